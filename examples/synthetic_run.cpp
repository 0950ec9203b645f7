// examples/synthetic_run.cpp — synthetic inputs in the engine's backend memory, and timed runs.
#include "synthetic_run.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "kda/bf16.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/error.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kda::examples {

namespace {

[[noreturn]] void fail(const std::string& what, StatusCode code = StatusCode::kInvalidArgument) {
  throw Error(code, what);
}

using kda::detail::align_up;
using kda::detail::checked_mul;

// int32 values in the engine's backend memory, as BatchMetadata's arrays are: host memory on the
// CPU, device memory on CUDA.
class BackendInts {
 public:
  BackendInts(const engine::Engine& engine, std::vector<std::int32_t> values)
      : host_(std::move(values)) {
    if (engine.backend() != Backend::kCuda || host_.empty()) return;
    const std::size_t bytes = host_.size() * sizeof(std::int32_t);
    throw_if_error(device_malloc(&device_, bytes), "synthetic run: batch metadata");
    if (const Status st = memcpy_to_device(device_, host_.data(), bytes); !st.ok()) {
      (void)device_free(device_);
      throw Error(st, "synthetic run: batch metadata");
    }
  }
  ~BackendInts() {
    if (device_ != nullptr) (void)device_free(device_);
  }
  BackendInts(const BackendInts&) = delete;
  BackendInts& operator=(const BackendInts&) = delete;
  const std::int32_t* get() const noexcept {
    return device_ != nullptr ? static_cast<const std::int32_t*>(device_) : host_.data();
  }

 private:
  std::vector<std::int32_t> host_;
  void* device_ = nullptr;
};

// One decode step of every layer captured as a CUDA graph on caller-owned metadata (the slot list
// in device memory), replayed per step. Built only where it can be (see RunOptions::graphs).
class DecodeGraph {
 public:
  DecodeGraph() = default;
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;
  ~DecodeGraph() {
#ifdef KDA_HAVE_CUDA
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
#endif
  }

  // Captures `step` (every layer's decode on `batch`, whose slot list this graph keeps); returns ""
  // or why it could not (the steps then run eagerly).
  std::string capture(engine::Engine& engine, const std::vector<int>& slots,
                      const std::function<void(const engine::BatchMetadata&)>& step) {
    slots_ = std::make_unique<BackendInts>(engine,
                                           std::vector<std::int32_t>(slots.begin(), slots.end()));
    engine::BatchMetadata batch;
    batch.sequences = static_cast<std::int64_t>(slots.size());
    batch.tokens = batch.sequences;
    batch.decode_tokens = 1;
    batch.slots = slots_->get();
    return capture_calls(engine, [&] { step(batch); });
  }
  // Captures the engine calls `calls` makes (on metadata the caller keeps); "" or why not.
  std::string capture_calls(engine::Engine& engine, const std::function<void()>& calls) {
#ifdef KDA_HAVE_CUDA
    if (engine.backend() != Backend::kCuda) return "the CPU backend";
    auto* stream = static_cast<cudaStream_t>(engine.stream());
    if (stream == nullptr) return "the engine has no stream of its own";
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      (void)cudaGetLastError();
      return "cudaStreamBeginCapture failed";
    }
    std::string error;
    try {
      calls();
    } catch (const Error& e) {
      error = e.what();
    } catch (...) {  // anything else: the capture ended, then passed on
      cudaGraph_t partial = nullptr;
      (void)cudaStreamEndCapture(stream, &partial);
      if (partial != nullptr) (void)cudaGraphDestroy(partial);
      (void)cudaGetLastError();
      throw;
    }
    const cudaError_t end = cudaStreamEndCapture(stream, &graph_);
    if (error.empty() && end != cudaSuccess) error = cudaGetErrorString(end);
    if (error.empty() && cudaGraphInstantiate(&exec_, graph_, 0) != cudaSuccess) {
      error = "cudaGraphInstantiate failed";
    }
    (void)cudaGetLastError();
    return error;
#else
    (void)engine, (void)calls;
    return "the CPU backend";
#endif
  }
  void replay(engine::Engine& engine) const {
#ifdef KDA_HAVE_CUDA
    const cudaError_t err = cudaGraphLaunch(exec_, static_cast<cudaStream_t>(engine.stream()));
    if (err != cudaSuccess) {
      throw Error(StatusCode::kCudaError,
                  std::string("decode graph replay: ") + cudaGetErrorString(err));
    }
#else
    (void)engine;
#endif
  }

