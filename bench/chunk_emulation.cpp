// kda-chunk-emulation: the CUDA prefill's chunk algorithm emulated on the CPU, with a switch per
// point where the GPU rounds to bf16, to apportion the GPU's error against an fp64 recurrence
// (the target: <= 3e-3). It follows prefill_prepare.cu and prefill_recurrence.cu step by step
// (factored path: every chunk's half decay range below 80, as the bounded gate guarantees):
//
//   prepare  r = (G_0 + G_last) / 2 per channel (the reference in the middle of the decay range)
//            qg = scale q^ e^(G - r)    kg = k^ e^(G - r)    ki = k^ e^(r - G)
//            kd = k^ e^(G_last - G)     qgY = scale q^ e^G (the record's Q~)
//            A = beta_i (kg_i . ki_j), i > j (fp32 sums of bf16 products)   M = qg_i . ki_j, i >= j
//            W  = (I + A)^-1 diag(beta) (k^ e^G)   U0 = (I + A)^-1 diag(beta) v   (fp32
//            substitution)
//   recur.   X = S^T W^T   U = U0 - X   S^T = S^T diag(e^G_last) + U^T kd   O = S^T qg^T + U^T M^T
//
// Rounding points (each on unless switched off; `out` is always rounded to bf16 at the end):
//   gram   the Gram operands kg, ki, qg as the tensor cores see them (bf16)
//   M      the output mask M, stored fp16 (bf16 with --bf16-update)
//   W      W stored bf16          U0   U0 stored fp16 (bf16 with --bf16-update)
//   kd     K^ stored fp16 (the state update's right operand; bf16 with --bf16-update)
//   S      the state as the left operand of X and O (bf16 copy of the fp32 accumulators)
//   U      U as the left operand of the state update and of U^T M^T (fp16; bf16 with
//          --bf16-update)
// The GPU today switches off `gram` (bf16 pairs); with --bf16-update also `M` (then a pair).
//   qgY    qg as the right operand of S^T qg^T (bf16; off: the fp32 value)
//
//   B      --pair only: B = W_b K^_a^T (16 x 16) stored bf16
//
//   kda-chunk-emulation [--tokens T] [--heads H] [--seed N] [--initial-state] [--chunk C] [--gate
//   softplus|lower_bound] [--dt-shift X] [--pair] [--bf16-update]   (X added to every dt_bias: -4
//   long memory, +3 strong decay, as the operator tests' regimes; --pair: the recurrence two
//   chunks a step, recur_pair, a design for a shorter state chain; --bf16-update: the kernels
//   before the fp16 state update)
// Prints, for each configuration, the relative L2 error of out and of the final state.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kda/bf16.hpp"

