// The prefill through state slot indices (Problem::num_state_slots): reversed, strided and padded
// slot lists equal the contiguous run bitwise and unnamed pool entries keep their guards (every
// backend, cases.cpp slot_shapes); chained calls on the same slots equal one call; a slot outside
// the pool (CUDA: reported through the device status word, run as padding); bad slot lists refused
// before anything is written; the slot fields' validation.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

KDA_MATRIX_CASE("prefill through state slots equals the contiguous run bitwise") {
  for (const SlotShape& shape : slot_shapes()) {
    if (!runs_on(shape.backends, runner)) continue;
    const KdaCase c = make_case(shape.options);
    const DType state = shape.options.final_state_dtype;
    for (const auto& [name, slots] : slot_lists(c.num_seqs())) {
      const std::string label = shape.name + " " + name;
      const SlotCase sc = make_slot_case(c, slots, 2 * c.num_seqs() + 3);
      // Padded sequences start from zero in sc.contiguous: the reference run starts there too.
      const PrefillRun ref = runner.prefill(sc.contiguous);
      REQUIRE_MESSAGE(ref.status.ok(), label << ": " << ref.status.to_string());
      const void* fin = state == DType::kF32 ? static_cast<const void*>(ref.out.final_f32.data())
                                             : static_cast<const void*>(ref.out.final_bf16.data());
      const PooledRun got = runner.prefill_pooled(sc);
      REQUIRE_MESSAGE(got.status.ok(), label << ": " << got.status.to_string());
      CHECK(got.device_status == 0u);
      CHECK_MESSAGE(got.guards_intact, label << ": guard bytes changed");
      check_pooled_equals_contiguous(sc, got.out, got.pool, ref.out.out, fin, label);
    }
  }
}

KDA_MATRIX_CASE("prefill through state slots: two chained calls equal one") {
  for (const SplitCase& split : pooled_split_cases()) {
    if (!runs_on(split.backends, runner)) continue;
    CAPTURE(split.name);
    const KdaCase whole = make_case(split.options);
    const std::int64_t T = whole.problem.seq_len, cut = split.cuts.at(0);
    const std::vector<std::int32_t> slots = {4, 0, 2};
    const PooledRun one = runner.prefill_pooled(make_slot_case(whole, slots, 6));
    REQUIRE(one.status.ok());
    // The same tokens in two calls [0, cut) and [cut, T), the pool carried between them.
    const KdaCase first =
        split_tokens(whole, 0, cut, DType::kF32, whole.initial_state, DType::kF32);
    const KdaCase second =
        split_tokens(whole, cut, T, DType::kF32, whole.initial_state, DType::kF32);
    const PooledRun a = runner.prefill_pooled(make_slot_case(first, slots, 6));
    REQUIRE(a.status.ok());
    SlotCase sb = make_slot_case(second, slots, 6);
    sb.pool = a.pool;  // continue from the first call's pool
    const PooledRun b = runner.prefill_pooled(sb);
    REQUIRE(b.status.ok());
    if (split.tol == 0.0) {  // bitwise, out token by token too
      CHECK(b.pool == one.pool);
      const std::size_t row =
          static_cast<std::size_t>(whole.problem.num_heads * whole.problem.head_dim_v);
      for (std::int64_t s = 0; s < whole.problem.batch; ++s) {
        for (std::int64_t t = 0; t < T; ++t) {
          const std::uint16_t* got =
              t < cut ? &a.out[(s * cut + t) * row] : &b.out[(s * (T - cut) + t - cut) * row];
          CHECK(std::memcmp(got, &one.out[(s * T + t) * row], row * 2) == 0);
        }
      }
    } else {
      const double e =
          rel_error(pool_values(b.pool, DType::kF32), pool_values(one.pool, DType::kF32));
      std::printf("chained vs one call: pool rel error %.2e\n", e);
      CHECK(e <= split.tol);
    }
  }
}

KDA_CUDA_CASE("prefill: a slot outside the pool is reported and runs as padding") {
  CaseOptions o = cuda_options(4, 7);
  o.lengths = {40, 700, 3};
  const KdaCase kc = make_case(o);
  // The reference: sequence 1 as padding (pool entry 5 keeps its guard).
  const SlotCase padded = make_slot_case(kc, {2, -1, 0}, 6);
  SlotCase sc = padded;
  sc.slots[1] = 6;  // past the end: the device sees it (no host copy is given to check)
  const PrefillRun ref = cuda.prefill(padded.contiguous);
  REQUIRE(ref.status.ok());
  const PooledRun got = cuda.prefill_pooled(sc);
  REQUIRE(got.status.ok());
  CHECK(got.device_status == static_cast<std::uint32_t>(kDeviceStatusSlot));
  check_pooled_equals_contiguous(padded, got.out, got.pool, ref.out.out, ref.out.final_f32.data(),
                                 "slot outside the pool");
}

