// kda/engine/communicator.hpp — how the ranks of a tensor-parallel group exchange data.
//
// An engine of one tensor-parallel rank (runtime.tp_size > 1) computes its shard's partial sum of
// every whole layer's output. Given a Communicator (EngineOptions::communicator), its
// prefill_hidden / decode_hidden all-reduce that output in place, so every rank returns the whole
// layer's output. The engine only calls the interface; the transport is the communicator's:
//   make_local_communicators()  ranks as threads of one process on the CPU backend (tests, and
//                               hosts that shard a model over CPU workers)
// Every rank calls the same collectives in the same order, as NCCL requires; a collective returns
// once this rank's result is in place (CPU) or enqueued on `stream` (CUDA transports).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "kda/kda.hpp"

namespace kda::engine {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  // The memory its collectives read and write: host memory (kCpu) or device memory (kCuda).
  virtual Backend backend() const noexcept = 0;
  // data[i] = the sum over ranks of their data[i], in place, `count` elements of `dtype` (kBF16 or
  // kF32); bf16 is summed in fp32 in rank order and rounded once, so every rank gets the same
  // bits. Throws kda::Error on a transport failure or a dtype it does not sum.
  virtual void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) = 0;
  // recv[r * bytes .. (r + 1) * bytes) = rank r's send, for every rank r.
  virtual void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) = 0;
};

// `ranks` communicators (1..1024) of one group in this process, on host memory: rank r is
// communicators[r]. Each must be driven by its own thread (a collective waits for every rank); the
// group's shared state lives as long as any of them.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int ranks);

}  // namespace kda::engine
