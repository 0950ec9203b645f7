// The C API (kda/kda_engine.h) on the CUDA backend (label `gpu`): an engine created from YAML text
// runs prefill and decode on the caller's device pointers and stream, and agrees with a CPU engine
// made through the same API from the same YAML and seed; the CUDA-only checks (host pointers, the
// device status word) come back as status codes and per-handle messages, never as exceptions or
// faults.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda/kda_engine.h"
#include "kda_reference.hpp"

namespace {

const char* const kSpec =
    "name: c-api-cuda-test\n"
    "hidden_size: 256\n"
    "num_hidden_layers: 2\n"
    "linear_attn_config:\n"
    "  num_heads: 2\n"
    "  head_dim: 128\n"
    "  kda_layers: [1, 2]\n"
    "  full_attn_layers: []\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 256\n"
    "  max_sequences: 3\n"
    "  state_dtype: fp32\n";

struct Handle {
  kda_engine* e = nullptr;
  ~Handle() { kda_engine_destroy(e); }
};

kda_engine* create(kda_backend backend, int check_pointers = 1) {
  kda_engine_options o;
  REQUIRE(kda_engine_options_init(&o) == KDA_OK);
  o.backend = backend;
  o.check_pointers = check_pointers;
  o.seed = 29;
  kda_engine* e = nullptr;
  char err[512] = {0};
  const kda_status st = kda_engine_create_from_string(kSpec, &o, &e, err, sizeof err);
  REQUIRE_MESSAGE(st == KDA_OK, err);
  return e;
}

// Token inputs for `tokens` tokens, H = 2, D = 128, as host bf16 and as device copies.
struct Inputs {
  std::vector<std::uint16_t> q, k, v, g, beta;
  kda::test::DeviceBuffer dq, dk, dv, dg, dbeta;
  Inputs(std::int64_t tokens, std::uint64_t seed) {
    kda::test::Rng rng(seed);
    const std::int64_t n = tokens * 2 * 128;
    q = kda::test::random_bf16(rng, n, 1.0);
    k = kda::test::random_bf16(rng, n, 1.0);
    v = kda::test::random_bf16(rng, n, 1.0);
    g = kda::test::random_bf16(rng, n, 1.0);
    beta = kda::test::random_bf16(rng, tokens * 2, 1.0);
    dq = kda::test::DeviceBuffer::from(q);
    dk = kda::test::DeviceBuffer::from(k);
    dv = kda::test::DeviceBuffer::from(v);
    dg = kda::test::DeviceBuffer::from(g);
    dbeta = kda::test::DeviceBuffer::from(beta);
  }
};

std::vector<double> values(const std::vector<std::uint16_t>& bf16) {
  return kda::test::to_doubles(bf16);
}

}  // namespace

