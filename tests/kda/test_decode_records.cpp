// The record-and-commit verify step (DecodeProblem::records) and the commit (commit_cpu /
// commit_cuda): a records step followed by a commit of num_accepted[b] records gives the state the
// per-token-states verify step keeps after token num_accepted[b] - 1 (bit for bit) and the same
// out; records and states against an fp64 recurrence; padding rows touch nothing; several layers in
// one commit; bad input is refused (CPU) or reported through the device status word (CUDA).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"
#include "cuda_runtime_util.hpp"

using namespace kda;
using namespace kda::test;

namespace {

constexpr std::int64_t D = 128;            // make_decode_case's K and V
constexpr std::int64_t kRecord = 3 * D;    // floats of one (token, head) record: alpha, k^, u
constexpr std::uint32_t kPoisonF32 = ~0u;  // records are poisoned with 0xFF bytes (a NaN)

bool is_poison(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits == kPoisonF32;
}

// A records step's results.
struct RecordsRun {
  Status status;
  std::vector<unsigned char> pool;
  std::vector<std::uint16_t> out;
  std::vector<float> records;
  std::uint32_t device_status = 0;
  bool guards_intact = true;
};

// What a step folds (DecodeProblem::fold_batch): a records step's records, and per row of the step
// the row of that step and its accepted count.
struct Fold {
  std::int64_t batch = 0, tokens = 1;
  std::vector<float> records;
  std::vector<std::int32_t> rows, counts;
};

// A plain or records step (dc.problem.records: d.slots is [B], num_accepted not passed) on the
// pool `pool_in`, folding `fold` first where given (`cpu`: the CPU backend's options).
template <class Buffer>
RecordsRun step_on(Backend backend, const DecodeCase& dc, const std::vector<unsigned char>& pool_in,
                   const Fold* fold, const CpuOptions& cpu = {}) {
  RecordsRun r;
  DecodeProblem p = dc.problem;
  CaseBuffers<Buffer> d(dc.tokens);
  Buffer slots = Buffer::from(dc.slots);
  Buffer pool = Buffer::from(pool_in);
  Buffer out(static_cast<std::size_t>(dc.tokens.out_elems()) * 2);
  out.fill(kPoisonByte);
  const std::int64_t record = 2 * p.head_dim_k + p.head_dim_v;  // kRecord at K = V = 128
  Buffer records(p.records ? static_cast<std::size_t>(p.batch * p.tokens * p.num_heads * record) * 4
                           : 0);
  records.fill(kPoisonByte);
  Buffer fold_records = Buffer::from(fold != nullptr ? fold->records : std::vector<float>(1));
  Buffer fold_rows = Buffer::from(fold != nullptr ? fold->rows : std::vector<std::int32_t>(1));
  Buffer fold_counts = Buffer::from(fold != nullptr ? fold->counts : std::vector<std::int32_t>(1));
  Buffer status(backend == Backend::kCuda ? 4 : 0);
  if (backend == Backend::kCuda) status.fill(0);
  DecodeTensors t = d.decode_tensors();
  t.slots = static_cast<const std::int32_t*>(slots.get());
  t.state_pool = pool.get();
  t.out = out.get();
  if (p.records) t.records = static_cast<float*>(records.get());
  if (fold != nullptr) {
    p.fold_batch = fold->batch;
    p.fold_tokens = fold->tokens;
    t.fold_records = static_cast<const float*>(fold_records.get());
    t.fold_rows = static_cast<const std::int32_t*>(fold_rows.get());
    t.fold_counts = static_cast<const std::int32_t*>(fold_counts.get());
  }
  if (backend == Backend::kCuda) t.device_status = static_cast<std::uint32_t*>(status.get());
  r.status = backend == Backend::kCpu ? decode_cpu(p, t, cpu) : decode_cuda(p, t, nullptr, dc.cuda);
  if (r.status.ok()) r.status = Buffer::synchronize();
  r.pool = pool.template download<unsigned char>();
  r.out = out.template download<std::uint16_t>();
  if (p.records) r.records = records.template download<float>();
  if (backend == Backend::kCuda) r.device_status = status.template download<std::uint32_t>()[0];
  r.guards_intact = pool.guards_intact() && out.guards_intact() && records.guards_intact() &&
                    fold_records.guards_intact();
  return r;
}

RecordsRun step(const Runner& runner, const DecodeCase& dc, const std::vector<unsigned char>& pool,
                const Fold* fold, const CpuOptions& cpu = {}) {
  return runner.backend() == Backend::kCpu ? step_on<HostBuffer>(Backend::kCpu, dc, pool, fold, cpu)
                                           : step_on<DeviceBuffer>(Backend::kCuda, dc, pool, fold);
}

RecordsRun records_step(const Runner& runner, const DecodeCase& dc) {
  return step(runner, dc, pool_bytes(dc), nullptr);
}

struct CommitRun {
  Status status;
  std::vector<std::vector<unsigned char>> pools;  // per layer, after the commit
  std::uint32_t device_status = 0;
  bool guards_intact = true;
};

// One commit call over layers[l] = (records[l], pools[l]).
template <class Buffer>
CommitRun commit_on(Backend backend, const CommitProblem& p,
                    const std::vector<std::vector<float>>& records,
                    const std::vector<std::vector<unsigned char>>& pools,
                    const std::vector<std::int32_t>& slots,
                    const std::vector<std::int32_t>& num_accepted, const CpuOptions& cpu) {
  CommitRun r;
  std::vector<Buffer> rec, pool;
  std::vector<CommitLayer> layers;
  for (std::size_t l = 0; l < records.size(); ++l) {
    rec.push_back(Buffer::from(records[l]));
    pool.push_back(Buffer::from(pools[l]));
  }
  for (std::size_t l = 0; l < records.size(); ++l) {
    layers.push_back({static_cast<const float*>(rec[l].get()), pool[l].get()});
  }
  Buffer s = Buffer::from(slots), na = Buffer::from(num_accepted);
  Buffer status(backend == Backend::kCuda ? 4 : 0);
  if (backend == Backend::kCuda) status.fill(0);
  const auto* ps = static_cast<const std::int32_t*>(s.get());
  const auto* pa = static_cast<const std::int32_t*>(na.get());
  const int n = static_cast<int>(layers.size());
  r.status = backend == Backend::kCpu
                 ? commit_cpu(p, layers.data(), n, ps, pa, cpu)
                 : commit_cuda(p, layers.data(), n, ps, pa,
                               static_cast<std::uint32_t*>(status.get()), nullptr);
  if (r.status.ok()) r.status = Buffer::synchronize();
  for (std::size_t l = 0; l < pool.size(); ++l) {
    r.pools.push_back(pool[l].template download<unsigned char>());
    r.guards_intact = r.guards_intact && pool[l].guards_intact() && rec[l].guards_intact();
  }
  if (backend == Backend::kCuda) r.device_status = status.template download<std::uint32_t>()[0];
  return r;
}

CommitRun commit(const Runner& runner, const CommitProblem& p,
                 const std::vector<std::vector<float>>& records,
                 const std::vector<std::vector<unsigned char>>& pools,
                 const std::vector<std::int32_t>& slots,
                 const std::vector<std::int32_t>& num_accepted, const CpuOptions& cpu = {}) {
  return runner.backend() == Backend::kCpu
             ? commit_on<HostBuffer>(Backend::kCpu, p, records, pools, slots, num_accepted, cpu)
             : commit_on<DeviceBuffer>(Backend::kCuda, p, records, pools, slots, num_accepted, cpu);
}

CommitProblem commit_problem(const DecodeProblem& d) {
  CommitProblem p;
  p.batch = d.batch;
  p.tokens = d.tokens;
  p.num_heads = d.num_heads;
  p.head_dim_k = d.head_dim_k;
  p.head_dim_v = d.head_dim_v;
  p.num_slots = d.num_slots;
  p.state_dtype = d.state_dtype;
  return p;
}

// A verify step's two forms on the same rows: row b of `per_token` starts from its slot at
// num_accepted 1 (= slots[b][0]) and keeps the state after token t in slots[b][t]; row b of
// `records` starts from the same slot (its committed state). Row 3 (and every fourth) is padding.
struct TwoForms {
  DecodeCase per_token, records;
};

TwoForms two_forms(std::int64_t B, std::int64_t T, std::int64_t H, DType dt, GateMode gate,
                   std::uint64_t seed) {
  const std::int64_t num_slots = B * T + 3;
  TwoForms f;
  f.per_token = make_decode_case(B, T, H, num_slots, dt, gate, seed);
  Rng rng(seed + 7);
  std::vector<std::int32_t> perm;
  for (std::int32_t s = 0; s < num_slots; ++s) perm.push_back(s);
  for (std::size_t i = perm.size(); i > 1; --i) {
    std::swap(perm[i - 1], perm[static_cast<std::size_t>(rng.uniform(0, double(i)))]);
  }
  f.per_token.problem.verify = true;
  f.per_token.slots.clear();
  f.per_token.num_accepted.assign(static_cast<std::size_t>(B), 1);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < T; ++t) {
      f.per_token.slots.push_back(b % 4 == 3 ? -1 : perm[static_cast<std::size_t>(b * T + t)]);
    }
  }
  f.records = f.per_token;
  f.records.problem.records = true;
  f.records.num_accepted.clear();
  f.records.slots.clear();
  for (std::int64_t b = 0; b < B; ++b) {
    f.records.slots.push_back(f.per_token.slots[static_cast<std::size_t>(b * T)]);
  }
  return f;
}

