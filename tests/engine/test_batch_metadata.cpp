// The engine's forwards on caller-owned batch metadata (kda::engine::BatchMetadata) on both
// backends: equal to the host-span calls, padding rows that output zeros and touch no state, bad
// metadata refused on the CPU and reported by the device on CUDA, and (CUDA) a decode step of every
// layer and a prefill bucket captured once in a CUDA graph and replayed as the slots and cu_seqlens
// change, equal to eager calls bitwise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_runtime_util.hpp"
#include "cuda_test_util.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"
#include "kda/kda_engine.h"
#include "layer_test_util.hpp"
#include "synthetic_run.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using kda::Backend;
using kda::engine::BatchMetadata;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::ModelSpec;

// A C batch started from kda_batch_init, with its leading fields.
kda_batch c_batch(std::int64_t tokens = 0, std::int64_t sequences = 0, int decode_tokens = 0,
                  const std::int32_t* slots = nullptr, const std::int64_t* cu_seqlens = nullptr) {
  kda_batch batch;
  REQUIRE(kda_batch_init(&batch) == KDA_OK);
  batch.tokens = tokens;
  batch.sequences = sequences;
  batch.decode_tokens = decode_tokens;
  batch.slots = slots;
  batch.cu_seqlens = cu_seqlens;
  return batch;
}

// Two whole KDA layers of 4 heads of 128 (the CUDA path's head size), softplus gate, six slots.
const char* const kSpec =
    "name: batch-metadata\n"
    "hidden_size: 256\n"
    "num_hidden_layers: 2\n"
    "linear_attn_config:\n"
    "  num_heads: 4\n"
    "  head_dim: 128\n"
    "  kda_layers: [1, 2]\n"
    "  full_attn_layers: []\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 256\n"
    "  max_sequences: 6\n"
    "  workspace_plan: reuse\n";

ModelSpec spec() { return kda::engine::parse_model_spec(kSpec, "batch-metadata.yaml"); }
constexpr std::int64_t kHidden = 256;

// Memory of one backend: host buffers for the CPU, device buffers for CUDA (both with guards).
class Memory {
 public:
  Memory(Backend backend, std::size_t bytes) : device_(backend == Backend::kCuda) {
    if (device_) {
      d_ = kda::test::DeviceBuffer(bytes);
    } else {
      h_ = kda::test::HostBuffer(bytes);
    }
  }
  template <typename T>
  Memory(Backend backend, const std::vector<T>& values)
      : Memory(backend, values.size() * sizeof(T)) {
    write(values);
  }
  void* get() const { return device_ ? d_.get() : h_.get(); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(get());
  }
  template <typename T>
  void write(const std::vector<T>& values) {
    if (values.empty()) return;
    if (device_) {
      REQUIRE(kda::memcpy_to_device(get(), values.data(), values.size() * sizeof(T)).ok());
      REQUIRE(kda::stream_synchronize(nullptr).ok());
    } else {
      std::memcpy(get(), values.data(), values.size() * sizeof(T));
    }
  }
  template <typename T>
  std::vector<T> read() const {
    return device_ ? d_.download<T>() : h_.download<T>();
  }
  // NaN bytes; on CUDA finished before it returns (the engines may run on a non-blocking stream).
  void poison() {
    if (device_) {
      d_.fill(0xFF);
      REQUIRE(kda::stream_synchronize(nullptr).ok());
    } else {
      h_.fill(0xFF);
    }
  }
  bool guards_intact() const { return device_ ? d_.guards_intact() : h_.guards_intact(); }

 private:
  bool device_;
  kda::test::DeviceBuffer d_;
  kda::test::HostBuffer h_;
};

// Every slot's recurrent and conv states of every layer, as host bytes.
std::vector<std::uint8_t> all_states(const Engine& e) {
  std::vector<std::uint8_t> states;
  const auto state_bytes = static_cast<std::size_t>(e.state_slot_bytes());
  const auto conv_bytes = static_cast<std::size_t>(e.conv_state_slot_bytes());
  for (int l = 0; l < e.num_layers(); ++l) {
    for (int slot = 0; slot < e.num_slots(); ++slot) {
      std::vector<std::uint8_t> s(state_bytes);
      e.read_slot_state(l, slot, s.data());
      states.insert(states.end(), s.begin(), s.end());
      for (int p = 0; p < 3; ++p) {
        std::vector<std::uint8_t> c(conv_bytes);
        e.read_slot_conv_state(l, slot, p, c.data());
        states.insert(states.end(), c.begin(), c.end());
      }
    }
  }
  return states;
}

// Every slot of `e` acquired.
void acquire_all(Engine& e) {
  for (int s = 0; s < e.num_slots(); ++s) e.acquire_slot();
}

// Two engines with the same weights on `backend`: one driven through host spans, the other through
// caller-owned metadata; every slot acquired and given a history by the same prefill.
struct EnginePair {
  explicit EnginePair(Backend backend, void* stream = nullptr, const ModelSpec& model = spec())
      : backend(backend),
        spans(model, options(backend, stream)),
        meta(model, options(backend, stream)) {
    for (Engine* e : {&spans, &meta}) {
      for (int s = 0; s < e->num_slots(); ++s) REQUIRE(e->acquire_slot() == s);
    }
    const std::vector<std::int64_t> cu = {0, 7, 19, 20, 33, 41, 52};
    const std::vector<int> slots = {0, 1, 2, 3, 4, 5};
    Memory hidden(backend, kda::test::random_bf16(52 * kHidden, 1.0f, 5));
    Memory out(backend, 52 * kHidden * 2);
    for (Engine* e : {&spans, &meta}) {
      for (int l = 0; l < e->num_layers(); ++l)
        e->prefill_hidden(l, hidden.get(), out.get(), slots, cu);
      e->synchronize();
    }
  }
  static EngineOptions options(Backend backend, void* stream) {
    EngineOptions o;
    o.backend = backend == Backend::kCuda ? kda::engine::BackendChoice::kCuda
                                          : kda::engine::BackendChoice::kCpu;
    o.seed = 17;
    o.cpu_threads = 2;
    o.stream = stream;
    return o;
  }
  Backend backend;
  Engine spans, meta;
};

bool usable(Backend backend) { return backend == Backend::kCpu || kda::test::gpu_or_skip(); }

// The case `name` on each backend, "name [cpu]" and "name [cuda]" (CTest's labels cpu and gpu):
// `run(backend)`, the CUDA one skipped with a message where there is no usable device.
#define KDA_ENGINE_CASE(name, run)                   \
  TEST_CASE(name " [cpu]") { run(Backend::kCpu); }   \
  TEST_CASE(name " [cuda]") {                        \
    if (usable(Backend::kCuda)) run(Backend::kCuda); \
  }

// A decode step of every layer on `slots` (negative: padding), through spans and through
// metadata: outputs and every state equal bitwise; padding rows zeros; slots outside the batch
// unchanged.
void decode_layouts(Backend backend) {
  EnginePair pair(backend);
  const std::vector<std::vector<int>> layouts = {
      {3, 0, 5}, {5, 4, 3, 2, 1, 0}, {-1, 2, -1, 4}, {1}, {-1, -1, 0, -1, -1, 5}};
  std::uint64_t seed = 100;
  for (const std::vector<int>& slots : layouts) {
    CAPTURE(slots.size());
    const auto rows = static_cast<std::int64_t>(slots.size());
    for (const int tokens : {1, 3}) {
      const std::vector<std::uint8_t> before = all_states(pair.meta);
      Memory hidden(backend, kda::test::random_bf16(rows * tokens * kHidden, 1.0f, ++seed));
      Memory out_spans(backend, rows * tokens * kHidden * 2),
          out_meta(backend, rows * tokens * kHidden * 2);
      out_spans.poison();
      out_meta.poison();
      Memory slot_list(backend, std::vector<std::int32_t>(slots.begin(), slots.end()));
      BatchMetadata batch;
      batch.tokens = rows * tokens;
      batch.sequences = rows;
      batch.decode_tokens = tokens;
      batch.slots = slot_list.as<std::int32_t>();
      for (int l = 0; l < pair.spans.num_layers(); ++l) {
        pair.spans.decode_hidden(l, hidden.get(), out_spans.get(), slots, tokens);
        pair.meta.decode_hidden(l, hidden.get(), out_meta.get(), batch);
      }
      pair.spans.synchronize();
      pair.meta.synchronize();
      const auto a = out_spans.read<std::uint16_t>(), b = out_meta.read<std::uint16_t>();
      CHECK(a == b);
      CHECK(all_states(pair.spans) == all_states(pair.meta));
      CHECK(out_meta.guards_intact());
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto first = b.begin() + r * tokens * kHidden, last = first + tokens * kHidden;
        if (slots[static_cast<std::size_t>(r)] < 0) {
          CHECK(std::all_of(first, last, [](std::uint16_t x) { return x == 0; }));
        } else {
          CHECK(std::any_of(first, last, [](std::uint16_t x) { return x != 0; }));
        }
      }
      // Slots outside the batch (padding rows included) kept every state byte.
      const std::vector<std::uint8_t> after = all_states(pair.meta);
      const std::size_t per_slot = after.size() / static_cast<std::size_t>(2 * 6);
      for (int l = 0; l < 2; ++l) {
        for (int s = 0; s < 6; ++s) {
          if (std::find(slots.begin(), slots.end(), s) != slots.end()) continue;
          const std::size_t at = (static_cast<std::size_t>(l) * 6 + s) * per_slot;
          CHECK(std::equal(after.begin() + at, after.begin() + at + per_slot, before.begin() + at));
        }
      }
    }
  }
}

// A varlen prefill on metadata (an empty, a one-token and a padding sequence) against the same
// batch through spans: equal (bitwise on the CPU; CUDA may plan long sequences differently without
// host lengths, so within rounding), padding rows zeros and no state touched.
void prefill_varlen(Backend backend) {
  EnginePair pair(backend);
  const std::vector<std::int64_t> cu = {0, 0, 1, 24, 33, 60};
  const std::vector<int> slots = {4, 0, -1, 2, 5};
  const std::int64_t T = cu.back();
  const std::vector<std::uint8_t> before = all_states(pair.meta);
  Memory hidden(backend, kda::test::random_bf16(T * kHidden, 1.0f, 8));
  Memory out_spans(backend, T * kHidden * 2), out_meta(backend, T * kHidden * 2);
  out_meta.poison();
  Memory slot_list(backend, std::vector<std::int32_t>(slots.begin(), slots.end()));
  Memory cu_list(backend, cu);
  BatchMetadata batch;
  batch.tokens = T;
  batch.sequences = static_cast<std::int64_t>(slots.size());
  batch.slots = slot_list.as<std::int32_t>();
  batch.cu_seqlens = cu_list.as<std::int64_t>();
  for (int l = 0; l < pair.spans.num_layers(); ++l) {
    pair.spans.prefill_hidden(l, hidden.get(), out_spans.get(), slots, cu);
    pair.meta.prefill_hidden(l, hidden.get(), out_meta.get(), batch);
  }
  pair.spans.synchronize();
  pair.meta.synchronize();
  const auto a = out_spans.read<std::uint16_t>(), b = out_meta.read<std::uint16_t>();
  if (backend == Backend::kCpu) {
    CHECK(a == b);
    CHECK(all_states(pair.spans) == all_states(pair.meta));
  } else {
    CHECK(kda::test::relative_error(b, a) < 5e-3);
  }
  CHECK(out_meta.guards_intact());
  // The padding sequence (tokens 1..24): zeros; slots 1 and 3 (not in the batch) untouched.
  CHECK(std::all_of(b.begin() + 1 * kHidden, b.begin() + 24 * kHidden,
                    [](std::uint16_t x) { return x == 0; }));
  CHECK(std::any_of(b.begin() + 24 * kHidden, b.end(), [](std::uint16_t x) { return x != 0; }));
  const std::vector<std::uint8_t> after = all_states(pair.meta);
  const std::size_t per_slot = after.size() / 12;
  for (int l = 0; l < 2; ++l) {
    for (const int slot : {1, 3}) {
      const std::size_t at = (static_cast<std::size_t>(l) * 6 + slot) * per_slot;
      CHECK(std::equal(after.begin() + at, after.begin() + at + per_slot, before.begin() + at));
    }
  }
}

// One slot's recurrent state and its three conv states in one layer, as floats.
std::vector<double> slot_values(const Engine& e, int layer, int slot) {
  std::vector<float> state(e.state_slot_bytes() / sizeof(float));
  e.read_slot_state(layer, slot, state.data());
  std::vector<double> values(state.begin(), state.end());
  for (int p = 0; p < 3; ++p) {
    std::vector<std::uint16_t> conv(e.conv_state_slot_bytes() / sizeof(std::uint16_t));
    e.read_slot_conv_state(layer, slot, p, conv.data());
    for (const std::uint16_t x : conv) values.push_back(kda::bf16_to_float(x));
  }
  return values;
}

double deviation(const std::vector<double>& got, const std::vector<double>& want) {
  if (got == want) return 0.0;
  return kda::test::relative_error(got, want);
}

// A speculative verify step through BatchMetadata::num_accepted, both layers: row 0 (3 tokens)
// starts from slot 1 (2 accepted) and keeps its states in slots 0, 1, 2; row 1 starts from slot 3
// (1 accepted), keeps them in slots 3 and 4 and not after its last token. The reference: the other
// engine of the pair, one-token decode steps of the same rows on their start slots, the states
// read after every step. The CPU computes the same operations (bit for bit); CUDA runs other
// GEMM shapes for the two calls. Slot 5 is not touched.
void verify_step(Backend backend) {
  EnginePair pair(backend);
  const int T = 3;
  const std::vector<std::int32_t> entries = {0, 1, 2, 3, 4, -1};
  Memory hidden(backend, kda::test::random_bf16(2 * T * kHidden, 1.0f, 71));
  Memory out(backend, 2 * T * kHidden * 2);
  out.poison();
  Memory slots(backend, entries);
  Memory accepted(backend, std::vector<std::int32_t>{2, 1});
  BatchMetadata b;
  b.tokens = 2 * T;
  b.sequences = 2;
  b.decode_tokens = T;
  b.slots = slots.as<std::int32_t>();
  b.num_accepted = accepted.as<std::int32_t>();
  const std::vector<double> untouched = slot_values(pair.meta, 1, 5);
  std::vector<std::vector<std::uint16_t>> outs;
  for (int l = 0; l < 2; ++l) {
    pair.meta.decode_hidden(l, hidden.get(), out.get(), b);
    pair.meta.synchronize();
    outs.push_back(out.read<std::uint16_t>());
  }
  CHECK_NOTHROW(pair.meta.check_device_status());
  CHECK(out.guards_intact());

  const double tolerance = backend == Backend::kCpu ? 0.0 : 1e-2;
  const std::vector<std::uint16_t> all = hidden.read<std::uint16_t>();
  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    std::vector<std::vector<double>> kept(5);
    std::vector<std::uint16_t> want(static_cast<std::size_t>(2 * T * kHidden));
    for (int t = 0; t < T; ++t) {
      std::vector<std::uint16_t> step(all.begin() + t * kHidden, all.begin() + (t + 1) * kHidden);
      step.insert(step.end(), all.begin() + (T + t) * kHidden, all.begin() + (T + t + 1) * kHidden);
      Memory in(backend, step), o(backend, step.size() * 2);
      pair.spans.decode_hidden(l, in.get(), o.get(), {1, 3}, 1);
      pair.spans.synchronize();
      const std::vector<std::uint16_t> got = o.read<std::uint16_t>();
      std::copy(got.begin(), got.begin() + kHidden, want.begin() + t * kHidden);
      std::copy(got.begin() + kHidden, got.end(), want.begin() + (T + t) * kHidden);
      kept[static_cast<std::size_t>(entries[static_cast<std::size_t>(t)])] =
          slot_values(pair.spans, l, 1);
      if (t < 2) {
        kept[static_cast<std::size_t>(entries[static_cast<std::size_t>(T + t)])] =
            slot_values(pair.spans, l, 3);
      }
    }
    const double out_error = deviation(kda::test::to_doubles(outs[static_cast<std::size_t>(l)]),
                                       kda::test::to_doubles(want));
    MESSAGE("verify through the engine, layer " << l << ": out " << out_error);
    CHECK(out_error <= tolerance);
    for (int s = 0; s < 5; ++s) {
      CAPTURE(s);
      CHECK(deviation(slot_values(pair.meta, l, s), kept[static_cast<std::size_t>(s)]) <=
            tolerance);
    }
  }
  CHECK(slot_values(pair.meta, 1, 5) == untouched);
}

}  // namespace

