// YAML model descriptions: the example models parse; every kind of bad input is an error that
// names the file, line, column and key.
#include <doctest/doctest.h>

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
    "name: test-model\n"                         // 1
    "hidden_size: 256\n"                         // 2
    "num_hidden_layers: 6\n"                     // 3
    "linear_attn_config:\n"                      // 4
    "  num_heads: 4\n"                           // 5
    "  head_dim: 64\n"                           // 6
    "  short_conv_kernel_size: 4\n"              // 7
    "  kda_layers: [1, 2, 4, 5]\n"               // 8
    "  full_attn_layers: [3, 6]\n"               // 9
    "  gate: lower_bound\n"                      // 10
    "  gate_lower_bound: -5.0\n"                 // 11
    "runtime:\n"                                 // 12
    "  max_tokens: 4096\n"                       // 13
    "  max_sequences: 4\n"                       // 14
    "  state_dtype: bf16\n"                      // 15
    "  workspace_plan: reuse\n"                  // 16
    "  backend: cpu\n";                          // 17

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

fs::path temp_dir(const char* tag) {
  std::random_device random;
  const fs::path dir = fs::temp_directory_path() /
                       ("kda-test-" + std::string(tag) + "-" + std::to_string(random()));
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
  CHECK(spec.runtime.workspace_plan == kda::planner::PlanMode::kSum);
  CHECK(spec.runtime.backend == kda::engine::BackendChoice::kAuto);
  // An empty runtime section means defaults too.
  CHECK(parse_model_spec(text + "runtime:\n", "m.yaml").runtime.max_sequences == 8);
}

TEST_CASE("extra keys are accepted anywhere (a pasted Hugging Face config)") {
  std::string text = kValid;
  text = replace(text, "hidden_size: 256\n",
                 "hidden_size: 256\nmodel_type: kimi_linear\nrope_theta: 10000.0\n"
                 "moe: {num_experts: 256, top_k: 8}\nvocab: [a, b]\n");
  text = replace(text, "  head_dim: 64\n", "  head_dim: 64\n  unknown_knob: true\n");
  text = replace(text, "  backend: cpu\n", "  backend: cpu\n  comment: hello\n");
  const ModelSpec spec = parse_model_spec(text, "m.yaml");
  CHECK(spec.num_heads == 4);
  CHECK(spec.runtime.backend == kda::engine::BackendChoice::kCpu);
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
  CHECK(kimi.kda_layers == std::vector<int>{1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19,
                                            21, 22, 23, 25, 26});
  CHECK(kimi.num_kda_layers() == 20);
  CHECK(kimi.kda_layer_indices.front() == 0);
  CHECK(kimi.kda_layer_indices.back() == 25);
  CHECK(kimi.full_attn_layers == std::vector<int>{4, 8, 12, 16, 20, 24, 27});

  const ModelSpec tiny = kda::engine::load_model_spec(dir + "tiny.yaml");
  CHECK(tiny.num_kda_layers() >= 1);
  CHECK(tiny.num_kda_layers() < kimi.num_kda_layers());
}

TEST_CASE("syntax errors name the file / line and column") {
  const std::string message = error_of(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n",
                                               "  kda_layers: [1, 2, 4, 5\n"));
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
  check_error(replace(kValid, "hidden_size: 256\n", ""), {"hidden_size", "required key is missing"});
  check_error(replace(kValid, "  num_heads: 4\n", ""),
              {"m.yaml:5:3:", "linear_attn_config.num_heads", "missing"});
  check_error(replace(kValid, "  kda_layers: [1, 2, 4, 5]\n", ""), {"linear_attn_config.kda_layers"});
  check_error(replace(kValid, "  gate: lower_bound\n", ""), {"linear_attn_config.gate", "missing"});
  // A key written with no value is missing too.
  check_error(replace(kValid, "  head_dim: 64\n", "  head_dim:\n"), {"head_dim"});
}

TEST_CASE("wrong types are named with their position") {
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: many\n"),
              {"m.yaml:5:14:", "linear_attn_config.num_heads", "expected an integer", "'many'"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 4.5\n"), {"num_heads", "integer"});
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
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: -1\n"), {"num_heads", "out of range"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 0\n"), {"num_heads", "out of range"});
  check_error(replace(kValid, "  num_heads: 4\n", "  num_heads: 4096\n"), {"num_heads", "[1, 1024]"});
  check_error(replace(kValid, "  head_dim: 64\n", "  head_dim: 2048\n"), {"head_dim", "out of range"});
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
  // Beyond int64: not an integer this parser can hold.
  check_error(replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 99999999999999999999999\n"),
              {"runtime.max_tokens", "integer"});
}

TEST_CASE("byte counts that overflow 64 bits are rejected") {
  kda::StatusCode code = kda::StatusCode::kOk;
  // 2^62 tokens x 4 heads x 64 x 2 bytes overflows.
  const std::string message =
      error_of(replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 4611686018427387904\n"), &code);
  INFO(message);
  CHECK(code == kda::StatusCode::kOverflow);
  CHECK(message.find("runtime.max_tokens") != std::string::npos);
  CHECK(message.find("overflows 64 bits") != std::string::npos);
  // Large but representable: accepted (allocation is the engine's problem, not the parser's).
  CHECK_NOTHROW(parse_model_spec(replace(kValid, "  max_tokens: 4096\n", "  max_tokens: 1000000000000\n"),
                                 "m.yaml"));
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
  CHECK(parse_model_spec(replace(kValid, "-5.0\n", "-0.5\n"), "m.yaml").gate_lower_bound == -0.5f);
  CHECK(parse_model_spec(replace(kValid, "-5.0\n", "-5\n"), "m.yaml").gate_lower_bound == -5.0f);
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
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(yaml.string()),
                       doctest::Contains("weights"), kda::Error);

  const std::string missing = (dir / "nope.yaml").string();
  CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(missing), doctest::Contains("nope.yaml"),
                       kda::Error);
  fs::remove_all(dir);
}
