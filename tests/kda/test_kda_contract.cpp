// The operator contract: enum names, Status text, validation (every check has a case that trips it
// and the message names the field), size overflow, can_implement and workspace_size.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kda_reference.hpp"

using namespace kda;

namespace {

// A valid problem with every pointer set: K = V = 4, H = 2, B = 2, T = 3, f32 state in and out.
struct Fixture {
  Problem p;
  std::vector<std::uint16_t> q, k, v, g, beta, out;
  std::vector<float> A_log, dt_bias, initial, final_state;
  std::vector<std::int64_t> cu;
  Tensors t;

  Fixture() {
    p.batch = 2;
    p.seq_len = 3;
    p.num_heads = 2;
    p.head_dim_k = 4;
    p.head_dim_v = 4;
    p.initial_state_dtype = DType::kF32;
    p.final_state_dtype = DType::kF32;
    q.assign(2 * 3 * 2 * 4, 0x3f80);  // bf16 1.0
    k = q;
    g = q;
    v = q;
    out.assign(v.size(), 0);
    beta.assign(2 * 3 * 2, 0);
    A_log.assign(2, 0.0f);
    dt_bias.assign(2 * 4, 0.0f);
    initial.assign(2 * 2 * 4 * 4, 0.0f);
    final_state = initial;
    cu = {0, 2, 6};  // used once make_varlen() switches the problem to varlen
    t.q = q.data();
    t.k = k.data();
    t.v = v.data();
    t.g = g.data();
    t.beta = beta.data();
    t.A_log = A_log.data();
    t.dt_bias = dt_bias.data();
    t.initial_state = initial.data();
    t.final_state = final_state.data();
    t.out = out.data();
  }
  // Switches to varlen: B = 1, T = 6 tokens in sequences {2, 4}, i64 cu_seqlens {0, 2, 6}.
  void make_varlen() {
    p.batch = 1;
    p.seq_len = 6;
    p.num_seqs = 2;
    p.cu_seqlens_dtype = DType::kI64;
    t.cu_seqlens = cu.data();
  }
};

// The status is `code` and its message mentions `field`.
void check_fails(const Status& st, StatusCode code, const std::string& field) {
  CAPTURE(st.to_string());
  CAPTURE(field);
  CHECK(st.code() == code);
  CHECK(st.message().find(field) != std::string::npos);
}

void check_invalid(const Problem& p, const std::string& field) {
  check_fails(validate(p), StatusCode::kInvalidArgument, field);
}

}  // namespace

TEST_CASE("enum names / dtype sizes and Status text") {
  CHECK(std::string(to_string(StatusCode::kOk)) == "ok");
  CHECK(std::string(to_string(StatusCode::kInvalidArgument)) == "invalid argument");
  CHECK(std::string(to_string(StatusCode::kWorkspaceTooSmall)) == "workspace too small");
  CHECK(std::string(to_string(DType::kBF16)) == "bf16");
  CHECK(std::string(to_string(DType::kI64)) == "i64");
  CHECK(std::string(to_string(DType::kF16)) == "f16");
  CHECK(std::string(to_string(GateMode::kSoftplus)) == "softplus");
  CHECK(std::string(to_string(GateMode::kLowerBound)) == "lower_bound");
  CHECK(std::string(to_string(Backend::kCuda)) == "cuda");
  CHECK(dtype_size(DType::kNone) == 0);
  CHECK(dtype_size(DType::kBF16) == 2);
  CHECK(dtype_size(DType::kF32) == 4);
  CHECK(dtype_size(DType::kI32) == 4);
  CHECK(dtype_size(DType::kI64) == 8);
  CHECK(dtype_size(DType::kF16) == 2);
  CHECK(Status::Ok().ok());
  CHECK(Status::Ok().to_string() == "ok");
  const Status bad(StatusCode::kInvalidArgument, "q is null");
  CHECK(!bad.ok());
  CHECK(!static_cast<bool>(bad));
  CHECK(bad.to_string() == "invalid argument: q is null");
}

TEST_CASE("effective scale: 0 selects K^-0.5") {
  Problem p;
  p.head_dim_k = 128;
  CHECK(p.effective_scale() == doctest::Approx(1.0 / std::sqrt(128.0)));
  p.head_dim_k = 4;
  CHECK(p.effective_scale() == 0.5f);
  p.scale = 0.25f;
  CHECK(p.effective_scale() == 0.25f);
  DecodeProblem d;
  d.head_dim_k = 64;
  CHECK(d.effective_scale() == 0.125f);
  d.scale = 2.0f;
  CHECK(d.effective_scale() == 2.0f);
}

