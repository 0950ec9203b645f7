// layer/src/cuda/one_launch_step.cu — a whole decode step of one token of each of a few sequences
// (rows) in one launch: the input projection, every (row, head)'s fused step (conv + SiLU, the
// low-rank second factors, beta, the KDA step, the gated RMSNorm) and o_proj.
//
// At one row the layer's three launches (projection, fused step, o_proj) each pay their ramp and
// drain in turn, and the step's latency chain runs while no weights stream
// (docs/design/layer.md). Here one block a multiprocessor, all resident at once, hand the work on
// through the layer's exchange words in global memory (below):
//   1. Every block computes its share of the input projection's rows (a warp a row, 16-byte weight
//      loads past L1, the hidden row from shared memory), each row's value one exchange word.
//      Its first round of weight loads is issued before the wait for the kernel before, and the
//      hidden rows come in by the copy engine after it.
//      With several rows, a block takes 16 weight rows at a time on the tensor cores instead
//      (mma.m16n8k16 with the weights as A, loaded as the layer's fragment GEMM loads them, and the
//      hidden rows as B's columns; K split over the block's warps, their sums added in warp
//      order), so that each weight is read once for every row.
//      Before it, the blocks that own a (row, head) (block b < rows x heads: row b / heads, head
//      b % heads) start copying into shared memory
//      everything of the head that does not depend on the step: the recurrent state
//      (cp.async.bulk), its W_fb (and W_gb) rows, conv states, conv taps, dt_bias, the norm's
//      weight and the gate's bias (cp.async), so that no load after the projection leaves the
//      multiprocessor but the projection's own outputs (from L2). After it, the other blocks start
//      loading their share of W_o's rows, into their threads' registers where it fits
//      (SmemPlan::out_in_registers) or into shared memory (cp.async.bulk; at one row held back
//      kWoHoldNs first), so that W_o streams while the heads step.
//   2. A (row, head) block takes the words of the rows its head reads (each thread its own), then
//      steps its head as the fused kernel does (fused_decode.cu: the same operations in the same
//      order, one block a head, 16 warps of 8 value rows), and writes the states and y's words.
//   3. The other blocks take y's words (every row's), then their W_o rows · y -> out: from
//      registers where they fit (one row: SmemPlan::out_lanes threads a weight row,
//      o_proj_row_held; several: on the tensor cores, o_proj_rows_mma), else out_lanes threads a
//      weight row from shared memory.
// An exchange word carries its value in its low half and the launch's tag in its high half (the
// count of blocks left in `sync` over the grid, plus one), written and read as one relaxed 64-bit
// access: a reader waits until the words it needs carry this launch's tag. No fence and no counter
// stand between a value and its reader (a release reduction after each block's rows and an acquire
// poll of the count cost about 1 us more a step: kda-step-probe, docs/design/layer.md). Every word
// is written in every launch, so a word left from an earlier launch carries an earlier tag.
// The launch is a programmatic dependent of the kernel before it, and lets the kernel after it
// launch as soon as all its own blocks have started: its blocks take multiprocessors as the
// kernel before leaves them, issue their first round of input-projection weight loads and their
// head's weight copies (nothing writes the weight image inside a forward but `sync` and the
// exchange words), and wait (griddepcontrol.wait) before they
// read the hidden row, the slots, the states or `sync`. That hides most of the launch between two
// steps. Each block adds one to the count of blocks left as it leaves, by a reduction with no fence
// (the next launch reads the count after this one completed; an epoch advanced by the last block
// out, behind a fence and an atomic's round trip, cost each launch 0.8-1 us at its end): the layer
// keeps the count and the exchange words in its weight image, zeroed when it is written, so a
// captured graph replays the launch as it is. A wait that outlasts kSpinLimitNs (the device did not
// run every block at once) gives up and reports kDeviceStatusStepTimeout rather than hang.
//
// The projections' sums run in another order than the small-row kernel's (one row: a warp a whole
// row of the input projection, four partial sums a thread, then shuffles, in o_proj; several rows:
// mma.m16n8k16 tiles, the warps' sums added in order), so out may differ from the three-launch
// step's in its last bits; the step itself is the fused kernel's arithmetic.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdlib>

#include "cuda/common.cuh"  // the operator's gate activations (kda/src/cuda)
#include "cuda/conv_silu.cuh"
#include "cuda/cuda_check.hpp"  // current_device_sm_count (kda/src/cuda)
#include "cuda/factor_rows.cuh"
#include "cuda/head_step.cuh"
#include "cuda/kernels.hpp"
#include "cuda/ptx.cuh"
#include "cuda/shared_memory.cuh"
#include "cuda/weight_rows.cuh"

