// layer/src/cuda/small_gemm.cu — out = in · Wᵀ for one row (a decode step of one sequence): a
// matrix-vector product bound by reading W once. Each weight row is cut into `split` slices of K,
// one warp a slice; a block of eight warps holds 8 / split rows and sums each row's slices in
// shared memory (fixed order: deterministic). `split` is chosen per shape so that the grid has
// enough warps in flight to cover the memory latency: a row of 2304 columns fills a warp, a row of
// 4096 (o_proj of a 32-head layer, 2304 rows) is cut in four. Weights are streamed past L1 with
// 16-byte loads, eight in flight a lane; the input row stays in L1; fp32 accumulation, one
// rounding at the end. Launched as a programmatic dependent, it streams its first weights while
// the kernel before it finishes (the layer's o_proj after the fused decode step). Measured against
// cuBLAS on the H200 in kda-layer-bench (KDA_LAYER_SMALL_GEMM=0 runs cuBLAS instead; at 8 rows an
// earlier form of this kernel took twice cuBLAS's time, so the layer uses it for one row only).
#include <cuda_bf16.h>

#include "cuda/kernels.hpp"
#include "cuda/ptx.cuh"  // griddepcontrol (kda/src/cuda)

namespace kda::layer::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 8;  // 16-byte weight loads in flight per lane

__device__ __forceinline__ void unpack(const uint4& u, float (&x)[8]) {
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

__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  float wf[8], xf[8];
  unpack(w, wf);
  unpack(x, xf);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc = fmaf(wf[j], xf[j], acc);
  return acc;
}

using kda::detail::griddep_launch_dependents;
using kda::detail::griddep_wait;

template <bool kOutF32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    small_gemm_kernel(SmallGemmParams p, int split) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int rows_per_block = kWarpsPerBlock / split;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + warp / split;
  const int part = warp % split;
  const std::int64_t chunks = p.k / 8;
  const std::int64_t per_part = (chunks + split - 1) / split;
  const std::int64_t c_begin = part * per_part;
  const std::int64_t c_end = c_begin + per_part < chunks ? c_begin + per_part : chunks;
  griddep_launch_dependents();  // the kernel after this one may start its own prologue
  const bool row = n < p.n;
  const auto* w = reinterpret_cast<const uint4*>(p.weight + (row ? n : 0) * p.k);
  const auto* x = reinterpret_cast<const uint4*>(p.in);
  // Rounds of kUnroll loads a lane, all issued before their math; past the slice's end they are
  // predicated off (a slice of four loads a lane takes one round).
  uint4 wv[kUnroll];
  auto load_round = [&](std::int64_t c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t c = c0 + 32 * u;
      wv[u] = row && c < c_end ? load_streaming(w + c) : make_uint4(0, 0, 0, 0);
    }
  };
  const std::int64_t first = c_begin + lane;
  load_round(first);
  // Launched as a programmatic dependent (SmallGemmParams::programmatic), the input row is the
  // previous kernel's output: the first round of weights is in flight before waiting for it.
  griddep_wait();
  float acc = 0.0f;
  for (std::int64_t c0 = first; row && c0 < c_end; c0 += 32 * kUnroll) {
    if (c0 != first) load_round(c0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t c = c0 + 32 * u;
      if (c < c_end) acc = dot8(wv[u], __ldg(x + c), acc);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  __shared__ float partial[kWarpsPerBlock];
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (part != 0 || lane != 0 || n >= p.n) return;
  float sum = partial[warp];
  for (int s = 1; s < split; ++s) sum += partial[warp + s];
  if constexpr (kOutF32) {
    static_cast<float*>(p.out)[n] = sum;
  } else {
    static_cast<std::uint16_t*>(p.out)[n] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
  }
}

// Slices per row: the fewest (1, 2, 4 or 8) that give the grid 8192 warps or more (about 62 a
// multiprocessor of a 132-SM H200, near its 64), keeping at least two loads a lane per slice.
int split_of(const SmallGemmParams& p) {
  const std::int64_t chunks = p.k / 8;
  int split = 1;
  while (split < kWarpsPerBlock && p.n * split < 8192 && chunks / (2 * split) >= 64) split *= 2;
  return split;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15) == 0; }

}  // namespace

bool small_gemm_fits(const SmallGemmParams& p) {
  return p.rows >= 1 && p.rows <= kSmallGemmMaxRows && p.n >= 1 && p.k >= 8 && p.k % 8 == 0 &&
         p.ldi % 8 == 0 && aligned16(p.in) && aligned16(p.weight) && p.n <= (std::int64_t{1} << 30);
}

cudaError_t launch_small_gemm(const SmallGemmParams& p, cudaStream_t stream) {
  if (!small_gemm_fits(p)) return cudaErrorInvalidValue;
  const int split =
      p.split == 1 || p.split == 2 || p.split == 4 || p.split == 8 ? p.split : split_of(p);
  const int rows_per_block = kWarpsPerBlock / split;
  const dim3 grid(static_cast<unsigned>((p.n + rows_per_block - 1) / rows_per_block));
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kWarpsPerBlock * 32);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (p.programmatic) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return p.out_f32 ? cudaLaunchKernelEx(&config, small_gemm_kernel<true>, p, split)
                   : cudaLaunchKernelEx(&config, small_gemm_kernel<false>, p, split);
}

}  // namespace kda::layer::cuda
