// The CPU backend's per-token KDA step, shared by the prefill (cpu_backend.cpp) and the decode
// (cpu_decode.cpp), so that both compute bit-for-bit the same recurrence.
//
// One (sequence, head) keeps its state S^T as a row-major V x K matrix ("V-first", as in memory).
// A token is applied in two parts:
//   prepare_token: the K-sized vectors of the token: k^ and q^ (L2 norm, eps 1e-6 inside the sqrt),
//     the decay a = exp(g) from the activated gate, beta = sigmoid(b), and the products the state
//     pass needs: ak = a * k^, aq = scale * a * q^, kq = scale * (k^ . q^).
//   apply_token: one pass over the state, row v at a time (rows are independent: the delta rule is
//     per column of V):
//       u_v  = beta * (v_v - row_v . ak)                  (= beta (v - S^T k^) after the decay)
//       o_v  = row_v . aq + u_v * kq                       (= scale S'^T q^ with the new state S')
//       row_v = row_v * a + u_v * k^                       (decay, then the rank-1 delta update)
//   This is KDA.md §1 reordered so that each state row is read and written once per token.
//
// Real is float (fp32 accumulation, the default) or double (CpuOptions::fp64, for tests).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu_parallel.hpp"
#include "kda/bf16.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/kda.hpp"

namespace kda::detail::cpu {

// Alignment of each thread's scratch slot inside the caller's workspace.
inline constexpr std::uint64_t kSlotAlignment = 64;

// Every array of a slot starts on a 64-byte boundary (16 Reals: 64 bytes of float, 128 of double)
// and the slot itself is 64-byte aligned. Eigen peels unaligned heads of vectorized loops with
// scalar code, which rounds differently, so an array's address would otherwise change the result's
// bits: with AVX (32-byte packets) a 16-byte aligned vector gave other bits than a 32-byte aligned
// one, and two identical runs could differ.
inline constexpr std::uint64_t kArrayAlignReals = 16;
inline std::uint64_t padded_reals(std::uint64_t n) { return align_up(n, kArrayAlignReals); }

// Reals of one thread's scratch slot: the V x K state, four K-vectors (a, ak, aq, k^) and o (V),
// each padded to kArrayAlignReals.
inline std::uint64_t slot_reals(std::uint64_t head_dim_k, std::uint64_t head_dim_v) {
  return padded_reals(head_dim_v * head_dim_k) + 4 * padded_reals(head_dim_k) +
         padded_reals(head_dim_v);
}
// Bytes of one slot, sized for double so that one workspace serves both precisions. The caller has
// bounded K and V (<= 4096), so this cannot overflow.
inline std::uint64_t slot_bytes(std::uint64_t head_dim_k, std::uint64_t head_dim_v) {
  const std::uint64_t bytes = slot_reals(head_dim_k, head_dim_v) * sizeof(double);
  return align_up(bytes, kSlotAlignment);
}

// One head's gate parameters and scale, converted to Real once per (sequence, head).
template <typename Real>
struct HeadParams {
  std::int64_t head_dim_k = 0;
  std::int64_t head_dim_v = 0;
  GateMode gate = GateMode::kSoftplus;
  Real lower_bound = 0;
  Real exp_a = 0;                  // exp(A_log[h])
  const float* dt_bias = nullptr;  // [K] of this head
  Real scale = 0;
};

template <typename Real>
HeadParams<Real> make_head_params(std::int64_t head_dim_k, std::int64_t head_dim_v, GateMode gate,
                                  float lower_bound, float scale, const float* A_log,
                                  const float* dt_bias, std::int64_t head) {
  HeadParams<Real> hp;
  hp.head_dim_k = head_dim_k;
  hp.head_dim_v = head_dim_v;
  hp.gate = gate;
  hp.lower_bound = static_cast<Real>(lower_bound);
  // Capped at the largest finite Real, so that exp(A_log) * 0 stays 0 for absurd A_log (> 88).
  hp.exp_a = std::min(std::exp(static_cast<Real>(A_log[head])), std::numeric_limits<Real>::max());
  hp.dt_bias = dt_bias + head * head_dim_k;
  hp.scale = static_cast<Real>(scale);
  return hp;
}

// A token's K-vectors (pointers into the thread's scratch) and scalars.
template <typename Real>
struct TokenVectors {
  Real* a = nullptr;   // exp(g)
  Real* ak = nullptr;  // a * k^
  Real* aq = nullptr;  // scale * a * q^
  Real* kh = nullptr;  // k^
  Real beta = 0;       // sigmoid(b)
  Real kq = 0;         // scale * (k^ . q^)
};

// Carves one thread's slot (at least slot_reals(K, V) Reals) into the state and the vectors.
template <typename Real>
struct Scratch {
  Real* state = nullptr;  // [V, K]
  TokenVectors<Real> tok;
  Real* o = nullptr;  // [V]

