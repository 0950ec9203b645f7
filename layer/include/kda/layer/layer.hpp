// kda/layer/layer.hpp — one whole Kimi Delta Attention layer as an operator: hidden states in,
// hidden states out, for a varlen batch of prefills or a batch of decode steps, on the CPU or on
// CUDA behind one interface.
//
// For hidden states x [T, E] (bf16), local heads Hl, head dim D, Cl = Hl·D, conv width W:
//   q, k, v = SiLU(causal depthwise conv1d_W(x·W_{q,k,v}ᵀ))   per sequence, from its conv state
//   g_raw   = (x·W_faᵀ)·W_fbᵀ            β_raw = x·W_bᵀ
//   o       = KDA(q, k, v, g_raw, β_raw; A_log, dt_bias)      the operator (kda/kda.hpp)
//   y       = RMSNorm_D(o) · o_norm ⊙ sigmoid((x·W_gaᵀ)·W_gbᵀ [+ g_b bias])   per head
//             (Config::full_rank_gate: sigmoid(x·W_gᵀ [+ g_b bias]), Kimi K3's gate)
//   out     = y·W_oᵀ                                            [T, E] bf16
// fp32 accumulation everywhere; every intermediate is rounded to bf16 where the reference
// implementations (fla, vLLM) round it (docs/LAYER.md lists the rounding points). `hidden` is what
// the model's input RMSNorm of this layer produced; the caller adds the residual to `out`.
//
// The contract, as CUTLASS's: can_implement() → workspace_bytes() / weight_image_bytes() →
// make_layer() (places the weights once) → forward() (any number of times).
//
// States. Each sequence has a conv state per projection — the last W-1 pre-conv inputs of each
// channel, oldest first, bf16 [Cl, W-1] (zeros for a new sequence) — and the recurrent state
// [Hl, D, D] (V-first, as kda/kda.hpp), bf16 or f32. They live in caller-owned pools of num_slots
// rows (State); sequence n uses row slots[n] of each pool (row n without slots). A forward reads
// and updates them in place, so a second forward on the same rows continues the sequences (chunked
// prefill), and a decode batch advances each row by decode_tokens tokens.
//
// Padding. A negative slot (or one equal to Batch::padding_slot) marks a padding row — a decode row
// or a prefill sequence: it outputs zeros, and no state is read or written for it (its q is zeroed
// after the conv, so the core's output is exactly zero). A serving runtime pads its captured
// batches with such rows.
//
// Tensor parallelism: with config.tp_size > 1 the layer holds its rank's heads (weights.hpp) and
// its pools hold those heads only; `out` is then this rank's PARTIAL SUM of the layer output
// (rounded to bf16): the caller all-reduces (sums) `out` over the ranks.
//
// Memory. Everything a forward touches is the caller's memory on the layer's backend (host memory
// on the CPU, device memory on CUDA): hidden, out, the state pools, the batch's cu_seqlens and
// slots, and the workspace (at least workspace_bytes(), any alignment; on CUDA it also holds
// cuBLAS's workspace). A forward allocates nothing, prints nothing and, on CUDA, synchronizes
// nothing unless it is asked for phase times: it enqueues work on the stream and returns, and it
// can be captured in a CUDA graph (with RunOptions::check_pointers off while capturing). Errors
// throw kda::Error (kda/error.hpp); every check the host can make runs before the first byte of out
// or of a state is written (on CUDA also the core's, kda::check_cuda_call, among them the pools',
// cu_seqlens' and slots' alignment, before the conv's launch).
// What only the device can see (a slot outside the pool, broken cu_seqlens in device memory) is
// ORed into Batch::device_status (kda::DeviceStatusBit).
//
// Threads. One forward at a time per Layer object (the CUDA layer owns one cuBLASLt handle and a
// table of the GEMM algorithms its forwards have used, which a forward reads and fills, and a
// stream that a decode step's GEMMs of the output gate run on, forked from and joined back into
// RunOptions::stream within the forward: docs/LAYER.md); different objects may run concurrently
// (on CUDA, on different streams).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kda/kda.hpp"
#include "kda/layer/weights.hpp"

