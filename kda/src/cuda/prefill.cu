// CUDA prefill of KDA for sm_90a: the chunked algorithm of KDA.md §3 in two kernels.
//
// Phase 1, kda_prepare_kernel (token-parallel, one block per (chunk slot, head)): L2 norms, gate
// activation and its in-chunk cumulative sum G, beta sigmoid, the strictly lower triangular A, the
// output mask M, and the forward substitution (I + A) X = diag(beta) [K~ | V]. Every exp() takes a
// difference G_i - G_j <= 0 (never a separate exp(-G)), so the softplus gate cannot overflow however
// strong the decay. It writes one ChunkRecord (workspace_layout.hpp) per (slot, head).
//
// Phase 2, kda_recurrence_kernel (one block per (sequence, head, V-slice), one warp per 16 columns of
// V): the only sequential part. Each warp keeps its 16 x 128 slice of S^T in fp32 registers, laid out
// as mma.sync accumulators, and per chunk computes with bf16 tensor-core products
//     X = S^T W^T,  Y = S^T Q~^T,  U^T = U0^T - X,  O^T = Y + U^T M^T,  S^T = S^T diag(g_last) + U^T K^
// The accumulator layout of S^T is the A-operand layout of the next chunk's products, so the state
// never leaves registers. Columns of V are independent in the delta rule: no inter-warp traffic.
// Chunk records stream through a 5-stage ring in shared memory, one bulk copy (copy engine,
// mbarrier completion) per record.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"
#include "kda/nvtx.hpp"
#include "state_slots.hpp"
#include "tensor_extents.hpp"
#include "workspace_layout.hpp"

