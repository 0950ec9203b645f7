// Engine on the CPU backend: the plan, bitwise agreement with forward_cpu, state slots (prefill +
// decode == longer prefill, untouched slots, padding, reuse), batches of scattered slots, weights.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda_reference.hpp"
#include "synthetic_run.hpp"

namespace fs = std::filesystem;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;
using kda::engine::ModelSpec;

namespace {

const char* const kSpec =
    "name: engine-test\n"
    "hidden_size: 64\n"
    "num_hidden_layers: 4\n"
    "linear_attn_config:\n"
    "  num_heads: 2\n"
    "  head_dim: 32\n"
    "  kda_layers: [1, 2, 4]\n"
    "  full_attn_layers: [3]\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 256\n"
    "  max_sequences: 4\n"
    "  state_dtype: fp32\n"
    "  workspace_plan: sum\n"
    "  backend: cpu\n"
    "  layers: core\n";  // these tests are of the core-only engine; whole layers: test_engine_whole

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
  return text;
}

ModelSpec spec_from(const std::string& text) {
  return kda::engine::parse_model_spec(text, "t.yaml");
}

// bf16 activations for `tokens` tokens, laid out [tokens, H, D] (beta [tokens, H]).
struct Activations {
  std::int64_t tokens = 0, H = 0, D = 0;
  std::vector<std::uint16_t> q, k, v, g, beta;

  Activations(std::int64_t t, std::int64_t h, std::int64_t d, std::uint64_t seed)
      : tokens(t), H(h), D(d) {
    kda::test::Rng rng(seed);
    q = kda::test::random_bf16(rng, t * h * d, 1.0);
    k = kda::test::random_bf16(rng, t * h * d, 1.0);
    v = kda::test::random_bf16(rng, t * h * d, 1.0);
    g = kda::test::random_bf16(rng, t * h * d, 1.0);
    beta = kda::test::random_bf16(rng, t * h, 1.0);
  }
  Activations(std::int64_t h, std::int64_t d) : H(h), D(d) {}

  // Appends tokens [t0, t1) of `other`.
  void append(const Activations& other, std::int64_t t0, std::int64_t t1) {
    auto add = [&](std::vector<std::uint16_t>& dst, const std::vector<std::uint16_t>& src,
                   std::int64_t width) {
      dst.insert(dst.end(), src.begin() + t0 * width, src.begin() + t1 * width);
    };
    add(q, other.q, H * D);
    add(k, other.k, H * D);
    add(v, other.v, H * D);
    add(g, other.g, H * D);
    add(beta, other.beta, H);
    tokens += t1 - t0;
  }
  LayerInputs inputs() const { return {q.data(), k.data(), v.data(), g.data(), beta.data()}; }
};

std::vector<float> slot_state(const Engine& e, int layer, int slot) {
  std::vector<float> state(e.state_slot_bytes() / sizeof(float));
  e.read_slot_state(layer, slot, state.data());
  return state;
}

std::vector<std::uint8_t> slot_bytes(const Engine& e, int layer, int slot) {
  std::vector<std::uint8_t> bytes(e.state_slot_bytes());
  e.read_slot_state(layer, slot, bytes.data());
  return bytes;
}

double rel(const std::vector<float>& x, const std::vector<float>& ref) {
  return kda::test::rel_error(kda::test::to_doubles(x), kda::test::to_doubles(ref));
}
double rel_bf16(const std::vector<std::uint16_t>& x, const std::vector<std::uint16_t>& ref) {
  return kda::test::rel_error(kda::test::to_doubles(x), kda::test::to_doubles(ref));
}

bool entries_overlap(const kda::planner::PlanEntry& a, const kda::planner::PlanEntry& b) {
  return a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}
bool lifetimes_overlap(const kda::planner::PlanEntry& a, const kda::planner::PlanEntry& b) {
  return a.persistent || b.persistent ||
         (a.first_step <= b.last_step && b.first_step <= a.last_step);
}

}  // namespace

