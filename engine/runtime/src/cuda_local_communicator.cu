// engine/runtime/src/cuda_local_communicator.cu — the in-process CUDA communicator
// (communicator.hpp, make_cuda_local_communicators): ranks as threads, each on its own stream.
//
// The host threads meet at a rendezvous (rendezvous.hpp) only to exchange pointers and events;
// the device work of a collective is enqueued on each rank's stream and ordered by events:
//   1. each rank records `ready` on its stream (its buffer is written) and posts its arguments;
//      barrier; every rank checks every rank's arguments (so that all throw alike);
//   2. each stream waits for every other rank's `ready`, then reads all buffers: the all-reduce
//      sums them into scratch of its own (the others may still be reading its buffer), the
//      all-gather copies them into recv; it records `done` (its reads are enqueued before it);
//      barrier;
//   3. each stream waits for every other rank's `done`: nobody reads its buffer any more, so the
//      all-reduce copies its scratch in place, and the caller may write its buffers after.
// An event is re-recorded only after a barrier that every rank passes after its waits on it, so
// no wait ever sees a later record than the one it means. Every wait is on work already enqueued
// that waits on nothing later: the ordering cannot deadlock, whatever else the streams hold.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "kda/engine/communicator.hpp"
#include "kda/error.hpp"
#include "rendezvous.hpp"

namespace kda::engine {

namespace {

constexpr int kMaxRanks = 64;  // the kernel takes every rank's pointer as a parameter

struct Buffers {
  const void* at[kMaxRanks];
};

// kda/bf16.hpp's conversions, on the device: the same bits as the CPU communicator's.
__device__ inline float bf16_to_float(std::uint16_t b) {
  return __uint_as_float(std::uint32_t(b) << 16);
}

__device__ inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<std::uint16_t>(u >> 16);
}

// out[i] = the sum over ranks of in.at[r][i], in fp32 from 0 in rank order, rounded once to the
// output's type: the CPU communicator's loop, element for element (adds only, so no contraction).
template <bool kBf16>
__global__ void sum_in_rank_order(Buffers in, int ranks, void* out, std::size_t count) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float sum = 0.0f;
    for (int r = 0; r < ranks; ++r) {
      const float x = kBf16 ? bf16_to_float(static_cast<const std::uint16_t*>(in.at[r])[i])
                            : static_cast<const float*>(in.at[r])[i];
      sum = __fadd_rn(sum, x);
    }
    if (kBf16) {
      static_cast<std::uint16_t*>(out)[i] = float_to_bf16(sum);
    } else {
      static_cast<float*>(out)[i] = sum;
    }
  }
}

std::string cuda_message(const char* call, cudaError_t err) {
  return std::string(call) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// Makes `device` current for a scope and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) err_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0 && err_ == cudaSuccess) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return err_; }

 private:
  int previous_ = -1;
  cudaError_t err_ = cudaSuccess;
};

enum class Op { kAllReduce, kAllGather };

// One rank's arguments of the collective in progress.
struct Posted {
  Op op = Op::kAllReduce;
  DType dtype = DType::kF32;
  std::size_t count = 0;  // elements (all-reduce) or bytes (all-gather)
  const void* buffer = nullptr;
  std::string problem;  // what this rank found wrong before any device work; empty: nothing
};

struct Group {
  explicit Group(int ranks)
      : rendezvous(ranks),
        devices(static_cast<std::size_t>(ranks)),
        ready(static_cast<std::size_t>(ranks)),
        done(static_cast<std::size_t>(ranks)),
        failed(static_cast<std::size_t>(ranks)) {}
  ~Group() {
    for (std::size_t r = 0; r < devices.size(); ++r) {
      DeviceScope scope(devices[r]);
      if (ready[r] != nullptr) cudaEventDestroy(ready[r]);
      if (done[r] != nullptr) cudaEventDestroy(done[r]);
    }
  }
  Rendezvous<Posted> rendezvous;
  std::vector<int> devices;
  std::vector<cudaEvent_t> ready;  // rank r's buffer is written (recorded on its stream)
  std::vector<cudaEvent_t> done;   // rank r's reads of the others' buffers are enqueued before it
  // A rank's CUDA error in step 2, written before the second barrier and read after it by all.
  std::vector<std::string> failed;
};

