// Varlen layouts beyond the registry's accuracy cases (cases.cpp holds the mixed, empty, one-token
// and many-tiny-sequence cases): zero sequences, varlen equal to fixed-length rows, every output
// element written (zero-length sequences get zero states, not poison).
#include <doctest/doctest.h>

#include <chrono>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

KDA_MATRIX_CASE("prefill of zero sequences and zero tokens") {
  CaseOptions o = runner.backend() == Backend::kCpu ? CaseOptions{} : cuda_options(4, 25);
  if (runner.backend() == Backend::kCpu) o.heads = 2;
  o.varlen = true;  // N = 0 sequences, T = 0
  const KdaCase c = make_case(o);
  REQUIRE(c.problem.num_seqs == 0);
  const PrefillRun got = runner.prefill(c);
  CHECK_MESSAGE(got.status.ok(), got.status.to_string());
  CHECK(got.guards_intact);
}

KDA_CPU_CASE("2^40 empty fixed-length rows with no state to write return at once") {
  // Nothing to compute and nothing to write: not walked row by row (hours at 2^40 rows).
  Problem p;
  p.batch = std::int64_t{1} << 40;
  p.seq_len = 0;
  p.num_heads = 1;
  p.head_dim_k = p.head_dim_v = 8;
  const std::vector<float> A_log(1, 0.0f), dt_bias(8, 0.0f);
  Tensors t;
  t.A_log = A_log.data();
  t.dt_bias = dt_bias.data();
  std::size_t bytes = 0;
  REQUIRE(workspace_size(p, Backend::kCpu, &bytes).ok());
  std::vector<unsigned char> workspace(bytes + 64);
  const auto start = std::chrono::steady_clock::now();
  const Status st = forward_cpu(p, t, Workspace{workspace.data(), workspace.size()});
  CHECK_MESSAGE(st.ok(), st.to_string());
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

KDA_CPU_CASE("varlen equals fixed-length rows of the same tokens") {
  CaseOptions o;
  o.batch = 3;
  o.seq_len = 10;
  o.heads = 2;
  o.initial_state_dtype = DType::kF32;
  o.seed = 5;
  const KdaCase fixed = make_case(o);
  KdaCase var = fixed;
  var.problem.batch = 1;
  var.problem.seq_len = 30;
  var.problem.num_seqs = 3;
  var.problem.cu_seqlens_dtype = DType::kI64;
  var.cu_seqlens = {0, 10, 20, 30};
  const PrefillRun a = cpu_runner().prefill(fixed), b = cpu_runner().prefill(var);
  REQUIRE(a.status.ok());
  REQUIRE(b.status.ok());
  CHECK(a.out.out == b.out.out);
  CHECK(same_bits(a.out.final_f32, b.out.final_f32));
}

KDA_CPU_CASE("poisoned outputs are fully overwritten") {
  CaseOptions o;
  o.lengths = {7, 0, 1, 18};
  o.heads = 3;
  o.head_dim_k = 8;
  o.head_dim_v = 12;
  o.final_state_dtype = DType::kBF16;
  o.seed = 81;
  const KdaCase c = make_case(o);
  const PrefillRun got = cpu_runner().prefill(c);  // out and the final state are poisoned first
  REQUIRE(got.status.ok());
  CHECK(got.guards_intact);
  CHECK(all_finite(got.out.out));
  CHECK(all_finite(got.out.final_bf16));  // includes the zero-length sequence: zeros, not poison
  const std::size_t per_seq = static_cast<std::size_t>(3 * 8 * 12);
  for (std::size_t i = per_seq; i < 2 * per_seq; ++i) CHECK(got.out.final_bf16[i] == 0);
}
