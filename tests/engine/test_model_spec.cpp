// Model descriptions: the example models (YAML, and the Hugging Face config.json as is) parse;
// every kind of bad input is an error that names the file, line, column and key; unknown keys in
// the engine's sections are warnings with a suggested spelling, or errors in strict mode.
#include <doctest/doctest.h>

#include <chrono>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "kda/engine/error.hpp"
#include "kda/engine/model_spec.hpp"

namespace fs = std::filesystem;
using kda::engine::ModelSpec;
using kda::engine::parse_model_spec;

namespace {

// Line numbers matter: tests below point at "m.yaml:LINE:COLUMN".
const char* const kValid =
    "name: test-model\n"             // 1
    "hidden_size: 256\n"             // 2
    "num_hidden_layers: 6\n"         // 3
    "linear_attn_config:\n"          // 4
    "  num_heads: 4\n"               // 5
    "  head_dim: 64\n"               // 6
    "  short_conv_kernel_size: 4\n"  // 7
    "  kda_layers: [1, 2, 4, 5]\n"   // 8
    "  full_attn_layers: [3, 6]\n"   // 9
    "  gate: lower_bound\n"          // 10
    "  gate_lower_bound: -5.0\n"     // 11
    "runtime:\n"                     // 12
    "  max_tokens: 4096\n"           // 13
    "  max_sequences: 4\n"           // 14
    "  state_dtype: bf16\n"          // 15
    "  workspace_plan: reuse\n"      // 16
    "  backend: cpu\n";              // 17

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE_MESSAGE(at != std::string::npos, "test setup: '" << from << "' not in the YAML");
  text.replace(at, from.size(), to);
  return text;
}

// Parses `text` expecting kda::Error; returns its message (empty when nothing was thrown).
std::string error_of(const std::string& text, kda::StatusCode* code = nullptr) {
  try {
    parse_model_spec(text, "m.yaml");
  } catch (const kda::Error& e) {
    if (code != nullptr) *code = e.code();
    return e.what();
  }
  return {};
}

void check_error(const std::string& text, std::initializer_list<const char*> parts) {
  const std::string message = error_of(text);
  INFO("message: " << message);
  REQUIRE_FALSE(message.empty());
  CHECK(message.rfind("m.yaml", 0) == 0);
  for (const char* part : parts) CHECK(message.find(part) != std::string::npos);
}

// The message of the kda::Error that parsing `text` as `source` throws (empty when none is).
std::string error_in(const std::string& source, const std::string& text) {
  try {
    parse_model_spec(text, source);
  } catch (const kda::Error& e) {
    return e.what();
  }
  return {};
}

