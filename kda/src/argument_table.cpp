// The argument tables of the prefill and decode problems, and the checks that walk them (see
// argument_table.hpp for why there is one table).
#include "argument_table.hpp"

#include <initializer_list>
#include <string>

#include "kda/detail/checked_math.hpp"
#include "state_slots.hpp"

namespace kda {
namespace detail {
namespace {

Status invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

// Product of non-negative factors, or kOverflow naming `what` when it passes kMaxSize.
Status checked_size(const char* what, std::initializer_list<std::int64_t> factors,
                    std::uint64_t* out) {
  std::uint64_t product = 1;
  for (std::int64_t factor : factors) {
    if (!checked_mul(product, static_cast<std::uint64_t>(factor), &product) || product > kMaxSize) {
      return Status(StatusCode::kOverflow, std::string(what) + " overflows 64-bit sizes");
    }
  }
  *out = product;
  return Status::Ok();
}

std::int64_t size_of(DType dtype) { return static_cast<std::int64_t>(dtype_size(dtype)); }

// The in-place pair: final_state over its initial_state (checked on its own, first).
bool in_place_pair(const Argument& out, const Argument& in) {
  return out.role == ArgumentRole::kStateOut && in.role == ArgumentRole::kStateIn;
}

}  // namespace

bool overlaps(const Argument& a, const Argument& b) {
  return byte_ranges_overlap(a.ptr, a.bytes, b.ptr, b.bytes);
}

Argument& ArgumentTable::add(const char* name, const void* ptr, std::uint64_t bytes, DType dtype,
                             ArgumentRole role) {
  // The builders add at most 16 rows; a 21st would be a programming error caught by every test.
  Argument& row = items[count < kCapacity ? count++ : kCapacity - 1];
  row = Argument{};
  row.name = name;
  row.ptr = ptr;
  row.bytes = bytes;
  row.dtype = dtype;
  row.role = role;
  return row;
}

namespace {

// A segment transition's outputs, which take the place of out and the states.
struct TransitionOutputs {
  const float* p_t;
  const float* h_t;
};

// Prefill (transition == null) or segment transition. Layouts: kda.hpp. The CUDA kernels move q, k,
// v, g and out in 16-byte pieces (bulk copies, vector stores), states and transitions in 8-byte
// pieces.
Status prefill_table(const Problem& p, const Tensors& t, const TransitionOutputs* transition,
                     ArgumentTable* table) {
  std::uint64_t scratch = 0, qk = 0, v = 0, beta = 0, a_log = 0, dt_bias = 0, cu = 0, slots = 0,
                initial = 0, final_bytes = 0, p_bytes = 0, h_bytes = 0;
  Status st;
  if (!(st = checked_size("total tokens B*T", {p.batch, p.seq_len}, &scratch))) return st;
  if (!(st = checked_size("q/k/g bytes B*T*H*K*2",
                          {p.batch, p.seq_len, p.num_heads, p.head_dim_k, 2}, &qk))) {
    return st;
  }
  if (!(st = checked_size("v/out bytes B*T*H*V*2",
                          {p.batch, p.seq_len, p.num_heads, p.head_dim_v, 2}, &v))) {
    return st;
  }
  if (!(st = checked_size("beta bytes B*T*H*2", {p.batch, p.seq_len, p.num_heads, 2}, &beta))) {
    return st;
  }
  if (!(st = checked_size("A_log bytes H*4", {p.num_heads, 4}, &a_log))) return st;
  if (!(st = checked_size("dt_bias bytes H*K*4", {p.num_heads, p.head_dim_k, 4}, &dt_bias))) {
    return st;
  }
  const std::int64_t n = p.sequences();
  if (!(st = checked_size("sequence-head pairs N*H", {n, p.num_heads}, &scratch))) return st;
  if (p.varlen() && !(st = checked_size("cu_seqlens bytes (N+1)*size",
                                        {n + 1, size_of(p.cu_seqlens_dtype)}, &cu))) {
    return st;
  }
  // States are [N, ...] or, addressed through state_slots, pools of num_state_slots entries.
  const bool pooled = p.num_state_slots > 0;
  const std::int64_t states = pooled ? p.num_state_slots : n;
  if (pooled && !(st = checked_size("state_slots bytes N*4", {n, 4}, &slots))) return st;
  if (p.initial_state_dtype != DType::kNone &&
      !(st = checked_size(
            pooled ? "initial_state bytes num_state_slots*H*V*K*size"
                   : "initial_state bytes N*H*V*K*size",
            {states, p.num_heads, p.head_dim_v, p.head_dim_k, size_of(p.initial_state_dtype)},
            &initial))) {
    return st;
  }
  if (p.final_state_dtype != DType::kNone &&
      !(st = checked_size(
            pooled ? "final_state bytes num_state_slots*H*V*K*size"
                   : "final_state bytes N*H*V*K*size",
            {states, p.num_heads, p.head_dim_v, p.head_dim_k, size_of(p.final_state_dtype)},
            &final_bytes))) {
    return st;
  }
  if (transition != nullptr &&
      (!(st = checked_size("p_t bytes N*H*K*K*4", {n, p.num_heads, p.head_dim_k, p.head_dim_k, 4},
                           &p_bytes)) ||
       !(st = checked_size("h_t bytes N*H*V*K*4", {n, p.num_heads, p.head_dim_v, p.head_dim_k, 4},
                           &h_bytes)))) {
    return st;
  }

  using R = ArgumentRole;
  const DType bf16 = DType::kBF16;
  // Token tensors may be null only when there are no tokens at all.
  const bool tokens = p.total_tokens() > 0;
  table->count = 0;
  table->add("q", t.q, qk, bf16, R::kInput).cuda(16).required_if(tokens);
  table->add("k", t.k, qk, bf16, R::kInput).cuda(16).required_if(tokens);
  table->add("v", t.v, v, bf16, R::kInput).cuda(16).required_if(tokens);
  table->add("g", t.g, qk, bf16, R::kInput).cuda(16).required_if(tokens);
  table->add("beta", t.beta, beta, bf16, R::kInput).cuda(2).required_if(tokens);
  if (transition == nullptr) {
    table->add("out", t.out, v, bf16, R::kOutput).cuda(16).required_if(tokens);
  }
  table->add("A_log", t.A_log, a_log, DType::kF32, R::kInput).cuda(4).required_if(true);
  table->add("dt_bias", t.dt_bias, dt_bias, DType::kF32, R::kInput).cuda(4).required_if(true);
  Argument& cu_dev = table->add("cu_seqlens", t.cu_seqlens, cu, p.cu_seqlens_dtype, R::kIndex)
                         .cuda(p.cu_seqlens_dtype == DType::kI64 ? 8 : 4);
  Argument& cu_host =
      table->add("cu_seqlens_host", t.cu_seqlens_host, cu, p.cu_seqlens_dtype, R::kIndex).host();
  if (p.varlen()) {
    cu_dev.required_if(true);
  } else {
    cu_dev.unused_because("cu_seqlens_dtype is none");
    cu_host.unused_because("cu_seqlens_dtype is none");
  }
  const auto status_word = [&] {
    table->add("device_status", t.device_status, sizeof(std::uint32_t), DType::kI32, R::kStatus)
        .cuda(4);
  };
  if (transition != nullptr) {  // out, states and slots are null (validate_transition)
    table->add("p_t", transition->p_t, p_bytes, DType::kF32, R::kOutput)
        .cuda(8)
        .required_if(p_bytes > 0);
    table->add("h_t", transition->h_t, h_bytes, DType::kF32, R::kOutput)
        .cuda(8)
        .required_if(p_bytes > 0);
    status_word();
    return Status::Ok();
  }
  std::uint64_t cp_offsets = 0, cp_slots = 0;
  if (!(st = checked_size("checkpoint_offsets bytes N*checkpoints*size",
                          {n, p.checkpoints, size_of(p.checkpoint_offsets_dtype)}, &cp_offsets)) ||
      !(st = checked_size("checkpoint_slots bytes N*checkpoints*4", {n, p.checkpoints, 4},
                          &cp_slots))) {
    return st;
  }
  Argument& cp_off = table->add("checkpoint_offsets", t.checkpoint_offsets, cp_offsets,
                                p.checkpoint_offsets_dtype, R::kIndex);
  Argument& cp_dst =
      table->add("checkpoint_slots", t.checkpoint_slots, cp_slots, DType::kI32, R::kIndex);
  if (p.checkpoints > 0) {
    cp_off.cuda(p.checkpoint_offsets_dtype == DType::kI64 ? 8 : 4).required_if(n > 0);
    cp_dst.cuda(4).required_if(n > 0);
  } else {
    cp_off.unused_because("checkpoints is 0");
    cp_dst.unused_because("checkpoints is 0");
  }
  Argument& slots_dev =
      table->add("state_slots", t.state_slots, slots, DType::kI32, R::kIndex).cuda(4);
  Argument& slots_host =
      table->add("state_slots_host", t.state_slots_host, slots, DType::kI32, R::kIndex).host();
  if (pooled) {
    slots_dev.required_if(n > 0);
  } else {
    slots_dev.unused_because("num_state_slots is 0");
    slots_host.unused_because("num_state_slots is 0");
  }
  // States: a pointer exactly when a dtype is given (null allowed for a zero-sized state).
  Argument& h0 =
      table->add("initial_state", t.initial_state, initial, p.initial_state_dtype, R::kStateIn)
          .cuda(8);
  if (p.initial_state_dtype == DType::kNone) {
    h0.unused_because("initial_state_dtype is none");
  } else {
    h0.required_if(initial > 0, "initial_state_dtype");
  }
  Argument& ht =
      table->add("final_state", t.final_state, final_bytes, p.final_state_dtype, R::kStateOut)
          .cuda(8);
  if (p.final_state_dtype == DType::kNone) {
    ht.unused_because("final_state_dtype is none");
  } else {
    ht.required_if(final_bytes > 0, "final_state_dtype");
  }
  status_word();
  return Status::Ok();
}

}  // namespace

Status prefill_arguments(const Problem& p, const Tensors& t, ArgumentTable* table) {
  return prefill_table(p, t, nullptr, table);
}

Status transition_arguments(const Problem& p, const Tensors& t, const float* p_t, const float* h_t,
                            ArgumentTable* table) {
  const TransitionOutputs outputs{p_t, h_t};
  return prefill_table(p, t, &outputs, table);
}

// s_out^T = s_in^T P^T + H^T over `pairs` (sequence, head) pairs; s_out may be s_in. The CUDA
// kernel moves all four in 16-byte pieces.
Status apply_transition_arguments(std::int64_t pairs, std::int64_t head_dim_k,
                                  std::int64_t head_dim_v, const float* s_in, const float* p_t,
                                  const float* h_t, const float* s_out, ArgumentTable* table) {
  std::uint64_t s_bytes = 0, p_bytes = 0;
  Status st;
  if (!(st = checked_size("state bytes pairs*V*K*4", {pairs, head_dim_v, head_dim_k, 4},
                          &s_bytes)) ||
      !(st = checked_size("p_t bytes pairs*K*K*4", {pairs, head_dim_k, head_dim_k, 4}, &p_bytes))) {
    return st;
  }
  using R = ArgumentRole;
  const DType f32 = DType::kF32;
  const bool any = pairs > 0;
  table->count = 0;
  table->add("s_in", s_in, s_bytes, f32, R::kStateIn).cuda(16).required_if(any);
  table->add("p_t", p_t, p_bytes, f32, R::kInput).cuda(16).required_if(any);
  table->add("h_t", h_t, s_bytes, f32, R::kInput).cuda(16).required_if(any);
  table->add("s_out", s_out, s_bytes, f32, R::kStateOut).cuda(16).required_if(any);
  return Status::Ok();
}

// Decode. The CUDA kernel loads q, k, g and a bf16 pool in 8-byte pieces, v, dt_bias and an f32
// pool in 16.
Status decode_arguments(const DecodeProblem& p, const DecodeTensors& t, ArgumentTable* table) {
  std::uint64_t qk = 0, v = 0, beta = 0, a_log = 0, dt_bias = 0, slots = 0, pool = 0;
  Status st;
  if (!(st = checked_size("q/k/g bytes B*tokens*H*K*2",
                          {p.batch, p.tokens, p.num_heads, p.head_dim_k, 2}, &qk))) {
    return st;
  }
  if (!(st = checked_size("v/out bytes B*tokens*H*V*2",
                          {p.batch, p.tokens, p.num_heads, p.head_dim_v, 2}, &v))) {
    return st;
  }
  if (!(st = checked_size("beta bytes B*tokens*H*2", {p.batch, p.tokens, p.num_heads, 2}, &beta))) {
    return st;
  }
  if (!(st = checked_size("A_log bytes H*4", {p.num_heads, 4}, &a_log))) return st;
  if (!(st = checked_size("dt_bias bytes H*K*4", {p.num_heads, p.head_dim_k, 4}, &dt_bias))) {
    return st;
  }
  // A verify step's slots are [B, tokens]; its records form's, as a plain step's, [B].
  const bool slot_per_token = p.verify && !p.records;
  if (!(st = checked_size(slot_per_token ? "slots bytes B*tokens*4" : "slots bytes B*4",
                          {p.batch, slot_per_token ? p.tokens : 1, 4}, &slots))) {
    return st;
  }
  std::uint64_t records = 0, fold_records = 0;
  if (p.records &&
      !(st = checked_size("records bytes B*tokens*H*(2K+V)*4",
                          {p.batch, p.tokens, p.num_heads, 2 * p.head_dim_k + p.head_dim_v, 4},
                          &records))) {
    return st;
  }
  if (p.folds() && !(st = checked_size("fold_records bytes fold_batch*fold_tokens*H*(2K+V)*4",
                                       {p.fold_batch, p.fold_tokens, p.num_heads,
                                        2 * p.head_dim_k + p.head_dim_v, 4},
                                       &fold_records))) {
    return st;
  }
  if (!(st = checked_size(
            "state_pool bytes num_slots*H*V*K*size",
            {p.num_slots, p.num_heads, p.head_dim_v, p.head_dim_k, size_of(p.state_dtype)},
            &pool))) {
    return st;
  }

  using R = ArgumentRole;
  const DType bf16 = DType::kBF16;
  const bool rows = p.batch > 0;
  table->count = 0;
  table->add("q", t.q, qk, bf16, R::kInput).cuda(8).required_if(rows);
  table->add("k", t.k, qk, bf16, R::kInput).cuda(8).required_if(rows);
  table->add("v", t.v, v, bf16, R::kInput).cuda(16).required_if(rows);
  table->add("g", t.g, qk, bf16, R::kInput).cuda(8).required_if(rows);
  table->add("beta", t.beta, beta, bf16, R::kInput).cuda(2).required_if(rows);
  table->add("slots", t.slots, slots, DType::kI32, R::kIndex).cuda(4).required_if(rows);
  Argument& accepted = table->add("num_accepted", t.num_accepted,
                                  static_cast<std::uint64_t>(p.batch) * 4, DType::kI32, R::kIndex);
  if (p.records) {
    accepted.unused_because("DecodeProblem::records is true (the commit takes it)");
  } else if (p.verify) {
    accepted.cuda(4).required_if(rows);
  } else {
    accepted.unused_because("DecodeProblem::verify is false");
  }
  table->add("out", t.out, v, bf16, R::kOutput).cuda(2).required_if(rows);
  table->add("A_log", t.A_log, a_log, DType::kF32, R::kInput).cuda(4).required_if(true);
  table->add("dt_bias", t.dt_bias, dt_bias, DType::kF32, R::kInput).cuda(16).required_if(true);
  // The records form only reads the pool, unless it folds (it then stores the folded state).
  table
      ->add("state_pool", t.state_pool, pool, p.state_dtype,
            p.records && !p.folds() ? R::kInput : R::kInOut)
      .cuda(p.state_dtype == DType::kF32 ? 16 : 8)
      .required_if(pool > 0);
  // The CUDA kernel stores a record's alpha and k^ in 16-byte pieces.
  Argument& rec = table->add("records", t.records, records, DType::kF32, R::kOutput);
  if (p.records) {
    rec.cuda(16).required_if(rows);
  } else {
    rec.unused_because("DecodeProblem::records is false");
  }
  // The fold's records are read a float4 at a time on CUDA, as the commit reads them.
  Argument& fold_rec =
      table->add("fold_records", t.fold_records, fold_records, DType::kF32, R::kInput);
  Argument& fold_rows = table->add("fold_rows", t.fold_rows,
                                   static_cast<std::uint64_t>(p.batch) * 4, DType::kI32, R::kIndex);
  Argument& fold_counts =
      table->add("fold_counts", t.fold_counts, static_cast<std::uint64_t>(p.batch) * 4, DType::kI32,
                 R::kIndex);
  if (p.folds()) {
    fold_rec.cuda(16).required_if(rows);
    fold_rows.cuda(4).required_if(rows);
    fold_counts.cuda(4).required_if(rows);
  } else {
    fold_rec.unused_because("DecodeProblem::fold_batch is 0");
    fold_rows.unused_because("DecodeProblem::fold_batch is 0");
    fold_counts.unused_because("DecodeProblem::fold_batch is 0");
  }
  table->add("device_status", t.device_status, sizeof(std::uint32_t), DType::kI32, R::kStatus)
      .cuda(4);
  return Status::Ok();
}

// Commit. The CUDA kernel moves records and pools (either dtype) in 16-byte pieces.
Status commit_arguments(const CommitProblem& p, const CommitLayer& layer, const std::int32_t* slots,
                        const std::int32_t* num_accepted, ArgumentTable* table) {
  std::uint64_t records = 0, pool = 0, rows_bytes = 0;
  Status st;
  if (!(st = checked_size("records bytes B*tokens*H*(2K+V)*4",
                          {p.batch, p.tokens, p.num_heads, 2 * p.head_dim_k + p.head_dim_v, 4},
                          &records)) ||
      !(st = checked_size(
            "state_pool bytes num_slots*H*V*K*size",
            {p.num_slots, p.num_heads, p.head_dim_v, p.head_dim_k, size_of(p.state_dtype)},
            &pool)) ||
      !(st = checked_size("slots bytes B*4", {p.batch, 4}, &rows_bytes))) {
    return st;
  }
  using R = ArgumentRole;
  const bool rows = p.batch > 0;
  table->count = 0;
  table->add("records", layer.records, records, DType::kF32, R::kInput).cuda(16).required_if(rows);
  table->add("state_pool", layer.state_pool, pool, p.state_dtype, R::kInOut)
      .cuda(16)
      .required_if(rows && pool > 0);
  table->add("slots", slots, rows_bytes, DType::kI32, R::kIndex).cuda(4).required_if(rows);
  table->add("num_accepted", num_accepted, rows_bytes, DType::kI32, R::kIndex)
      .cuda(4)
      .required_if(rows);
  return Status::Ok();
}

Status validate_arguments(const Problem& p, const Tensors& t, ArgumentTable* table) {
  if (Status st = check_problem_fields(p); !st) return st;
  if (Status st = prefill_arguments(p, t, table); !st) return st;
  return check_tensors(*table);
}

Status validate_arguments(const DecodeProblem& p, const DecodeTensors& t, ArgumentTable* table) {
  if (Status st = check_problem_fields(p); !st) return st;
  if (Status st = decode_arguments(p, t, table); !st) return st;
  return check_tensors(*table);
}

Status check_tensors(const ArgumentTable& table) {
  if (Status st = check_presence(table); !st) return st;
  return check_no_overlap(table);
}

Status check_presence(const ArgumentTable& table) {
  for (const Argument& a : table) {
    if (a.presence == Presence::kRequired && a.ptr == nullptr) {
      std::string message = std::string(a.name) + " is null";
      if (a.why != nullptr) message += std::string(" but ") + a.why + " is " + to_string(a.dtype);
      return invalid(std::move(message));
    }
    if (a.presence == Presence::kUnused && a.ptr != nullptr) {
      return invalid(std::string(a.name) + " is set but " + a.why);
    }
  }
  return Status::Ok();
}

Status check_no_overlap(const ArgumentTable& table) {
  // In-place update: final_state may be initial_state itself (same dtype), never a partial overlap.
  for (const Argument& out : table) {
    if (out.role != ArgumentRole::kStateOut) continue;  // in_place_pair's first half, hoisted
    for (const Argument& in : table) {
      if (!in_place_pair(out, in)) continue;
      if (out.ptr != nullptr && out.ptr == in.ptr) {
        if (out.dtype != in.dtype) {
          return invalid(std::string(out.name) + " aliases " + in.name +
                         " but their dtypes differ (" + to_string(out.dtype) + " vs " +
                         to_string(in.dtype) + ")");
        }
      } else if (overlaps(out, in)) {
        return invalid(std::string(out.name) + " partially overlaps " + in.name +
                       " (only an exact alias is allowed)");
      }
    }
  }
  // Every written row against every other row; a pair of written rows once, named by the first.
  for (int i = 0; i < table.count; ++i) {
    const Argument& out = table.items[i];
    if (!writes(out.role) || out.ptr == nullptr || out.bytes == 0) continue;  // overlaps nothing
    for (int j = 0; j < table.count; ++j) {
      const Argument& other = table.items[j];
      if (j == i || (j < i && writes(other.role)) || in_place_pair(out, other)) continue;
      if (overlaps(out, other)) {
        return invalid(std::string(out.name) + " overlaps " + other.name +
                       " (outputs must not alias inputs)");
      }
    }
  }
  return Status::Ok();
}

Status check_workspace_apart(const ArgumentTable& table, const void* workspace,
                             std::uint64_t bytes) {
  const Argument scratch = byte_range(workspace, bytes);
  for (const Argument& a : table) {
    if (overlaps(scratch, a)) {
      return invalid(std::string("the workspace overlaps ") + a.name +
                     " (it is the operator's scratch, written by the call)");
    }
  }
  return Status::Ok();
}

Status check_cuda_alignment(const ArgumentTable& table, const char* user) {
  for (const Argument& a : table) {
    if (a.space != MemorySpace::kBackend) continue;
    if (reinterpret_cast<std::uintptr_t>(a.ptr) % a.cuda_alignment != 0) {
      return invalid(std::string(a.name) + " must be " + std::to_string(a.cuda_alignment) +
                     "-byte aligned for " + user);
    }
  }
  return Status::Ok();
}

Status check_host_copies(const Problem& p, const Tensors& t) {
  if (t.cu_seqlens_host != nullptr) {
    if (Status st = validate_cu_seqlens(p, t.cu_seqlens_host); !st) return st;
  }
  if (t.state_slots_host != nullptr) {
    if (Status st = check_state_slots(p, t.state_slots_host, nullptr); !st) return st;
  }
  return Status::Ok();
}

Status check_cuda_call(const Problem& p, const Tensors& t, const CudaOptions& opt,
                       ArgumentTable* table) {
  if (!is_known(opt.schedule)) {
    return invalid("CudaOptions::schedule is " + std::to_string(static_cast<int>(opt.schedule)) +
                   ", expected kAuto, kTwoPhase or kPipelined");
  }
  if (Status st = implement_and_validate(p, t, Backend::kCuda, table); !st) return st;
  if (Status st = check_host_copies(p, t); !st) return st;
  return check_cuda_alignment(*table, "the CUDA backend");
}

Status check_cuda_call(const DecodeProblem& p, const DecodeTensors& t, const CudaOptions& opt,
                       ArgumentTable* table) {
  if (Status st = implement_and_validate(p, t, Backend::kCuda, table); !st) return st;
  if (Status st = check_cuda_alignment(*table, "the CUDA decode"); !st) return st;
  if (opt.decode_blocks_per_head != 0 && !valid_blocks_per_head(opt.decode_blocks_per_head)) {
    return invalid("CudaOptions::decode_blocks_per_head is " +
                   std::to_string(opt.decode_blocks_per_head) + ", not 0, 1, 2 or 4");
  }
  return Status::Ok();
}

Status check_device_arguments(ArgumentTable table, const void* workspace, std::uint64_t bytes) {
  table.add("workspace", workspace, bytes, DType::kNone, ArgumentRole::kScratch);
  return check_device_arguments(table);
}

}  // namespace detail

Status check_cuda_call(const Problem& p, const Tensors& t, const CudaOptions& opt) {
  detail::ArgumentTable table;
  return detail::check_cuda_call(p, t, opt, &table);
}

Status check_cuda_call(const DecodeProblem& p, const DecodeTensors& t, const CudaOptions& opt) {
  detail::ArgumentTable table;
  return detail::check_cuda_call(p, t, opt, &table);
}

Status check_device_pointers(const Problem& p, const Tensors& t) {
  if (Status st = validate(p); !st) return st;
  detail::ArgumentTable table;
  if (Status st = detail::prefill_arguments(p, t, &table); !st) return st;
  return detail::check_device_arguments(table);
}

Status check_device_pointers(const DecodeProblem& p, const DecodeTensors& t) {
  if (Status st = validate(p); !st) return st;
  detail::ArgumentTable table;
  if (Status st = detail::decode_arguments(p, t, &table); !st) return st;
  return detail::check_device_arguments(table);
}

namespace {
Status invalid_commit(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}
std::string layer_name(int i) { return "layers[" + std::to_string(i) + "]"; }
// A layer's message with the layer named first.
Status in_layer(int i, const Status& st) {
  return Status(st.code(), layer_name(i) + ": " + st.message());
}
}  // namespace

Status validate(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                const std::int32_t* slots, const std::int32_t* num_accepted) {
  if (Status st = validate(p); !st) return st;
  if (num_layers < 0 || num_layers > kMaxCommitLayers) {
    return invalid_commit("num_layers must be in [0, " + std::to_string(kMaxCommitLayers) +
                          "] (got " + std::to_string(num_layers) + ")");
  }
  if (num_layers > 0 && layers == nullptr) {
    return invalid_commit("layers is null but num_layers is " + std::to_string(num_layers));
  }
  detail::ArgumentTable table;
  for (int i = 0; i < num_layers; ++i) {
    if (Status st = detail::commit_arguments(p, layers[i], slots, num_accepted, &table); !st) {
      return st;
    }
    if (Status st = detail::check_tensors(table); !st) return in_layer(i, st);
  }
  // Across layers: a pool (written) overlaps no other layer's pool or records. Every layer's
  // records and pool have the sizes of the last table's rows 0 and 1. (L^2 / 2 comparisons of two
  // ranges: about 1 us of host time for 20 layers.)
  if (num_layers < 2) return Status::Ok();
  const std::uint64_t record_bytes = table.items[0].bytes, pool_bytes = table.items[1].bytes;
  for (int i = 0; i < num_layers; ++i) {
    const detail::Argument pool = detail::byte_range(layers[i].state_pool, pool_bytes);
    for (int j = 0; j < num_layers; ++j) {
      if (j == i) continue;
      if (j > i && detail::overlaps(pool, detail::byte_range(layers[j].state_pool, pool_bytes))) {
        return invalid_commit(layer_name(i) + ".state_pool overlaps " + layer_name(j) +
                              ".state_pool (each layer updates its own pool)");
      }
      if (detail::overlaps(pool, detail::byte_range(layers[j].records, record_bytes))) {
        return invalid_commit(layer_name(i) + ".state_pool overlaps " + layer_name(j) +
                              ".records (outputs must not alias inputs)");
      }
    }
  }
  return Status::Ok();
}

Status check_cuda_call(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                       const std::int32_t* slots, const std::int32_t* num_accepted,
                       const std::uint32_t* device_status) {
  if (Status st = can_implement(p, Backend::kCuda); !st) return st;
  if (Status st = validate(p, layers, num_layers, slots, num_accepted); !st) return st;
  if (reinterpret_cast<std::uintptr_t>(device_status) % 4 != 0) {
    return invalid_commit("device_status must be 4-byte aligned for the CUDA commit");
  }
  detail::ArgumentTable table;
  for (int i = 0; i < num_layers; ++i) {
    detail::commit_arguments(p, layers[i], slots, num_accepted, &table);
    if (Status st = detail::check_cuda_alignment(table, "the CUDA commit"); !st) {
      return in_layer(i, st);
    }
  }
  return Status::Ok();
}

Status check_device_pointers(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                             const std::int32_t* slots, const std::int32_t* num_accepted) {
  if (Status st = validate(p, layers, num_layers, slots, num_accepted); !st) return st;
  detail::ArgumentTable table;
  for (int i = 0; i < num_layers; ++i) {
    detail::commit_arguments(p, layers[i], slots, num_accepted, &table);
    // slots and num_accepted once, with the first layer.
    if (i > 0) table.count = 2;
    if (Status st = detail::check_device_arguments(table); !st) return in_layer(i, st);
  }
  return Status::Ok();
}

}  // namespace kda
