// GPU tests of the CUDA decode (label `gpu`): against the CPU decode on the same pool; prefill + decode
// steps equal one longer prefill; slots not named and padding rows stay bitwise untouched; a
// graph-captured step equals an eager one. Prints "KDA_SKIP: ..." without a device.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
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

// A decode step's inputs: a fixed-length case of B rows of `tokens` tokens (same layout as decode).
struct DecodeCase {
  KdaCase tokens;  // q, k, v, g, beta, A_log, dt_bias
  DecodeProblem problem;
  std::vector<std::int32_t> slots;
  std::vector<float> pool;  // [num_slots, H, V, K] as values (bf16-representable when bf16)
};

DecodeCase make_decode_case(std::int64_t B, std::int64_t tokens, std::int64_t H, std::int64_t num_slots,
                            DType state_dtype, GateMode gate, std::uint64_t seed) {
  DecodeCase d;
  CaseOptions o;
  o.heads = H;
  o.head_dim_k = o.head_dim_v = 128;
  o.batch = B;
  o.seq_len = tokens;
  o.gate = gate;
  o.seed = seed;
  o.final_state_dtype = DType::kNone;
  d.tokens = make_case(o);
  d.problem.batch = B;
  d.problem.tokens = tokens;
  d.problem.num_heads = H;
  d.problem.num_slots = num_slots;
  d.problem.state_dtype = state_dtype;
  d.problem.gate = gate;
  Rng rng(seed + 1);
  d.pool.resize(static_cast<std::size_t>(num_slots * H * 128 * 128));
  for (auto& x : d.pool) x = static_cast<float>(0.3 * rng.normal());
  if (state_dtype == DType::kBF16) d.pool = to_floats(to_bf16(d.pool));
  // Distinct slots, shuffled, with padding rows (-1) every fourth sequence.
  std::vector<std::int32_t> free_slots;
  for (std::int32_t s = 0; s < num_slots; ++s) free_slots.push_back(s);
  for (std::size_t i = free_slots.size(); i > 1; --i) std::swap(free_slots[i - 1], free_slots[static_cast<std::size_t>(rng.uniform(0, double(i)))]);
  for (std::int64_t b = 0; b < B; ++b) d.slots.push_back(b % 4 == 3 ? -1 : free_slots[static_cast<std::size_t>(b)]);
  return d;
}

std::vector<unsigned char> pool_bytes(const DecodeCase& d) {
  std::vector<unsigned char> b;
  if (d.problem.state_dtype == DType::kF32) {
    b.resize(d.pool.size() * 4);
    std::memcpy(b.data(), d.pool.data(), b.size());
  } else {
    auto h = to_bf16(d.pool);
    b.resize(h.size() * 2);
    std::memcpy(b.data(), h.data(), b.size());
  }
  return b;
}

struct DecodeResult {
  Status status;
  std::vector<unsigned char> pool;
  std::vector<std::uint16_t> out;
};

DecodeTensors host_tensors(const DecodeCase& d) {
  DecodeTensors t;
  t.q = d.tokens.q.data();
  t.k = d.tokens.k.data();
  t.v = d.tokens.v.data();
  t.g = d.tokens.g.data();
  t.beta = d.tokens.beta.data();
  t.A_log = d.tokens.A_log.data();
  t.dt_bias = d.tokens.dt_bias.data();
  t.slots = d.slots.data();
  return t;
}

DecodeResult run_cpu_decode(const DecodeCase& d) {
  DecodeResult r;
  r.pool = pool_bytes(d);
  r.out.assign(static_cast<std::size_t>(d.tokens.out_elems()), 0xFFFF);
  DecodeTensors t = host_tensors(d);
  t.state_pool = r.pool.data();
  t.out = r.out.data();
  r.status = decode_cpu(d.problem, t);
  return r;
}

