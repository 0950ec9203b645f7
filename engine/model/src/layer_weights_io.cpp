// engine/model/src/layer_weights_io.cpp — a whole KDA layer's weights in checkpoints: reading them
// by their Hugging Face names, and writing them as safetensors tensors.
#include "kda/engine/layer_weights_io.hpp"

#include <cmath>
#include <cstring>

#include "kda/engine/checkpoint.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"

namespace kda::engine {

namespace {

using Shape = std::vector<std::int64_t>;
using layer::Config;
using layer::Weights;

[[noreturn]] void invalid(const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, message);
}

std::size_t to_size(std::int64_t n) { return static_cast<std::size_t>(n); }

// kda::validate_gate_parameters, naming the file and the A_log tensor (the values are finite
// already: the loaders refuse non-finite tensors by name).
void check_gate_parameters(const std::string& path, const std::string& a_log_name,
                           const std::vector<float>& A_log, const std::vector<float>& dt_bias,
                           std::int64_t head_dim) {
  const Status st = validate_gate_parameters(A_log.data(), dt_bias.data(),
                                             static_cast<std::int64_t>(A_log.size()), head_dim);
  if (!st.ok()) invalid(path + ": tensor '" + a_log_name + "': " + st.message());
}

// Looks a layer's tensors up by checkpoint name, with the layer prefix first, then bare.
class LayerTensors {
 public:
  LayerTensors(const Checkpoint& checkpoint, int layer_index)
      : checkpoint_(checkpoint),
        prefix_(layer_index < 0 ? std::string() : layer_tensor_prefix(layer_index)) {}

  // The name under which `name` is stored; empty when absent.
  std::string stored_name(const std::string& name) const {
    if (!prefix_.empty() && checkpoint_.find(prefix_ + name) != nullptr) return prefix_ + name;
    if (checkpoint_.find(name) != nullptr) return name;
    return {};
  }

  bool has(const std::string& name) const { return !stored_name(name).empty(); }

  // Reads `name`, checking that its shape is one of `shapes` and its dtype one of `dtypes`.
  Tensor read(const std::string& name, const std::vector<Shape>& shapes,
              const std::vector<DType>& dtypes) const {
    const std::string stored = stored_name(name);
    if (stored.empty()) {
      invalid(checkpoint_.path() + ": no tensor '" + prefix_ + name + "'" +
              (prefix_.empty() ? std::string() : " (nor '" + name + "')") +
              ", a weight of the KDA layer");
    }
    const TensorInfo* info = checkpoint_.find(stored);
    bool dtype_ok = false;
    std::string dtype_names;
    for (DType dtype : dtypes) {
      dtype_ok = dtype_ok || info->dtype == dtype;
      dtype_names += std::string(dtype_names.empty() ? "" : " or ") + safetensors_dtype_name(dtype);
    }
    if (!dtype_ok) {
      invalid(checkpoint_.path() + ": tensor '" + stored + "' has dtype " +
              safetensors_dtype_name(info->dtype) + ", expected " + dtype_names);
    }
    bool shape_ok = false;
    std::string shape_names;
    for (const Shape& shape : shapes) {
      shape_ok = shape_ok || info->shape == shape;
      shape_names += (shape_names.empty() ? "" : " or ") + shape_to_string(shape);
    }
    if (!shape_ok) {
      invalid(checkpoint_.path() + ": tensor '" + stored + "' has shape " +
              shape_to_string(info->shape) + ", expected " + shape_names);
    }
    return checkpoint_.read(stored);
  }

  // A BF16 tensor of exactly `shape`, as raw bf16 bits.
  std::vector<bf16_bits> bf16(const std::string& name, const Shape& shape) const {
    const Tensor t = read(name, {shape}, {DType::kBF16});
    std::vector<bf16_bits> values(to_size(t.numel()));
    std::memcpy(values.data(), t.data.data(), values.size() * sizeof(bf16_bits));
    return values;
  }

