// kda/detail/checked_math.hpp — overflow-checked size arithmetic, align-up and byte-range overlap,
// the one copy shared by the operator (kda/src), the layer and the engine. Not part of the
// operator's contract: layers above may use it, users need not. The planner keeps its own (it does
// not depend on kda).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

namespace kda::detail {

// a * b into *out; false (and *out untouched) when the product overflows 64 bits.
constexpr bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

// a + b into *out; false (and *out untouched) when the sum overflows 64 bits.
constexpr bool checked_add(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  if (b > std::numeric_limits<std::uint64_t>::max() - a) return false;
  *out = a + b;
  return true;
}

// The product of `factors` into *out; false when it overflows 64 bits.
constexpr bool checked_product(std::initializer_list<std::uint64_t> factors, std::uint64_t* out) {
  std::uint64_t product = 1;
  for (std::uint64_t factor : factors) {
    if (!checked_mul(product, factor, &product)) return false;
  }
  *out = product;
  return true;
}

// `value` rounded up to a multiple of `alignment` (> 0, not necessarily a power of two), for
// values the caller knows cannot overflow (sizes bounded by validation, addresses inside a buffer
// whose size included the slack).
template <typename Unsigned>
constexpr Unsigned align_up(Unsigned value, Unsigned alignment) {
  static_assert(std::is_unsigned_v<Unsigned>, "align_up works on unsigned sizes and addresses");
  return (value + alignment - 1) / alignment * alignment;
}

// The same, checked: false when the rounded value overflows 64 bits.
constexpr bool checked_align_up(std::uint64_t value, std::uint64_t alignment, std::uint64_t* out) {
  std::uint64_t end = 0;
  if (!checked_add(value, alignment - 1, &end)) return false;
  *out = end / alignment * alignment;
  return true;
}

// Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte: never where either
// is null or empty (an empty tensor overlaps nothing, wherever its pointer points).
inline bool byte_ranges_overlap(const void* a, std::uint64_t a_bytes, const void* b,
                                std::uint64_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

}  // namespace kda::detail
