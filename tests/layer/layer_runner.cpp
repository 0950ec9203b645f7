// layer_runner.cpp — the whole-layer tests' runners and checks (layer_runner.hpp).
#include "layer_runner.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

namespace kda::test {

// ---------------------------------------------------------------------------------------------
// Pools, batches
// ---------------------------------------------------------------------------------------------

Pools::Pools(const layer::Config& c, std::int64_t slots, DType recurrent_dtype)
    : num_slots(slots),
      dtype(recurrent_dtype),
      conv_row(static_cast<std::size_t>(c.local_channels() * (c.conv_width - 1))),
      recurrent_row(static_cast<std::size_t>(c.local_heads() * c.head_dim * c.head_dim)) {
  const std::size_t rows = static_cast<std::size_t>(slots);
  conv_q.assign(rows * conv_row, 0);
  conv_k.assign(rows * conv_row, 0);
  conv_v.assign(rows * conv_row, 0);
  if (dtype == DType::kF32) rec_f32.assign(rows * recurrent_row, 0.0f);
  if (dtype == DType::kBF16) rec_bf16.assign(rows * recurrent_row, 0);
}

void Pools::randomize(std::uint64_t seed) {
  conv_q = random_bf16(conv_q.size(), 2.0f, seed + 1);
  conv_k = random_bf16(conv_k.size(), 2.0f, seed + 2);
  conv_v = random_bf16(conv_v.size(), 2.0f, seed + 3);
  const std::vector<bf16_bits> bits =
      random_bf16(static_cast<std::size_t>(num_slots) * recurrent_row, 0.5f, seed + 4);
  if (dtype == DType::kBF16) rec_bf16 = bits;
  for (std::size_t i = 0; i < rec_f32.size(); ++i) rec_f32[i] = bf16_to_float(bits[i]);
}

void Pools::add_records(const layer::Config& c, std::int64_t rows) {
  record_rows = rows;
  const auto pairs = static_cast<std::size_t>(rows);
  float nan;
  const std::uint32_t nan_bits = 0xFFFFFFFFu;
  std::memcpy(&nan, &nan_bits, sizeof(nan));
  recurrent_records.assign(pairs * static_cast<std::size_t>(c.local_heads() * 3 * c.head_dim), nan);
  conv_records.assign(pairs * static_cast<std::size_t>(3 * c.local_channels()), bf16_bits{0xFFFF});
}

void Pools::zero_row(std::int64_t r) {
  auto zero = [r](auto& pool, std::size_t row) {
    std::fill(pool.begin() + r * row, pool.begin() + (r + 1) * row, 0);
  };
  zero(conv_q, conv_row);
  zero(conv_k, conv_row);
  zero(conv_v, conv_row);
  zero(rec_f32, dtype == DType::kF32 ? recurrent_row : 0);
  zero(rec_bf16, dtype == DType::kBF16 ? recurrent_row : 0);
}

std::vector<double> Pools::recurrent() const {
  std::vector<double> values(rec_f32.begin(), rec_f32.end());
  for (bf16_bits b : rec_bf16) values.push_back(bf16_to_float(b));
  return values;
}

bool Pools::row_equal(const Pools& other, std::int64_t r, std::int64_t other_r) const {
  // Empty rows (conv width 1) compare equal without memcmp: their data() may be null.
  auto same = [&](const auto& a, const auto& b, std::size_t row) {
    return row == 0 ||
           std::memcmp(a.data() + r * row, b.data() + other_r * row, row * sizeof(a[0])) == 0;
  };
  return same(conv_q, other.conv_q, conv_row) && same(conv_k, other.conv_k, conv_row) &&
         same(conv_v, other.conv_v, conv_row) &&
         (dtype == DType::kF32 ? same(rec_f32, other.rec_f32, recurrent_row)
                               : same(rec_bf16, other.rec_bf16, recurrent_row));
}

bool Pools::operator==(const Pools& other) const {
  return dtype == other.dtype && same_bits(conv_q, other.conv_q) &&
         same_bits(conv_k, other.conv_k) && same_bits(conv_v, other.conv_v) &&
         same_bits(rec_f32, other.rec_f32) && same_bits(rec_bf16, other.rec_bf16) &&
         same_bits(recurrent_records, other.recurrent_records) &&
         same_bits(conv_records, other.conv_records);
}

BatchSpec prefill_batch(const std::vector<std::int64_t>& lengths, std::vector<std::int32_t> slots) {
  BatchSpec b;
  for (std::int64_t length : lengths) b.cu_seqlens.push_back(b.cu_seqlens.back() + length);
  b.slots = std::move(slots);
  return b;
}

BatchSpec decode_batch(std::int64_t sequences, std::int64_t tokens,
                       std::vector<std::int32_t> slots) {
  BatchSpec b = prefill_batch(
      std::vector<std::int64_t>(static_cast<std::size_t>(sequences), tokens), std::move(slots));
  b.decode_tokens = tokens;
  return b;
}

std::vector<bf16_bits> token_rows(const std::vector<bf16_bits>& m, std::int64_t E,
                                  std::int64_t begin, std::int64_t end) {
  return std::vector<bf16_bits>(m.begin() + begin * E, m.begin() + end * E);
}

// ---------------------------------------------------------------------------------------------
// Runners
// ---------------------------------------------------------------------------------------------

layer::Config LayerRunner::config(GateMode gate, bool full_rank_gate) const {
  layer::Config c;
  c.hidden_size = backend() == Backend::kCpu ? 48 : 256;
  c.num_heads = 4;
  c.head_dim = backend() == Backend::kCpu ? 16 : 128;
  c.conv_width = 4;
  c.gate = gate;
  c.lower_bound = -5.0f;
  c.norm_eps = 1e-5f;
  c.full_rank_gate = full_rank_gate;
  return c;
}

Tolerances LayerRunner::tolerances() const {
  // The CPU layer computes what the reference computes, in fp32: close, and a split run differs
  // in fp32 rounding only. CUDA's core rounds inside its chunks and its GEMMs pick kernels by
  // shape: 1e-2 everywhere, as for the CUDA layer against the CPU layer.
  if (backend() == Backend::kCpu) return Tolerances{5e-3, 1e-3, 1e-5, true};
  return Tolerances{1e-2, 1e-2, 1e-2, false};
}

std::string LayerRunner::forward_error_prefix() const {
  return std::string("KDA layer forward (") + name() + "): ";
}

namespace {

template <class Buffer>
class BufferMemory final : public Memory {
 public:
  explicit BufferMemory(std::size_t bytes) : buffer_(bytes) {}
  void* get() const override { return buffer_.get(); }
  void fill(unsigned char byte) override {
    buffer_.fill(byte);
    (void)Buffer::synchronize();
  }
  std::vector<unsigned char> download() const override {
    return buffer_.template download<unsigned char>();
  }
  bool guards_intact() const override { return buffer_.guards_intact(); }

