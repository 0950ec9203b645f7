// Segment transitions: (P^T, H^T) with S_final = S_0 P^T + H^T (V-first) for every sequence and
// head (cases.cpp transition_cases: against the fp64 final state on the CPU, against the CPU's
// transition on CUDA); chaining the transitions of two halves equals one prefill over both;
// apply_transition in and out of place; bad calls refused.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

KDA_MATRIX_CASE("segment transitions give the prefill's final state") {
  for (const TransitionCase& tc : transition_cases()) {
    if (!runs_on(tc.backends, runner)) continue;
    CAPTURE(tc.name);
    const KdaCase c = make_case(tc.options);
    const std::int64_t pairs = c.num_seqs() * c.problem.num_heads;
    const std::int64_t K = c.problem.head_dim_k, V = c.problem.head_dim_v;
    if (tc.against == Against::kFp64) {
      const TransitionRun tr = runner.transition(c, CpuOptions{0, true});
      REQUIRE(tr.status.ok());
      CHECK(tr.guards_intact);
      CHECK(all_finite(tr.p_t));
      CHECK(all_finite(tr.h_t));
      std::vector<float> s;
      REQUIRE(runner.apply_transition(pairs, K, V, c.initial_state, tr.p_t, tr.h_t, true, &s).ok());
      const Reference ref = reference_forward(c);
      const double e = rel_error(s, ref.final_state);
      MESSAGE(tc.name << ": transition vs fp64 final state " << e);
      CHECK(e <= tc.tol);
      // An empty sequence's transition is the identity map (P = I, H = 0).
      REQUIRE(c.seq_end(0) == c.seq_begin(0));
      for (std::int64_t i = 0; i < K; ++i)
        CHECK(tr.p_t[static_cast<std::size_t>(i * K + i)] == 1.0f);
    } else {
      const TransitionRun got = runner.transition(c), cpu = cpu_runner().transition(c);
      REQUIRE(got.status.ok());
      REQUIRE(cpu.status.ok());
      CHECK(got.guards_intact);
      CHECK(all_finite(got.p_t));
      CHECK(all_finite(got.h_t));
      const double ep = rel_error(got.p_t, to_doubles(cpu.p_t));
      const double eh = rel_error(got.h_t, to_doubles(cpu.h_t));
      std::printf("transition %s: P^T rel error %.2e, H^T %.2e\n", tc.name.c_str(), ep, eh);
      CHECK(ep <= tc.tol);
      CHECK(eh <= tc.tol);
    }
  }
}

KDA_MATRIX_CASE("transitions of two halves, chained, equal one prefill over both") {
  for (const SplitCase& sc : transition_split_cases()) {
    if (!runs_on(sc.backends, runner)) continue;
    CAPTURE(sc.name);
    const KdaCase whole = make_case(sc.options);
    const std::int64_t T = whole.problem.seq_len, cut = sc.cuts.at(0);
    const KdaCase a = split_tokens(whole, 0, cut, DType::kNone, {}, DType::kNone);
    const KdaCase b = split_tokens(whole, cut, T, DType::kNone, {}, DType::kNone);
    const TransitionRun ta = runner.transition(a), tb = runner.transition(b);
    REQUIRE(ta.status.ok());
    REQUIRE(tb.status.ok());
    const std::int64_t pairs = whole.problem.batch * whole.problem.num_heads;
    const std::int64_t K = whole.problem.head_dim_k, V = whole.problem.head_dim_v;
    std::vector<float> mid(whole.initial_state.size()), fin(mid.size());
    REQUIRE(apply_transition_cpu(pairs, K, V, whole.initial_state.data(), ta.p_t.data(),
                                 ta.h_t.data(), mid.data())
                .ok());
    REQUIRE(apply_transition_cpu(pairs, K, V, mid.data(), tb.p_t.data(), tb.h_t.data(), fin.data())
                .ok());
    double e = 0;
    if (sc.vs_fp64) {
      e = rel_error(fin, reference_forward(whole).final_state);
    } else {  // the backend's own prefill over both halves
      const PrefillRun one = runner.prefill(whole);
      REQUIRE(one.status.ok());
      e = rel_error(fin, to_doubles(one.out.final_f32));
    }
    std::printf("two chained transitions vs %s: %.2e\n", sc.vs_fp64 ? "fp64" : "one prefill", e);
    CHECK(e <= sc.tol);
  }
}

