// kda-run, the binary: usage errors, --version, --plan-only (summary, --plan table, --json), one
// layer numbering, a small synthetic run with decode steps, --case round trips against the fp64
// recurrence, bad case files and bad paths (message naming the file, non-zero exit, nothing
// written), runtime overrides, output line by line; and the scripts around it (run-example.sh's
// arguments, build.sh's choice of CPU architecture).
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/layer/layer.hpp"
#include "kda_reference.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using kda::DType;
using kda::engine::Tensor;

using kda::test::TempDir;

namespace {

struct Result {
  int rc = -1;
  std::string out, err;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string quote(const std::string& arg) {
  std::string quoted = "'";
  for (const char c : arg) {
    if (c == '\'')
      quoted += "'\\''";
    else
      quoted += c;
  }
  return quoted + "'";
}

// Runs a shell command, capturing its stdout and stderr.
Result shell(const std::string& command) {
  TempDir capture;
  const std::string full =
      "{ " + command + "; } >" + quote(capture.file("out")) + " 2>" + quote(capture.file("err"));
  const int status = std::system(full.c_str());
  Result r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(capture.file("out"));
  r.err = read_text(capture.file("err"));
  return r;
}

std::string quoted_args(const std::vector<std::string>& args) {
  std::string text;
  for (const std::string& arg : args) text += " " + quote(arg);
  return text;
}

// Runs kda-run with `args` (in `dir` when given), capturing stdout and stderr.
Result kda_run(const std::vector<std::string>& args, const std::string& dir = {}) {
#ifndef KDA_RUN_PATH
  (void)args;
  (void)dir;
  MESSAGE("KDA_SKIP: kda-run was not built");
  return {};
#else
  const std::string cd = dir.empty() ? std::string() : "cd " + quote(dir) + " && ";
  return shell(cd + quote(KDA_RUN_PATH) + quoted_args(args));
#endif
}

const std::string kModels = std::string(KDA_SOURCE_DIR) + "/examples/models/";

// ---- case files ----------------------------------------------------------------------------

Tensor bf16_tensor(const std::string& name, const std::vector<std::uint16_t>& values,
                   std::vector<std::int64_t> shape) {
  Tensor t = Tensor::zeros(name, DType::kBF16, std::move(shape));
  REQUIRE(t.data.size() == values.size() * 2);
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}
template <typename T>
Tensor typed_tensor(const std::string& name, DType dtype, const std::vector<T>& values,
                    std::vector<std::int64_t> shape) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  REQUIRE(t.data.size() == values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

template <typename T>
std::vector<T> values_of(const Tensor& t) {
  std::vector<T> v(t.data.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

std::string number(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.9g", value);
  return text;
}

struct CaseFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;

  void save(const std::string& path) const {
    std::vector<Tensor> list;
    for (const auto& [name, tensor] : tensors) list.push_back(tensor);
    kda::engine::save_safetensors(path, list, metadata);
  }
};

// The case-file form of a reference case.
CaseFile to_case_file(const kda::test::KdaCase& c) {
  const kda::Problem& p = c.problem;
  const std::int64_t B = p.batch, T = p.seq_len, H = p.num_heads, K = p.head_dim_k,
                     V = p.head_dim_v;
  const std::int64_t N = p.sequences();
  CaseFile f;
  auto add = [&f](Tensor t) { f.tensors.emplace(t.name, std::move(t)); };
  add(bf16_tensor("q", c.q, {B, T, H, K}));
  add(bf16_tensor("k", c.k, {B, T, H, K}));
  add(bf16_tensor("g", c.g, {B, T, H, K}));
  add(bf16_tensor("v", c.v, {B, T, H, V}));
  add(bf16_tensor("beta", c.beta, {B, T, H}));
  add(typed_tensor("A_log", DType::kF32, c.A_log, {H}));
  add(typed_tensor("dt_bias", DType::kF32, c.dt_bias, {H, K}));
  if (p.initial_state_dtype == DType::kF32) {
    add(typed_tensor("initial_state", DType::kF32, c.initial_state, {N, H, V, K}));
  } else if (p.initial_state_dtype == DType::kBF16) {
    add(bf16_tensor("initial_state", c.initial_state_bf16, {N, H, V, K}));
  }
  if (p.varlen()) {
    if (p.cu_seqlens_dtype == DType::kI32) {
      add(typed_tensor("cu_seqlens", DType::kI32, c.cu_seqlens_i32, {N + 1}));
    } else {
      add(typed_tensor("cu_seqlens", DType::kI64, c.cu_seqlens, {N + 1}));
    }
  }
  f.metadata["gate"] = p.gate == kda::GateMode::kSoftplus ? "softplus" : "lower_bound";
  if (p.gate == kda::GateMode::kLowerBound) f.metadata["lower_bound"] = number(p.lower_bound);
  if (p.scale != 0.0f) f.metadata["scale"] = number(p.scale);
  f.metadata["final_state"] = p.final_state_dtype == DType::kF32    ? "f32"
                              : p.final_state_dtype == DType::kBF16 ? "bf16"
                                                                    : "none";
  return f;
}

// Runs `c` through kda-run --case and compares with the fp64 recurrence.
void check_round_trip(const kda::test::KdaCase& c, bool write_final_state_key = true) {
  TempDir dir;
  CaseFile file = to_case_file(c);
  if (!write_final_state_key) file.metadata.erase("final_state");
  file.save(dir.file("in.safetensors"));
  const Result r = kda_run({"--case", dir.file("in.safetensors"), "--output",
                            dir.file("out.safetensors"), "--backend", "cpu"});
  INFO("stderr: " << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("on cpu") != std::string::npos);

  const kda::test::Reference ref = kda::test::reference_forward(c);
  const auto out_file = kda::engine::SafetensorsFile::open(dir.file("out.safetensors"));
  const Tensor out = out_file.read("out");
  const kda::Problem& p = c.problem;
  CHECK(out.dtype == DType::kBF16);
  CHECK(out.shape == std::vector<std::int64_t>{p.batch, p.seq_len, p.num_heads, p.head_dim_v});
  std::vector<std::uint16_t> out_values(out.data.size() / 2);
  std::memcpy(out_values.data(), out.data.data(), out.data.size());
  CHECK(kda::test::rel_error_bf16(out_values, ref.out) <= 2.5e-3);

  if (p.final_state_dtype == DType::kNone) {
    CHECK(out_file.find("final_state") == nullptr);
    return;
  }
  const Tensor state = out_file.read("final_state");
  CHECK(state.dtype == p.final_state_dtype);
  CHECK(state.shape ==
        std::vector<std::int64_t>{p.sequences(), p.num_heads, p.head_dim_v, p.head_dim_k});
  if (state.dtype == DType::kF32) {
    std::vector<float> values(state.data.size() / 4);
    std::memcpy(values.data(), state.data.data(), state.data.size());
    CHECK(kda::test::rel_error(values, ref.final_state) <= 1e-3);
  } else {
    std::vector<std::uint16_t> values(state.data.size() / 2);
    std::memcpy(values.data(), state.data.data(), state.data.size());
    CHECK(kda::test::rel_error_bf16(values, ref.final_state) <= 2.5e-3);
  }
}

// A small valid case to break in the error tests.
kda::test::KdaCase small_case() {
  kda::test::CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 8;
  o.head_dim_v = 8;
  o.lengths = {3, 5};
  o.initial_state_dtype = DType::kF32;
  o.gate = kda::GateMode::kLowerBound;
  o.lower_bound = -2.0f;
  o.seed = 31;
  return kda::test::make_case(o);
}

// Saves `file` (or raw bytes), runs kda-run --case on it, expects failure with `part` in the
// message and no output: an absent output stays absent, an existing one keeps its contents.
void check_rejected(const CaseFile* file, const std::string* raw, const std::string& part,
                    const std::string& flag = "--case", const std::string& backend = "cpu") {
  TempDir dir;
  const std::string in = dir.file("in.safetensors");
  if (file != nullptr) file->save(in);
  if (raw != nullptr) {
    std::ofstream(in, std::ios::binary) << *raw;
  }
  for (const bool existing : {false, true}) {
    const std::string out = dir.file(existing ? "existing.safetensors" : "out.safetensors");
    if (existing) std::ofstream(out) << "keep me";
    const Result r = kda_run({flag, in, "--output", out, "--backend", backend});
    INFO("stderr: " << r.err);
    CHECK(r.rc == 1);
    CHECK(r.err.find(part) != std::string::npos);
    if (existing) {
      CHECK(read_text(out) == "keep me");
    } else {
      CHECK_FALSE(fs::exists(out));
    }
    std::size_t files = 0;
    for (const auto& entry : fs::directory_iterator(dir.path)) {
      (void)entry;
      ++files;
    }
    CHECK(files == (existing ? 2u : 1u));  // the input (and the kept output); no temporaries
  }
}
void check_rejected(const CaseFile& file, const std::string& part) {
  check_rejected(&file, nullptr, part);
}
void check_rejected_bytes(const std::string& raw, const std::string& part) {
  check_rejected(nullptr, &raw, part);
}
void check_layer_rejected(const CaseFile& file, const std::string& part) {
  check_rejected(&file, nullptr, part, "--layer-case");
}

}  // namespace

TEST_CASE("kda-run: --help / usage errors exit 2") {
  Result r = kda_run({"--help"});
  CHECK(r.rc == 0);
  CHECK(r.out.find("Usage:") != std::string::npos);
  CHECK(r.out.find("--decode-steps") != std::string::npos);

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{},
        {"--frobnicate"},
        {"--model"},
        {"--model", "m.yaml", "--json"},
        {"--model", "m.yaml", "--tokens", "abc"},
        {"--model", "m.yaml", "--tokens", "0"},
        {"--model", "m.yaml", "--backend", "tpu"},
        {"--model", "m.yaml", "--prefill-schedule", "fused"},
        {"--model", "m.yaml", "--plan-only", "--prefill-schedule", "pipelined"},
        {"--model", "m.yaml", "--decode-step", "fast"},
        {"--model", "m.yaml", "--plan-only", "--decode-step", "fused"},
        {"--case", "in.safetensors"},
        {"--case", "a", "--output", "b", "--model", "m.yaml"},
        {"--output", "b"},
        {"--model", "m.yaml", "--plan-only", "--decode-steps", "3"}}) {
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    CAPTURE(joined);
    r = kda_run(args);
    CHECK(r.rc == 2);
    CHECK(r.err.find("kda-run: ") == 0);
  }
  // Limits of the model are usage errors too, naming the YAML key.
  r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "1000000"});
  CHECK(r.rc == 2);
  CHECK(r.err.find("runtime.max_tokens") != std::string::npos);
  r = kda_run({"--model", kModels + "tiny.yaml", "--sequences", "99"});
  CHECK(r.rc == 2);
  CHECK(r.err.find("runtime.max_sequences") != std::string::npos);
  r = kda_run({"--model", kModels + "tiny.yaml", "--prefill-schedule", "fused"});
  CHECK(r.rc == 2);
  CHECK(r.err.find("--prefill-schedule expects auto, two-phase or pipelined, got 'fused'") !=
        std::string::npos);
  r = kda_run({"--model", kModels + "tiny.yaml", "--decode-step", "one_launch"});
  CHECK(r.rc == 2);
  CHECK(r.err.find("--decode-step expects auto, one-launch, fused, fused-after-gemms or separate, "
                   "got 'one_launch'") != std::string::npos);
  // Integers as written: digits with an optional '-', nothing around them.
  for (const char* text : {" 5", "+5", "5 ", "0x10", "-", "1e3", "99999999999999999999"}) {
    CAPTURE(text);
    r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", text});
    CHECK(r.rc == 2);
    CHECK(r.err.find(std::string("--tokens expects an integer, got '") + text + "'") !=
          std::string::npos);
  }
  // An empty value (an unset shell variable) is refused as such, not read as the option left out.
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--model", kModels + "tiny.yaml", "--tokens", ""},
                                             {"--model", ""},
                                             {"--model="},
                                             {"--case", "", "--output", "o.safetensors"}}) {
    CAPTURE(args.size());
    r = kda_run(args);
    CHECK(r.rc == 2);
    CHECK(r.err.find(" needs a value, got an empty one") != std::string::npos);
  }
  r = kda_run({"--model", kModels + "tiny.yaml", "--decode-steps", "-1"});
  CHECK(r.rc == 2);
  CHECK(r.err.find("--decode-steps -1 is out of range [0, 16777216]") != std::string::npos);
  // A forced schedule and decode step run (on the CPU they change nothing).
  r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "64", "--backend", "cpu",
               "--prefill-schedule", "two-phase", "--decode-step", "separate", "--decode-steps",
               "2"});
  CHECK(r.rc == 0);
}

TEST_CASE("kda-run: bad model descriptions exit 1 naming file:line:column and key") {
  TempDir dir;
  const std::string yaml = dir.file("bad.yaml");
  std::ofstream(yaml) << "hidden_size: 64\nnum_hidden_layers: 2\nlinear_attn_config:\n"
                         "  num_heads: 2\n  head_dim: 16\n  kda_layers: [1, 3]\n  gate: softplus\n";
  Result r = kda_run({"--model", yaml});
  CHECK(r.rc == 1);
  CHECK(r.err.find(yaml + ":6:") != std::string::npos);
  CHECK(r.err.find("kda_layers[1]") != std::string::npos);
  r = kda_run({"--model", dir.file("missing.yaml"), "--plan-only"});
  CHECK(r.rc == 1);
  CHECK(r.err.find("missing.yaml") != std::string::npos);
  // A FIFO would block the reader: refused, naming it.
  const std::string fifo = dir.file("fifo.yaml");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  r = kda_run({"--model", fifo, "--plan-only"});
  CHECK(r.rc == 1);
  CHECK(r.err.find(fifo + ": the model description is not a regular file") != std::string::npos);
}

