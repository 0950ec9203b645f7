// Every other backend against the CPU backend (the CPU itself is the reference here, so these are
// CUDA cases): the registry's against == kCpu prefill cases (cases.cpp: lengths, head counts,
// gates, varlen layouts, strong decay and long memory, state dtypes, split sequences), each also
// checked for poison left in its outputs, changed guard bytes and a written unused state row.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

KDA_CUDA_CASE("prefill matches the CPU backend") {
  for (const PrefillCase& pc : prefill_cases()) {
    if (pc.against != Against::kCpu || !runs_on(pc.backends, cuda)) continue;
    // One subcase per entry: `-sc=*varlen*` picks entries by name (the sanitizer runs do).
    SUBCASE(pc.name.c_str()) {
      const std::string& label = pc.name;
      const KdaCase c = make_case(pc.options);
      PrefillOptions opt;
      opt.extra_state_rows = 1;
      opt.cuda.schedule = pc.schedule;
      const PrefillRun gpu = cuda.prefill(c, opt);
      REQUIRE_MESSAGE(gpu.status.ok(), label << ": " << gpu.status.to_string());
      const PrefillRun cpu = cpu_runner().prefill(c);
      REQUIRE(cpu.status.ok());
      // Against the CPU backend and against the fp64 recurrence (the accuracy measure: the CPU's
      // own bf16 output rounding and fp32 sums are in e_out).
      const Reference ref = reference_forward(c);
      const double e_out = rel_error_bf16(gpu.out.out, to_doubles(cpu.out.out));
      const double e64_out = rel_error_bf16(gpu.out.out, ref.out);
      double e_state = 0, e64_state = 0;
      if (c.problem.final_state_dtype != DType::kNone) {
        const std::vector<double> gpu_state = gpu.out.final_state();
        e_state = rel_error(gpu_state, cpu.out.final_state());
        e64_state = rel_error(gpu_state, ref.final_state);
      }
      std::printf("%-58s out %.2e  state %.2e  | vs fp64: out %.2e  state %.2e\n", label.c_str(),
                  e_out, e_state, e64_out, e64_state);
      CHECK_MESSAGE(all_finite(gpu.out.out),
                    label << ": an output element was not written (poison left)");
      if (!gpu.out.final_f32.empty()) {
        CHECK_MESSAGE(all_finite(gpu.out.final_f32), label << ": state poison left");
      }
      if (!gpu.out.final_bf16.empty()) {
        CHECK_MESSAGE(all_finite(gpu.out.final_bf16), label << ": state poison left");
      }
      CHECK_MESSAGE(gpu.guards_intact,
                    label << ": bytes outside the outputs (or unused state rows) changed");
      CHECK_MESSAGE(e_out <= pc.out_tol, label << ": out rel error " << e_out);
      CHECK_MESSAGE(e_state <= pc.state_tol, label << ": state rel error " << e_state);
      const double fp64_state_tol = c.problem.final_state_dtype == DType::kBF16
                                        ? std::max(pc.fp64_state_tol, kGpuFp64Bf16StateTol)
                                        : pc.fp64_state_tol;
      CHECK_MESSAGE(e64_out <= pc.fp64_out_tol,
                    label << ": out rel error against fp64 " << e64_out);
      CHECK_MESSAGE(e64_state <= fp64_state_tol,
                    label << ": state rel error against fp64 " << e64_state);
    }
  }
}

KDA_CUDA_CASE("prefill: a decay far below e^-88 inside a chunk stays finite") {
  // The softplus gate with dt_bias + 6 decays by far more than e^-88 inside a chunk: any exp(-G)
  // would overflow. Check no NaN or Inf appears and the state stays bounded.
  CaseOptions o = cuda_options(4, 310);
  o.seq_len = 64;
  o.dt_bias_shift = 6.0f;
  const KdaCase c = make_case(o);
  const PrefillRun gpu = cuda.prefill(c);
  REQUIRE(gpu.status.ok());
  CHECK(all_finite(gpu.out.out));
  CHECK(all_finite(gpu.out.final_f32));
  const PrefillRun cpu = cpu_runner().prefill(c);
  REQUIRE(cpu.status.ok());
  CHECK(rel_error_bf16(gpu.out.out, to_doubles(cpu.out.out)) <= kGpuOutTol);
}

// Without a device too: the CUDA cases above must reach each of the prepare kernel's three paths
// (a gate regime the registry lost would leave a path untested without any failure).
TEST_CASE("the CUDA cases reach every prepare path (reference 0, middle, exact) [cpu]") {
  PreparePaths total;
  for (const PrefillCase& pc : prefill_cases()) {
    // The large shapes repeat the small ones' gate regimes; skipping them keeps this test fast.
    const CaseOptions& o = pc.options;
    std::int64_t tokens = o.seq_len * o.batch;
    if (!o.lengths.empty()) tokens = std::accumulate(o.lengths.begin(), o.lengths.end(), 0LL);
    if ((pc.backends & kOnCuda) == 0 || o.head_dim_k != 128 || tokens * o.heads > 8192) continue;
    const PreparePaths p = prepare_paths(pc.options);
    total.zero_ref += p.zero_ref;
    total.middle_ref += p.middle_ref;
    total.exact += p.exact;
  }
  MESSAGE("chunk-heads by path: reference 0 " << total.zero_ref << ", middle " << total.middle_ref
                                              << ", exact " << total.exact);
  CHECK(total.zero_ref > 0);
  CHECK(total.middle_ref > 0);
  CHECK(total.exact > 0);
}
