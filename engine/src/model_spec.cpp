// engine/model_spec.cpp — YAML → ModelSpec with file:line:column errors that name the key.
#include "kda/engine/model_spec.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "kda/engine/error.hpp"

namespace kda::engine {

namespace {

namespace fs = std::filesystem;

// Limits that catch typos and absurd values long before any byte count overflows.
constexpr std::int64_t kMaxHiddenSize = 1 << 20;
constexpr std::int64_t kMaxLayers = 4096;
constexpr std::int64_t kMaxHeads = 1024;
constexpr std::int64_t kMaxHeadDim = 1024;
constexpr std::int64_t kMaxConvKernel = 64;
constexpr std::int64_t kMaxSequences = 1 << 20;  // slots are int32 indices

// Everything the parser needs to phrase an error.
class Context {
 public:
  explicit Context(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const YAML::Mark& mark, const std::string& key, const std::string& what,
                         StatusCode code = StatusCode::kInvalidArgument) const {
    std::string message = source_;
    if (!mark.is_null()) {
      message += ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
    }
    message += ": ";
    if (!key.empty()) message += key + ": ";
    message += what;
    throw Error(code, message);
  }
  [[noreturn]] void fail(const YAML::Node& node, const std::string& key, const std::string& what,
                         StatusCode code = StatusCode::kInvalidArgument) const {
    fail(node.Mark(), key, what, code);
  }

 private:
  std::string source_;
};

std::string join_key(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

// How a node looks, for "expected X, got Y" messages.
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null: return "null";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Scalar: {
      std::string text = node.Scalar();
      if (text.size() > 40) text = text.substr(0, 37) + "...";
      return (node.Tag() == "!" ? "the string '" : "'") + text + "'";
    }
    default: return "nothing";
  }
}

// A plain (unquoted) scalar, as YAML writes numbers; quoted "32" is a string, not a number.
bool is_plain_scalar(const YAML::Node& node) { return node.IsScalar() && node.Tag() != "!"; }

std::int64_t as_int(const Context& ctx, const YAML::Node& node, const std::string& key) {
  if (is_plain_scalar(node)) {
    try {
      return node.as<std::int64_t>();
    } catch (const YAML::Exception&) {
      // Falls through: not an integer, or one that does not fit in 64 bits.
    }
  }
  ctx.fail(node, key, "expected an integer, got " + describe(node));
}

std::int64_t as_int_in(const Context& ctx, const YAML::Node& node, const std::string& key,
                       std::int64_t lo, std::int64_t hi) {
  const std::int64_t value = as_int(ctx, node, key);
  if (value < lo || value > hi) {
    ctx.fail(node, key,
             "value " + std::to_string(value) + " is out of range [" + std::to_string(lo) + ", " +
                 std::to_string(hi) + "]");
  }
  return value;
}

double as_double(const Context& ctx, const YAML::Node& node, const std::string& key) {
  if (is_plain_scalar(node)) {
    try {
      return node.as<double>();
    } catch (const YAML::Exception&) {
    }
  }
  ctx.fail(node, key, "expected a number, got " + describe(node));
}

std::string as_string(const Context& ctx, const YAML::Node& node, const std::string& key) {
  if (!node.IsScalar()) ctx.fail(node, key, "expected a string, got " + describe(node));
  return node.Scalar();
}

const YAML::Node require(const Context& ctx, const YAML::Node& map, const std::string& parent,
                         const std::string& key) {
  const YAML::Node child = map[key];
  if (!child.IsDefined()) ctx.fail(map, join_key(parent, key), "required key is missing");
  return child;
}

// nullptr-like: an undefined node when absent (a key written with no value counts as absent).
const YAML::Node optional(const YAML::Node& map, const std::string& key) {
  const YAML::Node child = map[key];
  if (child.IsDefined() && child.IsNull()) return YAML::Node(YAML::NodeType::Undefined);
  return child;
}

// A map whose keys are unique (YAML requires it; yaml-cpp would silently take one of them).
void require_map(const Context& ctx, const YAML::Node& node, const std::string& key) {
  if (!node.IsMap()) ctx.fail(node, key, "expected a map, got " + describe(node));
  std::set<std::string> seen;
  for (auto it = node.begin(); it != node.end(); ++it) {
    if (!it->first.IsScalar()) continue;
    if (!seen.insert(it->first.Scalar()).second) {
      ctx.fail(it->first, join_key(key, it->first.Scalar()), "key appears twice");
    }
  }
}

// A list of 1-based layer indices, each in [1, num_layers], unique. Sorted on return.
std::vector<int> layer_list(const Context& ctx, const YAML::Node& node, const std::string& key,
                            std::int64_t num_layers) {
  if (!node.IsSequence()) ctx.fail(node, key, "expected a list of layer numbers, got " + describe(node));
  std::vector<int> layers;
  std::set<std::int64_t> seen;
  for (std::size_t i = 0; i < node.size(); ++i) {
    const YAML::Node element = node[i];
    const std::string element_key = key + "[" + std::to_string(i) + "]";
    const std::int64_t layer = as_int(ctx, element, element_key);
    if (layer < 1 || layer > num_layers) {
      ctx.fail(element, element_key,
               "layer " + std::to_string(layer) + " is out of range [1, " +
                   std::to_string(num_layers) + "] (layers are 1-based)");
    }
    if (!seen.insert(layer).second) {
      ctx.fail(element, element_key, "layer " + std::to_string(layer) + " is listed twice");
    }
    layers.push_back(static_cast<int>(layer));
  }
  std::sort(layers.begin(), layers.end());
  return layers;
}

bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  *out = a * b;
  return true;
}
bool checked_add(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  if (b > std::numeric_limits<std::uint64_t>::max() - a) return false;
  *out = a + b;
  return true;
}
bool checked_product(std::initializer_list<std::uint64_t> factors, std::uint64_t* out) {
  std::uint64_t product = 1;
  for (const std::uint64_t factor : factors) {
    if (!checked_mul(product, factor, &product)) return false;
  }
  *out = product;
  return true;
}

