// A whole layer's weights in checkpoints (kda/engine/layer_weights_io.hpp): round trips through
// safetensors with and without the layer prefix, a tensor-parallel load keeping the rank's shard,
// a sharded checkpoint's index, tensors refused by name (missing, misshapen, wrongly typed, out of
// range), and the full-rank output gate g_proj (round trip, its shard, and the checkpoints that
// hold the wrong gate form or both).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kda/engine/checkpoint.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"
#include "kda/layer/weights.hpp"
#include "layer_test_util.hpp"
#include "temp_dir.hpp"

using kda::DType;
using kda::engine::Checkpoint;
using kda::engine::Tensor;
using kda::layer::Config;
using kda::layer::Weights;
using kda::test::error_of;
using kda::test::TempDir;
using kda::test::with_bias_and_norm;

namespace {

Config small_config() {
  Config c;
  c.hidden_size = 48;
  c.num_heads = 4;
  c.head_dim = 16;
  c.conv_width = 4;
  return c;
}

}  // namespace

TEST_CASE("layer weights round trip through safetensors, with and without the layer prefix") {
  const Config config = small_config();
  const Weights weights = with_bias_and_norm(kda::layer::random_weights(config, 9, 5));
  TempDir dir;
  for (const std::string prefix : {std::string(), kda::engine::layer_tensor_prefix(5)}) {
    CAPTURE(prefix);
    const std::string path = dir.file("layer.safetensors");
    kda::engine::save_safetensors(path, kda::engine::layer_weight_tensors(weights, prefix));
    const Weights loaded = kda::engine::load_layer_weights(Checkpoint::open(path), 5, config);
    CHECK(loaded.q_proj == weights.q_proj);
    CHECK(loaded.v_conv == weights.v_conv);
    CHECK(loaded.f_b_proj == weights.f_b_proj);
    CHECK(loaded.g_b_bias == weights.g_b_bias);
    CHECK(loaded.A_log == weights.A_log);
    CHECK(loaded.dt_bias == weights.dt_bias);
    CHECK(loaded.o_norm == weights.o_norm);
    CHECK(loaded.o_proj == weights.o_proj);
    // Another layer index finds the bare names only.
    if (prefix.empty()) {
      CHECK(kda::engine::load_layer_weights(Checkpoint::open(path), 0, config).b_proj ==
            weights.b_proj);
    } else {
      CHECK(error_of([&] {
              kda::engine::load_layer_weights(Checkpoint::open(path), 0, config);
            }).find("model.layers.0.self_attn.q_proj.weight") != std::string::npos);
    }
  }
  // A tensor-parallel load keeps the rank's shard.
  Config rank1 = config;
  rank1.tp_size = 2;
  rank1.tp_rank = 1;
  const Weights shard =
      kda::engine::load_layer_weights(Checkpoint::open(dir.file("layer.safetensors")), 5, rank1);
  CHECK(shard.o_proj == kda::layer::shard_weights(weights, 2, 1).o_proj);
  CHECK(shard.A_log.size() == 2);
  // A shard has no checkpoint shapes.
  CHECK(error_of([&] { kda::engine::layer_weight_tensors(shard); }) != "(no error)");
}

