// engine/runtime/src/engine.cpp — planning, the arena, state slots, prefill/decode dispatch.
//
// Everything backend-specific (memory, copies, the operator's entry points, the device status
// word, pointer checks) goes through one EngineBackend (backend.hpp); this file never asks which
// backend it runs on.
#include "kda/engine/engine.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>

#include "backend.hpp"
#include "engine_layer.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/engine/checkpoint.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"
#include "kda/nvtx.hpp"

namespace kda::engine {

namespace {

[[noreturn]] void fail(const std::string& what, StatusCode code = StatusCode::kInvalidArgument) {
  throw Error(code, what);
}

// What a context group needs of the model: every head on each rank, and an f32 state (the ranks'
// segment transitions are composed in fp32). Creation and plan_for ask the same.
bool context_parallel_fits(const ModelSpec& spec) {
  return spec.runtime.tp_size == 1 && spec.runtime.state_dtype == DType::kF32;
}

// What the loader checks of a description, checked again for a spec built or edited in code (and
// the layer mode, which EngineOptions may set): the constructor and plan_for, before anything is
// sized by it.
void check_spec(const ModelSpec& spec) {
  if (spec.runtime.layer_mode != LayerMode::kWhole &&
      spec.runtime.layer_mode != LayerMode::kCoreOnly) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": the layer mode (runtime.layers, EngineOptions::layer_mode) is " +
                    std::to_string(static_cast<int>(spec.runtime.layer_mode)) +
                    ", expected kWhole or kCoreOnly");
  }
  // A slot keeps W - 1 columns of conv state a projection: none at W = 1, which the engine's
  // slots (their pools, reads, writes and copies) do not represent.
  if (spec.runtime.layer_mode == LayerMode::kWhole && spec.short_conv_kernel_size < 2) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": short_conv_kernel_size " +
                    std::to_string(spec.short_conv_kernel_size) +
                    " leaves no conv state, which a whole-layer engine's slots need: 2.." +
                    std::to_string(layer::kMaxConvWidth) +
                    " (the cores alone, runtime.layers: core, take any width)");
  }
  // A spec built in code skips the loader's checks: the layers divide the heads by tp_size, and
  // the slots are int indices.
  if (spec.runtime.max_tokens < 1) {
    throw Error(StatusCode::kInvalidArgument, spec.source + ": runtime.max_tokens " +
                                                  std::to_string(spec.runtime.max_tokens) +
                                                  " is below 1");
  }
  if (spec.runtime.max_sequences < 1 ||
      spec.runtime.max_sequences > std::numeric_limits<int>::max()) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": runtime.max_sequences " +
                    std::to_string(spec.runtime.max_sequences) +
                    " is not in [1, 2147483647] (slots are int indices)");
  }
  if (spec.runtime.tp_size < 1 || spec.num_heads % spec.runtime.tp_size != 0) {
    throw Error(StatusCode::kInvalidArgument, spec.source + ": runtime.tp_size " +
                                                  std::to_string(spec.runtime.tp_size) +
                                                  " does not divide linear_attn_config.num_heads " +
                                                  std::to_string(spec.num_heads) +
                                                  " (each rank holds num_heads / tp_size heads)");
  }
  if (spec.runtime.tp_rank < 0 || spec.runtime.tp_rank >= spec.runtime.tp_size) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": runtime.tp_rank " + std::to_string(spec.runtime.tp_rank) +
                    " is not in [0, tp_size " + std::to_string(spec.runtime.tp_size) + ")");
  }
  if (spec.runtime.layer_mode == LayerMode::kCoreOnly && spec.runtime.tp_size != 1) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": runtime.tp_size " + std::to_string(spec.runtime.tp_size) +
                    " needs whole layers (runtime.layers: whole): a core-only engine holds every "
                    "head");
  }
  // The loader takes 1 or 2 records regions and 0..16 verify tokens; both size the arena's records.
  if (spec.runtime.record_regions < 1 || spec.runtime.record_regions > 2) {
    throw Error(StatusCode::kInvalidArgument, spec.source + ": runtime.record_regions is " +
                                                  std::to_string(spec.runtime.record_regions) +
                                                  ", expected 1 or 2");
  }
  if (spec.runtime.max_verify_tokens < 0 || spec.runtime.max_verify_tokens > kMaxDecodeTokens) {
    throw Error(StatusCode::kInvalidArgument, spec.source + ": runtime.max_verify_tokens is " +
                                                  std::to_string(spec.runtime.max_verify_tokens) +
                                                  ", expected 0.." +
                                                  std::to_string(kMaxDecodeTokens));
  }
  // The KDA layers: model layers (0-based), ascending without repeats, as the loader lists them;
  // kda_layers, where given, the same 1-based.
  const std::vector<int>& indices = spec.kda_layer_indices;
  for (std::size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || indices[i] >= spec.num_hidden_layers ||
        (i > 0 && indices[i] <= indices[i - 1])) {
      throw Error(StatusCode::kInvalidArgument,
                  spec.source + ": kda_layer_indices[" + std::to_string(i) + "] is " +
                      std::to_string(indices[i]) + ", expected ascending model layers in [0, " +
                      "num_hidden_layers " + std::to_string(spec.num_hidden_layers) +
                      ") without repeats");
    }
  }
  if (!spec.kda_layers.empty()) {
    bool same = spec.kda_layers.size() == indices.size();
    for (std::size_t i = 0; same && i < indices.size(); ++i) {
      same = spec.kda_layers[i] == indices[i] + 1;
    }
    if (!same) {
      throw Error(StatusCode::kInvalidArgument,
                  spec.source +
                      ": kda_layers (1-based) and kda_layer_indices (0-based) name "
                      "different layers");
    }
  }
}

// The layers of `spec` on `backend`, sizes only: what the plan needs.
std::vector<std::unique_ptr<EngineLayer>> make_layers(const ModelSpec& spec, Backend backend) {
  std::vector<std::unique_ptr<EngineLayer>> layers;
  layers.reserve(spec.kda_layer_indices.size());
  for (std::size_t i = 0; i < spec.kda_layer_indices.size(); ++i) {
    layers.push_back(std::make_unique<EngineLayer>(spec, static_cast<int>(i), backend));
  }
  return layers;
}

// Reads (or seeds) each layer's weights, one layer at a time, into its bound buffers: whole
// layers their weight image and gate parameters, cores their gate parameters alone. Tensor names
// are the spec's tensor prefix + the layer's names.
void load_layers(const ModelSpec& spec, std::uint64_t seed,
                 const std::vector<std::unique_ptr<EngineLayer>>& layers) {
  const bool whole = spec.runtime.layer_mode == LayerMode::kWhole;
  std::unique_ptr<Checkpoint> checkpoint;
  if (!spec.weights.empty()) {
    check_weights_file(spec);
    checkpoint = std::make_unique<Checkpoint>(Checkpoint::open(spec.weights));
  }
  const layer::Config config = layer_config(spec);
  for (const auto& layer : layers) {
    const int index = layer->info().model_layer - 1;  // checkpoints number layers from 0
    if (whole) {
      layer::Weights weights;
      try {
        weights = checkpoint ? load_layer_weights(*checkpoint, index, config, spec.tensor_prefix)
                             : layer::random_weights(config, seed, index);
      } catch (const Error& e) {
        throw Error(e.code(), spec.source + ": weights of layer " + std::to_string(index + 1) +
                                  ": " + e.what());
      }
      layer->load(weights);
    } else if (checkpoint) {
      layer->load(load_gate_parameters(*checkpoint, index, spec.num_heads, spec.head_dim,
                                       spec.tensor_prefix),
                  checkpoint->path());
    } else {
      layer->load(layer::random_gate_parameters(seed, index, spec.num_heads, spec.head_dim),
                  "random (seed " + std::to_string(seed) + ")");
    }
  }
}

// The engine's own buffers besides the layers': handles into the plan.
struct EngineBuffers {
  planner::BufferHandle cu_seqlens, prefill_slots, decode_slots, copy_src, copy_dst, reset_slot,
      device_status;
  // Context parallelism: this rank's transition and every rank's (context.transitions), and the
  // operator's workspace for computing one (context.workspace).
  planner::BufferHandle context_transitions, context_workspace;
  // Whole layers: this rank's conv history block and every rank's (context.conv_history).
  planner::BufferHandle context_conv;
};

// A context-parallel prefill of whole layers all-gathers one conv history block per rank: a
// 16-byte header (int64: the rank's tokens) and the three conv states (q, k, v: bf16 [Cl, W-1]
// each) that a zero conv state becomes over the rank's last min(tokens, W-1) pre-conv inputs —
// those inputs right-aligned, zeros before them where the rank holds fewer than W-1 tokens.
constexpr std::uint64_t kConvHistoryHeader = 16;

// Elements of one projection's conv state of one sequence: Cl * (W - 1).
std::uint64_t conv_state_elements(const ModelSpec& spec) {
  const layer::Config c = layer_config(spec);
  return static_cast<std::uint64_t>(c.local_channels()) *
         static_cast<std::uint64_t>(c.conv_width - 1);
}

// Bytes of one rank's conv history block, a multiple of 16 (each rank's block aligned alike).
std::uint64_t conv_history_block_bytes(const ModelSpec& spec) {
  return (kConvHistoryHeader + 3 * conv_state_elements(spec) * sizeof(bf16_bits) + 15) / 16 * 16;
}

// Floats of one rank's transitions of one layer: P^T [H, K, K] then H^T [H, V, K].
std::uint64_t transition_floats(const ModelSpec& spec) {
  const auto H = static_cast<std::uint64_t>(spec.num_heads);
  const auto D = static_cast<std::uint64_t>(spec.head_dim);
  return H * (D * D + D * D);
}

// A range of one sequence's tokens without states: the problem of its segment transition.
Problem transition_problem(Problem p) {
  p.initial_state_dtype = DType::kNone;
  p.final_state_dtype = DType::kNone;
  p.num_state_slots = 0;
  return p;
}

