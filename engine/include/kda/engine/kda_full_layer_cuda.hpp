// kda/engine/kda_full_layer_cuda.hpp — one whole Kimi Delta Attention layer on CUDA: hidden states
// in, hidden states out, for a varlen prefill batch or a decode step. The same layer as
// FullLayerCpu (kda_full_layer.hpp, the reference it is tested against; docs/LAYER.md §6 says what
// runs where and where values are rounded):
//   projections  cuBLAS (bf16 in, fp32 accumulation, CUBLAS_COMPUTE_32F): x·[W_q; W_k; W_v; W_fa;
//                W_ga; W_b]ᵀ as one GEMM, then the two low-rank second factors
//   conv         one fused kernel: causal conv + SiLU of q, k, v from and to the conv states
//   core         kda::forward_cuda (prefill) or kda::decode_cuda (decode), states in the pool
//   norm         one fused kernel: gated RMSNorm
//   o_proj       cuBLAS
//
// Memory. The weights live in one device image of weight_image_bytes(config) bytes (every tensor
// at a 256-byte aligned offset), copied there once, at construction: into device memory the caller
// hands in (an engine's arena, laid out by its memory plan) or, with the one-argument constructor,
// into memory the layer allocates itself. Hidden states, out, the state pools, cu_seqlens, slots
// and the workspace are the caller's device memory. The workspace (at least workspace_bytes(...)
// bytes, any alignment) also holds cuBLAS's workspace (cublasSetWorkspace), so a forward allocates
// nothing, synchronizes nothing and prints nothing: it enqueues work on `stream` and returns, and
// it can be captured in a CUDA graph (pass CudaOptions{.check_pointers = false} while capturing;
// see kda::CudaOptions).
//
// States. The pools are FullLayerState's, in device memory: conv states bf16 [num_slots, Cl, W-1]
// (q, k, v) and the recurrent state [num_slots, Hl, D, D] bf16 or f32. Sequence n uses row slots[n]
// (row n without a slot list); a negative slot is padding (a zero state, nothing written back).
//
// Tensor parallelism as FullLayerCpu: `out` is this rank's partial sum; all-reduce it over ranks.
//
// Threads. The layer owns one cuBLAS handle: one forward at a time per FullLayerCuda object
// (different objects may run concurrently on different streams).
//
// In a build without CUDA the constructors throw kda::Error (kBackendUnavailable);
// workspace_bytes() and weight_image_bytes() work in every build, so a planner can size a CUDA
// arena anywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kda/engine/kda_full_layer.hpp"
#include "kda/engine/kda_full_layer_weights.hpp"
#include "kda/kda.hpp"

namespace kda::engine {

// One batch on the device.
struct FullLayerCudaBatch {
  std::int64_t tokens = 0;     // T
  std::int64_t sequences = 0;  // N
  // 0: prefill — sequences of any length (0 included) laid out by cu_seqlens.
  // 1..16: decode — every sequence has exactly decode_tokens tokens (tokens == sequences *
  // decode_tokens), cu_seqlens is not read, and the core runs through kda::decode_cuda.
  std::int64_t decode_tokens = 0;
  const std::int64_t* cu_seqlens = nullptr;  // device [N + 1]; prefill only
  // Device [N]: each sequence's state row, distinct among the non-negative ones; negative =
  // padding. nullptr: sequence n uses row n (then N <= num_slots).
  const std::int32_t* slots = nullptr;
  // Optional host copies, checked before anything is enqueued (cu_seqlens: [0] == 0,
  // non-decreasing, [N] == T; slots: < num_slots, no duplicates). Without them the device cannot
  // be checked by the host: a slot >= num_slots is then treated as padding and reported through
  // device_status, and broken cu_seqlens are reported by the core.
  const std::int64_t* cu_seqlens_host = nullptr;
  const std::int32_t* slots_host = nullptr;
  // Optional device word the kernels OR kda::DeviceStatusBit values into
  // (kda::Tensors::device_status).
  std::uint32_t* device_status = nullptr;
};

// Optional: six cudaEvent_t (passed as void*) that forward() records on its stream at the phase
// boundaries — before the projections, after the projections, the conv, the core, the norm and
// o_proj — so that a caller can time the phases (cudaEventElapsedTime) after its own sync.
struct FullLayerCudaEvents {
  void* boundary[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
};

class FullLayerCuda {
 public:
  // Checks the weights (as FullLayerCpu) and the CUDA path's limits (head_dim 128, conv width
  // 2..4), copies the weights' image into `weight_image` (device memory of the current device,
  // kWeightImageAlignment-aligned, at least weight_image_bytes(weights.config) of `bytes`; the
  // caller keeps it, untouched, for the layer's life) and creates the cuBLAS handle. The region is
  // checked before the device is touched. Throws kda::Error (kInvalidArgument: a null, misaligned
  // or too small region; kBackendUnavailable without CUDA or a device; kUnsupported; kCudaError).
  FullLayerCuda(const FullLayerWeights& weights, void* weight_image, std::size_t bytes);
  // The same into device memory the layer allocates (and frees) itself.
  explicit FullLayerCuda(const FullLayerWeights& weights);
  ~FullLayerCuda();
  FullLayerCuda(const FullLayerCuda&) = delete;
  FullLayerCuda& operator=(const FullLayerCuda&) = delete;

  const FullLayerConfig& config() const noexcept { return config_; }

  // Device bytes of workspace for a forward of up to `tokens` tokens in up to `sequences`
  // sequences (prefill or decode) on pools of `num_slots` rows. Includes cuBLAS's workspace
  // (kCublasWorkspaceBytes). Throws kda::Error (kOverflow) when the size does not fit 64 bits.
  static std::size_t workspace_bytes(const FullLayerConfig& config, std::int64_t tokens,
                                     std::int64_t sequences, std::int64_t num_slots);
  std::size_t workspace_bytes(std::int64_t tokens, std::int64_t sequences,
                              std::int64_t num_slots) const {
    return workspace_bytes(config_, tokens, sequences, num_slots);
  }
  // cuBLAS's share of the workspace (32 MiB, NVIDIA's recommendation for Hopper).
  static constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;

  // Device bytes of the weight image of a layer of `config`, whatever its weights' values (a
  // g_b bias always has its place). Throws kda::Error (kInvalidArgument) for a bad config.
  static std::size_t weight_image_bytes(const FullLayerConfig& config);
  // The image's (and each of its tensors') alignment: cuBLAS's and the vector loads' wish.
  static constexpr std::size_t kWeightImageAlignment = 256;

  // Device bytes of this layer's weights (= weight_image_bytes(config())).
  std::size_t weight_bytes() const noexcept { return weight_image_bytes_; }

  // hidden: device bf16 [T, E]; out: device bf16 [T, E], not overlapping hidden. `stream` is a
  // cudaStream_t (nullptr: the default stream). `cuda.check_pointers` checks every caller buffer
  // with the driver before anything is enqueued. Every host-side check runs before the first
  // launch; a CUDA error after that throws kCudaError and may leave states partly updated.
  // Throws kda::Error.
  void forward(const FullLayerCudaBatch& batch, const bf16_bits* hidden, bf16_bits* out,
               const FullLayerState& state, Workspace workspace, void* stream,
               const CudaOptions& cuda = {}, const FullLayerCudaEvents* events = nullptr) const;

 private:
  struct Impl;
  FullLayerConfig config_;
  std::size_t weight_image_bytes_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kda::engine
