// gemm_chain.cuh — what the probes of the decode GEMMs (kda-gemv-probe, kda-cluster-gemm-probe)
// share: a failed call's exit, a shape's operands with weights beyond L2, cuBLAS's call, and a GEMM
// timed as a step runs it, after the kernel that writes its input (back-to-back calls of one GEMM
// overlap their tails, which a step's GEMM cannot).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_device.cuh"        // CK
#include "decode_gemm_shapes.hpp"  // DecodeGemmShape

namespace kda_bench {

// A failed CUDA call ends the probe, with `what` and the error's name.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// One shape's operands, freed with it: copies of the weights beyond three times L2 (each call
// reads the next), an input of up to kMaxRows rows, an output of up to kMaxRows f32 rows.
struct Operands {
  static constexpr std::int64_t kMaxRows = 256;
  std::size_t bytes = 0;  // of one weight copy
  std::vector<void*> weights;
  void* in = nullptr;
  void* out = nullptr;
  Operands(const DecodeGemmShape& s, const cudaDeviceProp& prop)
      : bytes(static_cast<std::size_t>(s.n * s.k) * 2),
        weights(static_cast<std::size_t>(
            std::max<std::size_t>(2, 3 * static_cast<std::size_t>(prop.l2CacheSize) / bytes + 1))) {
    for (void*& w : weights) {
      CK(cudaMalloc(&w, bytes));
      CK(cudaMemset(w, 0x3c, bytes));
    }
    CK(cudaMalloc(&in, kMaxRows * s.k * 2));
    CK(cudaMemset(in, 0x3c, kMaxRows * s.k * 2));
    CK(cudaMalloc(&out, kMaxRows * s.n * 4));
  }
  ~Operands() {
    for (void* w : weights) cudaFree(w);
    cudaFree(in);
    cudaFree(out);
  }
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;
};

// out[rows, n] = in[rows, k] · w[n, k]ᵀ of shape `s` on cuBLAS, as the layer calls it (bf16 out,
// rows packed).
inline void cublas_gemm(cublasHandle_t handle, const void* w, const void* in, void* out,
                        const DecodeGemmShape& s, std::int64_t rows) {
  const float one = 1.0f, zero = 0.0f;
  cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n), static_cast<int>(rows),
               static_cast<int>(s.k), &one, w, CUDA_R_16BF, static_cast<int>(s.k), in, CUDA_R_16BF,
               static_cast<int>(s.k), &zero, out, CUDA_R_16BF, static_cast<int>(s.n),
               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// The kernel before a GEMM in the chain: writes its input row (k bf16 values, varying with
// `salt`), and lets a programmatic dependent start at once.
__global__ void write_input_row(std::uint16_t* in, std::int64_t k, std::uint32_t salt) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  for (std::int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    in[i] = static_cast<std::uint16_t>(0x3c00u | ((static_cast<std::uint32_t>(i) + salt) & 0x7fu));
  }
}

// us per (writer, GEMM) pair on `stream`: 50 pairs in one CUDA graph, the writer writing the
// first row of `in` (k values), GEMM i launched by launch_gemm(weights[i % weights.size()]) (none
// where with_gemm is false: the writer's alone); the median of 5 timed replays after 2.
template <class LaunchGemm>
double chain_us(cudaStream_t stream, void* in, std::int64_t k, const std::vector<void*>& weights,
                LaunchGemm&& launch_gemm, bool with_gemm) {
  constexpr int kPairs = 50;
  cudaGraph_t graph = nullptr;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kPairs; ++i) {
    write_input_row<<<1, 256, 0, stream>>>(static_cast<std::uint16_t*>(in), k,
                                           static_cast<std::uint32_t>(i));
    if (with_gemm) launch_gemm(weights[static_cast<std::size_t>(i) % weights.size()]);
  }
  CK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> rounds;
  for (int round = 0; round < 7; ++round) {
    CK(cudaEventRecord(a, stream));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (round >= 2) rounds.push_back(ms * 1e3 / kPairs);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

}  // namespace kda_bench
