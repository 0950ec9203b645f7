// The checkpoint requests the CUDA benchmarks hand a prefill (bench/checkpoint_requests.hpp): what
// their checkpoint rows report the cost of. Host code, so it runs everywhere.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "checkpoint_requests.hpp"

using kda::bench::checkpoint_requests;

TEST_CASE("bench checkpoint requests: two a sequence reach every sequence, padded with -1") {
  const std::vector<std::int64_t> lengths = {40, 7, 300, 0};
  const auto r = checkpoint_requests(lengths, kda::bench::kTwoPerSequence, 10);
  CHECK(r.columns == 2);
  CHECK(r.count == 8);
  CHECK(r.offsets == std::vector<std::int64_t>{16, 40, 0, 7, 144, 300, 0, 0});
  CHECK(r.rows == std::vector<std::int32_t>{10, 11, 12, 13, 14, 15, 16, 17});
}

TEST_CASE("bench checkpoint requests: one every n tokens and the end, ragged rows") {
  const std::vector<std::int64_t> lengths = {1000, 256, 3};
  const auto r = checkpoint_requests(lengths, 256, 2);
  REQUIRE(r.columns == 4);
  CHECK(r.count == 6);
  CHECK(r.offsets ==
        std::vector<std::int64_t>{256, 512, 768, 1000, 256, -1, -1, -1, 3, -1, -1, -1});
  CHECK(r.rows == std::vector<std::int32_t>{2, 3, 4, 5, 6, -1, -1, -1, 7, -1, -1, -1});
}

TEST_CASE("bench checkpoint requests: unused columns name nothing, and none ask for no columns") {
  const std::vector<std::int64_t> lengths = {64, 32};
  const auto unused = checkpoint_requests(lengths, kda::bench::kUnusedCheckpointColumns, 4);
  CHECK(unused.columns == 2);
  CHECK(unused.count == 0);
  CHECK(unused.offsets == std::vector<std::int64_t>(4, -1));
  CHECK(unused.rows == std::vector<std::int32_t>(4, -1));
  const auto none = checkpoint_requests(lengths, kda::bench::kNoCheckpoints, 4);
  CHECK(none.columns == 0);
  CHECK(none.count == 0);
  CHECK(none.offsets.empty());
}
