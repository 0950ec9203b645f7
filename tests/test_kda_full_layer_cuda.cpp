// The whole KDA layer on CUDA (kda_full_layer_cuda.hpp) against the CPU layer (FullLayerCpu, itself
// tested against an fp64 reference in test_kda_full_layer.cpp): varlen batches with empty, 1- and
// 2-token sequences (shorter than the conv history), both gates, f32 and bf16 recurrent states,
// scattered slots; prefill then decode steps (with a padding row); conv chunk edges with widths 2-4
// and padding prefill sequences; tensor-parallel ranks summing to the whole layer; every output
// written; host checks refusing bad calls before anything is written; a graph-captured forward
// equal to the eager one; weights placed in caller-provided device memory (an engine's arena)
// equal to self-allocated ones. Tolerance: 1e-2 relative L2 error on out and states (issue 11).
// Cases print the errors they measure.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "full_layer_test_util.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/error.hpp"
#include "kda/engine/kda_full_layer.hpp"
#include "kda/engine/kda_full_layer_cuda.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using kda::bf16_bits;
using kda::bf16_to_float;
using kda::DType;
using kda::float_to_bf16;
using kda::GateMode;
using kda::engine::FullLayerBatch;
using kda::engine::FullLayerConfig;
using kda::engine::FullLayerCpu;
using kda::engine::FullLayerCuda;
using kda::engine::FullLayerCudaBatch;
using kda::engine::FullLayerState;
using kda::engine::FullLayerWeights;
using kda::test::DeviceBuffer;
using kda::test::gpu_or_skip;

using kda::test::error_of;
using kda::test::random_bf16;
using kda::test::relative_error;
using kda::test::with_bias_and_norm;

namespace {

// The CUDA path runs D = 128 only.
FullLayerConfig cuda_config(GateMode gate = GateMode::kSoftplus) {
  FullLayerConfig c;
  c.hidden_size = 256;
  c.num_heads = 4;
  c.head_dim = 128;
  c.conv_width = 4;
  c.gate = gate;
  c.lower_bound = -5.0f;
  c.norm_eps = 1e-5f;
  return c;
}

// State pools on the host: the CPU layer's, and the image uploaded to / downloaded from the GPU.
struct HostPools {
  std::int64_t slots = 0;
  DType dtype = DType::kF32;
  std::vector<bf16_bits> conv_q, conv_k, conv_v;
  std::vector<float> rec_f32;
  std::vector<bf16_bits> rec_bf16;

