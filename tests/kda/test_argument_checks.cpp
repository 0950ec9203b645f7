// The operator's argument table (kda/src/argument_table.hpp) seen through the public API: every
// tensor of a prefill and of a decode takes part in the aliasing checks under its own name, the
// host copies are named in their own messages, check_device_pointers() validates the problem
// first, and the shared checked arithmetic (kda/detail/checked_math.hpp) holds at its edges.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "kda/detail/checked_math.hpp"
#include "kda/kda.hpp"

using namespace kda;

namespace {

std::string message_of(const Status& st) { return st.ok() ? "ok" : st.message(); }

// Points the token tensors and gate parameters of `t` (Tensors or DecodeTensors) at the
// fixture's buffers of the same names.
template <typename Fixture, typename CallTensors>
void point_inputs(Fixture* f, CallTensors* t) {
  t->q = f->at("q");
  t->k = f->at("k");
  t->v = f->at("v");
  t->g = f->at("g");
  t->beta = f->at("beta");
  t->A_log = static_cast<const float*>(f->at("A_log"));
  t->dt_bias = static_cast<const float*>(f->at("dt_bias"));
}

// A varlen prefill with pooled states and every optional tensor set, each in its own buffer:
// T = 6 tokens in 2 sequences, H = 2, K = V = 4, a pool of 3 f32 states in and another out.
struct Prefill {
  Problem p;
  std::map<std::string, std::vector<std::uint64_t>> buffers;  // 8-byte aligned storage by name
  Tensors t;

  Prefill() {
    p.batch = 1;
    p.seq_len = 6;
    p.num_seqs = 2;
    p.num_heads = 2;
    p.head_dim_k = p.head_dim_v = 4;
    p.cu_seqlens_dtype = DType::kI64;
    p.num_state_slots = 3;
    p.initial_state_dtype = p.final_state_dtype = DType::kF32;
    for (const char* name : {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens",
                             "cu_seqlens_host", "state_slots", "state_slots_host", "initial_state",
                             "final_state", "out", "device_status"}) {
      buffers[name].assign(64, 0);  // 512 bytes: larger than any tensor here
    }
    for (const char* cu : {"cu_seqlens", "cu_seqlens_host"}) buffers[cu] = {0, 2, 6};  // i64
    point_inputs(this, &t);
    t.cu_seqlens = at("cu_seqlens");
    t.cu_seqlens_host = at("cu_seqlens_host");
    t.state_slots = static_cast<const std::int32_t*>(at("state_slots"));
    t.state_slots_host = static_cast<const std::int32_t*>(at("state_slots_host"));
    t.initial_state = at("initial_state");
    t.final_state = at("final_state");
    t.out = at("out");
    t.device_status = static_cast<std::uint32_t*>(at("device_status"));
  }
  void* at(const std::string& name) { return buffers.at(name).data(); }
};

struct Decode {
  DecodeProblem p;
  std::map<std::string, std::vector<std::uint64_t>> buffers;
  DecodeTensors t;

  Decode() {
    p.batch = 2;
    p.tokens = 2;
    p.num_heads = 2;
    p.head_dim_k = p.head_dim_v = 4;
    p.num_slots = 3;
    for (const char* name : {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "slots", "state_pool",
                             "out", "device_status"}) {
      buffers[name].assign(64, 0);
    }
    point_inputs(this, &t);
    t.slots = static_cast<const std::int32_t*>(at("slots"));
    t.state_pool = at("state_pool");
    t.out = at("out");
    t.device_status = static_cast<std::uint32_t*>(at("device_status"));
  }
  void* at(const std::string& name) { return buffers.at(name).data(); }
};

const std::vector<const char*> kPrefillInputs = {"q",
                                                 "k",
                                                 "v",
                                                 "g",
                                                 "beta",
                                                 "A_log",
                                                 "dt_bias",
                                                 "cu_seqlens",
                                                 "cu_seqlens_host",
                                                 "state_slots",
                                                 "state_slots_host"};
const std::vector<const char*> kDecodeInputs = {"q",    "k",     "v",       "g",
                                                "beta", "A_log", "dt_bias", "slots"};

// Places the written tensor `written` (through `place`) over each of `inputs` in turn: validate()
// names the pair.
template <typename Fixture, typename Place>
void check_over_each(Fixture& f, const std::vector<const char*>& inputs, const std::string& written,
                     Place place) {
  for (const char* input : inputs) {
    CAPTURE(input);
    auto t = f.t;
    place(t, f.at(input));
    CHECK(message_of(validate(f.p, t)) ==
          written + " overlaps " + input + " (outputs must not alias inputs)");
  }
}

}  // namespace