// Every buffer of an engine, in the order the arena lays them out in `sum` mode. The layers keep
// their handles; the engine's come back in `buffers`.
planner::MemoryPlan make_plan(const ModelSpec& spec, Backend backend,
                              const std::vector<std::unique_ptr<EngineLayer>>& layers,
                              int context_ranks, EngineBuffers* buffers) {
  planner::MemoryPlanner planner;
  // Each layer's workspace holds every intermediate of the layer: live during that layer only, so
  // `reuse` lays all layers' over the same bytes.
  for (const auto& layer : layers) layer->declare_buffers(planner);
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
  // A host-span slot copy's pairs, apart from the forwards' lists, which captured host-span
  // forwards read at replay.
  buffers->copy_src = scratch("copy.src", seqs * sizeof(std::int32_t));
  buffers->copy_dst = scratch("copy.dst", seqs * sizeof(std::int32_t));
  // The one slot acquire_slot and reset_slot zero, apart from every list above.
  buffers->reset_slot = scratch("reset.slot", sizeof(std::int32_t));
  buffers->device_status = backend_has_device_status(backend)
                               ? scratch("engine.device_status", sizeof(std::uint32_t))
                               : planner::BufferHandle{};

  if (context_ranks > 0 && !layers.empty()) {
    buffers->context_transitions =
        scratch("context.transitions", (1 + static_cast<std::uint64_t>(context_ranks)) *
                                           transition_floats(spec) * sizeof(float));
    std::size_t bytes = 0;
    const Problem range =
        transition_problem(layers.front()->prefill_problem(spec.runtime.max_tokens, 1));
    if (const Status st = transition_workspace_size(range, backend, &bytes); !st.ok()) {
      throw Error(st, spec.name + ": context-parallel transition workspace");
    }
    buffers->context_workspace = scratch("context.workspace", bytes);
    if (spec.runtime.layer_mode == LayerMode::kWhole) {
      buffers->context_conv =
          scratch("context.conv_history",
                  (1 + static_cast<std::uint64_t>(context_ranks)) * conv_history_block_bytes(spec));
    }
  }
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
  Communicator* communicator = nullptr;   // EngineOptions::communicator
  Communicator* context_group = nullptr;  // EngineOptions::context_group
  float* context_transitions = nullptr;   // context.transitions: mine, then every rank's
  void* context_workspace = nullptr;
  std::uint64_t context_workspace_bytes = 0;
  // Whole layers: context.conv_history (mine, then every rank's), and host copies sized once:
  // every rank's blocks, and two conv states of the three projections (the one at this range's
  // start, and the running one that ends as the sequence's last).
  std::uint8_t* context_conv = nullptr;
  std::uint64_t context_conv_block = 0;
  std::vector<std::uint8_t> context_conv_blocks;
  std::vector<bf16_bits> context_conv_states;
  std::int64_t context_tokens = 0;  // the header's source (a copy is enqueued from it)
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
  std::vector<std::unique_ptr<EngineLayer>> layers;
  bool whole = false;  // runtime.layers: whole
  std::string weights_origin;
  std::uint64_t weight_bytes = 0;
  int cpu_threads = 0;
  planner::MemoryPlan plan;
  BackendBuffer arena;
  std::uint64_t slot_bytes = 0;
  std::uint64_t conv_slot_bytes = 0;  // whole layers: one projection's conv state of one slot
  std::vector<char> slot_in_use;
  int null_slot = -1;  // EngineOptions::null_slot, or -1: never acquired, padding in every batch

  // Prefill staging: the batch's int64 cu_seqlens.
  std::int64_t* cu_scratch = nullptr;
  std::vector<std::int64_t> cu_staging;   // host, capacity fixed at construction
  std::vector<std::int64_t> cu_uploaded;  // what cu_scratch holds now (skip repeat uploads)
  std::vector<unsigned> seen_stamp;       // duplicate-slot detection without clearing
  unsigned stamp = 0;
  SlotStaging prefill_slots, decode_slots, copy_src, copy_dst, reset_slot;

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
  // A batch entry that is padding: negative, or the null slot.
  bool padding(int slot) const noexcept { return slot < 0 || slot == null_slot; }
  bool in_use(int slot) const noexcept {
    return slot >= 0 && slot < num_slots() && slot_in_use[static_cast<std::size_t>(slot)] != 0;
  }

  void check_layer(int kda_index) const {
    if (kda_index < 0 || kda_index >= num_layers()) {
      fail("KDA layer " + std::to_string(kda_index) + " is out of range [0, " +
           std::to_string(num_layers()) +
           "): the argument is the KDA index (0-based position in kda_layers), not the model "
           "layer");
    }
  }

  std::uint8_t* slot_state(int kda_index, int slot) const noexcept {
    return static_cast<std::uint8_t*>(layers[static_cast<std::size_t>(kda_index)]->state_pool()) +
           static_cast<std::uint64_t>(slot) * slot_bytes;
  }

  std::uint8_t* slot_conv_state(int kda_index, int slot, int projection) const noexcept {
    return static_cast<std::uint8_t*>(
               layers[static_cast<std::size_t>(kda_index)]->conv_pool(projection)) +
           static_cast<std::uint64_t>(slot) * conv_slot_bytes;
  }

  // Every entry slot `slot` has, in slot_pools' order.
  template <typename Fn>
  void for_each_slot_entry(int slot, Fn fn) const {
    for (const SlotPool& pool : slot_pools) {
      fn(static_cast<std::uint8_t*>(pool.base) +
             static_cast<std::uint64_t>(slot) * pool.entry_bytes,
         pool.entry_bytes);
    }
  }

  // The sequence-state block's header for this engine, and the check of a block's (below).
  SequenceStateHeader sequence_state_header(std::uint64_t payload_bytes) const;
  void check_sequence_state_header(const SequenceStateHeader& got,
                                   std::uint64_t payload_bytes) const;

  // A slot-state or sequence-state call's slot and host buffer; a sequence state's size is checked
  // apart (a block to write has its header checked first, so that a block of another layout is
  // named by the fields that differ).
  void check_sequence_state_buffer(const char* what, int slot, const void* host) const {
    if (slot < 0 || slot >= num_slots()) {
      fail(std::string(what) + ": slot " + std::to_string(slot) + " out of range");
    }
    if (host == nullptr) fail(std::string(what) + ": the host buffer is null");
  }
  void check_sequence_state_size(const char* what, std::uint64_t bytes,
                                 std::uint64_t expected) const {
    if (bytes != expected) {
      fail(std::string(what) + ": " + std::to_string(bytes) + " bytes, the sequence's states are " +
           std::to_string(expected) + " (sequence_state_bytes)");
    }
  }

  // One slot zeroed in every pool by the zeroing's one launch, not a memset a pool (80 calls for
  // Kimi-Linear-48B's 20 layers: PERFORMANCE.md, "Copying states between slots").
  void zero_slot(const std::string& call, int slot) {
    const int one[1] = {slot};
    stage_slots(Span<const int>(one, 1), &reset_slot);
    run_copy(call, 1, nullptr, reset_slot.device);
  }

  void check_whole(const char* what) const {
    if (!whole) {
      fail(std::string(what) + ": " + spec.name +
           " runs the KDA core only (runtime.layers: core); hidden states need whole layers "
           "(runtime.layers: whole, the default)");
    }
  }

  // The checks of read_slot_conv_state / write_slot_conv_state, one message each.
  void check_conv_state_access(const char* what, int kda_index, int slot, int projection,
                               const void* host) const {
    check_layer(kda_index);
    check_whole(what);
    check_sequence_state_buffer(what, slot, host);
    if (projection < 0 || projection > 2) {
      fail(std::string(what) + ": projection " + std::to_string(projection) +
           " is not 0 (q), 1 (k) or 2 (v)");
    }
  }

  // A prefill batch: 1..max_sequences sequences on distinct acquired slots (negative: padding),
  // cu_seqlens 0, non-decreasing, at most max_tokens.
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
    check_span_data(call, slots, "slots");
    check_span_data(call, cu_seqlens, "cu_seqlens");
    // The bound first: a total past it would be refused as such, not by the sizes it implies.
    if (cu_seqlens[n] > spec.runtime.max_tokens) {
      fail(call + ": " + std::to_string(cu_seqlens[n]) + " tokens exceed runtime.max_tokens " +
           std::to_string(spec.runtime.max_tokens));
    }
    if (const Status st =
            validate_cu_seqlens(cu_seqlens.data(), static_cast<std::int64_t>(n), cu_seqlens[n]);
        !st.ok()) {
      fail(call + ": " + st.message());
    }
    claim_slots(call, "sequence", slots.data(), n);
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
    if (tokens < 1 || tokens > static_cast<int>(kMaxDecodeTokens)) {
      fail(call + ": tokens " + std::to_string(tokens) + " per sequence, expected 1.." +
           std::to_string(kMaxDecodeTokens));
    }
    check_span_data(call, slots, "slots");
    claim_slots(call, "row", slots.data(), batch);
  }

  // A state written into a free slot would be lost (acquire_slot zeroes the slot): a caller's
  // mistake. The null slot takes one (no row reads it: a test can fill it to show none writes it).
  void check_acquired_for_write(const char* call, int slot) const {
    if (!in_use(slot) && slot != null_slot) {
      fail(std::string(call) + ": slot " + std::to_string(slot) + " is not acquired");
    }
  }

  // A host span of entries has its data (Span{nullptr, n} is a caller's mistake, not an empty
  // list).
  template <typename T>
  static void check_span_data(const std::string& call, Span<T> span, const char* name) {
    if (!span.empty() && span.data() == nullptr) {
      fail(call + ": " + name + " is null but has " + std::to_string(span.size()) + " entries");
    }
  }

  // A records region named by a call (`name` its field): below runtime.record_regions.
  void check_region(const std::string& call, const char* name, int region) const {
    const int regions = spec.runtime.record_regions;
    if (region < 0 || region >= regions) {
      fail(call + ": " + name + " " + std::to_string(region) + ", expected 0.." +
           std::to_string(regions - 1) + " (runtime.record_regions " + std::to_string(regions) +
           ")");
    }
  }

  // Caller-owned batch metadata: the bounds, and the metadata arrays usable by the backend. Where
  // the backend's memory is the host's (the CPU), also their contents: the slots acquired and
  // distinct, cu_seqlens well formed; on CUDA the kernels check what they can (BatchMetadata).
  void check_metadata(const char* what, const BatchMetadata& b, bool decode) {
    const std::string call = what;
    if (decode ? b.decode_tokens <= 0 : b.decode_tokens != 0) {
      fail(call + ": decode_tokens " + std::to_string(b.decode_tokens) +
           (decode ? ", expected 1.." + std::to_string(kMaxDecodeTokens) + " for a decode"
                   : ", expected 0 for a prefill"));
    }
    if (b.sequences < 1 || b.sequences > num_slots()) {
      fail(call + ": " + std::to_string(b.sequences) + " sequences, expected 1.." +
           std::to_string(num_slots()) + " (runtime.max_sequences)");
    }
    if (decode && (b.decode_tokens > static_cast<int>(kMaxDecodeTokens) ||
                   b.tokens != b.sequences * b.decode_tokens)) {
      fail(call + ": " + std::to_string(b.tokens) + " tokens for " + std::to_string(b.sequences) +
           " rows of decode_tokens " + std::to_string(b.decode_tokens) + " (1.." +
           std::to_string(kMaxDecodeTokens) + " each, tokens = rows x decode_tokens)");
    }
    if (!decode && (b.tokens < 0 || b.tokens > spec.runtime.max_tokens)) {
      fail(call + ": " + std::to_string(b.tokens) + " tokens, expected 0.." +
           std::to_string(spec.runtime.max_tokens) + " (runtime.max_tokens)");
    }
    if (b.slots == nullptr) fail(call + ": slots is null");
    if (!decode && b.cu_seqlens == nullptr && b.cu_seqlens_i32 == nullptr) {
      fail(call + ": cu_seqlens is null, and so is cu_seqlens_i32: a prefill sets one of them");
    }
    if (!decode && b.cu_seqlens != nullptr && b.cu_seqlens_i32 != nullptr) {
      fail(call +
           ": cu_seqlens (int64) and cu_seqlens_i32 are both set: a prefill sets one of "
           "them");
    }
    if (!decode && b.num_accepted != nullptr) {
      fail(call + ": num_accepted is set, but a verify step is a decode");
    }
    if (b.records) {
      if (!decode) fail(call + ": records is set, but a verify step is a decode");
      if (b.num_accepted != nullptr) {
        fail(call +
             ": records and num_accepted are both set: a records step takes no num_accepted "
             "(Engine::commit does)");
      }
      if (spec.runtime.max_verify_tokens < b.decode_tokens) {
        fail(call + ": a records verify step of " + std::to_string(b.decode_tokens) +
             " tokens per row needs runtime.max_verify_tokens >= " +
             std::to_string(b.decode_tokens) + " (the records buffers' size); it is " +
             std::to_string(spec.runtime.max_verify_tokens));
      }
    }
    check_region(call, "records_region", b.records_region);
    if (b.fold_rows != nullptr || b.fold_counts != nullptr) {
      if (!decode || b.num_accepted != nullptr) {
        fail(call +
             ": fold_rows is set: a fold (the deferred commit of a records step) is a decode "
             "step's without num_accepted");
      }
      if (b.fold_rows == nullptr || b.fold_counts == nullptr) {
        fail(call + ": a fold needs both fold_rows and fold_counts");
      }
      check_region(call, "fold_region", b.fold_region);
      if (b.records && b.fold_region == b.records_region) {
        fail(call + ": a records step folds records region " + std::to_string(b.fold_region) +
             ", the one it writes (runtime.record_regions 2: alternate records_region)");
      }
    }
    if (b.checkpoints < 0 || (b.checkpoints > 0 && decode)) {
      fail(call + ": checkpoints " + std::to_string(b.checkpoints) +
           (decode ? " in a decode (checkpoints are a prefill's)" : ", expected >= 0"));
    }
    // A sequence of at most max_tokens tokens has max_tokens / 16 + 2 distinct offsets to ask for
    // (the multiples of 16 from 0, and its length): more columns can only repeat them or be -1,
    // and a larger count is taken for a mistake before any [sequences, checkpoints] array is read.
    if (const std::int64_t most = spec.runtime.max_tokens / 16 + 2; b.checkpoints > most) {
      fail(call + ": checkpoints " + std::to_string(b.checkpoints) + ", expected at most " +
           std::to_string(most) + " (runtime.max_tokens / 16 + 2: every offset a sequence has)");
    }
    if (b.checkpoints > 0 && (b.checkpoint_offsets == nullptr || b.checkpoint_slots == nullptr)) {
      fail(call + ": checkpoint_offsets or checkpoint_slots is null");
    }
    const auto n = static_cast<std::size_t>(b.sequences);
    const bool verify = b.num_accepted != nullptr;
    const std::size_t entries = verify ? n * static_cast<std::size_t>(b.decode_tokens) : n;
    for (const auto& [ptr, bytes, name] :
         {std::tuple<const void*, std::size_t, const char*>{b.slots, entries * 4, "slots"},
          {decode ? nullptr : b.cu_seqlens, (n + 1) * 8, "cu_seqlens"},
          {decode ? nullptr : b.cu_seqlens_i32, (n + 1) * 4, "cu_seqlens_i32"},
          {b.num_accepted, n * 4, "num_accepted"},
          {b.fold_rows, n * 4, "fold_rows"},
          {b.fold_counts, n * 4, "fold_counts"},
          {b.checkpoints > 0 ? b.checkpoint_offsets : nullptr,
           n * static_cast<std::size_t>(b.checkpoints) * 8, "checkpoint_offsets"},
          {b.checkpoints > 0 ? b.checkpoint_slots : nullptr,
           n * static_cast<std::size_t>(b.checkpoints) * 4, "checkpoint_slots"}}) {
      if (const Status st = backend->check_caller_buffer(ptr, bytes, name); !st.ok()) {
        throw Error(st, call);
      }
    }
    if (backend->has_device_status()) return;  // the device's memory: the kernels check it
    if (!decode) {
      if (const Status st = b.cu_seqlens != nullptr
                                ? validate_cu_seqlens(b.cu_seqlens, b.sequences, b.tokens)
                                : validate_cu_seqlens(b.cu_seqlens_i32, b.sequences, b.tokens);
          !st.ok()) {
        fail(call + ": " + st.message());
      }
    }
    if (verify) {
      for (std::size_t r = 0; r < n; ++r) {
        if (b.num_accepted[r] < 1 || b.num_accepted[r] > b.decode_tokens) {
          fail(call + ": row " + std::to_string(r) + " has num_accepted " +
               std::to_string(b.num_accepted[r]) + ", expected 1.." +
               std::to_string(b.decode_tokens) + " (decode_tokens)");
        }
      }
      claim_slots(call, "slots entry", b.slots, entries);
      return;
    }
    claim_slots(call, decode ? "row" : "sequence", b.slots, n);
    // Checkpoint slots: acquired, and (same stamp) none a sequence's slot or another's. A padding
    // sequence's requests are not read (kda::layer::Batch::checkpoints).
    const auto columns = static_cast<std::size_t>(b.checkpoints);
    for (std::size_t i = 0; i < n * columns; ++i) {
      if (!padding(b.slots[i / columns]) && !padding(b.checkpoint_slots[i]) &&
          b.checkpoint_offsets[i] >= 0) {
        claim_slot(call, "checkpoint", i, b.checkpoint_slots[i]);
      }
    }
  }

  // A batch's `count` slots: each one that is not padding (negative, or the null slot) an
  // acquired slot, none twice.
  template <typename Slot>
  void claim_slots(const std::string& call, const char* entry, const Slot* slots,
                   std::size_t count) {
    next_stamp();
    for (std::size_t j = 0; j < count; ++j) {
      if (!padding(slots[j])) claim_slot(call, entry, j, slots[j]);
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
  void check_hidden(const EngineLayer& layer, const char* what, const void* hidden, const void* out,
                    std::int64_t tokens) const {
    // The call's name only for an error: a forward allocates nothing.
    auto call = [&] { return layer.info().label + " " + what; };
    if (tokens == 0) return;
    if (hidden == nullptr) fail(call() + ": hidden is null");
    if (out == nullptr) fail(call() + ": out is null");
    const auto bytes = static_cast<std::size_t>(tokens) *
                       static_cast<std::size_t>(spec.hidden_size) * sizeof(std::uint16_t);
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{hidden, "hidden"},
                                    std::pair<const void*, const char*>{out, "out"}}) {
      const Status st = backend->check_caller_buffer(ptr, bytes, name);
      if (!st.ok()) throw Error(st, call());
    }
    check_current_device_for(call);
  }

  // The KDA core's twin of check_hidden for one range of `tokens` tokens (a context-parallel
  // prefill): q..beta and out set, and usable by the backend.
  void check_core_range(const EngineLayer& layer, const char* what, const LayerInputs& inputs,
                        void* out, std::int64_t tokens) const {
    if (tokens == 0) return;
    const std::pair<const void*, const char*> given[] = {{inputs.q, "q"},       {inputs.k, "k"},
                                                         {inputs.v, "v"},       {inputs.g, "g"},
                                                         {inputs.beta, "beta"}, {out, "out"}};
    for (const auto& [pointer, name] : given) {
      if (pointer == nullptr) fail(std::string(what) + ": " + name + " is null");
    }
    check_caller_tensors(layer, what, layer.prefill_problem(tokens, 1),
                         caller_tensors<Tensors>(inputs, out));
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
  void check_caller_tensors(const EngineLayer& layer, const char* what, const CallProblem& p,
                            const CallTensors& t) const {
    const Status st = backend->check_caller_tensors(p, t);
    if (!st.ok()) throw Error(st, layer.info().label + " " + what);
    // The operator's own check of the arena's buffers (states, parameters, workspace) is off too.
    check_current_device_for([&] { return layer.info().label + " " + what; });
  }

  // With pointer checks on (CUDA), refuses a call made while another device than the arena's is
  // current: one query of the arena. `call_name()` names the call, made only for the error (a
  // forward allocates nothing).
  template <typename CallName>
  void check_current_device_for(const CallName& call_name) const {
    const Status st = backend->check_caller_buffer(arena.get(), 1, "the engine's arena");
    if (!st.ok()) throw Error(st, call_name());
  }
  void check_current_device(const char* call) const {
    check_current_device_for([call] { return std::string(call); });
  }

  // The staged batch of the host-span calls, as metadata in the arena.
  BatchMetadata staged_prefill(std::size_t sequences) const {
    BatchMetadata b;
    b.sequences = static_cast<std::int64_t>(sequences);
    b.tokens = cu_staging[sequences];
    b.slots = prefill_slots.device;  // checked: acquired, no duplicates
    b.cu_seqlens = cu_scratch;
    return b;
  }
  // The same for one sequence of `tokens` tokens before its cu_seqlens and slot are staged (the
  // arrays where they will be; only their addresses are read).
  BatchMetadata staged_prefill_bounds(std::int64_t tokens) const {
    BatchMetadata b;
    b.sequences = 1;
    b.tokens = tokens;
    b.slots = prefill_slots.device;
    b.cu_seqlens = cu_scratch;
    return b;
  }
  BatchMetadata staged_decode(std::size_t rows, int tokens) const {
    BatchMetadata b;
    b.sequences = static_cast<std::int64_t>(rows);
    b.tokens = b.sequences * tokens;
    b.decode_tokens = tokens;
    b.slots = decode_slots.device;  // checked: acquired or padding, no duplicates
    return b;
  }

  // The core's prefill call on batch `b` (its problem into *problem): the caller's q..beta and
  // out, the batch's metadata and the engine's status word.
  Tensors core_prefill_call(const EngineLayer& layer, const LayerInputs& inputs, void* out,
                            const BatchMetadata& b, const std::int64_t* cu_host,
                            Problem* problem) const {
    *problem = layer.prefill_problem(b.tokens, b.sequences);
    Tensors t = caller_tensors<Tensors>(inputs, out);
    if (b.checkpoints > 0) {
      problem->checkpoints = b.checkpoints;
      problem->checkpoint_offsets_dtype = DType::kI64;
      t.checkpoint_offsets = b.checkpoint_offsets;
      t.checkpoint_slots = b.checkpoint_slots;
    }
    // int32 cu_seqlens go to the core as they are (Problem::cu_seqlens_dtype); a host copy is
    // only staged for the int64 host-span calls.
    if (b.cu_seqlens == nullptr) {
      problem->cu_seqlens_dtype = DType::kI32;
      t.cu_seqlens = b.cu_seqlens_i32;
    } else {
      t.cu_seqlens = b.cu_seqlens;
      t.cu_seqlens_host = cu_host;
    }
    t.state_slots = b.slots;
    t.device_status = device_status;
    problem->padding_slot = null_slot;
    return t;
  }

  // The core alone on a checked batch. `cu_host`: the staged host copy of cu_seqlens, or null.
  void run_core(int kda_index, const char* what, const LayerInputs& inputs, void* out,
                const BatchMetadata& b, const std::int64_t* cu_host) const {
    const EngineLayer& layer = *layers[static_cast<std::size_t>(kda_index)];
    KDA_NVTX_RANGE(layer.nvtx_name().c_str());
    // The caller's tensors over the whole batch, checked before anything is enqueued (the
    // operator refuses an out that overlaps an input before it writes anything). Each sequence
    // reads and writes its state through its slot index in the layer's pool, whatever the slots.
    if (b.decode_tokens == 0) {
      check_caller_tensors(layer, what, layer.prefill_problem(b.tokens, b.sequences),
                           caller_tensors<Tensors>(inputs, out));
      Problem problem;
      const Tensors t = core_prefill_call(layer, inputs, out, b, cu_host, &problem);
      layer.forward_core(problem, t, unchecked);
    } else {
      DecodeProblem problem = layer.decode_problem(b.sequences, b.decode_tokens);
      problem.verify = b.num_accepted != nullptr || b.records;
      problem.records = b.records;
      problem.padding_slot = null_slot;
      DecodeTensors t = caller_tensors<DecodeTensors>(inputs, out);
      check_caller_tensors(layer, what, problem, t);
      t.slots = b.slots;
      t.num_accepted = b.num_accepted;
      t.records = b.records ? layer.records(b.records_region) : nullptr;
      if (b.fold_rows != nullptr) {
        const PendingRecords& folded = fold_source(kda_index, what, b);
        problem.fold_batch = folded.sequences;
        problem.fold_tokens = folded.decode_tokens;
        t.fold_records = layer.records(b.fold_region);
        t.fold_rows = b.fold_rows;
        t.fold_counts = b.fold_counts;
      }
      t.device_status = device_status;
      layer.decode_core(problem, t, unchecked);
      note_records(kda_index, b);
    }
  }

  // The checks of a context-parallel call: a group, one acquired slot, tokens within bounds.
  void check_context_call(const char* what, int slot, std::int64_t tokens) {
    if (spec.runtime.tp_size != 1) {
      fail(std::string(what) + ": " + spec.name + " is tensor-parallel (runtime.tp_size " +
           std::to_string(spec.runtime.tp_size) +
           "); a context-parallel prefill needs every head on each rank (tp_size 1)");
    }
    if (context_group == nullptr) fail(std::string(what) + ": the engine has no context_group");
    check_prefill_batch(what, {slot}, {0, tokens});
    if (padding(slot)) fail(std::string(what) + ": slot " + std::to_string(slot) + " is padding");
  }

  // This rank's segment transition (P^T, H^T per head) of `tokens` tokens of q..beta in `t`
  // (cu_seqlens {0, tokens} staged), into the first of context.transitions.
  void range_transition(const EngineLayer& layer, Tensors t, std::int64_t tokens) const {
    const auto H = static_cast<std::int64_t>(spec.num_heads);
    const auto D = static_cast<std::int64_t>(spec.head_dim);
    t.cu_seqlens = cu_scratch;
    t.cu_seqlens_host = cu_staging.data();
    layer.transition_core(
        transition_problem(layer.prefill_problem(tokens, 1)), t, context_transitions,
        context_transitions + H * D * D,
        Workspace{context_workspace, static_cast<std::size_t>(context_workspace_bytes)});
  }

  // Applies the gathered transitions of ranks [from, to), in order, to the slot's recurrent state.
  void apply_transitions(int kda_index, int slot, const char* what, int from, int to) const {
    const std::uint64_t floats = transition_floats(spec);
    const auto H = static_cast<std::int64_t>(spec.num_heads);
    const auto D = static_cast<std::int64_t>(spec.head_dim);
    const float* all = context_transitions + floats;  // rank j's at all + j * floats
    auto* state = reinterpret_cast<float*>(slot_state(kda_index, slot));
    for (int j = from; j < to; ++j) {
      const float* p_t = all + static_cast<std::uint64_t>(j) * floats;
      throw_if_error(
          backend->apply_transition(H, D, D, state, p_t, p_t + H * D * D, state),
          (std::string(what) + ": applying rank " + std::to_string(j) + "'s transition").c_str());
    }
  }

  // The whole layer on a checked batch, with the staged host copies of its metadata (or null).
  void run_whole(int kda_index, const char* what, const void* hidden, void* out,
                 const BatchMetadata& b, const std::int64_t* cu_host,
                 const std::int32_t* slots_host, layer::Times* times) const {
    const EngineLayer& layer = *layers[static_cast<std::size_t>(kda_index)];
    KDA_NVTX_RANGE(layer.nvtx_name().c_str());
    check_hidden(layer, what, hidden, out, b.tokens);
    layer::Batch batch;
    batch.tokens = b.tokens;
    batch.sequences = b.sequences;
    batch.decode_tokens = b.decode_tokens;
    batch.cu_seqlens = b.decode_tokens == 0 ? b.cu_seqlens : nullptr;
    batch.cu_seqlens_i32 = b.decode_tokens == 0 ? b.cu_seqlens_i32 : nullptr;
    batch.slots = b.slots;
    batch.padding_slot = null_slot;
    batch.num_accepted = b.num_accepted;
    batch.records = b.records;
    if (b.fold_rows != nullptr) {
      const PendingRecords& folded = fold_source(kda_index, what, b);
      batch.fold_sequences = folded.sequences;
      batch.fold_decode_tokens = folded.decode_tokens;
      batch.fold_rows = b.fold_rows;
      batch.fold_counts = b.fold_counts;
    }
    batch.checkpoints = b.checkpoints;
    batch.checkpoint_offsets = b.checkpoint_offsets;
    batch.checkpoint_slots = b.checkpoint_slots;
    batch.cu_seqlens_host = cu_host;
    batch.slots_host = slots_host;
    batch.device_status = device_status;
    layer::RunOptions options = layer_options(times);
    options.decode_kernel_ran = &decode_kernels_ran[static_cast<std::size_t>(kda_index)];
    layer.forward(batch, hidden, out, options, b.records_region,
                  b.fold_rows != nullptr ? b.fold_region : -1);
    note_records(kda_index, b);
    // A tensor-parallel rank's partial sum, summed over the group in place.
    if (communicator != nullptr && b.tokens > 0) {
      communicator->all_reduce_sum(
          out, static_cast<std::size_t>(b.tokens) * static_cast<std::size_t>(spec.hidden_size),
          DType::kBF16, backend->stream());
    }
  }

  // Which layers hold the records of a records step not committed yet, and its shape (the rows
  // and tokens of each layer's last records step), so that a commit runs on records that exist.
  struct PendingRecords {
    bool pending = false;
    std::int64_t sequences = 0;
    int decode_tokens = 0;
  };
  // One per KDA layer and records region.
  mutable std::vector<std::array<PendingRecords, 2>> pending_records;
  // One per KDA layer: the kernel its last CUDA decode step ran (kAuto: none yet).
  mutable std::vector<layer::DecodeKernel> decode_kernels_ran;
  // The layers' States and the cores' commit layers for each records region, built once for
  // commit().
  std::array<std::vector<layer::State>, 2> commit_states;
  std::array<std::vector<CommitLayer>, 2> commit_layers;
  // Every pool a slot has an entry in, built once: per KDA layer its recurrent states, then with
  // whole layers its q, k and v conv states (sequence_state_bytes()'s order). What a slot copy,
  // zeroing and sequence-state transfer walk.
  std::vector<SlotPool> slot_pools;

  // A slot copy's pairs (host memory): each pair that is not padding copies an acquired slot into
  // an acquired slot, no destination twice or also a source.
  template <typename Slot>
  void check_copy_pairs(const std::string& call, const Slot* src, const Slot* dst,
                        std::size_t pairs) {
    next_stamp();
    for (std::size_t j = 0; j < pairs; ++j) {
      if (padding(src[j]) || padding(dst[j])) continue;
      for (const auto& [slot, side] : {std::pair<int, const char*>{src[j], "from"},
                                       std::pair<int, const char*>{dst[j], "into"}}) {
        if (!in_use(slot)) {
          fail(call + ": pair " + std::to_string(j) + " copies " + side + " slot " +
               std::to_string(slot) + ", which is not an acquired slot");
        }
      }
      if (seen_stamp[static_cast<std::size_t>(dst[j])] == stamp) {
        fail(call + ": slot " + std::to_string(dst[j]) + " is the destination of two pairs");
      }
      seen_stamp[static_cast<std::size_t>(dst[j])] = stamp;
    }
    for (std::size_t j = 0; j < pairs; ++j) {
      if (padding(src[j]) || padding(dst[j])) continue;
      if (seen_stamp[static_cast<std::size_t>(src[j])] == stamp) {
        fail(call + ": slot " + std::to_string(src[j]) + " is both a source (pair " +
             std::to_string(j) + ") and a destination of the copy");
      }
    }
  }

  // The caller's int32 arrays of `count` entries each, usable by the backend (CUDA: device memory
  // of the current device, long enough; throws).
  void check_index_arrays(
      const std::string& call, std::size_t count,
      std::initializer_list<std::pair<const std::int32_t*, const char*>> arrays) const {
    for (const auto& [ptr, name] : arrays) {
      const Status st = backend->check_caller_buffer(ptr, count * sizeof(std::int32_t), name);
      if (!st.ok()) throw Error(st, call);
    }
  }

  // A copy's or zeroing's count, signed (the pointer forms) or a span's size: 0..max_sequences.
  template <typename Count>
  void check_copy_count(const std::string& call, Count count, const char* what) const {
    bool negative = false;
    if constexpr (std::is_signed_v<Count>) negative = count < 0;
    if (negative || static_cast<std::uint64_t>(count) > static_cast<std::uint64_t>(num_slots())) {
      fail(call + ": " + std::to_string(count) + " " + what + ", expected 0.." +
           std::to_string(num_slots()) + " (runtime.max_sequences)");
    }
  }

  // A copy of slots src[i] into dst[i], or (src null) a zeroing of the slots dst names, over
  // every pool a slot has an entry in.
  void run_copy(const std::string& call, std::int64_t pairs, const std::int32_t* src,
                const std::int32_t* dst) {
    KDA_NVTX_RANGE("engine.copy_slots");
    SlotCopyProblem problem;
    problem.pairs = pairs;
    problem.num_slots = num_slots();
    problem.padding_slot = null_slot;
    const int pools = static_cast<int>(slot_pools.size());
    for (int at = 0; at < pools; at += kMaxCopyPools) {
      const int count = std::min(kMaxCopyPools, pools - at);
      const SlotPool* some = slot_pools.data() + at;
      const Status st = src != nullptr
                            ? backend->copy_slots(problem, some, count, src, dst, device_status)
                            : backend->zero_slots(problem, some, count, dst, device_status);
      if (!st.ok()) throw Error(st, call);
    }
  }

  void note_records(int kda_index, const BatchMetadata& b) const {
    if (!b.records) return;
    pending_records[static_cast<std::size_t>(kda_index)][static_cast<std::size_t>(
        b.records_region)] = {true, b.sequences, b.decode_tokens};
  }

  // The records step a fold of `b` on layer `kda_index` folds: the last that wrote its region.
  const PendingRecords& fold_source(int kda_index, const char* what, const BatchMetadata& b) const {
    const PendingRecords& p = pending_records[static_cast<std::size_t>(kda_index)]
                                             [static_cast<std::size_t>(b.fold_region)];
    if (!p.pending) {
      fail(std::string(what) + ": " + layers[static_cast<std::size_t>(kda_index)]->info().label +
           " has no records in region " + std::to_string(b.fold_region) +
           " to fold (no records verify step wrote it)");
    }
    return p;
  }

  // How the whole layers run: on the engine's stream and threads, its pointers checked already.
  layer::RunOptions layer_options(layer::Times* times) const {
    layer::RunOptions options;
    options.stream = backend->stream();
    options.cpu_threads = cpu_threads;
    options.check_pointers = false;
    options.schedule = unchecked.schedule;
    options.decode_kernel = spec.runtime.decode_step;
    options.times = times;
    return options;
  }

  // Copies the batch's slot indices to `staging`'s scratch, unless it holds them already.
  void stage_slots(Span<const int> slots, SlotStaging* staging) {
    staging->host.clear();
    for (const int slot : slots) staging->host.push_back(padding(slot) ? -1 : slot);
    if (staging->host != staging->uploaded) {
      KDA_NVTX_RANGE("engine.stage_slots");
      backend->copy_to_device(staging->device, staging->host.data(),
                              staging->host.size() * sizeof(std::int32_t));
      staging->uploaded = staging->host;  // capacity reserved: no allocation
    }
  }
};