  HostPools(const FullLayerConfig& c, std::int64_t num_slots, DType recurrent_dtype)
      : slots(num_slots), dtype(recurrent_dtype) {
    const auto conv = static_cast<std::size_t>(num_slots * c.local_channels() * (c.conv_width - 1));
    conv_q.assign(conv, 0);
    conv_k.assign(conv, 0);
    conv_v.assign(conv, 0);
    const auto rec =
        static_cast<std::size_t>(num_slots * c.local_heads() * c.head_dim * c.head_dim);
    if (dtype == DType::kF32) rec_f32.assign(rec, 0.0f);
    if (dtype == DType::kBF16) rec_bf16.assign(rec, 0);
  }
  void randomize(std::uint64_t seed) {
    conv_q = random_bf16(conv_q.size(), 2.0f, seed + 1);
    conv_k = random_bf16(conv_k.size(), 2.0f, seed + 2);
    conv_v = random_bf16(conv_v.size(), 2.0f, seed + 3);
    const std::vector<bf16_bits> bits =
        random_bf16(std::max(rec_f32.size(), rec_bf16.size()), 0.5f, seed + 4);
    if (dtype == DType::kF32) {
      for (std::size_t i = 0; i < bits.size(); ++i) rec_f32[i] = bf16_to_float(bits[i]);
    } else {
      rec_bf16 = bits;
    }
  }
  std::vector<double> recurrent() const {
    std::vector<double> values;
    if (dtype == DType::kF32) values.assign(rec_f32.begin(), rec_f32.end());
    for (bf16_bits b : rec_bf16) values.push_back(bf16_to_float(b));
    return values;
  }
  FullLayerState host_view() {
    FullLayerState s;
    s.num_slots = slots;
    s.conv_q = conv_q.data();
    s.conv_k = conv_k.data();
    s.conv_v = conv_v.data();
    s.recurrent = dtype == DType::kF32 ? static_cast<void*>(rec_f32.data())
                                       : static_cast<void*>(rec_bf16.data());
    s.recurrent_dtype = dtype;
    return s;
  }
  // Rows of a pool, for "this row did not change" checks.
  template <typename T>
  static std::vector<T> row(const std::vector<T>& pool, std::int64_t slots, std::int64_t r) {
    const std::size_t n = pool.size() / static_cast<std::size_t>(slots);
    return std::vector<T>(pool.begin() + r * n, pool.begin() + (r + 1) * n);
  }
};

struct DevicePools {
  DeviceBuffer q, k, v, rec;
  std::int64_t slots;
  DType dtype;
  explicit DevicePools(const HostPools& h)
      : q(DeviceBuffer::from(h.conv_q)),
        k(DeviceBuffer::from(h.conv_k)),
        v(DeviceBuffer::from(h.conv_v)),
        rec(h.dtype == DType::kF32 ? DeviceBuffer::from(h.rec_f32)
                                   : DeviceBuffer::from(h.rec_bf16)),
        slots(h.slots),
        dtype(h.dtype) {}
  FullLayerState view() const {
    FullLayerState s;
    s.num_slots = slots;
    s.conv_q = static_cast<bf16_bits*>(q.get());
    s.conv_k = static_cast<bf16_bits*>(k.get());
    s.conv_v = static_cast<bf16_bits*>(v.get());
    s.recurrent = rec.get();
    s.recurrent_dtype = dtype;
    return s;
  }
  void download(HostPools* h) const {
    h->conv_q = q.download<bf16_bits>();
    h->conv_k = k.download<bf16_bits>();
    h->conv_v = v.download<bf16_bits>();
    if (dtype == DType::kF32) h->rec_f32 = rec.download<float>();
    if (dtype == DType::kBF16) h->rec_bf16 = rec.download<bf16_bits>();
  }
  bool guards_intact() const {
    return q.guards_intact() && k.guards_intact() && v.guards_intact() && rec.guards_intact();
  }
};

std::vector<bf16_bits> run_cpu(const FullLayerCpu& layer, const std::vector<bf16_bits>& hidden,
                               const std::vector<std::int64_t>& cu, HostPools* pools,
                               const std::vector<std::int32_t>& slots = {}) {
  FullLayerBatch batch;
  batch.sequences = static_cast<std::int64_t>(cu.size()) - 1;
  batch.tokens = cu.back();
  batch.cu_seqlens = cu.data();
  batch.slots = slots.empty() ? nullptr : slots.data();
  std::vector<unsigned char> workspace(
      layer.workspace_bytes(batch.tokens, batch.sequences, pools->slots));
  std::vector<bf16_bits> out(hidden.size());
  layer.forward(batch, hidden.data(), out.data(), pools->host_view(),
                kda::Workspace{workspace.data(), workspace.size()});
  return out;
}

// Whether every value is finite: out starts as 0xFF bytes (NaN), so a NaN left means a value the
// forward did not write (or computed as NaN, equally wrong).
bool all_finite(const std::vector<bf16_bits>& values) {
  return std::all_of(values.begin(), values.end(),
                     [](bf16_bits b) { return std::isfinite(bf16_to_float(b)); });
}

struct CudaRun {
  std::vector<bf16_bits> out;
  bool all_written = false;
  bool guards_intact = false;
};

// One forward on the GPU from `pools` (updated in place from the device afterwards), out poisoned
// with 0xFF bytes. decode_tokens > 0: a decode step (every sequence decode_tokens tokens).
CudaRun run_cuda(const FullLayerCuda& layer, const std::vector<bf16_bits>& hidden,
                 const std::vector<std::int64_t>& cu, HostPools* pools,
                 const std::vector<std::int32_t>& slots = {}, std::int64_t decode_tokens = 0) {
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1, T = cu.back();
  DeviceBuffer d_hidden = DeviceBuffer::from(hidden);
  DeviceBuffer d_cu = DeviceBuffer::from(cu);
  DeviceBuffer d_slots = DeviceBuffer::from(slots);
  DeviceBuffer d_out(hidden.size() * sizeof(bf16_bits));
  d_out.fill(0xFF);
  DeviceBuffer d_status(4);
  d_status.fill(0);
  DevicePools d_pools(*pools);
  DeviceBuffer workspace(layer.workspace_bytes(T, N, pools->slots));
  FullLayerCudaBatch batch;
  batch.tokens = T;
  batch.sequences = N;
  batch.decode_tokens = decode_tokens;
  batch.cu_seqlens = decode_tokens > 0 ? nullptr : static_cast<const std::int64_t*>(d_cu.get());
  batch.cu_seqlens_host = decode_tokens > 0 ? nullptr : cu.data();
  batch.slots = slots.empty() ? nullptr : static_cast<const std::int32_t*>(d_slots.get());
  batch.slots_host = slots.empty() ? nullptr : slots.data();
  batch.device_status = static_cast<std::uint32_t*>(d_status.get());
  layer.forward(batch, static_cast<const bf16_bits*>(d_hidden.get()),
                static_cast<bf16_bits*>(d_out.get()), d_pools.view(),
                kda::Workspace{workspace.get(), workspace.bytes()}, nullptr);
  const kda::Status status = kda::check_device_status(batch.device_status, nullptr);
  INFO(status.to_string());
  CHECK(status.ok());
  CudaRun run;
  run.out = d_out.download<bf16_bits>();
  run.all_written = all_finite(run.out);
  run.guards_intact = d_out.guards_intact() && d_pools.guards_intact() && workspace.guards_intact();
  d_pools.download(pools);
  return run;
}

// Compares the GPU's pools with the CPU's, printing each error.
void check_pools(const HostPools& gpu, const HostPools& cpu, double tolerance) {
  const double conv_q = relative_error(gpu.conv_q, cpu.conv_q);
  const double conv_k = relative_error(gpu.conv_k, cpu.conv_k);
  const double conv_v = relative_error(gpu.conv_v, cpu.conv_v);
  const double recurrent = relative_error(gpu.recurrent(), cpu.recurrent());
  MESSAGE("state relative errors: conv_q " << conv_q << ", conv_k " << conv_k << ", conv_v "
                                           << conv_v << ", recurrent " << recurrent);
  CHECK(conv_q <= tolerance);
  CHECK(conv_k <= tolerance);
  CHECK(conv_v <= tolerance);
  CHECK(recurrent <= tolerance);
}

constexpr double kTolerance = 1e-2;

// A forward's out against the CPU layer's: every value written, guards intact, within tolerance.
void check_out(const CudaRun& run, const std::vector<bf16_bits>& expected) {
  const double out_error = relative_error(run.out, expected);
  MESSAGE("out relative error " << out_error);
  CHECK(run.all_written);
  CHECK(run.guards_intact);
  CHECK(out_error <= kTolerance);
}

}  // namespace

