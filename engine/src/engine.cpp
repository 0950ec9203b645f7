// engine/engine.cpp — planning, the arena, state slots, prefill/decode dispatch, synthetic runs.
#include "kda/engine/engine.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>

#include "kda/bf16.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/nvtx.hpp"

namespace kda::engine {

namespace {

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

// Every buffer of an engine, in the order the arena lays them out in `sum` mode.
planner::MemoryPlan make_plan(const ModelSpec& spec, Backend backend,
                              const std::vector<KdaLayer>& layers, std::int64_t synthetic_capacity) {
  planner::MemoryPlanner planner;
  for (const KdaLayer& layer : layers) layer.declare_buffers(planner, backend);

  const int last_step = std::max(0, static_cast<int>(layers.size()) - 1);
  auto scratch = [&](const std::string& name, std::uint64_t bytes) {
    planner::BufferRequest request;
    request.name = name;
    request.kind = planner::BufferKind::kScratch;
    request.bytes = bytes;
    request.first_step = 0;  // live while any layer runs
    request.last_step = last_step;
    planner.add(request);
  };
  const auto seqs = static_cast<std::uint64_t>(spec.runtime.max_sequences);
  // A batch of N sequences splits into at most N runs of consecutive slots; each run's cu_seqlens
  // has (its sequences + 1) entries: at most 2N in all.
  scratch("prefill.cu_seqlens", (seqs + 1) * sizeof(std::int64_t));
  // Slot indices, one buffer per kind of call, so that alternating prefill and decode batches do
  // not re-upload (and a captured graph replays without host-to-device copies).
  scratch("prefill.slots", seqs * sizeof(std::int32_t));
  scratch("decode.slots", seqs * sizeof(std::int32_t));
  if (backend == Backend::kCuda) scratch("engine.device_status", sizeof(std::uint32_t));

  if (synthetic_capacity > 0) {
    const auto tokens = static_cast<std::uint64_t>(synthetic_capacity);
    const auto H = static_cast<std::uint64_t>(spec.num_heads);
    const auto D = static_cast<std::uint64_t>(spec.head_dim);
    std::uint64_t per_token = 0, qkvg = 0, beta = 0;
    if (!detail::checked_mul(H, D * 2, &per_token) ||
        !detail::checked_mul(tokens, per_token, &qkvg) || !detail::checked_mul(tokens, H * 2, &beta)) {
      fail("synthetic inputs of " + std::to_string(tokens) + " tokens: byte count overflows 64 bits",
           StatusCode::kOverflow);
    }
    scratch("synthetic.q", qkvg);
    scratch("synthetic.k", qkvg);
    scratch("synthetic.v", qkvg);
    scratch("synthetic.g", qkvg);
    scratch("synthetic.beta", beta);
    scratch("synthetic.out", qkvg);
  }
  planner::PlanResult result = planner.plan(spec.runtime.workspace_plan);
  if (!result.ok) fail("memory plan for " + spec.name + ": " + result.error, StatusCode::kOverflow);
  return std::move(result.plan);
}

std::int64_t synthetic_capacity_for(const ModelSpec& spec, std::int64_t synthetic_tokens) {
  if (synthetic_tokens < 0) fail("synthetic_tokens must be >= 0, got " + std::to_string(synthetic_tokens));
  if (synthetic_tokens == 0) return 0;
  return std::max(synthetic_tokens, spec.runtime.max_sequences);
}

// splitmix64: fast, seedable, good enough for synthetic activations.
struct SplitMix {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float symmetric() { return static_cast<float>((next() >> 40) * (2.0 / 16777216.0) - 1.0); }
};

void fill_random(std::vector<std::uint16_t>* values, std::size_t count, std::uint64_t seed) {
  values->resize(count);
  SplitMix generator{seed};
  for (std::uint16_t& v : *values) v = float_to_bf16(generator.symmetric());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Backend resolve_backend(const ModelSpec& spec, BackendChoice choice) {
  switch (choice) {
    case BackendChoice::kCpu: return Backend::kCpu;
    case BackendChoice::kCuda: return Backend::kCuda;
    case BackendChoice::kAuto: break;
  }
  if (cuda_device_count() > 0 && can_implement(max_prefill_problem(spec), Backend::kCuda).ok() &&
      can_implement(max_decode_problem(spec), Backend::kCuda).ok()) {
    return Backend::kCuda;
  }
  return Backend::kCpu;
}

void Engine::ArenaDeleter::operator()(std::uint8_t* ptr) const noexcept {
  if (ptr == nullptr) return;
  if (backend == Backend::kCuda) {
    (void)device_free(ptr);  // nothing useful to do with a failure in a destructor
  } else {
    (void)munmap(ptr, bytes);
  }
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

planner::MemoryPlan Engine::plan_for(const ModelSpec& spec, Backend backend,
                                     std::int64_t synthetic_tokens) {
  const std::vector<KdaLayer> layers = make_layers(spec, false, 0);
  return make_plan(spec, backend, layers, synthetic_capacity_for(spec, synthetic_tokens));
}

Engine::Engine(ModelSpec spec, const EngineOptions& options)
    : spec_(std::move(spec)),
      backend_(resolve_backend(spec_, options.backend.value_or(spec_.runtime.backend))),
      stream_(options.stream),
      arena_(nullptr, ArenaDeleter{backend_}) {
  cpu_.num_threads = options.cpu_threads;
  check_pointers_ = options.check_pointers;
  unchecked_.check_pointers = false;
  const std::string where = spec_.name + " on " + to_string(backend_);
  if (backend_ == Backend::kCuda && cuda_device_count() == 0) {
    fail(where + ": no CUDA device" +
             (cuda_compiled() ? std::string() : std::string(" (built without CUDA)")),
         StatusCode::kBackendUnavailable);
  }
  if (const Status st = can_implement(max_prefill_problem(spec_), backend_); !st.ok()) {
    throw Error(st, where + ": prefill");
  }
  if (const Status st = can_implement(max_decode_problem(spec_), backend_); !st.ok()) {
    throw Error(st, where + ": decode");
  }

  layers_ = make_layers(spec_, true, options.seed);
  synthetic_capacity_ = synthetic_capacity_for(spec_, options.synthetic_tokens);
  plan_ = make_plan(spec_, backend_, layers_, synthetic_capacity_);

  // The one allocation.
  const std::uint64_t total = plan_.arena_bytes;
  if (total > std::numeric_limits<std::size_t>::max()) {
    fail(where + ": arena of " + std::to_string(total) + " bytes is too large", StatusCode::kOverflow);
  }
  if (backend_ == Backend::kCuda) {
    void* ptr = nullptr;
    throw_if_error(device_malloc(&ptr, static_cast<std::size_t>(total)),
                   ("allocating the arena (" + std::to_string(total) + " bytes)").c_str());
    arena_.reset(static_cast<std::uint8_t*>(ptr));
  } else {
    // Pages straight from the kernel (page-aligned, beyond any plan alignment): a destroyed engine
    // gives its arena back to the system at once, whatever malloc's thresholds would do.
    void* ptr = mmap(nullptr, static_cast<std::size_t>(total), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      fail(where + ": cannot allocate the arena of " + std::to_string(total) + " bytes",
           StatusCode::kInternal);
    }
    arena_ = std::unique_ptr<std::uint8_t, ArenaDeleter>(
        static_cast<std::uint8_t*>(ptr), ArenaDeleter{backend_, static_cast<std::size_t>(total)});
  }

  std::uint8_t* base = arena_.get();
  for (KdaLayer& layer : layers_) layer.bind(base, plan_, backend_, stream_);
  auto locate = [&](const char* name) -> void* {
    const planner::PlanEntry* entry = plan_.find(name);
    return entry == nullptr ? nullptr : base + entry->offset;
  };
  cu_scratch_ = static_cast<std::int64_t*>(locate("prefill.cu_seqlens"));
  prefill_slots_.device = static_cast<std::int32_t*>(locate("prefill.slots"));
  decode_slots_.device = static_cast<std::int32_t*>(locate("decode.slots"));
  device_status_ = static_cast<std::uint32_t*>(locate("engine.device_status"));
  if (device_status_ != nullptr) {
    throw_if_error(clear_device_status(device_status_, stream_), "clearing the device status word");
  }
  if (synthetic_capacity_ > 0) {
    synthetic_ = {locate("synthetic.q"), locate("synthetic.k"),    locate("synthetic.v"),
                  locate("synthetic.g"), locate("synthetic.beta"), locate("synthetic.out")};
  }

  slot_bytes_ = spec_.state_slot_bytes();
  const auto slots = static_cast<std::size_t>(spec_.runtime.max_sequences);
  slot_in_use_.assign(slots, 0);
  // Fresh slots start from zero: clear every pool once here, then per slot on acquire / reset.
  for (const KdaLayer& layer : layers_) {
    if (backend_ == Backend::kCuda) {
      throw_if_error(memset_device(layer.state_pool(), 0, layer.state_pool_bytes(), stream_),
                     "zeroing the state pools");
    } else {
      std::memset(layer.state_pool(), 0, static_cast<std::size_t>(layer.state_pool_bytes()));
    }
  }

  // Host staging sized once, so prefill and decode never allocate.
  cu_staging_.reserve(slots + 1);
  cu_uploaded_.reserve(slots + 1);
  seen_stamp_.assign(slots, 0);
  for (SlotStaging* staging : {&prefill_slots_, &decode_slots_}) {
    staging->host.reserve(slots);
    staging->uploaded.reserve(slots);
  }
  synchronize();
}

Engine::~Engine() {
  if (backend_ == Backend::kCuda && arena_) {
    (void)stream_synchronize(stream_);  // kernels may still use the arena
  }
}

const KdaLayer& Engine::layer(int kda_layer) const {
  check_layer(kda_layer);
  return layers_[static_cast<std::size_t>(kda_layer)];
}

void Engine::check_layer(int kda_layer) const {
  if (kda_layer < 0 || kda_layer >= num_layers()) {
    fail("KDA layer " + std::to_string(kda_layer) + " is out of range [0, " +
         std::to_string(num_layers()) +
         "): the argument is the KDA index (0-based position in kda_layers), not the model layer");
  }
}

std::uint8_t* Engine::slot_state(int kda_layer, int slot) const noexcept {
  return static_cast<std::uint8_t*>(layers_[static_cast<std::size_t>(kda_layer)].state_pool()) +
         static_cast<std::uint64_t>(slot) * slot_bytes_;
}

void Engine::copy_in(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (backend_ == Backend::kCuda) {
    throw_if_error(memcpy_to_device(dst, src, bytes, stream_), "copying to the device");
  } else {
    std::memcpy(dst, src, bytes);
  }
}

void Engine::synchronize() const {
  if (backend_ == Backend::kCuda) throw_if_error(stream_synchronize(stream_), "synchronizing");
}

void Engine::check_on_device(const KdaLayer& layer, const char* what, const Status& callers) const {
  if (!callers.ok()) throw Error(callers, layer.label() + " " + what);
  // The operator runs with its pointer checks off, so its own check of the arena's buffers (states,
  // parameters, workspace) is gone too: one query here still catches a call made while another
  // device is current.
  const Status st = check_device_pointer(device_status_, sizeof(std::uint32_t), "the engine's arena");
  if (!st.ok()) throw Error(st, layer.label() + " " + what);
}

void Engine::check_device_status() {
  if (device_status_ == nullptr) return;
  const Status st = kda::check_device_status(device_status_, stream_);
  if (st.ok()) return;
  if (st.code() == StatusCode::kInvalidArgument) {  // bits were set: clear them for the next check
    throw_if_error(clear_device_status(device_status_, stream_), "clearing the device status word");
  }
  throw Error(st, spec_.name + ": device status");
}

// ---- state slots ---------------------------------------------------------------------------

int Engine::free_slots() const noexcept {
  return static_cast<int>(std::count(slot_in_use_.begin(), slot_in_use_.end(), 0));
}

bool Engine::slot_in_use(int slot) const noexcept {
  return slot >= 0 && slot < num_slots() && slot_in_use_[static_cast<std::size_t>(slot)] != 0;
}

void Engine::zero_slot(int slot) {
  for (int l = 0; l < num_layers(); ++l) {
    if (backend_ == Backend::kCuda) {
      throw_if_error(memset_device(slot_state(l, slot), 0, slot_bytes_, stream_), "zeroing a slot");
    } else {
      std::memset(slot_state(l, slot), 0, static_cast<std::size_t>(slot_bytes_));
    }
  }
}

int Engine::acquire_slot() {
  for (int slot = 0; slot < num_slots(); ++slot) {
    if (slot_in_use_[static_cast<std::size_t>(slot)] == 0) {
      zero_slot(slot);
      slot_in_use_[static_cast<std::size_t>(slot)] = 1;
      return slot;
    }
  }
  fail("all " + std::to_string(num_slots()) +
           " state slots are in use (runtime.max_sequences); release one first",
       StatusCode::kInvalidArgument);
}

void Engine::release_slot(int slot) {
  if (!slot_in_use(slot)) fail("release_slot: slot " + std::to_string(slot) + " is not acquired");
  slot_in_use_[static_cast<std::size_t>(slot)] = 0;
}

void Engine::reset_slot(int slot) {
  if (!slot_in_use(slot)) fail("reset_slot: slot " + std::to_string(slot) + " is not acquired");
  zero_slot(slot);
}

void Engine::read_slot_state(int kda_layer, int slot, void* host_dst) const {
  check_layer(kda_layer);
  if (slot < 0 || slot >= num_slots()) fail("read_slot_state: slot " + std::to_string(slot) + " out of range");
  if (backend_ == Backend::kCuda) {
    throw_if_error(memcpy_to_host(host_dst, slot_state(kda_layer, slot), slot_bytes_, stream_),
                   "reading a slot");
    synchronize();
  } else {
    std::memcpy(host_dst, slot_state(kda_layer, slot), static_cast<std::size_t>(slot_bytes_));
  }
}

void Engine::write_slot_state(int kda_layer, int slot, const void* host_src) {
  check_layer(kda_layer);
  if (slot < 0 || slot >= num_slots()) fail("write_slot_state: slot " + std::to_string(slot) + " out of range");
  copy_in(slot_state(kda_layer, slot), host_src, static_cast<std::size_t>(slot_bytes_));
  synchronize();
}

// ---- forward -------------------------------------------------------------------------------

void Engine::prefill(int kda_layer, const LayerInputs& inputs, void* out,
                     const std::vector<int>& slots, const std::vector<std::int64_t>& cu_seqlens) {
  check_layer(kda_layer);
  const KdaLayer& layer = layers_[static_cast<std::size_t>(kda_layer)];
  KDA_NVTX_RANGE(layer.nvtx_name().c_str());

  const std::size_t n = slots.size();
  if (n == 0 || n > static_cast<std::size_t>(num_slots())) {
    fail("prefill: " + std::to_string(n) + " sequences, expected 1.." + std::to_string(num_slots()) +
         " (runtime.max_sequences)");
  }
  if (cu_seqlens.size() != n + 1) {
    fail("prefill: cu_seqlens has " + std::to_string(cu_seqlens.size()) + " entries, expected " +
         std::to_string(n + 1) + " (sequences + 1)");
  }
  if (cu_seqlens[0] != 0) fail("prefill: cu_seqlens[0] is " + std::to_string(cu_seqlens[0]) + ", expected 0");
  for (std::size_t j = 0; j < n; ++j) {
    if (cu_seqlens[j + 1] < cu_seqlens[j]) {
      fail("prefill: cu_seqlens decreases at index " + std::to_string(j + 1) + " (" +
           std::to_string(cu_seqlens[j]) + " then " + std::to_string(cu_seqlens[j + 1]) + ")");
    }
  }
  if (cu_seqlens[n] > spec_.runtime.max_tokens) {
    fail("prefill: " + std::to_string(cu_seqlens[n]) + " tokens exceed runtime.max_tokens " +
         std::to_string(spec_.runtime.max_tokens));
  }
  if (++stamp_ == 0) {  // wrapped: restart the stamps
    std::fill(seen_stamp_.begin(), seen_stamp_.end(), 0u);
    stamp_ = 1;
  }
  for (std::size_t j = 0; j < n; ++j) {
    const int slot = slots[j];
    if (!slot_in_use(slot)) {
      fail("prefill: sequence " + std::to_string(j) + " uses slot " + std::to_string(slot) +
           ", which is not an acquired slot");
    }
    if (seen_stamp_[static_cast<std::size_t>(slot)] == stamp_) {
      fail("prefill: slot " + std::to_string(slot) + " appears twice in the batch");
    }
    seen_stamp_[static_cast<std::size_t>(slot)] = stamp_;
  }

  // The caller's buffers over the whole batch (T tokens). The operator's forward refuses an out
  // that overlaps an input before it writes anything; on CUDA they are checked here, once, for
  // device memory large enough, before anything is enqueued, and the forward skips its own
  // per-call pointer checks.
  const Problem problem = layer.prefill_problem(cu_seqlens[n], static_cast<std::int64_t>(n));
  Tensors t = caller_tensors<Tensors>(inputs, out);
  if (backend_ == Backend::kCuda && check_pointers_) {
    check_on_device(layer, "prefill", check_device_pointers(problem, t));
  }

  // One forward for the whole batch: each sequence reads and writes its state through its slot
  // index in the layer's pool (Problem::num_state_slots), whatever the slots are.
  cu_staging_.assign(cu_seqlens.begin(), cu_seqlens.end());  // capacity reserved: no allocation
  if (cu_staging_ != cu_uploaded_) {
    KDA_NVTX_RANGE("prefill.stage_cu_seqlens");
    copy_in(cu_scratch_, cu_staging_.data(), cu_staging_.size() * sizeof(std::int64_t));
    cu_uploaded_ = cu_staging_;
  }
  stage_slots(slots, &prefill_slots_);
  t.cu_seqlens = cu_scratch_;
  t.cu_seqlens_host = cu_staging_.data();
  t.initial_state = layer.state_pool();
  t.final_state = layer.state_pool();  // in place
  t.state_slots = prefill_slots_.device;  // checked above: acquired, no duplicates
  t.device_status = device_status_;
  layer.forward(problem, t, cpu_, stream_, unchecked_);
}

void Engine::stage_slots(const std::vector<int>& slots, SlotStaging* staging) {
  staging->host.clear();
  for (const int slot : slots) staging->host.push_back(slot < 0 ? -1 : slot);
  if (staging->host != staging->uploaded) {
    KDA_NVTX_RANGE("engine.stage_slots");
    copy_in(staging->device, staging->host.data(), staging->host.size() * sizeof(std::int32_t));
    staging->uploaded = staging->host;  // capacity reserved: no allocation
  }
}

void Engine::decode(int kda_layer, const LayerInputs& inputs, void* out,
                    const std::vector<int>& slots, int tokens) {
  check_layer(kda_layer);
  const KdaLayer& layer = layers_[static_cast<std::size_t>(kda_layer)];
  KDA_NVTX_RANGE(layer.nvtx_name().c_str());

  const std::size_t batch = slots.size();
  if (batch == 0 || batch > static_cast<std::size_t>(num_slots())) {
    fail("decode: batch of " + std::to_string(batch) + " rows, expected 1.." +
         std::to_string(num_slots()) + " (runtime.max_sequences)");
  }
  if (tokens < 1 || tokens > kda::kMaxDecodeTokens) {
    fail("decode: tokens " + std::to_string(tokens) + " per sequence, expected 1.." +
         std::to_string(kda::kMaxDecodeTokens));
  }
  if (++stamp_ == 0) {
    std::fill(seen_stamp_.begin(), seen_stamp_.end(), 0u);
    stamp_ = 1;
  }
  for (std::size_t j = 0; j < batch; ++j) {
    const int slot = slots[j];
    if (slot >= 0) {
      if (!slot_in_use(slot)) {
        fail("decode: row " + std::to_string(j) + " uses slot " + std::to_string(slot) +
             ", which is not an acquired slot");
      }
      if (seen_stamp_[static_cast<std::size_t>(slot)] == stamp_) {
        fail("decode: slot " + std::to_string(slot) + " appears twice in the batch");
      }
      seen_stamp_[static_cast<std::size_t>(slot)] = stamp_;
    }
  }
  // The caller's buffers, before anything is enqueued (see prefill).
  const DecodeProblem problem = layer.decode_problem(static_cast<std::int64_t>(batch), tokens);
  DecodeTensors t = caller_tensors<DecodeTensors>(inputs, out);
  if (backend_ == Backend::kCuda && check_pointers_) {
    check_on_device(layer, "decode", check_device_pointers(problem, t));
  }
  stage_slots(slots, &decode_slots_);
  t.slots = decode_slots_.device;
  t.device_status = device_status_;
  layer.decode(problem, t, cpu_, stream_, unchecked_);
}

// ---- synthetic inputs ----------------------------------------------------------------------

void Engine::generate_synthetic_inputs(std::uint64_t seed) {
  if (synthetic_capacity_ == 0) {
    fail("synthetic inputs were not planned (EngineOptions::synthetic_tokens is 0)");
  }
  const auto tokens = static_cast<std::size_t>(synthetic_capacity_);
  const auto H = static_cast<std::size_t>(spec_.num_heads);
  const auto D = static_cast<std::size_t>(spec_.head_dim);
  // One stream per tensor, so changing the capacity does not reshuffle the others.
  fill_random(&synthetic_host_.q, tokens * H * D, seed * 8 + 1);
  fill_random(&synthetic_host_.k, tokens * H * D, seed * 8 + 2);
  fill_random(&synthetic_host_.v, tokens * H * D, seed * 8 + 3);
  fill_random(&synthetic_host_.g, tokens * H * D, seed * 8 + 4);
  fill_random(&synthetic_host_.beta, tokens * H, seed * 8 + 5);
  auto upload = [&](void* dst, const std::vector<std::uint16_t>& src) {
    copy_in(dst, src.data(), src.size() * sizeof(std::uint16_t));
  };
  upload(synthetic_.q, synthetic_host_.q);
  upload(synthetic_.k, synthetic_host_.k);
  upload(synthetic_.v, synthetic_host_.v);
  upload(synthetic_.g, synthetic_host_.g);
  upload(synthetic_.beta, synthetic_host_.beta);
  synchronize();
}

LayerInputs Engine::synthetic_inputs(std::int64_t token_offset) const {
  if (synthetic_capacity_ == 0) fail("synthetic inputs were not planned");
  if (token_offset < 0 || token_offset > synthetic_capacity_) {
    fail("synthetic token offset " + std::to_string(token_offset) + " is out of range [0, " +
         std::to_string(synthetic_capacity_) + "]");
  }
  const auto t0 = static_cast<std::uint64_t>(token_offset);
  const auto H = static_cast<std::uint64_t>(spec_.num_heads);
  const auto D = static_cast<std::uint64_t>(spec_.head_dim);
  auto at = [](void* base, std::uint64_t bytes) -> const void* {
    return static_cast<const std::uint8_t*>(base) + bytes;
  };
  return {at(synthetic_.q, t0 * H * D * 2), at(synthetic_.k, t0 * H * D * 2),
          at(synthetic_.v, t0 * H * D * 2), at(synthetic_.g, t0 * H * D * 2),
          at(synthetic_.beta, t0 * H * 2)};
}

RunReport Engine::run_synthetic(const RunOptions& options) {
  if (synthetic_capacity_ == 0) fail("run_synthetic: synthetic inputs were not planned");
  if (options.sequences < 1 || options.sequences > free_slots()) {
    fail("run_synthetic: " + std::to_string(options.sequences) + " sequences, but " +
         std::to_string(free_slots()) + " of " + std::to_string(num_slots()) +
         " state slots are free (runtime.max_sequences)");
  }
  const std::int64_t token_limit = std::min(synthetic_capacity_, spec_.runtime.max_tokens);
  if (options.tokens < 0 || options.tokens > token_limit) {
    fail("run_synthetic: " + std::to_string(options.tokens) + " tokens, expected 0.." +
         std::to_string(token_limit));
  }
  if (options.decode_steps < 0) fail("run_synthetic: negative decode_steps");

  RunReport report;
  report.backend = backend_;
  report.tokens = options.tokens;
  report.sequences = options.sequences;

  const auto upload_start = std::chrono::steady_clock::now();
  generate_synthetic_inputs(options.seed);
  report.upload_seconds = seconds_since(upload_start);

  const auto n = static_cast<std::size_t>(options.sequences);
  std::vector<std::int64_t> cu(n + 1, 0);
  for (std::size_t j = 0; j < n; ++j) {
    const std::int64_t length = options.tokens / options.sequences +
                                (static_cast<std::int64_t>(j) < options.tokens % options.sequences);
    cu[j + 1] = cu[j] + length;
  }
  try {
    for (std::size_t j = 0; j < n; ++j) report.slots.push_back(acquire_slot());
    synchronize();
    const int total_steps = num_layers() + options.decode_steps;
    int done = 0;
    for (int l = 0; l < num_layers(); ++l) {
      const auto start = std::chrono::steady_clock::now();
      prefill(l, synthetic_inputs(0), synthetic_.out, report.slots, cu);
      synchronize();
      report.layer_seconds.push_back(seconds_since(start));
      report.prefill_seconds += report.layer_seconds.back();
      if (options.progress) options.progress(++done, total_steps);
    }
    // Each step reads the next window of `n` synthetic tokens, wrapping around.
    const std::int64_t windows = synthetic_capacity_ - options.sequences + 1;
    for (int step = 0; step < options.decode_steps; ++step) {
      const std::int64_t offset = (static_cast<std::int64_t>(step) * options.sequences) % windows;
      const LayerInputs inputs = synthetic_inputs(offset);
      const auto start = std::chrono::steady_clock::now();
      for (int l = 0; l < num_layers(); ++l) decode(l, inputs, synthetic_.out, report.slots, 1);
      synchronize();
      report.decode_step_seconds.push_back(seconds_since(start));
      if (options.progress) options.progress(++done, total_steps);
    }
  } catch (...) {
    for (const int slot : report.slots) release_slot(slot);
    throw;
  }
  if (options.release_slots) {
    for (const int slot : report.slots) release_slot(slot);
  }
  return report;
}

}  // namespace kda::engine
