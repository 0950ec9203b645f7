// kda/engine/model_spec.hpp — the model description (YAML, a Hugging Face config.json as is, or a
// Hugging Face folder), parsed and validated into a ModelSpec.
//
// Schema. JSON is read too (YAML 1.2 is a superset of JSON), so a Hugging Face `config.json` loads
// unchanged; see examples/models/kimi-linear-48b-a3b.json. A key listed here with the wrong type or
// an out-of-range value is an error. A Hugging Face config is read by its model family's keys
// (model_family.hpp: Kimi-Linear, Kimi K3, GLM-5.3-Flash; `text_config` is followed; an unknown
// model_type or architectures is refused); the keys below are the engine's own schema, which is
// Kimi-Linear's.
//
//   name: Kimi-Linear-48B-A3B        # optional string; default: the file name without extension
//                                    #   (config.json, a folder: the folder's name)
//   family: kimi-linear              # optional: kimi-linear | kimi-k3 | glm-5.3-flash; wins over
//                                    #   model_type / architectures
//   model_type: kimi_linear          # optional (Hugging Face): names the family
//   hidden_size: 2304                # required, 1..1048576
//   num_hidden_layers: 27            # required, 1..4096
//   linear_attn_config:              # required map
//     num_heads: 32                  # required, 1..1024 (H)
//     head_dim: 128                  # required, 1..1024 (K = V)
//     short_conv_kernel_size: 4      # optional, 1..16, default 4 (W: the whole layer's short
//                                    #   convolution; not used by the KDA core alone)
//     kda_layers: [1, 2, 3, 5]       # required, 1-based, each in [1, num_hidden_layers], unique,
//                                    #   at least one
//     full_attn_layers: [4]          # optional (default none), 1-based, same rules, and disjoint
//                                    #   from kda_layers
//     gate: softplus                 # softplus | lower_bound; required, except that with
//                                    #   model_type: kimi_linear and no gate_lower_bound it
//                                    #   defaults to softplus (the released model's gate)
//     gate_lower_bound: -5.0         # required with gate: lower_bound; finite, in [-5, 0);
//                                    #   checked the same way when given with softplus (unused)
//     use_full_rank_gate: false      # optional: g_proj instead of g_a/g_b_proj (Kimi K3);
//                                    #   default: whether the checkpoint holds g_proj.weight
//   rms_norm_eps: 1.0e-5             # optional (Hugging Face), finite, > 0, default 1e-5: the
//                                    #   epsilon of the whole layer's gated RMSNorm
//   weights: kda-params.safetensors  # optional; a relative path is relative to the file's folder;
//                                    #   a safetensors file, a sharded checkpoint's
//                                    #   model.safetensors.index.json, or a folder holding either
//                                    #   (a description without model keys reads the folder's
//                                    #   config.json for them)
//   tensor_prefix: model.layers.{i}.self_attn.  # optional: a KDA layer's tensors, {i} the
//                                    #   0-based model layer; default: the family's
//   runtime:                         # optional map; every key optional
//     max_tokens: 8192               # default 8192; >= 1; tokens per prefill, all sequences
//     max_sequences: 8               # default 8; 1..1048576; sequences per prefill = state slots
//     state_dtype: fp32              # default fp32; fp32 | bf16
//     workspace_plan: reuse          # default reuse; reuse | sum (reuse: each KDA layer's
//                                    #   workspace is live only while it runs, so all layers
//                                    #   share one; sum: every buffer its own memory)
//     backend: auto                  # default auto; auto | cpu | cuda
//     layers: whole                  # default whole; whole | core (what a KDA layer of the engine
//                                    #   is: the whole layer, hidden states in and out, or the
//                                    #   KDA core alone, q/k/v/g/beta in; see engine.hpp)
//     tp_size: 1                     # default 1; tensor-parallel ranks, dividing num_heads
//     tp_rank: 0                     # default 0; this engine's rank, in [0, tp_size)
//     prefill_schedule: auto         # default auto; auto | two-phase | pipelined (the CUDA
//                                    #   prefill's phases, docs/KDA.md section 3)
//     decode_step: auto              # default auto; auto | one-launch | fused |
//                                    #   fused-after-gemms | separate: how a CUDA whole layer's
//                                    #   decode step runs (kda::layer::DecodeKernel, LAYER.md)
//     max_verify_tokens: 0           # default 0; 0..16: tokens per row of a record-and-commit
//                                    #   verify step (BatchMetadata::records); sizes each KDA
//                                    #   layer's records buffers (max_sequences rows); 0: none,
//                                    #   and such steps are refused
//     record_regions: 1              # default 1; 1 | 2: records regions of that size a layer
//                                    #   keeps; 2 lets the next decode step fold a records step
//                                    #   (BatchMetadata::fold_rows) while writing the other
//
// Unknown keys. linear_attn_config and runtime are the engine's: a key there that is not listed
// above is a warning ("did you mean `max_tokens`?"), or an error with ModelSpecOptions::strict.
// Top-level keys the engine does not read are ignored silently (a Hugging Face config carries
// dozens), except one within a typo of an absent engine key (`runtme:`), which warns the same way.
// Warnings are returned in ModelSpec::warnings; the library prints nothing.
//
// Byte counts derived from the sizes (inputs and outputs at max_tokens, the state pool of every KDA
// layer at max_sequences, their sum) must fit in 64 bits; the loader checks them, so every later
// size computation on a validated spec is overflow-free.
//
// Errors throw kda::Error (code kInvalidArgument, or kOverflow for byte counts) whose message
// starts with "file:line:column:" and names the key, e.g.
//   models/m.yaml:5:14: linear_attn_config.num_heads: expected an integer, got 'many'
// A missing required key is reported at its enclosing map, or at the near-miss key when there is
// one ("required key is missing; found `num_head` (line 7): a typo?").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kda/engine/model_family.hpp"
#include "kda/kda.hpp"
#include "kda/layer/layer.hpp"
#include "kda/planner/memory_plan.hpp"