TEST_CASE("kda-run --plan-only --json: the fields of the plan") {
  for (const char* model : {"tiny.yaml", "kimi-linear-48b-a3b.yaml"}) {
    CAPTURE(model);
    const Result r = kda_run({"--model", kModels + model, "--plan-only", "--json"});
    REQUIRE(r.rc == 0);
    const nlohmann::json plan = nlohmann::json::parse(r.out);
    CHECK(plan["mode"].is_string());
    CHECK((plan["mode"] == "sum" || plan["mode"] == "reuse"));
    CHECK(plan["alignment"] == 256);
    REQUIRE(plan["arena_bytes"].is_number_unsigned());
    REQUIRE(plan["buffers"].is_array());
    const std::set<std::string> kinds = {"workspace", "state", "scratch", "parameter"};
    std::uint64_t end = 0;
    int states = 0;
    std::set<int> state_layers;
    for (const auto& buffer : plan["buffers"]) {
      for (const char* key : {"name", "kind", "layer", "offset", "bytes"}) {
        CHECK(buffer.contains(key));
      }
      CHECK(kinds.count(buffer["kind"].get<std::string>()) == 1);
      CHECK(buffer["offset"].get<std::uint64_t>() % 256 == 0);
      end = std::max(end,
                     buffer["offset"].get<std::uint64_t>() + buffer["bytes"].get<std::uint64_t>());
      if (buffer["kind"] == "state") {
        ++states;
        state_layers.insert(buffer["layer"].get<int>());
      }
    }
    CHECK(end <= plan["arena_bytes"].get<std::uint64_t>());
    // Whole layers: a recurrent state and three conv states (q, k, v) per KDA layer.
    CHECK(states == 4 * static_cast<int>(state_layers.size()));
    CHECK(state_layers.size() == (std::string(model) == "tiny.yaml" ? 3u : 20u));
    // --core-only: the recurrent state only.
    const Result core =
        kda_run({"--model", kModels + model, "--plan-only", "--json", "--core-only"});
    REQUIRE(core.rc == 0);
    int core_states = 0;
    const nlohmann::json core_plan = nlohmann::json::parse(core.out);
    for (const auto& buffer : core_plan["buffers"]) {
      core_states += buffer["kind"] == "state";
    }
    CHECK(core_states == static_cast<int>(state_layers.size()));
  }
}

TEST_CASE("kda-run --plan-only: a summary by default, every buffer with --plan") {
  // The KDA cores' plan (sizes known to this test); whole layers add conv states and workspace.
  // On the CPU backend: the figures below are its plan's (a CUDA machine's auto would plan CUDA).
  const Result json = kda_run({"--model", kModels + "tiny.yaml", "--plan-only", "--json",
                               "--core-only", "--backend", "cpu"});
  REQUIRE(json.rc == 0);
  const auto total = nlohmann::json::parse(json.out)["arena_bytes"].get<std::uint64_t>();

  const Result summary =
      kda_run({"--model", kModels + "tiny.yaml", "--plan-only", "--core-only", "--backend", "cpu"});
  INFO("summary:\n" << summary.out);
  REQUIRE(summary.rc == 0);
  // The arena in bytes is the JSON's total; one line per kind; both plan modes; no buffer rows.
  CHECK(summary.out.find("arena: 5.1 MiB (" + std::to_string(total) + " bytes)") !=
        std::string::npos);
  for (const char* kind : {"parameter", "state", "workspace", "scratch"}) {
    CAPTURE(kind);
    CHECK(std::regex_search(summary.out,
                            std::regex(std::string("\n  ") + kind + " +[0-9]+ buffers")));
  }
  CHECK(summary.out.find("plan sum: ") != std::string::npos);
  CHECK(summary.out.find("plan reuse: 5.1 MiB") != std::string::npos);  // tiny.yaml plans reuse
  CHECK(summary.out.find("--plan prints every buffer") != std::string::npos);
  CHECK(summary.out.find("layer1.state") == std::string::npos);
  CHECK(std::count(summary.out.begin(), summary.out.end(), '\n') <= 11);

  const Result table = kda_run({"--model", kModels + "tiny.yaml", "--plan-only", "--plan",
                                "--core-only", "--backend", "cpu"});
  INFO("table:\n" << table.out);
  REQUIRE(table.rc == 0);
  CHECK(table.out.find("layer1.state") != std::string::npos);
  CHECK(table.out.find("prefill.cu_seqlens") != std::string::npos);
  CHECK(table.out.find("synthetic.q") == std::string::npos);  // a run's inputs are not the engine's
  CHECK(table.out.find("arena_bytes: " + std::to_string(total) + " (") != std::string::npos);
  CHECK(table.out.find("plan sum: ") == std::string::npos);

  // A run prints the summary too, the table with --plan.
  Result run = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "16", "--backend", "cpu"});
  REQUIRE(run.rc == 0);
  CHECK(run.out.find("arena: ") != std::string::npos);
  CHECK(run.out.find("layer1.state") == std::string::npos);
  run = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "16", "--backend", "cpu", "--plan"});
  REQUIRE(run.rc == 0);
  CHECK(run.out.find("layer1.state") != std::string::npos);
  // --plan belongs to model runs only.
  CHECK(kda_run({"--case", "a", "--output", "b", "--plan"}).rc == 2);
}

// A reuse plan that fits 64-bit sizes where the sum of its buffers does not (the planner allows
// it): the summary still prints, its sum figure saying so.
TEST_CASE("kda-run --plan-only: a summary whose sum plan overflows 64 bits") {
  TempDir dir;
  const std::string yaml = dir.file("many.yaml");
  std::string layers;
  for (int i = 1; i <= 4096; ++i) layers += (i > 1 ? ", " : "") + std::to_string(i);
  std::ofstream(yaml) << "name: many\nhidden_size: 1\nnum_hidden_layers: 4096\n"
                         "linear_attn_config:\n  num_heads: 1\n  head_dim: 1\n  kda_layers: ["
                      << layers
                      << "]\n  full_attn_layers: []\n  gate: softplus\nruntime:\n"
                         "  max_tokens: 1000000000000000\n";
  const Result r = kda_run({"--model", yaml, "--plan-only", "--backend", "cpu"});
  INFO(r.out << r.err);
  CHECK(r.rc == 0);
  CHECK(r.out.find("plan sum: more than 64-bit sizes hold") != std::string::npos);
  CHECK(r.out.find("plan reuse: ") != std::string::npos);
}

TEST_CASE("kda-run: layers are numbered as the YAML's kda_layers, with the KDA index labelled") {
  // Kimi: kda_layers skip 4, 8, ...; so model layer 5 is KDA index 3.
  const std::string model = kModels + "kimi-linear-48b-a3b.yaml";
  const kda::engine::ModelSpec spec = kda::engine::load_model_spec(model);
  REQUIRE(spec.kda_layers.size() > 3);
  REQUIRE(spec.kda_layers[3] == 5);

  const Result table = kda_run({"--model", model, "--plan-only", "--plan"});
  INFO("table:\n" << table.out);
  REQUIRE(table.rc == 0);
  CHECK(table.out.find("layer0.") == std::string::npos);  // no 0-based model layers
  CHECK(table.out.find("layer4.") == std::string::npos);  // 4 is a full-attention layer
  CHECK(std::regex_search(table.out, std::regex("\nlayer5\\.state +state +5 \\(KDA index 3\\) ")));
  CHECK(std::regex_search(table.out, std::regex("\nlayer5\\.workspace .* KDA index 3\n")));

  // --json: "layer" is the same model layer, one state per KDA layer.
  const Result json = kda_run({"--model", model, "--plan-only", "--json"});
  REQUIRE(json.rc == 0);
  const nlohmann::json plan = nlohmann::json::parse(json.out);
  std::vector<int> state_layers;
  for (const auto& buffer : plan["buffers"]) {
    const std::string name = buffer["name"];
    if (buffer["kind"] == "state" && name.size() > 6 && name.substr(name.size() - 6) == ".state") {
      state_layers.push_back(buffer["layer"].get<int>());
    }
  }
  CHECK(state_layers == spec.kda_layers);

  // The timing table of a run: model layer, then KDA index.
  TempDir dir;
  const std::string yaml = dir.file("gap.yaml");
  std::ofstream(yaml) << "hidden_size: 64\nnum_hidden_layers: 3\nlinear_attn_config:\n"
                         "  num_heads: 1\n  head_dim: 16\n  kda_layers: [1, 3]\n"
                         "  full_attn_layers: [2]\n  gate: softplus\nruntime:\n  max_tokens: 8\n";
  const Result run = kda_run({"--model", yaml, "--tokens", "8", "--backend", "cpu"});
  INFO("run:\n" << run.out << run.err);
  REQUIRE(run.rc == 0);
  CHECK(run.out.find("   layer  KDA index") != std::string::npos);
  // (then each phase's time: projections, conv, core, norm, o_proj)
  CHECK(std::regex_search(run.out,
                          std::regex("\n +1 +0 +[0-9.]+ +[0-9]+( +[0-9.]+){5}\n +3 +1 +[0-9.]+")));
}

TEST_CASE("kda-run --version: the version, the backends of this build and those available here") {
  const Result r = kda_run({"--version"});
  REQUIRE(r.rc == 0);
  CHECK(std::regex_search(r.out, std::regex("^kda-run [0-9]+\\.[0-9]+\\.[0-9]+\n")));
  std::string why_not;
  const bool cuda_here = kda::engine::cuda_backend_available(&why_not);
  const std::string expected =
      !kda::cuda_compiled() ? "backends built: cpu; available here: cpu\n"
      : cuda_here           ? "backends built: cpu cuda; available here: cpu cuda\n"
                  : "backends built: cpu cuda; available here: cpu (cuda: " + why_not + ")\n";
  CHECK(r.out.find(expected) != std::string::npos);
  if (kda::cuda_compiled() && kda::cuda_device_count() == 0) {
    CHECK(r.out.find("(cuda: no CUDA device found)") != std::string::npos);
  }
  CHECK(r.err.empty());
  CHECK(kda_run({"--version=1"}).rc == 2);
}

TEST_CASE("kda-run: backend auto says why it chose the CPU") {
  std::string why_not;
  if (kda::engine::cuda_backend_available(&why_not)) {
    // tiny.yaml runs on CUDA here; a head_dim the CUDA whole layer cannot run stays on the CPU.
    TempDir dir;
    const std::string yaml = dir.file("d64.yaml");
    std::string text = read_text(kModels + "tiny.yaml");
    const std::string head_dim = "head_dim: 128";
    REQUIRE(text.find(head_dim) != std::string::npos);
    std::ofstream(yaml) << text.replace(text.find(head_dim), head_dim.size(), "head_dim: 64");
    const Result r = kda_run({"--model", yaml, "--tokens", "16", "--threads", "1"});
    INFO(r.out << r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("\nbackend: cpu (1 thread; auto: KDA layer (CUDA): head_dim 64 is not 128 "
                     "(the CUDA core and the gated-norm kernel run D = 128))\n") !=
          std::string::npos);
    return;
  }
  const std::string line = "backend: cpu (1 thread; auto: " + why_not + ")\n";
  CHECK(why_not ==
        (kda::cuda_compiled() ? "no CUDA device found" : "this build has no CUDA backend"));
  const Result run =
      kda_run({"--model", kModels + "tiny.yaml", "--tokens", "16", "--threads", "1"});
  INFO(run.out << run.err);
  REQUIRE(run.rc == 0);
  CHECK(run.out.find("\n" + line) != std::string::npos);
  // --plan-only says it too; an explicit --backend needs no reason.
  const Result plan = kda_run({"--model", kModels + "tiny.yaml", "--plan-only"});
  CHECK(plan.out.find("\nbackend: cpu (auto: " + why_not + ")\n") != std::string::npos);
  const Result cpu = kda_run(
      {"--model", kModels + "tiny.yaml", "--tokens", "16", "--threads", "1", "--backend", "cpu"});
  CHECK(cpu.out.find("\nbackend: cpu (1 thread)\n") != std::string::npos);
  // CUDA asked for where it cannot run: the reason, before anything is printed.
  const Result cuda = kda_run({"--model", kModels + "tiny.yaml", "--backend", "cuda"});
  CHECK(cuda.rc == 1);
  CHECK(cuda.out.empty());
  CHECK(cuda.err == "kda-run: error: " + kModels + "tiny.yaml: --backend cuda: " + why_not + "\n");
}

TEST_CASE(
    "kda-run --model: a directory without config.json, and a missing weights file, are named") {
  TempDir dir;
  Result r = kda_run({"--model", dir.path.string(), "--plan-only"});
  CHECK(r.rc == 1);
  CHECK(r.err == "kda-run: error: " + dir.path.string() +
                     ": is a directory without config.json (a Hugging Face model folder holds "
                     "config.json and its weights, model.safetensors or "
                     "model.safetensors.index.json; a model description is a YAML/JSON file)\n");

  // weights: resolved against the YAML's directory; reported by --plan-only (which reads no
  // weights), --json and a run alike, naming the model file, the key and the resolved path.
  const std::string yaml = dir.file("m.yaml");
  std::ofstream(yaml) << read_text(kModels + "tiny.yaml") << "weights: sub/w.safetensors\n";
  const std::string resolved = (fs::path(dir.path) / "sub" / "w.safetensors").string();
  for (const std::vector<std::string>& extra : {std::vector<std::string>{"--plan-only"},
                                                {"--plan-only", "--json"},
                                                {"--tokens", "16", "--backend", "cpu"}}) {
    std::vector<std::string> args = {"--model", yaml};
    args.insert(args.end(), extra.begin(), extra.end());
    CAPTURE(extra.front());
    r = kda_run(args);
    CHECK(r.rc == 1);
    CHECK(r.out.empty());
    CHECK(r.err.find("kda-run: error: " + yaml + ": weights: '" + resolved + "' does not exist") ==
          0);
  }
  // A directory where the weights file should be.
  fs::create_directories(resolved);
  r = kda_run({"--model", yaml, "--plan-only"});
  CHECK(r.rc == 1);
  CHECK(r.err.find(resolved + "' is a directory") != std::string::npos);
}

