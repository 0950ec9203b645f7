// layer/src/cuda/conv_decode.cu — the short convolutions (+ SiLU) of q, k and v for a decode step:
// every sequence has the same few tokens (rows n * k .. n * k + k - 1), each starts from its conv
// state and leaves the new one behind. Fused with the copy of beta into the core's layout and, when
// the caller gave no slot list, the identity slot list kda::decode_cuda needs. One thread: eight
// channels of one sequence, of two in a plain one-token step (16-byte loads and stores, 16-byte
// state accesses when the pools are 16-byte aligned; a one-token step's taps fetched by the warp in
// whole lines). Blocks past the sequences' compute the low-rank second factors
// (ConvParams::factors), which read only the projection too: one launch instead of three.
#include <cstdlib>
#include <string>

#include "cuda/conv_silu.cuh"
#include "cuda/ptx.cuh"  // mma_bf16 (kda/src/cuda)

namespace kda::layer::cuda {

namespace {

constexpr int kFactorRank = 128;  // the low-rank factors' inner dimension
constexpr int kFactorTile = 16;   // rows and channels of a warp's tile (conv_decode_factor_tiles)

// The factors' warp tiles: g's, then as many of the gate's.
__host__ __device__ inline std::int64_t factor_warp_tiles(const ConvParams& p) {
  if (p.factors.w_fb == nullptr) return 0;
  const std::int64_t one = conv_decode_factor_tiles(p.tokens, p.channels);
  return p.factors.gate != nullptr ? 2 * one : one;
}

__device__ __forceinline__ unsigned word(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// One warp: rows [16 rt, 16 rt + 16) x channels [16 ct, 16 ct + 16) of g (or of the gate), two
// mma.m16n8k16 tiles summed over the rank in fp32. The order of k inside an mma is free as long as
// A and B agree: lane 4 r + t takes k = 8 t .. 8 t + 7 of every 32 from one 16-byte load of its
// input row and of its weight row, words 0-1 for one k step and words 2-3 for the next. g is
// rounded to bf16 as the GEMM it replaces stores it; the gate stays fp32.
__device__ void factor_tile(const ConvParams& p, std::int64_t tile) {
  const ConvParams::Factors& f = p.factors;
  const std::int64_t col_tiles = p.channels / kFactorTile;
  const std::int64_t per_factor = conv_decode_factor_tiles(p.tokens, p.channels);
  const bool gate = tile >= per_factor;
  if (gate) tile -= per_factor;
  const std::int64_t rt = tile / col_tiles, ct = tile % col_tiles;
  const int lane = static_cast<int>(threadIdx.x & 31), r = lane >> 2, t = lane & 3;
  const std::uint16_t* w = (gate ? f.w_gb : f.w_fb) + (ct * kFactorTile + r) * kFactorRank + 8 * t;
  const std::uint16_t* in = p.proj + (gate ? f.g_a_col : f.f_a_col) + 8 * t;
  const std::int64_t row_lo = rt * kFactorTile + r, row_hi = row_lo + 8;
  const bool lo = row_lo < p.tokens, hi = row_hi < p.tokens;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[2][4] = {};
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {  // two rounds of loads: 32 registers in flight, not 64
    uint4 a_lo[2], a_hi[2], b[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int k = 64 * half + 32 * j;
      a_lo[j] = lo ? __ldg(reinterpret_cast<const uint4*>(in + row_lo * p.proj_stride + k)) : zero;
      a_hi[j] = hi ? __ldg(reinterpret_cast<const uint4*>(in + row_hi * p.proj_stride + k)) : zero;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        b[n][j] = __ldg(reinterpret_cast<const uint4*>(w + n * 8 * kFactorRank + k));
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const unsigned a[4] = {word(a_lo[j], 2 * s), word(a_hi[j], 2 * s), word(a_lo[j], 2 * s + 1),
                               word(a_hi[j], 2 * s + 1)};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          kda::detail::mma_bf16(acc[n], a, word(b[n][j], 2 * s), word(b[n][j], 2 * s + 1));
        }
      }
    }
  }
  // acc[n]: row_lo (0, 1) and row_hi (2, 3), channels 16 ct + 8 n + 2 t and the one after.
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const std::int64_t c = ct * kFactorTile + 8 * n + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = half == 0 ? row_lo : row_hi;
      if (!(half == 0 ? lo : hi)) continue;
      const float x = acc[n][2 * half], y = acc[n][2 * half + 1];
      if (gate) {
        *reinterpret_cast<float2*>(f.gate + row * p.channels + c) = make_float2(x, y);
      } else {
        *reinterpret_cast<std::uint32_t*>(f.g + row * p.channels + c) =
            static_cast<std::uint32_t>(float_to_bits(x)) |
            (static_cast<std::uint32_t>(float_to_bits(y)) << 16);
      }
    }
  }
}

