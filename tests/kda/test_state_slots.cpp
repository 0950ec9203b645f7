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

KDA_CPU_CASE("validate_state_slots: the first error in order, many sequences, slots past 65,536") {
  Problem p = make_case(cpu_slot_options(41)).problem;
  p.cu_seqlens_dtype = DType::kI64;
  p.num_seqs = 200000;  // checked without scratch: linear, a scan of earlier entries only past 2^16
  p.num_state_slots = 1 << 20;
  REQUIRE(p.varlen());
  std::vector<std::int32_t> slots(static_cast<std::size_t>(p.num_seqs));
  for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<std::int32_t>(i * 5);
  CHECK(validate_state_slots(p, slots.data()).ok());
  slots.back() = 5 * 70000;  // past the stack bitmap's slots
  CHECK(validate_state_slots(p, slots.data()).message() ==
        "state_slots[199999] = 350000 repeats state_slots[70000] (two sequences cannot write one "
        "state)");
  slots[150000] = 1 << 20;  // outside the pool, before the repeat: named first
  CHECK(validate_state_slots(p, slots.data()).message() ==
        "state_slots[150000] = 1048576 is outside the pool of num_state_slots = 1048576");
  slots[150000] = 3;
  slots[160000] = 3;  // a repeat before the slot outside the pool: named first
  slots[170000] = -5;
  slots[180000] = 1 << 21;
  CHECK(validate_state_slots(p, slots.data())
            .message()
            .find("state_slots[160000] = 3 repeats "
                  "state_slots[150000]") == 0);
  p.padding_slot = 3;  // the padding slot may repeat
  CHECK(validate_state_slots(p, slots.data())
            .message()
            .find("state_slots[180000] = 2097152 is "
                  "outside the pool") == 0);
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
  // A workspace over the pool: refused before the CPU writes its slot bitmap there.
  {
    t.out = out.data();
    t.state_slots = named.data();
    std::size_t needed = 0;
    REQUIRE(workspace_size(p, Backend::kCpu, &needed).ok());
    std::vector<unsigned char> scratch(needed + pool.size() * sizeof(float));
    float* in_scratch = reinterpret_cast<float*>(scratch.data());
    std::fill(in_scratch, in_scratch + pool.size(), 0.5f);
    t.initial_state = t.final_state = in_scratch;
    const std::vector<unsigned char> before = scratch;
    const Status st = forward_cpu(p, t, Workspace{scratch.data(), needed});
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(st.message().find("the workspace overlaps initial_state") != std::string::npos,
                  st.message());
    CHECK(scratch == before);
    t.initial_state = t.final_state = pool.data();
  }
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
  Status run() { return run_at(pool.data()); }
  // The call on a copy of the pool placed at `states` (pool.size() floats, not the pool itself),
  // copied back afterwards.
  Status run_moved_to(float* states) {
    std::copy(pool.begin(), pool.end(), states);
    const Status st = run_at(states);
    std::copy(states, states + pool.size(), pool.begin());
    return st;
  }
  Status run_at(float* states) {
    Tensors t = c.inputs();
    t.initial_state = states;
    t.final_state = states;
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

// A request with an offset but no slot (-1) writes nothing, also when the call names a padding slot
// of its own: the pool lies between two guard entries of random values, which must survive, and
// the call equals the one without a padding slot.
KDA_CPU_CASE("a checkpoint request with slot -1 writes nothing when padding_slot is set") {
  CheckpointCall want;
  REQUIRE(want.run().ok());
  CheckpointCall call;
  REQUIRE(call.offsets[7] == 32);
  REQUIRE(call.checkpoint_slots[7] == -1);  // row 2's request after 32 tokens, not kept
  call.p.padding_slot = 11;                 // no request or sequence names it
  const std::size_t per_slot = call.per_slot();
  std::vector<float> framed(call.pool.size() + 2 * per_slot);
  Rng rng(1501);
  for (float& x : framed) x = static_cast<float>(rng.normal());
  const std::vector<float> guards = framed;
  REQUIRE(call.run_moved_to(framed.data() + per_slot).ok());
  CHECK(std::equal(guards.begin(), guards.begin() + per_slot, framed.begin()));  // entry -1
  CHECK(std::equal(guards.end() - per_slot, guards.end(), framed.end() - per_slot));
  CHECK(call.pool == want.pool);
  CHECK(call.out == want.out);
}

// A request with offset -1 is no request: its slot may be the sequence's own or another request's
// (no write twice), and the call equals the one where it names an unused slot.
KDA_CPU_CASE("a checkpoint request with offset -1 may name a slot the call writes") {
  CheckpointCall want;
  REQUIRE(want.run().ok());
  struct Case {
    std::size_t request;  // [row][2], offset -1
    std::int32_t slot;
  };
  for (const Case& k : {Case{2, 0}, Case{2, 3}, Case{2, 10}, Case{8, 2}, Case{8, 9}}) {
    CAPTURE(k.request);
    CAPTURE(k.slot);
    CheckpointCall call;
    REQUIRE(call.offsets[k.request] == -1);
    call.checkpoint_slots[k.request] = k.slot;
    const Status st = call.run();
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    CHECK(call.pool == want.pool);
    CHECK(call.out == want.out);
  }
}

namespace {

struct CheckpointShape {
  std::string name;
  CaseOptions options;  // initial and final state in the same dtype
  unsigned backends;
  std::vector<PrefillSchedule> schedules;  // the CUDA schedules to run (the CPU has one)
};

CaseOptions checkpoint_options(std::int64_t heads, std::int64_t dim,
                               std::vector<std::int64_t> lengths, DType state, GateMode gate,
                               std::uint64_t seed) {
  CaseOptions o;
  o.heads = heads;
  o.head_dim_k = o.head_dim_v = dim;
  o.lengths = std::move(lengths);
  o.gate = gate;
  o.initial_state_dtype = state;
  o.final_state_dtype = state;
  o.seed = seed;
  return o;
}

// H = 4 with long sequences: the split recurrence (segment 0 and the second pass write); one
// sequence of 4096 tokens: split, or pipelined where forced; H = 64 short ones: the shape the
// paired block would take without checkpoints.
const std::vector<CheckpointShape>& checkpoint_shapes() {
  static const std::vector<CheckpointShape> shapes = [] {
    std::vector<CheckpointShape> v;
    const std::vector<PrefillSchedule> all = {PrefillSchedule::kAuto, PrefillSchedule::kTwoPhase,
                                              PrefillSchedule::kPipelined};
    std::uint64_t seed = 500;
    for (DType state : {DType::kF32, DType::kBF16}) {
      for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
        const std::string tail = std::string(" ") + to_string(state) + " " +
                                 (gate == GateMode::kSoftplus ? "softplus" : "lower-bound");
        v.push_back({"H2 K=V=32" + tail,
                     checkpoint_options(2, 32, {37, 0, 1, 100, 16, 63}, state, gate, ++seed),
                     kOnCpu,
                     {PrefillSchedule::kAuto}});
        v.push_back(
            {"H4 split" + tail,
             checkpoint_options(4, 128, {300, 0, 1, 1000, 16, 2100, 37}, state, gate, ++seed),
             kOnCuda, all});
      }
      v.push_back({std::string("H2 one sequence ") + to_string(state),
                   checkpoint_options(2, 128, {4096}, state, GateMode::kSoftplus, ++seed), kOnCuda,
                   all});
      v.push_back({std::string("H64 short ") + to_string(state),
                   checkpoint_options(64, 128, {37, 0, 1, 100, 16, 63}, state,
                                      GateMode::kLowerBound, ++seed),
                   kOnCuda,
                   {PrefillSchedule::kAuto}});
    }
    return v;
  }();
  return shapes;
}

// Sequence s on pool entry 2 s; K = 5 requests a sequence in random order: offsets among -1, 0,
// multiples of 16 up to the length and the length, each on its own odd entry or none (-1).
SlotCase with_checkpoints(const KdaCase& c, std::uint64_t seed, DType offsets_dtype) {
  const std::int64_t n = c.num_seqs(), K = 5;
  std::vector<std::int32_t> slots;
  for (std::int64_t s = 0; s < n; ++s) slots.push_back(static_cast<std::int32_t>(2 * s));
  SlotCase sc = make_slot_case(c, slots, 2 * n * (K + 1) + 3, seed);
  sc.problem.checkpoints = K;
  sc.problem.checkpoint_offsets_dtype = offsets_dtype;
  Rng rng(seed);
  std::int32_t next = 1;
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int64_t length = c.cu_seqlens[s + 1] - c.cu_seqlens[s];
    for (std::int64_t k = 0; k < K; ++k) {
      const std::uint64_t pick = rng.next() % 8;
      std::int64_t offset = -1;
      if (pick == 0) {
        offset = 0;
      } else if (pick <= 2) {
        offset = length;
      } else if (pick <= 6) {
        offset = 16 * static_cast<std::int64_t>(rng.next() % (length / 16 + 1));
      }
      sc.checkpoint_offsets.push_back(offset);
      sc.checkpoint_slots.push_back(rng.next() % 6 == 0 ? -1 : next);
      next += 2;
    }
  }
  return sc;
}

double entry_error(const std::vector<unsigned char>& got, const std::vector<unsigned char>& ref,
                   const SlotCase& sc, std::int64_t entry) {
  const DType dt = sc.problem.final_state_dtype;
  const std::size_t at = static_cast<std::size_t>(entry) * sc.entry_bytes;
  const std::vector<unsigned char> a(got.begin() + at, got.begin() + at + sc.entry_bytes);
  const std::vector<unsigned char> b(ref.begin() + at, ref.begin() + at + sc.entry_bytes);
  return rel_error(pool_values(a, dt), pool_values(b, dt));
}

}  // namespace

