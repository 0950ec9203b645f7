// CPU decode: a few new tokens per sequence against a pool of state slots, updated in place.
// Same per-token step as the CPU prefill (cpu_recurrence.hpp), so a prefill of n tokens followed by
// decode steps computes what one longer prefill computes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "argument_table.hpp"
#include "cpu_recurrence.hpp"
#include "kda/kda.hpp"

namespace kda {
namespace {

// Slot indices: below num_slots, and no slot named twice (two rows would race on one state).
// `seen`: num_slots bits of caller scratch (the workspace), so that nothing is allocated; the first
// row naming a slot is found again by a scan, only when there is a duplicate.
// A verify step's [B, tokens] entries are checked the same way, and each row's num_accepted. The
// records form only reads the pool: its rows may share a slot, unless it folds (it then writes
// each row's folded state). A fold's rows and counts are checked where a row is no padding.
Status check_slots(const DecodeProblem& p, const std::int32_t* slots,
                   const std::int32_t* num_accepted, const std::int32_t* fold_rows,
                   const std::int32_t* fold_counts, unsigned char* seen) {
  const bool per_token = p.verify && !p.records;
  if (per_token) {
    for (std::int64_t b = 0; b < p.batch; ++b) {
      if (num_accepted[b] < 1 || num_accepted[b] > p.tokens) {
        return Status(StatusCode::kInvalidArgument,
                      "num_accepted[" + std::to_string(b) +
                          "] = " + std::to_string(num_accepted[b]) + " is outside [1, " +
                          std::to_string(p.tokens) + "] (the step's tokens)");
      }
    }
  }
  auto entry = [&](std::int64_t i) {
    return per_token
               ? "slots[" + std::to_string(i / p.tokens) + "][" + std::to_string(i % p.tokens) + "]"
               : "slots[" + std::to_string(i) + "]";
  };
  if (p.folds()) {  // a fold's row of the records step and its count, where the row is no padding
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int32_t s = per_token ? -1 : slots[b];
      if (s < 0 || s == p.padding_slot || fold_rows[b] < 0) continue;
      const std::string row = std::to_string(b);
      if (fold_rows[b] >= p.fold_batch) {
        return Status(StatusCode::kInvalidArgument,
                      "fold_rows[" + row + "] = " + std::to_string(fold_rows[b]) +
                          " is outside [0, " + std::to_string(p.fold_batch) +
                          ") (the records step's rows, fold_batch)");
      }
      if (fold_counts[b] < 1 || fold_counts[b] > p.fold_tokens) {
        return Status(StatusCode::kInvalidArgument,
                      "fold_counts[" + row + "] = " + std::to_string(fold_counts[b]) +
                          " is outside [1, " + std::to_string(p.fold_tokens) +
                          "] (the records step's tokens, fold_tokens)");
      }
    }
  }
  std::memset(seen, 0, static_cast<std::size_t>((p.num_slots + 7) / 8));
  const std::int64_t entries = per_token ? p.batch * p.tokens : p.batch;
  for (std::int64_t b = 0; b < entries; ++b) {
    const std::int32_t s = slots[b];
    if (s < 0 || s == p.padding_slot) continue;  // padding (any number of rows may name it)
    if (s >= p.num_slots) {
      return Status(StatusCode::kInvalidArgument, entry(b) + " = " + std::to_string(s) +
                                                      " is out of range (num_slots " +
                                                      std::to_string(p.num_slots) + ")");
    }
    if (p.records && !p.folds()) continue;  // read only: a shared slot is fine
    const unsigned char bit = static_cast<unsigned char>(1u << (s % 8));
    if (seen[s / 8] & bit) {
      std::int64_t first = 0;
      while (slots[first] != s) ++first;
      return Status(StatusCode::kInvalidArgument,
                    entry(first) + " and " + entry(b) + " both name slot " + std::to_string(s));
    }
    seen[s / 8] |= bit;
  }
  return Status::Ok();
}

template <typename Real>
void run_decode(const DecodeProblem& p, const DecodeTensors& t, Real* scratch, std::int64_t workers,
                std::uint64_t slot_stride_reals) {
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v, n_tok = p.tokens;
  const std::int64_t state_elems = V * K;
  const auto slot_reals = static_cast<std::int64_t>(slot_stride_reals);
  const std::size_t state_size = dtype_size(p.state_dtype);
  const float scale = p.effective_scale();
  const detail::cpu::TokenInputs in(t);
  auto* out = static_cast<bf16_bits*>(t.out);
  // fp32 accumulation on an f32 pool works on the pool itself; otherwise on a scratch copy.
  // A verify step keeps the state after every token in slots of its own, or (records) never writes
  // the pool: never in place.
  constexpr bool kIsFloat = std::is_same<Real, float>::value;
  const bool in_place = kIsFloat && p.state_dtype == DType::kF32 && !p.verify;
  const bool per_token = p.verify && !p.records;
  const std::int64_t record_floats = 2 * K + V;  // one (token, head) record: alpha, k^, u
  auto state_at = [&](std::int32_t slot, std::int64_t head) {
    return static_cast<unsigned char*>(t.state_pool) +
           (static_cast<std::int64_t>(slot) * H + head) * state_elems *
               static_cast<std::int64_t>(state_size);
  };

  detail::cpu::parallel_for(p.batch * H, workers, [&](std::int64_t item, std::int64_t worker) {
    const std::int64_t b = item / H, head = item % H;
    const std::int32_t slot = per_token ? t.slots[b * n_tok + t.num_accepted[b] - 1] : t.slots[b];
    if (slot < 0 || slot == p.padding_slot)
      return;  // padding: its out rows (and records) stay untouched
    detail::cpu::Scratch<Real> sc(scratch + worker * slot_reals, K, V);
    unsigned char* state_mem = state_at(slot, head);
    if (in_place) {
      sc.state = reinterpret_cast<Real*>(state_mem);
    } else {
      detail::cpu::load_state(p.state_dtype, state_mem, state_elems, sc.state);
    }
    if (p.folds() && t.fold_rows[b] >= 0) {
      // The commit's operations on the commit's values: each accepted record of the row named,
      // in token order, then (not in place) the state rounded as the commit's store rounds it.
      const float* rec =
          t.fold_records + (t.fold_rows[b] * p.fold_tokens * H + head) * record_floats;
      for (std::int64_t j = 0; j < t.fold_counts[b]; ++j) {
        const float* r = rec + j * H * record_floats;
        for (std::int64_t v = 0; v < V; ++v) {
          detail::cpu::commit_channels<Real>(sc.state + v * K, 0, K, K, r, r + K, r[2 * K + v]);
        }
      }
      if (!in_place) {
        detail::cpu::store_state(sc.state, state_elems, p.state_dtype, state_mem);
        if (p.state_dtype == DType::kBF16 || !kIsFloat) {
          detail::cpu::load_state(p.state_dtype, state_mem, state_elems, sc.state);
        }
      }
    }
    const auto hp = detail::cpu::make_head_params<Real>(K, V, p.gate, p.lower_bound, scale, t.A_log,
                                                        t.dt_bias, head);
    for (std::int64_t j = 0; j < n_tok; ++j) {
      const std::int64_t row = (b * n_tok + j) * H + head;
      detail::cpu::prepare_token(hp, in.q + row * K, in.k + row * K, in.g + row * K, in.beta[row],
                                 &sc.tok);
      float* record = p.records ? t.records + row * record_floats : nullptr;
      if (record != nullptr) {
        for (std::int64_t d = 0; d < K; ++d) {
          record[d] = static_cast<float>(sc.tok.a[d]);
          record[K + d] = static_cast<float>(sc.tok.kh[d]);
        }
      }
      detail::cpu::apply_token(sc.state, V, K, sc.tok, in.v + row * V, sc.o,
                               record != nullptr ? record + 2 * K : nullptr);
      detail::cpu::store_out(sc.o, V, out + row * V);
      if (per_token && t.slots[b * n_tok + j] >= 0 && t.slots[b * n_tok + j] != p.padding_slot) {
        detail::cpu::store_state(sc.state, state_elems, p.state_dtype,
                                 state_at(t.slots[b * n_tok + j], head));
      }
    }
    if (!in_place && !p.verify) {
      detail::cpu::store_state(sc.state, state_elems, p.state_dtype, state_mem);
    }
  });
}

}  // namespace