TEST_CASE("layer weights load from a sharded checkpoint's model.safetensors.index.json") {
  const Config config = small_config();
  const Weights weights = kda::layer::random_weights(config, 12, 2);
  std::vector<Tensor> tensors =
      kda::engine::layer_weight_tensors(weights, kda::engine::layer_tensor_prefix(2));
  TempDir dir;
  // Half of the tensors in each of two shards, plus one unrelated tensor.
  std::vector<Tensor> shard1(tensors.begin(), tensors.begin() + 7);
  std::vector<Tensor> shard2(tensors.begin() + 7, tensors.end());
  shard2.push_back(Tensor::zeros("model.embed_tokens.weight", DType::kBF16, {4, 4}));
  kda::engine::save_safetensors(dir.file("model-00001-of-00002.safetensors"), shard1);
  kda::engine::save_safetensors(dir.file("model-00002-of-00002.safetensors"), shard2);
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  for (const Tensor& t : shard1) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const Tensor& t : shard2) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir.file("model.safetensors.index.json")) << index.dump(2);

  for (const std::string& path : {dir.file("model.safetensors.index.json"), dir.path.string()}) {
    CAPTURE(path);
    const Weights loaded = kda::engine::load_layer_weights(Checkpoint::open(path), 2, config);
    CHECK(loaded.k_proj == weights.k_proj);
    CHECK(loaded.o_norm == weights.o_norm);
    CHECK(loaded.o_proj == weights.o_proj);
  }

  // The index decides where a tensor is: one a shard holds but weight_map does not list is not
  // found (here a name that sorts just before a listed one of the same shard).
  {
    TempDir unlisted_dir;
    std::vector<Tensor> second = shard2;
    const std::string unlisted = "model.layers.2.self_attn.o_proj";
    second.push_back(Tensor::zeros(unlisted, DType::kBF16, {2}));
    kda::engine::save_safetensors(unlisted_dir.file("model-00001-of-00002.safetensors"), shard1);
    kda::engine::save_safetensors(unlisted_dir.file("model-00002-of-00002.safetensors"), second);
    std::ofstream(unlisted_dir.file("model.safetensors.index.json")) << index.dump(2);
    const Checkpoint checkpoint = Checkpoint::open(unlisted_dir.path.string());
    CHECK(checkpoint.find(unlisted) == nullptr);
    CHECK(checkpoint.find("model.layers.2.self_attn.o_proj.weight") != nullptr);
  }

  // Gate parameters outside the operator's range: the error names the shard that holds A_log.
  {
    Weights bad = weights;
    bad.A_log[0] = 80.0f;
    const std::vector<Tensor> bad_tensors =
        kda::engine::layer_weight_tensors(bad, kda::engine::layer_tensor_prefix(2));
    TempDir bad_dir;
    nlohmann::json bad_index;
    std::vector<Tensor> first(bad_tensors.begin(), bad_tensors.begin() + 7);
    std::vector<Tensor> second(bad_tensors.begin() + 7, bad_tensors.end());
    kda::engine::save_safetensors(bad_dir.file("a.safetensors"), first);
    kda::engine::save_safetensors(bad_dir.file("b.safetensors"), second);
    std::string holder;
    for (const Tensor& t : first) {
      bad_index["weight_map"][t.name] = "a.safetensors";
      if (t.name == "model.layers.2.self_attn.A_log") holder = bad_dir.file("a.safetensors");
    }
    for (const Tensor& t : second) {
      bad_index["weight_map"][t.name] = "b.safetensors";
      if (t.name == "model.layers.2.self_attn.A_log") holder = bad_dir.file("b.safetensors");
    }
    REQUIRE_FALSE(holder.empty());
    std::ofstream(bad_dir.file("model.safetensors.index.json")) << bad_index.dump();
    const std::string refusal = error_of([&] {
      kda::engine::load_layer_weights(Checkpoint::open(bad_dir.path.string()), 2, config);
    });
    CHECK(refusal.find(holder + ": tensor 'model.layers.2.self_attn.A_log': A_log[0] = 80") !=
          std::string::npos);
  }

  // An index that puts a tensor in the wrong shard names both.
  index["weight_map"]["model.layers.2.self_attn.o_proj.weight"] =
      "model-00001-of-00002.safetensors";
  std::ofstream(dir.file("model.safetensors.index.json")) << index.dump(2);
  const std::string message = error_of([&] { Checkpoint::open(dir.path.string()); });
  CHECK(message.find("model.layers.2.self_attn.o_proj.weight") != std::string::npos);
  CHECK(message.find("model-00001-of-00002.safetensors") != std::string::npos);

  // An index that is not JSON names where its text stops parsing; one that is JSON but not an
  // object, or has no weight_map object, says so.
  TempDir broken_dir;
  const std::string broken_index = broken_dir.file("model.safetensors.index.json");
  std::ofstream(broken_index) << "{\n  \"weight_map\": {\n    \"a\": \"b.safetensors\",\n  }\n}\n";
  const std::string syntax = error_of([&] { Checkpoint::open(broken_dir.path.string()); });
  CHECK(syntax.find(broken_index + ": is not valid JSON: parse error at line 4, column 3") !=
        std::string::npos);
  CHECK(syntax.find("[json.exception") == std::string::npos);
  std::ofstream(broken_index) << "[\"weight_map\"]";
  CHECK(error_of([&] {
          Checkpoint::open(broken_dir.path.string());
        }).find(broken_index + ": is not a JSON object") != std::string::npos);
  std::ofstream(broken_index) << "{\"weight_map\": [\"b.safetensors\"]}";
  CHECK(error_of([&] {
          Checkpoint::open(broken_dir.path.string());
        }).find(broken_index + ": has no \"weight_map\" object") != std::string::npos);

  // A tensor listed twice: nlohmann would keep the second shard named.
  std::ofstream(broken_index) << R"({"weight_map": {"a": "b.safetensors", "a": "c.safetensors"}})";
  CHECK(error_of([&] {
          Checkpoint::open(broken_dir.path.string());
        }).find(broken_index + ": the checkpoint index repeats the key 'a' in one object") !=
        std::string::npos);

  // An index that is a FIFO (its reader would block forever) or a link to a device (never ending),
  // named or found in its folder, is refused before it is opened; one holding binary data names
  // the offset of its first zero byte.
  TempDir special_dir;
  const std::string fifo_index = special_dir.file("model.safetensors.index.json");
  REQUIRE(::mkfifo(fifo_index.c_str(), 0600) == 0);
  for (const std::string& named : {fifo_index, special_dir.path.string()}) {
    CAPTURE(named);
    CHECK(error_of([&] { Checkpoint::open(named); }) ==
          fifo_index + ": the checkpoint index is not a regular file (a FIFO, socket or device)");
  }
  TempDir device_dir;
  const std::string device_index = device_dir.file("index.json");
  std::error_code linked;
  std::filesystem::create_symlink("/dev/zero", device_index, linked);
  if (!linked) {
    CHECK(error_of([&] {
            Checkpoint::open(device_index);
          }).find(device_index + ": the checkpoint index is not a regular file") == 0);
  }
  std::ofstream(broken_index, std::ios::binary) << std::string("{\"weight_map\"\0}", 15);
  CHECK(error_of([&] { Checkpoint::open(broken_index); })
            .find(broken_index + ": the checkpoint index holds binary data (a zero byte at offset "
                                 "13): it should be the JSON text") == 0);

  // Shards outside the index's directory are refused before anything is opened, although the
  // files named exist.
  TempDir inner_dir;
  const std::string outside = dir.file("model-00002-of-00002.safetensors");
  for (const std::string& shard :
       {std::string(""), outside,
        "../" + dir.path.filename().string() + "/model-00002-of-00002.safetensors"}) {
    CAPTURE(shard);
    nlohmann::json inner;
    inner["weight_map"]["model.embed_tokens.weight"] = shard;
    std::ofstream(inner_dir.file("model.safetensors.index.json")) << inner.dump();
    const std::string refusal = error_of([&] { Checkpoint::open(inner_dir.path.string()); });
    CHECK(refusal.find("names the shard '" + shard + "', not a file under the index's directory") !=
          std::string::npos);
  }
}