// Every schedule writes, at every request, the state of the fp64 recurrence after that many of the
// sequence's tokens (within the backend's tolerance); a request at the length equals the
// sequence's final state bit for bit; out and the final states are those of the run without
// checkpoints within tolerance; entries no request names keep their guards.
KDA_MATRIX_CASE("prefill checkpoints match the fp64 recurrence, every schedule") {
  for (const CheckpointShape& shape : checkpoint_shapes()) {
    if (!runs_on(shape.backends, runner)) continue;
    const KdaCase c = make_case(shape.options);
    const DType dt = shape.options.final_state_dtype;
    for (const DType offsets_dtype : {DType::kI64, DType::kI32}) {
      const SlotCase sc = with_checkpoints(c, shape.options.seed, offsets_dtype);
      PrefillOptions fp64;
      fp64.cpu.fp64 = true;
      const PooledRun ref = cpu_runner().prefill_pooled(sc, fp64);
      REQUIRE_MESSAGE(ref.status.ok(), ref.status.to_string());
      const bool gpu = runner.backend() == Backend::kCuda;
      const double out_tol = gpu ? kGpuFp64Tol : kBf16Tol;
      const double state_tol = gpu ? (dt == DType::kF32 ? kGpuFp64Tol : kGpuFp64Bf16StateTol)
                                   : (dt == DType::kF32 ? kCpuStateTol : kBf16Tol);
      // Which entries the call writes: the sequences' (final states) and the valid requests'.
      std::vector<int> written(static_cast<std::size_t>(sc.problem.num_state_slots), 0);
      for (std::int32_t e : sc.slots) written[static_cast<std::size_t>(e)] = 1;
      for (std::size_t i = 0; i < sc.checkpoint_slots.size(); ++i) {
        if (sc.checkpoint_slots[i] >= 0 && sc.checkpoint_offsets[i] >= 0) {
          written[static_cast<std::size_t>(sc.checkpoint_slots[i])] = 1;
        }
      }
      for (const PrefillSchedule schedule : shape.schedules) {
        const std::string label =
            shape.name + " " + to_string(schedule) + " offsets " + to_string(offsets_dtype);
        CAPTURE(label);
        PrefillOptions opt;
        opt.cuda.schedule = schedule;
        const PooledRun got = runner.prefill_pooled(sc, opt);
        REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
        CHECK(got.device_status == 0u);
        CHECK(got.guards_intact);
        CHECK(rel_error(to_doubles(got.out), to_doubles(ref.out)) <= out_tol);
        for (std::int64_t e = 0; e < sc.problem.num_state_slots; ++e) {
          CAPTURE(e);
          const std::size_t at = static_cast<std::size_t>(e) * sc.entry_bytes;
          if (written[static_cast<std::size_t>(e)]) {
            CHECK(entry_error(got.pool, ref.pool, sc, e) <= state_tol);
          } else {
            CHECK(std::memcmp(got.pool.data() + at, sc.pool.data() + at, sc.entry_bytes) == 0);
          }
        }
        // A request at the sequence's length holds its final state, bit for bit.
        const std::int64_t K = sc.problem.checkpoints;
        for (std::size_t i = 0; i < sc.checkpoint_slots.size(); ++i) {
          const std::int64_t s = static_cast<std::int64_t>(i) / K;
          const std::int64_t length = c.cu_seqlens[s + 1] - c.cu_seqlens[s];
          if (sc.checkpoint_slots[i] < 0 || sc.checkpoint_offsets[i] != length) continue;
          const std::size_t a = static_cast<std::size_t>(sc.checkpoint_slots[i]) * sc.entry_bytes;
          const std::size_t b = static_cast<std::size_t>(sc.slots[s]) * sc.entry_bytes;
          CHECK(std::memcmp(got.pool.data() + a, got.pool.data() + b, sc.entry_bytes) == 0);
        }
      }
    }
  }
}

