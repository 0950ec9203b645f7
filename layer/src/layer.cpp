// layer/src/layer.cpp — the layer's public entry points: the one place that picks a backend.
#include "kda/layer/layer.hpp"

#include <string>

#include "backends.hpp"
#include "kda/error.hpp"

namespace kda::layer {

namespace {

[[noreturn]] void unknown_backend(Backend backend) {
  throw Error(StatusCode::kInvalidArgument, "KDA layer: backend " +
                                                std::to_string(static_cast<int>(backend)) +
                                                " is neither kCpu nor kCuda");
}

}  // namespace

Problem core_prefill_problem(const Config& c, std::int64_t tokens, std::int64_t sequences,
                             std::int64_t num_state_slots, DType state_dtype) {
  Problem p;
  p.batch = 1;
  p.seq_len = tokens;
  p.num_heads = c.local_heads();
  p.head_dim_k = p.head_dim_v = c.head_dim;
  p.num_seqs = sequences;
  p.cu_seqlens_dtype = DType::kI64;
  p.gate = c.gate;
  p.lower_bound = c.lower_bound;
  p.initial_state_dtype = p.final_state_dtype = state_dtype;
  p.num_state_slots = num_state_slots;
  return p;
}

DecodeProblem core_decode_problem(const Config& c, std::int64_t rows, std::int64_t tokens,
                                  std::int64_t num_slots, DType state_dtype) {
  DecodeProblem p;
  p.batch = rows;
  p.tokens = tokens;
  p.num_heads = c.local_heads();
  p.head_dim_k = p.head_dim_v = c.head_dim;
  p.num_slots = num_slots;
  p.state_dtype = state_dtype;
  p.gate = c.gate;
  p.lower_bound = c.lower_bound;
  return p;
}

Status can_implement(Backend backend, const Config& config) {
  try {
    validate(config);
  } catch (const Error& e) {
    return Status(e.code(), e.what());
  }
  switch (backend) {
    case Backend::kCpu:
      return Status::Ok();
    case Backend::kCuda:
      return detail::cuda_can_implement(config);
  }
  return Status(StatusCode::kInvalidArgument, "KDA layer: unknown backend");
}

std::size_t workspace_bytes(Backend backend, const Config& config, std::int64_t tokens,
                            std::int64_t sequences, std::int64_t num_slots) {
  switch (backend) {
    case Backend::kCpu:
      return detail::cpu_workspace_bytes(config, tokens, sequences, num_slots);
    case Backend::kCuda:
      return detail::cuda_workspace_bytes(config, tokens, sequences, num_slots);
  }
  unknown_backend(backend);
}

std::size_t weight_image_bytes(Backend backend, const Config& config) {
  switch (backend) {
    case Backend::kCpu:
      return detail::cpu_weight_image_bytes(config);
    case Backend::kCuda:
      return detail::cuda_weight_image_bytes(config);
  }
  unknown_backend(backend);
}

std::size_t weight_image_alignment(Backend backend) noexcept {
  return backend == Backend::kCuda ? detail::kCudaWeightImageAlignment
                                   : detail::kCpuWeightImageAlignment;
}

std::unique_ptr<Layer> make_layer(Backend backend, const Weights& weights, void* weight_image,
                                  std::size_t bytes) {
  switch (backend) {
    case Backend::kCpu:
      return detail::make_cpu_layer(weights, weight_image, bytes);
    case Backend::kCuda:
      return detail::make_cuda_layer(weights, weight_image, bytes);
  }
  unknown_backend(backend);
}

std::unique_ptr<Layer> make_layer(Backend backend, const Weights& weights) {
  switch (backend) {
    case Backend::kCpu:
      return detail::make_cpu_layer(weights);
    case Backend::kCuda:
      return detail::make_cuda_layer(weights);
  }
  unknown_backend(backend);
}

namespace {
constexpr const char* kDecodeKernelNames[] = {"auto", "fused", "fused-after-gemms", "separate",
                                              "one-launch"};
}  // namespace

const char* to_string(DecodeKernel kernel) noexcept {
  return is_known(kernel) ? kDecodeKernelNames[static_cast<int>(kernel)] : "unknown";
}

bool parse_decode_kernel(const std::string& text, DecodeKernel* kernel) noexcept {
  if (kernel == nullptr) return false;
  for (int k = 0; k <= static_cast<int>(DecodeKernel::kOneLaunch); ++k) {
    if (text == kDecodeKernelNames[k]) {
      *kernel = static_cast<DecodeKernel>(k);
      return true;
    }
  }
  return false;
}

}  // namespace kda::layer
