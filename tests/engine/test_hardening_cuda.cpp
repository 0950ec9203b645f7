// Hardening of the CUDA path (label `gpu`; two engines on two streams in two threads:
// test_engine_threads.cpp, both backends): an engine's prefill and decode captured in a CUDA
// graph and replayed with new input contents equal eager runs, bitwise; create -> 1000 forwards ->
// destroy, three times, gives device memory back; an engine the device cannot hold is refused as
// kOutOfMemory and the next engine runs; a prefill of T*H*K > 2^31 elements (H = 128, T =
// 150,000) agrees with the CPU backend on sampled heads. Every case prints "KDA_SKIP: ..." without
// a device.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime_util.hpp"
#include "cuda_test_util.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda_reference.hpp"
#include "synthetic_run.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using kda::engine::BackendChoice;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;
using kda::engine::ModelSpec;
using kda::examples::SyntheticInputs;

#ifdef KDA_HAVE_CUDA
namespace {

// Throws std::runtime_error on a failed status (for code running on worker threads, where doctest
// assertions are avoided).
void ok_or_throw(const kda::Status& st, const char* what) {
  if (!st.ok()) throw std::runtime_error(std::string(what) + ": " + st.to_string());
}

using kda::test::Graph;
using kda::test::Stream;

// 16 heads of 128, three KDA layers, softplus gate: big enough that kernels of two engines overlap.
const char* const kSpec =
    "name: hardening-cuda\n"
    "hidden_size: 2048\n"
    "num_hidden_layers: 4\n"
    "linear_attn_config:\n"
    "  num_heads: 16\n"
    "  head_dim: 128\n"
    "  kda_layers: [1, 2, 4]\n"
    "  full_attn_layers: [3]\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 2048\n"
    "  max_sequences: 4\n"
    "  state_dtype: fp32\n"
    "  workspace_plan: reuse\n";

ModelSpec cuda_spec() { return kda::engine::parse_model_spec(kSpec, "hardening-cuda.yaml"); }

EngineOptions cuda_options(std::uint64_t seed, void* stream) {
  EngineOptions o;
  o.backend = BackendChoice::kCuda;
  o.seed = seed;
  o.stream = stream;
  return o;
}

// Device bytes -> host vector, on the engine's stream (memcpy_to_host waits for the stream).
template <typename T>
std::vector<T> download(const void* device, std::size_t count, void* stream) {
  std::vector<T> host(count);
  ok_or_throw(kda::memcpy_to_host(host.data(), device, count * sizeof(T), stream), "download");
  return host;
}

std::uint8_t* byte_ptr(void* p, std::size_t offset) {
  return static_cast<std::uint8_t*>(p) + offset;
}

}  // namespace
#endif  // KDA_HAVE_CUDA

// ---------------------------------------------------------------------------------------------
// CUDA graphs
// ---------------------------------------------------------------------------------------------
#ifdef KDA_HAVE_CUDA
namespace {

constexpr std::int64_t kGraphTokens = 512;
const std::vector<std::int64_t> kGraphCu = {0, 200,
                                            kGraphTokens};  // two sequences, one run of slots
constexpr int kGraphLayer = 1;                              // the middle KDA layer

struct Snapshot {
  std::vector<std::uint16_t> prefill_out, decode_out;
  std::vector<std::uint8_t> states;  // the two slots' states of kGraphLayer (whole: conv too)
};

// An engine on a non-blocking stream, two acquired slots, and the forward that gets captured: one
// layer's prefill of two sequences, then one decode step of that layer (rows: second slot, padding,
// first slot); the KDA core's calls (prefill / decode on q, k, v, g, beta), or with `whole` the
// whole layer's (prefill_hidden / decode_hidden on hidden states).
class GraphFixture {
 public:
  explicit GraphFixture(bool whole = false)
      : whole_(whole),
        spec_(cuda_spec()),
        engine_(spec_, cuda_options(61, stream_.stream)),
        synthetic_(engine_, kGraphTokens + 3),
        prefill_out_(static_cast<std::size_t>(kGraphTokens * token_out() * 2)),
        decode_out_(static_cast<std::size_t>(3 * token_out() * 2)) {
    slots_ = {engine_.acquire_slot(), engine_.acquire_slot()};
    rows_ = {slots_[1], -1, slots_[0]};
    ok_or_throw(kda::stream_synchronize(nullptr), "buffer setup");  // legacy-stream memsets done
  }
  cudaStream_t stream() const { return stream_.stream; }