// ---- construction ----------------------------------------------------------------------------

namespace {

// The CUDA backend's checks of `spec`: the whole layer's limits, then the core's prefill and
// decode at the runtime's bounds. Each names the model's obstacles (kUnsupported) before this
// machine's (kBackendUnavailable, or kUnsupported for a device the kernels are not built for).
std::vector<Status> cuda_checks(const ModelSpec& spec) {
  std::vector<Status> checks;
  if (spec.runtime.layer_mode == LayerMode::kWhole) {
    checks.push_back(layer::can_implement(Backend::kCuda, layer_config(spec)));
  }
  const Status prefill = can_implement(max_prefill_problem(spec), Backend::kCuda);
  checks.emplace_back(prefill.code(), prefill.ok() ? "" : "prefill: " + prefill.message());
  const Status decode = can_implement(max_decode_problem(spec), Backend::kCuda);
  checks.emplace_back(decode.code(), decode.ok() ? "" : "decode: " + decode.message());
  return checks;
}

// A plan for CUDA is made on any machine, of a model the CUDA backend can run: the model's
// obstacles are refused, this machine's are not, whichever check they come from. (A device the
// kernels are not built for reads as kUnsupported too; there nothing is refused, since the two
// cannot be told apart.)
void check_cuda_can_run_model(const ModelSpec& spec) {
  if (cuda_device_count() > 0 && !cuda_device_supported().ok()) return;
  for (const Status& st : cuda_checks(spec)) {
    if (st.code() == StatusCode::kUnsupported) {
      throw Error(st, spec.source + ": the CUDA backend cannot run this model");
    }
  }
}

}  // namespace