namespace kda::layer::cuda {

namespace {

constexpr int D = 128;
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = D / kWarps;  // value rows of Sᵀ a warp
constexpr int kLoadsPerLane = 16;         // 16-byte weight loads a lane in flight (projection)
constexpr int kRoundSteps = kLoadsPerLane / 4;  // 64-column steps a round, several rows (4 loads)
constexpr int kReduceBytes = kWarps * 4 * 32 * 4;  // the warps' tile sums, several rows
static_assert(kOneLaunchMaxRows <= 8, "the rows are the columns of an m16n8 tile");
constexpr unsigned kCopyBytes = 16 * 1024;  // one cp.async.bulk of W_o's rows
// One row: how long an o_proj block holds back its W_o copies into shared memory after its
// projection rows are done, so that the heads' polls for their last projected values cross a memory
// system not yet full of W_o (19 MB at H = 32). One H100, graph replays per layer, held back 0 /
// 0.7 / 1.5 / 3 us: H = 32 35.7-36.0 / 35.7-36.0 / 35.2-35.4 / 36.0-36.2 us, K3's shard 46.8-47.4 /
// 46.8-47.0 / 46.2-46.6 / 47.0-47.1 (1 to 2 us within 0.2 us of each other in another call); the
// heads then took their values 2.7 us after the last projection rows against 4.5
// (docs/design/layer.md). KDA_LAYER_WO_HOLD_NS (a benchmark knob, read once; not part of the
// contract) sets it.
constexpr unsigned kWoHoldNs = 1500;
constexpr std::uint64_t kSpinLimitNs = 2'000'000'000ull;
// sync words 0-1, one 64-bit count (8-byte aligned): the blocks that have left this layer's
// launches (every block of every launch adds one as it leaves). A launch's grid is the device's
// multiprocessor count, the same every launch, so once a launch's blocks have all left the count is
// a multiple of it; its tag is the count over the grid plus one, read after griddepcontrol.wait
// (the launch before complete). A block adds its one after a barrier that follows all its threads'
// reads, so whenever any thread reads the count at most grid - 1 of this launch's blocks (not its
// own) can have added theirs: every read of a launch gives the same quotient, however late a block
// starts or whatever it waits on.
constexpr int kLeftWord = 0;

using kda::detail::gate_params_bad;
using kda::detail::sigmoid_f;

using kda::detail::bulk_commit;
using kda::detail::bulk_copy_to_global;
using kda::detail::bulk_copy_to_shared;
using kda::detail::bulk_wait_all;
using kda::detail::cp_async_16;
using kda::detail::cp_async_commit;
using kda::detail::cp_async_wait;
using kda::detail::fence_proxy_async;
using kda::detail::global_timer_ns;
using kda::detail::griddep_launch_dependents;
using kda::detail::griddep_wait;
using kda::detail::load_relaxed_gpu_u64;
using kda::detail::mbarrier_arrive;
using kda::detail::mbarrier_expect_tx;
using kda::detail::mbarrier_init;
using kda::detail::mbarrier_wait;
using kda::detail::store_relaxed_gpu_u64;

constexpr std::int64_t align128(std::int64_t bytes) { return (bytes + 127) / 128 * 128; }

// A head block's region: Sᵀ [D][D] as the pool holds it, the factor rows (W_fb's, then W_gb's,
// swizzled), the conv states [3][D][W-1] (bf16), the conv taps [3][D][W] (f32), dt_bias, the norm's
// weight (f32) and the gate's bias (bf16), all copied in before the projection.
struct HeadRegion {
  std::int64_t state = 0, factors = 0, hist = 0, taps = 0, dt_bias = 0, o_norm = 0, g_bias = 0,
               bytes = 0;
};
__host__ __device__ constexpr HeadRegion head_region(bool f32_state, bool low_rank, int width) {
  HeadRegion r;
  r.factors = static_cast<std::int64_t>(D) * D * (f32_state ? 4 : 2);
  r.hist = r.factors + static_cast<std::int64_t>(low_rank ? 2 : 1) * D * D * 2;
  r.taps = r.hist + 3 * D * (width - 1) * 2;
  r.dt_bias = r.taps + 3 * D * width * 4;
  r.o_norm = r.dt_bias + D * 4;
  r.g_bias = r.o_norm + D * 4;
  r.bytes = r.g_bias + D * 2;
  return r;
}

// The dynamic shared memory of a launch: the hidden rows, y's rows, with several rows the warps'
// tile sums, then either a (row, head)'s region (blocks < rows x heads) or the block's W_o rows
// (the others; where those are in registers instead, the region holds nothing, or with several
// rows o_proj_rows_mma's warp sums). With several rows a hidden row takes 16 bytes more than its
// values (x_chunks 16-byte chunks), so that the eight rows' chunks a warp reads at once fall on
// distinct banks. o_proj gives each of a block's weight rows out_lanes threads (a power of two, the
// most with which all its rows run in one round; 1 when even that takes several).
struct SmemPlan {
  std::int64_t x_chunks = 0, x_bytes = 0, y_bytes = 0, reduce_bytes = 0, head_bytes = 0,
               out_rows = 0, out_bytes = 0, total = 0;
  int out_lanes = 1;
  // Where a block's W_o rows fit in its threads' registers (the TP8 shard's 18-24 rows of 512
  // columns), they go there instead of shared memory, and o_proj runs from them
  // (o_proj_row_held, o_proj_rows_mma).
  bool out_in_registers = false;
  unsigned wo_hold_ns = 0;  // one row, W_o into shared memory: kWoHoldNs
};
SmemPlan smem_plan(const OneLaunchStepParams& p, int blocks) {
  SmemPlan s;
  const std::int64_t Cl = static_cast<std::int64_t>(p.heads) * D;
  const bool multi = p.rows > 1;
  s.x_chunks = p.hidden_size / 8 + (multi ? 1 : 0);
  s.x_bytes = align128(p.rows * s.x_chunks * 16);
  s.y_bytes = align128(p.rows * Cl * 2);
  s.reduce_bytes = multi ? kReduceBytes : 0;
  s.head_bytes = head_region(p.f32_state, p.w_gb != nullptr, p.width).bytes;
  const int out_blocks = blocks - p.rows * p.heads;
  s.out_rows = out_blocks > 0 ? (p.hidden_size + out_blocks - 1) / out_blocks : 0;
  s.out_bytes = s.out_rows * Cl * 2;
  s.total = s.x_bytes + s.y_bytes + s.reduce_bytes +
            (s.head_bytes > s.out_bytes ? s.head_bytes : s.out_bytes);
  while (s.out_lanes < 32 && s.out_rows * s.out_lanes * 2 <= kThreads) s.out_lanes *= 2;
  const std::int64_t out_tiles = (s.out_rows + 15) / 16;
  // One row: every weight row's out_lanes threads in one pass, at most four 16-byte chunks a
  // thread (o_proj_row_held); several: at most two tiles of 16 rows, a 64-column step of one tile
  // a warp (o_proj_rows_mma).
  s.out_in_registers =
      s.out_rows > 0 && (multi ? out_tiles <= 2 && Cl / 64 * out_tiles <= kWarps
                               : s.out_rows * s.out_lanes <= kThreads && Cl / 8 <= 4 * s.out_lanes);
  static const unsigned hold = [] {
    const char* env = std::getenv("KDA_LAYER_WO_HOLD_NS");
    return env != nullptr ? static_cast<unsigned>(std::strtoul(env, nullptr, 10)) : kWoHoldNs;
  }();
  s.wo_hold_ns = multi || s.out_in_registers ? 0 : hold;
  return s;
}

// An exchange word: value in the low half, tag in the high half.
__device__ __forceinline__ void put_word(std::uint64_t* word, std::uint32_t tag,
                                         std::uint32_t value) {
  store_relaxed_gpu_u64(word, static_cast<std::uint64_t>(tag) << 32 | value);
}

// The values of the exchange words at[0..N) (null: none) once each carries `tag`: at[0] alone is
// polled until it does (one load a thread a round while the writers are still at work), then the
// others are loaded together and polled until all do. `late` is set if that took longer than
// kSpinLimitNs (the values are then undefined).
template <int N>
__device__ void take_words(const std::uint64_t* const (&at)[N], std::uint32_t tag,
                           std::uint32_t (&value)[N], bool& late) {
  const std::uint64_t absent = static_cast<std::uint64_t>(tag) << 32;
  auto tagged = [tag](std::uint64_t w) { return static_cast<std::uint32_t>(w >> 32) == tag; };
  std::uint64_t start = 0;
  auto overdue = [&]() {
    if (start == 0) start = global_timer_ns();
    return global_timer_ns() - start > kSpinLimitNs;
  };
  std::uint64_t w[N];
  w[0] = at[0] != nullptr ? load_relaxed_gpu_u64(at[0]) : absent;
  while (!tagged(w[0]) && !late) {
    late = overdue();
    w[0] = load_relaxed_gpu_u64(at[0]);
  }
#pragma unroll
  for (int k = 1; k < N; ++k) w[k] = at[k] != nullptr ? load_relaxed_gpu_u64(at[k]) : absent;
  for (bool all = false; !all && !late;) {
    all = true;
#pragma unroll
    for (int k = 1; k < N; ++k) {
      if (!tagged(w[k])) {
        all = false;
        w[k] = load_relaxed_gpu_u64(at[k]);
      }
    }
    if (!all) late = overdue();
  }
#pragma unroll
  for (int k = 0; k < N; ++k) value[k] = static_cast<std::uint32_t>(w[k]);
}

// The input projection's weight row r: w_in's rows, then with the full-rank gate w_g's.
__device__ __forceinline__ const uint4* weight_row(const OneLaunchStepParams& p, std::int64_t r) {
  return reinterpret_cast<const uint4*>(r >= p.proj_rows ? p.w_g + (r - p.proj_rows) * p.hidden_size
                                                         : p.w_in + r * p.hidden_size);
}

// One row: one round of a lane's 16-byte loads of weight row w from chunk c0 (chunks c0, c0 + 32,
// ...; zeros past the row's E / 8 chunks).
__device__ __forceinline__ void load_row_round(const OneLaunchStepParams& p, const uint4* w,
                                               std::int64_t c0, uint4 (&wv)[kLoadsPerLane]) {
#pragma unroll
  for (int u = 0; u < kLoadsPerLane; ++u) {
    const std::int64_t c = c0 + 32 * u;
    wv[u] = c < p.hidden_size / 8 ? load_streaming(w + c) : make_uint4(0, 0, 0, 0);
  }
}

// Several rows: a block's share of the projection, by its tiles and K steps.
struct TileWork {
  std::int64_t chunks, rows_total, tiles;
  int s_begin, s_end;
};
template <bool kLowRank>
__device__ TileWork tile_work(const OneLaunchStepParams& p) {
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  TileWork t;
  t.chunks = p.hidden_size / 8;
  t.rows_total = p.proj_rows + (kLowRank ? 0 : static_cast<std::int64_t>(p.heads) * D);
  t.tiles = (t.rows_total + 15) / 16;
  const int steps = static_cast<int>((t.chunks + 7) / 8);
  const int per_warp = (steps + kWarps - 1) / kWarps;
  t.s_begin = min(steps, warp * per_warp);
  t.s_end = min(steps, t.s_begin + per_warp);
  return t;
}

// One round of a lane's weight loads of tile t from K step s0: w[step][half][chunk].
template <bool kLowRank>
__device__ __forceinline__ void load_tile_round(const OneLaunchStepParams& p, const TileWork& work,
                                                std::int64_t t, int s0,
                                                uint4 (&w)[kRoundSteps][2][2]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, g = lane / 4, q = lane % 4;
  const std::int64_t E = p.hidden_size;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t n = 16 * t + 8 * half + g;
    const bool ok = n < work.rows_total;
    const bool gate_row = !kLowRank && n >= p.proj_rows;
    const auto* row = reinterpret_cast<const uint4*>(!ok        ? p.w_in
                                                     : gate_row ? p.w_g + (n - p.proj_rows) * E
                                                                : p.w_in + n * E);
#pragma unroll
    for (int u = 0; u < kRoundSteps; ++u) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const std::int64_t chunk = static_cast<std::int64_t>(s0 + u) * 8 + 2 * q + c;
        const bool in_k = s0 + u < work.s_end && chunk < work.chunks;
        w[u][half][c] = in_k && ok ? load_streaming(row + chunk) : make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// The warps' m16n8 sums of a tile, as project_rows_mma and o_proj_rows_mma add them: warp w's
// acc[j] of lane l is stored at `partial` [(4 w + j) 32 + l] (stash_warp_sums, then a block
// barrier); entry i in [0, 128) of a tile, acc[j = i / 32] of lane l = i % 32, is weight row
// l / 4 (+ 8 for j >= 2) of the tile and input row 2 (l % 4) + j % 2, summed over warps first,
// first + stride, ... in that order.
__device__ __forceinline__ void stash_warp_sums(float* partial, const float (&acc)[4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
#pragma unroll
  for (int j = 0; j < 4; ++j) partial[(warp * 4 + j) * 32 + lane] = acc[j];
}
struct TileEntry {
  int weight_row;  // in the tile
  int input_row;
  float sum;
};
__device__ __forceinline__ TileEntry sum_warp_tiles(const float* partial, int i, int first,
                                                    int stride) {
  const int j = i / 32, l = i % 32;
  float sum = 0.0f;
  for (int w = first; w < kWarps; w += stride) sum += partial[(w * 4 + j) * 32 + l];
  return {l / 4 + (j >= 2 ? 8 : 0), 2 * (l % 4) + j % 2, sum};
}

// The input projection of several rows (p.rows, at most 8) on the tensor cores: the block takes
// tiles of 16 weight rows (those of w_in, then with the full-rank gate w_g's), block b tiles b,
// b + blocks, ...; its warps split K in 64-column steps, each lane loading 16 bytes of weight rows
// g and g + 8 (g = lane / 4) at chunk 8 s + 2 q + c (q = lane % 4, c = 0, 1) of step s, and the
// same chunk of hidden row g from shared memory: mma.m16n8k16 sums each chunk's words in the order
// of the layer's fragment GEMM (small_gemm.cu says why any order of K is the sum). The warps' sums
// meet in `partial` and are added in warp order; each (weight row, row) value becomes row's word.
// `w` holds the first round of the block's first tile, loaded before the wait for the kernel
// before (load_tile_round).
template <bool kLowRank>
__device__ void project_rows_mma(const OneLaunchStepParams& p, const SmemPlan& plan,
                                 const TileWork& work, uint4 (&w)[kRoundSteps][2][2],
                                 const uint4* x_s, float* partial, std::uint64_t* exchange,
                                 std::int64_t row_words, std::uint32_t tag) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, g = lane / 4, q = lane % 4;
  const int R = p.rows;
  const uint4* x_row = x_s + (g < R ? g : 0) * plan.x_chunks;
  for (std::int64_t t = blockIdx.x; t < work.tiles; t += gridDim.x) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s0 = work.s_begin; s0 < work.s_end; s0 += kRoundSteps) {
      if (t != blockIdx.x || s0 != work.s_begin) load_tile_round<kLowRank>(p, work, t, s0, w);
#pragma unroll
      for (int u = 0; u < kRoundSteps; ++u) {
        if (s0 + u >= work.s_end) break;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const std::int64_t chunk = static_cast<std::int64_t>(s0 + u) * 8 + 2 * q + c;
          // Past K (a last step of fewer than 64 columns) and past the rows, both operands are 0.
          const uint4 xv = chunk < work.chunks && g < R ? x_row[chunk] : make_uint4(0, 0, 0, 0);
          fragment_mma(acc, w[u][0][c], w[u][1][c], xv);
        }
      }
    }
    stash_warp_sums(partial, acc);
    __syncthreads();
    if (tid < 4 * 32) {
      const TileEntry entry = sum_warp_tiles(partial, tid, 0, 1);
      const std::int64_t n = 16 * t + entry.weight_row;
      const int r = entry.input_row;
      if (n < work.rows_total && r < R) {
        const bool gate_row = !kLowRank && n >= p.proj_rows;
        put_word(exchange + r * row_words + n, tag,
                 gate_row ? __float_as_uint(entry.sum) : float_to_bits(entry.sum));
      }
    }
    __syncthreads();
  }
}

