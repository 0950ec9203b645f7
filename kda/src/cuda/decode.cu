// CUDA decode of KDA: 1..16 new tokens per sequence on a pool of state slots, updated in place.
//
// One block per (sequence, head), 8 warps; warp w owns rows v in [16w, 16w + 16) of S^T (V-first
// state) and each lane 4 consecutive channels of K, so a row is one coalesced 512-byte access and
// the state stays in registers (64 floats a thread) across the step's tokens. The kernel is bound
// by moving the state (read and written once per step): the dot products are warp-shuffle
// reductions.
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
constexpr int kWarps = 8;
constexpr int kRows = D / kWarps;  // 16 rows of S^T per warp

struct DecodeParams {
  InputPointers in;
  const std::int32_t* slots;
  void* pool;
  bf16* out;
  std::int64_t num_slots;
  int tokens;
  int num_heads;
  GateMode gate;
  float lower_bound;
  float scale;
  std::uint32_t* status;  // caller's device status word, or null
};

__device__ __forceinline__ float4 load_bf16x4(const bf16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  return make_float4(__bfloat162float(lo.x), __bfloat162float(lo.y), __bfloat162float(hi.x),
                     __bfloat162float(hi.y));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <bool kF32State>
__global__ void __launch_bounds__(kWarps * 32) kda_decode_kernel(const DecodeParams p) {
  const std::int64_t b = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int32_t slot = p.slots[b];
  if (b == 0) {  // the first row's blocks (one per head) check the gate parameters for everyone
    const int k = threadIdx.x & (D - 1);
    if (gate_params_bad(threadIdx.x == 0 ? p.in.A_log[h] : 0.f, p.in.dt_bias[h * D + k])) {
      report_status(p.status, kDeviceStatusGateParams);
    }
  }
  if (slot >= p.num_slots && h == 0 && threadIdx.x == 0) report_status(p.status, kDeviceStatusSlot);
  if (slot < 0 || slot >= p.num_slots) return;  // padding (or out of range: skipped, never indexed)

  const std::int64_t H = p.num_heads;
  const std::int64_t state_base = (static_cast<std::int64_t>(slot) * H + h) * D * D;
  const int k0 = 4 * lane;
  const int v_row0 = warp * kRows;

  float4 S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const std::int64_t off = state_base + static_cast<std::int64_t>(v_row0 + r) * D + k0;
    if constexpr (kF32State) {
      S[r] = *reinterpret_cast<const float4*>(static_cast<const float*>(p.pool) + off);
    } else {
      S[r] = load_bf16x4(static_cast<const bf16*>(p.pool) + off);
    }
  }

  const float a_exp = __expf(p.in.A_log[h]);
  const float4 dtb = *reinterpret_cast<const float4*>(p.in.dt_bias + h * D + k0);

  for (int t = 0; t < p.tokens; ++t) {
    const std::int64_t tok = b * p.tokens + t;
    const std::int64_t qk_off = (tok * H + h) * D;
    const float4 q = load_bf16x4(p.in.q + qk_off + k0);
    const float4 k = load_bf16x4(p.in.k + qk_off + k0);
    const float4 g = load_bf16x4(p.in.g + qk_off + k0);
    const float beta = sigmoid_f(__bfloat162float(p.in.beta[tok * H + h]));
    // This warp's 16 values of v (a broadcast load).
    float vr[kRows];
    {
      const uint4* vp = reinterpret_cast<const uint4*>(p.in.v + qk_off + v_row0);
      const uint4 r0 = vp[0], r1 = vp[1];
      const __nv_bfloat162* h0 = reinterpret_cast<const __nv_bfloat162*>(&r0);
      const __nv_bfloat162* h1 = reinterpret_cast<const __nv_bfloat162*>(&r1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        vr[2 * i] = __bfloat162float(h0[i].x);
        vr[2 * i + 1] = __bfloat162float(h0[i].y);
        vr[8 + 2 * i] = __bfloat162float(h1[i].x);
        vr[8 + 2 * i + 1] = __bfloat162float(h1[i].y);
      }
    }
    const float inv_q =
        rsqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f) * p.scale;
    const float inv_k = rsqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
    const float4 qh = make_float4(q.x * inv_q, q.y * inv_q, q.z * inv_q, q.w * inv_q);
    const float4 kh = make_float4(k.x * inv_k, k.y * inv_k, k.z * inv_k, k.w * inv_k);
    const float4 alpha =
        make_float4(__expf(gate_activation(p.gate, g.x, a_exp, dtb.x, p.lower_bound)),
                    __expf(gate_activation(p.gate, g.y, a_exp, dtb.y, p.lower_bound)),
                    __expf(gate_activation(p.gate, g.z, a_exp, dtb.z, p.lower_bound)),
                    __expf(gate_activation(p.gate, g.w, a_exp, dtb.w, p.lower_bound)));

    float dot[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r].x *= alpha.x;
      S[r].y *= alpha.y;
      S[r].z *= alpha.z;
      S[r].w *= alpha.w;
      dot[r] = S[r].x * kh.x + S[r].y * kh.y + S[r].z * kh.z + S[r].w * kh.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], o);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float delta = beta * (vr[r] - dot[r]);
      S[r].x = fmaf(delta, kh.x, S[r].x);
      S[r].y = fmaf(delta, kh.y, S[r].y);
      S[r].z = fmaf(delta, kh.z, S[r].z);
      S[r].w = fmaf(delta, kh.w, S[r].w);
      dot[r] = S[r].x * qh.x + S[r].y * qh.y + S[r].z * qh.z + S[r].w * qh.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], o);
    }
    // Lane r writes row r's output: 16 lanes, 32 contiguous bytes.
    float mine = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) mine = lane == r ? dot[r] : mine;
    if (lane < kRows) p.out[(tok * H + h) * D + v_row0 + lane] = __float2bfloat16(mine);
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const std::int64_t off = state_base + static_cast<std::int64_t>(v_row0 + r) * D + k0;
    if constexpr (kF32State) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.pool) + off) = S[r];
    } else {
      uint2 raw;
      raw.x = pack_bf16x2(S[r].x, S[r].y);
      raw.y = pack_bf16x2(S[r].z, S[r].w);
      *reinterpret_cast<uint2*>(static_cast<bf16*>(p.pool) + off) = raw;
    }
  }
}

}  // namespace
}  // namespace kda::detail

