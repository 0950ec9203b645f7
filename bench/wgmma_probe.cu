// kda-wgmma-probe: the first step of the recurrence on wgmma (docs/design/prefill.md, "Not built").
// Not part of the library: two measurements that decide whether the recurrence should move from
// mma.sync + ldmatrix to wgmma, before any kernel is rewritten.
//   1. Layout check. One warpgroup runs one chunk step on wgmma from the design's record layout
//      (128-byte-swizzled token-major tiles, a 32-byte-swizzled M): U = U0 - S W^T (A = S
//      from registers, scale-a -1), S' = S diag(g) + U K^ (B read MN-major, trans-b 1) and
//      O = U M^T, against an fp64 host reference from the same bf16 operands. The relative errors
//      should be ~1e-7 (fp32 sums); a wrong descriptor gives O(1).
//   2. Latency of the state chain (pack S, X, U, decay, update) per step, wgmma against today's
//      mma.sync + ldmatrix chain (the one-m-tile recurrence's), for one and two warpgroups per
//      block at 1, 132, 264 and 528 blocks, shared memory pinning both kernels to two blocks (128
//      threads) or one (256) per SM. The design's go: wgmma >= ~1.3x faster at one block.
// Exit status 1 if the layout check fails (relative error above 1e-3) or a launch fails.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/ptx.cuh"

using kda::detail::bf16;
namespace d = kda::detail;

namespace {

constexpr int kRows = 64;     // state rows (V) per warpgroup
constexpr int kK = 128;       // state columns (K channels)
constexpr int kTok = 16;      // tokens per chunk
constexpr int kTile = 4096;   // one [16][128] bf16 tile in the swizzled layout
constexpr int kMTile = 512;   // one [16][16] bf16 tile
constexpr int kPadRow = 136;  // today's padded rows (bf16), for the mma.sync chain
// Shared bytes per warpgroup in the timing kernel: W and K^ in either layout (2 x 4,352 padded),
// rounded to the 1,024-byte alignment of the swizzle atoms.
constexpr int kGroupBytes = 9216;

// Byte offset of (token t, channel c) in a [16][128] tile: two 2,048-byte halves (channels 0-63,
// 64-127) of 16 rows of 128 bytes, 16-byte chunks XOR-swizzled by the row (128-byte swizzle).
__host__ __device__ int tile_offset(int t, int c) {
  return (c / 64) * 2048 + t * 128 + ((((c / 8) % 8) ^ (t % 8)) * 16) + (c % 8) * 2;
}
// Byte offset of (i, j) in a 16 x 16 tile with 32-byte rows (32-byte swizzle).
__host__ __device__ int m_offset(int i, int j) {
  return i * 32 + (((j / 8) ^ ((i / 4) & 1)) * 16) + (j % 8) * 2;
}
// Row (V) and column of accumulator element e of an m16n8 C layout repeated along N, this lane.
__device__ int acc_row(int warp, int lane, int e) {
  return 16 * (warp % 4) + (lane >> 2) + 8 * ((e >> 1) & 1);
}
__device__ int acc_col(int lane, int e) { return 8 * (e >> 2) + 2 * (lane & 3) + (e & 1); }

// Dynamic shared memory rounded up to 1,024 bytes (the swizzle atoms' alignment).
__device__ unsigned char* aligned_smem(unsigned char* raw) {
  const unsigned a = d::smem_addr(raw);
  return raw + ((1024u - (a & 1023u)) & 1023u);
}

__device__ void pack_state(const float (&acc)[64], unsigned (&sa)[8][4]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      sa[k][j] = d::pack_bf16x2(acc[8 * k + 2 * j], acc[8 * k + 2 * j + 1]);
  }
}

