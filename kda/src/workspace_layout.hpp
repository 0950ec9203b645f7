// Workspace layout of the CUDA prefill, in plain C++ so that workspace_size() works in every build
// (a CPU-only build can still plan a CUDA arena) and the kernels and the planner agree on one
// formula.
//
// The prefill runs in two phases. Phase 1 (token-parallel) turns each chunk of kChunk tokens of
// each head into the operands of the sequential recurrence and stores them in the workspace; phase
// 2 walks the chunks of each (sequence, head) in order. A sequence s that starts at token cu[s]
// owns chunk slots [s + cu[s] / kChunk, s + cu[s] / kChunk + ceil(len_s / kChunk)): disjoint across
// sequences and all below num_chunk_slots(T, N) = ceil(T / kChunk) + N, so the workspace depends on
// sizes alone.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kda/detail/checked_math.hpp"

namespace kda::detail {

inline constexpr int kChunk = 16;     // tokens per chunk
inline constexpr int kHeadDim = 128;  // K == V == 128 on CUDA

// One (chunk slot, head) record. Rows are padded (kRowStride bf16 for 128-wide tiles, kMStride for
// M) so that the record is byte for byte the shared-memory image the recurrence kernel works on:
// one bulk copy brings it in, and ldmatrix on 272-byte rows is free of bank conflicts.
// - qg: bf16 [kChunk][kRowStride], scale * q_hat * exp(G_i) (Q~)
// - kd: fp16 [kChunk][kRowStride], k_hat * exp(G_last - G_i) (K^, feeds the state update)
// - w:  bf16 [kChunk][kRowStride], (I + A)^-1 diag(beta) (k_hat * exp(G_i)) (W)
// - u:  fp16 [kChunk][kRowStride], (I + A)^-1 diag(beta) v (U0), each 32-column group g scaled by
//       2^-e_g into [-2, 2] (e_g from the group's largest magnitude)
// - m:  fp16 [kChunk][kMStride], scale * q_hat_i . (k_hat_j * exp(G_i - G_j)) for i >= j, else 0
// - gl: f32 [K], exp(G_last) (the chunk's decay of the state)
// - the four group scales 2^e_g as f32 in the padding of qg's row 0 (kScaleColumn).
// The state update S^T += U^T K^ and U^T M^T take fp16 operands: K^ and M are bounded by 1 (unit
// keys and queries, decay factors <= 1) and U reaches fp16 in the recurrence's power-of-two unit
// of the state (prefill_recurrence.cu), so fp16's 3 more mantissa bits than bf16 cost no range.
// Long memory against fp64: 3.8e-3 -> 2.7e-3 on out, 3.1e-3 -> 0.7e-3 on the state (H200).
// Other padding carries nothing.
inline constexpr int kRowStride = kHeadDim + 8;  // 272-byte rows
inline constexpr int kMStride = kChunk + 8;      // 48-byte rows
inline constexpr int kScaleColumn = kHeadDim;    // qg[0][kScaleColumn..]: U0's four group scales
inline constexpr int kScaleGroup = 32;           // U0 columns per scale
struct ChunkRecord {
  static constexpr std::size_t kTileBytes = kChunk * kRowStride * 2;  // 4,352
  static constexpr std::size_t kQg = 0;
  static constexpr std::size_t kKd = kQg + kTileBytes;
  static constexpr std::size_t kW = kKd + kTileBytes;
  static constexpr std::size_t kU = kW + kTileBytes;
  static constexpr std::size_t kM = kU + kTileBytes;
  static constexpr std::size_t kGl = kM + kChunk * kMStride * 2;
  static constexpr std::size_t kBytes = kGl + kHeadDim * 4;       // 18,688
  static constexpr std::size_t kScales = kQg + kScaleColumn * 2;  // U0's four group scales (f32)
};
static_assert(ChunkRecord::kBytes % 128 == 0, "records stay 128-byte aligned");

// Alignment of the record array inside the caller's workspace.
inline constexpr std::size_t kWorkspaceAlignment = 256;

// Number of chunk slots for total_tokens tokens split into num_seqs sequences.
inline bool num_chunk_slots(std::uint64_t total_tokens, std::uint64_t num_seqs,
                            std::uint64_t* out) {
  return checked_add((total_tokens + kChunk - 1) / kChunk, num_seqs, out);
}

// ---- Segments (intracard context parallelism) ------------------------------------------------
// A long sequence is cut into segments of seg_chunks chunks, aligned to its start. Its state map
// over segment j is affine, S_{j+1} = P_j S_j + H_j (KDA.md §3): phase 2a runs every segment's
// recurrence at once (segment 0 from the true initial state; the middle ones from 0 for H_j and
// from the identity, with v = 0, for P_j), a short fp32 scan chains S_{j+1} = S_j P_j^T + H_j^T
// (in the V-first layout), and phase 2b runs segments 1.. again from their true initial states.
// Segment slots are handed out like chunk slots: sequence s owns [s + cu[s] / (16 seg_chunks),
// ...), at most num_seqs + total_tokens / (16 seg_chunks) of them. Each (segment slot, head) has
// one fp32 [2 * 128][128] block: rows 0..127 hold H_j^T (after the scan: the state at the start of
// segment j + 1), rows 128..255 P_j^T.
inline constexpr std::uint64_t kSegmentBlockBytes = 2ull * kHeadDim * kHeadDim * 4;  // 128 KiB
inline constexpr std::uint64_t kMinSegmentChunks = 8;  // shorter segments cost more than they save
// Upper bound of segments x heads that any device's plan asks for (the plan scales with the SM
// count: about two segment-heads per SM), so that the workspace depends on sizes alone.
inline constexpr std::uint64_t kSegmentBudget = 512;

// Most segments the plan may cut all sequences into, beyond one per sequence: 0 when no split is
// possible (fewer than two minimal segments of tokens).
inline std::uint64_t max_extra_segments(std::uint64_t total_tokens, std::uint64_t num_heads) {
  const std::uint64_t chunks = (total_tokens + kChunk - 1) / kChunk;
  if (chunks < 2 * kMinSegmentChunks || num_heads == 0) return 0;
  std::uint64_t by_budget = kSegmentBudget / num_heads;
  if (by_budget < 2) return 0;
  const std::uint64_t by_length = chunks / kMinSegmentChunks;
  return by_budget < by_length ? by_budget : by_length;
}

// ---- Ready flags (the pipelined prefill) -----------------------------------------------------
// One 32-bit flag per (chunk slot, head), after the records and segment blocks: the prepare kernel
// sets it once the chunk's record is in memory, the recurrence waits for it before copying the
// record in; zeroed at the start of each call.
inline constexpr std::uint64_t kReadyFlagBytes = 4;

// Offsets in the CUDA prefill workspace (from its 256-byte aligned start): the flags after the
// chunk records and the segment blocks; and the workspace's size (+ one alignment unit so that an
// unaligned caller pointer can be rounded up). false on overflow.
inline bool cuda_prefill_flags_offset(std::uint64_t total_tokens, std::uint64_t num_seqs,
                                      std::uint64_t num_heads, std::uint64_t* offset) {
  std::uint64_t slots = 0, records = 0, total = 0;
  if (!num_chunk_slots(total_tokens, num_seqs, &slots)) return false;
  if (!checked_mul(slots, num_heads, &records)) return false;
  if (!checked_mul(records, ChunkRecord::kBytes, &total)) return false;
  const std::uint64_t extra = max_extra_segments(total_tokens, num_heads);
  if (extra > 0) {
    std::uint64_t seg_slots = 0, seg_heads = 0, seg_bytes = 0;
    if (!checked_add(num_seqs, extra, &seg_slots)) return false;
    if (!checked_mul(seg_slots, num_heads, &seg_heads)) return false;
    if (!checked_mul(seg_heads, kSegmentBlockBytes, &seg_bytes)) return false;
    if (!checked_add(total, seg_bytes, &total)) return false;  // records end 128-byte aligned
  }
  *offset = total;
  return true;
}
// ---- Checkpoint index (prefill checkpoints) --------------------------------------------------
// With state slots (Problem::num_state_slots = P > 0), after the ready flags: int32 heads
// [num_chunk_slots + N], int32 claims [P] and int32 next [P]. A checkpoint request for the state
// after chunk slot c of its sequence, into pool entry e, heads the list of heads[c] (offset 0, the
// initial state: heads[num_chunk_slots + s]) and next[e] chains the entries that share that point;
// -1 ends a list. claims[e] keeps an entry from being listed twice (a request naming an entry
// another one named is reported and skipped), so no list can loop. Indexed by entry, not by
// request, the index does not depend on how many requests a call makes; the recurrence reads one
// head per chunk step, so that any number of them costs one load a chunk.
inline constexpr std::uint64_t kCheckpointIndexBytes = 4;

// Offset of the checkpoint heads (after the ready flags; claims follow them, then next) and the
// end of the index (no index without state slots).
inline bool cuda_prefill_checkpoint_index(std::uint64_t total_tokens, std::uint64_t num_seqs,
                                          std::uint64_t num_heads, std::uint64_t num_state_slots,
                                          std::uint64_t* heads_at, std::uint64_t* end) {
  std::uint64_t flags_at = 0, slots = 0, flags = 0, flag_bytes = 0, at = 0, entries = 0,
                index_bytes = 0;
  if (!cuda_prefill_flags_offset(total_tokens, num_seqs, num_heads, &flags_at)) return false;
  if (!num_chunk_slots(total_tokens, num_seqs, &slots)) return false;
  if (!checked_mul(slots, num_heads, &flags)) return false;
  if (!checked_mul(flags, kReadyFlagBytes, &flag_bytes)) return false;
  if (!checked_add(flags_at, flag_bytes, &at)) return false;
  if (num_state_slots > 0) {
    std::uint64_t heads = 0, per_entry = 0;
    if (!checked_add(slots, num_seqs, &heads)) return false;
    if (!checked_mul(num_state_slots, 2, &per_entry)) return false;
    if (!checked_add(heads, per_entry, &entries)) return false;
    if (!checked_mul(entries, kCheckpointIndexBytes, &index_bytes)) return false;
  }
  *heads_at = at;
  return checked_add(at, index_bytes, end);
}

// The CUDA prefill's workspace: records, segment blocks, ready flags, the checkpoint index, and
// one alignment unit so that an unaligned caller pointer can be rounded up.
inline bool cuda_prefill_workspace_bytes(std::uint64_t total_tokens, std::uint64_t num_seqs,
                                         std::uint64_t num_heads, std::uint64_t num_state_slots,
                                         std::uint64_t* bytes) {
  std::uint64_t heads_at = 0, end = 0;
  if (!cuda_prefill_checkpoint_index(total_tokens, num_seqs, num_heads, num_state_slots, &heads_at,
                                     &end))
    return false;
  return checked_add(end, kWorkspaceAlignment, bytes);
}

}  // namespace kda::detail
