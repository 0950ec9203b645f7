// kda_prepare_kernel: the token-parallel phase of the CUDA prefill (see prefill_kernels.cuh).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.hpp"
#include "cuda/prefill_kernels.cuh"
#include "cuda/shared_memory.cuh"  // allow_shared_memory
#include "kda/detail/prepare_paths.hpp"

namespace kda::detail {
namespace {

constexpr int kPrepThreads = 128;  // 4 warps
// The elementwise steps give each thread a pair of adjacent channels (bf16x2 loads, conversions
// and stores) and half of the chunk's tokens: thread t owns channels 2 (t % 64) + {0, 1} of tokens
// 8 (t / 64) .. 8 (t / 64) + 7.
constexpr int kHalf = C / 2;
constexpr int kLowerPairs = C * (C - 1) / 2;  // 120 strictly lower (i, j) of a chunk
static_assert(kLowerPairs + C / 2 == kPrepThreads, "exact path: a pair or two diagonals a thread");
constexpr int kPad = D + 2;  // fp32 rows of the exact path: 8-byte aligned, distinct banks per row
// The factored path splits exp(G_i - G_j) = exp(G_i - r) exp(r - G_j) around a per-channel
// reference r, so that A and M are Gram products on the tensor cores. Two references:
// - r = 0 (the chunk start) while every channel's decay over the chunk stays below 80 nats: the
//   factors exp(G) and exp(-G) are then normal fp32 (and bf16) numbers, and the operands k_hat
//   exp(G) = K~ and scale q_hat exp(G) = Q~ are the record's Q~ and W's operand themselves. The
//   bounded gate (lower_bound >= -5, 16 tokens: at most 80 nats) always takes it.
// - r = (G_0 + G_last) / 2, the middle of the channel's decay range, while that half range stays
//   below 80 nats: every factor lies within exp(+-half); Q~ and K~ are taken from the operands
//   afterwards. The softplus gate needs it above ~5 nats of decay per token.
// Above that, chunks take the exact path that exponentiates differences G_i - G_j <= 0 only. The
// kernel works in log2 units (G times log2(e)), so that every exp is one ex2. The rule, with its
// bound, is kda/detail/prepare_paths.hpp's (the tests and kda-bench --paths predict it from there).
constexpr float kFactoredRange2 = static_cast<float>(kPrepareFactoredBoundNats) * kLog2e;

// Blocks per SM: the kernel is bound by the latency of its inputs and of its one-warp steps (the
// Gram products, the substitution), which more resident blocks hide; the shared memory below and
// 64 registers a thread fit eight.
constexpr int kPrepBlocksPerSm = 8;

struct PrepSmem {
  // raw inputs of the chunk (padded tokens zero); q and k then hold the Gram operands' remainders
  // (k: K~'s, W's operand); v arrives over q once the Gram products are done; k takes U0 (fp16
  // bits) at the end
  bf16 q[C][kRowPad];
  bf16 k[C][kRowPad];
  union {  // a thread reads its g elements before anyone writes kg (a block barrier between)
    bf16 g[C][kRowPad];
    bf16 kg[C][kRowPad];  // k_hat * exp(G - r) (feeds A and W; K~ when r = 0 and on the exact path)
                          // and finally the W output
  };
  // scale * q_hat * exp(G) (record: Q~); in the factored path it first holds the Gram operand
  // scale * q_hat * exp(G - r) (feeds M) and takes Q~ once the Gram products are done.
  bf16 qg[C][kRowPad];
  // Three lives, one after the other (a block barrier between): the Gram products' operands (steps
  // 3 and 4), then what steps 5 to 7 keep. Sharing it is what fits kPrepBlocksPerSm blocks.
  union {
    struct {
      // factored paths: k_hat * exp(r - G) and what bf16 left of it (feeds A and M)
      bf16 ki[C][kRowPad];
      bf16 ki_lo[C][kRowPad];
    } fac;
    float G[C][kPad];  // exact path: the cumulative gate itself (log2 units)
    struct {
      __half kd[C][kRowPad];  // k_hat * exp(G_last - G)  (record: K^, fp16)
      float A[C][C + 4];      // 16-byte rows: read back as float4; then T' = (I + A)^-1 diag(beta)
      float er[D];            // middle-reference path: exp(r) per channel, the scale of W's columns
    } late;
  };
  union {
    __half m[C][kMPad];  // record: M (fp16)
    struct {             // step 2's exchange between the two token halves, dead before M is written
      float4 first_half[D / 2];   // per channel pair: G at token 0 and the sum of tokens 0..7
      float2 second_half[D / 2];  // the sum of tokens 8..15
    };
  };
  float beta[C];
  float inv_norm[2][C];
  float range[4];  // per warp: the largest half range and the largest decay
  float decay[4];
  // mbarriers of the input copies: q, k and g (steps 2 to 5), and v, which only step 6 reads
  // (copied once q's tile is free, so that step 5 overlaps the copies)
  std::uint64_t qkg_ready, v_ready;
};

// acc (16 x 16, as in gram16_pair) += X Y^T over the 128 channels, X and Y bf16 16 x 128 tiles in
// shared memory (one warp).
__device__ __forceinline__ void gram16(float (&acc)[2][4], const bf16 (*x)[kRowPad],
                                       const bf16 (*y)[kRowPad], int lane) {
  const int lrow = (lane & 7) + ((lane >> 4) << 3);
  const int lcol = ((lane >> 3) & 1) * 8;
#pragma unroll 2
  for (int kt = 0; kt < D / 16; ++kt) {
    unsigned a[4], b0, b1, b2, b3;
    ldmatrix_x4(a[0], a[1], a[2], a[3], &x[lane & 15][kt * 16 + (lane >> 4) * 8]);
    ldmatrix_x4(b0, b1, b2, b3, &y[lrow][kt * 16 + lcol]);
    mma_bf16(acc[0], a, b0, b1);
    mma_bf16(acc[1], a, b2, b3);
  }
}

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

// M[i][j] = mv in fp16 (|M| <= scale: unit q_hat and k_hat, decay factors <= 1). As a bf16 pair
// before it cost two more mma a step in the recurrence; fp16 alone errs 2^-12, below the pair's
// gain at three digits (kda-chunk-emulation).
__device__ __forceinline__ void store_m(PrepSmem& sm, int i, int j, float mv) {
  sm.m[i][j] = __float2half_rn(mv);
}

__device__ __forceinline__ std::uint32_t lds32(const bf16* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}
template <typename T16>
__device__ __forceinline__ void sts32(T16* p, std::uint32_t v) {
  static_assert(sizeof(T16) == 2, "two 16-bit elements");
  *reinterpret_cast<std::uint32_t*>(p) = v;
}
// x as a bf16 pair: hi = bf16(x), lo = bf16(x - hi), two channels at once.
__device__ __forceinline__ void split_pair(float2 x, std::uint32_t* hi, std::uint32_t* lo) {
  *hi = pack_bf16x2(x.x, x.y);
  *lo = bf16x2_remainder(x.x, x.y, *hi);
}

// Pipelined, thread 0: publishes the record whose bulk stores it committed last (`*pending`, null
// when none): waits for them to complete, then sets the flag.
__device__ __forceinline__ void publish_pending(std::uint32_t** pending) {
  if (*pending == nullptr) return;
  bulk_wait_all();
  fence_proxy_async_global();  // the stores before the flag, for the copy engine's later reads
  store_release_gpu(*pending, 1u);
  *pending = nullptr;
}

// One (chunk slot, head) item; false for a gap slot (no chunk, the input barriers untouched).
// GATE: p.gate as a template argument, so that the gate's per-element code has no branch.
// PIPELINED: the block's input barriers were initialized once, for 3 C and C arrivals (a padded
// row's thread arrives without bytes), and `phase` is this item's parity on them: re-initializing
// them per item (after mbarrier.inval) left racecheck reporting the next item's q, k, g copies
// against the last one's v copy into q's tile as write-write races (H200). Otherwise they are
// initialized here for this item's rows and `phase` is 0.
// `pending` (PIPELINED, thread 0): the previous item's flag, published once this item's input
// copies are on their way (its stores' completion then overlaps them); this item's flag is left
// there in turn.
template <GateMode GATE, bool PIPELINED>
__device__ __forceinline__ bool prepare_item(const PrefillParams& p, PrepSmem& sm,
                                             const std::int64_t slot, const int h,
                                             const unsigned phase = 0,
                                             std::uint32_t** pending = nullptr) {
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int pc = tid % (D / 2), c0 = 2 * pc;      // this thread's channels c0, c0 + 1
  const int hf = tid / (D / 2), t0 = kHalf * hf;  // and tokens t0 .. t0 + 7

  // The gate parameters first: their latency overlaps the search and the input copies.
  const float a_log_h = p.in.A_log[h];
  const float2 dtb = make_float2(p.in.dt_bias[h * D + c0], p.in.dt_bias[h * D + c0 + 1]);
  // The first slot's blocks (one per head) check the gate parameters for everyone.
  if (slot == 0 && (gate_params_bad(tid == 0 ? a_log_h : 0.f, dtb.x) || !isfinite(dtb.y)))
    report_status(p.status, kDeviceStatusGateParams);
  // Block (s, head 0) checks sequence s's cu_seqlens entries (slot used as a sequence index here;
  // there are at least N slots).
  if (h == 0 && tid == 0 && slot < p.seqs.num_seqs) check_sequence_bounds(p.seqs, slot, p.status);

  const std::int64_t s = owner_of_slot(p.seqs, slot, C, lane);
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t j = slot - (s + bos / C);
  const std::int64_t nchunks = (eos - bos + C - 1) / C;
  if (j < 0 || j >= nchunks) {  // a gap slot: no chunk lives here
    // Pipelined: its flag is set all the same, so that no recurrence block can wait for it forever
    // (with broken cu_seqlens on the device the two kernels' owner searches may disagree; the
    // status word reports those, the outputs are then unspecified).
    if constexpr (PIPELINED) {
      if (tid == 0) store_release_gpu(ready_flag(p, slot, h), 1u);
    }
    return false;
  }
  const std::int64_t tok0 = bos + j * C;
  const int nvalid = static_cast<int>(eos - tok0 < C ? eos - tok0 : C);

  // 1. The chunk's q, k, g rows (v's come in step 5) into shared memory: one 256-byte bulk copy
  //    per (tensor, token), issued by 3 * nvalid threads, each announcing its own bytes on its
  //    tensor's mbarrier (so no thread waits on another's announcement); padded tokens are zeroed.
  const std::int64_t H = p.num_heads;
  auto copy_rows = [&](bf16(*dst)[kRowPad], const bf16* src, int row, std::uint64_t* ready) {
    if (row < nvalid) {
      mbarrier_expect_tx(ready, D * 2);
      bulk_copy_to_shared(&dst[row][0], src + ((tok0 + row) * H + h) * D, D * 2, ready);
    } else {
      uint4* z = reinterpret_cast<uint4*>(&dst[row][0]);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) z[i] = make_uint4(0, 0, 0, 0);
      if constexpr (PIPELINED) mbarrier_arrive(ready);
    }
  };
  {
    if constexpr (!PIPELINED) {
      if (tid == 0) {
        mbarrier_init(&sm.qkg_ready, static_cast<unsigned>(3 * nvalid));
        mbarrier_init(&sm.v_ready, static_cast<unsigned>(nvalid));
      }
      __syncthreads();  // the barriers are initialized before anyone uses them
    }
    if (tid < 3 * C) {
      const int tensor = tid / C;
      bf16(*dst)[kRowPad] = tensor == 0 ? sm.q : tensor == 1 ? sm.k : sm.g;
      const bf16* src = tensor == 0 ? p.in.q : tensor == 1 ? p.in.k : p.in.g;
      copy_rows(dst, src, tid % C, &sm.qkg_ready);
    }
    if (tid < C)
      sm.beta[tid] =
          tid < nvalid ? sigmoid_f(__bfloat162float(p.in.beta[(tok0 + tid) * H + h])) : 0.f;
    if constexpr (PIPELINED) {
      if (tid == 0) publish_pending(pending);
    }
    mbarrier_wait(&sm.qkg_ready, phase);
    __syncthreads();  // the zeroed rows and beta
  }

