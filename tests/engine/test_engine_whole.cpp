// The Engine running whole KDA layers (runtime.layers: whole, the default) on the backend matrix:
// against the CPU layer (kda::layer) called directly on the same weights — bitwise on the CPU,
// 1e-2 relative L2 on CUDA, on out and on every state — through prefill and decode steps with
// empty sequences and padding rows, every prefill schedule, weights in the arena's planned buffers;
// state round trips through the slots (prefill then decode = one longer prefill), fragmented slots,
// conv states zeroed on acquire / reset, tensor-parallel engines summing to the whole layer,
// weights from a checkpoint by their Hugging Face names, a layer case file's run, the layer's
// checks of its weight image region, and the errors. On the CPU alone: plans (reuse much smaller
// than sum; each layer's weights a persistent buffer), made without a device for both backends.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "case_file.hpp"
#include "engine_matrix.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"
#include "kda/layer/layer.hpp"
#include "kda/layer/weights.hpp"
#include "layer_test_util.hpp"
#include "temp_dir.hpp"

using kda::bf16_bits;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::ModelSpec;
using kda::test::allowed;
using kda::test::deviation;
using kda::test::Memory;
using kda::test::Runner;

namespace {

// Two KDA layers (model layers 1 and 3) of `heads` heads of `head_dim`, conv width 4.
std::string two_layer_spec(std::int64_t hidden, std::int64_t heads, std::int64_t head_dim) {
  auto line = [](const char* key, std::int64_t value) {
    return key + std::to_string(value) + "\n";
  };
  return "name: whole-test\n" + line("hidden_size: ", hidden) +
         "num_hidden_layers: 3\n"
         "rms_norm_eps: 1.0e-6\n"
         "linear_attn_config:\n" +
         line("  num_heads: ", heads) + line("  head_dim: ", head_dim) +
         "  short_conv_kernel_size: 4\n"
         "  kda_layers: [1, 3]\n"
         "  full_attn_layers: [2]\n"
         "  gate: softplus\n"
         "runtime:\n"
         "  max_tokens: 160\n"
         "  max_sequences: 4\n";
}
// head_dim 128: what the CUDA layer runs.
constexpr std::int64_t E = 256, H = 2, D = 128, W = 4;
const std::string kSpec = two_layer_spec(E, H, D);
constexpr std::uint64_t kSeed = 7;

ModelSpec spec_from(const std::string& text) {
  return kda::engine::parse_model_spec(text, "w.yaml");
}
ModelSpec spec_with(const std::string& runtime_lines) { return spec_from(kSpec + runtime_lines); }

EngineOptions options(const Runner& runner) { return kda::test::engine_options(runner, kSeed); }

std::vector<bf16_bits> random_hidden(std::int64_t tokens, std::uint64_t seed) {
  return kda::test::random_bf16(static_cast<std::size_t>(tokens * E), 1.0f, seed);
}

// Bytes of the plan's whole-layer weight images (layer{i}.weights).
std::uint64_t planned_weight_bytes(const kda::planner::MemoryPlan& plan) {
  const std::string suffix = ".weights";
  std::uint64_t bytes = 0;
  for (const auto& entry : plan.entries) {
    if (entry.name.size() > suffix.size() &&
        entry.name.compare(entry.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      bytes += entry.bytes;
    }
  }
  return bytes;
}

// One slot's whole state of one layer.
struct SlotState {
  std::vector<bf16_bits> conv[3];
  std::vector<float> recurrent;
};

SlotState read_state(const Engine& engine, int layer, int slot) {
  SlotState s;
  for (int p = 0; p < 3; ++p) {
    s.conv[p].resize(engine.conv_state_slot_bytes() / 2);
    engine.read_slot_conv_state(layer, slot, p, s.conv[p].data());
  }
  s.recurrent.resize(engine.state_slot_bytes() / 4);
  engine.read_slot_state(layer, slot, s.recurrent.data());
  return s;
}

bool all_zero(const SlotState& s) {
  for (const auto& conv : s.conv) {
    for (const bf16_bits v : conv) {
      if (v != 0) return false;
    }
  }
  for (const float v : s.recurrent) {
    if (v != 0.0f) return false;
  }
  return true;
}

// The largest deviation of `a` from `b` over the conv states and the recurrent state.
double state_deviation(const SlotState& a, const SlotState& b) {
  double worst = deviation(a.recurrent, b.recurrent);
  for (int p = 0; p < 3; ++p) worst = std::max(worst, deviation(a.conv[p], b.conv[p]));
  return worst;
}

// The CPU layer called directly, with host pools of `slots` rows: the reference the engine must
// match (the engine runs the same layer on its arena's buffers).
struct Direct {
  std::unique_ptr<kda::layer::Layer> layer;
  std::int64_t slots;
  std::vector<bf16_bits> conv[3];
  std::vector<float> recurrent;
  std::vector<std::uint8_t> workspace;

  Direct(const kda::layer::Weights& weights, std::int64_t num_slots)
      : layer(kda::layer::make_layer(kda::Backend::kCpu, weights)), slots(num_slots) {
    const kda::layer::Config& c = weights.config;
    for (auto& pool : conv) {
      pool.assign(static_cast<std::size_t>(num_slots * c.local_channels() * (c.conv_width - 1)), 0);
    }
    recurrent.assign(
        static_cast<std::size_t>(num_slots * c.local_heads() * c.head_dim * c.head_dim), 0.0f);
    workspace.resize(kda::layer::workspace_bytes(kda::Backend::kCpu, c, 160, num_slots, num_slots));
  }
  // A prefill (decode_tokens 0: cu_seqlens lay the sequences out) or a decode batch of
  // decode_tokens tokens per row; negative slots are padding.
  std::vector<bf16_bits> forward(const std::vector<std::int64_t>& cu,
                                 const std::vector<std::int32_t>& slot_list,
                                 const std::vector<bf16_bits>& x, std::int64_t decode_tokens = 0) {
    const kda::layer::State state{slots,          conv[0].data(),   conv[1].data(),
                                  conv[2].data(), recurrent.data(), kda::DType::kF32};
    kda::layer::Batch batch;
    batch.sequences = static_cast<std::int64_t>(slot_list.size());
    batch.tokens = decode_tokens > 0 ? batch.sequences * decode_tokens : cu.back();
    batch.decode_tokens = decode_tokens;
    batch.cu_seqlens = decode_tokens > 0 ? nullptr : cu.data();
    batch.slots = slot_list.data();
    kda::layer::RunOptions run;
    run.cpu_threads = 2;
    std::vector<bf16_bits> out(static_cast<std::size_t>(batch.tokens * E), 0x7fc0);
    layer->forward(batch, x.data(), out.data(), state,
                   kda::Workspace{workspace.data(), workspace.size()}, run);
    return out;
  }
  SlotState row(std::int64_t slot) const {
    SlotState s;
    const std::size_t conv_row = conv[0].size() / static_cast<std::size_t>(slots);
    const std::size_t state_row = recurrent.size() / static_cast<std::size_t>(slots);
    for (int p = 0; p < 3; ++p) {
      s.conv[p].assign(conv[p].begin() + static_cast<std::ptrdiff_t>(slot * conv_row),
                       conv[p].begin() + static_cast<std::ptrdiff_t>((slot + 1) * conv_row));
    }
    s.recurrent.assign(recurrent.begin() + static_cast<std::ptrdiff_t>(slot * state_row),
                       recurrent.begin() + static_cast<std::ptrdiff_t>((slot + 1) * state_row));
    return s;
  }
};

// Hidden states of a layer's output on a runner's backend, poisoned (a NaN) before the call.
Memory poisoned(const Runner& runner, std::int64_t tokens) {
  return Memory::from(runner, std::vector<bf16_bits>(static_cast<std::size_t>(tokens * E), 0x7fc0));
}
std::vector<bf16_bits> result(const Engine& engine, const Memory& out) {
  engine.synchronize();
  return out.download<bf16_bits>();
}

}  // namespace

KDA_MATRIX_CASE(
    "whole layers: prefill_hidden and decode_hidden equal the layer called directly, phases "
    "timed, weights in the arena") {
  const ModelSpec spec = spec_from(kSpec);
  CHECK(spec.runtime.layer_mode == kda::engine::LayerMode::kWhole);  // the default
  CHECK(spec.rms_norm_eps == doctest::Approx(1e-6));
  Engine engine(spec, options(runner));
  REQUIRE(engine.backend() == runner.backend());
  REQUIRE(engine.layer_mode() == kda::engine::LayerMode::kWhole);
  CHECK(engine.weights_origin() == "random (seed 7)");
  CHECK(engine.conv_state_slot_bytes() == static_cast<std::uint64_t>(H * D * (W - 1) * 2));
  // The weights are the arena's: one planned buffer per layer holding the backend's weight image
  // (fp32 on the CPU, bf16 on CUDA), all of weight_bytes().
  CHECK(engine.plan().to_json() == Engine::plan_for(spec, runner.backend()).to_json());
  const std::uint64_t image =
      kda::layer::weight_image_bytes(runner.backend(), kda::engine::layer_config(spec));
  for (const char* name : {"layer1.weights", "layer3.weights"}) {
    CAPTURE(name);
    const kda::planner::PlanEntry* weights = engine.plan().find(name);
    REQUIRE(weights != nullptr);
    CHECK(weights->bytes == image);
  }
  CHECK(engine.weight_bytes() == planned_weight_bytes(engine.plan()));
  CHECK(engine.weight_bytes() == 2 * image);

  for (int i = 0; i < 4; ++i) engine.acquire_slot();
  const std::vector<std::int64_t> cu = {0, 70, 70, 71, 150};  // an empty and a 1-token sequence
  const std::vector<std::int32_t> slots = {2, 0, 3, 1};
  const std::vector<int> engine_slots(slots.begin(), slots.end());
  const std::vector<bf16_bits> x = random_hidden(150, 1);
  const Memory hidden = Memory::from(runner, x);
  std::vector<Direct> direct;
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    const int index = spec.kda_layer_indices[static_cast<std::size_t>(l)];
    direct.emplace_back(kda::layer::random_weights(kda::engine::layer_config(spec), kSeed, index),
                        4);
    const std::vector<bf16_bits> expected = direct.back().forward(cu, slots, x);
    Memory out = poisoned(runner, 150);
    kda::layer::Times times;
    engine.prefill_hidden(l, hidden.get(), out.get(), engine_slots, cu, &times);
    CHECK(deviation(result(engine, out), expected) <= allowed(runner, 1e-2));
    CHECK(out.guards_intact());
    CHECK(times.projections > 0.0);
    CHECK(times.core > 0.0);
    CHECK(times.o_proj > 0.0);
    for (const int slot : engine_slots) {
      CAPTURE(slot);
      CHECK(state_deviation(read_state(engine, l, slot), direct.back().row(slot)) <=
            allowed(runner, 1e-2));
    }
    CHECK_FALSE(all_zero(read_state(engine, l, 2)));
  }
  // Decode: 3 steps of 2 tokens on rows {1, pad, 2, 0}; a padding row's out is zeros.
  const std::vector<std::int32_t> rows = {1, -1, 2, 0};
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const std::vector<bf16_bits> y = random_hidden(8, 10 + static_cast<std::uint64_t>(step));
    const Memory step_in = Memory::from(runner, y);
    for (int l = 0; l < engine.num_layers(); ++l) {
      CAPTURE(l);
      Memory step_out = poisoned(runner, 8);
      engine.decode_hidden(l, step_in.get(), step_out.get(), {1, -1, 2, 0}, 2);
      const std::vector<bf16_bits> got = result(engine, step_out);
      const std::vector<bf16_bits> expected =
          direct[static_cast<std::size_t>(l)].forward({}, rows, y, 2);
      CHECK(deviation(got, expected) <= allowed(runner, 1e-2));
      CHECK(kda::test::rows_of(got, E, 2, 4) == std::vector<bf16_bits>(2 * E, 0));
    }
  }
  CHECK_NOTHROW(engine.check_device_status());
  for (int l = 0; l < engine.num_layers(); ++l) {
    for (const int slot : {0, 1, 2, 3}) {
      CAPTURE(l);
      CAPTURE(slot);
      CHECK(state_deviation(read_state(engine, l, slot), direct[static_cast<std::size_t>(l)].row(
                                                             slot)) <= allowed(runner, 1e-2));
    }
  }
}

