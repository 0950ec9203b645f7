// CPU forward: the token-by-token KDA recurrence (cpu_recurrence.hpp), threaded over
// (sequence, head) pairs. Everything is validated before the first byte of output is written.
#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <thread>

#include "argument_table.hpp"
#include "cpu_recurrence.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/kda.hpp"
#include "state_slots.hpp"
#include "transition.hpp"

namespace kda {

Status validate_gate_parameters(const float* A_log, const float* dt_bias, std::int64_t num_heads,
                                std::int64_t head_dim_k) {
  std::uint64_t dt_bias_count = 0;
  if (num_heads < 0 || head_dim_k < 0 ||
      !detail::checked_mul(static_cast<std::uint64_t>(num_heads),
                           static_cast<std::uint64_t>(head_dim_k), &dt_bias_count) ||
      dt_bias_count > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
    return Status(StatusCode::kInvalidArgument, "gate parameters of " + std::to_string(num_heads) +
                                                    " heads of " + std::to_string(head_dim_k) +
                                                    ": sizes must be >= 0 and their product fit");
  }
  if (num_heads > 0 && (A_log == nullptr || (dt_bias_count > 0 && dt_bias == nullptr))) {
    return Status(StatusCode::kInvalidArgument,
                  A_log == nullptr ? "A_log is null" : "dt_bias is null");
  }
  for (std::int64_t h = 0; h < num_heads; ++h) {
    if (!std::isfinite(A_log[h])) {
      return Status(StatusCode::kInvalidArgument, "A_log[" + std::to_string(h) + "] is not finite");
    }
    if (std::fabs(A_log[h]) > kMaxAbsALog) {
      char text[96];
      std::snprintf(text, sizeof text, "A_log[%lld] = %g is outside [-%g, %g]",
                    static_cast<long long>(h), static_cast<double>(A_log[h]),
                    static_cast<double>(kMaxAbsALog), static_cast<double>(kMaxAbsALog));
      return Status(StatusCode::kInvalidArgument, text);
    }
  }
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(dt_bias_count); ++i) {
    if (!std::isfinite(dt_bias[i])) {
      return Status(StatusCode::kInvalidArgument, "dt_bias[" + std::to_string(i / head_dim_k) +
                                                      ", " + std::to_string(i % head_dim_k) +
                                                      "] is not finite");
    }
  }
  return Status::Ok();
}

namespace detail::cpu {

std::int64_t resolve_threads(int requested, std::int64_t items, std::int64_t state_updates) {
  constexpr std::int64_t kMinUpdatesPerThread = std::int64_t{1} << 20;
  std::int64_t threads = requested;
  if (threads <= 0) {
    threads = static_cast<std::int64_t>(std::thread::hardware_concurrency());
    threads = std::min(threads, state_updates / kMinUpdatesPerThread);
  }
  threads = std::min({std::max<std::int64_t>(threads, 1), kMaxThreads, items});
  return std::max<std::int64_t>(threads, 1);
}

}  // namespace detail::cpu

