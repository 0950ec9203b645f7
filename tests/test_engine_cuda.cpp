// GPU tests of the engine (label `gpu`): an engine on the CUDA backend against the same engine on
// the CPU backend (same seeded parameters and synthetic inputs): prefill of a batch on state slots,
// then decode steps, per layer; and run_synthetic end to end. Prints "KDA_SKIP: ..." without a
// device.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda_reference.hpp"
#include "synthetic_run.hpp"

using kda::engine::BackendChoice;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::examples::SyntheticInputs;

namespace {

const char* const kSpec =
    "name: engine-cuda-test\n"
    "hidden_size: 512\n"
    "num_hidden_layers: 3\n"
    "linear_attn_config:\n"
    "  num_heads: 4\n"
    "  head_dim: 128\n"
    "  kda_layers: [1, 3]\n"
    "  full_attn_layers: [2]\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 512\n"
    "  max_sequences: 4\n"
    "  state_dtype: fp32\n"
    "  workspace_plan: reuse\n";

std::vector<std::uint16_t> output_of(const Engine& e, const SyntheticInputs& s, std::size_t elems) {
  std::vector<std::uint16_t> host(elems);
  if (e.backend() == kda::Backend::kCuda) {
    REQUIRE(kda::memcpy_to_host(host.data(), s.output(), elems * 2, e.stream()).ok());
  } else {
    std::memcpy(host.data(), s.output(), elems * 2);
  }
  return host;
}

std::vector<double> state_of(const Engine& e, int layer, int slot) {
  std::vector<float> s(e.state_slot_bytes() / 4);
  e.read_slot_state(layer, slot, s.data());
  return kda::test::to_doubles(s);
}

}  // namespace

TEST_CASE("engine on CUDA equals the engine on the CPU: prefill on slots then decode steps") {
  if (!kda::test::gpu_or_skip()) return;
  const kda::engine::ModelSpec spec = kda::engine::parse_model_spec(kSpec, "engine-cuda.yaml");
  EngineOptions go, co;
  go.backend = BackendChoice::kCuda;
  co.backend = BackendChoice::kCpu;
  go.seed = co.seed = 17;
  Engine gpu(spec, go), cpu(spec, co);
  REQUIRE(gpu.backend() == kda::Backend::kCuda);
  SyntheticInputs gin(gpu, 300), cin(cpu, 300);
  gin.generate(5);
  cin.generate(5);
  const std::vector<std::int64_t> cu = {0, 100, 101, 300};
  std::vector<int> gs, cs;
  for (int i = 0; i < 3; ++i) {
    gs.push_back(gpu.acquire_slot());
    cs.push_back(cpu.acquire_slot());
  }
  const std::int64_t H = 4, D = 128;
  for (int l = 0; l < gpu.num_layers(); ++l) {
    gpu.prefill(l, gin.inputs(0), gin.output(), gs, cu);
    cpu.prefill(l, cin.inputs(0), cin.output(), cs, cu);
    gpu.synchronize();
    const std::size_t n = static_cast<std::size_t>(300 * H * D);
    const double e_out = kda::test::rel_error_bf16(output_of(gpu, gin, n),
                                                   kda::test::to_doubles(output_of(cpu, cin, n)));
    std::printf("engine layer %d prefill: out %.2e\n", l, e_out);
    CHECK(e_out <= 5e-3);
    for (int s = 0; s < 3; ++s) {
      const double e_state = kda::test::rel_error(state_of(gpu, l, gs[s]), state_of(cpu, l, cs[s]));
      CHECK(e_state <= 5e-3);
    }
  }
  // Two decode steps of one token for each of the three sequences, plus a padding row.
  for (int step = 0; step < 2; ++step) {
    std::vector<int> gslots = {gs[0], -1, gs[1], gs[2]}, cslots = {cs[0], -1, cs[1], cs[2]};
    for (int l = 0; l < gpu.num_layers(); ++l) {
      gpu.decode(l, gin.inputs(4 * step), gin.output(), gslots, 1);
      cpu.decode(l, cin.inputs(4 * step), cin.output(), cslots, 1);
      gpu.synchronize();
      std::vector<std::uint16_t> g = output_of(gpu, gin, static_cast<std::size_t>(4 * H * D));
      std::vector<std::uint16_t> c = output_of(cpu, cin, static_cast<std::size_t>(4 * H * D));
      // Row 1 is padding: compare rows 0, 2, 3.
      std::vector<double> gr, cr;
      for (int r : {0, 2, 3}) {
        for (std::int64_t i = r * H * D; i < (r + 1) * H * D; ++i) {
          gr.push_back(kda::bf16_to_float(g[static_cast<std::size_t>(i)]));
          cr.push_back(kda::bf16_to_float(c[static_cast<std::size_t>(i)]));
        }
      }
      const double e_out = kda::test::rel_error(gr, cr);
      CHECK(e_out <= 5e-3);
      for (int s = 0; s < 3; ++s) {
        CHECK(kda::test::rel_error(state_of(gpu, l, gs[s]), state_of(cpu, l, cs[s])) <= 5e-3);
      }
    }
  }
}

