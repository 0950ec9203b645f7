// Decode: a prefill followed by decode steps equals one longer prefill; multi-token steps equal
// single-token steps; slots not named and padding rows stay untouched and every backend's decode
// equals the CPU decode (cases.cpp decode_shapes); bad slots write nothing; the CPU decode's
// workspace, fp64 mode and thread counts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

namespace {

// A state pool [num_slots, H, V, K] in f32 or bf16, filled with seeded random values.
struct Pool {
  DType dtype = DType::kF32;
  std::int64_t per_slot = 0;  // H * V * K
  std::vector<float> f32;
  std::vector<std::uint16_t> bf16;

  Pool(DType d, std::int64_t num_slots, std::int64_t per_slot_elems, std::uint64_t seed)
      : dtype(d), per_slot(per_slot_elems) {
    Rng rng(seed);
    std::vector<float> values(static_cast<std::size_t>(num_slots * per_slot));
    for (auto& x : values) x = static_cast<float>(0.5 * rng.normal());
    if (dtype == DType::kF32) {
      f32 = values;
    } else {
      bf16 = to_bf16(values);
    }
  }
  void* data() { return dtype == DType::kF32 ? static_cast<void*>(f32.data()) : bf16.data(); }
  // Slot `slot` as floats.
  std::vector<float> slot(std::int64_t slot) const {
    const std::size_t begin = static_cast<std::size_t>(slot * per_slot);
    const std::size_t count = static_cast<std::size_t>(per_slot);
    if (dtype == DType::kF32) {
      return std::vector<float>(f32.begin() + begin, f32.begin() + begin + count);
    }
    std::vector<std::uint16_t> bits(bf16.begin() + begin, bf16.begin() + begin + count);
    return to_floats(bits);
  }
  // Writes `values` (per_slot floats) into slot `slot`, rounding to bf16 for a bf16 pool.
  void set_slot(std::int64_t slot, const float* values) {
    for (std::int64_t i = 0; i < per_slot; ++i) {
      const std::size_t at = static_cast<std::size_t>(slot * per_slot + i);
      if (dtype == DType::kF32) {
        f32[at] = values[i];
      } else {
        bf16[at] = float_to_bf16(values[i]);
      }
    }
  }
  bool same_bits(const Pool& other) const {
    return bf16 == other.bf16 && kda::test::same_bits(f32, other.f32);
  }
};

// One decode call on tokens [t0, t0 + tokens) of every row of the fixed-length case `c`, row b on
// slot slots[b]. Returns the status; *out receives [B, tokens, H, V] bf16 (poisoned first, or
// kept as given when it already has the right size).
Status decode_tokens(const KdaCase& c, std::int64_t t0, std::int64_t tokens,
                     const std::vector<std::int32_t>& slots, Pool* pool,
                     std::vector<std::uint16_t>* out, const CpuOptions& opt = {},
                     std::int64_t num_slots = -1, const Workspace* ws = nullptr) {
  const KdaCase step = split_tokens(c, t0, t0 + tokens, DType::kNone, {}, DType::kNone);
  DecodeProblem p;
  p.batch = c.problem.batch;
  p.tokens = tokens;
  p.num_heads = c.problem.num_heads;
  p.head_dim_k = c.problem.head_dim_k;
  p.head_dim_v = c.problem.head_dim_v;
  p.num_slots = num_slots >= 0
                    ? num_slots
                    : static_cast<std::int64_t>(
                          (pool->dtype == DType::kF32 ? pool->f32.size() : pool->bf16.size()) /
                          static_cast<std::size_t>(pool->per_slot));
  p.state_dtype = pool->dtype;
  p.gate = c.problem.gate;
  p.lower_bound = c.problem.lower_bound;
  p.scale = c.problem.scale;
  const std::size_t out_elems =
      static_cast<std::size_t>(p.batch * tokens * p.num_heads * p.head_dim_v);
  if (out->size() != out_elems) out->assign(out_elems, kPoisonBf16);
  DecodeTensors t;
  t.q = step.q.data();
  t.k = step.k.data();
  t.v = step.v.data();
  t.g = step.g.data();
  t.beta = step.beta.data();
  t.A_log = c.A_log.data();
  t.dt_bias = c.dt_bias.data();
  t.slots = slots.data();
  t.state_pool = pool->data();
  t.out = out->data();
  return ws != nullptr ? decode_cpu(p, t, *ws, opt) : decode_cpu(p, t, opt);
}

CaseOptions small_options(std::uint64_t seed) {
  CaseOptions o;
  o.batch = 3;
  o.seq_len = 12;
  o.heads = 2;
  o.head_dim_k = 32;
  o.head_dim_v = 16;
  o.initial_state_dtype = DType::kF32;
  o.seed = seed;
  return o;
}

// out [B, T, H, V] of a case, tokens [t0, t0 + n) of every row, as a [B, n, H, V] vector.
template <typename Element>
std::vector<Element> out_tokens(const KdaCase& c, const std::vector<Element>& out, std::int64_t t0,
                                std::int64_t n) {
  const std::int64_t row = c.problem.num_heads * c.problem.head_dim_v, T = c.problem.seq_len;
  std::vector<Element> part;
  for (std::int64_t b = 0; b < c.problem.batch; ++b) {
    const auto first = out.begin() + (b * T + t0) * row;
    part.insert(part.end(), first, first + n * row);
  }
  return part;
}

}  // namespace