  // An F32 or BF16 tensor of one of `shapes`, widened to float, every value finite.
  std::vector<float> floats(const std::string& name, const std::vector<Shape>& shapes) const {
    const Tensor t = read(name, shapes, {DType::kF32, DType::kBF16});
    std::vector<float> values(to_size(t.numel()));
    if (t.dtype == DType::kF32) {
      std::memcpy(values.data(), t.data.data(), values.size() * sizeof(float));
    } else {
      const auto* bits = t.data_as<bf16_bits>();
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
    }
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        invalid(checkpoint_.path() + ": tensor '" + t.name +
                "' holds a non-finite value at element " + std::to_string(i));
      }
    }
    return values;
  }

 private:
  const Checkpoint& checkpoint_;
  std::string prefix_;
};

template <typename T>
Tensor make_tensor(const std::string& name, DType dtype, Shape shape,
                   const std::vector<T>& values) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  std::memcpy(t.data.data(), values.data(), values.size() * sizeof(T));
  return t;
}

// A parameter tensor as fp32, whatever its stored float dtype.
std::vector<float> to_float(const SafetensorsFile& file, const Tensor& tensor) {
  std::vector<float> values(static_cast<std::size_t>(tensor.numel()));
  if (tensor.dtype == DType::kF32) {
    std::memcpy(values.data(), tensor.data.data(), values.size() * sizeof(float));
  } else if (tensor.dtype == DType::kBF16) {
    const auto* bits = tensor.data_as<bf16_bits>();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
  } else {
    throw Error(StatusCode::kInvalidArgument,
                file.path() + ": tensor '" + tensor.name + "' has dtype " +
                    safetensors_dtype_name(tensor.dtype) + ", expected F32 or BF16");
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      throw Error(StatusCode::kInvalidArgument, file.path() + ": tensor '" + tensor.name +
                                                    "' holds a non-finite value at element " +
                                                    std::to_string(i));
    }
  }
  return values;
}

// The output gate's matrices: g_proj [C, E] when the config selects the full-rank gate, else the
// low-rank pair. A checkpoint holding both forms is refused whichever the config selects: which one
// its model runs cannot be told from the tensors.
void load_output_gate(const Checkpoint& checkpoint, const LayerTensors& tensors, int layer_index,
                      const Config& config, Weights* full) {
  const std::int64_t E = config.hidden_size, D = config.head_dim, C = config.num_heads * D;
  const std::string full_rank = tensors.stored_name("g_proj.weight");
  std::string low_rank;
  for (const char* name : {"g_a_proj.weight", "g_b_proj.weight"}) {
    const std::string stored = tensors.stored_name(name);
    if (!stored.empty()) low_rank += (low_rank.empty() ? "'" : ", '") + stored + "'";
  }
  if (!full_rank.empty() && !low_rank.empty()) {
    invalid(checkpoint.path() + ": both output gate forms present: '" + full_rank +
            "' (full rank) and " + low_rank + " (low rank)");
  }
  const std::string prefix = layer_index < 0 ? std::string() : layer_tensor_prefix(layer_index);
  auto missing = [&](const char* name, const char* form, const std::string& other) {
    invalid(checkpoint.path() + ": no tensor '" + prefix + name + "'" +
            (prefix.empty() ? std::string() : std::string(" (nor '") + name + "')") + ", the " +
            form + " output gate the config selects; the checkpoint holds " + other);
  };
  if (!config.full_rank_gate) {
    if (!full_rank.empty()) {
      missing("g_a_proj.weight", "low-rank", "the full-rank '" + full_rank + "'");
    }
    full->g_a_proj = tensors.bf16("g_a_proj.weight", {D, E});
    full->g_b_proj = tensors.bf16("g_b_proj.weight", {C, D});
    return;
  }
  if (full_rank.empty()) {
    missing("g_proj.weight", "full-rank (full_rank_gate)",
            low_rank.empty() ? std::string("neither form") : "the low-rank " + low_rank);
  }
  full->g_proj = tensors.bf16("g_proj.weight", {C, E});
}