TEST_CASE("CUDA layer: workspace_bytes works in every build and grows with the batch") {
  const FullLayerConfig config = cuda_config();
  const std::size_t small = FullLayerCuda::workspace_bytes(config, 1, 1, 1);
  const std::size_t large = FullLayerCuda::workspace_bytes(config, 8192, 64, 64);
  CHECK(small > FullLayerCuda::kCublasWorkspaceBytes);
  CHECK(large > small + 8192 * 4 * 512);  // at least the fp32 output gate
  CHECK(error_of([&] { FullLayerCuda::workspace_bytes(config, -1, 1, 1); }).find(">= 0") !=
        std::string::npos);
  if (!kda::cuda_compiled()) {
    try {
      FullLayerCuda layer(kda::engine::random_full_layer_weights(config, 1, 0));
      FAIL("a build without CUDA constructed a FullLayerCuda");
    } catch (const kda::Error& e) {
      CHECK(e.code() == kda::StatusCode::kBackendUnavailable);
    }
  }
}

TEST_CASE("CUDA layer: weights placed in the caller's device memory run as self-allocated ones") {
  if (!gpu_or_skip()) return;
  const FullLayerConfig config = cuda_config(GateMode::kLowerBound);
  // A g_b bias and a non-trivial o_norm: every tensor of the image is used.
  const FullLayerWeights weights =
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 5, 1));
  const std::size_t image_bytes = FullLayerCuda::weight_image_bytes(config);
  DeviceBuffer region(image_bytes);  // 256-byte aligned, guard bytes on both sides
  const FullLayerCuda placed(weights, region.get(), region.bytes());
  const FullLayerCuda owning(weights);
  CHECK(placed.weight_bytes() == image_bytes);
  CHECK(owning.weight_bytes() == image_bytes);
  CHECK(region.guards_intact());

  const std::vector<std::int64_t> cu = {0, 3, 3, 20};
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(20 * config.hidden_size), 2.0f, 17);
  HostPools placed_pools(config, 4, DType::kF32);
  placed_pools.randomize(3);
  HostPools owning_pools = placed_pools;
  const CudaRun a = run_cuda(placed, hidden, cu, &placed_pools);
  const CudaRun b = run_cuda(owning, hidden, cu, &owning_pools);
  CHECK(a.all_written);
  CHECK(a.out == b.out);  // the same image, the same kernels: bit for bit
  CHECK(relative_error(placed_pools.recurrent(), owning_pools.recurrent()) == 0.0);
  CHECK(region.guards_intact());

  // Host memory is not device memory: refused once a device is there to ask.
  std::vector<unsigned char> host(image_bytes + 256);
  void* host_region = host.data() + (256 - reinterpret_cast<std::uintptr_t>(host.data()) % 256);
  CHECK(error_of([&] {
          FullLayerCuda layer(weights, host_region, image_bytes);
        }).find("weight image") != std::string::npos);
  CHECK(error_of([&] {
          FullLayerCuda layer(weights, region.get(), image_bytes - 256);
        }).find("too small") != std::string::npos);
}

