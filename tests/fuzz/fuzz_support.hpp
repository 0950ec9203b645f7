// tests/fuzz/fuzz_support.hpp — what the libFuzzer harnesses share: how a finding is reported,
// and batch metadata drawn from a fuzzer's input (slot indices, counts, rows, offsets) for the
// harnesses that drive the operator and the engine.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace kda::fuzz {

// A broken property: said on stderr, then abort, so that libFuzzer keeps the input.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "FINDING: %s\n", what.c_str());
  std::abort();
}

inline void expect(bool condition, const std::string& what) {
  if (!condition) finding(what);
}

// An int32 of batch metadata: mostly in [0, n), sometimes just outside it, sometimes far outside.
// (An input that has run out reads as zeros, which gives the common case.)
inline std::int32_t metadata_value(FuzzedDataProvider& in, std::int64_t n) {
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 15:
      return std::numeric_limits<std::int32_t>::max();
    case 14:
      return std::numeric_limits<std::int32_t>::min();
    case 13:
    case 12:
    case 11:
      return in.ConsumeIntegralInRange<std::int32_t>(-2, static_cast<std::int32_t>(n) + 1);
    default:
      return in.ConsumeIntegralInRange<std::int32_t>(0,
                                                     static_cast<std::int32_t>(n > 0 ? n - 1 : 0));
  }
}

// `count` such values (none for a count below 1).
inline std::vector<std::int32_t> metadata_array(FuzzedDataProvider& in, std::int64_t count,
                                                std::int64_t n) {
  std::vector<std::int32_t> a(static_cast<std::size_t>(count > 0 ? count : 0));
  for (auto& v : a) v = metadata_value(in, n);
  return a;
}

}  // namespace kda::fuzz
