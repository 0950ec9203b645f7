// Two engines driven from two threads at once — on CUDA each on a stream of its own, so that their
// kernels overlap — equal the same work run serially, bitwise, on both backends: an Engine keeps
// no state that another engine touches, and its forwards depend on nothing but their inputs.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine_matrix.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"
#include "synthetic_run.hpp"

#include "cuda_runtime_util.hpp"

namespace {

using kda::Backend;
using kda::engine::Engine;
using kda::engine::LayerInputs;
using kda::engine::ModelSpec;
using kda::examples::SyntheticInputs;

// Three KDA layers, softplus gate. On CUDA 16 heads and longer sequences, so that two engines'
// kernels really overlap; on the CPU 4 heads (each engine threads internally too).
ModelSpec spec(Backend backend) {
  const bool cuda = backend == Backend::kCuda;
  return kda::engine::parse_model_spec(std::string("name: threads\nhidden_size: ") +
                                           (cuda ? "2048" : "512") +
                                           "\nnum_hidden_layers: 4\n"
                                           "linear_attn_config:\n  num_heads: " +
                                           (cuda ? "16" : "4") +
                                           "\n  head_dim: 128\n  kda_layers: [1, 2, 4]\n"
                                           "  full_attn_layers: [3]\n  gate: softplus\n"
                                           "runtime:\n  max_tokens: 2048\n  max_sequences: 4\n",
                                       "threads.yaml");
}

// The work: three sequences prefilled (one of one token) and decode steps of one token with a
// padding row, through every layer.
struct Shape {
  std::vector<std::int64_t> cu_seqlens;
  int decode_steps;
  std::int64_t tokens() const { return cu_seqlens.back(); }
};
constexpr int kDecodeRows = 4;  // three sequences and one padding row
Shape shape(Backend backend) {
  return backend == Backend::kCuda ? Shape{{0, 700, 701, 1500}, 6} : Shape{{0, 100, 101, 257}, 4};
}

struct WorkResult {
  std::vector<std::uint16_t> prefill_out;  // [layers][T, H, V]
  std::vector<std::uint16_t> decode_out;   // [steps][layers][rows, H, V]
  std::vector<std::uint8_t> states;        // [layers][3 slots][H, V, K]
};

void ok_or_throw(const kda::Status& st, const char* what) {
  if (!st.ok()) throw std::runtime_error(std::string(what) + ": " + st.to_string());
}

// Poisons the outputs, acquires three slots, runs the work, reads every output and the slots'
// states back and releases the slots. Runs on worker threads: no doctest macros, throws instead.
WorkResult work(Engine& engine, const SyntheticInputs& synthetic, const Shape& s,
                kda::test::Memory& prefill_out, kda::test::Memory& decode_out) {
  const bool cuda = engine.backend() == Backend::kCuda;
  auto poison = [&](kda::test::Memory& m) {
    if (cuda) {
      ok_or_throw(kda::memset_device(m.get(), 0xFF, m.bytes(), engine.stream()), "poison");
    } else {
      std::memset(m.get(), 0xFF, m.bytes());
    }
  };
  poison(prefill_out);
  poison(decode_out);
  const std::int64_t H = engine.spec().num_heads, D = engine.spec().head_dim;
  const std::size_t prefill_bytes = static_cast<std::size_t>(s.tokens() * H * D * 2);
  const std::size_t row_bytes = static_cast<std::size_t>(kDecodeRows * H * D * 2);
  const int layers = engine.num_layers();
  auto at = [](kda::test::Memory& m, std::size_t offset) {
    return static_cast<std::uint8_t*>(m.get()) + offset;
  };
  std::vector<int> slots;
  for (int j = 0; j < 3; ++j) slots.push_back(engine.acquire_slot());
  for (int l = 0; l < layers; ++l) {
    engine.prefill(l, synthetic.inputs(0), at(prefill_out, prefill_bytes * l), slots, s.cu_seqlens);
  }
  const std::vector<int> rows = {slots[0], -1, slots[1], slots[2]};
  for (int step = 0; step < s.decode_steps; ++step) {
    const LayerInputs inputs = synthetic.inputs(s.tokens() + kDecodeRows * step);
    for (int l = 0; l < layers; ++l) {
      engine.decode(l, inputs, at(decode_out, row_bytes * (step * layers + l)), rows, 1);
    }
  }
  engine.synchronize();
  WorkResult r;
  auto read = [&](const kda::test::Memory& m) {
    std::vector<std::uint16_t> host(m.bytes() / 2);
    if (cuda) {
      ok_or_throw(kda::memcpy_to_host(host.data(), m.get(), m.bytes(), engine.stream()), "read");
    } else {
      std::memcpy(host.data(), m.get(), m.bytes());
    }
    return host;
  };
  r.prefill_out = read(prefill_out);
  r.decode_out = read(decode_out);
  const std::size_t slot_bytes = static_cast<std::size_t>(engine.state_slot_bytes());
  r.states.resize(slot_bytes * slots.size() * layers);
  for (int l = 0; l < layers; ++l) {
    for (std::size_t j = 0; j < slots.size(); ++j) {
      engine.read_slot_state(l, slots[j], r.states.data() + slot_bytes * (l * slots.size() + j));
    }
  }
  for (const int slot : slots) engine.release_slot(slot);
  return r;
}

// The engines' streams: on CUDA non-blocking ones (their kernels then overlap); none on the CPU.
struct EngineStream {
#ifdef KDA_HAVE_CUDA
  explicit EngineStream(Backend backend) : cuda(backend == Backend::kCuda) {}
  void* get() const { return cuda ? static_cast<void*>(stream.stream) : nullptr; }
  bool cuda;
  kda::test::Stream stream;
#else
  explicit EngineStream(Backend) {}
  void* get() const { return nullptr; }
#endif
};

}  // namespace

