// Model families (kda/engine/model_family.hpp): the example configs of Kimi K3 and GLM-5.3-Flash
// and their variants parse into the one layer description; unknown families are refused naming
// what was looked for; a description that names no family takes the layout from the checkpoint's
// tensor names; small checkpoints written here in each family's layout (sharded, other layers'
// and other dtypes' tensors beside them) load from F32, F16 and BF16 sources with the conversions
// the loader promises, into engines whose tensor-parallel ranks sum to the whole layer; bad
// checkpoints are refused naming the tensor and the file.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine_matrix.hpp"
#include "kda/engine/checkpoint.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/engine/model_family.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"
#include "layer_test_util.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using kda::bf16_bits;
using kda::DType;
using kda::engine::Checkpoint;
using kda::engine::ModelSpec;
using kda::engine::Tensor;
using kda::layer::Config;
using kda::layer::Weights;
using kda::test::error_of;
using kda::test::TempDir;

namespace {

const std::string kModels = std::string(KDA_SOURCE_DIR) + "/examples/models/";
const std::string kKimiPrefix = "model.layers.{i}.self_attn.";
const std::string kK3Prefix = "language_model.model.layers.{i}.self_attn.";
const std::string kGlmPrefix = "model.language_model.layers.{i}.self_attn.";

ModelSpec parse(const std::string& text, const std::string& source = "c.json") {
  return kda::engine::parse_model_spec(text, source);
}

std::string parse_error(const std::string& text, const std::string& source = "c.json") {
  return error_of([&] { parse(text, source); });
}

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE_MESSAGE(at != std::string::npos, "test setup: '" << from << "' not in the text");
  text.replace(at, from.size(), to);
  return text;
}

std::vector<int> range(int first, int last) {  // first..last, both included
  std::vector<int> values;
  for (int i = first; i <= last; ++i) values.push_back(i);
  return values;
}

// ---- synthetic checkpoints in each family's layout ---------------------------------------------

// A tiny layer: every projection small, the CPU layer runs it in microseconds.
Config small_config(bool full_rank = false) {
  Config c;
  c.hidden_size = 32;
  c.num_heads = 4;
  c.head_dim = 8;
  c.conv_width = 4;
  c.gate = kda::GateMode::kLowerBound;
  c.lower_bound = -5.0f;
  c.full_rank_gate = full_rank;
  return c;
}

// The F16 bits of k * 2^e, |k| <= 2048 (exact in binary16, a normal number or zero).
std::uint16_t f16_exact(int k, int e) {
  if (k == 0) return 0;
  const std::uint16_t sign = k < 0 ? 0x8000 : 0;
  unsigned magnitude = static_cast<unsigned>(k < 0 ? -k : k);
  REQUIRE(magnitude <= 2048);
  int top = 0;
  while ((magnitude >> (top + 1)) != 0) ++top;  // 2^top <= magnitude < 2^(top + 1)
  const int biased = top + e + 15;
  REQUIRE(biased >= 1);
  REQUIRE(biased <= 30);
  const unsigned mantissa =
      top <= 10 ? (magnitude << (10 - top)) & 0x3ffu : (magnitude >> (top - 10)) & 0x3ffu;
  return static_cast<std::uint16_t>(sign | (biased << 10) | mantissa);
}

template <typename T>
Tensor tensor_of(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
                 const std::vector<T>& values) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  REQUIRE(t.data.size() == values.size() * sizeof(T));
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

// One matrix (or o_norm / bias) in `dtype` from values chosen for it, and the bf16 bits the loader
// must make of it: BF16 as is, F32 rounded to nearest even (the values are not bf16 ones), F16
// exact values k * 2^-14 widened and rounded.
struct Source {
  Tensor tensor;
  std::vector<bf16_bits> expected;
};
Source matrix_source(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
                     std::mt19937_64& rng) {
  std::int64_t count = 1;
  for (const std::int64_t d : shape) count *= d;
  const auto n = static_cast<std::size_t>(count);
  std::uniform_int_distribution<int> k(-2048, 2048);
  std::uniform_real_distribution<float> u(-0.2f, 0.2f);
  Source s;
  s.expected.resize(n);
  if (dtype == DType::kF16) {
    std::vector<std::uint16_t> bits(n);
    for (std::size_t i = 0; i < n; ++i) {
      const int ki = k(rng);
      bits[i] = f16_exact(ki, -14);
      s.expected[i] = kda::float_to_bf16(std::ldexp(static_cast<float>(ki), -14));
    }
    s.tensor = tensor_of(name, dtype, std::move(shape), bits);
  } else if (dtype == DType::kF32) {
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i) {
      values[i] = u(rng);
      s.expected[i] = kda::float_to_bf16(values[i]);
    }
    s.tensor = tensor_of(name, dtype, std::move(shape), values);
  } else {
    for (std::size_t i = 0; i < n; ++i) s.expected[i] = kda::float_to_bf16(u(rng));
    s.tensor = tensor_of(name, dtype, std::move(shape), s.expected);
  }
  return s;
}

// Vectors held as fp32: in F32 as they are, in BF16 rounded, in F16 as exact values k * 2^scale;
// `values` becomes what the loader must read.
Tensor vector_source(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
                     std::vector<float>* values, int scale) {
  if (dtype == DType::kF32) return tensor_of(name, dtype, std::move(shape), *values);
  std::vector<std::uint16_t> bits(values->size());
  if (dtype == DType::kBF16) {
    for (std::size_t i = 0; i < values->size(); ++i) {
      bits[i] = kda::float_to_bf16((*values)[i]);
      (*values)[i] = kda::bf16_to_float(bits[i]);
    }
    return tensor_of(name, dtype, std::move(shape), bits);
  }
  for (std::size_t i = 0; i < values->size(); ++i) {
    const int k = static_cast<int>(std::lround(std::ldexp((*values)[i], -scale)));
    bits[i] = f16_exact(k, scale);
    (*values)[i] = std::ldexp(static_cast<float>(k), scale);  // what the loader must read
  }
  return tensor_of(name, dtype, std::move(shape), bits);
}

// A KDA layer's tensors as a family's checkpoint holds them, and the weights the loader must make
// of them. `matrices`: the dtype of every matrix; conv weights [C, 1, W] F32; A_log [H] (K3, GLM)
// or [1, 1, H, 1] (Kimi-Linear) in `vectors`, dt_bias [C] in `vectors`.
struct LayerCheckpoint {
  std::vector<Tensor> tensors;
  Weights expected;
};
LayerCheckpoint layer_checkpoint(const Config& c, int index, const std::string& pattern,
                                 DType matrices, DType vectors, bool a_log_1d, std::uint64_t seed) {
  const std::int64_t E = c.hidden_size, H = c.num_heads, D = c.head_dim, W = c.conv_width;
  const std::int64_t C = H * D;
  const std::string p = kda::engine::layer_tensor_prefix(index, pattern);
  std::mt19937_64 rng(seed);
  LayerCheckpoint l;
  l.expected.config = c;
  auto matrix = [&](const std::string& name, std::vector<std::int64_t> shape,
                    std::vector<bf16_bits>* into) {
    Source s = matrix_source(p + name, matrices, std::move(shape), rng);
    *into = s.expected;
    l.tensors.push_back(std::move(s.tensor));
  };
  matrix("q_proj.weight", {C, E}, &l.expected.q_proj);
  matrix("k_proj.weight", {C, E}, &l.expected.k_proj);
  matrix("v_proj.weight", {C, E}, &l.expected.v_proj);
  matrix("f_a_proj.weight", {D, E}, &l.expected.f_a_proj);
  matrix("f_b_proj.weight", {C, D}, &l.expected.f_b_proj);
  matrix("b_proj.weight", {H, E}, &l.expected.b_proj);
  if (c.full_rank_gate) {
    matrix("g_proj.weight", {C, E}, &l.expected.g_proj);
  } else {
    matrix("g_a_proj.weight", {D, E}, &l.expected.g_a_proj);
    matrix("g_b_proj.weight", {C, D}, &l.expected.g_b_proj);
  }
  matrix("o_norm.weight", {D}, &l.expected.o_norm);
  for (bf16_bits& x : l.expected.o_norm) x = kda::float_to_bf16(1.0f);  // a plain norm
  l.tensors.back() = tensor_of(p + "o_norm.weight", DType::kBF16, {D}, l.expected.o_norm);
  matrix("o_proj.weight", {E, C}, &l.expected.o_proj);
  std::uniform_real_distribution<float> conv(-0.5f, 0.5f);
  for (auto [name, into] :
       {std::pair<const char*, std::vector<float>*>{"q_conv1d.weight", &l.expected.q_conv},
        {"k_conv1d.weight", &l.expected.k_conv},
        {"v_conv1d.weight", &l.expected.v_conv}}) {
    into->resize(static_cast<std::size_t>(C * W));
    for (float& x : *into) x = conv(rng);
    l.tensors.push_back(tensor_of(p + name, DType::kF32, {C, 1, W}, *into));
  }
  const kda::layer::GateParameters gate = kda::layer::random_gate_parameters(seed, index, H, D);
  l.expected.A_log = gate.A_log;
  l.expected.dt_bias = gate.dt_bias;
  l.tensors.push_back(
      vector_source(p + "A_log", vectors,
                    a_log_1d ? std::vector<std::int64_t>{H} : std::vector<std::int64_t>{1, 1, H, 1},
                    &l.expected.A_log, -8));
  l.tensors.push_back(vector_source(p + "dt_bias", vectors, {C}, &l.expected.dt_bias, -8));
  return l;
}

