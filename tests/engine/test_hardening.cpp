// Hardening of the engine on the CPU backend (label `cpu`; two engines in two threads:
// test_engine_threads.cpp, both backends): byte counts that overflow 64 bits are a kda::Error
// (from the YAML loader, the engine constructor and the planner), never a crash or a huge
// allocation; a prefill or decode that breaks the runtime limits (max_tokens, max_sequences, tokens
// per step) throws before writing anything. docs/VALIDATION.md lists every check.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda_reference.hpp"
#include "synthetic_run.hpp"

using kda::engine::BackendChoice;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;
using kda::engine::ModelSpec;

namespace {

std::string tiny_path() { return std::string(KDA_SOURCE_DIR) + "/examples/models/tiny.yaml"; }

EngineOptions cpu_options(std::uint64_t seed) {
  EngineOptions o;
  o.backend = BackendChoice::kCpu;
  o.seed = seed;
  o.cpu_threads = 2;  // each engine threads internally too, so the threads really interleave
  return o;
}

// A slot's state in every layer, as raw bytes.
std::vector<std::uint8_t> all_layer_states(const Engine& e, int slot) {
  const std::size_t bytes = static_cast<std::size_t>(e.state_slot_bytes());
  std::vector<std::uint8_t> states(bytes * e.num_layers());
  for (int l = 0; l < e.num_layers(); ++l) e.read_slot_state(l, slot, states.data() + bytes * l);
  return states;
}

// Runs `call`, which must throw kda::Error with `code`; returns its message ("" when it did not).
template <typename Call>
std::string expect_error(Call call, kda::StatusCode code) {
  try {
    call();
  } catch (const kda::Error& e) {
    CHECK_MESSAGE(e.code() == code, "code " << kda::to_string(e.code()) << ": " << e.what());
    return e.what();
  }
  FAIL_CHECK("no kda::Error was thrown");
  return std::string();
}

std::string with_runtime_value(std::string yaml, const std::string& key, const std::string& value) {
  const std::string needle = "  " + key + ": ";
  const auto at = yaml.find(needle);
  REQUIRE(at != std::string::npos);
  const auto end = yaml.find('\n', at);
  yaml.replace(at, end - at, needle + value);
  return yaml;
}

std::string tiny_yaml() {
  // tiny.yaml's text, so that a variant can be parsed from a string (same schema, same numbers).
  return "name: tiny-kda\n"
         "hidden_size: 512\n"
         "num_hidden_layers: 4\n"
         "linear_attn_config:\n"
         "  num_heads: 4\n"
         "  head_dim: 128\n"
         "  kda_layers: [1, 2, 3]\n"
         "  full_attn_layers: [4]\n"
         "  gate: lower_bound\n"
         "  gate_lower_bound: -5.0\n"
         "runtime:\n"
         "  max_tokens: 2048\n"
         "  max_sequences: 4\n"
         "  state_dtype: fp32\n"
         "  workspace_plan: reuse\n"
         "  backend: auto\n";
}

}  // namespace

