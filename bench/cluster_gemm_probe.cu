// kda-cluster-gemm-probe: GEMMs of 9 to 64 rows (a decode step of a batch) on kernels of the
// fragment kind (layer/src/cuda/small_gemm.cu), against cuBLAS, on the decode shapes
// (decode_gemm_shapes.hpp). Not part of the library: the measurements that decide whether such a
// kernel should take these GEMMs from cuBLAS, whose grids leave multiprocessors idle there
// (docs/design/layer.md, "What was learned"). Two kernels, the same plan and reduction:
//   - mma.sync: each lane reads its 16 bytes of every 8-row input tile from shared memory and
//     issues two MMAs a tile (measured on the H200: correct, slower than cuBLAS on every shape);
//   - wgmma: the weights' fragments feed wgmma.m64nNk16 from registers, the input its B operand
//     from shared memory (measured on the H200: correct, slower than both).
// 1. Check: each kernel at 16, 33 and 64 rows against an fp64 product of the same bf16 operands at
//    sampled weight rows (bf16 out), relative L2 error; exit status 1 if one is above 4e-3 or a
//    launch fails.
// 2. Chain, as a decode step runs them (kda-gemv-probe's third table): 50 pairs of (a one-block
//    kernel that writes the input's first row, the GEMM) in one CUDA graph, each GEMM on another
//    copy of the weights (copies beyond three times L2), the pair's time less the writer's alone;
//    median of 5 replays after 2; us and TB/s of weight bytes.
// CUDA only.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/ptx.cuh"            // mma, wgmma, clusters, griddepcontrol (kda/src/cuda)
#include "cuda/shared_memory.cuh"  // allow_shared_memory (kda/src/cuda)
#include "cuda/weight_rows.cuh"    // load_streaming (layer/src/cuda)
#include "decode_gemm_shapes.hpp"
#include "gemm_chain.cuh"

namespace {

namespace d = kda::detail;

using kda_bench::check;

int sm_count() {
  static const int sms = [] {
    int n = 0;
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0), "SM count");
    return n;
  }();
  return sms;
}

// out[rows, n] (row stride ldo) = in[rows, k] (row stride ldi) · weight[n, k]ᵀ, bf16 operands,
// fp32 sums, bf16 or f32 out.
struct GemmArgs {
  const std::uint16_t* in = nullptr;
  std::int64_t ldi = 0;
  const std::uint16_t* weight = nullptr;
  void* out = nullptr;
  std::int64_t ldo = 0;
  bool out_f32 = false;
  std::int64_t rows = 0, n = 0, k = 0;
  bool programmatic = false;
  bool wgmma = false;  // the wgmma kernel, else the mma.sync one
};

template <bool kOutF32>
__device__ __forceinline__ void store_out(void* out, std::int64_t n, float sum) {
  if constexpr (kOutF32) {
    static_cast<float*>(out)[n] = sum;
  } else {
    static_cast<std::uint16_t*>(out)[n] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
  }
}

using d::griddep_launch_dependents;
using d::griddep_wait;
using kda::detail::allow_shared_memory;
using kda::layer::cuda::load_streaming;

// ---- the mma.sync kernel -----------------------------------------------------------------------
// The fragment kernel's weight loads (straight into mma.m16n8k16's A fragments, K permuted alike
// in both operands) for steps of 9 to 64 rows, where the fragment kernel would read the input once
// per 8-row tile from L2. Here a block's warps (16 weight rows each) share one range of K, whose
// input rows the block copies into shared memory once (rows padded by 16 bytes: each
// quarter-warp's 16-byte reads fall on distinct banks); a lane reads its 16 bytes of every 8-row
// tile of input from there, NT tiles. Where the weights have few rows, K is split between the
// blocks of a thread block cluster (up to 8), which add their partial sums through distributed
// shared memory in rank order: deterministic, no workspace, no second launch. The plan (warps a
// block, blocks a cluster) fills one wave of blocks, one a multiprocessor, as fully as it can.

constexpr int kWideMaxWarps = 16;
constexpr int kWideSteps = 2;  // 64-column steps a round: 8 16-byte weight loads a lane in flight

