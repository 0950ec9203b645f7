// libFuzzer harness for the operator's CPU entry points: the prefill (forward_cpu, with varlen,
// state slots, padding and checkpoint requests), the decode step (decode_cpu: plain, speculative
// verify, records, fold), the commit (commit_cpu) and the slot copy / zeroing (copy_slots_cpu,
// zero_slots_cpu), plus the size checks on arbitrary 64-bit problem fields.
//
// The input chooses the problem (small sizes, every option) and the batch metadata a serving
// runtime writes (slots, cu_seqlens, accepted counts, fold rows, checkpoint offsets), valid or
// not; the tensors hold seeded random values of the documented sizes. Contract under test, the
// one kda/kda.hpp documents for the CPU backend:
//   - a Status is the only outcome: no exception, crash, undefined behaviour or leak;
//   - a refused call writes nothing: every output, pool and record byte as before;
//   - an accepted call writes only what it names: pool entries outside its written slots, padding
//     rows' out and records, and read-only inputs keep their bytes;
//   - the results do not depend on the thread count (bit for bit), and are finite where the
//     inputs are finite and the scale is the default.
// Anything else is a finding (abort, so that libFuzzer keeps the input).
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "kda/bf16.hpp"
#include "kda/kda.hpp"

namespace {

using kda::fuzz::expect;
using kda::fuzz::finding;
using kda::fuzz::metadata_array;
using kda::fuzz::metadata_value;

using Bytes = std::vector<std::uint8_t>;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Tensor contents: seeded random values (the input chooses the seed, not every value).
class Values {
 public:
  explicit Values(std::uint32_t seed) : rng_(seed) {}
  Bytes bf16(std::int64_t count, float amplitude) {
    Bytes b(static_cast<std::size_t>(count) * 2);
    for (std::int64_t i = 0; i < count; ++i) {
      const kda::bf16_bits v = kda::float_to_bf16(uniform(amplitude));
      std::memcpy(b.data() + 2 * i, &v, 2);
    }
    return b;
  }
  Bytes f32(std::int64_t count, float lo, float hi) {
    Bytes b(static_cast<std::size_t>(count) * 4);
    for (std::int64_t i = 0; i < count; ++i) {
      const float v = lo + (hi - lo) * unit();
      std::memcpy(b.data() + 4 * i, &v, 4);
    }
    return b;
  }
  // A state pool or state array of `count` values, finite, in the state's dtype.
  Bytes state(kda::DType dtype, std::int64_t count) {
    return dtype == kda::DType::kBF16 ? bf16(count, 0.5f) : f32(count, -0.5f, 0.5f);
  }