TEST_CASE("CUDA layer matches the CPU layer (varlen with empty, 1- and 2-token sequences)") {
  if (!gpu_or_skip()) return;
  for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const char* gate_name = kda::to_string(gate);
      const char* dtype_name = kda::to_string(dtype);
      CAPTURE(gate_name);
      CAPTURE(dtype_name);
      const FullLayerConfig config = cuda_config(gate);
      FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 7, 3);
      if (gate == GateMode::kLowerBound) weights = with_bias_and_norm(std::move(weights));
      const FullLayerCpu cpu(weights);
      const FullLayerCuda gpu(weights);
      // Lengths 5, 0, 1, 2, 17, 37 (the last over two conv chunks and several core chunks).
      const std::vector<std::int64_t> cu = {0, 5, 5, 6, 8, 25, 62};
      const std::vector<std::int32_t> slots = {5, 0, 1, 3, 2, 6};  // rows 4 and 7 unused
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(62 * config.hidden_size), 2.0f, 11);

      HostPools cpu_pools(config, 8, dtype);
      cpu_pools.randomize(21);  // every sequence continues from non-zero states
      HostPools gpu_pools = cpu_pools;
      const HostPools initial = cpu_pools;
      const std::vector<bf16_bits> expected = run_cpu(cpu, hidden, cu, &cpu_pools, slots);
      const CudaRun run = run_cuda(gpu, hidden, cu, &gpu_pools, slots);

      check_out(run, expected);
      check_pools(gpu_pools, cpu_pools, kTolerance);
      // The empty sequence's row (slot 0) and the unused rows 4 and 7 keep their states bit for
      // bit.
      for (std::int64_t r : {0, 4, 7}) {
        CAPTURE(r);
        CHECK(HostPools::row(gpu_pools.conv_q, 8, r) == HostPools::row(initial.conv_q, 8, r));
        CHECK(HostPools::row(gpu_pools.conv_v, 8, r) == HostPools::row(initial.conv_v, 8, r));
        CHECK(relative_error(HostPools::row(gpu_pools.recurrent(), 8, r),
                             HostPools::row(initial.recurrent(), 8, r)) == 0.0);
      }
    }
  }
}

