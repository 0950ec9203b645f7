// layer/src/cuda/one_launch_exchange.hpp — how many exchange words the one-launch decode step
// (one_launch_step.cu, OneLaunchStepParams::exchange) hands its values through. Plain C++: the
// layer sizes its weight image with it in builds without CUDA too, and kda-step-probe its buffers.
#pragma once

#include <cstdint>

namespace kda::layer::cuda {

// A word a projection row (proj_rows, then the full-rank gate's `channels` rows), then a word a
// pair of y's `channels` values (the kernel's y_word0 is where those start).
constexpr std::int64_t one_launch_exchange_words(std::int64_t proj_rows, std::int64_t channels,
                                                 bool full_rank_gate) {
  return proj_rows + (full_rank_gate ? channels : 0) + channels / 2;
}

}  // namespace kda::layer::cuda