// What a checkpoint of a hybrid model holds besides its KDA layers: a full-attention layer, an
// MoE expert stored in FP8 (read by nobody), embeddings, a vision tower.
std::vector<Tensor> other_tensors(const std::string& pattern, int full_attention_layer) {
  const std::string p = kda::engine::layer_tensor_prefix(full_attention_layer, pattern);
  std::vector<Tensor> t;
  t.push_back(Tensor::zeros(p + "q_a_proj.weight", DType::kBF16, {8, 32}));
  t.push_back(Tensor::zeros(p + "kv_a_proj_with_mqa.weight", DType::kBF16, {8, 32}));
  t.push_back(Tensor::zeros("model.embed_tokens.weight", DType::kBF16, {16, 32}));
  t.push_back(Tensor::zeros("visual.blocks.0.attn.qkv.weight", DType::kF32, {4, 4}));
  return t;
}

// The safetensors files of a sharded checkpoint: an FP8 tensor (a header entry only this test
// writes) goes into the last shard, then the index of all of them.
void write_sharded(const TempDir& dir, const std::vector<Tensor>& tensors, int shards,
                   const std::string& fp8_name = {}) {
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  std::vector<std::vector<Tensor>> parts(static_cast<std::size_t>(shards));
  for (std::size_t i = 0; i < tensors.size(); ++i) parts[i % parts.size()].push_back(tensors[i]);
  for (int s = 0; s < shards; ++s) {
    const std::string file =
        "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
    kda::engine::save_safetensors(dir.file(file), parts[static_cast<std::size_t>(s)]);
    for (const Tensor& t : parts[static_cast<std::size_t>(s)]) index["weight_map"][t.name] = file;
    if (s + 1 == shards && !fp8_name.empty()) {
      // Append an F8_E4M3 tensor: rewrite the file with a header that lists it after the others.
      const kda::engine::SafetensorsFile saved = kda::engine::SafetensorsFile::open(dir.file(file));
      nlohmann::ordered_json header = nlohmann::ordered_json::object();
      std::string data;
      for (const auto& info : saved.tensors()) {
        const Tensor t = saved.read(info.name);
        header[info.name] = {{"dtype", info.dtype_text},
                             {"shape", info.shape},
                             {"data_offsets", {data.size(), data.size() + t.data.size()}}};
        data.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
      }
      header[fp8_name] = {{"dtype", "F8_E4M3"},
                          {"shape", {4, 8}},
                          {"data_offsets", {data.size(), data.size() + 32}}};
      data.append(32, '\x3c');
      const std::string text = header.dump();
      std::string bytes(8, '\0');
      for (int i = 0; i < 8; ++i)
        bytes[static_cast<std::size_t>(i)] = static_cast<char>(text.size() >> (8 * i));
      std::ofstream(dir.file(file), std::ios::binary) << bytes << text << data;
      index["weight_map"][fp8_name] = file;
    }
  }
  std::ofstream(dir.file("model.safetensors.index.json")) << index.dump(2);
}

void check_weights(const Weights& got, const Weights& expected) {
  CHECK(got.q_proj == expected.q_proj);
  CHECK(got.k_proj == expected.k_proj);
  CHECK(got.v_proj == expected.v_proj);
  CHECK(got.f_a_proj == expected.f_a_proj);
  CHECK(got.f_b_proj == expected.f_b_proj);
  CHECK(got.b_proj == expected.b_proj);
  CHECK(got.g_a_proj == expected.g_a_proj);
  CHECK(got.g_b_proj == expected.g_b_proj);
  CHECK(got.o_norm == expected.o_norm);
  CHECK(got.o_proj == expected.o_proj);
  CHECK(got.q_conv == expected.q_conv);
  CHECK(got.k_conv == expected.k_conv);
  CHECK(got.v_conv == expected.v_conv);
  CHECK(got.A_log == expected.A_log);
  CHECK(got.dt_bias == expected.dt_bias);
}

// A GLM-5.3-Flash config.json for small_config(): layers 1, 2 and 4 KDA, layer 3 full attention.
std::string glm_config() {
  return R"({
  "architectures": ["Glm5NextForConditionalGeneration"],
  "model_type": "glm5_next",
  "text_config": {
    "model_type": "glm5_next_text",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-05,
    "layer_types": ["linear_attention", "linear_attention", "deepseek_sparse_attention",
                    "linear_attention"],
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0
  }
}
)";
}

// The prefill of `tokens` random hidden states through every layer of `engine`, one sequence.
std::vector<std::vector<bf16_bits>> prefill_all(kda::engine::Engine& engine, std::int64_t tokens) {
  const std::int64_t E = engine.spec().hidden_size;
  const std::vector<bf16_bits> hidden =
      kda::test::random_bf16(static_cast<std::size_t>(tokens * E), 1.0f, 5);
  const int slot = engine.acquire_slot();
  std::vector<std::vector<bf16_bits>> outs;
  for (int l = 0; l < engine.num_layers(); ++l) {
    std::vector<bf16_bits> out(hidden.size(), 0xffff);
    engine.prefill_hidden(l, hidden.data(), out.data(), {slot}, {0, tokens});
    outs.push_back(out);
  }
  return outs;
}

kda::engine::EngineOptions cpu_options() {
  kda::engine::EngineOptions o;
  o.backend = kda::engine::BackendChoice::kCpu;
  o.cpu_threads = 1;
  return o;
}

}  // namespace

// ---- configs ---------------------------------------------------------------------------------

