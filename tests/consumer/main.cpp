// A user's program built against the installed kda package (find_package(kda CONFIG)): checks that
// the public headers compile outside the source tree and that the exported libraries link and run.
// Exits non-zero, naming the failed check, when something is wrong.
#include <kda/kda_engine.h>
#include <kda/bf16.hpp>
#include <kda/engine/engine.hpp>
#include <kda/engine/error.hpp>
#include <kda/engine/model_spec.hpp>
#include <kda/kda.hpp>
#include <kda/planner/memory_plan.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool condition, const std::string& what) {
  if (!condition) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

bool near(float actual, float expected, float tolerance) {
  return std::fabs(actual - expected) <= tolerance * std::fmax(1.0f, std::fabs(expected));
}

// One token, one head, K = V = 2, no initial state. With S0 = 0 the decay does nothing, so
// S = beta * k_hat * v^T and out = scale * (k_hat . q_hat) * beta * v. With q = k = (1, 0) and
// b_raw = 0 (beta = 1/2): out = 2^-0.5 * 0.5 * v, and final_state (V-first, i.e. S^T) is
// [[v0 / 2, 0], [v1 / 2, 0]].
void check_tiny_forward() {
  kda::Problem problem;
  problem.batch = 1;
  problem.seq_len = 1;
  problem.num_heads = 1;
  problem.head_dim_k = 2;
  problem.head_dim_v = 2;
  problem.gate = kda::GateMode::kSoftplus;
  problem.final_state_dtype = kda::DType::kF32;

  kda::Status status = kda::can_implement(problem, kda::Backend::kCpu);
  check(status.ok(), "can_implement(cpu): " + status.to_string());
  std::size_t workspace_bytes = 0;
  status = kda::workspace_size(problem, kda::Backend::kCpu, &workspace_bytes);
  check(status.ok(), "workspace_size: " + status.to_string());

  const float v0 = 2.0f, v1 = -4.0f;
  std::vector<kda::bf16_bits> q = {kda::float_to_bf16(1.0f), kda::float_to_bf16(0.0f)};
  std::vector<kda::bf16_bits> k = q;
  std::vector<kda::bf16_bits> g = {kda::float_to_bf16(0.3f), kda::float_to_bf16(-0.7f)};
  std::vector<kda::bf16_bits> v = {kda::float_to_bf16(v0), kda::float_to_bf16(v1)};
  std::vector<kda::bf16_bits> beta = {kda::float_to_bf16(0.0f)};
  std::vector<float> A_log = {0.0f};
  std::vector<float> dt_bias = {0.0f, 0.0f};
  std::vector<kda::bf16_bits> out(2, 0);
  std::vector<float> final_state(4, -1.0f);
  std::vector<unsigned char> workspace(workspace_bytes + 1);

  kda::Tensors tensors;
  tensors.q = q.data();
  tensors.k = k.data();
  tensors.v = v.data();
  tensors.g = g.data();
  tensors.beta = beta.data();
  tensors.A_log = A_log.data();
  tensors.dt_bias = dt_bias.data();
  tensors.final_state = final_state.data();
  tensors.out = out.data();

  status = kda::forward_cpu(problem, tensors, kda::Workspace{workspace.data(), workspace_bytes});
  check(status.ok(), "forward_cpu: " + status.to_string());
  if (!status.ok()) return;

  const float out_factor = 0.5f / std::sqrt(2.0f);
  check(near(kda::bf16_to_float(out[0]), out_factor * v0, 1e-2f), "out[0]");
  check(near(kda::bf16_to_float(out[1]), out_factor * v1, 1e-2f), "out[1]");
  const float expected_state[4] = {0.5f * v0, 0.0f, 0.5f * v1, 0.0f};
  for (int i = 0; i < 4; ++i) {
    check(near(final_state[i], expected_state[i], 1e-3f), "final_state[" + std::to_string(i) + "]");
  }

  // Validation reports errors as a Status that names the field, without throwing.
  kda::Problem bad = problem;
  bad.num_heads = -1;
  status = kda::validate(bad);
  check(!status.ok() && !status.message().empty(), "validate() rejects num_heads = -1");
}

void check_planner() {
  kda::planner::MemoryPlanner planner;
  kda::planner::BufferRequest state;
  state.name = "layer0.state";
  state.kind = kda::planner::BufferKind::kState;
  state.layer = 0;
  state.bytes = 1000;
  state.persistent = true;
  planner.add(state);
  kda::planner::BufferRequest workspace;
  workspace.name = "layer0.workspace";
  workspace.kind = kda::planner::BufferKind::kWorkspace;
  workspace.layer = 0;
  workspace.bytes = 300;
  planner.add(workspace);

  kda::planner::PlanResult result = planner.plan(kda::planner::PlanMode::kSum);
  check(result.ok, "planner sum: " + result.error);
  if (!result.ok) return;
  const kda::planner::MemoryPlan& plan = result.plan;
  check(plan.entries.size() == 2, "plan has two entries");
  check(plan.arena_bytes >= 1300 && plan.arena_bytes % kda::planner::kDefaultAlignment == 0,
        "plan total is aligned and covers both buffers");
  for (const kda::planner::PlanEntry& entry : plan.entries) {
    check(entry.offset % kda::planner::kDefaultAlignment == 0, entry.name + " offset aligned");
  }
  check(plan.find("layer0.workspace") != nullptr, "plan.find(layer0.workspace)");
  check(plan.to_json().find("\"arena_bytes\"") != std::string::npos, "plan JSON has arena_bytes");
}

