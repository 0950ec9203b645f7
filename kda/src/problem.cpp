// Validation, can_implement and workspace_size for the prefill and decode problems.
//
// Every check returns a Status whose message names the offending field and its value. Sizes are
// computed in overflow-checked 64-bit arithmetic and must stay below 2^63 (the backends index with
// signed 64-bit integers), so any problem that validates can be addressed without overflow. The
// tensors' sizes and the checks on the tensors live in the argument table (argument_table.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "argument_table.hpp"
#include "cpu_recurrence.hpp"
#include "kda/kda.hpp"
#include "state_slots.hpp"
#include "transition.hpp"
#include "workspace_layout.hpp"

namespace kda {
namespace {

// Head dimensions above this are rejected as absurd (Kimi Linear uses 128).
constexpr std::int64_t kMaxHeadDim = 4096;

Status invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

std::string str(std::int64_t value) { return std::to_string(value); }
std::string str(float value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", static_cast<double>(value));
  return text;
}

bool valid_gate(GateMode gate) {
  return gate == GateMode::kLowerBound || gate == GateMode::kSoftplus;
}
bool valid_state_dtype(DType dtype) {
  return dtype == DType::kNone || dtype == DType::kBF16 || dtype == DType::kF32;
}
std::string dtype_name(DType dtype) {
  const int raw = static_cast<int>(dtype);
  if (raw < 0 || raw > static_cast<int>(DType::kF16)) return "dtype(" + std::to_string(raw) + ")";
  return to_string(dtype);
}

Status check_head_dims(std::int64_t head_dim_k, std::int64_t head_dim_v) {
  if (head_dim_k < 1 || head_dim_k > kMaxHeadDim) {
    return invalid("head_dim_k must be in [1, " + str(kMaxHeadDim) + "] (got " + str(head_dim_k) +
                   ")");
  }
  if (head_dim_v < 1 || head_dim_v > kMaxHeadDim) {
    return invalid("head_dim_v must be in [1, " + str(kMaxHeadDim) + "] (got " + str(head_dim_v) +
                   ")");
  }
  return Status::Ok();
}

// Gate mode, lower_bound (bounded gate only) and scale: shared by prefill and decode.
Status check_gate_and_scale(GateMode gate, float lower_bound, float scale) {
  if (!valid_gate(gate)) {
    return invalid("gate must be lower_bound or softplus (got " +
                   std::to_string(static_cast<int>(gate)) + ")");
  }
  if (gate == GateMode::kLowerBound &&
      !(std::isfinite(lower_bound) && lower_bound >= -5.0f && lower_bound < 0.0f)) {
    return invalid("lower_bound must be finite and in [-5, 0) (got " + str(lower_bound) + ")");
  }
  if (!std::isfinite(scale) || scale < 0.0f) {
    return invalid("scale must be finite and >= 0, 0 selecting K^-0.5 (got " + str(scale) + ")");
  }
  return Status::Ok();
}

// The shape of a decode step and of the commit of its records: rows, tokens, heads, head dims,
// the pool and its state dtype.
Status check_step_shape(std::int64_t batch, std::int64_t tokens, std::int64_t num_heads,
                        std::int64_t head_dim_k, std::int64_t head_dim_v, std::int64_t num_slots,
                        std::int32_t padding_slot, DType state_dtype) {
  if (batch < 0) return invalid("batch must be >= 0 (got " + str(batch) + ")");
  if (tokens < 1 || tokens > kMaxDecodeTokens) {
    return invalid("tokens must be in [1, " + str(kMaxDecodeTokens) + "] (got " + str(tokens) +
                   ")");
  }
  if (num_heads < 1) return invalid("num_heads must be >= 1 (got " + str(num_heads) + ")");
  if (Status st = check_head_dims(head_dim_k, head_dim_v); !st) return st;
  if (num_slots < 0) return invalid("num_slots must be >= 0 (got " + str(num_slots) + ")");
  if (Status st = detail::check_padding_slot(padding_slot, num_slots, "num_slots"); !st) return st;
  if (state_dtype != DType::kBF16 && state_dtype != DType::kF32) {
    return invalid("state_dtype must be bf16 or f32 (got " + dtype_name(state_dtype) + ")");
  }
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------------------------
Status detail::check_problem_fields(const Problem& p) {
  if (p.batch < 1) return invalid("batch must be >= 1 (got " + str(p.batch) + ")");
  if (p.seq_len < 0) return invalid("seq_len must be >= 0 (got " + str(p.seq_len) + ")");
  if (p.num_heads < 1) return invalid("num_heads must be >= 1 (got " + str(p.num_heads) + ")");
  if (Status st = check_head_dims(p.head_dim_k, p.head_dim_v); !st) return st;
  if (p.cu_seqlens_dtype != DType::kNone && p.cu_seqlens_dtype != DType::kI32 &&
      p.cu_seqlens_dtype != DType::kI64) {
    return invalid("cu_seqlens_dtype must be none, i32 or i64 (got " +
                   dtype_name(p.cu_seqlens_dtype) + ")");
  }
  if (p.varlen()) {
    if (p.batch != 1) {
      return invalid("batch must be 1 with cu_seqlens (got " + str(p.batch) + ")");
    }
    if (p.num_seqs < 0) return invalid("num_seqs must be >= 0 (got " + str(p.num_seqs) + ")");
    if (p.num_seqs == std::numeric_limits<std::int64_t>::max()) {
      return Status(StatusCode::kOverflow, "cu_seqlens entries num_seqs+1 overflows 64-bit sizes");
    }
    if (p.num_seqs == 0 && p.seq_len > 0) {
      return invalid("num_seqs is 0 but seq_len is " + str(p.seq_len) +
                     " (zero sequences hold no tokens)");
    }
    if (p.cu_seqlens_dtype == DType::kI32 && p.seq_len > std::numeric_limits<std::int32_t>::max()) {
      return invalid("seq_len " + str(p.seq_len) + " does not fit i32 cu_seqlens");
    }
  }
  if (Status st = check_gate_and_scale(p.gate, p.lower_bound, p.scale); !st) return st;
  if (!valid_state_dtype(p.initial_state_dtype)) {
    return invalid("initial_state_dtype must be none, bf16 or f32 (got " +
                   dtype_name(p.initial_state_dtype) + ")");
  }
  if (!valid_state_dtype(p.final_state_dtype)) {
    return invalid("final_state_dtype must be none, bf16 or f32 (got " +
                   dtype_name(p.final_state_dtype) + ")");
  }
  if (p.num_state_slots < 0) {
    return invalid("num_state_slots must be >= 0 (got " + str(p.num_state_slots) + ")");
  }
  if (p.num_state_slots > 0 && p.initial_state_dtype == DType::kNone &&
      p.final_state_dtype == DType::kNone) {
    return invalid("num_state_slots is " + str(p.num_state_slots) +
                   " but neither initial_state_dtype nor final_state_dtype is set (slots address "
                   "states)");
  }
  if (Status st = detail::check_padding_slot(p.padding_slot, p.num_state_slots, "num_state_slots");
      !st)
    return st;
  if (p.checkpoints < 0)
    return invalid("checkpoints must be >= 0 (got " + str(p.checkpoints) + ")");
  if (p.checkpoints > 0) {
    if (p.num_state_slots == 0 || p.final_state_dtype == DType::kNone) {
      return invalid("checkpoints (" + str(p.checkpoints) +
                     ") need state slots and a final state (they are written to the pool)");
    }
    if (p.checkpoint_offsets_dtype != DType::kI32 && p.checkpoint_offsets_dtype != DType::kI64) {
      return invalid("checkpoint_offsets_dtype must be i32 or i64 (got " +
                     dtype_name(p.checkpoint_offsets_dtype) + ")");
    }
  }
  return Status::Ok();
}

Status validate(const Problem& p) {
  if (Status st = detail::check_problem_fields(p); !st) return st;
  // Every size the problem implies fits: the table of its (absent) tensors can be built.
  detail::ArgumentTable table;
  return detail::prefill_arguments(p, Tensors{}, &table);
}

Status validate(const Problem& p, const Tensors& t) {
  detail::ArgumentTable table;
  return detail::validate_arguments(p, t, &table);
}

namespace detail {
Status check_padding_slot(std::int32_t padding_slot, std::int64_t pool, const char* pool_name) {
  if (padding_slot >= 0 && padding_slot >= pool) {
    return invalid("padding_slot " + str(std::int64_t{padding_slot}) + " is outside the pool of " +
                   pool_name + " = " + str(pool) + " (negative: no padding slot)");
  }
  return Status::Ok();
}

Status check_state_slots(const Problem& p, const std::int32_t* slots, std::uint64_t* seen_bits) {
  const std::int64_t n = p.sequences();
  const bool writes = p.final_state_dtype != DType::kNone;
  auto outside = [&](std::int64_t s) {
    return invalid("state_slots[" + str(s) + "] = " + str(std::int64_t{slots[s]}) +
                   " is outside the pool of num_state_slots = " + str(p.num_state_slots));
  };
  auto repeated = [&](std::int64_t s, std::int64_t first) {
    return invalid("state_slots[" + str(s) + "] = " + str(std::int64_t{slots[s]}) +
                   " repeats state_slots[" + str(first) +
                   "] (two sequences cannot write one state)");
  };
  // Padding (negative, or the padding slot) may repeat; without a final state nothing is written.
  auto free_to_repeat = [&](std::int32_t slot) {
    return slot < 0 || slot == p.padding_slot || slot >= p.num_state_slots || !writes;
  };
  if (seen_bits == nullptr || !writes) {
    // The first repeat, then the first entry outside the pool before it: the first error in order.
    const auto [first, repeat] = find_repeated_slot(slots, n, free_to_repeat);
    for (std::int64_t s = 0; s < n && (repeat < 0 || s < repeat); ++s) {
      if (slots[s] >= p.num_state_slots) return outside(s);
    }
    return repeat >= 0 ? repeated(repeat, first) : Status::Ok();
  }
  std::fill(seen_bits, seen_bits + (p.num_state_slots + 63) / 64, std::uint64_t{0});
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int32_t slot = slots[s];
    if (slot >= p.num_state_slots) return outside(s);
    if (free_to_repeat(slot)) continue;
    std::uint64_t& word = seen_bits[slot / 64];
    const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
    if ((word & bit) != 0) {
      std::int64_t first = 0;  // only on the error path
      while (slots[first] != slot) ++first;
      return repeated(s, first);
    }
    word |= bit;
  }
  return Status::Ok();
}

Status check_checkpoints(const Problem& p, const Tensors& t, std::uint64_t* seen_bits) {
  const std::int64_t n = p.sequences(), K = p.checkpoints;
  for (std::int64_t s = 0; s < n; ++s) {
    // A padding sequence's requests are not read (it writes no state): the rule the layer and the
    // CUDA index kernel follow too.
    const std::int32_t own = t.state_slots[s];
    if (own < 0 || own == p.padding_slot) continue;
    std::int64_t length = p.seq_len;
    if (p.varlen()) {
      length = p.cu_seqlens_dtype == DType::kI64
                   ? static_cast<const std::int64_t*>(t.cu_seqlens)[s + 1] -
                         static_cast<const std::int64_t*>(t.cu_seqlens)[s]
                   : std::int64_t{static_cast<const std::int32_t*>(t.cu_seqlens)[s + 1]} -
                         static_cast<const std::int32_t*>(t.cu_seqlens)[s];
    }
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t i = s * K + k;
      const std::int64_t offset = p.checkpoint_offsets_dtype == DType::kI64
                                      ? static_cast<const std::int64_t*>(t.checkpoint_offsets)[i]
                                      : static_cast<const std::int32_t*>(t.checkpoint_offsets)[i];
      const std::int64_t slot = t.checkpoint_slots[i];
      const std::string at = "[" + str(s) + "][" + str(k) + "]";
      if (offset < -1 || offset > length ||
          (offset >= 0 && offset % kCheckpointAlignment != 0 && offset != length)) {
        return invalid("checkpoint_offsets" + at + " = " + str(offset) + " is not -1, a multiple " +
                       "of " + str(kCheckpointAlignment) + " up to the sequence's length " +
                       str(length) + ", or that length");
      }
      if (slot >= p.num_state_slots) {
        return invalid("checkpoint_slots" + at + " = " + str(slot) +
                       " is outside the pool of num_state_slots = " + str(p.num_state_slots));
      }
      if (slot < 0 || slot == p.padding_slot || offset < 0) continue;
      std::uint64_t& word = seen_bits[slot / 64];
      const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
      if ((word & bit) != 0) {
        return invalid("checkpoint_slots" + at + " = " + str(slot) +
                       " is written twice in the call (another checkpoint or a sequence's state)");
      }
      word |= bit;
    }
  }
  return Status::Ok();
}
}  // namespace detail

namespace detail {
Status validate_transition(const Problem& p, const Tensors& t, const float* p_t, const float* h_t,
                           ArgumentTable* table) {
  if (Status st = validate(p); !st) return st;
  if (p.initial_state_dtype != DType::kNone || p.final_state_dtype != DType::kNone ||
      p.num_state_slots != 0) {
    return invalid(
        "a segment transition starts from no state: initial_state_dtype, final_state_dtype and "
        "num_state_slots must be unset");
  }
  if (t.out != nullptr || t.initial_state != nullptr || t.final_state != nullptr ||
      t.state_slots != nullptr || t.state_slots_host != nullptr) {
    return invalid(
        "a segment transition writes p_t and h_t only: out, initial_state, final_state and "
        "state_slots must be null");
  }
  ArgumentTable local;
  if (table == nullptr) table = &local;
  if (Status st = transition_arguments(p, t, p_t, h_t, table); !st) return st;
  return check_tensors(*table);
}
}  // namespace detail

Status validate_apply_transition(std::int64_t pairs, std::int64_t head_dim_k,
                                 std::int64_t head_dim_v, const float* s_in, const float* p_t,
                                 const float* h_t, const float* s_out,
                                 detail::ArgumentTable* table) {
  if (pairs < 0) return invalid("pairs must be >= 0 (got " + str(pairs) + ")");
  if (Status st = check_head_dims(head_dim_k, head_dim_v); !st) return st;
  detail::ArgumentTable local;
  if (table == nullptr) table = &local;
  if (Status st = detail::apply_transition_arguments(pairs, head_dim_k, head_dim_v, s_in, p_t, h_t,
                                                     s_out, table);
      !st) {
    return st;
  }
  return detail::check_tensors(*table);
}

Status validate_state_slots(const Problem& p, const std::int32_t* state_slots_host) {
  if (Status st = validate(p); !st) return st;
  if (p.num_state_slots == 0) return invalid("state_slots given but num_state_slots is 0");
  if (p.sequences() > 0 && state_slots_host == nullptr) return invalid("state_slots is null");
  return detail::check_state_slots(p, state_slots_host, nullptr);
}

Status validate_cu_seqlens(const Problem& p, const void* cu_seqlens_host) {
  if (Status st = validate(p); !st) return st;
  if (!p.varlen()) return invalid("cu_seqlens given but cu_seqlens_dtype is none");
  if (cu_seqlens_host == nullptr) return invalid("cu_seqlens is null");
  const bool is_i64 = p.cu_seqlens_dtype == DType::kI64;
  auto at = [&](std::int64_t i) -> std::int64_t {
    return is_i64 ? static_cast<const std::int64_t*>(cu_seqlens_host)[i]
                  : static_cast<const std::int32_t*>(cu_seqlens_host)[i];
  };
  if (at(0) != 0) return invalid("cu_seqlens[0] must be 0 (got " + str(at(0)) + ")");
  for (std::int64_t i = 1; i <= p.num_seqs; ++i) {
    if (at(i) < at(i - 1)) {
      return invalid("cu_seqlens must be non-decreasing: cu_seqlens[" + str(i) +
                     "] = " + str(at(i)) + " < cu_seqlens[" + str(i - 1) + "] = " + str(at(i - 1)));
    }
  }
  if (at(p.num_seqs) != p.seq_len) {
    return invalid("cu_seqlens[" + str(p.num_seqs) + "] must equal seq_len " + str(p.seq_len) +
                   " (got " + str(at(p.num_seqs)) + ")");
  }
  return Status::Ok();
}

Status validate_cu_seqlens(const std::int64_t* cu_seqlens_host, std::int64_t sequences,
                           std::int64_t tokens) {
  Problem p;
  p.seq_len = tokens;
  p.num_heads = 1;
  p.num_seqs = sequences;
  p.cu_seqlens_dtype = DType::kI64;
  return validate_cu_seqlens(p, cu_seqlens_host);
}

Status validate_cu_seqlens(const std::int32_t* cu_seqlens_host, std::int64_t sequences,
                           std::int64_t tokens) {
  Problem p;
  p.seq_len = tokens;
  p.num_heads = 1;
  p.num_seqs = sequences;
  p.cu_seqlens_dtype = DType::kI32;
  return validate_cu_seqlens(p, cu_seqlens_host);
}

namespace {
Status can_run_cuda(std::int64_t head_dim_k, std::int64_t head_dim_v) {
  if (head_dim_k != detail::kHeadDim || head_dim_v != detail::kHeadDim) {
    return Status(StatusCode::kUnsupported,
                  "the CUDA backend needs head_dim_k == head_dim_v == 128 (got K = " +
                      str(head_dim_k) + ", V = " + str(head_dim_v) + ")");
  }
  if (!cuda_compiled()) {
    return Status(StatusCode::kBackendUnavailable, "the CUDA backend is not compiled in");
  }
  if (cuda_device_count() <= 0) {
    return Status(StatusCode::kBackendUnavailable, "no CUDA device is present");
  }
  return cuda_device_supported();
}

// The CUDA kernels' grids: heads on y (at most 65,535), chunk slots, sequences or decode rows on
// x (at most 2^31 - 1).
constexpr std::int64_t kMaxGridY = 65535;
constexpr std::int64_t kMaxGridX = 2147483647;

Status check_cuda_grid(std::int64_t num_heads, const char* x_what, std::uint64_t x_count) {
  if (num_heads > kMaxGridY) {
    return Status(StatusCode::kUnsupported, "the CUDA backend runs at most " + str(kMaxGridY) +
                                                " heads per call (got " + str(num_heads) + ")");
  }
  if (x_count > static_cast<std::uint64_t>(kMaxGridX)) {
    return Status(StatusCode::kUnsupported, std::string("the CUDA backend runs at most ") +
                                                str(kMaxGridX) + " " + x_what + " per call (got " +
                                                std::to_string(x_count) + ")");
  }
  return Status::Ok();
}

Status check_backend(Backend backend) {
  if (backend != Backend::kCpu && backend != Backend::kCuda) {
    return invalid("backend must be cpu or cuda (got " + std::to_string(static_cast<int>(backend)) +
                   ")");
  }
  return Status::Ok();
}
}  // namespace

Status lower_bound_from_double(double bound, float* used) {
  // Cast only in range: a double beyond float's range has no float (the conversion is undefined).
  const bool in_range = std::isfinite(bound) && bound >= -5.0 && bound < 0.0;
  const float as_float = in_range ? static_cast<float>(bound) : 0.0f;
  if (used != nullptr) *used = as_float;
  if (in_range && as_float < 0.0f) return Status::Ok();
  return invalid(std::string("outside [-5, 0) or not finite") +
                 (in_range ? " (as a float it is -0)" : ""));
}

namespace {
// can_implement's limits of a backend, for a problem validate() accepts.
Status backend_limits(const Problem& p, Backend backend) {
  if (backend == Backend::kCuda) {
    std::uint64_t slots = 0;
    detail::num_chunk_slots(static_cast<std::uint64_t>(p.total_tokens()),
                            static_cast<std::uint64_t>(p.sequences()), &slots);
    if (Status st =
            check_cuda_grid(p.num_heads, "sequences", static_cast<std::uint64_t>(p.sequences()));
        !st) {
      return st;
    }
    if (Status st =
            check_cuda_grid(p.num_heads, "16-token chunk slots (tokens / 16 + sequences)", slots);
        !st) {
      return st;
    }
    return can_run_cuda(p.head_dim_k, p.head_dim_v);
  }
  return Status::Ok();
}
}  // namespace

Status can_implement(const Problem& p, Backend backend) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  return backend_limits(p, backend);
}