 private:
  std::unique_ptr<BackendInts> slots_;  // capture()'s slot list, which the graph reads
#ifdef KDA_HAVE_CUDA
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
#endif
};

// splitmix64: fast, seedable, good enough for synthetic activations.
struct SplitMix {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float symmetric() { return static_cast<float>((next() >> 40) * (2.0 / 16777216.0) - 1.0); }
};

void fill_random(std::vector<std::uint16_t>* values, std::size_t count, std::uint64_t seed) {
  values->resize(count);
  SplitMix generator{seed};
  for (std::uint16_t& v : *values) v = float_to_bf16(generator.symmetric());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

constexpr std::uint64_t kAlignment = 256;

}  // namespace

SyntheticInputs::SyntheticInputs(const engine::Engine& engine, std::int64_t tokens)
    : backend_(engine.backend()),
      stream_(engine.stream()),
      heads_(engine.spec().local_heads()),
      head_dim_(engine.spec().head_dim),
      hidden_size_(engine.layer_mode() == engine::LayerMode::kWhole ? engine.spec().hidden_size
                                                                    : 0) {
  if (tokens < 0) fail("synthetic inputs: tokens must be >= 0, got " + std::to_string(tokens));
  capacity_ = std::max(tokens, engine.spec().runtime.max_sequences);
  // Six buffers, each rounded up to 256 bytes, back to back in one allocation.
  const auto t = static_cast<std::uint64_t>(capacity_);
  const auto H = static_cast<std::uint64_t>(heads_);
  const auto D = static_cast<std::uint64_t>(head_dim_);
  std::uint64_t per_token = 0, qkvg = 0, beta = 0, total = 0;
  if (!checked_mul(H, D * 2, &per_token) || !checked_mul(t, per_token, &qkvg) ||
      !checked_mul(t, H * 2, &beta) || qkvg > std::numeric_limits<std::uint64_t>::max() / 8 ||
      !checked_mul(align_up(qkvg, kAlignment), 5, &total) ||
      total > std::numeric_limits<std::uint64_t>::max() - beta - kAlignment ||
      total + beta + kAlignment > std::numeric_limits<std::size_t>::max()) {
    fail("synthetic inputs of " + std::to_string(capacity_) +
             " tokens: byte count overflows 64 bits",
         StatusCode::kOverflow);
  }
  const std::uint64_t qkvg_stride = align_up(qkvg, kAlignment);
  // Whole layers: hidden states and their output, [capacity, hidden_size] each.
  std::uint64_t hidden = 0;
  if (!checked_mul(t, static_cast<std::uint64_t>(hidden_size_) * 2, &hidden) ||
      hidden > std::numeric_limits<std::uint64_t>::max() / 4) {
    fail("synthetic hidden states of " + std::to_string(capacity_) +
             " tokens: byte count overflows 64 bits",
         StatusCode::kOverflow);
  }
  const std::uint64_t hidden_stride = align_up(hidden, kAlignment);
  bytes_ = total + align_up(beta, kAlignment);
  const std::uint64_t beta_end = bytes_;
  if (bytes_ > std::numeric_limits<std::uint64_t>::max() - 2 * hidden_stride) {
    fail("synthetic inputs: byte count overflows 64 bits", StatusCode::kOverflow);
  }
  bytes_ += 2 * hidden_stride;
  const auto size = static_cast<std::size_t>(bytes_);
  if (backend_ == Backend::kCuda) {
    throw_if_error(device_malloc(&memory_, size), "allocating the synthetic inputs");
  } else {
    memory_ = std::aligned_alloc(kAlignment, std::max<std::size_t>(size, kAlignment));
    if (memory_ == nullptr) {
      fail("cannot allocate the synthetic inputs (" + std::to_string(bytes_) + " bytes)",
           StatusCode::kOutOfMemory);
    }
  }
  auto* base = static_cast<std::uint8_t*>(memory_);
  q_ = base;
  k_ = base + qkvg_stride;
  v_ = base + 2 * qkvg_stride;
  g_ = base + 3 * qkvg_stride;
  out_ = base + 4 * qkvg_stride;
  beta_ = base + 5 * qkvg_stride;
  if (hidden_size_ > 0) {
    hidden_ = base + beta_end;
    hidden_out_ = base + beta_end + hidden_stride;
  }
}