TEST_CASE("engine on CUDA: run_synthetic with decode steps completes and reports timings") {
  if (!kda::test::gpu_or_skip()) return;
  const kda::engine::ModelSpec spec = kda::engine::parse_model_spec(kSpec, "engine-cuda.yaml");
  EngineOptions o;
  o.backend = BackendChoice::kAuto;
  Engine e(spec, o);
  CHECK(e.backend() == kda::Backend::kCuda);
  SyntheticInputs inputs(e, 512);
  kda::examples::RunOptions r;
  r.tokens = 512;
  r.sequences = 4;
  r.decode_steps = 3;
  // The run writes rows 0..3 of the layer output (its prefill, then each decode step): the
  // hidden-state output for whole layers (this spec), the core's output otherwise. Poisoned first
  // (bf16 0xffff is a NaN), so that the check below sees values the run wrote.
  const bool whole = e.layer_mode() == kda::engine::LayerMode::kWhole;
  void* written = whole ? inputs.hidden_output() : inputs.output();
  const std::size_t n =
      static_cast<std::size_t>(4 * (whole ? spec.hidden_size : spec.local_heads() * spec.head_dim));
  REQUIRE(written != nullptr);
  REQUIRE(kda::memset_device(written, 0xff, n * 2, e.stream()).ok());
  const kda::examples::RunReport rep = kda::examples::run_synthetic(e, inputs, r);
  CHECK(rep.layer_seconds.size() == 2);
  CHECK(rep.decode_step_seconds.size() == 3);
  CHECK(rep.prefill_seconds > 0);
  std::vector<std::uint16_t> host(n);
  REQUIRE(kda::memcpy_to_host(host.data(), written, n * 2, e.stream()).ok());
  e.synchronize();
  for (std::uint16_t x : host) {
    if (!std::isfinite(kda::bf16_to_float(x))) {
      FAIL("a non-finite (or unwritten) output element after run_synthetic");
      break;
    }
  }
}

TEST_CASE(
    "engine on CUDA: a caller buffer too short for a later run of slots is refused before any run "
    "writes") {
  if (!kda::test::gpu_or_skip()) return;
  const kda::engine::ModelSpec spec = kda::engine::parse_model_spec(kSpec, "engine-cuda.yaml");
  EngineOptions o;
  o.backend = BackendChoice::kCuda;
  Engine e(spec, o);
  SyntheticInputs synthetic(e, 200);
  synthetic.generate(9);
  const int s0 = e.acquire_slot(), s1 = e.acquire_slot(), s2 = e.acquire_slot();
  (void)s1;
  // Slots {s0, s2}: two runs of consecutive slots, so two operator forwards; out holds only the
  // first sequence and half of the second (no guard bytes: the allocation ends where the buffer
  // does).
  const std::int64_t H = 4, D = 128;
  const std::vector<std::int64_t> cu = {0, 40, 80};
  const std::vector<int> slots = {s0, s2};
  kda::test::DeviceBuffer out(static_cast<std::size_t>(60 * H * D) * 2, 0);
  out.fill(0xFF);
  CHECK_THROWS_WITH_AS(e.prefill(0, synthetic.inputs(0), out.get(), slots, cu),
                       doctest::Contains("out needs"), kda::Error);
  e.synchronize();
  for (std::uint16_t x : out.download<std::uint16_t>()) {
    if (x != 0xFFFF) {
      FAIL("the first run wrote its output before the second run's buffer was refused");
      break;
    }
  }
  for (double x : state_of(e, 0, s0)) {
    if (x != 0.0) {
      FAIL("the first run updated its state before the second run's buffer was refused");
      break;
    }
  }
  // A host pointer for beta, in decode.
  std::vector<std::uint16_t> host_beta(static_cast<std::size_t>(2 * H), 0);
  kda::engine::LayerInputs in = synthetic.inputs(0);
  in.beta = host_beta.data();
  CHECK_THROWS_WITH_AS(e.decode(0, in, synthetic.output(), slots, 1),
                       doctest::Contains("beta points to unregistered host memory"), kda::Error);
  // The same calls with good buffers work, and the engine's status word stays clear.
  e.prefill(0, synthetic.inputs(0), synthetic.output(), slots, cu);
  e.decode(0, synthetic.inputs(0), synthetic.output(), slots, 1);
  CHECK_NOTHROW(e.check_device_status());
}
