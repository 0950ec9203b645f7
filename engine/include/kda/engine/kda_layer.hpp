// kda/engine/kda_layer.hpp — one KDA layer of a model: its parameters, its buffers, its forward.
//
// Parameters (per layer, fp32 in the arena):
//   A_log   [H]     tensor "model.layers.{i}.self_attn.A_log",   stored as [H] or [1, 1, H, 1]
//   dt_bias [H, K]  tensor "model.layers.{i}.self_attn.dt_bias", stored as [H * K] or [H, K]
// with i the 0-based model layer index, as in Hugging Face Kimi-Linear checkpoints (so YAML layer 1
// is model.layers.0). F32 and BF16 tensors are accepted (BF16 is widened). When the model names no
// weights file, parameters are seeded random, as fla initialises a KDA layer:
//   A_log = log(U[1, 16]),  dt_bias = softplus^-1(dt) with dt = exp(U[log 1e-3, log 1e-1])
// from a generator seeded by (seed, i), so a run is reproducible and layers differ.
//
// Buffers a layer declares to the planner (names carry the 0-based model layer index i):
//   layer{i}.A_log, layer{i}.dt_bias   parameter, persistent
//   layer{i}.state                     state, persistent: [max_sequences, H, V, K] slots
//   layer{i}.workspace                 workspace, live while the layer runs (step = its position
//                                      among the KDA layers); sized by kda::workspace_size() for
//                                      max_tokens tokens in max_sequences sequences, or for a whole
//                                      layer (every intermediate of it too) when the engine runs
//                                      whole layers; omitted when the backend needs none
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/engine/model_spec.hpp"
#include "kda/kda.hpp"
#include "kda/planner/memory_plan.hpp"

namespace kda::engine {

class SafetensorsFile;
class EngineBackend;  // engine-internal (engine/src/backend.hpp)

struct KdaParameters {
  std::vector<float> A_log;    // [H]
  std::vector<float> dt_bias;  // [H * K]
  std::string origin;          // "random (seed S)" or "file:tensor-name"
};

// Tensor names of a layer's parameters in a checkpoint.
std::string a_log_tensor_name(int layer_index);
std::string dt_bias_tensor_name(int layer_index);

// Reads layer `layer_index`'s parameters from `file`, checking names, shapes and dtypes. Throws
// kda::Error naming the file and the tensor.
KdaParameters load_kda_parameters(const SafetensorsFile& file, int layer_index,
                                  std::int64_t num_heads, std::int64_t head_dim);
// Seeded random parameters (see the header comment).
KdaParameters random_kda_parameters(std::uint64_t seed, int layer_index, std::int64_t num_heads,
                                    std::int64_t head_dim);

class KdaLayer {
 public:
  // `ordinal`: position among the model's KDA layers (its execution step); `layer_index`: 0-based
  // model layer. Throws kda::Error when the parameters do not match the spec's sizes.
  KdaLayer(const ModelSpec& spec, int ordinal, int layer_index, KdaParameters parameters);

  int ordinal() const noexcept { return ordinal_; }
  int layer_index() const noexcept { return layer_index_; }
  const KdaParameters& parameters() const noexcept { return parameters_; }
  const std::string& state_buffer_name() const noexcept { return state_name_; }
  const std::string& workspace_buffer_name() const noexcept { return workspace_name_; }

  // The layer's problem for `tokens` tokens in `sequences` varlen sequences (int64 cu_seqlens),
  // state read from and written to the pool's dtype.
  Problem prefill_problem(std::int64_t tokens, std::int64_t sequences) const noexcept;
  DecodeProblem decode_problem(std::int64_t batch, std::int64_t tokens) const noexcept;

  // Adds this layer's buffers to `planner` and keeps their handles for bind(). The workspace is at
  // least `min_workspace_bytes` (an engine of whole layers runs them in it too). Throws kda::Error
  // when workspace_size() fails.
  void declare_buffers(planner::MemoryPlanner& planner, Backend backend,
                       std::uint64_t min_workspace_bytes = 0);

  // Engine-internal: points the layer at its buffers inside an arena laid out by `plan` (the plan
  // of the planner declare_buffers() last added to), copies the parameters in through `backend`
  // (enqueued in its stream order) and runs forward/decode there from now on. Throws kda::Error.
  void bind(std::uint8_t* arena, const planner::MemoryPlan& plan, EngineBackend& backend);

  void* state_pool() const noexcept { return state_pool_; }
  std::uint64_t state_pool_bytes() const noexcept { return state_pool_bytes_; }
  const float* device_A_log() const noexcept { return A_log_; }
  const float* device_dt_bias() const noexcept { return dt_bias_; }
  void* workspace() const noexcept { return workspace_; }
  std::uint64_t workspace_bytes() const noexcept { return workspace_bytes_; }

  // "kda.layer{n}", n the 1-based model layer: the NVTX range the engine opens around everything
  // this layer does.
  const std::string& nvtx_name() const noexcept { return nvtx_name_; }
  // "layer {n} (KDA index {ordinal})", n the 1-based model layer: how messages name the layer.
  const std::string& label() const noexcept { return label_; }

  // One forward on the bound backend, in the NVTX phase range "prefill.forward_cpu|cuda". `t`
  // needs no parameters or workspace: the layer fills them in. Throws kda::Error.
  void forward(const Problem& p, Tensors t, const CudaOptions& cuda = {}) const;
  // One decode step on the layer's state pool, in the NVTX phase range "decode.step_cpu|cuda";
  // `t` needs no parameters or pool. Throws kda::Error.
  void decode(const DecodeProblem& p, DecodeTensors t, const CudaOptions& cuda = {}) const;

 private:
  int ordinal_;
  int layer_index_;
  std::int64_t num_heads_, head_dim_;
  std::int64_t max_tokens_, max_sequences_;
  DType state_dtype_;
  GateMode gate_;
  float lower_bound_;
  KdaParameters parameters_;
  std::string label_, nvtx_name_, a_log_name_, dt_bias_name_, state_name_, workspace_name_;
  planner::BufferHandle a_log_buffer_, dt_bias_buffer_, state_buffer_, workspace_buffer_;

  const EngineBackend* backend_ = nullptr;
  float* A_log_ = nullptr;
  float* dt_bias_ = nullptr;
  void* state_pool_ = nullptr;
  std::uint64_t state_pool_bytes_ = 0;
  void* workspace_ = nullptr;
  std::uint64_t workspace_bytes_ = 0;
};

}  // namespace kda::engine