KDA_ENGINE_CASE("engine: a verify step keeps each token's states in its slots (num_accepted)",
                verify_step)

namespace {

// A num_accepted outside [1, decode_tokens]: refused on the CPU (as are slots named twice and a
// prefill with num_accepted), reported by the device on CUDA.
void bad_verify(Backend backend) {
  {
    Engine e(spec(), EnginePair::options(backend, nullptr));
    acquire_all(e);
    Memory hidden(backend, kda::test::random_bf16(4 * kHidden, 1.0f, 72));
    Memory out(backend, 4 * kHidden * 2);
    Memory slots(backend, std::vector<std::int32_t>{0, 1, 2, 3});
    Memory accepted(backend, std::vector<std::int32_t>{1, 3});
    BatchMetadata b;
    b.tokens = 4;
    b.sequences = 2;
    b.decode_tokens = 2;
    b.slots = slots.as<std::int32_t>();
    b.num_accepted = accepted.as<std::int32_t>();
    if (backend == Backend::kCpu) {
      CHECK(kda::test::error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), b); }) ==
            "decode_hidden: row 1 has num_accepted 3, expected 1..2 (decode_tokens)");
      accepted.write(std::vector<std::int32_t>{0, 1});  // no token accepted: no state to start from
      CHECK(kda::test::error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), b); }) ==
            "decode_hidden: row 0 has num_accepted 0, expected 1..2 (decode_tokens)");
      accepted.write(std::vector<std::int32_t>{1, 3});
      BatchMetadata twice = b;
      accepted.write(std::vector<std::int32_t>{1, 1});
      slots.write(std::vector<std::int32_t>{0, 1, 2, 1});
      CHECK(kda::test::error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), twice); }) ==
            "decode_hidden: slot 1 appears twice in the batch");
      BatchMetadata prefill = b;
      prefill.decode_tokens = 0;
      const std::vector<std::int64_t> cu = {0, 2, 4};
      prefill.cu_seqlens = cu.data();
      CHECK(kda::test::error_of([&] { e.prefill_hidden(0, hidden.get(), out.get(), prefill); }) ==
            "prefill_hidden: num_accepted is set, but a verify step is a decode");
    } else {
      e.decode_hidden(0, hidden.get(), out.get(), b);
      const std::string error = kda::test::error_of([&] { e.check_device_status(); });
      CHECK(error.find("num_accepted") != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("engine: a verify step's bad num_accepted is refused [cpu]") {
  bad_verify(Backend::kCpu);
}
TEST_CASE("engine: a verify step's bad num_accepted is reported by the device [cuda]") {
  if (usable(Backend::kCuda)) bad_verify(Backend::kCuda);
}

namespace {

// A prefill of two sequences (20 and 33 tokens, slots 0 and 1) with checkpoints: sequence 0 after
// 16 tokens into slot 2, sequence 1 after 32 into slot 3 (its second request none). Continuing
// sequence 1 from slot 3 with its last token ends where the one-pass prefill ended (the CPU: bit
// for bit; CUDA within rounding), in both layers.
void prefill_checkpoints(Backend backend) {
  Engine e(spec(), EnginePair::options(backend, nullptr));
  for (int s = 0; s < 4; ++s) e.acquire_slot();
  const std::vector<std::int64_t> cu = {0, 20, 53};
  const std::vector<std::int64_t> offsets = {16, -1, 32, -1};
  const std::vector<std::int32_t> checkpoint_slots = {2, -1, 3, -1};
  Memory hidden(backend, kda::test::random_bf16(53 * kHidden, 1.0f, 81));
  Memory out(backend, 53 * kHidden * 2);
  Memory slots(backend, std::vector<std::int32_t>{0, 1});
  Memory cu_dev(backend, cu), off_dev(backend, offsets), cp_dev(backend, checkpoint_slots);
  BatchMetadata b;
  b.tokens = 53;
  b.sequences = 2;
  b.slots = slots.as<std::int32_t>();
  b.cu_seqlens = cu_dev.as<std::int64_t>();
  b.checkpoints = 2;
  b.checkpoint_offsets = off_dev.as<std::int64_t>();
  b.checkpoint_slots = cp_dev.as<std::int32_t>();
  for (int l = 0; l < 2; ++l) e.prefill_hidden(l, hidden.get(), out.get(), b);
  e.check_device_status();  // throws what the device reported (CUDA)
  const std::vector<std::uint16_t> all = hidden.read<std::uint16_t>();
  const std::vector<std::uint16_t> last(all.begin() + 52 * kHidden, all.end());
  Memory tail(backend, last), tail_out(backend, kHidden * 2);
  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    const std::vector<double> one_pass = slot_values(e, l, 1);
    e.prefill_hidden(l, tail.get(), tail_out.get(), {3}, {0, 1});
    if (backend == Backend::kCpu) {
      CHECK(slot_values(e, l, 3) == one_pass);
    } else {  // the continuation's recurrence may round apart from the one pass
      CHECK(deviation(slot_values(e, l, 3), one_pass) <= 5e-3);
    }
  }
  // A prefill of empty sequences only (no tokens, no hidden): each request at offset 0 holds its
  // sequence's states as they are, bit for bit, in every layer (into fresh slots 4 and 5, zero
  // before); the sequences' own slots unchanged.
  {
    CHECK(e.acquire_slot() == 4);
    CHECK(e.acquire_slot() == 5);
    Memory empty_cu(backend, std::vector<std::int64_t>{0, 0, 0});
    Memory empty_offsets(backend, std::vector<std::int64_t>{0, 0});
    Memory empty_rows(backend, std::vector<std::int32_t>{5, 4});
    BatchMetadata empty = b;
    empty.tokens = 0;
    empty.cu_seqlens = empty_cu.as<std::int64_t>();
    empty.checkpoints = 1;
    empty.checkpoint_offsets = empty_offsets.as<std::int64_t>();
    empty.checkpoint_slots = empty_rows.as<std::int32_t>();
    std::vector<std::vector<double>> own[2];
    for (int l = 0; l < 2; ++l) own[l] = {slot_values(e, l, 0), slot_values(e, l, 1)};
    for (int l = 0; l < 2; ++l) e.prefill_hidden(l, nullptr, nullptr, empty);
    e.check_device_status();
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      CHECK(slot_values(e, l, 5) == own[l][0]);
      CHECK(slot_values(e, l, 4) == own[l][1]);
      CHECK(slot_values(e, l, 0) == own[l][0]);
      CHECK(slot_values(e, l, 1) == own[l][1]);
    }
    e.release_slot(4);
    e.release_slot(5);
  }
  // More checkpoint columns than a sequence of max_tokens (256) has offsets (256 / 16 + 2): refused
  // on either backend before any [sequences, checkpoints] array is read (a count such as 2^61
  // would wrap their byte counts).
  for (const std::int64_t columns : {std::int64_t{19}, std::int64_t{1} << 61}) {
    BatchMetadata wide = b;
    wide.checkpoints = columns;
    CHECK(kda::test::error_of([&] { e.prefill_hidden(0, hidden.get(), out.get(), wide); }) ==
          "prefill_hidden: checkpoints " + std::to_string(columns) +
              ", expected at most 18 (runtime.max_tokens / 16 + 2: every offset a sequence has)");
  }
  // CUDA reads the requests on the device only (the operator's and the layer's tests cover what
  // it reports); the CPU refuses slots not acquired, or named twice.
  if (backend == Backend::kCuda) return;
  cp_dev.write(std::vector<std::int32_t>{5, -1, 3, -1});
  CHECK(kda::test::error_of([&] { e.prefill_hidden(0, hidden.get(), out.get(), b); }) ==
        "prefill_hidden: checkpoint 0 uses slot 5, which is not an acquired slot");
  // A request at offset 0 (the sequence's initial states) is a write like any other.
  off_dev.write(std::vector<std::int64_t>{0, -1, 32, -1});
  CHECK(kda::test::error_of([&] { e.prefill_hidden(0, hidden.get(), out.get(), b); }) ==
        "prefill_hidden: checkpoint 0 uses slot 5, which is not an acquired slot");
  off_dev.write(offsets);
  cp_dev.write(std::vector<std::int32_t>{1, -1, 3, -1});
  CHECK(kda::test::error_of([&] { e.prefill_hidden(0, hidden.get(), out.get(), b); }) ==
        "prefill_hidden: slot 1 appears twice in the batch");
  // A padding sequence's requests are not read, as the layer's contract says: one naming a slot
  // not acquired (or its own sequence's) is no error there, and the other sequence's is written.
  slots.write(std::vector<std::int32_t>{-1, 1});
  cp_dev.write(std::vector<std::int32_t>{5, -1, 3, -1});
  const std::vector<double> before = slot_values(e, 0, 3);
  CHECK(kda::test::error_of([&] { e.prefill_hidden(0, hidden.get(), out.get(), b); }) ==
        "(no error)");
  CHECK(slot_values(e, 0, 3) != before);
}

}  // namespace

KDA_ENGINE_CASE("engine: prefill checkpoints on caller-owned metadata, and continuing from one",
                prefill_checkpoints)

namespace {

// A serving step that carries decode rows and prefill sequences in one hidden tensor (vLLM's order:
// the decodes first) is two calls a layer on row offsets of it and sub-arrays of one slot list
// (caller-owned metadata): outputs and every state equal the same batches run from buffers and
// slot lists of their own, bit for bit.
void mixed_step(Backend backend) {
  EnginePair pair(backend);
  const std::int64_t decode_rows = 3, prefill_tokens = 14;
  const std::vector<std::int32_t> slots = {0, 2, 4, 1, 3};  // three decode rows, two sequences
  const std::vector<std::uint16_t> all =
      kda::test::random_bf16((decode_rows + prefill_tokens) * kHidden, 1.0f, 97);
  Memory hidden(backend, all), out(backend, all.size() * 2), slot_list(backend, slots);
  Memory cu(backend, std::vector<std::int64_t>{0, 5, 14});
  BatchMetadata decode;
  decode.tokens = decode_rows;
  decode.sequences = decode_rows;
  decode.decode_tokens = 1;
  decode.slots = slot_list.as<std::int32_t>();
  BatchMetadata prefill;
  prefill.tokens = prefill_tokens;
  prefill.sequences = 2;
  prefill.slots = slot_list.as<std::int32_t>() + decode_rows;
  prefill.cu_seqlens = cu.as<std::int64_t>();
  const std::size_t offset = static_cast<std::size_t>(decode_rows * kHidden) * 2;
  Memory decode_hidden(
      backend, std::vector<std::uint16_t>(all.begin(), all.begin() + decode_rows * kHidden));
  Memory prefill_hidden(backend,
                        std::vector<std::uint16_t>(all.begin() + decode_rows * kHidden, all.end()));
  Memory decode_out(backend, offset), prefill_out(backend, all.size() * 2 - offset);
  // The same batches from buffers and slot lists of their own, on caller-owned metadata too (a
  // CUDA prefill plans from its bounds there, from the lengths on host spans).
  Memory decode_slots(backend, std::vector<std::int32_t>{0, 2, 4}),
      prefill_slots(backend, std::vector<std::int32_t>{1, 3});
  BatchMetadata decode_alone = decode, prefill_alone = prefill;
  decode_alone.slots = decode_slots.as<std::int32_t>();
  prefill_alone.slots = prefill_slots.as<std::int32_t>();
  for (int l = 0; l < 2; ++l) {
    pair.meta.decode_hidden(l, hidden.get(), out.get(), decode);
    pair.meta.prefill_hidden(l, static_cast<unsigned char*>(hidden.get()) + offset,
                             static_cast<unsigned char*>(out.get()) + offset, prefill);
    pair.spans.decode_hidden(l, decode_hidden.get(), decode_out.get(), decode_alone);
    pair.spans.prefill_hidden(l, prefill_hidden.get(), prefill_out.get(), prefill_alone);
    std::vector<std::uint16_t> want = decode_out.read<std::uint16_t>();
    const std::vector<std::uint16_t> rest = prefill_out.read<std::uint16_t>();
    want.insert(want.end(), rest.begin(), rest.end());
    CAPTURE(l);
    CHECK(out.read<std::uint16_t>() == want);
  }
  pair.meta.check_device_status();
  CHECK(all_states(pair.meta) == all_states(pair.spans));
}

}  // namespace

KDA_ENGINE_CASE("engine: a step of decode rows and prefill sequences as two calls on one tensor",
                mixed_step)

namespace {

// One slot's states in every layer (recurrent and conv), as bytes.
std::vector<std::uint8_t> slot_states(const Engine& e, int slot) {
  std::vector<std::uint8_t> states;
  for (int l = 0; l < e.num_layers(); ++l) {
    std::vector<std::uint8_t> s(static_cast<std::size_t>(e.state_slot_bytes()));
    e.read_slot_state(l, slot, s.data());
    states.insert(states.end(), s.begin(), s.end());
    for (int p = 0; p < 3; ++p) {
      std::vector<std::uint8_t> c(static_cast<std::size_t>(e.conv_state_slot_bytes()));
      e.read_slot_conv_state(l, slot, p, c.data());
      states.insert(states.end(), c.begin(), c.end());
    }
  }
  return states;
}

// A prefix shared by two requests: a 48-token prompt prefilled on slot a with a checkpoint after
// 32 tokens into slot c; two requests copy slot c into slots of their own (copy_slots on
// caller-owned pairs, a padding pair among them) and continue from there, one with the prompt's
// last 16 tokens (the one-pass prefill's outputs: the CPU bit for bit, CUDA within rounding), one
// with other tokens (equal bitwise to the same tokens continued from a copy made through host
// spans). The checkpoint stays as it was, every copy of it equals it bit for bit, and no slot
// outside the pairs changes.
void shared_prefix(Backend backend) {
  Engine e(spec(), EnginePair::options(backend, nullptr));
  const int a = e.acquire_slot(), c = e.acquire_slot();
  const std::vector<std::uint16_t> prompt = kda::test::random_bf16(48 * kHidden, 1.0f, 95);
  Memory hidden(backend, prompt), out(backend, 48 * kHidden * 2);
  Memory slot_a(backend, std::vector<std::int32_t>{a}),
      cu(backend, std::vector<std::int64_t>{0, 48});
  Memory offsets(backend, std::vector<std::int64_t>{32}),
      rows(backend, std::vector<std::int32_t>{c});
  BatchMetadata whole;
  whole.tokens = 48;
  whole.sequences = 1;
  whole.slots = slot_a.as<std::int32_t>();
  whole.cu_seqlens = cu.as<std::int64_t>();
  whole.checkpoints = 1;
  whole.checkpoint_offsets = offsets.as<std::int64_t>();
  whole.checkpoint_slots = rows.as<std::int32_t>();
  std::vector<std::vector<std::uint16_t>> one_pass;
  for (int l = 0; l < 2; ++l) {
    e.prefill_hidden(l, hidden.get(), out.get(), whole);
    const std::vector<std::uint16_t> all = out.read<std::uint16_t>();
    one_pass.emplace_back(all.begin() + 32 * kHidden, all.end());
  }
  e.release_slot(a);
  const std::vector<std::uint8_t> checkpoint = slot_states(e, c);
  const int r1 = e.acquire_slot(), r2 = e.acquire_slot(), r3 = e.acquire_slot();
  const int spare = e.acquire_slot();  // slot 5 stays free
  const std::vector<std::uint8_t> spare_before = slot_states(e, spare);

  Memory src(backend, std::vector<std::int32_t>{c, -1, c}),
      dst(backend, std::vector<std::int32_t>{r1, spare, r2});
  e.copy_slots(3, src.as<std::int32_t>(), dst.as<std::int32_t>());
  e.check_device_status();
  CHECK(slot_states(e, r1) == checkpoint);
  CHECK(slot_states(e, r2) == checkpoint);
  CHECK(slot_states(e, spare) == spare_before);  // its pair was padding
  CHECK(slot_states(e, c) == checkpoint);

  const std::vector<std::uint16_t> tail(prompt.begin() + 32 * kHidden, prompt.end());
  const std::vector<std::uint16_t> other = kda::test::random_bf16(16 * kHidden, 1.0f, 96);
  Memory tail_hidden(backend, tail), other_hidden(backend, other);
  Memory tail_out(backend, 16 * kHidden * 2), other_out(backend, 16 * kHidden * 2);
  std::vector<std::vector<std::uint16_t>> other_outs;
  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    e.prefill_hidden(l, tail_hidden.get(), tail_out.get(), {r1}, {0, 16});
    e.prefill_hidden(l, other_hidden.get(), other_out.get(), {r2}, {0, 16});
    const std::vector<std::uint16_t> got = tail_out.read<std::uint16_t>();
    if (backend == Backend::kCpu) {
      CHECK(got == one_pass[static_cast<std::size_t>(l)]);
    } else {
      CHECK(kda::test::relative_error(got, one_pass[static_cast<std::size_t>(l)]) <= 1e-2);
    }
    other_outs.push_back(other_out.read<std::uint16_t>());
  }
  CHECK(slot_states(e, c) == checkpoint);  // the continuations ran on the copies

