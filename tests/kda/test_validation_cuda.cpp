// The CUDA backend's checks that need a device (docs/VALIDATION.md): where each pointer lives and
// how far its allocation reaches (cudaPointerGetAttributes / cuMemGetAddressRange), the compute
// capability, decode alignment, and the device status word through which the kernels report what
// the host cannot see (broken device cu_seqlens, gate parameters out of range, decode slots out of
// range). Every rejected call must leave its poisoned outputs untouched.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "kda/kda.hpp"
#include "kda_reference.hpp"

using namespace kda;
using namespace kda::test;

namespace {

CaseOptions cuda_case(std::uint64_t seed) {
  CaseOptions o;
  o.heads = 3;
  o.head_dim_k = o.head_dim_v = 128;
  o.lengths = {20, 30, 17};
  o.seed = seed;
  o.initial_state_dtype = DType::kNone;
  o.final_state_dtype = DType::kF32;
  return o;
}

bool all_bytes(const DeviceBuffer& b, unsigned char value) {
  for (unsigned char x : b.download<unsigned char>()) {
    if (x != value) return false;
  }
  return true;
}

bool contains(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

// A decode step of `batch` rows of `tokens` tokens and `heads` heads on a pool of `num_slots` fp32
// states.
DecodeProblem f32_decode_problem(std::int64_t batch, std::int64_t tokens, std::int64_t heads,
                                 std::int64_t num_slots) {
  DecodeProblem dp;
  dp.batch = batch;
  dp.tokens = tokens;
  dp.num_heads = heads;
  dp.num_slots = num_slots;
  dp.state_dtype = DType::kF32;
  return dp;
}

// A prefill case on the device with poisoned outputs, a workspace and a status word.
struct PrefillRig {
  KdaCase c;
  DeviceCase d;
  DeviceBuffer out, ht, ws, status;
  std::size_t ws_bytes = 0;
  explicit PrefillRig(const KdaCase& kc)
      : c(kc),
        d(kc),
        out(static_cast<std::size_t>(kc.out_elems()) * 2),
        ht(static_cast<std::size_t>(kc.state_elems()) * 4),
        status(sizeof(std::uint32_t)) {
    REQUIRE(workspace_size(c.problem, Backend::kCuda, &ws_bytes).ok());
    ws = DeviceBuffer(ws_bytes);
    out.fill(0xFF);
    ht.fill(0xFF);
    REQUIRE(clear_device_status(static_cast<std::uint32_t*>(status.get()), nullptr).ok());
  }
  Tensors tensors() const {
    Tensors t = d.tensors();
    t.out = out.get();
    t.final_state = ht.get();
    t.device_status = static_cast<std::uint32_t*>(status.get());
    return t;
  }
  Status run(const Tensors& t, const CudaOptions& opt = {}) {
    return forward_cuda(c.problem, t, {ws.get(), ws_bytes}, nullptr, opt);
  }
  Status device_status() {
    return check_device_status(static_cast<std::uint32_t*>(status.get()), nullptr);
  }
  bool untouched() const { return all_bytes(out, 0xFF) && all_bytes(ht, 0xFF); }
};

// White-box: how many of a one-sequence forward's ready flags of the pipelined path (one 32-bit
// word per chunk slot and head, the workspace's last words before its 256 bytes of alignment
// slack, workspace_layout.hpp) hold 1 after the call; *words: how many there are.
std::size_t ready_flags_set(const PrefillRig& rig, std::int64_t len, std::int64_t heads,
                            std::size_t* words) {
  *words = static_cast<std::size_t>(((len + 15) / 16 + 1) * heads);
  const std::vector<std::uint32_t> ws = rig.ws.download<std::uint32_t>();
  const std::size_t end = (rig.ws_bytes - 256) / 4;
  REQUIRE(end >= *words);
  std::size_t set = 0;
  for (std::size_t i = end - *words; i < end; ++i) set += ws[i] == 1u ? 1 : 0;
  return set;
}

// Runs `c` with `cu` as its only cu_seqlens, in device memory (the host has no copy, so the launch
// goes ahead): the device status word must name a broken list, and nothing outside the outputs may
// change.
void check_broken_list_reported(const KdaCase& c, const std::vector<std::int64_t>& cu) {
  PrefillRig rig(c);
  DeviceBuffer dcu = DeviceBuffer::from(cu);
  Tensors t = rig.tensors();
  t.cu_seqlens = dcu.get();
  REQUIRE(rig.run(t).ok());
  const Status dev = rig.device_status();
  CHECK_MESSAGE(contains(dev, "broken cu_seqlens"), dev.to_string());
  CHECK(rig.out.guards_intact());
  CHECK(rig.ht.guards_intact());
}

}  // namespace

TEST_CASE("cuda: the device is one the backend is built for") {
  if (!gpu_or_skip()) return;
  const Status st = cuda_device_supported();
  CHECK_MESSAGE(st.ok(), st.to_string());
  KdaCase c = make_case(cuda_case(3));
  CHECK(can_implement(c.problem, Backend::kCuda).ok());
}

TEST_CASE(
    "cuda prefill: host memory / short allocations / the workspace are refused before any launch") {
  if (!gpu_or_skip()) return;
  PrefillRig rig(make_case(cuda_case(11)));
  const Tensors good = rig.tensors();
  REQUIRE(stream_synchronize(nullptr).ok());

  SUBCASE("host pointer for q") {
    Tensors t = good;
    t.q = rig.c.q.data();
    const Status st = rig.run(t);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(st, "q points to unregistered host memory"), st.to_string());
  }
  SUBCASE("host pointer for the gate parameters and cu_seqlens") {
    for (int which = 0; which < 3; ++which) {
      Tensors t = good;
      const char* name = which == 0 ? "A_log" : which == 1 ? "dt_bias" : "cu_seqlens";
      if (which == 0) t.A_log = rig.c.A_log.data();
      if (which == 1) t.dt_bias = rig.c.dt_bias.data();
      if (which == 2) t.cu_seqlens = rig.c.cu_seqlens.data();
      const Status st = rig.run(t);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE(contains(st, std::string(name) + " points to unregistered host memory"),
                    st.to_string());
    }
  }
  SUBCASE("v in an allocation one token too short") {
    const std::size_t need = static_cast<std::size_t>(rig.c.out_elems()) * 2;
    const std::size_t row = static_cast<std::size_t>(rig.c.problem.num_heads * 128 * 2);
    DeviceBuffer short_v(need - row, 0);  // no guard bytes: the allocation ends where the data does
    Tensors t = good;
    t.v = short_v.get();
    const Status st = rig.run(t);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(
        contains(st, "v needs " + std::to_string(need) + " bytes, but its allocation ends " +
                         std::to_string(need - row) + " bytes after it"),
        st.to_string());
  }
  SUBCASE("final_state in an allocation too short") {
    DeviceBuffer short_ht(rig.ht.bytes() - 4, 0);
    Tensors t = good;
    t.final_state = short_ht.get();
    const Status st = rig.run(t);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(st, "final_state needs"), st.to_string());
  }
  SUBCASE("a workspace whose allocation is shorter than its stated size") {
    DeviceBuffer small(rig.ws_bytes / 2, 0);
    const Status st = forward_cuda(rig.c.problem, good, {small.get(), rig.ws_bytes}, nullptr);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(st, "workspace needs"), st.to_string());
  }
  SUBCASE("an interior pointer of a large allocation is fine") {
    DeviceBuffer big(static_cast<std::size_t>(rig.c.out_elems()) * 2 + 4096, 0);
    memcpy_to_device(static_cast<unsigned char*>(big.get()) + 4096, rig.c.v.data(),
                     rig.c.v.size() * 2);
    Tensors t = good;
    t.v = static_cast<unsigned char*>(big.get()) + 4096;
    const Status st = rig.run(t);
    CHECK_MESSAGE(st.ok(), st.to_string());
    REQUIRE(stream_synchronize(nullptr).ok());
    return;  // this one ran: outputs are written
  }
  REQUIRE(stream_synchronize(nullptr).ok());
  CHECK(rig.untouched());
}

