// Slot copy (kda.hpp, "Slot copy"): the checks both backends share, and the CPU backend's copy and
// zeroing.
#include <cstring>
#include <string>

#include "argument_table.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/kda.hpp"
#include "state_slots.hpp"

namespace kda {
namespace {

Status invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, "slot copy: " + std::move(message));
}

std::string pool_name(int i) { return "pools[" + std::to_string(i) + "]"; }

bool padding(const SlotCopyProblem& p, std::int32_t slot) {
  return slot < 0 || slot == p.padding_slot;
}

// Every pair that is not padding: both entries inside the pools, no destination named twice or
// also a source. Pairwise comparisons, so that nothing is allocated: pairs^2 of them, far below the
// bytes a pair copies for any real pool.
Status check_pairs(const SlotCopyProblem& p, const std::int32_t* src, const std::int32_t* dst) {
  for (std::int64_t i = 0; i < p.pairs; ++i) {
    if (padding(p, src[i]) || padding(p, dst[i])) continue;
    const std::string pair = std::to_string(i);
    for (const auto& [slot, name] : {std::pair<std::int32_t, const char*>{src[i], "src"},
                                     std::pair<std::int32_t, const char*>{dst[i], "dst"}}) {
      if (slot >= p.num_slots) {
        return invalid(std::string(name) + "[" + pair + "] = " + std::to_string(slot) +
                       " is out of range (num_slots " + std::to_string(p.num_slots) + ")");
      }
    }
    for (std::int64_t j = 0; j < p.pairs; ++j) {
      if (padding(p, src[j]) || padding(p, dst[j])) continue;
      if (j < i && dst[j] == dst[i]) {
        return invalid("dst[" + std::to_string(j) + "] and dst[" + pair + "] both name slot " +
                       std::to_string(dst[i]));
      }
      if (src[j] == dst[i]) {
        return invalid("dst[" + pair + "] = " + std::to_string(dst[i]) + " is also src[" +
                       std::to_string(j) + "] (a copy's destinations are not its sources)");
      }
    }
  }
  return Status::Ok();
}

// The checks of both forms: `dst` null for a zeroing, whose one index array is `src` ("slots").
Status validate_pools(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                      const std::int32_t* src, const std::int32_t* dst) {
  const bool zeroing = dst == nullptr;
  if (p.pairs < 0) {
    return invalid(std::string(zeroing ? "the entries" : "pairs") + " must be >= 0 (got " +
                   std::to_string(p.pairs) + ")");
  }
  if (p.num_slots < 0) {
    return invalid("num_slots must be >= 0 (got " + std::to_string(p.num_slots) + ")");
  }
  if (Status st = detail::check_padding_slot(p.padding_slot, p.num_slots, "num_slots"); !st) {
    return invalid(st.message());
  }
  if (num_pools < 0 || num_pools > kMaxCopyPools) {
    return invalid("num_pools must be in [0, " + std::to_string(kMaxCopyPools) + "] (got " +
                   std::to_string(num_pools) + ")");
  }
  if (num_pools > 0 && pools == nullptr) {
    return invalid("pools is null but num_pools is " + std::to_string(num_pools));
  }
  std::uint64_t index_bytes = 0;
  if (!detail::checked_mul(static_cast<std::uint64_t>(p.pairs), 4, &index_bytes) ||
      index_bytes > detail::kMaxSize) {
    return Status(StatusCode::kOverflow, "slot copy: src / dst bytes pairs*4 overflow");
  }
  if (p.pairs > 0 && src == nullptr) {
    return invalid(std::string(zeroing ? "slots" : "src") + " is null but " +
                   (zeroing ? "the entries are " : "pairs is ") + std::to_string(p.pairs));
  }
  for (int i = 0; i < num_pools; ++i) {
    std::uint64_t bytes = 0;
    if (!detail::checked_mul(static_cast<std::uint64_t>(p.num_slots), pools[i].entry_bytes,
                             &bytes) ||
        bytes > detail::kMaxSize) {
      return Status(
          StatusCode::kOverflow,
          "slot copy: " + pool_name(i) + " bytes num_slots*entry_bytes overflow 64-bit sizes");
    }
    if (pools[i].base == nullptr && bytes > 0 && p.pairs > 0) {
      return invalid(pool_name(i) + ".base is null");
    }
    const detail::Argument pool = detail::byte_range(pools[i].base, bytes);
    for (int j = 0; j < i; ++j) {
      if (detail::overlaps(pool,
                           detail::byte_range(pools[j].base, p.num_slots * pools[j].entry_bytes))) {
        return invalid(pool_name(i) + " overlaps " + pool_name(j) + " (each pool is its own)");
      }
    }
    for (const auto& [ptr, name] :
         {std::pair<const void*, const char*>{src, zeroing ? "slots" : "src"},
          std::pair<const void*, const char*>{dst, "dst"}}) {
      if (detail::overlaps(pool, detail::byte_range(ptr, index_bytes))) {
        return invalid(pool_name(i) + " overlaps " + name + " (a pool is written)");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status validate(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                const std::int32_t* src, const std::int32_t* dst) {
  if (p.pairs > 0 && dst == nullptr) {
    return invalid("dst is null but pairs is " + std::to_string(p.pairs));
  }
  return validate_pools(p, pools, num_pools, src, dst);
}

Status validate(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                const std::int32_t* slots) {
  return validate_pools(p, pools, num_pools, slots, nullptr);
}

Status copy_slots_cpu(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                      const std::int32_t* src, const std::int32_t* dst) {
  if (Status st = validate(p, pools, num_pools, src, dst); !st) return st;
  if (Status st = check_pairs(p, src, dst); !st) return st;
  for (std::int64_t i = 0; i < p.pairs; ++i) {
    if (padding(p, src[i]) || padding(p, dst[i])) continue;
    for (int k = 0; k < num_pools; ++k) {
      const std::uint64_t bytes = pools[k].entry_bytes;
      if (bytes == 0) continue;
      auto* base = static_cast<unsigned char*>(pools[k].base);
      std::memcpy(base + static_cast<std::uint64_t>(dst[i]) * bytes,
                  base + static_cast<std::uint64_t>(src[i]) * bytes, bytes);
    }
  }
  return Status::Ok();
}

Status zero_slots_cpu(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                      const std::int32_t* slots) {
  if (Status st = validate(p, pools, num_pools, slots); !st) return st;
  for (std::int64_t i = 0; i < p.pairs; ++i) {
    if (!padding(p, slots[i]) && slots[i] >= p.num_slots) {
      return invalid("slots[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
                     " is out of range (num_slots " + std::to_string(p.num_slots) + ")");
    }
  }
  for (std::int64_t i = 0; i < p.pairs; ++i) {
    if (padding(p, slots[i])) continue;
    for (int k = 0; k < num_pools; ++k) {
      const std::uint64_t bytes = pools[k].entry_bytes;
      if (bytes == 0) continue;
      std::memset(
          static_cast<unsigned char*>(pools[k].base) + static_cast<std::uint64_t>(slots[i]) * bytes,
          0, bytes);
    }
  }
  return Status::Ok();
}

}  // namespace kda
