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
// Chunk records stream through a 3-stage cp.async ring in shared memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"
#include "kda/nvtx.hpp"
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
};

__device__ __forceinline__ unsigned char* record_ptr(const PrefillParams& p, std::int64_t slot, int h) {
  return p.records + (slot * p.num_heads + h) * static_cast<std::int64_t>(ChunkRecord::kBytes);
}

// ---------------------------------------------------------------------------------------------
// Phase 1
// ---------------------------------------------------------------------------------------------
constexpr int kPrepThreads = 128;  // one thread per channel d
constexpr int kPad = D + 1;        // fp32 rows padded so that threads reading [i][d] for different i
                                   // hit different banks

struct PrepSmem {
  float qn[C][kPad];   // scale-free normalized q
  float kn[C][kPad];   // normalized k
  float G[C][kPad];    // in-chunk cumulative gate
  float A[C][C + 1];   // beta_i * k_i . k_j * exp(G_i - G_j), i > j
  float M[C][C + 1];   // scale * q_i . k_j * exp(G_i - G_j), i >= j
  float part[4][2][C];  // per-warp partial sums of squares
  float beta[C];
  float inv_norm[2][C];
};

// Finds the sequence owning chunk slot `slot`: the largest s with s + start(s) / C <= slot.
__device__ __forceinline__ std::int64_t owner_of_slot(const SeqIndex& seqs, std::int64_t slot) {
  std::int64_t lo = 0, hi = seqs.num_seqs - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    std::int64_t b = seqs.start(mid);
    b = b < 0 ? 0 : (b > seqs.total ? seqs.total : b);
    if (mid + b / C <= slot) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kPrepThreads) kda_prepare_kernel(const PrefillParams p) {
  __shared__ PrepSmem sm;
  const std::int64_t slot = blockIdx.x;
  const int h = blockIdx.y;
  const int d = threadIdx.x;
  const int lane = d & 31, warp = d >> 5;

  const std::int64_t s = owner_of_slot(p.seqs, slot);
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t first_slot = s + bos / C;
  const std::int64_t j = slot - first_slot;
  const std::int64_t nchunks = (eos - bos + C - 1) / C;
  if (j < 0 || j >= nchunks) return;  // a gap slot: no chunk lives here
  const std::int64_t tok0 = bos + j * C;
  const int nvalid = static_cast<int>(eos - tok0 < C ? eos - tok0 : C);

  const std::int64_t H = p.num_heads;
  const float a_exp = __expf(p.A_log[h]);
  const float dtb = p.dt_bias[h * D + d];

  float qv[C], kv[C], gv[C], vv[C];
#pragma unroll
  for (int t = 0; t < C; ++t) {
    if (t < nvalid) {
      const std::int64_t off = ((tok0 + t) * H + h) * D + d;
      qv[t] = __bfloat162float(p.q[off]);
      kv[t] = __bfloat162float(p.k[off]);
      gv[t] = __bfloat162float(p.g[off]);
      vv[t] = __bfloat162float(p.v[off]);
    } else {
      qv[t] = kv[t] = gv[t] = vv[t] = 0.f;
    }
  }
  if (d < C) {
    sm.beta[d] = d < nvalid ? sigmoid_f(__bfloat162float(p.beta[(tok0 + d) * H + h])) : 0.f;
  }

  // Sums of squares per token: warp shuffle, then across the 4 warps.
#pragma unroll
  for (int t = 0; t < C; ++t) {
    float sq = qv[t] * qv[t], sk = kv[t] * kv[t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    if (lane == 0) {
      sm.part[warp][0][t] = sq;
      sm.part[warp][1][t] = sk;
    }
  }
  __syncthreads();
  if (d < 2 * C) {
    const int which = d / C, t = d % C;
    const float ss = sm.part[0][which][t] + sm.part[1][which][t] + sm.part[2][which][t] +
                     sm.part[3][which][t];
    sm.inv_norm[which][t] = rsqrtf(ss + 1e-6f);
  }
  __syncthreads();

  // Gate and its cumulative sum over the chunk (padded tokens have g = 0: no decay).
  float G[C];
  float acc = 0.f;
#pragma unroll
  for (int t = 0; t < C; ++t) {
    if (t < nvalid) acc += gate_activation(p.gate_mode, gv[t], a_exp, dtb, p.lower_bound);
    G[t] = acc;
    qv[t] *= sm.inv_norm[0][t];
    kv[t] *= sm.inv_norm[1][t];
    sm.qn[t][d] = qv[t];
    sm.kn[t][d] = kv[t];
    sm.G[t][d] = G[t];
  }
  __syncthreads();

  // A and M: 136 pairs (i >= j). Warp w sums channels [32w, 32w + 32) of every pair (a lane per
  // pair), writes its partial to shared memory, and the four partials are added afterwards.
  // Pair index pidx = i * (i + 1) / 2 + j.
  {
    __shared__ float partA[4][C * (C + 1) / 2];
    __shared__ float partM[4][C * (C + 1) / 2];
    constexpr int kPairs = C * (C + 1) / 2;  // 136
    for (int pidx = lane; pidx < kPairs; pidx += 32) {
      // invert pidx = i*(i+1)/2 + j
      int i = static_cast<int>((sqrtf(8.f * pidx + 1.f) - 1.f) * 0.5f);
      while ((i + 1) * (i + 2) / 2 <= pidx) ++i;
      while (i * (i + 1) / 2 > pidx) --i;
      const int jj = pidx - i * (i + 1) / 2;
      float a = 0.f, m = 0.f;
      const int d0 = warp * 32;
#pragma unroll 8
      for (int dd = 0; dd < 32; ++dd) {
        // Every lane reads channel c of its own rows i, jj: rows are 129 floats apart, so distinct
        // rows fall in distinct banks and equal rows broadcast.
        const int c = d0 + dd;
        const float e = __expf(sm.G[i][c] - sm.G[jj][c]);
        const float kj = sm.kn[jj][c] * e;
        a = fmaf(sm.kn[i][c], kj, a);
        m = fmaf(sm.qn[i][c], kj, m);
      }
      partA[warp][pidx] = a;
      partM[warp][pidx] = m;
    }
    __syncthreads();
    for (int pidx = d; pidx < kPairs; pidx += kPrepThreads) {
      int i = static_cast<int>((sqrtf(8.f * pidx + 1.f) - 1.f) * 0.5f);
      while ((i + 1) * (i + 2) / 2 <= pidx) ++i;
      while (i * (i + 1) / 2 > pidx) --i;
      const int jj = pidx - i * (i + 1) / 2;
      const float a = partA[0][pidx] + partA[1][pidx] + partA[2][pidx] + partA[3][pidx];
      const float m = partM[0][pidx] + partM[1][pidx] + partM[2][pidx] + partM[3][pidx];
      sm.A[i][jj] = i > jj ? sm.beta[i] * a : 0.f;
      sm.M[i][jj] = p.scale * m;
    }
    __syncthreads();
  }

  // Forward substitution: (I + A) X = diag(beta) [K~ | V], one column of each per thread.
  float xk[C], xv[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float b = sm.beta[i];
    float rk = b * kv[i] * __expf(G[i]);
    float rv = b * vv[i];
#pragma unroll
    for (int jj = 0; jj < i; ++jj) {
      const float aij = sm.A[i][jj];
      rk = fmaf(-aij, xk[jj], rk);
      rv = fmaf(-aij, xv[jj], rv);
    }
    xk[i] = rk;
    xv[i] = rv;
  }

  unsigned char* rec = record_ptr(p, slot, h);
  bf16* r_qg = reinterpret_cast<bf16*>(rec + ChunkRecord::kQg);
  bf16* r_kd = reinterpret_cast<bf16*>(rec + ChunkRecord::kKd);
  bf16* r_w = reinterpret_cast<bf16*>(rec + ChunkRecord::kW);
  bf16* r_u = reinterpret_cast<bf16*>(rec + ChunkRecord::kU);
  bf16* r_m = reinterpret_cast<bf16*>(rec + ChunkRecord::kM);
  float* r_gl = reinterpret_cast<float*>(rec + ChunkRecord::kGl);
  const float g_last = G[C - 1];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    r_qg[i * D + d] = __float2bfloat16(p.scale * qv[i] * __expf(G[i]));
    r_kd[i * D + d] = __float2bfloat16(kv[i] * __expf(g_last - G[i]));
    r_w[i * D + d] = __float2bfloat16(xk[i]);
    r_u[i * D + d] = __float2bfloat16(xv[i]);
  }
  r_gl[d] = __expf(g_last);
  for (int e = d; e < C * C; e += kPrepThreads) {
    const int i = e / C, jj = e % C;
    r_m[e] = __float2bfloat16(i >= jj ? sm.M[i][jj] : 0.f);
  }
}

