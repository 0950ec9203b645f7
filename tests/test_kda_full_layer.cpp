// The whole KDA layer on the CPU (kda_full_layer.hpp): against an fp64 token-by-token reference
// written here, state round trips (chained prefills, prefill + decode steps), varlen with empty and
// one-token sequences, tensor-parallel shards summing to the whole layer, weights by checkpoint
// name (prefixed, bare, sharded index), the weight image in caller memory, and the errors for bad
// weights and bad calls.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "full_layer_test_util.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/checkpoint.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/kda_full_layer.hpp"
#include "kda/engine/safetensors.hpp"
#include "temp_dir.hpp"

using kda::bf16_bits;
using kda::bf16_to_float;
using kda::DType;
using kda::float_to_bf16;
using kda::GateMode;
using kda::engine::Checkpoint;
using kda::engine::FullLayerBatch;
using kda::engine::FullLayerConfig;
using kda::engine::FullLayerCpu;
using kda::engine::FullLayerState;
using kda::engine::FullLayerWeights;
using kda::engine::Tensor;
using kda::test::TempDir;

using kda::test::error_of;
using kda::test::random_bf16;
using kda::test::relative_error;
using kda::test::with_bias_and_norm;

namespace {

FullLayerConfig small_config(GateMode gate = GateMode::kSoftplus) {
  FullLayerConfig c;
  c.hidden_size = 48;
  c.num_heads = 4;
  c.head_dim = 16;
  c.conv_width = 4;
  c.gate = gate;
  c.lower_bound = -5.0f;
  c.norm_eps = 1e-5f;
  return c;
}

// State pools of one layer (conv states bf16, recurrent state f32) and the view the layer takes.
struct Pools {
  std::int64_t slots = 0;
  std::vector<bf16_bits> conv_q, conv_k, conv_v;
  std::vector<float> recurrent;