TEST_CASE("bad layer weights: missing, misshapen or wrongly typed tensors are refused by name") {
  const Config config = small_config();
  const Weights weights = kda::layer::random_weights(config, 1, 0);
  const std::vector<Tensor> good = kda::engine::layer_weight_tensors(weights);
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  auto load_error = [&](std::vector<Tensor> tensors) {
    kda::engine::save_safetensors(path, tensors);
    return error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), -1, config); });
  };
  auto replaced = [&](const std::string& name, Tensor replacement) {
    std::vector<Tensor> tensors = good;
    for (Tensor& t : tensors) {
      if (t.name == name) t = std::move(replacement);
    }
    return tensors;
  };

  SUBCASE("missing") {
    std::vector<Tensor> tensors;
    for (const Tensor& t : good) {
      if (t.name != "g_a_proj.weight") tensors.push_back(t);
    }
    const std::string message = load_error(tensors);
    CHECK(message.find("no tensor 'g_a_proj.weight'") != std::string::npos);
  }
  SUBCASE("wrong shape") {
    const std::string message = load_error(
        replaced("f_b_proj.weight", Tensor::zeros("f_b_proj.weight", DType::kBF16, {16, 64})));
    CHECK(message.find("'f_b_proj.weight' has shape [16, 64], expected [64, 16]") !=
          std::string::npos);
  }
  SUBCASE("wrong dtype") {
    const std::string message = load_error(
        replaced("o_proj.weight", Tensor::zeros("o_proj.weight", DType::kI64, {48, 64})));
    CHECK(message.find(path + ": tensor 'o_proj.weight' has dtype I64, expected a float dtype "
                              "(F32, F16 or BF16)") != std::string::npos);
  }
  SUBCASE("conv weight of the wrong dtype") {
    const std::string message = load_error(
        replaced("k_conv1d.weight", Tensor::zeros("k_conv1d.weight", DType::kI32, {64, 1, 4})));
    CHECK(message.find("'k_conv1d.weight' has dtype I32, expected a float dtype") !=
          std::string::npos);
  }
  SUBCASE("A_log out of range") {
    Tensor a_log = Tensor::zeros("A_log", DType::kF32, {1, 1, 4, 1});
    a_log.data_as<float>()[2] = 30.0f;
    const std::string message = load_error(replaced("A_log", a_log));
    CHECK(message.find("tensor 'A_log'") != std::string::npos);
    CHECK(message.find("A_log[2] = 30") != std::string::npos);
  }
}

