// engine/src/cuda/conv_prefill.cu — the short convolutions (+ SiLU) of q, k and v over a varlen
// prefill batch, from and to each sequence's conv state, fused with the copy of beta into the
// core's layout. One thread: two channels x one chunk of up to kConvChunk tokens of one sequence.
#include "cuda/conv_silu.cuh"

namespace kda::engine::cuda {

namespace {

// A sequence n owns chunk slots [n + cu[n] / kConvChunk, ... + ceil(len_n / kConvChunk)): disjoint,
// all below ceil(tokens / kConvChunk) + sequences (the operator hands out its chunks the same way).
__device__ __forceinline__ std::int64_t clamped_cu(const ConvParams& p, std::int64_t n) {
  const std::int64_t value = p.cu_seqlens[n];
  return value < 0 ? 0 : (value > p.tokens ? p.tokens : value);
}
__device__ __forceinline__ std::int64_t first_slot(const ConvParams& p, std::int64_t n) {
  return n + clamped_cu(p, n) / kConvChunk;
}

template <int W>
__global__ void __launch_bounds__(kConvThreads) conv_prefill_kernel(ConvParams p) {
  const std::int64_t s = blockIdx.x;
  // The sequence owning slot s: the last n with first_slot(n) <= s (first_slot(0) == 0 <= s).
  // Broken cu_seqlens contents (the core reports them) only change which in-range rows are used.
  std::int64_t lo = 0, hi = p.sequences - 1;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (first_slot(p, mid) <= s) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const std::int64_t n = lo;
  const std::int64_t bos = clamped_cu(p, n);
  std::int64_t eos = clamped_cu(p, n + 1);
  eos = eos < bos ? bos : eos;
  const std::int64_t chunk = s - first_slot(p, n);
  const std::int64_t t_begin = bos + chunk * kConvChunk;
  if (chunk < 0 || t_begin >= eos) return;  // an unused slot (block-uniform)
  const std::int64_t t_end = t_begin + kConvChunk < eos ? t_begin + kConvChunk : eos;

  if (blockIdx.y == 0) copy_beta(p, t_begin, t_end);
  const std::int64_t c = 2 * (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  if (c >= 3 * p.channels) return;
  const bool first_chunk = chunk == 0;
  const std::int64_t slot = first_chunk ? state_row(p, n, c == 0) : -1;
  conv_pair<W>(p, c, bos, eos, t_begin, t_end, first_chunk, slot);
}

}  // namespace

cudaError_t launch_conv_prefill(const ConvParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.sequences == 0) return cudaSuccess;
  const std::int64_t chunk_slots = (p.tokens + kConvChunk - 1) / kConvChunk + p.sequences;
  const std::int64_t pairs = 3 * p.channels / 2;
  const dim3 grid(static_cast<unsigned>(chunk_slots),
                  static_cast<unsigned>((pairs + kConvThreads - 1) / kConvThreads));
  switch (p.width) {
    case 2:
      conv_prefill_kernel<2><<<grid, kConvThreads, 0, stream>>>(p);
      break;
    case 3:
      conv_prefill_kernel<3><<<grid, kConvThreads, 0, stream>>>(p);
      break;
    case 4:
      conv_prefill_kernel<4><<<grid, kConvThreads, 0, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kda::engine::cuda
