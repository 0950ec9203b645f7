// state_slots_util.hpp — the prefill through state slot indices (Problem::num_state_slots), shared
// by the CPU and the CUDA tests: a pool of states with guard values, a slot list, and the checks
// that a pooled run equals the contiguous run of the same case bitwise.
//
//   SlotCase sc = make_slot_case(c, slots, pool_size);   // c: a case with initial and final states
//   ... run c.problem with sc.problem / sc.pool on a backend (in place: initial == final == pool)
//   check_pooled_equals_contiguous(sc, pooled_out, pooled_pool, contiguous);
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kda_reference.hpp"

namespace kda::test {

// A case run through a pool: the pool holds distinct random guard states; each sequence's initial
// state sits at its slot. `contiguous` is the same case with padded sequences' (slot < 0) initial
// states zeroed: its outputs and final states are what the pooled run must reproduce.
struct SlotCase {
  KdaCase contiguous;
  Problem problem;  // pooled: num_state_slots = pool size
  std::vector<std::int32_t> slots;
  std::vector<unsigned char> pool;  // [P, H, V, K] in the state dtype, before the run
  std::size_t entry_bytes = 0;      // bytes of one pool entry
  // Prefill checkpoints (problem.checkpoints = K > 0): [N, K] each, offsets as values (fed in
  // problem.checkpoint_offsets_dtype).
  std::vector<std::int64_t> checkpoint_offsets;
  std::vector<std::int32_t> checkpoint_slots;
};

inline SlotCase make_slot_case(const KdaCase& c, const std::vector<std::int32_t>& slots,
                               std::int64_t pool_size, std::uint64_t seed = 99) {
  SlotCase sc;
  sc.contiguous = c;
  sc.slots = slots;
  const Problem& p = c.problem;
  REQUIRE(p.initial_state_dtype == p.final_state_dtype);
  REQUIRE(static_cast<std::int64_t>(slots.size()) == p.sequences());
  const std::size_t elems = static_cast<std::size_t>(p.num_heads * p.head_dim_v * p.head_dim_k);
  const std::size_t esize = dtype_size(p.initial_state_dtype);
  sc.entry_bytes = elems * esize;
  // Guard states: distinct random values in every entry.
  Rng rng(seed);
  std::vector<float> guard(elems * static_cast<std::size_t>(pool_size));
  for (auto& x : guard) x = static_cast<float>(rng.normal());
  if (p.initial_state_dtype == DType::kBF16) {
    const std::vector<std::uint16_t> g16 = to_bf16(guard);
    sc.pool.resize(g16.size() * 2);
    std::memcpy(sc.pool.data(), g16.data(), sc.pool.size());
  } else {
    sc.pool.resize(guard.size() * 4);
    std::memcpy(sc.pool.data(), guard.data(), sc.pool.size());
  }
  const unsigned char* init = static_cast<const unsigned char*>(c.initial_state_ptr());
  for (std::size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0) {
      std::memcpy(sc.pool.data() + static_cast<std::size_t>(slots[s]) * sc.entry_bytes,
                  init + s * sc.entry_bytes, sc.entry_bytes);
    } else {  // padding starts from zero
      if (!sc.contiguous.initial_state.empty()) {
        std::fill_n(sc.contiguous.initial_state.begin() + static_cast<std::ptrdiff_t>(s * elems),
                    elems, 0.0f);
      }
      if (!sc.contiguous.initial_state_bf16.empty()) {
        std::fill_n(
            sc.contiguous.initial_state_bf16.begin() + static_cast<std::ptrdiff_t>(s * elems),
            elems, std::uint16_t{0});
      }
    }
  }
  sc.problem = p;
  sc.problem.num_state_slots = pool_size;
  return sc;
}

// The pooled run's out equals the contiguous run's bitwise; each named slot holds that sequence's
// final state bitwise; every other entry (unnamed, or named by padding) still holds its guard.
inline void check_pooled_equals_contiguous(const SlotCase& sc,
                                           const std::vector<std::uint16_t>& out,
                                           const std::vector<unsigned char>& pool_after,
                                           const std::vector<std::uint16_t>& contiguous_out,
                                           const void* contiguous_final, const std::string& label) {
  CHECK_MESSAGE(out == contiguous_out, label << ": out differs from the contiguous run");
  REQUIRE(pool_after.size() == sc.pool.size());
  const std::int64_t pool_size = sc.problem.num_state_slots;
  std::vector<int> owner(static_cast<std::size_t>(pool_size), -1);
  for (std::size_t s = 0; s < sc.slots.size(); ++s) {
    if (sc.slots[s] >= 0) owner[static_cast<std::size_t>(sc.slots[s])] = static_cast<int>(s);
  }
  const auto* fin = static_cast<const unsigned char*>(contiguous_final);
  for (std::int64_t e = 0; e < pool_size; ++e) {
    const unsigned char* got = pool_after.data() + static_cast<std::size_t>(e) * sc.entry_bytes;
    const int s = owner[static_cast<std::size_t>(e)];
    const unsigned char* want = s >= 0
                                    ? fin + static_cast<std::size_t>(s) * sc.entry_bytes
                                    : sc.pool.data() + static_cast<std::size_t>(e) * sc.entry_bytes;
    CHECK_MESSAGE(std::memcmp(got, want, sc.entry_bytes) == 0,
                  label << ": pool entry " << e
                        << (s >= 0 ? " differs from its sequence's final state"
                                   : " was not named but changed"));
  }
}

// Slot lists of N sequences in a pool of 2N + 3: reversed, strided, and padded (every third -1).
inline std::vector<std::pair<std::string, std::vector<std::int32_t>>> slot_lists(std::int64_t n) {
  std::vector<std::int32_t> reversed, strided, padded;
  for (std::int64_t s = 0; s < n; ++s) {
    reversed.push_back(static_cast<std::int32_t>(2 * n + 2 - s));
    strided.push_back(static_cast<std::int32_t>(2 * s + 1));
    padded.push_back(s % 3 == 1 ? -1 : static_cast<std::int32_t>(2 * n + 2 - 2 * s));
  }
  return {{"reversed", reversed}, {"strided", strided}, {"padded", padded}};
}

}  // namespace kda::test
