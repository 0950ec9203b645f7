// layer/src/cuda/warpgroup_gemm.cu — out[rows, n] = in[rows, k] · weight[n, k]ᵀ for 1 to 256 rows
// on the warpgroup tensor cores (wgmma), its operands brought in by the copy engine's tensor
// copies.
//
// A decode step's GEMMs read far more weight bytes than they do arithmetic, so what counts is how
// many bytes stay in flight and how little each multiprocessor issues for them. The mma.sync
// kernels of small_gemm.cu spend an instruction per 16 bytes (loads, fragments, mma) and were bound
// by issuing (docs/design/layer.md); here one thread issues two tensor copies a stage and each
// consumer warpgroup one wgmma per 16 columns of K, whatever the rows:
//   - A block owns a tile of BN = 64 x C weight rows (C consumer warpgroups, one 64-row slice each)
//     and one of S slices of K; the S blocks of a tile form a thread block cluster.
//   - Its last warp (the producer) streams the tile's weights and the input rows, 64 columns of K
//     a stage ([BN x 64] and [N x 64] bf16, the 128-byte swizzle wgmma reads), through a ring of
//     stages on full / empty mbarriers. Rows past `rows`, weight rows past n and columns past k
//     arrive as zeros.
//   - Each consumer warpgroup runs wgmma.m64nNk16 over its slice, A = its 64 weight rows, B = the N
//     input rows (N: rows rounded up to 8, 16, 32, 64, 128 or 256), into fp32 registers.
//   - The block then writes its [N x BN] sums into its shared memory; after the cluster's barrier
//     block r of the cluster adds the S blocks' sums of its share of the rows, in rank order
//     (through distributed shared memory), and stores them as bf16 or f32. No workspace, no second
//     launch, and the same bits on every run for one plan.
// The plan (C, S) is chosen by shape for the device: the least waves of clusters times the bytes a
// block streams (an input byte from L2 counted half a weight byte from memory), then the fewest
// blocks.
#include <cuda.h>
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>

#include "cuda/cuda_check.hpp"  // current_device_sm_count (kda/src/cuda)
#include "cuda/kernels.hpp"
#include "cuda/ptx.cuh"
#include "cuda/shared_memory.cuh"

