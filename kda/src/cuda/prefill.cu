// prefill.cu — the host side of the CUDA prefill (the kernels: prefill_kernels.cuh). Split the
// CUTLASS way: PrefillLaunch::initialize makes every check that can fail and fixes the parameters
// and the segment plan before anything is enqueued; run() only launches. forward_cuda,
// segment_transition_cuda and apply_transition_cuda are the public entry points (kda.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "argument_table.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/prefill_kernels.cuh"
#include "kda/kda.hpp"
#include "kda/nvtx.hpp"
#include "state_slots.hpp"
#include "transition.hpp"
#include "workspace_layout.hpp"

namespace kda::detail {
namespace {

// How the recurrence is cut: segments of seg_chunks chunks so that about `factor` segment-heads
// per SM run at once (bounded by kSegmentBudget so that workspace_size() holds on any device), or
// no split when the sequences are too short for two segments of kMinSegmentChunks.
struct SegmentPlan {
  std::int64_t seg_chunks = kNoSplit;
  std::int64_t seg_slots = 0;  // grid size of the passes: num_seqs + total_tokens / (16 seg_chunks)
  bool split = false;
};

// Tuning knobs for the benchmark's sweeps (docs/design/prefill.md), read once. Not part of the
// contract: the workspace bound holds whatever they say (kSegmentBudget caps the plan).
float env_float(const char* name, float fallback, float lo, float hi) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  const float v = static_cast<float>(std::atof(env));
  return v < lo ? lo : (v > hi ? hi : v);
}
// Segment-heads per SM to aim for at most (parallelism); 0 turns the split off.
float segment_factor() {
  static const float factor = env_float("KDA_PREFILL_SEGMENT_FACTOR", 1.0f, 0.0f, 16.0f);
  return factor;
}
// Cost of one scan step in chunk-steps of the recurrence: with n segments over c chunks the split
// costs about 2 c / n chunk-steps (two passes) plus n scan steps, least at n = sqrt(2 c / ratio).
float scan_step_ratio() {
  static const float ratio = env_float("KDA_PREFILL_SCAN_RATIO", 2.0f, 0.05f, 100.0f);
  return ratio;
}

// The pipelined prefill under PrefillSchedule::kAuto (docs/design/prefill.md):
// KDA_PREFILL_PIPELINE=0 turns it off (a knob for the benchmark's A/B, not part of the contract).
bool pipeline_enabled() {
  static const bool enabled = env_float("KDA_PREFILL_PIPELINE", 1.0f, 0.0f, 1.0f) > 0.5f;
  return enabled;
}
// Persistent prepare blocks per SM beside the pipelined recurrence (3 measured best of 2-5, twice;
// KDA_PREFILL_PIPE_PREP_BLOCKS, a benchmark knob, 1-8).
int pipelined_prep_blocks() {
  static const int blocks =
      static_cast<int>(env_float("KDA_PREFILL_PIPE_PREP_BLOCKS",
                                 static_cast<float>(kPrepPipelinedBlocksPerSm), 1.0f, 8.0f) +
                       0.5f);
  return blocks;
}
// Shortest sequence (in chunks) worth pipelining: below it the recurrence is too short to hide
// the prepare kernel behind.
constexpr std::int64_t kMinPipelineChunks = 32;

// Fewest segments (over all sequences) worth a split: below this the second pass, the scan and
// pass 1's doubled columns eat the gain (H200: H = 32, 8k tokens, 4 segments took 0.64 ms against
// 0.58 unsplit), unless the sequence is long enough for the fixed costs to vanish (H = 32, 32k
// tokens, 4 segments: 2.25 ms against 2.35-2.47 unsplit).
constexpr std::int64_t kMinSplitSegments = 6;
constexpr std::int64_t kLongSequenceChunks = 1024;  // 16k tokens: three segments pay already

// One sequence the pipelined prefill can run: its 32-column recurrence blocks (four per head)
// leave every SM room for the persistent prepare grid beside them.
bool pipeline_fits(std::int64_t T, std::int64_t N, std::int64_t H, int sms) {
  return N == 1 && T > 0 && 4 * H <= static_cast<std::int64_t>(sms);
}

// Whether the forward runs pipelined under `schedule`. kAuto: where it was measured faster (both
// gates: h32-1seq 0.90x, its softplus twin 0.975x; 64-column blocks for more heads, h64-1seq,
// lost 38 %), from kMinPipelineChunks on.
bool pipeline_wanted(std::int64_t T, std::int64_t N, std::int64_t H, int sms,
                     PrefillSchedule schedule) {
  if (!pipeline_fits(T, N, H, sms)) return false;
  switch (schedule) {
    case PrefillSchedule::kTwoPhase:
      return false;
    case PrefillSchedule::kPipelined:
      return true;
    case PrefillSchedule::kAuto:
      break;
  }
  return pipeline_enabled() && T >= kMinPipelineChunks * C;
}

// max_chunks: the longest sequence's chunks, or an upper bound of it (what the host knows).
// pipelined: the sequence can take the pipelined path instead (pipeline_wanted()); forced: the
// caller asked for it (PrefillSchedule::kPipelined), so no split at all.
SegmentPlan plan_segments(std::int64_t T, std::int64_t N, std::int64_t H, int sms,
                          std::int64_t max_chunks, bool pipelined, bool forced) {
  SegmentPlan plan;
  plan.seg_slots = N;
  if (pipelined && forced) return plan;
  const std::uint64_t extra_bound =
      max_extra_segments(static_cast<std::uint64_t>(T), static_cast<std::uint64_t>(H));
  if (extra_bound == 0 || N == 0) return plan;
  const std::int64_t chunks = (T + C - 1) / C;
  // Segments (over all sequences): enough to fill the GPU, no more than the scan pays for, and
  // within the workspace's budget.
  std::int64_t target =
      static_cast<std::int64_t>(segment_factor() * static_cast<float>(sms) / static_cast<float>(H));
  const std::int64_t per_seq = static_cast<std::int64_t>(
      std::sqrt(2.0 * static_cast<double>(chunks) / N / scan_step_ratio()));
  if (target > per_seq * N) target = per_seq * N;
  const std::int64_t budget = static_cast<std::int64_t>(kSegmentBudget) / H;
  if (target > budget) target = budget;
  if (target < 3 || (target < kMinSplitSegments && max_chunks < kLongSequenceChunks)) return plan;
  // Few segments lose to the pipelined path (H200, 1 x 32768 tokens: H = 32, 4 segments 1.954 ms,
  // unsplit 1.905, pipelined 1.708; H = 16, 8 segments 1.050, pipelined 1.530).
  if (pipelined && target < kMinSplitSegments) return plan;
  std::int64_t seg_chunks = (chunks + target - 1) / target;
  if (seg_chunks < static_cast<std::int64_t>(kMinSegmentChunks)) seg_chunks = kMinSegmentChunks;
  // A sequence gains from three segments on (1 - 2 / n of its recurrence); with two, segment 1
  // only waits for segment 0. No sequence that long: no split.
  if (max_chunks < 3 * seg_chunks) return plan;
  const std::int64_t extra = T / (C * seg_chunks);
  if (extra == 0) return plan;
  plan.seg_chunks = seg_chunks;
  plan.seg_slots = N + extra;
  plan.split = true;
  return plan;
}

// The recurrence's block shape for `items` (segment, head) work items, measured on the H200
// (docs/design/prefill.md): with two items or more per SM, one 128-column block of four warps
// with two m-tiles each per item, two blocks sharing an SM (half the shared-memory reads of eight
// warps); with one to two, eight warps of one m-tile (shorter steps, which is what counts when
// each SM has one item); with fewer, two 64-column blocks, and below a quarter of the SMs four
// 32-column blocks, to keep more SMs busy.
RecurrenceShape recurrence_shape(std::int64_t items, int sms) {
  if (items >= 2 * static_cast<std::int64_t>(sms)) return RecurrenceShape::kCols128Paired;
  if (items >= sms) return RecurrenceShape::kCols128;
  return 4 * items >= sms ? RecurrenceShape::kCols64 : RecurrenceShape::kCols32;
}

// One prefill (or segment transition) on the device: initialize() checks and plans, run() launches.
class PrefillLaunch {
 public:
  // A forward: out and states.
  Status initialize(const Problem& p, const Tensors& t, Workspace ws, const CudaOptions& opt) {
    ArgumentTable args;
    Status st = check_cuda_call(p, t, opt, &args);
    if (!st.ok()) return st;
    std::size_t need = 0;
    if (!(st = checked_workspace_size(p, Backend::kCuda, &need))) return st;
    if (!(st = check_workspace(ws, need, "the CUDA prefill"))) return st;
    if (!(st = check_workspace_apart(args, ws.ptr, need))) return st;
    if (opt.check_pointers && !(st = check_device_arguments(args, ws.ptr, need))) return st;
    fill_params(p, t, ws);
    prm_.h0 = t.initial_state;
    prm_.initial_kind = t.initial_state ? state_kind(p.initial_state_dtype) : StateKind::kNone;
    prm_.ht = t.final_state;
    prm_.final_kind = t.final_state ? state_kind(p.final_state_dtype) : StateKind::kNone;
    prm_.out = static_cast<bf16*>(t.out);
    prm_.state_slots = p.num_state_slots > 0 ? t.state_slots : nullptr;
    prm_.num_state_slots = p.num_state_slots;
    prm_.padding_slot = p.padding_slot;
    if (p.checkpoints > 0) {
      std::uint64_t heads_at = 0, end = 0;
      if (!cuda_prefill_checkpoint_index(
              static_cast<std::uint64_t>(T_), static_cast<std::uint64_t>(N_),
              static_cast<std::uint64_t>(p.num_heads),
              static_cast<std::uint64_t>(p.num_state_slots), &heads_at, &end)) {
        // workspace_size() computed the same offsets above: unreachable unless they diverge.
        return Status(StatusCode::kInternal, "the CUDA prefill's checkpoint index overflows");
      }
      prm_.checkpoint_offsets = t.checkpoint_offsets;
      prm_.checkpoint_offsets_64 = p.checkpoint_offsets_dtype == DType::kI64;
      prm_.checkpoint_slots = t.checkpoint_slots;
      prm_.checkpoints = p.checkpoints;
      prm_.checkpoint_heads = reinterpret_cast<std::int32_t*>(prm_.records + heads_at);
      prm_.checkpoint_claims = prm_.checkpoint_heads + chunk_slots_ + N_;
      prm_.checkpoint_next = prm_.checkpoint_claims + p.num_state_slots;
    }
    const bool wants_pipeline = pipeline_wanted(T_, N_, p.num_heads, sms_, opt.schedule);
    plan_ = plan_segments(T_, N_, p.num_heads, sms_, longest_chunks(p, t), wants_pipeline,
                          opt.schedule == PrefillSchedule::kPipelined);
    prm_.seg_chunks = plan_.seg_chunks;
    prm_.seg_blocks =
        plan_.split
            ? reinterpret_cast<float*>(prm_.records + static_cast<std::uint64_t>(chunk_slots_) *
                                                          static_cast<std::uint64_t>(p.num_heads) *
                                                          ChunkRecord::kBytes)
            : nullptr;
    shape_ = recurrence_shape(plan_.seg_slots * p.num_heads, sms_);
    // Pipelined: one unsplit sequence fed chunk by chunk by the persistent prepare grid
    // (H200: h32-1seq 0.92x, h32-32k 0.87x against the split).
    pipelined_ = wants_pipeline && !plan_.split;
    if (pipelined_) {
      std::uint64_t flags_at = 0;
      if (!cuda_prefill_flags_offset(static_cast<std::uint64_t>(T_), static_cast<std::uint64_t>(N_),
                                     static_cast<std::uint64_t>(p.num_heads), &flags_at)) {
        // workspace_size() computed the same offsets above: unreachable unless they diverge.
        return Status(StatusCode::kInternal, "the CUDA prefill's ready flags overflow");
      }
      prm_.ready = reinterpret_cast<std::uint32_t*>(prm_.records + flags_at);
      shape_ = RecurrenceShape::kCols32;
    }
    return Status::Ok();
  }

