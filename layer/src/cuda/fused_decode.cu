// layer/src/cuda/fused_decode.cu — everything of a decode step between the input projection and
// o_proj in one kernel: the low-rank second factors (f_a·W_fbᵀ and g_a·W_gbᵀ), the short conv +
// SiLU of q, k and v with their conv states, beta, the KDA step on the recurrent state, and the
// gated RMSNorm.
//
// A (row, head) is a cluster of NC blocks (1, 2, 4 or 8) of eight warps. Block r of the cluster
// holds the value rows [r·128/NC, (r + 1)·128/NC) of the head's state Sᵀ in registers across the
// row's tokens (warp w a run of 16/NC rows, each lane four consecutive channels of K: the
// operator's decode layout cut along V), so that a head's state is loaded and stored by NC
// multiprocessors at once: a step of few rows is bound by each multiprocessor's latency and
// bandwidth, not the device's. Every block computes what all value rows need — the conv of q and k,
// g = f_a·W_fbᵀ — itself (W_fb's 32 KB of a head come from L2 for all but the first block), its
// own rows' v, output gate and state, and exchanges only the core's output o through distributed
// shared memory for the norm over the head's 128 values. The conv states are written by the block
// that owns their channels (the same slice of q, k and v).
//
// Latency is what a small batch pays, so everything that does not need the input projection is
// issued before waiting for it: the kernel is launched as a programmatic dependent of the GEMM
// before it (it starts while that GEMM drains), copies its W_fb and W_gb rows into shared memory
// (cp.async) and loads the recurrent and conv states, and only then waits for the GEMM's grid
// (griddepcontrol.wait) and reads the projection. It lets its own dependent (o_proj) start at
// once, which then streams W_o while this kernel runs (or, with FusedDecodeParams::late_dependents,
// only after that wait).
//
// A step that folds the records step before it (FusedDecodeParams::fold_rows, the commit deferred
// into this step) applies that step's accepted records to the state and the conv history right
// after loading them, before waiting for the projection, with the commit's operations.
//
// A record-and-commit verify step (FusedDecodeParams::records) writes, instead of any state, each
// token's records as the operator's decode kernel and the conv kernel write them (kda.hpp): alpha
// and k^ from the cluster's first block, u from each block for its value rows, the pre-conv q | k |
// v inputs from the block that owns their channels; the pools are only read.
//
// Every intermediate is rounded where the unfused path stores it in bf16 (q, k, v after the conv,
// g after f_b, o after the core), and each phase repeats the unfused kernels' operations in their
// order (conv taps, the step's reductions, the norm), so with an f32 state the result differs from
// the unfused path only by the order of the f_b / g_b dot products (fp32 either way), and not with
// the cluster size. With a bf16 state the operator's decode kernel takes eight channels a lane
// (kda/src/cuda/decode_kernel.cuh), this kernel four: the step's sums, and so out, u and k^, may
// differ from the unfused path in their last bits too.
#include <cuda_bf16.h>

#include "cuda/common.cuh"  // the operator's gate activations (kda/src/cuda)
#include "cuda/conv_silu.cuh"
#include "cuda/factor_rows.cuh"
#include "cuda/head_step.cuh"
#include "cuda/kernels.hpp"
#include "cuda/shared_memory.cuh"