TEST_CASE("prefill: every tensor is in the aliasing checks under its own name") {
  Prefill f;
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  check_over_each(f, kPrefillInputs, "out", [](Tensors& t, void* at) { t.out = at; });
  check_over_each(f, kPrefillInputs, "final_state",
                  [](Tensors& t, void* at) { t.final_state = at; });
  check_over_each(f, kPrefillInputs, "device_status",
                  [](Tensors& t, void* at) { t.device_status = static_cast<std::uint32_t*>(at); });
  Tensors t = f.t;
  t.out = f.at("initial_state");
  CHECK(message_of(validate(f.p, t)) ==
        "out overlaps initial_state (outputs must not alias inputs)");
  t = f.t;
  t.out = f.at("final_state");
  CHECK(message_of(validate(f.p, t)) == "out overlaps final_state (outputs must not alias inputs)");
  // Two written tensors are one pair, named by the first in the table.
  t = f.t;
  t.device_status = static_cast<std::uint32_t*>(f.at("out"));
  CHECK(message_of(validate(f.p, t)) ==
        "out overlaps device_status (outputs must not alias inputs)");
  t = f.t;
  t.device_status = static_cast<std::uint32_t*>(f.at("final_state"));
  CHECK(message_of(validate(f.p, t)) ==
        "final_state overlaps device_status (outputs must not alias inputs)");
  // The state pair: an exact alias is an in-place update, anything else partial.
  t = f.t;
  t.final_state = f.at("initial_state");
  CHECK(validate(f.p, t).ok());
  t.final_state = static_cast<unsigned char*>(f.at("initial_state")) + 4;
  CHECK(message_of(validate(f.p, t)) ==
        "final_state partially overlaps initial_state (only an exact alias is allowed)");
}

TEST_CASE("prefill: a one-byte overlap at either end of out is refused") {
  Prefill f;
  auto* out = static_cast<unsigned char*>(f.at("out"));
  auto* q = static_cast<unsigned char*>(f.at("q"));
  const std::size_t out_bytes = 6 * 2 * 4 * 2;  // B*T*H*V bf16, as q's B*T*H*K
  const std::string refused = "out overlaps q (outputs must not alias inputs)";
  // q starting at out's last byte, then right after it.
  Tensors t = f.t;
  t.q = out + out_bytes - 1;
  CHECK(message_of(validate(f.p, t)) == refused);
  t.q = out + out_bytes;
  CHECK(validate(f.p, t).ok());
  // out starting at q's last byte, then right after it.
  t = f.t;
  t.out = q + out_bytes - 1;
  CHECK(message_of(validate(f.p, t)) == refused);
  t.out = q + out_bytes;
  CHECK(validate(f.p, t).ok());
}

// The byte counts of the ranges compared: cu_seqlens holds N + 1 entries, a pool num_state_slots
// entries (not N), and a tensor of no bytes overlaps nothing, wherever it points.
TEST_CASE("prefill: cu_seqlens, pooled states and empty tensors have their own byte ranges") {
  Prefill f;
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  auto* cu = static_cast<unsigned char*>(f.at("cu_seqlens"));
  Tensors t = f.t;
  t.out = cu + 2 * 8;  // cu_seqlens[2], the last of the N + 1 = 3 int64 entries
  CHECK(message_of(validate(f.p, t)) == "out overlaps cu_seqlens (outputs must not alias inputs)");
  t.out = cu + 3 * 8;
  CHECK(validate(f.p, t).ok());
  // Pool entry 2 of num_state_slots = 3 (N = 2): H*V*K*4 = 128 bytes an entry.
  auto* initial = static_cast<unsigned char*>(f.at("initial_state"));
  t = f.t;
  t.out = initial + 2 * 128;
  CHECK(message_of(validate(f.p, t)) ==
        "out overlaps initial_state (outputs must not alias inputs)");
  t.out = initial + 3 * 128;
  CHECK(validate(f.p, t).ok());
  // state_slots: N int32 entries.
  auto* state_slots = static_cast<unsigned char*>(f.at("state_slots"));
  t = f.t;
  t.out = state_slots + 4;
  CHECK(message_of(validate(f.p, t)) == "out overlaps state_slots (outputs must not alias inputs)");
  t.out = state_slots + 2 * 4;
  CHECK(validate(f.p, t).ok());
  // No tokens: q, k, v, g, beta and out are empty ranges, which overlap nothing.
  Prefill empty;
  empty.p.seq_len = 0;
  for (const char* name : {"cu_seqlens", "cu_seqlens_host"}) empty.buffers[name] = {0, 0, 0};
  t = empty.t;
  t.out = static_cast<unsigned char*>(empty.at("initial_state")) + 4;
  t.q = static_cast<unsigned char*>(empty.at("final_state")) + 4;
  CHECK(message_of(validate(empty.p, t)) == "ok");
}

