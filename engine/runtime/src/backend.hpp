// engine/runtime/src/backend.hpp — internal: where the engine's memory lives and how its forwards
// run.
//
// The engine talks to one EngineBackend (as ggml talks to a ggml_backend) instead of branching on
// kda::Backend: a host implementation (mmap'd memory, memcpy, kda::forward_cpu / decode_cpu) and a
// CUDA one. The CUDA implementation uses only kda's public device helpers (kda/kda.hpp), which
// exist in every build and return kBackendUnavailable without CUDA, so the engine compiles the same
// everywhere. Not installed (the public API stays kda::Backend); the build tree's tools (the case
// files of kda-run) reach it through the target kda_engine_internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kda/engine/model_spec.hpp"
#include "kda/kda.hpp"

namespace kda::engine {

struct BackendOptions {
  int cpu_threads = 0;         // host: forward threads; 0: all hardware threads
  void* stream = nullptr;      // CUDA: the stream everything is enqueued on; nullptr: default
  bool check_pointers = true;  // CUDA: check_caller_buffer() asks the driver; host: no effect
};

class EngineBackend {
 public:
  virtual ~EngineBackend() = default;

  virtual Backend kind() const noexcept = 0;
  void* stream() const noexcept { return stream_; }

  // Memory of this backend, aligned to at least 256 bytes; never nullptr (throws kda::Error naming
  // `what`). 0 bytes still gives a valid, distinct pointer.
  virtual void* alloc(std::size_t bytes, const std::string& what) = 0;
  // Gives back what alloc() returned (with the same byte count). Does not throw.
  virtual void free(void* ptr, std::size_t bytes) noexcept = 0;

  // Host -> backend memory: enqueued in stream order (`src` must stay valid until synchronize()).
  virtual void copy_to_device(void* dst, const void* src, std::size_t bytes) = 0;
  // Backend memory -> host: complete when it returns.
  virtual void copy_to_host(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void memset(void* dst, int value, std::size_t bytes) = 0;
  // Waits for everything enqueued; a no-op on the host.
  virtual void synchronize() = 0;

  // The operator on this backend. `cuda` carries the per-call options of the CUDA operator (ignored
  // on the host). In an NVTX phase range named after the call and the backend.
  virtual Status prefill(const Problem& p, const Tensors& t, Workspace ws,
                         const CudaOptions& cuda) const = 0;
  virtual Status decode(const DecodeProblem& p, const DecodeTensors& t, Workspace ws,
                        const CudaOptions& cuda) const = 0;
  // Segment transitions and their application (context parallelism, kda.hpp).
  virtual Status transition(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                            Workspace ws) const = 0;
  virtual Status apply_transition(std::int64_t pairs, std::int64_t head_dim_k,
                                  std::int64_t head_dim_v, const float* s_in, const float* p_t,
                                  const float* h_t, float* s_out) const = 0;

  // Slot copy and zeroing on this backend (kda.hpp): the engine checks its caller's arrays first,
  // and the pools are its own, so no pointer is checked here.
  virtual Status copy_slots(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                            const std::int32_t* src, const std::int32_t* dst,
                            std::uint32_t* device_status) const = 0;
  virtual Status zero_slots(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                            const std::int32_t* slots, std::uint32_t* device_status) const = 0;

  // Whether the kernels report through a device status word (CUDA), which the engine then plans
  // in its arena and checks with check_device_status(); the host reports at once instead.
  virtual bool has_device_status() const noexcept = 0;
  virtual Status clear_device_status(std::uint32_t* word) = 0;
  virtual Status check_device_status(const std::uint32_t* word) = 0;

  // Whether [ptr, ptr + bytes) is usable memory of this backend for a forward: device memory of the
  // current device on CUDA (when BackendOptions::check_pointers), always kOk on the host, where
  // a bad pointer cannot be told from a good one.
  virtual Status check_caller_buffer(const void* ptr, std::size_t bytes,
                                     const char* name) const = 0;
  // The same for every tensor a call names, each over the bytes its problem implies (the
  // operator's argument table: kda::check_device_pointers). The engine passes only its caller's
  // q, k, v, g, beta and out; the operator itself refuses overlaps before it writes anything.
  virtual Status check_caller_tensors(const Problem& p, const Tensors& t) const = 0;
  virtual Status check_caller_tensors(const DecodeProblem& p, const DecodeTensors& t) const = 0;
  // Every check prefill() makes of its call before it writes, without the driver's pointer queries
  // (host: validate(p, t); CUDA: kda::check_cuda_call, alignment and `cuda`'s fields too): for a
  // call that writes something of its own before the operator runs (a context-parallel prefill
  // moves the slot's state to its range's start first).
  virtual Status check_prefill(const Problem& p, const Tensors& t,
                               const CudaOptions& cuda) const = 0;

 protected:
  explicit EngineBackend(void* stream) : stream_(stream) {}

 private:
  void* stream_;
};

// The backend of `kind`. Throws kda::Error (kBackendUnavailable), its message starting with
// `where`, when CUDA is asked for and no device is present.
std::unique_ptr<EngineBackend> make_engine_backend(Backend kind, const BackendOptions& options,
                                                   const std::string& where);

// Whether an engine on `kind` plans a device status word (EngineBackend::has_device_status()),
// answered without a device, for plans made on machines that lack one.
bool backend_has_device_status(Backend kind) noexcept;

// kCpu / kCuda as asked; kAuto: CUDA when cuda_backend_available() and `why_cuda_cannot_run()`
// (what of the caller's problem the CUDA backend cannot run) is empty, else the CPU. `why`
// (optional) gets the reason in resolve_backend()'s words.
Backend choose_backend(BackendChoice choice,
                       const std::function<std::string()>& why_cuda_cannot_run, std::string* why);
// The same with a yes / no check of the problem.
Backend choose_backend(BackendChoice choice, const std::function<bool()>& cuda_can_run);

// One allocation of a backend, freed when it goes (after the backend's work on it is done: the
// owner synchronizes first where kernels may still use it).
class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(EngineBackend& backend, std::size_t bytes, const std::string& what)
      : backend_(&backend), bytes_(bytes), ptr_(backend.alloc(bytes, what)) {}
  ~BackendBuffer() { reset(); }
  BackendBuffer(BackendBuffer&& other) noexcept { *this = std::move(other); }
  BackendBuffer& operator=(BackendBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = other.backend_;
      bytes_ = other.bytes_;
      ptr_ = other.ptr_;
      other.ptr_ = nullptr;
    }
    return *this;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;

  std::uint8_t* get() const noexcept { return static_cast<std::uint8_t*>(ptr_); }
  std::size_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }
  void reset() noexcept {
    if (ptr_ != nullptr) backend_->free(ptr_, bytes_);
    ptr_ = nullptr;
  }

 private:
  EngineBackend* backend_ = nullptr;
  std::size_t bytes_ = 0;
  void* ptr_ = nullptr;
};

}  // namespace kda::engine
