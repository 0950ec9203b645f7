// engine/engine.cpp — planning, the arena, state slots, prefill/decode dispatch.
//
// Everything backend-specific (memory, copies, the operator's entry points, the device status
// word, pointer checks) goes through one EngineBackend (backend.hpp); this file never asks which
// backend it runs on.
#include "kda/engine/engine.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <system_error>

#include "backend.hpp"
#include "kda/engine/checkpoint.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/nvtx.hpp"
#include "whole_layer.hpp"

namespace kda::engine {

namespace {

constexpr int kMaxDecodeTokens = 16;

[[noreturn]] void fail(const std::string& what, StatusCode code = StatusCode::kInvalidArgument) {
  throw Error(code, what);
}

Problem max_prefill_problem(const ModelSpec& spec) {
  Problem p;
  p.batch = 1;
  p.seq_len = spec.runtime.max_tokens;
  p.num_heads = spec.local_heads();
  p.head_dim_k = spec.head_dim;
  p.head_dim_v = spec.head_dim;
  p.num_seqs = spec.runtime.max_sequences;
  p.cu_seqlens_dtype = DType::kI64;
  p.gate = spec.gate;
  p.lower_bound = spec.gate_lower_bound;
  p.initial_state_dtype = spec.runtime.state_dtype;
  p.final_state_dtype = spec.runtime.state_dtype;
  return p;
}

DecodeProblem max_decode_problem(const ModelSpec& spec) {
  DecodeProblem p;
  p.batch = spec.runtime.max_sequences;
  p.tokens = 1;
  p.num_heads = spec.local_heads();
  p.head_dim_k = spec.head_dim;
  p.head_dim_v = spec.head_dim;
  p.num_slots = spec.runtime.max_sequences;
  p.state_dtype = spec.runtime.state_dtype;
  p.gate = spec.gate;
  p.lower_bound = spec.gate_lower_bound;
  return p;
}

// Whole layers: the spec the cores see, with this rank's heads.
ModelSpec core_spec(const ModelSpec& spec) {
  ModelSpec local = spec;
  local.num_heads = spec.local_heads();
  local.runtime.tp_size = 1;
  local.runtime.tp_rank = 0;
  return local;
}

void check_layer_mode(const ModelSpec& spec) {
  if (spec.runtime.layer_mode == LayerMode::kCoreOnly && spec.runtime.tp_size != 1) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": runtime.tp_size " + std::to_string(spec.runtime.tp_size) +
                    " needs whole layers (runtime.layers: whole): a core-only engine holds every "
                    "head");
  }
}

// Parameters of a layer that is only planned: sizes matter, values do not.
KdaParameters planning_parameters(const ModelSpec& spec) {
  KdaParameters parameters;
  parameters.A_log.assign(static_cast<std::size_t>(spec.num_heads), 0.0f);
  parameters.dt_bias.assign(static_cast<std::size_t>(spec.num_heads * spec.head_dim), 0.0f);
  return parameters;
}

// Whole layers of `spec` on `backend`, without weights: what the plan needs. Their weights come
// once the arena exists (make_whole_cores with a WeightPlacement).
std::vector<std::unique_ptr<WholeLayer>> make_whole_layers(const ModelSpec& spec, Backend backend) {
  std::vector<std::unique_ptr<WholeLayer>> whole;
  whole.reserve(spec.kda_layer_indices.size());
  for (std::size_t i = 0; i < spec.kda_layer_indices.size(); ++i) {
    whole.push_back(std::make_unique<WholeLayer>(spec, static_cast<int>(i),
                                                 spec.kda_layer_indices[i], backend));
  }
  return whole;
}

// Where whole layers' weights go: `arena`, laid out by `plan` (the plan the layers declared to).
struct WeightPlacement {
  std::uint64_t seed = 0;  // random weights when the spec names no checkpoint
  std::uint8_t* arena = nullptr;
  const planner::MemoryPlan* plan = nullptr;
};

// The cores (KdaLayer) of `whole`. Without `placement`: planning parameters (sizes only). With it:
// each layer's weights are read from the checkpoint (or seeded random) one layer at a time, placed
// by its WholeLayer (into its arena buffer) and dropped; the core keeps their A_log and dt_bias,
// so both calls run the same layer.
std::vector<KdaLayer> make_whole_cores(const ModelSpec& spec,
                                       const std::vector<std::unique_ptr<WholeLayer>>& whole,
                                       const WeightPlacement* placement) {
  const ModelSpec local = core_spec(spec);
  std::vector<KdaLayer> layers;
  layers.reserve(whole.size());
  std::unique_ptr<Checkpoint> checkpoint;
  if (placement != nullptr && !spec.weights.empty()) {
    check_weights_file(spec);
    checkpoint = std::make_unique<Checkpoint>(Checkpoint::open(spec.weights));
  }
  for (std::size_t i = 0; i < whole.size(); ++i) {
    const int index = spec.kda_layer_indices[i];
    WholeLayer& layer = *whole[i];
    KdaParameters parameters;
    if (placement != nullptr) {
      FullLayerWeights weights;
      try {
        weights = checkpoint ? load_full_layer_weights(*checkpoint, index, layer.config())
                             : random_full_layer_weights(layer.config(), placement->seed, index);
      } catch (const Error& e) {
        throw Error(e.code(), spec.source + ": weights of layer " + std::to_string(index + 1) +
                                  ": " + e.what());
      }
      layer.set_weights(weights, placement->arena, *placement->plan);
      parameters.A_log = std::move(weights.A_log);
      parameters.dt_bias = std::move(weights.dt_bias);
      parameters.origin = weights.origin;
    } else {
      parameters = planning_parameters(local);
    }
    layers.emplace_back(local, static_cast<int>(i), index, std::move(parameters));
  }
  return layers;
}