// ---------------------------------------------------------------------------------------------
// Phase 2
// ---------------------------------------------------------------------------------------------
constexpr int kStages = 3;
constexpr int kRowPad = D + 8;   // bf16 row stride in shared memory: 272 bytes, so that ldmatrix's 8
                                 // row addresses fall in distinct 16-byte bank groups
constexpr int kMPad = C + 8;     // 48-byte rows for M

struct StageSmem {
  bf16 qg[C][kRowPad];
  bf16 kd[C][kRowPad];
  bf16 w[C][kRowPad];
  bf16 u[C][kRowPad];
  bf16 m[C][kMPad];
  float gl[D];
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
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

// Copies the chunk record of (slot, h) into a stage: 4 padded 16 x 128 bf16 tiles, M, g_last.
template <int THREADS>
__device__ __forceinline__ void load_stage(StageSmem& st, const unsigned char* rec, int tid) {
  constexpr int kTileChunks = C * D * 2 / 16;  // 256 16-byte pieces per 16 x 128 bf16 tile
#pragma unroll
  for (int tile = 0; tile < 4; ++tile) {
    bf16(*dst)[kRowPad] = tile == 0 ? st.qg : tile == 1 ? st.kd : tile == 2 ? st.w : st.u;
    const unsigned char* src = rec + tile * (C * D * 2);
    for (int e = tid; e < kTileChunks; e += THREADS) {
      const int row = e / (D / 8), col = (e % (D / 8)) * 8;
      cp_async16(&dst[row][col], src + e * 16);
    }
  }
  for (int e = tid; e < C * C * 2 / 16 + D * 4 / 16; e += THREADS) {
    if (e < C * C * 2 / 16) {
      const int row = e / 2, col = (e % 2) * 8;
      cp_async16(&st.m[row][col], rec + ChunkRecord::kM + e * 16);
    } else {
      const int f = e - C * C * 2 / 16;
      cp_async16(&st.gl[f * 4], rec + ChunkRecord::kGl + f * 16);
    }
  }
}

template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32) kda_recurrence_kernel(const PrefillParams p) {
  constexpr int THREADS = WARPS * 32;
  constexpr int VB = WARPS * 16;  // V columns per block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StageSmem* stages = reinterpret_cast<StageSmem*>(smem_raw);
  bf16(*so)[VB + 8] = reinterpret_cast<bf16(*)[VB + 8]>(smem_raw + kStages * sizeof(StageSmem));

  const std::int64_t s = blockIdx.x;
  const int h = blockIdx.y;
  const int v_block = blockIdx.z * VB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;  // mma fragment row group / thread-in-group
  const int v_warp = v_block + warp * 16;   // first V column of this warp

  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t nchunks = (eos - bos + C - 1) / C;
  const std::int64_t slot0 = s + bos / C;
  const std::int64_t H = p.num_heads;
  const std::int64_t state_base = (s * H + h) * static_cast<std::int64_t>(D) * D;

  // S^T slice [v_warp + 0..15][0..127] as 16 n-tiles of m16n8 accumulators:
  // acc[n][0..1] -> (row gq, cols 8n + 2tq + {0,1}); acc[n][2..3] -> row gq + 8.
  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::int64_t off = state_base + static_cast<std::int64_t>(v_warp + gq + 8 * r) * D + 8 * n + 2 * tq;
      float x0 = 0.f, x1 = 0.f;
      if (p.h0_kind == 2) {
        const float2 t2 = *reinterpret_cast<const float2*>(static_cast<const float*>(p.h0) + off);
        x0 = t2.x;
        x1 = t2.y;
      } else if (p.h0_kind == 1) {
        const __nv_bfloat162 t2 = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.h0) + off);
        x0 = __bfloat162float(t2.x);
        x1 = __bfloat162float(t2.y);
      }
      acc[n][2 * r] = x0;
      acc[n][2 * r + 1] = x1;
    }
  }

  // Prologue: prefetch the first kStages - 1 chunks.
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) {
    if (c < nchunks && slot0 + c < p.num_slots) load_stage<THREADS>(stages[c], record_ptr(p, slot0 + c, h), tid);
    cp_async_commit();
  }

  for (std::int64_t c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage c is visible to all; every warp is done with chunk c - 1
    {
      const std::int64_t nc = c + kStages - 1;
      if (nc < nchunks && slot0 + nc < p.num_slots)
        load_stage<THREADS>(stages[nc % kStages], record_ptr(p, slot0 + nc, h), tid);
      cp_async_commit();
    }
    const StageSmem& st = stages[c % kStages];

    // X = S^T W^T and Y = S^T Q~^T  (16 v x 16 tokens each, two n-tiles of 8 tokens)
    float X[2][4] = {}, Y[2][4] = {};
    // ldmatrix addresses: lanes 0-7 rows 0-7 col lo, 8-15 rows 0-7 col hi, 16-23 rows 8-15 lo, 24-31 hi
    const int lrow = (lane & 7) + ((lane >> 4) << 3);
    const int lcol = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      unsigned a[4];
      a[0] = pack_bf16x2(acc[2 * kt][0], acc[2 * kt][1]);
      a[1] = pack_bf16x2(acc[2 * kt][2], acc[2 * kt][3]);
      a[2] = pack_bf16x2(acc[2 * kt + 1][0], acc[2 * kt + 1][1]);
      a[3] = pack_bf16x2(acc[2 * kt + 1][2], acc[2 * kt + 1][3]);
      unsigned w0, w1, w2, w3, q0, q1, q2, q3;
      ldmatrix_x4(w0, w1, w2, w3, &st.w[lrow][kt * 16 + lcol]);
      ldmatrix_x4(q0, q1, q2, q3, &st.qg[lrow][kt * 16 + lcol]);
      mma_bf16(X[0], a, w0, w1);
      mma_bf16(X[1], a, w2, w3);
      mma_bf16(Y[0], a, q0, q1);
      mma_bf16(Y[1], a, q2, q3);
    }

    // U^T = U0^T - X   (row v, col token)
    float U[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int t0 = nt * 8 + 2 * tq;
      const int v0 = v_warp + gq;
      U[nt][0] = __bfloat162float(st.u[t0][v0]) - X[nt][0];
      U[nt][1] = __bfloat162float(st.u[t0 + 1][v0]) - X[nt][1];
      U[nt][2] = __bfloat162float(st.u[t0][v0 + 8]) - X[nt][2];
      U[nt][3] = __bfloat162float(st.u[t0 + 1][v0 + 8]) - X[nt][3];
    }
    unsigned ua[4];
    ua[0] = pack_bf16x2(U[0][0], U[0][1]);
    ua[1] = pack_bf16x2(U[0][2], U[0][3]);
    ua[2] = pack_bf16x2(U[1][0], U[1][1]);
    ua[3] = pack_bf16x2(U[1][2], U[1][3]);

    // O^T = Y + U^T M^T
    {
      unsigned m0, m1, m2, m3;
      ldmatrix_x4(m0, m1, m2, m3, &st.m[lrow][lcol]);
      mma_bf16(Y[0], ua, m0, m1);
      mma_bf16(Y[1], ua, m2, m3);
    }

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

    // Output: stage O^T through shared memory, then coalesced 16-byte stores of the valid tokens.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int t0 = nt * 8 + 2 * tq;
      const int vl = warp * 16 + gq;
      so[t0][vl] = __float2bfloat16(Y[nt][0]);
      so[t0 + 1][vl] = __float2bfloat16(Y[nt][1]);
      so[t0][vl + 8] = __float2bfloat16(Y[nt][2]);
      so[t0 + 1][vl + 8] = __float2bfloat16(Y[nt][3]);
    }
    __syncthreads();
    {
      const std::int64_t tok0 = bos + c * C;
      const int nvalid = static_cast<int>(eos - tok0 < C ? eos - tok0 : C);
      constexpr int kPieces = VB / 8;  // 16-byte pieces per token row
      for (int e = tid; e < nvalid * kPieces; e += THREADS) {
        const int t = e / kPieces, pc = e % kPieces;
        const std::int64_t off = ((tok0 + t) * H + h) * D + v_block + pc * 8;
        *reinterpret_cast<uint4*>(p.out + off) = *reinterpret_cast<const uint4*>(&so[t][pc * 8]);
      }
    }
  }
  cp_async_wait<0>();

  if (p.ht_kind != 0) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const std::int64_t off = state_base + static_cast<std::int64_t>(v_warp + gq + 8 * r) * D + 8 * n + 2 * tq;
        if (p.ht_kind == 2) {
          *reinterpret_cast<float2*>(static_cast<float*>(p.ht) + off) =
              make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
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
  return kStages * sizeof(StageSmem) + C * (WARPS * 16 + 8) * sizeof(bf16);
}