  // The captured work: only engine calls.
  void forward() {
    if (whole_) {
      engine_.prefill_hidden(kGraphLayer, synthetic_.hidden(0), prefill_out_.get(), slots_,
                             kGraphCu);
      engine_.decode_hidden(kGraphLayer, synthetic_.hidden(kGraphTokens), decode_out_.get(), rows_,
                            1);
      return;
    }
    engine_.prefill(kGraphLayer, synthetic_.inputs(0), prefill_out_.get(), slots_, kGraphCu);
    engine_.decode(kGraphLayer, synthetic_.inputs(kGraphTokens), decode_out_.get(), rows_, 1);
  }
  // Fresh slot states, new input contents in the same buffers, poisoned outputs.
  void prepare(std::uint64_t input_seed) {
    for (const int slot : slots_) engine_.reset_slot(slot);
    synthetic_.generate(input_seed);
    ok_or_throw(kda::memset_device(prefill_out_.get(), 0xFF, prefill_out_.bytes(), stream_.stream),
                "poison");
    ok_or_throw(kda::memset_device(decode_out_.get(), 0xFF, decode_out_.bytes(), stream_.stream),
                "poison");
  }
  Snapshot collect() {
    engine_.synchronize();
    Snapshot s;
    s.prefill_out =
        download<std::uint16_t>(prefill_out_.get(), prefill_out_.bytes() / 2, stream_.stream);
    s.decode_out =
        download<std::uint16_t>(decode_out_.get(), decode_out_.bytes() / 2, stream_.stream);
    const std::size_t slot_bytes = static_cast<std::size_t>(engine_.state_slot_bytes());
    s.states.resize(slot_bytes * slots_.size());
    for (std::size_t j = 0; j < slots_.size(); ++j) {
      engine_.read_slot_state(kGraphLayer, slots_[j], s.states.data() + slot_bytes * j);
    }
    if (whole_) {
      std::vector<std::uint8_t> conv(static_cast<std::size_t>(engine_.conv_state_slot_bytes()));
      for (const int slot : slots_) {
        for (int projection = 0; projection < 3; ++projection) {
          engine_.read_slot_conv_state(kGraphLayer, slot, projection, conv.data());
          s.states.insert(s.states.end(), conv.begin(), conv.end());
        }
      }
    }
    return s;
  }

 private:
  // Output values a token: the core's H * V, the whole layer's hidden size.
  std::int64_t token_out() const {
    return whole_ ? spec_.hidden_size : spec_.num_heads * spec_.head_dim;
  }