__global__ void check_kernel(const float* S, const bf16* W, const bf16* K, const bf16* M,
                             const float* U0, const float* g, float* U_out, float* S_out,
                             float* O_out) {
  extern __shared__ unsigned char raw[];
  unsigned char* sm = aligned_smem(raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kTok * kK; i += blockDim.x) {
    const int off = tile_offset(i / kK, i % kK);
    *reinterpret_cast<bf16*>(sm + off) = W[i];
    *reinterpret_cast<bf16*>(sm + kTile + off) = K[i];
  }
  for (int i = tid; i < kTok * kTok; i += blockDim.x)
    *reinterpret_cast<bf16*>(sm + 2 * kTile + m_offset(i / kTok, i % kTok)) = M[i];
  d::fence_proxy_async();  // generic stores, then wgmma's (async proxy) reads
  __syncthreads();

  float acc[64], x[8], o[8] = {};
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[e] = S[acc_row(warp, lane, e) * kK + acc_col(lane, e)];
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = U0[acc_row(warp, lane, e) * kTok + acc_col(lane, e)];
  unsigned sa[8][4];
  pack_state(acc, sa);

  // X: U = U0 - S W^T, k-step k at channels 16k: half k / 4, 32 bytes per step inside it.
  d::wgmma_fence_operands(x);
  d::wgmma_fence();
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const std::uint64_t desc =
        d::wgmma_desc(sm + (k / 4) * 2048 + (k % 4) * 32, 16, 1024, d::WgmmaSwizzle::k128B);
    d::wgmma_m64n16k16<-1>(x, sa[k], desc);
  }
  d::wgmma_commit();
  d::wgmma_wait<0>();
  d::wgmma_fence_operands(x);

  unsigned ua[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) ua[j] = d::pack_bf16x2(x[2 * j], x[2 * j + 1]);
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[e] *= g[acc_col(lane, e)];

  // The update (K^ MN-major: LBO the next 64-channel half, SBO the next 8 tokens) and O = U M^T.
  d::wgmma_fence_operands(acc);
  d::wgmma_fence_operands(o);
  d::wgmma_fence();
  d::wgmma_m64n128k16_trans_b(acc, ua,
                              d::wgmma_desc(sm + kTile, 2048, 1024, d::WgmmaSwizzle::k128B));
  d::wgmma_m64n16k16<1>(o, ua, d::wgmma_desc(sm + 2 * kTile, 16, 256, d::WgmmaSwizzle::k32B));
  d::wgmma_commit();
  d::wgmma_wait<0>();
  d::wgmma_fence_operands(acc);
  d::wgmma_fence_operands(o);

#pragma unroll
  for (int e = 0; e < 64; ++e) S_out[acc_row(warp, lane, e) * kK + acc_col(lane, e)] = acc[e];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    U_out[acc_row(warp, lane, e) * kTok + acc_col(lane, e)] = x[e];
    O_out[acc_row(warp, lane, e) * kTok + acc_col(lane, e)] = o[e];
  }
}

