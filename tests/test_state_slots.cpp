// The prefill through state slot indices on the CPU backend (label `cpu`): reversed, strided and
// padded slot lists equal the contiguous run bitwise; unnamed pool entries keep their guards; a
// chunked prefill over two calls on the same slots equals one call; bad slot lists are refused
// before anything is written. The CUDA twin of these checks is test_state_slots_cuda.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kda_reference.hpp"
#include "state_slots_util.hpp"

using namespace kda;
using namespace kda::test;

namespace {

// Runs the pooled problem on the CPU in place (initial == final == pool); out poisoned first.
Status run_pooled_cpu(const SlotCase& sc, std::vector<std::uint16_t>* out,
                      std::vector<unsigned char>* pool) {
  *pool = sc.pool;
  out->assign(static_cast<std::size_t>(sc.contiguous.out_elems()), kPoisonBf16);
  std::size_t bytes = 0;
  if (Status st = workspace_size(sc.problem, Backend::kCpu, &bytes); !st) return st;
  std::vector<unsigned char> ws(bytes);
  Tensors t = sc.contiguous.inputs();
  t.initial_state = pool->data();
  t.final_state = pool->data();
  t.state_slots = sc.slots.data();
  t.out = out->data();
  return forward_cpu(sc.problem, t, Workspace{ws.data(), ws.size()});
}

CaseOptions slot_options(DType state, std::uint64_t seed) {
  CaseOptions o;
  o.heads = 2;
  o.head_dim_k = o.head_dim_v = 32;
  o.lengths = {37, 0, 1, 100, 16, 63};
  o.initial_state_dtype = state;
  o.final_state_dtype = state;
  o.seed = seed;
  return o;
}

}  // namespace

TEST_CASE("cpu prefill through state slots equals the contiguous run bitwise") {
  for (DType state : {DType::kF32, DType::kBF16}) {
    const KdaCase c = make_case(slot_options(state, state == DType::kF32 ? 11 : 12));
    for (const auto& [name, slots] : slot_lists(c.num_seqs())) {
      const std::string label = std::string(to_string(state)) + " " + name;
      const SlotCase sc = make_slot_case(c, slots, 2 * c.num_seqs() + 3);
      Outputs contiguous;
      REQUIRE(run_cpu(sc.contiguous, &contiguous).ok());
      std::vector<std::uint16_t> out;
      std::vector<unsigned char> pool;
      const Status st = run_pooled_cpu(sc, &out, &pool);
      REQUIRE_MESSAGE(st.ok(), label << ": " << st.to_string());
      check_pooled_equals_contiguous(sc, out, pool, contiguous.out, contiguous.final_state_ptr(),
                                     label);
    }
  }
}

TEST_CASE("cpu prefill through state slots: two chained calls equal one") {
  CaseOptions o = slot_options(DType::kF32, 21);
  o.lengths.clear();
  o.batch = 3;
  o.seq_len = 50;
  const KdaCase whole = make_case(o);
  const std::vector<std::int32_t> slots = {4, 0, 2};
  const SlotCase one = make_slot_case(whole, slots, 6);
  std::vector<std::uint16_t> out_one;
  std::vector<unsigned char> pool_one;
  REQUIRE(run_pooled_cpu(one, &out_one, &pool_one).ok());

  // The same tokens in two calls [0, 20) and [20, 50), the pool carried between them.
  const KdaCase first = split_tokens(whole, 0, 20, DType::kF32, whole.initial_state, DType::kF32);
  const KdaCase second = split_tokens(whole, 20, 50, DType::kF32, whole.initial_state, DType::kF32);
  SlotCase a = make_slot_case(first, slots, 6);
  std::vector<std::uint16_t> out_a, out_b;
  std::vector<unsigned char> pool_a, pool_b;
  REQUIRE(run_pooled_cpu(a, &out_a, &pool_a).ok());
  SlotCase b = make_slot_case(second, slots, 6);
  b.pool = pool_a;  // continue from the first call's pool
  REQUIRE(run_pooled_cpu(b, &out_b, &pool_b).ok());
  CHECK(pool_b == pool_one);
  // Out of the two calls, token by token, equals the one call's.
  const std::size_t row = static_cast<std::size_t>(o.heads * o.head_dim_v);
  for (std::int64_t s = 0; s < 3; ++s) {
    for (std::int64_t t = 0; t < 50; ++t) {
      const std::uint16_t* got =
          t < 20 ? &out_a[(s * 20 + t) * row] : &out_b[(s * 30 + t - 20) * row];
      CHECK(std::memcmp(got, &out_one[(s * 50 + t) * row], row * 2) == 0);
    }
  }
}

TEST_CASE("cpu prefill refuses bad state slots before writing anything") {
  const KdaCase c = make_case(slot_options(DType::kF32, 31));
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
    std::vector<std::uint16_t> out;
    std::vector<unsigned char> pool;
    const Status st = run_pooled_cpu(sc, &out, &pool);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(st.message().find(bad.needle) != std::string::npos, st.message());
    CHECK(pool == sc.pool);
    CHECK(out == std::vector<std::uint16_t>(out.size(), kPoisonBf16));
  }
  // The host check of the public entry point says the same.
  Problem p = c.problem;
  p.num_state_slots = n + 2;
  CHECK(validate_state_slots(p, twice.data()).message().find("repeats") != std::string::npos);
  // Without a final state, sequences may share a slot (they only read it).
  p.final_state_dtype = DType::kNone;
  CHECK(validate_state_slots(p, twice.data()).ok());
}

TEST_CASE("state slot fields are validated") {
  const KdaCase c = make_case(slot_options(DType::kF32, 41));
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
}