// o_proj of several rows in an o_proj block: out[r, e] for its weight rows e in [e0, e1) (from
// shared memory, `rows`), kPass rows a pass (the last row's y again past R, not stored), the passes
// not unrolled. A body unrolled over every row took longer than its arithmetic (kda-step-probe at
// two rows: 2.3 us from W_o landed to the rows done, against 0.8 for one row's); and each row a
// pass costs its shared-memory reads of y whether stored or not (two rows by passes of four took
// 0.8 us longer than by one pass of two), hence passes of two for two rows, of four above.
template <int kPass>
__device__ void o_proj_rows(const OneLaunchStepParams& p, const SmemPlan& plan, const uint4* rows,
                            const uint4* y_s, int R, std::int64_t e0, std::int64_t e1) {
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t E = p.hidden_size, y_chunks = static_cast<std::int64_t>(p.heads) * D / 8;
  const int L = plan.out_lanes, sub = tid % L;
#pragma unroll 1
  for (int r0 = 0; r0 < R; r0 += kPass) {
    const uint4* y[kPass];
#pragma unroll
    for (int j = 0; j < kPass; ++j) y[j] = y_s + min(r0 + j, R - 1) * y_chunks;
    for (std::int64_t base = e0; base < e1; base += kThreads / L) {  // warp-uniform
      const std::int64_t e = base + tid / L;
      float acc[kPass] = {};
      if (e < e1) {
        const uint4* row = rows + (e - e0) * y_chunks;
        for (std::int64_t c = sub; c < y_chunks; c += L) {
          const uint4 w = row[c];
#pragma unroll
          for (int j = 0; j < kPass; ++j) acc[j] = dot8(w, y[j][c], acc[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kPass; ++j) {
        for (int offset = L / 2; offset > 0; offset /= 2) {
          acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], offset);
        }
        if (e < e1 && sub == 0 && r0 + j < R) p.out[(r0 + j) * E + e] = float_to_bits(acc[j]);
      }
    }
  }
}

// o_proj on the tensor cores from W_o in registers (SmemPlan::out_in_registers): the block's rows
// e0 .. e1 as one or two tiles of 16 weight rows (A), the rows' y as B's columns (mma.m16n8k16 as
// the projection of several rows runs it); warp w takes tile w % tiles and the 64 columns of step
// w / tiles, loaded by load_out_fragments as the fragment GEMM lays them (fragment_mma) when the
// block's projection rows are done. The warps' sums meet in `partial` (8 KB of shared memory,
// here the W_o region's start, unused) and are added in step order. From shared memory, one
// weight row a group of threads with fp32 FMAs (o_proj_rows), the TP8 shard's step of eight rows
// took 15.1 us (12.7 now; those FMAs from registers 14.8-14.9): every thread unpacked every bf16
// pair of W_o and of y, once a row.
// `partial` is the start of an o_proj block's region, at least a head region's bytes.
static_assert(head_region(false, false, 2).bytes >= kReduceBytes, "o_proj's warp sums fit");
__device__ __forceinline__ int out_tiles(std::int64_t e0, std::int64_t e1) {
  return e1 - e0 > 16 ? 2 : 1;
}
__device__ void load_out_fragments(const OneLaunchStepParams& p, std::int64_t e0, std::int64_t e1,
                                   uint4 (&wo)[4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane / 4, q = lane % 4, tiles = out_tiles(e0, e1);
  const std::int64_t Cl = static_cast<std::int64_t>(p.heads) * D;
  const int t = warp % tiles, step = warp / tiles;
  const bool in_k = step < Cl / 64;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t e = e0 + 16 * t + 8 * half + g;
    // Past the block's rows the lane loads nothing; its pointer stays at W_o's start.
    const auto* row = reinterpret_cast<const uint4*>(e < e1 ? p.w_o + e * Cl : p.w_o);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      wo[2 * c + half] =
          in_k && e < e1 ? load_streaming(row + 8 * step + 2 * q + c) : make_uint4(0, 0, 0, 0);
    }
  }
}
__device__ void o_proj_rows_mma(const OneLaunchStepParams& p, const uint4 (&wo)[4],
                                const uint4* y_s, float* partial, int R, std::int64_t e0,
                                std::int64_t e1) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5, g = lane / 4, q = lane % 4;
  const int tiles = out_tiles(e0, e1);
  const std::int64_t E = p.hidden_size, y_chunks = static_cast<std::int64_t>(p.heads) * D / 8;
  const int step = warp / tiles;  // of tile warp % tiles (load_out_fragments)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (step < y_chunks / 8) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint4 xv = g < R ? y_s[g * y_chunks + 8 * step + 2 * q + c] : make_uint4(0, 0, 0, 0);
      fragment_mma(acc, wo[2 * c], wo[2 * c + 1], xv);
    }
  }
  stash_warp_sums(partial, acc);
  __syncthreads();
  if (tid < tiles * 128) {
    const int tile = tid / 128;
    const TileEntry entry = sum_warp_tiles(partial, tid % 128, tile, tiles);
    const std::int64_t e = e0 + 16 * tile + entry.weight_row;
    const int r = entry.input_row;
    if (e < e1 && r < R) p.out[r * E + e] = float_to_bits(entry.sum);
  }
}

