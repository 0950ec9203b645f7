// Tests for kda::planner: both layout modes, validation errors, and the table / JSON reports.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kda/planner/memory_plan.hpp"

namespace {

using kda::planner::BufferHandle;
using kda::planner::BufferKind;
using kda::planner::BufferRequest;
using kda::planner::MemoryPlan;
using kda::planner::MemoryPlanner;
using kda::planner::PlanEntry;
using kda::planner::PlanMode;
using kda::planner::PlanResult;
using kda::planner::PlanStatus;

constexpr std::uint64_t kMaxU64 = std::numeric_limits<std::uint64_t>::max();

std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

BufferRequest make_request(std::string name, std::uint64_t bytes, int first_step, int last_step,
                           BufferKind kind = BufferKind::kScratch, int layer = -1) {
  BufferRequest request;
  request.name = std::move(name);
  request.kind = kind;
  request.layer = layer;
  request.bytes = bytes;
  request.first_step = first_step;
  request.last_step = last_step;
  return request;
}

BufferRequest make_persistent(std::string name, std::uint64_t bytes,
                              BufferKind kind = BufferKind::kState, int layer = -1) {
  BufferRequest request = make_request(std::move(name), bytes, 0, 0, kind, layer);
  request.persistent = true;
  return request;
}

bool lifetimes_overlap(const PlanEntry& a, const PlanEntry& b) {
  if (a.persistent || b.persistent) return true;
  return a.first_step <= b.last_step && b.first_step <= a.last_step;
}

bool memory_overlaps(const PlanEntry& a, const PlanEntry& b) {
  return a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

// Random requests: sizes from a few bytes to a few MiB, optional per-buffer alignment, lifetimes
// within `steps`, about one in six persistent.
std::vector<BufferRequest> random_requests(std::mt19937_64& rng, std::size_t count, int steps) {
  std::uniform_int_distribution<int> size_exponent(0, 22);
  std::uniform_int_distribution<int> step_dist(0, steps - 1);
  std::uniform_int_distribution<int> alignment_choice(0, 7);
  std::uniform_int_distribution<int> kind_choice(0, 3);
  std::vector<BufferRequest> requests;
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t scale = std::uint64_t{1} << size_exponent(rng);
    const std::uint64_t bytes = 1 + rng() % (2 * scale);
    int first = step_dist(rng);
    int last = step_dist(rng);
    if (first > last) std::swap(first, last);
    BufferRequest request =
        make_request("buf" + std::to_string(i), bytes, first, last,
                     static_cast<BufferKind>(kind_choice(rng)), static_cast<int>(i % 7) - 1);
    const int choice = alignment_choice(rng);
    // 0 (the plan's) most of the time; sometimes smaller or larger than the plan's.
    if (choice == 5) request.alignment = 16;
    if (choice == 6) request.alignment = 1024;
    if (choice == 7) request.alignment = 8192;
    request.persistent = rng() % 6 == 0;
    requests.push_back(std::move(request));
  }
  return requests;
}

PlanResult plan_of(const std::vector<BufferRequest>& requests, PlanMode mode,
                   std::uint64_t alignment = kda::planner::kDefaultAlignment) {
  MemoryPlanner planner(alignment);
  for (const BufferRequest& request : requests) planner.add(request);
  return planner.plan(mode);
}

// Checks that hold for every valid plan, whatever the mode.
void check_common_invariants(const std::vector<BufferRequest>& requests, const PlanResult& result,
                             std::uint64_t plan_alignment) {
  REQUIRE(result.ok);
  const MemoryPlan& plan = result.plan;
  REQUIRE(plan.entries.size() == requests.size());
  CHECK(plan.alignment == plan_alignment);
  CHECK(plan.arena_bytes % plan_alignment == 0);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const PlanEntry& entry = plan.entries[i];
    CHECK(entry.name == requests[i].name);  // request order
    CHECK(entry.bytes == requests[i].bytes);
    CHECK(entry.kind == requests[i].kind);
    CHECK(entry.layer == requests[i].layer);
    CHECK(entry.persistent == requests[i].persistent);
    const std::uint64_t alignment = std::max(plan_alignment, requests[i].alignment);
    CHECK(entry.offset % alignment == 0);
    CHECK(entry.offset + entry.bytes <= plan.arena_bytes);
  }
}

std::string error_of(const std::vector<BufferRequest>& requests, PlanMode mode,
                     std::uint64_t alignment = kda::planner::kDefaultAlignment) {
  const PlanResult result = plan_of(requests, mode, alignment);
  CHECK_FALSE(result.ok);
  return result.error;
}