TEST_CASE(
    "plan: one state buffer per KDA layer / parameters / workspaces / aligned / no overlap in "
    "sum") {
  const ModelSpec spec = spec_from(kSpec);
  const Engine engine(spec);
  CHECK(engine.backend() == kda::Backend::kCpu);
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
    CHECK(state->bytes == 4u * 2 * 32 * 32 * 4);  // max_sequences x H x V x K x fp32
    CHECK(plan.find(prefix + ".A_log") != nullptr);
    CHECK(plan.find(prefix + ".dt_bias") != nullptr);
  }
  CHECK(plan.find("layer3.state") == nullptr);  // full attention: no KDA state
  // The engine plans only what it runs: inputs and outputs are the caller's.
  CHECK(plan.find("synthetic.q") == nullptr);
  CHECK(plan.find("prefill.cu_seqlens") != nullptr);
  CHECK(plan.find("engine.device_status") == nullptr);  // the CPU reports at once
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    for (std::size_t j = i + 1; j < plan.entries.size(); ++j) {
      CHECK_FALSE(entries_overlap(plan.entries[i], plan.entries[j]));
    }
  }
  // The engine plans exactly what plan_for() predicts.
  const auto predicted = Engine::plan_for(spec, kda::Backend::kCpu);
  CHECK(predicted.arena_bytes == plan.arena_bytes);
  CHECK(predicted.to_json() == plan.to_json());
  CHECK(engine.arena_bytes() == plan.arena_bytes);  // the same name as kda_engine_arena_bytes
  CHECK(plan.to_json().find("\"arena_bytes\": " + std::to_string(plan.arena_bytes)) !=
        std::string::npos);
  CHECK(plan.to_table().find("arena_bytes: " + std::to_string(plan.arena_bytes)) !=
        std::string::npos);

  // bf16 state halves the pools.
  const auto bf16 = Engine::plan_for(
      spec_from(replace(kSpec, "state_dtype: fp32", "state_dtype: bf16")), kda::Backend::kCpu);
  CHECK(bf16.find("layer1.state")->bytes == 4u * 2 * 32 * 32 * 2);
}

TEST_CASE("plan: reuse shares workspaces between layers and is smaller than sum") {
  const std::string dir = std::string(KDA_SOURCE_DIR) + "/examples/models/";
  ModelSpec kimi = kda::engine::load_model_spec(dir + "kimi-linear-48b-a3b.yaml");
  kimi.runtime.layer_mode = kda::engine::LayerMode::kCoreOnly;  // whole layers: test_engine_whole
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    CAPTURE(kda::to_string(backend));
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

TEST_CASE("prefill on the CPU equals calling kda::forward_cpu directly (bitwise)") {
  const ModelSpec spec = spec_from(kSpec);
  EngineOptions options;
  options.seed = 11;
  Engine engine(spec, options);
  kda::examples::SyntheticInputs synthetic(engine, 100);
  synthetic.generate(5);
  const auto& host = synthetic.host();

  const std::vector<int> slots = {engine.acquire_slot(), engine.acquire_slot(),
                                  engine.acquire_slot()};
  CHECK(slots == std::vector<int>{0, 1, 2});
  const std::vector<std::int64_t> cu = {0, 34, 67, 100};
  const std::int64_t H = 2, D = 32, T = 100;
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    engine.prefill(l, synthetic.inputs(0), synthetic.output(), slots, cu);
    std::vector<std::uint16_t> engine_out(static_cast<std::size_t>(T * H * D));
    std::memcpy(engine_out.data(), synthetic.output(), engine_out.size() * 2);

    kda::Problem p;
    p.batch = 1;
    p.seq_len = T;
    p.num_heads = H;
    p.head_dim_k = D;
    p.head_dim_v = D;
    p.num_seqs = 3;
    p.cu_seqlens_dtype = kda::DType::kI64;
    p.gate = kda::GateMode::kSoftplus;
    p.initial_state_dtype = kda::DType::kF32;
    p.final_state_dtype = kda::DType::kF32;
    std::vector<float> initial(static_cast<std::size_t>(3 * H * D * D), 0.0f);
    std::vector<float> final_state(initial.size(), -1.0f);
    std::vector<std::uint16_t> out(engine_out.size(), 0);
    std::size_t ws_bytes = 0;
    REQUIRE(kda::workspace_size(p, kda::Backend::kCpu, &ws_bytes).ok());
    std::vector<unsigned char> workspace(ws_bytes);
    kda::Tensors t;
    t.q = host.q.data();
    t.k = host.k.data();
    t.v = host.v.data();
    t.g = host.g.data();
    t.beta = host.beta.data();
    t.A_log = engine.layer(l).parameters().A_log.data();
    t.dt_bias = engine.layer(l).parameters().dt_bias.data();
    t.cu_seqlens = cu.data();
    t.initial_state = initial.data();
    t.final_state = final_state.data();
    t.out = out.data();
    REQUIRE(kda::forward_cpu(p, t, kda::Workspace{workspace.data(), ws_bytes}).ok());

    CHECK(out == engine_out);
    for (int s = 0; s < 3; ++s) {
      const std::vector<float> state = slot_state(engine, l, s);
      CHECK(std::memcmp(state.data(), final_state.data() + s * H * D * D, state.size() * 4) == 0);
    }
  }
}