// A fold (ConvParams::fold_rows): channels c .. c + 7 of the row's conv state become the last W-1
// of (old ++ the folded row's first `accepted` pre-conv inputs): bf16 bits moved, as the commit
// (conv_commit.cu) moves them, stored before the conv reads the state again (same thread).
template <int W>
__device__ __forceinline__ void fold_conv_state(const ConvParams& p, bool vector_state,
                                                std::int64_t c, std::int64_t row,
                                                std::int64_t accepted, std::int64_t slot) {
  constexpr int kHist = W - 1;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  std::uint16_t* state = p.pools[branch] + (slot * p.channels + cc) * kHist;
  std::uint16_t bits[kConvVec * kHist];
  load_state<kHist>(state, vector_state, bits);
  const std::int64_t rec_stride = 3 * p.channels / kConvVec;  // in uint4
  const uint4* inputs =
      reinterpret_cast<const uint4*>(p.fold_conv_records + c) + row * p.fold_tokens * rec_stride;
  for (std::int64_t t = 0; t < accepted; ++t) {
    const uint4 u = __ldg(inputs + t * rec_stride);
    const std::uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < kConvVec; ++i) {
#pragma unroll
      for (int k = 0; k + 1 < kHist; ++k) bits[i * kHist + k] = bits[i * kHist + k + 1];
      bits[i * kHist + kHist - 1] = static_cast<std::uint16_t>(words[i / 2] >> (16 * (i % 2)));
    }
  }
  store_state<kHist>(state, vector_state, bits);
}

// A warp's conv taps, fetched in whole lines. Its lanes' taps are contiguous (2 W float4 a lane),
// so that a load of one float4 a lane touches 32 lines, and the taps (the largest of a thread's
// loads) kept the L1 busy. Here the warp's `lanes` active lanes (the lowest; a block is whole
// warps, so lane 0's channel, c - 8 lane, is the warp's first) load them in consecutive float4
// into their slice of shared memory, and each lane then reads its own; float4 i sits at
// i ^ (i / 8 % 8), so that neither the stores nor (for W = 2 and 4) the reads of eight lanes share
// a bank.
template <int W>
__device__ __forceinline__ void load_taps_coalesced(const ConvParams& p, std::int64_t c, int lanes,
                                                    unsigned mask, float (&taps)[kConvVec * W]) {
  constexpr int kPerLane = kConvVec * W / 4;
  __shared__ float4 staged[kConvThreads / 32][32 * kPerLane];
  const int lane = static_cast<int>(threadIdx.x % 32);
  float4* slice = staged[threadIdx.x / 32];
  const float4* from = reinterpret_cast<const float4*>(p.conv_weight + (c - kConvVec * lane) * W);
  auto at = [](int i) { return i ^ (i / 8 % 8); };
  float4 raw[kPerLane];
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) raw[q] = __ldg(from + q * lanes + lane);
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) slice[at(q * lanes + lane)] = raw[q];
  __syncwarp(mask);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float4 f = slice[at(kPerLane * lane + j)];
    taps[4 * j] = f.x, taps[4 * j + 1] = f.y, taps[4 * j + 2] = f.z, taps[4 * j + 3] = f.w;
  }
}

// A step of one token a row (a plain decode step, or a records step of one token): conv8's
// operations on that token, bit for bit, with the conv state held as packed bf16 pairs (value m =
// i * kHist + k of the channel-major slice in word m / 2) rather than a register a value, and no
// group of rows: conv8's registers (162 at W = 4, its group of eight rows holding the one row eight
// times) kept three blocks on a multiprocessor, and a large batch's step was bound by latency.
// In two parts, so that a thread can take several rows (below): what a row loads (its conv state
// and its input), then the arithmetic and the stores.
template <int W>
struct OneTokenRow {
  std::uint16_t* state = nullptr;  // null: padding (no state read or written)
  std::uint32_t old[kConvVec * (W - 1) / 2];
  uint4 in;
};

