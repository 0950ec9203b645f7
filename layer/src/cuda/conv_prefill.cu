// layer/src/cuda/conv_prefill.cu — the short convolutions (+ SiLU) of q, k and v over a varlen
// prefill batch, from and to each sequence's conv state, fused with the copy of beta into the
// core's layout. One thread: eight channels (16-byte loads and stores) x one chunk of up to
// kConvChunk tokens of one sequence; one block: one chunk x a tile of channels, whose input rows
// (the chunk's and the W-1 before it) one thread copies into shared memory with the copy engine
// before anyone computes. With checkpoint requests, the same launch writes their conv states
// (checkpoint_block, first_chunk_checkpoints).
#include "cuda/conv_silu.cuh"
#include "cuda/ptx.cuh"            // the copy engine and its mbarrier (kda/src/cuda)
#include "cuda/shared_memory.cuh"  // allow_shared_memory

namespace kda::layer::cuda {

namespace {

// A sequence n owns chunk slots [n + cu[n] / kConvChunk, ... + ceil(len_n / kConvChunk)): disjoint,
// all below ceil(tokens / kConvChunk) + sequences (the operator hands out its chunks the same way).
__device__ __forceinline__ std::int64_t clamped_cu(const ConvParams& p, std::int64_t n) {
  const std::int64_t value =
      p.cu_seqlens != nullptr ? p.cu_seqlens[n] : static_cast<std::int64_t>(p.cu_seqlens_i32[n]);
  return value < 0 ? 0 : (value > p.tokens ? p.tokens : value);
}
__device__ __forceinline__ std::int64_t first_slot(const ConvParams& p, std::int64_t n) {
  return n + clamped_cu(p, n) / kConvChunk;
}
// The grid's rows of chunk blocks (the slots above); checkpoint blocks follow them.
__host__ __device__ __forceinline__ std::int64_t chunk_rows(const ConvParams& p) {
  return (p.tokens + kConvChunk - 1) / kConvChunk + p.sequences;
}

// Whether sequence n is padding: a negative slot, or one outside the pool (state_row reports it).
__device__ __forceinline__ bool padding_sequence(const ConvParams& p, std::int64_t n) {
  if (p.slots == nullptr) return n >= p.num_slots;
  const std::int32_t slot = p.slots[n];
  return slot < 0 || slot >= p.num_slots || slot == p.padding_slot;
}

// Request `request` (sequence n, rows [bos, eos)): its offset and row where the core takes it too
// (kda.hpp: not a bad offset, a row in the pool, not a padding sequence's); false for the rest,
// which the core reports.
__device__ __forceinline__ bool checkpoint_request(const ConvParams& p, std::int64_t request,
                                                   std::int64_t n, std::int64_t bos,
                                                   std::int64_t eos, std::int64_t* offset,
                                                   std::int32_t* row) {
  *offset = p.checkpoint_offsets[request];
  *row = p.checkpoint_slots[request];
  const std::int64_t length = eos - bos;
  return *offset >= 0 && *offset <= length &&
         (*offset % kCheckpointAlignment == 0 || *offset == length) && *row >= 0 &&
         *row != p.padding_slot && *row < p.num_slots && !padding_sequence(p, n);
}

// Where a checkpoint's conv states are written: a request whose offset is below W-1 in a sequence
// with tokens reads the sequence's initial conv state, which that sequence's first chunk replaces,
// so the first chunk's threads write it before their conv, each its own channels
// (first_chunk_checkpoints); every other request has a block of its own after the chunks'
// (checkpoint_block), which reads only the projection (or, for a sequence without tokens, whose
// state nothing replaces, the initial state).
__device__ __forceinline__ bool written_by_first_chunk(std::int64_t offset, std::int64_t bos,
                                                       std::int64_t eos, int history) {
  return offset < history && eos > bos;
}

// Blocks past the chunks' rows of the grid: blockIdx.x - chunk rows is a request (n, k), a thread
// eight channels of q | k | v.
template <int W>
__device__ void checkpoint_block(const ConvParams& p, bool vector_state, std::int64_t request) {
  constexpr int kHist = W - 1;
  const std::int64_t c =
      kConvVec * (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  if (c >= 3 * p.channels) return;
  const std::int64_t n = request / p.checkpoints;
  const std::int64_t bos = clamped_cu(p, n);
  std::int64_t eos = clamped_cu(p, n + 1);
  eos = eos < bos ? bos : eos;
  std::int64_t offset = 0;
  std::int32_t row = 0;
  if (!checkpoint_request(p, request, n, bos, eos, &offset, &row)) return;
  if (written_by_first_chunk(offset, bos, eos, kHist)) return;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  std::uint16_t initial[kConvVec * kHist] = {};
  if (offset < kHist) {  // no tokens: the initial state is the checkpoint
    const std::int64_t own = state_row(p, n, false);  // not padding: checked with the request
    load_state<kHist>(p.pools[branch] + (own * p.channels + cc) * kHist, vector_state, initial);
  }
  std::uint16_t bits[kConvVec * kHist];
  conv_state_at<kHist>(offset, bos, ProjRows(p, c), initial, bits);
  store_state<kHist>(p.pools[branch] + (row * p.channels + cc) * kHist, vector_state, bits);
}

// The requests of sequence n at offsets below W-1 (written_by_first_chunk), by a first-chunk
// thread before its conv replaces the initial state (row `slot`, this thread's channels c .. c +
// 7). Every thread walks the sequence's K requests (broadcast loads): their offsets eight at a
// time, all eight loads in flight, and only the few below W-1 further. One request's checks after
// another, each waiting on its loads, held the first chunk's blocks behind the rest of the conv.
template <int W, class RunRow>
__device__ void first_chunk_checkpoints(const ConvParams& p, bool vector_state, std::int64_t c,
                                        std::int64_t n, std::int64_t bos, std::int64_t eos,
                                        std::int64_t slot, const RunRow& run_row) {
  constexpr int kHist = W - 1;
  constexpr int kBatch = 8;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  std::uint16_t initial[kConvVec * kHist];
  bool loaded = false;
  const std::int64_t first = n * p.checkpoints;
#pragma unroll 1
  for (std::int64_t k0 = 0; k0 < p.checkpoints; k0 += kBatch) {
    unsigned short_offsets = 0;  // bit i: request k0 + i asks for fewer than W-1 tokens
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const bool in_row = k0 + i < p.checkpoints;
      const std::int64_t offset = in_row ? p.checkpoint_offsets[first + k0 + i] : -1;
      if (offset >= 0 && offset < kHist) short_offsets |= 1u << i;
    }
#pragma unroll 1
    for (; short_offsets != 0; short_offsets &= short_offsets - 1) {
      const std::int64_t request = first + k0 + __ffs(short_offsets) - 1;
      std::int64_t offset = 0;
      std::int32_t row = 0;
      if (!checkpoint_request(p, request, n, bos, eos, &offset, &row) ||
          !written_by_first_chunk(offset, bos, eos, kHist)) {
        continue;
      }
      if (!loaded) {
        load_state<kHist>(p.pools[branch] + (slot * p.channels + cc) * kHist, vector_state,
                          initial);
        loaded = true;
      }
      std::uint16_t bits[kConvVec * kHist];
      conv_state_at<kHist>(offset, bos, run_row, initial, bits);
      store_state<kHist>(p.pools[branch] + (row * p.channels + cc) * kHist, vector_state, bits);
    }
  }
}

// A block's shared memory: the rows of its chunk and the W-1 before it, blockDim.x * 16 bytes each
// (the block's channels of q | k | v).
inline int conv_prefill_smem(int width, unsigned threads) {
  return (kConvChunk + width - 1) * static_cast<int>(threads) * 16;
}

// Each block's rows land in shared memory at once, through the copy engine (up to 35 rows of 2 KB
// at W = 4, 70 KB: three blocks an SM). Loaded by each thread instead, 8 rows at a time into
// registers (16 warps an SM, 64 KB in flight), the conv ran at about half the copy bandwidth: on
// the H200 at T = 8192, H = 32 193 us against 131 staged (floor 95), TP8 35 against 26, K3's TP8
// shard 88 against 58 (docs/PERFORMANCE.md). (kConvThreads, 3): at most 170 registers, no spills.
// CKPT compiles the checkpoint requests (ConvParams::checkpoints) into a kernel of their own, so
// that the conv without them keeps its code (the same PTX as before they were added; in one kernel
// with them it took 160-168 registers at W = 4 against 126).
template <int W, bool CKPT>
__global__ void __launch_bounds__(kConvThreads, 3)
    conv_prefill_kernel(ConvParams p, bool vector_state) {
  extern __shared__ __align__(128) unsigned char staged[];
  __shared__ std::uint64_t landed;
  if constexpr (CKPT) {
    const std::int64_t chunks = chunk_rows(p);
    if (static_cast<std::int64_t>(blockIdx.x) >= chunks) {
      checkpoint_block<W>(p, vector_state, blockIdx.x - chunks);
      return;
    }
  }
  const std::int64_t s = blockIdx.x;
  // The sequence owning slot s: the last n with first_slot(n) <= s (first_slot(0) == 0 <= s).
  // Broken cu_seqlens contents (the core reports them) only change which in-range rows are used.
  std::int64_t lo = 0, hi = p.sequences - 1;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (first_slot(p, mid) <= s) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const std::int64_t n = lo;
  const std::int64_t bos = clamped_cu(p, n);
  std::int64_t eos = clamped_cu(p, n + 1);
  eos = eos < bos ? bos : eos;
  const std::int64_t chunk = s - first_slot(p, n);
  const std::int64_t t_begin = bos + chunk * kConvChunk;
  if (chunk < 0 || t_begin >= eos) return;  // an unused slot (block-uniform)
  const std::int64_t t_end = t_begin + kConvChunk < eos ? t_begin + kConvChunk : eos;

  if (blockIdx.y == 0) copy_beta(p, t_begin, t_end);
  constexpr int kHist = W - 1;
  const bool first_chunk = chunk == 0;
  // Rows [first_row, t_end) of the block's channels: a later chunk's history is its W-1 rows
  // before t_begin (all in the sequence: t_begin >= bos + kConvChunk there).
  const std::int64_t first_row = first_chunk ? t_begin : t_begin - kHist;
  const std::int64_t tile_group = static_cast<std::int64_t>(blockIdx.y) * blockDim.x;
  const std::int64_t groups = 3 * p.channels / kConvVec - tile_group;  // the block's, at most
  const unsigned row_bytes =
      static_cast<unsigned>(16 * (groups < blockDim.x ? groups : blockDim.x));
  const std::int64_t pitch = 16 * static_cast<std::int64_t>(blockDim.x);
  if (threadIdx.x == 0) kda::detail::mbarrier_init(&landed, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    const auto rows = static_cast<unsigned>(t_end - first_row);
    kda::detail::mbarrier_expect_tx(&landed, rows * row_bytes);
    const std::uint16_t* from = p.proj + first_row * p.proj_stride + kConvVec * tile_group;
    for (unsigned r = 0; r < rows; ++r) {
      kda::detail::bulk_copy_to_shared(staged + r * pitch, from + r * p.proj_stride, row_bytes,
                                       &landed);
    }
  }
  kda::detail::mbarrier_wait(&landed, 0);
  const std::int64_t c = kConvVec * (tile_group + threadIdx.x);
  if (c >= 3 * p.channels) return;
  const std::int64_t slot = first_chunk ? state_row(p, n, c == 0) : -1;
  if (c < p.channels && padding_sequence(p, n)) {
    // A padding sequence's q is zero, so the core's output for it is exactly zero (q̂ = 0), and
    // with it the layer's: padding rows produce zeros, as in decode.
    for (std::int64_t t = t_begin; t < t_end; ++t) {
      *reinterpret_cast<uint4*>(p.out[0] + t * p.channels + c) = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  const auto run_row = [&](std::int64_t t) {
    return reinterpret_cast<const uint4*>(staged + (t - first_row) * pitch)[threadIdx.x];
  };
  if (CKPT && slot >= 0) first_chunk_checkpoints<W>(p, vector_state, c, n, bos, eos, slot, run_row);
  conv8<W>(p, vector_state, c, bos, eos, t_begin, t_end, first_chunk, slot, run_row);
}

}  // namespace

cudaError_t launch_conv_prefill(const ConvParams& p, cudaStream_t stream) {
  // Without tokens, only checkpoint requests (of empty sequences) have anything to write.
  if (p.sequences == 0 || (p.tokens == 0 && p.checkpoints == 0)) return cudaSuccess;
  bool vector_state = false;
  if (const cudaError_t err = check_conv_layout(p, &vector_state); err != cudaSuccess) return err;
  // The chunks' rows of blocks, then one row a checkpoint request (checkpoint_block).
  const std::int64_t rows = chunk_rows(p) + (p.checkpoints > 0 ? p.sequences * p.checkpoints : 0);
  if (rows > 2147483647) return cudaErrorInvalidValue;
  const ConvShape shape = conv_shape(p.channels);
  const dim3 grid(static_cast<unsigned>(rows), shape.tiles);
  const int smem = conv_prefill_smem(p.width, shape.threads);
  auto launch_as = [&](auto kernel_width, auto checkpoints) -> cudaError_t {
    constexpr int kW = decltype(kernel_width)::value;
    constexpr bool kCkpt = decltype(checkpoints)::value;
    if (const cudaError_t err =
            kda::detail::allow_shared_memory<conv_prefill_kernel<kW, kCkpt>>(smem);
        err != cudaSuccess) {
      return err;
    }
    conv_prefill_kernel<kW, kCkpt><<<grid, shape.threads, smem, stream>>>(p, vector_state);
    return cudaGetLastError();
  };
  auto launch = [&](auto kernel_width) -> cudaError_t {
    return p.checkpoints > 0 ? launch_as(kernel_width, std::true_type{})
                             : launch_as(kernel_width, std::false_type{});
  };
  switch (p.width) {
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 3:
      return launch(std::integral_constant<int, 3>{});
    case 4:
      return launch(std::integral_constant<int, 4>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kda::layer::cuda
