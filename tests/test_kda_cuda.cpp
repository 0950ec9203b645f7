// GPU tests of the CUDA prefill (label `gpu`): the CUDA backend against the CPU backend (and the fp64
// reference) on fresh random cases, over lengths, heads, gates, varlen layouts and state dtypes; split
// round trips; bitwise repeatability; poisoned outputs all written; guard bytes and unused state rows
// untouched; a graph-captured forward equal to an eager one; errors reported before any launch.
// Every case prints "KDA_SKIP: ..." and returns when there is no device.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda_reference.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace kda;
using namespace kda::test;

namespace {

constexpr double kTol = 5e-3;

CaseOptions cuda_options(std::int64_t heads, std::uint64_t seed) {
  CaseOptions o;
  o.heads = heads;
  o.head_dim_k = o.head_dim_v = 128;
  o.seed = seed;
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  return o;
}

// Runs c on the GPU and on the CPU backend; checks the GPU result against the CPU one.
void check_against_cpu(const KdaCase& c, const std::string& label, int extra_state_rows = 1) {
  GpuRun gpu = run_cuda(c, extra_state_rows);
  REQUIRE_MESSAGE(gpu.status.ok(), label << ": " << gpu.status.to_string());
  Outputs cpu;
  REQUIRE(run_cpu(c, &cpu).ok());
  const double e_out = rel_error_bf16(gpu.out.out, to_doubles(cpu.out));
  double e_state = 0;
  if (c.problem.final_state_dtype != DType::kNone) e_state = rel_error(gpu.out.final_state(), cpu.final_state());
  std::printf("%-58s out %.2e  state %.2e\n", label.c_str(), e_out, e_state);
  CHECK_MESSAGE(all_finite(gpu.out.out), label << ": an output element was not written (poison left)");
  if (!gpu.out.final_f32.empty()) CHECK_MESSAGE(all_finite(gpu.out.final_f32), label << ": state poison left");
  if (!gpu.out.final_bf16.empty()) CHECK_MESSAGE(all_finite(gpu.out.final_bf16), label << ": state poison left");
  CHECK_MESSAGE(gpu.guards_intact, label << ": bytes outside the outputs (or unused state rows) changed");
  CHECK_MESSAGE(e_out <= kTol, label << ": out rel error " << e_out);
  CHECK_MESSAGE(e_state <= kTol, label << ": state rel error " << e_state);
}

}  // namespace

TEST_CASE("cuda prefill matches the CPU backend over lengths and head counts") {
  if (!gpu_or_skip()) return;
  struct Shape {
    std::int64_t T, H, B;
  };
  const Shape shapes[] = {{1, 1, 1},   {15, 4, 1},   {16, 4, 2},   {17, 4, 1},  {100, 32, 1},
                          {1000, 4, 1}, {4096, 32, 1}, {1000, 96, 1}, {333, 96, 3}};
  std::uint64_t seed = 100;
  for (const Shape& s : shapes) {
    for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
      CaseOptions o = cuda_options(s.H, ++seed);
      o.batch = s.B;
      o.seq_len = s.T;
      o.gate = gate;
      const KdaCase c = make_case(o);
      check_against_cpu(c, "T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) + " B=" +
                               std::to_string(s.B) + (gate == GateMode::kSoftplus ? " softplus" : " lower_bound"));
    }
  }
}

TEST_CASE("cuda prefill is as accurate as the fp64 reference demands") {
  if (!gpu_or_skip()) return;
  // KDA.md §4's accuracy case: T = 1024, H = 4, bounded gate, fp32 state in and out.
  for (GateMode gate : {GateMode::kLowerBound, GateMode::kSoftplus}) {
    CaseOptions o = cuda_options(4, gate == GateMode::kLowerBound ? 7 : 8);
    o.seq_len = 1024;
    o.gate = gate;
    const KdaCase c = make_case(o);
    GpuRun gpu = run_cuda(c);
    REQUIRE(gpu.status.ok());
    const Reference ref = reference_forward(c);
    const double e_out = rel_error_bf16(gpu.out.out, ref.out);
    const double e_state = rel_error(gpu.out.final_state(), ref.final_state);
    std::printf("vs fp64 reference, T=1024 H=4 %s: out %.2e state %.2e\n",
                gate == GateMode::kLowerBound ? "lower_bound" : "softplus", e_out, e_state);
    CHECK(e_out <= kTol);
    CHECK(e_state <= kTol);
  }
}

