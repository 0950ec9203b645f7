// engine/kda_full_layer_weights.cpp — a whole KDA layer's weights: checkpoint names, loading,
// random weights, tensor-parallel shards.
#include "kda/engine/kda_full_layer_weights.hpp"

#include <cmath>
#include <cstring>
#include <random>

#include "kda/engine/checkpoint.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/kda_layer.hpp"
#include "kda/engine/safetensors.hpp"

namespace kda::engine {

namespace {

using Shape = std::vector<std::int64_t>;

[[noreturn]] void invalid(const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, message);
}

std::size_t to_size(std::int64_t n) { return static_cast<std::size_t>(n); }

// Looks a layer's tensors up by checkpoint name, with the layer prefix first, then bare.
class LayerTensors {
 public:
  LayerTensors(const Checkpoint& checkpoint, int layer_index)
      : checkpoint_(checkpoint),
        prefix_(layer_index < 0 ? std::string() : full_layer_tensor_prefix(layer_index)) {}

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

// Rows [begin, begin + count) of a row-major matrix with `cols` columns.
template <typename T>
std::vector<T> rows(const std::vector<T>& matrix, std::int64_t cols, std::int64_t begin,
                    std::int64_t count) {
  if (matrix.empty()) return {};
  return std::vector<T>(matrix.begin() + begin * cols, matrix.begin() + (begin + count) * cols);
}

// Columns [begin, begin + count) of a row-major matrix with `cols` columns.
template <typename T>
std::vector<T> columns(const std::vector<T>& matrix, std::int64_t cols, std::int64_t begin,
                       std::int64_t count) {
  const std::int64_t n_rows = static_cast<std::int64_t>(matrix.size()) / cols;
  std::vector<T> out;
  out.reserve(to_size(n_rows * count));
  for (std::int64_t r = 0; r < n_rows; ++r) {
    out.insert(out.end(), matrix.begin() + r * cols + begin,
               matrix.begin() + r * cols + begin + count);
  }
  return out;
}

template <typename T>
Tensor make_tensor(const std::string& name, DType dtype, Shape shape,
                   const std::vector<T>& values) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  std::memcpy(t.data.data(), values.data(), values.size() * sizeof(T));
  return t;
}

}  // namespace

void validate(const FullLayerConfig& c) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) invalid("KDA layer config: " + what);
  };
  require(c.hidden_size > 0 && c.hidden_size <= (std::int64_t{1} << 20),
          "hidden_size " + std::to_string(c.hidden_size) + " is not in [1, 2^20]");
  require(c.num_heads > 0 && c.num_heads <= 4096,
          "num_heads " + std::to_string(c.num_heads) + " is not in [1, 4096]");
  require(c.head_dim > 0 && c.head_dim <= 1024,
          "head_dim " + std::to_string(c.head_dim) + " is not in [1, 1024]");
  require(c.conv_width >= 1 && c.conv_width <= 16,
          "conv_width " + std::to_string(c.conv_width) + " is not in [1, 16]");
  require(c.gate != GateMode::kLowerBound ||
              (std::isfinite(c.lower_bound) && c.lower_bound >= -5.0f && c.lower_bound < 0.0f),
          "lower_bound " + std::to_string(c.lower_bound) + " is not in [-5, 0)");
  require(std::isfinite(c.norm_eps) && c.norm_eps > 0.0f,
          "norm_eps " + std::to_string(c.norm_eps) + " is not finite and > 0");
  require(c.tp_size >= 1 && c.num_heads % c.tp_size == 0, "tp_size " + std::to_string(c.tp_size) +
                                                              " does not divide num_heads " +
                                                              std::to_string(c.num_heads));
  require(c.tp_rank >= 0 && c.tp_rank < c.tp_size, "tp_rank " + std::to_string(c.tp_rank) +
                                                       " is not in [0, tp_size " +
                                                       std::to_string(c.tp_size) + ")");
}