namespace kda::detail {
namespace {

constexpr int C = kChunk;      // 16
constexpr int D = kHeadDim;    // 128

struct PrefillParams {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* g;
  const bf16* beta;
  const float* A_log;
  const float* dt_bias;
  SeqIndex seqs;
  int num_heads;
  int gate_mode;
  float lower_bound;
  float scale;
  const void* h0;
  int h0_kind;  // 0 none, 1 bf16, 2 f32
  void* ht;
  int ht_kind;
  bf16* out;
  unsigned char* records;
  std::int64_t num_slots;
  std::uint32_t* status;  // caller's device status word, or null
  // Pooled states (Problem::num_state_slots > 0): sequence s uses pool entry state_slots[s].
  const std::int32_t* state_slots;  // null: sequence s uses state s
  std::int64_t num_state_slots;
  // Segments (workspace_layout.hpp): chunks per segment (kNoSplit: one segment per sequence) and
  // the fp32 segment blocks (null without a split).
  std::int64_t seg_chunks;
  float* seg_blocks;
};

// seg_chunks of a plan that does not split: one segment holds any sequence, and seg_slot == s.
constexpr std::int64_t kNoSplit = std::int64_t{1} << 40;

__device__ __forceinline__ unsigned char* record_ptr(const PrefillParams& p, std::int64_t slot, int h) {
  return p.records + (slot * p.num_heads + h) * static_cast<std::int64_t>(ChunkRecord::kBytes);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core and copy helpers
// ---------------------------------------------------------------------------------------------
constexpr int kRowPad = kRowStride;  // bf16 row stride in shared memory (and in the records): 272
                                     // bytes, so that ldmatrix's 8 row addresses fall in distinct
                                     // 16-byte bank groups
constexpr int kMPad = kMStride;      // 48-byte rows for 16 x 16 tiles

// The copy engine (cp.async.bulk, plain sm_90) and its mbarriers.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's earlier generic shared-memory accesses before later async-proxy (copy
// engine) accesses.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Arrives once on `bar` and announces `bytes` of copies that will complete on it.
__device__ __forceinline__ void mbarrier_expect_tx(std::uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// Global -> shared, `bytes` a multiple of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, std::uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// Shared -> global, tracked by the issuing thread's bulk group.
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}
// Commits the bulk stores and waits until they have read their shared-memory sources (the block may
// then exit; the writes complete before the grid does).
__device__ __forceinline__ void bulk_commit_and_wait_read() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Waits until the phase with parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3, const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

// D = A * B + D, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// Phase 1
// ---------------------------------------------------------------------------------------------
constexpr int kPrepThreads = 128;  // 4 warps; in the elementwise steps one thread per channel d
constexpr int kPad = D + 1;        // fp32 rows of the exact path, padded against bank conflicts
// Above this in-chunk decay (-G_last, natural log), exp(-G) could overflow or lose the smallest
// factors: such chunks take the exact path that exponentiates differences G_i - G_j <= 0 only. The
// bounded gate (lower_bound >= -5, 16 tokens) always stays below it.
constexpr float kFactoredRange = 80.0f;

struct PrepSmem {
  bf16 q[C][kRowPad];   // raw inputs of the chunk (padded tokens zero); q and k are reused for the
  bf16 k[C][kRowPad];   // W and U0 outputs once the last reader (step 4) is done
  bf16 v[C][kRowPad];
  union {               // thread d reads g[t][d] for every t before it writes kg[t][d]
    bf16 g[C][kRowPad];
    bf16 kg[C][kRowPad];  // k_hat * exp(G)                (K~, feeds A)
  };
  bf16 qg[C][kRowPad];  // scale * q_hat * exp(G)          (record: Q~)
  bf16 kd[C][kRowPad];  // k_hat * exp(G_last - G)         (record: K^)
  union {
    bf16 ki[C][kRowPad];  // factored path: k_hat * exp(-G)
    float G[C][kPad];     // exact path: the cumulative gate itself
  };
  bf16 m[C][kMPad];     // record: M
  float A[C][C + 4];     // 16-byte rows: read back as float4
  float beta[C];
  float inv_norm[2][C];
  float range[4];
  std::uint64_t inputs_ready;  // mbarrier of the input copies
};

// Finds the sequence owning slot `slot` when slots are `width` tokens wide (a chunk: C; a segment:
// C * seg_chunks): the largest s with s + start(s) / width <= slot.
__device__ __forceinline__ std::int64_t owner_of_slot(const SeqIndex& seqs, std::int64_t slot,
                                                      std::int64_t width) {
  std::int64_t lo = 0, hi = seqs.num_seqs - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    std::int64_t b = seqs.start(mid);
    b = b < 0 ? 0 : (b > seqs.total ? seqs.total : b);
    if (mid + b / width <= slot) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// 16 x 16 = X Y^T over the 128 channels, X and Y 16 x 128 bf16 tiles in shared memory (one warp).
// acc[nt][0..1]: (row gq, cols 8 nt + 2 tq + {0,1}); acc[nt][2..3]: row gq + 8.
__device__ __forceinline__ void gram16(float (&acc)[2][4], const bf16 (*X)[kRowPad],
                                       const bf16 (*Y)[kRowPad], int lane) {
  const int lrow = (lane & 7) + ((lane >> 4) << 3);
  const int lcol = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    unsigned a[4], b0, b1, b2, b3;
    ldmatrix_x4(a[0], a[1], a[2], a[3], &X[lane & 15][kt * 16 + (lane >> 4) * 8]);
    ldmatrix_x4(b0, b1, b2, b3, &Y[lrow][kt * 16 + lcol]);
    mma_bf16(acc[0], a, b0, b1);
    mma_bf16(acc[1], a, b2, b3);
  }
}

__global__ void __launch_bounds__(kPrepThreads) kda_prepare_kernel(const PrefillParams p) {
  extern __shared__ __align__(16) unsigned char prep_smem_raw[];
  PrepSmem& sm = *reinterpret_cast<PrepSmem*>(prep_smem_raw);
  const std::int64_t slot = blockIdx.x;
  const int h = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;

  // The gate parameters first: their latency overlaps the search and the input copies.
  const float a_log_h = p.A_log[h];
  const float dtb = p.dt_bias[h * D + tid];
  // The first slot's blocks (one per head) check the gate parameters for everyone.
  if (slot == 0 && gate_params_bad(tid == 0 ? a_log_h : 0.f, dtb)) report_status(p.status, kDeviceStatusGateParams);

  const std::int64_t s = owner_of_slot(p.seqs, slot, C);
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t j = slot - (s + bos / C);
  const std::int64_t nchunks = (eos - bos + C - 1) / C;
  if (j < 0 || j >= nchunks) return;  // a gap slot: no chunk lives here
  const std::int64_t tok0 = bos + j * C;
  const int nvalid = static_cast<int>(eos - tok0 < C ? eos - tok0 : C);
  const std::int64_t H = p.num_heads;

  // 1. The chunk's q, k, v, g rows into shared memory: one 256-byte bulk copy per (tensor, token),
  //    issued by 4 * nvalid threads, each announcing its own bytes on the mbarrier (so no thread
  //    waits on another's announcement); padded tokens are zeroed.
  {
    if (tid == 0) mbarrier_init(&sm.inputs_ready, static_cast<unsigned>(4 * nvalid));
    __syncthreads();  // the barrier is initialized before anyone uses it
    if (tid < 4 * C) {
      const int tensor = tid / C, row = tid % C;
      const bf16* src = tensor == 0 ? p.q : tensor == 1 ? p.k : tensor == 2 ? p.v : p.g;
      bf16(*dst)[kRowPad] = tensor == 0 ? sm.q : tensor == 1 ? sm.k : tensor == 2 ? sm.v : sm.g;
      if (row < nvalid) {
        mbarrier_expect_tx(&sm.inputs_ready, D * 2);
        bulk_copy_to_shared(&dst[row][0], src + ((tok0 + row) * H + h) * D, D * 2, &sm.inputs_ready);
      } else {
        uint4* z = reinterpret_cast<uint4*>(&dst[row][0]);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) z[i] = make_uint4(0, 0, 0, 0);
      }
    }
    if (tid < C) sm.beta[tid] = tid < nvalid ? sigmoid_f(__bfloat162float(p.beta[(tok0 + tid) * H + h])) : 0.f;
    mbarrier_wait(&sm.inputs_ready, 0);
    __syncthreads();  // the zeroed rows and beta
  }

  // 2. Inverse L2 norms of q and k rows: warp w takes rows 4w .. 4w + 3.
#pragma unroll
  for (int which = 0; which < 2; ++which) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = warp * 4 + r;
      const bf16* x = which == 0 ? &sm.q[row][4 * lane] : &sm.k[row][4 * lane];
      const uint2 raw = *reinterpret_cast<const uint2*>(x);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      float ss = a.x * a.x + a.y * a.y + b.x * b.x + b.y * b.y;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) sm.inv_norm[which][row] = rsqrtf(ss + 1e-6f);
    }
  }

  // 3. Gate, its in-chunk cumulative sum G, and the scaled operands; thread d owns channel d.
  const int d = tid;
  float G[C];
  {
    const float a_exp = __expf(a_log_h);
    float acc = 0.f;
#pragma unroll
    for (int t = 0; t < C; ++t) {
      if (t < nvalid) acc += gate_activation(p.gate_mode, __bfloat162float(sm.g[t][d]), a_exp, dtb, p.lower_bound);
      G[t] = acc;
    }
  }
  const float g_last = G[C - 1];
  float range = -g_last;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) range = fmaxf(range, __shfl_xor_sync(0xffffffffu, range, o));
  if (lane == 0) sm.range[warp] = range;
  __syncthreads();  // also publishes inv_norm
  const bool factored = fmaxf(fmaxf(sm.range[0], sm.range[1]), fmaxf(sm.range[2], sm.range[3])) < kFactoredRange;

  unsigned char* rec = record_ptr(p, slot, h);
  const float gl_d = __expf(g_last);
  reinterpret_cast<float*>(rec + ChunkRecord::kGl)[d] = gl_d;
  float kt[C];  // K~ column d in fp32, for the forward substitution