KDA_MATRIX_CASE(
    "two engines in two threads (on CUDA on two streams) equal the same work run serially "
    "(bitwise)") {
  const Backend backend = runner.backend();
  EngineStream stream_a(backend), stream_b(backend);  // before the engines: destroyed after them
  const bool streams_ready = backend == Backend::kCpu || (stream_a.get() && stream_b.get());
  REQUIRE(streams_ready);
  const ModelSpec model = spec(backend);
  const Shape s = shape(backend);
  kda::engine::EngineOptions oa = kda::test::engine_options(runner, 31),
                             ob = kda::test::engine_options(runner, 32);
  oa.stream = stream_a.get();
  ob.stream = stream_b.get();
  Engine a(model, oa), b(model, ob);
  REQUIRE(a.backend() == backend);
  const std::int64_t synthetic = s.tokens() + kDecodeRows * s.decode_steps;
  SyntheticInputs ia(a, synthetic), ib(b, synthetic);
  ia.generate(7);
  ib.generate(8);
  const std::int64_t HD = model.num_heads * model.head_dim;
  const auto prefill_bytes = static_cast<std::size_t>(s.tokens() * HD * 2 * a.num_layers());
  const auto decode_bytes =
      static_cast<std::size_t>(kDecodeRows * HD * 2 * a.num_layers() * s.decode_steps);
  kda::test::Memory pa(runner, prefill_bytes), da(runner, decode_bytes);
  kda::test::Memory pb(runner, prefill_bytes), db(runner, decode_bytes);
  // Buffers set up on the legacy default stream, which non-blocking streams do not wait for.
  const bool setup_done = backend == Backend::kCpu || kda::stream_synchronize(nullptr).ok();
  REQUIRE(setup_done);

  const WorkResult serial_a = work(a, ia, s, pa, da);
  const WorkResult serial_b = work(b, ib, s, pb, db);
  // Every output of a real row was written; the two engines really compute different things.
  CHECK(kda::test::all_finite(serial_a.prefill_out));
  CHECK(kda::test::all_finite(serial_b.prefill_out));
  CHECK(serial_a.prefill_out != serial_b.prefill_out);
  CHECK(serial_a.states != serial_b.states);

  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    WorkResult got[2];
    std::exception_ptr failure[2];
    std::atomic<int> ready{0};
    auto drive = [&](int i, Engine& engine, const SyntheticInputs& inputs, kda::test::Memory& p,
                     kda::test::Memory& d) {
      ready.fetch_add(1);
      while (ready.load() < 2) std::this_thread::yield();  // start together
      try {
        got[i] = work(engine, inputs, s, p, d);
      } catch (...) {
        failure[i] = std::current_exception();
      }
    };
    std::thread ta(drive, 0, std::ref(a), std::cref(ia), std::ref(pa), std::ref(da));
    std::thread tb(drive, 1, std::ref(b), std::cref(ib), std::ref(pb), std::ref(db));
    ta.join();
    tb.join();
    for (const std::exception_ptr& f : failure) {
      if (!f) continue;
      try {
        std::rethrow_exception(f);
      } catch (const std::exception& e) {
        FAIL("a worker thread failed: " << e.what());
      }
    }
    CHECK(got[0].prefill_out == serial_a.prefill_out);
    CHECK(got[0].decode_out == serial_a.decode_out);
    CHECK(got[0].states == serial_a.states);
    CHECK(got[1].prefill_out == serial_b.prefill_out);
    CHECK(got[1].decode_out == serial_b.decode_out);
    CHECK(got[1].states == serial_b.states);
  }
  for (const kda::test::Memory* m : {&pa, &da, &pb, &db}) CHECK(m->guards_intact());
}