TEST_CASE("kda-run: a small synthetic run with decode steps reports times and tokens/s") {
  const Result r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "96", "--sequences", "3",
                            "--decode-steps", "4", "--backend", "cpu", "--seed", "7"});
  INFO("stderr: " << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("memory plan") != std::string::npos);
  CHECK(r.out.find("prefill: 96 tokens in 3 sequences") != std::string::npos);
  CHECK(r.out.find("tokens/s") != std::string::npos);
  CHECK(r.out.find("decode: 4 steps") != std::string::npos);
  CHECK(r.out.find("median") != std::string::npos);
  CHECK(r.err.empty());  // no progress bar when stderr is not a terminal
}

TEST_CASE("kda-run --verify-tokens: speculative verify steps in each form") {
  for (const char* form : {"tokens", "records", "fold"}) {
    CAPTURE(form);
    const Result r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "96", "--sequences",
                              "3", "--decode-steps", "3", "--verify-tokens", "4", "--verify-form",
                              form, "--backend", "cpu", "--threads", "2"});
    INFO("stderr: " << r.err);
    REQUIRE(r.rc == 0);
    const std::string kind = std::string(form) == "tokens"    ? "per-token states"
                             : std::string(form) == "records" ? "records + a commit"
                                                              : "records, each folding the step "
                                                                "before";
    CHECK(r.out.find("decode: 3 verify steps of 4 tokens (" + kind + ") x 3 sequences") !=
          std::string::npos);
    CHECK(r.out.find("us per layer-step (eager: the CPU backend)") != std::string::npos);
  }
  // More verified token rows than prefill tokens: the synthetic inputs hold both.
  const Result few = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "8", "--sequences", "4",
                              "--decode-steps", "2", "--verify-tokens", "4", "--verify-form",
                              "records", "--backend", "cpu", "--threads", "2"});
  INFO("stderr: " << few.err);
  CHECK(few.rc == 0);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--verify-form", "fold"},
        // out of [2, 16], with decode steps to verify (so that only the bound refuses them)
        {"--verify-tokens", "1", "--decode-steps", "1"},
        {"--verify-tokens", "17", "--decode-steps", "1"},
        {"--verify-tokens", "4", "--verify-form", "both"},
        {"--verify-tokens", "4", "--ranks", "2"},
        {"--verify-tokens", "4", "--plan-only"},
        // no decode steps to verify
        {"--verify-tokens", "4"},
        // 8 slots, but --max-sequences 4
        {"--verify-tokens", "4", "--verify-form", "tokens", "--decode-steps", "1", "--sequences",
         "2", "--max-sequences", "4"}}) {
    std::vector<std::string> full = {"--model", kModels + "tiny.yaml", "--backend", "cpu"};
    full.insert(full.end(), args.begin(), args.end());
    const Result bad = kda_run(full);
    CAPTURE(args[0] + " " + args[1]);
    CHECK(bad.rc == 2);
  }
}

TEST_CASE("kda-run --ranks: a tensor-parallel run over threads reports the all-reduce's share") {
  const Result r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "64", "--ranks", "2",
                            "--decode-steps", "2", "--backend", "cpu", "--threads", "2"});
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("tensor parallel: 2 ranks as threads of this process, 2 heads each") !=
        std::string::npos);
  CHECK(r.out.find("all-reduce of 64 x 512 bf16") != std::string::npos);
  CHECK(r.out.find("all-reduce share") != std::string::npos);
  CHECK(r.out.find("decode: 2 steps") != std::string::npos);
  // What it cannot run is a usage error.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--ranks", "3"},
                                               {"--ranks", "2", "--core-only"},
                                               {"--ranks", "0"},
                                               {"--ranks", "2", "--plan-only"}}) {
    std::vector<std::string> full = {"--model", kModels + "tiny.yaml", "--backend", "cpu"};
    full.insert(full.end(), args.begin(), args.end());
    const Result bad = kda_run(full);
    CAPTURE(args[0] + " " + args[1]);
    CHECK(bad.rc == 2);
  }
}

TEST_CASE("kda-run --case: varlen / softplus / fp32 initial and final state") {
  kda::test::CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 32;
  o.head_dim_v = 32;
  o.lengths = {5, 0, 17, 33};
  o.gate = kda::GateMode::kSoftplus;
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  o.seed = 1234;
  check_round_trip(kda::test::make_case(o));
}

TEST_CASE(
    "kda-run --case: fixed length / lower_bound gate / bf16 state by default / custom scale") {
  kda::test::CaseOptions o;
  o.heads = 3;
  o.head_dim_k = 16;
  o.head_dim_v = 24;
  o.batch = 2;
  o.seq_len = 20;
  o.gate = kda::GateMode::kLowerBound;
  o.lower_bound = -4.0f;
  o.scale = 0.3f;
  o.initial_state_dtype = DType::kBF16;
  o.final_state_dtype = DType::kBF16;  // what the file gets when it names no final_state
  o.seed = 77;
  check_round_trip(kda::test::make_case(o), /*write_final_state_key=*/false);
}

TEST_CASE("kda-run --case: int32 cu_seqlens / no state in or out") {
  kda::test::CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 16;
  o.head_dim_v = 16;
  o.lengths = {1, 16, 15};
  o.cu_seqlens_dtype = DType::kI32;
  o.final_state_dtype = DType::kNone;
  o.seed = 5;
  check_round_trip(kda::test::make_case(o));
}

TEST_CASE("kda-run --case: bad files exit 1 / name the problem and write nothing") {
  const CaseFile good = to_case_file(small_case());
  {
    TempDir dir;
    good.save(dir.file("good.safetensors"));
    const std::string bytes = read_text(dir.file("good.safetensors"));
    check_rejected_bytes(bytes.substr(0, bytes.size() - 7), "past the end");
    check_rejected_bytes(bytes.substr(0, 5), "truncated");
    check_rejected_bytes(std::string(), "empty");
    check_rejected_bytes(std::string("\x08\0\0\0\0\0\0\0{garbage", 16), "JSON");
  }
  CaseFile bad = good;
  bad.tensors.erase("beta");
  check_rejected(bad, "missing tensor 'beta'");

  auto with_cu = [&good](std::vector<std::int64_t> cu) {
    CaseFile f = good;
    f.tensors.erase("cu_seqlens");
    const auto n = static_cast<std::int64_t>(cu.size());
    Tensor t = typed_tensor("cu_seqlens", DType::kI64, cu, {n});
    f.tensors.emplace(t.name, t);
    return f;
  };
  check_rejected(with_cu({1, 3, 8}), "cu_seqlens[0] must be 0 (got 1)");
  check_rejected(with_cu({0, 6, 5}), "cu_seqlens must be non-decreasing");
  check_rejected(with_cu({0, 3, 7}), "cu_seqlens[2] must equal seq_len 8 (got 7)");

  bad = good;
  bad.metadata["gate"] = "sigmoid";
  check_rejected(bad, "metadata 'gate' is 'sigmoid'");
  bad.metadata.erase("gate");
  check_rejected(bad, "metadata 'gate' is missing");
  for (const char* bound : {"-6", "0", "0.5", "nan", "inf", "-5.5"}) {
    CAPTURE(bound);
    bad = good;
    bad.metadata["lower_bound"] = bound;
    check_rejected(bad, "outside [-5, 0)");
  }
  // Shown as written; checked as written and as the float the core takes.
  bad = good;
  bad.metadata["lower_bound"] = "-5.0000000001";
  check_rejected(bad, "metadata 'lower_bound' is -5.0000000001, outside [-5, 0) or not finite");
  bad.metadata["lower_bound"] = "-1e-300";
  check_rejected(bad,
                 "metadata 'lower_bound' is -1e-300, outside [-5, 0) or not finite (as a "
                 "float it is -0)");
  bad = good;
  bad.metadata["lower_bound"] = "minus two";
  check_rejected(bad, "not a number");
  bad.metadata.erase("lower_bound");
  check_rejected(bad, "'lower_bound' is required");
  bad = good;
  bad.metadata["gate"] = "softplus";  // the bound of a bounded gate left beside softplus
  check_rejected(bad, "'lower_bound' is given with gate softplus");
  bad = good;
  bad.metadata["final_state"] = "fp64";
  check_rejected(bad, "final_state");
  bad = good;
  bad.metadata["scale"] = "-1";
  check_rejected(bad, "scale");
  // A scale that is 0 as a float would be taken as K^-1/2: refused, not replaced.
  bad.metadata["scale"] = "1e-300";
  check_rejected(bad,
                 "metadata 'scale' is 1e-300, expected a finite value > 0 (as a float: from "
                 "1.4e-45 up)");
  // Decimal only, as the other metadata numbers: no leading space, no hexadecimal.
  for (const char* written : {" 0.5", "0x1p-3", "0.5 "}) {
    CAPTURE(written);
    bad.metadata["scale"] = written;
    check_rejected(bad, "not a number");
  }

  bad = good;  // dt_bias neither [H, K] nor [H * K]
  bad.tensors.at("dt_bias").shape = {16, 1};
  check_rejected(bad, "tensor 'dt_bias' has shape [16, 1], expected [2, 8] ([H, K] or [H * K])");
  bad = good;
  bad.tensors.at("A_log").shape = {1, 2, 1};
  check_rejected(bad, "tensor 'A_log' has shape [1, 2, 1], expected [2] ([H] or [1, 1, H, 1])");
  bad = good;
  bad.tensors.erase("q");
  {
    std::vector<float> q(2 * 8 * 8, 0.5f);
    Tensor t = typed_tensor("q", DType::kF32, q, {1, 8, 2, 8});
    bad.tensors.emplace(t.name, t);
  }
  check_rejected(bad, "tensor 'q' has dtype F32, expected BF16");
  bad = good;
  bad.tensors.at("initial_state").shape = {3, 2, 8, 8};
  bad.tensors.at("initial_state").data.resize(3 * 2 * 8 * 8 * 4);
  check_rejected(bad, "initial_state");

  // What only the operator checks (parameter values) still names the case file.
  bad = good;
  bad.tensors.at("A_log").data_as<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  check_rejected(bad, "in.safetensors: CPU forward: A_log[0] is not finite");
}

// A_log and dt_bias as Kimi-Linear's checkpoints store them ([1, 1, H, 1], [H * K]): the same
// forward, bit for bit.
TEST_CASE("kda-run --case: A_log and dt_bias in their checkpoint shapes run the same forward") {
  const CaseFile plain = to_case_file(small_case());
  CaseFile released = plain;
  const std::int64_t H = plain.tensors.at("A_log").shape[0];
  const std::int64_t K = plain.tensors.at("dt_bias").shape[1];
  released.tensors.at("A_log").shape = {1, 1, H, 1};
  released.tensors.at("dt_bias").shape = {H * K};
  TempDir dir;
  plain.save(dir.file("plain.safetensors"));
  released.save(dir.file("released.safetensors"));
  for (const char* name : {"plain", "released"}) {
    const Result r =
        kda_run({"--case", dir.file(std::string(name) + ".safetensors"), "--output",
                 dir.file(std::string(name) + "-out.safetensors"), "--backend", "cpu"});
    INFO(r.err);
    REQUIRE(r.rc == 0);
  }
  const auto a = kda::engine::SafetensorsFile::open(dir.file("plain-out.safetensors"));
  const auto b = kda::engine::SafetensorsFile::open(dir.file("released-out.safetensors"));
  CHECK(a.read("out").data == b.read("out").data);
  CHECK(a.read("final_state").data == b.read("final_state").data);
}

TEST_CASE("kda-run --case: an --output that is the case file is refused, the file kept") {
  TempDir dir;
  const std::string in = dir.file("in.safetensors");
  to_case_file(small_case()).save(in);
  const std::string original = read_text(in);
  fs::create_directories(dir.file("sub"));
  fs::create_symlink(in, dir.file("link.safetensors"));
  fs::create_hard_link(in, dir.file("hard.safetensors"));
  fs::create_directory_symlink(dir.path, dir.file("dirlink"));
  const std::vector<std::string> same_file = {
      in,                                       // the same path
      dir.file("sub") + "/../in.safetensors",   // spelled differently
      dir.file("link.safetensors"),             // a symlink to it
      dir.file("hard.safetensors"),             // a hard link to it
      dir.file("dirlink") + "/in.safetensors",  // through a symlinked directory
  };
  for (const std::string& out : same_file) {
    CAPTURE(out);
    const Result r = kda_run({"--case", in, "--output", out, "--backend", "cpu"});
    CHECK(r.rc == 1);
    CHECK(r.err == "kda-run: error: " + out + ": is the case file '" + in +
                       "' itself (same file); refusing to overwrite the input, nothing written\n");
    CHECK(read_text(in) == original);
    CHECK(fs::is_symlink(dir.file("link.safetensors")));
    CHECK(fs::hard_link_count(in) == 2);
  }
  CHECK(dir.entries() == 5u);  // in, sub, link, hard, dirlink: no temporaries, no outputs

  // The case file given through the link, written next to it: runs.
  const Result r = kda_run({"--case", dir.file("link.safetensors"), "--output",
                            dir.file("sub/out.safetensors"), "--backend", "cpu"});
  CHECK(r.rc == 0);
  CHECK(fs::exists(dir.file("sub/out.safetensors")));
  CHECK(read_text(in) == original);
}

// ---- decode mode and prefill checkpoints -----------------------------------------------------

