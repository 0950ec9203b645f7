// layer/src/cuda/shared_memory.cuh — raising a kernel's dynamic shared-memory limit past the 48 KB
// a launch gets unasked. The attribute belongs to the device that is current when it is set, so it
// is raised once a device (a process may run layers on several: one rank a device), not once a
// process.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace kda::layer::cuda {

template <auto Kernel>
cudaError_t allow_shared_memory(int bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> raised[kMaxDevices] = {};  // the limit set, a device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxDevices &&
      raised[device].load(std::memory_order_acquire) >= bytes) {
    return cudaSuccess;
  }
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && device >= 0 && device < kMaxDevices) {
    int seen = raised[device].load(std::memory_order_relaxed);
    while (seen < bytes && !raised[device].compare_exchange_weak(seen, bytes)) {
    }
  }
  return err;
}

}  // namespace kda::layer::cuda
