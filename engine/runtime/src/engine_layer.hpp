// engine/runtime/src/engine_layer.hpp — internal: one KDA layer of an Engine, owning every buffer
// it uses.
//
// A layer is the whole KDA layer (runtime.layers: whole; kda/layer/layer.hpp) or its core alone
// (runtime.layers: core), which is the same layer without projection weights and conv states. It
// declares its buffers to the planner once, from the spec's sizes alone; once the arena exists it
// binds them, then load() writes its parameters (and, whole, its weight image) into them. Buffers,
// n the 1-based model layer (as the YAML's kda_layers):
//   layer{n}.A_log, layer{n}.dt_bias   parameter, persistent: f32 [Hl], [Hl * D]
//   layer{n}.weights                   parameter, persistent (whole): the backend's weight image
//                                      (kda::layer::weight_image_bytes)
//   layer{n}.state                     state, persistent: [max_sequences, Hl, D, D] slots
//   layer{n}.conv_q, conv_k, conv_v    state, persistent (whole): bf16 [max_sequences, Hl·D, W-1]
//   layer{n}.records, conv_records     state, persistent, with runtime.max_verify_tokens > 0: the
//                                      records of a record-and-commit verify step, f32
//                                      [max_sequences * max_verify_tokens, Hl, 3 D], and (whole)
//                                      its conv inputs, bf16 [..., 3 Hl·D], runtime.record_regions
//                                      of each back to back; they outlive the step until the
//                                      engine's commit or the fold of a later step
//   layer{n}.workspace                 workspace, live while the layer runs (step = its KDA
//                                      index): the larger of a max_tokens prefill in max_sequences
//                                      sequences and a decode step of kMaxDecodeTokens tokens for
//                                      every slot, of the core or of the whole layer; omitted when
//                                      the backend needs none.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/kda.hpp"
#include "kda/layer/layer.hpp"
#include "kda/planner/memory_plan.hpp"

namespace kda::engine {

class EngineBackend;

// The core's largest problems for `spec` (this rank's heads): what the arena is sized for.
Problem max_prefill_problem(const ModelSpec& spec);
DecodeProblem max_decode_problem(const ModelSpec& spec);

class EngineLayer {
 public:
  // The KDA layer at position `kda_index` among the spec's KDA layers, on `backend` (which decides
  // the weight image's and the workspace's sizes). Sizes only: nothing is read or allocated.
  EngineLayer(const ModelSpec& spec, int kda_index, Backend backend);
  ~EngineLayer();
  EngineLayer(const EngineLayer&) = delete;
  EngineLayer& operator=(const EngineLayer&) = delete;

  const LayerInfo& info() const noexcept { return info_; }
  bool whole() const noexcept { return whole_; }
  // "kda.layer{n}": the NVTX range the engine opens around everything this layer does.
  const std::string& nvtx_name() const noexcept { return nvtx_name_; }

  void declare_buffers(planner::MemoryPlanner& planner);
  // Points the layer at its buffers in `arena`, laid out by `plan` (the plan of the planner
  // declare_buffers() added to) and keeps `backend` for what follows. `poison_workspace`
  // (EngineOptions::poison_arena): every call that runs the layer first fills its workspace with
  // 0xFF bytes in stream order. Throws kda::Error.
  void bind(std::uint8_t* arena, const planner::MemoryPlan& plan, EngineBackend& backend,
            bool poison_workspace = false);
  // Whole layers: builds the layer from `weights` (its weight image into layer{n}.weights, which
  // the caller may drop afterwards); both: copies the gate parameters into layer{n}.A_log and
  // dt_bias. Enqueued in the backend's stream order. Throws kda::Error.
  void load(const layer::Weights& weights);
  void load(const layer::GateParameters& parameters, const std::string& origin);

  void* state_pool() const noexcept { return state_pool_; }
  std::uint64_t state_pool_bytes() const noexcept { return state_pool_bytes_; }
  void* conv_pool(int which) const noexcept { return conv_pool_[which]; }  // 0 q, 1 k, 2 v
  std::uint64_t conv_pool_bytes() const noexcept { return conv_pool_bytes_; }
  std::uint64_t weight_bytes() const noexcept { return layer_ ? layer_->weight_bytes() : 0; }
  // The records regions (null without runtime.max_verify_tokens; `region` in [0,
  // record_regions)) and the row-token pairs each holds.
  float* records(int region = 0) const noexcept;
  bf16_bits* conv_records(int region = 0) const noexcept;
  std::int64_t record_rows() const noexcept { return record_rows_; }
  int record_regions() const noexcept { return record_regions_; }
  // The layer's pools and records as kda::layer::State (whole layers; conv pools null for cores):
  // the records a step writes in `records_region`, and those it folds in `fold_region` (negative:
  // none).
  layer::State state(int records_region = 0, int fold_region = -1) const noexcept;

