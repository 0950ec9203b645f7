// layer/src/cuda/kernels.hpp — the fused kernels of the whole KDA layer on CUDA
// (layer_cuda.cpp): conv + SiLU for prefill and for decode, gated RMSNorm, the fused decode step,
// the small-row GEMM.
// Plain C++ declarations (no CUDA headers needed beyond cuda_runtime.h), launched on a stream,
// nothing allocated or synchronized.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/one_launch_exchange.hpp"
#include "kda/kda.hpp"

namespace kda::layer::cuda {

// The short convolutions of q, k and v (3 * channels channels, `channels` = Cl each) over one
// batch.
//   proj: bf16 [tokens, proj_stride]; columns [0, 3 * channels) hold the pre-conv q | k | v
//   projections, columns [beta_col, beta_col + heads) the raw beta projection.
//   conv_weight: f32 [3 * channels, width], tap width-1 multiplies the current token.
//   pools[b]: bf16 [num_slots, channels, width-1] conv states of branch b (q, k, v), in place.
//   out[b]: bf16 [tokens, channels], SiLU(conv(...)) of branch b.
//   beta: bf16 [tokens, heads], a contiguous copy of the beta columns (the core's layout).
struct ConvParams {
  const std::uint16_t* proj = nullptr;
  std::int64_t proj_stride = 0;
  std::int64_t tokens = 0;
  std::int64_t sequences = 0;
  std::int64_t channels = 0;  // Cl, a multiple of 8
  int width = 4;              // W, 2..4
  const float* conv_weight = nullptr;
  std::uint16_t* pools[3] = {nullptr, nullptr, nullptr};
  std::uint16_t* out[3] = {nullptr, nullptr, nullptr};
  std::int64_t beta_col = 0;
  std::int64_t heads = 0;  // Hl
  std::uint16_t* beta = nullptr;
  // Sequence n's state row: slots[n] (nullptr: n). Negative: padding (zero state, nothing written);
  // >= num_slots: treated as padding and reported through status (kDeviceStatusSlot).
  const std::int32_t* slots = nullptr;
  std::int64_t num_slots = 0;
  std::int32_t padding_slot = -1;   // Batch::padding_slot: an entry equal to it is padding too
  std::uint32_t* status = nullptr;  // optional device status word
  // Prefill: device cu_seqlens [sequences + 1], int64 in cu_seqlens or (cu_seqlens null) int32 in
  // cu_seqlens_i32. Decode: both nullptr, every sequence has `decode_tokens` tokens (tokens ==
  // sequences * decode_tokens).
  const std::int64_t* cu_seqlens = nullptr;
  const std::int32_t* cu_seqlens_i32 = nullptr;
  std::int64_t decode_tokens = 0;
  // Decode only, optional: int32 [sequences] receives 0, 1, ..., N-1 (the slot list the core
  // needs when the caller addresses rows without one).
  std::int32_t* identity_slots = nullptr;
  // Decode only, a verify step (kda::layer::Batch::num_accepted): slots [sequences,
  // decode_tokens]; each row starts from its slot at num_accepted - 1 and keeps its conv state
  // after each token in that token's slot.
  const std::int32_t* num_accepted = nullptr;
  // Decode only, a record-and-commit verify step (kda::layer::Batch::records): the rows start from
  // slots[n] as a plain step's, no conv state is written, and each row's pre-conv inputs are
  // copied into conv_records (bf16 [tokens, 3 * channels], 16-byte aligned) for the commit.
  std::uint16_t* conv_records = nullptr;
  // Decode only, a fold (kda::layer::Batch::fold_sequences > 0): row n's conv states first take
  // the first fold_counts[n] pre-conv inputs of row fold_rows[n] of the records step before
  // (fold_conv_records, bf16 [fold_sequences * fold_tokens, 3 * channels]), as the commit shifts
  // them, and the folded state is stored before the conv reads it. A fold row or count out of
  // range: the row runs as padding (kDeviceStatusAccepted).
  const std::uint16_t* fold_conv_records = nullptr;
  const std::int32_t* fold_rows = nullptr;
  const std::int32_t* fold_counts = nullptr;
  std::int64_t fold_sequences = 0;
  std::int64_t fold_tokens = 1;
  // Prefill only, optional: checkpoint requests (kda::layer::Batch::checkpoints), K per sequence,
  // int64 offsets and int32 rows [sequences, K]: launch_conv_prefill writes the three conv states
  // at each valid request's offset into its row, in the conv's launch (requests below W-1 tokens,
  // which read a sequence's initial conv state, before the conv replaces it).
  std::int64_t checkpoints = 0;
  const std::int64_t* checkpoint_offsets = nullptr;
  const std::int32_t* checkpoint_slots = nullptr;
  // Decode only, optional: the low-rank second factors, computed by blocks of the same launch
  // (they read only the projection, as the conv does): g = f_a·W_fbᵀ and, with gate, gate =
  // g_a·W_gbᵀ, over all `tokens` rows. The rank is 128. conv_decode_factors_fit says whether the
  // layout allows it.
  struct Factors {
    const std::uint16_t* w_fb = nullptr;    // bf16 [channels, 128]; null: no factors
    const std::uint16_t* w_gb = nullptr;    // bf16 [channels, 128], with gate
    std::int64_t f_a_col = 0, g_a_col = 0;  // their inputs' first columns in proj
    std::uint16_t* g = nullptr;             // bf16 [tokens, channels]
    float* gate = nullptr;                  // f32 [tokens, channels], or null: g alone
  } factors;
};

// Tokens per thread in the prefill conv (a chunk never crosses a sequence; >= W - 1). A thread
// re-reads the W - 1 rows before its chunk, so longer chunks read less twice; the grid has
// ceil(tokens / kConvChunk) + sequences rows of blocks.
inline constexpr std::int64_t kConvChunk = 32;

// Both conv launchers need: channels a multiple of 8, proj_stride a multiple of 8 and proj, out[b]
// and conv_weight 16-byte aligned (each thread moves eight channels with one 16-byte access); they
// return cudaErrorInvalidValue otherwise. The CUDA layer guarantees it: channels = Hl * 128, the
// stride is rounded up to 8 columns, the q | k | v columns start at 0, Cl and 2 Cl, and every
// buffer sits at a 256-byte aligned offset. The pools may have any 2-byte alignment (16-byte
// aligned pools get 16-byte state accesses).

cudaError_t launch_conv_prefill(const ConvParams& p, cudaStream_t stream);
cudaError_t launch_conv_decode(const ConvParams& p, cudaStream_t stream);
// Whether launch_conv_decode can compute p.factors: 16-byte aligned weights and 16-byte aligned
// input columns (f_a_col, g_a_col multiples of 8), g 4-byte and gate 8-byte aligned, channels a
// multiple of 16. launch_conv_decode returns cudaErrorInvalidValue for factors that do not fit.
bool conv_decode_factors_fit(const ConvParams& p);
// The warp tiles (16 rows x 16 channels) of one factor: what its blocks' work grows with.
__host__ __device__ inline std::int64_t conv_decode_factor_tiles(std::int64_t tokens,
                                                                 std::int64_t channels) {
  return (tokens + 15) / 16 * (channels / 16);
}

// The conv half of a record-and-commit verify step's commit (kda::layer::commit), for up to
// kda::kMaxCommitLayers layers in one launch: row b's three conv states in slots[b] of each layer
// become the last width-1 of (old state ++ the row's first num_accepted[b] pre-conv inputs), the
// inputs read from the layer's conv records (bf16 [sequences * decode_tokens, 3 * channels], q | k
// | v). A padding row (negative slot or padding_slot) touches nothing; a slot >= num_slots or a
// count outside [1, decode_tokens] skips the row and sets kDeviceStatusSlot / kDeviceStatusAccepted
// in status.
struct ConvCommitLayer {
  const std::uint16_t* records = nullptr;
  std::uint16_t* pools[3] = {nullptr, nullptr, nullptr};  // bf16 [num_slots, channels, width-1]
};
struct ConvCommitParams {
  const std::int32_t* slots = nullptr;
  const std::int32_t* num_accepted = nullptr;
  std::uint32_t* status = nullptr;
  std::int64_t num_slots = 0;
  std::int64_t sequences = 0;
  std::int64_t decode_tokens = 1;
  std::int64_t channels = 0;  // Cl
  std::int32_t padding_slot = -1;
  int width = 4;  // 2..4
  int num_layers = 0;
  ConvCommitLayer layers[kMaxCommitLayers];
};
cudaError_t launch_conv_commit(const ConvCommitParams& p, cudaStream_t stream);

// y = RMSNorm_D(o) * o_norm * sigmoid(round_bf16(gate + bias)) per (token, head), -> bf16.
//   o: bf16 [rows, 128] (rows = tokens * heads), gate: f32 [rows, 128] (the g_b projection before
//   its bias and rounding), bias: bf16 [heads * 128] or nullptr, o_norm: f32 [128], y: bf16.
struct GatedNormParams {
  const std::uint16_t* o = nullptr;
  const float* gate = nullptr;
  const std::uint16_t* bias = nullptr;
  const float* o_norm = nullptr;
  std::uint16_t* y = nullptr;
  std::int64_t rows = 0;
  std::int64_t heads = 0;
  float eps = 1e-5f;
};
inline constexpr int kNormHeadDim = 128;

cudaError_t launch_gated_rmsnorm(const GatedNormParams& p, cudaStream_t stream);

// kda::decode_cuda with the gated RMSNorm above as its epilogue (decode_norm.cu): y from each
// head's rows of o in the same launch, o itself not stored; a row the step skips (padding, bad
// metadata) gets zeros in y. y may be the step's q: a block writes a token's y only after it has
// read that token's q. A step of several tokens a row, and one of one token a row above 256 (row,
// head) pairs that the operator's rule cuts into several blocks a head, instead stores o from the
// operator's kernel, in as many blocks a head as its rule (CudaOptions::decode_blocks_per_head)
// gives (norm.o, which must be the core's out, tensors.out, norm.rows = batch x tokens x heads and
// norm.heads must be set, the gate 16-byte aligned; zeros for the skipped rows), then runs
// launch_gated_rmsnorm; y may differ from the one-launch form's in its last bits (the sum of
// squares in another order), and a skipped row's y is the norm of zeros (zero where the row's gate
// is finite). The operator's checks and statuses; kInvalidArgument if gate, o_norm or y is null or
// misaligned (4, 4, 8 bytes).
kda::Status decode_with_gated_norm(const kda::DecodeProblem& problem,
                                   const kda::DecodeTensors& tensors, const GatedNormParams& norm,
                                   cudaStream_t stream, const kda::CudaOptions& options);

// A decode step between the input projection and o_proj in one kernel (fused_decode.cu): per
// (row, head) the conv + SiLU of q, k and v from and to the conv states, the low-rank second
// factors g = f_a·W_fbᵀ and (low-rank gate) gate = g_a·W_gbᵀ, beta, the KDA step on the recurrent
// state in place, the gated RMSNorm -> y. Every row has decode_tokens tokens (rows b * T .. b * T +
// T - 1). A negative slot, or one >= num_slots (then reported through status), is padding: its y
// rows are zeros and no state is read or written.
struct FusedDecodeParams {
  const std::uint16_t* proj = nullptr;  // bf16 [tokens, proj_stride]: q | k | v at 0, Cl, 2 Cl
  std::int64_t proj_stride = 0;
  std::int64_t f_a_col = 0, g_a_col = 0, beta_col = 0;  // f_a [D], g_a [D], beta [heads] columns
  // The second factors computed here (w_fb; w_gb with the low-rank gate), or their results
  // given (w_fb null: g; w_gb null: gate, which a full-rank gate always gives).
  const std::uint16_t* w_fb = nullptr;                         // bf16 [Cl, 128]
  const std::uint16_t* g = nullptr;                            // bf16 [tokens, Cl]
  const std::uint16_t* w_gb = nullptr;                         // bf16 [Cl, 128]
  const float* gate = nullptr;                                 // f32 [tokens, Cl], before the bias
  const std::uint16_t* g_bias = nullptr;                       // bf16 [Cl] or null
  const float* conv_weight = nullptr;                          // f32 [3 Cl, width]
  std::uint16_t* conv_pools[3] = {nullptr, nullptr, nullptr};  // bf16 [num_slots, Cl, width-1]
  const float* A_log = nullptr;                                // [heads]
  const float* dt_bias = nullptr;                              // [Cl]
  const float* o_norm = nullptr;                               // f32 [128]
  void* state = nullptr;  // [num_slots, heads, 128, 128] (Sᵀ), f32 or bf16
  bool f32_state = true;
  // The kernel after this one (o_proj) may start once this step has waited for the projection and
  // its own loads have landed, not at once: its weight reads then do not queue with the step's
  // (KDA_LAYER_FUSED_LATE_DEPENDENTS=1, a benchmark knob).
  bool late_dependents = false;
  const std::int32_t* slots = nullptr;  // [sequences]; null: row b uses slot b
  // A verify step (kda::layer::Batch::num_accepted): slots [sequences, decode_tokens], num_accepted
  // [sequences]; the states after each token kept in that token's slot.
  const std::int32_t* num_accepted = nullptr;
  std::int64_t num_slots = 0;
  std::int32_t padding_slot = -1;  // Batch::padding_slot: an entry equal to it is padding too
  std::int64_t sequences = 0;
  int decode_tokens = 1;
  int heads = 0;  // Hl; Cl = heads * 128
  int width = 4;
  GateMode gate_mode = GateMode::kSoftplus;
  float lower_bound = -5.0f;
  float scale = 0.0f;  // the query scale (kda::DecodeProblem::effective_scale())
  float eps = 1e-5f;
  std::uint16_t* y = nullptr;  // bf16 [tokens, Cl]
  std::uint32_t* status = nullptr;
  // Blocks a (row, head), 1, 2, 4 or 8: a cluster that splits the head's 128 value rows
  // (fused_decode.cu).
  int cluster = 1;
  // A record-and-commit verify step (kda::layer::Batch::records; slots [sequences], no
  // num_accepted): the records instead of any state, the pools only read (a padding row's records
  // are not written). records: f32 [tokens, heads, 3 * 128] (kda::DecodeTensors::records),
  // conv_records: bf16 [tokens, 3 Cl] (the pre-conv q | k | v inputs); both null otherwise.
  float* records = nullptr;
  std::uint16_t* conv_records = nullptr;
  // A fold (kda::layer::Batch::fold_sequences > 0; not with num_accepted): each row's recurrent
  // and conv states first take the first fold_counts[b] tokens of row fold_rows[b] of the records
  // step before (its records: f32 [fold_sequences * fold_tokens, heads, 3 * 128] and bf16
  // [fold_sequences * fold_tokens, 3 Cl]); a records step stores the folded states. Null: none.
  const float* fold_records = nullptr;
  const std::uint16_t* fold_conv_records = nullptr;
  const std::int32_t* fold_rows = nullptr;
  const std::int32_t* fold_counts = nullptr;
  int fold_sequences = 0;
  int fold_tokens = 1;
};
// The cluster size launch_fused_decode runs `p` with.
int fused_decode_cluster(const FusedDecodeParams& p);
// Whether launch_fused_decode takes `p` (width 2..4, the alignments its loads need).
bool fused_decode_fits(const FusedDecodeParams& p);
cudaError_t launch_fused_decode(const FusedDecodeParams& p, cudaStream_t stream);

// A whole decode step of one token of each of a few sequences (rows) in one launch
// (one_launch_step.cu): the input projection, each (row, head)'s fused step (as launch_fused_decode
// computes it) and o_proj. One block a multiprocessor, every block resident at once, handing values
// on through `exchange`.
struct OneLaunchStepParams {
  int rows = 1;                           // 1..one_launch_max_rows(heads)
  const std::uint16_t* hidden = nullptr;  // bf16 [rows, E]
  std::int64_t hidden_size = 0;           // E, a multiple of 8
  // The input projection: rows [0, proj_rows) of w_in (bf16 [proj_rows, E]: q | k | v | f_a |
  // g_a | beta; bf16 values), and with the full-rank gate (w_gb null) w_g (bf16 [Cl, E]; f32
  // values, before the gate's bias).
  const std::uint16_t* w_in = nullptr;
  std::int64_t proj_rows = 0;
  std::int64_t f_a_col = 0, g_a_col = 0, beta_col = 0;
  const std::uint16_t* w_g = nullptr;
  // The step (FusedDecodeParams' fields of the same names).
  const std::uint16_t* w_fb = nullptr;  // bf16 [Cl, 128]
  const std::uint16_t* w_gb = nullptr;  // bf16 [Cl, 128], the low-rank gate; null: full rank
  const std::uint16_t* g_bias = nullptr;
  const float* conv_weight = nullptr;
  std::uint16_t* conv_pools[3] = {nullptr, nullptr, nullptr};
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  const float* o_norm = nullptr;
  void* state = nullptr;
  bool f32_state = true;
  const std::int32_t* slots = nullptr;  // [rows]; null: slots 0..rows-1
  std::int64_t num_slots = 0;
  std::int32_t padding_slot = -1;
  int heads = 0;
  int width = 4;
  GateMode gate_mode = GateMode::kSoftplus;
  float lower_bound = -5.0f;
  float scale = 0.0f;
  float eps = 1e-5f;
  // o_proj: out (bf16 [rows, E]) = y · w_oᵀ (w_o bf16 [E, Cl]), y (bf16 [rows, Cl]) the norm's
  // output.
  const std::uint16_t* w_o = nullptr;
  std::uint16_t* out = nullptr;
  std::uint32_t* status = nullptr;
  // kOneLaunchSyncWords words, and the exchange: a row's words (one_launch_row_words) for each of
  // `rows` rows (the layer's hold one_launch_max_rows(heads)): a word a projection row (proj_rows,
  // then the full-rank gate's Cl rows), then a word a pair of y's Cl values. Both the layer's own
  // (no other layer's launch may use them), zero before its first launch; the kernel keeps them
  // between launches (a 64-bit count of the blocks that have left, in the first two words, so
  // `sync` is 8-byte aligned; each row's and y's last values with their tags).
  std::uint32_t* sync = nullptr;
  std::uint64_t* exchange = nullptr;
  // Optional: kOneLaunchTraceStamps device-clock stamps (ns) a block, [grid][stamps], where its
  // phases end (kda-step-probe); null in the layer.
  std::uint64_t* trace = nullptr;
};
// The stamps of OneLaunchStepParams::trace, by their place in a block's row: where a block's phases
// end (a head block's and an o_proj block's where both have the phase).
enum OneLaunchStamp : int {
  kStampStart = 0,
  kStampHiddenLoaded,
  kStampProjectionDone,  // the block's projection rows
  kStampValuesTaken,     // head: projection, conv and second factors; o_proj: y
  kStampWoLanded,        // o_proj: W_o in shared memory
  kStampResultsIssued,   // head: the state's store issued; o_proj: its rows done
  kStampLeaving,
  kStampStateInRegisters,  // head
  kStampStepComputed,      // head
  kStampStateInShared,     // head: the state back in shared memory
  kStampNormDone,          // head: y written (warp 0)
  kStampOwnWordsTaken,     // thread 0
  kStampWaitReturned,      // the wait for the kernel before returned
};
inline constexpr int kOneLaunchTraceStamps = kStampWaitReturned + 1;
inline constexpr int kOneLaunchSyncWords = 4;
// Whether launch_one_launch_step takes `p` on the current device: rows within
// one_launch_max_rows(heads), every (row, head) a block of its own with a block to spare for
// o_proj, each block's share of W_o in shared memory beside the hidden rows and y, width 2..4, the
// alignments its 16-byte accesses need.
bool one_launch_step_fits(const OneLaunchStepParams& p);
cudaError_t launch_one_launch_step(const OneLaunchStepParams& p, cudaStream_t stream);

// out[rows, n] (row stride ldo) = in[rows, k] (row stride ldi) · weight[n, k]ᵀ for a few rows:
// bf16 in and weight, fp32 accumulation, bf16 or f32 out. What the layer's projections run on for
// batches of at most kSmallGemmMaxRows tokens (decode steps of one sequence: the sliced kernel),
// of up to kFragmentGemmMaxRows (the fragment kernel, on the shapes where it beat cuBLAS), and with
// KDA_LAYER_SMALL_GEMM=streamed up to kTiledGemmMaxRows (small_gemm.cu).
enum class SmallGemmKernel { kSliced, kStreamed, kTiled, kFragment, kWarpgroup };
struct SmallGemmParams {
  const std::uint16_t* in = nullptr;
  std::int64_t ldi = 0;
  const std::uint16_t* weight = nullptr;
  void* out = nullptr;
  std::int64_t ldo = 0;
  bool out_f32 = false;
  std::int64_t rows = 0, n = 0, k = 0;
  // Launch as a programmatic dependent of the kernel before it in the stream: weights are read
  // before waiting for that kernel's grid, `in` only after (the previous kernel may write it).
  bool programmatic = false;
  // Which kernel (small_gemm.cu; kStreamed refuses shapes streamed_gemm_fits does not take). The
  // sliced kernel's slices per weight row: 0 chooses by shape; 1, 2, 4 or 8 forces it.
  SmallGemmKernel kernel = SmallGemmKernel::kSliced;
  int split = 0;
  // The tiled kernel's room for partial sums where it splits K (splits * rows * n fp32; it splits
  // only as far as they fit, none without it). Device memory, not in use by anything else on the
  // stream during the call.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // The fragment kernel's 16-row weight tiles a warp (1 or 2) and 16-byte weight loads a lane in
  // flight (8 or 16); 0 chooses by shape. `split` (1, 2, 4 or 8) forces its warps a row panel (K
  // split between a block's warps); 0 chooses by shape.
  int fragment_row_tiles = 0;
  int fragment_loads = 0;
  // The warpgroup kernel's consumer warpgroups a block (1-4: 64 weight rows each) and K slices a
  // tile (1-8: the blocks of a cluster); 0 chooses by shape (warpgroup_gemm_plan).
  int warpgroup_consumers = 0;
  int warpgroup_splits = 0;
};
inline constexpr std::int64_t kSmallGemmMaxRows = 1;
// Whether launch_small_gemm takes `p`: 1..kSmallGemmMaxRows rows, k and ldi multiples of 8, in and
// weight 16-byte aligned.
bool small_gemm_fits(const SmallGemmParams& p);
// Whether the streamed kernel takes `p` as well: one row of 256 to 16384 columns.
bool streamed_gemm_fits(const SmallGemmParams& p);
// Whether the tiled kernel (SmallGemmKernel::kTiled) takes `p`: 1..kTiledGemmMaxRows rows, k a
// multiple of 8 up to 2^30, ldi a multiple of 8 and >= k, ldo >= n, in and weight 16-byte
// aligned, out aligned to its element, the workspace to 4 bytes.
inline constexpr std::int64_t kTiledGemmMaxRows = 64;
bool tiled_gemm_fits(const SmallGemmParams& p);
// Whether the fragment kernel (SmallGemmKernel::kFragment) takes `p`: 1..kFragmentGemmMaxRows
// rows, and operands as the tiled kernel's (it needs no workspace).
inline constexpr std::int64_t kFragmentGemmMaxRows = 8;
bool fragment_gemm_fits(const SmallGemmParams& p);
// The operands the tiled, fragment and warpgroup kernels share: 1..max_rows rows, k a multiple of
// 8 up to 2^30, n up to 2^30, ldi a multiple of 8 and >= k, ldo >= n, in and weight 16-byte
// aligned, out aligned to its element.
bool few_row_operands_fit(const SmallGemmParams& p, std::int64_t max_rows);
cudaError_t launch_small_gemm(const SmallGemmParams& p, cudaStream_t stream);

// The warpgroup kernel (SmallGemmKernel::kWarpgroup, warpgroup_gemm.cu): 1..kWarpgroupGemmMaxRows
// rows on wgmma, the weights and input rows brought in by tensor copies; K split over the blocks
// of a thread block cluster, whose partial sums meet in distributed shared memory (no workspace).
// Its plan for `p` on the current device: `consumers` warpgroups a block (64 weight rows each),
// `splits` blocks a tile (the cluster), `tiles` tiles of 64 x consumers weight rows, and the rows a
// product `n_rows` (8, 16, 32, 64, 128 or 256). Invalid (consumers 0) where no variant runs.
inline constexpr std::int64_t kWarpgroupGemmMaxRows = 256;
struct WarpgroupGemmPlan {
  int consumers = 0, splits = 0, n_rows = 0;
  std::int64_t tiles = 0;
  bool valid() const { return consumers > 0; }
};
WarpgroupGemmPlan warpgroup_gemm_plan(const SmallGemmParams& p);
// Whether it takes `p`: rows within kWarpgroupGemmMaxRows, k a multiple of 8 up to 2^30, ldi a
// multiple of 8 and >= k, ldo >= n, in and weight 16-byte aligned, out aligned to its element,
// and a plan on the current device.
bool warpgroup_gemm_fits(const SmallGemmParams& p);
cudaError_t launch_warpgroup_gemm(const SmallGemmParams& p, cudaStream_t stream);

}  // namespace kda::layer::cuda
