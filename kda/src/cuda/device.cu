// Device helpers of the public API (kda/kda.hpp), so that layers above need no CUDA headers.
#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"

namespace kda {

using detail::cuda_status;

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error: "no device" is an answer, not a failure
    return 0;
  }
  return n;
}

Status device_malloc(void** ptr, std::size_t bytes) {
  if (ptr == nullptr) return Status(StatusCode::kInvalidArgument, "device_malloc: ptr is null");
  *ptr = nullptr;
  if (bytes == 0) return Status::Ok();
  return cuda_status(cudaMalloc(ptr, bytes), "cudaMalloc");
}

Status device_free(void* ptr) {
  if (ptr == nullptr) return Status::Ok();
  return cuda_status(cudaFree(ptr), "cudaFree");
}

Status memcpy_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice,
                                     static_cast<cudaStream_t>(stream)),
                     "cudaMemcpyAsync(host to device)");
}

Status memcpy_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  Status st = cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost,
                                          static_cast<cudaStream_t>(stream)),
                          "cudaMemcpyAsync(device to host)");
  if (!st.ok()) return st;
  // The host buffer is only meaningful once the copy is done.
  return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

Status memset_device(void* dst, int value, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  return cuda_status(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream)),
                     "cudaMemsetAsync");
}

Status stream_synchronize(void* stream) {
  return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "none";
  }
  return prop.name;
}

}  // namespace kda