DecodeResult run_gpu_decode(const DecodeCase& d, int repeats = 1) {
  DecodeResult r;
  DeviceCase dc(d.tokens);
  DeviceBuffer slots = DeviceBuffer::from(d.slots);
  DeviceBuffer pool = DeviceBuffer::from(pool_bytes(d));
  DeviceBuffer out(static_cast<std::size_t>(d.tokens.out_elems()) * 2);
  out.fill(0xFF);
  DecodeTensors t = dc.decode_tensors();
  t.slots = static_cast<const std::int32_t*>(slots.get());
  t.state_pool = pool.get();
  t.out = out.get();
  for (int i = 0; i < repeats && r.status.ok(); ++i) r.status = decode_cuda(d.problem, t, nullptr);
  if (r.status.ok()) r.status = stream_synchronize(nullptr);
  r.pool = pool.download<unsigned char>();
  r.out = out.download<std::uint16_t>();
  if (!pool.guards_intact() || !out.guards_intact()) r.status = Status(StatusCode::kInternal, "guard bytes changed");
  return r;
}

std::vector<double> pool_values(const std::vector<unsigned char>& bytes, DType dt) {
  if (dt == DType::kF32) {
    std::vector<float> f(bytes.size() / 4);
    std::memcpy(f.data(), bytes.data(), bytes.size());
    return to_doubles(f);
  }
  std::vector<std::uint16_t> h(bytes.size() / 2);
  std::memcpy(h.data(), bytes.data(), bytes.size());
  return to_doubles(h);
}

}  // namespace

TEST_CASE("cuda decode matches the CPU decode / and unnamed slots and padding rows stay untouched") {
  if (!gpu_or_skip()) return;
  std::uint64_t seed = 1000;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (std::int64_t tokens : {1, 4, 16}) {
      for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
        const std::int64_t B = 13, H = 8, slots = 40;
        const DecodeCase d = make_decode_case(B, tokens, H, slots, dt, gate, ++seed);
        const DecodeResult cpu = run_cpu_decode(d);
        REQUIRE_MESSAGE(cpu.status.ok(), cpu.status.to_string());
        const DecodeResult gpu = run_gpu_decode(d);
        REQUIRE_MESSAGE(gpu.status.ok(), gpu.status.to_string());
        const std::string label = std::string("decode ") + to_string(dt) + " tokens=" + std::to_string(tokens) +
                                  (gate == GateMode::kSoftplus ? " softplus" : " lower_bound");
        const double e_pool = rel_error(pool_values(gpu.pool, dt), pool_values(cpu.pool, dt));
        // Padding rows keep their poison on both backends: compare the written rows only.
        const std::size_t row = static_cast<std::size_t>(tokens * H * 128);
        std::vector<double> g_rows, c_rows;
        for (std::int64_t b = 0; b < B; ++b) {
          if (d.slots[static_cast<std::size_t>(b)] < 0) continue;
          for (std::size_t i = b * row; i < (b + 1) * row; ++i) {
            g_rows.push_back(bf16_to_float(gpu.out[i]));
            c_rows.push_back(bf16_to_float(cpu.out[i]));
          }
        }
        const double e_out = rel_error(g_rows, c_rows);
        std::printf("%-40s out %.2e  pool %.2e\n", label.c_str(), e_out, e_pool);
        CHECK(e_pool <= 5e-3);
        CHECK(e_out <= 5e-3);
        // Slots not named in the step are bitwise what they were.
        const std::vector<unsigned char> before = pool_bytes(d);
        const std::size_t slot_bytes = before.size() / static_cast<std::size_t>(slots);
        std::vector<bool> named(static_cast<std::size_t>(slots), false);
        for (auto s : d.slots) if (s >= 0) named[static_cast<std::size_t>(s)] = true;
        for (std::int64_t s = 0; s < slots; ++s) {
          if (named[static_cast<std::size_t>(s)]) continue;
          CHECK_MESSAGE(std::memcmp(gpu.pool.data() + s * slot_bytes, before.data() + s * slot_bytes, slot_bytes) == 0,
                        label << ": slot " << s << " changed");
        }
        // Padding rows of out keep their poison; named rows are all written.
        for (std::int64_t b = 0; b < B; ++b) {
          const bool pad = d.slots[static_cast<std::size_t>(b)] < 0;
          bool poisoned = true, finite = true;
          for (std::size_t i = b * row; i < (b + 1) * row; ++i) {
            poisoned = poisoned && gpu.out[i] == 0xFFFF;
            finite = finite && std::isfinite(bf16_to_float(gpu.out[i]));
          }
          if (pad) CHECK_MESSAGE(poisoned, label << ": padding row " << b << " written");
          else CHECK_MESSAGE(finite, label << ": row " << b << " not fully written");
        }
      }
    }
  }
}