// num_accepted in [1, T]: row 0 accepts 1, row 1 all T, the others at random; padding rows get a
// value no row could have (the commit must not read it).
std::vector<std::int32_t> random_accepted(const std::vector<std::int32_t>& slots, std::int64_t T,
                                          std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> na;
  for (std::size_t b = 0; b < slots.size(); ++b) {
    std::int32_t n = 1 + static_cast<std::int32_t>(rng.uniform(0, double(T)));
    if (b == 0) n = 1;
    if (b == 1) n = static_cast<std::int32_t>(T);
    na.push_back(slots[b] < 0 ? 999 : std::min<std::int32_t>(n, static_cast<std::int32_t>(T)));
  }
  return na;
}

// The fp64 recurrence (KDA.md §1) of row b's first n tokens from `start` ([H, V, K] values):
// the state after them ([H, V, K]) and every token's record ([n, H, 3D] as the operator lays
// them out, token-major).
struct RowReference {
  std::vector<double> state, records;
};

RowReference reference_row(const DecodeCase& d, std::int64_t b, std::int64_t n,
                           const double* start) {
  KdaCase c = d.tokens;
  c.problem.gate = d.problem.gate;
  c.problem.lower_bound = d.problem.lower_bound;
  const std::int64_t H = d.problem.num_heads, T = d.problem.tokens;
  RowReference r;
  r.state.assign(start, start + H * D * D);
  r.records.assign(static_cast<std::size_t>(n * H * kRecord), 0.0);
  auto at = [](const std::vector<std::uint16_t>& x, std::int64_t i) {
    return static_cast<double>(bf16_to_float(x[static_cast<std::size_t>(i)]));
  };
  for (std::int64_t h = 0; h < H; ++h) {
    double* S = r.state.data() + h * D * D;  // S^T: [V][K]
    const double a = std::exp(static_cast<double>(c.A_log[static_cast<std::size_t>(h)]));
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t row = (b * T + t) * H + h;
      double* rec = r.records.data() + (t * H + h) * kRecord;
      double kk = 0;
      for (std::int64_t i = 0; i < D; ++i) kk += at(c.k, row * D + i) * at(c.k, row * D + i);
      for (std::int64_t i = 0; i < D; ++i) {
        rec[i] = std::exp(log_decay(c, a, row * D + i, h * D + i));
        rec[D + i] = at(c.k, row * D + i) / std::sqrt(kk + 1e-6);
      }
      const double beta = 1.0 / (1.0 + std::exp(-at(c.beta, row)));
      for (std::int64_t v = 0; v < D; ++v) {
        double dot = 0;
        for (std::int64_t i = 0; i < D; ++i) {
          S[v * D + i] *= rec[i];
          dot += S[v * D + i] * rec[D + i];
        }
        rec[2 * D + v] = beta * (at(c.v, row * D + v) - dot);
        for (std::int64_t i = 0; i < D; ++i) S[v * D + i] += rec[2 * D + v] * rec[D + i];
      }
    }
  }
  return r;
}

std::size_t entry_bytes(const DecodeCase& d) {
  return static_cast<std::size_t>(d.problem.num_heads * D * D) * dtype_size(d.problem.state_dtype);
}

bool same_entry(const std::vector<unsigned char>& a, std::int64_t slot_a,
                const std::vector<unsigned char>& b, std::int64_t slot_b, std::size_t bytes) {
  return std::memcmp(a.data() + slot_a * bytes, b.data() + slot_b * bytes, bytes) == 0;
}

}  // namespace