KDA_CPU_CASE("prefill n tokens then m decode steps equals one prefill of n + m") {
  for (DType pool_dtype : {DType::kF32, DType::kBF16}) {
    for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
      CAPTURE(std::string(to_string(pool_dtype)));
      CAPTURE(std::string(to_string(gate)));
      CaseOptions o = small_options(3);
      o.gate = gate;
      const KdaCase whole = make_case(o);
      const std::int64_t n = 5, m = 7, T = 12;
      Outputs full;
      REQUIRE(run_cpu(whole, &full).ok());
      const Reference ref = reference_forward(whole);

      // Prefill n tokens, then move each row's state into its slot of a 5-slot pool.
      const KdaCase first =
          split_tokens(whole, 0, n, DType::kF32, whole.initial_state, DType::kF32);
      Outputs pre;
      REQUIRE(run_cpu(first, &pre).ok());
      const std::int64_t per_slot = o.heads * o.head_dim_v * o.head_dim_k;
      Pool pool(pool_dtype, 5, per_slot, 17);
      const std::vector<std::int32_t> slots = {3, 0, 4};
      for (std::int64_t b = 0; b < o.batch; ++b) {
        pool.set_slot(slots[static_cast<std::size_t>(b)], pre.final_f32.data() + b * per_slot);
      }
      const std::vector<float> untouched_slot1 = pool.slot(1), untouched_slot2 = pool.slot(2);

      std::vector<double> decoded_out(ref.out.size());
      std::vector<std::uint16_t> all_out(full.out.size());
      for (std::int64_t j = 0; j < m; ++j) {
        std::vector<std::uint16_t> out;
        REQUIRE(decode_tokens(whole, n + j, 1, slots, &pool, &out).ok());
        CHECK(all_finite(out));
        // Row b's token lands at [b, n + j] of the whole sequence's out.
        const std::size_t row = static_cast<std::size_t>(o.heads * o.head_dim_v);
        for (std::int64_t b = 0; b < o.batch; ++b) {
          std::copy(out.begin() + b * row, out.begin() + (b + 1) * row,
                    all_out.begin() + (b * T + n + j) * row);
        }
      }
      const std::vector<std::uint16_t> got = out_tokens(whole, all_out, n, m);
      const std::vector<std::uint16_t> want = out_tokens(whole, full.out, n, m);
      const std::vector<double> ref_part = out_tokens(whole, ref.out, n, m);
      CHECK(rel_error_bf16(got, to_doubles(want)) <= 5e-3);
      CHECK(rel_error_bf16(got, ref_part) <= 5e-3);
      std::vector<float> final_state;
      for (std::int64_t b = 0; b < o.batch; ++b) {
        const std::vector<float> s = pool.slot(slots[static_cast<std::size_t>(b)]);
        final_state.insert(final_state.end(), s.begin(), s.end());
      }
      CHECK(rel_error(final_state, to_doubles(full.final_f32)) <= 5e-3);
      CHECK(rel_error(final_state, ref.final_state) <= 5e-3);
      if (pool_dtype == DType::kF32) {
        // Same per-token step, fp32 state throughout: bit-identical to the one long prefill.
        CHECK(got == want);
        CHECK(final_state == full.final_f32);
      }
      CHECK(pool.slot(1) == untouched_slot1);  // slots not named: bitwise untouched
      CHECK(pool.slot(2) == untouched_slot2);
    }
  }
}

KDA_CPU_CASE("a 4-token step equals the same tokens one at a time") {
  for (DType pool_dtype : {DType::kF32, DType::kBF16}) {
    for (bool fp64 : {false, true}) {
      CAPTURE(std::string(to_string(pool_dtype)));
      CAPTURE(fp64);
      const KdaCase c = make_case(small_options(5));
      const std::int64_t per_slot = 2 * 16 * 32;
      const std::vector<std::int32_t> slots = {1, 2, 0};
      CpuOptions opt;
      opt.fp64 = fp64;
      Pool multi(pool_dtype, 3, per_slot, 23), single = multi;
      std::vector<std::uint16_t> out_multi;
      REQUIRE(decode_tokens(c, 2, 4, slots, &multi, &out_multi, opt).ok());
      std::vector<std::uint16_t> out_single(out_multi.size());
      const std::size_t row = 2 * 16;
      for (std::int64_t j = 0; j < 4; ++j) {
        std::vector<std::uint16_t> out;
        REQUIRE(decode_tokens(c, 2 + j, 1, slots, &single, &out, opt).ok());
        for (std::size_t b = 0; b < 3; ++b) {
          std::copy(out.begin() + b * row, out.begin() + (b + 1) * row,
                    out_single.begin() + (b * 4 + j) * row);
        }
      }
      if (pool_dtype == DType::kF32 && !fp64) {
        CHECK(out_multi == out_single);
        CHECK(multi.same_bits(single));
      } else {
        // bf16 pools round the state after every call; fp64 rounds it to f32 after every call.
        CHECK(rel_error_bf16(out_multi, to_doubles(out_single)) <= 5e-3);
        for (std::int64_t s = 0; s < 3; ++s) {
          CHECK(rel_error(multi.slot(s), to_doubles(single.slot(s))) <= 5e-3);
        }
      }
    }
  }
}

