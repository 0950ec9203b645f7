// kda_checkpoint_index_kernel: turns a prefill's checkpoint requests [N, K] into per-chunk lists
// (workspace_layout.hpp, "Checkpoint index") so that the recurrence finds the requests of a chunk
// with one load, however many there are and in whatever order the caller gave them.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/prefill_kernels.cuh"

namespace kda::detail {
namespace {

// Request i's push: a valid request with an entry goes onto the list of the chunk slot it follows
// (offset 0: the sequence's initial-state list), once per entry. List order depends on the
// atomics' order, the values written do not: every entry of a list gets the same state.
__device__ void push_checkpoint_request(const PrefillParams& p, std::int64_t i) {
  const std::int64_t K = p.checkpoints;
  const std::int64_t s = i / K;
  // A padding sequence's requests are not read (it writes no state), as on the CPU.
  const std::int32_t own = p.state_slots[s];
  if (own < 0 || own == p.padding_slot) return;
  const std::int64_t offset = p.checkpoint_offsets_64
                                  ? static_cast<const std::int64_t*>(p.checkpoint_offsets)[i]
                                  : static_cast<const std::int32_t*>(p.checkpoint_offsets)[i];
  const std::int32_t slot = p.checkpoint_slots[i];
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t length = eos - bos;
  const bool offset_bad =
      offset < -1 || offset > length || (offset >= 0 && offset % C != 0 && offset != length);
  if (offset_bad || slot >= p.num_state_slots) {
    report_status(p.status, kDeviceStatusCheckpoint);
    return;
  }
  if (offset < 0 || slot < 0 || slot == p.padding_slot) return;  // no request
  if (atomicExch(&p.checkpoint_claims[slot], 0) != -1) {         // another request named the entry
    report_status(p.status, kDeviceStatusCheckpoint);
    return;
  }
  const std::int64_t head =
      offset == 0 ? p.num_chunk_slots + s : s + bos / C + (offset + C - 1) / C - 1;
  p.checkpoint_next[slot] = atomicExch(&p.checkpoint_heads[head], slot);
}

// Threads of a block: the grid's, and the one block's that builds a small index alone (up to
// kIndexBlockThreads requests: a request a thread, since each push is a chain of dependent loads
// and atomics).
constexpr int kIndexThreads = 256;
constexpr int kIndexBlockThreads = 1024;

// One thread per request; the heads and claims were set to -1 (no list, unclaimed) before.
__global__ void __launch_bounds__(kIndexThreads)
    kda_checkpoint_index_kernel(const PrefillParams p) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < p.seqs.num_seqs * p.checkpoints) push_checkpoint_request(p, i);
}

// One block for every request and the heads' and claims' reset before them: one launch instead of
// a memset and a kernel, where both are small (a graph paid ~5 us for the memset node and the gap
// after it: H200, kda-layer-bench --timeline, the TP8 shard's prefill with two checkpoints).
__global__ void __launch_bounds__(kIndexBlockThreads)
    kda_checkpoint_index_block_kernel(const PrefillParams p, std::int64_t words) {
  for (std::int64_t w = threadIdx.x; w < words; w += blockDim.x) p.checkpoint_heads[w] = -1;
  __syncthreads();  // every head and claim reset before the first push
  const std::int64_t requests = p.seqs.num_seqs * p.checkpoints;
  for (std::int64_t i = threadIdx.x; i < requests; i += blockDim.x) push_checkpoint_request(p, i);
}

}  // namespace

Status launch_checkpoint_index(const PrefillParams& prm, cudaStream_t stream) {
  if (prm.checkpoint_heads == nullptr) return Status::Ok();
  // Heads and claims, adjacent: -1 (no list, unclaimed).
  const std::size_t words =
      static_cast<std::size_t>(prm.num_chunk_slots + prm.seqs.num_seqs + prm.num_state_slots);
  const std::int64_t requests = prm.seqs.num_seqs * prm.checkpoints;
  // Up to these, one block resets and pushes: 64 stores a thread at most for the reset.
  constexpr std::size_t kBlockMaxWords = 64 * kIndexBlockThreads;
  if (requests <= kIndexBlockThreads && words <= kBlockMaxWords) {
    kda_checkpoint_index_block_kernel<<<1, kIndexBlockThreads, 0, stream>>>(
        prm, static_cast<std::int64_t>(words));
    return cuda_status(cudaGetLastError(), "kda_checkpoint_index_block_kernel");
  }
  if (const cudaError_t err =
          cudaMemsetAsync(prm.checkpoint_heads, 0xff, words * sizeof(std::int32_t), stream);
      err != cudaSuccess) {
    return cuda_status(err, "cudaMemsetAsync(checkpoint index)");
  }
  if (requests == 0) return Status::Ok();
  const std::int64_t blocks = (requests + kIndexThreads - 1) / kIndexThreads;
  if (blocks > 2147483647) {
    return Status(StatusCode::kUnsupported,
                  "the CUDA prefill takes at most 2^39 checkpoint requests (sequences * "
                  "checkpoints) per call");
  }
  kda_checkpoint_index_kernel<<<static_cast<unsigned>(blocks), kIndexThreads, 0, stream>>>(prm);
  return cuda_status(cudaGetLastError(), "kda_checkpoint_index_kernel");
}

}  // namespace kda::detail
