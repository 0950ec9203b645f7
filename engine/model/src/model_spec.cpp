// engine/model/src/model_spec.cpp — YAML or JSON → ModelSpec with file:line:column errors that name
// the key, and warnings (with a suggested spelling) for unknown keys in the engine's own sections.
#include "kda/engine/model_spec.hpp"
#include "kda/detail/checked_math.hpp"

#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "file_failure.hpp"
#include "kda/error.hpp"

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

// Everything the parser needs to phrase an error or a warning, and where warnings go.
class Context {
 public:
  Context(std::string source, bool strict, std::vector<std::string>* warnings)
      : source_(std::move(source)), strict_(strict), warnings_(warnings) {}

  // "file:line:column: key: what" (no line and column when the mark is null).
  std::string message(const YAML::Mark& mark, const std::string& key,
                      const std::string& what) const {
    std::string text = source_;
    if (!mark.is_null()) {
      text += ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
    }
    text += ": ";
    if (!key.empty()) text += key + ": ";
    return text + what;
  }

  [[noreturn]] void fail(const YAML::Mark& mark, const std::string& key, const std::string& what,
                         StatusCode code = StatusCode::kInvalidArgument) const {
    throw Error(code, message(mark, key, what));
  }
  [[noreturn]] void fail(const YAML::Node& node, const std::string& key, const std::string& what,
                         StatusCode code = StatusCode::kInvalidArgument) const {
    fail(node.Mark(), key, what, code);
  }

  // An unknown key: a warning, or an error in strict mode. `hint` says what was probably meant.
  void unknown_key(const YAML::Node& key_node, const std::string& key,
                   const std::string& hint) const {
    if (strict_) {
      fail(key_node, key, "unknown key; " + hint + " (strict mode: unknown keys are errors)");
    }
    warnings_->push_back(message(key_node.Mark(), key, "unknown key, ignored; " + hint));
  }

 private:
  std::string source_;
  bool strict_;
  std::vector<std::string>* warnings_;
};

// The keys the engine reads: at the top level, and in the two sections it owns.
const std::vector<std::string> kTopLevelKeys = {
    "name",    "model_type", "hidden_size", "num_hidden_layers", "linear_attn_config",
    "weights", "runtime",    "rms_norm_eps"};
const std::vector<std::string> kLinearAttnKeys = {
    "num_heads",        "head_dim", "short_conv_kernel_size", "kda_layers",
    "full_attn_layers", "gate",     "gate_lower_bound"};
const std::vector<std::string> kRuntimeKeys = {
    "max_tokens", "max_sequences", "state_dtype", "workspace_plan",  "backend",
    "layers",     "tp_size",       "tp_rank",     "prefill_schedule"};