std::vector<KdaLayer> make_layers(const ModelSpec& spec, bool with_parameters, std::uint64_t seed) {
  std::vector<KdaLayer> layers;
  layers.reserve(spec.kda_layer_indices.size());
  std::unique_ptr<SafetensorsFile> weights;
  if (with_parameters && !spec.weights.empty()) {
    check_weights_file(spec);
    weights = std::make_unique<SafetensorsFile>(SafetensorsFile::open(spec.weights));
  }
  for (std::size_t i = 0; i < spec.kda_layer_indices.size(); ++i) {
    const int index = spec.kda_layer_indices[i];
    KdaParameters parameters;
    if (weights) {
      parameters = load_kda_parameters(*weights, index, spec.num_heads, spec.head_dim);
    } else if (with_parameters) {
      parameters = random_kda_parameters(seed, index, spec.num_heads, spec.head_dim);
    } else {
      parameters = planning_parameters(spec);
    }
    layers.emplace_back(spec, static_cast<int>(i), index, std::move(parameters));
  }
  return layers;
}

// The engine's own buffers besides the layers': handles into the plan.
struct EngineBuffers {
  planner::BufferHandle cu_seqlens, prefill_slots, decode_slots, device_status;
};

// Every buffer of an engine, in the order the arena lays them out in `sum` mode. The layers keep
// their handles; the engine's come back in `buffers`.
planner::MemoryPlan make_plan(const ModelSpec& spec, Backend backend, std::vector<KdaLayer>& layers,
                              const std::vector<std::unique_ptr<WholeLayer>>& whole,
                              EngineBuffers* buffers) {
  planner::MemoryPlanner planner;
  // Whole layers run in their core's workspace, sized for every intermediate of the layer: live
  // during that layer only, so `reuse` lays all layers' over the same bytes.
  const std::uint64_t whole_workspace = whole.empty() ? 0 : whole_workspace_bytes(spec, backend);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    layers[i].declare_buffers(planner, backend, whole_workspace);
    if (!whole.empty()) whole[i]->declare_buffers(planner);
  }
  const int last_step = std::max(0, static_cast<int>(layers.size()) - 1);
  auto scratch = [&](const char* name, std::uint64_t bytes) {
    planner::BufferRequest request;
    request.name = name;
    request.kind = planner::BufferKind::kScratch;
    request.bytes = bytes;
    request.first_step = 0;  // live while any layer runs
    request.last_step = last_step;
    return planner.add(request);
  };
  const auto seqs = static_cast<std::uint64_t>(spec.runtime.max_sequences);
  // The batch's cu_seqlens: one entry per sequence and one more.
  buffers->cu_seqlens = scratch("prefill.cu_seqlens", (seqs + 1) * sizeof(std::int64_t));
  // Slot indices, one buffer per kind of call, so that alternating prefill and decode batches do
  // not re-upload (and a captured graph replays without host-to-device copies).
  buffers->prefill_slots = scratch("prefill.slots", seqs * sizeof(std::int32_t));
  buffers->decode_slots = scratch("decode.slots", seqs * sizeof(std::int32_t));
  buffers->device_status = backend_has_device_status(backend)
                               ? scratch("engine.device_status", sizeof(std::uint32_t))
                               : planner::BufferHandle{};

  planner::PlanResult result = planner.plan(spec.runtime.workspace_plan);
  if (!result.ok) {
    // Sizes that do not fit are the model's (kOverflow); anything else is the engine's mistake.
    throw Error(result.status == planner::PlanStatus::kOverflow ? StatusCode::kOverflow
                                                                : StatusCode::kInternal,
                "memory plan for " + spec.name + ": " + result.error + " (" +
                    planner::to_string(result.status) + ")");
  }
  return std::move(result.plan);
}

// The caller's part of an operator call's tensors (Tensors or DecodeTensors); the engine adds its
// own (states, slots, cu_seqlens, status word).
template <typename CallTensors>
CallTensors caller_tensors(const LayerInputs& inputs, void* out) {
  CallTensors t;
  t.q = inputs.q;
  t.k = inputs.k;
  t.v = inputs.v;
  t.g = inputs.g;
  t.beta = inputs.beta;
  t.out = out;
  return t;
}

}  // namespace

// ---- the engine's state ----------------------------------------------------------------------

