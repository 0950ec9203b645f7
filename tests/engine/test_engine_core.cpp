// The Engine's KDA cores (prefill / decode on q, k, v, g, beta) on the backend matrix: the plan,
// agreement with the core called directly on the CPU (bitwise on the CPU, 5e-3 on CUDA; on a
// core-only engine and on the cores of a whole-layer engine), run_synthetic, state slots (prefill
// + decode == longer prefill, chunked prefill, untouched slots, padding rows, reuse, misuse),
// batches of scattered slots, buffers refused before anything is written; on the CPU alone the
// plans of models too large to run, parameters from a weights file and the backend choice.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine_matrix.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"
#include "kda_reference.hpp"
#include "synthetic_run.hpp"
#include "temp_dir.hpp"

using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;
using kda::engine::LayerMode;
using kda::engine::ModelSpec;
using kda::test::Activations;
using kda::test::allowed;
using kda::test::deviation;
using kda::test::engine_options;
using kda::test::Memory;
using kda::test::OnBackend;
using kda::test::Runner;
using kda::test::slot_bytes;
using kda::test::slot_state;

namespace {

// Three KDA layers (model layers 1, 2 and 4) of two heads of 128, four slots, core-only engines
// (whole layers: test_engine_whole): what both backends run.
const char* const kSpec =
    "name: engine-test\n"
    "hidden_size: 256\n"
    "num_hidden_layers: 4\n"
    "linear_attn_config:\n"
    "  num_heads: 2\n"
    "  head_dim: 128\n"
    "  kda_layers: [1, 2, 4]\n"
    "  full_attn_layers: [3]\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 256\n"
    "  max_sequences: 4\n"
    "  state_dtype: fp32\n"
    "  workspace_plan: sum\n"
    "  layers: core\n";
constexpr std::int64_t H = 2, D = 128;
constexpr std::int64_t kRow = H * D;  // one token's q, k, v or out

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
  return text;
}

ModelSpec spec_from(const std::string& text) {
  return kda::engine::parse_model_spec(text, "t.yaml");
}

// The same model at head_dim 32, which only the CPU runs.
std::string cpu_spec() {
  return replace(replace(kSpec, "head_dim: 128", "head_dim: 32"), "hidden_size: 256",
                 "hidden_size: 64") +
         "  backend: cpu\n";
}

bool entries_overlap(const kda::planner::PlanEntry& a, const kda::planner::PlanEntry& b) {
  return a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}
bool lifetimes_overlap(const kda::planner::PlanEntry& a, const kda::planner::PlanEntry& b) {
  return a.persistent || b.persistent ||
         (a.first_step <= b.last_step && b.first_step <= a.last_step);
}

bool all_zero(const std::vector<float>& x) {
  for (const float v : x) {
    if (v != 0.0f) return false;
  }
  return true;
}

// An engine's KDA core of one layer called directly on the CPU (kda::forward_cpu /
// kda::decode_cpu) with the layer's parameters, on host pools of state slots as the engine holds
// them: the reference every core call of the engine is compared to.
class CoreReference {
 public:
  CoreReference(const Engine& engine, int layer)
      : spec_(engine.spec()),
        A_log_(engine.layer(layer).A_log),
        dt_bias_(engine.layer(layer).dt_bias),
        pool_(static_cast<std::size_t>(spec_.runtime.max_sequences) * engine.state_slot_bytes() /
                  sizeof(float),
              0.0f) {
    REQUIRE(spec_.runtime.state_dtype == kda::DType::kF32);
  }

  std::vector<std::uint16_t> prefill(const Activations& x, const std::vector<int>& slots,
                                     const std::vector<std::int64_t>& cu) {
    kda::Problem p;
    p.batch = 1;
    p.seq_len = x.tokens;
    p.num_heads = spec_.local_heads();
    p.head_dim_k = p.head_dim_v = spec_.head_dim;
    p.num_seqs = static_cast<std::int64_t>(slots.size());
    p.cu_seqlens_dtype = kda::DType::kI64;
    p.gate = spec_.gate;
    p.lower_bound = spec_.gate_lower_bound;
    p.initial_state_dtype = p.final_state_dtype = kda::DType::kF32;
    p.num_state_slots = spec_.runtime.max_sequences;
    const std::vector<std::int32_t> slot_list(slots.begin(), slots.end());
    std::vector<std::uint16_t> out(x.out_elems(), kda::test::kPoisonBf16);
    std::size_t ws_bytes = 0;
    REQUIRE(kda::workspace_size(p, kda::Backend::kCpu, &ws_bytes).ok());
    std::vector<unsigned char> workspace(ws_bytes);
    auto t = inputs<kda::Tensors>(x, out);
    t.cu_seqlens = cu.data();
    t.initial_state = pool_.data();
    t.final_state = pool_.data();
    t.state_slots = slot_list.data();
    const kda::Status st =
        kda::forward_cpu(p, t, kda::Workspace{workspace.data(), ws_bytes}, cpu_options());
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    return out;
  }

  // Padding rows' out keep the poison, as the engine's.
  std::vector<std::uint16_t> decode(const Activations& x, const std::vector<int>& slots,
                                    int tokens) {
    kda::DecodeProblem p;
    p.batch = static_cast<std::int64_t>(slots.size());
    p.tokens = tokens;
    p.num_heads = spec_.local_heads();
    p.head_dim_k = p.head_dim_v = spec_.head_dim;
    p.num_slots = spec_.runtime.max_sequences;
    p.state_dtype = kda::DType::kF32;
    p.gate = spec_.gate;
    p.lower_bound = spec_.gate_lower_bound;
    const std::vector<std::int32_t> slot_list(slots.begin(), slots.end());
    std::vector<std::uint16_t> out(x.out_elems(), kda::test::kPoisonBf16);
    auto t = inputs<kda::DecodeTensors>(x, out);
    t.slots = slot_list.data();
    t.state_pool = pool_.data();
    const kda::Status st = kda::decode_cpu(p, t, cpu_options());
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    return out;
  }

  std::vector<float> state(int slot) const {
    const std::size_t n = pool_.size() / static_cast<std::size_t>(spec_.runtime.max_sequences);
    return std::vector<float>(pool_.begin() + static_cast<std::ptrdiff_t>(slot * n),
                              pool_.begin() + static_cast<std::ptrdiff_t>((slot + 1) * n));
  }

