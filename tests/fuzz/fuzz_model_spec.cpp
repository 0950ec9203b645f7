// libFuzzer harness for the YAML model-description loader (kda::engine::parse_model_spec).
//
// Contract under test: any byte string either yields a ModelSpec that satisfies every documented
// limit, or throws kda::Error. Anything else — another exception type, a crash, undefined
// behaviour, a leak (ASan/UBSan/LSan in the fuzz preset) or a "validated" spec that breaks a
// documented limit — is a finding, reported by aborting so that libFuzzer saves the input.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"

namespace {

using kda::fuzz::finding;

void expect(bool condition, const char* what) {
  if (!condition) finding(std::string("accepted spec breaks: ") + what);
}

// A 1-based layer list as the header documents it: sorted, unique, in [1, num_layers].
bool valid_layer_list(const std::vector<int>& layers, std::int64_t num_layers) {
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 1 || layers[i] > num_layers) return false;
    if (i > 0 && layers[i] <= layers[i - 1]) return false;
  }
  return true;
}

void check_spec(const kda::engine::ModelSpec& spec) {
  using kda::engine::ModelSpec;
  expect(!spec.name.empty(), "name is not empty");
  expect(spec.hidden_size >= 1 && spec.hidden_size <= (1 << 20), "hidden_size in [1, 2^20]");
  expect(spec.num_hidden_layers >= 1 && spec.num_hidden_layers <= 4096,
         "num_hidden_layers in [1, 4096]");
  expect(spec.num_heads >= 1 && spec.num_heads <= 1024, "num_heads in [1, 1024]");
  expect(spec.head_dim >= 1 && spec.head_dim <= 1024, "head_dim in [1, 1024]");
  expect(spec.short_conv_kernel_size >= 1 && spec.short_conv_kernel_size <= 64,
         "short_conv_kernel_size in [1, 64]");
  expect(!spec.kda_layers.empty(), "at least one KDA layer");
  expect(valid_layer_list(spec.kda_layers, spec.num_hidden_layers),
         "kda_layers sorted/unique/in range");
  expect(valid_layer_list(spec.full_attn_layers, spec.num_hidden_layers),
         "full_attn_layers sorted/unique/in range");
  for (const int layer : spec.full_attn_layers) {
    expect(!std::binary_search(spec.kda_layers.begin(), spec.kda_layers.end(), layer),
           "full_attn_layers disjoint from kda_layers");
  }
  expect(spec.kda_layer_indices.size() == spec.kda_layers.size(), "one 0-based index per layer");
  for (std::size_t i = 0; i < spec.kda_layers.size(); ++i) {
    expect(spec.kda_layer_indices[i] == spec.kda_layers[i] - 1, "0-based index = layer - 1");
  }
  if (spec.gate == kda::GateMode::kLowerBound) {
    expect(std::isfinite(spec.gate_lower_bound) && spec.gate_lower_bound >= -5.0f &&
               spec.gate_lower_bound < 0.0f,
           "gate_lower_bound in [-5, 0)");
  }
  expect(spec.runtime.max_tokens >= 1, "max_tokens >= 1");
  expect(spec.runtime.max_sequences >= 1 && spec.runtime.max_sequences <= (1 << 20),
         "max_sequences in [1, 2^20]");
  expect(
      spec.runtime.state_dtype == kda::DType::kF32 || spec.runtime.state_dtype == kda::DType::kBF16,
      "state_dtype fp32 or bf16");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const kda::engine::ModelSpec spec = kda::engine::parse_model_spec(text, "fuzz.yaml", "base");
    check_spec(spec);
    // A validated spec promises overflow-free byte counts: planning (no allocation) must either
    // succeed or fail with kda::Error, never wrap around or crash.
    (void)kda::engine::Engine::plan_for(spec, kda::Backend::kCpu);
  } catch (const kda::Error&) {
    // The documented outcome for a bad description.
  } catch (const std::exception& e) {
    finding(std::string("exception other than kda::Error: ") + e.what());
  } catch (...) {
    finding("non-std exception");
  }
  return 0;
}