  // 2. The gate and its cumulative sum over this thread's 8 tokens, in log2 units (every exp of
  //    the kernel is then one ex2); the two halves exchange their sums below. Meanwhile warps 0
  //    and 1 take the inverse L2 norms of the q and k rows from the diagonals of q q^T and k k^T
  //    (tensor cores: bf16 products are exact in fp32).
  float Gx[kHalf], Gy[kHalf];
  {
    const float a_exp = __expf(a_log_h);
    const GateLog2 gx = GateLog2::make(GATE, a_exp, dtb.x, p.lower_bound);
    const GateLog2 gy = GateLog2::make(GATE, a_exp, dtb.y, p.lower_bound);
    // FULL: every token of the chunk valid (all but a sequence's last chunk); otherwise a padded
    // token's gate (of a zeroed g) is computed and dropped, a select, not a branch.
    auto cumulate = [&](auto full_tag) {
      constexpr bool kFull = decltype(full_tag)::value;
      float ax = 0.f, ay = 0.f;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float2 g = unpack_bf16x2(lds32(&sm.g[t0 + i][c0]));
        const bool valid = kFull || t0 + i < nvalid;
        ax += valid ? gx(g.x) : 0.f;
        ay += valid ? gy(g.y) : 0.f;
        Gx[i] = ax;
        Gy[i] = ay;
      }
    };
    if (nvalid == C)
      cumulate(std::true_type{});
    else
      cumulate(std::false_type{});
    const float ax = Gx[kHalf - 1], ay = Gy[kHalf - 1];
    if (hf == 0)
      sm.first_half[pc] = make_float4(Gx[0], Gy[0], ax, ay);
    else
      sm.second_half[pc] = make_float2(ax, ay);
  }
  if (warp < 2) {
    float acc[2][4] = {};
    const bf16(*x)[kRowPad] = warp == 0 ? sm.q : sm.k;
    gram16(acc, x, x, lane);
    // Diagonal (i, i): rows gq and gq + 8 sit with the lanes whose tq == gq / 2.
    if ((gq >> 1) == tq) {
      const bool odd = gq & 1;
      sm.inv_norm[warp][gq] = rsqrtf((odd ? acc[0][1] : acc[0][0]) + 1e-6f);
      sm.inv_norm[warp][gq + 8] = rsqrtf((odd ? acc[1][3] : acc[1][2]) + 1e-6f);
    }
  }
  __syncthreads();  // the half sums and the norms