KDA_CPU_CASE("padding rows (negative slots) are skipped: out rows and all other slots untouched") {
  const KdaCase c = make_case(small_options(7));
  const std::int64_t per_slot = 2 * 16 * 32;
  Pool pool(DType::kF32, 4, per_slot, 29);
  const Pool before = pool;
  const std::vector<std::int32_t> slots = {-1, 2, -7};
  std::vector<std::uint16_t> out;
  REQUIRE(decode_tokens(c, 0, 3, slots, &pool, &out).ok());
  const std::size_t row_elems = 3 * 2 * 16;  // tokens * H * V of one batch row
  for (std::size_t i = 0; i < out.size(); ++i) {
    const bool padding = i < row_elems || i >= 2 * row_elems;
    if (padding) {
      CHECK(out[i] == kPoisonBf16);
    } else {
      CHECK(std::isfinite(bf16_to_float(out[i])));
    }
  }
  for (std::int64_t s : {0, 1, 3}) CHECK(pool.slot(s) == before.slot(s));
  CHECK(pool.slot(2) != before.slot(2));
}

KDA_CPU_CASE("bad slots and bad parameters are errors that write nothing") {
  KdaCase c = make_case(small_options(9));
  const std::int64_t per_slot = 2 * 16 * 32;
  Pool pool(DType::kBF16, 4, per_slot, 31);
  const Pool before = pool;
  auto expect_nothing_written = [&](const KdaCase& kc, const std::vector<std::int32_t>& slots,
                                    const std::string& field) {
    std::vector<std::uint16_t> out;
    const Status st = decode_tokens(kc, 0, 2, slots, &pool, &out);
    CAPTURE(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find(field) != std::string::npos);
    for (std::uint16_t x : out) CHECK(x == kPoisonBf16);
    CHECK(pool.same_bits(before));
  };
  expect_nothing_written(c, {0, 4, 1}, "slots[1] = 4");  // == num_slots
  expect_nothing_written(c, {0, 1, 1000}, "slots[2] = 1000");
  expect_nothing_written(c, {2, 1, 2}, "both name slot 2");  // duplicate
  expect_nothing_written(c, {-1, 3, 3}, "both name slot 3");
  KdaCase bad = c;
  bad.A_log[0] = std::numeric_limits<float>::infinity();
  expect_nothing_written(bad, {0, 1, 2}, "A_log[0]");
  bad = c;
  bad.dt_bias[40] = std::numeric_limits<float>::quiet_NaN();
  expect_nothing_written(bad, {0, 1, 2}, "dt_bias[1, 8]");
  // Duplicate negative (padding) slots are fine.
  std::vector<std::uint16_t> out;
  CHECK(decode_tokens(c, 0, 2, {-1, -1, 0}, &pool, &out).ok());
}

KDA_CPU_CASE("decode: empty batch / fp64 mode against the reference / thread counts") {
  SUBCASE("batch 0 is a no-op") {
    DecodeProblem p;
    p.batch = 0;
    p.num_heads = 1;
    p.head_dim_k = p.head_dim_v = 8;
    p.num_slots = 1;
    std::vector<float> params(8, 0.0f), pool(64, 1.0f);
    DecodeTensors t;
    t.A_log = params.data();
    t.dt_bias = params.data();
    t.state_pool = pool.data();
    CHECK(decode_cpu(p, t).ok());
    CHECK(pool == std::vector<float>(64, 1.0f));
  }
  SUBCASE("one 16-token step from zero state matches the fp64 reference") {
    CaseOptions o = small_options(13);
    o.seq_len = 16;
    o.initial_state_dtype = DType::kNone;
    o.head_dim_k = o.head_dim_v = 128;
    const KdaCase c = make_case(o);
    const Reference ref = reference_forward(c);
    for (bool fp64 : {false, true}) {
      CAPTURE(fp64);
      const std::int64_t per_slot = 2 * 128 * 128;
      Pool pool(DType::kF32, 3, per_slot, 37);
      std::fill(pool.f32.begin(), pool.f32.end(), 0.0f);
      CpuOptions opt;
      opt.fp64 = fp64;
      std::vector<std::uint16_t> out;
      REQUIRE(decode_tokens(c, 0, 16, {2, 1, 0}, &pool, &out, opt).ok());
      CHECK(rel_error_bf16(out, ref.out) <= 2.5e-3);  // [B, 16, H, V] is [B, T, H, V] here
      std::vector<float> states;
      for (std::int64_t s : {2, 1, 0}) {
        const std::vector<float> x = pool.slot(s);
        states.insert(states.end(), x.begin(), x.end());
      }
      CHECK(rel_error(states, ref.final_state) <= (fp64 ? 2e-7 : 1e-5));
    }
  }
  SUBCASE("1 and 2 threads are bitwise equal") {
    const KdaCase c = make_case(small_options(15));
    const std::int64_t per_slot = 2 * 16 * 32;
    Pool one(DType::kF32, 3, per_slot, 41), two = one;
    std::vector<std::uint16_t> out_one, out_two;
    CpuOptions opt;
    opt.num_threads = 1;
    REQUIRE(decode_tokens(c, 0, 3, {0, 2, 1}, &one, &out_one, opt).ok());
    opt.num_threads = 2;
    REQUIRE(decode_tokens(c, 0, 3, {0, 2, 1}, &two, &out_two, opt).ok());
    CHECK(out_one == out_two);
    CHECK(one.same_bits(two));
  }
}