TEST_CASE("lower_bound_from_double: -5 up to 0 as written and as the float the operator takes") {
  float used = 1.0f;
  CHECK(lower_bound_from_double(-5.0, &used).ok());
  CHECK(used == -5.0f);
  CHECK(lower_bound_from_double(-0.25, &used).ok());
  CHECK(used == -0.25f);
  CHECK(lower_bound_from_double(-1e-30, &used).ok());  // a float still below 0
  CHECK(used < 0.0f);
  // Outside as written, though its float is -5; 0; not finite: the reason alone.
  for (const double bad : {-5.0000000001, 0.0, -0.0, 1.0, -6.0, -1e300, 1e300, std::nan(""),
                           -std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    const Status st = lower_bound_from_double(bad, &used);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message() == "outside [-5, 0) or not finite");
  }
  // Below 0 as written, -0 as a float.
  const Status st = lower_bound_from_double(-1e-300, &used);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message() == "outside [-5, 0) or not finite (as a float it is -0)");
  // Without a float to receive it: the answer alone.
  CHECK(lower_bound_from_double(-0.5, nullptr).ok());
  CHECK(lower_bound_from_double(1.0, nullptr).code() == StatusCode::kInvalidArgument);
}

TEST_CASE(
    "validate_gate_parameters: sizes, null arrays and values are refused with what is wrong") {
  const std::vector<float> A_log = {0.5f, -1.0f}, dt_bias(2 * 4, 0.25f);
  CHECK(validate_gate_parameters(A_log.data(), dt_bias.data(), 2, 4).ok());
  CHECK(validate_gate_parameters(nullptr, nullptr, 0, 4).ok());  // no heads: nothing to read
  auto refused = [](const Status& st, const std::string& part) {
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(st.message().find(part) != std::string::npos, st.message());
  };
  refused(validate_gate_parameters(nullptr, dt_bias.data(), 2, 4), "A_log is null");
  refused(validate_gate_parameters(A_log.data(), nullptr, 2, 4), "dt_bias is null");
  refused(validate_gate_parameters(A_log.data(), dt_bias.data(), -3, 4), "sizes must be >= 0");
  refused(validate_gate_parameters(A_log.data(), dt_bias.data(), 2, -4), "sizes must be >= 0");
  refused(validate_gate_parameters(A_log.data(), dt_bias.data(), std::int64_t{1} << 40,
                                   std::int64_t{1} << 40),
          "their product fit");
  std::vector<float> bad_bias = dt_bias;
  bad_bias[5] = std::numeric_limits<float>::infinity();
  refused(validate_gate_parameters(A_log.data(), bad_bias.data(), 2, 4),
          "dt_bias[1, 1] is not finite");
  const std::vector<float> bad_a = {0.5f, 21.0f};
  refused(validate_gate_parameters(bad_a.data(), dt_bias.data(), 2, 4), "A_log[1] = 21");
}