struct WidePlan {
  int warps = 0;       // a block's warps, 16 weight rows each (0: no plan)
  int ksplit = 1;      // blocks a cluster, each a range of K
  int steps = 0;       // 64-column steps of K
  int per_part = 0;    // steps a block
  int row_blocks = 0;  // blocks of 16 x warps weight rows
  int x_pitch = 0;     // bytes of a staged input row: its range of K and 16 of padding
  int smem = 0;
};

// Lane (g, q)'s weights: rows g and g + 8 of its warp's 16-row tile from n0 (past N, zeros), and
// of each 64-column step its two 16-byte chunks 2 q + c (past K or s_end, zeros).
struct WarpWeights {
  const uint4* row[2];
  bool ok[2];
  std::int64_t chunks;
  int q, s_end;
  __device__ __forceinline__ WarpWeights(const GemmArgs& p, std::int64_t n0, int lane, int end)
      : chunks(p.k / 8), q(lane % 4), s_end(end) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t n = n0 + 8 * h + lane / 4;
      ok[h] = n < p.n;
      row[h] = reinterpret_cast<const uint4*>(p.weight + (ok[h] ? n : 0) * p.k);
    }
  }
  // Steps [s0, s0 + kWideSteps) into buf[step][half][chunk].
  __device__ __forceinline__ void load(uint4 (&buf)[kWideSteps][2][2], int s0) const {
#pragma unroll
    for (int u = 0; u < kWideSteps; ++u) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const std::int64_t chunk = static_cast<std::int64_t>(s0 + u) * 8 + 2 * q + c;
        const bool in_k = s0 + u < s_end && chunk < chunks;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          buf[u][h][c] = in_k && ok[h] ? load_streaming(row[h] + chunk) : make_uint4(0, 0, 0, 0);
        }
      }
    }
  }
};

// The cluster fragment kernels' end: acc[t][j] (weight row n0 + g, + 8 for j >= 2; input row
// 8 t + 2 q + j % 2) stored, after the cluster's parts are added in rank order where K is split:
// warp w's sums belong to the block of rank w % ksplit, into whose shared memory (`staged`, free
// once every block is past the cluster's barrier) every block stores its part of them (remote
// stores, which do not wait); the owner adds the parts from its own shared memory after the next.
template <int NT, bool kOutF32>
__device__ __forceinline__ void wide_reduce_store(const GemmArgs& p, const WidePlan& plan,
                                                  float (&acc)[NT][4], unsigned char* staged,
                                                  int warp, int lane, int part, std::int64_t n0) {
  const int g = lane / 4, q = lane % 4;
  auto store = [&] {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t n = n0 + g + (j >= 2 ? 8 : 0);
        const std::int64_t m = 8 * t + 2 * q + j % 2;
        if (n < p.n && m < p.rows) store_out<kOutF32>(p.out, m * p.ldo + n, acc[t][j]);
      }
    }
  };
  if (plan.ksplit == 1) {
    store();
    return;
  }
  float* partials = reinterpret_cast<float*>(staged);  // [warps / ksplit][ksplit][NT][4][32]
  d::cluster_sync();
  const unsigned owner = static_cast<unsigned>(warp % plan.ksplit);
  const int slot = warp / plan.ksplit;
  auto at = [&](int from, int t, int j) {
    return partials + (((slot * plan.ksplit + from) * NT + t) * 4 + j) * 32 + lane;
  };
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) d::store_shared_cluster(at(part, t, j), owner, acc[t][j]);
  }
  d::cluster_sync();
  if (static_cast<int>(owner) != part) return;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float sum = 0.0f;
      for (int from = 0; from < plan.ksplit; ++from) sum += *at(from, t, j);
      acc[t][j] = sum;
    }
  }
  store();
}