KDA_CPU_CASE("the family table: keys, look-ups, the tensor prefixes") {
  const auto& families = kda::engine::model_families();
  REQUIRE(families.size() == 3);
  CHECK(std::string(families[0].name) == "Kimi-Linear");
  CHECK(std::string(families[1].name) == "Kimi K3");
  CHECK(std::string(families[2].name) == "GLM-5.3-Flash");
  CHECK(kda::engine::family_by_key("kimi-k3") == &families[1]);
  CHECK(kda::engine::family_by_model_type("glm5_next_text") == &families[2]);
  CHECK(kda::engine::family_by_architecture("KimiLinearForCausalLM") == &families[0]);
  CHECK(kda::engine::family_by_model_type("llama") == nullptr);
  CHECK(families[0].tensor_prefixes.front() == kKimiPrefix);
  CHECK(families[1].tensor_prefixes.front() == kK3Prefix);
  CHECK(families[2].tensor_prefixes.front() == kGlmPrefix);
  CHECK(kda::engine::expand_tensor_prefix(kK3Prefix, 12) ==
        "language_model.model.layers.12.self_attn.");
  const std::vector<std::string> names = {"a", "model.language_model.layers.3.self_attn.A_log",
                                          "model.layers.3.mlp.gate.weight"};
  const auto found = kda::engine::families_holding(names, 3, "A_log");
  REQUIRE(found.size() == 1);
  CHECK(found.front() == &families[2]);
  CHECK(kda::engine::families_holding(names, 2, "A_log").empty());
  // A family's other prefix: Kimi K3's short form is K3's alone; GLM's text-only form is
  // Kimi-Linear's first, which wins.
  const auto k3_short =
      kda::engine::families_holding({"language_model.layers.0.self_attn.A_log", "z"}, 0, "A_log");
  REQUIRE(k3_short.size() == 1);
  CHECK(k3_short.front() == &families[1]);
  const auto text_only =
      kda::engine::families_holding({"model.layers.0.self_attn.A_log"}, 0, "A_log");
  REQUIRE(text_only.size() == 1);
  CHECK(text_only.front() == &families[0]);
}

KDA_CPU_CASE(
    "Kimi K3's config.json: text_config followed, its gate and full-rank gate, its prefix") {
  kda::engine::ModelSpecOptions strict;
  strict.strict = true;  // every key of its linear_attn_config is one the engine knows
  const ModelSpec k3 = kda::engine::load_model_spec(kModels + "kimi-k3.json", strict);
  CHECK(k3.name == "kimi-k3");
  CHECK(k3.family == "Kimi K3");
  CHECK(k3.family_source == "model_type kimi_k3");
  CHECK(k3.tensor_prefix == kK3Prefix);
  CHECK(k3.hidden_size == 7168);
  CHECK(k3.num_hidden_layers == 93);
  CHECK(k3.num_heads == 96);
  CHECK(k3.head_dim == 128);
  CHECK(k3.short_conv_kernel_size == 4);
  CHECK(k3.num_kda_layers() == 69);
  CHECK(k3.full_attn_layers.size() == 24);
  CHECK(k3.full_attn_layers.back() == 93);
  CHECK(k3.kda_layers.front() == 1);
  CHECK(k3.kda_layers.back() == 91);
  CHECK(k3.gate == kda::GateMode::kLowerBound);
  CHECK(k3.gate_lower_bound == -5.0f);
  CHECK(k3.full_rank_gate);
  CHECK(k3.rms_norm_eps == doctest::Approx(1e-5));
  CHECK(k3.warnings.empty());

  // Its TP8 shard: the same layers, 12 heads a rank.
  const ModelSpec tp8 = kda::engine::load_model_spec(kModels + "kimi-k3-tp8.yaml", strict);
  CHECK(tp8.family == "Kimi K3");
  CHECK(tp8.family_source == "family: kimi-k3");
  CHECK(tp8.kda_layers == k3.kda_layers);
  CHECK(tp8.full_attn_layers == k3.full_attn_layers);
  CHECK(tp8.full_rank_gate);
  CHECK(tp8.gate_lower_bound == -5.0f);
  CHECK(tp8.runtime.tp_size == 8);
  CHECK(tp8.local_heads() == 12);

  // Without gate_lower_bound, Kimi K3's layer runs the softplus gate; errors in text_config name
  // the nested key at its line.
  std::ifstream in(kModels + "kimi-k3.json");
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(parse(replace(json, "\"gate_lower_bound\": -5.0,", "")).gate == kda::GateMode::kSoftplus);
  const std::string bad = parse_error(replace(json, "\"num_heads\": 96", "\"num_heads\": \"96\""));
  CHECK(bad.find("text_config.linear_attn_config.num_heads: expected an integer, got the "
                 "string '96'") != std::string::npos);
  CHECK(bad.rfind("c.json:", 0) == 0);
  CHECK(parse_error(replace(json, "\"gate_lower_bound\": -5.0", "\"gate_lower_bound\": -7"))
            .find("text_config.linear_attn_config.gate_lower_bound: value -7 is outside [-5, 0)") !=
        std::string::npos);
  CHECK(parse_error(replace(json, "\"use_full_rank_gate\": true", "\"use_full_rank_gate\": 1"))
            .find("use_full_rank_gate: expected true or false") != std::string::npos);
}

KDA_CPU_CASE("GLM-5.3-Flash's config: its keys, layer_types, the bounded gate by default") {
  kda::engine::ModelSpecOptions strict;
  strict.strict = true;
  const ModelSpec glm = kda::engine::load_model_spec(kModels + "glm-5.3-flash.json", strict);
  CHECK(glm.family == "GLM-5.3-Flash");
  CHECK(glm.tensor_prefix == kGlmPrefix);
  CHECK(glm.hidden_size == 4096);
  CHECK(glm.num_hidden_layers == 45);
  CHECK(glm.num_heads == 64);
  CHECK(glm.head_dim == 128);
  CHECK(glm.num_kda_layers() == 34);
  CHECK(glm.full_attn_layers == std::vector<int>{4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44});
  CHECK(glm.gate == kda::GateMode::kLowerBound);
  CHECK(glm.gate_lower_bound == -5.0f);
  CHECK_FALSE(glm.full_rank_gate);
  CHECK(glm.warnings.empty());

  const std::string config = glm_config();
  const ModelSpec small = parse(config);
  CHECK(small.kda_layers == std::vector<int>{1, 2, 4});
  CHECK(small.full_attn_layers == std::vector<int>{3});
  CHECK(small.num_heads == 4);
  CHECK(small.head_dim == 8);
  // The bound: the key's value; null is the unbounded gate; no bound key: -5.
  CHECK(parse(replace(config, "-5.0", "-2.5")).gate_lower_bound == -2.5f);
  CHECK(parse(replace(config, "-5.0", "null")).gate == kda::GateMode::kSoftplus);
  const ModelSpec unsaid = parse(replace(config, ",\n    \"linear_lower_bound\": -5.0", ""));
  CHECK(unsaid.gate == kda::GateMode::kLowerBound);
  CHECK(unsaid.gate_lower_bound == -5.0f);
  // The older linear_attn_config dict: lower_bound, or null with safe_gate.
  const std::string older =
      replace(replace(config,
                      "\"linear_num_heads\": 4,\n    \"linear_head_dim\": 8,\n    "
                      "\"linear_conv_kernel_dim\": 4,\n    \"linear_lower_bound\": -5.0",
                      "\"linear_attn_config\": {\"num_heads\": 4, \"head_dim\": 8, "
                      "\"short_conv_kernel_size\": 3, \"lower_bound\": null, \"safe_gate\": true}"),
              "", "");
  const ModelSpec old_spec = parse(older);
  CHECK(old_spec.num_heads == 4);
  CHECK(old_spec.short_conv_kernel_size == 3);
  CHECK(old_spec.gate == kda::GateMode::kLowerBound);
  CHECK(old_spec.gate_lower_bound == -5.0f);
  CHECK(old_spec.warnings.empty());
  CHECK(parse(replace(older, "\"safe_gate\": true", "\"safe_gate\": false")).gate ==
        kda::GateMode::kSoftplus);
  // use_full_rank_gate is Moonshot's key: GLM takes the gate's form from the checkpoint (g_proj),
  // so the key is reported as unknown, and refused when strict.
  const std::string said_full_rank =
      replace(older, "\"safe_gate\": true", "\"safe_gate\": true, \"use_full_rank_gate\": true");
  const ModelSpec not_read = parse(said_full_rank);
  CHECK_FALSE(not_read.full_rank_gate);
  REQUIRE(not_read.warnings.size() == 1);
  CHECK(not_read.warnings[0].find(
            "text_config.linear_attn_config.use_full_rank_gate: unknown key, ignored") !=
        std::string::npos);
  CHECK(error_of([&] {
          kda::engine::parse_model_spec(said_full_rank, "c.json", {}, strict);
        }).find("use_full_rank_gate") != std::string::npos);
  // Without layer_types: every fourth layer is full attention, as transformers defaults.
  const ModelSpec pattern =
      parse(replace(config,
                    "\"layer_types\": [\"linear_attention\", \"linear_attention\", "
                    "\"deepseek_sparse_attention\",\n                    \"linear_attention\"],\n",
                    ""));
  CHECK(pattern.kda_layers == std::vector<int>{1, 2, 3});
  CHECK(pattern.full_attn_layers == std::vector<int>{4});
  // A flat text-only config, named by its architectures.
  const std::string flat = R"({"architectures": ["Glm5NextForCausalLM"], "hidden_size": 32,
      "num_hidden_layers": 4, "linear_num_heads": 4, "linear_head_dim": 8})";
  const ModelSpec text_only = parse(flat);
  CHECK(text_only.family == "GLM-5.3-Flash");
  CHECK(text_only.family_source == "architectures Glm5NextForCausalLM");
  CHECK(text_only.kda_layers == std::vector<int>{1, 2, 3});
  // Errors name the key as the family reads it.
  CHECK(parse_error(replace(config, "\"linear_num_heads\": 4,", ""))
            .find("text_config.linear_num_heads: required key is missing (looked for "
                  "text_config.linear_attn_config.num_heads, then text_config.linear_num_heads)") !=
        std::string::npos);
  CHECK(parse_error(replace(config, "\"linear_attention\"],", "\"linear_attention\", \"x\"],"))
            .find("text_config.layer_types: has 5 entries, expected num_hidden_layers 4") !=
        std::string::npos);
  CHECK(parse_error(replace(config, "-5.0", "0.5"))
            .find("text_config.linear_lower_bound: value "
                  "0.5 is outside [-5, 0)") != std::string::npos);
  // A number or a boolean where a layer type belongs is refused, not taken for full attention.
  for (const char* entry : {"5", "true", "\"\""}) {
    CAPTURE(entry);
    CHECK(parse_error(replace(config, "\"deepseek_sparse_attention\"", entry))
              .find("text_config.layer_types[2]: expected a layer type such as "
                    "\"linear_attention\" or \"full_attention\", got '") != std::string::npos);
  }
}