// More requests than one block of the index kernel takes (sequences x K past 1024: the index is
// reset by a memset and built by a grid, not by one block): the same requests, spread over K = 160
// columns a sequence among requests of none (-1, -1), write the same states and out bit for bit as
// the five columns, on the split and the pipelined schedules.
KDA_CUDA_CASE("checkpoint requests past one index block write what fewer columns write") {
  const KdaCase c = make_case(checkpoint_options(4, 128, {300, 0, 1, 1000, 16, 2100, 37},
                                                 DType::kF32, GateMode::kLowerBound, 611));
  const SlotCase narrow = with_checkpoints(c, 611, DType::kI64);
  const std::int64_t N = c.num_seqs(), K = narrow.problem.checkpoints, wide_k = 160;
  REQUIRE(N * wide_k > 1024);
  SlotCase wide = narrow;
  wide.problem.checkpoints = wide_k;
  wide.checkpoint_offsets.assign(static_cast<std::size_t>(N * wide_k), -1);
  wide.checkpoint_slots.assign(static_cast<std::size_t>(N * wide_k), -1);
  for (std::int64_t s = 0; s < N; ++s) {
    for (std::int64_t k = 0; k < K; ++k) {
      // Request k of sequence s in column 31 k + 7 (the last column for k = 4: 131 < 160).
      const std::size_t from = static_cast<std::size_t>(s * K + k);
      const std::size_t to = static_cast<std::size_t>(s * wide_k + 31 * k + 7);
      wide.checkpoint_offsets[to] = narrow.checkpoint_offsets[from];
      wide.checkpoint_slots[to] = narrow.checkpoint_slots[from];
    }
  }
  for (const PrefillSchedule schedule : {PrefillSchedule::kTwoPhase, PrefillSchedule::kPipelined}) {
    const std::string label = to_string(schedule);
    CAPTURE(label);
    PrefillOptions opt;
    opt.cuda.schedule = schedule;
    const PooledRun want = cuda.prefill_pooled(narrow, opt);
    const PooledRun got = cuda.prefill_pooled(wide, opt);
    REQUIRE(want.status.ok());
    REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
    CHECK(want.device_status == 0u);
    CHECK(got.device_status == 0u);
    CHECK(got.guards_intact);
    CHECK(got.out == want.out);
    CHECK(got.pool == want.pool);
  }
}