TEST_CASE("a full-rank output gate: g_proj round trips, shards by rows, the wrong or both forms") {
  Config config = small_config();
  config.full_rank_gate = true;
  const Weights weights = with_bias_and_norm(kda::layer::random_weights(config, 4, 3));
  const std::vector<Tensor> tensors =
      kda::engine::layer_weight_tensors(weights, kda::engine::layer_tensor_prefix(3));
  // g_proj [C, E] in place of the low-rank pair; the bias keeps its name.
  bool has_g_proj = false, has_bias = false;
  for (const Tensor& t : tensors) {
    CAPTURE(t.name);
    CHECK(t.name.find("g_a_proj") == std::string::npos);
    CHECK(t.name.find("g_b_proj.weight") == std::string::npos);
    if (t.name == "model.layers.3.self_attn.g_proj.weight") {
      has_g_proj = true;
      CHECK(t.dtype == DType::kBF16);
      CHECK(t.shape == std::vector<std::int64_t>{64, 48});
    }
    has_bias = has_bias || t.name == "model.layers.3.self_attn.g_b_proj.bias";
  }
  CHECK(has_g_proj);
  CHECK(has_bias);

  TempDir dir;
  const std::string path = dir.file("k3.safetensors");
  kda::engine::save_safetensors(path, tensors);
  const Weights loaded = kda::engine::load_layer_weights(Checkpoint::open(path), 3, config);
  CHECK(loaded.config.full_rank_gate);
  CHECK(loaded.g_proj == weights.g_proj);
  CHECK(loaded.g_b_bias == weights.g_b_bias);
  CHECK(loaded.g_a_proj.empty());
  CHECK(loaded.g_b_proj.empty());
  CHECK(loaded.q_proj == weights.q_proj);
  CHECK(loaded.o_proj == weights.o_proj);
  Config rank1 = config;
  rank1.tp_size = 2;
  rank1.tp_rank = 1;
  const Weights shard = kda::engine::load_layer_weights(Checkpoint::open(path), 3, rank1);
  CHECK(shard.g_proj == kda::layer::shard_weights(weights, 2, 1).g_proj);
  CHECK(shard.g_proj.size() == weights.g_proj.size() / 2);

  // The same checkpoint under a low-rank config, and a low-rank checkpoint under a full-rank one:
  // refused naming the missing tensor and what the checkpoint holds instead.
  Config low_rank = config;
  low_rank.full_rank_gate = false;
  std::string message =
      error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), 3, low_rank); });
  CHECK(message.find(path) != std::string::npos);
  CHECK(message.find("no tensor 'model.layers.3.self_attn.g_a_proj.weight'") != std::string::npos);
  CHECK(message.find("'model.layers.3.self_attn.g_proj.weight'") != std::string::npos);
  const std::string low_path = dir.file("low.safetensors");
  kda::engine::save_safetensors(
      low_path, kda::engine::layer_weight_tensors(kda::layer::random_weights(low_rank, 4, 3)));
  message =
      error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(low_path), -1, config); });
  CHECK(message.find(low_path) != std::string::npos);
  CHECK(message.find("no tensor 'g_proj.weight'") != std::string::npos);
  CHECK(message.find("full-rank") != std::string::npos);
  CHECK(message.find("'g_a_proj.weight', 'g_b_proj.weight'") != std::string::npos);
  // Neither form at all.
  std::vector<Tensor> no_gate;
  for (const Tensor& t : tensors) {
    if (t.name.find("g_proj.weight") == std::string::npos) no_gate.push_back(t);
  }
  kda::engine::save_safetensors(path, no_gate);
  message = error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), 3, config); });
  CHECK(message.find("no tensor 'model.layers.3.self_attn.g_proj.weight' (nor 'g_proj.weight')") !=
        std::string::npos);
  CHECK(message.find("neither form") != std::string::npos);

  // Both forms present: refused for either config, naming the file and the tensors.
  std::vector<Tensor> both = tensors;
  both.push_back(Tensor::zeros("model.layers.3.self_attn.g_a_proj.weight", DType::kBF16, {16, 48}));
  both.push_back(Tensor::zeros("g_b_proj.weight", DType::kBF16, {64, 16}));
  kda::engine::save_safetensors(path, both);
  for (const Config& c : {config, low_rank}) {
    CAPTURE(c.full_rank_gate);
    message = error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), 3, c); });
    CHECK(message.find(path) != std::string::npos);
    CHECK(message.find("both output gate forms present") != std::string::npos);
    CHECK(message.find("'model.layers.3.self_attn.g_proj.weight' (full rank)") !=
          std::string::npos);
    CHECK(
        message.find("'model.layers.3.self_attn.g_a_proj.weight', 'g_b_proj.weight' (low rank)") !=
        std::string::npos);
  }
}