template <int NT, bool kOutF32>
__global__ void __launch_bounds__(kWideMaxWarps * 32, 1)
    wide_fragment_gemm_kernel(GemmArgs p, WidePlan plan) {
  extern __shared__ __align__(16) unsigned char staged[];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int g = lane / 4, q = lane % 4;
  const int part = static_cast<int>(blockIdx.x) % plan.ksplit;  // the block's rank in its cluster
  const std::int64_t row_block = blockIdx.x / plan.ksplit;
  const int s_begin = part * plan.per_part;
  const int s_end = min(plan.steps, s_begin + plan.per_part);
  const std::int64_t n0 = (row_block * plan.warps + warp) * 16;
  griddep_launch_dependents();
  const WarpWeights weights(p, n0, lane, s_end);
  const std::int64_t chunks = p.k / 8;
  uint4 w[kWideSteps][2][2];  // [step][half][chunk]
  auto load_round = [&](int s0) { weights.load(w, s0); };
  if (s_begin < s_end) load_round(s_begin);
  griddep_wait();
  // The input's rows [0, 8 NT) over the block's steps, zeros past the rows and past K: every
  // copy in flight at once (cp.async), then one wait.
  const int cols16 = (s_end - s_begin) * 8;
  for (int i = static_cast<int>(threadIdx.x); i < 8 * NT * cols16;
       i += static_cast<int>(blockDim.x)) {
    const int r = i / cols16, c16 = i % cols16;
    const std::int64_t chunk = static_cast<std::int64_t>(s_begin) * 8 + c16;
    const bool valid = r < p.rows && chunk < chunks;
    d::cp_async_16_or_zero(
        staged + r * plan.x_pitch + c16 * 16,
        reinterpret_cast<const uint4*>(p.in + (valid ? r * p.ldi : 0)) + (valid ? chunk : 0),
        valid);
  }
  d::cp_async_commit();
  d::cp_async_wait<0>();
  __syncthreads();
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.0f;
  }
  for (int s0 = s_begin; s0 < s_end; s0 += kWideSteps) {
    if (s0 != s_begin) load_round(s0);
#pragma unroll
    for (int u = 0; u < kWideSteps; ++u) {
      if (s0 + u >= s_end) break;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int c16 = (s0 + u - s_begin) * 8 + 2 * q + c;
        const unsigned a0[4] = {w[u][0][c].x, w[u][1][c].x, w[u][0][c].y, w[u][1][c].y};
        const unsigned a1[4] = {w[u][0][c].z, w[u][1][c].z, w[u][0][c].w, w[u][1][c].w};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const uint4 xv =
              *reinterpret_cast<const uint4*>(staged + (8 * t + g) * plan.x_pitch + c16 * 16);
          d::mma_bf16(acc[t], a0, xv.x, xv.y);
          d::mma_bf16(acc[t], a1, xv.z, xv.w);
        }
      }
    }
  }
  wide_reduce_store<NT, kOutF32>(p, plan, acc, staged, warp, lane, part, n0);
}

// The cluster fragment kernel on wgmma (GemmArgs::wgmma). wgmma takes its A operand
// from registers in mma.sync's m16k16 fragment layout, a warp 16 of a warpgroup's 64 weight rows,
// so the weight loads above feed it as they are; its B operand, the 8 NT input rows of a 16-column
// step, it reads itself from shared memory, where the block stages the input in the loads' K order
// (K-major, 128-byte swizzle: a 64-column step of the loads is 8 NT rows of 128 bytes). Its
// accumulators have mma.sync's C layout per warp, NT m16n8 tiles: acc[4 t + j] is acc[t][j] above.
// The weights of the next round load into the other of two register buffers while the tensor
// cores work on this one.
//
// Where a load's 16 bytes (physical columns 8 (2 q + c) .. + 7 of a step) go: the mma using words
// (2 h, 2 h + 1) of chunk c is the step's k16 step 2 c + h, whose logical columns 2 q, 2 q + 1 hold
// word 2 h and 2 q + 8, 2 q + 9 word 2 h + 1: logical column 16 (2 c + h) + 8 hi + 2 q of the step
// is word 2 h + hi of that chunk.
__device__ __forceinline__ int wgmma_x_offset(int row, int logical) {  // bytes in a step's block
  return row * 128 + ((((logical / 8) % 8) ^ (row % 8)) * 16) + (logical % 8) * 2;
}