SyntheticInputs::~SyntheticInputs() {
  if (backend_ == Backend::kCuda) {
    (void)stream_synchronize(stream_);  // kernels may still read the inputs
    (void)device_free(memory_);
  } else {
    std::free(memory_);
  }
}

void SyntheticInputs::generate(std::uint64_t seed) {
  const auto tokens = static_cast<std::size_t>(capacity_);
  const auto H = static_cast<std::size_t>(heads_);
  const auto D = static_cast<std::size_t>(head_dim_);
  fill_random(&host_.q, tokens * H * D, seed * 8 + 1);
  fill_random(&host_.k, tokens * H * D, seed * 8 + 2);
  fill_random(&host_.v, tokens * H * D, seed * 8 + 3);
  fill_random(&host_.g, tokens * H * D, seed * 8 + 4);
  fill_random(&host_.beta, tokens * H, seed * 8 + 5);
  fill_random(&host_.hidden, tokens * static_cast<std::size_t>(hidden_size_), seed * 8 + 6);
  auto upload = [&](void* dst, const std::vector<std::uint16_t>& src) {
    const std::size_t bytes = src.size() * sizeof(std::uint16_t);
    if (bytes == 0) return;
    if (backend_ == Backend::kCuda) {
      throw_if_error(memcpy_to_device(dst, src.data(), bytes, stream_),
                     "uploading synthetic inputs");
    } else {
      std::memcpy(dst, src.data(), bytes);
    }
  };
  upload(q_, host_.q);
  upload(k_, host_.k);
  upload(v_, host_.v);
  upload(g_, host_.g);
  upload(beta_, host_.beta);
  if (hidden_ != nullptr) upload(hidden_, host_.hidden);
  if (backend_ == Backend::kCuda) throw_if_error(stream_synchronize(stream_), "synchronizing");
}

engine::LayerInputs SyntheticInputs::inputs(std::int64_t token_offset) const {
  if (token_offset < 0 || token_offset > capacity_) {
    fail("synthetic token offset " + std::to_string(token_offset) + " is out of range [0, " +
         std::to_string(capacity_) + "]");
  }
  const auto t0 = static_cast<std::uint64_t>(token_offset);
  const auto H = static_cast<std::uint64_t>(heads_);
  const auto D = static_cast<std::uint64_t>(head_dim_);
  auto at = [](void* base, std::uint64_t bytes) -> const void* {
    return static_cast<const std::uint8_t*>(base) + bytes;
  };
  return {at(q_, t0 * H * D * 2), at(k_, t0 * H * D * 2), at(v_, t0 * H * D * 2),
          at(g_, t0 * H * D * 2), at(beta_, t0 * H * 2)};
}

const void* SyntheticInputs::hidden(std::int64_t token_offset) const {
  if (hidden_ == nullptr) return nullptr;
  if (token_offset < 0 || token_offset > capacity_) {
    fail("synthetic token offset " + std::to_string(token_offset) + " is out of range [0, " +
         std::to_string(capacity_) + "]");
  }
  return static_cast<const std::uint8_t*>(hidden_) +
         static_cast<std::uint64_t>(token_offset) * static_cast<std::uint64_t>(hidden_size_) * 2;
}