namespace {

// Runs kda-run --case on `file` (CPU) and opens the output.
kda::engine::SafetensorsFile run_case_cpu(const CaseFile& file, const TempDir& dir,
                                          const std::string& name) {
  file.save(dir.file(name + ".safetensors"));
  const Result r = kda_run({"--case", dir.file(name + ".safetensors"), "--output",
                            dir.file(name + "-out.safetensors"), "--backend", "cpu"});
  INFO("stderr: " << r.err);
  REQUIRE(r.rc == 0);
  return kda::engine::SafetensorsFile::open(dir.file(name + "-out.safetensors"));
}

// Tokens [t0, t1) of every row of a fixed-length case's [B, T, H, X] tensor.
std::vector<std::uint16_t> tokens_of(const std::vector<std::uint16_t>& x, std::int64_t B,
                                     std::int64_t T, std::int64_t token_elems, std::int64_t t0,
                                     std::int64_t t1) {
  std::vector<std::uint16_t> step;
  for (std::int64_t b = 0; b < B; ++b) {
    step.insert(step.end(), x.begin() + (b * T + t0) * token_elems,
                x.begin() + (b * T + t1) * token_elems);
  }
  return step;
}

// What the CPU operator gives for the tokens of `c` (B rows of T tokens) by plain decode calls on
// a pool of B states in `state_dtype`, from c's f32 initial state (rounded for a bf16 pool).
// kOneByOne: T calls of one token each, chained through the pool. kPrefixes: for each t, one call
// of tokens [0, t] from the initial state (a call carries its state in fp32 from token to token,
// rounding it to the pool's dtype once at the end, as a verify step does for each state it keeps).
enum class Calls { kOneByOne, kPrefixes };
struct DecodeCalls {
  std::vector<std::uint16_t> out;    // bf16 [B, T, H, V]
  std::vector<std::uint8_t> states;  // [B, T, H, V, K] in state_dtype: after each token
};
DecodeCalls decode_calls(const kda::test::KdaCase& c, DType state_dtype, Calls calls) {
  const kda::Problem& p = c.problem;
  const std::int64_t B = p.batch, T = p.seq_len, H = p.num_heads, K = p.head_dim_k,
                     V = p.head_dim_v;
  const std::int64_t state = H * V * K;
  const std::size_t state_bytes = static_cast<std::size_t>(state) * kda::dtype_size(state_dtype);
  std::vector<std::uint8_t> initial(static_cast<std::size_t>(B) * state_bytes);
  for (std::int64_t i = 0; i < B * state; ++i) {
    const float x = c.initial_state[static_cast<std::size_t>(i)];
    if (state_dtype == DType::kF32) {
      std::memcpy(initial.data() + i * 4, &x, 4);
    } else {
      const std::uint16_t bits = kda::float_to_bf16(x);
      std::memcpy(initial.data() + i * 2, &bits, 2);
    }
  }
  std::vector<std::uint8_t> pool = initial;
  DecodeCalls r;
  r.out.assign(static_cast<std::size_t>(B * T * H * V), 0);
  r.states.assign(static_cast<std::size_t>(B * T) * state_bytes, 0);
  std::vector<std::int32_t> slots;
  for (std::int64_t b = 0; b < B; ++b) slots.push_back(static_cast<std::int32_t>(b));
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t t0 = calls == Calls::kOneByOne ? t : 0, n = t + 1 - t0;
    if (calls == Calls::kPrefixes) pool = initial;
    kda::DecodeProblem d;
    d.batch = B;
    d.tokens = n;
    d.num_heads = H;
    d.head_dim_k = K;
    d.head_dim_v = V;
    d.num_slots = B;
    d.state_dtype = state_dtype;
    d.gate = p.gate;
    d.lower_bound = p.lower_bound;
    d.scale = p.scale;
    const auto q = tokens_of(c.q, B, T, H * K, t0, t + 1),
               k = tokens_of(c.k, B, T, H * K, t0, t + 1),
               g = tokens_of(c.g, B, T, H * K, t0, t + 1),
               v = tokens_of(c.v, B, T, H * V, t0, t + 1),
               beta = tokens_of(c.beta, B, T, H, t0, t + 1);
    std::vector<std::uint16_t> out(static_cast<std::size_t>(B * n * H * V));
    kda::DecodeTensors dt;
    dt.q = q.data();
    dt.k = k.data();
    dt.v = v.data();
    dt.g = g.data();
    dt.beta = beta.data();
    dt.A_log = c.A_log.data();
    dt.dt_bias = c.dt_bias.data();
    dt.slots = slots.data();
    dt.state_pool = pool.data();
    dt.out = out.data();
    const kda::Status st = kda::decode_cpu(d, dt);
    INFO(st.to_string());
    REQUIRE(st.ok());
    for (std::int64_t b = 0; b < B; ++b) {  // the out of token t, the state after it
      std::copy(out.begin() + (b * n + n - 1) * H * V, out.begin() + (b * n + n) * H * V,
                r.out.begin() + (b * T + t) * H * V);
      std::memcpy(r.states.data() + static_cast<std::size_t>(b * T + t) * state_bytes,
                  pool.data() + static_cast<std::size_t>(b) * state_bytes, state_bytes);
    }
  }
  return r;
}

kda::test::KdaCase decode_case(std::int64_t tokens) {
  kda::test::CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 16;
  o.head_dim_v = 16;
  o.batch = 3;
  o.seq_len = tokens;
  o.gate = kda::GateMode::kLowerBound;
  o.lower_bound = -3.0f;
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  o.seed = 404;
  return kda::test::make_case(o);
}

}  // namespace

TEST_CASE("kda-run --case: decode mode equals the CPU decode one token at a time") {
  const kda::test::KdaCase c = decode_case(4);
  const std::int64_t B = 3, T = 4, H = 2, K = 16, V = 16;
  TempDir dir;
  for (const DType state_dtype : {DType::kF32, DType::kBF16}) {
    const bool f32 = state_dtype == DType::kF32;
    CAPTURE(f32);
    CaseFile f = to_case_file(c);  // f32 initial state [B, H, V, K]
    f.metadata["mode"] = "decode";
    f.metadata["final_state"] = f32 ? "f32" : "bf16";  // bf16: the f32 initial state rounded
    const auto out_file = run_case_cpu(f, dir, f32 ? "f32" : "bf16");
    // An f32 state: the verify step equals T one-token calls bit for bit. A bf16 one is rounded
    // only where it is kept, as at the end of a call of tokens [0, t].
    const DecodeCalls expected =
        decode_calls(c, state_dtype, f32 ? Calls::kOneByOne : Calls::kPrefixes);

    const Tensor out = out_file.read("out");
    CHECK(out.shape == std::vector<std::int64_t>{B, T, H, V});
    CHECK(values_of<std::uint16_t>(out) == expected.out);
    const Tensor states = out_file.read("intermediate_states");
    CHECK(states.dtype == state_dtype);
    CHECK(states.shape == std::vector<std::int64_t>{B, T, H, V, K});
    CHECK(states.data == expected.states);  // bit for bit
    const Tensor final_state = out_file.read("final_state");
    CHECK(final_state.dtype == state_dtype);
    CHECK(final_state.shape == std::vector<std::int64_t>{B, H, V, K});
    const std::size_t state_bytes =
        static_cast<std::size_t>(H * V * K) * kda::dtype_size(state_dtype);
    for (std::int64_t b = 0; b < B; ++b) {
      CAPTURE(b);
      CHECK(std::memcmp(final_state.data.data() + b * state_bytes,
                        states.data.data() + (b * T + T - 1) * state_bytes, state_bytes) == 0);
    }
    CHECK(out_file.metadata().at("backend") == "cpu");
  }
  {  // No initial state: the rows start from zeros.
    CaseFile f = to_case_file(c);
    f.tensors.erase("initial_state");
    f.metadata["mode"] = "decode";
    kda::test::KdaCase zero = c;
    std::fill(zero.initial_state.begin(), zero.initial_state.end(), 0.0f);
    const auto out_file = run_case_cpu(f, dir, "zero");
    const DecodeCalls expected = decode_calls(zero, DType::kF32, Calls::kOneByOne);
    CHECK(values_of<std::uint16_t>(out_file.read("out")) == expected.out);
    CHECK(out_file.read("intermediate_states").data == expected.states);
  }
}

TEST_CASE("kda-run --case: decode mode refuses what it cannot run, naming the file") {
  CaseFile f = to_case_file(decode_case(17));
  f.metadata["mode"] = "decode";
  check_rejected(f,
                 "in.safetensors: tensor 'q' has shape [3, 17, 2, 16]: decode mode takes 1 to "
                 "16 tokens per row (T), got T = 17");
  CaseFile good = to_case_file(decode_case(4));
  good.metadata["mode"] = "decode";
  CaseFile bad = good;
  bad.metadata["mode"] = "verify";
  check_rejected(bad, "in.safetensors: metadata 'mode' is 'verify', expected prefill or decode");
  bad = good;
  bad.metadata["final_state"] = "none";
  check_rejected(bad,
                 "in.safetensors: metadata 'final_state' is 'none', but decode mode always "
                 "writes its states");
  bad = good;
  bad.tensors.at("initial_state").shape = {3, 2, 16, 8};
  bad.tensors.at("initial_state").data.resize(3 * 2 * 16 * 8 * 4);
  check_rejected(bad,
                 "in.safetensors: tensor 'initial_state' has shape [3, 2, 16, 8], expected "
                 "[3, 2, 16, 16]");
  bad = good;
  bad.tensors.emplace(
      "checkpoint_offsets",
      typed_tensor("checkpoint_offsets", DType::kI64, std::vector<std::int64_t>{4, 4, 4}, {3, 1}));
  check_rejected(bad,
                 "in.safetensors: tensor 'checkpoint_offsets' is given, but decode mode "
                 "takes none");
  CaseFile varlen = to_case_file(small_case());  // cu_seqlens [3]
  varlen.metadata["mode"] = "decode";
  check_rejected(varlen,
                 "in.safetensors: tensor 'cu_seqlens' is given, but decode mode takes "
                 "none");
  // What only the operator checks names the file too.
  bad = good;
  bad.tensors.at("A_log").data_as<float>()[1] = std::numeric_limits<float>::infinity();
  check_rejected(bad, "in.safetensors: CPU decode: A_log[1] is not finite");
}

namespace {

// A case of the first `tokens` tokens of sequence `n` of the varlen case `c`, from its initial
// state: a prefix of that sequence on its own.
CaseFile prefix_case(const kda::test::KdaCase& c, std::int64_t n, std::int64_t tokens) {
  const kda::Problem& p = c.problem;
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  const std::int64_t begin = c.seq_begin(n);
  auto slice = [&](const std::vector<std::uint16_t>& x, std::int64_t row) {
    return std::vector<std::uint16_t>(x.begin() + begin * row, x.begin() + (begin + tokens) * row);
  };
  CaseFile f = to_case_file(c);
  f.tensors.clear();
  auto add = [&f](Tensor t) { f.tensors.emplace(t.name, std::move(t)); };
  add(bf16_tensor("q", slice(c.q, H * K), {1, tokens, H, K}));
  add(bf16_tensor("k", slice(c.k, H * K), {1, tokens, H, K}));
  add(bf16_tensor("g", slice(c.g, H * K), {1, tokens, H, K}));
  add(bf16_tensor("v", slice(c.v, H * V), {1, tokens, H, V}));
  add(bf16_tensor("beta", slice(c.beta, H), {1, tokens, H}));
  add(typed_tensor("A_log", DType::kF32, c.A_log, {H}));
  add(typed_tensor("dt_bias", DType::kF32, c.dt_bias, {H, K}));
  const std::vector<float> initial(c.initial_state.begin() + n * H * V * K,
                                   c.initial_state.begin() + (n + 1) * H * V * K);
  add(typed_tensor("initial_state", DType::kF32, initial, {1, H, V, K}));
  return f;
}

}  // namespace

