// examples/cases/case_file.hpp — one KDA forward described by a safetensors "case file".
//
// The case-file contract (what `kda-run --case IN --output OUT` reads and writes; metadata values
// are strings):
//   Metadata mode        = "prefill" | "decode"                  (optional; default prefill)
//            gate        = "lower_bound" | "softplus"            (required)
//            lower_bound = finite number in [-5, 0)              (required with gate lower_bound)
//            scale       = finite number > 0                      (optional; default K^-0.5)
//            final_state = "f32" | "bf16" | "none"                (optional; default: the dtype of
//                                                                   initial_state, else f32)
//   Prefill (mode prefill): one forward of B rows of T tokens, or of N varlen sequences
//   Inputs   q, k, g  BF16 [B, T, H, K]     v BF16 [B, T, H, V]     beta BF16 [B, T, H]
//            A_log F32 [H]                  dt_bias F32 [H, K]
//              (or as checkpoints store them: A_log [1, 1, H, 1], dt_bias [H * K])
//            initial_state F32 or BF16 [N, H, V, K]   (optional)
//            cu_seqlens I64 or I32 [N + 1]           (optional; then B = 1, N sequences; else N =
//            B)
//            checkpoint_offsets I64 or I32 [N, R]    (optional, R >= 1: prefix-cache checkpoints;
//                                                     -1, a multiple of 16 up to the sequence's
//                                                     length, or that length)
//   Output   out BF16 [B, T, H, V] and, unless final_state is none, final_state [N, H, V, K];
//            with checkpoint_offsets, checkpoint_states [N, R, H, V, K] in final_state's dtype
//            (f32 when final_state is none): the state after that many of the sequence's tokens,
//            zeros where the offset is -1. Metadata records the backend that ran and the gate.
//   Decode (mode decode): T new tokens on each of B rows (a speculative verify step that keeps
//   the state after every token)
//   Inputs   q, k, g  BF16 [B, T, H, K]     v BF16 [B, T, H, V]     beta BF16 [B, T, H]
//            with 1 <= T <= kMaxDecodeTokens; A_log, dt_bias as for prefill
//            initial_state F32 or BF16 [B, H, V, K]   (optional; else zeros)
//            no cu_seqlens, no checkpoint_offsets
//   Output   out BF16 [B, T, H, V]; final_state [B, H, V, K] (after the last token) and
//            intermediate_states [B, T, H, V, K] (after each token), both in the state dtype:
//            final_state's (f32 or bf16; none is refused), else initial_state's, else f32 (an
//            initial state of the other dtype is converted first).
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
#include "kda/layer/weights.hpp"

