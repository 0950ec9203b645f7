// kda_recurrence_kernel: the sequential phase of the CUDA prefill (see prefill_kernels.cuh).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.hpp"
#include "cuda/prefill_kernels.cuh"
#include "cuda/shared_memory.cuh"  // allow_shared_memory

namespace kda::detail {
namespace {

constexpr int kStages = 5;  // deep enough to cover DRAM latency with one or two blocks per SM

// A stage is the byte image of a chunk record (workspace_layout.hpp).
struct StageSmem {
  bf16 qg[C][kRowPad];  // row 0's padding: U0's group scales (f32)
  __half kd[C][kRowPad];
  bf16 w[C][kRowPad];
  __half u[C][kRowPad];
  __half m[C][kMPad];
  float gl[D];
};
static_assert(sizeof(StageSmem) == ChunkRecord::kBytes, "a stage is a record's image");
static_assert(offsetof(StageSmem, m) == ChunkRecord::kM &&
                  offsetof(StageSmem, gl) == ChunkRecord::kGl,
              "a stage is a record's image");

// One record into a stage by the copy engine, completing on `bar`. One thread.
__device__ __forceinline__ void load_stage_bulk(StageSmem& st, const unsigned char* rec,
                                                std::uint64_t* bar) {
  fence_proxy_async();
  mbarrier_expect_tx(bar, static_cast<unsigned>(ChunkRecord::kBytes));
  bulk_copy_to_shared(&st, rec, static_cast<unsigned>(ChunkRecord::kBytes), bar);
}

// out[kt & 1][nt] += S^T T^T over the 128 channels: S^T as bf16 A fragments (8 k-tiles), with
// their remainders sa_lo too where WITH_LO (a bf16 pair, fp32-like), T a 16 x 128 tile of the stage
// (tokens x channels); even and odd k-tiles accumulate apart to halve the chain.
template <bool WITH_LO, int LO_TILES>
__device__ __forceinline__ void state_times_tile(float (&out)[2][2][4], const unsigned (&sa)[8][4],
                                                 const unsigned (&sa_lo)[LO_TILES][4],
                                                 const bf16 (*tile)[kRowPad], int lrow, int lcol) {
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    unsigned b0, b1, b2, b3;
    ldmatrix_x4(b0, b1, b2, b3, &tile[lrow][kt * 16 + lcol]);
    mma_bf16(out[kt & 1][0], sa[kt], b0, b1);
    mma_bf16(out[kt & 1][1], sa[kt], b2, b3);
    if constexpr (WITH_LO) {
      mma_bf16(out[kt & 1][0], sa_lo[kt], b0, b1);
      mma_bf16(out[kt & 1][1], sa_lo[kt], b2, b3);
    }
  }
}

// Where a sequence's state lives: index s, its pool entry, or nowhere (-1: padding, or an entry
// outside the pool, reported once through the status word).
__device__ __forceinline__ std::int64_t state_index(const PrefillParams& p, std::int64_t s,
                                                    bool report) {
  if (p.state_slots == nullptr) return s;
  const std::int64_t slot = p.state_slots[s];
  if (slot >= p.num_state_slots) {
    if (report) report_status(p.status, kDeviceStatusSlot);
    return -1;
  }
  return slot < 0 || slot == p.padding_slot ? -1 : slot;
}

// Calls store(row, col, value) for each pair of this thread's elements of the state slice (acc in
// units of `unit`): row `row` of Sᵀ (0..127; a transition's P^T rows 128..255), columns col and
// col + 1, the values times the unit.
template <int MT, typename Store>
__device__ __forceinline__ void for_each_state_pair(const float (&acc)[MT][16][4], float unit,
                                                    int v_warp, int gq, int tq, Store store) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = v_warp + 16 * mt + gq + 8 * r;
        const int col = 8 * n + 2 * tq;
        store(row, col, make_float2(acc[mt][n][2 * r] * unit, acc[mt][n][2 * r + 1] * unit));
      }
    }
  }
}

// Writes this thread's elements of the state slice into the state of pool entry `slot`, head h,
// of ht (fp32 or bf16): the end state and the checkpoints alike.
template <int MT>
__device__ __forceinline__ void store_pool_state(const PrefillParams& p, std::int64_t slot, int h,
                                                 const float (&acc)[MT][16][4], float unit,
                                                 int v_warp, int gq, int tq) {
  const std::int64_t base = (slot * p.num_heads + h) * static_cast<std::int64_t>(D) * D;
  for_each_state_pair(acc, unit, v_warp, gq, tq, [&](int row, int col, float2 value) {
    const std::int64_t off = base + static_cast<std::int64_t>(row) * D + col;
    if (p.final_kind == StateKind::kF32) {
      *reinterpret_cast<float2*>(static_cast<float*>(p.ht) + off) = value;
    } else {
      *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.ht) + off) =
          __floats2bfloat162_rn(value.x, value.y);
    }
  });
}

// The pool entry after `entry` on its checkpoint list (prefill_checkpoints.cu), -1 after the last
// or for none.
__device__ __forceinline__ std::int32_t next_listed_entry(const PrefillParams& p,
                                                          std::int32_t entry) {
  return entry >= 0 ? p.checkpoint_next[entry] : -1;
}