KDA_MATRIX_CASE("whole layers: every prefill schedule equals the layer called directly") {
  // EngineOptions::prefill_schedule reaches the core: one 150-token sequence (10 chunks, which
  // kAuto keeps two-phase on CUDA) run two-phase and pipelined. The CPU has one schedule.
  const ModelSpec spec = spec_from(kSpec);
  const std::vector<std::int64_t> cu = {0, 150};
  const std::vector<bf16_bits> x = random_hidden(150, 9);
  Direct direct(
      kda::layer::random_weights(kda::engine::layer_config(spec), kSeed, spec.kda_layer_indices[0]),
      4);
  const std::vector<bf16_bits> expected = direct.forward(cu, {0}, x);
  const Memory hidden = Memory::from(runner, x);
  for (const kda::PrefillSchedule schedule :
       {kda::PrefillSchedule::kTwoPhase, kda::PrefillSchedule::kPipelined}) {
    const std::string schedule_name = kda::to_string(schedule);
    CAPTURE(schedule_name);
    EngineOptions o = options(runner);
    o.prefill_schedule = schedule;
    Engine engine(spec, o);
    CHECK(engine.spec().runtime.prefill_schedule == schedule);
    engine.acquire_slot();
    Memory out = poisoned(runner, 150);
    engine.prefill_hidden(0, hidden.get(), out.get(), {0}, cu);
    CHECK(deviation(result(engine, out), expected) <= allowed(runner, 1e-2));
    CHECK(state_deviation(read_state(engine, 0, 0), direct.row(0)) <= allowed(runner, 1e-2));
  }
}

