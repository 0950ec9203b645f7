// layer/src/cuda/gated_rmsnorm.cu — the layer's gated RMSNorm per (token, head), fp32 math:
//   y = o * (mean_D(o^2) + eps)^-1/2 * o_norm * sigmoid(round_bf16(gate + bias))  -> bf16
// One warp per row of D = 128 values, four consecutive values per lane (8-byte loads of o and y,
// 16-byte loads of the fp32 gate). The gate arrives in fp32 straight from its GEMM so that the
// bias is added before the rounding, as the CPU layer (and fla's fused gate projection) round it.
#include "cuda/head_step.cuh"  // head_inv_rms, gated_norm4

namespace kda::layer::cuda {

namespace {

constexpr int kRowsPerBlock = 8;
static_assert(kNormHeadDim == 32 * 4, "one warp of four values per lane covers a head");

__global__ void __launch_bounds__(32 * kRowsPerBlock) gated_rmsnorm_kernel(GatedNormParams p) {
  const int lane = threadIdx.x & 31;
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= p.rows) return;  // warp-uniform
  const std::int64_t head = row % p.heads;
  const int d0 = lane * 4;
  const std::int64_t at = row * kNormHeadDim + d0;

  float o[4];
  unpack_bf16x4(*reinterpret_cast<const uint2*>(p.o + at), o);
  const float4 gate4 = *reinterpret_cast<const float4*>(p.gate + at);
  const float gate[4] = {gate4.x, gate4.y, gate4.z, gate4.w};
  *reinterpret_cast<uint2*>(p.y + at) =
      gated_norm4(o, head_inv_rms(o, p.eps), gate,
                  p.bias != nullptr ? p.bias + head * kNormHeadDim : nullptr, d0, p.o_norm + d0);
}

}  // namespace

cudaError_t launch_gated_rmsnorm(const GatedNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const std::int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  gated_rmsnorm_kernel<<<static_cast<unsigned>(blocks), 32 * kRowsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kda::layer::cuda