TEST_CASE("cuda prefill of n tokens then m decode steps equals one prefill of n + m") {
  if (!gpu_or_skip()) return;
  const std::int64_t n = 77, m = 5, H = 4;
  CaseOptions o;
  o.heads = H;
  o.head_dim_k = o.head_dim_v = 128;
  o.batch = 3;
  o.seq_len = n + m;
  o.seed = 2000;
  o.initial_state_dtype = DType::kF32;
  o.final_state_dtype = DType::kF32;
  const KdaCase whole = make_case(o);
  GpuRun full = run_cuda(whole);
  REQUIRE(full.status.ok());
  const KdaCase head = split_tokens(whole, 0, n, DType::kF32, whole.initial_state, DType::kF32);
  GpuRun pre = run_cuda(head);
  REQUIRE(pre.status.ok());
  // The prefill's final states become slots 0..2 of a pool; decode one token at a time.
  std::vector<float> pool = pre.out.final_f32;
  const std::int64_t row = H * 128;
  std::vector<double> stitched_tail;
  for (std::int64_t step = 0; step < m; ++step) {
    const KdaCase tok = split_tokens(whole, n + step, n + step + 1, DType::kNone, {}, DType::kNone);
    DecodeCase d;
    d.tokens = tok;
    d.problem.batch = 3;
    d.problem.tokens = 1;
    d.problem.num_heads = H;
    d.problem.num_slots = 3;
    d.problem.state_dtype = DType::kF32;
    d.problem.gate = whole.problem.gate;
    d.slots = {0, 1, 2};
    d.pool = pool;
    DecodeResult r = run_gpu_decode(d);
    REQUIRE(r.status.ok());
    std::vector<double> pv = pool_values(r.pool, DType::kF32);
    pool.assign(pv.begin(), pv.end());
    for (std::int64_t b = 0; b < 3; ++b) {
      for (std::int64_t i = 0; i < row; ++i) stitched_tail.push_back(bf16_to_float(r.out[b * row + i]));
    }
  }
  // The whole prefill's last m tokens of every row, in the same (step, row) order.
  std::vector<double> ref_tail;
  for (std::int64_t step = 0; step < m; ++step) {
    for (std::int64_t b = 0; b < 3; ++b) {
      for (std::int64_t i = 0; i < row; ++i) {
        ref_tail.push_back(bf16_to_float(full.out.out[(b * (n + m) + n + step) * row + i]));
      }
    }
  }
  const double e_out = rel_error(stitched_tail, ref_tail);
  const double e_state = rel_error(to_doubles(pool), full.out.final_state());
  std::printf("prefill %lld + %lld decode steps vs prefill %lld: out %.2e state %.2e\n", (long long)n,
              (long long)m, (long long)(n + m), e_out, e_state);
  CHECK(e_out <= 5e-3);
  CHECK(e_state <= 5e-3);
}

TEST_CASE("cuda decode: a graph of decode steps equals the same steps run eagerly") {
  if (!gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  const DecodeCase d = make_decode_case(9, 2, 4, 12, DType::kF32, GateMode::kSoftplus, 3000);
  const DecodeResult eager = run_gpu_decode(d, 3);
  REQUIRE(eager.status.ok());
  DeviceCase dc(d.tokens);
  DeviceBuffer slots = DeviceBuffer::from(d.slots);
  DeviceBuffer pool = DeviceBuffer::from(pool_bytes(d));
  DeviceBuffer out(static_cast<std::size_t>(d.tokens.out_elems()) * 2);
  out.fill(0xFF);
  REQUIRE(stream_synchronize(nullptr).ok());
  DecodeTensors t = dc.decode_tensors();
  t.slots = static_cast<const std::int32_t*>(slots.get());
  t.state_pool = pool.get();
  t.out = out.get();
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaGraph_t graph;
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  Status st;
  for (int i = 0; i < 3; ++i) st = decode_cuda(d.problem, t, s);
  REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
  REQUIRE(st.ok());
  cudaGraphExec_t exec;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(pool.download<unsigned char>() == eager.pool);
  CHECK(out.download<std::uint16_t>() == eager.out);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
#endif
}
