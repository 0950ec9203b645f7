// engine/model/src/bounded_json.hpp — internal: JSON read from a file the engine does not trust (a
// safetensors header, a checkpoint's index), refusing what nlohmann would take but a checked
// reader must not: a key twice in one object (nlohmann keeps the last), nesting or a number of
// values whose parsed tree would cost far more than the text (a 100 MB header of empty objects is
// gigabytes of nodes), and a zero byte (nlohmann stops reading there).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace kda::engine {

struct JsonBounds {
  int max_depth = 8;                                  // objects and arrays inside each other
  std::uint64_t max_values = std::uint64_t{1} << 22;  // values of any kind, containers included
};

// What parse_bounded_json refused beyond syntax, as a predicate for a message that names the text
// ("repeats the key 'q' in one object", "holds a zero byte at offset 12"); `key` is the repeated
// key where that is the refusal.
class JsonBoundsError : public std::runtime_error {
 public:
  JsonBoundsError(const std::string& what, std::string key)
      : std::runtime_error(what), key_(std::move(key)) {}
  const std::string& key() const noexcept { return key_; }

 private:
  std::string key_;
};

// `text` as JSON: a first pass (nlohmann's SAX reader: no tree) checks `bounds`, keys and zero
// bytes, then the tree is built. Throws JsonBoundsError for those, and nlohmann's own exceptions
// for its syntax and numbers, as nlohmann::json::parse does.
nlohmann::json parse_bounded_json(const std::string& text, const JsonBounds& bounds = {});

}  // namespace kda::engine