 private:
  float unit() { return std::uniform_real_distribution<float>(0.0f, 1.0f)(rng_); }
  float uniform(float amplitude) { return amplitude * (2.0f * unit() - 1.0f); }
  std::mt19937 rng_;
};

float gate_bound(FuzzedDataProvider& in) {
  return in.PickValueInArray<float>(
      {-5.0f, -1.0f, -0.25f, 0.0f, -6.0f, kNaN, -kInf, in.ConsumeFloatingPoint<float>()});
}

// The scale: the default (0) or 0.5 mostly; sometimes a value to refuse or an extreme one.
float scale_of(FuzzedDataProvider& in) {
  return in.PickValueInArray<float>(
      {0.0f, 0.0f, 0.5f, -1.0f, kNaN, kInf, in.ConsumeFloatingPoint<float>()});
}

kda::DType state_dtype(FuzzedDataProvider& in, bool none_allowed) {
  if (none_allowed) {
    return in.PickValueInArray({kda::DType::kNone, kda::DType::kBF16, kda::DType::kF32});
  }
  return in.PickValueInArray(
      {kda::DType::kBF16, kda::DType::kF32, kda::DType::kF32, kda::DType::kI32});
}

// Gate parameters: valid mostly, sometimes one bad value (non-finite, or |A_log| > 20).
void gate_parameters(FuzzedDataProvider& in, Values& values, std::int64_t heads,
                     std::int64_t head_dim, Bytes* a_log, Bytes* dt_bias) {
  *a_log = values.f32(heads, -1.0f, 1.0f);
  *dt_bias = values.f32(heads * head_dim, -1.0f, 1.0f);
  if (in.ConsumeIntegralInRange<int>(0, 7) == 7) {
    const float bad = in.PickValueInArray<float>({kNaN, kInf, 25.0f, -21.0f});
    Bytes& target = in.ConsumeBool() || dt_bias->empty() ? *a_log : *dt_bias;
    if (!target.empty()) std::memcpy(target.data(), &bad, 4);
  }
}

// The head shape and the gate fields every problem kind has.
template <typename P>
void head_fields(FuzzedDataProvider& in, P* p) {
  p->num_heads = in.ConsumeIntegralInRange<std::int64_t>(1, 2);
  p->head_dim_k = in.PickValueInArray<std::int64_t>({4, 8, 16});
  p->head_dim_v = in.PickValueInArray<std::int64_t>({4, 8, 16});
}
template <typename P>
void gate_fields(FuzzedDataProvider& in, P* p) {
  p->gate = in.ConsumeBool() ? kda::GateMode::kLowerBound : kda::GateMode::kSoftplus;
  p->lower_bound = gate_bound(in);
  p->scale = scale_of(in);
}

// The step's inputs for `tokens` tokens: q, k, v, g, beta and the gate parameters.
struct Inputs {
  Bytes q, k, v, g, beta, a_log, dt_bias;
  void fill(FuzzedDataProvider& in, Values& values, std::int64_t tokens, std::int64_t heads,
            std::int64_t head_dim_k, std::int64_t head_dim_v) {
    q = values.bf16(tokens * heads * head_dim_k, 2.0f);
    k = values.bf16(tokens * heads * head_dim_k, 2.0f);
    v = values.bf16(tokens * heads * head_dim_v, 2.0f);
    g = values.bf16(tokens * heads * head_dim_k, 4.0f);
    beta = values.bf16(tokens * heads, 4.0f);
    gate_parameters(in, values, heads, head_dim_k, &a_log, &dt_bias);
  }
  template <typename T>
  void set(T* t) const {
    t->q = q.data();
    t->k = k.data();
    t->v = v.data();
    t->g = g.data();
    t->beta = beta.data();
    t->A_log = reinterpret_cast<const float*>(a_log.data());
    t->dt_bias = reinterpret_cast<const float*>(dt_bias.data());
  }
};

bool bf16_finite(const Bytes& b, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i + 1 < end; i += 2) {
    kda::bf16_bits v;
    std::memcpy(&v, b.data() + i, 2);
    if (!std::isfinite(kda::bf16_to_float(v))) return false;
  }
  return true;
}

bool padding(std::int32_t slot, std::int32_t padding_slot) {
  return slot < 0 || (padding_slot >= 0 && slot == padding_slot);
}

// The entries of a pool of `slots` entries of `entry` bytes that differ between two copies.
std::set<std::int64_t> changed_entries(const Bytes& before, const Bytes& after, std::int64_t slots,
                                       std::size_t entry) {
  std::set<std::int64_t> changed;
  for (std::int64_t s = 0; s < slots; ++s) {
    const std::size_t at = static_cast<std::size_t>(s) * entry;
    if (std::memcmp(before.data() + at, after.data() + at, entry) != 0) changed.insert(s);
  }
  return changed;
}

void expect_within(const std::set<std::int64_t>& changed, const std::set<std::int64_t>& allowed,
                   const std::string& what) {
  for (const std::int64_t s : changed) {
    expect(allowed.count(s) == 1, what + ": entry " + std::to_string(s) + " changed");
  }
}

std::size_t workspace_bytes_or_zero(const kda::Status& st, std::size_t bytes) {
  return st.ok() && bytes <= (std::size_t{64} << 20) ? bytes : 0;
}

// ---- the prefill ------------------------------------------------------------------------------

struct Prefill {
  kda::Problem p;
  Inputs inputs;
  Bytes cu, out, initial, final_state, offsets;
  std::vector<std::int32_t> slots, checkpoint_slots;
  bool in_place = false;  // one pool for the initial and the final states
  Bytes workspace;