KDA_MATRIX_CASE(
    "whole layers: prefill then decode steps equal one longer prefill, conv and recurrent") {
  Engine engine(spec_from(kSpec), options(runner));
  const int chunked = engine.acquire_slot(), whole = engine.acquire_slot();
  const Memory x = Memory::from(runner, random_hidden(17, 2));
  const bf16_bits* in = x.as<bf16_bits>();
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    Memory expected = poisoned(runner, 17), out = poisoned(runner, 17);
    bf16_bits* o = out.as<bf16_bits>();
    engine.prefill_hidden(l, in, expected.get(), {whole}, {0, 17});
    // 12 tokens, three one-token steps, one two-token step.
    engine.prefill_hidden(l, in, o, {chunked}, {0, 12});
    for (std::int64_t t = 12; t < 15; ++t) {
      engine.decode_hidden(l, in + t * E, o + t * E, {chunked}, 1);
    }
    engine.decode_hidden(l, in + 15 * E, o + 15 * E, {chunked}, 2);
    CHECK(deviation(result(engine, out), result(engine, expected)) <= allowed(runner, 1e-2, 1e-3));
    const SlotState a = read_state(engine, l, chunked), b = read_state(engine, l, whole);
    for (int p = 0; p < 3; ++p) CHECK(deviation(a.conv[p], b.conv[p]) <= allowed(runner, 1e-2));
    CHECK(deviation(a.recurrent, b.recurrent) <= allowed(runner, 1e-2, 1e-5));
  }
}