bool contains(const std::vector<std::string>& keys, const std::string& key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

// Edit distance with adjacent transpositions (optimal string alignment), case-insensitive and
// reading '-' as '_', so `Max-Token` is one edit from `max_tokens`.
std::size_t key_distance(const std::string& a, const std::string& b) {
  auto fold = [](char c) {
    if (c == '-') return '_';
    return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  };
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const bool same = fold(a[i - 1]) == fold(b[j - 1]);
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && fold(a[i - 1]) == fold(b[j - 2]) && fold(a[i - 2]) == fold(b[j - 1])) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

// How far a misspelling of a key this long may be: short keys allow one edit, long ones three.
std::size_t typo_budget(std::size_t length) { return length <= 4 ? 1 : length <= 8 ? 2 : 3; }

// The candidate closest to `key` within a typo of it (the budget of the longer of the two); empty
// when none is that close. Ties go to the earlier candidate.
std::string closest(const std::string& key, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const std::string& candidate : candidates) {
    const std::size_t budget = typo_budget(std::max(key.size(), candidate.size()));
    const std::size_t length_gap = key.size() > candidate.size() ? key.size() - candidate.size()
                                                                 : candidate.size() - key.size();
    if (length_gap > budget) continue;  // too far apart, whatever the letters (and cheap)
    const std::size_t distance = key_distance(key, candidate);
    if (key == candidate || distance > budget) continue;
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

std::string join_list(const std::vector<std::string>& keys) {
  std::string text;
  for (const std::string& key : keys) text += (text.empty() ? "" : ", ") + key;
  return text;
}

std::string line_of(const YAML::Node& node) {
  return node.Mark().is_null() ? "" : " (line " + std::to_string(node.Mark().line + 1) + ")";
}

std::string join_key(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

// How a node looks, for "expected X, got Y" messages.
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Scalar: {
      std::string text = node.Scalar();
      if (text.size() > 40) text = text.substr(0, 37) + "...";
      return (node.Tag() == "!" ? "the string '" : "'") + text + "'";
    }
    default:
      return "nothing";
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

// Reports a required key missing from `map`: at a near-miss key the engine does not read when there
// is one (`num_head` for `num_heads`), else at the map itself. `note` follows the message.
[[noreturn]] void fail_missing(const Context& ctx, const YAML::Node& map, const std::string& parent,
                               const std::string& key, const std::vector<std::string>& known,
                               const std::string& note = {}) {
  std::vector<std::string> unread;
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (it->first.IsScalar() && !contains(known, it->first.Scalar())) {
      unread.push_back(it->first.Scalar());
    }
  }
  const std::string near_miss = closest(key, unread);
  if (!near_miss.empty()) {
    const YAML::Node near_node = [&] {
      for (auto it = map.begin(); it != map.end(); ++it) {
        if (it->first.IsScalar() && it->first.Scalar() == near_miss) return it->first;
      }
      return YAML::Node();
    }();
    ctx.fail(near_node, join_key(parent, key),
             "required key is missing" + note + "; found `" + near_miss + "`" + line_of(near_node) +
                 ": a typo?");
  }
  ctx.fail(map, join_key(parent, key), "required key is missing" + note);
}

const YAML::Node require(const Context& ctx, const YAML::Node& map, const std::string& parent,
                         const std::string& key, const std::vector<std::string>& known) {
  const YAML::Node child = map[key];
  if (!child.IsDefined()) fail_missing(ctx, map, parent, key, known);
  return child;
}

// Unknown keys in a section the engine owns: each one a warning (an error in strict mode) with the
// known key it is closest to, or the list of known keys.
void check_section_keys(const Context& ctx, const YAML::Node& map, const std::string& section,
                        const std::vector<std::string>& known) {
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node key_node = it->first;
    const std::string key = key_node.IsScalar() ? key_node.Scalar() : describe(key_node);
    if (key_node.IsScalar() && contains(known, key)) continue;
    const std::string suggestion = key_node.IsScalar() ? closest(key, known) : std::string();
    ctx.unknown_key(key_node, join_key(section, key),
                    suggestion.empty() ? "known keys here: " + join_list(known)
                                       : "did you mean `" + suggestion + "`?");
  }
}

// Top-level keys belong to whoever wrote the file (a Hugging Face config carries dozens), so only
// a near-miss of an engine key that is absent (`runtme` without `runtime`) is reported.
void check_top_level_keys(const Context& ctx, const YAML::Node& root) {
  std::vector<std::string> absent;
  for (const std::string& key : kTopLevelKeys) {
    if (!root[key].IsDefined()) absent.push_back(key);
  }
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (!it->first.IsScalar() || contains(kTopLevelKeys, it->first.Scalar())) continue;
    const std::string suggestion = closest(it->first.Scalar(), absent);
    if (!suggestion.empty()) {
      ctx.unknown_key(it->first, it->first.Scalar(), "did you mean `" + suggestion + "`?");
    }
  }
}

// The first character that is not whitespace (or a UTF-8 byte order mark) opens a JSON object.
bool looks_like_json(const std::string& text) {
  std::size_t at = text.compare(0, 3, "\xEF\xBB\xBF") == 0 ? 3 : 0;
  while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
  return at < text.size() && text[at] == '{';
}