  bool whole_;
  Stream stream_;  // destroyed after the engine
  ModelSpec spec_;
  Engine engine_;
  SyntheticInputs synthetic_;
  kda::test::DeviceBuffer prefill_out_, decode_out_;
  std::vector<int> slots_, rows_;
};

// Captures fixture.forward() on the fixture's stream (thread-local mode). Returns the engine's
// error text, or "" with g->graph set. The capture is always ended, whatever happened.
std::string capture_forward(GraphFixture& f, Graph* g) {
  const cudaError_t begin = cudaStreamBeginCapture(f.stream(), cudaStreamCaptureModeThreadLocal);
  if (begin != cudaSuccess)
    return std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(begin);
  std::string error;
  try {
    f.forward();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(f.stream(), &g->graph);
  if (error.empty() && end != cudaSuccess) {
    error = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
  }
  cudaGetLastError();  // a refused call during capture leaves its error behind: clear it
  return error;
}

void check_same(const Snapshot& got, const Snapshot& want) {
  CHECK(got.prefill_out == want.prefill_out);
  CHECK(got.decode_out == want.decode_out);
  CHECK(got.states == want.states);
}

}  // namespace
#endif  // KDA_HAVE_CUDA

#ifdef KDA_HAVE_CUDA
namespace {

// The fixture's forward captured once and replayed with new inputs, against eager runs.
void captured_forward_equals_eager(bool whole) {
  CAPTURE(whole);
  GraphFixture f(whole);
  REQUIRE(f.stream() != nullptr);
  const std::uint64_t seeds[3] = {101, 102, 103};

  // Eager runs, one per input set. They also stage the batch's cu_seqlens and decode slots on the
  // device, so the captured calls below need no host-to-device copy (see docs/VALIDATION.md).
  std::vector<Snapshot> eager;
  for (const std::uint64_t seed : seeds) {
    f.prepare(seed);
    f.forward();
    eager.push_back(f.collect());
  }
  CHECK(kda::test::all_finite(eager[0].prefill_out));
  CHECK(eager[0].prefill_out != eager[1].prefill_out);  // new inputs really change the results
  CHECK(eager[1].states != eager[2].states);

  f.prepare(999);
  CUDA_REQUIRE(cudaStreamSynchronize(f.stream()));
  Graph g;
  const std::string error = capture_forward(f, &g);
  REQUIRE_MESSAGE(error.empty(), "engine prefill/decode under stream capture: " << error);
  {  // Capturing ran nothing: the outputs still hold the poison.
    const Snapshot idle = f.collect();
    CHECK(std::all_of(idle.prefill_out.begin(), idle.prefill_out.end(),
                      [](std::uint16_t x) { return x == 0xFFFF; }));
    CHECK(std::all_of(idle.decode_out.begin(), idle.decode_out.end(),
                      [](std::uint16_t x) { return x == 0xFFFF; }));
  }
  std::size_t nodes = 0;
  CUDA_REQUIRE(cudaGraphGetNodes(g.graph, nullptr, &nodes));
  CHECK(nodes >= 3);  // prefill: prepare + recurrence kernels; decode: one kernel
  CUDA_REQUIRE(cudaGraphInstantiate(&g.exec, g.graph, 0));

  // Replays with new contents in the same input buffers, in another order, one input set twice.
  for (const int i : {2, 0, 1, 2}) {
    CAPTURE(i);
    f.prepare(seeds[i]);
    CUDA_REQUIRE(cudaGraphLaunch(g.exec, f.stream()));
    check_same(f.collect(), eager[static_cast<std::size_t>(i)]);
  }
  // Eager execution after the replays still agrees.
  f.prepare(seeds[1]);
  f.forward();
  check_same(f.collect(), eager[1]);
}

}  // namespace
#endif

TEST_CASE(
    "engine prefill and decode captured in a CUDA graph and replayed with new inputs equal eager "
    "runs (bitwise)") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  // The KDA cores' calls, and the whole layer's (prefill_hidden / decode_hidden), on host spans.
  captured_forward_equals_eager(false);
  captured_forward_equals_eager(true);
#endif
}

// The engine stages each batch's cu_seqlens (prefill) and slot list (decode) from pageable host
// memory with cudaMemcpyAsync when they differ from what it staged last. Captured as the very first
// call, that copy happens inside the capture. Whether the driver accepts it is what this case finds
// out; it is marked may_fail because the engine does not promise it yet (docs/VALIDATION.md).
TEST_CASE("engine forward captured as the first call after construction (no eager warm-up)" *
          doctest::may_fail()) {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  GraphFixture reference;
  reference.prepare(7);
  reference.forward();
  const Snapshot eager = reference.collect();

  GraphFixture f;
  f.prepare(7);
  CUDA_REQUIRE(cudaStreamSynchronize(f.stream()));
  Graph g;
  const std::string error = capture_forward(f, &g);
  if (!error.empty()) std::printf("capture without warm-up failed: %s\n", error.c_str());
  REQUIRE_MESSAGE(error.empty(), "engine prefill/decode under stream capture: " << error);
  CUDA_REQUIRE(cudaGraphInstantiate(&g.exec, g.graph, 0));
  CUDA_REQUIRE(cudaGraphLaunch(g.exec, f.stream()));
  check_same(f.collect(), eager);
#endif
}