namespace {

constexpr int D = 128;

struct Rounding {
  bool gram = true, M = true, W = true, U0 = true, kd = true, S = true, U = true, qgY = true;
  bool B = true;   // --pair only: B = W_b K^_a^T stored bf16
  bool SY = true;  // S as the bf16 operand of Y = S Q~^T (off: a bf16 pair there, X keeps `S`)
};

float r16(float x, bool on) { return on ? kda::round_bf16(x) : x; }
// IEEE half rounding (round to nearest even, subnormals; no overflow handling: the values here are
// far below 65504).
float rh(float x) {
  const float ax = std::fabs(x);
  if (ax == 0.f) return x;
  int e;
  std::frexp(ax, &e);                       // ax in [2^(e-1), 2^e)
  const int q = std::max(e - 1 - 10, -24);  // quantum exponent
  return static_cast<float>(std::nearbyint(static_cast<double>(x) * std::ldexp(1.0, -q)) *
                            std::ldexp(1.0, q));
}
// The GPU rounds U, U0, K^ and M to fp16, not bf16 (U and U0 scaled by powers
// of two into fp16's range first: exact, so not modelled); --bf16-update emulates the kernels
// before, with M then taken as the bf16 pair they stored (the `M` switch off).
bool g_f16 = true;
float r16h(float x, bool on) { return on ? (g_f16 ? rh(x) : kda::round_bf16(x)) : x; }

struct Rng {
  std::uint64_t s;
  double uniform() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(s >> 11) * 0x1.0p-53;
  }
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

struct Head {
  int T;
  std::vector<float> q, k, v, g, beta;  // bf16 values as floats, [T, D] / [T]
  float a_exp, lower_bound;
  std::vector<float> dt_bias;  // [D]
  bool softplus;
  std::vector<float> s0;  // initial state S^T [V][K]
};

float gate(const Head& h, float graw, int d) {
  const float x = graw + h.dt_bias[d];
  if (h.softplus) return -h.a_exp * (std::max(x, 0.f) + std::log1p(std::exp(-std::fabs(x))));
  return h.lower_bound / (1.f + std::exp(-h.a_exp * x));
}

// fp64 token-by-token recurrence (KDA.md §1).
void reference(const Head& h, std::vector<double>* out, std::vector<double>* state) {
  std::vector<double> S(h.s0.begin(), h.s0.end());  // [V][K]
  out->assign(static_cast<size_t>(h.T) * D, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> qh(D), kh(D), a(D);
  for (int t = 0; t < h.T; ++t) {
    double nq = 0, nk = 0;
    for (int d = 0; d < D; ++d) {
      nq += static_cast<double>(h.q[t * D + d]) * h.q[t * D + d];
      nk += static_cast<double>(h.k[t * D + d]) * h.k[t * D + d];
    }
    nq = 1.0 / std::sqrt(nq + 1e-6);
    nk = 1.0 / std::sqrt(nk + 1e-6);
    for (int d = 0; d < D; ++d) {
      qh[d] = h.q[t * D + d] * nq;
      kh[d] = h.k[t * D + d] * nk;
      const double x = static_cast<double>(h.g[t * D + d]) + h.dt_bias[d];
      const double gg = h.softplus
                            ? -static_cast<double>(h.a_exp) *
                                  (std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))))
                            : h.lower_bound / (1.0 + std::exp(-static_cast<double>(h.a_exp) * x));
      a[d] = std::exp(gg);
    }
    const double b = 1.0 / (1.0 + std::exp(-static_cast<double>(h.beta[t])));
    for (int vv = 0; vv < D; ++vv) {
      double* row = &S[static_cast<size_t>(vv) * D];
      double dk = 0;
      for (int d = 0; d < D; ++d) {
        row[d] *= a[d];
        dk += row[d] * kh[d];
      }
      const double u = b * (h.v[t * D + vv] - dk);
      double o = 0;
      for (int d = 0; d < D; ++d) {
        row[d] += u * kh[d];
        o += row[d] * qh[d];
      }
      (*out)[static_cast<size_t>(t) * D + vv] = scale * o;
    }
  }
  *state = S;
}

// One chunk's record as the prepare kernel leaves it (rounded as `r` says).
template <int C>
struct Record {
  int t0 = 0, n = 0;  // first token, valid tokens
  float W[C][D], U0[C][D], kd[C][D], qgY[C][D], M[C][C] = {}, gl[D];
};

