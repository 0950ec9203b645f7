// kda/src/cuda/decode_kernel.cuh — the CUDA decode step of KDA: 1..16 new tokens per sequence on a
// pool of state slots, updated in place (decode.cu launches it for kda::decode_cuda).
//
// 8 warps per (sequence, head), in 1, 2 or 4 blocks (decode_blocks_per_head); warp w owns rows v in
// [16w, 16w + 16) of S^T (V-first state) and each lane 4 consecutive channels of K of every row
// (fp32 state: a row is one 512-byte warp access), or 8 of every other row (bf16 state: a half-warp
// per row, one warp access covers two rows, fewer instructions per state byte); the state stays in
// registers (64 floats a thread) across the step's tokens. The kernel is meant to be bound by
// moving the state (read and written once per step); the dot products are shuffle reductions
// (DecodeLanes). A step that folds the records step before it (kda.hpp, "Fold") applies that step's
// accepted records to the state right after loading it, with the commit's operations (commit.cu).
//
// The step's output goes through an epilogue (StoreOut for the operator's out): launch_decode is
// a template over it, so that a caller inside the project (the whole layer's gated RMSNorm,
// layer/src/cuda/decode_norm.cu) can consume a head's rows in the same launch, behind the same
// checks and the same kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "argument_table.hpp"
#include "cuda/common.cuh"
#include "cuda/cuda_check.hpp"
#include "kda/kda.hpp"

namespace kda::detail {

constexpr int D = 128;
constexpr int kWarps = 8;          // a (sequence, head)'s warps, in all its blocks
constexpr int kRows = D / kWarps;  // 16 rows of S^T per warp

// The kernel's parameters in two structs: what every step reads, kept within 128 bytes, and what
// only the records form and a fold read. (Past 128 bytes the compiler reads a by-value struct's
// fields through a register base instead of as kernel parameters: with records and fold pointers
// in one struct the plain bf16-state kernel ran 1.13-1.36x slower on the H200.)
struct DecodeParams {
  InputPointers in;
  const std::int32_t* slots;         // [batch], or [batch, tokens] with verify
  const std::int32_t* num_accepted;  // [batch] with verify, else null
  void* pool;
  bf16* out;
  std::int64_t num_slots;
  std::int32_t padding_slot = -1;  // DecodeProblem::padding_slot (negative: none)
  int tokens;
  int num_heads;
  GateMode gate;
  float lower_bound;
  float scale;
  std::uint32_t* status;  // caller's device status word, or null
};
static_assert(sizeof(DecodeParams) <= 128, "the steps' parameters stay within 128 bytes");

struct DecodeExtras {
  float* records;  // [batch, tokens, H, 3 D] in the records form, else null
  // A fold (kda.hpp): the records step's records, each row's row of it and accepted count; null
  // rows: no fold.
  const float* fold_records;
  const std::int32_t* fold_rows;
  const std::int32_t* fold_counts;
  int fold_batch;
  int fold_tokens;
};

// kVec consecutive channels of K per lane: 4 (a row is one warp-wide access; 5 shuffle steps per
// reduction of 16 rows) or 8 (a warp access covers two rows, one per half-warp; 4 shuffle steps,
// each reducing two rows at once: fewer instructions per state byte, which a bf16 state needs).
template <int kVec>
struct DecodeLanes {
  static_assert(kVec == 4 || kVec == 8, "4 or 8 channels per lane");
  static constexpr int kLanesPerRow = D / kVec;           // 32 or 16
  static constexpr int kRowsPerStep = 32 / kLanesPerRow;  // rows one warp access covers: 1 or 2
  static constexpr int kSteps = kRows / kRowsPerStep;     // 16 or 8 row groups per warp
};

// kVec bf16 values at p as floats (8- or 16-byte load).
template <int kVec>
__device__ __forceinline__ void load_bf16(const bf16* p, float (&x)[kVec]) {
  std::uint32_t w[kVec / 2];
  if constexpr (kVec == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    w[0] = raw.x;
    w[1] = raw.y;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    w[0] = raw.x;
    w[1] = raw.y;
    w[2] = raw.z;
    w[3] = raw.w;
  }
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    const float2 pair = unpack_bf16x2(w[i]);
    x[2 * i] = pair.x;
    x[2 * i + 1] = pair.y;
  }
}

