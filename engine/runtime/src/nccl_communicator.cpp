// engine/runtime/src/nccl_communicator.cpp — the NCCL transport of communicator.hpp, built only
// when CMake finds NCCL (KDA_NCCL). Each collective is one NCCL call on the caller's stream, so it
// is asynchronous and graph-capturable exactly as NCCL's own are; the communicator adds nothing
// but the dtype mapping and errors as kda::Error.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>

#include "kda/engine/communicator.hpp"
#include "kda/error.hpp"

static_assert(sizeof(kda::engine::NcclUniqueId::bytes) == NCCL_UNIQUE_ID_BYTES,
              "NcclUniqueId must hold NCCL's ncclUniqueId");

namespace kda::engine {

namespace {

[[noreturn]] void nccl_fail(const std::string& what, ncclResult_t result) {
  throw Error(StatusCode::kCudaError, what + ": " + ncclGetErrorString(result) + " (ncclResult_t " +
                                          std::to_string(static_cast<int>(result)) + ")");
}

void nccl_check(const std::string& what, ncclResult_t result) {
  if (result != ncclSuccess) nccl_fail(what, result);
}

void cuda_check(const std::string& what, cudaError_t err) {
  if (err != cudaSuccess) {
    throw Error(StatusCode::kCudaError,
                what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Makes `device` current for a scope (NCCL enqueues on the current device) and restores the
// caller's.
class DeviceScope {
 public:
  DeviceScope(int device, const std::string& what) {
    cuda_check(what + ": cudaGetDevice", cudaGetDevice(&previous_));
    if (previous_ != device) {
      cuda_check(what + ": cudaSetDevice", cudaSetDevice(device));
      restore_ = true;
    }
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owned) : comm_(comm), owned_(owned) {
    if (comm == nullptr) {
      throw Error(StatusCode::kInvalidArgument, "make_nccl_communicator: a null ncclComm_t");
    }
    try {
      nccl_check("make_nccl_communicator: ncclCommUserRank", ncclCommUserRank(comm, &rank_));
      nccl_check("make_nccl_communicator: ncclCommCount", ncclCommCount(comm, &size_));
      nccl_check("make_nccl_communicator: ncclCommCuDevice", ncclCommCuDevice(comm, &device_));
    } catch (...) {
      if (owned_) ncclCommDestroy(comm_);
      throw;
    }
  }
  ~NcclCommunicator() override {
    if (owned_) ncclCommDestroy(comm_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  Backend backend() const noexcept override { return Backend::kCuda; }

  void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) override {
    ncclDataType_t type = ncclFloat32;
    if (dtype == DType::kBF16) {
      type = ncclBfloat16;
    } else if (dtype != DType::kF32) {
      // Only this rank knows: the others, already in the collective, wait for it (as NCCL's own
      // misuse does). The engine only ever passes bf16 and f32.
      throw Error(StatusCode::kInvalidArgument,
                  std::string("nccl communicator: all_reduce_sum of ") + to_string(dtype) +
                      " (it sums bf16 and f32)");
    }
    const std::string what = "nccl communicator: rank " + std::to_string(rank_) + " ncclAllReduce";
    DeviceScope scope(device_, what);
    nccl_check(what, ncclAllReduce(data, data, count, type, ncclSum, comm_,
                                   static_cast<cudaStream_t>(stream)));
  }

  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    const std::string what = "nccl communicator: rank " + std::to_string(rank_) + " ncclAllGather";
    DeviceScope scope(device_, what);
    nccl_check(what, ncclAllGather(send, recv, bytes, ncclUint8, comm_,
                                   static_cast<cudaStream_t>(stream)));
  }

 private:
  ncclComm_t comm_;
  bool owned_;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
};

}  // namespace

bool nccl_compiled() noexcept { return true; }

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  nccl_check("nccl_unique_id: ncclGetUniqueId", ncclGetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.bytes, id.internal, sizeof out.bytes);
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm* comm, bool owned) {
  return std::make_unique<NcclCommunicator>(comm, owned);
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int ranks, int rank,
                                                     int device) {
  const std::string what = "make_nccl_communicator";
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw Error(StatusCode::kInvalidArgument,
                what + ": rank " + std::to_string(rank) + " of " + std::to_string(ranks));
  }
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.bytes, sizeof uid.internal);
  DeviceScope scope(device, what);  // ncclCommInitRank binds the current device
  ncclComm_t comm = nullptr;
  nccl_check(what + ": ncclCommInitRank", ncclCommInitRank(&comm, ranks, uid, rank));
  return std::make_unique<NcclCommunicator>(comm, true);
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(
    const std::vector<int>& devices) {
  const std::string what = "make_nccl_communicators";
  if (devices.empty()) throw Error(StatusCode::kInvalidArgument, what + ": no devices");
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  nccl_check(what + ": ncclCommInitAll",
             ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
  std::vector<std::unique_ptr<Communicator>> out;
  std::size_t next = 0;
  try {
    for (; next < comms.size(); ++next)
      out.push_back(std::make_unique<NcclCommunicator>(comms[next], true));
  } catch (...) {
    // The communicator that threw destroyed its own; the ones not yet wrapped are destroyed here.
    for (std::size_t i = next + 1; i < comms.size(); ++i) ncclCommDestroy(comms[i]);
    throw;
  }
  return out;
}

}  // namespace kda::engine