namespace kda::layer {

// Pools of per-sequence state, on the layer's backend, read and written in place.
struct State {
  std::int64_t num_slots = 0;
  bf16_bits* conv_q = nullptr;          // [num_slots, Cl, W-1]
  bf16_bits* conv_k = nullptr;          // [num_slots, Cl, W-1]
  bf16_bits* conv_v = nullptr;          // [num_slots, Cl, W-1]
  void* recurrent = nullptr;            // [num_slots, Hl, D, D] in recurrent_dtype
  DType recurrent_dtype = DType::kF32;  // kF32 or kBF16
  // Where a record-and-commit verify step (Batch::records) writes its records and commit() reads
  // them: per layer, beside its pools, because they are that layer's (a runtime keeps one region
  // per layer, sized once for its largest verify batch, and reuses it every step). Row-token pair
  // i = n * decode_tokens + t of the step:
  //   recurrent_records  f32 [record_rows, Hl, 3 D]: the operator's records (kda.hpp,
  //                      DecodeTensors::records), 16-byte aligned on CUDA
  //   conv_records       bf16 [record_rows, 3 Cl]: the token's pre-conv q | k | v projections
  //                      (the conv inputs), from which a commit shifts the conv states
  // record_rows: the pairs both hold (at least sequences * decode_tokens of a records step).
  // Unused (and may stay null) outside records steps and commits.
  float* recurrent_records = nullptr;
  bf16_bits* conv_records = nullptr;
  std::int64_t record_rows = 0;
  // The records a step folds (Batch::fold_sequences): the regions the records step before it
  // wrote, laid out as above for its sequences x decode_tokens pairs. A runtime that folds keeps
  // two regions a layer and alternates: a records step writes one while it folds the other.
  const float* fold_recurrent_records = nullptr;
  const bf16_bits* fold_conv_records = nullptr;
};

// One batch: `sequences` sequences, back to back in `tokens` rows of hidden states.
struct Batch {
  std::int64_t tokens = 0;     // T
  std::int64_t sequences = 0;  // N
  // 0: prefill — sequences of any length (0 included) laid out by cu_seqlens.
  // 1..kda::kMaxDecodeTokens: decode — every sequence has exactly decode_tokens tokens (tokens ==
  // sequences * decode_tokens) and cu_seqlens is not read.
  std::int64_t decode_tokens = 0;
  // Prefill: [N + 1], 0, non-decreasing, last == T; on the layer's backend. int64 here, or int32
  // in cu_seqlens_i32 (a serving runtime's query_start_loc): exactly one of the two for a prefill
  // of sequences (both set is an error). The kernels read either as it is, without a conversion.
  const std::int64_t* cu_seqlens = nullptr;
  const std::int32_t* cu_seqlens_i32 = nullptr;
  // [N], on the layer's backend: each sequence's state row, distinct among the non-negative ones,
  // below num_slots; negative = padding. nullptr: sequence n uses row n (then N <= num_slots).
  const std::int32_t* slots = nullptr;
  // A caller-chosen null row, with slots: a slots entry (a verify step's start or per-token entry,
  // a checkpoint_slots entry) equal to it is padding too, exactly as a negative one, and may
  // appear any number of times (a serving runtime's reserved null slot that pads its CUDA graphs'
  // batches). Negative (the default): none. Otherwise below num_slots.
  std::int32_t padding_slot = -1;
  // Optional host copies of the two (CUDA), checked before anything is enqueued. Without them the
  // host cannot see the device's values: a slot >= num_slots is then treated as padding and
  // reported through device_status, and broken cu_seqlens are reported by the core. The CPU reads
  // cu_seqlens and slots themselves (host memory) and ignores these.
  const std::int64_t* cu_seqlens_host = nullptr;
  const std::int32_t* slots_host = nullptr;
  // The host copy of cu_seqlens_i32 (the copy has the device array's dtype: cu_seqlens_host goes
  // with cu_seqlens, this one with cu_seqlens_i32; the other pairing is an error).
  const std::int32_t* cu_seqlens_host_i32 = nullptr;
  // Decode only, optional: a speculative verify step (kda.hpp, DecodeProblem::verify). slots is
  // then [N, decode_tokens] and num_accepted [N] (each in [1, decode_tokens]), both on the layer's
  // backend: row n starts from the states (recurrent and conv) in slots[n][num_accepted[n] - 1]
  // and keeps them after its token t in slots[n][t] (negative: not kept); a row whose start entry
  // is negative is padding (zeros out, no state touched). num_accepted_host: its optional host
  // copy (CUDA), checked as slots_host is; without it a bad value is reported through
  // device_status (kDeviceStatusAccepted) and that row written as padding.
  const std::int32_t* num_accepted = nullptr;
  const std::int32_t* num_accepted_host = nullptr;
  // Decode only, optional: a record-and-commit verify step (kda.hpp, DecodeProblem::records), the
  // form a runtime takes when it would rather keep one state a sequence than one a draft token.
  // slots is then [N] (each row's committed states; negative or padding_slot: padding, rows may
  // share a slot since nothing is written), num_accepted null. The step reads the conv and
  // recurrent states of slots[n], writes out (equal to a per-token-states verify step's) and the
  // records in State::recurrent_records / conv_records, and writes no pool: commit() then folds
  // each row's accepted tokens into its states. A padding row's out is zeros, its records are
  // left as they were.
  bool records = false;
  // Decode only, optional: the commit of the records step before this one deferred into this step
  // (kda.hpp, "Fold"), instead of a commit() launch. fold_sequences and fold_decode_tokens are that
  // step's N and decode_tokens; fold_rows and fold_counts [N], on the layer's backend: row n of
  // this step starts from its slot after folding in the first fold_counts[n] tokens of that step's
  // row fold_rows[n] (the row that read the same slot; negative: nothing to fold), from the
  // records in State::fold_recurrent_records / fold_conv_records, recurrent and conv states alike,
  // with the commit's operations: out and states equal, bit for bit, those of commit() followed by
  // this step. A plain step or a records step may fold (not a step with num_accepted); a records
  // step that folds stores each folded state in its row's slot, so its slots must be distinct. A
  // fold row outside [0, fold_sequences) or a count outside [1, fold_decode_tokens]: the CPU
  // refuses the call naming the row; CUDA writes that row as padding and sets
  // kDeviceStatusAccepted.
  std::int64_t fold_sequences = 0;
  std::int64_t fold_decode_tokens = 1;
  const std::int32_t* fold_rows = nullptr;
  const std::int32_t* fold_counts = nullptr;
  // Prefill only, optional: checkpoints for prefix caching (kda.hpp, Problem::checkpoints), K
  // requests per sequence in checkpoint_offsets int64 [N, K] and checkpoint_slots int32 [N, K], on
  // the layer's backend and with slots: request k of sequence n writes, into pool row
  // checkpoint_slots[n][k] (-1: none), the recurrent state after checkpoint_offsets[n][k] of the
  // sequence's tokens (-1: none; a multiple of 16, or its length) and the three conv states there
  // (the W-1 pre-conv inputs before that offset, from the sequence's initial conv state where
  // fewer tokens came before). The rows written are distinct and none is a slots entry; a padding
  // sequence's requests are not read. The CPU checks the requests before anything is written;
  // CUDA reads them on the device only (kda.hpp, Problem::checkpoints: kDeviceStatusCheckpoint,
  // that request skipped; a row named by two requests may then hold a mix of both). A call of 0
  // tokens computes nothing and writes only its requests (each at offset 0: the initial states).
  std::int64_t checkpoints = 0;
  const std::int64_t* checkpoint_offsets = nullptr;
  const std::int32_t* checkpoint_slots = nullptr;
  // Optional device word the kernels OR kda::DeviceStatusBit values into (CUDA).
  std::uint32_t* device_status = nullptr;
};

// Seconds spent per phase, added to by forward() when asked. On CUDA a one-launch decode step
// counts its whole time as the projections', a fused step its conv and norm as the core's, and a
// decode step on the separate kernels its norm (the core's epilogue, or its own launch after it)
// as the core's; core_inputs() on CUDA adds none.
struct Times {
  double projections = 0.0;  // q/k/v, f_a/f_b, b, g_a/g_b (or g) projections
  double conv = 0.0;         // short convolutions + SiLU, conv state update
  double core = 0.0;         // the KDA operator
  double norm = 0.0;         // gated RMSNorm
  double o_proj = 0.0;       // output projection
};

// How a CUDA decode step runs between its input projection and o_proj (the CPU has one way).
// Every choice computes the same layer; they differ in launches and bytes moved (fused: one kernel
// instead of the conv and the core and their round trips through the workspace).
enum class DecodeKernel : int {
  kAuto = 0,      // one launch where kOneLaunch fits; else, for a step of one token a row,
                  // fused with its second factors up to 128 (row, head) pairs (32 with an fp32
                  // state, none with the full-rank output gate); else separate (every step of
                  // several tokens a row)
  kFusedFactors,  // fused, the low-rank second factors (f_b, g_b) inside it at any batch
  kFused,         // fused, the second factors by GEMMs before it
  kSeparate,      // the conv (with the low-rank second factors up to 2048 16 x 16 tiles each,
                  // 4096 at one token a row), then the core's decode kernel with the gated norm
                  // as its epilogue (or, for steps the operator's rule cuts finer, o stored and
                  // the norm's kernel)
  kOneLaunch,     // a plain step of one token of each of up to 8 sequences, at most 32 (row,
                  // head) pairs (one row where the layer has more than 32 heads), fewer pairs
                  // than the device's multiprocessors: projections, step and o_proj in one
                  // launch (kAuto's choice there, where it fits; else as kAuto)
};
// "auto", "fused", "fused-after-gemms", "separate", "one-launch" (kAuto .. kOneLaunch in order);
// "unknown" for a value that is none of them.
const char* to_string(DecodeKernel kernel) noexcept;
constexpr bool is_known(DecodeKernel kernel) noexcept {
  return static_cast<unsigned>(kernel) <= static_cast<unsigned>(DecodeKernel::kOneLaunch);
}
// to_string's names -> DecodeKernel; false for anything else (*kernel untouched).
bool parse_decode_kernel(const std::string& text, DecodeKernel* kernel) noexcept;

// The KDA core's inputs of a prefill batch as the layer computes them (core_inputs()): bf16 q, k,
// g [T, Hl, D], v [T, Hl, D], beta [T, Hl] in the forward's workspace (valid until it is used
// again), and the layer's gate parameters f32 A_log [Hl], dt_bias [Hl * D], all on the layer's
// backend. g and beta are raw (activated inside the core), as forward() hands them to it.
struct CoreInputs {
  const bf16_bits* q = nullptr;
  const bf16_bits* k = nullptr;
  const bf16_bits* v = nullptr;
  const bf16_bits* g = nullptr;
  const bf16_bits* beta = nullptr;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
};

struct RunOptions {
  void* stream = nullptr;      // CUDA: the cudaStream_t to enqueue on; nullptr: the default stream
  int cpu_threads = 0;         // CPU threads (core, projections); 0: up to the hardware's
  bool check_pointers = true;  // CUDA: ask the driver about every caller buffer (host time)
  PrefillSchedule schedule = PrefillSchedule::kAuto;  // CUDA prefill: kda::CudaOptions::schedule
  DecodeKernel decode_kernel = DecodeKernel::kAuto;   // CUDA decode steps
  // CUDA fused decode step: the blocks (a thread block cluster) that share one (row, head), each a
  // slice of its value rows: 1, 2, 4 or 8; 0 chooses by shape, the most that keep one block a
  // multiprocessor (rows x heads x blocks <= the device's multiprocessors). Every choice computes
  // the same bits.
  int fused_cluster = 0;
  // Adds each phase's seconds. CUDA: measured with events, and the call waits for the layer.
  Times* times = nullptr;
  // Optional: a CUDA decode step sets it to the kernel it ran (kOneLaunch, kFusedFactors, kFused
  // or kSeparate; never kAuto), once its work is enqueued. decode_kernel is a request that a step
  // of another shape may not take (kOneLaunch: a step of more rows; a fused step that does not
  // fit), so this says which launches a captured graph holds and which batch sizes share a
  // kernel. A step of no tokens, prefills, core_inputs() and the CPU leave it untouched.
  DecodeKernel* decode_kernel_ran = nullptr;
};

class Layer {
 public:
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  virtual Backend backend() const noexcept = 0;
  const Config& config() const noexcept { return config_; }
  // Bytes of this layer's weight image (= weight_image_bytes(backend(), config())).
  std::size_t weight_bytes() const noexcept { return weight_bytes_; }