KDA_MATRIX_CASE(
    "verify with records + commit equals the per-token-states verify (state and out, bit for bit) "
    "/ and the fp64 recurrence") {
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    for (const GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
      for (const std::int64_t T : {std::int64_t{4}, std::int64_t{8}}) {
        const std::string label = std::string(runner.name()) + " " + to_string(dt) + " " +
                                  to_string(gate) + " T=" + std::to_string(T);
        CAPTURE(label);
        const std::int64_t B = 5, H = 2;
        const TwoForms f = two_forms(
            B, T, H, dt, gate,
            300 + 10 * T + (dt == DType::kF32 ? 0 : 1) + (gate == GateMode::kSoftplus ? 0 : 5));
        const DecodeRun full = runner.decode(f.per_token);
        REQUIRE_MESSAGE(full.status.ok(), full.status.to_string());
        const RecordsRun rec = records_step(runner, f.records);
        REQUIRE_MESSAGE(rec.status.ok(), rec.status.to_string());
        CHECK(rec.guards_intact);
        CHECK(rec.device_status == 0);
        // The records form never writes the pool.
        CHECK(rec.pool == pool_bytes(f.records));
        // out: the same kernel arithmetic in both forms; padding rows untouched in both.
        CHECK(rec.out == full.out);
        const std::size_t row_out = static_cast<std::size_t>(T * H * D);
        CHECK(std::all_of(rec.out.begin() + 3 * row_out, rec.out.begin() + 4 * row_out,
                          [](std::uint16_t x) { return x == 0xFFFF; }));
        // Records: every token's of a row written, the padding row's untouched.
        const std::size_t row_rec = static_cast<std::size_t>(T * H * kRecord);
        for (std::int64_t b = 0; b < B; ++b) {
          const auto first = rec.records.begin() + b * row_rec, last = first + row_rec;
          if (b % 4 == 3) {
            CHECK(std::all_of(first, last, is_poison));
          } else {
            CHECK(std::none_of(first, last, [](float x) { return !std::isfinite(x); }));
          }
        }

        const std::vector<std::int32_t> na = random_accepted(f.records.slots, T, 77 + T);
        const CommitProblem cp = commit_problem(f.records.problem);
        const CommitRun got =
            commit(runner, cp, {rec.records}, {pool_bytes(f.records)}, f.records.slots, na);
        REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
        CHECK(got.guards_intact);
        CHECK(got.device_status == 0);
        const std::vector<unsigned char>& pool = got.pools[0];
        const std::size_t bytes = entry_bytes(f.records);
        const std::vector<unsigned char> before = pool_bytes(f.records);
        const std::vector<double> start = pool_values(before, dt);
        std::vector<double> got_states, ref_states, got_records, ref_records;
        for (std::int64_t b = 0; b < B; ++b) {
          const std::int32_t slot = f.records.slots[static_cast<std::size_t>(b)];
          if (slot < 0) continue;
          const std::int64_t n = na[static_cast<std::size_t>(b)];
          CAPTURE(b);
          CAPTURE(n);
          // The per-token form kept the state after token n - 1 in slots[b][n - 1].
          const std::int32_t kept = f.per_token.slots[static_cast<std::size_t>(b * T + n - 1)];
          const bool equal = same_entry(pool, slot, full.pool, kept, bytes);
          if (!equal) {
            const std::vector<double> all = pool_values(pool, dt),
                                      want = pool_values(full.pool, dt);
            const std::size_t e = bytes / dtype_size(dt);
            MESSAGE(label << " row " << b << ": commit vs per-token state rel error "
                          << rel_error(std::vector<double>(all.begin() + slot * e,
                                                           all.begin() + (slot + 1) * e),
                                       std::vector<double>(want.begin() + kept * e,
                                                           want.begin() + (kept + 1) * e)));
          }
          CHECK(equal);
          const RowReference ref = reference_row(f.records, b, n, start.data() + slot * H * D * D);
          const std::vector<double> values = pool_values(pool, dt);
          got_states.insert(got_states.end(), values.begin() + slot * H * D * D,
                            values.begin() + (slot + 1) * H * D * D);
          ref_states.insert(ref_states.end(), ref.state.begin(), ref.state.end());
          got_records.insert(got_records.end(), rec.records.begin() + b * row_rec,
                             rec.records.begin() + b * row_rec + n * H * kRecord);
          ref_records.insert(ref_records.end(), ref.records.begin(), ref.records.end());
        }
        // Every entry that is no row's committed slot is bit for bit as it was.
        for (std::int64_t s = 0; s < f.records.problem.num_slots; ++s) {
          if (std::find(f.records.slots.begin(), f.records.slots.end(), s) !=
              f.records.slots.end()) {
            continue;
          }
          CAPTURE(s);
          CHECK(same_entry(pool, s, before, s, bytes));
        }
        const double e_state = rel_error(got_states, ref_states);
        const double e_rec = rel_error(got_records, ref_records);
        MESSAGE(label << ": committed state vs fp64 " << e_state << ", records vs fp64 " << e_rec);
        const bool cpu = runner.backend() == Backend::kCpu;
        // bf16 pools: the start state is the same bf16 values, the end rounded once to bf16.
        CHECK(e_state <= (dt == DType::kBF16 ? 5e-3 : cpu ? 1e-5 : kGpuTol));
        CHECK(e_rec <= (cpu ? 1e-5 : kGpuTol));
      }
    }
  }
}

KDA_MATRIX_CASE(
    "commit: several layers in one call equal one call per layer, padding rows and "
    "their poisoned records and num_accepted touch nothing") {
  // 40 layers of 12 (row, head) pairs: on CUDA the call of all layers (480 heads) takes one block a
  // head and each call of one layer two (commit.cu: halves below two blocks a multiprocessor, on
  // devices of up to 240), so the two kernel shapes must agree bit for bit.
  const std::int64_t B = 6, T = 4, H = 2, layers = 40;
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    CAPTURE(std::string(to_string(dt)));
    std::vector<std::vector<float>> records;
    std::vector<std::vector<unsigned char>> pools;
    TwoForms f = two_forms(B, T, H, dt, GateMode::kSoftplus, 500);
    for (std::int64_t l = 0; l < layers; ++l) {
      TwoForms fl =
          two_forms(B, T, H, dt, GateMode::kSoftplus, 500 + 13 * static_cast<std::uint64_t>(l));
      fl.records.slots = f.records.slots;  // one slot list for every layer, as a model's
      const RecordsRun r = records_step(runner, fl.records);
      REQUIRE_MESSAGE(r.status.ok(), r.status.to_string());
      records.push_back(r.records);
      pools.push_back(pool_bytes(fl.records));
    }
    // Row 3 is padding (two_forms): poison its records in every layer with finite garbage, and
    // give it an impossible num_accepted.
    std::vector<std::int32_t> na = random_accepted(f.records.slots, T, 901);
    REQUIRE(f.records.slots[3] < 0);
    na[3] = -5;
    const std::size_t row_rec = static_cast<std::size_t>(T * H * kRecord);
    for (auto& r : records) std::fill(r.begin() + 3 * row_rec, r.begin() + 4 * row_rec, 1e30f);
    const CommitProblem cp = commit_problem(f.records.problem);
    const CommitRun all = commit(runner, cp, records, pools, f.records.slots, na);
    REQUIRE_MESSAGE(all.status.ok(), all.status.to_string());
    CHECK(all.guards_intact);
    CHECK(all.device_status == 0);
    const std::size_t bytes = entry_bytes(f.records);
    for (std::int64_t l = 0; l < layers; ++l) {
      CAPTURE(l);
      const CommitRun one = commit(runner, cp, {records[static_cast<std::size_t>(l)]},
                                   {pools[static_cast<std::size_t>(l)]}, f.records.slots, na);
      REQUIRE(one.status.ok());
      CHECK(one.pools[0] == all.pools[static_cast<std::size_t>(l)]);
      // Only the committed slots changed (and each did: its state took at least one record).
      for (std::int64_t s = 0; s < cp.num_slots; ++s) {
        const bool committed =
            std::find(f.records.slots.begin(), f.records.slots.end(), s) != f.records.slots.end();
        CAPTURE(s);
        CHECK(same_entry(all.pools[static_cast<std::size_t>(l)], s,
                         pools[static_cast<std::size_t>(l)], s, bytes) == !committed);
      }
    }
  }
}

