// GPU tests (label `gpu`) of the CUDA prefill through state slot indices and of its segment split
// (intracard context parallelism): pooled runs equal contiguous runs bitwise, unnamed pool entries
// keep their guards, an entry outside the pool is reported through the status word and runs as
// padding, chained calls on the same slots equal one call, and split sequences (long, low head
// count) match the CPU backend. Every case prints "KDA_SKIP: ..." and returns when there is no
// device.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda_reference.hpp"
#include "state_slots_util.hpp"

using namespace kda;
using namespace kda::test;

namespace {

constexpr double kTol = 5e-3;

struct PooledGpuRun {
  Status status;
  std::vector<std::uint16_t> out;
  std::vector<unsigned char> pool;
  std::uint32_t device_status = 0;
  bool guards_intact = true;
};

// Runs the pooled problem on the GPU in place (initial == final == pool); out poisoned first.
PooledGpuRun run_pooled_cuda(const SlotCase& sc) {
  PooledGpuRun r;
  DeviceCase d(sc.contiguous);
  DeviceBuffer pool = DeviceBuffer::from(sc.pool);
  DeviceBuffer slots = DeviceBuffer::from(sc.slots);
  DeviceBuffer out(static_cast<std::size_t>(sc.contiguous.out_elems()) * 2);
  out.fill(0xFF);
  DeviceBuffer status(4);
  status.fill(0);
  std::size_t ws_bytes = 0;
  r.status = workspace_size(sc.problem, Backend::kCuda, &ws_bytes);
  if (!r.status.ok()) return r;
  DeviceBuffer ws(ws_bytes);
  Tensors t = d.tensors();
  t.initial_state = pool.get();
  t.final_state = pool.get();
  t.state_slots = static_cast<const std::int32_t*>(slots.get());
  t.out = out.get();
  t.cu_seqlens_host = sc.contiguous.cu_seqlens_ptr();
  t.device_status = static_cast<std::uint32_t*>(status.get());
  r.status = forward_cuda(sc.problem, t, Workspace{ws.get(), ws.bytes()}, nullptr);
  if (r.status.ok()) r.status = stream_synchronize(nullptr);
  r.out = out.download<std::uint16_t>();
  r.pool = pool.download<unsigned char>();
  r.device_status = status.download<std::uint32_t>()[0];
  r.guards_intact = out.guards_intact() && pool.guards_intact() && ws.guards_intact();
  return r;
}

CaseOptions gpu_options(std::int64_t heads, std::vector<std::int64_t> lengths, DType state,
                        std::uint64_t seed) {
  CaseOptions o;
  o.heads = heads;
  o.head_dim_k = o.head_dim_v = 128;
  o.lengths = std::move(lengths);
  o.initial_state_dtype = state;
  o.final_state_dtype = state;
  o.seed = seed;
  return o;
}

// GPU against the CPU backend, out and final state.
void check_against_cpu(const KdaCase& c, const std::string& label) {
  GpuRun gpu = run_cuda(c, 1);
  REQUIRE_MESSAGE(gpu.status.ok(), label << ": " << gpu.status.to_string());
  Outputs cpu;
  REQUIRE(run_cpu(c, &cpu).ok());
  const double e_out = rel_error_bf16(gpu.out.out, to_doubles(cpu.out));
  const double e_state = rel_error(gpu.out.final_state(), cpu.final_state());
  std::printf("%-58s out %.2e  state %.2e\n", label.c_str(), e_out, e_state);
  CHECK_MESSAGE(all_finite(gpu.out.out), label << ": an output element was not written");
  CHECK_MESSAGE(gpu.guards_intact, label << ": bytes outside the outputs changed");
  CHECK_MESSAGE(e_out <= kTol, label << ": out rel error " << e_out);
  CHECK_MESSAGE(e_state <= kTol, label << ": state rel error " << e_state);
}

}  // namespace

