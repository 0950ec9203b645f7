// kda-run, the binary: usage errors, --plan-only --json, a small synthetic run with decode steps,
// --case round trips against the fp64 recurrence, and bad case files (message, non-zero exit, no
// output written).
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"
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
    if (c == '\'') quoted += "'\\''";
    else quoted += c;
  }
  return quoted + "'";
}

// Runs kda-run with `args`, capturing stdout and stderr.
Result kda_run(const std::vector<std::string>& args) {
#ifndef KDA_RUN_PATH
  MESSAGE("KDA_SKIP: kda-run was not built");
  return {};
#else
  TempDir capture;
  std::string command = quote(KDA_RUN_PATH);
  for (const std::string& arg : args) command += " " + quote(arg);
  command += " >" + quote(capture.file("out")) + " 2>" + quote(capture.file("err"));
  const int status = std::system(command.c_str());
  Result r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(capture.file("out"));
  r.err = read_text(capture.file("err"));
  return r;
#endif
}

const std::string kModels = std::string(KDA_SOURCE_DIR) + "/examples/models/";

// ---- case files ----------------------------------------------------------------------------

Tensor bf16_tensor(const std::string& name, const std::vector<std::uint16_t>& values,
                   std::vector<std::int64_t> shape) {
  Tensor t = Tensor::zeros(name, DType::kBF16, std::move(shape));
  REQUIRE(t.data.size() == values.size() * 2);
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}
template <typename T>
Tensor typed_tensor(const std::string& name, DType dtype, const std::vector<T>& values,
                    std::vector<std::int64_t> shape) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  REQUIRE(t.data.size() == values.size() * sizeof(T));
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
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
  const std::int64_t B = p.batch, T = p.seq_len, H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
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
void check_rejected(const CaseFile* file, const std::string* raw, const std::string& part) {
  TempDir dir;
  const std::string in = dir.file("in.safetensors");
  if (file != nullptr) file->save(in);
  if (raw != nullptr) {
    std::ofstream(in, std::ios::binary) << *raw;
  }
  for (const bool existing : {false, true}) {
    const std::string out = dir.file(existing ? "existing.safetensors" : "out.safetensors");
    if (existing) std::ofstream(out) << "keep me";
    const Result r = kda_run({"--case", in, "--output", out, "--backend", "cpu"});
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
void check_rejected(const CaseFile& file, const std::string& part) { check_rejected(&file, nullptr, part); }
void check_rejected_bytes(const std::string& raw, const std::string& part) {
  check_rejected(nullptr, &raw, part);
}

}  // namespace

TEST_CASE("kda-run: --help / usage errors exit 2") {
  Result r = kda_run({"--help"});
  CHECK(r.rc == 0);
  CHECK(r.out.find("Usage:") != std::string::npos);
  CHECK(r.out.find("--decode-steps") != std::string::npos);

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{}, {"--frobnicate"}, {"--model"}, {"--model", "m.yaml", "--json"},
        {"--model", "m.yaml", "--tokens", "abc"}, {"--model", "m.yaml", "--tokens", "0"},
        {"--model", "m.yaml", "--backend", "tpu"}, {"--case", "in.safetensors"},
        {"--case", "a", "--output", "b", "--model", "m.yaml"}, {"--output", "b"},
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
    REQUIRE(plan["total_bytes"].is_number_unsigned());
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
      end = std::max(end, buffer["offset"].get<std::uint64_t>() + buffer["bytes"].get<std::uint64_t>());
      if (buffer["kind"] == "state") {
        ++states;
        state_layers.insert(buffer["layer"].get<int>());
      }
    }
    CHECK(end <= plan["total_bytes"].get<std::uint64_t>());
    CHECK(states == static_cast<int>(state_layers.size()));
    CHECK(states == (std::string(model) == "tiny.yaml" ? 3 : 20));
  }
  // The plain-text plan is a table with a totals line.
  const Result table = kda_run({"--model", kModels + "tiny.yaml", "--plan-only"});
  CHECK(table.rc == 0);
  CHECK(table.out.find("layer0.state") != std::string::npos);
  CHECK(table.out.find("total:") != std::string::npos);
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

TEST_CASE("kda-run --case: fixed length / lower_bound gate / bf16 state by default / custom scale") {
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
  check_rejected(with_cu({1, 3, 8}), "cu_seqlens[0] is 1");
  check_rejected(with_cu({0, 6, 5}), "cu_seqlens decreases");
  check_rejected(with_cu({0, 3, 7}), "cu_seqlens ends at 7, expected T = 8");

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
  bad = good;
  bad.metadata["lower_bound"] = "minus two";
  check_rejected(bad, "not a number");
  bad.metadata.erase("lower_bound");
  check_rejected(bad, "'lower_bound' is required");
  bad = good;
  bad.metadata["final_state"] = "fp64";
  check_rejected(bad, "final_state");
  bad = good;
  bad.metadata["scale"] = "-1";
  check_rejected(bad, "scale");

  bad = good;  // dt_bias flat [H * K] instead of [H, K]
  bad.tensors.at("dt_bias").shape = {16};
  check_rejected(bad, "tensor 'dt_bias' has shape [16], expected [2, 8]");
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
}
