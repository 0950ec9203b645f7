// prefill_kernels.cuh — what the CUDA prefill's kernels share: their parameters, the chunk-record
// and segment addressing, and the launchers (one .cu file per kernel, like ggml-cuda's one file per
// op; prefill.cu is the host side that plans and launches them).
//
//   prefill_prepare.cu     kda_prepare_kernel: token-parallel, one block per (chunk slot, head):
//       L2 norms, gate and its in-chunk cumulative sum G, beta, the strictly lower triangular A,
//       the output mask M, T' = (I + A)^-1 diag(beta) and [W | U0] = T' [K~ | V] on the tensor
//       cores. Every exp() of the exact path takes a difference G_i - G_j <= 0, so the softplus
//       gate cannot overflow however strong the decay. One ChunkRecord (workspace_layout.hpp) per
//       (slot, head).
//   prefill_recurrence.cu  kda_recurrence_kernel: the sequential part, one block per (segment,
//       head, column block), one warp per 16 columns; S^T in fp32 mma accumulators, per chunk
//           X = S^T W^T,  Y = S^T Q~^T,  U^T = U0^T - X,  O^T = Y + U^T M^T,
//           S^T = S^T diag(g_last) + U^T K^,
//       chunk records streamed through a 5-stage shared-memory ring by the copy engine.
//   segment_scan.cu        kda_segment_scan_kernel (S_{j+1}^T = S_j^T P_j^T + H_j^T between the
//       two passes of a split recurrence) and kda_apply_transition_kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ptx.cuh"
#include "kda/kda.hpp"
#include "workspace_layout.hpp"