// The state chain, `steps` times, on zero tiles (only the time counts). WGMMA: X by 8 wgmma and
// the update by one; otherwise today's one-m-tile chain: 8 ldmatrix + 16 mma for X, 8
// ldmatrix.trans + 16 mma for the update. Each warpgroup (of 1 or 2) has its own tiles.
template <bool WGMMA>
__global__ void chain_kernel(int steps, float* sink) {
  extern __shared__ unsigned char raw[];
  unsigned char* sm = aligned_smem(raw);
  const int tid = threadIdx.x, lane = tid & 31;
  for (int i = tid; i < 2 * kGroupBytes / 4; i += blockDim.x) reinterpret_cast<float*>(sm)[i] = 0.f;
  d::fence_proxy_async();
  __syncthreads();
  unsigned char* tiles = sm + (tid / 128) * kGroupBytes;  // this warpgroup's W and K^
  const bf16(*w_pad)[kPadRow] = reinterpret_cast<const bf16(*)[kPadRow]>(tiles);
  const bf16(*k_pad)[kPadRow] =
      reinterpret_cast<const bf16(*)[kPadRow]>(tiles + kTok * kPadRow * 2);
  const int lrow = (lane & 7) + ((lane >> 4) << 3), lcol = ((lane >> 3) & 1) * 8;
  float acc[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[e] = 0.01f * e;
  const float decay = 1.f - 1e-7f * static_cast<float>(tid);
  for (int step = 0; step < steps; ++step) {
    unsigned sa[8][4];
    pack_state(acc, sa);
    float x[8] = {};
    if constexpr (WGMMA) {
      d::wgmma_fence_operands(x);
      d::wgmma_fence();
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        d::wgmma_m64n16k16<-1>(
            x, sa[k],
            d::wgmma_desc(tiles + (k / 4) * 2048 + (k % 4) * 32, 16, 1024, d::WgmmaSwizzle::k128B));
      }
      d::wgmma_commit();
      d::wgmma_wait<0>();
      d::wgmma_fence_operands(x);
    } else {
      float xs[2][2][4] = {};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        unsigned b0, b1, b2, b3;
        d::ldmatrix_x4(b0, b1, b2, b3, &w_pad[lrow][k * 16 + lcol]);
        d::mma_bf16(xs[k & 1][0], sa[k], b0, b1);
        d::mma_bf16(xs[k & 1][1], sa[k], b2, b3);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = -(xs[0][e / 4][e % 4] + xs[1][e / 4][e % 4]);
    }
    unsigned ua[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) ua[j] = d::pack_bf16x2(x[2 * j], x[2 * j + 1]);
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] *= decay;
    if constexpr (WGMMA) {
      d::wgmma_fence_operands(acc);
      d::wgmma_fence();
      d::wgmma_m64n128k16_trans_b(acc, ua,
                                  d::wgmma_desc(tiles + kTile, 2048, 1024, d::WgmmaSwizzle::k128B));
      d::wgmma_commit();
      d::wgmma_wait<0>();
      d::wgmma_fence_operands(acc);
    } else {
      float(&acc_n)[16][4] = *reinterpret_cast<float(*)[16][4]>(acc);
#pragma unroll
      for (int n = 0; n < 16; n += 2) {
        unsigned b0, b1, b2, b3;
        d::ldmatrix_x4_trans(b0, b1, b2, b3, &k_pad[lane & 15][8 * n + ((lane >> 4) << 3)]);
        d::mma_bf16(acc_n[n], ua, b0, b1);
        d::mma_bf16(acc_n[n + 1], ua, b2, b3);
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 64; ++e) s += acc[e];
  sink[blockIdx.x * blockDim.x + tid] = s;
}

float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

double rel_error(const std::vector<float>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  cudaMalloc(&p, host.size() * sizeof(T));
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

bool check_layout() {
  std::mt19937 rng(20261130);
  std::uniform_real_distribution<float> uni(-1.f, 1.f), pos(0.5f, 1.f);
  std::vector<float> S(kRows * kK), U0(kRows * kTok), g(kK);
  std::vector<bf16> W(kTok * kK), K(kTok * kK), M(kTok * kTok);
  for (float& v : S) v = uni(rng);
  for (float& v : U0) v = uni(rng);
  for (float& v : g) v = pos(rng);
  for (bf16& v : W) v = __float2bfloat16(uni(rng));
  for (bf16& v : K) v = __float2bfloat16(uni(rng));
  for (bf16& v : M) v = __float2bfloat16(uni(rng));
  float *dS = device_copy(S), *dU0 = device_copy(U0), *dg = device_copy(g);
  bf16 *dW = device_copy(W), *dK = device_copy(K), *dM = device_copy(M);
  float *dU, *dSo, *dO;
  cudaMalloc(&dU, U0.size() * 4);
  cudaMalloc(&dSo, S.size() * 4);
  cudaMalloc(&dO, U0.size() * 4);
  const int smem = 2 * kTile + kMTile + 1024;
  check_kernel<<<1, 128, smem>>>(dS, dW, dK, dM, dU0, dg, dU, dSo, dO);
  cudaError_t err = cudaGetLastError();  // a launch error (cudaDeviceSynchronize misses those)
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  std::vector<float> U(U0.size()), So(S.size()), O(U0.size());
  cudaMemcpy(U.data(), dU, U.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(So.data(), dSo, So.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(O.data(), dO, O.size() * 4, cudaMemcpyDeviceToHost);
  for (void* p : {static_cast<void*>(dS), static_cast<void*>(dU0), static_cast<void*>(dg),
                  static_cast<void*>(dW), static_cast<void*>(dK), static_cast<void*>(dM),
                  static_cast<void*>(dU), static_cast<void*>(dSo), static_cast<void*>(dO)})
    cudaFree(p);
  if (err != cudaSuccess) {
    std::printf("layout check: launch failed: %s\n", cudaGetErrorString(err));
    return false;
  }
  // References from the GPU's own bf16 operands (S rounded for X; U as the GPU rounded it).
  std::vector<double> U_ref(U.size()), S_ref(S.size()), O_ref(O.size());
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTok; ++t) {
      double u = U0[r * kTok + t];
      for (int c = 0; c < kK; ++c)
        u -= static_cast<double>(round_bf16(S[r * kK + c])) * __bfloat162float(W[t * kK + c]);
      U_ref[r * kTok + t] = u;
      double o = 0;
      for (int j = 0; j < kTok; ++j)
        o += static_cast<double>(round_bf16(U[r * kTok + j])) * __bfloat162float(M[t * kTok + j]);
      O_ref[r * kTok + t] = o;
    }
    for (int c = 0; c < kK; ++c) {
      double s = static_cast<double>(S[r * kK + c]) * g[c];
      for (int t = 0; t < kTok; ++t)
        s += static_cast<double>(round_bf16(U[r * kTok + t])) * __bfloat162float(K[t * kK + c]);
      S_ref[r * kK + c] = s;
    }
  }
  const double eu = rel_error(U, U_ref), es = rel_error(So, S_ref), eo = rel_error(O, O_ref);
  // fp32 sums give ~1e-7 to 1e-6 (the tensor core's accumulator rounding is not measured); a
  // wrong layout or descriptor gives O(1).
  const bool ok = eu <= 1e-3 && es <= 1e-3 && eo <= 1e-3;
  std::printf(
      "| layout check | X (U = U0 - S W^T) | update (S diag(g) + U K^) | U M^T | verdict |\n");
  std::printf("|---|---:|---:|---:|---|\n");
  std::printf("| relative error vs fp64 | %.2e | %.2e | %.2e | %s |\n\n", eu, es, eo,
              ok ? "pass" : "FAIL (a layout or descriptor is wrong)");
  return ok;
}

bool time_chains() {
  // Shared memory pins the blocks per SM alike for both kernels (their register counts differ:
  // 96 and 130), as in the recurrence: two blocks of 128 threads per SM, one of 256.
  const int steps = 4000, max_smem = 128 * 1024;
  float* sink = nullptr;
  if (cudaMalloc(&sink, 528 * 256 * sizeof(float)) != cudaSuccess) return false;
  cudaFuncSetAttribute(chain_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  cudaFuncSetAttribute(chain_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  bool ok = true;
  std::printf("ns per step: kernel time / steps, whatever the number of waves; best of three\n\n");
  std::printf(
      "| threads per block | blocks | mma.sync ns per step | wgmma ns per step | ratio |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (int threads : {128, 256}) {
    const int smem = threads == 128 ? 96 * 1024 : 128 * 1024;
    for (int blocks : {1, 132, 264, 528}) {
      float ns[2] = {1e30f, 1e30f};
      for (int round = 0; round < 3; ++round) {  // the two kernels alternating
        for (int wg = 0; wg < 2; ++wg) {
          void (*kernel)(int, float*) = wg ? chain_kernel<true> : chain_kernel<false>;
          kernel<<<blocks, threads, smem>>>(10, sink);  // warm-up
          cudaEventRecord(start);
          kernel<<<blocks, threads, smem>>>(steps, sink);
          cudaEventRecord(stop);
          cudaEventSynchronize(stop);
          const cudaError_t err = cudaGetLastError();
          if (err != cudaSuccess) {
            std::printf("launch failed: %s\n", cudaGetErrorString(err));
            ok = false;
          }
          float ms = 0.f;
          cudaEventElapsedTime(&ms, start, stop);
          ns[wg] = std::min(ns[wg], ms * 1e6f / steps);
        }
      }
      std::printf("| %d | %d | %.1f | %.1f | %.2fx |\n", threads, blocks, ns[0], ns[1],
                  ns[0] / ns[1]);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(sink);
  return ok;
}

}  // namespace

int main() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    std::printf("kda-wgmma-probe: no CUDA device\n");
    return 1;
  }
  if (major != 9) {
    std::printf("kda-wgmma-probe: needs sm_90 (this device is sm_%d%d)\n", major, minor);
    return 1;
  }
  const bool layout_ok = check_layout();
  const bool timing_ok = time_chains();
  return layout_ok && timing_ok ? 0 : 1;
}
