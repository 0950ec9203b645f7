// engine/model/src/file_failure.hpp — internal: the words for a file that cannot be opened or read.
#pragma once

#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace kda::engine {

// "cannot open the model description '/abs/dir/m.yaml': No such file or directory" for
// file_failure("cannot open the model description", "dir/m.yaml", ENOENT): what failed, where (the
// absolute path, since a relative one is resolved against the current directory, which a user who
// ran from elsewhere needs to see; left out when `path` is already absolute and normal) and why
// (strerror of the errno the failed call left; 0 when the standard library set none).
inline std::string file_failure(const std::string& action, const std::string& path,
                                int error_number) {
  std::string text = action;
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(path, ec).lexically_normal();
  if (!ec && absolute.string() != path) text += " '" + absolute.string() + "'";
  return text + ": " + (error_number != 0 ? std::strerror(error_number) : "reason unknown");
}

}  // namespace kda::engine
