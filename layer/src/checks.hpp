// layer/src/checks.hpp — internal: what the CPU and the CUDA layer check and derive alike, in one
// place: the core's problems for a batch, the batch itself, the gate weights' range, the weight
// image's region. Each throws kda::Error with `what` ("KDA layer forward (CPU)", "KDA layer forward
// (CUDA)") in front of the message.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kda/detail/checked_math.hpp"
#include "kda/kda.hpp"
#include "kda/layer/layer.hpp"
#include "state_slots.hpp"
#include "workspace_layout.hpp"

namespace kda::layer::detail {

// A fold's rows and counts (Batch::fold_rows / fold_counts) where the host can read them (the
// CPU's own arrays), else nulls: each non-padding row's fold row and count are checked then.
struct HostFold {
  const std::int32_t* rows = nullptr;
  const std::int32_t* counts = nullptr;
};

// A prefill's cu_seqlens where the host can read them, int64 or int32 (Batch::cu_seqlens or
// cu_seqlens_i32 on the CPU, their host copies on CUDA); neither: the host cannot.
struct HostCuSeqlens {
  const std::int64_t* i64 = nullptr;
  const std::int32_t* i32 = nullptr;
  bool present() const noexcept { return i64 != nullptr || i32 != nullptr; }
  std::int64_t operator[](std::int64_t n) const noexcept {
    return i64 != nullptr ? i64[n] : std::int64_t{i32[n]};
  }
};

// Whether slots entry `slot` is padding: negative, or the batch's padding_slot.
inline bool is_padding(const Batch& batch, std::int64_t slot) noexcept {
  return slot < 0 || slot == batch.padding_slot;
}

// The operator's linear repeated-slot search (kda/src/state_slots.hpp), for the layer's checks.
using kda::detail::find_repeated_slot;

// The dtype of the batch's device cu_seqlens (kI64 unless cu_seqlens_i32 is set): the core's
// Problem::cu_seqlens_dtype.
inline DType cu_seqlens_dtype(const Batch& batch) noexcept {
  return batch.cu_seqlens_i32 != nullptr && batch.cu_seqlens == nullptr ? DType::kI32 : DType::kI64;
}

// The core's decode step for a batch: its rows, tokens (Batch::decode_tokens, at least one: a
// prefill batch gets a step it never runs) and states, the verify form (per-token states where
// num_accepted is set, records), the padding slot, and the fold of the records step before it
// (Batch::fold_sequences).
DecodeProblem decode_step_problem(const Config& c, const Batch& batch, const State& state);

// What a decode step's core tensors take from the batch and the states, beside the forward's
// intermediates (core_tensors): slots, accepted counts, the recurrent pool, the records and the
// fold's records, rows and counts.
void add_step_batch(DecodeTensors& t, const Batch& batch, const State& state);

// Every check of a forward that needs no device, before anything is written:
//   - tokens, sequences >= 0; decode_tokens in [0, kMaxDecodeTokens]; a decode batch has
//     tokens == sequences * decode_tokens; a prefill with tokens has sequences and cu_seqlens;
//   - a prefill gives cu_seqlens or cu_seqlens_i32, not both, and a host copy of the same dtype;
//   - cu_seqlens (prefill) and slots contents where the host can read them (`cu_host`,
//     `slots_host`: the batch's own arrays on the CPU, its optional host copies on CUDA):
//     kda::validate_cu_seqlens, and each slot below num_slots, non-negative ones distinct;
//   - a verify step (num_accepted): decode with slots, [N, decode_tokens] entries checked as
//     above, each num_accepted in [1, decode_tokens] where the host can read it (`accepted_host`);
//   - without slots, sequences <= num_slots;
//   - the pools non-null (conv pools when W > 1), the recurrent dtype f32 or bf16;
//   - hidden and out non-null ([T, hidden_size] bf16 each, their bytes within 64 bits);
//   - the core's problem valid.
// `core_inputs` (Layer::core_inputs): a prefill without checkpoints, which needs neither out nor
// the recurrent pool.
void check_forward(const Config& c, const Batch& batch, HostCuSeqlens cu_host,
                   const std::int32_t* slots_host, const std::int32_t* accepted_host,
                   HostFold fold_host, const State& state, const void* hidden, const void* out,
                   const char* what, bool core_inputs = false);
// The workspace non-null and at least `needed` bytes (make_workspace_layout's total), after
// check_forward (which makes the layout's sizes valid).
void check_workspace(Workspace workspace, std::size_t needed, const Batch& batch, const char* what);

// Every host check of a forward, in order — check_forward, the batch's workspace layout on
// `backend`, check_workspace, out overlapping none of the other forward_buffers, hidden included (a
// forward writes out last: it would overwrite states or metadata already used, or the workspace
// o_proj reads) —
// and that layout.
WorkspaceLayout checked_forward_layout(Backend backend, const Config& c, const Batch& batch,
                                       HostCuSeqlens cu_host, const std::int32_t* slots_host,
                                       const std::int32_t* accepted_host, HostFold fold_host,
                                       const State& state, const void* hidden, const void* out,
                                       Workspace workspace, const char* what,
                                       bool core_inputs = false);

// RunOptions' enumerations and cluster sizes known, on both backends (the CPU uses none of them,
// but a value no backend knows is a caller's mistake either way).
void check_run_options(const RunOptions& options, const char* what);

// One of the caller's regions a forward reads or writes beside the layer's weights, and the bytes
// of it the forward may touch; null where the batch names none (or does not use it).
struct ForwardBuffer {
  const void* ptr = nullptr;
  std::uint64_t bytes = 0;
  const char* name = "";
};
inline constexpr std::size_t kForwardBuffers = 20;
// hidden and out first, then the workspace (its declared bytes), the state pools, the batch's
// arrays, the records regions and the device status word: what the CUDA layer asks the driver
// about, and what out must not overlap. After check_forward (which bounds the sizes).
std::array<ForwardBuffer, kForwardBuffers> forward_buffers(const Config& c, const Batch& batch,
                                                           const State& state, const void* hidden,
                                                           const void* out, Workspace workspace);

// A prefill's checkpoint requests (Batch::checkpoints > 0) where the host can read them: each
// offset -1, or a multiple of kda::kCheckpointAlignment up to its sequence's length, or that
// length; each row -1 or inside the pools; the rows written distinct and none a `slots_host`
// entry. `seen`: ceil(num_slots / 64) words of scratch (the workspace's slot bitmap).
void check_checkpoints(const Batch& batch, HostCuSeqlens cu_host, const std::int32_t* slots_host,
                       std::int64_t num_slots, std::uint64_t* seen, const char* what);

// kda::validate_gate_parameters on the weights (sizes checked first): the core would refuse them,
// but only after the conv states were updated (on CUDA, only through the device status word).
void check_gate_weights(const Weights& weights);

// The caller's region for a layer's weight image: not null, `alignment`-aligned, at least `needed`
// bytes (weight_image_bytes). Throws kda::Error (kInvalidArgument) naming the numbers.
void check_weight_region(const void* image, std::size_t bytes, std::size_t needed,
                         std::size_t alignment, const char* what);

using kda::detail::byte_ranges_overlap;

}  // namespace kda::layer::detail
