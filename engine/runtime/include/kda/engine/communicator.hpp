// kda/engine/communicator.hpp — how the ranks of a tensor-parallel group exchange data.
//
// An engine of one tensor-parallel rank (runtime.tp_size > 1) computes its shard's partial sum of
// every whole layer's output. Given a Communicator (EngineOptions::communicator), its
// prefill_hidden / decode_hidden all-reduce that output in place, so every rank returns the whole
// layer's output; a context-parallel prefill (EngineOptions::context_group) all-gathers its ranks'
// segment transitions (and, whole layers, their conv histories). The engine only calls the
// interface; the transport is the communicator's:
//   make_local_communicators()       ranks as threads of one process on the CPU backend (tests,
//                                    and hosts that shard a model over CPU workers)
//   make_cuda_local_communicators()  ranks as threads of one process, each on its own CUDA stream
//                                    of one device (or each its own): tests, a single-process
//                                    multi-stream host. Not graph-capturable (below).
//   make_nccl_communicator(s)()      NCCL (built with it: nccl_compiled()), one device per rank,
//                                    in one process or one per rank. Graph-capturable as NCCL is.
// Every rank calls the same collectives in the same order, as NCCL requires; a collective returns
// once this rank's result is in place (CPU) or enqueued on `stream` (CUDA transports). The engine
// never aborts a group: a call refused on one rank (its arguments are checked before the first
// collective, so that rank's states stay as they were) is not known to the other ranks, which go
// on into the collective; the runtime wakes or aborts them through its transport (NCCL:
// ncclCommAbort). A collective that throws does so after the layers before it have run: the
// call's slots have taken its tokens in those layers and out holds a partial result, so the
// runtime resets or restores the call's sequences along with the group.
//
// Which bits an all-reduce gives: the local transports (CPU and CUDA) sum bf16 in fp32 in rank
// order and round once, so every rank gets the same bits and the CPU and CUDA ones agree bitwise.
// NCCL sums in an order of its own (ring or tree, chunked, bf16 rounded at each step): every rank
// still gets the same bits, but they may differ from the local transports' in the last bf16 place.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "kda/kda.hpp"

struct ncclComm;  // NCCL's communicator (nccl.h: typedef struct ncclComm* ncclComm_t)

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
  // For a rank that fails between collectives and will not call the next one: the in-process
  // transports wake every rank of the group waiting in a collective with kda::Error, and every
  // later collective of the group throws. The default does nothing (NCCL's ranks are processes;
  // ncclCommAbort is the owner's).
  virtual void abort() noexcept {}
};

// `ranks` communicators (1..1024) of one group in this process, on host memory: rank r is
// communicators[r]. Each must be driven by its own thread (a collective waits for every rank); the
// group's shared state lives as long as any of them.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int ranks);

// `ranks` communicators (1..64) of one group in this process, on device memory (backend kCuda):
// rank r is communicators[r], on devices[r] (empty: every rank on the device current at this
// call; otherwise one device per rank, each pair of distinct devices with peer access, which this
// enables). As with the CPU group, each rank is driven by its own thread and a collective returns
// once every rank has called it; but nothing waits for the device: the collective enqueues its
// work on the caller's `stream` (cudaStream_t; nullptr: the legacy default stream) behind what is
// already there and orders the ranks' streams with events (each rank's stream waits for the
// others' buffers to be ready before reading them, and for the others' reads of its buffer before
// it writes or returns it). A rank's buffers must stay valid until its stream passes the
// collective; it may write them, on its stream, as soon as the call returns. With several devices,
// buffers from a stream-ordered pool (cudaMallocAsync) need that pool's access granted to the other
// devices (cudaMemPoolSetAccess): peer access covers cudaMalloc's memory only.
//
// Not graph-capturable: the ranks' streams wait on each other's events, which a capture of one
// rank's stream cannot reach (a CUDA graph is one capture, its events its own). A collective on a
// capturing stream throws kda::Error (kInvalidArgument), on every rank alike. Capture the engine's
// other work per rank and run the collectives eagerly, or use NCCL, whose kernels synchronize the
// ranks on the device and are capturable. Each rank's all-reduce scratch grows to its largest call
// (stream-ordered; when the stream differs from the last call's, after waiting for that stream).
//
// Misuse throws kda::Error on every rank of the collective alike (each rank's arguments are checked
// against the others' before any device work): ranks that disagree on count, dtype or bytes, a null
// buffer of a non-empty collective, a dtype other than bf16 / f32, a capturing stream; a CUDA error
// before any device work (setting the device, the capture query, recording the rank's event) is
// reported the same way. A CUDA error while a rank enqueues its reads of the others' buffers throws
// kCudaError on every rank; while it enqueues its own writes, on that rank alone. Both leave the
// group broken (a later collective may wait forever for the rank that failed). Without CUDA
// (cuda_compiled() false) the factory throws kBackendUnavailable; with no device, a CUDA error.
std::vector<std::unique_ptr<Communicator>> make_cuda_local_communicators(
    int ranks, const std::vector<int>& devices = {});

// ---- NCCL
// ---------------------------------------------------------------------------------------- Built
// when CMake finds NCCL (KDA_NCCL: AUTO, ON, OFF); without it every factory below throws kda::Error
// (kBackendUnavailable). NCCL's types are opaque here, so that this header needs no nccl.h: an
// `ncclComm_t` is a `ncclComm*`.
//
// all_reduce_sum is one ncclAllReduce (ncclSum; kF32 as ncclFloat32, kBF16 as ncclBfloat16: see
// above for its bits), all_gather one ncclAllGather of bytes (ncclUint8), both on the given stream
// and asynchronous, graph-capturable as NCCL's collectives are. One rank per device and process
// thread, as NCCL asks; errors throw kda::Error (kCudaError, NCCL's message).
bool nccl_compiled() noexcept;

// NCCL's ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128), for processes that start one group: rank 0
// makes it (nccl_unique_id), sends its bytes to the others by its own means, and every rank calls
// make_nccl_communicator(id, ranks, rank, device).
struct NcclUniqueId {
  char bytes[128];
};
NcclUniqueId nccl_unique_id();

// Wraps an NCCL communicator of this process (ncclComm_t); `owned`: destroyed with it
// (ncclCommDestroy), otherwise the caller's and it must outlive the communicator.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm* comm, bool owned = false);
// ncclCommInitRank on `device` (made current for the call): rank `rank` of `ranks`, owned.
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int ranks, int rank,
                                                     int device);
// ncclCommInitAll: one rank per device of this process (rank r on devices[r]), owned. Each rank's
// collectives must then be called on its own thread with its device current, or between
// ncclGroupStart / ncclGroupEnd by the caller.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>& devices);

}  // namespace kda::engine