PlanStatus status_of(const std::vector<BufferRequest>& requests, PlanMode mode,
                     std::uint64_t alignment = kda::planner::kDefaultAlignment) {
  return plan_of(requests, mode, alignment).status;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("planner: names of kinds and modes / parse_plan_mode / format_bytes") {
  CHECK(std::string(to_string(BufferKind::kWorkspace)) == "workspace");
  CHECK(std::string(to_string(BufferKind::kState)) == "state");
  CHECK(std::string(to_string(BufferKind::kScratch)) == "scratch");
  CHECK(std::string(to_string(BufferKind::kParameter)) == "parameter");
  CHECK(std::string(to_string(PlanMode::kSum)) == "sum");
  CHECK(std::string(to_string(PlanMode::kReuse)) == "reuse");

  PlanMode mode = PlanMode::kSum;
  CHECK(kda::planner::parse_plan_mode("reuse", &mode));
  CHECK(mode == PlanMode::kReuse);
  CHECK(kda::planner::parse_plan_mode("sum", &mode));
  CHECK(mode == PlanMode::kSum);
  CHECK_FALSE(kda::planner::parse_plan_mode("Reuse!", &mode));
  CHECK_FALSE(kda::planner::parse_plan_mode("", &mode));
  CHECK(mode == PlanMode::kSum);  // untouched on failure
  CHECK_FALSE(kda::planner::parse_plan_mode("sum", nullptr));

  CHECK(kda::planner::format_bytes(0) == "0 B");
  CHECK(kda::planner::format_bytes(1023) == "1023 B");
  CHECK(kda::planner::format_bytes(1024) == "1.0 KiB");
  CHECK(kda::planner::format_bytes(1536) == "1.5 KiB");
  CHECK(kda::planner::format_bytes(3 * 1024 * 1024 / 2) == "1.5 MiB");
  CHECK(kda::planner::format_bytes(1024 * 1024 - 1) == "1.0 MiB");  // not "1024.0 KiB"
  CHECK(kda::planner::format_bytes(std::uint64_t{5} << 30) == "5.0 GiB");
  CHECK(kda::planner::format_bytes(kMaxU64) == "16.0 EiB");
}

TEST_CASE("planner: sum mode / hand-checkable offsets") {
  const std::vector<BufferRequest> requests = {
      make_request("a", 100, 0, 0), make_request("b", 300, 1, 1), make_request("c", 1, 2, 2)};
  const PlanResult result = plan_of(requests, PlanMode::kSum);
  check_common_invariants(requests, result, 256);
  CHECK(result.plan.mode == PlanMode::kSum);
  CHECK(result.plan.entries[0].offset == 0);
  CHECK(result.plan.entries[1].offset == 256);
  CHECK(result.plan.entries[2].offset == 768);
  CHECK(result.plan.arena_bytes == 1024);

  // A request alignment above the plan's raises that buffer's offset only.
  std::vector<BufferRequest> aligned = requests;
  aligned[2].alignment = 4096;
  const PlanResult aligned_result = plan_of(aligned, PlanMode::kSum);
  check_common_invariants(aligned, aligned_result, 256);
  CHECK(aligned_result.plan.entries[2].offset == 4096);
  CHECK(aligned_result.plan.arena_bytes == 4352);

  // An empty plan is valid and empty.
  const PlanResult empty = plan_of({}, PlanMode::kSum);
  CHECK(empty.ok);
  CHECK(empty.plan.arena_bytes == 0);
  CHECK(empty.plan.entries.empty());
}

TEST_CASE("planner: sum mode never overlaps / aligns / and totals the aligned sum") {
  for (const std::uint64_t plan_alignment :
       {std::uint64_t{1}, std::uint64_t{64}, std::uint64_t{256}, std::uint64_t{4096}}) {
    for (std::uint64_t seed = 0; seed < 40; ++seed) {
      CAPTURE(plan_alignment);
      CAPTURE(seed);
      std::mt19937_64 rng(0x5u + seed * 7919u + plan_alignment);
      std::vector<BufferRequest> requests = random_requests(rng, 1 + rng() % 40, 8);
      const PlanResult result = plan_of(requests, PlanMode::kSum, plan_alignment);
      check_common_invariants(requests, result, plan_alignment);
      const std::vector<PlanEntry>& entries = result.plan.entries;
      for (std::size_t i = 0; i < entries.size(); ++i) {
        for (std::size_t j = i + 1; j < entries.size(); ++j) {
          CHECK_FALSE(memory_overlaps(entries[i], entries[j]));
        }
        if (i > 0) CHECK(entries[i].offset >= entries[i - 1].offset + entries[i - 1].bytes);
      }
      // The expected arena, laid out independently: each buffer right after the previous one.
      std::uint64_t cursor = 0;
      for (const BufferRequest& request : requests) {
        cursor = align_up(cursor, std::max(plan_alignment, request.alignment)) + request.bytes;
      }
      CHECK(result.plan.arena_bytes == align_up(cursor, plan_alignment));

      // Without larger per-buffer alignments, the total is exactly the sum of aligned sizes.
      std::uint64_t aligned_sum = 0;
      for (BufferRequest& request : requests) {
        request.alignment = 0;
        aligned_sum += align_up(request.bytes, plan_alignment);
      }
      const PlanResult plain = plan_of(requests, PlanMode::kSum, plan_alignment);
      REQUIRE(plain.ok);
      CHECK(plain.plan.arena_bytes == aligned_sum);
    }
  }
}

TEST_CASE("planner: reuse mode shares memory between layers that run one after another") {
  constexpr int kLayers = 20;
  std::mt19937_64 rng(20);
  std::vector<BufferRequest> requests;
  std::uint64_t largest_workspace = 0;
  std::uint64_t state_sum = 0;
  for (int layer = 0; layer < kLayers; ++layer) {
    const std::uint64_t workspace = (1 + rng() % 64) * 1000;  // not multiples of 256
    requests.push_back(make_request("layer" + std::to_string(layer) + ".workspace", workspace,
                                    layer, layer, BufferKind::kWorkspace, layer));
    largest_workspace = std::max(largest_workspace, align_up(workspace, 256));
  }
  const PlanResult sum = plan_of(requests, PlanMode::kSum);
  const PlanResult reuse = plan_of(requests, PlanMode::kReuse);
  check_common_invariants(requests, sum, 256);
  check_common_invariants(requests, reuse, 256);
  CHECK(reuse.plan.mode == PlanMode::kReuse);
  // Each workspace is live alone, so the arena is the largest one.
  CHECK(reuse.plan.arena_bytes == largest_workspace);
  CHECK(reuse.plan.arena_bytes * 5 < sum.plan.arena_bytes);
  for (const PlanEntry& entry : reuse.plan.entries) CHECK(entry.offset == 0);

  // With a persistent state per layer: the states stack, the workspaces share what is left.
  for (int layer = 0; layer < kLayers; ++layer) {
    const std::uint64_t state = (1 + rng() % 16) * 512;
    requests.push_back(make_persistent("layer" + std::to_string(layer) + ".state", state,
                                       BufferKind::kState, layer));
    state_sum += state;
  }
  const PlanResult with_states = plan_of(requests, PlanMode::kReuse);
  check_common_invariants(requests, with_states, 256);
  CHECK(with_states.plan.arena_bytes == state_sum + largest_workspace);
  CHECK(with_states.plan.arena_bytes < plan_of(requests, PlanMode::kSum).plan.arena_bytes);
}

TEST_CASE("planner: reuse mode never overlaps buffers that are live together (random sets)") {
  for (std::uint64_t seed = 0; seed < 300; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(0xC0FFEEu + seed);
    const int steps = 1 + static_cast<int>(rng() % 12);
    const std::uint64_t plan_alignment = std::uint64_t{1} << (rng() % 10);
    const std::vector<BufferRequest> requests = random_requests(rng, 1 + rng() % 60, steps);
    const PlanResult result = plan_of(requests, PlanMode::kReuse, plan_alignment);
    check_common_invariants(requests, result, plan_alignment);
    const std::vector<PlanEntry>& entries = result.plan.entries;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      for (std::size_t j = i + 1; j < entries.size(); ++j) {
        if (lifetimes_overlap(entries[i], entries[j])) {
          CAPTURE(entries[i].name);
          CAPTURE(entries[j].name);
          CHECK_FALSE(memory_overlaps(entries[i], entries[j]));
        }
      }
    }
    // Never worse than giving every buffer its own region, never better than the bytes live at the
    // busiest step.
    const PlanResult sum = plan_of(requests, PlanMode::kSum, plan_alignment);
    REQUIRE(sum.ok);
    CHECK(result.plan.arena_bytes <= sum.plan.arena_bytes);
    for (int step = 0; step < steps; ++step) {
      std::uint64_t live = 0;
      for (const BufferRequest& request : requests) {
        if (request.persistent || (request.first_step <= step && step <= request.last_step)) {
          live += request.bytes;
        }
      }
      CHECK(result.plan.arena_bytes >= live);
    }
    // Deterministic: the same requests give the same plan.
    CHECK(plan_of(requests, PlanMode::kReuse, plan_alignment).plan.to_json() ==
          result.plan.to_json());
  }
}