namespace {

using detail::cpu::Scratch;

template <typename Real>
void run_prefill(const Problem& p, const Tensors& t, unsigned char* slots, std::int64_t workers) {
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  const std::int64_t state_elems = V * K;
  const std::uint64_t slot_stride = detail::cpu::slot_bytes(K, V);
  const float scale = p.effective_scale();
  const detail::cpu::TokenInputs in(t);
  auto* out = static_cast<bf16_bits*>(t.out);
  // Where sequence seq's state lives: index seq, or its pool entry (-1: padding, no state).
  auto state_index = [&](std::int64_t seq) -> std::int64_t {
    if (p.num_state_slots == 0) return seq;
    const std::int32_t slot = t.state_slots[seq];
    return slot < 0 || slot == p.padding_slot ? -1 : std::int64_t{slot};
  };
  const std::size_t in_size = dtype_size(p.initial_state_dtype);
  const std::size_t fin_size = dtype_size(p.final_state_dtype);
  // Checkpoint request k of sequence seq: its offset (-1: none) and pool entry.
  auto checkpoint_offset = [&](std::int64_t seq, std::int64_t k) -> std::int64_t {
    const std::int64_t i = seq * p.checkpoints + k;
    return p.checkpoint_offsets_dtype == DType::kI64
               ? static_cast<const std::int64_t*>(t.checkpoint_offsets)[i]
               : static_cast<const std::int32_t*>(t.checkpoint_offsets)[i];
  };
  // Writes the state of (seq, head) into every checkpoint slot asked for after `done` tokens.
  auto store_checkpoints = [&](std::int64_t seq, std::int64_t head, std::int64_t done,
                               const Real* state) {
    for (std::int64_t k = 0; k < p.checkpoints; ++k) {
      const std::int32_t slot = t.checkpoint_slots[seq * p.checkpoints + k];
      if (slot < 0 || slot == p.padding_slot || checkpoint_offset(seq, k) != done) continue;
      detail::cpu::store_state(state, state_elems, p.final_state_dtype,
                               static_cast<unsigned char*>(t.final_state) +
                                   (std::int64_t{slot} * H + head) * state_elems * fin_size);
    }
  };

  detail::cpu::parallel_for(
      p.sequences() * H, workers, [&](std::int64_t item, std::int64_t worker) {
        const std::int64_t seq = item / H, head = item % H;  // item == seq * H + head
        std::int64_t begin = 0, end = 0;
        detail::cpu::sequence_bounds(p, t.cu_seqlens, seq, &begin, &end);
        Scratch<Real> sc(reinterpret_cast<Real*>(slots + worker * slot_stride), K, V);
        const auto hp = detail::cpu::make_head_params<Real>(K, V, p.gate, p.lower_bound, scale,
                                                            t.A_log, t.dt_bias, head);
        // The whole state is read before anything is written: final_state may alias initial_state.
        const std::int64_t state_item = state_index(seq) * H + head;  // negative: padding
        const bool reads = state_item >= 0 && t.initial_state != nullptr;
        detail::cpu::load_state(reads ? p.initial_state_dtype : DType::kNone,
                                reads ? static_cast<const unsigned char*>(t.initial_state) +
                                            state_item * state_elems * in_size
                                      : nullptr,
                                state_elems, sc.state);
        const bool checkpoints = p.checkpoints > 0 && state_item >= 0;
        if (checkpoints) store_checkpoints(seq, head, 0, sc.state);
        for (std::int64_t i = begin; i < end; ++i) {
          const std::int64_t row = i * H + head;
          detail::cpu::prepare_token(hp, in.q + row * K, in.k + row * K, in.g + row * K,
                                     in.beta[row], &sc.tok);
          detail::cpu::apply_token(sc.state, V, K, sc.tok, in.v + row * V, sc.o);
          detail::cpu::store_out(sc.o, V, out + row * V);
          const std::int64_t done = i + 1 - begin;
          if (checkpoints && (done % kCheckpointAlignment == 0 || i + 1 == end)) {
            store_checkpoints(seq, head, done, sc.state);
          }
        }
        if (state_item >= 0 && t.final_state != nullptr) {
          detail::cpu::store_state(
              sc.state, state_elems, p.final_state_dtype,
              static_cast<unsigned char*>(t.final_state) + state_item * state_elems * fin_size);
        }
      });
}

template <typename Real>
void run_transition(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                    unsigned char* slots, std::int64_t workers) {
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  const std::int64_t Vx = V + K;
  const std::uint64_t stride = detail::cpu::transition_stride(K, V);
  const std::uint64_t slot =
      detail::cpu::slot_bytes(static_cast<std::uint64_t>(K), static_cast<std::uint64_t>(Vx));
  const float scale = p.effective_scale();
  const detail::cpu::TokenInputs in(t);
  detail::cpu::parallel_for(
      p.sequences() * H, workers, [&](std::int64_t item, std::int64_t worker) {
        const std::int64_t seq = item / H, head = item % H;
        std::int64_t begin = 0, end = 0;
        detail::cpu::sequence_bounds(p, t.cu_seqlens, seq, &begin, &end);
        unsigned char* base = slots + static_cast<std::uint64_t>(worker) * stride;
        Scratch<Real> sc(reinterpret_cast<Real*>(base), K, Vx);
        auto* vrow = reinterpret_cast<bf16_bits*>(base + slot);
        std::fill(vrow + V, vrow + Vx, bf16_bits{0});
        std::fill(sc.state, sc.state + Vx * K, Real(0));
        for (std::int64_t i = 0; i < K; ++i) sc.state[(V + i) * K + i] = Real(1);
        const auto hp = detail::cpu::make_head_params<Real>(K, Vx, p.gate, p.lower_bound, scale,
                                                            t.A_log, t.dt_bias, head);
        for (std::int64_t i = begin; i < end; ++i) {
          const std::int64_t row = i * H + head;
          detail::cpu::prepare_token(hp, in.q + row * K, in.k + row * K, in.g + row * K,
                                     in.beta[row], &sc.tok);
          std::copy(in.v + row * V, in.v + row * V + V, vrow);
          detail::cpu::apply_token(sc.state, Vx, K, sc.tok, vrow, sc.o);
        }
        for (std::int64_t i = 0; i < V * K; ++i)
          h_t[item * V * K + i] = static_cast<float>(sc.state[i]);
        for (std::int64_t i = 0; i < K * K; ++i)
          p_t[item * K * K + i] = static_cast<float>(sc.state[V * K + i]);
      });
}

// What the CPU reads from host memory that validate() cannot see: cu_seqlens contents and the gate
// parameters' values.
Status check_host_inputs(const Problem& p, const Tensors& t) {
  if (p.varlen()) {
    if (Status st = validate_cu_seqlens(p, t.cu_seqlens); !st) return st;
  }
  return validate_gate_parameters(t.A_log, t.dt_bias, p.num_heads, p.head_dim_k);
}

// The workspace holds `needed` bytes; *slots is its first slot-aligned address (the size functions
// added the slack for it).
Status workspace_slots(Workspace ws, std::size_t needed, const char* what, unsigned char** slots) {
  if (ws.bytes < needed) {
    return Status(StatusCode::kWorkspaceTooSmall, "workspace has " + std::to_string(ws.bytes) +
                                                      " bytes, " + what + " needs " +
                                                      std::to_string(needed));
  }
  if (needed > 0 && ws.ptr == nullptr) {
    return Status(StatusCode::kInvalidArgument, "workspace.ptr is null");
  }
  *slots = reinterpret_cast<unsigned char*>(detail::align_up(
      reinterpret_cast<std::uintptr_t>(ws.ptr), std::uintptr_t{detail::cpu::kSlotAlignment}));
  return Status::Ok();
}

}  // namespace