namespace {

// Worker count and scratch bytes of a decode, from the problem alone (decode_workspace_size and
// both decode_cpu overloads agree on them).
std::int64_t decode_workers(const DecodeProblem& p, int requested_threads) {
  const std::int64_t items = p.batch * p.num_heads;
  const double updates = static_cast<double>(items) * static_cast<double>(p.tokens) *
                         static_cast<double>(p.head_dim_v * p.head_dim_k);
  return detail::cpu::resolve_threads(
      requested_threads, items,
      updates > 1e18 ? std::int64_t{1} << 60 : static_cast<std::int64_t>(updates));
}

// Runs on `slots` (64-byte aligned, room for `workers` slots sized for double); checked before.
Status decode_on(const DecodeProblem& p, const DecodeTensors& t, unsigned char* slots,
                 std::int64_t workers, const CpuOptions& opt) {
  if (opt.fp64) {
    run_decode<double>(p, t, reinterpret_cast<double*>(slots), workers,
                       detail::cpu::slot_bytes(p.head_dim_k, p.head_dim_v) / sizeof(double));
  } else {
    run_decode<float>(p, t, reinterpret_cast<float*>(slots), workers,
                      detail::cpu::slot_bytes(p.head_dim_k, p.head_dim_v) / sizeof(float));
  }
  return Status::Ok();
}

// validate(p, t), as the CUDA backend checks its calls, into `table` (the workspace's check walks
// it), and the gate parameters.
Status decode_checks(const DecodeProblem& p, const DecodeTensors& t, detail::ArgumentTable* table) {
  if (Status st = detail::implement_and_validate(p, t, Backend::kCpu, table); !st) return st;
  if (Status st = validate_gate_parameters(t.A_log, t.dt_bias, p.num_heads, p.head_dim_k); !st) {
    return st;
  }
  return Status::Ok();
}

}  // namespace

