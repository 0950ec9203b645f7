// layer/src/cuda/small_gemm.cu — out = in · Wᵀ for one row (a decode step of one sequence): a
// matrix-vector product bound by reading W once, in two kernels; and for a few rows.
//
// The streamed kernel: one block a multiprocessor, each streaming a contiguous range
// of weight rows through a ring of shared-memory stages filled by the copy engine (one
// cp.async.bulk a stage, up to 128 KB in flight a multiprocessor), eight warps computing the rows'
// dot products from shared memory. Launched as a programmatic dependent, its first stages are in
// flight while the kernel before it still runs (o_proj's weights arrive while the fused decode
// step computes).
//
// The sliced kernel (the layer's unless KDA_LAYER_SMALL_GEMM=streamed; and the shapes the streamed
// one does not take: rows of fewer than 256 or more than 16384 columns): each weight row is cut
// into `split` slices of K, one warp a slice, 16-byte loads past L1, eight in flight a lane; a
// block of eight warps holds 8 / split rows and sums each row's slices in shared memory.
//
// The tiled kernel: 2 to 64 rows on the tensor cores (below).
//
// All: fp32 accumulation, a row's partial sums added in a fixed order (deterministic), one
// rounding at the end. Measured against cuBLAS on the H200 in kda-gemv-probe and kda-layer-bench
// (KDA_LAYER_SMALL_GEMM=0 runs cuBLAS instead).
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/cuda_check.hpp"  // current_device_sm_count (kda/src/cuda)
#include "cuda/kernels.hpp"
#include "cuda/ptx.cuh"  // griddepcontrol, cp.async.bulk, mbarriers (kda/src/cuda)
#include "cuda/shared_memory.cuh"
#include "cuda/weight_rows.cuh"

namespace kda::layer::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 8;  // 16-byte weight loads in flight per lane

template <bool kOutF32>
__device__ __forceinline__ void store_out(void* out, std::int64_t n, float sum) {
  if constexpr (kOutF32) {
    static_cast<float*>(out)[n] = sum;
  } else {
    static_cast<std::uint16_t*>(out)[n] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
  }
}

using kda::detail::griddep_launch_dependents;
using kda::detail::griddep_wait;

template <bool kOutF32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sliced_gemm_kernel(SmallGemmParams p, int split) {
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
  store_out<kOutF32>(p.out, n, sum);
}

// ---- the streamed kernel ------------------------------------------------------------------------
// One block a multiprocessor, each a contiguous range of weight rows. A producer thread copies
// stages of whole rows (one cp.async.bulk each: the rows of a range are contiguous bytes) into a
// ring of shared-memory stages; eight consumer warps take each stage as it lands, a row (or a slice
// of one) a warp, and give the stage back through its mbarrier. The first stages are in flight
// before griddepcontrol.wait (weights never depend on the kernel before), the input row is read
// after it.

constexpr int kConsumerWarps = 8;
constexpr int kStreamThreads = (kConsumerWarps + 1) * 32;  // the last warp's lane 0 copies
constexpr int kMaxStages = 8;
constexpr std::int64_t kStageCap = 32 * 1024;  // bytes of one stage (whole rows)
// Shared memory a block: room beside it on the same multiprocessor for a fused decode step's
// blocks of 4 or 8 a head (about 45 and 41 KB; one block a head with its second factors takes 69
// KB), where o_proj starts while that step runs.
constexpr std::int64_t kStreamSmem = 128 * 1024;
// Shared memory header: full[kMaxStages], empty[kMaxStages] mbarriers, then the slices' partial
// sums [kMaxStages][kConsumerWarps].
constexpr int kHeaderBytes = 2 * kMaxStages * 8 + kMaxStages * kConsumerWarps * 4;
constexpr int kHeaderAligned = (kHeaderBytes + 127) / 128 * 128;

struct StreamPlan {
  int rows_per_stage = 0;  // R: a power of two
  int slices = 0;          // warps a row (8 / R where R < 8, else 1)
  int stages = 0;
  int stage_bytes = 0;
  int x_bytes = 0;  // the input row's room in shared memory, 128-byte aligned
  int grid = 0;
  int smem = 0;
};

int slices_of(int rows_per_stage) {
  return rows_per_stage >= kConsumerWarps ? 1 : kConsumerWarps / rows_per_stage;
}

