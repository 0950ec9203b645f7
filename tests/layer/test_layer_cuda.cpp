// What only the CUDA layer has: a slot outside the pool that only the device sees (reported in the
// device status word, run as padding), a forward captured in a CUDA graph (with either output gate
// form), device memory required for the weight image and for the batch's arrays, and the decode
// kernels (RunOptions::decode_kernel) against each other.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/one_launch_exchange.hpp"  // one_launch_max_rows (layer/src)
#include "layer_runner.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda_runtime_util.hpp"
#endif

using namespace kda;
using namespace kda::test;

#ifdef KDA_HAVE_CUDA
namespace {

// One forward of `call` on `stream`, without its pointer checks (no driver queries inside a
// capture), captured into `graph` and instantiated; graph->exec stays null, with a failed check
// saying why, where the capture or the instantiation failed.
void capture_forward(const layer::Layer& layer, ForwardCall call, cudaStream_t stream,
                     Graph* graph) {
  call.options.stream = stream;
  call.options.check_pointers = false;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) {
    FAIL_CHECK("cudaStreamBeginCapture failed");
    return;
  }
  const std::string capture_error = error_of([&] {
    layer.forward(call.batch, call.hidden, call.out, call.state, call.workspace, call.options);
  });
  const cudaError_t end = cudaStreamEndCapture(stream, &graph->graph);
  INFO("forward during capture: " << capture_error);
  CHECK(capture_error == "(no error)");
  CHECK(end == cudaSuccess);
  if (capture_error == "(no error)" && end == cudaSuccess &&
      cudaGraphInstantiate(&graph->exec, graph->graph, 0) != cudaSuccess) {
    FAIL_CHECK("cudaGraphInstantiate failed");
    graph->exec = nullptr;
  }
}

}  // namespace
#endif

namespace {

// What kAuto runs for a plain decode step of `rows` rows of `tokens` tokens a row on `heads` heads
// (layer.hpp, DecodeKernel; the one-launch step's cap: one_launch_max_rows), on buffers it can
// take: what RunOptions::decode_kernel_ran must report. Only for shapes whose one-launch step fits
// the device within that cap (this file's: hidden sizes up to 4104; not Kimi K3's shard, whose two
// rows do not fit shared memory). The fused kernel for one token a row up to 128 (row, head) pairs,
// 32 with an fp32 state, and never with the full-rank output gate; for several tokens a row never.
layer::DecodeKernel auto_decode_kernel(std::int64_t rows, std::int64_t tokens, std::int64_t heads,
                                       bool full_rank_gate, DType state_dtype) {
  if (tokens == 1 && rows >= 1 && rows <= layer::cuda::one_launch_max_rows(heads)) {
    return layer::DecodeKernel::kOneLaunch;
  }
  bool fused = false;  // several tokens a row: never
  if (tokens == 1 && !full_rank_gate) {
    fused = rows * heads <= (state_dtype == DType::kF32 ? 32 : 128);
  }
  return fused ? layer::DecodeKernel::kFusedFactors : layer::DecodeKernel::kSeparate;
}

// A decode step on the separate conv, core and norm kernels (DecodeKernel::kSeparate) from
// `before`, checked against the CPU layer and the fp64 reference.
void check_separate_step(const LayerRunner& cuda, const layer::Weights& weights,
                         const layer::Layer& layer, const std::vector<bf16_bits>& hidden,
                         const BatchSpec& step, const Pools& before) {
  ForwardSettings settings;
  settings.change = [](ForwardCall& call) {
    call.options.decode_kernel = layer::DecodeKernel::kSeparate;
  };
  Pools after = before;
  const LayerRun run = cuda.forward(layer, hidden, step, &after, settings);
  check_forward(cuda, weights, hidden, step, before, run, after);
}

}  // namespace

KDA_LAYER_CUDA_CASE("a slot outside the pool seen only by the device is reported, run as padding") {
  const layer::Config config = cuda.config();
  const layer::Weights weights = layer::random_weights(config, 1, 0);
  const auto layer = cuda.make(weights);
  const std::int64_t E = config.hidden_size;
  Pools before(config, 2);
  before.randomize(3);
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(2 * E), 1.0f, 4);
  for (std::int64_t decode_tokens : {0, 1}) {
    CAPTURE(decode_tokens);
    // Slot 2 is outside the pool of 2 rows; without the host copy only the device can tell.
    const std::vector<std::int32_t> slots = {1, 2};
    const BatchSpec batch =
        decode_tokens > 0 ? decode_batch(2, 1, slots) : prefill_batch({1, 1}, slots);
    ForwardSettings device_only;
    device_only.host_copies = false;
    Pools after = before;
    const LayerRun run = cuda.forward(*layer, hidden, batch, &after, device_only);
    CHECK_MESSAGE(run.error.empty(), run.error);
    const Status status = describe_device_status(run.device_status);
    MESSAGE(status.to_string());
    CHECK((run.device_status & kDeviceStatusSlot) != 0);
    CHECK(status.code() == StatusCode::kInvalidArgument);
    CHECK(run.guards_intact);
    // Row 0 belongs to no sequence: untouched.
    CHECK(after.row_equal(before, 0));
    // The sequence ran as a padding one: the same as slot -1.
    BatchSpec padded = batch;
    padded.slots[1] = -1;
    Pools padded_after = before;
    const LayerRun padded_run = cuda.forward(*layer, hidden, padded, &padded_after);
    check_forward(cuda, weights, hidden, padded, before, padded_run, padded_after);
    CHECK(same_bits(run.out, padded_run.out));
    CHECK(after == padded_after);
  }
}