  Pools(const FullLayerConfig& c, std::int64_t num_slots) : slots(num_slots) {
    const auto conv = static_cast<std::size_t>(num_slots * c.local_channels() * (c.conv_width - 1));
    conv_q.assign(conv, 0);
    conv_k.assign(conv, 0);
    conv_v.assign(conv, 0);
    recurrent.assign(
        static_cast<std::size_t>(num_slots * c.local_heads() * c.head_dim * c.head_dim), 0.0f);
  }
  void randomize(std::uint64_t seed) {
    conv_q = random_bf16(conv_q.size(), 2.0f, seed + 1);
    conv_k = random_bf16(conv_k.size(), 2.0f, seed + 2);
    conv_v = random_bf16(conv_v.size(), 2.0f, seed + 3);
    const std::vector<bf16_bits> bits = random_bf16(recurrent.size(), 0.5f, seed + 4);
    for (std::size_t i = 0; i < bits.size(); ++i) recurrent[i] = bf16_to_float(bits[i]);
  }
  FullLayerState view() {
    FullLayerState s;
    s.num_slots = slots;
    s.conv_q = conv_q.data();
    s.conv_k = conv_k.data();
    s.conv_v = conv_v.data();
    s.recurrent = recurrent.data();
    s.recurrent_dtype = DType::kF32;
    return s;
  }
};

// One forward with a workspace of exactly the size asked for.
std::vector<bf16_bits> run(const FullLayerCpu& layer, const std::vector<bf16_bits>& hidden,
                           const std::vector<std::int64_t>& cu, Pools* pools,
                           const std::vector<std::int32_t>& slots = {}) {
  FullLayerBatch batch;
  batch.sequences = static_cast<std::int64_t>(cu.size()) - 1;
  batch.tokens = cu.back();
  batch.cu_seqlens = cu.data();
  batch.slots = slots.empty() ? nullptr : slots.data();
  std::vector<unsigned char> workspace(
      layer.workspace_bytes(batch.tokens, batch.sequences, pools->slots));
  std::vector<bf16_bits> out(hidden.size(), float_to_bf16(-7.0f));
  layer.forward(batch, hidden.data(), out.data(), pools->view(),
                kda::Workspace{workspace.data(), workspace.size()});
  return out;
}

// ---------------------------------------------------------------------------------------------
// fp64 reference: the layer token by token, written from the math alone, rounding to bf16 at the
// same points as the implementation (docs/LAYER.md). Whole layer only (tp_size 1).
// ---------------------------------------------------------------------------------------------
double bf16_round(double x) { return bf16_to_float(float_to_bf16(static_cast<float>(x))); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Reference {
  std::vector<double> out;                     // [T, E]
  std::vector<double> conv_q, conv_k, conv_v;  // [N, C, W-1]
  std::vector<double> recurrent;               // [N, H, V, K]
};

// initial: pools of N rows (row n for sequence n).
Reference reference_layer(const FullLayerWeights& w, const std::vector<bf16_bits>& hidden,
                          const std::vector<std::int64_t>& cu, const Pools& initial) {
  const FullLayerConfig& c = w.config;
  const std::int64_t E = c.hidden_size, H = c.num_heads, D = c.head_dim, W = c.conv_width;
  const std::int64_t C = H * D, N = static_cast<std::int64_t>(cu.size()) - 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto weight = [](const std::vector<bf16_bits>& m, std::int64_t row, std::int64_t cols,
                   std::int64_t col) {
    return static_cast<double>(bf16_to_float(m[row * cols + col]));
  };

  Reference ref;
  ref.out.assign(static_cast<std::size_t>(cu.back() * E), 0.0);
  ref.conv_q.resize(initial.conv_q.size());
  ref.conv_k.resize(initial.conv_k.size());
  ref.conv_v.resize(initial.conv_v.size());
  for (std::size_t i = 0; i < ref.conv_q.size(); ++i) {
    ref.conv_q[i] = bf16_to_float(initial.conv_q[i]);
    ref.conv_k[i] = bf16_to_float(initial.conv_k[i]);
    ref.conv_v[i] = bf16_to_float(initial.conv_v[i]);
  }
  ref.recurrent.assign(initial.recurrent.begin(), initial.recurrent.end());

  for (std::int64_t n = 0; n < N; ++n) {
    for (std::int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      std::vector<double> x(E);
      for (std::int64_t e = 0; e < E; ++e) x[e] = bf16_to_float(hidden[t * E + e]);
      // y[rows] = round(x · M[rows, cols]ᵀ)
      auto linear = [&](const std::vector<bf16_bits>& m, std::int64_t rows_n,
                        const std::vector<double>& in) {
        std::vector<double> y(rows_n);
        for (std::int64_t r = 0; r < rows_n; ++r) {
          double acc = 0.0;
          for (std::size_t i = 0; i < in.size(); ++i)
            acc +=
                weight(m, r, static_cast<std::int64_t>(in.size()), static_cast<std::int64_t>(i)) *
                in[i];
          y[r] = bf16_round(acc);
        }
        return y;
      };
      // Conv over (state ++ this input), SiLU; the state shifts by one.
      auto conv = [&](const std::vector<double>& pre, const std::vector<float>& taps,
                      std::vector<double>* state) {
        std::vector<double> y(C);
        for (std::int64_t ch = 0; ch < C; ++ch) {
          double* s = state->data() + (n * C + ch) * (W - 1);
          double acc = taps[ch * W + (W - 1)] * pre[ch];
          for (std::int64_t j = 0; j < W - 1; ++j) acc += taps[ch * W + j] * s[j];
          y[ch] = bf16_round(acc * sigmoid(acc));
          for (std::int64_t j = 0; j + 1 < W - 1; ++j) s[j] = s[j + 1];
          if (W > 1) s[W - 2] = pre[ch];
        }
        return y;
      };
      const std::vector<double> q = conv(linear(w.q_proj, C, x), w.q_conv, &ref.conv_q);
      const std::vector<double> k = conv(linear(w.k_proj, C, x), w.k_conv, &ref.conv_k);
      const std::vector<double> v = conv(linear(w.v_proj, C, x), w.v_conv, &ref.conv_v);
      const std::vector<double> g_raw = linear(w.f_b_proj, C, linear(w.f_a_proj, D, x));
      const std::vector<double> b_raw = linear(w.b_proj, H, x);
      const std::vector<double> ga = linear(w.g_a_proj, D, x);
      std::vector<double> gate(C);
      for (std::int64_t ch = 0; ch < C; ++ch) {
        double acc = w.g_b_bias.empty() ? 0.0 : bf16_to_float(w.g_b_bias[ch]);
        for (std::int64_t d = 0; d < D; ++d) acc += weight(w.g_b_proj, ch, D, d) * ga[d];
        gate[ch] = bf16_round(acc);
      }

      std::vector<double> y(C);
      for (std::int64_t h = 0; h < H; ++h) {
        // KDA recurrence, state S[v][k] (V-first).
        double* S = ref.recurrent.data() + (n * H + h) * D * D;
        double qn = 0.0, kn = 0.0;
        for (std::int64_t d = 0; d < D; ++d) {
          qn += q[h * D + d] * q[h * D + d];
          kn += k[h * D + d] * k[h * D + d];
        }
        qn = 1.0 / std::sqrt(qn + 1e-6);
        kn = 1.0 / std::sqrt(kn + 1e-6);
        const double beta = sigmoid(b_raw[h]);
        const double a = std::exp(static_cast<double>(w.A_log[h]));
        std::vector<double> decay(D), kh(D), qh(D);
        for (std::int64_t d = 0; d < D; ++d) {
          const double u = g_raw[h * D + d] + w.dt_bias[h * D + d];
          const double log_decay = c.gate == GateMode::kSoftplus ? -a * std::log1p(std::exp(u))
                                                                 : c.lower_bound * sigmoid(a * u);
          decay[d] = std::exp(log_decay);
          kh[d] = k[h * D + d] * kn;
          qh[d] = q[h * D + d] * qn;
        }
        std::vector<double> o(D);
        for (std::int64_t vv = 0; vv < D; ++vv) {
          double* row = S + vv * D;
          double sk = 0.0;
          for (std::int64_t d = 0; d < D; ++d) {
            row[d] *= decay[d];
            sk += row[d] * kh[d];
          }
          const double delta = beta * (v[h * D + vv] - sk);
          double so = 0.0;
          for (std::int64_t d = 0; d < D; ++d) {
            row[d] += delta * kh[d];
            so += row[d] * qh[d];
          }
          o[vv] = bf16_round(scale * so);
        }
        // Gated RMSNorm.
        double ms = 0.0;
        for (double value : o) ms += value * value;
        const double inv_rms = 1.0 / std::sqrt(ms / static_cast<double>(D) + c.norm_eps);
        for (std::int64_t d = 0; d < D; ++d) {
          y[h * D + d] =
              bf16_round(o[d] * inv_rms * bf16_to_float(w.o_norm[d]) * sigmoid(gate[h * D + d]));
        }
      }
      const std::vector<double> out = linear(w.o_proj, E, y);
      for (std::int64_t e = 0; e < E; ++e) ref.out[t * E + e] = out[e];
    }
  }
  return ref;
}

}  // namespace

TEST_CASE("whole layer matches the fp64 reference (varlen with empty and 1-token sequences)") {
  for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
    CAPTURE(static_cast<int>(gate));
    const FullLayerConfig config = small_config(gate);
    FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 7, 3);
    if (gate == GateMode::kLowerBound) weights = with_bias_and_norm(std::move(weights));
    const FullLayerCpu layer(weights);
    const std::vector<std::int64_t> cu = {0, 5, 5, 6, 23, 40};  // lengths 5, 0, 1, 17, 17
    const std::vector<bf16_bits> hidden =
        random_bf16(static_cast<std::size_t>(40 * config.hidden_size), 2.0f, 11);