// The prefill conv kernel hands each thread a chunk of 32 tokens of one sequence (kConvChunk in
// engine/src/cuda/full_layer_kernels.hpp; it was 16): lengths around the chunk and the conv history
// (1, W-2, W-1, 15..17, 31..33, several chunks plus a tail), conv widths 2, 3, 4, scattered slots,
// an unused row and two padding sequences (negative slots: zero state in, nothing written back).
// The CPU layer has no padding: it runs those two from zeroed scratch rows instead.
TEST_CASE("CUDA layer: conv chunk edges, widths 2-4 and padding sequences match the CPU layer") {
  if (!gpu_or_skip()) return;
  for (int width : {2, 3, 4}) {
    CAPTURE(width);
    FullLayerConfig config = cuda_config(GateMode::kSoftplus);
    config.conv_width = width;
    const FullLayerWeights weights = kda::engine::random_full_layer_weights(config, 13, 2);
    const FullLayerCpu cpu(weights);
    const FullLayerCuda gpu(weights);
    const std::int64_t W = width;
    const std::vector<std::int64_t> lengths = {1, W - 2, W - 1, 15, 16, 17, 31, 32, 33, 101, 33, 2};
    // Rows 0..9 for the real sequences (scattered), row 10 unused, rows 11 and 12: the CPU's
    // scratch rows for the two padding sequences (the last two).
    const std::vector<std::int32_t> cpu_slots = {7, 0, 9, 2, 4, 1, 8, 3, 6, 5, 11, 12};
    std::vector<std::int32_t> gpu_slots = cpu_slots;
    gpu_slots[10] = -1;
    gpu_slots[11] = -3;
    constexpr std::int64_t kRows = 13;
    std::vector<std::int64_t> cu = {0};
    for (std::int64_t len : lengths) cu.push_back(cu.back() + len);
    const std::vector<bf16_bits> hidden =
        random_bf16(static_cast<std::size_t>(cu.back() * config.hidden_size), 2.0f, 17);

    HostPools cpu_pools(config, kRows, DType::kF32);
    cpu_pools.randomize(31);
    auto zero_row = [](auto& pool, std::int64_t r) {
      const std::size_t n = pool.size() / static_cast<std::size_t>(kRows);
      std::fill(pool.begin() + r * n, pool.begin() + (r + 1) * n, 0);
    };
    auto zero_scratch = [&](HostPools* pools) {
      for (std::int64_t r : {11, 12}) {
        zero_row(pools->conv_q, r);
        zero_row(pools->conv_k, r);
        zero_row(pools->conv_v, r);
        zero_row(pools->rec_f32, r);
      }
    };
    zero_scratch(&cpu_pools);
    HostPools gpu_pools = cpu_pools;
    const HostPools initial = cpu_pools;
    const std::vector<bf16_bits> expected = run_cpu(cpu, hidden, cu, &cpu_pools, cpu_slots);
    const CudaRun run = run_cuda(gpu, hidden, cu, &gpu_pools, gpu_slots);

    check_out(run, expected);
    // Each sequence on its own too (a short one's error would vanish in the batch's norm).
    const std::int64_t E = config.hidden_size;
    for (std::size_t n = 0; n < lengths.size(); ++n) {
      if (lengths[n] == 0) continue;
      CAPTURE(n);
      const std::vector<bf16_bits> got(run.out.begin() + cu[n] * E,
                                       run.out.begin() + cu[n + 1] * E);
      const std::vector<bf16_bits> want(expected.begin() + cu[n] * E,
                                        expected.begin() + cu[n + 1] * E);
      CHECK(relative_error(got, want) <= kTolerance);
    }
    // The padding sequences wrote nothing: rows 11 and 12 are still zeros on the GPU, as is the
    // unused row 10 unchanged; the CPU's scratch rows are reset before comparing the rest.
    for (std::int64_t r : {10, 11, 12}) {
      CAPTURE(r);
      CHECK(HostPools::row(gpu_pools.conv_q, kRows, r) == HostPools::row(initial.conv_q, kRows, r));
      CHECK(HostPools::row(gpu_pools.conv_k, kRows, r) == HostPools::row(initial.conv_k, kRows, r));
      CHECK(HostPools::row(gpu_pools.conv_v, kRows, r) == HostPools::row(initial.conv_v, kRows, r));
      CHECK(HostPools::row(gpu_pools.rec_f32, kRows, r) ==
            HostPools::row(initial.rec_f32, kRows, r));
    }
    zero_scratch(&cpu_pools);
    check_pools(gpu_pools, cpu_pools, kTolerance);
  }
}

TEST_CASE("CUDA layer: prefill then decode steps track the CPU layer (with a padding row)") {
  if (!gpu_or_skip()) return;
  const FullLayerConfig config = cuda_config(GateMode::kLowerBound);
  const FullLayerWeights weights =
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 4, 1));
  const FullLayerCpu cpu(weights);
  const FullLayerCuda gpu(weights);
  const std::int64_t E = config.hidden_size;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const char* dtype_name = kda::to_string(dtype);
    CAPTURE(dtype_name);
    HostPools cpu_pools(config, 3, dtype);
    HostPools gpu_pools(config, 3, dtype);
    const std::vector<std::int32_t> slots = {2, 0};
    // Prefill 6 and 2 tokens (the second shorter than the conv history).
    const std::vector<bf16_bits> prefill = random_bf16(static_cast<std::size_t>(8 * E), 2.0f, 9);
    const std::vector<bf16_bits> expected = run_cpu(cpu, prefill, {0, 6, 8}, &cpu_pools, slots);
    const CudaRun run = run_cuda(gpu, prefill, {0, 6, 8}, &gpu_pools, slots);
    MESSAGE("prefill out relative error " << relative_error(run.out, expected));
    CHECK(run.all_written);
    CHECK(relative_error(run.out, expected) <= kTolerance);

    // Three one-token steps, then one two-token step.
    for (std::int64_t step = 0; step < 4; ++step) {
      CAPTURE(step);
      const std::int64_t k = step < 3 ? 1 : 2;
      const std::vector<bf16_bits> in =
          random_bf16(static_cast<std::size_t>(2 * k * E), 2.0f, 100 + step);
      const std::vector<bf16_bits> step_expected =
          run_cpu(cpu, in, {0, k, 2 * k}, &cpu_pools, slots);
      const CudaRun step_run = run_cuda(gpu, in, {0, k, 2 * k}, &gpu_pools, slots, k);
      const double error = relative_error(step_run.out, step_expected);
      MESSAGE("decode step " << step << " (" << k << " tokens) out relative error " << error);
      CHECK(step_run.all_written);
      CHECK(step_run.guards_intact);
      CHECK(error <= kTolerance);
    }
    check_pools(gpu_pools, cpu_pools, kTolerance);

    // A step with a padding row between the two sequences: its out is zeros and no state moves
    // for it; the others continue as without it.
    const std::vector<bf16_bits> in = random_bf16(static_cast<std::size_t>(3 * E), 2.0f, 200);
    std::vector<bf16_bits> cpu_in(in.begin(), in.begin() + E);
    cpu_in.insert(cpu_in.end(), in.begin() + 2 * E, in.end());
    const std::vector<bf16_bits> pad_expected = run_cpu(cpu, cpu_in, {0, 1, 2}, &cpu_pools, slots);
    const CudaRun pad_run = run_cuda(gpu, in, {0, 1, 2, 3}, &gpu_pools, {2, -1, 0}, 1);
    std::vector<bf16_bits> real_rows(pad_run.out.begin(), pad_run.out.begin() + E);
    real_rows.insert(real_rows.end(), pad_run.out.begin() + 2 * E, pad_run.out.end());
    const double error = relative_error(real_rows, pad_expected);
    MESSAGE("decode step with a padding row: out relative error " << error);
    CHECK(error <= kTolerance);
    CHECK(std::all_of(pad_run.out.begin() + E, pad_run.out.begin() + 2 * E,
                      [](bf16_bits b) { return bf16_to_float(b) == 0.0f; }));
    check_pools(gpu_pools, cpu_pools, kTolerance);
  }
}