TEST_CASE(
    "overflow: YAML sizes whose byte counts overflow 64 bits are a kda::Error naming the key") {
  {  // Inputs at max_tokens: 2^62 x 4 heads x 128 x 2 bytes.
    const std::string yaml = with_runtime_value(tiny_yaml(), "max_tokens", "4611686018427387904");
    const std::string message = expect_error(
        [&] { kda::engine::parse_model_spec(yaml, "huge.yaml"); }, kda::StatusCode::kOverflow);
    CHECK(message.find("huge.yaml:") == 0);
    CHECK(message.find("runtime.max_tokens") != std::string::npos);
    CHECK(message.find("overflows 64 bits") != std::string::npos);
  }
  {  // State pools: 2^20 slots x 1024 heads x 1024^2 x 4 bytes x 4096 layers = 2^64.
    std::string layers;
    for (int i = 1; i <= 4096; ++i) layers += (i == 1 ? "" : ", ") + std::to_string(i);
    const std::string yaml =
        "hidden_size: 4096\n"
        "num_hidden_layers: 4096\n"
        "linear_attn_config:\n"
        "  num_heads: 1024\n"
        "  head_dim: 1024\n"
        "  kda_layers: [" +
        layers +
        "]\n"
        "  gate: softplus\n"
        "runtime:\n"
        "  max_tokens: 1\n"
        "  max_sequences: 1048576\n";
    const std::string message = expect_error(
        [&] { kda::engine::parse_model_spec(yaml, "pools.yaml"); }, kda::StatusCode::kOverflow);
    CHECK(message.find("runtime.max_sequences") != std::string::npos);
    CHECK(message.find("overflow 64 bits") != std::string::npos);
  }
  {  // The bound is exact: inputs and outputs (6 x T x 4 heads x 128 x 2 bytes = 6144 T) plus the
    // state pools (4 slots x 4 x 128^2 x 4 bytes x 3 layers = 3145728) fit in 2^64 - 1 bytes for
    // T = 3002399751579818 and not for one token more.
    CHECK_NOTHROW(kda::engine::parse_model_spec(
        with_runtime_value(tiny_yaml(), "max_tokens", "3002399751579818"), "edge.yaml"));
    expect_error(
        [&] {
          kda::engine::parse_model_spec(
              with_runtime_value(tiny_yaml(), "max_tokens", "3002399751579819"), "edge.yaml");
        },
        kda::StatusCode::kOverflow);
  }
}

TEST_CASE("overflow: an engine whose sizes overflow fails with kda::Error and allocates nothing") {
  const ModelSpec tiny = kda::engine::parse_model_spec(tiny_yaml(), "tiny.yaml");
  EngineOptions options;
  options.backend = BackendChoice::kCpu;
  {  // A spec edited past the loader's checks: the operator's size checks still catch it.
    ModelSpec spec = tiny;
    spec.runtime.max_tokens = std::numeric_limits<std::int64_t>::max() / 2;
    const std::string message =
        expect_error([&] { Engine e(spec, options); }, kda::StatusCode::kOverflow);
    CHECK(message.find("tiny-kda on cpu") != std::string::npos);
    CHECK(message.find("overflows 64-bit sizes") != std::string::npos);
  }
  {  // Synthetic inputs (examples/synthetic_run.hpp) for 2^60 tokens.
    const Engine engine(tiny, options);
    const std::string message =
        expect_error([&] { kda::examples::SyntheticInputs inputs(engine, std::int64_t{1} << 60); },
                     kda::StatusCode::kOverflow);
    CHECK(message.find("synthetic inputs") != std::string::npos);
  }
  {  // Valid for the loader (inputs fit in 64 bits), but more 16-token chunks at max_tokens than a
    // CUDA grid holds (and a CUDA workspace past 64 bits): the CUDA plan refuses it, even on a
    // machine without a GPU (a build with CUDA or without).
    const std::string yaml = with_runtime_value(
        with_runtime_value(tiny_yaml(), "max_tokens", "10000000000000"), "max_sequences", "8");
    std::string wide = yaml;
    wide.replace(wide.find("num_heads: 4"), 12, "num_heads: 1024");
    const ModelSpec spec = kda::engine::parse_model_spec(wide, "wide.yaml");
    const std::string message = expect_error([&] { Engine::plan_for(spec, kda::Backend::kCuda); },
                                             kda::StatusCode::kUnsupported);
    CHECK(message.find("the CUDA backend cannot run this model: prefill: the CUDA backend runs at "
                       "most 2147483647 16-token chunk slots") != std::string::npos);
    // The CPU core's workspace does not grow with the tokens: the same spec plans there with
    // core-only layers; a whole layer's intermediates do grow, and overflow the same way.
    ModelSpec core = spec;
    core.runtime.layer_mode = kda::engine::LayerMode::kCoreOnly;
    CHECK(Engine::plan_for(core, kda::Backend::kCpu).arena_bytes > 0);
    CHECK(expect_error([&] { Engine::plan_for(spec, kda::Backend::kCpu); },
                       kda::StatusCode::kOverflow)
              .find("workspace") != std::string::npos);
  }
}