namespace {

// One decode step of every layer on `batch`, reading the synthetic inputs' first rows (whole
// layers: hidden states; cores: q, k, v, g, beta).
void decode_layers(engine::Engine& engine, SyntheticInputs& inputs, bool whole_layers,
                   const engine::BatchMetadata& batch) {
  for (int l = 0; l < engine.num_layers(); ++l) {
    if (whole_layers) {
      engine.decode_hidden(l, inputs.hidden(0), inputs.hidden_output(), batch);
    } else {
      engine.decode(l, inputs.inputs(0), inputs.output(), batch);
    }
  }
}

// The decode steps of run_synthetic as speculative verify steps (RunOptions::verify_tokens).
// `extra_slots` receives the slots it acquires (the per-token form's), for the caller to release.
void run_verify_steps(engine::Engine& engine, SyntheticInputs& inputs, const RunOptions& options,
                      RunReport* report, std::vector<int>* extra_slots, int* done,
                      int total_steps) {
  if (options.decode_steps == 0) return;
  const int T = options.verify_tokens;
  const auto N = static_cast<std::int32_t>(report->slots.size());
  const VerifyForm form = options.verify_form;
  std::vector<std::int32_t> rows, counts, ones(static_cast<std::size_t>(N), 1), identity;
  for (std::int32_t r = 0; r < N; ++r) {
    counts.push_back(1 + r % T);
    identity.push_back(r);
    rows.push_back(report->slots[static_cast<std::size_t>(r)]);
    if (form != VerifyForm::kPerToken) continue;
    // Per-token states: row r's slots are its prefill slot, then T - 1 more.
    for (int t = 1; t < T; ++t) {
      extra_slots->push_back(engine.acquire_slot());
      rows.push_back(extra_slots->back());
    }
  }
  report->state_slots.clear();
  for (std::int32_t r = 0; r < N; ++r) {
    report->state_slots.push_back(form == VerifyForm::kPerToken
                                      ? rows[static_cast<std::size_t>(r * T + counts[r] - 1)]
                                      : report->slots[static_cast<std::size_t>(r)]);
  }
  const BackendInts d_rows(engine, rows), d_counts(engine, counts), d_ones(engine, ones),
      d_identity(engine, identity);
  // Step k's metadata: the per-token form starts from the prefill's slot (num_accepted 1) at
  // k = 0, then from the slot of the step before's last accepted token; the records forms write
  // their records, the fold into alternating regions, folding the other from k = 1.
  auto metadata = [&](int k) {
    engine::BatchMetadata b;
    b.tokens = static_cast<std::int64_t>(N) * T;
    b.sequences = N;
    b.decode_tokens = T;
    b.slots = d_rows.get();
    if (form == VerifyForm::kPerToken) {
      b.num_accepted = k == 0 ? d_ones.get() : d_counts.get();
      return b;
    }
    b.records = true;
    if (form == VerifyForm::kFold) {
      b.records_region = k % 2;
      if (k > 0) {
        b.fold_rows = d_identity.get();
        b.fold_counts = d_counts.get();
        b.fold_region = 1 - k % 2;
      }
    }
    return b;
  };
  auto step = [&](int k) {
    decode_layers(engine, inputs, report->whole_layers, metadata(k));
    if (form == VerifyForm::kRecords) engine.commit(N, d_rows.get(), d_counts.get());
  };
  // Steps after the first as graph replays where they can be: one graph, or with the fold one per
  // parity of k (the regions each writes and folds).
  DecodeGraph graphs[2];
  report->decode_mode = options.graphs ? "the first step runs eagerly" : "graphs off";
  bool captured = false;
  for (int k = 0; k < options.decode_steps; ++k) {
    if (k == 1 && options.graphs) {
      const int kinds = form == VerifyForm::kFold ? 2 : 1;
      std::string why;
      for (int g = 0; g < kinds && why.empty(); ++g) {
        why = graphs[g].capture_calls(engine, [&] { step(1 + g); });
      }
      captured = why.empty();
      report->decode_mode = captured ? "CUDA graph replays after the first step" : why;
      report->decode_graphs = captured;
    }
    const auto start = std::chrono::steady_clock::now();
    if (captured) {
      graphs[form == VerifyForm::kFold ? (k - 1) % 2 : 0].replay(engine);
    } else {
      step(k);
    }
    engine.synchronize();
    report->decode_step_seconds.push_back(seconds_since(start));
    if (options.progress) options.progress(++*done, total_steps);
  }
  // The fold's last step's records, committed: every sequence's state in its slot.
  if (form == VerifyForm::kFold && options.decode_steps > 0) {
    engine.commit(N, d_rows.get(), d_counts.get(), (options.decode_steps - 1) % 2);
    engine.synchronize();
  }
}

}  // namespace

