// kda/bf16.hpp — host-side bfloat16 conversions (round to nearest even), shared by the CPU backend,
// the engine, the tests and the benchmarks.
#pragma once

#include <cstdint>
#include <cstring>

namespace kda {

// bf16 stored as its raw 16 bits (the upper half of an IEEE float).
using bf16_bits = std::uint16_t;

inline float bf16_to_float(bf16_bits b) noexcept {
  std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline bf16_bits float_to_bf16(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<bf16_bits>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<bf16_bits>(u >> 16);
}

// Round a float to the nearest bf16 value, kept as float.
inline float round_bf16(float f) noexcept { return bf16_to_float(float_to_bf16(f)); }

}  // namespace kda