KDA_CPU_CASE(
    "decode with a caller workspace: sized by decode_workspace_size / bitwise equal to the "
    "allocating call / too small writes nothing") {
  KdaCase c = make_case(small_options(21));  // B = 3 rows, H = 2, K = 32, V = 16
  const std::int64_t per_slot = c.problem.num_heads * c.problem.head_dim_v * c.problem.head_dim_k;
  const std::vector<std::int32_t> slots = {2, -1, 0};
  DecodeProblem p;  // what decode_tokens(c, 0, 2, slots, <5-slot f32 pool>, ...) runs
  p.batch = c.problem.batch;
  p.tokens = 2;
  p.num_heads = c.problem.num_heads;
  p.head_dim_k = c.problem.head_dim_k;
  p.head_dim_v = c.problem.head_dim_v;
  p.num_slots = 5;
  std::size_t need = 0;
  REQUIRE(decode_workspace_size(p, Backend::kCpu, &need).ok());
  CHECK(need > 0);
  std::size_t cuda_need = 1;
  REQUIRE(decode_workspace_size(p, Backend::kCuda, &cuda_need).ok());
  CHECK(cuda_need == 0);
  CHECK(decode_workspace_size(p, Backend::kCpu, nullptr).code() == StatusCode::kInvalidArgument);

  Pool a(DType::kF32, 5, per_slot, 3), b = a;
  std::vector<std::uint16_t> out_a, out_b;
  REQUIRE(decode_tokens(c, 0, 2, slots, &a, &out_a).ok());
  // A workspace at an odd address: decode_cpu aligns inside it (decode_workspace_size has the
  // slack).
  std::vector<unsigned char> bytes(need + 1, 0xCD);
  const Workspace ws{bytes.data() + 1, need};
  REQUIRE(decode_tokens(c, 0, 2, slots, &b, &out_b, {}, -1, &ws).ok());
  CHECK(out_a == out_b);
  CHECK(a.same_bits(b));

  Pool pool(DType::kF32, 5, per_slot, 3);
  const Pool before = pool;
  std::vector<std::uint16_t> out;
  const Workspace small{bytes.data(), need - 1};
  const Status st = decode_tokens(c, 0, 2, slots, &pool, &out, {}, -1, &small);
  CHECK(st.code() == StatusCode::kWorkspaceTooSmall);
  CHECK(st.message().find("the CPU decode needs " + std::to_string(need)) != std::string::npos);
  for (std::uint16_t x : out) CHECK(x == kPoisonBf16);
  CHECK(pool.same_bits(before));
  const Workspace null_ws{nullptr, need};
  CHECK(decode_tokens(c, 0, 2, slots, &pool, &out, {}, -1, &null_ws).code() ==
        StatusCode::kInvalidArgument);
}

