// kda/engine/engine.hpp — the KDA layers of a model, one memory arena, and a pool of state slots.
//
// An Engine plans its memory once (the spec's runtime.workspace_plan), allocates ONE arena (256-byte
// aligned host memory on the CPU backend, one kda::device_malloc on CUDA) and never allocates again:
// prefill and decode only enqueue work on buffers that already exist.
//
// State slots. Each KDA layer keeps a pool of runtime.max_sequences recurrent states [H, V, K] in
// the arena. A runtime gives each live sequence a slot:
//   int slot = engine.acquire_slot();            // lowest free slot, its state zeroed in every layer
//   engine.prefill(layer, inputs, out, {slot}, {0, n});   // per KDA layer, in order
//   engine.decode(layer, inputs, out, {slot}, 1);         // per KDA layer, each step
//   engine.release_slot(slot);                   // or reset_slot(slot) to start over
// prefill starts from the slot's current state — zero for a freshly acquired or reset slot, so a
// second prefill on the same slot continues the sequence (chunked prefill) — and leaves the
// sequence's final state in the slot; decode reads and updates it in place.
//
// Any slots, one launch. prefill and decode address each sequence's state by its slot index in the
// pool (kda::Problem::num_state_slots / kda::Tensors::state_slots): a batch whose slots are
// fragmented, reversed or strided is still one forward per layer, in place, with no gather or
// scatter copies.
//
// Errors throw kda::Error. Inputs and outputs passed to prefill/decode live on the engine's backend
// (host pointers for CPU, device pointers for CUDA); bf16 layouts as in kda/kda.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kda/engine/kda_layer.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/kda.hpp"
#include "kda/planner/memory_plan.hpp"

namespace kda::engine {

struct EngineOptions {
  // Unset: the spec's runtime.backend. See resolve_backend().
  std::optional<BackendChoice> backend;
  std::uint64_t seed = 0;        // random parameters (when the spec names no weights file)
  int cpu_threads = 0;           // CPU backend threads; 0: all hardware threads
  void* stream = nullptr;        // CUDA stream (cudaStream_t) for everything; nullptr: default
  // Synthetic inputs (kda-run, tests, benchmarks): when > 0, the plan gets scratch buffers
  // synthetic.{q,k,v,g,beta,out} for max(synthetic_tokens, max_sequences) tokens.
  std::int64_t synthetic_tokens = 0;
  // CUDA: check on every prefill / decode that the caller's pointers are device memory of the
  // current device, large enough (kda::CudaOptions::check_pointers). Costs host time per call.
  bool check_pointers = true;
};

// Inputs of one KDA layer: bf16 q, k, g [T, H, K], v [T, H, V], beta [T, H] (T = tokens of the
// batch, all sequences back to back; for decode T = batch * tokens), on the engine's backend.
struct LayerInputs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
};

// Timings of run_synthetic().
struct RunReport {
  Backend backend = Backend::kCpu;
  std::int64_t tokens = 0;
  std::int64_t sequences = 0;
  std::vector<int> slots;                   // the slots the run used
  std::vector<double> layer_seconds;        // prefill, per KDA layer (in order)
  double prefill_seconds = 0.0;             // sum of layer_seconds
  double upload_seconds = 0.0;              // generating + uploading inputs (not in the above)
  std::vector<double> decode_step_seconds;  // one entry per step: every KDA layer, 1 token/seq
};

struct RunOptions {
  std::int64_t tokens = 1024;  // total prefill tokens, split evenly over the sequences
  std::int64_t sequences = 1;
  int decode_steps = 0;        // after the prefill: steps of one token per sequence
  std::uint64_t seed = 0;      // synthetic inputs
  bool release_slots = true;   // false: leave the slots acquired (tests inspect their state)
  // Called after every layer of the prefill and after every decode step: (done, total).
  std::function<void(int, int)> progress;
};

// Which backend an engine for `spec` would use: kCpu / kCuda as asked; kAuto picks CUDA when a
// device is present and the CUDA backend can run the model's problems (K == V == 128), else CPU.
Backend resolve_backend(const ModelSpec& spec, BackendChoice choice);

