// kda/layer/weights.hpp — the weights of one whole Kimi Delta Attention layer (projections, short
// convolutions, gate parameters, gated norm, output projection), whole or as one tensor-parallel
// rank's shard. Reading and writing them in checkpoints is the engine's (kda/engine/
// layer_weights_io.hpp); this header knows no file format.
//
// Shapes (docs/LAYER.md has the table with the checkpoint names and where each value is rounded).
// With C = H·D (H heads, head dim D), hidden size E, conv width W:
//   q_proj, k_proj, v_proj [C, E]     q_conv, k_conv, v_conv [C, W]
//   f_a_proj [D, E], f_b_proj [C, D]  (forget gate, low rank)     b_proj [H, E]  (beta)
//   g_a_proj [D, E], g_b_proj [C, D]  (output gate, low rank)     g_b_bias [C] (optional)
//   or g_proj [C, E]                  (output gate, full rank: Config::full_rank_gate, Kimi K3)
//   A_log [H], dt_bias [C]            o_norm [D]                  o_proj [E, C]
//
// Tensor parallelism (as vLLM shards the layer): rank r of tp_size keeps heads
// [r·H/tp, (r+1)·H/tp): the matching rows of q/k/v/f_b/g_b/g/b_proj (column-parallel linears), of
// the conv weights, A_log, dt_bias and g_b bias, and the matching columns of o_proj (row-parallel);
// f_a, g_a and o_norm are replicated. The rank's layer output is then a partial sum over ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/kda.hpp"

namespace kda::layer {

// The widest short convolution a layer takes (its conv state keeps W - 1 columns).
inline constexpr std::int64_t kMaxConvWidth = 16;

// The sizes and settings of one whole KDA layer, and which tensor-parallel shard of it this is.
struct Config {
  std::int64_t hidden_size = 0;  // E
  std::int64_t num_heads = 0;    // H of the whole layer (all ranks together)
  std::int64_t head_dim = 128;   // D (= K = V)
  std::int64_t conv_width = 4;   // W, the short convolution's kernel size
  GateMode gate = GateMode::kSoftplus;
  float lower_bound = -5.0f;  // GateMode::kLowerBound only
  float norm_eps = 1e-5f;     // the gated RMSNorm's epsilon (Kimi-Linear: rms_norm_eps)
  // The output gate is one full-rank projection g_proj [C, E] (Kimi K3's use_full_rank_gate)
  // instead of the low-rank pair g_a_proj, g_b_proj.
  bool full_rank_gate = false;
  int tp_size = 1;  // tensor-parallel ranks; num_heads % tp_size == 0
  int tp_rank = 0;  // this shard, 0 <= tp_rank < tp_size

  // 0 for a tp_size below 1, and channels 0 where heads x head_dim is not a positive int64
  // (validate() refuses such configs; the problems built from them then have no heads or
  // channels, which their own checks refuse).
  std::int64_t local_heads() const noexcept { return tp_size > 0 ? num_heads / tp_size : 0; }
  std::int64_t local_channels() const noexcept {  // C / tp
    const std::int64_t heads = local_heads();
    return heads > 0 && head_dim > 0 && heads <= INT64_MAX / head_dim ? heads * head_dim : 0;
  }
};

// Throws kda::Error (kInvalidArgument) naming the first bad field.
void validate(const Config& config);

// One rank's weights. Matrices are row-major [out, in] as nn.Linear stores them. With Cl =
// local_channels() and Hl = local_heads():
struct Weights {
  Config config;
  std::vector<bf16_bits> q_proj, k_proj, v_proj;  // [Cl, E]
  std::vector<float> q_conv, k_conv, v_conv;      // [Cl, W], tap W-1 multiplies the newest token
  std::vector<bf16_bits> f_a_proj;                // [D, E]
  std::vector<bf16_bits> f_b_proj;                // [Cl, D]
  std::vector<bf16_bits> b_proj;                  // [Hl, E]
  std::vector<bf16_bits> g_a_proj;                // [D, E]; empty with config.full_rank_gate
  std::vector<bf16_bits> g_b_proj;                // [Cl, D]; empty with config.full_rank_gate
  std::vector<bf16_bits> g_proj;                  // [Cl, E] with config.full_rank_gate, else empty
  std::vector<bf16_bits> g_b_bias;                // [Cl], or empty: no bias (either gate form)
  std::vector<float> A_log;                       // [Hl]
  std::vector<float> dt_bias;                     // [Cl]
  std::vector<bf16_bits> o_norm;                  // [D]
  std::vector<bf16_bits> o_proj;                  // [E, Cl]
  std::string origin;                             // "random (seed S)" or the checkpoint path
};

// Throws kda::Error naming the first member whose size does not match weights.config.
void check_sizes(const Weights& weights);

// The gate's per-layer parameters, seeded random as fla initialises a KDA layer:
//   A_log = log(U[1, 16]),  dt_bias = softplus^-1(dt) with dt = exp(U[log 1e-3, log 1e-1])
// from a generator seeded by (seed, layer_index), so a run is reproducible and layers differ.
struct GateParameters {
  std::vector<float> A_log;    // [H]
  std::vector<float> dt_bias;  // [H * D]
};
GateParameters random_gate_parameters(std::uint64_t seed, int layer_index, std::int64_t num_heads,
                                      std::int64_t head_dim);

// Seeded random weights of config's shard of a layer: what shard_weights() takes of the whole
// layer's random weights of the same seed and layer (so every rank of one seed holds a shard of
// the same layer), generated for the shard alone. Linear and conv weights ~ U(-1/sqrt(fan_in),
// 1/sqrt(fan_in)) as PyTorch initialises them, o_norm = 1, no g_b bias, A_log and dt_bias as
// random_gate_parameters(). Reproducible for (seed, layer_index).
Weights random_weights(const Config& config, std::uint64_t seed, int layer_index);

// Rank `tp_rank` of `tp_size` of a whole layer's weights (full.config.tp_size must be 1).
Weights shard_weights(const Weights& full, int tp_size, int tp_rank);

}  // namespace kda::layer
