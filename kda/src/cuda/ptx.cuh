// ptx.cuh — the PTX the CUDA kernels use, each behind one small wrapper (as ggml-cuda keeps its
// mma.cuh / cp-async.cuh): the copy engine (cp.async.bulk) and its mbarriers, cp.async, ldmatrix,
// stmatrix, the bf16 tensor-core mma and wgmma. sm_90a. Kernels include this and never write asm
// themselves.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kda::detail {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- copy engine and mbarriers ----------------------------------------------------------------
// The copy engine (cp.async.bulk, plain sm_90) and its mbarriers.
__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's earlier generic shared-memory accesses before later async-proxy (copy
// engine) accesses.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Arrives once on `bar` and announces `bytes` of copies that will complete on it.
__device__ __forceinline__ void mbarrier_expect_tx(std::uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Global -> shared, `bytes` a multiple of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// Shared -> global, tracked by the issuing thread's bulk group.
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
// Commits the bulk stores and waits until they have read their shared-memory sources (the block may
// then exit; the writes complete before the grid does).
__device__ __forceinline__ void bulk_commit_and_wait_read() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Commits this thread's bulk stores issued since the last commit as one group.
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's committed bulk stores have completed (their global writes performed).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Orders this thread's async-proxy (copy engine) global accesses with its generic ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// A flag between blocks of different grids: release store / acquire load at GPU scope.
__device__ __forceinline__ void store_release_gpu(std::uint32_t* flag, std::uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
}
__device__ __forceinline__ std::uint32_t load_acquire_gpu(const std::uint32_t* flag) {
  std::uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}
// A 64-bit word between blocks running at once, with no ordering to anything else: one
// single-copy-atomic relaxed store / load at GPU scope (the word carries its own validity, so no
// fence is needed to publish it).
__device__ __forceinline__ void store_relaxed_gpu_u64(std::uint64_t* word, std::uint64_t v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;\n" ::"l"(word), "l"(v) : "memory");
}
__device__ __forceinline__ std::uint64_t load_relaxed_gpu_u64(const std::uint64_t* word) {
  std::uint64_t v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(word) : "memory");
  return v;
}
__device__ __forceinline__ std::uint32_t load_relaxed_gpu_u32(const std::uint32_t* word) {
  std::uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(word) : "memory");
  return v;
}
// The device's nanosecond clock (the same on every multiprocessor).
__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Programmatic dependent launch: lets the next kernel in the stream, launched with the
// programmatic-serialization attribute, start before this grid ends.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// ... and in such a dependent: waits until the grids it depends on have completed and their
// memory operations are visible.
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Orders this thread's earlier generic accesses, in every state space, before later async-proxy
// (copy engine) accesses.
__device__ __forceinline__ void fence_proxy_async_all() {
  asm volatile("fence.proxy.async;\n" ::: "memory");
}

