// kda/engine/kda_full_layer.hpp — one whole Kimi Delta Attention layer on the CPU: hidden states
// in, hidden states out, for a varlen batch of prefills or decode steps.
//
// For hidden states x [T, E] (bf16), local heads Hl, head dim D, Cl = Hl·D, conv width W:
//   q, k, v = SiLU(causal depthwise conv1d_W(x·W_{q,k,v}ᵀ))   per sequence, from its conv state
//   g_raw   = (x·W_faᵀ)·W_fbᵀ            β_raw = x·W_bᵀ
//   o       = KDA(q, k, v, g_raw, β_raw; A_log, dt_bias)      kda::forward_cpu, recurrent state
//   y       = RMSNorm_D(o) · o_norm ⊙ sigmoid((x·W_gaᵀ)·W_gbᵀ [+ g_b bias])   per head
//   out     = y·W_oᵀ                                            [T, E] bf16
// fp32 accumulation everywhere; every intermediate above is rounded to bf16 as the reference
// implementations (fla, vLLM) round it — docs/LAYER.md lists the rounding points.
//
// States. Each sequence has a conv state per projection — the last W-1 pre-conv inputs of each
// channel, oldest first, bf16 [Cl, W-1] (zeros for a new sequence) — and the recurrent state
// [Hl, D, D] (V-first, as kda/kda.hpp), bf16 or f32. They live in caller-owned pools of num_slots
// rows; sequence n uses row slots[n] of each pool (row n without slots). A forward reads and
// updates them in place, so a second forward on the same rows continues the sequences (chunked
// prefill) and a forward with one token per sequence is a decode step.
//
// Tensor parallelism: with config.tp_size > 1 the layer holds its rank's heads (see
// kda_full_layer_weights.hpp) and its state pools hold those heads only; `out` is then this rank's
// PARTIAL SUM of the layer output (rounded to bf16): the caller all-reduces (sums) `out` over the
// ranks to get the layer's output.
//
// Memory. The weights, widened to fp32, live in one host image of weight_image_bytes(config) bytes
// (every tensor at a kWeightImageAlignment-aligned offset), written once, at construction: into
// host memory the caller hands in (an engine's arena, laid out by its memory plan) or, with the
// one-argument constructor, into memory the layer allocates itself. The caller also hands in a
// workspace of at least workspace_bytes(tokens, sequences, num_slots) bytes (any alignment); a
// forward allocates nothing and prints nothing. Errors throw kda::Error, and every check runs
// before the first byte of out or of a state is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kda/engine/kda_full_layer_weights.hpp"
#include "kda/kda.hpp"

namespace kda::engine {

// Pools of per-sequence state, host memory, read and written in place.
struct FullLayerState {
  std::int64_t num_slots = 0;
  bf16_bits* conv_q = nullptr;          // [num_slots, Cl, W-1]
  bf16_bits* conv_k = nullptr;          // [num_slots, Cl, W-1]
  bf16_bits* conv_v = nullptr;          // [num_slots, Cl, W-1]
  void* recurrent = nullptr;            // [num_slots, Hl, D, D] in recurrent_dtype
  DType recurrent_dtype = DType::kF32;  // kF32 or kBF16
};

// One batch: `sequences` sequences, back to back in `tokens` rows of hidden states.
struct FullLayerBatch {
  std::int64_t tokens = 0;                   // T
  std::int64_t sequences = 0;                // N
  const std::int64_t* cu_seqlens = nullptr;  // host [N + 1]: 0, non-decreasing, last == T
  // Host [N]: the state row of each sequence, distinct, in [0, num_slots). nullptr: row n.
  const std::int32_t* slots = nullptr;
};

// Seconds spent per phase, added to by forward() when asked (kda-run's per-layer report).
struct FullLayerTimes {
  double projections = 0.0;  // q/k/v, f_a/f_b, b, g_a/g_b projections
  double conv = 0.0;         // short convolutions + SiLU, conv state update
  double core = 0.0;         // the KDA operator
  double norm = 0.0;         // gated RMSNorm
  double o_proj = 0.0;       // output projection
};

class FullLayerCpu {
 public:
  // Checks the weights' sizes against their config and copies them, widened to fp32 (exact: the
  // matrices are bf16), into `weight_image`: host memory, kWeightImageAlignment-aligned, at least
  // weight_image_bytes(weights.config) of `bytes`, that the caller keeps, untouched, for the
  // layer's life. The region is checked before it is written. Throws kda::Error
  // (kInvalidArgument: bad weights, or a null, misaligned or too small region).
  FullLayerCpu(const FullLayerWeights& weights, void* weight_image, std::size_t bytes);
  // The same into host memory the layer allocates (and frees) itself.
  explicit FullLayerCpu(const FullLayerWeights& weights);
  FullLayerCpu(const FullLayerCpu&) = delete;
  FullLayerCpu& operator=(const FullLayerCpu&) = delete;

