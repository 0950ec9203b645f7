// Forwards allocate nothing: after a warm-up call of the same kind, the engine's forwards on the
// CPU backend (the KDA core and whole layers, host spans and BatchMetadata, a prefill with
// checkpoints, a records step and its commit) and a sequence state's write make no heap
// allocation. Counted by replacing the global operator new in this
// binary, only while a forward runs; error paths may allocate (their message), the success path
// may not.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"

namespace {
bool counting = false;
int allocations = 0;
}  // namespace

void* operator new(std::size_t bytes) {
  if (counting) ++allocations;
  if (void* p = std::malloc(bytes != 0 ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using kda::engine::BatchMetadata;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;

// The allocations of one call of `forward`, after a first call of it.
int allocations_of(const std::function<void()>& forward) {
  forward();
  allocations = 0;
  counting = true;
  try {
    forward();
  } catch (...) {
    counting = false;
    throw;
  }
  counting = false;
  return allocations;
}

}  // namespace

TEST_CASE("forward allocations: none on the CPU backend after a warm-up call") {
  // The example model, with records regions for the records step below.
  kda::engine::ModelSpec spec =
      kda::engine::load_model_spec(std::string(KDA_SOURCE_DIR) + "/examples/models/tiny.yaml");
  spec.runtime.max_verify_tokens = 4;
  EngineOptions options;
  options.backend = kda::engine::BackendChoice::kCpu;
  options.cpu_threads = 1;
  Engine engine(spec, options);
  constexpr std::int64_t T = 32;
  const std::int64_t H = spec.num_heads, D = spec.head_dim, E = spec.hidden_size;
  std::vector<std::uint16_t> q(T * H * D, 0x3c00), beta(T * H, 0x3f00), out(T * H * D);
  std::vector<std::uint16_t> hidden(T * E, 0x3c00), hidden_out(T * E);
  const int slot = engine.acquire_slot(), checkpoint = engine.acquire_slot();
  const LayerInputs in{q.data(), q.data(), q.data(), q.data(), beta.data()};
  const std::vector<int> slots{slot};
  const std::vector<std::int64_t> cu{0, T};
  const std::int32_t slots32[1] = {slot};
  const std::int64_t offsets[2] = {16, T};
  const std::int32_t checkpoint_slots[2] = {checkpoint, -1};

  BatchMetadata prefill;
  prefill.tokens = T;
  prefill.sequences = 1;
  prefill.slots = slots32;
  prefill.cu_seqlens = cu.data();
  BatchMetadata with_checkpoints = prefill;
  with_checkpoints.checkpoints = 2;
  with_checkpoints.checkpoint_offsets = offsets;
  with_checkpoints.checkpoint_slots = checkpoint_slots;
  BatchMetadata decode;
  decode.tokens = 1;
  decode.sequences = 1;
  decode.decode_tokens = 1;
  decode.slots = slots32;

  CHECK(allocations_of([&] { engine.prefill(0, in, out.data(), slots, cu); }) == 0);
  CHECK(allocations_of([&] { engine.decode(0, in, out.data(), slots, 1); }) == 0);
  CHECK(allocations_of([&] { engine.prefill(0, in, out.data(), prefill); }) == 0);
  CHECK(allocations_of([&] { engine.decode(0, in, out.data(), decode); }) == 0);
  CHECK(allocations_of(
            [&] { engine.prefill_hidden(0, hidden.data(), hidden_out.data(), slots, cu); }) == 0);
  CHECK(allocations_of(
            [&] { engine.decode_hidden(1, hidden.data(), hidden_out.data(), slots, 1); }) == 0);
  CHECK(allocations_of(
            [&] { engine.prefill_hidden(1, hidden.data(), hidden_out.data(), prefill); }) == 0);
  CHECK(allocations_of([&] {
          engine.prefill_hidden(0, hidden.data(), hidden_out.data(), with_checkpoints);
        }) == 0);
  CHECK(allocations_of(
            [&] { engine.decode_hidden(0, hidden.data(), hidden_out.data(), decode); }) == 0);
  // A records step of two tokens, its commit, and a sequence state written back.
  BatchMetadata records = decode;
  records.tokens = 2;
  records.decode_tokens = 2;
  records.records = true;
  const std::int32_t accepted[1] = {1};
  for (int layer = 0; layer < engine.num_layers(); ++layer) {
    engine.decode_hidden(layer, hidden.data(), hidden_out.data(), records);
  }
  CHECK(allocations_of(
            [&] { engine.decode_hidden(0, hidden.data(), hidden_out.data(), records); }) == 0);
  CHECK(allocations_of([&] { engine.commit(1, slots32, accepted); }) == 0);
  std::vector<unsigned char> state(engine.sequence_state_bytes());
  engine.read_sequence_state(slot, state.data(), state.size());
  CHECK(allocations_of([&] { engine.write_sequence_state(slot, state.data(), state.size()); }) ==
        0);
  // The counter counts: a failing call's message is built on the heap.
  CHECK_THROWS(
      allocations_of([&] { engine.prefill_hidden(0, nullptr, hidden_out.data(), slots, cu); }));
  counting = true;
  allocations = 0;
  const std::string grown(100, 'x');
  counting = false;
  CHECK(allocations >= 1);
}