template <int W>
__device__ __forceinline__ void load_one_token_row(const ConvParams& p, bool vector_state,
                                                   std::int64_t c, std::int64_t row,
                                                   std::int64_t slot, OneTokenRow<W>& r) {
  constexpr int kHist = W - 1;
  constexpr int kWords = kConvVec * kHist / 2;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  r.state = slot >= 0 ? p.pools[branch] + (slot * p.channels + cc) * kHist : nullptr;
  if (r.state == nullptr) {
#pragma unroll
    for (int q = 0; q < kWords; ++q) r.old[q] = 0;
  } else if (vector_state) {
#pragma unroll
    for (int q = 0; q < kHist; ++q) {
      const uint4 u = reinterpret_cast<const uint4*>(r.state)[q];
      r.old[4 * q] = u.x, r.old[4 * q + 1] = u.y, r.old[4 * q + 2] = u.z, r.old[4 * q + 3] = u.w;
    }
  } else {
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      r.old[q] = static_cast<std::uint32_t>(r.state[2 * q]) |
                 (static_cast<std::uint32_t>(r.state[2 * q + 1]) << 16);
    }
  }
  r.in = __ldg(reinterpret_cast<const uint4*>(p.proj + c) + row * (p.proj_stride / 8));
}

template <int W>
__device__ __forceinline__ void finish_one_token_row(const ConvParams& p, bool vector_state,
                                                     std::int64_t c, std::int64_t row,
                                                     const OneTokenRow<W>& r,
                                                     const float (&taps)[kConvVec * W]) {
  constexpr int kHist = W - 1;
  constexpr int kWords = kConvVec * kHist / 2;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  auto value = [&](int m) {  // value m of the old slice, as a float
    return __uint_as_float(m % 2 == 0 ? r.old[m / 2] << 16 : r.old[m / 2] & 0xffff0000u);
  };
  const std::uint32_t x_words[4] = {r.in.x, r.in.y, r.in.z, r.in.w};
  float y[kConvVec];
#pragma unroll
  for (int i = 0; i < kConvVec; ++i) {
    const float x =
        __uint_as_float(i % 2 == 0 ? x_words[i / 2] << 16 : x_words[i / 2] & 0xffff0000u);
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < kHist; ++j) a += taps[i * W + j] * value(i * kHist + j);
    a += taps[i * W + W - 1] * x;
    y[i] = silu(a);
  }
  reinterpret_cast<uint4*>(p.out[branch] + cc)[row * (p.channels / kConvVec)] = pack8(y);
  if (r.state == nullptr || p.conv_records != nullptr) return;
  // The new slice: each channel's history shifted by one, the token's input last (bf16 bits moved).
  auto next_bits = [&](int m) -> std::uint32_t {
    const int i = m / kHist, k = m % kHist;
    if (k + 1 < kHist) {
      const int from = m + 1;
      return from % 2 == 0 ? r.old[from / 2] & 0xffffu : r.old[from / 2] >> 16;
    }
    return i % 2 == 0 ? x_words[i / 2] & 0xffffu : x_words[i / 2] >> 16;
  };
  std::uint32_t next[kWords];
#pragma unroll
  for (int q = 0; q < kWords; ++q) next[q] = next_bits(2 * q) | (next_bits(2 * q + 1) << 16);
  if (vector_state) {
#pragma unroll
    for (int q = 0; q < kHist; ++q) {
      reinterpret_cast<uint4*>(r.state)[q] =
          make_uint4(next[4 * q], next[4 * q + 1], next[4 * q + 2], next[4 * q + 3]);
    }
  } else {
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      r.state[2 * q] = static_cast<std::uint16_t>(next[q] & 0xffffu);
      r.state[2 * q + 1] = static_cast<std::uint16_t>(next[q] >> 16);
    }
  }
}