// ---------------------------------------------------------------------------------------------
// Leaks
// ---------------------------------------------------------------------------------------------
TEST_CASE(
    "engine create then 1000 forwards then destroy three times: device memory back to its "
    "baseline") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  const ModelSpec spec = cuda_spec();
  constexpr std::int64_t kTokens = 64;
  const std::vector<std::int64_t> cu = {0, 40, kTokens};
  // One cycle: an engine (arena allocated), `forwards` prefills of one layer (two sequences of 40
  // and 24 tokens) each followed by a decode step of that layer, then the engine destroyed.
  auto cycle = [&](int forwards) {
    Engine e(spec, cuda_options(71, nullptr));
    SyntheticInputs synthetic(e, kTokens + 2);
    synthetic.generate(3);
    const std::vector<int> slots = {e.acquire_slot(), e.acquire_slot()};
    for (int i = 0; i < forwards; ++i) {
      const int layer = i % e.num_layers();
      e.prefill(layer, synthetic.inputs(0), synthetic.output(), slots, cu);
      e.decode(layer, synthetic.inputs(kTokens), synthetic.output(), slots, 1);
    }
    e.synchronize();
    for (const int slot : slots) e.release_slot(slot);
  };
  // Warm-up: the context, and every kernel loaded (lazy module loading keeps them resident).
  CUDA_REQUIRE(cudaFree(nullptr));
  cycle(6);
  CUDA_REQUIRE(cudaDeviceSynchronize());
  std::size_t baseline = 0, total = 0;
  CUDA_REQUIRE(cudaMemGetInfo(&baseline, &total));
  constexpr long long kSlack = 2ll << 20;  // 2 MiB
  // KDA_LEAK_FORWARDS overrides the 1000 forwards per cycle, for runs under compute-sanitizer's
  // racecheck, whose process did not survive 3 x 1000 (docs/SANITIZERS.md).
  int forwards = 1000;
  if (const char* env = std::getenv("KDA_LEAK_FORWARDS")) forwards = std::max(1, std::atoi(env));
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    cycle(forwards);
    CUDA_REQUIRE(cudaDeviceSynchronize());
    std::size_t free_now = 0;
    CUDA_REQUIRE(cudaMemGetInfo(&free_now, &total));
    const long long lost = static_cast<long long>(baseline) - static_cast<long long>(free_now);
    std::printf("leak check round %d: free %zu bytes, baseline %zu, lost %lld\n", round, free_now,
                baseline, lost);
    CHECK(lost <= kSlack);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Out of memory
// ---------------------------------------------------------------------------------------------
TEST_CASE(
    "an engine the device cannot hold is refused as out of memory, and the next engine's forwards "
    "run") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  ModelSpec huge = cuda_spec();
  huge.runtime.max_sequences = 1 << 20;  // 2^20 slots of three layers' 1 MiB fp32 states: 3 TiB
  CUDA_REQUIRE(cudaFree(nullptr));
  CUDA_REQUIRE(cudaGetLastError());
  bool refused = false;
  try {
    Engine e(huge, cuda_options(5, nullptr));
  } catch (const kda::Error& err) {
    refused = true;
    CAPTURE(std::string(err.what()));
    CHECK(err.code() == kda::StatusCode::kOutOfMemory);
    CHECK(std::string(err.what()).find("cudaErrorMemoryAllocation") != std::string::npos);
  }
  CHECK(refused);
  // The refusal is not left as the runtime's last error, which launch checks read (the layer's
  // conv and norm: cudaGetLastError after the launch) and would report again. Without the clearing
  // (one H100) this check failed (cudaErrorMemoryAllocation left behind); the forwards below ran
  // even so: something in the next engine's construction read the error first.
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  constexpr std::int64_t kTokens = 40;
  Engine e(cuda_spec(), cuda_options(73, nullptr));
  SyntheticInputs synthetic(e, kTokens + 1);
  synthetic.generate(5);
  const std::vector<int> slots = {e.acquire_slot()};
  const std::vector<std::int64_t> cu = {0, kTokens};
  for (int layer = 0; layer < e.num_layers(); ++layer) {
    CAPTURE(layer);
    CHECK_NOTHROW(
        e.prefill_hidden(layer, synthetic.hidden(0), synthetic.hidden_output(), slots, cu));
    CHECK_NOTHROW(
        e.decode_hidden(layer, synthetic.hidden(kTokens), synthetic.hidden_output(), slots, 1));
  }
  CHECK_NOTHROW(e.synchronize());
  CHECK_NOTHROW(e.check_device_status());