Status decode_workspace_size(const DecodeProblem& p, Backend backend, std::size_t* bytes) {
  if (bytes == nullptr) return Status(StatusCode::kInvalidArgument, "bytes is null");
  if (Status st = can_implement(p, Backend::kCpu); !st) return st;  // shapes and sizes only
  if (backend != Backend::kCpu && backend != Backend::kCuda) {
    return Status(
        StatusCode::kInvalidArgument,
        "backend must be cpu or cuda (got " + std::to_string(static_cast<int>(backend)) + ")");
  }
  return detail::checked_workspace_size(p, backend, bytes);
}

Status detail::checked_workspace_size(const DecodeProblem& p, Backend backend, std::size_t* bytes) {
  *bytes = 0;
  if (backend == Backend::kCuda) return Status::Ok();
  // Scratch for the most threads a call could use, min(batch * H, kMaxThreads), then the slot
  // bitmap (num_slots bits). validate() bounded every factor, so this cannot overflow.
  const std::uint64_t items =
      static_cast<std::uint64_t>(p.batch) * static_cast<std::uint64_t>(p.num_heads);
  const std::uint64_t slots = std::min<std::uint64_t>(items, detail::cpu::kMaxThreads);
  if (slots > 0) {
    const std::uint64_t total =
        slots * detail::cpu::slot_bytes(static_cast<std::uint64_t>(p.head_dim_k),
                                        static_cast<std::uint64_t>(p.head_dim_v)) +
        detail::cpu::kSlotAlignment + (static_cast<std::uint64_t>(p.num_slots) + 7) / 8;
    if (total > std::numeric_limits<std::size_t>::max()) {
      return Status(StatusCode::kOverflow, "decode workspace bytes do not fit size_t");
    }
    *bytes = static_cast<std::size_t>(total);
  }
  return Status::Ok();
}

Status decode_cpu(const DecodeProblem& p, const DecodeTensors& t, Workspace ws,
                  const CpuOptions& opt) {
  detail::ArgumentTable table;
  if (Status st = decode_checks(p, t, &table); !st) return st;
  if (p.batch == 0) return Status::Ok();
  std::size_t need = 0;
  if (Status st = detail::checked_workspace_size(p, Backend::kCpu, &need); !st) return st;
  if (ws.bytes < need) {
    return Status(StatusCode::kWorkspaceTooSmall, "workspace has " + std::to_string(ws.bytes) +
                                                      " bytes, the CPU decode needs " +
                                                      std::to_string(need));
  }
  if (need > 0 && ws.ptr == nullptr)
    return Status(StatusCode::kInvalidArgument, "workspace.ptr is null");
  if (Status st = detail::check_workspace_apart(table, ws.ptr, need); !st) return st;
  const std::uintptr_t align = detail::cpu::kSlotAlignment;
  const std::uintptr_t base = detail::align_up(reinterpret_cast<std::uintptr_t>(ws.ptr), align);
  auto* slots = reinterpret_cast<unsigned char*>(base);
  const std::uint64_t items =
      static_cast<std::uint64_t>(p.batch) * static_cast<std::uint64_t>(p.num_heads);
  const std::uint64_t scratch_bytes =
      std::min<std::uint64_t>(items, detail::cpu::kMaxThreads) *
      detail::cpu::slot_bytes(static_cast<std::uint64_t>(p.head_dim_k),
                              static_cast<std::uint64_t>(p.head_dim_v));
  if (Status st = check_slots(p, t.slots, t.num_accepted, t.fold_rows, t.fold_counts,
                              slots + scratch_bytes);
      !st) {
    return st;
  }
  return decode_on(p, t, slots, decode_workers(p, opt.num_threads), opt);
}

Status decode_cpu(const DecodeProblem& p, const DecodeTensors& t, const CpuOptions& opt) {
  detail::ArgumentTable table;
  if (Status st = decode_checks(p, t, &table); !st) return st;
  if (p.batch == 0) return Status::Ok();
  std::size_t need = 0;
  if (Status st = detail::checked_workspace_size(p, Backend::kCpu, &need); !st) return st;
  try {
    std::vector<unsigned char> scratch(need);
    return decode_cpu(p, t, Workspace{scratch.data(), scratch.size()}, opt);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, "decode_cpu could not allocate its per-thread scratch");
  }
}

}  // namespace kda
