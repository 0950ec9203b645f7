// engine/src/whole_layer.cpp — one whole KDA layer inside an Engine: weights, conv state pools,
// and the forward on the backend's implementation (FullLayerCpu or FullLayerCuda).
#include "whole_layer.hpp"

#include <algorithm>
#include <chrono>

#include "kda/engine/error.hpp"
#include "kda/nvtx.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kda::engine {

namespace {
constexpr std::int64_t kMaxDecodeTokens = 16;
const char* const kConvNames[3] = {"conv_q", "conv_k", "conv_v"};
}  // namespace

FullLayerConfig whole_layer_config(const ModelSpec& spec) {
  FullLayerConfig c;
  c.hidden_size = spec.hidden_size;
  c.num_heads = spec.num_heads;
  c.head_dim = spec.head_dim;
  c.conv_width = spec.short_conv_kernel_size;
  c.gate = spec.gate;
  c.lower_bound = spec.gate_lower_bound;
  c.norm_eps = spec.rms_norm_eps;
  c.tp_size = spec.runtime.tp_size;
  c.tp_rank = spec.runtime.tp_rank;
  return c;
}

std::uint64_t whole_workspace_bytes(const ModelSpec& spec, Backend backend) {
  const FullLayerConfig c = whole_layer_config(spec);
  const std::int64_t seqs = spec.runtime.max_sequences;
  auto bytes = [&](std::int64_t tokens) {
    return backend == Backend::kCuda ? FullLayerCuda::workspace_bytes(c, tokens, seqs, seqs)
                                     : FullLayerCpu::workspace_bytes(c, tokens, seqs, seqs);
  };
  return std::max(bytes(spec.runtime.max_tokens), bytes(seqs * kMaxDecodeTokens));
}

// Six events at the phase boundaries of a CUDA forward (FullLayerCudaEvents), created once.
struct WholeLayer::CudaTimer {
  FullLayerCudaEvents events;
#ifdef KDA_HAVE_CUDA
  CudaTimer() {
    for (void*& event : events.boundary) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreate(&e) != cudaSuccess) {
        throw Error(StatusCode::kCudaError, "KDA layer: cannot create its timing events");
      }
      event = e;
    }
  }
  ~CudaTimer() {
    for (void* event : events.boundary) {
      if (event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
    }
  }
  // Seconds between boundaries, added to `times` (waits for the last event).
  void add(FullLayerTimes* times) const {
    if (cudaEventSynchronize(static_cast<cudaEvent_t>(events.boundary[5])) != cudaSuccess) {
      throw Error(StatusCode::kCudaError, "KDA layer: waiting for its timing events");
    }
    double* phases[5] = {&times->projections, &times->conv, &times->core, &times->norm,
                         &times->o_proj};
    for (int i = 0; i < 5; ++i) {
      float ms = 0.0f;
      (void)cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events.boundary[i]),
                                 static_cast<cudaEvent_t>(events.boundary[i + 1]));
      *phases[i] += ms * 1e-3;
    }
  }
#else
  void add(FullLayerTimes*) const {}
#endif
};

WholeLayer::WholeLayer(const ModelSpec& spec, int ordinal, int layer_index, Backend backend)
    : config_(whole_layer_config(spec)),
      max_sequences_(spec.runtime.max_sequences),
      state_dtype_(spec.runtime.state_dtype),
      backend_(backend) {
  validate(config_);
  model_layer_ = layer_index + 1;
  const std::string model_layer = std::to_string(model_layer_);
  label_ = "layer " + model_layer + " (KDA index " + std::to_string(ordinal) + ")";
  for (int i = 0; i < 3; ++i) conv_names_[i] = "layer" + model_layer + "." + kConvNames[i];
  weights_name_ = "layer" + model_layer + ".weights";
  conv_pool_bytes_ = static_cast<std::uint64_t>(max_sequences_) * spec.conv_state_slot_bytes();
}

WholeLayer::~WholeLayer() = default;

void WholeLayer::declare_buffers(planner::MemoryPlanner& planner) {
  planner::BufferRequest request;
  request.kind = planner::BufferKind::kState;
  request.persistent = true;
  request.bytes = conv_pool_bytes_;
  request.layer = model_layer_;  // 1-based, as in the YAML
  for (int i = 0; i < 3; ++i) {
    request.name = conv_names_[i];
    conv_buffers_[i] = planner.add(request);
  }
  request.name = weights_name_;
  request.kind = planner::BufferKind::kParameter;
  // The layer checks the region's alignment (FullLayerCuda / FullLayerCpu::kWeightImageAlignment).
  if (backend_ == Backend::kCuda) {
    request.bytes = FullLayerCuda::weight_image_bytes(config_);
    request.alignment = FullLayerCuda::kWeightImageAlignment;
  } else {
    request.bytes = FullLayerCpu::weight_image_bytes(config_);
    request.alignment = FullLayerCpu::kWeightImageAlignment;
  }
  weights_buffer_ = planner.add(request);
}