TEST_CASE("C API on CUDA: prefill and decode on device pointers agree with the C API on the CPU") {
  if (!kda::test::gpu_or_skip()) return;
  Handle gpu{create(KDA_BACKEND_CUDA)}, cpu{create(KDA_BACKEND_CPU)};
  kda_backend b = KDA_BACKEND_DEFAULT;
  REQUIRE(kda_engine_backend(gpu.e, &b) == KDA_OK);
  REQUIRE(b == KDA_BACKEND_CUDA);
  size_t json_len = 0;
  REQUIRE(kda_engine_plan_json(gpu.e, nullptr, 0, &json_len) == KDA_OK);
  std::string json(json_len + 1, '\0');
  REQUIRE(kda_engine_plan_json(gpu.e, json.data(), json.size(), nullptr) == KDA_OK);
  CHECK(json.find("engine.device_status") != std::string::npos);

  const std::int64_t T = 203, H = 2, D = 128;
  const std::vector<std::int64_t> cu = {0, 150, 151, 203};
  int gslots[3], cslots[3];
  for (int i = 0; i < 3; ++i) {
    REQUIRE(kda_engine_acquire_slot(gpu.e, &gslots[i]) == KDA_OK);
    REQUIRE(kda_engine_acquire_slot(cpu.e, &cslots[i]) == KDA_OK);
  }
  Inputs in(T, 41);
  kda::test::DeviceBuffer dout(static_cast<std::size_t>(T * H * D) * 2);
  std::vector<std::uint16_t> cout(static_cast<std::size_t>(T * H * D));
  for (int layer = 0; layer < 2; ++layer) {
    dout.fill(0xFF);
    REQUIRE_MESSAGE(
        kda_engine_prefill(gpu.e, layer, in.dq.get(), in.dk.get(), in.dv.get(), in.dg.get(),
                           in.dbeta.get(), dout.get(), gslots, 3, cu.data()) == KDA_OK,
        kda_engine_last_error(gpu.e));
    REQUIRE(kda_engine_prefill(cpu.e, layer, in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                               in.beta.data(), cout.data(), cslots, 3, cu.data()) == KDA_OK);
    REQUIRE(kda_engine_synchronize(gpu.e) == KDA_OK);
    const double e = kda::test::rel_error_bf16(dout.download<std::uint16_t>(), values(cout));
    MESSAGE("C API layer " << layer << " prefill out rel error " << e);
    CHECK(e <= 5e-3);
  }
  // Three decode steps of two tokens for rows (slot 2, padding, slot 0).
  for (int step = 0; step < 3; ++step) {
    Inputs tok(3 * 2, 100 + static_cast<std::uint64_t>(step));
    const int grows[3] = {gslots[2], -1, gslots[0]}, crows[3] = {cslots[2], -1, cslots[0]};
    kda::test::DeviceBuffer sout(static_cast<std::size_t>(3 * 2 * H * D) * 2);
    sout.fill(0);
    std::vector<std::uint16_t> csout(static_cast<std::size_t>(3 * 2 * H * D), 0);
    for (int layer = 0; layer < 2; ++layer) {
      REQUIRE_MESSAGE(
          kda_engine_decode(gpu.e, layer, tok.dq.get(), tok.dk.get(), tok.dv.get(), tok.dg.get(),
                            tok.dbeta.get(), sout.get(), grows, 3, 2) == KDA_OK,
          kda_engine_last_error(gpu.e));
      REQUIRE(kda_engine_decode(cpu.e, layer, tok.q.data(), tok.k.data(), tok.v.data(),
                                tok.g.data(), tok.beta.data(), csout.data(), crows, 3,
                                2) == KDA_OK);
    }
    REQUIRE(kda_engine_synchronize(gpu.e) == KDA_OK);
    const double e = kda::test::rel_error_bf16(sout.download<std::uint16_t>(), values(csout));
    CHECK(e <= 5e-3);
  }
  CHECK_MESSAGE(kda_engine_check_device_status(gpu.e) == KDA_OK, kda_engine_last_error(gpu.e));
  CHECK(kda_engine_check_device_status(cpu.e) == KDA_OK);
}