  const FullLayerConfig& config() const noexcept { return config_; }

  // Workspace bytes of a forward of up to `tokens` tokens in up to `sequences` sequences on state
  // pools of `num_slots` rows (FullLayerState::num_slots). Throws kda::Error (kOverflow) when the
  // size does not fit 64 bits.
  static std::size_t workspace_bytes(const FullLayerConfig& config, std::int64_t tokens,
                                     std::int64_t sequences, std::int64_t num_slots);
  std::size_t workspace_bytes(std::int64_t tokens, std::int64_t sequences,
                              std::int64_t num_slots) const {
    return workspace_bytes(config_, tokens, sequences, num_slots);
  }

  // Host bytes of the fp32 weight image of a layer of `config`, whatever its weights' values (a
  // g_b bias always has its place). Throws kda::Error (kInvalidArgument) for a bad config,
  // (kOverflow) when the size does not fit 64 bits.
  static std::size_t weight_image_bytes(const FullLayerConfig& config);
  // The image's (and each of its tensors') alignment: a cache line.
  static constexpr std::size_t kWeightImageAlignment = 64;

  // Host bytes of this layer's weights (= weight_image_bytes(config())).
  std::size_t weight_bytes() const noexcept { return weight_image_bytes_; }

  // hidden: host bf16 [T, E]; out: host bf16 [T, E], not overlapping hidden. Throws kda::Error.
  void forward(const FullLayerBatch& batch, const bf16_bits* hidden, bf16_bits* out,
               const FullLayerState& state, Workspace workspace, const CpuOptions& cpu = {},
               FullLayerTimes* times = nullptr) const;

 private:
  // Checks `weight_image` (as the first constructor says), writes the image there and points the
  // layer at its tensors. Both constructors end here.
  void place(const FullLayerWeights& weights, void* weight_image, std::size_t bytes);

  FullLayerConfig config_;
  std::size_t weight_image_bytes_ = 0;
  std::unique_ptr<unsigned char[]> owned_image_;  // the one-argument constructor's, else null
  // In the image, fp32. Row-major [out, in], as the checkpoint stores them:
  const float *q_proj_ = nullptr, *k_proj_ = nullptr, *v_proj_ = nullptr, *f_a_proj_ = nullptr,
              *f_b_proj_ = nullptr, *b_proj_ = nullptr, *g_a_proj_ = nullptr, *g_b_proj_ = nullptr,
              *o_proj_ = nullptr;
  const float *q_conv_ = nullptr, *k_conv_ = nullptr, *v_conv_ = nullptr;  // [Cl, W]
  const float* g_b_bias_ = nullptr;                                        // [Cl], null: none
  const float* o_norm_ = nullptr;                                          // [D]
  const float *A_log_ = nullptr, *dt_bias_ = nullptr;                      // [Hl], [Cl]
};

}  // namespace kda::engine
