// Error reporting of the prefill: a failing call returns the right status with a message and
// writes nothing (every output still holds its poison); the CUDA prefill reports bad input before
// launching anything. (Decode, state slot and transition errors: their own files.)
#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend_matrix.hpp"
#include "cases.hpp"

using namespace kda;
using namespace kda::test;

KDA_CPU_CASE("a failing call writes nothing") {
  CaseOptions o;
  o.lengths = {5, 9};
  o.heads = 2;
  o.initial_state_dtype = DType::kF32;
  o.seed = 91;
  const KdaCase good = make_case(o);
  Runner& runner = cpu_runner();
  auto expect_untouched = [&](const KdaCase& c, StatusCode code, std::size_t shortfall = 0) {
    PrefillOptions opt;
    opt.workspace_shortfall = shortfall;
    const PrefillRun got = runner.prefill(c, opt);
    CHECK(got.status.code() == code);
    CHECK(!got.status.message().empty());
    CHECK(got.out.out == runner.poisoned_out(c));  // NaN bits compared as bits
    for (float x : got.out.final_f32) {
      std::uint32_t bits;
      std::memcpy(&bits, &x, 4);
      CHECK(bits == 0xFFFFFFFFu);
    }
    CHECK(got.out.final_f32.size() == static_cast<std::size_t>(c.state_elems()));
    CHECK(got.guards_intact);
  };
  SUBCASE("non-finite A_log") {
    KdaCase c = good;
    c.A_log[1] = std::numeric_limits<float>::quiet_NaN();
    expect_untouched(c, StatusCode::kInvalidArgument);
  }
  SUBCASE("A_log outside [-kMaxAbsALog, kMaxAbsALog]") {
    for (float a : {kMaxAbsALog + 0.25f, -kMaxAbsALog - 1.0f, 88.0f}) {
      KdaCase c = good;
      c.A_log[0] = a;
      expect_untouched(c, StatusCode::kInvalidArgument);
    }
    KdaCase edge = good;  // the bounds themselves are allowed
    edge.A_log[0] = kMaxAbsALog;
    edge.A_log[1] = -kMaxAbsALog;
    CHECK(runner.prefill(edge).status.ok());
  }
  SUBCASE("infinite dt_bias") {
    KdaCase c = good;
    c.dt_bias[3] = std::numeric_limits<float>::infinity();
    expect_untouched(c, StatusCode::kInvalidArgument);
  }
  SUBCASE("cu_seqlens not ending at T") {
    KdaCase c = good;
    c.cu_seqlens[2] = 13;
    expect_untouched(c, StatusCode::kInvalidArgument);
  }
  SUBCASE("cu_seqlens decreasing") {
    KdaCase c = good;
    c.cu_seqlens[1] = 15;
    expect_untouched(c, StatusCode::kInvalidArgument);
  }
  SUBCASE("workspace one byte short") { expect_untouched(good, StatusCode::kWorkspaceTooSmall, 1); }
}

KDA_CUDA_CASE("prefill reports bad input before launching anything") {
  CaseOptions o = cuda_options(4, 800);
  o.lengths = {20, 30};
  o.final_state_dtype = DType::kNone;
  KdaCase c = make_case(o);
  {
    KdaCase k64 = c;
    k64.problem.head_dim_k = 64;
    CHECK(can_implement(k64.problem, Backend::kCuda).code() == StatusCode::kUnsupported);
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