struct Engine::Impl {
  // Slot indices staged for the operator (int32, -1 for padding), one per kind of call.
  struct SlotStaging {
    std::int32_t* device = nullptr;      // arena scratch
    std::vector<std::int32_t> host;      // capacity fixed at construction
    std::vector<std::int32_t> uploaded;  // what `device` holds now (skip repeat uploads)
  };

  ModelSpec spec;
  std::unique_ptr<EngineBackend> backend;
  CudaOptions unchecked;  // the operator calls: pointers already checked or the arena's own
  std::uint32_t* device_status = nullptr;  // the backend's device status word (arena), if any
  std::vector<KdaLayer> layers;
  std::vector<std::unique_ptr<WholeLayer>> whole;  // whole layers: one per KdaLayer; else empty
  std::string weights_origin;
  std::uint64_t weight_bytes = 0;
  int cpu_threads = 0;
  planner::MemoryPlan plan;
  BackendBuffer arena;
  std::uint64_t slot_bytes = 0;
  std::uint64_t conv_slot_bytes = 0;  // whole layers: one projection's conv state of one slot
  std::vector<char> slot_in_use;
  std::vector<std::int64_t> decode_cu;  // whole-layer decode: 0, t, 2t, ... (capacity reserved)

  // Prefill staging: the batch's int64 cu_seqlens.
  std::int64_t* cu_scratch = nullptr;
  std::vector<std::int64_t> cu_staging;   // host, capacity fixed at construction
  std::vector<std::int64_t> cu_uploaded;  // what cu_scratch holds now (skip repeat uploads)
  std::vector<unsigned> seen_stamp;       // duplicate-slot detection without clearing
  unsigned stamp = 0;
  SlotStaging prefill_slots, decode_slots;

  ~Impl() {
    // Kernels may still use the arena; freeing it must wait for them (nothing to do with a
    // failure in a destructor).
    if (arena && backend) {
      try {
        backend->synchronize();
      } catch (const Error&) {
      }
    }
    arena.reset();
  }

  int num_layers() const noexcept { return static_cast<int>(layers.size()); }
  int num_slots() const noexcept { return static_cast<int>(slot_in_use.size()); }
  bool in_use(int slot) const noexcept {
    return slot >= 0 && slot < num_slots() && slot_in_use[static_cast<std::size_t>(slot)] != 0;
  }

  void check_layer(int kda_layer) const {
    if (kda_layer < 0 || kda_layer >= num_layers()) {
      fail("KDA layer " + std::to_string(kda_layer) + " is out of range [0, " +
           std::to_string(num_layers()) +
           "): the argument is the KDA index (0-based position in kda_layers), not the model "
           "layer");
    }
  }

  std::uint8_t* slot_state(int kda_layer, int slot) const noexcept {
    return static_cast<std::uint8_t*>(layers[static_cast<std::size_t>(kda_layer)].state_pool()) +
           static_cast<std::uint64_t>(slot) * slot_bytes;
  }

  std::uint8_t* slot_conv_state(int kda_layer, int slot, int projection) const noexcept {
    return static_cast<std::uint8_t*>(
               whole[static_cast<std::size_t>(kda_layer)]->conv_pool(projection)) +
           static_cast<std::uint64_t>(slot) * conv_slot_bytes;
  }

  void zero_slot(int slot) {
    for (int l = 0; l < num_layers(); ++l) {
      backend->memset(slot_state(l, slot), 0, static_cast<std::size_t>(slot_bytes));
      if (whole.empty()) continue;
      for (int projection = 0; projection < 3; ++projection) {
        backend->memset(slot_conv_state(l, slot, projection), 0,
                        static_cast<std::size_t>(conv_slot_bytes));
      }
    }
  }

  void check_whole(const char* what) const {
    if (whole.empty()) {
      fail(std::string(what) + ": " + spec.name +
           " runs the KDA core only (runtime.layers: core); hidden states need whole layers "
           "(runtime.layers: whole, the default)");
    }
  }

  // The checks of read_slot_conv_state / write_slot_conv_state, one message each.
  void check_conv_state_access(const char* what, int kda_layer, int slot, int projection) const {
    check_layer(kda_layer);
    check_whole(what);
    if (slot < 0 || slot >= num_slots()) {
      fail(std::string(what) + ": slot " + std::to_string(slot) + " out of range");
    }
    if (projection < 0 || projection > 2) {
      fail(std::string(what) + ": projection " + std::to_string(projection) +
           " is not 0 (q), 1 (k) or 2 (v)");
    }
  }

