// kda/engine/kda_full_layer_weights.hpp — the weights of one whole Kimi Delta Attention layer
// (projections, short convolutions, gate parameters, gated norm, output projection), by their
// Hugging Face Kimi-Linear checkpoint names, whole or as one tensor-parallel rank's shard.
//
// Names and shapes (docs/LAYER.md has the full table and where each value is rounded). With C = H·D
// (H heads, head dim D), hidden size E, conv width W, each name optionally prefixed by
// "model.layers.{i}.self_attn." (i the 0-based model layer):
//   q_proj.weight, k_proj.weight, v_proj.weight   BF16 [C, E]
//   q_conv1d.weight, k_conv1d.weight, v_conv1d.weight  BF16 or F32 [C, 1, W] (or [C, W])
//   f_a_proj.weight BF16 [D, E]     f_b_proj.weight BF16 [C, D]      (forget gate, low rank)
//   b_proj.weight   BF16 [H, E]                                      (beta)
//   g_a_proj.weight BF16 [D, E]     g_b_proj.weight BF16 [C, D]      (output gate, low rank)
//   g_b_proj.bias   BF16 [C]        optional (fla's KimiDeltaAttention has it; Kimi-Linear not)
//   A_log   F32 or BF16 [1, 1, H, 1] (or [H])     dt_bias F32 or BF16 [C] (or [H, D])
//   o_norm.weight   BF16 [D]        o_proj.weight BF16 [E, C]
//
// Tensor parallelism (as vLLM shards the layer): rank r of tp_size keeps heads
// [r·H/tp, (r+1)·H/tp): the matching rows of q/k/v/f_b/g_b/b_proj (column-parallel linears), of
// the conv weights, A_log, dt_bias and g_b bias, and the matching columns of o_proj (row-parallel);
// f_a, g_a and o_norm are replicated. The rank's layer output is then a partial sum over ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/kda.hpp"

namespace kda::engine {

class Checkpoint;
struct Tensor;

// The sizes and settings of one whole KDA layer, and which tensor-parallel shard of it this is.
struct FullLayerConfig {
  std::int64_t hidden_size = 0;  // E
  std::int64_t num_heads = 0;    // H of the whole layer (all ranks together)
  std::int64_t head_dim = 128;   // D (= K = V)
  std::int64_t conv_width = 4;   // W, the short convolution's kernel size
  GateMode gate = GateMode::kSoftplus;
  float lower_bound = -5.0f;  // GateMode::kLowerBound only
  float norm_eps = 1e-5f;     // the gated RMSNorm's epsilon (Kimi-Linear: rms_norm_eps)
  int tp_size = 1;            // tensor-parallel ranks; num_heads % tp_size == 0
  int tp_rank = 0;            // this shard, 0 <= tp_rank < tp_size

  std::int64_t local_heads() const noexcept { return num_heads / tp_size; }
  std::int64_t local_channels() const noexcept { return local_heads() * head_dim; }  // C / tp
};

// Throws kda::Error (kInvalidArgument) naming the first bad field.
void validate(const FullLayerConfig& config);

// One rank's weights. Matrices are row-major [out, in] as nn.Linear stores them. With Cl =
// local_channels() and Hl = local_heads():
struct FullLayerWeights {
  FullLayerConfig config;
  std::vector<bf16_bits> q_proj, k_proj, v_proj;  // [Cl, E]
  std::vector<float> q_conv, k_conv, v_conv;      // [Cl, W], tap W-1 multiplies the newest token
  std::vector<bf16_bits> f_a_proj;                // [D, E]
  std::vector<bf16_bits> f_b_proj;                // [Cl, D]
  std::vector<bf16_bits> b_proj;                  // [Hl, E]
  std::vector<bf16_bits> g_a_proj;                // [D, E]
  std::vector<bf16_bits> g_b_proj;                // [Cl, D]
  std::vector<bf16_bits> g_b_bias;                // [Cl], or empty: no bias
  std::vector<float> A_log;                       // [Hl]
  std::vector<float> dt_bias;                     // [Cl]
  std::vector<bf16_bits> o_norm;                  // [D]
  std::vector<bf16_bits> o_proj;                  // [E, Cl]
  std::string origin;                             // "random (seed S)" or the checkpoint path
};

// Throws kda::Error naming the first member whose size does not match weights.config.
void check_sizes(const FullLayerWeights& weights);

// "model.layers.{i}.self_attn."
std::string full_layer_tensor_prefix(int layer_index);

// Reads layer `layer_index`'s weights from `checkpoint` and keeps config's shard of them. Each
// tensor is looked up as full_layer_tensor_prefix(layer_index) + name, then as the bare name (a
// layer case file); layer_index < 0 looks up bare names only. Throws kda::Error naming the tensor
// when one is missing, has another shape or dtype than the table above, or (A_log, dt_bias) holds
// a value the operator refuses.
FullLayerWeights load_full_layer_weights(const Checkpoint& checkpoint, int layer_index,
                                         const FullLayerConfig& config);

// Seeded random weights of the whole layer, then config's shard of them (so every rank of one
// seed holds a shard of the same layer). Linear and conv weights ~ U(-1/sqrt(fan_in),
// 1/sqrt(fan_in)) as PyTorch initialises them, o_norm = 1, no g_b bias, A_log and dt_bias as
// random_kda_parameters(). Reproducible for (seed, layer_index).
FullLayerWeights random_full_layer_weights(const FullLayerConfig& config, std::uint64_t seed,
                                           int layer_index);

// Rank `tp_rank` of `tp_size` of a whole layer's weights (full.config.tp_size must be 1).
FullLayerWeights shard_full_layer_weights(const FullLayerWeights& full, int tp_size, int tp_rank);

// The weights as safetensors tensors named `prefix` + checkpoint name, in the checkpoint's shapes
// and dtypes (conv weights, A_log and dt_bias as F32, so nothing is rounded). Only for whole
// layers (tp_size 1): a shard has no checkpoint shapes. Throws kda::Error otherwise.
std::vector<Tensor> full_layer_weight_tensors(const FullLayerWeights& weights,
                                              const std::string& prefix = {});

}  // namespace kda::engine
