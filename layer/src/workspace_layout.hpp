// layer/src/workspace_layout.hpp — internal: the one workspace layout of a layer forward, for both
// backends. The regions every forward uses — the core's inputs and output, the output gate, the
// core's own workspace, a decode batch's cu_seqlens and identity slots — come first, then each
// backend's scratch; every region at a kWorkspaceAlignment-aligned offset from the first aligned
// byte of the caller's workspace (which may have any alignment: total includes the slack).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kda/kda.hpp"
#include "kda/layer/layer.hpp"

namespace kda::layer::detail {

// cuBLAS's wish for its workspace and matrices; the CPU takes the same.
inline constexpr std::size_t kWorkspaceAlignment = 256;

// Columns of the CUDA layer's fused input projection x·W_inᵀ [T, stride]:
// q | k | v | f_a | g_a | b | padding, without g_a for a full-rank gate (g_a = -1).
struct ProjColumns {
  std::int64_t q = 0, k = 0, v = 0, f_a = 0, g_a = 0, b = 0;
  std::int64_t stride = 0;  // rounded up to 8 columns: 16-byte rows for cuBLAS and the conv
};
ProjColumns proj_columns(const Config& c);

struct WorkspaceLayout {
  // Both backends.
  std::size_t q = 0, k = 0, v = 0, g = 0, o = 0;  // bf16 [T, Cl]: the core's inputs and output
  std::size_t beta = 0;                           // bf16 [T, Hl]
  std::size_t gate = 0;                           // f32 [T, Cl]: the output gate before the norm
  std::size_t cu = 0;              // i64 [N + 1]: a decode batch's cu_seqlens (0, t, 2t, ...)
  std::size_t identity_slots = 0;  // i32 [N]: 0, 1, ..., N-1, a decode batch's rows as slots
  std::size_t slot_bitmap = 0;     // u64 [ceil(num_slots / 64)]: the CPU's checkpoint check
  std::size_t core = 0;            // the operator's workspace, core_bytes long
  std::size_t core_bytes = 0;
  // CPU scratch: x widened f32 [T, E] (later the o_proj result), one projection f32 [T, Cl]
  // before its conv (in the gate's bytes: consumed before the gate is written), the low-rank
  // factor f32 [T, D].
  std::size_t hidden_f32 = 0, pre_f32 = 0, lowrank_f32 = 0;
  // CUDA scratch: cuBLAS's workspace, and the fused input projection bf16 [T, proj stride], whose
  // region the core's workspace shares (the projections are consumed before the core runs).
  std::size_t cublas = 0, proj = 0;
  std::size_t total = 0;  // bytes the caller's workspace needs, alignment slack included
};

// Throws kda::Error (kInvalidArgument for negative sizes, kOverflow past 64 bits).
WorkspaceLayout make_workspace_layout(Backend backend, const Config& c, std::int64_t tokens,
                                      std::int64_t sequences, std::int64_t num_slots);

// The intermediates every forward has, in one caller workspace.
struct Intermediates {
  bf16_bits *q, *k, *v, *g, *o, *beta;  // the core's inputs and output
  float* gate;                          // the output gate before the norm
};

// The core's tensors of a forward (Tensors or DecodeTensors): its inputs and output in the
// workspace, the gate parameters; the caller adds states, slots and cu_seqlens.
template <typename CoreTensors>
CoreTensors core_tensors(const Intermediates& m, const float* A_log, const float* dt_bias) {
  CoreTensors t;
  t.q = m.q;
  t.k = m.k;
  t.v = m.v;
  t.g = m.g;
  t.beta = m.beta;
  t.A_log = A_log;
  t.dt_bias = dt_bias;
  t.out = m.o;
  return t;
}

// The same for a forward's batch, after its checks: an error (64-bit overflow) names `what`.
WorkspaceLayout forward_workspace_layout(Backend backend, const Config& c, std::int64_t tokens,
                                         std::int64_t sequences, std::int64_t num_slots,
                                         const char* what);

// The layout's regions in one caller workspace.
class WorkspaceRegions {
 public:
  WorkspaceRegions(const WorkspaceLayout& layout, void* workspace)
      : layout_(layout),
        base_(reinterpret_cast<unsigned char*>(
            (reinterpret_cast<std::uintptr_t>(workspace) + kWorkspaceAlignment - 1) /
            kWorkspaceAlignment * kWorkspaceAlignment)) {}
  template <typename T>
  T* at(std::size_t WorkspaceLayout::*region) const {
    return reinterpret_cast<T*>(base_ + layout_.*region);
  }
  Workspace core() const { return Workspace{base_ + layout_.core, layout_.core_bytes}; }
  Intermediates intermediates() const {
    return {at<bf16_bits>(&WorkspaceLayout::q), at<bf16_bits>(&WorkspaceLayout::k),
            at<bf16_bits>(&WorkspaceLayout::v), at<bf16_bits>(&WorkspaceLayout::g),
            at<bf16_bits>(&WorkspaceLayout::o), at<bf16_bits>(&WorkspaceLayout::beta),
            at<float>(&WorkspaceLayout::gate)};
  }

 private:
  const WorkspaceLayout& layout_;
  unsigned char* base_;
};

}  // namespace kda::layer::detail