Status detail::implement_and_validate(const Problem& p, const Tensors& t, Backend backend,
                                      ArgumentTable* table) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = check_problem_fields(p); !st) return st;
  if (Status st = prefill_arguments(p, t, table); !st) return st;  // the sizes, as validate(p)
  if (Status st = backend_limits(p, backend); !st) return st;
  return check_tensors(*table);
}

// CPU: one scratch slot (state + token vectors, sized for fp64) per thread, for up to
// min(N*H, kMaxThreads) threads, plus slack to align the caller's pointer.
// CUDA: the chunk records of kda/src/workspace_layout.hpp.
Status workspace_size(const Problem& p, Backend backend, std::size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes is null");
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  return detail::checked_workspace_size(p, backend, bytes);
}

Status detail::checked_workspace_size(const Problem& p, Backend backend, std::size_t* bytes) {
  std::uint64_t total = 0;
  if (backend == Backend::kCpu) {
    const std::uint64_t items = static_cast<std::uint64_t>(p.sequences()) *
                                static_cast<std::uint64_t>(p.num_heads);  // checked in validate
    const std::uint64_t slots = std::min<std::uint64_t>(items, detail::cpu::kMaxThreads);
    if (slots > 0) {
      total = slots * detail::cpu::slot_bytes(static_cast<std::uint64_t>(p.head_dim_k),
                                              static_cast<std::uint64_t>(p.head_dim_v)) +
              detail::cpu::kSlotAlignment;
    }
    // The duplicate-slot bitmap sits after the thread slots (validate bounded num_state_slots).
    total += detail::state_slot_bitmap_bytes(p);
  } else if (!detail::cuda_prefill_workspace_bytes(
                 static_cast<std::uint64_t>(p.total_tokens()),
                 static_cast<std::uint64_t>(p.sequences()), static_cast<std::uint64_t>(p.num_heads),
                 static_cast<std::uint64_t>(p.num_state_slots), &total) ||
             total > detail::kMaxSize) {
    return Status(StatusCode::kOverflow, "CUDA workspace bytes overflow 64-bit sizes");
  }
  if (total > std::numeric_limits<std::size_t>::max()) {
    return Status(StatusCode::kOverflow, "workspace bytes do not fit size_t");
  }
  *bytes = static_cast<std::size_t>(total);
  return Status::Ok();
}