TEST_CASE("cuda prefill: check_pointers off gives the same result as on (bitwise)") {
  if (!gpu_or_skip()) return;
  PrefillRig rig(make_case(cuda_case(13)));
  REQUIRE(rig.run(rig.tensors()).ok());
  REQUIRE(stream_synchronize(nullptr).ok());
  const auto out_on = rig.out.download<std::uint16_t>();
  const auto ht_on = rig.ht.download<float>();
  rig.out.fill(0xFF);
  rig.ht.fill(0xFF);
  CudaOptions off;
  off.check_pointers = false;
  REQUIRE(rig.run(rig.tensors(), off).ok());
  REQUIRE(stream_synchronize(nullptr).ok());
  CHECK(rig.out.download<std::uint16_t>() == out_on);
  CHECK(std::memcmp(rig.ht.download<float>().data(), ht_on.data(), ht_on.size() * 4) == 0);
  CHECK(rig.device_status().ok());
}

TEST_CASE("cuda prefill: broken device cu_seqlens are reported through the device status word") {
  if (!gpu_or_skip()) return;
  KdaCase c = make_case(cuda_case(17));  // lengths 20, 30, 17: cu_seqlens 0 20 50 67
  const std::vector<std::vector<std::int64_t>> broken = {
      {0, 30, 20, 67},  // decreasing
      {4, 20, 50, 67},  // does not start at 0
      {0, 20, 50, 60},  // does not end at T
      {0, 20, 50, 99},  // ends past T
      {-5, 20, 50, 67},
  };
  SUBCASE("five broken int64 lists") {
    for (const auto& cu : broken) {
      CAPTURE(cu[0]);
      CAPTURE(cu[2]);
      CAPTURE(cu[3]);
      PrefillRig rig(c);
      DeviceBuffer dcu = DeviceBuffer::from(cu);
      Tensors t = rig.tensors();
      t.cu_seqlens = dcu.get();
      const Status st = rig.run(t);  // the host has no copy: the launch goes ahead
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      const Status dev = rig.device_status();
      CHECK(dev.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE(contains(dev, "broken cu_seqlens"), dev.to_string());
      CHECK_FALSE(contains(dev, "gate parameters"));
      // Memory-safe all the same: nothing outside the outputs was touched.
      CHECK(rig.out.guards_intact());
      CHECK(rig.ht.guards_intact());
      // The word is sticky until cleared.
      CHECK(rig.device_status().code() == StatusCode::kInvalidArgument);
      REQUIRE(clear_device_status(t.device_status, nullptr).ok());
      CHECK(rig.device_status().ok());
    }
  }
  SUBCASE("an int32 list") {
    KdaCase c32 = c;
    c32.problem.cu_seqlens_dtype = DType::kI32;
    PrefillRig rig(c32);
    DeviceBuffer dcu = DeviceBuffer::from(std::vector<std::int32_t>{0, 20, 10, 67});
    Tensors t = rig.tensors();
    t.cu_seqlens = dcu.get();
    REQUIRE(rig.run(t).ok());
    CHECK(rig.device_status().code() == StatusCode::kInvalidArgument);
  }
  SUBCASE("a list long enough for a split plan, one entry decreasing") {
    // 8192 tokens in three sequences at H = 3: on an H200 (132 SMs) the plan cuts them into
    // segments of 14 chunks (224 tokens). With the entries 0, 3000, 2000, 8192 the owner search
    // maps no segment slot to sequence 1's first segment (1 + 3000 / 224 = 14 > 2 + 2000 / 224 =
    // 10), where the recurrence checks a sequence's entries; the prepare kernel's block (1, 0)
    // checks them whatever the search says.
    CaseOptions o = cuda_case(23);
    o.lengths = {2730, 2730, 2732};
    check_broken_list_reported(make_case(o), {0, 3000, 2000, 8192});
  }
  SUBCASE("one sequence on the pipelined path: every broken list finishes and is reported") {
    // H = 32, one 1,000-token sequence, bounded gate: prefill.cu pipelines it on 128 SMs or more
    // (the recurrence waits for each chunk's ready flag; a hang here is a failure by timeout).
    CaseOptions o = cuda_case(29);
    o.heads = 32;
    o.lengths = {1000};
    o.gate = GateMode::kLowerBound;
    const KdaCase one = make_case(o);
    const std::vector<std::vector<std::int64_t>> lists = {
        {600, 1000}, {0, 700}, {0, 1500}, {-5, 1000}, {0, 0}};
    for (const auto& cu : lists) {
      CAPTURE(cu[0]);
      CAPTURE(cu[1]);
      check_broken_list_reported(one, cu);
    }
  }
  SUBCASE("valid lists leave the word at zero, int64 and int32") {
    PrefillRig rig(c);
    REQUIRE(rig.run(rig.tensors()).ok());
    CHECK(rig.device_status().ok());
    KdaCase c32 = c;
    c32.problem.cu_seqlens_dtype = DType::kI32;
    c32.cu_seqlens_i32.assign(c.cu_seqlens.begin(), c.cu_seqlens.end());
    PrefillRig rig32(c32);
    REQUIRE(rig32.run(rig32.tensors()).ok());
    CHECK(rig32.device_status().ok());
  }
}

TEST_CASE(
    "cuda prefill and decode: gate parameters out of range are reported through the device status "
    "word") {
  if (!gpu_or_skip()) return;
  KdaCase c = make_case(cuda_case(19));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Bad {
    const char* what;
    int head;
    float a_log;
    int dt_index;
    float dt_bias;
  };
  const Bad bads[] = {{"A_log above the range", 1, kMaxAbsALog + 1.0f, -1, 0.f},
                      {"A_log below the range", 2, -kMaxAbsALog - 0.5f, -1, 0.f},
                      {"A_log NaN", 0, nan, -1, 0.f},
                      {"dt_bias inf", -1, 0.f, 3 * 128 - 1, inf},
                      {"dt_bias NaN", -1, 0.f, 128 + 77, nan}};
  for (const Bad& bad : bads) {
    CAPTURE(bad.what);
    KdaCase b = c;
    if (bad.head >= 0) b.A_log[static_cast<std::size_t>(bad.head)] = bad.a_log;
    if (bad.dt_index >= 0) b.dt_bias[static_cast<std::size_t>(bad.dt_index)] = bad.dt_bias;
    // The CPU backend refuses the same parameters up front.
    {
      std::vector<std::uint16_t> out(static_cast<std::size_t>(b.out_elems()), 0xFFFF);
      Tensors t;
      t.q = b.q.data();
      t.k = b.k.data();
      t.v = b.v.data();
      t.g = b.g.data();
      t.beta = b.beta.data();
      t.A_log = b.A_log.data();
      t.dt_bias = b.dt_bias.data();
      t.cu_seqlens = b.cu_seqlens.data();
      t.out = out.data();
      std::size_t bytes = 0;
      REQUIRE(workspace_size(b.problem, Backend::kCpu, &bytes).ok());
      std::vector<unsigned char> ws(bytes);
      Problem p = b.problem;
      p.final_state_dtype = DType::kNone;
      const Status st = forward_cpu(p, t, {ws.data(), bytes});
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE((contains(st, "A_log[") || contains(st, "dt_bias[")), st.to_string());
    }
    PrefillRig rig(b);
    REQUIRE(rig.run(rig.tensors()).ok());
    const Status dev = rig.device_status();
    CHECK(dev.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(dev, "gate parameters out of range"), dev.to_string());
    CHECK_FALSE(contains(dev, "cu_seqlens"));

    // Decode of one token for two rows on the same parameters.
    const DecodeProblem dp = f32_decode_problem(2, 1, b.problem.num_heads, 2);
    DeviceBuffer slots = DeviceBuffer::from(std::vector<std::int32_t>{1, 0});
    DeviceBuffer pool(static_cast<std::size_t>(2 * dp.num_heads * 128 * 128) * 4);
    pool.fill(0);
    DeviceBuffer dout(static_cast<std::size_t>(2 * dp.num_heads * 128) * 2);
    DecodeTensors dt = rig.d.decode_tensors();
    dt.slots = static_cast<const std::int32_t*>(slots.get());
    dt.state_pool = pool.get();
    dt.out = dout.get();
    dt.device_status = static_cast<std::uint32_t*>(rig.status.get());
    REQUIRE(clear_device_status(dt.device_status, nullptr).ok());
    REQUIRE(decode_cuda(dp, dt, nullptr).ok());
    const Status ddev = rig.device_status();
    CHECK(ddev.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(ddev, "gate parameters out of range"), ddev.to_string());
  }
}

TEST_CASE("cuda decode: slots out of range / misaligned and host pointers") {
  if (!gpu_or_skip()) return;
  KdaCase c = make_case(cuda_case(23));
  DeviceCase d(c);
  const DecodeProblem dp = f32_decode_problem(3, 2, c.problem.num_heads, 4);
  const std::size_t slot_bytes = static_cast<std::size_t>(dp.num_heads * 128 * 128) * 4;
  DeviceBuffer pool(4 * slot_bytes);
  pool.fill(0);
  DeviceBuffer dout(static_cast<std::size_t>(3 * 2 * dp.num_heads * 128) * 2);
  dout.fill(0xFF);
  DeviceBuffer status(4);
  std::uint32_t* word = static_cast<std::uint32_t*>(status.get());
  REQUIRE(clear_device_status(word, nullptr).ok());
  DecodeTensors t = d.decode_tensors();
  t.state_pool = pool.get();
  t.out = dout.get();
  t.device_status = word;

  SUBCASE("a slot index past the pool is skipped and reported") {
    DeviceBuffer slots = DeviceBuffer::from(std::vector<std::int32_t>{2, 9, -1});
    t.slots = static_cast<const std::int32_t*>(slots.get());
    REQUIRE(decode_cuda(dp, t, nullptr).ok());
    const Status st = check_device_status(word, nullptr);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(st, "slot index >= the pool size"), st.to_string());
    // Row 1 (slot 9) and row 2 (padding) left their out untouched; row 0 was written.
    const auto out = dout.download<std::uint16_t>();
    const std::size_t row = static_cast<std::size_t>(2 * dp.num_heads * 128);
    bool row0_written = false, rows12_untouched = true;
    for (std::size_t i = 0; i < row; ++i) row0_written |= out[i] != 0xFFFF;
    for (std::size_t i = row; i < 3 * row; ++i) rows12_untouched &= out[i] == 0xFFFF;
    CHECK(row0_written);
    CHECK(rows12_untouched);
    CHECK(pool.guards_intact());
  }
  SUBCASE("valid slots leave the word at zero") {
    DeviceBuffer slots = DeviceBuffer::from(std::vector<std::int32_t>{3, -1, 0});
    t.slots = static_cast<const std::int32_t*>(slots.get());
    REQUIRE(decode_cuda(dp, t, nullptr).ok());
    CHECK(check_device_status(word, nullptr).ok());
  }
  SUBCASE("misaligned v and pool, host q: refused, nothing written") {
    DeviceBuffer slots = DeviceBuffer::from(std::vector<std::int32_t>{0, 1, 2});
    t.slots = static_cast<const std::int32_t*>(slots.get());
    {
      DecodeTensors bad = t;
      bad.v = static_cast<const unsigned char*>(t.v) + 8;
      const Status st = decode_cuda(dp, bad, nullptr);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE(contains(st, "v must be 16-byte aligned"), st.to_string());
    }
    {
      DecodeTensors bad = t;
      bad.state_pool = static_cast<unsigned char*>(pool.get()) + 8;
      DecodeProblem small = dp;
      small.num_slots = 3;
      const Status st = decode_cuda(small, bad, nullptr);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE(contains(st, "state_pool must be 16-byte aligned"), st.to_string());
    }
    {
      DecodeTensors bad = t;
      bad.q = c.q.data();
      const Status st = decode_cuda(dp, bad, nullptr);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE(contains(st, "q points to unregistered host memory"), st.to_string());
    }
    {
      DeviceBuffer short_pool(4 * slot_bytes - 16, 0);
      DecodeTensors bad = t;
      bad.state_pool = short_pool.get();
      const Status st = decode_cuda(dp, bad, nullptr);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK_MESSAGE(contains(st, "state_pool needs"), st.to_string());
    }
    REQUIRE(stream_synchronize(nullptr).ok());
    CHECK(all_bytes(dout, 0xFF));
    CHECK(all_bytes(pool, 0));
  }
}