TEST_CASE("planner: reuse mode puts persistent buffers first and never shares them") {
  std::mt19937_64 rng(77);
  std::vector<BufferRequest> requests;
  // Interleave persistent and short-lived buffers; the short ones are larger so they would be
  // placed first if persistence were ignored.
  for (int i = 0; i < 6; ++i) {
    requests.push_back(make_request("ws" + std::to_string(i), 4096 + rng() % 4096, i, i));
    requests.push_back(make_persistent("state" + std::to_string(i), 256 + rng() % 1024));
  }
  const PlanResult result = plan_of(requests, PlanMode::kReuse);
  check_common_invariants(requests, result, 256);
  std::uint64_t cursor = 0;
  std::uint64_t largest_workspace = 0;
  for (const BufferRequest& request : requests) {
    const PlanEntry* entry = result.plan.find(request.name);
    REQUIRE(entry != nullptr);
    if (request.persistent) {
      // Stacked at the bottom of the arena, in request order.
      CHECK(entry->offset == cursor);
      cursor = align_up(cursor + request.bytes, 256);
    } else {
      largest_workspace = std::max(largest_workspace, align_up(request.bytes, 256));
    }
  }
  for (const PlanEntry& a : result.plan.entries) {
    if (!a.persistent) continue;
    for (const PlanEntry& b : result.plan.entries) {
      if (&a != &b) CHECK_FALSE(memory_overlaps(a, b));
    }
  }
  CHECK(result.plan.arena_bytes == cursor + largest_workspace);
}