// CPU: one scratch slot per thread sized for V + K state rows (cpu_recurrence.hpp,
// transition_stride); CUDA: the chunk records alone (no segment blocks).
Status transition_workspace_size(const Problem& p, Backend backend, std::size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes is null");
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  std::uint64_t total = 0;
  if (backend == Backend::kCpu) {
    // One scratch slot per thread, its state V + K rows tall (the P^T rows ride along as extra
    // value columns with v = 0).
    const std::uint64_t items =
        static_cast<std::uint64_t>(p.sequences()) * static_cast<std::uint64_t>(p.num_heads);
    const std::uint64_t slots = std::min<std::uint64_t>(items, detail::cpu::kMaxThreads);
    if (slots > 0) {
      total = slots * detail::cpu::transition_stride(p.head_dim_k, p.head_dim_v) +
              detail::cpu::kSlotAlignment;
    }
  } else {
    // The chunk records only: transitions run one segment per sequence.
    std::uint64_t slots = 0, records = 0;
    if (!detail::num_chunk_slots(static_cast<std::uint64_t>(p.total_tokens()),
                                 static_cast<std::uint64_t>(p.sequences()), &slots) ||
        !detail::checked_mul(slots, static_cast<std::uint64_t>(p.num_heads), &records) ||
        !detail::checked_mul(records, detail::ChunkRecord::kBytes, &total) ||
        !detail::checked_add(total, detail::kWorkspaceAlignment, &total) ||
        total > detail::kMaxSize) {
      return Status(StatusCode::kOverflow, "CUDA transition workspace bytes overflow 64-bit sizes");
    }
  }
  if (total > std::numeric_limits<std::size_t>::max()) {
    return Status(StatusCode::kOverflow, "workspace bytes do not fit size_t");
  }
  *bytes = static_cast<std::size_t>(total);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------------
Status detail::check_problem_fields(const DecodeProblem& p) {
  if (Status st = check_step_shape(p.batch, p.tokens, p.num_heads, p.head_dim_k, p.head_dim_v,
                                   p.num_slots, p.padding_slot, p.state_dtype);
      !st) {
    return st;
  }
  if (Status st = check_gate_and_scale(p.gate, p.lower_bound, p.scale); !st) return st;
  if (p.records && !p.verify) {
    return invalid("records is set but verify is not (records are a verify step's form)");
  }
  if (p.fold_batch < 0) return invalid("fold_batch must be >= 0 (got " + str(p.fold_batch) + ")");
  if (p.folds()) {
    if (p.fold_tokens < 1 || p.fold_tokens > kMaxDecodeTokens) {
      return invalid("fold_tokens must be in [1, " + str(kMaxDecodeTokens) + "] (got " +
                     str(p.fold_tokens) + ")");
    }
    if (p.verify && !p.records) {
      return invalid(
          "fold_batch is set on a per-token-states verify step (a plain or a records step may "
          "fold)");
    }
  }
  return Status::Ok();
}

Status validate(const DecodeProblem& p) {
  if (Status st = detail::check_problem_fields(p); !st) return st;
  // Every size the problem implies fits: the table of its (absent) tensors can be built.
  detail::ArgumentTable table;
  return detail::decode_arguments(p, DecodeTensors{}, &table);
}

Status validate(const DecodeProblem& p, const DecodeTensors& t) {
  detail::ArgumentTable table;
  return detail::validate_arguments(p, t, &table);
}

namespace {
Status backend_limits(const DecodeProblem& p, Backend backend) {
  if (backend == Backend::kCuda) {
    if (Status st =
            check_cuda_grid(p.num_heads, "decode rows", static_cast<std::uint64_t>(p.batch));
        !st) {
      return st;
    }
    return can_run_cuda(p.head_dim_k, p.head_dim_v);
  }
  return Status::Ok();
}
}  // namespace

Status can_implement(const DecodeProblem& p, Backend backend) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  return backend_limits(p, backend);
}