  // `slot` must be 64-byte aligned (see kArrayAlignReals).
  Scratch(Real* slot, std::int64_t head_dim_k, std::int64_t head_dim_v) {
    const auto pad = [](std::int64_t n) {
      return static_cast<std::int64_t>(padded_reals(static_cast<std::uint64_t>(n)));
    };
    state = slot;
    Real* p = slot + pad(head_dim_v * head_dim_k);
    const std::int64_t kp = pad(head_dim_k);
    tok.a = p;
    tok.ak = p + kp;
    tok.aq = p + 2 * kp;
    tok.kh = p + 3 * kp;
    o = p + 4 * kp;
  }
};

// The decay and the rank-1 update of one state element, x * a + u * k: the scalar form of
// apply_rows' packet loop (its tail) and of commit_channels, written once so that both round the
// same way.
template <typename Real>
inline Real decay_update(Real x, Real a, Real u, Real k) {
  return x * a + u * k;
}

template <typename Real>
using ArrayMap = Eigen::Map<Eigen::Array<Real, Eigen::Dynamic, 1>>;

// Fills `tv` for one token of one head. q, k, g: [K] bf16; b: the raw beta.
template <typename Real>
void prepare_token(const HeadParams<Real>& hp, const bf16_bits* q, const bf16_bits* k,
                   const bf16_bits* g, bf16_bits b, TokenVectors<Real>* tv) {
  const std::int64_t K = hp.head_dim_k;
  ArrayMap<Real> a(tv->a, K), ak(tv->ak, K), aq(tv->aq, K), kh(tv->kh, K);
  // Raw inputs: q into aq, k into kh, g + dt_bias into a (computed in Real).
  for (std::int64_t d = 0; d < K; ++d) {
    aq[d] = static_cast<Real>(bf16_to_float(q[d]));
    kh[d] = static_cast<Real>(bf16_to_float(k[d]));
    a[d] = static_cast<Real>(bf16_to_float(g[d])) + static_cast<Real>(hp.dt_bias[d]);
  }
  const Real eps = static_cast<Real>(1e-6);
  const Real q_norm = std::sqrt(aq.square().sum() + eps);
  const Real k_norm = std::sqrt(kh.square().sum() + eps);
  aq /= q_norm;
  kh /= k_norm;

  // Gate activation, as separate whole-array statements so that Eigen vectorizes each (exp, log1p).
  if (hp.gate == GateMode::kSoftplus) {
    // softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow for large x, where it is x itself
    // (the "x > 20 -> x" rule, without a branch), and exact for very negative x.
    ak = (-a.abs()).exp();             // ak: scratch
    ak = a.max(Real(0)) + ak.log1p();  // softplus(x) >= 0
    a = (-hp.exp_a * ak).exp();        // exp(-exp(A_log) * softplus(x))
  } else {
    ak = (-hp.exp_a * a).exp();                   // exp(-exp(A_log) * x)
    a = (hp.lower_bound / (Real(1) + ak)).exp();  // exp(lower_bound * sigmoid(exp(A_log) * x))
  }

  tv->kq = hp.scale * (kh * aq).sum();
  ak = a * kh;
  aq = hp.scale * a * aq;
  tv->beta = Real(1) / (Real(1) + std::exp(-static_cast<Real>(bf16_to_float(b))));
}

// Applies `rows` consecutive state rows (R at once, so the token vectors are loaded once for R
// rows). With u_out (a verify step's records), u of each row is kept there as fp32.
template <typename Real, int R>
inline void apply_rows(Real* state, std::int64_t row0, std::int64_t K, const TokenVectors<Real>& tv,
                       const bf16_bits* v, Real* o, float* u_out) {
  using Packet = typename Eigen::internal::packet_traits<Real>::type;
  constexpr std::int64_t W = Eigen::internal::packet_traits<Real>::size;
  const std::int64_t k_packets = K / W * W;
  Real* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = state + (row0 + i) * K;

  // Dots with ak and aq: packet partial sums, then the tail, in a fixed order (deterministic).
  Packet dot_k[R], dot_q[R];
  for (int i = 0; i < R; ++i) {
    dot_k[i] = Eigen::internal::pset1<Packet>(Real(0));
    dot_q[i] = Eigen::internal::pset1<Packet>(Real(0));
  }
  for (std::int64_t j = 0; j < k_packets; j += W) {
    const Packet pak = Eigen::internal::ploadu<Packet>(tv.ak + j);
    const Packet paq = Eigen::internal::ploadu<Packet>(tv.aq + j);
    for (int i = 0; i < R; ++i) {
      const Packet x = Eigen::internal::ploadu<Packet>(rows[i] + j);
      dot_k[i] = Eigen::internal::pmadd(x, pak, dot_k[i]);
      dot_q[i] = Eigen::internal::pmadd(x, paq, dot_q[i]);
    }
  }
  Real u[R];
  for (int i = 0; i < R; ++i) {
    Real dk = Eigen::internal::predux(dot_k[i]);
    Real dq = Eigen::internal::predux(dot_q[i]);
    for (std::int64_t j = k_packets; j < K; ++j) {
      dk += rows[i][j] * tv.ak[j];
      dq += rows[i][j] * tv.aq[j];
    }
    u[i] = tv.beta * (static_cast<Real>(bf16_to_float(v[row0 + i])) - dk);
    o[row0 + i] = dq + u[i] * tv.kq;
    if (u_out != nullptr) u_out[row0 + i] = static_cast<float>(u[i]);
  }

  // row = row * a + u * k^
  Packet pu[R];
  for (int i = 0; i < R; ++i) pu[i] = Eigen::internal::pset1<Packet>(u[i]);
  for (std::int64_t j = 0; j < k_packets; j += W) {
    const Packet pa = Eigen::internal::ploadu<Packet>(tv.a + j);
    const Packet pk = Eigen::internal::ploadu<Packet>(tv.kh + j);
    for (int i = 0; i < R; ++i) {
      const Packet x = Eigen::internal::ploadu<Packet>(rows[i] + j);
      Eigen::internal::pstoreu(rows[i] + j,
                               Eigen::internal::pmadd(pu[i], pk, Eigen::internal::pmul(x, pa)));
    }
  }
  for (int i = 0; i < R; ++i) {
    for (std::int64_t j = k_packets; j < K; ++j)
      rows[i][j] = decay_update(rows[i][j], tv.a[j], u[i], tv.kh[j]);
  }
}

// Applies one prepared token to the V x K state; writes o [V] (Real; scale included) and, with
// u_out, u [V] as fp32.
template <typename Real>
void apply_token(Real* state, std::int64_t head_dim_v, std::int64_t head_dim_k,
                 const TokenVectors<Real>& tv, const bf16_bits* v, Real* o,
                 float* u_out = nullptr) {
  constexpr int kRowBlock = 4;
  std::int64_t row = 0;
  for (; row + kRowBlock <= head_dim_v; row += kRowBlock) {
    apply_rows<Real, kRowBlock>(state, row, head_dim_k, tv, v, o, u_out);
  }
  for (; row < head_dim_v; ++row) apply_rows<Real, 1>(state, row, head_dim_k, tv, v, o, u_out);
}

// One token's record (a record-and-commit verify step's, kda.hpp) applied to `count` channels of a
// state row, starting at channel j0 of the row's K: row = row * alpha + u * k^, with the packet
// operations of apply_rows on the channels below K / W * W and its scalar tail above, so that a
// commit reproduces the verify step's state bit for bit in fp32.
template <typename Real>
inline void commit_channels(Real* row, std::int64_t j0, std::int64_t count, std::int64_t K,
                            const float* alpha, const float* kh, float u) {
  const std::int64_t j1 = j0 + count;
  std::int64_t j = j0;
  if constexpr (std::is_same<Real, float>::value) {
    using Packet = typename Eigen::internal::packet_traits<float>::type;
    constexpr std::int64_t W = Eigen::internal::packet_traits<float>::size;
    const std::int64_t k_packets = std::min(j1, K / W * W);
    const Packet pu = Eigen::internal::pset1<Packet>(u);
    for (; j + W <= k_packets; j += W) {
      const Packet pa = Eigen::internal::ploadu<Packet>(alpha + j);
      const Packet pk = Eigen::internal::ploadu<Packet>(kh + j);
      const Packet x = Eigen::internal::ploadu<Packet>(row + j - j0);
      Eigen::internal::pstoreu(row + j - j0,
                               Eigen::internal::pmadd(pu, pk, Eigen::internal::pmul(x, pa)));
    }
  }
  for (; j < j1; ++j) {
    row[j - j0] = decay_update(row[j - j0], static_cast<Real>(alpha[j]), static_cast<Real>(u),
                               static_cast<Real>(kh[j]));
  }
}

// State transfer between memory (bf16 / f32 / none = zeros) and the Real accumulator.
template <typename Real>
void load_state(DType dtype, const void* src, std::int64_t count, Real* dst) {
  if (dtype == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    for (std::int64_t i = 0; i < count; ++i) dst[i] = static_cast<Real>(s[i]);
  } else if (dtype == DType::kBF16) {
    const bf16_bits* s = static_cast<const bf16_bits*>(src);
    for (std::int64_t i = 0; i < count; ++i) dst[i] = static_cast<Real>(bf16_to_float(s[i]));
  } else {
    for (std::int64_t i = 0; i < count; ++i) dst[i] = Real(0);
  }
}

template <typename Real>
void store_state(const Real* src, std::int64_t count, DType dtype, void* dst) {
  if (dtype == DType::kF32) {
    float* d = static_cast<float*>(dst);
    for (std::int64_t i = 0; i < count; ++i) d[i] = static_cast<float>(src[i]);
  } else if (dtype == DType::kBF16) {
    bf16_bits* d = static_cast<bf16_bits*>(dst);
    for (std::int64_t i = 0; i < count; ++i) d[i] = float_to_bf16(static_cast<float>(src[i]));
  }
}

// Writes o [V] as bf16 (rounded once, from Real through float).
template <typename Real>
void store_out(const Real* o, std::int64_t count, bf16_bits* out) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(static_cast<float>(o[i]));
}

