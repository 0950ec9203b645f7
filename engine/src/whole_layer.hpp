// engine/src/whole_layer.hpp — internal: the whole-layer side of one KDA layer of an Engine
// (runtime.layers: whole). The KdaLayer next to it keeps the core's parameters, the recurrent state
// pool and the workspace; this adds the layer's weights (a FullLayerCpu or FullLayerCuda, chosen by
// the backend) and its three conv state pools, and runs the layer on hidden states.
//
// Buffers it declares to the planner (i the 1-based model layer, as KdaLayer's):
//   layer{i}.conv_q, layer{i}.conv_k, layer{i}.conv_v   state, persistent: bf16
//       [max_sequences, local_heads * head_dim, W - 1], one row per slot
//   layer{i}.weights   parameter, persistent: the layer's weight image, FullLayerCuda's
//       (FullLayerCuda::weight_image_bytes, bf16 GEMM operands) on CUDA, FullLayerCpu's
//       (FullLayerCpu::weight_image_bytes, every tensor widened to fp32) on the CPU.
// and the size its forward needs from the KdaLayer's workspace (whole_workspace_bytes): every
// intermediate of the layer (projections, conv outputs, gates, core output) and the core's own
// workspace, live while the layer runs only, so the `reuse` plan lays every layer's over the same
// bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kda/engine/kda_full_layer.hpp"
#include "kda/engine/kda_full_layer_cuda.hpp"
#include "kda/engine/kda_full_layer_weights.hpp"
#include "kda/engine/kda_layer.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/planner/memory_plan.hpp"

namespace kda::engine {

class EngineBackend;

// The FullLayerConfig of every KDA layer of `spec` (this engine's tensor-parallel shard).
FullLayerConfig whole_layer_config(const ModelSpec& spec);

// Workspace bytes of one whole layer of `spec` on `backend`: the larger of a max_tokens prefill in
// max_sequences sequences and a decode step of 16 tokens for every slot.
std::uint64_t whole_workspace_bytes(const ModelSpec& spec, Backend backend);

class WholeLayer {
 public:
  // The layer of `spec` at model layer `layer_index` (0-based), the `ordinal`-th KDA layer, run on
  // `backend` (which decides what declare_buffers() plans for the weights).
  WholeLayer(const ModelSpec& spec, int ordinal, int layer_index, Backend backend);
  ~WholeLayer();
  WholeLayer(const WholeLayer&) = delete;
  WholeLayer& operator=(const WholeLayer&) = delete;

  const FullLayerConfig& config() const noexcept { return config_; }
  void declare_buffers(planner::MemoryPlanner& planner);

  // Builds the layer's implementation from `weights`, which the caller may drop afterwards: it
  // writes their image (FullLayerCuda's or FullLayerCpu's) into its `layer{i}.weights` buffer of
  // `arena`, laid out by `plan` (the plan of the planner declare_buffers() last added to).
  // Throws kda::Error.
  void set_weights(const FullLayerWeights& weights, std::uint8_t* arena,
                   const planner::MemoryPlan& plan);
  // Bytes of the weights: their planned arena buffer.
  std::uint64_t weight_bytes() const noexcept { return weight_bytes_; }

  // Points the layer at its conv pools in `arena` (laid out by `plan`), and at `core`'s recurrent
  // pool and workspace.
  void bind(std::uint8_t* arena, const planner::MemoryPlan& plan, const KdaLayer& core);

  void* conv_pool(int which) const noexcept { return conv_pool_[which]; }  // 0 q, 1 k, 2 v
  std::uint64_t conv_pool_bytes() const noexcept { return conv_pool_bytes_; }

  // Prefill: `slots_host` / `cu_host` are host arrays (the CPU reads them), `slots_device` /
  // `cu_device` the same in the arena (CUDA reads them). Throws kda::Error.
  struct Call {
    std::int64_t tokens = 0, sequences = 0;
    std::int64_t decode_tokens = 0;  // 0: prefill; 1..16: decode, every sequence that many tokens
    const std::int64_t* cu_host = nullptr;
    const std::int64_t* cu_device = nullptr;
    const std::int32_t* slots_host = nullptr;  // decode: negative = padding row
    const std::int32_t* slots_device = nullptr;
    std::uint32_t* device_status = nullptr;
    const void* hidden = nullptr;
    void* out = nullptr;
    void* stream = nullptr;
    PrefillSchedule schedule = PrefillSchedule::kAuto;  // CUDA prefill
    int cpu_threads = 0;
    FullLayerTimes* times = nullptr;  // CUDA: timing synchronizes the stream
  };
  void forward(const Call& call) const;

 private:
  struct CudaTimer;
  FullLayerConfig config_;
  std::int64_t max_sequences_;
  DType state_dtype_;
  Backend backend_;
  int model_layer_ = 0;
  std::string label_;
  std::string conv_names_[3];
  std::string weights_name_;
  planner::BufferHandle conv_buffers_[3];
  planner::BufferHandle weights_buffer_;
  std::unique_ptr<FullLayerCpu> cpu_;
  std::unique_ptr<FullLayerCuda> cuda_;
  std::unique_ptr<CudaTimer> timer_;
  std::uint64_t weight_bytes_ = 0;
  void* conv_pool_[3] = {nullptr, nullptr, nullptr};
  std::uint64_t conv_pool_bytes_ = 0;
  void* recurrent_ = nullptr;
  void* workspace_ = nullptr;
  std::uint64_t workspace_bytes_ = 0;
};

}  // namespace kda::engine
