// rank_threads.hpp — what the parallel tests (tests/engine/test_parallel*.cpp) share: ranks run as
// threads of the test, and a slot's recurrent and conv states read and written whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/engine/engine.hpp"
#include "layer_test_util.hpp"

namespace kda::test {

// Runs body(rank) on one thread per rank and waits for all; each rank's exception text (empty:
// none), in rank order. Assertions stay on the test's thread.
inline std::vector<std::string> run_on_rank_threads(int ranks,
                                                    const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

// A slot's states of one layer: the f32 recurrent state and the three conv states (q, k, v).
struct SlotStates {
  std::vector<float> recurrent;
  std::vector<std::vector<bf16_bits>> conv;
};

// The starting states the context-parallel tests give a slot: recurrent [H, D, D] 0.01 (i % 13),
// each of the three conv states [H D, W - 1] random in [-0.5, 0.5) (seeds 50, 51, 52).
inline SlotStates starting_slot_states(std::int64_t H, std::int64_t D, std::int64_t W) {
  SlotStates states;
  states.recurrent.resize(static_cast<std::size_t>(H * D * D));
  for (std::size_t i = 0; i < states.recurrent.size(); ++i) {
    states.recurrent[i] = 0.01f * static_cast<float>(i % 13);
  }
  const std::size_t conv_elements = static_cast<std::size_t>(H * D * (W - 1));
  for (int p = 0; p < 3; ++p) states.conv.push_back(random_bf16(conv_elements, 0.5f, 50 + p));
  return states;
}

inline void write_slot_states(engine::Engine& e, int layer, int slot,
                              const std::vector<float>& recurrent,
                              const std::vector<std::vector<bf16_bits>>& conv) {
  e.write_slot_state(layer, slot, recurrent.data());
  for (int p = 0; p < 3; ++p) e.write_slot_conv_state(layer, slot, p, conv[p].data());
}

inline SlotStates read_slot_states(const engine::Engine& e, int layer, int slot,
                                   std::size_t recurrent_elements, std::size_t conv_elements) {
  SlotStates st{std::vector<float>(recurrent_elements), {}};
  e.read_slot_state(layer, slot, st.recurrent.data());
  for (int p = 0; p < 3; ++p) {
    st.conv.emplace_back(conv_elements);
    e.read_slot_conv_state(layer, slot, p, st.conv.back().data());
  }
  return st;
}

}  // namespace kda::test