template <bool kOutF32>
__global__ void __launch_bounds__(kStreamThreads, 1)
    streamed_gemm_kernel(SmallGemmParams p, StreamPlan plan) {
  extern __shared__ __align__(128) unsigned char smem[];
  auto* full = reinterpret_cast<std::uint64_t*>(smem);
  std::uint64_t* empty = full + kMaxStages;
  auto* partial = reinterpret_cast<float*>(empty + kMaxStages);
  auto* x = reinterpret_cast<uint4*>(smem + kHeaderAligned);
  unsigned char* stages = smem + kHeaderAligned + plan.x_bytes;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int R = plan.rows_per_stage, P = plan.stages;
  const std::int64_t units = (p.n + R - 1) / R;
  const std::int64_t u_begin = units * blockIdx.x / gridDim.x;
  const std::int64_t u_end = units * (blockIdx.x + 1) / gridDim.x;
  const int count = static_cast<int>(u_end - u_begin);
  if (threadIdx.x == 0) {
    for (int s = 0; s < P; ++s) {
      kda::detail::mbarrier_init(&full[s], 1);
      kda::detail::mbarrier_init(&empty[s], kConsumerWarps * 32);
    }
  }
  __syncthreads();
  griddep_launch_dependents();
  if (warp == kConsumerWarps) {  // the producer
    if (lane == 0) {
      for (int i = 0; i < count; ++i) {
        const int s = i % P;
        if (i >= P) kda::detail::mbarrier_wait(&empty[s], static_cast<unsigned>(i / P - 1) & 1u);
        const std::int64_t row0 = (u_begin + i) * R;
        const std::int64_t rows = p.n - row0 < R ? p.n - row0 : R;
        const auto bytes = static_cast<unsigned>(rows * p.k * 2);
        kda::detail::mbarrier_expect_tx(&full[s], bytes);
        kda::detail::bulk_copy_to_shared(stages + static_cast<std::int64_t>(s) * plan.stage_bytes,
                                         p.weight + row0 * p.k, bytes, &full[s]);
      }
    }
    return;
  }
  // The consumers. The input row may be the previous kernel's output: read it after the wait.
  griddep_wait();
  const int C = static_cast<int>(p.k / 8);
  for (int c = static_cast<int>(threadIdx.x); c < C; c += kConsumerWarps * 32) {
    x[c] = reinterpret_cast<const uint4*>(p.in)[c];
  }
  kda::detail::named_barrier_sync(1, kConsumerWarps * 32);
  const int S = plan.slices;
  const int per_slice = (C + S - 1) / S;
  const int slice = warp % S;
  const int c_begin = slice * per_slice;
  const int c_end = c_begin + per_slice < C ? c_begin + per_slice : C;
  const int row_step = kConsumerWarps / S;
  const int first_row = warp / S;
  for (int i = 0; i < count; ++i) {
    const int s = i % P;
    kda::detail::mbarrier_wait(&full[s], static_cast<unsigned>(i / P) & 1u);
    const std::int64_t row0 = (u_begin + i) * R;
    const int rows = static_cast<int>(p.n - row0 < R ? p.n - row0 : R);
    const auto* w =
        reinterpret_cast<const uint4*>(stages + static_cast<std::int64_t>(s) * plan.stage_bytes);
    for (int r = first_row; r < rows; r += row_step) {
      float acc = 0.0f;
      for (int c = c_begin + lane; c < c_end; c += 32) acc = dot8(w[r * C + c], x[c], acc);
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      }
      float sum = acc;
      if (S > 1) {  // the row's slices meet: its first warp adds them in slice order
        if (lane == 0) partial[s * kConsumerWarps + warp] = acc;
        kda::detail::named_barrier_sync(2 + first_row, S * 32);
        if (slice != 0) continue;
        sum = partial[s * kConsumerWarps + warp];
        for (int j = 1; j < S; ++j) sum += partial[s * kConsumerWarps + warp + j];
      }
      if (lane == 0) store_out<kOutF32>(p.out, row0 + r, sum);
    }
    // Every consumer thread gives the stage back itself, after its own last read of it: one
    // arrival a warp after __syncwarp orders the same reads, but racecheck credits an arrival with
    // the arriving thread's accesses only and reports the next copy into the stage as a hazard
    // against the other lanes' reads (SANITIZERS.md).
    kda::detail::mbarrier_arrive(&empty[s]);
  }
}