TEST_CASE("CUDA layer: tensor-parallel ranks' partial outputs sum to the whole layer") {
  if (!gpu_or_skip()) return;
  FullLayerConfig config = cuda_config();
  const FullLayerWeights full =
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 5, 4));
  const std::vector<std::int64_t> cu = {0, 11, 12, 30};
  const std::int64_t E = config.hidden_size;
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(30 * E), 2.0f, 6);
  const std::vector<bf16_bits> step_in = random_bf16(static_cast<std::size_t>(3 * E), 2.0f, 7);
  // Rows 0..N-1 (no slot list): the decode step then runs on the identity slot list.
  HostPools whole_pools(config, 3, DType::kF32);
  const FullLayerCuda whole(full);
  const CudaRun expected = run_cuda(whole, hidden, cu, &whole_pools);
  const CudaRun expected_step = run_cuda(whole, step_in, {0, 1, 2, 3}, &whole_pools, {}, 1);
  // And the whole layer on the CPU, for the record.
  HostPools cpu_pools(config, 3, DType::kF32);
  const FullLayerCpu cpu(full);
  MESSAGE("tp 1 CUDA vs CPU out relative error "
          << relative_error(expected.out, run_cpu(cpu, hidden, cu, &cpu_pools)));

  std::vector<double> sum(expected.out.size(), 0.0), step_sum(expected_step.out.size(), 0.0);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const FullLayerWeights shard = kda::engine::shard_full_layer_weights(full, 2, rank);
    const FullLayerCuda layer(shard);
    HostPools pools(shard.config, 3, DType::kF32);
    const CudaRun partial = run_cuda(layer, hidden, cu, &pools);
    const CudaRun partial_step = run_cuda(layer, step_in, {0, 1, 2, 3}, &pools, {}, 1);
    CHECK(partial.all_written);
    CHECK(partial_step.all_written);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += bf16_to_float(partial.out[i]);
    for (std::size_t i = 0; i < step_sum.size(); ++i) {
      step_sum[i] += bf16_to_float(partial_step.out[i]);
    }
    // The rank's recurrent states are the whole layer's states of its heads.
    const std::int64_t Hl = shard.config.local_heads(), D = config.head_dim;
    std::vector<float> expected_state;
    for (std::int64_t n = 0; n < 3; ++n) {
      const auto begin = whole_pools.rec_f32.begin() + ((n * config.num_heads + rank * Hl) * D * D);
      expected_state.insert(expected_state.end(), begin, begin + Hl * D * D);
    }
    const double state_error = relative_error(pools.rec_f32, expected_state);
    MESSAGE("rank " << rank << " recurrent state vs the whole layer's heads: " << state_error);
    CHECK(state_error <= kTolerance);
  }
  const double error = relative_error(sum, expected.out);
  const double step_error = relative_error(step_sum, expected_step.out);
  MESSAGE("tp 2 sum vs tp 1: prefill " << error << ", decode step " << step_error);
  CHECK(error <= kTolerance);
  CHECK(step_error <= kTolerance);
}