TEST_CASE("planner: reuse mode best fit picks the smallest adequate gap") {
  constexpr std::uint64_t u = 256;
  // Placed by decreasing size (ties by request order):
  //   A 4u [0,1] -> [0, 4u);   B 2u [1,2] -> [4u, 6u);
  //   E 2u [0,1] -> [6u, 8u);  F 1u [1,2] -> [8u, 9u)
  // C (1u, step 2, after F) is live with B and F only, so it sees gaps [0, 4u) and [6u, 8u): best
  // fit takes the 2u gap at 6u, where first fit would take offset 0.
  const std::vector<BufferRequest> requests = {
      make_request("A", 4 * u, 0, 1), make_request("B", 2 * u, 1, 2),
      make_request("E", 2 * u, 0, 1), make_request("F", 1 * u, 1, 2),
      make_request("C", 1 * u, 2, 2)};
  const PlanResult result = plan_of(requests, PlanMode::kReuse);
  check_common_invariants(requests, result, 256);
  CHECK(result.plan.find("A")->offset == 0);
  CHECK(result.plan.find("B")->offset == 4 * u);
  CHECK(result.plan.find("E")->offset == 6 * u);
  CHECK(result.plan.find("F")->offset == 8 * u);
  CHECK(result.plan.find("C")->offset == 6 * u);
  CHECK(result.plan.arena_bytes == 9 * u);

  CHECK(result.plan.find("nope") == nullptr);

  // A buffer too big for every gap goes after the last buffer live with it:
  //   X 4u [0,0] -> [0, 4u);  Y 3u [0,1] -> [4u, 7u);  W 3u [1,1] -> [0, 3u) (best fit in X's gap)
  //   V 2u [1,1] is live with Y and W; the only gap, [3u, 4u), is too small: V goes to 7u.
  const std::vector<BufferRequest> no_fit = {
      make_request("X", 4 * u, 0, 0), make_request("Y", 3 * u, 0, 1),
      make_request("W", 3 * u, 1, 1), make_request("V", 2 * u, 1, 1)};
  const PlanResult no_fit_result = plan_of(no_fit, PlanMode::kReuse);
  check_common_invariants(no_fit, no_fit_result, 256);
  CHECK(no_fit_result.plan.find("X")->offset == 0);
  CHECK(no_fit_result.plan.find("Y")->offset == 4 * u);
  CHECK(no_fit_result.plan.find("W")->offset == 0);
  CHECK(no_fit_result.plan.find("V")->offset == 7 * u);
  CHECK(no_fit_result.plan.arena_bytes == 9 * u);
}

TEST_CASE("planner: reuse mode places a buffer in a gap it fills exactly") {
  constexpr std::uint64_t u = 256;
  // X 3u [0,0] -> [0, 3u);  Y 3u [0,1] -> [3u, 6u);  W 3u [1,1] is live with Y only: X's memory
  // below Y is a gap of exactly 3u, so W goes to 0 and the arena stays 6u (not 9u).
  const std::vector<BufferRequest> requests = {make_request("X", 3 * u, 0, 0),
                                               make_request("Y", 3 * u, 0, 1),
                                               make_request("W", 3 * u, 1, 1)};
  const PlanResult result = plan_of(requests, PlanMode::kReuse);
  check_common_invariants(requests, result, 256);
  CHECK(result.plan.find("X")->offset == 0);
  CHECK(result.plan.find("Y")->offset == 3 * u);
  CHECK(result.plan.find("W")->offset == 0);
  CHECK(result.plan.arena_bytes == 6 * u);
}