KDA_LAYER_CUDA_CASE("a host pointer where device memory belongs is refused before anything runs") {
  const layer::Config config = cuda.config();
  const auto layer = cuda.make(layer::random_weights(config, 1, 0));
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(6 * config.hidden_size), 1.0f, 3);
  Pools before(config, 2);
  before.randomize(5);
  const BatchSpec batch = prefill_batch({2, 4}, {0, 1});
  ForwardSettings settings;
  settings.change = [&batch](ForwardCall& call) {
    call.batch.cu_seqlens = batch.cu_seqlens.data();
  };
  const LayerRun run = check_refused(cuda, *layer, hidden, batch, before, settings);
  CHECK(run.code == StatusCode::kInvalidArgument);
  CHECK(run.error.find("cu_seqlens") != std::string::npos);
  // A decode step's recurrent pool in host memory: the layer's own check names it (the core,
  // which reads the pool, does not ask the driver a second time).
  std::vector<float> host_pool(static_cast<std::size_t>(2 * config.num_heads * 128 * 128), 1.0f);
  const BatchSpec step = decode_batch(2, 1, {1, 0});
  ForwardSettings pool_settings;
  pool_settings.change = [&host_pool](ForwardCall& call) {
    call.state.recurrent = host_pool.data();
  };
  const LayerRun step_run = check_refused(cuda, *layer, hidden, step, before, pool_settings);
  CHECK(step_run.code == StatusCode::kInvalidArgument);
  CHECK(step_run.error.find("recurrent pool") != std::string::npos);
  CHECK(std::all_of(host_pool.begin(), host_pool.end(), [](float x) { return x == 1.0f; }));
}

KDA_LAYER_CUDA_CASE("the core's alignment and the schedule are refused before the conv writes") {
  const layer::Config config = cuda.config();
  const auto layer = cuda.make(layer::random_weights(config, 1, 0));
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(6 * config.hidden_size), 1.0f, 3);
  Pools before(config, 3);
  before.randomize(5);
  // A prefill, a one-row step (the one-launch kernel) and a step of two tokens a row (the separate
  // kernels): each would have run the conv, which updates the conv states, before its core.
  const BatchSpec prefill = prefill_batch({2, 4}, {0, 2});
  const BatchSpec one_row = decode_batch(1, 1, {1});
  const BatchSpec two_tokens = decode_batch(2, 2, {2, 0});
  // The recurrent pool 4 bytes past a 16-byte boundary (the pointer checks off: they would refuse
  // the pool first, as reaching 4 bytes past its allocation).
  ForwardSettings shifted_pool;
  shifted_pool.change = [](ForwardCall& call) {
    call.options.check_pointers = false;
    call.state.recurrent = static_cast<unsigned char*>(call.state.recurrent) + 4;
  };
  // The device slots 2 bytes past a 4-byte boundary (their host copy is right).
  ForwardSettings shifted_slots;
  shifted_slots.change = [](ForwardCall& call) {
    call.options.check_pointers = false;
    call.batch.slots = reinterpret_cast<const std::int32_t*>(
        reinterpret_cast<const unsigned char*>(call.batch.slots) + 2);
  };
  for (const BatchSpec* batch : {&prefill, &one_row, &two_tokens}) {
    CAPTURE(batch->decode_tokens);
    CAPTURE(batch->sequences());
    const LayerRun pool_run = check_refused(cuda, *layer, hidden, *batch, before, shifted_pool);
    CHECK(pool_run.code == StatusCode::kInvalidArgument);
    // The prefill's states 8-byte aligned, a decode step's f32 pool 16.
    const bool states =
        pool_run.error.find("initial_state must be 8-byte aligned") != std::string::npos ||
        pool_run.error.find("state_pool must be 16-byte aligned") != std::string::npos;
    CHECK(states);
    const LayerRun slots_run = check_refused(cuda, *layer, hidden, *batch, before, shifted_slots);
    CHECK(slots_run.code == StatusCode::kInvalidArgument);
    CHECK(slots_run.error.find("slots must be 4-byte aligned") != std::string::npos);
  }
  ForwardSettings unknown_schedule;
  unknown_schedule.change = [](ForwardCall& call) {
    call.options.schedule = static_cast<PrefillSchedule>(7);
  };
  const LayerRun run = check_refused(cuda, *layer, hidden, prefill, before, unknown_schedule);
  CHECK(run.code == StatusCode::kInvalidArgument);
  CHECK(run.error ==
        cuda.forward_error_prefix() + "RunOptions::schedule 7 is not a kda::PrefillSchedule");
}