Backend resolve_backend(const ModelSpec& spec, BackendChoice choice, std::string* why) {
  return choose_backend(
      choice,
      [&spec] {
        for (const Status& st : cuda_checks(spec)) {
          if (!st.ok()) return st.message();
        }
        return std::string();
      },
      why);
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
    // A Hugging Face checkpoint folder (checkpoint.hpp), for whole layers and cores alike.
    const std::filesystem::path dir(spec.weights);
    std::error_code exists_ec;
    if (std::filesystem::exists(dir / "model.safetensors.index.json", exists_ec) ||
        std::filesystem::exists(dir / "model.safetensors", exists_ec)) {
      return;
    }
    problem = "is a directory holding neither model.safetensors.index.json nor model.safetensors";
  } else {
    return;
  }
  fail(spec.source + ": weights: '" + spec.weights + "' " + problem +
       " (a relative path is resolved against the YAML's directory)");
}

planner::MemoryPlan Engine::plan_for(const ModelSpec& spec, Backend backend, int context_ranks) {
  check_spec(spec);
  if (backend == Backend::kCuda) check_cuda_can_run_model(spec);
  if (context_ranks < 0) {
    throw Error(StatusCode::kInvalidArgument, spec.source + ": plan_for: context_ranks is " +
                                                  std::to_string(context_ranks) +
                                                  ", expected >= 0 (0: no context_group)");
  }
  if (context_ranks > 0 && !context_parallel_fits(spec)) {
    throw Error(StatusCode::kInvalidArgument,
                spec.source + ": plan_for: a context group (" + std::to_string(context_ranks) +
                    " ranks) needs tp_size 1 (every head on each rank) and an f32 state");
  }
  EngineBuffers buffers;
  return make_plan(spec, backend, make_layers(spec, backend), context_ranks, &buffers);
}