  const float4 fh = sm.first_half[pc];
  const float2 sh = sm.second_half[pc];
  if (hf == 1) {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      Gx[i] += fh.z;
      Gy[i] += fh.w;
    }
  }
  const float2 g_last = make_float2(fh.z + sh.x, fh.w + sh.y);
  const float2 half_range = make_float2(0.5f * (fh.x - g_last.x), 0.5f * (fh.y - g_last.y));
  {
    float range = fmaxf(half_range.x, half_range.y), decay = -fminf(g_last.x, g_last.y);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      range = fmaxf(range, __shfl_xor_sync(0xffffffffu, range, o));
      decay = fmaxf(decay, __shfl_xor_sync(0xffffffffu, decay, o));
    }
    if (lane == 0) {
      sm.range[warp] = range;
      sm.decay[warp] = decay;
    }
  }
  unsigned char* rec = record_ptr(p, slot, h);
  if (hf == 0) {
    reinterpret_cast<float2*>(rec + ChunkRecord::kGl)[pc] =
        make_float2(fast_exp2(g_last.x), fast_exp2(g_last.y));
  }
  __syncthreads();  // the ranges
  const bool zero_ref =
      fmaxf(fmaxf(sm.decay[0], sm.decay[1]), fmaxf(sm.decay[2], sm.decay[3])) < kFactoredRange2;
  // The bounded gate (lower_bound in [-5, 0), validated) decays at most 15 x 5 nats between a
  // chunk's first and last token: its half range stays below 40 nats, so it is always factored and
  // its instantiations carry no exact-path code.
  constexpr bool kAlwaysFactored = GATE == GateMode::kLowerBound;
  const bool factored =
      kAlwaysFactored || zero_ref ||
      fmaxf(fmaxf(sm.range[0], sm.range[1]), fmaxf(sm.range[2], sm.range[3])) < kFactoredRange2;

  // 3. The scaled operands of this thread's 8 tokens x 2 channels. K^ waits in registers until
  //    step 5: its tile shares memory with the Gram operands.
  const float2 ref = zero_ref ? make_float2(0.f, 0.f)
                              : make_float2(g_last.x + half_range.x, g_last.y + half_range.y);
  std::uint32_t kt_lo[kHalf];   // exact path: K~'s bf16 remainder (over the raw k in step 5)
  std::uint32_t kd_f16[kHalf];  // K^ = k_hat exp(G_last - G), two channels in fp16
  if (factored) {
    // The Gram operands around the reference, each a bf16 pair; exp(G_last - G) =
    // exp(G_last - r) exp(r - G) saves an exp. With r = 0 the operands are Q~ and K~; otherwise
    // Q~ and K~ are taken from them after the Gram products (fewer registers live across them).
    const float2 ref_to_last =
        make_float2(fast_exp2(g_last.x - ref.x), fast_exp2(g_last.y - ref.y));  // exp(G_last - r)
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int t = t0 + i;
      const float iq = sm.inv_norm[0][t] * p.scale, ik = sm.inv_norm[1][t];
      const float2 q = unpack_bf16x2(lds32(&sm.q[t][c0]));
      const float2 k = unpack_bf16x2(lds32(&sm.k[t][c0]));
      const float2 e_fwd = make_float2(fast_exp2(Gx[i] - ref.x), fast_exp2(Gy[i] - ref.y));
      const float2 e_back = make_float2(fast_exp2(ref.x - Gx[i]), fast_exp2(ref.y - Gy[i]));
      const float2 kh = make_float2(k.x * ik, k.y * ik);
      const float2 ki = make_float2(kh.x * e_back.x, kh.y * e_back.y);
      std::uint32_t hi, lo;
      split_pair(make_float2(kh.x * e_fwd.x, kh.y * e_fwd.y), &hi, &lo);
      sts32(&sm.kg[t][c0], hi);
      sts32(&sm.k[t][c0], lo);  // over this thread's own, already read, k elements
      split_pair(make_float2(q.x * iq * e_fwd.x, q.y * iq * e_fwd.y), &hi, &lo);
      sts32(&sm.qg[t][c0], hi);
      sts32(&sm.q[t][c0], lo);
      split_pair(ki, &hi, &lo);
      sts32(&sm.fac.ki[t][c0], hi);
      sts32(&sm.fac.ki_lo[t][c0], lo);
      kd_f16[i] = pack_f16x2(ki.x * ref_to_last.x, ki.y * ref_to_last.y);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int t = t0 + i;
      const float iq = sm.inv_norm[0][t] * p.scale, ik = sm.inv_norm[1][t];
      const float2 q = unpack_bf16x2(lds32(&sm.q[t][c0]));
      const float2 k = unpack_bf16x2(lds32(&sm.k[t][c0]));
      const float2 kh = make_float2(k.x * ik, k.y * ik);
      const float2 eg = make_float2(fast_exp2(Gx[i]), fast_exp2(Gy[i]));
      std::uint32_t hi;  // K~ = k_hat exp(G), W's operand, as a bf16 pair
      split_pair(make_float2(kh.x * eg.x, kh.y * eg.y), &hi, &kt_lo[i]);
      sts32(&sm.kg[t][c0], hi);
      sts32(&sm.qg[t][c0], pack_bf16x2(q.x * iq * eg.x, q.y * iq * eg.y));
      kd_f16[i] =
          pack_f16x2(kh.x * fast_exp2(g_last.x - Gx[i]), kh.y * fast_exp2(g_last.y - Gy[i]));
      *reinterpret_cast<float2*>(&sm.G[t][c0]) = make_float2(Gx[i], Gy[i]);
    }
  }
  __syncthreads();

  // 4. A (strictly lower, times beta_i) and M (lower with diagonal, scale inside qg). A stays in
  //    registers until step 5 (its rows share memory with the operands read here).
  float gram[2][4] = {};  // factored paths, warp 0: A's 16 x 16 Gram product (as in gram16_pair)
  float a_exact = 0.f;    // exact path: the pair (i, j) of this thread, times beta_i
  int ai = 0, aj = 0;
  if (factored) {
    // exp(G_i - G_j) = exp(G_i - r) exp(r - G_j): two 16 x 16 x 128 Gram products on the tensor
    // cores, each operand a bf16 pair (hi + lo), hi hi + hi lo + lo hi: fp32-like sums (the bf16
    // operands alone cost 2.3e-3 of out error, kda-chunk-emulation). Entries above the diagonal
    // (i < j, up to exp(2 half)) may overflow; they are discarded, never multiplied.
    if (warp < 2) {
      const bf16(*x_hi)[kRowPad] = warp == 0 ? sm.kg : sm.qg;
      const bf16(*x_lo)[kRowPad] = warp == 0 ? sm.k : sm.q;
      gram16_pair(gram, x_hi, x_lo, sm.fac.ki, sm.fac.ki_lo, lane);
      if (warp == 1) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = gq + (r >> 1) * 8, jj = nt * 8 + 2 * tq + (r & 1);
            store_m(sm, i, jj, i >= jj ? gram[nt][r] : 0.f);
          }
        }
      }
    }
  } else {
    // Exact: every exp() of a difference G_i - G_j <= 0, over channel pairs (bf16x2 and float2
    // loads). Threads 0..119 take one strictly lower pair (i, j) each, A and M, and zero M's
    // mirror entry (j, i); threads 120..127 take two diagonal entries of M each (exp(0) = 1, A's
    // diagonal is 0). Per channel the sums run in the order of channels as before.
    if (tid < kLowerPairs) {
      int i = static_cast<int>((1.f + sqrtf(1.f + 8.f * static_cast<float>(tid))) * 0.5f);
      i -= i * (i - 1) / 2 > tid ? 1 : 0;
      i += (i + 1) * i / 2 <= tid ? 1 : 0;
      const int jj = tid - i * (i - 1) / 2;
      float a = 0.f, m = 0.f;
#pragma unroll 8
      for (int c = 0; c < D; c += 2) {
        const float2 gi = *reinterpret_cast<const float2*>(&sm.G[i][c]);
        const float2 gj = *reinterpret_cast<const float2*>(&sm.G[jj][c]);
        const float2 kj = unpack_bf16x2(lds32(&sm.k[jj][c]));
        const float2 ki = unpack_bf16x2(lds32(&sm.k[i][c]));
        const float2 qi = unpack_bf16x2(lds32(&sm.q[i][c]));
        const float kjx = kj.x * fast_exp2(gi.x - gj.x), kjy = kj.y * fast_exp2(gi.y - gj.y);
        a = fmaf(ki.x, kjx, a);
        m = fmaf(qi.x, kjx, m);
        a = fmaf(ki.y, kjy, a);
        m = fmaf(qi.y, kjy, m);
      }
      ai = i;
      aj = jj;
      a_exact = sm.beta[i] * a * sm.inv_norm[1][i] * sm.inv_norm[1][jj];
      store_m(sm, i, jj, p.scale * m * sm.inv_norm[0][i] * sm.inv_norm[1][jj]);
      store_m(sm, jj, i, 0.f);
    } else {
      const int d0 = 2 * (tid - kLowerPairs);
      float m0 = 0.f, m1 = 0.f;
#pragma unroll 8
      for (int c = 0; c < D; c += 2) {
        const float2 k0 = unpack_bf16x2(lds32(&sm.k[d0][c]));
        const float2 q0 = unpack_bf16x2(lds32(&sm.q[d0][c]));
        const float2 k1 = unpack_bf16x2(lds32(&sm.k[d0 + 1][c]));
        const float2 q1 = unpack_bf16x2(lds32(&sm.q[d0 + 1][c]));
        m0 = fmaf(q0.y, k0.y, fmaf(q0.x, k0.x, m0));
        m1 = fmaf(q1.y, k1.y, fmaf(q1.x, k1.x, m1));
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = d0 + e;
        store_m(sm, d, d, p.scale * (e == 0 ? m0 : m1) * sm.inv_norm[0][d] * sm.inv_norm[1][d]);
      }
    }
  }
  // v's rows go over q, dead now but on the middle-reference path (step 5 reads Q~'s remainder):
  // every thread orders its accesses to q before the copy engine's writes, the barrier orders
  // them all before the copies; the zeroed padding rows are ordered by step 5's barrier.
  const bool v_after_step5 = factored && !zero_ref;
  fence_proxy_async();
  __syncthreads();
  if (!v_after_step5 && tid < C) copy_rows(sm.q, p.in.v, tid, &sm.v_ready);

  // 5. Over the dead operands: K^ and A from registers (and exp(r) on the middle-reference path);
  //    Q~ (the record's) and, on the exact path, K~'s remainder over the dead raw k; then warp 0
  //    turns A into T' = (I + A)^-1 diag(beta), fp32 (lane j: column j, forward substitution).
  for (int i = 0; i < kHalf; ++i) sts32(&sm.late.kd[t0 + i][c0], kd_f16[i]);
  if (zero_ref) {
    // Q~ is the Gram operand (its hi part already in qg), K~ the pair in kg and k.
  } else if (factored) {
    // Q~ = (Gram operand) exp(r), from its pair (relative error ~2^-17); W takes the factor
    // exp(r) per column after its product with the operand K~ exp(-r).
    const float2 er = make_float2(fast_exp2(ref.x), fast_exp2(ref.y));
    if (hf == 0) *reinterpret_cast<float2*>(&sm.late.er[c0]) = er;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int t = t0 + i;
      const float2 qh = unpack_bf16x2(lds32(&sm.qg[t][c0]));
      const float2 ql = unpack_bf16x2(lds32(&sm.q[t][c0]));
      sts32(&sm.qg[t][c0], pack_bf16x2((qh.x + ql.x) * er.x, (qh.y + ql.y) * er.y));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) sts32(&sm.k[t0 + i][c0], kt_lo[i]);
    if (tid < kLowerPairs) {
      sm.late.A[ai][aj] = a_exact;
      sm.late.A[aj][ai] = 0.f;
    } else {
      const int d0 = 2 * (tid - kLowerPairs);
      sm.late.A[d0][d0] = 0.f;
      sm.late.A[d0 + 1][d0 + 1] = 0.f;
    }
    __syncthreads();  // A, written by every thread, before warp 0's substitution
  }
  if (warp == 0) {
    if (factored) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = gq + (r >> 1) * 8, jj = nt * 8 + 2 * tq + (r & 1);
          sm.late.A[i][jj] = i > jj ? sm.beta[i] * gram[nt][r] : 0.f;
        }
      }
      __syncwarp();
    }
    float tcol[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float x = i == lane ? 1.f : 0.f;
#pragma unroll
      for (int j4 = 0; j4 < i; j4 += 4) {
        const float4 a4 = *reinterpret_cast<const float4*>(&sm.late.A[i][j4]);
        const float arow[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int jj = j4; jj < j4 + 4 && jj < i; ++jj) x = fmaf(-arow[jj - j4], tcol[jj], x);
      }
      tcol[i] = x;
    }
    __syncwarp();  // A is read by this warp only
    if (lane < C) {
      const float b = sm.beta[lane];
#pragma unroll
      for (int i = 0; i < C; ++i) sm.late.A[i][lane] = tcol[i] * b;
    }
  }
  if (v_after_step5) {
    fence_proxy_async();
    __syncthreads();
    if (tid < C) copy_rows(sm.q, p.in.v, tid, &sm.v_ready);
  }
  __syncthreads();  // T' (and v's zeroed padding rows)

  mbarrier_wait(&sm.v_ready, phase);  // every thread: the copies' writes are visible to waiters

  // 6. [W | U0] = T' [K~ | V] on the tensor cores: T' and K~ as bf16 pairs (hi hi + hi lo + lo hi),
  //    V exact in bf16 (T'_hi V + T'_lo V); warp w takes channels 32 w .. 32 w + 31 of both.
  //    W goes over kg, U0 over k; U0 in fp16, scaled by 2^-e into [-2, 2) by the largest magnitude
  //    of the warp's 32 columns (2^e into qg's row 0 padding, workspace_layout.hpp), so that
  //    fp16 holds U0 whatever the scale of v.
  {
    unsigned th[4], tl[4];
    const int rr[4] = {gq, gq + 8, gq, gq + 8}, cc[4] = {2 * tq, 2 * tq, 2 * tq + 8, 2 * tq + 8};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 t2 = *reinterpret_cast<const float2*>(&sm.late.A[rr[r]][cc[r]]);
      split_pair(t2, &th[r], &tl[r]);
    }
    float u_first[2][4];  // U0 of the first half's columns, stored with the second's (one scale)
    static_assert(kScaleGroup == 32, "a warp's 32 U0 columns share a scale");
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int cb = 32 * warp + 16 * half;
      const int lr = lane & 15, lc = cb + ((lane >> 4) << 3);
      float w[2][4] = {}, u[2][4] = {};
      unsigned b0, b1, b2, b3;
      ldmatrix_x4_trans(b0, b1, b2, b3, &sm.kg[lr][lc]);
      mma_bf16(w[0], th, b0, b1);
      mma_bf16(w[1], th, b2, b3);
      mma_bf16(w[0], tl, b0, b1);
      mma_bf16(w[1], tl, b2, b3);
      ldmatrix_x4_trans(b0, b1, b2, b3, &sm.k[lr][lc]);
      mma_bf16(w[0], th, b0, b1);
      mma_bf16(w[1], th, b2, b3);
      ldmatrix_x4_trans(b0, b1, b2, b3, &sm.q[lr][lc]);  // v
      mma_bf16(u[0], th, b0, b1);
      mma_bf16(u[1], th, b2, b3);
      mma_bf16(u[0], tl, b0, b1);
      mma_bf16(u[1], tl, b2, b3);
      // kg and k held K~'s pair for this warp's own columns: every lane's ldmatrix above is done
      // before any lane overwrites them with W and U0.
      __syncwarp();
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int c = cb + 8 * nt + 2 * tq;
        if (factored && !zero_ref) {
          const float2 er = *reinterpret_cast<const float2*>(&sm.late.er[c]);
          w[nt][0] *= er.x;
          w[nt][1] *= er.y;
          w[nt][2] *= er.x;
          w[nt][3] *= er.y;
        }
        sts32(&sm.kg[gq][c], pack_bf16x2(w[nt][0], w[nt][1]));
        sts32(&sm.kg[gq + 8][c], pack_bf16x2(w[nt][2], w[nt][3]));
      }
      if (half == 0) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) u_first[nt][r] = u[nt][r];
        }
      } else {
        // The scale of the warp's 32 U0 columns (both halves): |x| as bits orders like x.
        float mx = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) mx = fmaxf(mx, fmaxf(fabsf(u[nt][r]), fabsf(u_first[nt][r])));
        }
        mx = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(mx)));
        const int e = scale_exponent(mx);
        const float inv = pow2f(-e);
        // The scale goes to the record by a plain store, not through the qg tile's bulk copy
        // (which skips those bytes): the recurrence reads it with plain loads too, and a
        // copy-engine write is only known to be complete, and is only seen as a write by
        // compute-sanitizer's initcheck, through the async proxy.
        if (lane == 0) {
          record_scales(rec)[warp] = pow2f(e);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int c = 32 * warp + 16 * hh + 8 * nt + 2 * tq;
            const float(&uu)[4] = hh == 0 ? u_first[nt] : u[nt];
            sts32(&sm.k[gq][c], pack_f16x2(uu[0] * inv, uu[1] * inv));
            sts32(&sm.k[gq + 8][c], pack_f16x2(uu[2] * inv, uu[3] * inv));
          }
        }
      }
    }
  }
  // 7. The tiles go out by the copy engine: every writer fences its shared-memory stores against
  //    the async proxy, then one thread issues the bulk stores and waits for them before the
  //    block ends.
  // Pipelined: the fence covers the generic global stores too (g_last's factors, U0's scales),
  // which the flag publishes along with the bulk stores.
  if constexpr (PIPELINED) {
    fence_proxy_async_all();
  } else {
    fence_proxy_async();
  }
  __syncthreads();
  if (tid == 0) {
    constexpr unsigned kTile = static_cast<unsigned>(ChunkRecord::kTileBytes);
    // qg without row 0's padding (U0's group scales, stored above).
    constexpr unsigned kRow0 = ChunkRecord::kScales - ChunkRecord::kQg;
    constexpr unsigned kRowBytes = kRowPad * sizeof(bf16);
    bulk_copy_to_global(rec + ChunkRecord::kQg, sm.qg, kRow0);
    bulk_copy_to_global(rec + ChunkRecord::kQg + kRowBytes, &sm.qg[1][0], kTile - kRowBytes);
    bulk_copy_to_global(rec + ChunkRecord::kKd, sm.late.kd, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kW, sm.kg, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kU, sm.k, kTile);
    bulk_copy_to_global(rec + ChunkRecord::kM, sm.m, static_cast<unsigned>(C * kMPad * 2));
    bulk_commit_and_wait_read();
    // Pipelined: the record (its tiles by the copy engine, the scales by plain stores before the
    // barrier above) must be in memory before its flag says so: published by the next item, or
    // at the end of the block's items.
    if constexpr (PIPELINED) *pending = ready_flag(p, slot, h);
  }
  return true;
}