  // hidden: bf16 [T, E]; out: bf16 [T, E], overlapping none of hidden, the workspace, the state
  // pools and records regions, the batch's arrays and its device status word. Throws kda::Error.
  void forward(const Batch& batch, const bf16_bits* hidden, bf16_bits* out, const State& state,
               Workspace workspace, const RunOptions& options = {}) const {
    run(batch, hidden, out, state, workspace, options, nullptr);
  }

  // The forward of a prefill batch up to the core: the projections and the short convolutions,
  // which read and update the conv states in `state` exactly as forward() does (so the conv rows
  // end as forward() leaves them), and nothing after (no core, no norm, no output; the recurrent
  // pool is neither read nor written and may be null). For a context-parallel prefill, which needs
  // a range's core inputs for its segment transition (kda.hpp) before the range's true recurrent
  // state is known. Prefill only: no checkpoints. Throws kda::Error as forward() does.
  CoreInputs core_inputs(const Batch& batch, const bf16_bits* hidden, const State& state,
                         Workspace workspace, const RunOptions& options = {}) const {
    CoreInputs inputs;
    run(batch, hidden, nullptr, state, workspace, options, &inputs);
    return inputs;
  }

 protected:
  Layer(const Config& config, std::size_t weight_bytes)
      : config_(config), weight_bytes_(weight_bytes) {}
  // The backend's forward; with `inputs`, only up to the core, whose inputs it points at
  // (core_inputs()).
  virtual void run(const Batch& batch, const bf16_bits* hidden, bf16_bits* out, const State& state,
                   Workspace workspace, const RunOptions& options, CoreInputs* inputs) const = 0;

