// kda/engine/engine.hpp — the KDA layers of a model, one memory arena, and a pool of state slots.
//
// An Engine plans its memory once (the spec's runtime.workspace_plan), allocates ONE arena
// (256-byte aligned host memory on the CPU backend, one kda::device_malloc on CUDA) and never
// allocates again: prefill and decode only enqueue work on buffers that already exist. Everything
// the engine keeps for its layers is in the arena, the whole layers' weights included
// (weight_bytes()): on CUDA all of its device memory, on the CPU the fp32 weights too.
//
// State slots. Each KDA layer keeps a pool of runtime.max_sequences recurrent states [H, V, K] in
// the arena. A runtime gives each live sequence a slot:
//   int slot = engine.acquire_slot();              // lowest free slot, zeroed in every layer
//   engine.prefill(layer, inputs, out, {slot}, {0, n});  // per KDA layer, in order
//   engine.decode(layer, inputs, out, {slot}, 1);        // per KDA layer, each step
//   engine.release_slot(slot);                     // or reset_slot(slot) to start over
// prefill starts from the slot's current state — zero for a freshly acquired or reset slot, so a
// second prefill on the same slot continues the sequence (chunked prefill) — and leaves the
// sequence's final state in the slot; decode reads and updates it in place.
//
// Any slots, one launch. prefill and decode address each sequence's state by its slot index in the
// pool (kda::Problem::num_state_slots / kda::Tensors::state_slots): a batch whose slots are
// fragmented, reversed or strided is still one forward per layer, in place, with no gather or
// scatter copies.
//
// Whole layers. By default (runtime.layers: whole) each KDA layer is the whole Kimi Delta Attention
// layer (kda/layer/layer.hpp): hidden states [T, hidden_size] in, hidden states out, through the
// projections, the short convolutions, the KDA core, the gated RMSNorm and the output projection.
// A slot then holds a sequence's whole state in every layer: its conv states (q, k, v; the last
// W-1 pre-conv inputs of each channel) and its recurrent state, all zeroed on acquire / reset:
//   int slot = engine.acquire_slot();
//   for (int l = 0; l < engine.num_layers(); ++l)       // x: [T, hidden] in, [T, hidden] out
//     engine.prefill_hidden(l, x, y, {slot}, {0, T});  // (the host runs the other layers between)
//   engine.decode_hidden(l, x1, y1, {slot}, 1);        // per layer, each step
// Weights come from the YAML's `weights:` checkpoint by their Hugging Face names under
// ModelSpec::tensor_prefix (load_layer_weights), or are seeded random. With runtime.tp_size > 1 the
// engine holds its rank's heads of every layer and prefill_hidden / decode_hidden write this rank's
// PARTIAL SUM of the layer output: the host runtime all-reduces (sums) `out` over the ranks. The
// core-only calls (prefill / decode) work on a whole-layer engine too, on the same recurrent states
// (q, k, v, g, beta then have the engine's local heads); runtime.layers: core (or
// EngineOptions::layer_mode) makes an engine of cores only, which plans no conv states and a
// smaller workspace.
//
// The engine is the runtime only: synthetic inputs and timed runs live in examples/ (kda-run's
// synthetic_run.hpp). Its state is private (a pimpl), so this header shows only the API.
//
// Errors throw kda::Error. Inputs and outputs passed to prefill/decode live on the engine's backend
// (host pointers for CPU, device pointers for CUDA); bf16 layouts as in kda/kda.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/engine/communicator.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/kda.hpp"
#include "kda/layer/layer.hpp"
#include "kda/planner/memory_plan.hpp"

namespace kda::engine {

// A read-only view of `size` consecutive values (C++17 has no std::span): what prefill / decode
// take for slots and cu_seqlens, so a caller passes a std::vector, a braced list ({slot}, {0, n})
// or a pointer and a count, without a copy. It does not own the values: a braced list lives until
// the end of the full expression, which covers the call.
template <typename T>
class Span {
  static_assert(std::is_const<T>::value, "Span<const T>: a read-only view");

