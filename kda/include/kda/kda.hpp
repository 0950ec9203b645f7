// kda/kda.hpp — the Kimi Delta Attention operator contract.
//
// One header describes the problem (shapes, layouts, gate, state dtypes), the tensors (raw
// pointers, caller-owned), the workspace (caller-owned scratch, sized by workspace_size()) and the
// backends (CPU: Eigen, exact reference and fallback; CUDA: sm_90a). The contract follows CUTLASS's
// operator sequence: can_implement -> workspace_size -> forward. Nothing here throws: every entry
// point returns a Status that names the problem. Nothing in a forward allocates, synchronizes or
// prints.
//
// Math, layouts and numerics: see docs/KDA.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kda {

// ---------------------------------------------------------------------------------------------
// Status
// ---------------------------------------------------------------------------------------------
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // a shape, pointer, dtype or value is wrong
  kUnsupported = 2,         // valid, but not supported by this backend (e.g. K != 128 on CUDA)
  kOverflow = 3,            // a size whose element or byte count overflows 64 bits
  kWorkspaceTooSmall = 4,   // caller's workspace smaller than workspace_size()
  kBackendUnavailable = 5,  // CUDA not compiled in, or no device present
  kCudaError = 6,           // a CUDA runtime call or launch failed
  kInternal = 7,            // an invariant of the library broke (a bug)
  kOutOfMemory = 8,         // host or device memory could not be allocated (retry smaller)
};

const char* to_string(StatusCode code) noexcept;

// A status code and a message naming the problem. Ok statuses carry no message (no allocation).
class Status {
 public:
  Status() noexcept = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() noexcept { return Status(); }
  bool ok() const noexcept { return code_ == StatusCode::kOk; }
  explicit operator bool() const noexcept { return ok(); }
  StatusCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "invalid argument: q is null" style text for logs.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// ---------------------------------------------------------------------------------------------
// Problem description
// ---------------------------------------------------------------------------------------------
// kF16 is a storage dtype only (checkpoints hold F16 tensors, converted when loaded): no operator
// tensor takes it.
enum class DType : int { kNone = 0, kBF16 = 1, kF32 = 2, kI32 = 3, kI64 = 4, kF16 = 5 };
const char* to_string(DType dtype) noexcept;
std::size_t dtype_size(DType dtype) noexcept;  // 0 for kNone

enum class GateMode : int {
  kLowerBound = 0,  // g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h]))
  kSoftplus = 1,    // g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])
};
const char* to_string(GateMode gate) noexcept;

enum class Backend : int { kCpu = 0, kCuda = 1 };
const char* to_string(Backend backend) noexcept;

// Layouts (FlashKDA-compatible, all contiguous):
//   q, k, g: bf16 [B, T, H, K]    v, out: bf16 [B, T, H, V]    beta: bf16 [B, T, H]
//   A_log: f32 [H]                dt_bias: f32 [H, K]
//   cu_seqlens: i32 or i64 [N + 1] (then B == 1; T is the total token count)
//   initial_state, final_state: [N, H, V, K] ("V-first", i.e. S^T), bf16 or f32, each optional.
struct Problem {
  std::int64_t batch = 1;         // B. Must be 1 when cu_seqlens is used.
  std::int64_t seq_len = 0;       // T: tokens per row (with cu_seqlens: all tokens together)
  std::int64_t num_heads = 0;     // H
  std::int64_t head_dim_k = 128;  // K
  std::int64_t head_dim_v = 128;  // V
  std::int64_t num_seqs = 0;  // N with cu_seqlens (cu_seqlens has N + 1 entries); ignored otherwise
  DType cu_seqlens_dtype = DType::kNone;  // kNone: fixed-length rows; kI32 or kI64: varlen
  GateMode gate = GateMode::kSoftplus;
  float lower_bound = -5.0f;                 // kLowerBound only; must be finite and in [-5, 0)
  float scale = 0.0f;                        // 0 means K^-0.5; otherwise finite and > 0
  DType initial_state_dtype = DType::kNone;  // kNone | kBF16 | kF32
  DType final_state_dtype = DType::kNone;    // kNone | kBF16 | kF32
  // State addressing. 0: initial_state / final_state are [N, H, V, K], sequence s at index s.
  // > 0: they are pools of num_state_slots states [num_state_slots, H, V, K] (typically one pool,
  // updated in place: final_state == initial_state) and sequence s reads and writes entry
  // Tensors::state_slots[s]; a negative entry means "start from zero, write no final state"
  // (padding). A serving runtime's slots fragment as sequences come and go: this keeps a batch of
  // any slots one launch, with no gather or scatter around it.
  std::int64_t num_state_slots = 0;
  // With state slots: a caller-chosen null slot. A state_slots or checkpoint_slots entry equal to
  // it is padding too, exactly as a negative one (no state read or written), so that a runtime
  // that pads its CUDA graphs' batches with a reserved pool entry (vLLM's null slot 0) hands its
  // slot list over as it is. Negative (the default): none, only negative entries are padding.
  // Otherwise below num_state_slots; several sequences may name it.
  std::int32_t padding_slot = -1;
  // Prefill checkpoints (prefix caching): with state slots and a final state, up to `checkpoints`
  // requests per sequence (K; 0: none) in Tensors::checkpoint_offsets [N, K] (this dtype: i32 or
  // i64) and Tensors::checkpoint_slots int32 [N, K]. Request k of sequence s writes the state after
  // checkpoint_offsets[s][k] of the sequence's tokens (a multiple of 16, or the sequence's length;
  // -1: no request) into pool entry checkpoint_slots[s][k] (negative or padding_slot: none), in
  // final_state_dtype. The
  // entries written are distinct and none is a state_slots entry of the call. The CPU checks all
  // of this before computing; CUDA reads the requests on the device only (graph replays take new
  // ones): a bad offset, a slot >= the pool, or a slot another request of the call names sets
  // kDeviceStatusCheckpoint and skips that request (of two naming one slot, either); a checkpoint
  // slot that is also a state_slots entry is not detected (the call's results for that sequence
  // and that slot are then unspecified). A padding sequence's requests are not read. A
  // sequence that runs as padding (a negative state slot) writes no checkpoints. Every schedule
  // writes the same states (to rounding): a split recurrence writes each from the pass that carries
  // the true state.
  std::int64_t checkpoints = 0;
  DType checkpoint_offsets_dtype = DType::kNone;

