// layer/src/cuda/weight_rows.cuh — a warp's dot product of bf16 weight rows with a bf16 row, 16
// bytes at a time: the one-row GEMMs (small_gemm.cu) and the one-launch decode step's projections
// (one_launch_step.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

}  // namespace kda::layer::cuda
