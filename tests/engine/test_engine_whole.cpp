// The Engine running whole KDA layers (runtime.layers: whole, the default) on the CPU: against
// FullLayerCpu called directly on the same weights, state round trips through the slots (prefill
// then decode = one longer prefill), fragmented slots and padding rows, conv states zeroed on
// acquire / reset, tensor-parallel engines summing to the whole layer, weights from a checkpoint by
// their Hugging Face names, the memory plan (reuse much smaller than sum; on the CPU and on CUDA
// each layer's weights a persistent buffer of it, planned without a device) and the errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "full_layer_test_util.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/kda_full_layer.hpp"
#include "kda/engine/kda_full_layer_cuda.hpp"
#include "kda/engine/safetensors.hpp"
#include "temp_dir.hpp"

using kda::bf16_bits;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::FullLayerConfig;
using kda::engine::FullLayerCpu;
using kda::engine::FullLayerCuda;
using kda::engine::FullLayerState;
using kda::engine::FullLayerWeights;
using kda::engine::ModelSpec;

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
         "  max_tokens: 64\n"
         "  max_sequences: 4\n"
         "  backend: cpu\n";
}
constexpr std::int64_t E = 48, H = 4, D = 16, W = 4;
const std::string kSpec = two_layer_spec(E, H, D);
// The same two layers at head_dim 128 (what the CUDA layer runs): for CUDA plans.
const std::string kCudaSpec = two_layer_spec(64, 2, 128);
constexpr std::uint64_t kSeed = 7;
constexpr int kThreads = 2;

ModelSpec spec_from(const std::string& text) {
  return kda::engine::parse_model_spec(text, "w.yaml");
}

ModelSpec spec_with(const std::string& runtime_lines) { return spec_from(kSpec + runtime_lines); }

EngineOptions options() {
  EngineOptions o;
  o.seed = kSeed;
  o.cpu_threads = kThreads;
  return o;
}

FullLayerConfig config_of(const ModelSpec& spec) {
  FullLayerConfig c;
  c.hidden_size = spec.hidden_size;
  c.num_heads = spec.num_heads;
  c.head_dim = spec.head_dim;
  c.conv_width = spec.short_conv_kernel_size;
  c.gate = spec.gate;
  c.lower_bound = spec.gate_lower_bound;
  c.norm_eps = spec.rms_norm_eps;
  c.tp_size = spec.runtime.tp_size;
  c.tp_rank = spec.runtime.tp_rank;
  return c;
}