TEST_CASE("CUDA layer: bad calls are refused before anything is written") {
  if (!gpu_or_skip()) return;
  const FullLayerConfig config = cuda_config();
  const FullLayerCuda layer(kda::engine::random_full_layer_weights(config, 1, 0));
  const std::int64_t E = config.hidden_size;
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(6 * E), 1.0f, 3);
  std::vector<std::int64_t> cu = {0, 2, 6};
  std::vector<std::int32_t> slots = {0, 1};
  HostPools pools(config, 2, DType::kF32);
  DevicePools d_pools(pools);
  DeviceBuffer d_hidden = DeviceBuffer::from(hidden);
  DeviceBuffer d_out(hidden.size() * 2);
  d_out.fill(0x12);
  DeviceBuffer d_cu = DeviceBuffer::from(cu);
  DeviceBuffer d_slots = DeviceBuffer::from(slots);
  DeviceBuffer workspace(layer.workspace_bytes(6, 2, 2));
  FullLayerCudaBatch batch;
  batch.tokens = 6;
  batch.sequences = 2;
  batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu.get());
  batch.slots = static_cast<const std::int32_t*>(d_slots.get());
  batch.cu_seqlens_host = cu.data();
  batch.slots_host = slots.data();
  std::size_t workspace_bytes = workspace.bytes();
  auto call = [&] {
    return error_of([&] {
      layer.forward(batch, static_cast<const bf16_bits*>(d_hidden.get()),
                    static_cast<bf16_bits*>(d_out.get()), d_pools.view(),
                    kda::Workspace{workspace.get(), workspace_bytes}, nullptr);
    });
  };
  SUBCASE("workspace too small") {
    workspace_bytes -= 1;
    CHECK(call().find("workspace has") != std::string::npos);
  }
  SUBCASE("cu_seqlens not ending at tokens") {
    cu[2] = 5;
    CHECK(call().find("cu_seqlens[2] = 5 is not tokens = 6") != std::string::npos);
  }
  SUBCASE("slot outside the pool") {
    slots[1] = 2;
    CHECK(call().find("slot 2, outside [0, num_slots = 2)") != std::string::npos);
  }
  SUBCASE("two sequences on one slot") {
    slots[1] = 0;
    CHECK(call().find("share slot 0") != std::string::npos);
  }
  SUBCASE("decode tokens that do not match") {
    batch.decode_tokens = 2;
    CHECK(call().find("decode: tokens 6 is not sequences 2 x decode_tokens 2") !=
          std::string::npos);
  }
  SUBCASE("a host pointer where device memory belongs") {
    batch.cu_seqlens = cu.data();
    const std::string message = call();
    MESSAGE(message);
    CHECK(message.find("cu_seqlens") != std::string::npos);
  }
  CHECK(kda::stream_synchronize(nullptr).ok());
  const std::vector<bf16_bits> out = d_out.download<bf16_bits>();
  CHECK(std::all_of(out.begin(), out.end(), [](bf16_bits b) { return b == 0x1212; }));
  HostPools after = pools;
  d_pools.download(&after);
  CHECK(after.rec_f32 == pools.rec_f32);
  CHECK(after.conv_k == pools.conv_k);
}

TEST_CASE("CUDA layer: a slot outside the pool seen only by the device is reported") {
  if (!gpu_or_skip()) return;
  const FullLayerConfig config = cuda_config();
  const FullLayerCuda layer(kda::engine::random_full_layer_weights(config, 1, 0));
  const std::int64_t E = config.hidden_size;
  HostPools pools(config, 2, DType::kF32);
  pools.randomize(3);
  for (std::int64_t decode_tokens : {0, 1}) {
    CAPTURE(decode_tokens);
    DevicePools d_pools(pools);
    DeviceBuffer d_hidden =
        DeviceBuffer::from(random_bf16(static_cast<std::size_t>(2 * E), 1.0f, 4));
    DeviceBuffer d_out(static_cast<std::size_t>(2 * E) * 2);
    const std::vector<std::int64_t> cu = {0, 1, 2};
    const std::vector<std::int32_t> slots = {1, 2};  // 2 is outside the pool of 2 rows
    DeviceBuffer d_cu = DeviceBuffer::from(cu);
    DeviceBuffer d_slots = DeviceBuffer::from(slots);
    DeviceBuffer d_status(4);
    d_status.fill(0);
    DeviceBuffer workspace(layer.workspace_bytes(2, 2, 2));
    FullLayerCudaBatch batch;
    batch.tokens = 2;
    batch.sequences = 2;
    batch.decode_tokens = decode_tokens;
    batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu.get());
    batch.slots = static_cast<const std::int32_t*>(d_slots.get());  // no host copy
    batch.device_status = static_cast<std::uint32_t*>(d_status.get());
    layer.forward(batch, static_cast<const bf16_bits*>(d_hidden.get()),
                  static_cast<bf16_bits*>(d_out.get()), d_pools.view(),
                  kda::Workspace{workspace.get(), workspace.bytes()}, nullptr);
    const kda::Status status = kda::check_device_status(batch.device_status, nullptr);
    MESSAGE(status.to_string());
    CHECK(status.code() == kda::StatusCode::kInvalidArgument);
    CHECK(d_pools.guards_intact());
    HostPools after = pools;
    d_pools.download(&after);
    // Row 0 belongs to no sequence: untouched.
    CHECK(HostPools::row(after.conv_q, 2, 0) == HostPools::row(pools.conv_q, 2, 0));
    CHECK(HostPools::row(after.rec_f32, 2, 0) == HostPools::row(pools.rec_f32, 2, 0));
  }
}