// The prepare kernel's work for chunk [t0, t0 + C), with the given roundings. Counts in *wide the
// (chunk, channel) pairs whose half decay range reaches the factored path's bound (80): the GPU
// takes its exact path there, and the factors emulated here may overflow.
template <int C>
void prepare(const Head& h, const Rounding& r, int t0, Record<C>* rec, long* wide) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int n = std::min(C, h.T - t0);
  rec->t0 = t0;
  rec->n = n;
  float G[C][D], qg[C][D], kg[C][D], ki[C][D], kt[C][D];
  float A[C][C] = {}, beta[C] = {};
  float inq[C] = {}, ink[C] = {};
  for (int i = 0; i < C; ++i) {
    if (i >= n) continue;
    float sq = 0, sk = 0;
    for (int d = 0; d < D; ++d) {
      sq += h.q[(t0 + i) * D + d] * h.q[(t0 + i) * D + d];
      sk += h.k[(t0 + i) * D + d] * h.k[(t0 + i) * D + d];
    }
    inq[i] = 1.f / std::sqrt(sq + 1e-6f);
    ink[i] = 1.f / std::sqrt(sk + 1e-6f);
    beta[i] = 1.f / (1.f + std::exp(-h.beta[t0 + i]));
  }
  for (int d = 0; d < D; ++d) {
    float acc = 0;
    for (int i = 0; i < C; ++i) {
      if (i < n) acc += gate(h, h.g[(t0 + i) * D + d], d);
      G[i][d] = acc;
    }
    rec->gl[d] = std::exp(G[C - 1][d]);
  }
  for (int i = 0; i < C; ++i) {
    for (int d = 0; d < D; ++d) {
      const float qh = i < n ? h.q[(t0 + i) * D + d] * inq[i] : 0.f;
      const float kh = i < n ? h.k[(t0 + i) * D + d] * ink[i] : 0.f;
      const float eg = std::exp(G[i][d]);
      const float half = 0.5f * (G[0][d] - G[C - 1][d]), ref = G[C - 1][d] + half;
      if (i == 0 && half >= 80.f) ++*wide;
      const float e_fwd = std::exp(G[i][d] - ref), e_back = std::exp(ref - G[i][d]);
      kt[i][d] = kh * eg;
      qg[i][d] = r16(scale * qh * e_fwd, r.gram);
      rec->qgY[i][d] = r16(scale * qh * eg, r.qgY);
      kg[i][d] = r16(kh * e_fwd, r.gram);
      const float kinv = kh * e_back;
      ki[i][d] = r16(kinv, r.gram);
      rec->kd[i][d] = r16h(kinv * std::exp(-half), r.kd);
    }
  }
  for (int i = 0; i < C; ++i) {
    for (int j = 0; j <= i; ++j) {
      float a = 0, m = 0;
      for (int d = 0; d < D; ++d) {
        a += kg[i][d] * ki[j][d];
        m += qg[i][d] * ki[j][d];
      }
      if (i > j) A[i][j] = beta[i] * a;
      rec->M[i][j] = r16h(m, r.M);
    }
  }
  for (int d = 0; d < D; ++d) {
    float xk[C], xv[C];
    for (int i = 0; i < C; ++i) {
      float rk = beta[i] * kt[i][d];
      float rv = beta[i] * (i < n ? h.v[(t0 + i) * D + d] : 0.f);
      for (int j = 0; j < i; ++j) {
        rk -= A[i][j] * xk[j];
        rv -= A[i][j] * xv[j];
      }
      xk[i] = rk;
      xv[i] = rv;
      rec->W[i][d] = r16(rk, r.W);
      rec->U0[i][d] = r16h(rv, r.U0);
    }
  }
}

// The pieces of the recurrence kernel's step over chunk c for state row (V column) vv, S^T[vv][*]:
// U = U0 - S W^T from the state operand s (already rounded as `S` says),
template <int C>
void chunk_u(const Record<C>& c, const Rounding& r, int vv, const float* s, float* u) {
  for (int i = 0; i < C; ++i) {
    float x = 0;
    for (int d = 0; d < D; ++d) x += s[d] * c.W[i][d];
    u[i] = r16h(c.U0[i][vv] - x, r.U);
  }
}
// O = S Q~^T + U M^T of the chunk's valid tokens, into out,
template <int C>
void chunk_out(const Record<C>& c, int vv, const float* s, const float* u,
               std::vector<double>* out) {
  for (int i = 0; i < c.n; ++i) {
    float y = 0;
    for (int d = 0; d < D; ++d) y += s[d] * c.qgY[i][d];
    for (int j = 0; j <= i; ++j) y += u[j] * c.M[i][j];
    (*out)[static_cast<size_t>(c.t0 + i) * D + vv] = kda::round_bf16(y);
  }
}
// and the next state S' = S diag(gl) + U K^ (fp32; s_out may be s_in).
template <int C>
void chunk_state(const Record<C>& c, const float* u, const float* s_in, float* s_out) {
  for (int d = 0; d < D; ++d) {
    float acc = s_in[d] * c.gl[d];
    for (int i = 0; i < C; ++i) acc += u[i] * c.kd[i][d];
    s_out[d] = acc;
  }
}