void WholeLayer::set_weights(const FullLayerWeights& weights, std::uint8_t* arena,
                             const planner::MemoryPlan& plan) {
  try {
    const planner::PlanEntry* entry = plan.entry(weights_buffer_);
    if (entry == nullptr) {
      throw Error(StatusCode::kInternal, weights_name_ + " is missing from the memory plan");
    }
    void* region = arena + entry->offset;
    const auto bytes = static_cast<std::size_t>(entry->bytes);
    if (backend_ == Backend::kCuda) {
      cuda_ = std::make_unique<FullLayerCuda>(weights, region, bytes);
      timer_ = std::make_unique<CudaTimer>();
    } else {
      cpu_ = std::make_unique<FullLayerCpu>(weights, region, bytes);
    }
    weight_bytes_ = entry->bytes;
  } catch (const Error& e) {
    throw Error(e.code(), label_ + ": " + e.what() + " (weights from " + weights.origin + ")");
  }
}

void WholeLayer::bind(std::uint8_t* arena, const planner::MemoryPlan& plan, const KdaLayer& core) {
  for (int i = 0; i < 3; ++i) {
    const planner::PlanEntry* entry = plan.entry(conv_buffers_[i]);
    if (entry == nullptr) {
      throw Error(StatusCode::kInternal,
                  label_ + ": conv state pools missing from the memory plan");
    }
    conv_pool_[i] = arena + entry->offset;
  }
  recurrent_ = core.state_pool();
  workspace_ = core.workspace();
  workspace_bytes_ = core.workspace_bytes();
}

void WholeLayer::forward(const Call& call) const {
  FullLayerState state;
  state.num_slots = max_sequences_;
  state.conv_q = static_cast<bf16_bits*>(conv_pool_[0]);
  state.conv_k = static_cast<bf16_bits*>(conv_pool_[1]);
  state.conv_v = static_cast<bf16_bits*>(conv_pool_[2]);
  state.recurrent = recurrent_;
  state.recurrent_dtype = state_dtype_;
  const Workspace workspace{workspace_, static_cast<std::size_t>(workspace_bytes_)};
  const auto* hidden = static_cast<const bf16_bits*>(call.hidden);
  auto* out = static_cast<bf16_bits*>(call.out);
  const char* what = call.decode_tokens > 0 ? " decode" : " prefill";
  try {
    if (cuda_) {
      FullLayerCudaBatch batch;
      batch.tokens = call.tokens;
      batch.sequences = call.sequences;
      batch.decode_tokens = call.decode_tokens;
      batch.cu_seqlens = call.decode_tokens > 0 ? nullptr : call.cu_device;
      batch.slots = call.slots_device;
      batch.cu_seqlens_host = call.decode_tokens > 0 ? nullptr : call.cu_host;
      batch.slots_host = call.slots_host;
      batch.device_status = call.device_status;
      CudaOptions unchecked;
      unchecked.check_pointers = false;  // the engine checked its caller's pointers
      unchecked.schedule = call.schedule;
      cuda_->forward(batch, hidden, out, state, workspace, call.stream, unchecked,
                     call.times != nullptr ? &timer_->events : nullptr);
      if (call.times != nullptr) timer_->add(call.times);
      return;
    }
    if (!cpu_) throw Error(StatusCode::kInternal, "no weights");
    CpuOptions cpu;
    cpu.num_threads = call.cpu_threads;
    if (call.decode_tokens == 0) {
      FullLayerBatch batch{call.tokens, call.sequences, call.cu_host, call.slots_host};
      cpu_->forward(batch, hidden, out, state, workspace, cpu, call.times);
      return;
    }
    // Decode: the CPU layer has no padding rows, so each run of real rows is one forward (its
    // cu_seqlens a prefix of 0, t, 2t, ...; the caller's call.cu_host holds that).
    const std::int64_t t = call.decode_tokens, E = config_.hidden_size;
    std::int64_t row = 0;
    while (row < call.sequences) {
      if (call.slots_host[row] < 0) {
        ++row;
        continue;
      }
      std::int64_t end = row;
      while (end < call.sequences && call.slots_host[end] >= 0) ++end;
      FullLayerBatch batch{(end - row) * t, end - row, call.cu_host, call.slots_host + row};
      cpu_->forward(batch, hidden + row * t * E, out + row * t * E, state, workspace, cpu,
                    call.times);
      row = end;
    }
  } catch (const Error& e) {
    throw Error(e.code(), label_ + what + ": " + e.what());
  }
}

}  // namespace kda::engine