fs::path temp_dir(const char* tag) {
  std::random_device random;
  const fs::path dir =
      fs::temp_directory_path() / ("kda-test-" + std::string(tag) + "-" + std::to_string(random()));
  fs::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("a valid description parses into the spec it describes") {
  const ModelSpec spec = parse_model_spec(kValid, "dir/test.yaml");
  CHECK(spec.name == "test-model");
  CHECK(spec.source == "dir/test.yaml");
  CHECK(spec.hidden_size == 256);
  CHECK(spec.num_hidden_layers == 6);
  CHECK(spec.num_heads == 4);
  CHECK(spec.head_dim == 64);
  CHECK(spec.short_conv_kernel_size == 4);
  CHECK(spec.kda_layers == std::vector<int>{1, 2, 4, 5});
  CHECK(spec.kda_layer_indices == std::vector<int>{0, 1, 3, 4});
  CHECK(spec.full_attn_layers == std::vector<int>{3, 6});
  CHECK(spec.gate == kda::GateMode::kLowerBound);
  CHECK(spec.gate_lower_bound == -5.0f);
  CHECK(spec.weights.empty());
  CHECK(spec.runtime.max_tokens == 4096);
  CHECK(spec.runtime.max_sequences == 4);
  CHECK(spec.runtime.state_dtype == kda::DType::kBF16);
  CHECK(spec.runtime.workspace_plan == kda::planner::PlanMode::kReuse);
  CHECK(spec.runtime.backend == kda::engine::BackendChoice::kCpu);
  CHECK(spec.state_slot_bytes() == 4u * 64 * 64 * 2);
}

TEST_CASE("defaults: runtime section / name / short conv kernel / full attention layers") {
  const std::string text =
      "hidden_size: 64\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 2, head_dim: 16, kda_layers: [2, 1], gate: softplus}\n";
  const ModelSpec spec = parse_model_spec(text, "models/my-model.yaml");
  CHECK(spec.name == "my-model");
  CHECK(spec.kda_layers == std::vector<int>{1, 2});  // sorted: layers run in model order
  CHECK(spec.full_attn_layers.empty());
  CHECK(spec.short_conv_kernel_size == 4);
  CHECK(spec.runtime.max_tokens == 8192);
  CHECK(spec.runtime.max_sequences == 8);
  CHECK(spec.runtime.state_dtype == kda::DType::kF32);
  CHECK(spec.runtime.workspace_plan == kda::planner::PlanMode::kReuse);
  CHECK(spec.runtime.backend == kda::engine::BackendChoice::kAuto);
  CHECK(spec.runtime.prefill_schedule == kda::PrefillSchedule::kAuto);
  // An empty runtime section means defaults too.
  CHECK(parse_model_spec(text + "runtime:\n", "m.yaml").runtime.max_sequences == 8);
}

TEST_CASE("extra keys: silent at the top level, warnings inside the engine's sections") {
  std::string text = kValid;
  text = replace(text, "hidden_size: 256\n",
                 "hidden_size: 256\nmodel_type: kimi_linear\nrope_theta: 10000.0\n"
                 "moe: {num_experts: 256, top_k: 8}\nvocab: [a, b]\n");
  CHECK(parse_model_spec(text, "m.yaml").warnings.empty());

  text = replace(text, "  head_dim: 64\n", "  head_dim: 64\n  unknown_knob: true\n");
  text = replace(text, "  backend: cpu\n", "  backend: cpu\n  comment: hello\n");
  const ModelSpec spec = parse_model_spec(text, "m.yaml");
  CHECK(spec.num_heads == 4);
  CHECK(spec.runtime.backend == kda::engine::BackendChoice::kCpu);
  REQUIRE(spec.warnings.size() == 2);
  // Nothing close: the warning lists the keys that section knows.
  CHECK(spec.warnings[0] ==
        "m.yaml:11:3: linear_attn_config.unknown_knob: unknown key, ignored; known keys here: "
        "num_heads, head_dim, short_conv_kernel_size, kda_layers, full_attn_layers, gate, "
        "gate_lower_bound, use_full_rank_gate");
  CHECK(spec.warnings[1].rfind("m.yaml:23:3: runtime.comment: unknown key, ignored; known keys "
                               "here: max_tokens,",
                               0) == 0);
}

TEST_CASE("typos in the engine's sections: a warning with the spelling meant") {
  const ModelSpec spec = parse_model_spec(
      replace(replace(kValid, "  max_sequences: 4\n", "  max_sequences: 4\n  max_token: 16\n"),
              "  short_conv_kernel_size: 4\n", "  short_conv_kernal_size: 4\n"),
      "m.yaml");
  REQUIRE(spec.warnings.size() == 2);
  CHECK(spec.warnings[0] ==
        "m.yaml:7:3: linear_attn_config.short_conv_kernal_size: unknown key, ignored; did you "
        "mean `short_conv_kernel_size`?");
  CHECK(spec.warnings[1] ==
        "m.yaml:15:3: runtime.max_token: unknown key, ignored; did you mean `max_tokens`?");
  // The misspelt values are not used: the defaults and the other values stand.
  CHECK(spec.short_conv_kernel_size == 4);
  CHECK(spec.runtime.max_tokens == 4096);

  // Case, '-' for '_' and swapped letters count as one edit each.
  for (const char* typo : {"Max_Tokens", "max-tokens", "mxa_tokens", "max_tokesn"}) {
    CAPTURE(typo);
    const ModelSpec typed = parse_model_spec(
        replace(kValid, "  max_tokens: 4096\n", std::string("  ") + typo + ": 4096\n"), "m.yaml");
    REQUIRE(typed.warnings.size() == 1);
    CHECK(typed.warnings[0].find("did you mean `max_tokens`?") != std::string::npos);
    CHECK(typed.runtime.max_tokens == 8192);  // the default: the misspelt key is ignored
  }
  // A top-level key within a typo of an engine key that is absent warns too; other top-level
  // keys stay silent, and so does a near-miss of an engine key that is present.
  const ModelSpec top =
      parse_model_spec(replace(kValid, "runtime:\n", "hidden_sizes: 3\nruntme:\n"), "m.yaml");
  REQUIRE(top.warnings.size() == 1);
  CHECK(top.warnings[0] == "m.yaml:13:1: runtme: unknown key, ignored; did you mean `runtime`?");
  CHECK(top.runtime.max_tokens == 8192);  // the misspelt section is not read
  const ModelSpec weights =
      parse_model_spec(std::string(kValid) + "weight: w.safetensors\n", "m.yaml");
  REQUIRE(weights.warnings.size() == 1);
  CHECK(weights.warnings[0].find("weight: unknown key, ignored; did you mean `weights`?") !=
        std::string::npos);
}

TEST_CASE("text after the description (a second document, more after a JSON object) is refused") {
  for (const std::string& text :
       {kValid + std::string("---\nmodel:\n  hidden_size: 8\n"),
        std::string(R"({"model": {"hidden_size": 64}} {"model": {"hidden_size": "x"}})"),
        std::string(R"({"model": {"hidden_size": 64}} garbage)")}) {
    CAPTURE(text);
    CHECK_THROWS_WITH_AS(parse_model_spec(text, "m.yaml"),
                         doctest::Contains("text after the model description (a second YAML "
                                           "document, or more after the JSON object's end)"),
                         kda::Error);
  }
}

TEST_CASE("texts yaml-cpp's LoadAll never returned from are refused, and promptly") {
  // Found by fuzz_model_spec: yaml-cpp 0.7's LoadAll kept taking empty documents from these.
  for (const char* text : {", 1",
                           " , 1",
                           "# c\n,x",
                           "\"x\", 1",
                           "'x', 1",
                           "[1], 2",
                           "{a: 1}, 2",
                           "--- , 1",
                           "a: 1\n---\n, 2",
                           "&a , 1",
                           "!t , 1",
                           "- x\n, 2",
                           "{\"model\": {\"hidden_size\": 64}}, 2",
                           "{&a}, 2",
                           "[!t], 2",
                           "!\"x\" , 1",
                           "!'x', 1",
                           "|\n x\n, 1",
                           "!ds\": 3\",",
                           "{:\nx},",
                           "{a: E\n'\nb},",
                           "\"\"z\n?\n",
                           "&:,"}) {
    CAPTURE(text);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(parse_model_spec(text, "m.yaml"), kda::Error);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  }
  // Commas inside plain scalars, quoted scalars and comments are text.
  for (const char* name : {"\", test\"", "', x'", "test, model", "test , model", "layers.{i}, x"}) {
    CAPTURE(name);
    const std::string text = "# a, b\n" + replace(kValid, "test-model", name);
    CHECK(error_of(text) == "");
  }
}

TEST_CASE("a description string holding a control character is refused where it stands") {
  // yaml-cpp stops reading at a zero byte, and did not return from others in a tag.
  CHECK_THROWS_WITH_AS(parse_model_spec(std::string("{\n\0 \"a\": 1},\n", 12), "m.yaml"),
                       "m.yaml:2:1: holds a control character (byte 0x00), not YAML or JSON text",
                       kda::Error);
  CHECK_THROWS_WITH_AS(parse_model_spec("!'\x13t\x07x{\"\n,++,p\n", "m.yaml"),
                       "m.yaml:1:3: holds a control character (byte 0x13), not YAML or JSON text",
                       kda::Error);
  // Tabs and carriage returns are text.
  CHECK(error_of(std::string(kValid) + "\t\r\n").find("control character") == std::string::npos);
}

TEST_CASE("YAML nested past the reader's depth limit says so") {
  const std::string deep = "model: " + std::string(600, '[') + std::string(600, ']') + "\n";
  CHECK_THROWS_WITH_AS(parse_model_spec(deep, "m.yaml"),
                       doctest::Contains("YAML nested deeper than the reader takes (about 500 "
                                         "levels)"),
                       kda::Error);
}

TEST_CASE("strict mode: an unknown key in the engine's sections is an error") {
  kda::engine::ModelSpecOptions strict;
  strict.strict = true;
  const std::string typo = replace(kValid, "  max_tokens: 4096\n", "  max_token: 4096\n");
  CHECK_THROWS_WITH_AS(parse_model_spec(typo, "m.yaml", "", strict),
                       "m.yaml:13:3: runtime.max_token: unknown key; did you mean `max_tokens`? "
                       "(strict mode: unknown keys are errors)",
                       kda::Error);
  CHECK_THROWS_WITH_AS(
      parse_model_spec(replace(kValid, "  head_dim: 64\n", "  head_dim: 64\n  knob: 1\n"), "m.yaml",
                       "", strict),
      doctest::Contains("m.yaml:7:3: linear_attn_config.knob: unknown key; known keys here: "),
      kda::Error);
  // Top-level keys of a Hugging Face config stay silent in strict mode too.
  const ModelSpec spec =
      parse_model_spec(replace(kValid, "hidden_size: 256\n", "hidden_size: 256\nrope_theta: 1.0\n"),
                       "m.yaml", "", strict);
  CHECK(spec.warnings.empty());
  CHECK(spec.hidden_size == 256);
  // load_model_spec takes the option too.
  const fs::path dir = temp_dir("strict");
  const fs::path yaml = dir / "m.yaml";
  std::ofstream(yaml) << typo;
  CHECK(kda::engine::load_model_spec(yaml.string()).warnings.size() == 1);
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(yaml.string(), strict),
                       doctest::Contains("did you mean `max_tokens`?"), kda::Error);
  fs::remove_all(dir);
}