TEST_CASE("run_synthetic: every layer timed / slots acquired and released / decode steps") {
  Engine engine(spec_from(kSpec));
  kda::examples::SyntheticInputs synthetic(engine, 64);
  CHECK(synthetic.capacity() == 64);
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
  CHECK(report.layer_seconds.size() == 3);
  CHECK(report.decode_step_seconds.size() == 4);
  CHECK(report.slots.size() == 3);
  CHECK(calls == 3 + 4);
  CHECK(last_total == 7);
  CHECK(engine.free_slots() == 4);
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

// Prefill n tokens then m decode steps of one token equals one prefill of n + m tokens; and m
// tokens in one multi-token decode step equal the same tokens one at a time.
void check_prefill_then_decode(const std::string& yaml, kda::DType state_dtype) {
  const ModelSpec spec = spec_from(yaml);
  Engine engine(spec, EngineOptions{});
  const std::int64_t H = spec.num_heads, D = spec.head_dim, n = 21, m = 6, L = n + m;
  const Activations seq0(L, H, D, 101), seq1(L, H, D, 202);

  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    // A: one prefill of L tokens per sequence.
    const int a0 = engine.acquire_slot(), a1 = engine.acquire_slot();
    Activations full(H, D);
    full.append(seq0, 0, L);
    full.append(seq1, 0, L);
    std::vector<std::uint16_t> out_full(static_cast<std::size_t>(2 * L * H * D));
    engine.prefill(l, full.inputs(), out_full.data(), {a0, a1}, {0, L, 2 * L});

    // B: prefill n, then m single-token decode steps.
    const int b0 = engine.acquire_slot(), b1 = engine.acquire_slot();
    Activations head(H, D);
    head.append(seq0, 0, n);
    head.append(seq1, 0, n);
    std::vector<std::uint16_t> out_head(static_cast<std::size_t>(2 * n * H * D));
    engine.prefill(l, head.inputs(), out_head.data(), {b0, b1}, {0, n, 2 * n});
    std::vector<std::uint16_t> out_steps_full, out_steps_b;  // [m][2 sequences][H][V]
    for (std::int64_t t = n; t < L; ++t) {
      Activations step(H, D);  // [B = 2, tokens = 1, H, D]
      step.append(seq0, t, t + 1);
      step.append(seq1, t, t + 1);
      std::vector<std::uint16_t> out_step(static_cast<std::size_t>(2 * H * D),
                                          kda::test::kPoisonBf16);
      engine.decode(l, step.inputs(), out_step.data(), {b0, b1}, 1);
      out_steps_b.insert(out_steps_b.end(), out_step.begin(), out_step.end());
      for (std::int64_t s = 0; s < 2; ++s) {
        const auto first = out_full.begin() + (s * L + t) * H * D;
        out_steps_full.insert(out_steps_full.end(), first, first + H * D);
      }
    }
    CHECK(kda::test::all_finite(out_steps_b));
    CHECK(rel_bf16(out_steps_b, out_steps_full) <= 5e-3);
    std::vector<std::uint16_t> head_full;
    for (std::int64_t s = 0; s < 2; ++s) {
      const auto first = out_full.begin() + s * L * H * D;
      head_full.insert(head_full.end(), first, first + n * H * D);
    }
    CHECK(rel_bf16(out_head, head_full) <= 5e-3);
    if (state_dtype == kda::DType::kF32) {
      CHECK(rel(slot_state(engine, l, b0), slot_state(engine, l, a0)) <= 5e-3);
      CHECK(rel(slot_state(engine, l, b1), slot_state(engine, l, a1)) <= 5e-3);
    } else {
      std::vector<std::uint16_t> sa(engine.state_slot_bytes() / 2), sb(sa.size());
      engine.read_slot_state(l, a1, sa.data());
      engine.read_slot_state(l, b1, sb.data());
      CHECK(rel_bf16(sb, sa) <= 5e-3);
    }
    const std::vector<std::uint8_t> state_b0 = slot_bytes(engine, l, b0);
    engine.release_slot(a0);
    engine.release_slot(a1);

    // C: prefill n, then all m tokens in one multi-token decode step.
    const int c0 = engine.acquire_slot(), c1 = engine.acquire_slot();
    std::vector<std::uint16_t> scratch(out_head.size());
    engine.prefill(l, head.inputs(), scratch.data(), {c0, c1}, {0, n, 2 * n});
    Activations multi(H, D);  // [B = 2, tokens = m, H, D]
    multi.append(seq0, n, L);
    multi.append(seq1, n, L);
    std::vector<std::uint16_t> out_multi(static_cast<std::size_t>(2 * m * H * D));
    engine.decode(l, multi.inputs(), out_multi.data(), {c0, c1}, static_cast<int>(m));
    // Reorder B's [m][2] rows to [2][m] for the comparison.
    std::vector<std::uint16_t> b_by_sequence;
    for (std::int64_t s = 0; s < 2; ++s) {
      for (std::int64_t t = 0; t < m; ++t) {
        const auto first = out_steps_b.begin() + (t * 2 + s) * H * D;
        b_by_sequence.insert(b_by_sequence.end(), first, first + H * D);
      }
    }
    CHECK(rel_bf16(out_multi, b_by_sequence) <= 5e-3);
    if (state_dtype == kda::DType::kF32) {
      std::vector<float> sb(state_b0.size() / 4);
      std::memcpy(sb.data(), state_b0.data(), state_b0.size());
      CHECK(rel(slot_state(engine, l, c0), sb) <= 5e-3);
    }
    for (const int slot : {b0, b1, c0, c1}) engine.release_slot(slot);
    CHECK(engine.free_slots() == 4);
  }
}

