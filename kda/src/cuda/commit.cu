// CUDA commit of a record-and-commit verify step (kda.hpp, "Commit"): each row's accepted records
// folded into its state in place, for every head of up to kMaxCommitLayers layers in one launch.
//
// Bound by moving the state (read and written once; the records are a few percent of its bytes).
// One block per (layer, row, head), or two of half its rows where the grid is small, 256 threads:
// each thread holds kVec consecutive channels of K (one 16-byte access: 4 fp32 or 8 bf16) of kSteps
// rows in registers. The block first starts asynchronous copies of the row's accepted records
// (alpha, k^ and u of its rows) into shared memory, then loads its rows of the state, so that both
// are in flight together; then it applies the records in token order with the verify kernel's
// element operations (decode_kernel.cuh: S *= alpha, then S = fma(u, k^, S)), which makes the
// result equal bit for bit to the state the per-token-states verify step keeps; a bf16 state rounds
// once, at the store, as there. The layers' pointers travel by value in the kernel's parameters
// (__grid_constant__, so that the kernel indexes them where they lie instead of copying the array
// to local memory).
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "argument_table.hpp"
#include "cuda/common.cuh"
#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"
#include "kda/nvtx.hpp"

namespace kda::detail {
namespace {

constexpr int D = 128;
constexpr int kThreads = 256;
constexpr int kRecordFloats = 3 * D;

struct CommitPointers {
  const float* records;
  void* pool;
};

struct CommitParams {
  const std::int32_t* slots;
  const std::int32_t* num_accepted;
  std::uint32_t* status;  // caller's device status word, or null
  std::int64_t num_slots;
  std::int32_t padding_slot;
  int batch;
  int tokens;
  int num_heads;
  CommitPointers layers[kMaxCommitLayers];
};
static_assert(sizeof(CommitParams) <= 4096, "kernel parameters must stay within 4 KiB");

// kRowsPerBlock: the rows of S^T a block updates, the whole head (D), or half of it where one block
// a head leaves the multiprocessors with fewer than two blocks each. Every block of a head reads
// the head's alpha and k^ whole, so one block a head reads them once; a grid too small for the
// device is bound by its blocks' latency instead, and halves halve it. On the H200 (kda-bench
// --verify): one commit over 20 layers at B = 64, two rounds, one block a head against two of 64
// rows, fp32 T = 4 / 8 1466 / 1504 us against 1507 / 1581, bf16 784 / 948 against 993-996 / 1285
// (four blocks of 32 rows: 1606-1609 / 1815-1817 and 1290 / 1875); one layer (two calls, so
// roughly) at B = 64 fp32 76.5 / 81.9 against 78.0 / 84.2, bf16 42.6 / 52.2 against 50.7 / 68.9,
// at B = 1 (32 blocks against 64) fp32 3.69 / 4.96 against 2.83 / 3.35, bf16 3.18 / 4.19 against
// 2.82 / 3.51.
template <bool kF32State, int kRowsPerBlock>
__global__ void __launch_bounds__(kThreads)
    kda_commit_kernel(const __grid_constant__ CommitParams p) {
  constexpr int kVec = kF32State ? 4 : 8;                // state elements per 16-byte access
  constexpr int kLanesPerRow = D / kVec;                 // 32 or 16 threads per row
  constexpr int kRowsPerPass = kThreads / kLanesPerRow;  // 8 or 16 rows per block-wide access
  constexpr int kSteps = kRowsPerBlock / kRowsPerPass;   // accesses per thread
  constexpr int kPieces = (D + D + kRowsPerBlock) / 4;   // 16-byte pieces of a token's record
  __shared__ __align__(16) float s_alpha[kMaxDecodeTokens][D];
  __shared__ __align__(16) float s_k[kMaxDecodeTokens][D];
  __shared__ __align__(16) float s_u[kMaxDecodeTokens][kRowsPerBlock];

  const int layer = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.batch));
  const std::int64_t b = blockIdx.x - static_cast<std::int64_t>(layer) * p.batch;
  const int h = blockIdx.y;
  const int v0 = blockIdx.z * kRowsPerBlock;
  // One block per row reports what it skips (the row's first layer, head and part).
  const bool reporter = layer == 0 && h == 0 && blockIdx.z == 0 && threadIdx.x == 0;
  const std::int32_t slot = p.slots[b];
  if (slot < 0 || slot == p.padding_slot) return;  // padding: nothing read or written
  if (slot >= p.num_slots) {
    if (reporter) report_status(p.status, kDeviceStatusSlot);
    return;
  }
  const int n = p.num_accepted[b];
  if (n < 1 || n > p.tokens) {
    if (reporter) report_status(p.status, kDeviceStatusAccepted);
    return;
  }