template <int NT, bool kOutF32>
__global__ void __launch_bounds__(kWideMaxWarps * 32, 1)
    wgmma_fragment_gemm_kernel(GemmArgs p, WidePlan plan) {
  extern __shared__ __align__(16) unsigned char raw[];
  // 1024-byte aligned: the swizzle atoms' alignment (the plan's smem has the slack).
  unsigned char* staged = raw + ((1024u - (d::smem_addr(raw) & 1023u)) & 1023u);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int part = static_cast<int>(blockIdx.x) % plan.ksplit;
  const std::int64_t row_block = blockIdx.x / plan.ksplit;
  const int s_begin = part * plan.per_part;
  const int s_end = min(plan.steps, s_begin + plan.per_part);
  const std::int64_t n0 = (row_block * plan.warps + warp) * 16;
  constexpr int kBlockBytes = 8 * NT * 128;  // one 64-column step of the staged input
  griddep_launch_dependents();
  const WarpWeights weights(p, n0, lane, s_end);
  const std::int64_t chunks = p.k / 8;
  uint4 w[2][kWideSteps][2][2];  // [buffer][step][half][chunk]
  auto load_round = [&](uint4(&buf)[kWideSteps][2][2], int s0) { weights.load(buf, s0); };
  if (s_begin < s_end) load_round(w[0], s_begin);
  griddep_wait();
  // The input staged: each thread eight 16-byte chunks in flight, then their words placed.
  const int per_step = 8 * NT * 8;  // chunks of a step: rows x 8
  const int total = (s_end - s_begin) * per_step;
  for (int i0 = static_cast<int>(threadIdx.x); i0 < total; i0 += 8 * static_cast<int>(blockDim.x)) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * static_cast<int>(blockDim.x);
      const int step = i / per_step, r = (i % per_step) / 8, cc = i % 8;
      const std::int64_t chunk = static_cast<std::int64_t>(s_begin + step) * 8 + cc;
      v[u] = i < total && r < p.rows && chunk < chunks
                 ? __ldg(reinterpret_cast<const uint4*>(p.in + r * p.ldi) + chunk)
                 : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * static_cast<int>(blockDim.x);
      if (i >= total) break;
      const int step = i / per_step, r = (i % per_step) / 8, cc = i % 8;
      const int cq = cc / 2, c = cc % 2;  // the chunk's lane q and c
      unsigned char* block = staged + step * kBlockBytes;
      const unsigned words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
      for (int word = 0; word < 4; ++word) {
        const int h = word / 2, hi = word % 2;
        *reinterpret_cast<unsigned*>(
            block + wgmma_x_offset(r, 16 * (2 * c + h) + 8 * hi + 2 * cq)) = words[word];
      }
    }
  }
  d::fence_proxy_async();  // generic stores, then wgmma's reads
  __syncthreads();

  float acc[4 * NT];
#pragma unroll
  for (int i = 0; i < 4 * NT; ++i) acc[i] = 0.0f;
  auto mma_round = [&](const uint4(&buf)[kWideSteps][2][2], int s0) {
    d::wgmma_fence_operands(acc);
    d::wgmma_fence();
#pragma unroll
    for (int u = 0; u < kWideSteps; ++u) {
      if (s0 + u >= s_end) break;
      const unsigned char* block = staged + (s0 + u - s_begin) * kBlockBytes;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned a[4] = {
              h == 0 ? buf[u][0][c].x : buf[u][0][c].z, h == 0 ? buf[u][1][c].x : buf[u][1][c].z,
              h == 0 ? buf[u][0][c].y : buf[u][0][c].w, h == 0 ? buf[u][1][c].y : buf[u][1][c].w};
          const std::uint64_t desc =
              d::wgmma_desc(block + (2 * c + h) * 32, 16, 1024, d::WgmmaSwizzle::k128B);
          if constexpr (NT == 2) {
            d::wgmma_m64n16k16<1>(reinterpret_cast<float(&)[8]>(acc), a, desc);
          } else if constexpr (NT == 4) {
            d::wgmma_m64n32k16(reinterpret_cast<float(&)[16]>(acc), a, desc);
          } else {
            d::wgmma_m64n64k16(reinterpret_cast<float(&)[32]>(acc), a, desc);
          }
        }
      }
    }
    d::wgmma_commit();
  };
  // Two buffers: round r's MMAs run while round r + 1's weights load.
  for (int s0 = s_begin; s0 < s_end; s0 += 2 * kWideSteps) {
    if (s0 + kWideSteps < s_end) load_round(w[1], s0 + kWideSteps);
    mma_round(w[0], s0);
    d::wgmma_wait<0>();
    d::wgmma_fence_operands(acc);
    if (s0 + kWideSteps >= s_end) break;
    if (s0 + 2 * kWideSteps < s_end) load_round(w[0], s0 + 2 * kWideSteps);
    mma_round(w[1], s0 + kWideSteps);
    d::wgmma_wait<0>();
    d::wgmma_fence_operands(acc);
  }
  float tiles[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) tiles[t][j] = acc[4 * t + j];
  }
  wide_reduce_store<NT, kOutF32>(p, plan, tiles, staged, warp, lane, part, n0);
}