// ---- the tiled kernel ---------------------------------------------------------------------------
// A few rows (2 to 64: decode steps of a small batch) on the tensor cores: out[rows, n] = in ·
// Wᵀ with mma.m16n8k16 (bf16 in, fp32 accumulation), each block 64 weight rows (a warp 16 of
// them) against all rows of `in`, K in tiles of 64 through a cp.async ring of kTiledStages
// stages (both operands; the weights' tiles are issued before griddepcontrol.wait). Shapes with
// few blocks split K: each split writes fp32 partial sums to the workspace and a second kernel adds
// them in split order (deterministic). Shared-memory rows of a tile are 128 bytes; chunk c of row
// r sits at c ^ (r % 8), so that ldmatrix's eight rows fall in distinct banks.

constexpr int kTiledWarps = 4;
constexpr int kTiledRows = 16 * kTiledWarps;  // weight rows a block
constexpr int kTiledK = 64;                   // columns a tile
constexpr int kTiledStages = 4;
constexpr int kTiledChunks = kTiledK / 8;  // 16-byte chunks a tile row

__device__ __forceinline__ int tile_offset(int row, int chunk) {  // in 16-byte units
  return row * kTiledChunks + (chunk ^ (row % 8));
}

struct TiledPlan {
  int m_tiles = 0;  // 8-row tiles of `in` (1, 2, 4 or 8)
  int splits = 1;   // of K
  int n_blocks = 0;
  int k_tiles = 0;
};

template <int MT, bool kOutF32>
__global__ void __launch_bounds__(kTiledWarps * 32)
    tiled_gemm_kernel(SmallGemmParams p, TiledPlan plan) {
  extern __shared__ __align__(128) uint4 tiles[];  // [stages][kTiledRows + 8 MT][kTiledChunks]
  constexpr int kStageChunks = (kTiledRows + 8 * MT) * kTiledChunks;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.x) * kTiledRows;
  const int split = static_cast<int>(blockIdx.y);
  const int kt_begin = plan.k_tiles * split / plan.splits;
  const int kt_end = plan.k_tiles * (split + 1) / plan.splits;
  const int count = kt_end - kt_begin;
  const std::int64_t chunks_k = p.k / 8;

  // Stage s gets tile kt: the weights' part and the input's part apart (the weights may load
  // before the kernel ahead of this one is done, the input may not).
  auto load_weights = [&](int s, int kt) {
    uint4* stage = tiles + s * kStageChunks;
    for (int i = tid; i < kTiledRows * kTiledChunks; i += kTiledWarps * 32) {
      const int r = i / kTiledChunks, c = i % kTiledChunks;
      const std::int64_t n = n0 + r, chunk = static_cast<std::int64_t>(kt) * kTiledChunks + c;
      const bool valid = n < p.n && chunk < chunks_k;
      const std::uint16_t* src = valid ? p.weight + n * p.k + chunk * 8 : p.weight;
      kda::detail::cp_async_16_or_zero(stage + tile_offset(r, c), src, valid);
    }
  };
  auto load_input = [&](int s, int kt) {
    uint4* stage = tiles + s * kStageChunks + kTiledRows * kTiledChunks;
    for (int i = tid; i < 8 * MT * kTiledChunks; i += kTiledWarps * 32) {
      const int r = i / kTiledChunks, c = i % kTiledChunks;
      const std::int64_t chunk = static_cast<std::int64_t>(kt) * kTiledChunks + c;
      const bool valid = r < p.rows && chunk < chunks_k;
      const std::uint16_t* src = valid ? p.in + r * p.ldi + chunk * 8 : p.in;
      kda::detail::cp_async_16_or_zero(stage + tile_offset(r, c), src, valid);
    }
  };

  griddep_launch_dependents();
  for (int s = 0; s < kTiledStages - 1 && s < count; ++s) load_weights(s, kt_begin + s);
  griddep_wait();  // `in` may be the previous kernel's output
  for (int s = 0; s < kTiledStages - 1; ++s) {
    if (s < count) load_input(s, kt_begin + s);
    kda::detail::cp_async_commit();  // group s: stage s's input (and, in group 0, every early
                                     // weight)
  }

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
  for (int i = 0; i < count; ++i) {
    kda::detail::cp_async_wait<kTiledStages - 2>();
    __syncthreads();  // tile i is in; every warp is done with the stage refilled below
    const int next = i + kTiledStages - 1;
    if (next < count) {
      load_weights(next % kTiledStages, kt_begin + next);
      load_input(next % kTiledStages, kt_begin + next);
    }
    kda::detail::cp_async_commit();
    const uint4* stage = tiles + (i % kTiledStages) * kStageChunks;
    const uint4* x = stage + kTiledRows * kTiledChunks;
#pragma unroll
    for (int kk = 0; kk < kTiledK / 16; ++kk) {
      unsigned a[4];
      const int a_row = warp * 16 + lane % 16;
      kda::detail::ldmatrix_x4(a[0], a[1], a[2], a[3],
                               stage + tile_offset(a_row, 2 * kk + lane / 16));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        unsigned b0, b1;
        const int b_row = mt * 8 + lane % 8;
        kda::detail::ldmatrix_x2(b0, b1, x + tile_offset(b_row, 2 * kk + (lane / 8) % 2));
        kda::detail::mma_bf16(acc[mt], a, b0, b1);
      }
    }
  }

  // acc[mt][j]: weight row n0 + 16 warp + lane / 4 (+ 8 for j >= 2), input row 8 mt + 2 (lane % 4)
  // + j % 2.
  const bool partial = plan.splits > 1;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t n = n0 + warp * 16 + lane / 4 + (j >= 2 ? 8 : 0);
      const std::int64_t m = mt * 8 + 2 * (lane % 4) + j % 2;
      if (n >= p.n || m >= p.rows) continue;
      if (partial) {
        static_cast<float*>(p.workspace)[(split * p.rows + m) * p.n + n] = acc[mt][j];
      } else {
        store_out<kOutF32>(p.out, m * p.ldo + n, acc[mt][j]);
      }
    }
  }
}