// A commit's bad rows: the CPU refuses the call naming the row and writes nothing; CUDA skips the
// row (its state untouched), commits the others and reports the status bit.
KDA_MATRIX_CASE(
    "commit: num_accepted outside [1, tokens] or a slot past the pool is refused or "
    "reported") {
  const std::int64_t B = 3, T = 4, H = 1;
  TwoForms f = two_forms(B, T, H, DType::kF32, GateMode::kLowerBound, 700);
  const RecordsRun r = records_step(runner, f.records);
  REQUIRE(r.status.ok());
  const CommitProblem cp = commit_problem(f.records.problem);
  const std::vector<unsigned char> before = pool_bytes(f.records);
  const std::size_t bytes = entry_bytes(f.records);
  struct Bad {
    std::vector<std::int32_t> slots, na;
    std::string message;
    std::uint32_t bit;
  };
  const std::int32_t s0 = f.records.slots[0], s1 = f.records.slots[1], s2 = f.records.slots[2];
  const std::int32_t past = static_cast<std::int32_t>(cp.num_slots);
  const std::vector<Bad> cases = {
      {{s0, s1, s2},
       {2, 0, 1},
       "num_accepted[1] = 0 is outside [1, 4] (the verify step's tokens)",
       kDeviceStatusAccepted},
      {{s0, s1, s2},
       {2, 5, 1},
       "num_accepted[1] = 5 is outside [1, 4] (the verify step's tokens)",
       kDeviceStatusAccepted},
      {{s0, past, s2},
       {2, 3, 1},
       "slots[1] = " + std::to_string(past) + " is out of range (num_slots " +
           std::to_string(past) + ")",
       kDeviceStatusSlot},
  };
  for (const Bad& bad : cases) {
    CAPTURE(bad.message);
    const CommitRun got = commit(runner, cp, {r.records}, {before}, bad.slots, bad.na);
    CHECK(got.guards_intact);
    if (runner.backend() == Backend::kCpu) {
      CHECK(got.status.code() == StatusCode::kInvalidArgument);
      CHECK(got.status.message() == bad.message);
      CHECK(got.pools[0] == before);
      continue;
    }
    REQUIRE(got.status.ok());
    CHECK(got.device_status == bad.bit);
    CHECK(same_entry(got.pools[0], s1, before, s1, bytes));   // the bad row: skipped
    CHECK(!same_entry(got.pools[0], s0, before, s0, bytes));  // the others: committed
    CHECK(!same_entry(got.pools[0], s2, before, s2, bytes));
  }
  if (runner.backend() == Backend::kCpu) {
    const CommitRun dup = commit(runner, cp, {r.records}, {before}, {s0, s2, s2}, {1, 1, 1});
    CHECK(dup.status.message() == "slots[1] and slots[2] both name slot " + std::to_string(s2));
    CHECK(dup.pools[0] == before);
  }
}

KDA_CPU_CASE("records step and commit: argument errors name the field") {
  const TwoForms f = two_forms(2, 3, 1, DType::kF32, GateMode::kSoftplus, 800);
  DecodeProblem p = f.records.problem;
  std::vector<std::uint16_t> out(static_cast<std::size_t>(f.records.tokens.out_elems()));
  std::vector<float> records(static_cast<std::size_t>(2 * 3 * kRecord));
  std::vector<unsigned char> pool = pool_bytes(f.records);
  const std::vector<unsigned char> pool_before = pool;
  DecodeTensors t;
  t.q = f.records.tokens.q.data();
  t.k = f.records.tokens.k.data();
  t.v = f.records.tokens.v.data();
  t.g = f.records.tokens.g.data();
  t.beta = f.records.tokens.beta.data();
  t.A_log = f.records.tokens.A_log.data();
  t.dt_bias = f.records.tokens.dt_bias.data();
  t.slots = f.records.slots.data();
  t.state_pool = pool.data();
  t.out = out.data();
  t.records = records.data();
  REQUIRE(decode_cpu(p, t).ok());
  CHECK(pool == pool_before);

  auto expect = [](const Status& st, const std::string& text) {
    CAPTURE(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find(text) != std::string::npos);
  };
  DecodeTensors bad = t;
  bad.records = nullptr;
  expect(decode_cpu(p, bad), "records is null");
  const std::int32_t accepted[2] = {1, 1};
  bad = t;
  bad.num_accepted = accepted;
  expect(decode_cpu(p, bad), "num_accepted is set but DecodeProblem::records is true");
  DecodeProblem no_verify = p;
  no_verify.verify = false;
  expect(validate(no_verify), "records is set but verify is not");
  DecodeProblem plain = p;
  plain.records = plain.verify = false;
  expect(decode_cpu(plain, t), "records is set but DecodeProblem::records is false");
  bad = t;
  bad.records = reinterpret_cast<float*>(pool.data());  // records over the pool it reads
  expect(decode_cpu(p, bad), "records overlaps state_pool");
  // Rows may share a slot: the pool is only read.
  const std::vector<std::int32_t> shared = {f.records.slots[0], f.records.slots[0]};
  bad = t;
  bad.slots = shared.data();
  CHECK(decode_cpu(p, bad).ok());
  const std::vector<std::int32_t> past = {f.records.slots[0],
                                          static_cast<std::int32_t>(p.num_slots)};
  bad.slots = past.data();
  expect(decode_cpu(p, bad), "slots[1] = " + std::to_string(p.num_slots) + " is out of range");

  // The commit.
  const CommitProblem cp = commit_problem(p);
  const std::vector<std::int32_t> na = {1, 3};
  CommitLayer layer{records.data(), pool.data()};
  const std::int32_t* slots = f.records.slots.data();
  REQUIRE(commit_cpu(cp, &layer, 1, slots, na.data()).ok());
  CHECK(commit_cpu(cp, &layer, 0, slots, na.data()).ok());  // no layers: nothing to do
  expect(commit_cpu(cp, nullptr, 1, slots, na.data()), "layers is null but num_layers is 1");
  expect(commit_cpu(cp, &layer, kMaxCommitLayers + 1, slots, na.data()),
         "num_layers must be in [0, " + std::to_string(kMaxCommitLayers) + "] (got " +
             std::to_string(kMaxCommitLayers + 1) + ")");
  expect(commit_cpu(cp, &layer, -1, slots, na.data()), "num_layers must be in");
  CommitLayer no_records{nullptr, pool.data()};
  expect(commit_cpu(cp, &no_records, 1, slots, na.data()), "layers[0]: records is null");
  CommitLayer no_pool{records.data(), nullptr};
  expect(commit_cpu(cp, &no_pool, 1, slots, na.data()), "layers[0]: state_pool is null");
  expect(commit_cpu(cp, &layer, 1, nullptr, na.data()), "layers[0]: slots is null");
  expect(commit_cpu(cp, &layer, 1, slots, nullptr), "layers[0]: num_accepted is null");
  CommitLayer aliased{reinterpret_cast<const float*>(pool.data()), pool.data()};
  expect(commit_cpu(cp, &aliased, 1, slots, na.data()), "layers[0]: state_pool overlaps records");
  // Two layers on one pool, and a pool over another layer's records.
  std::vector<unsigned char> pool2 = pool;
  const CommitLayer two_on_one[2] = {layer, {records.data(), pool.data()}};
  expect(commit_cpu(cp, two_on_one, 2, slots, na.data()),
         "layers[0].state_pool overlaps layers[1].state_pool");
  const CommitLayer over_records[2] = {layer,
                                       {reinterpret_cast<const float*>(pool.data()), pool2.data()}};
  expect(commit_cpu(cp, over_records, 2, slots, na.data()),
         "layers[0].state_pool overlaps layers[1].records");
  // ... and over an earlier layer's records: every pair of layers, either order.
  const CommitLayer under_records[2] = {{reinterpret_cast<const float*>(pool2.data()), pool.data()},
                                        {records.data(), pool2.data()}};
  expect(commit_cpu(cp, under_records, 2, slots, na.data()),
         "layers[1].state_pool overlaps layers[0].records");
  CommitProblem bad_p = cp;
  bad_p.state_dtype = DType::kF16;
  expect(validate(bad_p), "state_dtype must be bf16 or f32 (got f16)");
  bad_p = cp;
  bad_p.tokens = kMaxDecodeTokens + 1;
  expect(validate(bad_p), "tokens must be in [1, 16]");
  bad_p = cp;
  bad_p.batch = -1;
  expect(validate(bad_p), "batch must be >= 0");
  bad_p = cp;
  bad_p.head_dim_k = 0;
  expect(validate(bad_p), "head_dim_k must be in");
  bad_p = cp;
  bad_p.num_slots = -2;
  expect(validate(bad_p), "num_slots must be >= 0");
  // CUDA needs K = V = 128 (and, without CUDA, the backend at all).
  bad_p = cp;
  bad_p.head_dim_v = 64;
  CHECK(can_implement(bad_p, Backend::kCuda).code() != StatusCode::kOk);
  CHECK(can_implement(cp, Backend::kCpu).ok());
}