 private:
  // The inputs and parameters of a prefill (Tensors) or decode (DecodeTensors) call.
  template <typename CallTensors>
  CallTensors inputs(const Activations& x, std::vector<std::uint16_t>& out) const {
    CallTensors t;
    t.q = x.q.data();
    t.k = x.k.data();
    t.v = x.v.data();
    t.g = x.g.data();
    t.beta = x.beta.data();
    t.A_log = A_log_.data();
    t.dt_bias = dt_bias_.data();
    t.out = out.data();
    return t;
  }
  static kda::CpuOptions cpu_options() {
    kda::CpuOptions cpu;
    cpu.num_threads = 2;  // as the engines' (engine_options)
    return cpu;
  }

  ModelSpec spec_;
  std::vector<float> A_log_, dt_bias_;
  std::vector<float> pool_;  // [max_sequences, H, V, K]
};

// An output of `elems` bf16 values on a runner's backend, poisoned (a NaN) until a call writes it.
struct Out {
  Memory memory;
  Out(const Runner& runner, std::size_t elems)
      : memory(Memory::from(runner, std::vector<std::uint16_t>(elems, kda::test::kPoisonBf16))) {}
  void* get() const { return memory.get(); }
  std::vector<std::uint16_t> download(const Engine& engine) const {
    engine.synchronize();
    return memory.download<std::uint16_t>();
  }
};

}  // namespace

KDA_MATRIX_CASE(
    "plan: one state buffer per KDA layer / parameters / workspaces / aligned / no overlap in sum "
    "/ what plan_for predicts") {
  const ModelSpec spec = spec_from(kSpec);
  const Engine engine(spec, engine_options(runner));
  CHECK(engine.backend() == runner.backend());
  CHECK(engine.num_layers() == 3);
  const kda::planner::MemoryPlan& plan = engine.plan();
  CHECK(plan.mode == kda::planner::PlanMode::kSum);

  int states = 0;
  for (const auto& entry : plan.entries) {
    CHECK(entry.offset % 256 == 0);
    CHECK(entry.offset + entry.bytes <= plan.arena_bytes);
    if (entry.kind == kda::planner::BufferKind::kState) ++states;
  }
  CHECK(states == 3);
  for (const int layer : {1, 2, 4}) {  // buffers carry the model layer, 1-based as in the YAML
    const std::string prefix = "layer" + std::to_string(layer);
    const auto* state = plan.find(prefix + ".state");
    REQUIRE(state != nullptr);
    CHECK(state->kind == kda::planner::BufferKind::kState);
    CHECK(state->layer == layer);
    CHECK(state->persistent);
    CHECK(state->bytes == 4u * H * D * D * 4);  // max_sequences x H x V x K x fp32
    CHECK(plan.find(prefix + ".A_log") != nullptr);
    CHECK(plan.find(prefix + ".dt_bias") != nullptr);
  }
  CHECK(plan.find("layer3.state") == nullptr);  // full attention: no KDA state
  // The engine plans only what it runs: inputs and outputs are the caller's.
  CHECK(plan.find("synthetic.q") == nullptr);
  CHECK(plan.find("prefill.cu_seqlens") != nullptr);
  // CUDA kernels report what the host cannot see through a status word; the CPU reports at once.
  CHECK((plan.find("engine.device_status") != nullptr) ==
        (runner.backend() == kda::Backend::kCuda));
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    for (std::size_t j = i + 1; j < plan.entries.size(); ++j) {
      CHECK_FALSE(entries_overlap(plan.entries[i], plan.entries[j]));
    }
  }
  // The engine plans exactly what plan_for() predicts.
  const auto predicted = Engine::plan_for(spec, runner.backend());
  CHECK(predicted.arena_bytes == plan.arena_bytes);
  CHECK(predicted.to_json() == plan.to_json());
  CHECK(engine.arena_bytes() == plan.arena_bytes);  // the same name as kda_engine_arena_bytes
  CHECK(plan.to_json().find("\"arena_bytes\": " + std::to_string(plan.arena_bytes)) !=
        std::string::npos);
  CHECK(plan.to_table().find("arena_bytes: " + std::to_string(plan.arena_bytes)) !=
        std::string::npos);

  // bf16 state halves the pools.
  const auto bf16 = Engine::plan_for(
      spec_from(replace(kSpec, "state_dtype: fp32", "state_dtype: bf16")), runner.backend());
  CHECK(bf16.find("layer1.state")->bytes == 4u * H * D * D * 2);

  // Each layer as messages name it: the model layer 1-based, and its KDA index.
  const kda::engine::LayerInfo& info = engine.layer(2);
  CHECK(info.model_layer == 4);
  CHECK(info.kda_index == 2);
  CHECK(info.label == "layer 4 (KDA index 2)");
  CHECK(info.A_log.size() == static_cast<std::size_t>(H));
  CHECK(info.dt_bias.size() == static_cast<std::size_t>(H * D));
  CHECK(info.origin == "random (seed 0)");
  CHECK_THROWS_WITH_AS(engine.layer(3), doctest::Contains("KDA layer 3 is out of range [0, 3)"),
                       kda::Error);
}

KDA_CPU_CASE("plan: reuse shares workspaces between layers and is smaller than sum") {
  // Planned without a device, on both backends.
  const std::string dir = std::string(KDA_SOURCE_DIR) + "/examples/models/";
  ModelSpec kimi = kda::engine::load_model_spec(dir + "kimi-linear-48b-a3b.yaml");
  kimi.runtime.layer_mode = LayerMode::kCoreOnly;  // whole layers: test_engine_whole
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    const std::string backend_name = kda::to_string(backend);
    CAPTURE(backend_name);
    kimi.runtime.workspace_plan = kda::planner::PlanMode::kSum;
    const auto sum = Engine::plan_for(kimi, backend);
    kimi.runtime.workspace_plan = kda::planner::PlanMode::kReuse;
    const auto reuse = Engine::plan_for(kimi, backend);
    CHECK(sum.mode == kda::planner::PlanMode::kSum);
    CHECK(reuse.mode == kda::planner::PlanMode::kReuse);
    REQUIRE(sum.entries.size() == reuse.entries.size());

    int workspaces = 0, states = 0;
    std::uint64_t workspace_bytes = 0;
    for (const auto& entry : sum.entries) {
      if (entry.kind == kda::planner::BufferKind::kWorkspace) {
        ++workspaces;
        workspace_bytes = entry.bytes;
      }
      if (entry.kind == kda::planner::BufferKind::kState) ++states;
    }
    CHECK(states == 20);
    if (workspaces == 0) continue;  // a backend that needs no workspace has nothing to share
    CHECK(workspaces == 20);
    // Sum gives every layer its own workspace; reuse needs about one.
    CHECK(reuse.arena_bytes < sum.arena_bytes);
    CHECK(sum.arena_bytes - reuse.arena_bytes >= 19 * workspace_bytes);
    for (std::size_t i = 0; i < reuse.entries.size(); ++i) {
      for (std::size_t j = i + 1; j < reuse.entries.size(); ++j) {
        const auto& a = reuse.entries[i];
        const auto& b = reuse.entries[j];
        if (lifetimes_overlap(a, b)) CHECK_FALSE(entries_overlap(a, b));
      }
    }
  }
}

