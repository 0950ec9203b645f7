// engine/kda_full_layer_cpu.cpp — the whole KDA layer on the CPU (Eigen projections, fp32
// accumulation, bf16 between the steps), around the operator's CPU backend.
#include "kda/detail/checked_math.hpp"
#include "kda/engine/kda_full_layer.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "aligned_regions.hpp"
#include "full_layer_checks.hpp"
#include "kda/engine/error.hpp"
#include "kda/nvtx.hpp"

namespace kda::engine {

namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMajor>;
using MatrixMap = Eigen::Map<RowMajor>;

[[noreturn]] void invalid(const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, "KDA layer forward: " + message);
}

// out[T, n_out] = round_bf16(in[T, n_in] · weight[n_out, n_in]ᵀ), fp32 accumulation.
void project(const float* in, std::int64_t tokens, std::int64_t n_in, const float* weight,
             std::int64_t n_out, float* out) {
  MatrixMap result(out, tokens, n_out);
  result.noalias() =
      ConstMatrixMap(in, tokens, n_in) * ConstMatrixMap(weight, n_out, n_in).transpose();
  for (std::int64_t i = 0; i < tokens * n_out; ++i) out[i] = round_bf16(out[i]);
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Where each intermediate lives in the caller's workspace (byte offsets from the aligned base).
struct Layout {
  std::size_t hidden = 0;   // f32 [T, E]: x widened; later the o_proj result
  std::size_t pre = 0;      // f32 [T, Cl]: a projection before its conv; later the output gate, y
  std::size_t lowrank = 0;  // f32 [T, D]: x·W_faᵀ, then x·W_gaᵀ
  std::size_t q = 0, k = 0, v = 0, g = 0, o = 0;  // bf16 [T, Cl]: the KDA core's inputs, output
  std::size_t beta = 0;                           // bf16 [T, Hl]
  std::size_t core = 0;                           // the operator's workspace
  std::size_t core_bytes = 0;
  std::size_t total = 0;  // including alignment slack for an unaligned workspace pointer
};

constexpr std::size_t kAlignment = 64;

using kda::detail::align_up;

using detail::full_layer_core_problem;

Layout make_layout(const FullLayerConfig& c, std::int64_t tokens, std::int64_t sequences,
                   std::int64_t num_slots) {
  if (tokens < 0 || sequences < 0 || num_slots < 0) {
    invalid("tokens, sequences and num_slots must be >= 0");
  }
  detail::AlignedRegions regions("KDA layer workspace size", kAlignment);
  auto per_token = [&](std::int64_t width, std::uint64_t element_bytes) {
    return regions.take(regions.bytes_of(tokens, width, element_bytes));
  };
  const std::int64_t Cl = c.local_channels();
  Layout layout;
  layout.hidden = per_token(c.hidden_size, sizeof(float));
  layout.pre = per_token(Cl, sizeof(float));
  layout.lowrank = per_token(c.head_dim, sizeof(float));
  layout.q = per_token(Cl, sizeof(bf16_bits));
  layout.k = per_token(Cl, sizeof(bf16_bits));
  layout.v = per_token(Cl, sizeof(bf16_bits));
  layout.g = per_token(Cl, sizeof(bf16_bits));
  layout.o = per_token(Cl, sizeof(bf16_bits));
  layout.beta = per_token(c.local_heads(), sizeof(bf16_bits));
  // Sized with a slot list (the larger of the two: it adds the core's duplicate-slot bitmap).
  const Problem p = full_layer_core_problem(c, tokens, sequences, num_slots, true, DType::kF32);
  if (Status st = workspace_size(p, Backend::kCpu, &layout.core_bytes); !st) {
    throw Error(st, "KDA layer workspace");
  }
  layout.core = regions.take(layout.core_bytes);
  layout.total = regions.end() + kAlignment;  // slack for an unaligned workspace pointer
  return layout;
}

// Causal depthwise conv + SiLU of one sequence: `pre` [L, Cl] (rows `stride` floats apart) holds
// the sequence's pre-conv inputs, `conv_state` [Cl, W-1] the W-1 inputs before them (oldest
// first). Writes bf16 [L, Cl] to `out` and leaves the last W-1 inputs in `conv_state`.
void conv_silu(const float* pre, std::int64_t length, std::int64_t channels, std::int64_t width,
               const float* weight, bf16_bits* conv_state, bf16_bits* out) {
  const std::int64_t history = width - 1;
  // Input t of the sequence (t < 0: from the conv state).
  auto input = [&](std::int64_t c, std::int64_t t) {
    return t >= 0 ? pre[t * channels + c] : bf16_to_float(conv_state[c * history + history + t]);
  };
  for (std::int64_t t = 0; t < length; ++t) {
    for (std::int64_t c = 0; c < channels; ++c) {
      float acc = 0.0f;
      for (std::int64_t j = 0; j < width; ++j)
        acc += weight[c * width + j] * input(c, t - history + j);
      out[t * channels + c] = float_to_bf16(acc * sigmoid(acc));
    }
  }
  if (length == 0) return;
  // Ascending i reads input(L - history + i), which is state column L + i > i when it comes from
  // the state: never one already overwritten.
  for (std::int64_t c = 0; c < channels; ++c) {
    for (std::int64_t i = 0; i < history; ++i) {
      conv_state[c * history + i] = float_to_bf16(input(c, length - history + i));
    }
  }
}

// Byte offsets of the fp32 weight image's tensors from its kWeightImageAlignment-aligned base:
// the one layout that weight_image_bytes() sizes and place() fills.
struct WeightLayout {
  std::size_t q_proj = 0, k_proj = 0, v_proj = 0;  // [Cl, E]
  std::size_t f_a_proj = 0, f_b_proj = 0;          // [D, E], [Cl, D]
  std::size_t b_proj = 0;                          // [Hl, E]
  std::size_t g_a_proj = 0, g_b_proj = 0;          // [D, E], [Cl, D]
  std::size_t o_proj = 0;                          // [E, Cl]
  std::size_t q_conv = 0, k_conv = 0, v_conv = 0;  // [Cl, W]
  std::size_t g_b_bias = 0;                        // [Cl]; its place is kept without a bias
  std::size_t o_norm = 0;                          // [D]
  std::size_t A_log = 0, dt_bias = 0;              // [Hl], [Cl]
  std::size_t total = 0;
};

WeightLayout make_weight_layout(const FullLayerConfig& c) {
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Hl = c.local_heads(), Cl = c.local_channels();
  detail::AlignedRegions regions("KDA layer weight image size",
                                 FullLayerCpu::kWeightImageAlignment);
  auto matrix = [&](std::int64_t rows, std::int64_t columns) {
    return regions.take(regions.bytes_of(rows, columns, sizeof(float)));
  };
  WeightLayout layout;
  layout.q_proj = matrix(Cl, E);
  layout.k_proj = matrix(Cl, E);
  layout.v_proj = matrix(Cl, E);
  layout.f_a_proj = matrix(D, E);
  layout.f_b_proj = matrix(Cl, D);
  layout.b_proj = matrix(Hl, E);
  layout.g_a_proj = matrix(D, E);
  layout.g_b_proj = matrix(Cl, D);
  layout.o_proj = matrix(E, Cl);
  layout.q_conv = matrix(Cl, W);
  layout.k_conv = matrix(Cl, W);
  layout.v_conv = matrix(Cl, W);
  layout.g_b_bias = matrix(Cl, 1);
  layout.o_norm = matrix(D, 1);
  layout.A_log = matrix(Hl, 1);
  layout.dt_bias = matrix(Cl, 1);
  layout.total = regions.end();
  return layout;
}

class PhaseTimer {
 public:
  explicit PhaseTimer(FullLayerTimes* times) : times_(times) { start_ = Clock::now(); }
  // Adds the time since the last call (or construction) to `phase`.
  void lap(double FullLayerTimes::*phase) {
    if (times_ == nullptr) return;
    const Clock::time_point now = Clock::now();
    times_->*phase += std::chrono::duration<double>(now - start_).count();
    start_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  FullLayerTimes* times_;
  Clock::time_point start_;
};

}  // namespace

// Both constructors check the weights first, then hand the image's memory (the caller's, or the
// layer's own) to the one place().
FullLayerCpu::FullLayerCpu(const FullLayerWeights& w, void* weight_image, std::size_t bytes)
    : config_(w.config) {
  place(w, weight_image, bytes);
}

FullLayerCpu::FullLayerCpu(const FullLayerWeights& w) : config_(w.config) {
  check_sizes(w);  // before sizing the allocation from the config
  const std::size_t bytes = weight_image_bytes(config_);
  // Over-allocated by one alignment: operator new[] guarantees less than the image wants.
  owned_image_.reset(new unsigned char[bytes + kWeightImageAlignment]);
  const auto address = reinterpret_cast<std::uintptr_t>(owned_image_.get());
  place(w, reinterpret_cast<void*>(align_up<std::uintptr_t>(address, kWeightImageAlignment)),
        bytes);
}

void FullLayerCpu::place(const FullLayerWeights& w, void* weight_image, std::size_t bytes) {
  check_sizes(w);
  detail::check_gate_weights(w.A_log, w.dt_bias);
  const WeightLayout layout = make_weight_layout(config_);
  weight_image_bytes_ = layout.total;
  detail::check_weight_region(weight_image, bytes, layout.total, kWeightImageAlignment,
                              "KDA layer");

  auto* image = static_cast<unsigned char*>(weight_image);
  std::memset(image, 0, layout.total);  // alignment padding, and the bias's place without one
  auto widen = [&](std::size_t at, const std::vector<bf16_bits>& bits) {
    auto* values = reinterpret_cast<float*>(image + at);
    for (std::size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_float(bits[i]);
    return static_cast<const float*>(values);
  };
  auto copy = [&](std::size_t at, const std::vector<float>& values) {
    if (!values.empty()) std::memcpy(image + at, values.data(), values.size() * sizeof(float));
    return reinterpret_cast<const float*>(image + at);
  };
  q_proj_ = widen(layout.q_proj, w.q_proj);
  k_proj_ = widen(layout.k_proj, w.k_proj);
  v_proj_ = widen(layout.v_proj, w.v_proj);
  f_a_proj_ = widen(layout.f_a_proj, w.f_a_proj);
  f_b_proj_ = widen(layout.f_b_proj, w.f_b_proj);
  b_proj_ = widen(layout.b_proj, w.b_proj);
  g_a_proj_ = widen(layout.g_a_proj, w.g_a_proj);
  g_b_proj_ = widen(layout.g_b_proj, w.g_b_proj);
  o_proj_ = widen(layout.o_proj, w.o_proj);
  q_conv_ = copy(layout.q_conv, w.q_conv);
  k_conv_ = copy(layout.k_conv, w.k_conv);
  v_conv_ = copy(layout.v_conv, w.v_conv);
  g_b_bias_ = w.g_b_bias.empty() ? nullptr : widen(layout.g_b_bias, w.g_b_bias);
  o_norm_ = widen(layout.o_norm, w.o_norm);
  A_log_ = copy(layout.A_log, w.A_log);
  dt_bias_ = copy(layout.dt_bias, w.dt_bias);
}

std::size_t FullLayerCpu::weight_image_bytes(const FullLayerConfig& config) {
  validate(config);
  return make_weight_layout(config).total;
}

std::size_t FullLayerCpu::workspace_bytes(const FullLayerConfig& config, std::int64_t tokens,
                                          std::int64_t sequences, std::int64_t num_slots) {
  validate(config);
  return make_layout(config, tokens, sequences, num_slots).total;
}

void FullLayerCpu::forward(const FullLayerBatch& batch, const bf16_bits* hidden, bf16_bits* out,
                           const FullLayerState& state, Workspace workspace, const CpuOptions& cpu,
                           FullLayerTimes* times) const {
  const FullLayerConfig& c = config_;
  const std::int64_t T = batch.tokens, N = batch.sequences, E = c.hidden_size, D = c.head_dim;
  const std::int64_t W = c.conv_width, Hl = c.local_heads(), Cl = c.local_channels();

  // ---- checks, before anything is written ---------------------------------------------------
  if (T < 0 || N < 0) invalid("tokens and sequences must be >= 0");
  const Layout layout = make_layout(c, T, N, state.num_slots);  // also: sizes fit 64 bits
  if (batch.cu_seqlens == nullptr) invalid("cu_seqlens is null");
  if (batch.cu_seqlens[0] != 0) invalid("cu_seqlens[0] is not 0");
  for (std::int64_t n = 0; n < N; ++n) {
    if (batch.cu_seqlens[n + 1] < batch.cu_seqlens[n]) {
      invalid("cu_seqlens decreases at entry " + std::to_string(n + 1));
    }
  }
  if (batch.cu_seqlens[N] != T) {
    invalid("cu_seqlens[" + std::to_string(N) + "] = " + std::to_string(batch.cu_seqlens[N]) +
            " is not tokens = " + std::to_string(T));
  }
  detail::check_hidden_and_out(hidden, out, T, E, "KDA layer forward");
  detail::check_state_pools(state, N, W, "KDA layer forward");
  auto slot_of = [&](std::int64_t n) -> std::int64_t {
    return batch.slots == nullptr ? n : batch.slots[n];
  };
  for (std::int64_t n = 0; n < N; ++n) {
    if (slot_of(n) < 0 || slot_of(n) >= state.num_slots) {
      invalid("sequence " + std::to_string(n) + " has slot " + std::to_string(slot_of(n)) +
              ", outside [0, num_slots = " + std::to_string(state.num_slots) + ")");
    }
    for (std::int64_t m = 0; m < n && batch.slots != nullptr; ++m) {
      if (slot_of(m) == slot_of(n)) {
        invalid("sequences " + std::to_string(m) + " and " + std::to_string(n) + " share slot " +
                std::to_string(slot_of(n)));
      }
    }
  }
  const Problem core = full_layer_core_problem(c, T, N, state.num_slots, batch.slots != nullptr,
                                               state.recurrent_dtype);
  throw_if_error(validate(core), "KDA layer forward: core problem");
  if (workspace.bytes < layout.total) {
    throw Error(StatusCode::kWorkspaceTooSmall,
                "KDA layer forward: workspace has " + std::to_string(workspace.bytes) +
                    " bytes, a forward of " + std::to_string(T) + " tokens in " +
                    std::to_string(N) + " sequences needs " + std::to_string(layout.total));
  }
  if (workspace.ptr == nullptr) invalid("workspace.ptr is null");
  if (T == 0) return;  // nothing to compute; every state stays as it is

  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(workspace.ptr);
  auto* base = reinterpret_cast<unsigned char*>(align_up<std::uintptr_t>(address, kAlignment));
  auto* xf = reinterpret_cast<float*>(base + layout.hidden);
  auto* pre = reinterpret_cast<float*>(base + layout.pre);
  auto* lowrank = reinterpret_cast<float*>(base + layout.lowrank);
  auto* q = reinterpret_cast<bf16_bits*>(base + layout.q);
  auto* k = reinterpret_cast<bf16_bits*>(base + layout.k);
  auto* v = reinterpret_cast<bf16_bits*>(base + layout.v);
  auto* g = reinterpret_cast<bf16_bits*>(base + layout.g);
  auto* o = reinterpret_cast<bf16_bits*>(base + layout.o);
  auto* beta = reinterpret_cast<bf16_bits*>(base + layout.beta);
  PhaseTimer timer(times);

  // ---- q, k, v: projection, then conv + SiLU per sequence ------------------------------------
  for (std::int64_t i = 0; i < T * E; ++i) xf[i] = bf16_to_float(hidden[i]);
  const std::int64_t conv_row = Cl * (W - 1);  // one sequence's conv state, in elements
  struct ConvBranch {
    const float* proj;
    const float* conv;
    bf16_bits* pool;
    bf16_bits* out;
  };
  for (const ConvBranch& branch : {ConvBranch{q_proj_, q_conv_, state.conv_q, q},
                                   ConvBranch{k_proj_, k_conv_, state.conv_k, k},
                                   ConvBranch{v_proj_, v_conv_, state.conv_v, v}}) {
    {
      KDA_NVTX_RANGE("projections");  // the same range names as the CUDA layer's
      project(xf, T, E, branch.proj, Cl, pre);
    }
    timer.lap(&FullLayerTimes::projections);
    {
      KDA_NVTX_RANGE("conv");
      for (std::int64_t n = 0; n < N; ++n) {
        const std::int64_t begin = batch.cu_seqlens[n], length = batch.cu_seqlens[n + 1] - begin;
        conv_silu(pre + begin * Cl, length, Cl, W, branch.conv, branch.pool + slot_of(n) * conv_row,
                  branch.out + begin * Cl);
      }
    }
    timer.lap(&FullLayerTimes::conv);
  }

  // ---- forget gate g_raw = (x·W_faᵀ)·W_fbᵀ and beta_raw = x·W_bᵀ (activated inside the core) ---
  {
    KDA_NVTX_RANGE("projections");
    project(xf, T, E, f_a_proj_, D, lowrank);
    project(lowrank, T, D, f_b_proj_, Cl, pre);
    for (std::int64_t i = 0; i < T * Cl; ++i) g[i] = float_to_bf16(pre[i]);
    project(xf, T, E, b_proj_, Hl, pre);
    for (std::int64_t i = 0; i < T * Hl; ++i) beta[i] = float_to_bf16(pre[i]);
    // Output gate (x·W_gaᵀ)·W_gbᵀ [+ bias] into `pre`, for the norm.
    project(xf, T, E, g_a_proj_, D, lowrank);
    {
      MatrixMap gate(pre, T, Cl);
      gate.noalias() = ConstMatrixMap(lowrank, T, D) * ConstMatrixMap(g_b_proj_, Cl, D).transpose();
      if (g_b_bias_ != nullptr) {
        gate.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(g_b_bias_, Cl);
      }
      for (std::int64_t i = 0; i < T * Cl; ++i) pre[i] = round_bf16(pre[i]);
    }
  }
  timer.lap(&FullLayerTimes::projections);

  // ---- the KDA core: one call for the batch, states in place in the pool -------------------
  Tensors t;
  t.q = q;
  t.k = k;
  t.v = v;
  t.g = g;
  t.beta = beta;
  t.A_log = A_log_;
  t.dt_bias = dt_bias_;
  t.cu_seqlens = batch.cu_seqlens;
  t.initial_state = state.recurrent;
  t.final_state = state.recurrent;  // updated in place
  t.state_slots = batch.slots;
  t.out = o;
  {
    KDA_NVTX_RANGE("core");
    throw_if_error(forward_cpu(core, t, Workspace{base + layout.core, layout.core_bytes}, cpu),
                   "KDA layer forward: core");
  }
  timer.lap(&FullLayerTimes::core);

  // ---- gated RMSNorm per (token, head), y into `pre` over the gate it reads ------------------
  {
    KDA_NVTX_RANGE("norm");
    for (std::int64_t row = 0; row < T * Hl; ++row) {
      const bf16_bits* o_row = o + row * D;
      float* gate_row = pre + row * D;
      float sum_squares = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) {
        const float value = bf16_to_float(o_row[d]);
        sum_squares += value * value;
      }
      const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(D) + c.norm_eps);
      for (std::int64_t d = 0; d < D; ++d) {
        gate_row[d] =
            round_bf16(bf16_to_float(o_row[d]) * inv_rms * o_norm_[d] * sigmoid(gate_row[d]));
      }
    }
  }
  timer.lap(&FullLayerTimes::norm);

  // ---- out = y·W_oᵀ (a partial sum over tensor-parallel ranks) -------------------------------
  {
    KDA_NVTX_RANGE("o_proj");
    project(pre, T, Cl, o_proj_, E, xf);
    for (std::int64_t i = 0; i < T * E; ++i) out[i] = float_to_bf16(xf[i]);
  }
  timer.lap(&FullLayerTimes::o_proj);
}

}  // namespace kda::engine
