// layer_test_util.hpp — what the whole-layer tests (CPU and CUDA) share: seeded random bf16
// values, the relative L2 error of bf16 / float / double vectors, weights whose g_b bias and o_norm
// matter, the message of a call that throws, and the refusal of a weight image region.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/error.hpp"
#include "kda/layer/layer.hpp"

namespace kda::test {

// `count` values uniform in [-amplitude, amplitude), as bf16, from `seed`.
inline std::vector<bf16_bits> random_bf16(std::size_t count, float amplitude, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  std::vector<bf16_bits> values(count);
  for (bf16_bits& v : values) v = float_to_bf16(dist(rng));
  return values;
}

// Relative L2 error ||a - b|| / ||b|| of vectors of bf16 bits, float or double.
template <typename A, typename B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  REQUIRE(a.size() == b.size());
  auto value = [](auto x) {
    if constexpr (std::is_same_v<decltype(x), bf16_bits>) {
      return static_cast<double>(bf16_to_float(x));
    } else {
      return static_cast<double>(x);
    }
  };
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (value(a[i]) - value(b[i])) * (value(a[i]) - value(b[i]));
    norm += value(b[i]) * value(b[i]);
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// Random weights leave out the g_b bias and set o_norm to ones; tests want both to matter.
inline layer::Weights with_bias_and_norm(layer::Weights w) {
  w.g_b_bias = random_bf16(static_cast<std::size_t>(w.config.local_channels()), 1.0f, 99);
  w.o_norm = random_bf16(static_cast<std::size_t>(w.config.head_dim), 1.0f, 98);
  for (bf16_bits& x : w.o_norm) x = float_to_bf16(1.0f + 0.5f * bf16_to_float(x));
  return w;
}

// The message of the kda::Error `call` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The first `alignment`-aligned byte of `memory` (alignment - 1 bytes longer than what goes there).
inline unsigned char* first_aligned(std::vector<unsigned char>& memory, std::size_t alignment) {
  const auto address = reinterpret_cast<std::uintptr_t>(memory.data());
  return memory.data() + ((address + alignment - 1) / alignment * alignment - address);
}

// The message of the kInvalidArgument error make_layer() throws on `backend` when the weight image
// is to go into `region` of `bytes`.
inline std::string weight_region_refusal(Backend backend, const layer::Weights& weights,
                                         void* region, std::size_t bytes) {
  try {
    (void)layer::make_layer(backend, weights, region, bytes);
    FAIL("the layer accepted the weight image region");
  } catch (const Error& e) {
    CHECK(e.code() == StatusCode::kInvalidArgument);
    return e.what();
  }
  return {};
}

}  // namespace kda::test