// The cluster fragment kernel's 8-row input tiles for `rows`: 2, 4 or 8.
int wide_tiles(std::int64_t rows) { return rows <= 16 ? 2 : rows <= 32 ? 4 : 8; }

// Clusters of `ksplit` blocks of the widest plan (one a multiprocessor) the device holds at once,
// asked once a device and cluster size.
int wide_resident_clusters(int ksplit) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices][9] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const int slot = ksplit;
  if (device >= 0 && device < kMaxDevices && cached[device][slot].load() > 0) {
    return cached[device][slot].load();
  }
  constexpr auto kernel = wide_fragment_gemm_kernel<8, false>;
  constexpr int kSmem = 200 << 10;  // enough to keep one block a multiprocessor
  if (allow_shared_memory<kernel>(kSmem) != cudaSuccess) return 0;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(ksplit));
  config.blockDim = dim3(kWideMaxWarps * 32);
  config.dynamicSmemBytes = kSmem;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(ksplit);
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (device >= 0 && device < kMaxDevices) cached[device][slot].store(clusters);
  return clusters;
}

// The cluster fragment kernel's plan for `p`: of 8-16 warps a block and 1-8 blocks a cluster (each
// at least two steps of K, the staged input within shared memory), the one whose
// grid is the largest single wave (one block a multiprocessor, clusters as many as fit); ties go to
// fewer blocks a cluster, then more warps. None (warps 0) where no plan fills half the device.
WidePlan wide_plan(const GemmArgs& p) {
  WidePlan best;
  const int sms = sm_count();
  const int rows = 8 * wide_tiles(p.rows);
  const int steps = static_cast<int>((p.k + 63) / 64);
  std::int64_t best_blocks = 0;
  for (int ksplit = 1; ksplit <= 8; ++ksplit) {
    const int per_part = (steps + ksplit - 1) / ksplit;
    if (ksplit > 1 && per_part < 2) break;
    const int pitch = per_part * 128 + 16;
    const std::int64_t resident =
        ksplit == 1 ? sms : static_cast<std::int64_t>(wide_resident_clusters(ksplit)) * ksplit;
    for (int warps = kWideMaxWarps; warps >= 8; --warps) {
      if (p.wgmma && warps % 4 != 0) continue;          // whole warpgroups
      const int owned = (warps + ksplit - 1) / ksplit;  // warps a block adds the parts of
      const int staged = p.wgmma ? per_part * rows * 128 + 1024 : rows * pitch;
      const int smem = std::max(staged, ksplit > 1 ? owned * ksplit * rows / 8 * 512 + 1024 : 0);
      if (smem > (227 << 10)) continue;
      const std::int64_t row_blocks = (p.n + 16 * warps - 1) / (16 * warps);
      const std::int64_t blocks = row_blocks * ksplit;
      if (blocks > resident || blocks <= best_blocks) continue;
      best_blocks = blocks;
      best = WidePlan{warps, ksplit, steps, per_part, static_cast<int>(row_blocks), pitch, smem};
    }
  }
  if (2 * best_blocks < sms) best.warps = 0;
  return best;
}