// A parsed JSON document as a YAML tree (without positions): strings are tagged as quoted, so
// "32" stays a string, as it does when yaml-cpp reads the JSON itself.
YAML::Node yaml_from_json(const Context& ctx, const nlohmann::json& value, int depth = 0) {
  constexpr int kMaxDepth = 256;  // far beyond any config; bounds the recursion
  if (depth > kMaxDepth) {
    ctx.fail(YAML::Mark::null_mark(), "",
             "JSON nested deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  switch (value.type()) {
    case nlohmann::json::value_t::object: {
      YAML::Node map(YAML::NodeType::Map);
      for (auto it = value.begin(); it != value.end(); ++it) {
        map[it.key()] = yaml_from_json(ctx, *it, depth + 1);
      }
      return map;
    }
    case nlohmann::json::value_t::array: {
      YAML::Node list(YAML::NodeType::Sequence);
      for (const auto& element : value) list.push_back(yaml_from_json(ctx, element, depth + 1));
      return list;
    }
    case nlohmann::json::value_t::string: {
      YAML::Node scalar(value.get<std::string>());
      scalar.SetTag("!");
      return scalar;
    }
    case nlohmann::json::value_t::null:
      return YAML::Node(YAML::NodeType::Null);
    default:
      return YAML::Node(value.dump());  // numbers and booleans, as JSON writes them
  }
}

// The 0-based line and column of byte `offset` in `text`.
YAML::Mark mark_at(const std::string& text, std::size_t offset) {
  YAML::Mark mark;
  offset = std::min(offset, text.size());
  mark.pos = static_cast<int>(offset);
  for (std::size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++mark.line;
      mark.column = 0;
    } else {
      ++mark.column;
    }
  }
  return mark;
}

// Reads YAML, or JSON: yaml-cpp reads nearly all JSON with positions kept; what it rejects (a
// surrogate-pair escape, as JSON writes an emoji) is read again as JSON, and a text that is JSON to
// neither is reported with the JSON parser's message, which is the one that names the problem.
YAML::Node load_document(const Context& ctx, const std::string& text) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    if (looks_like_json(text)) {
      try {
        return yaml_from_json(ctx, nlohmann::json::parse(text));
      } catch (const nlohmann::json::parse_error& json_error) {
        // what() is "[json.exception.parse_error.101] parse error at line 1, column 12: ...".
        std::string what = json_error.what();
        const std::size_t colon = what.find(": ");
        if (colon != std::string::npos) what = what.substr(colon + 2);
        const std::size_t at = json_error.byte > 0 ? json_error.byte - 1 : 0;
        const bool says_syntax = what.rfind("syntax error", 0) == 0;
        ctx.fail(mark_at(text, at), "",
                 says_syntax ? "JSON " + what : "JSON syntax error: " + what);
      } catch (const nlohmann::json::exception& json_error) {
        // Not a syntax error: a number too large for a double ("[json.exception.out_of_range.406]
        // number overflow parsing '1e705'"), ... . Reported at the quoted text when it is found.
        std::string what = json_error.what();
        const std::size_t bracket = what.find("] ");
        if (bracket != std::string::npos) what = what.substr(bracket + 2);
        std::size_t at = 0;
        const std::size_t open = what.find('\'');
        const std::size_t close = open == std::string::npos ? open : what.find('\'', open + 1);
        if (close != std::string::npos && close > open + 1) {
          const std::size_t found = text.find(what.substr(open + 1, close - open - 1));
          if (found != std::string::npos) at = found;
        }
        ctx.fail(mark_at(text, at), "", "JSON: " + what);
      }
    }
    if (const auto* parser_error = dynamic_cast<const YAML::ParserException*>(&e)) {
      ctx.fail(parser_error->mark, "", "YAML syntax error: " + parser_error->msg);
    }
    ctx.fail(e.mark, "", std::string("cannot read YAML: ") + e.what());
  }
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
  if (!node.IsSequence())
    ctx.fail(node, key, "expected a list of layer numbers, got " + describe(node));
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

