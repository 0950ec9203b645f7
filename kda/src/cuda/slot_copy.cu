// CUDA slot copy (kda.hpp, "Slot copy"): entry src[i] of every pool copied into entry dst[i] (or,
// a zeroing, entry slots[i] set to zeros), up to kMaxCopyPools pools in one launch.
//
// A copy moves bytes and nothing else, so the kernel is a plain streaming copy: blockIdx.x walks
// 32 KB tiles of the pools' entries (the pools laid end to end: a block finds its pool by a binary
// search over the tiles where each starts), blockIdx.y the pairs (striding where there are more
// than a grid's y dimension holds). Each of 256 threads loads its eight 16-byte pieces of the tile
// before it stores any, so that a block has the whole tile in flight. 32 KB tiles against 16 and
// 64 KB, measured on the H200 (kda-bench --copy, two rounds, 20 layers of H = 32): one pair 24.7
// against 25.3 / 25.0 us (fp32), 14.7 against 15.8 / 15.0-15.3 (bf16), its zeroing 11.8 against
// 12.8 / 12.6 and 7.5 against 9.0 / 8.3-8.4; 8 and 64 pairs 0.3-1 % faster (zeroing 1-5 %). The
// pairs are read on the device, so a captured copy replays with whatever pairs the caller wrote
// since.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "argument_table.hpp"
#include "cuda/common.cuh"
#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"
#include "kda/nvtx.hpp"

namespace kda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kPiecesPerThread = 8;  // the default; KDA_SLOT_COPY_PIECES 4 or 16 for the A/B
// A tile's bytes: 16-byte pieces, `pieces` a thread (the kernel's template argument, the launch's
// grid).
__host__ __device__ constexpr std::uint64_t tile_bytes_of(int pieces) {
  return 16ull * kThreads * static_cast<unsigned>(pieces);
}

// Pieces of 16 bytes a thread (and so the tile: 16, 32 or 64 KB): the environment's
// KDA_SLOT_COPY_PIECES (read once; a knob for the benchmark's A/B, not part of the contract),
// else kPiecesPerThread.
int slot_copy_pieces() {
  static const int pieces = [] {
    const char* env = std::getenv("KDA_SLOT_COPY_PIECES");
    const int v = env != nullptr ? std::atoi(env) : 0;
    return v == 4 || v == 8 || v == 16 ? v : kPiecesPerThread;
  }();
  return pieces;
}
constexpr unsigned kMaxGridY = 65535;

struct CopyPool {
  unsigned char* base;
  std::uint64_t entry_bytes;
  std::uint32_t first_tile;  // the pool's first tile among the launch's
};

struct CopyParams {
  const std::int32_t* src;  // null: a zeroing of the entries `dst` names
  const std::int32_t* dst;
  std::uint32_t* status;  // caller's device status word, or null
  std::int64_t pairs;
  std::int64_t num_slots;
  std::int32_t padding_slot;
  int num_pools;  // pools with at least one tile
  CopyPool pools[kMaxCopyPools];
};
static_assert(sizeof(CopyParams) <= 4096, "kernel parameters must stay within 4 KiB");

template <int kPieces>
__global__ void __launch_bounds__(kThreads)
    kda_copy_slots_kernel(const __grid_constant__ CopyParams p) {
  constexpr std::uint64_t kTileBytes = tile_bytes_of(kPieces);
  // The pool whose tiles hold this block's: the last with first_tile <= blockIdx.x.
  int lo = 0, hi = p.num_pools - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.pools[mid].first_tile <= blockIdx.x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const CopyPool& pool = p.pools[lo];
  const std::uint64_t offset =
      static_cast<std::uint64_t>(blockIdx.x - pool.first_tile) * kTileBytes;
  const int pieces = static_cast<int>(min(kTileBytes, pool.entry_bytes - offset) / 16);
  for (std::int64_t pair = blockIdx.y; pair < p.pairs; pair += gridDim.y) {
    const std::int32_t d = p.dst[pair];
    const std::int32_t s = p.src != nullptr ? p.src[pair] : d;
    if (s < 0 || d < 0 || s == p.padding_slot || d == p.padding_slot) continue;  // padding
    if (s >= p.num_slots || d >= p.num_slots) {
      if (blockIdx.x == 0 && threadIdx.x == 0) report_status(p.status, kDeviceStatusSlot);
      continue;
    }
    const auto* from = reinterpret_cast<const uint4*>(
        pool.base + static_cast<std::uint64_t>(s) * pool.entry_bytes + offset);
    auto* to = reinterpret_cast<uint4*>(pool.base +
                                        static_cast<std::uint64_t>(d) * pool.entry_bytes + offset);
    uint4 v[kPieces];
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int j = static_cast<int>(threadIdx.x) + i * kThreads;
      v[i] = make_uint4(0, 0, 0, 0);
      if (j < pieces && p.src != nullptr) v[i] = from[j];
    }
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int j = static_cast<int>(threadIdx.x) + i * kThreads;
      if (j < pieces) to[j] = v[i];
    }
  }
}