namespace kda::engine {

enum class CaseMode : int { kPrefill = 0, kDecode = 1 };

struct KdaCase {
  std::string source;  // the file (or caller's source name) it came from: prefixes run_case errors
  CaseMode mode = CaseMode::kPrefill;
  // Prefill: the forward as the file describes it (no state slots). With checkpoint_offsets,
  // checkpoints and checkpoint_offsets_dtype are set too; run_case then runs it on a state pool.
  Problem problem;
  DecodeProblem decode;  // decode: the verify step run_case makes (batch, tokens, pool, dtypes)
  std::map<std::string, Tensor> tensors;  // the inputs named above that are present
};

// Reads and validates a case file. Throws kda::Error.
KdaCase load_case(const std::string& path);
// Validates a case held in memory (tensors by name, metadata); `source` prefixes messages.
KdaCase make_case(std::map<std::string, Tensor> tensors,
                  const std::map<std::string, std::string>& metadata, const std::string& source);

// Runs the forward (or the decode step) on `backend` (kAuto: CUDA when present and able, else CPU).
// Returns the output tensors (prefill: out, final_state unless none, checkpoint_states with
// checkpoints; decode: out, final_state, intermediate_states) and sets *used to the backend that
// ran.
std::vector<Tensor> run_case(const KdaCase& kda_case, BackendChoice backend,
                             Backend* used = nullptr);

// Throws kda::Error when `output_path` is the file `input_path` (same path, or a symlink or hard
// link to it: same device and inode when the output exists, same canonical path otherwise).
void check_output_is_not_input(const std::string& input_path, const std::string& output_path);

// check_output_is_not_input + load_case + run_case + save_safetensors (atomic): nothing is written
// unless all succeeded. Every error names the input or the output file.
void run_case_file(const std::string& input_path, const std::string& output_path,
                   BackendChoice backend, Backend* used = nullptr);

// ---- layer case files: one whole KDA layer (kda/layer/layer.hpp) ------------------------------
//
// What `kda-run --layer-case IN --output OUT` reads and writes (metadata values are strings):
//   Inputs   hidden_states  BF16 [T, E]
//            the layer's weights under their checkpoint names without the layer prefix
//              (q_proj.weight, ..., o_proj.weight; kda/engine/layer_weights_io.hpp has the table),
//              which also give the sizes: H from b_proj.weight [H, E], D from o_norm.weight [D],
//              the conv width W from q_conv1d.weight [C, 1, W]; and the output gate's form:
//              g_proj.weight [C, E] (full rank, Kimi K3) or g_a_proj / g_b_proj (low rank), not
//              both; g_b_proj.bias [C] when present
//            cu_seqlens     I64 or I32 [N + 1]            (optional; else N = 1, the T tokens)
//            conv_state_q, conv_state_k, conv_state_v  BF16 [N, H*D, W-1]   (optional; else zeros)
//            recurrent_state  F32 or BF16 [N, H, V, K]   (optional; else zeros)
//            checkpoint_offsets I64 or I32 [N, R]   (optional, R >= 1: prefix-cache checkpoints,
//              as for --case; not in decode mode)
//   Metadata gate = "lower_bound" | "softplus" (required); lower_bound (required with lower_bound);
//            norm_eps = finite number > 0 (optional, default 1e-5);
//            final_state = "f32" | "bf16" | "none" (optional; default: recurrent_state's dtype,
//              else f32; the recurrent state is carried in that dtype, an initial state of the
//              other dtype converted first; none is refused in decode mode)
//            mode = "prefill" | "decode" (optional; default prefill); tokens = T (decode: 1..16,
//              dividing hidden_states' rows): N rows of T tokens, hidden_states [N*T, E] with
//              row n's tokens consecutive, no cu_seqlens, initial states [N, ...], one verify step
//   Output   out BF16 [T, E] and, unless final_state is none, the final states under the input
//            names (conv_state_q, conv_state_k, conv_state_v, recurrent_state), so that an output
//            file can give the next chunk its initial states; with checkpoint_offsets also
//            checkpoint_states [N, R, H, V, K] (in final_state's dtype, as above; f32 when it is
//            none) and checkpoint_conv_state_q, _k, _v BF16 [N, R, H*D, W-1]: the states after
//            that many of the sequence's tokens, zeros where the offset is -1; in decode mode
//            also intermediate_states [N, T, H, V, K] and intermediate_conv_state_q, _k, _v BF16
//            [N, T, H*D, W-1], the states after each token. Metadata records the backend.
// Everything is validated before any computation; a bad file throws kda::Error naming the file and
// the tensor or key, and no output is written.
struct LayerCase {
  std::string source;
  layer::Weights weights;
  std::int64_t tokens = 0, sequences = 0;
  std::vector<std::int64_t> cu_seqlens;  // [N + 1]
  Tensor hidden;                         // BF16 [T, E]
  Tensor conv_state[3];                  // q, k, v: BF16 [N, C, W-1], or empty (zeros)
  Tensor recurrent_state;                // [N, H, V, K], or empty (zeros)
  DType final_dtype = DType::kF32;       // kNone: no final states in the output
  std::int64_t checkpoints = 0;          // R: prefix-cache checkpoints per sequence (0: none)
  std::vector<std::int64_t> checkpoint_offsets;  // [N, R]
  // Decode mode (metadata mode: decode): N rows of decode_tokens tokens each (hidden_states
  // [N * decode_tokens, E], row n's tokens consecutive), run as one speculative verify step that
  // keeps the states after every token; 0: a prefill.
  std::int64_t decode_tokens = 0;
};

// Reads and validates a layer case file. Throws kda::Error.
LayerCase load_layer_case(const std::string& path);
// Runs the layer on `backend` (kAuto: CUDA when present and able, else CPU). Returns out and,
// unless final_dtype is kNone, the final states; sets *used to the backend that ran.
std::vector<Tensor> run_layer_case(const LayerCase& layer_case, BackendChoice backend,
                                   Backend* used = nullptr);
// check_output_is_not_input + load_layer_case + run_layer_case + save_safetensors (atomic).
void run_layer_case_file(const std::string& input_path, const std::string& output_path,
                         BackendChoice backend, Backend* used = nullptr);

}  // namespace kda::engine
