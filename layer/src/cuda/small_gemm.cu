// layer/src/cuda/small_gemm.cu — out = in · Wᵀ for one row (a decode step of one sequence):
// bandwidth-bound, so one warp streams one weight row with 16-byte loads and dots it with the input
// row (held in L1), fp32 accumulation, one rounding at the end. The layer uses it where it was
// measured faster than cuBLAS (H200, kda-layer-bench graph replays: B = 1 3-12 % under cuBLAS; at 8
// rows this kernel, and a variant with four weight rows per warp, took twice cuBLAS's time).
#include <cuda_bf16.h>

#include "cuda/kernels.hpp"

namespace kda::layer::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;  // one output column (weight row) per warp

__device__ __forceinline__ void unpack(const uint4& u, float (&x)[8]) {
  const std::uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Weights are read once: stream them past L1 so that the input rows stay there.
__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int kRows, bool kOutF32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) small_gemm_kernel(SmallGemmParams p) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= p.n) return;
  const auto* w = reinterpret_cast<const uint4*>(p.weight + n * p.k);
  const std::int64_t chunks = p.k / 8;
  float acc[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) acc[m] = 0.0f;
#pragma unroll 4
  for (std::int64_t c = lane; c < chunks; c += 32) {
    float wf[8];
    unpack(load_streaming(w + c), wf);
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      if (m < p.rows) {
        float xf[8];
        unpack(__ldg(reinterpret_cast<const uint4*>(p.in + m * p.ldi) + c), xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m] = fmaf(wf[j], xf[j], acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    float sum = acc[m];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0 && m < p.rows) {
      if constexpr (kOutF32) {
        static_cast<float*>(p.out)[m * p.ldo + n] = sum;
      } else {
        static_cast<std::uint16_t*>(p.out)[m * p.ldo + n] =
            __bfloat16_as_ushort(__float2bfloat16_rn(sum));
      }
    }
  }
}

template <int kRows>
cudaError_t launch_rows(const SmallGemmParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kWarpsPerBlock - 1) / kWarpsPerBlock));
  if (p.out_f32) {
    small_gemm_kernel<kRows, true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  } else {
    small_gemm_kernel<kRows, false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15) == 0; }

}  // namespace

bool small_gemm_fits(const SmallGemmParams& p) {
  return p.rows >= 1 && p.rows <= kSmallGemmMaxRows && p.n >= 1 && p.k >= 8 && p.k % 8 == 0 &&
         p.ldi % 8 == 0 && aligned16(p.in) && aligned16(p.weight) && p.n <= (std::int64_t{1} << 30);
}

cudaError_t launch_small_gemm(const SmallGemmParams& p, cudaStream_t stream) {
  if (!small_gemm_fits(p)) return cudaErrorInvalidValue;
  return launch_rows<1>(p, stream);
}

}  // namespace kda::layer::cuda