// What a step does with its output. For every token in order, every thread of the block calls
// ahead() before the step's arithmetic (what the epilogue loads for the lane's row, so that its
// latency hides behind the step's) and token() after it, with the value of row `row` of token
// `tok`, head h, where `holds` says the lane holds one. A row the step skips (padding, or bad
// metadata reported) gets skipped() from the whole block, which then returns. Where a head's warps
// are cut into several blocks (decode_blocks_per_head), every block of the head calls all three
// and threadIdx.x counts within the block, not the head; an epilogue that combines a head's rows
// across its warps says so (kWholeHead) and runs one block a head. The operator's: out stored, a
// skipped row's left as it was. A caller that consumes the rows in the same launch (the layer's
// gated norm, layer/src/cuda/decode_norm.cu) passes its own.
struct StoreOut {
  static constexpr bool kWholeHead = false;
  struct Nothing {};
  __device__ __forceinline__ Nothing ahead(const DecodeParams&, std::int64_t, int, int,
                                           bool) const {
    return {};
  }
  __device__ __forceinline__ void token(const DecodeParams& p, std::int64_t tok, int h, int row,
                                        float value, bool holds, Nothing) const {
    if (holds) p.out[(tok * p.num_heads + h) * D + row] = __float2bfloat16(value);
  }
  __device__ __forceinline__ void skipped(const DecodeParams&, std::int64_t, int) const {}
};

// kVerify: a verify step (compiled apart, so that a plain step's kernel is the one it was).
// kRecords: a verify step's record-and-commit form (kda.hpp): the row's slot as a plain step's,
// the pool only read, each token's record (alpha, k^, u) written instead of its state.
// kFold: a plain or records step that folds the records step before it (kda.hpp, "Fold";
// compiled apart, as the verify forms are, so that a step without a fold runs the kernel it ran).
// kSplit: the blocks a (sequence, head)'s 8 warps are cut into (1, 2 or 4), block blockIdx.z
// holding warps [blockIdx.z 8 / kSplit, ...). The warps never meet (but in a kWholeHead epilogue,
// which takes one block), so the cut is only the block scheduler's granularity: below.
template <bool kF32State, int kVec, bool kVerify, bool kRecords, bool kFold, class Epilogue,
          int kSplit>