KDA_LAYER_CUDA_CASE("a weight image region in host memory is refused once a device can tell") {
  const layer::Weights weights = with_bias_and_norm(layer::random_weights(cuda.config(), 5, 1));
  const std::size_t bytes = layer::weight_image_bytes(Backend::kCuda, weights.config);
  const std::size_t align = layer::weight_image_alignment(Backend::kCuda);
  std::vector<unsigned char> host(bytes + align, 0x5A);
  unsigned char* region = first_aligned(host, align);
  const std::string message = weight_region_refusal(Backend::kCuda, weights, region, bytes);
  MESSAGE(message);
  CHECK(message.find("weight image") != std::string::npos);
  CHECK(std::all_of(host.begin(), host.end(), [](unsigned char b) { return b == 0x5A; }));
}

KDA_LAYER_CUDA_CASE("a graph-captured forward equals the eager one (prefill and decode)") {
#ifndef KDA_HAVE_CUDA
  FAIL("a CUDA device without the CUDA backend");
#else
  const Stream owned_stream;
  const cudaStream_t stream = owned_stream.stream;
  REQUIRE(stream != nullptr);
  for (const bool full_rank : {false, true}) {
    const layer::Config config = cuda.config(GateMode::kSoftplus, full_rank);
    const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 8, 2));
    const auto layer = cuda.make(weights);
    const std::int64_t E = config.hidden_size;
    // Decode of three rows (kAuto's choice: at 4 heads the one-launch step), of twelve on the
    // separate kernels (cuBLAS's; the full-rank gate's GEMM on the layer's side stream beside the
    // conv, cuBLAS switched to that stream and back) and of one (the small-row kernel's).
    struct Step {
      std::int64_t decode_rows;
      layer::DecodeKernel kernel;
    };
    for (const Step& s :
         {Step{0, layer::DecodeKernel::kAuto}, Step{3, layer::DecodeKernel::kAuto},
          Step{12, layer::DecodeKernel::kSeparate}, Step{1, layer::DecodeKernel::kAuto}}) {
      const std::int64_t decode_rows = s.decode_rows;
      const layer::DecodeKernel kernel = s.kernel;
      CAPTURE(full_rank);
      CAPTURE(decode_rows);
      CAPTURE(layer::to_string(kernel));
      const std::vector<std::int32_t> slots = {3, 0, 1, 12, 5, -1, 7, 15, 2, 9, 10, 4};
      const BatchSpec batch =
          decode_rows > 0
              ? decode_batch(decode_rows, 1,
                             std::vector<std::int32_t>(slots.begin(), slots.begin() + decode_rows))
              : prefill_batch({7, 0, 33}, {3, 0, 1});
      Pools initial(config, 16);
      initial.randomize(12);
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(batch.tokens() * E), 2.0f, 13);

      // Eager, on the stream, pointers checked; no host copies (a graph replays without them).
      ForwardSettings eager_settings;
      eager_settings.host_copies = false;
      eager_settings.change = [stream, kernel](ForwardCall& call) {
        call.options.stream = stream;
        call.options.decode_kernel = kernel;
      };
      Pools eager = initial;
      const LayerRun eager_run = cuda.forward(*layer, hidden, batch, &eager, eager_settings);
      REQUIRE_MESSAGE(eager_run.error.empty(), eager_run.error);
      CHECK(eager_run.all_written);
      check_forward(cuda, weights, hidden, batch, initial, eager_run, eager);

      // Captured into a graph from fresh copies of the same inputs and states, then replayed.
      ForwardBuffers<DeviceBuffer> buffers(
          hidden, batch, initial,
          layer::workspace_bytes(Backend::kCuda, config, batch.tokens(), batch.sequences(), 16));
      ForwardCall call = buffers.call(batch, initial, false);
      call.options.decode_kernel = kernel;
      Graph graph;
      capture_forward(*layer, call, stream, &graph);
      const cudaGraphExec_t exec = graph.exec;
      REQUIRE(exec != nullptr);
      REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
      REQUIRE(stream_synchronize(stream).ok());
      const std::vector<bf16_bits> graph_out = buffers.out.download<bf16_bits>();
      Pools replayed = initial;
      buffers.download(&replayed);
      MESSAGE("graph vs eager out relative error " << relative_error(graph_out, eager_run.out));
      CHECK(same_bits(graph_out, eager_run.out));
      CHECK(replayed == eager);
      CHECK(buffers.guards_intact());
    }
  }
#endif
}