template <int NT, bool kOutF32>
cudaError_t launch_wide_tiles(const GemmArgs& p, const WidePlan& plan, cudaLaunchConfig_t config) {
  constexpr auto kernel = wide_fragment_gemm_kernel<NT, kOutF32>;
  constexpr auto wgmma_kernel = wgmma_fragment_gemm_kernel<NT, kOutF32>;
  cudaError_t raised = allow_shared_memory<kernel>(227 << 10);
  if (raised == cudaSuccess) raised = allow_shared_memory<wgmma_kernel>(227 << 10);
  if (raised != cudaSuccess) return raised;
  cudaLaunchAttribute attributes[2] = {};
  int count = 0;
  if (config.numAttrs > 0) attributes[count++] = config.attrs[0];  // programmatic
  attributes[count].id = cudaLaunchAttributeClusterDimension;
  attributes[count].val.clusterDim.x = static_cast<unsigned>(plan.ksplit);
  attributes[count].val.clusterDim.y = attributes[count].val.clusterDim.z = 1;
  ++count;
  config.attrs = attributes;
  config.numAttrs = static_cast<unsigned>(count);
  config.gridDim = dim3(static_cast<unsigned>(plan.row_blocks * plan.ksplit));
  config.blockDim = dim3(static_cast<unsigned>(plan.warps * 32));
  config.dynamicSmemBytes = static_cast<std::size_t>(plan.smem);
  return p.wgmma ? cudaLaunchKernelEx(&config, wgmma_kernel, p, plan)
                 : cudaLaunchKernelEx(&config, kernel, p, plan);
}

template <bool kOutF32>
cudaError_t launch_wide(const GemmArgs& p, const WidePlan& plan, const cudaLaunchConfig_t& config) {
  switch (wide_tiles(p.rows)) {
    case 2:
      return launch_wide_tiles<2, kOutF32>(p, plan, config);
    case 4:
      return launch_wide_tiles<4, kOutF32>(p, plan, config);
    default:
      return launch_wide_tiles<8, kOutF32>(p, plan, config);
  }
}

cudaError_t launch_gemm(const GemmArgs& p, cudaStream_t stream) {
  const WidePlan plan = wide_plan(p);
  if (plan.warps == 0) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config{};
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (p.programmatic) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return p.out_f32 ? launch_wide<true>(p, plan, config) : launch_wide<false>(p, plan, config);
}

// `rows` rows of shape `s`: in [rows, k], weight [n, k], bf16 out [rows, n], rows packed.
GemmArgs args_of(const kda_bench::DecodeGemmShape& s, const void* in, const void* weight, void* out,
                 std::int64_t rows, bool wgmma) {
  GemmArgs p;
  p.in = static_cast<const std::uint16_t*>(in);
  p.ldi = s.k;
  p.weight = static_cast<const std::uint16_t*>(weight);
  p.out = out;
  p.ldo = s.n;
  p.rows = rows;
  p.n = s.n;
  p.k = s.k;
  p.wgmma = wgmma;
  return p;
}

std::vector<std::uint16_t> random_bits(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::uint16_t> v(count);
  for (auto& x : v) {
    const __nv_bfloat16 b = __float2bfloat16_rn(dist(rng));
    x = *reinterpret_cast<const std::uint16_t*>(&b);
  }
  return v;
}