// The pool entries listed from `first` on (prefill_checkpoints.cu), `then` the one after it
// (loaded ahead): the state into each. Block-uniform (every thread walks the same list).
template <int MT>
__device__ __forceinline__ void store_checkpoints(const PrefillParams& p, std::int32_t first,
                                                  std::int32_t then, int h,
                                                  const float (&acc)[MT][16][4], float unit,
                                                  int v_warp, int gq, int tq) {
  for (std::int32_t entry = first, after = then; entry >= 0;
       entry = after, after = next_listed_entry(p, after)) {
    // The paired shape's unit through an opaque move in the loop: the values stored are the same
    // for every entry, and computed once before the loop they were 192 more live registers (its
    // kernel spilled ~500 bytes a thread). The one-m-tile kernels keep the hoisted products: with
    // the move they took fewer registers but ran slower (H200, same run: h32-1seq's checkpoint
    // prefills 3 % faster without it).
    float unit_here = unit;
    if constexpr (MT == 2) asm volatile("mov.b32 %0, %1;" : "=f"(unit_here) : "f"(unit));
    store_pool_state<MT>(p, entry, h, acc, unit_here, v_warp, gq, tq);
  }
}

// One block per (segment slot, head, column block). Columns 0..127 are the V columns of S^T; in
// the first pass a middle segment also carries columns 128..255, the rows of P^T, started from the
// identity with U0 = 0 (v = 0 for them).
// SPLIT = false compiles the one-segment-per-sequence case without the segment logic (no
// transitions, no identity columns, no owner search): its register count and speed stay those of
// the plain recurrence.
// MT: m-tiles (16 columns each) per warp. Two m-tiles share every B fragment a warp loads from the
// stage (W, Q~, K^, M) and the decay factors, which halves the block's shared-memory traffic per
// column: that traffic, ~70 % of the shared-memory bandwidth at one m-tile, bounds the kernel.
// Threads of a block: the pipelined pass adds a feeder warp (below).
template <int WARPS, RecurrencePass PASS>
constexpr int recurrence_threads() {
  return (WARPS + (PASS == RecurrencePass::kPipelined ? 1 : 0)) * 32;
}