KDA_CUDA_CASE("prefill: the host copy of state slots is checked before any launch") {
  CaseOptions o = cuda_options(4, 8);
  o.lengths = {40, 70, 3};
  const KdaCase c = make_case(o);
  SlotCase sc = make_slot_case(c, {2, 5, 2}, 6);
  DeviceCase d(c);
  DeviceBuffer pool = DeviceBuffer::from(sc.pool), slots = DeviceBuffer::from(sc.slots);
  DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2);
  std::size_t ws_bytes = 0;
  REQUIRE(workspace_size(sc.problem, Backend::kCuda, &ws_bytes).ok());
  DeviceBuffer ws(ws_bytes);
  Tensors t = d.tensors();
  t.initial_state = t.final_state = pool.get();
  t.state_slots = static_cast<const std::int32_t*>(slots.get());
  t.state_slots_host = sc.slots.data();
  t.out = out.get();
  const Status st = forward_cuda(sc.problem, t, Workspace{ws.get(), ws.bytes()}, nullptr);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_MESSAGE(st.message().find("state_slots[2] = 2 repeats state_slots[0]") != std::string::npos,
                st.message());
}

namespace {

CaseOptions cpu_slot_options(std::uint64_t seed) {
  CaseOptions o = slot_shapes().front().options;  // H = 2, K = V = 32, six sequences, f32
  o.seed = seed;
  return o;
}

}  // namespace