void check_sizes(const FullLayerWeights& w) {
  const FullLayerConfig& c = w.config;
  validate(c);
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Cl = c.local_channels(), Hl = c.local_heads();
  auto require = [](std::size_t size, std::int64_t expected, const char* name) {
    if (size != to_size(expected)) {
      invalid(std::string("KDA layer weights: ") + name + " holds " + std::to_string(size) +
              " values, expected " + std::to_string(expected));
    }
  };
  require(w.q_proj.size(), Cl * E, "q_proj");
  require(w.k_proj.size(), Cl * E, "k_proj");
  require(w.v_proj.size(), Cl * E, "v_proj");
  require(w.q_conv.size(), Cl * W, "q_conv");
  require(w.k_conv.size(), Cl * W, "k_conv");
  require(w.v_conv.size(), Cl * W, "v_conv");
  require(w.f_a_proj.size(), D * E, "f_a_proj");
  require(w.f_b_proj.size(), Cl * D, "f_b_proj");
  require(w.b_proj.size(), Hl * E, "b_proj");
  require(w.g_a_proj.size(), D * E, "g_a_proj");
  require(w.g_b_proj.size(), Cl * D, "g_b_proj");
  if (!w.g_b_bias.empty()) require(w.g_b_bias.size(), Cl, "g_b_bias");
  require(w.A_log.size(), Hl, "A_log");
  require(w.dt_bias.size(), Cl, "dt_bias");
  require(w.o_norm.size(), D, "o_norm");
  require(w.o_proj.size(), E * Cl, "o_proj");
}

std::string full_layer_tensor_prefix(int layer_index) {
  return "model.layers." + std::to_string(layer_index) + ".self_attn.";
}

FullLayerWeights load_full_layer_weights(const Checkpoint& checkpoint, int layer_index,
                                         const FullLayerConfig& config) {
  validate(config);
  const std::int64_t E = config.hidden_size, H = config.num_heads, D = config.head_dim;
  const std::int64_t W = config.conv_width, C = H * D;
  const LayerTensors tensors(checkpoint, layer_index);

  FullLayerWeights full;
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
  full.g_a_proj = tensors.bf16("g_a_proj.weight", {D, E});
  full.g_b_proj = tensors.bf16("g_b_proj.weight", {C, D});
  if (tensors.has("g_b_proj.bias")) full.g_b_bias = tensors.bf16("g_b_proj.bias", {C});
  full.A_log = tensors.floats("A_log", {{1, 1, H, 1}, {H}});
  full.dt_bias = tensors.floats("dt_bias", {{C}, {H, D}});
  full.o_norm = tensors.bf16("o_norm.weight", {D});
  full.o_proj = tensors.bf16("o_proj.weight", {E, C});
  for (std::size_t h = 0; h < full.A_log.size(); ++h) {
    if (std::fabs(full.A_log[h]) > kMaxAbsALog) {
      invalid(checkpoint.path() + ": tensor '" + tensors.stored_name("A_log") + "' value " +
              std::to_string(full.A_log[h]) + " at element " + std::to_string(h) +
              " is outside [-20, 20] (kda::kMaxAbsALog)");
    }
  }
  full.origin = checkpoint.path();
  if (config.tp_size == 1) return full;
  return shard_full_layer_weights(full, config.tp_size, config.tp_rank);
}