KDA_CPU_CASE("Kimi-Linear as transformers writes it: top-level sizes and layer_types") {
  const ModelSpec spec = parse(R"({"model_type": "kimi_linear", "hidden_size": 64,
      "num_hidden_layers": 4, "linear_num_heads": 2, "linear_head_dim": 16,
      "linear_conv_kernel_dim": 4,
      "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]})");
  CHECK(spec.family == "Kimi-Linear");
  CHECK(spec.tensor_prefix == kKimiPrefix);
  CHECK(spec.num_heads == 2);
  CHECK(spec.kda_layers == std::vector<int>{1, 2, 3});
  CHECK(spec.full_attn_layers == std::vector<int>{4});
  CHECK(spec.gate == kda::GateMode::kSoftplus);
  // "kda_attention" names a KDA layer as "linear_attention" does.
  const ModelSpec named = parse(R"({"model_type": "kimi_linear", "hidden_size": 64,
      "num_hidden_layers": 3, "linear_num_heads": 2, "linear_head_dim": 16,
      "linear_conv_kernel_dim": 4,
      "layer_types": ["kda_attention", "full_attention", "kda_attention"]})");
  CHECK(named.kda_layers == std::vector<int>{1, 3});
  CHECK(named.full_attn_layers == std::vector<int>{2});
}

KDA_CPU_CASE("GLM-5.3-Flash: which key wins where several are written, and layer_types checked") {
  const std::string config = glm_config();
  // An older linear_attn_config dict beside transformers' top-level keys.
  auto with_dict = [&](const std::string& dict) {
    return replace(config, "\"linear_lower_bound\": -5.0",
                   "\"linear_lower_bound\": -5.0,\n    \"linear_attn_config\": " + dict);
  };
  // transformers' top-level conv width is read (W = 3, not the default 4).
  CHECK(parse(replace(config, "\"linear_conv_kernel_dim\": 4", "\"linear_conv_kernel_dim\": 3"))
            .short_conv_kernel_size == 3);
  // KDA layers: layer_types wins over the dict's kda_layers; without layer_types, the dict's list
  // (not the every-fourth-layer default).
  const std::string both = with_dict("{\"kda_layers\": [1, 3], \"full_attn_layers\": [2, 4]}");
  const ModelSpec typed = parse(both);
  CHECK(typed.kda_layers == std::vector<int>{1, 2, 4});
  CHECK(typed.full_attn_layers == std::vector<int>{3});
  const std::string layer_types =
      "\"layer_types\": [\"linear_attention\", \"linear_attention\", "
      "\"deepseek_sparse_attention\",\n                    \"linear_attention\"],\n";
  const ModelSpec listed = parse(replace(both, layer_types, ""));
  CHECK(listed.kda_layers == std::vector<int>{1, 3});
  CHECK(listed.full_attn_layers == std::vector<int>{2, 4});
  // The bound: the dict's lower_bound wins over linear_lower_bound; Moonshot's gate_lower_bound,
  // the last key looked for, is read when it is the only one.
  const ModelSpec dict_bound = parse(with_dict("{\"lower_bound\": -2.5}"));
  CHECK(dict_bound.gate == kda::GateMode::kLowerBound);
  CHECK(dict_bound.gate_lower_bound == -2.5f);
  const ModelSpec moonshot_bound =
      parse(replace(config, "\"linear_lower_bound\": -5.0",
                    "\"linear_attn_config\": {\"gate_lower_bound\": -3.0}"));
  CHECK(moonshot_bound.gate == kda::GateMode::kLowerBound);
  CHECK(moonshot_bound.gate_lower_bound == -3.0f);
  // An explicit gate: softplus wins over the family's bounded default, and the bound it leaves
  // unused (here linear_lower_bound, not the first key looked for) is still checked.
  CHECK(parse(with_dict("{\"gate\": \"softplus\"}")).gate == kda::GateMode::kSoftplus);
  CHECK(parse_error(replace(with_dict("{\"gate\": \"softplus\"}"), "-5.0", "0.5"))
            .find("text_config.linear_lower_bound: value 0.5 is outside [-5, 0)") !=
        std::string::npos);
  // safe_gate is a boolean even where no bound key makes it matter.
  CHECK(parse_error(replace(config, "\"linear_lower_bound\": -5.0",
                            "\"linear_attn_config\": {\"safe_gate\": \"yes\"}"))
            .find("text_config.linear_attn_config.safe_gate: expected true or false") !=
        std::string::npos);
  // layer_types: one entry per layer, too few as well as too many, and at least one KDA layer.
  CHECK(parse_error(replace(config, "\"deepseek_sparse_attention\",", ""))
            .find("text_config.layer_types: has 3 entries, expected num_hidden_layers 4") !=
        std::string::npos);
  CHECK(parse_error(replace(config, layer_types,
                            "\"layer_types\": [\"full_attention\", \"full_attention\", "
                            "\"full_attention\", \"full_attention\"],\n"))
            .find("text_config.layer_types: names no KDA layer") != std::string::npos);
  // architectures: the first entry the table knows, not only the first entry.
  const ModelSpec second = parse(R"({"architectures": ["SomeWrapperModel", "Glm5NextForCausalLM"],
      "hidden_size": 32, "num_hidden_layers": 4, "linear_num_heads": 4, "linear_head_dim": 8})");
  CHECK(second.family == "GLM-5.3-Flash");
  CHECK(second.family_source == "architectures Glm5NextForCausalLM");
}