namespace kda::layer::cuda {

namespace {

using kda::detail::cluster_rank;
using kda::detail::cluster_sync;
using kda::detail::load_shared_cluster_v4;
using kda::detail::mbarrier_arrive;
using kda::detail::mbarrier_expect_tx;
using kda::detail::mbarrier_init;
using kda::detail::mbarrier_wait;
using kda::detail::tensor_copy_2d_to_shared;
using kda::detail::wgmma_commit;
using kda::detail::wgmma_desc;
using kda::detail::wgmma_fence;
using kda::detail::wgmma_fence_operands;
using kda::detail::wgmma_ss;
using kda::detail::wgmma_wait;
using kda::detail::WgmmaSwizzle;

constexpr int kChunk = 64;              // columns of K a stage (128 bytes: the swizzle's row)
constexpr int kRowBytes = kChunk * 2;   // one row of a stage's box
constexpr int kRingBytes = 192 * 1024;  // the stages' room
constexpr int kMaxStages = 8;
constexpr int kMaxCluster = 8;  // blocks a cluster (K slices): the portable limit

// The [N x BN] fp32 sums a block leaves in shared memory for its cluster: rows BN + 4 floats apart,
// so that the accumulator's writes (eight weight rows by four column pairs a warp) fall on 32
// distinct banks and each row stays 16-byte aligned.
template <int N, int C>
__host__ __device__ constexpr int sums_bytes() {
  return N * (64 * C + 4) * 4;
}
template <int N, int C>
__host__ __device__ constexpr int stage_bytes() {
  return (64 * C + N) * kRowBytes;
}
template <int N, int C>
__host__ __device__ constexpr int stages() {
  return kRingBytes / stage_bytes<N, C>() < kMaxStages ? kRingBytes / stage_bytes<N, C>()
                                                       : kMaxStages;
}
template <int N, int C>
__host__ __device__ constexpr int smem_bytes() {
  // + 1 KB: the ring's start rounded up to the 1024-byte alignment the swizzle needs.
  return (stages<N, C>() * stage_bytes<N, C>() > sums_bytes<N, C>()
              ? stages<N, C>() * stage_bytes<N, C>()
              : sums_bytes<N, C>()) +
         1024;
}

struct WarpgroupArgs {
  void* out = nullptr;
  std::int64_t ldo = 0;
  bool out_f32 = false;
  int rows = 0, n = 0;
  int chunks = 0;  // of K
  int splits = 1;  // the cluster's size
  bool programmatic = false;
};

template <int N, int C>
__global__ void __launch_bounds__(C * 128 + 32, 1)
    warpgroup_gemm_kernel(const __grid_constant__ CUtensorMap weight_map,
                          const __grid_constant__ CUtensorMap in_map, const WarpgroupArgs a) {
  constexpr int BN = 64 * C;
  constexpr int kStages = stages<N, C>();
  constexpr int kStageBytes = stage_bytes<N, C>();
  constexpr int kWeightBytes = BN * kRowBytes;
  // A stage goes back only once the next one's products are issued: one stage would deadlock.
  static_assert(kStages >= 2, "the ring needs two stages");
  extern __shared__ unsigned char smem_raw[];
  __shared__ std::uint64_t full[kStages], empty[kStages];
  unsigned char* ring = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int split = static_cast<int>(blockIdx.x) % a.splits;
  const int tile = static_cast<int>(blockIdx.x) / a.splits;
  const int c0 = static_cast<int>(static_cast<std::int64_t>(a.chunks) * split / a.splits);
  const int c1 = static_cast<int>(static_cast<std::int64_t>(a.chunks) * (split + 1) / a.splits);
  const int count = c1 - c0;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], C);
    }
  }
  __syncthreads();

  float d[N / 2];
  if (warp == 4 * C) {
    // ---- the producer: one thread issues every copy ----
    if (lane == 0) {
      kda::detail::prefetch_tensor_map(&weight_map);
      kda::detail::prefetch_tensor_map(&in_map);
      // The first round of weights before waiting for the kernel before (it may write `in`, never
      // the weights); the input rows after.
      const int first = count < kStages ? count : kStages;
      for (int i = 0; i < first; ++i) {
        unsigned char* stage = ring + i * kStageBytes;
        mbarrier_expect_tx(&full[i], kStageBytes);
        tensor_copy_2d_to_shared(stage, &weight_map, (c0 + i) * kChunk, tile * BN, &full[i]);
      }
      if (a.programmatic) kda::detail::griddep_wait();
      for (int i = 0; i < first; ++i) {
        tensor_copy_2d_to_shared(ring + i * kStageBytes + kWeightBytes, &in_map, (c0 + i) * kChunk,
                                 0, &full[i]);
      }
      for (int i = first; i < count; ++i) {
        const int s = i % kStages;
        mbarrier_wait(&empty[s], static_cast<unsigned>((i / kStages - 1) & 1));
        unsigned char* stage = ring + s * kStageBytes;
        mbarrier_expect_tx(&full[s], kStageBytes);
        tensor_copy_2d_to_shared(stage, &weight_map, (c0 + i) * kChunk, tile * BN, &full[s]);
        tensor_copy_2d_to_shared(stage + kWeightBytes, &in_map, (c0 + i) * kChunk, 0, &full[s]);
      }
    }
  } else {
    // ---- a consumer warpgroup: weight rows 64 g .. 64 g + 63 of the tile ----
    const int g = warp / 4;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) d[j] = 0.0f;
    wgmma_fence_operands(d);
    for (int i = 0; i < count; ++i) {
      const int s = i % kStages;
      mbarrier_wait(&full[s], static_cast<unsigned>((i / kStages) & 1));
      const unsigned char* stage = ring + s * kStageBytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        // 16 columns of K are 32 bytes into each 128-byte row; the swizzle is applied by the
        // hardware from the address bits, so the descriptors advance by plain offsets.
        const std::uint64_t da =
            wgmma_desc(stage + g * 64 * kRowBytes + kk * 32, 16, 1024, WgmmaSwizzle::k128B);
        const std::uint64_t db =
            wgmma_desc(stage + kWeightBytes + kk * 32, 16, 1024, WgmmaSwizzle::k128B);
        wgmma_ss<N>(d, da, db);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the stage before's products are done: its room goes back
      wgmma_fence_operands(d);
      if (i > 0 && tid % 128 == 0) mbarrier_arrive(&empty[(i - 1) % kStages]);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(d);
  }
  if (a.programmatic) kda::detail::griddep_wait();  // before any thread writes `out`
  __syncthreads();  // every stage consumed: the ring's room holds the sums now

  float* sums = reinterpret_cast<float*>(ring);
  constexpr int kSumsStride = BN + 4;
  if (warp < 4 * C) {
    // Accumulator element j of this thread: weight row 16 w + lane / 4 + 8 ((j / 2) % 2) of its
    // warpgroup's slice, input row 8 (j / 4) + 2 (lane % 4) + j % 2.
    const int w = warp % 4, g = warp / 4;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const int row = 8 * (j / 4) + 2 * (lane % 4) + (j % 2);
      const int col = 64 * g + 16 * w + lane / 4 + 8 * ((j / 2) % 2);
      sums[row * kSumsStride + col] = d[j];
    }
  }
  if (a.splits > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  // This block's share of the rows, each row's BN sums four at a time.
  const int rank = a.splits > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int rows = a.rows < N ? a.rows : N;
  const int r0 = rows * rank / a.splits, r1 = rows * (rank + 1) / a.splits;
  const std::int64_t col0 = static_cast<std::int64_t>(tile) * BN;
  const bool vector_out = a.n % 4 == 0 && a.ldo % 4 == 0 &&
                          (reinterpret_cast<std::uintptr_t>(a.out) & (a.out_f32 ? 15u : 7u)) == 0;
  constexpr int kQuads = BN / 4;
  for (int at = tid; at < (r1 - r0) * kQuads; at += blockDim.x) {
    const int row = r0 + at / kQuads, quad = at % kQuads;
    const std::int64_t col = col0 + 4 * quad;
    if (col >= a.n) continue;  // the last tile's columns past n: nothing to read or store
    const float* local = sums + row * kSumsStride + 4 * quad;
    float4 v;
    if (a.splits == 1) {
      v = *reinterpret_cast<const float4*>(local);
    } else {
      v = load_shared_cluster_v4(local, 0);
      for (int r = 1; r < a.splits; ++r) {
        const float4 u = load_shared_cluster_v4(local, static_cast<unsigned>(r));
        v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
      }
    }
    const std::int64_t at_out = row * a.ldo + col;
    const float values[4] = {v.x, v.y, v.z, v.w};
    if (vector_out && col + 4 <= a.n) {
      if (a.out_f32) {
        *reinterpret_cast<float4*>(static_cast<float*>(a.out) + at_out) = v;
      } else {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const unsigned*>(&lo);
        packed.y = *reinterpret_cast<const unsigned*>(&hi);
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + at_out) = packed;
      }
    } else {
      for (int e = 0; e < 4 && col + e < a.n; ++e) {
        if (a.out_f32) {
          static_cast<float*>(a.out)[at_out + e] = values[e];
        } else {
          static_cast<__nv_bfloat16*>(a.out)[at_out + e] = __float2bfloat16_rn(values[e]);
        }
      }
    }
  }
  if (a.splits > 1) cluster_sync();  // the others may still be reading this block's sums
}