 private:
  Buffer buffer_;
};

template <class Buffer>
class BufferLayerRunner final : public LayerRunner {
 public:
  explicit BufferLayerRunner(Backend backend) : backend_(backend) {}
  Backend backend() const override { return backend_; }

  std::unique_ptr<Memory> allocate(std::size_t bytes) const override {
    return std::make_unique<BufferMemory<Buffer>>(bytes);
  }

  LayerRun forward(const layer::Layer& layer, const std::vector<bf16_bits>& hidden,
                   const BatchSpec& batch, Pools* pools,
                   const ForwardSettings& settings) const override {
    const std::size_t workspace = layer::workspace_bytes(backend_, layer.config(), batch.tokens(),
                                                         batch.sequences(), pools->num_slots);
    ForwardBuffers<Buffer> buffers(hidden, batch, *pools, workspace);
    ForwardCall call = buffers.call(batch, *pools, settings.host_copies);
    if (settings.change) settings.change(call);
    LayerRun run;
    try {
      layer.forward(call.batch, call.hidden, call.out, call.state, call.workspace, call.options);
    } catch (const Error& e) {
      run.error = e.what();
      run.code = e.code();
    }
    // A forward on a stream of the test's own is waited for too (the default stream below).
    if (call.options.stream != nullptr) {
      const Status synced = stream_synchronize(call.options.stream);
      CHECK_MESSAGE(synced.ok(), synced.to_string());
    }
    const Status synced = Buffer::synchronize();
    CHECK_MESSAGE(synced.ok(), synced.to_string());
    run.out = buffers.out.template download<bf16_bits>();
    run.device_status = buffers.status.template download<std::uint32_t>()[0];
    run.all_written = all_finite(run.out);
    run.guards_intact = buffers.guards_intact();
    buffers.download(pools);
    return run;
  }

