// layer/src/cuda/conv_commit.cu — the conv half of a record-and-commit verify step's commit: each
// row's three conv states shifted by its accepted tokens' pre-conv inputs, for every layer of the
// call in one launch (kernels.hpp, ConvCommitParams). One thread: one channel of one branch of one
// (layer, row); it reads the channel's W-1 old values before it writes any, so the update is in
// place without a race (no other thread touches the channel). The values move as bf16 bits: the
// committed state is the per-token-states verify step's exactly.
//
// The layers' pointers travel by value in the kernel's parameters (__grid_constant__, as the
// operator's commit does): four pointers a layer make kMaxCommitLayers layers a little over 4 KiB,
// inside the 32 KiB that CUDA 12.1 and later allow a kernel's parameters on Volta and newer.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels.hpp"

namespace kda::layer::cuda {

namespace {

constexpr int kThreads = 128;

template <int W>
__global__ void __launch_bounds__(kThreads)
    conv_commit_kernel(const __grid_constant__ ConvCommitParams p) {
  constexpr int kHist = W - 1;
  const int layer = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.sequences));
  const std::int64_t b = blockIdx.x - static_cast<std::int64_t>(layer) * p.sequences;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  const bool reporter = layer == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  const std::int32_t slot = p.slots[b];
  if (slot < 0 || slot == p.padding_slot) return;  // padding: nothing read or written
  if (slot >= p.num_slots) {
    if (reporter && p.status != nullptr) atomicOr(p.status, kDeviceStatusSlot);
    return;
  }
  const int n = p.num_accepted[b];
  if (n < 1 || n > p.decode_tokens) {
    if (reporter && p.status != nullptr) atomicOr(p.status, kDeviceStatusAccepted);
    return;
  }
  if (c >= 3 * p.channels) return;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  std::uint16_t* state = p.layers[layer].pools[branch] + (slot * p.channels + cc) * kHist;
  const std::uint16_t* inputs =
      p.layers[layer].records + b * p.decode_tokens * 3 * p.channels + c;  // token 0's
  std::uint16_t old[kHist];
#pragma unroll
  for (int i = 0; i < kHist; ++i) old[i] = state[i];
    // Position n + i of old ++ inputs: from the old state below kHist, else input n + i - kHist.
#pragma unroll
  for (int i = 0; i < kHist; ++i) {
    const int at = n + i;
    std::uint16_t value = 0;
    if (at < kHist) {
#pragma unroll
      for (int j = 0; j < kHist; ++j) value = j == at ? old[j] : value;  // no local memory
    } else {
      value = inputs[static_cast<std::int64_t>(at - kHist) * 3 * p.channels];
    }
    state[i] = value;
  }
}

}  // namespace

cudaError_t launch_conv_commit(const ConvCommitParams& p, cudaStream_t stream) {
  if (p.sequences == 0 || p.num_layers == 0 || p.channels == 0) return cudaSuccess;
  if (p.num_layers < 0 || p.num_layers > kMaxCommitLayers || p.sequences < 0 || p.channels < 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(p.sequences * p.num_layers),
                  static_cast<unsigned>((3 * p.channels + kThreads - 1) / kThreads));
  switch (p.width) {
    case 2:
      conv_commit_kernel<2><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 3:
      conv_commit_kernel<3><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 4:
      conv_commit_kernel<4><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kda::layer::cuda
