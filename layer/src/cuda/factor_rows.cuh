// layer/src/cuda/factor_rows.cuh — a head's rows of the low-rank second factors (W_fb, W_gb: 128
// rows of 128 bf16) in shared memory, one row a thread, as the fused decode step
// (fused_decode.cu) and the one-launch step (one_launch_step.cu) compute them.
#pragma once

#include <cuda_runtime.h>

#include "cuda/conv_silu.cuh"  // bits_to_float, float_to_bits, unpack8

namespace kda::layer::cuda {

// A bf16 value's float: where the unfused path stores an intermediate in bf16.
__device__ __forceinline__ float round_bf16(float x) { return bits_to_float(float_to_bits(x)); }

// Row r (of W_fb, then W_gb: 128 bf16, 16 chunks of 16 bytes) holds its chunk c at position
// c ^ (r % 16), so that the eight rows a quarter-warp reads at once (one row a thread, the same
// chunk) fall in distinct banks.
inline constexpr int kFactorRowChunks = 128 / 8;
__device__ __forceinline__ int swizzled(int r, int c) {
  return r * kFactorRowChunks + (c ^ (r % kFactorRowChunks));
}

// The dot product of weight row r (shared memory, above) with x (shared memory, fp32, 16-byte
// aligned: read a float4 at a time, every thread the same, one load instruction for four values
// where scalar loads had taken the factors' time): fp32 sums of every fourth chunk (chunk c into
// sum c % 4, in index order), added pairwise at the end. Four chains of 32 dependent FMAs instead
// of one of 128: a step waits on this product.
__device__ __forceinline__ float dot_row(const uint4* rows, int r, const float* x) {
  const auto* x4 = reinterpret_cast<const float4*>(x);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int c = 0; c < kFactorRowChunks; ++c) {
    float wf[8];
    unpack8(rows[swizzled(r, c)], wf);
    const float4 lo = x4[2 * c], hi = x4[2 * c + 1];
    const float xs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[c % 4] = fmaf(wf[j], xs[j], acc[c % 4]);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace kda::layer::cuda