// Both forms after their validation: src null for a zeroing of the entries `dst` names.
Status launch_slot_kernel(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                          const std::int32_t* src, const std::int32_t* dst,
                          std::uint32_t* device_status, void* stream_ptr, const CudaOptions& opt) {
  auto invalid = [](std::string message) {
    return Status(StatusCode::kInvalidArgument, "slot copy: " + std::move(message));
  };
  if (reinterpret_cast<std::uintptr_t>(device_status) % 4 != 0) {
    return invalid("device_status must be 4-byte aligned");
  }
  // The status word is written by the kernel too: nothing it reads or writes may hold it.
  const Argument word = byte_range(device_status, device_status != nullptr ? 4 : 0);
  const std::pair<const void*, const char*> indices[] = {{src, "src"},
                                                         {dst, src != nullptr ? "dst" : "slots"}};
  for (const auto& [ptr, name] : indices) {
    if (reinterpret_cast<std::uintptr_t>(ptr) % 4 != 0) {
      return invalid(std::string(name) + " must be 4-byte aligned");
    }
    if (overlaps(word, byte_range(ptr, static_cast<std::uint64_t>(p.pairs) * 4))) {
      return invalid(std::string(name) + " overlaps device_status");
    }
  }
  Status st;
  CopyParams prm{};
  const int pieces = slot_copy_pieces();
  const std::uint64_t tile_bytes = tile_bytes_of(pieces);
  std::uint64_t tiles = 0;
  for (int i = 0; i < num_pools; ++i) {
    const std::string name = "pools[" + std::to_string(i) + "]";
    if (pools[i].entry_bytes == 0) continue;  // nothing of it is touched
    if (reinterpret_cast<std::uintptr_t>(pools[i].base) % 16 != 0 ||
        pools[i].entry_bytes % 16 != 0) {
      return invalid(name + ": base and entry_bytes must be multiples of 16 for the CUDA copy");
    }
    if (opt.check_pointers && p.pairs > 0) {
      st = check_device_pointer(
          pools[i].base, static_cast<std::size_t>(p.num_slots * pools[i].entry_bytes), "pool");
      if (!st.ok()) return Status(st.code(), "slot copy: " + name + ": " + st.message());
    }
    if (overlaps(word, byte_range(pools[i].base, p.num_slots * pools[i].entry_bytes))) {
      return invalid(name + " overlaps device_status");
    }
    CopyPool& pool = prm.pools[prm.num_pools++];
    pool.base = static_cast<unsigned char*>(pools[i].base);
    pool.entry_bytes = pools[i].entry_bytes;
    pool.first_tile = static_cast<std::uint32_t>(tiles);
    tiles += (pools[i].entry_bytes + tile_bytes - 1) / tile_bytes;
    if (tiles > 0x7fffffffull) {
      return Status(StatusCode::kUnsupported,
                    "slot copy: the pools' entries exceed the CUDA grid (2^31 - 1 tiles of " +
                        std::to_string(tile_bytes / 1024) + " KB)");
    }
  }
  if (opt.check_pointers && p.pairs > 0) {
    for (const auto& [ptr, name] : indices) {
      if (ptr == nullptr) continue;  // a zeroing's src
      st = check_device_pointer(ptr, static_cast<std::size_t>(p.pairs) * 4, name);
      if (!st.ok()) return Status(st.code(), "slot copy: " + st.message());
    }
    st = check_device_pointer(device_status, device_status != nullptr ? 4 : 0, "device_status");
    if (!st.ok()) return Status(st.code(), "slot copy: " + st.message());
  }
  // With no bytes in any pool nothing is read: not even the pairs (the CPU still checks them).
  if (p.pairs == 0 || tiles == 0) return Status::Ok();
  if (Status supported = cuda_device_supported(); !supported.ok()) return supported;
  prm.src = src;
  prm.dst = dst;
  prm.status = device_status;
  prm.pairs = p.pairs;
  prm.num_slots = p.num_slots;
  prm.padding_slot = p.padding_slot;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles),
                     static_cast<unsigned>(std::min<std::int64_t>(p.pairs, kMaxGridY)));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = static_cast<cudaStream_t>(stream_ptr);
  const cudaError_t err = pieces == 16  ? cudaLaunchKernelEx(&cfg, kda_copy_slots_kernel<16>, prm)
                          : pieces == 8 ? cudaLaunchKernelEx(&cfg, kda_copy_slots_kernel<8>, prm)
                                        : cudaLaunchKernelEx(&cfg, kda_copy_slots_kernel<4>, prm);
  return cuda_status(err, "kda_copy_slots_kernel");
}

}  // namespace
}  // namespace kda::detail

namespace kda {

Status copy_slots_cuda(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                       const std::int32_t* src, const std::int32_t* dst,
                       std::uint32_t* device_status, void* stream, const CudaOptions& opt) {
  KDA_NVTX_RANGE("kda.copy_slots");
  if (Status st = validate(p, pools, num_pools, src, dst); !st.ok()) return st;
  return detail::launch_slot_kernel(p, pools, num_pools, src, dst, device_status, stream, opt);
}

Status zero_slots_cuda(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                       const std::int32_t* slots, std::uint32_t* device_status, void* stream,
                       const CudaOptions& opt) {
  KDA_NVTX_RANGE("kda.zero_slots");
  if (Status st = validate(p, pools, num_pools, slots); !st.ok()) return st;
  return detail::launch_slot_kernel(p, pools, num_pools, nullptr, slots, device_status, stream,
                                    opt);
}

}  // namespace kda