std::vector<bf16_bits> random_hidden(std::int64_t tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<bf16_bits> x(static_cast<std::size_t>(tokens * E));
  for (bf16_bits& v : x) v = kda::float_to_bf16(dist(rng));
  return x;
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

double relative_error(const std::vector<bf16_bits>& a, const std::vector<bf16_bits>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = kda::bf16_to_float(a[i]), y = kda::bf16_to_float(b[i]);
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// One slot's whole state of one layer, read from the engine.
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

// FullLayerCpu with host pools of `slots` rows: the direct call the engine must match.
struct Direct {
  FullLayerCpu layer;
  std::int64_t slots;
  std::vector<bf16_bits> conv[3];
  std::vector<float> recurrent;
  std::vector<std::uint8_t> workspace;

  Direct(const FullLayerWeights& weights, std::int64_t num_slots)
      : layer(weights), slots(num_slots) {
    const FullLayerConfig& c = weights.config;
    for (auto& pool : conv) {
      pool.assign(static_cast<std::size_t>(num_slots * c.local_channels() * (c.conv_width - 1)), 0);
    }
    recurrent.assign(
        static_cast<std::size_t>(num_slots * c.local_heads() * c.head_dim * c.head_dim), 0.0f);
    workspace.resize(layer.workspace_bytes(64, num_slots, num_slots));
  }
  void forward(const std::vector<std::int64_t>& cu, const std::vector<std::int32_t>& slot_list,
               const std::vector<bf16_bits>& x, std::vector<bf16_bits>* out) {
    FullLayerState state{slots,          conv[0].data(),   conv[1].data(),
                         conv[2].data(), recurrent.data(), kda::DType::kF32};
    kda::engine::FullLayerBatch batch{cu.back(), static_cast<std::int64_t>(cu.size()) - 1,
                                      cu.data(), slot_list.data()};
    kda::CpuOptions cpu;
    cpu.num_threads = kThreads;
    layer.forward(batch, x.data(), out->data(), state,
                  kda::Workspace{workspace.data(), workspace.size()}, cpu);
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

void check_same_state(const SlotState& a, const SlotState& b) {
  for (int p = 0; p < 3; ++p) CHECK(a.conv[p] == b.conv[p]);
  CHECK(a.recurrent == b.recurrent);
}

}  // namespace

TEST_CASE("whole layers: engine prefill_hidden equals FullLayerCpu called directly") {
  const ModelSpec spec = spec_from(kSpec);
  CHECK(spec.runtime.layer_mode == kda::engine::LayerMode::kWhole);  // the default
  CHECK(spec.rms_norm_eps == doctest::Approx(1e-6));
  Engine engine(spec, options());
  REQUIRE(engine.layer_mode() == kda::engine::LayerMode::kWhole);
  CHECK(engine.weights_origin() == "random (seed 7)");
  CHECK(engine.conv_state_slot_bytes() == static_cast<std::uint64_t>(H * D * (W - 1) * 2));

  const int s0 = engine.acquire_slot(), s1 = engine.acquire_slot(), s2 = engine.acquire_slot();
  const std::vector<std::int64_t> cu = {0, 10, 10, 25};  // an empty sequence in the middle
  const std::vector<int> slots = {s2, s0, s1};
  const std::vector<bf16_bits> x = random_hidden(25, 1);
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    const int index = spec.kda_layer_indices[static_cast<std::size_t>(l)];
    Direct direct(kda::engine::random_full_layer_weights(config_of(spec), kSeed, index), 4);
    std::vector<bf16_bits> expected(x.size()), out(x.size(), 0x7fc0);
    direct.forward(cu, {s2, s0, s1}, x, &expected);
    kda::engine::FullLayerTimes times;
    engine.prefill_hidden(l, x.data(), out.data(), slots, cu, &times);
    CHECK(out == expected);
    CHECK(times.projections > 0.0);
    CHECK(times.core > 0.0);
    CHECK(times.o_proj > 0.0);
    for (const int slot : slots) check_same_state(read_state(engine, l, slot), direct.row(slot));
    CHECK_FALSE(all_zero(read_state(engine, l, s2)));
  }
}

TEST_CASE("whole layers: prefill then decode steps equal one longer prefill, conv and recurrent") {
  Engine engine(spec_from(kSpec), options());
  const int chunked = engine.acquire_slot(), whole = engine.acquire_slot();
  const std::vector<bf16_bits> x = random_hidden(17, 2);
  std::vector<bf16_bits> expected(x.size()), out(x.size());
  for (int l = 0; l < engine.num_layers(); ++l) {
    CAPTURE(l);
    engine.prefill_hidden(l, x.data(), expected.data(), {whole}, {0, 17});
    // 12 tokens, three one-token steps, one two-token step.
    engine.prefill_hidden(l, x.data(), out.data(), {chunked}, {0, 12});
    for (std::int64_t t = 12; t < 15; ++t) {
      engine.decode_hidden(l, x.data() + t * E, out.data() + t * E, {chunked}, 1);
    }
    engine.decode_hidden(l, x.data() + 15 * E, out.data() + 15 * E, {chunked}, 2);
    CHECK(relative_error(out, expected) <= 1e-3);
    const SlotState a = read_state(engine, l, chunked), b = read_state(engine, l, whole);
    for (int p = 0; p < 3; ++p) CHECK(a.conv[p] == b.conv[p]);
    CHECK(relative_error(a.recurrent, b.recurrent) <= 1e-5);
  }
}

TEST_CASE("whole layers: fragmented slots and padding rows equal the same sequences alone") {
  Engine engine(spec_from(kSpec), options());
  for (int i = 0; i < 4; ++i) engine.acquire_slot();
  const std::vector<bf16_bits> x = random_hidden(14, 3);
  // One batch on slots 3 and 1 against each sequence alone on slots 0 and 2.
  std::vector<bf16_bits> batch(x.size()), alone(x.size());
  engine.prefill_hidden(0, x.data(), batch.data(), {3, 1}, {0, 9, 14});
  engine.prefill_hidden(0, x.data(), alone.data(), {0}, {0, 9});
  engine.prefill_hidden(0, x.data() + 9 * E, alone.data() + 9 * E, {2}, {0, 5});
  CHECK(batch == alone);
  check_same_state(read_state(engine, 0, 3), read_state(engine, 0, 0));
  check_same_state(read_state(engine, 0, 1), read_state(engine, 0, 2));

  // Decode: rows {3, pad, 1} against rows {0, 2}; the padding row's state is no slot's.
  const std::vector<bf16_bits> step = random_hidden(3, 4);
  std::vector<bf16_bits> padded(step.size()), packed(2 * E);
  std::vector<bf16_bits> packed_in(step.begin(), step.begin() + E);
  packed_in.insert(packed_in.end(), step.begin() + 2 * E, step.end());
  engine.decode_hidden(0, step.data(), padded.data(), {3, -1, 1}, 1);
  engine.decode_hidden(0, packed_in.data(), packed.data(), {0, 2}, 1);
  CHECK(std::equal(packed.begin(), packed.begin() + E, padded.begin()));
  CHECK(std::equal(packed.begin() + E, packed.end(), padded.begin() + 2 * E));
  check_same_state(read_state(engine, 0, 3), read_state(engine, 0, 0));
  check_same_state(read_state(engine, 0, 1), read_state(engine, 0, 2));
}

TEST_CASE("whole layers: a slot's conv and recurrent states are zeroed on acquire and reset") {
  Engine engine(spec_from(kSpec), options());
  int slot = engine.acquire_slot();
  const std::vector<bf16_bits> x = random_hidden(6, 5);
  std::vector<bf16_bits> out(x.size());
  for (int l = 0; l < engine.num_layers(); ++l) {
    engine.prefill_hidden(l, x.data(), out.data(), {slot}, {0, 6});
  }
  CHECK_FALSE(all_zero(read_state(engine, 1, slot)));
  engine.reset_slot(slot);
  for (int l = 0; l < engine.num_layers(); ++l) CHECK(all_zero(read_state(engine, l, slot)));
  engine.prefill_hidden(0, x.data(), out.data(), {slot}, {0, 6});
  engine.release_slot(slot);
  slot = engine.acquire_slot();  // the same slot again
  CHECK(all_zero(read_state(engine, 0, slot)));
  // Written conv states are what the next call starts from.
  SlotState s = read_state(engine, 0, slot);
  s.conv[1][5] = kda::float_to_bf16(1.5f);
  engine.write_slot_conv_state(0, slot, 1, s.conv[1].data());
  CHECK(read_state(engine, 0, slot).conv[1][5] == kda::float_to_bf16(1.5f));
}

TEST_CASE("whole layers: the tp_size = 2 engines' outputs, summed, equal the tp_size = 1 engine") {
  Engine full(spec_from(kSpec), options());
  Engine rank0(spec_with("  tp_size: 2\n  tp_rank: 0\n"), options());
  Engine rank1(spec_with("  tp_size: 2\n  tp_rank: 1\n"), options());
  CHECK(rank0.spec().local_heads() == 2);
  CHECK(rank1.state_slot_bytes() * 2 == full.state_slot_bytes());
  CHECK(rank1.conv_state_slot_bytes() * 2 == full.conv_state_slot_bytes());
  const std::vector<bf16_bits> x = random_hidden(20, 6);
  std::vector<bf16_bits> expected(x.size()), part0(x.size()), part1(x.size()), sum(x.size());
  auto check_sum = [&] {
    for (std::size_t i = 0; i < sum.size(); ++i) {
      sum[i] = kda::float_to_bf16(kda::bf16_to_float(part0[i]) + kda::bf16_to_float(part1[i]));
    }
    CHECK(relative_error(sum, expected) <= 5e-3);
  };
  Engine* engines[3] = {&full, &rank0, &rank1};
  for (Engine* e : engines) e->acquire_slot();
  for (int l = 0; l < full.num_layers(); ++l) {
    CAPTURE(l);
    full.prefill_hidden(l, x.data(), expected.data(), {0}, {0, 16});
    rank0.prefill_hidden(l, x.data(), part0.data(), {0}, {0, 16});
    rank1.prefill_hidden(l, x.data(), part1.data(), {0}, {0, 16});
    check_sum();
    full.decode_hidden(l, x.data() + 16 * E, expected.data(), {0}, 4);
    rank0.decode_hidden(l, x.data() + 16 * E, part0.data(), {0}, 4);
    rank1.decode_hidden(l, x.data() + 16 * E, part1.data(), {0}, 4);
    check_sum();
  }
}

TEST_CASE("whole layers: weights from the YAML's checkpoint by their Hugging Face names") {
  kda::test::TempDir dir;
  const ModelSpec plain = spec_from(kSpec);
  std::vector<kda::engine::Tensor> tensors;
  std::vector<FullLayerWeights> weights;
  for (const int index : plain.kda_layer_indices) {
    weights.push_back(kda::engine::random_full_layer_weights(config_of(plain), 99, index));
    for (auto& t : kda::engine::full_layer_weight_tensors(
             weights.back(), kda::engine::full_layer_tensor_prefix(index))) {
      tensors.push_back(std::move(t));
    }
  }
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  std::ofstream(dir.file("m.yaml")) << kSpec << "weights: model.safetensors\n";
  Engine engine(kda::engine::load_model_spec(dir.file("m.yaml")), options());
  CHECK(engine.weights_origin().find("model.safetensors") != std::string::npos);
  const int slot = engine.acquire_slot();
  const std::vector<bf16_bits> x = random_hidden(9, 8);
  for (int l = 0; l < engine.num_layers(); ++l) {
    Direct direct(weights[static_cast<std::size_t>(l)], 4);
    std::vector<bf16_bits> expected(x.size()), out(x.size());
    direct.forward({0, 9}, {slot}, x, &expected);
    engine.prefill_hidden(l, x.data(), out.data(), {slot}, {0, 9});
    CHECK(out == expected);
    // The core reads the same A_log / dt_bias.
    CHECK(engine.layer(l).parameters().A_log == weights[static_cast<std::size_t>(l)].A_log);
  }
  // A folder holding model.safetensors is a checkpoint too.
  std::ofstream(dir.file("d.yaml")) << kSpec << "weights: .\n";
  CHECK_NOTHROW(Engine(kda::engine::load_model_spec(dir.file("d.yaml")), options()));

  // A tensor missing from the checkpoint is named, with the model file.
  tensors.erase(std::find_if(tensors.begin(), tensors.end(), [](const kda::engine::Tensor& t) {
    return t.name == "model.layers.2.self_attn.o_proj.weight";
  }));
  kda::engine::save_safetensors(dir.file("model.safetensors"), tensors);
  try {
    Engine broken(kda::engine::load_model_spec(dir.file("m.yaml")), options());
    FAIL("a checkpoint without o_proj was accepted");
  } catch (const kda::Error& e) {
    const std::string message = e.what();
    CHECK(message.find("m.yaml") != std::string::npos);
    CHECK(message.find("model.layers.2.self_attn.o_proj.weight") != std::string::npos);
  }
}

TEST_CASE("whole layers: the plan holds conv states, and reuse is much smaller than sum") {
  const ModelSpec spec = spec_from(kSpec);
  const Engine engine(spec, options());
  CHECK(Engine::plan_for(spec, kda::Backend::kCpu).to_json() == engine.plan().to_json());
  CHECK(engine.plan().find("layer3.conv_v") != nullptr);
  CHECK(engine.plan().find("layer3.conv_v")->bytes == 4u * H * D * (W - 1) * 2);

  ModelSpec kimi = kda::engine::load_model_spec(std::string(KDA_SOURCE_DIR) +
                                                "/examples/models/kimi-linear-48b-a3b.yaml");
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    CAPTURE(kda::to_string(backend));
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

TEST_CASE("whole layers: each layer's weights are a persistent buffer of the plan, CPU and CUDA") {
  // Planned without a device, as kda-run --plan-only does. head_dim 128: the CUDA layer's.
  for (const kda::Backend backend : {kda::Backend::kCpu, kda::Backend::kCuda}) {
    const bool cuda = backend == kda::Backend::kCuda;
    for (const char* runtime : {"  workspace_plan: sum\n", "  workspace_plan: reuse\n",
                                "  workspace_plan: reuse\n  tp_size: 2\n  tp_rank: 1\n"}) {
      CAPTURE(kda::to_string(backend));
      CAPTURE(runtime);
      const ModelSpec spec = spec_from(kCudaSpec + std::string(runtime));
      const kda::planner::MemoryPlan plan = Engine::plan_for(spec, backend);
      const std::uint64_t image = cuda ? FullLayerCuda::weight_image_bytes(config_of(spec))
                                       : FullLayerCpu::weight_image_bytes(config_of(spec));
      const std::uint64_t alignment =
          cuda ? FullLayerCuda::kWeightImageAlignment : FullLayerCpu::kWeightImageAlignment;
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
  FullLayerConfig shard = config_of(spec_from(kCudaSpec));
  const std::size_t whole_image = FullLayerCuda::weight_image_bytes(shard);
  shard.tp_size = 2;
  CHECK(FullLayerCuda::weight_image_bytes(shard) < whole_image);

  // A CPU engine holds its layers' fp32 weights in those buffers of its arena.
  const ModelSpec cpu_spec = spec_from(kSpec);
  const Engine cpu(cpu_spec, options());
  const kda::planner::PlanEntry* weights = cpu.plan().find("layer1.weights");
  REQUIRE(weights != nullptr);
  CHECK(weights->bytes == FullLayerCpu::weight_image_bytes(config_of(cpu_spec)));
  CHECK(cpu.weight_bytes() == planned_weight_bytes(cpu.plan()));
  CHECK(cpu.weight_bytes() == 2 * weights->bytes);
}

TEST_CASE("FullLayerCuda refuses a weight image region that is null, misaligned or too small") {
  // The region is checked before the device is touched: this runs without one (host memory stands
  // in for the device memory it would be).
  const FullLayerConfig config = config_of(spec_from(kCudaSpec));
  const FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 1, 0);
  const std::size_t needed = FullLayerCuda::weight_image_bytes(config);
  CHECK(needed % FullLayerCuda::kWeightImageAlignment == 0);
  const std::size_t alignment = FullLayerCuda::kWeightImageAlignment;
  std::vector<unsigned char> memory(needed + alignment);
  unsigned char* aligned = kda::test::first_aligned(memory, alignment);
  auto refusal = [&](void* region, std::size_t bytes) {
    return kda::test::weight_region_refusal<FullLayerCuda>(weights, region, bytes);
  };
  CHECK(refusal(aligned, needed - 1) ==
        "KDA layer (CUDA): the weight image region is too small: " + std::to_string(needed - 1) +
            " bytes, the layer's weights need " + std::to_string(needed) + " (weight_image_bytes)");
  CHECK(refusal(aligned + 16, needed).find("is not 256-byte aligned") != std::string::npos);
  CHECK(refusal(nullptr, needed).find("the weight image region is null") != std::string::npos);
  if (kda::cuda_device_count() == 0) {  // a good region: then the device is what is missing
    try {
      FullLayerCuda layer(weights, aligned, needed);
      FAIL("FullLayerCuda constructed without a device");
    } catch (const kda::Error& e) {
      CHECK(e.code() == kda::StatusCode::kBackendUnavailable);
    }
  }
}

TEST_CASE("whole layers: bad calls and bad settings are refused with a clear message") {
  Engine engine(spec_from(kSpec), options());
  const int slot = engine.acquire_slot();
  std::vector<bf16_bits> x = random_hidden(4, 9), out(x.size(), 0x1234);
  CHECK_THROWS_WITH_AS(engine.prefill_hidden(0, x.data(), out.data(), {3}, {0, 4}),
                       doctest::Contains("prefill_hidden: sequence 0 uses slot 3"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.decode_hidden(0, x.data(), out.data(), {slot}, 17),
                       doctest::Contains("decode_hidden: tokens 17"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill_hidden(0, nullptr, out.data(), {slot}, {0, 4}),
                       doctest::Contains("hidden is null"), kda::Error);
  CHECK_THROWS_WITH_AS(engine.prefill_hidden(2, x.data(), out.data(), {slot}, {0, 4}),
                       doctest::Contains("KDA layer 2 is out of range"), kda::Error);
  CHECK(std::all_of(out.begin(), out.end(), [](bf16_bits b) { return b == 0x1234; }));
  CHECK(all_zero(read_state(engine, 0, slot)));
  // The core alone still runs on a whole-layer engine (its recurrent states).
  std::vector<std::uint16_t> qkvg(4 * H * D, 0x3f80), beta(4 * H, 0), core_out(4 * H * D);
  engine.prefill(0, {qkvg.data(), qkvg.data(), qkvg.data(), qkvg.data(), beta.data()},
                 core_out.data(), {slot}, {0, 4});
  CHECK_FALSE(all_zero(read_state(engine, 0, slot)));

  // A core-only engine has no hidden-state calls; tensor parallelism needs whole layers.
  Engine core(spec_with("  layers: core\n"), options());
  CHECK(core.layer_mode() == kda::engine::LayerMode::kCoreOnly);
  CHECK(core.plan().find("layer1.conv_q") == nullptr);
  core.acquire_slot();
  CHECK_THROWS_WITH_AS(core.prefill_hidden(0, x.data(), out.data(), {0}, {0, 4}),
                       doctest::Contains("runtime.layers: core"), kda::Error);
  EngineOptions core_tp = options();
  core_tp.layer_mode = kda::engine::LayerMode::kCoreOnly;
  CHECK_THROWS_WITH_AS(Engine(spec_with("  tp_size: 2\n"), core_tp),
                       doctest::Contains("runtime.tp_size 2 needs whole layers"), kda::Error);
  // The schedule in effect: the YAML's, unless EngineOptions sets one.
  CHECK(Engine(spec_from(kSpec), options()).spec().runtime.prefill_schedule ==
        kda::PrefillSchedule::kAuto);
  CHECK(Engine(spec_with("  prefill_schedule: two-phase\n"), options())
            .spec()
            .runtime.prefill_schedule == kda::PrefillSchedule::kTwoPhase);
  EngineOptions pipelined = options();
  pipelined.prefill_schedule = kda::PrefillSchedule::kPipelined;
  CHECK(Engine(spec_with("  prefill_schedule: two-phase\n"), pipelined)
            .spec()
            .runtime.prefill_schedule == kda::PrefillSchedule::kPipelined);
  EngineOptions bad_schedule = options();
  bad_schedule.prefill_schedule = static_cast<kda::PrefillSchedule>(9);
  CHECK_THROWS_WITH_AS(Engine(spec_from(kSpec), bad_schedule),
                       doctest::Contains("EngineOptions::prefill_schedule is 9"), kda::Error);
}