  // A segment transition: p_t and h_t; no out, no states.
  Status initialize_transition(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                               Workspace ws, const CudaOptions& opt) {
    Status st = can_implement(p, Backend::kCuda);
    if (!st.ok()) return st;
    ArgumentTable args;
    if (!(st = validate_transition(p, t, p_t, h_t, &args))) return st;
    if (!(st = check_host_copies(p, t))) return st;
    if (!(st = check_cuda_alignment(args, "the CUDA backend"))) return st;
    std::size_t need = 0;
    if (!(st = transition_workspace_size(p, Backend::kCuda, &need))) return st;
    if (!(st = check_workspace(ws, need, "the CUDA segment transition"))) return st;
    if (!(st = check_workspace_apart(args, ws.ptr, need))) return st;
    if (opt.check_pointers && !(st = check_device_arguments(args, ws.ptr, need))) return st;
    fill_params(p, t, ws);
    prm_.transition_p = p_t;
    prm_.transition_h = h_t;
    transition_ = true;
    plan_.seg_slots = N_;
    // 256 columns (H^T and P^T rows) per pair: twice the work items of a forward's pair.
    shape_ = recurrence_shape(2 * N_ * p.num_heads, sms_);
    return Status::Ok();
  }

  Status run(cudaStream_t stream) const {
    if (N_ == 0) return Status::Ok();
    if (prm_.checkpoint_heads != nullptr) {
      KDA_NVTX_RANGE("kda.prefill.checkpoint_index");
      if (Status st = launch_checkpoint_index(prm_, stream); !st) return st;
    }
    if (pipelined_) {
      KDA_NVTX_RANGE("kda.prefill.pipelined");
      const std::size_t flag_bytes = static_cast<std::size_t>(chunk_slots_) *
                                     static_cast<std::size_t>(prm_.num_heads) * kReadyFlagBytes;
      if (const cudaError_t err = cudaMemsetAsync(prm_.ready, 0, flag_bytes, stream);
          err != cudaSuccess) {
        return cuda_status(err, "cudaMemsetAsync(ready flags)");
      }
      Status st = launch_prepare(prm_, chunk_slots_, pipelined_prep_blocks(), stream);
      if (!st.ok()) return st;
      return launch_recurrence(prm_, RecurrencePass::kPipelined, false, shape_, N_, D, stream);
    }
    if (T_ > 0) {
      KDA_NVTX_RANGE("kda.prefill.prepare");
      Status st = launch_prepare(prm_, chunk_slots_, kPrepPipelinedBlocksPerSm, stream);
      if (!st.ok()) return st;
    }
    KDA_NVTX_RANGE("kda.prefill.recurrence");
    if (transition_) {
      return launch_recurrence(prm_, RecurrencePass::kTransition, false, shape_, N_, 2 * D, stream);
    }
    if (!plan_.split)
      return launch_recurrence(prm_, RecurrencePass::kFirst, false, shape_, N_, D, stream);
    Status st = launch_recurrence(prm_, RecurrencePass::kFirst, true, shape_, plan_.seg_slots,
                                  2 * D, stream);
    if (!st.ok()) return st;
    {
      KDA_NVTX_RANGE("kda.prefill.segment_scan");
      st = launch_segment_scan(prm_, N_, stream);
      if (!st.ok()) return st;
    }
    // The second pass runs segments 1.. alone: about one item per SM at most (their count is
    // bounded by the plan's target, ~sms / H), where the shorter steps of one-tile warps win.
    const RecurrenceShape second =
        shape_ == RecurrenceShape::kCols128Paired ? RecurrenceShape::kCols128 : shape_;
    return launch_recurrence(prm_, RecurrencePass::kSecond, true, second, plan_.seg_slots, D,
                             stream);
  }