// out[m, n] = the splits' partial sums added in split order.
template <bool kOutF32>
__global__ void __launch_bounds__(256) tiled_gemm_reduce_kernel(SmallGemmParams p, int splits) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  griddep_launch_dependents();
  griddep_wait();  // launched in plain stream order today; safe as a programmatic dependent too
  if (i >= p.rows * p.n) return;
  const std::int64_t m = i / p.n, n = i % p.n;
  const auto* partials = static_cast<const float*>(p.workspace);
  float sum = partials[i];
  for (int s = 1; s < splits; ++s) sum += partials[s * p.rows * p.n + i];
  store_out<kOutF32>(p.out, m * p.ldo + n, sum);
}

// ---- the fragment kernel ------------------------------------------------------------------------
// 1 to 8 rows (decode steps of a small batch) on the tensor cores, with the weights loaded from
// global memory straight into mma.m16n8k16's A fragments: no shared-memory staging and no
// ldmatrix, so a warp issues two 16-byte weight loads, one 16-byte input load and two MMAs for
// every 1 KB of weights it reads. That is possible because a dot product does not care in which
// order K is summed: lane (g, q) (g = lane / 4, q = lane % 4) loads 16 contiguous bytes of weight
// rows g and g + 8 at column 64 s + 16 q + 8 c and, for the k16 step j in {0, 1} of that chunk,
// hands its words (2j, 2j + 1) to the MMA as the fragment's columns (2q, 2q + 1) and (2q + 8,
// 2q + 9); it loads the same 16 bytes of input row g (B's column g), which lands them at the same
// logical columns of B. Each MMA thus sums 16 physical columns of K, and every column is summed
// once over a 64-column step. A step is 128 bytes of each row, the quad's 8 chunks; one load
// instruction (one c) takes the first half of each of its 32-byte sectors and the next the second
// half, so each sector is requested twice past L1 (64 contiguous bytes a quad and instruction,
// chunk 4c + q, measured slower at H = 32 and faster on the TP8 shard by less:
// docs/design/layer.md). A warp takes RT 16-row tiles of weights over a contiguous range of
// 64-column steps; `ksplit` warps of a block share one panel of 16 RT rows and add their partial
// sums in warp order through shared memory (deterministic; no workspace and no second kernel).
// kLoads 16-byte weight loads a lane are in flight a round (kLoads / (4 RT) steps), issued before
// the round's input loads and MMAs; the first round before griddepcontrol.wait. Rows of 9 and more
// read the input once per 8-row tile from L2 and lost to cuBLAS on the H200 (docs/design/layer.md),
// so the kernel stops at 8.