// CUDA reads the requests on the device only: a bad offset or slot sets kDeviceStatusCheckpoint
// and skips that request; the others are written as without it.
KDA_CUDA_CASE("bad checkpoint requests are reported through the device status word") {
  const KdaCase c =
      make_case(checkpoint_options(2, 128, {100, 40, 1}, DType::kF32, GateMode::kSoftplus, 601));
  const SlotCase good = with_checkpoints(c, 601, DType::kI64);
  const PooledRun clean = cuda.prefill_pooled(good);
  REQUIRE(clean.status.ok());
  REQUIRE(clean.device_status == 0u);
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    SlotCase bad = good;
    bad.checkpoint_offsets[0] = which == 0 ? 24 : which == 1 ? 112 : 16;
    // Request 0 owns entry 1 (with_checkpoints); out of the pool in the third case.
    bad.checkpoint_slots[0] =
        which == 2 ? static_cast<std::int32_t>(bad.problem.num_state_slots) : 1;
    const PooledRun got = cuda.prefill_pooled(bad);
    REQUIRE(got.status.ok());
    CHECK(got.device_status == kDeviceStatusCheckpoint);
    CHECK(got.guards_intact);
    CHECK(got.out == clean.out);
    // Entry 1 (the skipped request's) holds its guard; every other entry what the clean run
    // wrote.
    for (std::int64_t e = 0; e < good.problem.num_state_slots; ++e) {
      CAPTURE(e);
      const std::size_t at = static_cast<std::size_t>(e) * good.entry_bytes;
      const std::vector<unsigned char>& want = e == 1 ? good.pool : clean.pool;
      CHECK(std::memcmp(got.pool.data() + at, want.data() + at, good.entry_bytes) == 0);
    }
  }
  // Two requests naming one entry: one is skipped and reported, the other written; entry 3 (the
  // second one's own) keeps its guard.
  SlotCase twice = good;
  twice.checkpoint_offsets[0] = 16;
  twice.checkpoint_offsets[1] = 32;
  twice.checkpoint_slots[0] = 1;
  twice.checkpoint_slots[1] = 1;
  const PooledRun got = cuda.prefill_pooled(twice);
  REQUIRE(got.status.ok());
  CHECK(got.device_status == kDeviceStatusCheckpoint);
  CHECK(got.out == clean.out);
  const std::size_t at3 = 3 * good.entry_bytes;
  CHECK(std::memcmp(got.pool.data() + at3, good.pool.data() + at3, good.entry_bytes) == 0);
  CHECK(std::memcmp(got.pool.data() + good.entry_bytes, good.pool.data() + good.entry_bytes,
                    good.entry_bytes) != 0);
}