KDA_MATRIX_CASE(
    "prefill on slots then decode steps with a padding row equal the KDA core called directly") {
  // On a core-only engine and on the cores of a whole-layer engine (the same recurrent states).
  for (const LayerMode mode : {LayerMode::kCoreOnly, LayerMode::kWhole}) {
    const std::string layers = mode == LayerMode::kWhole ? "whole" : "core";
    CAPTURE(layers);
    EngineOptions options = engine_options(runner, 11);
    options.layer_mode = mode;
    Engine engine(spec_from(kSpec), options);
    REQUIRE(engine.backend() == runner.backend());
    constexpr std::int64_t T = 256;
    kda::examples::SyntheticInputs synthetic(engine, T);
    synthetic.generate(5);
    const auto& host = synthetic.host();
    Activations all(H, D);  // the synthetic inputs as the reference reads them
    all.q = host.q;
    all.k = host.k;
    all.v = host.v;
    all.g = host.g;
    all.beta = host.beta;
    all.tokens = T;

    const std::vector<int> slots = {engine.acquire_slot(), engine.acquire_slot(),
                                    engine.acquire_slot()};
    CHECK(slots == std::vector<int>{0, 1, 2});
    const std::vector<std::int64_t> cu = {0, 100, 101, T};  // a one-token sequence in the middle
    std::vector<CoreReference> reference;
    for (int l = 0; l < engine.num_layers(); ++l) {
      CAPTURE(l);
      reference.emplace_back(engine, l);
      kda::test::fill(engine, synthetic.output(), 0xFF, all.out_elems() * 2);
      engine.prefill(l, synthetic.inputs(0), synthetic.output(), slots, cu);
      engine.synchronize();
      const auto out =
          kda::test::download<std::uint16_t>(engine, synthetic.output(), all.out_elems());
      const auto expected = reference.back().prefill(all, slots, cu);
      CHECK(deviation(out, expected) <= allowed(runner, 5e-3));
      for (const int s : slots) {
        CAPTURE(s);
        CHECK(deviation(slot_state(engine, l, s), reference.back().state(s)) <=
              allowed(runner, 5e-3));
      }
    }
    // Two decode steps of one token for each of the three sequences, rows {0, padding, 1, 2}: the
    // padding row's out is left as it was.
    const std::vector<int> rows = {slots[0], -1, slots[1], slots[2]};
    for (int step = 0; step < 2; ++step) {
      CAPTURE(step);
      const Activations x = all.slice(4 * step, 4 * step + 4);
      for (int l = 0; l < engine.num_layers(); ++l) {
        CAPTURE(l);
        kda::test::fill(engine, synthetic.output(), 0xFF, x.out_elems() * 2);
        engine.decode(l, synthetic.inputs(4 * step), synthetic.output(), rows, 1);
        engine.synchronize();
        const auto out =
            kda::test::download<std::uint16_t>(engine, synthetic.output(), x.out_elems());
        const auto expected = reference[static_cast<std::size_t>(l)].decode(x, rows, 1);
        CHECK(kda::test::rows_of(out, kRow, 1, 2) == std::vector<std::uint16_t>(kRow, 0xFFFF));
        CHECK(deviation(kda::test::without_rows(out, kRow, 1, 2),
                        kda::test::without_rows(expected, kRow, 1, 2)) <= allowed(runner, 5e-3));
        for (const int s : slots) {
          CAPTURE(s);
          CHECK(deviation(slot_state(engine, l, s), reference[static_cast<std::size_t>(l)].state(
                                                        s)) <= allowed(runner, 5e-3));
        }
      }
    }
    CHECK_NOTHROW(engine.check_device_status());
  }
}

KDA_MATRIX_CASE(
    "run_synthetic: every layer timed / slots acquired and released / decode steps / every "
    "output written") {
  for (const LayerMode mode : {LayerMode::kCoreOnly, LayerMode::kWhole}) {
    const std::string layers = mode == LayerMode::kWhole ? "whole" : "core";
    CAPTURE(layers);
    EngineOptions options = engine_options(runner);
    options.layer_mode = mode;
    Engine engine(spec_from(kSpec), options);
    kda::examples::SyntheticInputs synthetic(engine, 64);
    CHECK(synthetic.capacity() == 64);
    // The run writes the layer output: the hidden-state output for whole layers, the core's
    // output otherwise. Poisoned first (bf16 0xffff is a NaN), so that the check below sees values
    // the run wrote.
    const bool whole = mode == LayerMode::kWhole;
    void* written = whole ? synthetic.hidden_output() : synthetic.output();
    REQUIRE(written != nullptr);
    const std::size_t n = static_cast<std::size_t>(64 * (whole ? engine.spec().hidden_size : kRow));
    kda::test::fill(engine, written, 0xFF, n * 2);
    kda::examples::RunOptions run;
    run.tokens = 64;
    run.sequences = 3;
    run.decode_steps = 4;
    int calls = 0, last_total = 0;
    run.progress = [&](int done, int total) {
      ++calls;
      CHECK(done == calls);
      last_total = total;
    };
    const kda::examples::RunReport report = kda::examples::run_synthetic(engine, synthetic, run);
    CHECK(report.backend == runner.backend());
    CHECK(report.layer_seconds.size() == 3);
    CHECK(report.decode_step_seconds.size() == 4);
    CHECK(report.prefill_seconds > 0);
    CHECK(report.slots.size() == 3);
    CHECK(calls == 3 + 4);
    CHECK(last_total == 7);
    CHECK(engine.free_slots() == 4);
    engine.synchronize();
    CHECK(kda::test::all_finite(kda::test::download<std::uint16_t>(engine, written, n)));
    run.sequences = 5;  // more than max_sequences
    CHECK_THROWS_AS(kda::examples::run_synthetic(engine, synthetic, run), kda::Error);
    run.sequences = 1;
    run.tokens = 65;  // more than the inputs hold
    CHECK_THROWS_AS(kda::examples::run_synthetic(engine, synthetic, run), kda::Error);
    // Fewer tokens than sequences still leave room for a decode step of every slot.
    CHECK(kda::examples::SyntheticInputs(engine, 1).capacity() == 4);
    CHECK_THROWS_WITH_AS(kda::examples::SyntheticInputs(engine, -1),
                         doctest::Contains("tokens must be >= 0"), kda::Error);
  }
}

