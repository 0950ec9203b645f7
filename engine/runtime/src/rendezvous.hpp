// engine/runtime/src/rendezvous.hpp — the meeting point of the in-process communicators' ranks
// (local_communicator.cpp on the CPU, cuda_local_communicator.cu on CUDA): a reusable barrier
// and one posted entry per rank, read by every rank between two barriers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace kda::engine {

template <class Entry>
struct Rendezvous {
  explicit Rendezvous(int ranks) : size(ranks), posted(static_cast<std::size_t>(ranks)) {}

  // Blocks until every rank has arrived at this barrier.
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex);
    const std::uint64_t generation = passed;
    if (++arrived == size) {
      arrived = 0;
      ++passed;
      all_arrived.notify_all();
      return;
    }
    all_arrived.wait(lock, [&] { return passed != generation; });
  }

  // Publishes this rank's entry and waits until every rank has published its own. The slot may be
  // rewritten by the next post only after a barrier that follows every rank's last read of it.
  void post(int rank, const Entry& entry) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      posted[static_cast<std::size_t>(rank)] = entry;
    }
    barrier();
  }

  const int size;
  std::vector<Entry> posted;  // each rank's entry of the collective in progress
  std::mutex mutex;
  std::condition_variable all_arrived;
  int arrived = 0;
  std::uint64_t passed = 0;
};

}  // namespace kda::engine