TEST_CASE("planner: errors name the buffer and the problem") {
  SUBCASE("zero size") {
    const std::string error =
        error_of({make_request("ok", 10, 0, 0), make_request("empty_ws", 0, 0, 0)}, PlanMode::kSum);
    CHECK(contains(error, "empty_ws"));
    CHECK(contains(error, "bytes"));
    CHECK(status_of({make_request("empty_ws", 0, 0, 0)}, PlanMode::kSum) == PlanStatus::kZeroBytes);
  }
  SUBCASE("size whose aligned size overflows") {
    for (const PlanMode mode : {PlanMode::kSum, PlanMode::kReuse}) {
      const std::string error = error_of({make_request("huge", kMaxU64 - 3, 0, 0)}, mode);
      CHECK(contains(error, "huge"));
      CHECK(contains(error, "overflow"));
      CHECK(status_of({make_request("huge", kMaxU64 - 3, 0, 0)}, mode) == PlanStatus::kOverflow);
    }
    // Right at the limit it fits: UINT64_MAX rounded down to the alignment.
    const PlanResult at_limit = plan_of({make_request("max", kMaxU64 - 255, 0, 0)}, PlanMode::kSum);
    CHECK(at_limit.ok);
    CHECK(at_limit.plan.arena_bytes == kMaxU64 - 255);
  }
  SUBCASE("a buffer whose end cannot round up to the alignment") {
    // Each size rounds up within 64 bits alone, but the second, after the first, ends at
    // 2^64 - 101, which rounds up to 2^64: the arena total would not fit.
    const std::uint64_t second = kMaxU64 - 356;
    REQUIRE(align_up(second, 256) == kMaxU64 - 255);
    const std::vector<BufferRequest> together = {make_request("first", 256, 0, 0),
                                                 make_request("second", second, 0, 0)};
    const std::string error = error_of(together, PlanMode::kSum);
    CHECK(contains(error, "second"));
    CHECK(contains(error, "overflow"));
    CHECK(status_of(together, PlanMode::kSum) == PlanStatus::kOverflow);
    CHECK(status_of(together, PlanMode::kReuse) == PlanStatus::kOverflow);
    const std::vector<BufferRequest> stacked = {make_persistent("first", 256),
                                                make_persistent("second", second)};
    for (const PlanMode mode : {PlanMode::kSum, PlanMode::kReuse}) {
      CHECK(status_of(stacked, mode) == PlanStatus::kOverflow);
    }
    // Live one after another, reuse puts both at 0.
    const std::vector<BufferRequest> apart = {make_request("first", 256, 0, 0),
                                              make_request("second", second, 1, 1)};
    const PlanResult reuse = plan_of(apart, PlanMode::kReuse);
    check_common_invariants(apart, reuse, 256);
    CHECK(reuse.plan.arena_bytes == kMaxU64 - 255);
  }
  SUBCASE("a best-fit layout that would overflow where the sum layout fits") {
    // Reuse places the largest first; the small one's alignment then rounds past 2^64. The sum
    // layout, small one first, fits, and is a reuse layout too.
    const std::uint64_t half = std::uint64_t{1} << 63;
    BufferRequest small = make_request("small", 256, 0, 0);
    small.alignment = half;
    const std::vector<BufferRequest> requests = {small, make_request("big", half + 256, 0, 0)};
    const PlanResult sum = plan_of(requests, PlanMode::kSum);
    REQUIRE(sum.ok);
    const PlanResult reuse = plan_of(requests, PlanMode::kReuse);
    REQUIRE(reuse.ok);
    check_common_invariants(requests, reuse, 256);
    CHECK(reuse.plan.arena_bytes == sum.plan.arena_bytes);
    CHECK(reuse.plan.to_json().find("\"mode\": \"reuse\"") != std::string::npos);
  }
  SUBCASE("many big buffers summing past 2^64") {
    std::vector<BufferRequest> requests;
    for (int i = 0; i < 20; ++i) {
      requests.push_back(make_request("big" + std::to_string(i), std::uint64_t{1} << 60, i, i));
    }
    const std::string sum_error = error_of(requests, PlanMode::kSum);
    CHECK(contains(sum_error, "big15"));  // it would end at 16 * 2^60 = 2^64
    CHECK(contains(sum_error, "overflow"));
    CHECK(status_of(requests, PlanMode::kSum) == PlanStatus::kOverflow);
    // One after another, reuse needs only one of them...
    const PlanResult reuse = plan_of(requests, PlanMode::kReuse);
    CHECK(reuse.ok);
    CHECK(reuse.plan.arena_bytes == std::uint64_t{1} << 60);
    // ...but not when they are all live together.
    for (BufferRequest& request : requests) request.last_step = 19;
    const std::string reuse_error = error_of(requests, PlanMode::kReuse);
    CHECK(contains(reuse_error, "big15"));
    CHECK(contains(reuse_error, "overflow"));
    CHECK(status_of(requests, PlanMode::kReuse) == PlanStatus::kOverflow);
  }
  SUBCASE("alignment not a power of two") {
    BufferRequest request = make_request("odd_align", 100, 0, 0);
    request.alignment = 384;
    const std::string error = error_of({request}, PlanMode::kSum);
    CHECK(contains(error, "odd_align"));
    CHECK(contains(error, "384"));
    CHECK(status_of({request}, PlanMode::kSum) == PlanStatus::kBadAlignment);
    CHECK(contains(error_of({make_request("x", 1, 0, 0)}, PlanMode::kSum, 384), "384"));
    CHECK(contains(error_of({make_request("x", 1, 0, 0)}, PlanMode::kReuse, 0), "alignment"));
    // Zero is no power of two: a plan alignment of 0 is refused as such, even with no buffers.
    for (const PlanMode mode : {PlanMode::kSum, PlanMode::kReuse}) {
      CHECK(status_of({make_request("x", 1, 0, 0)}, mode, 0) == PlanStatus::kBadAlignment);
      CHECK(status_of({}, mode, 0) == PlanStatus::kBadAlignment);
    }
  }
  SUBCASE("duplicate and empty names") {
    const std::string error = error_of(
        {make_request("ws", 1, 0, 0), make_request("other", 1, 0, 0), make_request("ws", 2, 1, 1)},
        PlanMode::kReuse);
    CHECK(contains(error, "'ws'"));
    CHECK(contains(error, "duplicate"));
    CHECK(contains(error, "#2"));
    // Reported as a duplicate even when the buffers would also overflow the arena together.
    const std::vector<BufferRequest> huge_twins = {make_request("twin", kMaxU64 / 2, 0, 0),
                                                   make_request("twin", kMaxU64 / 2, 0, 0)};
    for (const PlanMode mode : {PlanMode::kSum, PlanMode::kReuse}) {
      const PlanResult twins = plan_of(huge_twins, mode);
      CHECK(twins.status == PlanStatus::kDuplicateName);
      CHECK(contains(twins.error, "duplicate"));
      CHECK_FALSE(contains(twins.error, "overflow"));
    }
    const std::string empty =
        error_of({make_request("a", 1, 0, 0), make_request("", 1, 0, 0)}, PlanMode::kSum);
    CHECK(contains(empty, "#1"));
    CHECK(contains(empty, "empty"));
    CHECK(status_of({make_request("", 1, 0, 0)}, PlanMode::kSum) == PlanStatus::kEmptyName);
  }
  SUBCASE("bad lifetimes") {
    const std::string reversed = error_of({make_request("backwards", 1, 3, 2)}, PlanMode::kReuse);
    CHECK(contains(reversed, "backwards"));
    CHECK(contains(reversed, "first_step 3"));
    const std::string negative = error_of({make_request("before_start", 1, -1, 2)}, PlanMode::kSum);
    CHECK(contains(negative, "before_start"));
    CHECK(contains(negative, "negative"));
    // A negative last step is named as such too, not as a first step after the last.
    const std::string negative_last =
        error_of({make_request("ends_before", 1, 0, -1)}, PlanMode::kSum);
    CHECK(contains(negative_last, "ends_before"));
    CHECK(contains(negative_last, "negative"));
    CHECK(status_of({make_request("backwards", 1, 3, 2)}, PlanMode::kSum) ==
          PlanStatus::kBadLifetime);
    // A persistent buffer's steps do not matter.
    BufferRequest persistent = make_persistent("state", 1);
    persistent.first_step = 5;
    persistent.last_step = -1;
    CHECK(plan_of({persistent}, PlanMode::kReuse).ok);
  }
  SUBCASE("bad fields: an unknown kind, a layer below -1") {
    BufferRequest kind = make_request("k", 1, 0, 0);
    kind.kind = static_cast<BufferKind>(42);
    CHECK(error_of({kind}, PlanMode::kSum) == "buffer 'k': kind 42 is not a BufferKind");
    BufferRequest layer = make_request("l", 1, 0, 0);
    layer.layer = -77;
    CHECK(error_of({layer}, PlanMode::kReuse) == "buffer 'l': layer -77 is below -1 (-1: none)");
    CHECK(status_of({layer}, PlanMode::kSum) == PlanStatus::kBadField);
    layer.layer = -1;  // none
    CHECK(plan_of({layer}, PlanMode::kSum).ok);
    CHECK(std::string(kda::planner::to_string(PlanStatus::kBadField)) == "bad field");
  }
  SUBCASE("unknown mode") {
    CHECK(contains(error_of({make_request("a", 1, 0, 0)}, static_cast<PlanMode>(7)), "mode"));
    CHECK(status_of({make_request("a", 1, 0, 0)}, static_cast<PlanMode>(7)) ==
          PlanStatus::kBadMode);
  }
}