TEST_CASE("a spec edited past the loader with tp_size, tp_rank or bounds out of range is refused") {
  const ModelSpec tiny = kda::engine::parse_model_spec(tiny_yaml(), "tiny.yaml");
  EngineOptions options;
  options.backend = BackendChoice::kCpu;
  for (const auto& [size, rank] : {std::pair<int, int>{0, 0}, {-2, 0}, {3, 0}, {2, 2}, {2, -1}}) {
    CAPTURE(size);
    CAPTURE(rank);
    ModelSpec spec = tiny;  // 4 heads
    spec.runtime.tp_size = size;
    spec.runtime.tp_rank = rank;
    const std::string expected =
        size < 1 || 4 % size != 0
            ? "tiny.yaml: runtime.tp_size " + std::to_string(size) +
                  " does not divide linear_attn_config.num_heads 4 (each rank holds num_heads / "
                  "tp_size heads)"
            : "tiny.yaml: runtime.tp_rank " + std::to_string(rank) + " is not in [0, tp_size " +
                  std::to_string(size) + ")";
    CHECK(expect_error([&] { Engine e(spec, options); }, kda::StatusCode::kInvalidArgument) ==
          expected);
    CHECK(expect_error([&] { Engine::plan_for(spec, kda::Backend::kCpu); },
                       kda::StatusCode::kInvalidArgument) == expected);
  }
  for (const std::int64_t tokens : {std::int64_t{0}, std::int64_t{-1}}) {
    ModelSpec spec = tiny;
    spec.runtime.max_tokens = tokens;
    CHECK(expect_error([&] { Engine e(spec, options); }, kda::StatusCode::kInvalidArgument) ==
          "tiny.yaml: runtime.max_tokens " + std::to_string(tokens) + " is below 1");
  }
  for (const std::int64_t sequences : {std::int64_t{0}, std::int64_t{-1}, std::int64_t{1} << 31}) {
    ModelSpec spec = tiny;
    spec.runtime.max_sequences = sequences;
    CHECK(expect_error([&] { Engine::plan_for(spec, kda::Backend::kCpu); },
                       kda::StatusCode::kInvalidArgument) ==
          "tiny.yaml: runtime.max_sequences " + std::to_string(sequences) +
              " is not in [1, 2147483647] (slots are int indices)");
  }
  // The records' sizes: the constructor and plan_for refuse alike (a wrapped size had planned a
  // records region too small for the steps the engine then ran).
  struct RecordsCase {
    std::int64_t regions, verify_tokens;
    std::string expected;
  };
  const std::int64_t huge = (std::int64_t{1} << 55) + 1,
                     most = std::numeric_limits<std::int64_t>::max();
  const RecordsCase records_cases[] = {
      {0, 0, "runtime.record_regions is 0, expected 1 or 2"},
      {-1, 0, "runtime.record_regions is -1, expected 1 or 2"},
      {3, 0, "runtime.record_regions is 3, expected 1 or 2"},
      {1000000, 0, "runtime.record_regions is 1000000, expected 1 or 2"},
      {1, -1, "runtime.max_verify_tokens is -1, expected 0..16"},
      {1, 17, "runtime.max_verify_tokens is 17, expected 0..16"},
      {1, huge, "runtime.max_verify_tokens is " + std::to_string(huge) + ", expected 0..16"},
      {1, most, "runtime.max_verify_tokens is " + std::to_string(most) + ", expected 0..16"},
  };
  for (const RecordsCase& c : records_cases) {
    ModelSpec spec = tiny;
    spec.runtime.record_regions = static_cast<int>(c.regions);
    spec.runtime.max_verify_tokens = c.verify_tokens;
    CHECK(expect_error([&] { Engine e(spec, options); }, kda::StatusCode::kInvalidArgument) ==
          "tiny.yaml: " + c.expected);
    CHECK(expect_error([&] { Engine::plan_for(spec, kda::Backend::kCpu); },
                       kda::StatusCode::kInvalidArgument) == "tiny.yaml: " + c.expected);
  }
  // The KDA layers: tiny's are model layers 0, 1, 2 of 4.
  REQUIRE(tiny.kda_layer_indices == std::vector<int>{0, 1, 2});
  for (const std::vector<int>& indices :
       {std::vector<int>{0, 0, 2}, {-5, 1, 2}, {0, 2, 1}, {0, 1, 4}}) {
    ModelSpec spec = tiny;
    spec.kda_layer_indices = indices;
    spec.kda_layers.clear();
    CHECK(
        expect_error([&] { Engine::plan_for(spec, kda::Backend::kCpu); },
                     kda::StatusCode::kInvalidArgument)
            .find("expected ascending model layers in [0, num_hidden_layers 4) without repeats") !=
        std::string::npos);
  }
  {
    ModelSpec spec = tiny;
    spec.kda_layer_indices = {0};
    CHECK(expect_error([&] { Engine e(spec, options); }, kda::StatusCode::kInvalidArgument) ==
          "tiny.yaml: kda_layers (1-based) and kda_layer_indices (0-based) name different layers");
  }
  {
    ModelSpec spec = tiny;
    options.cpu_threads = -4;
    CHECK(expect_error([&] { Engine e(spec, options); }, kda::StatusCode::kInvalidArgument) ==
          "tiny.yaml: EngineOptions::cpu_threads is -4, expected >= 0 (0: all cores)");
    options.cpu_threads = 0;
  }
}

