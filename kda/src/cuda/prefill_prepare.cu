// kda_prepare_kernel: the token-parallel phase of the CUDA prefill (see prefill_kernels.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/prefill_kernels.cuh"

namespace kda::detail {
namespace {

constexpr int kPrepThreads = 128;  // 4 warps; in the elementwise steps one thread per channel d
constexpr int kPad = D + 1;        // fp32 rows of the exact path, padded against bank conflicts
// The factored path splits exp(G_i - G_j) = exp(G_i - r) exp(r - G_j) around a per-channel
// reference r = (G_0 + G_last) / 2, the middle of the chunk's decay range: every factor then lies
// in [exp(-half), exp(half)], half = (G_0 - G_last) / 2. Above this half range (natural log) a
// factor could overflow or lose the smallest terms: such chunks take the exact path that
// exponentiates differences G_i - G_j <= 0 only. The bounded gate (lower_bound >= -5, 16 tokens:
// half <= 40) always stays below it; the softplus gate passes it only above ~10 nats of decay per
// token.
constexpr float kFactoredHalfRange = 80.0f;

struct PrepSmem {
  bf16 q[C][kRowPad];  // raw inputs of the chunk (padded tokens zero); q and k are reused for the
  bf16 k[C][kRowPad];  // W and U0 outputs once the last reader (step 4) is done
  bf16 v[C][kRowPad];
  union {  // thread d reads g[t][d] for every t before it writes kg[t][d]
    bf16 g[C][kRowPad];
    bf16 kg[C][kRowPad];  // factored path: k_hat * exp(G - r)  (feeds A)
  };
  // scale * q_hat * exp(G) (record: Q~); in the factored path it first holds the Gram operand
  // scale * q_hat * exp(G - r) (feeds M) and takes Q~ once the Gram products are done.
  bf16 qg[C][kRowPad];
  bf16 kd[C][kRowPad];  // k_hat * exp(G_last - G)         (record: K^)
  union {
    struct {
      bf16 ki[C][kRowPad];  // factored path: k_hat * exp(r - G), and what bf16 left of it
      bf16 ki_lo[C][kRowPad];
    } fac;
    float G[C][kPad];  // exact path: the cumulative gate itself
  };
  bf16 m[C][kMPad];   // record: M (its bf16 remainder m_lo goes into qg's and kd's row padding)
  float A[C][C + 4];  // 16-byte rows: read back as float4
  float beta[C];
  float inv_norm[2][C];
  float range[4];
  std::uint64_t inputs_ready;  // mbarrier of the input copies
};

// 16 x 16 += X Y^T over the 128 channels, X and Y 16 x 128 tiles in shared memory (one warp), each
// a bf16 pair (hi + lo): X_hi Y_hi^T + X_hi Y_lo^T + X_lo Y_hi^T (the lo lo term is below fp32's
// rounding). The three products accumulate apart, so each mma chain is 8 deep as with one product
// (the warp's latency, not its issue rate, bounds this step). acc[nt][0..1]: (row gq, cols
// 8 nt + 2 tq + {0,1}); acc[nt][2..3]: row gq + 8.
__device__ __forceinline__ void gram16_pair(float (&acc)[2][4], const bf16 (*x_hi)[kRowPad],
                                            const bf16 (*x_lo)[kRowPad],
                                            const bf16 (*y_hi)[kRowPad],
                                            const bf16 (*y_lo)[kRowPad], int lane) {
  const int lrow = (lane & 7) + ((lane >> 4) << 3);
  const int lcol = ((lane >> 3) & 1) * 8;
  float hl[2][4] = {}, lh[2][4] = {};
#pragma unroll 2
  for (int kt = 0; kt < D / 16; ++kt) {
    unsigned a[4], a_lo[4], b0, b1, b2, b3;
    ldmatrix_x4(a[0], a[1], a[2], a[3], &x_hi[lane & 15][kt * 16 + (lane >> 4) * 8]);
    ldmatrix_x4(a_lo[0], a_lo[1], a_lo[2], a_lo[3], &x_lo[lane & 15][kt * 16 + (lane >> 4) * 8]);
    ldmatrix_x4(b0, b1, b2, b3, &y_hi[lrow][kt * 16 + lcol]);
    mma_bf16(acc[0], a, b0, b1);
    mma_bf16(acc[1], a, b2, b3);
    mma_bf16(lh[0], a_lo, b0, b1);
    mma_bf16(lh[1], a_lo, b2, b3);
    ldmatrix_x4(b0, b1, b2, b3, &y_lo[lrow][kt * 16 + lcol]);
    mma_bf16(hl[0], a, b0, b1);
    mma_bf16(hl[1], a, b2, b3);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[nt][r] += hl[nt][r] + lh[nt][r];
  }
}

// M's bf16 remainder, into the record's padding (workspace_layout.hpp: kMloColumn).
__device__ __forceinline__ void store_m_lo(PrepSmem& sm, int i, int j, bf16 value) {
  (j < 8 ? sm.qg[i][kMloColumn + j] : sm.kd[i][kMloColumn + j - 8]) = value;
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
  const float a_log_h = p.in.A_log[h];
  const float dtb = p.in.dt_bias[h * D + tid];
  // The first slot's blocks (one per head) check the gate parameters for everyone.
  if (slot == 0 && gate_params_bad(tid == 0 ? a_log_h : 0.f, dtb))
    report_status(p.status, kDeviceStatusGateParams);

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
      const bf16* src = tensor == 0 ? p.in.q : tensor == 1 ? p.in.k : tensor == 2 ? p.in.v : p.in.g;
      bf16(*dst)[kRowPad] = tensor == 0 ? sm.q : tensor == 1 ? sm.k : tensor == 2 ? sm.v : sm.g;
      if (row < nvalid) {
        mbarrier_expect_tx(&sm.inputs_ready, D * 2);
        bulk_copy_to_shared(&dst[row][0], src + ((tok0 + row) * H + h) * D, D * 2,
                            &sm.inputs_ready);
      } else {
        uint4* z = reinterpret_cast<uint4*>(&dst[row][0]);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) z[i] = make_uint4(0, 0, 0, 0);
      }
    }
    if (tid < C)
      sm.beta[tid] =
          tid < nvalid ? sigmoid_f(__bfloat162float(p.in.beta[(tok0 + tid) * H + h])) : 0.f;
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
      if (t < nvalid)
        acc += gate_activation(p.gate, __bfloat162float(sm.g[t][d]), a_exp, dtb, p.lower_bound);
      G[t] = acc;
    }
  }
  const float g_last = G[C - 1];
  const float half_range = 0.5f * (G[0] - g_last);  // G_0 - r = r - G_last
  float range = half_range;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) range = fmaxf(range, __shfl_xor_sync(0xffffffffu, range, o));
  if (lane == 0) sm.range[warp] = range;
  __syncthreads();  // also publishes inv_norm
  const bool factored =
      fmaxf(fmaxf(sm.range[0], sm.range[1]), fmaxf(sm.range[2], sm.range[3])) < kFactoredHalfRange;

  unsigned char* rec = record_ptr(p, slot, h);
  const float gl_d = __expf(g_last);
  reinterpret_cast<float*>(rec + ChunkRecord::kGl)[d] = gl_d;
  const float ref = g_last + half_range;          // r, this channel's reference
  const float ref_to_last = __expf(-half_range);  // exp(G_last - r)
  float kt[C];   // K~ column d in fp32, for the forward substitution
  float qgv[C];  // Q~ column d in fp32: the record's, stored after the Gram products