TEST_CASE("planner: add() returns handles that resolve to their entries / ok and status agree") {
  for (const PlanMode mode : {PlanMode::kSum, PlanMode::kReuse}) {
    MemoryPlanner planner;
    const BufferHandle a = planner.add(make_persistent("a", 100));
    const BufferHandle b = planner.add(make_request("b", 300, 0, 0));
    const BufferHandle c = planner.add(make_request("c", 200, 1, 1));
    CHECK(a.valid());
    CHECK(a.index == 0);
    CHECK(b.index == 1);
    CHECK(c.index == 2);
    const PlanResult result = planner.plan(mode);
    REQUIRE(result.ok);
    CHECK(result.status == PlanStatus::kOk);
    CHECK(result.error.empty());
    for (const auto& [handle, name] :
         {std::pair<BufferHandle, const char*>{a, "a"}, {b, "b"}, {c, "c"}}) {
      const PlanEntry* entry = result.plan.entry(handle);
      REQUIRE(entry != nullptr);
      CHECK(entry->name == name);
      CHECK(entry == result.plan.find(name));
    }
    CHECK(result.plan.entry(BufferHandle{}) == nullptr);   // default: invalid
    CHECK(result.plan.entry(BufferHandle{3}) == nullptr);  // beyond this plan
    CHECK(result.plan.entry(BufferHandle{-5}) == nullptr);
  }
  CHECK(std::string(kda::planner::to_string(PlanStatus::kDuplicateName)) == "duplicate name");
  CHECK(std::string(kda::planner::to_string(PlanStatus::kOk)) == "ok");
}