namespace kda::engine {

enum class BackendChoice : int { kAuto = 0, kCpu = 1, kCuda = 2 };
const char* to_string(BackendChoice choice) noexcept;
// Parses "auto" / "cpu" / "cuda"; false on anything else.
bool parse_backend_choice(const std::string& text, BackendChoice* choice) noexcept;

// What each KDA layer of an engine is (runtime.layers): the whole layer (projections, short
// convolutions, the KDA core, gated norm, output projection: hidden states in, hidden states out)
// or the KDA core alone (q, k, v, g, beta in).
enum class LayerMode : int { kWhole = 0, kCoreOnly = 1 };
const char* to_string(LayerMode mode) noexcept;  // "whole" / "core"
// Parses "whole" / "core"; false on anything else.
bool parse_layer_mode(const std::string& text, LayerMode* mode) noexcept;

// "auto" / "two-phase" / "pipelined" (kda::to_string's names) -> PrefillSchedule; false for
// anything else (*schedule untouched).
bool parse_prefill_schedule(const std::string& text, PrefillSchedule* schedule) noexcept;
// "fp32" / "bf16" (runtime.state_dtype's names) -> DType::kF32 / kBF16; false for anything else
// (*dtype untouched).
bool parse_state_dtype(const std::string& text, DType* dtype) noexcept;

struct RuntimeSpec {
  std::int64_t max_tokens = 8192;
  std::int64_t max_sequences = 8;
  DType state_dtype = DType::kF32;  // kF32 or kBF16
  // reuse by default: the layers run one after another on one stream, so their workspaces can
  // share memory (Kimi-Linear-48B-A3B: 3.8 GiB instead of 13.7 GiB on the CPU).
  planner::PlanMode workspace_plan = planner::PlanMode::kReuse;
  BackendChoice backend = BackendChoice::kAuto;
  LayerMode layer_mode = LayerMode::kWhole;
  // The CUDA prefill's schedule (kda::CudaOptions::schedule); the CPU backend ignores it.
  PrefillSchedule prefill_schedule = PrefillSchedule::kAuto;
  // How a CUDA whole layer runs a decode step (kda::layer::RunOptions::decode_kernel); the CPU
  // backend and core-only layers ignore it. Every choice computes the same layer (to rounding).
  layer::DecodeKernel decode_step = layer::DecodeKernel::kAuto;
  // Tensor parallelism (whole layers): this engine holds heads [tp_rank·H/tp_size,
  // (tp_rank+1)·H/tp_size) of every KDA layer, and its whole-layer outputs are partial sums that
  // the host runtime all-reduces over the ranks. The loader checks tp_size divides num_heads.
  int tp_size = 1;
  int tp_rank = 0;
  // The most tokens per row of a record-and-commit verify step (BatchMetadata::records), 0..16:
  // each KDA layer keeps records for max_sequences x max_verify_tokens row-token pairs in the arena
  // (f32 [H/tp, 3 D] each, and bf16 [3 H/tp D] conv inputs with whole layers). 0: no records
  // buffers; a records step is refused.
  std::int64_t max_verify_tokens = 0;
  // Records regions of that size each KDA layer keeps, 1 or 2 (BatchMetadata::records_region):
  // with 2, a records step writes one while it folds the one the records step before it wrote
  // (BatchMetadata::fold_rows, the commit deferred into the next step).
  int record_regions = 1;
};

struct ModelSpec {
  std::string name;
  std::string source;  // where it was read from (file path or the caller's source name)
  std::int64_t hidden_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_heads = 0;  // H
  std::int64_t head_dim = 0;   // K = V
  std::int64_t short_conv_kernel_size = 4;
  float rms_norm_eps = 1e-5f;          // the whole layer's gated RMSNorm epsilon
  std::vector<int> kda_layers;         // 1-based, as written in the YAML (sorted ascending)
  std::vector<int> kda_layer_indices;  // the same, 0-based (model.layers.{i} in checkpoints)
  std::vector<int> full_attn_layers;   // 1-based, sorted ascending
  GateMode gate = GateMode::kSoftplus;
  float gate_lower_bound = -5.0f;  // meaningful with GateMode::kLowerBound
  // The whole layer's output gate is one full-rank projection g_proj (Kimi K3) instead of the
  // low-rank g_a_proj / g_b_proj pair (kda::layer::Config::full_rank_gate).
  bool full_rank_gate = false;
  // The model family (model_family.hpp: "Kimi-Linear", "Kimi K3", "GLM-5.3-Flash") and how it was
  // recognised ("model_type kimi_k3", "family: kimi-k3", "the checkpoint's tensor names"); both
  // empty when nothing says.
  std::string family;
  std::string family_source;
  // A KDA layer's tensors in the checkpoint: this with {i} the 0-based model layer, + the names of
  // layer_weights_io.hpp. What an engine reads of a family.
  std::string tensor_prefix = kDefaultTensorPrefix;
  std::string weights;  // resolved path, or empty when none
  RuntimeSpec runtime;
  // Unknown keys in the engine's sections, one message each ("file:line:col: key: ..."), in file
  // order; the caller decides whether and where to show them.
  std::vector<std::string> warnings;