    Pools pools(config, 5);
    pools.randomize(21);  // every sequence continues from a non-zero conv and recurrent state
    const Reference ref = reference_layer(weights, hidden, cu, pools);
    const std::vector<bf16_bits> out = run(layer, hidden, cu, &pools);

    const double out_error = relative_error(out, ref.out);
    MESSAGE("out relative error " << out_error);
    CHECK(out_error <= 5e-3);
    CHECK(relative_error(pools.conv_q, ref.conv_q) <= 5e-3);
    CHECK(relative_error(pools.conv_k, ref.conv_k) <= 5e-3);
    CHECK(relative_error(pools.conv_v, ref.conv_v) <= 5e-3);
    // The empty sequence (slot 1) keeps its state bit for bit.
    Pools before(config, 5);
    before.randomize(21);
    const std::size_t conv_row = pools.conv_q.size() / 5, rec_row = pools.recurrent.size() / 5;
    CHECK(std::equal(pools.conv_q.begin() + conv_row, pools.conv_q.begin() + 2 * conv_row,
                     before.conv_q.begin() + conv_row));
    CHECK(std::equal(pools.recurrent.begin() + rec_row, pools.recurrent.begin() + 2 * rec_row,
                     before.recurrent.begin() + rec_row));
    const double state_error = relative_error(pools.recurrent, ref.recurrent);
    MESSAGE("recurrent state relative error " << state_error);
    CHECK(state_error <= 5e-3);
  }
}