__global__ void __launch_bounds__(kWarps / kSplit * 32, 2 * kSplit)
    kda_decode_kernel(const DecodeParams p, const DecodeExtras x, const Epilogue epilogue) {
  static_assert(!(kVerify && kRecords), "the records form reads slots as a plain step does");
  static_assert(!(kVerify && kFold), "a per-token-states verify step does not fold");
  using L = DecodeLanes<kVec>;
  const std::int64_t b = blockIdx.x;
  const int h = blockIdx.y;
  static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4, "1, 2 or 4 blocks a head");
  static_assert(!Epilogue::kWholeHead || kSplit == 1, "an epilogue over a head's warps: one block");
  const int lane = threadIdx.x & 31;
  // The warp and thread over the head's blocks (one block: the same as within it).
  const int warp = static_cast<int>(
      kSplit == 1 ? threadIdx.x >> 5 : (threadIdx.x >> 5) + blockIdx.z * (kWarps / kSplit));
  const int tid = kSplit == 1 ? static_cast<int>(threadIdx.x) : 32 * warp + lane;
  // A verify step starts from the slot after the row's last accepted token (kda.hpp).
  constexpr bool verify = kVerify;
  std::int32_t slot = -1;
  if constexpr (verify) {
    const std::int32_t accepted = p.num_accepted[b];
    if (accepted < 1 || accepted > p.tokens) {
      if (h == 0 && tid == 0) report_status(p.status, kDeviceStatusAccepted);
    } else {
      slot = p.slots[b * p.tokens + accepted - 1];
    }
  } else {
    slot = p.slots[b];
  }
  if (b == 0) {  // the first row's blocks (1-4 a head) check the gate parameters for everyone
    const int k = tid & (D - 1);
    if (gate_params_bad(tid == 0 ? p.in.A_log[h] : 0.f, p.in.dt_bias[h * D + k])) {
      report_status(p.status, kDeviceStatusGateParams);
    }
  }
  if (slot >= p.num_slots && h == 0 && tid == 0) report_status(p.status, kDeviceStatusSlot);
  // Padding (a negative entry or the caller's null slot), or out of range: skipped, never indexed.
  if (slot < 0 || slot >= p.num_slots || slot == p.padding_slot) {
    epilogue.skipped(p, b, h);
    return;
  }
  // A fold's row and count: out of range, the row is skipped as padding (reported).
  int fold_row = -1, fold_count = 0;
  if (kFold && (fold_row = x.fold_rows[b]) >= 0) {
    fold_count = x.fold_counts[b];
    if (fold_row >= x.fold_batch || fold_count < 1 || fold_count > x.fold_tokens) {
      if (h == 0 && tid == 0) report_status(p.status, kDeviceStatusAccepted);
      epilogue.skipped(p, b, h);
      return;
    }
  }

  const std::int64_t H = p.num_heads;
  const std::int64_t state_base = (static_cast<std::int64_t>(slot) * H + h) * D * D;
  const int k0 = kVec * (lane % L::kLanesPerRow);
  const int sub = lane / L::kLanesPerRow;  // which row of a step's group this lane holds
  const int v_row0 = warp * kRows;
  auto row_of = [&](int i) { return v_row0 + L::kRowsPerStep * i + sub; };

  float S[L::kSteps][kVec];  // S^T[row_of(i)][k0 .. k0 + kVec)