// A call's token inputs as bf16 bits (prefill and decode alike).
struct TokenInputs {
  const bf16_bits* q;
  const bf16_bits* k;
  const bf16_bits* v;
  const bf16_bits* g;
  const bf16_bits* beta;
  template <typename CallTensors>
  explicit TokenInputs(const CallTensors& t)
      : q(static_cast<const bf16_bits*>(t.q)),
        k(static_cast<const bf16_bits*>(t.k)),
        v(static_cast<const bf16_bits*>(t.v)),
        g(static_cast<const bf16_bits*>(t.g)),
        beta(static_cast<const bf16_bits*>(t.beta)) {}
};

// Token range [*begin, *end) of sequence `seq`: from cu_seqlens (host memory, validated) or the
// fixed-length rows.
inline void sequence_bounds(const Problem& p, const void* cu_seqlens, std::int64_t seq,
                            std::int64_t* begin, std::int64_t* end) {
  if (p.cu_seqlens_dtype == DType::kI64) {
    *begin = static_cast<const std::int64_t*>(cu_seqlens)[seq];
    *end = static_cast<const std::int64_t*>(cu_seqlens)[seq + 1];
  } else if (p.cu_seqlens_dtype == DType::kI32) {
    *begin = static_cast<const std::int32_t*>(cu_seqlens)[seq];
    *end = static_cast<const std::int32_t*>(cu_seqlens)[seq + 1];
  } else {
    *begin = seq * p.seq_len;
    *end = *begin + p.seq_len;
  }
}

// Bytes of one thread's scratch for a segment transition: a slot whose state is V + K rows tall
// (rows V.. carry P^T: the same recurrence with v = 0, started from the identity), then the bf16
// value row extended by K zeros.
inline std::uint64_t transition_stride(std::int64_t head_dim_k, std::int64_t head_dim_v) {
  const std::uint64_t rows = static_cast<std::uint64_t>(head_dim_v + head_dim_k);
  const std::uint64_t vbuf = align_up<std::uint64_t>(rows * 2, kSlotAlignment);
  return slot_bytes(static_cast<std::uint64_t>(head_dim_k), rows) + vbuf;
}

}  // namespace kda::detail::cpu
