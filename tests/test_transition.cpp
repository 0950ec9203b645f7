// Segment transitions on the CPU backend (label `cpu`): segment_transition_cpu gives (P^T, H^T) with
// S_final = S_0 P^T + H^T (V-first) for every sequence and head; chaining the transitions of two
// halves equals one prefill over both; apply_transition_cpu works in place; bad calls are refused.
// The CUDA twin: test_transition_cuda.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kda_reference.hpp"

using namespace kda;
using namespace kda::test;

namespace {

// The transition of case c's sequences (c's state dtypes are ignored: transitions have none).
struct Transition {
  std::vector<float> p_t, h_t;
};

Status transition_cpu(const KdaCase& c, Transition* out, const CpuOptions& opt = {}) {
  Problem p = c.problem;
  p.initial_state_dtype = p.final_state_dtype = DType::kNone;
  const std::size_t pairs = static_cast<std::size_t>(c.num_seqs() * p.num_heads);
  out->p_t.assign(pairs * static_cast<std::size_t>(p.head_dim_k * p.head_dim_k), kPoisonF32);
  out->h_t.assign(pairs * static_cast<std::size_t>(p.head_dim_v * p.head_dim_k), kPoisonF32);
  std::size_t bytes = 0;
  if (Status st = transition_workspace_size(p, Backend::kCpu, &bytes); !st) return st;
  std::vector<unsigned char> ws(bytes);
  Tensors t = c.inputs();
  t.initial_state = nullptr;
  return segment_transition_cpu(p, t, out->p_t.data(), out->h_t.data(), Workspace{ws.data(), bytes}, opt);
}

CaseOptions options(std::uint64_t seed, GateMode gate) {
  CaseOptions o;
  o.heads = 2;
  o.head_dim_k = 16;
  o.head_dim_v = 24;
  o.lengths = {0, 1, 37, 100};
  o.gate = gate;
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  o.seed = seed;
  return o;
}

}  // namespace

TEST_CASE("a segment transition applied to the initial state gives the prefill's final state") {
  for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
    const KdaCase c = make_case(options(gate == GateMode::kSoftplus ? 1 : 2, gate));
    Transition tr;
    REQUIRE(transition_cpu(c, &tr, CpuOptions{0, true}).ok());
    CHECK(all_finite(tr.p_t));
    CHECK(all_finite(tr.h_t));
    const std::int64_t pairs = c.num_seqs() * c.problem.num_heads;
    std::vector<float> s(c.initial_state);
    REQUIRE(apply_transition_cpu(pairs, c.problem.head_dim_k, c.problem.head_dim_v, s.data(),
                                 tr.p_t.data(), tr.h_t.data(), s.data())
                .ok());
    const Reference ref = reference_forward(c);
    const double e = rel_error(s, ref.final_state);
    MESSAGE(std::string(to_string(gate)) << ": transition vs fp64 final state " << e);
    CHECK(e <= 1e-5);
    // An empty sequence's transition is the identity map (P = I, H = 0).
    const std::size_t K = 16;
    for (std::size_t i = 0; i < K; ++i) CHECK(tr.p_t[i * K + i] == 1.0f);
  }
}

TEST_CASE("transitions of two halves, chained, equal one prefill over both") {
  CaseOptions o = options(3, GateMode::kSoftplus);
  o.lengths.clear();
  o.batch = 2;
  o.seq_len = 90;
  const KdaCase whole = make_case(o);
  const KdaCase a = split_tokens(whole, 0, 40, DType::kNone, {}, DType::kNone);
  const KdaCase b = split_tokens(whole, 40, 90, DType::kNone, {}, DType::kNone);
  Transition ta, tb;
  REQUIRE(transition_cpu(a, &ta).ok());
  REQUIRE(transition_cpu(b, &tb).ok());
  const std::int64_t pairs = 2 * o.heads;
  std::vector<float> s(whole.initial_state), mid(s.size());
  REQUIRE(apply_transition_cpu(pairs, 16, 24, s.data(), ta.p_t.data(), ta.h_t.data(), mid.data()).ok());
  REQUIRE(apply_transition_cpu(pairs, 16, 24, mid.data(), tb.p_t.data(), tb.h_t.data(), s.data()).ok());
  const Reference ref = reference_forward(whole);
  const double e = rel_error(s, ref.final_state);
  MESSAGE("two chained transitions vs fp64 " << e);
  CHECK(e <= 1e-4);
}

TEST_CASE("segment transitions refuse what they cannot do") {
  const KdaCase c = make_case(options(4, GateMode::kSoftplus));
  Problem p = c.problem;  // has states: refused
  std::vector<float> pt(8 * 16 * 16), ht(8 * 24 * 16);  // 4 sequences x 2 heads
  std::vector<unsigned char> ws(1 << 20);
  Tensors t = c.inputs();
  Status st = segment_transition_cpu(p, t, pt.data(), ht.data(), Workspace{ws.data(), ws.size()});
  CHECK(st.message().find("starts from no state") != std::string::npos);
  p.initial_state_dtype = p.final_state_dtype = DType::kNone;
  st = segment_transition_cpu(p, t, pt.data(), ht.data(), Workspace{ws.data(), ws.size()});
  CHECK(st.message().find("initial_state, final_state and state_slots must be null") != std::string::npos);
  t.initial_state = nullptr;
  st = segment_transition_cpu(p, t, nullptr, ht.data(), Workspace{ws.data(), ws.size()});
  CHECK(st.message() == "p_t is null");
  st = segment_transition_cpu(p, t, pt.data(), pt.data() + 4, Workspace{ws.data(), ws.size()});
  CHECK(st.message().find("p_t overlaps h_t") != std::string::npos);
  st = segment_transition_cpu(p, t, pt.data(), ht.data(), Workspace{ws.data(), 16});
  CHECK(st.code() == StatusCode::kWorkspaceTooSmall);
  // apply: sizes and aliasing.
  std::vector<float> s(64);
  CHECK(apply_transition_cpu(-1, 4, 4, s.data(), pt.data(), ht.data(), s.data()).code() ==
        StatusCode::kInvalidArgument);
  CHECK(apply_transition_cpu(1, 4, 4, s.data(), pt.data(), ht.data(), s.data() + 1).message().find(
            "partially overlaps") != std::string::npos);
  CHECK(apply_transition_cpu(1, 4, 4, ht.data() + 100, s.data(), ht.data(), s.data() + 8)
            .message()
            .find("s_out overlaps p_t") != std::string::npos);
  CHECK(apply_transition_cpu(0, 4, 4, nullptr, nullptr, nullptr, nullptr).ok());
}