  std::int64_t num_kda_layers() const noexcept {
    return static_cast<std::int64_t>(kda_layer_indices.size());
  }
  // Heads of each KDA layer this engine holds: num_heads / runtime.tp_size.
  std::int64_t local_heads() const noexcept { return num_heads / runtime.tp_size; }
  // Bytes of one recurrent state slot of one layer: local_heads * V * K * sizeof(state dtype).
  std::uint64_t state_slot_bytes() const noexcept;
  // Bytes of one conv state slot of one layer and one projection (q, k or v), whole layers only:
  // bf16 [local_heads * head_dim, short_conv_kernel_size - 1].
  std::uint64_t conv_state_slot_bytes() const noexcept;
};

// Values that replace the description's runtime keys (unset: the file's value, or the default),
// e.g. from a command line. Each is checked as the file's own would be (its range, and the byte
// counts derived from it); an error about one names its runtime key and says it was overridden.
struct RuntimeOverrides {
  std::optional<std::int64_t> max_tokens;
  std::optional<std::int64_t> max_sequences;
  std::optional<planner::PlanMode> workspace_plan;
  std::optional<DType> state_dtype;  // kF32 or kBF16
};

struct ModelSpecOptions {
  // Unknown keys in linear_attn_config / runtime (and top-level near-misses of engine keys) are
  // errors instead of warnings.
  bool strict = false;
  RuntimeOverrides runtime;
};

// Reads and validates a model description (YAML or JSON), or a Hugging Face model folder: its
// config.json is the description, the folder its weights and its name. Throws kda::Error.
ModelSpec load_model_spec(const std::string& path, const ModelSpecOptions& options = {});

// Parses YAML or JSON text. `source_name` prefixes error messages ("file:line:col: ..."); relative
// `weights` paths are resolved against `base_dir` (empty: left as written).
ModelSpec parse_model_spec(const std::string& text, const std::string& source_name,
                           const std::string& base_dir = {}, const ModelSpecOptions& options = {});

}  // namespace kda::engine