namespace {

// Prefill n tokens then m decode steps of one token equals one prefill of n + m tokens; and m
// tokens in one multi-token decode step equal the same tokens one at a time.
void check_prefill_then_decode(const Runner& runner, const std::string& yaml,
                               kda::DType state_dtype) {
  const ModelSpec spec = spec_from(yaml);
  Engine engine(spec, engine_options(runner));
  const std::int64_t n = 21, m = 6, L = n + m;
  const Activations seq0(L, H, D, 101), seq1(L, H, D, 202);
  auto both = [&](std::int64_t t0, std::int64_t t1) {  // [B = 2, t1 - t0, H, D]
    Activations x = seq0.slice(t0, t1);
    x.append(seq1, t0, t1);
    return x;
  };
  auto state_deviation = [&](int layer, int slot, int reference_slot) {
    if (state_dtype == kda::DType::kF32) {
      return deviation(slot_state(engine, layer, slot), slot_state(engine, layer, reference_slot));
    }
    std::vector<std::uint16_t> a(engine.state_slot_bytes() / 2), b(a.size());
    engine.read_slot_state(layer, slot, a.data());
    engine.read_slot_state(layer, reference_slot, b.data());
    return deviation(a, b);
  };

  const Activations full = both(0, L), head = both(0, n), multi = both(n, L);
  const OnBackend full_in(runner, full), head_in(runner, head), multi_in(runner, multi);
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    // A: one prefill of L tokens per sequence.
    const int a0 = engine.acquire_slot(), a1 = engine.acquire_slot();
    Out out_full(runner, full.out_elems());
    engine.prefill(l, full_in.inputs(), out_full.get(), {a0, a1}, {0, L, 2 * L});
    const std::vector<std::uint16_t> a_out = out_full.download(engine);

    // B: prefill n, then m single-token decode steps.
    const int b0 = engine.acquire_slot(), b1 = engine.acquire_slot();
    Out out_head(runner, head.out_elems());
    engine.prefill(l, head_in.inputs(), out_head.get(), {b0, b1}, {0, n, 2 * n});
    std::vector<std::uint16_t> out_steps_full, out_steps_b;  // [m][2 sequences][H][V]
    for (std::int64_t t = n; t < L; ++t) {
      const Activations step = both(t, t + 1);  // [B = 2, tokens = 1, H, D]
      const OnBackend step_in(runner, step);
      Out out_step(runner, step.out_elems());
      engine.decode(l, step_in.inputs(), out_step.get(), {b0, b1}, 1);
      const std::vector<std::uint16_t> got = out_step.download(engine);
      out_steps_b.insert(out_steps_b.end(), got.begin(), got.end());
      for (std::int64_t s = 0; s < 2; ++s) {
        const auto first = a_out.begin() + (s * L + t) * kRow;
        out_steps_full.insert(out_steps_full.end(), first, first + kRow);
      }
    }
    CHECK(kda::test::all_finite(out_steps_b));
    CHECK(deviation(out_steps_b, out_steps_full) <= 5e-3);
    std::vector<std::uint16_t> head_full;
    for (std::int64_t s = 0; s < 2; ++s) {
      const auto first = a_out.begin() + s * L * kRow;
      head_full.insert(head_full.end(), first, first + n * kRow);
    }
    CHECK(deviation(out_head.download(engine), head_full) <= 5e-3);
    CHECK(state_deviation(l, b1, a1) <= 5e-3);
    if (state_dtype == kda::DType::kF32) CHECK(state_deviation(l, b0, a0) <= 5e-3);
    engine.release_slot(a0);
    engine.release_slot(a1);

    // C: prefill n, then all m tokens in one multi-token decode step.
    const int c0 = engine.acquire_slot(), c1 = engine.acquire_slot();
    Out scratch(runner, head.out_elems()), out_multi(runner, multi.out_elems());
    engine.prefill(l, head_in.inputs(), scratch.get(), {c0, c1}, {0, n, 2 * n});
    engine.decode(l, multi_in.inputs(), out_multi.get(), {c0, c1}, static_cast<int>(m));
    // Reorder B's [m][2] rows to [2][m] for the comparison.
    std::vector<std::uint16_t> b_by_sequence;
    for (std::int64_t s = 0; s < 2; ++s) {
      for (std::int64_t t = 0; t < m; ++t) {
        const auto first = out_steps_b.begin() + (t * 2 + s) * kRow;
        b_by_sequence.insert(b_by_sequence.end(), first, first + kRow);
      }
    }
    CHECK(deviation(out_multi.download(engine), b_by_sequence) <= 5e-3);
    if (state_dtype == kda::DType::kF32) CHECK(state_deviation(l, c0, b0) <= 5e-3);
    for (const int slot : {b0, b1, c0, c1}) engine.release_slot(slot);
    CHECK(engine.free_slots() == 4);
  }
}

}  // namespace

KDA_MATRIX_CASE("slots: prefill n + decode m equals prefill n + m (softplus / fp32 state)") {
  check_prefill_then_decode(runner, kSpec, kda::DType::kF32);
}

KDA_MATRIX_CASE(
    "slots: prefill n + decode m equals prefill n + m (lower_bound gate / bf16 state)") {
  std::string yaml =
      replace(kSpec, "gate: softplus", "gate: lower_bound\n  gate_lower_bound: -3.0");
  yaml = replace(yaml, "state_dtype: fp32", "state_dtype: bf16");
  check_prefill_then_decode(runner, yaml, kda::DType::kBF16);
}

KDA_MATRIX_CASE("slots: a second prefill continues from the slot's state (chunked prefill)") {
  Engine engine(spec_from(kSpec), engine_options(runner));
  const Activations seq(40, H, D, 9);
  const OnBackend whole_in(runner, seq), first_in(runner, seq.slice(0, 17)),
      second_in(runner, seq.slice(17, 40));
  const int whole = engine.acquire_slot(), chunked = engine.acquire_slot();
  Out out_whole(runner, 40 * kRow), out_a(runner, 17 * kRow), out_b(runner, 23 * kRow);
  engine.prefill(0, whole_in.inputs(), out_whole.get(), {whole}, {0, 40});
  engine.prefill(0, first_in.inputs(), out_a.get(), {chunked}, {0, 17});
  engine.prefill(0, second_in.inputs(), out_b.get(), {chunked}, {0, 23});
  CHECK(deviation(slot_state(engine, 0, chunked), slot_state(engine, 0, whole)) <= 5e-3);
  CHECK(deviation(out_b.download(engine),
                  kda::test::rows_of(out_whole.download(engine), kRow, 17, 40)) <= 5e-3);
}