#pragma unroll
  for (int i = 0; i < L::kSteps; ++i) {
    const std::int64_t off = state_base + static_cast<std::int64_t>(row_of(i)) * D + k0;
    if constexpr (kF32State) {
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        const float4 f =
            *reinterpret_cast<const float4*>(static_cast<const float*>(p.pool) + off + j);
        S[i][j] = f.x;
        S[i][j + 1] = f.y;
        S[i][j + 2] = f.z;
        S[i][j + 3] = f.w;
      }
    } else {
      load_bf16<kVec>(static_cast<const bf16*>(p.pool) + off, S[i]);
    }
  }

  // Writes S to the state at `base` (its slot's head).
  auto store_state = [&](std::int64_t base) {
#pragma unroll
    for (int i = 0; i < L::kSteps; ++i) {
      const std::int64_t off = base + static_cast<std::int64_t>(row_of(i)) * D + k0;
      if constexpr (kF32State) {
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          *reinterpret_cast<float4*>(static_cast<float*>(p.pool) + off + j) =
              make_float4(S[i][j], S[i][j + 1], S[i][j + 2], S[i][j + 3]);
        }
      } else {
        std::uint32_t w[kVec / 2];
#pragma unroll
        for (int j = 0; j < kVec / 2; ++j) w[j] = pack_bf16x2(S[i][2 * j], S[i][2 * j + 1]);
        if constexpr (kVec == 4) {
          *reinterpret_cast<uint2*>(static_cast<bf16*>(p.pool) + off) = make_uint2(w[0], w[1]);
        } else {
          *reinterpret_cast<uint4*>(static_cast<bf16*>(p.pool) + off) =
              make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
  };
  if (kFold && fold_row >= 0) {
    // The commit's operations (apply_record) on the records of the row named, in token order; a
    // bf16 state rounded as the commit's store rounds it; a records step stores the folded state
    // (the pool's only write of such a step).
    const float* rec =
        x.fold_records + (static_cast<std::int64_t>(fold_row) * x.fold_tokens * H + h) * (3 * D);
    for (int t = 0; t < fold_count; ++t) {
      const float* r = rec + static_cast<std::int64_t>(t) * H * (3 * D);
      float a[kVec], kh[kVec];
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        const float4 fa = *reinterpret_cast<const float4*>(r + k0 + j);
        const float4 fk = *reinterpret_cast<const float4*>(r + D + k0 + j);
        a[j] = fa.x, a[j + 1] = fa.y, a[j + 2] = fa.z, a[j + 3] = fa.w;
        kh[j] = fk.x, kh[j + 1] = fk.y, kh[j + 2] = fk.z, kh[j + 3] = fk.w;
      }
#pragma unroll
      for (int i = 0; i < L::kSteps; ++i) {
        apply_record(S[i], a, kh, r[2 * D + row_of(i)]);
      }
    }
    if constexpr (!kF32State) {
#pragma unroll
      for (int i = 0; i < L::kSteps; ++i) {
#pragma unroll
        for (int j = 0; j < kVec; j += 2) {
          const float2 f = unpack_bf16x2(pack_bf16x2(S[i][j], S[i][j + 1]));
          S[i][j] = f.x, S[i][j + 1] = f.y;
        }
      }
    }
    if constexpr (kRecords) store_state(state_base);
  }
  const float a_exp = __expf(p.in.A_log[h]);
  // Sum over the lanes that share a row (all 32, or each half-warp).
  auto row_sum = [](float x) {
#pragma unroll
    for (int o = L::kLanesPerRow / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
  };

  for (int t = 0; t < p.tokens; ++t) {
    const std::int64_t tok = b * p.tokens + t;
    // The lane's output row of this token: what the epilogue reads ahead of the step for it.
    const int i_mine = lane % L::kLanesPerRow;
    const auto ahead = epilogue.ahead(p, tok, h, row_of(i_mine), i_mine < L::kSteps);
    const std::int64_t qk_off = (tok * H + h) * D;
    float q[kVec], k[kVec], g[kVec];
    load_bf16<kVec>(p.in.q + qk_off + k0, q);
    load_bf16<kVec>(p.in.k + qk_off + k0, k);
    load_bf16<kVec>(p.in.g + qk_off + k0, g);
    const float beta = sigmoid_f(__bfloat162float(p.in.beta[tok * H + h]));
    float vr[L::kSteps];  // v of this lane's rows row_of(i)
    {
      const uint4* vp = reinterpret_cast<const uint4*>(p.in.v + qk_off + v_row0);
      const uint4 r0 = vp[0], r1 = vp[1];
      float v16[kRows];
      const __nv_bfloat162* h0 = reinterpret_cast<const __nv_bfloat162*>(&r0);
      const __nv_bfloat162* h1 = reinterpret_cast<const __nv_bfloat162*>(&r1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v16[2 * i] = __bfloat162float(h0[i].x);
        v16[2 * i + 1] = __bfloat162float(h0[i].y);
        v16[8 + 2 * i] = __bfloat162float(h1[i].x);
        v16[8 + 2 * i + 1] = __bfloat162float(h1[i].y);
      }
      // (by a select: a run-time index would put the array in local memory)
#pragma unroll
      for (int i = 0; i < L::kSteps; ++i) {
        vr[i] = L::kRowsPerStep == 1 ? v16[i] : (sub ? v16[2 * i + 1] : v16[2 * i]);
      }
    }
    float qq = 0.f, kk = 0.f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      qq += q[j] * q[j];
      kk += k[j] * k[j];
    }
    const float inv_q = rsqrtf(row_sum(qq) + 1e-6f) * p.scale;
    const float inv_k = rsqrtf(row_sum(kk) + 1e-6f);
    float qh[kVec], kh[kVec], alpha[kVec], dtb[kVec];
    // dt_bias again for each token (an L1 hit) rather than kVec registers held across the loop.
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p.in.dt_bias + h * D + k0 + j);
      dtb[j] = f.x;
      dtb[j + 1] = f.y;
      dtb[j + 2] = f.z;
      dtb[j + 3] = f.w;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      qh[j] = q[j] * inv_q;
      kh[j] = k[j] * inv_k;
      alpha[j] = __expf(gate_activation(p.gate, g[j], a_exp, dtb[j], p.lower_bound));
    }
    // The record's alpha and k^: every warp holds them, warp 0 (its first row group) writes them.
    float* record = nullptr;
    if constexpr (kRecords) {
      record = x.records + (tok * H + h) * (3 * D);
      if (warp == 0 && sub == 0) {
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          *reinterpret_cast<float4*>(record + k0 + j) =
              make_float4(alpha[j], alpha[j + 1], alpha[j + 2], alpha[j + 3]);
          *reinterpret_cast<float4*>(record + D + k0 + j) =
              make_float4(kh[j], kh[j + 1], kh[j + 2], kh[j + 3]);
        }
      }
    }

    float dot[L::kSteps];