  bool varlen() const noexcept { return cu_seqlens_dtype != DType::kNone; }
  std::int64_t total_tokens() const noexcept { return batch * seq_len; }
  std::int64_t sequences() const noexcept { return varlen() ? num_seqs : batch; }
  float effective_scale() const noexcept;
};

// Checkpoint offsets are multiples of this many tokens (the prefill's chunk), or a sequence's
// length.
inline constexpr std::int64_t kCheckpointAlignment = 16;

// Caller-owned tensors. For the CPU backend all pointers are host pointers; for the CUDA backend
// all are device pointers except cu_seqlens_host.
struct Tensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;     // raw gate input, activated inside the operator
  const void* beta = nullptr;  // raw beta, sigmoid inside the operator
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  const void* cu_seqlens = nullptr;
  // Optional host copy of cu_seqlens. When given, its contents are validated before anything runs
  // (CUDA backend; the CPU backend always validates cu_seqlens itself), and the CUDA backend plans
  // the split of long sequences from the real lengths instead of the total: a call with it and one
  // without may take different plans, whose results agree to rounding, not bitwise.
  const void* cu_seqlens_host = nullptr;
  const void* initial_state = nullptr;
  void* final_state = nullptr;  // may equal initial_state (in-place update) if dtypes match
  // With Problem::num_state_slots > 0: int32 [N], the pool entry of each sequence (negative:
  // padding). Device memory for the CUDA backend, host memory for the CPU backend. Entries >=
  // num_state_slots are refused by the CPU backend; the CUDA kernels treat such a sequence as
  // padding and report kDeviceStatusSlot. Two sequences may not share an entry while final_state is
  // written.
  const std::int32_t* state_slots = nullptr;
  // Optional host copy of state_slots (CUDA backend): when given, its range and duplicates are
  // checked before anything runs (linear host time below 65,536 slots; an entry past that scans
  // the earlier ones; callers that already checked pass none).
  const std::int32_t* state_slots_host = nullptr;
  // With Problem::checkpoints > 0 (above): [N, K] each, on the backend as state_slots.
  const void* checkpoint_offsets = nullptr;
  const std::int32_t* checkpoint_slots = nullptr;
  void* out = nullptr;
  // Optional device word (4 bytes of device memory, CUDA only) where the kernels report what only
  // the device can see: they OR in DeviceStatusBit values (broken cu_seqlens contents, gate
  // parameters out of range) and never clear it. Read it after your own synchronization with
  // check_device_status(); clear it with clear_device_status(). Ignored by the CPU backend, which
  // reports the same problems in its returned Status. After a reported problem the call's out and
  // final states hold unspecified values (every access stays inside its tensor or the
  // workspace); host copies (cu_seqlens_host, state_slots_host) have such input refused before
  // anything runs.
  std::uint32_t* device_status = nullptr;
};