  // A prefill batch: 1..max_sequences sequences on distinct acquired slots, cu_seqlens 0,
  // non-decreasing, at most max_tokens.
  void check_prefill_batch(const char* what, Span<const int> slots,
                           Span<const std::int64_t> cu_seqlens) {
    const std::string call = what;
    const std::size_t n = slots.size();
    if (n == 0 || n > static_cast<std::size_t>(num_slots())) {
      fail(call + ": " + std::to_string(n) + " sequences, expected 1.." +
           std::to_string(num_slots()) + " (runtime.max_sequences)");
    }
    if (cu_seqlens.size() != n + 1) {
      fail(call + ": cu_seqlens has " + std::to_string(cu_seqlens.size()) + " entries, expected " +
           std::to_string(n + 1) + " (sequences + 1)");
    }
    if (cu_seqlens[0] != 0)
      fail(call + ": cu_seqlens[0] is " + std::to_string(cu_seqlens[0]) + ", expected 0");
    for (std::size_t j = 0; j < n; ++j) {
      if (cu_seqlens[j + 1] < cu_seqlens[j]) {
        fail(call + ": cu_seqlens decreases at index " + std::to_string(j + 1) + " (" +
             std::to_string(cu_seqlens[j]) + " then " + std::to_string(cu_seqlens[j + 1]) + ")");
      }
    }
    if (cu_seqlens[n] > spec.runtime.max_tokens) {
      fail(call + ": " + std::to_string(cu_seqlens[n]) + " tokens exceed runtime.max_tokens " +
           std::to_string(spec.runtime.max_tokens));
    }
    next_stamp();
    for (std::size_t j = 0; j < n; ++j) claim_slot(call, "sequence", j, slots[j]);
  }

  // A decode batch: 1..max_sequences rows of 1..16 tokens; negative slots are padding, the others
  // distinct acquired slots.
  void check_decode_batch(const char* what, Span<const int> slots, int tokens) {
    const std::string call = what;
    const std::size_t batch = slots.size();
    if (batch == 0 || batch > static_cast<std::size_t>(num_slots())) {
      fail(call + ": batch of " + std::to_string(batch) + " rows, expected 1.." +
           std::to_string(num_slots()) + " (runtime.max_sequences)");
    }
    if (tokens < 1 || tokens > kMaxDecodeTokens) {
      fail(call + ": tokens " + std::to_string(tokens) + " per sequence, expected 1.." +
           std::to_string(kMaxDecodeTokens));
    }
    next_stamp();
    for (std::size_t j = 0; j < batch; ++j) {
      if (slots[j] >= 0) claim_slot(call, "row", j, slots[j]);  // negative: a padding row
    }
  }

  // Batch entry j (a "sequence" or a "row") uses `slot`: an acquired slot, not yet seen in this
  // batch (since the last next_stamp()).
  void claim_slot(const std::string& call, const char* entry, std::size_t j, int slot) {
    if (!in_use(slot)) {
      fail(call + ": " + entry + " " + std::to_string(j) + " uses slot " + std::to_string(slot) +
           ", which is not an acquired slot");
    }
    if (seen_stamp[static_cast<std::size_t>(slot)] == stamp) {
      fail(call + ": slot " + std::to_string(slot) + " appears twice in the batch");
    }
    seen_stamp[static_cast<std::size_t>(slot)] = stamp;
  }

  // The caller's hidden states and out of a whole-layer call ([tokens, hidden_size] bf16), and
  // the arena, usable by the backend (CUDA: device memory of the current device; throws).
  void check_hidden(const KdaLayer& layer, const char* what, const void* hidden, const void* out,
                    std::int64_t tokens) const {
    const std::string call = layer.label() + " " + what;
    if (tokens == 0) return;
    if (hidden == nullptr) fail(call + ": hidden is null");
    if (out == nullptr) fail(call + ": out is null");
    const auto bytes = static_cast<std::size_t>(tokens) *
                       static_cast<std::size_t>(spec.hidden_size) * sizeof(std::uint16_t);
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{hidden, "hidden"},
                                    std::pair<const void*, const char*>{out, "out"}}) {
      const Status st = backend->check_caller_buffer(ptr, bytes, name);
      if (!st.ok()) throw Error(st, call);
    }
    const Status st = backend->check_caller_buffer(arena.get(), 1, "the engine's arena");
    if (!st.ok()) throw Error(st, call);
  }

  // Copies the batch's cu_seqlens to the arena, unless it holds them already.
  void stage_cu_seqlens(Span<const std::int64_t> cu_seqlens) {
    cu_staging.assign(cu_seqlens.begin(), cu_seqlens.end());  // capacity reserved: no allocation
    if (cu_staging != cu_uploaded) {
      KDA_NVTX_RANGE("prefill.stage_cu_seqlens");
      backend->copy_to_device(cu_scratch, cu_staging.data(),
                              cu_staging.size() * sizeof(std::int64_t));
      cu_uploaded = cu_staging;
    }
  }

  // A new stamp for one batch's duplicate-slot check.
  void next_stamp() {
    if (++stamp == 0) {  // wrapped: restart the stamps
      std::fill(seen_stamp.begin(), seen_stamp.end(), 0u);
      stamp = 1;
    }
  }

  // The caller's tensors usable by the backend (CUDA: device memory of the current device, large
  // enough for the call), and the arena reachable too (throws). The operator then runs with its
  // own pointer checks off.
  template <typename CallProblem, typename CallTensors>
  void check_caller_tensors(const KdaLayer& layer, const char* what, const CallProblem& p,
                            const CallTensors& t) const {
    Status st = backend->check_caller_tensors(p, t);
    if (!st.ok()) throw Error(st, layer.label() + " " + what);
    // The operator's own check of the arena's buffers (states, parameters, workspace) is off too:
    // one query here still catches a call made while another device is current.
    st = backend->check_caller_buffer(arena.get(), 1, "the engine's arena");
    if (!st.ok()) throw Error(st, layer.label() + " " + what);
  }

  // Copies the batch's slot indices to `staging`'s scratch, unless it holds them already.
  void stage_slots(Span<const int> slots, SlotStaging* staging) {
    staging->host.clear();
    for (const int slot : slots) staging->host.push_back(slot < 0 ? -1 : slot);
    if (staging->host != staging->uploaded) {
      KDA_NVTX_RANGE("engine.stage_slots");
      backend->copy_to_device(staging->device, staging->host.data(),
                              staging->host.size() * sizeof(std::int32_t));
      staging->uploaded = staging->host;  // capacity reserved: no allocation
    }
  }
};