#pragma unroll
  for (int t = 0; t < C; ++t) {
    const float qh = __bfloat162float(sm.q[t][d]) * sm.inv_norm[0][t];
    const float kh = __bfloat162float(sm.k[t][d]) * sm.inv_norm[1][t];
    const float eg = __expf(G[t]);
    kt[t] = kh * eg;
    sm.qg[t][d] = __float2bfloat16(p.scale * qh * eg);
    sm.kg[t][d] = __float2bfloat16(kt[t]);
    if (factored) {
      // exp(-G) is finite here, and exp(G_last - G) = exp(G_last) exp(-G) saves an exp.
      const float ki = kh * __expf(-G[t]);
      sm.ki[t][d] = __float2bfloat16(ki);
      sm.kd[t][d] = __float2bfloat16(ki * gl_d);
    } else {
      sm.kd[t][d] = __float2bfloat16(kh * __expf(g_last - G[t]));
      sm.G[t][d] = G[t];
    }
  }
  __syncthreads();

  // 4. A (strictly lower, times beta_i) and M (lower with diagonal, scale inside qg).
  if (factored) {
    // exp(G_i - G_j) = exp(G_i) exp(-G_j): two 16 x 16 x 128 tensor-core products.
    if (warp < 2) {
      float acc[2][4] = {};
      gram16(acc, warp == 0 ? sm.kg : sm.qg, sm.ki, lane);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = gq + (r >> 1) * 8, jj = nt * 8 + 2 * tq + (r & 1);
          if (warp == 0) sm.A[i][jj] = i > jj ? sm.beta[i] * acc[nt][r] : 0.f;
          else sm.m[i][jj] = __float2bfloat16(i >= jj ? acc[nt][r] : 0.f);
        }
      }
    }
  } else {
    // Exact: every exp() of a difference G_i - G_j <= 0. A thread per pair (i, j), i >= j.
    for (int pidx = tid; pidx < C * C; pidx += kPrepThreads) {
      const int i = pidx / C, jj = pidx % C;
      float a = 0.f, m = 0.f;
      if (i >= jj) {
#pragma unroll 8
        for (int c = 0; c < D; ++c) {
          const float kj = __bfloat162float(sm.k[jj][c]) * __expf(sm.G[i][c] - sm.G[jj][c]);
          a = fmaf(__bfloat162float(sm.k[i][c]), kj, a);
          m = fmaf(__bfloat162float(sm.q[i][c]), kj, m);
        }
      }
      sm.A[i][jj] = i > jj ? sm.beta[i] * a * sm.inv_norm[1][i] * sm.inv_norm[1][jj] : 0.f;
      sm.m[i][jj] = __float2bfloat16(i >= jj ? p.scale * m * sm.inv_norm[0][i] * sm.inv_norm[1][jj] : 0.f);
    }
  }
  __syncthreads();

  // 5. Forward substitution in fp32, thread d owning column d:
  //    (I + A) [W | U0] = diag(beta) [K~ | V]. q and k are dead now: W and U0 take their place.
  {
    float xk[C], xv[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const float b = sm.beta[i];
      float rk = b * kt[i];
      float rv = b * __bfloat162float(sm.v[i][d]);
#pragma unroll
      for (int j4 = 0; j4 < i; j4 += 4) {
        const float4 a4 = *reinterpret_cast<const float4*>(&sm.A[i][j4]);
        const float arow[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int jj = j4; jj < j4 + 4 && jj < i; ++jj) {
          rk = fmaf(-arow[jj - j4], xk[jj], rk);
          rv = fmaf(-arow[jj - j4], xv[jj], rv);
        }
      }
      xk[i] = rk;
      xv[i] = rv;
      sm.q[i][d] = __float2bfloat16(rk);  // W
      sm.k[i][d] = __float2bfloat16(rv);  // U0
    }
  }
  // 6. The tiles go out by the copy engine: every writer fences its shared-memory stores against the
  //    async proxy, then one thread issues the bulk stores and waits for them before the block ends.
  fence_proxy_async();
  __syncthreads();
  if (tid == 0) {
    constexpr unsigned kTile = static_cast<unsigned>(ChunkRecord::kTileBytes);
    bulk_copy_to_global(rec + ChunkRecord::kQg, sm.qg, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kKd, sm.kd, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kW, sm.q, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kU, sm.k, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kM, sm.m, static_cast<unsigned>(C * kMPad * 2));
    bulk_commit_and_wait_read();
  }
}

// ---------------------------------------------------------------------------------------------
// Phase 2
// ---------------------------------------------------------------------------------------------
constexpr int kStages = 5;  // deep enough to cover DRAM latency with one or two blocks per SM

// A stage is the byte image of a chunk record (workspace_layout.hpp).
struct StageSmem {
  bf16 qg[C][kRowPad];
  bf16 kd[C][kRowPad];
  bf16 w[C][kRowPad];
  bf16 u[C][kRowPad];
  bf16 m[C][kMPad];
  float gl[D];
};
static_assert(sizeof(StageSmem) == ChunkRecord::kBytes, "a stage is a record's image");
static_assert(offsetof(StageSmem, m) == ChunkRecord::kM && offsetof(StageSmem, gl) == ChunkRecord::kGl,
              "a stage is a record's image");

// One record into a stage by the copy engine, completing on `bar`. One thread.
__device__ __forceinline__ void load_stage_bulk(StageSmem& st, const unsigned char* rec, std::uint64_t* bar) {
  fence_proxy_async();
  mbarrier_expect_tx(bar, static_cast<unsigned>(ChunkRecord::kBytes));
  bulk_copy_to_shared(&st, rec, static_cast<unsigned>(ChunkRecord::kBytes), bar);
}

// out[kt & 1][nt] += S^T T^T over the 128 channels: S^T as bf16 A fragments (8 k-tiles), T a 16 x 128
// tile of the stage (tokens x channels); even and odd k-tiles accumulate apart to halve the chain.
__device__ __forceinline__ void state_times_tile(float (&out)[2][2][4], const unsigned (&sa)[8][4],
                                                 const bf16 (*tile)[kRowPad], int lrow, int lcol) {
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    unsigned b0, b1, b2, b3;
    ldmatrix_x4(b0, b1, b2, b3, &tile[lrow][kt * 16 + lcol]);
    mma_bf16(out[kt & 1][0], sa[kt], b0, b1);
    mma_bf16(out[kt & 1][1], sa[kt], b2, b3);
  }
}

