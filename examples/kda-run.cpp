// kda-run — run a model's KDA layers (whole layers, or their cores with --core-only) on synthetic
// inputs, print its memory plan, or run one case file (--case: the KDA core; --layer-case: one
// whole layer).
//
// Exit codes: 0 success, 1 runtime error (bad model or case file, backend failure), 2 usage error.
// Layers are named as the YAML's kda_layers names them (model layer, 1-based), with the KDA index
// (0-based position among the KDA layers, what Engine::prefill / decode take) where it helps.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "case_file.hpp"
#include "kda/engine/communicator.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"
#include "synthetic_run.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using kda::engine::BackendChoice;
using kda::planner::MemoryPlan;

#ifndef KDA_VERSION
#define KDA_VERSION "unknown"  // set from the CMake project version (examples/CMakeLists.txt)
#endif

constexpr std::int64_t kDefaultTokens = 1024;

// A non-blocking CUDA stream for the run (nullptr without CUDA or when not asked), destroyed last.
class Stream {
 public:
  explicit Stream(bool create) {
#ifdef KDA_HAVE_CUDA
    if (create && cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      stream_ = nullptr;  // the engine then runs on the default stream, and decode eagerly
    }
#else
    (void)create;
#endif
  }
  ~Stream() {
#ifdef KDA_HAVE_CUDA
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
#endif
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* get() const noexcept { return stream_; }

 private:
#ifdef KDA_HAVE_CUDA
  cudaStream_t stream_ = nullptr;
#else
  void* stream_ = nullptr;
#endif
};

const char* const kUsage =
    R"(Usage:
  kda-run --model M.yaml [--core-only] [--strict-config] [--tokens T] [--sequences N] [--decode-steps S]
          [--verify-tokens K [--verify-form tokens|records|fold]] [--graphs on|off]
          [--prefill-schedule auto|two-phase|pipelined]
          [--decode-step auto|one-launch|fused|fused-after-gemms|separate]
          [--backend auto|cpu|cuda] [--seed S] [--threads N] [--plan] [--ranks N]
          [--workspace-plan reuse|sum] [--max-tokens N] [--max-sequences N] [--state-dtype fp32|bf16]
  kda-run --model M.yaml --plan-only [--core-only] [--strict-config] [--plan | --json] [--tokens T]
          [--backend auto|cpu|cuda] [--workspace-plan reuse|sum] [--max-tokens N] [--max-sequences N]
          [--state-dtype fp32|bf16]
  kda-run --case IN.safetensors --output OUT.safetensors [--backend auto|cpu|cuda]
  kda-run --layer-case IN.safetensors --output OUT.safetensors [--backend auto|cpu|cuda]
  kda-run --help | --version

Runs every KDA layer of the model described by M.yaml on synthetic inputs (T tokens split as
evenly as they go over N sequences, so with T < N some have none; each on its own state slot)
and prints a summary of the memory plan, the time of each layer, the total and tokens/s. A KDA
layer is the whole layer (hidden states in and out: projections, short convolutions, the KDA
core, gated RMSNorm, output projection; its time split into those phases) unless --core-only or
the model's runtime.layers: core asks for the KDA core alone. With --decode-steps S, then runs S
decode steps of one token per sequence through every KDA layer and prints the median step latency
and tokens/s.

Layers are numbered as in the YAML's kda_layers (model layer, 1-based); "KDA index" is the 0-based
position among the KDA layers (the layer argument of Engine::prefill / decode and the C API).

The model line and the backend (with the reason when auto picks the CPU) come first, before the
arena is allocated and the weights are read or generated (seconds for a large model); each layer's
line is printed as it finishes. One untimed warm-up forward of the first layer runs before the timed
ones (first-call costs: kernel loading, cuBLAS, page faults), its states then cleared.

Options:
  --model M.yaml       model description (YAML, or a Hugging Face config.json as is; the schema:
                       docs/MODEL.md), or a Hugging Face model folder: its config.json describes
                       the model (Kimi-Linear, Kimi K3, GLM-5.3-Flash), its checkpoint
                       (model.safetensors or model.safetensors.index.json) gives the weights
  --tokens T           prefill tokens, all sequences together (default 1024; at most
                       runtime.max_tokens of the model)
  --sequences N        sequences (default 1; at most runtime.max_sequences)
  --workspace-plan P   reuse or sum: replaces the model's runtime.workspace_plan (default reuse,
                       also for a description without a runtime section: the KDA layers' workspaces
                       share memory; sum gives every buffer its own)
  --max-tokens N       replaces the model's runtime.max_tokens (default 8192): the largest prefill
                       the engine is planned for, all sequences together
  --max-sequences N    replaces the model's runtime.max_sequences (default 8; 1..1048576): the
                       state slots of every KDA layer
  --state-dtype D      fp32 or bf16: replaces the model's runtime.state_dtype (default fp32): the
                       recurrent states' dtype (a bf16 state halves their bytes)
  --decode-steps S     decode steps after the prefill (default 0)
  --graphs on|off      CUDA: each decode step replays one CUDA graph of every layer, captured once
                       on batch metadata in device memory, as a serving runtime runs decode
                       (default on); off: eager calls
  --verify-tokens K    the decode steps are speculative verify steps of K tokens a sequence
                       (2..16), sequence r accepting 1 + r % K of them each step (default 0: plain
                       steps of one token)
  --verify-form F      how: tokens (the state after every token kept, K slots a sequence), records
                       (records, then one commit of every layer after each step) or fold (default:
                       records, each step folding the step before's; one commit after the last).
                       Sets what the model's runtime needs (max_verify_tokens, record_regions,
                       max_sequences); with graphs, the steps after the first replay captured
                       graphs (two with fold, one per records region)
  --backend B          auto (default: the model's runtime.backend), cpu or cuda
  --seed S             seeds the synthetic inputs and random parameters (default 0)
  --threads N          CPU backend threads (default 0: all hardware threads; with --ranks, shared
                       evenly by the ranks)
  --ranks N            a synthetic tensor-parallel run (whole layers; N divides num_heads, 1..64):
                       N ranks as threads of this process, rank r an engine of runtime.tp_size N,
                       tp_rank r (its heads' shard), every whole layer's output all-reduced through
                       an in-process communicator: on CUDA every rank on its own stream of the one
                       GPU (make_cuda_local_communicators), on the CPU the CPU one. Prints each
                       layer's time (the slowest rank's, the all-reduce included), the time of the
                       all-reduce alone (the same T x hidden_size bf16, timed after the run) and its
                       share; decode steps run eagerly (this transport is not graph-capturable).
                       Ranks in separate processes or on several GPUs need NCCL
                       (make_nccl_communicator) in the host's own launcher. Default 1: no ranks
  --prefill-schedule S auto, two-phase or pipelined (default: the model's
                       runtime.prefill_schedule, itself auto): how the CUDA prefill runs its two
                       phases (docs/KDA.md section 3; same results to rounding, for A/B runs)
  --decode-step S      auto, one-launch, fused, fused-after-gemms or separate (default: the
                       model's runtime.decode_step, itself auto): how a CUDA whole layer runs a
                       decode step (docs/LAYER.md; same results to rounding, for A/B runs)
  --plan-only          print the memory plan and exit (no weights are read, but a missing weights
                       file is reported); --json prints every buffer as JSON:
                       {"mode", "alignment", "arena_bytes", "buffers": [{"name", "kind", "layer",
                       "offset", "bytes", ...}]}, kind one of workspace, state, scratch, parameter,
                       layer the model layer (1-based; -1 for buffers of no layer)
  --plan               print the memory plan as a table of every buffer (default: a summary of
                       the arena size, the bytes of each kind and the sum and reuse plans)
  --case IN            one KDA forward on the tensors of IN (safetensors case file: q, k, v, g,
                       beta, A_log, dt_bias, optional initial_state, cu_seqlens and
                       checkpoint_offsets; metadata gate, lower_bound, scale, final_state, mode
                       prefill or decode); writes out and final_state (and checkpoint_states, or in
                       decode mode intermediate_states) to --output. A bad case file is reported
                       and nothing is written.
  --layer-case IN      one whole KDA layer on the tensors of IN (safetensors: hidden_states, the
                       layer's weights by their checkpoint names, optional cu_seqlens, conv_state_q,
                       conv_state_k, conv_state_v, recurrent_state and checkpoint_offsets; metadata
                       gate, lower_bound, norm_eps, final_state, mode prefill or decode, tokens in
                       decode mode); writes out and the final states (and the checkpoint states, or
                       in decode mode intermediate_states and intermediate_conv_state_q, _k, _v)
                       to --output
  --core-only          run the KDA core of each layer only (q, k, v, g, beta in) instead of whole
                       layers
  --strict-config      unknown keys in runtime / linear_attn_config, and near misses of the
                       description's top-level keys (typos) are errors, not warnings
  --output OUT         where --case / --layer-case writes its result (atomically); must not be IN
                       itself (also not through a symlink or hard link)
  --help               this text
  --version            the version, the backends this build has and those this machine can run

Exit status: 0 success, 1 runtime error, 2 usage error.
)";

struct UsageError {
  std::string message;
};

struct Options {
  std::string model;
  std::string case_path;
  bool layer_case = false;  // case_path is a --layer-case file
  bool core_only = false;
  bool strict_config = false;  // unknown keys in the engine's sections are errors
  std::string output;
  std::optional<std::int64_t> tokens;
  std::int64_t sequences = 1;
  std::int64_t decode_steps = 0;
  bool graphs = true;
  bool graphs_given = false;
  int verify_tokens = 0;  // --verify-tokens
  kda::examples::VerifyForm verify_form = kda::examples::VerifyForm::kFold;
  bool verify_form_given = false;
  std::optional<BackendChoice> backend;
  std::uint64_t seed = 0;
  std::int64_t threads = 0;
  bool plan_only = false;
  bool json = false;
  bool full_plan = false;
  bool help = false;
  bool version = false;
  int ranks = 1;  // --ranks: tensor-parallel ranks as threads
  bool sequences_given = false;
  bool decode_given = false;
  bool seed_given = false;
  bool threads_given = false;
  std::optional<kda::PrefillSchedule> schedule;  // unset: the model's runtime.prefill_schedule
  std::optional<kda::layer::DecodeKernel> decode_step;  // unset: the model's runtime.decode_step
  // Replace the model description's runtime values (unset: the file's, or the defaults).
  kda::engine::RuntimeOverrides runtime;
};

std::int64_t parse_int(const std::string& flag, const std::string& text, std::int64_t lo,
                       std::int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  // Digits as written, with an optional '-' (strtoll would also skip blanks and take a '+').
  const std::size_t first_digit = !text.empty() && text[0] == '-' ? 1 : 0;
  if (text.size() <= first_digit || !std::isdigit(static_cast<unsigned char>(text[first_digit])) ||
      end != text.c_str() + text.size() || errno == ERANGE) {
    throw UsageError{flag + " expects an integer, got '" + text + "'"};
  }
  if (value < lo || value > hi) {
    throw UsageError{flag + " " + text + " is out of range [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]"};
  }
  return value;
}

// The model description's limit on runtime.max_sequences.
constexpr std::int64_t kMaxSequences = 1 << 20;

Options parse_args(int argc, char** argv) {
  Options o;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (arg.rfind("--", 0) == 0) {
      const auto eq = arg.find('=');
      if (eq != std::string::npos) {
        inline_value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
    }
    auto value = [&]() -> std::string {
      if (!inline_value && i + 1 >= argc) throw UsageError{arg + " needs a value"};
      std::string given = inline_value ? *inline_value : std::string(argv[++i]);
      // `--model ""` (an unset shell variable) would otherwise read as the option left out.
      if (given.empty()) throw UsageError{arg + " needs a value, got an empty one"};
      return given;
    };
    auto no_value = [&]() {
      if (inline_value) throw UsageError{arg + " takes no value"};
    };
    if (arg == "--help" || arg == "-h") {
      no_value();
      o.help = true;
    } else if (arg == "--version") {
      no_value();
      o.version = true;
    } else if (arg == "--model") {
      o.model = value();
    } else if (arg == "--case" || arg == "--layer-case") {
      if (!o.case_path.empty()) throw UsageError{"give one --case or --layer-case"};
      o.case_path = value();
      o.layer_case = arg == "--layer-case";
    } else if (arg == "--core-only") {
      no_value();
      o.core_only = true;
    } else if (arg == "--strict-config") {
      no_value();
      o.strict_config = true;
    } else if (arg == "--output") {
      o.output = value();
    } else if (arg == "--tokens") {
      o.tokens = parse_int(arg, value(), 1, kMax);
    } else if (arg == "--sequences") {
      o.sequences = parse_int(arg, value(), 1, kMaxSequences);
      o.sequences_given = true;
    } else if (arg == "--decode-steps") {
      o.decode_steps = parse_int(arg, value(), 0, 1 << 24);
      o.decode_given = true;
    } else if (arg == "--graphs") {
      const std::string v = value();
      if (v != "on" && v != "off") throw UsageError{"--graphs takes on or off, not '" + v + "'"};
      o.graphs = v == "on";
      o.graphs_given = true;
    } else if (arg == "--verify-tokens") {
      o.verify_tokens = static_cast<int>(parse_int(arg, value(), 2, kda::kMaxDecodeTokens));
    } else if (arg == "--verify-form") {
      const std::string v = value();
      if (v == "tokens") {
        o.verify_form = kda::examples::VerifyForm::kPerToken;
      } else if (v == "records") {
        o.verify_form = kda::examples::VerifyForm::kRecords;
      } else if (v == "fold") {
        o.verify_form = kda::examples::VerifyForm::kFold;
      } else {
        throw UsageError{"--verify-form takes tokens, records or fold, not '" + v + "'"};
      }
      o.verify_form_given = true;
    } else if (arg == "--ranks") {
      o.ranks = static_cast<int>(parse_int(arg, value(), 1, 64));
    } else if (arg == "--seed") {
      o.seed = static_cast<std::uint64_t>(parse_int(arg, value(), 0, kMax));
      o.seed_given = true;
    } else if (arg == "--threads") {
      o.threads = parse_int(arg, value(), 0, 4096);
      o.threads_given = true;
    } else if (arg == "--backend") {
      const std::string text = value();
      BackendChoice choice;
      if (!kda::engine::parse_backend_choice(text, &choice)) {
        throw UsageError{"--backend expects auto, cpu or cuda, got '" + text + "'"};
      }
      o.backend = choice;
    } else if (arg == "--prefill-schedule") {
      const std::string text = value();
      kda::PrefillSchedule schedule;
      if (!kda::engine::parse_prefill_schedule(text, &schedule)) {
        throw UsageError{"--prefill-schedule expects auto, two-phase or pipelined, got '" + text +
                         "'"};
      }
      o.schedule = schedule;
    } else if (arg == "--decode-step") {
      const std::string text = value();
      kda::layer::DecodeKernel step;
      if (!kda::layer::parse_decode_kernel(text, &step)) {
        throw UsageError{
            "--decode-step expects auto, one-launch, fused, fused-after-gemms or separate, got '" +
            text + "'"};
      }
      o.decode_step = step;
    } else if (arg == "--workspace-plan") {
      const std::string text = value();
      kda::planner::PlanMode mode;
      if (!kda::planner::parse_plan_mode(text, &mode)) {
        throw UsageError{"--workspace-plan expects reuse or sum, got '" + text + "'"};
      }
      o.runtime.workspace_plan = mode;
    } else if (arg == "--state-dtype") {
      const std::string text = value();
      kda::DType dtype;
      if (!kda::engine::parse_state_dtype(text, &dtype)) {
        throw UsageError{"--state-dtype expects fp32 or bf16, got '" + text + "'"};
      }
      o.runtime.state_dtype = dtype;
    } else if (arg == "--max-tokens") {
      o.runtime.max_tokens = parse_int(arg, value(), 1, kMax);
    } else if (arg == "--max-sequences") {
      o.runtime.max_sequences = parse_int(arg, value(), 1, kMaxSequences);
    } else if (arg == "--plan-only") {
      no_value();
      o.plan_only = true;
    } else if (arg == "--json") {
      no_value();
      o.json = true;
    } else if (arg == "--plan") {
      no_value();
      o.full_plan = true;
    } else {
      throw UsageError{"unknown argument '" + std::string(argv[i]) + "'"};
    }
  }
  if (o.help || o.version) return o;
  if (!o.case_path.empty()) {
    const std::string flag = o.layer_case ? "--layer-case" : "--case";
    if (!o.model.empty()) throw UsageError{flag + " and --model cannot be used together"};
    if (o.output.empty()) throw UsageError{flag + " needs --output OUT.safetensors"};
    const kda::engine::RuntimeOverrides& r = o.runtime;
    if (o.plan_only || o.json || o.full_plan || o.tokens || o.sequences_given || o.decode_given ||
        o.graphs_given || o.seed_given || o.threads_given || o.core_only || o.strict_config ||
        o.schedule || o.decode_step || r.workspace_plan || r.max_tokens || r.max_sequences ||
        r.state_dtype || o.ranks != 1 || o.verify_tokens != 0 || o.verify_form_given) {
      throw UsageError{flag + " takes only --output and --backend"};
    }
    return o;
  }
  if (!o.output.empty()) throw UsageError{"--output is only used with --case or --layer-case"};
  if (o.model.empty())
    throw UsageError{"nothing to do: give --model M.yaml (or FOLDER) or --case IN.safetensors"};
  if (o.json && !o.plan_only) throw UsageError{"--json is only used with --plan-only"};
  if (o.verify_form_given && o.verify_tokens == 0) {
    throw UsageError{"--verify-form needs --verify-tokens K"};
  }
  if (o.verify_tokens != 0 && o.decode_steps == 0 && !o.plan_only) {
    throw UsageError{"--verify-tokens needs --decode-steps S (the verify steps)"};
  }
  if (o.verify_tokens != 0 && o.ranks != 1) {
    throw UsageError{"--verify-tokens runs on one engine (not with --ranks)"};
  }
  if (o.plan_only &&
      (o.sequences_given || o.decode_given || o.graphs_given || o.seed_given || o.threads_given ||
       o.schedule || o.decode_step || o.ranks != 1 || o.verify_tokens != 0)) {
    throw UsageError{
        "--plan-only takes only --plan, --json, --tokens, --core-only, --strict-config, "
        "--backend, --workspace-plan, --max-tokens, --max-sequences and --state-dtype"};
  }
  return o;
}

// A one-line progress bar on stderr, shown only on a terminal and only once the run has taken
// more than about a second (short runs stay quiet).
class ProgressBar {
 public:
  ProgressBar() : enabled_(isatty(STDERR_FILENO) == 1), start_(std::chrono::steady_clock::now()) {}
  void update(int done, int total) {
    if (!enabled_) return;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (elapsed < 1.0 && !shown_) return;
    shown_ = true;
    constexpr int kWidth = 30;
    const int filled = total > 0 ? done * kWidth / total : kWidth;
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.append(static_cast<std::size_t>(kWidth - filled), '.');
    std::fprintf(stderr, "\r[%s] %d/%d  %.1f s", bar.c_str(), done, total, elapsed);
    std::fflush(stderr);
  }
  void finish() {
    if (shown_) {
      std::fprintf(stderr, "\r\033[K");
      std::fflush(stderr);
    }
    shown_ = false;
  }
  ~ProgressBar() { finish(); }

 private:
  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_;
};

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// "1 step", "2 steps": a count and its noun, plural where it is not one.
std::string counted(long long count, const char* noun) {
  return std::to_string(count) + " " + noun + (count == 1 ? "" : "s");
}

// The kernels the CUDA whole layers' decode steps ran (what --decode-step auto chose), in layer
// order without repeats, for the decode line: "; one-launch step"; "" where none ran (the CPU,
// core-only layers).
std::string decode_steps_ran(const kda::engine::Engine& engine) {
  std::vector<kda::layer::DecodeKernel> kernels;
  for (int l = 0; l < engine.num_layers(); ++l) {
    const kda::layer::DecodeKernel kernel = engine.decode_step_ran(l);
    if (kernel != kda::layer::DecodeKernel::kAuto &&
        std::find(kernels.begin(), kernels.end(), kernel) == kernels.end()) {
      kernels.push_back(kernel);
    }
  }
  std::string ran;
  for (const kda::layer::DecodeKernel kernel : kernels) {
    ran += std::string(ran.empty() ? "; " : ", ") + kda::layer::to_string(kernel);
  }
  return ran.empty() ? ran : ran + " step";
}

std::string describe_model(const kda::engine::ModelSpec& spec) {
  std::string text = spec.name + ": " + std::to_string(spec.num_hidden_layers) + " layers, " +
                     std::to_string(spec.num_kda_layers()) +
                     " KDA (H=" + std::to_string(spec.num_heads) +
                     ", D=" + std::to_string(spec.head_dim) + ", gate " + kda::to_string(spec.gate);
  if (spec.gate == kda::GateMode::kLowerBound) {
    char bound[32];
    std::snprintf(bound, sizeof bound, " %g", static_cast<double>(spec.gate_lower_bound));
    text += bound;
  }
  text += ", state " + std::string(spec.runtime.state_dtype == kda::DType::kF32 ? "fp32" : "bf16") +
          ", plan " + kda::planner::to_string(spec.runtime.workspace_plan) + ")";
  if (!spec.family.empty()) {
    text += "\nfamily: " + spec.family + " (" + spec.family_source + "), tensors " +
            spec.tensor_prefix + "*";
  }
  if (spec.runtime.layer_mode == kda::engine::LayerMode::kWhole) {
    text += "\nlayers: whole (hidden " + std::to_string(spec.hidden_size) + ", conv width " +
            std::to_string(spec.short_conv_kernel_size);
    if (spec.full_rank_gate) text += ", full-rank output gate";
    if (spec.runtime.tp_size > 1) {
      text += ", tensor-parallel rank " + std::to_string(spec.runtime.tp_rank) + " of " +
              std::to_string(spec.runtime.tp_size) + ": " + std::to_string(spec.local_heads()) +
              " heads, outputs are partial sums";
    }
    text += ")";
  } else {
    text += "\nlayers: KDA core only (q, k, v, g, beta in)";
  }
  return text;
}

// "4 (KDA index 2)" for model layer 4 (1-based), the third KDA layer.
std::string layer_text(const kda::engine::ModelSpec& spec, int model_layer) {
  const auto it = std::find(spec.kda_layers.begin(), spec.kda_layers.end(), model_layer);
  if (it == spec.kda_layers.end()) return std::to_string(model_layer);
  return std::to_string(model_layer) + " (KDA index " +
         std::to_string(it - spec.kda_layers.begin()) + ")";
}

// Every buffer, one per line; layers and lifetimes in the numbering above (the engine runs the KDA
// layers in order, one planner step each, so a step is a KDA index).
std::string plan_table(const kda::engine::ModelSpec& spec, const MemoryPlan& plan) {
  kda::planner::TableFormat format;
  format.layer_text = [&spec](int layer) { return layer_text(spec, layer); };
  format.steps_text = [](int first, int last) {
    return first == last ? "KDA index " + std::to_string(first)
                         : "KDA index " + std::to_string(first) + "-" + std::to_string(last);
  };
  format.lifetime_heading = "live during";
  return plan.to_table(format);
}

// The plan in a few lines: the arena, the bytes of each kind of buffer, and what the model would
// need under each plan mode (runtime.workspace_plan picks one).
std::string plan_summary(const kda::engine::ModelSpec& spec, const MemoryPlan& plan,
                         kda::Backend backend) {
  using kda::planner::BufferKind;
  using kda::planner::format_bytes;
  std::string text = "arena: " + format_bytes(plan.arena_bytes) + " (" +
                     std::to_string(plan.arena_bytes) + " bytes) in " +
                     std::to_string(plan.entries.size()) + " buffers, runtime.workspace_plan " +
                     kda::planner::to_string(plan.mode) + "\n";
  char line[160];
  for (const BufferKind kind :
       {BufferKind::kParameter, BufferKind::kState, BufferKind::kWorkspace, BufferKind::kScratch}) {
    std::uint64_t bytes = 0;
    int count = 0;
    for (const auto& entry : plan.entries) {
      if (entry.kind != kind) continue;
      bytes += entry.bytes;
      ++count;
    }
    if (count == 0) continue;
    const bool whole = spec.runtime.layer_mode == kda::engine::LayerMode::kWhole;
    const char* note =
        kind == BufferKind::kState
            ? (whole ? "max_sequences slots per KDA layer: recurrent, conv q/k/v"
                     : "max_sequences slots per KDA layer")
        : kind == BufferKind::kWorkspace
            ? (whole ? "one per KDA layer, live while it runs: projections, conv "
                       "outputs, gates, core output, the core's workspace"
                     : "one per KDA layer")
        : kind == BufferKind::kParameter
            ? (whole ? "A_log and dt_bias, and each KDA layer's weights" : "A_log and dt_bias")
            : "engine temporaries";
    std::snprintf(line, sizeof line, "  %-10s %3d buffers  %10s  %s\n",
                  kda::planner::to_string(kind), count, format_bytes(bytes).c_str(), note);
    text += line;
  }
  kda::engine::ModelSpec other = spec;
  other.runtime.workspace_plan = plan.mode == kda::planner::PlanMode::kSum
                                     ? kda::planner::PlanMode::kReuse
                                     : kda::planner::PlanMode::kSum;
  // The other mode's arena, for comparison: a sum of every buffer may overflow 64 bits where
  // reuse does not (the planner allows it), which only this line says.
  std::string other_bytes;
  try {
    other_bytes = format_bytes(kda::engine::Engine::plan_for(other, backend).arena_bytes);
  } catch (const kda::Error& e) {
    if (e.code() != kda::StatusCode::kOverflow) throw;
    other_bytes = "more than 64-bit sizes hold";
  }
  const std::string this_bytes = format_bytes(plan.arena_bytes);
  const bool is_sum = plan.mode == kda::planner::PlanMode::kSum;
  std::snprintf(line, sizeof line,
                "  plan sum: %s (each buffer its own memory), plan reuse: %s (workspaces and "
                "scratch share)\n",
                (is_sum ? this_bytes : other_bytes).c_str(),
                (is_sum ? other_bytes : this_bytes).c_str());
  text += line;
  text += "  (--plan prints every buffer)\n";
  return text;
}

std::string plan_text(const Options& o, const kda::engine::ModelSpec& spec, const MemoryPlan& plan,
                      kda::Backend backend) {
  return o.full_plan ? plan_table(spec, plan) : plan_summary(spec, plan, backend);
}

// Prefixes `path: ` to an error that does not name the file it concerns yet, so every message of
// kda-run says which file it is about.
kda::Error naming(const kda::Error& e, const std::string& path) {
  const std::string what = e.what();
  if (what.rfind(path, 0) == 0) return e;
  return kda::Error(e.code(), path + ": " + what);
}

int run_case_mode(const Options& o) {
  const auto start = std::chrono::steady_clock::now();
  kda::Backend used = kda::Backend::kCpu;
  try {
    if (o.layer_case) {
      kda::engine::run_layer_case_file(o.case_path, o.output,
                                       o.backend.value_or(BackendChoice::kAuto), &used);
    } else {
      kda::engine::run_case_file(o.case_path, o.output, o.backend.value_or(BackendChoice::kAuto),
                                 &used);
    }
  } catch (const kda::Error& e) {
    // run_case_file names the input or the output; anything else is about the input.
    const std::string what = e.what();
    if (what.rfind(o.output, 0) == 0) throw;
    throw naming(e, o.case_path);
  } catch (const std::bad_alloc&) {
    // A small file can ask for much: its cu_seqlens may hold a million sequences, each with its
    // states. Nothing was written (the output is written last).
    throw kda::Error(kda::StatusCode::kOutOfMemory,
                     o.case_path +
                         ": out of host memory: the case's tensors, states and outputs (one "
                         "state a sequence of its cu_seqlens) do not fit in this machine's memory");
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("kda-run: %s -> %s on %s in %.3f s\n", o.case_path.c_str(), o.output.c_str(),
              kda::to_string(used), seconds);
  return 0;
}

// "backend: cpu (2 threads; auto: no CUDA device found)", "backend: cuda (NVIDIA H200; prefill
// schedule auto)": what the engine will run on, and why auto chose the CPU, said before the engine
// is built (which takes seconds for a large model).
std::string backend_line(const Options& o, const kda::engine::ModelSpec& spec, BackendChoice choice,
                         kda::Backend backend, const std::string& why) {
  std::string text = "backend: " + std::string(kda::to_string(backend)) + " (";
  if (backend == kda::Backend::kCpu) {
    const int threads = o.threads > 0
                            ? static_cast<int>(o.threads)
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    text += std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  } else {
    text +=
        kda::device_name(0) + "; prefill schedule " + kda::to_string(spec.runtime.prefill_schedule);
    if (spec.runtime.layer_mode == kda::engine::LayerMode::kWhole) {
      text += std::string("; decode step ") + kda::layer::to_string(spec.runtime.decode_step);
    }
  }
  if (choice == BackendChoice::kAuto && backend == kda::Backend::kCpu) text += "; auto: " + why;
  return text + ")";
}

// One row of the timing table: model layer, KDA index, time, tokens/s (and a whole layer's phases).
void print_layer_row(const kda::engine::Engine& engine, int kda_index, double seconds,
                     std::int64_t tokens, const kda::layer::Times* phases) {
  std::printf("%8d  %9d  %12.3f  %12.0f", engine.layer(kda_index).model_layer, kda_index,
              seconds * 1e3, seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
  if (phases != nullptr) {
    std::printf("  %11.3f  %9.3f  %9.3f  %9.3f  %9.3f", phases->projections * 1e3,
                phases->conv * 1e3, phases->core * 1e3, phases->norm * 1e3, phases->o_proj * 1e3);
  }
  std::printf("\n");
}

// --ranks N: N tensor-parallel ranks as threads, each an engine of its shard with a communicator
// of one in-process group; rank r's engine is runtime.tp_size N, tp_rank r of the same model (the
// same seed gives every rank its shard of the same random weights).
int run_ranks(const Options& o, const kda::engine::ModelSpec& spec, BackendChoice choice,
              kda::Backend backend, const std::string& why, std::int64_t tokens) {
  const int n = o.ranks;
  if (spec.runtime.layer_mode != kda::engine::LayerMode::kWhole) {
    throw UsageError{
        "--ranks needs whole layers (a tensor-parallel rank all-reduces its whole "
        "layers' outputs), not --core-only or runtime.layers: core"};
  }
  if (spec.runtime.tp_size != 1) {
    throw UsageError{"--ranks: " + o.model + " is already rank " +
                     std::to_string(spec.runtime.tp_rank) + " of runtime.tp_size " +
                     std::to_string(spec.runtime.tp_size)};
  }
  if (spec.num_heads % n != 0) {
    throw UsageError{"--ranks " + std::to_string(n) + " does not divide num_heads " +
                     std::to_string(spec.num_heads) + " (each rank holds num_heads / N heads)"};
  }
  const bool cuda = backend == kda::Backend::kCuda;
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int rank_threads =
      std::max(1, (o.threads > 0 ? static_cast<int>(o.threads) : hardware) / n);
  std::printf("%s\n%s\n", describe_model(spec).c_str(),
              backend_line(o, spec, choice, backend, why).c_str());
  std::printf("tensor parallel: %d ranks as threads of this process, %lld heads each, %s\n", n,
              static_cast<long long>(spec.num_heads / n),
              cuda ? "each on its own stream of the one GPU (CUDA local communicator)"
                   : ("each with " + std::to_string(rank_threads) +
                      " CPU thread(s) (CPU local communicator)")
                         .c_str());
  std::printf("building %d engines: the arenas, then random weights (seed %llu)...\n", n,
              static_cast<unsigned long long>(o.seed));
  auto group = cuda ? kda::engine::make_cuda_local_communicators(n)
                    : kda::engine::make_local_communicators(n);

  struct Rank {
    kda::examples::RunReport report;
    double all_reduce_seconds = 0.0;
    std::vector<int> model_layers;
    std::string decode_ran;  // decode_steps_ran()
    std::string error;
  };
  std::vector<Rank> ranks(static_cast<std::size_t>(n));
  // The ranks meet once their engines are built: a rank whose engine failed must not leave the
  // others waiting in a collective it never calls, so either all run or none does.
  std::mutex mutex;
  std::condition_variable all_built;
  int built = 0;
  bool any_failed = false;
  auto arrive = [&](bool ok) {
    std::unique_lock<std::mutex> lock(mutex);
    any_failed = any_failed || !ok;
    ++built;
    all_built.notify_all();
    all_built.wait(lock, [&] { return built == n; });
    return !any_failed;
  };
  constexpr int kAllReduceReps = 10;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Rank& mine = ranks[static_cast<std::size_t>(r)];
      bool arrived = false;
      try {
        kda::engine::ModelSpec rank_spec = spec;
        rank_spec.runtime.tp_size = n;
        rank_spec.runtime.tp_rank = r;
        // The ranks' decode steps run on concurrent streams of one GPU, where one-launch steps
        // (each wanting every multiprocessor) could wait on each other: the fused step, unless
        // --decode-step says otherwise.
        if (cuda && !o.decode_step) {
          rank_spec.runtime.decode_step = kda::layer::DecodeKernel::kFusedFactors;
        }
        kda::engine::EngineOptions options;
        options.backend = cuda ? BackendChoice::kCuda : BackendChoice::kCpu;
        options.seed = o.seed;
        options.cpu_threads = rank_threads;
        const Stream stream(cuda);
        options.stream = stream.get();
        options.communicator = group[static_cast<std::size_t>(r)].get();
        kda::engine::Engine engine(rank_spec, options);
        kda::examples::SyntheticInputs inputs(engine, tokens);
        arrived = true;
        if (!arrive(true)) return;
        for (int l = 0; l < engine.num_layers(); ++l)
          mine.model_layers.push_back(engine.layer(l).model_layer);
        kda::examples::RunOptions run;
        run.tokens = tokens;
        run.sequences = o.sequences;
        run.decode_steps = static_cast<int>(o.decode_steps);
        run.graphs = false;  // the in-process CUDA communicator cannot be captured
        run.seed = o.seed;
        mine.report = kda::examples::run_synthetic(engine, inputs, run);
        mine.decode_ran = decode_steps_ran(engine);
        // The all-reduce alone: what each layer's prefill ends with, on the same buffer.
        const std::size_t count = static_cast<std::size_t>(tokens * spec.hidden_size);
        engine.synchronize();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < kAllReduceReps; ++i) {
          group[static_cast<std::size_t>(r)]->all_reduce_sum(inputs.hidden_output(), count,
                                                             kda::DType::kBF16, stream.get());
        }
        engine.synchronize();
        mine.all_reduce_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
            kAllReduceReps;
        engine.check_device_status();
      } catch (const std::exception& e) {
        mine.error = e.what();
        if (!arrived) arrive(false);
        // Ranks still running wait in a collective this rank will not call: wake them.
        group[static_cast<std::size_t>(r)]->abort();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // The first rank's own error, before those of ranks the failure woke (an aborted group).
  for (const bool woken : {false, true}) {
    for (int r = 0; r < n; ++r) {
      const std::string& error = ranks[static_cast<std::size_t>(r)].error;
      if (error.empty() || (!woken && error.find("was aborted") != std::string::npos)) continue;
      throw kda::Error(kda::StatusCode::kInternal, "rank " + std::to_string(r) + ": " + error);
    }
  }

  const Rank& first = ranks[0];
  const double all_reduce =
      std::max_element(ranks.begin(), ranks.end(), [](const Rank& a, const Rank& b) {
        return a.all_reduce_seconds < b.all_reduce_seconds;
      })->all_reduce_seconds;
  std::printf(
      "\nprefill: %lld tokens in %lld sequence%s on %d ranks; all-reduce of %lld x %lld bf16 "
      "(%s) alone: %.3f ms (the slowest rank, mean of %d)\n",
      static_cast<long long>(tokens), static_cast<long long>(o.sequences),
      o.sequences == 1 ? "" : "s", n, static_cast<long long>(tokens),
      static_cast<long long>(spec.hidden_size),
      kda::planner::format_bytes(static_cast<std::uint64_t>(tokens * spec.hidden_size * 2)).c_str(),
      all_reduce * 1e3, kAllReduceReps);
  std::printf("%8s  %9s  %12s  %12s  %15s  %15s\n", "layer", "KDA index", "time (ms)", "tokens/s",
              "all-reduce (ms)", "all-reduce share");
  double total = 0.0;
  for (std::size_t l = 0; l < first.report.layer_seconds.size(); ++l) {
    double slowest = 0.0;  // the ranks run at once: a layer is done when its slowest rank is
    for (const Rank& rank : ranks) slowest = std::max(slowest, rank.report.layer_seconds[l]);
    total += slowest;
    std::printf("%8d  %9d  %12.3f  %12.0f  %15.3f  %14.1f%%\n", first.model_layers[l],
                static_cast<int>(l), slowest * 1e3,
                slowest > 0 ? static_cast<double>(tokens) / slowest : 0.0, all_reduce * 1e3,
                slowest > 0 ? 100.0 * all_reduce / slowest : 0.0);
  }
  const std::size_t layers = first.report.layer_seconds.size();
  std::printf(
      "total: %s in %.3f s: %.0f tokens/s through the whole stack; the all-reduces "
      "%.1f%% of it\n",
      counted(static_cast<long long>(layers), "KDA layer").c_str(), total,
      total > 0 ? static_cast<double>(tokens) / total : 0.0,
      total > 0 ? 100.0 * all_reduce * static_cast<double>(layers) / total : 0.0);
  if (o.decode_steps > 0) {
    const double step = median(first.report.decode_step_seconds);
    std::printf(
        "decode: %s of 1 token x %s through %s on %d ranks: median %.3f ms per step (rank 0, "
        "eager%s)\n",
        counted(static_cast<long long>(o.decode_steps), "step").c_str(),
        counted(static_cast<long long>(o.sequences), "sequence").c_str(),
        counted(static_cast<long long>(layers), "KDA layer").c_str(), n, step * 1e3,
        first.decode_ran.c_str());
  }
  return 0;
}

int run_model(const Options& o) {
  const auto start = std::chrono::steady_clock::now();
  kda::engine::ModelSpecOptions spec_options;
  spec_options.strict = o.strict_config;
  spec_options.runtime = o.runtime;
  kda::engine::ModelSpec spec = kda::engine::load_model_spec(o.model, spec_options);
  if (o.core_only) spec.runtime.layer_mode = kda::engine::LayerMode::kCoreOnly;
  if (o.schedule) spec.runtime.prefill_schedule = *o.schedule;
  if (o.decode_step) spec.runtime.decode_step = *o.decode_step;
  for (const std::string& warning : spec.warnings) {
    std::fprintf(stderr, "kda-run: warning: %s\n", warning.c_str());
  }
  const std::int64_t tokens = o.tokens.value_or(std::min(kDefaultTokens, spec.runtime.max_tokens));
  if (tokens > spec.runtime.max_tokens) {
    throw UsageError{"--tokens " + std::to_string(tokens) + " exceeds runtime.max_tokens " +
                     std::to_string(spec.runtime.max_tokens) + " of " + o.model +
                     " (--max-tokens raises it)"};
  }
  if (o.sequences > spec.runtime.max_sequences) {
    throw UsageError{"--sequences " + std::to_string(o.sequences) +
                     " exceeds runtime.max_sequences " +
                     std::to_string(spec.runtime.max_sequences) + " of " + o.model +
                     " (--max-sequences raises it)"};
  }
  if (o.verify_tokens != 0) {
    // What the verify form needs of the runtime: records for K tokens (and two regions to fold),
    // or K slots a sequence (raised where --max-sequences did not set it).
    using kda::examples::VerifyForm;
    const std::int64_t slots = o.sequences * o.verify_tokens;
    if (o.verify_form == VerifyForm::kPerToken && slots > spec.runtime.max_sequences) {
      if (o.runtime.max_sequences || slots > kMaxSequences) {
        throw UsageError{
            "--verify-form tokens keeps " + std::to_string(o.verify_tokens) +
            " slots a sequence: " + std::to_string(slots) + " slots, above runtime.max_sequences " +
            std::to_string(spec.runtime.max_sequences) +
            (o.runtime.max_sequences ? " (--max-sequences)"
                                     : " (at most " + std::to_string(kMaxSequences) + ")")};
      }
      spec.runtime.max_sequences = slots;
    }
    if (o.verify_form != VerifyForm::kPerToken) {
      spec.runtime.max_verify_tokens =
          std::max<std::int64_t>(spec.runtime.max_verify_tokens, o.verify_tokens);
    }
    if (o.verify_form == VerifyForm::kFold) spec.runtime.record_regions = 2;
  }
  const BackendChoice choice = o.backend.value_or(spec.runtime.backend);
  std::string why;
  const kda::Backend backend = kda::engine::resolve_backend(spec, choice, &why);

  // A weights file that is not there is worth knowing before anything is printed or planned
  // (planning reads no weights; the engine would find out only after the arena is allocated).
  kda::engine::check_weights_file(spec);
  if (o.plan_only) {
    const MemoryPlan plan = kda::engine::Engine::plan_for(spec, backend);
    if (o.json) {
      std::printf("%s\n", plan.to_json().c_str());
    } else {
      std::printf("%s\n", describe_model(spec).c_str());
      if (choice == BackendChoice::kAuto && backend == kda::Backend::kCpu) {
        std::printf("backend: cpu (auto: %s)\n", why.c_str());
      }
      std::printf(
          "memory plan on %s (the engine's arena; a run's synthetic inputs come on top):\n%s",
          kda::to_string(backend), plan_text(o, spec, plan, backend).c_str());
    }
    return 0;
  }

  // A run on CUDA where it cannot run fails before anything is printed (a plan is still made).
  if (std::string unavailable;
      backend == kda::Backend::kCuda && !kda::engine::cuda_backend_available(&unavailable)) {
    throw kda::Error(kda::StatusCode::kBackendUnavailable,
                     (o.backend ? "--backend cuda: " : "runtime.backend cuda: ") + unavailable);
  }
  if (o.ranks > 1) return run_ranks(o, spec, choice, backend, why, tokens);
  // What the engine will be, before it is built: allocating the arena and reading or generating
  // the weights takes seconds for a large model.
  const bool whole = spec.runtime.layer_mode == kda::engine::LayerMode::kWhole;
  std::printf("%s\n%s\n", describe_model(spec).c_str(),
              backend_line(o, spec, choice, backend, why).c_str());
  const std::string what = whole ? "weights" : "parameters";
  const std::string source = spec.weights.empty()
                                 ? "random " + what + " (seed " + std::to_string(o.seed) + ")"
                                 : "the " + what + " of " + spec.weights;
  std::printf("building the engine: the arena, then %s...\n", source.c_str());
  kda::engine::EngineOptions options;
  options.backend = backend == kda::Backend::kCuda ? BackendChoice::kCuda : BackendChoice::kCpu;
  options.seed = o.seed;
  options.cpu_threads = static_cast<int>(o.threads);
  // CUDA: a stream of the run's own, as a runtime would give the engine (graph capture needs one).
  const Stream stream(backend == kda::Backend::kCuda);
  options.stream = stream.get();
  kda::engine::Engine engine(spec, options);
  if (whole) {
    // Each layer's weight image is its arena buffer layer{n}.weights (CPU: widened to fp32).
    std::printf("weights: %s (%s in the arena%s)\n", engine.weights_origin().c_str(),
                kda::planner::format_bytes(engine.weight_bytes()).c_str(),
                engine.backend() == kda::Backend::kCuda ? "" : ", widened to fp32");
  } else {
    std::printf("parameters: %s\n", engine.layer(0).origin.c_str());
  }
  std::printf("engine ready in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  // Room for a verify step's sequences x K token rows too.
  kda::examples::SyntheticInputs inputs(
      engine, std::max<std::int64_t>(tokens, o.sequences * std::max(o.verify_tokens, 1)));
  std::printf("\nmemory plan:\n%s", plan_text(o, spec, engine.plan(), engine.backend()).c_str());
  std::printf("synthetic inputs: %s for %lld tokens (outside the arena)\n\n",
              kda::planner::format_bytes(inputs.bytes()).c_str(),
              static_cast<long long>(inputs.capacity()));

  ProgressBar bar;
  kda::examples::RunOptions run;
  run.tokens = tokens;
  run.sequences = o.sequences;
  run.decode_steps = static_cast<int>(o.decode_steps);
  run.verify_tokens = o.verify_tokens;
  run.verify_form = o.verify_form;
  run.graphs = o.graphs;
  run.seed = o.seed;
  run.progress = [&bar](int done, int total) { bar.update(done, total); };
  // Each layer's row as soon as it has run; the header with the first (the untimed work is known
  // by then).
  run.prefill_layer_done = [&](const kda::examples::RunReport& so_far) {
    bar.finish();  // the row goes where the bar was; the next update draws it again
    const std::size_t done = so_far.layer_seconds.size();
    if (done == 1) {
      std::printf(
          "prefill: %lld tokens in %lld sequence%s (inputs generated and copied in %.3f s, a "
          "warm-up forward of the first layer in %.3f s; neither timed)\n",
          static_cast<long long>(tokens), static_cast<long long>(o.sequences),
          o.sequences == 1 ? "" : "s", so_far.upload_seconds, so_far.warmup_seconds);
      std::printf("%8s  %9s  %12s  %12s", "layer", "KDA index", "time (ms)", "tokens/s");
      if (whole) {
        std::printf("  %11s  %9s  %9s  %9s  %9s  (ms)", "projections", "conv", "core", "norm",
                    "o_proj");
      }
      std::printf("\n");
    }
    print_layer_row(engine, static_cast<int>(done - 1), so_far.layer_seconds.back(), tokens,
                    whole ? &so_far.layer_phases.back() : nullptr);
  };
  const kda::examples::RunReport report = kda::examples::run_synthetic(engine, inputs, run);
  bar.finish();

  const double total = report.prefill_seconds;
  std::printf(
      "total: %s in %.3f s: %.0f tokens/s through the whole stack, "
      "%.0f tokens/s per layer\n",
      counted(engine.num_layers(), "KDA layer").c_str(), total,
      total > 0 ? static_cast<double>(tokens) / total : 0.0,
      total > 0 ? static_cast<double>(tokens) * engine.num_layers() / total : 0.0);

  if (o.decode_steps > 0) {
    const double step = median(report.decode_step_seconds);
    const double best =
        *std::min_element(report.decode_step_seconds.begin(), report.decode_step_seconds.end());
    const char* const forms[] = {"per-token states", "records + a commit",
                                 "records, each folding the step before"};
    const long long steps = static_cast<long long>(o.decode_steps);
    const std::string kind = o.verify_tokens == 0
                                 ? counted(steps, "step") + " of 1 token"
                                 : counted(steps, "verify step") + " of " +
                                       std::to_string(o.verify_tokens) + " tokens (" +
                                       forms[static_cast<int>(o.verify_form)] + ")";
    const std::int64_t step_tokens = o.sequences * std::max(o.verify_tokens, 1);
    const std::string ran = decode_steps_ran(engine);
    std::printf(
        "decode: %s x %s through %s: median "
        "%.3f ms per step (min %.3f ms), %.0f tokens/s, %.1f us per layer-step (%s%s)\n",
        kind.c_str(), counted(static_cast<long long>(o.sequences), "sequence").c_str(),
        counted(engine.num_layers(), "KDA layer").c_str(), step * 1e3, best * 1e3,
        step > 0 ? static_cast<double>(step_tokens) / step : 0.0, step * 1e6 / engine.num_layers(),
        report.decode_graphs ? report.decode_mode.c_str()
                             : ("eager: " + report.decode_mode).c_str(),
        ran.c_str());
  }
  // What the kernels found that the host could not see (CUDA; throws kda::Error naming it).
  engine.check_device_status();
  return 0;
}

int run_model_mode(const Options& o) {
  try {
    return run_model(o);
  } catch (const kda::Error& e) {
    throw naming(e, o.model);
  }
}

// "backends built: cpu cuda; available here: cpu (cuda: no CUDA device found)": what this build
// has, and what this machine can run of it.
void print_version() {
  std::string available = "cpu";
  if (std::string why_not; kda::engine::cuda_backend_available(&why_not)) {
    available += " cuda";
  } else if (kda::cuda_compiled()) {
    available += " (cuda: " + why_not + ")";
  }
  std::printf("kda-run %s\nbackends built: cpu%s; available here: %s\n", KDA_VERSION,
              kda::cuda_compiled() ? " cuda" : "", available.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line into a pipe or a file too (`kda-run ... | tee log`): a run prints its progress
  // over seconds or minutes, not all at its end.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  Options options;
  try {
    options = parse_args(argc, argv);
    if (options.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (options.version) {
      print_version();
      return 0;
    }
    return options.case_path.empty() ? run_model_mode(options) : run_case_mode(options);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "kda-run: %s\n(run kda-run --help for usage)\n", e.message.c_str());
    return 2;
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "kda-run: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda-run: error: %s\n", e.what());
    return 1;
  }
}
