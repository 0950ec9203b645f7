// layer/src/cuda/gated_rmsnorm.cu — the layer's gated RMSNorm per (token, head), fp32 math:
//   y = o * (mean_D(o^2) + eps)^-1/2 * o_norm * sigmoid(round_bf16(gate + bias))  -> bf16
// One warp per row of D = 128 values, four consecutive values per lane (8-byte loads of o and y,
// 16-byte loads of the fp32 gate). The gate arrives in fp32 straight from its GEMM so that the
// bias is added before the rounding, as the CPU layer (and fla's fused gate projection) round it.
#include "cuda/conv_silu.cuh"
#include "cuda/gated_norm.cuh"

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

  const uint2 o_words = *reinterpret_cast<const uint2*>(p.o + at);
  const float o[4] = {__uint_as_float(o_words.x << 16), __uint_as_float(o_words.x & 0xffff0000u),
                      __uint_as_float(o_words.y << 16), __uint_as_float(o_words.y & 0xffff0000u)};
  float sum_squares = o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
  }
  const float inv_rms = head_inv_rms_of(sum_squares, p.eps);

  const float4 gate4 = *reinterpret_cast<const float4*>(p.gate + at);
  const float gate[4] = {gate4.x, gate4.y, gate4.z, gate4.w};
  float y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float bias =
        p.bias != nullptr ? bits_to_float(p.bias[head * kNormHeadDim + d0 + i]) : 0.0f;
    y[i] = gated_norm1(o[i], inv_rms, p.o_norm[d0 + i], output_gate(gate[i], bias));
  }
  uint2 y_words;
  y_words.x = static_cast<std::uint32_t>(float_to_bits(y[0])) |
              (static_cast<std::uint32_t>(float_to_bits(y[1])) << 16);
  y_words.y = static_cast<std::uint32_t>(float_to_bits(y[2])) |
              (static_cast<std::uint32_t>(float_to_bits(y[3])) << 16);
  *reinterpret_cast<uint2*>(p.y + at) = y_words;
}

}  // namespace

cudaError_t launch_gated_rmsnorm(const GatedNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const std::int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  gated_rmsnorm_kernel<<<static_cast<unsigned>(blocks), 32 * kRowsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kda::layer::cuda