#pragma unroll
    for (int i = 0; i < L::kSteps; ++i) {
      float d = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        S[i][j] *= alpha[j];
        d += S[i][j] * kh[j];
      }
      dot[i] = d;
    }
#pragma unroll
    for (int o = L::kLanesPerRow / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int i = 0; i < L::kSteps; ++i) dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], o);
    }
#pragma unroll
    for (int i = 0; i < L::kSteps; ++i) {
      const float delta = beta * (vr[i] - dot[i]);
      // The record's u: every lane of the row group holds it, lane i of the group writes it.
      if constexpr (kRecords) {
        if (lane % L::kLanesPerRow == i) record[2 * D + row_of(i)] = delta;
      }
      float d = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        S[i][j] = fmaf(delta, kh[j], S[i][j]);
        d += S[i][j] * qh[j];
      }
      dot[i] = d;
    }
#pragma unroll
    for (int o = L::kLanesPerRow / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int i = 0; i < L::kSteps; ++i) dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], o);
    }
    // Lane (sub, i) of its row group writes row row_of(i): every lane of the group holds the sum.
    float mine = 0.f;
#pragma unroll
    for (int i = 0; i < L::kSteps; ++i) mine = i_mine == i ? dot[i] : mine;
    epilogue.token(p, tok, h, row_of(i_mine), mine, i_mine < L::kSteps, ahead);
    if constexpr (verify) {  // the state after this token, where the row keeps it
      const std::int32_t keep = p.slots[b * p.tokens + t];
      if (keep >= p.num_slots && h == 0 && tid == 0) {
        report_status(p.status, kDeviceStatusSlot);
      }
      if (keep >= 0 && keep < p.num_slots && keep != p.padding_slot)
        store_state((static_cast<std::int64_t>(keep) * H + h) * D * D);
    }
  }

  if constexpr (!verify && !kRecords) store_state(state_base);
}

// Channels per lane (DecodeLanes), measured on the H200 (same run, 3 rounds, B = 1..256): 4 for an
// fp32 state (8 took 1.06-1.42x the time: 64 more bytes of state a lane, spills at 128 registers)
// and 8 for a bf16 state (0.92-0.97x of 4's time), which needs q, k, g and the pool 16-byte
// aligned: the contract asks 8 of them (argument_table.cpp), so a pointer that is only 8-byte
// aligned takes 4.
inline int decode_vec(const DecodeProblem& p, const DecodeTensors& t) {
  auto aligned16 = [](const void* ptr) {
    return (reinterpret_cast<std::uintptr_t>(ptr) & 15) == 0;
  };
  const bool wide = p.state_dtype == DType::kBF16 && aligned16(t.q) && aligned16(t.k) &&
                    aligned16(t.g) && aligned16(t.state_pool);
  return wide ? 8 : 4;
}

