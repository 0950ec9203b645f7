// bench/checkpoint_requests.hpp — the prefix-cache checkpoint requests the CUDA benchmarks hand a
// prefill (kda::Problem::checkpoints, the layer's checkpoint tensors): offsets [N, K] and the pool
// rows they write, padded with -1. Shared by kda-bench and kda-layer-bench, and host code only, so
// that a CPU test (tests/bench) checks the requests whose cost the benchmarks report.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kda::bench {

// What a benchmark row asks for (`every`): no checkpoints; two a sequence (its middle, rounded
// down to the 16-token chunk, and its end); two columns of -1 (the checkpoint kernels with nothing
// to store: their fixed cost); or, for every > 0, one every `every` tokens and the end.
inline constexpr std::int64_t kNoCheckpoints = 0;
inline constexpr std::int64_t kTwoPerSequence = -1;
inline constexpr std::int64_t kUnusedCheckpointColumns = -2;

// The offsets asked of one sequence of `length` tokens.
inline std::vector<std::int64_t> checkpoint_offsets(std::int64_t length, std::int64_t every) {
  if (every == kTwoPerSequence) return {length / 2 / 16 * 16, length};
  if (every <= 0) return {};
  std::vector<std::int64_t> offsets;
  for (std::int64_t o = every; o < length; o += every) offsets.push_back(o);
  offsets.push_back(length);
  return offsets;
}

struct CheckpointRequests {
  std::int64_t columns = 0;           // K: the longest sequence's count (2 for unused columns)
  std::int64_t count = 0;             // requests that name an offset
  std::vector<std::int64_t> offsets;  // [N, K]; -1 past a sequence's own
  std::vector<std::int32_t> rows;     // [N, K]; first_row, first_row + 1, ... in order; -1 with -1
};

// The requests of sequences of `lengths` tokens, their states into pool rows from `first_row` on.
inline CheckpointRequests checkpoint_requests(const std::vector<std::int64_t>& lengths,
                                              std::int64_t every, std::int32_t first_row) {
  CheckpointRequests r;
  std::vector<std::vector<std::int64_t>> asked;
  asked.reserve(lengths.size());
  for (const std::int64_t length : lengths) {
    asked.push_back(checkpoint_offsets(length, every));
    r.columns = std::max<std::int64_t>(r.columns, static_cast<std::int64_t>(asked.back().size()));
  }
  if (every == kUnusedCheckpointColumns) r.columns = 2;
  const std::size_t cells = lengths.size() * static_cast<std::size_t>(r.columns);
  r.offsets.assign(cells, -1);
  r.rows.assign(cells, -1);
  std::int32_t next = first_row;
  for (std::size_t n = 0; n < asked.size(); ++n) {
    for (std::size_t k = 0; k < asked[n].size(); ++k) {
      const std::size_t cell = n * static_cast<std::size_t>(r.columns) + k;
      r.offsets[cell] = asked[n][k];
      r.rows[cell] = next++;
      ++r.count;
    }
  }
  return r;
}

}  // namespace kda::bench
