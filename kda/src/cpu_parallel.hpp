// The CPU backend's threads: how many a call runs and the loop that hands them work items. Shared
// by the operator's CPU backend (kda/src) and the whole layer's CPU projections (layer/src).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace kda::detail::cpu {

// The CPU backend never runs more threads than this; workspace_size(kCpu) sizes one scratch slot
// per thread up to this many (and never more than the problem has (sequence, head) items).
inline constexpr std::int64_t kMaxThreads = 64;

// Threads for `items` independent work items that update `state_updates` state elements in all
// (tokens x V x K summed over items). An explicit request is honoured (up to kMaxThreads and
// `items`); 0 means the hardware's thread count, but no more threads than the work pays for
// (starting a thread costs about as much as a few hundred thousand element updates).
std::int64_t resolve_threads(int requested, std::int64_t items, std::int64_t state_updates);

// Runs fn(item, worker) for item in [0, items) on `workers` threads (worker in [0, workers)), items
// handed out dynamically. Each item's result depends only on the item, so any thread count gives
// bit-identical results. One worker runs inline. If a thread cannot be started, the workers already
// running (or the caller alone) take over its share: no exception escapes.
template <typename Fn>
void parallel_for(std::int64_t items, std::int64_t workers, Fn fn) {
  std::atomic<std::int64_t> next{0};
  auto drain = [&](std::int64_t worker) {
    for (std::int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
      fn(item, worker);
    }
  };
  if (workers <= 1 || items <= 1) {
    drain(0);
    return;
  }
  std::vector<std::thread> pool;
  try {
    pool.reserve(static_cast<std::size_t>(workers - 1));
    for (std::int64_t w = 1; w < workers; ++w) pool.emplace_back(drain, w);
  } catch (const std::exception&) {
    // Fewer threads than asked: the ones started (and this one) still drain every item.
  }
  drain(0);
  for (std::thread& t : pool) t.join();
}

}  // namespace kda::detail::cpu
