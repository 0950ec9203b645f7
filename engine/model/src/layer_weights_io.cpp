// engine/model/src/layer_weights_io.cpp — a whole KDA layer's weights in checkpoints: reading them
// by their Hugging Face names, and writing them as safetensors tensors.
#include "kda/engine/layer_weights_io.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "kda/engine/checkpoint.hpp"
#include "kda/engine/model_family.hpp"
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

// The dtypes a weight may be stored in: each is widened to fp32 exactly.
const std::vector<DType> kFloatDTypes = {DType::kF32, DType::kF16, DType::kBF16};

// IEEE binary16 to fp32 (exact: every F16 value is a float).
float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  const std::uint32_t bits = exponent == 0x1fu ? sign | 0x7f800000u | (mantissa << 13)
                                               : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Every value of an F32, F16 or BF16 tensor as fp32.
std::vector<float> widen(const Tensor& t) {
  std::vector<float> values(to_size(t.numel()));
  if (t.dtype == DType::kF32) {
    std::memcpy(values.data(), t.data.data(), values.size() * sizeof(float));
  } else if (t.dtype == DType::kF16) {
    const auto* bits = t.data_as<std::uint16_t>();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = f16_to_float(bits[i]);
  } else {
    const auto* bits = t.data_as<bf16_bits>();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
  }
  return values;
}

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string text;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    text += std::string(i == 0                   ? ""
                        : i + 1 == dtypes.size() ? " or "
                                                 : ", ") +
            safetensors_dtype_name(dtypes[i]);
  }
  return text;
}

// Refuses a tensor whose dtype is not a float one, naming the file that holds it.
void check_float_dtype(const std::string& path, const TensorInfo& info) {
  if (std::find(kFloatDTypes.begin(), kFloatDTypes.end(), info.dtype) == kFloatDTypes.end()) {
    invalid(path + ": tensor '" + info.name + "' has dtype " + info.dtype_text +
            ", expected a float dtype (" + dtype_list(kFloatDTypes) + ")");
  }
}

void check_finite(const std::string& path, const std::string& name,
                  const std::vector<float>& values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      invalid(path + ": tensor '" + name + "' holds a non-finite value at element " +
              std::to_string(i));
    }
  }
}

// Looks a layer's tensors up by checkpoint name, with the layer prefix first, then bare.
class LayerTensors {
 public:
  LayerTensors(const Checkpoint& checkpoint, int layer_index, const std::string& tensor_prefix)
      : checkpoint_(checkpoint),
        layer_index_(layer_index),
        pattern_(tensor_prefix),
        prefix_(layer_index < 0 ? std::string() : layer_tensor_prefix(layer_index, tensor_prefix)) {
  }

  // The name under which `name` is stored; empty when absent.
  std::string stored_name(const std::string& name) const {
    if (!prefix_.empty() && checkpoint_.find(prefix_ + name) != nullptr) return prefix_ + name;
    if (checkpoint_.find(name) != nullptr) return name;
    return {};
  }

  bool has(const std::string& name) const { return !stored_name(name).empty(); }

  // The file that holds `name` (a shard of an index), or the checkpoint's path when absent.
  std::string holding_file(const std::string& name) const {
    const SafetensorsFile* file = nullptr;
    const std::string stored = stored_name(name);
    if (stored.empty() || checkpoint_.find(stored, &file) == nullptr || file == nullptr) {
      return checkpoint_.path();
    }
    return file->path();
  }

  // Reads `name`, a float tensor whose shape is one of `shapes`; errors name the file holding it.
  Tensor read(const std::string& name, const std::vector<Shape>& shapes) const {
    const std::string stored = stored_name(name);
    if (stored.empty()) {
      invalid(checkpoint_.path() + ": no tensor '" + prefix_ + name + "'" +
              (prefix_.empty() ? std::string() : " (nor '" + name + "')") +
              ", a weight of the KDA layer" + elsewhere(name));
    }
    const SafetensorsFile* file = nullptr;
    const TensorInfo* info = checkpoint_.find(stored, &file);
    check_float_dtype(file->path(), *info);
    bool shape_ok = false;
    std::string shape_names;
    for (const Shape& shape : shapes) {
      shape_ok = shape_ok || info->shape == shape;
      shape_names += (shape_names.empty() ? "" : " or ") + shape_to_string(shape);
    }
    if (!shape_ok) {
      invalid(file->path() + ": tensor '" + stored + "' has shape " + shape_to_string(info->shape) +
              ", expected " + shape_names);
    }
    return file->read(stored);
  }