TEST_CASE("slots: prefill n + decode m equals prefill n + m (softplus / fp32 state)") {
  check_prefill_then_decode(kSpec, kda::DType::kF32);
}

TEST_CASE("slots: prefill n + decode m equals prefill n + m (lower_bound gate / bf16 state)") {
  std::string yaml =
      replace(kSpec, "gate: softplus", "gate: lower_bound\n  gate_lower_bound: -3.0");
  yaml = replace(yaml, "state_dtype: fp32", "state_dtype: bf16");
  check_prefill_then_decode(yaml, kda::DType::kBF16);
}

TEST_CASE("slots: a second prefill continues from the slot's state (chunked prefill)") {
  Engine engine(spec_from(kSpec), EngineOptions{});
  const Activations seq(40, 2, 32, 9);
  const int whole = engine.acquire_slot(), chunked = engine.acquire_slot();
  std::vector<std::uint16_t> out_whole(40 * 2 * 32), out_a(17 * 2 * 32), out_b(23 * 2 * 32);
  engine.prefill(0, seq.inputs(), out_whole.data(), {whole}, {0, 40});
  Activations first(2, 32), second(2, 32);
  first.append(seq, 0, 17);
  second.append(seq, 17, 40);
  engine.prefill(0, first.inputs(), out_a.data(), {chunked}, {0, 17});
  engine.prefill(0, second.inputs(), out_b.data(), {chunked}, {0, 23});
  CHECK(rel(slot_state(engine, 0, chunked), slot_state(engine, 0, whole)) <= 5e-3);
  std::vector<std::uint16_t> tail(out_whole.begin() + 17 * 64, out_whole.end());
  CHECK(rel_bf16(out_b, tail) <= 5e-3);
}