TEST_CASE("CUDA layer: a graph-captured forward equals the eager one (prefill and decode)") {
  if (!gpu_or_skip()) return;
#ifndef KDA_HAVE_CUDA
  FAIL("a CUDA device without the CUDA backend");
#else
  const FullLayerConfig config = cuda_config();
  const FullLayerCuda layer(
      with_bias_and_norm(kda::engine::random_full_layer_weights(config, 8, 2)));
  const std::int64_t E = config.hidden_size;
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  for (std::int64_t decode_tokens : {0, 1}) {
    CAPTURE(decode_tokens);
    const std::vector<std::int64_t> cu = decode_tokens > 0 ? std::vector<std::int64_t>{0, 1, 2, 3}
                                                           : std::vector<std::int64_t>{0, 7, 7, 40};
    const std::int64_t N = 3, T = cu.back();
    const std::vector<std::int32_t> slots = {3, 0, 1};
    HostPools initial(config, 4, DType::kF32);
    initial.randomize(12);
    DevicePools d_pools(initial);
    DeviceBuffer d_hidden =
        DeviceBuffer::from(random_bf16(static_cast<std::size_t>(T * E), 2.0f, 13));
    DeviceBuffer d_out(static_cast<std::size_t>(T * E) * 2);
    DeviceBuffer d_cu = DeviceBuffer::from(cu);
    DeviceBuffer d_slots = DeviceBuffer::from(slots);
    DeviceBuffer workspace(layer.workspace_bytes(T, N, 4));
    FullLayerCudaBatch batch;
    batch.tokens = T;
    batch.sequences = N;
    batch.decode_tokens = decode_tokens;
    batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu.get());
    batch.slots = static_cast<const std::int32_t*>(d_slots.get());
    auto forward = [&](bool check_pointers) {
      kda::CudaOptions options;
      options.check_pointers = check_pointers;
      layer.forward(batch, static_cast<const bf16_bits*>(d_hidden.get()),
                    static_cast<bf16_bits*>(d_out.get()), d_pools.view(),
                    kda::Workspace{workspace.get(), workspace.bytes()}, stream, options);
    };
    auto reset_pools = [&] {
      REQUIRE(kda::stream_synchronize(stream).ok());
      HostPools copy = initial;
      DevicePools fresh(copy);  // upload, then copy device to device
      REQUIRE(cudaMemcpy(d_pools.q.get(), fresh.q.get(), fresh.q.bytes(), cudaMemcpyDefault) == 0);
      REQUIRE(cudaMemcpy(d_pools.k.get(), fresh.k.get(), fresh.k.bytes(), cudaMemcpyDefault) == 0);
      REQUIRE(cudaMemcpy(d_pools.v.get(), fresh.v.get(), fresh.v.bytes(), cudaMemcpyDefault) == 0);
      REQUIRE(cudaMemcpy(d_pools.rec.get(), fresh.rec.get(), fresh.rec.bytes(),
                         cudaMemcpyDefault) == 0);
      d_out.fill(0xFF);
      REQUIRE(kda::stream_synchronize(nullptr).ok());
    };

    reset_pools();
    forward(true);
    REQUIRE(kda::stream_synchronize(stream).ok());
    const std::vector<bf16_bits> eager_out = d_out.download<bf16_bits>();
    HostPools eager = initial;
    d_pools.download(&eager);
    CHECK(all_finite(eager_out));

    reset_pools();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
    std::string capture_error;
    try {
      forward(false);
    } catch (const kda::Error& e) {
      capture_error = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    INFO("forward during capture: " << capture_error);
    REQUIRE(capture_error.empty());
    REQUIRE(end == cudaSuccess);
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
    REQUIRE(kda::stream_synchronize(stream).ok());
    const std::vector<bf16_bits> graph_out = d_out.download<bf16_bits>();
    HostPools replayed = initial;
    d_pools.download(&replayed);
    MESSAGE("graph vs eager out relative error " << relative_error(graph_out, eager_out));
    CHECK(graph_out == eager_out);
    CHECK(replayed.conv_q == eager.conv_q);
    CHECK(replayed.conv_v == eager.conv_v);
    CHECK(replayed.rec_f32 == eager.rec_f32);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
#endif
}