TEST_CASE("a missing required key names the near-miss found in its place, at its line") {
  // `num_head` for `num_heads`: the error points at the typo, not at the map.
  check_error(replace(kValid, "  num_heads: 4\n", "  num_head: 4\n"),
              {"m.yaml:5:3: linear_attn_config.num_heads: required key is missing; found "
               "`num_head` (line 5): a typo?"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layer: [1, 2, 4, 5]\n"),
              {"m.yaml:8:3: linear_attn_config.kda_layers: required key is missing; found "
               "`kda_layer` (line 8): a typo?"});
  check_error(replace(kValid, "num_hidden_layers: 6\n", "num_hidden_layer: 6\n"),
              {"m.yaml:3:1: num_hidden_layers: required key is missing; found `num_hidden_layer` "
               "(line 3): a typo?"});
  check_error(replace(kValid, "  gate_lower_bound: -5.0\n", "  gate_lowerbound: -5.0\n"),
              {"m.yaml:11:3: linear_attn_config.gate_lower_bound: required key is missing "
               "(required with gate: lower_bound; a value in [-5, 0)); found `gate_lowerbound` "
               "(line 11): a typo?"});
  // Nothing near: the error points at the enclosing map (its first key) and names no candidate.
  const std::string message = error_of(replace(kValid, "  num_heads: 4\n", "  heads_count: 4\n"));
  CHECK(message == "m.yaml:5:3: linear_attn_config.num_heads: required key is missing");
}

TEST_CASE("gate: kimi_linear defaults to softplus, otherwise a missing gate lists the values") {
  const std::string no_gate =
      replace(replace(kValid, "  gate: lower_bound\n  gate_lower_bound: -5.0\n", ""),
              "name: test-model\n", "name: test-model\nmodel_type: kimi_linear\n");
  const ModelSpec kimi = parse_model_spec(no_gate, "m.yaml");
  CHECK(kimi.gate == kda::GateMode::kSoftplus);
  CHECK(kimi.warnings.empty());
  // An explicit gate wins over the model type's default.
  const ModelSpec bounded = parse_model_spec(
      replace(kValid, "name: test-model\n", "name: test-model\nmodel_type: kimi_linear\n"),
      "m.yaml");
  CHECK(bounded.gate == kda::GateMode::kLowerBound);
  CHECK(bounded.gate_lower_bound == -5.0f);

  // No model type: the gate is required, and the message lists the values. Another model type is
  // no family the engine knows: refused, naming those it looks for.
  check_error(replace(no_gate, "model_type: kimi_linear\n", ""),
              {"m.yaml:5:3: linear_attn_config.gate: required key is missing",
               "allowed values: softplus, lower_bound", "model_type: kimi_linear"});
  check_error(replace(no_gate, "model_type: kimi_linear\n", "model_type: llama\n"),
              {"m.yaml:2:13: model_type: 'llama' is not a model family the engine knows",
               "kimi_linear, kimi_k3, glm5_next, glm5_next_text", "`family:`"});
  // kimi_linear with a lower bound but no gate is ambiguous: refused, naming both choices.
  check_error(replace(no_gate, "  full_attn_layers: [3, 6]\n",
                      "  full_attn_layers: [3, 6]\n  gate_lower_bound: -5.0\n"),
              {"m.yaml:11:21:", "linear_attn_config.gate", "gate_lower_bound is given", "softplus",
               "lower_bound"});
  check_error(replace(no_gate, "model_type: kimi_linear\n", "model_type: [kimi_linear]\n"),
              {"model_type", "expected a string"});
}

namespace {

// The Hugging Face config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as YAML (block style):
// the same keys and values as examples/models/kimi-linear-48b-a3b.json.
const char* const kKimiConfigYaml = R"(architectures:
  - KimiLinearForCausalLM
auto_map:
  AutoConfig: configuration_kimi.KimiLinearConfig
  AutoModel: modeling_kimi.KimiLinearModel
  AutoModelForCausalLM: modeling_kimi.KimiLinearForCausalLM
bos_token_id: 163584
dtype: bfloat16
eos_token_id: 163586
first_k_dense_replace: 1
head_dim: 72
hidden_act: silu
hidden_size: 2304
initializer_range: 0.02
intermediate_size: 9216
kv_lora_rank: 512
linear_attn_config:
  full_attn_layers: [4, 8, 12, 16, 20, 24, 27]
  head_dim: 128
  kda_layers: [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]
  num_heads: 32
  short_conv_kernel_size: 4
mla_use_nope: true
model_max_length: 1048576
model_type: kimi_linear
moe_intermediate_size: 1024
moe_layer_freq: 1
moe_renormalize: true
moe_router_activation_func: sigmoid
num_attention_heads: 32
num_expert_group: 1
num_experts: 256
num_experts_per_token: 8
num_hidden_layers: 27
num_key_value_heads: 32
num_nextn_predict_layers: 0
num_shared_experts: 1
pad_token_id: 163839
q_lora_rank: null
qk_nope_head_dim: 128
qk_rope_head_dim: 64
rms_norm_eps: 1.0e-05
rope_theta: 10000.0
routed_scaling_factor: 2.446
tie_word_embeddings: false
topk_group: 1
use_cache: true
use_grouped_topk: true
v_head_dim: 128
vocab_size: 163840
)";

void check_kimi_linear_48b(const ModelSpec& spec) {
  CHECK(spec.hidden_size == 2304);
  CHECK(spec.num_hidden_layers == 27);
  CHECK(spec.num_heads == 32);
  CHECK(spec.head_dim == 128);  // linear_attn_config.head_dim, not the top-level (MLA) head_dim 72
  CHECK(spec.short_conv_kernel_size == 4);
  CHECK(spec.num_kda_layers() == 20);
  CHECK(spec.kda_layers ==
        std::vector<int>{1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26});
  CHECK(spec.full_attn_layers == std::vector<int>{4, 8, 12, 16, 20, 24, 27});
  CHECK(spec.gate == kda::GateMode::kSoftplus);  // model_type: kimi_linear, no gate key
  CHECK(spec.runtime.max_tokens == 8192);        // no runtime section: the defaults
  CHECK(spec.warnings.empty());                  // none of the Hugging Face keys is a typo
}

}  // namespace

