// kda/engine/model_family.hpp — the model families the engine recognises, in one table: how each is
// recognised, where its config keeps the KDA layers' sizes and gate, and under which names its
// checkpoint stores a KDA layer's tensors. Every family maps onto the one layer description
// (ModelSpec, kda::layer::Config); nothing past the model description knows families.
//
//   Kimi-Linear    model_type kimi_linear, architectures KimiLinearForCausalLM
//                  tensors model.layers.{i}.self_attn.*
//   Kimi K3        model_type kimi_k3, architectures KimiK3ForConditionalGeneration
//                  tensors language_model.model.layers.{i}.self_attn.* (or language_model.layers.)
//   GLM-5.3-Flash  model_type glm5_next or glm5_next_text, architectures
//                  Glm5NextForConditionalGeneration or Glm5NextForCausalLM
//                  tensors model.language_model.layers.{i}.self_attn.* (text only: model.layers.)
//
// {i} is the 0-based model layer. A description that names no family (no model_type, architectures
// or `family:`) is the engine's own schema; its checkpoint's tensor names then say the layout.
#pragma once

#include <string>
#include <vector>

namespace kda::engine {

// The tensor prefix of a description that says nothing else: Kimi-Linear's.
inline constexpr const char* kDefaultTensorPrefix = "model.layers.{i}.self_attn.";

// How a family's config chooses the gate when it has no `gate:` key (the engine's own key, which
// every family accepts and which wins).
enum class GateRule : int {
  // Softplus (the released Kimi-Linear's gate); a bound without `gate:` is refused as ambiguous,
  // since Kimi-Linear's loaders ignore it.
  kSoftplusUnlessSaid,
  // A bound key present: the bounded gate with that bound; absent: softplus (vLLM's Kimi K3 layer).
  kBoundedWhenGiven,
  // The first bound key present: that bound; null there, softplus unless a true safe-gate key
  // makes it -5; no bound key: -5. As transformers' Glm5NextTextConfig reads its config.
  kBoundedByDefault,
};

struct ModelFamily {
  const char* name;                        // "Kimi K3": messages, kda-run's model line
  const char* key;                         // "kimi-k3": the description's `family:` value
  std::vector<std::string> model_types;    // top-level model_type values (or text_config's)
  std::vector<std::string> architectures;  // top-level architectures entries
  // Tensor prefixes with {i}: the first, unless the checkpoint's names use a later one (a
  // text-only checkpoint of a multimodal family, an older wrapper's names).
  std::vector<std::string> tensor_prefixes;
  // Where the text config (text_config when present, else the top level) keeps each value: key
  // paths ('.' between map keys), the first present wins.
  std::vector<std::string> num_heads, head_dim, conv_kernel;
  // 1-based layer lists, or a `layer_types` list of per-layer strings ("linear_attention" and
  // "kda_attention" are KDA layers, any other string a full-attention layer).
  std::vector<std::string> kda_layers;
  std::vector<std::string> full_attn_layers;
  // Without any of kda_layers: every layer but each fourth (0-based i % 4 == 3) is a KDA layer, as
  // transformers' Glm5NextTextConfig defaults; false: the layer list is required.
  bool every_fourth_full_attention;
  GateRule gate;
  std::vector<std::string> gate_bound;  // bound keys, first present wins
  std::string safe_gate;                // a boolean key meaning "bound -5" (empty: none)
  std::string full_rank_gate;           // a boolean key: g_proj instead of g_a/g_b (empty: none)
};

// The table, in the order above.
const std::vector<ModelFamily>& model_families();

// By `family:` key, model_type, or architectures entry; nullptr when none matches.
const ModelFamily* family_by_key(const std::string& key);
const ModelFamily* family_by_model_type(const std::string& model_type);
const ModelFamily* family_by_architecture(const std::string& architecture);

// "kimi-linear, kimi-k3, glm-5.3-flash", "kimi_linear, kimi_k3, glm5_next, glm5_next_text", ...:
// what was looked for, for messages.
std::string family_keys_text();
std::string family_model_types_text();
std::string family_architectures_text();

// The first of `patterns` under which `tensor_names` (sorted) hold `tensor` (a name within a
// layer: "A_log") of layer `layer_index`; empty when none does.
std::string prefix_holding(const std::vector<std::string>& tensor_names,
                           const std::vector<std::string>& patterns, int layer_index,
                           const std::string& tensor);

// The families whose first tensor prefix holds `tensor` of layer `layer_index` in
// `tensor_names` (sorted), in table order: what a checkpoint's names say of its family; when no
// first prefix holds it, the families whose other prefixes do.
std::vector<const ModelFamily*> families_holding(const std::vector<std::string>& tensor_names,
                                                 int layer_index, const std::string& tensor);

// `pattern` with its {i} replaced by `layer_index`.
std::string expand_tensor_prefix(const std::string& pattern, int layer_index);

}  // namespace kda::engine
