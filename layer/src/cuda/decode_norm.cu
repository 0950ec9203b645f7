// layer/src/cuda/decode_norm.cu — a decode step's core with the layer's gated RMSNorm as its
// epilogue: the operator's decode kernel (kda/src/cuda/decode_kernel.cuh) hands each token's head
// rows to GatedNormEpilogue instead of storing o; each lane normalizes the row it holds and writes
// its y (the norm kernel's operations, gated_rmsnorm.cu, but the sum of squares taken in another
// order: y may differ from the separate kernels' in its last bits): one launch and o's round trip
// fewer a step. A row the step skips (padding, bad metadata) gets zeros in y. The epilogue needs
// one block a head (the head's sum of squares spans its warps) and meets them at a block barrier
// for every token. At several tokens a row those barriers cost more than o's round trip and a
// launch (H200: the records step at H = 32, B = 256, T = 4 652 against 545 us), and a step of one
// token a row of more (row, head) pairs than about a wave of blocks loses more to the single
// block a head than the launch costs (bf16 state, H = 32 B = 256: 267 against 219 us): such steps
// store o (zeros for the rows they skip) from the operator's kernel, cut into blocks as the
// operator's rule cuts it, then run the norm kernel (split_core below).
#include "cuda/decode_kernel.cuh"  // the operator's decode step (kda/src/cuda)
#include "cuda/factor_rows.cuh"    // round_bf16
#include "cuda/head_step.cuh"      // sum_over_warp, the norm's arithmetic
#include "cuda/kernels.hpp"

namespace kda::layer::cuda {

namespace {

constexpr int D = kNormHeadDim;

// A skipped (row b, head h)'s rows of dst (bf16 [tokens, heads, D]): zeros for each of its tokens,
// four values a thread of the block's first 32.
__device__ __forceinline__ void zero_skipped_rows(std::uint16_t* dst,
                                                  const kda::detail::DecodeParams& p,
                                                  std::int64_t b, int h) {
  if (threadIdx.x >= 32) return;
  for (int t = 0; t < p.tokens; ++t) {
    const std::int64_t at =
        ((b * p.tokens + t) * p.num_heads + h) * D + 4 * static_cast<int>(threadIdx.x);
    *reinterpret_cast<uint2*>(dst + at) = make_uint2(0, 0);
  }
}

struct GatedNormEpilogue {
  static constexpr bool kWholeHead = true;  // the head's sum of squares spans its 8 warps
  const float* gate;
  const std::uint16_t* bias;
  const float* o_norm;
  std::uint16_t* y;
  float eps;