TEST_CASE("cuda prefill varlen: empty and one-token sequences / int32 and int64 / many tiny ones") {
  if (!gpu_or_skip()) return;
  for (DType cu : {DType::kI64, DType::kI32}) {
    CaseOptions o = cuda_options(4, cu == DType::kI64 ? 21 : 22);
    o.lengths = {0, 1, 17, 0, 100, 33, 1, 16, 15, 0};
    o.cu_seqlens_dtype = cu;
    check_against_cpu(make_case(o), std::string("varlen mixed ") + to_string(cu));
  }
  {
    CaseOptions o = cuda_options(4, 23);
    Rng rng(99);
    for (int i = 0; i < 64; ++i) o.lengths.push_back(static_cast<std::int64_t>(rng.uniform(0, 6)));
    check_against_cpu(make_case(o), "64 tiny sequences (0..5 tokens)");
  }
  {
    CaseOptions o = cuda_options(32, 24);
    o.lengths = {1300, 547, 2048, 963, 271, 3063};
    o.gate = GateMode::kLowerBound;
    check_against_cpu(make_case(o), "KDA.md varlen 1300,547,2048,963,271,3063 H=32");
  }
  {
    CaseOptions o = cuda_options(4, 25);
    o.varlen = true;  // N = 0 sequences, T = 0
    GpuRun gpu = run_cuda(make_case(o));
    CHECK(gpu.status.ok());
  }
}

TEST_CASE("cuda prefill: strong decay and long memory / both gates") {
  if (!gpu_or_skip()) return;
  std::uint64_t seed = 300;
  for (float shift : {3.0f, -4.0f}) {
    for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
      CaseOptions o = cuda_options(8, ++seed);
      o.seq_len = 700;
      o.gate = gate;
      o.dt_bias_shift = shift;
      check_against_cpu(make_case(o), std::string(shift > 0 ? "strong decay " : "long memory ") +
                                          (gate == GateMode::kSoftplus ? "softplus" : "lower_bound"));
    }
  }
  // The softplus gate with dt_bias + 3 decays by far more than e^-88 inside a chunk: any exp(-G) would
  // overflow. Check no NaN or Inf appears and the state stays bounded.
  CaseOptions o = cuda_options(4, 310);
  o.seq_len = 64;
  o.dt_bias_shift = 6.0f;
  const KdaCase c = make_case(o);
  GpuRun gpu = run_cuda(c);
  REQUIRE(gpu.status.ok());
  CHECK(all_finite(gpu.out.out));
  CHECK(all_finite(gpu.out.final_f32));
  Outputs cpu;
  REQUIRE(run_cpu(c, &cpu).ok());
  CHECK(rel_error_bf16(gpu.out.out, to_doubles(cpu.out)) <= kTol);
}

TEST_CASE("cuda prefill: every state combination / and in-place state") {
  if (!gpu_or_skip()) return;
  std::uint64_t seed = 400;
  for (DType in : {DType::kNone, DType::kBF16, DType::kF32}) {
    for (DType out : {DType::kNone, DType::kBF16, DType::kF32}) {
      CaseOptions o = cuda_options(4, ++seed);
      o.lengths = {37, 0, 64, 5};
      o.initial_state_dtype = in;
      o.final_state_dtype = out;
      check_against_cpu(make_case(o), std::string("state in ") + to_string(in) + " out " + to_string(out));
    }
  }
  // In place: final_state == initial_state.
  for (DType dt : {DType::kF32, DType::kBF16}) {
    CaseOptions o = cuda_options(4, 420 + static_cast<int>(dt));
    o.lengths = {50, 1, 0, 33};
    o.initial_state_dtype = dt;
    o.final_state_dtype = dt;
    const KdaCase c = make_case(o);
    DeviceCase d(c);
    DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2);
    std::size_t ws_bytes = 0;
    REQUIRE(workspace_size(c.problem, Backend::kCuda, &ws_bytes).ok());
    DeviceBuffer ws(ws_bytes);
    Tensors t = d.tensors();
    t.out = out.get();
    t.final_state = d.h0.get();
    REQUIRE(forward_cuda(c.problem, t, {ws.get(), ws.bytes()}, nullptr).ok());
    Outputs cpu;
    REQUIRE(run_cpu(c, &cpu).ok());
    std::vector<double> got = dt == DType::kF32 ? to_doubles(d.h0.download<float>())
                                                 : to_doubles(d.h0.download<std::uint16_t>());
    const double e = rel_error(got, cpu.final_state());
    std::printf("in-place state %s: state %.2e\n", to_string(dt), e);
    CHECK(e <= kTol);
    CHECK(rel_error_bf16(out.download<std::uint16_t>(), to_doubles(cpu.out)) <= kTol);
  }
}

TEST_CASE("cuda prefill: split round trip through the state equals one call") {
  if (!gpu_or_skip()) return;
  CaseOptions o = cuda_options(8, 500);
  o.batch = 2;
  o.seq_len = 777;
  const KdaCase whole = make_case(o);
  GpuRun full = run_cuda(whole);
  REQUIRE(full.status.ok());
  for (std::int64_t cut : {std::int64_t(1), std::int64_t(16), std::int64_t(301)}) {
    const KdaCase a = split_tokens(whole, 0, cut, DType::kF32, whole.initial_state, DType::kF32);
    GpuRun ra = run_cuda(a);
    REQUIRE(ra.status.ok());
    const KdaCase b = split_tokens(whole, cut, whole.problem.seq_len, DType::kF32, ra.out.final_f32, DType::kF32);
    GpuRun rb = run_cuda(b);
    REQUIRE(rb.status.ok());
    // Stitch the two outputs back into [B, T, H, V].
    const std::int64_t row = whole.problem.num_heads * whole.problem.head_dim_v;
    std::vector<std::uint16_t> stitched;
    for (std::int64_t bi = 0; bi < whole.problem.batch; ++bi) {
      stitched.insert(stitched.end(), ra.out.out.begin() + bi * cut * row, ra.out.out.begin() + (bi + 1) * cut * row);
      const std::int64_t rest = whole.problem.seq_len - cut;
      stitched.insert(stitched.end(), rb.out.out.begin() + bi * rest * row, rb.out.out.begin() + (bi + 1) * rest * row);
    }
    const double e_out = rel_error_bf16(stitched, to_doubles(full.out.out));
    const double e_state = rel_error(rb.out.final_state(), full.out.final_state());
    std::printf("split at %lld: out %.2e state %.2e\n", static_cast<long long>(cut), e_out, e_state);
    CHECK(e_out <= kTol);
    CHECK(e_state <= kTol);
  }
}