KDA_MATRIX_CASE("slots: a copied slot continues as its source does, in every layer (copy_slots)") {
  Engine engine(spec_from(kSpec), engine_options(runner));
  const int source = engine.acquire_slot(), fork = engine.acquire_slot();
  const int other = engine.acquire_slot();
  const Activations prompt(21, H, D, 12);
  const OnBackend prompt_in(runner, prompt);
  Out out(runner, 21 * kRow);
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill(l, prompt_in.inputs(), out.get(), {source, other}, {0, 13, 21});
  }
  const std::vector<std::uint8_t> other_before = slot_bytes(engine, 1, other);
  // Caller-owned pairs (the backend's memory): source into fork; a padding pair into `other`.
  const Memory src = Memory::from(runner, std::vector<std::int32_t>{source, -1});
  const Memory dst = Memory::from(runner, std::vector<std::int32_t>{fork, other});
  engine.copy_slots(2, src.as<std::int32_t>(), dst.as<std::int32_t>());
  engine.check_device_status();
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    CHECK(slot_bytes(engine, l, fork) == slot_bytes(engine, l, source));
  }
  CHECK(slot_bytes(engine, 1, other) == other_before);
  // Both continue with the same two tokens: the same outputs and states, bit for bit.
  const OnBackend step_in(runner, Activations(2, H, D, 13));
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    Out a(runner, 2 * kRow), b(runner, 2 * kRow);
    engine.decode(l, step_in.inputs(), a.get(), {source}, 2);
    engine.decode(l, step_in.inputs(), b.get(), {fork}, 2);
    CHECK(a.download(engine) == b.download(engine));
    CHECK(slot_bytes(engine, l, fork) == slot_bytes(engine, l, source));
  }
}

KDA_MATRIX_CASE("slots: reset_slots zeroes the named slots in every layer, as reset_slot does") {
  Engine engine(spec_from(kSpec), engine_options(runner));
  const int a = engine.acquire_slot(), b = engine.acquire_slot(), c = engine.acquire_slot();
  const Activations prompt(19, H, D, 14);
  const OnBackend prompt_in(runner, prompt);
  Out out(runner, 19 * kRow);
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill(l, prompt_in.inputs(), out.get(), {a, b, c}, {0, 6, 11, 19});
  }
  const std::vector<std::uint8_t> zeros(engine.state_slot_bytes(), 0);
  const std::vector<std::uint8_t> c_before = slot_bytes(engine, 0, c);
  REQUIRE(c_before != zeros);
  const Memory slots = Memory::from(runner, std::vector<std::int32_t>{b, -1, a, b});
  engine.reset_slots(4, slots.as<std::int32_t>());
  engine.check_device_status();
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    CHECK(slot_bytes(engine, l, a) == zeros);
    CHECK(slot_bytes(engine, l, b) == zeros);
    CHECK(slot_bytes(engine, l, c) != zeros);
  }
  CHECK(slot_bytes(engine, 0, c) == c_before);
  engine.reset_slots(0, nullptr);  // nothing to do
  CHECK_THROWS_WITH_AS(engine.reset_slots(1, nullptr), "reset_slots: slots is null", kda::Error);
  CHECK_THROWS_WITH_AS(engine.reset_slots(5, slots.as<std::int32_t>()),
                       "reset_slots: 5 entries, expected 0..4 (runtime.max_sequences)", kda::Error);
  CHECK_THROWS_WITH_AS(engine.reset_slots(-1, slots.as<std::int32_t>()),
                       "reset_slots: -1 entries, expected 0..4 (runtime.max_sequences)",
                       kda::Error);
  if (runner.backend() == kda::Backend::kCpu) {
    engine.release_slot(b);
    const std::string message =
        "reset_slots: entry 0 names slot " + std::to_string(b) + ", which is not an acquired slot";
    CHECK_THROWS_WITH_AS(engine.reset_slots(4, slots.as<std::int32_t>()), message.c_str(),
                         kda::Error);
  }
}

KDA_MATRIX_CASE(
    "slots: slots not named in a step stay bitwise untouched / padding rows are skipped") {
  Engine engine(spec_from(kSpec), engine_options(runner));
  for (int i = 0; i < 4; ++i) CHECK(engine.acquire_slot() == i);
  // Poison slots 2 and 3 of every layer with NaN bit patterns and random bytes.
  std::mt19937_64 rng(77);
  std::vector<std::vector<std::uint8_t>> poison;
  for (int l = 0; l < engine.num_layers(); ++l) {
    for (const int slot : {2, 3}) {
      std::vector<std::uint8_t> bytes(engine.state_slot_bytes());
      for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
      for (std::size_t i = 0; i < bytes.size(); i += 64)
        std::memcpy(&bytes[i], "\xc1\xff\xff\x7f", 4);
      engine.write_slot_state(l, slot, bytes.data());
      poison.push_back(bytes);
    }
  }
  const Activations seq(30, H, D, 5);
  const OnBackend seq_in(runner, seq);
  Out out(runner, 30 * kRow);
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill(l, seq_in.inputs(), out.get(), {0, 1}, {0, 12, 30});
  }
  // Decode rows: slot 1, padding, slot 0.
  const OnBackend step_in(runner, Activations(3, H, D, 6));
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    Out out_step(runner, 3 * kRow);
    engine.decode(l, step_in.inputs(), out_step.get(), {1, -1, 0}, 1);
    const std::vector<std::uint16_t> got = out_step.download(engine);
    CHECK(kda::test::all_finite(kda::test::rows_of(got, kRow, 0, 1)));
    CHECK(kda::test::all_finite(kda::test::rows_of(got, kRow, 2, 3)));
    CHECK(kda::test::rows_of(got, kRow, 1, 2) ==
          std::vector<std::uint16_t>(kRow, kda::test::kPoisonBf16));  // padding: untouched
  }
  std::size_t index = 0;
  for (int l = 0; l < engine.num_layers(); ++l) {
    for (const int slot : {2, 3}) {
      CAPTURE(l);
      CAPTURE(slot);
      CHECK(slot_bytes(engine, l, slot) == poison[index++]);
    }
  }
  CHECK_NOTHROW(engine.check_device_status());
}

