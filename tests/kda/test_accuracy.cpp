// Accuracy against the fp64 recurrence of kda_reference.hpp: every registry case (cases.cpp) with
// against == kFp64 on its backends (the CPU in fp32 and in fp64 mode), and hand-checked K = V = 2
// cases on the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

namespace {

// One run of case pc on runner, checked against the reference.
void check_against_fp64(Runner& runner, const PrefillCase& pc, const KdaCase& c,
                        const Reference& ref, const CpuOptions& cpu) {
  const bool fp64 = cpu.fp64;
  CAPTURE(fp64);
  PrefillOptions opt;
  opt.cpu = cpu;
  const PrefillRun got = runner.prefill(c, opt);
  REQUIRE_MESSAGE(got.status.ok(), pc.name << ": " << got.status.to_string());
  CHECK_MESSAGE(got.guards_intact, pc.name << ": bytes outside the outputs changed");
  CHECK_MESSAGE(all_finite(got.out.out), pc.name << ": an output element was not written");
  const double e_out = rel_error_bf16(got.out.out, ref.out);
  CHECK_MESSAGE(e_out <= pc.out_tol, pc.name << ": out rel error " << e_out);
  if (c.problem.final_state_dtype == DType::kNone) return;
  const std::vector<double> state = got.out.final_state();
  CHECK(state.size() == ref.final_state.size());
  const double state_tol = runner.backend() != Backend::kCpu             ? pc.state_tol
                           : c.problem.final_state_dtype == DType::kBF16 ? kBf16Tol
                           : fp64                                        ? kFp64Tol
                                                                         : pc.state_tol;
  const double e_state = rel_error(state, ref.final_state);
  if (runner.backend() != Backend::kCpu) {
    std::printf("vs fp64 reference, %s: out %.2e state %.2e\n", pc.name.c_str(), e_out, e_state);
  }
  CHECK_MESSAGE(e_state <= state_tol, pc.name << ": state rel error " << e_state);
}

}  // namespace

KDA_MATRIX_CASE("prefill matches the fp64 reference") {
  for (const PrefillCase& pc : prefill_cases()) {
    if (pc.against != Against::kFp64 || !runs_on(pc.backends, runner)) continue;
    SUBCASE(pc.name.c_str()) {  // one per entry: `-sc=NAME` runs a few
      const KdaCase c = make_case(pc.options);
      const Reference ref = reference_forward(c);
      if (runner.backend() == Backend::kCpu) {
        for (bool fp64 : {false, true}) check_against_fp64(runner, pc, c, ref, CpuOptions{2, fp64});
      } else {
        check_against_fp64(runner, pc, c, ref, {});
      }
    }
  }
}

namespace {

// A hand-built K = V = 2 case of three tokens; see the test below for the expected values.
KdaCase hand_case(GateMode gate) {
  KdaCase c;
  Problem& p = c.problem;
  p.batch = 1;
  p.seq_len = 3;
  p.num_heads = 1;
  p.head_dim_k = 2;
  p.head_dim_v = 2;
  p.gate = gate;
  p.lower_bound = static_cast<float>(-2.0 * std::log(2.0));  // -2 ln 2
  p.scale = 1.0f;
  p.final_state_dtype = DType::kF32;
  auto b = [](std::vector<float> x) { return to_bf16(x); };
  c.q = b({1, 0, 0, 1, 1, 1});
  c.k = b({1, 0, 0, 1, 1, 0});
  c.v = b({2, 4, 2, 2, 1, 0});
  c.g = b({0, 0, 0, 0, 0, 0});
  c.beta = b({0, 0, 0});
  c.A_log = {0.0f};
  c.dt_bias = {0.0f, 0.0f};
  return c;
}

}  // namespace