// The byte counts an engine for this spec will plan; each, and their sum, must fit in 64 bits.
void check_byte_counts(const Context& ctx, const ModelSpec& spec, const YAML::Node& runtime_node,
                       const YAML::Node& root) {
  const std::uint64_t tokens = static_cast<std::uint64_t>(spec.runtime.max_tokens);
  const std::uint64_t heads = static_cast<std::uint64_t>(spec.num_heads);
  const std::uint64_t dim = static_cast<std::uint64_t>(spec.head_dim);
  const std::uint64_t seqs = static_cast<std::uint64_t>(spec.runtime.max_sequences);
  const std::uint64_t layers = static_cast<std::uint64_t>(spec.num_kda_layers());
  const std::uint64_t state_size = dtype_size(spec.runtime.state_dtype);
  // Point at the runtime value that makes the count overflow, or at the section (or top) when the
  // default is in effect.
  auto node_of = [&](const char* key) -> YAML::Node {
    if (!runtime_node.IsDefined()) return root;
    const YAML::Node value = runtime_node[key];
    return value.IsDefined() ? value : runtime_node;
  };
  const std::string key = "runtime.max_tokens";

  std::uint64_t tensor_bytes = 0, state_pool = 0, all_pools = 0, total = 0;
  // One bf16 [max_tokens, H, D] tensor (q, k, v, g or out); six of them with beta rounded up.
  if (!checked_product({tokens, heads, dim, 2}, &tensor_bytes) ||
      !checked_mul(tensor_bytes, 6, &total)) {
    ctx.fail(node_of("max_tokens"), key,
             "max_tokens " + std::to_string(tokens) + " x num_heads " + std::to_string(heads) +
                 " x head_dim " + std::to_string(dim) + " x 2 bytes overflows 64 bits",
             StatusCode::kOverflow);
  }
  if (!checked_product({seqs, heads, dim, dim, state_size}, &state_pool) ||
      !checked_mul(state_pool, layers, &all_pools) || !checked_add(total, all_pools, &total)) {
    ctx.fail(node_of("max_sequences"), "runtime.max_sequences",
             "the state pools (max_sequences " + std::to_string(seqs) + " x num_heads " +
                 std::to_string(heads) + " x head_dim^2 " + std::to_string(dim) + "^2 x " +
                 std::to_string(state_size) + " bytes x " + std::to_string(layers) +
                 " KDA layers) plus the inputs overflow 64 bits",
             StatusCode::kOverflow);
  }
}

}  // namespace

