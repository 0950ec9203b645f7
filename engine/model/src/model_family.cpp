// engine/model/src/model_family.cpp — the family table (docs/MODEL.md lists the sources each row
// was read from) and its look-ups.
#include "kda/engine/model_family.hpp"

#include <algorithm>

namespace kda::engine {

namespace {

// Moonshot's configs keep the sizes in linear_attn_config; transformers' KimiLinearConfig and
// Glm5NextTextConfig write them at the top level (linear_num_heads, ...) and, like this table, let
// a linear_attn_config dict win where both are given. Each list is looked up in order, the first
// key present wins: for GLM's KDA layers that is layer_types, before the dict's kda_layers.
const std::vector<std::string> kHeads = {"linear_attn_config.num_heads", "linear_num_heads"};
const std::vector<std::string> kHeadDim = {"linear_attn_config.head_dim", "linear_head_dim"};
const std::vector<std::string> kConv = {"linear_attn_config.short_conv_kernel_size",
                                        "linear_conv_kernel_dim"};
const std::vector<std::string> kKimiLayers = {"linear_attn_config.kda_layers", "layer_types"};
const std::vector<std::string> kFullAttnLayers = {"linear_attn_config.full_attn_layers"};

// A family of Moonshot's config layout, whose output gate may be full rank.
ModelFamily moonshot_family(const char* name, const char* key, const char* model_type,
                            const char* architecture, std::vector<std::string> prefixes,
                            GateRule gate) {
  return {name,
          key,
          {model_type},
          {architecture},
          std::move(prefixes),
          kHeads,
          kHeadDim,
          kConv,
          kKimiLayers,
          kFullAttnLayers,
          false,
          gate,
          {"linear_attn_config.gate_lower_bound"},
          "",
          "linear_attn_config.use_full_rank_gate"};
}

std::vector<ModelFamily> make_table() {
  std::vector<ModelFamily> table;
  table.push_back(moonshot_family("Kimi-Linear", "kimi-linear", "kimi_linear",
                                  "KimiLinearForCausalLM", {kDefaultTensorPrefix},
                                  GateRule::kSoftplusUnlessSaid));
  // vLLM's Kimi K3 loader maps language_model.layers. onto language_model.model.layers.: both.
  table.push_back(moonshot_family(
      "Kimi K3", "kimi-k3", "kimi_k3", "KimiK3ForConditionalGeneration",
      {"language_model.model.layers.{i}.self_attn.", "language_model.layers.{i}.self_attn."},
      GateRule::kBoundedWhenGiven));
  // transformers' Glm5NextTextConfig: the sizes at the top level of text_config or in an older
  // linear_attn_config dict (num_heads, head_dim, short_conv_kernel_size, lower_bound, safe_gate),
  // the KDA layers in layer_types; a text-only checkpoint (Glm5NextForCausalLM) has no
  // language_model level.
  table.push_back({"GLM-5.3-Flash",
                   "glm-5.3-flash",
                   {"glm5_next", "glm5_next_text"},
                   {"Glm5NextForConditionalGeneration", "Glm5NextForCausalLM"},
                   {"model.language_model.layers.{i}.self_attn.", kDefaultTensorPrefix},
                   kHeads,
                   kHeadDim,
                   kConv,
                   {"layer_types", "linear_attn_config.kda_layers"},
                   kFullAttnLayers,
                   true,
                   GateRule::kBoundedByDefault,
                   {"linear_attn_config.lower_bound", "linear_lower_bound",
                    "linear_attn_config.gate_lower_bound"},
                   "linear_attn_config.safe_gate",
                   ""});
  return table;
}

template <typename Member>
const ModelFamily* find(const std::string& value, Member member) {
  for (const ModelFamily& family : model_families()) {
    const std::vector<std::string>& values = family.*member;
    if (std::find(values.begin(), values.end(), value) != values.end()) return &family;
  }
  return nullptr;
}

template <typename Member>
std::string list_text(Member member) {
  std::string text;
  for (const ModelFamily& family : model_families()) {
    for (const std::string& value : family.*member) text += (text.empty() ? "" : ", ") + value;
  }
  return text;
}

}  // namespace

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> table = make_table();
  return table;
}

const ModelFamily* family_by_key(const std::string& key) {
  for (const ModelFamily& family : model_families()) {
    if (key == family.key) return &family;
  }
  return nullptr;
}

const ModelFamily* family_by_model_type(const std::string& model_type) {
  return find(model_type, &ModelFamily::model_types);
}

const ModelFamily* family_by_architecture(const std::string& architecture) {
  return find(architecture, &ModelFamily::architectures);
}

std::string family_keys_text() {
  std::string text;
  for (const ModelFamily& family : model_families()) {
    text += (text.empty() ? "" : ", ") + std::string(family.key);
  }
  return text;
}

std::string family_model_types_text() { return list_text(&ModelFamily::model_types); }
std::string family_architectures_text() { return list_text(&ModelFamily::architectures); }

std::string prefix_holding(const std::vector<std::string>& tensor_names,
                           const std::vector<std::string>& patterns, int layer_index,
                           const std::string& tensor) {
  for (const std::string& pattern : patterns) {
    if (std::binary_search(tensor_names.begin(), tensor_names.end(),
                           expand_tensor_prefix(pattern, layer_index) + tensor)) {
      return pattern;
    }
  }
  return {};
}

std::vector<const ModelFamily*> families_holding(const std::vector<std::string>& tensor_names,
                                                 int layer_index, const std::string& tensor) {
  // First prefixes first: a family's later prefix may be another family's first (GLM's text-only
  // checkpoints use Kimi-Linear's), and then the names say the family whose own layout it is.
  for (const bool first_only : {true, false}) {
    std::vector<const ModelFamily*> found;
    for (const ModelFamily& family : model_families()) {
      const std::vector<std::string> patterns =
          first_only ? std::vector<std::string>{family.tensor_prefixes.front()}
                     : std::vector<std::string>(family.tensor_prefixes.begin() + 1,
                                                family.tensor_prefixes.end());
      if (!prefix_holding(tensor_names, patterns, layer_index, tensor).empty()) {
        found.push_back(&family);
      }
    }
    if (!found.empty()) return found;
  }
  return {};
}

std::string expand_tensor_prefix(const std::string& pattern, int layer_index) {
  std::string text = pattern;
  const std::size_t hole = text.find("{i}");
  if (hole != std::string::npos) text.replace(hole, 3, std::to_string(layer_index));
  return text;
}

}  // namespace kda::engine
