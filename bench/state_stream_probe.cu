// kda-state-stream-probe: how fast the decode step's state traffic alone can go (docs/design/
// decode.md, "What was learned"). Not part of the library, and not a test: timings only.
//
// A decode step of one token a row reads each (row, head)'s fp32 state (64 KiB at K = V = 128) and
// writes it back in place; the floors of kda-bench compare that with cudaMemcpy's rate. These
// kernels move exactly those bytes and do nothing else (each value times a constant), H = 32, B
// rows on every slot of a pool of B slots, several pools in turn so that no call finds its states
// in L2, CUDA events, median of 20 after 5:
//   copy          a grid-stride copy of the same bytes into another buffer (no slots);
//   in place xN   a block a (row, head) in the decode kernel's geometry, its 8 warps cut into N
//                 blocks (decode_blocks_per_head): warp w rows [16w, 16w + 16), a lane 4 channels;
//   persistent    one block of 8 warps a multiprocessor walking the (row, head) pairs, the next
//                 pair's state loaded into a second set of registers before the current one's
//                 stores;
//   persistent, shared memory   two such blocks a multiprocessor, the next pair's state brought
//                 into shared memory by one bulk copy (an mbarrier) while the current one's goes
//                 out.
// Against these, run `kda-bench --decode --batch B` in the same call.
//
//   kda-state-stream-probe [--batch B ...]   (default 64 and 256)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "cuda/ptx.cuh"

namespace {

constexpr int D = 128;      // K = V
constexpr int kHeads = 32;  // Kimi-Linear-48B's
constexpr int kRowsPerWarp = 16;

// Each value times `scale`: what stands for the step's arithmetic (none of its latency).
__device__ __forceinline__ void scale_rows(float4 (&rows)[kRowsPerWarp], float scale) {
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    rows[i].x *= scale;
    rows[i].y *= scale;
    rows[i].z *= scale;
    rows[i].w *= scale;
  }
}

// The decode kernel's geometry: blockIdx (row, head, cut), 8 / SPLIT warps a block.
template <int SPLIT>
__global__ void __launch_bounds__(256 / SPLIT, 2 * SPLIT)
    in_place_kernel(float* pool, const int* slots, int heads, float scale) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int warp = (threadIdx.x >> 5) + blockIdx.z * (8 / SPLIT), lane = threadIdx.x & 31;
  const std::int64_t base = (static_cast<std::int64_t>(slots[b]) * heads + h) * D * D +
                            static_cast<std::int64_t>(warp) * kRowsPerWarp * D + lane * 4;
  float4 s[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i)
    s[i] = *reinterpret_cast<const float4*>(pool + base + i * D);
  scale_rows(s, scale);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) *reinterpret_cast<float4*>(pool + base + i * D) = s[i];
}

// One block of 8 warps a multiprocessor, pair blockIdx.x, + gridDim.x, ...
__global__ void __launch_bounds__(256, 1)
    persistent_kernel(float* pool, const int* slots, int heads, int pairs, float scale) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto base_of = [&](int pair) {
    return (static_cast<std::int64_t>(slots[pair / heads]) * heads + pair % heads) * D * D +
           static_cast<std::int64_t>(warp) * kRowsPerWarp * D + lane * 4;
  };
  int pair = blockIdx.x;
  if (pair >= pairs) return;
  float4 current[kRowsPerWarp], next[kRowsPerWarp];
  std::int64_t base = base_of(pair);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    current[i] = *reinterpret_cast<const float4*>(pool + base + i * D);
  }
  for (;;) {
    const int following = pair + static_cast<int>(gridDim.x);
    const bool more = following < pairs;
    const std::int64_t next_base = more ? base_of(following) : 0;
    if (more) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        next[i] = *reinterpret_cast<const float4*>(pool + next_base + i * D);
      }
    }
    scale_rows(current, scale);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      *reinterpret_cast<float4*>(pool + base + i * D) = current[i];
    }
    if (!more) break;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) current[i] = next[i];
    base = next_base;
    pair = following;
  }
}

constexpr unsigned kStateBytes = D * D * sizeof(float);
constexpr std::size_t kSharedBytes = kStateBytes + 16;  // the state, an mbarrier

// Two blocks of 8 warps a multiprocessor; a pair's state arrives in shared memory by one bulk copy,
// issued once the block has taken the pair before into registers.
__global__ void __launch_bounds__(256, 2)
    persistent_shared_kernel(float* pool, const int* slots, int heads, int pairs, float scale) {
  namespace d = kda::detail;
  extern __shared__ __align__(128) unsigned char shared[];
  float* buffer = reinterpret_cast<float*>(shared);
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(shared + kStateBytes);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int pair = blockIdx.x;
  if (pair >= pairs) return;
  auto state_of = [&](int at) {
    return pool + (static_cast<std::int64_t>(slots[at / heads]) * heads + at % heads) * D * D;
  };
  if (threadIdx.x == 0) d::mbarrier_init(full, 1);
  __syncthreads();
  auto fetch = [&](int at) {
    d::fence_proxy_async();
    d::mbarrier_expect_tx(full, kStateBytes);
    d::bulk_copy_to_shared(buffer, state_of(at), kStateBytes, full);
  };
  if (threadIdx.x == 0) fetch(pair);
  unsigned phase = 0;
  for (;;) {
    d::mbarrier_wait(full, phase);
    phase ^= 1u;
    float4 s[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      s[i] = *reinterpret_cast<const float4*>(buffer + (warp * kRowsPerWarp + i) * D + lane * 4);
    }
    __syncthreads();  // every thread has read the buffer
    const int following = pair + static_cast<int>(gridDim.x);
    if (threadIdx.x == 0 && following < pairs) fetch(following);
    float* out = state_of(pair) + warp * kRowsPerWarp * D + lane * 4;
    scale_rows(s, scale);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) *reinterpret_cast<float4*>(out + i * D) = s[i];
    if (following >= pairs) break;
    pair = following;
  }
}