struct Workspace {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

// Shape and value checks on the problem alone (no pointers). Names the offending field.
Status validate(const Problem& p);
// Problem checks + pointer checks (non-null where required, state aliasing rules).
Status validate(const Problem& p, const Tensors& t);
// Checks cu_seqlens contents: [0] == 0, non-decreasing, [N] == T. `cu_seqlens` is a host pointer.
Status validate_cu_seqlens(const Problem& p, const void* cu_seqlens_host);
// The same rule on int64 host cu_seqlens [sequences + 1] of `tokens` tokens, for layers above the
// operator (the whole layer, the engine, case files) that check their callers' batches.
Status validate_cu_seqlens(const std::int64_t* cu_seqlens_host, std::int64_t sequences,
                           std::int64_t tokens);
// The same on int32 cu_seqlens (a serving runtime's query_start_loc), which must also keep
// `tokens` within int32.
Status validate_cu_seqlens(const std::int32_t* cu_seqlens_host, std::int64_t sequences,
                           std::int64_t tokens);
// Checks state_slots contents (Problem::num_state_slots > 0): every entry < num_state_slots, and no
// entry >= 0 twice when the problem writes a final state. `state_slots_host` is a host pointer.
Status validate_state_slots(const Problem& p, const std::int32_t* state_slots_host);

// Whether `backend` can run `p` (validate() plus backend restrictions, e.g. K == V == 128 on CUDA,
// CUDA compiled in and a device present).
Status can_implement(const Problem& p, Backend backend);

// Bytes of workspace a forward of `p` on `backend` needs, in overflow-checked 64-bit arithmetic.
// A tight upper bound that depends only on the problem's sizes (never on cu_seqlens contents), so a
// planner can size it once for max_tokens / max_sequences.
Status workspace_size(const Problem& p, Backend backend, std::size_t* bytes);

// ---------------------------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------------------------
// Gate parameter range, enforced by every backend (CPU: before computing; CUDA: on the device,
// through Tensors::device_status): A_log finite with |A_log| <= kMaxAbsALog, so that exp(A_log) and
// the per-chunk decay sums stay far inside fp32 (trained Kimi Linear layers hold A_log in about
// [0, 3]); dt_bias finite.
inline constexpr float kMaxAbsALog = 20.0f;
// The rule above on host arrays A_log [num_heads] and dt_bias [num_heads, head_dim]: the one check
// every layer above the operator makes where its parameters enter (loaders, the engine, the whole
// layer), so that CUDA callers learn of bad parameters before a launch. kInvalidArgument names the
// first bad element (or a negative or overflowing size, or a null array where there are heads).
Status validate_gate_parameters(const float* A_log, const float* dt_bias, std::int64_t num_heads,
                                std::int64_t head_dim);

// The bounded gate's lower bound as a model description or a case file writes it, before it
// becomes Problem::lower_bound: finite, in [-5, 0), and still below 0 as the float the operator
// takes (-1e-300 rounds to -0). *used receives that float (where `used` is not null).
// kInvalidArgument's message is the reason alone ("outside [-5, 0) or not finite", with " (as a
// float it is -0)" where rounding made it so), for the caller to put after the value as written.
Status lower_bound_from_double(double bound, float* used);

// Bits the CUDA kernels OR into a caller's device status word (Tensors::device_status,
// DecodeTensors::device_status).
enum DeviceStatusBit : std::uint32_t {
  kDeviceStatusCuSeqlens = 1u << 0,    // cu_seqlens[0] != 0, decreasing, or cu_seqlens[N] != T
  kDeviceStatusGateParams = 1u << 1,   // an A_log or dt_bias value not finite or out of range
  kDeviceStatusSlot = 1u << 2,         // a slot index >= the pool size (decode: that row was
                                       // skipped; prefill: that sequence ran as padding; slot
                                       // copy: that pair was skipped)
  kDeviceStatusAccepted = 1u << 3,     // a verify step's or a commit's num_accepted outside
                                       // [1, tokens], or a decode step's fold row or count out
                                       // of range (that row was skipped)
  kDeviceStatusCheckpoint = 1u << 4,   // a prefill checkpoint request whose offset is not -1, a
                                       // multiple of 16 up to its sequence's length, or that
                                       // length, whose slot is >= the pool size, or whose slot
                                       // another request named (the request was skipped)
  kDeviceStatusStepTimeout = 1u << 5,  // the whole layer's one-launch decode step: its blocks
                                       // waited for each other past their bound (the device
                                       // did not run them all at once); that step's outputs
                                       // and states are not valid
};
// kOk for 0; otherwise kInvalidArgument naming every problem in `bits`.
Status describe_device_status(std::uint32_t bits);

struct CpuOptions {
  int num_threads = 0;  // 0: std::thread::hardware_concurrency()
  bool fp64 = false;    // accumulate in double (tests); default fp32 accumulation
};

// CPU forward (Eigen). Validates, then computes; writes nothing when validation fails.
Status forward_cpu(const Problem& p, const Tensors& t, Workspace ws, const CpuOptions& opt = {});

// How the CUDA prefill schedules its two phases (the per-chunk preparation and the sequential
// recurrence; docs/KDA.md §3). Every schedule computes the same result to rounding; they differ
// in speed only, and kAuto picks what was measured fastest on the H200 for the shape.
enum class PrefillSchedule : int {
  kAuto = 0,
  // The prepare kernel over every chunk, then the recurrence, long sequences split into segments
  // run in parallel and joined by a scan (intracard context parallelism) where that pays.
  kTwoPhase = 1,
  // The recurrence fed chunk by chunk by a persistent prepare grid running beside it. Only for one
  // sequence whose 4 H recurrence blocks fit beside that grid (4 H <= the device's SMs); any other
  // problem runs kTwoPhase. kAuto takes it from 32 chunks (512 tokens) on.
  kPipelined = 2,
};
const char* to_string(PrefillSchedule schedule) noexcept;
constexpr bool is_known(PrefillSchedule schedule) noexcept {
  return schedule == PrefillSchedule::kAuto || schedule == PrefillSchedule::kTwoPhase ||
         schedule == PrefillSchedule::kPipelined;
}

struct CudaOptions {
  // Ask the driver where every pointer lives (cudaPointerGetAttributes) and how far its allocation
  // reaches, before anything is launched: a host pointer, memory of another device or a buffer too
  // small for the problem is reported as kInvalidArgument instead of faulting in a kernel. Costs a
  // few driver queries per call (host time only, measured in docs/PERFORMANCE.md); turn it off for
  // pointers already checked, e.g. when capturing a graph that will be replayed many times.
  bool check_pointers = true;
  // The prefill's schedule (forward_cuda only; the decode and the segment transition ignore it).
  // A value outside the enum is kInvalidArgument.
  PrefillSchedule schedule = PrefillSchedule::kAuto;
  // The decode's thread blocks per (sequence, head) (decode_cuda only): a step's 8 warps a head in
  // 1, 2 or 4 blocks; 0 chooses by the step's shape (docs/design/decode.md). The same bits whatever
  // the count; another value is kInvalidArgument.
  int decode_blocks_per_head = 0;
};

// CUDA forward on `stream` (a cudaStream_t; nullptr = default stream). Asynchronous: returns once
// the kernels are enqueued. No allocation, no synchronization; capturable in a CUDA graph.
Status forward_cuda(const Problem& p, const Tensors& t, Workspace ws, void* stream,
                    const CudaOptions& opt = {});

// ---------------------------------------------------------------------------------------------
// Segment transitions: the primitive of context parallelism
// ---------------------------------------------------------------------------------------------
// A sequence's effect on the recurrent state is affine (docs/KDA.md §3): S_final = P S_0 + H, or in
// the V-first layout of states, S_final^T = S_0^T P^T + H^T. segment_transition_* computes, for
// every sequence of `p` and every head, P^T [K, K] and H^T [V, K] in fp32, from the sequence's
// tokens alone:
//   p_t: f32 [N, H, K, K]    h_t: f32 [N, H, V, K]
// `p` must have no states (initial_state_dtype, final_state_dtype none, num_state_slots 0) and `t`
// no out, states or slots: only the inputs are read. apply_transition_* then maps states through
// transitions: s_out^T = s_in^T P^T + H^T, per (sequence, head), fp32, s_out may be s_in.
//
// Context parallelism over devices: split a long sequence into segments, one per device; each
// device computes its segment's transition (all in parallel), the transitions are gathered, each
// device chains the true state at its segment's start by applying the transitions before it, and
// then runs an ordinary prefill of its segment from that state. The CUDA prefill does the same
// inside one GPU on its own (intracard segments, workspace_layout.hpp).
Status transition_workspace_size(const Problem& p, Backend backend, std::size_t* bytes);
Status segment_transition_cpu(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                              Workspace ws, const CpuOptions& opt = {});
Status segment_transition_cuda(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                               Workspace ws, void* stream, const CudaOptions& opt = {});
// `pairs` (sequence, head) pairs of states [pairs, V, K], transitions as above.
Status apply_transition_cpu(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                            const float* s_in, const float* p_t, const float* h_t, float* s_out);
Status apply_transition_cuda(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                             const float* s_in, const float* p_t, const float* h_t, float* s_out,
                             void* stream);

// ---------------------------------------------------------------------------------------------
// Decode: a few new tokens per sequence on a pool of state slots, updated in place.
// ---------------------------------------------------------------------------------------------
//   q, k, g: bf16 [B, tokens, H, K]   v, out: bf16 [B, tokens, H, V]   beta: bf16 [B, tokens, H]
//   slots: int32 [B], index into the pool, negative (or DecodeProblem::padding_slot) = padding (row
//   skipped, its out left untouched)
//   state_pool: [num_slots, H, V, K] bf16 or f32, read and written in place
//
// Speculative verify (DecodeProblem::verify; vLLM's semantics for spec decode): each row's tokens
// are the last accepted token and its draft tokens, and the step keeps the state after every one
// of them, so that the next step can start after whichever was the last accepted:
//   slots: int32 [B, tokens]    num_accepted: int32 [B], each in [1, tokens]
// Row b starts from the state in slots[b][num_accepted[b] - 1] (the slot the step before wrote
// after its last accepted token) and writes the state after its token t into slots[b][t] (a
// negative entry: that state is not kept). A row whose start entry is negative is padding. The
// non-negative entries of all rows are distinct (the start entry of a row is one of its own).
//
// Record-and-commit verify (DecodeProblem::records, with verify; vLLM's RecoverSSM, FlashInfer's
// ReplaySSM): instead of a state after every token, the step writes for every (row, token, head)
// the small record that rebuilds the state after the token from the state before it, with no dot
// product against the state; commit_cpu / commit_cuda (below) then fold each row's accepted records
// into its state. With records:
//   slots: int32 [B], the row's committed state (negative = padding: nothing read or written, its
//          out and records untouched); rows may share a slot (the pool is only read)
//   num_accepted: must be null (the commit takes it)
//   state_pool: only read, never written
//   out: every token's, as a plain multi-token step computes it
//   records: f32 [B, tokens, H, K + K + V], for token t of a row and head h, with S_{t-1} the state
//            before it (S^T in the pool's V-first layout) and the gate, norm and scale of the step:
//     [0, K)        alpha_t = exp(g_t), the decay per channel of K
//     [K, 2K)       k^_t, the L2-normalised key (eps 1e-6 inside the square root)
//     [2K, 2K + V)  u_t = beta_t (v_t - (diag(alpha_t) S_{t-1})^T k^_t)
//   so that S_t = diag(alpha_t) S_{t-1} + k^_t u_t^T; row v of S_t^T is row_v * alpha_t + u_t[v]
//   k^_t.
// Bytes a row moves per head for T tokens: per-token states read one state and write T; records
// read one state and write T (2K + V) fp32 values, and the commit reads and writes the state once
// more and reads the accepted records. At K = V = 128 the records form moves fewer bytes from
// T = 3 on, and keeps one pool entry a row instead of T (docs/design/decode.md#which-verify-form).
// Fold (the commit deferred into the next step; DecodeProblem::fold_batch > 0): instead of a commit
// launch after a records step, the runtime names in the next step, for each of its rows, the row of
// that records step whose accepted records apply to this row's slot; the step loads the slot's
// state, applies those records in token order (the commit's operations, so the state is the
// commit's bit for bit: a bf16 state is rounded once after them, as the commit's store rounds it),
// and then runs its own tokens from it. Each state is then read and written once a step, against
// a records step plus commit's three (docs/design/decode.md#folding-in-the-next-step):
//   fold_records: f32 [fold_batch, fold_tokens, H, K + K + V], the records step's records (not the
//                 region this step writes)
//   fold_rows:    int32 [batch], the row of the records step that read this row's slot, or
//                 negative: nothing to fold
//   fold_counts:  int32 [batch], that row's accepted tokens, in [1, fold_tokens] (read only where
//                 fold_rows is not negative)
// A plain step or a records step may fold (not a per-token-states verify step). A records step
// that folds writes the folded state into the row's slot (its one pool write; its records are
// relative to the folded state), so its rows' slots must be distinct, as a plain step's. A padding
// row folds nothing. CPU: a fold row outside [0, fold_batch) or a count outside [1, fold_tokens] is
// kInvalidArgument naming the row; CUDA: that row is skipped (padding) and kDeviceStatusAccepted
// reported.
// Most new tokens per sequence in one decode call (speculative or multi-token steps); longer
// continuations are prefills. The engine's decode checks against the same constant.
inline constexpr std::int64_t kMaxDecodeTokens = 16;

struct DecodeProblem {
  std::int64_t batch = 0;   // B sequences in this step
  std::int64_t tokens = 1;  // new tokens per sequence, 1..kMaxDecodeTokens
  std::int64_t num_heads = 0;
  std::int64_t head_dim_k = 128;
  std::int64_t head_dim_v = 128;
  std::int64_t num_slots = 0;
  DType state_dtype = DType::kF32;
  GateMode gate = GateMode::kSoftplus;
  float lower_bound = -5.0f;
  float scale = 0.0f;
  bool verify = false;  // speculative verify (above): slots [batch, tokens], num_accepted [batch]
  // A caller-chosen null slot (as Problem::padding_slot): a slots entry equal to it counts as a
  // negative one: a plain step's row or a verify row whose start entry it is is padding, a verify
  // row's per-token entry equal to it keeps no state. Negative (the default): none. Otherwise below
  // num_slots; any number of entries may name it.
  std::int32_t padding_slot = -1;
  // With verify: the record-and-commit form (above): slots [batch], records written, pool only
  // read.
  bool records = false;
  // Fold (above): rows and tokens a row of the records step whose records this step folds into
  // its rows' states first; 0 rows: no fold (fold_tokens then unused).
  std::int64_t fold_batch = 0;
  std::int64_t fold_tokens = 1;
  float effective_scale() const noexcept;
  bool folds() const noexcept { return fold_batch > 0; }
};

struct DecodeTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  const std::int32_t* slots = nullptr;  // [batch], or [batch, tokens] with verify
  // verify: int32 [batch], on the backend as slots. CPU: a value outside [1, tokens] is an error;
  // CUDA: that row is skipped and kDeviceStatusAccepted reported.
  const std::int32_t* num_accepted = nullptr;
  void* state_pool = nullptr;
  void* out = nullptr;
  // DecodeProblem::records: f32 [batch, tokens, H, K + K + V] (above), on the backend as slots;
  // otherwise null.
  float* records = nullptr;
  // DecodeProblem::fold_batch > 0 (Fold, above), on the backend as slots; otherwise null.
  const float* fold_records = nullptr;        // [fold_batch, fold_tokens, H, K + K + V]
  const std::int32_t* fold_rows = nullptr;    // [batch]
  const std::int32_t* fold_counts = nullptr;  // [batch]
  std::uint32_t* device_status = nullptr;     // optional, CUDA only: see Tensors::device_status
};