KDA_CPU_CASE("unknown families are refused, naming what was looked for") {
  const std::string sizes =
      R"("hidden_size": 64, "num_hidden_layers": 2,
      "linear_attn_config": {"num_heads": 2, "head_dim": 16, "kda_layers": [1, 2], "gate": "softplus"})";
  const std::string type = parse_error("{\"model_type\": \"qwen3_next\", " + sizes + "}");
  CHECK(type.find("c.json:1:16: model_type: 'qwen3_next' is not a model family the engine knows "
                  "(it looks for model_type kimi_linear, kimi_k3, glm5_next, glm5_next_text; "
                  "`family:` kimi-linear, kimi-k3, glm-5.3-flash names one)") != std::string::npos);
  const std::string arch =
      parse_error("{\"architectures\": [\"LlamaForCausalLM\"], " + sizes + "}");
  CHECK(arch.find("architectures: [LlamaForCausalLM] names no model family the engine knows (it "
                  "looks for KimiLinearForCausalLM, KimiK3ForConditionalGeneration, "
                  "Glm5NextForConditionalGeneration, Glm5NextForCausalLM") != std::string::npos);
  const std::string nested =
      parse_error("{\"text_config\": {\"model_type\": \"mamba\", " + sizes + "}}");
  CHECK(nested.find("text_config.model_type: 'mamba' is not a model family") != std::string::npos);
  const std::string key = parse_error("family: kimi-k4\n", "m.yaml");
  CHECK(key ==
        "m.yaml:1:9: family: unknown family 'kimi-k4' (known: kimi-linear, kimi-k3, "
        "glm-5.3-flash)");
  // `family:` wins over a model_type the engine does not know.
  CHECK(parse("{\"family\": \"kimi-linear\", \"model_type\": \"qwen3_next\", " + sizes + "}")
            .family == "Kimi-Linear");
}

KDA_CPU_CASE("tensor_prefix: the description's own, checked for its {i}") {
  const std::string yaml =
      "hidden_size: 64\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 2, head_dim: 16, kda_layers: [1, 2], gate: softplus}\n";
  CHECK(parse(yaml, "m.yaml").tensor_prefix == kKimiPrefix);
  CHECK(parse(yaml + "tensor_prefix: backbone.blocks.{i}.mixer.\n", "m.yaml").tensor_prefix ==
        "backbone.blocks.{i}.mixer.");
  CHECK(parse_error(yaml + "tensor_prefix: model.layers.self_attn.\n", "m.yaml")
            .find("m.yaml:4:16: tensor_prefix: 'model.layers.self_attn.' must hold {i} once") !=
        std::string::npos);
}

// ---- checkpoints -------------------------------------------------------------------------------

KDA_CPU_CASE(
    "each family's layout, F32 / F16 / BF16 sources: converted once, exactly as promised") {
  struct Case {
    const char* family;
    std::string pattern;
    DType matrices, vectors;
    bool a_log_1d;
  };
  for (const Case& c : {Case{"Kimi-Linear", kKimiPrefix, DType::kF32, DType::kF32, false},
                        Case{"Kimi-Linear", kKimiPrefix, DType::kBF16, DType::kBF16, false},
                        Case{"Kimi K3", kK3Prefix, DType::kF32, DType::kF32, true},
                        Case{"GLM-5.3-Flash", kGlmPrefix, DType::kF16, DType::kF16, true},
                        Case{"GLM-5.3-Flash", kGlmPrefix, DType::kBF16, DType::kF32, true}}) {
    const std::string family = c.family;
    const std::string matrix_dtype = kda::engine::safetensors_dtype_name(c.matrices);
    const std::string vector_dtype = kda::engine::safetensors_dtype_name(c.vectors);
    CAPTURE(family);
    CAPTURE(matrix_dtype);
    CAPTURE(vector_dtype);
    const Config config = small_config();
    TempDir dir;
    std::vector<Tensor> tensors = other_tensors(c.pattern, 2);
    std::vector<Weights> expected;
    for (const int index : {0, 1, 3}) {
      LayerCheckpoint l =
          layer_checkpoint(config, index, c.pattern, c.matrices, c.vectors, c.a_log_1d, 40 + index);
      tensors.insert(tensors.end(), l.tensors.begin(), l.tensors.end());
      expected.push_back(l.expected);
    }
    write_sharded(dir, tensors, 3, "model.layers.2.mlp.experts.0.down_proj.weight");
    const Checkpoint checkpoint = Checkpoint::open(dir.path.string());
    int k = 0;
    for (const int index : {0, 1, 3}) {
      CAPTURE(index);
      check_weights(kda::engine::load_layer_weights(checkpoint, index, config, c.pattern),
                    expected[static_cast<std::size_t>(k++)]);
    }
  }
}

KDA_CPU_CASE("F16 values widen exactly, subnormals and extremes included, F32 rounds to even") {
  TempDir dir;
  const Config config = small_config();
  LayerCheckpoint l = layer_checkpoint(config, 0, kGlmPrefix, DType::kBF16, DType::kF32, true, 7);
  // o_norm [8] in F16: subnormal 2^-24, the largest subnormal, the smallest normal, 1, -2, the
  // largest finite, 0.333251953125 and -0.
  const std::vector<std::uint16_t> bits = {0x0001, 0x03ff, 0x0400, 0x3c00,
                                           0xc000, 0x7bff, 0x3555, 0x8000};
  const std::vector<float> values = {std::ldexp(1.0f, -24),
                                     std::ldexp(1023.0f, -24),
                                     std::ldexp(1.0f, -14),
                                     1.0f,
                                     -2.0f,
                                     65504.0f,
                                     std::ldexp(1365.0f, -12),
                                     -0.0f};
  // o_proj in F32 with halfway cases: 1 + 2^-8 (a tie, to even: 1), 1 + 3 * 2^-8 (a tie, to even:
  // 1 + 2^-6).
  for (Tensor& t : l.tensors) {
    if (t.name.find("o_norm") != std::string::npos) {
      t = tensor_of(t.name, DType::kF16, {8}, bits);
    }
    if (t.name.find("o_proj") != std::string::npos) {
      std::vector<float> ties(static_cast<std::size_t>(t.numel()), 1.0f + std::ldexp(1.0f, -8));
      ties[1] = 1.0f + 3.0f * std::ldexp(1.0f, -8);
      t = tensor_of(t.name, DType::kF32, t.shape, ties);
    }
  }
  kda::engine::save_safetensors(dir.file("model.safetensors"), l.tensors);
  const Weights w =
      kda::engine::load_layer_weights(Checkpoint::open(dir.path.string()), 0, config, kGlmPrefix);
  REQUIRE(w.o_norm.size() == 8);
  for (std::size_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    CHECK(w.o_norm[i] == kda::float_to_bf16(values[i]));
  }
  CHECK(w.o_norm[7] == 0x8000);  // -0 kept
  CHECK(w.o_proj[0] == 0x3f80);  // 1
  CHECK(w.o_proj[1] == kda::float_to_bf16(1.0f + std::ldexp(1.0f, -6)));
  CHECK(w.o_proj[1] == 0x3f82);
}

