// engine/model/src/file_failure.hpp — internal: the words for a file that cannot be opened or read,
// and which files are not to be opened at all.
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

// Whether `path` names something that exists but is neither a regular file nor a directory: a
// FIFO, socket or device, whose reader would block or never reach an end, so the readers refuse it
// before opening it.
inline bool is_special_file(const std::string& path) {
  std::error_code ec;
  const std::filesystem::file_type type = std::filesystem::status(path, ec).type();
  return !ec && type != std::filesystem::file_type::regular &&
         type != std::filesystem::file_type::directory &&
         type != std::filesystem::file_type::not_found;
}

}  // namespace kda::engine