KDA_MATRIX_CASE("slots: acquire / release / reset / reuse / misuse") {
  Engine engine(spec_from(kSpec), engine_options(runner));
  CHECK(engine.num_slots() == 4);
  for (int i = 0; i < 4; ++i) CHECK(engine.acquire_slot() == i);
  CHECK(engine.free_slots() == 0);
  CHECK_THROWS_WITH_AS(engine.acquire_slot(), doctest::Contains("in use"), kda::Error);

  const OnBackend seq(runner, Activations(16, H, D, 3));
  const LayerInputs in = seq.inputs();
  Out out(runner, 16 * kRow);
  engine.prefill(1, in, out.get(), {1}, {0, 16});
  CHECK_FALSE(all_zero(slot_state(engine, 1, 1)));
  engine.release_slot(1);
  CHECK_FALSE(engine.slot_in_use(1));
  CHECK_THROWS_AS(engine.release_slot(1), kda::Error);  // twice
  CHECK_THROWS_AS(engine.reset_slot(1), kda::Error);    // not acquired
  // Just past either end of the pool: never acquired, so neither released nor reset.
  for (const int outside : {-1, engine.num_slots()}) {
    CAPTURE(outside);
    CHECK_FALSE(engine.slot_in_use(outside));
    CHECK_THROWS_AS(engine.release_slot(outside), kda::Error);
    CHECK_THROWS_AS(engine.reset_slot(outside), kda::Error);
  }
  CHECK_THROWS_WITH_AS(engine.prefill(1, in, out.get(), {1}, {0, 16}), doctest::Contains("slot 1"),
                       kda::Error);
  CHECK_THROWS_AS(engine.decode(1, in, out.get(), {1}, 1), kda::Error);
  // Reacquired: the lowest free slot again, zeroed in every layer.
  CHECK(engine.acquire_slot() == 1);
  for (int l = 0; l < engine.num_layers(); ++l) CHECK(all_zero(slot_state(engine, l, 1)));

  // Reset zeroes a slot in every layer and keeps it acquired.
  for (int l = 0; l < engine.num_layers(); ++l) engine.prefill(l, in, out.get(), {2}, {0, 16});
  CHECK_FALSE(all_zero(slot_state(engine, 0, 2)));
  engine.reset_slot(2);
  CHECK(engine.slot_in_use(2));
  for (int l = 0; l < engine.num_layers(); ++l) CHECK(all_zero(slot_state(engine, l, 2)));

  // Misuse is an error, not corruption.
  CHECK_THROWS_WITH_AS(engine.prefill(0, in, out.get(), {0, 0}, {0, 8, 16}),
                       doctest::Contains("twice"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, in, out.get(), {0, 1}, {0, 16}),
                       doctest::Contains("cu_seqlens"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, in, out.get(), {0, 1}, {1, 8, 16}),
                       doctest::Contains("cu_seqlens[0]"), kda::Error);
  CHECK_THROWS_WITH_AS(
      engine.prefill(0, in, out.get(), {0, 1}, {0, 9, 8}),
      doctest::Contains("prefill: cu_seqlens must be non-decreasing: cu_seqlens[2] = 8 < "
                        "cu_seqlens[1] = 9"),
      kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, in, out.get(), {0}, {0, 257}),
                       doctest::Contains("max_tokens"), kda::Error);
  CHECK_THROWS_AS(engine.prefill(3, in, out.get(), {0}, {0, 16}), kda::Error);
  CHECK_THROWS_AS(engine.decode(0, in, out.get(), {0}, 0), kda::Error);
  CHECK_THROWS_AS(engine.decode(0, in, out.get(), {0}, 17), kda::Error);
  CHECK_THROWS_WITH_AS(engine.decode(0, in, out.get(), {0, 0}, 1), doctest::Contains("twice"),
                       kda::Error);
  CHECK_THROWS_AS(engine.decode(0, in, out.get(), {7}, 1), kda::Error);
  // A slot's state to or from a null host buffer.
  CHECK_THROWS_WITH_AS(engine.read_slot_state(0, 0, nullptr),
                       doctest::Contains("read_slot_state: the host buffer is null"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.write_slot_state(0, 0, nullptr),
                       doctest::Contains("write_slot_state: the host buffer is null"), kda::Error);
  CHECK(out.memory.guards_intact());
}

KDA_CPU_CASE("options of unknown enum values, and a commit with no KDA layer, are refused") {
  EngineOptions bad_mode;
  bad_mode.layer_mode = static_cast<LayerMode>(7);
  CHECK_THROWS_WITH_AS(Engine(spec_from(kSpec), bad_mode),
                       doctest::Contains("the layer mode (runtime.layers, "
                                         "EngineOptions::layer_mode) is 7, expected kWhole or "
                                         "kCoreOnly"),
                       kda::Error);
  EngineOptions bad_backend;
  bad_backend.backend = static_cast<kda::engine::BackendChoice>(9);
  CHECK_THROWS_WITH_AS(Engine(spec_from(kSpec), bad_backend),
                       doctest::Contains("the backend (runtime.backend, EngineOptions::backend) "
                                         "is 9, expected kAuto, kCpu or kCuda"),
                       kda::Error);
  // A spec built in code with no KDA layer makes an engine of none; its commit has nothing to
  // take records from.
  kda::engine::ModelSpec none = spec_from(kSpec);
  none.kda_layers.clear();
  none.kda_layer_indices.clear();
  none.runtime.max_verify_tokens = 2;
  none.runtime.layer_mode = LayerMode::kCoreOnly;
  EngineOptions cpu;
  cpu.backend = kda::engine::BackendChoice::kCpu;
  Engine engine(none, cpu);
  REQUIRE(engine.num_layers() == 0);
  const std::int32_t slots[1] = {-1}, accepted[1] = {1};
  CHECK_THROWS_WITH_AS(engine.commit(1, slots, accepted), doctest::Contains("has no KDA layer"),
                       kda::Error);
}

KDA_MATRIX_CASE("a batch of scattered slots equals each sequence run alone") {
  Engine batched(spec_from(kSpec), engine_options(runner, 3));
  Engine alone(spec_from(kSpec), engine_options(runner, 3));  // same seed: same parameters
  for (int i = 0; i < 4; ++i) batched.acquire_slot();
  const int solo = alone.acquire_slot();

  // Sequences of lengths 5, 0, 7, 9 on slots 3, 1, 2, 0.
  const std::vector<int> slots = {3, 1, 2, 0};
  const std::vector<std::int64_t> cu = {0, 5, 5, 12, 21};
  const Activations all(21, H, D, 8);
  const OnBackend all_in(runner, all);
  for (int l = 0; l < batched.num_layers(); ++l) {
    CAPTURE(l);
    Out out(runner, 21 * kRow);
    batched.prefill(l, all_in.inputs(), out.get(), slots, cu);
    const std::vector<std::uint16_t> got = out.download(batched);
    CHECK(kda::test::all_finite(got));
    for (std::size_t j = 0; j < slots.size(); ++j) {
      CAPTURE(j);
      alone.reset_slot(solo);
      const std::int64_t t0 = cu[j], t1 = cu[j + 1];
      const OnBackend one(runner, all.slice(t0, t1));
      Out out_one(runner, static_cast<std::size_t>((t1 - t0) * kRow));
      alone.prefill(l, one.inputs(), out_one.get(), {solo}, {0, t1 - t0});
      CHECK(deviation(kda::test::rows_of(got, kRow, t0, t1), out_one.download(alone)) <=
            allowed(runner, 1e-3, 1e-6));
      CHECK(deviation(slot_state(batched, l, slots[j]), slot_state(alone, l, solo)) <=
            allowed(runner, 1e-3, 1e-6));
    }
  }
}