// CKPT compiles the checkpoint stores (PrefillParams::checkpoint_heads) into a kernel of its own,
// so that the loop without them keeps its registers (the paired shape has none to spare).
template <int WARPS, int MT, RecurrencePass PASS, bool SPLIT, bool CKPT>
__global__ void __launch_bounds__(recurrence_threads<WARPS, PASS>(), 1)
    kda_recurrence_kernel(const PrefillParams p) {
  constexpr int VB = WARPS * 16 * MT;  // columns per block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StageSmem* stages = reinterpret_cast<StageSmem*>(smem_raw);
  bf16(*so)[VB + 8] = reinterpret_cast<bf16(*)[VB + 8]>(smem_raw + kStages * sizeof(StageSmem));
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem_raw + kStages * sizeof(StageSmem) +
                                                         C * (VB + 8) * sizeof(bf16));
  std::uint64_t* empty = full + kStages;  // pipelined: every consumer is done with a stage's chunk

  const std::int64_t seg_slot = blockIdx.x;
  const int h = blockIdx.y;
  const int v_block = blockIdx.z * VB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;      // mma fragment row group / thread-in-group
  const int v_warp = v_block + warp * 16 * MT;  // first column of this warp

  const std::int64_t seg_tokens = C * p.seg_chunks;
  const std::int64_t s = SPLIT ? owner_of_slot(p.seqs, seg_slot, seg_tokens, lane) : seg_slot;
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t nchunks = (eos - bos + C - 1) / C;
  const std::int64_t j = SPLIT ? seg_slot - (s + bos / seg_tokens) : 0;  // segment in the sequence
  const std::int64_t nseg = SPLIT ? segments_of(nchunks, p.seg_chunks) : 1;
  if (j < 0 || j >= nseg) return;  // a gap slot
  const bool last = j == nseg - 1;
  // What this block does: see RecurrencePass.
  constexpr bool kAllTransitions = PASS == RecurrencePass::kTransition;
  constexpr bool kPipelined = PASS == RecurrencePass::kPipelined;  // kFirst's work, no split
  static_assert(!(kPipelined && SPLIT), "the pipelined pass does not split");
  // Pipelined: warp WARPS is the feeder. It waits for each record's ready flag and issues its copy,
  // so that the flag's round trip to L2 stays off the chain (on warp 0, the first version lost
  // ~1.8 us a chunk to it: H200, h32-1seq 0.79 ms against 0.32). It owns no columns.
  const bool feeder = kPipelined && warp == WARPS;
  const bool transition = kAllTransitions || (SPLIT && PASS == RecurrencePass::kFirst && j > 0);
  if (PASS == RecurrencePass::kFirst && j > 0 && last) return;  // the last one runs in kSecond
  if (PASS == RecurrencePass::kSecond && j == 0) return;        // segment 0 ran in kFirst
  if (!transition && v_block >= D) return;                      // P columns: middle segments only
  const bool identity_cols = (SPLIT || kAllTransitions) && v_warp >= D;  // warp-uniform

  // One block per sequence checks its cu_seqlens entries (the first and last also the ends).
  const bool reporter =
      PASS != RecurrencePass::kSecond && j == 0 && h == 0 && blockIdx.z == 0 && tid == 0;
  if (reporter) check_sequence_bounds(p.seqs, s, p.status);
  const std::int64_t state_idx = state_index(p, s, reporter);
  const std::int64_t H = p.num_heads;
  const std::int64_t state_base = (state_idx * H + h) * static_cast<std::int64_t>(D) * D;
  // Initial state: the caller's (segment 0), the scan's (segment j >= 1, second pass: in the block
  // of segment j - 1), or zero / identity (transitions).
  const float* seg_in = PASS == RecurrencePass::kSecond ? seg_block(p, seg_slot - 1, h) : nullptr;
  const StateKind h0_kind = (j == 0 && state_idx >= 0) ? p.initial_kind : StateKind::kNone;
  const bool h0_f32 = h0_kind == StateKind::kF32;

  // S^T slice [v_warp + 0..16 MT - 1][0..127] as MT x 16 n-tiles of m16n8 accumulators:
  // acc[mt][n][0..1] -> (row 16 mt + gq, cols 8n + 2tq + {0,1}); acc[mt][n][2..3] -> row + 8.
  float acc[MT][16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = v_warp + 16 * mt + gq + 8 * r;
        const int col = 8 * n + 2 * tq;
        const std::int64_t off = state_base + static_cast<std::int64_t>(row) * D + col;
        float x0 = 0.f, x1 = 0.f;
        if (feeder) {
          // no columns
        } else if (PASS == RecurrencePass::kSecond) {
          const float2 t2 =
              *reinterpret_cast<const float2*>(seg_in + static_cast<std::int64_t>(row) * D + col);
          x0 = t2.x;
          x1 = t2.y;
        } else if (transition) {
          x0 = identity_cols && row - D == col ? 1.f : 0.f;
          x1 = identity_cols && row - D == col + 1 ? 1.f : 0.f;
        } else if (h0_kind == StateKind::kF32) {
          const float2 t2 = *reinterpret_cast<const float2*>(static_cast<const float*>(p.h0) + off);
          x0 = t2.x;
          x1 = t2.y;
        } else if (h0_kind == StateKind::kBF16) {
          const __nv_bfloat162 t2 =
              *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.h0) + off);
          x0 = __bfloat162float(t2.x);
          x1 = __bfloat162float(t2.y);
        }
        acc[mt][n][2 * r] = x0;
        acc[mt][n][2 * r + 1] = x1;
      }
    }
  }
  // Checkpoints: blocks that carry a sequence's true state (segment 0 of the first pass, the
  // second pass, the pipelined pass) write the states its requests ask for; offset 0 is the
  // initial state itself.
  const bool checkpointing = CKPT && !transition && !feeder && state_idx >= 0 &&
                             (PASS != RecurrencePass::kFirst || j == 0);
  if (checkpointing && j == 0) {
    const std::int32_t first = p.checkpoint_heads[p.num_chunk_slots + s];
    store_checkpoints<MT>(p, first, next_listed_entry(p, first), h, acc, 1.f, v_warp, gq, tq);
  }

  // This segment's chunks [c_begin, c_end) of the sequence. One thread drives the copy engine: an
  // mbarrier per stage, the first kStages - 1 chunks now. Chunks past the workspace's slots (only
  // with broken cu_seqlens) are never fetched or waited on.
  const std::int64_t slot0 = s + bos / C;
  const std::int64_t c_begin = j * p.seg_chunks;
  std::int64_t c_end = last ? nchunks : c_begin + p.seg_chunks;
  if (c_end > p.num_chunk_slots - slot0) c_end = p.num_chunk_slots - slot0;
  const std::int64_t nfetch = c_end > c_begin ? c_end - c_begin : 0;
  const bool write_out = !transition;
  // The first step from an fp32 initial state runs apart (the step lambda's Y_PAIR, below).
  const bool pair_first = PASS != RecurrencePass::kSecond && nfetch > 0 && write_out && h0_f32;
  // Checkpoints: the list heads of the first chunks (chunk 0's in `head_first` when its step runs
  // apart; the loop's first window and the one after it, a lane each), loaded now, so that their
  // latency hides behind the unit's scan rather than before the first run.
  [[maybe_unused]] const std::int32_t* heads = nullptr;
  [[maybe_unused]] std::int32_t head_first = -1, window = -1, ahead = -1;
  auto heads_at = [&](std::int64_t first) {
    const std::int64_t c = first + lane;
    return c < nfetch ? heads[c] : -1;
  };
  if constexpr (CKPT) {
    if (checkpointing) {
      heads = p.checkpoint_heads + slot0 + c_begin;
      if (pair_first) head_first = heads[0];
      window = heads_at(pair_first ? 1 : 0);
      ahead = heads_at(pair_first ? 33 : 32);
    }
  }

  // The power-of-two unit 2^E of the state rows: U goes to fp16 as U 2^-E, so E must bound every
  // U of the segment. U = U0 - S W^T is a chunk's new values less the state's prediction of them,
  // so E comes from the largest U0 (the records' group scales) and the largest initial state
  // entry of the block's rows; the state is kept in units of 2^E (exact: powers of two), out and
  // the end state are scaled back. The P^T rows of a transition (identity start, U0 = 0, values
  // of order 1 whatever v's scale) keep E = 0 and stay out of the others' maximum. E depends on
  // the block's rows and chunks, so a plan that cuts the work differently (block width, segments)
  // may differ from another in the last bits; the same call always gives the same bits.
  // The scan reads 16 bytes a chunk (~1-2 us at 8,192 chunks, once per block). The warps' maxima
  // meet in `so`, free until the first chunk step's barrier (a static __shared__ array would move
  // the stages off their alignment).
  unsigned* block_max = reinterpret_cast<unsigned*>(&so[0][0]);
  {
    float mx = 0.f;
    if (!identity_cols) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
#pragma unroll
          for (int r = 0; r < 4; ++r) mx = fmaxf(mx, fabsf(acc[mt][n][r]));
        }
      }
    }
    // Pipelined: the records are not all written yet; the unit grows during the loop instead.