// Which pass of the recurrence a launch is (see workspace_layout.hpp, "Segments"). Without a split
// every sequence is one segment and kFirst is the whole recurrence.
enum class RecurrencePass : int {
  kFirst = 0,   // segment 0 from the true initial state (outputs); middle segments' (H_j, P_j)
  kSecond = 1,  // segments 1.. from the scanned initial states (outputs, final state)
};

// Where a sequence's state lives: index s, its pool entry, or nowhere (-1: padding, or an entry
// outside the pool, reported once through the status word).
__device__ __forceinline__ std::int64_t state_index(const PrefillParams& p, std::int64_t s, bool report) {
  if (p.state_slots == nullptr) return s;
  const std::int64_t slot = p.state_slots[s];
  if (slot >= p.num_state_slots) {
    if (report) report_status(p.status, kDeviceStatusSlot);
    return -1;
  }
  return slot < 0 ? -1 : slot;
}

__device__ __forceinline__ float* seg_block(const PrefillParams& p, std::int64_t seg_slot, int h) {
  return p.seg_blocks + (seg_slot * p.num_heads + h) * static_cast<std::int64_t>(2 * D * D);
}

// Segment j of a sequence with nchunks chunks: the count of its segments (at least one, so that an
// empty sequence still passes its initial state on).
__device__ __forceinline__ std::int64_t segments_of(std::int64_t nchunks, std::int64_t seg_chunks) {
  const std::int64_t n = (nchunks + seg_chunks - 1) / seg_chunks;
  return n < 1 ? 1 : n;
}