TEST_CASE(
    "C API on CUDA: host pointers and short buffers come back as KDA_INVALID_ARGUMENT with a "
    "message") {
  if (!kda::test::gpu_or_skip()) return;
  Handle gpu{create(KDA_BACKEND_CUDA)};
  int slot = -1;
  REQUIRE(kda_engine_acquire_slot(gpu.e, &slot) == KDA_OK);
  const std::int64_t T = 40, H = 2, D = 128;
  Inputs in(T, 43);
  kda::test::DeviceBuffer dout(static_cast<std::size_t>(T * H * D) * 2);
  dout.fill(0xFF);
  const std::int64_t cu[2] = {0, T};

  // q on the host.
  kda_status st = kda_engine_prefill(gpu.e, 0, in.q.data(), in.dk.get(), in.dv.get(), in.dg.get(),
                                     in.dbeta.get(), dout.get(), &slot, 1, cu);
  CHECK(st == KDA_INVALID_ARGUMENT);
  CHECK_MESSAGE(
      std::string(kda_engine_last_error(gpu.e)).find("q points to unregistered host memory") !=
          std::string::npos,
      kda_engine_last_error(gpu.e));
  // out one token short of T.
  kda::test::DeviceBuffer short_out(static_cast<std::size_t>((T - 1) * H * D) * 2, 0);
  st = kda_engine_prefill(gpu.e, 0, in.dq.get(), in.dk.get(), in.dv.get(), in.dg.get(),
                          in.dbeta.get(), short_out.get(), &slot, 1, cu);
  CHECK(st == KDA_INVALID_ARGUMENT);
  CHECK_MESSAGE(std::string(kda_engine_last_error(gpu.e)).find("out needs") != std::string::npos,
                kda_engine_last_error(gpu.e));
  // Decode with beta on the host.
  st = kda_engine_decode(gpu.e, 0, in.dq.get(), in.dk.get(), in.dv.get(), in.dg.get(),
                         in.beta.data(), dout.get(), &slot, 1, 1);
  CHECK(st == KDA_INVALID_ARGUMENT);
  CHECK(std::string(kda_engine_last_error(gpu.e)).find("beta points to") != std::string::npos);
  // Nothing was written, and the engine still works.
  REQUIRE(kda_engine_synchronize(gpu.e) == KDA_OK);
  for (std::uint16_t x : dout.download<std::uint16_t>()) {
    if (x != 0xFFFF) {
      FAIL("a refused call wrote its output");
      break;
    }
  }
  CHECK(kda_engine_prefill(gpu.e, 0, in.dq.get(), in.dk.get(), in.dv.get(), in.dg.get(),
                           in.dbeta.get(), dout.get(), &slot, 1, cu) == KDA_OK);
  CHECK(kda_engine_check_device_status(gpu.e) == KDA_OK);
  CHECK(std::string(kda_engine_last_error(gpu.e)).empty());
}

TEST_CASE("C API on CUDA: check_pointers = 0 gives bitwise the same results as the default") {
  if (!kda::test::gpu_or_skip()) return;
  Handle checked{create(KDA_BACKEND_CUDA)}, unchecked{create(KDA_BACKEND_CUDA, 0)};
  const std::int64_t T = 77, H = 2, D = 128;
  const std::int64_t cu[3] = {0, 33, T};
  int a[2], b[2];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(kda_engine_acquire_slot(checked.e, &a[i]) == KDA_OK);
    REQUIRE(kda_engine_acquire_slot(unchecked.e, &b[i]) == KDA_OK);
  }
  Inputs in(T, 47);
  kda::test::DeviceBuffer out_a(static_cast<std::size_t>(T * H * D) * 2),
      out_b(static_cast<std::size_t>(T * H * D) * 2);
  for (int layer = 0; layer < 2; ++layer) {
    REQUIRE(kda_engine_prefill(checked.e, layer, in.dq.get(), in.dk.get(), in.dv.get(), in.dg.get(),
                               in.dbeta.get(), out_a.get(), a, 2, cu) == KDA_OK);
    REQUIRE(kda_engine_prefill(unchecked.e, layer, in.dq.get(), in.dk.get(), in.dv.get(),
                               in.dg.get(), in.dbeta.get(), out_b.get(), b, 2, cu) == KDA_OK);
    REQUIRE(kda_engine_decode(checked.e, layer, in.dq.get(), in.dk.get(), in.dv.get(), in.dg.get(),
                              in.dbeta.get(), out_a.get(), a, 2, 1) == KDA_OK);
    REQUIRE(kda_engine_decode(unchecked.e, layer, in.dq.get(), in.dk.get(), in.dv.get(),
                              in.dg.get(), in.dbeta.get(), out_b.get(), b, 2, 1) == KDA_OK);
  }
  REQUIRE(kda_engine_synchronize(checked.e) == KDA_OK);
  REQUIRE(kda_engine_synchronize(unchecked.e) == KDA_OK);
  CHECK(out_a.download<std::uint16_t>() == out_b.download<std::uint16_t>());
  CHECK(kda_engine_check_device_status(unchecked.e) == KDA_OK);
}