TEST_CASE("the Hugging Face config.json of Kimi-Linear-48B-A3B loads as is") {
  const std::string path =
      std::string(KDA_SOURCE_DIR) + "/examples/models/kimi-linear-48b-a3b.json";
  const ModelSpec spec = kda::engine::load_model_spec(path);
  check_kimi_linear_48b(spec);
  CHECK(spec.name == "kimi-linear-48b-a3b");  // the file name: config.json carries no name
  // Strict mode accepts it too: its linear_attn_config holds only keys the engine knows.
  kda::engine::ModelSpecOptions strict;
  strict.strict = true;
  CHECK_NOTHROW(kda::engine::load_model_spec(path, strict));
}

TEST_CASE("the YAML twin of the Hugging Face config loads to the same spec") {
  const ModelSpec spec = parse_model_spec(kKimiConfigYaml, "config.yaml");
  check_kimi_linear_48b(spec);
  // And the curated example, which writes the gate and a runtime section, describes the same
  // KDA layers.
  const ModelSpec example = kda::engine::load_model_spec(
      std::string(KDA_SOURCE_DIR) + "/examples/models/kimi-linear-48b-a3b.yaml");
  CHECK(example.kda_layers == spec.kda_layers);
  CHECK(example.num_heads == spec.num_heads);
  CHECK(example.head_dim == spec.head_dim);
  CHECK(example.gate == spec.gate);
  CHECK(example.warnings.empty());
}