  // The same request again, from a copy made through host spans: the same bits.
  e.copy_slots({c}, {r3});
  CHECK(slot_states(e, r3) == checkpoint);
  for (int l = 0; l < 2; ++l) {
    e.prefill_hidden(l, other_hidden.get(), other_out.get(), {r3}, {0, 16});
    CHECK(other_out.read<std::uint16_t>() == other_outs[static_cast<std::size_t>(l)]);
  }
  CHECK(slot_states(e, r3) == slot_states(e, r2));

  // A fork of a running sequence: r1 into r2 and r3 (their states replaced).
  e.copy_slots({r1, r1}, {r2, r3});
  CHECK(slot_states(e, r2) == slot_states(e, r1));
  CHECK(slot_states(e, r3) == slot_states(e, r1));

  // The requests end: their slots zeroed for the next ones, conv states too, on the device.
  const std::vector<std::uint8_t> zeros(checkpoint.size(), 0);
  {
    Memory ended(backend, std::vector<std::int32_t>{r3, -1});
    const std::vector<std::uint8_t> r2_kept = slot_states(e, r2);
    e.reset_slots(2, ended.as<std::int32_t>());
    CHECK(slot_states(e, r3) == zeros);
    CHECK(slot_states(e, r2) == r2_kept);
    CHECK(slot_states(e, c) == checkpoint);
  }

  // Bad pairs: the host spans are checked on both backends; caller-owned pairs on the CPU, and on
  // CUDA a slot outside the pool is reported by the device and its pair skipped.
  const std::vector<std::uint8_t> r2_before = slot_states(e, r2);
  CHECK(kda::test::error_of([&] { e.copy_slots({c}, {5}); }) ==
        "copy_slots: pair 0 copies into slot 5, which is not an acquired slot");
  CHECK(kda::test::error_of([&] {
          e.copy_slots({c, r1}, {r2, r2});
        }) == "copy_slots: slot " + std::to_string(r2) + " is the destination of two pairs");
  CHECK(kda::test::error_of([&] {
          e.copy_slots({c, r2}, {r2, r3});
        }) == "copy_slots: slot " + std::to_string(r2) +
                  " is both a source (pair 1) and a destination of the copy");
  CHECK(kda::test::error_of([&] {
          e.copy_slots({c, c}, {r2});
        }) == "copy_slots: src has 2 entries, dst 1");
  CHECK(kda::test::error_of([&] {
          e.copy_slots(7, src.as<std::int32_t>(), dst.as<std::int32_t>());
        }) == "copy_slots: 7 pairs, expected 0..6 (runtime.max_sequences)");
  CHECK(kda::test::error_of([&] { e.copy_slots(1, nullptr, dst.as<std::int32_t>()); }) ==
        "copy_slots: src or dst is null");
  src.write(std::vector<std::int32_t>{c, -1, 6});
  dst.write(std::vector<std::int32_t>{r2, spare, r3});
  if (backend == Backend::kCpu) {
    CHECK(kda::test::error_of([&] {
            e.copy_slots(3, src.as<std::int32_t>(), dst.as<std::int32_t>());
          }) == "copy_slots: pair 2 copies from slot 6, which is not an acquired slot");
    CHECK(slot_states(e, r2) == r2_before);  // nothing written
  } else {
    e.copy_slots(3, src.as<std::int32_t>(), dst.as<std::int32_t>());
    const std::string error = kda::test::error_of([&] { e.check_device_status(); });
    CHECK(error.find("slot index") != std::string::npos);
    CHECK(slot_states(e, r2) == checkpoint);  // the good pair ran
  }
}

}  // namespace

KDA_ENGINE_CASE("engine: a prefix checkpoint shared by two requests through copy_slots",
                shared_prefix)

namespace {

// A sequence moved to host memory and back, and into another engine of the same model: the block
// read_sequence_state() gives is its header, then every layer's recurrent and conv states in
// slot_states()' order; written into another slot (or engine) it continues as the original does,
// bit for bit. A block whose header does not describe the engine is refused, nothing written.
void sequence_state_round_trip(Backend backend) {
  Engine e(spec(), EnginePair::options(backend, nullptr));
  Engine other(spec(), EnginePair::options(backend, nullptr));  // the same seed: the same weights
  const int a = e.acquire_slot(), b = e.acquire_slot();
  const int there = other.acquire_slot();
  Memory hidden(backend, kda::test::random_bf16(21 * kHidden, 1.0f, 98)),
      out(backend, 21 * kHidden * 2);
  for (int l = 0; l < 2; ++l) e.prefill_hidden(l, hidden.get(), out.get(), {a}, {0, 21});
  const std::uint64_t bytes = e.sequence_state_bytes();
  const std::size_t header_bytes = sizeof(kda::engine::SequenceStateHeader);
  CHECK(bytes == header_bytes + 2 * (e.state_slot_bytes() + 3 * e.conv_state_slot_bytes()));
  std::vector<std::uint8_t> block(bytes, 0xA5);
  e.read_sequence_state(a, block.data(), bytes);
  kda::engine::SequenceStateHeader header;
  std::memcpy(&header, block.data(), header_bytes);
  CHECK(std::string(header.magic, 8) == "KDASTATE");
  CHECK(header.version == 1);
  CHECK(header.header_bytes == header_bytes);
  CHECK(header.payload_bytes == bytes - header_bytes);
  CHECK(header.kda_layers == 2);
  CHECK(header.num_heads == e.spec().num_heads);
  CHECK(header.head_dim == e.spec().head_dim);
  CHECK(header.conv_width == e.spec().short_conv_kernel_size);
  CHECK(header.state_value_bytes == 4);
  CHECK(header.tp_rank == 0);
  CHECK(header.tp_size == 1);
  CHECK(header.reserved[0] == 0);
  CHECK(header.reserved[2] == 0);
  const std::vector<std::uint8_t> payload(block.begin() + header_bytes, block.end());
  CHECK(payload == slot_states(e, a));
  e.write_sequence_state(b, block.data(), bytes);
  other.write_sequence_state(there, block.data(), bytes);
  CHECK(slot_states(e, b) == payload);
  CHECK(slot_states(other, there) == payload);
  // One decode token on each copy: the same outputs and states.
  Memory step(backend, kda::test::random_bf16(kHidden, 1.0f, 99));
  Memory out_a(backend, kHidden * 2), out_b(backend, kHidden * 2), out_there(backend, kHidden * 2);
  for (int l = 0; l < 2; ++l) {
    e.decode_hidden(l, step.get(), out_a.get(), {a}, 1);
    e.decode_hidden(l, step.get(), out_b.get(), {b}, 1);
    other.decode_hidden(l, step.get(), out_there.get(), {there}, 1);
    CAPTURE(l);
    CHECK(out_b.read<std::uint16_t>() == out_a.read<std::uint16_t>());
    CHECK(out_there.read<std::uint16_t>() == out_a.read<std::uint16_t>());
  }
  CHECK(slot_states(e, b) == slot_states(e, a));
  CHECK(slot_states(other, there) == slot_states(e, a));
  // Bad calls, nothing written.
  const std::vector<std::uint8_t> b_before = slot_states(e, b);
  CHECK(kda::test::error_of([&] { e.write_sequence_state(b, block.data(), bytes - 1); }) ==
        "write_sequence_state: " + std::to_string(bytes - 1) +
            " bytes, the sequence's states are " + std::to_string(bytes) +
            " (sequence_state_bytes)");
  CHECK(kda::test::error_of([&] { e.write_sequence_state(5, block.data(), bytes); }) ==
        "write_sequence_state: slot 5 is not acquired");
  CHECK(kda::test::error_of([&] { e.read_sequence_state(6, block.data(), bytes); }) ==
        "read_sequence_state: slot 6 out of range");
  // Below the pool too: nothing before slot 0 is read or written.
  CHECK(kda::test::error_of([&] { e.read_sequence_state(-1, block.data(), bytes); }) ==
        "read_sequence_state: slot -1 out of range");
  std::vector<std::uint8_t> one_state(e.state_slot_bytes());
  CHECK(kda::test::error_of([&] { e.read_slot_state(0, -1, one_state.data()); }) ==
        "read_slot_state: slot -1 out of range");
  CHECK(kda::test::error_of([&] { e.write_slot_state(0, -1, one_state.data()); }) ==
        "write_slot_state: slot -1 out of range");
  // A free slot takes no state (acquire_slot would zero it): refused as the whole block is.
  std::vector<std::uint8_t> one_conv(e.conv_state_slot_bytes(), 0x3C);
  const std::vector<std::uint8_t> free_before = slot_states(e, 5);
  std::fill(one_state.begin(), one_state.end(), std::uint8_t{0x3C});
  CHECK(kda::test::error_of([&] { e.write_slot_state(0, 5, one_state.data()); }) ==
        "write_slot_state: slot 5 is not acquired");
  CHECK(kda::test::error_of([&] { e.write_slot_conv_state(1, 5, 2, one_conv.data()); }) ==
        "write_slot_conv_state: slot 5 is not acquired");
  CHECK(slot_states(e, 5) == free_before);
  CHECK(kda::test::error_of([&] { e.read_sequence_state(a, nullptr, bytes); }) ==
        "read_sequence_state: the host buffer is null");
  // Headers that do not describe this engine: each named, the block's value then the engine's.
  auto with = [&](auto change) {
    std::vector<std::uint8_t> bad = block;
    kda::engine::SequenceStateHeader h;
    std::memcpy(&h, bad.data(), header_bytes);
    change(h);
    std::memcpy(bad.data(), &h, header_bytes);
    return kda::test::error_of([&] { e.write_sequence_state(b, bad.data(), bytes); });
  };
  const std::string prefix = "write_sequence_state: ";
  CHECK(with([](auto& h) { h.magic[0] = 'X'; }) ==
        prefix +
            "the block does not begin with a sequence-state header (KDASTATE, as "
            "read_sequence_state writes it)");
  CHECK(with([](auto& h) { h.version = 2; }) ==
        prefix + "the block's header is version 2 of 64 bytes; this engine reads version 1 of 64");
  CHECK(with([](auto& h) { h.header_bytes = 72; }) ==
        prefix + "the block's header is version 1 of 72 bytes; this engine reads version 1 of 64");
  CHECK(with([](auto& h) { h.tp_rank = 1, h.tp_size = 2; }) ==
        prefix + "the block holds tensor-parallel rank 1 of 2, this engine rank 0 of 1");
  // Another rank of as many ranks: its heads are not this engine's.
  CHECK(with([](auto& h) { h.tp_rank = 1; }) ==
        prefix + "the block holds tensor-parallel rank 1 of 1, this engine rank 0 of 1");
  CHECK(with([](auto& h) { h.state_value_bytes = 2; }) ==
        prefix + "the block holds bf16 states, this engine fp32");
  CHECK(with([](auto& h) { h.conv_width = 0; }) ==
        prefix + "the block holds no conv states (KDA cores), this engine conv states of width " +
            std::to_string(e.spec().short_conv_kernel_size) + " (whole layers)");
  CHECK(with([&](auto& h) {
          h.kda_layers = 3;
          h.head_dim *= 2;
          h.payload_bytes += 1;
        }) == prefix + "the block holds 3 KDA layers, this engine 2; head_dim " +
                  std::to_string(2 * e.spec().head_dim) + ", this engine " +
                  std::to_string(e.spec().head_dim) + "; " +
                  std::to_string(bytes - header_bytes + 1) + " bytes of states, this engine " +
                  std::to_string(bytes - header_bytes));
  CHECK(with([](auto& h) { h.num_heads += 1; }).find("heads, this engine") != std::string::npos);
  // The ranks' count alone differing, and any one byte of the magic, are refused too.
  CHECK(with([](auto& h) { h.tp_size = 2; }) ==
        prefix + "the block holds tensor-parallel rank 0 of 2, this engine rank 0 of 1");
  for (std::size_t i = 0; i < sizeof(kda::engine::SequenceStateHeader::magic); ++i) {
    CAPTURE(i);
    CHECK(with([i](auto& h) {
            h.magic[i] ^= 0x20;
          }).find("does not begin with a sequence-state header") != std::string::npos);
  }
  // A block cut to its header alone: named by the header's fields, which are checked first.
  {
    std::vector<std::uint8_t> cut(block.begin(), block.begin() + header_bytes);
    kda::engine::SequenceStateHeader h;
    std::memcpy(&h, cut.data(), header_bytes);
    h.num_heads += 1;
    std::memcpy(cut.data(), &h, header_bytes);
    CHECK(kda::test::error_of([&] {
            e.write_sequence_state(b, cut.data(), header_bytes);
          }).find("heads, this engine") != std::string::npos);
  }
  // A whole block of an engine with bf16 states (of its own size): named by its header's fields.
  ModelSpec half_spec = spec();
  half_spec.runtime.state_dtype = kda::DType::kBF16;
  Engine half(half_spec, EnginePair::options(backend, nullptr));
  const std::uint64_t half_bytes = half.sequence_state_bytes();
  std::vector<std::uint8_t> half_block(half_bytes);
  half.read_sequence_state(half.acquire_slot(), half_block.data(), half_bytes);
  CHECK(kda::test::error_of([&] { e.write_sequence_state(b, half_block.data(), half_bytes); }) ==
        prefix + "the block holds bf16 states, this engine fp32; " +
            std::to_string(half_bytes - header_bytes) + " bytes of states, this engine " +
            std::to_string(bytes - header_bytes));
  CHECK(slot_states(e, b) == b_before);
}

}  // namespace

KDA_ENGINE_CASE("engine: a sequence's states to host memory and back, and into another engine",
                sequence_state_round_trip)