Status validate(const DecodeProblem& p);
Status validate(const DecodeProblem& p, const DecodeTensors& t);
Status can_implement(const DecodeProblem& p, Backend backend);
// Bytes of workspace a decode of `p` needs: CPU, one scratch slot per thread (as the prefill's, for
// min(batch * H, 64) threads) plus alignment slack; CUDA, none. Overflow-checked.
Status decode_workspace_size(const DecodeProblem& p, Backend backend, std::size_t* bytes);
// CPU: slot indices >= num_slots are an error (checked before anything is written). Its scratch
// comes from `ws` (at least decode_workspace_size() bytes): nothing is allocated.
Status decode_cpu(const DecodeProblem& p, const DecodeTensors& t, Workspace ws,
                  const CpuOptions& opt = {});
// The same, allocating its scratch on the heap for the call: for tests and one-off use, not for a
// runtime's decode loop.
Status decode_cpu(const DecodeProblem& p, const DecodeTensors& t, const CpuOptions& opt = {});
// CUDA: slot indices >= num_slots are skipped on the device (out rows left untouched) and reported
// through t.device_status (kDeviceStatusSlot), since the host cannot see them without a sync.
Status decode_cuda(const DecodeProblem& p, const DecodeTensors& t, void* stream,
                   const CudaOptions& opt = {});