namespace kda::detail {

constexpr int C = kChunk;            // 16
constexpr int D = kHeadDim;          // 128
constexpr int kRowPad = kRowStride;  // bf16 row stride in shared memory (and in the records): 272
                                     // bytes, so that ldmatrix's 8 row addresses fall in distinct
                                     // 16-byte bank groups
constexpr int kMPad = kMStride;      // 48-byte rows for 16 x 16 tiles

// How a state tensor is stored (kNone: absent, zeros in / nothing out).
enum class StateKind : int { kNone = 0, kBF16 = 1, kF32 = 2 };
inline StateKind state_kind(DType dt) {
  return dt == DType::kBF16  ? StateKind::kBF16
         : dt == DType::kF32 ? StateKind::kF32
                             : StateKind::kNone;
}

struct PrefillParams {
  InputPointers in;
  SeqIndex seqs;
  int num_heads;
  GateMode gate;
  float lower_bound;
  float scale;
  const void* h0;
  StateKind initial_kind;
  void* ht;
  StateKind final_kind;
  bf16* out;
  unsigned char* records;
  std::int64_t num_chunk_slots;  // chunk records in the workspace (not state slots)
  std::uint32_t* status;         // caller's device status word, or null
  // Pooled states (Problem::num_state_slots > 0): sequence s uses pool entry state_slots[s].
  const std::int32_t* state_slots;  // null: sequence s uses state s
  std::int64_t num_state_slots;
  std::int32_t padding_slot = -1;  // Problem::padding_slot: entries equal to it are padding too
  // Segments (workspace_layout.hpp): chunks per segment (kNoSplit: one segment per sequence) and
  // the fp32 segment blocks (null without a split).
  std::int64_t seg_chunks;
  float* seg_blocks;
  // segment_transition_cuda: where the transition of each (sequence, head) goes, fp32 P^T [K, K]
  // and H^T [V, K] per pair (RecurrencePass::kTransition only).
  float* transition_p;
  float* transition_h;
  // The pipelined prefill (prefill.cu): one flag per (chunk slot, head), set by the prepare kernel
  // once the record is in memory; null otherwise (the recurrence then runs after the prepare).
  std::uint32_t* ready;
  // Prefill checkpoints (Problem::checkpoints > 0; null heads otherwise): the requests [N, K] and
  // their index (workspace_layout.hpp, "Checkpoint index"), built by the index kernel before the
  // recurrence, which writes the state into pool entries of ht at every listed chunk.
  const void* checkpoint_offsets;
  bool checkpoint_offsets_64;
  const std::int32_t* checkpoint_slots;
  std::int64_t checkpoints;         // K
  std::int32_t* checkpoint_heads;   // [num_chunk_slots + N]: after chunk slot c; then offset 0
  std::int32_t* checkpoint_claims;  // [num_state_slots], after the heads
  std::int32_t* checkpoint_next;    // [num_state_slots]: the next entry of a list
};

// seg_chunks of a plan that does not split: one segment holds any sequence, and seg_slot == s.
constexpr std::int64_t kNoSplit = std::int64_t{1} << 40;

__device__ __forceinline__ unsigned char* record_ptr(const PrefillParams& p, std::int64_t slot,
                                                     int h) {
  return p.records + (slot * p.num_heads + h) * static_cast<std::int64_t>(ChunkRecord::kBytes);
}

// The pipelined prefill's ready flag of (chunk slot, head), laid out like the records.
__device__ __forceinline__ std::uint32_t* ready_flag(const PrefillParams& p, std::int64_t slot,
                                                     int h) {
  return p.ready + slot * p.num_heads + h;
}

// U0's four group scales (f32, ChunkRecord::kScales) of a record, in memory or as a stage's image.
__device__ __forceinline__ float* record_scales(unsigned char* record) {
  return reinterpret_cast<float*>(record + ChunkRecord::kScales);
}
__device__ __forceinline__ const float* record_scales(const void* record) {
  return reinterpret_cast<const float*>(static_cast<const unsigned char*>(record) +
                                        ChunkRecord::kScales);
}

// Finds the sequence owning slot `slot` when slots are `width` tokens wide (a chunk: C; a segment:
// C * seg_chunks): the largest s with s + start(s) / width <= slot. A 32-ary search by the whole
// warp (every lane calls it with the same slot and width, in warp-uniform control flow): each
// round, lane l tests candidate lo + step (l + 1) and a ballot counts the true ones, so that N
// sequences cost ceil(log32 N) rounds of independent loads, not log2 N dependent ones by every
// thread (the binary search was ~9 % of the prepare kernel's instructions at 8 sequences).
// Broken (decreasing) cu_seqlens break the predicate's monotony, never the range: the result
// stays in [0, num_seqs).
__device__ __forceinline__ std::int64_t owner_of_slot(const SeqIndex& seqs, std::int64_t slot,
                                                      std::int64_t width, int lane) {
  std::int64_t lo = 0, n = seqs.num_seqs;  // the owner lies in [lo, lo + n)
  while (n > 1) {
    const std::int64_t step = (n + 31) / 32;
    const std::int64_t cand = lo + step * (lane + 1);
    bool below = false;
    if (cand < lo + n) {
      std::int64_t b = seqs.start(cand);
      b = b < 0 ? 0 : (b > seqs.total ? seqs.total : b);
      below = cand + b / width <= slot;
    }
    const std::int64_t count = __popc(__ballot_sync(0xffffffffu, below));
    const std::int64_t next = lo + step * count;
    n = (lo + n - next < step) ? lo + n - next : step;
    lo = next;
  }
  return lo;
}

// Reports sequence s's cu_seqlens entries if they are broken: decreasing, the first not 0, the
// last not T. One thread calls it per sequence: block (s, head 0) of the prepare kernel for every
// s < N (whatever the owner search makes of broken entries: a split plan's search seldom maps a
// decreasing entry's sequence to its first segment), and the recurrence's first block of each
// sequence (which also covers T = 0, where the prepare kernel does not run).
__device__ __forceinline__ void check_sequence_bounds(const SeqIndex& seqs, std::int64_t s,
                                                      std::uint32_t* status) {
  if (seqs.cu == nullptr) return;
  const std::int64_t b = seqs.start(s), e = seqs.start(s + 1);
  if (e < b || (s == 0 && b != 0) || (s == seqs.num_seqs - 1 && e != seqs.total)) {
    report_status(status, kDeviceStatusCuSeqlens);
  }
}

// Which pass of the recurrence a launch is (see workspace_layout.hpp, "Segments"). Without a split
// every sequence is one segment and kFirst is the whole recurrence.
enum class RecurrencePass : int {
  kFirst = 0,       // segment 0 from the true initial state (outputs); middle segments' (H_j, P_j)
  kSecond = 1,      // segments 1.. from the scanned initial states (outputs, final state)
  kTransition = 2,  // every sequence as one transition (H, P) into transition_h / transition_p
  kPipelined = 3,   // kFirst without a split, beside the prepare kernel: waits for each record's
                    // ready flag (PrefillParams::ready) and grows its state unit chunk by chunk
};

__device__ __forceinline__ float* seg_block(const PrefillParams& p, std::int64_t seg_slot, int h) {
  return p.seg_blocks + (seg_slot * p.num_heads + h) * static_cast<std::int64_t>(2 * D * D);
}

// Segment j of a sequence with nchunks chunks: the count of its segments (at least one, so that an
// empty sequence still passes its initial state on).
__device__ __forceinline__ std::int64_t segments_of(std::int64_t nchunks, std::int64_t seg_chunks) {
  const std::int64_t n = (nchunks + seg_chunks - 1) / seg_chunks;
  return n < 1 ? 1 : n;
}

// Launchers (asynchronous on `stream`; each reports its own launch error).
// With prm.ready, the prepare kernel runs as a persistent grid of `pipelined_blocks_per_sm` blocks
// per SM (kPrepPipelinedBlocksPerSm by default: room for a recurrence block beside them; clamped
// to what the kernel's launch bounds allow) taking (slot, head) items slot by slot, and lets the
// recurrence, launched next as RecurrencePass::kPipelined, start at once (programmatic dependent
// launch). More blocks than fit beside the recurrence delay it, never deadlock: the prepare grid
// waits on nothing.
inline constexpr int kPrepPipelinedBlocksPerSm = 3;
Status launch_prepare(const PrefillParams& prm, std::int64_t chunk_slots,
                      int pipelined_blocks_per_sm, cudaStream_t stream);
// Recurrence block shapes: the V columns a block carries, its warps, and the 16-column m-tiles per
// warp. Two m-tiles a warp share every fragment the warp loads from the stage (W, Q~, K^, M) and
// the decay factors (each m-tile reads its own U0 columns), which halves the shared-memory reads
// per column (the limit of the eight-warp shape, ~70 % of the bandwidth), at twice the work per
// warp and chunk step: the better shape when two blocks share each SM.
enum class RecurrenceShape : int {
  kCols32,         // 2 warps x 1 m-tile
  kCols64,         // 4 warps x 1 m-tile
  kCols128,        // 8 warps x 1 m-tile
  kCols128Paired,  // 4 warps x 2 m-tiles
};
// Grid (grid_x, heads, columns / the shape's columns): `columns` D, or 2 D where a block also
// carries the P^T rows of a transition.
Status launch_recurrence(const PrefillParams& prm, RecurrencePass pass, bool split,
                         RecurrenceShape shape, std::int64_t grid_x, int columns,
                         cudaStream_t stream);
// Builds the checkpoint index from the requests (and reports bad ones): a memset of the heads,
// then one thread per request. Before the prepare kernel.
Status launch_checkpoint_index(const PrefillParams& prm, cudaStream_t stream);
Status launch_segment_scan(const PrefillParams& prm, std::int64_t num_seqs, cudaStream_t stream);
// s_out^T = s_in^T P^T + H^T for `pairs` (sequence, head) pairs of 128 x 128 fp32 states.
Status launch_apply_transition(const float* s_in, const float* p_t, const float* h_t, float* s_out,
                               std::int64_t pairs, cudaStream_t stream);

}  // namespace kda::detail