KDA_MATRIX_CASE("an out that overlaps an input is refused before anything is written") {
  Engine engine(spec_from(kSpec), engine_options(runner, 5));
  const int s0 = engine.acquire_slot(), s1 = engine.acquire_slot(), s2 = engine.acquire_slot();
  (void)s1;
  const std::vector<int> slots = {s0, s2};  // fragmented slots
  const std::vector<std::int64_t> cu = {0, 10, 110};
  // One buffer: q for 110 tokens, then room; out starts 50 tokens into q, so the first
  // sequence's 10 output tokens would not touch its 10 input tokens, but the whole batch's do.
  const Activations acts(110, H, D, 4);
  std::vector<std::uint16_t> contents(200 * kRow, kda::test::kPoisonBf16);
  std::copy(acts.q.begin(), acts.q.end(), contents.begin());
  Memory buffer = Memory::from(runner, contents);
  const OnBackend acts_in(runner, acts);
  LayerInputs in = acts_in.inputs();
  in.q = buffer.get();
  CHECK_THROWS_WITH_AS(engine.prefill(0, in, buffer.as<std::uint16_t>() + 50 * kRow, slots, cu),
                       doctest::Contains("layer 1 (KDA index 0) prefill: out overlaps q"),
                       kda::Error);
  engine.synchronize();
  CHECK(buffer.download<std::uint16_t>() == contents);
  CHECK(buffer.guards_intact());
  CHECK(all_zero(slot_state(engine, 0, s0)));
  CHECK(all_zero(slot_state(engine, 0, s2)));
  // Without the overlap the same batch runs.
  Out out(runner, 110 * kRow);
  CHECK_NOTHROW(engine.prefill(0, in, out.get(), slots, cu));
  CHECK(kda::test::all_finite(out.download(engine)));
}

KDA_CUDA_CASE(
    "a caller buffer too short for the batch or in host memory is refused before anything is "
    "written") {
  Engine e(spec_from(kSpec), engine_options(cuda));
  const int s0 = e.acquire_slot(), s1 = e.acquire_slot(), s2 = e.acquire_slot();
  (void)s1;
  // Slots {s0, s2}; out holds only the first sequence and half of the second (no guard bytes: the
  // allocation ends where the buffer does).
  const std::vector<std::int64_t> cu = {0, 40, 80};
  const std::vector<int> slots = {s0, s2};
  const OnBackend acts(cuda, Activations(80, H, D, 9));
  Memory out(cuda, static_cast<std::size_t>(60 * kRow) * 2, 0);
  out.fill(0xFF);
  CHECK_THROWS_WITH_AS(e.prefill(0, acts.inputs(), out.get(), slots, cu),
                       doctest::Contains("out needs"), kda::Error);
  e.synchronize();
  CHECK(out.download<std::uint16_t>() == std::vector<std::uint16_t>(60 * kRow, 0xFFFF));
  CHECK(all_zero(slot_state(e, 0, s0)));
  CHECK(all_zero(slot_state(e, 0, s2)));
  // A host pointer for beta, in decode.
  std::vector<std::uint16_t> host_beta(static_cast<std::size_t>(2 * H), 0);
  LayerInputs in = acts.inputs();
  in.beta = host_beta.data();
  CHECK_THROWS_WITH_AS(e.decode(0, in, out.get(), slots, 1),
                       doctest::Contains("beta points to unregistered host memory"), kda::Error);
  // The same calls with good buffers work, and the engine's status word stays clear.
  Out good(cuda, 80 * kRow);
  e.prefill(0, acts.inputs(), good.get(), slots, cu);
  e.decode(0, acts.inputs(), good.get(), slots, 1);
  CHECK_NOTHROW(e.check_device_status());
}

KDA_CPU_CASE("parameters come from the weights file when the model names one") {
  const kda::test::TempDir dir;
  const std::int64_t K = 32;
  std::vector<kda::engine::Tensor> tensors;
  kda::test::Rng rng(99);
  for (const int index : {0, 1, 3}) {
    // A_log as Hugging Face stores it, [1, 1, H, 1] F32; dt_bias flat [H * K] in BF16.
    auto a_log = kda::engine::Tensor::zeros(kda::engine::a_log_tensor_name(index), kda::DType::kF32,
                                            {1, 1, H, 1});
    for (std::int64_t h = 0; h < H; ++h)
      a_log.data_as<float>()[h] = static_cast<float>(rng.uniform(0, 2));
    auto dt = kda::engine::Tensor::zeros(kda::engine::dt_bias_tensor_name(index), kda::DType::kBF16,
                                         {H * K});
    for (std::int64_t i = 0; i < H * K; ++i) {
      dt.data_as<std::uint16_t>()[i] = kda::float_to_bf16(static_cast<float>(rng.uniform(-3, 0)));
    }
    tensors.push_back(a_log);
    tensors.push_back(dt);
  }
  kda::engine::save_safetensors(dir.file("w.safetensors"), tensors);
  std::ofstream(dir.file("m.yaml")) << cpu_spec() << "weights: w.safetensors\n";
  const Engine engine(kda::engine::load_model_spec(dir.file("m.yaml")), EngineOptions{});
  for (int l = 0; l < 3; ++l) {
    const kda::engine::LayerInfo& info = engine.layer(l);
    CHECK(info.origin == dir.file("w.safetensors"));
    const auto& a_log = tensors[static_cast<std::size_t>(2 * l)];
    const auto& dt = tensors[static_cast<std::size_t>(2 * l + 1)];
    for (std::int64_t h = 0; h < H; ++h) CHECK(info.A_log[h] == a_log.data_as<float>()[h]);
    for (std::int64_t i = 0; i < H * K; ++i) {
      CHECK(info.dt_bias[i] == kda::bf16_to_float(dt.data_as<std::uint16_t>()[i]));
    }
  }

  // A missing tensor is named; so is a wrong shape.
  tensors.pop_back();
  kda::engine::save_safetensors(dir.file("w.safetensors"), tensors);
  CHECK_THROWS_WITH_AS(Engine(kda::engine::load_model_spec(dir.file("m.yaml"))),
                       doctest::Contains("model.layers.3.self_attn.dt_bias"), kda::Error);
  tensors.push_back(kda::engine::Tensor::zeros(kda::engine::dt_bias_tensor_name(3),
                                               kda::DType::kF32, {K, H + 1}));
  kda::engine::save_safetensors(dir.file("w.safetensors"), tensors);
  CHECK_THROWS_WITH_AS(Engine(kda::engine::load_model_spec(dir.file("m.yaml"))),
                       doctest::Contains("expected [64] or [2, 32]"), kda::Error);
  // A_log outside the operator's range (kda::kMaxAbsALog) is refused at load, naming the tensor.
  tensors.pop_back();
  tensors.push_back(
      kda::engine::Tensor::zeros(kda::engine::dt_bias_tensor_name(3), kda::DType::kF32, {H * K}));
  tensors[2].data_as<float>()[1] = kda::kMaxAbsALog + 5.0f;  // layer 1's A_log, head 1
  kda::engine::save_safetensors(dir.file("w.safetensors"), tensors);
  CHECK_THROWS_WITH_AS(
      Engine(kda::engine::load_model_spec(dir.file("m.yaml"))),
      doctest::Contains("model.layers.1.self_attn.A_log': A_log[1] = 25 is outside [-20, 20]"),
      kda::Error);
}