// Throws kda::Error naming the model file, its `weights:` key and the resolved path when the spec
// names a weights file that does not exist or is a directory; nothing when it names none. The
// Engine constructor checks this; plan_for() reads no files, so callers that only plan (kda-run
// --plan-only) call it themselves.
void check_weights_file(const ModelSpec& spec);

class Engine {
 public:
  // Loads parameters, plans, allocates the arena, copies parameters in and zeroes every state
  // slot. Throws kda::Error (e.g. kBackendUnavailable when CUDA is asked for and absent).
  explicit Engine(ModelSpec spec, const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // The memory plan an engine for `spec` would use on `backend`, without allocating anything (so
  // a CPU-only machine can print a CUDA plan). Throws kda::Error.
  static planner::MemoryPlan plan_for(const ModelSpec& spec, Backend backend,
                                      std::int64_t synthetic_tokens = 0);

  const ModelSpec& spec() const noexcept { return spec_; }
  Backend backend() const noexcept { return backend_; }
  const planner::MemoryPlan& plan() const noexcept { return plan_; }
  // Size of the one allocation (= plan().arena_bytes; C: kda_engine_arena_bytes).
  std::uint64_t arena_bytes() const noexcept { return plan_.arena_bytes; }
  int num_layers() const noexcept { return static_cast<int>(layers_.size()); }  // KDA layers
  const KdaLayer& layer(int kda_layer) const;  // by position among the KDA layers
  void* stream() const noexcept { return stream_; }

  // ---- state slots ------------------------------------------------------------------------
  int num_slots() const noexcept { return static_cast<int>(slot_in_use_.size()); }
  int free_slots() const noexcept;
  bool slot_in_use(int slot) const noexcept;
  // Lowest free slot, its state zeroed in every layer. Throws when all slots are in use.
  int acquire_slot();
  void release_slot(int slot);
  // Zeroes the slot's state in every layer (the slot stays acquired).
  void reset_slot(int slot);
  std::uint64_t state_slot_bytes() const noexcept { return slot_bytes_; }
  // Copies one slot's state of one layer ([H, V, K] in the state dtype) to / from host memory
  // (synchronous). For tests, checkpoints and moving sequences between engines.
  void read_slot_state(int kda_layer, int slot, void* host_dst) const;
  void write_slot_state(int kda_layer, int slot, const void* host_src);

  // ---- forward ----------------------------------------------------------------------------
  // Prefill of one KDA layer for a batch: sequence j (tokens cu_seqlens[j] .. cu_seqlens[j+1]) uses
  // slots[j]. cu_seqlens is a host array of slots.size() + 1 entries: 0, non-decreasing, last at
  // most runtime.max_tokens; 1..max_sequences sequences on distinct acquired slots. `out`: bf16
  // [T, H, V]. Asynchronous on CUDA (synchronize() to wait).
  void prefill(int kda_layer, const LayerInputs& inputs, void* out, const std::vector<int>& slots,
               const std::vector<std::int64_t>& cu_seqlens);
  // Decode of one KDA layer: `tokens` (1..16) new tokens for each of slots.size() (1..max_sequences)
  // rows; inputs [B, tokens, ...], out bf16 [B, tokens, H, V]. A negative slot marks a padding row
  // (skipped, its out left untouched); the others must be distinct acquired slots.
  void decode(int kda_layer, const LayerInputs& inputs, void* out, const std::vector<int>& slots,
              int tokens);
  // Waits for everything enqueued (CUDA); no-op on the CPU.
  void synchronize() const;
  // What the kernels found that the host could not see (CUDA): broken cu_seqlens on the device or
  // gate parameters out of range (kda::DeviceStatusBit), accumulated over every forward since the
  // last check. Synchronizes the stream, reads the engine's device status word, clears it, and
  // throws kda::Error (kInvalidArgument) naming what was found. No-op on the CPU, whose forwards
  // throw such problems at once. Not for the hot path: call it where you synchronize anyway.
  void check_device_status();

  // ---- synthetic inputs -------------------------------------------------------------------
  // Requires EngineOptions::synthetic_tokens > 0. Generates random bf16 inputs on the host (seeded)
  // and copies them into the planned synthetic.* buffers, once.
  void generate_synthetic_inputs(std::uint64_t seed);
  std::int64_t synthetic_capacity() const noexcept { return synthetic_capacity_; }  // tokens
  // Inputs starting at token `token_offset` of the synthetic buffers, and the synthetic output.
  LayerInputs synthetic_inputs(std::int64_t token_offset = 0) const;
  void* synthetic_output() const noexcept { return synthetic_.out; }
  // Host copies of the generated inputs (q, k, g [cap, H, K]; v [cap, H, V]; beta [cap, H]).
  struct SyntheticHost {
    std::vector<std::uint16_t> q, k, v, g, beta;
  };
  const SyntheticHost& synthetic_host() const noexcept { return synthetic_host_; }

  // Acquires `sequences` slots, prefills every KDA layer on the synthetic inputs (tokens split as
  // evenly as possible, earlier sequences one longer), then runs `decode_steps` steps of one token
  // per sequence over every layer. Generates inputs first if not done yet (timed separately).
  RunReport run_synthetic(const RunOptions& options);

 private:
  struct ArenaDeleter {
    Backend backend;
    std::size_t bytes = 0;  // CPU: the mapping's length
    void operator()(std::uint8_t* ptr) const noexcept;
  };
  struct SyntheticBuffers {
    void* q = nullptr;
    void* k = nullptr;
    void* v = nullptr;
    void* g = nullptr;
    void* beta = nullptr;
    void* out = nullptr;
  };

  std::uint8_t* slot_state(int kda_layer, int slot) const noexcept;
  void zero_slot(int slot);
  void check_layer(int kda_layer) const;
  void copy_in(void* dst, const void* src, std::size_t bytes);  // host -> arena
  // CUDA: `callers` is kda::check_device_pointers() of the call's q, k, v, g, beta and out (throws
  // it, labelled), and the arena is on the current device too (throws).
  void check_on_device(const KdaLayer& layer, const char* what, const Status& callers) const;
  // Copies the batch's slot indices to `staging`'s device scratch, unless it holds them already.
  struct SlotStaging;
  void stage_slots(const std::vector<int>& slots, SlotStaging* staging);

  ModelSpec spec_;
  Backend backend_;
  void* stream_;
  CpuOptions cpu_;
  bool check_pointers_ = true;  // CUDA: the caller's buffers, once per prefill / decode call
  CudaOptions unchecked_;       // the operator calls: pointers already checked or the arena's own
  std::uint32_t* device_status_ = nullptr;  // CUDA: the engine's device status word (arena)
  std::vector<KdaLayer> layers_;
  planner::MemoryPlan plan_;
  std::unique_ptr<std::uint8_t, ArenaDeleter> arena_;
  std::uint64_t slot_bytes_ = 0;
  std::vector<char> slot_in_use_;

  // Prefill staging: the batch's int64 cu_seqlens.
  std::int64_t* cu_scratch_ = nullptr;
  std::vector<std::int64_t> cu_staging_;   // host, capacity fixed at construction
  std::vector<std::int64_t> cu_uploaded_;  // what cu_scratch_ holds now (skip repeat uploads)
  std::vector<unsigned> seen_stamp_;       // duplicate-slot detection without clearing
  unsigned stamp_ = 0;
  // Slot staging: int32 slot indices (-1 for padding), one per kind of call.
  struct SlotStaging {
    std::int32_t* device = nullptr;      // arena scratch
    std::vector<std::int32_t> host;      // capacity fixed at construction
    std::vector<std::int32_t> uploaded;  // what `device` holds now (skip repeat uploads)
  };
  SlotStaging prefill_slots_, decode_slots_;

  std::int64_t synthetic_capacity_ = 0;
  SyntheticBuffers synthetic_;
  SyntheticHost synthetic_host_;
};

}  // namespace kda::engine
