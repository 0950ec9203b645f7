// kda_segment_scan_kernel and kda_apply_transition_kernel: fp32 state maps of segments (see
// prefill_kernels.cuh and workspace_layout.hpp, "Segments").
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/prefill_kernels.cuh"
#include "cuda/shared_memory.cuh"  // allow_shared_memory

namespace kda::detail {
namespace {

// The scan between the passes: for each (sequence, head, 4 rows of S^T), S_{j+1}^T = S_j^T P_j^T +
// H_j^T for j = 1 .. nseg - 2, in fp32, written over H_j^T. S_1^T comes from segment 0's block.
// Only S carries from step to step: P_{j+1}^T streams into the other shared-memory buffer
// (cp.async) while step j computes, so a step costs its 4 x 128 x 128 products, not a 64 KiB load.
// Warp w owns row w, lane l columns 4l .. 4l + 3 (conflict-free 16-byte reads of P^T rows).
constexpr int kScanRows = 4;
constexpr int kScanThreads = kScanRows * 32;
struct ScanSmem {
  float pt[2][D][D];      // P_j^T, double-buffered
  float s[kScanRows][D];  // the running S^T rows
};

__global__ void __launch_bounds__(kScanThreads) kda_segment_scan_kernel(const PrefillParams p) {
  extern __shared__ __align__(16) unsigned char scan_smem_raw[];
  ScanSmem& sm = *reinterpret_cast<ScanSmem*>(scan_smem_raw);
  const std::int64_t s = blockIdx.x;
  const int h = blockIdx.y;
  const int row0 = blockIdx.z * kScanRows;
  const int tid = threadIdx.x, lane = tid & 31, r = tid >> 5;
  const int c0 = lane * 4;
  std::int64_t bos, eos;
  p.seqs.bounds(s, &bos, &eos);
  const std::int64_t seg_tokens = C * p.seg_chunks;
  const std::int64_t nseg = segments_of((eos - bos + C - 1) / C, p.seg_chunks);
  if (nseg < 3) return;  // nothing between segment 0 and the last
  const std::int64_t base = s + bos / seg_tokens;
  auto prefetch = [&](std::int64_t jj, int buf) {
    const float* pt = seg_block(p, base + jj, h) + static_cast<std::int64_t>(D) * D;
    for (int e = tid; e < D * D / 4; e += kScanThreads)
      cp_async_16(&sm.pt[buf][0][0] + 4 * e, pt + 4 * e);
    cp_async_commit();
  };
  prefetch(1, 1);
  {
    const float* s1 = seg_block(p, base, h) + static_cast<std::int64_t>(row0 + r) * D + c0;
    *reinterpret_cast<float4*>(&sm.s[r][c0]) = *reinterpret_cast<const float4*>(s1);
  }
  for (std::int64_t jj = 1; jj + 1 < nseg; ++jj) {
    const int buf = static_cast<int>(jj & 1);
    float* hrow = seg_block(p, base + jj, h) + static_cast<std::int64_t>(row0 + r) * D + c0;
    const float4 hv = *reinterpret_cast<const float4*>(hrow);  // issued before the wait
    if (jj + 2 < nseg) {
      prefetch(jj + 1, buf ^ 1);  // its buffer was last read in step jj - 1 (barrier below)
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // P_jj^T and this warp's S row are in
    float o0 = hv.x, o1 = hv.y, o2 = hv.z, o3 = hv.w;
#pragma unroll 8
    for (int i = 0; i < D; ++i) {
      const float x = sm.s[r][i];
      const float4 a = *reinterpret_cast<const float4*>(&sm.pt[buf][i][c0]);
      o0 = fmaf(x, a.x, o0);
      o1 = fmaf(x, a.y, o1);
      o2 = fmaf(x, a.z, o2);
      o3 = fmaf(x, a.w, o3);
    }
    __syncthreads();  // every warp is done with P_jj^T and its old S row
    *reinterpret_cast<float4*>(hrow) = make_float4(o0, o1, o2, o3);
    *reinterpret_cast<float4*>(&sm.s[r][c0]) = make_float4(o0, o1, o2, o3);
  }
}

// s_out^T = s_in^T P^T + H^T for one (sequence, head) pair per blockIdx.x and 4 rows of S^T per
// blockIdx.y (warp w: row w; lane l: columns 4l .. 4l + 3). Each warp reads its whole row before
// writing it, so s_out may be s_in (in place).
__global__ void __launch_bounds__(kScanThreads)
    kda_apply_transition_kernel(const float* s_in, const float* p_t, const float* h_t,
                                float* s_out) {
  __shared__ float row_in[kScanRows][D];
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * D * D;
  const int lane = threadIdx.x & 31, r = threadIdx.x >> 5;
  const int row = blockIdx.y * kScanRows + r, c0 = 4 * lane;
  const std::int64_t row_off = base + static_cast<std::int64_t>(row) * D;
  *reinterpret_cast<float4*>(&row_in[r][c0]) =
      *reinterpret_cast<const float4*>(s_in + row_off + c0);
  __syncwarp();
  float4 o = *reinterpret_cast<const float4*>(h_t + row_off + c0);
#pragma unroll 8
  for (int i = 0; i < D; ++i) {
    const float x = row_in[r][i];
    const float4 a =
        *reinterpret_cast<const float4*>(p_t + base + static_cast<std::int64_t>(i) * D + c0);
    o.x = fmaf(x, a.x, o.x);
    o.y = fmaf(x, a.y, o.y);
    o.z = fmaf(x, a.z, o.z);
    o.w = fmaf(x, a.w, o.w);
  }
  *reinterpret_cast<float4*>(s_out + row_off + c0) = o;
}

}  // namespace

Status launch_apply_transition(const float* s_in, const float* p_t, const float* h_t, float* s_out,
                               std::int64_t pairs, cudaStream_t stream) {
  if (pairs == 0) return Status::Ok();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(pairs), D / kScanRows);
  cfg.blockDim = dim3(kScanThreads);
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kda_apply_transition_kernel, s_in, p_t, h_t, s_out),
                     "kda_apply_transition_kernel");
}

Status launch_segment_scan(const PrefillParams& prm, std::int64_t num_seqs, cudaStream_t stream) {
  const cudaError_t err =
      allow_shared_memory<kda_segment_scan_kernel>(static_cast<int>(sizeof(ScanSmem)));
  if (err != cudaSuccess) return cuda_status(err, "cudaFuncSetAttribute(kda_segment_scan_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim =
      dim3(static_cast<unsigned>(num_seqs), static_cast<unsigned>(prm.num_heads), D / kScanRows);
  cfg.blockDim = dim3(kScanThreads);
  cfg.dynamicSmemBytes = sizeof(ScanSmem);
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kda_segment_scan_kernel, prm),
                     "kda_segment_scan_kernel");
}

// How the recurrence is cut: segments of seg_chunks chunks so that about `factor` segment-heads
// per SM run at once (bounded by kSegmentBudget so that workspace_size() holds on any device), or
}  // namespace kda::detail