// The blocks a (sequence, head)'s warps are cut into, for every form of the step (an epilogue
// over a head's warps keeps one: launch_decode). The warps never meet, so the cut changes no bit;
// it changes what the block scheduler hands out. Smaller blocks win where the grid is a few waves
// (the last blocks' ramp and drain are shorter) and lose where it is many (more blocks to hand out:
// more per-block cost). Measured on the H200 (kda-bench --decode, H = 32, one token, two rounds, us
// at B = 1 / 16 / 64 / 256 for 1 / 2 / 4 blocks): fp32 state 4.64 / 3.41 / 3.19, 15.50 / 14.78
// / 14.46, 74.8 / 74.2 / 74.4, 280-282 / 285 / 290; bf16 3.59 / 2.76 / 2.70, 9.19 / 8.77
// / 8.76, 45.6 / 42.0 / 40.7-41.0, 164.8-165.0 / 150.7 / 155.8-156.0. Hence by the step's
// (sequence, head) pairs: fp32 4 up to 1024, 2 up to 2048, else 1; bf16 4 up to 2048, else 2.
// Checked at B = 8-192 (kda-bench --decode --batch, two rounds): the rule's count within 0.4 %
// (fp32) and 0.9 % (bf16) of the best at every B. A step of several tokens a row with an fp32
// state (kda-bench --verify --batch, T = 4 and 8, B = 1-64) differs: the per-token-states form is
// fastest in 4 blocks up to 128 pairs and in 1 from 256 (at 256-1024 pairs 4 blocks took 1.03-1.07x
// one's: B = 32, T = 8, 184.8 against 173.0 us); the plain, records and folding forms keep 4 blocks
// up to 2048 pairs (at 1536 and 2048, 2 blocks took 1.016-1.028x four's in the plain and records
// forms, 0.995-0.996x in the folding form). Hence fp32: per-token states 4 up to 128 pairs, else
// 1 (of one token: 4 up to 1024, else 1, the rule measured before); other steps of several tokens
// 4 up to 2048, else 1.
// CudaOptions::decode_blocks_per_head forces a count; KDA_DECODE_BLOCKS_PER_HEAD=1|2|4 in the
// environment (read once; a knob for the benchmarks' A/B, not part of the contract) replaces the
// rule where the options leave it open.
inline int decode_blocks_per_head(const DecodeProblem& p, const CudaOptions& opt) {
  if (opt.decode_blocks_per_head != 0) return opt.decode_blocks_per_head;
  static const int forced = [] {
    const char* env = std::getenv("KDA_DECODE_BLOCKS_PER_HEAD");
    const int v = env != nullptr ? std::atoi(env) : 0;
    return valid_blocks_per_head(v) ? v : 0;
  }();
  if (forced != 0) return forced;
  const std::int64_t pairs = p.batch * p.num_heads;
  if (p.state_dtype == DType::kF32) {
    if (p.verify && !p.records) {  // per-token states
      return pairs <= (p.tokens > 1 ? 128 : 1024) ? 4 : 1;
    }
    if (p.tokens > 1) return pairs <= 2048 ? 4 : 1;
    return pairs <= 1024 ? 4 : pairs <= 2048 ? 2 : 1;
  }
  return pairs <= 2048 ? 4 : 2;
}