Engine::Engine(ModelSpec spec, const EngineOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.spec = std::move(spec);
  if (options.layer_mode) m.spec.runtime.layer_mode = *options.layer_mode;
  if (options.prefill_schedule) m.spec.runtime.prefill_schedule = *options.prefill_schedule;
  if (options.decode_step) m.spec.runtime.decode_step = *options.decode_step;
  check_spec(m.spec);
  if (options.cpu_threads < 0) {
    throw Error(StatusCode::kInvalidArgument, m.spec.source + ": EngineOptions::cpu_threads is " +
                                                  std::to_string(options.cpu_threads) +
                                                  ", expected >= 0 (0: all cores)");
  }
  m.cpu_threads = options.cpu_threads;
  const BackendChoice choice = options.backend.value_or(m.spec.runtime.backend);
  if (choice != BackendChoice::kAuto && choice != BackendChoice::kCpu &&
      choice != BackendChoice::kCuda) {
    throw Error(StatusCode::kInvalidArgument,
                m.spec.source + ": the backend (runtime.backend, EngineOptions::backend) is " +
                    std::to_string(static_cast<int>(choice)) + ", expected kAuto, kCpu or kCuda");
  }
  const Backend kind = resolve_backend(m.spec, choice);
  const std::string where = m.spec.name + " on " + to_string(kind);
  // Checked before the backend is made: nothing is created for options that will be refused.
  if (!is_known(m.spec.runtime.prefill_schedule)) {
    throw Error(StatusCode::kInvalidArgument,
                where + ": EngineOptions::prefill_schedule is " +
                    std::to_string(static_cast<int>(m.spec.runtime.prefill_schedule)) +
                    ", expected kAuto, kTwoPhase or kPipelined");
  }
  if (!layer::is_known(m.spec.runtime.decode_step)) {
    throw Error(StatusCode::kInvalidArgument,
                where + ": " +
                    (options.decode_step ? "EngineOptions::decode_step" : "runtime.decode_step") +
                    " is " + std::to_string(static_cast<int>(m.spec.runtime.decode_step)) +
                    ", expected kAuto, kFusedFactors, kFused, kSeparate or kOneLaunch");
  }
  BackendOptions backend_options;
  backend_options.cpu_threads = options.cpu_threads;
  backend_options.stream = options.stream;
  backend_options.check_pointers = options.check_pointers;
  if (options.communicator != nullptr) {
    const Communicator& c = *options.communicator;
    if (m.spec.runtime.layer_mode != LayerMode::kWhole || c.size() != m.spec.runtime.tp_size ||
        c.rank() != m.spec.runtime.tp_rank || c.backend() != kind) {
      throw Error(StatusCode::kInvalidArgument,
                  where + ": EngineOptions::communicator is rank " + std::to_string(c.rank()) +
                      " of " + std::to_string(c.size()) + " on " + to_string(c.backend()) +
                      "; the engine is tensor-parallel rank " +
                      std::to_string(m.spec.runtime.tp_rank) + " of " +
                      std::to_string(m.spec.runtime.tp_size) + " on " + to_string(kind) +
                      (m.spec.runtime.layer_mode != LayerMode::kWhole
                           ? " with the KDA cores alone (a communicator sums whole layers)"
                           : ""));
    }
  }
  m.communicator = options.communicator;
  if (options.context_group != nullptr) {
    const Communicator& c = *options.context_group;
    if (c.size() < 1 || c.rank() < 0 || c.rank() >= c.size()) {
      throw Error(StatusCode::kInvalidArgument,
                  where + ": EngineOptions::context_group is rank " + std::to_string(c.rank()) +
                      " of " + std::to_string(c.size()) +
                      ", expected a size of at least 1 and a rank in [0, size)");
    }
    if (!context_parallel_fits(m.spec) || c.backend() != kind) {
      throw Error(StatusCode::kInvalidArgument,
                  where + ": EngineOptions::context_group (rank " + std::to_string(c.rank()) +
                      " of " + std::to_string(c.size()) + " on " + to_string(c.backend()) +
                      ") needs tp_size 1 (every head on each rank), an f32 state and the "
                      "engine's backend");
    }
  }
  m.context_group = options.context_group;
  m.backend = make_engine_backend(kind, backend_options, where);
  m.unchecked.check_pointers = false;
  m.unchecked.schedule = m.spec.runtime.prefill_schedule;
  if (const Status st = can_implement(max_prefill_problem(m.spec), kind); !st.ok()) {
    throw Error(st, where + ": prefill");
  }
  if (const Status st = can_implement(max_decode_problem(m.spec), kind); !st.ok()) {
    throw Error(st, where + ": decode");
  }

  // Plan from the sizes alone and allocate the arena before any weights are read or generated
  // (seconds, gigabytes for a large model): an arena that cannot be had fails first. The layers
  // then read their weights straight into their planned buffers, one layer at a time.
  m.whole = m.spec.runtime.layer_mode == LayerMode::kWhole;
  if (m.whole) {  // before the arena and the weights: their sizes assume the backend runs them
    if (const Status st = layer::can_implement(kind, layer_config(m.spec)); !st.ok()) {
      throw Error(st, where);
    }
  }
  m.layers = make_layers(m.spec, kind);
  EngineBuffers buffers;
  m.plan =
      make_plan(m.spec, kind, m.layers,
                options.context_group != nullptr ? options.context_group->size() : 0, &buffers);
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
  if (options.poison_arena) {
    m.backend->memset(base, 0xFF, static_cast<std::size_t>(total));
    // Done before the weights are written: a CUDA layer copies its image by cudaMemcpy, which does
    // not wait for work on a non-blocking stream of the caller's.
    m.backend->synchronize();
  }
  for (const auto& layer : m.layers) layer->bind(base, m.plan, *m.backend, options.poison_arena);
  load_layers(m.spec, options.seed, m.layers);
  m.weights_origin = m.layers.empty() ? std::string() : m.layers[0]->info().origin;
  for (const auto& layer : m.layers) m.weight_bytes += layer->weight_bytes();

  auto locate = [&](planner::BufferHandle handle) -> void* {
    const planner::PlanEntry* entry = m.plan.entry(handle);
    return entry == nullptr ? nullptr : base + entry->offset;
  };
  m.cu_scratch = static_cast<std::int64_t*>(locate(buffers.cu_seqlens));
  m.prefill_slots.device = static_cast<std::int32_t*>(locate(buffers.prefill_slots));
  m.decode_slots.device = static_cast<std::int32_t*>(locate(buffers.decode_slots));
  m.copy_src.device = static_cast<std::int32_t*>(locate(buffers.copy_src));
  m.copy_dst.device = static_cast<std::int32_t*>(locate(buffers.copy_dst));
  m.reset_slot.device = static_cast<std::int32_t*>(locate(buffers.reset_slot));
  m.device_status = static_cast<std::uint32_t*>(locate(buffers.device_status));
  m.context_transitions = static_cast<float*>(locate(buffers.context_transitions));
  m.context_workspace = locate(buffers.context_workspace);
  m.context_conv = static_cast<std::uint8_t*>(locate(buffers.context_conv));
  if (m.context_conv != nullptr) {
    m.context_conv_block = conv_history_block_bytes(m.spec);
    m.context_conv_blocks.assign(static_cast<std::size_t>(m.context_conv_block) *
                                     static_cast<std::size_t>(options.context_group->size()),
                                 0);
    m.context_conv_states.assign(static_cast<std::size_t>(6 * conv_state_elements(m.spec)), 0);
  }
  if (const planner::PlanEntry* entry = m.plan.entry(buffers.context_workspace)) {
    m.context_workspace_bytes = entry->bytes;
  }
  if (m.device_status != nullptr) {
    throw_if_error(m.backend->clear_device_status(m.device_status),
                   "clearing the device status word");
  }

  if (options.null_slot >= 0) {
    // One of the pool's slots, and at least one other to acquire.
    if (options.null_slot >= m.spec.runtime.max_sequences || m.spec.runtime.max_sequences < 2) {
      fail(where + ": EngineOptions::null_slot " + std::to_string(options.null_slot) +
           " needs a pool slot to reserve and one more to acquire: expected 0.." +
           std::to_string(m.spec.runtime.max_sequences - 1) + " with runtime.max_sequences " +
           std::to_string(m.spec.runtime.max_sequences) + " >= 2 (negative: no null slot)");
    }
    m.null_slot = options.null_slot;
  }
  m.slot_bytes = m.spec.state_slot_bytes();
  m.conv_slot_bytes = m.whole ? m.spec.conv_state_slot_bytes() : 0;
  const auto slots = static_cast<std::size_t>(m.spec.runtime.max_sequences);
  m.slot_in_use.assign(slots, 0);
  // Fresh slots start from zero: clear every pool once here, then per slot on acquire / reset.
  for (const auto& layer : m.layers) {
    m.backend->memset(layer->state_pool(), 0, static_cast<std::size_t>(layer->state_pool_bytes()));
    for (int projection = 0; projection < 3 && m.whole; ++projection) {
      m.backend->memset(layer->conv_pool(projection), 0,
                        static_cast<std::size_t>(layer->conv_pool_bytes()));
    }
  }

  // Host staging sized once, so prefill and decode never allocate.
  m.cu_staging.reserve(slots + 1);
  m.cu_uploaded.reserve(slots + 1);
  m.seen_stamp.assign(slots, 0);
  for (Impl::SlotStaging* staging :
       {&m.prefill_slots, &m.decode_slots, &m.copy_src, &m.copy_dst, &m.reset_slot}) {
    staging->host.reserve(slots);
    staging->uploaded.reserve(slots);
  }
  m.pending_records.assign(m.layers.size(), {});
  m.decode_kernels_ran.assign(m.layers.size(), layer::DecodeKernel::kAuto);
  for (int region = 0; region < m.spec.runtime.record_regions; ++region) {
    for (const auto& layer : m.layers) {
      m.commit_states[static_cast<std::size_t>(region)].push_back(layer->state(region));
      m.commit_layers[static_cast<std::size_t>(region)].push_back(
          CommitLayer{layer->records(region), layer->state_pool()});
    }
  }
  for (int l = 0; l < m.num_layers(); ++l) {
    m.slot_pools.push_back(
        SlotPool{m.layers[static_cast<std::size_t>(l)]->state_pool(), m.slot_bytes});
    if (!m.whole) continue;
    for (int projection = 0; projection < 3; ++projection) {
      m.slot_pools.push_back(SlotPool{m.layers[static_cast<std::size_t>(l)]->conv_pool(projection),
                                      m.conv_slot_bytes});
    }
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

const LayerInfo& Engine::layer(int kda_index) const {
  impl_->check_layer(kda_index);
  return impl_->layers[static_cast<std::size_t>(kda_index)]->info();
}

LayerMode Engine::layer_mode() const noexcept { return impl_->spec.runtime.layer_mode; }

layer::DecodeKernel Engine::decode_step_ran(int kda_index) const {
  impl_->check_layer(kda_index);
  return impl_->decode_kernels_ran[static_cast<std::size_t>(kda_index)];
}
const std::string& Engine::weights_origin() const noexcept { return impl_->weights_origin; }
std::uint64_t Engine::weight_bytes() const noexcept { return impl_->weight_bytes; }

void Engine::synchronize() const { impl_->backend->synchronize(); }

void Engine::check_device_status() {
  Impl& m = *impl_;
  if (m.device_status == nullptr) return;
  m.check_current_device("check_device_status");
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
  const int unused =
      static_cast<int>(std::count(impl_->slot_in_use.begin(), impl_->slot_in_use.end(), 0));
  return impl_->null_slot >= 0 ? unused - 1 : unused;  // the null slot is never handed out
}

int Engine::null_slot() const noexcept { return impl_->null_slot; }

bool Engine::slot_in_use(int slot) const noexcept { return impl_->in_use(slot); }

int Engine::acquire_slot() {
  Impl& m = *impl_;
  m.check_current_device("acquire_slot");
  for (int slot = 0; slot < m.num_slots(); ++slot) {
    if (slot != m.null_slot && m.slot_in_use[static_cast<std::size_t>(slot)] == 0) {
      m.zero_slot("acquire_slot", slot);
      m.slot_in_use[static_cast<std::size_t>(slot)] = 1;
      return slot;
    }
  }
  fail("all " + std::to_string(m.num_slots() - (m.null_slot >= 0 ? 1 : 0)) +
           " state slots are in use (runtime.max_sequences" +
           (m.null_slot >= 0 ? ", less the null slot " + std::to_string(m.null_slot) : "") +
           "); release one first",
       StatusCode::kInvalidArgument);
}

void Engine::release_slot(int slot) {
  if (!slot_in_use(slot)) fail("release_slot: slot " + std::to_string(slot) + " is not acquired");
  impl_->slot_in_use[static_cast<std::size_t>(slot)] = 0;
}

void Engine::reset_slot(int slot) {
  if (!slot_in_use(slot)) fail("reset_slot: slot " + std::to_string(slot) + " is not acquired");
  impl_->check_current_device("reset_slot");
  impl_->zero_slot("reset_slot", slot);
}

void Engine::read_slot_state(int kda_index, int slot, void* host_dst) const {
  const Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_sequence_state_buffer("read_slot_state", slot, host_dst);
  m.check_current_device("read_slot_state");
  m.backend->copy_to_host(host_dst, m.slot_state(kda_index, slot),
                          static_cast<std::size_t>(m.slot_bytes));
}

void Engine::write_slot_state(int kda_index, int slot, const void* host_src) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_sequence_state_buffer("write_slot_state", slot, host_src);
  m.check_acquired_for_write("write_slot_state", slot);
  m.check_current_device("write_slot_state");
  m.backend->copy_to_device(m.slot_state(kda_index, slot), host_src,
                            static_cast<std::size_t>(m.slot_bytes));
  synchronize();
}

// ---- forward -------------------------------------------------------------------------------
//
// Each call comes in two forms: on host spans, which the engine checks completely, stages into its
// arena and hands on with their host copies (the CUDA core plans long sequences from the real
// lengths), and on caller-owned metadata (BatchMetadata), which it hands on as it is.

void Engine::prefill(int kda_index, const LayerInputs& inputs, void* out, Span<const int> slots,
                     Span<const std::int64_t> cu_seqlens) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_prefill_batch("prefill", slots, cu_seqlens);
  m.stage_cu_seqlens(cu_seqlens);
  m.stage_slots(slots, &m.prefill_slots);
  m.run_core(kda_index, "prefill", inputs, out, m.staged_prefill(slots.size()),
             m.cu_staging.data());
}

