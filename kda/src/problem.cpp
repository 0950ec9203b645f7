// Validation, can_implement and workspace_size for the prefill and decode problems.
//
// Every check returns a Status whose message names the offending field and its value. Sizes are
// computed in overflow-checked 64-bit arithmetic and must stay below 2^63 (the backends index with
// signed 64-bit integers), so any problem that validates can be addressed without overflow.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>

#include "cpu_recurrence.hpp"
#include "kda/kda.hpp"
#include "state_slots.hpp"
#include "transition.hpp"
#include "tensor_extents.hpp"
#include "workspace_layout.hpp"

namespace kda {
namespace {

// Head dimensions above this are rejected as absurd (Kimi Linear uses 128).
constexpr std::int64_t kMaxHeadDim = 4096;
constexpr std::int64_t kMaxDecodeTokens = 16;
constexpr std::uint64_t kMaxSize =
    static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

Status invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

std::string str(std::int64_t value) { return std::to_string(value); }
std::string str(float value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", static_cast<double>(value));
  return text;
}

// Product of non-negative factors, or kOverflow naming `what` when it passes 2^63 - 1.
Status checked_product(const char* what, std::initializer_list<std::int64_t> factors,
                       std::uint64_t* out) {
  std::uint64_t product = 1;
  for (std::int64_t factor : factors) {
    const std::uint64_t f = static_cast<std::uint64_t>(factor);
    if (!detail::checked_mul(product, f, &product) || product > kMaxSize) {
      return Status(StatusCode::kOverflow, std::string(what) + " overflows 64-bit sizes");
    }
  }
  *out = product;
  return Status::Ok();
}

bool valid_gate(GateMode gate) {
  return gate == GateMode::kLowerBound || gate == GateMode::kSoftplus;
}
bool valid_state_dtype(DType dtype) {
  return dtype == DType::kNone || dtype == DType::kBF16 || dtype == DType::kF32;
}
std::string dtype_name(DType dtype) {
  const int raw = static_cast<int>(dtype);
  if (raw < 0 || raw > static_cast<int>(DType::kI64)) return "dtype(" + std::to_string(raw) + ")";
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

// Byte range of a tensor, for the aliasing checks. Null or empty ranges overlap nothing.
struct Range {
  const char* name;
  const void* ptr;
  std::uint64_t bytes;
};

bool overlaps(const Range& a, const Range& b) {
  if (a.ptr == nullptr || b.ptr == nullptr || a.bytes == 0 || b.bytes == 0) return false;
  const std::uintptr_t a0 = reinterpret_cast<std::uintptr_t>(a.ptr);
  const std::uintptr_t b0 = reinterpret_cast<std::uintptr_t>(b.ptr);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

// `output` must not overlap any of `inputs`.
Status check_no_overlap(const Range& output, std::initializer_list<Range> inputs) {
  for (const Range& input : inputs) {
    if (overlaps(output, input)) {
      return invalid(std::string(output.name) + " overlaps " + input.name +
                     " (outputs must not alias inputs)");
    }
  }
  return Status::Ok();
}

Status require(const void* ptr, const char* name) {
  if (ptr == nullptr) return invalid(std::string(name) + " is null");
  return Status::Ok();
}

// Sizes of a valid prefill problem, in bytes.
struct PrefillSizes {
  std::uint64_t qk_bytes = 0;  // q, k, g each
  std::uint64_t v_bytes = 0;   // v, out each
  std::uint64_t beta_bytes = 0;
  std::uint64_t a_log_bytes = 0;
  std::uint64_t dt_bias_bytes = 0;
  std::uint64_t cu_bytes = 0;
  std::uint64_t initial_state_bytes = 0;
  std::uint64_t final_state_bytes = 0;
  std::uint64_t state_slots_bytes = 0;  // int32 [N] with num_state_slots > 0
};

// Computes the sizes; the problem's shape fields are already known to be in range.
Status prefill_sizes(const Problem& p, PrefillSizes* s) {
  std::uint64_t scratch = 0;
  Status st;
  if (!(st = checked_product("total tokens B*T", {p.batch, p.seq_len}, &scratch))) return st;
  if (!(st = checked_product("q/k/g bytes B*T*H*K*2",
                             {p.batch, p.seq_len, p.num_heads, p.head_dim_k, 2}, &s->qk_bytes))) {
    return st;
  }
  if (!(st = checked_product("v/out bytes B*T*H*V*2",
                             {p.batch, p.seq_len, p.num_heads, p.head_dim_v, 2}, &s->v_bytes))) {
    return st;
  }
  if (!(st = checked_product("beta bytes B*T*H*2", {p.batch, p.seq_len, p.num_heads, 2},
                             &s->beta_bytes))) {
    return st;
  }
  if (!(st = checked_product("A_log bytes H*4", {p.num_heads, 4}, &s->a_log_bytes))) return st;
  if (!(st = checked_product("dt_bias bytes H*K*4", {p.num_heads, p.head_dim_k, 4},
                             &s->dt_bias_bytes))) {
    return st;
  }
  const std::int64_t n = p.sequences();
  if (!(st = checked_product("sequence-head pairs N*H", {n, p.num_heads}, &scratch))) return st;
  if (p.varlen()) {
    if (!(st = checked_product("cu_seqlens bytes (N+1)*size",
                               {n + 1, static_cast<std::int64_t>(dtype_size(p.cu_seqlens_dtype))},
                               &s->cu_bytes))) {
      return st;
    }
  }
  // States are [N, ...] or, addressed through state_slots, pools of num_state_slots entries.
  const bool pooled = p.num_state_slots > 0;
  const std::int64_t states = pooled ? p.num_state_slots : n;
  if (pooled && !(st = checked_product("state_slots bytes N*4", {n, 4}, &s->state_slots_bytes))) {
    return st;
  }
  if (p.initial_state_dtype != DType::kNone) {
    if (!(st = checked_product(pooled ? "initial_state bytes num_state_slots*H*V*K*size"
                                      : "initial_state bytes N*H*V*K*size",
                               {states, p.num_heads, p.head_dim_v, p.head_dim_k,
                                static_cast<std::int64_t>(dtype_size(p.initial_state_dtype))},
                               &s->initial_state_bytes))) {
      return st;
    }
  }
  if (p.final_state_dtype != DType::kNone) {
    if (!(st = checked_product(pooled ? "final_state bytes num_state_slots*H*V*K*size"
                                      : "final_state bytes N*H*V*K*size",
                               {states, p.num_heads, p.head_dim_v, p.head_dim_k,
                                static_cast<std::int64_t>(dtype_size(p.final_state_dtype))},
                               &s->final_state_bytes))) {
      return st;
    }
  }
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------------------------
Status validate(const Problem& p) {
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
  PrefillSizes sizes;
  return prefill_sizes(p, &sizes);
}

Status validate(const Problem& p, const Tensors& t) {
  if (Status st = validate(p); !st) return st;
  PrefillSizes s;
  if (Status st = prefill_sizes(p, &s); !st) return st;

  // Token tensors may be null only when there are no tokens at all.
  if (p.total_tokens() > 0) {
    for (const Range& r : {Range{"q", t.q, 0}, Range{"k", t.k, 0}, Range{"v", t.v, 0},
                           Range{"g", t.g, 0}, Range{"beta", t.beta, 0}, Range{"out", t.out, 0}}) {
      if (Status st = require(r.ptr, r.name); !st) return st;
    }
  }
  if (Status st = require(t.A_log, "A_log"); !st) return st;
  if (Status st = require(t.dt_bias, "dt_bias"); !st) return st;

  if (p.varlen()) {
    if (Status st = require(t.cu_seqlens, "cu_seqlens"); !st) return st;
  } else if (t.cu_seqlens != nullptr || t.cu_seqlens_host != nullptr) {
    return invalid("cu_seqlens is set but cu_seqlens_dtype is none");
  }

  if (p.num_state_slots > 0) {
    if (p.sequences() > 0) {
      if (Status st = require(t.state_slots, "state_slots"); !st) return st;
    }
  } else if (t.state_slots != nullptr || t.state_slots_host != nullptr) {
    return invalid("state_slots is set but num_state_slots is 0");
  }

  // States: a pointer exactly when a dtype is given (null allowed for a zero-sized state).
  if (p.initial_state_dtype == DType::kNone && t.initial_state != nullptr) {
    return invalid("initial_state is set but initial_state_dtype is none");
  }
  if (p.initial_state_dtype != DType::kNone && s.initial_state_bytes > 0 &&
      t.initial_state == nullptr) {
    return invalid("initial_state is null but initial_state_dtype is " +
                   dtype_name(p.initial_state_dtype));
  }
  if (p.final_state_dtype == DType::kNone && t.final_state != nullptr) {
    return invalid("final_state is set but final_state_dtype is none");
  }
  if (p.final_state_dtype != DType::kNone && s.final_state_bytes > 0 && t.final_state == nullptr) {
    return invalid("final_state is null but final_state_dtype is " +
                   dtype_name(p.final_state_dtype));
  }

  const Range q{"q", t.q, s.qk_bytes}, k{"k", t.k, s.qk_bytes}, v{"v", t.v, s.v_bytes},
      g{"g", t.g, s.qk_bytes}, beta{"beta", t.beta, s.beta_bytes},
      a_log{"A_log", t.A_log, s.a_log_bytes}, dt_bias{"dt_bias", t.dt_bias, s.dt_bias_bytes},
      cu{"cu_seqlens", t.cu_seqlens, s.cu_bytes},
      cu_host{"cu_seqlens_host", t.cu_seqlens_host, s.cu_bytes},
      initial{"initial_state", t.initial_state, s.initial_state_bytes},
      final_state{"final_state", t.final_state, s.final_state_bytes}, out{"out", t.out, s.v_bytes},
      status{"device_status", t.device_status, sizeof(std::uint32_t)},
      slots{"state_slots", t.state_slots, s.state_slots_bytes},
      slots_host{"state_slots_host", t.state_slots_host, s.state_slots_bytes};

  // In-place update: final_state may be initial_state itself (same dtype), never a partial overlap.
  if (t.final_state != nullptr && t.final_state == t.initial_state) {
    if (p.final_state_dtype != p.initial_state_dtype) {
      return invalid("final_state aliases initial_state but their dtypes differ (" +
                     dtype_name(p.final_state_dtype) + " vs " + dtype_name(p.initial_state_dtype) +
                     ")");
    }
  } else if (overlaps(final_state, initial)) {
    return invalid("final_state partially overlaps initial_state (only an exact alias is allowed)");
  }
  if (Status st = check_no_overlap(out, {q, k, v, g, beta, a_log, dt_bias, cu, cu_host, initial,
                                        final_state, slots, slots_host});
      !st) {
    return st;
  }
  if (Status st = check_no_overlap(
          final_state, {q, k, v, g, beta, a_log, dt_bias, cu, cu_host, slots, slots_host});
      !st) {
    return st;
  }
  return check_no_overlap(status, {q, k, v, g, beta, a_log, dt_bias, cu, cu_host, initial,
                                   final_state, out, slots, slots_host});
}

namespace detail {
Status prefill_extents(const Problem& p, const Tensors& t, TensorExtents* out) {
  PrefillSizes s;
  if (Status st = prefill_sizes(p, &s); !st) return st;
  out->count = 0;
  out->add("q", t.q, s.qk_bytes);
  out->add("k", t.k, s.qk_bytes);
  out->add("v", t.v, s.v_bytes);
  out->add("g", t.g, s.qk_bytes);
  out->add("beta", t.beta, s.beta_bytes);
  out->add("A_log", t.A_log, s.a_log_bytes);
  out->add("dt_bias", t.dt_bias, s.dt_bias_bytes);
  out->add("cu_seqlens", t.cu_seqlens, s.cu_bytes);
  out->add("initial_state", t.initial_state, s.initial_state_bytes);
  out->add("final_state", t.final_state, s.final_state_bytes);
  out->add("state_slots", t.state_slots, s.state_slots_bytes);
  out->add("out", t.out, s.v_bytes);
  out->add("device_status", t.device_status, sizeof(std::uint32_t));
  return Status::Ok();
}
}  // namespace detail

namespace detail {
Status check_state_slots(const Problem& p, const std::int32_t* slots, std::uint64_t* seen_bits) {
  const std::int64_t n = p.sequences();
  const bool writes = p.final_state_dtype != DType::kNone;
  if (seen_bits != nullptr && writes) {
    std::fill(seen_bits, seen_bits + (p.num_state_slots + 63) / 64, std::uint64_t{0});
  }
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int32_t slot = slots[s];
    if (slot >= p.num_state_slots) {
      return invalid("state_slots[" + str(s) + "] = " + str(std::int64_t{slot}) +
                     " is outside the pool of num_state_slots = " + str(p.num_state_slots));
    }
    if (slot < 0 || !writes) continue;
    bool twice = false;
    std::int64_t first = -1;
    if (seen_bits != nullptr) {
      std::uint64_t& word = seen_bits[slot / 64];
      const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
      twice = (word & bit) != 0;
      word |= bit;
      for (std::int64_t r = 0; twice && r < s && first < 0; ++r) {  // only on the error path
        if (slots[r] == slot) first = r;
      }
    } else {
      for (std::int64_t r = 0; r < s && !twice; ++r) {
        if (slots[r] == slot) {
          twice = true;
          first = r;
        }
      }
    }
    if (twice) {
      return invalid("state_slots[" + str(s) + "] = " + str(std::int64_t{slot}) +
                     (first >= 0 ? " repeats state_slots[" + str(first) + "]" : " appears twice") +
                     " (two sequences cannot write one state)");
    }
  }
  return Status::Ok();
}
}  // namespace detail

namespace detail {
Status validate_transition(const Problem& p, const Tensors& t, const float* p_t, const float* h_t) {
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
  PrefillSizes s;
  if (Status st = prefill_sizes(p, &s); !st) return st;
  std::uint64_t p_bytes = 0, h_bytes = 0;
  const std::int64_t n = p.sequences();
  if (Status st = checked_product("p_t bytes N*H*K*K*4", {n, p.num_heads, p.head_dim_k, p.head_dim_k, 4},
                                  &p_bytes);
      !st) {
    return st;
  }
  if (Status st = checked_product("h_t bytes N*H*V*K*4", {n, p.num_heads, p.head_dim_v, p.head_dim_k, 4},
                                  &h_bytes);
      !st) {
    return st;
  }
  if (p.total_tokens() > 0) {
    for (const Range& r : {Range{"q", t.q, 0}, Range{"k", t.k, 0}, Range{"v", t.v, 0},
                           Range{"g", t.g, 0}, Range{"beta", t.beta, 0}}) {
      if (Status st = require(r.ptr, r.name); !st) return st;
    }
  }
  if (Status st = require(t.A_log, "A_log"); !st) return st;
  if (Status st = require(t.dt_bias, "dt_bias"); !st) return st;
  if (p.varlen()) {
    if (Status st = require(t.cu_seqlens, "cu_seqlens"); !st) return st;
  } else if (t.cu_seqlens != nullptr || t.cu_seqlens_host != nullptr) {
    return invalid("cu_seqlens is set but cu_seqlens_dtype is none");
  }
  if (p_bytes > 0) {
    if (Status st = require(p_t, "p_t"); !st) return st;
    if (Status st = require(h_t, "h_t"); !st) return st;
  }
  const Range q{"q", t.q, s.qk_bytes}, k{"k", t.k, s.qk_bytes}, v{"v", t.v, s.v_bytes},
      g{"g", t.g, s.qk_bytes}, beta{"beta", t.beta, s.beta_bytes},
      a_log{"A_log", t.A_log, s.a_log_bytes}, dt_bias{"dt_bias", t.dt_bias, s.dt_bias_bytes},
      cu{"cu_seqlens", t.cu_seqlens, s.cu_bytes},
      cu_host{"cu_seqlens_host", t.cu_seqlens_host, s.cu_bytes}, pt{"p_t", p_t, p_bytes},
      ht{"h_t", h_t, h_bytes}, status{"device_status", t.device_status, sizeof(std::uint32_t)};
  if (Status st = check_no_overlap(pt, {q, k, v, g, beta, a_log, dt_bias, cu, cu_host, ht}); !st) {
    return st;
  }
  if (Status st = check_no_overlap(ht, {q, k, v, g, beta, a_log, dt_bias, cu, cu_host}); !st) {
    return st;
  }
  return check_no_overlap(status, {q, k, v, g, beta, a_log, dt_bias, cu, cu_host, pt, ht});
}

Status transition_extents(const Problem& p, const Tensors& t, const float* p_t, const float* h_t,
                          TensorExtents* out) {
  if (Status st = prefill_extents(p, t, out); !st) return st;
  const std::uint64_t pairs =
      static_cast<std::uint64_t>(p.sequences()) * static_cast<std::uint64_t>(p.num_heads);
  out->add("p_t", p_t, pairs * static_cast<std::uint64_t>(p.head_dim_k * p.head_dim_k) * 4);
  out->add("h_t", h_t, pairs * static_cast<std::uint64_t>(p.head_dim_v * p.head_dim_k) * 4);
  return Status::Ok();
}
}  // namespace detail

Status validate_apply_transition(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                                 const float* s_in, const float* p_t, const float* h_t,
                                 const float* s_out) {
  if (pairs < 0) return invalid("pairs must be >= 0 (got " + str(pairs) + ")");
  if (Status st = check_head_dims(head_dim_k, head_dim_v); !st) return st;
  std::uint64_t s_bytes = 0, p_bytes = 0;
  if (Status st = checked_product("state bytes pairs*V*K*4", {pairs, head_dim_v, head_dim_k, 4}, &s_bytes);
      !st) {
    return st;
  }
  if (Status st = checked_product("p_t bytes pairs*K*K*4", {pairs, head_dim_k, head_dim_k, 4}, &p_bytes);
      !st) {
    return st;
  }
  if (pairs == 0) return Status::Ok();
  for (const Range& r : {Range{"s_in", s_in, 0}, Range{"p_t", p_t, 0}, Range{"h_t", h_t, 0},
                         Range{"s_out", s_out, 0}}) {
    if (Status st = require(r.ptr, r.name); !st) return st;
  }
  const Range in{"s_in", s_in, s_bytes}, pt{"p_t", p_t, p_bytes}, ht{"h_t", h_t, s_bytes},
      out{"s_out", s_out, s_bytes};
  if (s_out != s_in && overlaps(out, in)) {
    return invalid("s_out partially overlaps s_in (only an exact alias is allowed)");
  }
  return check_no_overlap(out, {pt, ht});
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

Status can_implement(const Problem& p, Backend backend) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  if (backend == Backend::kCuda) {
    std::uint64_t slots = 0;
    detail::num_chunk_slots(static_cast<std::uint64_t>(p.total_tokens()),
                            static_cast<std::uint64_t>(p.sequences()), &slots);
    if (Status st = check_cuda_grid(p.num_heads, "sequences", static_cast<std::uint64_t>(p.sequences()));
        !st) {
      return st;
    }
    if (Status st = check_cuda_grid(p.num_heads, "16-token chunk slots (tokens / 16 + sequences)", slots);
        !st) {
      return st;
    }
    return can_run_cuda(p.head_dim_k, p.head_dim_v);
  }
  return Status::Ok();
}

// CPU: one scratch slot (state + token vectors, sized for fp64) per thread, for up to
// min(N*H, kMaxThreads) threads, plus slack to align the caller's pointer.
// CUDA: the chunk records of kda/src/workspace_layout.hpp.
Status workspace_size(const Problem& p, Backend backend, std::size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes is null");
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
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
  } else if (!detail::cuda_prefill_workspace_bytes(static_cast<std::uint64_t>(p.total_tokens()),
                                                   static_cast<std::uint64_t>(p.sequences()),
                                                   static_cast<std::uint64_t>(p.num_heads),
                                                   &total) ||
             total > kMaxSize) {
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
    const std::uint64_t items = static_cast<std::uint64_t>(p.sequences()) *
                                static_cast<std::uint64_t>(p.num_heads);
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
        !detail::checked_add(total, detail::kWorkspaceAlignment, &total) || total > kMaxSize) {
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
namespace {
struct DecodeSizes {
  std::uint64_t qk_bytes = 0, v_bytes = 0, beta_bytes = 0, a_log_bytes = 0, dt_bias_bytes = 0,
                slots_bytes = 0, pool_bytes = 0;
};

Status decode_sizes(const DecodeProblem& p, DecodeSizes* s) {
  Status st;
  if (!(st = checked_product("q/k/g bytes B*tokens*H*K*2",
                             {p.batch, p.tokens, p.num_heads, p.head_dim_k, 2}, &s->qk_bytes))) {
    return st;
  }
  if (!(st = checked_product("v/out bytes B*tokens*H*V*2",
                             {p.batch, p.tokens, p.num_heads, p.head_dim_v, 2}, &s->v_bytes))) {
    return st;
  }
  if (!(st = checked_product("beta bytes B*tokens*H*2", {p.batch, p.tokens, p.num_heads, 2},
                             &s->beta_bytes))) {
    return st;
  }
  if (!(st = checked_product("A_log bytes H*4", {p.num_heads, 4}, &s->a_log_bytes))) return st;
  if (!(st = checked_product("dt_bias bytes H*K*4", {p.num_heads, p.head_dim_k, 4},
                             &s->dt_bias_bytes))) {
    return st;
  }
  if (!(st = checked_product("slots bytes B*4", {p.batch, 4}, &s->slots_bytes))) return st;
  return checked_product("state_pool bytes num_slots*H*V*K*size",
                         {p.num_slots, p.num_heads, p.head_dim_v, p.head_dim_k,
                          static_cast<std::int64_t>(dtype_size(p.state_dtype))},
                         &s->pool_bytes);
}
}  // namespace

Status validate(const DecodeProblem& p) {
  if (p.batch < 0) return invalid("batch must be >= 0 (got " + str(p.batch) + ")");
  if (p.tokens < 1 || p.tokens > kMaxDecodeTokens) {
    return invalid("tokens must be in [1, " + str(kMaxDecodeTokens) + "] (got " + str(p.tokens) +
                   ")");
  }
  if (p.num_heads < 1) return invalid("num_heads must be >= 1 (got " + str(p.num_heads) + ")");
  if (Status st = check_head_dims(p.head_dim_k, p.head_dim_v); !st) return st;
  if (p.num_slots < 0) return invalid("num_slots must be >= 0 (got " + str(p.num_slots) + ")");
  if (p.state_dtype != DType::kBF16 && p.state_dtype != DType::kF32) {
    return invalid("state_dtype must be bf16 or f32 (got " + dtype_name(p.state_dtype) + ")");
  }
  if (Status st = check_gate_and_scale(p.gate, p.lower_bound, p.scale); !st) return st;
  DecodeSizes sizes;
  return decode_sizes(p, &sizes);
}

Status validate(const DecodeProblem& p, const DecodeTensors& t) {
  if (Status st = validate(p); !st) return st;
  DecodeSizes s;
  if (Status st = decode_sizes(p, &s); !st) return st;
  if (p.batch > 0) {
    for (const Range& r :
         {Range{"q", t.q, 0}, Range{"k", t.k, 0}, Range{"v", t.v, 0}, Range{"g", t.g, 0},
          Range{"beta", t.beta, 0}, Range{"slots", t.slots, 0}, Range{"out", t.out, 0}}) {
      if (Status st = require(r.ptr, r.name); !st) return st;
    }
  }
  if (Status st = require(t.A_log, "A_log"); !st) return st;
  if (Status st = require(t.dt_bias, "dt_bias"); !st) return st;
  if (s.pool_bytes > 0) {
    if (Status st = require(t.state_pool, "state_pool"); !st) return st;
  }
  const Range q{"q", t.q, s.qk_bytes}, k{"k", t.k, s.qk_bytes}, v{"v", t.v, s.v_bytes},
      g{"g", t.g, s.qk_bytes}, beta{"beta", t.beta, s.beta_bytes},
      a_log{"A_log", t.A_log, s.a_log_bytes}, dt_bias{"dt_bias", t.dt_bias, s.dt_bias_bytes},
      slots{"slots", t.slots, s.slots_bytes}, pool{"state_pool", t.state_pool, s.pool_bytes},
      out{"out", t.out, s.v_bytes}, status{"device_status", t.device_status, sizeof(std::uint32_t)};
  if (Status st = check_no_overlap(out, {q, k, v, g, beta, a_log, dt_bias, slots, pool}); !st) {
    return st;
  }
  if (Status st = check_no_overlap(pool, {q, k, v, g, beta, a_log, dt_bias, slots}); !st) return st;
  return check_no_overlap(status, {q, k, v, g, beta, a_log, dt_bias, slots, pool, out});
}

namespace detail {
Status decode_extents(const DecodeProblem& p, const DecodeTensors& t, TensorExtents* out) {
  DecodeSizes s;
  if (Status st = decode_sizes(p, &s); !st) return st;
  out->count = 0;
  out->add("q", t.q, s.qk_bytes);
  out->add("k", t.k, s.qk_bytes);
  out->add("v", t.v, s.v_bytes);
  out->add("g", t.g, s.qk_bytes);
  out->add("beta", t.beta, s.beta_bytes);
  out->add("A_log", t.A_log, s.a_log_bytes);
  out->add("dt_bias", t.dt_bias, s.dt_bias_bytes);
  out->add("slots", t.slots, s.slots_bytes);
  out->add("state_pool", t.state_pool, s.pool_bytes);
  out->add("out", t.out, s.v_bytes);
  out->add("device_status", t.device_status, sizeof(std::uint32_t));
  return Status::Ok();
}
}  // namespace detail

Status can_implement(const DecodeProblem& p, Backend backend) {
  if (Status st = check_backend(backend); !st) return st;
  if (Status st = validate(p); !st) return st;
  if (backend == Backend::kCuda) {
    if (Status st = check_cuda_grid(p.num_heads, "decode rows", static_cast<std::uint64_t>(p.batch));
        !st) {
      return st;
    }
    return can_run_cuda(p.head_dim_k, p.head_dim_v);
  }
  return Status::Ok();
}

}  // namespace kda
