// examples/synthetic_run.hpp — random inputs and timed runs over a kda::engine::Engine: what
// kda-run measures, and what tests use for inputs. Not part of the engine (the engine is the
// runtime only): it uses the engine's public API, as any integrator would.
//
//   kda::engine::Engine engine(spec);
//   kda::examples::SyntheticInputs inputs(engine, 1024);  // memory of the engine's backend
//   const kda::examples::RunReport report = kda::examples::run_synthetic(engine, inputs, {});
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kda/engine/engine.hpp"

namespace kda::examples {

// Random bf16 inputs q, k, g [capacity, H, K], v [capacity, H, V], beta [capacity, H] and an output
// [capacity, H, V] (H: the engine's local heads), and for an engine of whole layers also hidden
// states [capacity, hidden_size] and their output, in memory of the engine's backend (host memory
// on the CPU, device memory on CUDA), outside the engine's arena. capacity = max(tokens,
// max_sequences), so that a decode step of every sequence fits too.
class SyntheticInputs {
 public:
  // Allocates (nothing generated yet). Throws kda::Error: negative tokens, byte counts that
  // overflow 64 bits, allocation failures.
  SyntheticInputs(const engine::Engine& engine, std::int64_t tokens);
  ~SyntheticInputs();
  SyntheticInputs(const SyntheticInputs&) = delete;
  SyntheticInputs& operator=(const SyntheticInputs&) = delete;

  std::int64_t capacity() const noexcept { return capacity_; }  // tokens
  std::uint64_t bytes() const noexcept { return bytes_; }       // all six buffers
  // Generates the inputs on the host (seeded; one stream per tensor, so changing the capacity does
  // not reshuffle the others) and copies them in. Synchronous.
  void generate(std::uint64_t seed);
  // Inputs starting at token `token_offset` (0..capacity).
  engine::LayerInputs inputs(std::int64_t token_offset = 0) const;
  void* output() const noexcept { return out_; }
  // Whole layers: hidden states from token `token_offset` (nullptr for a core-only engine), and
  // the layer output [capacity, hidden_size].
  const void* hidden(std::int64_t token_offset = 0) const;
  void* hidden_output() const noexcept { return hidden_out_; }
  // Host copies of the generated inputs.
  struct Host {
    std::vector<std::uint16_t> q, k, v, g, beta, hidden;
  };
  const Host& host() const noexcept { return host_; }

 private:
  Backend backend_;
  void* stream_;
  std::int64_t capacity_ = 0;
  std::int64_t heads_ = 0, head_dim_ = 0, hidden_size_ = 0;  // hidden_size_ 0: core only
  std::uint64_t bytes_ = 0;
  void* memory_ = nullptr;  // one allocation holding the six buffers
  void *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *g_ = nullptr, *beta_ = nullptr;
  void* out_ = nullptr;
  void *hidden_ = nullptr, *hidden_out_ = nullptr;
  Host host_;
};

// Timings of run_synthetic().
struct RunReport {
  Backend backend = Backend::kCpu;
  std::int64_t tokens = 0;
  std::int64_t sequences = 0;
  std::vector<int> slots;             // the slots the run used
  bool whole_layers = false;          // hidden states through whole layers
  std::vector<double> layer_seconds;  // prefill, per KDA layer (in order)
  // Whole layers: each layer's prefill time by phase (kda::layer::Times; empty for core layers).
  std::vector<layer::Times> layer_phases;
  double prefill_seconds = 0.0;             // sum of layer_seconds
  double upload_seconds = 0.0;              // generating + uploading inputs (not in the above)
  double warmup_seconds = 0.0;              // the untimed warm-up forward (RunOptions::warmup)
  std::vector<double> decode_step_seconds;  // one entry per step: every KDA layer, 1 token/seq
  // Whether the decode steps replayed one CUDA graph (RunOptions::graphs), and if not, why not
  // ("the CPU backend", "graphs off", "the engine has no stream of its own", ...).
  bool decode_graphs = false;
  std::string decode_mode;
  // Where each sequence's state is after the run: its slot in `slots`, except after verify steps
  // with per-token states (the slot of the last step's last accepted token).
  std::vector<int> state_slots;
  // The slots verify steps with per-token states acquired beyond `slots` (released with them,
  // or left acquired as they are with RunOptions::release_slots false).
  std::vector<int> extra_slots;
};

// How decode steps run as speculative verify steps (RunOptions::verify_tokens; BatchMetadata):
// per-token states (num_accepted, T slots a sequence), records and a commit after each step, or
// records folded into the next step (records_region / fold_rows; a commit after the last).
enum class VerifyForm { kPerToken, kRecords, kFold };

struct RunOptions {
  std::int64_t tokens = 1024;  // total prefill tokens, split evenly over the sequences
  std::int64_t sequences = 1;
  int decode_steps = 0;       // after the prefill: steps of one token per sequence
  std::uint64_t seed = 0;     // synthetic inputs
  bool release_slots = true;  // false: leave the slots acquired (tests inspect their state)
  // One untimed prefill of the first layer (and a decode step of it, with decode_steps) on the
  // same inputs and slots before the timed runs, the slots then reset: the first timed layer then
  // does not pay first-call costs (CUDA kernel loading, cuBLAS initialisation, first touches of
  // the arena's pages), and every result is what it would have been without it.
  bool warmup = true;
  // CUDA: each decode step replays one CUDA graph of every layer's decode, captured once on
  // caller-owned batch metadata (kda::engine::BatchMetadata) — how a serving runtime runs decode.
  // Capture needs the engine on a stream of its own (EngineOptions::stream); without one, on the
  // CPU, or with false, the steps are eager calls. Every step reads the same window of synthetic
  // tokens then (the graph's inputs are fixed buffers); the states advance as in eager steps.
  bool graphs = true;
  // 0: decode steps of one token per sequence. 2..16: each decode step is a speculative verify
  // step of that many tokens a sequence in `verify_form`, sequence r accepting 1 + r % T of them
  // every step (the first step starts from the prefill's state), on caller-owned batch metadata;
  // on CUDA with graphs, steps after the first replay captured graphs (two with kFold, one per
  // records region). The engine needs free slots for the per-token form (T a sequence), and
  // runtime.max_verify_tokens >= T for the others (and runtime.record_regions 2 for kFold).
  int verify_tokens = 0;
  VerifyForm verify_form = VerifyForm::kFold;
  // Called after every layer of the prefill and after every decode step: (done, total).
  std::function<void(int, int)> progress;
  // Called after every layer of the prefill, before `progress`, with the report so far: its last
  // layer_seconds (and layer_phases) entry is the layer just run; upload and warm-up times are in.
  std::function<void(const RunReport&)> prefill_layer_done;
};

// Generates `inputs` (seeded, timed separately), acquires `sequences` slots, warms up (see
// RunOptions::warmup), prefills every KDA layer (tokens split as evenly as possible, earlier
// sequences one longer), then runs
// `decode_steps` steps of one token per sequence over every layer. An engine of whole layers runs
// prefill_hidden / decode_hidden on the synthetic hidden states (every layer reads the same ones)
// and reports each layer's phases; a core-only engine prefill / decode. Throws kda::Error.
RunReport run_synthetic(engine::Engine& engine, SyntheticInputs& inputs, const RunOptions& options);

}  // namespace kda::examples