 private:
  // The longest sequence in chunks: exact for fixed-length rows and with a host copy of
  // cu_seqlens (O(N) host reads), else bounded by all the tokens.
  static std::int64_t longest_chunks(const Problem& p, const Tensors& t) {
    std::int64_t longest = p.varlen() ? p.total_tokens() : p.seq_len;
    if (p.varlen() && t.cu_seqlens_host != nullptr) {
      longest = 0;
      for (std::int64_t s = 0; s < p.num_seqs; ++s) {
        const std::int64_t len = p.cu_seqlens_dtype == DType::kI64
                                     ? static_cast<const std::int64_t*>(t.cu_seqlens_host)[s + 1] -
                                           static_cast<const std::int64_t*>(t.cu_seqlens_host)[s]
                                     : static_cast<const std::int32_t*>(t.cu_seqlens_host)[s + 1] -
                                           static_cast<const std::int32_t*>(t.cu_seqlens_host)[s];
        longest = std::max(longest, len);
      }
    }
    return (longest + C - 1) / C;
  }
  static Status check_workspace(Workspace ws, std::size_t need, const char* what) {
    if (ws.bytes < need || (need > 0 && ws.ptr == nullptr)) {
      return Status(StatusCode::kWorkspaceTooSmall, "workspace holds " + std::to_string(ws.bytes) +
                                                        " bytes; " + what + " needs " +
                                                        std::to_string(need));
    }
    return Status::Ok();
  }
  // The parameters every launch shares: inputs, gate, sequences, chunk records.
  void fill_params(const Problem& p, const Tensors& t, Workspace ws) {
    N_ = p.sequences();
    T_ = p.total_tokens();
    sms_ = current_device_sm_count();
    prm_ = PrefillParams{};
    prm_.in = InputPointers::from_tensors(t);
    prm_.seqs.cu = p.varlen() ? t.cu_seqlens : nullptr;
    prm_.seqs.cu_is_64 = p.cu_seqlens_dtype == DType::kI64;
    prm_.seqs.row_len = p.seq_len;
    prm_.seqs.total = T_;
    prm_.seqs.num_seqs = N_;
    prm_.num_heads = static_cast<int>(p.num_heads);
    prm_.gate = p.gate;
    prm_.lower_bound = p.lower_bound;
    prm_.scale = p.effective_scale();
    prm_.status = t.device_status;
    prm_.seg_chunks = kNoSplit;
    const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(ws.ptr);
    prm_.records =
        reinterpret_cast<unsigned char*>(align_up<std::uintptr_t>(base, kWorkspaceAlignment));
    std::uint64_t slots = 0;
    num_chunk_slots(static_cast<std::uint64_t>(T_), static_cast<std::uint64_t>(N_), &slots);
    chunk_slots_ = static_cast<std::int64_t>(slots);
    prm_.num_chunk_slots = chunk_slots_;
  }

