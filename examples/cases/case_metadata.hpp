// What the two case-file formats (kda-run --case: the operator; --layer-case: the whole layer)
// read alike from a safetensors file's metadata: the gate and its lower bound, the final-state
// dtype, strict numbers. Messages start with the file (`source`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kda/engine/safetensors.hpp"
#include "kda/kda.hpp"

namespace kda::engine::detail {

using CaseMetadata = std::map<std::string, std::string>;

// kInvalidArgument "source: what".
[[noreturn]] void case_fail(const std::string& source, const std::string& what);

// The whole string as a decimal number (no leading space, no hexadecimal, nothing after it);
// false otherwise.
bool parse_case_number(const std::string& text, double* value);
// A number as the messages print it.
std::string case_number_text(double value);

// 'gate' (lower_bound | softplus, required) and, with the bounded gate, 'lower_bound' (required,
// finite, in [-5, 0)); a 'lower_bound' given with softplus is checked too and kept.
void read_case_gate(const CaseMetadata& metadata, const std::string& source, GateMode* gate,
                    float* lower_bound);

// 'final_state' (f32 | bf16 | none) when present; `fallback` otherwise.
DType read_case_final_state(const CaseMetadata& metadata, const std::string& source,
                            DType fallback);

// `count` state values in `dtype` (f32 or bf16): the first ones from `initial` (F32 or BF16; bf16
// -> f32 exactly, f32 -> bf16 rounded to nearest even), zeros past its end (all zeros when it is
// empty).
std::vector<std::uint8_t> case_state_values(const Tensor& initial, DType dtype, std::size_t count);

}  // namespace kda::engine::detail