TEST_CASE("kda-run --case: prefill checkpoints equal the final states of the prefixes") {
  kda::test::CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 16;
  o.head_dim_v = 16;
  o.lengths = {37, 20};
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  o.seed = 808;
  const kda::test::KdaCase c = kda::test::make_case(o);
  const std::int64_t H = 2, K = 16, V = 16, state = H * V * K;
  const std::vector<std::int32_t> offsets = {16, 37, 0, -1};
  CaseFile f = to_case_file(c);
  f.tensors.emplace("checkpoint_offsets",
                    typed_tensor("checkpoint_offsets", DType::kI32, offsets, {2, 2}));
  TempDir dir;
  const auto out_file = run_case_cpu(f, dir, "whole");
  const Tensor checkpoints = out_file.read("checkpoint_states");
  CHECK(checkpoints.dtype == DType::kF32);
  REQUIRE(checkpoints.shape == std::vector<std::int64_t>{2, 2, H, V, K});
  const auto values = values_of<float>(checkpoints);
  const auto final_state = values_of<float>(out_file.read("final_state"));
  // The sequences' own outputs are those of a run without checkpoints.
  CaseFile plain = to_case_file(c);
  const auto plain_file = run_case_cpu(plain, dir, "plain");
  CHECK(values_of<std::uint16_t>(out_file.read("out")) ==
        values_of<std::uint16_t>(plain_file.read("out")));
  CHECK(final_state == values_of<float>(plain_file.read("final_state")));

  for (std::int64_t i = 0; i < 4; ++i) {
    const std::int64_t n = i / 2, offset = offsets[static_cast<std::size_t>(i)];
    CAPTURE(n);
    CAPTURE(offset);
    const std::vector<float> got(values.begin() + i * state, values.begin() + (i + 1) * state);
    if (offset < 0) {
      CHECK(got == std::vector<float>(static_cast<std::size_t>(state), 0.0f));
      continue;
    }
    const auto prefix = run_case_cpu(prefix_case(c, n, offset), dir, "prefix" + std::to_string(i));
    CHECK(got == values_of<float>(prefix.read("final_state")));
  }
  // The checkpoint at a sequence's length is its final state.
  CHECK(std::vector<float>(values.begin() + state, values.begin() + 2 * state) ==
        std::vector<float>(final_state.begin(), final_state.begin() + state));

  {  // final_state none: the checkpoints alone, in f32, from a bf16 initial state.
    CaseFile g = f;
    g.metadata["final_state"] = "none";
    const auto none_file = run_case_cpu(g, dir, "none");
    CHECK(none_file.find("final_state") == nullptr);
    CHECK(none_file.read("checkpoint_states").dtype == DType::kF32);
    CHECK(values_of<float>(none_file.read("checkpoint_states")) == values);
    g.metadata["final_state"] = "bf16";
    const auto bf16_file = run_case_cpu(g, dir, "bf16");
    CHECK(bf16_file.read("checkpoint_states").dtype == DType::kBF16);
    CHECK(bf16_file.read("final_state").dtype == DType::kBF16);
  }

  // Offsets the library refuses, named with the file; a tensor of the wrong shape.
  CaseFile bad = f;
  bad.tensors.at("checkpoint_offsets").data_as<std::int32_t>()[0] = 24;
  check_rejected(bad,
                 "in.safetensors: CPU forward: checkpoint_offsets[0][0] = 24 is not -1, a "
                 "multiple of 16 up to the sequence's length 37, or that length");
  bad = f;
  bad.tensors.at("checkpoint_offsets").data_as<std::int32_t>()[2] = 32;
  check_rejected(bad, "checkpoint_offsets[1][0] = 32 is not -1");
  bad = f;
  bad.tensors.erase("checkpoint_offsets");
  bad.tensors.emplace("checkpoint_offsets",
                      typed_tensor("checkpoint_offsets", DType::kI64,
                                   std::vector<std::int64_t>{16, 16, 16}, {3, 1}));
  check_rejected(bad,
                 "in.safetensors: tensor 'checkpoint_offsets' has shape [3, 1], expected "
                 "[2, R]");
  bad = f;
  bad.tensors.erase("checkpoint_offsets");
  bad.tensors.emplace("checkpoint_offsets", typed_tensor("checkpoint_offsets", DType::kF32,
                                                         std::vector<float>{16, 16}, {2, 1}));
  check_rejected(bad, "tensor 'checkpoint_offsets' has dtype F32, expected I64 or I32");
}

// On CUDA the decode line names the kernel the whole layers' steps ran: auto's one launch for one
// sequence of one token, or the kernel --decode-step forces; with --ranks, rank 0's.
TEST_CASE("kda-run: the decode line names the kernel the CUDA steps ran") {
  if (!kda::engine::cuda_backend_available()) {
    MESSAGE("KDA_SKIP: no CUDA device (this test needs one)");
    return;
  }
  const struct {
    const char* flag;
    const char* ends;
  } runs[] = {{"auto", "(CUDA graph replays; one-launch step)\n"},
              {"separate", "(CUDA graph replays; separate step)\n"},
              {"fused", "(CUDA graph replays; fused step)\n"}};
  for (const auto& run : runs) {
    CAPTURE(run.flag);
    const Result r = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "16", "--decode-steps",
                              "3", "--backend", "cuda", "--decode-step", run.flag});
    INFO(r.out << r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find(run.ends) != std::string::npos);
  }
  // Tensor-parallel ranks on streams of one GPU take the fused step unless told otherwise.
  const Result ranks = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "16", "--ranks", "2",
                                "--decode-steps", "2", "--backend", "cuda"});
  INFO(ranks.out << ranks.err);
  REQUIRE(ranks.rc == 0);
  CHECK(ranks.out.find("(rank 0, eager; fused step)\n") != std::string::npos);
}

// The same file at K = V = 128 on CUDA: the checkpoints within the CUDA tolerance of the CPU's, and
// the one at a sequence's length its final state, bit for bit.
TEST_CASE("kda-run --case: prefill checkpoints on CUDA equal the CPU's within tolerance") {
  if (!kda::engine::cuda_backend_available()) {
    MESSAGE("KDA_SKIP: no CUDA device (this test needs one)");
    return;
  }
  kda::test::CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 128;
  o.head_dim_v = 128;
  o.lengths = {37, 20};
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  o.seed = 809;
  const kda::test::KdaCase c = kda::test::make_case(o);
  const std::int64_t state = 2 * 128 * 128;
  CaseFile f = to_case_file(c);
  f.tensors.emplace("checkpoint_offsets",
                    typed_tensor("checkpoint_offsets", DType::kI32,
                                 std::vector<std::int32_t>{16, 37, 0, -1}, {2, 2}));
  TempDir dir;
  f.save(dir.file("in.safetensors"));
  for (const char* backend : {"cpu", "cuda"}) {
    const Result r =
        kda_run({"--case", dir.file("in.safetensors"), "--output",
                 dir.file(std::string(backend) + ".safetensors"), "--backend", backend});
    INFO("stderr: " << r.err);
    REQUIRE(r.rc == 0);
  }
  const auto cpu = kda::engine::SafetensorsFile::open(dir.file("cpu.safetensors"));
  const auto gpu = kda::engine::SafetensorsFile::open(dir.file("cuda.safetensors"));
  const auto want = values_of<float>(cpu.read("checkpoint_states"));
  const auto got = values_of<float>(gpu.read("checkpoint_states"));
  REQUIRE(got.size() == want.size());
  CHECK(kda::test::rel_error(got, kda::test::to_doubles(want)) <= 5e-3);
  const auto final_state = values_of<float>(gpu.read("final_state"));
  CHECK(std::vector<float>(got.begin() + state, got.begin() + 2 * state) ==
        std::vector<float>(final_state.begin(), final_state.begin() + state));
  CHECK(std::vector<float>(got.begin() + 3 * state, got.end()) ==
        std::vector<float>(static_cast<std::size_t>(state), 0.0f));
}

// ---- whole layers ----------------------------------------------------------------------------

TEST_CASE("kda-run: whole layers by default, split into phases, and --core-only runs the cores") {
  const Result whole = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "24", "--sequences",
                                "2", "--decode-steps", "2", "--backend", "cpu", "--threads", "2"});
  INFO("whole:\n" << whole.out << whole.err);
  REQUIRE(whole.rc == 0);
  CHECK(whole.out.find("layers: whole (hidden 512, conv width 4)") != std::string::npos);
  CHECK(whole.out.find("weights: random (seed 0)") != std::string::npos);
  CHECK(whole.out.find(" in the arena, widened to fp32)") != std::string::npos);
  CHECK(whole.out.find("A_log and dt_bias, and each KDA layer's weights") != std::string::npos);
  CHECK(whole.out.find("projections       conv       core       norm     o_proj  (ms)") !=
        std::string::npos);
  CHECK(std::regex_search(whole.out, std::regex("plan sum: [0-9.]+ [KMG]iB .*plan reuse: ")));
  CHECK(whole.out.find("decode: 2 steps") != std::string::npos);

  const Result core = kda_run({"--model", kModels + "tiny.yaml", "--tokens", "24", "--backend",
                               "cpu", "--threads", "2", "--core-only"});
  INFO("core:\n" << core.out << core.err);
  REQUIRE(core.rc == 0);
  CHECK(core.out.find("layers: KDA core only") != std::string::npos);
  CHECK(core.out.find("projections") == std::string::npos);
  CHECK(core.out.find("parameters: random (seed 0)") != std::string::npos);
  CHECK(kda_run({"--layer-case", "a", "--output", "b", "--core-only"}).rc == 2);
  CHECK(kda_run({"--layer-case", "a"}).rc == 2);  // no --output
  CHECK(kda_run({"--case", "a", "--layer-case", "b", "--output", "c"}).rc == 2);
  CHECK(kda_run({"--layer-case", "a", "--output", "b", "--model", "m.yaml"}).rc == 2);
}

namespace {

constexpr std::int64_t kLayerE = 48, kLayerH = 4, kLayerD = 16, kLayerW = 4;

kda::layer::Config layer_config() {
  kda::layer::Config c;
  c.hidden_size = kLayerE;
  c.num_heads = kLayerH;
  c.head_dim = kLayerD;
  c.conv_width = kLayerW;
  c.gate = kda::GateMode::kSoftplus;
  c.norm_eps = 1e-5f;
  return c;
}

std::vector<std::uint16_t> random_bits(std::size_t count, float amplitude, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  std::vector<std::uint16_t> bits(count);
  for (auto& b : bits) b = kda::float_to_bf16(dist(rng));
  return bits;
}

// A layer case: weights (bare names), `tokens` hidden states, optional cu_seqlens and states.
CaseFile layer_case(const kda::layer::Weights& weights, const std::vector<std::uint16_t>& hidden) {
  CaseFile f;
  for (const Tensor& t : kda::engine::layer_weight_tensors(weights)) f.tensors.emplace(t.name, t);
  const auto T = static_cast<std::int64_t>(hidden.size()) / kLayerE;
  f.tensors.emplace("hidden_states", bf16_tensor("hidden_states", hidden, {T, kLayerE}));
  f.metadata["gate"] = "softplus";
  return f;
}

// The CPU layer on `hidden` with `n` sequences, from states `init` (rows 0..n-1) when given.
struct LayerRun {
  std::vector<std::uint16_t> out;
  std::vector<std::uint16_t> conv[3];
  std::vector<float> recurrent;
};
LayerRun run_direct(const kda::layer::Weights& weights, const std::vector<std::uint16_t>& hidden,
                    const std::vector<std::int64_t>& cu, const LayerRun* init = nullptr) {
  const auto layer = kda::layer::make_layer(kda::Backend::kCpu, weights);
  const auto N = static_cast<std::int64_t>(cu.size()) - 1;
  LayerRun r;
  r.out.assign(hidden.size(), 0);
  for (int p = 0; p < 3; ++p) {
    r.conv[p] = init ? init->conv[p]
                     : std::vector<std::uint16_t>(
                           static_cast<std::size_t>(N * kLayerH * kLayerD * (kLayerW - 1)), 0);
  }
  r.recurrent = init
                    ? init->recurrent
                    : std::vector<float>(static_cast<std::size_t>(N * kLayerH * kLayerD * kLayerD));
  std::vector<std::uint8_t> ws(
      kda::layer::workspace_bytes(kda::Backend::kCpu, weights.config, cu.back(), N, N));
  const kda::layer::State state{
      N, r.conv[0].data(), r.conv[1].data(), r.conv[2].data(), r.recurrent.data(), DType::kF32};
  kda::layer::Batch batch;
  batch.tokens = cu.back();
  batch.sequences = N;
  batch.cu_seqlens = cu.data();
  layer->forward(batch, hidden.data(), r.out.data(), state, kda::Workspace{ws.data(), ws.size()});
  return r;
}

}  // namespace

TEST_CASE("kda-run --layer-case: varlen with initial states equals the CPU layer, chunks chain") {
  const auto weights = kda::layer::random_weights(layer_config(), 3, 0);
  const std::vector<std::uint16_t> hidden = random_bits(12 * kLayerE, 1.0f, 11);
  TempDir dir;
  {  // Three sequences (one empty), int32 cu_seqlens, random initial conv and recurrent states.
    CaseFile f = layer_case(weights, hidden);
    const std::vector<std::int32_t> cu32 = {0, 5, 5, 12};
    f.tensors.emplace("cu_seqlens", typed_tensor("cu_seqlens", DType::kI32, cu32, {4}));
    LayerRun init;
    const char* names[3] = {"conv_state_q", "conv_state_k", "conv_state_v"};
    for (int p = 0; p < 3; ++p) {
      init.conv[p] = random_bits(3 * kLayerH * kLayerD * (kLayerW - 1), 1.0f, 20 + p);
      f.tensors.emplace(names[p],
                        bf16_tensor(names[p], init.conv[p], {3, kLayerH * kLayerD, kLayerW - 1}));
    }
    for (const std::uint16_t b : random_bits(3 * kLayerH * kLayerD * kLayerD, 0.2f, 30)) {
      init.recurrent.push_back(kda::bf16_to_float(b));
    }
    f.tensors.emplace("recurrent_state",
                      typed_tensor("recurrent_state", DType::kF32, init.recurrent,
                                   {3, kLayerH, kLayerD, kLayerD}));
    f.metadata["norm_eps"] = "1e-5";
    f.save(dir.file("in.safetensors"));
    const Result r = kda_run({"--layer-case", dir.file("in.safetensors"), "--output",
                              dir.file("out.safetensors"), "--backend", "cpu"});
    INFO(r.err);
    REQUIRE(r.rc == 0);
    const auto out = kda::engine::SafetensorsFile::open(dir.file("out.safetensors"));
    const LayerRun expected = run_direct(weights, hidden, {0, 5, 5, 12}, &init);
    CHECK(out.read("out").shape == std::vector<std::int64_t>{12, kLayerE});
    CHECK(values_of<std::uint16_t>(out.read("out")) == expected.out);
    for (int p = 0; p < 3; ++p) {
      CHECK(values_of<std::uint16_t>(out.read(names[p])) == expected.conv[p]);
    }
    CHECK(values_of<float>(out.read("recurrent_state")) == expected.recurrent);
    CHECK(out.metadata().at("backend") == "cpu");
  }
  {  // One sequence in two chunks: the first output's states are the second input's.
    const std::vector<std::uint16_t> first(hidden.begin(), hidden.begin() + 7 * kLayerE);
    const std::vector<std::uint16_t> second(hidden.begin() + 7 * kLayerE, hidden.end());
    layer_case(weights, first).save(dir.file("a.safetensors"));
    REQUIRE(kda_run({"--layer-case", dir.file("a.safetensors"), "--output",
                     dir.file("a-out.safetensors")})
                .rc == 0);
    CaseFile b = layer_case(weights, second);
    const auto a_out = kda::engine::SafetensorsFile::open(dir.file("a-out.safetensors"));
    for (const char* name : {"conv_state_q", "conv_state_k", "conv_state_v", "recurrent_state"}) {
      b.tensors.emplace(name, a_out.read(name));
    }
    b.save(dir.file("b.safetensors"));
    REQUIRE(kda_run({"--layer-case", dir.file("b.safetensors"), "--output",
                     dir.file("b-out.safetensors"), "--backend", "cpu"})
                .rc == 0);
    const auto b_out = kda::engine::SafetensorsFile::open(dir.file("b-out.safetensors"));
    const LayerRun whole = run_direct(weights, hidden, {0, 12});
    const std::vector<std::uint16_t> tail(whole.out.begin() + 7 * kLayerE, whole.out.end());
    const auto chained = values_of<std::uint16_t>(b_out.read("out"));
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < tail.size(); ++i) {
      const double x = kda::bf16_to_float(chained[i]), y = kda::bf16_to_float(tail[i]);
      diff += (x - y) * (x - y);
      norm += y * y;
    }
    CHECK(std::sqrt(diff / norm) <= 1e-3);
    CHECK(values_of<std::uint16_t>(b_out.read("conv_state_v")) == whole.conv[2]);
  }
  {  // final_state none: out only.
    CaseFile f = layer_case(weights, hidden);
    f.metadata["final_state"] = "none";
    f.save(dir.file("n.safetensors"));
    REQUIRE(kda_run({"--layer-case", dir.file("n.safetensors"), "--output",
                     dir.file("n-out.safetensors")})
                .rc == 0);
    const auto out = kda::engine::SafetensorsFile::open(dir.file("n-out.safetensors"));
    CHECK(out.find("out") != nullptr);
    CHECK(out.find("recurrent_state") == nullptr);
  }
}

