// engine/model/src/text_file.hpp — internal: the whole text of a small file (a model description,
// a config.json, a checkpoint's index) with an error naming the file and what is wrong with it.
#pragma once

#include <string>

namespace kda::engine {

// The text of `path`, `what` naming it in errors ("the model description"). Refused with
// kda::Error (kInvalidArgument): a FIFO, socket or device (its reader would block or never end), a
// file that cannot be opened or read (with the system's reason), one over 16 MiB (read up to one
// byte past the cap, never whole) and one holding a zero byte (binary data); `hint` (may be empty)
// ends the last two errors: what the file should be, and where what it holds belongs.
std::string read_text_file(const std::string& path, const char* what, const std::string& hint);

}  // namespace kda::engine
