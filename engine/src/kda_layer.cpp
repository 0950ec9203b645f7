// engine/kda_layer.cpp — parameters, buffer declarations and the forward of one KDA layer.
#include "kda/engine/kda_layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "backend.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"

namespace kda::engine {

namespace {

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

KdaParameters load_kda_parameters(const SafetensorsFile& file, int layer_index,
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
  KdaParameters parameters;
  parameters.A_log = to_float(file, a_log);
  parameters.dt_bias = to_float(file, dt_bias);
  for (std::size_t h = 0; h < parameters.A_log.size(); ++h) {
    if (std::fabs(parameters.A_log[h]) > kMaxAbsALog) {
      throw Error(StatusCode::kInvalidArgument,
                  file.path() + ": tensor '" + a_log.name + "' value " +
                      std::to_string(parameters.A_log[h]) + " at element " + std::to_string(h) +
                      " is outside [-" + std::to_string(static_cast<int>(kMaxAbsALog)) + ", " +
                      std::to_string(static_cast<int>(kMaxAbsALog)) + "] (kda::kMaxAbsALog)");
    }
  }
  parameters.origin = file.path();
  return parameters;
}

KdaParameters random_kda_parameters(std::uint64_t seed, int layer_index, std::int64_t num_heads,
                                    std::int64_t head_dim) {
  // Distinct, reproducible streams per (seed, layer).
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(layer_index), 0x6b6461u};
  std::mt19937_64 generator(seq);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  KdaParameters parameters;
  parameters.A_log.resize(static_cast<std::size_t>(num_heads));
  parameters.dt_bias.resize(static_cast<std::size_t>(num_heads * head_dim));
  for (float& a : parameters.A_log) a = static_cast<float>(std::log(1.0 + 15.0 * unit(generator)));
  const double log_lo = std::log(1e-3), log_hi = std::log(1e-1);
  for (float& bias : parameters.dt_bias) {
    const double dt = std::exp(log_lo + (log_hi - log_lo) * unit(generator));
    bias = static_cast<float>(dt + std::log(-std::expm1(-dt)));  // softplus^-1(dt)
  }
  parameters.origin = "random (seed " + std::to_string(seed) + ")";
  return parameters;
}

KdaLayer::KdaLayer(const ModelSpec& spec, int ordinal, int layer_index, KdaParameters parameters)
    : ordinal_(ordinal),
      layer_index_(layer_index),
      num_heads_(spec.num_heads),
      head_dim_(spec.head_dim),
      max_tokens_(spec.runtime.max_tokens),
      max_sequences_(spec.runtime.max_sequences),
      state_dtype_(spec.runtime.state_dtype),
      gate_(spec.gate),
      lower_bound_(spec.gate_lower_bound),
      parameters_(std::move(parameters)) {
  // Users see the model layer 1-based, as the YAML's kda_layers lists it (the checkpoint's
  // model.layers.{i} is 0-based), plus the position among the KDA layers that Engine::prefill /
  // decode take: "layer 4 (KDA index 2)". Buffer and NVTX names use the same model layer number.
  const std::string model_layer = std::to_string(layer_index + 1);
  label_ = "layer " + model_layer + " (KDA index " + std::to_string(ordinal) + ")";
  const std::string prefix = "layer" + model_layer;
  if (parameters_.A_log.size() != static_cast<std::size_t>(num_heads_) ||
      parameters_.dt_bias.size() != static_cast<std::size_t>(num_heads_ * head_dim_)) {
    throw Error(StatusCode::kInvalidArgument,
                label_ + ": parameters have " + std::to_string(parameters_.A_log.size()) +
                    " A_log and " + std::to_string(parameters_.dt_bias.size()) +
                    " dt_bias values, expected " + std::to_string(num_heads_) + " and " +
                    std::to_string(num_heads_ * head_dim_));
  }
  // The operator's parameter contract (kda.hpp), here too, so that parameters built in code (not
  // loaded from a file) fail at construction on every backend: CUDA would only report them through
  // the device status word.
  for (std::size_t h = 0; h < parameters_.A_log.size(); ++h) {
    const float a = parameters_.A_log[h];
    if (!std::isfinite(a) || std::fabs(a) > kMaxAbsALog) {
      throw Error(StatusCode::kInvalidArgument,
                  label_ + ": A_log[" + std::to_string(h) + "] = " + std::to_string(a) +
                      " is not finite or outside [-" +
                      std::to_string(static_cast<int>(kMaxAbsALog)) + ", " +
                      std::to_string(static_cast<int>(kMaxAbsALog)) + "] (parameters from " +
                      parameters_.origin + ")");
    }
  }
  for (std::size_t i = 0; i < parameters_.dt_bias.size(); ++i) {
    if (!std::isfinite(parameters_.dt_bias[i])) {
      throw Error(StatusCode::kInvalidArgument, label_ + ": dt_bias[" + std::to_string(i) +
                                                    "] is not finite (parameters from " +
                                                    parameters_.origin + ")");
    }
  }
  nvtx_name_ = "kda.layer" + model_layer;
  a_log_name_ = prefix + ".A_log";
  dt_bias_name_ = prefix + ".dt_bias";
  state_name_ = prefix + ".state";
  workspace_name_ = prefix + ".workspace";
}

Problem KdaLayer::prefill_problem(std::int64_t tokens, std::int64_t sequences) const noexcept {
  Problem p;
  p.batch = 1;
  p.seq_len = tokens;
  p.num_heads = num_heads_;
  p.head_dim_k = head_dim_;
  p.head_dim_v = head_dim_;
  p.num_seqs = sequences;
  p.cu_seqlens_dtype = DType::kI64;
  p.gate = gate_;
  p.lower_bound = lower_bound_;
  p.initial_state_dtype = state_dtype_;
  p.final_state_dtype = state_dtype_;
  p.num_state_slots = max_sequences_;  // states through slot indices into the layer's pool
  return p;
}

DecodeProblem KdaLayer::decode_problem(std::int64_t batch, std::int64_t tokens) const noexcept {
  DecodeProblem p;
  p.batch = batch;
  p.tokens = tokens;
  p.num_heads = num_heads_;
  p.head_dim_k = head_dim_;
  p.head_dim_v = head_dim_;
  p.num_slots = max_sequences_;
  p.state_dtype = state_dtype_;
  p.gate = gate_;
  p.lower_bound = lower_bound_;
  return p;
}

void KdaLayer::declare_buffers(planner::MemoryPlanner& planner, Backend backend,
                               std::uint64_t min_workspace_bytes) {
  const auto H = static_cast<std::uint64_t>(num_heads_);
  const auto K = static_cast<std::uint64_t>(head_dim_);
  planner::BufferRequest request;
  request.layer = layer_index_ + 1;  // the model layer, 1-based as in the YAML
  request.persistent = true;

  request.name = a_log_name_;
  request.kind = planner::BufferKind::kParameter;
  request.bytes = H * sizeof(float);
  a_log_buffer_ = planner.add(request);

  request.name = dt_bias_name_;
  request.bytes = H * K * sizeof(float);
  dt_bias_buffer_ = planner.add(request);

  // The spec loader checked that this product fits in 64 bits.
  request.name = state_name_;
  request.kind = planner::BufferKind::kState;
  request.bytes = static_cast<std::uint64_t>(max_sequences_) * H * K * K * dtype_size(state_dtype_);
  state_buffer_ = planner.add(request);

  // One workspace serves the layer's prefill and its decode (never at the same time): the larger.
  std::size_t workspace = 0, decode_workspace = 0;
  Status st = workspace_size(prefill_problem(max_tokens_, max_sequences_), backend, &workspace);
  if (!st.ok()) throw Error(st, label_ + ": workspace size on " + to_string(backend));
  // 16: the most tokens a decode step takes.
  st = decode_workspace_size(decode_problem(max_sequences_, 16), backend, &decode_workspace);
  if (!st.ok()) throw Error(st, label_ + ": decode workspace size on " + to_string(backend));
  workspace =
      std::max({workspace, decode_workspace, static_cast<std::size_t>(min_workspace_bytes)});
  workspace_buffer_ = planner::BufferHandle{};
  if (workspace > 0) {
    request.name = workspace_name_;
    request.kind = planner::BufferKind::kWorkspace;
    request.bytes = workspace;
    request.persistent = false;
    request.first_step = ordinal_;
    request.last_step = ordinal_;
    workspace_buffer_ = planner.add(request);
  }
}

void KdaLayer::bind(std::uint8_t* arena, const planner::MemoryPlan& plan, EngineBackend& backend) {
  auto locate = [&](planner::BufferHandle handle, std::uint64_t* bytes) -> std::uint8_t* {
    const planner::PlanEntry* entry = plan.entry(handle);
    if (entry == nullptr) return nullptr;
    if (bytes != nullptr) *bytes = entry->bytes;
    return arena + entry->offset;
  };
  A_log_ = reinterpret_cast<float*>(locate(a_log_buffer_, nullptr));
  dt_bias_ = reinterpret_cast<float*>(locate(dt_bias_buffer_, nullptr));
  state_pool_ = locate(state_buffer_, &state_pool_bytes_);
  workspace_bytes_ = 0;
  workspace_ = locate(workspace_buffer_, &workspace_bytes_);
  if (A_log_ == nullptr || dt_bias_ == nullptr || state_pool_ == nullptr) {
    throw Error(StatusCode::kInternal, label_ + ": buffers missing from the memory plan");
  }
  backend.copy_to_device(A_log_, parameters_.A_log.data(),
                         parameters_.A_log.size() * sizeof(float));
  backend.copy_to_device(dt_bias_, parameters_.dt_bias.data(),
                         parameters_.dt_bias.size() * sizeof(float));
  backend_ = &backend;
}

void KdaLayer::forward(const Problem& p, Tensors t, const CudaOptions& cuda) const {
  if (backend_ == nullptr) throw Error(StatusCode::kInternal, label_ + " prefill: not bound");
  t.A_log = A_log_;
  t.dt_bias = dt_bias_;
  const Status st = backend_->prefill(
      p, t, Workspace{workspace_, static_cast<std::size_t>(workspace_bytes_)}, cuda);
  if (!st.ok()) throw Error(st, label_ + " prefill");
}

void KdaLayer::decode(const DecodeProblem& p, DecodeTensors t, const CudaOptions& cuda) const {
  if (backend_ == nullptr) throw Error(StatusCode::kInternal, label_ + " decode: not bound");
  t.A_log = A_log_;
  t.dt_bias = dt_bias_;
  t.state_pool = state_pool_;
  const Status st = backend_->decode(
      p, t, Workspace{workspace_, static_cast<std::size_t>(workspace_bytes_)}, cuda);
  if (!st.ok()) throw Error(st, label_ + " decode");
}

}  // namespace kda::engine