Status forward_cpu(const Problem& p, const Tensors& t, Workspace ws, const CpuOptions& opt) {
  detail::ArgumentTable table;  // validate(p, t), as the CUDA backend checks its calls
  if (Status st = detail::implement_and_validate(p, t, Backend::kCpu, &table); !st) return st;
  if (Status st = check_host_inputs(p, t); !st) return st;
  std::size_t needed = 0;
  if (Status st = detail::checked_workspace_size(p, Backend::kCpu, &needed); !st) return st;
  unsigned char* slots = nullptr;
  if (Status st = workspace_slots(ws, needed, "the CPU backend", &slots); !st) return st;
  if (Status st = detail::check_workspace_apart(table, ws.ptr, needed); !st) return st;
  const std::int64_t items = p.sequences() * p.num_heads;
  if (items == 0) return Status::Ok();

  if (p.num_state_slots > 0) {
    // The duplicate bitmap follows the thread slots (workspace_size() counted both).
    const std::uint64_t thread_slots =
        static_cast<std::uint64_t>(std::min<std::int64_t>(items, detail::cpu::kMaxThreads));
    auto* seen = reinterpret_cast<std::uint64_t*>(
        slots + thread_slots * detail::cpu::slot_bytes(static_cast<std::uint64_t>(p.head_dim_k),
                                                       static_cast<std::uint64_t>(p.head_dim_v)));
    if (Status st = detail::check_state_slots(p, t.state_slots, seen); !st) return st;
    if (Status st = detail::check_checkpoints(p, t, seen); !st) return st;
  }
  // No token and no state to write (checkpoints go into final_state's pool): nothing to do, however
  // many sequences (a fixed-length batch of 2^40 empty ones would otherwise be walked one by one).
  if (p.total_tokens() == 0 && t.final_state == nullptr) return Status::Ok();
  // Tokens x V x K, saturated: only a heuristic for the automatic thread count.
  const double updates = static_cast<double>(p.total_tokens()) * static_cast<double>(p.num_heads) *
                         static_cast<double>(p.head_dim_v * p.head_dim_k);
  const std::int64_t workers = detail::cpu::resolve_threads(
      opt.num_threads, items,
      updates > 1e18 ? std::int64_t{1} << 60 : static_cast<std::int64_t>(updates));
  if (opt.fp64) {
    run_prefill<double>(p, t, slots, workers);
  } else {
    run_prefill<float>(p, t, slots, workers);
  }
  return Status::Ok();
}