namespace {

// The same varlen prefill on caller-owned metadata with int64 cu_seqlens (one engine of the pair)
// and int32 ones (the other), whole layers then the core alone: out and every state bit for bit.
// A prefill naming both dtypes or neither is refused, naming both fields.
void prefill_int32(Backend backend) {
  EnginePair pair(backend);
  const std::vector<std::int64_t> cu = {0, 0, 1, 24, 33, 60};
  const std::vector<int> slots = {4, 0, -1, 2, 5};
  const std::int64_t T = cu.back();
  Memory hidden(backend, kda::test::random_bf16(T * kHidden, 1.0f, 91));
  Memory out_wide(backend, T * kHidden * 2), out_narrow(backend, T * kHidden * 2);
  out_narrow.poison();
  Memory slot_list(backend, std::vector<std::int32_t>(slots.begin(), slots.end()));
  Memory cu64(backend, cu), cu32(backend, std::vector<std::int32_t>(cu.begin(), cu.end()));
  BatchMetadata wide;
  wide.tokens = T;
  wide.sequences = static_cast<std::int64_t>(slots.size());
  wide.slots = slot_list.as<std::int32_t>();
  wide.cu_seqlens = cu64.as<std::int64_t>();
  BatchMetadata narrow = wide;
  narrow.cu_seqlens = nullptr;
  narrow.cu_seqlens_i32 = cu32.as<std::int32_t>();
  const std::vector<std::uint8_t> before = all_states(pair.meta);
  for (int l = 0; l < pair.spans.num_layers(); ++l) {
    pair.spans.prefill_hidden(l, hidden.get(), out_wide.get(), wide);
    pair.meta.prefill_hidden(l, hidden.get(), out_narrow.get(), narrow);
  }
  pair.spans.synchronize();
  pair.meta.synchronize();
  CHECK(out_wide.read<std::uint16_t>() == out_narrow.read<std::uint16_t>());
  CHECK(all_states(pair.spans) == all_states(pair.meta));
  CHECK(all_states(pair.meta) != before);
  CHECK(out_narrow.guards_intact());

  // The core alone (q, k, v, g [T, H, 128], beta [T, H]).
  const std::int64_t elems = T * 4 * 128;
  Memory q(backend, kda::test::random_bf16(elems, 1.0f, 92)),
      k(backend, kda::test::random_bf16(elems, 1.0f, 93)),
      v(backend, kda::test::random_bf16(elems, 1.0f, 94)),
      g(backend, kda::test::random_bf16(elems, 1.0f, 95)),
      beta(backend, kda::test::random_bf16(T * 4, 1.0f, 96));
  const kda::engine::LayerInputs inputs{q.get(), k.get(), v.get(), g.get(), beta.get()};
  Memory core_wide(backend, elems * 2), core_narrow(backend, elems * 2);
  core_narrow.poison();
  pair.spans.prefill(1, inputs, core_wide.get(), wide);
  pair.meta.prefill(1, inputs, core_narrow.get(), narrow);
  pair.spans.synchronize();
  pair.meta.synchronize();
  CHECK(core_wide.read<std::uint16_t>() == core_narrow.read<std::uint16_t>());
  CHECK(all_states(pair.spans) == all_states(pair.meta));
  CHECK_NOTHROW(pair.meta.check_device_status());

  BatchMetadata both = wide;
  both.cu_seqlens_i32 = narrow.cu_seqlens_i32;
  CHECK(kda::test::error_of(
            [&] { pair.meta.prefill_hidden(0, hidden.get(), out_narrow.get(), both); }) ==
        "prefill_hidden: cu_seqlens (int64) and cu_seqlens_i32 are both set: a prefill sets "
        "one of them");
  BatchMetadata neither = narrow;
  neither.cu_seqlens_i32 = nullptr;
  CHECK(kda::test::error_of([&] { pair.meta.prefill(0, inputs, core_narrow.get(), neither); }) ==
        "prefill: cu_seqlens is null, and so is cu_seqlens_i32: a prefill sets one of them");
  if (backend == Backend::kCpu) {  // the host reads int32 offsets as it reads int64 ones
    BatchMetadata broken = narrow;
    const std::vector<std::int32_t> bad = {0, 5, 3, 24, 33, 60};
    broken.cu_seqlens_i32 = bad.data();
    const std::string error = kda::test::error_of(
        [&] { pair.meta.prefill_hidden(0, hidden.get(), out_narrow.get(), broken); });
    CHECK(error.find("non-decreasing") != std::string::npos);
  }
}

}  // namespace

KDA_ENGINE_CASE("engine: int32 cu_seqlens on caller-owned metadata equal int64 ones bitwise",
                prefill_int32)

namespace {

// Every byte of slot `slot`'s recurrent and conv states in every layer set to 0xFF (NaN).
void poison_slot(Engine& e, int slot) {
  const std::vector<std::uint8_t> state(e.state_slot_bytes(), 0xFF),
      conv(e.conv_state_slot_bytes(), 0xFF);
  for (int l = 0; l < e.num_layers(); ++l) {
    e.write_slot_state(l, slot, state.data());
    for (int p = 0; p < 3; ++p) e.write_slot_conv_state(l, slot, p, conv.data());
  }
}

bool slot_poisoned(const Engine& e, int slot) {
  for (int l = 0; l < e.num_layers(); ++l) {
    std::vector<std::uint8_t> state(e.state_slot_bytes()), conv(e.conv_state_slot_bytes());
    e.read_slot_state(l, slot, state.data());
    bool all = std::all_of(state.begin(), state.end(), [](std::uint8_t b) { return b == 0xFF; });
    for (int p = 0; p < 3; ++p) {
      e.read_slot_conv_state(l, slot, p, conv.data());
      all = all && std::all_of(conv.begin(), conv.end(), [](std::uint8_t b) { return b == 0xFF; });
    }
    if (!all) return false;
  }
  return true;
}

// EngineOptions::null_slot = 0 (vLLM's null slot): acquire never hands it out (five of the six
// slots), and batches naming it — prefill sequences, decode rows (twice in one batch), a verify
// step's start and per-token entries, host spans and caller-owned metadata, whole layers and the
// core — equal bit for bit an engine given -1 in its place: out and every state, the null slot's
// poisoned states untouched and never read (out holds no NaN), its rows' out zeros (whole layers).
void null_slot(Backend backend) {
  EngineOptions options = EnginePair::options(backend, nullptr);
  options.null_slot = 0;
  Engine e(spec(), options), neg(spec(), EnginePair::options(backend, nullptr));
  CHECK(e.null_slot() == 0);
  CHECK(neg.null_slot() == -1);
  CHECK(e.num_slots() == 6);
  CHECK(e.free_slots() == 5);
  for (int s = 1; s < 6; ++s) CHECK(e.acquire_slot() == s);
  CHECK(e.free_slots() == 0);
  CHECK_FALSE(e.slot_in_use(0));
  CHECK(kda::test::error_of([&] { e.acquire_slot(); }).find("all 5 state slots are in use") !=
        std::string::npos);
  CHECK(kda::test::error_of([&] { e.release_slot(0); }) == "release_slot: slot 0 is not acquired");
  for (int s = 0; s < 6; ++s) neg.acquire_slot();
  poison_slot(e, 0);
  poison_slot(neg, 0);
  auto same = [&](const Memory& a, const Memory& b) {
    e.synchronize();
    neg.synchronize();
    CHECK_NOTHROW(e.check_device_status());
    CHECK(a.read<std::uint16_t>() == b.read<std::uint16_t>());
    CHECK(all_states(e) == all_states(neg));
    CHECK(slot_poisoned(e, 0));
  };
  auto no_nan = [](const std::vector<std::uint16_t>& v) {
    return std::none_of(v.begin(), v.end(), [](std::uint16_t x) { return (x & 0x7FFF) > 0x7F80; });
  };
  auto negative = [](std::vector<std::int32_t> v) {
    for (std::int32_t& s : v) s = s == 0 ? -1 : s;
    return v;
  };
  // A prefill through metadata (slot 0 twice), then one through host spans.
  const std::vector<std::int64_t> cu = {0, 4, 4, 20, 31, 40};
  const std::vector<std::int32_t> slots = {3, 0, 1, 0, 5};
  Memory hidden(backend, kda::test::random_bf16(40 * kHidden, 1.0f, 101));
  Memory out_e(backend, 40 * kHidden * 2), out_n(backend, 40 * kHidden * 2);
  out_e.poison();
  out_n.poison();
  Memory slots_e(backend, slots), slots_n(backend, negative(slots)), cu_dev(backend, cu);
  BatchMetadata b;
  b.tokens = 40;
  b.sequences = 5;
  b.cu_seqlens = cu_dev.as<std::int64_t>();
  BatchMetadata bn = b;
  b.slots = slots_e.as<std::int32_t>();
  bn.slots = slots_n.as<std::int32_t>();
  const std::vector<std::uint8_t> before = all_states(e);
  for (int l = 0; l < 2; ++l) {
    e.prefill_hidden(l, hidden.get(), out_e.get(), b);
    neg.prefill_hidden(l, hidden.get(), out_n.get(), bn);
  }
  same(out_e, out_n);
  CHECK(all_states(e) != before);
  const std::vector<std::uint16_t> prefill_out = out_e.read<std::uint16_t>();
  CHECK(no_nan(prefill_out));
  CHECK(std::all_of(prefill_out.begin() + 4 * kHidden, prefill_out.begin() + 31 * kHidden,
                    [](std::uint16_t x) { return x == 0 || x == 0xFFFF; }) == false);
  CHECK(std::all_of(prefill_out.begin() + 20 * kHidden, prefill_out.begin() + 31 * kHidden,
                    [](std::uint16_t x) { return x == 0; }));
  const std::vector<int> span_slots = {0, 2, 0};
  const std::vector<std::int64_t> span_cu = {0, 3, 9, 12};
  for (int l = 0; l < 2; ++l) {
    e.prefill_hidden(l, hidden.get(), out_e.get(), span_slots, span_cu);
    neg.prefill_hidden(l, hidden.get(), out_n.get(), {-1, 2, -1}, span_cu);
  }
  same(out_e, out_n);
  // Decode steps of 1 and 3 tokens (slot 0 on two rows), metadata and host spans, whole layers
  // and the core alone.
  for (const int tokens : {1, 3}) {
    CAPTURE(tokens);
    const std::vector<std::int32_t> rows = {0, 5, 2, 0};
    slots_e.write(rows);
    slots_n.write(negative(rows));
    BatchMetadata d;
    d.tokens = 4 * tokens;
    d.sequences = 4;
    d.decode_tokens = tokens;
    BatchMetadata dn = d;
    d.slots = slots_e.as<std::int32_t>();
    dn.slots = slots_n.as<std::int32_t>();
    out_e.poison();
    out_n.poison();
    for (int l = 0; l < 2; ++l) {
      e.decode_hidden(l, hidden.get(), out_e.get(), d);
      neg.decode_hidden(l, hidden.get(), out_n.get(), dn);
    }
    same(out_e, out_n);
    const std::vector<std::uint16_t> o = out_e.read<std::uint16_t>();
    CHECK(std::all_of(o.begin(), o.begin() + tokens * kHidden,
                      [](std::uint16_t x) { return x == 0; }));
    CHECK(no_nan(std::vector<std::uint16_t>(o.begin(), o.begin() + 4 * tokens * kHidden)));
    for (int l = 0; l < 2; ++l) {
      e.decode_hidden(l, hidden.get(), out_e.get(), {3, 0, 0}, tokens);
      neg.decode_hidden(l, hidden.get(), out_n.get(), {3, -1, -1}, tokens);
    }
    same(out_e, out_n);
    const std::int64_t elems = 4 * tokens * 4 * 128;
    Memory q(backend, kda::test::random_bf16(elems, 1.0f, 102)),
        beta(backend, kda::test::random_bf16(4 * tokens * 4, 1.0f, 103));
    const kda::engine::LayerInputs inputs{q.get(), q.get(), q.get(), q.get(), beta.get()};
    Memory core_e(backend, elems * 2), core_n(backend, elems * 2);
    core_e.poison();
    core_n.poison();
    e.decode(1, inputs, core_e.get(), d);
    neg.decode(1, inputs, core_n.get(), dn);
    same(core_e, core_n);
  }
  // A verify step: row 0 starts from slot 1 and keeps nothing after its token 1 (slot 0), row 1
  // starts from slot 0 (padding), row 2 starts from slot 4 and keeps in 3 and 4.
  const std::vector<std::int32_t> entries = {1, 0, 0, 0, 3, 4};
  slots_e.write(entries);
  slots_n.write(negative(entries));
  Memory accepted(backend, std::vector<std::int32_t>{1, 2, 2});
  BatchMetadata v;
  v.tokens = 6;
  v.sequences = 3;
  v.decode_tokens = 2;
  v.num_accepted = accepted.as<std::int32_t>();
  BatchMetadata vn = v;
  v.slots = slots_e.as<std::int32_t>();
  vn.slots = slots_n.as<std::int32_t>();
  out_e.poison();
  out_n.poison();
  for (int l = 0; l < 2; ++l) {
    e.decode_hidden(l, hidden.get(), out_e.get(), v);
    neg.decode_hidden(l, hidden.get(), out_n.get(), vn);
  }
  same(out_e, out_n);
  const std::vector<std::uint16_t> o = out_e.read<std::uint16_t>();
  CHECK(std::all_of(o.begin() + 2 * kHidden, o.begin() + 4 * kHidden,
                    [](std::uint16_t x) { return x == 0; }));
  if (backend == Backend::kCpu) {  // the null slot is not an acquired slot for anyone else
    slots_e.write(std::vector<std::int32_t>{1, 0, 2, 2, 3, 4});
    CHECK(kda::test::error_of([&] { e.decode_hidden(0, hidden.get(), out_e.get(), v); }) ==
          "decode_hidden: slot 2 appears twice in the batch");
  }
  // A slot copy naming the null slot on either side skips that pair as padding: nothing changes.
  const std::vector<std::uint8_t> slot1 = slot_states(e, 1);
  e.copy_slots({0, 1}, {1, 0});
  e.synchronize();
  CHECK(slot_poisoned(e, 0));
  CHECK(slot_states(e, 1) == slot1);
  // A null slot outside the pool, or a pool with no other slot, is refused at construction.
  EngineOptions bad = EnginePair::options(backend, nullptr);
  bad.null_slot = 6;
  CHECK(kda::test::error_of([&] { Engine x(spec(), bad); }).find("EngineOptions::null_slot 6") !=
        std::string::npos);
  ModelSpec one_slot = spec();
  one_slot.runtime.max_sequences = 1;
  bad.null_slot = 0;
  CHECK(kda::test::error_of([&] { Engine x(one_slot, bad); }).find("EngineOptions::null_slot 0") !=
        std::string::npos);
  bad.null_slot = -1;
  CHECK_NOTHROW(Engine(one_slot, bad));
}

}  // namespace

KDA_ENGINE_CASE("engine: a null slot is padding in every batch and never acquired", null_slot)

KDA_ENGINE_CASE("engine: decode on caller-owned metadata equals host slots, padding rows zeros",
                decode_layouts)
KDA_ENGINE_CASE("engine: varlen prefill on caller-owned metadata, padding sequence zeros",
                prefill_varlen)

