// layer/src/backends.hpp — internal: what each backend of the layer provides to layer.cpp, the one
// place that picks a backend (make_layer, workspace_bytes, weight_image_bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kda/layer/layer.hpp"

namespace kda::layer::detail {

// The core's prefill problem and tensors with the batch's checkpoint requests (Batch::checkpoints,
// int64 offsets), as both backends hand them to the operator.
inline Problem with_checkpoints(Problem core, const Batch& batch, Tensors* t) {
  if (batch.checkpoints > 0) {
    core.checkpoints = batch.checkpoints;
    core.checkpoint_offsets_dtype = DType::kI64;
    t->checkpoint_offsets = batch.checkpoint_offsets;
    t->checkpoint_slots = batch.checkpoint_slots;
  }
  return core;
}

// The conv states of one sequence and branch after `accepted` more tokens, in place: each of the
// `channels` rows of `hist` inputs (bf16 [channels, hist]) becomes the last `hist` of old ++ the
// accepted inputs, input t of channel ch at inputs[t * input_stride + ch]. bf16 bits moved, never
// rounded: what commit() and a fold (Batch::fold_sequences) do to the conv states on the CPU.
inline void shift_conv_states(bf16_bits* rows, std::int64_t channels, std::int64_t hist,
                              std::int64_t accepted, const bf16_bits* inputs,
                              std::int64_t input_stride) {
  bf16_bits old[16];  // hist <= 15 (conv_width <= 16): nothing allocated
  for (std::int64_t ch = 0; ch < channels && hist > 0; ++ch) {
    bf16_bits* row = rows + ch * hist;
    for (std::int64_t i = 0; i < hist; ++i) old[i] = row[i];
    for (std::int64_t i = 0; i < hist; ++i) {
      const std::int64_t at = accepted + i;
      row[i] = at < hist ? old[at] : inputs[(at - hist) * input_stride + ch];
    }
  }
}

// CPU (layer_cpu.cpp): an fp32 weight image, cache-line aligned.
inline constexpr std::size_t kCpuWeightImageAlignment = 64;
std::size_t cpu_weight_image_bytes(const Config& config);
std::size_t cpu_workspace_bytes(const Config& config, std::int64_t tokens, std::int64_t sequences,
                                std::int64_t num_slots);
std::unique_ptr<Layer> make_cpu_layer(const Weights& weights, void* weight_image,
                                      std::size_t bytes);
std::unique_ptr<Layer> make_cpu_layer(const Weights& weights);

// CUDA (layer_cuda.cpp): a bf16 weight image, 256-byte aligned for cuBLAS and vector loads; the
// sizes work in every build, the layer needs CUDA (kBackendUnavailable otherwise).
inline constexpr std::size_t kCudaWeightImageAlignment = 256;
// cuBLAS's share of the CUDA workspace (32 MiB, NVIDIA's recommendation for Hopper).
inline constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;
Status cuda_can_implement(const Config& config);
std::size_t cuda_weight_image_bytes(const Config& config);
std::size_t cuda_workspace_bytes(const Config& config, std::int64_t tokens, std::int64_t sequences,
                                 std::int64_t num_slots);
std::unique_ptr<Layer> make_cuda_layer(const Weights& weights, void* weight_image,
                                       std::size_t bytes);
std::unique_ptr<Layer> make_cuda_layer(const Weights& weights);

}  // namespace kda::layer::detail
