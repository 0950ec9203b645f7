// Checks of the segment-transition entry points (kda.hpp, "Segment transitions"), shared by the
// CPU and CUDA backends.
#pragma once

#include <cstdint>

#include "argument_table.hpp"
#include "kda/kda.hpp"

namespace kda {

// pairs >= 0, head dims in range, pointers non-null when pairs > 0, sizes without overflow,
// s_out equal to s_in or disjoint from it, and disjoint from p_t and h_t. `table`, when given,
// receives the call's argument table (for the CUDA backend's further checks).
Status validate_apply_transition(std::int64_t pairs, std::int64_t head_dim_k,
                                 std::int64_t head_dim_v, const float* s_in, const float* p_t,
                                 const float* h_t, const float* s_out,
                                 detail::ArgumentTable* table = nullptr);

namespace detail {
// validate(p) plus: no states, slots or out; inputs present; p_t / h_t present and disjoint from
// the inputs and each other. `table`, when given, receives the call's argument table.
Status validate_transition(const Problem& p, const Tensors& t, const float* p_t, const float* h_t,
                           ArgumentTable* table = nullptr);
}  // namespace detail
}  // namespace kda