bool shape_is(const std::vector<std::int64_t>& shape, std::initializer_list<std::int64_t> dims) {
  return shape == std::vector<std::int64_t>(dims);
}

}  // namespace

std::string a_log_tensor_name(int layer_index) {
  return "model.layers." + std::to_string(layer_index) + ".self_attn.A_log";
}
std::string dt_bias_tensor_name(int layer_index) {
  return "model.layers." + std::to_string(layer_index) + ".self_attn.dt_bias";
}

layer::GateParameters load_gate_parameters(const SafetensorsFile& file, int layer_index,
                                           std::int64_t num_heads, std::int64_t head_dim) {
  const std::string a_name = a_log_tensor_name(layer_index);
  const std::string dt_name = dt_bias_tensor_name(layer_index);
  for (const std::string& name : {a_name, dt_name}) {
    if (file.find(name) == nullptr) {
      throw Error(StatusCode::kInvalidArgument,
                  file.path() + ": no tensor '" + name + "' (parameters of layer " +
                      std::to_string(layer_index + 1) + ", numbered as in the YAML's kda_layers)");
    }
  }
  const Tensor a_log = file.read(a_name);
  if (!shape_is(a_log.shape, {num_heads}) && !shape_is(a_log.shape, {1, 1, num_heads, 1})) {
    throw Error(StatusCode::kInvalidArgument, file.path() + ": tensor '" + a_name + "' has shape " +
                                                  shape_to_string(a_log.shape) + ", expected [" +
                                                  std::to_string(num_heads) + "] or [1, 1, " +
                                                  std::to_string(num_heads) + ", 1]");
  }
  const Tensor dt_bias = file.read(dt_name);
  if (!shape_is(dt_bias.shape, {num_heads * head_dim}) &&
      !shape_is(dt_bias.shape, {num_heads, head_dim})) {
    throw Error(StatusCode::kInvalidArgument,
                file.path() + ": tensor '" + dt_name + "' has shape " +
                    shape_to_string(dt_bias.shape) + ", expected [" +
                    std::to_string(num_heads * head_dim) + "] or [" + std::to_string(num_heads) +
                    ", " + std::to_string(head_dim) + "]");
  }
  layer::GateParameters parameters;
  parameters.A_log = to_float(file, a_log);
  parameters.dt_bias = to_float(file, dt_bias);
  check_gate_parameters(file.path(), a_log.name, parameters.A_log, parameters.dt_bias, head_dim);
  return parameters;
}

std::string layer_tensor_prefix(int layer_index) {
  return "model.layers." + std::to_string(layer_index) + ".self_attn.";
}

Weights load_layer_weights(const Checkpoint& checkpoint, int layer_index, const Config& config) {
  layer::validate(config);
  const std::int64_t E = config.hidden_size, H = config.num_heads, D = config.head_dim;
  const std::int64_t W = config.conv_width, C = H * D;
  const LayerTensors tensors(checkpoint, layer_index);

  Weights full;
  full.config = config;
  full.config.tp_size = 1;
  full.config.tp_rank = 0;
  full.q_proj = tensors.bf16("q_proj.weight", {C, E});
  full.k_proj = tensors.bf16("k_proj.weight", {C, E});
  full.v_proj = tensors.bf16("v_proj.weight", {C, E});
  full.q_conv = tensors.floats("q_conv1d.weight", {{C, 1, W}, {C, W}});
  full.k_conv = tensors.floats("k_conv1d.weight", {{C, 1, W}, {C, W}});
  full.v_conv = tensors.floats("v_conv1d.weight", {{C, 1, W}, {C, W}});
  full.f_a_proj = tensors.bf16("f_a_proj.weight", {D, E});
  full.f_b_proj = tensors.bf16("f_b_proj.weight", {C, D});
  full.b_proj = tensors.bf16("b_proj.weight", {H, E});
  load_output_gate(checkpoint, tensors, layer_index, config, &full);
  if (tensors.has("g_b_proj.bias")) full.g_b_bias = tensors.bf16("g_b_proj.bias", {C});
  full.A_log = tensors.floats("A_log", {{1, 1, H, 1}, {H}});
  full.dt_bias = tensors.floats("dt_bias", {{C}, {H, D}});
  full.o_norm = tensors.bf16("o_norm.weight", {D});
  full.o_proj = tensors.bf16("o_proj.weight", {E, C});
  check_gate_parameters(checkpoint.path(), tensors.stored_name("A_log"), full.A_log, full.dt_bias,
                        D);
  full.origin = checkpoint.path();
  if (config.tp_size == 1) return full;
  return layer::shard_weights(full, config.tp_size, config.tp_rank);
}