TEST_CASE("cuda prefill: a pipelined forward ignores what its workspace held before (bitwise)") {
  // The pipelined path (prefill.cu, on 128 SMs or more) zeroes its ready flags at the start of
  // every call: a workspace full of 0xFF bytes (every flag "ready", every record garbage) must give
  // the bits a zeroed one gives. The second shape is long enough that the launcher split it into
  // segments before the pipelined path measured faster (five segments at H = 23 on 132 SMs).
  if (!gpu_or_skip()) return;
  struct Shape {
    std::int64_t heads, len;
  };
  for (const Shape sh : {Shape{32, 1200}, Shape{23, 16400}}) {
    CAPTURE(sh.heads);
    CAPTURE(sh.len);
    CaseOptions o = cuda_case(31);
    o.heads = sh.heads;
    o.lengths = {sh.len};
    o.gate = GateMode::kLowerBound;
    const KdaCase c = make_case(o);
    PrefillRig stale(c), clean(c);
    stale.ws.fill(0xFF);
    clean.ws.fill(0x00);
    REQUIRE(stale.run(stale.tensors()).ok());
    REQUIRE(clean.run(clean.tensors()).ok());
    CHECK(stale.device_status().ok());
    CHECK(stale.out.download<std::uint16_t>() == clean.out.download<std::uint16_t>());
    CHECK(stale.ht.download<std::uint32_t>() == clean.ht.download<std::uint32_t>());
#ifdef KDA_HAVE_CUDA
    // And the path did run: its ready flags are all set after the call into the zeroed workspace
    // (a split plan sets none). Four 32-column blocks per head must fit the SMs.
    int sms = 0;
    REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
    if (sms >= 4 * o.heads) {
      std::size_t words = 0;
      const std::size_t set = ready_flags_set(clean, sh.len, o.heads, &words);
      CHECK_MESSAGE(set == words, set << " of " << words << " ready flags set: not pipelined?");
    } else {
      MESSAGE("fewer than " << 4 * o.heads << " SMs: this shape is not pipelined here");
    }
#endif
  }
}