TEST_CASE("slots: slots not named in a step stay bitwise untouched / padding rows are skipped") {
  Engine engine(spec_from(kSpec), EngineOptions{});
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
  const Activations seq(30, 2, 32, 5);
  std::vector<std::uint16_t> out(30 * 64);
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill(l, seq.inputs(), out.data(), {0, 1}, {0, 12, 30});
  }
  // Decode rows: slot 1, padding, slot 0.
  const Activations step(3, 2, 32, 6);
  std::vector<std::uint16_t> out_step(3 * 64, kda::test::kPoisonBf16);
  for (int l = 0; l < engine.num_layers(); ++l) {
    std::fill(out_step.begin(), out_step.end(), kda::test::kPoisonBf16);
    engine.decode(l, step.inputs(), out_step.data(), {1, -1, 0}, 1);
    std::vector<std::uint16_t> row0(out_step.begin(), out_step.begin() + 64);
    std::vector<std::uint16_t> row1(out_step.begin() + 64, out_step.begin() + 128);
    std::vector<std::uint16_t> row2(out_step.begin() + 128, out_step.end());
    CHECK(kda::test::all_finite(row0));
    CHECK(kda::test::all_finite(row2));
    CHECK(row1 == std::vector<std::uint16_t>(64, kda::test::kPoisonBf16));  // padding: untouched
  }
  std::size_t index = 0;
  for (int l = 0; l < engine.num_layers(); ++l) {
    for (const int slot : {2, 3}) {
      CAPTURE(l);
      CAPTURE(slot);
      CHECK(slot_bytes(engine, l, slot) == poison[index++]);
    }
  }
}

TEST_CASE("slots: acquire / release / reset / reuse / misuse") {
  Engine engine(spec_from(kSpec), EngineOptions{});
  CHECK(engine.num_slots() == 4);
  for (int i = 0; i < 4; ++i) CHECK(engine.acquire_slot() == i);
  CHECK(engine.free_slots() == 0);
  CHECK_THROWS_WITH_AS(engine.acquire_slot(), doctest::Contains("in use"), kda::Error);

  const Activations seq(16, 2, 32, 3);
  std::vector<std::uint16_t> out(16 * 64);
  const std::vector<float> zero(engine.state_slot_bytes() / 4, 0.0f);
  engine.prefill(1, seq.inputs(), out.data(), {1}, {0, 16});
  CHECK(slot_state(engine, 1, 1) != zero);
  engine.release_slot(1);
  CHECK_FALSE(engine.slot_in_use(1));
  CHECK_THROWS_AS(engine.release_slot(1), kda::Error);  // twice
  CHECK_THROWS_AS(engine.reset_slot(1), kda::Error);    // not acquired
  CHECK_THROWS_WITH_AS(engine.prefill(1, seq.inputs(), out.data(), {1}, {0, 16}),
                       doctest::Contains("slot 1"), kda::Error);
  CHECK_THROWS_AS(engine.decode(1, seq.inputs(), out.data(), {1}, 1), kda::Error);
  // Reacquired: the lowest free slot again, zeroed in every layer.
  CHECK(engine.acquire_slot() == 1);
  for (int l = 0; l < engine.num_layers(); ++l) CHECK(slot_state(engine, l, 1) == zero);

  // Reset zeroes a slot in every layer and keeps it acquired.
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill(l, seq.inputs(), out.data(), {2}, {0, 16});
  }
  engine.reset_slot(2);
  CHECK(engine.slot_in_use(2));
  for (int l = 0; l < engine.num_layers(); ++l) CHECK(slot_state(engine, l, 2) == zero);

  // Misuse is an error, not corruption.
  CHECK_THROWS_WITH_AS(engine.prefill(0, seq.inputs(), out.data(), {0, 0}, {0, 8, 16}),
                       doctest::Contains("twice"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, seq.inputs(), out.data(), {0, 1}, {0, 16}),
                       doctest::Contains("cu_seqlens"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, seq.inputs(), out.data(), {0, 1}, {1, 8, 16}),
                       doctest::Contains("cu_seqlens[0]"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, seq.inputs(), out.data(), {0, 1}, {0, 9, 8}),
                       doctest::Contains("decreases"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill(0, seq.inputs(), out.data(), {0}, {0, 257}),
                       doctest::Contains("max_tokens"), kda::Error);
  CHECK_THROWS_AS(engine.prefill(3, seq.inputs(), out.data(), {0}, {0, 16}), kda::Error);
  CHECK_THROWS_AS(engine.decode(0, seq.inputs(), out.data(), {0}, 0), kda::Error);
  CHECK_THROWS_AS(engine.decode(0, seq.inputs(), out.data(), {0}, 17), kda::Error);
  CHECK_THROWS_WITH_AS(engine.decode(0, seq.inputs(), out.data(), {0, 0}, 1),
                       doctest::Contains("twice"), kda::Error);
  CHECK_THROWS_AS(engine.decode(0, seq.inputs(), out.data(), {7}, 1), kda::Error);
}