#pragma unroll 4
    for (std::int64_t c = kPipelined ? nfetch : tid; c < nfetch; c += WARPS * 32) {
      const float4 sc =
          *reinterpret_cast<const float4*>(record_scales(record_ptr(p, slot0 + c_begin + c, h)));
      mx = fmaxf(mx, fmaxf(fmaxf(sc.x, sc.y), fmaxf(sc.z, sc.w)));
    }
    const unsigned wmax = __reduce_max_sync(0xffffffffu, __float_as_uint(mx));
    if (lane == 0 && !feeder) block_max[warp] = wmax;
  }
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) mbarrier_init(&full[i], 1);
    if constexpr (kPipelined) {
#pragma unroll
      for (int i = 0; i < kStages; ++i) mbarrier_init(&empty[i], WARPS * 32);
    }
  }
  __syncthreads();  // the barriers are initialized before anyone uses them; block_max is complete
  if constexpr (kPipelined) {
    // The feeder leaves before the unit (it reads nothing of `so`, whose first row the warps'
    // maxima share with warp 0's output columns: the consumers' barriers do not order it).
    if (feeder) {
      // Every chunk in order: its record ready (the prepare kernel's flag), its stage free (the
      // consumers arrive on `empty` once past the chunk that used it), then the copy. The flags
      // are polled 32 chunks at a time, a lane each, so that one round trip to L2 covers up to 32
      // chunks (one flag per chunk held the feeder to ~1.6 us a chunk: H200, 0.41 ms at h32-1seq
      // where the consumers need 0.32).
      std::int64_t ready_end = 0;  // chunks [0, ready_end) are known ready
      for (std::int64_t n = 0; n < nfetch; ++n) {
        if (n == ready_end) {
          for (;;) {
            const std::int64_t m = n + lane;
            const bool ok = m >= nfetch || load_acquire_gpu(ready_flag(p, slot0 + c_begin + m, h));
            const unsigned ready = __ballot_sync(0xffffffffu, ok);
            if (ready & 1u) {  // chunks n .. n + run - 1 are ready
              ready_end = n + (ready == 0xffffffffu ? 32 : __ffs(~ready) - 1);
              break;
            }
            __nanosleep(64);
          }
          __syncwarp();                               // every lane's acquire before lane 0's copies
          if (lane == 0) fence_proxy_async_global();  // the flags before the copy engine's reads
        }
        if (lane == 0) {
          const int st = static_cast<int>(n % kStages);
          if (n >= kStages) mbarrier_wait(&empty[st], static_cast<unsigned>((n / kStages - 1) & 1));
          load_stage_bulk(stages[st], record_ptr(p, slot0 + c_begin + n, h), &full[st]);
        }
      }
      return;  // the consumers' barriers below are named ones that leave this warp out
    }
  }
  float unit_inv, unit;  // 2^-E, 2^E
  int unit_exp;          // E
  {
    unsigned m = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = m > block_max[w] ? m : block_max[w];
    // Pipelined without an initial state: the unit starts at its least, the chunks raise it (at
    // 2^0 small values would lose U's bits to fp16's subnormals where main's E would not).
    unit_exp = identity_cols                             ? 0
               : kPipelined && __uint_as_float(m) == 0.f ? -kMaxScaleExp
                                                         : scale_exponent(__uint_as_float(m));
    unit_inv = pow2f(-unit_exp);
    unit = pow2f(unit_exp);
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][n][r] *= unit_inv;
    }
  }
  if (!kPipelined && tid == 0) {
#pragma unroll
    for (int c = 0; c < kStages - 1; ++c) {
      if (c < nfetch) load_stage_bulk(stages[c], record_ptr(p, slot0 + c_begin + c, h), &full[c]);
    }
  }

  // One chunk step. Y_PAIR (the first step from an fp32 initial state only): Y takes the state
  // as a bf16 pair. The step is a lambda so that the loop below compiles without that case:
  // with it as a runtime branch inside the loop, the loop lost 4-27 % (H200), the pair or not.
  auto step = [&](std::int64_t c, auto y_pair_tag) {
    constexpr bool y_pair = decltype(y_pair_tag)::value;
    // This barrier is the only one a chunk step: past it every warp is done with chunk c - 1, so
    // its stage can be refilled, and has read its columns of `so` for the stores of c - 1.
    if constexpr (kPipelined) {
      // Every consumer thread releases chunk c - 1's stage itself (an arrival releases only the
      // arriving thread's accesses for racecheck, which reported the stage's refill against the
      // other warps' reads when thread 0 arrived for all after the barrier).
      if (c > 0) mbarrier_arrive(&empty[(c - 1) % kStages]);
      named_barrier_sync(1, WARPS * 32);  // the consumers only
    } else {
      __syncthreads();
    }
    if (!kPipelined && tid == 0) {
      const std::int64_t nc = c + kStages - 1;
      if (nc < nfetch) {
        load_stage_bulk(stages[nc % kStages], record_ptr(p, slot0 + c_begin + nc, h),
                        &full[nc % kStages]);
      }
    }
    mbarrier_wait(&full[c % kStages], static_cast<unsigned>((c / kStages) & 1));
    const StageSmem& st = stages[c % kStages];
    if (kPipelined && !identity_cols) {
      // Pipelined: the unit grows to this chunk's U0 scales before anything uses it (the state
      // rescaled by a power of two, in two steps so that a factor below 2^-100 stays exact).
      const float4 sc = *reinterpret_cast<const float4*>(record_scales(&st));
      const int e = scale_exponent(fmaxf(fmaxf(sc.x, sc.y), fmaxf(sc.z, sc.w)));
      if (e > unit_exp) {  // block-uniform: every warp reads the same scales
        const int d = unit_exp - e;
        const float f1 = pow2f(d / 2), f2 = pow2f(d - d / 2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int n = 0; n < 16; ++n) {
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mt][n][r] = acc[mt][n][r] * f1 * f2;
          }
        }
        unit_exp = e;
        unit_inv = pow2f(-e);
        unit = pow2f(e);
      }
    }

    // The chain that carries the state from chunk to chunk is X -> U -> S; Y hangs off the old
    // state. With one m-tile, Y is issued after the state update (it fills the update's latency)
    // from the old state's fragments kept in registers; with two there is no room for them, and Y
    // shares X's k-tile loop and fragments.
    constexpr bool kYWithX = MT > 1;
    // ldmatrix addresses: lanes 0-7 rows 0-7 col lo, 8-15 rows 0-7 col hi, 16-23 rows 8-15 lo,
    // 24-31 hi
    const int lrow = (lane & 7) + ((lane >> 4) << 3);
    const int lcol = ((lane >> 3) & 1) * 8;

    // X = S^T W^T (and Y = S^T Q~^T with two m-tiles; 16 v x 16 tokens per m-tile, two n-tiles of
    // 8 tokens), S^T packed to bf16 A fragments one k-tile (16 state channels) at a time; even and
    // odd k-tiles accumulate apart to halve the chains.
    // In the first chunk from an fp32 initial state, Y takes the state as a bf16 pair (hi + lo):
    // there the caller's state, which bf16 cannot hold, is all of Y's state term (at T = 1 all of
    // out but one token's U M^T), and its rounding was the largest term of out's error: T = 1
    // against fp64 3.23e-3 with it, 2.81e-3 without (H200). In later chunks the state is itself
    // made of the chunk's bf16 operands and its rounding one term of five (kda-chunk-emulation):
    // the pair in every step cost 9-22 % of the prefill for <= 0.3e-3 more than the first step's
    // pair alone gives, so only the first step takes it. X, on the chain, keeps the bf16 state.
    float X[MT][2][2][4] = {};
    float Y[MT][2][2][4] = {};
    // MT == 1: the old state's fragments (and their remainders, first step), for Y.
    [[maybe_unused]] unsigned kept[kYWithX ? 1 : 8][4];
    [[maybe_unused]] unsigned kept_lo[kYWithX || !y_pair ? 1 : 8][4];
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      unsigned w0, w1, w2, w3, q0, q1, q2, q3;
      ldmatrix_x4(w0, w1, w2, w3, &st.w[lrow][kt * 16 + lcol]);
      if (kYWithX && write_out) ldmatrix_x4(q0, q1, q2, q3, &st.qg[lrow][kt * 16 + lcol]);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        unsigned sa[4];
        sa[0] = pack_bf16x2(acc[mt][2 * kt][0], acc[mt][2 * kt][1]);
        sa[1] = pack_bf16x2(acc[mt][2 * kt][2], acc[mt][2 * kt][3]);
        sa[2] = pack_bf16x2(acc[mt][2 * kt + 1][0], acc[mt][2 * kt + 1][1]);
        sa[3] = pack_bf16x2(acc[mt][2 * kt + 1][2], acc[mt][2 * kt + 1][3]);
        mma_bf16(X[mt][kt & 1][0], sa, w0, w1);
        mma_bf16(X[mt][kt & 1][1], sa, w2, w3);
        unsigned sl[4] = {0, 0, 0, 0};
        if constexpr (y_pair) {
          sl[0] = bf16x2_remainder(acc[mt][2 * kt][0], acc[mt][2 * kt][1], sa[0]);
          sl[1] = bf16x2_remainder(acc[mt][2 * kt][2], acc[mt][2 * kt][3], sa[1]);
          sl[2] = bf16x2_remainder(acc[mt][2 * kt + 1][0], acc[mt][2 * kt + 1][1], sa[2]);
          sl[3] = bf16x2_remainder(acc[mt][2 * kt + 1][2], acc[mt][2 * kt + 1][3], sa[3]);
        }
        if constexpr (kYWithX) {
          if (write_out) {
            mma_bf16(Y[mt][kt & 1][0], sa, q0, q1);
            mma_bf16(Y[mt][kt & 1][1], sa, q2, q3);
          }
          if constexpr (y_pair) {
            mma_bf16(Y[mt][kt & 1][0], sl, q0, q1);
            mma_bf16(Y[mt][kt & 1][1], sl, q2, q3);
          }
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            kept[kt][i] = sa[i];
            if constexpr (y_pair) kept_lo[kt][i] = sl[i];
          }
        }
      }
    }

    // U^T = U0^T - X   (row v, col token); U0 = 0 on the P^T rows. In units of 2^E, as fp16: U0
    // was stored as U0 2^-e_g (its group's scale), so it takes 2^(e_g - E).
    unsigned ua[MT][4];
    const float u0_unit = identity_cols ? 0.f : record_scales(&st)[v_warp / kScaleGroup] * unit_inv;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // U0^T in the accumulators' layout, straight from the token-major tile: ldmatrix.trans of
      // its four 8 x 8 blocks (tokens 0-7 / 8-15 x columns +0 / +8) gives lane (gq, tq) the pair
      // of tokens 8 nt + 2 tq + {0, 1} at column gq (+ 8) -- one load for eight 2-byte ones.
      std::uint32_t u0[4] = {0, 0, 0, 0};
      if (!identity_cols) {  // warp-uniform
        ldmatrix_x4_trans(u0[0], u0[1], u0[2], u0[3], &st.u[lrow][v_warp + 16 * mt + lcol]);
      }
      float U[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float2 lo = unpack_f16x2(u0[2 * nt]), hi = unpack_f16x2(u0[2 * nt + 1]);
        U[nt][0] = fmaf(lo.x, u0_unit, -(X[mt][0][nt][0] + X[mt][1][nt][0]));
        U[nt][1] = fmaf(lo.y, u0_unit, -(X[mt][0][nt][1] + X[mt][1][nt][1]));
        U[nt][2] = fmaf(hi.x, u0_unit, -(X[mt][0][nt][2] + X[mt][1][nt][2]));
        U[nt][3] = fmaf(hi.y, u0_unit, -(X[mt][0][nt][3] + X[mt][1][nt][3]));
      }
      ua[mt][0] = pack_f16x2(U[0][0], U[0][1]);
      ua[mt][1] = pack_f16x2(U[0][2], U[0][3]);
      ua[mt][2] = pack_f16x2(U[1][0], U[1][1]);
      ua[mt][3] = pack_f16x2(U[1][2], U[1][3]);
    }

    // S^T = S^T diag(g_last) + U^T K^