TEST_CASE("tensors as written: the checkpoint's shapes and dtypes, A_log as Kimi-Linear's") {
  const Config config = small_config();  // E 48, H 4, D 16, W 4: C 64
  const Weights weights = with_bias_and_norm(kda::layer::random_weights(config, 3, 1));
  using Shape = std::vector<std::int64_t>;
  struct Expected {
    const char* name;
    DType dtype;
    Shape shape;
  };
  const std::vector<Expected> expected = {
      {"q_proj.weight", DType::kBF16, {64, 48}},    {"k_proj.weight", DType::kBF16, {64, 48}},
      {"v_proj.weight", DType::kBF16, {64, 48}},    {"q_conv1d.weight", DType::kF32, {64, 1, 4}},
      {"k_conv1d.weight", DType::kF32, {64, 1, 4}}, {"v_conv1d.weight", DType::kF32, {64, 1, 4}},
      {"f_a_proj.weight", DType::kBF16, {16, 48}},  {"f_b_proj.weight", DType::kBF16, {64, 16}},
      {"b_proj.weight", DType::kBF16, {4, 48}},     {"g_a_proj.weight", DType::kBF16, {16, 48}},
      {"g_b_proj.weight", DType::kBF16, {64, 16}},  {"g_b_proj.bias", DType::kBF16, {64}},
      {"A_log", DType::kF32, {1, 1, 4, 1}},         {"dt_bias", DType::kF32, {64}},
      {"o_norm.weight", DType::kBF16, {16}},        {"o_proj.weight", DType::kBF16, {48, 64}}};
  const std::vector<Tensor> tensors = kda::engine::layer_weight_tensors(weights, "p.");
  REQUIRE(tensors.size() == expected.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    CAPTURE(tensors[i].name);
    CHECK(tensors[i].name == std::string("p.") + expected[i].name);
    CHECK(tensors[i].dtype == expected[i].dtype);
    CHECK(tensors[i].shape == expected[i].shape);
  }
}