  // A matrix of exactly `shape` as bf16 bits: BF16 as stored, F32 and F16 rounded to nearest
  // even once, here; a value that is not finite (stored so, or once rounded) is refused.
  std::vector<bf16_bits> bf16(const std::string& name, const Shape& shape) const {
    const Tensor t = read(name, {shape});
    std::vector<bf16_bits> values(to_size(t.numel()));
    std::vector<float> wide;  // F32 and F16: the values as stored, which a message shows
    if (t.dtype == DType::kBF16) {
      std::memcpy(values.data(), t.data.data(), values.size() * sizeof(bf16_bits));
    } else {
      wide = widen(t);
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = float_to_bf16(wide[i]);
    }
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(bf16_to_float(values[i]))) {
        std::ostringstream shown;
        shown << (wide.empty() ? bf16_to_float(values[i]) : wide[i]);
        invalid(holder(t.name) + ": tensor '" + t.name + "' holds " + shown.str() + " at element " +
                std::to_string(i) + ", not a finite bf16 value");
      }
    }
    return values;
  }

  // A vector or conv weight of one of `shapes`, widened to fp32, every value finite.
  std::vector<float> floats(const std::string& name, const std::vector<Shape>& shapes) const {
    const Tensor t = read(name, shapes);
    std::vector<float> values = widen(t);
    check_finite(holder(t.name), t.name, values);
    return values;
  }

 private:
  std::string holder(const std::string& stored) const {
    const SafetensorsFile* file = nullptr;
    checkpoint_.find(stored, &file);
    return file != nullptr ? file->path() : checkpoint_.path();
  }

  // "; the checkpoint has 'X'": the same weight of the same layer under another prefix, a hint
  // that the description's tensor prefix (its family) is not the checkpoint's.
  std::string elsewhere(const std::string& name) const {
    if (layer_index_ < 0) return {};
    const std::string tail = "layers." + std::to_string(layer_index_) + ".self_attn." + name;
    for (const std::string& candidate : checkpoint_.tensor_names()) {
      if (candidate.size() > tail.size() &&
          candidate.compare(candidate.size() - tail.size(), tail.size(), tail) == 0 &&
          candidate[candidate.size() - tail.size() - 1] == '.') {
        return "; the checkpoint has '" + candidate + "': its tensors are not under " + pattern_ +
               " (the family's tensor prefix; `tensor_prefix:` in the description sets another)";
      }
    }
    return {};
  }

  const Checkpoint& checkpoint_;
  int layer_index_;
  std::string pattern_;
  std::string prefix_;

 public:
  // "" for a layer case file's bare names.
  const std::string& prefix() const noexcept { return prefix_; }
};

template <typename T>
Tensor make_tensor(const std::string& name, DType dtype, Shape shape,
                   const std::vector<T>& values) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  std::memcpy(t.data.data(), values.data(), values.size() * sizeof(T));
  return t;
}