KDA_CPU_CASE("commit: kMaxCommitLayers layers in one call, each equal to its own commit") {
  // Small heads (the CPU takes any size): K = 8, V = 4, one head, 2 rows of 2 tokens.
  CommitProblem p;
  p.batch = 2;
  p.tokens = 2;
  p.num_heads = 1;
  p.head_dim_k = 8;
  p.head_dim_v = 4;
  p.num_slots = 3;
  const std::int64_t rec_floats = p.batch * p.tokens * (2 * 8 + 4), pool_floats = 3 * 4 * 8;
  std::vector<std::vector<float>> records(kMaxCommitLayers), pools(kMaxCommitLayers);
  Rng rng(5);
  for (int l = 0; l < kMaxCommitLayers; ++l) {
    records[l].resize(static_cast<std::size_t>(rec_floats));
    pools[l].resize(static_cast<std::size_t>(pool_floats));
    for (float& x : records[l]) x = static_cast<float>(rng.uniform(0.2, 1.0));
    for (float& x : pools[l]) x = static_cast<float>(rng.normal());
  }
  const std::vector<std::int32_t> slots = {2, 0}, na = {2, 1};
  std::vector<std::vector<float>> each = pools, all = pools;
  std::vector<CommitLayer> layers;
  for (int l = 0; l < kMaxCommitLayers; ++l) {
    CommitLayer one{records[l].data(), each[l].data()};
    REQUIRE(commit_cpu(p, &one, 1, slots.data(), na.data()).ok());
    layers.push_back({records[l].data(), all[l].data()});
  }
  REQUIRE(commit_cpu(p, layers.data(), kMaxCommitLayers, slots.data(), na.data()).ok());
  CHECK(all == each);
  CHECK(all[kMaxCommitLayers - 1] != pools[kMaxCommitLayers - 1]);
  // By hand, layer 0, row 1 (slot 0, one record): row v of S^T becomes row * alpha + u[v] k^.
  const float* r = records[0].data() + 1 * p.tokens * (2 * 8 + 4);  // row 1, token 0
  for (int v = 0; v < 4; ++v) {
    for (int j = 0; j < 8; ++j) {
      const float want = pools[0][v * 8 + j] * r[j] + r[16 + v] * r[8 + j];
      CHECK(std::fabs(all[0][v * 8 + j] - want) <= 1e-6f * (1 + std::fabs(want)));
    }
  }
  layers.push_back(layers[0]);
  CHECK(commit_cpu(p, layers.data(), kMaxCommitLayers + 1, slots.data(), na.data()).code() ==
        StatusCode::kInvalidArgument);
  // fp64 accumulation agrees to fp32 rounding.
  std::vector<std::vector<float>> wide = pools;
  CommitLayer w{records[0].data(), wide[0].data()};
  CpuOptions opt;
  opt.fp64 = true;
  REQUIRE(commit_cpu(p, &w, 1, slots.data(), na.data(), opt).ok());
  CHECK(rel_error(wide[0], to_doubles(each[0])) <= 1e-6);
}