namespace kda::layer::cuda {

namespace {

constexpr int D = 128;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

using kda::detail::gate_params_bad;
using kda::detail::sigmoid_f;

using kda::detail::cluster_arrive_relaxed;
using kda::detail::cluster_sync;
using kda::detail::cluster_wait;
using kda::detail::cp_async_16;
using kda::detail::cp_async_commit;
using kda::detail::cp_async_wait;
using kda::detail::griddep_launch_dependents;
using kda::detail::griddep_wait;
using kda::detail::store_shared_cluster;

// One block a (row, head) asks for one block a multiprocessor: `kAuto` runs this step only up to
// 128 (row, head) pairs, one wave at one block a multiprocessor, and held to two the kernel spilled
// 200-220 bytes a thread (163-233 registers now, no spills).
template <int W, bool kF32State, int NC, bool kRecords>
__global__ void __launch_bounds__(kThreads, NC == 1 ? 1 : 2)
    fused_decode_kernel(const FusedDecodeParams p) {
  constexpr int kHist = W - 1;
  constexpr int kSlice = D / NC;                 // value rows (and v, gate channels) a block
  constexpr int kRowsPerWarp = kSlice / kWarps;  // rows of Sᵀ a warp
  constexpr int kQkPairs = D;                    // conv threads of q and k: two channels each
  constexpr int kConvPairs = kQkPairs + kSlice / 2;
  static_assert(kRowsPerWarp >= 1 && kRowsPerWarp <= 32, "cluster size");
  static_assert(kConvPairs <= kThreads && D + kSlice <= kThreads, "threads");
  const int rank = NC > 1 ? static_cast<int>(blockIdx.x % NC) : 0;  // the block within the cluster
  const std::int64_t b = blockIdx.x / NC;
  const int h = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const std::int64_t Cl = static_cast<std::int64_t>(p.heads) * D;
  const int T = p.decode_tokens;
  const int slice0 = rank * kSlice;  // this block's first value row / channel of the head

  if (b == 0 && rank == 0 && tid < D) {  // the first row's blocks check the gate parameters
    if (gate_params_bad(tid == 0 ? p.A_log[h] : 0.0f, p.dt_bias[h * D + tid])) {
      if (p.status != nullptr) atomicOr(p.status, kDeviceStatusGateParams);
    }
  }
  // A verify step's row starts from its slot at num_accepted - 1 (a bad count: padding, reported).
  // The blocks of a cluster read the same entries, so they take the padding path below together
  // (no block may leave while another still writes its shared memory): that holds because what
  // the slots and counts come from is complete before this kernel starts (they are read before
  // griddepcontrol.wait, and the kernel ahead of this one, the projection GEMM, does not write
  // them).
  const bool verify = p.num_accepted != nullptr;
  const bool reporter = h == 0 && rank == 0 && tid == 0 && p.status != nullptr;
  std::int64_t slot = b;
  if (verify) {
    const std::int32_t accepted = p.num_accepted[b];
    const bool counted = accepted >= 1 && accepted <= T;
    if (!counted && reporter) atomicOr(p.status, kDeviceStatusAccepted);
    slot = counted ? static_cast<std::int64_t>(p.slots[b * T + accepted - 1]) : -1;
  } else if (p.slots != nullptr) {
    slot = p.slots[b];
  }
  if (slot >= p.num_slots && reporter) atomicOr(p.status, kDeviceStatusSlot);
  // A fold's row and count (written before this kernel, as the slots are): out of range, the row
  // is padding (reported).
  int fold_row = -1, fold_count = 0;
  if (p.fold_rows != nullptr && slot >= 0 && slot < p.num_slots && slot != p.padding_slot &&
      (fold_row = p.fold_rows[b]) >= 0) {
    fold_count = p.fold_counts[b];
    if (fold_row >= p.fold_sequences || fold_count < 1 || fold_count > p.fold_tokens) {
      if (reporter) atomicOr(p.status, kDeviceStatusAccepted);
      slot = -1;
    }
  }
  if (!p.late_dependents) griddep_launch_dependents();  // o_proj may start streaming its weights
  if (slot < 0 || slot >= p.num_slots || slot == p.padding_slot) {
    // Padding (a negative entry or the caller's null slot; or a slot outside the pool, reported
    // above): zeros out, no state read or written. The cluster's blocks all leave here.
    griddep_wait();
    for (int i = tid; i < T * kSlice / 8; i += kThreads) {
      const int t = i / (kSlice / 8), c = i % (kSlice / 8);
      reinterpret_cast<uint4*>(p.y + (b * T + t) * Cl + h * D + slice0)[c] = make_uint4(0, 0, 0, 0);
    }
    return;
  }

  // The second factors' weights: all of W_fb's rows of this head (every value row needs all of g),
  // W_gb's rows of this block's value rows after them.
  extern __shared__ uint4 w_rows[];  // [D + kSlice rows][kFactorRowChunks], swizzled
  {
    if (p.w_fb != nullptr) {
      const uint4* src = reinterpret_cast<const uint4*>(p.w_fb + h * D * D);
      for (int i = tid; i < D * kFactorRowChunks; i += kThreads) {
        const int r = i / kFactorRowChunks, c = i % kFactorRowChunks;
        cp_async_16(w_rows + swizzled(r, c), src + i);
      }
    }
    if (p.w_gb != nullptr) {
      const uint4* src = reinterpret_cast<const uint4*>(p.w_gb + (h * D + slice0) * D);
      for (int i = tid; i < kSlice * kFactorRowChunks; i += kThreads) {
        const int r = i / kFactorRowChunks, c = i % kFactorRowChunks;
        cp_async_16(w_rows + swizzled(D + r, c), src + i);
      }
    }
    cp_async_commit();
  }

  // The recurrent state: its loads are the step's long pole, the rest overlaps with them.
  const int k0 = 4 * lane;
  const int v_row0 = slice0 + warp * kRowsPerWarp;
  const std::int64_t state_base = (slot * p.heads + h) * D * D;
  float S[kRowsPerWarp][4];  // Sᵀ[v_row0 + i][k0 .. k0 + 4)
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const std::int64_t off = state_base + static_cast<std::int64_t>(v_row0 + i) * D + k0;
    if constexpr (kF32State) {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(p.state) + off);
      S[i][0] = f.x, S[i][1] = f.y, S[i][2] = f.z, S[i][3] = f.w;
    } else {
      unpack_bf16x4(
          *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(p.state) + off), S[i]);
    }
  }

  // Conv threads: two channels each, of q or k (all of the head's: threads < kQkPairs) or of v
  // (this block's slice), their taps and history (the last kHist inputs, oldest first) kept in
  // registers across the tokens. A thread writes its conv state back where its channels are this
  // block's slice (q, k and v alike): each entry has one writer in the cluster.
  const bool conv_thread = tid < kConvPairs;
  const int branch = tid < kQkPairs ? (2 * tid) / D : 2;  // 0 q, 1 k, 2 v (conv threads)
  const int channel = tid < kQkPairs ? (2 * tid) % D : slice0 + 2 * (tid - kQkPairs);
  const std::int64_t cc = h * D + channel;  // channel within the branch
  const bool conv_owner =
      NC == 1 ? conv_thread : conv_thread && channel >= slice0 && channel < slice0 + kSlice;
  // (The taps and dt_bias are read again for each token, L1 hits, rather than held in registers
  // beside the state: at 128 registers a thread they spilled with a whole head a block.)
  float hist[2][kHist];
  std::uint16_t* conv_state = nullptr;
  if (conv_thread) {
    conv_state = p.conv_pools[branch] + (slot * Cl + cc) * kHist;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < kHist; ++j) hist[i][j] = bits_to_float(conv_state[i * kHist + j]);
    }
  }
  // Channel i's history after one more input x: the oldest dropped, x last (the conv's inputs of
  // this step, and the fold's accepted ones before them).
  auto push_history = [&](int i, float x) {
#pragma unroll
    for (int j = 0; j + 1 < kHist; ++j) hist[i][j] = hist[i][j + 1];
    if constexpr (kHist > 0) hist[i][kHist - 1] = x;
  };

  __shared__ __align__(16) float fa_s[D], ga_s[D];  // this token's f_a and g_a rows (dot_row)
  __shared__ float qkv_s[3][D];     // q, k, v after the conv (bf16 values; v: this slice's)
  __shared__ float g_s[D];          // the gate's raw input g = f_a·W_fbᵀ (a bf16 value)
  __shared__ float gate_s[kSlice];  // the output gate before its bias, fp32, this slice's rows
  __shared__ float o_s[2][D];       // the core's output (bf16 values), by token parity
  __shared__ float beta_s;

  // The recurrent state of this block's rows and the conv state of this thread's channels, written
  // to a slot (its head's / channels' entries): after the row's last token, or after each token of
  // a verify step where the row keeps it.
  auto store_state = [&](std::int64_t base) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const std::int64_t off = base + static_cast<std::int64_t>(v_row0 + i) * D + k0;
      if constexpr (kF32State) {
        *reinterpret_cast<float4*>(static_cast<float*>(p.state) + off) =
            make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
      } else {
        *reinterpret_cast<uint2*>(static_cast<std::uint16_t*>(p.state) + off) = pack_bf16x4(S[i]);
      }
    }
  };
  auto store_conv = [&](std::uint16_t* dst) {  // the last kHist inputs (old entries when fewer)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < kHist; ++j) dst[i * kHist + j] = float_to_bits(hist[i][j]);
    }
  };

  if (fold_row >= 0) {
    // The deferred commit of the records step before (kda.hpp, "Fold"), before waiting for the
    // projection: its records are complete before this kernel starts. The commit's operations on
    // the state (apply_record, kda/src/cuda/common.cuh), a bf16 state rounded as the commit's
    // store rounds it; the conv inputs shifted into each thread's history as bf16 values, exactly.
    const std::int64_t first = static_cast<std::int64_t>(fold_row) * p.fold_tokens;
    for (int t = 0; t < fold_count; ++t) {
      const float* r = p.fold_records + ((first + t) * p.heads + h) * (3 * D);
      const float4 a4 = *reinterpret_cast<const float4*>(r + k0);
      const float4 k4 = *reinterpret_cast<const float4*>(r + D + k0);
      const float a[4] = {a4.x, a4.y, a4.z, a4.w}, kh[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        kda::detail::apply_record(S[i], a, kh, r[2 * D + v_row0 + i]);
      }
      if (conv_thread) {
        const std::uint32_t pair = *reinterpret_cast<const std::uint32_t*>(
            p.fold_conv_records + (first + t) * 3 * Cl + branch * Cl + cc);
        const float x[2] = {__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u)};
#pragma unroll
        for (int i = 0; i < 2; ++i) push_history(i, x[i]);
      }
    }
    if constexpr (!kF32State) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) S[i][j] = round_bf16(S[i][j]);
      }
    }
  }

  const float a_exp = __expf(p.A_log[h]);
  // Distributed shared memory may be written only once every block of the cluster runs: each
  // thread arrives here and waits before its first such write (the first token's outputs), so that
  // neither the barrier nor the loads above hold up the reads of the projection.
  if constexpr (NC > 1) cluster_arrive_relaxed();
  griddep_wait();  // the input projection (and the gate's GEMM) from here on
  cp_async_wait<0>();
  if (p.late_dependents) griddep_launch_dependents();
  if constexpr (kRecords) {
    // A records step's one pool write, the folded states: after the wait, so that no write of
    // this kernel precedes the completion of the kernels before it.
    if (fold_row >= 0) {
      store_state(state_base);
      if (conv_owner) store_conv(conv_state);
    }
  }

  for (int t = 0; t < T; ++t) {
    const std::int64_t row = b * T + t;
    const std::uint16_t* proj = p.proj + row * p.proj_stride;
    if (tid < D) {
      if (p.w_fb != nullptr) fa_s[tid] = bits_to_float(proj[p.f_a_col + tid]);
    } else if (p.w_gb != nullptr) {
      ga_s[tid - D] = bits_to_float(proj[p.g_a_col + tid - D]);
    }
    if (tid == 0) beta_s = sigmoid_f(bits_to_float(proj[p.beta_col + h]));
    if (conv_thread) {
      const std::uint32_t pair = *reinterpret_cast<const std::uint32_t*>(proj + branch * Cl + cc);
      if constexpr (kRecords) {  // the conv record: the projection's bf16 bits as they are
        if (conv_owner) {
          *reinterpret_cast<std::uint32_t*>(p.conv_records + row * 3 * Cl + branch * Cl + cc) =
              pair;
        }
      }
      const float x[2] = {__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u)};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float* taps = p.conv_weight + (branch * Cl + cc + i) * W;
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < kHist; ++j) a += __ldg(taps + j) * hist[i][j];
        a += __ldg(taps + W - 1) * x[i];
        qkv_s[branch][channel + i] = round_bf16(silu(a));
        push_history(i, x[i]);
      }
    }
    __syncthreads();
    // The second factors: thread r < D computes g of channel r, thread D + r the output gate of
    // this block's value row slice0 + r.
    if (tid < D) {
      g_s[tid] = p.w_fb != nullptr ? round_bf16(dot_row(w_rows, tid, fa_s))
                                   : bits_to_float(p.g[row * Cl + h * D + tid]);
    } else if (tid < D + kSlice) {
      const int r = tid - D;
      gate_s[r] =
          p.w_gb != nullptr ? dot_row(w_rows, D + r, ga_s) : p.gate[row * Cl + h * D + slice0 + r];
    }
    __syncthreads();

    // The KDA step (the operator's decode kernel, the same operations in the same order).
    float qh[4], kh[4], alpha[4];
    step_factors(&qkv_s[0][k0], &qkv_s[1][k0], g_s + k0, p.dt_bias + h * D + k0, a_exp, p.gate_mode,
                 p.lower_bound, p.scale, qh, kh, alpha);
    // The record's alpha and k^: every block holds them, the cluster's first block's first warp
    // writes them.
    float* record = nullptr;
    if constexpr (kRecords) {
      record = p.records + (row * p.heads + h) * (3 * D);
      if (rank == 0 && warp == 0) {
        *reinterpret_cast<float4*>(record + k0) =
            make_float4(alpha[0], alpha[1], alpha[2], alpha[3]);
        *reinterpret_cast<float4*>(record + D + k0) = make_float4(kh[0], kh[1], kh[2], kh[3]);
      }
    }
    // The record's u: every lane holds it, lane i writes it.
    const float mine =
        step_rows(S, alpha, kh, qh, beta_s, &qkv_s[2][v_row0], lane, [&](int i, float delta) {
          if constexpr (kRecords) {
            if (lane == i) record[2 * D + v_row0 + i] = delta;
          }
        });
    // This block's outputs into every block of the cluster (o_s of this token's parity: a block
    // one token ahead writes the other half), then the cluster's barrier.
    float* o_now = o_s[NC > 1 ? t & 1 : 0];
    if constexpr (NC > 1) {
      if (t == 0) cluster_wait();
    }
    if (lane < kRowsPerWarp) {
      const float value = round_bf16(mine);
      if constexpr (NC > 1) {
#pragma unroll
        for (int to = 0; to < NC; ++to) store_shared_cluster(o_now + v_row0 + lane, to, value);
      } else {
        o_now[v_row0 + lane] = value;
      }
    }
    if constexpr (NC > 1) {
      cluster_sync();
    } else {
      __syncthreads();
    }

    // The states after this token (the step's last; a verify step's each, where the row keeps
    // them), stored before the norm so that they drain while it runs: the step ends when its stores
    // have landed. After the cluster's barrier, whose release would wait for them.
    if (verify) {
      const std::int64_t keep = p.slots[b * T + t];
      if (keep >= p.num_slots && reporter) atomicOr(p.status, kDeviceStatusSlot);
      if (keep >= 0 && keep < p.num_slots && keep != p.padding_slot) {
        store_state((keep * p.heads + h) * D * D);
        if (conv_owner) store_conv(p.conv_pools[branch] + (keep * Cl + cc) * kHist);
      }
    } else if (!kRecords && t == T - 1) {
      store_state(state_base);
      if (conv_owner) store_conv(conv_state);
    }

    // The gated RMSNorm of the head (the norm kernel's operations), one warp; each block writes
    // its own rows.
    if (warp == 0) {
      float o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] = o_now[k0 + j];
      const float inv_rms = head_inv_rms(o, p.eps);
      if (NC == 1 || (k0 >= slice0 && k0 < slice0 + kSlice)) {
        *reinterpret_cast<uint2*>(p.y + row * Cl + h * D + k0) =
            gated_norm4(o, inv_rms, gate_s + (k0 - slice0), p.g_bias, h * D + k0, p.o_norm + k0);
      }
    }
    __syncthreads();  // the next token overwrites the shared rows
  }
}

