// What a front end such as kda-run takes from the engine besides running it: runtime values that
// replace the model description's (checked as the file's own), the default plan of a description
// without a runtime section, files that cannot be opened (the absolute path and the reason), and
// why backend auto chose what it chose.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "kda/engine/checkpoint.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using kda::engine::ModelSpec;
using kda::engine::ModelSpecOptions;
using kda::engine::parse_model_spec;
using kda::planner::PlanMode;

namespace {

// No runtime section, as a Hugging Face config.json.
const char* const kNoRuntime =
    "hidden_size: 64\nnum_hidden_layers: 2\n"
    "linear_attn_config: {num_heads: 2, head_dim: 16, kda_layers: [1, 2], gate: softplus}\n";

std::string error_of(const std::string& text, const ModelSpecOptions& options) {
  try {
    parse_model_spec(text, "m.yaml", {}, options);
  } catch (const kda::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Runs `open` with the current directory at `dir` (restored after), returning the error message.
template <typename Open>
std::string open_error_in(const fs::path& dir, Open open) {
  const fs::path before = fs::current_path();
  fs::current_path(dir);
  std::string message = "(no error)";
  try {
    open();
  } catch (const kda::Error& e) {
    message = e.what();
    CHECK(e.code() == kda::StatusCode::kInvalidArgument);
  }
  fs::current_path(before);
  return message;
}

}  // namespace

TEST_CASE("model spec: reuse by default, and runtime overrides replace the file's values") {
  ModelSpec spec = parse_model_spec(kNoRuntime, "config.json");
  CHECK(spec.runtime.workspace_plan == PlanMode::kReuse);

  ModelSpecOptions options;
  options.runtime.workspace_plan = PlanMode::kSum;
  options.runtime.max_tokens = 64;
  options.runtime.max_sequences = 3;
  spec =
      parse_model_spec(std::string(kNoRuntime) +
                           "runtime: {max_tokens: 16, max_sequences: 2, workspace_plan: reuse}\n",
                       "m.yaml", {}, options);
  CHECK(spec.runtime.workspace_plan == PlanMode::kSum);
  CHECK(spec.runtime.max_tokens == 64);
  CHECK(spec.runtime.max_sequences == 3);
  spec = parse_model_spec(kNoRuntime, "m.yaml", {}, options);  // no section to replace
  CHECK(spec.runtime.max_sequences == 3);
  CHECK(spec.runtime.state_dtype == kda::DType::kF32);
  options.runtime.state_dtype = kda::DType::kBF16;
  spec = parse_model_spec(std::string(kNoRuntime) + "runtime: {state_dtype: fp32}\n", "m.yaml", {},
                          options);
  CHECK(spec.runtime.state_dtype == kda::DType::kBF16);
  const std::uint64_t bf16_slot = spec.state_slot_bytes();
  options.runtime.state_dtype = kda::DType::kF32;
  spec = parse_model_spec(std::string(kNoRuntime) + "runtime: {state_dtype: bf16}\n", "m.yaml", {},
                          options);
  CHECK(spec.runtime.state_dtype == kda::DType::kF32);
  CHECK(spec.state_slot_bytes() == 2 * bf16_slot);

  // Out of range, or sizes that overflow: the key, the override, and no line and column.
  ModelSpecOptions bad;
  bad.runtime.max_sequences = 0;
  CHECK(error_of(kNoRuntime, bad) ==
        "m.yaml: runtime.max_sequences: 0 (overriding the model description's) is out of range "
        "[1, 1048576]");
  bad.runtime.max_sequences = (1 << 20) + 1;
  CHECK(error_of(kNoRuntime, bad).find("is out of range [1, 1048576]") != std::string::npos);
  bad = {};
  bad.runtime.state_dtype = kda::DType::kI32;
  CHECK(error_of(kNoRuntime, bad) ==
        "m.yaml: runtime.state_dtype: " + std::string(kda::to_string(kda::DType::kI32)) +
            " (overriding the model description's) is not fp32 or bf16");
  bad = {};
  bad.runtime.max_tokens = 0;
  CHECK(error_of(kNoRuntime, bad).find("m.yaml: runtime.max_tokens: 0 (overriding") == 0);
  bad.runtime.max_tokens = std::numeric_limits<std::int64_t>::max();
  try {
    parse_model_spec(std::string(kNoRuntime) + "runtime: {max_tokens: 16}\n", "m.yaml", {}, bad);
    FAIL("expected kda::Error");
  } catch (const kda::Error& e) {
    CHECK(e.code() == kda::StatusCode::kOverflow);
    CHECK(std::string(e.what()) ==
          "m.yaml: runtime.max_tokens: max_tokens 9223372036854775807 (overriding the model "
          "description's) x num_heads 2 x head_dim 16 x 2 bytes overflows 64 bits");
  }
}

TEST_CASE("files that cannot be opened: the absolute path and the reason") {
  kda::test::TempDir dir;
  const fs::path cwd = fs::canonical(dir.path);  // what getcwd() gives
  const std::string enoent = std::strerror(ENOENT);
  CHECK(open_error_in(dir.path, [] { kda::engine::load_model_spec("sub/m.yaml"); }) ==
        "sub/m.yaml: cannot open the model description '" + (cwd / "sub/m.yaml").string() +
            "': " + enoent);
  CHECK(open_error_in(dir.path, [] { kda::engine::SafetensorsFile::open("w.safetensors"); }) ==
        "w.safetensors: cannot open the safetensors file '" + (cwd / "w.safetensors").string() +
            "': " + enoent);
  CHECK(open_error_in(dir.path, [] { kda::engine::Checkpoint::open("./x/../index.json"); }) ==
        "./x/../index.json: cannot open the checkpoint index '" + (cwd / "index.json").string() +
            "': " + enoent);
  // An absolute path is not repeated.
  const std::string absolute = (cwd / "m.yaml").string();
  CHECK(open_error_in(dir.path, [&] { kda::engine::load_model_spec(absolute); }) ==
        absolute + ": cannot open the model description: " + enoent);
  if (geteuid() != 0) {  // permissions do not stop root
    std::ofstream(dir.file("locked.yaml")) << kNoRuntime;
    fs::permissions(dir.file("locked.yaml"), fs::perms::none);
    CHECK(open_error_in(dir.path, [] { kda::engine::load_model_spec("locked.yaml"); }) ==
          "locked.yaml: cannot open the model description '" + (cwd / "locked.yaml").string() +
              "': " + std::strerror(EACCES));
  }
}

TEST_CASE("resolve_backend: why it chose what it chose") {
  const ModelSpec spec = parse_model_spec(kNoRuntime, "m.yaml");  // head_dim 16
  std::string why;
  CHECK(kda::engine::resolve_backend(spec, kda::engine::BackendChoice::kCpu, &why) ==
        kda::Backend::kCpu);
  CHECK(why == "asked for");
  CHECK(kda::engine::resolve_backend(spec, kda::engine::BackendChoice::kCuda, &why) ==
        kda::Backend::kCuda);
  CHECK(why == "asked for");

  std::string machine;
  const bool cuda_here = kda::engine::cuda_backend_available(&machine);
  CHECK(cuda_here == machine.empty());
  if (!kda::cuda_compiled()) CHECK(machine == "this build has no CUDA backend");
  if (kda::cuda_compiled() && kda::cuda_device_count() == 0)
    CHECK(machine == "no CUDA device found");
  CHECK(kda::engine::resolve_backend(spec, kda::engine::BackendChoice::kAuto, &why) ==
        kda::Backend::kCpu);
  // The machine's reason first; where CUDA runs, the model's.
  CHECK(why == (cuda_here ? "KDA layer (CUDA): head_dim 16 is not 128 (the CUDA core and the "
                            "gated-norm kernel run D = 128)"
                          : machine));
  ModelSpec core = spec;
  core.runtime.layer_mode = kda::engine::LayerMode::kCoreOnly;
  kda::engine::resolve_backend(core, kda::engine::BackendChoice::kAuto, &why);
  if (cuda_here)
    CHECK(why.find("prefill: the CUDA backend needs head_dim_k == head_dim_v == 128") == 0);
  kda::engine::resolve_backend(spec, kda::engine::BackendChoice::kAuto);  // `why` is optional
}