// A weight row's four partial sums a thread added pairwise, then over the row's L threads by
// shuffles (both one-row o_proj paths: o_proj_row_held and the pass from shared memory).
__device__ __forceinline__ float sum_row(const float (&a)[4], int L) {
  float acc = (a[0] + a[1]) + (a[2] + a[3]);
  for (int offset = L / 2; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  return acc;
}
// One row: thread tid holds chunks sub, sub + L, sub + 2 L, sub + 3 L of W_o row e0 + tid / L
// (L = out_lanes, sub = tid % L; zeros past the row or the block's rows), loaded when the block's
// projection rows are done; o_proj_row_held sums them with y (chunk sub + u L into sum u, the four
// sums added pairwise, then the L lanes' by shuffles: the one-row pass from shared memory's order
// where a row has 4 L chunks, as the TP8 shard's), without a barrier. At one row it took the TP8
// shard's step 0.2 us less than the tensor cores' tiles (10.2-10.3 against 10.4-10.5 us).
__device__ void load_out_row(const OneLaunchStepParams& p, const SmemPlan& plan, std::int64_t e0,
                             std::int64_t e1, uint4 (&wo)[4]) {
  const int tid = static_cast<int>(threadIdx.x), L = plan.out_lanes;
  const std::int64_t Cl = static_cast<std::int64_t>(p.heads) * D, e = e0 + tid / L;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const std::int64_t c = tid % L + u * L;
    wo[u] = e < e1 && c < Cl / 8
                ? load_streaming(reinterpret_cast<const uint4*>(p.w_o + e * Cl) + c)
                : make_uint4(0, 0, 0, 0);
  }
}
__device__ void o_proj_row_held(const OneLaunchStepParams& p, const SmemPlan& plan,
                                const uint4 (&wo)[4], const uint4* y_s, std::int64_t e0,
                                std::int64_t e1) {
  const int tid = static_cast<int>(threadIdx.x), L = plan.out_lanes, sub = tid % L;
  const std::int64_t y_chunks = static_cast<std::int64_t>(p.heads) * D / 8, e = e0 + tid / L;
  float a[4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
    a[u] = sub + u * L < y_chunks ? dot8(wo[u], y_s[sub + u * L], 0.0f) : 0.0f;
  const float acc = sum_row(a, L);
  if (e < e1 && sub == 0) p.out[e] = float_to_bits(acc);
}

template <int W, bool kF32State, bool kLowRank, bool kMulti>
__global__ void __launch_bounds__(kThreads, 1)
    one_launch_step_kernel(const OneLaunchStepParams p, const SmemPlan plan) {
  constexpr int kHist = W - 1;
  constexpr HeadRegion kRegion = head_region(kF32State, kLowRank, W);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::uint64_t landed;      // the head's state, or the W_o rows (cp.async.bulk)
  __shared__ std::uint64_t x_landed;    // the hidden rows (cp.async.bulk)
  __shared__ std::uint64_t factors_in;  // f_a and g_a (or the gate) in shared memory: 2 D arrivals
  __shared__ __align__(16) float fa_s[D], ga_s[D];  // f_a and g_a (bf16 values; dot_row)
  __shared__ float qkv_s[3][D];                     // q, k, v after the conv (bf16 values)
  __shared__ float g_s[D];                          // g = f_a·W_fbᵀ (bf16 values)
  __shared__ float gate_s[D];  // the full-rank output gate before its bias, fp32
  __shared__ float og_s[D];    // sigmoid(round_bf16(gate + bias)): what y takes of the gate
  __shared__ float o_s[D];     // the core's output (bf16 values)
  __shared__ float beta_s;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int blocks = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);
  const int R = kMulti ? p.rows : 1;
  const int H = p.heads;
  // A head block's head and row.
  const int h = kMulti ? block % H : block, m = kMulti ? block / H : 0;
  const std::int64_t E = p.hidden_size, Cl = static_cast<std::int64_t>(H) * D;
  const bool head_block = block < R * H;
  auto* x_s = reinterpret_cast<uint4*>(smem);
  auto* y_s = reinterpret_cast<uint4*>(smem + plan.x_bytes);
  unsigned char* region = smem + plan.x_bytes + plan.y_bytes + plan.reduce_bytes;
  const bool reporter = head_block && h == 0 && tid == 0 && p.status != nullptr;
  auto report = [&](std::uint32_t bit) {
    if (p.status != nullptr) atomicOr(p.status, bit);
  };
  auto stamp = [&](OneLaunchStamp k) {
    if (p.trace != nullptr && tid == 0) {
      p.trace[block * kOneLaunchTraceStamps + k] = global_timer_ns();
    }
  };
  stamp(kStampStart);
  // The kernel after this one (launched as a programmatic dependent) may start its blocks as this
  // grid's leave, and waits for it to complete before it reads what it wrote.
  griddep_launch_dependents();
  if (tid == 0) {
    mbarrier_init(&landed, 1);
    mbarrier_init(&x_landed, 1);
    mbarrier_init(&factors_in, 2 * D);
  }
  unsigned char* state_s = region;
  auto* w_rows = reinterpret_cast<uint4*>(region + kRegion.factors);
  auto* hist_s = reinterpret_cast<std::uint16_t*>(region + kRegion.hist);
  auto* taps_s = reinterpret_cast<float*>(region + kRegion.taps);
  auto* dtb_s = reinterpret_cast<float*>(region + kRegion.dt_bias);
  auto* o_norm_s = reinterpret_cast<float*>(region + kRegion.o_norm);
  auto* g_bias_s = reinterpret_cast<std::uint16_t*>(region + kRegion.g_bias);
  constexpr int kHistChunks = D * kHist * 2 / 16, kTapChunks = D * W * 4 / 16;

  // ---- the input projection's first round of weight loads (one row: a warp's from its first
  // weight row; several: the block's first tile), in flight before the wait for the kernel
  // before, which writes no weight: the weights stream while that kernel drains and while the
  // hidden rows come in (the TP8 shard's step of one row: 12.1 -> 11.3 us a layer) ----
  const std::int64_t proj_rows_all = p.proj_rows + (kLowRank ? 0 : Cl);
  const std::int64_t first_row = static_cast<std::int64_t>(block) * kWarps + warp;
  uint4 wv[kLoadsPerLane];      // one row
  uint4 wt[kRoundSteps][2][2];  // several rows
  TileWork work{};
  if constexpr (kMulti) {
    work = tile_work<kLowRank>(p);
    if (block < work.tiles && work.s_begin < work.s_end) {
      load_tile_round<kLowRank>(p, work, block, work.s_begin, wt);
    }
  } else {
    if (first_row < proj_rows_all) load_row_round(p, weight_row(p, first_row), lane, wv);
  }

  // ---- a head block's weights (no kernel before this one writes them): in flight before the
  // wait for that kernel, through cp.async, 16 bytes a thread at a time (the factor rows
  // swizzled) ----
  if (head_block) {
    const auto* fb = reinterpret_cast<const uint4*>(p.w_fb + static_cast<std::int64_t>(h) * D * D);
    for (int i = tid; i < D * kFactorRowChunks; i += kThreads) {
      cp_async_16(w_rows + swizzled(i / kFactorRowChunks, i % kFactorRowChunks), fb + i);
    }
    if constexpr (kLowRank) {
      const auto* gb =
          reinterpret_cast<const uint4*>(p.w_gb + static_cast<std::int64_t>(h) * D * D);
      for (int i = tid; i < D * kFactorRowChunks; i += kThreads) {
        cp_async_16(w_rows + swizzled(D + i / kFactorRowChunks, i % kFactorRowChunks), gb + i);
      }
    }
    // A branch's taps of the head's channels are contiguous in conv_weight.
    for (int j = tid; j < 3 * kTapChunks + D / 2 + D / 8; j += kThreads) {
      if (j < 3 * kTapChunks) {
        const int branch = j / kTapChunks, c = j % kTapChunks;
        cp_async_16(reinterpret_cast<uint4*>(taps_s) + j,
                    reinterpret_cast<const uint4*>(p.conv_weight + (branch * Cl + h * D) * W) + c);
        continue;
      }
      int i = j - 3 * kTapChunks;
      if (i < D / 4) {
        cp_async_16(reinterpret_cast<uint4*>(dtb_s) + i,
                    reinterpret_cast<const uint4*>(p.dt_bias + h * D) + i);
      } else if (i < D / 2) {
        i -= D / 4;
        cp_async_16(reinterpret_cast<uint4*>(o_norm_s) + i,
                    reinterpret_cast<const uint4*>(p.o_norm) + i);
      } else if (p.g_bias != nullptr) {
        i -= D / 2;
        cp_async_16(reinterpret_cast<uint4*>(g_bias_s) + i,
                    reinterpret_cast<const uint4*>(p.g_bias + h * D) + i);
      }
    }
  }
  // Launched as a programmatic dependent: what the kernels before wrote (the hidden row, the
  // slots, the states, the count of blocks left and the exchange words) is read after this.
  griddep_wait();
  stamp(kStampWaitReturned);
  auto* const left = reinterpret_cast<unsigned long long*>(p.sync + kLeftWord);
  const std::uint32_t tag =
      static_cast<std::uint32_t>(load_relaxed_gpu_u64(reinterpret_cast<std::uint64_t*>(left)) /
                                 static_cast<std::uint64_t>(blocks)) +
      1u;
  std::uint64_t* const exchange = p.exchange;
  const std::int64_t y_word0 = one_launch_y_word0(p.proj_rows, Cl, !kLowRank);
  const std::int64_t row_words = one_launch_row_words(p.proj_rows, Cl, !kLowRank);
  std::uint64_t* const my_words =
      exchange + (head_block ? m * row_words : 0);  // a head block's row's
  // The hidden rows by the copy engine, a copy a row (a row's shared-memory slot is x_chunks
  // chunks): threads' loads would queue behind the weight loads in flight.
  if (tid == 0) {
    const auto row_bytes = static_cast<unsigned>(E * 2);
    mbarrier_expect_tx(&x_landed, row_bytes * static_cast<unsigned>(R));
    for (int r = 0; r < R; ++r) {
      bulk_copy_to_shared(x_s + r * plan.x_chunks,
                          reinterpret_cast<const uint4*>(p.hidden) + r * (E / 8), row_bytes,
                          &x_landed);
    }
  }

  // ---- a head block: its slot, its state and conv states ----
  std::int64_t slot = -1;
  float a_log = 0.0f;
  if (head_block) {
    slot = p.slots != nullptr ? p.slots[m] : m;
    a_log = p.A_log[h];
    if (slot >= p.num_slots && reporter) report(kDeviceStatusSlot);
    // The first row's blocks check the gate parameters.
    if (m == 0 && tid < D && gate_params_bad(tid == 0 ? a_log : 0.0f, p.dt_bias[h * D + tid])) {
      report(kDeviceStatusGateParams);
    }
    if (slot >= p.num_slots || slot == p.padding_slot) slot = -1;
  }
  const bool steps = head_block && slot >= 0;  // padding: zeros out, no state read or written
  const std::int64_t state_base = (slot * H + h) * D * D;
  if (steps) {
    if (tid == 0) {  // the state: one copy, landing on `landed`
      constexpr unsigned kStateBytes = D * D * (kF32State ? 4 : 2);
      mbarrier_expect_tx(&landed, kStateBytes);
      bulk_copy_to_shared(
          state_s, static_cast<const unsigned char*>(p.state) + state_base * (kF32State ? 4 : 2),
          kStateBytes, &landed);
    }
    // A branch's conv states of the head's channels are contiguous in the pool.
    for (int i = tid; i < 3 * kHistChunks; i += kThreads) {
      const int branch = i / kHistChunks, c = i % kHistChunks;
      cp_async_16(
          reinterpret_cast<uint4*>(hist_s) + i,
          reinterpret_cast<const uint4*>(p.conv_pools[branch] + (slot * Cl + h * D) * kHist) + c);
    }
  }
  if (head_block) cp_async_commit();
  __syncthreads();
  mbarrier_wait(&x_landed, 0);
  stamp(kStampHiddenLoaded);

  // ---- 1. the input projection: a warp a row (one row), or 16 rows a block (several) ----
  if constexpr (kMulti) {
    project_rows_mma<kLowRank>(p, plan, work, wt, x_s,
                               reinterpret_cast<float*>(smem + plan.x_bytes + plan.y_bytes),
                               exchange, row_words, tag);
  } else {
    const std::int64_t chunks = E / 8;
    const std::int64_t stride = static_cast<std::int64_t>(blocks) * kWarps;
    for (std::int64_t r = first_row; r < proj_rows_all; r += stride) {
      const bool gate_row = !kLowRank && r >= p.proj_rows;
      const uint4* w = weight_row(p, r);
      float acc = 0.0f;
      for (std::int64_t c0 = lane; c0 < chunks; c0 += 32 * kLoadsPerLane) {
        if (r != first_row || c0 != lane) load_row_round(p, w, c0, wv);  // the first: above
#pragma unroll
        for (int u = 0; u < kLoadsPerLane; ++u) {
          const std::int64_t c = c0 + 32 * u;
          if (c < chunks) acc = dot8(wv[u], x_s[c], acc);
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      }
      if (lane == 0) {
        put_word(exchange + r, tag, gate_row ? __float_as_uint(acc) : float_to_bits(acc));
      }
    }
  }
  __syncthreads();
  stamp(kStampProjectionDone);
  // The o_proj blocks' W_o rows, from here on: into the threads' registers (out_in_registers) or,
  // contiguous, into shared memory by the copy engine.
  const std::int64_t e0 = head_block ? 0 : (block - R * H) * plan.out_rows;
  const std::int64_t e1 = head_block ? 0 : (e0 + plan.out_rows < E ? e0 + plan.out_rows : E);
  uint4 wo[4];  // out_in_registers: this thread's chunks of W_o (several rows: fragments)
  if (!head_block && plan.out_in_registers) {
    if constexpr (kMulti) {
      load_out_fragments(p, e0, e1, wo);
    } else {
      load_out_row(p, plan, e0, e1, wo);
    }
  } else if (tid == 0 && e1 > e0) {
    for (const std::uint64_t held = global_timer_ns();
         global_timer_ns() - held < plan.wo_hold_ns;) {
    }
    const auto bytes = static_cast<unsigned>((e1 - e0) * Cl * 2);
    mbarrier_expect_tx(&landed, bytes);
    const auto* src = reinterpret_cast<const unsigned char*>(p.w_o + e0 * Cl);
    for (unsigned off = 0; off < bytes; off += kCopyBytes) {
      bulk_copy_to_shared(region + off, src + off,
                          bytes - off < kCopyBytes ? bytes - off : kCopyBytes, &landed);
    }
  }

  if (head_block) {
    // ---- 2. the head's step ----
    cp_async_wait<0>();  // the head's region: every thread's copies, then the barrier
    if (steps) mbarrier_wait(&landed, 0);
    __syncthreads();
    if (!steps) {
      for (int i = tid; i < D / 2; i += kThreads)
        put_word(my_words + y_word0 + h * D / 2 + i, tag, 0);
    } else {
      // The thread's state values into registers now, off the chain after the projection.
      const int k0 = 4 * lane;
      const int v_row0 = warp * kRowsPerWarp;
      float S[kRowsPerWarp][4];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int off = (v_row0 + i) * D + k0;
        if constexpr (kF32State) {
          const float4 f = reinterpret_cast<const float4*>(state_s)[off / 4];
          S[i][0] = f.x, S[i][1] = f.y, S[i][2] = f.z, S[i][3] = f.w;
        } else {
          unpack_bf16x4(reinterpret_cast<const uint2*>(state_s)[off / 4], S[i]);
        }
      }
      stamp(kStampStateInRegisters);
      // What the step reads of the projection: each thread its words.
      bool late = false;
      {
        const std::uint64_t* at[1] = {nullptr};
        if (tid < D) {
          at[0] = my_words + p.f_a_col + tid;
        } else if (tid < 2 * D) {
          at[0] = my_words + (kLowRank ? p.g_a_col + tid - D : p.proj_rows + h * D + tid - D);
        } else if (tid == 2 * D) {
          at[0] = my_words + p.beta_col + h;
        }
        std::uint32_t v[1];
        take_words(at, tag, v, late);
        const auto bits = static_cast<std::uint16_t>(v[0]);
        if (tid < D) {
          fa_s[tid] = bits_to_float(bits);
        } else if (tid < 2 * D) {
          if constexpr (kLowRank) {
            ga_s[tid - D] = bits_to_float(bits);
          } else {
            gate_s[tid - D] = __uint_as_float(v[0]);
          }
        } else if (tid == 2 * D) {
          beta_s = sigmoid_f(bits_to_float(bits));
        }
      }
      // The conv's threads (the last 3 D / 2, two channels each of q, k or v) take their words
      // too; then warps 0-7 compute the second factors (thread r < D g of channel r, thread D + r
      // the output gate of row r and what y takes of it, so that warp 0's norm after the step
      // waits on nothing but o) while the conv's threads convolve, and one block barrier ends it.
      static_assert(2 * D < kThreads - 3 * D / 2,
                    "the factors' threads and beta's are not the conv's");
      const int conv_index = tid - (kThreads - 3 * D / 2);
      const int branch = conv_index / (D / 2), channel = 2 * (conv_index % (D / 2));
      const std::int64_t cc = h * D + channel;
      float x[2] = {0.0f, 0.0f};
      if (conv_index >= 0) {
        const std::uint64_t* at[2] = {my_words + branch * Cl + cc, my_words + branch * Cl + cc + 1};
        std::uint32_t v[2];
        take_words(at, tag, v, late);
        x[0] = bits_to_float(static_cast<std::uint16_t>(v[0]));
        x[1] = bits_to_float(static_cast<std::uint16_t>(v[1]));
      }
      stamp(kStampOwnWordsTaken);
      // Warps 0-7 go on once f_a and g_a (or the gate) are in, without waiting for the conv's
      // words: an mbarrier of their 256 arrivals (a block barrier here cost the TP8 shard's step
      // 0.2 us; a named barrier drew racecheck reports on the block barrier after it, an
      // mbarrier does not: SANITIZERS.md).
      if (tid < 2 * D) {
        mbarrier_arrive(&factors_in);
        mbarrier_wait(&factors_in, 0);
      }
      if (tid < D) {
        g_s[tid] = round_bf16(dot_row(w_rows, tid, fa_s));
      } else if (tid < 2 * D) {
        const int r = tid - D;
        const float gate = kLowRank ? dot_row(w_rows, tid, ga_s) : gate_s[r];
        og_s[r] = output_gate(gate, p.g_bias != nullptr ? bits_to_float(g_bias_s[r]) : 0.0f);
      } else if (conv_index >= 0) {
        std::uint16_t* conv_state = p.conv_pools[branch] + (slot * Cl + cc) * kHist;
        const std::uint16_t* old = hist_s + (branch * D + channel) * kHist;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float* taps = taps_s + (branch * D + channel + i) * W;
          float a = 0.0f;
#pragma unroll
          for (int j = 0; j < kHist; ++j) a += taps[j] * bits_to_float(old[i * kHist + j]);
          a += taps[W - 1] * x[i];
          qkv_s[branch][channel + i] = round_bf16(silu(a));
#pragma unroll
          for (int j = 0; j + 1 < kHist; ++j) conv_state[i * kHist + j] = old[i * kHist + j + 1];
          conv_state[i * kHist + kHist - 1] = float_to_bits(x[i]);
        }
      }
      if (late) report(kDeviceStatusStepTimeout);
      __syncthreads();
      stamp(kStampValuesTaken);

      // The KDA step (the fused kernel's operations in its order), Sᵀ in registers.
      float qh[4], kh[4], alpha[4];
      step_factors(&qkv_s[0][k0], &qkv_s[1][k0], g_s + k0, dtb_s + k0, __expf(a_log), p.gate_mode,
                   p.lower_bound, p.scale, qh, kh, alpha);
      const float mine =
          step_rows(S, alpha, kh, qh, beta_s, &qkv_s[2][v_row0], lane, [](int, float) {});
      if (lane < kRowsPerWarp) o_s[v_row0 + lane] = round_bf16(mine);
      stamp(kStampStepComputed);
      __syncthreads();  // o_s whole
      // The gated RMSNorm of the head (the norm kernel's operations), one warp, before the state
      // goes back to shared memory: y is what o_proj waits for, the state's store is not.
      if (warp == 0) {
        float o[4], og[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = o_s[k0 + j], og[j] = og_s[k0 + j];
        const uint2 y = gated_norm4(o, head_inv_rms(o, p.eps), og, o_norm_s + k0);
        put_word(my_words + y_word0 + (h * D + k0) / 2, tag, y.x);
        put_word(my_words + y_word0 + (h * D + k0) / 2 + 1, tag, y.y);
      }
      stamp(kStampNormDone);
      // The new state back into shared memory, whence the copy engine stores it (one bulk copy,
      // drained while o_proj runs): plain stores of 64 KB from one multiprocessor took 3.5-7 us
      // to issue (kda-step-probe), longer than the rest of the step.
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int off = (v_row0 + i) * D + k0;
        if constexpr (kF32State) {
          reinterpret_cast<float4*>(state_s)[off / 4] =
              make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
        } else {
          reinterpret_cast<uint2*>(state_s)[off / 4] = pack_bf16x4(S[i]);
        }
      }
      fence_proxy_async();  // this thread's shared writes, before the copy engine reads them
      stamp(kStampStateInShared);
      __syncthreads();
      if (tid == 0) {
        bulk_copy_to_global(static_cast<unsigned char*>(p.state) + state_base * (kF32State ? 4 : 2),
                            state_s, D * D * (kF32State ? 4 : 2));
        bulk_commit();
      }
    }
    stamp(kStampResultsIssued);
  } else {
    // ---- 3. o_proj: this block's W_o rows · y (from registers where they fit: o_proj_row_held,
    // o_proj_rows_mma; else out_lanes threads a weight row from shared memory) ----
    // y's words (two values each) of every row, four a thread at a time.
    const std::int64_t y_words = Cl / 2;  // a row's
    auto* y_pairs = reinterpret_cast<std::uint32_t*>(y_s);
    bool late = false;
    for (std::int64_t base = 0; base < R * y_words; base += 4 * kThreads) {
      const std::uint64_t* at[4];
      std::uint32_t v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const std::int64_t i = base + tid + k * kThreads;
        const std::int64_t word =
            kMulti ? i / y_words * row_words + y_word0 + i % y_words : y_word0 + i;
        at[k] = i < R * y_words ? exchange + word : nullptr;
      }
      take_words(at, tag, v, late);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (at[k] != nullptr) y_pairs[base + tid + k * kThreads] = v[k];
      }
    }
    if (late) report(kDeviceStatusStepTimeout);
    stamp(kStampOwnWordsTaken);
    __syncthreads();
    stamp(kStampValuesTaken);
    const std::int64_t y_chunks = Cl / 8;
    if (e1 > e0 && !plan.out_in_registers) mbarrier_wait(&landed, 0);
    stamp(kStampWoLanded);
    const auto* rows = reinterpret_cast<const uint4*>(region);
    const int L = plan.out_lanes, sub = tid % L;
    if (plan.out_in_registers) {
      if constexpr (kMulti) {
        o_proj_rows_mma(p, wo, y_s, reinterpret_cast<float*>(region), R, e0, e1);
      } else {
        o_proj_row_held(p, plan, wo, y_s, e0, e1);
      }
    } else if constexpr (kMulti) {
      if (R <= 2) {
        o_proj_rows<2>(p, plan, rows, y_s, R, e0, e1);
      } else {
        o_proj_rows<4>(p, plan, rows, y_s, R, e0, e1);
      }
    } else {
      for (std::int64_t base = e0; base < e1; base += kThreads / L) {  // warp-uniform
        const std::int64_t e = base + tid / L;
        // Four sums in flight a thread (chunks sub, sub + L, ... in turn), added pairwise.
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (e < e1) {
          const uint4* row = rows + (e - e0) * y_chunks;
          std::int64_t c = sub;
          for (; c + 3 * L < y_chunks; c += 4 * L) {
#pragma unroll
            for (int u = 0; u < 4; ++u) a[u] = dot8(row[c + u * L], y_s[c + u * L], a[u]);
          }
          for (; c < y_chunks; c += L) a[0] = dot8(row[c], y_s[c], a[0]);
        }
        const float acc = sum_row(a, L);
        if (e < e1 && sub == 0) p.out[e] = float_to_bits(acc);
      }
    }
    __syncthreads();
    stamp(kStampResultsIssued);
  }

  // The block leaves: one more in the count the next launch's tag comes from (a reduction, no
  // fence: the next launch reads it after this one has completed).
  __syncthreads();
  stamp(kStampLeaving);
  if (steps && tid == 0)
    bulk_wait_all();  // the state's store, before the block (and its shared
                      // memory) goes
  if (tid == 0) atomicAdd(left, 1ull);
}

bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// The current device's shared memory a block may opt in to, read once a device (0 when it cannot
// be read: nothing fits).
int max_block_smem() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices) {
    value = cached[device].load(std::memory_order_relaxed);
    if (value != 0) return value;
  }
  if (cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess) {
    return 0;
  }
  if (device >= 0 && device < kMaxDevices) cached[device].store(value, std::memory_order_relaxed);
  return value;
}

// Room for the kernel's static shared memory (the arrays above: 4.2 KB), beside the dynamic plan.
constexpr int kStaticSmemBytes = 8 * 1024;

template <int W, bool kF32State, bool kLowRank, bool kMulti>
cudaError_t launch_kernel(const OneLaunchStepParams& p, const SmemPlan& plan, int blocks,
                          cudaStream_t stream) {
  auto* kernel = one_launch_step_kernel<W, kF32State, kLowRank, kMulti>;
  const cudaError_t raised =
      kda::detail::allow_shared_memory<one_launch_step_kernel<W, kF32State, kLowRank, kMulti>>(
          static_cast<int>(plan.total));
  if (raised != cudaSuccess) return raised;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<std::size_t>(plan.total);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p, plan);
}

template <int W, bool kMulti>
cudaError_t launch_width(const OneLaunchStepParams& p, const SmemPlan& plan, int blocks,
                         cudaStream_t stream) {
  const bool low_rank = p.w_gb != nullptr;
  if (p.f32_state) {
    return low_rank ? launch_kernel<W, true, true, kMulti>(p, plan, blocks, stream)
                    : launch_kernel<W, true, false, kMulti>(p, plan, blocks, stream);
  }
  return low_rank ? launch_kernel<W, false, true, kMulti>(p, plan, blocks, stream)
                  : launch_kernel<W, false, false, kMulti>(p, plan, blocks, stream);
}

