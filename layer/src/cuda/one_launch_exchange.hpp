// layer/src/cuda/one_launch_exchange.hpp — where the one-launch decode step (one_launch_step.cu,
// OneLaunchStepParams::exchange) keeps the words it hands its values through, and how many rows
// (sequences of one token) a layer's exchange holds. Plain C++: the layer sizes its weight image
// with it in builds without CUDA too, kda-step-probe its buffers, and the kernel finds its words
// with it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KDA_ONE_LAUNCH_HOST_DEVICE __host__ __device__
#else
#define KDA_ONE_LAUNCH_HOST_DEVICE
#endif

namespace kda::layer::cuda {

// A step takes at most this many rows, and at most kOneLaunchMaxHeadBlocks (row, head) pairs: each
// pair is a block of its own beside the o_proj blocks, one block a multiprocessor.
inline constexpr int kOneLaunchMaxRows = 8;
inline constexpr int kOneLaunchMaxHeadBlocks = 32;

// The rows a step of `heads` heads may take (at least one).
KDA_ONE_LAUNCH_HOST_DEVICE constexpr int one_launch_max_rows(std::int64_t heads) {
  const std::int64_t rows = heads > 0 ? kOneLaunchMaxHeadBlocks / heads : 1;
  return rows < 1 ? 1 : rows > kOneLaunchMaxRows ? kOneLaunchMaxRows : static_cast<int>(rows);
}

// A row's words: a word a projection row (proj_rows, then the full-rank gate's `channels` rows),
// then a word a pair of y's `channels` values, from this one on.
KDA_ONE_LAUNCH_HOST_DEVICE constexpr std::int64_t one_launch_y_word0(std::int64_t proj_rows,
                                                                     std::int64_t channels,
                                                                     bool full_rank_gate) {
  return proj_rows + (full_rank_gate ? channels : 0);
}

// How many words a row has; row m's start at m times this.
KDA_ONE_LAUNCH_HOST_DEVICE constexpr std::int64_t one_launch_row_words(std::int64_t proj_rows,
                                                                       std::int64_t channels,
                                                                       bool full_rank_gate) {
  return one_launch_y_word0(proj_rows, channels, full_rank_gate) + channels / 2;
}

// The words of an exchange for `rows` rows (a layer's: one_launch_max_rows of its heads).
KDA_ONE_LAUNCH_HOST_DEVICE constexpr std::int64_t one_launch_exchange_words(int rows,
                                                                            std::int64_t proj_rows,
                                                                            std::int64_t channels,
                                                                            bool full_rank_gate) {
  return rows * one_launch_row_words(proj_rows, channels, full_rank_gate);
}

}  // namespace kda::layer::cuda