  kda::Status run(int threads) {
    kda::Tensors t;
    inputs.set(&t);
    t.cu_seqlens = p.varlen() ? cu.data() : nullptr;
    t.initial_state = p.initial_state_dtype != kda::DType::kNone ? initial.data() : nullptr;
    t.final_state = p.final_state_dtype == kda::DType::kNone
                        ? nullptr
                        : (in_place ? initial.data() : final_state.data());
    t.state_slots = p.num_state_slots > 0 ? slots.data() : nullptr;
    t.checkpoint_offsets = p.checkpoints > 0 ? offsets.data() : nullptr;
    t.checkpoint_slots = p.checkpoints > 0 ? checkpoint_slots.data() : nullptr;
    t.out = out.data();
    kda::CpuOptions options;
    options.num_threads = threads;
    return kda::forward_cpu(p, t, kda::Workspace{workspace.data(), workspace.size()}, options);
  }
};

void fuzz_prefill(FuzzedDataProvider& in) {
  Prefill f;
  kda::Problem& p = f.p;
  Values values(in.ConsumeIntegral<std::uint32_t>());
  head_fields(in, &p);
  std::vector<std::int64_t> lengths;
  if (in.ConsumeBool()) {  // varlen: N sequences, cu_seqlens possibly broken
    p.num_seqs = in.ConsumeIntegralInRange<std::int64_t>(0, 5);
    p.cu_seqlens_dtype = in.ConsumeBool() ? kda::DType::kI32 : kda::DType::kI64;
    std::vector<std::int64_t> cu = {0};
    for (std::int64_t s = 0; s < p.num_seqs; ++s) {
      lengths.push_back(in.PickValueInArray<std::int64_t>(
          {0, 1, 5, 16, 17, 33, in.ConsumeIntegralInRange<std::int64_t>(0, 40)}));
      cu.push_back(cu.back() + lengths.back());
    }
    p.seq_len = cu.back();
    if (in.ConsumeIntegralInRange<int>(0, 5) == 5) {  // a broken entry, or a wrong total
      const std::size_t at = in.ConsumeIntegralInRange<std::size_t>(0, cu.size() - 1);
      cu[at] = metadata_value(in, p.seq_len + 1);
    }
    for (const std::int64_t c : cu) {
      if (p.cu_seqlens_dtype == kda::DType::kI32) {
        const auto c32 = static_cast<std::int32_t>(c);
        f.cu.insert(f.cu.end(), reinterpret_cast<const std::uint8_t*>(&c32),
                    reinterpret_cast<const std::uint8_t*>(&c32) + 4);
      } else {
        f.cu.insert(f.cu.end(), reinterpret_cast<const std::uint8_t*>(&c),
                    reinterpret_cast<const std::uint8_t*>(&c) + 8);
      }
    }
  } else {
    p.batch = in.ConsumeIntegralInRange<std::int64_t>(0, 3);
    p.seq_len = in.ConsumeIntegralInRange<std::int64_t>(0, 40);
    lengths.assign(static_cast<std::size_t>(p.batch), p.seq_len);
  }
  gate_fields(in, &p);
  p.initial_state_dtype = state_dtype(in, true);
  p.final_state_dtype = state_dtype(in, true);
  const std::int64_t N = p.sequences(), H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  const std::int64_t T = p.total_tokens(), state = H * V * K;
  if (in.ConsumeBool()) {  // state slots, a padding slot, checkpoint requests
    p.num_state_slots = in.ConsumeIntegralInRange<std::int64_t>(1, 8);
    p.padding_slot = in.ConsumeBool() ? -1 : metadata_value(in, p.num_state_slots);
    f.slots = metadata_array(in, N, p.num_state_slots);
    if (in.ConsumeBool()) {
      p.checkpoints = in.ConsumeIntegralInRange<std::int64_t>(1, 3);
      p.checkpoint_offsets_dtype = in.ConsumeBool() ? kda::DType::kI32 : kda::DType::kI64;
      f.checkpoint_slots = metadata_array(in, N * p.checkpoints, p.num_state_slots);
      for (std::int64_t i = 0; i < N * p.checkpoints; ++i) {
        const std::int64_t length =
            lengths.empty() ? 0 : lengths[static_cast<std::size_t>(i / p.checkpoints)];
        const std::int64_t offset =
            in.PickValueInArray<std::int64_t>({-1, 0, 16, 32, length, length - 1, length + 16,
                                               static_cast<std::int64_t>(metadata_value(in, 48))});
        if (p.checkpoint_offsets_dtype == kda::DType::kI32) {
          const auto o32 = static_cast<std::int32_t>(offset);
          f.offsets.insert(f.offsets.end(), reinterpret_cast<const std::uint8_t*>(&o32),
                           reinterpret_cast<const std::uint8_t*>(&o32) + 4);
        } else {
          f.offsets.insert(f.offsets.end(), reinterpret_cast<const std::uint8_t*>(&offset),
                           reinterpret_cast<const std::uint8_t*>(&offset) + 8);
        }
      }
    }
  }
  const bool pooled = p.num_state_slots > 0;
  const std::int64_t entries = pooled ? p.num_state_slots : N;
  f.inputs.fill(in, values, T, H, K, V);
  f.out = values.bf16(T * H * V, 100.0f);  // poison: any stale value shows
  f.in_place = pooled && p.initial_state_dtype == p.final_state_dtype && in.ConsumeBool();
  if (p.initial_state_dtype != kda::DType::kNone || f.in_place) {
    f.initial = values.state(p.initial_state_dtype, entries * state);
  }
  if (p.final_state_dtype != kda::DType::kNone && !f.in_place) {
    f.final_state = values.state(p.final_state_dtype, entries * state);
  }
  std::size_t ws_bytes = 0;
  const kda::Status ws_status = kda::workspace_size(p, kda::Backend::kCpu, &ws_bytes);
  ws_bytes = workspace_bytes_or_zero(ws_status, ws_bytes);
  if (ws_bytes > 0 && in.ConsumeIntegralInRange<int>(0, 15) == 15) ws_bytes /= 2;  // too small
  f.workspace.assign(ws_bytes, 0xA5);

  const Prefill before = f;
  const int threads = in.PickValueInArray({1, 2, 3});
  const kda::Status st = f.run(threads);
  if (!st.ok()) {
    expect(!st.message().empty(), "prefill: a refusal without a message");
    expect(
        f.out == before.out && f.initial == before.initial && f.final_state == before.final_state,
        "prefill: refused (" + st.message() + ") but wrote");
    return;
  }
  expect(ws_status.ok(), "prefill: ran although workspace_size refused: " + ws_status.message());
  if (p.initial_state_dtype != kda::DType::kNone && !f.in_place) {
    expect(f.initial == before.initial, "prefill: the initial states changed");
  }
  if (pooled && p.final_state_dtype != kda::DType::kNone) {
    // Only the sequences' own entries and their checkpoint entries may change.
    std::set<std::int64_t> allowed;
    for (std::int64_t s = 0; s < N; ++s) {
      if (padding(f.slots[static_cast<std::size_t>(s)], p.padding_slot)) continue;
      allowed.insert(f.slots[static_cast<std::size_t>(s)]);
      for (std::int64_t r = 0; r < p.checkpoints; ++r) {
        allowed.insert(f.checkpoint_slots[static_cast<std::size_t>(s * p.checkpoints + r)]);
      }
    }
    const Bytes& pool_before = f.in_place ? before.initial : before.final_state;
    const Bytes& pool_after = f.in_place ? f.initial : f.final_state;
    const std::size_t entry =
        static_cast<std::size_t>(state) * kda::dtype_size(p.final_state_dtype);
    expect_within(changed_entries(pool_before, pool_after, entries, entry), allowed,
                  "prefill: a pool entry no sequence writes");
  }
  if (p.scale == 0.0f) expect(bf16_finite(f.out, 0, f.out.size()), "prefill: out not finite");
  // The same call on another thread count: the same bits.
  Prefill again = before;
  const kda::Status st2 = again.run(threads == 1 ? 3 : 1);
  expect(st2.ok(), "prefill: refused on another thread count: " + st2.message());
  expect(again.out == f.out && again.initial == f.initial && again.final_state == f.final_state,
         "prefill: results depend on the thread count");
}