 private:
  Config config_;
  std::size_t weight_bytes_;
};

// The commit of a record-and-commit verify step (Batch::records), for the layers given.
struct CommitBatch {
  std::int64_t sequences = 0;      // N of the records step
  std::int64_t decode_tokens = 1;  // its tokens per row, 1..kda::kMaxDecodeTokens
  // [N] each, on the layer's backend: the records step's slots and each row's accepted tokens, in
  // [1, decode_tokens]. A padding row (negative slot or padding_slot) touches nothing and its
  // num_accepted is not read; the non-negative slots are distinct (each state is written once).
  const std::int32_t* slots = nullptr;
  const std::int32_t* num_accepted = nullptr;
  std::int32_t padding_slot = -1;
  // Optional host copies (CUDA; num_accepted_host is read only with slots_host, which says which
  // rows are padding), checked before anything is enqueued; the CPU reads the arrays
  // themselves. Without them a bad value only the device sees skips its row and sets
  // kDeviceStatusAccepted / kDeviceStatusSlot in device_status.
  const std::int32_t* slots_host = nullptr;
  const std::int32_t* num_accepted_host = nullptr;
  std::uint32_t* device_status = nullptr;
};

// Folds the first num_accepted[n] tokens of each row of the records step that wrote the states'
// records into every layer's states: the recurrent state through kda::commit_cpu / commit_cuda,
// the three conv states by shifting in the accepted pre-conv inputs (the conv state after a
// tokens is the last W-1 of old state ++ inputs[0 .. a)). Afterwards each state equals the one a
// per-token-states verify step would have kept after token num_accepted[n] - 1 (bit for bit on
// one backend). All layers share `config` and their States' num_slots, recurrent dtype and
// record_rows. CUDA: one operator commit launch per kda::kMaxCommitLayers layers and one conv
// launch for the same layers, enqueued on options.stream: nothing allocated or synchronized,
// capturable. Throws kda::Error on what the host can see, before anything is written.
void commit(Backend backend, const Config& config, const CommitBatch& batch, const State* states,
            int num_layers, const RunOptions& options = {});

// Whether `backend` runs layers of `config`: the config is valid (validate()), and CUDA is built
// and its limits hold (head_dim 128, conv width 2..4). Checks no device.
Status can_implement(Backend backend, const Config& config);

// The KDA core's problems inside a layer of `config`: the one place they are built (the layer, the
// engine's core-only layers and the engine's sizing use them). Prefill: `tokens` in `sequences`
// varlen sequences (int64 cu_seqlens: set cu_seqlens_dtype for int32), states through slot indices
// into pools of `num_state_slots` rows (0: state n is row n). Decode: `rows` rows of `tokens`
// tokens on a pool of `num_slots`.
Problem core_prefill_problem(const Config& config, std::int64_t tokens, std::int64_t sequences,
                             std::int64_t num_state_slots, DType state_dtype);
DecodeProblem core_decode_problem(const Config& config, std::int64_t rows, std::int64_t tokens,
                                  std::int64_t num_slots, DType state_dtype);

// Bytes of workspace for a forward of up to `tokens` tokens in up to `sequences` sequences
// (prefill or decode) on pools of `num_slots` rows. Throws kda::Error (kInvalidArgument for a bad
// config, kOverflow when the size does not fit 64 bits). Needs no device.
std::size_t workspace_bytes(Backend backend, const Config& config, std::int64_t tokens,
                            std::int64_t sequences, std::int64_t num_slots);

// Bytes of the weight image of a layer of `config` on `backend`, whatever its weights' values (a
// g_b bias always has its place): fp32 on the CPU, bf16 GEMM operands on CUDA. Throws kda::Error.
std::size_t weight_image_bytes(Backend backend, const Config& config);
// The alignment the weight image's region must have.
std::size_t weight_image_alignment(Backend backend) noexcept;

// The layer of `weights` on `backend`. Checks the weights against their config, then writes their
// image into `weight_image` (memory of the backend, weight_image_alignment()-aligned, at least
// weight_image_bytes() of `bytes`, which the caller keeps, untouched, for the layer's life). The
// region is checked before it is written. Throws kda::Error (kInvalidArgument: bad weights or a bad
// region; kBackendUnavailable: CUDA not built or no device; kUnsupported: can_implement(), or a
// device the kernels are not built for; kCudaError: the device cannot be queried).
std::unique_ptr<Layer> make_layer(Backend backend, const Weights& weights, void* weight_image,
                                  std::size_t bytes);
// The same into memory the layer allocates, and frees, itself.
std::unique_ptr<Layer> make_layer(Backend backend, const Weights& weights);

}  // namespace kda::layer
