// layer/src/workspace_layout.cpp — the one workspace layout of a layer forward
// (workspace_layout.hpp).
#include "workspace_layout.hpp"

#include <algorithm>
#include <string>

#include "aligned_regions.hpp"
#include "backends.hpp"
#include "kda/error.hpp"

namespace kda::layer::detail {

ProjColumns proj_columns(const Config& c) {
  const std::int64_t Cl = c.local_channels(), D = c.head_dim;
  ProjColumns p;
  p.q = 0;
  p.k = Cl;
  p.v = 2 * Cl;
  p.f_a = 3 * Cl;
  // The full-rank gate's product is a GEMM of its own, with f32 out (layer_cuda.cpp): no columns.
  p.g_a = c.full_rank_gate ? -1 : 3 * Cl + D;
  p.b = c.full_rank_gate ? 3 * Cl + D : 3 * Cl + 2 * D;
  p.stride = (p.b + c.local_heads() + 7) / 8 * 8;
  return p;
}

WorkspaceLayout make_workspace_layout(Backend backend, const Config& c, std::int64_t tokens,
                                      std::int64_t sequences, std::int64_t num_slots) {
  if (tokens < 0 || sequences < 0 || num_slots < 0) {
    throw Error(StatusCode::kInvalidArgument,
                "KDA layer workspace: tokens, sequences and num_slots must be >= 0");
  }
  // Past 2^62 the counts' own sums (sequences + 1, num_slots + 63) would leave int64; any such
  // workspace overflows 64-bit byte counts anyway.
  constexpr std::int64_t kMaxCount = std::int64_t{1} << 62;
  if (tokens > kMaxCount || sequences > kMaxCount || num_slots > kMaxCount) {
    throw Error(StatusCode::kOverflow, "KDA layer workspace size overflows 64 bits");
  }
  AlignedRegions regions("KDA layer workspace size", kWorkspaceAlignment);
  auto per_token = [&](std::int64_t width, std::uint64_t element_bytes) {
    return regions.take(regions.bytes_of(tokens, width, element_bytes));
  };
  const std::int64_t Cl = c.local_channels();
  WorkspaceLayout layout;
  layout.q = per_token(Cl, sizeof(bf16_bits));
  layout.k = per_token(Cl, sizeof(bf16_bits));
  layout.v = per_token(Cl, sizeof(bf16_bits));
  layout.g = per_token(Cl, sizeof(bf16_bits));
  layout.o = per_token(Cl, sizeof(bf16_bits));
  layout.beta = per_token(c.local_heads(), sizeof(bf16_bits));
  layout.gate = per_token(Cl, sizeof(float));
  layout.cu = regions.take(regions.bytes_of(sequences + 1, 1, sizeof(std::int64_t)));
  layout.identity_slots = regions.take(regions.bytes_of(sequences, 1, sizeof(std::int32_t)));
  layout.slot_bitmap = regions.take(regions.bytes_of((num_slots + 63) / 64, 1, 8));
  // Sized with a slot list (the larger of the two: it adds the core's duplicate-slot bitmap).
  const Problem core = core_prefill_problem(c, tokens, sequences, num_slots, DType::kF32);
  if (Status st = workspace_size(core, backend, &layout.core_bytes); !st) {
    throw Error(st, "KDA layer workspace");
  }
  // A verify step runs the operator's decode (CPU: its per-thread scratch and slot bitmap).
  if (sequences > 0) {
    std::size_t decode_bytes = 0;
    const DecodeProblem step = core_decode_problem(c, sequences, 1, num_slots, DType::kF32);
    if (Status st = decode_workspace_size(step, backend, &decode_bytes); !st) {
      throw Error(st, "KDA layer workspace");
    }
    layout.core_bytes = std::max<std::uint64_t>(layout.core_bytes, decode_bytes);
  }
  if (backend == Backend::kCuda) {
    layout.cublas = regions.take(kCublasWorkspaceBytes);
    const std::uint64_t proj_bytes = regions.bytes_of(tokens, proj_columns(c).stride, 2);
    layout.proj = regions.take(std::max<std::uint64_t>(proj_bytes, layout.core_bytes));
    layout.core = layout.proj;
  } else {
    layout.hidden_f32 = per_token(c.hidden_size, sizeof(float));
    // Each projection before its conv, then the gate's and beta's, are consumed before the output
    // gate is computed: they share its bytes.
    layout.pre_f32 = layout.gate;
    layout.lowrank_f32 = per_token(c.head_dim, sizeof(float));
    layout.core = regions.take(layout.core_bytes);
  }
  layout.total = regions.end() + kWorkspaceAlignment;  // slack for an unaligned workspace pointer
  return layout;
}

WorkspaceLayout forward_workspace_layout(Backend backend, const Config& c, std::int64_t tokens,
                                         std::int64_t sequences, std::int64_t num_slots,
                                         const char* what) {
  try {
    return make_workspace_layout(backend, c, tokens, sequences, num_slots);
  } catch (const Error& e) {
    throw Error(e.code(), std::string(what) + ": " + e.what());
  }
}

}  // namespace kda::layer::detail
