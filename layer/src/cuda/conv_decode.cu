// layer/src/cuda/conv_decode.cu — the short convolutions (+ SiLU) of q, k and v for a decode step:
// every sequence has the same few tokens (rows n * k .. n * k + k - 1), each starts from its conv
// state and leaves the new one behind. Fused with the copy of beta into the core's layout and, when
// the caller gave no slot list, the identity slot list kda::decode_cuda needs. One thread: eight
// channels of one sequence (16-byte loads and stores, 16-byte state accesses when the pools are
// 16-byte aligned).
#include "cuda/conv_silu.cuh"

namespace kda::layer::cuda {

namespace {

// A fold (ConvParams::fold_rows): channels c .. c + 7 of the row's conv state become the last W-1
// of (old ++ the folded row's first `accepted` pre-conv inputs): bf16 bits moved, as the commit
// (conv_commit.cu) moves them, stored before the conv reads the state again (same thread).
template <int W>
__device__ __forceinline__ void fold_conv_state(const ConvParams& p, bool vector_state,
                                                std::int64_t c, std::int64_t row,
                                                std::int64_t accepted, std::int64_t slot) {
  constexpr int kHist = W - 1;
  const int branch = static_cast<int>(c / p.channels);
  const std::int64_t cc = c - branch * p.channels;
  std::uint16_t* state = p.pools[branch] + (slot * p.channels + cc) * kHist;
  std::uint16_t bits[kConvVec * kHist];
  load_state<kHist>(state, vector_state, bits);
  const std::int64_t rec_stride = 3 * p.channels / kConvVec;  // in uint4
  const uint4* inputs =
      reinterpret_cast<const uint4*>(p.fold_conv_records + c) + row * p.fold_tokens * rec_stride;
  for (std::int64_t t = 0; t < accepted; ++t) {
    const uint4 u = __ldg(inputs + t * rec_stride);
    const std::uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < kConvVec; ++i) {
#pragma unroll
      for (int k = 0; k + 1 < kHist; ++k) bits[i * kHist + k] = bits[i * kHist + k + 1];
      bits[i * kHist + kHist - 1] = static_cast<std::uint16_t>(words[i / 2] >> (16 * (i % 2)));
    }
  }
  store_state<kHist>(state, vector_state, bits);
}

template <int W, bool kVerify>
__global__ void __launch_bounds__(kConvThreads)
    conv_decode_kernel(ConvParams p, bool vector_state) {
  const std::int64_t n = blockIdx.x;
  const std::int64_t bos = n * p.decode_tokens, eos = bos + p.decode_tokens;
  if (blockIdx.y == 0) {
    if (threadIdx.x == 0 && p.identity_slots != nullptr) {
      p.identity_slots[n] = static_cast<std::int32_t>(n);
    }
    copy_beta(p, bos, eos);
  }
  const std::int64_t c =
      kConvVec * (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  if (c >= 3 * p.channels) return;
  std::int64_t slot = state_row<kVerify>(p, n, c == 0);
  if (p.fold_rows != nullptr && slot >= 0 && p.fold_rows[n] >= 0) {
    const std::int64_t row = p.fold_rows[n], accepted = p.fold_counts[n];
    if (row >= p.fold_sequences || accepted < 1 || accepted > p.fold_tokens) {
      if (c == 0 && p.status != nullptr) atomicOr(p.status, kDeviceStatusAccepted);
      slot = -1;  // padding, as the core takes it
    } else {
      fold_conv_state<W>(p, vector_state, c, row, accepted, slot);
    }
  }
  conv8<W, kVerify>(p, vector_state, c, bos, eos, bos, eos, true, slot);
  if (p.conv_records != nullptr && slot >= 0) {
    // A records step: the row's conv inputs, which the commit shifts into the conv state (the
    // projection's own bf16 values, so the committed state is exact).
    const std::int64_t in_stride = p.proj_stride / kConvVec, rec_stride = 3 * p.channels / kConvVec;
    const uint4* column = reinterpret_cast<const uint4*>(p.proj + c);
    uint4* record = reinterpret_cast<uint4*>(p.conv_records + c);
    for (std::int64_t t = bos; t < eos; ++t) record[t * rec_stride] = __ldg(column + t * in_stride);
  }
}

template <int W>
void launch_width(const ConvParams& p, bool vector_state, bool verify, dim3 grid, unsigned threads,
                  cudaStream_t stream) {
  if (verify) {
    conv_decode_kernel<W, true><<<grid, threads, 0, stream>>>(p, vector_state);
  } else {
    conv_decode_kernel<W, false><<<grid, threads, 0, stream>>>(p, vector_state);
  }
}

}  // namespace

cudaError_t launch_conv_decode(const ConvParams& p, cudaStream_t stream) {
  if (p.sequences == 0) return cudaSuccess;
  bool vector_state = false;
  if (const cudaError_t err = check_conv_layout(p, &vector_state); err != cudaSuccess) return err;
  const ConvShape shape = conv_shape(p.channels);
  const dim3 grid(static_cast<unsigned>(p.sequences), shape.tiles);
  if (p.conv_records != nullptr && !aligned16(p.conv_records)) return cudaErrorInvalidValue;
  if (p.fold_rows != nullptr && (p.fold_counts == nullptr || !aligned16(p.fold_conv_records))) {
    return cudaErrorInvalidValue;
  }
  const bool verify = p.num_accepted != nullptr;
  switch (p.width) {
    case 2:
      launch_width<2>(p, vector_state, verify, grid, shape.threads, stream);
      break;
    case 3:
      launch_width<3>(p, vector_state, verify, grid, shape.threads, stream);
      break;
    case 4:
      launch_width<4>(p, vector_state, verify, grid, shape.threads, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kda::layer::cuda