// Arrives once on `bar` (release at CTA scope: this thread's earlier accesses happen before the
// phase completes for its waiters).
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Barrier `id` (1-15; 0 is __syncthreads') over `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- thread block clusters ----------------------------------------------------------------------
// Stores `value` at the address of `local` (this block's shared memory) in the shared memory of
// block `rank` of the cluster.
__device__ __forceinline__ void store_shared_cluster(float* local, unsigned rank, float value) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(smem_addr(local)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(value) : "memory");
}
// The cluster's barrier, every thread of every block: what each wrote before (its own or another
// block's shared memory) is visible to all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// The cluster's barrier in two halves, without ordering memory: each thread arrives once every
// block of the cluster may be written through distributed shared memory, and waits before its first
// such write. Work between the two is not held up by the barrier (nor, unlike cluster_sync's
// release, by the thread's own loads and stores still in flight).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// Waits until the phase with parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            const void* smem) {
  const unsigned s = smem_addr(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned& r0, unsigned& r1, const void* smem) {
  const unsigned s = smem_addr(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3, const void* smem) {
  const unsigned s = smem_addr(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

// The transposes of four 8 x 8 bf16 matrices into shared memory: lane l gives the address of row
// l % 8 of matrix l / 8, and r0..r3 hold the lane's pair of each matrix in the mma fragment layout
// (row l / 4, columns 2 (l % 4) + {0, 1}), which lands at column l / 4 of rows 2 (l % 4) + {0, 1}.
__device__ __forceinline__ void stmatrix_x4_trans(void* smem, unsigned r0, unsigned r1, unsigned r2,
                                                  unsigned r3) {
  const unsigned s = smem_addr(smem);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(s),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// D = A * B + D, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A * B + D, m16n8k16, fp16 inputs, fp32 accumulators (the state update and U M^T: their
// operands are bounded or scaled into fp16's range, which holds 3 more bits than bf16).
__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                        unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x by the special-function unit (what __expf uses after scaling by log2(e)); flushes denormal
// results to zero.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- cp.async (16-byte global -> shared copies, per-thread groups) ------------------------------
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
// The same where `valid`, else 16 zero bytes (nothing read; `src` must still be a mapped address).
__device__ __forceinline__ void cp_async_16_or_zero(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- wgmma (warpgroup MMA, sm_90a) --------------------------------------------------------------
// The layer's warpgroup GEMM (layer/src/cuda/warpgroup_gemm.cu: wgmma_ss) and the probes (bench/:
// the forms with A from registers, for docs/design/prefill.md's "the recurrence on wgmma", not
// built). A warpgroup is four consecutive warps starting at a multiple of four; every call below
// is warpgroup-wide.

// The accumulator operands of a wgmma: KDA_WGMMA_ACCn(d, i) is "+f"(d[i]), ..., "+f"(d[i + n - 1])
// (defined for the wgmma forms below only; undefined at the end of this header).
#define KDA_WGMMA_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define KDA_WGMMA_ACC8(d, i) KDA_WGMMA_ACC4(d, i), KDA_WGMMA_ACC4(d, i + 4)
#define KDA_WGMMA_ACC16(d, i) KDA_WGMMA_ACC8(d, i), KDA_WGMMA_ACC8(d, i + 8)
#define KDA_WGMMA_ACC32(d, i) KDA_WGMMA_ACC16(d, i), KDA_WGMMA_ACC16(d, i + 16)
#define KDA_WGMMA_ACC64(d, i) KDA_WGMMA_ACC32(d, i), KDA_WGMMA_ACC32(d, i + 32)
#define KDA_WGMMA_ACC128(d, i) KDA_WGMMA_ACC64(d, i), KDA_WGMMA_ACC64(d, i + 64)

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address >> 4 in
// bits 0-13, leading byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45, base offset 0,
// swizzle in 62-63.
enum class WgmmaSwizzle : std::uint64_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };
__device__ __forceinline__ std::uint64_t wgmma_desc(const void* smem, unsigned lbo, unsigned sbo,
                                                    WgmmaSwizzle swizzle) {
  return static_cast<std::uint64_t>((smem_addr(smem) & 0x3FFFFu) >> 4) |
         static_cast<std::uint64_t>(lbo >> 4) << 16 | static_cast<std::uint64_t>(sbo >> 4) << 32 |
         static_cast<std::uint64_t>(swizzle) << 62;
}
// Before the first wgmma, and between any register access and a wgmma that uses those registers.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses to these registers across a wgmma fence or wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(unsigned (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// d (64 x 16 per warpgroup, this warp's 16 rows in mma.sync's m16n8 C layout, two n-tiles) +=
// SCALE_A * A B: A (16 x 16 per warp, mma.sync's m16k16 A layout) from registers, B (16 x 16)
// K-major in shared memory through `desc`. SCALE_A: 1 or -1.
template <int SCALE_A>
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[8], const unsigned (&a)[4],
                                                std::uint64_t desc) {
  static_assert(SCALE_A == 1 || SCALE_A == -1, "scale-a is 1 or -1");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, %13, 1, 0;\n}\n"
      : KDA_WGMMA_ACC8(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SCALE_A));
}
// d (64 x 32: this warp's 16 rows, four m16n8 n-tiles) += A B, A from registers as above, B
// (16 x 32) K-major in shared memory through `desc`.
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], const unsigned (&a)[4],
                                                std::uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : KDA_WGMMA_ACC16(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
// d (64 x 64: this warp's 16 rows, eight m16n8 n-tiles) += A B, A from registers as above, B
// (16 x 64) K-major in shared memory through `desc`.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const unsigned (&a)[4],
                                                std::uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : KDA_WGMMA_ACC32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
// d (64 x 128: this warp's 16 rows, sixteen m16n8 n-tiles) += A B with B (16 x 128) read
// MN-major (trans-b 1) through `desc`: the state update S^T += U^T K^ with K^ token-major.
__device__ __forceinline__ void wgmma_m64n128k16_trans_b(float (&d)[64], const unsigned (&a)[4],
                                                         std::uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : KDA_WGMMA_ACC64(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// d (64 x N: this warp's 16 rows, N / 8 m16n8 n-tiles, mma.sync's C layout) += A B with both
// operands K-major in shared memory through their descriptors: A 64 x 16, B N x 16 (its rows are
// the product's columns). N: 8, 16, 32, 64, 128 or 256.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], std::uint64_t desc_a,
                                         std::uint64_t desc_b);
template <>
__device__ __forceinline__ void wgmma_ss<8>(float (&d)[4], std::uint64_t desc_a,
                                            std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3"
      "}, %4, %5, p, 1, 1, 0, 0;\n}\n"
      : KDA_WGMMA_ACC4(d, 0)
      : "l"(desc_a), "l"(desc_b));
}
template <>
__device__ __forceinline__ void wgmma_ss<16>(float (&d)[8], std::uint64_t desc_a,
                                             std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7"
      "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : KDA_WGMMA_ACC8(d, 0)
      : "l"(desc_a), "l"(desc_b));
}
template <>
__device__ __forceinline__ void wgmma_ss<32>(float (&d)[16], std::uint64_t desc_a,
                                             std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : KDA_WGMMA_ACC16(d, 0)
      : "l"(desc_a), "l"(desc_b));
}
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[32], std::uint64_t desc_a,
                                             std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : KDA_WGMMA_ACC32(d, 0)
      : "l"(desc_a), "l"(desc_b));
}
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], std::uint64_t desc_a,
                                              std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "
      "%58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : KDA_WGMMA_ACC64(d, 0)
      : "l"(desc_a), "l"(desc_b));
}
template <>
__device__ __forceinline__ void wgmma_ss<256>(float (&d)[128], std::uint64_t desc_a,
                                              std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "
      "%58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, "
      "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "
      "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, "
      "%122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : KDA_WGMMA_ACC128(d, 0)
      : "l"(desc_a), "l"(desc_b));
}

// ---- tensor copies (cp.async.bulk.tensor, sm_90) -----------------------------------------------
// A 2-D box of the tensor `map` describes (a CUtensorMap in kernel-parameter, constant or global
// memory) at coordinates (c0 innermost, c1) -> shared memory at `dst`, completing on `bar`. The box
// lands in the map's layout (its swizzle); elements outside the tensor arrive as zeros and count
// toward the transaction bytes like the others.
__device__ __forceinline__ void tensor_copy_2d_to_shared(void* dst, const void* map, int c0, int c1,
                                                         std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}
// Brings a tensor map into the cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
// Four floats at the address of `local` (this block's shared memory, 16-byte aligned) in the shared
// memory of block `rank` of the cluster.
__device__ __forceinline__ float4 load_shared_cluster_v4(const float* local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(smem_addr(local)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

#undef KDA_WGMMA_ACC4
#undef KDA_WGMMA_ACC8
#undef KDA_WGMMA_ACC16
#undef KDA_WGMMA_ACC32
#undef KDA_WGMMA_ACC64
#undef KDA_WGMMA_ACC128

}  // namespace kda::detail