TEST_CASE("engine: bad caller-owned metadata is refused before anything is written [cpu]") {
  EnginePair pair(Backend::kCpu);
  Engine& e = pair.meta;
  e.release_slot(5);
  const std::vector<std::uint8_t> before = all_states(e);
  Memory hidden(Backend::kCpu, kda::test::random_bf16(8 * kHidden, 1.0f, 9));
  Memory out(Backend::kCpu, 8 * kHidden * 2);
  out.poison();
  const std::vector<std::uint16_t> poisoned = out.read<std::uint16_t>();
  // One call with the batch edited by `edit` (2 sequences of slots {0, 1}; prefill: cu_seqlens
  // {0, 3, 8}), its error message.
  auto attempt = [&](const std::function<void(BatchMetadata&, std::vector<std::int32_t>&,
                                              std::vector<std::int64_t>&)>& edit,
                     bool decode) {
    std::vector<std::int32_t> slots = {0, 1};
    std::vector<std::int64_t> cu = {0, 3, 8};
    BatchMetadata b;
    b.sequences = 2;
    b.tokens = decode ? 2 : 8;
    b.decode_tokens = decode ? 1 : 0;
    edit(b, slots, cu);
    if (b.slots == nullptr && !slots.empty()) b.slots = slots.data();
    if (b.cu_seqlens == nullptr && !cu.empty()) b.cu_seqlens = cu.data();
    return kda::test::error_of([&] {
      if (decode) {
        e.decode_hidden(0, hidden.get(), out.get(), b);
      } else {
        e.prefill_hidden(0, hidden.get(), out.get(), b);
      }
    });
  };
  using Slots = std::vector<std::int32_t>;
  using Cu = std::vector<std::int64_t>;
  auto contains = [](const std::string& text, const char* part) {
    INFO(text);
    return text.find(part) != std::string::npos;
  };
  CHECK(contains(attempt(
                     [](BatchMetadata&, Slots& s, Cu&) {
                       s = {0, 5};
                     },
                     false),
                 "not an acquired slot"));
  CHECK(contains(attempt(
                     [](BatchMetadata&, Slots& s, Cu&) {
                       s = {1, 1};
                     },
                     true),
                 "appears twice"));
  CHECK(contains(attempt(
                     [](BatchMetadata&, Slots&, Cu& c) {
                       c = {0, 5, 3};
                     },
                     false),
                 "non-decreasing"));
  CHECK(contains(attempt(
                     [](BatchMetadata&, Slots&, Cu& c) {
                       c = {1, 3, 8};
                     },
                     false),
                 "cu_seqlens[0]"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.tokens = 9; }, false),
                 "cu_seqlens[2]"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.tokens = 3; }, true),
                 "rows x decode_tokens"));
  CHECK(contains(
      attempt([](BatchMetadata& b, Slots&, Cu&) { b.decode_tokens = 17, b.tokens = 34; }, true),
      "decode_tokens 17"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.sequences = 0; }, false),
                 "0 sequences"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.sequences = 7; }, true),
                 "expected 1..6"));
  CHECK(
      contains(attempt([](BatchMetadata&, Slots& s, Cu&) { s.clear(); }, false), "slots is null"));
  CHECK(contains(attempt([](BatchMetadata&, Slots&, Cu& c) { c.clear(); }, false),
                 "cu_seqlens is null"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.tokens = 300; }, false),
                 "runtime.max_tokens"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.decode_tokens = 1; }, false),
                 "expected 0 for a prefill"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.decode_tokens = -1; }, false),
                 "decode_tokens -1, expected 0 for a prefill"));
  CHECK(contains(attempt([](BatchMetadata& b, Slots&, Cu&) { b.decode_tokens = -1; }, true),
                 "decode_tokens -1, expected 1..16 for a decode"));
  CHECK(out.read<std::uint16_t>() == poisoned);
  CHECK(all_states(e) == before);
}

#ifdef KDA_HAVE_CUDA
namespace {

using kda::test::Graph;
using kda::test::Stream;

// Captures `work` on `stream`; the capture is always ended. Returns what the work threw, or "".
std::string capture(cudaStream_t stream, Graph* g, const std::function<void()>& work) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    return "cudaStreamBeginCapture failed";
  }
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &g->graph);
  if (error.empty() && end != cudaSuccess) error = cudaGetErrorString(end);
  (void)cudaGetLastError();
  if (error.empty() && cudaGraphInstantiate(&g->exec, g->graph, 0) != cudaSuccess) {
    error = "cudaGraphInstantiate failed";
  }
  return error;
}

}  // namespace
#endif

TEST_CASE("engine: a slot outside the pool seen only by the device is reported [cuda]") {
  if (!usable(Backend::kCuda)) return;
  EnginePair pair(Backend::kCuda);
  Engine& e = pair.meta;
  const std::vector<std::uint8_t> before = all_states(e);
  Memory hidden(Backend::kCuda, kda::test::random_bf16(2 * kHidden, 1.0f, 10));
  Memory out(Backend::kCuda, 2 * kHidden * 2);
  Memory slots(Backend::kCuda, std::vector<std::int32_t>{9, 2});
  BatchMetadata b;
  b.tokens = 2;
  b.sequences = 2;
  b.decode_tokens = 1;
  b.slots = slots.as<std::int32_t>();
  e.decode_hidden(0, hidden.get(), out.get(), b);
  const std::string error = kda::test::error_of([&] { e.check_device_status(); });
  CHECK(error.find("slot") != std::string::npos);
  const auto o = out.read<std::uint16_t>();
  CHECK(std::all_of(o.begin(), o.begin() + kHidden, [](std::uint16_t x) { return x == 0; }));
  // Only slot 2 of layer 0 moved.
  const std::vector<std::uint8_t> after = all_states(e);
  const std::size_t per_slot = after.size() / 12;
  for (int s = 0; s < 12; ++s) {
    const bool moved = s == 2;
    CHECK(std::equal(after.begin() + s * per_slot, after.begin() + (s + 1) * per_slot,
                     before.begin() + s * per_slot) != moved);
  }
  CHECK_NOTHROW(e.check_device_status());  // the check cleared the word
}

TEST_CASE(
    "engine: a decode step of every layer and a prefill bucket captured once, replayed as the "
    "metadata changes, equal eager calls bitwise [cuda]") {
  if (!usable(Backend::kCuda)) return;
#ifdef KDA_HAVE_CUDA
  Stream stream;
  REQUIRE(stream.stream != nullptr);
  // `graphs` replays; `eager` makes the same calls directly; the same history before each.
  EnginePair graphs(Backend::kCuda, stream.stream), eager(Backend::kCuda, stream.stream);
  Engine& g = graphs.meta;
  Engine& x = eager.meta;
  constexpr std::int64_t kRows = 4, kBucket = 48;
  Memory hidden(Backend::kCuda, kda::test::random_bf16(kBucket * kHidden, 1.0f, 11));
  Memory out_g(Backend::kCuda, kBucket * kHidden * 2), out_x(Backend::kCuda, kBucket * kHidden * 2);
  Memory slots_g(Backend::kCuda, kRows * 4), slots_x(Backend::kCuda, kRows * 4);
  Memory cu_g(Backend::kCuda, (kRows + 1) * 8), cu_x(Backend::kCuda, (kRows + 1) * 8);
  auto batch = [&](const Memory& slots, const Memory& cu, int decode_tokens) {
    BatchMetadata b;
    b.sequences = kRows;
    b.decode_tokens = decode_tokens;
    b.tokens = decode_tokens > 0 ? kRows * decode_tokens : kBucket;
    b.slots = slots.as<std::int32_t>();
    b.cu_seqlens = cu.as<std::int64_t>();
    return b;
  };
  auto decode_all = [&](Engine& e, const Memory& out, const BatchMetadata& b) {
    for (int l = 0; l < e.num_layers(); ++l) e.decode_hidden(l, hidden.get(), out.get(), b);
  };
  auto prefill_all = [&](Engine& e, const Memory& out, const BatchMetadata& b) {
    for (int l = 0; l < e.num_layers(); ++l) e.prefill_hidden(l, hidden.get(), out.get(), b);
  };
  slots_g.write(std::vector<std::int32_t>{0, 1, 2, 3});
  cu_g.write(std::vector<std::int64_t>{0, 12, 24, 36, 48});
  Graph decode_graph, prefill_graph;
  std::string error =
      capture(stream.stream, &decode_graph, [&] { decode_all(g, out_g, batch(slots_g, cu_g, 1)); });
  REQUIRE_MESSAGE(error.empty(), "decode under capture: " << error);
  error = capture(stream.stream, &prefill_graph,
                  [&] { prefill_all(g, out_g, batch(slots_g, cu_g, 0)); });
  REQUIRE_MESSAGE(error.empty(), "prefill under capture: " << error);
  CHECK(all_states(g) == all_states(x));  // capturing ran nothing
  out_g.poison();  // decode writes the first kRows rows only: the rest must match too
  out_x.poison();

  auto compare = [&] {
    REQUIRE(cudaStreamSynchronize(stream.stream) == cudaSuccess);
    CHECK(out_g.read<std::uint16_t>() == out_x.read<std::uint16_t>());
    CHECK(all_states(g) == all_states(x));
  };
  const std::vector<std::vector<std::int32_t>> layouts = {
      {3, 1, 5, 0}, {5, 4, 3, 2}, {-1, 2, -1, 4}, {0, -1, -1, -1}};
  for (const auto& slots : layouts) {
    slots_g.write(slots);
    slots_x.write(slots);
    CUDA_REQUIRE(cudaGraphLaunch(decode_graph.exec, stream.stream));
    decode_all(x, out_x, batch(slots_x, cu_x, 1));
    compare();
    // An eager call of another layout in between changes nothing the next replay computes.
    slots_g.write(std::vector<std::int32_t>{1, 0, -1, -1});
    slots_x.write(std::vector<std::int32_t>{1, 0, -1, -1});
    decode_all(g, out_g, batch(slots_g, cu_g, 1));
    decode_all(x, out_x, batch(slots_x, cu_x, 1));
    compare();
  }
  // The prefill bucket (48 tokens in 4 sequences) with other lengths and slots.
  const std::vector<std::vector<std::int64_t>> lengths = {
      {0, 12, 24, 36, 48}, {0, 0, 1, 47, 48}, {0, 30, 30, 40, 48}};
  const std::vector<std::int32_t> slots = {5, -1, 0, 3};
  for (const auto& cu : lengths) {
    slots_g.write(slots);
    slots_x.write(slots);
    cu_g.write(cu);
    cu_x.write(cu);
    CUDA_REQUIRE(cudaGraphLaunch(prefill_graph.exec, stream.stream));
    prefill_all(x, out_x, batch(slots_x, cu_x, 0));
    compare();
  }
  CHECK_NOTHROW(g.check_device_status());
#endif
}

TEST_CASE(
    "kda-run's decode steps replay one captured graph: the states of eager steps on the same "
    "tokens, bitwise [cuda]") {
  if (!usable(Backend::kCuda)) return;
#ifdef KDA_HAVE_CUDA
  Stream stream;
  REQUIRE(stream.stream != nullptr);
  auto engine_options = [&] {
    EngineOptions o = EnginePair::options(Backend::kCuda, stream.stream);
    o.seed = 23;
    return o;
  };
  kda::examples::RunOptions run;
  run.tokens = 96;
  run.sequences = 3;
  run.seed = 4;
  run.release_slots = false;
  // Replays of the captured step.
  Engine replayed(spec(), engine_options());
  kda::examples::SyntheticInputs replayed_inputs(replayed, 96);
  run.decode_steps = 4;
  const kda::examples::RunReport report =
      kda::examples::run_synthetic(replayed, replayed_inputs, run);
  CHECK(report.decode_graphs);
  CHECK(report.decode_mode == "CUDA graph replays");
  // The same prefill, then four eager steps of every layer on the window the graph reads.
  Engine eager(spec(), engine_options());
  kda::examples::SyntheticInputs eager_inputs(eager, 96);
  run.decode_steps = 0;
  const kda::examples::RunReport prefilled = kda::examples::run_synthetic(eager, eager_inputs, run);
  for (int step = 0; step < 4; ++step) {
    for (int l = 0; l < eager.num_layers(); ++l) {
      eager.decode_hidden(l, eager_inputs.hidden(0), eager_inputs.hidden_output(), prefilled.slots,
                          1);
    }
  }
  eager.synchronize();
  replayed.synchronize();
  CHECK(prefilled.slots == report.slots);
  CHECK(all_states(replayed) == all_states(eager));
  run.graphs = false;  // and eager steps are what --graphs off runs
  Engine off(spec(), engine_options());
  kda::examples::SyntheticInputs off_inputs(off, 96);
  run.decode_steps = 1;
  const kda::examples::RunReport eager_report = kda::examples::run_synthetic(off, off_inputs, run);
  CHECK_FALSE(eager_report.decode_graphs);
#endif
}

