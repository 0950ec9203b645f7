// kda-run's synthetic run (examples/synthetic_run.hpp): its untimed warm-up forward leaves every
// result as it would have been without it (outputs, recurrent and conv states of every slot), and
// each prefill layer is reported as it finishes. CPU backend; whole layers and cores.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kda/engine/engine.hpp"
#include "synthetic_run.hpp"

using kda::engine::Engine;
using kda::examples::RunOptions;
using kda::examples::RunReport;
using kda::examples::SyntheticInputs;

namespace {

std::string spec_text(const char* layers) {
  return std::string(
             "name: synthetic-run-test\n"
             "hidden_size: 64\n"
             "num_hidden_layers: 3\n"
             "linear_attn_config:\n"
             "  num_heads: 2\n"
             "  head_dim: 32\n"
             "  kda_layers: [1, 3]\n"
             "  full_attn_layers: [2]\n"
             "  gate: softplus\n"
             "runtime:\n"
             "  max_tokens: 64\n"
             "  max_sequences: 3\n"
             "  backend: cpu\n"
             "  layers: ") +
         layers + "\n";
}

// The run every case makes: 40 tokens of 3 sequences (SyntheticInputs of 40 rows), then
// `decode_steps` steps, its slots kept for collect().
RunOptions run_options(int decode_steps, std::uint64_t seed) {
  RunOptions options;
  options.tokens = 40;
  options.sequences = 3;
  options.decode_steps = decode_steps;
  options.seed = seed;
  options.release_slots = false;
  return options;
}

// What a run leaves behind: the output buffer it wrote last, and every state of every slot it used.
struct Results {
  std::vector<std::uint8_t> output;
  std::vector<std::vector<std::uint8_t>> states;
  RunReport report;
};

// The first `rows` rows of the output the run wrote last, and every state (recurrent, and conv
// with whole layers) of every layer in `slots`, into `r`.
void collect(const Engine& engine, const SyntheticInputs& inputs, std::size_t rows,
             const std::vector<int>& slots, Results* r) {
  const bool whole = engine.layer_mode() == kda::engine::LayerMode::kWhole;
  const std::size_t row_bytes =
      static_cast<std::size_t>(whole ? engine.spec().hidden_size
                                     : engine.spec().local_heads() * engine.spec().head_dim) *
      2;
  const void* written = whole ? inputs.hidden_output() : inputs.output();
  r->output.resize(rows * row_bytes);
  std::memcpy(r->output.data(), written, r->output.size());
  for (int l = 0; l < engine.num_layers(); ++l) {
    for (const int slot : slots) {
      std::vector<std::uint8_t> state(engine.state_slot_bytes());
      engine.read_slot_state(l, slot, state.data());
      r->states.push_back(state);
      if (!whole) continue;
      for (int projection = 0; projection < 3; ++projection) {
        std::vector<std::uint8_t> conv(engine.conv_state_slot_bytes());
        engine.read_slot_conv_state(l, slot, projection, conv.data());
        r->states.push_back(conv);
      }
    }
  }
}

Results run(const std::string& spec_yaml, bool warmup, int decode_steps) {
  Engine engine(kda::engine::parse_model_spec(spec_yaml, "synthetic-run-test.yaml"));
  const bool whole = engine.layer_mode() == kda::engine::LayerMode::kWhole;
  SyntheticInputs inputs(engine, 40);
  RunOptions options = run_options(decode_steps, 5);
  options.warmup = warmup;
  int layers_reported = 0;
  options.prefill_layer_done = [&](const RunReport& so_far) {
    ++layers_reported;
    CHECK(so_far.layer_seconds.size() == static_cast<std::size_t>(layers_reported));
    CHECK(so_far.layer_phases.size() == (whole ? so_far.layer_seconds.size() : 0u));
    CHECK((so_far.warmup_seconds > 0.0) == warmup);  // known by the first layer
  };
  int progress_calls = 0;
  options.progress = [&](int done, int total) {
    ++progress_calls;
    CHECK(done == progress_calls);
    CHECK(total == engine.num_layers() + decode_steps);
  };
  Results r;
  r.report = kda::examples::run_synthetic(engine, inputs, options);
  CHECK(layers_reported == engine.num_layers());
  CHECK(progress_calls == engine.num_layers() + decode_steps);  // the warm-up is not a step
  CHECK((r.report.warmup_seconds > 0.0) == warmup);

  // Every row the run wrote: the last layer's prefill, the first 3 overwritten by decode steps.
  collect(engine, inputs, 40, r.report.slots, &r);
  for (const int slot : r.report.slots) engine.release_slot(slot);
  return r;
}

}  // namespace

