// engine/runtime/src/backend.cpp — the host and CUDA implementations of EngineBackend.
#include "backend.hpp"

#include <sys/mman.h>

#include <cstring>

#include "kda/engine/engine.hpp"
#include "kda/error.hpp"
#include "kda/nvtx.hpp"

namespace kda::engine {

namespace {

// Host memory and kda::forward_cpu / decode_cpu.
class HostBackend final : public EngineBackend {
 public:
  explicit HostBackend(const BackendOptions& options) : EngineBackend(nullptr) {
    cpu_.num_threads = options.cpu_threads;
  }
  Backend kind() const noexcept override { return Backend::kCpu; }

  void* alloc(std::size_t bytes, const std::string& what) override {
    // Pages straight from the kernel (page-aligned, beyond any plan alignment): a destroyed engine
    // gives its arena back to the system at once, whatever malloc's thresholds would do.
    void* ptr = mmap(nullptr, mapped_length(bytes), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      throw Error(StatusCode::kOutOfMemory,
                  "cannot allocate " + what + " (" + std::to_string(bytes) + " bytes)");
    }
    return ptr;
  }
  void free(void* ptr, std::size_t bytes) noexcept override {
    if (ptr != nullptr) (void)munmap(ptr, mapped_length(bytes));
  }

  void copy_to_device(void* dst, const void* src, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
  }
  void memset(void* dst, int value, std::size_t bytes) override {
    if (bytes != 0) std::memset(dst, value, bytes);
  }
  void synchronize() override {}

  Status prefill(const Problem& p, const Tensors& t, Workspace ws,
                 const CudaOptions&) const override {
    KDA_NVTX_RANGE("prefill.forward_cpu");
    return forward_cpu(p, t, ws, cpu_);
  }
  Status decode(const DecodeProblem& p, const DecodeTensors& t, Workspace ws,
                const CudaOptions&) const override {
    KDA_NVTX_RANGE("decode.step_cpu");
    return decode_cpu(p, t, ws, cpu_);
  }
  Status transition(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                    Workspace ws) const override {
    KDA_NVTX_RANGE("prefill.transition_cpu");
    return segment_transition_cpu(p, t, p_t, h_t, ws, cpu_);
  }
  Status apply_transition(std::int64_t pairs, std::int64_t k, std::int64_t v, const float* s_in,
                          const float* p_t, const float* h_t, float* s_out) const override {
    return apply_transition_cpu(pairs, k, v, s_in, p_t, h_t, s_out);
  }
  Status copy_slots(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                    const std::int32_t* src, const std::int32_t* dst,
                    std::uint32_t*) const override {
    KDA_NVTX_RANGE("slots.copy_cpu");
    return copy_slots_cpu(p, pools, num_pools, src, dst);
  }
  Status zero_slots(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                    const std::int32_t* slots, std::uint32_t*) const override {
    KDA_NVTX_RANGE("slots.zero_cpu");
    return zero_slots_cpu(p, pools, num_pools, slots);
  }

  bool has_device_status() const noexcept override { return false; }
  Status clear_device_status(std::uint32_t*) override { return Status(); }
  Status check_device_status(const std::uint32_t*) override { return Status(); }
  Status check_caller_buffer(const void*, std::size_t, const char*) const override {
    return Status();
  }
  Status check_caller_tensors(const Problem&, const Tensors&) const override { return Status(); }
  Status check_caller_tensors(const DecodeProblem&, const DecodeTensors&) const override {
    return Status();
  }
  Status check_prefill(const Problem& p, const Tensors& t, const CudaOptions&) const override {
    return validate(p, t);
  }

 private:
  static std::size_t mapped_length(std::size_t bytes) { return bytes == 0 ? 1 : bytes; }
  CpuOptions cpu_;
};

// Device memory on one stream, through kda's device helpers only.
class CudaBackend final : public EngineBackend {
 public:
  explicit CudaBackend(const BackendOptions& options)
      : EngineBackend(options.stream), check_pointers_(options.check_pointers) {}
  Backend kind() const noexcept override { return Backend::kCuda; }

  void* alloc(std::size_t bytes, const std::string& what) override {
    void* ptr = nullptr;
    throw_if_error(device_malloc(&ptr, bytes == 0 ? 256 : bytes),
                   ("allocating " + what + " (" + std::to_string(bytes) + " bytes)").c_str());
    return ptr;
  }
  void free(void* ptr, std::size_t) noexcept override {
    if (ptr != nullptr) (void)device_free(ptr);  // nothing useful to do with a failure here
  }

  void copy_to_device(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    throw_if_error(memcpy_to_device(dst, src, bytes, stream()), "copying to the device");
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    if (bytes != 0) {
      throw_if_error(memcpy_to_host(dst, src, bytes, stream()), "copying to the host");
    }
    synchronize();
  }
  void memset(void* dst, int value, std::size_t bytes) override {
    if (bytes == 0) return;
    throw_if_error(memset_device(dst, value, bytes, stream()), "setting device memory");
  }
  void synchronize() override { throw_if_error(stream_synchronize(stream()), "synchronizing"); }