#pragma unroll
    for (int n = 0; n < 16; n += 2) {
      unsigned b0, b1, b2, b3;
      // trans: lanes 0-7 tokens 0-7 col 8n, 8-15 tokens 8-15 col 8n, 16-23 tokens 0-7 col 8n+8,
      // 24-31
      ldmatrix_x4_trans(b0, b1, b2, b3, &st.kd[(lane & 15)][8 * n + ((lane >> 4) << 3)]);
#pragma unroll
      for (int hn = 0; hn < 2; ++hn) {
        const float2 gl = *reinterpret_cast<const float2*>(&st.gl[8 * (n + hn) + 2 * tq]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          acc[mt][n + hn][0] *= gl.x;
          acc[mt][n + hn][1] *= gl.y;
          acc[mt][n + hn][2] *= gl.x;
          acc[mt][n + hn][3] *= gl.y;
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_f16(acc[mt][n], ua[mt], b0, b1);
        mma_f16(acc[mt][n + 1], ua[mt], b2, b3);
      }
    }

    if (write_out) {
      // O^T = S^T Q~^T + U^T M^T.
      if constexpr (!kYWithX) state_times_tile<y_pair>(Y[0], kept, kept_lo, st.qg, lrow, lcol);
      {
        unsigned m0, m1, m2, m3;
        ldmatrix_x4(m0, m1, m2, m3, &st.m[lrow][lcol]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_f16(Y[mt][1][0], ua[mt], m0, m1);
          mma_f16(Y[mt][1][1], ua[mt], m2, m3);
        }
      }

      // Output: O^T goes through shared memory as token rows, each warp its own columns (stmatrix
      // .trans: the accumulator pairs (column gq, tokens 2 tq + {0, 1}) of the four 8 x 8 blocks
      // of an m-tile land as rows), then 16-byte stores of the valid tokens' pieces of those
      // columns. No other warp touches them: a warp barrier, not a block one.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float o[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) o[nt][r] = (Y[mt][0][nt][r] + Y[mt][1][nt][r]) * unit;
        }
        stmatrix_x4_trans(&so[lrow][warp * 16 * MT + 16 * mt + lcol], pack_bf16x2(o[0][0], o[0][1]),
                          pack_bf16x2(o[0][2], o[0][3]), pack_bf16x2(o[1][0], o[1][1]),
                          pack_bf16x2(o[1][2], o[1][3]));
      }
      __syncwarp();
      const std::int64_t tok0 = bos + (c_begin + c) * C;
      const int nvalid = static_cast<int>(eos - tok0 < C ? eos - tok0 : C);
      constexpr int kPieces = 2 * MT;  // 16-byte pieces of a token row in a warp's columns
      const auto store_piece = [&](int e) {
        const int t = e / kPieces, col = warp * 16 * MT + (e % kPieces) * 8;
        const std::int64_t off = ((tok0 + t) * H + h) * D + v_block + col;
        *reinterpret_cast<uint4*>(p.out + off) = *reinterpret_cast<const uint4*>(&so[t][col]);
      };
      if constexpr (MT == 1) {
        static_assert(C * kPieces == 32, "one m-tile: a chunk's pieces are one a lane");
        // Up to 32 pieces (16 tokens x 2), one a lane. As a loop (unrolled four times by the
        // compiler) it had the step scheduled differently in each kernel around it: on the H200
        // (h12-8x4096-bf16, ncu) the plain recurrence took 259.8 us against 245.3 now, and the
        // checkpoint kernel with no request listed 269.1 against 248.3.
        if (lane < nvalid * kPieces) store_piece(lane);
      } else {
        for (int e = lane; e < nvalid * kPieces; e += 32) store_piece(e);
      }
    }
  };
  std::int64_t c_first = 0;
  // (A second pass never starts from the caller's state: its loop alone is compiled.)
  if (PASS != RecurrencePass::kSecond && nfetch > 0 && write_out && h0_f32) {
    step(std::int64_t{0}, std::true_type{});
    c_first = 1;
  }
  if constexpr (CKPT) {
    if (checkpointing) {
      if (head_first >= 0) {
        store_checkpoints<MT>(p, head_first, next_listed_entry(p, head_first), h, acc, unit, v_warp,
                              gq, tq);
      }
      // The lists of 32 chunks at a time, a lane each (every warp holds the same window: the
      // index is read-only here), with each list's second entry; the next window's heads are
      // loaded a window ahead. Runs of plain chunk steps go up to each listed chunk of the window
      // (or its end), its states stored after it: the steps' loop stays the one without
      // checkpoints (a store inside it cost it ~8 %, H200), and no run waits on the index's loads.
      std::int64_t w0 = c_first;  // the window: chunks [w0, w0 + 32)
      std::int32_t second = next_listed_entry(p, window);
      std::int64_t c = c_first;
      while (c < nfetch) {
        const unsigned listed =
            __ballot_sync(0xffffffffu, window >= 0) & (0xffffffffu << static_cast<int>(c - w0));
        const int bit = listed != 0 ? __ffs(listed) - 1 : 31;
        const std::int64_t stop = w0 + bit + 1 < nfetch ? w0 + bit + 1 : nfetch;
        const std::int32_t entry = __shfl_sync(0xffffffffu, window, bit);
        for (; c < stop; ++c) step(c, std::false_type{});
        // The second entries, loaded as the window began, are read only after the run.
        const std::int32_t then = __shfl_sync(0xffffffffu, second, bit);
        if (listed != 0) store_checkpoints<MT>(p, entry, then, h, acc, unit, v_warp, gq, tq);
        if (c == w0 + 32) {
          w0 += 32;
          window = ahead;
          second = next_listed_entry(p, window);
          ahead = heads_at(w0 + 32);
        }
      }
    } else {
      for (std::int64_t c = c_first; c < nfetch; ++c) step(c, std::false_type{});
    }
  } else {
    for (std::int64_t c = c_first; c < nfetch; ++c) step(c, std::false_type{});
  }
  // The end state: the caller's final state (last segment), this segment's block in the workspace
  // (segment 0 of a split sequence: S_1; a transition: H_j^T and P^T rows), or the caller's
  // transition buffers (kTransition), fp32 but for a bf16 final state. The slot is looked up again
  // rather than kept live across the chunk loop (that cost the loop ~60 registers and 4-9 % of its
  // speed).
  enum class EndKind { kNone, kFinal, kSegment, kTransition };
  EndKind end = EndKind::kNone;
  const std::int64_t end_idx = state_index(p, s, false);
  if (kAllTransitions) {
    end = EndKind::kTransition;
  } else if (last) {
    if (end_idx >= 0 && p.final_kind != StateKind::kNone) end = EndKind::kFinal;
  } else if (PASS == RecurrencePass::kFirst) {
    end = EndKind::kSegment;
  }
  float* seg_out = end == EndKind::kSegment ? seg_block(p, seg_slot, h) : nullptr;
  // kTransition: H^T rows (0..127) and P^T rows (128..255) of pair (s, h).
  const std::int64_t pair_base = (s * H + h) * static_cast<std::int64_t>(D) * D;
  if (end == EndKind::kFinal) {
    store_pool_state<MT>(p, end_idx, h, acc, unit, v_warp, gq, tq);
  } else if (end != EndKind::kNone) {
    for_each_state_pair(acc, unit, v_warp, gq, tq, [&](int row, int col, float2 value) {
      if (end == EndKind::kSegment) {
        *reinterpret_cast<float2*>(seg_out + static_cast<std::int64_t>(row) * D + col) = value;
      } else {
        float* dst = row < D ? p.transition_h + pair_base + static_cast<std::int64_t>(row) * D
                             : p.transition_p + pair_base + static_cast<std::int64_t>(row - D) * D;
        *reinterpret_cast<float2*>(dst + col) = value;
      }
    });
  }
  // Pipelined: this grid ends after the prepare kernel it overlapped (a programmatic dependent
  // of the recurrence may rely on both being complete, and on the status bits both report).
  if constexpr (kPipelined) griddep_wait();
}