// One block per (segment slot, head, column block). Columns 0..127 are the V columns of S^T; in
// the first pass a middle segment also carries columns 128..255, the rows of P^T, started from the
// identity with U0 = 0 (v = 0 for them).
// SPLIT = false compiles the one-segment-per-sequence case without the segment logic (no
// transitions, no identity columns, no owner search): its register count and speed stay those of
// the plain recurrence.
template <int WARPS, RecurrencePass PASS, bool SPLIT>
__global__ void __launch_bounds__(WARPS * 32) kda_recurrence_kernel(const PrefillParams p) {
  constexpr int THREADS = WARPS * 32;
  constexpr int VB = WARPS * 16;  // columns per block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StageSmem* stages = reinterpret_cast<StageSmem*>(smem_raw);
  bf16(*so)[VB + 8] = reinterpret_cast<bf16(*)[VB + 8]>(smem_raw + kStages * sizeof(StageSmem));
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem_raw + kStages * sizeof(StageSmem) +
                                                         C * (VB + 8) * sizeof(bf16));

  const std::int64_t seg_slot = blockIdx.x;
  const int h = blockIdx.y;
  const int v_block = blockIdx.z * VB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;  // mma fragment row group / thread-in-group
  const int v_warp = v_block + warp * 16;   // first column of this warp

  const std::int64_t seg_tokens = C * p.seg_chunks;
  const std::int64_t s = SPLIT ? owner_of_slot(p.seqs, seg_slot, seg_tokens) : seg_slot;
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t nchunks = (eos - bos + C - 1) / C;
  const std::int64_t j = SPLIT ? seg_slot - (s + bos / seg_tokens) : 0;  // segment in the sequence
  const std::int64_t nseg = SPLIT ? segments_of(nchunks, p.seg_chunks) : 1;
  if (j < 0 || j >= nseg) return;  // a gap slot
  const bool last = j == nseg - 1;
  // What this block does: see RecurrencePass.
  const bool transition = SPLIT && PASS == RecurrencePass::kFirst && j > 0;  // (H_j, P_j), middle
  if (PASS == RecurrencePass::kFirst && j > 0 && last) return;    // the last one runs in kSecond
  if (PASS == RecurrencePass::kSecond && j == 0) return;          // segment 0 ran in kFirst
  if (!transition && v_block >= D) return;                         // P columns: middle segments only
  const bool identity_cols = SPLIT && v_warp >= D;                 // warp-uniform

  // One block per sequence checks its cu_seqlens entries (the first and last also the ends).
  const bool reporter = PASS == RecurrencePass::kFirst && j == 0 && h == 0 && blockIdx.z == 0 && tid == 0;
  if (p.seqs.cu != nullptr && reporter) {
    const std::int64_t b = p.seqs.start(s), e = p.seqs.start(s + 1);
    if (e < b || (s == 0 && b != 0) || (s == p.seqs.num_seqs - 1 && e != p.seqs.total)) {
      report_status(p.status, kDeviceStatusCuSeqlens);
    }
  }
  const std::int64_t state_idx = state_index(p, s, reporter);
  const std::int64_t H = p.num_heads;
  const std::int64_t state_base = (state_idx * H + h) * static_cast<std::int64_t>(D) * D;
  // Initial state: the caller's (segment 0), the scan's (segment j >= 1, second pass: in the block
  // of segment j - 1), or zero / identity (transitions).
  const float* seg_in = PASS == RecurrencePass::kSecond ? seg_block(p, seg_slot - 1, h) : nullptr;
  const int h0_kind = (j == 0 && state_idx >= 0) ? p.h0_kind : 0;

  // S^T slice [v_warp + 0..15][0..127] as 16 n-tiles of m16n8 accumulators:
  // acc[n][0..1] -> (row gq, cols 8n + 2tq + {0,1}); acc[n][2..3] -> row gq + 8.
  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = v_warp + gq + 8 * r;
      const int col = 8 * n + 2 * tq;
      const std::int64_t off = state_base + static_cast<std::int64_t>(row) * D + col;
      float x0 = 0.f, x1 = 0.f;
      if (PASS == RecurrencePass::kSecond) {
        const float2 t2 = *reinterpret_cast<const float2*>(seg_in + static_cast<std::int64_t>(row) * D + col);
        x0 = t2.x;
        x1 = t2.y;
      } else if (transition) {
        x0 = identity_cols && row - D == col ? 1.f : 0.f;
        x1 = identity_cols && row - D == col + 1 ? 1.f : 0.f;
      } else if (h0_kind == 2) {
        const float2 t2 = *reinterpret_cast<const float2*>(static_cast<const float*>(p.h0) + off);
        x0 = t2.x;
        x1 = t2.y;
      } else if (h0_kind == 1) {
        const __nv_bfloat162 t2 = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.h0) + off);
        x0 = __bfloat162float(t2.x);
        x1 = __bfloat162float(t2.y);
      }
      acc[n][2 * r] = x0;
      acc[n][2 * r + 1] = x1;
    }
  }

  // This segment's chunks [c_begin, c_end) of the sequence. One thread drives the copy engine: an
  // mbarrier per stage, the first kStages - 1 chunks now. Chunks past the workspace's slots (only
  // with broken cu_seqlens) are never fetched or waited on.
  const std::int64_t slot0 = s + bos / C;
  const std::int64_t c_begin = j * p.seg_chunks;
  std::int64_t c_end = last ? nchunks : c_begin + p.seg_chunks;
  if (c_end > p.num_slots - slot0) c_end = p.num_slots - slot0;
  const std::int64_t nfetch = c_end > c_begin ? c_end - c_begin : 0;
  const bool write_out = !transition;
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) mbarrier_init(&full[i], 1);
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < kStages - 1; ++c) {
      if (c < nfetch) load_stage_bulk(stages[c], record_ptr(p, slot0 + c_begin + c, h), &full[c]);
    }
  }

  for (std::int64_t c = 0; c < nfetch; ++c) {
    // Every warp is done with chunk c - 1 (the barrier before the output stores of c - 1), so its
    // stage can be refilled; `so` is free once the stores of c - 1 are done (this barrier).
    __syncthreads();
    if (tid == 0) {
      const std::int64_t nc = c + kStages - 1;
      if (nc < nfetch) {
        load_stage_bulk(stages[nc % kStages], record_ptr(p, slot0 + c_begin + nc, h), &full[nc % kStages]);
      }
    }
    mbarrier_wait(&full[c % kStages], static_cast<unsigned>((c / kStages) & 1));
    const StageSmem& st = stages[c % kStages];

    // The chain that carries the state from chunk to chunk is X -> U -> S; Y and O hang off it and
    // are issued after the state update so that they fill its latency.
    // S^T (old) as bf16 A fragments: k-tile kt covers state channels [16 kt, 16 kt + 16).
    unsigned sa[8][4];
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      sa[kt][0] = pack_bf16x2(acc[2 * kt][0], acc[2 * kt][1]);
      sa[kt][1] = pack_bf16x2(acc[2 * kt][2], acc[2 * kt][3]);
      sa[kt][2] = pack_bf16x2(acc[2 * kt + 1][0], acc[2 * kt + 1][1]);
      sa[kt][3] = pack_bf16x2(acc[2 * kt + 1][2], acc[2 * kt + 1][3]);
    }
    // ldmatrix addresses: lanes 0-7 rows 0-7 col lo, 8-15 rows 0-7 col hi, 16-23 rows 8-15 lo, 24-31 hi
    const int lrow = (lane & 7) + ((lane >> 4) << 3);
    const int lcol = ((lane >> 3) & 1) * 8;

    // X = S^T W^T (16 v x 16 tokens, two n-tiles of 8 tokens).
    float X[2][2][4] = {};
    state_times_tile(X, sa, st.w, lrow, lcol);

    // U^T = U0^T - X   (row v, col token); U0 = 0 on the P^T rows.
    float U[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int t0 = nt * 8 + 2 * tq;
      const int v0 = v_warp + gq;
      float u00 = 0.f, u01 = 0.f, u10 = 0.f, u11 = 0.f;
      if (!identity_cols) {
        u00 = __bfloat162float(st.u[t0][v0]);
        u01 = __bfloat162float(st.u[t0 + 1][v0]);
        u10 = __bfloat162float(st.u[t0][v0 + 8]);
        u11 = __bfloat162float(st.u[t0 + 1][v0 + 8]);
      }
      U[nt][0] = u00 - (X[0][nt][0] + X[1][nt][0]);
      U[nt][1] = u01 - (X[0][nt][1] + X[1][nt][1]);
      U[nt][2] = u10 - (X[0][nt][2] + X[1][nt][2]);
      U[nt][3] = u11 - (X[0][nt][3] + X[1][nt][3]);
    }
    unsigned ua[4];
    ua[0] = pack_bf16x2(U[0][0], U[0][1]);
    ua[1] = pack_bf16x2(U[0][2], U[0][3]);
    ua[2] = pack_bf16x2(U[1][0], U[1][1]);
    ua[3] = pack_bf16x2(U[1][2], U[1][3]);

    // S^T = S^T diag(g_last) + U^T K^
