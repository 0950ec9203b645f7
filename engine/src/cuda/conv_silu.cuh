// engine/src/cuda/conv_silu.cuh — the causal depthwise conv + SiLU of one run of tokens of one
// sequence, for two adjacent channels, shared by the prefill and decode kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/full_layer_kernels.hpp"
#include "kda/kda.hpp"

namespace kda::engine::cuda {

__device__ __forceinline__ float bits_to_float(std::uint16_t bits) {
  return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}
__device__ __forceinline__ std::uint16_t float_to_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
// Two adjacent bf16 values (4-byte aligned) as floats.
__device__ __forceinline__ float2 load_pair(const std::uint16_t* at) {
  const std::uint32_t word = *reinterpret_cast<const std::uint32_t*>(at);
  return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
}
__device__ __forceinline__ void store_pair(std::uint16_t* at, float lo, float hi) {
  const std::uint32_t word = static_cast<std::uint32_t>(float_to_bits(lo)) |
                             (static_cast<std::uint32_t>(float_to_bits(hi)) << 16);
  *reinterpret_cast<std::uint32_t*>(at) = word;
}
// SiLU as the CPU layer computes it: a * sigmoid(a), fp32.
__device__ __forceinline__ float silu(float a) { return a * (1.0f / (1.0f + expf(-a))); }

// values[index] for a register array indexed at run time, without spilling it to local memory.
template <int N>
__device__ __forceinline__ float pick(const float (&values)[N], int index) {
  float result = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) result = i == index ? values[i] : result;
  return result;
}

// The sequence occupies token rows [bos, eos); this thread computes rows [t_begin, t_end) of
// channels c and c + 1 (c even; both in one branch since channels is even). `first_chunk`: t_begin
// == bos — the thread reads the sequence's old conv state (row `slot`; slot < 0: zeros) and, when
// slot >= 0, writes the new one (the sequence's last W-1 inputs). Only first-chunk threads touch
// a state row, and each touches only its own channels' entries, so reads and writes never race.
// Later chunks (t_begin >= bos + kConvChunk >= bos + W - 1) take their history from `proj`.
template <int W>
__device__ __forceinline__ void conv_pair(const ConvParams& p, std::int64_t c, std::int64_t bos,
                                          std::int64_t eos, std::int64_t t_begin,
                                          std::int64_t t_end, bool first_chunk, std::int64_t slot) {
  constexpr int kHist = W - 1;
  static_assert(kHist >= 1 && kHist <= kConvChunk, "conv width out of range");
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  float w0[W], w1[W];
#pragma unroll
  for (int j = 0; j < W; ++j) {
    w0[j] = p.conv_weight[c * W + j];
    w1[j] = p.conv_weight[(c + 1) * W + j];
  }
  const std::uint16_t* column = p.proj + c;
  auto input = [&](std::int64_t t) { return load_pair(column + t * p.proj_stride); };

  // h0/h1: the kHist inputs before the current token, oldest first. s0/s1: the old state.
  float h0[kHist], h1[kHist], s0[kHist], s1[kHist];
  std::uint16_t* state =
      (first_chunk && slot >= 0) ? p.pools[branch] + (slot * p.channels + cc) * kHist : nullptr;
#pragma unroll
  for (int i = 0; i < kHist; ++i) {
    if (first_chunk) {
      s0[i] = state != nullptr ? bits_to_float(state[i]) : 0.0f;
      s1[i] = state != nullptr ? bits_to_float(state[kHist + i]) : 0.0f;
      h0[i] = s0[i];
      h1[i] = s1[i];
    } else {
      const float2 x = input(t_begin - kHist + i);
      h0[i] = x.x;
      h1[i] = x.y;
    }
  }

  std::uint16_t* out = p.out[branch] + cc;
  for (std::int64_t t = t_begin; t < t_end; ++t) {
    const float2 x = input(t);
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int j = 0; j < kHist; ++j) {
      a0 += w0[j] * h0[j];
      a1 += w1[j] * h1[j];
    }
    a0 += w0[W - 1] * x.x;
    a1 += w1[W - 1] * x.y;
    store_pair(out + t * p.channels, silu(a0), silu(a1));
#pragma unroll
    for (int j = 0; j + 1 < kHist; ++j) {
      h0[j] = h0[j + 1];
      h1[j] = h1[j + 1];
    }
    h0[kHist - 1] = x.x;
    h1[kHist - 1] = x.y;
  }

  if (state == nullptr) return;
  // New state column i = input (len - kHist + i) of the sequence: from proj when >= 0, else old
  // state column len + i (held in s0/s1, read before any write).
  const std::int64_t len = eos - bos;
#pragma unroll
  for (int i = 0; i < kHist; ++i) {
    const std::int64_t tau = len - kHist + i;
    float v0, v1;
    if (tau >= 0) {
      const float2 x = input(bos + tau);
      v0 = x.x;
      v1 = x.y;
    } else {
      v0 = pick(s0, static_cast<int>(len) + i);
      v1 = pick(s1, static_cast<int>(len) + i);
    }
    state[i] = float_to_bits(v0);
    state[kHist + i] = float_to_bits(v1);
  }
}

// Copies the beta columns of rows [t_begin, t_end) into the contiguous [tokens, heads] tensor.
__device__ __forceinline__ void copy_beta(const ConvParams& p, std::int64_t t_begin,
                                          std::int64_t t_end) {
  for (std::int64_t t = t_begin; t < t_end; ++t) {
    for (std::int64_t h = threadIdx.x; h < p.heads; h += blockDim.x) {
      p.beta[t * p.heads + h] = p.proj[t * p.proj_stride + p.beta_col + h];
    }
  }
}

// Sequence n's state row, or -1 for padding (negative slot) and for a slot outside the pool
// (reported once per sequence by the thread that asks with `report`).
__device__ __forceinline__ std::int64_t state_row(const ConvParams& p, std::int64_t n,
                                                  bool report) {
  const std::int64_t slot = p.slots != nullptr ? static_cast<std::int64_t>(p.slots[n]) : n;
  if (slot >= p.num_slots) {
    if (report && p.status != nullptr) atomicOr(p.status, kDeviceStatusSlot);
    return -1;
  }
  return slot < 0 ? -1 : slot;
}

inline constexpr int kConvThreads = 128;  // each thread: two channels

}  // namespace kda::engine::cuda