// ---------------------------------------------------------------------------------------------
// Commit: a record-and-commit verify step's accepted records folded into the states
// ---------------------------------------------------------------------------------------------
// After a verify step with DecodeProblem::records, the runtime knows how many of each row's tokens
// were accepted; commit_* applies records 0 .. num_accepted[b] - 1 of row b, in token order, to the
// state in slots[b], in place, for every head, in every layer given (one call, one launch, for all
// of a model's KDA layers):
//   per layer: records f32 [batch, tokens, H, K + K + V] (the verify step's), state_pool
//              [num_slots, H, V, K] of state_dtype (bf16: rounded once, after the last record)
//   shared:    slots int32 [batch] (negative = padding: nothing read or written; its num_accepted
//              not read), num_accepted int32 [batch], each in [1, tokens]
// The non-negative slots are distinct. The fp32 operations are those of the verify step's state
// update in the same order, so a commit reproduces the state a per-token-states verify step keeps
// after token num_accepted[b] - 1 (bit for bit on one backend with fp32 accumulation; the records
// are fp32, so under CpuOptions::fp64 it agrees to fp32 rounding; docs/design/decode.md).
//
// CUDA: up to kMaxCommitLayers layers travel by value in the kernel's parameters: no workspace, no
// allocation, no synchronization, capturable. `layers` is a host array on both backends; the
// pointers in it, slots and num_accepted are backend memory. A num_accepted outside [1, tokens] or
// a slot >= num_slots is refused by the CPU backend (naming the row) and, on CUDA, skips that row
// and sets kDeviceStatusAccepted / kDeviceStatusSlot in device_status. CUDA needs K == V == 128 and
// records and pools 16-byte aligned.
inline constexpr int kMaxCommitLayers = 128;