void Engine::prefill(int kda_index, const LayerInputs& inputs, void* out,
                     const BatchMetadata& batch) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_metadata("prefill", batch, false);
  m.run_core(kda_index, "prefill", inputs, out, batch, nullptr);
}

void Engine::decode(int kda_index, const LayerInputs& inputs, void* out, Span<const int> slots,
                    int tokens) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_decode_batch("decode", slots, tokens);
  m.stage_slots(slots, &m.decode_slots);
  m.run_core(kda_index, "decode", inputs, out, m.staged_decode(slots.size(), tokens), nullptr);
}

void Engine::decode(int kda_index, const LayerInputs& inputs, void* out,
                    const BatchMetadata& batch) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_metadata("decode", batch, true);
  m.run_core(kda_index, "decode", inputs, out, batch, nullptr);
}

void Engine::prefill_context_parallel(int kda_index, const LayerInputs& inputs, void* out, int slot,
                                      std::int64_t tokens) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  const char* what = "prefill_context_parallel";
  m.check_context_call(what, slot, tokens);
  const EngineLayer& layer = *m.layers[static_cast<std::size_t>(kda_index)];
  // Before the first collective, so that a refused call leaves this rank's slot as it was (a
  // failure after it would leave the slot half updated). The other ranks still go on into the
  // gather: the runtime wakes them (Communicator's contract). Step 4's core call is checked
  // whole here (an out overlapping an input; on CUDA the tensors' alignment): step 3 has moved
  // the slot's state by the time it runs.
  m.check_core_range(layer, what, inputs, out, tokens);
  {
    Problem problem;
    const Tensors t =
        m.core_prefill_call(layer, inputs, out, m.staged_prefill_bounds(tokens), nullptr, &problem);
    layer.check_forward_core(problem, t, m.unchecked, what);
  }
  // 1. This range's transition (P^T, H^T per head), from its tokens alone.
  m.stage_cu_seqlens({0, tokens});
  m.range_transition(layer, caller_tensors<Tensors>(inputs, nullptr), tokens);
  // 2. Every rank's, in rank order; 3. the true state at this range's start: the initial state
  // through the ranges before.
  m.context_group->all_gather(m.context_transitions,
                              m.context_transitions + transition_floats(m.spec),
                              transition_floats(m.spec) * sizeof(float), m.backend->stream());
  m.apply_transitions(kda_index, slot, what, 0, m.context_group->rank());
  // 4. This range's prefill from there (the batch checked and its cu_seqlens staged above): its
  // outputs, and the state at its end in the slot.
  m.stage_slots({slot}, &m.prefill_slots);
  m.run_core(kda_index, what, inputs, out, m.staged_prefill(1), m.cu_staging.data());
  // 5. The final state on every rank: the ranges after this one.
  m.apply_transitions(kda_index, slot, what, m.context_group->rank() + 1, m.context_group->size());
}

