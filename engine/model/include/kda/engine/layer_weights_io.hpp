// kda/engine/layer_weights_io.hpp — a whole KDA layer's weights (kda/layer/weights.hpp) in
// checkpoints, by their Hugging Face Kimi-Linear names.
//
// Names, dtypes (as Kimi-Linear's checkpoints store them) and shapes, each optionally prefixed by
// the model's tensor prefix with {i} the 0-based model layer (ModelSpec::tensor_prefix;
// Kimi-Linear's, the default, is "model.layers.{i}.self_attn.", model_family.hpp has the others):
//   q_proj.weight, k_proj.weight, v_proj.weight   BF16 [C, E]
//   q_conv1d.weight, k_conv1d.weight, v_conv1d.weight  BF16 or F32 [C, 1, W] (or [C, W])
//   f_a_proj.weight BF16 [D, E]     f_b_proj.weight BF16 [C, D]      (forget gate, low rank)
//   b_proj.weight   BF16 [H, E]                                      (beta)
//   g_a_proj.weight BF16 [D, E]     g_b_proj.weight BF16 [C, D]      (output gate, low rank)
//   or g_proj.weight BF16 [C, E]    with config.full_rank_gate (Kimi K3; then no g_a/g_b_proj)
//   g_b_proj.bias   BF16 [C]        optional, either gate form (fla's KimiDeltaAttention has it;
//                                   Kimi-Linear and K3 not)
//   A_log   F32 or BF16 [1, 1, H, 1] (or [H])     dt_bias F32 or BF16 [C] (or [H, D])
//   o_norm.weight   BF16 [D]        o_proj.weight BF16 [E, C]
//
// Any tensor may be F32, F16 or BF16 whatever the dtype above: it is converted once, when read, to
// what the layer holds. A BF16 entry (a matrix, o_norm, the bias) is held as bf16, rounded to
// nearest even (exact from BF16; a value that is not finite once rounded is refused); the conv
// weights, A_log and dt_bias are held as fp32 (exact from each). Another dtype (an integer, F8,
// ...) is refused naming the tensor and the file that holds it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/engine/model_family.hpp"
#include "kda/layer/weights.hpp"

namespace kda::engine {

class Checkpoint;
class SafetensorsFile;
struct Tensor;

// Tensor names of a layer's gate parameters (0-based model layer), and the two read alone: what a
// core-only engine needs of a checkpoint. A_log [H] or [1, 1, H, 1], dt_bias [H * D] or [H, D],
// each F32, F16 or BF16. Throws kda::Error naming the file and the tensor.
std::string a_log_tensor_name(int layer_index,
                              const std::string& tensor_prefix = kDefaultTensorPrefix);
std::string dt_bias_tensor_name(int layer_index,
                                const std::string& tensor_prefix = kDefaultTensorPrefix);
layer::GateParameters load_gate_parameters(const Checkpoint& checkpoint, int layer_index,
                                           std::int64_t num_heads, std::int64_t head_dim,
                                           const std::string& tensor_prefix = kDefaultTensorPrefix);
layer::GateParameters load_gate_parameters(const SafetensorsFile& file, int layer_index,
                                           std::int64_t num_heads, std::int64_t head_dim,
                                           const std::string& tensor_prefix = kDefaultTensorPrefix);

// `tensor_prefix` with {i} the 0-based model layer: "model.layers.{i}.self_attn." by default.
std::string layer_tensor_prefix(int layer_index,
                                const std::string& tensor_prefix = kDefaultTensorPrefix);

// Reads layer `layer_index`'s weights (0-based model layer) from `checkpoint` and keeps config's
// shard of them. Each tensor is looked up as layer_tensor_prefix(layer_index, tensor_prefix) +
// name, then as the bare name (a layer case file); layer_index < 0 looks up bare names only.
// Throws kda::Error naming the tensor (and the file) when one is missing (saying where the
// checkpoint keeps it when that is under another prefix), has another shape than the table
// above or a dtype that is not a float one, or (A_log, dt_bias) holds a value the operator
// refuses.
// Also refused: a checkpoint holding both output gate forms (g_proj and g_a_proj / g_b_proj),
// naming them.
layer::Weights load_layer_weights(const Checkpoint& checkpoint, int layer_index,
                                  const layer::Config& config,
                                  const std::string& tensor_prefix = kDefaultTensorPrefix);

// The weights as safetensors tensors named `prefix` + checkpoint name, in the checkpoint's shapes
// and dtypes (conv weights, A_log and dt_bias as F32, so nothing is rounded). Only for whole
// layers (tp_size 1): a shard has no checkpoint shapes. Throws kda::Error otherwise.
std::vector<Tensor> layer_weight_tensors(const layer::Weights& weights,
                                         const std::string& prefix = {});

}  // namespace kda::engine