// ---- the plan ----

// The kernel's rows a product (N) for `rows`.
int padded_rows(std::int64_t rows) {
  int n = 8;
  while (n < rows) n *= 2;
  return n;
}

template <int N, int C>
constexpr bool instantiated() {
  // Registers: the accumulators (N / 2 a thread) within what C + 1 warpgroups' threads may hold
  // at one block a multiprocessor; the sums within the shared memory.
  return (N <= 64 || (N == 128 && C <= 3) || (N == 256 && C <= 2)) &&
         smem_bytes<N, C>() <= 227 * 1024;
}

using KernelFn = void (*)(CUtensorMap, CUtensorMap, WarpgroupArgs);

// One compiled kernel: its function, its dynamic shared memory, and the once-a-device raise of its
// shared-memory limit (allow_shared_memory keys that on the kernel).
struct Variant {
  KernelFn fn = nullptr;
  int smem = 0;
  cudaError_t (*allow)() = nullptr;
};

template <int N, int C>
Variant variant_of() {
  if constexpr (instantiated<N, C>()) {
    return {
        warpgroup_gemm_kernel<N, C>, smem_bytes<N, C>(), [] {
          return kda::detail::allow_shared_memory<warpgroup_gemm_kernel<N, C>>(smem_bytes<N, C>());
        }};
  } else {
    return {};
  }
}