TEST_CASE("cuda prefill through state slots equals the contiguous run bitwise") {
  if (!gpu_or_skip()) return;
  // H = 4 with long sequences: the split (segments) path; H = 32, short ones: one segment each.
  const std::vector<std::pair<std::int64_t, std::vector<std::int64_t>>> shapes = {
      {4, {300, 0, 1, 1000, 16, 2100}}, {32, {37, 0, 1, 100, 16, 63}}};
  for (const auto& [heads, lengths] : shapes) {
    for (DType state : {DType::kF32, DType::kBF16}) {
      const KdaCase c = make_case(gpu_options(heads, lengths, state, 100 + heads));
      GpuRun contiguous = run_cuda(c);
      REQUIRE(contiguous.status.ok());
      const void* fin = state == DType::kF32
                            ? static_cast<const void*>(contiguous.out.final_f32.data())
                            : static_cast<const void*>(contiguous.out.final_bf16.data());
      for (const auto& [name, slots] : slot_lists(c.num_seqs())) {
        const std::string label = "H" + std::to_string(heads) + " " + to_string(state) + " " + name;
        SlotCase sc = make_slot_case(c, slots, 2 * c.num_seqs() + 3);
        // Padded sequences start from zero: the contiguous reference must too.
        GpuRun ref = contiguous;
        if (name == std::string("padded")) {
          ref = run_cuda(sc.contiguous);
          REQUIRE(ref.status.ok());
          fin = state == DType::kF32 ? static_cast<const void*>(ref.out.final_f32.data())
                                     : static_cast<const void*>(ref.out.final_bf16.data());
        }
        const PooledGpuRun got = run_pooled_cuda(sc);
        REQUIRE_MESSAGE(got.status.ok(), label << ": " << got.status.to_string());
        CHECK(got.device_status == 0u);
        CHECK_MESSAGE(got.guards_intact, label << ": guard bytes changed");
        check_pooled_equals_contiguous(sc, got.out, got.pool, ref.out.out, fin, label);
      }
    }
  }
}

TEST_CASE("cuda prefill: a slot outside the pool is reported and runs as padding") {
  if (!gpu_or_skip()) return;
  const KdaCase c = make_case(gpu_options(4, {40, 700, 3}, DType::kF32, 7));
  // The reference: sequence 1 as padding (pool entry 5 keeps its guard).
  const SlotCase padded = make_slot_case(c, {2, -1, 0}, 6);
  SlotCase sc = padded;
  sc.slots[1] = 6;  // past the end: the device sees it (no host copy is given to check)
  GpuRun ref = run_cuda(padded.contiguous);
  REQUIRE(ref.status.ok());
  const PooledGpuRun got = run_pooled_cuda(sc);
  REQUIRE(got.status.ok());
  CHECK(got.device_status == static_cast<std::uint32_t>(kDeviceStatusSlot));
  check_pooled_equals_contiguous(padded, got.out, got.pool, ref.out.out, ref.out.final_f32.data(),
                                 "slot outside the pool");
}

TEST_CASE("cuda prefill: the host copy of state slots is checked before any launch") {
  if (!gpu_or_skip()) return;
  const KdaCase c = make_case(gpu_options(4, {40, 70, 3}, DType::kF32, 8));
  SlotCase sc = make_slot_case(c, {2, 5, 2}, 6);
  DeviceCase d(c);
  DeviceBuffer pool = DeviceBuffer::from(sc.pool), slots = DeviceBuffer::from(sc.slots);
  DeviceBuffer out(static_cast<std::size_t>(c.out_elems()) * 2);
  std::size_t ws_bytes = 0;
  REQUIRE(workspace_size(sc.problem, Backend::kCuda, &ws_bytes).ok());
  DeviceBuffer ws(ws_bytes);
  Tensors t = d.tensors();
  t.initial_state = t.final_state = pool.get();
  t.state_slots = static_cast<const std::int32_t*>(slots.get());
  t.state_slots_host = sc.slots.data();
  t.out = out.get();
  const Status st = forward_cuda(sc.problem, t, Workspace{ws.get(), ws.bytes()}, nullptr);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_MESSAGE(st.message().find("state_slots[2] = 2 repeats state_slots[0]") != std::string::npos,
                st.message());
}