TEST_CASE("run_synthetic: the warm-up forward changes no result, only adds its own time") {
  for (const char* layers : {"whole", "core"}) {
    for (const int decode_steps : {0, 2}) {
      CAPTURE(layers);
      CAPTURE(decode_steps);
      const Results cold = run(spec_text(layers), /*warmup=*/false, decode_steps);
      const Results warm = run(spec_text(layers), /*warmup=*/true, decode_steps);
      CHECK(cold.report.warmup_seconds == 0.0);
      CHECK(warm.output == cold.output);
      REQUIRE(warm.states.size() == cold.states.size());
      for (std::size_t i = 0; i < warm.states.size(); ++i) {
        CAPTURE(i);
        CHECK(warm.states[i] == cold.states[i]);
      }
      CHECK(warm.report.slots == cold.report.slots);
      CHECK(warm.report.layer_seconds.size() == cold.report.layer_seconds.size());
      CHECK(warm.report.decode_step_seconds.size() == static_cast<std::size_t>(decode_steps));
    }
  }
}

namespace {

// Decode steps as verify steps of 3 tokens, in one form: the out rows of the last step, and each
// sequence's state (recurrent, and conv with whole layers) where the run says it is.
Results verify_run(const char* layers, kda::examples::VerifyForm form, int steps) {
  const std::string spec = spec_text(layers) +
                           "  max_verify_tokens: 3\n"
                           "  record_regions: 2\n";
  kda::engine::ModelSpec model = kda::engine::parse_model_spec(spec, "synthetic-run-test.yaml");
  model.runtime.max_sequences = 9;  // the per-token form: 3 slots a sequence
  Engine engine(model);
  SyntheticInputs inputs(engine, 40);
  RunOptions options = run_options(steps, 9);
  options.verify_tokens = 3;
  options.verify_form = form;
  Results r;
  r.report = kda::examples::run_synthetic(engine, inputs, options);
  REQUIRE(r.report.state_slots.size() == 3);
  collect(engine, inputs, 9, r.report.state_slots, &r);  // the last step's 3 x 3 rows
  return r;
}

}  // namespace

// The three verify forms through run_synthetic (kda-run --verify-tokens): per-token states,
// records with a commit after each step, and records folded into the next step leave every
// sequence in the same state, bit for bit, and write the same outs (CPU).
TEST_CASE("run_synthetic: verify steps in each form leave the same states and outs") {
  using kda::examples::VerifyForm;
  for (const char* layers : {"whole", "core"}) {
    CAPTURE(layers);
    const Results tokens = verify_run(layers, VerifyForm::kPerToken, 3);
    const Results records = verify_run(layers, VerifyForm::kRecords, 3);
    const Results fold = verify_run(layers, VerifyForm::kFold, 3);
    CHECK(tokens.report.decode_step_seconds.size() == 3u);
    CHECK(fold.report.decode_step_seconds.size() == 3u);
    CHECK(tokens.report.state_slots != tokens.report.slots);  // rows moved to their kept slots
    CHECK(fold.report.state_slots == fold.report.slots);
    CHECK(tokens.report.extra_slots.size() == 6u);  // 3 sequences x (3 - 1) more slots
    CHECK(fold.report.extra_slots.empty());
    CHECK(records.output == tokens.output);
    CHECK(fold.output == tokens.output);
    REQUIRE(fold.states.size() == tokens.states.size());
    for (std::size_t i = 0; i < tokens.states.size(); ++i) {
      CAPTURE(i);
      CHECK(records.states[i] == tokens.states[i]);
      CHECK(fold.states[i] == tokens.states[i]);
    }
  }
  // What the engine lacks is refused before anything runs.
  Engine plain(kda::engine::parse_model_spec(spec_text("whole"), "synthetic-run-test.yaml"));
  SyntheticInputs inputs(plain, 40);
  RunOptions options;
  options.tokens = 40;
  options.sequences = 3;
  options.decode_steps = 1;
  options.verify_tokens = 3;
  CHECK_THROWS_WITH(kda::examples::run_synthetic(plain, inputs, options),
                    "run_synthetic: records verify steps of 3 tokens need "
                    "runtime.max_verify_tokens >= 3 (it is 0)");
  options.verify_form = VerifyForm::kPerToken;
  CHECK_THROWS_WITH(kda::examples::run_synthetic(plain, inputs, options),
                    "run_synthetic: verify steps with per-token states keep 3 slots a sequence: 9 "
                    "slots, but 3 are free (runtime.max_sequences)");
  options.verify_tokens = 1;
  CHECK_THROWS_WITH(kda::examples::run_synthetic(plain, inputs, options),
                    "run_synthetic: verify_tokens 1, expected 0 or 2..16");
}