TEST_CASE("the other accepted shapes load as the released ones, their transposes are refused") {
  const Config config = small_config();  // E 48, H 4, D 16, W 4: C 64
  const Weights weights = with_bias_and_norm(kda::layer::random_weights(config, 3, 1));
  using Shape = std::vector<std::int64_t>;
  // The released tensors with some given other shapes of the same values (row-major, so the same
  // bytes): conv weights [C, W] for [C, 1, W], dt_bias [H, D] for [C], A_log [H] for [1, 1, H, 1].
  auto reshaped = [&](const std::vector<std::pair<std::string, Shape>>& shapes) {
    std::vector<Tensor> tensors = kda::engine::layer_weight_tensors(weights);
    for (Tensor& t : tensors) {
      for (const auto& [name, shape] : shapes) {
        if (t.name == name) t.shape = shape;
      }
    }
    return tensors;
  };
  TempDir dir;
  const std::string path = dir.file("layer.safetensors");
  kda::engine::save_safetensors(path, reshaped({{"q_conv1d.weight", {64, 4}},
                                                {"k_conv1d.weight", {64, 4}},
                                                {"v_conv1d.weight", {64, 4}},
                                                {"dt_bias", {4, 16}},
                                                {"A_log", {4}}}));
  const Weights loaded = kda::engine::load_layer_weights(Checkpoint::open(path), -1, config);
  CHECK(loaded.q_conv == weights.q_conv);
  CHECK(loaded.k_conv == weights.k_conv);
  CHECK(loaded.v_conv == weights.v_conv);
  CHECK(loaded.dt_bias == weights.dt_bias);
  CHECK(loaded.A_log == weights.A_log);
  // Rank 1 of 2 from those shapes: channels [32, 64) (each conv's rows, dt_bias's values), heads
  // [2, 4) of A_log, taken here of the whole layer's tensors.
  Config rank1 = config;
  rank1.tp_size = 2;
  rank1.tp_rank = 1;
  const Weights shard = kda::engine::load_layer_weights(Checkpoint::open(path), -1, rank1);
  CHECK(shard.q_conv == std::vector<float>(weights.q_conv.begin() + 32 * 4, weights.q_conv.end()));
  CHECK(shard.v_conv == std::vector<float>(weights.v_conv.begin() + 32 * 4, weights.v_conv.end()));
  CHECK(shard.dt_bias == std::vector<float>(weights.dt_bias.begin() + 32, weights.dt_bias.end()));
  CHECK(shard.A_log == std::vector<float>(weights.A_log.begin() + 2, weights.A_log.end()));
  CHECK(shard.g_b_bias ==
        std::vector<kda::bf16_bits>(weights.g_b_bias.begin() + 32, weights.g_b_bias.end()));

  // A conv weight [W, C] or dt_bias [D, H] (transposed, the same number of values) is refused.
  auto load_error = [&](const std::vector<Tensor>& tensors) {
    kda::engine::save_safetensors(path, tensors);
    return error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), -1, config); });
  };
  for (const char* conv : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"}) {
    CAPTURE(conv);
    CHECK(load_error(reshaped({{conv, {4, 64}}}))
              .find(std::string("'") + conv +
                    "' has shape [4, 64], expected [64, 1, 4] or [64, 4]") != std::string::npos);
    CHECK(load_error(reshaped({{conv, {64, 4, 1}}})).find("has shape [64, 4, 1]") !=
          std::string::npos);
  }
  CHECK(load_error(reshaped({{"dt_bias", {16, 4}}}))
            .find("'dt_bias' has shape [16, 4], expected [64] or [4, 16]") != std::string::npos);
  CHECK(load_error(reshaped({{"A_log", {1, 1, 1, 4}}}))
            .find("'A_log' has shape [1, 1, 1, 4], expected [1, 1, 4, 1] or [4]") !=
        std::string::npos);

  // load_gate_parameters (a core-only engine's reader) takes the same shapes of A_log and dt_bias,
  // and refuses the transposed dt_bias and a tensor that is not a float one.
  const std::string gate_path = dir.file("gate.safetensors");
  auto gate = [&](Shape a_shape, DType a_dtype, Shape dt_shape) {
    Tensor a_log = Tensor::zeros(kda::engine::a_log_tensor_name(1), a_dtype, std::move(a_shape));
    if (a_dtype == DType::kF32) {
      std::memcpy(a_log.data.data(), weights.A_log.data(), a_log.data.size());
    }
    Tensor dt =
        Tensor::zeros(kda::engine::dt_bias_tensor_name(1), DType::kF32, std::move(dt_shape));
    std::memcpy(dt.data.data(), weights.dt_bias.data(), dt.data.size());
    kda::engine::save_safetensors(gate_path, {a_log, dt});
    return Checkpoint::open(gate_path);
  };
  for (const Shape& dt_shape : {Shape{64}, Shape{4, 16}}) {
    for (const Shape& a_shape : {Shape{4}, Shape{1, 1, 4, 1}}) {
      CAPTURE(dt_shape.size());
      CAPTURE(a_shape.size());
      const kda::layer::GateParameters p =
          kda::engine::load_gate_parameters(gate(a_shape, DType::kF32, dt_shape), 1, 4, 16);
      CHECK(p.A_log == weights.A_log);
      CHECK(p.dt_bias == weights.dt_bias);
    }
  }
  CHECK(error_of([&] {
          kda::engine::load_gate_parameters(gate({4}, DType::kF32, {16, 4}), 1, 4, 16);
        }).find("'model.layers.1.self_attn.dt_bias' has shape [16, 4], expected [64] or [4, 16]") !=
        std::string::npos);
  CHECK(error_of([&] { kda::engine::load_gate_parameters(gate({4}, DType::kI32, {64}), 1, 4, 16); })
            .find(gate_path + ": tensor 'model.layers.1.self_attn.A_log' has dtype I32, expected a "
                              "float dtype") != std::string::npos);
}