KDA_MATRIX_CASE(
    "whole layers: every decode step (EngineOptions::decode_step) computes the same steps") {
  // A prefill of 12 tokens, then four one-token steps, one engine per choice; on CUDA each picks
  // the layer's kernels (auto: one launch a step), the CPU has one way. An unknown value throws.
  const ModelSpec spec = spec_from(kSpec);
  const Memory x = Memory::from(runner, random_hidden(16, 5));
  const bf16_bits* in = x.as<bf16_bits>();
  std::vector<std::vector<bf16_bits>> outs;
  for (const kda::layer::DecodeKernel step :
       {kda::layer::DecodeKernel::kSeparate, kda::layer::DecodeKernel::kAuto,
        kda::layer::DecodeKernel::kOneLaunch, kda::layer::DecodeKernel::kFusedFactors,
        kda::layer::DecodeKernel::kFused}) {
    const std::string step_name = kda::layer::to_string(step);
    CAPTURE(step_name);
    EngineOptions o = options(runner);
    o.decode_step = step;
    Engine engine(spec, o);
    CHECK(engine.spec().runtime.decode_step == step);
    const int slot = engine.acquire_slot();
    Memory out = poisoned(runner, 16);
    bf16_bits* dst = out.as<bf16_bits>();
    engine.prefill_hidden(0, in, dst, {slot}, {0, 12});
    CHECK(engine.decode_step_ran(0) == kda::layer::DecodeKernel::kAuto);  // no decode yet
    for (std::int64_t t = 12; t < 16; ++t)
      engine.decode_hidden(0, in + t * E, dst + t * E, {slot}, 1);
    outs.push_back(result(engine, out));
    CHECK(deviation(outs.back(), outs.front()) <= allowed(runner, 1e-2, 0.0));
    // The kernel layer 0's steps ran (a one-token step of one row: the one launch where asked
    // for or left to auto); the CPU and layer 1, which decoded nothing, report none.
    const kda::layer::DecodeKernel ran = engine.decode_step_ran(0);
    const std::string ran_name = kda::layer::to_string(ran);
    CAPTURE(ran_name);
    if (runner.backend() == kda::Backend::kCuda) {
      const bool one_launch =
          step == kda::layer::DecodeKernel::kAuto || step == kda::layer::DecodeKernel::kOneLaunch;
      CHECK(ran == (one_launch ? kda::layer::DecodeKernel::kOneLaunch : step));
    } else {
      CHECK(ran == kda::layer::DecodeKernel::kAuto);
    }
    CHECK(engine.decode_step_ran(1) == kda::layer::DecodeKernel::kAuto);
    CHECK_THROWS_WITH_AS(engine.decode_step_ran(2),
                         doctest::Contains("KDA layer 2 is out of range"), kda::Error);
  }
  EngineOptions bad = options(runner);
  bad.decode_step = static_cast<kda::layer::DecodeKernel>(9);
  CHECK_THROWS_WITH_AS(Engine(spec, bad), doctest::Contains("EngineOptions::decode_step is 9"),
                       kda::Error);
}

// EngineOptions::poison_arena fills the arena before anything is written into it, and each
// layer's workspace before every call (every other case here runs with it on): an engine with it
// and one without compute the same bits, a prefill of two sequences on fragmented slots and a
// decode step with a padding row, their outputs and both layers' states; the padding row's out is
// zeros.
KDA_MATRIX_CASE("whole layers: a poisoned arena changes no output and no state") {
  EngineOptions plain = options(runner);
  plain.poison_arena = false;
  EngineOptions poisoned_arena = options(runner);
  REQUIRE(poisoned_arena.poison_arena);
  Engine a(spec_from(kSpec), plain), b(spec_from(kSpec), poisoned_arena);
  for (int i = 0; i < 4; ++i) {
    REQUIRE(a.acquire_slot() == i);
    REQUIRE(b.acquire_slot() == i);
  }
  const Memory x = Memory::from(runner, random_hidden(14, 11));
  const Memory step = Memory::from(runner, random_hidden(3, 12));
  REQUIRE(a.num_layers() == 2);
  std::vector<bf16_bits> outs[2][2][2];  // [engine][layer][prefill, decode]
  Engine* engines[2] = {&a, &b};
  for (int e = 0; e < 2; ++e) {
    for (int l = 0; l < 2; ++l) {
      Memory prefill_out = poisoned(runner, 14), step_out = poisoned(runner, 3);
      engines[e]->prefill_hidden(l, x.get(), prefill_out.get(), {3, 1}, {0, 9, 14});
      engines[e]->decode_hidden(l, step.get(), step_out.get(), {1, -1, 3}, 1);
      outs[e][l][0] = result(*engines[e], prefill_out);
      outs[e][l][1] = result(*engines[e], step_out);
    }
  }
  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    CHECK(outs[0][l][0] == outs[1][l][0]);
    CHECK(outs[0][l][1] == outs[1][l][1]);
    CHECK(kda::test::rows_of(outs[1][l][1], E, 1, 2) == std::vector<bf16_bits>(E, 0));
  }
  for (int l = 0; l < a.num_layers(); ++l) {
    for (const int slot : {0, 1, 2, 3}) {
      CAPTURE(l);
      CAPTURE(slot);
      const SlotState sa = read_state(a, l, slot), sb = read_state(b, l, slot);
      CHECK(sa.recurrent == sb.recurrent);
      for (int p = 0; p < 3; ++p) CHECK(sa.conv[p] == sb.conv[p]);
    }
  }
}

