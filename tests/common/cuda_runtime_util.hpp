// cuda_runtime_util.hpp — what the CUDA-only test code shares (streams, graphs, a checked call),
// on the CUDA runtime's own types; empty without CUDA (KDA_HAVE_CUDA), so that the files including
// it still build, and skip, there.
#pragma once

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#include <doctest/doctest.h>

// REQUIRE that a CUDA runtime call succeeded, naming it and the error.
#define CUDA_REQUIRE(call)                                                       \
  do {                                                                           \
    const cudaError_t cuda_require_err_ = (call);                                \
    REQUIRE_MESSAGE(cuda_require_err_ == cudaSuccess,                            \
                    #call << ": " << cudaGetErrorName(cuda_require_err_) << " (" \
                          << cudaGetErrorString(cuda_require_err_) << ")");      \
  } while (0)

namespace kda::test {

// A non-blocking stream, destroyed at scope exit (after the engines that use it: declare it first).
struct Stream {
  cudaStream_t stream = nullptr;
  Stream() {
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) stream = nullptr;
  }
  ~Stream() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// A captured graph and its executable, destroyed at scope exit.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
};

}  // namespace kda::test
#endif  // KDA_HAVE_CUDA