KDA_CPU_CASE("gate parameters outside the operator's contract are refused at load, by name") {
  // A checkpoint is how parameters reach an engine: A_log below -kMaxAbsALog, a NaN A_log and an
  // infinite dt_bias are each refused, naming the tensor (its model layer, 0-based as checkpoints
  // number layers) and the element.
  const kda::test::TempDir dir;
  const std::int64_t K = 32;
  std::ofstream(dir.file("m.yaml")) << cpu_spec() << "weights: w.safetensors\n";
  // The model with layer `bad`'s A_log and dt_bias (F32) passed through `spoil` first.
  auto model = [&](int bad, const std::function<void(float* a_log, float* dt_bias)>& spoil) {
    std::vector<kda::engine::Tensor> tensors;
    for (const int index : {0, 1, 3}) {
      const kda::layer::GateParameters p = kda::layer::random_gate_parameters(1, index, H, K);
      auto a_log =
          kda::engine::Tensor::zeros(kda::engine::a_log_tensor_name(index), kda::DType::kF32, {H});
      auto dt = kda::engine::Tensor::zeros(kda::engine::dt_bias_tensor_name(index),
                                           kda::DType::kF32, {H * K});
      std::memcpy(a_log.data.data(), p.A_log.data(), a_log.data.size());
      std::memcpy(dt.data.data(), p.dt_bias.data(), dt.data.size());
      if (index == bad) spoil(a_log.data_as<float>(), dt.data_as<float>());
      tensors.push_back(a_log);
      tensors.push_back(dt);
    }
    kda::engine::save_safetensors(dir.file("w.safetensors"), tensors);
    return kda::engine::load_model_spec(dir.file("m.yaml"));
  };
  CHECK_NOTHROW(Engine(model(3, [](float*, float*) {})));
  CHECK_THROWS_WITH_AS(
      Engine(model(3, [](float* a_log, float*) { a_log[1] = -kda::kMaxAbsALog - 1.0f; })),
      doctest::Contains("model.layers.3.self_attn.A_log': A_log[1] = -21 is outside [-20, 20]"),
      kda::Error);
  CHECK_THROWS_WITH_AS(
      Engine(model(
          3, [](float* a_log, float*) { a_log[0] = std::numeric_limits<float>::quiet_NaN(); })),
      doctest::Contains("model.layers.3.self_attn.A_log' holds a non-finite value at element 0"),
      kda::Error);
  CHECK_THROWS_WITH_AS(
      Engine(model(
          1, [](float*, float* dt_bias) { dt_bias[5] = std::numeric_limits<float>::infinity(); })),
      doctest::Contains("model.layers.1.self_attn.dt_bias' holds a non-finite value at element 5"),
      kda::Error);
}

KDA_MATRIX_CASE("backends: each backend as asked / auto picks CUDA when it can run the model") {
  ModelSpec small = spec_from(cpu_spec()), cuda_sized = spec_from(kSpec);
  small.runtime.backend = cuda_sized.runtime.backend = kda::engine::BackendChoice::kAuto;
  // head_dim 32 is not a CUDA problem, so auto stays on the CPU even with a GPU present.
  CHECK(kda::engine::resolve_backend(small, kda::engine::BackendChoice::kAuto) ==
        kda::Backend::kCpu);
  CHECK(Engine(small).backend() == kda::Backend::kCpu);
  CHECK(Engine(cuda_sized, engine_options(runner)).backend() == runner.backend());
  // A CUDA plan is made on any machine, of a model the CUDA backend can run; one it cannot is
  // refused naming why (the cores' head_dim; with whole layers, the layer's).
  CHECK(Engine::plan_for(cuda_sized, kda::Backend::kCuda).arena_bytes > 0);
  if (kda::cuda_device_count() == 0 || kda::cuda_device_supported().ok()) {
    CHECK_THROWS_WITH_AS(Engine::plan_for(small, kda::Backend::kCuda),
                         doctest::Contains("the CUDA backend cannot run this model: prefill: the "
                                           "CUDA backend needs head_dim_k == head_dim_v == 128"),
                         kda::Error);
    ModelSpec whole = small;
    whole.runtime.layer_mode = LayerMode::kWhole;
    CHECK_THROWS_WITH_AS(Engine::plan_for(whole, kda::Backend::kCuda),
                         doctest::Contains("the CUDA backend cannot run this model: KDA layer "
                                           "(CUDA): head_dim 32 is not 128"),
                         kda::Error);
    CHECK(Engine::plan_for(whole, kda::Backend::kCpu).arena_bytes > 0);
  }
  if (runner.backend() == kda::Backend::kCuda) {
    CHECK(kda::engine::resolve_backend(cuda_sized, kda::engine::BackendChoice::kAuto) ==
          kda::Backend::kCuda);
    CHECK(Engine(cuda_sized).backend() == kda::Backend::kCuda);
  } else if (kda::cuda_device_count() == 0) {  // the CPU always works; CUDA needs a device
    CHECK(kda::engine::resolve_backend(cuda_sized, kda::engine::BackendChoice::kAuto) ==
          kda::Backend::kCpu);
    EngineOptions options;
    options.backend = kda::engine::BackendChoice::kCuda;
    try {
      Engine engine(small, options);
      FAIL("expected kda::Error");
    } catch (const kda::Error& e) {
      CHECK(e.code() == kda::StatusCode::kBackendUnavailable);
    }
  }
}