FullLayerWeights random_full_layer_weights(const FullLayerConfig& config, std::uint64_t seed,
                                           int layer_index) {
  validate(config);
  const std::int64_t E = config.hidden_size, H = config.num_heads, D = config.head_dim;
  const std::int64_t W = config.conv_width, C = H * D;
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(layer_index), 0x6c61796eu};
  std::mt19937_64 generator(seq);
  auto uniform_bf16 = [&](std::int64_t count, std::int64_t fan_in) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    std::vector<bf16_bits> values(to_size(count));
    for (bf16_bits& v : values) v = float_to_bf16(bound * dist(generator));
    return values;
  };
  auto uniform_conv = [&](std::int64_t count) {  // bf16-representable, as in a bf16 checkpoint
    std::vector<float> values(to_size(count));
    const std::vector<bf16_bits> bits = uniform_bf16(count, W);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
    return values;
  };

  FullLayerWeights full;
  full.config = config;
  full.config.tp_size = 1;
  full.config.tp_rank = 0;
  full.q_proj = uniform_bf16(C * E, E);
  full.k_proj = uniform_bf16(C * E, E);
  full.v_proj = uniform_bf16(C * E, E);
  full.q_conv = uniform_conv(C * W);
  full.k_conv = uniform_conv(C * W);
  full.v_conv = uniform_conv(C * W);
  full.f_a_proj = uniform_bf16(D * E, E);
  full.f_b_proj = uniform_bf16(C * D, D);
  full.b_proj = uniform_bf16(H * E, E);
  full.g_a_proj = uniform_bf16(D * E, E);
  full.g_b_proj = uniform_bf16(C * D, D);
  full.o_norm.assign(to_size(D), float_to_bf16(1.0f));
  full.o_proj = uniform_bf16(E * C, C);
  KdaParameters gate = random_kda_parameters(seed, layer_index, H, D);
  full.A_log = std::move(gate.A_log);
  full.dt_bias = std::move(gate.dt_bias);
  full.origin = "random (seed " + std::to_string(seed) + ")";
  if (config.tp_size == 1) return full;
  return shard_full_layer_weights(full, config.tp_size, config.tp_rank);
}

FullLayerWeights shard_full_layer_weights(const FullLayerWeights& full, int tp_size, int tp_rank) {
  check_sizes(full);
  if (full.config.tp_size != 1)
    invalid("shard_full_layer_weights: the weights are already a shard");
  FullLayerWeights shard;
  shard.config = full.config;
  shard.config.tp_size = tp_size;
  shard.config.tp_rank = tp_rank;
  validate(shard.config);
  const std::int64_t E = full.config.hidden_size, D = full.config.head_dim;
  const std::int64_t W = full.config.conv_width;
  const std::int64_t Hl = shard.config.local_heads(), Cl = shard.config.local_channels();
  const std::int64_t h0 = tp_rank * Hl, c0 = tp_rank * Cl;  // first head / channel of the shard

  shard.q_proj = rows(full.q_proj, E, c0, Cl);
  shard.k_proj = rows(full.k_proj, E, c0, Cl);
  shard.v_proj = rows(full.v_proj, E, c0, Cl);
  shard.q_conv = rows(full.q_conv, W, c0, Cl);
  shard.k_conv = rows(full.k_conv, W, c0, Cl);
  shard.v_conv = rows(full.v_conv, W, c0, Cl);
  shard.f_a_proj = full.f_a_proj;  // replicated: every rank needs the whole low-rank factor
  shard.f_b_proj = rows(full.f_b_proj, D, c0, Cl);
  shard.b_proj = rows(full.b_proj, E, h0, Hl);
  shard.g_a_proj = full.g_a_proj;
  shard.g_b_proj = rows(full.g_b_proj, D, c0, Cl);
  shard.g_b_bias = rows(full.g_b_bias, 1, c0, Cl);
  shard.A_log = rows(full.A_log, 1, h0, Hl);
  shard.dt_bias = rows(full.dt_bias, 1, c0, Cl);
  shard.o_norm = full.o_norm;
  shard.o_proj = columns(full.o_proj, Cl * tp_size, c0, Cl);
  shard.origin =
      full.origin + " (tp rank " + std::to_string(tp_rank) + " of " + std::to_string(tp_size) + ")";
  return shard;
}

std::vector<Tensor> full_layer_weight_tensors(const FullLayerWeights& w,
                                              const std::string& prefix) {
  check_sizes(w);
  if (w.config.tp_size != 1) {
    invalid("full_layer_weight_tensors: weights of tp rank " + std::to_string(w.config.tp_rank) +
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
  out.push_back(make_tensor(prefix + "g_a_proj.weight", DType::kBF16, {D, E}, w.g_a_proj));
  out.push_back(make_tensor(prefix + "g_b_proj.weight", DType::kBF16, {C, D}, w.g_b_proj));
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