#pragma unroll
    for (int n = 0; n < 16; n += 2) {
      unsigned b0, b1, b2, b3;
      // trans: lanes 0-7 tokens 0-7 col 8n, 8-15 tokens 8-15 col 8n, 16-23 tokens 0-7 col 8n+8, 24-31
      ldmatrix_x4_trans(b0, b1, b2, b3, &st.kd[(lane & 15)][8 * n + ((lane >> 4) << 3)]);
#pragma unroll
      for (int hn = 0; hn < 2; ++hn) {
        const float2 gl = *reinterpret_cast<const float2*>(&st.gl[8 * (n + hn) + 2 * tq]);
        acc[n + hn][0] *= gl.x;
        acc[n + hn][1] *= gl.y;
        acc[n + hn][2] *= gl.x;
        acc[n + hn][3] *= gl.y;
      }
      mma_bf16(acc[n], ua, b0, b1);
      mma_bf16(acc[n + 1], ua, b2, b3);
    }

    if (write_out) {
      // O^T = S^T Q~^T + U^T M^T, from the old state's fragments.
      float Y[2][2][4] = {};
      state_times_tile(Y, sa, st.qg, lrow, lcol);
      {
        unsigned m0, m1, m2, m3;
        ldmatrix_x4(m0, m1, m2, m3, &st.m[lrow][lcol]);
        mma_bf16(Y[0][0], ua, m0, m1);
        mma_bf16(Y[0][1], ua, m2, m3);
      }

      // Output: stage O^T through shared memory, then coalesced 16-byte stores of the valid tokens.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int t0 = nt * 8 + 2 * tq;
        const int vl = warp * 16 + gq;
        so[t0][vl] = __float2bfloat16(Y[0][nt][0] + Y[1][nt][0]);
        so[t0 + 1][vl] = __float2bfloat16(Y[0][nt][1] + Y[1][nt][1]);
        so[t0][vl + 8] = __float2bfloat16(Y[0][nt][2] + Y[1][nt][2]);
        so[t0 + 1][vl + 8] = __float2bfloat16(Y[0][nt][3] + Y[1][nt][3]);
      }
      __syncthreads();
      const std::int64_t tok0 = bos + (c_begin + c) * C;
      const int nvalid = static_cast<int>(eos - tok0 < C ? eos - tok0 : C);
      constexpr int kPieces = VB / 8;  // 16-byte pieces per token row
      for (int e = tid; e < nvalid * kPieces; e += THREADS) {
        const int t = e / kPieces, pc = e % kPieces;
        const std::int64_t off = ((tok0 + t) * H + h) * D + v_block + pc * 8;
        *reinterpret_cast<uint4*>(p.out + off) = *reinterpret_cast<const uint4*>(&so[t][pc * 8]);
      }
    }
  }
  // The end state: the caller's final state (last segment), or this segment's block in the
  // workspace (segment 0 of a split sequence: S_1; a transition: H_j^T and P^T rows), fp32.
  float* seg_out = nullptr;
  int out_kind = 0;
  // The slot is looked up again rather than kept live across the chunk loop (that cost the loop
  // ~60 registers and 4-9 % of its speed).
  const std::int64_t end_idx = state_index(p, s, false);
  const std::int64_t end_base = (end_idx * H + h) * static_cast<std::int64_t>(D) * D;
  if (last) {
    out_kind = end_idx >= 0 ? p.ht_kind : 0;
  } else if (PASS == RecurrencePass::kFirst) {
    seg_out = seg_block(p, seg_slot, h);
    out_kind = 3;
  }
  if (out_kind != 0) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = v_warp + gq + 8 * r;
        const int col = 8 * n + 2 * tq;
        const std::int64_t off = end_base + static_cast<std::int64_t>(row) * D + col;
        if (out_kind == 3) {
          *reinterpret_cast<float2*>(seg_out + static_cast<std::int64_t>(row) * D + col) =
              make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
        } else if (out_kind == 2) {
          *reinterpret_cast<float2*>(static_cast<float*>(p.ht) + off) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.ht) + off) =
              __floats2bfloat162_rn(acc[n][2 * r], acc[n][2 * r + 1]);
        }
      }
    }
  }
}

template <int WARPS>
constexpr std::size_t recurrence_smem_bytes() {
  return kStages * sizeof(StageSmem) + C * (WARPS * 16 + 8) * sizeof(bf16) + kStages * sizeof(std::uint64_t);
}

template <int WARPS, RecurrencePass PASS, bool SPLIT>
Status launch_recurrence(const PrefillParams& prm, std::int64_t seg_slots, int column_blocks,
                         cudaStream_t stream) {
  constexpr std::size_t smem = recurrence_smem_bytes<WARPS>();
  cudaError_t err = cudaFuncSetAttribute(kda_recurrence_kernel<WARPS, PASS, SPLIT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_recurrence_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(seg_slots), static_cast<unsigned>(prm.num_heads),
                     static_cast<unsigned>(column_blocks));
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kda_recurrence_kernel<WARPS, PASS, SPLIT>, prm),
                     "kda_recurrence_kernel");
}

// The scan between the passes: for each (sequence, head, 4 rows of S^T), S_{j+1}^T = S_j^T P_j^T +
// H_j^T for j = 1 .. nseg - 2, in fp32, written over H_j^T. S_1^T comes from segment 0's block.
// Only S carries from step to step: P_{j+1}^T streams into the other shared-memory buffer (cp.async)
// while step j computes, so a step costs its 4 x 128 x 128 products, not a 64 KiB load. Warp w owns
// row w, lane l columns 4l .. 4l + 3 (conflict-free 16-byte reads of P^T rows).
constexpr int kScanRows = 4;
constexpr int kScanThreads = kScanRows * 32;
struct ScanSmem {
  float pt[2][D][D];         // P_j^T, double-buffered
  float s[kScanRows][D];     // the running S^T rows
};

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__global__ void __launch_bounds__(kScanThreads) kda_segment_scan_kernel(const PrefillParams p) {
  extern __shared__ __align__(16) unsigned char scan_smem_raw[];
  ScanSmem& sm = *reinterpret_cast<ScanSmem*>(scan_smem_raw);
  const std::int64_t s = blockIdx.x;
  const int h = blockIdx.y;
  const int row0 = blockIdx.z * kScanRows;
  const int tid = threadIdx.x, lane = tid & 31, r = tid >> 5;
  const int c0 = lane * 4;
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t seg_tokens = C * p.seg_chunks;
  const std::int64_t nseg = segments_of((eos - bos + C - 1) / C, p.seg_chunks);
  if (nseg < 3) return;  // nothing between segment 0 and the last
  const std::int64_t base = s + bos / seg_tokens;
  auto prefetch = [&](std::int64_t jj, int buf) {
    const float* pt = seg_block(p, base + jj, h) + static_cast<std::int64_t>(D) * D;
    for (int e = tid; e < D * D / 4; e += kScanThreads) cp_async_16(&sm.pt[buf][0][0] + 4 * e, pt + 4 * e);
    cp_async_commit();
  };
  prefetch(1, 1);
  {
    const float* s1 = seg_block(p, base, h) + static_cast<std::int64_t>(row0 + r) * D + c0;
    *reinterpret_cast<float4*>(&sm.s[r][c0]) = *reinterpret_cast<const float4*>(s1);
  }
  for (std::int64_t jj = 1; jj + 1 < nseg; ++jj) {
    const int buf = static_cast<int>(jj & 1);
    float* hrow = seg_block(p, base + jj, h) + static_cast<std::int64_t>(row0 + r) * D + c0;
    const float4 hv = *reinterpret_cast<const float4*>(hrow);  // issued before the wait
    if (jj + 2 < nseg) {
      prefetch(jj + 1, buf ^ 1);  // its buffer was last read in step jj - 1 (barrier below)
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // P_jj^T and this warp's S row are in
    float o0 = hv.x, o1 = hv.y, o2 = hv.z, o3 = hv.w;
#pragma unroll 8
    for (int i = 0; i < D; ++i) {
      const float x = sm.s[r][i];
      const float4 a = *reinterpret_cast<const float4*>(&sm.pt[buf][i][c0]);
      o0 = fmaf(x, a.x, o0);
      o1 = fmaf(x, a.y, o1);
      o2 = fmaf(x, a.z, o2);
      o3 = fmaf(x, a.w, o3);
    }
    __syncthreads();  // every warp is done with P_jj^T and its old S row
    *reinterpret_cast<float4*>(hrow) = make_float4(o0, o1, o2, o3);
    *reinterpret_cast<float4*>(&sm.s[r][c0]) = make_float4(o0, o1, o2, o3);
  }
}

Status launch_segment_scan(const PrefillParams& prm, std::int64_t num_seqs, cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kda_segment_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(sizeof(ScanSmem)));
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_segment_scan_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(num_seqs), static_cast<unsigned>(prm.num_heads), D / kScanRows);
  cfg.blockDim = dim3(kScanThreads);
  cfg.dynamicSmemBytes = sizeof(ScanSmem);
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kda_segment_scan_kernel, prm), "kda_segment_scan_kernel");
}