// Every RunOptions::decode_kernel computes the same layer: each against the fp64 reference and the
// CPU layer (check_forward: padding rows zeros, their states untouched), and the fused kernel
// against the separate ones: out and the recurrent state within rounding, the conv states bit for
// bit (they are copies of the projection's inputs). Both gates and output gate forms, f32 and bf16
// pools, conv widths 2 to 4, 1 to 16 tokens a row, one-token steps of 1, 3 and 8 rows (the
// one-launch step's one and several rows: H = 4 takes up to 8) and 9 (past it), and a batch past
// kAuto's 64 rows of in-kernel second factors.
KDA_LAYER_CUDA_CASE("every decode kernel: fused with or without its second factors, and separate") {
  using layer::DecodeKernel;
  struct Variant {
    GateMode gate;
    bool full_rank;
    int width;
    DType pool;
  };
  std::vector<std::int32_t> many;  // 70 rows on a pool of 72, reversed, two of them padding
  for (std::int32_t r = 69; r >= 0; --r) many.push_back(r % 23 == 5 ? -1 : r + 2);
  const DecodeKernel kernels[5] = {DecodeKernel::kAuto, DecodeKernel::kFusedFactors,
                                   DecodeKernel::kFused, DecodeKernel::kSeparate,
                                   DecodeKernel::kOneLaunch};
  const char* kernel_names[5] = {"auto", "fused, factors inside", "fused after GEMMs", "separate",
                                 "one launch"};
  constexpr int kSeparateRun = 3;
  // The GEMM benchmark knobs (LAYER.md) may put the separate and fused steps' input projection on
  // a kernel that adds each row's products in another order than the one-launch step's own rows:
  // their bf16 conv states may then differ from its in the last place. Without a knob (as the
  // library runs) they are bit for bit the same.
  const bool gemm_knob = std::getenv("KDA_LAYER_SMALL_GEMM") != nullptr ||
                         std::getenv("KDA_LAYER_INPUT_GEMM") != nullptr;
  std::uint64_t seed = 60;
  for (const Variant& v : {Variant{GateMode::kSoftplus, false, 4, DType::kF32},
                           Variant{GateMode::kLowerBound, false, 3, DType::kBF16},
                           Variant{GateMode::kLowerBound, true, 4, DType::kF32},
                           Variant{GateMode::kSoftplus, true, 2, DType::kBF16}}) {
    const std::string gate_name = to_string(v.gate);
    CAPTURE(gate_name);
    CAPTURE(v.full_rank);
    CAPTURE(v.width);
    const bool bf16_pool = v.pool == DType::kBF16;
    CAPTURE(bf16_pool);
    layer::Config config = cuda.config(v.gate, v.full_rank);
    config.conv_width = v.width;
    const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 31, v.width));
    const auto layer = cuda.make(weights);
    const std::int64_t E = config.hidden_size;
    for (const BatchSpec& step :
         {decode_batch(1, 1, {3}), decode_batch(1, 1, {-1}), decode_batch(3, 1, {4, -1, 0}),
          decode_batch(8, 1, {7, 2, -1, 0, 5, 1, 6, 3}),
          decode_batch(9, 1, {8, 0, 3, -1, 11, 2, 6, 1, 4}), decode_batch(5, 3, {4, -1, 0, 7, 2}),
          decode_batch(2, 16, {1, 6}), decode_batch(1, 4, {3}), decode_batch(70, 1, many)}) {
      CAPTURE(step.sequences());
      CAPTURE(step.decode_tokens);
      Pools before(config, 72, v.pool);
      before.randomize(++seed);
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(step.tokens() * E), 2.0f, ++seed);
      std::vector<LayerRun> runs;
      std::vector<Pools> afters;
      std::vector<DecodeKernel> ran_kernels;
      for (int k = 0; k < 5; ++k) {
        CAPTURE(kernel_names[k]);
        ForwardSettings settings;
        const DecodeKernel kernel = kernels[k];
        DecodeKernel ran = DecodeKernel::kAuto;
        settings.change = [kernel, &ran](ForwardCall& call) {
          call.options.decode_kernel = kernel;
          call.options.decode_kernel_ran = &ran;
        };
        Pools after = before;
        runs.push_back(cuda.forward(*layer, hidden, step, &after, settings));
        check_forward(cuda, weights, hidden, step, before, runs.back(), after);
        afters.push_back(after);
        // A forced kernel runs; kAuto and kOneLaunch (kAuto where the one launch does not take
        // the step) run kAuto's choice.
        const bool as_auto = kernel == DecodeKernel::kAuto || kernel == DecodeKernel::kOneLaunch;
        ran_kernels.push_back(ran);
        const std::string ran_name = layer::to_string(ran);
        CAPTURE(ran_name);
        CHECK(ran == (as_auto ? auto_decode_kernel(step.sequences(), step.decode_tokens,
                                                   config.num_heads, v.full_rank, v.pool)
                              : kernel));
      }
      // The fused step with each cluster size (blocks a head) computes the same bits as the
      // size chosen by shape (the runs above, RunOptions::fused_cluster 0).
      for (const int cluster : {1, 2, 4, 8}) {
        for (const DecodeKernel kernel : {DecodeKernel::kFusedFactors, DecodeKernel::kFused}) {
          CAPTURE(cluster);
          const bool factors = kernel == DecodeKernel::kFusedFactors;
          CAPTURE(factors);
          ForwardSettings settings;
          settings.change = [kernel, cluster](ForwardCall& call) {
            call.options.decode_kernel = kernel;
            call.options.fused_cluster = cluster;
          };
          Pools after = before;
          const LayerRun run = cuda.forward(*layer, hidden, step, &after, settings);
          const int same_as = factors ? 1 : 2;
          CHECK(same_bits(run.out, runs[same_as].out));
          CHECK(after == afters[same_as]);
        }
      }
      for (int k = 0; k < 5; ++k) {
        if (k == kSeparateRun) continue;
        CAPTURE(kernel_names[k]);
        const double out_error = relative_error(runs[k].out, runs[kSeparateRun].out);
        const double state_error =
            relative_error(afters[k].recurrent(), afters[kSeparateRun].recurrent());
        MESSAGE(std::string(kernel_names[k])
                << " vs separate: out " << out_error << ", state " << state_error);
        CHECK(out_error < 5e-3);
        CHECK(state_error < (bf16_pool ? kBf16PoolTolerance : 1e-4));
        if (gemm_knob && ran_kernels[k] == DecodeKernel::kOneLaunch) {
          CHECK(relative_error(afters[k].conv_q, afters[kSeparateRun].conv_q) < 1e-3);
          CHECK(relative_error(afters[k].conv_k, afters[kSeparateRun].conv_k) < 1e-3);
          CHECK(relative_error(afters[k].conv_v, afters[kSeparateRun].conv_v) < 1e-3);
          continue;
        }
        CHECK(same_bits(afters[k].conv_q, afters[kSeparateRun].conv_q));
        CHECK(same_bits(afters[k].conv_k, afters[kSeparateRun].conv_k));
        CHECK(same_bits(afters[k].conv_v, afters[kSeparateRun].conv_v));
      }
    }
  }
}

