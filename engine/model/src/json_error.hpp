// engine/model/src/json_error.hpp — internal: the words of a JSON library error, for a message.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kda::engine {

// e.what() without the library's tag: "parse error at line 3, column 7: syntax error while
// parsing object ..." for "[json.exception.parse_error.101] parse error at line 3, column 7: ...",
// "number overflow parsing '1e705'" for "[json.exception.out_of_range.406] number overflow ...".
inline std::string json_error_text(const nlohmann::json::exception& e) {
  std::string what = e.what();
  const std::size_t tag_end =
      what.rfind("[json.exception.", 0) == 0 ? what.find("] ") : std::string::npos;
  return tag_end == std::string::npos ? what : what.substr(tag_end + 2);
}

}  // namespace kda::engine