// ---- the decode step --------------------------------------------------------------------------

struct Decode {
  kda::DecodeProblem p;
  Inputs inputs;
  Bytes pool, out, records, fold_records;
  std::vector<std::int32_t> slots, accepted, fold_rows, fold_counts;
  bool pass_accepted = false;
  Bytes workspace;

  kda::Status run(int threads) {
    kda::DecodeTensors t;
    inputs.set(&t);
    t.slots = slots.data();
    t.num_accepted = pass_accepted ? accepted.data() : nullptr;
    t.state_pool = pool.data();
    t.out = out.data();
    t.records = p.records ? reinterpret_cast<float*>(records.data()) : nullptr;
    if (p.folds()) {
      t.fold_records = reinterpret_cast<const float*>(fold_records.data());
      t.fold_rows = fold_rows.data();
      t.fold_counts = fold_counts.data();
    }
    kda::CpuOptions options;
    options.num_threads = threads;
    return kda::decode_cpu(p, t, kda::Workspace{workspace.data(), workspace.size()}, options);
  }
};

void fuzz_decode(FuzzedDataProvider& in) {
  Decode d;
  kda::DecodeProblem& p = d.p;
  Values values(in.ConsumeIntegral<std::uint32_t>());
  p.batch = in.ConsumeIntegralInRange<std::int64_t>(0, 4);
  p.tokens = in.PickValueInArray<std::int64_t>({1, 1, 2, 3, 16, 0, 17});
  head_fields(in, &p);
  p.num_slots = in.ConsumeIntegralInRange<std::int64_t>(0, 8);
  p.state_dtype = state_dtype(in, false);
  gate_fields(in, &p);
  p.verify = in.ConsumeBool();
  p.records = p.verify && in.ConsumeBool();
  p.padding_slot = in.ConsumeBool() ? -1 : metadata_value(in, p.num_slots);
  if (in.ConsumeIntegralInRange<int>(0, 2) == 2) {
    p.fold_batch = in.ConsumeIntegralInRange<std::int64_t>(1, 3);
    p.fold_tokens = in.ConsumeIntegralInRange<std::int64_t>(1, 4);
  }
  const std::int64_t B = p.batch, T = p.tokens > 0 ? p.tokens : 0, H = p.num_heads;
  const std::int64_t K = p.head_dim_k, V = p.head_dim_v, state = H * V * K;
  const bool per_token = p.verify && !p.records;
  d.slots = metadata_array(in, per_token ? B * T : B, p.num_slots);
  d.pass_accepted = per_token != (in.ConsumeIntegralInRange<int>(0, 9) == 9);
  d.accepted.resize(static_cast<std::size_t>(B));
  for (auto& a : d.accepted) {
    a = in.ConsumeIntegralInRange<int>(0, 7) == 7
            ? metadata_value(in, T + 1)
            : in.ConsumeIntegralInRange<std::int32_t>(1, static_cast<std::int32_t>(T > 0 ? T : 1));
  }
  d.inputs.fill(in, values, B * T, H, K, V);
  const kda::DType pool_dtype =
      p.state_dtype == kda::DType::kBF16 ? kda::DType::kBF16 : kda::DType::kF32;
  d.pool = values.state(pool_dtype, p.num_slots * state);
  d.out = values.bf16(B * T * H * V, 100.0f);
  const std::int64_t record = H * (2 * K + V);
  if (p.records) d.records = values.f32(B * T * record, 100.0f, 200.0f);
  if (p.folds()) {
    // Records a records step could have written: decays in (0.5, 1], small keys and corrections.
    d.fold_records.resize(static_cast<std::size_t>(p.fold_batch * p.fold_tokens * record) * 4);
    Bytes decay = values.f32(p.fold_batch * p.fold_tokens * H * K, 0.5f, 1.0f);
    Bytes rest = values.f32(p.fold_batch * p.fold_tokens * H * (K + V), -0.3f, 0.3f);
    for (std::int64_t i = 0; i < p.fold_batch * p.fold_tokens * H; ++i) {
      std::uint8_t* at = d.fold_records.data() + static_cast<std::size_t>(i * (2 * K + V)) * 4;
      std::memcpy(at, decay.data() + static_cast<std::size_t>(i * K) * 4,
                  static_cast<std::size_t>(K) * 4);
      std::memcpy(at + K * 4, rest.data() + static_cast<std::size_t>(i * (K + V)) * 4,
                  static_cast<std::size_t>(K + V) * 4);
    }
    d.fold_rows = metadata_array(in, B, p.fold_batch);
    d.fold_counts = metadata_array(in, B, p.fold_tokens + 1);
  }
  std::size_t ws_bytes = 0;
  const kda::Status ws_status = kda::decode_workspace_size(p, kda::Backend::kCpu, &ws_bytes);
  ws_bytes = workspace_bytes_or_zero(ws_status, ws_bytes);
  if (ws_bytes > 0 && in.ConsumeIntegralInRange<int>(0, 15) == 15) ws_bytes /= 2;  // too small
  d.workspace.assign(ws_bytes, 0x5A);

  const Decode before = d;
  const int threads = in.PickValueInArray({1, 2, 3});
  const kda::Status st = d.run(threads);
  if (!st.ok()) {
    expect(!st.message().empty(), "decode: a refusal without a message");
    expect(d.out == before.out && d.pool == before.pool && d.records == before.records,
           "decode: refused (" + st.message() + ") but wrote");
    return;
  }
  expect(ws_status.ok(), "decode: ran although its workspace size was refused");
  expect(p.state_dtype == kda::DType::kBF16 || p.state_dtype == kda::DType::kF32,
         "decode: ran with a state dtype other than bf16 and f32");
  // (Without rows the arrays are empty: their pointers are null whatever was chosen.)
  expect(per_token == d.pass_accepted || !p.verify || B == 0,
         std::string("decode: a verify step ran with num_accepted ") +
             (d.pass_accepted ? "given (records form)" : "missing (per-token form)") + ", batch " +
             std::to_string(B));
  if (per_token) {
    for (const std::int32_t a : d.accepted) {
      expect(a >= 1 && a <= T, "decode: ran with num_accepted " + std::to_string(a) +
                                   " outside [1, " + std::to_string(T) + "]");
    }
  }
  // Which rows ran, and which pool entries they may write.
  std::set<std::int64_t> allowed;
  std::vector<bool> ran(static_cast<std::size_t>(B), false);
  for (std::int64_t b = 0; b < B; ++b) {
    if (per_token) {
      const std::int32_t start =
          d.slots[static_cast<std::size_t>(b * T + d.accepted[static_cast<std::size_t>(b)] - 1)];
      if (padding(start, p.padding_slot)) continue;
      ran[static_cast<std::size_t>(b)] = true;
      for (std::int64_t t = 0; t < T; ++t) {
        allowed.insert(d.slots[static_cast<std::size_t>(b * T + t)]);
      }
    } else {
      const std::int32_t slot = d.slots[static_cast<std::size_t>(b)];
      if (padding(slot, p.padding_slot)) continue;
      ran[static_cast<std::size_t>(b)] = true;
      if (!p.records || p.folds()) allowed.insert(slot);
    }
  }
  const std::size_t entry = static_cast<std::size_t>(state) * kda::dtype_size(pool_dtype);
  expect_within(changed_entries(before.pool, d.pool, p.num_slots, entry), allowed,
                "decode: a pool entry no row writes");
  const std::size_t out_row = static_cast<std::size_t>(T * H * V) * 2;
  const std::size_t record_row = static_cast<std::size_t>(T * record) * 4;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::size_t o = static_cast<std::size_t>(b) * out_row;
    if (!ran[static_cast<std::size_t>(b)]) {
      expect(std::memcmp(d.out.data() + o, before.out.data() + o, out_row) == 0,
             "decode: padding row " + std::to_string(b) + " wrote out");
      if (p.records) {
        const std::size_t r = static_cast<std::size_t>(b) * record_row;
        expect(std::memcmp(d.records.data() + r, before.records.data() + r, record_row) == 0,
               "decode: padding row " + std::to_string(b) + " wrote records");
      }
    } else if (p.scale == 0.0f) {
      expect(bf16_finite(d.out, o, o + out_row),
             "decode: row " + std::to_string(b) + "'s out not finite");
    }
  }
  Decode again = before;
  const kda::Status st2 = again.run(threads == 1 ? 3 : 1);
  expect(st2.ok(), "decode: refused on another thread count: " + st2.message());
  expect(again.out == d.out && again.pool == d.pool && again.records == d.records,
         "decode: results depend on the thread count");
}