__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst,
                            std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc && std::atoi(argv[i + 1]) >= 1 &&
        std::atoi(argv[i + 1]) <= 4096) {
      batches.push_back(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: kda-state-stream-probe [--batch B ...] (1..4096)\n");
      return 2;
    }
  }
  if (batches.empty()) batches = {64, 256};
  int sms = 0, device = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, device));
  CK(cudaFuncSetAttribute(persistent_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          static_cast<int>(kSharedBytes)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::printf(
      "kda-state-stream-probe on %s: fp32 states of H = %d, K = V = %d, read and written "
      "once; us (median of 20), TB/s of bytes read + written\n\n",
      prop.name, kHeads, D);
  std::printf(
      "| B | bytes MB | copy | in place x1 | x2 | x4 | persistent | persistent, shared "
      "memory |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const int B : batches) {
    const std::int64_t per_pool = static_cast<std::int64_t>(B) * kHeads * D * D;  // floats
    // Enough pools in turn that their bytes exceed the L2 several times.
    const std::int64_t pool_bytes = per_pool * 4;
    const int pools = static_cast<int>(std::max<std::int64_t>(
        2, (4 * static_cast<std::int64_t>(prop.l2CacheSize)) / pool_bytes + 1));
    kda_bench::DeviceMemory states(static_cast<std::size_t>(pool_bytes) * pools);
    kda_bench::DeviceMemory copy_target(static_cast<std::size_t>(pool_bytes));
    std::vector<int> host_slots(static_cast<std::size_t>(B));
    for (int i = 0; i < B; ++i) host_slots[static_cast<std::size_t>(i)] = i;
    kda_bench::DeviceMemory slots(host_slots.size() * sizeof(int));
    CK(cudaMemcpy(slots.ptr, host_slots.data(), host_slots.size() * sizeof(int),
                  cudaMemcpyHostToDevice));
    float* base = static_cast<float*>(states.ptr);
    const int* slot_list = static_cast<const int*>(slots.ptr);
    const int pairs = B * kHeads;
    auto time_us = [&](auto launch) {
      std::vector<double> samples;
      for (int r = 0; r < 25; ++r) {
        float* pool = base + (r % pools) * per_pool;
        CK(cudaEventRecord(e0));
        launch(pool);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 5) samples.push_back(ms * 1e3);
      }
      CK(cudaGetLastError());
      return kda_bench::median(samples);
    };
    const double copy = time_us([&](float* pool) {
      copy_kernel<<<sms * 8, 512>>>(reinterpret_cast<const float4*>(pool),
                                    static_cast<float4*>(copy_target.ptr), per_pool / 4);
    });
    const double x1 = time_us([&](float* pool) {
      in_place_kernel<1><<<dim3(B, kHeads, 1), 256>>>(pool, slot_list, kHeads, 1.0001f);
    });
    const double x2 = time_us([&](float* pool) {
      in_place_kernel<2><<<dim3(B, kHeads, 2), 128>>>(pool, slot_list, kHeads, 1.0001f);
    });
    const double x4 = time_us([&](float* pool) {
      in_place_kernel<4><<<dim3(B, kHeads, 4), 64>>>(pool, slot_list, kHeads, 1.0001f);
    });
    const double persistent = time_us([&](float* pool) {
      persistent_kernel<<<std::min(sms, pairs), 256>>>(pool, slot_list, kHeads, pairs, 1.0001f);
    });
    const double shared = time_us([&](float* pool) {
      persistent_shared_kernel<<<std::min(2 * sms, pairs), 256, kSharedBytes>>>(
          pool, slot_list, kHeads, pairs, 1.0001f);
    });
    const double bytes = 2.0 * static_cast<double>(pool_bytes);
    auto cell = [&](double us) {
      char text[64];
      std::snprintf(text, sizeof text, "%.2f (%.2f)", us, bytes / (us * 1e-6) / 1e12);
      return std::string(text);
    };
    std::printf("| %d | %.1f | %s | %s | %s | %s | %s | %s |\n", B, bytes / 1e6, cell(copy).c_str(),
                cell(x1).c_str(), cell(x2).c_str(), cell(x4).c_str(), cell(persistent).c_str(),
                cell(shared).c_str());
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return 0;
}
