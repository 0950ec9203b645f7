// Device-side helpers shared by the CUDA prefill and decode kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ptx.cuh"
#include "kda/kda.hpp"

namespace kda::detail {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;

// Gate activations (KDA.md §1), fp32. softplus(x) = max(x, 0) + log(1 + exp(-|x|)): stable for
// any x, with fast intrinsics (absolute error ~1e-7, far below the bf16 inputs' rounding).
__device__ __forceinline__ float softplus_f(float x) {
  return fmaxf(x, 0.f) + __logf(1.f + __expf(-fabsf(x)));
}
// __fdividef: the SFU reciprocal (2 ulp), not IEEE division's instruction sequence; it gives 0 when
// 1 + exp(-x) overflows, which is sigmoid's value there too.
__device__ __forceinline__ float sigmoid_f(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))   (GateMode::kLowerBound)
// g = -exp(A_log) * softplus(g_raw + dt_bias)                  (GateMode::kSoftplus)
__device__ __forceinline__ float gate_activation(GateMode gate, float g_raw, float a_exp,
                                                 float dt_bias, float lower_bound) {
  const float x = g_raw + dt_bias;
  return gate == GateMode::kLowerBound ? lower_bound * sigmoid_f(a_exp * x)
                                       : -a_exp * softplus_f(x);
}

// The same gates times log2(e) (the prefill's cumulative sums are in log2 units), on the SFU's
// ex2 / lg2 / rcp alone (flushing denormals, which the gates' ranges never need). The per-channel
// constants: GateLog2::make(gate, exp(A_log), dt_bias, lower_bound).
struct GateLog2 {
  // z = mul g + add: bounded -(a log2e) x, softplus x log2e (x = g + dt_bias; one FFMA either way)
  float mul, add, scale;
  bool bounded;
  __device__ __forceinline__ static GateLog2 make(GateMode gate, float a_exp, float dt_bias,
                                                  float lower_bound) {
    const bool b = gate == GateMode::kLowerBound;
    const float m = b ? -a_exp * kLog2e : kLog2e;
    return GateLog2{m, m * dt_bias, b ? lower_bound * kLog2e : -a_exp, b};
  }
  __device__ __forceinline__ float operator()(float g_raw) const {
    const float z = fmaf(mul, g_raw, add);
    if (bounded) return scale * fast_rcp(1.f + fast_exp2(z));  // lower_bound log2e / (1 + 2^z)
    // -a (max(z, 0) + log2(1 + 2^-|z|)) = -a log2e softplus(x)
    return scale * (fmaxf(z, 0.f) + fast_log2(1.f + fast_exp2(-fabsf(z))));
  }
};

// A forward's token inputs and gate parameters on the device, as the kernels read them (prefill
// and decode alike); from_tensors() takes them from a Tensors or DecodeTensors.
struct InputPointers {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* g;
  const bf16* beta;
  const float* A_log;
  const float* dt_bias;

  template <typename CallTensors>
  static InputPointers from_tensors(const CallTensors& t) {
    return {static_cast<const bf16*>(t.q),
            static_cast<const bf16*>(t.k),
            static_cast<const bf16*>(t.v),
            static_cast<const bf16*>(t.g),
            static_cast<const bf16*>(t.beta),
            t.A_log,
            t.dt_bias};
  }
};

// Sequence bounds [bos, eos) of sequence s: from cu_seqlens (int32 or int64) or fixed rows of T.
struct SeqIndex {
  const void* cu;  // nullptr: fixed-length rows
  int cu_is_64;
  std::int64_t row_len;  // T per row (fixed length)
  std::int64_t total;    // all tokens
  std::int64_t num_seqs;