#ifdef KDA_HAVE_CUDA
// The records step and the commit inside one captured graph (neither allocates nor synchronizes)
// equal the eager calls bit for bit; host pointers and misaligned records are refused before
// anything is launched.
KDA_CUDA_CASE(
    "records step + commit: a captured graph equals the eager calls / bad pointers are "
    "refused") {
  const TwoForms f = two_forms(5, 4, 2, DType::kBF16, GateMode::kSoftplus, 950);
  const RecordsRun eager = records_step(cuda, f.records);
  REQUIRE(eager.status.ok());
  const std::vector<std::int32_t> na = random_accepted(f.records.slots, 4, 951);
  const CommitProblem cp = commit_problem(f.records.problem);
  const CommitRun eager_commit =
      commit(cuda, cp, {eager.records}, {pool_bytes(f.records)}, f.records.slots, na);
  REQUIRE(eager_commit.status.ok());

  DeviceCase d(f.records.tokens);
  DeviceBuffer slots = DeviceBuffer::from(f.records.slots), accepted = DeviceBuffer::from(na);
  DeviceBuffer pool = DeviceBuffer::from(pool_bytes(f.records));
  DeviceBuffer out(static_cast<std::size_t>(f.records.tokens.out_elems()) * 2);
  DeviceBuffer records(eager.records.size() * 4);
  DeviceBuffer status(4);
  out.fill(0xFF);
  records.fill(0xFF);
  status.fill(0);
  DecodeTensors t = d.decode_tensors();
  t.slots = static_cast<const std::int32_t*>(slots.get());
  t.state_pool = pool.get();
  t.out = out.get();
  t.records = static_cast<float*>(records.get());
  auto* word = static_cast<std::uint32_t*>(status.get());
  t.device_status = word;
  const CommitLayer layer{static_cast<const float*>(records.get()), pool.get()};
  const auto* s = static_cast<const std::int32_t*>(slots.get());
  const auto* a = static_cast<const std::int32_t*>(accepted.get());
  Stream stream;
  REQUIRE(stream.stream != nullptr);
  Graph g;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
  const Status st_decode = decode_cuda(f.records.problem, t, stream.stream);
  const Status st_commit = commit_cuda(cp, &layer, 1, s, a, word, stream.stream);
  CUDA_REQUIRE(cudaStreamEndCapture(stream.stream, &g.graph));
  REQUIRE_MESSAGE(st_decode.ok(), st_decode.to_string());
  REQUIRE_MESSAGE(st_commit.ok(), st_commit.to_string());
  CUDA_REQUIRE(cudaGraphInstantiate(&g.exec, g.graph, 0));
  CUDA_REQUIRE(cudaGraphLaunch(g.exec, stream.stream));
  CUDA_REQUIRE(cudaStreamSynchronize(stream.stream));
  CHECK(out.download<std::uint16_t>() == eager.out);
  // Bytes, not floats: padding rows' records keep the poison (NaN), which never compares equal.
  const std::vector<float> graph_records = records.download<float>();
  REQUIRE(graph_records.size() == eager.records.size());
  CHECK(std::memcmp(graph_records.data(), eager.records.data(), graph_records.size() * 4) == 0);
  CHECK(pool.download<unsigned char>() == eager_commit.pools[0]);
  CHECK(status.download<std::uint32_t>()[0] == 0);

  auto refused = [&](const CommitLayer& bad, const std::string& text) {
    const Status st = commit_cuda(cp, &bad, 1, s, a, word, nullptr);
    CAPTURE(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find(text) != std::string::npos);
  };
  refused({eager.records.data(), pool.get()}, "layers[0]: records");  // host memory
  refused({static_cast<const float*>(records.get()) + 1, pool.get()},
          "layers[0]: records must be 16-byte aligned for the CUDA commit");
  std::vector<std::int32_t> host_slots = f.records.slots;
  const Status st = commit_cuda(cp, &layer, 1, host_slots.data(), a, word, nullptr);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("slots") != std::string::npos);
}
#endif  // KDA_HAVE_CUDA

// The commit deferred into the next step (DecodeProblem::fold_batch): a step that folds a records
// step's accepted records into its rows' states first computes, bit for bit, what the commit
// followed by that step computes: out, the pool (a plain step) or the records and the folded
// states (a records step). The next step takes the records step's rows in another order, one more
// row that folds nothing (a slot the records step did not read) and a padding row whose fold
// entries are garbage.
KDA_MATRIX_CASE(
    "a step that folds a records step's accepted tokens equals the commit, then that step") {
  const std::int64_t B = 5, T = 4, H = 2;
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    for (const bool next_records : {false, true}) {
      const GateMode gate = next_records ? GateMode::kLowerBound : GateMode::kSoftplus;
      const std::string label = std::string(runner.name()) + " " + to_string(dt) +
                                (next_records ? " records step" : " plain step");
      CAPTURE(label);
      const TwoForms f = two_forms(B, T, H, dt, gate, 1100 + (dt == DType::kF32 ? 0 : 1));
      const RecordsRun first = records_step(runner, f.records);
      REQUIRE_MESSAGE(first.status.ok(), first.status.to_string());
      const std::vector<std::int32_t> na = random_accepted(f.records.slots, T, 1200);
      const std::vector<unsigned char> p0 = pool_bytes(f.records);
      const CommitRun committed = commit(runner, commit_problem(f.records.problem), {first.records},
                                         {p0}, f.records.slots, na);
      REQUIRE_MESSAGE(committed.status.ok(), committed.status.to_string());
      const std::vector<unsigned char>& p1 = committed.pools[0];

      // The next step: the records step's rows reversed (its padding row 3 included), then a row
      // on a slot nobody read.
      const std::int64_t B2 = B + 1, T2 = next_records ? 3 : 2;
      DecodeCase next = make_decode_case(B2, T2, H, f.records.problem.num_slots, dt, gate, 1300);
      next.problem.verify = next.problem.records = next_records;
      next.slots.clear();
      Fold fold;
      fold.batch = B;
      fold.tokens = T;
      fold.records = first.records;
      for (std::int64_t b = B - 1; b >= 0; --b) {
        const std::int32_t s = f.records.slots[static_cast<std::size_t>(b)];
        next.slots.push_back(s);
        fold.rows.push_back(s < 0 ? 12345 : static_cast<std::int32_t>(b));  // padding: not read
        fold.counts.push_back(s < 0 ? -7 : na[static_cast<std::size_t>(b)]);
      }
      std::int32_t fresh = 0;
      while (std::find(f.records.slots.begin(), f.records.slots.end(), fresh) !=
             f.records.slots.end()) {
        ++fresh;
      }
      next.slots.push_back(fresh);
      fold.rows.push_back(-1);
      fold.counts.push_back(0);

      const RecordsRun want = step(runner, next, p1, nullptr);
      REQUIRE_MESSAGE(want.status.ok(), want.status.to_string());
      const RecordsRun got = step(runner, next, p0, &fold);
      REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
      CHECK(got.guards_intact);
      CHECK(got.device_status == 0);
      CHECK(got.out == want.out);
      if (next_records) {
        // Bytes, not floats: the padding row's records are the poison (a NaN) in both.
        REQUIRE(got.records.size() == want.records.size());
        CHECK(std::memcmp(got.records.data(), want.records.data(), got.records.size() * 4) == 0);
        CHECK(got.pool == p1);  // the folded states stored, every other entry as it was
      } else {
        CHECK(got.pool == want.pool);
      }
      // The padding row (the records step's row 3, now row 1) wrote nothing.
      const std::size_t row_out = static_cast<std::size_t>(T2 * H * D);
      CHECK(std::all_of(got.out.begin() + row_out, got.out.begin() + 2 * row_out,
                        [](std::uint16_t x) { return x == 0xFFFF; }));
      // CUDA: the per-token-states, records and folding steps in 1, 2 or 4 blocks a head
      // (CudaOptions::decode_blocks_per_head) compute the same bits as the count by shape.
      if (runner.backend() == Backend::kCuda) {
        const auto same_bytes = [](const std::vector<float>& a, const std::vector<float>& b) {
          return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
        };
        const DecodeRun per_token = runner.decode(f.per_token);
        REQUIRE(per_token.status.ok());
        for (const int blocks : {1, 2, 4}) {
          CAPTURE(blocks);
          DecodeCase per_token_cut = f.per_token, first_cut = f.records, next_cut = next;
          per_token_cut.cuda.decode_blocks_per_head = first_cut.cuda.decode_blocks_per_head =
              next_cut.cuda.decode_blocks_per_head = blocks;
          const DecodeRun a = runner.decode(per_token_cut);
          REQUIRE(a.status.ok());
          CHECK(a.out == per_token.out);
          CHECK(a.pool == per_token.pool);
          const RecordsRun b = records_step(runner, first_cut);
          REQUIRE(b.status.ok());
          CHECK(b.out == first.out);
          CHECK(same_bytes(b.records, first.records));
          const RecordsRun c = step(runner, next_cut, p0, &fold);
          REQUIRE(c.status.ok());
          CHECK(c.device_status == 0);
          CHECK(c.out == got.out);
          CHECK(c.pool == got.pool);
          CHECK(same_bytes(c.records, got.records));
        }
      }
    }
  }
}