TEST_CASE("JSON: errors and warnings carry positions, what yaml-cpp cannot read, syntax errors") {
  const std::string json =
      "{\n"                                   // 1
      "  \"hidden_size\": 64,\n"              // 2
      "  \"num_hidden_layers\": 2,\n"         // 3
      "  \"model_type\": \"kimi_linear\",\n"  // 4
      "  \"linear_attn_config\": {\n"         // 5
      "    \"num_heads\": 2,\n"               // 6
      "    \"head_dim\": 16,\n"               // 7
      "    \"kda_layers\": [1, 2]\n"          // 8
      "  }\n"                                 // 9
      "}\n";                                  // 10
  CHECK(parse_model_spec(json, "c.json").gate == kda::GateMode::kSoftplus);
  CHECK(error_in("c.json", replace(json, "\"head_dim\": 16", "\"head_dim\": \"16\"")) ==
        "c.json:7:17: linear_attn_config.head_dim: expected an integer, got the string '16'");
  CHECK(error_in("c.json", replace(json, "\"num_heads\"", "\"num_head\"")) ==
        "c.json:6:5: linear_attn_config.num_heads: required key is missing (looked for "
        "linear_attn_config.num_heads, then linear_num_heads); found `num_head` (line 6): a typo?");
  const ModelSpec typo = parse_model_spec(
      replace(json, "    \"head_dim\": 16,\n", "    \"head_dim\": 16,\n    \"gates\": 1,\n"),
      "c.json");
  REQUIRE(typo.warnings.size() == 1);
  CHECK(typo.warnings[0] ==
        "c.json:8:5: linear_attn_config.gates: unknown key, ignored; did you mean `gate`?");

  // Tabs and a byte order mark, as some editors write JSON, load too.
  std::string tabbed = json;
  for (std::size_t at = tabbed.find("  "); at != std::string::npos; at = tabbed.find("  ")) {
    tabbed.replace(at, 2, "\t");
  }
  CHECK(parse_model_spec("\xEF\xBB\xBF" + tabbed, "c.json").num_heads == 2);

  // yaml-cpp rejects a surrogate-pair escape (an emoji) that JSON allows: the JSON parser reads
  // the file instead; errors then carry no line.
  const std::string emoji =
      replace(json, "  \"model_type\"", "  \"comment\": \"\\ud83d\\ude00\",\n  \"model_type\"");
  const ModelSpec spec = parse_model_spec(emoji, "c.json");
  CHECK(spec.num_heads == 2);
  CHECK(spec.kda_layers == std::vector<int>{1, 2});
  CHECK(spec.gate == kda::GateMode::kSoftplus);
  CHECK(error_in("c.json", replace(emoji, "\"head_dim\": 16", "\"head_dim\": \"16\"")) ==
        "c.json: linear_attn_config.head_dim: expected an integer, got the string '16'");

  // A key twice in one object, in a file only the JSON parser reads: refused as the YAML reader
  // refuses it, at the second one.
  const std::string twice = error_in(
      "c.json", replace(emoji, "  \"model_type\"", "  \"hidden_size\": 32,\n  \"model_type\""));
  INFO(twice);
  CHECK(twice.rfind("c.json:", 0) == 0);
  CHECK(twice.find("hidden_size: key appears twice") != std::string::npos);

  // A number no double holds, in a file only the JSON parser reads: an error naming it, at its
  // line (the parser's out_of_range exception, not a parse_error, once escaped as itself).
  const std::string huge =
      error_in("c.json", replace(emoji, "\"head_dim\": 16", "\"head_dim\": 1e705"));
  INFO(huge);
  CHECK(huge.rfind("c.json:", 0) == 0);
  CHECK(huge.find("number overflow parsing '1e705'") != std::string::npos);

  // Not JSON to either parser: the JSON parser's message, at its line.
  const std::string missing_comma =
      error_in("c.json", replace(json, "\"num_heads\": 2,", "\"num_heads\": 2"));
  INFO(missing_comma);
  CHECK(missing_comma.rfind("c.json:7:", 0) == 0);
  CHECK(missing_comma.find("JSON syntax error") != std::string::npos);
  CHECK(missing_comma.find("expected '}'") != std::string::npos);
}

TEST_CASE("the example models parse") {
  const std::string dir = std::string(KDA_SOURCE_DIR) + "/examples/models/";
  const ModelSpec kimi = kda::engine::load_model_spec(dir + "kimi-linear-48b-a3b.yaml");
  CHECK(kimi.name == "Kimi-Linear-48B-A3B");
  CHECK(kimi.hidden_size == 2304);
  CHECK(kimi.num_hidden_layers == 27);
  CHECK(kimi.num_heads == 32);
  CHECK(kimi.head_dim == 128);
  CHECK(kimi.gate == kda::GateMode::kSoftplus);
  CHECK(kimi.kda_layers ==
        std::vector<int>{1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26});
  CHECK(kimi.num_kda_layers() == 20);
  CHECK(kimi.kda_layer_indices.front() == 0);
  CHECK(kimi.kda_layer_indices.back() == 25);
  CHECK(kimi.full_attn_layers == std::vector<int>{4, 8, 12, 16, 20, 24, 27});

  const ModelSpec tiny = kda::engine::load_model_spec(dir + "tiny.yaml");
  CHECK(tiny.num_kda_layers() >= 1);
  CHECK(tiny.num_kda_layers() < kimi.num_kda_layers());
}