// ---- the commit -------------------------------------------------------------------------------

void fuzz_commit(FuzzedDataProvider& in) {
  kda::CommitProblem p;
  Values values(in.ConsumeIntegral<std::uint32_t>());
  p.batch = in.ConsumeIntegralInRange<std::int64_t>(0, 4);
  p.tokens = in.PickValueInArray<std::int64_t>({1, 2, 4, 16, 0, 17});
  head_fields(in, &p);
  p.num_slots = in.ConsumeIntegralInRange<std::int64_t>(0, 6);
  p.state_dtype = state_dtype(in, false);
  p.padding_slot = in.ConsumeBool() ? -1 : metadata_value(in, p.num_slots);
  const int num_layers = in.ConsumeIntegralInRange<int>(0, 3);
  const std::int64_t T = p.tokens > 0 ? p.tokens : 0;
  const std::int64_t record = p.num_heads * (2 * p.head_dim_k + p.head_dim_v);
  const std::int64_t state = p.num_heads * p.head_dim_k * p.head_dim_v;
  const kda::DType pool_dtype =
      p.state_dtype == kda::DType::kBF16 ? kda::DType::kBF16 : kda::DType::kF32;
  std::vector<Bytes> records, pools;
  for (int l = 0; l < num_layers; ++l) {
    records.push_back(values.f32(p.batch * T * record, -0.3f, 0.3f));
    pools.push_back(values.state(pool_dtype, p.num_slots * state));
  }
  const std::vector<std::int32_t> slots = metadata_array(in, p.batch, p.num_slots);
  const std::vector<std::int32_t> accepted = metadata_array(in, p.batch, T + 1);
  auto run = [&](std::vector<Bytes>& layer_pools, int threads) {
    std::vector<kda::CommitLayer> layers;
    for (int l = 0; l < num_layers; ++l) {
      layers.push_back({reinterpret_cast<const float*>(records[static_cast<std::size_t>(l)].data()),
                        layer_pools[static_cast<std::size_t>(l)].data()});
    }
    kda::CpuOptions options;
    options.num_threads = threads;
    return kda::commit_cpu(p, layers.data(), num_layers, slots.data(), accepted.data(), options);
  };
  const std::vector<Bytes> before = pools;
  const kda::Status st = run(pools, 1);
  if (!st.ok()) {
    expect(pools == before, "commit: refused (" + st.message() + ") but wrote");
    return;
  }
  std::set<std::int64_t> allowed;
  for (const std::int32_t slot : slots) {
    if (!padding(slot, p.padding_slot)) allowed.insert(slot);
  }
  const std::size_t entry = static_cast<std::size_t>(state) * kda::dtype_size(pool_dtype);
  for (int l = 0; l < num_layers; ++l) {
    expect_within(changed_entries(before[static_cast<std::size_t>(l)],
                                  pools[static_cast<std::size_t>(l)], p.num_slots, entry),
                  allowed, "commit: a pool entry no row names");
  }
  std::vector<Bytes> again = before;
  expect(run(again, 3).ok(), "commit: refused on another thread count");
  expect(again == pools, "commit: results depend on the thread count");
}

