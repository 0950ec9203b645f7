// kda/error.hpp — the one exception type of the C++ API (the layer and the engine).
//
// The operator never throws: kda/kda.hpp returns kda::Status, planner/ returns PlanResult. The
// layer (kda/layer/) and the engine (model descriptions, checkpoints, Engine, case files) report
// every failure by throwing kda::Error, whose code() says what kind of failure it was and whose
// what() names the offending file, key, tensor or value. Nothing else is thrown on purpose;
// std::bad_alloc can still escape from the standard library when host memory runs out.
#pragma once

#include <stdexcept>
#include <string>

#include "kda/kda.hpp"

namespace kda {

class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  // From a failed status: the message is the status message, prefixed by `context` when given
  // ("layer 3 prefill: workspace too small ...").
  explicit Error(const Status& status, const std::string& context = {})
      : std::runtime_error(context.empty() ? status.message() : context + ": " + status.message()),
        code_(status.code()) {}

  StatusCode code() const noexcept { return code_; }

 private:
  StatusCode code_;
};

// Throws kda::Error when `status` is not ok; does nothing (and allocates nothing) otherwise.
inline void throw_if_error(const Status& status, const char* context = nullptr) {
  if (!status.ok()) throw Error(status, context == nullptr ? std::string() : std::string(context));
}

}  // namespace kda