// The low-rank second factors of a decode step in the conv's launch up to 2048 16 x 16 tiles a
// factor (4096 at one token a row), past that from the GEMMs on the side stream: each side of
// both limits against the CPU layer and the fp64 reference (padding rows zeros), the low-rank and
// the full-rank output gate. The test config's H = 4 has 32 tiles a row of 16 tokens: 130 rows of
// 8 tokens (2080 tiles) take the GEMMs, 1040 rows of one token (2080) the conv's launch; at H = 8
// (64 tiles a row of 16) 1040 rows of one token (4160) take the GEMMs again.
KDA_LAYER_CUDA_CASE("decode steps on each side of the conv's factor-tile limits equal the CPU") {
  struct Step {
    std::int64_t heads, rows, decode_tokens;
  };
  std::uint64_t seed = 90;
  for (const Step& s : {Step{4, 130, 8}, Step{4, 1040, 1}, Step{8, 1040, 1}}) {
    for (const bool full_rank : {false, true}) {
      CAPTURE(s.heads);
      CAPTURE(s.rows);
      CAPTURE(s.decode_tokens);
      CAPTURE(full_rank);
      // The rows reversed on a pool of rows + 2 entries, every 17th from the 4th padding.
      std::vector<std::int32_t> slots;
      for (std::int64_t r = 0; r < s.rows; ++r) {
        slots.push_back(r % 17 == 3 ? -1 : static_cast<std::int32_t>(s.rows - r));
      }
      layer::Config config = cuda.config(GateMode::kSoftplus, full_rank);
      config.num_heads = s.heads;
      const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 41, 4));
      const auto layer = cuda.make(weights);
      const BatchSpec step = decode_batch(s.rows, s.decode_tokens, slots);
      // A bf16 pool where the rows are many (its states' bytes halved).
      Pools before(config, s.rows + 2, s.rows > 200 ? DType::kBF16 : DType::kF32);
      before.randomize(++seed);
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(step.tokens() * config.hidden_size), 2.0f, ++seed);
      check_separate_step(cuda, weights, *layer, hidden, step, before);
    }
  }
}

// A one-token step of more than 2,048 (row, head) pairs with an fp32 state runs its core in one
// block a head with the gated norm as its epilogue (the operator's rule cuts such a step no finer,
// decode_norm.cu): 530 rows of the test config's 4 heads (2,120 pairs), reversed slots with padding
// rows, both output gates, against the CPU layer and the fp64 reference (padding rows zeros, their
// states untouched).
KDA_LAYER_CUDA_CASE("a one-token step of over 2,048 pairs with an fp32 state equals the CPU") {
  const std::int64_t rows = 530;
  std::vector<std::int32_t> slots;
  for (std::int64_t r = 0; r < rows; ++r) {
    slots.push_back(r % 13 == 5 ? -1 : static_cast<std::int32_t>(rows - r));
  }
  std::uint64_t seed = 110;
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    const layer::Config config = cuda.config(GateMode::kSoftplus, full_rank);
    REQUIRE(rows * config.num_heads > 2048);
    const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, ++seed, 4));
    const auto layer = cuda.make(weights);
    const BatchSpec step = decode_batch(rows, 1, slots);
    Pools before(config, rows + 2, DType::kF32);
    before.randomize(++seed);
    const std::vector<bf16_bits> hidden =
        random_bf16(static_cast<std::size_t>(step.tokens() * config.hidden_size), 2.0f, ++seed);
    check_separate_step(cuda, weights, *layer, hidden, step, before);
  }
}

