// engine/model/src/bounded_json.cpp — see bounded_json.hpp.
#include "bounded_json.hpp"

#include <set>
#include <vector>

namespace kda::engine {

namespace {

using json = nlohmann::json;

// nlohmann's SAX interface: counts values, tracks depth and each open object's keys, and stops
// at the first thing refused (`refusal` then says what) or at a syntax error (left to the second
// pass, whose exception names its position).
class BoundsCheck {
 public:
  explicit BoundsCheck(const JsonBounds& bounds) : bounds_(bounds) {}
  std::string refusal, repeated_key;

  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(json::number_integer_t) { return value(); }
  bool number_unsigned(json::number_unsigned_t) { return value(); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(); }
  bool string(json::string_t&) { return value(); }
  bool binary(json::binary_t&) { return value(); }
  bool start_object(std::size_t) {
    keys_.emplace_back();
    return value() && open();
  }
  bool key(json::string_t& name) {
    if (keys_.back().insert(name).second) return true;
    repeated_key = name;
    refusal = "repeats the key '" + name + "' in one object";
    return false;
  }
  bool end_object() {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) { return value() && open(); }
  bool end_array() {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

 private:
  bool value() {
    if (++values_ <= bounds_.max_values) return true;
    refusal = "holds more than " + std::to_string(bounds_.max_values) + " values";
    return false;
  }
  bool open() {
    if (++depth_ <= bounds_.max_depth) return true;
    refusal = "nests objects and arrays more than " + std::to_string(bounds_.max_depth) + " deep";
    return false;
  }
  const JsonBounds bounds_;
  std::uint64_t values_ = 0;
  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;
};

}  // namespace

json parse_bounded_json(const std::string& text, const JsonBounds& bounds) {
  if (const std::size_t nul = text.find('\0'); nul != std::string::npos) {
    throw JsonBoundsError("holds a zero byte at offset " + std::to_string(nul), "");
  }
  BoundsCheck check(bounds);
  json::sax_parse(text, &check);
  if (!check.refusal.empty()) throw JsonBoundsError(check.refusal, check.repeated_key);
  return json::parse(text);
}

}  // namespace kda::engine
