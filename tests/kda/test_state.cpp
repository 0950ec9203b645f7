// The recurrent state across calls: one call equals two calls chained through the state (split
// round trips, cases.cpp split_cases), a bf16 state between the calls, and an in-place state
// (final_state == initial_state) equal to the out-of-place result.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

KDA_MATRIX_CASE("split round trip: one call equals two calls chained through the state") {
  for (const SplitCase& sc : split_cases()) {
    if (!runs_on(sc.backends, runner)) continue;
    CAPTURE(sc.name);
    const KdaCase whole = make_case(sc.options);
    const std::int64_t T = whole.problem.seq_len;
    const PrefillRun full = runner.prefill(whole);
    REQUIRE(full.status.ok());
    for (std::int64_t cut : sc.cuts) {
      CAPTURE(cut);
      const KdaCase a = split_tokens(whole, 0, cut, DType::kF32, whole.initial_state, DType::kF32);
      const PrefillRun ra = runner.prefill(a);
      REQUIRE(ra.status.ok());
      const KdaCase b = split_tokens(whole, cut, T, DType::kF32, ra.out.final_f32, DType::kF32);
      const PrefillRun rb = runner.prefill(b);
      REQUIRE(rb.status.ok());
      // Stitch the two outputs back into [B, T, H, V].
      const std::int64_t row = whole.problem.num_heads * whole.problem.head_dim_v;
      std::vector<std::uint16_t> stitched;
      for (std::int64_t bi = 0; bi < whole.problem.batch; ++bi) {
        stitched.insert(stitched.end(), ra.out.out.begin() + bi * cut * row,
                        ra.out.out.begin() + (bi + 1) * cut * row);
        const std::int64_t rest = T - cut;
        stitched.insert(stitched.end(), rb.out.out.begin() + bi * rest * row,
                        rb.out.out.begin() + (bi + 1) * rest * row);
      }
      if (sc.tol == 0.0) {  // bitwise
        CHECK(rb.out.final_f32 == full.out.final_f32);
        CHECK(stitched == full.out.out);
      } else {
        const double e_out = rel_error_bf16(stitched, to_doubles(full.out.out));
        const double e_state = rel_error(rb.out.final_state(), full.out.final_state());
        std::printf("split at %lld: out %.2e state %.2e\n", static_cast<long long>(cut), e_out,
                    e_state);
        CHECK(e_out <= sc.tol);
        CHECK(e_state <= sc.tol);
      }
    }
  }
}

KDA_CPU_CASE("split round trip through a bf16 state: within tolerance") {
  const SplitCase& sc = split_cases().front();
  REQUIRE(runs_on(sc.backends, cpu_runner()));
  const KdaCase whole = make_case(sc.options);
  const std::int64_t T = whole.problem.seq_len;
  const PrefillRun full = cpu_runner().prefill(whole);
  REQUIRE(full.status.ok());
  for (std::int64_t cut : sc.cuts) {
    CAPTURE(cut);
    const KdaCase first =
        split_tokens(whole, 0, cut, DType::kF32, whole.initial_state, DType::kBF16);
    const PrefillRun a = cpu_runner().prefill(first);
    REQUIRE(a.status.ok());
    const KdaCase second =
        split_tokens(whole, cut, T, DType::kBF16, to_floats(a.out.final_bf16), DType::kF32);
    const PrefillRun b = cpu_runner().prefill(second);
    REQUIRE(b.status.ok());
    CHECK(rel_error(b.out.final_f32, to_doubles(full.out.final_f32)) <= kBf16Tol);
  }
}

KDA_MATRIX_CASE("in-place state: final_state == initial_state gives the out-of-place result") {
  const bool cpu = runner.backend() == Backend::kCpu;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    CAPTURE(std::string(to_string(dt)));
    CaseOptions o;
    if (cpu) {
      o.lengths = {3, 0, 20, 1};
      o.heads = 2;
      o.seed = 71;
    } else {
      o = cuda_options(4, 420 + static_cast<int>(dt));
      o.lengths = {50, 1, 0, 33};
    }
    o.initial_state_dtype = dt;
    o.final_state_dtype = dt;
    const KdaCase c = make_case(o);
    PrefillOptions in_place;
    in_place.in_place = true;
    const PrefillRun got = runner.prefill(c, in_place);
    REQUIRE_MESSAGE(got.status.ok(), got.status.to_string());
    CHECK(got.guards_intact);
    if (cpu) {  // the same backend out of place: bitwise
      const PrefillRun expected = runner.prefill(c);
      REQUIRE(expected.status.ok());
      CHECK(got.out.out == expected.out.out);
      CHECK(got.out.final_bf16 == expected.out.final_bf16);
      CHECK(same_bits(got.out.final_f32, expected.out.final_f32));
    } else {  // against the CPU backend out of place
      const PrefillRun expected = cpu_runner().prefill(c);
      REQUIRE(expected.status.ok());
      const double e = rel_error(got.out.final_state(), expected.out.final_state());
      std::printf("in-place state %s: state %.2e\n", to_string(dt), e);
      CHECK(e <= kGpuTol);
      CHECK(rel_error_bf16(got.out.out, to_doubles(expected.out.out)) <= kGpuOutTol);
    }
  }
}