using kda::detail::checked_add;
using kda::detail::checked_mul;
using kda::detail::checked_product;

// What an override says in an error about it: the value is not in the file.
constexpr const char* kOverridden = " (overriding the model description's)";

// The caller's runtime values in place of the file's, range-checked as the file's are. An error
// has no line and column: the value is not in the file.
void apply_runtime_overrides(const Context& ctx, const RuntimeOverrides& overrides,
                             RuntimeSpec* runtime) {
  auto in_range = [&ctx](std::int64_t value, const char* key, std::int64_t hi) {
    if (value < 1 || value > hi) {
      ctx.fail(
          YAML::Mark::null_mark(), std::string("runtime.") + key,
          std::to_string(value) + kOverridden + " is out of range [1, " + std::to_string(hi) + "]");
    }
    return value;
  };
  if (overrides.max_tokens) {
    runtime->max_tokens =
        in_range(*overrides.max_tokens, "max_tokens", std::numeric_limits<std::int64_t>::max());
  }
  if (overrides.max_sequences) {
    runtime->max_sequences = in_range(*overrides.max_sequences, "max_sequences", kMaxSequences);
  }
  if (overrides.workspace_plan) runtime->workspace_plan = *overrides.workspace_plan;
}

// The byte counts an engine for this spec will plan; each, and their sum, must fit in 64 bits.
void check_byte_counts(const Context& ctx, const ModelSpec& spec, const YAML::Node& runtime_node,
                       const YAML::Node& root, const RuntimeOverrides& overrides) {
  const std::uint64_t tokens = static_cast<std::uint64_t>(spec.runtime.max_tokens);
  const std::uint64_t heads = static_cast<std::uint64_t>(spec.num_heads);
  const std::uint64_t dim = static_cast<std::uint64_t>(spec.head_dim);
  const std::uint64_t seqs = static_cast<std::uint64_t>(spec.runtime.max_sequences);
  const std::uint64_t layers = static_cast<std::uint64_t>(spec.num_kda_layers());
  const std::uint64_t state_size = dtype_size(spec.runtime.state_dtype);
  // Point at the runtime value that makes the count overflow, or at the section (or top) when the
  // default is in effect; nowhere in the file for an override.
  auto mark_of = [&](const char* key, bool overridden) -> YAML::Mark {
    if (overridden) return YAML::Mark::null_mark();
    if (!runtime_node.IsDefined()) return root.Mark();
    const YAML::Node value = runtime_node[key];
    return value.IsDefined() ? value.Mark() : runtime_node.Mark();
  };
  auto note = [](bool overridden) { return std::string(overridden ? kOverridden : ""); };
  const std::string key = "runtime.max_tokens";

  std::uint64_t tensor_bytes = 0, state_pool = 0, all_pools = 0, total = 0;
  // One bf16 [max_tokens, H, D] tensor (q, k, v, g or out); six of them with beta rounded up.
  if (!checked_product({tokens, heads, dim, 2}, &tensor_bytes) ||
      !checked_mul(tensor_bytes, 6, &total)) {
    const bool overridden = overrides.max_tokens.has_value();
    ctx.fail(mark_of("max_tokens", overridden), key,
             "max_tokens " + std::to_string(tokens) + note(overridden) + " x num_heads " +
                 std::to_string(heads) + " x head_dim " + std::to_string(dim) +
                 " x 2 bytes overflows 64 bits",
             StatusCode::kOverflow);
  }
  if (!checked_product({seqs, heads, dim, dim, state_size}, &state_pool) ||
      !checked_mul(state_pool, layers, &all_pools) || !checked_add(total, all_pools, &total)) {
    const bool overridden = overrides.max_sequences.has_value();
    ctx.fail(mark_of("max_sequences", overridden), "runtime.max_sequences",
             "the state pools (max_sequences " + std::to_string(seqs) + note(overridden) +
                 " x num_heads " + std::to_string(heads) + " x head_dim^2 " + std::to_string(dim) +
                 "^2 x " + std::to_string(state_size) + " bytes x " + std::to_string(layers) +
                 " KDA layers) plus the inputs overflow 64 bits",
             StatusCode::kOverflow);
  }
}

}  // namespace

