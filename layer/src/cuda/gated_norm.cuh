// layer/src/cuda/gated_norm.cuh — the gated RMSNorm's arithmetic, one value at a time, as every
// kernel that computes it uses it (the norm kernel, the fused and one-launch steps, the decode
// step's epilogue), so that they compute the same bits from the same sums:
//   y = o · inv_rms · o_norm · sigmoid(round_bf16(gate + bias)),
//   inv_rms = 1 / sqrt(sum of the head's 128 o² / 128 + eps).
#pragma once

#include <cuda_runtime.h>

#include "cuda/conv_silu.cuh"  // bits_to_float, float_to_bits

namespace kda::layer::cuda {

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

}  // namespace kda::layer::cuda