TEST_CASE("sequences on scattered slots equal the same sequences on rows 0..N-1") {
  const FullLayerConfig config = small_config();
  const FullLayerCpu layer(kda::engine::random_full_layer_weights(config, 3, 0));
  const std::vector<std::int64_t> cu = {0, 4, 4, 13, 14};
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(14 * config.hidden_size), 2.0f, 5);
  Pools identity(config, 4);
  const std::vector<bf16_bits> expected = run(layer, hidden, cu, &identity);

  const std::vector<std::int32_t> slots = {5, 0, 1, 3};  // runs {5}, {0, 1}, {3}
  Pools scattered(config, 6);
  const std::vector<bf16_bits> out = run(layer, hidden, cu, &scattered, slots);
  CHECK(out == expected);
  const std::size_t conv_row = identity.conv_q.size() / 4, rec_row = identity.recurrent.size() / 4;
  for (std::size_t n = 0; n < slots.size(); ++n) {
    const std::size_t s = static_cast<std::size_t>(slots[n]);
    CHECK(std::equal(identity.conv_v.begin() + n * conv_row,
                     identity.conv_v.begin() + (n + 1) * conv_row,
                     scattered.conv_v.begin() + s * conv_row));
    CHECK(std::equal(identity.recurrent.begin() + n * rec_row,
                     identity.recurrent.begin() + (n + 1) * rec_row,
                     scattered.recurrent.begin() + s * rec_row));
  }
}

TEST_CASE("state round trip: one prefill equals two chained prefills") {
  const FullLayerConfig config = small_config();
  const FullLayerCpu layer(kda::engine::random_full_layer_weights(config, 1, 2));
  const std::int64_t E = config.hidden_size;
  // Two sequences of 9 and 13 tokens, split 2 + 7 (shorter than W-1 first) and 8 + 5.
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(22 * E), 2.0f, 8);
  Pools whole(config, 2);
  const std::vector<bf16_bits> expected = run(layer, hidden, {0, 9, 22}, &whole);

  auto tokens = [&](std::int64_t begin, std::int64_t end) {
    return std::vector<bf16_bits>(hidden.begin() + begin * E, hidden.begin() + end * E);
  };
  std::vector<bf16_bits> first = tokens(0, 2), second = tokens(2, 9);
  const std::vector<bf16_bits> first_b = tokens(9, 17), second_b = tokens(17, 22);
  first.insert(first.end(), first_b.begin(), first_b.end());
  second.insert(second.end(), second_b.begin(), second_b.end());
  Pools chained(config, 2);
  const std::vector<bf16_bits> out1 = run(layer, first, {0, 2, 10}, &chained);
  const std::vector<bf16_bits> out2 = run(layer, second, {0, 7, 12}, &chained);

  std::vector<bf16_bits> out;  // back in the order of the whole prefill
  out.insert(out.end(), out1.begin(), out1.begin() + 2 * E);
  out.insert(out.end(), out2.begin(), out2.begin() + 7 * E);
  out.insert(out.end(), out1.begin() + 2 * E, out1.end());
  out.insert(out.end(), out2.begin() + 7 * E, out2.end());
  CHECK(relative_error(out, expected) <= 1e-3);
  CHECK(chained.conv_q == whole.conv_q);
  CHECK(chained.conv_k == whole.conv_k);
  CHECK(chained.conv_v == whole.conv_v);
  CHECK(relative_error(chained.recurrent, whole.recurrent) <= 1e-5);
}

TEST_CASE("state round trip: prefill then one-token decode steps equal one longer prefill") {
  const FullLayerConfig config = small_config(GateMode::kLowerBound);
  const FullLayerCpu layer(
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 4, 1)));
  const std::int64_t E = config.hidden_size;
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(14 * E), 2.0f, 9);
  const std::vector<std::int32_t> slots = {2, 0};  // sequence 0 on slot 2, sequence 1 on slot 0
  Pools whole(config, 3);
  const std::vector<bf16_bits> expected = run(layer, hidden, {0, 9, 14}, &whole, slots);

  // Prefill 6 and 2 tokens, then 3 steps of one token per sequence.
  auto row = [&](std::int64_t token) {
    return std::vector<bf16_bits>(hidden.begin() + token * E, hidden.begin() + (token + 1) * E);
  };
  std::vector<bf16_bits> prefill(hidden.begin(), hidden.begin() + 6 * E);
  prefill.insert(prefill.end(), hidden.begin() + 9 * E, hidden.begin() + 11 * E);
  Pools stepped(config, 3);
  const std::vector<bf16_bits> prefill_out = run(layer, prefill, {0, 6, 8}, &stepped, slots);
  std::vector<bf16_bits> out(hidden.size());
  std::copy(prefill_out.begin(), prefill_out.begin() + 6 * E, out.begin());
  std::copy(prefill_out.begin() + 6 * E, prefill_out.end(), out.begin() + 9 * E);
  for (std::int64_t step = 0; step < 3; ++step) {
    std::vector<bf16_bits> step_in = row(6 + step);
    const std::vector<bf16_bits> b = row(11 + step);
    step_in.insert(step_in.end(), b.begin(), b.end());
    const std::vector<bf16_bits> step_out = run(layer, step_in, {0, 1, 2}, &stepped, slots);
    std::copy(step_out.begin(), step_out.begin() + E, out.begin() + (6 + step) * E);
    std::copy(step_out.begin() + E, step_out.end(), out.begin() + (11 + step) * E);
  }
  CHECK(relative_error(out, expected) <= 1e-3);
  CHECK(stepped.conv_q == whole.conv_q);
  CHECK(stepped.conv_v == whole.conv_v);
  CHECK(relative_error(stepped.recurrent, whole.recurrent) <= 1e-5);
}

