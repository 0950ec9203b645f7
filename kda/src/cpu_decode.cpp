// CPU decode: a few new tokens per sequence against a pool of state slots, updated in place.
// Same per-token step as the CPU prefill (cpu_recurrence.hpp), so a prefill of n tokens followed by
// decode steps computes what one longer prefill computes.
#include <algorithm>
#include <cstdint>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_recurrence.hpp"
#include "kda/kda.hpp"

namespace kda {
namespace {

// Slot indices: below num_slots, and no slot named twice (two rows would race on one state).
Status check_slots(const DecodeProblem& p, const std::int32_t* slots) {
  std::vector<std::pair<std::int32_t, std::int64_t>> named;  // (slot, row)
  named.reserve(static_cast<std::size_t>(p.batch));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    if (slots[b] < 0) continue;  // padding row
    if (slots[b] >= p.num_slots) {
      return Status(StatusCode::kInvalidArgument,
                    "slots[" + std::to_string(b) + "] = " + std::to_string(slots[b]) +
                        " is out of range (num_slots " + std::to_string(p.num_slots) + ")");
    }
    named.emplace_back(slots[b], b);
  }
  std::sort(named.begin(), named.end());
  for (std::size_t i = 1; i < named.size(); ++i) {
    if (named[i].first == named[i - 1].first) {
      return Status(StatusCode::kInvalidArgument,
                    "slots[" + std::to_string(named[i - 1].second) + "] and slots[" +
                        std::to_string(named[i].second) + "] both name slot " +
                        std::to_string(named[i].first));
    }
  }
  return Status::Ok();
}

template <typename Real>
void run_decode(const DecodeProblem& p, const DecodeTensors& t, Real* scratch, std::int64_t workers) {
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v, n_tok = p.tokens;
  const std::int64_t state_elems = V * K;
  const std::int64_t slot_reals = static_cast<std::int64_t>(
      detail::cpu::slot_reals(static_cast<std::uint64_t>(K), static_cast<std::uint64_t>(V)));
  const std::size_t state_size = dtype_size(p.state_dtype);
  const float scale = p.effective_scale();
  const auto* q = static_cast<const bf16_bits*>(t.q);
  const auto* k = static_cast<const bf16_bits*>(t.k);
  const auto* v = static_cast<const bf16_bits*>(t.v);
  const auto* g = static_cast<const bf16_bits*>(t.g);
  const auto* beta = static_cast<const bf16_bits*>(t.beta);
  auto* out = static_cast<bf16_bits*>(t.out);
  // fp32 accumulation on an f32 pool works on the pool itself; otherwise on a scratch copy.
  constexpr bool kIsFloat = std::is_same<Real, float>::value;
  const bool in_place = kIsFloat && p.state_dtype == DType::kF32;

  detail::cpu::parallel_for(p.batch * H, workers, [&](std::int64_t item, std::int64_t worker) {
    const std::int64_t b = item / H, head = item % H;
    const std::int32_t slot = t.slots[b];
    if (slot < 0) return;  // padding: its out rows stay untouched
    detail::cpu::Scratch<Real> sc(scratch + worker * slot_reals, K, V);
    const std::int64_t state_index = (static_cast<std::int64_t>(slot) * H + head) * state_elems;
    unsigned char* state_mem = static_cast<unsigned char*>(t.state_pool) +
                               state_index * static_cast<std::int64_t>(state_size);
    if (in_place) {
      sc.state = reinterpret_cast<Real*>(state_mem);
    } else {
      detail::cpu::load_state(p.state_dtype, state_mem, state_elems, sc.state);
    }
    const auto hp = detail::cpu::make_head_params<Real>(K, V, p.gate, p.lower_bound, scale, t.A_log,
                                                        t.dt_bias, head);
    for (std::int64_t j = 0; j < n_tok; ++j) {
      const std::int64_t row = (b * n_tok + j) * H + head;
      detail::cpu::prepare_token(hp, q + row * K, k + row * K, g + row * K, beta[row], &sc.tok);
      detail::cpu::apply_token(sc.state, V, K, sc.tok, v + row * V, sc.o);
      detail::cpu::store_out(sc.o, V, out + row * V);
    }
    if (!in_place) detail::cpu::store_state(sc.state, state_elems, p.state_dtype, state_mem);
  });
}

}  // namespace

Status decode_cpu(const DecodeProblem& p, const DecodeTensors& t, const CpuOptions& opt) {
  if (Status st = validate(p, t); !st) return st;
  if (Status st = detail::cpu::check_gate_parameters(t.A_log, t.dt_bias, p.num_heads, p.head_dim_k);
      !st) {
    return st;
  }
  if (p.batch == 0) return Status::Ok();
  try {
    if (Status st = check_slots(p, t.slots); !st) return st;
    const std::int64_t items = p.batch * p.num_heads;
    const double updates = static_cast<double>(items) * static_cast<double>(p.tokens) *
                           static_cast<double>(p.head_dim_v * p.head_dim_k);
    const std::int64_t workers = detail::cpu::resolve_threads(
        opt.num_threads, items,
        updates > 1e18 ? std::int64_t{1} << 60 : static_cast<std::int64_t>(updates));
    const std::size_t reals =
        static_cast<std::size_t>(workers) *
        static_cast<std::size_t>(detail::cpu::slot_reals(static_cast<std::uint64_t>(p.head_dim_k),
                                                         static_cast<std::uint64_t>(p.head_dim_v)));
    // 64-byte aligned slots (Scratch's contract): one alignment's worth of slack, then round up.
    const auto aligned = [](auto& buffer) {
      using Real = typename std::decay_t<decltype(buffer)>::value_type;
      const auto at = reinterpret_cast<std::uintptr_t>(buffer.data());
      const std::uintptr_t align = detail::cpu::kSlotAlignment;
      return reinterpret_cast<Real*>((at + align - 1) / align * align);
    };
    const std::size_t slack = detail::cpu::kSlotAlignment / sizeof(float);
    if (opt.fp64) {
      std::vector<double> scratch(reals + slack);
      run_decode<double>(p, t, aligned(scratch), workers);
    } else {
      std::vector<float> scratch(reals + slack);
      run_decode<float>(p, t, aligned(scratch), workers);
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kInternal, "decode_cpu could not allocate its per-thread scratch");
  }
  return Status::Ok();
}

}  // namespace kda