KDA_MATRIX_CASE("whole layers: fragmented slots and padding rows equal the same sequences alone") {
  // Bitwise on the CPU; on CUDA the same to 1e-3 (the GEMMs' shapes differ).
  Engine engine(spec_from(kSpec), options(runner));
  for (int i = 0; i < 4; ++i) engine.acquire_slot();
  const Memory x = Memory::from(runner, random_hidden(14, 3));
  const bf16_bits* in = x.as<bf16_bits>();
  // One batch on slots 3 and 1 against each sequence alone on slots 0 and 2.
  Memory batch = poisoned(runner, 14), alone = poisoned(runner, 14);
  engine.prefill_hidden(0, in, batch.get(), {3, 1}, {0, 9, 14});
  engine.prefill_hidden(0, in, alone.get(), {0}, {0, 9});
  engine.prefill_hidden(0, in + 9 * E, alone.as<bf16_bits>() + 9 * E, {2}, {0, 5});
  CHECK(deviation(result(engine, batch), result(engine, alone)) <= allowed(runner, 1e-3));
  CHECK(state_deviation(read_state(engine, 0, 3), read_state(engine, 0, 0)) <=
        allowed(runner, 1e-3));
  CHECK(state_deviation(read_state(engine, 0, 1), read_state(engine, 0, 2)) <=
        allowed(runner, 1e-3));

  // Decode: rows {3, pad, 1} against rows {0, 2}; the padding row's state is no slot's, its out
  // zeros.
  const std::vector<bf16_bits> step = random_hidden(3, 4);
  std::vector<bf16_bits> packed_in(step.begin(), step.begin() + E);
  packed_in.insert(packed_in.end(), step.begin() + 2 * E, step.end());
  const Memory step_in = Memory::from(runner, step),
               packed_step_in = Memory::from(runner, packed_in);
  Memory padded = poisoned(runner, 3), packed = poisoned(runner, 2);
  engine.decode_hidden(0, step_in.get(), padded.get(), {3, -1, 1}, 1);
  engine.decode_hidden(0, packed_step_in.get(), packed.get(), {0, 2}, 1);
  const std::vector<bf16_bits> p = result(engine, padded), q = result(engine, packed);
  CHECK(deviation(kda::test::rows_of(p, E, 0, 1), kda::test::rows_of(q, E, 0, 1)) <=
        allowed(runner, 1e-3));
  CHECK(deviation(kda::test::rows_of(p, E, 2, 3), kda::test::rows_of(q, E, 1, 2)) <=
        allowed(runner, 1e-3));
  CHECK(kda::test::rows_of(p, E, 1, 2) == std::vector<bf16_bits>(E, 0));
  CHECK(state_deviation(read_state(engine, 0, 3), read_state(engine, 0, 0)) <=
        allowed(runner, 1e-3));
  CHECK(state_deviation(read_state(engine, 0, 1), read_state(engine, 0, 2)) <=
        allowed(runner, 1e-3));
}

KDA_MATRIX_CASE(
    "whole layers: a slot's conv and recurrent states are zeroed on acquire and reset") {
  Engine engine(spec_from(kSpec), options(runner));
  int slot = engine.acquire_slot();
  const Memory x = Memory::from(runner, random_hidden(6, 5));
  Memory out = poisoned(runner, 6);
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill_hidden(l, x.get(), out.get(), {slot}, {0, 6});
  }
  CHECK_FALSE(all_zero(read_state(engine, 1, slot)));
  engine.reset_slot(slot);
  for (int l = 0; l < engine.num_layers(); ++l) CHECK(all_zero(read_state(engine, l, slot)));
  engine.prefill_hidden(0, x.get(), out.get(), {slot}, {0, 6});
  engine.release_slot(slot);
  slot = engine.acquire_slot();  // the same slot again
  CHECK(all_zero(read_state(engine, 0, slot)));
  // Written conv states are what the next call starts from.
  SlotState s = read_state(engine, 0, slot);
  s.conv[1][5] = kda::float_to_bf16(1.5f);
  engine.write_slot_conv_state(0, slot, 1, s.conv[1].data());
  CHECK(read_state(engine, 0, slot).conv[1][5] == kda::float_to_bf16(1.5f));
}

KDA_MATRIX_CASE(
    "whole layers: the tp_size = 2 engines' outputs, summed, equal the tp_size = 1 engine") {
  Engine full(spec_from(kSpec), options(runner));
  Engine rank0(spec_with("  tp_size: 2\n  tp_rank: 0\n"), options(runner));
  Engine rank1(spec_with("  tp_size: 2\n  tp_rank: 1\n"), options(runner));
  CHECK(rank0.spec().local_heads() == H / 2);
  CHECK(rank1.state_slot_bytes() * 2 == full.state_slot_bytes());
  CHECK(rank1.conv_state_slot_bytes() * 2 == full.conv_state_slot_bytes());
  const Memory x = Memory::from(runner, random_hidden(20, 6));
  const bf16_bits* in = x.as<bf16_bits>();
  Memory expected = poisoned(runner, 16), part0 = poisoned(runner, 16),
         part1 = poisoned(runner, 16);
  // The first `tokens` rows of the three outputs.
  auto check_sum = [&](std::int64_t tokens) {
    const auto a = kda::test::rows_of(result(rank0, part0), E, 0, tokens);
    const auto b = kda::test::rows_of(result(rank1, part1), E, 0, tokens);
    std::vector<bf16_bits> sum(a.size());
    for (std::size_t i = 0; i < sum.size(); ++i) {
      sum[i] = kda::float_to_bf16(kda::bf16_to_float(a[i]) + kda::bf16_to_float(b[i]));
    }
    CHECK(deviation(sum, kda::test::rows_of(result(full, expected), E, 0, tokens)) <=
          allowed(runner, 1e-2, 5e-3));
  };
  Engine* engines[3] = {&full, &rank0, &rank1};
  for (Engine* e : engines) e->acquire_slot();
  for (int l = 0; l < full.num_layers(); ++l) {
    CAPTURE(l);
    full.prefill_hidden(l, in, expected.get(), {0}, {0, 16});
    rank0.prefill_hidden(l, in, part0.get(), {0}, {0, 16});
    rank1.prefill_hidden(l, in, part1.get(), {0}, {0, 16});
    check_sum(16);
    full.decode_hidden(l, in + 16 * E, expected.get(), {0}, 4);
    rank0.decode_hidden(l, in + 16 * E, part0.get(), {0}, 4);
    rank1.decode_hidden(l, in + 16 * E, part1.get(), {0}, 4);
    check_sum(4);
  }
}

