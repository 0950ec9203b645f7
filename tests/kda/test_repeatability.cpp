// Bitwise repeatability: the same case run again gives the same bits (cases.cpp repeat_cases, on
// every backend), and on the CPU 1, 2 and an automatic number of threads agree bitwise.
#include <doctest/doctest.h>

#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

namespace {

bool bitwise_equal(const Outputs& a, const Outputs& b) {
  return a.out == b.out && a.final_bf16 == b.final_bf16 && same_bits(a.final_f32, b.final_f32);
}

}  // namespace

KDA_MATRIX_CASE("prefill is bitwise repeatable") {
  for (const RepeatCase& rc : repeat_cases()) {
    if (!runs_on(rc.backends, runner)) continue;
    CAPTURE(rc.name);
    const KdaCase c = make_case(rc.options);
    const PrefillRun first = runner.prefill(c);
    REQUIRE(first.status.ok());
    for (int i = 0; i < 3; ++i) {
      const PrefillRun again = runner.prefill(c);
      REQUIRE(again.status.ok());
      CHECK(bitwise_equal(again.out, first.out));
    }
  }
}

KDA_CPU_CASE("1 and 2 threads give bitwise equal results") {
  const KdaCase c = make_case(repeat_cases().front().options);  // varlen 30,1,0,64,17 bf16 -> f32
  for (bool fp64 : {false, true}) {
    CAPTURE(fp64);
    PrefillOptions opt;
    opt.cpu.fp64 = fp64;
    opt.cpu.num_threads = 1;
    const PrefillRun one = cpu_runner().prefill(c, opt);
    opt.cpu.num_threads = 2;
    const PrefillRun two = cpu_runner().prefill(c, opt);
    opt.cpu.num_threads = 0;  // automatic
    const PrefillRun many = cpu_runner().prefill(c, opt);
    REQUIRE(one.status.ok());
    REQUIRE(two.status.ok());
    REQUIRE(many.status.ok());
    CHECK(bitwise_equal(one.out, two.out));
    CHECK(bitwise_equal(one.out, many.out));
  }
}