template <int WARPS>
Status launch_recurrence(const PrefillParams& prm, std::int64_t num_seqs, cudaStream_t stream) {
  constexpr std::size_t smem = recurrence_smem_bytes<WARPS>();
  cudaError_t err = cudaFuncSetAttribute(kda_recurrence_kernel<WARPS>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_recurrence_kernel)");
  dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(prm.num_heads), 128 / (WARPS * 16));
  kda_recurrence_kernel<WARPS><<<grid, WARPS * 32, smem, stream>>>(prm);
  return launch_status("kda_recurrence_kernel");
}

int state_kind(DType dt) { return dt == DType::kBF16 ? 1 : dt == DType::kF32 ? 2 : 0; }

}  // namespace
}  // namespace kda::detail

namespace kda {

Status forward_cuda(const Problem& p, const Tensors& t, Workspace ws, void* stream_ptr) {
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
  std::size_t need = 0;
  st = workspace_size(p, Backend::kCuda, &need);
  if (!st.ok()) return st;
  if (ws.bytes < need || (need > 0 && ws.ptr == nullptr)) {
    return Status(StatusCode::kWorkspaceTooSmall, "workspace holds " + std::to_string(ws.bytes) +
                                                      " bytes; the CUDA prefill needs " + std::to_string(need));
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
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(ws.ptr);
  prm.records = reinterpret_cast<unsigned char*>((base + kWorkspaceAlignment - 1) & ~(kWorkspaceAlignment - 1));
  std::uint64_t slots = 0;
  num_chunk_slots(static_cast<std::uint64_t>(T), static_cast<std::uint64_t>(N), &slots);
  prm.num_slots = static_cast<std::int64_t>(slots);

  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (T > 0) {
    KDA_NVTX_RANGE("kda.prefill.prepare");
    dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(p.num_heads));
    kda_prepare_kernel<<<grid, kPrepThreads, 0, stream>>>(prm);
    st = launch_status("kda_prepare_kernel");
    if (!st.ok()) return st;
  }
  {
    KDA_NVTX_RANGE("kda.prefill.recurrence");
    // Enough blocks to fill the GPU: split V into more, narrower slices when there are few (seq, head).
    const std::int64_t pairs = N * p.num_heads;
    if (pairs >= 264) return launch_recurrence<4>(prm, N, stream);
    if (pairs >= 66) return launch_recurrence<2>(prm, N, stream);
    return launch_recurrence<1>(prm, N, stream);
  }
}

}  // namespace kda