// Decode mode: two rows of three tokens from random initial states, as one verify step; the
// reference is the CPU layer run three times on one token of each row, its states read after
// every step (an f32 state: the same operations, bit for bit).
TEST_CASE("kda-run --layer-case: decode mode equals one-token steps, every token's states kept") {
  const auto weights = kda::layer::random_weights(layer_config(), 5, 1);
  const std::int64_t B = 2, Td = 3, C = kLayerH * kLayerD, W1 = kLayerW - 1;
  const std::size_t conv_row = static_cast<std::size_t>(C * W1);
  const std::size_t state_row = static_cast<std::size_t>(kLayerH * kLayerD * kLayerD);
  const std::vector<std::uint16_t> hidden = random_bits(B * Td * kLayerE, 1.0f, 61);
  LayerRun state;  // rows 0 and 1: the two rows' states, advanced step by step
  const char* names[3] = {"conv_state_q", "conv_state_k", "conv_state_v"};
  CaseFile f = layer_case(weights, hidden);
  for (int p = 0; p < 3; ++p) {
    state.conv[p] = random_bits(B * conv_row, 1.0f, 62 + p);
    f.tensors.emplace(names[p], bf16_tensor(names[p], state.conv[p], {B, C, W1}));
  }
  for (const std::uint16_t b : random_bits(B * state_row, 0.2f, 66)) {
    state.recurrent.push_back(kda::bf16_to_float(b));
  }
  f.tensors.emplace("recurrent_state", typed_tensor("recurrent_state", DType::kF32, state.recurrent,
                                                    {B, kLayerH, kLayerD, kLayerD}));
  f.metadata["mode"] = "decode";
  f.metadata["tokens"] = "3";
  TempDir dir;
  f.save(dir.file("in.safetensors"));
  const Result r = kda_run({"--layer-case", dir.file("in.safetensors"), "--output",
                            dir.file("out.safetensors"), "--backend", "cpu"});
  INFO(r.err);
  REQUIRE(r.rc == 0);
  const auto out = kda::engine::SafetensorsFile::open(dir.file("out.safetensors"));

  const auto layer = kda::layer::make_layer(kda::Backend::kCpu, weights);
  std::vector<std::uint8_t> ws(
      kda::layer::workspace_bytes(kda::Backend::kCpu, weights.config, B, B, B));
  std::vector<std::uint16_t> want_out(hidden.size());
  std::vector<float> want_states;
  std::vector<std::uint16_t> want_conv[3];
  std::vector<std::vector<float>> per_token(static_cast<std::size_t>(B * Td));
  std::vector<std::vector<std::uint16_t>> per_token_conv[3];
  for (auto& v : per_token_conv) v.resize(static_cast<std::size_t>(B * Td));
  for (std::int64_t t = 0; t < Td; ++t) {
    std::vector<std::uint16_t> step;
    for (std::int64_t b = 0; b < B; ++b) {
      step.insert(step.end(), hidden.begin() + (b * Td + t) * kLayerE,
                  hidden.begin() + (b * Td + t + 1) * kLayerE);
    }
    std::vector<std::uint16_t> step_out(step.size());
    const kda::layer::State st{B,
                               state.conv[0].data(),
                               state.conv[1].data(),
                               state.conv[2].data(),
                               state.recurrent.data(),
                               DType::kF32};
    kda::layer::Batch batch;
    batch.tokens = B;
    batch.sequences = B;
    batch.decode_tokens = 1;
    layer->forward(batch, step.data(), step_out.data(), st, kda::Workspace{ws.data(), ws.size()});
    for (std::int64_t b = 0; b < B; ++b) {
      std::copy(step_out.begin() + b * kLayerE, step_out.begin() + (b + 1) * kLayerE,
                want_out.begin() + (b * Td + t) * kLayerE);
      per_token[static_cast<std::size_t>(b * Td + t)].assign(
          state.recurrent.begin() + b * state_row, state.recurrent.begin() + (b + 1) * state_row);
      for (int p = 0; p < 3; ++p) {
        per_token_conv[p][static_cast<std::size_t>(b * Td + t)].assign(
            state.conv[p].begin() + b * conv_row, state.conv[p].begin() + (b + 1) * conv_row);
      }
    }
  }
  CHECK(values_of<std::uint16_t>(out.read("out")) == want_out);
  std::vector<float> intermediate;
  for (const auto& s : per_token) intermediate.insert(intermediate.end(), s.begin(), s.end());
  CHECK(out.read("intermediate_states").shape ==
        std::vector<std::int64_t>{B, Td, kLayerH, kLayerD, kLayerD});
  CHECK(values_of<float>(out.read("intermediate_states")) == intermediate);
  CHECK(values_of<float>(out.read("recurrent_state")) == state.recurrent);  // after the last token
  const char* kept[3] = {"intermediate_conv_state_q", "intermediate_conv_state_k",
                         "intermediate_conv_state_v"};
  for (int p = 0; p < 3; ++p) {
    CAPTURE(p);
    std::vector<std::uint16_t> all;
    for (const auto& c : per_token_conv[p]) all.insert(all.end(), c.begin(), c.end());
    CHECK(out.read(kept[p]).shape == std::vector<std::int64_t>{B, Td, C, W1});
    CHECK(values_of<std::uint16_t>(out.read(kept[p])) == all);
    CHECK(values_of<std::uint16_t>(out.read(names[p])) == state.conv[p]);
  }

  // What decode mode refuses, naming the file; nothing written.
  struct Bad {
    std::function<void(CaseFile&)> change;
    std::string message;
  };
  for (const Bad& bad :
       {Bad{[](CaseFile& c) { c.metadata.erase("tokens"); },
            "metadata 'tokens' is missing, expected the tokens of each row in decode mode, 1 to "
            "16"},
        Bad{[](CaseFile& c) { c.metadata["tokens"] = "4"; },
            "tensor 'hidden_states' has 6 rows, not a whole number of rows of 4 tokens (metadata "
            "'tokens')"},
        Bad{[](CaseFile& c) { c.metadata["mode"] = "verify"; },
            "metadata 'mode' is 'verify', expected prefill or decode"},
        Bad{[](CaseFile& c) {
              const std::vector<std::int64_t> cu = {0, 3, 6};
              c.tensors.emplace("cu_seqlens", typed_tensor("cu_seqlens", DType::kI64, cu, {3}));
            },
            "tensor 'cu_seqlens' is given, but decode mode takes none (N rows of 'tokens' tokens "
            "each)"}}) {
    CAPTURE(bad.message);
    CaseFile c = f;
    bad.change(c);
    c.save(dir.file("bad.safetensors"));
    const Result rb = kda_run({"--layer-case", dir.file("bad.safetensors"), "--output",
                               dir.file("bad-out.safetensors"), "--backend", "cpu"});
    CHECK(rb.rc == 1);
    CHECK(rb.err.find(bad.message) != std::string::npos);
    CHECK(!fs::exists(dir.file("bad-out.safetensors")));
  }
}

TEST_CASE("kda-run --layer-case: bad files exit 1 / name the problem and write nothing") {
  const auto weights = kda::layer::random_weights(layer_config(), 3, 0);
  const CaseFile good = layer_case(weights, random_bits(6 * kLayerE, 1.0f, 12));
  CaseFile bad = good;
  bad.tensors.erase("hidden_states");
  check_layer_rejected(bad, "missing tensor 'hidden_states'");
  bad = good;
  bad.tensors.erase("hidden_states");
  bad.tensors.emplace("hidden_states", Tensor::zeros("hidden_states", DType::kF32, {6, kLayerE}));
  check_layer_rejected(bad, "tensor 'hidden_states' has dtype F32, expected BF16");
  bad = good;
  bad.tensors.erase("k_proj.weight");
  check_layer_rejected(bad, "no tensor 'k_proj.weight'");
  bad = good;
  bad.tensors.erase("v_proj.weight");
  bad.tensors.emplace("v_proj.weight",
                      Tensor::zeros("v_proj.weight", DType::kBF16, {kLayerH * kLayerD, 40}));
  check_layer_rejected(bad, "v_proj.weight");
  // A hidden_states of the wrong width: the weights' message says where the width came from.
  bad = good;
  bad.tensors.erase("hidden_states");
  bad.tensors.emplace("hidden_states",
                      Tensor::zeros("hidden_states", DType::kBF16, {6, kLayerE + 1}));
  check_layer_rejected(bad, "(the sizes expected: hidden " + std::to_string(kLayerE + 1) +
                                " from hidden_states, heads " + std::to_string(kLayerH));
  bad = good;
  bad.tensors.emplace("conv_state_k", Tensor::zeros("conv_state_k", DType::kBF16, {1, 64, 2}));
  check_layer_rejected(bad, "tensor 'conv_state_k' has shape [1, 64, 2], expected [1, 64, 3]");
  bad = good;
  bad.tensors.emplace("recurrent_state",
                      Tensor::zeros("recurrent_state", DType::kI32, {1, 4, 16, 16}));
  check_layer_rejected(bad, "tensor 'recurrent_state' has dtype I32");
  bad = good;
  bad.tensors.emplace("cu_seqlens", typed_tensor("cu_seqlens", DType::kI64,
                                                 std::vector<std::int64_t>{0, 2, 5}, {3}));
  check_layer_rejected(bad,
                       "cu_seqlens[2] must equal seq_len 6 (got 5) (T: the rows of hidden_states)");
  bad = good;
  bad.metadata.erase("gate");
  check_layer_rejected(bad, "metadata 'gate' is missing");
  bad = good;
  bad.metadata["norm_eps"] = "-1";
  check_layer_rejected(bad, "metadata 'norm_eps' is '-1'");
  bad = good;
  bad.metadata["final_state"] = "f16";
  check_layer_rejected(bad, "metadata 'final_state' is 'f16'");

  // The output must not be the input.
  TempDir dir;
  good.save(dir.file("in.safetensors"));
  const std::string before = read_text(dir.file("in.safetensors"));
  const Result r =
      kda_run({"--layer-case", dir.file("in.safetensors"), "--output", dir.file("in.safetensors")});
  CHECK(r.rc == 1);
  CHECK(r.err.find("refusing to overwrite the input") != std::string::npos);
  CHECK(read_text(dir.file("in.safetensors")) == before);
}

// Kimi K3's layer: the file holds g_proj instead of g_a_proj / g_b_proj, and the case runs the
// full-rank output gate; a file holding both forms is refused, naming them.
TEST_CASE("kda-run --layer-case: the full-rank output gate (g_proj) equals the CPU layer") {
  kda::layer::Config config = layer_config();
  config.full_rank_gate = true;
  const auto weights = kda::layer::random_weights(config, 9, 2);
  REQUIRE(!weights.g_proj.empty());
  const std::vector<std::uint16_t> hidden = random_bits(9 * kLayerE, 1.0f, 14);
  CaseFile f = layer_case(weights, hidden);
  REQUIRE(f.tensors.count("g_proj.weight") == 1);
  REQUIRE(f.tensors.count("g_a_proj.weight") == 0);
  f.tensors.emplace("cu_seqlens", typed_tensor("cu_seqlens", DType::kI64,
                                               std::vector<std::int64_t>{0, 4, 9}, {3}));
  TempDir dir;
  f.save(dir.file("k3.safetensors"));
  const Result r = kda_run({"--layer-case", dir.file("k3.safetensors"), "--output",
                            dir.file("k3-out.safetensors"), "--backend", "cpu"});
  INFO(r.err);
  REQUIRE(r.rc == 0);
  const auto out = kda::engine::SafetensorsFile::open(dir.file("k3-out.safetensors"));
  const LayerRun expected = run_direct(weights, hidden, {0, 4, 9});
  CHECK(values_of<std::uint16_t>(out.read("out")) == expected.out);
  CHECK(values_of<float>(out.read("recurrent_state")) == expected.recurrent);

  const auto low_rank = kda::layer::random_weights(layer_config(), 9, 2);
  CaseFile both = f;
  for (const Tensor& t : kda::engine::layer_weight_tensors(low_rank)) {
    if (t.name == "g_a_proj.weight" || t.name == "g_b_proj.weight") both.tensors.emplace(t.name, t);
  }
  check_layer_rejected(both, "both output gate forms present: 'g_proj.weight' (full rank)");
  // Not a shape error: no hint of where the expected sizes came from after it.
  check_layer_rejected(both, "'g_b_proj.weight' (low rank)\n");
}

