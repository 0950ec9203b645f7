// Internal helpers of the CUDA backend: turning cudaError_t into kda::Status.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kda/kda.hpp"

namespace kda::detail {

// A failed call's error is also the runtime's last error until someone reads it, and the first
// launch check to read it (cudaGetLastError after a launch) would report it again, failing a call
// that did nothing wrong: a cudaMalloc refused for an engine too large, then a smaller engine. So
// reading it here clears it (an error that corrupts the context stays: every later call reports
// it). cudaMalloc's refusal is kOutOfMemory, which a caller can answer with a smaller request.
inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  return Status(
      err == cudaErrorMemoryAllocation ? StatusCode::kOutOfMemory : StatusCode::kCudaError,
      std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Streaming multiprocessors of the current device, looked up once per device (1 if unknown).
int current_device_sm_count();

}  // namespace kda::detail