KDA_CPU_CASE(
    "a Hugging Face folder as the model: config.json, sharded F16 checkpoint, TP ranks sum") {
  TempDir dir;
  const Config config = small_config();
  std::vector<Tensor> tensors = other_tensors(kGlmPrefix, 2);
  std::vector<Tensor> bf16_twin;  // the expected weights as a BF16 Kimi-Linear-layout checkpoint
  for (const int index : {0, 1, 3}) {
    LayerCheckpoint l =
        layer_checkpoint(config, index, kGlmPrefix, DType::kF16, DType::kF32, true, 70 + index);
    tensors.insert(tensors.end(), l.tensors.begin(), l.tensors.end());
    for (Tensor& t : kda::engine::layer_weight_tensors(
             l.expected, kda::engine::layer_tensor_prefix(index, kKimiPrefix))) {
      bf16_twin.push_back(std::move(t));
    }
  }
  write_sharded(dir, tensors, 2, "model.language_model.layers.2.mlp.experts.0.w1.weight");
  std::ofstream(dir.file("config.json")) << glm_config();

  kda::engine::ModelSpecOptions options;
  options.runtime.max_tokens = 64;
  options.runtime.max_sequences = 2;
  const ModelSpec spec = kda::engine::load_model_spec(dir.path.string(), options);
  CHECK(spec.family == "GLM-5.3-Flash");
  CHECK(spec.tensor_prefix == kGlmPrefix);
  CHECK(spec.weights == dir.path.string());
  CHECK(spec.name == dir.path.filename().string());
  CHECK(spec.source == dir.file("config.json"));
  CHECK(spec.runtime.max_tokens == 64);  // the runtime sizes: the caller's, or the defaults

  kda::engine::Engine engine(spec, cpu_options());
  CHECK(engine.num_layers() == 3);
  CHECK(engine.weights_origin() == dir.file("model.safetensors.index.json"));
  const auto outputs = prefill_all(engine, 12);

  // The same weights stored as BF16 under Kimi-Linear's names give the same outputs, bit for bit:
  // the F16 checkpoint was read under GLM's names and converted as the twin holds them.
  TempDir twin;
  kda::engine::save_safetensors(twin.file("model.safetensors"), bf16_twin);
  std::ofstream(twin.file("m.yaml"))
      << "hidden_size: 32\nnum_hidden_layers: 4\nweights: model.safetensors\n"
         "linear_attn_config: {num_heads: 4, head_dim: 8, kda_layers: [1, 2, 4], gate: "
         "lower_bound, gate_lower_bound: -5.0}\n"
         "runtime: {max_tokens: 64, max_sequences: 2}\n";
  kda::engine::Engine reference(kda::engine::load_model_spec(twin.file("m.yaml")), cpu_options());
  CHECK(prefill_all(reference, 12) == outputs);

  // Tensor-parallel ranks of the folder's model: their partial sums add up to the whole layer.
  std::vector<std::vector<std::vector<bf16_bits>>> parts;
  for (int rank = 0; rank < 2; ++rank) {
    ModelSpec shard = spec;
    shard.runtime.tp_size = 2;
    shard.runtime.tp_rank = rank;
    kda::engine::Engine e(shard, cpu_options());
    parts.push_back(prefill_all(e, 12));
  }
  for (std::size_t l = 0; l < outputs.size(); ++l) {
    CAPTURE(l);
    std::vector<float> sum(outputs[l].size());
    for (std::size_t i = 0; i < sum.size(); ++i) {
      sum[i] = kda::bf16_to_float(parts[0][l][i]) + kda::bf16_to_float(parts[1][l][i]);
    }
    CHECK(kda::test::relative_error(sum, outputs[l]) < 1e-2);
  }

  // A description that names the folder as its weights and has no model keys reads its
  // config.json; its own runtime section stands.
  std::ofstream(twin.file("folder.yaml"))
      << "weights: " << dir.path.string() << "\nruntime: {max_tokens: 32, max_sequences: 1}\n";
  const ModelSpec via_yaml = kda::engine::load_model_spec(twin.file("folder.yaml"));
  CHECK(via_yaml.family == "GLM-5.3-Flash");
  CHECK(via_yaml.kda_layers == spec.kda_layers);
  CHECK(via_yaml.name == "folder");
  CHECK(via_yaml.runtime.max_tokens == 32);
  CHECK(via_yaml.weights == dir.path.string());
  // One of the model's keys beside such weights would not be merged with config.json: refused,
  // named, rather than ignored; a family's own top-level key (transformers' linear_num_heads) is
  // one of them too.
  struct ModelKey {
    std::string file, line;
  };
  for (const ModelKey& given :
       {ModelKey{"eps.yaml", "rms_norm_eps: 0.5"}, ModelKey{"heads.yaml", "linear_num_heads: 8"}}) {
    CAPTURE(given.line);
    std::ofstream(twin.file(given.file)) << "weights: " << dir.path.string() << "\n"
                                         << given.line << "\n";
    const std::string key = given.line.substr(0, given.line.find(':'));
    // Marked at the value: line 2, the column after "key: ".
    const std::string expected = given.file + ":2:" + std::to_string(key.size() + 3) + ": " + key +
                                 ": a description whose weights name a Hugging Face folder takes "
                                 "the model's keys from its config.json";
    CHECK_THROWS_WITH_AS(kda::engine::load_model_spec(twin.file(given.file)),
                         doctest::Contains(expected.c_str()), kda::Error);
  }
}

KDA_CPU_CASE("Kimi-Linear saved by transformers: one model.safetensors, every tensor F32") {
  TempDir dir;
  const Config config = small_config();
  std::vector<Tensor> tensors = other_tensors(kKimiPrefix, 3);
  std::vector<Weights> expected;
  for (const int index : {0, 1, 2}) {
    LayerCheckpoint l =
        layer_checkpoint(config, index, kKimiPrefix, DType::kF32, DType::kF32, false, 90 + index);
    tensors.insert(tensors.end(), l.tensors.begin(), l.tensors.end());
    expected.push_back(l.expected);
  }
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  std::ofstream(dir.file("config.json"))
      << R"({"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
  "hidden_size": 32, "num_hidden_layers": 4, "torch_dtype": "float32",
  "linear_attn_config": {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
    "kda_layers": [1, 2, 3], "full_attn_layers": [4], "gate": "lower_bound",
    "gate_lower_bound": -5.0}})";
  kda::engine::ModelSpecOptions options;
  options.runtime.max_tokens = 32;
  options.runtime.max_sequences = 1;
  const ModelSpec spec = kda::engine::load_model_spec(dir.path.string(), options);
  kda::engine::Engine engine(spec, cpu_options());
  CHECK(engine.weights_origin() == dir.path.string());
  for (int l = 0; l < 3; ++l) {
    CHECK(engine.layer(l).A_log == expected[static_cast<std::size_t>(l)].A_log);
  }
  CHECK_NOTHROW(prefill_all(engine, 8));
}

