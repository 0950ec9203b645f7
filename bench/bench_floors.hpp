// bench/bench_floors.hpp — the lower bounds the CUDA benchmarks compare their times with, shared
// by kda-bench (kda_bench.cu) and kda-layer-bench (layer_bench.cu) so that both use one
// definition: the device-to-device copy bandwidth measured at run time, the bytes the KDA core must
// move, and the bf16 tensor-core peak used for GEMM floors.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace kda::bench {

// Dense bf16 tensor-core peak of the H200 (SXM), NVIDIA's specification: 989 TFLOP/s without
// sparsity. A GEMM floor is FLOPs / this; real cuBLAS GEMMs reach roughly 70-80 % of it.
inline constexpr double kPeakBf16Flops = 989e12;

inline void check_cuda_or_exit(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "bench: %s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Device-to-device copy bandwidth, bytes read + written per second: the median of 15 timed
// cudaMemcpyAsync of 2 GiB after 3 warm-up copies, on the default stream.
inline double measure_copy_bandwidth() {
  const std::size_t bytes = std::size_t(2) << 30;  // 2 GiB
  void *a = nullptr, *b = nullptr;
  check_cuda_or_exit(cudaMalloc(&a, bytes), "cudaMalloc");
  check_cuda_or_exit(cudaMalloc(&b, bytes), "cudaMalloc");
  check_cuda_or_exit(cudaMemset(a, 1, bytes), "cudaMemset");
  cudaEvent_t start, stop;
  check_cuda_or_exit(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda_or_exit(cudaEventCreate(&stop), "cudaEventCreate");
  auto copy = [&] {
    check_cuda_or_exit(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
  };
  for (int i = 0; i < 3; ++i) copy();
  check_cuda_or_exit(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<float> ms(15);
  for (float& m : ms) {
    check_cuda_or_exit(cudaEventRecord(start), "cudaEventRecord");
    copy();
    check_cuda_or_exit(cudaEventRecord(stop), "cudaEventRecord");
    check_cuda_or_exit(cudaEventSynchronize(stop), "cudaEventSynchronize");
    check_cuda_or_exit(cudaEventElapsedTime(&m, start, stop), "cudaEventElapsedTime");
  }
  check_cuda_or_exit(cudaEventDestroy(start), "cudaEventDestroy");
  check_cuda_or_exit(cudaEventDestroy(stop), "cudaEventDestroy");
  check_cuda_or_exit(cudaFree(a), "cudaFree");
  check_cuda_or_exit(cudaFree(b), "cudaFree");
  std::sort(ms.begin(), ms.end());
  return 2.0 * static_cast<double>(bytes) / (ms[ms.size() / 2] * 1e-3);
}

// The bytes a KDA core forward (prefill or decode) must move: q, k, v, g read and out written (bf16
// [tokens, heads, D] each), beta read (bf16 [tokens, heads]), every sequence's recurrent state
// read and written (heads x D x D of state_bytes each), and the int32 slot list when the core
// reads one (`slot_list`).
inline double kda_core_bytes(double tokens, double sequences, double heads, double head_dim,
                             double state_bytes, bool slot_list) {
  const double token_elems = tokens * heads * head_dim;
  return 5.0 * token_elems * 2 + 2.0 * tokens * heads +
         2.0 * sequences * heads * head_dim * head_dim * state_bytes +
         (slot_list ? 4.0 * sequences : 0.0);
}

}  // namespace kda::bench