TEST_CASE("the layer prefix's name wins over a bare one, and a hint needs a whole path segment") {
  const Config config = small_config();
  const Weights prefixed = with_bias_and_norm(kda::layer::random_weights(config, 5, 5));
  const Weights bare = kda::layer::random_weights(config, 6, 5);
  std::vector<Tensor> tensors =
      kda::engine::layer_weight_tensors(prefixed, kda::engine::layer_tensor_prefix(5));
  for (const Tensor& t : kda::engine::layer_weight_tensors(bare)) tensors.push_back(t);
  TempDir dir;
  const std::string path = dir.file("both.safetensors");
  kda::engine::save_safetensors(path, tensors);
  // Layer 5 finds its prefixed tensors first; layer 2 has none, and reads the bare ones.
  const Weights five = kda::engine::load_layer_weights(Checkpoint::open(path), 5, config);
  CHECK(five.q_proj == prefixed.q_proj);
  CHECK(five.o_proj == prefixed.o_proj);
  CHECK(five.A_log == prefixed.A_log);
  CHECK(five.g_b_bias == prefixed.g_b_bias);
  const Weights two = kda::engine::load_layer_weights(Checkpoint::open(path), 2, config);
  CHECK(two.q_proj == bare.q_proj);
  CHECK(two.A_log == bare.A_log);
  CHECK(two.g_b_bias.empty());

  // A missing tensor's message names where the checkpoint has the same weight under another
  // prefix, "layers.5.self_attn.q_proj.weight" after a '.'; "sublayers.5..." is another weight.
  for (const std::string& other : {std::string("backbone.layers.5.self_attn.q_proj.weight"),
                                   std::string("model.sublayers.5.self_attn.q_proj.weight")}) {
    CAPTURE(other);
    std::vector<Tensor> moved;
    for (const Tensor& t :
         kda::engine::layer_weight_tensors(prefixed, kda::engine::layer_tensor_prefix(5))) {
      moved.push_back(t);
      if (t.name == "model.layers.5.self_attn.q_proj.weight") moved.back().name = other;
    }
    kda::engine::save_safetensors(path, moved);
    const std::string message =
        error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), 5, config); });
    CHECK(message.find("no tensor 'model.layers.5.self_attn.q_proj.weight'") != std::string::npos);
    CHECK((message.find("the checkpoint has '" + other + "'") != std::string::npos) ==
          (other.rfind("backbone.", 0) == 0));
  }
}

TEST_CASE("an F16 matrix holding a NaN or an infinity is refused showing that value") {
  const Config config = small_config();
  const Weights weights = kda::layer::random_weights(config, 7, 0);
  TempDir dir;
  const std::string path = dir.file("f16.safetensors");
  struct NonFinite {
    std::uint16_t bits;  // F16
    std::string shown;
  };
  for (const NonFinite& value :
       {NonFinite{0x7e00, "nan"}, NonFinite{0xfc00, "-inf"}, NonFinite{0x7c00, "inf"}}) {
    CAPTURE(value.shown);
    std::vector<Tensor> tensors = kda::engine::layer_weight_tensors(weights);
    for (Tensor& t : tensors) {
      if (t.name != "q_proj.weight") continue;
      t = Tensor::zeros("q_proj.weight", DType::kF16, {64, 48});
      for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<std::uint16_t>()[i] = 0x3c00;  // 1
      t.data_as<std::uint16_t>()[3] = value.bits;
    }
    kda::engine::save_safetensors(path, tensors);
    const std::string message =
        error_of([&] { kda::engine::load_layer_weights(Checkpoint::open(path), -1, config); });
    CHECK(message == path + ": tensor 'q_proj.weight' holds " + value.shown +
                         " at element 3, not a finite bf16 value");
  }
}