// Shared memory for the second factors' rows: up to 64 KB, past the 48 KB a launch gets unasked
// (raised once a device, before the kernel's first launch there).
constexpr int kMaxRowBytes = 2 * D * D * 2;

template <int W, bool kF32State, int NC, bool kRecords>
cudaError_t launch_kernel(const FusedDecodeParams& p, cudaStream_t stream) {
  const cudaError_t raised =
      kda::detail::allow_shared_memory<fused_decode_kernel<W, kF32State, NC, kRecords>>(
          kMaxRowBytes);
  if (raised != cudaSuccess) return raised;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(p.sequences * NC), static_cast<unsigned>(p.heads));
  config.blockDim = dim3(kThreads);
  // W_gb's rows (this block's) follow W_fb's: room for both when there is W_gb.
  const int rows = p.w_gb != nullptr ? D + D / NC : p.w_fb != nullptr ? D : 0;
  config.dynamicSmemBytes = static_cast<std::size_t>(rows) * D * 2;
  config.stream = stream;
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = NC;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = NC > 1 ? 2 : 1;
  return cudaLaunchKernelEx(&config, fused_decode_kernel<W, kF32State, NC, kRecords>, p);
}

template <int W, int NC>
cudaError_t launch_state(const FusedDecodeParams& p, cudaStream_t stream) {
  if (p.records != nullptr) {
    return p.f32_state ? launch_kernel<W, true, NC, true>(p, stream)
                       : launch_kernel<W, false, NC, true>(p, stream);
  }
  return p.f32_state ? launch_kernel<W, true, NC, false>(p, stream)
                     : launch_kernel<W, false, NC, false>(p, stream);
}