TEST_CASE("a batch of empty sequences writes nothing and keeps every state") {
  const FullLayerConfig config = small_config();
  const FullLayerCpu layer(kda::engine::random_full_layer_weights(config, 2, 0));
  Pools pools(config, 3);
  pools.randomize(4);
  Pools before(config, 3);
  before.randomize(4);
  const std::vector<bf16_bits> out = run(layer, {}, {0, 0, 0, 0}, &pools);
  CHECK(out.empty());
  CHECK(pools.conv_k == before.conv_k);
  CHECK(pools.recurrent == before.recurrent);
}

TEST_CASE("a layer whose weight image is in caller memory equals a self-owned one bit for bit") {
  constexpr std::size_t kAlign = FullLayerCpu::kWeightImageAlignment;
  for (const bool bias : {false, true}) {
    CAPTURE(bias);
    const FullLayerConfig config = small_config(bias ? GateMode::kLowerBound : GateMode::kSoftplus);
    FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 6, 3);
    if (bias) weights = with_bias_and_norm(weights);
    const std::size_t needed = FullLayerCpu::weight_image_bytes(config);
    CHECK(needed % kAlign == 0);
    // Every tensor widened to fp32, each at an aligned offset: at least 4 bytes per element.
    const std::size_t elements =
        weights.q_proj.size() + weights.k_proj.size() + weights.v_proj.size() +
        weights.f_a_proj.size() + weights.f_b_proj.size() + weights.b_proj.size() +
        weights.g_a_proj.size() + weights.g_b_proj.size() + weights.o_proj.size() +
        weights.q_conv.size() + weights.k_conv.size() + weights.v_conv.size() +
        static_cast<std::size_t>(config.local_channels()) /* g_b bias, kept without one */ +
        weights.o_norm.size() + weights.A_log.size() + weights.dt_bias.size();
    CHECK(needed >= 4 * elements);
    CHECK(needed < 4 * elements + 16 * kAlign);

    // The region sits inside a larger one filled with a pattern: the layer writes its image only.
    std::vector<unsigned char> memory(needed + 3 * kAlign, 0xA5);
    unsigned char* region = kda::test::first_aligned(memory, kAlign) + kAlign;
    const std::vector<std::int64_t> cu = {0, 7, 8, 20};
    const std::vector<bf16_bits> hidden =
        random_bf16(static_cast<std::size_t>(20 * config.hidden_size), 2.0f, 12);
    Pools own_pools(config, 3), placed_pools(config, 3);
    own_pools.randomize(13);
    placed_pools.randomize(13);
    const FullLayerCpu own(weights);
    const FullLayerCpu placed(weights, region, needed + kAlign);  // a larger region is fine
    CHECK(own.weight_bytes() == needed);
    CHECK(placed.weight_bytes() == needed);
    const std::vector<bf16_bits> expected = run(own, hidden, cu, &own_pools);
    CHECK(run(placed, hidden, cu, &placed_pools) == expected);
    CHECK(placed_pools.conv_q == own_pools.conv_q);
    CHECK(placed_pools.conv_v == own_pools.conv_v);
    CHECK(placed_pools.recurrent == own_pools.recurrent);
    CHECK(std::all_of(memory.data(), region, [](unsigned char b) { return b == 0xA5; }));
    CHECK(std::all_of(region + needed, memory.data() + memory.size(),
                      [](unsigned char b) { return b == 0xA5; }));

    // Refused before a byte is written, naming the numbers.
    std::vector<unsigned char> other(needed + 2 * kAlign, 0x5A);
    unsigned char* aligned = kda::test::first_aligned(other, kAlign);
    auto refusal = [&](void* at, std::size_t bytes) {
      return kda::test::weight_region_refusal<FullLayerCpu>(weights, at, bytes);
    };
    CHECK(refusal(aligned, needed - 1) ==
          "KDA layer: the weight image region is too small: " + std::to_string(needed - 1) +
              " bytes, the layer's weights need " + std::to_string(needed) +
              " (weight_image_bytes)");
    CHECK(refusal(aligned + 4, needed) ==
          "KDA layer: the weight image region is not " + std::to_string(kAlign) + "-byte aligned");
    CHECK(refusal(nullptr, needed) == "KDA layer: the weight image region is null");
    CHECK(std::all_of(other.begin(), other.end(), [](unsigned char b) { return b == 0x5A; }));
  }
  // A tensor-parallel rank holds its heads only: a smaller image.
  FullLayerConfig shard = small_config();
  const std::size_t whole_image = FullLayerCpu::weight_image_bytes(shard);
  shard.tp_size = 2;
  CHECK(FullLayerCpu::weight_image_bytes(shard) < whole_image);
  shard.tp_size = 3;  // does not divide the heads
  CHECK(error_of([&] { FullLayerCpu::weight_image_bytes(shard); }).find("tp_size 3") !=
        std::string::npos);
}