KDA_MATRIX_CASE("whole layers: weights from the YAML's checkpoint by their Hugging Face names") {
  kda::test::TempDir dir;
  const ModelSpec plain = spec_from(kSpec);
  std::vector<kda::engine::Tensor> tensors;
  std::vector<kda::layer::Weights> weights;
  for (const int index : plain.kda_layer_indices) {
    weights.push_back(kda::layer::random_weights(kda::engine::layer_config(plain), 99, index));
    for (auto& t : kda::engine::layer_weight_tensors(weights.back(),
                                                     kda::engine::layer_tensor_prefix(index))) {
      tensors.push_back(std::move(t));
    }
  }
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  std::ofstream(dir.file("m.yaml")) << kSpec << "weights: model.safetensors\n";
  Engine engine(kda::engine::load_model_spec(dir.file("m.yaml")), options(runner));
  CHECK(engine.weights_origin().find("model.safetensors") != std::string::npos);
  const int slot = engine.acquire_slot();
  const std::vector<bf16_bits> x = random_hidden(9, 8);
  const Memory hidden = Memory::from(runner, x);
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    Direct direct(weights[static_cast<std::size_t>(l)], 4);
    const std::vector<bf16_bits> expected = direct.forward({0, 9}, {slot}, x);
    Memory out = poisoned(runner, 9);
    engine.prefill_hidden(l, hidden.get(), out.get(), {slot}, {0, 9});
    CHECK(deviation(result(engine, out), expected) <= allowed(runner, 1e-2));
    // The core reads the same A_log / dt_bias.
    CHECK(engine.layer(l).A_log == weights[static_cast<std::size_t>(l)].A_log);
    CHECK(engine.layer(l).dt_bias == weights[static_cast<std::size_t>(l)].dt_bias);
  }
  // A folder holding model.safetensors is a checkpoint too.
  std::ofstream(dir.file("d.yaml")) << kSpec << "weights: .\n";
  CHECK_NOTHROW(Engine(kda::engine::load_model_spec(dir.file("d.yaml")), options(runner)));

  // A tensor missing from the checkpoint is named, with the model file.
  tensors.erase(std::find_if(tensors.begin(), tensors.end(), [](const kda::engine::Tensor& t) {
    return t.name == "model.layers.2.self_attn.o_proj.weight";
  }));
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  const std::string message = kda::test::error_of(
      [&] { Engine broken(kda::engine::load_model_spec(dir.file("m.yaml")), options(runner)); });
  CHECK(message.find("m.yaml") != std::string::npos);
  CHECK(message.find("model.layers.2.self_attn.o_proj.weight") != std::string::npos);
}

KDA_MATRIX_CASE("whole layers: a layer case file's run equals the layer called directly") {
  kda::layer::Config config;
  config.hidden_size = E;
  config.num_heads = H;
  config.head_dim = D;
  kda::engine::LayerCase lc;
  lc.source = "in-memory case";
  lc.weights = kda::layer::random_weights(config, 9, 0);
  lc.tokens = 33;
  lc.sequences = 2;
  lc.cu_seqlens = {0, 20, 33};
  lc.hidden = kda::engine::Tensor::zeros("hidden_states", kda::DType::kBF16, {33, E});
  const std::vector<bf16_bits> x = random_hidden(33, 3);
  std::memcpy(lc.hidden.data.data(), x.data(), lc.hidden.data.size());
  kda::Backend used = kda::Backend::kCpu;
  const auto got = kda::engine::run_layer_case(lc, kda::test::backend_choice(runner), &used);
  CHECK(used == runner.backend());
  Direct direct(lc.weights, 2);
  const std::vector<bf16_bits> out = direct.forward(lc.cu_seqlens, {0, 1}, x);
  // out, conv_state_q, conv_state_k, conv_state_v [N, C, W-1], recurrent_state [N, H, V, K].
  REQUIRE(got.size() == 5);
  auto values = [](const kda::engine::Tensor& t, auto element) {
    std::vector<decltype(element)> v(t.data.size() / sizeof(element));
    std::memcpy(v.data(), t.data.data(), t.data.size());
    return v;
  };
  CHECK(got[0].name == "out");
  CHECK(deviation(values(got[0], bf16_bits{}), out) <= allowed(runner, 1e-2));
  for (int p = 0; p < 3; ++p) {
    CAPTURE(got[1 + p].name);
    CHECK(deviation(values(got[1 + p], bf16_bits{}), direct.conv[p]) <= allowed(runner, 1e-2));
  }
  CHECK(got[4].name == "recurrent_state");
  REQUIRE(got[4].dtype == kda::DType::kF32);
  CHECK(deviation(values(got[4], float{}), direct.recurrent) <= allowed(runner, 1e-2));
}