KDA_CPU_CASE("hand-checked K = V = 2 recurrence / both gates") {
  // Both gates give exp(g) = 1/2 here: A_log = 0, g_raw + dt_bias = 0, so
  //   softplus:     g = -1 * softplus(0) = -ln 2;
  //   lower_bound:  g = (-2 ln 2) * sigmoid(0) = -ln 2.
  // beta = sigmoid(0) = 1/2, scale = 1; q^ = q / |q|, k^ = k / |k| (eps 1e-6 is below bf16 ulps).
  // S is K x V, S0 = 0.
  //   t1: k=(1,0) v=(2,4): S = 1/2 k v^T = [[1,2],[0,0]];                   o = S^T (1,0) = (1, 2)
  //   t2: k=(0,1) v=(2,2): decay [[.5,1],[0,0]]; S^T k = (0,0);
  //       S += 1/2 (0,1)^T (2,2) = [[.5,1],[1,1]];                           o = S^T (0,1) = (1, 1)
  //   t3: k=(1,0) v=(1,0): decay [[.25,.5],[.5,.5]]; S^T k = (.25,.5); v - S^T k = (.75,-.5);
  //       S += 1/2 (1,0)^T (.75,-.5) = [[.625,.25],[.5,.5]]; q^ = (1,1)/sqrt 2:
  //       o = (1.125, .75)/sqrt 2 = (0.7954951, 0.5303301)
  //   final state V-first (S^T): [[.625,.5],[.25,.5]]
  const std::vector<float> expected_out = {1, 2, 1, 1, 0.7954951f, 0.5303301f};
  const std::vector<float> expected_state = {0.625f, 0.5f, 0.25f, 0.5f};
  for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
    CAPTURE(std::string(to_string(gate)));
    for (bool fp64 : {false, true}) {
      CAPTURE(fp64);
      const KdaCase c = hand_case(gate);
      PrefillOptions opt;
      opt.cpu.fp64 = fp64;
      const PrefillRun got = cpu_runner().prefill(c, opt);
      REQUIRE(got.status.ok());
      for (std::size_t i = 0; i < expected_out.size(); ++i) {
        CAPTURE(i);
        CHECK(bf16_to_float(got.out.out[i]) == doctest::Approx(expected_out[i]).epsilon(4e-3));
      }
      for (std::size_t i = 0; i < expected_state.size(); ++i) {
        CAPTURE(i);
        CHECK(got.out.final_f32[i] == doctest::Approx(expected_state[i]).epsilon(1e-5));
      }
      // The reference agrees with the hand computation as well.
      const Reference ref = reference_forward(c);
      for (std::size_t i = 0; i < expected_state.size(); ++i) {
        CHECK(ref.final_state[i] == doctest::Approx(expected_state[i]).epsilon(1e-5));
      }
    }
  }
}

KDA_CPU_CASE("hand-checked: a zero-length row returns its initial state / a one-token row") {
  // Varlen lengths {0, 1}. Sequence 0 has no tokens: its final state is its initial state.
  KdaCase c = hand_case(GateMode::kSoftplus);
  c.problem.seq_len = 1;
  c.problem.cu_seqlens_dtype = DType::kI64;
  c.problem.num_seqs = 2;
  c.cu_seqlens = {0, 0, 1};
  c.q.resize(2);
  c.k.resize(2);
  c.v.resize(2);
  c.g.resize(2);
  c.beta.resize(1);
  c.problem.initial_state_dtype = DType::kF32;
  c.initial_state = {1, 2, 3, 4, 4, 0, 0, 4};  // seq 0: [[1,2],[3,4]]; seq 1: 4 I (V-first)
  // Seq 1, one token q=k=(1,0), v=(2,4): decay S = 2 I; S^T k = (2, 0); v - S^T k = (0, 4);
  // S += 1/2 (1,0)^T (0,4) -> S = [[2,2],[0,2]]; o = S^T (1,0) = (2, 2); V-first [[2,0],[2,2]].
  const PrefillRun got = cpu_runner().prefill(c);
  REQUIRE(got.status.ok());
  const std::vector<float> expected_state = {1, 2, 3, 4, 2, 0, 2, 2};
  for (std::size_t i = 0; i < 4; ++i) CHECK(got.out.final_f32[i] == expected_state[i]);  // exact
  for (std::size_t i = 4; i < 8; ++i) {
    CHECK(got.out.final_f32[i] == doctest::Approx(expected_state[i]).epsilon(1e-5));
  }
  CHECK(to_floats(got.out.out) == std::vector<float>({2, 2}));
}

KDA_CPU_CASE("an explicit scale is used instead of K^-0.5") {
  // (The case itself is "explicit scale 0.3" of the registry, checked against fp64 above.)
  // Doubling the scale doubles out exactly in fp64 mode (up to bf16 rounding of the output).
  CaseOptions o;
  o.seq_len = 20;
  o.scale = 0.3f;
  o.seed = 41;
  const KdaCase c = make_case(o);
  KdaCase twice = c;
  twice.problem.scale = 0.6f;
  PrefillOptions opt;
  opt.cpu.fp64 = true;
  const PrefillRun a = cpu_runner().prefill(c, opt), b = cpu_runner().prefill(twice, opt);
  REQUIRE(a.status.ok());
  REQUIRE(b.status.ok());
  for (std::size_t i = 0; i < a.out.out.size(); ++i) {
    CHECK(bf16_to_float(b.out.out[i]) == 2.0f * bf16_to_float(a.out.out[i]));
  }
}
