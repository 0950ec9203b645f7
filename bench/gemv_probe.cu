// kda-gemv-probe — the whole layer's one-row GEMM (layer/src/cuda/small_gemm.cu) against cuBLAS on
// the shapes a decode step of one sequence runs: the input projection, o_proj and the low-rank
// second factors of Kimi-Linear-48B (hidden 2304, H = 32), its TP8 shard and Kimi K3's TP8 shard;
// the kernel as the layer runs it (the sliced kernel, slices by shape), the streamed kernel
// launched plainly and as a programmatic dependent of the call before (its first stages then load
// while that call finishes), and the sliced kernel with each row cut in two.
// Each call reads another copy of the weights (copies beyond three times L2), CUDA events around
// 50 calls after 10 warm-up, median of 5 such rounds; bandwidth = weight bytes / time. CUDA only.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/kernels.hpp"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  cudaStream_t stream = nullptr;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cublasSetStream(handle, stream);
  struct Shape {
    const char* name;
    std::int64_t n, k;
  };
  std::printf("kda-gemv-probe on %s: one row, bf16 weights [n, k], us (TB/s of weight reads)\n\n",
              prop.name);
  std::printf(
      "| shape | n | k | weights MB | as the layer runs it | streamed | streamed, programmatic | "
      "sliced, split 2 | cuBLAS |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Shape& s :
       {Shape{"H = 32 input projection", 12576, 2304}, Shape{"H = 32 o_proj", 2304, 4096},
        Shape{"H = 32 f_b", 4096, 128}, Shape{"TP8 input projection", 1800, 2304},
        Shape{"TP8 o_proj", 2304, 512}, Shape{"K3 TP8 input projection", 4760, 7168},
        Shape{"K3 TP8 g_proj", 1536, 7168}, Shape{"K3 TP8 o_proj", 7168, 1536}}) {
    const std::size_t bytes = static_cast<std::size_t>(s.n * s.k) * 2;
    const int copies = static_cast<int>(std::max<std::size_t>(2, 3 * prop.l2CacheSize / bytes + 1));
    std::vector<void*> weights(copies);
    for (void*& w : weights) {
      check(cudaMalloc(&w, bytes), "cudaMalloc");
      check(cudaMemset(w, 0x3c, bytes), "cudaMemset");
    }
    void *in = nullptr, *out = nullptr;
    check(cudaMalloc(&in, s.k * 2), "cudaMalloc");
    check(cudaMemset(in, 0x3c, s.k * 2), "cudaMemset");
    check(cudaMalloc(&out, s.n * 4), "cudaMalloc");
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    // 0: the kernel as the layer runs it (the sliced one); 1: streamed; 2: streamed,
    // programmatic; 3: sliced, each row cut in 2; 4: cuBLAS. A kernel that does not take the shape:
    // "-".
    using kda::layer::cuda::SmallGemmKernel;
    constexpr int kColumns = 5;
    double us[kColumns];
    for (int which = 0; which < kColumns; ++which) {
      bool taken = true;
      std::vector<double> rounds;
      for (int round = 0; round < 5; ++round) {
        for (int it = 0; it < 60; ++it) {
          if (it == 10) cudaEventRecord(a, stream);
          void* w = weights[it % copies];
          if (which < 4) {
            kda::layer::cuda::SmallGemmParams p;
            p.kernel =
                which == 1 || which == 2 ? SmallGemmKernel::kStreamed : SmallGemmKernel::kSliced;
            p.programmatic = which == 2;
            p.split = which == 3 ? 2 : 0;
            p.in = static_cast<const std::uint16_t*>(in);
            p.ldi = s.k;
            p.weight = static_cast<const std::uint16_t*>(w);
            p.out = out;
            p.ldo = s.n;
            p.rows = 1;
            p.n = s.n;
            p.k = s.k;
            const cudaError_t err = kda::layer::cuda::launch_small_gemm(p, stream);
            if (err == cudaErrorInvalidValue && p.kernel == SmallGemmKernel::kStreamed) {
              cudaGetLastError();
              taken = false;
              break;
            }
            check(err, "launch_small_gemm");
          } else {
            const float one = 1.0f, zero = 0.0f;
            cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n), 1,
                         static_cast<int>(s.k), &one, w, CUDA_R_16BF, static_cast<int>(s.k), in,
                         CUDA_R_16BF, static_cast<int>(s.k), &zero, out, CUDA_R_16BF,
                         static_cast<int>(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          }
        }
        if (!taken) break;
        cudaEventRecord(b, stream);
        check(cudaEventSynchronize(b), "run");
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        rounds.push_back(ms * 1e3 / 50);
      }
      std::sort(rounds.begin(), rounds.end());
      us[which] = taken ? rounds[2] : -1.0;
    }
    std::printf("| %s | %lld | %lld | %.1f |", s.name, static_cast<long long>(s.n),
                static_cast<long long>(s.k), bytes / 1e6);
    for (const double t : us) {
      if (t < 0) {
        std::printf(" - |");
      } else {
        std::printf(" %.2f (%.2f) |", t, bytes / t / 1e6);
      }
    }
    std::printf("\n");
    for (void* w : weights) cudaFree(w);
    cudaFree(in);
    cudaFree(out);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  cublasDestroy(handle);
  return 0;
}
