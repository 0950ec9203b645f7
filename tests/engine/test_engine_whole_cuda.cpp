// The Engine's whole layers on CUDA (FullLayerCuda under the engine): against the CPU engine of the
// same seed (<= 1e-2 relative L2 on out and on every state), prefill then decode steps with padding
// rows, the tp_size = 2 engines' sum, phase times, the weights in the arena's planned buffers, and
// a layer case on both backends. Label `gpu`: prints "KDA_SKIP: ..." without a device.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/case_file.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"

using kda::bf16_bits;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::ModelSpec;
using kda::test::DeviceBuffer;

namespace {

const char* const kSpec =
    "name: whole-cuda-test\n"
    "hidden_size: 256\n"
    "num_hidden_layers: 2\n"
    "linear_attn_config:\n"
    "  num_heads: 2\n"
    "  head_dim: 128\n"
    "  short_conv_kernel_size: 4\n"
    "  kda_layers: [1, 2]\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 160\n"
    "  max_sequences: 4\n";
constexpr std::int64_t E = 256;

EngineOptions on(kda::engine::BackendChoice backend) {
  EngineOptions o;
  o.backend = backend;
  o.seed = 5;
  o.cpu_threads = 4;
  return o;
}

std::vector<bf16_bits> random_hidden(std::int64_t tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<bf16_bits> x(static_cast<std::size_t>(tokens * E));
  for (bf16_bits& v : x) v = kda::float_to_bf16(dist(rng));
  return x;
}

template <typename T>
double relative_error(const std::vector<T>& a, const std::vector<T>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double x, y;
    if constexpr (std::is_same_v<T, bf16_bits>) {
      x = kda::bf16_to_float(a[i]);
      y = kda::bf16_to_float(b[i]);
    } else {
      x = a[i];
      y = b[i];
    }
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

void check_states_close(const Engine& gpu, const Engine& cpu, int layer, int slot) {
  for (int p = 0; p < 3; ++p) {
    std::vector<bf16_bits> a(gpu.conv_state_slot_bytes() / 2), b(a.size());
    gpu.read_slot_conv_state(layer, slot, p, a.data());
    cpu.read_slot_conv_state(layer, slot, p, b.data());
    CHECK(relative_error(a, b) <= 1e-2);
  }
  std::vector<float> a(gpu.state_slot_bytes() / 4), b(a.size());
  gpu.read_slot_state(layer, slot, a.data());
  cpu.read_slot_state(layer, slot, b.data());
  CHECK(relative_error(a, b) <= 1e-2);
}

}  // namespace

TEST_CASE("whole layers on CUDA: prefill and decode match the CPU engine, phases timed") {
  if (!kda::test::gpu_or_skip()) return;
  const ModelSpec spec = kda::engine::parse_model_spec(kSpec, "w.yaml");
  Engine gpu(spec, on(kda::engine::BackendChoice::kCuda));
  Engine cpu(spec, on(kda::engine::BackendChoice::kCpu));
  REQUIRE(gpu.backend() == kda::Backend::kCuda);
  // The weights are the arena's: one planned buffer per layer, all of weight_bytes().
  const kda::planner::PlanEntry* weights[2] = {gpu.plan().find("layer1.weights"),
                                               gpu.plan().find("layer2.weights")};
  REQUIRE(weights[0] != nullptr);
  REQUIRE(weights[1] != nullptr);
  CHECK(gpu.weight_bytes() == weights[0]->bytes + weights[1]->bytes);
  CHECK(gpu.plan().to_json() == Engine::plan_for(spec, kda::Backend::kCuda).to_json());
  for (Engine* e : {&gpu, &cpu}) {
    for (int i = 0; i < 4; ++i) e->acquire_slot();
  }
  const std::vector<std::int64_t> cu = {0, 70, 70, 71, 150};  // an empty and a 1-token sequence
  const std::vector<int> slots = {2, 0, 3, 1};
  const std::vector<bf16_bits> x = random_hidden(150, 1);
  DeviceBuffer hidden = DeviceBuffer::from(x), out(x.size() * 2);
  for (int l = 0; l < gpu.num_layers(); ++l) {
    CAPTURE(l);
    kda::engine::FullLayerTimes times;
    gpu.prefill_hidden(l, hidden.get(), out.get(), slots, cu, &times);
    gpu.synchronize();
    std::vector<bf16_bits> expected(x.size());
    cpu.prefill_hidden(l, x.data(), expected.data(), slots, cu);
    CHECK(relative_error(out.download<bf16_bits>(), expected) <= 1e-2);
    CHECK(times.projections > 0.0);
    CHECK(times.core > 0.0);
    CHECK(times.o_proj > 0.0);
    for (const int slot : slots) check_states_close(gpu, cpu, l, slot);
  }
  // Decode: 3 steps of 2 tokens on rows {1, pad, 2, 0}.
  const std::vector<int> rows = {1, -1, 2, 0};
  for (int step = 0; step < 3; ++step) {
    const std::vector<bf16_bits> y = random_hidden(8, 10 + static_cast<std::uint64_t>(step));
    DeviceBuffer step_in = DeviceBuffer::from(y), step_out(y.size() * 2);
    for (int l = 0; l < gpu.num_layers(); ++l) {
      gpu.decode_hidden(l, step_in.get(), step_out.get(), rows, 2);
      std::vector<bf16_bits> expected(y.size(), 0);
      cpu.decode_hidden(l, y.data(), expected.data(), rows, 2);
      std::vector<bf16_bits> got = step_out.download<bf16_bits>();
      std::fill(got.begin() + 2 * E, got.begin() + 4 * E, 0);  // the padding row: unspecified
      CHECK(relative_error(got, expected) <= 1e-2);
    }
  }
  gpu.check_device_status();
  for (int l = 0; l < gpu.num_layers(); ++l) {
    for (const int slot : {0, 1, 2, 3}) check_states_close(gpu, cpu, l, slot);
  }
}

TEST_CASE("whole layers on CUDA: the tp_size = 2 engines' outputs, summed, equal tp_size = 1") {
  if (!kda::test::gpu_or_skip()) return;
  const auto cuda = on(kda::engine::BackendChoice::kCuda);
  Engine full(kda::engine::parse_model_spec(kSpec, "w.yaml"), cuda);
  Engine r0(kda::engine::parse_model_spec(std::string(kSpec) + "  tp_size: 2\n", "w.yaml"), cuda);
  Engine r1(
      kda::engine::parse_model_spec(std::string(kSpec) + "  tp_size: 2\n  tp_rank: 1\n", "w.yaml"),
      cuda);
  const std::vector<bf16_bits> x = random_hidden(40, 2);
  DeviceBuffer hidden = DeviceBuffer::from(x), o_full(x.size() * 2), o0(x.size() * 2),
               o1(x.size() * 2);
  for (Engine* e : {&full, &r0, &r1}) e->acquire_slot();
  full.prefill_hidden(0, hidden.get(), o_full.get(), {0}, {0, 40});
  r0.prefill_hidden(0, hidden.get(), o0.get(), {0}, {0, 40});
  r1.prefill_hidden(0, hidden.get(), o1.get(), {0}, {0, 40});
  for (Engine* e : {&full, &r0, &r1}) e->synchronize();
  const auto a = o0.download<bf16_bits>(), b = o1.download<bf16_bits>();
  std::vector<bf16_bits> sum(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    sum[i] = kda::float_to_bf16(kda::bf16_to_float(a[i]) + kda::bf16_to_float(b[i]));
  }
  CHECK(relative_error(sum, o_full.download<bf16_bits>()) <= 1e-2);
}

TEST_CASE("whole layers on CUDA: a layer case runs on both backends alike") {
  if (!kda::test::gpu_or_skip()) return;
  kda::engine::FullLayerConfig config;
  config.hidden_size = E;
  config.num_heads = 2;
  config.head_dim = 128;
  kda::engine::LayerCase lc;
  lc.source = "in-memory case";
  lc.weights = kda::engine::random_full_layer_weights(config, 9, 0);
  lc.tokens = 33;
  lc.sequences = 2;
  lc.cu_seqlens = {0, 20, 33};
  lc.hidden = kda::engine::Tensor::zeros("hidden_states", kda::DType::kBF16, {33, E});
  const std::vector<bf16_bits> x = random_hidden(33, 3);
  std::memcpy(lc.hidden.data.data(), x.data(), lc.hidden.data.size());
  kda::Backend used = kda::Backend::kCpu;
  const auto gpu = kda::engine::run_layer_case(lc, kda::engine::BackendChoice::kCuda, &used);
  CHECK(used == kda::Backend::kCuda);
  const auto cpu = kda::engine::run_layer_case(lc, kda::engine::BackendChoice::kCpu, &used);
  REQUIRE(gpu.size() == cpu.size());
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    CAPTURE(gpu[i].name);
    REQUIRE(gpu[i].data.size() == cpu[i].data.size());
    if (gpu[i].dtype == kda::DType::kF32) {
      std::vector<float> a(gpu[i].data.size() / 4), b(a.size());
      std::memcpy(a.data(), gpu[i].data.data(), gpu[i].data.size());
      std::memcpy(b.data(), cpu[i].data.data(), cpu[i].data.size());
      CHECK(relative_error(a, b) <= 1e-2);
    } else {
      std::vector<bf16_bits> a(gpu[i].data.size() / 2), b(a.size());
      std::memcpy(a.data(), gpu[i].data.data(), gpu[i].data.size());
      std::memcpy(b.data(), cpu[i].data.data(), cpu[i].data.size());
      CHECK(relative_error(a, b) <= 1e-2);
    }
  }
}