TEST_CASE("prefill: checkpoints need both their offsets and their slots") {
  Prefill f;
  f.p.checkpoints = 1;
  f.p.checkpoint_offsets_dtype = DType::kI64;
  f.buffers["checkpoint_offsets"] = {16, 16};
  f.buffers["checkpoint_slots"].assign(1, 0);
  f.t.checkpoint_offsets = f.at("checkpoint_offsets");
  f.t.checkpoint_slots = static_cast<const std::int32_t*>(f.at("checkpoint_slots"));
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  Tensors t = f.t;
  t.checkpoint_slots = nullptr;
  CHECK(message_of(validate(f.p, t)) == "checkpoint_slots is null");
  t = f.t;
  t.checkpoint_offsets = nullptr;
  CHECK(message_of(validate(f.p, t)) == "checkpoint_offsets is null");
}

TEST_CASE("prefill: host copies are named in their own messages") {
  Prefill f;
  f.p.cu_seqlens_dtype = DType::kNone;
  f.p.batch = 2;
  f.p.seq_len = 3;
  Tensors t = f.t;
  t.cu_seqlens = nullptr;
  CHECK(message_of(validate(f.p, t)) == "cu_seqlens_host is set but cu_seqlens_dtype is none");
  t.cu_seqlens_host = nullptr;
  f.p.num_state_slots = 0;
  t.state_slots = nullptr;
  CHECK(message_of(validate(f.p, t)) == "state_slots_host is set but num_state_slots is 0");
  t.state_slots_host = nullptr;
  t.initial_state = nullptr;
  CHECK(message_of(validate(f.p, t)) == "initial_state is null but initial_state_dtype is f32");
}

TEST_CASE("decode: every tensor is in the aliasing checks under its own name") {
  Decode f;
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  check_over_each(f, kDecodeInputs, "out", [](DecodeTensors& t, void* at) { t.out = at; });
  check_over_each(f, kDecodeInputs, "state_pool",
                  [](DecodeTensors& t, void* at) { t.state_pool = at; });
  check_over_each(f, kDecodeInputs, "device_status", [](DecodeTensors& t, void* at) {
    t.device_status = static_cast<std::uint32_t*>(at);
  });
  DecodeTensors t = f.t;
  t.out = f.at("state_pool");
  CHECK(message_of(validate(f.p, t)) == "out overlaps state_pool (outputs must not alias inputs)");
  t = f.t;
  t.device_status = static_cast<std::uint32_t*>(f.at("state_pool"));
  CHECK(message_of(validate(f.p, t)) ==
        "state_pool overlaps device_status (outputs must not alias inputs)");
  // One token past the limit is refused; the limit itself is fine.
  f.p.tokens = kMaxDecodeTokens;
  CHECK(validate(f.p).ok());
  f.p.tokens = kMaxDecodeTokens + 1;
  CHECK(message_of(validate(f.p)) == "tokens must be in [1, 16] (got 17)");
}