// ---- construction ----------------------------------------------------------------------------

Backend resolve_backend(const ModelSpec& spec, BackendChoice choice, std::string* why) {
  auto why_cuda_cannot_run = [&spec]() -> std::string {
    // Whole layers on CUDA: FullLayerCuda's limits (head_dim 128, conv width 2..4).
    if (spec.runtime.layer_mode == LayerMode::kWhole) {
      if (spec.head_dim != 128) {
        return "head_dim " + std::to_string(spec.head_dim) + " (the CUDA whole layer needs 128)";
      }
      if (spec.short_conv_kernel_size < 2 || spec.short_conv_kernel_size > 4) {
        return "short_conv_kernel_size " + std::to_string(spec.short_conv_kernel_size) +
               " (the CUDA whole layer needs 2..4)";
      }
    }
    if (const Status st = can_implement(max_prefill_problem(spec), Backend::kCuda); !st.ok()) {
      return "prefill: " + st.message();
    }
    if (const Status st = can_implement(max_decode_problem(spec), Backend::kCuda); !st.ok()) {
      return "decode: " + st.message();
    }
    return std::string();
  };
  return choose_backend(choice, why_cuda_cannot_run, why);
}

void check_weights_file(const ModelSpec& spec) {
  if (spec.weights.empty()) return;
  std::error_code ec;
  const auto status = std::filesystem::status(spec.weights, ec);
  std::string problem;
  if (status.type() == std::filesystem::file_type::not_found) {
    problem = "does not exist";
  } else if (ec) {
    problem = "cannot be read (" + ec.message() + ")";
  } else if (status.type() == std::filesystem::file_type::directory) {
    // Whole layers read a Hugging Face checkpoint folder too (checkpoint.hpp).
    const std::filesystem::path dir(spec.weights);
    std::error_code exists_ec;
    if (spec.runtime.layer_mode == LayerMode::kWhole &&
        (std::filesystem::exists(dir / "model.safetensors.index.json", exists_ec) ||
         std::filesystem::exists(dir / "model.safetensors", exists_ec))) {
      return;
    }
    problem = spec.runtime.layer_mode == LayerMode::kWhole
                  ? "is a directory holding neither model.safetensors.index.json nor "
                    "model.safetensors"
                  : "is a directory, expected a safetensors file";
  } else {
    return;
  }
  fail(spec.source + ": weights: '" + spec.weights + "' " + problem +
       " (a relative path is resolved against the YAML's directory)");
}

planner::MemoryPlan Engine::plan_for(const ModelSpec& spec, Backend backend) {
  check_layer_mode(spec);
  const bool whole_layers = spec.runtime.layer_mode == LayerMode::kWhole;
  std::vector<std::unique_ptr<WholeLayer>> whole;
  if (whole_layers) whole = make_whole_layers(spec, backend);
  std::vector<KdaLayer> layers =
      whole_layers ? make_whole_cores(spec, whole, nullptr) : make_layers(spec, false, 0);
  EngineBuffers buffers;
  return make_plan(spec, backend, layers, whole, &buffers);
}