template <int WARPS, int MT>
constexpr std::size_t recurrence_smem_bytes() {
  return kStages * sizeof(StageSmem) + C * (WARPS * 16 * MT + 8) * sizeof(bf16) +
         2 * kStages * sizeof(std::uint64_t);  // full (and the pipelined pass's empty) barriers
}

template <int WARPS, int MT, RecurrencePass PASS, bool SPLIT, bool CKPT>
Status launch_kernel(const PrefillParams& prm, std::int64_t grid_x, int columns,
                     cudaStream_t stream) {
  constexpr std::size_t smem = recurrence_smem_bytes<WARPS, MT>();
  const cudaError_t err = allow_shared_memory<kda_recurrence_kernel<WARPS, MT, PASS, SPLIT, CKPT>>(
      static_cast<int>(smem));
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_recurrence_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(prm.num_heads),
                     static_cast<unsigned>(columns / (WARPS * 16 * MT)));
  cfg.blockDim = dim3(recurrence_threads<WARPS, PASS>());
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  // Pipelined: may start while the prepare kernel before it runs (it waits on the ready flags).
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  if constexpr (PASS == RecurrencePass::kPipelined) {
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  return cuda_status(
      cudaLaunchKernelEx(&cfg, kda_recurrence_kernel<WARPS, MT, PASS, SPLIT, CKPT>, prm),
      "kda_recurrence_kernel");
}