TEST_CASE("decode: a per-token-states verify step needs num_accepted") {
  Decode f;
  f.p.verify = true;  // slots [B, tokens], num_accepted [B]
  f.buffers["num_accepted"].assign(64, 0);
  f.t.num_accepted = static_cast<const std::int32_t*>(f.at("num_accepted"));
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  DecodeTensors t = f.t;
  t.num_accepted = nullptr;
  CHECK(message_of(validate(f.p, t)) == "num_accepted is null");
  // Its slots are [B, tokens] int32: out over row 1's entries is refused, right after them not.
  auto* slots = static_cast<unsigned char*>(f.at("slots"));
  t = f.t;
  t.out = slots + 2 * 4;
  CHECK(message_of(validate(f.p, t)) == "out overlaps slots (outputs must not alias inputs)");
  t.out = slots + 2 * 2 * 4;
  CHECK(validate(f.p, t).ok());
  // num_accepted: B int32 entries.
  auto* accepted = static_cast<unsigned char*>(f.at("num_accepted"));
  t = f.t;
  t.out = accepted + 4;
  CHECK(message_of(validate(f.p, t)) ==
        "out overlaps num_accepted (outputs must not alias inputs)");
  t.out = accepted + 2 * 4;
  CHECK(validate(f.p, t).ok());
}

// The records step's pool is an input unless it folds: then it stores the folded states, and no
// input (the fold's own tensors included) may share its memory.
TEST_CASE("decode: a records step that folds writes the pool, which may alias no input") {
  Decode f;
  f.p.verify = f.p.records = true;
  f.p.fold_batch = 2;
  f.p.fold_tokens = 1;
  for (const char* name : {"records", "fold_records", "fold_rows", "fold_counts"}) {
    f.buffers[name].assign(64, 0);
  }
  f.t.records = static_cast<float*>(f.at("records"));
  f.t.fold_records = static_cast<const float*>(f.at("fold_records"));
  f.t.fold_rows = static_cast<const std::int32_t*>(f.at("fold_rows"));
  f.t.fold_counts = static_cast<const std::int32_t*>(f.at("fold_counts"));
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  std::vector<const char*> inputs = kDecodeInputs;
  inputs.insert(inputs.end(), {"fold_records", "fold_rows", "fold_counts"});
  check_over_each(f, inputs, "state_pool", [](DecodeTensors& t, void* at) { t.state_pool = at; });
  // Without the fold the pool is only read: an input may share its memory.
  f.p.fold_batch = 0;
  DecodeTensors t = f.t;
  t.fold_records = nullptr;
  t.fold_rows = t.fold_counts = nullptr;
  t.state_pool = f.at("q");
  CHECK(validate(f.p, t).ok());
}

// The fold's records are fold_batch x fold_tokens row-token pairs of H x (2K + V) floats each, and
// a step that folds needs them: the pool it writes over the last pair is refused. fold_rows and
// fold_counts hold one entry a row of the step.
TEST_CASE("decode: the fold's records cover every fold token, and are required") {
  Decode f;
  f.p.verify = f.p.records = true;
  f.p.fold_batch = 1;  // of the step's B = 2 rows
  f.p.fold_tokens = 2;
  for (const char* name : {"records", "fold_rows", "fold_counts"}) f.buffers[name].assign(64, 0);
  f.buffers["fold_records"].assign(128, 0);  // 1 KiB: the fold's records, then room for the pool
  f.t.records = static_cast<float*>(f.at("records"));
  auto* fold = static_cast<unsigned char*>(f.at("fold_records"));
  f.t.fold_records = reinterpret_cast<const float*>(fold);
  f.t.fold_rows = static_cast<const std::int32_t*>(f.at("fold_rows"));
  f.t.fold_counts = static_cast<const std::int32_t*>(f.at("fold_counts"));
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  const std::size_t bytes = 1 * 2 * 2 * (2 * 4 + 4) * 4;  // fold_batch*fold_tokens*H*(2K+V) floats
  DecodeTensors t = f.t;
  t.state_pool = fold + bytes - 4;
  CHECK(message_of(validate(f.p, t)) ==
        "state_pool overlaps fold_records (outputs must not alias inputs)");
  t.state_pool = fold + bytes;
  CHECK(validate(f.p, t).ok());
  // fold_rows and fold_counts are the step's: B int32 entries each, whatever fold_batch is.
  for (const char* name : {"fold_rows", "fold_counts"}) {
    CAPTURE(name);
    t = f.t;
    t.out = static_cast<unsigned char*>(f.at(name)) + 4;
    CHECK(message_of(validate(f.p, t)) ==
          std::string("out overlaps ") + name + " (outputs must not alias inputs)");
    t.out = static_cast<unsigned char*>(f.at(name)) + 2 * 4;
    CHECK(validate(f.p, t).ok());
  }
  t = f.t;
  t.fold_records = nullptr;
  CHECK(message_of(validate(f.p, t)) == "fold_records is null");
}

