// layer/src/cuda/conv_silu.cuh — the causal depthwise conv + SiLU of one run of tokens of one
// sequence, for eight adjacent channels (one 16-byte load or store per token row), shared by the
// prefill and decode kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels.hpp"
#include "kda/kda.hpp"

namespace kda::layer::cuda {

inline constexpr int kConvVec = 8;        // channels per thread: one uint4 of bf16
inline constexpr int kConvGroup = 8;      // token rows loaded together before their math
inline constexpr int kConvThreads = 128;  // at most, per block

__device__ __forceinline__ float bits_to_float(std::uint16_t bits) {
  return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}
__device__ __forceinline__ std::uint16_t float_to_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
// SiLU, a * sigmoid(a) in fp32, as a / (1 + e^-a) with the hardware's exp2 and reciprocal: a few
// ulp from the CPU layer's a * (1 / (1 + exp(-a))), well inside the bf16 rounding of every
// output, in fewer instructions than expf and the IEEE reciprocal (the prefill conv's phase on the
// H200 at T = 8192: H = 32 190 against 196 us, TP8 34 against 36, K3's TP8 shard 86 against 95).
// a below about -87 gives -0 (the reciprocal of a huge or infinite denominator is 0).
__device__ __forceinline__ float silu(float a) { return __fdividef(a, 1.0f + __expf(-a)); }

// Eight bf16 values (one uint4) as floats, and back (round to nearest even).
__device__ __forceinline__ void unpack8(const uint4& u, float (&x)[kConvVec]) {
  const std::uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float (&y)[kConvVec]) {
  std::uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = static_cast<std::uint32_t>(float_to_bits(y[2 * i])) |
           (static_cast<std::uint32_t>(float_to_bits(y[2 * i + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// values[index] for a register array indexed at run time, without spilling it to local memory.
template <typename T, int N>
__device__ __forceinline__ T pick(const T (&values)[N], int index) {
  T result = values[0];
#pragma unroll
  for (int i = 1; i < N; ++i) result = i == index ? values[i] : result;
  return result;
}

// The conv-state slice of eight channels: [8, W-1] bf16, channel-major (8 * (W-1) values, a whole
// number of uint4). `vector`: the pool is 16-byte aligned, so the slice (at a multiple of 16 *
// (W-1) bytes) is read and written as W-1 uint4s; otherwise bf16 by bf16.
template <int kHist>
__device__ __forceinline__ void load_state(const std::uint16_t* state, bool vector,
                                           std::uint16_t (&bits)[kConvVec * kHist]) {
  if (vector) {
#pragma unroll
    for (int q = 0; q < kHist; ++q) {
      const uint4 u = reinterpret_cast<const uint4*>(state)[q];
      const std::uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        bits[8 * q + 2 * i] = static_cast<std::uint16_t>(w[i] & 0xffffu);
        bits[8 * q + 2 * i + 1] = static_cast<std::uint16_t>(w[i] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kConvVec * kHist; ++i) bits[i] = state[i];
  }
}
template <int kHist>
__device__ __forceinline__ void store_state(std::uint16_t* state, bool vector,
                                            const std::uint16_t (&bits)[kConvVec * kHist]) {
  if (vector) {
#pragma unroll
    for (int q = 0; q < kHist; ++q) {
      std::uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = static_cast<std::uint32_t>(bits[8 * q + 2 * i]) |
               (static_cast<std::uint32_t>(bits[8 * q + 2 * i + 1]) << 16);
      }
      reinterpret_cast<uint4*>(state)[q] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kConvVec * kHist; ++i) state[i] = bits[i];
  }
}

// The conv taps of channels c .. c + 7: 8 x W floats, channel-major, contiguous and 16-byte
// aligned (c * W * 4 is a multiple of 32), in W 16-byte loads.
template <int W>
__device__ __forceinline__ void load_taps(const ConvParams& p, std::int64_t c,
                                          float (&taps)[kConvVec * W]) {
  const float4* from = reinterpret_cast<const float4*>(p.conv_weight + c * W);
#pragma unroll
  for (int q = 0; q < kConvVec * W / 4; ++q) {
    const float4 f = __ldg(from + q);
    taps[4 * q] = f.x;
    taps[4 * q + 1] = f.y;
    taps[4 * q + 2] = f.z;
    taps[4 * q + 3] = f.w;
  }
}

// The thread's eight input channels of token row t, straight from `proj` (one 16-byte load).
struct ProjRows {
  const uint4* column;
  std::int64_t stride;  // in uint4
  __device__ ProjRows(const ConvParams& p, std::int64_t c)
      : column(reinterpret_cast<const uint4*>(p.proj + c)), stride(p.proj_stride / kConvVec) {}
  __device__ __forceinline__ uint4 operator()(std::int64_t t) const {
    return __ldg(column + t * stride);
  }
};

// The conv state of eight channels `offset` tokens into a sequence starting at row bos: column k
// (oldest first) is the sequence's input offset - kHist + k, from `input(row)` (the eight
// channels of a token row) where that is >= 0, else the initial state's column offset + k
// (`initial`, read only where offset < kHist). A sequence's new state is its state at its length;
// a checkpoint's, at its offset.
template <int kHist, class Input>
__device__ __forceinline__ void conv_state_at(std::int64_t offset, std::int64_t bos,
                                              const Input& input,
                                              const std::uint16_t (&initial)[kConvVec * kHist],
                                              std::uint16_t (&out)[kConvVec * kHist]) {
#pragma unroll
  for (int k = 0; k < kHist; ++k) {
    const std::int64_t tau = offset - kHist + k;
    if (tau >= 0) {
      const uint4 u = input(bos + tau);
      const std::uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < kConvVec; ++i) {
        out[i * kHist + k] = static_cast<std::uint16_t>(words[i / 2] >> (16 * (i % 2)));
      }
    } else {
      // offset + k < kHist here.
#pragma unroll
      for (int i = 0; i < kConvVec; ++i) {
        std::uint16_t column[kHist];
#pragma unroll
        for (int m = 0; m < kHist; ++m) column[m] = initial[i * kHist + m];
        out[i * kHist + k] = pick(column, static_cast<int>(offset) + k);
      }
    }
  }
}

// The sequence occupies token rows [bos, eos); this thread computes rows [t_begin, t_end) of
// channels c .. c + 7 (c a multiple of 8; all in one branch since channels is a multiple of 8).
// `first_chunk`: t_begin == bos — the thread reads the sequence's old conv state (row `slot`;
// slot < 0: zeros) and, when slot >= 0, writes the new one (the sequence's last W-1 inputs). Only
// first-chunk threads touch a state row, and each touches only its own channels' entries, so reads
// and writes never race. Later chunks (t_begin >= bos + W - 1) take their history from run_row.
//
// Rows are loaded kConvGroup at a time (all loads of a group issued before its math; a partial
// group re-reads its last row instead of branching, and computes only its own rows), each output is
//   silu(((0 + w[0] h[0]) + w[1] h[1]) + ... + w[W-1] x)   in fp32, taps in this order,
// the CPU layer's operations (its SiLU to a few ulp: silu above).
//
// Requires (checked by the launchers): proj, proj_stride, channels and out[] 16-byte granular,
// conv_weight 16-byte aligned.
// kVerify: a decode verify step (p.num_accepted; compiled apart, so that the prefill's and a plain
// decode's code is what it was). `run_row(t)`: the thread's eight input channels of token row t,
// for the rows of the run and the kHist before it (the prefill stages them in shared memory); the
// new conv state's rows, which may lie past the run, come from `proj`.
template <int W, bool kVerify = false, class RunRow>
__device__ __forceinline__ void conv8(const ConvParams& p, bool vector_state, std::int64_t c,
                                      std::int64_t bos, std::int64_t eos, std::int64_t t_begin,
                                      std::int64_t t_end, bool first_chunk, std::int64_t slot,
                                      const RunRow& run_row) {
  constexpr int kHist = W - 1;
  static_assert(kHist >= 1 && kHist <= kConvChunk, "conv width out of range");
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;

  float w[kConvVec][W];
  {
    float flat[kConvVec * W];
    load_taps<W>(p, c, flat);
#pragma unroll
    for (int i = 0; i < kConvVec; ++i) {
#pragma unroll
      for (int j = 0; j < W; ++j) w[i][j] = flat[i * W + j];
    }
  }
  const ProjRows input(p, c);

  // h[i][k]: the kHist inputs of channel c + i before the current token, oldest first.
  float h[kConvVec][kHist];
  std::uint16_t* state =
      (first_chunk && slot >= 0) ? p.pools[branch] + (slot * p.channels + cc) * kHist : nullptr;
  if (first_chunk) {
    std::uint16_t old[kConvVec * kHist];
    if (state != nullptr) {
      load_state<kHist>(state, vector_state, old);
    } else {
#pragma unroll
      for (int i = 0; i < kConvVec * kHist; ++i) old[i] = 0;
    }
#pragma unroll
    for (int i = 0; i < kConvVec; ++i) {
#pragma unroll
      for (int k = 0; k < kHist; ++k) h[i][k] = bits_to_float(old[i * kHist + k]);
    }
  } else {
    uint4 rows[kHist];
#pragma unroll
    for (int k = 0; k < kHist; ++k) rows[k] = run_row(t_begin - kHist + k);
#pragma unroll
    for (int k = 0; k < kHist; ++k) {
      float x[kConvVec];
      unpack8(rows[k], x);
#pragma unroll
      for (int i = 0; i < kConvVec; ++i) h[i][k] = x[i];
    }
  }

  const std::int64_t out_stride = p.channels / kConvVec;  // in uint4
  uint4* out = reinterpret_cast<uint4*>(p.out[branch] + cc);
#pragma unroll 1
  for (std::int64_t t0 = t_begin; t0 < t_end; t0 += kConvGroup) {
    uint4 rows[kConvGroup];
#pragma unroll
    for (int r = 0; r < kConvGroup; ++r) {
      // Past t_end (a partial last group): the last row again; its results are not stored.
      rows[r] = run_row(t0 + r < t_end ? t0 + r : t_end - 1);
    }
#pragma unroll
    for (int r = 0; r < kConvGroup; ++r) {
      // A partial group (the last one; a decode step of fewer than kConvGroup tokens) stops at
      // t_end: the math of the rows past it would be thrown away (it made decode 2x slower).
      if (t0 + r >= t_end) break;
      float x[kConvVec], y[kConvVec];
      unpack8(rows[r], x);
#pragma unroll
      for (int i = 0; i < kConvVec; ++i) {
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < kHist; ++j) a += w[i][j] * h[i][j];
        a += w[i][W - 1] * x[i];
        y[i] = silu(a);
#pragma unroll
        for (int j = 0; j + 1 < kHist; ++j) h[i][j] = h[i][j + 1];
        h[i][kHist - 1] = x[i];
      }
      out[(t0 + r) * out_stride] = pack8(y);
      if (kVerify && state != nullptr) {
        // A verify step keeps the conv state after each token where its row names a slot.
        // (A decode row's tokens are rows n * T .. n * T + T - 1: slots[n][t] is slots[row].)
        const std::int64_t keep = p.slots[t0 + r];
        if (keep >= p.num_slots && cc == 0 && branch == 0 && p.status != nullptr) {
          atomicOr(p.status, kDeviceStatusSlot);
        }
        if (keep >= 0 && keep < p.num_slots && keep != p.padding_slot) {
          std::uint16_t bits[kConvVec * kHist];
#pragma unroll
          for (int i = 0; i < kConvVec; ++i) {
#pragma unroll
            for (int k = 0; k < kHist; ++k) bits[i * kHist + k] = float_to_bits(h[i][k]);
          }
          store_state<kHist>(p.pools[branch] + (keep * p.channels + cc) * kHist, vector_state,
                             bits);
        }
      }
    }
  }

  if (state == nullptr || kVerify || p.conv_records != nullptr) return;
  // New state column k = input (len - kHist + k) of the sequence: from proj when >= 0, else old
  // state column len + k (read again: nothing has written the row since the read above).
  const std::int64_t len = eos - bos;
  std::uint16_t old[kConvVec * kHist];
  if (len < kHist) load_state<kHist>(state, vector_state, old);
  std::uint16_t next[kConvVec * kHist];
  conv_state_at<kHist>(len, bos, input, old, next);
  store_state<kHist>(state, vector_state, next);
}

// Copies the beta columns of rows [t_begin, t_end) into the contiguous [tokens, heads] tensor, one
// value per thread of the block.
__device__ __forceinline__ void copy_beta(const ConvParams& p, std::int64_t t_begin,
                                          std::int64_t t_end) {
  const std::int64_t n = (t_end - t_begin) * p.heads;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const std::int64_t t = t_begin + i / p.heads, h = i % p.heads;
    p.beta[t * p.heads + h] = p.proj[t * p.proj_stride + p.beta_col + h];
  }
}

// Sequence n's state row, or -1 for padding (negative slot) and for a slot outside the pool
// (reported once per sequence by the thread that asks with `report`). A verify step's row: its
// slot at num_accepted - 1 (a count outside [1, decode_tokens]: padding, reported).
template <bool kVerify = false>
__device__ __forceinline__ std::int64_t state_row(const ConvParams& p, std::int64_t n,
                                                  bool report) {
  std::int64_t slot = p.slots != nullptr ? static_cast<std::int64_t>(p.slots[n]) : n;
  if constexpr (kVerify) {
    const std::int32_t accepted = p.num_accepted[n];
    if (accepted < 1 || accepted > p.decode_tokens) {
      if (report && p.status != nullptr) atomicOr(p.status, kDeviceStatusAccepted);
      return -1;
    }
    slot = p.slots[n * p.decode_tokens + accepted - 1];
  }
  if (slot >= p.num_slots) {
    if (report && p.status != nullptr) atomicOr(p.status, kDeviceStatusSlot);
    return -1;
  }
  return slot < 0 || slot == p.padding_slot ? -1 : slot;
}

// Host side: the block shape that covers 3 * channels / 8 threads of one token run with the
// fewest idle threads (tiles blocks of `threads`, a multiple of 32, at most kConvThreads).
struct ConvShape {
  unsigned threads = 0;
  unsigned tiles = 0;
};
inline ConvShape conv_shape(std::int64_t channels) {
  const std::int64_t groups = 3 * channels / kConvVec;
  const std::int64_t tiles = (groups + kConvThreads - 1) / kConvThreads;
  const std::int64_t per_tile = (groups + tiles - 1) / tiles;
  return {static_cast<unsigned>((per_tile + 31) / 32 * 32), static_cast<unsigned>(tiles)};
}

// Host side: the layout the 8-channel kernels need (cudaErrorInvalidValue otherwise), and whether
// the conv-state pools allow 16-byte state accesses.
inline bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15) == 0; }
inline cudaError_t check_conv_layout(const ConvParams& p, bool* vector_state) {
  if (p.channels <= 0 || p.channels % kConvVec != 0 || p.proj_stride % kConvVec != 0 ||
      !aligned16(p.proj) || !aligned16(p.conv_weight) || !aligned16(p.out[0]) ||
      !aligned16(p.out[1]) || !aligned16(p.out[2])) {
    return cudaErrorInvalidValue;
  }
  *vector_state = aligned16(p.pools[0]) && aligned16(p.pools[1]) && aligned16(p.pools[2]);
  return cudaSuccess;
}

}  // namespace kda::layer::cuda