#endif
}

// ---------------------------------------------------------------------------------------------
// Large sizes
// ---------------------------------------------------------------------------------------------
#ifdef KDA_HAVE_CUDA
namespace {

// splitmix64's finaliser: a value is a function of (tensor, flat index) alone, so any slice of a
// tensor can be regenerated without the rest, and generation parallelises trivially.
inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Uniform in [-1, 1).
inline float hashed_uniform(std::uint64_t tensor, std::uint64_t index) {
  const std::uint64_t h = mix64(index * 0x9e3779b97f4a7c15ull + tensor * 0xd1b54a32d192ed03ull);
  return static_cast<float>(static_cast<double>(h >> 40) * (2.0 / 16777216.0) - 1.0);
}
inline std::uint16_t hashed_bf16(std::uint64_t tensor, std::uint64_t index) {
  return kda::float_to_bf16(hashed_uniform(tensor, index));
}

// f(begin, end) over [0, n) split across the machine's hardware threads.
void parallel_ranges(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& f) {
  const std::int64_t workers = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  const std::int64_t per = (n + workers - 1) / workers;
  std::vector<std::thread> pool;
  for (std::int64_t begin = 0; begin < n; begin += per) {
    pool.emplace_back(f, begin, std::min(n, begin + per));
  }
  for (std::thread& t : pool) t.join();
}

enum TensorId : std::uint64_t { kQ = 1, kK = 2, kV = 3, kG = 4, kBeta = 5, kALog = 6, kDtBias = 7 };

}  // namespace
#endif  // KDA_HAVE_CUDA