// The prefill conv stages each block's input rows (its chunk of up to 32 tokens and the W-1 rows
// before it, its tile of channels) in shared memory. Head counts whose channel tiles are not all
// full (H = 3: 144 groups of eight channels in tiles of 96 and 48; H = 12: four of 128, one of
// 64) and the test config's H = 4 (two full tiles), sequences from empty to several chunks long
// (a history from the chunk before, the new conv state from the last chunk's rows), padding and a
// fresh slot: against the CPU layer and the fp64 reference, both output gates.
KDA_LAYER_CUDA_CASE("prefill conv: partial channel tiles and chunks past the first equal the CPU") {
  const std::vector<std::int64_t> lengths = {70, 0, 1, 3, 33, 130, 32, 5};
  const std::vector<std::int32_t> slots = {4, 0, 2, -1, 6, 1, 3, 5};
  std::uint64_t seed = 120;
  for (const std::int64_t heads : {3, 4, 12}) {
    for (const bool full_rank : {false, true}) {
      CAPTURE(heads);
      CAPTURE(full_rank);
      layer::Config config = cuda.config(GateMode::kSoftplus, full_rank);
      config.num_heads = heads;
      const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, ++seed, 4));
      const auto layer = cuda.make(weights);
      const BatchSpec batch = prefill_batch(lengths, slots);
      Pools before(config, 7);
      before.randomize(++seed);
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(batch.tokens() * config.hidden_size), 2.0f, ++seed);
      Pools after = before;
      const LayerRun run = cuda.forward(*layer, hidden, batch, &after);
      check_forward(cuda, weights, hidden, batch, before, run, after);
    }
  }
}

// A one-token decode step's conv loads each warp's taps together (conv_decode.cu), over the lanes
// that have channels. Head counts whose warps are not all full (H = 3: 144 groups of eight
// channels in blocks of 96 threads, the second block's second warp 16 lanes and its third none;
// H = 5: 240 groups in blocks of 128, the last warp 16 lanes), with warps across the q / k / v
// boundaries (H = 5: 80 groups a branch, 32 a warp), and H = 12 (warps full or empty): the
// separate kernels, widths 4 and 3, f32 and bf16 pools, scattered slots and padding rows, against
// the CPU layer and the fp64 reference.
KDA_LAYER_CUDA_CASE("decode conv: warps with fewer lanes than channel groups equal the CPU") {
  const std::vector<std::int32_t> slots = {6, -1, 0, 9, 3, 11, 2, -1, 7};
  std::uint64_t seed = 140;
  for (const std::int64_t heads : {3, 5, 12}) {
    for (const int width : {4, 3}) {
      CAPTURE(heads);
      CAPTURE(width);
      const DType pool = width == 4 ? DType::kF32 : DType::kBF16;
      layer::Config config = cuda.config(GateMode::kSoftplus, false);
      config.num_heads = heads;
      config.conv_width = width;
      const layer::Weights weights =
          with_bias_and_norm(layer::random_weights(config, ++seed, width));
      const auto layer = cuda.make(weights);
      const BatchSpec step = decode_batch(static_cast<std::int64_t>(slots.size()), 1, slots);
      Pools before(config, 12, pool);
      before.randomize(++seed);
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(step.tokens() * config.hidden_size), 2.0f, ++seed);
      check_separate_step(cuda, weights, *layer, hidden, step, before);
    }
  }
}

// The one-launch step of several rows at head counts other than the test config's: H = 3 (8 rows,
// the cap: 24 (row, head) blocks; a 16-row projection tile spans rows of q, k and v) and H = 8 (4
// rows, the most a step of 8 heads takes), and at hidden size 4104 (5 rows; K's last 64-column
// step partial, two rounds of weight loads a warp), with padding rows and scattered slots, both
// output gates, against the CPU layer and the fp64 reference; and a step of one more row than a
// step takes, which runs the other kernels, equal to it within rounding. At hidden size 2312 and
// 4 heads the o_proj blocks hold W_o in registers, the last block's rows fewer than the others'
// (on a device of 132 multiprocessors, as the H200: 19-20 rows a block): at one row a group of
// threads a weight row (o_proj_row_held), at two to four rows two tiles of 16 rows on the tensor
// cores (o_proj_rows_mma). The TP8 shard's hidden size is 2304. At one row and 32, 12 or 17 heads
// (a y of 4096, 1536 or 2176 values) the o_proj blocks' W_o rows are in shared memory, copied there
// kWoHoldNs after their projection rows, a group of threads a weight row.
KDA_LAYER_CUDA_CASE("the one-launch step of several rows at other head counts equals the CPU") {
  struct Variant {
    std::int64_t heads, hidden;  // hidden 0: the test config's
    std::vector<std::int32_t> slots;
  };
  std::uint64_t seed = 170;
  for (const Variant& v :
       {Variant{3, 0, {5, -1, 0, 9, 2, 7, -1, 4}}, Variant{8, 0, {6, 1, -1, 3}},
        Variant{4, 4104, {2, 8, -1, 0, 6}}, Variant{4, 2312, {3}}, Variant{4, 2312, {7, -1, 2}},
        Variant{32, 0, {6}}, Variant{12, 0, {4}}, Variant{17, 0, {9}}}) {
    for (const bool full_rank : {false, true}) {
      CAPTURE(v.heads);
      CAPTURE(v.hidden);
      CAPTURE(full_rank);
      layer::Config config = cuda.config(GateMode::kSoftplus, full_rank);
      config.num_heads = v.heads;
      if (v.hidden != 0) config.hidden_size = v.hidden;
      const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, ++seed, 4));
      const auto layer = cuda.make(weights);
      std::vector<std::int32_t> more = v.slots;
      more.push_back(10);
      const std::vector<std::int32_t>* lists[2] = {&v.slots, &more};
      for (const std::vector<std::int32_t>* slots : lists) {
        const BatchSpec step = decode_batch(static_cast<std::int64_t>(slots->size()), 1, *slots);
        CAPTURE(step.sequences());
        Pools before(config, 11);
        before.randomize(++seed);
        const std::vector<bf16_bits> hidden =
            random_bf16(static_cast<std::size_t>(step.tokens() * config.hidden_size), 2.0f, ++seed);
        LayerRun runs[2];
        for (int k = 0; k < 2; ++k) {
          ForwardSettings settings;
          const layer::DecodeKernel kernel =
              k == 0 ? layer::DecodeKernel::kOneLaunch : layer::DecodeKernel::kSeparate;
          layer::DecodeKernel ran = layer::DecodeKernel::kAuto;
          settings.change = [kernel, &ran](ForwardCall& call) {
            call.options.decode_kernel = kernel;
            call.options.decode_kernel_ran = &ran;
          };
          Pools after = before;
          runs[k] = cuda.forward(*layer, hidden, step, &after, settings);
          check_forward(cuda, weights, hidden, step, before, runs[k], after);
          // The one launch takes the step up to its rows, and only then.
          CHECK(ran == (k == 1 ? layer::DecodeKernel::kSeparate
                               : auto_decode_kernel(step.sequences(), 1, v.heads, full_rank,
                                                    DType::kF32)));
        }
        const double error = relative_error(runs[0].out, runs[1].out);
        MESSAGE("one launch (or as auto past its rows) vs separate: out " << error);
        CHECK(error < 5e-3);
      }
    }
  }
}