constexpr int kFragmentWarps = 8;

struct FragmentPlan {
  int ksplit = 1;    // warps a panel (1, 2, 4 or 8)
  int steps = 0;     // 64-column steps of K
  int per_part = 0;  // steps a warp
  int panels = 0;    // of 16 RT weight rows
};

template <int RT, int kLoads, bool kOutF32>
__global__ void __launch_bounds__(kFragmentWarps * 32)
    fragment_gemm_kernel(SmallGemmParams p, FragmentPlan plan) {
  constexpr int kSteps = kLoads / (4 * RT);  // steps a round
  static_assert(kSteps >= 1, "a round holds a step at least");
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int g = lane / 4, q = lane % 4;
  const int panels_per_block = kFragmentWarps / plan.ksplit;
  const std::int64_t panel =
      static_cast<std::int64_t>(blockIdx.x) * panels_per_block + warp / plan.ksplit;
  const int part = warp % plan.ksplit;
  const int s_begin = part * plan.per_part;
  const int s_end = min(plan.steps, s_begin + plan.per_part);
  griddep_launch_dependents();
  const bool live = panel < plan.panels;
  // This lane's weight rows: tile r, half h (rows g and g + 8 of the tile).
  const uint4* w_row[RT][2];
  bool w_ok[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t n = panel * (16 * RT) + 16 * r + 8 * h + g;
      w_ok[r][h] = live && n < p.n;
      w_row[r][h] = reinterpret_cast<const uint4*>(p.weight + (w_ok[r][h] ? n : 0) * p.k);
    }
  }
  const bool x_ok = g < p.rows;
  const auto* x_row = reinterpret_cast<const uint4*>(p.in + (x_ok ? g : 0) * p.ldi);
  const std::int64_t chunks = p.k / 8;  // 16-byte chunks a row
  float acc[RT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[r][j] = 0.0f;
  }

  uint4 w[kSteps][RT][2][2];  // [step][tile][half][chunk]
  auto load_round = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const std::int64_t chunk = static_cast<std::int64_t>(s0 + u) * 8 + 2 * q + c;
        const bool in_k = s0 + u < s_end && chunk < chunks;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            w[u][r][h][c] =
                in_k && w_ok[r][h] ? load_streaming(w_row[r][h] + chunk) : make_uint4(0, 0, 0, 0);
          }
        }
      }
    }
  };
  if (live && s_begin < s_end) load_round(s_begin);
  griddep_wait();
  for (int s0 = s_begin; live && s0 < s_end; s0 += kSteps) {
    if (s0 != s_begin) load_round(s0);
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      if (s0 + u >= s_end) break;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const std::int64_t chunk = static_cast<std::int64_t>(s0 + u) * 8 + 2 * q + c;
        // Past K (a last step of fewer than 64 columns) both operands are zero.
        const uint4 xv = chunk < chunks && x_ok ? __ldg(x_row + chunk) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          fragment_mma(acc[r], w[u][r][0][c], w[u][r][1][c], xv);
        }
      }
    }
  }

  // The panel's parts added in warp order: parts 1.. leave theirs in shared memory.
  constexpr int kValues = RT * 4;
  extern __shared__ float partials[];  // [kFragmentWarps][kValues][32]
  if (plan.ksplit > 1) {
    if (part != 0) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int j = 0; j < 4; ++j) partials[(warp * kValues + r * 4 + j) * 32 + lane] = acc[r][j];
      }
    }
    __syncthreads();
    if (part != 0) return;
    for (int other = 1; other < plan.ksplit; ++other) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[r][j] += partials[((warp + other) * kValues + r * 4 + j) * 32 + lane];
        }
      }
    }
  }
  if (!live) return;
    // acc[r][j]: weight row 16 r + g (+ 8 for j >= 2) of the panel, input row 2 q + j % 2.
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t n = panel * (16 * RT) + 16 * r + g + (j >= 2 ? 8 : 0);
      const std::int64_t m = 2 * q + j % 2;
      if (n < p.n && m < p.rows) store_out<kOutF32>(p.out, m * p.ldo + n, acc[r][j]);
    }
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