template <int W>
cudaError_t launch_width(const FusedDecodeParams& p, cudaStream_t stream) {
  switch (fused_decode_cluster(p)) {
    case 1:
      return launch_state<W, 1>(p, stream);
    case 2:
      return launch_state<W, 2>(p, stream);
    case 4:
      return launch_state<W, 4>(p, stream);
    case 8:
      return launch_state<W, 8>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

int fused_decode_cluster(const FusedDecodeParams& p) {
  return p.cluster == 2 || p.cluster == 4 || p.cluster == 8 ? p.cluster : 1;
}

bool fused_decode_fits(const FusedDecodeParams& p) {
  auto aligned = [](const void* ptr, std::uintptr_t bytes) {
    return (reinterpret_cast<std::uintptr_t>(ptr) & (bytes - 1)) == 0;
  };
  return p.width >= 2 && p.width <= 4 && p.heads >= 1 && p.decode_tokens >= 1 &&
         (p.cluster == 1 || p.cluster == 2 || p.cluster == 4 || p.cluster == 8) &&
         p.sequences * fused_decode_cluster(p) <= 0x7fffffff && p.heads <= 65535 &&
         p.proj_stride % 2 == 0 && aligned(p.proj, 4) &&
         (p.w_fb != nullptr ? aligned(p.w_fb, 16) : p.g != nullptr) &&
         (p.w_gb != nullptr ? aligned(p.w_gb, 16) : p.gate != nullptr) && aligned(p.y, 16) &&
         aligned(p.state, p.f32_state ? 16 : 8) && aligned(p.conv_weight, 4) &&
         aligned(p.dt_bias, 16) &&
         (p.records == nullptr
              ? p.conv_records == nullptr
              : p.num_accepted == nullptr && p.slots != nullptr && aligned(p.records, 16) &&
                    p.conv_records != nullptr && aligned(p.conv_records, 4)) &&
         (p.fold_rows == nullptr ||
          (p.num_accepted == nullptr && p.slots != nullptr && p.fold_counts != nullptr &&
           p.fold_records != nullptr && aligned(p.fold_records, 16) &&
           p.fold_conv_records != nullptr && aligned(p.fold_conv_records, 4)));
}

cudaError_t launch_fused_decode(const FusedDecodeParams& p, cudaStream_t stream) {
  if (!fused_decode_fits(p)) return cudaErrorInvalidValue;
  if (p.sequences == 0) return cudaSuccess;
  switch (p.width) {
    case 2:
      return launch_width<2>(p, stream);
    case 3:
      return launch_width<3>(p, stream);
    case 4:
      return launch_width<4>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kda::layer::cuda
