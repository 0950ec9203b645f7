// gemm_chain.cuh — a decode GEMM timed as a step runs it, after the kernel that writes its input
// (kda-gemv-probe, kda-cluster-gemm-probe): back-to-back calls of one GEMM overlap their tails,
// which a step's GEMM cannot.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench_device.cuh"  // CK

namespace kda_bench {

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
