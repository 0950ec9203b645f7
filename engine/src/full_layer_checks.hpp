// What FullLayerCpu and FullLayerCuda check and derive alike: the core's problem for a batch, the
// gate weights' range, the state pools, and hidden / out. Each throws kda::Error with `what`
// ("KDA layer forward", "KDA layer forward (CUDA)") in front of the message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kda/engine/kda_full_layer.hpp"
#include "kda/kda.hpp"

namespace kda::engine::detail {

// The core's prefill problem for a batch; sequence n's recurrent state is pool row slots[n]
// (`slot_list`: Problem::num_state_slots) or, without a slot list, row n. Also sizes the core's
// workspace.
Problem full_layer_core_problem(const FullLayerConfig& c, std::int64_t tokens,
                                std::int64_t sequences, std::int64_t num_slots, bool slot_list,
                                DType state_dtype);

// A_log finite with |A_log| <= kMaxAbsALog, dt_bias finite: the core would refuse them, but only
// after the conv states were updated.
void check_gate_weights(const std::vector<float>& A_log, const std::vector<float>& dt_bias);

// With sequences: every pool the layer uses is non-null (the conv pools when W > 1), and the
// recurrent dtype is f32 or bf16.
void check_state_pools(const FullLayerState& state, std::int64_t sequences, std::int64_t conv_width,
                       const char* what);

// With tokens: hidden and out non-null and disjoint ([T, hidden_size] bf16 each).
void check_hidden_and_out(const void* hidden, const void* out, std::int64_t tokens,
                          std::int64_t hidden_size, const char* what);

// The caller's region for a layer's weight image: not null, `alignment`-aligned, at least `needed`
// bytes (weight_image_bytes). Throws kda::Error (kInvalidArgument) naming the numbers, with `what`
// ("KDA layer", "KDA layer (CUDA)") in front.
void check_weight_region(const void* image, std::size_t bytes, std::size_t needed,
                         std::size_t alignment, const char* what);

}  // namespace kda::engine::detail