namespace {

// The streamed kernel's stages for `p`, or none (rows == 0) where it does not take the shape: one
// row, rows of 256 to 16384 columns. Stages hold the most whole rows that fit kStageCap (a power
// of two), halved while the grid would have fewer than eight stages a block (the last block's
// share then stays within an eighth of the others'), as long as a row's slices keep a warp's worth
// of 16-byte chunks each.
StreamPlan stream_plan(const SmallGemmParams& p) {
  StreamPlan plan;
  const std::int64_t chunks = p.k / 8, row_bytes = p.k * 2;
  const int sms = kda::detail::current_device_sm_count();
  if (p.rows != 1 || chunks < 32 || row_bytes > kStageCap || sms <= 0) return plan;
  int R = 1;
  while (R < 64 && 2 * R * row_bytes <= kStageCap) R *= 2;
  while (R > 1 && (p.n + R - 1) / R < 8 * sms && chunks / slices_of(R / 2) >= 32) R /= 2;
  plan.rows_per_stage = R;
  plan.slices = slices_of(R);
  plan.stage_bytes = static_cast<int>(R * row_bytes);
  plan.x_bytes = static_cast<int>((row_bytes + 127) / 128 * 128);
  plan.stages = static_cast<int>(std::min<std::int64_t>(
      kMaxStages, (kStreamSmem - kHeaderAligned - plan.x_bytes) / plan.stage_bytes));
  const std::int64_t units = (p.n + R - 1) / R;
  plan.grid = static_cast<int>(std::min<std::int64_t>(sms, units));
  plan.smem = kHeaderAligned + plan.x_bytes + plan.stages * plan.stage_bytes;
  if (plan.stages < 2) plan.rows_per_stage = 0;
  return plan;
}

template <bool kOutF32>
cudaError_t launch_streamed(const SmallGemmParams& p, const StreamPlan& plan,
                            cudaLaunchConfig_t config) {
  const cudaError_t raised = kda::detail::allow_shared_memory<streamed_gemm_kernel<kOutF32>>(
      static_cast<int>(kStreamSmem));
  if (raised != cudaSuccess) return raised;
  config.gridDim = dim3(static_cast<unsigned>(plan.grid));
  config.blockDim = dim3(kStreamThreads);
  config.dynamicSmemBytes = static_cast<std::size_t>(plan.smem);
  return cudaLaunchKernelEx(&config, streamed_gemm_kernel<kOutF32>, p, plan);
}

// The tiled kernel's tiles and splits for `p`: K split (in powers of two) while the grid stays
// within two blocks a multiprocessor, each split keeps four tiles of K or more, and the partial
// sums fit the workspace. The split count, and so the order of the sums, depends on the device's
// multiprocessors and the workspace given: results repeat bit for bit for one device and
// workspace size, not across them.
TiledPlan tiled_plan(const SmallGemmParams& p) {
  TiledPlan plan;
  plan.m_tiles = p.rows <= 8 ? 1 : p.rows <= 16 ? 2 : p.rows <= 32 ? 4 : 8;
  plan.n_blocks = static_cast<int>((p.n + kTiledRows - 1) / kTiledRows);
  plan.k_tiles = static_cast<int>((p.k + kTiledK - 1) / kTiledK);
  const std::int64_t blocks = 2 * static_cast<std::int64_t>(kda::detail::current_device_sm_count());
  auto partial_bytes = [&](int splits) {
    return static_cast<std::uint64_t>(splits) * static_cast<std::uint64_t>(p.rows * p.n) * 4;
  };
  while (2 * plan.splits * static_cast<std::int64_t>(plan.n_blocks) <= blocks &&
         plan.k_tiles / (2 * plan.splits) >= 4 && p.workspace != nullptr &&
         partial_bytes(2 * plan.splits) <= p.workspace_bytes) {
    plan.splits *= 2;
  }
  return plan;
}

template <int MT, bool kOutF32>
cudaError_t launch_tiled_mt(const SmallGemmParams& p, const TiledPlan& plan,
                            cudaLaunchConfig_t config) {
  constexpr int kSmem = kTiledStages * (kTiledRows + 8 * MT) * kTiledChunks * 16;
  const cudaError_t raised =
      kda::detail::allow_shared_memory<tiled_gemm_kernel<MT, kOutF32>>(kSmem);
  if (raised != cudaSuccess) return raised;
  config.gridDim = dim3(static_cast<unsigned>(plan.n_blocks), static_cast<unsigned>(plan.splits));
  config.blockDim = dim3(kTiledWarps * 32);
  config.dynamicSmemBytes = kSmem;
  cudaError_t err = cudaLaunchKernelEx(&config, tiled_gemm_kernel<MT, kOutF32>, p, plan);
  if (err != cudaSuccess || plan.splits == 1) return err;
  // The partial sums added: after the tiled kernel, in plain stream order.
  cudaLaunchConfig_t reduce{};
  reduce.stream = config.stream;
  reduce.blockDim = dim3(256);
  reduce.gridDim = dim3(static_cast<unsigned>((p.rows * p.n + 255) / 256));
  return cudaLaunchKernelEx(&reduce, tiled_gemm_reduce_kernel<kOutF32>, p, plan.splits);
}

// The fragment kernel's plan for `p` with RT row tiles a warp: 8 warps a panel (as many as leave
// each a step of K), or SmallGemmParams::split where it forces 1, 2, 4 or 8. On the H200 the most
// warps a panel won on every decode shape at 1-8 rows (kda-gemv-probe's sweep).
FragmentPlan fragment_plan(const SmallGemmParams& p, int rt) {
  FragmentPlan plan;
  plan.steps = static_cast<int>((p.k + 63) / 64);
  plan.panels = static_cast<int>((p.n + 16 * rt - 1) / (16 * rt));
  if (p.split == 1 || p.split == 2 || p.split == 4 || p.split == 8) {
    plan.ksplit = p.split;
  } else {
    while (plan.ksplit < kFragmentWarps && plan.steps >= 2 * plan.ksplit) plan.ksplit *= 2;
  }
  plan.per_part = (plan.steps + plan.ksplit - 1) / plan.ksplit;
  return plan;
}

template <int RT, int kLoads, bool kOutF32>
cudaError_t launch_fragment_variant(const SmallGemmParams& p, cudaLaunchConfig_t config) {
  const FragmentPlan plan = fragment_plan(p, RT);
  const int smem = plan.ksplit > 1 ? kFragmentWarps * RT * 4 * 32 * 4 : 0;  // at most 8 KB
  const int panels_per_block = kFragmentWarps / plan.ksplit;
  config.gridDim =
      dim3(static_cast<unsigned>((plan.panels + panels_per_block - 1) / panels_per_block));
  config.blockDim = dim3(kFragmentWarps * 32);
  config.dynamicSmemBytes = static_cast<std::size_t>(smem);
  return cudaLaunchKernelEx(&config, fragment_gemm_kernel<RT, kLoads, kOutF32>, p, plan);
}

// Two 16-row tiles a warp (8 loads a lane a round) where the weights have three panels of 16 rows
// a multiprocessor or more, else one (16 loads a lane). kda-gemv-probe's sweep on the H200 at 8
// rows: two tiles were best for H = 32's input projection and K3's TP8 o_proj, one for the TP8
// shard's GEMMs (with 8 loads 0.05-0.12 us faster than 16 in one run, 16 best in another).
// SmallGemmParams::fragment_row_tiles / fragment_loads force either.
template <bool kOutF32>
cudaError_t launch_fragment(const SmallGemmParams& p, const cudaLaunchConfig_t& config) {
  const std::int64_t sms = kda::detail::current_device_sm_count();
  int rt = p.n >= 16 * 3 * sms ? 2 : 1;
  if (p.fragment_row_tiles == 1 || p.fragment_row_tiles == 2) rt = p.fragment_row_tiles;
  int loads = rt == 2 ? 8 : 16;
  if (p.fragment_loads == 8 || p.fragment_loads == 16) loads = p.fragment_loads;
  if (rt == 1) {
    return loads == 8 ? launch_fragment_variant<1, 8, kOutF32>(p, config)
                      : launch_fragment_variant<1, 16, kOutF32>(p, config);
  }
  return loads == 8 ? launch_fragment_variant<2, 8, kOutF32>(p, config)
                    : launch_fragment_variant<2, 16, kOutF32>(p, config);
}

template <bool kOutF32>
cudaError_t launch_tiled(const SmallGemmParams& p, const TiledPlan& plan,
                         const cudaLaunchConfig_t& config) {
  switch (plan.m_tiles) {
    case 1:
      return launch_tiled_mt<1, kOutF32>(p, plan, config);
    case 2:
      return launch_tiled_mt<2, kOutF32>(p, plan, config);
    case 4:
      return launch_tiled_mt<4, kOutF32>(p, plan, config);
    default:
      return launch_tiled_mt<8, kOutF32>(p, plan, config);
  }
}

}  // namespace