// The engine's model description: parsed from YAML text, defaults filled in, errors thrown as
// kda::Error naming the key.
void check_model_spec() {
  const std::string yaml =
      "name: consumer-model\n"
      "hidden_size: 64\n"
      "num_hidden_layers: 3\n"
      "linear_attn_config:\n"
      "  num_heads: 2\n"
      "  head_dim: 16\n"
      "  kda_layers: [1, 3]\n"
      "  full_attn_layers: [2]\n"
      "  gate: softplus\n";
  try {
    kda::engine::ModelSpec spec = kda::engine::parse_model_spec(yaml, "consumer.yaml");
    check(spec.num_kda_layers() == 2, "model spec has two KDA layers");
    check(spec.kda_layer_indices.size() == 2 && spec.kda_layer_indices[1] == 2,
          "KDA layer 3 (1-based) is index 2");
    check(spec.runtime.workspace_plan == kda::planner::PlanMode::kReuse,
          "default plan mode is reuse");
  } catch (const kda::Error& error) {
    check(false, std::string("parse_model_spec threw: ") + error.what());
  }
  bool threw = false;
  try {
    kda::engine::parse_model_spec("hidden_size: -1\n", "bad.yaml");
  } catch (const kda::Error& error) {
    threw = std::string(error.what()).find("bad.yaml") != std::string::npos;
  }
  check(threw, "parse_model_spec rejects a bad description with an error naming the file");
}

// The installed example model (share/kda/examples/models) loads, and the C header compiles here.
void check_installed_model() {
  try {
    const kda::engine::ModelSpec spec =
        kda::engine::load_model_spec(std::string(KDA_DATA_DIR) + "/examples/models/tiny.yaml");
    check(spec.num_kda_layers() > 0, "the installed tiny.yaml has KDA layers");
  } catch (const kda::Error& error) {
    check(false, std::string("loading the installed tiny.yaml threw: ") + error.what());
  }
  kda_engine_options options;
  check(kda_engine_options_init(&options) == KDA_OK, "kda_engine_options_init");
}

// A whole (tiny) engine on the CPU: plan, one arena, a prefill through every KDA layer.
void check_engine() {
  const std::string yaml =
      "hidden_size: 64\n"
      "num_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 2, head_dim: 16, kda_layers: [1, 2], gate: softplus}\n"
      "runtime: {max_tokens: 32, max_sequences: 2, backend: cpu}\n";
  try {
    kda::engine::EngineOptions options;
    options.cpu_threads = 1;
    kda::engine::Engine engine(kda::engine::parse_model_spec(yaml, "engine.yaml"), options);
    check(engine.backend() == kda::Backend::kCpu, "engine runs on the CPU");
    check(engine.num_layers() == 2, "engine has two KDA layers");
    // Two sequences of 20 and 12 tokens through both layers, then one decode step of each.
    const std::size_t T = 32, H = 2, D = 16;
    std::vector<std::uint16_t> qkvg(T * H * D), beta(T * H, kda::float_to_bf16(0.5f));
    std::vector<std::uint16_t> out(T * H * D, 0);
    for (std::size_t i = 0; i < qkvg.size(); ++i) {
      qkvg[i] = kda::float_to_bf16(static_cast<float>(i % 7) / 7.0f - 0.4f);
    }
    const kda::engine::LayerInputs in{qkvg.data(), qkvg.data(), qkvg.data(), qkvg.data(),
                                      beta.data()};
    const int a = engine.acquire_slot(), b = engine.acquire_slot();
    for (int l = 0; l < engine.num_layers(); ++l)
      engine.prefill(l, in, out.data(), {a, b}, {0, 20, 32});
    bool finite = true;
    for (const std::uint16_t x : out) finite = finite && std::isfinite(kda::bf16_to_float(x));
    check(finite, "prefill writes finite outputs");
    for (int l = 0; l < engine.num_layers(); ++l) engine.decode(l, in, out.data(), {a, b}, 1);
    check(engine.free_slots() == 0, "both slots acquired");
    engine.release_slot(a);
    engine.release_slot(b);
  } catch (const kda::Error& error) {
    check(false, std::string("engine threw: ") + error.what());
  }
}

}  // namespace

int main() {
  check_tiny_forward();
  check_planner();
  check_model_spec();
  check_engine();
  check_installed_model();
  std::printf("consumer: CUDA compiled in: %s\n", kda::cuda_compiled() ? "yes" : "no");
  if (failures != 0) {
    std::fprintf(stderr, "consumer: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("consumer: all checks passed\n");
  return 0;
}
