// CPU commit of a record-and-commit verify step (kda.hpp, "Commit"): each row's accepted records
// folded into its state, for every head of every layer given. The element operations are the CPU
// verify step's state update (cpu_recurrence.hpp, commit_channels), so an fp32 commit reproduces
// the state a per-token-states verify step keeps, bit for bit.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cpu_recurrence.hpp"
#include "kda/kda.hpp"

namespace kda {
namespace {

Status invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

// Every row that is not padding: its slot inside the pool and named once, its num_accepted in
// [1, tokens]. The duplicate check compares pairs (no scratch, so nothing is allocated): B^2 / 2
// comparisons, far below the commit's own B * H * V * K element updates for any real head size.
Status check_rows(const CommitProblem& p, const std::int32_t* slots,
                  const std::int32_t* num_accepted) {
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int32_t s = slots[b];
    if (s < 0 || s == p.padding_slot) continue;  // padding: its num_accepted is not read
    const std::string row = std::to_string(b);
    if (s >= p.num_slots) {
      return invalid("slots[" + row + "] = " + std::to_string(s) + " is out of range (num_slots " +
                     std::to_string(p.num_slots) + ")");
    }
    if (num_accepted[b] < 1 || num_accepted[b] > p.tokens) {
      return invalid("num_accepted[" + row + "] = " + std::to_string(num_accepted[b]) +
                     " is outside [1, " + std::to_string(p.tokens) +
                     "] (the verify step's tokens)");
    }
    for (std::int64_t c = 0; c < b; ++c) {
      if (slots[c] == s) {
        return invalid("slots[" + std::to_string(c) + "] and slots[" + row + "] both name slot " +
                       std::to_string(s));
      }
    }
  }
  return Status::Ok();
}

// Channels of a state row worked on at a time, in a buffer on the stack (bf16 pools, fp64).
constexpr std::int64_t kChunk = 256;

template <typename Real>
void run_commit(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                const std::int32_t* slots, const std::int32_t* num_accepted, std::int64_t workers) {
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  const std::int64_t record_floats = 2 * K + V;
  const std::int64_t items = static_cast<std::int64_t>(num_layers) * p.batch * H;
  const bool f32 = p.state_dtype == DType::kF32;
  constexpr bool kIsFloat = std::is_same<Real, float>::value;
  detail::cpu::parallel_for(items, workers, [&](std::int64_t item, std::int64_t) {
    const std::int64_t head = item % H, b = (item / H) % p.batch, layer = item / H / p.batch;
    const std::int32_t slot = slots[b];
    if (slot < 0 || slot == p.padding_slot) return;  // padding
    const std::int64_t n = num_accepted[b];
    const std::int64_t state_off = (static_cast<std::int64_t>(slot) * H + head) * V * K;
    const float* rec = layers[layer].records + (b * p.tokens * H + head) * record_floats;
    const std::int64_t token_stride = H * record_floats;  // from token t to t + 1 of the row
    float* pool_f32 = static_cast<float*>(layers[layer].state_pool) + state_off;
    bf16_bits* pool_bf16 = static_cast<bf16_bits*>(layers[layer].state_pool) + state_off;
    Real buf[kChunk];
    for (std::int64_t v = 0; v < V; ++v) {
      for (std::int64_t j0 = 0; j0 < K; j0 += kChunk) {
        const std::int64_t count = std::min(kChunk, K - j0);
        const std::int64_t at = v * K + j0;
        // An f32 pool with fp32 accumulation is updated where it lies.
        Real* row = buf;
        if constexpr (kIsFloat) {
          if (f32) row = pool_f32 + at;
        }
        if (row == buf) {
          for (std::int64_t j = 0; j < count; ++j) {
            buf[j] = static_cast<Real>(f32 ? pool_f32[at + j] : bf16_to_float(pool_bf16[at + j]));
          }
        }
        for (std::int64_t t = 0; t < n; ++t) {
          const float* r = rec + t * token_stride;
          detail::cpu::commit_channels<Real>(row, j0, count, K, r, r + K, r[2 * K + v]);
        }
        if (row == buf) {
          for (std::int64_t j = 0; j < count; ++j) {
            if (f32) {
              pool_f32[at + j] = static_cast<float>(buf[j]);
            } else {
              pool_bf16[at + j] = float_to_bf16(static_cast<float>(buf[j]));
            }
          }
        }
      }
    }
  });
}

}  // namespace

Status commit_cpu(const CommitProblem& p, const CommitLayer* layers, int num_layers,
                  const std::int32_t* slots, const std::int32_t* num_accepted,
                  const CpuOptions& opt) {
  if (Status st = validate(p, layers, num_layers, slots, num_accepted); !st) return st;
  if (p.batch == 0 || num_layers == 0) return Status::Ok();
  if (Status st = check_rows(p, slots, num_accepted); !st) return st;
  const std::int64_t items = static_cast<std::int64_t>(num_layers) * p.batch * p.num_heads;
  const double updates = static_cast<double>(items) * static_cast<double>(p.tokens) *
                         static_cast<double>(p.head_dim_v * p.head_dim_k);
  const std::int64_t workers = detail::cpu::resolve_threads(
      opt.num_threads, items,
      updates > 1e18 ? std::int64_t{1} << 60 : static_cast<std::int64_t>(updates));
  if (opt.fp64) {
    run_commit<double>(p, layers, num_layers, slots, num_accepted, workers);
  } else {
    run_commit<float>(p, layers, num_layers, slots, num_accepted, workers);
  }
  return Status::Ok();
}

}  // namespace kda