  Status prefill(const Problem& p, const Tensors& t, Workspace ws,
                 const CudaOptions& cuda) const override {
    KDA_NVTX_RANGE("prefill.forward_cuda");
    return forward_cuda(p, t, ws, stream(), cuda);
  }
  Status decode(const DecodeProblem& p, const DecodeTensors& t, Workspace,
                const CudaOptions& cuda) const override {
    KDA_NVTX_RANGE("decode.step_cuda");
    return decode_cuda(p, t, stream(), cuda);
  }
  Status transition(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                    Workspace ws) const override {
    KDA_NVTX_RANGE("prefill.transition_cuda");
    CudaOptions unchecked;  // the engine checks its callers' tensors itself
    unchecked.check_pointers = false;
    return segment_transition_cuda(p, t, p_t, h_t, ws, stream(), unchecked);
  }
  Status apply_transition(std::int64_t pairs, std::int64_t k, std::int64_t v, const float* s_in,
                          const float* p_t, const float* h_t, float* s_out) const override {
    return apply_transition_cuda(pairs, k, v, s_in, p_t, h_t, s_out, stream());
  }
  Status copy_slots(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                    const std::int32_t* src, const std::int32_t* dst,
                    std::uint32_t* device_status) const override {
    KDA_NVTX_RANGE("slots.copy_cuda");
    CudaOptions unchecked;
    unchecked.check_pointers = false;
    return copy_slots_cuda(p, pools, num_pools, src, dst, device_status, stream(), unchecked);
  }
  Status zero_slots(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                    const std::int32_t* slots, std::uint32_t* device_status) const override {
    KDA_NVTX_RANGE("slots.zero_cuda");
    CudaOptions unchecked;
    unchecked.check_pointers = false;
    return zero_slots_cuda(p, pools, num_pools, slots, device_status, stream(), unchecked);
  }

  bool has_device_status() const noexcept override { return true; }
  Status clear_device_status(std::uint32_t* word) override {
    return kda::clear_device_status(word, stream());
  }
  Status check_device_status(const std::uint32_t* word) override {
    return kda::check_device_status(word, stream());
  }
  Status check_caller_buffer(const void* ptr, std::size_t bytes, const char* name) const override {
    return check_pointers_ ? check_device_pointer(ptr, bytes, name) : Status();
  }
  Status check_caller_tensors(const Problem& p, const Tensors& t) const override {
    return check_pointers_ ? check_device_pointers(p, t) : Status();
  }
  Status check_caller_tensors(const DecodeProblem& p, const DecodeTensors& t) const override {
    return check_pointers_ ? check_device_pointers(p, t) : Status();
  }
  Status check_prefill(const Problem& p, const Tensors& t, const CudaOptions& cuda) const override {
    return check_cuda_call(p, t, cuda);
  }

 private:
  bool check_pointers_;
};

}  // namespace

std::unique_ptr<EngineBackend> make_engine_backend(Backend kind, const BackendOptions& options,
                                                   const std::string& where) {
  if (kind == Backend::kCpu) return std::make_unique<HostBackend>(options);
  if (cuda_device_count() == 0) {
    throw Error(StatusCode::kBackendUnavailable,
                where + ": no CUDA device" +
                    (cuda_compiled() ? std::string() : std::string(" (built without CUDA)")));
  }
  return std::make_unique<CudaBackend>(options);
}

bool backend_has_device_status(Backend kind) noexcept { return kind == Backend::kCuda; }

bool cuda_backend_available(std::string* why_not) {
  std::string reason;
  if (!cuda_compiled()) {
    reason = "this build has no CUDA backend";
  } else if (cuda_device_count() <= 0) {
    reason = "no CUDA device found";
  } else if (const Status st = cuda_device_supported(); !st.ok()) {
    reason = st.message();  // names the device and its compute capability
  }
  if (why_not != nullptr) *why_not = reason;
  return reason.empty();
}

Backend choose_backend(BackendChoice choice,
                       const std::function<std::string()>& why_cuda_cannot_run, std::string* why) {
  std::string reason = "asked for";
  Backend backend = choice == BackendChoice::kCuda ? Backend::kCuda : Backend::kCpu;
  if (choice == BackendChoice::kAuto) {
    // The machine first, then the problem: the problem's obstacle only matters where CUDA runs.
    if (cuda_backend_available(&reason)) reason = why_cuda_cannot_run();
    if (reason.empty()) {
      backend = Backend::kCuda;
      reason = "a CUDA device can run it";
    }
  }
  if (why != nullptr) *why = reason;
  return backend;
}

Backend choose_backend(BackendChoice choice, const std::function<bool()>& cuda_can_run) {
  return choose_backend(
      choice,
      [&cuda_can_run] {
        return cuda_can_run() ? std::string() : std::string("the CUDA backend cannot run it");
      },
      nullptr);
}

}  // namespace kda::engine
