// layer/src/cuda/head_step.cuh — the arithmetic of one decode token on one head, as the fused
// decode step (fused_decode.cu) and the one-launch step (one_launch_step.cu) compute it: a warp
// holds R value rows of the head's state Sᵀ, each lane four consecutive channels k0 .. k0 + 3 of
// K (the operator's decode layout), and the operations run in the operator's decode kernel's order
// (kda/src/cuda/decode_kernel.cuh), so that both kernels compute the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"     // gate_activation (kda/src/cuda)
#include "cuda/conv_silu.cuh"  // bits_to_float, float_to_bits
#include "kda/kda.hpp"

namespace kda::layer::cuda {

// Four bf16 state values (a lane's channels of one row) as floats, and back.
__device__ __forceinline__ void unpack_bf16x4(const uint2 raw, float (&s)[4]) {
  s[0] = __uint_as_float(raw.x << 16), s[1] = __uint_as_float(raw.x & 0xffff0000u);
  s[2] = __uint_as_float(raw.y << 16), s[3] = __uint_as_float(raw.y & 0xffff0000u);
}
__device__ __forceinline__ uint2 pack_bf16x4(const float (&s)[4]) {
  const std::uint32_t lo = static_cast<std::uint32_t>(float_to_bits(s[0])) |
                           (static_cast<std::uint32_t>(float_to_bits(s[1])) << 16);
  const std::uint32_t hi = static_cast<std::uint32_t>(float_to_bits(s[2])) |
                           (static_cast<std::uint32_t>(float_to_bits(s[3])) << 16);
  return make_uint2(lo, hi);
}

// A lane's q̂ = q / ‖q‖ · scale and k̂ = k / ‖k‖ (norms over the warp's 128 channels, 1e-6 under
// the root) and decays α = exp(gate(g)) of its four channels. q_row, k_row, g_row: the lane's four
// values of q and k after the conv and of g (shared memory); dt_bias: the four channels' values
// (16-byte aligned, global or shared memory).
__device__ __forceinline__ void step_factors(const float* q_row, const float* k_row,
                                             const float* g_row, const float* dt_bias, float a_exp,
                                             GateMode mode, float lower_bound, float scale,
                                             float (&qh)[4], float (&kh)[4], float (&alpha)[4]) {
  float q[4], k[4], g[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    q[j] = q_row[j];
    k[j] = k_row[j];
    g[j] = g_row[j];
  }
  float qq = 0.f, kk = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    qq += q[j] * q[j];
    kk += k[j] * k[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    qq += __shfl_xor_sync(0xffffffffu, qq, o);
    kk += __shfl_xor_sync(0xffffffffu, kk, o);
  }
  const float inv_q = rsqrtf(qq + 1e-6f) * scale;
  const float inv_k = rsqrtf(kk + 1e-6f);
  const float4 dtb4 = *reinterpret_cast<const float4*>(dt_bias);
  const float dtb[4] = {dtb4.x, dtb4.y, dtb4.z, dtb4.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    qh[j] = q[j] * inv_q;
    kh[j] = k[j] * inv_k;
    alpha[j] = __expf(kda::detail::gate_activation(mode, g[j], a_exp, dtb[j], lower_bound));
  }
}

// Each of R values summed over the warp's lanes (a butterfly, every lane left with the sums).
template <int R>
__device__ __forceinline__ void sum_over_warp(float (&values)[R]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int i = 0; i < R; ++i) values[i] += __shfl_xor_sync(0xffffffffu, values[i], o);
  }
}

// The sums over the warp's lanes of a lane's eight values, row r's sum left in lanes 4r .. 4r + 3
// (lane l returns row l / 4's): at each of the first three butterfly steps a lane keeps half of
// its rows and adds its partner's values of those rows, then two plain steps. The same additions
// of the same partial sums as sum_over_warp's, so the same bits, with 9 shuffles instead of 40.
__device__ __forceinline__ float sum_rows_over_warp(const float (&values)[8], int lane) {
  float four[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // lanes 16-31 keep rows 4-7
    const bool upper = (lane & 16) != 0;
    const float sent = __shfl_xor_sync(0xffffffffu, upper ? values[i] : values[i + 4], 16);
    four[i] = (upper ? values[i + 4] : values[i]) + sent;
  }
  float two[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // then lanes with 8 set keep the upper two of their four
    const bool upper = (lane & 8) != 0;
    const float sent = __shfl_xor_sync(0xffffffffu, upper ? four[i] : four[i + 2], 8);
    two[i] = (upper ? four[i + 2] : four[i]) + sent;
  }
  const bool upper = (lane & 4) != 0;
  float one = (upper ? two[1] : two[0]) + __shfl_xor_sync(0xffffffffu, upper ? two[0] : two[1], 4);
  one += __shfl_xor_sync(0xffffffffu, one, 2);
  one += __shfl_xor_sync(0xffffffffu, one, 1);
  return one;
}