 public:
  using value_type = std::remove_cv_t<T>;
  constexpr Span() noexcept = default;
  constexpr Span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  template <typename A>
  Span(const std::vector<value_type, A>& values) noexcept  // NOLINT: implicit by design
      : data_(values.data()), size_(values.size()) {}
// GCC warns that the view does not extend the braced list's lifetime: it is not meant to (see
// above), and the warning would reach every user of this header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  constexpr Span(std::initializer_list<value_type> values) noexcept  // NOLINT: implicit by design
      : data_(values.begin()), size_(values.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  constexpr T* begin() const noexcept { return data_; }
  constexpr T* end() const noexcept { return data_ + size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

struct EngineOptions {
  // Unset: the spec's runtime.backend. See resolve_backend().
  std::optional<BackendChoice> backend;
  std::uint64_t seed = 0;  // random parameters (when the spec names no weights file)
  int cpu_threads = 0;     // CPU backend threads; 0: all hardware threads; negative: refused
  void* stream = nullptr;  // CUDA stream (cudaStream_t) for everything; nullptr: default
  // CUDA: check on every prefill / decode that the caller's pointers are device memory of the
  // current device, large enough (kda::CudaOptions::check_pointers). Costs host time per call.
  bool check_pointers = true;
  // Fill the arena with 0xFF bytes (NaN in bf16 and f32) as soon as it is allocated, before the
  // weights and the zeroed state pools are written into it, and each layer's workspace again
  // before every call that runs the layer (in stream order: a captured call's replays refill it): a
  // debugging aid, so that a read of arena memory no call wrote, or of workspace bytes an earlier
  // call left, shows as NaN in an output rather than as whatever the allocator or that call left
  // there. Costs one memset of the arena at construction (on the CPU it also touches every page of
  // it) and one of the layer's workspace per layer call; no result changes. Off by default; the
  // project's engine tests run with it on.
  bool poison_arena = false;
  // CUDA: the prefill's schedule (kda::CudaOptions::schedule); kAuto picks per call from the
  // shape. Unset: the spec's runtime.prefill_schedule (auto by default); Engine::spec() reports
  // the schedule in effect. Unknown values throw at construction.
  std::optional<PrefillSchedule> prefill_schedule;
  // CUDA whole layers: how a decode step runs (kda::layer::RunOptions::decode_kernel; kAuto runs a
  // step of up to a few sequences in one launch, LAYER.md). Unset: the spec's runtime.decode_step
  // (auto by default); Engine::spec() reports the choice in effect. Unknown values throw at
  // construction.
  std::optional<layer::DecodeKernel> decode_step;
  // Unset: the spec's runtime.layers (whole by default). Engine::spec() reports the mode in effect.
  std::optional<LayerMode> layer_mode;
  // Tensor parallelism (runtime.tp_size > 1, whole layers): the group of this rank, not owned (it
  // must outlive the engine). With it every prefill_hidden / decode_hidden all-reduces its output
  // in place (bf16, communicator.hpp), so that each rank returns the whole layer's output rather
  // than its shard's partial sum. Its size and rank must be the spec's tp_size and tp_rank and its
  // memory the engine's backend's. Null: the output is the partial sum (the host all-reduces).
  Communicator* communicator = nullptr;
  // Context parallelism (tp_size 1, an f32 state; the cores alone or whole layers): the group
  // whose ranks share long prefills (prefill_context_parallel, prefill_hidden_context_parallel),
  // not owned; this engine is its rank context_group->rank(), its memory the engine's backend's.
  // Null: none.
  Communicator* context_group = nullptr;
  // A caller-chosen null slot, for runtimes that pad the batches of their CUDA graphs with a
  // reserved slot index rather than a negative one (vLLM reserves slot 0 in some configurations).
  // Negative (the default): none, only negative entries are padding. Otherwise in
  // [0, runtime.max_sequences): a batch entry equal to it is padding exactly as a negative one —
  // a decode row (a verify row whose start entry it is; a verify row's per-token entry equal to it
  // keeps no state), a prefill sequence, a checkpoint request — and may appear any number of
  // times. The slot is one of the pool's runtime.max_sequences slots, never acquired: the engine
  // then holds at most max_sequences - 1 sequences at once (raise max_sequences by one to keep as
  // many), while a batch still has up to max_sequences rows, padding included. Its states are
  // never read or written by a forward. Needs max_sequences >= 2.
  int null_slot = -1;
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

// A batch whose per-step metadata the caller keeps in the engine's backend memory — device memory
// on CUDA, host memory on the CPU — and rewrites before each call, or before each replay of calls
// captured in a CUDA graph: the engine reads slots and cu_seqlens only where the kernels run, and
// stages nothing. Only the bounds below and the scalar fields (checkpoints, records, the regions)
// are host values, fixed when a call is made (or captured).
// On CUDA what is wrong in the metadata can only be seen on the device: a slot outside the pool or
// broken cu_seqlens set a bit of the device status word (check_device_status()); a slot outside
// the pool makes its row a padding row, and after broken cu_seqlens the batch's outputs and states
// are unspecified (every access stays in bounds, as kda::Tensors::device_status says). That the
// slots are acquired and distinct is the caller's promise there.
// On the CPU the same metadata is checked before anything runs and a bad batch throws.
struct BatchMetadata {
  std::int64_t tokens = 0;     // rows of hidden: prefill cu_seqlens[sequences], at most
                               // runtime.max_tokens; decode sequences * decode_tokens
  std::int64_t sequences = 0;  // prefill sequences or decode rows, 1..runtime.max_sequences
  int decode_tokens = 0;       // 0: a prefill; 1..kda::kMaxDecodeTokens: a decode step
  // int32 [sequences]: each row's state slot; negative (or EngineOptions::null_slot): a padding
  // row, which reads and writes no state (whole layers: its out is zeros; the core alone: as
  // kda::Tensors::state_slots).
  const std::int32_t* slots = nullptr;
  // Prefill: int64 [sequences + 1], 0, non-decreasing, last == tokens. Decode: not read.
  const std::int64_t* cu_seqlens = nullptr;
  // Prefill, instead of cu_seqlens: the same offsets as int32 (vLLM's and SGLang's
  // query_start_loc), which the kernels read as they are (no conversion, no copy). A prefill sets
  // exactly one of the two (kda::Error naming both otherwise). Decode: not read.
  const std::int32_t* cu_seqlens_i32 = nullptr;
  // Decode only, optional: a speculative verify step. int32 [sequences], each in
  // [1, decode_tokens]; `slots` is then [sequences, decode_tokens]: row r starts from the states in
  // slots[r][num_accepted[r] - 1] and keeps its states after token t in slots[r][t] (negative: not
  // kept; every non-negative entry an acquired slot, none twice); a row whose start entry is
  // negative is padding (kda::DecodeProblem::verify, kda::layer::Batch::num_accepted). CUDA: a
  // count outside the range is reported by check_device_status() and its row skipped.
  const std::int32_t* num_accepted = nullptr;
  // Decode only, optional: the record-and-commit form of a verify step
  // (kda::DecodeProblem::records, kda::layer::Batch::records), with num_accepted null: `slots` is
  // [sequences], each row's committed slot (distinct acquired slots; negative or the null slot:
  // padding). The step reads the slots' states, writes out (the per-token-states form's) and the
  // layer's records into buffers the engine keeps for it (runtime.max_verify_tokens, at least
  // decode_tokens), and writes no state: Engine::commit() then folds each row's accepted tokens
  // into its slot, for every KDA layer at once. One state per sequence instead of one per draft
  // token.
  bool records = false;
  // Decode only, with runtime.record_regions 2: the records region (0 or 1) a records step writes.
  // A runtime that folds (below) alternates it from one records step to the next.
  int records_region = 0;
  // Decode only, optional: the commit of the last records step that wrote records region
  // `fold_region` deferred into this step, instead of Engine::commit() (kda::layer::Batch::
  // fold_sequences, kda::DecodeProblem::fold_batch; whole layers and cores alike). int32
  // [sequences] each, in the backend's memory: row r starts from its slot after folding in the
  // first fold_counts[r] tokens of that records step's row fold_rows[r] (the row that read the
  // same slot; negative: nothing to fold), recurrent and conv states, with the commit's
  // operations, so outs and states equal Engine::commit() followed by this step. A plain or
  // records step may fold (not one with num_accepted); a records step that folds writes the other
  // region (records_region != fold_region) and stores the folded states in its slots. Each state
  // is then read and written once a step. Every KDA layer must have run a records step on that
  // region (its last one there gives the fold's rows and tokens; the caller promises that nothing
  // wrote the slots since). The CPU refuses a fold row outside that step's rows or a count outside
  // [1, its decode_tokens]; CUDA writes that row as padding and reports it through
  // check_device_status().
  const std::int32_t* fold_rows = nullptr;
  const std::int32_t* fold_counts = nullptr;
  int fold_region = 0;
  // Prefill only, optional: prefix-cache checkpoints, `checkpoints` (K) requests per sequence,
  // int64 checkpoint_offsets [sequences, K] and int32 checkpoint_slots [sequences, K]: request k of
  // sequence j writes the states after checkpoint_offsets[j][k] of its tokens (-1: none; a
  // multiple of 16, or its length) into acquired slot checkpoint_slots[j][k] (-1: none), the conv
  // states too for whole layers (kda::layer::Batch::checkpoints). The slots written are distinct
  // and none is a `slots` entry. CUDA: read on the device only; a bad offset, a slot outside the
  // pool or one named twice by the requests is reported by check_device_status() and that request
  // skipped (kda.hpp, Problem::checkpoints).
  std::int64_t checkpoints = 0;
  const std::int64_t* checkpoint_offsets = nullptr;
  const std::int32_t* checkpoint_slots = nullptr;
};

// One KDA layer of an engine, as messages and tables name it, and its gate parameters.
struct LayerInfo {
  int model_layer = 0;       // 1-based, as the YAML's kda_layers lists it ("layer 5")
  int kda_index = 0;         // 0-based position among the KDA layers: the `kda_index` of every call
  std::string label;         // "layer 5 (KDA index 3)"
  std::vector<float> A_log;  // [local heads], host copy of what the layer runs with
  std::vector<float> dt_bias;  // [local heads * head_dim]
  std::string origin;          // "random (seed S)" or the checkpoint path
};

// The kda::layer::Config of every KDA layer of `spec` (this rank's tensor-parallel shard): what
// an engine of whole layers builds them with, and what sizes their weight images and workspaces.
layer::Config layer_config(const ModelSpec& spec);

// Which backend an engine for `spec` would use: kCpu / kCuda as asked; kAuto picks CUDA when
// cuda_backend_available() and the CUDA backend can run the model's problems (K == V == 128), else
// CPU. `why` (optional) gets the reason in a few words, for a front end to show (the library prints
// nothing): "asked for" (kCpu / kCuda); for kAuto "a CUDA device can run it", or why not: the
// machine's reason (cuda_backend_available()) or the model's ("head_dim 64 (the CUDA whole layer
// needs 128)").
Backend resolve_backend(const ModelSpec& spec, BackendChoice choice, std::string* why = nullptr);

// Whether this machine can run the CUDA backend at all: the build has it, a device is present and
// the kernels are built for it (compute capability 9.0). `why_not` (optional) gets the reason when
// not ("this build has no CUDA backend", "no CUDA device found", or the device and its compute
// capability), and is cleared when it can.
bool cuda_backend_available(std::string* why_not = nullptr);

// Throws kda::Error naming the model file, its `weights:` key and the resolved path when the spec
// names a weights file that does not exist or a directory holding no checkpoint; nothing when it
// names none. The
// Engine constructor checks this; plan_for() reads no files, so callers that only plan (kda-run
// --plan-only) call it themselves.
void check_weights_file(const ModelSpec& spec);

// The first 64 bytes of a sequence-state block (Engine::read_sequence_state), in the host's byte
// order: what the block holds, so that a write can refuse a block of another layout.
struct SequenceStateHeader {
  char magic[8];                // "KDASTATE"
  std::uint32_t version;        // kVersion
  std::uint32_t header_bytes;   // sizeof(SequenceStateHeader): the payload's offset
  std::uint64_t payload_bytes;  // the states' bytes after the header
  std::uint32_t kda_layers;     // layers in the block, in the engine's order
  std::uint32_t num_heads;      // every rank's heads (ModelSpec::num_heads)
  std::uint32_t head_dim;       // K = V
  std::uint32_t conv_width;     // W of the conv states that follow each recurrent state; 0: none
  std::uint32_t state_value_bytes;  // 4 (fp32 states) or 2 (bf16)
  std::uint32_t tp_rank, tp_size;   // whose heads: local_heads = num_heads / tp_size
  std::uint32_t reserved[3];        // written zero, not read
  static constexpr std::uint32_t kVersion = 1;
};
static_assert(sizeof(SequenceStateHeader) == 64 &&
                  offsetof(SequenceStateHeader, payload_bytes) == 16 &&
                  offsetof(SequenceStateHeader, kda_layers) == 24 &&
                  offsetof(SequenceStateHeader, tp_size) == 48 &&
                  std::is_trivially_copyable<SequenceStateHeader>::value,
              "a sequence-state header is the 64 bytes kda_engine.h describes");

class Engine {
 public:
  // Loads parameters, plans, allocates the arena, copies parameters in and zeroes every state
  // slot. Throws kda::Error (e.g. kBackendUnavailable when CUDA is asked for and absent).
  explicit Engine(ModelSpec spec, const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // The memory plan an engine for `spec` would use on `backend` (with spec.runtime.layer_mode),
  // without allocating anything (so a CPU-only machine can print a CUDA plan). Throws kda::Error;
  // for kCuda, kUnsupported naming why when the CUDA backend cannot run the model (head_dim not
  // 128, a conv width outside 2..4, a grid too large), whatever this machine has, but for a
  // machine whose GPU the kernels are not built for (there the model's obstacles cannot be told
  // from the device's, and none is refused).
  // `context_ranks`: the size of the EngineOptions::context_group the engine will have (its
  // context-parallel buffers grow with it); 0, the default: none.
  static planner::MemoryPlan plan_for(const ModelSpec& spec, Backend backend,
                                      int context_ranks = 0);

  const ModelSpec& spec() const noexcept;
  Backend backend() const noexcept;
  const planner::MemoryPlan& plan() const noexcept;
  // Size of the one allocation (= plan().arena_bytes; C: kda_engine_arena_bytes).
  std::uint64_t arena_bytes() const noexcept;
  int num_layers() const noexcept;              // KDA layers
  const LayerInfo& layer(int kda_index) const;  // by KDA index
  LayerMode layer_mode() const noexcept;
  // The kernel the last decode step of a CUDA whole layer ran (kOneLaunch, kFusedFactors, kFused or
  // kSeparate: layer::RunOptions::decode_kernel_ran), so that a runtime sees what its captured
  // graphs hold and which batch sizes take the one-launch step; kAuto where the layer has run no
  // such step (none yet, the CPU, core-only layers); a step of no rows leaves it as it was.
  // Recorded when the step is enqueued: a capture records it once, its replays do not change it.
  // Throws kda::Error for a bad index.
  layer::DecodeKernel decode_step_ran(int kda_index) const;
  // Where the layers' weights came from ("random (seed S)" or the checkpoint), and, whole layers,
  // the bytes they take in the arena: each layer's persistent `layer{n}.weights` buffer of the
  // plan, kda::layer's weight image of the backend (bf16 on CUDA, fp32 on the CPU); 0 for cores.
  const std::string& weights_origin() const noexcept;
  std::uint64_t weight_bytes() const noexcept;
  void* stream() const noexcept;

  // ---- state slots ------------------------------------------------------------------------
  int num_slots() const noexcept;   // the pool: runtime.max_sequences, the null slot included
  int free_slots() const noexcept;  // slots acquire_slot() can still hand out
  // EngineOptions::null_slot in effect: the padding slot index, never acquired; -1: none.
  int null_slot() const noexcept;
  bool slot_in_use(int slot) const noexcept;
  // Lowest free slot (never the null slot), its state zeroed in every layer. Throws when all
  // slots are in use.
  int acquire_slot();
  void release_slot(int slot);
  // Zeroes the slot's state in every layer, conv states included (the slot stays acquired).
  // acquire_slot and reset_slot stage the slot's index in the engine's scratch (reset.slot) from
  // pageable host memory, then zero it in one launch: eager calls, not for a stream capture
  // (reset_slots zeroes slots a device array names inside a captured graph).
  void reset_slot(int slot);
  std::uint64_t state_slot_bytes() const noexcept;
  // Copies one slot's state of one layer ([H, V, K] in the state dtype) to / from host memory
  // (synchronous). For tests, checkpoints and moving sequences between engines. The writes (this
  // and write_slot_conv_state) take an acquired slot or the null slot, and refuse a free one.
  void read_slot_state(int kda_index, int slot, void* host_dst) const;
  void write_slot_state(int kda_index, int slot, const void* host_src);
  // Whole layers: one slot's conv state of one layer and projection (0 q, 1 k, 2 v), bf16
  // [local_heads * head_dim, W - 1] (oldest input first), to / from host memory (synchronous).
  std::uint64_t conv_state_slot_bytes() const noexcept;
  void read_slot_conv_state(int kda_index, int slot, int projection, void* host_dst) const;
  void write_slot_conv_state(int kda_index, int slot, int projection, const void* host_src);
  // A sequence's whole state, every layer's, as one host block (synchronous): for a runtime that
  // moves sequences to host memory and back (preemption, a host-side prefix cache) or between
  // engines of one model. sequence_state_bytes() is its size: a SequenceStateHeader, then per KDA
  // layer, in order, the recurrent state [H, V, K] (state dtype), then with whole layers the q, k
  // and v conv states (bf16 [local_heads * head_dim, W - 1] each). read_sequence_state() copies
  // slot `slot`'s states out, write_sequence_state() into an acquired slot; `bytes` must equal
  // sequence_state_bytes(). The write refuses, before it copies anything, a block whose header
  // does not describe this engine's layout: another layer count, head count, head size, conv
  // width, state dtype or tensor-parallel rank (another rank's block has the same size and other
  // heads). A block of another model of the same layout is not told apart. A write that fails
  // part way (a CUDA error) leaves the slot's states undefined.
  std::uint64_t sequence_state_bytes() const noexcept;
  void read_sequence_state(int slot, void* host_dst, std::uint64_t bytes) const;
  void write_sequence_state(int slot, const void* host_src, std::uint64_t bytes);

  // ---- forward ----------------------------------------------------------------------------
  // Prefill of one KDA layer for a batch: sequence j (tokens cu_seqlens[j] .. cu_seqlens[j+1]) uses
  // slots[j]. cu_seqlens is a host array of slots.size() + 1 entries: 0, non-decreasing, last at
  // most runtime.max_tokens; 1..max_sequences sequences on distinct acquired slots (a negative
  // slot: a padding sequence, which reads and writes no state). `out`: bf16 [T, H, V]. Asynchronous
  // on CUDA (synchronize() to wait).
  void prefill(int kda_index, const LayerInputs& inputs, void* out, Span<const int> slots,
               Span<const std::int64_t> cu_seqlens);
  // Decode of one KDA layer: `tokens` (1..16) new tokens for each of slots.size()
  // (1..max_sequences) rows; inputs [B, tokens, ...], out bf16 [B, tokens, H, V]. A negative slot
  // marks a padding row (skipped, its out left untouched); the others must be distinct acquired
  // slots.
  void decode(int kda_index, const LayerInputs& inputs, void* out, Span<const int> slots,
              int tokens);
  // Whole layers (runtime.layers: whole): prefill of one KDA layer on hidden states, bf16
  // [T, hidden_size] in and out (out not overlapping hidden; with tp_size > 1 a partial sum to
  // all-reduce). Slots and cu_seqlens as prefill(): each sequence starts from its slot's conv and
  // recurrent states and leaves its new ones there. `times` (optional) gets the seconds of each
  // phase added (on CUDA measured with events, which makes the call wait for the layer).
  void prefill_hidden(int kda_index, const void* hidden, void* out, Span<const int> slots,
                      Span<const std::int64_t> cu_seqlens, layer::Times* times = nullptr);
  // Decode of one whole layer: `tokens` (1..16) new tokens for each of slots.size() rows, hidden
  // and out [B * tokens, hidden_size]. A negative slot marks a padding row (its out zeros, no
  // state touched); the others are distinct acquired slots.
  void decode_hidden(int kda_index, const void* hidden, void* out, Span<const int> slots,
                     int tokens, layer::Times* times = nullptr);
  // The same four calls on caller-owned batch metadata (BatchMetadata): nothing is staged or
  // synchronized, so a sequence of them can be captured in a CUDA graph once per bucket of bounds
  // and replayed with whatever slots and cu_seqlens the caller has written since. `tokens` and
  // `sequences` are the bounds; `decode_tokens` picks prefill (0) or decode. The whole-layer ones
  // need whole layers, as above.
  void prefill(int kda_index, const LayerInputs& inputs, void* out, const BatchMetadata& batch);
  void decode(int kda_index, const LayerInputs& inputs, void* out, const BatchMetadata& batch);
  void prefill_hidden(int kda_index, const void* hidden, void* out, const BatchMetadata& batch,
                      layer::Times* times = nullptr);
  void decode_hidden(int kda_index, const void* hidden, void* out, const BatchMetadata& batch,
                     layer::Times* times = nullptr);

  // The commit of a record-and-commit verify step (BatchMetadata::records): folds the first
  // num_accepted[r] tokens of each row r of the last records step into slots[r] of EVERY KDA layer
  // (recurrent states, and conv states with whole layers), after which each slot holds what a
  // per-token-states verify step would have kept after token num_accepted[r] - 1. slots and
  // num_accepted are int32 [sequences] in the backend's memory (as BatchMetadata's): the records
  // step's slots (padding rows touch nothing), each count in [1, decode_tokens]. Every KDA layer
  // must have run a records step, its last of `sequences` rows (the same decode_tokens), on those
  // slots; the host checks the shape only and does not consume it (a graph of records steps may be
  // replayed before each eager commit), the slots and that nothing wrote their states since are
  // the caller's promise. One operator
  // commit launch per kda::kMaxCommitLayers layers plus one conv launch on CUDA: nothing staged,
  // allocated or synchronized, so it is captured in a CUDA graph with the verify steps. The CPU
  // checks the slots (acquired, distinct) and the counts and throws before writing; CUDA reports
  // a bad count or slot through check_device_status() and skips that row.
  // `records_region`: the region that records step wrote (BatchMetadata::records_region).
  void commit(std::int64_t sequences, const std::int32_t* slots, const std::int32_t* num_accepted,
              int records_region = 0);

  // ---- copying states between slots -----------------------------------------------------------
  // Copies slot src[i]'s states into slot dst[i] in EVERY KDA layer: the recurrent states, and
  // with whole layers the conv states. For a request that starts from a cached prefix's checkpoint
  // slot without consuming it (the checkpoint stays for the next request), and for a sequence
  // forked for parallel sampling or beam search. src and dst: int32 [pairs] in the backend's memory
  // (as BatchMetadata's), pairs in 0..max_sequences; a pair with a negative entry or the null slot
  // on either side is padding (nothing copied). Every other entry is an acquired slot, the
  // destinations distinct and none of them also a source (one source may be copied into several
  // destinations). The CPU checks all of it and throws before writing; CUDA reads the pairs on the
  // device only, one operator launch per kda::kMaxCopyPools pools (a layer has one, four with its
  // conv states): nothing staged, allocated or synchronized, so it is captured in a CUDA graph and
  // replays with the pairs the caller wrote since. There an entry outside the pool is reported by
  // check_device_status() and its pair skipped; that the entries are acquired and the
  // destinations distinct is the caller's promise. Ordered with the forwards on the engine's
  // stream; records waiting for a commit are not copied.
  void copy_slots(std::int64_t pairs, const std::int32_t* src, const std::int32_t* dst);
  // The same from host spans of equal length, checked as on the CPU on both backends, then staged
  // into the engine's scratch (not for capture).
  void copy_slots(Span<const int> src, Span<const int> dst);
  // Zeroes the states of `count` slots in every KDA layer (recurrent and conv states), as
  // reset_slot() does one at a time: slots int32 [count] in the backend's memory, count in
  // 0..max_sequences, a negative entry or the null slot padding, an entry may repeat. The CPU
  // checks that every other entry is an acquired slot and throws before writing; CUDA reads them
  // on the device only (the operator's zeroing, kda::zero_slots_cuda: one launch per
  // kda::kMaxCopyPools pools, capturable), reports an entry outside the pool through
  // check_device_status() and skips it. For a runtime that starts new sequences inside a captured
  // prefill bucket: their slots zeroed in the same graph, before the prefill.
  void reset_slots(std::int64_t count, const std::int32_t* slots);

  // Context parallelism (EngineOptions::context_group): the prefill of one long sequence split
  // over the group, this rank holding `tokens` consecutive tokens of it (rank r the r-th range;
  // q..beta of its range back to back, out the same rows), every rank with the sequence's initial
  // state in its `slot` (the same on each: zeros for a new sequence). Each rank computes its
  // range's segment transition, the group all-gathers them, each chains its range's true initial
  // state from the transitions before it and prefills its range from there: out is the one-engine
  // prefill's to rounding. Afterwards every rank's `slot` holds the sequence's final state (the
  // ranks before the last apply the transitions after theirs). Every rank calls it for the same
  // layer; a rank may hold 0 tokens.
  void prefill_context_parallel(int kda_index, const LayerInputs& inputs, void* out, int slot,
                                std::int64_t tokens);
  // The same for whole layers (runtime.layers: whole, tp_size 1): this rank's `tokens` consecutive
  // rows of the sequence's hidden states in, the same rows of the layer's output out (bf16
  // [tokens, hidden_size], as prefill_hidden), every rank with the sequence's initial conv and
  // recurrent states in its `slot` (the same on each). Besides the recurrent state, a range depends
  // on the ranges before it through the short convolution: its first W-1 tokens read the W-1
  // pre-conv inputs before it. So each rank first projects its last min(tokens, W-1) rows, the
  // group all-gathers these conv histories (with each rank's token count, so that ranges shorter
  // than W-1 — 0 tokens included — pass on the history before them), and each rank forms on the
  // host the conv state at its range's start (from the slot's initial one and the ranks before
  // it). Then the core's path: each rank's segment transition from its core inputs (projections
  // and conv from that conv state, layer::Layer::core_inputs), all-gathered, chained into the
  // recurrent state at its start, and the whole layer's prefill of its range from those two states
  // (prefill_hidden's forward): out is the one-engine prefill_hidden's to rounding (rank 0's rows
  // bit for bit on the CPU). Afterwards every rank's `slot` holds the sequence's final states: the
  // ranks before the last apply the transitions after theirs and take the final conv state from
  // the gathered histories. Every rank calls it for the same layer; a rank may hold 0 tokens. On
  // CUDA the host reads the gathered histories, so the call waits for the work before it (once).
  void prefill_hidden_context_parallel(int kda_index, const void* hidden, void* out, int slot,
                                       std::int64_t tokens);

  // Waits for everything enqueued (CUDA); no-op on the CPU.
  void synchronize() const;
  // What the kernels found that the host could not see (CUDA): broken cu_seqlens on the device or
  // gate parameters out of range (kda::DeviceStatusBit), accumulated over every forward since the
  // last check. Synchronizes the stream, reads the engine's device status word, clears it, and
  // throws kda::Error (kInvalidArgument) naming what was found. No-op on the CPU, whose forwards
  // throw such problems at once. Not for the hot path: call it where you synchronize anyway.
  void check_device_status();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kda::engine