struct CommitProblem {
  std::int64_t batch = 0;   // rows of the verify step
  std::int64_t tokens = 1;  // the verify step's tokens per row, 1..kMaxDecodeTokens
  std::int64_t num_heads = 0;
  std::int64_t head_dim_k = 128;
  std::int64_t head_dim_v = 128;
  std::int64_t num_slots = 0;  // entries of each layer's pool
  DType state_dtype = DType::kF32;
  // A caller-chosen null slot (as DecodeProblem::padding_slot): a row whose slot it is is padding.
  std::int32_t padding_slot = -1;
};

struct CommitLayer {
  const float* records = nullptr;  // the layer's verify step's records
  void* state_pool = nullptr;      // the layer's pool, updated in place
};

// Shape checks on the problem alone, then the problem with its tensors: num_layers in
// [0, kMaxCommitLayers], no null pointer where the problem moves bytes, no pool overlapping
// another layer's pool, any records, slots or num_accepted.
Status validate(const CommitProblem& p);
Status validate(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                const std::int32_t* slots, const std::int32_t* num_accepted);
Status can_implement(const CommitProblem& p, Backend backend);
// CPU: slots and num_accepted (host memory) are checked before anything is written: a slot >=
// num_slots, a slot named twice or a row's num_accepted outside [1, tokens] is kInvalidArgument
// naming the row. Uses CpuOptions::num_threads; fp64 accumulates in double. Allocates nothing.
Status commit_cpu(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                  const std::int32_t* slots, const std::int32_t* num_accepted,
                  const CpuOptions& opt = {});