template <int N>
Variant variant_for_c(int c) {
  switch (c) {
    case 1:
      return variant_of<N, 1>();
    case 2:
      return variant_of<N, 2>();
    case 3:
      return variant_of<N, 3>();
    default:
      return variant_of<N, 4>();
  }
}

Variant variant_for(int n_rows, int c) {
  switch (n_rows) {
    case 8:
      return variant_for_c<8>(c);
    case 16:
      return variant_for_c<16>(c);
    case 32:
      return variant_for_c<32>(c);
    case 64:
      return variant_for_c<64>(c);
    case 128:
      return variant_for_c<128>(c);
    default:
      return variant_for_c<256>(c);
  }
}

// How many clusters of `splits` blocks of kernel (n_rows, c) the current device holds at once,
// looked up once a device and kernel (0 where the kernel or the cluster cannot run).
int cluster_capacity(int n_rows, int c, int splits) {
  constexpr int kMaxDevices = 64;
  // [device][log2(N / 8)][C - 1][splits - 1]: the capacity plus one; 0, not looked up yet.
  static std::atomic<int> table[kMaxDevices][6][4][kMaxCluster] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  int log = 0;
  while ((8 << log) < n_rows) ++log;
  std::atomic<int>& slot = table[device][log][c - 1][splits - 1];
  const int known = slot.load(std::memory_order_acquire);
  if (known > 0) return known - 1;
  int clusters = 0;
  const Variant v = variant_for(n_rows, c);
  if (v.fn == nullptr) return 0;
  cudaError_t err = v.allow();
  if (err == cudaSuccess && splits == 1) {
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.fn, c * 128 + 32,
                                                        static_cast<std::size_t>(v.smem));
    clusters = per_sm * kda::detail::current_device_sm_count();
  } else if (err == cudaSuccess) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(splits * kda::detail::current_device_sm_count()));
    config.blockDim = dim3(static_cast<unsigned>(c * 128 + 32));
    config.dynamicSmemBytes = static_cast<std::size_t>(v.smem);
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(splits);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    err = cudaOccupancyMaxActiveClusters(&clusters, v.fn, &config);
  }
  if (err != cudaSuccess) {
    // This call's own error, cleared; not remembered, so that a later call asks again.
    cudaGetLastError();
    return 0;
  }
  slot.store(clusters + 1, std::memory_order_release);
  return clusters;
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, looked up once (the runtime hands it out; nothing links the
// driver library).
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// The operands the kernel takes, whatever the plan: the few-row kernels' (small_gemm.cu), an input
// row stride within the tensor map's limit (strides below 2^40 bytes), and the driver's encoder.
bool operands_fit(const SmallGemmParams& p) {
  return few_row_operands_fit(p, kWarpgroupGemmMaxRows) && p.ldi < (std::int64_t{1} << 39) &&
         encode_tiled() != nullptr;
}

// A plan the launch can run: some variant, and a grid within its x limit.
bool plan_runs(const WarpgroupGemmPlan& plan) {
  return plan.valid() && plan.tiles <= 0x7fffffff / kMaxCluster;
}

}  // namespace

