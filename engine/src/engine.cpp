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
#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/nvtx.hpp"

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
  p.num_heads = spec.num_heads;
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
  p.num_heads = spec.num_heads;
  p.head_dim_k = spec.head_dim;
  p.head_dim_v = spec.head_dim;
  p.num_slots = spec.runtime.max_sequences;
  p.state_dtype = spec.runtime.state_dtype;
  p.gate = spec.gate;
  p.lower_bound = spec.gate_lower_bound;
  return p;
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
    } else {  // planning only: sizes matter, values do not
      parameters.A_log.assign(static_cast<std::size_t>(spec.num_heads), 0.0f);
      parameters.dt_bias.assign(static_cast<std::size_t>(spec.num_heads * spec.head_dim), 0.0f);
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
                              EngineBuffers* buffers) {
  planner::MemoryPlanner planner;
  for (KdaLayer& layer : layers) layer.declare_buffers(planner, backend);
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
  planner::MemoryPlan plan;
  BackendBuffer arena;
  std::uint64_t slot_bytes = 0;
  std::vector<char> slot_in_use;

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

  void zero_slot(int slot) {
    for (int l = 0; l < num_layers(); ++l) {
      backend->memset(slot_state(l, slot), 0, static_cast<std::size_t>(slot_bytes));
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

Backend resolve_backend(const ModelSpec& spec, BackendChoice choice) {
  return choose_backend(choice, [&spec] {
    return can_implement(max_prefill_problem(spec), Backend::kCuda).ok() &&
           can_implement(max_decode_problem(spec), Backend::kCuda).ok();
  });
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
    problem = "is a directory, expected a safetensors file";
  } else {
    return;
  }
  fail(spec.source + ": weights: '" + spec.weights + "' " + problem +
       " (a relative path is resolved against the YAML's directory)");
}

planner::MemoryPlan Engine::plan_for(const ModelSpec& spec, Backend backend) {
  std::vector<KdaLayer> layers = make_layers(spec, false, 0);
  EngineBuffers buffers;
  return make_plan(spec, backend, layers, &buffers);
}

Engine::Engine(ModelSpec spec, const EngineOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.spec = std::move(spec);
  const Backend kind = resolve_backend(m.spec, options.backend.value_or(m.spec.runtime.backend));
  const std::string where = m.spec.name + " on " + to_string(kind);
  BackendOptions backend_options;
  backend_options.cpu_threads = options.cpu_threads;
  backend_options.stream = options.stream;
  backend_options.check_pointers = options.check_pointers;
  m.backend = make_engine_backend(kind, backend_options, where);
  m.unchecked.check_pointers = false;
  if (const Status st = can_implement(max_prefill_problem(m.spec), kind); !st.ok()) {
    throw Error(st, where + ": prefill");
  }
  if (const Status st = can_implement(max_decode_problem(m.spec), kind); !st.ok()) {
    throw Error(st, where + ": decode");
  }

  m.layers = make_layers(m.spec, true, options.seed);
  EngineBuffers buffers;
  m.plan = make_plan(m.spec, kind, m.layers, &buffers);

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

  std::uint8_t* base = m.arena.get();
  for (KdaLayer& layer : m.layers) layer.bind(base, m.plan, *m.backend);
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
  const auto slots = static_cast<std::size_t>(m.spec.runtime.max_sequences);
  m.slot_in_use.assign(slots, 0);
  // Fresh slots start from zero: clear every pool once here, then per slot on acquire / reset.
  for (const KdaLayer& layer : m.layers) {
    m.backend->memset(layer.state_pool(), 0, static_cast<std::size_t>(layer.state_pool_bytes()));
  }

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

  const std::size_t n = slots.size();
  if (n == 0 || n > static_cast<std::size_t>(num_slots())) {
    fail("prefill: " + std::to_string(n) + " sequences, expected 1.." +
         std::to_string(num_slots()) + " (runtime.max_sequences)");
  }
  if (cu_seqlens.size() != n + 1) {
    fail("prefill: cu_seqlens has " + std::to_string(cu_seqlens.size()) + " entries, expected " +
         std::to_string(n + 1) + " (sequences + 1)");
  }
  if (cu_seqlens[0] != 0)
    fail("prefill: cu_seqlens[0] is " + std::to_string(cu_seqlens[0]) + ", expected 0");
  for (std::size_t j = 0; j < n; ++j) {
    if (cu_seqlens[j + 1] < cu_seqlens[j]) {
      fail("prefill: cu_seqlens decreases at index " + std::to_string(j + 1) + " (" +
           std::to_string(cu_seqlens[j]) + " then " + std::to_string(cu_seqlens[j + 1]) + ")");
    }
  }
  if (cu_seqlens[n] > m.spec.runtime.max_tokens) {
    fail("prefill: " + std::to_string(cu_seqlens[n]) + " tokens exceed runtime.max_tokens " +
         std::to_string(m.spec.runtime.max_tokens));
  }
  m.next_stamp();
  for (std::size_t j = 0; j < n; ++j) {
    const int slot = slots[j];
    if (!slot_in_use(slot)) {
      fail("prefill: sequence " + std::to_string(j) + " uses slot " + std::to_string(slot) +
           ", which is not an acquired slot");
    }
    if (m.seen_stamp[static_cast<std::size_t>(slot)] == m.stamp) {
      fail("prefill: slot " + std::to_string(slot) + " appears twice in the batch");
    }
    m.seen_stamp[static_cast<std::size_t>(slot)] = m.stamp;
  }

  // The caller's tensors over the whole batch, checked before anything is enqueued (the operator's
  // forward refuses an out that overlaps an input before it writes anything).
  const Problem problem = layer.prefill_problem(cu_seqlens[n], static_cast<std::int64_t>(n));
  Tensors t = caller_tensors<Tensors>(inputs, out);
  m.check_caller_tensors(layer, "prefill", problem, t);

  // One forward for the whole batch: each sequence reads and writes its state through its slot
  // index in the layer's pool (Problem::num_state_slots), whatever the slots are.
  m.cu_staging.assign(cu_seqlens.begin(), cu_seqlens.end());  // capacity reserved: no allocation
  if (m.cu_staging != m.cu_uploaded) {
    KDA_NVTX_RANGE("prefill.stage_cu_seqlens");
    m.backend->copy_to_device(m.cu_scratch, m.cu_staging.data(),
                              m.cu_staging.size() * sizeof(std::int64_t));
    m.cu_uploaded = m.cu_staging;
  }
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

  const std::size_t batch = slots.size();
  if (batch == 0 || batch > static_cast<std::size_t>(num_slots())) {
    fail("decode: batch of " + std::to_string(batch) + " rows, expected 1.." +
         std::to_string(num_slots()) + " (runtime.max_sequences)");
  }
  if (tokens < 1 || tokens > kMaxDecodeTokens) {
    fail("decode: tokens " + std::to_string(tokens) + " per sequence, expected 1.." +
         std::to_string(kMaxDecodeTokens));
  }
  m.next_stamp();
  for (std::size_t j = 0; j < batch; ++j) {
    const int slot = slots[j];
    if (slot >= 0) {
      if (!slot_in_use(slot)) {
        fail("decode: row " + std::to_string(j) + " uses slot " + std::to_string(slot) +
             ", which is not an acquired slot");
      }
      if (m.seen_stamp[static_cast<std::size_t>(slot)] == m.stamp) {
        fail("decode: slot " + std::to_string(slot) + " appears twice in the batch");
      }
      m.seen_stamp[static_cast<std::size_t>(slot)] = m.stamp;
    }
  }
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

}  // namespace kda::engine
