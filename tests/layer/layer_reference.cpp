// layer_reference.cpp — the fp64 reference of the whole layer (layer_runner.hpp): token by token,
// written from the math alone (layer.hpp's formulas), rounding to bf16 at the same points as the
// implementations (docs/LAYER.md).
#include <cmath>

#include "layer_runner.hpp"

namespace kda::test {

namespace {

double bf16_round(double x) { return bf16_to_float(float_to_bf16(static_cast<float>(x))); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace

LayerReference reference_layer(const layer::Weights& w, const std::vector<bf16_bits>& hidden,
                               const BatchSpec& batch, const Pools& before) {
  const layer::Config& c = w.config;
  // A shard is a layer of its local heads whose o_proj yields the rank's partial sum.
  const std::int64_t E = c.hidden_size, H = c.local_heads(), D = c.head_dim, W = c.conv_width;
  const std::int64_t C = H * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto weight = [](const std::vector<bf16_bits>& m, std::int64_t row, std::int64_t cols,
                   std::int64_t col) {
    return static_cast<double>(bf16_to_float(m[row * cols + col]));
  };

  LayerReference ref;
  ref.out.assign(static_cast<std::size_t>(batch.tokens() * E), 0.0);
  ref.conv_q = to_doubles(before.conv_q);
  ref.conv_k = to_doubles(before.conv_k);
  ref.conv_v = to_doubles(before.conv_v);
  ref.recurrent = before.recurrent();
  for (std::int64_t n = 0; n < batch.sequences(); ++n) {
    // A padding row or sequence (negative slot) outputs zeros (ref.out stays 0) and touches no
    // state.
    const std::int64_t slot = batch.slot(n);
    if (slot < 0) continue;
    double* state_q = ref.conv_q.data() + slot * C * (W - 1);
    double* state_k = ref.conv_k.data() + slot * C * (W - 1);
    double* state_v = ref.conv_v.data() + slot * C * (W - 1);
    double* recurrent = ref.recurrent.data() + slot * H * D * D;

    for (std::int64_t t = batch.cu_seqlens[n]; t < batch.cu_seqlens[n + 1]; ++t) {
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
      // Conv over (state ++ this input), SiLU; the state [C, W-1] shifts by one.
      auto conv = [&](const std::vector<double>& pre, const std::vector<float>& taps,
                      double* state) {
        std::vector<double> y(C);
        for (std::int64_t ch = 0; ch < C; ++ch) {
          double* s = state + ch * (W - 1);
          double acc = taps[ch * W + (W - 1)] * pre[ch];
          for (std::int64_t j = 0; j < W - 1; ++j) acc += taps[ch * W + j] * s[j];
          y[ch] = bf16_round(acc * sigmoid(acc));
          for (std::int64_t j = 0; j + 1 < W - 1; ++j) s[j] = s[j + 1];
          if (W > 1) s[W - 2] = pre[ch];
        }
        return y;
      };
      const std::vector<double> q = conv(linear(w.q_proj, C, x), w.q_conv, state_q);
      const std::vector<double> k = conv(linear(w.k_proj, C, x), w.k_conv, state_k);
      const std::vector<double> v = conv(linear(w.v_proj, C, x), w.v_conv, state_v);
      const std::vector<double> g_raw = linear(w.f_b_proj, C, linear(w.f_a_proj, D, x));
      const std::vector<double> b_raw = linear(w.b_proj, H, x);
      // Output gate: (x·W_gaᵀ → bf16)·W_gbᵀ, or x·W_gᵀ (full rank); the bias added before the
      // one rounding.
      const std::vector<double> gate_in = c.full_rank_gate ? x : linear(w.g_a_proj, D, x);
      const std::vector<bf16_bits>& gate_weight = c.full_rank_gate ? w.g_proj : w.g_b_proj;
      const std::int64_t gate_k = static_cast<std::int64_t>(gate_in.size());
      std::vector<double> gate(C);
      for (std::int64_t ch = 0; ch < C; ++ch) {
        double acc = w.g_b_bias.empty() ? 0.0 : bf16_to_float(w.g_b_bias[ch]);
        for (std::int64_t i = 0; i < gate_k; ++i)
          acc += weight(gate_weight, ch, gate_k, i) * gate_in[i];
        gate[ch] = bf16_round(acc);
      }

      std::vector<double> y(C);
      for (std::int64_t h = 0; h < H; ++h) {
        // KDA recurrence, state S[v][k] (V-first).
        double* S = recurrent + h * D * D;
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

}  // namespace kda::test