KDA_MATRIX_CASE(
    "decode matches the CPU decode / and unnamed slots and padding rows stay untouched") {
  for (const DecodeShape& shape : decode_shapes()) {
    if (!runs_on(shape.backends, runner)) continue;
    const std::int64_t B = shape.batch, tokens = shape.tokens, H = shape.heads;
    const std::int64_t slots = shape.num_slots;
    const DType dt = shape.state;
    const DecodeCase d = make_decode_case(B, tokens, H, slots, dt, shape.gate, shape.seed);
    const std::string label = shape.name();
    const DecodeRun got = runner.decode(d);
    REQUIRE_MESSAGE(got.status.ok(), label << ": " << got.status.to_string());
    CHECK_MESSAGE(got.guards_intact, label << ": guard bytes changed");
    const std::size_t row = static_cast<std::size_t>(tokens * H * 128);
    if (runner.backend() != Backend::kCpu) {
      const DecodeRun cpu = cpu_runner().decode(d);
      REQUIRE_MESSAGE(cpu.status.ok(), cpu.status.to_string());
      const double e_pool = rel_error(pool_values(got.pool, dt), pool_values(cpu.pool, dt));
      // Padding rows keep their poison on both backends: compare the written rows only.
      std::vector<double> g_rows, c_rows;
      for (std::int64_t b = 0; b < B; ++b) {
        if (d.slots[static_cast<std::size_t>(b)] < 0) continue;
        for (std::size_t i = b * row; i < (b + 1) * row; ++i) {
          g_rows.push_back(bf16_to_float(got.out[i]));
          c_rows.push_back(bf16_to_float(cpu.out[i]));
        }
      }
      const double e_out = rel_error(g_rows, c_rows);
      std::printf("%-40s out %.2e  pool %.2e\n", label.c_str(), e_out, e_pool);
      CHECK(e_pool <= kGpuTol);
      CHECK(e_out <= kGpuTol);
    }
    // Slots not named in the step are bitwise what they were.
    const std::vector<unsigned char> before = pool_bytes(d);
    const std::size_t slot_bytes = before.size() / static_cast<std::size_t>(slots);
    std::vector<bool> named(static_cast<std::size_t>(slots), false);
    for (auto s : d.slots) {
      if (s >= 0) named[static_cast<std::size_t>(s)] = true;
    }
    for (std::int64_t s = 0; s < slots; ++s) {
      if (named[static_cast<std::size_t>(s)]) continue;
      CHECK_MESSAGE(std::memcmp(got.pool.data() + s * slot_bytes, before.data() + s * slot_bytes,
                                slot_bytes) == 0,
                    label << ": slot " << s << " changed");
    }
    // Padding rows of out keep their poison; named rows are all written.
    for (std::int64_t b = 0; b < B; ++b) {
      const bool pad = d.slots[static_cast<std::size_t>(b)] < 0;
      bool poisoned = true, finite = true;
      for (std::size_t i = b * row; i < (b + 1) * row; ++i) {
        poisoned = poisoned && got.out[i] == 0xFFFF;
        finite = finite && std::isfinite(bf16_to_float(got.out[i]));
      }
      if (pad) {
        CHECK_MESSAGE(poisoned, label << ": padding row " << b << " written");
      } else {
        CHECK_MESSAGE(finite, label << ": row " << b << " not fully written");
      }
    }
  }
}

KDA_CUDA_CASE("prefill n tokens then m decode steps equals one prefill of n + m") {
  const std::int64_t n = 77, m = 5, H = 4;
  CaseOptions o = cuda_options(H, 2000);
  o.batch = 3;
  o.seq_len = n + m;
  const KdaCase whole = make_case(o);
  const PrefillRun full = cuda.prefill(whole);
  REQUIRE(full.status.ok());
  const KdaCase head = split_tokens(whole, 0, n, DType::kF32, whole.initial_state, DType::kF32);
  const PrefillRun pre = cuda.prefill(head);
  REQUIRE(pre.status.ok());
  // The prefill's final states become slots 0..2 of a pool; decode one token at a time.
  std::vector<float> pool = pre.out.final_f32;
  const std::int64_t row = H * 128;
  std::vector<double> stitched_tail;
  for (std::int64_t step = 0; step < m; ++step) {
    const KdaCase tok = split_tokens(whole, n + step, n + step + 1, DType::kNone, {}, DType::kNone);
    DecodeCase d;
    d.tokens = tok;
    d.problem.batch = 3;
    d.problem.tokens = 1;
    d.problem.num_heads = H;
    d.problem.num_slots = 3;
    d.problem.state_dtype = DType::kF32;
    d.problem.gate = whole.problem.gate;
    d.slots = {0, 1, 2};
    d.pool = pool;
    const DecodeRun r = cuda.decode(d);
    REQUIRE(r.status.ok());
    REQUIRE(r.guards_intact);
    std::vector<double> pv = pool_values(r.pool, DType::kF32);
    pool.assign(pv.begin(), pv.end());
    for (std::int64_t b = 0; b < 3; ++b) {
      for (std::int64_t i = 0; i < row; ++i) {
        stitched_tail.push_back(bf16_to_float(r.out[b * row + i]));
      }
    }
  }
  // The whole prefill's last m tokens of every row, in the same (step, row) order.
  std::vector<double> ref_tail;
  for (std::int64_t step = 0; step < m; ++step) {
    for (std::int64_t b = 0; b < 3; ++b) {
      for (std::int64_t i = 0; i < row; ++i) {
        ref_tail.push_back(bf16_to_float(full.out.out[(b * (n + m) + n + step) * row + i]));
      }
    }
  }
  const double e_out = rel_error(stitched_tail, ref_tail);
  const double e_state = rel_error(to_doubles(pool), full.out.final_state());
  std::printf("prefill %lld + %lld decode steps vs prefill %lld: out %.2e state %.2e\n",
              (long long)n, (long long)m, (long long)(n + m), e_out, e_state);
  CHECK(e_out <= kGpuTol);
  CHECK(e_state <= kGpuTol);
}