// A records step writes 2K + V floats per (token, head): alpha, k^ and u. An input over the u of
// its last token is refused; one right after the records is not.
TEST_CASE("decode: the records tensor's range covers u, its last V floats") {
  Decode f;
  f.p.verify = f.p.records = true;
  f.buffers["records"].assign(256, 0);  // 2 KiB: records, then room for the pool after them
  auto* records = static_cast<unsigned char*>(f.at("records"));
  f.t.records = reinterpret_cast<float*>(records);
  REQUIRE(message_of(validate(f.p, f.t)) == "ok");
  const std::size_t bytes = 2 * 2 * 2 * (2 * 4 + 4) * 4;  // B*tokens*H*(2K+V) floats
  DecodeTensors t = f.t;
  t.state_pool = records + bytes - 4;  // the pool's first float is the records' last u
  CHECK(message_of(validate(f.p, t)) ==
        "records overlaps state_pool (outputs must not alias inputs)");
  t.state_pool = records + bytes;
  CHECK(validate(f.p, t).ok());
}

TEST_CASE("segment transitions: p_t, h_t and s_out are in the aliasing checks") {
  Prefill f;
  f.p.num_state_slots = 0;
  f.p.initial_state_dtype = f.p.final_state_dtype = DType::kNone;
  f.t.out = f.t.final_state = nullptr;
  f.t.initial_state = nullptr;
  f.t.state_slots = f.t.state_slots_host = nullptr;
  float* p_t = static_cast<float*>(f.at("initial_state"));  // N*H*K*K*4 = 256 bytes
  float* h_t = static_cast<float*>(f.at("final_state"));
  std::vector<unsigned char> ws(1 << 16);
  const Workspace workspace{ws.data(), ws.size()};
  CHECK(segment_transition_cpu(f.p, f.t, p_t, h_t, workspace).ok());
  for (const char* input :
       {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "cu_seqlens_host"}) {
    CAPTURE(input);
    CHECK(message_of(
              segment_transition_cpu(f.p, f.t, static_cast<float*>(f.at(input)), h_t, workspace)) ==
          "p_t overlaps " + std::string(input) + " (outputs must not alias inputs)");
    CHECK(message_of(
              segment_transition_cpu(f.p, f.t, p_t, static_cast<float*>(f.at(input)), workspace)) ==
          "h_t overlaps " + std::string(input) + " (outputs must not alias inputs)");
  }
  // apply: s_out is s_in exactly or disjoint from it, and disjoint from the transition.
  std::vector<float> s(16), pt(16), ht(16);
  CHECK(apply_transition_cpu(1, 4, 4, s.data(), pt.data(), ht.data(), s.data()).ok());
  CHECK(message_of(apply_transition_cpu(1, 4, 4, s.data(), pt.data(), ht.data(), ht.data())) ==
        "s_out overlaps h_t (outputs must not alias inputs)");
  CHECK(message_of(apply_transition_cpu(1, 4, 4, s.data(), pt.data(), ht.data(), nullptr)) ==
        "s_out is null");
}

TEST_CASE("check_device_pointers: the problem first, then the device") {
  Prefill f;
  Decode d;
  Problem bad = f.p;
  bad.num_heads = 0;
  CHECK(message_of(check_device_pointers(bad, f.t)) == "num_heads must be >= 1 (got 0)");
  DecodeProblem bad_decode = d.p;
  bad_decode.tokens = 0;
  CHECK(check_device_pointers(bad_decode, d.t).code() == StatusCode::kInvalidArgument);
  const Status prefill = check_device_pointers(f.p, f.t);
  const Status decode = check_device_pointers(d.p, d.t);
  if (!cuda_compiled()) {
    CHECK(prefill.code() == StatusCode::kBackendUnavailable);
    CHECK(decode.code() == StatusCode::kBackendUnavailable);
  } else if (cuda_device_count() > 0) {
    // Host vectors: the first backend tensor of the table is named.
    CHECK(prefill.code() == StatusCode::kInvalidArgument);
    CHECK(prefill.message().rfind("q ", 0) == 0);
    CHECK(decode.message().rfind("q ", 0) == 0);
    // The host copies are host memory by contract: only they set, nothing to refuse.
    Tensors host_only;
    host_only.cu_seqlens_host = f.t.cu_seqlens_host;
    host_only.state_slots_host = f.t.state_slots_host;
    CHECK(check_device_pointers(f.p, host_only).ok());
  }
}

