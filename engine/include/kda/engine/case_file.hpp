// kda/engine/case_file.hpp — one KDA forward described by a safetensors "case file".
//
// The case-file contract (what `kda-run --case IN --output OUT` reads and writes; metadata values
// are strings):
//   Inputs   q, k, g  BF16 [B, T, H, K]     v BF16 [B, T, H, V]     beta BF16 [B, T, H]
//            A_log F32 [H]                  dt_bias F32 [H, K]
//            initial_state F32 or BF16 [N, H, V, K]   (optional)
//            cu_seqlens I64 or I32 [N + 1]           (optional; then B = 1, N sequences; else N =
//            B)
//   Metadata gate        = "lower_bound" | "softplus"            (required)
//            lower_bound = finite number in [-5, 0)              (required with gate lower_bound)
//            scale       = finite number > 0                      (optional; default K^-0.5)
//            final_state = "f32" | "bf16" | "none"                (optional; default: the dtype of
//                                                                   initial_state, else f32)
//   Output   out BF16 [B, T, H, V] and, unless final_state is none, final_state [N, H, V, K];
//            metadata records the backend that ran and the gate.
// Other tensors and metadata keys are ignored (a file may carry reference outputs alongside).
// Everything — shapes, dtypes, cu_seqlens contents, metadata values — is validated before any
// computation; a bad file throws kda::Error naming the tensor or key, and no output is written.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kda/engine/model_spec.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/kda.hpp"

namespace kda::engine {

struct KdaCase {
  std::string source;  // the file (or caller's source name) it came from: prefixes run_case errors
  Problem problem;
  std::map<std::string, Tensor> tensors;  // the inputs named above that are present
};

// Reads and validates a case file. Throws kda::Error.
KdaCase load_case(const std::string& path);
// Validates a case held in memory (tensors by name, metadata); `source` prefixes messages.
KdaCase make_case(std::map<std::string, Tensor> tensors,
                  const std::map<std::string, std::string>& metadata, const std::string& source);

// Runs the forward on `backend` (kAuto: CUDA when present and able, else CPU). Returns the output
// tensors (out, and final_state unless none) and sets *used to the backend that ran.
std::vector<Tensor> run_case(const KdaCase& kda_case, BackendChoice backend,
                             Backend* used = nullptr);

// Throws kda::Error when `output_path` is the file `input_path` (same path, or a symlink or hard
// link to it: same device and inode when the output exists, same canonical path otherwise).
void check_output_is_not_input(const std::string& input_path, const std::string& output_path);

// check_output_is_not_input + load_case + run_case + save_safetensors (atomic): nothing is written
// unless all succeeded. Every error names the input or the output file.
void run_case_file(const std::string& input_path, const std::string& output_path,
                   BackendChoice backend, Backend* used = nullptr);

}  // namespace kda::engine