// Checkpoints only where a pass carries true states (not the transitions). The paired shape's
// checkpoint kernel, when it still spilled (~500 bytes a thread: store_pool_state's values hoisted
// out of the list's loop), beat the one-m-tile shape it would otherwise take (H200, same run:
// h64-8x1024 with 2 checkpoints a sequence 1.08x the prefill without them against 1.17x,
// h32-16x2048 1.07x against 1.14x); it now compiles without spills.
template <int WARPS, int MT, RecurrencePass PASS, bool SPLIT>
Status launch(const PrefillParams& prm, std::int64_t grid_x, int columns, cudaStream_t stream) {
  if (prm.checkpoint_heads != nullptr) {
    if constexpr (PASS != RecurrencePass::kTransition) {
      return launch_kernel<WARPS, MT, PASS, SPLIT, true>(prm, grid_x, columns, stream);
    } else {
      return Status(StatusCode::kInternal, "a transition carries no checkpoints");
    }
  }
  return launch_kernel<WARPS, MT, PASS, SPLIT, false>(prm, grid_x, columns, stream);
}

template <int WARPS, int MT>
Status launch_pass(const PrefillParams& prm, RecurrencePass pass, bool split, std::int64_t grid_x,
                   int columns, cudaStream_t stream) {
  switch (pass) {
    case RecurrencePass::kFirst:
      return split ? launch<WARPS, MT, RecurrencePass::kFirst, true>(prm, grid_x, columns, stream)
                   : launch<WARPS, MT, RecurrencePass::kFirst, false>(prm, grid_x, columns, stream);
    case RecurrencePass::kSecond:
      // The launcher never runs the second pass with the paired shape (prefill.cu).
      if constexpr (MT == 1) {
        return launch<WARPS, MT, RecurrencePass::kSecond, true>(prm, grid_x, columns, stream);
      } else {
        return Status(StatusCode::kInternal, "the paired recurrence shape has no second pass");
      }
    case RecurrencePass::kTransition:
      return launch<WARPS, MT, RecurrencePass::kTransition, false>(prm, grid_x, columns, stream);
    case RecurrencePass::kPipelined:
      if constexpr (WARPS == 2 && MT == 1) {  // the launcher pipelines 32-column blocks only
        return launch<WARPS, MT, RecurrencePass::kPipelined, false>(prm, grid_x, columns, stream);
      } else {
        return Status(StatusCode::kInternal, "only 32-column recurrence blocks are pipelined");
      }
  }
  return Status(StatusCode::kInternal, "unknown recurrence pass");
}

}  // namespace

Status launch_recurrence(const PrefillParams& prm, RecurrencePass pass, bool split,
                         RecurrenceShape shape, std::int64_t grid_x, int columns,
                         cudaStream_t stream) {
  switch (shape) {
    case RecurrenceShape::kCols32:
      return launch_pass<2, 1>(prm, pass, split, grid_x, columns, stream);
    case RecurrenceShape::kCols64:
      return launch_pass<4, 1>(prm, pass, split, grid_x, columns, stream);
    case RecurrenceShape::kCols128:
      return launch_pass<8, 1>(prm, pass, split, grid_x, columns, stream);
    case RecurrenceShape::kCols128Paired:
      return launch_pass<4, 2>(prm, pass, split, grid_x, columns, stream);
  }
  return Status(StatusCode::kInternal, "unknown recurrence block shape");
}

}  // namespace kda::detail
