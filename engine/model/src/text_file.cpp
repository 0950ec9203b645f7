// engine/model/src/text_file.cpp — see text_file.hpp.
#include "text_file.hpp"

#include <cerrno>
#include <cstddef>
#include <fstream>

#include "file_failure.hpp"
#include "kda/error.hpp"

namespace kda::engine {

std::string read_text_file(const std::string& path, const char* what, const std::string& hint) {
  if (is_special_file(path)) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": " + what + " is not a regular file (a FIFO, socket or device)");
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": " + file_failure(std::string("cannot open ") + what, path, errno));
  }
  // At most one byte past the cap (a character device or a checkpoint's weights named by mistake
  // would otherwise be read whole).
  constexpr std::size_t kMaxBytes = std::size_t{16} << 20;
  std::string text(kMaxBytes + 1, '\0');
  errno = 0;
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) {
    throw Error(StatusCode::kInvalidArgument,
                path + ": " + file_failure(std::string("cannot read ") + what, path, errno));
  }
  text.resize(static_cast<std::size_t>(in.gcount()));
  const std::string after = hint.empty() ? std::string() : ": " + hint;
  if (text.size() > kMaxBytes) {
    throw Error(StatusCode::kInvalidArgument, path + ": " + what + " is over 16 MiB" + after);
  }
  if (const std::size_t nul = text.find('\0'); nul != std::string::npos) {
    throw Error(StatusCode::kInvalidArgument, path + ": " + what +
                                                  " holds binary data (a zero byte at offset " +
                                                  std::to_string(nul) + ")" + after);
  }
  return text;
}

}  // namespace kda::engine