// How the recurrence is cut: segments of seg_chunks chunks so that about `factor` segment-heads
// per SM run at once (bounded by kSegmentBudget so that workspace_size() holds on any device), or
// no split when the sequences are too short for two segments of kMinSegmentChunks.
struct SegmentPlan {
  std::int64_t seg_chunks = kNoSplit;
  std::int64_t seg_slots = 0;  // grid size of the passes: num_seqs + total_tokens / (16 seg_chunks)
  bool split = false;
};

// Tuning knobs for the benchmark's sweeps (docs/PERFORMANCE-NOTES.md), read once. Not part of the
// contract: the workspace bound holds whatever they say (kSegmentBudget caps the plan).
float env_float(const char* name, float fallback, float lo, float hi) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  const float v = static_cast<float>(std::atof(env));
  return v < lo ? lo : (v > hi ? hi : v);
}
// Segment-heads per SM to aim for at most (parallelism); 0 turns the split off.
float segment_factor() {
  static const float factor = env_float("KDA_PREFILL_SEGMENT_FACTOR", 1.0f, 0.0f, 16.0f);
  return factor;
}
// Cost of one scan step in chunk-steps of the recurrence: with n segments over c chunks the split
// costs about 2 c / n chunk-steps (two passes) plus n scan steps, least at n = sqrt(2 c / ratio).
float scan_step_ratio() {
  static const float ratio = env_float("KDA_PREFILL_SCAN_RATIO", 2.0f, 0.05f, 100.0f);
  return ratio;
}

SegmentPlan plan_segments(std::int64_t T, std::int64_t N, std::int64_t H, int sms) {
  SegmentPlan plan;
  plan.seg_slots = N;
  const std::uint64_t extra_bound = max_extra_segments(static_cast<std::uint64_t>(T), static_cast<std::uint64_t>(H));
  if (extra_bound == 0) return plan;
  const std::int64_t chunks = (T + C - 1) / C;
  // Segments (over all sequences): enough to fill the GPU, no more than the scan pays for, and
  // within the workspace's budget.
  std::int64_t target = static_cast<std::int64_t>(segment_factor() * static_cast<float>(sms) / static_cast<float>(H));
  const std::int64_t per_seq = static_cast<std::int64_t>(std::sqrt(2.0 * static_cast<double>(chunks) / N / scan_step_ratio()));
  if (target > per_seq * N) target = per_seq * N;
  const std::int64_t budget = static_cast<std::int64_t>(kSegmentBudget) / H;
  if (target > budget) target = budget;
  // Two segments gain nothing (segment 1 waits for segment 0); three and more save 1 - 2 / n.
  if (target < 3) return plan;
  std::int64_t seg_chunks = (chunks + target - 1) / target;
  if (seg_chunks < static_cast<std::int64_t>(kMinSegmentChunks)) seg_chunks = kMinSegmentChunks;
  const std::int64_t extra = T / (C * seg_chunks);
  if (extra == 0) return plan;
  plan.seg_chunks = seg_chunks;
  plan.seg_slots = N + extra;
  plan.split = true;
  return plan;
}

int state_kind(DType dt) { return dt == DType::kBF16 ? 1 : dt == DType::kF32 ? 2 : 0; }

}  // namespace
}  // namespace kda::detail