TEST_CASE("tensor parallel: the tp_size = 2 ranks' partial outputs sum to the whole layer") {
  FullLayerConfig config = small_config();
  const FullLayerWeights full =
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 5, 4));
  const std::vector<std::int64_t> cu = {0, 11, 12, 30};
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(30 * config.hidden_size), 2.0f, 6);
  Pools whole_pools(config, 3);
  const std::vector<bf16_bits> expected = run(FullLayerCpu(full), hidden, cu, &whole_pools);

  std::vector<double> sum(expected.size(), 0.0);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    // Random weights of a rank are the rank's shard of the whole layer's random weights.
    config.tp_size = 2;
    config.tp_rank = rank;
    const FullLayerWeights shard = kda::engine::shard_full_layer_weights(full, 2, rank);
    CHECK(kda::engine::random_full_layer_weights(config, 5, 4).q_proj == shard.q_proj);
    CHECK(kda::engine::random_full_layer_weights(config, 5, 4).o_proj == shard.o_proj);
    Pools pools(shard.config, 3);
    const std::vector<bf16_bits> partial = run(FullLayerCpu(shard), hidden, cu, &pools);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += bf16_to_float(partial[i]);
    // The rank's recurrent states are the whole layer's states of its heads.
    const std::int64_t Hl = shard.config.local_heads(), D = config.head_dim;
    std::vector<float> expected_state;
    for (std::int64_t n = 0; n < 3; ++n) {
      const auto begin =
          whole_pools.recurrent.begin() + ((n * config.num_heads + rank * Hl) * D * D);
      expected_state.insert(expected_state.end(), begin, begin + Hl * D * D);
    }
    CHECK(relative_error(pools.recurrent, expected_state) <= 1e-5);
  }
  const double error = relative_error(expected, sum);
  MESSAGE("tp 2 sum vs tp 1 relative error " << error);
  CHECK(error <= 5e-3);
}

TEST_CASE("weights round trip through safetensors, with and without the layer prefix") {
  const FullLayerConfig config = small_config();
  const FullLayerWeights weights =
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 9, 5));
  TempDir dir;
  for (const std::string prefix : {std::string(), kda::engine::full_layer_tensor_prefix(5)}) {
    CAPTURE(prefix);
    const std::string path = dir.file("layer.safetensors");
    kda::engine::save_safetensors(path, kda::engine::full_layer_weight_tensors(weights, prefix));
    const FullLayerWeights loaded =
        kda::engine::load_full_layer_weights(Checkpoint::open(path), 5, config);
    CHECK(loaded.q_proj == weights.q_proj);
    CHECK(loaded.v_conv == weights.v_conv);
    CHECK(loaded.f_b_proj == weights.f_b_proj);
    CHECK(loaded.g_b_bias == weights.g_b_bias);
    CHECK(loaded.A_log == weights.A_log);
    CHECK(loaded.dt_bias == weights.dt_bias);
    CHECK(loaded.o_proj == weights.o_proj);
    // Another layer index finds the bare names only.
    if (prefix.empty()) {
      CHECK(kda::engine::load_full_layer_weights(Checkpoint::open(path), 0, config).b_proj ==
            weights.b_proj);
    } else {
      CHECK(error_of([&] {
              kda::engine::load_full_layer_weights(Checkpoint::open(path), 0, config);
            }).find("model.layers.0.self_attn.q_proj.weight") != std::string::npos);
    }
  }
  // A tensor-parallel load keeps the rank's shard.
  FullLayerConfig rank1 = config;
  rank1.tp_size = 2;
  rank1.tp_rank = 1;
  const FullLayerWeights shard = kda::engine::load_full_layer_weights(
      Checkpoint::open(dir.file("layer.safetensors")), 5, rank1);
  CHECK(shard.o_proj == kda::engine::shard_full_layer_weights(weights, 2, 1).o_proj);
  CHECK(shard.A_log.size() == 2);
}

