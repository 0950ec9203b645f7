// layer/src/cuda/weight_rows.cuh — a warp's dot product of bf16 weight rows with a bf16 row, 16
// bytes at a time, and the tensor-core form of a few rows (one 16-byte chunk of 16 weight rows
// against 8 input rows): the small-row GEMMs (small_gemm.cu) and the one-launch decode step's
// projections (one_launch_step.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ptx.cuh"  // mma_bf16 (kda/src/cuda)

namespace kda::layer::cuda {

// Eight bf16 values (one uint4) as floats.
__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float (&x)[8]) {
  const std::uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Weights are read once: stream them past L1 so that the input row stays there.
__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// acc + the dot product of eight weights with eight inputs, fp32, in index order.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  float wf[8], xf[8];
  unpack_bf16x8(w, wf);
  unpack_bf16x8(x, xf);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc = fmaf(wf[j], xf[j], acc);
  return acc;
}

// acc (an m16n8 fp32 tile: weight rows g, g + 8 by input rows 2q, 2q + 1, g = lane / 4,
// q = lane % 4) += one chunk's MMAs as the fragment GEMM lays them: `lo` and `hi` the same 16 bytes
// of weight rows g and g + 8, `x` those of input row g. Words (2j, 2j + 1) of each go to the k16
// step j as the fragment's columns (2q, 2q + 1) and (2q + 8, 2q + 9); weights and inputs land on
// the same logical columns, so the MMAs sum the chunk's 8 columns (small_gemm.cu).
__device__ __forceinline__ void fragment_mma(float (&acc)[4], const uint4& lo, const uint4& hi,
                                             const uint4& x) {
  const unsigned a0[4] = {lo.x, hi.x, lo.y, hi.y};
  kda::detail::mma_bf16(acc, a0, x.x, x.y);
  const unsigned a1[4] = {lo.z, hi.z, lo.w, hi.w};
  kda::detail::mma_bf16(acc, a1, x.z, x.w);
}

}  // namespace kda::layer::cuda