RunReport run_synthetic(engine::Engine& engine, SyntheticInputs& inputs,
                        const RunOptions& options) {
  if (options.sequences < 1 || options.sequences > engine.free_slots()) {
    fail("run_synthetic: " + std::to_string(options.sequences) + " sequences, but " +
         std::to_string(engine.free_slots()) + " of " + std::to_string(engine.num_slots()) +
         " state slots are free (runtime.max_sequences)");
  }
  const std::int64_t token_limit = std::min(inputs.capacity(), engine.spec().runtime.max_tokens);
  if (options.tokens < 0 || options.tokens > token_limit) {
    fail("run_synthetic: " + std::to_string(options.tokens) + " tokens, expected 0.." +
         std::to_string(token_limit));
  }
  if (options.decode_steps < 0) fail("run_synthetic: negative decode_steps");
  const int T = options.verify_tokens;
  if (T != 0) {
    const engine::RuntimeSpec& runtime = engine.spec().runtime;
    if (T < 2 || T > static_cast<int>(kMaxDecodeTokens)) {
      fail("run_synthetic: verify_tokens " + std::to_string(T) + ", expected 0 or 2.." +
           std::to_string(kMaxDecodeTokens));
    }
    if (options.sequences * T > inputs.capacity()) {
      fail("run_synthetic: verify steps of " + std::to_string(options.sequences) + " x " +
           std::to_string(T) + " tokens need synthetic inputs of that many tokens (" +
           std::to_string(inputs.capacity()) + ")");
    }
    if (options.verify_form == VerifyForm::kPerToken &&
        options.sequences * T > engine.free_slots()) {
      fail("run_synthetic: verify steps with per-token states keep " + std::to_string(T) +
           " slots a sequence: " + std::to_string(options.sequences * T) + " slots, but " +
           std::to_string(engine.free_slots()) + " are free (runtime.max_sequences)");
    }
    if (options.verify_form != VerifyForm::kPerToken && runtime.max_verify_tokens < T) {
      fail("run_synthetic: records verify steps of " + std::to_string(T) +
           " tokens need runtime.max_verify_tokens >= " + std::to_string(T) + " (it is " +
           std::to_string(runtime.max_verify_tokens) + ")");
    }
    if (options.verify_form == VerifyForm::kFold && runtime.record_regions != 2) {
      fail("run_synthetic: folding records steps needs runtime.record_regions 2 (it is " +
           std::to_string(runtime.record_regions) + ")");
    }
  }

  RunReport report;
  report.backend = engine.backend();
  report.tokens = options.tokens;
  report.sequences = options.sequences;
  report.whole_layers = engine.layer_mode() == engine::LayerMode::kWhole;

  const auto upload_start = std::chrono::steady_clock::now();
  inputs.generate(options.seed);
  report.upload_seconds = seconds_since(upload_start);

  const auto n = static_cast<std::size_t>(options.sequences);
  std::vector<std::int64_t> cu(n + 1, 0);
  for (std::size_t j = 0; j < n; ++j) {
    const std::int64_t length = options.tokens / options.sequences +
                                (static_cast<std::int64_t>(j) < options.tokens % options.sequences);
    cu[j + 1] = cu[j] + length;
  }
  auto prefill = [&](int layer, layer::Times* times) {
    if (report.whole_layers) {
      engine.prefill_hidden(layer, inputs.hidden(0), inputs.hidden_output(), report.slots, cu,
                            times);
    } else {
      engine.prefill(layer, inputs.inputs(0), inputs.output(), report.slots, cu);
    }
  };
  auto decode_step = [&](int layer, std::int64_t offset) {
    if (report.whole_layers) {
      engine.decode_hidden(layer, inputs.hidden(offset), inputs.hidden_output(), report.slots, 1);
    } else {
      engine.decode(layer, inputs.inputs(offset), inputs.output(), report.slots, 1);
    }
  };
  std::vector<int> extra_slots;  // the per-token verify form's slots beyond the prefill's
  auto release_all = [&] {
    for (const int slot : report.slots) engine.release_slot(slot);
    for (const int slot : extra_slots) engine.release_slot(slot);
  };
  try {
    for (std::size_t j = 0; j < n; ++j) report.slots.push_back(engine.acquire_slot());
    if (options.warmup) {
      // The same calls as the timed ones below, on the same slots, which reset_slot() then zeroes
      // again (conv states included), as acquire_slot() left them.
      const auto warmup_start = std::chrono::steady_clock::now();
      prefill(0, nullptr);
      if (options.decode_steps > 0) decode_step(0, 0);
      for (const int slot : report.slots) engine.reset_slot(slot);
      engine.synchronize();
      report.warmup_seconds = seconds_since(warmup_start);
    }
    engine.synchronize();
    const int layers = engine.num_layers();
    const int total_steps = layers + options.decode_steps;
    int done = 0;
    for (int l = 0; l < layers; ++l) {
      const auto start = std::chrono::steady_clock::now();
      layer::Times* times = nullptr;
      if (report.whole_layers) times = &report.layer_phases.emplace_back();
      prefill(l, times);
      engine.synchronize();
      report.layer_seconds.push_back(seconds_since(start));
      report.prefill_seconds += report.layer_seconds.back();
      if (options.prefill_layer_done) options.prefill_layer_done(report);
      if (options.progress) options.progress(++done, total_steps);
    }
    report.state_slots = report.slots;
    if (T != 0) {
      run_verify_steps(engine, inputs, options, &report, &extra_slots, &done, total_steps);
    } else {
      // Graph replays of one captured step, or eager steps, each of which reads the next window
      // of `n` synthetic tokens, wrapping around.
      DecodeGraph graph;
      report.decode_mode = "graphs off";
      if (options.graphs && options.decode_steps > 0) {
        report.decode_mode =
            graph.capture(engine, report.slots, [&](const engine::BatchMetadata& b) {
              decode_layers(engine, inputs, report.whole_layers, b);
            });
        report.decode_graphs = report.decode_mode.empty();
        if (report.decode_graphs) report.decode_mode = "CUDA graph replays";
      }
      const std::int64_t windows = inputs.capacity() - options.sequences + 1;
      for (int step = 0; step < options.decode_steps; ++step) {
        const std::int64_t offset = (static_cast<std::int64_t>(step) * options.sequences) % windows;
        const auto start = std::chrono::steady_clock::now();
        if (report.decode_graphs) {
          graph.replay(engine);
        } else {
          for (int l = 0; l < layers; ++l) decode_step(l, offset);
        }
        engine.synchronize();
        report.decode_step_seconds.push_back(seconds_since(start));
        if (options.progress) options.progress(++done, total_steps);
      }
    }
  } catch (...) {
    release_all();
    throw;
  }
  report.extra_slots = extra_slots;
  if (options.release_slots) release_all();
  return report;
}

}  // namespace kda::examples