const char* to_string(BackendChoice choice) noexcept {
  switch (choice) {
    case BackendChoice::kAuto:
      return "auto";
    case BackendChoice::kCpu:
      return "cpu";
    case BackendChoice::kCuda:
      return "cuda";
  }
  return "unknown";
}

bool parse_backend_choice(const std::string& text, BackendChoice* choice) noexcept {
  if (choice == nullptr) return false;
  if (text == "auto")
    *choice = BackendChoice::kAuto;
  else if (text == "cpu")
    *choice = BackendChoice::kCpu;
  else if (text == "cuda")
    *choice = BackendChoice::kCuda;
  else
    return false;
  return true;
}

bool parse_prefill_schedule(const std::string& text, PrefillSchedule* schedule) noexcept {
  if (schedule == nullptr) return false;
  for (PrefillSchedule s :
       {PrefillSchedule::kAuto, PrefillSchedule::kTwoPhase, PrefillSchedule::kPipelined}) {
    if (text == to_string(s)) {
      *schedule = s;
      return true;
    }
  }
  return false;
}

const char* to_string(LayerMode mode) noexcept {
  return mode == LayerMode::kWhole ? "whole" : mode == LayerMode::kCoreOnly ? "core" : "unknown";
}

bool parse_layer_mode(const std::string& text, LayerMode* mode) noexcept {
  if (mode == nullptr) return false;
  if (text == "whole")
    *mode = LayerMode::kWhole;
  else if (text == "core")
    *mode = LayerMode::kCoreOnly;
  else
    return false;
  return true;
}

std::uint64_t ModelSpec::state_slot_bytes() const noexcept {
  return static_cast<std::uint64_t>(local_heads()) * static_cast<std::uint64_t>(head_dim) *
         static_cast<std::uint64_t>(head_dim) * dtype_size(runtime.state_dtype);
}

std::uint64_t ModelSpec::conv_state_slot_bytes() const noexcept {
  return static_cast<std::uint64_t>(local_heads()) * static_cast<std::uint64_t>(head_dim) *
         static_cast<std::uint64_t>(short_conv_kernel_size - 1) * sizeof(std::uint16_t);
}

