// engine/runtime/src/engine_layer.cpp — one KDA layer of an Engine: its buffers, its parameters,
// its forwards through the backend (the core) and through kda::layer (the whole layer).
#include "engine_layer.hpp"

#include <algorithm>

#include "backend.hpp"
#include "kda/error.hpp"
#include "kda/nvtx.hpp"

namespace kda::engine {

layer::Config layer_config(const ModelSpec& spec) {
  layer::Config c;
  c.hidden_size = spec.hidden_size;
  c.num_heads = spec.num_heads;
  c.head_dim = spec.head_dim;
  c.conv_width = spec.short_conv_kernel_size;
  c.gate = spec.gate;
  c.lower_bound = spec.gate_lower_bound;
  c.norm_eps = spec.rms_norm_eps;
  c.full_rank_gate = spec.full_rank_gate;
  c.tp_size = spec.runtime.tp_size;
  c.tp_rank = spec.runtime.tp_rank;
  return c;
}

Problem max_prefill_problem(const ModelSpec& spec) {
  return layer::core_prefill_problem(layer_config(spec), spec.runtime.max_tokens,
                                     spec.runtime.max_sequences, spec.runtime.max_sequences,
                                     spec.runtime.state_dtype);
}

DecodeProblem max_decode_problem(const ModelSpec& spec) {
  return layer::core_decode_problem(layer_config(spec), spec.runtime.max_sequences,
                                    kMaxDecodeTokens, spec.runtime.max_sequences,
                                    spec.runtime.state_dtype);
}

EngineLayer::EngineLayer(const ModelSpec& spec, int kda_index, Backend backend)
    : whole_(spec.runtime.layer_mode == LayerMode::kWhole),
      backend_kind_(backend),
      config_(layer_config(spec)),
      max_tokens_(spec.runtime.max_tokens),
      max_sequences_(spec.runtime.max_sequences),
      state_dtype_(spec.runtime.state_dtype),
      record_rows_(spec.runtime.max_sequences * spec.runtime.max_verify_tokens),
      record_regions_(spec.runtime.record_regions) {
  // Users see the model layer 1-based, as the YAML's kda_layers lists it (the checkpoint's
  // model.layers.{i} is 0-based), plus the position among the KDA layers that Engine::prefill /
  // decode take: "layer 4 (KDA index 2)". Buffer and NVTX names use the same model layer number.
  info_.kda_index = kda_index;
  info_.model_layer = spec.kda_layer_indices[static_cast<std::size_t>(kda_index)] + 1;
  const std::string model_layer = std::to_string(info_.model_layer);
  info_.label = "layer " + model_layer + " (KDA index " + std::to_string(kda_index) + ")";
  nvtx_name_ = "kda.layer" + model_layer;
  if (whole_) layer::validate(config_);
  conv_pool_bytes_ =
      whole_ ? static_cast<std::uint64_t>(max_sequences_) * spec.conv_state_slot_bytes() : 0;
}

EngineLayer::~EngineLayer() = default;

planner::BufferHandle EngineLayer::add(planner::MemoryPlanner& planner, const std::string& suffix,
                                       planner::BufferKind kind, std::uint64_t bytes,
                                       std::uint64_t alignment) {
  planner::BufferRequest request;
  request.name = "layer" + std::to_string(info_.model_layer) + "." + suffix;
  request.kind = kind;
  request.bytes = bytes;
  request.layer = info_.model_layer;
  request.persistent = kind != planner::BufferKind::kWorkspace;
  if (!request.persistent) request.first_step = request.last_step = info_.kda_index;
  if (alignment != 0) request.alignment = alignment;
  return planner.add(request);
}

void EngineLayer::declare_buffers(planner::MemoryPlanner& planner) {
  const auto Hl = static_cast<std::uint64_t>(config_.local_heads());
  const auto D = static_cast<std::uint64_t>(config_.head_dim);
  using planner::BufferKind;
  handles_.A_log = add(planner, "A_log", BufferKind::kParameter, Hl * sizeof(float));
  handles_.dt_bias = add(planner, "dt_bias", BufferKind::kParameter, Hl * D * sizeof(float));
  if (whole_) {
    // The layer checks the region's alignment (kda::layer::weight_image_alignment).
    handles_.weights = add(planner, "weights", BufferKind::kParameter,
                           layer::weight_image_bytes(backend_kind_, config_),
                           layer::weight_image_alignment(backend_kind_));
  }
  // The spec loader checked that this product fits in 64 bits.
  handles_.state =
      add(planner, "state", BufferKind::kState,
          static_cast<std::uint64_t>(max_sequences_) * Hl * D * D * dtype_size(state_dtype_));
  if (whole_) {
    const char* const names[3] = {"conv_q", "conv_k", "conv_v"};
    for (int i = 0; i < 3; ++i) {
      handles_.conv[i] = add(planner, names[i], BufferKind::kState, conv_pool_bytes_);
    }
  }

  if (record_rows_ > 0) {
    // 16-byte aligned, as the CUDA commit reads them (the planner's default alignment is more).
    const auto rows = static_cast<std::uint64_t>(record_rows_) *
                      static_cast<std::uint64_t>(record_regions_);  // the regions back to back
    handles_.records = add(planner, "records", BufferKind::kState, rows * Hl * 3 * D * 4);
    if (whole_) {
      handles_.conv_records =
          add(planner, "conv_records", BufferKind::kState, rows * 3 * Hl * D * 2);
    }
  }

  // One workspace serves the layer's prefill and its decode (never at the same time): the larger.
  std::size_t prefill = 0, decode = 0;
  const Problem max_prefill = prefill_problem(max_tokens_, max_sequences_);
  Status st = workspace_size(max_prefill, backend_kind_, &prefill);
  if (!st.ok()) throw Error(st, info_.label + ": workspace size on " + to_string(backend_kind_));
  st = decode_workspace_size(decode_problem(max_sequences_, kMaxDecodeTokens), backend_kind_,
                             &decode);
  if (!st.ok()) {
    throw Error(st, info_.label + ": decode workspace size on " + to_string(backend_kind_));
  }
  std::size_t workspace = std::max(prefill, decode);
  if (whole_) {
    workspace =
        std::max({workspace,
                  layer::workspace_bytes(backend_kind_, config_, max_tokens_, max_sequences_,
                                         max_sequences_),
                  layer::workspace_bytes(backend_kind_, config_, max_sequences_ * kMaxDecodeTokens,
                                         max_sequences_, max_sequences_)});
  }
  handles_.workspace = workspace > 0 ? add(planner, "workspace", BufferKind::kWorkspace, workspace)
                                     : planner::BufferHandle{};
}

void EngineLayer::bind(std::uint8_t* arena, const planner::MemoryPlan& plan, EngineBackend& backend,
                       bool poison_workspace) {
  auto locate = [&](planner::BufferHandle handle, std::uint64_t* bytes) -> std::uint8_t* {
    const planner::PlanEntry* entry = plan.entry(handle);
    if (entry == nullptr) return nullptr;
    if (bytes != nullptr) *bytes = entry->bytes;
    return arena + entry->offset;
  };
  A_log_ = reinterpret_cast<float*>(locate(handles_.A_log, nullptr));
  dt_bias_ = reinterpret_cast<float*>(locate(handles_.dt_bias, nullptr));
  state_pool_ = locate(handles_.state, &state_pool_bytes_);
  workspace_bytes_ = 0;
  workspace_ = locate(handles_.workspace, &workspace_bytes_);
  records_ = reinterpret_cast<float*>(locate(handles_.records, nullptr));
  conv_records_ = reinterpret_cast<bf16_bits*>(locate(handles_.conv_records, nullptr));
  bool missing =
      A_log_ == nullptr || dt_bias_ == nullptr || state_pool_ == nullptr ||
      (record_rows_ > 0 && (records_ == nullptr || (whole_ && conv_records_ == nullptr)));
  if (whole_) {
    weights_ = locate(handles_.weights, &weights_bytes_);
    for (int i = 0; i < 3; ++i) conv_pool_[i] = locate(handles_.conv[i], nullptr);
    missing = missing || weights_ == nullptr || conv_pool_[0] == nullptr ||
              conv_pool_[1] == nullptr || conv_pool_[2] == nullptr;
  }
  if (missing) throw Error(StatusCode::kInternal, info_.label + ": buffers missing from the plan");
  backend_ = &backend;
  poison_workspace_ = poison_workspace;
}

Workspace EngineLayer::call_workspace() const {
  // A call that read workspace bytes an earlier call left (finite, stale) would pass unnoticed;
  // poisoned, they read as NaN. In stream order, so that a captured call replays the fill too.
  if (poison_workspace_ && workspace_bytes_ > 0) {
    backend_->memset(workspace_, 0xFF, static_cast<std::size_t>(workspace_bytes_));
  }
  return Workspace{workspace_, static_cast<std::size_t>(workspace_bytes_)};
}

void EngineLayer::load(const layer::GateParameters& parameters, const std::string& origin) {
  const std::string from = " (parameters from " + origin + ")";
  const auto Hl = static_cast<std::size_t>(config_.local_heads());
  const auto D = static_cast<std::size_t>(config_.head_dim);
  if (parameters.A_log.size() != Hl || parameters.dt_bias.size() != Hl * D) {
    throw Error(StatusCode::kInvalidArgument,
                info_.label + ": parameters have " + std::to_string(parameters.A_log.size()) +
                    " A_log and " + std::to_string(parameters.dt_bias.size()) +
                    " dt_bias values, expected " + std::to_string(Hl) + " and " +
                    std::to_string(Hl * D) + from);
  }
  // The operator's parameter rule, here, so that parameters fail at load on every backend: CUDA
  // would only report them through the device status word.
  if (const Status st = validate_gate_parameters(parameters.A_log.data(), parameters.dt_bias.data(),
                                                 config_.local_heads(), config_.head_dim);
      !st.ok()) {
    throw Error(st.code(), info_.label + ": " + st.message() + from);
  }
  if (backend_ == nullptr) throw Error(StatusCode::kInternal, info_.label + ": not bound");
  info_.A_log = parameters.A_log;
  info_.dt_bias = parameters.dt_bias;
  info_.origin = origin;
  backend_->copy_to_device(A_log_, info_.A_log.data(), info_.A_log.size() * sizeof(float));
  backend_->copy_to_device(dt_bias_, info_.dt_bias.data(), info_.dt_bias.size() * sizeof(float));
}

void EngineLayer::load(const layer::Weights& weights) {
  if (!whole_) throw Error(StatusCode::kInternal, info_.label + ": a core layer has no weights");
  if (backend_ == nullptr) throw Error(StatusCode::kInternal, info_.label + ": not bound");
  try {
    layer_ = layer::make_layer(backend_kind_, weights, weights_,
                               static_cast<std::size_t>(weights_bytes_));
  } catch (const Error& e) {
    throw Error(e.code(), info_.label + ": " + e.what() + " (weights from " + weights.origin + ")");
  }
  load(layer::GateParameters{weights.A_log, weights.dt_bias}, weights.origin);
}

// States through slot indices into the layer's pool.
Problem EngineLayer::prefill_problem(std::int64_t tokens, std::int64_t sequences) const {
  return layer::core_prefill_problem(config_, tokens, sequences, max_sequences_, state_dtype_);
}

DecodeProblem EngineLayer::decode_problem(std::int64_t batch, std::int64_t tokens) const {
  return layer::core_decode_problem(config_, batch, tokens, max_sequences_, state_dtype_);
}

Tensors EngineLayer::core_prefill_tensors(Tensors t) const {
  if (backend_ == nullptr) throw Error(StatusCode::kInternal, info_.label + " prefill: not bound");
  t.A_log = A_log_;
  t.dt_bias = dt_bias_;
  t.initial_state = state_pool_;
  t.final_state = state_pool_;  // in place
  return t;
}

void EngineLayer::forward_core(const Problem& p, Tensors t, const CudaOptions& cuda) const {
  const Tensors all = core_prefill_tensors(t);  // throws before backend_ is used where unbound
  const Status st = backend_->prefill(p, all, call_workspace(), cuda);
  if (!st.ok()) throw Error(st, info_.label + " prefill");
}

void EngineLayer::check_forward_core(const Problem& p, Tensors t, const CudaOptions& cuda,
                                     const char* what) const {
  const Tensors all = core_prefill_tensors(t);
  const Status st = backend_->check_prefill(p, all, cuda);
  if (!st.ok()) throw Error(st, info_.label + " " + what);
}

void EngineLayer::transition_core(const Problem& p, Tensors t, float* p_t, float* h_t,
                                  Workspace ws) const {
  if (backend_ == nullptr)
    throw Error(StatusCode::kInternal, info_.label + " transition: not bound");
  t.A_log = A_log_;
  t.dt_bias = dt_bias_;
  const Status st = backend_->transition(p, t, p_t, h_t, ws);
  if (!st.ok()) throw Error(st, info_.label + " segment transition");
}

void EngineLayer::decode_core(const DecodeProblem& p, DecodeTensors t,
                              const CudaOptions& cuda) const {
  if (backend_ == nullptr) throw Error(StatusCode::kInternal, info_.label + " decode: not bound");
  t.A_log = A_log_;
  t.dt_bias = dt_bias_;
  t.state_pool = state_pool_;
  const Status st = backend_->decode(p, t, call_workspace(), cuda);
  if (!st.ok()) throw Error(st, info_.label + " decode");
}

float* EngineLayer::records(int region) const noexcept {
  if (records_ == nullptr) return nullptr;
  const auto D = static_cast<std::int64_t>(config_.head_dim);
  return records_ + region * record_rows_ * config_.local_heads() * 3 * D;
}

bf16_bits* EngineLayer::conv_records(int region) const noexcept {
  if (conv_records_ == nullptr) return nullptr;
  return conv_records_ + region * record_rows_ * 3 * config_.local_channels();
}

layer::State EngineLayer::state(int records_region, int fold_region) const noexcept {
  layer::State state;
  state.num_slots = max_sequences_;
  state.conv_q = static_cast<bf16_bits*>(conv_pool_[0]);
  state.conv_k = static_cast<bf16_bits*>(conv_pool_[1]);
  state.conv_v = static_cast<bf16_bits*>(conv_pool_[2]);
  state.recurrent = state_pool_;
  state.recurrent_dtype = state_dtype_;
  state.recurrent_records = records(records_region);
  state.conv_records = conv_records(records_region);
  state.record_rows = record_rows_;
  if (fold_region >= 0) {
    state.fold_recurrent_records = records(fold_region);
    state.fold_conv_records = conv_records(fold_region);
  }
  return state;
}

void EngineLayer::forward(const layer::Batch& batch, const void* hidden, void* out,
                          const layer::RunOptions& options, int records_region,
                          int fold_region) const {
  const char* what = batch.decode_tokens > 0 ? " decode" : " prefill";
  if (!layer_) throw Error(StatusCode::kInternal, info_.label + what + ": no weights loaded");
  const layer::State state = this->state(records_region, fold_region);
  try {
    layer_->forward(batch, static_cast<const bf16_bits*>(hidden), static_cast<bf16_bits*>(out),
                    state, call_workspace(), options);
  } catch (const Error& e) {
    throw Error(e.code(), info_.label + what + ": " + e.what());
  }
}

layer::CoreInputs EngineLayer::core_inputs(const layer::Batch& batch, const void* hidden,
                                           bf16_bits* const conv[3],
                                           const layer::RunOptions& options) const {
  if (!layer_) throw Error(StatusCode::kInternal, info_.label + " core inputs: no weights loaded");
  layer::State state;
  state.num_slots = 1;
  state.conv_q = conv[0];
  state.conv_k = conv[1];
  state.conv_v = conv[2];
  state.recurrent_dtype = state_dtype_;
  try {
    return layer_->core_inputs(batch, static_cast<const bf16_bits*>(hidden), state,
                               call_workspace(), options);
  } catch (const Error& e) {
    throw Error(e.code(), info_.label + " core inputs: " + e.what());
  }
}

}  // namespace kda::engine