void Engine::prefill_hidden_context_parallel(int kda_index, const void* hidden, void* out, int slot,
                                             std::int64_t tokens) {
  Impl& m = *impl_;
  const char* what = "prefill_hidden_context_parallel";
  m.check_layer(kda_index);
  m.check_whole(what);
  m.check_context_call(what, slot, tokens);
  const EngineLayer& layer = *m.layers[static_cast<std::size_t>(kda_index)];
  m.check_hidden(layer, what, hidden, out, tokens);
  Communicator& group = *m.context_group;
  const int rank = group.rank(), ranks = group.size();
  const std::int64_t E = m.spec.hidden_size;
  // The layer refuses an out that overlaps hidden only in step 5, after steps 1-4 have moved the
  // slot's states: here, before anything (what else it checks there is the engine's own: the
  // batch, the arena's states and workspace, hidden and out set and usable).
  const auto hidden_bytes = static_cast<std::uint64_t>(tokens * E) * sizeof(bf16_bits);
  if (kda::detail::byte_ranges_overlap(out, hidden_bytes, hidden, hidden_bytes)) {
    fail(layer.info().label + " " + what + ": out overlaps hidden");
  }
  const auto history = static_cast<std::int64_t>(m.spec.short_conv_kernel_size - 1);  // W - 1
  const std::uint64_t block = m.context_conv_block;
  const auto elements = static_cast<std::size_t>(conv_state_elements(m.spec));
  const auto conv_bytes = static_cast<std::size_t>(m.conv_slot_bytes);
  // The three conv states of a history block (backend memory) or of a host copy of one.
  auto conv_of = [&](std::uint8_t* b) {
    auto* base = reinterpret_cast<bf16_bits*>(b + kConvHistoryHeader);
    return std::array<bf16_bits*, 3>{base, base + elements, base + 2 * elements};
  };
  std::uint8_t* mine = m.context_conv;
  std::uint8_t* all = mine + block;
  const std::array<bf16_bits*, 3> scratch = conv_of(mine);
  const layer::RunOptions options = m.layer_options(nullptr);
  auto range = [&](std::int64_t n) {
    layer::Batch b;
    b.tokens = n;
    b.sequences = 1;
    b.cu_seqlens = m.cu_scratch;  // staged before each use
    b.cu_seqlens_host = m.cu_staging.data();
    b.device_status = m.device_status;
    return b;
  };

  // 1. This range's conv history: a zero conv state through its last min(tokens, W-1) rows (their
  // projections and conv, on the block's conv states) holds their pre-conv inputs, right-aligned.
  // A range that needs more history than its own rows takes the rest from the ranks before it.
  m.backend->memset(mine, 0, static_cast<std::size_t>(block));
  m.context_tokens = tokens;
  m.backend->copy_to_device(mine, &m.context_tokens, sizeof m.context_tokens);
  const std::int64_t last = std::min(tokens, history);
  if (last > 0) {
    m.stage_cu_seqlens({0, last});
    layer.core_inputs(range(last), static_cast<const bf16_bits*>(hidden) + (tokens - last) * E,
                      scratch.data(), options);
  }
  // 2. Every rank's block. The conv states are formed on the host (a few rows per rank): the
  // sequence's initial ones (the slot's, the same on every rank), then each rank's inputs shifted
  // in, in rank order — the conv state at this range's start, and after the last rank's the
  // sequence's final one.
  group.all_gather(mine, all, static_cast<std::size_t>(block), m.backend->stream());
  m.backend->copy_to_host(m.context_conv_blocks.data(), all,
                          static_cast<std::size_t>(block) * static_cast<std::size_t>(ranks));
  bf16_bits* running = m.context_conv_states.data();  // [3][Cl, W-1]
  bf16_bits* start = running + 3 * elements;
  for (int p = 0; p < 3; ++p) {
    m.backend->copy_to_host(running + p * elements, m.slot_conv_state(kda_index, slot, p),
                            conv_bytes);
  }
  for (int j = 0; j < ranks; ++j) {
    if (j == rank) std::copy(running, running + 3 * elements, start);
    std::uint8_t* b = m.context_conv_blocks.data() + static_cast<std::size_t>(j) * block;
    std::int64_t held = 0;
    std::memcpy(&held, b, sizeof held);
    if (held < 0 || held > m.spec.runtime.max_tokens) {
      fail(std::string(what) + ": rank " + std::to_string(j) + "'s conv history names " +
               std::to_string(held) + " tokens (the ranks disagree on the call)",
           StatusCode::kInternal);
    }
    // The state after n more inputs: the last W-1 of (state ++ inputs).
    const std::int64_t n = std::min(held, history);
    const std::array<bf16_bits*, 3> inputs = conv_of(b);
    for (int p = 0; p < 3; ++p) {
      bf16_bits* s = running + p * elements;
      for (std::size_t c = 0; c < elements; c += static_cast<std::size_t>(history)) {
        for (std::int64_t i = 0; i < history; ++i) {  // ascending: reads i + n >= i, not yet moved
          s[c + i] = i < history - n ? s[c + i + n] : inputs[p][c + i];
        }
      }
    }
  }
  // 3. This range's conv state at its start, into the block's conv states for the transition
  // pass (which moves them on as a forward would).
  for (int p = 0; p < 3; ++p) {
    m.backend->copy_to_device(scratch[p], start + p * elements, conv_bytes);
  }
  // 4. This range's segment transition from its core inputs (projections and conv from that
  // state), every rank's gathered; then, past the last collective (a refused one leaves the slot
  // as it was), the slot's conv state at this range's start, for the prefill below, and its
  // recurrent state there.
  m.stage_cu_seqlens({0, tokens});
  const layer::CoreInputs in = layer.core_inputs(range(tokens), hidden, scratch.data(), options);
  LayerInputs core_in{in.q, in.k, in.v, in.g, in.beta};
  m.range_transition(layer, caller_tensors<Tensors>(core_in, nullptr), tokens);
  group.all_gather(m.context_transitions, m.context_transitions + transition_floats(m.spec),
                   transition_floats(m.spec) * sizeof(float), m.backend->stream());
  for (int p = 0; p < 3; ++p) {
    m.backend->copy_to_device(m.slot_conv_state(kda_index, slot, p), start + p * elements,
                              conv_bytes);
  }
  m.apply_transitions(kda_index, slot, what, 0, rank);
  // 5. The whole layer on this range from (that recurrent state, that conv state): its out rows,
  // and the states at its end in the slot.
  m.stage_slots({slot}, &m.prefill_slots);
  m.run_whole(kda_index, what, hidden, out, m.staged_prefill(1), m.cu_staging.data(),
              m.prefill_slots.host.data(), nullptr);
  // 6. The sequence's final states on every rank: the transitions after this range, and the conv
  // states from the gathered history (the last rank's prefill left them already).
  m.apply_transitions(kda_index, slot, what, rank + 1, ranks);
  if (rank + 1 < ranks) {
    for (int p = 0; p < 3; ++p) {
      m.backend->copy_to_device(m.slot_conv_state(kda_index, slot, p), running + p * elements,
                                conv_bytes);
    }
  }
}

// ---- whole layers ----------------------------------------------------------------------------

std::uint64_t Engine::conv_state_slot_bytes() const noexcept { return impl_->conv_slot_bytes; }

void Engine::read_slot_conv_state(int kda_index, int slot, int projection, void* host_dst) const {
  const Impl& m = *impl_;
  m.check_conv_state_access("read_slot_conv_state", kda_index, slot, projection, host_dst);
  m.check_current_device("read_slot_conv_state");
  m.backend->copy_to_host(host_dst, m.slot_conv_state(kda_index, slot, projection),
                          static_cast<std::size_t>(m.conv_slot_bytes));
}

std::uint64_t Engine::sequence_state_bytes() const noexcept {
  std::uint64_t bytes = sizeof(SequenceStateHeader);
  for (const SlotPool& pool : impl_->slot_pools) bytes += pool.entry_bytes;
  return bytes;
}

namespace {

constexpr char kSequenceStateMagic[8] = {'K', 'D', 'A', 'S', 'T', 'A', 'T', 'E'};

}  // namespace

SequenceStateHeader Engine::Impl::sequence_state_header(std::uint64_t payload_bytes) const {
  SequenceStateHeader h{};
  std::memcpy(h.magic, kSequenceStateMagic, sizeof(h.magic));
  h.version = SequenceStateHeader::kVersion;
  h.header_bytes = sizeof(SequenceStateHeader);
  h.payload_bytes = payload_bytes;
  h.kda_layers = static_cast<std::uint32_t>(num_layers());
  h.num_heads = static_cast<std::uint32_t>(spec.num_heads);
  h.head_dim = static_cast<std::uint32_t>(spec.head_dim);
  h.conv_width = whole ? static_cast<std::uint32_t>(spec.short_conv_kernel_size) : 0;
  h.state_value_bytes = static_cast<std::uint32_t>(dtype_size(spec.runtime.state_dtype));
  h.tp_rank = static_cast<std::uint32_t>(spec.runtime.tp_rank);
  h.tp_size = static_cast<std::uint32_t>(spec.runtime.tp_size);
  return h;
}

// Refuses a block whose header differs from this engine's, naming each field that differs.
void Engine::Impl::check_sequence_state_header(const SequenceStateHeader& got,
                                               std::uint64_t payload_bytes) const {
  const std::string_view what = "write_sequence_state: ";
  if (std::memcmp(got.magic, kSequenceStateMagic, sizeof(got.magic)) != 0) {
    fail(std::string(what) +
         "the block does not begin with a sequence-state header (KDASTATE, as "
         "read_sequence_state writes it)");
  }
  if (got.version != SequenceStateHeader::kVersion || got.header_bytes != sizeof(got)) {
    fail(std::string(what) + "the block's header is version " + std::to_string(got.version) +
         " of " + std::to_string(got.header_bytes) + " bytes; this engine reads version " +
         std::to_string(SequenceStateHeader::kVersion) + " of " + std::to_string(sizeof(got)));
  }
  const SequenceStateHeader want = sequence_state_header(payload_bytes);
  auto conv = [](std::uint32_t w) {
    return w == 0 ? std::string("no conv states (KDA cores)")
                  : "conv states of width " + std::to_string(w) + " (whole layers)";
  };
  auto dtype = [](std::uint32_t bytes) {
    return bytes == 4   ? std::string("fp32")
           : bytes == 2 ? std::string("bf16")
                        : std::to_string(bytes) + "-byte";
  };
  // Each field's words built only where it differs: a write allocates nothing.
  std::string differs;
  auto field = [&](bool same, auto&& block, auto&& engine) {
    if (!same) differs += (differs.empty() ? "" : "; ") + block() + ", this engine " + engine();
  };
  field(
      got.kda_layers == want.kda_layers,
      [&] { return std::to_string(got.kda_layers) + " KDA layers"; },
      [&] { return std::to_string(want.kda_layers); });
  field(
      got.num_heads == want.num_heads, [&] { return std::to_string(got.num_heads) + " heads"; },
      [&] { return std::to_string(want.num_heads); });
  field(
      got.head_dim == want.head_dim, [&] { return "head_dim " + std::to_string(got.head_dim); },
      [&] { return std::to_string(want.head_dim); });
  field(
      got.conv_width == want.conv_width, [&] { return conv(got.conv_width); },
      [&] { return conv(want.conv_width); });
  field(
      got.state_value_bytes == want.state_value_bytes,
      [&] { return dtype(got.state_value_bytes) + " states"; },
      [&] { return dtype(want.state_value_bytes); });
  field(
      got.tp_rank == want.tp_rank && got.tp_size == want.tp_size,
      [&] {
        return "tensor-parallel rank " + std::to_string(got.tp_rank) + " of " +
               std::to_string(got.tp_size);
      },
      [&] {
        return "rank " + std::to_string(want.tp_rank) + " of " + std::to_string(want.tp_size);
      });
  field(
      got.payload_bytes == want.payload_bytes,
      [&] { return std::to_string(got.payload_bytes) + " bytes of states"; },
      [&] { return std::to_string(want.payload_bytes); });
  if (!differs.empty()) fail(std::string(what) + "the block holds " + differs);
}

