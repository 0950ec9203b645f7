// Host checks of state slot indices: a prefill's (Problem::num_state_slots > 0), shared by the CPU
// backend (always, bitmap in its workspace) and the CUDA backend (when the caller gives a host
// copy), and the linear repeated-slot search the layer's checks use too.
#pragma once

#include <bitset>
#include <cstdint>
#include <utility>

#include "kda/kda.hpp"

namespace kda::detail {

// A caller-chosen padding slot names an entry of the pool (negative: none): prefill, decode, the
// commit and the slot copy. `pool_name` is the pool size's field, for the message.
Status check_padding_slot(std::int32_t padding_slot, std::int64_t pool, const char* pool_name);

// Every entry < num_state_slots; no entry >= 0 twice when a final state is written. `seen_bits`:
// ceil(num_state_slots / 64) words of scratch for the duplicate check, or null for
// find_repeated_slot's (a bitmap on the stack; a scan of the earlier entries only for a slot past
// its 65,536).
Status check_state_slots(const Problem& p, const std::int32_t* slots, std::uint64_t* seen_bits);
// Problem::checkpoints > 0, host memory (cu_seqlens, checkpoint_offsets, checkpoint_slots): each
// request's offset -1 or in [0, length], a multiple of kCheckpointAlignment or the length; its
// slot negative (none) or inside the pool; the entries written distinct and none a state_slots
// entry. `seen_bits`: check_state_slots' bitmap after it ran (the call's state_slots marked).
Status check_checkpoints(const Problem& p, const Tensors& t, std::uint64_t* seen_bits);

// Two entries of slots [0, count) that name the same slot, skipping those `skip(slot)` holds for
// (padding): {earlier, later} for the first repeat, or {-1, -1}. Linear for slots below
// kSlotBits (a bitmap on the stack, so that a forward allocates nothing), a scan of the earlier
// entries for a larger one.
template <typename Skip>
std::pair<std::int64_t, std::int64_t> find_repeated_slot(const std::int32_t* slots,
                                                         std::int64_t count, Skip skip) {
  constexpr std::int64_t kSlotBits = std::int64_t{1} << 16;
  std::bitset<kSlotBits> seen;
  auto earlier = [&](std::int64_t n) {
    for (std::int64_t m = 0; m < n; ++m) {
      if (slots[m] == slots[n]) return m;
    }
    return std::int64_t{-1};
  };
  for (std::int64_t n = 0; n < count; ++n) {
    const std::int32_t slot = slots[n];
    if (skip(slot)) continue;
    if (slot >= 0 && slot < kSlotBits) {
      if (!seen[static_cast<std::size_t>(slot)]) {
        seen.set(static_cast<std::size_t>(slot));
        continue;
      }
    }
    const std::int64_t m = earlier(n);
    if (m >= 0) return {m, n};
  }
  return {-1, -1};
}

// Bytes of the CPU backend's duplicate bitmap (0 without pooled final states).
inline std::uint64_t state_slot_bitmap_bytes(const Problem& p) {
  if (p.num_state_slots <= 0 || p.final_state_dtype == DType::kNone) return 0;
  return (static_cast<std::uint64_t>(p.num_state_slots) + 63) / 64 * 8;
}

}  // namespace kda::detail