#pragma unroll
  for (int t = 0; t < C; ++t) {
    const float qh = __bfloat162float(sm.q[t][d]) * sm.inv_norm[0][t];
    const float kh = __bfloat162float(sm.k[t][d]) * sm.inv_norm[1][t];
    const float eg = __expf(G[t]);
    kt[t] = kh * eg;
    qgv[t] = p.scale * qh * eg;
    if (factored) {
      // The Gram operands around the reference, each a bf16 pair; exp(G_last - G) =
      // exp(G_last - r) exp(r - G) saves an exp.
      const float e_fwd = __expf(G[t] - ref), e_back = __expf(ref - G[t]);
      const float kg = kh * e_fwd, qg = p.scale * qh * e_fwd, ki = kh * e_back;
      const bf16 kg_hi = __float2bfloat16(kg), qg_hi = __float2bfloat16(qg);
      const bf16 ki_hi = __float2bfloat16(ki);
      sm.kg[t][d] = kg_hi;
      sm.qg[t][d] = qg_hi;
      sm.fac.ki[t][d] = ki_hi;
      sm.fac.ki_lo[t][d] = __float2bfloat16(ki - __bfloat162float(ki_hi));
      sm.kd[t][d] = __float2bfloat16(ki * ref_to_last);
      // What bf16 left of qg and kg, over this thread's own (already read) q and k inputs: the
      // factored path reads them no more.
      sm.q[t][d] = __float2bfloat16(qg - __bfloat162float(qg_hi));
      sm.k[t][d] = __float2bfloat16(kg - __bfloat162float(kg_hi));
    } else {
      sm.qg[t][d] = __float2bfloat16(qgv[t]);
      sm.kd[t][d] = __float2bfloat16(kh * __expf(g_last - G[t]));
      sm.G[t][d] = G[t];
    }
  }
  __syncthreads();

  // 4. A (strictly lower, times beta_i) and M (lower with diagonal, scale inside qg).
  if (factored) {
    // exp(G_i - G_j) = exp(G_i - r) exp(r - G_j): two 16 x 16 x 128 Gram products on the tensor
    // cores, each operand a bf16 pair (hi + lo), hi hi + hi lo + lo hi: fp32-like sums (the bf16
    // operands alone cost 2.3e-3 of out error, kda-chunk-emulation). Entries above the diagonal
    // (i < j, up to exp(2 half)) may overflow; they are discarded, never multiplied.
    if (warp < 2) {
      float acc[2][4] = {};
      const bf16(*x_hi)[kRowPad] = warp == 0 ? sm.kg : sm.qg;
      const bf16(*x_lo)[kRowPad] = warp == 0 ? sm.k : sm.q;
      gram16_pair(acc, x_hi, x_lo, sm.fac.ki, sm.fac.ki_lo, lane);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = gq + (r >> 1) * 8, jj = nt * 8 + 2 * tq + (r & 1);
          if (warp == 0) {
            sm.A[i][jj] = i > jj ? sm.beta[i] * acc[nt][r] : 0.f;
          } else {
            const float mv = i >= jj ? acc[nt][r] : 0.f;
            const bf16 m_hi = __float2bfloat16(mv);
            sm.m[i][jj] = m_hi;
            store_m_lo(sm, i, jj, __float2bfloat16(mv - __bfloat162float(m_hi)));
          }
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
      const float mv = i >= jj ? p.scale * m * sm.inv_norm[0][i] * sm.inv_norm[1][jj] : 0.f;
      const bf16 m_hi = __float2bfloat16(mv);
      sm.m[i][jj] = m_hi;
      store_m_lo(sm, i, jj, __float2bfloat16(mv - __bfloat162float(m_hi)));
    }
  }
  __syncthreads();

  // 5. Forward substitution in fp32, thread d owning column d:
  //    (I + A) [W | U0] = diag(beta) [K~ | V]. q and k are dead now: W and U0 take their place,
  //    and the factored path's Gram operand in qg gives way to the record's Q~.
  {
    if (factored) {
#pragma unroll
      for (int t = 0; t < C; ++t) sm.qg[t][d] = __float2bfloat16(qgv[t]);
    }
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
  // 6. The tiles go out by the copy engine: every writer fences its shared-memory stores against
  //    the async proxy, then one thread issues the bulk stores and waits for them before the
  //    block ends.
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

}  // namespace

Status launch_prepare(const PrefillParams& prm, std::int64_t chunk_slots, cudaStream_t stream) {
  cudaError_t err =
      cudaFuncSetAttribute(kda_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(sizeof(PrepSmem)));
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_prepare_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(chunk_slots), static_cast<unsigned>(prm.num_heads));
  cfg.blockDim = dim3(kPrepThreads);
  cfg.dynamicSmemBytes = sizeof(PrepSmem);
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kda_prepare_kernel, prm), "kda_prepare_kernel");
}

}  // namespace kda::detail
