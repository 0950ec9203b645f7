// layer/src/layer_cpu.cpp — the whole KDA layer on the CPU (Eigen projections, fp32 accumulation,
// bf16 between the steps), around the operator's CPU backend.
#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "aligned_regions.hpp"
#include "backends.hpp"
#include "checks.hpp"
#include "cpu_parallel.hpp"  // parallel_for, resolve_threads (kda/src)
#include "kda/detail/checked_math.hpp"
#include "kda/error.hpp"
#include "kda/nvtx.hpp"
#include "workspace_layout.hpp"

namespace kda::layer::detail {

namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMajor>;
using MatrixMap = Eigen::Map<RowMajor>;

constexpr const char* kForward = "KDA layer forward (CPU)";
constexpr const char* kCoreInputs = "KDA layer core inputs (CPU)";

// Output columns a work item of project() computes: fixed, so that the result does not depend on
// the thread count.
constexpr std::int64_t kProjectColumns = 256;

// out[T, n_out] = round_bf16(in[T, n_in] · weight[n_out, n_in]ᵀ + bias), fp32 accumulation, the
// bias [n_out] (if any) added before the rounding; in blocks of kProjectColumns output columns on
// up to `threads` threads (0: the hardware's, as far as the work pays for them;
// RunOptions::cpu_threads).
void project(const float* in, std::int64_t tokens, std::int64_t n_in, const float* weight,
             std::int64_t n_out, float* out, int threads, const float* bias = nullptr) {
  const std::int64_t blocks = (n_out + kProjectColumns - 1) / kProjectColumns;
  // resolve_threads weighs work in state updates of the recurrence, each a few multiply-adds
  // slower than a GEMM's: a thread here is worth its start from about 4M multiply-adds.
  const std::int64_t workers =
      kda::detail::cpu::resolve_threads(threads, blocks, tokens * n_in / 4 * n_out);
  MatrixMap result(out, tokens, n_out);
  const ConstMatrixMap x(in, tokens, n_in), w(weight, n_out, n_in);
  kda::detail::cpu::parallel_for(blocks, workers, [&](std::int64_t block, std::int64_t) {
    const std::int64_t first = block * kProjectColumns;
    const std::int64_t columns = std::min(kProjectColumns, n_out - first);
    auto part = result.middleCols(first, columns);
    part.noalias() = x * w.middleRows(first, columns).transpose();
    if (bias != nullptr) {
      part.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(bias + first, columns);
    }
    part = part.unaryExpr([](float value) { return round_bf16(value); });
  });
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

using kda::detail::align_up;

// The conv state after `offset` inputs of a sequence whose pre-conv inputs are `pre` [L, Cl] and
// whose initial conv state is `initial` [Cl, W-1]: its last W-1 inputs there, the older ones from
// `initial` where fewer than W-1 inputs came before. Into `dst` [Cl, W-1], which may be `initial`
// itself: ascending i reads initial column offset + i >= i when it comes from there, never one
// already overwritten.
void conv_state_at(const float* pre, std::int64_t offset, std::int64_t channels, std::int64_t width,
                   const bf16_bits* initial, bf16_bits* dst) {
  const std::int64_t history = width - 1;
  for (std::int64_t c = 0; c < channels; ++c) {
    for (std::int64_t i = 0; i < history; ++i) {
      const std::int64_t t = offset - history + i;  // the input's position in the sequence
      dst[c * history + i] =
          t >= 0 ? float_to_bf16(pre[t * channels + c]) : initial[c * history + history + t];
    }
  }
}

// Causal depthwise conv + SiLU of one sequence: `pre` [L, Cl] holds the sequence's pre-conv
// inputs, `conv_state` [Cl, W-1] the W-1 inputs before them (oldest first). Writes bf16 [L, Cl] to
// `out` and leaves the last W-1 inputs in `conv_state`. A null `conv_state` (a padding sequence)
// reads zeros before the sequence and keeps nothing.
void conv_silu(const float* pre, std::int64_t length, std::int64_t channels, std::int64_t width,
               const float* weight, bf16_bits* conv_state, bf16_bits* out) {
  const std::int64_t history = width - 1;
  // Input t of the sequence (t < 0: from the conv state).
  auto input = [&](std::int64_t c, std::int64_t t) {
    if (t >= 0) return pre[t * channels + c];
    return conv_state == nullptr ? 0.0f : bf16_to_float(conv_state[c * history + history + t]);
  };
  for (std::int64_t t = 0; t < length; ++t) {
    for (std::int64_t c = 0; c < channels; ++c) {
      float acc = 0.0f;
      for (std::int64_t j = 0; j < width; ++j)
        acc += weight[c * width + j] * input(c, t - history + j);
      out[t * channels + c] = float_to_bf16(acc * sigmoid(acc));
    }
  }
  if (length == 0 || conv_state == nullptr) return;
  conv_state_at(pre, length, channels, width, conv_state, conv_state);
}

// The same conv for a verify step's row of `length` tokens (at most kMaxDecodeTokens): starts from
// `start` [Cl, W-1] and writes the conv state after token t into keep[t] (null: not kept). Channel
// by channel, each channel's start read before any of its states is written, so that keep[t] may be
// `start` itself (the row's start slot is one of its own).
void conv_silu_kept(const float* pre, std::int64_t length, std::int64_t channels,
                    std::int64_t width, const float* weight, const bf16_bits* start,
                    bf16_bits* const* keep, bf16_bits* out) {
  const std::int64_t history = width - 1;
  constexpr std::int64_t kMaxInputs = kMaxConvWidth - 1 + kMaxDecodeTokens;
  for (std::int64_t c = 0; c < channels; ++c) {
    float x[kMaxInputs];  // x[history + t]: input t; x[0 .. history): the start state
    for (std::int64_t i = 0; i < history; ++i) x[i] = bf16_to_float(start[c * history + i]);
    for (std::int64_t t = 0; t < length; ++t) x[history + t] = pre[t * channels + c];
    for (std::int64_t t = 0; t < length; ++t) {
      float acc = 0.0f;
      for (std::int64_t j = 0; j < width; ++j) acc += weight[c * width + j] * x[t + j];
      out[t * channels + c] = float_to_bf16(acc * sigmoid(acc));
      if (keep[t] == nullptr) continue;
      for (std::int64_t i = 0; i < history; ++i) {
        keep[t][c * history + i] = float_to_bf16(x[t + 1 + i]);
      }
    }
  }
}

// Byte offsets of the fp32 weight image's tensors from its kWeightImageAlignment-aligned base:
// the one layout that weight_image_bytes() sizes and place() fills.
struct WeightLayout {
  std::size_t q_proj = 0, k_proj = 0, v_proj = 0;  // [Cl, E]
  std::size_t f_a_proj = 0, f_b_proj = 0;          // [D, E], [Cl, D]
  std::size_t b_proj = 0;                          // [Hl, E]
  std::size_t g_a_proj = 0, g_b_proj = 0;          // [D, E], [Cl, D]: the low-rank gate only
  std::size_t g_proj = 0;                          // [Cl, E]: the full-rank gate only
  std::size_t o_proj = 0;                          // [E, Cl]
  std::size_t q_conv = 0, k_conv = 0, v_conv = 0;  // [Cl, W]
  std::size_t g_b_bias = 0;                        // [Cl]; its place is kept without a bias
  std::size_t o_norm = 0;                          // [D]
  std::size_t A_log = 0, dt_bias = 0;              // [Hl], [Cl]
  std::size_t total = 0;
};

WeightLayout make_weight_layout(const Config& c) {
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Hl = c.local_heads(), Cl = c.local_channels();
  AlignedRegions regions("KDA layer (CPU) weight image size", kCpuWeightImageAlignment);
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
  if (c.full_rank_gate) {
    layout.g_proj = matrix(Cl, E);
  } else {
    layout.g_a_proj = matrix(D, E);
    layout.g_b_proj = matrix(Cl, D);
  }
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
  explicit PhaseTimer(Times* times) : times_(times) { start_ = Clock::now(); }
  // Adds the time since the last call (or construction) to `phase`.
  void lap(double Times::*phase) {
    if (times_ == nullptr) return;
    const Clock::time_point now = Clock::now();
    times_->*phase += std::chrono::duration<double>(now - start_).count();
    start_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Times* times_;
  Clock::time_point start_;
};

}  // namespace

class CpuLayer final : public Layer {
 public:
  CpuLayer(const Weights& w, void* weight_image, std::size_t bytes,
           std::unique_ptr<unsigned char[]> owned_image)
      : Layer(w.config, cpu_weight_image_bytes(w.config)), owned_image_(std::move(owned_image)) {
    place(w, weight_image, bytes);
  }

  Backend backend() const noexcept override { return Backend::kCpu; }

 private:
  void run(const Batch& batch, const bf16_bits* hidden, bf16_bits* out, const State& state,
           Workspace workspace, const RunOptions& options, CoreInputs* inputs) const override;
  void place(const Weights& w, void* weight_image, std::size_t bytes);

  std::unique_ptr<unsigned char[]> owned_image_;  // make_layer() without a region: its own
  // In the image, fp32. Row-major [out, in], as the checkpoint stores them:
  const float *q_proj_ = nullptr, *k_proj_ = nullptr, *v_proj_ = nullptr, *f_a_proj_ = nullptr,
              *f_b_proj_ = nullptr, *b_proj_ = nullptr, *o_proj_ = nullptr;
  // The output gate: g_a_proj_ and g_b_proj_ (low rank), or g_proj_ (full rank); the others null.
  const float *g_a_proj_ = nullptr, *g_b_proj_ = nullptr, *g_proj_ = nullptr;
  const float *q_conv_ = nullptr, *k_conv_ = nullptr, *v_conv_ = nullptr;  // [Cl, W]
  const float* g_b_bias_ = nullptr;                                        // [Cl], null: none
  const float* o_norm_ = nullptr;                                          // [D]
  const float *A_log_ = nullptr, *dt_bias_ = nullptr;                      // [Hl], [Cl]
};

void CpuLayer::place(const Weights& w, void* weight_image, std::size_t bytes) {
  check_sizes(w);
  check_gate_weights(w);
  const WeightLayout layout = make_weight_layout(config());
  check_weight_region(weight_image, bytes, layout.total, kCpuWeightImageAlignment,
                      "KDA layer (CPU)");
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
  if (config().full_rank_gate) {
    g_proj_ = widen(layout.g_proj, w.g_proj);
  } else {
    g_a_proj_ = widen(layout.g_a_proj, w.g_a_proj);
    g_b_proj_ = widen(layout.g_b_proj, w.g_b_proj);
  }
  o_proj_ = widen(layout.o_proj, w.o_proj);
  q_conv_ = copy(layout.q_conv, w.q_conv);
  k_conv_ = copy(layout.k_conv, w.k_conv);
  v_conv_ = copy(layout.v_conv, w.v_conv);
  g_b_bias_ = w.g_b_bias.empty() ? nullptr : widen(layout.g_b_bias, w.g_b_bias);
  o_norm_ = widen(layout.o_norm, w.o_norm);
  A_log_ = copy(layout.A_log, w.A_log);
  dt_bias_ = copy(layout.dt_bias, w.dt_bias);
}

std::size_t cpu_weight_image_bytes(const Config& config) {
  validate(config);
  return make_weight_layout(config).total;
}

std::size_t cpu_workspace_bytes(const Config& config, std::int64_t tokens, std::int64_t sequences,
                                std::int64_t num_slots) {
  validate(config);
  return make_workspace_layout(Backend::kCpu, config, tokens, sequences, num_slots).total;
}

std::unique_ptr<Layer> make_cpu_layer(const Weights& w, void* weight_image, std::size_t bytes) {
  return std::make_unique<CpuLayer>(w, weight_image, bytes, nullptr);
}

std::unique_ptr<Layer> make_cpu_layer(const Weights& w) {
  check_sizes(w);  // before sizing the allocation from the config
  const std::size_t bytes = cpu_weight_image_bytes(w.config);
  // Over-allocated by one alignment: operator new[] guarantees less than the image wants.
  std::unique_ptr<unsigned char[]> owned(new unsigned char[bytes + kCpuWeightImageAlignment]);
  const auto address = reinterpret_cast<std::uintptr_t>(owned.get());
  void* image =
      reinterpret_cast<void*>(align_up<std::uintptr_t>(address, kCpuWeightImageAlignment));
  return std::make_unique<CpuLayer>(w, image, bytes, std::move(owned));
}

void CpuLayer::run(const Batch& batch, const bf16_bits* hidden, bf16_bits* out, const State& state,
                   Workspace workspace, const RunOptions& options, CoreInputs* inputs) const {
  const Config& c = config();
  const std::int64_t T = batch.tokens, N = batch.sequences, E = c.hidden_size, D = c.head_dim;
  const std::int64_t W = c.conv_width, Hl = c.local_heads(), Cl = c.local_channels();
  const bool decode = batch.decode_tokens > 0;

  // ---- checks, before anything is written ---------------------------------------------------
  const HostCuSeqlens cu_host =
      decode ? HostCuSeqlens{} : HostCuSeqlens{batch.cu_seqlens, batch.cu_seqlens_i32};
  const WorkspaceLayout layout = checked_forward_layout(
      Backend::kCpu, c, batch, cu_host, batch.slots, batch.num_accepted,
      HostFold{batch.fold_rows, batch.fold_counts}, state, hidden, out, workspace,
      inputs != nullptr ? kCoreInputs : kForward, inputs != nullptr);
  check_run_options(options, inputs != nullptr ? kCoreInputs : kForward);
  const WorkspaceRegions regions(layout, workspace.ptr);
  using L = WorkspaceLayout;
  if (inputs != nullptr) {
    const Intermediates at = regions.intermediates();
    *inputs = CoreInputs{at.q, at.k, at.v, at.g, at.beta, A_log_, dt_bias_};
  }
  if (batch.checkpoints > 0) {
    check_checkpoints(batch, cu_host, batch.slots, state.num_slots,
                      regions.at<std::uint64_t>(&L::slot_bitmap), kForward);
  }
  // Nothing to compute, every state stays as it is; but a prefill's checkpoint requests of empty
  // sequences (offset 0) hold their initial states, as in a batch with tokens (below).
  if (T == 0 && (batch.checkpoints == 0 || N == 0)) return;
  // A verify step's rows start from their slot at num_accepted - 1 (kda.hpp).
  const bool verify = batch.num_accepted != nullptr;
  const bool folds = batch.fold_sequences > 0;  // the last records step's commit, deferred here
  const std::int64_t per_row = verify ? batch.decode_tokens : 1;
  auto slot_of = [&](std::int64_t n) -> std::int64_t {
    if (batch.slots == nullptr) return n;
    return batch.slots[n * per_row + (verify ? batch.num_accepted[n] - 1 : 0)];
  };
  const CpuOptions cpu{options.cpu_threads};
  Problem core = core_prefill_problem(c, T, N, batch.slots != nullptr ? state.num_slots : 0,
                                      state.recurrent_dtype);
  core.padding_slot = batch.padding_slot;  // the core skips the same rows

  auto* xf = regions.at<float>(&L::hidden_f32);
  auto* pre = regions.at<float>(&L::pre_f32);
  auto* lowrank = regions.at<float>(&L::lowrank_f32);
  const Intermediates m = regions.intermediates();
  bf16_bits *q = m.q, *k = m.k, *v = m.v, *g = m.g, *o = m.o, *beta = m.beta;
  float* gate = m.gate;
  // A decode batch is a prefill of sequences of decode_tokens tokens each. int32 cu_seqlens are
  // widened into the same workspace row (N + 1 host values, against the layer's O(T) work), so
  // that everything below reads one dtype.
  const std::int64_t* cu_seqlens = batch.cu_seqlens;
  if (decode || cu_seqlens == nullptr) {
    auto* cu = regions.at<std::int64_t>(&L::cu);
    for (std::int64_t n = 0; n <= N; ++n) cu[n] = decode ? n * batch.decode_tokens : cu_host[n];
    cu_seqlens = cu;
  }
  const std::int64_t conv_row = Cl * (W - 1);  // one sequence's conv state, in elements
  // The conv states of sequence n's checkpoint requests into `pool`'s rows: from its pre-conv
  // inputs `seq_pre` and its initial state `conv_state`, which its conv then replaces.
  auto conv_checkpoints = [&](std::int64_t n, const float* seq_pre, const bf16_bits* conv_state,
                              bf16_bits* pool) {
    for (std::int64_t r = 0; r < batch.checkpoints; ++r) {
      const std::int64_t offset = batch.checkpoint_offsets[n * batch.checkpoints + r];
      const std::int32_t slot = batch.checkpoint_slots[n * batch.checkpoints + r];
      if (offset < 0 || is_padding(batch, slot)) continue;
      conv_state_at(seq_pre, offset, Cl, W, conv_state, pool + std::int64_t{slot} * conv_row);
    }
  };
  // The core's call: a prefill, states in place in the pool, or (a verify step, a records step,
  // a fold) the operator's decode.
  const bool core_steps = verify || batch.records || folds;
  auto core_prefill_tensors = [&](Problem* prefill) {
    Tensors t = core_tensors<Tensors>(m, A_log_, dt_bias_);
    t.cu_seqlens = cu_seqlens;
    t.initial_state = state.recurrent;
    t.final_state = state.recurrent;  // updated in place
    t.state_slots = batch.slots;
    *prefill = with_checkpoints(core, batch, &t);
    return t;
  };
  auto core_step_tensors = [&] {
    DecodeTensors t = core_tensors<DecodeTensors>(m, A_log_, dt_bias_);
    add_step_batch(t, batch, state);
    return t;
  };
  auto run_core_prefill = [&] {
    Problem prefill;
    const Tensors t = core_prefill_tensors(&prefill);
    KDA_NVTX_RANGE("core");
    throw_if_error(forward_cpu(prefill, t, regions.core(), cpu), "KDA layer forward (CPU): core");
  };
  // The core's own checks of its call (its tensors against each other: the pools, the workspace,
  // the records) before the conv below writes any state.
  if (inputs == nullptr) {
    if (core_steps) {
      throw_if_error(validate(decode_step_problem(c, batch, state), core_step_tensors()),
                     "KDA layer forward (CPU): core");
    } else {
      Problem prefill;
      const Tensors t = core_prefill_tensors(&prefill);
      throw_if_error(validate(prefill, t), "KDA layer forward (CPU): core");
    }
  }
  if (T == 0) {
    // A prefill of empty sequences with checkpoint requests (checked: a prefill, not core inputs):
    // each request's conv states and recurrent state are its sequence's initial ones.
    for (std::int64_t n = 0; n < N; ++n) {
      if (is_padding(batch, slot_of(n))) continue;
      for (bf16_bits* pool : {state.conv_q, state.conv_k, state.conv_v}) {
        conv_checkpoints(n, nullptr, pool + slot_of(n) * conv_row, pool);
      }
    }
    run_core_prefill();
    return;
  }
  PhaseTimer timer(options.times);

  // ---- q, k, v: projection, then conv + SiLU per sequence ------------------------------------
  for (std::int64_t i = 0; i < T * E; ++i) xf[i] = bf16_to_float(hidden[i]);
  struct ConvBranch {
    const float* proj;
    const float* conv;
    bf16_bits* pool;
    bf16_bits* out;
    std::int64_t index;  // q, k, v: 0, 1, 2 (its columns in the conv records)
  };
  for (const ConvBranch& branch : {ConvBranch{q_proj_, q_conv_, state.conv_q, q, 0},
                                   ConvBranch{k_proj_, k_conv_, state.conv_k, k, 1},
                                   ConvBranch{v_proj_, v_conv_, state.conv_v, v, 2}}) {
    {
      KDA_NVTX_RANGE("projections");  // the same range names as the CUDA layer's
      project(xf, T, E, branch.proj, Cl, pre, options.cpu_threads);
    }
    timer.lap(&Times::projections);
    {
      KDA_NVTX_RANGE("conv");
      for (std::int64_t n = 0; n < N; ++n) {
        const std::int64_t begin = cu_seqlens[n], length = cu_seqlens[n + 1] - begin;
        const bool padding = is_padding(batch, slot_of(n));
        if (padding && branch.out == q) {
          // A padding sequence's q is zero, so the core's output for it is exactly zero (q̂ =
          // 0), and with it the layer's: padding rows produce zeros, as in decode.
          std::fill(q + begin * Cl, q + (begin + length) * Cl, bf16_bits{0});
          continue;
        }
        bf16_bits* conv_state = padding ? nullptr : branch.pool + slot_of(n) * conv_row;
        if (folds && !padding && batch.fold_rows[n] >= 0) {
          // The deferred commit (layer.hpp, Batch::fold_sequences): the conv state becomes the last
          // W-1 of old ++ the folded row's accepted inputs, as commit() shifts it, before the conv.
          shift_conv_states(conv_state, Cl, W - 1, batch.fold_counts[n],
                            state.fold_conv_records +
                                batch.fold_rows[n] * batch.fold_decode_tokens * 3 * Cl +
                                branch.index * Cl,
                            3 * Cl);
        }
        if (batch.checkpoints > 0 && !padding) {
          // Checkpoints first: they read the sequence's initial conv state, which the conv
          // below replaces.
          conv_checkpoints(n, pre + begin * Cl, conv_state, branch.pool);
        }
        if ((verify || batch.records) && !padding) {
          bf16_bits* keep[kMaxDecodeTokens] = {};  // a records step keeps none
          for (std::int64_t t = 0; t < length && verify; ++t) {
            const std::int32_t slot = batch.slots[n * per_row + t];
            keep[t] = is_padding(batch, slot) ? nullptr : branch.pool + slot * conv_row;
          }
          if (batch.records) {
            // The conv inputs, from which the commit shifts the conv state: pre holds bf16
            // values (the projection's rounding), so they are kept exactly.
            const std::int64_t branch_index = branch.index;
            for (std::int64_t t = 0; t < length; ++t) {
              bf16_bits* record = state.conv_records + (begin + t) * 3 * Cl + branch_index * Cl;
              const float* input = pre + (begin + t) * Cl;
              for (std::int64_t ch = 0; ch < Cl; ++ch) record[ch] = float_to_bf16(input[ch]);
            }
          }
          conv_silu_kept(pre + begin * Cl, length, Cl, W, branch.conv, conv_state, keep,
                         branch.out + begin * Cl);
          continue;
        }
        conv_silu(pre + begin * Cl, length, Cl, W, branch.conv, conv_state,
                  branch.out + begin * Cl);
      }
    }
    timer.lap(&Times::conv);
  }

  // ---- forget gate g_raw = (x·W_faᵀ)·W_fbᵀ and beta_raw = x·W_bᵀ (activated inside the core) ---
  {
    KDA_NVTX_RANGE("projections");
    project(xf, T, E, f_a_proj_, D, lowrank, options.cpu_threads);
    project(lowrank, T, D, f_b_proj_, Cl, pre, options.cpu_threads);
    for (std::int64_t i = 0; i < T * Cl; ++i) g[i] = float_to_bf16(pre[i]);
    project(xf, T, E, b_proj_, Hl, pre, options.cpu_threads);
    for (std::int64_t i = 0; i < T * Hl; ++i) beta[i] = float_to_bf16(pre[i]);
    // Output gate (x·W_gaᵀ → bf16)·W_gbᵀ [+ bias], or x·W_gᵀ [+ bias] (full rank), into `gate`
    // for the norm, rounded once after the bias. The full-rank form as Kimi K3 runs it (read: the
    // K3 reference modeling_kimi_linear.py and sglang's K3 KimiDeltaAttention: g = g_proj(x), one
    // bf16 Linear [C, E] without bias, column-parallel, into FusedRMSNormGated(o, g)).
    if (inputs != nullptr) {  // the core's inputs are all there: no output gate
      timer.lap(&Times::projections);
      return;
    }
    const float* gate_in = xf;  // the last product's input [T, gate_k] and weight [Cl, gate_k]
    const float* gate_weight = g_proj_;
    std::int64_t gate_k = E;
    if (!c.full_rank_gate) {
      project(xf, T, E, g_a_proj_, D, lowrank, options.cpu_threads);
      gate_in = lowrank;
      gate_weight = g_b_proj_;
      gate_k = D;
    }
    project(gate_in, T, gate_k, gate_weight, Cl, gate, options.cpu_threads, g_b_bias_);
  }
  timer.lap(&Times::projections);

  // ---- the KDA core: one call for the batch, states in place in the pool -------------------
  // (A verify step: the operator's decode, which keeps the state after every token; padding rows
  // leave their o rows unwritten, so they are zeroed first.)
  // (A fold: the operator's decode too, which folds the records into each state first.)
  if (core_steps) {
    const DecodeProblem step = decode_step_problem(c, batch, state);
    const DecodeTensors t = core_step_tensors();
    std::fill(o, o + T * Cl, bf16_bits{0});
    KDA_NVTX_RANGE("core");
    throw_if_error(decode_cpu(step, t, regions.core(), cpu), "KDA layer forward (CPU): core");
  } else {
    run_core_prefill();
  }
  timer.lap(&Times::core);

  // ---- gated RMSNorm per (token, head), y into `gate` over the gate it reads -----------------
  {
    KDA_NVTX_RANGE("norm");
    for (std::int64_t row = 0; row < T * Hl; ++row) {
      const bf16_bits* o_row = o + row * D;
      float* gate_row = gate + row * D;
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
  timer.lap(&Times::norm);

  // ---- out = y·W_oᵀ (a partial sum over tensor-parallel ranks) -------------------------------
  {
    KDA_NVTX_RANGE("o_proj");
    project(gate, T, Cl, o_proj_, E, xf, options.cpu_threads);
    for (std::int64_t i = 0; i < T * E; ++i) out[i] = float_to_bf16(xf[i]);
  }
  timer.lap(&Times::o_proj);
}

}  // namespace kda::layer::detail
