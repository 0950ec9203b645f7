// Host check of a prefill's state slot indices (Problem::num_state_slots > 0), shared by the CPU
// backend (always, bitmap in its workspace) and the CUDA backend (when the caller gives a host
// copy).
#pragma once

#include <cstdint>

#include "kda/kda.hpp"

namespace kda::detail {

// A caller-chosen padding slot names an entry of the pool (negative: none): prefill, decode, the
// commit and the slot copy. `pool_name` is the pool size's field, for the message.
Status check_padding_slot(std::int32_t padding_slot, std::int64_t pool, const char* pool_name);

// Every entry < num_state_slots; no entry >= 0 twice when a final state is written. `seen_bits`:
// ceil(num_state_slots / 64) words of scratch for an O(N) duplicate check, or null for O(N^2)
// with no scratch.
Status check_state_slots(const Problem& p, const std::int32_t* slots, std::uint64_t* seen_bits);
// Problem::checkpoints > 0, host memory (cu_seqlens, checkpoint_offsets, checkpoint_slots): each
// request's offset -1 or in [0, length], a multiple of kCheckpointAlignment or the length; its
// slot negative (none) or inside the pool; the entries written distinct and none a state_slots
// entry. `seen_bits`: check_state_slots' bitmap after it ran (the call's state_slots marked).
Status check_checkpoints(const Problem& p, const Tensors& t, std::uint64_t* seen_bits);

// Bytes of the CPU backend's duplicate bitmap (0 without pooled final states).
inline std::uint64_t state_slot_bitmap_bytes(const Problem& p) {
  if (p.num_state_slots <= 0 || p.final_state_dtype == DType::kNone) return 0;
  return (static_cast<std::uint64_t>(p.num_state_slots) + 63) / 64 * 8;
}

}  // namespace kda::detail