Status detail::implement_and_validate(const DecodeProblem& p, const DecodeTensors& t,
                                      Backend backend, ArgumentTable* table) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = check_problem_fields(p); !st) return st;
  if (Status st = decode_arguments(p, t, table); !st) return st;  // the sizes, as validate(p)
  if (Status st = backend_limits(p, backend); !st) return st;
  return check_tensors(*table);
}

// ---------------------------------------------------------------------------------------------
// Commit
// ---------------------------------------------------------------------------------------------
Status validate(const CommitProblem& p) {
  if (Status st = check_step_shape(p.batch, p.tokens, p.num_heads, p.head_dim_k, p.head_dim_v,
                                   p.num_slots, p.padding_slot, p.state_dtype);
      !st) {
    return st;
  }
  detail::ArgumentTable table;
  return detail::commit_arguments(p, CommitLayer{}, nullptr, nullptr, &table);
}

Status can_implement(const CommitProblem& p, Backend backend) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  if (backend == Backend::kCuda) {
    // One block per (layer, row) on x, for up to kMaxCommitLayers layers.
    const std::uint64_t rows =
        static_cast<std::uint64_t>(p.batch) * static_cast<std::uint64_t>(kMaxCommitLayers);
    if (Status st = check_cuda_grid(p.num_heads, "commit rows x kMaxCommitLayers", rows); !st) {
      return st;
    }
    return can_run_cuda(p.head_dim_k, p.head_dim_v);
  }
  return Status::Ok();
}

}  // namespace kda