TEST_CASE("cuda prefill: the schedule option picks the path, and every path computes the same") {
  // White-box, as above: after a call into a zeroed workspace, the ready flags say whether the
  // pipelined path ran. kTwoPhase sets none, kPipelined all of them (where four 32-column
  // blocks per head fit the SMs), kAuto whichever it picks; each result against the fp64
  // recurrence. The second shape is shorter than kAuto's 32 chunks.
  if (!gpu_or_skip()) return;
  int sms = 0;
#ifdef KDA_HAVE_CUDA
  REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
#endif
  struct Shape {
    std::int64_t heads, len;
    GateMode gate;
  };
  for (const Shape sh :
       {Shape{32, 1200, GateMode::kLowerBound}, Shape{8, 400, GateMode::kSoftplus}}) {
    CAPTURE(sh.heads);
    CAPTURE(sh.len);
    CaseOptions o = cuda_case(47);
    o.heads = sh.heads;
    o.lengths = {sh.len};
    o.gate = sh.gate;
    const KdaCase c = make_case(o);
    const Reference ref = reference_forward(c);
    for (PrefillSchedule schedule :
         {PrefillSchedule::kAuto, PrefillSchedule::kTwoPhase, PrefillSchedule::kPipelined}) {
      CAPTURE(to_string(schedule));
      PrefillRig rig(c);
      rig.ws.fill(0x00);
      CudaOptions opt;
      opt.schedule = schedule;
      REQUIRE(rig.run(rig.tensors(), opt).ok());
      CHECK(rig.device_status().ok());
      const double e_out = rel_error_bf16(rig.out.download<std::uint16_t>(), ref.out);
      const double e_state = rel_error(to_doubles(rig.ht.download<float>()), ref.final_state);
      MESSAGE(to_string(schedule) << ": out " << e_out << ", state " << e_state);
      CHECK(e_out <= 3e-3);
      CHECK(e_state <= 3e-3);
      std::size_t words = 0;
      const std::size_t set = ready_flags_set(rig, sh.len, o.heads, &words);
      if (schedule == PrefillSchedule::kTwoPhase) {
        CHECK_MESSAGE(set == 0, set << " ready flags set: pipelined?");
      } else if (schedule == PrefillSchedule::kPipelined && sms >= 4 * o.heads) {
        CHECK_MESSAGE(set == words, set << " of " << words << " ready flags set: not pipelined?");
      }
    }
  }
}