const char* op_name(Op op) { return op == Op::kAllReduce ? "all_reduce_sum" : "all_gather"; }

class CudaLocalCommunicator final : public Communicator {
 public:
  CudaLocalCommunicator(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  ~CudaLocalCommunicator() override {
    if (scratch_ != nullptr) {
      DeviceScope scope(device());
      cudaFree(scratch_);  // waits for the stream-ordered frees and uses before it
    }
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return group_->rendezvous.size; }
  Backend backend() const noexcept override { return Backend::kCuda; }
  void abort() noexcept override { group_->rendezvous.abort(); }

  void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) override {
    Posted mine;
    mine.op = Op::kAllReduce;
    mine.dtype = dtype;
    mine.count = count;
    mine.buffer = data;
    if (dtype != DType::kBF16 && dtype != DType::kF32) {
      mine.problem =
          std::string("all_reduce_sum of ") + to_string(dtype) + " (it sums bf16 and f32)";
    }
    const std::size_t bytes = count * (dtype == DType::kBF16 ? 2 : 4);
    collective(
        mine, stream,
        [&](cudaStream_t s) -> std::string {
          if (scratch_bytes_ < bytes) {  // grows to the largest call, in stream order: no host wait
            if (scratch_ != nullptr) {
              // The free is ordered on s only: a use on another stream may still read it.
              if (scratch_stream_ != s) {
                if (const cudaError_t err = cudaStreamSynchronize(scratch_stream_);
                    err != cudaSuccess) {
                  return cuda_message("cudaStreamSynchronize", err);
                }
              }
              const cudaError_t err = cudaFreeAsync(scratch_, s);
              scratch_ = nullptr;
              scratch_bytes_ = 0;
              if (err != cudaSuccess) return cuda_message("cudaFreeAsync", err);
            }
            if (const cudaError_t err = cudaMallocAsync(&scratch_, bytes, s); err != cudaSuccess) {
              scratch_ = nullptr;
              return cuda_message("cudaMallocAsync", err);
            }
            scratch_bytes_ = bytes;
          }
          scratch_stream_ = s;
          Buffers in{};
          for (int r = 0; r < size(); ++r) in.at[r] = posted(r).buffer;
          const unsigned blocks =
              static_cast<unsigned>(std::min<std::size_t>((count + 255) / 256, 1024));
          if (dtype == DType::kBF16) {
            sum_in_rank_order<true><<<blocks, 256, 0, s>>>(in, size(), scratch_, count);
          } else {
            sum_in_rank_order<false><<<blocks, 256, 0, s>>>(in, size(), scratch_, count);
          }
          const cudaError_t err = cudaGetLastError();
          return err == cudaSuccess ? std::string() : cuda_message("sum kernel launch", err);
        },
        [&](cudaStream_t s) -> std::string {
          const cudaError_t err =
              cudaMemcpyAsync(data, scratch_, bytes, cudaMemcpyDeviceToDevice, s);
          return err == cudaSuccess ? std::string() : cuda_message("cudaMemcpyAsync", err);
        });
  }

  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    Posted mine;
    mine.op = Op::kAllGather;
    mine.dtype = DType::kBF16;  // unused: all_gather moves bytes
    mine.count = bytes;
    mine.buffer = send;
    if (bytes > 0 && recv == nullptr) mine.problem = "all_gather into a null recv";
    collective(
        mine, stream,
        [&](cudaStream_t s) -> std::string {
          for (int r = 0; r < size(); ++r) {
            void* to = static_cast<unsigned char*>(recv) + static_cast<std::size_t>(r) * bytes;
            if (to == posted(r).buffer) continue;  // in place: send is recv's own range
            // cudaMemcpyDefault: the address tells the device (a peer's, over peer access).
            if (const cudaError_t err =
                    cudaMemcpyAsync(to, posted(r).buffer, bytes, cudaMemcpyDefault, s);
                err != cudaSuccess) {
              return cuda_message("cudaMemcpyAsync", err);
            }
          }
          return std::string();
        },
        [](cudaStream_t) { return std::string(); });
  }

 private:
  int device() const { return group_->devices[static_cast<std::size_t>(rank_)]; }
  const Posted& posted(int r) const {
    return group_->rendezvous.posted[static_cast<std::size_t>(r)];
  }

  [[noreturn]] void fail(StatusCode code, const std::string& what) const {
    throw Error(code, "cuda local communicator: rank " + std::to_string(rank_) + ": " + what);
  }

  // The three steps of every collective (file comment): `read` enqueues step 2's reads of the
  // posted buffers, `write` step 3's writes of this rank's own; each returns a CUDA error's text.
  template <class Read, class Write>
  void collective(Posted mine, void* stream_arg, Read read, Write write) {
    Group& g = *group_;
    const auto stream = static_cast<cudaStream_t>(stream_arg);
    const auto me = static_cast<std::size_t>(rank_);
    DeviceScope scope(device());
    if (mine.problem.empty() && scope.error() != cudaSuccess) {
      mine.problem = cuda_message("cudaSetDevice", scope.error());
    }
    if (mine.problem.empty() && mine.count > 0 && mine.buffer == nullptr) {
      mine.problem = std::string(op_name(mine.op)) + " of a null buffer";
    }
    if (mine.problem.empty()) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      if (const cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess) {
        mine.problem = cuda_message("cudaStreamIsCapturing", err);
      } else if (capture != cudaStreamCaptureStatusNone) {
        mine.problem = std::string(op_name(mine.op)) +
                       " on a capturing stream (this transport orders the ranks' streams with "
                       "events, which a graph of one rank cannot hold)";
      }
    }
    if (mine.problem.empty()) {
      if (const cudaError_t err = cudaEventRecord(g.ready[me], stream); err != cudaSuccess) {
        mine.problem = cuda_message("cudaEventRecord", err);
      }
    }
    g.rendezvous.post(rank_, mine);
    // Step 1's check, the same on every rank: they all read the same posted arguments.
    std::string wrong;
    for (int r = 0; r < size() && wrong.empty(); ++r) {
      const Posted& p = posted(r);
      if (!p.problem.empty()) {
        wrong = "rank " + std::to_string(r) + ": " + p.problem;
      } else if (p.op != posted(0).op || p.count != posted(0).count ||
                 (p.op == Op::kAllReduce && p.dtype != posted(0).dtype)) {
        auto what = [](const Posted& x) {
          return std::string(op_name(x.op)) + " of " + std::to_string(x.count) +
                 (x.op == Op::kAllReduce ? std::string(" ") + to_string(x.dtype) : " bytes");
        };
        wrong = "ranks disagree: rank 0 calls " + what(posted(0)) + ", rank " + std::to_string(r) +
                " " + what(p);
      }
    }
    if (!wrong.empty()) {
      g.rendezvous.barrier();  // every rank has read the posted arguments
      throw Error(StatusCode::kInvalidArgument, "cuda local communicator: " + wrong);
    }
    // Step 2.
    std::string error;
    if (mine.count > 0) {
      for (int r = 0; r < size() && error.empty(); ++r) {
        if (r == rank_) continue;
        if (const cudaError_t err =
                cudaStreamWaitEvent(stream, g.ready[static_cast<std::size_t>(r)], 0);
            err != cudaSuccess) {
          error = cuda_message("cudaStreamWaitEvent", err);
        }
      }
      if (error.empty()) error = read(stream);
      if (error.empty()) {
        if (const cudaError_t err = cudaEventRecord(g.done[me], stream); err != cudaSuccess) {
          error = cuda_message("cudaEventRecord", err);
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(g.rendezvous.mutex);
      g.failed[me] = error;
    }
    g.rendezvous.barrier();  // every rank's reads are enqueued, its `done` recorded
    for (int r = 0; r < size(); ++r) {
      const std::string& f = g.failed[static_cast<std::size_t>(r)];
      if (!f.empty()) {
        // The group is broken (some rank's stream may never run its reads): nothing more is
        // enqueued here. Every rank throws, the rank that failed named.
        throw Error(StatusCode::kCudaError,
                    "cuda local communicator: rank " + std::to_string(r) + ": " + f);
      }
    }
    if (mine.count == 0) return;
    // Step 3.
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      if (const cudaError_t err =
              cudaStreamWaitEvent(stream, g.done[static_cast<std::size_t>(r)], 0);
          err != cudaSuccess) {
        fail(StatusCode::kCudaError, cuda_message("cudaStreamWaitEvent", err));
      }
    }
    if (const std::string e = write(stream); !e.empty()) fail(StatusCode::kCudaError, e);
  }

  std::shared_ptr<Group> group_;
  int rank_;
  void* scratch_ = nullptr;  // this rank's all-reduce result before it is copied in place
  std::size_t scratch_bytes_ = 0;
  cudaStream_t scratch_stream_ = nullptr;  // the stream of its last use
};