// A plain step's 8 warps a (sequence, head) run as 1, 2 or 4 blocks (CudaOptions::
// decode_blocks_per_head; 0 chooses by shape). The warps never meet, so every count must give the
// same bits: out, the pool, padding rows (every fourth) left poisoned and their slots untouched,
// and against the CPU within the usual tolerance. A count other than 0, 1, 2 or 4 is refused before
// anything is written.
KDA_CUDA_CASE("decode: 1, 2 or 4 blocks a head give the same bits") {
  struct Shape {
    std::int64_t B, tokens, H;
    DType state;
    GateMode gate;
  };
  const Shape shapes[] = {{1, 1, 3, DType::kF32, GateMode::kSoftplus},
                          {9, 1, 4, DType::kF32, GateMode::kLowerBound},
                          {6, 3, 2, DType::kF32, GateMode::kSoftplus},
                          {7, 1, 5, DType::kBF16, GateMode::kSoftplus},
                          {5, 2, 4, DType::kBF16, GateMode::kLowerBound}};
  std::uint64_t seed = 4200;
  for (const Shape& s : shapes) {
    DecodeCase d = make_decode_case(s.B, s.tokens, s.H, s.B + 3, s.state, s.gate, ++seed);
    const std::string label = "B " + std::to_string(s.B) + " T " + std::to_string(s.tokens) +
                              " H " + std::to_string(s.H) +
                              (s.state == DType::kF32 ? " f32" : " bf16");
    const DecodeRun cpu = cpu_runner().decode(d);
    REQUIRE(cpu.status.ok());
    DecodeRun first;
    for (const int blocks : {1, 2, 4, 0}) {
      d.cuda.decode_blocks_per_head = blocks;
      const DecodeRun r = cuda.decode(d);
      REQUIRE_MESSAGE(r.status.ok(), label << ", " << blocks << ": " << r.status.to_string());
      CHECK_MESSAGE(r.guards_intact, label << ", " << blocks << ": guard bytes changed");
      CHECK(r.device_status == 0);
      if (blocks == 1) {
        first = r;
        CHECK(rel_error(pool_values(r.pool, s.state), pool_values(cpu.pool, s.state)) <= kGpuTol);
        std::vector<double> g_rows, c_rows;
        const std::size_t row = static_cast<std::size_t>(s.tokens * s.H * 128);
        for (std::int64_t b = 0; b < s.B; ++b) {
          const bool pad = d.slots[static_cast<std::size_t>(b)] < 0;
          for (std::size_t i = b * row; i < (b + 1) * row; ++i) {
            if (pad) {
              CHECK(r.out[i] == 0xFFFF);
            } else {
              g_rows.push_back(bf16_to_float(r.out[i]));
              c_rows.push_back(bf16_to_float(cpu.out[i]));
            }
          }
        }
        CHECK(rel_error(g_rows, c_rows) <= kGpuTol);
        continue;
      }
      CHECK_MESSAGE(r.out == first.out, label << ": out with " << blocks << " blocks a head");
      CHECK_MESSAGE(r.pool == first.pool, label << ": pool with " << blocks << " blocks a head");
    }
  }
  DecodeCase d = make_decode_case(3, 1, 2, 4, DType::kF32, GateMode::kSoftplus, 4300);
  for (const int bad : {3, -1, 8}) {
    d.cuda.decode_blocks_per_head = bad;
    const DecodeRun r = cuda.decode(d);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK(r.status.message().find("decode_blocks_per_head") != std::string::npos);
    CHECK(r.pool == pool_bytes(d));
    for (const std::uint16_t x : r.out) CHECK(x == 0xFFFF);
  }
  // Bad metadata only the device sees, at every count: a slot past the pool is skipped and
  // reported (kDeviceStatusSlot, from one block of the head), its out left poisoned; the other
  // rows the same bits whatever the count.
  DecodeCase bad = make_decode_case(6, 1, 3, 9, DType::kF32, GateMode::kSoftplus, 4400);
  bad.slots[2] = 9 + 4;
  DecodeRun first_bad;
  for (const int blocks : {1, 2, 4}) {
    CAPTURE(blocks);
    bad.cuda.decode_blocks_per_head = blocks;
    const DecodeRun r = cuda.decode(bad);
    REQUIRE(r.status.ok());
    CHECK(r.device_status == kDeviceStatusSlot);
    const std::size_t row = 3 * 128;
    for (std::size_t i = 2 * row; i < 3 * row; ++i) CHECK(r.out[i] == 0xFFFF);
    if (blocks == 1) {
      first_bad = r;
    } else {
      CHECK(r.out == first_bad.out);
      CHECK(r.pool == first_bad.pool);
    }
  }
}