TEST_CASE("a batch of scattered slots equals each sequence run alone") {
  EngineOptions options;
  options.seed = 3;
  Engine batched(spec_from(kSpec), options);
  Engine alone(spec_from(kSpec), options);  // same seed: same parameters
  for (int i = 0; i < 4; ++i) batched.acquire_slot();
  const int solo = alone.acquire_slot();

  // Sequences of lengths 5, 0, 7, 9 on slots 3, 1, 2, 0: runs {3}, {1, 2}, {0}.
  const std::vector<int> slots = {3, 1, 2, 0};
  const std::vector<std::int64_t> cu = {0, 5, 5, 12, 21};
  const Activations all(21, 2, 32, 8);
  for (int l = 0; l < batched.num_layers(); ++l) {
    CAPTURE(l);
    std::vector<std::uint16_t> out(21 * 64, kda::test::kPoisonBf16);
    batched.prefill(l, all.inputs(), out.data(), slots, cu);
    CHECK(kda::test::all_finite(out));
    for (std::size_t j = 0; j < slots.size(); ++j) {
      CAPTURE(j);
      alone.reset_slot(solo);
      const std::int64_t t0 = cu[j], t1 = cu[j + 1];
      Activations one(2, 32);
      one.append(all, t0, t1);
      std::vector<std::uint16_t> out_one(static_cast<std::size_t>((t1 - t0) * 64));
      alone.prefill(l, one.inputs(), out_one.data(), {solo}, {0, t1 - t0});
      const std::vector<std::uint16_t> part(out.begin() + t0 * 64, out.begin() + t1 * 64);
      CHECK(rel_bf16(part, out_one) <= 1e-6);
      CHECK(rel(slot_state(batched, l, slots[j]), slot_state(alone, l, solo)) <= 1e-6);
    }
  }
}

TEST_CASE(
    "an out that overlaps an input only in a later run of slots is refused before any run writes") {
  EngineOptions options;
  options.seed = 5;
  Engine engine(spec_from(kSpec), options);
  const int s0 = engine.acquire_slot(), s1 = engine.acquire_slot(), s2 = engine.acquire_slot();
  (void)s1;
  const std::vector<int> slots = {s0, s2};  // two runs: {s0}, {s2}
  const std::vector<std::int64_t> cu = {0, 10, 110};
  // One buffer: q for 110 tokens, then room; out starts 50 tokens into q, so the first run's
  // 10 output tokens would not touch its 10 input tokens, but the whole batch's do.
  std::vector<std::uint16_t> buffer(200 * 64, kda::test::kPoisonBf16);
  const Activations acts(110, 2, 32, 4);
  std::copy(acts.q.begin(), acts.q.end(), buffer.begin());
  LayerInputs in = acts.inputs();
  in.q = buffer.data();
  const std::vector<std::uint16_t> before = buffer;
  CHECK_THROWS_WITH_AS(engine.prefill(0, in, buffer.data() + 50 * 64, slots, cu),
                       doctest::Contains("layer 1 (KDA index 0) prefill: out overlaps q"),
                       kda::Error);
  CHECK(buffer == before);
  for (float x : slot_state(engine, 0, s0)) {
    if (x != 0.0f) {
      FAIL("the first run updated its state before the overlap was refused");
      break;
    }
  }
  // Without the overlap the same batch runs.
  std::vector<std::uint16_t> out(110 * 64, kda::test::kPoisonBf16);
  CHECK_NOTHROW(engine.prefill(0, in, out.data(), slots, cu));
}