[[noreturn]] void factory_fail(StatusCode code, const std::string& what) {
  throw Error(code, "make_cuda_local_communicators: " + what);
}

void factory_check(const char* call, cudaError_t err) {
  if (err != cudaSuccess) factory_fail(StatusCode::kCudaError, cuda_message(call, err));
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_cuda_local_communicators(
    int ranks, const std::vector<int>& devices) {
  if (ranks < 1 || ranks > kMaxRanks) {
    factory_fail(
        StatusCode::kInvalidArgument,
        "ranks " + std::to_string(ranks) + " is not in [1, " + std::to_string(kMaxRanks) + "]");
  }
  if (!devices.empty() && devices.size() != static_cast<std::size_t>(ranks)) {
    factory_fail(StatusCode::kInvalidArgument,
                 std::to_string(devices.size()) + " devices for " + std::to_string(ranks) +
                     " ranks (give one per rank, or none: all on the current device)");
  }
  int count = 0;
  factory_check("cudaGetDeviceCount", cudaGetDeviceCount(&count));
  auto group = std::make_shared<Group>(ranks);
  if (devices.empty()) {
    int current = 0;
    factory_check("cudaGetDevice", cudaGetDevice(&current));
    std::fill(group->devices.begin(), group->devices.end(), current);
  } else {
    for (int r = 0; r < ranks; ++r) {
      const int d = devices[static_cast<std::size_t>(r)];
      if (d < 0 || d >= count) {
        factory_fail(StatusCode::kInvalidArgument, "rank " + std::to_string(r) + "'s device " +
                                                       std::to_string(d) + " is not in [0, " +
                                                       std::to_string(count) + ")");
      }
      group->devices[static_cast<std::size_t>(r)] = d;
    }
  }
  // Every rank's kernel reads every other rank's buffer: distinct devices need peer access.
  std::vector<int> distinct = group->devices;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  for (const int a : distinct) {
    for (const int b : distinct) {
      if (a == b) continue;
      int can = 0;
      factory_check("cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&can, a, b));
      if (can == 0) {
        factory_fail(
            StatusCode::kUnsupported,
            "device " + std::to_string(a) + " has no peer access to device " + std::to_string(b));
      }
      DeviceScope scope(a);
      factory_check("cudaSetDevice", scope.error());
      const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // enabled before (by this group or the host): fine, and not sticky
      } else {
        factory_check("cudaDeviceEnablePeerAccess", err);
      }
    }
  }
  for (std::size_t r = 0; r < group->devices.size(); ++r) {
    DeviceScope scope(group->devices[r]);  // an event belongs to the device current at creation
    factory_check("cudaSetDevice", scope.error());
    factory_check("cudaEventCreateWithFlags",
                  cudaEventCreateWithFlags(&group->ready[r], cudaEventDisableTiming));
    factory_check("cudaEventCreateWithFlags",
                  cudaEventCreateWithFlags(&group->done[r], cudaEventDisableTiming));
  }
  std::vector<std::unique_ptr<Communicator>> communicators;
  for (int r = 0; r < ranks; ++r)
    communicators.push_back(std::make_unique<CudaLocalCommunicator>(group, r));
  return communicators;
}

}  // namespace kda::engine