// The C API's forwards on a kda_batch (kda_engine_forward_hidden_batch for whole layers,
// kda_engine_forward_batch for KDA cores) are what a C runtime captures: a decode step of every
// layer and a prefill bucket (48 tokens in 4 sequences), each captured once on one engine and
// replayed as the slots (fragmented, reversed, padding rows, all padding) and cu_seqlens (empty
// sequences, a padding sequence) change, equal the same C calls made eagerly on a twin engine, bit
// for bit, every layer's output; eager calls of another layout between replays change nothing a
// later replay computes; and a last eager step of every slot on both engines (which reads each
// slot's state) agrees too. The whole layers' captured decode step is the one-launch step (four
// rows of four heads), as kda_engine_decode_step_ran reports once it is captured (after an eager
// step of two tokens that ran the separate kernels).
TEST_CASE(
    "C API: kda_batch steps and prefills captured once and replayed equal eager calls [cuda]") {
  if (!usable(Backend::kCuda)) return;
#ifdef KDA_HAVE_CUDA
  Stream stream;
  REQUIRE(stream.stream != nullptr);
  constexpr int kRows = 4, kSlots = 6;
  constexpr std::int64_t kHeads = 4, kDim = 128, kBucket = 48;
  for (const bool whole : {true, false}) {
    CAPTURE(whole);
    const std::string yaml = std::string(kSpec) + (whole ? "" : "  layers: core\n");
    kda_engine_options options;
    REQUIRE(kda_engine_options_init(&options) == KDA_OK);
    options.backend = KDA_BACKEND_CUDA;
    options.cuda_stream = stream.stream;
    options.seed = 29;
    struct Handles {                                // destroyed before the stream they run on
      kda_engine* engines[2] = {nullptr, nullptr};  // graphs, eager
      ~Handles() {
        for (kda_engine* e : engines) kda_engine_destroy(e);
      }
    } handles;
    kda_engine*(&engines)[2] = handles.engines;
    char err[512];
    for (kda_engine*& e : engines) {
      REQUIRE_MESSAGE(
          kda_engine_create_from_string(yaml.c_str(), &options, &e, err, sizeof err) == KDA_OK,
          err);
      for (int s = 0; s < kSlots; ++s) {
        int slot = -1;
        REQUIRE(kda_engine_acquire_slot(e, &slot) == KDA_OK);
      }
    }
    kda_engine* const g = engines[0];
    int layers = 0;
    REQUIRE(kda_engine_num_layers(g, &layers) == KDA_OK);
    // A token's input: hidden [E] for whole layers; for the cores q, k, v, g [H, D] and beta [H]
    // (the five tensors of a call one after the other in one buffer).
    const std::int64_t token_values = whole ? kHidden : 4 * kHeads * kDim + kHeads;
    const std::int64_t token_out = whole ? kHidden : kHeads * kDim;
    std::uint64_t seed = 300;
    // Each replay reads new inputs, so that one reading the wrong slot's state shows.
    Memory input(Backend::kCuda, kda::test::random_bf16(kBucket * token_values, 1.0f, ++seed));
    std::vector<Memory> outs;  // engine e's layer l: outs[e * layers + l]
    for (int e = 0; e < 2 * layers; ++e) outs.emplace_back(Backend::kCuda, kBucket * token_out * 2);
    Memory slots_g(Backend::kCuda, kSlots * 4), slots_x(Backend::kCuda, kSlots * 4);
    Memory cu_g(Backend::kCuda, (kRows + 1) * 8), cu_x(Backend::kCuda, (kRows + 1) * 8);
    // One call of every layer of engine `which` on `b` (tokens rows of input); the C status of
    // the first that failed, KDA_OK otherwise (no REQUIRE inside a capture).
    auto forward = [&](int which, const kda_batch& b) {
      for (int l = 0; l < layers; ++l) {
        void* out = outs[static_cast<std::size_t>(which * layers + l)].get();
        const auto* in = input.as<std::uint16_t>();
        kda_status status;
        if (whole) {
          status = kda_engine_forward_hidden_batch(engines[which], l, in, out, &b);
        } else {
          const std::int64_t plane = b.tokens * kHeads * kDim;  // q, k, v and g
          status = kda_engine_forward_batch(engines[which], l, in, in + plane, in + 2 * plane,
                                            in + 3 * plane, in + 4 * plane, out, &b);
        }
        if (status != KDA_OK) return status;
      }
      return KDA_OK;
    };
    auto decode = [&](int which, int rows) {
      return forward(which,
                     c_batch(rows, rows, 1, (which == 0 ? slots_g : slots_x).as<std::int32_t>()));
    };
    auto prefill = [&](int which) {
      return forward(which,
                     c_batch(kBucket, kRows, 0, (which == 0 ? slots_g : slots_x).as<std::int32_t>(),
                             (which == 0 ? cu_g : cu_x).as<std::int64_t>()));
    };
    auto write_both = [&](Memory& a, Memory& b, const auto& values) {
      a.write(values);
      b.write(values);
    };
    // The same history on both (states start at zero): one eager step of every slot.
    const std::vector<std::int32_t> all = {0, 1, 2, 3, 4, 5};
    write_both(slots_g, slots_x, all);
    REQUIRE(decode(0, kSlots) == KDA_OK);
    REQUIRE(decode(1, kSlots) == KDA_OK);
    REQUIRE(cudaStreamSynchronize(stream.stream) == cudaSuccess);  // before the metadata changes
    // A step of two tokens on two rows, eagerly on both: the whole layers' separate kernels, so
    // that the capture below must record the one launch for it to be reported.
    write_both(slots_g, slots_x, std::vector<std::int32_t>{4, 5});
    for (int which = 0; which < 2; ++which) {
      REQUIRE(
          forward(which, c_batch(4, 2, 2, (which == 0 ? slots_g : slots_x).as<std::int32_t>())) ==
          KDA_OK);
    }
    kda_decode_step ran = KDA_DECODE_STEP_MAX_ENUM_;
    REQUIRE(kda_engine_decode_step_ran(g, 0, &ran) == KDA_OK);
    CHECK(ran == (whole ? KDA_DECODE_STEP_SEPARATE : KDA_DECODE_STEP_AUTO));
    REQUIRE(cudaStreamSynchronize(stream.stream) == cudaSuccess);
    write_both(slots_g, slots_x, std::vector<std::int32_t>{0, 1, 2, 3});
    write_both(cu_g, cu_x, std::vector<std::int64_t>{0, 12, 24, 36, 48});
    // The captured calls' batches, made before the captures (no REQUIRE inside one).
    const kda_batch step_batch = c_batch(kRows, kRows, 1, slots_g.as<std::int32_t>());
    const kda_batch bucket_batch =
        c_batch(kBucket, kRows, 0, slots_g.as<std::int32_t>(), cu_g.as<std::int64_t>());
    Graph decode_graph, prefill_graph;
    kda_status captured = KDA_OK;
    std::string error =
        capture(stream.stream, &decode_graph, [&] { captured = forward(0, step_batch); });
    REQUIRE_MESSAGE(error.empty(), "decode under capture: " << error);
    REQUIRE_MESSAGE(captured == KDA_OK, kda_engine_last_error(g));
    REQUIRE(kda_engine_decode_step_ran(g, 0, &ran) == KDA_OK);
    CHECK(ran == (whole ? KDA_DECODE_STEP_ONE_LAUNCH : KDA_DECODE_STEP_AUTO));
    error = capture(stream.stream, &prefill_graph, [&] { captured = forward(0, bucket_batch); });
    REQUIRE_MESSAGE(error.empty(), "prefill under capture: " << error);
    REQUIRE_MESSAGE(captured == KDA_OK, kda_engine_last_error(g));

    auto compare = [&] {
      REQUIRE(cudaStreamSynchronize(stream.stream) == cudaSuccess);
      for (int l = 0; l < layers; ++l) {
        CAPTURE(l);
        CHECK(outs[static_cast<std::size_t>(l)].read<std::uint16_t>() ==
              outs[static_cast<std::size_t>(layers + l)].read<std::uint16_t>());
      }
    };
    auto new_inputs = [&] {
      input.write(kda::test::random_bf16(kBucket * token_values, 1.0f, ++seed));
      for (Memory& out : outs) out.poison();
    };
    const std::vector<std::vector<std::int32_t>> layouts = {
        {3, 1, 5, 0}, {5, 4, 3, 2}, {-1, 2, -1, 4}, {0, -1, -1, -1}, {-1, -1, -1, -1}};
    for (const auto& slots : layouts) {
      new_inputs();
      write_both(slots_g, slots_x, slots);
      CUDA_REQUIRE(cudaGraphLaunch(decode_graph.exec, stream.stream));
      REQUIRE(decode(1, kRows) == KDA_OK);
      compare();
      // An eager call of another layout in between.
      write_both(slots_g, slots_x, std::vector<std::int32_t>{1, 0});
      REQUIRE(decode(0, 2) == KDA_OK);
      REQUIRE(decode(1, 2) == KDA_OK);
      compare();
    }
    // The prefill bucket with other lengths and slots.
    const std::vector<std::vector<std::int64_t>> lengths = {
        {0, 12, 24, 36, 48}, {0, 0, 1, 47, 48}, {0, 30, 30, 40, 48}};
    for (const auto& cu : lengths) {
      new_inputs();
      write_both(slots_g, slots_x, std::vector<std::int32_t>{5, -1, 0, 3});
      write_both(cu_g, cu_x, cu);
      CUDA_REQUIRE(cudaGraphLaunch(prefill_graph.exec, stream.stream));
      REQUIRE(prefill(1) == KDA_OK);
      compare();
    }
    // Every slot's state, through one more eager step of all of them.
    new_inputs();
    write_both(slots_g, slots_x, all);
    REQUIRE(decode(0, kSlots) == KDA_OK);
    REQUIRE(decode(1, kSlots) == KDA_OK);
    compare();
    CHECK(kda_engine_check_device_status(g) == KDA_OK);
  }
#endif
}

namespace {

// A prefix-cache round trip through the C API: a 48-token prompt prefilled on slot a with a
// checkpoint after 32 tokens into slot c; slot a released and acquired again for another request,
// which copies the checkpoint into it (kda_engine_copy_slots, pairs in the backend's memory); then
// the prompt's last 16 tokens prefilled from that copy, and from the checkpoint slot itself, give
// the one-pass prefill's outputs for those tokens (the CPU: bit for bit; CUDA: within rounding), in
// both layers.
void c_api_prefix_cache(Backend backend) {
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  options.backend = backend == Backend::kCuda ? KDA_BACKEND_CUDA : KDA_BACKEND_CPU;
  options.cpu_threads = 2;
  kda_engine* e = nullptr;
  char err[512];
  REQUIRE_MESSAGE(kda_engine_create_from_string(kSpec, &options, &e, err, sizeof err) == KDA_OK,
                  err);
  int a = -1, c = -1;
  REQUIRE(kda_engine_acquire_slot(e, &a) == KDA_OK);
  REQUIRE(kda_engine_acquire_slot(e, &c) == KDA_OK);
  const std::vector<std::uint16_t> prompt = kda::test::random_bf16(48 * kHidden, 1.0f, 91);
  Memory hidden(backend, prompt), out(backend, 48 * kHidden * 2);
  Memory slot_a(backend, std::vector<std::int32_t>{a}),
      cu(backend, std::vector<std::int64_t>{0, 48});
  Memory offsets(backend, std::vector<std::int64_t>{32}),
      rows(backend, std::vector<std::int32_t>{c});
  kda_batch whole = c_batch();
  whole.tokens = 48;
  whole.sequences = 1;
  whole.slots = slot_a.as<std::int32_t>();
  whole.cu_seqlens = cu.as<std::int64_t>();
  whole.checkpoints = 1;
  whole.checkpoint_offsets = offsets.as<std::int64_t>();
  whole.checkpoint_slots = rows.as<std::int32_t>();
  std::vector<std::vector<std::uint16_t>> one_pass;
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_forward_hidden_batch(e, l, hidden.get(), out.get(), &whole) == KDA_OK);
    REQUIRE(kda_engine_synchronize(e) == KDA_OK);
    const std::vector<std::uint16_t> all = out.read<std::uint16_t>();
    one_pass.emplace_back(all.begin() + 32 * kHidden, all.end());
  }
  REQUIRE(kda_engine_check_device_status(e) == KDA_OK);
  // Another request takes slot a; the checkpoint in slot c is the caller's to keep.
  REQUIRE(kda_engine_release_slot(e, a) == KDA_OK);
  int other = -1;
  REQUIRE(kda_engine_acquire_slot(e, &other) == KDA_OK);
  const std::vector<std::uint16_t> tail(prompt.begin() + 32 * kHidden, prompt.end());
  Memory tail_hidden(backend, tail), tail_out(backend, 16 * kHidden * 2);
  Memory copy_src(backend, std::vector<std::int32_t>{c}),
      copy_dst(backend, std::vector<std::int32_t>{other});
  REQUIRE(kda_engine_copy_slots(e, 1, copy_src.as<std::int32_t>(), copy_dst.as<std::int32_t>()) ==
          KDA_OK);
  Memory tail_cu(backend, std::vector<std::int64_t>{0, 16});
  for (const int start : {other, c}) {
    CAPTURE(start);
    Memory slot(backend, std::vector<std::int32_t>{start});
    kda_batch rest = c_batch();
    rest.tokens = 16;
    rest.sequences = 1;
    rest.slots = slot.as<std::int32_t>();
    rest.cu_seqlens = tail_cu.as<std::int64_t>();
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      REQUIRE(kda_engine_forward_hidden_batch(e, l, tail_hidden.get(), tail_out.get(), &rest) ==
              KDA_OK);
      REQUIRE(kda_engine_synchronize(e) == KDA_OK);
      const std::vector<std::uint16_t> got = tail_out.read<std::uint16_t>();
      if (backend == Backend::kCpu) {
        CHECK(got == one_pass[static_cast<std::size_t>(l)]);
      } else {
        CHECK(kda::test::relative_error(got, one_pass[static_cast<std::size_t>(l)]) <= 1e-2);
      }
    }
  }
  REQUIRE(kda_engine_check_device_status(e) == KDA_OK);
  kda_engine_destroy(e);
}

}  // namespace

KDA_ENGINE_CASE("C API: a prefix-cache round trip through kda_batch checkpoints",
                c_api_prefix_cache)

TEST_CASE("C API: kda_batch calls equal the host-slot calls, bad batches are refused [cpu]") {
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  options.backend = KDA_BACKEND_CPU;
  options.cpu_threads = 2;
  kda_engine *spans = nullptr, *batch = nullptr;
  char err[512];
  REQUIRE(kda_engine_create_from_string(kSpec, &options, &spans, err, sizeof err) == KDA_OK);
  REQUIRE(kda_engine_create_from_string(kSpec, &options, &batch, err, sizeof err) == KDA_OK);
  int slots[3];
  for (int& s : slots) {
    REQUIRE(kda_engine_acquire_slot(spans, &s) == KDA_OK);
    REQUIRE(kda_engine_acquire_slot(batch, &s) == KDA_OK);
  }
  const std::vector<std::uint16_t> hidden = kda::test::random_bf16(20 * kHidden, 1.0f, 12);
  std::vector<std::uint16_t> out_spans(20 * kHidden), out_batch(20 * kHidden, 0xFFFF);
  const std::vector<std::int32_t> rows = {slots[2], -1, slots[0]};
  const std::vector<std::int64_t> cu = {0, 9, 12, 20};
  const int host_rows[3] = {rows[0], rows[1], rows[2]};
  kda_batch prefill = c_batch(20, 3, 0, rows.data(), cu.data());
  kda_batch decode = c_batch(3, 3, 1, rows.data());
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_prefill_hidden(spans, l, hidden.data(), out_spans.data(), host_rows, 3,
                                      cu.data()) == KDA_OK);
    REQUIRE(kda_engine_forward_hidden_batch(batch, l, hidden.data(), out_batch.data(), &prefill) ==
            KDA_OK);
  }
  CHECK(out_spans == out_batch);
  // The same prefill with int32 cu_seqlens (kda_batch::cu_seqlens_i32), on the states both engines
  // reached: equal bit for bit; both dtypes or neither refused.
  const std::vector<std::int32_t> cu32(cu.begin(), cu.end());
  kda_batch narrow = c_batch();
  narrow.tokens = 20;
  narrow.sequences = 3;
  narrow.slots = rows.data();
  narrow.cu_seqlens_i32 = cu32.data();
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_prefill_hidden(spans, l, hidden.data(), out_spans.data(), host_rows, 3,
                                      cu.data()) == KDA_OK);
    REQUIRE(kda_engine_forward_hidden_batch(batch, l, hidden.data(), out_batch.data(), &narrow) ==
            KDA_OK);
  }
  CHECK(out_spans == out_batch);
  kda_batch both = narrow;
  both.cu_seqlens = cu.data();
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &both) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)).find("cu_seqlens_i32 are both set") !=
        std::string::npos);
  kda_batch neither = narrow;
  neither.cu_seqlens_i32 = nullptr;
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &neither) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)).find("so is cu_seqlens_i32") !=
        std::string::npos);
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_decode_hidden(spans, l, hidden.data(), out_spans.data(), host_rows, 3, 1) ==
            KDA_OK);
    REQUIRE(kda_engine_forward_hidden_batch(batch, l, hidden.data(), out_batch.data(), &decode) ==
            KDA_OK);
  }
  CHECK(std::equal(out_spans.begin(), out_spans.begin() + 3 * kHidden, out_batch.begin()));
  CHECK(std::all_of(out_batch.begin() + kHidden, out_batch.begin() + 2 * kHidden,
                    [](std::uint16_t x) { return x == 0; }));  // the padding row
  // The core alone on the same batch type, and refusals naming the problem.
  const std::vector<std::uint16_t> q = kda::test::random_bf16(3 * 4 * 128, 1.0f, 13);
  const std::vector<std::uint16_t> beta(3 * 4, 0);
  std::vector<std::uint16_t> core_out(3 * 4 * 128);
  CHECK(kda_engine_forward_batch(batch, 0, q.data(), q.data(), q.data(), q.data(), beta.data(),
                                 core_out.data(), &decode) == KDA_OK);
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), nullptr) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)).find("batch") != std::string::npos);
  kda_batch bad = decode;
  bad.decode_tokens = 17;
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &bad) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)).find("decode_tokens 17") != std::string::npos);
  // A verify step through kda_batch::num_accepted: a count outside 1..decode_tokens is named; a
  // good one runs (its semantics are the engine's, tested above).
  const std::vector<std::int32_t> verify_slots = {slots[0], slots[1], slots[2], -1};
  std::vector<std::int32_t> accepted = {2, 3};
  kda_batch verify = c_batch(4, 2, 2, verify_slots.data());
  verify.num_accepted = accepted.data();
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &verify) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)).find("row 1 has num_accepted 3") !=
        std::string::npos);
  accepted[1] = 1;
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &verify) ==
        KDA_OK);
  // kda_batch's struct_size: a batch not started from kda_batch_init (0), one of a later header
  // (larger than this library's) and a nonzero reserved field are refused, naming the field,
  // before anything runs; kda_batch_init zeroes every field.
  kda_batch unset = decode;
  unset.struct_size = 0;
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &unset) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)) ==
        "kda_engine_forward_hidden_batch: batch->struct_size is 0, expected " +
            std::to_string(offsetof(kda_batch, reserved) + sizeof(int)) + " or " +
            std::to_string(sizeof(kda_batch)) + " (initialise the batch with kda_batch_init)");
  kda_batch later = decode;
  later.struct_size = sizeof(kda_batch) + 8;
  CHECK(kda_engine_forward_batch(batch, 0, q.data(), q.data(), q.data(), q.data(), beta.data(),
                                 core_out.data(), &later) == KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch))
            .find("batch->struct_size is " + std::to_string(sizeof(kda_batch) + 8)) !=
        std::string::npos);
  kda_batch reserved = decode;
  reserved.reserved = 1;
  CHECK(kda_engine_forward_hidden_batch(batch, 0, hidden.data(), out_batch.data(), &reserved) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(batch)) ==
        "kda_engine_forward_hidden_batch: batch->reserved is 1, must be 0");
  kda_batch fresh;
  std::memset(&fresh, 0x5A, sizeof fresh);
  REQUIRE(kda_batch_init(&fresh) == KDA_OK);
  CHECK(fresh.struct_size == sizeof(kda_batch));
  CHECK((fresh.tokens == 0 && fresh.sequences == 0 && fresh.decode_tokens == 0 &&
         fresh.slots == nullptr && fresh.cu_seqlens == nullptr && fresh.num_accepted == nullptr &&
         fresh.checkpoints == 0 && fresh.checkpoint_offsets == nullptr &&
         fresh.checkpoint_slots == nullptr && fresh.cu_seqlens_i32 == nullptr &&
         fresh.records == 0 && fresh.reserved == 0));
  CHECK(kda_batch_init(nullptr) == KDA_INVALID_ARGUMENT);
  kda_engine_destroy(spans);
  kda_engine_destroy(batch);
}