  __device__ __forceinline__ std::int64_t start(std::int64_t s) const {
    if (cu == nullptr) return s * row_len;
    return cu_is_64 ? static_cast<const std::int64_t*>(cu)[s]
                    : static_cast<std::int64_t>(static_cast<const std::int32_t*>(cu)[s]);
  }
  // Bounds clamped to [0, total] so that broken cu_seqlens on the device can never index out of
  // range (the host validates them when it has a copy).
  __device__ __forceinline__ void bounds(std::int64_t s, std::int64_t* bos,
                                         std::int64_t* eos) const {
    std::int64_t b = start(s), e = start(s + 1);
    b = b < 0 ? 0 : (b > total ? total : b);
    e = e < b ? b : (e > total ? total : e);
    *bos = b;
    *eos = e;
  }
};

// Gate parameters outside the contract's range (kda.hpp: kMaxAbsALog; NaN fails every comparison).
__device__ __forceinline__ bool gate_params_bad(float a_log, float dt_bias) {
  return !(fabsf(a_log) <= kMaxAbsALog) || !isfinite(dt_bias);
}

// One accepted token's record applied to a run of state elements Sᵀ[row][k .. k + N): the decay
// alpha, then the rank-one update u k^, each rounded once to fp32 (kda.hpp, "Records"). The one
// definition of the commit's element operations: the commit kernel, the decode kernel's fold and
// the whole layer's fused step (its fold) all apply records through it, so that folding equals
// committing bit for bit.
template <int N>
__device__ __forceinline__ void apply_record(float (&S)[N], const float (&alpha)[N],
                                             const float (&k_hat)[N], float u) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    S[j] *= alpha[j];
    S[j] = fmaf(u, k_hat[j], S[j]);
  }
}

// ORs `bits` into the caller's device status word (Tensors::device_status), if it gave one.
__device__ __forceinline__ void report_status(std::uint32_t* status, std::uint32_t bits) {
  if (status != nullptr && bits != 0) atomicOr(status, bits);
}

// A bf16 pair (lo in the low half) as floats. bf16 -> fp32 is exact (the bf16 bits are the float's
// upper half): two integer operations a pair, where cvt.f32.bf16 cost about two a value.
__device__ __forceinline__ float2 unpack_bf16x2(std::uint32_t raw) {
  return make_float2(__uint_as_float(raw << 16), __uint_as_float(raw & 0xffff0000u));
}

__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}

// An fp16 pair (lo in the low half), round to nearest, and back.
__device__ __forceinline__ std::uint32_t pack_f16x2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}
__device__ __forceinline__ float2 unpack_f16x2(std::uint32_t raw) {
  return __half22float2(*reinterpret_cast<const __half2*>(&raw));
}

// 2^e as a float, e clamped to [-kMaxScaleExp, kMaxScaleExp] (normal either way, exact inverse).
inline constexpr int kMaxScaleExp = 100;
__device__ __forceinline__ float pow2f(int e) {
  e = e < -kMaxScaleExp ? -kMaxScaleExp : e > kMaxScaleExp ? kMaxScaleExp : e;
  return __uint_as_float(static_cast<std::uint32_t>(127 + e) << 23);
}
// The power-of-two exponent that brings m (>= 0) into [1, 2); 0 for 0 and for inf / NaN.
__device__ __forceinline__ int scale_exponent(float m) {
  if (!(m > 0.f) || !isfinite(m)) return 0;
  const int e = ilogbf(m);
  return e < -kMaxScaleExp ? -kMaxScaleExp : e > kMaxScaleExp ? kMaxScaleExp : e;
}

// What bf16 left of two floats whose packed bf16 pair is `hi` (x - hi is exact in fp32), as a bf16
// pair: hi + lo carries x to ~2^-17 relative, an fp32-like operand in two bf16 mma.
__device__ __forceinline__ std::uint32_t bf16x2_remainder(float x_lo, float x_hi,
                                                          std::uint32_t hi) {
  const float2 h = unpack_bf16x2(hi);
  return pack_bf16x2(x_lo - h.x, x_hi - h.y);
}

}  // namespace kda::detail