template <int W>
cudaError_t launch_rows(const OneLaunchStepParams& p, const SmemPlan& plan, int blocks,
                        cudaStream_t stream) {
  return p.rows > 1 ? launch_width<W, true>(p, plan, blocks, stream)
                    : launch_width<W, false>(p, plan, blocks, stream);
}

}  // namespace

bool one_launch_step_fits(const OneLaunchStepParams& p) {
  const int blocks = kda::detail::current_device_sm_count();
  if (p.heads < 1 || p.rows < 1 || p.rows > one_launch_max_rows(p.heads) ||
      static_cast<std::int64_t>(p.rows) * p.heads >= blocks || p.width < 2 || p.width > 4 ||
      p.hidden_size < 8 || p.hidden_size % 8 != 0 || p.sync == nullptr || p.w_fb == nullptr ||
      p.exchange == nullptr || (p.w_gb == nullptr && p.w_g == nullptr)) {
    return false;
  }
  for (const void* required :
       {static_cast<const void*>(p.hidden), static_cast<const void*>(p.w_in),
        static_cast<const void*>(p.conv_weight), static_cast<const void*>(p.conv_pools[0]),
        static_cast<const void*>(p.conv_pools[1]), static_cast<const void*>(p.conv_pools[2]),
        static_cast<const void*>(p.A_log), static_cast<const void*>(p.dt_bias),
        static_cast<const void*>(p.o_norm), static_cast<const void*>(p.state),
        static_cast<const void*>(p.w_o), static_cast<const void*>(p.out)}) {
    if (required == nullptr) return false;
  }
  const SmemPlan plan = smem_plan(p, blocks);
  if (plan.total + kStaticSmemBytes > max_block_smem()) return false;
  return aligned(p.hidden, 16) && aligned(p.w_in, 16) && aligned(p.w_o, 16) &&
         aligned(p.w_fb, 16) && (p.w_gb == nullptr || aligned(p.w_gb, 16)) &&
         (p.w_g == nullptr || aligned(p.w_g, 16)) && aligned(p.exchange, 8) && aligned(p.sync, 8) &&
         aligned(p.state, 16) && aligned(p.conv_pools[0], 16) && aligned(p.conv_pools[1], 16) &&
         aligned(p.conv_pools[2], 16) && aligned(p.conv_weight, 16) && aligned(p.dt_bias, 16) &&
         aligned(p.o_norm, 16) && aligned(p.g_bias, 16);
}

cudaError_t launch_one_launch_step(const OneLaunchStepParams& p, cudaStream_t stream) {
  if (!one_launch_step_fits(p)) return cudaErrorInvalidValue;
  const int blocks = kda::detail::current_device_sm_count();
  const SmemPlan plan = smem_plan(p, blocks);
  switch (p.width) {
    case 2:
      return launch_rows<2>(p, plan, blocks, stream);
    case 3:
      return launch_rows<3>(p, plan, blocks, stream);
    default:
      return launch_rows<4>(p, plan, blocks, stream);
  }
}

}  // namespace kda::layer::cuda