// The operands of the tiled, fragment and warpgroup kernels (kernels.hpp): 1..max_rows rows, k a
// multiple of 8 up to 2^30, ldi a multiple of 8 and >= k, ldo >= n, in and weight 16-byte aligned,
// out aligned to its element.
bool few_row_operands_fit(const SmallGemmParams& p, std::int64_t max_rows) {
  const auto aligned = [](const void* ptr, std::uintptr_t bytes) {
    return (reinterpret_cast<std::uintptr_t>(ptr) & (bytes - 1)) == 0;
  };
  return p.rows >= 1 && p.rows <= max_rows && p.n >= 1 && p.k >= 8 && p.k % 8 == 0 &&
         p.k <= (std::int64_t{1} << 30) && p.ldi % 8 == 0 && p.ldi >= p.k && p.ldo >= p.n &&
         aligned(p.in, 16) && aligned(p.weight, 16) && aligned(p.out, p.out_f32 ? 4 : 2) &&
         p.n <= (std::int64_t{1} << 30);
}

bool tiled_gemm_fits(const SmallGemmParams& p) {
  return few_row_operands_fit(p, kTiledGemmMaxRows) &&
         (reinterpret_cast<std::uintptr_t>(p.workspace) & 3) == 0 &&
         (p.n + kTiledRows - 1) / kTiledRows <= 0x7fffffff;
}