// PIPELINED: a persistent grid over the items (prm.ready set), else one block per item.
template <GateMode GATE, bool PIPELINED>
__global__ void __launch_bounds__(kPrepThreads, kPrepBlocksPerSm)
    kda_prepare_kernel(const PrefillParams p) {
  extern __shared__ __align__(16) unsigned char prep_smem_raw[];
  PrepSmem& sm = *reinterpret_cast<PrepSmem*>(prep_smem_raw);
  // 228 KB of shared memory per SM, 1 KB of it reserved per block
  static_assert(kPrepBlocksPerSm * (sizeof(PrepSmem) + 1024) <= 228 * 1024, "blocks per SM");
  static_assert(kPrepPipelinedBlocksPerSm <= kPrepBlocksPerSm, "the persistent grid is resident");
  if constexpr (!PIPELINED) {
    prepare_item<GATE, false>(p, sm, blockIdx.x, static_cast<int>(blockIdx.y));
    return;
  }
  // Pipelined: a resident grid; the recurrence may start now (it waits for each record's flag).
  // Items slot by slot, the heads of a slot side by side, so that every head's chunks become
  // ready in order as the recurrence consumes them.
  griddep_launch_dependents();
  if (threadIdx.x == 0) {
    mbarrier_init(&sm.qkg_ready, static_cast<unsigned>(3 * C));
    mbarrier_init(&sm.v_ready, static_cast<unsigned>(C));
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
  const std::int64_t H = p.num_heads, items = p.num_chunk_slots * H;
  unsigned phase = 0;
  std::uint32_t* pending = nullptr;  // thread 0's: see prepare_item
  for (std::int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    if (prepare_item<GATE, true>(p, sm, w / H, static_cast<int>(w % H), phase, &pending)) {
      phase ^= 1u;
    }
    __syncthreads();  // the item's shared memory (read by its bulk stores) before the next one's
  }
  if (threadIdx.x == 0) publish_pending(&pending);
}

}  // namespace