ModelSpec parse_model_spec(const std::string& text, const std::string& source_name,
                           const std::string& base_dir, const ModelSpecOptions& options) {
  ModelSpec spec;
  const Context ctx(source_name, options.strict, &spec.warnings);
  const YAML::Node root = load_document(ctx, text);
  if (!root.IsDefined() || root.IsNull()) {
    ctx.fail(YAML::Mark::null_mark(), "", "empty model description (expected a map of keys)");
  }
  if (!root.IsMap())
    ctx.fail(root, "", "expected a map of keys at the top level, got " + describe(root));
  require_map(ctx, root, "");

  spec.source = source_name;
  try {
    check_top_level_keys(ctx, root);
    // name: optional; default is the file name without its extension.
    if (const YAML::Node name = optional(root, "name"); name.IsDefined()) {
      spec.name = as_string(ctx, name, "name");
      if (spec.name.empty()) ctx.fail(name, "name", "must not be empty");
    } else {
      spec.name = fs::path(source_name).stem().string();
      if (spec.name.empty()) spec.name = "model";
    }

    // model_type: a Hugging Face key; kimi_linear means the released model's gate by default.
    std::string model_type;
    if (const YAML::Node type = optional(root, "model_type"); type.IsDefined()) {
      model_type = as_string(ctx, type, "model_type");
    }

    spec.hidden_size = as_int_in(ctx, require(ctx, root, "", "hidden_size", kTopLevelKeys),
                                 "hidden_size", 1, kMaxHiddenSize);
    spec.num_hidden_layers =
        as_int_in(ctx, require(ctx, root, "", "num_hidden_layers", kTopLevelKeys),
                  "num_hidden_layers", 1, kMaxLayers);

    const YAML::Node attn = require(ctx, root, "", "linear_attn_config", kTopLevelKeys);
    require_map(ctx, attn, "linear_attn_config");
    const std::string a = "linear_attn_config";
    check_section_keys(ctx, attn, a, kLinearAttnKeys);
    spec.num_heads = as_int_in(ctx, require(ctx, attn, a, "num_heads", kLinearAttnKeys),
                               a + ".num_heads", 1, kMaxHeads);
    spec.head_dim = as_int_in(ctx, require(ctx, attn, a, "head_dim", kLinearAttnKeys),
                              a + ".head_dim", 1, kMaxHeadDim);
    if (const YAML::Node n = optional(attn, "short_conv_kernel_size"); n.IsDefined()) {
      spec.short_conv_kernel_size =
          as_int_in(ctx, n, a + ".short_conv_kernel_size", 1, kMaxConvKernel);
    }
    const YAML::Node kda_node = require(ctx, attn, a, "kda_layers", kLinearAttnKeys);
    spec.kda_layers = layer_list(ctx, kda_node, a + ".kda_layers", spec.num_hidden_layers);
    if (spec.kda_layers.empty())
      ctx.fail(kda_node, a + ".kda_layers", "must name at least one layer");
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

    const YAML::Node gate_node = optional(attn, "gate");
    const YAML::Node bound_node = optional(attn, "gate_lower_bound");
    if (gate_node.IsDefined()) {
      const std::string gate = as_string(ctx, gate_node, a + ".gate");
      if (gate == "softplus") {
        spec.gate = GateMode::kSoftplus;
      } else if (gate == "lower_bound") {
        spec.gate = GateMode::kLowerBound;
      } else {
        ctx.fail(gate_node, a + ".gate",
                 "unknown gate '" + gate + "' (expected softplus or lower_bound)");
      }
    } else if (model_type == "kimi_linear" && !bound_node.IsDefined()) {
      spec.gate =
          GateMode::kSoftplus;  // what the released Kimi-Linear checkpoints were trained with
    } else if (model_type == "kimi_linear") {
      ctx.fail(bound_node, a + ".gate",
               "required key is missing: gate_lower_bound is given, so say which gate it is "
               "(allowed values: softplus, the released Kimi-Linear's gate, or lower_bound)");
    } else {
      fail_missing(ctx, attn, a, "gate", kLinearAttnKeys,
                   " (allowed values: softplus, lower_bound; with model_type: kimi_linear it "
                   "defaults to softplus, the released model's gate)");
    }
    if (spec.gate == GateMode::kLowerBound && !bound_node.IsDefined()) {
      fail_missing(ctx, attn, a, "gate_lower_bound", kLinearAttnKeys,
                   " (required with gate: lower_bound; a value in [-5, 0))");
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

    if (const YAML::Node eps = optional(root, "rms_norm_eps"); eps.IsDefined()) {
      const double value = as_double(ctx, eps, "rms_norm_eps");
      if (!std::isfinite(value) || value <= 0.0 || !std::isfinite(static_cast<float>(value)) ||
          static_cast<float>(value) <= 0.0f) {
        std::ostringstream shown;
        shown << value;
        ctx.fail(eps, "rms_norm_eps", "value " + shown.str() + " is not a finite number > 0");
      }
      spec.rms_norm_eps = static_cast<float>(value);
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
      check_section_keys(ctx, runtime, r, kRuntimeKeys);
      if (const YAML::Node n = optional(runtime, "max_tokens"); n.IsDefined()) {
        spec.runtime.max_tokens =
            as_int_in(ctx, n, r + ".max_tokens", 1, std::numeric_limits<std::int64_t>::max());
      }
      if (const YAML::Node n = optional(runtime, "max_sequences"); n.IsDefined()) {
        spec.runtime.max_sequences = as_int_in(ctx, n, r + ".max_sequences", 1, kMaxSequences);
      }
      if (const YAML::Node n = optional(runtime, "state_dtype"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".state_dtype");
        if (value == "fp32")
          spec.runtime.state_dtype = DType::kF32;
        else if (value == "bf16")
          spec.runtime.state_dtype = DType::kBF16;
        else
          ctx.fail(n, r + ".state_dtype",
                   "unknown state dtype '" + value + "' (expected fp32 or bf16)");
      }
      if (const YAML::Node n = optional(runtime, "workspace_plan"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".workspace_plan");
        if (!planner::parse_plan_mode(value, &spec.runtime.workspace_plan)) {
          ctx.fail(n, r + ".workspace_plan",
                   "unknown plan '" + value + "' (expected sum or reuse)");
        }
      }
      if (const YAML::Node n = optional(runtime, "backend"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".backend");
        if (!parse_backend_choice(value, &spec.runtime.backend)) {
          ctx.fail(n, r + ".backend",
                   "unknown backend '" + value + "' (expected auto, cpu or cuda)");
        }
      }
      if (const YAML::Node n = optional(runtime, "prefill_schedule"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".prefill_schedule");
        if (!parse_prefill_schedule(value, &spec.runtime.prefill_schedule)) {
          ctx.fail(
              n, r + ".prefill_schedule",
              "unknown prefill schedule '" + value + "' (expected auto, two-phase or pipelined)");
        }
      }
      if (const YAML::Node n = optional(runtime, "layers"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".layers");
        if (!parse_layer_mode(value, &spec.runtime.layer_mode)) {
          ctx.fail(n, r + ".layers", "unknown layer mode '" + value + "' (expected whole or core)");
        }
      }
      const YAML::Node tp_size = optional(runtime, "tp_size");
      if (tp_size.IsDefined()) {
        spec.runtime.tp_size =
            static_cast<int>(as_int_in(ctx, tp_size, r + ".tp_size", 1, kMaxHeads));
        if (spec.num_heads % spec.runtime.tp_size != 0) {
          ctx.fail(tp_size, r + ".tp_size",
                   "tp_size " + std::to_string(spec.runtime.tp_size) +
                       " does not divide linear_attn_config.num_heads " +
                       std::to_string(spec.num_heads) +
                       " (each rank holds num_heads / tp_size heads)");
        }
      }
      if (const YAML::Node n = optional(runtime, "tp_rank"); n.IsDefined()) {
        spec.runtime.tp_rank =
            static_cast<int>(as_int_in(ctx, n, r + ".tp_rank", 0, spec.runtime.tp_size - 1));
      }
    }
    apply_runtime_overrides(ctx, options.runtime, &spec.runtime);
    check_byte_counts(ctx, spec, runtime, root, options.runtime);
  } catch (const YAML::Exception& e) {
    // Anything yaml-cpp itself rejects while we walk the tree (should not happen on a parsed tree).
    ctx.fail(e.mark, "", std::string("cannot read YAML: ") + e.what());
  }
  return spec;
}

ModelSpec load_model_spec(const std::string& path, const ModelSpecOptions& options) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": is a directory, expected a YAML/JSON model description");
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": " + file_failure("cannot open the model description", path, errno));
  }
  std::ostringstream text;
  errno = 0;
  text << in.rdbuf();
  if (in.bad()) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": " + file_failure("cannot read the model description", path, errno));
  }
  const fs::path parent = fs::path(path).parent_path();
  return parse_model_spec(text.str(), path, parent.empty() ? std::string(".") : parent.string(),
                          options);
}

}  // namespace kda::engine