namespace kda {

Status decode_cuda(const DecodeProblem& p, const DecodeTensors& t, void* stream_ptr,
                   const CudaOptions& opt) {
  using namespace detail;
  KDA_NVTX_RANGE("kda.decode");
  Status st = can_implement(p, Backend::kCuda);
  if (!st.ok()) return st;
  ArgumentTable args;
  st = validate_arguments(p, t, &args);
  if (!st.ok()) return st;
  st = check_cuda_alignment(args, "the CUDA decode");
  if (!st.ok()) return st;
  if (opt.check_pointers) {
    st = check_device_arguments(args);
    if (!st.ok()) return st;
  }
  if (p.batch == 0) return Status::Ok();
  DecodeParams prm{};
  prm.in = InputPointers::from_tensors(t);
  prm.slots = t.slots;
  prm.pool = t.state_pool;
  prm.out = static_cast<bf16*>(t.out);
  prm.num_slots = p.num_slots;
  prm.tokens = static_cast<int>(p.tokens);
  prm.num_heads = static_cast<int>(p.num_heads);
  prm.gate = p.gate;
  prm.lower_bound = p.lower_bound;
  prm.scale = p.effective_scale();
  prm.status = t.device_status;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_heads));
  cfg.blockDim = dim3(kWarps * 32);
  cfg.stream = static_cast<cudaStream_t>(stream_ptr);
  const cudaError_t err = p.state_dtype == DType::kF32
                              ? cudaLaunchKernelEx(&cfg, kda_decode_kernel<true>, prm)
                              : cudaLaunchKernelEx(&cfg, kda_decode_kernel<false>, prm);
  return cuda_status(err, "kda_decode_kernel");
}

}  // namespace kda