TEST_CASE("cuda prefill: an unknown schedule is rejected before anything runs") {
  if (!gpu_or_skip()) return;
  PrefillRig rig(make_case(cuda_case(53)));
  CudaOptions opt;
  opt.schedule = static_cast<PrefillSchedule>(7);
  const Status st = rig.run(rig.tensors(), opt);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_MESSAGE(contains(st, "CudaOptions::schedule is 7"), st.to_string());
  REQUIRE(stream_synchronize(nullptr).ok());
  CHECK(rig.untouched());
}

TEST_CASE(
    "cuda: check_cuda_call refuses what forward_cuda and decode_cuda refuse, in their words") {
  if (!gpu_or_skip()) return;
  PrefillRig rig(make_case(cuda_case(59)));
  const Tensors good = rig.tensors();
  CHECK(check_cuda_call(rig.c.problem, good).ok());
  std::vector<std::int64_t> broken = {0, 30, 20, 67};  // decreasing
  Tensors misaligned_k = good, bad_host_copy = good;
  misaligned_k.k = static_cast<const unsigned char*>(good.k) + 2;
  bad_host_copy.cu_seqlens_host = broken.data();
  CudaOptions unknown;
  unknown.schedule = static_cast<PrefillSchedule>(7);
  const struct {
    const Tensors* t;
    const CudaOptions* opt;
    const char* words;
  } prefills[] = {{&misaligned_k, nullptr, "k must be 16-byte aligned for the CUDA backend"},
                  {&bad_host_copy, nullptr, "cu_seqlens"},
                  {&good, &unknown, "CudaOptions::schedule is 7"}};
  for (const auto& call : prefills) {
    CAPTURE(call.words);
    const CudaOptions opt = call.opt != nullptr ? *call.opt : CudaOptions{};
    const Status checked = check_cuda_call(rig.c.problem, *call.t, opt);
    const Status ran = rig.run(*call.t, opt);
    CHECK(checked.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(checked, call.words), checked.to_string());
    CHECK(checked.message() == ran.message());
  }
  REQUIRE(stream_synchronize(nullptr).ok());
  CHECK(rig.untouched());

  // A decode step: a pool 8 bytes past a 16-byte boundary, a count of blocks a head not offered.
  KdaCase c = make_case(cuda_case(61));
  DeviceCase d(c);
  const DecodeProblem dp = f32_decode_problem(3, 1, c.problem.num_heads, 3);
  DeviceBuffer pool(static_cast<std::size_t>(4 * dp.num_heads * 128 * 128) * 4);
  pool.fill(0);
  DeviceBuffer dout(static_cast<std::size_t>(3 * dp.num_heads * 128) * 2);
  dout.fill(0xFF);
  DeviceBuffer slots = DeviceBuffer::from(std::vector<std::int32_t>{2, 0, 1});
  DecodeTensors step = d.decode_tensors();
  step.state_pool = pool.get();
  step.out = dout.get();
  step.slots = static_cast<const std::int32_t*>(slots.get());
  CHECK(check_cuda_call(dp, step).ok());
  DecodeTensors shifted = step;
  shifted.state_pool = static_cast<unsigned char*>(pool.get()) + 8;
  CudaOptions three_blocks;
  three_blocks.decode_blocks_per_head = 3;
  const struct {
    const DecodeTensors* t;
    CudaOptions opt;
    const char* words;
  } steps[] = {{&shifted, CudaOptions{}, "state_pool must be 16-byte aligned for the CUDA decode"},
               {&step, three_blocks, "CudaOptions::decode_blocks_per_head is 3"}};
  for (const auto& call : steps) {
    CAPTURE(call.words);
    const Status checked = check_cuda_call(dp, *call.t, call.opt);
    const Status ran = decode_cuda(dp, *call.t, nullptr, call.opt);
    CHECK(checked.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(checked, call.words), checked.to_string());
    CHECK(checked.message() == ran.message());
  }
  REQUIRE(stream_synchronize(nullptr).ok());
  CHECK(all_bytes(dout, 0xFF));
  CHECK(all_bytes(pool, 0));
}