WarpgroupGemmPlan warpgroup_gemm_plan(const SmallGemmParams& p) {
  WarpgroupGemmPlan best;
  if (p.rows < 1 || p.rows > kWarpgroupGemmMaxRows || p.n < 1 || p.k < 1) return best;
  const int n_rows = padded_rows(p.rows);
  const std::int64_t chunks = (p.k + kChunk - 1) / kChunk;
  double best_cost = 0.0;
  std::int64_t best_blocks = 0;
  const int c_force = p.warpgroup_consumers, s_force = p.warpgroup_splits;
  for (int c = 1; c <= 4; ++c) {
    if (c_force != 0 && c != c_force) continue;
    if (variant_for(n_rows, c).fn == nullptr) continue;
    const std::int64_t tiles = (p.n + 64 * c - 1) / (64 * c);
    for (int s = 1; s <= kMaxCluster && s <= chunks; ++s) {
      if (s_force != 0 && s != s_force) continue;
      const int clusters = cluster_capacity(n_rows, c, s);
      if (clusters <= 0) continue;
      const std::int64_t waves = (tiles + clusters - 1) / clusters;
      const std::int64_t per_block = (chunks + s - 1) / s;
      // Bytes a block streams a wave: its weight rows from memory, the input rows (from L2) at
      // half.
      const double cost = static_cast<double>(waves * per_block) * (64.0 * c + 0.5 * n_rows);
      const std::int64_t blocks = tiles * s;
      if (!best.valid() || cost < best_cost || (cost == best_cost && blocks < best_blocks)) {
        best.consumers = c;
        best.splits = s;
        best.n_rows = n_rows;
        best.tiles = tiles;
        best_cost = cost;
        best_blocks = blocks;
      }
    }
  }
  return best;
}

bool warpgroup_gemm_fits(const SmallGemmParams& p) {
  return operands_fit(p) && plan_runs(warpgroup_gemm_plan(p));
}

namespace {

// A bf16 matrix [rows, cols] (row stride `stride` elements) as boxes of [box_rows x 64] with the
// 128-byte swizzle.
bool encode_bf16_map(CUtensorMap* map, const void* base, std::int64_t rows, std::int64_t cols,
                     std::int64_t stride, int box_rows) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kChunk), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cudaError_t launch_warpgroup_gemm(const SmallGemmParams& p, cudaStream_t stream) {
  if (!operands_fit(p)) return cudaErrorInvalidValue;
  const WarpgroupGemmPlan plan = warpgroup_gemm_plan(p);
  if (!plan_runs(plan)) return cudaErrorInvalidValue;
  CUtensorMap weight_map, in_map;
  if (!encode_bf16_map(&weight_map, p.weight, p.n, p.k, p.k, 64 * plan.consumers) ||
      !encode_bf16_map(&in_map, p.in, p.rows, p.k, p.ldi, plan.n_rows)) {
    return cudaErrorInvalidValue;
  }
  WarpgroupArgs a;
  a.out = p.out;
  a.ldo = p.ldo;
  a.out_f32 = p.out_f32;
  a.rows = static_cast<int>(p.rows);
  a.n = static_cast<int>(p.n);
  a.chunks = static_cast<int>((p.k + kChunk - 1) / kChunk);
  a.splits = plan.splits;
  a.programmatic = p.programmatic;
  const Variant v = variant_for(plan.n_rows, plan.consumers);
  const cudaError_t raised = v.allow();
  if (raised != cudaSuccess) return raised;
  cudaLaunchConfig_t config{};
  config.stream = stream;
  config.gridDim = dim3(static_cast<unsigned>(plan.tiles * plan.splits));
  config.blockDim = dim3(static_cast<unsigned>(plan.consumers * 128 + 32));
  config.dynamicSmemBytes = static_cast<std::size_t>(v.smem);
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (plan.splits > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = static_cast<unsigned>(plan.splits);
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (p.programmatic) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = count > 0 ? attributes : nullptr;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, v.fn, weight_map, in_map, a);
}

}  // namespace kda::layer::cuda
