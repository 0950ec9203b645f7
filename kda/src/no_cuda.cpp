// The CUDA entry points of a build without the CUDA backend: each validates its arguments (so that
// callers get the same diagnostics everywhere), then reports kBackendUnavailable.
#include "argument_table.hpp"
#include "kda/kda.hpp"
#include "transition.hpp"

namespace kda {
namespace {
Status unavailable() {
  return Status(StatusCode::kBackendUnavailable, "the CUDA backend is not compiled in");
}
}  // namespace

Status forward_cuda(const Problem& p, const Tensors& t, Workspace, void*, const CudaOptions&) {
  if (Status st = validate(p, t); !st) return st;
  return unavailable();
}

Status decode_cuda(const DecodeProblem& p, const DecodeTensors& t, void*, const CudaOptions&) {
  if (Status st = validate(p, t); !st) return st;
  return unavailable();
}

Status commit_cuda(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                   const std::int32_t* slots, const std::int32_t* num_accepted, std::uint32_t*,
                   void*, const CudaOptions&) {
  if (Status st = validate(p, layers, num_layers, slots, num_accepted); !st) return st;
  return unavailable();
}

Status copy_slots_cuda(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                       const std::int32_t* src, const std::int32_t* dst, std::uint32_t*, void*,
                       const CudaOptions&) {
  if (Status st = validate(p, pools, num_pools, src, dst); !st) return st;
  return unavailable();
}

Status zero_slots_cuda(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                       const std::int32_t* slots, std::uint32_t*, void*, const CudaOptions&) {
  if (Status st = validate(p, pools, num_pools, slots); !st) return st;
  return unavailable();
}

Status segment_transition_cuda(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                               Workspace, void*, const CudaOptions&) {
  if (Status st = detail::validate_transition(p, t, p_t, h_t); !st) return st;
  return unavailable();
}

Status apply_transition_cuda(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                             const float* s_in, const float* p_t, const float* h_t, float* s_out,
                             void*) {
  if (Status st = validate_apply_transition(pairs, head_dim_k, head_dim_v, s_in, p_t, h_t, s_out);
      !st) {
    return st;
  }
  return unavailable();
}

bool cuda_compiled() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
Status device_malloc(void** ptr, std::size_t) {
  if (ptr != nullptr) *ptr = nullptr;
  return unavailable();
}
Status device_free(void*) { return unavailable(); }
Status memcpy_to_device(void*, const void*, std::size_t, void*) { return unavailable(); }
Status memcpy_to_host(void*, const void*, std::size_t, void*) { return unavailable(); }
Status memset_device(void*, int, std::size_t, void*) { return unavailable(); }
Status stream_synchronize(void*) { return unavailable(); }
std::string device_name(int) { return "none"; }
Status cuda_device_supported() { return unavailable(); }
Status check_device_pointer(const void*, std::size_t, const char*) { return unavailable(); }
Status check_device_status(const std::uint32_t*, void*) { return unavailable(); }
Status clear_device_status(std::uint32_t*, void*) { return unavailable(); }

namespace detail {
Status check_device_arguments(const ArgumentTable&) { return unavailable(); }
}  // namespace detail

}  // namespace kda