// CUDA on `stream`, asynchronous; device_status optional (see Tensors::device_status).
Status commit_cuda(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                   const std::int32_t* slots, const std::int32_t* num_accepted,
                   std::uint32_t* device_status, void* stream, const CudaOptions& opt = {});

// ---------------------------------------------------------------------------------------------
// Slot copy: the states of one pool entry copied into another
// ---------------------------------------------------------------------------------------------
// A runtime that lets a request start from a cached prefix's checkpoint without consuming it, or
// forks a sequence (parallel sampling, beam search), gives the new request a slot of its own that
// holds another slot's states. Pair i copies entry src[i] of every pool given into entry dst[i] of
// the same pool. A pool is any array of num_slots entries of entry_bytes each (a layer's recurrent
// states, its conv states), so that one call copies a sequence's states in every layer of a model:
//   pools:    host array of {base, entry_bytes}, the bases backend memory, no two pools overlapping
//   src, dst: int32 [pairs], backend memory; a pair with a negative entry or padding_slot on
//             either side is padding: nothing read or written
// The destinations are distinct and none is also a source of the call (one source may be copied
// into several destinations). The CPU backend checks the pairs before it writes anything (an
// entry >= num_slots, a destination named twice or also a source: kInvalidArgument naming the
// pair); CUDA skips a pair with an entry >= num_slots and sets kDeviceStatusSlot in device_status
// (optional), the rest being the caller's promise there. CUDA: up to kMaxCopyPools pools travel by
// value in the kernel's parameters, every base and entry_bytes a multiple of 16; no workspace, no
// allocation, no synchronization: capturable in a CUDA graph and replayed with new pairs.
inline constexpr int kMaxCopyPools = 128;

struct SlotPool {
  void* base = nullptr;           // entry s at base + s * entry_bytes
  std::uint64_t entry_bytes = 0;  // one slot's bytes in this pool
};

struct SlotCopyProblem {
  std::int64_t pairs = 0;      // entries of src and dst (zeroing: of slots)
  std::int64_t num_slots = 0;  // entries of every pool
  // A caller-chosen null slot (as DecodeProblem::padding_slot): a pair naming it is padding.
  std::int32_t padding_slot = -1;
};