  const std::int64_t H = p.num_heads;
  const std::int64_t token_stride = H * kRecordFloats;
  const float* rec = p.layers[layer].records + (b * p.tokens * H + h) * kRecordFloats;
  for (int i = threadIdx.x; i < n * kPieces; i += kThreads) {
    const int t = i / kPieces, j = i - t * kPieces;
    const float* src = rec + t * token_stride;
    float* dst;
    if (j < D / 4) {
      src += 4 * j;
      dst = &s_alpha[t][4 * j];
    } else if (j < D / 2) {
      src += D + 4 * (j - D / 4);
      dst = &s_k[t][4 * (j - D / 4)];
    } else {
      src += 2 * D + v0 + 4 * (j - D / 2);
      dst = &s_u[t][4 * (j - D / 2)];
    }
    __pipeline_memcpy_async(dst, src, 16);
  }
  __pipeline_commit();

  const int k0 = kVec * (threadIdx.x % kLanesPerRow);
  const int r0 = threadIdx.x / kLanesPerRow;  // the thread's first row, from v0
  const std::int64_t state_base = (static_cast<std::int64_t>(slot) * H + h) * D * D;
  auto offset = [&](int i) {
    return state_base + static_cast<std::int64_t>(v0 + r0 + kRowsPerPass * i) * D + k0;
  };
  float S[kSteps][kVec];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    if constexpr (kF32State) {
      const float4 f = *reinterpret_cast<const float4*>(
          static_cast<const float*>(p.layers[layer].pool) + offset(i));
      S[i][0] = f.x;
      S[i][1] = f.y;
      S[i][2] = f.z;
      S[i][3] = f.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(
          static_cast<const bf16*>(p.layers[layer].pool) + offset(i));
      const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 pair = unpack_bf16x2(w[j]);
        S[i][2 * j] = pair.x;
        S[i][2 * j + 1] = pair.y;
      }
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  for (int t = 0; t < n; ++t) {
    float a[kVec], kh[kVec];
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      const float4 fa = *reinterpret_cast<const float4*>(&s_alpha[t][k0 + j]);
      const float4 fk = *reinterpret_cast<const float4*>(&s_k[t][k0 + j]);
      a[j] = fa.x;
      a[j + 1] = fa.y;
      a[j + 2] = fa.z;
      a[j + 3] = fa.w;
      kh[j] = fk.x;
      kh[j + 1] = fk.y;
      kh[j + 2] = fk.z;
      kh[j + 3] = fk.w;
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      apply_record(S[i], a, kh, s_u[t][r0 + kRowsPerPass * i]);
    }
  }

#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    if constexpr (kF32State) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.layers[layer].pool) + offset(i)) =
          make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
    } else {
      *reinterpret_cast<uint4*>(static_cast<bf16*>(p.layers[layer].pool) + offset(i)) =
          make_uint4(pack_bf16x2(S[i][0], S[i][1]), pack_bf16x2(S[i][2], S[i][3]),
                     pack_bf16x2(S[i][4], S[i][5]), pack_bf16x2(S[i][6], S[i][7]));
    }
  }
}

}  // namespace
}  // namespace kda::detail

namespace kda {

Status commit_cuda(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                   const std::int32_t* slots, const std::int32_t* num_accepted,
                   std::uint32_t* device_status, void* stream_ptr, const CudaOptions& opt) {
  using namespace detail;
  KDA_NVTX_RANGE("kda.commit");
  Status st = check_cuda_call(p, layers, num_layers, slots, num_accepted, device_status);
  if (!st.ok()) return st;
  if (opt.check_pointers) {
    st = check_device_pointers(p, layers, num_layers, slots, num_accepted);
    if (!st.ok()) return st;
    st = check_device_pointer(device_status, device_status != nullptr ? 4 : 0, "device_status");
    if (!st.ok()) return st;
  }
  if (p.batch == 0 || num_layers == 0) return Status::Ok();
  CommitParams prm{};
  prm.slots = slots;
  prm.num_accepted = num_accepted;
  prm.status = device_status;
  prm.num_slots = p.num_slots;
  prm.padding_slot = p.padding_slot;
  prm.batch = static_cast<int>(p.batch);
  prm.tokens = static_cast<int>(p.tokens);
  prm.num_heads = static_cast<int>(p.num_heads);
  for (int i = 0; i < num_layers; ++i) prm.layers[i] = {layers[i].records, layers[i].state_pool};
  const std::int64_t heads = p.batch * num_layers * p.num_heads;
  const bool halves = heads < 2 * static_cast<std::int64_t>(current_device_sm_count());
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.batch * num_layers),
                     static_cast<unsigned>(p.num_heads), halves ? 2 : 1);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = static_cast<cudaStream_t>(stream_ptr);
  const bool f32 = p.state_dtype == DType::kF32;
  const cudaError_t err =
      halves
          ? cudaLaunchKernelEx(
                &cfg, f32 ? kda_commit_kernel<true, D / 2> : kda_commit_kernel<false, D / 2>, prm)
          : cudaLaunchKernelEx(&cfg, f32 ? kda_commit_kernel<true, D> : kda_commit_kernel<false, D>,
                               prm);
  return cuda_status(err, "kda_commit_kernel");
}

}  // namespace kda