TEST_CASE("planner: to_json has the documented shape and parses back") {
  // The exact text of a tiny plan.
  const PlanResult tiny =
      plan_of({make_request("ws", 100, 0, 0, BufferKind::kWorkspace, 0)}, PlanMode::kSum);
  REQUIRE(tiny.ok);
  CHECK(tiny.plan.to_json() ==
        "{\"mode\": \"sum\", \"alignment\": 256, \"arena_bytes\": 256, \"buffers\": [{\"name\": "
        "\"ws\", \"kind\": \"workspace\", \"layer\": 0, \"offset\": 0, \"bytes\": 100, "
        "\"persistent\": false, \"first_step\": 0, \"last_step\": 0}]}");
  CHECK(plan_of({}, PlanMode::kReuse).plan.to_json() ==
        "{\"mode\": \"reuse\", \"alignment\": 256, \"arena_bytes\": 0, \"buffers\": []}");

  const std::vector<std::string> odd_names = {"plain",
                                              "with \"quotes\"",
                                              "back\\slash",
                                              "line\nbreak\ttab\r",
                                              std::string("nul\0byte", 8),
                                              "ctrl\x01\x1f",
                                              "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82",
                                              "/slash"};
  std::mt19937_64 rng(9);
  std::vector<BufferRequest> requests;
  for (std::size_t i = 0; i < odd_names.size(); ++i) {
    BufferRequest request = make_request(odd_names[i], 1 + rng() % 100000, static_cast<int>(i % 3),
                                         static_cast<int>(i % 3) + 1,
                                         static_cast<BufferKind>(i % 4), static_cast<int>(i) - 1);
    request.persistent = i % 4 == 3;
    requests.push_back(request);
  }
  for (const PlanMode mode : {PlanMode::kSum, PlanMode::kReuse}) {
    const PlanResult result = plan_of(requests, mode, 512);
    REQUIRE(result.ok);
    const nlohmann::json json = nlohmann::json::parse(result.plan.to_json());
    CHECK(json.at("mode") == to_string(mode));
    CHECK(json.at("alignment") == 512);
    CHECK(json.at("arena_bytes") == result.plan.arena_bytes);
    REQUIRE(json.at("buffers").size() == requests.size());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const nlohmann::json& buffer = json.at("buffers")[i];
      const PlanEntry& entry = result.plan.entries[i];
      CHECK(buffer.at("name").get<std::string>() == odd_names[i]);
      CHECK(buffer.at("kind") == to_string(entry.kind));
      CHECK(buffer.at("layer") == entry.layer);
      CHECK(buffer.at("offset") == entry.offset);
      CHECK(buffer.at("bytes") == entry.bytes);
      CHECK(buffer.at("persistent") == entry.persistent);
      CHECK(buffer.at("first_step") == entry.first_step);
      CHECK(buffer.at("last_step") == entry.last_step);
    }
  }

  // Bytes that are not UTF-8 still give valid JSON (as U+FFFD), and large numbers stay exact.
  const PlanResult broken =
      plan_of({make_request("bad\xff\xc3(", kMaxU64 - 255, 0, 0)}, PlanMode::kSum);
  REQUIRE(broken.ok);
  const nlohmann::json json = nlohmann::json::parse(broken.plan.to_json());
  CHECK(json.at("buffers")[0].at("name").get<std::string>() == "bad\xef\xbf\xbd\xef\xbf\xbd(");
  CHECK(json.at("arena_bytes").get<std::uint64_t>() == kMaxU64 - 255);
}