TEST_CASE("kda-run --layer-case: prefill checkpoints equal the states of the prefixes") {
  const auto weights = kda::layer::random_weights(layer_config(), 5, 0);
  const std::vector<std::int64_t> lengths = {37, 20}, cu = {0, 37, 57};
  const std::vector<std::uint16_t> hidden = random_bits(57 * kLayerE, 1.0f, 61);
  const std::int64_t C = kLayerH * kLayerD, W1 = kLayerW - 1, state = kLayerH * kLayerD * kLayerD;
  const char* names[3] = {"conv_state_q", "conv_state_k", "conv_state_v"};
  std::vector<std::uint16_t> conv[3];
  for (int p = 0; p < 3; ++p) conv[p] = random_bits(2 * C * W1, 1.0f, 70 + p);
  std::vector<float> recurrent;
  for (const std::uint16_t b : random_bits(2 * state, 0.2f, 75)) {
    recurrent.push_back(kda::bf16_to_float(b));
  }
  // Sequence n's first `tokens` tokens (all of them: tokens = -1) from its initial states.
  auto case_of = [&](std::int64_t n, std::int64_t tokens) {
    const std::int64_t begin = tokens < 0 ? 0 : cu[static_cast<std::size_t>(n)];
    const std::int64_t end = tokens < 0 ? 57 : begin + tokens;
    const std::int64_t first = tokens < 0 ? 0 : n, count = tokens < 0 ? 2 : 1;
    CaseFile f = layer_case(weights, std::vector<std::uint16_t>(hidden.begin() + begin * kLayerE,
                                                                hidden.begin() + end * kLayerE));
    if (tokens < 0)
      f.tensors.emplace("cu_seqlens", typed_tensor("cu_seqlens", DType::kI64, cu, {3}));
    for (int p = 0; p < 3; ++p) {
      const std::vector<std::uint16_t> rows(conv[p].begin() + first * C * W1,
                                            conv[p].begin() + (first + count) * C * W1);
      f.tensors.emplace(names[p], bf16_tensor(names[p], rows, {count, C, W1}));
    }
    const std::vector<float> rows(recurrent.begin() + first * state,
                                  recurrent.begin() + (first + count) * state);
    f.tensors.emplace("recurrent_state", typed_tensor("recurrent_state", DType::kF32, rows,
                                                      {count, kLayerH, kLayerD, kLayerD}));
    return f;
  };
  const std::vector<std::int64_t> offsets = {16, 37, 0, -1};
  CaseFile f = case_of(0, -1);
  f.tensors.emplace("checkpoint_offsets",
                    typed_tensor("checkpoint_offsets", DType::kI64, offsets, {2, 2}));
  TempDir dir;
  auto run = [&dir](const CaseFile& file, const std::string& name) {
    file.save(dir.file(name + ".safetensors"));
    const Result r = kda_run({"--layer-case", dir.file(name + ".safetensors"), "--output",
                              dir.file(name + "-out.safetensors"), "--backend", "cpu"});
    INFO("stderr: " << r.err);
    REQUIRE(r.rc == 0);
    return kda::engine::SafetensorsFile::open(dir.file(name + "-out.safetensors"));
  };
  const auto out_file = run(f, "whole");
  const auto plain_file = run(case_of(0, -1), "plain");
  CHECK(values_of<std::uint16_t>(out_file.read("out")) ==
        values_of<std::uint16_t>(plain_file.read("out")));
  CHECK(values_of<float>(out_file.read("recurrent_state")) ==
        values_of<float>(plain_file.read("recurrent_state")));
  const Tensor states = out_file.read("checkpoint_states");
  CHECK(states.dtype == DType::kF32);
  REQUIRE(states.shape == std::vector<std::int64_t>{2, 2, kLayerH, kLayerD, kLayerD});
  const auto state_values = values_of<float>(states);
  std::vector<std::uint16_t> conv_values[3];
  for (int p = 0; p < 3; ++p) {
    const Tensor t = out_file.read(std::string("checkpoint_") + names[p]);
    CHECK(t.dtype == DType::kBF16);
    REQUIRE(t.shape == std::vector<std::int64_t>{2, 2, C, W1});
    conv_values[p] = values_of<std::uint16_t>(t);
  }
  for (std::int64_t i = 0; i < 4; ++i) {
    const std::int64_t n = i / 2, offset = offsets[static_cast<std::size_t>(i)];
    CAPTURE(n);
    CAPTURE(offset);
    const std::vector<float> got(state_values.begin() + i * state,
                                 state_values.begin() + (i + 1) * state);
    if (offset < 0) {
      CHECK(got == std::vector<float>(static_cast<std::size_t>(state), 0.0f));
      for (int p = 0; p < 3; ++p) {
        CHECK(std::vector<std::uint16_t>(conv_values[p].begin() + i * C * W1,
                                         conv_values[p].begin() + (i + 1) * C * W1) ==
              std::vector<std::uint16_t>(static_cast<std::size_t>(C * W1), 0));
      }
      continue;
    }
    const auto prefix = run(case_of(n, offset), "prefix" + std::to_string(i));
    CHECK(got == values_of<float>(prefix.read("recurrent_state")));
    for (int p = 0; p < 3; ++p) {
      CAPTURE(p);
      CHECK(std::vector<std::uint16_t>(conv_values[p].begin() + i * C * W1,
                                       conv_values[p].begin() + (i + 1) * C * W1) ==
            values_of<std::uint16_t>(prefix.read(names[p])));
    }
  }

  CaseFile bad = f;
  bad.tensors.at("checkpoint_offsets").data_as<std::int64_t>()[0] = 24;
  check_layer_rejected(bad,
                       "in.safetensors: KDA layer forward (CPU): sequence 0 checkpoint 0: "
                       "offset 24 is not -1, a multiple of 16 up to the sequence's length 37");
  bad = f;
  bad.tensors.at("checkpoint_offsets").shape = {1, 4};
  check_layer_rejected(bad,
                       "in.safetensors: tensor 'checkpoint_offsets' has shape [1, 4], "
                       "expected [2, R]");
}

TEST_CASE("kda-run: a typo in runtime is a warning, and an error with --strict-config") {
  TempDir dir;
  std::string yaml = read_text(kModels + "tiny.yaml");
  const std::string key = "  max_tokens: 2048\n";
  REQUIRE(yaml.find(key) != std::string::npos);
  yaml.replace(yaml.find(key), key.size(), "  max_tokens: 2048\n  max_token: 64\n");
  {
    std::ofstream out(dir.file("typo.yaml"));
    out << yaml;
  }
  Result r = kda_run({"--model", dir.file("typo.yaml"), "--plan-only", "--core-only"});
  INFO("stderr: " << r.err);
  CHECK(r.rc == 0);
  CHECK(r.err.find("warning") != std::string::npos);
  CHECK(r.err.find("did you mean `max_tokens`?") != std::string::npos);
  r = kda_run({"--model", dir.file("typo.yaml"), "--plan-only", "--core-only", "--strict-config"});
  CHECK(r.rc == 1);
  CHECK(r.err.find("max_token") != std::string::npos);
  CHECK(r.err.find("warning") == std::string::npos);
}

// ---- runtime overrides, file errors, output as it happens, scripts ---------------------------

TEST_CASE(
    "kda-run: --workspace-plan, --max-tokens, --max-sequences and --state-dtype replace the "
    "runtime values") {
  // reuse, max_tokens 2048, max_sequences 4, state_dtype fp32
  const std::string tiny = kModels + "tiny.yaml";
  auto plan_of = [](const Result& r) {
    INFO(r.err);
    REQUIRE(r.rc == 0);
    return nlohmann::json::parse(r.out);
  };
  auto state_bytes = [](const nlohmann::json& plan) {
    for (const auto& buffer : plan["buffers"]) {
      if (buffer["name"] == "layer1.state") return buffer["bytes"].get<std::uint64_t>();
    }
    FAIL("no layer1.state buffer");
    return std::uint64_t{0};
  };
  const nlohmann::json file =
      plan_of(kda_run({"--model", tiny, "--plan-only", "--json", "--backend", "cpu"}));
  CHECK(file["mode"] == "reuse");
  const nlohmann::json overridden = plan_of(
      kda_run({"--model", tiny, "--plan-only", "--json", "--backend", "cpu", "--workspace-plan",
               "sum", "--max-sequences", "16", "--max-tokens", "4096", "--tokens", "4096"}));
  CHECK(overridden["mode"] == "sum");
  CHECK(state_bytes(overridden) == 4 * state_bytes(file));  // 16 slots instead of 4
  CHECK(overridden["arena_bytes"].get<std::uint64_t>() > file["arena_bytes"].get<std::uint64_t>());
  // A bf16 state: every layer's recurrent states in half the bytes.
  const nlohmann::json bf16 = plan_of(kda_run(
      {"--model", tiny, "--plan-only", "--json", "--backend", "cpu", "--state-dtype", "bf16"}));
  CHECK(2 * state_bytes(bf16) == state_bytes(file));
  CHECK(plan_of(kda_run({"--model", tiny, "--plan-only", "--json", "--backend", "cpu",
                         "--state-dtype", "fp32"})) == file);

  // A run with more sequences than the file allows.
  const Result run = kda_run({"--model", tiny, "--max-sequences", "6", "--sequences", "6",
                              "--tokens", "12", "--backend", "cpu", "--threads", "1"});
  INFO(run.out << run.err);
  REQUIRE(run.rc == 0);
  CHECK(run.out.find("prefill: 12 tokens in 6 sequences") != std::string::npos);
  // A run on bf16 states, prefill and decode steps, says so in its model line.
  const Result bf16_run =
      kda_run({"--model", tiny, "--state-dtype", "bf16", "--tokens", "12", "--sequences", "2",
               "--decode-steps", "2", "--backend", "cpu", "--threads", "1"});
  INFO(bf16_run.out << bf16_run.err);
  REQUIRE(bf16_run.rc == 0);
  CHECK(bf16_run.out.find("state bf16") != std::string::npos);

  // Bad values are usage errors; the model's limits say how to raise them.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--workspace-plan", "greedy"},
        {"--max-tokens", "0"},
        {"--max-tokens", "many"},
        {"--max-sequences", "0"},
        {"--max-sequences", "1048577"},
        {"--state-dtype", "f16"}}) {
    std::vector<std::string> full = {"--model", tiny, "--plan-only"};
    full.insert(full.end(), args.begin(), args.end());
    CAPTURE(args.front());
    const Result r = kda_run(full);
    CHECK(r.rc == 2);
    CHECK(r.err.find("kda-run: " + args.front()) == 0);
  }
  CHECK(kda_run({"--model", tiny, "--workspace-plan", "greedy"})
            .err.find("--workspace-plan expects reuse or sum, got 'greedy'") != std::string::npos);
  CHECK(kda_run({"--model", tiny, "--state-dtype", "fp16"})
            .err.find("--state-dtype expects fp32 or bf16, got 'fp16'") != std::string::npos);
  CHECK(kda_run({"--case", "a", "--output", "b", "--max-tokens", "8"}).rc == 2);
  CHECK(kda_run({"--case", "a", "--output", "b", "--state-dtype", "bf16"}).rc == 2);
  CHECK(kda_run({"--model", tiny, "--tokens", "4096"}).err.find("(--max-tokens raises it)") !=
        std::string::npos);
  CHECK(kda_run({"--model", tiny, "--sequences", "5"}).err.find("(--max-sequences raises it)") !=
        std::string::npos);
  // Sizes that overflow are the loader's errors, as the file's own values would be, naming the
  // key and the override (no line and column: the value is not in the file).
  const Result huge = kda_run({"--model", tiny, "--plan-only", "--max-tokens",
                               std::to_string(std::numeric_limits<std::int64_t>::max())});
  CHECK(huge.rc == 1);
  CHECK(huge.err == "kda-run: error: " + tiny +
                        ": runtime.max_tokens: max_tokens 9223372036854775807 (overriding the "
                        "model description's) x num_heads 4 x head_dim 128 x 2 bytes overflows "
                        "64 bits\n");
}