Engine::Engine(ModelSpec spec, const EngineOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.spec = std::move(spec);
  if (options.layer_mode) m.spec.runtime.layer_mode = *options.layer_mode;
  if (options.prefill_schedule) m.spec.runtime.prefill_schedule = *options.prefill_schedule;
  check_layer_mode(m.spec);
  m.cpu_threads = options.cpu_threads;
  const Backend kind = resolve_backend(m.spec, options.backend.value_or(m.spec.runtime.backend));
  const std::string where = m.spec.name + " on " + to_string(kind);
  // Checked before the backend is made: nothing is created for options that will be refused.
  if (!is_known(m.spec.runtime.prefill_schedule)) {
    throw Error(StatusCode::kInvalidArgument,
                where + ": EngineOptions::prefill_schedule is " +
                    std::to_string(static_cast<int>(m.spec.runtime.prefill_schedule)) +
                    ", expected kAuto, kTwoPhase or kPipelined");
  }
  BackendOptions backend_options;
  backend_options.cpu_threads = options.cpu_threads;
  backend_options.stream = options.stream;
  backend_options.check_pointers = options.check_pointers;
  m.backend = make_engine_backend(kind, backend_options, where);
  m.unchecked.check_pointers = false;
  m.unchecked.schedule = m.spec.runtime.prefill_schedule;
  if (const Status st = can_implement(max_prefill_problem(m.spec), kind); !st.ok()) {
    throw Error(st, where + ": prefill");
  }
  if (const Status st = can_implement(max_decode_problem(m.spec), kind); !st.ok()) {
    throw Error(st, where + ": decode");
  }

  // Plan from the sizes alone and allocate the arena first: an arena that cannot be had fails
  // before any weights are read or generated (seconds, gigabytes for a large model). The whole
  // layers declared here are the engine's own: their weights then go straight into this plan's
  // buffers, one layer at a time.
  const bool whole = m.spec.runtime.layer_mode == LayerMode::kWhole;
  if (whole) m.whole = make_whole_layers(m.spec, kind);
  {
    std::vector<KdaLayer> sizes_only =
        whole ? make_whole_cores(m.spec, m.whole, nullptr) : make_layers(m.spec, false, 0);
    EngineBuffers unused;
    m.plan = make_plan(m.spec, kind, sizes_only, m.whole, &unused);
  }
  // The one allocation.
  const std::uint64_t total = m.plan.arena_bytes;
  if (total > std::numeric_limits<std::size_t>::max()) {
    fail(where + ": arena of " + std::to_string(total) + " bytes is too large",
         StatusCode::kOverflow);
  }
  try {
    m.arena = BackendBuffer(*m.backend, static_cast<std::size_t>(total), "the arena");
  } catch (const Error& e) {
    throw Error(e.code(), where + ": " + e.what());
  }

  if (whole) {
    const WeightPlacement placement{options.seed, m.arena.get(), &m.plan};
    m.layers = make_whole_cores(m.spec, m.whole, &placement);
    m.weights_origin = m.layers.empty() ? std::string() : m.layers[0].parameters().origin;
    for (const auto& layer : m.whole) m.weight_bytes += layer->weight_bytes();
  } else {
    m.layers = make_layers(m.spec, true, options.seed);
  }
  EngineBuffers buffers;
  // The same declarations as above: the same plan, now with the cores' handles. The weights were
  // placed by the first one, so every offset must stay where it was.
  const std::string sized_plan = m.plan.to_json();
  m.plan = make_plan(m.spec, kind, m.layers, m.whole, &buffers);
  if (m.plan.to_json() != sized_plan) {
    throw Error(StatusCode::kInternal, where + ": the plan changed once the weights were loaded");
  }

  std::uint8_t* base = m.arena.get();
  for (KdaLayer& layer : m.layers) layer.bind(base, m.plan, *m.backend);
  for (std::size_t i = 0; i < m.whole.size(); ++i) m.whole[i]->bind(base, m.plan, m.layers[i]);
  auto locate = [&](planner::BufferHandle handle) -> void* {
    const planner::PlanEntry* entry = m.plan.entry(handle);
    return entry == nullptr ? nullptr : base + entry->offset;
  };
  m.cu_scratch = static_cast<std::int64_t*>(locate(buffers.cu_seqlens));
  m.prefill_slots.device = static_cast<std::int32_t*>(locate(buffers.prefill_slots));
  m.decode_slots.device = static_cast<std::int32_t*>(locate(buffers.decode_slots));
  m.device_status = static_cast<std::uint32_t*>(locate(buffers.device_status));
  if (m.device_status != nullptr) {
    throw_if_error(m.backend->clear_device_status(m.device_status),
                   "clearing the device status word");
  }

  m.slot_bytes = m.spec.state_slot_bytes();
  m.conv_slot_bytes = m.whole.empty() ? 0 : m.spec.conv_state_slot_bytes();
  const auto slots = static_cast<std::size_t>(m.spec.runtime.max_sequences);
  m.slot_in_use.assign(slots, 0);
  // Fresh slots start from zero: clear every pool once here, then per slot on acquire / reset.
  for (const KdaLayer& layer : m.layers) {
    m.backend->memset(layer.state_pool(), 0, static_cast<std::size_t>(layer.state_pool_bytes()));
  }
  for (const auto& layer : m.whole) {
    for (int projection = 0; projection < 3; ++projection) {
      m.backend->memset(layer->conv_pool(projection), 0,
                        static_cast<std::size_t>(layer->conv_pool_bytes()));
    }
  }
  m.decode_cu.reserve(slots + 1);

  // Host staging sized once, so prefill and decode never allocate.
  m.cu_staging.reserve(slots + 1);
  m.cu_uploaded.reserve(slots + 1);
  m.seen_stamp.assign(slots, 0);
  for (Impl::SlotStaging* staging : {&m.prefill_slots, &m.decode_slots}) {
    staging->host.reserve(slots);
    staging->uploaded.reserve(slots);
  }
  synchronize();
}

Engine::~Engine() = default;

const ModelSpec& Engine::spec() const noexcept { return impl_->spec; }
Backend Engine::backend() const noexcept { return impl_->backend->kind(); }
const planner::MemoryPlan& Engine::plan() const noexcept { return impl_->plan; }
std::uint64_t Engine::arena_bytes() const noexcept { return impl_->plan.arena_bytes; }
int Engine::num_layers() const noexcept { return impl_->num_layers(); }
void* Engine::stream() const noexcept { return impl_->backend->stream(); }