TEST_CASE("weights load from a sharded checkpoint's model.safetensors.index.json") {
  const FullLayerConfig config = small_config();
  const FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 12, 2);
  std::vector<Tensor> tensors =
      kda::engine::full_layer_weight_tensors(weights, kda::engine::full_layer_tensor_prefix(2));
  TempDir dir;
  // Half of the tensors in each of two shards, plus one unrelated tensor.
  std::vector<Tensor> shard1(tensors.begin(), tensors.begin() + 7);
  std::vector<Tensor> shard2(tensors.begin() + 7, tensors.end());
  shard2.push_back(Tensor::zeros("model.embed_tokens.weight", DType::kBF16, {4, 4}));
  kda::engine::save_safetensors(dir.file("model-00001-of-00002.safetensors"), shard1);
  kda::engine::save_safetensors(dir.file("model-00002-of-00002.safetensors"), shard2);
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  for (const Tensor& t : shard1) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const Tensor& t : shard2) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir.file("model.safetensors.index.json")) << index.dump(2);

  for (const std::string& path : {dir.file("model.safetensors.index.json"), dir.path.string()}) {
    CAPTURE(path);
    const FullLayerWeights loaded =
        kda::engine::load_full_layer_weights(Checkpoint::open(path), 2, config);
    CHECK(loaded.k_proj == weights.k_proj);
    CHECK(loaded.o_norm == weights.o_norm);
    CHECK(loaded.o_proj == weights.o_proj);
  }

  // An index that puts a tensor in the wrong shard names both.
  index["weight_map"]["model.layers.2.self_attn.o_proj.weight"] =
      "model-00001-of-00002.safetensors";
  std::ofstream(dir.file("model.safetensors.index.json")) << index.dump(2);
  const std::string message = error_of([&] { Checkpoint::open(dir.path.string()); });
  CHECK(message.find("model.layers.2.self_attn.o_proj.weight") != std::string::npos);
  CHECK(message.find("model-00001-of-00002.safetensors") != std::string::npos);
}

TEST_CASE("bad weights: missing, misshapen or wrongly typed tensors are refused by name") {
  const FullLayerConfig config = small_config();
  const FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 1, 0);
  const std::vector<Tensor> good = kda::engine::full_layer_weight_tensors(weights);
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  auto load_error = [&](std::vector<Tensor> tensors) {
    kda::engine::save_safetensors(path, tensors);
    return error_of(
        [&] { kda::engine::load_full_layer_weights(Checkpoint::open(path), -1, config); });
  };
  auto replaced = [&](const std::string& name, Tensor replacement) {
    std::vector<Tensor> tensors = good;
    for (Tensor& t : tensors) {
      if (t.name == name) t = std::move(replacement);
    }
    return tensors;
  };

  SUBCASE("missing") {
    std::vector<Tensor> tensors;
    for (const Tensor& t : good) {
      if (t.name != "g_a_proj.weight") tensors.push_back(t);
    }
    const std::string message = load_error(tensors);
    CHECK(message.find("no tensor 'g_a_proj.weight'") != std::string::npos);
  }
  SUBCASE("wrong shape") {
    const std::string message = load_error(
        replaced("f_b_proj.weight", Tensor::zeros("f_b_proj.weight", DType::kBF16, {16, 64})));
    CHECK(message.find("'f_b_proj.weight' has shape [16, 64], expected [64, 16]") !=
          std::string::npos);
  }
  SUBCASE("wrong dtype") {
    const std::string message = load_error(
        replaced("o_proj.weight", Tensor::zeros("o_proj.weight", DType::kF32, {48, 64})));
    CHECK(message.find("'o_proj.weight' has dtype F32, expected BF16") != std::string::npos);
  }
  SUBCASE("conv weight of the wrong dtype") {
    const std::string message = load_error(
        replaced("k_conv1d.weight", Tensor::zeros("k_conv1d.weight", DType::kI32, {64, 1, 4})));
    CHECK(message.find("'k_conv1d.weight' has dtype I32, expected F32 or BF16") !=
          std::string::npos);
  }
  SUBCASE("A_log out of range") {
    Tensor a_log = Tensor::zeros("A_log", DType::kF32, {1, 1, 4, 1});
    a_log.data_as<float>()[2] = 30.0f;
    const std::string message = load_error(replaced("A_log", a_log));
    CHECK(message.find("'A_log' value 30") != std::string::npos);
  }
  SUBCASE("weights whose sizes do not match their config") {
    FullLayerWeights broken = weights;
    broken.dt_bias.pop_back();
    CHECK(error_of([&] { FullLayerCpu layer(broken); }).find("dt_bias") != std::string::npos);
    broken = weights;
    broken.A_log[1] = std::nanf("");
    CHECK(error_of([&] { FullLayerCpu layer(broken); }).find("A_log[1]") != std::string::npos);
  }
  SUBCASE("tp_size that does not divide the heads") {
    FullLayerConfig three = config;
    three.tp_size = 3;
    CHECK(error_of([&] { kda::engine::validate(three); }).find("tp_size 3") != std::string::npos);
  }
}