// A fold's bad rows: the CPU refuses the step naming the row and writes nothing; CUDA skips the
// row (out untouched, its state not folded nor stepped) and reports kDeviceStatusAccepted.
KDA_MATRIX_CASE("a fold row or count out of range is refused or reported") {
  const std::int64_t B = 3, T = 4, H = 1;
  const TwoForms f = two_forms(B, T, H, DType::kF32, GateMode::kSoftplus, 1400);
  const RecordsRun first = records_step(runner, f.records);
  REQUIRE(first.status.ok());
  DecodeCase next = make_decode_case(B, 1, H, f.records.problem.num_slots, DType::kF32,
                                     GateMode::kSoftplus, 1401);
  next.slots = f.records.slots;  // rows 0..2, none padding
  const std::vector<unsigned char> p0 = pool_bytes(f.records);
  const std::size_t bytes = entry_bytes(f.records);
  struct Bad {
    std::vector<std::int32_t> rows, counts;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {{0, 3, 2}, {1, 1, 1}, "fold_rows[1] = 3 is outside [0, 3)"},
      {{0, 1, 2}, {1, 5, 1}, "fold_counts[1] = 5 is outside [1, 4]"},
      {{0, 1, 2}, {1, 0, 1}, "fold_counts[1] = 0 is outside [1, 4]"},
  };
  for (const Bad& c : cases) {
    CAPTURE(c.message);
    Fold fold;
    fold.batch = B;
    fold.tokens = T;
    fold.records = first.records;
    fold.rows = c.rows;
    fold.counts = c.counts;
    const RecordsRun r = step(runner, next, p0, &fold);
    CHECK(r.guards_intact);
    if (runner.backend() == Backend::kCpu) {
      CHECK(r.status.code() == StatusCode::kInvalidArgument);
      CHECK(r.status.message().find(c.message) != std::string::npos);
      CHECK(r.pool == p0);
      CHECK(std::all_of(r.out.begin(), r.out.end(), [](std::uint16_t x) { return x == 0xFFFF; }));
    } else {
      REQUIRE_MESSAGE(r.status.ok(), r.status.to_string());
      CHECK(r.device_status == kDeviceStatusAccepted);
      const std::size_t row_out = static_cast<std::size_t>(H * D);
      CHECK(std::all_of(r.out.begin() + row_out, r.out.begin() + 2 * row_out,
                        [](std::uint16_t x) { return x == 0xFFFF; }));
      CHECK(same_entry(r.pool, next.slots[1], p0, next.slots[1], bytes));
      CHECK(!same_entry(r.pool, next.slots[0], p0, next.slots[0], bytes));
    }
  }
}

TEST_CASE(
    "a fold is refused on a per-token-states verify step, and its records may not be the step's "
    "[cpu]") {
  DecodeProblem p;
  p.batch = 2;
  p.tokens = 2;
  p.num_heads = 1;
  p.num_slots = 4;
  p.fold_batch = 2;
  p.fold_tokens = 4;
  p.verify = true;
  Status st = validate(p);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("per-token-states verify step") != std::string::npos);
  p.verify = false;
  p.fold_tokens = 17;
  st = validate(p);
  CHECK(st.message().find("fold_tokens must be in [1, 16]") != std::string::npos);
  p.fold_tokens = 4;
  p.fold_batch = -1;
  CHECK(validate(p).message().find("fold_batch must be >= 0") != std::string::npos);

  // A records step whose fold reads the region it writes.
  p.fold_batch = 2;
  p.verify = p.records = true;
  std::vector<std::uint16_t> q(2 * 2 * 128), v(2 * 2 * 128), beta(4), out(2 * 2 * 128);
  std::vector<float> A_log(1), dt_bias(128), pool(4 * 128 * 128), records(2 * 4 * 3 * 128);
  std::vector<std::int32_t> slots = {0, 1}, rows = {0, 1}, counts = {1, 1};
  DecodeTensors t;
  t.q = t.k = t.g = q.data();
  t.v = v.data();
  t.beta = beta.data();
  t.A_log = A_log.data();
  t.dt_bias = dt_bias.data();
  t.slots = slots.data();
  t.state_pool = pool.data();
  t.out = out.data();
  t.records = records.data();
  t.fold_records = records.data();
  t.fold_rows = rows.data();
  t.fold_counts = counts.data();
  st = validate(p, t);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("fold_records") != std::string::npos);
  // Without fold_rows.
  std::vector<float> other(records.size());
  t.fold_records = other.data();
  t.fold_rows = nullptr;
  st = validate(p, t);
  CHECK(st.message().find("fold_rows") != std::string::npos);
  t.fold_rows = rows.data();
  CHECK(validate(p, t).ok());
}