const KdaLayer& Engine::layer(int kda_layer) const {
  impl_->check_layer(kda_layer);
  return impl_->layers[static_cast<std::size_t>(kda_layer)];
}

LayerMode Engine::layer_mode() const noexcept { return impl_->spec.runtime.layer_mode; }
const std::string& Engine::weights_origin() const noexcept { return impl_->weights_origin; }
std::uint64_t Engine::weight_bytes() const noexcept { return impl_->weight_bytes; }

void Engine::synchronize() const { impl_->backend->synchronize(); }

void Engine::check_device_status() {
  Impl& m = *impl_;
  if (m.device_status == nullptr) return;
  const Status st = m.backend->check_device_status(m.device_status);
  if (st.ok()) return;
  if (st.code() == StatusCode::kInvalidArgument) {  // bits were set: clear them for the next check
    throw_if_error(m.backend->clear_device_status(m.device_status),
                   "clearing the device status word");
  }
  throw Error(st, m.spec.name + ": device status");
}

// ---- state slots ---------------------------------------------------------------------------

int Engine::num_slots() const noexcept { return impl_->num_slots(); }
std::uint64_t Engine::state_slot_bytes() const noexcept { return impl_->slot_bytes; }

int Engine::free_slots() const noexcept {
  return static_cast<int>(std::count(impl_->slot_in_use.begin(), impl_->slot_in_use.end(), 0));
}

bool Engine::slot_in_use(int slot) const noexcept { return impl_->in_use(slot); }

int Engine::acquire_slot() {
  Impl& m = *impl_;
  for (int slot = 0; slot < m.num_slots(); ++slot) {
    if (m.slot_in_use[static_cast<std::size_t>(slot)] == 0) {
      m.zero_slot(slot);
      m.slot_in_use[static_cast<std::size_t>(slot)] = 1;
      return slot;
    }
  }
  fail("all " + std::to_string(m.num_slots()) +
           " state slots are in use (runtime.max_sequences); release one first",
       StatusCode::kInvalidArgument);
}

void Engine::release_slot(int slot) {
  if (!slot_in_use(slot)) fail("release_slot: slot " + std::to_string(slot) + " is not acquired");
  impl_->slot_in_use[static_cast<std::size_t>(slot)] = 0;
}

void Engine::reset_slot(int slot) {
  if (!slot_in_use(slot)) fail("reset_slot: slot " + std::to_string(slot) + " is not acquired");
  impl_->zero_slot(slot);
}

void Engine::read_slot_state(int kda_layer, int slot, void* host_dst) const {
  const Impl& m = *impl_;
  m.check_layer(kda_layer);
  if (slot < 0 || slot >= m.num_slots()) {
    fail("read_slot_state: slot " + std::to_string(slot) + " out of range");
  }
  m.backend->copy_to_host(host_dst, m.slot_state(kda_layer, slot),
                          static_cast<std::size_t>(m.slot_bytes));
}

void Engine::write_slot_state(int kda_layer, int slot, const void* host_src) {
  Impl& m = *impl_;
  m.check_layer(kda_layer);
  if (slot < 0 || slot >= m.num_slots()) {
    fail("write_slot_state: slot " + std::to_string(slot) + " out of range");
  }
  m.backend->copy_to_device(m.slot_state(kda_layer, slot), host_src,
                            static_cast<std::size_t>(m.slot_bytes));
  synchronize();
}

// ---- forward -------------------------------------------------------------------------------

void Engine::prefill(int kda_layer, const LayerInputs& inputs, void* out, Span<const int> slots,
                     Span<const std::int64_t> cu_seqlens) {
  Impl& m = *impl_;
  m.check_layer(kda_layer);
  const KdaLayer& layer = m.layers[static_cast<std::size_t>(kda_layer)];
  KDA_NVTX_RANGE(layer.nvtx_name().c_str());

  m.check_prefill_batch("prefill", slots, cu_seqlens);
  const std::size_t n = slots.size();

  // The caller's tensors over the whole batch, checked before anything is enqueued (the operator's
  // forward refuses an out that overlaps an input before it writes anything).
  const Problem problem = layer.prefill_problem(cu_seqlens[n], static_cast<std::int64_t>(n));
  Tensors t = caller_tensors<Tensors>(inputs, out);
  m.check_caller_tensors(layer, "prefill", problem, t);

  // One forward for the whole batch: each sequence reads and writes its state through its slot
  // index in the layer's pool (Problem::num_state_slots), whatever the slots are.
  m.stage_cu_seqlens(cu_seqlens);
  m.stage_slots(slots, &m.prefill_slots);
  t.cu_seqlens = m.cu_scratch;
  t.cu_seqlens_host = m.cu_staging.data();
  t.initial_state = layer.state_pool();
  t.final_state = layer.state_pool();      // in place
  t.state_slots = m.prefill_slots.device;  // checked above: acquired, no duplicates
  t.device_status = m.device_status;
  layer.forward(problem, t, m.unchecked);
}