TEST_CASE("check_cuda_call: the options, the problem and the tensors before the backend") {
  Prefill f;
  Decode d;
  CudaOptions unknown;
  unknown.schedule = static_cast<PrefillSchedule>(7);
  CHECK(message_of(check_cuda_call(f.p, f.t, unknown)) ==
        "CudaOptions::schedule is 7, expected kAuto, kTwoPhase or kPipelined");
  Problem bad = f.p;
  bad.num_heads = 0;
  CHECK(message_of(check_cuda_call(bad, f.t)) == "num_heads must be >= 1 (got 0)");
  // Head size 4: the CUDA backend's limits refuse it before the tensors are walked.
  CHECK(check_cuda_call(f.p, f.t).code() == StatusCode::kUnsupported);
  CHECK(check_cuda_call(d.p, d.t).code() == StatusCode::kUnsupported);
  // Head size 128 (the buffers are too small for it, which only the device walk would see): q two
  // bytes past a 16-byte boundary is refused where a device can run the backend, with the words
  // forward_cuda and decode_cuda use; elsewhere the backend is unavailable.
  Problem p128 = f.p;
  DecodeProblem d128 = d.p;
  p128.head_dim_k = p128.head_dim_v = d128.head_dim_k = d128.head_dim_v = 128;
  Tensors shifted = f.t;
  shifted.q = static_cast<const unsigned char*>(f.t.q) + 2;
  DecodeTensors shifted_step = d.t;
  shifted_step.q = static_cast<const unsigned char*>(d.t.q) + 2;
  const bool runs = cuda_compiled() && cuda_device_count() > 0 && cuda_device_supported().ok();
  const Status prefill = check_cuda_call(p128, shifted);
  const Status decode = check_cuda_call(d128, shifted_step);
  if (runs) {
    CHECK(message_of(prefill) == "q must be 16-byte aligned for the CUDA backend");
    CHECK(message_of(decode) == "q must be 16-byte aligned for the CUDA decode");
  } else if (!cuda_compiled() || cuda_device_count() == 0) {
    CHECK_MESSAGE(prefill.code() == StatusCode::kBackendUnavailable, prefill.to_string());
    CHECK_MESSAGE(decode.code() == StatusCode::kBackendUnavailable, decode.to_string());
  }
}

TEST_CASE("checked arithmetic and align-up at their edges") {
  using namespace kda::detail;
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t out = 7;
  CHECK(checked_mul(std::uint64_t{1} << 32, std::uint64_t{1} << 31, &out));
  CHECK(out == std::uint64_t{1} << 63);
  out = 7;
  CHECK_FALSE(checked_mul(std::uint64_t{1} << 32, std::uint64_t{1} << 32, &out));
  CHECK(out == 7);  // untouched on overflow
  CHECK(checked_mul(0, kMax, &out));
  CHECK(out == 0);
  CHECK(checked_add(kMax - 1, 1, &out));
  CHECK(out == kMax);
  CHECK_FALSE(checked_add(kMax, 1, &out));
  CHECK(checked_product({3, 5, 7}, &out));
  CHECK(out == 105);
  CHECK_FALSE(checked_product({std::uint64_t{1} << 40, std::uint64_t{1} << 30, 0}, &out));
  static_assert(align_up<std::uint64_t>(13, 8) == 16);
  static_assert(align_up<std::uint64_t>(16, 8) == 16);
  static_assert(align_up<std::uint64_t>(0, 64) == 0);
  static_assert(align_up<std::uint64_t>(10, 6) == 12);  // any alignment, not only powers of two
  CHECK(checked_align_up(kMax - 7, 8, &out));
  CHECK(out == kMax - 7);
  CHECK_FALSE(checked_align_up(kMax - 6, 8, &out));
}