// The output gate's matrices: g_proj [C, E] when the config selects the full-rank gate, else the
// low-rank pair. A checkpoint holding both forms is refused whichever the config selects: which one
// its model runs cannot be told from the tensors.
void load_output_gate(const Checkpoint& checkpoint, const LayerTensors& tensors,
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
  const std::string& prefix = tensors.prefix();
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

std::string a_log_tensor_name(int layer_index, const std::string& tensor_prefix) {
  return layer_tensor_prefix(layer_index, tensor_prefix) + "A_log";
}
std::string dt_bias_tensor_name(int layer_index, const std::string& tensor_prefix) {
  return layer_tensor_prefix(layer_index, tensor_prefix) + "dt_bias";
}

layer::GateParameters load_gate_parameters(const Checkpoint& checkpoint, int layer_index,
                                           std::int64_t num_heads, std::int64_t head_dim,
                                           const std::string& tensor_prefix) {
  const std::string a_name = a_log_tensor_name(layer_index, tensor_prefix);
  const std::string dt_name = dt_bias_tensor_name(layer_index, tensor_prefix);
  for (const std::string& name : {a_name, dt_name}) {
    if (checkpoint.find(name) == nullptr) {
      throw Error(StatusCode::kInvalidArgument,
                  checkpoint.path() + ": no tensor '" + name + "' (parameters of layer " +
                      std::to_string(layer_index + 1) + ", numbered as in the YAML's kda_layers)");
    }
  }
  // Each read names the file that holds the tensor (a shard of an index).
  auto read = [&checkpoint](const std::string& name, std::string* path) {
    const SafetensorsFile* file = nullptr;
    const TensorInfo* info = checkpoint.find(name, &file);
    *path = file->path();
    check_float_dtype(*path, *info);
    return file->read(name);
  };
  std::string a_path, dt_path;
  const Tensor a_log = read(a_name, &a_path);
  if (!shape_is(a_log.shape, {num_heads}) && !shape_is(a_log.shape, {1, 1, num_heads, 1})) {
    throw Error(StatusCode::kInvalidArgument, a_path + ": tensor '" + a_name + "' has shape " +
                                                  shape_to_string(a_log.shape) + ", expected [" +
                                                  std::to_string(num_heads) + "] or [1, 1, " +
                                                  std::to_string(num_heads) + ", 1]");
  }
  const Tensor dt_bias = read(dt_name, &dt_path);
  if (!shape_is(dt_bias.shape, {num_heads * head_dim}) &&
      !shape_is(dt_bias.shape, {num_heads, head_dim})) {
    throw Error(StatusCode::kInvalidArgument,
                dt_path + ": tensor '" + dt_name + "' has shape " + shape_to_string(dt_bias.shape) +
                    ", expected [" + std::to_string(num_heads * head_dim) + "] or [" +
                    std::to_string(num_heads) + ", " + std::to_string(head_dim) + "]");
  }
  layer::GateParameters parameters;
  parameters.A_log = widen(a_log);
  check_finite(a_path, a_name, parameters.A_log);
  parameters.dt_bias = widen(dt_bias);
  check_finite(dt_path, dt_name, parameters.dt_bias);
  check_gate_parameters(a_path, a_log.name, parameters.A_log, parameters.dt_bias, head_dim);
  return parameters;
}

layer::GateParameters load_gate_parameters(const SafetensorsFile& file, int layer_index,
                                           std::int64_t num_heads, std::int64_t head_dim,
                                           const std::string& tensor_prefix) {
  return load_gate_parameters(Checkpoint::from_file(file), layer_index, num_heads, head_dim,
                              tensor_prefix);
}

std::string layer_tensor_prefix(int layer_index, const std::string& tensor_prefix) {
  return expand_tensor_prefix(tensor_prefix, layer_index);
}

Weights load_layer_weights(const Checkpoint& checkpoint, int layer_index, const Config& config,
                           const std::string& tensor_prefix) {
  layer::validate(config);
  const std::int64_t E = config.hidden_size, H = config.num_heads, D = config.head_dim;
  const std::int64_t W = config.conv_width, C = H * D;
  const LayerTensors tensors(checkpoint, layer_index, tensor_prefix);

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
  load_output_gate(checkpoint, tensors, config, &full);
  if (tensors.has("g_b_proj.bias")) full.g_b_bias = tensors.bf16("g_b_proj.bias", {C});
  full.A_log = tensors.floats("A_log", {{1, 1, H, 1}, {H}});
  full.dt_bias = tensors.floats("dt_bias", {{C}, {H, D}});
  full.o_norm = tensors.bf16("o_norm.weight", {D});
  full.o_proj = tensors.bf16("o_proj.weight", {E, C});
  check_gate_parameters(tensors.holding_file("A_log"), tensors.stored_name("A_log"), full.A_log,
                        full.dt_bias, D);
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