KDA_MATRIX_CASE("apply_transition equals the CPU's, also in place") {
  const std::int64_t pairs = 5, K = 128, V = 128;
  const std::size_t n = static_cast<std::size_t>(pairs * K * V);
  Rng rng(21);
  std::vector<float> s(n), pt(n), ht(n);
  for (auto* v : {&s, &pt, &ht}) {
    for (float& x : *v) x = static_cast<float>(0.1 * rng.normal());
  }
  std::vector<float> cpu(n);
  REQUIRE(apply_transition_cpu(pairs, K, V, s.data(), pt.data(), ht.data(), cpu.data()).ok());
  for (bool in_place : {true, false}) {
    CAPTURE(in_place);
    std::vector<float> got;
    REQUIRE(runner.apply_transition(pairs, K, V, s, pt, ht, in_place, &got).ok());
    const double e = rel_error(got, to_doubles(cpu));
    std::printf("apply_transition on %s, in place %d: rel error %.2e\n", runner.name(),
                static_cast<int>(in_place), e);
    CHECK(e <= 1e-5);
  }
}

// The workspace is scratch: what it holds before the call (here 0xFF bytes, NaN in bf16 and f32)
// must not reach P^T or H^T. The runner's workspace starts zeroed; this one is poisoned.
KDA_CPU_CASE("segment transitions do not depend on the workspace's contents") {
  for (const TransitionCase& tc : transition_cases()) {
    if (!runs_on(tc.backends, cpu_runner())) continue;
    CAPTURE(tc.name);
    CaseOptions o = tc.options;
    o.seed += 1000;
    const KdaCase c = make_case(o);
    const TransitionRun clean = cpu_runner().transition(c);
    REQUIRE(clean.status.ok());
    Problem p = c.problem;
    p.initial_state_dtype = p.final_state_dtype = DType::kNone;
    std::size_t bytes = 0;
    REQUIRE(transition_workspace_size(p, Backend::kCpu, &bytes).ok());
    std::vector<unsigned char> ws(bytes, kPoisonByte);
    std::vector<float> pt(clean.p_t.size()), ht(clean.h_t.size());
    Tensors t = c.inputs();
    t.initial_state = nullptr;
    REQUIRE(
        segment_transition_cpu(p, t, pt.data(), ht.data(), Workspace{ws.data(), ws.size()}).ok());
    CHECK(all_finite(pt));
    CHECK(pt == clean.p_t);
    CHECK(ht == clean.h_t);
  }
}

KDA_CPU_CASE("segment transitions refuse what they cannot do") {
  CaseOptions o = transition_cases().front().options;  // H = 2, K = 16, V = 24, four sequences
  o.seed = 4;
  const KdaCase c = make_case(o);
  Problem p = c.problem;                                // has states: refused
  std::vector<float> pt(8 * 16 * 16), ht(8 * 24 * 16);  // 4 sequences x 2 heads
  std::vector<unsigned char> ws(1 << 20);
  Tensors t = c.inputs();
  Status st = segment_transition_cpu(p, t, pt.data(), ht.data(), Workspace{ws.data(), ws.size()});
  CHECK(st.message().find("starts from no state") != std::string::npos);
  p.initial_state_dtype = p.final_state_dtype = DType::kNone;
  st = segment_transition_cpu(p, t, pt.data(), ht.data(), Workspace{ws.data(), ws.size()});
  CHECK(st.message().find("initial_state, final_state and state_slots must be null") !=
        std::string::npos);
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
  CHECK(apply_transition_cpu(1, 4, 4, s.data(), pt.data(), ht.data(), s.data() + 1)
            .message()
            .find("partially overlaps") != std::string::npos);
  CHECK(apply_transition_cpu(1, 4, 4, ht.data() + 100, s.data(), ht.data(), s.data() + 8)
            .message()
            .find("s_out overlaps p_t") != std::string::npos);
  CHECK(apply_transition_cpu(0, 4, 4, nullptr, nullptr, nullptr, nullptr).ok());
}