TEST_CASE("C API: options.null_slot is never acquired and pads kda_batch rows [cpu]") {
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  CHECK(options.null_slot == -1);
  options.backend = KDA_BACKEND_CPU;
  options.cpu_threads = 2;
  kda_engine* engine = nullptr;
  char err[512];
  options.null_slot = 6;
  CHECK(kda_engine_create_from_string(kSpec, &options, &engine, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(err).find("null_slot 6") != std::string::npos);
  options.null_slot = 0;
  REQUIRE(kda_engine_create_from_string(kSpec, &options, &engine, err, sizeof err) == KDA_OK);
  int free_slots = 0, slot = -1;
  REQUIRE(kda_engine_free_slots(engine, &free_slots) == KDA_OK);
  CHECK(free_slots == 5);
  REQUIRE(kda_engine_acquire_slot(engine, &slot) == KDA_OK);
  CHECK(slot == 1);
  const std::vector<std::uint16_t> hidden = kda::test::random_bf16(3 * kHidden, 1.0f, 104);
  std::vector<std::uint16_t> out(3 * kHidden, 0xFFFF);
  const std::vector<std::int32_t> rows = {0, slot, 0};  // the null slot on two rows
  kda_batch decode = c_batch();
  decode.tokens = 3;
  decode.sequences = 3;
  decode.decode_tokens = 1;
  decode.slots = rows.data();
  REQUIRE(kda_engine_forward_hidden_batch(engine, 0, hidden.data(), out.data(), &decode) == KDA_OK);
  CHECK(std::all_of(out.begin(), out.begin() + kHidden, [](std::uint16_t x) { return x == 0; }));
  CHECK(std::all_of(out.begin() + 2 * kHidden, out.end(), [](std::uint16_t x) { return x == 0; }));
  CHECK(std::any_of(out.begin() + kHidden, out.begin() + 2 * kHidden,
                    [](std::uint16_t x) { return x != 0; }));
  CHECK(kda_engine_release_slot(engine, 0) == KDA_INVALID_ARGUMENT);
  kda_engine_destroy(engine);
}

namespace {

// The spec above with records buffers for verify steps of up to 3 tokens per row.
ModelSpec records_spec() {
  return kda::engine::parse_model_spec(std::string(kSpec) + "  max_verify_tokens: 3\n",
                                       "batch-metadata-records.yaml");
}

// The speculative-decode loop in both verify forms, both layers, four rounds of random counts.
// Rows 0 and 1 own slots {0, 1, 2} and {3, 4, 5}; row 2 is padding. The reference (`spans` of the
// pair): per-token-states verify steps whose row r starts from its current slot (num_accepted 1,
// that slot its first entry) and keeps the states after its tokens in its three slots; the current
// slot then becomes the one after its last accepted token. The records engine (`meta`): records
// steps on slots 0 and 3, then one commit of both layers. After every round the committed slots
// hold the reference's current states and the outs agree: bit for bit on the CPU; on CUDA to
// rounding (tests/layer/test_layer_state.cpp holds the two forms bit for bit on each decode
// kernel).
void records_loop(Backend backend) {
  EnginePair pair(backend, nullptr, records_spec());
  const int T = 3, N = 3;
  const std::vector<std::int32_t> committed = {0, 3, -1};
  std::vector<std::int32_t> current = {0, 3};
  std::mt19937 random(91);
  const double tolerance = backend == Backend::kCpu ? 0.0 : 1e-2;
  Memory out_ref(backend, N * T * kHidden * 2), out_rec(backend, N * T * kHidden * 2);
  Memory records_slots(backend, committed);
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    std::vector<std::int32_t> entries;
    for (int r = 0; r < 2; ++r) {
      entries.push_back(current[static_cast<std::size_t>(r)]);
      for (int s = 3 * r; s < 3 * r + 3; ++s) {
        if (s != current[static_cast<std::size_t>(r)]) entries.push_back(s);
      }
    }
    entries.insert(entries.end(), {-1, -1, -1});
    std::vector<std::int32_t> accepted = {1 + static_cast<std::int32_t>(random() % T),
                                          1 + static_cast<std::int32_t>(random() % T), 0};
    Memory hidden(backend, kda::test::random_bf16(N * T * kHidden, 1.0f, 100 + round));
    Memory verify_slots(backend, entries), ones(backend, std::vector<std::int32_t>{1, 1, 1});
    Memory counts(backend, accepted);
    BatchMetadata verify;
    verify.tokens = N * T;
    verify.sequences = N;
    verify.decode_tokens = T;
    verify.slots = verify_slots.as<std::int32_t>();
    verify.num_accepted = ones.as<std::int32_t>();
    BatchMetadata records = verify;
    records.slots = records_slots.as<std::int32_t>();
    records.num_accepted = nullptr;
    records.records = true;
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      out_ref.poison();
      out_rec.poison();
      pair.spans.decode_hidden(l, hidden.get(), out_ref.get(), verify);
      pair.meta.decode_hidden(l, hidden.get(), out_rec.get(), records);
      pair.spans.synchronize();
      pair.meta.synchronize();
      const std::vector<std::uint16_t> want = out_ref.read<std::uint16_t>();
      const std::vector<std::uint16_t> got = out_rec.read<std::uint16_t>();
      CHECK(deviation(kda::test::to_doubles(got), kda::test::to_doubles(want)) <= tolerance);
    }
    pair.meta.commit(N, records_slots.as<std::int32_t>(), counts.as<std::int32_t>());
    pair.meta.synchronize();
    CHECK_NOTHROW(pair.meta.check_device_status());
    for (int r = 0; r < 2; ++r) {
      current[static_cast<std::size_t>(r)] =
          entries[static_cast<std::size_t>(r * T + accepted[static_cast<std::size_t>(r)] - 1)];
    }
    for (int l = 0; l < 2; ++l) {
      for (int r = 0; r < 2; ++r) {
        CAPTURE(l);
        CAPTURE(r);
        CHECK(deviation(slot_values(pair.meta, l, committed[static_cast<std::size_t>(r)]),
                        slot_values(pair.spans, l, current[static_cast<std::size_t>(r)])) <=
              tolerance);
      }
    }
  }
  CHECK(out_rec.guards_intact());
}

}  // namespace

KDA_ENGINE_CASE("engine: spec decode with records steps and commits equals per-token-states verify",
                records_loop)

namespace {

// Records steps and commits refused: without runtime.max_verify_tokens, more tokens than it, with
// num_accepted, a commit without records, twice, or of other rows; on the CPU a count out of range
// or a slot not acquired (nothing written); on CUDA a bad count reported by the device.
void bad_records(Backend backend) {
  using kda::test::error_of;
  Memory hidden(backend, kda::test::random_bf16(4 * 4 * kHidden, 1.0f, 72));
  Memory out(backend, 4 * 4 * kHidden * 2);
  Memory slots(backend, std::vector<std::int32_t>{0, 1});
  Memory accepted(backend, std::vector<std::int32_t>{1, 2});
  BatchMetadata b;
  b.tokens = 4;
  b.sequences = 2;
  b.decode_tokens = 2;
  b.slots = slots.as<std::int32_t>();
  b.records = true;
  {
    Engine e(spec(), EnginePair::options(backend, nullptr));
    acquire_all(e);
    CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), b); }) ==
          "decode_hidden: a records verify step of 2 tokens per row needs "
          "runtime.max_verify_tokens >= 2 (the records buffers' size); it is 0");
    CHECK(error_of([&] {
            e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>());
          }).find("runtime.max_verify_tokens is 0") != std::string::npos);
  }
  Engine e(records_spec(), EnginePair::options(backend, nullptr));
  acquire_all(e);
  BatchMetadata four = b;
  four.decode_tokens = 4;
  four.tokens = 8;
  CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), four); }) ==
        "decode_hidden: a records verify step of 4 tokens per row needs "
        "runtime.max_verify_tokens >= 4 (the records buffers' size); it is 3");
  BatchMetadata both = b;
  both.num_accepted = accepted.as<std::int32_t>();
  CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), both); }) ==
        "decode_hidden: records and num_accepted are both set: a records step takes no "
        "num_accepted (Engine::commit does)");
  CHECK(error_of([&] { e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>()); }) ==
        "commit: layer 1 (KDA index 0) has no records to commit (no records verify step ran on "
        "it)");
  e.decode_hidden(0, hidden.get(), out.get(), b);
  CHECK(error_of([&] { e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>()); }) ==
        "commit: layer 2 (KDA index 1) has no records to commit (no records verify step ran on "
        "it)");
  e.decode_hidden(1, hidden.get(), out.get(), b);
  CHECK(error_of([&] { e.commit(1, slots.as<std::int32_t>(), accepted.as<std::int32_t>()); }) ==
        "commit: layer 1 (KDA index 0)'s records step had 2 rows of 2 tokens; the commit has 1 "
        "rows");
  if (backend == Backend::kCpu) {
    const std::vector<std::uint8_t> before = all_states(e);
    accepted.write(std::vector<std::int32_t>{1, 3});
    CHECK(error_of([&] { e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>()); }) ==
          "commit: row 1 has num_accepted 3, expected 1..2 (the records step's decode_tokens)");
    accepted.write(std::vector<std::int32_t>{1, 2});
    e.release_slot(1);
    CHECK(error_of([&] { e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>()); }) ==
          "commit: row 1 uses slot 1, which is not an acquired slot");
    CHECK(all_states(e) == before);
    REQUIRE(e.acquire_slot() == 1);
  } else {
    accepted.write(std::vector<std::int32_t>{1, 3});
    e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>());
    const std::string error = error_of([&] { e.check_device_status(); });
    CHECK(error.find("num_accepted") != std::string::npos);
    e.decode_hidden(0, hidden.get(), out.get(), b);
    e.decode_hidden(1, hidden.get(), out.get(), b);
    accepted.write(std::vector<std::int32_t>{1, 2});
  }
  CHECK_NOTHROW(e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>()));
  // A commit does not consume the records' shape: a runtime that replays a captured graph of
  // records steps commits after each replay (the records are the last replay's).
  CHECK_NOTHROW(e.commit(2, slots.as<std::int32_t>(), accepted.as<std::int32_t>()));
}

}  // namespace

TEST_CASE("engine: bad records steps and commits are refused [cpu]") { bad_records(Backend::kCpu); }
TEST_CASE("engine: bad records steps and commits are refused or reported by the device [cuda]") {
  if (usable(Backend::kCuda)) bad_records(Backend::kCuda);
}

namespace {

// The spec above with two records regions, for the commit deferred into the next step.
ModelSpec fold_spec() {
  return kda::engine::parse_model_spec(
      std::string(kSpec) + "  max_verify_tokens: 3\n  record_regions: 2\n",
      "batch-metadata-fold.yaml");
}

// The speculative-decode loop with records steps, two ways on two engines of one model: `spans`
// commits after every records step (Engine::commit), `meta` folds each records step into the next
// (BatchMetadata::fold_rows, alternating records_region) and commits only after the last. Rows 0
// and 1 on slots 4 and 1, row 2 padding (its fold entries garbage); the rows swap places every
// round, so fold_rows names the row of the step before. Outs of every layer and round, and at the
// end every state, equal bit for bit on each backend (the fold applies the commit's operations).
void fold_loop(Backend backend) {
  EnginePair pair(backend, nullptr, fold_spec());
  const int T = 3, N = 3;
  std::mt19937 random(93);
  Memory out_commit(backend, N * T * kHidden * 2), out_fold(backend, N * T * kHidden * 2);
  std::vector<std::int32_t> slots = {4, 1, -1}, accepted_before;
  int region = 0;
  for (int round = 0; round < 5; ++round) {
    CAPTURE(round);
    Memory hidden(backend, kda::test::random_bf16(N * T * kHidden, 1.0f, 200 + round));
    Memory step_slots(backend, slots);
    BatchMetadata records;
    records.tokens = N * T;
    records.sequences = N;
    records.decode_tokens = T;
    records.slots = step_slots.as<std::int32_t>();
    records.records = true;
    BatchMetadata folding = records;
    folding.records_region = region;
    std::vector<std::int32_t> rows, counts;
    if (round > 0) {
      // This round's rows are last round's swapped: row 0 was row 1, row 1 was row 0.
      rows = {1, 0, 999};
      counts = {accepted_before[1], accepted_before[0], -4};
      folding.fold_region = 1 - region;
    }
    Memory fold_rows(backend, rows.empty() ? std::vector<std::int32_t>{0} : rows);
    Memory fold_counts(backend, counts.empty() ? std::vector<std::int32_t>{0} : counts);
    if (round > 0) {
      folding.fold_rows = fold_rows.as<std::int32_t>();
      folding.fold_counts = fold_counts.as<std::int32_t>();
    }
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      out_commit.poison();
      out_fold.poison();
      pair.spans.decode_hidden(l, hidden.get(), out_commit.get(), records);
      pair.meta.decode_hidden(l, hidden.get(), out_fold.get(), folding);
      pair.spans.synchronize();
      pair.meta.synchronize();
      CHECK(out_commit.read<std::uint16_t>() == out_fold.read<std::uint16_t>());
    }
    const std::vector<std::int32_t> accepted = {1 + static_cast<std::int32_t>(random() % T),
                                                1 + static_cast<std::int32_t>(random() % T), 0};
    Memory counts_now(backend, accepted);
    pair.spans.commit(N, step_slots.as<std::int32_t>(), counts_now.as<std::int32_t>());
    if (round == 4) {
      pair.meta.commit(N, step_slots.as<std::int32_t>(), counts_now.as<std::int32_t>(), region);
    }
    accepted_before = accepted;
    std::swap(slots[0], slots[1]);
    region = 1 - region;
  }
  pair.spans.synchronize();
  pair.meta.synchronize();
  CHECK_NOTHROW(pair.spans.check_device_status());
  CHECK_NOTHROW(pair.meta.check_device_status());
  CHECK(all_states(pair.spans) == all_states(pair.meta));
  CHECK(out_fold.guards_intact());
}