const char* to_string(BackendChoice choice) noexcept {
  switch (choice) {
    case BackendChoice::kAuto: return "auto";
    case BackendChoice::kCpu: return "cpu";
    case BackendChoice::kCuda: return "cuda";
  }
  return "unknown";
}

bool parse_backend_choice(const std::string& text, BackendChoice* choice) noexcept {
  if (choice == nullptr) return false;
  if (text == "auto") *choice = BackendChoice::kAuto;
  else if (text == "cpu") *choice = BackendChoice::kCpu;
  else if (text == "cuda") *choice = BackendChoice::kCuda;
  else return false;
  return true;
}

std::uint64_t ModelSpec::state_slot_bytes() const noexcept {
  return static_cast<std::uint64_t>(num_heads) * static_cast<std::uint64_t>(head_dim) *
         static_cast<std::uint64_t>(head_dim) * dtype_size(runtime.state_dtype);
}

ModelSpec parse_model_spec(const std::string& text, const std::string& source_name,
                           const std::string& base_dir) {
  const Context ctx(source_name);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    ctx.fail(e.mark, "", "YAML syntax error: " + e.msg);
  } catch (const YAML::Exception& e) {
    ctx.fail(e.mark, "", std::string("cannot read YAML: ") + e.what());
  }
  if (!root.IsDefined() || root.IsNull()) {
    ctx.fail(YAML::Mark::null_mark(), "", "empty model description (expected a map of keys)");
  }
  if (!root.IsMap()) ctx.fail(root, "", "expected a map of keys at the top level, got " + describe(root));
  require_map(ctx, root, "");

  ModelSpec spec;
  spec.source = source_name;
  try {
    // name: optional; default is the file name without its extension.
    if (const YAML::Node name = optional(root, "name"); name.IsDefined()) {
      spec.name = as_string(ctx, name, "name");
      if (spec.name.empty()) ctx.fail(name, "name", "must not be empty");
    } else {
      spec.name = fs::path(source_name).stem().string();
      if (spec.name.empty()) spec.name = "model";
    }

    spec.hidden_size =
        as_int_in(ctx, require(ctx, root, "", "hidden_size"), "hidden_size", 1, kMaxHiddenSize);
    spec.num_hidden_layers = as_int_in(ctx, require(ctx, root, "", "num_hidden_layers"),
                                       "num_hidden_layers", 1, kMaxLayers);

    const YAML::Node attn = require(ctx, root, "", "linear_attn_config");
    require_map(ctx, attn, "linear_attn_config");
    const std::string a = "linear_attn_config";
    spec.num_heads = as_int_in(ctx, require(ctx, attn, a, "num_heads"), a + ".num_heads", 1,
                               kMaxHeads);
    spec.head_dim = as_int_in(ctx, require(ctx, attn, a, "head_dim"), a + ".head_dim", 1,
                              kMaxHeadDim);
    if (const YAML::Node n = optional(attn, "short_conv_kernel_size"); n.IsDefined()) {
      spec.short_conv_kernel_size =
          as_int_in(ctx, n, a + ".short_conv_kernel_size", 1, kMaxConvKernel);
    }
    const YAML::Node kda_node = require(ctx, attn, a, "kda_layers");
    spec.kda_layers = layer_list(ctx, kda_node, a + ".kda_layers", spec.num_hidden_layers);
    if (spec.kda_layers.empty()) ctx.fail(kda_node, a + ".kda_layers", "must name at least one layer");
    for (const int layer : spec.kda_layers) spec.kda_layer_indices.push_back(layer - 1);

    if (const YAML::Node full = optional(attn, "full_attn_layers"); full.IsDefined()) {
      spec.full_attn_layers =
          layer_list(ctx, full, a + ".full_attn_layers", spec.num_hidden_layers);
      for (std::size_t i = 0; i < full.size(); ++i) {
        const int layer = static_cast<int>(full[i].as<std::int64_t>());
        if (std::binary_search(spec.kda_layers.begin(), spec.kda_layers.end(), layer)) {
          ctx.fail(full[i], a + ".full_attn_layers[" + std::to_string(i) + "]",
                   "layer " + std::to_string(layer) + " is also listed in kda_layers");
        }
      }
    }

    const YAML::Node gate_node = require(ctx, attn, a, "gate");
    const std::string gate = as_string(ctx, gate_node, a + ".gate");
    if (gate == "softplus") {
      spec.gate = GateMode::kSoftplus;
    } else if (gate == "lower_bound") {
      spec.gate = GateMode::kLowerBound;
    } else {
      ctx.fail(gate_node, a + ".gate", "unknown gate '" + gate + "' (expected softplus or lower_bound)");
    }
    YAML::Node bound_node = optional(attn, "gate_lower_bound");
    if (spec.gate == GateMode::kLowerBound && !bound_node.IsDefined()) {
      ctx.fail(attn, a + ".gate_lower_bound", "required with gate: lower_bound (a value in [-5, 0))");
    }
    if (bound_node.IsDefined()) {
      const double bound = as_double(ctx, bound_node, a + ".gate_lower_bound");
      if (!std::isfinite(bound) || bound < -5.0 || bound >= 0.0) {
        std::ostringstream shown;
        shown << bound;
        ctx.fail(bound_node, a + ".gate_lower_bound",
                 "value " + shown.str() + " is outside [-5, 0) or not finite");
      }
      spec.gate_lower_bound = static_cast<float>(bound);
    }

    if (const YAML::Node weights = optional(root, "weights"); weights.IsDefined()) {
      const std::string path = as_string(ctx, weights, "weights");
      if (path.empty()) ctx.fail(weights, "weights", "must not be empty");
      fs::path resolved(path);
      if (resolved.is_relative() && !base_dir.empty()) resolved = fs::path(base_dir) / resolved;
      spec.weights = resolved.lexically_normal().string();
    }

    const YAML::Node runtime = optional(root, "runtime");
    if (runtime.IsDefined()) {
      require_map(ctx, runtime, "runtime");
      const std::string r = "runtime";
      if (const YAML::Node n = optional(runtime, "max_tokens"); n.IsDefined()) {
        spec.runtime.max_tokens =
            as_int_in(ctx, n, r + ".max_tokens", 1, std::numeric_limits<std::int64_t>::max());
      }
      if (const YAML::Node n = optional(runtime, "max_sequences"); n.IsDefined()) {
        spec.runtime.max_sequences = as_int_in(ctx, n, r + ".max_sequences", 1, kMaxSequences);
      }
      if (const YAML::Node n = optional(runtime, "state_dtype"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".state_dtype");
        if (value == "fp32") spec.runtime.state_dtype = DType::kF32;
        else if (value == "bf16") spec.runtime.state_dtype = DType::kBF16;
        else ctx.fail(n, r + ".state_dtype", "unknown state dtype '" + value + "' (expected fp32 or bf16)");
      }
      if (const YAML::Node n = optional(runtime, "workspace_plan"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".workspace_plan");
        if (!planner::parse_plan_mode(value, &spec.runtime.workspace_plan)) {
          ctx.fail(n, r + ".workspace_plan", "unknown plan '" + value + "' (expected sum or reuse)");
        }
      }
      if (const YAML::Node n = optional(runtime, "backend"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".backend");
        if (!parse_backend_choice(value, &spec.runtime.backend)) {
          ctx.fail(n, r + ".backend", "unknown backend '" + value + "' (expected auto, cpu or cuda)");
        }
      }
    }
    check_byte_counts(ctx, spec, runtime, root);
  } catch (const YAML::Exception& e) {
    // Anything yaml-cpp itself rejects while we walk the tree (should not happen on a parsed tree).
    ctx.fail(e.mark, "", std::string("cannot read YAML: ") + e.what());
  }
  return spec;
}

ModelSpec load_model_spec(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": is a directory, expected a YAML/JSON model description");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(StatusCode::kInvalidArgument, path + ": cannot open model description");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(StatusCode::kInvalidArgument, path + ": cannot read model description");
  const fs::path parent = fs::path(path).parent_path();
  return parse_model_spec(text.str(), path, parent.empty() ? std::string(".") : parent.string());
}

}  // namespace kda::engine