// The contract asks q, k, g and a bf16 state pool to be 8-byte aligned; the bf16-state kernel's
// wide lane layout loads 16 bytes, so such pointers must take the narrow one (decode_kernel.cuh,
// decode_vec) and give the same values as the aligned run (up to summation order).
KDA_CUDA_CASE("decode: 8-byte aligned q/k/g and bf16 pool match the aligned run") {
  const DecodeCase d = make_decode_case(5, 2, 4, 12, DType::kBF16, GateMode::kSoftplus, 3100);
  const DecodeRun aligned = cuda.decode(d);
  REQUIRE(aligned.status.ok());
  // Device copies that start 8 bytes past a 16-byte boundary (DeviceBuffer's are 256-aligned);
  // the 8 bytes before them hold a pattern (initialized, so that compute-sanitizer's initcheck does
  // not flag the download below, and checked: decode must not write there).
  constexpr unsigned char kLead = 0x5A;
  auto shifted = [](const void* host, std::size_t bytes) {
    auto b = std::make_unique<DeviceBuffer>(bytes + 8);
    b->fill(kLead);
    REQUIRE(memcpy_to_device(static_cast<unsigned char*>(b->get()) + 8, host, bytes).ok());
    return b;
  };
  const KdaCase& c = d.tokens;
  const std::vector<unsigned char> pool_in = pool_bytes(d);
  auto q = shifted(c.q.data(), c.q.size() * 2), k = shifted(c.k.data(), c.k.size() * 2),
       g = shifted(c.g.data(), c.g.size() * 2), pool = shifted(pool_in.data(), pool_in.size());
  DeviceCase dc(c);
  DeviceBuffer slots = DeviceBuffer::from(d.slots);
  DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2);
  out.fill(0xFF);
  DecodeTensors t = dc.decode_tensors();
  auto at8 = [](const std::unique_ptr<DeviceBuffer>& b) {
    return static_cast<unsigned char*>(b->get()) + 8;
  };
  t.q = at8(q);
  t.k = at8(k);
  t.g = at8(g);
  t.state_pool = at8(pool);
  t.slots = static_cast<const std::int32_t*>(slots.get());
  t.out = out.get();
  REQUIRE(decode_cuda(d.problem, t, nullptr).ok());
  REQUIRE(stream_synchronize(nullptr).ok());
  const std::vector<unsigned char> pool_all = pool->download<unsigned char>();
  const std::vector<unsigned char> pool_out(pool_all.begin() + 8, pool_all.end());
  CHECK(pool->guards_intact());
  for (int i = 0; i < 8; ++i) CHECK(pool_all[static_cast<std::size_t>(i)] == kLead);
  const std::vector<std::uint16_t> o = out.download<std::uint16_t>();
  std::vector<std::uint16_t> o_rows, a_rows;  // rows of sequences with a slot (others: padding)
  const std::int64_t row = d.problem.num_heads * 128;
  for (std::int64_t b = 0; b < d.problem.batch; ++b) {
    if (d.slots[static_cast<std::size_t>(b)] < 0) continue;
    for (std::int64_t i = b * d.problem.tokens * row; i < (b + 1) * d.problem.tokens * row; ++i) {
      o_rows.push_back(o[static_cast<std::size_t>(i)]);
      a_rows.push_back(aligned.out[static_cast<std::size_t>(i)]);
    }
  }
  REQUIRE(!o_rows.empty());
  const double e_out = rel_error_bf16(o_rows, to_doubles(a_rows));
  const double e_pool =
      rel_error(pool_values(pool_out, DType::kBF16), pool_values(aligned.pool, DType::kBF16));
  std::printf("decode, 8-byte aligned q/k/g/pool vs aligned: out %.2e  pool %.2e\n", e_out, e_pool);
  CHECK(e_out <= kGpuTol);
  CHECK(e_pool <= kGpuTol);
}

