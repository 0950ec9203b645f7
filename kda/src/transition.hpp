// Checks of the segment-transition entry points (kda.hpp, "Segment transitions"), shared by the
// CPU and CUDA backends.
#pragma once

#include <cstdint>

#include "kda/kda.hpp"
#include "tensor_extents.hpp"

namespace kda {

// pairs >= 0, head dims in range, pointers non-null when pairs > 0, sizes without overflow,
// s_out equal to s_in or disjoint from it, and disjoint from p_t and h_t.
Status validate_apply_transition(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                                 const float* s_in, const float* p_t, const float* h_t,
                                 const float* s_out);

namespace detail {
// validate(p) plus: no states, slots or out; inputs present; p_t / h_t present and disjoint from
// the inputs and each other.
Status validate_transition(const Problem& p, const Tensors& t, const float* p_t, const float* h_t);
// The device extents of a transition's tensors (for CudaOptions::check_pointers).
Status transition_extents(const Problem& p, const Tensors& t, const float* p_t, const float* h_t,
                          TensorExtents* out);
}  // namespace detail
}  // namespace kda
