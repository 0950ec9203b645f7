// layer/src/cuda/one_launch_exchange.hpp — where the one-launch decode step (one_launch_step.cu,
// OneLaunchStepParams::exchange) keeps the words it hands its values through. Plain C++: the layer
// sizes its weight image with it in builds without CUDA too, kda-step-probe its buffers, and the
// kernel finds y's words with it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KDA_ONE_LAUNCH_HOST_DEVICE __host__ __device__
#else
#define KDA_ONE_LAUNCH_HOST_DEVICE
#endif

namespace kda::layer::cuda {

// A word a projection row (proj_rows, then the full-rank gate's `channels` rows), then a word a
// pair of y's `channels` values, from this one on.
KDA_ONE_LAUNCH_HOST_DEVICE constexpr std::int64_t one_launch_y_word0(std::int64_t proj_rows,
                                                                     std::int64_t channels,
                                                                     bool full_rank_gate) {
  return proj_rows + (full_rank_gate ? channels : 0);
}

// How many words that is.
KDA_ONE_LAUNCH_HOST_DEVICE constexpr std::int64_t one_launch_exchange_words(std::int64_t proj_rows,
                                                                            std::int64_t channels,
                                                                            bool full_rank_gate) {
  return one_launch_y_word0(proj_rows, channels, full_rank_gate) + channels / 2;
}

}  // namespace kda::layer::cuda