// A records step that folds stores its rows' folded states, so its rows' slots must be distinct,
// as a plain step's (without the fold it only reads the pool and rows may share a slot).
KDA_CPU_CASE("a records step that folds refuses two rows on one slot") {
  const std::int64_t B = 3, T = 4, H = 1;
  const TwoForms f = two_forms(B, T, H, DType::kF32, GateMode::kSoftplus, 1700);
  const RecordsRun first = records_step(cpu_runner(), f.records);
  REQUIRE(first.status.ok());
  DecodeCase next = make_decode_case(B, 2, H, f.records.problem.num_slots, DType::kF32,
                                     GateMode::kLowerBound, 1701);
  next.problem.verify = next.problem.records = true;
  const std::int32_t s0 = f.records.slots[0], s2 = f.records.slots[2];
  next.slots = {s0, s2, s2};
  Fold fold;
  fold.batch = B;
  fold.tokens = T;
  fold.records = first.records;
  fold.rows = {0, 1, 2};
  fold.counts = {1, 2, 1};
  const std::vector<unsigned char> p0 = pool_bytes(f.records);
  const RecordsRun r = step(cpu_runner(), next, p0, &fold);
  CHECK(r.status.code() == StatusCode::kInvalidArgument);
  CHECK(r.status.message() == "slots[1] and slots[2] both name slot " + std::to_string(s2));
  CHECK(r.guards_intact);
  CHECK(r.pool == p0);
  CHECK(std::all_of(r.out.begin(), r.out.end(), [](std::uint16_t x) { return x == 0xFFFF; }));
  const RecordsRun shared = step(cpu_runner(), next, p0, nullptr);
  CHECK_MESSAGE(shared.status.ok(), shared.status.to_string());
}

// CpuOptions::fp64 on an f32 pool: the fold stores the folded state rounded to f32, as the commit
// does, and the step goes on from that stored state, so a folding step equals the fp64 commit
// followed by the same step bit for bit (a plain step and a records step).
KDA_CPU_CASE(
    "under fp64 a step that folds into an f32 pool equals the fp64 commit, then that step") {
  const std::int64_t B = 5, T = 4, H = 2;
  CpuOptions fp64;
  fp64.fp64 = true;
  const Runner& cpu = cpu_runner();
  for (const bool next_records : {false, true}) {
    CAPTURE(next_records);
    const std::uint64_t seed = next_records ? 1610 : 1600;
    const TwoForms f = two_forms(B, T, H, DType::kF32, GateMode::kSoftplus, seed);
    const std::vector<unsigned char> p0 = pool_bytes(f.records);
    const RecordsRun first = step(cpu, f.records, p0, nullptr, fp64);
    REQUIRE_MESSAGE(first.status.ok(), first.status.to_string());
    const std::vector<std::int32_t> na = random_accepted(f.records.slots, T, seed + 1);
    const CommitRun committed = commit(cpu, commit_problem(f.records.problem), {first.records},
                                       {p0}, f.records.slots, na, fp64);
    REQUIRE_MESSAGE(committed.status.ok(), committed.status.to_string());
    const std::vector<unsigned char>& p1 = committed.pools[0];
    REQUIRE(p1 != p0);

    // The next step on the same slots, row b folding the records step's row b (padding: none).
    DecodeCase next = make_decode_case(B, 2, H, f.records.problem.num_slots, DType::kF32,
                                       GateMode::kSoftplus, seed + 2);
    next.problem.verify = next.problem.records = next_records;
    next.slots = f.records.slots;
    Fold fold;
    fold.batch = B;
    fold.tokens = T;
    fold.records = first.records;
    for (std::int64_t b = 0; b < B; ++b) {
      const bool padding = f.records.slots[static_cast<std::size_t>(b)] < 0;
      fold.rows.push_back(padding ? -1 : static_cast<std::int32_t>(b));
      fold.counts.push_back(padding ? 0 : na[static_cast<std::size_t>(b)]);
    }
    const RecordsRun want = step(cpu, next, p1, nullptr, fp64);
    REQUIRE_MESSAGE(want.status.ok(), want.status.to_string());
    const RecordsRun got = step(cpu, next, p0, &fold, fp64);
    REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
    CHECK(got.guards_intact);
    CHECK(got.out == want.out);
    if (next_records) {
      // Bytes, not floats: the padding row's records are the poison (a NaN) in both.
      REQUIRE(got.records.size() == want.records.size());
      CHECK(std::memcmp(got.records.data(), want.records.data(), got.records.size() * 4) == 0);
      CHECK(got.pool == p1);
    } else {
      CHECK(got.pool == want.pool);
    }
  }
}

// The commit works on a state row in pieces of 256 channels (a buffer on the stack): with K = 320
// a row has a second, partial piece. A records step and its commit still keep, bit for bit, the
// state the per-token-states verify step keeps (f32 pool, fp32), and touch no other entry.
KDA_CPU_CASE("records step + commit equal the per-token-states verify step with K = 320") {
  const std::int64_t B = 3, T = 3, H = 2, K = 320, V = 8, num_slots = B * T + 1;
  DecodeCase per_token =
      make_decode_case(B, T, H, num_slots, DType::kF32, GateMode::kSoftplus, 1800, K, V);
  per_token.problem.verify = true;
  per_token.slots.clear();
  // [B, T] slots instead of the shuffled ones: row b starts from slots[b][0] = b * T + 1 and keeps
  // the state after token t in b * T + t + 1; no row names slot 0.
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < T; ++t) {
      per_token.slots.push_back(static_cast<std::int32_t>(b * T + t + 1));
    }
  }
  per_token.num_accepted.assign(static_cast<std::size_t>(B), 1);
  const DecodeRun full = cpu_runner().decode(per_token);
  REQUIRE_MESSAGE(full.status.ok(), full.status.to_string());

  // The records step on each row's first slot, then the commit of its accepted tokens.
  DecodeCase records = per_token;
  records.problem.records = true;
  records.slots.clear();
  for (std::int64_t b = 0; b < B; ++b) {
    records.slots.push_back(per_token.slots[static_cast<std::size_t>(b * T)]);
  }
  const std::vector<std::int32_t>& slots = records.slots;
  const RecordsRun step_run = records_step(cpu_runner(), records);
  REQUIRE_MESSAGE(step_run.status.ok(), step_run.status.to_string());
  CHECK(step_run.guards_intact);
  CHECK(step_run.out == full.out);
  CHECK(all_finite(step_run.records));

  const std::vector<std::int32_t> na = {1, static_cast<std::int32_t>(T), 2};
  const CommitRun committed = commit(cpu_runner(), commit_problem(records.problem),
                                     {step_run.records}, {step_run.pool}, slots, na);
  REQUIRE_MESSAGE(committed.status.ok(), committed.status.to_string());
  CHECK(committed.guards_intact);
  const std::vector<unsigned char>& pool = committed.pools[0];
  const std::vector<unsigned char> before = pool_bytes(per_token);
  const std::size_t bytes = static_cast<std::size_t>(H * V * K) * 4;
  for (std::int64_t b = 0; b < B; ++b) {
    CAPTURE(b);
    const std::int64_t n = na[static_cast<std::size_t>(b)];
    const std::int32_t kept = per_token.slots[static_cast<std::size_t>(b * T + n - 1)];
    CHECK(same_entry(pool, slots[static_cast<std::size_t>(b)], full.pool, kept, bytes));
  }
  for (std::int64_t s = 0; s < num_slots; ++s) {
    if (std::find(slots.begin(), slots.end(), s) != slots.end()) continue;
    CAPTURE(s);
    CHECK(same_entry(pool, s, before, s, bytes));
  }
}
