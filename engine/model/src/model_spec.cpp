// engine/model/src/model_spec.cpp — YAML or JSON → ModelSpec with file:line:column errors that name
// the key, and warnings (with a suggested spelling) for unknown keys in the engine's own sections;
// a Hugging Face config read by its family's keys (model_family.hpp).
#include "kda/engine/model_spec.hpp"
#include "kda/detail/checked_math.hpp"

#include <yaml-cpp/depthguard.h>    // YAML::DeepRecursion (not in yaml.h)
#include <yaml-cpp/eventhandler.h>  // YAML::EventHandler (not in yaml.h)
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include "bounded_json.hpp"
#include "json_error.hpp"
#include "kda/engine/checkpoint.hpp"
#include "kda/engine/model_family.hpp"
#include "kda/error.hpp"
#include "kda/kda.hpp"
#include "text_file.hpp"

namespace kda::engine {

namespace {

namespace fs = std::filesystem;

// Limits that catch typos and absurd values long before any byte count overflows.
constexpr std::int64_t kMaxHiddenSize = 1 << 20;
constexpr std::int64_t kMaxLayers = 4096;
constexpr std::int64_t kMaxHeads = 1024;
constexpr std::int64_t kMaxHeadDim = 1024;
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

// The keys the engine reads: at the top level (a model's own keys in text_config when there is
// one), and in the two sections it owns. A family reads more (model_family.hpp).
const std::vector<std::string> kTopLevelKeys = {"name",
                                                "model_type",
                                                "hidden_size",
                                                "num_hidden_layers",
                                                "linear_attn_config",
                                                "weights",
                                                "runtime",
                                                "rms_norm_eps",
                                                "family",
                                                "tensor_prefix",
                                                "text_config",
                                                "architectures"};
// The model's keys: where text_config nests the text model's config, they are read there.
const std::vector<std::string> kModelKeys = {"model_type", "hidden_size", "num_hidden_layers",
                                             "linear_attn_config", "rms_norm_eps"};
const std::vector<std::string> kLinearAttnKeys = {
    "num_heads",        "head_dim", "short_conv_kernel_size", "kda_layers",
    "full_attn_layers", "gate",     "gate_lower_bound",       "use_full_rank_gate"};
const std::vector<std::string> kRuntimeKeys = {
    "max_tokens",     "max_sequences", "state_dtype", "workspace_plan",   "backend",
    "layers",         "tp_size",       "tp_rank",     "prefill_schedule", "max_verify_tokens",
    "record_regions", "decode_step"};

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
    // Decimal digits only, as JSON and YAML 1.2 read them: yaml-cpp would take "010" as octal 8
    // and "0x20" as 32.
    const std::string& text = node.Scalar();
    const std::size_t digits = text.size() > 1 && (text[0] == '-' || text[0] == '+') ? 1 : 0;
    const bool decimal = digits < text.size() &&
                         std::all_of(text.begin() + static_cast<std::ptrdiff_t>(digits), text.end(),
                                     [](char c) { return c >= '0' && c <= '9'; });
    if (decimal && text[digits] == '0' && text.size() > digits + 1) {
      ctx.fail(node, key,
               "expected a decimal integer, got '" + text +
                   "' (a leading zero: YAML 1.1 readers take it as octal)");
    }
    if (decimal) {
      try {
        return node.as<std::int64_t>();
      } catch (const YAML::Exception&) {
        // Falls through: one that does not fit in 64 bits.
      }
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
// a near-miss of an engine key of `keys` that is absent (`runtme` without `runtime`) is reported;
// `known`: the keys read there (never a near-miss). `map_key` names the map in messages.
void check_top_level_keys(const Context& ctx, const YAML::Node& map, const std::string& map_key,
                          const std::vector<std::string>& keys,
                          const std::vector<std::string>& known) {
  std::vector<std::string> absent;
  for (const std::string& key : keys) {
    if (!map[key].IsDefined()) absent.push_back(key);
  }
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it->first.IsScalar() || contains(known, it->first.Scalar())) continue;
    const std::string suggestion = closest(it->first.Scalar(), absent);
    if (!suggestion.empty()) {
      ctx.unknown_key(it->first, join_key(map_key, it->first.Scalar()),
                      "did you mean `" + suggestion + "`?");
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

// Takes a document's events and keeps only where the last one began: what second_document() needs
// of the parser.
class DocumentStarts final : public YAML::EventHandler {
 public:
  YAML::Mark start;
  void OnDocumentStart(const YAML::Mark& mark) override { start = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// Where a document after the first begins in `text`, if there is one (a second `---` document,
// or more after a JSON object's end). Not by YAML::LoadAll: yaml-cpp 0.7's never returns from
// some malformed texts (", 1", "[1], 2": it keeps taking empty documents that consume nothing),
// so the parser is asked for two documents at most.
std::optional<YAML::Mark> second_document(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts events;
  if (!parser.HandleNextDocument(events) || !parser.HandleNextDocument(events)) {
    return std::nullopt;
  }
  return events.start;
}

// Reads YAML, or JSON: yaml-cpp reads nearly all JSON with positions kept; what it rejects (a
// surrogate-pair escape, as JSON writes an emoji) is read again as JSON, and a text that is JSON to
// neither is reported with the JSON parser's message, which is the one that names the problem.
YAML::Node load_document(const Context& ctx, const std::string& text) {
  // YAML and JSON text has no control characters but tab, line feed and carriage return, and
  // yaml-cpp stops reading at a zero byte. (A file's zero bytes were refused as it was read.)
  const auto control = std::find_if(text.begin(), text.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return (byte < 0x20 && c != '\t' && c != '\n' && c != '\r') || byte == 0x7f;
  });
  if (control != text.end()) {
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02x", static_cast<unsigned char>(*control));
    ctx.fail(mark_at(text, static_cast<std::size_t>(control - text.begin())), "",
             std::string("holds a control character (byte ") + hex + "), not YAML or JSON text");
  }
  try {
    YAML::Node document = YAML::Load(text);
    // Text after the first document is refused rather than ignored (after an empty one, the
    // empty description is the error).
    if (document.IsNull()) return document;
    if (const std::optional<YAML::Mark> second = second_document(text)) {
      ctx.fail(*second, "",
               "text after the model description (a second YAML document, or more after the "
               "JSON object's end): a description is one document");
    }
    return document;
  } catch (const YAML::Exception& e) {
    if (looks_like_json(text)) {
      try {
        // A key twice in one object: refused, as the YAML reader does (nlohmann would keep the
        // last value); marked at the key's second spelling where it is written plainly.
        nlohmann::json parsed;
        try {
          parsed = parse_bounded_json(text, JsonBounds{64});
        } catch (const JsonBoundsError& bounds) {
          if (bounds.key().empty())
            ctx.fail(mark_at(text, 0), "", std::string("JSON ") + bounds.what());
          const std::string quoted = "\"" + bounds.key() + "\"";
          std::size_t at = text.find(quoted);
          at = at == std::string::npos ? 0 : text.find(quoted, at + 1);
          ctx.fail(mark_at(text, at == std::string::npos ? 0 : at), bounds.key(),
                   "key appears twice");
        }
        return yaml_from_json(ctx, parsed);
      } catch (const nlohmann::json::parse_error& json_error) {
        // "parse error at line 1, column 12: syntax error ...": the mark gives the position.
        std::string what = json_error_text(json_error);
        const std::size_t colon = what.find(": ");
        if (colon != std::string::npos) what = what.substr(colon + 2);
        const std::size_t at = json_error.byte > 0 ? json_error.byte - 1 : 0;
        const bool says_syntax = what.rfind("syntax error", 0) == 0;
        ctx.fail(mark_at(text, at), "",
                 says_syntax ? "JSON " + what : "JSON syntax error: " + what);
      } catch (const nlohmann::json::exception& json_error) {
        // Not a syntax error: a number too large for a double ("number overflow parsing
        // '1e705'"), ... . Reported at the quoted text when it is found.
        const std::string what = json_error_text(json_error);
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
    if (dynamic_cast<const YAML::DeepRecursion*>(&e) != nullptr) {
      // yaml-cpp's own words for it are "bad file".
      ctx.fail(e.mark, "",
               "YAML nested deeper than the reader takes (about 500 levels): a model description "
               "nests a few");
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
  if (overrides.state_dtype) {
    if (*overrides.state_dtype != DType::kF32 && *overrides.state_dtype != DType::kBF16) {
      ctx.fail(
          YAML::Mark::null_mark(), "runtime.state_dtype",
          std::string(to_string(*overrides.state_dtype)) + kOverridden + " is not fp32 or bf16");
    }
    runtime->state_dtype = *overrides.state_dtype;
  }
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

// ---- a model's config, read by its family's keys ----------------------------------------------

const YAML::Node kAbsent(YAML::NodeType::Undefined);

// A key path ('.' between map keys) in a config map. Built once and never assigned: assigning a
// YAML::Node that refers to a node rewrites the node.
struct Found {
  YAML::Node node;         // undefined when absent (a key written with no value counts as absent)
  YAML::Node parent;       // the map that holds (or would hold) the last key; undefined when none
  std::string key;         // as messages name it: "text_config.linear_attn_config.num_heads"
  std::string leaf;        // the last key
  std::string parent_key;  // the parent map as messages name it
  bool null = false;       // written with a null value (`null`, `~` or nothing)
};

// A key path not looked up (a family without the key): absent.
Found not_read() { return Found{kAbsent, kAbsent, "", "", "", false}; }

Found find_path(const YAML::Node& map, const std::string& map_key, const std::string& path) {
  const std::size_t dot = path.find('.');
  if (dot == std::string::npos) {
    const YAML::Node raw = map.IsMap() ? map[path] : kAbsent;
    const bool null = raw.IsDefined() && raw.IsNull();
    return Found{null ? kAbsent : raw, map, join_key(map_key, path), path, map_key, null};
  }
  const std::string head = path.substr(0, dot);
  const YAML::Node child = map.IsMap() ? map[head] : kAbsent;
  if (!child.IsDefined() || !child.IsMap()) {
    const std::size_t last = path.rfind('.');
    return Found{kAbsent,
                 kAbsent,
                 join_key(map_key, path),
                 path.substr(last + 1),
                 join_key(map_key, path.substr(0, last)),
                 false};
  }
  return find_path(child, join_key(map_key, head), path.substr(dot + 1));
}

// The first of `paths` present (`node` undefined when none is).
Found find_first(const YAML::Node& map, const std::string& map_key,
                 const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    const Found found = find_path(map, map_key, path);
    if (found.node.IsDefined()) return found;
  }
  return find_path(map, map_key, paths.front());
}

// " (looked for a, then b)" for a value read from one of several keys; empty for one key.
std::string looked_for(const std::string& map_key, const std::vector<std::string>& paths) {
  if (paths.size() < 2) return {};
  std::string text;
  for (const std::string& path : paths) {
    text += (text.empty() ? "" : ", then ") + join_key(map_key, path);
  }
  return " (looked for " + text + ")";
}

// The first of `paths` present; else an error naming them all, at the map of the first whose map
// exists (with the near-miss found there, as fail_missing reports it).
Found require_first(const Context& ctx, const YAML::Node& map, const std::string& map_key,
                    const std::vector<std::string>& paths, const std::vector<std::string>& known,
                    const std::string& note = {}) {
  const Found found = find_first(map, map_key, paths);
  if (found.node.IsDefined()) return found;
  const std::string why = looked_for(map_key, paths) + note;
  for (const std::string& path : paths) {
    const Found at = find_path(map, map_key, path);
    if (at.parent.IsDefined()) fail_missing(ctx, at.parent, at.parent_key, at.leaf, known, why);
  }
  ctx.fail(map, join_key(map_key, paths.front()), "required key is missing" + why);
}

bool as_bool(const Context& ctx, const YAML::Node& node, const std::string& key) {
  if (is_plain_scalar(node)) {
    const std::string& text = node.Scalar();
    if (text == "true" || text == "True" || text == "TRUE") return true;
    if (text == "false" || text == "False" || text == "FALSE") return false;
  }
  ctx.fail(node, key, "expected true or false, got " + describe(node));
}

// A lower bound: finite, in [-5, 0), as written and as the float the layers take (-1e-300 is
// below 0 but rounds to -0). The message shows the value as written.
float gate_bound(const Context& ctx, const Found& found) {
  float used = 0.0f;
  const Status st = lower_bound_from_double(as_double(ctx, found.node, found.key), &used);
  if (!st.ok())
    ctx.fail(found.node, found.key, "value " + found.node.Scalar() + " is " + st.message());
  return used;
}

// The KDA layers of a `layer_types` list (one string per layer, "linear_attention" or
// "kda_attention" for KDA, any other for full attention), 1-based; the others into `full`.
std::vector<int> layers_of_types(const Context& ctx, const Found& found, std::int64_t num_layers,
                                 std::vector<int>* full) {
  const YAML::Node& list = found.node;
  if (!list.IsSequence()) {
    ctx.fail(list, found.key, "expected a list of layer types, got " + describe(list));
  }
  if (static_cast<std::int64_t>(list.size()) != num_layers) {
    ctx.fail(list, found.key,
             "has " + std::to_string(list.size()) + " entries, expected num_hidden_layers " +
                 std::to_string(num_layers) + " (one per layer)");
  }
  std::vector<int> kda;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string entry = found.key + "[" + std::to_string(i) + "]";
    const std::string type = as_string(ctx, list[i], entry);
    // A layer type is a word; a number or a boolean in the list is a mistake, not a full-attention
    // layer.
    char* end = nullptr;
    const bool number = !type.empty() && (std::strtod(type.c_str(), &end), *end == '\0');
    if (number || type == "true" || type == "false" || type.empty()) {
      ctx.fail(list[i], entry,
               "expected a layer type such as \"linear_attention\" or \"full_attention\", got '" +
                   type + "'");
    }
    const int layer = static_cast<int>(i) + 1;
    if (type == "linear_attention" || type == "kda_attention") {
      kda.push_back(layer);
    } else {
      full->push_back(layer);
    }
  }
  if (kda.empty()) {
    ctx.fail(list, found.key, "names no KDA layer (linear_attention or kda_attention)");
  }
  return kda;
}

// Where the model's keys are read: a config's top level and its text config (text_config when it
// has one, else the top level), with the context that names their file.
struct ModelConfig {
  const Context& ctx;
  const YAML::Node& top;
  const YAML::Node& text;
  std::string text_key;  // "text_config" or ""
};

// The family a description names: its `family:` key, else the config's model_type, architectures
// or text_config.model_type. Unknown values are refused, naming what was looked for; nullptr when
// none of the keys is there.
const ModelFamily* named_family(const Context& ctx, const YAML::Node& root, const ModelConfig& m,
                                std::string* how) {
  if (const YAML::Node key = optional(root, "family"); key.IsDefined()) {
    const std::string value = as_string(ctx, key, "family");
    const ModelFamily* family = family_by_key(value);
    if (family == nullptr) {
      ctx.fail(key, "family", "unknown family '" + value + "' (known: " + family_keys_text() + ")");
    }
    *how = "family: " + value;
    return family;
  }
  auto by_model_type = [&](const YAML::Node& node, const std::string& key) {
    const std::string value = as_string(m.ctx, node, key);
    const ModelFamily* family = family_by_model_type(value);
    if (family == nullptr) {
      m.ctx.fail(
          node, key,
          "'" + value + "' is not a model family the engine knows (it looks for model_type " +
              family_model_types_text() + "; `family:` " + family_keys_text() + " names one)");
    }
    *how = key + " " + value;
    return family;
  };
  if (const YAML::Node type = optional(m.top, "model_type"); type.IsDefined()) {
    return by_model_type(type, "model_type");
  }
  if (const YAML::Node list = optional(m.top, "architectures"); list.IsDefined()) {
    if (!list.IsSequence()) {
      m.ctx.fail(list, "architectures", "expected a list of strings, got " + describe(list));
    }
    std::string seen;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string value =
          as_string(m.ctx, list[i], "architectures[" + std::to_string(i) + "]");
      if (const ModelFamily* family = family_by_architecture(value)) {
        *how = "architectures " + value;
        return family;
      }
      seen += (seen.empty() ? "" : ", ") + value;
    }
    m.ctx.fail(list, "architectures",
               "[" + seen + "] names no model family the engine knows (it looks for " +
                   family_architectures_text() + ", and model_type " + family_model_types_text() +
                   "; `family:` " + family_keys_text() + " names one)");
  }
  if (!m.text_key.empty()) {
    if (const YAML::Node type = optional(m.text, "model_type"); type.IsDefined()) {
      return by_model_type(type, join_key(m.text_key, "model_type"));
    }
  }
  return nullptr;
}

// The tensor names of the checkpoint `weights` names, when it is there to be read; empty
// otherwise (the engine reports a missing or unreadable checkpoint when it loads it).
std::vector<std::string> checkpoint_tensor_names(const std::string& weights) {
  if (weights.empty()) return {};
  std::error_code ec;
  const fs::path path(weights);
  if (fs::is_directory(path, ec) && !fs::exists(path / "model.safetensors.index.json", ec) &&
      !fs::exists(path / "model.safetensors", ec)) {
    return {};
  }
  if (!fs::exists(path, ec)) return {};
  try {
    return Checkpoint::open(weights).tensor_names();
  } catch (const Error&) {
    return {};
  }
}

// The keys of the linear_attn_config section: the engine's and the family's. A family that takes
// the output gate's form from the checkpoint alone (GLM) does not read use_full_rank_gate: there
// the key is unknown (a warning, an error when strict), not silently ignored.
std::vector<std::string> linear_attn_keys(const ModelFamily* family) {
  std::vector<std::string> keys = kLinearAttnKeys;
  if (family == nullptr) return keys;
  if (family->full_rank_gate.empty()) {
    keys.erase(std::remove(keys.begin(), keys.end(), "use_full_rank_gate"), keys.end());
  }
  const std::string section = "linear_attn_config.";
  for (const std::vector<std::string>* paths :
       {&family->num_heads, &family->head_dim, &family->conv_kernel, &family->kda_layers,
        &family->full_attn_layers, &family->gate_bound}) {
    for (const std::string& path : *paths) {
      if (path.rfind(section, 0) == 0 && !contains(keys, path.substr(section.size()))) {
        keys.push_back(path.substr(section.size()));
      }
    }
  }
  for (const std::string& path : {family->safe_gate, family->full_rank_gate}) {
    if (path.rfind(section, 0) == 0 && !contains(keys, path.substr(section.size()))) {
      keys.push_back(path.substr(section.size()));
    }
  }
  return keys;
}

// The keys read at the text config's top level: the engine's and the family's.
std::vector<std::string> text_keys(const ModelFamily* family) {
  std::vector<std::string> keys = kTopLevelKeys;
  if (family == nullptr) return keys;
  for (const std::vector<std::string>* paths :
       {&family->num_heads, &family->head_dim, &family->conv_kernel, &family->kda_layers,
        &family->full_attn_layers, &family->gate_bound}) {
    for (const std::string& path : *paths) {
      if (path.find('.') == std::string::npos && !contains(keys, path)) keys.push_back(path);
    }
  }
  return keys;
}

// The gate: the engine's `gate:` key when given, else the family's rule (GateRule).
void read_gate(const ModelConfig& m, const ModelFamily& keys, const ModelFamily* family,
               const std::vector<std::string>& known, ModelSpec* spec) {
  const Context& ctx = m.ctx;
  const Found gate = find_path(m.text, m.text_key, "linear_attn_config.gate");
  const Found bound = find_first(m.text, m.text_key, keys.gate_bound);
  if (gate.node.IsDefined()) {
    const std::string value = as_string(ctx, gate.node, gate.key);
    if (value == "softplus") {
      spec->gate = GateMode::kSoftplus;
    } else if (value == "lower_bound") {
      spec->gate = GateMode::kLowerBound;
    } else {
      ctx.fail(gate.node, gate.key,
               "unknown gate '" + value + "' (expected softplus or lower_bound)");
    }
    if (spec->gate == GateMode::kLowerBound) {
      const Found given = require_first(ctx, m.text, m.text_key, keys.gate_bound, known,
                                        " (required with gate: lower_bound; a value in [-5, 0))");
      spec->gate_lower_bound = gate_bound(ctx, given);
    } else if (bound.node.IsDefined()) {
      spec->gate_lower_bound = gate_bound(ctx, bound);  // checked the same way, unused
    }
    return;
  }
  if (family == nullptr) {
    require_first(ctx, m.text, m.text_key, {"linear_attn_config.gate"}, known,
                  " (allowed values: softplus, lower_bound; with model_type: kimi_linear it "
                  "defaults to softplus, the released model's gate)");
    return;
  }
  switch (family->gate) {
    case GateRule::kSoftplusUnlessSaid:
      if (bound.node.IsDefined()) {
        ctx.fail(bound.node, gate.key,
                 "required key is missing: " + bound.leaf +
                     " is given, so say which gate it is (allowed values: softplus, the "
                     "released " +
                     family->name + "'s gate, or lower_bound)");
      }
      spec->gate = GateMode::kSoftplus;
      return;
    case GateRule::kBoundedWhenGiven:
      spec->gate = bound.node.IsDefined() ? GateMode::kLowerBound : GateMode::kSoftplus;
      if (bound.node.IsDefined()) spec->gate_lower_bound = gate_bound(ctx, bound);
      return;
    case GateRule::kBoundedByDefault: {
      // The first bound key written, a null one included: null is the unbounded gate.
      for (const std::string& path : keys.gate_bound) {
        const Found written = find_path(m.text, m.text_key, path);
        if (written.node.IsDefined()) {
          spec->gate = GateMode::kLowerBound;
          spec->gate_lower_bound = gate_bound(ctx, written);
          return;
        }
        if (written.null) {
          const Found safe =
              keys.safe_gate.empty() ? not_read() : find_path(m.text, m.text_key, keys.safe_gate);
          const bool bounded = safe.node.IsDefined() && as_bool(ctx, safe.node, safe.key);
          spec->gate = bounded ? GateMode::kLowerBound : GateMode::kSoftplus;
          spec->gate_lower_bound = -5.0f;
          return;
        }
      }
      if (!keys.safe_gate.empty()) {  // read for its type, whatever it says
        const Found safe = find_path(m.text, m.text_key, keys.safe_gate);
        if (safe.node.IsDefined()) as_bool(ctx, safe.node, safe.key);
      }
      spec->gate = GateMode::kLowerBound;
      spec->gate_lower_bound = -5.0f;
      return;
    }
  }
}

// The model's part of a spec: sizes, KDA layers, gate, output gate form, tensor prefix. `family`:
// what the description names (nullptr: the engine's own schema); `tensor_names`: the checkpoint's,
// for what the config does not say; `tensor_prefix`: the description's (empty: none).
void read_model(const ModelConfig& m, const ModelFamily* family,
                const std::vector<std::string>& tensor_names, const std::string& tensor_prefix,
                ModelSpec* spec) {
  const Context& ctx = m.ctx;
  // The engine's own schema reads Kimi-Linear's linear_attn_config keys, and only those.
  ModelFamily keys = family != nullptr ? *family : *family_by_key("kimi-linear");
  if (family == nullptr) {
    for (std::vector<std::string>* paths :
         {&keys.num_heads, &keys.head_dim, &keys.conv_kernel, &keys.kda_layers}) {
      paths->resize(1);
    }
  }
  const std::vector<std::string> attn_keys = linear_attn_keys(family);
  std::vector<std::string> known = text_keys(family);
  known.insert(known.end(), attn_keys.begin(), attn_keys.end());

  spec->hidden_size =
      as_int_in(ctx, require_first(ctx, m.text, m.text_key, {"hidden_size"}, known).node,
                join_key(m.text_key, "hidden_size"), 1, kMaxHiddenSize);
  spec->num_hidden_layers =
      as_int_in(ctx, require_first(ctx, m.text, m.text_key, {"num_hidden_layers"}, known).node,
                join_key(m.text_key, "num_hidden_layers"), 1, kMaxLayers);

  const std::string a = join_key(m.text_key, "linear_attn_config");
  const YAML::Node attn =
      family == nullptr ? require_first(ctx, m.text, m.text_key, {"linear_attn_config"}, known).node
                        : optional(m.text, "linear_attn_config");
  if (attn.IsDefined()) {
    require_map(ctx, attn, a);
    check_section_keys(ctx, attn, a, attn_keys);
  }

  const Found heads = require_first(ctx, m.text, m.text_key, keys.num_heads, known);
  spec->num_heads = as_int_in(ctx, heads.node, heads.key, 1, kMaxHeads);
  const Found dim = require_first(ctx, m.text, m.text_key, keys.head_dim, known);
  spec->head_dim = as_int_in(ctx, dim.node, dim.key, 1, kMaxHeadDim);
  if (const Found conv = find_first(m.text, m.text_key, keys.conv_kernel); conv.node.IsDefined()) {
    spec->short_conv_kernel_size = as_int_in(ctx, conv.node, conv.key, 1, layer::kMaxConvWidth);
  }

  // KDA layers: a 1-based list (with its full-attention list) or layer_types, or the family's
  // default pattern.
  const Found layers = find_first(m.text, m.text_key, keys.kda_layers);
  if (layers.node.IsDefined() && layers.leaf == "layer_types") {
    spec->kda_layers =
        layers_of_types(ctx, layers, spec->num_hidden_layers, &spec->full_attn_layers);
  } else if (layers.node.IsDefined()) {
    spec->kda_layers = layer_list(ctx, layers.node, layers.key, spec->num_hidden_layers);
    if (spec->kda_layers.empty()) ctx.fail(layers.node, layers.key, "must name at least one layer");
    if (const Found full = find_first(m.text, m.text_key, keys.full_attn_layers);
        full.node.IsDefined()) {
      spec->full_attn_layers = layer_list(ctx, full.node, full.key, spec->num_hidden_layers);
      for (std::size_t i = 0; i < full.node.size(); ++i) {
        const int layer = static_cast<int>(full.node[i].as<std::int64_t>());
        if (std::binary_search(spec->kda_layers.begin(), spec->kda_layers.end(), layer)) {
          ctx.fail(full.node[i], full.key + "[" + std::to_string(i) + "]",
                   "layer " + std::to_string(layer) + " is also listed in kda_layers");
        }
      }
    }
  } else if (keys.every_fourth_full_attention) {
    for (int i = 0; i < spec->num_hidden_layers; ++i) {
      (i % 4 == 3 ? spec->full_attn_layers : spec->kda_layers).push_back(i + 1);
    }
  } else {
    require_first(ctx, m.text, m.text_key, keys.kda_layers, known);
  }
  for (const int layer : spec->kda_layers) spec->kda_layer_indices.push_back(layer - 1);

  read_gate(m, keys, family, known, spec);

  if (const YAML::Node eps = optional(m.text, "rms_norm_eps"); eps.IsDefined()) {
    const std::string key = join_key(m.text_key, "rms_norm_eps");
    const double value = as_double(ctx, eps, key);
    if (!std::isfinite(value) || value <= 0.0 || !std::isfinite(static_cast<float>(value)) ||
        static_cast<float>(value) <= 0.0f) {
      std::ostringstream shown;
      shown << value;
      ctx.fail(eps, key,
               "value " + shown.str() + " is not a finite number > 0" +
                   (std::isfinite(value) && value > 0.0 ? " (as a float it is 0)" : ""));
    }
    spec->rms_norm_eps = static_cast<float>(value);
  }

  // The tensor prefix: the description's `tensor_prefix:`, else the family's (the one of its
  // prefixes the checkpoint uses), else what the checkpoint's names show, else Kimi-Linear's.
  const int first = spec->kda_layer_indices.front();
  if (!tensor_prefix.empty()) {
    spec->tensor_prefix = tensor_prefix;
  } else if (family != nullptr) {
    const std::string used = prefix_holding(tensor_names, family->tensor_prefixes, first, "A_log");
    spec->tensor_prefix = used.empty() ? family->tensor_prefixes.front() : used;
  } else if (const std::vector<const ModelFamily*> found =
                 families_holding(tensor_names, first, "A_log");
             found.size() == 1) {
    spec->family = found.front()->name;
    spec->family_source = "the checkpoint's tensor names";
    spec->tensor_prefix =
        prefix_holding(tensor_names, found.front()->tensor_prefixes, first, "A_log");
  }

  // The output gate's form: the config's key, else whether the checkpoint has g_proj.
  const Found full_rank =
      keys.full_rank_gate.empty() ? not_read() : find_path(m.text, m.text_key, keys.full_rank_gate);
  if (full_rank.node.IsDefined()) {
    spec->full_rank_gate = as_bool(ctx, full_rank.node, full_rank.key);
  } else {
    spec->full_rank_gate =
        std::binary_search(tensor_names.begin(), tensor_names.end(),
                           expand_tensor_prefix(spec->tensor_prefix, first) + "g_proj.weight");
  }
}

// The first of a model's keys a description holds, or "" for none (then the folder `weights`
// names may give them, in its config.json): the engine's model keys, the wrapper's, and any
// family's top-level keys (a description that gives some of them gives them all, rather than have
// them ignored).
std::string first_model_key(const YAML::Node& root) {
  for (const std::string& key : kModelKeys) {
    if (root[key].IsDefined()) return key;
  }
  for (const char* key : {"text_config", "architectures"}) {
    if (root[key].IsDefined()) return key;
  }
  for (const ModelFamily& family : model_families()) {
    for (const std::string& key : text_keys(&family)) {
      if (!contains(kTopLevelKeys, key) && root[key].IsDefined()) return key;
    }
  }
  return "";
}

// The text of a model description or a config.json (read_text_file), with what such a file is
// when it is too long or binary.
std::string read_description_text(const std::string& path, const char* what) {
  return read_text_file(path, what,
                        "it should be a YAML or JSON text of a few KB; a checkpoint's weights are "
                        "named by the description's `weights` key, or found in its folder");
}

// A YAML or JSON document that is a map with unique keys.
YAML::Node load_map(const Context& ctx, const std::string& text) {
  const YAML::Node root = load_document(ctx, text);
  if (!root.IsDefined() || root.IsNull()) {
    ctx.fail(YAML::Mark::null_mark(), "", "empty model description (expected a map of keys)");
  }
  if (!root.IsMap())
    ctx.fail(root, "", "expected a map of keys at the top level, got " + describe(root));
  require_map(ctx, root, "");
  return root;
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

bool parse_state_dtype(const std::string& text, DType* dtype) noexcept {
  if (dtype == nullptr) return false;
  if (text == "fp32") {
    *dtype = DType::kF32;
  } else if (text == "bf16") {
    *dtype = DType::kBF16;
  } else {
    return false;
  }
  return true;
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

namespace {

// Reads a description. `folder`: the Hugging Face folder whose config.json `text` is (its weights
// and its name), or empty.
ModelSpec parse_description(const std::string& text, const std::string& source_name,
                            const std::string& base_dir, const ModelSpecOptions& options,
                            const std::string& folder) {
  ModelSpec spec;
  const Context ctx(source_name, options.strict, &spec.warnings);
  const YAML::Node root = load_map(ctx, text);
  spec.source = source_name;
  try {
    // name: optional; default: the folder's name, else the file's without extension (a
    // config.json's folder).
    if (const YAML::Node name = optional(root, "name"); name.IsDefined()) {
      spec.name = as_string(ctx, name, "name");
      if (spec.name.empty()) ctx.fail(name, "name", "must not be empty");
    } else {
      std::error_code ec;
      fs::path named = folder.empty() ? fs::path(source_name) : fs::absolute(folder, ec);
      if (!folder.empty() || named.filename() == "config.json") {
        named = folder.empty() ? named.parent_path() : named.lexically_normal();
        if (named.filename().empty()) named = named.parent_path();
        spec.name = named.filename().string();
      } else {
        spec.name = named.stem().string();
      }
      if (spec.name.empty()) spec.name = "model";
    }

    const YAML::Node weights = optional(root, "weights");
    if (weights.IsDefined()) {
      const std::string path = as_string(ctx, weights, "weights");
      if (path.empty()) ctx.fail(weights, "weights", "must not be empty");
      fs::path resolved(path);
      if (resolved.is_relative() && !base_dir.empty()) resolved = fs::path(base_dir) / resolved;
      spec.weights = resolved.lexically_normal().string();
    } else if (!folder.empty()) {
      spec.weights = folder;
    }

    // The model's keys: this description's, or (when it has none) the config.json of the folder
    // its `weights` names.
    std::error_code ec;
    const fs::path folder_config = fs::path(spec.weights) / "config.json";
    const bool folder_has_config =
        weights.IsDefined() && fs::is_directory(spec.weights, ec) && fs::exists(folder_config, ec);
    const std::string model_key = first_model_key(root);
    const bool from_folder = folder_has_config && model_key.empty();
    if (folder_has_config && !model_key.empty() && !root["hidden_size"].IsDefined() &&
        !root["text_config"].IsDefined()) {
      // Some of the model's keys here, the rest in the folder's config.json: the description
      // would be read alone and those keys not merged, so say so rather than "hidden_size is
      // missing".
      ctx.fail(root[model_key], model_key,
               "a description whose weights name a Hugging Face folder takes the model's keys from "
               "its config.json, or every one of them from here (hidden_size is not); remove " +
                   model_key + " or give the model's keys here");
    }
    const Context config_ctx(from_folder ? folder_config.string() : source_name, options.strict,
                             &spec.warnings);
    const Context& mctx = from_folder ? config_ctx : ctx;
    const YAML::Node top =
        from_folder ? load_map(config_ctx, read_description_text(folder_config.string(),
                                                                 "the model's config.json"))
                    : root;
    const YAML::Node text_config = optional(top, "text_config");
    if (text_config.IsDefined()) require_map(mctx, text_config, "text_config");
    const YAML::Node& text_node = text_config.IsDefined() ? text_config : top;
    const ModelConfig m{mctx, top, text_node, text_config.IsDefined() ? "text_config" : ""};

    std::string how;
    const ModelFamily* family = named_family(ctx, root, m, &how);
    if (family != nullptr) {
      spec.family = family->name;
      spec.family_source = how;
    }

    // Near-misses of absent engine keys, where each is read: the description's own keys in it,
    // the wrapper's at the config's top level, the model's in its text config.
    const std::vector<std::string> known = text_keys(family);
    auto check_map = [&](const Context& c, const YAML::Node& map, const std::string& map_key,
                         bool description, bool wrapper, bool model) {
      std::vector<std::string> candidates;
      for (const std::string& key : kTopLevelKeys) {
        const bool model_key = contains(kModelKeys, key);
        const bool wrapper_key =
            key == "model_type" || key == "architectures" || key == "text_config";
        if ((model && model_key) || (wrapper && wrapper_key) ||
            (description && !model_key && !wrapper_key)) {
          candidates.push_back(key);
        }
      }
      check_top_level_keys(c, map, map_key, candidates, known);
    };
    check_map(ctx, root, "", true, !from_folder, !from_folder && !text_config.IsDefined());
    if (from_folder) check_map(mctx, top, "", false, true, !text_config.IsDefined());
    if (text_config.IsDefined()) check_map(mctx, text_config, "text_config", false, false, true);

    std::string tensor_prefix;
    if (const YAML::Node prefix = optional(root, "tensor_prefix"); prefix.IsDefined()) {
      tensor_prefix = as_string(ctx, prefix, "tensor_prefix");
      const std::size_t hole = tensor_prefix.find("{i}");
      if (hole == std::string::npos || tensor_prefix.find("{i}", hole + 1) != std::string::npos) {
        ctx.fail(prefix, "tensor_prefix",
                 "'" + tensor_prefix +
                     "' must hold {i} once, where the 0-based model layer goes (e.g. "
                     "model.layers.{i}.self_attn.)");
      }
    }
    read_model(m, family, checkpoint_tensor_names(spec.weights), tensor_prefix, &spec);

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
      if (const YAML::Node n = optional(runtime, "max_verify_tokens"); n.IsDefined()) {
        spec.runtime.max_verify_tokens =
            as_int_in(ctx, n, r + ".max_verify_tokens", 0, kMaxDecodeTokens);
      }
      if (const YAML::Node n = optional(runtime, "record_regions"); n.IsDefined()) {
        spec.runtime.record_regions =
            static_cast<int>(as_int_in(ctx, n, r + ".record_regions", 1, 2));
      }
      if (const YAML::Node n = optional(runtime, "state_dtype"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".state_dtype");
        if (!parse_state_dtype(value, &spec.runtime.state_dtype)) {
          ctx.fail(n, r + ".state_dtype",
                   "unknown state dtype '" + value + "' (expected fp32 or bf16)");
        }
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
      if (const YAML::Node n = optional(runtime, "decode_step"); n.IsDefined()) {
        const std::string value = as_string(ctx, n, r + ".decode_step");
        if (!layer::parse_decode_kernel(value, &spec.runtime.decode_step)) {
          ctx.fail(n, r + ".decode_step",
                   "unknown decode step '" + value +
                       "' (expected auto, one-launch, fused, fused-after-gemms or separate)");
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

}  // namespace

ModelSpec parse_model_spec(const std::string& text, const std::string& source_name,
                           const std::string& base_dir, const ModelSpecOptions& options) {
  return parse_description(text, source_name, base_dir, options, {});
}

ModelSpec load_model_spec(const std::string& path, const ModelSpecOptions& options) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    // A Hugging Face model folder: its config.json describes it, its checkpoint is its weights.
    const fs::path config = fs::path(path) / "config.json";
    if (!fs::exists(config, ec)) {
      throw Error(StatusCode::kInvalidArgument,
                  path +
                      ": is a directory without config.json (a Hugging Face model folder holds "
                      "config.json and its weights, model.safetensors or "
                      "model.safetensors.index.json; a model description is a YAML/JSON file)");
    }
    return parse_description(read_description_text(config.string(), "the model's config.json"),
                             config.string(), path, options, path);
  }
  const std::string text = read_description_text(path, "the model description");
  const fs::path parent = fs::path(path).parent_path();
  return parse_description(text, path, parent.empty() ? std::string(".") : parent.string(), options,
                           {});
}

}  // namespace kda::engine