// The one-launch step (a plain decode step of one token of each of up to a few sequences): one
// captured graph of one row and one of three rows, each replayed with new slots written before each
// replay (pool rows, negative entries, the caller's null slot), equals eager steps of the same
// slots bit for bit, out and every pool byte; padding rows output zeros, and a step of padding
// alone changes no pool byte. Each replay reads new hidden rows, so that a head that read the
// projection before this launch's was written would show (each launch's values carry a new tag: a
// value left by the launch before must never pass for this one's). The status word stays clear.
KDA_LAYER_CUDA_CASE("the one-launch step: one graph replayed with new slots equals eager steps") {
#ifndef KDA_HAVE_CUDA
  FAIL("a CUDA device without the CUDA backend");
#else
  const Stream owned_stream;
  const cudaStream_t stream = owned_stream.stream;
  REQUIRE(stream != nullptr);
  using Slots = std::vector<std::int32_t>;
  const std::vector<Slots> one_row = {{2}, {0}, {-1}, {3}, {2}, {1}};
  const std::vector<Slots> three_rows = {{2, 0, 1}, {1, -1, 4}, {4, 3, 0}, {-1, 3, -1}, {0, 2, 1}};
  for (const bool full_rank : {false, true}) {
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      for (const std::vector<Slots>* lists : {&one_row, &three_rows}) {
        CAPTURE(full_rank);
        const std::string dtype_name = to_string(dtype);
        CAPTURE(dtype_name);
        const std::int64_t rows = static_cast<std::int64_t>(lists->front().size());
        CAPTURE(rows);
        const layer::Config config =
            cuda.config(full_rank ? GateMode::kLowerBound : GateMode::kSoftplus, full_rank);
        const std::int64_t E = config.hidden_size;
        const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 90, 1));
        const auto layer = cuda.make(weights);
        BatchSpec step = decode_batch(rows, 1, lists->front());
        step.padding_slot = 3;
        Pools initial(config, 5, dtype);
        initial.randomize(91);
        std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(rows * E), 2.0f, 92);
        ForwardBuffers<DeviceBuffer> buffers(
            hidden, step, initial, layer::workspace_bytes(Backend::kCuda, config, rows, rows, 5));
        ForwardCall call = buffers.call(step, initial, false);
        call.options.decode_kernel = layer::DecodeKernel::kOneLaunch;
        layer::DecodeKernel captured = layer::DecodeKernel::kAuto;
        call.options.decode_kernel_ran = &captured;
        Graph graph;
        capture_forward(*layer, call, stream, &graph);
        const cudaGraphExec_t exec = graph.exec;
        REQUIRE(exec != nullptr);
        CHECK(captured == layer::DecodeKernel::kOneLaunch);  // what the graph holds
        Pools expected = initial;  // the eager steps' pools, one step after another
        std::uint64_t seed = 93;
        for (const Slots& slots : *lists) {
          std::string slot_list;
          for (const std::int32_t slot : slots) slot_list += std::to_string(slot) + " ";
          CAPTURE(slot_list);
          hidden = random_bf16(hidden.size(), 2.0f, ++seed);
          // On the replay's stream: a copy on the null stream need not have landed when a
          // non-blocking stream's replay starts.
          REQUIRE(memcpy_to_device(buffers.hidden.get(), hidden.data(), hidden.size() * 2, stream)
                      .ok());
          REQUIRE(
              memcpy_to_device(buffers.slots.get(), slots.data(), slots.size() * 4, stream).ok());
          REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
          REQUIRE(stream_synchronize(stream).ok());
          const std::vector<bf16_bits> replay_out = buffers.out.download<bf16_bits>();
          Pools replayed = initial;
          buffers.download(&replayed);

          BatchSpec eager_step = step;
          eager_step.slots = slots;
          ForwardSettings settings;
          settings.change = [](ForwardCall& c) {
            c.options.decode_kernel = layer::DecodeKernel::kOneLaunch;
          };
          Pools after = expected;
          const LayerRun eager = cuda.forward(*layer, hidden, eager_step, &after, settings);
          // (The references know negative padding only; a step with the null slot is checked
          // against the replay and for its padding rows' zeros.)
          const bool null_slot =
              std::find(slots.begin(), slots.end(), step.padding_slot) != slots.end();
          if (!null_slot) check_forward(cuda, weights, hidden, eager_step, expected, eager, after);
          CHECK(same_bits(replay_out, eager.out));
          CHECK(replayed == after);
          bool all_padding = true;
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::int32_t slot = slots[static_cast<std::size_t>(r)];
            if (slot >= 0 && slot != step.padding_slot) {
              all_padding = false;
              continue;
            }
            CAPTURE(r);
            CHECK(std::all_of(eager.out.begin() + r * E, eager.out.begin() + (r + 1) * E,
                              [](bf16_bits b) { return b == 0; }));
          }
          if (all_padding) CHECK(after == expected);
          expected = after;
        }
        const std::vector<std::uint32_t> status = buffers.status.download<std::uint32_t>();
        CHECK(status[0] == 0u);
        CHECK(buffers.guards_intact());
      }
    }
  }