Status segment_transition_cpu(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                              Workspace ws, const CpuOptions& opt) {
  if (Status st = detail::validate_transition(p, t, p_t, h_t); !st) return st;
  if (Status st = check_host_inputs(p, t); !st) return st;
  std::size_t needed = 0;
  if (Status st = transition_workspace_size(p, Backend::kCpu, &needed); !st) return st;
  unsigned char* slots = nullptr;
  if (Status st = workspace_slots(ws, needed, "the CPU transition", &slots); !st) return st;
  const std::int64_t items = p.sequences() * p.num_heads;
  if (items == 0) return Status::Ok();
  // transition_workspace_size() counted min(items, kMaxThreads) slots; resolve_threads never
  // exceeds that.
  const std::int64_t workers =
      detail::cpu::resolve_threads(opt.num_threads, items, std::int64_t{1} << 40);
  if (opt.fp64) {
    run_transition<double>(p, t, p_t, h_t, slots, workers);
  } else {
    run_transition<float>(p, t, p_t, h_t, slots, workers);
  }
  return Status::Ok();
}

Status apply_transition_cpu(std::int64_t pairs, std::int64_t head_dim_k, std::int64_t head_dim_v,
                            const float* s_in, const float* p_t, const float* h_t, float* s_out) {
  if (Status st = validate_apply_transition(pairs, head_dim_k, head_dim_v, s_in, p_t, h_t, s_out);
      !st) {
    return st;
  }
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::int64_t K = head_dim_k, V = head_dim_v;
  alignas(64) float row_buffer[4096];  // K <= 4096 (validated): no allocation
  for (std::int64_t pair = 0; pair < pairs; ++pair) {
    const Eigen::Map<const RowMajor> pt(p_t + pair * K * K, K, K);
    for (std::int64_t row = 0; row < V; ++row) {
      const std::int64_t off = (pair * V + row) * K;
      // The row is computed into a stack buffer before it is written: s_out may be s_in.
      Eigen::Map<Eigen::RowVectorXf> next(row_buffer, K);
      next.noalias() = Eigen::Map<const Eigen::RowVectorXf>(s_in + off, K) * pt;
      next += Eigen::Map<const Eigen::RowVectorXf>(h_t + off, K);
      Eigen::Map<Eigen::RowVectorXf>(s_out + off, K) = next;
    }
  }
  return Status::Ok();
}

}  // namespace kda