TEST_CASE(
    "cuda prefill beyond 2^31 elements: H 128 T 150000 agrees with the CPU backend on sampled "
    "heads") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  constexpr std::int64_t T = 150000, H = 128, D = 128;
  static_assert(T * H * D > (std::int64_t{1} << 31), "the point of the case");
  const std::int64_t sampled[2] = {37, H - 1};  // the last head reaches the largest offsets

  kda::Problem p;
  p.batch = 1;
  p.seq_len = T;
  p.num_heads = H;
  p.head_dim_k = p.head_dim_v = D;
  p.gate = kda::GateMode::kLowerBound;
  p.lower_bound = -5.0f;
  p.initial_state_dtype = kda::DType::kNone;
  p.final_state_dtype = kda::DType::kF32;
  REQUIRE(kda::can_implement(p, kda::Backend::kCuda).ok());
  std::size_t ws_bytes = 0;
  REQUIRE(kda::workspace_size(p, kda::Backend::kCuda, &ws_bytes).ok());

  const std::size_t elems = static_cast<std::size_t>(T * H * D);  // q, k, v, g, out each
  const std::size_t state_elems = static_cast<std::size_t>(H * D * D);
  const std::size_t need = 5 * elems * 2 + static_cast<std::size_t>(T * H) * 2 + ws_bytes +
                           state_elems * 4 + (64u << 20);
  std::size_t free_bytes = 0, total_bytes = 0;
  CUDA_REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < need) {
    std::printf("KDA_SKIP: needs %.1f GB of free device memory, %.1f GB free\n", need / 1e9,
                free_bytes / 1e9);
    return;
  }

  // Parameters: A_log = log(U(0.5, 2)), dt_bias ~ U(-1, 1), as in the other GPU tests.
  std::vector<float> A_log(static_cast<std::size_t>(H)), dt_bias(static_cast<std::size_t>(H * D));
  for (std::size_t h = 0; h < A_log.size(); ++h) {
    A_log[h] = static_cast<float>(std::log(1.25 + 0.75 * hashed_uniform(kALog, h)));
  }
  for (std::size_t i = 0; i < dt_bias.size(); ++i) dt_bias[i] = hashed_uniform(kDtBias, i);

  // Device tensors (no guards: 5 GB each), filled chunk by chunk from one host staging buffer.
  kda::test::DeviceBuffer q(elems * 2, 0), k(elems * 2, 0), v(elems * 2, 0), g(elems * 2, 0),
      out(elems * 2, 0), beta(static_cast<std::size_t>(T * H) * 2, 0), a_log_d(H * 4, 0),
      dt_bias_d(static_cast<std::size_t>(H * D) * 4, 0), final_state(state_elems * 4, 0),
      ws(ws_bytes, 0);
  {
    constexpr std::size_t kChunk = std::size_t{64} << 20;  // elements per upload (128 MB)
    std::vector<std::uint16_t> staging(kChunk);
    auto fill = [&](void* device, std::uint64_t tensor, std::size_t count) {
      for (std::size_t first = 0; first < count; first += kChunk) {
        const std::size_t n = std::min(kChunk, count - first);
        parallel_ranges(static_cast<std::int64_t>(n), [&](std::int64_t b, std::int64_t e) {
          for (std::int64_t i = b; i < e; ++i) {
            staging[static_cast<std::size_t>(i)] =
                hashed_bf16(tensor, first + static_cast<std::size_t>(i));
          }
        });
        CUDA_REQUIRE(cudaMemcpy(static_cast<std::uint16_t*>(device) + first, staging.data(), n * 2,
                                cudaMemcpyHostToDevice));
      }
    };
    fill(q.get(), kQ, elems);
    fill(k.get(), kK, elems);
    fill(v.get(), kV, elems);
    fill(g.get(), kG, elems);
    fill(beta.get(), kBeta, static_cast<std::size_t>(T * H));
  }
  CUDA_REQUIRE(cudaMemcpy(a_log_d.get(), A_log.data(), A_log.size() * 4, cudaMemcpyHostToDevice));
  CUDA_REQUIRE(
      cudaMemcpy(dt_bias_d.get(), dt_bias.data(), dt_bias.size() * 4, cudaMemcpyHostToDevice));
  CUDA_REQUIRE(cudaMemset(out.get(), 0xFF, out.bytes()));
  CUDA_REQUIRE(cudaMemset(final_state.get(), 0xFF, final_state.bytes()));
  CUDA_REQUIRE(cudaDeviceSynchronize());

  kda::Tensors t;
  t.q = q.get();
  t.k = k.get();
  t.v = v.get();
  t.g = g.get();
  t.beta = beta.get();
  t.A_log = static_cast<const float*>(a_log_d.get());
  t.dt_bias = static_cast<const float*>(dt_bias_d.get());
  t.out = out.get();
  t.final_state = final_state.get();
  const kda::Status st = kda::forward_cuda(p, t, kda::Workspace{ws.get(), ws.bytes()}, nullptr);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  CUDA_REQUIRE(cudaDeviceSynchronize());

  // GPU results of the sampled heads: out columns [T, V] (a strided 2-D copy) and final states.
  std::vector<std::uint16_t> gpu_out[2];
  std::vector<float> gpu_state[2];
  for (int j = 0; j < 2; ++j) {
    gpu_out[j].resize(static_cast<std::size_t>(T * D));
    CUDA_REQUIRE(cudaMemcpy2D(gpu_out[j].data(), D * 2,
                              static_cast<const std::uint16_t*>(out.get()) + sampled[j] * D,
                              H * D * 2, D * 2, T, cudaMemcpyDeviceToHost));
    gpu_state[j].resize(static_cast<std::size_t>(D * D));
    CUDA_REQUIRE(cudaMemcpy(gpu_state[j].data(),
                            static_cast<const float*>(final_state.get()) + sampled[j] * D * D,
                            D * D * 4, cudaMemcpyDeviceToHost));
  }

  // The CPU backend on an H = 2 problem made of the sampled heads' inputs and parameters.
  kda::Problem p2 = p;
  p2.num_heads = 2;
  const std::size_t elems2 = static_cast<std::size_t>(T * 2 * D);
  std::vector<std::uint16_t> q2(elems2), k2(elems2), v2(elems2), g2(elems2),
      beta2(static_cast<std::size_t>(T * 2)), out2(elems2, kda::test::kPoisonBf16);
  std::vector<float> A_log2(2), dt_bias2(static_cast<std::size_t>(2 * D)),
      final2(static_cast<std::size_t>(2 * D * D), kda::test::kPoisonF32);
  parallel_ranges(T, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t tok = b; tok < e; ++tok) {
      for (int j = 0; j < 2; ++j) {
        const std::uint64_t src_row = static_cast<std::uint64_t>(tok * H + sampled[j]);
        const std::size_t dst_row = static_cast<std::size_t>(tok * 2 + j);
        for (std::int64_t d = 0; d < D; ++d) {
          const std::uint64_t src = src_row * D + static_cast<std::uint64_t>(d);
          const std::size_t dst = dst_row * D + static_cast<std::size_t>(d);
          q2[dst] = hashed_bf16(kQ, src);
          k2[dst] = hashed_bf16(kK, src);
          v2[dst] = hashed_bf16(kV, src);
          g2[dst] = hashed_bf16(kG, src);
        }
        beta2[dst_row] = hashed_bf16(kBeta, src_row);
      }
    }
  });
  for (int j = 0; j < 2; ++j) {
    A_log2[j] = A_log[static_cast<std::size_t>(sampled[j])];
    std::copy_n(dt_bias.begin() + sampled[j] * D, D, dt_bias2.begin() + j * D);
  }
  std::size_t ws2_bytes = 0;
  REQUIRE(kda::workspace_size(p2, kda::Backend::kCpu, &ws2_bytes).ok());
  std::vector<unsigned char> ws2(ws2_bytes);
  kda::Tensors t2;
  t2.q = q2.data();
  t2.k = k2.data();
  t2.v = v2.data();
  t2.g = g2.data();
  t2.beta = beta2.data();
  t2.A_log = A_log2.data();
  t2.dt_bias = dt_bias2.data();
  t2.out = out2.data();
  t2.final_state = final2.data();
  kda::CpuOptions cpu;
  cpu.num_threads = 0;  // one thread per head here
  const kda::Status st2 = kda::forward_cpu(p2, t2, kda::Workspace{ws2.data(), ws2.size()}, cpu);
  REQUIRE_MESSAGE(st2.ok(), st2.to_string());

  for (int j = 0; j < 2; ++j) {
    CAPTURE(sampled[j]);
    std::vector<double> cpu_out(static_cast<std::size_t>(T * D)),
        cpu_state(static_cast<std::size_t>(D * D));
    for (std::int64_t tok = 0; tok < T; ++tok) {
      for (std::int64_t d = 0; d < D; ++d) {
        cpu_out[static_cast<std::size_t>(tok * D + d)] =
            kda::bf16_to_float(out2[static_cast<std::size_t>((tok * 2 + j) * D + d)]);
      }
    }
    for (std::int64_t i = 0; i < D * D; ++i) {
      cpu_state[static_cast<std::size_t>(i)] = final2[static_cast<std::size_t>(j * D * D + i)];
    }
    CHECK(kda::test::all_finite(gpu_out[j]));
    CHECK(kda::test::all_finite(gpu_state[j]));
    const double e_out = kda::test::rel_error_bf16(gpu_out[j], cpu_out);
    const double e_state = kda::test::rel_error(gpu_state[j], cpu_state);
    std::printf("T=%lld H=%lld head %lld vs CPU: out %.2e state %.2e\n", static_cast<long long>(T),
                static_cast<long long>(H), static_cast<long long>(sampled[j]), e_out, e_state);
    CHECK(e_out <= 5e-3);
    CHECK(e_state <= 5e-3);
  }
#endif
}
