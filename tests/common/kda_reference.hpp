// kda_reference.hpp — test helpers for the KDA operator, shared by the CPU and the CUDA tests.
//
// What it gives:
//   CaseOptions / make_case(opts)   a seeded random KDA problem: bf16 q, k, v, g, beta; f32 A_log
//       and dt_bias; optional cu_seqlens (i32 or i64); optional initial state (f32, or
//       bf16-representable values fed as bf16). Same options and seed give the same case on every
//       platform (own RNG transforms).
//   reference_forward(case)   an fp64 token-by-token recurrence written straight from KDA.md §1
//       (state kept K x V, shares no code with the backends); returns out [B*T, H, V] and the final
//       state [N, H, V, K] (V-first, as in memory).
//   Outputs / run_cpu(case, ...)   runs the CPU backend on a case with poisoned (NaN) outputs and
//       a workspace sized by workspace_size(); the CUDA tests feed the same inputs
//       (case.inputs() with the pointers swapped for device copies).
//   split_tokens(case, t0, t1, ...)   tokens [t0, t1) of a fixed-length case with a given initial
//       state (the split round trip).
//   rel_error(x, ref)   ||x - ref|| / ||ref|| in fp64 (x: float or double; rel_error_bf16: bf16).
//   same_bits(a, b)     bitwise equality of float vectors (NaN poison included).
//   all_finite(x)       no NaN/Inf left (poisoned outputs were all written).
//   to_floats / to_bf16 / to_doubles   bf16 <-> float <-> double conversions of vectors.
//
// Typical use:
//   kda::test::CaseOptions o;  o.heads = 4; o.lengths = {0, 1, 17};  o.seed = 7;
//   kda::test::KdaCase c = kda::test::make_case(o);
//   kda::test::Reference ref = kda::test::reference_forward(c);
//   kda::test::Outputs got;  REQUIRE(kda::test::run_cpu(c, &got).ok());
//   CHECK(kda::test::rel_error_bf16(got.out, ref.out) <= 2.5e-3);
//   CHECK(kda::test::rel_error(got.final_state(), ref.final_state) <= 1e-3);
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/kda.hpp"