KDA_CPU_CASE("a description that names no family: the checkpoint's tensor names give the layout") {
  TempDir dir;
  const Config config = small_config(true);
  std::vector<Tensor> tensors = other_tensors(kK3Prefix, 1);
  std::vector<Weights> expected;
  for (const int index : {0, 2}) {
    LayerCheckpoint l =
        layer_checkpoint(config, index, kK3Prefix, DType::kBF16, DType::kF32, true, 30 + index);
    tensors.insert(tensors.end(), l.tensors.begin(), l.tensors.end());
    expected.push_back(l.expected);
  }
  write_sharded(dir, tensors, 2);
  const std::string yaml = dir.file("m.yaml");
  std::ofstream(yaml) << "hidden_size: 32\nnum_hidden_layers: 3\nweights: .\n"
                         "linear_attn_config: {num_heads: 4, head_dim: 8, kda_layers: [1, 3], "
                         "full_attn_layers: [2], gate: lower_bound, gate_lower_bound: -5.0}\n"
                         "runtime: {max_tokens: 16, max_sequences: 2, layers: core}\n";
  const ModelSpec spec = kda::engine::load_model_spec(yaml);
  CHECK(spec.family == "Kimi K3");
  CHECK(spec.family_source == "the checkpoint's tensor names");
  CHECK(spec.tensor_prefix == kK3Prefix);
  CHECK(spec.full_rank_gate);  // g_proj.weight is there
  // Planned with the full-rank gate; the cores read A_log and dt_bias under Kimi K3's names.
  CHECK(kda::engine::Engine::plan_for(spec, kda::Backend::kCpu).arena_bytes > 0);
  kda::engine::Engine cores(spec, cpu_options());
  CHECK(cores.weights_origin() == dir.file("model.safetensors.index.json"));
  CHECK(cores.layer(0).A_log == expected[0].A_log);
  CHECK(cores.layer(1).dt_bias == expected[1].dt_bias);
  // And they run: one prefill of 4 tokens through the first core.
  const std::size_t n = 4 * 4 * 8;
  const std::vector<bf16_bits> q = kda::test::random_bf16(n, 1.0f, 1),
                               k = kda::test::random_bf16(n, 1.0f, 2),
                               v = kda::test::random_bf16(n, 1.0f, 3),
                               g = kda::test::random_bf16(n, 1.0f, 4),
                               beta = kda::test::random_bf16(4 * 4, 1.0f, 5);
  std::vector<bf16_bits> out(n, 0xffff);
  const int slot = cores.acquire_slot();
  cores.prefill(0, {q.data(), k.data(), v.data(), g.data(), beta.data()}, out.data(), {slot},
                {0, 4});
  CHECK(std::all_of(out.begin(), out.end(),
                    [](bf16_bits x) { return std::isfinite(kda::bf16_to_float(x)); }));

  // The config's word beats the names: use_full_rank_gate: false is a low-rank gate.
  std::ofstream(yaml) << "hidden_size: 32\nnum_hidden_layers: 3\nweights: .\n"
                         "linear_attn_config: {num_heads: 4, head_dim: 8, kda_layers: [1, 3], "
                         "gate: softplus, use_full_rank_gate: false}\n";
  CHECK_FALSE(kda::engine::load_model_spec(yaml).full_rank_gate);
  // Kimi K3's other prefix (language_model.layers.{i}): the family and that prefix.
  TempDir short_form;
  std::vector<Tensor> short_tensors;
  const std::string k3_short = "language_model.layers.{i}.self_attn.";
  for (const int index : {0, 2}) {
    LayerCheckpoint l =
        layer_checkpoint(config, index, k3_short, DType::kBF16, DType::kF32, true, 40 + index);
    short_tensors.insert(short_tensors.end(), l.tensors.begin(), l.tensors.end());
  }
  write_sharded(short_form, short_tensors, 2);
  std::ofstream(short_form.file("m.yaml"))
      << "hidden_size: 32\nnum_hidden_layers: 3\nweights: .\n"
         "linear_attn_config: {num_heads: 4, head_dim: 8, kda_layers: [1, 3], "
         "full_attn_layers: [2], gate: lower_bound, gate_lower_bound: -5.0}\n";
  const ModelSpec short_spec = kda::engine::load_model_spec(short_form.file("m.yaml"));
  CHECK(short_spec.family == "Kimi K3");
  CHECK(short_spec.tensor_prefix == k3_short);
  CHECK(short_spec.full_rank_gate);
  // Names of no family: Kimi-Linear's prefix, as before families.
  TempDir bare;
  kda::engine::save_safetensors(bare.file("w.safetensors"),
                                {Tensor::zeros("A_log", DType::kF32, {4})});
  std::ofstream(bare.file("m.yaml")) << "hidden_size: 32\nnum_hidden_layers: 1\n"
                                        "weights: w.safetensors\n"
                                        "linear_attn_config: {num_heads: 4, head_dim: 8, "
                                        "kda_layers: [1], gate: softplus}\n";
  const ModelSpec unnamed = kda::engine::load_model_spec(bare.file("m.yaml"));
  CHECK(unnamed.family.empty());
  CHECK(unnamed.tensor_prefix == kKimiPrefix);
}

KDA_CPU_CASE("the tensor names beside a config: a family's other prefix, the first KDA layer") {
  // A checkpoint that holds only `names` (F32 zeros): enough for the description to read them.
  auto names_only = [](const TempDir& dir, const std::vector<std::string>& names) {
    std::vector<Tensor> tensors;
    for (const std::string& name : names) tensors.push_back(Tensor::zeros(name, DType::kF32, {4}));
    kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
    return dir.file("model.safetensors");
  };
  // GLM's text-only checkpoint keeps its layers under model.layers.: a GLM config read beside it
  // takes that prefix (its second), and g_proj.weight there makes the output gate full rank.
  TempDir text_only;
  const std::string weights = names_only(
      text_only, {"model.layers.0.self_attn.A_log", "model.layers.0.self_attn.g_proj.weight"});
  const ModelSpec glm =
      parse(replace(glm_config(), "\"model_type\": \"glm5_next\",",
                    "\"model_type\": \"glm5_next\", \"weights\": \"" + weights + "\","));
  CHECK(glm.family == "GLM-5.3-Flash");
  CHECK(glm.tensor_prefix == kKimiPrefix);
  CHECK(glm.full_rank_gate);
  // Without names under either prefix: the family's first.
  TempDir elsewhere;
  const std::string other = names_only(elsewhere, {"backbone.0.A_log"});
  CHECK(parse(replace(glm_config(), "\"model_type\": \"glm5_next\",",
                      "\"model_type\": \"glm5_next\", \"weights\": \"" + other + "\","))
            .tensor_prefix == kGlmPrefix);

  // A description that names no family: the first KDA layer's names say the layout (model layer
  // 2, index 1; layer 3's are not there).
  const std::string yaml =
      "hidden_size: 32\nnum_hidden_layers: 3\n"
      "linear_attn_config: {num_heads: 4, head_dim: 8, kda_layers: [2, 3], "
      "full_attn_layers: [1], gate: softplus}\n";
  TempDir first_layer;
  const ModelSpec k3 =
      parse(yaml + "weights: " +
                names_only(first_layer, {"language_model.model.layers.1.self_attn.A_log"}) + "\n",
            "m.yaml");
  CHECK(k3.family == "Kimi K3");
  CHECK(k3.tensor_prefix == kK3Prefix);
  // Names that two families' first prefixes hold say neither: no family, Kimi-Linear's prefix.
  TempDir two;
  const ModelSpec neither =
      parse(yaml + "weights: " +
                names_only(two, {"language_model.model.layers.1.self_attn.A_log",
                                 "model.language_model.layers.1.self_attn.A_log"}) +
                "\n",
            "m.yaml");
  CHECK(neither.family.empty());
  CHECK(neither.tensor_prefix == kKimiPrefix);
}

KDA_CPU_CASE("bad checkpoints: a wrong prefix, an integer or FP8 tensor, an F32 value past bf16") {
  const Config config = small_config();
  TempDir dir;
  std::vector<Tensor> tensors = other_tensors(kGlmPrefix, 2);
  for (const int index : {0, 1}) {
    LayerCheckpoint l =
        layer_checkpoint(config, index, kGlmPrefix, DType::kBF16, DType::kF32, true, 3 + index);
    tensors.insert(tensors.end(), l.tensors.begin(), l.tensors.end());
  }
  auto load_error = [&](const std::vector<Tensor>& ts, const std::string& pattern, int index) {
    write_sharded(dir, ts, 2);
    return error_of([&] {
      kda::engine::load_layer_weights(Checkpoint::open(dir.path.string()), index, config, pattern);
    });
  };
  // Read as Kimi-Linear's: refused naming the tensor looked for, and where the checkpoint has it.
  const std::string wrong = load_error(tensors, kKimiPrefix, 1);
  CHECK(wrong.find(dir.file("model.safetensors.index.json") +
                   ": no tensor 'model.layers.1.self_attn.q_proj.weight' (nor 'q_proj.weight')") !=
        std::string::npos);
  CHECK(wrong.find("the checkpoint has 'model.language_model.layers.1.self_attn.q_proj.weight': "
                   "its tensors are not under model.layers.{i}.self_attn.") != std::string::npos);

  auto replaced = [&](const std::string& name, Tensor replacement) {
    std::vector<Tensor> ts = tensors;
    for (Tensor& t : ts) {
      if (t.name == name) t = std::move(replacement);
    }
    return ts;
  };
  // An integer tensor where a float is expected: the tensor and the shard file that holds it.
  const std::string f_b = "model.language_model.layers.1.self_attn.f_b_proj.weight";
  const std::string integer =
      load_error(replaced(f_b, Tensor::zeros(f_b, DType::kI32, {32, 8})), kGlmPrefix, 1);
  const std::string shard = integer.substr(0, integer.find(": "));
  CHECK(shard.find("model-0000") != std::string::npos);
  CHECK(integer ==
        shard + ": tensor '" + f_b + "' has dtype I32, expected a float dtype (F32, F16 or BF16)");
  // An F32 value bf16 cannot hold.
  const std::string o = "model.language_model.layers.0.self_attn.o_proj.weight";
  std::vector<float> huge(32 * 32, 0.5f);
  huge[5] = 3.4e38f;
  const std::string overflow =
      load_error(replaced(o, tensor_of(o, DType::kF32, {32, 32}, huge)), kGlmPrefix, 0);
  CHECK(overflow.find("tensor '" + o + "' holds 3.4e+38 at element 5, not a finite bf16 value") !=
        std::string::npos);
  // BF16 as stored is taken as it is, but not an Inf or a NaN.
  for (const std::uint16_t bits : {std::uint16_t{0x7F80}, std::uint16_t{0xFFC1}}) {
    std::vector<std::uint16_t> stored(32 * 32, 0x3F00);  // 0.5
    stored[7] = bits;
    const std::string error =
        load_error(replaced(o, tensor_of(o, DType::kBF16, {32, 32}, stored)), kGlmPrefix, 0);
    CAPTURE(error);
    CHECK(error.find("tensor '" + o + "' holds " + (bits == 0x7F80 ? "inf" : "-nan") +
                     " at element 7, not a finite bf16 value") != std::string::npos);
  }
  // A non-finite vector value is named too.
  const std::string a = "model.language_model.layers.0.self_attn.A_log";
  const std::string nan = load_error(
      replaced(a, tensor_of(a, DType::kF16, {4}, std::vector<std::uint16_t>{0, 0x7e00, 0, 0})),
      kGlmPrefix, 0);
  CHECK(nan.find("tensor '" + a + "' holds a non-finite value at element 1") != std::string::npos);
}