KDA_CPU_CASE("whole layers: the plan holds conv states, and reuse is much smaller than sum") {
  // Planned without a device, for both backends.
  const ModelSpec spec = spec_from(kSpec);
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    const std::string backend_name = kda::to_string(backend);
    CAPTURE(backend_name);
    const kda::planner::MemoryPlan plan = Engine::plan_for(spec, backend);
    REQUIRE(plan.find("layer3.conv_v") != nullptr);
    CHECK(plan.find("layer3.conv_v")->bytes == 4u * H * D * (W - 1) * 2);
  }

  ModelSpec kimi = kda::engine::load_model_spec(std::string(KDA_SOURCE_DIR) +
                                                "/examples/models/kimi-linear-48b-a3b.yaml");
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    const std::string backend_name = kda::to_string(backend);
    CAPTURE(backend_name);
    kimi.runtime.workspace_plan = kda::planner::PlanMode::kSum;
    const auto sum = Engine::plan_for(kimi, backend);
    kimi.runtime.workspace_plan = kda::planner::PlanMode::kReuse;
    const auto reuse = Engine::plan_for(kimi, backend);
    int states = 0, workspaces = 0;
    for (const auto& entry : sum.entries) {
      states += entry.kind == kda::planner::BufferKind::kState;
      workspaces += entry.kind == kda::planner::BufferKind::kWorkspace;
    }
    CHECK(states == 80);  // 20 layers: recurrent, conv q, k, v
    CHECK(workspaces == 20);
    // The weights are persistent: reuse cannot share them, only the rest.
    const std::uint64_t weights = planned_weight_bytes(sum);
    CHECK(weights == planned_weight_bytes(reuse));
    MESSAGE("kimi-linear-48b whole layers on " << std::string(kda::to_string(backend)) << ": sum "
                                               << sum.arena_bytes << " bytes, reuse "
                                               << reuse.arena_bytes << " bytes, weights " << weights
                                               << " bytes of both");
    CHECK((reuse.arena_bytes - weights) * 8 < sum.arena_bytes - weights);
  }
}

KDA_CPU_CASE(
    "whole layers: each layer's weights are a persistent buffer of the plan, CPU and CUDA") {
  // Planned without a device, as kda-run --plan-only does.
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    for (const char* runtime : {"  workspace_plan: sum\n", "  workspace_plan: reuse\n",
                                "  workspace_plan: reuse\n  tp_size: 2\n  tp_rank: 1\n"}) {
      const std::string backend_name = kda::to_string(backend);
      CAPTURE(backend_name);
      CAPTURE(runtime);
      const ModelSpec spec = spec_with(runtime);
      const kda::planner::MemoryPlan plan = Engine::plan_for(spec, backend);
      const std::uint64_t image =
          kda::layer::weight_image_bytes(backend, kda::engine::layer_config(spec));
      const std::uint64_t alignment = kda::layer::weight_image_alignment(backend);
      for (const char* name : {"layer1.weights", "layer3.weights"}) {
        CAPTURE(name);
        const kda::planner::PlanEntry* weights = plan.find(name);
        REQUIRE(weights != nullptr);
        CHECK(weights->kind == kda::planner::BufferKind::kParameter);
        CHECK(weights->persistent);
        CHECK(weights->bytes == image);
        CHECK(weights->offset % alignment == 0);
        CHECK(weights->offset + weights->bytes <= plan.arena_bytes);
        for (const auto& other : plan.entries) {  // in reuse mode too: never shared
          if (other.name == weights->name) continue;
          CAPTURE(other.name);
          CHECK((other.offset + other.bytes <= weights->offset ||
                 weights->offset + weights->bytes <= other.offset));
        }
      }
      CHECK(planned_weight_bytes(plan) == 2 * image);
    }
  }
  // A tensor-parallel rank holds its heads only: a smaller image.
  kda::layer::Config shard = kda::engine::layer_config(spec_from(kSpec));
  const std::size_t whole_image = kda::layer::weight_image_bytes(kda::Backend::kCuda, shard);
  shard.tp_size = 2;
  CHECK(kda::layer::weight_image_bytes(kda::Backend::kCuda, shard) < whole_image);
}

KDA_MATRIX_CASE(
    "whole layers: the layer refuses a weight image region that is null, misaligned or too "
    "small") {
  const kda::layer::Config config = kda::engine::layer_config(spec_from(kSpec));
  const kda::layer::Weights weights = kda::layer::random_weights(config, 1, 0);
  const kda::Backend backend = runner.backend();
  const std::string what = backend == kda::Backend::kCuda ? "KDA layer (CUDA)" : "KDA layer (CPU)";
  const std::size_t needed = kda::layer::weight_image_bytes(backend, config);
  const std::size_t alignment = kda::layer::weight_image_alignment(backend);
  CHECK(needed % alignment == 0);
  Memory memory(runner, needed + alignment);
  // The first `alignment`-aligned byte of `memory`.
  auto aligned_in = [](const Memory& m, std::size_t alignment) {
    const auto address = reinterpret_cast<std::uintptr_t>(m.get());
    return m.as<unsigned char>() + ((address + alignment - 1) / alignment * alignment - address);
  };
  unsigned char* aligned = aligned_in(memory, alignment);
  auto refusal = [&](void* region, std::size_t bytes) {
    return kda::test::weight_region_refusal(backend, weights, region, bytes);
  };
  CHECK(refusal(aligned, needed - 1) ==
        what + ": the weight image region is too small: " + std::to_string(needed - 1) +
            " bytes, the layer's weights need " + std::to_string(needed) + " (weight_image_bytes)");
  CHECK(refusal(aligned + alignment / 2, needed) ==
        what + ": the weight image region is not " + std::to_string(alignment) + "-byte aligned");
  CHECK(refusal(nullptr, needed) == what + ": the weight image region is null");
  // A good region takes the image, and nothing outside it is written.
  CHECK_NOTHROW(kda::layer::make_layer(backend, weights, aligned, needed));
  CHECK(memory.guards_intact());
  if (backend == kda::Backend::kCpu && kda::cuda_device_count() == 0) {
    // A good region for the CUDA layer (host memory standing in for the device's): then the device
    // is what is missing.
    const std::size_t cuda_needed = kda::layer::weight_image_bytes(kda::Backend::kCuda, config);
    const std::size_t cuda_alignment = kda::layer::weight_image_alignment(kda::Backend::kCuda);
    const Memory host(runner, cuda_needed + cuda_alignment);
    try {
      (void)kda::layer::make_layer(kda::Backend::kCuda, weights, aligned_in(host, cuda_alignment),
                                   cuda_needed);
      FAIL("a CUDA layer constructed without a device");
    } catch (const kda::Error& e) {
      CHECK(e.code() == kda::StatusCode::kBackendUnavailable);
    }
  }
}