namespace kda::test {

// ---------------------------------------------------------------------------------------------
// Conversions and errors
// ---------------------------------------------------------------------------------------------
inline std::vector<float> to_floats(const std::vector<std::uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (std::size_t i = 0; i < bf16.size(); ++i) out[i] = bf16_to_float(bf16[i]);
  return out;
}
inline std::vector<std::uint16_t> to_bf16(const std::vector<float>& values) {
  std::vector<std::uint16_t> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = float_to_bf16(values[i]);
  return out;
}
inline std::vector<double> to_doubles(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}
inline std::vector<double> to_doubles(const std::vector<std::uint16_t>& bf16) {
  std::vector<double> out(bf16.size());
  for (std::size_t i = 0; i < bf16.size(); ++i) out[i] = bf16_to_float(bf16[i]);
  return out;
}

// ||x - ref|| / ||ref|| in fp64. Sizes must match (else +inf); an all-zero ref gives ||x||.
// NaN anywhere in x gives NaN, which fails every `<=` check.
inline double rel_error(const std::vector<double>& x, const std::vector<double>& ref) {
  if (x.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    diff += (x[i] - ref[i]) * (x[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}
inline double rel_error(const std::vector<float>& x, const std::vector<double>& ref) {
  return rel_error(to_doubles(x), ref);
}
inline double rel_error_bf16(const std::vector<std::uint16_t>& x, const std::vector<double>& ref) {
  return rel_error(to_doubles(x), ref);
}

// Bit-for-bit equality of float vectors (NaN poison compares equal to the same NaN bits).
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// ---------------------------------------------------------------------------------------------
// Seeded randomness (splitmix64 + Box-Muller: the same numbers on every platform)
// ---------------------------------------------------------------------------------------------
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t state_;
};

// ---------------------------------------------------------------------------------------------
// Random cases
// ---------------------------------------------------------------------------------------------
struct CaseOptions {
  std::int64_t heads = 2;
  std::int64_t head_dim_k = 16;
  std::int64_t head_dim_v = 16;
  // Fixed-length rows (used when `lengths` is empty): B rows of T tokens.
  std::int64_t batch = 1;
  std::int64_t seq_len = 16;
  // Varlen: one entry per sequence (B = 1, T = the sum, N = lengths.size()); zeros are allowed.
  std::vector<std::int64_t> lengths;
  DType cu_seqlens_dtype = DType::kI64;  // kI32 or kI64, for varlen cases
  bool varlen = false;                   // force varlen even when lengths is empty (N = 0)

  GateMode gate = GateMode::kSoftplus;
  float lower_bound = -5.0f;
  float scale = 0.0f;  // 0: K^-0.5
  // Added to every dt_bias: +3 gives strong decay (exp(g) near 0), -4 long memory (near 1).
  float dt_bias_shift = 0.0f;
  float value_scale = 1.0f;  // standard deviation of v
  float state_scale = 0.5f;  // standard deviation of the initial state

  DType initial_state_dtype = DType::kNone;  // kNone, kBF16 (values rounded to bf16) or kF32
  DType final_state_dtype = DType::kF32;
  std::uint64_t seed = 1;
};

struct KdaCase {
  Problem problem;
  std::vector<std::uint16_t> q, k, g;        // bf16 [B, T, H, K]
  std::vector<std::uint16_t> v;              // bf16 [B, T, H, V]
  std::vector<std::uint16_t> beta;           // bf16 [B, T, H]
  std::vector<float> A_log;                  // [H]
  std::vector<float> dt_bias;                // [H, K]
  std::vector<std::int64_t> cu_seqlens;      // [N + 1] when varlen (values; see cu_seqlens_i32)
  std::vector<std::int32_t> cu_seqlens_i32;  // the same values when cu_seqlens_dtype == kI32
  // Initial state [N, H, V, K] as the operator sees it (already bf16-rounded when fed as bf16);
  // empty when the problem has none.
  std::vector<float> initial_state;
  std::vector<std::uint16_t> initial_state_bf16;  // what is fed when initial_state_dtype == kBF16

  std::int64_t num_seqs() const { return problem.sequences(); }
  std::int64_t out_elems() const {
    return problem.total_tokens() * problem.num_heads * problem.head_dim_v;
  }
  std::int64_t state_elems() const {
    return num_seqs() * problem.num_heads * problem.head_dim_v * problem.head_dim_k;
  }
  // Token range [begin, end) of sequence s in the flattened [B*T] token axis.
  std::int64_t seq_begin(std::int64_t s) const {
    return problem.varlen() ? cu_seqlens[static_cast<std::size_t>(s)] : s * problem.seq_len;
  }
  std::int64_t seq_end(std::int64_t s) const {
    return problem.varlen() ? cu_seqlens[static_cast<std::size_t>(s) + 1]
                            : (s + 1) * problem.seq_len;
  }
  const void* cu_seqlens_ptr() const {
    if (!problem.varlen()) return nullptr;
    return problem.cu_seqlens_dtype == DType::kI32 ? static_cast<const void*>(cu_seqlens_i32.data())
                                                   : static_cast<const void*>(cu_seqlens.data());
  }
  const void* initial_state_ptr() const {
    if (problem.initial_state_dtype == DType::kF32) return initial_state.data();
    if (problem.initial_state_dtype == DType::kBF16) return initial_state_bf16.data();
    return nullptr;
  }
  // Host pointers of every input; out and final_state are left null for the caller.
  Tensors inputs() const {
    Tensors t;
    t.q = q.data();
    t.k = k.data();
    t.v = v.data();
    t.g = g.data();
    t.beta = beta.data();
    t.A_log = A_log.data();
    t.dt_bias = dt_bias.data();
    t.cu_seqlens = cu_seqlens_ptr();
    t.initial_state = initial_state_ptr();
    return t;
  }
};

inline std::vector<std::uint16_t> random_bf16(Rng& rng, std::int64_t count, double stddev) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(count));
  for (auto& x : out) x = float_to_bf16(static_cast<float>(stddev * rng.normal()));
  return out;
}

// The log decay g of one element (KDA.md §1), in fp64: element `index` of c.g, channel `channel`
// (h * K + i) of dt_bias, a = exp(A_log[h]).
inline double log_decay(const KdaCase& c, double a, std::int64_t index, std::int64_t channel) {
  const double x = static_cast<double>(bf16_to_float(c.g[static_cast<std::size_t>(index)])) +
                   static_cast<double>(c.dt_bias[static_cast<std::size_t>(channel)]);
  if (c.problem.gate == GateMode::kSoftplus) return -a * (x > 30.0 ? x : std::log1p(std::exp(x)));
  return static_cast<double>(c.problem.lower_bound) / (1.0 + std::exp(-a * x));
}

// Draws a case. Distributions: q, k, g_raw, beta_raw ~ N(0, 1); v ~ N(0, value_scale^2);
// A_log = log(U(0.5, 2)); dt_bias ~ U(-1, 1) + dt_bias_shift; initial state ~ N(0, state_scale^2).
inline KdaCase make_case(const CaseOptions& o) {
  KdaCase c;
  Rng rng(o.seed);
  Problem& p = c.problem;
  p.num_heads = o.heads;
  p.head_dim_k = o.head_dim_k;
  p.head_dim_v = o.head_dim_v;
  p.gate = o.gate;
  p.lower_bound = o.lower_bound;
  p.scale = o.scale;
  p.initial_state_dtype = o.initial_state_dtype;
  p.final_state_dtype = o.final_state_dtype;
  if (!o.lengths.empty() || o.varlen) {
    p.batch = 1;
    p.cu_seqlens_dtype = o.cu_seqlens_dtype;
    p.num_seqs = static_cast<std::int64_t>(o.lengths.size());
    c.cu_seqlens.push_back(0);
    for (std::int64_t len : o.lengths) c.cu_seqlens.push_back(c.cu_seqlens.back() + len);
    p.seq_len = c.cu_seqlens.back();
    if (p.cu_seqlens_dtype == DType::kI32) {
      c.cu_seqlens_i32.assign(c.cu_seqlens.begin(), c.cu_seqlens.end());
    }
  } else {
    p.batch = o.batch;
    p.seq_len = o.seq_len;
  }
  const std::int64_t rows = p.total_tokens() * p.num_heads;
  c.q = random_bf16(rng, rows * p.head_dim_k, 1.0);
  c.k = random_bf16(rng, rows * p.head_dim_k, 1.0);
  c.v = random_bf16(rng, rows * p.head_dim_v, o.value_scale);
  c.g = random_bf16(rng, rows * p.head_dim_k, 1.0);
  c.beta = random_bf16(rng, rows, 1.0);
  for (std::int64_t h = 0; h < p.num_heads; ++h) {
    c.A_log.push_back(static_cast<float>(std::log(rng.uniform(0.5, 2.0))));
  }
  for (std::int64_t i = 0; i < p.num_heads * p.head_dim_k; ++i) {
    c.dt_bias.push_back(static_cast<float>(rng.uniform(-1.0, 1.0)) + o.dt_bias_shift);
  }
  if (p.initial_state_dtype != DType::kNone) {
    c.initial_state.resize(static_cast<std::size_t>(c.state_elems()));
    for (auto& x : c.initial_state) x = static_cast<float>(o.state_scale * rng.normal());
    if (p.initial_state_dtype == DType::kBF16) {
      c.initial_state_bf16 = to_bf16(c.initial_state);
      c.initial_state = to_floats(c.initial_state_bf16);
    }
  }
  return c;
}

// Tokens [t0, t1) of every row of a fixed-length case, as a case of its own whose initial state is
// `initial` (values [N, H, V, K], fed as `initial_dtype`: rounded to bf16 when kBF16; ignored when
// kNone) and whose final state is written as `final_dtype`. For the split round trip: case [0, n)
// then [n, T) chained through the state equals case [0, T).
inline KdaCase split_tokens(const KdaCase& c, std::int64_t t0, std::int64_t t1, DType initial_dtype,
                            const std::vector<float>& initial, DType final_dtype) {
  KdaCase s = c;
  Problem& p = s.problem;
  p.seq_len = t1 - t0;
  p.initial_state_dtype = initial_dtype;
  p.final_state_dtype = final_dtype;
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v, T = c.problem.seq_len;
  auto slice = [&](const std::vector<std::uint16_t>& x, std::int64_t width) {
    std::vector<std::uint16_t> out;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const auto first = x.begin() + (b * T + t0) * H * width;
      out.insert(out.end(), first, first + (t1 - t0) * H * width);
    }
    return out;
  };
  s.q = slice(c.q, K);
  s.k = slice(c.k, K);
  s.g = slice(c.g, K);
  s.v = slice(c.v, V);
  s.beta = slice(c.beta, 1);
  s.initial_state.clear();
  s.initial_state_bf16.clear();
  if (initial_dtype == DType::kF32) {
    s.initial_state = initial;
  } else if (initial_dtype == DType::kBF16) {
    s.initial_state_bf16 = to_bf16(initial);
    s.initial_state = to_floats(s.initial_state_bf16);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// fp64 reference (KDA.md §1, literally: S is K x V here)
// ---------------------------------------------------------------------------------------------
struct Reference {
  std::vector<double> out;          // [B*T, H, V]
  std::vector<double> final_state;  // [N, H, V, K]
};

inline Reference reference_forward(const KdaCase& c) {
  const Problem& p = c.problem;
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  const double scale = p.scale != 0.0f ? static_cast<double>(p.scale) : 1.0 / std::sqrt(double(K));
  Reference r;
  r.out.assign(static_cast<std::size_t>(c.out_elems()), 0.0);
  r.final_state.assign(static_cast<std::size_t>(c.state_elems()), 0.0);
  auto at = [](const std::vector<std::uint16_t>& x, std::int64_t i) {
    return static_cast<double>(bf16_to_float(x[static_cast<std::size_t>(i)]));
  };
  // One (sequence, head) pair at a time, pairs spread over the host's threads (the pairs write
  // disjoint outputs; the GPU tests compare cases of up to ~400 k token-heads with it).
  auto one_pair = [&](std::int64_t s, std::int64_t h) {
    std::vector<double> S(static_cast<std::size_t>(K * V));  // S[i * V + j], i < K, j < V
    std::vector<double> qn(K), kn(K), decay(K), w(V);
    const std::int64_t state_base = (s * H + h) * V * K;
    for (std::int64_t i = 0; i < K; ++i) {
      for (std::int64_t j = 0; j < V; ++j) {
        S[i * V + j] = c.initial_state.empty()
                           ? 0.0
                           : c.initial_state[static_cast<std::size_t>(state_base + j * K + i)];
      }
    }
    const double a = std::exp(static_cast<double>(c.A_log[h]));
    for (std::int64_t t = c.seq_begin(s); t < c.seq_end(s); ++t) {
      const std::int64_t row = t * H + h;
      double qq = 0, kk = 0;
      for (std::int64_t i = 0; i < K; ++i) {
        qq += at(c.q, row * K + i) * at(c.q, row * K + i);
        kk += at(c.k, row * K + i) * at(c.k, row * K + i);
      }
      for (std::int64_t i = 0; i < K; ++i) {
        qn[i] = at(c.q, row * K + i) / std::sqrt(qq + 1e-6);
        kn[i] = at(c.k, row * K + i) / std::sqrt(kk + 1e-6);
        decay[i] = std::exp(log_decay(c, a, row * K + i, h * K + i));
      }
      const double beta = 1.0 / (1.0 + std::exp(-at(c.beta, row)));
      for (std::int64_t i = 0; i < K; ++i) {
        for (std::int64_t j = 0; j < V; ++j) S[i * V + j] *= decay[i];
      }
      for (std::int64_t j = 0; j < V; ++j) {  // w = S^T k^
        w[j] = 0;
        for (std::int64_t i = 0; i < K; ++i) w[j] += S[i * V + j] * kn[i];
      }
      for (std::int64_t i = 0; i < K; ++i) {
        for (std::int64_t j = 0; j < V; ++j) {
          S[i * V + j] += beta * kn[i] * (at(c.v, row * V + j) - w[j]);
        }
      }
      for (std::int64_t j = 0; j < V; ++j) {
        double o = 0;
        for (std::int64_t i = 0; i < K; ++i) o += S[i * V + j] * qn[i];
        r.out[static_cast<std::size_t>(row * V + j)] = scale * o;
      }
    }
    for (std::int64_t i = 0; i < K; ++i) {
      for (std::int64_t j = 0; j < V; ++j) {
        r.final_state[static_cast<std::size_t>(state_base + j * K + i)] = S[i * V + j];
      }
    }
  };
  const std::int64_t pairs = c.num_seqs() * H;
  std::atomic<std::int64_t> next{0};
  auto worker = [&] {
    for (std::int64_t i = next++; i < pairs; i = next++) one_pair(i / H, i % H);
  };
  const std::int64_t threads = std::min<std::int64_t>(
      pairs,
      std::max<std::int64_t>(1, static_cast<std::int64_t>(std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (std::int64_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Running the CPU backend on a case
// ---------------------------------------------------------------------------------------------
inline constexpr std::uint16_t kPoisonBf16 = 0x7FC1;  // a quiet NaN
inline const float kPoisonF32 = std::numeric_limits<float>::quiet_NaN();

struct Outputs {
  std::vector<std::uint16_t> out;         // [B*T, H, V] bf16
  std::vector<float> final_f32;           // [N, H, V, K] when final_state_dtype == kF32
  std::vector<std::uint16_t> final_bf16;  // [N, H, V, K] when final_state_dtype == kBF16
  // The final state as doubles, whichever dtype it was written in (empty when none).
  std::vector<double> final_state() const {
    return !final_f32.empty() ? to_doubles(final_f32) : to_doubles(final_bf16);
  }
  // Fresh outputs for case c, every element poisoned (NaN) so that unwritten ones show.
  static Outputs poisoned(const KdaCase& c) {
    Outputs o;
    o.out.assign(static_cast<std::size_t>(c.out_elems()), kPoisonBf16);
    if (c.problem.final_state_dtype == DType::kF32) {
      o.final_f32.assign(static_cast<std::size_t>(c.state_elems()), kPoisonF32);
    } else if (c.problem.final_state_dtype == DType::kBF16) {
      o.final_bf16.assign(static_cast<std::size_t>(c.state_elems()), kPoisonBf16);
    }
    return o;
  }
  void* final_state_ptr() {
    if (!final_f32.empty()) return final_f32.data();
    if (!final_bf16.empty()) return final_bf16.data();
    return nullptr;
  }
};

// Whether every element is finite (a poisoned NaN left behind fails this).
inline bool all_finite(const std::vector<std::uint16_t>& bf16) {
  for (std::uint16_t x : bf16) {
    if (!std::isfinite(bf16_to_float(x))) return false;
  }
  return true;
}
inline bool all_finite(const std::vector<float>& values) {
  for (float x : values) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// Runs forward_cpu on case c into freshly poisoned *outputs, with a workspace of
// workspace_size(kCpu) bytes (minus `workspace_shortfall`, to test the size check).
inline Status run_cpu(const KdaCase& c, Outputs* outputs, const CpuOptions& opt = {},
                      std::size_t workspace_shortfall = 0) {
  *outputs = Outputs::poisoned(c);
  std::size_t bytes = 0;
  if (Status st = workspace_size(c.problem, Backend::kCpu, &bytes); !st) return st;
  bytes = bytes > workspace_shortfall ? bytes - workspace_shortfall : 0;
  std::vector<unsigned char> workspace(bytes);
  Tensors t = c.inputs();
  t.out = outputs->out.data();
  t.final_state = outputs->final_state_ptr();
  return forward_cpu(c.problem, t, Workspace{workspace.data(), bytes}, opt);
}

}  // namespace kda::test