// ---- slot copy and zeroing ----------------------------------------------------------------------

void fuzz_slot_copy(FuzzedDataProvider& in) {
  kda::SlotCopyProblem p;
  Values values(in.ConsumeIntegral<std::uint32_t>());
  p.pairs = in.ConsumeIntegralInRange<std::int64_t>(0, 5);
  p.num_slots = in.ConsumeIntegralInRange<std::int64_t>(0, 6);
  p.padding_slot = in.ConsumeBool() ? -1 : metadata_value(in, p.num_slots);
  const int num_pools = in.ConsumeIntegralInRange<int>(0, 3);
  std::vector<Bytes> pools;
  std::vector<std::uint64_t> entry_bytes;
  for (int i = 0; i < num_pools; ++i) {
    entry_bytes.push_back(in.PickValueInArray<std::uint64_t>({4, 16, 100}));
    pools.push_back(
        values.f32(p.num_slots * static_cast<std::int64_t>(entry_bytes.back()) / 4, -1.0f, 1.0f));
  }
  const std::vector<std::int32_t> src = metadata_array(in, p.pairs, p.num_slots);
  const std::vector<std::int32_t> dst = metadata_array(in, p.pairs, p.num_slots);
  const bool zeroing = in.ConsumeBool();
  std::vector<kda::SlotPool> descriptors;
  for (int i = 0; i < num_pools; ++i) {
    descriptors.push_back(
        {pools[static_cast<std::size_t>(i)].data(), entry_bytes[static_cast<std::size_t>(i)]});
  }
  const std::vector<Bytes> before = pools;
  const kda::Status st =
      zeroing ? kda::zero_slots_cpu(p, descriptors.data(), num_pools, dst.data())
              : kda::copy_slots_cpu(p, descriptors.data(), num_pools, src.data(), dst.data());
  if (!st.ok()) {
    expect(pools == before, "slot copy: refused (" + st.message() + ") but wrote");
    return;
  }
  for (int i = 0; i < num_pools; ++i) {
    const std::size_t entry = entry_bytes[static_cast<std::size_t>(i)];
    const Bytes& was = before[static_cast<std::size_t>(i)];
    const Bytes& now = pools[static_cast<std::size_t>(i)];
    std::set<std::int64_t> written;
    for (std::int64_t j = 0; j < p.pairs; ++j) {
      const std::int32_t to = dst[static_cast<std::size_t>(j)];
      const std::int32_t from = src[static_cast<std::size_t>(j)];
      if (padding(to, p.padding_slot) || (!zeroing && padding(from, p.padding_slot))) continue;
      written.insert(to);
      const std::uint8_t* result = now.data() + static_cast<std::size_t>(to) * entry;
      if (zeroing) {
        for (std::size_t b = 0; b < entry; ++b) expect(result[b] == 0, "zeroing left a byte");
      } else {
        expect(std::memcmp(result, was.data() + static_cast<std::size_t>(from) * entry, entry) == 0,
               "slot copy: pair " + std::to_string(j) + " is not the source's bytes");
      }
    }
    expect_within(
        changed_entries(was, now, p.num_slots, entry), written,
        zeroing ? "zeroing: an entry not named" : "slot copy: an entry not a destination");
  }
}