void Engine::decode(int kda_layer, const LayerInputs& inputs, void* out, Span<const int> slots,
                    int tokens) {
  Impl& m = *impl_;
  m.check_layer(kda_layer);
  const KdaLayer& layer = m.layers[static_cast<std::size_t>(kda_layer)];
  KDA_NVTX_RANGE(layer.nvtx_name().c_str());

  m.check_decode_batch("decode", slots, tokens);
  const std::size_t batch = slots.size();
  // The caller's tensors, before anything is enqueued (see prefill).
  const DecodeProblem problem = layer.decode_problem(static_cast<std::int64_t>(batch), tokens);
  DecodeTensors t = caller_tensors<DecodeTensors>(inputs, out);
  m.check_caller_tensors(layer, "decode", problem, t);
  m.stage_slots(slots, &m.decode_slots);
  t.slots = m.decode_slots.device;
  t.out = out;
  t.device_status = m.device_status;
  layer.decode(problem, t, m.unchecked);
}

// ---- whole layers ----------------------------------------------------------------------------

std::uint64_t Engine::conv_state_slot_bytes() const noexcept { return impl_->conv_slot_bytes; }

void Engine::read_slot_conv_state(int kda_layer, int slot, int projection, void* host_dst) const {
  const Impl& m = *impl_;
  m.check_conv_state_access("read_slot_conv_state", kda_layer, slot, projection);
  m.backend->copy_to_host(host_dst, m.slot_conv_state(kda_layer, slot, projection),
                          static_cast<std::size_t>(m.conv_slot_bytes));
}

void Engine::write_slot_conv_state(int kda_layer, int slot, int projection, const void* host_src) {
  Impl& m = *impl_;
  m.check_conv_state_access("write_slot_conv_state", kda_layer, slot, projection);
  m.backend->copy_to_device(m.slot_conv_state(kda_layer, slot, projection), host_src,
                            static_cast<std::size_t>(m.conv_slot_bytes));
  synchronize();
}

void Engine::prefill_hidden(int kda_layer, const void* hidden, void* out, Span<const int> slots,
                            Span<const std::int64_t> cu_seqlens, FullLayerTimes* times) {
  Impl& m = *impl_;
  m.check_layer(kda_layer);
  m.check_whole("prefill_hidden");
  const KdaLayer& layer = m.layers[static_cast<std::size_t>(kda_layer)];
  KDA_NVTX_RANGE(layer.nvtx_name().c_str());
  m.check_prefill_batch("prefill_hidden", slots, cu_seqlens);
  const std::int64_t tokens = cu_seqlens[slots.size()];
  m.check_hidden(layer, "prefill_hidden", hidden, out, tokens);

  m.stage_cu_seqlens(cu_seqlens);
  m.stage_slots(slots, &m.prefill_slots);
  WholeLayer::Call call;
  call.tokens = tokens;
  call.sequences = static_cast<std::int64_t>(slots.size());
  call.cu_host = m.cu_staging.data();
  call.cu_device = m.cu_scratch;
  call.slots_host = m.prefill_slots.host.data();
  call.slots_device = m.prefill_slots.device;  // checked above: acquired, no duplicates
  call.device_status = m.device_status;
  call.hidden = hidden;
  call.out = out;
  call.stream = m.backend->stream();
  call.schedule = m.unchecked.schedule;
  call.cpu_threads = m.cpu_threads;
  call.times = times;
  m.whole[static_cast<std::size_t>(kda_layer)]->forward(call);
}

void Engine::decode_hidden(int kda_layer, const void* hidden, void* out, Span<const int> slots,
                           int tokens, FullLayerTimes* times) {
  Impl& m = *impl_;
  m.check_layer(kda_layer);
  m.check_whole("decode_hidden");
  const KdaLayer& layer = m.layers[static_cast<std::size_t>(kda_layer)];
  KDA_NVTX_RANGE(layer.nvtx_name().c_str());
  m.check_decode_batch("decode_hidden", slots, tokens);
  const auto batch = static_cast<std::int64_t>(slots.size());
  m.check_hidden(layer, "decode_hidden", hidden, out, batch * tokens);

  m.stage_slots(slots, &m.decode_slots);
  m.decode_cu.clear();  // capacity reserved: no allocation
  for (std::int64_t j = 0; j <= batch; ++j) m.decode_cu.push_back(j * tokens);
  WholeLayer::Call call;
  call.tokens = batch * tokens;
  call.sequences = batch;
  call.decode_tokens = tokens;
  call.cu_host = m.decode_cu.data();
  call.slots_host = m.decode_slots.host.data();
  call.slots_device = m.decode_slots.device;
  call.device_status = m.device_status;
  call.hidden = hidden;
  call.out = out;
  call.stream = m.backend->stream();
  call.schedule = m.unchecked.schedule;
  call.cpu_threads = m.cpu_threads;
  call.times = times;
  m.whole[static_cast<std::size_t>(kda_layer)]->forward(call);
}

}  // namespace kda::engine