// Speculative verify (DecodeProblem::verify): each row starts from the state in its slot at
// num_accepted - 1 and keeps the state after each of its tokens in that token's slot (a negative
// entry: not kept). The reference is the CPU's plain decode one token at a time, each row on a
// working slot of its own, its state copied out after every token. Rows: accepted 1 of 5; accepted
// 4 with its last state not kept; padding (the start entry negative: nothing read or written, its
// out untouched); accepted 5 of 5 on scattered slots.
KDA_MATRIX_CASE("a verify step keeps the state after every token, from the last accepted one") {
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    const std::string state = to_string(dt);
    CAPTURE(state);
    const std::int64_t B = 4, T = 5, H = 2, num_slots = 24, per_slot = H * 128 * 128;
    DecodeCase d =
        make_decode_case(B, T, H, num_slots, dt, GateMode::kSoftplus, dt == DType::kF32 ? 91 : 92);
    d.problem.verify = true;
    d.slots = {3, 9, 1, 14, 20, 6, 7, 8, 2, -1, 11, -1, 12, 13, 15, 23, 0, 17, 5, 4};
    d.num_accepted = {1, 4, 2, 5};
    const DecodeRun got = runner.decode(d);
    REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
    CHECK(got.guards_intact);
    CHECK(got.device_status == 0);

    Pool work(dt, B, per_slot, 0);
    std::vector<std::int32_t> rows(static_cast<std::size_t>(B));
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int32_t start = d.slots[static_cast<std::size_t>(b * T + d.num_accepted[b] - 1)];
      rows[static_cast<std::size_t>(b)] = start < 0 ? -1 : static_cast<std::int32_t>(b);
      if (start >= 0) work.set_slot(b, d.pool.data() + start * per_slot);
    }
    std::vector<double> want_pool = pool_values(pool_bytes(d), dt);
    const std::size_t row_out = static_cast<std::size_t>(H * 128);
    std::vector<std::uint16_t> want_out(static_cast<std::size_t>(B * T) * row_out, 0xFFFF);
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<std::uint16_t> out;
      REQUIRE(decode_tokens(d.tokens, t, 1, rows, &work, &out).ok());
      for (std::int64_t b = 0; b < B; ++b) {
        if (rows[static_cast<std::size_t>(b)] < 0) continue;
        std::copy(out.begin() + b * row_out, out.begin() + (b + 1) * row_out,
                  want_out.begin() + (b * T + t) * row_out);
        const std::int32_t keep = d.slots[static_cast<std::size_t>(b * T + t)];
        if (keep < 0) continue;
        const std::vector<float> s = work.slot(b);
        std::copy(s.begin(), s.end(), want_pool.begin() + keep * per_slot);
      }
    }
    // A bf16 pool rounds the reference's state after every token, the verify step's only where it
    // keeps it: they differ by rounding there. An f32 pool on the CPU: the same operations.
    const double tolerance = dt == DType::kBF16                  ? 1e-2
                             : runner.backend() == Backend::kCpu ? 1e-6
                                                                 : kGpuTol;
    const double e_pool = rel_error(pool_values(got.pool, dt), want_pool);
    std::vector<double> g_rows, w_rows;
    for (std::size_t i = 0; i < want_out.size(); ++i) {
      if (want_out[i] == 0xFFFF) {
        CHECK(got.out[i] == 0xFFFF);  // the padding row's out is left untouched
        continue;
      }
      g_rows.push_back(bf16_to_float(got.out[i]));
      w_rows.push_back(bf16_to_float(want_out[i]));
    }
    const double e_out = rel_error(g_rows, w_rows);
    MESSAGE(std::string(runner.name())
            << " verify, " << state << " pool: out " << e_out << ", pool " << e_pool);
    CHECK(e_pool <= tolerance);
    CHECK(e_out <= tolerance);
    // The padding row's slots and the slots no row names are bit for bit as they were.
    const std::vector<unsigned char> before = pool_bytes(d);
    const std::size_t slot_bytes = before.size() / static_cast<std::size_t>(num_slots);
    for (const std::int32_t s : {11, 12, 13, 15, 10, 16, 18, 19, 21, 22}) {
      CAPTURE(s);
      CHECK(std::memcmp(got.pool.data() + s * slot_bytes, before.data() + s * slot_bytes,
                        slot_bytes) == 0);
    }
  }
}

// A num_accepted outside [1, tokens]: the CPU refuses the step and writes nothing; CUDA skips that
// row (its out and slots untouched), runs the others and reports kDeviceStatusAccepted.
KDA_MATRIX_CASE("a verify step's num_accepted outside [1, tokens] is refused or reported") {
  DecodeCase d = make_decode_case(2, 3, 2, 8, DType::kF32, GateMode::kLowerBound, 93);
  d.problem.verify = true;
  d.slots = {0, 1, 2, 3, 4, 5};
  for (const std::int32_t bad : {0, 4, -1}) {
    CAPTURE(bad);
    d.num_accepted = {2, bad};
    const DecodeRun got = runner.decode(d);
    CHECK(got.guards_intact);
    const std::vector<unsigned char> before = pool_bytes(d);
    const std::size_t slot_bytes = before.size() / 8;
    if (runner.backend() == Backend::kCpu) {
      CHECK(got.status.code() == StatusCode::kInvalidArgument);
      CHECK(got.status.message() ==
            "num_accepted[1] = " + std::to_string(bad) + " is outside [1, 3] (the step's tokens)");
      CHECK(got.pool == before);
      CHECK(
          std::all_of(got.out.begin(), got.out.end(), [](std::uint16_t x) { return x == 0xFFFF; }));
      continue;
    }
    REQUIRE(got.status.ok());
    CHECK(got.device_status == kDeviceStatusAccepted);
    CHECK(describe_device_status(got.device_status).message().find("num_accepted") !=
          std::string::npos);
    for (std::size_t s = 3; s < 8; ++s) {  // row 1's slots 3..5 and the unnamed ones
      CAPTURE(s);
      CHECK(std::memcmp(got.pool.data() + s * slot_bytes, before.data() + s * slot_bytes,
                        slot_bytes) == 0);
    }
    const std::size_t row = 3 * 2 * 128;
    CHECK(std::all_of(got.out.begin() + row, got.out.end(),
                      [](std::uint16_t x) { return x == 0xFFFF; }));
    CHECK(std::none_of(got.out.begin(), got.out.begin() + row,
                       [](std::uint16_t x) { return x == 0xFFFF; }));
  }
}