// The problem, the pools and the index arrays: pairs >= 0, num_pools in [0, kMaxCopyPools], no
// size overflowing, no null pointer where bytes move, no pool overlapping another pool, src or dst.
Status validate(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                const std::int32_t* src, const std::int32_t* dst);
// CPU: src and dst host memory, checked as above before anything is written; one thread.
Status copy_slots_cpu(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                      const std::int32_t* src, const std::int32_t* dst);
// CUDA on `stream`, asynchronous: one launch per call (none without pairs or pool bytes, when the
// pairs are not read either); device_status must lie outside every pool, src and dst.
Status copy_slots_cuda(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                       const std::int32_t* src, const std::int32_t* dst,
                       std::uint32_t* device_status, void* stream, const CudaOptions& opt = {});

// Zeroing: entry slots[i] of every pool set to zero bytes (a new sequence's states), for
// p.pairs entries of `slots` (int32, backend memory; negative or padding_slot: padding). The same
// checks but for the sources; an entry may repeat. CPU: an entry >= num_slots is kInvalidArgument
// before anything is written; CUDA: skipped and reported (kDeviceStatusSlot); one launch.
Status validate(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                const std::int32_t* slots);
Status zero_slots_cpu(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                      const std::int32_t* slots);
Status zero_slots_cuda(const SlotCopyProblem& p, const SlotPool* pools, int num_pools,
                       const std::int32_t* slots, std::uint32_t* device_status, void* stream,
                       const CudaOptions& opt = {});

// ---------------------------------------------------------------------------------------------
// Device helpers, so that layers above need no CUDA headers. All return kBackendUnavailable in a
// build without CUDA.
// ---------------------------------------------------------------------------------------------
bool cuda_compiled() noexcept;     // built with the CUDA backend
int cuda_device_count() noexcept;  // 0 when not compiled in or no device
Status device_malloc(void** ptr, std::size_t bytes);
Status device_free(void* ptr);
Status memcpy_to_device(void* dst, const void* src, std::size_t bytes, void* stream = nullptr);
Status memcpy_to_host(void* dst, const void* src, std::size_t bytes, void* stream = nullptr);
Status memset_device(void* dst, int value, std::size_t bytes, void* stream = nullptr);
Status stream_synchronize(void* stream);
std::string device_name(int device = 0);
// Whether the current device can run the CUDA backend (compute capability 9.0: the kernels are
// built for sm_90a only). kUnsupported names the device and its capability otherwise.
Status cuda_device_supported();
// The check CudaOptions::check_pointers makes, for one caller buffer: [ptr, ptr + bytes) is device
// (or managed) memory of the current device, inside one allocation where the driver can tell.
// kOk for a null ptr or 0 bytes; kInvalidArgument naming `name` otherwise.
Status check_device_pointer(const void* ptr, std::size_t bytes, const char* name);
// The same check for every non-null tensor of a call, each over the bytes `p` implies (the
// workspace aside): the check CudaOptions::check_pointers makes, on its own. For layers above the
// operator that check their callers' tensors once and run the operator with check_pointers off
// (the engine passes only its caller's q, k, v, g, beta and out). Validates `p` first.
Status check_device_pointers(const Problem& p, const Tensors& t);
Status check_device_pointers(const DecodeProblem& p, const DecodeTensors& t);
Status check_device_pointers(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                             const std::int32_t* slots, const std::int32_t* num_accepted);
// Every check forward_cuda (decode_cuda) makes of a call before its workspace and pointer checks,
// on the host alone: what the CUDA backend implements, validate(p, t), the host copies of
// cu_seqlens and state_slots, each tensor's alignment (docs/VALIDATION.md lists them) and opt's
// fields (the prefill's schedule, the decode's decode_blocks_per_head). For layers above the
// operator that enqueue work of their own ahead of the call and must refuse it before anything is
// written: the whole layer's conv updates the conv states before its core runs. Without CUDA (or a
// device): kBackendUnavailable, as can_implement.
Status check_cuda_call(const Problem& p, const Tensors& t, const CudaOptions& opt = {});
Status check_cuda_call(const DecodeProblem& p, const DecodeTensors& t, const CudaOptions& opt = {});
// The same for commit_cuda: what it implements, validate(p, layers, ...), each layer's records
// and pool 16-byte aligned, device_status 4 (for a caller that commits more than
// kMaxCommitLayers layers in several calls and checks them all before the first).
Status check_cuda_call(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                       const std::int32_t* slots, const std::int32_t* num_accepted,
                       const std::uint32_t* device_status);
// Synchronizes `stream`, reads the device status word and returns describe_device_status() of it.
// Not for the forward path (it synchronizes): call it where you would read results anyway.
Status check_device_status(const std::uint32_t* device_status, void* stream);
// Zeroes the device status word on `stream` (asynchronous, capturable).
Status clear_device_status(std::uint32_t* device_status, void* stream);

}  // namespace kda