// ---- the size checks on arbitrary fields --------------------------------------------------------

void fuzz_sizes(FuzzedDataProvider& in) {
  auto field = [&in]() {
    return in.PickValueInArray<std::int64_t>(
        {0, 1, -1, 128, 4096, 4097, std::int64_t{1} << 31, std::numeric_limits<std::int64_t>::max(),
         std::numeric_limits<std::int64_t>::min(), in.ConsumeIntegral<std::int64_t>()});
  };
  kda::Problem p;
  p.batch = field();
  p.seq_len = field();
  p.num_heads = field();
  p.head_dim_k = field();
  p.head_dim_v = field();
  p.num_seqs = field();
  p.cu_seqlens_dtype = in.PickValueInArray(
      {kda::DType::kNone, kda::DType::kI32, kda::DType::kI64, kda::DType::kF32});
  p.initial_state_dtype = state_dtype(in, true);
  p.final_state_dtype = state_dtype(in, true);
  p.num_state_slots = field();
  p.checkpoints = field();
  p.checkpoint_offsets_dtype = in.PickValueInArray({kda::DType::kNone, kda::DType::kI64});
  std::size_t bytes = 0;
  (void)kda::validate(p);
  (void)kda::validate(p, kda::Tensors{});
  (void)kda::can_implement(p, kda::Backend::kCpu);
  (void)kda::workspace_size(p, kda::Backend::kCpu, &bytes);
  (void)kda::workspace_size(p, kda::Backend::kCuda, &bytes);
  (void)kda::transition_workspace_size(p, kda::Backend::kCpu, &bytes);

  kda::DecodeProblem d;
  d.batch = field();
  d.tokens = field();
  d.num_heads = field();
  d.head_dim_k = field();
  d.head_dim_v = field();
  d.num_slots = field();
  d.fold_batch = field();
  d.fold_tokens = field();
  d.verify = in.ConsumeBool();
  d.records = in.ConsumeBool();
  (void)kda::validate(d);
  (void)kda::validate(d, kda::DecodeTensors{});
  (void)kda::decode_workspace_size(d, kda::Backend::kCpu, &bytes);

  kda::CommitProblem c;
  c.batch = field();
  c.tokens = field();
  c.num_heads = field();
  c.head_dim_k = field();
  c.head_dim_v = field();
  c.num_slots = field();
  (void)kda::validate(c);
  (void)kda::validate(c, nullptr, in.ConsumeIntegral<int>(), nullptr, nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  try {
    switch (in.ConsumeIntegralInRange<int>(0, 4)) {
      case 0:
        fuzz_prefill(in);
        break;
      case 1:
        fuzz_decode(in);
        break;
      case 2:
        fuzz_commit(in);
        break;
      case 3:
        fuzz_slot_copy(in);
        break;
      default:
        fuzz_sizes(in);
        break;
    }
  } catch (const std::exception& e) {
    finding(std::string("the operator threw: ") + e.what());
  } catch (...) {
    finding("the operator threw a non-std exception");
  }
  return 0;
}