#endif
}

// hidden and out are bf16 arrays a caller may place at any even address (a row of a larger
// buffer): every GEMM path (the small-row kernels where their alignment allows, cuBLASLt with the
// operands' alignments told) takes them one element past a 256-byte boundary and computes the
// same layer, writing nothing before or after out. With hidden shifted the one-launch step, which
// loads it 16 bytes at a time, gives way to the fused or separate kernels; with out alone shifted
// it runs and stores out an element at a time.
KDA_LAYER_CUDA_CASE("hidden and out one element past an aligned address equal the CPU") {
#ifndef KDA_HAVE_CUDA
  FAIL("a CUDA device without the CUDA backend");
#else
  for (const bool full_rank : {false, true}) {
    const layer::Config config = cuda.config(GateMode::kSoftplus, full_rank);
    const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 21, 2));
    const auto layer = cuda.make(weights);
    const std::int64_t E = config.hidden_size;
    // A prefill (its GEMMs on cuBLASLt), steps of 1 and 4 rows (the one-launch step where it takes
    // the addresses, else the fused step and the fragment kernel's GEMMs), 12 and 64 rows.
    for (const BatchSpec& batch : {prefill_batch({37, 0, 300}, {2, 0, 1}), decode_batch(1, 1, {3}),
                                   decode_batch(4, 1), decode_batch(12, 1), decode_batch(64, 1)}) {
      for (const bool shift_hidden : {true, false}) {
        CAPTURE(full_rank);
        CAPTURE(batch.decode_tokens);
        CAPTURE(batch.tokens());
        CAPTURE(shift_hidden);
        Pools before(config, 64);
        before.randomize(22);
        const std::vector<bf16_bits> hidden =
            random_bf16(static_cast<std::size_t>(batch.tokens() * E), 1.0f, 23);
        const std::size_t bytes = hidden.size() * sizeof(bf16_bits);
        DeviceBuffer shifted_hidden(bytes + 2), shifted_out(bytes + 2);
        shifted_hidden.fill(0);
        REQUIRE(memcpy_to_device(static_cast<unsigned char*>(shifted_hidden.get()) + 2,
                                 hidden.data(), bytes)
                    .ok());
        REQUIRE(DeviceBuffer::synchronize().ok());
        shifted_out.fill(kPoisonByte);
        layer::DecodeKernel ran = layer::DecodeKernel::kAuto;
        ForwardSettings settings;
        settings.change = [&](ForwardCall& call) {
          if (shift_hidden) call.hidden = static_cast<const bf16_bits*>(shifted_hidden.get()) + 1;
          call.out = static_cast<bf16_bits*>(shifted_out.get()) + 1;
          call.options.decode_kernel_ran = &ran;
        };
        Pools after = before;
        LayerRun run = cuda.forward(*layer, hidden, batch, &after, settings);
        const std::vector<unsigned char> out_bytes = shifted_out.download<unsigned char>();
        CHECK(out_bytes[0] == kPoisonByte);
        CHECK(out_bytes[1] == kPoisonByte);
        run.out.assign(hidden.size(), 0);
        std::memcpy(run.out.data(), out_bytes.data() + 2, bytes);
        run.all_written = all_finite(run.out);
        run.guards_intact =
            run.guards_intact && shifted_hidden.guards_intact() && shifted_out.guards_intact();
        check_forward(cuda, weights, hidden, batch, before, run, after);
        if (batch.decode_tokens > 0 &&
            batch.sequences() <= layer::cuda::one_launch_max_rows(config.num_heads)) {
          CHECK((ran == layer::DecodeKernel::kOneLaunch) == !shift_hidden);
        }
      }
    }
  }
#endif
}
