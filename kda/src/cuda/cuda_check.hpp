// Internal helpers of the CUDA backend: turning cudaError_t into kda::Status.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kda/kda.hpp"

namespace kda::detail {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kCudaError,
                std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// After a launch: reports configuration errors (bad grid, too much shared memory) without syncing.
inline Status launch_status(const char* kernel) {
  return cuda_status(cudaGetLastError(), kernel);
}

}  // namespace kda::detail
