// GPU tests (label `gpu`) of segment transitions: segment_transition_cuda against the CPU backend's,
// apply_transition_cuda against apply_transition_cpu, and a sequence cut in two on the GPU whose
// chained transitions give the same final state as forward_cuda over both halves.
#include <doctest/doctest.h>

#include <cstdio>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda_reference.hpp"

using namespace kda;
using namespace kda::test;

namespace {

struct Transition {
  std::vector<float> p_t, h_t;
};

Problem stateless(const KdaCase& c) {
  Problem p = c.problem;
  p.initial_state_dtype = p.final_state_dtype = DType::kNone;
  return p;
}

Status transition_on(Backend backend, const KdaCase& c, Transition* out) {
  const Problem p = stateless(c);
  const std::size_t pairs = static_cast<std::size_t>(c.num_seqs() * p.num_heads);
  const std::size_t elems = pairs * 128 * 128;
  std::size_t bytes = 0;
  if (Status st = transition_workspace_size(p, backend, &bytes); !st) return st;
  if (backend == Backend::kCpu) {
    out->p_t.assign(elems, kPoisonF32);
    out->h_t.assign(elems, kPoisonF32);
    std::vector<unsigned char> ws(bytes);
    Tensors t = c.inputs();
    t.initial_state = nullptr;
    return segment_transition_cpu(p, t, out->p_t.data(), out->h_t.data(), Workspace{ws.data(), bytes});
  }
  DeviceCase d(c);
  DeviceBuffer pt(elems * 4), ht(elems * 4), ws(bytes);
  pt.fill(0xFF);
  ht.fill(0xFF);
  Tensors t = d.tensors();
  t.initial_state = nullptr;
  Status st = segment_transition_cuda(p, t, static_cast<float*>(pt.get()), static_cast<float*>(ht.get()),
                                      Workspace{ws.get(), bytes}, nullptr);
  if (st.ok()) st = stream_synchronize(nullptr);
  out->p_t = pt.download<float>();
  out->h_t = ht.download<float>();
  CHECK(pt.guards_intact());
  CHECK(ht.guards_intact());
  return st;
}

CaseOptions gpu_options(std::vector<std::int64_t> lengths, GateMode gate, std::uint64_t seed) {
  CaseOptions o;
  o.heads = 3;
  o.head_dim_k = o.head_dim_v = 128;
  o.lengths = std::move(lengths);
  o.gate = gate;
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  o.seed = seed;
  return o;
}

}  // namespace

TEST_CASE("cuda segment transitions match the CPU backend's") {
  if (!gpu_or_skip()) return;
  for (GateMode gate : {GateMode::kLowerBound, GateMode::kSoftplus}) {
    const KdaCase c = make_case(gpu_options({0, 1, 77, 1000}, gate, gate == GateMode::kSoftplus ? 11 : 12));
    Transition gpu, cpu;
    REQUIRE(transition_on(Backend::kCuda, c, &gpu).ok());
    REQUIRE(transition_on(Backend::kCpu, c, &cpu).ok());
    CHECK(all_finite(gpu.p_t));
    CHECK(all_finite(gpu.h_t));
    const double ep = rel_error(gpu.p_t, to_doubles(cpu.p_t)), eh = rel_error(gpu.h_t, to_doubles(cpu.h_t));
    std::printf("transition %s: P^T rel error %.2e, H^T %.2e\n", to_string(gate), ep, eh);
    CHECK(ep <= 5e-3);
    CHECK(eh <= 5e-3);
  }
}

TEST_CASE("cuda apply_transition equals the CPU's, also in place") {
  if (!gpu_or_skip()) return;
  const std::int64_t pairs = 5;
  const std::size_t n = static_cast<std::size_t>(pairs) * 128 * 128;
  Rng rng(21);
  std::vector<float> s(n), pt(n), ht(n);
  for (auto* v : {&s, &pt, &ht}) {
    for (float& x : *v) x = static_cast<float>(0.1 * rng.normal());
  }
  std::vector<float> cpu(n);
  REQUIRE(apply_transition_cpu(pairs, 128, 128, s.data(), pt.data(), ht.data(), cpu.data()).ok());
  DeviceBuffer ds = DeviceBuffer::from(s), dp = DeviceBuffer::from(pt), dh = DeviceBuffer::from(ht);
  const float* in = static_cast<const float*>(ds.get());
  REQUIRE(apply_transition_cuda(pairs, 128, 128, in, static_cast<const float*>(dp.get()),
                                static_cast<const float*>(dh.get()), static_cast<float*>(ds.get()), nullptr)
              .ok());
  REQUIRE(stream_synchronize(nullptr).ok());
  const std::vector<float> gpu = ds.download<float>();
  const double e = rel_error(gpu, to_doubles(cpu));
  std::printf("apply_transition in place: rel error %.2e\n", e);
  CHECK(e <= 1e-5);
}

TEST_CASE("cuda: a sequence cut in two, chained through transitions, equals one prefill") {
  if (!gpu_or_skip()) return;
  CaseOptions o = gpu_options({}, GateMode::kSoftplus, 31);
  o.batch = 2;
  o.seq_len = 1500;
  const KdaCase whole = make_case(o);
  const KdaCase a = split_tokens(whole, 0, 700, DType::kNone, {}, DType::kNone);
  const KdaCase b = split_tokens(whole, 700, 1500, DType::kNone, {}, DType::kNone);
  Transition ta, tb;
  REQUIRE(transition_on(Backend::kCuda, a, &ta).ok());
  REQUIRE(transition_on(Backend::kCuda, b, &tb).ok());
  const std::int64_t pairs = 2 * o.heads;
  std::vector<float> mid(whole.initial_state.size()), fin(mid.size());
  REQUIRE(apply_transition_cpu(pairs, 128, 128, whole.initial_state.data(), ta.p_t.data(), ta.h_t.data(),
                               mid.data())
              .ok());
  REQUIRE(apply_transition_cpu(pairs, 128, 128, mid.data(), tb.p_t.data(), tb.h_t.data(), fin.data()).ok());
  GpuRun one = run_cuda(whole);
  REQUIRE(one.status.ok());
  const double e = rel_error(fin, to_doubles(one.out.final_f32));
  std::printf("chained transitions vs one prefill (GPU): %.2e\n", e);
  CHECK(e <= 5e-3);
}