TEST_CASE("validate(Problem): every shape and value check trips with the field named") {
  const Fixture f;
  REQUIRE(validate(f.p).ok());
  REQUIRE(validate(f.p, f.t).ok());
  auto with = [&](const std::function<void(Problem&)>& change) {
    Problem p = f.p;
    change(p);
    return p;
  };
  check_invalid(with([](Problem& p) { p.batch = 0; }), "batch");
  check_invalid(with([](Problem& p) { p.seq_len = -1; }), "seq_len");
  check_invalid(with([](Problem& p) { p.num_heads = 0; }), "num_heads");
  check_invalid(with([](Problem& p) { p.head_dim_k = 0; }), "head_dim_k");
  check_invalid(with([](Problem& p) { p.head_dim_k = 4097; }), "head_dim_k");
  check_invalid(with([](Problem& p) { p.head_dim_v = 0; }), "head_dim_v");
  check_invalid(with([](Problem& p) { p.head_dim_v = 5000; }), "head_dim_v");
  check_invalid(with([](Problem& p) { p.cu_seqlens_dtype = DType::kF32; }), "cu_seqlens_dtype");
  check_invalid(with([](Problem& p) { p.cu_seqlens_dtype = DType::kBF16; }), "cu_seqlens_dtype");
  check_invalid(with([](Problem& p) { p.cu_seqlens_dtype = static_cast<DType>(9); }),
                "cu_seqlens_dtype");
  check_invalid(with([](Problem& p) { p.cu_seqlens_dtype = DType::kI64; }), "batch");  // B = 2
  check_invalid(with([](Problem& p) {
                  p.batch = 1;
                  p.cu_seqlens_dtype = DType::kI64;
                  p.num_seqs = -1;
                }),
                "num_seqs");
  check_invalid(with([](Problem& p) {
                  p.batch = 1;
                  p.cu_seqlens_dtype = DType::kI64;
                  p.num_seqs = 0;  // with seq_len 3
                }),
                "num_seqs");
  check_invalid(with([](Problem& p) {
                  p.batch = 1;
                  p.seq_len = std::int64_t{1} << 31;
                  p.head_dim_k = p.head_dim_v = 1;
                  p.num_heads = 1;
                  p.num_seqs = 1;
                  p.cu_seqlens_dtype = DType::kI32;
                }),
                "i32");
  check_invalid(with([](Problem& p) { p.gate = static_cast<GateMode>(7); }), "gate");
  for (float lb : {0.0f, 0.5f, -5.5f, std::numeric_limits<float>::quiet_NaN(),
                   -std::numeric_limits<float>::infinity()}) {
    CAPTURE(lb);
    check_invalid(with([&](Problem& p) {
                    p.gate = GateMode::kLowerBound;
                    p.lower_bound = lb;
                  }),
                  "lower_bound");
  }
  // lower_bound is ignored by the softplus gate; -5 and just below 0 are legal for the bounded one.
  CHECK(validate(with([](Problem& p) { p.lower_bound = 1.0f; })).ok());
  CHECK(validate(with([](Problem& p) {
          p.gate = GateMode::kLowerBound;
          p.lower_bound = -5.0f;
        })).ok());
  CHECK(validate(with([](Problem& p) {
          p.gate = GateMode::kLowerBound;
          p.lower_bound = -1e-6f;
        })).ok());
  for (float scale :
       {-1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(scale);
    check_invalid(with([&](Problem& p) { p.scale = scale; }), "scale");
  }
  check_invalid(with([](Problem& p) { p.initial_state_dtype = DType::kI32; }),
                "initial_state_dtype");
  check_invalid(with([](Problem& p) { p.final_state_dtype = DType::kI64; }), "final_state_dtype");
  // F16 is a checkpoint's storage dtype: no state takes it.
  check_invalid(with([](Problem& p) { p.initial_state_dtype = DType::kF16; }),
                "initial_state_dtype");
  check_invalid(with([](Problem& p) { p.final_state_dtype = static_cast<DType>(-1); }),
                "final_state_dtype");
}

TEST_CASE("validate(Problem): sizes whose element or byte counts overflow 64 bits") {
  auto check_overflow = [](const Problem& p, const std::string& field) {
    check_fails(validate(p), StatusCode::kOverflow, field);
    std::size_t bytes = 0;
    check_fails(workspace_size(p, Backend::kCpu, &bytes), StatusCode::kOverflow, field);
    check_fails(can_implement(p, Backend::kCpu), StatusCode::kOverflow, field);
  };
  Problem p;
  p.num_heads = 32;
  p.seq_len = std::int64_t{1} << 40;
  p.batch = std::int64_t{1} << 30;  // B*T = 2^70
  check_overflow(p, "B*T");
  p.batch = 1;
  p.seq_len = std::int64_t{1} << 50;  // * H * K * 2 = 2^50 * 2^5 * 2^7 * 2 = 2^63
  check_overflow(p, "q/k/g bytes");
  p.head_dim_k = 1;
  p.head_dim_v = 4096;  // v: 2^50 * 2^5 * 2^12 * 2
  check_overflow(p, "v/out bytes");
  p.seq_len = 0;
  p.head_dim_k = p.head_dim_v = 128;
  p.cu_seqlens_dtype = DType::kI64;
  p.num_seqs = std::numeric_limits<std::int64_t>::max();
  check_overflow(p, "num_seqs+1");
  p.num_seqs = std::int64_t{1} << 44;  // state N*H*V*K*4 = 2^(44+5+7+7+2)
  p.initial_state_dtype = DType::kF32;
  check_overflow(p, "initial_state bytes");
  p.initial_state_dtype = DType::kNone;
  p.final_state_dtype = DType::kBF16;
  check_overflow(p, "final_state bytes");
  p.final_state_dtype = DType::kNone;
  p.num_seqs = std::int64_t{1} << 61;  // cu_seqlens (N + 1) * 8 bytes; N*H fits with H = 1
  p.num_heads = 1;
  check_overflow(p, "cu_seqlens bytes");
  p.num_heads = 32;
  p.num_seqs = std::int64_t{1} << 59;  // N*H = 2^64
  p.cu_seqlens_dtype = DType::kI32;    // (N+1)*4 fits
  check_overflow(p, "N*H");
  Problem heads;
  heads.num_heads = std::int64_t{1} << 62;
  heads.head_dim_k = 4;
  check_overflow(heads, "bytes");  // A_log H*4 or dt_bias H*K*4
}

TEST_CASE("validate(Problem / Tensors): pointers / optional states and aliasing") {
  Fixture f;
  auto check_t = [&](const std::function<void(Problem&, Tensors&)>& change,
                     const std::string& field) {
    Problem p = f.p;
    Tensors t = f.t;
    change(p, t);
    check_fails(validate(p, t), StatusCode::kInvalidArgument, field);
  };
  check_t([](Problem&, Tensors& t) { t.q = nullptr; }, "q is null");
  check_t([](Problem&, Tensors& t) { t.k = nullptr; }, "k is null");
  check_t([](Problem&, Tensors& t) { t.v = nullptr; }, "v is null");
  check_t([](Problem&, Tensors& t) { t.g = nullptr; }, "g is null");
  check_t([](Problem&, Tensors& t) { t.beta = nullptr; }, "beta is null");
  check_t([](Problem&, Tensors& t) { t.out = nullptr; }, "out is null");
  check_t([](Problem&, Tensors& t) { t.A_log = nullptr; }, "A_log is null");
  check_t([](Problem&, Tensors& t) { t.dt_bias = nullptr; }, "dt_bias is null");
  check_t([](Problem&, Tensors& t) { t.initial_state = nullptr; }, "initial_state is null");
  check_t([](Problem&, Tensors& t) { t.final_state = nullptr; }, "final_state is null");
  check_t([](Problem& p, Tensors&) { p.initial_state_dtype = DType::kNone; },
          "initial_state is set");
  check_t([](Problem& p, Tensors&) { p.final_state_dtype = DType::kNone; }, "final_state is set");
  check_t([&](Problem&, Tensors& t) { t.cu_seqlens = f.cu.data(); }, "cu_seqlens");
  check_t([&](Problem&, Tensors& t) { t.cu_seqlens_host = f.t.q; }, "cu_seqlens");
  // Aliasing. The two tensors under test share one separate buffer, so nothing else overlaps.
  std::vector<float> arena_storage(1024);
  unsigned char* arena = reinterpret_cast<unsigned char*>(arena_storage.data());
  check_t(
      [](Problem& p, Tensors& t) {
        t.final_state = const_cast<void*>(t.initial_state);
        p.final_state_dtype = DType::kBF16;
      },
      "dtypes differ");
  check_t(
      [&](Problem&, Tensors& t) {
        t.initial_state = arena;
        t.final_state = arena + 4;
      },
      "partially overlaps initial_state");
  check_t(
      [&](Problem&, Tensors& t) {
        t.v = arena;
        t.out = arena + 6;
      },
      "out overlaps v");
  check_t(
      [&](Problem&, Tensors& t) {
        t.q = arena + 90;  // q's last bytes are out's first
        t.out = arena + 90 + 2 * 2 * 3 * 2 * 4 - 2;
      },
      "out overlaps q");
  check_t(
      [&](Problem&, Tensors& t) {
        t.dt_bias = reinterpret_cast<const float*>(arena);
        t.out = arena + 4;
      },
      "out overlaps dt_bias");
  check_t(
      [&](Problem&, Tensors& t) {
        t.final_state = arena;
        t.out = arena + 16;
      },
      "out overlaps final_state");
  check_t(
      [&](Problem&, Tensors& t) {
        t.initial_state = arena;
        t.out = arena + 16;
      },
      "out overlaps initial_state");
  check_t(
      [&](Problem&, Tensors& t) {
        t.beta = arena;
        t.final_state = arena + 8;
      },
      "final_state overlaps beta");
  check_t(
      [&](Problem&, Tensors& t) {
        t.A_log = reinterpret_cast<const float*>(arena + 200);
        t.final_state = arena;
      },
      "final_state overlaps A_log");

  SUBCASE("legal: in place with equal dtypes, adjacent buffers, no state") {
    Problem p = f.p;
    Tensors t = f.t;
    t.final_state = const_cast<void*>(t.initial_state);
    CHECK(validate(p, t).ok());
    // out right after v's last byte does not overlap it.
    std::vector<std::uint16_t> both(2 * f.v.size());
    t.v = both.data();
    t.out = both.data() + f.v.size();
    CHECK(validate(p, t).ok());
    p.initial_state_dtype = p.final_state_dtype = DType::kNone;
    t.initial_state = t.final_state = nullptr;
    CHECK(validate(p, t).ok());
  }
  SUBCASE("no tokens: token tensors may be null") {
    Problem p = f.p;
    p.seq_len = 0;
    Tensors t = f.t;
    t.q = t.k = t.v = t.g = t.beta = nullptr;
    t.out = nullptr;
    CHECK(validate(p, t).ok());
    t.A_log = nullptr;
    check_fails(validate(p, t), StatusCode::kInvalidArgument, "A_log");
  }
  SUBCASE("varlen needs cu_seqlens") {
    f.make_varlen();
    CHECK(validate(f.p, f.t).ok());
    Tensors t = f.t;
    t.cu_seqlens = nullptr;
    check_fails(validate(f.p, t), StatusCode::kInvalidArgument, "cu_seqlens is null");
    t.cu_seqlens = f.cu.data();
    t.out = f.cu.data();
    check_fails(validate(f.p, t), StatusCode::kInvalidArgument, "out overlaps");
  }
}

TEST_CASE("validate_cu_seqlens: contents") {
  Fixture f;
  f.make_varlen();
  auto check_cu = [&](std::vector<std::int64_t> cu, const std::string& field) {
    check_fails(validate_cu_seqlens(f.p, cu.data()), StatusCode::kInvalidArgument, field);
    std::vector<std::int32_t> cu32(cu.begin(), cu.end());
    Problem p32 = f.p;
    p32.cu_seqlens_dtype = DType::kI32;
    check_fails(validate_cu_seqlens(p32, cu32.data()), StatusCode::kInvalidArgument, field);
  };
  CHECK(validate_cu_seqlens(f.p, f.cu.data()).ok());
  const std::vector<std::int32_t> ok32 = {0, 2, 6};
  Problem p32 = f.p;
  p32.cu_seqlens_dtype = DType::kI32;
  CHECK(validate_cu_seqlens(p32, ok32.data()).ok());
  const std::vector<std::int64_t> with_empty = {0, 0, 6};
  CHECK(validate_cu_seqlens(f.p, with_empty.data()).ok());
  check_cu({1, 2, 6}, "cu_seqlens[0]");
  check_cu({0, 7, 6}, "non-decreasing");
  check_cu({0, 2, 5}, "cu_seqlens[2]");
  check_cu({0, 2, 7}, "seq_len");
  check_fails(validate_cu_seqlens(f.p, nullptr), StatusCode::kInvalidArgument, "null");
  Fixture fixed;
  check_fails(validate_cu_seqlens(fixed.p, f.cu.data()), StatusCode::kInvalidArgument,
              "cu_seqlens_dtype");
}

TEST_CASE("can_implement: CPU takes any valid problem / CUDA needs K = V = 128 and a device") {
  Fixture f;
  CHECK(can_implement(f.p, Backend::kCpu).ok());
  check_fails(can_implement(f.p, Backend::kCuda), StatusCode::kUnsupported, "head_dim");
  Problem p = f.p;
  p.head_dim_k = p.head_dim_v = 128;
  const Status cuda = can_implement(p, Backend::kCuda);
  if (!cuda_compiled()) {
    check_fails(cuda, StatusCode::kBackendUnavailable, "not compiled");
  } else if (cuda_device_count() == 0) {
    check_fails(cuda, StatusCode::kBackendUnavailable, "device");
  } else {
    CHECK(cuda.ok());
  }
  p.batch = 0;
  check_fails(can_implement(p, Backend::kCuda), StatusCode::kInvalidArgument, "batch");
  check_fails(can_implement(f.p, static_cast<Backend>(5)), StatusCode::kInvalidArgument, "backend");
}

TEST_CASE("can_implement: CUDA grid limits (heads on y / sequences and chunk slots on x)") {
  Problem p;
  p.num_heads = 65536;
  p.seq_len = 1;
  check_fails(can_implement(p, Backend::kCuda), StatusCode::kUnsupported, "at most 65535 heads");
  CHECK(can_implement(p, Backend::kCpu).ok());
  p.num_heads = 1;
  p.seq_len = std::int64_t{1} << 36;  // 2^32 chunk slots
  check_fails(can_implement(p, Backend::kCuda), StatusCode::kUnsupported, "chunk slots");
  Problem v;
  v.num_heads = 1;
  v.cu_seqlens_dtype = DType::kI64;
  v.num_seqs = std::int64_t{1} << 31;
  v.seq_len = 0;
  check_fails(can_implement(v, Backend::kCuda), StatusCode::kUnsupported, "sequences");
  DecodeProblem d;
  d.batch = std::int64_t{1} << 31;
  d.num_heads = 1;
  d.num_slots = 1;
  check_fails(can_implement(d, Backend::kCuda), StatusCode::kUnsupported, "decode rows");
}

TEST_CASE("describe_device_status: each bit named, zero is ok") {
  CHECK(describe_device_status(0).ok());
  const Status cu = describe_device_status(kDeviceStatusCuSeqlens);
  check_fails(cu, StatusCode::kInvalidArgument, "broken cu_seqlens");
  CHECK(cu.message().find("gate") == std::string::npos);
  const Status all = describe_device_status(kDeviceStatusCuSeqlens | kDeviceStatusGateParams |
                                            kDeviceStatusSlot | 0x100u);
  check_fails(all, StatusCode::kInvalidArgument, "gate parameters out of range");
  CHECK(all.message().find("cu_seqlens") != std::string::npos);
  CHECK(all.message().find("slot index >= the pool size") != std::string::npos);
  CHECK(all.message().find("unknown status bits 0x100") != std::string::npos);
  const Status timeout = describe_device_status(kDeviceStatusStepTimeout);
  check_fails(timeout, StatusCode::kInvalidArgument, "one-launch decode step");
  CHECK(timeout.message().find("unknown") == std::string::npos);
}

TEST_CASE("validate: device_status must not overlap the tensors") {
  Fixture f;
  Tensors t = f.t;
  t.device_status = static_cast<std::uint32_t*>(const_cast<void*>(t.q));
  check_fails(validate(f.p, t), StatusCode::kInvalidArgument, "device_status overlaps q");
}

TEST_CASE("workspace_size: CPU and CUDA formulas / errors") {
  Fixture f;
  std::size_t cpu = 0, cuda = 0;
  REQUIRE(workspace_size(f.p, Backend::kCpu, &cpu).ok());
  CHECK(cpu > 0);
  REQUIRE(workspace_size(f.p, Backend::kCuda, &cuda).ok());
  // CUDA: (ceil(T_total / 16) + N) * H records of 18,688 bytes and as many 4-byte ready flags,
  // plus 256 bytes of alignment slack.
  CHECK(cuda == (1 + 2) * 2 * (18688 + 4) + 256);
  // Depends on sizes only, grows with tokens on CUDA, never with tokens on the CPU.
  Problem longer = f.p;
  longer.seq_len = 1000;
  std::size_t cpu_long = 0, cuda_long = 0;
  REQUIRE(workspace_size(longer, Backend::kCpu, &cpu_long).ok());
  REQUIRE(workspace_size(longer, Backend::kCuda, &cuda_long).ok());
  CHECK(cpu_long == cpu);
  CHECK(cuda_long > cuda);
  // CPU: grows with K and V (state scratch), and is zero without (sequence, head) pairs.
  Problem wide = f.p;
  wide.head_dim_k = wide.head_dim_v = 128;
  std::size_t cpu_wide = 0;
  REQUIRE(workspace_size(wide, Backend::kCpu, &cpu_wide).ok());
  CHECK(cpu_wide >= 4 * 128 * 128 * sizeof(double));  // N*H = 4 slots of a 128 x 128 fp64 state
  Problem none = f.p;
  none.batch = 1;
  none.seq_len = 0;
  none.cu_seqlens_dtype = DType::kI64;
  none.num_seqs = 0;
  std::size_t cpu_none = 1;
  REQUIRE(workspace_size(none, Backend::kCpu, &cpu_none).ok());
  CHECK(cpu_none == 0);

  check_fails(workspace_size(f.p, Backend::kCpu, nullptr), StatusCode::kInvalidArgument, "bytes");
  Problem bad = f.p;
  bad.num_heads = -3;
  check_fails(workspace_size(bad, Backend::kCuda, &cuda), StatusCode::kInvalidArgument,
              "num_heads");
  check_fails(workspace_size(f.p, static_cast<Backend>(3), &cuda), StatusCode::kInvalidArgument,
              "backend");
  // The CUDA record count overflows before the inputs do: 2^58 tokens * 1 head of K = V = 1 is
  // 2^59 bytes of q, but 2^54 chunks * 18,688 bytes passes 2^63.
  Problem huge;
  huge.seq_len = std::int64_t{1} << 58;
  huge.num_heads = 1;
  huge.head_dim_k = huge.head_dim_v = 1;
  REQUIRE(validate(huge).ok());
  check_fails(workspace_size(huge, Backend::kCuda, &cuda), StatusCode::kOverflow, "workspace");
  CHECK(workspace_size(huge, Backend::kCpu, &cpu).ok());
}

TEST_CASE("forward_cpu: workspace too small / null workspace") {
  kda::test::CaseOptions o;
  o.seq_len = 5;
  const kda::test::KdaCase c = kda::test::make_case(o);
  kda::test::Outputs got;
  check_fails(kda::test::run_cpu(c, &got, {}, 1), StatusCode::kWorkspaceTooSmall, "workspace");
  check_fails(kda::test::run_cpu(c, &got, {}, 1 << 30), StatusCode::kWorkspaceTooSmall,
              "workspace");
  std::size_t need = 0;
  REQUIRE(workspace_size(c.problem, Backend::kCpu, &need).ok());
  Tensors t = c.inputs();
  t.out = got.out.data();
  t.final_state = got.final_state_ptr();
  check_fails(forward_cpu(c.problem, t, Workspace{nullptr, need}), StatusCode::kInvalidArgument,
              "workspace");
  // An unaligned workspace pointer works: workspace_size() includes the slack to align it.
  std::vector<unsigned char> ws(need + 1);
  CHECK(forward_cpu(c.problem, t, Workspace{ws.data() + 1, need}).ok());
  CHECK(kda::test::all_finite(got.out));
}

TEST_CASE("CUDA entry points without the CUDA backend") {
  if (cuda_compiled()) {
    MESSAGE("CUDA is compiled in; the no-CUDA fallbacks are not part of this build");
    return;
  }
  CHECK(cuda_device_count() == 0);
  CHECK(device_name() == "none");
  void* ptr = reinterpret_cast<void*>(0x1);
  CHECK(device_malloc(&ptr, 16).code() == StatusCode::kBackendUnavailable);
  CHECK(ptr == nullptr);
  CHECK(device_free(nullptr).code() == StatusCode::kBackendUnavailable);
  CHECK(memcpy_to_device(nullptr, nullptr, 0).code() == StatusCode::kBackendUnavailable);
  CHECK(memcpy_to_host(nullptr, nullptr, 0).code() == StatusCode::kBackendUnavailable);
  CHECK(memset_device(nullptr, 0, 0).code() == StatusCode::kBackendUnavailable);
  CHECK(stream_synchronize(nullptr).code() == StatusCode::kBackendUnavailable);
  Fixture f;
  CHECK(forward_cuda(f.p, f.t, Workspace{}, nullptr).code() == StatusCode::kBackendUnavailable);
  // Validation comes first: a bad problem is reported as such, not as a missing backend.
  Problem bad = f.p;
  bad.num_heads = 0;
  CHECK(forward_cuda(bad, f.t, Workspace{}, nullptr).code() == StatusCode::kInvalidArgument);
  DecodeProblem d;
  d.batch = 0;
  d.num_heads = 1;
  d.head_dim_k = d.head_dim_v = 4;
  DecodeTensors dt;
  std::vector<float> params(4, 0.0f);
  dt.A_log = params.data();
  dt.dt_bias = params.data();
  CHECK(decode_cuda(d, dt, nullptr).code() == StatusCode::kBackendUnavailable);
  CHECK(cuda_device_supported().code() == StatusCode::kBackendUnavailable);
  std::uint32_t word = 0;
  CHECK(check_device_status(&word, nullptr).code() == StatusCode::kBackendUnavailable);
  CHECK(clear_device_status(&word, nullptr).code() == StatusCode::kBackendUnavailable);
}

TEST_CASE("validate(DecodeProblem) and its tensors") {
  DecodeProblem d;
  d.batch = 2;
  d.tokens = 1;
  d.num_heads = 2;
  d.head_dim_k = 4;
  d.head_dim_v = 4;
  d.num_slots = 3;
  REQUIRE(validate(d).ok());
  auto with = [&](const std::function<void(DecodeProblem&)>& change) {
    DecodeProblem p = d;
    change(p);
    return validate(p);
  };
  check_fails(with([](DecodeProblem& p) { p.batch = -1; }), StatusCode::kInvalidArgument, "batch");
  check_fails(with([](DecodeProblem& p) { p.tokens = 0; }), StatusCode::kInvalidArgument, "tokens");
  check_fails(with([](DecodeProblem& p) { p.tokens = 17; }), StatusCode::kInvalidArgument,
              "tokens");
  check_fails(with([](DecodeProblem& p) { p.num_heads = 0; }), StatusCode::kInvalidArgument,
              "num_heads");
  check_fails(with([](DecodeProblem& p) { p.head_dim_k = 0; }), StatusCode::kInvalidArgument,
              "head_dim_k");
  check_fails(with([](DecodeProblem& p) { p.head_dim_v = 9999; }), StatusCode::kInvalidArgument,
              "head_dim_v");
  check_fails(with([](DecodeProblem& p) { p.num_slots = -1; }), StatusCode::kInvalidArgument,
              "num_slots");
  check_fails(with([](DecodeProblem& p) { p.state_dtype = DType::kNone; }),
              StatusCode::kInvalidArgument, "state_dtype");
  check_fails(with([](DecodeProblem& p) { p.state_dtype = DType::kI32; }),
              StatusCode::kInvalidArgument, "state_dtype");
  check_fails(with([](DecodeProblem& p) { p.gate = static_cast<GateMode>(2); }),
              StatusCode::kInvalidArgument, "gate");
  check_fails(with([](DecodeProblem& p) {
                p.gate = GateMode::kLowerBound;
                p.lower_bound = -6.0f;
              }),
              StatusCode::kInvalidArgument, "lower_bound");
  check_fails(with([](DecodeProblem& p) { p.scale = -0.5f; }), StatusCode::kInvalidArgument,
              "scale");
  check_fails(with([](DecodeProblem& p) { p.num_slots = std::int64_t{1} << 60; }),
              StatusCode::kOverflow, "state_pool bytes");
  check_fails(with([](DecodeProblem& p) { p.batch = std::int64_t{1} << 60; }),
              StatusCode::kOverflow, "bytes");
  CHECK(can_implement(d, Backend::kCpu).ok());
  check_fails(can_implement(d, Backend::kCuda), StatusCode::kUnsupported, "head_dim");

  std::vector<std::uint16_t> q(2 * 2 * 4), beta(2 * 2), out(2 * 2 * 4);
  std::vector<float> A_log(2), dt_bias(8), pool(3 * 2 * 4 * 4);
  std::vector<std::int32_t> slots = {0, 1};
  DecodeTensors t;
  t.q = t.k = t.v = t.g = q.data();
  t.beta = beta.data();
  t.A_log = A_log.data();
  t.dt_bias = dt_bias.data();
  t.slots = slots.data();
  t.state_pool = pool.data();
  t.out = out.data();
  REQUIRE(validate(d, t).ok());
  auto check_t = [&](const std::function<void(DecodeTensors&)>& change, const std::string& field) {
    DecodeTensors bad = t;
    change(bad);
    check_fails(validate(d, bad), StatusCode::kInvalidArgument, field);
  };
  check_t([](DecodeTensors& x) { x.q = nullptr; }, "q is null");
  check_t([](DecodeTensors& x) { x.k = nullptr; }, "k is null");
  check_t([](DecodeTensors& x) { x.v = nullptr; }, "v is null");
  check_t([](DecodeTensors& x) { x.g = nullptr; }, "g is null");
  check_t([](DecodeTensors& x) { x.beta = nullptr; }, "beta is null");
  check_t([](DecodeTensors& x) { x.slots = nullptr; }, "slots is null");
  check_t([](DecodeTensors& x) { x.out = nullptr; }, "out is null");
  check_t([](DecodeTensors& x) { x.A_log = nullptr; }, "A_log is null");
  check_t([](DecodeTensors& x) { x.dt_bias = nullptr; }, "dt_bias is null");
  check_t([](DecodeTensors& x) { x.state_pool = nullptr; }, "state_pool is null");
  check_t([&](DecodeTensors& x) { x.out = q.data() + 1; }, "out overlaps q");
  check_t([&](DecodeTensors& x) { x.out = pool.data() + 5; }, "out overlaps state_pool");
  // The two tensors under test share one separate buffer, so nothing else overlaps.
  std::vector<float> arena(1024);
  check_t(
      [&](DecodeTensors& x) {
        x.slots = reinterpret_cast<const std::int32_t*>(arena.data() + 50);
        x.state_pool = arena.data();
      },
      "state_pool overlaps slots");
  check_t(
      [&](DecodeTensors& x) {
        x.q = arena.data() + 4;
        x.state_pool = arena.data();
      },
      "state_pool overlaps q");
}