TEST_CASE("whole layers on CUDA: every prefill schedule matches the CPU engine") {
  // EngineOptions::prefill_schedule reaches the operator: one 150-token sequence (10 chunks, which
  // kAuto keeps two-phase) run two-phase and pipelined, each against the CPU engine.
  if (!kda::test::gpu_or_skip()) return;
  const ModelSpec spec = kda::engine::parse_model_spec(kSpec, "w.yaml");
  Engine cpu(spec, on(kda::engine::BackendChoice::kCpu));
  cpu.acquire_slot();
  const std::vector<std::int64_t> cu = {0, 150};
  const std::vector<bf16_bits> x = random_hidden(150, 9);
  std::vector<bf16_bits> expected(x.size());
  cpu.prefill_hidden(0, x.data(), expected.data(), {0}, cu);
  for (kda::PrefillSchedule schedule :
       {kda::PrefillSchedule::kTwoPhase, kda::PrefillSchedule::kPipelined}) {
    CAPTURE(kda::to_string(schedule));
    EngineOptions o = on(kda::engine::BackendChoice::kCuda);
    o.prefill_schedule = schedule;
    Engine gpu(spec, o);
    gpu.acquire_slot();
    DeviceBuffer hidden = DeviceBuffer::from(x), out(x.size() * 2);
    out.fill(0xFF);
    gpu.prefill_hidden(0, hidden.get(), out.get(), {0}, cu);
    gpu.synchronize();
    CHECK(relative_error(out.download<bf16_bits>(), expected) <= 1e-2);
    check_states_close(gpu, cpu, 0, 0);
  }
}