TEST_CASE("bad calls are refused before anything is written") {
  const FullLayerConfig config = small_config();
  const FullLayerCpu layer(kda::engine::random_full_layer_weights(config, 1, 0));
  const std::int64_t E = config.hidden_size;
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(6 * E), 1.0f, 3);
  std::vector<bf16_bits> out(hidden.size(), 0x1234);
  Pools pools(config, 2);
  std::vector<std::int64_t> cu = {0, 2, 6};
  std::vector<std::int32_t> slots = {0, 1};
  std::vector<unsigned char> workspace(layer.workspace_bytes(6, 2, 2));
  FullLayerBatch batch;
  batch.tokens = 6;
  batch.sequences = 2;
  batch.cu_seqlens = cu.data();
  batch.slots = slots.data();
  auto call = [&](std::size_t workspace_bytes) {
    return error_of([&] {
      layer.forward(batch, hidden.data(), out.data(), pools.view(),
                    kda::Workspace{workspace.data(), workspace_bytes});
    });
  };
  SUBCASE("workspace too small") {
    CHECK(call(workspace.size() - 1).find("workspace has") != std::string::npos);
  }
  SUBCASE("cu_seqlens not ending at tokens") {
    cu[2] = 5;
    CHECK(call(workspace.size()).find("cu_seqlens[2] = 5 is not tokens = 6") != std::string::npos);
  }
  SUBCASE("slot outside the pool") {
    slots[1] = 2;
    CHECK(call(workspace.size()).find("slot 2, outside [0, num_slots = 2)") != std::string::npos);
  }
  SUBCASE("two sequences on one slot") {
    slots[1] = 0;
    CHECK(call(workspace.size()).find("share slot 0") != std::string::npos);
  }
  CHECK(std::all_of(out.begin(), out.end(), [](bf16_bits b) { return b == 0x1234; }));
  CHECK(std::all_of(pools.recurrent.begin(), pools.recurrent.end(),
                    [](float x) { return x == 0.0f; }));
}

TEST_CASE("a bf16 recurrent state pool runs the same layer within bf16 accuracy") {
  const FullLayerConfig config = small_config();
  const FullLayerCpu layer(kda::engine::random_full_layer_weights(config, 6, 1));
  const std::vector<std::int64_t> cu = {0, 9, 10, 24};
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(24 * config.hidden_size), 2.0f, 2);
  Pools f32(config, 3);
  const std::vector<bf16_bits> expected = run(layer, hidden, cu, &f32);

  Pools conv(config, 3);  // conv pools; the recurrent pool below replaces conv.recurrent
  std::vector<bf16_bits> recurrent(conv.recurrent.size(), 0);
  FullLayerState state = conv.view();
  state.recurrent = recurrent.data();
  state.recurrent_dtype = DType::kBF16;
  FullLayerBatch batch;
  batch.tokens = 24;
  batch.sequences = 3;
  batch.cu_seqlens = cu.data();
  std::vector<unsigned char> workspace(layer.workspace_bytes(24, 3, 3));
  std::vector<bf16_bits> out(hidden.size());
  layer.forward(batch, hidden.data(), out.data(), state,
                kda::Workspace{workspace.data(), workspace.size()});
  CHECK(relative_error(out, expected) <= 1e-2);
  CHECK(relative_error(recurrent, f32.recurrent) <= 1e-2);
  CHECK(conv.conv_k == f32.conv_k);
}