TEST_CASE("cuda prefill is bitwise repeatable") {
  if (!gpu_or_skip()) return;
  CaseOptions o = cuda_options(32, 600);
  o.lengths = {1000, 3, 0, 517, 2048};
  const KdaCase c = make_case(o);
  GpuRun first = run_cuda(c);
  REQUIRE(first.status.ok());
  for (int i = 0; i < 3; ++i) {
    GpuRun again = run_cuda(c);
    REQUIRE(again.status.ok());
    CHECK(again.out.out == first.out.out);
    CHECK(std::memcmp(again.out.final_f32.data(), first.out.final_f32.data(), first.out.final_f32.size() * 4) == 0);
  }
}

TEST_CASE("cuda prefill: a graph-captured forward equals the eager one bitwise") {
  if (!gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  CaseOptions o = cuda_options(16, 700);
  o.lengths = {300, 1, 129};
  o.cu_seqlens_dtype = DType::kI32;
  const KdaCase c = make_case(o);
  GpuRun eager = run_cuda(c);
  REQUIRE(eager.status.ok());

  DeviceCase d(c);
  DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2), ht(static_cast<std::size_t>(c.state_elems()) * 4);
  out.fill(0xFF);
  ht.fill(0xFF);
  std::size_t ws_bytes = 0;
  REQUIRE(workspace_size(c.problem, Backend::kCuda, &ws_bytes).ok());
  DeviceBuffer ws(ws_bytes);
  Tensors t = d.tensors();
  t.out = out.get();
  t.final_state = ht.get();
  REQUIRE(stream_synchronize(nullptr).ok());
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaGraph_t graph;
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  const Status st = forward_cuda(c.problem, t, {ws.get(), ws.bytes()}, s);
  REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  cudaGraphExec_t exec;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(out.download<std::uint16_t>() == eager.out.out);
  const auto state = ht.download<float>();
  CHECK(std::memcmp(state.data(), eager.out.final_f32.data(), state.size() * 4) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
#endif
}

TEST_CASE("cuda prefill reports bad input before launching anything") {
  if (!gpu_or_skip()) return;
  CaseOptions o = cuda_options(4, 800);
  o.lengths = {20, 30};
  o.final_state_dtype = DType::kNone;
  KdaCase c = make_case(o);
  {
    KdaCase k64 = c;
    k64.problem.head_dim_k = 64;
    std::size_t bytes = 0;
    CHECK(can_implement(k64.problem, Backend::kCuda).code() == StatusCode::kUnsupported);
    (void)bytes;
  }
  DeviceCase d(c);
  DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2);
  out.fill(0xFF);
  std::size_t ws_bytes = 0;
  REQUIRE(workspace_size(c.problem, Backend::kCuda, &ws_bytes).ok());
  DeviceBuffer ws(ws_bytes);
  Tensors t = d.tensors();
  t.out = out.get();
  {
    const Status st = forward_cuda(c.problem, t, {ws.get(), ws_bytes - 1}, nullptr);
    CHECK_MESSAGE(st.code() == StatusCode::kWorkspaceTooSmall, st.to_string());
  }
  {
    Tensors bad = t;
    bad.q = nullptr;
    const Status st = forward_cuda(c.problem, bad, {ws.get(), ws_bytes}, nullptr);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("q") != std::string::npos);
  }
  {
    Tensors bad = t;
    bad.k = static_cast<const unsigned char*>(t.k) + 2;  // bf16-aligned, not 16-byte aligned
    const Status st = forward_cuda(c.problem, bad, {ws.get(), ws_bytes}, nullptr);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("k must be 16-byte aligned") != std::string::npos);
  }
  {
    std::vector<std::int64_t> broken = {0, 30, 20};  // decreasing, and not ending at T = 50
    Tensors bad = t;
    bad.cu_seqlens_host = broken.data();
    const Status st = forward_cuda(c.problem, bad, {ws.get(), ws_bytes}, nullptr);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("cu_seqlens") != std::string::npos);
  }
  REQUIRE(stream_synchronize(nullptr).ok());
  for (std::uint16_t x : out.download<std::uint16_t>()) {
    if (x != 0xFFFF) {
      FAIL("a failed call wrote its output");
      break;
    }
  }
}
