// bench_device.cuh — what the CUDA benchmarks and probes share: the CUDA call check, a zeroed
// device buffer, a median, the device-side fills of random inputs and the events' median.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// Exits with a message naming the call, its error and where it is, when a CUDA call fails.
#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                               \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace kda_bench {

// `bytes` of device memory (at least one), zeroed, freed with the object.
struct DeviceMemory {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceMemory(std::size_t size) : bytes(size) {
    CK(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 1)));
    CK(cudaMemset(ptr, 0, std::max<std::size_t>(bytes, 1)));
  }
  ~DeviceMemory() { cudaFree(ptr); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
};

// The median of samples (the upper one of an even count; 0 for none).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The host's time per call of `call` (enqueued on `stream`, no synchronization inside), in
// microseconds: the median over 20 repeats of `calls` calls after 5 repeats, each repeat followed
// by a synchronization; the GPU's queue holds a repeat's launches, so the loop times the host's
// enqueueing.
template <typename Call>
double host_us_per_call(cudaStream_t stream, int calls, Call&& call) {
  std::vector<double> per_call;
  for (int rep = 0; rep < 25; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    CK(cudaStreamSynchronize(stream));
    if (rep >= 5)
      per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  return median(per_call);
}

// Uniform values in [lo, hi) from a counter-based hash (fast to fill gigabytes): element i of a
// fill with `seed`, the same on the host (kda-bench --paths replays the inputs there).
__host__ __device__ inline std::uint16_t hashed_bf16(std::int64_t i, std::uint64_t seed, float lo,
                                                     float hi) {
  std::uint64_t x = (static_cast<std::uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
  const float f = lo + (hi - lo) * u;
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
__host__ __device__ inline float hashed_f32(std::int64_t i, std::uint64_t seed, float lo,
                                            float hi) {
  std::uint64_t x = (static_cast<std::uint64_t>(i) + 7) * 0xD6E8FEB86659FD93ull ^ seed;
  x ^= x >> 32;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return lo + (hi - lo) * static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
}

__global__ void fill_bf16(std::uint16_t* dst, std::int64_t n, std::uint64_t seed, float lo,
                          float hi) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = hashed_bf16(i, seed, lo, hi);
  }
}
__global__ void fill_f32(float* dst, std::int64_t n, std::uint64_t seed, float lo, float hi) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = hashed_f32(i, seed, lo, hi);
  }
}

inline void fill(std::uint16_t* p, std::int64_t n, std::uint64_t seed, float lo, float hi) {
  if (n > 0) fill_bf16<<<1024, 256>>>(p, n, seed, lo, hi);
  CK(cudaGetLastError());
}
inline void fill(float* p, std::int64_t n, std::uint64_t seed, float lo, float hi) {
  if (n > 0) fill_f32<<<1024, 256>>>(p, n, seed, lo, hi);
  CK(cudaGetLastError());
}

// Median milliseconds of `iters` timed calls run(i) after `warmup` untimed ones, CUDA events
// recorded on `stream` around each call (run may fork work to other streams if it joins it back).
template <typename F>
double median_ms(F&& run, int warmup, int iters, cudaStream_t stream = nullptr) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) run(i);
  CK(cudaDeviceSynchronize());
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, stream));
    run(i);
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&ms[i], a, b));
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

}  // namespace kda_bench