TEST_CASE("kda-run: Kimi K3 and GLM-5.3-Flash plan, a Hugging Face folder is a model") {
  for (const char* model : {"kimi-k3.json", "kimi-k3-tp8.yaml", "glm-5.3-flash.json"}) {
    CAPTURE(model);
    const Result r = kda_run({"--model", kModels + model, "--plan-only", "--backend", "cpu"});
    INFO(r.out << r.err);
    CHECK(r.rc == 0);
    CHECK(r.out.find("\nfamily: ") != std::string::npos);
    CHECK(r.out.find("arena: ") != std::string::npos);
    const bool k3 = std::string(model).rfind("kimi-k3", 0) == 0;
    CHECK((r.out.find("full-rank output gate") != std::string::npos) == k3);
  }
  const Result tp8 =
      kda_run({"--model", kModels + "kimi-k3-tp8.yaml", "--plan-only", "--backend", "cpu"});
  CHECK(tp8.out.find("family: Kimi K3 (family: kimi-k3), tensors "
                     "language_model.model.layers.{i}.self_attn.*") != std::string::npos);
  CHECK(tp8.out.find("tensor-parallel rank 0 of 8: 12 heads") != std::string::npos);

  // A folder holding config.json and model.safetensors: GLM-5.3-Flash's names, run on the CPU.
  TempDir dir;
  kda::layer::Config c = layer_config();
  c.gate = kda::GateMode::kLowerBound;
  std::vector<Tensor> tensors;
  for (const int index : {0, 2}) {
    for (Tensor& t : kda::engine::layer_weight_tensors(
             kda::layer::random_weights(c, 3, index),
             kda::engine::layer_tensor_prefix(index,
                                              "model.language_model.layers.{i}.self_attn."))) {
      tensors.push_back(std::move(t));
    }
  }
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  std::ofstream(dir.file("config.json"))
      << R"({"model_type": "glm5_next", "text_config": {"hidden_size": 48, "num_hidden_layers": 3,
  "layer_types": ["linear_attention", "deepseek_sparse_attention", "linear_attention"],
  "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4}})";
  const Result r = kda_run({"--model", dir.path.string(), "--tokens", "8", "--backend", "cpu",
                            "--threads", "1", "--max-tokens", "64", "--max-sequences", "2"});
  INFO(r.out << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.rfind(dir.path.filename().string() + ": 3 layers, 2 KDA (H=4, D=16, gate "
                                                   "lower_bound -5",
                    0) == 0);
  CHECK(r.out.find("\nfamily: GLM-5.3-Flash (model_type glm5_next), tensors "
                   "model.language_model.layers.{i}.self_attn.*\n") != std::string::npos);
  CHECK(r.out.find("\nweights: " + dir.path.string() + " (") != std::string::npos);
  CHECK(r.out.find("total: 2 KDA layers") != std::string::npos);
}

// A Kimi K3 folder at the CUDA layer's head size (D = 128, the full-rank gate) runs on every
// backend this machine has.
TEST_CASE("kda-run: a Kimi K3 folder with its full-rank gate runs on each backend available") {
  TempDir dir;
  kda::layer::Config c = layer_config();
  c.hidden_size = 64;
  c.num_heads = 2;
  c.head_dim = 128;
  c.gate = kda::GateMode::kLowerBound;
  c.full_rank_gate = true;
  std::vector<Tensor> tensors;
  for (const int index : {0, 2}) {
    for (Tensor& t : kda::engine::layer_weight_tensors(
             kda::layer::random_weights(c, 5, index),
             kda::engine::layer_tensor_prefix(index,
                                              "language_model.model.layers.{i}.self_attn."))) {
      tensors.push_back(std::move(t));
    }
  }
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  std::ofstream(dir.file("config.json"))
      << R"({"model_type": "kimi_k3", "text_config": {"hidden_size": 64, "num_hidden_layers": 3,
  "linear_attn_config": {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4,
  "kda_layers": [1, 3], "full_attn_layers": [2], "gate_lower_bound": -5.0,
  "use_full_rank_gate": true}}})";
  std::vector<std::string> backends = {"cpu"};
  if (kda::engine::cuda_backend_available()) backends.push_back("cuda");
  for (const std::string& backend : backends) {
    CAPTURE(backend);
    const Result r =
        kda_run({"--model", dir.path.string(), "--tokens", "40", "--decode-steps", "3", "--backend",
                 backend, "--threads", "1", "--max-tokens", "64", "--max-sequences", "2"});
    INFO(r.out << r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("\nfamily: Kimi K3 (model_type kimi_k3), tensors "
                     "language_model.model.layers.{i}.self_attn.*\n") != std::string::npos);
    CHECK(r.out.find("full-rank output gate") != std::string::npos);
    CHECK(r.out.find("total: 2 KDA layers") != std::string::npos);
    CHECK(r.out.find("backend: " + backend) != std::string::npos);
  }
}

TEST_CASE("kda-run: a description without a runtime section (a config.json) plans reuse") {
  const std::string config = kModels + "kimi-linear-48b-a3b.json";
  Result r = kda_run({"--model", config, "--plan-only", "--backend", "cpu"});
  INFO(r.out << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("plan reuse)") != std::string::npos);  // the model line
  CHECK(r.out.find("arena: 3.8 GiB (") != std::string::npos);
  CHECK(r.out.find("runtime.workspace_plan reuse") != std::string::npos);
  r = kda_run({"--model", config, "--plan-only", "--backend", "cpu", "--workspace-plan", "sum"});
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("arena: 13.7 GiB (") != std::string::npos);
  CHECK(r.out.find("runtime.workspace_plan sum") != std::string::npos);
}

TEST_CASE("kda-run: a file that cannot be opened is named by its absolute path, with the reason") {
  TempDir dir;
  fs::create_directories(dir.file("run"));
  const fs::path cwd = fs::canonical(dir.file("run"));  // what the process's getcwd() says
  const std::string enoent = std::strerror(ENOENT);
  // A relative path, as a README command run outside the repository gives it.
  Result r = kda_run({"--model", "models/missing.yaml", "--plan-only"}, dir.file("run"));
  CHECK(r.rc == 1);
  CHECK(r.err == "kda-run: error: models/missing.yaml: cannot open the model description '" +
                     (cwd / "models/missing.yaml").string() + "': " + enoent + "\n");
  // An absolute one is named once.
  const std::string absolute = (cwd / "missing.yaml").string();
  r = kda_run({"--model", absolute});
  CHECK(r.err ==
        "kda-run: error: " + absolute + ": cannot open the model description: " + enoent + "\n");
  for (const char* flag : {"--case", "--layer-case"}) {
    CAPTURE(flag);
    r = kda_run({flag, "in.safetensors", "--output", "out.safetensors"}, dir.file("run"));
    CHECK(r.rc == 1);
    CHECK(r.err == "kda-run: error: in.safetensors: cannot open the safetensors file '" +
                       (cwd / "in.safetensors").string() + "': " + enoent + "\n");
  }
  if (geteuid() != 0) {  // permissions do not stop root
    const std::string yaml = dir.file("run/locked.yaml");
    std::ofstream(yaml) << read_text(kModels + "tiny.yaml");
    fs::permissions(yaml, fs::perms::none);
    r = kda_run({"--model", "locked.yaml", "--plan-only"}, dir.file("run"));
    CHECK(r.err.find(": " + std::string(std::strerror(EACCES)) + "\n") != std::string::npos);
    fs::permissions(yaml, fs::perms::owner_all);
  }
}

TEST_CASE("kda-run: the model and the backend come before the engine is built, line by line") {
  const Result r = kda_run(
      {"--model", kModels + "tiny.yaml", "--tokens", "16", "--backend", "cpu", "--threads", "1"});
  INFO(r.out << r.err);
  REQUIRE(r.rc == 0);
  std::size_t at = 0;
  for (const char* line :
       {"tiny-kda: 4 layers, 3 KDA", "\nbackend: cpu (1 thread)\n",
        "\nbuilding the engine: the arena, then random weights (seed 0)...\n",
        "\nweights: random (seed 0)", "\nengine ready in ", "\nmemory plan:\n",
        "\nprefill: 16 tokens in 1 sequence (inputs generated and copied in ",
        " a warm-up forward of the first layer in ", "\n   layer  KDA index",
        "\n       1          0", "\n       3          2", "\ntotal: 3 KDA layers"}) {
    CAPTURE(line);
    const std::size_t found = r.out.find(line, at);
    CHECK(found != std::string::npos);
    if (found != std::string::npos) at = found;
  }
  CHECK(r.out.rfind("tiny-kda: ", 0) == 0);  // the first line
#ifdef KDA_RUN_PATH
  // Into a pipe, each line as it is printed: a run stopped while it still builds the engine of a
  // large model (seconds of random weights) has shown its first lines already.
  const Result piped = shell("timeout -s KILL 3 " + quote(KDA_RUN_PATH) +
                             quoted_args({"--model", kModels + "kimi-linear-48b-a3b.yaml",
                                          "--tokens", "16", "--backend", "cpu", "--threads", "1"}) +
                             " | cat");
  INFO(piped.out << piped.err);
  CHECK(piped.out.rfind("Kimi-Linear-48B-A3B: 27 layers, 20 KDA", 0) == 0);
  CHECK(piped.out.find("\nbuilding the engine: ") != std::string::npos);
#endif
}

#ifdef KDA_RUN_PATH
TEST_CASE("scripts/run-example.sh: --layer-case and --case replace the default model") {
  const auto weights = kda::layer::random_weights(layer_config(), 3, 0);
  TempDir dir;
  layer_case(weights, random_bits(5 * kLayerE, 1.0f, 13)).save(dir.file("layer.safetensors"));
  to_case_file(small_case()).save(dir.file("core.safetensors"));
  const std::string script = "KDA_SKIP_BUILD=1 KDA_BUILD_DIR=" + quote(KDA_BINARY_DIR) + " bash " +
                             quote(std::string(KDA_SOURCE_DIR) + "/scripts/run-example.sh");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--layer-case", dir.file("layer.safetensors"), "--output",
                                 dir.file("a.safetensors")},
        {"--layer-case=" + dir.file("layer.safetensors"), "--output", dir.file("b.safetensors")},
        {"--case", dir.file("core.safetensors"), "--output", dir.file("c.safetensors")}}) {
    CAPTURE(args.front());
    const Result r = shell(script + quoted_args(args) + " --backend cpu");
    INFO(r.out << r.err);
    CHECK(r.rc == 0);
    CHECK(fs::exists(args[args.size() - 1]));
  }
}
#endif

namespace {

// The x86-64-v3 flags /proc/cpuinfo does not list (everything on a machine that is not x86-64):
// none, and this machine can run x86-64-v3 code.
std::vector<std::string> x86_64_v3_missing() {
  const std::vector<std::string> v3 = {"avx", "avx2",  "bmi1",   "bmi2",  "f16c",    "fma",
                                       "abm", "movbe", "xsave",  "cx16",  "lahf_lm", "popcnt",
                                       "pni", "ssse3", "sse4_1", "sse4_2"};
#if defined(__x86_64__)
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags{std::istream_iterator<std::string>(words), {}};
    std::vector<std::string> missing;
    for (const std::string& flag : v3) {
      if (flags.count(flag) == 0) missing.push_back(flag);
    }
    return missing;
  }
#endif
  return v3;
}

}  // namespace

TEST_CASE(
    "scripts/build.sh: x86-64-v3 where this CPU has it, unless KDA_CPU_ARCH or the cache says") {
  // A stand-in cmake records the arguments build.sh gives it.
  TempDir dir;
  fs::create_directories(dir.file("bin"));
  std::ofstream(dir.file("bin/cmake")) << "#!/bin/sh\necho \"$*\" >>\"$CMAKE_ARGS_LOG\"\n";
  fs::permissions(dir.file("bin/cmake"), fs::perms::owner_all);
  int runs = 0;
  auto build = [&](const std::string& env, const std::string& build_dir) {
    const std::string log = dir.file("args" + std::to_string(++runs));
    const Result r =
        shell(env + " PATH=" + quote(dir.file("bin")) + ":\"$PATH\" CMAKE_ARGS_LOG=" + quote(log) +
              " KDA_CUDA=OFF KDA_BUILD_DIR=" + quote(build_dir) + " bash " +
              quote(std::string(KDA_SOURCE_DIR) + "/scripts/build.sh"));
    INFO(r.out << r.err);
    CHECK(r.rc == 0);
    const std::string args = read_text(log);
    return std::make_pair(r.out, args.substr(0, args.find('\n')));  // the configure call
  };
  const std::string fresh = dir.file("fresh");
  auto [said, args] = build("env -u KDA_CPU_ARCH", fresh);
  const std::vector<std::string> missing = x86_64_v3_missing();
  if (missing.empty()) {
    CHECK(said.find("build.sh: CPU backend built for x86-64-v3 (") == 0);
    CHECK(std::regex_search(args, std::regex("-DKDA_CPU_ARCH=x86-64-v3( |$)")));
    CHECK(std::regex_search(args, std::regex("-DKDA_CPU_FLAGS=( |$)")));
  } else if (missing == std::vector<std::string>{"abm"}) {
    // All of x86-64-v3 but LZCNT (as some virtual machines report): the rest, without lzcnt.
    CHECK(said.find("build.sh: CPU backend built for x86-64-v3 without LZCNT (") == 0);
    CHECK(std::regex_search(args, std::regex("-DKDA_CPU_ARCH=x86-64-v3( |$)")));
    CHECK(std::regex_search(args, std::regex("-DKDA_CPU_FLAGS=-mno-lzcnt( |$)")));
  } else {
    CHECK(said.find("build.sh: CPU backend built for the compiler's generic target (") == 0);
    CHECK(std::regex_search(args, std::regex("-DKDA_CPU_ARCH=( |$)")));
    CHECK(std::regex_search(args, std::regex("-DKDA_CPU_FLAGS=( |$)")));
  }
  std::tie(said, args) = build("KDA_CPU_ARCH=native", fresh);
  CHECK(said.find("build.sh: CPU backend built for native (KDA_CPU_ARCH from the environment)") ==
        0);
  CHECK(std::regex_search(args, std::regex("-DKDA_CPU_ARCH=native( |$)")));
  CHECK(std::regex_search(args, std::regex("-DKDA_CPU_FLAGS=( |$)")));  // only -march asked for
  std::tie(said, args) = build("KDA_CPU_ARCH=", fresh);
  CHECK(said.find("build.sh: CPU backend built for generic (KDA_CPU_ARCH from the environment)") ==
        0);
  CHECK(std::regex_search(args, std::regex("-DKDA_CPU_ARCH=( |$)")));
  // A value configured by hand in the build directory stays.
  const std::string configured = dir.file("configured");
  fs::create_directories(configured);
  std::ofstream(configured + "/CMakeCache.txt") << "KDA_CPU_ARCH:STRING=native\n";
  std::tie(said, args) = build("env -u KDA_CPU_ARCH", configured);
  CHECK(said.find("build.sh: CPU backend built for native (KDA_CPU_ARCH configured in ") == 0);
  CHECK(args.find("KDA_CPU_ARCH") == std::string::npos);
}