// kda::decode_cuda with `epilogue` in place of StoreOut: the same checks, then the kernel compiled
// for the step's form and state.
template <class Epilogue>
Status launch_decode(const DecodeProblem& p, const DecodeTensors& t, void* stream_ptr,
                     const CudaOptions& opt, const Epilogue& epilogue) {
  ArgumentTable args;
  Status st = check_cuda_call(p, t, opt, &args);
  if (!st.ok()) return st;
  if (opt.check_pointers) {
    st = check_device_arguments(args);
    if (!st.ok()) return st;
  }
  if (p.batch == 0) return Status::Ok();
  DecodeParams prm{};
  prm.in = InputPointers::from_tensors(t);
  prm.slots = t.slots;
  prm.num_accepted = p.verify ? t.num_accepted : nullptr;
  prm.pool = t.state_pool;
  prm.out = static_cast<bf16*>(t.out);
  DecodeExtras extras{};
  extras.records = p.records ? t.records : nullptr;
  if (p.folds()) {
    extras.fold_records = t.fold_records;
    extras.fold_rows = t.fold_rows;
    extras.fold_counts = t.fold_counts;
    extras.fold_batch = static_cast<int>(std::min<std::int64_t>(p.fold_batch, 0x7fffffff));
    extras.fold_tokens = static_cast<int>(p.fold_tokens);
  }
  prm.num_slots = p.num_slots;
  prm.padding_slot = p.padding_slot;
  prm.tokens = static_cast<int>(p.tokens);
  prm.num_heads = static_cast<int>(p.num_heads);
  prm.gate = p.gate;
  prm.lower_bound = p.lower_bound;
  prm.scale = p.effective_scale();
  prm.status = t.device_status;
  // An epilogue over a head's warps (the whole layer's gated norm) runs one block a head: with its
  // blocks as a thread block cluster meeting for the sum of squares in distributed shared memory it
  // was measured slower (docs/design/decode.md), and its cut kernels are not compiled below.
  const int split = Epilogue::kWholeHead ? 1 : decode_blocks_per_head(p, opt);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_heads),
                     static_cast<unsigned>(split));
  cfg.blockDim = dim3(kWarps / split * 32);
  cfg.stream = static_cast<cudaStream_t>(stream_ptr);
  const bool wide = decode_vec(p, t) == 8;
  // The kernel compiled for the step's form (kVerify, kRecords, kFold), its state (fp32, or bf16
  // at eight or four channels a lane) and its blocks a head.
  auto launch = [&](auto verify, auto records, auto fold, auto blocks) {
    constexpr bool kV = decltype(verify)::value, kR = decltype(records)::value;
    constexpr bool kF = decltype(fold)::value;
    constexpr int kS = decltype(blocks)::value;
    return p.state_dtype == DType::kF32
               ? cudaLaunchKernelEx(&cfg, kda_decode_kernel<true, 4, kV, kR, kF, Epilogue, kS>, prm,
                                    extras, epilogue)
           : wide ? cudaLaunchKernelEx(&cfg, kda_decode_kernel<false, 8, kV, kR, kF, Epilogue, kS>,
                                       prm, extras, epilogue)
                  : cudaLaunchKernelEx(&cfg, kda_decode_kernel<false, 4, kV, kR, kF, Epilogue, kS>,
                                       prm, extras, epilogue);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  // In 2 or 4 blocks a head where the split asks it.
  auto launch_split = [&](auto verify, auto records, auto fold) {
    if constexpr (!Epilogue::kWholeHead) {
      if (split == 4) return launch(verify, records, fold, std::integral_constant<int, 4>{});
      if (split == 2) return launch(verify, records, fold, std::integral_constant<int, 2>{});
    }
    return launch(verify, records, fold, std::integral_constant<int, 1>{});
  };
  cudaError_t err;
  if (p.folds()) {
    err = p.records ? launch_split(No{}, Yes{}, Yes{})  // records, folding
                    : launch_split(No{}, No{}, Yes{});  // plain, folding
  } else if (p.records) {
    err = launch_split(No{}, Yes{}, No{});
  } else if (p.verify) {
    err = launch_split(Yes{}, No{}, No{});
  } else {
    err = launch_split(No{}, No{}, No{});
  }
  return cuda_status(err, "kda_decode_kernel");
}

}  // namespace kda::detail
