// Names of the contract's enums, Status text, and the effective scale.
#include <cmath>
#include <cstdio>
#include <string>

#include "kda/kda.hpp"

namespace kda {

const char* to_string(StatusCode code) noexcept {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kOverflow:
      return "overflow";
    case StatusCode::kWorkspaceTooSmall:
      return "workspace too small";
    case StatusCode::kBackendUnavailable:
      return "backend unavailable";
    case StatusCode::kCudaError:
      return "CUDA error";
    case StatusCode::kInternal:
      return "internal error";
    case StatusCode::kOutOfMemory:
      return "out of memory";
  }
  return "unknown status";
}

const char* to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::kNone:
      return "none";
    case DType::kBF16:
      return "bf16";
    case DType::kF32:
      return "f32";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kF16:
      return "f16";
  }
  return "unknown dtype";
}

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kNone:
      return 0;
    case DType::kBF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kF16:
      return 2;
  }
  return 0;
}

const char* to_string(GateMode gate) noexcept {
  switch (gate) {
    case GateMode::kLowerBound:
      return "lower_bound";
    case GateMode::kSoftplus:
      return "softplus";
  }
  return "unknown gate";
}

const char* to_string(PrefillSchedule schedule) noexcept {
  switch (schedule) {
    case PrefillSchedule::kAuto:
      return "auto";
    case PrefillSchedule::kTwoPhase:
      return "two-phase";
    case PrefillSchedule::kPipelined:
      return "pipelined";
  }
  return "unknown schedule";
}

const char* to_string(Backend backend) noexcept {
  switch (backend) {
    case Backend::kCpu:
      return "cpu";
    case Backend::kCuda:
      return "cuda";
  }
  return "unknown backend";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string text = kda::to_string(code_);
  if (!message_.empty()) {
    text += ": ";
    text += message_;
  }
  return text;
}

namespace {
// scale == 0 selects the default K^-0.5 (computed in double, then rounded once to float).
float effective_scale_of(float scale, std::int64_t head_dim_k) noexcept {
  if (scale != 0.0f) return scale;
  if (head_dim_k <= 0) return 0.0f;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim_k)));
}
}  // namespace

float Problem::effective_scale() const noexcept { return effective_scale_of(scale, head_dim_k); }
float DecodeProblem::effective_scale() const noexcept {
  return effective_scale_of(scale, head_dim_k);
}

}  // namespace kda

namespace kda {

Status describe_device_status(std::uint32_t bits) {
  if (bits == 0) return Status::Ok();
  std::string message = "the device reported:";
  const char* sep = " ";
  if (bits & kDeviceStatusCuSeqlens) {
    message += sep;
    message += "broken cu_seqlens (cu_seqlens[0] != 0, decreasing, or cu_seqlens[N] != T)";
    sep = "; ";
  }
  if (bits & kDeviceStatusGateParams) {
    message += sep;
    message += "gate parameters out of range (A_log not finite or |A_log| > " +
               std::to_string(static_cast<int>(kMaxAbsALog)) + ", or dt_bias not finite)";
    sep = "; ";
  }
  if (bits & kDeviceStatusSlot) {
    message += sep;
    message +=
        "a state slot index >= the pool size (decode: that row was skipped; prefill: that sequence "
        "ran as padding, from a zero state, with no final state written; slot copy: that pair was "
        "skipped)";
    sep = "; ";
  }
  if (bits & kDeviceStatusAccepted) {
    message += sep;
    message +=
        "a verify step's or a commit's num_accepted outside [1, tokens] (that row was skipped)";
    sep = "; ";
  }
  if (bits & kDeviceStatusCheckpoint) {
    message += sep;
    message +=
        "a prefill checkpoint request with an offset that is not -1, a multiple of 16 up to its "
        "sequence's length, or that length, with a slot >= the pool size, or with a slot another "
        "request of the call named (that request was skipped)";
    sep = "; ";
  }
  if (bits & kDeviceStatusStepTimeout) {
    message += sep;
    message +=
        "a one-launch decode step whose blocks waited for each other past their bound (the device "
        "did not run them all at once; that step's outputs and states are not valid)";
    sep = "; ";
  }
  const std::uint32_t unknown =
      bits & ~static_cast<std::uint32_t>(kDeviceStatusCuSeqlens | kDeviceStatusGateParams |
                                         kDeviceStatusSlot | kDeviceStatusAccepted |
                                         kDeviceStatusCheckpoint | kDeviceStatusStepTimeout);
  if (unknown != 0) {
    message += sep;
    message += "unknown status bits 0x" + [&] {
      char hex[16];
      std::snprintf(hex, sizeof hex, "%x", unknown);
      return std::string(hex);
    }();
  }
  return Status(StatusCode::kInvalidArgument, message);
}

}  // namespace kda