  // The row's norm weight and output gate, loaded before the step.
  struct Row {
    float weight = 0.0f, gate = 0.0f;
  };
  __device__ __forceinline__ Row ahead(const kda::detail::DecodeParams& p, std::int64_t tok, int h,
                                       int row, bool holds) const {
    Row r;
    if (holds) {
      const float b = bias != nullptr ? bits_to_float(bias[h * D + row]) : 0.0f;
      r.gate = output_gate(gate[(tok * p.num_heads + h) * D + row], b);
      r.weight = o_norm[row];
    }
    return r;
  }
  // Each lane its row: o rounded to bf16 (as the core stores it), the head's sum of squares
  // (each warp's by shuffles, then the eight warps' in order from shared memory, two buffers by
  // the token's parity so that one barrier a token suffices), y stored.
  __device__ __forceinline__ void token(const kda::detail::DecodeParams& p, std::int64_t tok, int h,
                                        int row, float value, bool holds, const Row& r) const {
    __shared__ float partial[2][kda::detail::kWarps];
    const float o = round_bf16(value);
    float sum_squares[1] = {holds ? o * o : 0.0f};
    sum_over_warp(sum_squares);
    float* sums = partial[tok & 1];
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = sum_squares[0];
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kda::detail::kWarps; ++w) total += sums[w];
    if (holds) {
      y[(tok * p.num_heads + h) * D + row] =
          float_to_bits(gated_norm1(o, head_inv_rms_of(total, eps), r.weight, r.gate));
    }
  }
  // A skipped row's y: zeros for each of its tokens.
  __device__ __forceinline__ void skipped(const kda::detail::DecodeParams& p, std::int64_t b,
                                          int h) const {
    zero_skipped_rows(y, p, b, h);
  }
};

// The core's rows stored into its out (the norm's o) as the operator stores them, a skipped row's
// as zeros (so that the norm kernel after it writes zeros into y); a head may be cut into several
// blocks.
struct StoreOZeroSkipped : kda::detail::StoreOut {
  // The head's first block writes the zeros (each of its blocks calls this).
  __device__ __forceinline__ void skipped(const kda::detail::DecodeParams& p, std::int64_t b,
                                          int h) const {
    if (blockIdx.z == 0) zero_skipped_rows(reinterpret_cast<std::uint16_t*>(p.out), p, b, h);
  }
};

// A step of one token a row splits above this many (row, head) pairs where the operator's rule
// cuts a head into several blocks. Below it the step's blocks are about one wave at one block a
// head, and the norm's launch costs more than the finer cut gains (H200, graph replays per layer,
// the epilogue against the split step: 1.00-1.04x at 192-256 pairs, 0.96-0.99x from 384 with an
// fp32 state, 0.81-0.98x from 288 with a bf16 state; docs/design/layer.md).
constexpr std::int64_t kSplitOneTokenAbovePairs = 256;

// Whether a step stores o and runs the norm's own launch (below) rather than the epilogue: every
// step of several tokens, and a step of one token a row above kSplitOneTokenAbovePairs pairs that
// the operator's rule cuts. KDA_LAYER_SPLIT_CORE (a benchmark knob, read once; not part of the
// contract): 0 keeps every step on the epilogue, 1 splits every step. The problem must have passed
// can_implement (its sizes bounded).
bool split_core(const kda::DecodeProblem& problem, const kda::CudaOptions& options) {
  static const int knob = [] {
    const char* env = std::getenv("KDA_LAYER_SPLIT_CORE");
    if (env == nullptr) return -1;
    return std::string(env) == "0" ? 0 : 1;
  }();
  if (knob >= 0) return knob == 1;
  if (problem.tokens > 1) return true;
  return problem.batch * problem.num_heads > kSplitOneTokenAbovePairs &&
         kda::detail::decode_blocks_per_head(problem, options) > 1;
}

}  // namespace

kda::Status decode_with_gated_norm(const kda::DecodeProblem& problem,
                                   const kda::DecodeTensors& tensors, const GatedNormParams& norm,
                                   cudaStream_t stream, const kda::CudaOptions& options) {
  if (norm.gate == nullptr || norm.o_norm == nullptr || norm.y == nullptr ||
      reinterpret_cast<std::uintptr_t>(norm.y) % 8 != 0 ||
      reinterpret_cast<std::uintptr_t>(norm.gate) % 4 != 0 ||
      reinterpret_cast<std::uintptr_t>(norm.o_norm) % 4 != 0) {
    return kda::Status(kda::StatusCode::kInvalidArgument,
                       "decode with the gated norm: gate, o_norm and y must be set and aligned");
  }
  // The problem's own checks first (its sizes bounded before the products below).
  if (const kda::Status st = kda::can_implement(problem, kda::Backend::kCuda); !st.ok()) return st;
  if (split_core(problem, options)) {
    if (norm.o == nullptr || norm.o != tensors.out ||
        reinterpret_cast<std::uintptr_t>(norm.o) % 8 != 0 ||
        reinterpret_cast<std::uintptr_t>(norm.gate) % 16 != 0 ||
        norm.rows != problem.batch * problem.tokens * problem.num_heads ||
        norm.heads != problem.num_heads) {
      return kda::Status(kda::StatusCode::kInvalidArgument,
                         "decode with the gated norm: o (the core's out, 8-byte aligned), gate "
                         "(16-byte aligned), rows and heads must be set for a step that stores o");
    }
    const StoreOZeroSkipped store{};
    const kda::Status st = kda::detail::launch_decode(problem, tensors, stream, options, store);
    if (!st.ok() || problem.batch == 0) return st;
    return kda::detail::cuda_status(launch_gated_rmsnorm(norm, stream), "gated_rmsnorm_kernel");
  }
  const GatedNormEpilogue epilogue{norm.gate, norm.bias, norm.o_norm, norm.y, norm.eps};
  return kda::detail::launch_decode(problem, tensors, stream, options, epilogue);
}

}  // namespace kda::layer::cuda
