// engine/runtime/src/rendezvous.hpp — the meeting point of the in-process communicators' ranks
// (local_communicator.cpp on the CPU, cuda_local_communicator.cu on CUDA): a reusable barrier
// and one posted entry per rank, read by every rank between two barriers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "kda/error.hpp"

namespace kda::engine {

template <class Entry>
struct Rendezvous {
  explicit Rendezvous(int ranks) : size(ranks), posted(static_cast<std::size_t>(ranks)) {}

  // Blocks until every rank has arrived at this barrier; throws kda::Error once the group is
  // aborted (a rank that fails between collectives would otherwise leave the others waiting).
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex);
    if (aborted) throw_aborted();
    const std::uint64_t generation = passed;
    if (++arrived == size) {
      arrived = 0;
      ++passed;
      all_arrived.notify_all();
      return;
    }
    all_arrived.wait(lock, [&] { return passed != generation || aborted; });
    if (passed == generation) throw_aborted();
  }

  // Wakes every rank waiting in a barrier with kda::Error, and makes every later one throw.
  void abort() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex);
      aborted = true;
    }
    all_arrived.notify_all();
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
  bool aborted = false;

 private:
  [[noreturn]] static void throw_aborted() {
    throw Error(StatusCode::kInternal,
                "the communicator group was aborted (Communicator::abort, by a rank that failed)");
  }
};

}  // namespace kda::engine