namespace kda {

Status forward_cuda(const Problem& p, const Tensors& t, Workspace ws, void* stream_ptr, const CudaOptions& opt) {
  using namespace detail;
  KDA_NVTX_RANGE("kda.prefill");
  Status st = can_implement(p, Backend::kCuda);
  if (!st.ok()) return st;
  st = validate(p, t);
  if (!st.ok()) return st;
  if (t.cu_seqlens_host != nullptr) {
    st = validate_cu_seqlens(p, t.cu_seqlens_host);
    if (!st.ok()) return st;
  }
  if (t.state_slots_host != nullptr) {
    st = check_state_slots(p, t.state_slots_host, nullptr);
    if (!st.ok()) return st;
  }
  // The kernels move q, k, v, g and out in 16-byte pieces (bulk copies, vector stores) and states in
  // 8-byte pieces.
  {
    const struct {
      const void* ptr;
      const char* name;
      std::uintptr_t align;
    } aligned[] = {{t.q, "q", 16}, {t.k, "k", 16}, {t.v, "v", 16}, {t.g, "g", 16}, {t.out, "out", 16},
                   {t.initial_state, "initial_state", 8}, {t.final_state, "final_state", 8},
                   {t.beta, "beta", 2}, {t.A_log, "A_log", 4}, {t.dt_bias, "dt_bias", 4},
                   {t.cu_seqlens, "cu_seqlens", p.cu_seqlens_dtype == DType::kI64 ? 8u : 4u},
                   {t.state_slots, "state_slots", 4}, {t.device_status, "device_status", 4}};
    for (const auto& a : aligned) {
      if (reinterpret_cast<std::uintptr_t>(a.ptr) % a.align != 0) {
        return Status(StatusCode::kInvalidArgument, std::string(a.name) + " must be " + std::to_string(a.align) +
                                                        "-byte aligned for the CUDA backend");
      }
    }
  }
  std::size_t need = 0;
  st = workspace_size(p, Backend::kCuda, &need);
  if (!st.ok()) return st;
  if (ws.bytes < need || (need > 0 && ws.ptr == nullptr)) {
    return Status(StatusCode::kWorkspaceTooSmall, "workspace holds " + std::to_string(ws.bytes) +
                                                      " bytes; the CUDA prefill needs " + std::to_string(need));
  }
  if (opt.check_pointers) {
    TensorExtents extents;
    st = prefill_extents(p, t, &extents);
    if (!st.ok()) return st;
    extents.add("workspace", ws.ptr, need);
    st = check_device_extents(extents);
    if (!st.ok()) return st;
  }
  const std::int64_t N = p.sequences();
  if (N == 0) return Status::Ok();
  const std::int64_t T = p.total_tokens();

  PrefillParams prm{};
  prm.q = static_cast<const bf16*>(t.q);
  prm.k = static_cast<const bf16*>(t.k);
  prm.v = static_cast<const bf16*>(t.v);
  prm.g = static_cast<const bf16*>(t.g);
  prm.beta = static_cast<const bf16*>(t.beta);
  prm.A_log = t.A_log;
  prm.dt_bias = t.dt_bias;
  prm.seqs.cu = p.varlen() ? t.cu_seqlens : nullptr;
  prm.seqs.cu_is_64 = p.cu_seqlens_dtype == DType::kI64;
  prm.seqs.row_len = p.seq_len;
  prm.seqs.total = T;
  prm.seqs.num_seqs = N;
  prm.num_heads = static_cast<int>(p.num_heads);
  prm.gate_mode = p.gate == GateMode::kLowerBound ? 0 : 1;
  prm.lower_bound = p.lower_bound;
  prm.scale = p.effective_scale();
  prm.h0 = t.initial_state;
  prm.h0_kind = t.initial_state ? state_kind(p.initial_state_dtype) : 0;
  prm.ht = t.final_state;
  prm.ht_kind = t.final_state ? state_kind(p.final_state_dtype) : 0;
  prm.out = static_cast<bf16*>(t.out);
  prm.status = t.device_status;
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(ws.ptr);
  prm.records = reinterpret_cast<unsigned char*>((base + kWorkspaceAlignment - 1) & ~(kWorkspaceAlignment - 1));
  std::uint64_t slots = 0;
  num_chunk_slots(static_cast<std::uint64_t>(T), static_cast<std::uint64_t>(N), &slots);
  prm.num_slots = static_cast<std::int64_t>(slots);
  prm.state_slots = p.num_state_slots > 0 ? t.state_slots : nullptr;
  prm.num_state_slots = p.num_state_slots;
  const int sms = current_device_sm_count();
  const SegmentPlan plan = plan_segments(T, N, p.num_heads, sms);
  prm.seg_chunks = plan.seg_chunks;
  prm.seg_blocks = plan.split ? reinterpret_cast<float*>(prm.records + slots * static_cast<std::uint64_t>(p.num_heads) *
                                                                            ChunkRecord::kBytes)
                              : nullptr;

  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (T > 0) {
    KDA_NVTX_RANGE("kda.prefill.prepare");
    dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(p.num_heads));
    cudaError_t err = cudaFuncSetAttribute(kda_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sizeof(PrepSmem)));
    if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_prepare_kernel)");
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kPrepThreads);
    cfg.dynamicSmemBytes = sizeof(PrepSmem);
    cfg.stream = stream;
    st = cuda_status(cudaLaunchKernelEx(&cfg, kda_prepare_kernel, prm), "kda_prepare_kernel");
    if (!st.ok()) return st;
  }
  KDA_NVTX_RANGE("kda.prefill.recurrence");
  // Block shape, measured on the H200 (docs/PERFORMANCE-NOTES.md): with at least one work item
  // (segment, head) per SM, one 128-column block per item (the chunk record read once, 8 warps
  // sharing it); with fewer, two 64-column blocks, and below a quarter of the SMs four 32-column
  // blocks, to keep more SMs busy.
  const std::int64_t items = plan.seg_slots * p.num_heads;
  auto run = [&](auto warps_tag) -> Status {
    constexpr int kWarps = decltype(warps_tag)::value;
    constexpr int kColumnBlocks = D / (kWarps * 16);
    if (!plan.split) return launch_recurrence<kWarps, RecurrencePass::kFirst, false>(prm, N, kColumnBlocks, stream);
    Status s1 = launch_recurrence<kWarps, RecurrencePass::kFirst, true>(prm, plan.seg_slots, 2 * kColumnBlocks, stream);
    if (!s1.ok()) return s1;
    {
      KDA_NVTX_RANGE("kda.prefill.segment_scan");
      s1 = launch_segment_scan(prm, N, stream);
      if (!s1.ok()) return s1;
    }
    return launch_recurrence<kWarps, RecurrencePass::kSecond, true>(prm, plan.seg_slots, kColumnBlocks, stream);
  };
  if (items >= sms) return run(std::integral_constant<int, 8>{});
  if (4 * items >= sms) return run(std::integral_constant<int, 4>{});
  return run(std::integral_constant<int, 2>{});
}

}  // namespace kda