namespace {

template <GateMode GATE, bool kPipelined>
Status launch_prepare_kernel(const PrefillParams& prm, std::int64_t chunk_slots,
                             int pipelined_blocks_per_sm, cudaStream_t stream) {
  // All of the SM's unified memory as shared memory, or kPrepBlocksPerSm blocks do not fit.
  const cudaError_t err = allow_shared_memory<kda_prepare_kernel<GATE, kPipelined>>(
      static_cast<int>(sizeof(PrepSmem)), /*max_shared_carveout=*/true);
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_prepare_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(chunk_slots), static_cast<unsigned>(prm.num_heads));
  if constexpr (kPipelined) {
    const std::int64_t items = chunk_slots * prm.num_heads;
    const int per_sm = pipelined_blocks_per_sm < 1                  ? 1
                       : pipelined_blocks_per_sm > kPrepBlocksPerSm ? kPrepBlocksPerSm
                                                                    : pipelined_blocks_per_sm;
    const std::int64_t grid = static_cast<std::int64_t>(per_sm) * current_device_sm_count();
    cfg.gridDim = dim3(static_cast<unsigned>(items < grid ? items : grid));
  }
  cfg.blockDim = dim3(kPrepThreads);
  cfg.dynamicSmemBytes = sizeof(PrepSmem);
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kda_prepare_kernel<GATE, kPipelined>, prm),
                     "kda_prepare_kernel");
}

}  // namespace

Status launch_prepare(const PrefillParams& prm, std::int64_t chunk_slots,
                      int pipelined_blocks_per_sm, cudaStream_t stream) {
  const bool pipelined = prm.ready != nullptr;
  if (prm.gate == GateMode::kLowerBound) {
    return pipelined ? launch_prepare_kernel<GateMode::kLowerBound, true>(
                           prm, chunk_slots, pipelined_blocks_per_sm, stream)
                     : launch_prepare_kernel<GateMode::kLowerBound, false>(
                           prm, chunk_slots, pipelined_blocks_per_sm, stream);
  }
  return pipelined ? launch_prepare_kernel<GateMode::kSoftplus, true>(
                         prm, chunk_slots, pipelined_blocks_per_sm, stream)
                   : launch_prepare_kernel<GateMode::kSoftplus, false>(
                         prm, chunk_slots, pipelined_blocks_per_sm, stream);
}

}  // namespace kda::detail
