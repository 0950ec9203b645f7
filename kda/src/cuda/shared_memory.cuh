// kda/src/cuda/shared_memory.cuh — raising a kernel's dynamic shared-memory limit past the 48 KB
// a launch gets unasked (and, where a kernel needs the whole unified memory as shared memory, its
// carveout). cudaFuncSetAttribute is a driver call that a forward would otherwise pay at every
// launch; the attribute belongs to the device that is current when it is set, so it is raised once
// a device and kernel (a process may run layers on several devices: one rank a device), not once a
// process. The operator's kernels and the layer's (layer/src/cuda) share this.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace kda::detail {

template <auto Kernel>
cudaError_t allow_shared_memory(int bytes, bool max_shared_carveout = false) {
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
  if (err == cudaSuccess && max_shared_carveout) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  if (err == cudaSuccess && device >= 0 && device < kMaxDevices) {
    int seen = raised[device].load(std::memory_order_relaxed);
    while (seen < bytes && !raised[device].compare_exchange_weak(seen, bytes)) {
    }
  }
  return err;
}

}  // namespace kda::detail