// A fold refused: on a model with one records region when it is a records step's own, without a
// records step on its region, with num_accepted, or with fold_counts missing; on the CPU a fold
// row outside the records step's rows (nothing written).
void bad_folds(Backend backend) {
  using kda::test::error_of;
  Memory hidden(backend, kda::test::random_bf16(4 * 2 * kHidden, 1.0f, 74));
  Memory out(backend, 4 * 2 * kHidden * 2);
  Memory slots(backend, std::vector<std::int32_t>{0, 1});
  Memory rows(backend, std::vector<std::int32_t>{0, 1}),
      counts(backend, std::vector<std::int32_t>{1, 2});
  BatchMetadata b;
  b.tokens = 4;
  b.sequences = 2;
  b.decode_tokens = 2;
  b.slots = slots.as<std::int32_t>();
  b.records = true;
  Engine e(fold_spec(), EnginePair::options(backend, nullptr));
  acquire_all(e);
  BatchMetadata fold = b;
  fold.fold_rows = rows.as<std::int32_t>();
  fold.fold_counts = counts.as<std::int32_t>();
  fold.fold_region = 1;
  CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), fold); }) ==
        "decode_hidden: layer 1 (KDA index 0) has no records in region 1 to fold (no records "
        "verify step wrote it)");
  BatchMetadata same = fold;
  same.fold_region = 0;
  CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), same); }) ==
        "decode_hidden: a records step folds records region 0, the one it writes "
        "(runtime.record_regions 2: alternate records_region)");
  BatchMetadata region2 = b;
  region2.records_region = 2;
  CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), region2); }) ==
        "decode_hidden: records_region 2, expected 0..1 (runtime.record_regions 2)");
  BatchMetadata half = fold;
  half.fold_counts = nullptr;
  CHECK(error_of([&] { e.decode_hidden(0, hidden.get(), out.get(), half); }) ==
        "decode_hidden: a fold needs both fold_rows and fold_counts");
  CHECK(error_of([&] { e.commit(2, slots.as<std::int32_t>(), counts.as<std::int32_t>(), 2); }) ==
        "commit: records_region 2, expected 0..1 (runtime.record_regions 2)");
  BatchMetadata second = b;
  second.records_region = 1;
  e.decode_hidden(0, hidden.get(), out.get(), second);  // region 1 of layer 0 holds records now
  BatchMetadata plain = fold;
  plain.records = false;
  if (backend == Backend::kCpu) {
    Memory far(backend, std::vector<std::int32_t>{0, 2});
    plain.fold_rows = far.as<std::int32_t>();
    const std::vector<std::uint8_t> before = all_states(e);
    CHECK(error_of([&] {
            e.decode_hidden(0, hidden.get(), out.get(), plain);
          }).find("row 1 has fold row 2, outside [0, fold_sequences = 2)") != std::string::npos);
    CHECK(all_states(e) == before);
  }
  Engine one(records_spec(), EnginePair::options(backend, nullptr));
  acquire_all(one);
  CHECK(error_of([&] { one.decode_hidden(0, hidden.get(), out.get(), second); }) ==
        "decode_hidden: records_region 1, expected 0..0 (runtime.record_regions 1)");
}

}  // namespace

KDA_ENGINE_CASE("engine: folding each records step into the next equals committing it", fold_loop)
KDA_ENGINE_CASE("engine: bad folds are refused", bad_folds)

// A CPU engine of the YAML `text` through the C API, its first `slots` slots acquired.
kda_engine* cpu_engine_with_slots(const std::string& text, int slots) {
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  options.backend = KDA_BACKEND_CPU;
  options.cpu_threads = 2;
  kda_engine* engine = nullptr;
  char err[512];
  REQUIRE_MESSAGE(
      kda_engine_create_from_string(text.c_str(), &options, &engine, err, sizeof err) == KDA_OK,
      err);
  for (int i = 0; i < slots; ++i) {
    int s = 0;
    REQUIRE(kda_engine_acquire_slot(engine, &s) == KDA_OK);
  }
  return engine;
}

// The C API's fold: two records steps of both layers, the second writing records region 1 and
// folding region 0, then kda_engine_commit_region(1), against an engine that commits after each
// records step: the outs and a decode step after them equal bit for bit; a caller built before the
// fold's fields (a smaller struct_size) folds nothing.
TEST_CASE("C API: kda_batch fold_rows and kda_engine_commit_region equal commits [cpu]") {
  const std::string text = std::string(kSpec) + "  max_verify_tokens: 2\n  record_regions: 2\n";
  kda_engine* committing = cpu_engine_with_slots(text, 4);
  kda_engine* folding = cpu_engine_with_slots(text, 4);
  const std::vector<std::int32_t> rows = {0, 2}, accepted = {2, 1}, fold_rows = {0, 1};
  std::vector<std::uint16_t> out_a(4 * kHidden), out_b(4 * kHidden, 0xFFFF);
  kda_batch step = c_batch(4, 2, 2, rows.data());
  step.records = 1;
  for (int round = 0; round < 2; ++round) {
    const std::vector<std::uint16_t> hidden = kda::test::random_bf16(4 * kHidden, 1.0f, 30 + round);
    kda_batch fold = step;
    fold.records_region = round;
    if (round == 1) {
      fold.fold_rows = fold_rows.data();
      fold.fold_counts = accepted.data();
      fold.fold_region = 0;
    }
    for (int l = 0; l < 2; ++l) {
      REQUIRE(kda_engine_forward_hidden_batch(committing, l, hidden.data(), out_a.data(), &step) ==
              KDA_OK);
      REQUIRE(kda_engine_forward_hidden_batch(folding, l, hidden.data(), out_b.data(), &fold) ==
              KDA_OK);
      CHECK(out_a == out_b);
    }
    REQUIRE(kda_engine_commit(committing, 2, rows.data(), accepted.data()) == KDA_OK);
  }
  CHECK(kda_engine_commit_region(folding, 2, rows.data(), accepted.data(), 2) ==
        KDA_INVALID_ARGUMENT);
  REQUIRE(kda_engine_commit_region(folding, 2, rows.data(), accepted.data(), 1) == KDA_OK);
  const int from[2] = {0, 2};
  const std::vector<std::uint16_t> hidden = kda::test::random_bf16(2 * kHidden, 1.0f, 40);
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_decode_hidden(committing, l, hidden.data(), out_a.data(), from, 2, 1) ==
            KDA_OK);
    REQUIRE(kda_engine_decode_hidden(folding, l, hidden.data(), out_b.data(), from, 2, 1) ==
            KDA_OK);
    CHECK(std::equal(out_a.begin(), out_a.begin() + 2 * kHidden, out_b.begin()));
  }
  // A batch of the version before the fold's fields: whatever lies past its struct_size is unread.
  kda_batch old = step;
  old.struct_size = offsetof(kda_batch, reserved) + sizeof(int);
  old.records_region = 7;
  const std::vector<std::uint16_t> rows4 = kda::test::random_bf16(4 * kHidden, 1.0f, 41);
  CHECK(kda_engine_forward_hidden_batch(folding, 0, rows4.data(), out_b.data(), &old) == KDA_OK);
  kda_engine_destroy(committing);
  kda_engine_destroy(folding);
}

TEST_CASE("C API: kda_batch records steps and kda_engine_commit equal the per-token form [cpu]") {
  const std::string text = std::string(kSpec) + "  max_verify_tokens: 2\n";
  kda_engine* tokens = cpu_engine_with_slots(text, 4);
  kda_engine* records = cpu_engine_with_slots(text, 4);
  const std::vector<std::uint16_t> hidden = kda::test::random_bf16(4 * kHidden, 1.0f, 13);
  std::vector<std::uint16_t> out_tokens(4 * kHidden), out_records(4 * kHidden, 0xFFFF);
  // Per-token states: row 0 from slot 0 keeps slots 0, 1; row 1 from slot 2 keeps slots 2, 3.
  const std::vector<std::int32_t> entries = {0, 1, 2, 3}, ones = {1, 1}, rows = {0, 2};
  const std::vector<std::int32_t> accepted = {2, 1};
  kda_batch verify = c_batch();
  verify.tokens = 4;
  verify.sequences = 2;
  verify.decode_tokens = 2;
  verify.slots = entries.data();
  verify.num_accepted = ones.data();
  kda_batch step = verify;
  step.slots = rows.data();
  step.num_accepted = nullptr;
  step.records = 1;
  CHECK(kda_engine_commit(records, 2, rows.data(), accepted.data()) == KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(records)).find("no records to commit") !=
        std::string::npos);
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_forward_hidden_batch(tokens, l, hidden.data(), out_tokens.data(), &verify) ==
            KDA_OK);
    REQUIRE(kda_engine_forward_hidden_batch(records, l, hidden.data(), out_records.data(), &step) ==
            KDA_OK);
    CHECK(out_tokens == out_records);
  }
  const std::vector<std::int32_t> too_many = {3, 1};
  CHECK(kda_engine_commit(records, 2, rows.data(), too_many.data()) == KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(records)).find("row 0 has num_accepted 3") !=
        std::string::npos);
  REQUIRE(kda_engine_commit(records, 2, rows.data(), accepted.data()) == KDA_OK);
  // Row 0 accepted 2 (the per-token engine kept that state in slot 1), row 1 accepted 1 (slot 2):
  // a decode step from there is the same on both engines, bit for bit, in both layers.
  const int from_tokens[2] = {1, 2}, from_records[2] = {0, 2};
  std::vector<std::uint16_t> next_tokens(2 * kHidden), next_records(2 * kHidden, 0xFFFF);
  for (int l = 0; l < 2; ++l) {
    REQUIRE(kda_engine_decode_hidden(tokens, l, hidden.data(), next_tokens.data(), from_tokens, 2,
                                     1) == KDA_OK);
    REQUIRE(kda_engine_decode_hidden(records, l, hidden.data(), next_records.data(), from_records,
                                     2, 1) == KDA_OK);
    CHECK(next_tokens == next_records);
  }
  kda_engine_destroy(tokens);
  kda_engine_destroy(records);
}

namespace {

// Random q, k, v, g (H = 4 heads of 128) and beta of `tokens` tokens on `backend`, as an engine of
// KDA cores takes them: seeds seed .. seed + 4.
struct CoreInputs {
  CoreInputs(Backend backend, std::size_t tokens, std::uint64_t seed)
      : q(backend, kda::test::random_bf16(tokens * 4 * 128, 1.0f, seed)),
        k(backend, kda::test::random_bf16(tokens * 4 * 128, 1.0f, seed + 1)),
        v(backend, kda::test::random_bf16(tokens * 4 * 128, 1.0f, seed + 2)),
        g(backend, kda::test::random_bf16(tokens * 4 * 128, 1.0f, seed + 3)),
        beta(backend, kda::test::random_bf16(tokens * 4, 1.0f, seed + 4)) {}
  kda::engine::LayerInputs inputs() const {
    return {q.get(), k.get(), v.get(), g.get(), beta.get()};
  }
  Memory q, k, v, g, beta;
};

// The records form on an engine of KDA cores (runtime.layers: core): a records step of both
// layers through decode() and one commit leave each committed slot with the per-token form's state
// after the last accepted token, and the same out (bit for bit on the CPU).
void records_cores(Backend backend) {
  const ModelSpec model = kda::engine::parse_model_spec(
      std::string(kSpec) + "  max_verify_tokens: 3\n  layers: core\n", "records-core.yaml");
  Engine tokens(model, EnginePair::options(backend, nullptr));
  Engine records(model, EnginePair::options(backend, nullptr));
  acquire_all(tokens);
  acquire_all(records);
  const int N = 2, T = 3, H = 4, D = 128;
  const std::size_t values = static_cast<std::size_t>(N * T * H * D);
  const CoreInputs random(backend, N * T, 120);
  const kda::engine::LayerInputs inputs = random.inputs();
  Memory out_tokens(backend, values * 2), out_records(backend, values * 2);
  Memory entries(backend, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5});
  Memory ones(backend, std::vector<std::int32_t>{1, 1});
  Memory rows(backend, std::vector<std::int32_t>{0, 3});
  Memory accepted(backend, std::vector<std::int32_t>{3, 2});
  BatchMetadata verify;
  verify.tokens = N * T;
  verify.sequences = N;
  verify.decode_tokens = T;
  verify.slots = entries.as<std::int32_t>();
  verify.num_accepted = ones.as<std::int32_t>();
  BatchMetadata step = verify;
  step.slots = rows.as<std::int32_t>();
  step.num_accepted = nullptr;
  step.records = true;
  const double tolerance = backend == Backend::kCpu ? 0.0 : 1e-2;
  for (int l = 0; l < 2; ++l) {
    tokens.decode(l, inputs, out_tokens.get(), verify);
    records.decode(l, inputs, out_records.get(), step);
    tokens.synchronize();
    records.synchronize();
    CHECK(deviation(kda::test::to_doubles(out_records.read<std::uint16_t>()),
                    kda::test::to_doubles(out_tokens.read<std::uint16_t>())) <= tolerance);
  }
  records.commit(N, rows.as<std::int32_t>(), accepted.as<std::int32_t>());
  records.synchronize();
  CHECK_NOTHROW(records.check_device_status());
  std::vector<float> got(records.state_slot_bytes() / sizeof(float)), want(got.size());
  for (int l = 0; l < 2; ++l) {
    for (const std::pair<int, int>& slots : {std::pair<int, int>{0, 2}, {3, 4}}) {
      // Named copies: doctest's CAPTURE takes its argument in a lambda, which may not capture a
      // structured binding before C++20.
      const int mine = slots.first, theirs = slots.second;
      CAPTURE(l);
      CAPTURE(mine);
      records.read_slot_state(l, mine, got.data());
      tokens.read_slot_state(l, theirs, want.data());
      CHECK(deviation(std::vector<double>(got.begin(), got.end()),
                      std::vector<double>(want.begin(), want.end())) <= tolerance);
    }
  }
}

// The fold on an engine of KDA cores (runtime.layers: core): a records step of both layers, then
// a second one that folds the first (records region 1, fold region 0), then a commit of the
// second, against an engine that commits after each: outs and committed states bit for bit.
void fold_cores(Backend backend) {
  const ModelSpec model = kda::engine::parse_model_spec(
      std::string(kSpec) + "  max_verify_tokens: 3\n  record_regions: 2\n  layers: core\n",
      "fold-core.yaml");
  Engine committing(model, EnginePair::options(backend, nullptr));
  Engine folding(model, EnginePair::options(backend, nullptr));
  acquire_all(committing);
  acquire_all(folding);
  const int N = 2, T = 3, H = 4, D = 128;
  const std::size_t values = static_cast<std::size_t>(N * T * H * D);
  Memory out_a(backend, values * 2), out_b(backend, values * 2);
  Memory rows(backend, std::vector<std::int32_t>{0, 3});
  Memory accepted(backend, std::vector<std::int32_t>{3, 2});
  Memory fold_rows(backend, std::vector<std::int32_t>{0, 1});
  BatchMetadata step;
  step.tokens = N * T;
  step.sequences = N;
  step.decode_tokens = T;
  step.slots = rows.as<std::int32_t>();
  step.records = true;
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    const CoreInputs random(backend, N * T, 130 + 10 * round);
    const kda::engine::LayerInputs inputs = random.inputs();
    BatchMetadata fold = step;
    fold.records_region = round;
    if (round == 1) {
      fold.fold_rows = fold_rows.as<std::int32_t>();
      fold.fold_counts = accepted.as<std::int32_t>();
      fold.fold_region = 0;
    }
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      committing.decode(l, inputs, out_a.get(), step);
      folding.decode(l, inputs, out_b.get(), fold);
      committing.synchronize();
      folding.synchronize();
      CHECK(out_a.read<std::uint16_t>() == out_b.read<std::uint16_t>());
    }
    committing.commit(N, rows.as<std::int32_t>(), accepted.as<std::int32_t>());
  }
  folding.commit(N, rows.as<std::int32_t>(), accepted.as<std::int32_t>(), 1);
  committing.synchronize();
  folding.synchronize();
  CHECK_NOTHROW(folding.check_device_status());
  std::vector<std::uint8_t> a(committing.state_slot_bytes()), b(a.size());
  for (int l = 0; l < 2; ++l) {
    for (int slot = 0; slot < committing.num_slots(); ++slot) {
      CAPTURE(l);
      CAPTURE(slot);
      committing.read_slot_state(l, slot, a.data());
      folding.read_slot_state(l, slot, b.data());
      CHECK(a == b);
    }
  }
}

}  // namespace

KDA_ENGINE_CASE("engine: folding records steps on an engine of KDA cores", fold_cores)

KDA_ENGINE_CASE("engine: records steps and a commit on an engine of KDA cores", records_cores)