bool fragment_gemm_fits(const SmallGemmParams& p) {
  return few_row_operands_fit(p, kFragmentGemmMaxRows);
}

bool streamed_gemm_fits(const SmallGemmParams& p) {
  return small_gemm_fits(p) && stream_plan(p).rows_per_stage > 0;
}

cudaError_t launch_small_gemm(const SmallGemmParams& p, cudaStream_t stream) {
  if (p.kernel == SmallGemmKernel::kWarpgroup) return launch_warpgroup_gemm(p, stream);
  const bool fits = p.kernel == SmallGemmKernel::kTiled      ? tiled_gemm_fits(p)
                    : p.kernel == SmallGemmKernel::kFragment ? fragment_gemm_fits(p)
                                                             : small_gemm_fits(p);
  if (!fits) {
    return cudaErrorInvalidValue;
  }
  cudaLaunchConfig_t config{};
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (p.programmatic) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  if (p.kernel == SmallGemmKernel::kFragment) {
    return p.out_f32 ? launch_fragment<true>(p, config) : launch_fragment<false>(p, config);
  }
  if (p.kernel == SmallGemmKernel::kTiled) {
    const TiledPlan plan = tiled_plan(p);
    return p.out_f32 ? launch_tiled<true>(p, plan, config) : launch_tiled<false>(p, plan, config);
  }
  if (p.kernel == SmallGemmKernel::kStreamed) {
    const StreamPlan plan = stream_plan(p);
    if (plan.rows_per_stage == 0) return cudaErrorInvalidValue;
    return p.out_f32 ? launch_streamed<true>(p, plan, config)
                     : launch_streamed<false>(p, plan, config);
  }
  const int split =
      p.split == 1 || p.split == 2 || p.split == 4 || p.split == 8 ? p.split : split_of(p);
  const int rows_per_block = kWarpsPerBlock / split;
  config.gridDim = dim3(static_cast<unsigned>((p.n + rows_per_block - 1) / rows_per_block));
  config.blockDim = dim3(kWarpsPerBlock * 32);
  return p.out_f32 ? cudaLaunchKernelEx(&config, sliced_gemm_kernel<true>, p, split)
                   : cudaLaunchKernelEx(&config, sliced_gemm_kernel<false>, p, split);
}

}  // namespace kda::layer::cuda
