// kda-prefill-halves-probe: whether a whole layer's prefill gains from its phases overlapping.
// Timings only, not a test. For each shape: one prefill of T tokens (one sequence) on one stream;
// two prefills of T / 2 tokens one after the other on that stream; and the same two on two streams
// at once (independent layers, states and workspaces: an upper bound for any schedule that
// overlaps a prefill's halves, which would also carry the first half's states into the second).
// Median of events around each form, after warm-up; the one prefill is timed before and after the
// other two (both shown), to show the run's drift.
//   kda-prefill-halves-probe [--tokens T] [--iters N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "kda/bf16.hpp"
#include "kda/layer/layer.hpp"
#include "layer_shapes.hpp"

namespace {

using kda_bench::DeviceMemory;

struct Run {  // one layer's forward of one sequence of `tokens` on its own buffers
  std::unique_ptr<kda::layer::Layer> layer;
  std::int64_t tokens;
  std::vector<std::int64_t> cu;
  std::unique_ptr<DeviceMemory> hidden, out, d_cu, conv_q, conv_k, conv_v, recurrent, ws;
  std::size_t ws_bytes = 0;
  kda::layer::Batch batch;
  kda::layer::State state;
  Run(const kda::layer::Config& config, int seed, std::int64_t T) : tokens(T), cu{0, T} {
    layer =
        kda::layer::make_layer(kda::Backend::kCuda, kda::layer::random_weights(config, 42, seed));
    const std::int64_t E = config.hidden_size, Cl = config.local_channels();
    const std::int64_t Hl = config.local_heads(), D = config.head_dim;
    std::vector<kda::bf16_bits> h(static_cast<std::size_t>(T * E));
    std::mt19937 rng(7 + seed);
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    for (auto& x : h) x = kda::float_to_bf16(dist(rng));
    hidden = std::make_unique<DeviceMemory>(h.size() * 2);
    out = std::make_unique<DeviceMemory>(h.size() * 2);
    CK(cudaMemcpy(hidden->ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    d_cu = std::make_unique<DeviceMemory>(16);
    CK(cudaMemcpy(d_cu->ptr, cu.data(), 16, cudaMemcpyHostToDevice));
    conv_q = std::make_unique<DeviceMemory>(Cl * 3 * 2);
    conv_k = std::make_unique<DeviceMemory>(Cl * 3 * 2);
    conv_v = std::make_unique<DeviceMemory>(Cl * 3 * 2);
    recurrent = std::make_unique<DeviceMemory>(Hl * D * D * 4);
    ws_bytes = kda::layer::workspace_bytes(kda::Backend::kCuda, config, T, 1, 1);
    ws = std::make_unique<DeviceMemory>(ws_bytes);
    batch.tokens = T;
    batch.sequences = 1;
    batch.decode_tokens = 0;
    batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu->ptr);
    batch.cu_seqlens_host = cu.data();
    state.num_slots = 1;
    state.conv_q = static_cast<kda::bf16_bits*>(conv_q->ptr);
    state.conv_k = static_cast<kda::bf16_bits*>(conv_k->ptr);
    state.conv_v = static_cast<kda::bf16_bits*>(conv_v->ptr);
    state.recurrent = recurrent->ptr;
    state.recurrent_dtype = kda::DType::kF32;
  }
  void forward(cudaStream_t s) {
    kda::layer::RunOptions o;
    o.stream = s;
    o.check_pointers = false;
    layer->forward(batch, static_cast<const kda::bf16_bits*>(hidden->ptr),
                   static_cast<kda::bf16_bits*>(out->ptr), state, kda::Workspace{ws->ptr, ws_bytes},
                   o);
  }
};
}  // namespace

int main(int argc, char** argv) {
  std::int64_t T = 8192;
  int iters = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tokens")) T = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
  }
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  std::printf(
      "| layer | one prefill of T | two of T/2 in series | two of T/2 at once | at once / one "
      "|\n|---|---:|---:|---:|---:|\n");
  for (const kda::bench::LayerShape& shape : kda::bench::layer_shapes()) {
    const kda::layer::Config& c = shape.config;
    Run whole(c, 0, T), a(c, 1, T / 2), b(c, 2, T - T / 2);
    auto timed = [&](auto&& f) {  // us, the median after 3 warm-ups, events on s0
      return 1e3 * kda_bench::median_ms([&](int) { f(); }, 3, iters, s0);
    };
    const double one = timed([&] { whole.forward(s0); });
    const double series = timed([&] {
      a.forward(s0);
      b.forward(s0);
    });
    const double at_once = timed([&] {
      cudaEventRecord(fork, s0);
      cudaStreamWaitEvent(s1, fork, 0);
      a.forward(s0);
      b.forward(s1);
      cudaEventRecord(join, s1);
      cudaStreamWaitEvent(s0, join, 0);
    });
    const double one2 = timed([&] { whole.forward(s0); });
    std::printf("| %s | %.1f / %.1f | %.1f | %.1f | %.3f |\n", shape.name, one, one2, series,
                at_once, at_once / std::min(one, one2));
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