KDA_CPU_CASE("prefill refuses bad state slots before writing anything") {
  const KdaCase c = make_case(cpu_slot_options(31));
  const std::int64_t n = c.num_seqs();
  struct Bad {
    std::vector<std::int32_t> slots;
    const char* needle;
  };
  std::vector<std::int32_t> out_of_range(static_cast<std::size_t>(n), 0),
      twice(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) {
    out_of_range[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s);
    twice[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s);
  }
  out_of_range[3] = static_cast<std::int32_t>(n + 2);  // pool of n + 2 entries: one past the end
  twice[4] = 1;
  for (const Bad& bad : {Bad{out_of_range, "state_slots[3] = 8 is outside the pool"},
                         Bad{twice, "state_slots[4] = 1 repeats state_slots[1]"}}) {
    SlotCase sc =
        make_slot_case(c, std::vector<std::int32_t>(static_cast<std::size_t>(n), -1), n + 2);
    sc.slots = bad.slots;
    const PooledRun got = cpu_runner().prefill_pooled(sc);
    CHECK(got.status.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(got.status.message().find(bad.needle) != std::string::npos, got.status.message());
    CHECK(got.pool == sc.pool);
    CHECK(got.out == cpu_runner().poisoned_out(c));
    CHECK(got.guards_intact);
  }
  // The host check of the public entry point says the same.
  Problem p = c.problem;
  p.num_state_slots = n + 2;
  CHECK(validate_state_slots(p, twice.data()).message().find("repeats") != std::string::npos);
  // Without a final state, sequences may share a slot (they only read it).
  p.final_state_dtype = DType::kNone;
  CHECK(validate_state_slots(p, twice.data()).ok());
}

KDA_CPU_CASE("state slot fields are validated") {
  const KdaCase c = make_case(cpu_slot_options(41));
  Problem p = c.problem;
  p.num_state_slots = -1;
  CHECK(validate(p).message().find("num_state_slots must be >= 0") != std::string::npos);
  p.num_state_slots = 4;
  p.initial_state_dtype = p.final_state_dtype = DType::kNone;
  CHECK(validate(p).message().find("neither initial_state_dtype nor final_state_dtype") !=
        std::string::npos);
  p = c.problem;
  p.num_state_slots = 8;
  Tensors t = c.inputs();
  std::vector<float> pool(static_cast<std::size_t>(8 * p.num_heads * p.head_dim_v * p.head_dim_k));
  std::vector<std::uint16_t> out(static_cast<std::size_t>(c.out_elems()));
  t.initial_state = t.final_state = pool.data();
  t.out = out.data();
  CHECK(validate(p, t).message() == "state_slots is null");
  std::vector<std::int32_t> slots(static_cast<std::size_t>(c.num_seqs()), -1);
  t.state_slots = slots.data();
  CHECK(validate(p, t).ok());
  p.num_state_slots = 0;
  CHECK(validate(p, t).message() == "state_slots is set but num_state_slots is 0");
  // The pool is sized by num_state_slots, not N: its bytes enter the overlap checks.
  p.num_state_slots = 8;
  t.out = reinterpret_cast<unsigned char*>(pool.data()) + 4;
  CHECK(validate(p, t).message().find("out overlaps") != std::string::npos);
  // padding_slot: inside the pool; entries equal to it are padding, so they may repeat.
  p.padding_slot = 8;
  CHECK(validate(p).message() ==
        "padding_slot 8 is outside the pool of num_state_slots = 8 (negative: no padding slot)");
  p.padding_slot = 2;
  CHECK(validate(p).ok());
  std::vector<std::int32_t> named(static_cast<std::size_t>(c.num_seqs()), 2);
  REQUIRE(named.size() >= 2);
  CHECK(validate_state_slots(p, named.data()).ok());
  p.padding_slot = -1;
  CHECK(validate_state_slots(p, named.data()).message().find("repeats state_slots[0]") !=
        std::string::npos);
  DecodeProblem d;
  d.batch = 1;
  d.num_heads = 1;
  d.num_slots = 3;
  d.padding_slot = 3;
  CHECK(validate(d).message() ==
        "padding_slot 3 is outside the pool of num_slots = 3 (negative: no padding slot)");
  d.padding_slot = 0;
  CHECK(validate(d).ok());
}

// ---- prefill checkpoints --------------------------------------------------------------------

namespace {

// Three rows of 40 tokens on slots 0..2 of a pool of 12, and checkpoint requests: row 0 after 16
// and 40 tokens (its third request none); row 1 after 0, 32 and 16; row 2 after 40 and, not kept
// (slot -1), 32.
struct CheckpointCall {
  KdaCase c;
  Problem p;
  std::vector<float> pool;
  std::vector<std::int32_t> slots = {0, 1, 2};
  std::vector<std::int64_t> offsets = {16, 40, -1, 0, 32, 16, 40, 32, -1};
  std::vector<std::int32_t> checkpoint_slots = {3, 4, 5, 6, 7, 8, 9, -1, 10};
  std::vector<std::uint16_t> out;

  CheckpointCall() {
    CaseOptions o;
    o.batch = 3;
    o.seq_len = 40;
    o.initial_state_dtype = DType::kF32;
    o.seed = 77;
    c = make_case(o);
    p = c.problem;
    p.num_state_slots = 12;
    p.checkpoints = 3;
    p.checkpoint_offsets_dtype = DType::kI64;
    const std::size_t per_slot = static_cast<std::size_t>(c.state_elems() / 3);
    pool.assign(12 * per_slot, 0.0f);
    for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = 0.001f * static_cast<float>(i % 97);
    std::copy(c.initial_state.begin(), c.initial_state.end(), pool.begin());
    out.assign(static_cast<std::size_t>(c.out_elems()), kPoisonBf16);
  }
  std::size_t per_slot() const { return pool.size() / 12; }
  Status run() {
    Tensors t = c.inputs();
    t.initial_state = pool.data();
    t.final_state = pool.data();
    t.state_slots = slots.data();
    t.checkpoint_offsets = offsets.data();
    t.checkpoint_slots = checkpoint_slots.data();
    t.out = out.data();
    std::size_t bytes = 0;
    REQUIRE(workspace_size(p, Backend::kCpu, &bytes).ok());
    std::vector<unsigned char> ws(bytes);
    return forward_cpu(p, t, Workspace{ws.data(), ws.size()});
  }
};

}  // namespace

// Every request's slot holds the final state of a prefill of that many of its tokens (the same
// operations: bit for bit); out and the sequences' own final states are those of the call without
// checkpoints; the slots of requests with no offset or no slot, and every other slot, untouched.
KDA_CPU_CASE("prefill checkpoints write the state after each requested offset") {
  CheckpointCall call;
  const std::vector<float> before = call.pool;
  REQUIRE(call.run().ok());
  const std::size_t per_slot = call.per_slot();

  // The same call without checkpoints.
  CheckpointCall plain;
  plain.p.checkpoints = 0;
  plain.p.checkpoint_offsets_dtype = DType::kNone;
  Tensors t = plain.c.inputs();
  t.initial_state = plain.pool.data();
  t.final_state = plain.pool.data();
  t.state_slots = plain.slots.data();
  t.out = plain.out.data();
  std::size_t bytes = 0;
  REQUIRE(workspace_size(plain.p, Backend::kCpu, &bytes).ok());
  std::vector<unsigned char> ws(bytes);
  REQUIRE(forward_cpu(plain.p, t, Workspace{ws.data(), ws.size()}).ok());
  CHECK(call.out == plain.out);
  CHECK(std::equal(call.pool.begin(), call.pool.begin() + 3 * per_slot, plain.pool.begin()));

  // Prefills of the first 0, 16, 32 and 40 tokens of every row, from the same initial states.
  for (const std::int64_t length : {0, 16, 32, 40}) {
    CAPTURE(length);
    KdaCase prefix =
        split_tokens(call.c, 0, length, DType::kF32, call.c.initial_state, DType::kF32);
    std::vector<float> final_state(static_cast<std::size_t>(prefix.state_elems()), -7.0f);
    std::vector<std::uint16_t> out(static_cast<std::size_t>(prefix.out_elems()));
    Tensors pt = prefix.inputs();
    pt.final_state = final_state.data();
    pt.out = out.data();
    std::size_t prefix_bytes = 0;
    REQUIRE(workspace_size(prefix.problem, Backend::kCpu, &prefix_bytes).ok());
    std::vector<unsigned char> prefix_ws(prefix_bytes);
    REQUIRE(forward_cpu(prefix.problem, pt, Workspace{prefix_ws.data(), prefix_ws.size()}).ok());
    for (std::size_t i = 0; i < call.offsets.size(); ++i) {
      if (call.offsets[i] != length || call.checkpoint_slots[i] < 0) continue;
      const std::size_t row = i / 3, slot = static_cast<std::size_t>(call.checkpoint_slots[i]);
      CAPTURE(slot);
      CHECK(std::equal(final_state.begin() + row * per_slot,
                       final_state.begin() + (row + 1) * per_slot,
                       call.pool.begin() + slot * per_slot));
    }
  }
  for (const std::size_t slot : {5, 10, 11}) {
    CAPTURE(slot);
    CHECK(std::equal(before.begin() + slot * per_slot, before.begin() + (slot + 1) * per_slot,
                     call.pool.begin() + slot * per_slot));
  }
}

KDA_CPU_CASE("bad checkpoint requests are refused before anything is written") {
  struct Bad {
    std::function<void(CheckpointCall&)> change;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {[](CheckpointCall& c) { c.offsets[1] = 24; },
       "checkpoint_offsets[0][1] = 24 is not -1, a multiple of 16 up to the sequence's length 40, "
       "or that length"},
      {[](CheckpointCall& c) { c.offsets[4] = 48; },
       "checkpoint_offsets[1][1] = 48 is not -1, a multiple of 16 up to the sequence's length 40, "
       "or that length"},
      {[](CheckpointCall& c) { c.checkpoint_slots[3] = 12; },
       "checkpoint_slots[1][0] = 12 is outside the pool of num_state_slots = 12"},
      {[](CheckpointCall& c) { c.checkpoint_slots[4] = 3; },
       "checkpoint_slots[1][1] = 3 is written twice in the call (another checkpoint or a "
       "sequence's state)"},
      {[](CheckpointCall& c) { c.checkpoint_slots[0] = 2; },
       "checkpoint_slots[0][0] = 2 is written twice in the call (another checkpoint or a "
       "sequence's state)"},
  };
  for (const Bad& bad : cases) {
    CAPTURE(bad.message);
    CheckpointCall call;
    bad.change(call);
    const std::vector<float> before = call.pool;
    const Status st = call.run();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message() == bad.message);
    CHECK(call.pool == before);
    CHECK(std::all_of(call.out.begin(), call.out.end(),
                      [](std::uint16_t x) { return x == kPoisonBf16; }));
  }
  // The problem's own fields.
  CheckpointCall call;
  Problem p = call.p;
  p.checkpoint_offsets_dtype = DType::kF32;
  CHECK(validate(p).message() == "checkpoint_offsets_dtype must be i32 or i64 (got f32)");
  p = call.p;
  p.num_state_slots = 0;
  CHECK(validate(p).message().find("checkpoints (3) need state slots and a final state") !=
        std::string::npos);
}

KDA_CUDA_CASE("prefill checkpoints are refused by the CUDA backend, naming the CPU") {
  CheckpointCall call;
  const Status st = can_implement(call.p, Backend::kCuda);
  CHECK(st.code() == StatusCode::kUnsupported);
  CHECK(st.message().find("CPU backend only") != std::string::npos);
}