TEST_CASE("limits: prefill past max_tokens or decode past its limits throws and writes nothing") {
  const ModelSpec spec = kda::engine::load_model_spec(tiny_path());
  REQUIRE(spec.runtime.max_tokens == 2048);
  REQUIRE(spec.runtime.max_sequences == 4);
  EngineOptions options;
  options.backend = BackendChoice::kCpu;
  options.seed = 41;
  options.cpu_threads = 2;
  Engine engine(spec, options);
  const std::int64_t H = spec.num_heads, D = spec.head_dim, T = spec.runtime.max_tokens + 1;

  // Inputs for one token more than max_tokens.
  kda::test::Rng rng(41);
  const std::vector<std::uint16_t> q = kda::test::random_bf16(rng, T * H * D, 1.0),
                                   k = kda::test::random_bf16(rng, T * H * D, 1.0),
                                   v = kda::test::random_bf16(rng, T * H * D, 1.0),
                                   g = kda::test::random_bf16(rng, T * H * D, 1.0),
                                   beta = kda::test::random_bf16(rng, T * H, 1.0);
  const LayerInputs in{q.data(), k.data(), v.data(), g.data(), beta.data()};

  // Two slots with a non-zero state, so that "untouched" means something.
  const std::vector<int> slots = {engine.acquire_slot(), engine.acquire_slot()};
  std::vector<std::uint16_t> warm(static_cast<std::size_t>(64 * H * D));
  for (int l = 0; l < engine.num_layers(); ++l)
    engine.prefill(l, in, warm.data(), slots, {0, 30, 64});
  const std::vector<std::uint8_t> state0 = all_layer_states(engine, slots[0]);
  const std::vector<std::uint8_t> state1 = all_layer_states(engine, slots[1]);

  std::vector<std::uint16_t> out(static_cast<std::size_t>(T * H * D), kda::test::kPoisonBf16);
  auto untouched = [&] {
    for (const std::uint16_t x : out) {
      if (x != kda::test::kPoisonBf16) return false;
    }
    return all_layer_states(engine, slots[0]) == state0 &&
           all_layer_states(engine, slots[1]) == state1;
  };

  {  // One sequence of max_tokens + 1 tokens.
    const std::string message = expect_error(
        [&] {
          engine.prefill(0, in, out.data(), {slots[0]}, {0, T});
        },
        kda::StatusCode::kInvalidArgument);
    CHECK(message.find("2049 tokens exceed runtime.max_tokens 2048") != std::string::npos);
  }
  {  // Two sequences that together exceed max_tokens, on the last layer.
    const std::string message = expect_error(
        [&] {
          engine.prefill(engine.num_layers() - 1, in, out.data(), slots, {0, 1500, T});
        },
        kda::StatusCode::kInvalidArgument);
    CHECK(message.find("max_tokens") != std::string::npos);
  }
  // More sequences than max_sequences.
  expect_error(
      [&] {
        engine.prefill(0, in, out.data(), {0, 1, 2, 3, 0}, {0, 1, 2, 3, 4, 5});
      },
      kda::StatusCode::kInvalidArgument);
  // Decode: 17 tokens per step, 5 rows, an unacquired slot, a slot named twice.
  const std::string m17 = expect_error([&] { engine.decode(0, in, out.data(), slots, 17); },
                                       kda::StatusCode::kInvalidArgument);
  CHECK(m17.find("tokens 17") != std::string::npos);
  expect_error(
      [&] {
        engine.decode(0, in, out.data(), {slots[0], -1, -1, -1, -1}, 1);
      },
      kda::StatusCode::kInvalidArgument);
  const std::string free_slot = expect_error(
      [&] {
        engine.decode(0, in, out.data(), {slots[0], 3}, 1);
      },
      kda::StatusCode::kInvalidArgument);
  CHECK(free_slot.find("not an acquired slot") != std::string::npos);
  const std::string twice = expect_error(
      [&] {
        engine.decode(0, in, out.data(), {slots[1], slots[1]}, 1);
      },
      kda::StatusCode::kInvalidArgument);
  CHECK(twice.find("appears twice") != std::string::npos);
  // A total far past max_tokens is refused by that bound, not by the sizes it would imply.
  CHECK(expect_error(
            [&] {
              engine.prefill(0, in, out.data(), {slots[0]},
                             {0, std::numeric_limits<std::int64_t>::max()});
            },
            kda::StatusCode::kInvalidArgument)
            .find("9223372036854775807 tokens exceed runtime.max_tokens 2048") !=
        std::string::npos);
  // Spans of entries without their data (a null pointer with a count).
  using kda::engine::Span;
  CHECK(expect_error(
            [&] {
              engine.prefill(0, in, out.data(), Span<const int>(nullptr, 1), {0, 2});
            },
            kda::StatusCode::kInvalidArgument) == "prefill: slots is null but has 1 entries");
  CHECK(expect_error(
            [&] {
              engine.prefill_hidden(0, q.data(), out.data(), {slots[0]},
                                    Span<const std::int64_t>(nullptr, 2));
            },
            kda::StatusCode::kInvalidArgument)
            .find("cu_seqlens is null but has 2 entries") != std::string::npos);
  CHECK(expect_error([&] { engine.decode(0, in, out.data(), Span<const int>(nullptr, 2), 1); },
                     kda::StatusCode::kInvalidArgument) ==
        "decode: slots is null but has 2 entries");
  CHECK(
      expect_error(
          [&] { engine.copy_slots(Span<const int>(slots.data(), 1), Span<const int>(nullptr, 1)); },
          kda::StatusCode::kInvalidArgument) == "copy_slots: dst is null but has 1 entries");
  CHECK(expect_error(
            [&] {
              engine.copy_slots(Span<const int>(slots.data(), SIZE_MAX),
                                Span<const int>(slots.data(), SIZE_MAX));
            },
            kda::StatusCode::kInvalidArgument)
            .find(std::to_string(SIZE_MAX) + " pairs, expected 0..4") != std::string::npos);
  CHECK(untouched());

  // The engine is still usable afterwards: a prefill at exactly max_tokens works.
  engine.reset_slot(slots[0]);
  engine.prefill(0, in, out.data(), {slots[0]}, {0, T - 1});
  CHECK(kda::test::all_finite(std::vector<std::uint16_t>(out.begin(), out.end() - H * D)));
}