double to_double(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  cudaStream_t stream = nullptr;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cublasSetStream(handle, stream);
  constexpr std::size_t kWorkspace = std::size_t{32} << 20;
  void* workspace = nullptr;
  check(cudaMalloc(&workspace, kWorkspace), "cudaMalloc");
  cublasSetWorkspace(handle, workspace, kWorkspace);
  const char* kernel_names[2] = {"mma.sync", "wgmma"};

  // 1. Check against fp64.
  std::printf("device: %s\n\n| shape | rows | kernel | relative error |\n|---|---:|---|---:|\n",
              prop.name);
  bool ok = true;
  std::uint64_t seed = 1;
  for (const auto& s : kda_bench::kDecodeGemmShapes) {
    const std::vector<std::uint16_t> w = random_bits(static_cast<std::size_t>(s.n * s.k), ++seed);
    const std::vector<std::uint16_t> x = random_bits(static_cast<std::size_t>(64 * s.k), ++seed);
    void *dw = nullptr, *dx = nullptr, *dout = nullptr;
    check(cudaMalloc(&dw, w.size() * 2), "cudaMalloc");
    check(cudaMalloc(&dx, x.size() * 2), "cudaMalloc");
    check(cudaMalloc(&dout, static_cast<std::size_t>(64 * s.n) * 2), "cudaMalloc");
    check(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice), "upload");
    check(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "upload");
    for (const std::int64_t rows : {16, 33, 64}) {
      for (const bool wgmma : {false, true}) {
        const GemmArgs p = args_of(s, dx, dw, dout, rows, wgmma);
        check(cudaMemset(dout, 0xFF, static_cast<std::size_t>(64 * s.n) * 2), "poison");
        const cudaError_t err = launch_gemm(p, stream);
        if (err == cudaErrorInvalidValue) {
          std::printf("| %s | %lld | %s | no plan |\n", s.name, static_cast<long long>(rows),
                      kernel_names[wgmma]);
          continue;
        }
        check(err, "launch");
        check(cudaStreamSynchronize(stream), kernel_names[wgmma]);
        std::vector<std::uint16_t> out(static_cast<std::size_t>(rows * s.n));
        check(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost), "download");
        double num = 0.0, den = 0.0;
        for (std::int64_t r = 0; r < s.n; r += 37) {
          for (std::int64_t m = 0; m < rows; ++m) {
            double ref = 0.0;
            for (std::int64_t c = 0; c < s.k; ++c) {
              ref += to_double(w[static_cast<std::size_t>(r * s.k + c)]) *
                     to_double(x[static_cast<std::size_t>(m * s.k + c)]);
            }
            const double got = to_double(out[static_cast<std::size_t>(m * s.n + r)]);
            num += (got - ref) * (got - ref);
            den += ref * ref;
          }
        }
        const double rel = std::sqrt(num / den);  // NaN (a row not written) fails too
        const bool good = rel <= 4e-3;
        ok = ok && good;
        std::printf("| %s | %lld | %s | %.2e%s |\n", s.name, static_cast<long long>(rows),
                    kernel_names[wgmma], rel, good ? "" : " FAIL");
      }
    }
    cudaFree(dw);
    cudaFree(dx);
    cudaFree(dout);
  }

  // 2. The chain.
  std::printf(
      "\nIn a chain (after a kernel that writes the input's first row; graph replays), us (TB/s of "
      "weight reads)\n\n| shape | rows | cuBLAS | mma.sync | wgmma |\n|---|---:|---:|---:|---:|\n");
  for (const auto& s : kda_bench::kDecodeGemmShapes) {
    const kda_bench::Operands operands(s, prop);
    const std::size_t bytes = operands.bytes;
    void *in = operands.in, *out = operands.out;
    auto chain_us = [&](auto&& launch, bool with_gemm) {
      return kda_bench::chain_us(stream, in, s.k, operands.weights, launch, with_gemm);
    };
    const double writer = chain_us([](void*) {}, false);
    auto cell = [&](double us) {
      if (us < 0) {
        std::printf(" - |");
      } else {
        std::printf(" %.2f (%.2f) |", us, static_cast<double>(bytes) / us / 1e6);
      }
    };
    for (const std::int64_t rows : {16, 32, 64}) {
      std::printf("| %s | %lld |", s.name, static_cast<long long>(rows));
      cell(chain_us([&](void* w) { kda_bench::cublas_gemm(handle, w, in, out, s, rows); }, true) -
           writer);
      for (const bool wgmma : {false, true}) {
        GemmArgs p = args_of(s, in, nullptr, out, rows, wgmma);
        if (wide_plan(p).warps == 0) {
          cell(-1.0);
          continue;
        }
        cell(chain_us(
                 [&](void* w) {
                   p.weight = static_cast<const std::uint16_t*>(w);
                   check(launch_gemm(p, stream), kernel_names[wgmma]);
                 },
                 true) -
             writer);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  cudaFree(workspace);
  cublasDestroy(handle);
  return ok ? 0 : 1;
}