TEST_CASE("syntax errors name the file / line and column") {
  const std::string message =
      error_of(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: [1, 2, 4, 5\n"));
  INFO(message);
  CHECK(message.find("YAML syntax error") != std::string::npos);
  // The unterminated list starts on line 8; yaml-cpp reports where it noticed, at or after it.
  unsigned line = 0, column = 0;
  REQUIRE(std::sscanf(message.c_str(), "m.yaml:%u:%u:", &line, &column) == 2);
  CHECK(line >= 8);
  CHECK(column >= 1);

  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 4\n   bad_indent: 1\n"),
              {"m.yaml:6:", "syntax"});
  check_error("", {"empty"});
  check_error("- just\n- a list\n", {"expected a map"});
}

TEST_CASE("missing required keys are named") {
  check_error(replace(kValid, "hidden_size: 256\n", ""),
              {"hidden_size", "required key is missing"});
  check_error(replace(kValid, "  num_heads: 4\n", ""),
              {"m.yaml:5:3:", "linear_attn_config.num_heads", "missing"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", ""),
              {"linear_attn_config.kda_layers"});
  check_error(replace(kValid, "  gate: lower_bound\n", ""), {"linear_attn_config.gate", "missing"});
  // A key written with no value is missing too.
  check_error(replace(kValid, "  head_dim: 64\n", "  head_dim:\n"), {"head_dim"});
}

TEST_CASE("wrong types are named with their position") {
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: many\n"),
              {"m.yaml:5:14:", "linear_attn_config.num_heads", "expected an integer", "'many'"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 4.5\n"), {"num_heads", "integer"});
  // Decimal only: yaml-cpp would read 04 as octal and 0x4 as hexadecimal.
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 04\n"),
              {"num_heads", "expected a decimal integer, got '04' (a leading zero"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 0x4\n"),
              {"num_heads", "expected an integer"});
  CHECK(parse_model_spec(replace(kValid, "  num_heads: 4\n", "  num_heads: +4\n"), "m.yaml")
            .num_heads == 4);
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: \"4\"\n"), {"num_heads", "string"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: [4]\n"), {"num_heads", "a list"});
  check_error(replace(kValid, "hidden_size: 256\n", "hidden_size: {a: 1}\n"),
              {"m.yaml:2:14:", "hidden_size", "a map"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: 1\n"),
              {"kda_layers", "list"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: [1, two]\n"),
              {"m.yaml:8:19:", "kda_layers[1]", "integer"});
  check_error(replace(kValid, "  gate_lower_bound: -5.0\n", "  gate_lower_bound: low\n"),
              {"m.yaml:11:", "gate_lower_bound", "number"});
  check_error(replace(kValid, "runtime:\n", "runtime: 5\nunused:\n"), {"runtime", "map"});
  check_error(replace(kValid, "  state_dtype: bf16\n", "  state_dtype: [bf16]\n"),
              {"runtime.state_dtype", "string"});
  check_error(replace(kValid, "linear_attn_config:\n", "linear_attn_config: 3\nignored:\n"),
              {"linear_attn_config", "map"});
}

TEST_CASE("out-of-range and absurd sizes are rejected") {
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: -1\n"),
              {"num_heads", "out of range"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 0\n"),
              {"num_heads", "out of range"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 4096\n"),
              {"num_heads", "[1, 1024]"});
  check_error(replace(kValid, "  head_dim: 64\n", "  head_dim: 2048\n"),
              {"head_dim", "out of range"});
  check_error(replace(kValid, "hidden_size: 256\n", "hidden_size: -256\n"), {"hidden_size"});
  check_error(replace(kValid, "num_hidden_layers: 6\n", "num_hidden_layers: 100000\n"),
              {"num_hidden_layers"});
  check_error(replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 0\n"), {"runtime.max_tokens"});
  check_error(replace(kValid, "  max_sequences: 4\n", "  max_sequences: 0\n"),
              {"runtime.max_sequences"});
  check_error(replace(kValid, "  max_sequences: 4\n", "  max_sequences: 9999999999\n"),
              {"runtime.max_sequences", "out of range"});
  check_error(replace(kValid, "  short_conv_kernel_size: 4\n", "  short_conv_kernel_size: 0\n"),
              {"short_conv_kernel_size"});
  check_error(replace(kValid, "  short_conv_kernel_size: 4\n", "  short_conv_kernel_size: 17\n"),
              {"short_conv_kernel_size", "[1, 16]"});
  // The description's range is 1..16 (an engine's whole layers need 2 or more; a case may not).
  CHECK(parse_model_spec(
            replace(kValid, "  short_conv_kernel_size: 4\n", "  short_conv_kernel_size: 1\n"),
            "m.yaml")
            .short_conv_kernel_size == 1);
  // Beyond int64: not an integer this parser can hold.
  check_error(replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 99999999999999999999999\n"),
              {"runtime.max_tokens", "integer"});
}

TEST_CASE("byte counts that overflow 64 bits are rejected") {
  kda::StatusCode code = kda::StatusCode::kOk;
  // 2^62 tokens x 4 heads x 64 x 2 bytes overflows.
  const std::string message = error_of(
      replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 4611686018427387904\n"), &code);
  INFO(message);
  CHECK(code == kda::StatusCode::kOverflow);
  CHECK(message.find("runtime.max_tokens") != std::string::npos);
  CHECK(message.find("overflows 64 bits") != std::string::npos);
  // Large but representable: accepted (allocation is the engine's problem, not the parser's).
  CHECK_NOTHROW(parse_model_spec(
      replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 1000000000000\n"), "m.yaml"));
}

TEST_CASE("layer indices: range / duplicates / overlap with full attention") {
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: [1, 2, 7]\n"),
              {"m.yaml:8:", "kda_layers[2]", "layer 7 is out of range [1, 6]"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: [0, 1]\n"),
              {"kda_layers[0]", "out of range", "1-based"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: [1, 2, 2]\n"),
              {"kda_layers[2]", "twice"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", "  kda_layers: []\n"),
              {"kda_layers", "at least one"});
  check_error(replace(kValid, "  full_attn_layers: [3, 6]\n", "  full_attn_layers: [2, 6]\n"),
              {"m.yaml:9:", "full_attn_layers[0]", "also listed in kda_layers"});
  check_error(replace(kValid, "  full_attn_layers: [3, 6]\n", "  full_attn_layers: [3, 60]\n"),
              {"full_attn_layers[1]", "out of range"});
}

TEST_CASE("gate and lower bound") {
  check_error(replace(kValid, "  gate: lower_bound\n", "  gate: sigmoid\n"),
              {"m.yaml:10:9:", "linear_attn_config.gate", "unknown gate 'sigmoid'"});
  check_error(replace(kValid, "  gate_lower_bound: -5.0\n", ""),
              {"gate_lower_bound", "required with gate: lower_bound"});
  for (const char* bad : {"-6.0", "0", "0.0", "1.5", "-5.0001", ".nan", ".inf", "-.inf"}) {
    CAPTURE(bad);
    check_error(replace(kValid, "-5.0\n", std::string(bad) + "\n"),
                {"m.yaml:11:21:", "gate_lower_bound", "outside [-5, 0)"});
  }
  // Shown as written (not rounded to -5), and refused where the float the layers take is -0.
  check_error(replace(kValid, "-5.0\n", "-5.0000000001\n"),
              {"value -5.0000000001 is outside [-5, 0) or not finite"});
  check_error(replace(kValid, "-5.0\n", "-1e-300\n"),
              {"value -1e-300 is outside [-5, 0) or not finite (as a float it is -0)"});
  CHECK(parse_model_spec(replace(kValid, "-5.0\n", "-0.5\n"), "m.yaml").gate_lower_bound == -0.5f);
  CHECK(parse_model_spec(replace(kValid, "-5.0\n", "-5\n"), "m.yaml").gate_lower_bound == -5.0f);
  // With gate: softplus a lower bound is unused, but checked all the same.
  check_error(replace(kValid, "  gate: lower_bound\n  gate_lower_bound: -5.0\n",
                      "  gate: softplus\n  gate_lower_bound: 7\n"),
              {"m.yaml:11:21:", "gate_lower_bound", "outside [-5, 0)"});
  // Softplus needs no lower bound.
  const ModelSpec softplus = parse_model_spec(
      replace(replace(kValid, "  gate_lower_bound: -5.0\n", ""), "lower_bound\n", "softplus\n"),
      "m.yaml");
  CHECK(softplus.gate == kda::GateMode::kSoftplus);
}

TEST_CASE("unknown runtime values are named") {
  check_error(replace(kValid, "  backend: cpu\n", "  backend: tpu\n"),
              {"m.yaml:17:12:", "runtime.backend", "unknown backend 'tpu'"});
  check_error(replace(kValid, "  state_dtype: bf16\n", "  state_dtype: fp16\n"),
              {"runtime.state_dtype", "unknown state dtype 'fp16'"});
  check_error(replace(kValid, "  workspace_plan: reuse\n", "  workspace_plan: greedy\n"),
              {"runtime.workspace_plan", "unknown plan 'greedy'"});
  check_error(replace(kValid, "  backend: cpu\n", "  backend: cpu\n  prefill_schedule: fused\n"),
              {"m.yaml:18:", "runtime.prefill_schedule", "unknown prefill schedule 'fused'",
               "expected auto, two-phase or pipelined"});
}

TEST_CASE("runtime.prefill_schedule: every name, and its parser") {
  for (kda::PrefillSchedule s : {kda::PrefillSchedule::kAuto, kda::PrefillSchedule::kTwoPhase,
                                 kda::PrefillSchedule::kPipelined}) {
    const std::string name = kda::to_string(s);
    CAPTURE(name);
    const ModelSpec spec = parse_model_spec(
        replace(kValid, "  backend: cpu\n", "  backend: cpu\n  prefill_schedule: " + name + "\n"),
        "m.yaml");
    CHECK(spec.runtime.prefill_schedule == s);
    CHECK(spec.warnings.empty());
  }
  kda::PrefillSchedule untouched = kda::PrefillSchedule::kPipelined;
  CHECK_FALSE(kda::engine::parse_prefill_schedule("two_phase", &untouched));
  CHECK(untouched == kda::PrefillSchedule::kPipelined);
  CHECK_FALSE(kda::engine::parse_prefill_schedule("auto", nullptr));
}

TEST_CASE("runtime.state_dtype's parser: fp32 and bf16, nothing else") {
  kda::DType dtype = kda::DType::kBF16;
  CHECK(kda::engine::parse_state_dtype("fp32", &dtype));
  CHECK(dtype == kda::DType::kF32);
  CHECK(kda::engine::parse_state_dtype("bf16", &dtype));
  CHECK(dtype == kda::DType::kBF16);
  CHECK_FALSE(kda::engine::parse_state_dtype("f32", &dtype));
  CHECK(dtype == kda::DType::kBF16);
  CHECK_FALSE(kda::engine::parse_state_dtype("fp32", nullptr));
}

TEST_CASE("runtime.decode_step: every name, its parser, and an unknown one") {
  CHECK(parse_model_spec(kValid, "m.yaml").runtime.decode_step == kda::layer::DecodeKernel::kAuto);
  for (const kda::layer::DecodeKernel k :
       {kda::layer::DecodeKernel::kAuto, kda::layer::DecodeKernel::kFusedFactors,
        kda::layer::DecodeKernel::kFused, kda::layer::DecodeKernel::kSeparate,
        kda::layer::DecodeKernel::kOneLaunch}) {
    const std::string name = kda::layer::to_string(k);
    CAPTURE(name);
    const ModelSpec spec = parse_model_spec(
        replace(kValid, "  backend: cpu\n", "  backend: cpu\n  decode_step: " + name + "\n"),
        "m.yaml");
    CHECK(spec.runtime.decode_step == k);
    CHECK(spec.warnings.empty());
  }
  CHECK(std::string(kda::layer::to_string(static_cast<kda::layer::DecodeKernel>(9))) == "unknown");
  kda::layer::DecodeKernel untouched = kda::layer::DecodeKernel::kSeparate;
  CHECK_FALSE(kda::layer::parse_decode_kernel("one_launch", &untouched));
  CHECK(untouched == kda::layer::DecodeKernel::kSeparate);
  CHECK_FALSE(kda::layer::parse_decode_kernel("auto", nullptr));
  check_error(replace(kValid, "  backend: cpu\n", "  backend: cpu\n  decode_step: fast\n"),
              {"m.yaml:18:", "runtime.decode_step", "unknown decode step 'fast'",
               "expected auto, one-launch, fused, fused-after-gemms or separate"});
}

TEST_CASE("duplicate keys are an error (not a silent choice)") {
  check_error(replace(kValid, "  head_dim: 64\n", "  head_dim: 64\n  head_dim: 128\n"),
              {"m.yaml:7:3:", "linear_attn_config.head_dim", "twice"});
}

TEST_CASE("files: weights resolve against the YAML's directory / unreadable files are named") {
  const fs::path dir = temp_dir("spec");
  const fs::path yaml = dir / "model.yaml";
  {
    std::ofstream out(yaml);
    out << kValid << "weights: sub/params.safetensors\n";
  }
  const ModelSpec spec = kda::engine::load_model_spec(yaml.string());
  CHECK(fs::path(spec.weights) == (dir / "sub" / "params.safetensors").lexically_normal());
  {
    std::ofstream out(yaml);
    out << kValid << "weights: /abs/params.safetensors\n";
  }
  CHECK(kda::engine::load_model_spec(yaml.string()).weights == "/abs/params.safetensors");
  {
    std::ofstream out(yaml);
    out << kValid << "weights: [a]\n";
  }
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(yaml.string()), doctest::Contains("weights"),
                       kda::Error);

  const std::string missing = (dir / "nope.yaml").string();
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(missing), doctest::Contains("nope.yaml"),
                       kda::Error);
  // Binary data (a checkpoint's weights named as the description), and a file past 16 MiB, are
  // refused by name before being parsed (or read whole).
  const fs::path binary = dir / "model.safetensors";
  {
    std::ofstream out(binary, std::ios::binary);
    out << kValid;
    out.put('\0');
    out << "rest";
  }
  const std::string binary_message =
      binary.string() + ": the model description holds binary data (a zero byte at offset " +
      std::to_string(std::string(kValid).size()) +
      "): it should be a YAML or JSON text of a few KB; a checkpoint's weights are named by the "
      "description's `weights` key, or found in its folder";
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(binary.string()), binary_message.c_str(),
                       kda::Error);
  fs::resize_file(binary, (std::uintmax_t{16} << 20) + 1);
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(binary.string()),
                       doctest::Contains(": the model description is over 16 MiB"), kda::Error);
  fs::remove_all(dir);
}

TEST_CASE("whole-layer keys: runtime.layers / tp_size / tp_rank and rms_norm_eps") {
  const ModelSpec defaults = parse_model_spec(kValid, "m.yaml");
  CHECK(defaults.runtime.layer_mode == kda::engine::LayerMode::kWhole);
  CHECK(defaults.runtime.tp_size == 1);
  CHECK(defaults.runtime.tp_rank == 0);
  CHECK(defaults.rms_norm_eps == doctest::Approx(1e-5));
  CHECK(defaults.local_heads() == 4);

  const std::string text = replace(kValid, "  backend: cpu\n",
                                   "  backend: cpu\n  layers: core\n  tp_size: 2\n  tp_rank: 1\n") +
                           "rms_norm_eps: 1.0e-6\n";
  const ModelSpec spec = parse_model_spec(text, "m.yaml");
  CHECK(spec.warnings.empty());
  CHECK(spec.runtime.layer_mode == kda::engine::LayerMode::kCoreOnly);
  CHECK(spec.runtime.tp_size == 2);
  CHECK(spec.runtime.tp_rank == 1);
  CHECK(spec.local_heads() == 2);
  CHECK(spec.rms_norm_eps == doctest::Approx(1e-6));
  CHECK(spec.state_slot_bytes() == 2u * 64 * 64 * 2);  // this rank's heads, bf16
  CHECK(spec.conv_state_slot_bytes() == 2u * 64 * 3 * 2);

  // The Hugging Face config's rms_norm_eps is read.
  const ModelSpec kimi = kda::engine::load_model_spec(std::string(KDA_SOURCE_DIR) +
                                                      "/examples/models/kimi-linear-48b-a3b.json");
  CHECK(kimi.rms_norm_eps == doctest::Approx(1e-5));

  // Bad values name the key and the problem.
  check_error(replace(kValid, "  backend: cpu\n", "  backend: cpu\n  tp_size: 3\n"),
              {"m.yaml:18:", "runtime.tp_size", "does not divide linear_attn_config.num_heads 4"});
  check_error(replace(kValid, "  backend: cpu\n", "  backend: cpu\n  tp_size: 2\n  tp_rank: 2\n"),
              {"m.yaml:19:", "runtime.tp_rank", "out of range [0, 1]"});
  check_error(replace(kValid, "  backend: cpu\n", "  backend: cpu\n  layers: half\n"),
              {"runtime.layers", "unknown layer mode 'half' (expected whole or core)"});
  check_error(std::string(kValid) + "rms_norm_eps: -1\n",
              {"m.yaml:18:", "rms_norm_eps", "not a finite number > 0"});
  check_error(std::string(kValid) + "rms_norm_eps: small\n", {"rms_norm_eps", "expected a number"});

  // Typos of the new keys warn with the spelling meant.
  const ModelSpec typo = parse_model_spec(
      replace(kValid, "  backend: cpu\n", "  backend: cpu\n  tp_sise: 2\n") + "rms_norm_esp: 1\n",
      "m.yaml");
  REQUIRE(typo.warnings.size() == 2);  // top-level keys are checked first
  CHECK(typo.warnings[0].find("rms_norm_esp: unknown key, ignored; did you mean `rms_norm_eps`?") !=
        std::string::npos);
  CHECK(typo.warnings[1].find("runtime.tp_sise: unknown key, ignored; did you mean `tp_size`?") !=
        std::string::npos);
}