TEST_CASE("planner: to_json keeps every well-formed UTF-8 sequence and replaces the others") {
  // RFC 3629: the shortest form only, nothing past U+10FFFF, no surrogates. The bounds of each
  // rule pass through unchanged; one past them becomes U+FFFD, one per byte not consumed.
  const std::string fffd = "\xef\xbf\xbd";
  const std::vector<std::pair<std::string, std::string>> names = {
      {"space here", "space here"},
      {"\x7f", "\x7f"},
      {"\xc2\x80", "\xc2\x80"},                         // U+0080, the first two-byte one
      {"\xdf\xbf", "\xdf\xbf"},                         // U+07FF
      {"\xe0\xa0\x80", "\xe0\xa0\x80"},                 // U+0800, the first three-byte one
      {"\xed\x9f\xbf", "\xed\x9f\xbf"},                 // U+D7FF, below the surrogates
      {"\xee\x80\x80", "\xee\x80\x80"},                 // U+E000, above them
      {"\xf0\x90\x80\x80", "\xf0\x90\x80\x80"},         // U+10000, the first four-byte one
      {"\xf4\x8f\xbf\xbf", "\xf4\x8f\xbf\xbf"},         // U+10FFFF, the last
      {"\xc1\xbf", fffd + fffd},                        // U+007F in two bytes
      {"\xe0\x9f\xbf", fffd + fffd + fffd},             // U+07FF in three
      {"\xf0\x8f\xbf\xbf", fffd + fffd + fffd + fffd},  // U+FFFF in four
      {"\xed\xa0\x80", fffd + fffd + fffd},             // U+D800, the first surrogate
      {"\xed\xbf\xbf", fffd + fffd + fffd},             // U+DFFF, the last
      {"\xf4\x90\x80\x80", fffd + fffd + fffd + fffd},  // U+110000
  };
  std::vector<BufferRequest> requests;
  for (std::size_t i = 0; i < names.size(); ++i) {
    requests.push_back(make_request(std::to_string(i) + names[i].first, 1, 0, 0));
  }
  const PlanResult result = plan_of(requests, PlanMode::kSum);
  REQUIRE(result.ok);
  const std::string text = result.plan.to_json();
  CHECK(contains(text, "\"name\": \"0space here\""));  // printable ASCII as itself
  const nlohmann::json json = nlohmann::json::parse(text);
  REQUIRE(json.at("buffers").size() == names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    CAPTURE(i);
    CHECK(json.at("buffers")[i].at("name").get<std::string>() ==
          std::to_string(i) + names[i].second);
  }
}

TEST_CASE("planner: to_table lists every buffer / the mode and the total") {
  std::vector<BufferRequest> requests = {
      make_request("layer0.workspace", 3 * 1024 * 1024 / 2, 0, 0, BufferKind::kWorkspace, 0),
      make_request("a_much_longer_buffer_name", 10, 1, 1, BufferKind::kScratch),
      make_persistent("layer0.state", 4096, BufferKind::kState, 0),
      make_persistent("layer0.A_log", 128, BufferKind::kParameter, 0)};
  const PlanResult result = plan_of(requests, PlanMode::kReuse);
  REQUIRE(result.ok);
  const std::string table = result.plan.to_table();
  for (const BufferRequest& request : requests) CHECK(contains(table, request.name));
  CHECK(contains(table, std::to_string(result.plan.arena_bytes)));
  CHECK(contains(table, "reuse"));
  CHECK(contains(table, "1.5 MiB"));
  CHECK(contains(table, "persistent"));
  CHECK(contains(table, "[1, 1]"));
  CHECK(contains(table, "parameter"));
  // Header, one line per buffer, totals; buffer lines have the same width up to the lifetime.
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t end; (end = table.find('\n', start)) != std::string::npos; start = end + 1) {
    lines.push_back(table.substr(start, end - start));
  }
  REQUIRE(lines.size() == requests.size() + 2);
  const std::size_t lifetime_column = lines[0].find("lifetime");
  REQUIRE(lifetime_column != std::string::npos);
  CHECK(lines[1].substr(lifetime_column) == "[0, 0]");
  CHECK(lines[3].substr(lifetime_column) == "persistent");
  // A name's control characters as \xNN: each buffer stays one line.
  const PlanResult odd = plan_of(
      {make_request("line\nbreak\r", 1, 0, 0), make_request(std::string("nul\0\x7f", 5), 1, 0, 0)},
      PlanMode::kSum);
  REQUIRE(odd.ok);
  const std::string odd_table = odd.plan.to_table();
  CHECK(std::count(odd_table.begin(), odd_table.end(), '\n') == 4);
  CHECK(contains(odd_table, "line\\x0Abreak\\x0D"));
  CHECK(contains(odd_table, "nul\\x00\\x7F"));
}