KDA_MATRIX_CASE("whole layers: bad calls and bad settings are refused with a clear message") {
  Engine engine(spec_from(kSpec), options(runner));
  const int slot = engine.acquire_slot();
  const Memory x = Memory::from(runner, random_hidden(4, 9));
  const std::vector<bf16_bits> untouched(static_cast<std::size_t>(4 * E), 0x1234);
  Memory out = Memory::from(runner, untouched);
  CHECK_THROWS_WITH_AS(engine.prefill_hidden(0, x.get(), out.get(), {3}, {0, 4}),
                       doctest::Contains("prefill_hidden: sequence 0 uses slot 3"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.decode_hidden(0, x.get(), out.get(), {slot}, 17),
                       doctest::Contains("decode_hidden: tokens 17"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill_hidden(0, nullptr, out.get(), {slot}, {0, 4}),
                       doctest::Contains("hidden is null"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill_hidden(2, x.get(), out.get(), {slot}, {0, 4}),
                       doctest::Contains("KDA layer 2 is out of range"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.read_slot_conv_state(0, slot, 0, nullptr),
                       doctest::Contains("read_slot_conv_state: the host buffer is null"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(engine.write_slot_conv_state(0, slot, 1, nullptr),
                       doctest::Contains("write_slot_conv_state: the host buffer is null"),
                       kda::Error);
  CHECK(result(engine, out) == untouched);
  CHECK(all_zero(read_state(engine, 0, slot)));
  // The core alone still runs on a whole-layer engine (its recurrent states).
  const Memory qkvg = Memory::from(runner, std::vector<std::uint16_t>(4 * H * D, 0x3f80)),
               beta = Memory::from(runner, std::vector<std::uint16_t>(4 * H, 0));
  Memory core_out(runner, 4 * H * D * 2);
  engine.prefill(0, {qkvg.get(), qkvg.get(), qkvg.get(), qkvg.get(), beta.get()}, core_out.get(),
                 {slot}, {0, 4});
  CHECK_FALSE(all_zero(read_state(engine, 0, slot)));

  // A core-only engine has no hidden-state calls; tensor parallelism needs whole layers.
  Engine core(spec_with("  layers: core\n"), options(runner));
  CHECK(core.layer_mode() == kda::engine::LayerMode::kCoreOnly);
  CHECK(core.plan().find("layer1.conv_q") == nullptr);
  CHECK(core.weight_bytes() == 0);
  core.acquire_slot();
  CHECK_THROWS_WITH_AS(core.prefill_hidden(0, x.get(), out.get(), {0}, {0, 4}),
                       doctest::Contains("runtime.layers: core"), kda::Error);
  EngineOptions core_tp = options(runner);
  core_tp.layer_mode = kda::engine::LayerMode::kCoreOnly;
  CHECK_THROWS_WITH_AS(Engine(spec_with("  tp_size: 2\n"), core_tp),
                       doctest::Contains("runtime.tp_size 2 needs whole layers"), kda::Error);
  // A conv width of 1 keeps no conv state: whole layers refuse it by name (the plan too), the
  // cores alone run.
  ModelSpec width_one = spec_from(kSpec);
  width_one.short_conv_kernel_size = 1;
  CHECK_THROWS_WITH_AS(Engine(width_one, options(runner)),
                       doctest::Contains("short_conv_kernel_size 1 leaves no conv state"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(Engine::plan_for(width_one, runner.backend()),
                       doctest::Contains("short_conv_kernel_size 1"), kda::Error);
  EngineOptions width_one_core = options(runner);
  width_one_core.layer_mode = kda::engine::LayerMode::kCoreOnly;
  CHECK(Engine(width_one, width_one_core).layer_mode() == kda::engine::LayerMode::kCoreOnly);
  // The schedule in effect: the YAML's, unless EngineOptions sets one.
  CHECK(Engine(spec_from(kSpec), options(runner)).spec().runtime.prefill_schedule ==
        kda::PrefillSchedule::kAuto);
  CHECK(Engine(spec_with("  prefill_schedule: two-phase\n"), options(runner))
            .spec()
            .runtime.prefill_schedule == kda::PrefillSchedule::kTwoPhase);
  EngineOptions pipelined = options(runner);
  pipelined.prefill_schedule = kda::PrefillSchedule::kPipelined;
  CHECK(Engine(spec_with("  prefill_schedule: two-phase\n"), pipelined)
            .spec()
            .runtime.prefill_schedule == kda::PrefillSchedule::kPipelined);
  EngineOptions bad_schedule = options(runner);
  bad_schedule.prefill_schedule = static_cast<kda::PrefillSchedule>(9);
  CHECK_THROWS_WITH_AS(Engine(spec_from(kSpec), bad_schedule),
                       doctest::Contains("EngineOptions::prefill_schedule is 9"), kda::Error);
}