// The step on the warp's R rows: S ← diag(α) S, δ = β (v − S k̂), S ← S + δ k̂ᵀ, o = S q̂. v: the
// rows' R values (shared memory). on_delta(i, δ) sees each row's δ (a records step keeps it).
// Returns, in lane i < R, row i's o (fp32).
template <int R, class OnDelta>
__device__ __forceinline__ float step_rows(float (&S)[R][4], const float (&alpha)[4],
                                           const float (&kh)[4], const float (&qh)[4], float beta,
                                           const float* v, int lane, OnDelta&& on_delta) {
  float dot[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      S[i][j] *= alpha[j];
      d += S[i][j] * kh[j];
    }
    dot[i] = d;
  }
  if constexpr (R == 8) {
    const float row_sum = sum_rows_over_warp(dot, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) dot[i] = __shfl_sync(0xffffffffu, row_sum, 4 * i);
  } else {
    sum_over_warp(dot);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float delta = beta * (v[i] - dot[i]);
    on_delta(i, delta);
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      S[i][j] = fmaf(delta, kh[j], S[i][j]);
      d += S[i][j] * qh[j];
    }
    dot[i] = d;
  }
  if constexpr (R == 8) {
    const float row_sum = sum_rows_over_warp(dot, lane);
    return __shfl_sync(0xffffffffu, row_sum, (4 * lane) & 31);  // lane i < 8: row i's
  }
  sum_over_warp(dot);
  float mine = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) mine = lane == i ? dot[i] : mine;
  return mine;
}

// The gated RMSNorm's arithmetic, one value at a time, as every kernel that computes it uses it
// (the norm kernel, the fused and one-launch steps, the decode step's epilogue), so that they
// compute the same bits from the same sums:
//   y = o · inv_rms · o_norm · sigmoid(round_bf16(gate + bias)),
//   inv_rms = 1 / sqrt(sum of the head's 128 o² / 128 + eps).

// sigmoid(round_bf16(gate + bias)): the gate rounded after its bias, as the CPU layer rounds it.
__device__ __forceinline__ float output_gate(float gate, float bias) {
  const float g = bits_to_float(float_to_bits(gate + bias));
  return 1.0f / (1.0f + expf(-g));
}

__device__ __forceinline__ float head_inv_rms_of(float sum_squares, float eps) {
  return 1.0f / sqrtf(sum_squares / 128.0f + eps);
}

__device__ __forceinline__ float gated_norm1(float o, float inv_rms, float o_norm, float gate) {
  return o * inv_rms * o_norm * gate;
}

// The gated RMSNorm of a head's 128 outputs over a warp (the norm kernel, gated_rmsnorm.cu): 1 /
// rms from the lane's four values o, then a lane's four y = o / rms · o_norm ·
// sigmoid(round_bf16(gate + bias)), bf16-packed (gated_norm4 below).
__device__ __forceinline__ float head_inv_rms(const float (&o)[4], float eps) {
  float sum_squares[1] = {o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3]};
  sum_over_warp(sum_squares);
  return head_inv_rms_of(sum_squares[0], eps);
}

// The output gates of a lane's four channels, og[j] = sigmoid(round_bf16(gate[j] + bias[d0 + j]))
// (bias null: none): what y takes of the gate.
__device__ __forceinline__ void output_gates4(const float* gate, const std::uint16_t* bias, int d0,
                                              float (&og)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float b = bias != nullptr ? bits_to_float(bias[d0 + j]) : 0.0f;
    og[j] = output_gate(gate[j], b);
  }
}

// A lane's four y from its output gates og and o_norm (the lane's four channels).
__device__ __forceinline__ uint2 gated_norm4(const float (&o)[4], float inv_rms,
                                             const float (&og)[4], const float* o_norm) {
  std::uint32_t words[2];
#pragma unroll
  for (int j = 0; j < 4; j += 2) {
    const float y0 = gated_norm1(o[j], inv_rms, o_norm[j], og[j]);
    const float y1 = gated_norm1(o[j + 1], inv_rms, o_norm[j + 1], og[j + 1]);
    words[j / 2] = static_cast<std::uint32_t>(float_to_bits(y0)) |
                   (static_cast<std::uint32_t>(float_to_bits(y1)) << 16);
  }
  return make_uint2(words[0], words[1]);
}

// The same from the gate itself: gate and o_norm point at the lane's four channels, bias (null:
// none) is indexed by d0 .. d0 + 3 (the lane's channels, counted as the bias array counts them).
__device__ __forceinline__ uint2 gated_norm4(const float (&o)[4], float inv_rms, const float* gate,
                                             const std::uint16_t* bias, int d0,
                                             const float* o_norm) {
  float og[4];
  output_gates4(gate, bias, d0, og);
  return gated_norm4(o, inv_rms, og, o_norm);
}

}  // namespace kda::layer::cuda