// `count` (1..R) consecutive rows from `row0` (R > 1: a plain one-token step, no records or
// folds): every row's loads first, the taps once for all of them, then each row's arithmetic.
template <int W, int R>
__device__ __forceinline__ void conv8_one_token(const ConvParams& p, bool vector_state,
                                                std::int64_t c, std::int64_t row0,
                                                const std::int64_t (&slots)[R], int count,
                                                int lanes, unsigned mask) {
  OneTokenRow<W> r[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i < count) load_one_token_row<W>(p, vector_state, c, row0 + i, slots[i], r[i]);
  }
  float taps[kConvVec * W];
  load_taps_coalesced<W>(p, c, lanes, mask, taps);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i < count) finish_one_token_row<W>(p, vector_state, c, row0 + i, r[i], taps);
  }
}

// kOneToken: a step of one token a row that is not a verify step (conv8_one_token). kRows: the
// rows a block column takes, more than one only for a plain one-token step (no records or folds).
template <int W, bool kVerify, bool kOneToken, int kRows = 1>
__global__ void __launch_bounds__(kConvThreads)
    conv_decode_kernel(ConvParams p, bool vector_state) {
  static_assert(kRows == 1 || (kOneToken && !kVerify), "several rows: a plain one-token step");
  const std::int64_t sequence_blocks = (p.sequences + kRows - 1) / kRows;
  if (blockIdx.x >= sequence_blocks) {  // the factors' blocks: a warp a tile
    const std::int64_t tile =
        ((blockIdx.x - sequence_blocks) * gridDim.y + blockIdx.y) * (blockDim.x / 32) +
        threadIdx.x / 32;
    if (tile < factor_warp_tiles(p)) factor_tile(p, tile);
    return;
  }
  // The block column's rows [row0, row0 + count) and their tokens [bos, eos): the identity slots
  // and beta it writes.
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.x) * kRows;
  const int count =
      kRows == 1 ? 1 : static_cast<int>(p.sequences - row0 < kRows ? p.sequences - row0 : kRows);
  const std::int64_t tokens = kRows == 1 ? p.decode_tokens : 1;  // several rows: one token each
  const std::int64_t bos = row0 * tokens, eos = bos + count * tokens;
  if (blockIdx.y == 0) {
    if (threadIdx.x == 0 && p.identity_slots != nullptr) {
      for (int i = 0; i < count; ++i)
        p.identity_slots[row0 + i] = static_cast<std::int32_t>(row0 + i);
    }
    copy_beta(p, bos, eos);
  }
  const std::int64_t c =
      kConvVec * (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  // The warp's lanes with channels: the lowest (the one-token step's taps are the warp's to load).
  const unsigned mask = __ballot_sync(0xffffffffu, c < 3 * p.channels);
  if (c >= 3 * p.channels) return;
  if constexpr (kRows > 1) {
    std::int64_t slots[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      slots[i] = i < count ? state_row<false>(p, row0 + i, c == 0) : -1;
    conv8_one_token<W, kRows>(p, vector_state, c, row0, slots, count, __popc(mask), mask);
  } else {
    const std::int64_t n = row0;
    std::int64_t slot = state_row<kVerify>(p, n, c == 0);
    if (p.fold_rows != nullptr && slot >= 0 && p.fold_rows[n] >= 0) {
      const std::int64_t row = p.fold_rows[n], accepted = p.fold_counts[n];
      if (row >= p.fold_sequences || accepted < 1 || accepted > p.fold_tokens) {
        if (c == 0 && p.status != nullptr) atomicOr(p.status, kDeviceStatusAccepted);
        slot = -1;  // padding, as the core takes it
      } else {
        fold_conv_state<W>(p, vector_state, c, row, accepted, slot);
      }
    }
    if constexpr (kOneToken) {
      const std::int64_t one[1] = {slot};
      conv8_one_token<W, 1>(p, vector_state, c, bos, one, 1, __popc(mask), mask);
    } else {
      conv8<W, kVerify>(p, vector_state, c, bos, eos, bos, eos, true, slot, ProjRows(p, c));
    }
    if (p.conv_records != nullptr && slot >= 0) {
      // A records step: the row's conv inputs, which the commit shifts into the conv state (the
      // projection's own bf16 values, so the committed state is exact).
      const std::int64_t in_stride = p.proj_stride / kConvVec,
                         rec_stride = 3 * p.channels / kConvVec;
      const uint4* column = reinterpret_cast<const uint4*>(p.proj + c);
      uint4* record = reinterpret_cast<uint4*>(p.conv_records + c);
      for (std::int64_t t = bos; t < eos; ++t)
        record[t * rec_stride] = __ldg(column + t * in_stride);
    }
  }
}

// The rows a thread takes in a plain one-token step: 2, or 1 under KDA_LAYER_CONV_ROWS=1 (a
// benchmark knob, read once; not part of the contract).
int conv_one_token_rows() {
  static const int rows = [] {
    const char* env = std::getenv("KDA_LAYER_CONV_ROWS");
    return env != nullptr && std::string(env) == "1" ? 1 : 2;
  }();
  return rows;
}

template <int W>
void launch_width(const ConvParams& p, bool vector_state, bool verify, int rows, dim3 grid,
                  unsigned threads, cudaStream_t stream) {
  if (verify) {
    conv_decode_kernel<W, true, false><<<grid, threads, 0, stream>>>(p, vector_state);
  } else if (p.decode_tokens == 1 && rows == 2) {
    conv_decode_kernel<W, false, true, 2><<<grid, threads, 0, stream>>>(p, vector_state);
  } else if (p.decode_tokens == 1) {
    conv_decode_kernel<W, false, true><<<grid, threads, 0, stream>>>(p, vector_state);
  } else {
    conv_decode_kernel<W, false, false><<<grid, threads, 0, stream>>>(p, vector_state);
  }
}

}  // namespace