  PrefillParams prm_{};
  SegmentPlan plan_{};
  std::int64_t N_ = 0, T_ = 0, chunk_slots_ = 0;
  int sms_ = 1;
  RecurrenceShape shape_ = RecurrenceShape::kCols128;
  bool transition_ = false;
  bool pipelined_ = false;
};

}  // namespace
}  // namespace kda::detail

namespace kda {

Status forward_cuda(const Problem& p, const Tensors& t, Workspace ws, void* stream,
                    const CudaOptions& opt) {
  KDA_NVTX_RANGE("kda.prefill");
  detail::PrefillLaunch launch;
  if (Status st = launch.initialize(p, t, ws, opt); !st) return st;
  return launch.run(static_cast<cudaStream_t>(stream));
}

Status segment_transition_cuda(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                               Workspace ws, void* stream, const CudaOptions& opt) {
  KDA_NVTX_RANGE("kda.segment_transition");
  detail::PrefillLaunch launch;
  if (Status st = launch.initialize_transition(p, t, p_t, h_t, ws, opt); !st) return st;
  return launch.run(static_cast<cudaStream_t>(stream));
}

Status apply_transition_cuda(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                             const float* s_in, const float* p_t, const float* h_t, float* s_out,
                             void* stream) {
  KDA_NVTX_RANGE("kda.apply_transition");
  detail::ArgumentTable args;
  if (Status st =
          validate_apply_transition(pairs, head_dim_k, head_dim_v, s_in, p_t, h_t, s_out, &args);
      !st) {
    return st;
  }
  if (head_dim_k != detail::D || head_dim_v != detail::D) {
    return Status(StatusCode::kUnsupported,
                  "the CUDA backend needs head_dim_k == head_dim_v == 128 (got K = " +
                      std::to_string(head_dim_k) + ", V = " + std::to_string(head_dim_v) + ")");
  }
  if (Status st = cuda_device_supported(); !st) return st;
  if (Status st = detail::check_cuda_alignment(args, "the CUDA backend"); !st) return st;
  return detail::launch_apply_transition(s_in, p_t, h_t, s_out, pairs,
                                         static_cast<cudaStream_t>(stream));
}

}  // namespace kda