// The recurrence kernel's step over one chunk, for state row (V column) vv: row is S^T[vv][*].
template <int C>
void recur_one(const Record<C>& c, const Rounding& r, int vv, float* row,
               std::vector<double>* out) {
  float sa[D], ua[C];
  float sy[D];
  for (int d = 0; d < D; ++d) sa[d] = r16(row[d], r.S);
  for (int d = 0; d < D; ++d) sy[d] = r.SY ? sa[d] : row[d];
  chunk_u(c, r, vv, sa, ua);
  chunk_out(c, vv, sy, ua, out);
  chunk_state(c, ua, row, row);
}

// Two chunks a, b in one step whose state chain is one chunk's plus a 16 x 16 product: with
// S_a = S^T diag(gl_a) (the decayed state) and B = W_b K^_a^T (16 x 16, from the two records, off
// the chain),
//   U_a = U0_a - S W_a^T                 S_1 = S_a + U_a K^_a
//   U_b = U0_b - S_a W_b^T - U_a B^T     S_2 = S_1 diag(gl_b) + U_b K^_b
//   O_a = S Q~_a^T + U_a M_a^T           O_b = S_1 Q~_b^T + U_b M_b^T
// (U_b as the one-chunk step computes it from S_1 = S_a + U_a K^_a, regrouped.) X_a and S_a W_b^T
// both start from S, so the chunk b no longer waits for chunk a's state update. Rounded as the
// GPU would: S, S_a and S_1 as bf16 operands (`S`), B stored bf16 (`B`), U_a, U_b (`U`).
template <int C>
void recur_pair(const Record<C>& a, const Record<C>& b, const Rounding& r, int vv, float* row,
                std::vector<double>* out) {
  float sa[D], sd[D], s1[D], s1r[D], ua[C], ub[C];
  for (int d = 0; d < D; ++d) {
    sa[d] = r16(row[d], r.S);
    sd[d] = r16(row[d] * a.gl[d], r.S);  // S_a as the operand of S_a W_b^T
  }
  chunk_u(a, r, vv, sa, ua);
  for (int i = 0; i < C; ++i) {
    float x = 0;
    for (int d = 0; d < D; ++d) x += sd[d] * b.W[i][d];
    for (int j = 0; j < C; ++j) {
      float bij = 0;  // B[i][j] = W_b[i] . K^_a[j]
      for (int d = 0; d < D; ++d) bij += b.W[i][d] * a.kd[j][d];
      x += r16(bij, r.B) * ua[j];
    }
    ub[i] = r16(b.U0[i][vv] - x, r.U);
  }
  chunk_state(a, ua, row, s1);  // S_1, fp32
  for (int d = 0; d < D; ++d) s1r[d] = r16(s1[d], r.S);
  chunk_out(a, vv, sa, ua, out);
  chunk_out(b, vv, s1r, ub, out);
  chunk_state(b, ub, s1, row);
}