TEST_CASE("cuda prefill through state slots: two chained calls equal one") {
  if (!gpu_or_skip()) return;
  CaseOptions o = gpu_options(4, {}, DType::kF32, 9);
  o.batch = 3;
  o.seq_len = 1500;
  const KdaCase whole = make_case(o);
  const std::vector<std::int32_t> slots = {4, 0, 2};
  const PooledGpuRun one = run_pooled_cuda(make_slot_case(whole, slots, 6));
  REQUIRE(one.status.ok());
  const KdaCase first = split_tokens(whole, 0, 700, DType::kF32, whole.initial_state, DType::kF32);
  const KdaCase second =
      split_tokens(whole, 700, 1500, DType::kF32, whole.initial_state, DType::kF32);
  const PooledGpuRun a = run_pooled_cuda(make_slot_case(first, slots, 6));
  REQUIRE(a.status.ok());
  SlotCase sb = make_slot_case(second, slots, 6);
  sb.pool = a.pool;
  const PooledGpuRun b = run_pooled_cuda(sb);
  REQUIRE(b.status.ok());
  std::vector<float> pool_one(one.pool.size() / 4), pool_two(b.pool.size() / 4);
  std::memcpy(pool_one.data(), one.pool.data(), one.pool.size());
  std::memcpy(pool_two.data(), b.pool.data(), b.pool.size());
  const double e = rel_error(pool_two, to_doubles(pool_one));
  std::printf("chained vs one call: pool rel error %.2e\n", e);
  CHECK(e <= kTol);
}

TEST_CASE("cuda prefill: split sequences (context parallel) match the CPU backend") {
  if (!gpu_or_skip()) return;
  struct Shape {
    std::int64_t heads;
    std::vector<std::int64_t> lengths;
    GateMode gate;
    DType state;
  };
  const std::vector<Shape> shapes = {
      {4, {8192}, GateMode::kLowerBound, DType::kF32},
      {4, {3000, 17, 0, 1, 5000}, GateMode::kSoftplus, DType::kF32},
      {8, {4096, 129, 2047}, GateMode::kLowerBound, DType::kBF16},
      {16, {4096}, GateMode::kSoftplus, DType::kBF16},
      {12, {2570, 255, 2561}, GateMode::kLowerBound, DType::kF32},  // a short one beside split ones
  };
  std::uint64_t seed = 300;
  for (const Shape& s : shapes) {
    CaseOptions o = gpu_options(s.heads, s.lengths, s.state, ++seed);
    o.gate = s.gate;
    const KdaCase c = make_case(o);
    std::string label = "split H" + std::to_string(s.heads) + " " + to_string(s.gate) + " " +
                        to_string(s.state) + " T";
    label += std::to_string(c.problem.seq_len) + " N" + std::to_string(c.num_seqs());
    check_against_cpu(c, label);
  }
}

TEST_CASE("cuda prefill: split sequences are as accurate as the fp64 reference demands") {
  if (!gpu_or_skip()) return;
  for (GateMode gate : {GateMode::kLowerBound, GateMode::kSoftplus}) {
    CaseOptions o = gpu_options(4, {2048}, DType::kF32, gate == GateMode::kSoftplus ? 401 : 402);
    o.gate = gate;
    const KdaCase c = make_case(o);
    GpuRun gpu = run_cuda(c);
    REQUIRE(gpu.status.ok());
    const Reference ref = reference_forward(c);
    const double e_out = rel_error_bf16(gpu.out.out, ref.out);
    const double e_state = rel_error(gpu.out.final_state(), ref.final_state);
    std::printf("split H4 T2048 %s vs fp64: out %.2e state %.2e\n", to_string(gate), e_out,
                e_state);
    CHECK(e_out <= kTol);
    CHECK(e_state <= kTol);
  }
}

TEST_CASE("cuda prefill: split sequences are bitwise repeatable") {
  if (!gpu_or_skip()) return;
  const KdaCase c = make_case(gpu_options(4, {5000, 300}, DType::kF32, 501));
  GpuRun a = run_cuda(c), b = run_cuda(c);
  REQUIRE(a.status.ok());
  REQUIRE(b.status.ok());
  CHECK(a.out.out == b.out.out);
  CHECK(same_bits(a.out.final_f32, b.out.final_f32));
}