std::vector<Tensor> layer_weight_tensors(const Weights& w, const std::string& prefix) {
  layer::check_sizes(w);
  if (w.config.tp_size != 1) {
    invalid("layer_weight_tensors: weights of tp rank " + std::to_string(w.config.tp_rank) +
            " of " + std::to_string(w.config.tp_size) + " are a shard, not a checkpoint layer");
  }
  const std::int64_t E = w.config.hidden_size, H = w.config.num_heads, D = w.config.head_dim;
  const std::int64_t W = w.config.conv_width, C = H * D;
  std::vector<Tensor> out;
  out.push_back(make_tensor(prefix + "q_proj.weight", DType::kBF16, {C, E}, w.q_proj));
  out.push_back(make_tensor(prefix + "k_proj.weight", DType::kBF16, {C, E}, w.k_proj));
  out.push_back(make_tensor(prefix + "v_proj.weight", DType::kBF16, {C, E}, w.v_proj));
  out.push_back(make_tensor(prefix + "q_conv1d.weight", DType::kF32, {C, 1, W}, w.q_conv));
  out.push_back(make_tensor(prefix + "k_conv1d.weight", DType::kF32, {C, 1, W}, w.k_conv));
  out.push_back(make_tensor(prefix + "v_conv1d.weight", DType::kF32, {C, 1, W}, w.v_conv));
  out.push_back(make_tensor(prefix + "f_a_proj.weight", DType::kBF16, {D, E}, w.f_a_proj));
  out.push_back(make_tensor(prefix + "f_b_proj.weight", DType::kBF16, {C, D}, w.f_b_proj));
  out.push_back(make_tensor(prefix + "b_proj.weight", DType::kBF16, {H, E}, w.b_proj));
  if (w.config.full_rank_gate) {
    out.push_back(make_tensor(prefix + "g_proj.weight", DType::kBF16, {C, E}, w.g_proj));
  } else {
    out.push_back(make_tensor(prefix + "g_a_proj.weight", DType::kBF16, {D, E}, w.g_a_proj));
    out.push_back(make_tensor(prefix + "g_b_proj.weight", DType::kBF16, {C, D}, w.g_b_proj));
  }
  if (!w.g_b_bias.empty()) {
    out.push_back(make_tensor(prefix + "g_b_proj.bias", DType::kBF16, {C}, w.g_b_bias));
  }
  out.push_back(make_tensor(prefix + "A_log", DType::kF32, {1, 1, H, 1}, w.A_log));
  out.push_back(make_tensor(prefix + "dt_bias", DType::kF32, {C}, w.dt_bias));
  out.push_back(make_tensor(prefix + "o_norm.weight", DType::kBF16, {D}, w.o_norm));
  out.push_back(make_tensor(prefix + "o_proj.weight", DType::kBF16, {E, C}, w.o_proj));
  return out;
}

}  // namespace kda::engine
