// Internal helpers of the CUDA backend: turning cudaError_t into kda::Status.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kda/kda.hpp"

namespace kda::detail {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                                            cudaGetErrorString(err) + ")");
}

// Streaming multiprocessors of the current device, looked up once per device (1 if unknown).
int current_device_sm_count();

}  // namespace kda::detail