KDA_CPU_CASE("an FP8 tensor of the KDA layer itself is refused by name, FP8 elsewhere is ignored") {
  const Config config = small_config();
  TempDir dir;
  LayerCheckpoint l = layer_checkpoint(config, 0, kGlmPrefix, DType::kBF16, DType::kF32, true, 1);
  const std::string q = "model.language_model.layers.0.self_attn.q_proj.weight";
  std::vector<Tensor> tensors;
  for (Tensor& t : l.tensors) {
    if (t.name != q) tensors.push_back(std::move(t));
  }
  write_sharded(dir, tensors, 1, q);
  const std::string message = error_of([&] {
    kda::engine::load_layer_weights(Checkpoint::open(dir.path.string()), 0, config, kGlmPrefix);
  });
  CHECK(message == dir.file("model-00001-of-00001.safetensors") + ": tensor '" + q +
                       "' has dtype F8_E4M3, expected a float dtype (F32, F16 or BF16)");
}

// ---- each family's folder on CUDA --------------------------------------------------------------

namespace {

// A family's folder at the CUDA layer's head size (D = 128): config.json and its safetensors.
struct FamilyFolder {
  const char* what;
  std::string prefix;
  DType matrices, vectors;
  bool a_log_1d, full_rank, sharded;
  std::string config_json;
};

std::vector<FamilyFolder> cuda_family_folders() {
  const std::string sizes = R"("hidden_size": 64, "num_hidden_layers": 3, "rms_norm_eps": 1e-05)";
  return {
      {"Kimi K3: BF16 matrices, F32 conv / A_log [H] / dt_bias, the full-rank gate", kK3Prefix,
       DType::kBF16, DType::kF32, true, true, true,
       R"({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
  "text_config": {"model_type": "kimi_linear", )" +
           sizes + R"(, "linear_attn_config": {"num_heads": 2, "head_dim": 128,
  "short_conv_kernel_size": 4, "kda_layers": [1, 3], "full_attn_layers": [2],
  "gate_lower_bound": -5.0, "use_full_rank_gate": true}}})"},
      {"GLM-5.3-Flash: F16 matrices, sharded, the low-rank gate", kGlmPrefix, DType::kF16,
       DType::kF32, true, false, true,
       R"({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
  "text_config": {"model_type": "glm5_next_text", )" +
           sizes + R"(, "layer_types": ["linear_attention", "deepseek_sparse_attention",
  "linear_attention"], "linear_num_heads": 2, "linear_head_dim": 128,
  "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0}})"},
      {"Kimi-Linear saved by transformers: every tensor F32, one file, the softplus gate",
       kKimiPrefix, DType::kF32, DType::kF32, false, false, false,
       R"({"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", )" + sizes +
           R"(, "torch_dtype": "float32", "linear_attn_config": {"num_heads": 2, "head_dim": 128,
  "short_conv_kernel_size": 4, "kda_layers": [1, 3], "full_attn_layers": [2],
  "gate": "softplus"}})"},
  };
}

// Prefill of two sequences (37 and 5 tokens, a padding row between them), then two decode steps
// of both, through every layer; the outputs in order, downloaded.
std::vector<std::vector<bf16_bits>> run_family(kda::engine::Engine& engine,
                                               const kda::test::Runner& runner) {
  using kda::test::Memory;
  const std::int64_t E = engine.spec().hidden_size;
  const std::int64_t T = 42;
  const std::vector<bf16_bits> prompt =
      kda::test::random_bf16(static_cast<std::size_t>(T * E), 1.0f, 11);
  const int a = engine.acquire_slot(), b = engine.acquire_slot();
  std::vector<std::vector<bf16_bits>> outs;
  Memory hidden = Memory::from(runner, prompt);
  Memory out(runner, prompt.size() * sizeof(bf16_bits));
  for (int l = 0; l < engine.num_layers(); ++l) {
    out.fill(0xff);
    engine.prefill_hidden(l, hidden.get(), out.get(), {a, -1, b}, {0, 37, 37, T});
    outs.push_back(out.download<bf16_bits>());
  }
  for (int step = 0; step < 2; ++step) {
    const std::vector<bf16_bits> token =
        kda::test::random_bf16(static_cast<std::size_t>(2 * E), 1.0f, 20 + step);
    Memory h = Memory::from(runner, token);
    Memory o(runner, token.size() * sizeof(bf16_bits));
    for (int l = 0; l < engine.num_layers(); ++l) {
      o.fill(0xff);
      engine.decode_hidden(l, h.get(), o.get(), {b, a}, 1);
      outs.push_back(o.download<bf16_bits>());
    }
  }
  return outs;
}

}  // namespace

// On the CPU the engine under test is a second CPU engine: the same bits.
KDA_MATRIX_CASE(
    "each family's folder: K3, GLM-5.3-Flash and F32 Kimi-Linear as the CPU runs them") {
  for (const FamilyFolder& family : cuda_family_folders()) {
    CAPTURE(family.what);
    TempDir dir;
    Config c;
    c.hidden_size = 64;
    c.num_heads = 2;
    c.head_dim = 128;
    c.conv_width = 4;
    c.full_rank_gate = family.full_rank;
    std::vector<Tensor> tensors = other_tensors(family.prefix, 1);
    for (const int index : {0, 2}) {
      LayerCheckpoint l = layer_checkpoint(c, index, family.prefix, family.matrices, family.vectors,
                                           family.a_log_1d, 50 + index);
      tensors.insert(tensors.end(), l.tensors.begin(), l.tensors.end());
    }
    if (family.sharded) {
      write_sharded(dir, tensors, 2);
    } else {
      kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
    }
    std::ofstream(dir.file("config.json")) << family.config_json;
    kda::engine::ModelSpecOptions options;
    options.runtime.max_tokens = 64;
    options.runtime.max_sequences = 3;
    const ModelSpec spec = kda::engine::load_model_spec(dir.path.string(), options);
    REQUIRE(spec.num_kda_layers() == 2);
    CHECK(spec.full_rank_gate == family.full_rank);

    kda::engine::Engine tested(spec, kda::test::engine_options(runner));
    kda::engine::Engine cpu(spec, cpu_options());
    const auto got = run_family(tested, runner);
    const auto want = run_family(cpu, kda::test::cpu_runner());
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      // bf16 projections accumulated in another order, the chunked core against the CPU's
      // token-by-token recurrence: the layer tests' CUDA-against-CPU tolerance.
      CHECK(kda::test::deviation(got[i], want[i]) <= kda::test::allowed(runner, 2e-2));
      CHECK(std::all_of(got[i].begin(), got[i].end(),
                        [](bf16_bits x) { return std::isfinite(kda::bf16_to_float(x)); }));
    }
  }
}