  LayerRun commit(const layer::Config& config, const BatchSpec& batch,
                  const std::vector<Pools*>& layers, bool host_copies,
                  const CommitChange& change) const override {
    // Each layer's pools and records uploaded as a forward's are (no hidden states, no workspace).
    std::vector<std::unique_ptr<ForwardBuffers<Buffer>>> buffers;
    std::vector<layer::State> states;
    const std::vector<bf16_bits> no_hidden;
    for (Pools* pools : layers) {
      buffers.push_back(std::make_unique<ForwardBuffers<Buffer>>(no_hidden, batch, *pools, 0));
      states.push_back(buffers.back()->call(batch, *pools, false).state);
    }
    const Buffer slots = Buffer::from(batch.slots), accepted = Buffer::from(batch.num_accepted);
    Buffer status(sizeof(std::uint32_t));
    status.fill(0);
    layer::CommitBatch commit;
    commit.sequences = batch.sequences();
    commit.decode_tokens = batch.decode_tokens;
    commit.slots = batch.slots.empty() ? nullptr : static_cast<const std::int32_t*>(slots.get());
    commit.num_accepted =
        batch.num_accepted.empty() ? nullptr : static_cast<const std::int32_t*>(accepted.get());
    commit.padding_slot = batch.padding_slot;
    if (host_copies) {
      commit.slots_host = batch.slots.empty() ? nullptr : batch.slots.data();
      commit.num_accepted_host = batch.num_accepted.empty() ? nullptr : batch.num_accepted.data();
    }
    commit.device_status = static_cast<std::uint32_t*>(status.get());
    layer::RunOptions options;
    if (change) change(states, commit, options);
    LayerRun run;
    try {
      layer::commit(backend_, config, commit, states.data(), static_cast<int>(states.size()),
                    options);
    } catch (const Error& e) {
      run.error = e.what();
      run.code = e.code();
    }
    const Status synced = Buffer::synchronize();
    CHECK_MESSAGE(synced.ok(), synced.to_string());
    run.device_status = status.template download<std::uint32_t>()[0];
    run.guards_intact = true;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      run.guards_intact = run.guards_intact && buffers[l]->guards_intact();
      buffers[l]->download(layers[l]);
    }
    run.all_written = true;
    return run;
  }

 private:
  Backend backend_;
};

}  // namespace

LayerRunner& cpu_layer_runner() {
  static BufferLayerRunner<HostBuffer> runner(Backend::kCpu);
  return runner;
}