cudaError_t launch_conv_decode(const ConvParams& p, cudaStream_t stream) {
  if (p.sequences == 0) return cudaSuccess;
  bool vector_state = false;
  if (const cudaError_t err = check_conv_layout(p, &vector_state); err != cudaSuccess) return err;
  const ConvShape shape = conv_shape(p.channels);
  if (p.factors.w_fb != nullptr && !conv_decode_factors_fit(p)) return cudaErrorInvalidValue;
  // The factors' blocks follow the sequences' along x, shape.tiles of them a column.
  const std::int64_t factor_blocks =
      (factor_warp_tiles(p) + shape.threads / 32 - 1) / (shape.threads / 32);
  const std::int64_t factor_columns = (factor_blocks + shape.tiles - 1) / shape.tiles;
  const bool verify = p.num_accepted != nullptr;
  const int rows =
      !verify && p.decode_tokens == 1 && p.conv_records == nullptr && p.fold_rows == nullptr
          ? conv_one_token_rows()
          : 1;
  const std::int64_t sequence_blocks = (p.sequences + rows - 1) / rows;
  if (sequence_blocks + factor_columns > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(sequence_blocks + factor_columns), shape.tiles);
  if (p.conv_records != nullptr && !aligned16(p.conv_records)) return cudaErrorInvalidValue;
  if (p.fold_rows != nullptr && (p.fold_counts == nullptr || !aligned16(p.fold_conv_records))) {
    return cudaErrorInvalidValue;
  }
  switch (p.width) {
    case 2:
      launch_width<2>(p, vector_state, verify, rows, grid, shape.threads, stream);
      break;
    case 3:
      launch_width<3>(p, vector_state, verify, rows, grid, shape.threads, stream);
      break;
    case 4:
      launch_width<4>(p, vector_state, verify, rows, grid, shape.threads, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

bool conv_decode_factors_fit(const ConvParams& p) {
  const ConvParams::Factors& f = p.factors;
  const bool gate = f.gate != nullptr;
  return f.w_fb != nullptr && f.g != nullptr && (!gate || f.w_gb != nullptr) &&
         p.channels % kFactorTile == 0 && p.proj_stride % 8 == 0 && aligned16(p.proj) &&
         f.f_a_col >= 0 && f.f_a_col % 8 == 0 && f.f_a_col + kFactorRank <= p.proj_stride &&
         (!gate ||
          (f.g_a_col >= 0 && f.g_a_col % 8 == 0 && f.g_a_col + kFactorRank <= p.proj_stride)) &&
         aligned16(f.w_fb) && (!gate || aligned16(f.w_gb)) &&
         reinterpret_cast<std::uintptr_t>(f.g) % 4 == 0 &&
         (!gate || reinterpret_cast<std::uintptr_t>(f.gate) % 8 == 0);
}

}  // namespace kda::layer::cuda