TEST_CASE("parameters come from the weights file when the model names one") {
  std::random_device random;
  const fs::path dir = fs::temp_directory_path() / ("kda-test-weights-" + std::to_string(random()));
  fs::create_directories(dir);
  const std::int64_t H = 2, K = 32;
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
  kda::engine::save_safetensors((dir / "w.safetensors").string(), tensors);
  {
    std::ofstream yaml(dir / "m.yaml");
    yaml << kSpec << "weights: w.safetensors\n";
  }
  const Engine engine(kda::engine::load_model_spec((dir / "m.yaml").string()), EngineOptions{});
  for (int l = 0; l < 3; ++l) {
    const auto& params = engine.layer(l).parameters();
    const auto& a_log = tensors[static_cast<std::size_t>(2 * l)];
    const auto& dt = tensors[static_cast<std::size_t>(2 * l + 1)];
    for (std::int64_t h = 0; h < H; ++h) CHECK(params.A_log[h] == a_log.data_as<float>()[h]);
    for (std::int64_t i = 0; i < H * K; ++i) {
      CHECK(params.dt_bias[i] == kda::bf16_to_float(dt.data_as<std::uint16_t>()[i]));
    }
  }

  // A missing tensor is named; so is a wrong shape.
  tensors.pop_back();
  kda::engine::save_safetensors((dir / "w.safetensors").string(), tensors);
  CHECK_THROWS_WITH_AS(Engine(kda::engine::load_model_spec((dir / "m.yaml").string())),
                       doctest::Contains("model.layers.3.self_attn.dt_bias"), kda::Error);
  tensors.push_back(kda::engine::Tensor::zeros(kda::engine::dt_bias_tensor_name(3),
                                               kda::DType::kF32, {K, H + 1}));
  kda::engine::save_safetensors((dir / "w.safetensors").string(), tensors);
  CHECK_THROWS_WITH_AS(Engine(kda::engine::load_model_spec((dir / "m.yaml").string())),
                       doctest::Contains("expected [64] or [2, 32]"), kda::Error);
  // A_log outside the operator's range (kda::kMaxAbsALog) is refused at load, naming the tensor.
  tensors.pop_back();
  tensors.push_back(
      kda::engine::Tensor::zeros(kda::engine::dt_bias_tensor_name(3), kda::DType::kF32, {H * K}));
  tensors[2].data_as<float>()[1] = kda::kMaxAbsALog + 5.0f;  // layer 1's A_log, head 1
  kda::engine::save_safetensors((dir / "w.safetensors").string(), tensors);
  CHECK_THROWS_WITH_AS(
      Engine(kda::engine::load_model_spec((dir / "m.yaml").string())),
      doctest::Contains(
          "model.layers.1.self_attn.A_log' value 25.000000 at element 1 is outside [-20, 20]"),
      kda::Error);
  fs::remove_all(dir);
}

TEST_CASE("KdaLayer refuses parameters outside the operator's contract, however they were made") {
  const ModelSpec spec = spec_from(kSpec);
  kda::engine::KdaParameters good =
      kda::engine::random_kda_parameters(1, 0, spec.num_heads, spec.head_dim);
  CHECK_NOTHROW(kda::engine::KdaLayer(spec, 0, 0, good));
  auto bad = good;
  bad.A_log[1] = -kda::kMaxAbsALog - 1.0f;
  CHECK_THROWS_WITH_AS(kda::engine::KdaLayer(spec, 0, 0, bad), doctest::Contains("A_log[1] = -21"),
                       kda::Error);
  // Messages name the model layer 1-based, as the YAML does, and the KDA index.
  CHECK_THROWS_WITH_AS(kda::engine::KdaLayer(spec, 2, 3, bad),
                       doctest::Contains("layer 4 (KDA index 2): A_log[1]"), kda::Error);
  bad = good;
  bad.A_log[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(kda::engine::KdaLayer(spec, 0, 0, bad), doctest::Contains("A_log[0]"),
                       kda::Error);
  bad = good;
  bad.dt_bias[5] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH_AS(kda::engine::KdaLayer(spec, 0, 0, bad),
                       doctest::Contains("dt_bias[5] is not finite"), kda::Error);
}

TEST_CASE("backends: cpu always works / cuda without a device is kBackendUnavailable") {
  ModelSpec spec = spec_from(kSpec);
  spec.runtime.backend = kda::engine::BackendChoice::kAuto;
  if (kda::cuda_device_count() == 0) {
    CHECK(kda::engine::resolve_backend(spec, kda::engine::BackendChoice::kAuto) ==
          kda::Backend::kCpu);
    EngineOptions options;
    options.backend = kda::engine::BackendChoice::kCuda;
    try {
      Engine engine(spec, options);
      FAIL("expected kda::Error");
    } catch (const kda::Error& e) {
      CHECK(e.code() == kda::StatusCode::kBackendUnavailable);
    }
  }
  // head_dim 32 is not a CUDA problem, so auto stays on the CPU even with a GPU present.
  CHECK(kda::engine::resolve_backend(spec, kda::engine::BackendChoice::kAuto) ==
        kda::Backend::kCpu);
  CHECK(Engine(spec).backend() == kda::Backend::kCpu);
}