void Engine::read_sequence_state(int slot, void* host_dst, std::uint64_t bytes) const {
  const Impl& m = *impl_;
  m.check_sequence_state_buffer("read_sequence_state", slot, host_dst);
  m.check_sequence_state_size("read_sequence_state", bytes, sequence_state_bytes());
  m.check_current_device("read_sequence_state");
  const SequenceStateHeader header = m.sequence_state_header(bytes - sizeof(SequenceStateHeader));
  std::memcpy(host_dst, &header, sizeof(header));
  auto* at = static_cast<std::uint8_t*>(host_dst) + sizeof(header);
  m.for_each_slot_entry(slot, [&](std::uint8_t* entry, std::uint64_t entry_bytes) {
    m.backend->copy_to_host(at, entry, static_cast<std::size_t>(entry_bytes));
    at += entry_bytes;
  });
}

void Engine::write_sequence_state(int slot, const void* host_src, std::uint64_t bytes) {
  Impl& m = *impl_;
  const std::uint64_t expected = sequence_state_bytes();
  m.check_sequence_state_buffer("write_sequence_state", slot, host_src);
  if (bytes >= sizeof(SequenceStateHeader)) {
    SequenceStateHeader header;
    std::memcpy(&header, host_src, sizeof(header));
    m.check_sequence_state_header(header, expected - sizeof(SequenceStateHeader));
  }
  m.check_sequence_state_size("write_sequence_state", bytes, expected);
  m.check_acquired_for_write("write_sequence_state", slot);
  m.check_current_device("write_sequence_state");
  const auto* at = static_cast<const std::uint8_t*>(host_src) + sizeof(SequenceStateHeader);
  try {
    m.for_each_slot_entry(slot, [&](std::uint8_t* entry, std::uint64_t entry_bytes) {
      m.backend->copy_to_device(entry, at, static_cast<std::size_t>(entry_bytes));
      at += entry_bytes;
    });
  } catch (const Error&) {
    // The copies already enqueued still read the caller's block: let them finish before it may go
    // (the slot's states are then undefined: reset or rewrite it).
    try {
      synchronize();
    } catch (const Error&) {
    }
    throw;
  }
  synchronize();  // the host block may go when this returns
}

void Engine::write_slot_conv_state(int kda_index, int slot, int projection, const void* host_src) {
  Impl& m = *impl_;
  m.check_conv_state_access("write_slot_conv_state", kda_index, slot, projection, host_src);
  m.check_acquired_for_write("write_slot_conv_state", slot);
  m.check_current_device("write_slot_conv_state");
  m.backend->copy_to_device(m.slot_conv_state(kda_index, slot, projection), host_src,
                            static_cast<std::size_t>(m.conv_slot_bytes));
  synchronize();
}

void Engine::prefill_hidden(int kda_index, const void* hidden, void* out, Span<const int> slots,
                            Span<const std::int64_t> cu_seqlens, layer::Times* times) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_whole("prefill_hidden");
  m.check_prefill_batch("prefill_hidden", slots, cu_seqlens);
  m.stage_cu_seqlens(cu_seqlens);
  m.stage_slots(slots, &m.prefill_slots);
  m.run_whole(kda_index, "prefill_hidden", hidden, out, m.staged_prefill(slots.size()),
              m.cu_staging.data(), m.prefill_slots.host.data(), times);
}

void Engine::prefill_hidden(int kda_index, const void* hidden, void* out,
                            const BatchMetadata& batch, layer::Times* times) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_whole("prefill_hidden");
  m.check_metadata("prefill_hidden", batch, false);
  m.run_whole(kda_index, "prefill_hidden", hidden, out, batch, nullptr, nullptr, times);
}

void Engine::commit(std::int64_t sequences, const std::int32_t* slots,
                    const std::int32_t* num_accepted, int records_region) {
  Impl& m = *impl_;
  const std::string call = "commit";
  if (m.spec.runtime.max_verify_tokens == 0) {
    fail(call + ": " + m.spec.name +
         " keeps no records (runtime.max_verify_tokens is 0): a commit follows a records verify "
         "step (BatchMetadata::records), which needs runtime.max_verify_tokens > 0");
  }
  if (sequences < 1 || sequences > m.num_slots()) {
    fail(call + ": " + std::to_string(sequences) + " rows, expected 1.." +
         std::to_string(m.num_slots()) + " (runtime.max_sequences)");
  }
  m.check_region(call, "records_region", records_region);
  const auto region = static_cast<std::size_t>(records_region);
  // Every layer has run a records step, its last one of these rows and one token count. The shape
  // is what the host can check; it is not consumed by a commit, so that a graph of records steps
  // replayed before each eager commit (or a graph holding both) commits what its last replay
  // wrote. That the records are the last step's of these slots is the caller's promise.
  if (m.num_layers() == 0) fail(call + ": " + m.spec.name + " has no KDA layer, so no records");
  int decode_tokens = 0;
  for (int l = 0; l < m.num_layers(); ++l) {
    const Impl::PendingRecords& p = m.pending_records[static_cast<std::size_t>(l)][region];
    const std::string& label = m.layers[static_cast<std::size_t>(l)]->info().label;
    if (!p.pending) {
      fail(call + ": " + label + " has no records to commit (no records verify step ran on it)");
    }
    if (p.sequences != sequences || (decode_tokens != 0 && p.decode_tokens != decode_tokens)) {
      fail(call + ": " + label + "'s records step had " + std::to_string(p.sequences) +
           " rows of " + std::to_string(p.decode_tokens) + " tokens; the commit has " +
           std::to_string(sequences) + " rows" +
           (decode_tokens != 0 ? " of " + std::to_string(decode_tokens) + " tokens" : ""));
    }
    decode_tokens = p.decode_tokens;
  }
  if (slots == nullptr || num_accepted == nullptr) fail(call + ": slots or num_accepted is null");
  const auto n = static_cast<std::size_t>(sequences);
  m.check_index_arrays(call, n, {{slots, "slots"}, {num_accepted, "num_accepted"}});
  m.check_current_device(call.c_str());
  if (!m.backend->has_device_status()) {  // host memory: checked before anything is written
    m.claim_slots(call, "row", slots, n);
    for (std::size_t r = 0; r < n; ++r) {
      if (m.padding(slots[r])) continue;
      if (num_accepted[r] < 1 || num_accepted[r] > decode_tokens) {
        fail(call + ": row " + std::to_string(r) + " has num_accepted " +
             std::to_string(num_accepted[r]) + ", expected 1.." + std::to_string(decode_tokens) +
             " (the records step's decode_tokens)");
      }
    }
  }
  KDA_NVTX_RANGE("engine.commit");
  if (m.whole) {
    layer::CommitBatch batch;
    batch.sequences = sequences;
    batch.decode_tokens = decode_tokens;
    batch.slots = slots;
    batch.num_accepted = num_accepted;
    batch.padding_slot = m.null_slot;
    batch.device_status = m.device_status;
    layer::commit(backend(), layer_config(m.spec), batch, m.commit_states[region].data(),
                  m.num_layers(), m.layer_options(nullptr));
  } else {
    const EngineLayer& first = *m.layers.front();
    CommitProblem problem;
    problem.batch = sequences;
    problem.tokens = decode_tokens;
    problem.num_heads = first.decode_problem(1, 1).num_heads;
    problem.head_dim_k = problem.head_dim_v = m.spec.head_dim;
    problem.num_slots = m.num_slots();
    problem.state_dtype = m.spec.runtime.state_dtype;
    problem.padding_slot = m.null_slot;
    for (int at = 0; at < m.num_layers(); at += kMaxCommitLayers) {
      const int count = std::min(kMaxCommitLayers, m.num_layers() - at);
      const CommitLayer* layers = m.commit_layers[region].data() + at;
      const Status st =
          backend() == Backend::kCpu
              ? commit_cpu(problem, layers, count, slots, num_accepted, CpuOptions{m.cpu_threads})
              : commit_cuda(problem, layers, count, slots, num_accepted, m.device_status,
                            m.backend->stream(), m.unchecked);
      if (!st.ok()) throw Error(st, call);
    }
  }
}

void Engine::copy_slots(std::int64_t pairs, const std::int32_t* src, const std::int32_t* dst) {
  Impl& m = *impl_;
  const std::string call = "copy_slots";
  m.check_copy_count(call, pairs, "pairs");
  if (pairs == 0) return;
  if (src == nullptr || dst == nullptr) fail(call + ": src or dst is null");
  const auto n = static_cast<std::size_t>(pairs);
  m.check_index_arrays(call, n, {{src, "src"}, {dst, "dst"}});
  m.check_current_device(call.c_str());
  // Host memory: checked before anything is written. The device's: its kernel checks the range.
  if (!m.backend->has_device_status()) m.check_copy_pairs(call, src, dst, n);
  m.run_copy(call, pairs, src, dst);
}

void Engine::reset_slots(std::int64_t count, const std::int32_t* slots) {
  Impl& m = *impl_;
  const std::string call = "reset_slots";
  m.check_copy_count(call, count, "entries");
  if (count == 0) return;
  if (slots == nullptr) fail(call + ": slots is null");
  const auto n = static_cast<std::size_t>(count);
  m.check_index_arrays(call, n, {{slots, "slots"}});
  m.check_current_device(call.c_str());
  if (!m.backend->has_device_status()) {  // host memory: checked before anything is written
    for (std::size_t j = 0; j < n; ++j) {
      if (!m.padding(slots[j]) && !m.in_use(slots[j])) {
        fail(call + ": entry " + std::to_string(j) + " names slot " + std::to_string(slots[j]) +
             ", which is not an acquired slot");
      }
    }
  }
  m.run_copy(call, count, nullptr, slots);
}

void Engine::copy_slots(Span<const int> src, Span<const int> dst) {
  Impl& m = *impl_;
  const std::string call = "copy_slots";
  if (src.size() != dst.size()) {
    fail(call + ": src has " + std::to_string(src.size()) + " entries, dst " +
         std::to_string(dst.size()));
  }
  m.check_copy_count(call, src.size(), "pairs");
  if (src.empty()) return;
  Impl::check_span_data(call, src, "src");
  Impl::check_span_data(call, dst, "dst");
  m.check_copy_pairs(call, src.data(), dst.data(), src.size());
  m.check_current_device(call.c_str());
  m.stage_slots(src, &m.copy_src);
  m.stage_slots(dst, &m.copy_dst);
  m.run_copy(call, static_cast<std::int64_t>(src.size()), m.copy_src.device, m.copy_dst.device);
}

void Engine::decode_hidden(int kda_index, const void* hidden, void* out, Span<const int> slots,
                           int tokens, layer::Times* times) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_whole("decode_hidden");
  m.check_decode_batch("decode_hidden", slots, tokens);
  m.stage_slots(slots, &m.decode_slots);
  m.run_whole(kda_index, "decode_hidden", hidden, out, m.staged_decode(slots.size(), tokens),
              nullptr, m.decode_slots.host.data(), times);
}

void Engine::decode_hidden(int kda_index, const void* hidden, void* out, const BatchMetadata& batch,
                           layer::Times* times) {
  Impl& m = *impl_;
  m.check_layer(kda_index);
  m.check_whole("decode_hidden");
  m.check_metadata("decode_hidden", batch, true);
  m.run_whole(kda_index, "decode_hidden", hidden, out, batch, nullptr, nullptr, times);
}

}  // namespace kda::engine