LayerRunner* cuda_layer_runner_or_skip() {
  static BufferLayerRunner<DeviceBuffer> runner(Backend::kCuda);
  return gpu_or_skip() ? &runner : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

namespace {

// A forward's out and pools (`after`) within `tolerance` of the expected values, each error printed
// after `label`.
void check_close(const std::string& label, const std::vector<bf16_bits>& out,
                 const std::vector<double>& expected_out, const Pools& after,
                 const std::vector<double>& conv_q, const std::vector<double>& conv_k,
                 const std::vector<double>& conv_v, const std::vector<double>& recurrent,
                 double tolerance) {
  const double out_error = relative_error(out, expected_out);
  const double q = relative_error(after.conv_q, conv_q);
  const double k = relative_error(after.conv_k, conv_k);
  const double v = relative_error(after.conv_v, conv_v);
  const double rec = relative_error(after.recurrent(), recurrent);
  MESSAGE(label << ": out relative error " << out_error << "; states: conv_q " << q << ", conv_k "
                << k << ", conv_v " << v << ", recurrent " << rec);
  CHECK(out_error <= tolerance);
  CHECK(q <= tolerance);
  CHECK(k <= tolerance);
  CHECK(v <= tolerance);
  CHECK(rec <= tolerance);
}

}  // namespace

void check_forward(const LayerRunner& runner, const layer::Weights& weights,
                   const std::vector<bf16_bits>& hidden, const BatchSpec& batch,
                   const Pools& before, const LayerRun& run, const Pools& after) {
  const std::int64_t E = weights.config.hidden_size;
  INFO(runner.name() << " forward of " << batch.tokens() << " tokens in " << batch.sequences()
                     << std::string(batch.decode_tokens > 0 ? " decode rows" : " sequences"));
  CHECK_MESSAGE(run.error.empty(), run.error);
  CHECK_MESSAGE(run.device_status == 0, describe_device_status(run.device_status).to_string());
  CHECK(run.all_written);
  CHECK(run.guards_intact);

  const LayerReference ref = reference_layer(weights, hidden, batch, before);
  const double tolerance = runner.tolerances().reference;
  check_close("against the fp64 reference", run.out, ref.out, after, ref.conv_q, ref.conv_k,
              ref.conv_v, ref.recurrent, tolerance);
  // Sequence by sequence: a short sequence's error would vanish in the batch's norm.
  for (std::int64_t n = 0; n < batch.sequences(); ++n) {
    const std::int64_t begin = batch.cu_seqlens[n], end = batch.cu_seqlens[n + 1];
    if (begin == end) continue;
    CAPTURE(n);
    const std::vector<bf16_bits> got = token_rows(run.out, E, begin, end);
    if (batch.slot(n) < 0) {
      CHECK(std::all_of(got.begin(), got.end(), [](bf16_bits b) { return b == 0; }));
      continue;
    }
    const std::vector<double> want(ref.out.begin() + begin * E, ref.out.begin() + end * E);
    CHECK(relative_error(got, want) <= tolerance);
  }
  // The rows no sequence with tokens runs on keep their states bit for bit.
  for (std::int64_t r = 0; r < before.num_slots; ++r) {
    bool used = false;
    for (std::int64_t n = 0; n < batch.sequences(); ++n) {
      used = used || (batch.slot(n) == r && batch.length(n) > 0);
    }
    if (used) continue;
    CAPTURE(r);
    CHECK(after.row_equal(before, r));
  }

  if (runner.backend() == Backend::kCpu) return;
  // The CPU layer's forward of the same call.
  Pools cpu_after = before;
  const LayerRun cpu = cpu_layer_runner().forward(*layer::make_layer(Backend::kCpu, weights),
                                                  hidden, batch, &cpu_after);
  REQUIRE_MESSAGE(cpu.error.empty(), cpu.error);
  check_close("against the CPU layer", run.out, to_doubles(cpu.out), after,
              to_doubles(cpu_after.conv_q), to_doubles(cpu_after.conv_k),
              to_doubles(cpu_after.conv_v), cpu_after.recurrent(), kCudaVsCpuTolerance);
}

void check_same_tokens(const LayerRunner& runner, const std::vector<bf16_bits>& out,
                       const std::vector<bf16_bits>& expected_out, const Pools& pools,
                       const Pools& expected_pools) {
  const Tolerances t = runner.tolerances();
  const bool bf16 = pools.dtype == DType::kBF16;
  const double out_error = relative_error(out, expected_out);
  const double state_error = relative_error(pools.recurrent(), expected_pools.recurrent());
  MESSAGE(runner.name() << ", the same tokens in other calls: out relative error " << out_error
                        << ", recurrent state " << state_error);
  CHECK(out_error <= (bf16 ? kBf16PoolTolerance : t.split_out));
  CHECK(state_error <= (bf16 ? kBf16PoolTolerance : t.split_state));
  if (t.split_conv_exact) {
    CHECK(same_bits(pools.conv_q, expected_pools.conv_q));
    CHECK(same_bits(pools.conv_k, expected_pools.conv_k));
    CHECK(same_bits(pools.conv_v, expected_pools.conv_v));
  } else {
    CHECK(relative_error(pools.conv_q, expected_pools.conv_q) <= t.split_out);
    CHECK(relative_error(pools.conv_k, expected_pools.conv_k) <= t.split_out);
    CHECK(relative_error(pools.conv_v, expected_pools.conv_v) <= t.split_out);
  }
}

LayerRun check_refused(const LayerRunner& runner, const layer::Layer& layer,
                       const std::vector<bf16_bits>& hidden, const BatchSpec& batch,
                       const Pools& before, const ForwardSettings& settings) {
  Pools after = before;
  LayerRun run = runner.forward(layer, hidden, batch, &after, settings);
  MESSAGE(runner.name() << " refusal: " << run.error);
  CHECK(run.code != StatusCode::kOk);
  CHECK(run.error.rfind(runner.forward_error_prefix(), 0) == 0);
  CHECK(std::all_of(run.out.begin(), run.out.end(),
                    [](bf16_bits b) { return b == bf16_bits{0xFFFF}; }));
  CHECK(after == before);
  CHECK(run.guards_intact);
  CHECK(run.device_status == 0);
  return run;
}

}  // namespace kda::test