  // The core's problems for a batch on this layer's pool (states through slot indices).
  Problem prefill_problem(std::int64_t tokens, std::int64_t sequences) const;
  DecodeProblem decode_problem(std::int64_t batch, std::int64_t tokens) const;

  // The core alone on q, k, v, g, beta: `t` needs no parameters, states or workspace (the layer
  // fills them in). In the NVTX phase range "prefill.forward_cpu|cuda". Throws kda::Error.
  void forward_core(const Problem& p, Tensors t, const CudaOptions& cuda) const;
  // forward_core's checks alone (EngineBackend::check_prefill), nothing enqueued. Throws, the
  // message naming the layer and `what` (the engine's call).
  void check_forward_core(const Problem& p, Tensors t, const CudaOptions& cuda,
                          const char* what) const;
  void decode_core(const DecodeProblem& p, DecodeTensors t, const CudaOptions& cuda) const;
  // The segment transition of the core on q, k, v, g, beta (`p` without states): P^T, H^T per
  // head into p_t, h_t (kda.hpp), `ws` the caller's (the engine plans it). Throws.
  void transition_core(const Problem& p, Tensors t, float* p_t, float* h_t, Workspace ws) const;
  // The whole layer on hidden states; `batch` needs no states (the layer's pools; a records step
  // writes records region `records_region`, a fold reads `fold_region`). Throws.
  void forward(const layer::Batch& batch, const void* hidden, void* out,
               const layer::RunOptions& options, int records_region = 0,
               int fold_region = -1) const;
  // Whole layers: the forward of a prefill batch up to the core (layer::Layer::core_inputs), its
  // conv states in the one-row pools `conv` (q, k, v: bf16 [Cl, W-1] each, read and updated; the
  // batch's sequences without slots), the inputs in this layer's workspace. Throws.
  layer::CoreInputs core_inputs(const layer::Batch& batch, const void* hidden,
                                bf16_bits* const conv[3], const layer::RunOptions& options) const;

 private:
  // `t` with the layer's gate parameters and its pool as both states (in place). Throws where the
  // layer is not bound to a backend.
  Tensors core_prefill_tensors(Tensors t) const;
  // The workspace a call runs on: poisoned first where bind() was asked to.
  Workspace call_workspace() const;
  planner::BufferHandle add(planner::MemoryPlanner& planner, const std::string& suffix,
                            planner::BufferKind kind, std::uint64_t bytes,
                            std::uint64_t alignment = 0);

  LayerInfo info_;
  bool whole_;
  Backend backend_kind_;
  layer::Config config_;
  std::int64_t max_tokens_, max_sequences_;
  DType state_dtype_;
  std::string nvtx_name_;
  struct Handles {
    planner::BufferHandle A_log, dt_bias, weights, state, conv[3], workspace, records, conv_records;
  } handles_;

  EngineBackend* backend_ = nullptr;
  std::unique_ptr<layer::Layer> layer_;  // whole layers, once loaded
  float* A_log_ = nullptr;
  float* dt_bias_ = nullptr;
  std::uint8_t* weights_ = nullptr;
  std::uint64_t weights_bytes_ = 0;
  void* state_pool_ = nullptr;
  std::uint64_t state_pool_bytes_ = 0;
  void* conv_pool_[3] = {nullptr, nullptr, nullptr};
  std::uint64_t conv_pool_bytes_ = 0;
  void* workspace_ = nullptr;
  std::uint64_t workspace_bytes_ = 0;
  bool poison_workspace_ = false;
  std::int64_t record_rows_ = 0;  // max_sequences * max_verify_tokens
  int record_regions_ = 1;        // runtime.record_regions
  float* records_ = nullptr;
  bf16_bits* conv_records_ = nullptr;
};

}  // namespace kda::engine