// The GPU's chunk path with the given roundings, in chunks of C tokens (the GPU's: 16; 32 and 64
// to judge longer chunks); `pairs`: the recurrence takes two chunks a step (recur_pair).
template <int C>
void emulate(const Head& h, const Rounding& r, bool pairs, std::vector<double>* out,
             std::vector<double>* state, long* wide) {
  std::vector<float> S(h.s0);  // fp32 accumulators, [V][K]
  out->assign(static_cast<size_t>(h.T) * D, 0.0);
  auto a = std::make_unique<Record<C>>(), b = std::make_unique<Record<C>>();
  for (int t0 = 0; t0 < h.T; t0 += (pairs ? 2 : 1) * C) {
    prepare<C>(h, r, t0, a.get(), wide);
    const bool two = pairs && t0 + C < h.T;
    if (two) prepare<C>(h, r, t0 + C, b.get(), wide);
    for (int vv = 0; vv < D; ++vv) {
      float* row = &S[static_cast<size_t>(vv) * D];
      if (two) {
        recur_pair<C>(*a, *b, r, vv, row, out);
      } else {
        recur_one<C>(*a, r, vv, row, out);
      }
    }
  }
  state->assign(S.begin(), S.end());
}

double rel(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

Head make_head(int T, bool softplus, bool initial, float dt_shift, std::uint64_t seed) {
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  Head h;
  h.T = T;
  h.softplus = softplus;
  h.lower_bound = -5.f;
  h.a_exp = static_cast<float>(std::exp(std::log(0.5 + 1.5 * rng.uniform())));
  auto bf = [&](size_t count, double sd) {
    std::vector<float> x(count);
    for (float& e : x) e = kda::round_bf16(static_cast<float>(sd * rng.normal()));
    return x;
  };
  h.q = bf(static_cast<size_t>(T) * D, 1);
  h.k = bf(static_cast<size_t>(T) * D, 1);
  h.v = bf(static_cast<size_t>(T) * D, 1);
  h.g = bf(static_cast<size_t>(T) * D, 1);
  h.beta = bf(static_cast<size_t>(T), 1);
  h.dt_bias.resize(D);
  for (float& e : h.dt_bias) e = static_cast<float>(2 * rng.uniform() - 1) + dt_shift;
  h.s0.assign(static_cast<size_t>(D) * D, 0.f);
  if (initial) {
    for (float& e : h.s0) e = static_cast<float>(0.5 * rng.normal());
  }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  int T = 1024, heads = 4, chunk = 16;
  std::uint64_t seed = 1;
  bool initial = true, softplus = false;
  float dt_shift = 0.f;
  bool pair = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc)
      T = std::atoi(argv[++i]);
    else if (a == "--heads" && i + 1 < argc)
      heads = std::atoi(argv[++i]);
    else if (a == "--seed" && i + 1 < argc)
      seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--no-initial-state")
      initial = false;
    else if (a == "--chunk" && i + 1 < argc)
      chunk = std::atoi(argv[++i]);
    else if (a == "--dt-shift" && i + 1 < argc)
      dt_shift = static_cast<float>(std::atof(argv[++i]));
    else if (a == "--gate" && i + 1 < argc)
      softplus = std::string(argv[++i]) == "softplus";
    else if (a == "--pair")
      pair = true;
    else if (a == "--bf16-update")
      g_f16 = false;
    else {
      std::fprintf(
          stderr,
          "usage: kda-chunk-emulation [--tokens T] [--heads H] [--seed N] [--no-initial-state] "
          "[--gate softplus|lower_bound] [--dt-shift X] [--chunk 16|32|64] [--pair] "
          "[--bf16-update]\n");
      return 2;
    }
  }
  if (T < 1 || heads < 1) {
    std::fprintf(stderr, "kda-chunk-emulation: --tokens and --heads must be >= 1\n");
    return 2;
  }
  if (chunk != 16 && chunk != 32 && chunk != 64) {
    std::fprintf(stderr, "kda-chunk-emulation: --chunk must be 16, 32 or 64\n");
    return 2;
  }
  struct Config {
    std::string name;
    Rounding r;
  };
  std::vector<Config> configs;
  configs.push_back({"GPU (every rounding)", Rounding{}});
  const char* names[] = {"gram", "M", "W", "U0", "kd", "S", "U", "qgY", "B"};
  for (int k = 0; k < (pair ? 9 : 8); ++k) {
    Rounding r;
    bool* flags[] = {&r.gram, &r.M, &r.W, &r.U0, &r.kd, &r.S, &r.U, &r.qgY, &r.B};
    *flags[k] = false;
    configs.push_back({names[k], r});
  }
  {
    Rounding r;
    r.gram = r.M = false;
    configs.push_back({"gram + M", r});
    r.kd = false;
    configs.push_back({"gram + M + kd", r});
    r.S = r.U = false;
    configs.push_back({"gram + M + kd + S + U", r});
  }
  {  // each other rounding off on top of the GPU's pairs (gram and M)
    const char* more[] = {"W", "U0", "kd", "S", "U", "qgY"};
    for (int k = 0; k < 6; ++k) {
      Rounding r;
      r.gram = r.M = false;
      bool* flags[] = {&r.W, &r.U0, &r.kd, &r.S, &r.U, &r.qgY};
      *flags[k] = false;
      configs.push_back({std::string("gram + M + ") + more[k], r});
    }
  }
  {
    Rounding r;
    r.gram = r.M = r.SY = false;
    configs.push_back({"gram + M + S in Y", r});
    r.qgY = false;
    configs.push_back({"gram + M + S in Y + qgY", r});
  }
  {
    Rounding r;
    r.gram = r.M = r.U0 = r.U = false;
    configs.push_back({"gram + M + U0 + U", r});
    r.kd = false;
    configs.push_back({"gram + M + U0 + U + kd", r});
  }
  configs.push_back({"none (out rounding only)",
                     Rounding{false, false, false, false, false, false, false, false, false}});
  std::printf(
      "T = %d, %d heads, gate %s, initial state %s, dt_bias shift %g, chunks of %d%s, fp64 "
      "reference\n\n",
      T, heads, softplus ? "softplus" : "lower_bound", initial ? "N(0, 0.25)" : "zero",
      static_cast<double>(dt_shift), chunk, pair ? " (the recurrence in pairs of chunks)" : "");
  std::printf("| rounding switched off | out rel error | state rel error |\n|---|---:|---:|\n");
  std::vector<std::vector<double>> ref_out(heads), ref_state(heads);
  std::vector<Head> hs;
  for (int h = 0; h < heads; ++h) {
    hs.push_back(make_head(T, softplus, initial, dt_shift, seed * 100 + h));
    reference(hs.back(), &ref_out[h], &ref_state[h]);
  }
  long wide = 0, pairs = 0;  // (chunk, channel) pairs past the factored bound, of all
  for (const Config& c : configs) {
    wide = 0;
    std::vector<double> all_out, all_ref_out, all_state, all_ref_state;
    for (int h = 0; h < heads; ++h) {
      std::vector<double> o, s;
      if (chunk == 16) emulate<16>(hs[h], c.r, pair, &o, &s, &wide);
      if (chunk == 32) emulate<32>(hs[h], c.r, pair, &o, &s, &wide);
      if (chunk == 64) emulate<64>(hs[h], c.r, pair, &o, &s, &wide);
      all_out.insert(all_out.end(), o.begin(), o.end());
      all_state.insert(all_state.end(), s.begin(), s.end());
      all_ref_out.insert(all_ref_out.end(), ref_out[h].begin(), ref_out[h].end());
      all_ref_state.insert(all_ref_state.end(), ref_state[h].begin(), ref_state[h].end());
    }
    std::printf("| %s | %.2e | %.2e |\n", c.name.c_str(), rel(all_out, all_ref_out),
                rel(all_state, all_ref_state));
  }
  pairs = static_cast<long>(heads) * ((T + chunk - 1) / chunk) * D;
  std::printf("\n%ld of %ld (chunk, channel) pairs reach the factored path's half range of 80%s\n",
              wide, pairs, wide > 0 ? " (the GPU would take its exact path there)" : "");
  return 0;
}
