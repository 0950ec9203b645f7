// kda-layer-bench — one whole KDA layer on CUDA (kda::layer), random weights, D = 128, conv width
// 4, f32 recurrent state (bf16 with --state bf16), in three shapes: Kimi-Linear-48B (hidden 2304, H
// = 32, softplus gate), its TP8 shard (H = 4 of 32), and Kimi K3's TP8 shard (hidden 7168, H = 12
// of 96, bounded gate -5, and K3's full-rank output gate g_proj [C, E] in place of the low-rank
// g_a/g_b pair); prefill T = 8192 (one sequence) and decode steps of B = 1, 2, 4, 8, 64, 256
// sequences (one token each; H = 32 B = 2 / 4 are 64 / 128 (row, head) pairs: past the fused
// step's 32 with an fp32 state, within its 128 with a bf16 one). Each phase (projections, conv,
// core, norm, o_proj) is timed with the layer's CUDA events (RunOptions::times; the call then waits
// for the layer); the table shows the median over the timed runs, after warm-up, in microseconds,
// each phase as "time (floor)", the whole layer's total against the sum of the phase floors, and
// "graph": the median of one forward captured in a CUDA graph and replayed (events around each
// replay, no host in between: what a serving runtime's captured decode step pays per layer). The
// graph holds the forwards of L layers of the shape, each with its own weights and state pools, L
// the fewest whose weights exceed three times the L2 cache (1 to 32), and its time is divided by L:
// every layer reads its weights from memory, as in a model, where a single layer replayed alone
// would find a small shard's weights in L2. Decode cases are replayed once for each
// RunOptions::decode_kernel (the second table: auto, which at one token of up to a few sequences is
// the one-launch step, fused with the second factors inside, fused after GEMMs, separate kernels;
// the fused ones with RunOptions::fused_cluster chosen by shape), then the fused step with each
// fused_cluster (1, 2, 4, 8 blocks a head), in the same run. The first table's decode cases name
// the kernel auto ran (RunOptions::decode_kernel_ran). The GEMMs of few rows are the layer's
// default kernels unless KDA_LAYER_SMALL_GEMM=streamed (or 0: cuBLAS). Floors (bench_floors.hpp; bw
// = the device-to-device copy bandwidth measured at start, peak = 989 TFLOP/s, the H200's dense
// bf16 spec):
//   projections  max(FLOPs / peak, bytes / bw): x·W_inᵀ and the two low-rank second factors (full-
//                rank gate: x·W_inᵀ without g_a, f_a·W_fbᵀ, x·W_gᵀ); bytes = their weights, hidden
//                read (once), proj, g and the f32 gate written, f_a|g_a (f_a) read
//   conv         bytes / bw: q|k|v read and written (bf16), beta read and written, conv states
//                read and written, taps
//   core         bytes / bw: the KDA core's bytes as kda-bench counts them (q, k, v, g, beta read,
//                out written, states read and written in their dtype, the slot list in decode)
//   norm         bytes / bw: o read (bf16), gate read (f32), y written (bf16)
//   o_proj       max(FLOPs / peak, bytes / bw): y·W_oᵀ; W_o, y read, out written
//
// Usage: kda-layer-bench [--iters N] [--warmup N] [--decode-only] [--shape h32|tp8|k3]...
//                        [--batch B]... [--state f32|bf16] [--verify-kernel K]
//                        [--timeline] [--graph-only] [--host]
// --host prints only the host's time per eager forward (run_host_table), for the shapes named,
// and what the host's calls it is made of cost alone (run_host_pieces).
// --decode-only leaves out the prefill rows (and the checkpoint table, which needs them).
// --graph-only leaves out the tables by decode kernel and the verify steps: the rows' default
// step alone, for A/B runs of one build against another.
// --state bf16 keeps every recurrent state pool (and checkpoint) in bf16; records stay f32.
// --verify-kernel K runs the verify rows' steps (not the commit) on one RunOptions::decode_kernel
// (parse_decode_kernel's names: fused, the fused kernel with its second factors inside, or
// separate, for an A/B of the two at several tokens a row; a step the fused kernel does not fit
// runs separate); auto by default.
// --shape runs only the shapes named (Kimi-Linear-48B, its TP8 shard, Kimi K3's TP8 shard);
// --batch only the decode rows and verify steps of B sequences, any B (with --decode-only: nothing
// else; verify steps of any B asked for, else of B = 1, 64 and 256).
// Both repeat; without them, everything. Device time is short: a run of the rows an A/B needs.
// --timeline (built with CUPTI, which comes with the CUDA Toolkit): for each row run (decode steps
// and prefills), the kernels and memsets of one graph replay of the row's default forward as
// CUPTI's activity records give them (start, end, the gap to the one before; a negative gap is an
// overlap, a programmatic dependent starting while the kernel before it drains): where a
// forward's time goes between its launches, which the per-phase events, which serialize the
// phases, cannot show. The other tables of such a run are timed with CUPTI loaded: compare them
// with runs without --timeline only with care.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(KDA_HAVE_CUPTI)
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <mutex>
#endif

#include "bench_device.cuh"
#include "bench_floors.hpp"
#include "checkpoint_requests.hpp"
#include "kda/bf16.hpp"
#include "kda/error.hpp"
#include "kda/layer/layer.hpp"
#include "layer_shapes.hpp"

namespace {

using kda_bench::DeviceMemory;

using kda_bench::host_us_per_call;
using kda_bench::median;

// What `enqueue` puts on `stream`, captured in one graph and instantiated.
struct CapturedGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CapturedGraph(cudaStream_t stream, const std::function<void()>& enqueue) {
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CK(cudaStreamEndCapture(stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
};

// What `enqueue` puts on `stream` (the forwards of `layers` layers, or one call over them),
// captured in one graph and replayed: the median over `iters` replays after `warmup`, each timed
// with events around it, in microseconds per layer.
double replay_per_layer(cudaStream_t stream, int layers, int warmup, int iters,
                        const std::function<void()>& enqueue) {
  const CapturedGraph captured(stream, enqueue);
  cudaGraphExec_t exec = captured.exec;
  cudaEvent_t before = nullptr, after = nullptr;
  CK(cudaEventCreate(&before));
  CK(cudaEventCreate(&after));
  std::vector<double> per_layer;
  for (int it = 0; it < warmup + iters; ++it) {
    CK(cudaEventRecord(before, stream));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(after, stream));
    CK(cudaEventSynchronize(after));
    float ms = 0.0f;
    CK(cudaEventElapsedTime(&ms, before, after));
    if (it >= warmup) per_layer.push_back(ms * 1e3 / layers);
  }
  cudaEventDestroy(before);
  cudaEventDestroy(after);
  return median(per_layer);
}

// One kernel (or memset) of a traced graph replay: its name and CUDA's launch shape (0 for a
// memset), GPU timestamps in ns.
struct KernelSpan {
  std::string name;
  std::uint64_t start = 0, end = 0;
  int grid = 0, block = 0, cluster = 0;  // blocks, threads a block, blocks a cluster (0: none)
};

#if defined(KDA_HAVE_CUPTI)
// False, with a warning, where CUPTI refuses (under nsys or ncu, say): the timeline is then left
// out and the run goes on.
bool cupti_ok(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return true;
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  std::fprintf(stderr, "kda-layer-bench --timeline: %s: %s\n", what,
               text != nullptr ? text : "CUPTI error");
  return false;
}

// The records CUPTI hands back (its own thread may call the completion callback).
std::mutex g_spans_mutex;
std::vector<KernelSpan> g_spans;
int g_untimed = 0;  // kernel and memset records without timestamps, left out

// A kernel's demangled name without its namespaces and parameter list, at most 72 characters.
std::string short_kernel_name(const char* mangled) {
  if (mangled == nullptr) return "(unnamed)";
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : mangled;
  std::free(demangled);
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);  // a template kernel's return type
  for (const char* noise : {"(anonymous namespace)::", "kda::layer::cuda::", "kda::detail::"}) {
    for (std::size_t at = name.find(noise); at != std::string::npos; at = name.find(noise)) {
      name.erase(at, std::strlen(noise));
    }
  }
  int depth = 0;  // cut the parameter list: the first '(' outside template arguments
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0) {
      name.resize(i);
      break;
    }
  }
  if (name.size() > 72) name = name.substr(0, 69) + "...";
  for (char& ch : name) ch = ch == '|' ? '/' : ch;  // a table cell
  return name;
}

void CUPTIAPI timeline_buffer_requested(std::uint8_t** buffer, std::size_t* size,
                                        std::size_t* max_records) {
  constexpr std::size_t kBytes = std::size_t{4} << 20;
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer != nullptr ? kBytes : 0;
  *max_records = 0;
}

void CUPTIAPI timeline_buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                                        std::size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    KernelSpan span;
    if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      // CUPTI 13's memset record; a graph's memset nodes (the prefill's checkpoint index).
      const auto* memset = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      span.name = "memset (" + std::to_string(memset->bytes) + " bytes)";
      span.start = memset->start;
      span.end = memset->end;
    } else if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      // CUPTI 13's kernel record (cupti_activity.h); a later CUPTI may deliver a newer layout.
      static_assert(CUPTI_API_VERSION >= 130000, "the kernel record layout of CUPTI 13");
      const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      span.name = short_kernel_name(kernel->name);
      span.start = kernel->start;
      span.end = kernel->end;
      span.grid = kernel->gridX * kernel->gridY * kernel->gridZ;
      span.block = kernel->blockX * kernel->blockY * kernel->blockZ;
      span.cluster = static_cast<int>(kernel->clusterX * kernel->clusterY * kernel->clusterZ);
    } else {
      continue;
    }
    const std::lock_guard<std::mutex> lock(g_spans_mutex);
    if (span.start == 0 || span.end == 0) {  // no timestamps collected for this record
      ++g_untimed;
    } else {
      g_spans.push_back(std::move(span));
    }
  }
  std::free(buffer);
}
#endif

// The kernels of one replay of what `enqueue` puts on `stream`, captured in a graph, in start
// order (after three replays whose records are dropped); `untimed`: records without timestamps,
// left out. Empty without CUPTI, or where CUPTI refuses (a warning on stderr).
std::vector<KernelSpan> traced_replay(cudaStream_t stream, const std::function<void()>& enqueue,
                                      int* untimed) {
  std::vector<KernelSpan> spans;
  *untimed = 0;
#if defined(KDA_HAVE_CUPTI)
  static const bool registered =
      cupti_ok(cuptiActivityRegisterCallbacks(timeline_buffer_requested, timeline_buffer_completed),
               "cuptiActivityRegisterCallbacks");
  // Traced from before the capture: CUPTI reports a graph's kernel nodes when it knew of the
  // graph from its instantiation on.
  if (!registered || !cupti_ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                               "cuptiActivityEnable")) {
    return spans;
  }
  const bool memsets =
      cupti_ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityEnable(memset)");
  bool ok = true;
  {
    const CapturedGraph captured(stream, enqueue);
    for (int it = 0; it < 3; ++it) CK(cudaGraphLaunch(captured.exec, stream));
    CK(cudaStreamSynchronize(stream));
    ok = cupti_ok(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    {
      const std::lock_guard<std::mutex> lock(g_spans_mutex);
      g_spans.clear();
      g_untimed = 0;
    }
    CK(cudaGraphLaunch(captured.exec, stream));
    CK(cudaStreamSynchronize(stream));
    ok = ok &&
         cupti_ok(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  }
  cupti_ok(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable");
  if (memsets) cupti_ok(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityDisable");
  {
    const std::lock_guard<std::mutex> lock(g_spans_mutex);
    if (ok) {
      spans.swap(g_spans);
      *untimed = g_untimed;
    }
    g_spans.clear();
  }
  std::sort(spans.begin(), spans.end(),
            [](const KernelSpan& a, const KernelSpan& b) { return a.start < b.start; });
#else
  (void)stream, (void)enqueue;
#endif
  return spans;
}

// `spans` as a table: times in us from the first kernel's start; "after the previous" is this
// kernel's start less the latest end of the kernels before it (negative: they overlap).
std::string timeline_table(const std::string& title, const std::vector<KernelSpan>& spans,
                           int untimed) {
  std::string out =
      "\n" + title + "\n\n| # | kernel | blocks | threads | cluster | start | end | " +
      "duration | after the previous |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
  if (spans.empty()) return out + "| - | no kernel or memset records | | | | | | | |\n";
  const double t0 = static_cast<double>(spans.front().start);
  std::uint64_t latest_end = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const KernelSpan& k = spans[i];
    const double start = (static_cast<double>(k.start) - t0) * 1e-3;
    const double end = (static_cast<double>(k.end) - t0) * 1e-3;
    char gap[32] = "-";
    if (i > 0) {
      std::snprintf(gap, sizeof gap, "%.2f",
                    (static_cast<double>(k.start) - static_cast<double>(latest_end)) * 1e-3);
    }
    latest_end = std::max(latest_end, k.end);
    char line[320];
    std::snprintf(line, sizeof line, "| %zu | %s | %d | %d | %d | %.2f | %.2f | %.2f | %s |\n",
                  i + 1, k.name.c_str(), k.grid, k.block, k.cluster, start, end, end - start, gap);
    out += line;
  }
  if (untimed > 0)
    out += "\n(" + std::to_string(untimed) +
           " kernel or memset records without timestamps left out)\n";
  return out;
}

// One layer's state pools of `slots` rows (conv states of width - 1 columns, recurrent states in
// `dtype`), zeroed, and the State that names them.
struct StatePools {
  DeviceMemory conv_q, conv_k, conv_v, recurrent;
  std::int64_t slots;
  kda::DType dtype;
  StatePools(const kda::layer::Config& c, std::int64_t num_slots, kda::DType recurrent_dtype)
      : conv_q(static_cast<std::size_t>(num_slots * c.local_channels() * (c.conv_width - 1)) * 2),
        conv_k(conv_q.bytes),
        conv_v(conv_q.bytes),
        recurrent(static_cast<std::size_t>(num_slots * c.local_heads() * c.head_dim * c.head_dim) *
                  kda::dtype_size(recurrent_dtype)),
        slots(num_slots),
        dtype(recurrent_dtype) {}
  kda::layer::State state() const {
    kda::layer::State state;
    state.num_slots = slots;
    state.conv_q = static_cast<kda::bf16_bits*>(conv_q.ptr);
    state.conv_k = static_cast<kda::bf16_bits*>(conv_k.ptr);
    state.conv_v = static_cast<kda::bf16_bits*>(conv_v.ptr);
    state.recurrent = recurrent.ptr;
    state.recurrent_dtype = dtype;
    return state;
  }
};

struct Case {
  std::string name;
  std::int64_t sequences;
  std::int64_t tokens_per_sequence;
  bool decode;
  // Prefill checkpoints (Batch::checkpoints), as checkpoint_requests.hpp reads it.
  std::int64_t checkpoint_every = kda::bench::kNoCheckpoints;
};

// --host: the host's time per eager forward, as a runtime pays it where it does not replay a graph
// (an eager prefill chunk, a decode step outside the captured sizes), with
// RunOptions::check_pointers on and off.
void run_host_table(const std::vector<std::string>& shapes_wanted, cudaStream_t stream) {
  std::printf(
      "\n### Host time per eager forward (us a call; enqueue only, median of 20 x 50 calls; slots "
      "and cu_seqlens with their host copies)\n\n");
  std::printf("| layer | case | host us per call | checks off | cost of the checks |\n");
  std::printf("|---|---|---:|---:|---:|\n");
  const Case cases[] = {Case{"decode B = 1", 1, 1, true}, Case{"decode B = 64", 64, 1, true},
                        Case{"prefill 1 x 64 tokens", 1, 64, false},
                        Case{"prefill 16 x 16 tokens", 16, 16, false}};
  for (const kda::bench::LayerShape& shape : kda::bench::layer_shapes()) {
    if (!shapes_wanted.empty() &&
        std::find(shapes_wanted.begin(), shapes_wanted.end(), shape.key) == shapes_wanted.end()) {
      continue;
    }
    const kda::layer::Config& config = shape.config;
    const auto layer =
        kda::layer::make_layer(kda::Backend::kCuda, kda::layer::random_weights(config, 42, 0));
    const std::int64_t E = config.hidden_size;
    for (const Case& c : cases) {
      const std::int64_t N = c.sequences, T = N * c.tokens_per_sequence;
      std::vector<std::int64_t> cu(static_cast<std::size_t>(N + 1));
      for (std::int64_t n = 0; n <= N; ++n) cu[n] = n * c.tokens_per_sequence;
      std::vector<std::int32_t> slots(static_cast<std::size_t>(N));  // reversed: a real list
      for (std::int64_t n = 0; n < N; ++n) slots[n] = static_cast<std::int32_t>(N - 1 - n);
      DeviceMemory d_hidden(static_cast<std::size_t>(T * E) * 2), d_out(d_hidden.bytes);
      DeviceMemory d_cu(cu.size() * 8), d_slots(slots.size() * 4);
      const StatePools pools(config, N, kda::DType::kF32);
      const std::size_t ws_bytes =
          kda::layer::workspace_bytes(kda::Backend::kCuda, config, T, N, N);
      DeviceMemory workspace(ws_bytes);
      CK(cudaMemcpy(d_cu.ptr, cu.data(), cu.size() * 8, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_slots.ptr, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
      kda::layer::Batch batch;
      batch.tokens = T;
      batch.sequences = N;
      batch.decode_tokens = c.decode ? 1 : 0;
      if (!c.decode) {
        batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu.ptr);
        batch.cu_seqlens_host = cu.data();
      }
      batch.slots = static_cast<const std::int32_t*>(d_slots.ptr);
      batch.slots_host = slots.data();
      const kda::layer::State state = pools.state();
      auto forward_us = [&](bool check_pointers) {
        kda::layer::RunOptions options;
        options.stream = stream;
        options.check_pointers = check_pointers;
        return host_us_per_call(stream, 50, [&] {
          layer->forward(batch, static_cast<const kda::bf16_bits*>(d_hidden.ptr),
                         static_cast<kda::bf16_bits*>(d_out.ptr), state,
                         kda::Workspace{workspace.ptr, ws_bytes}, options);
        });
      };
      const double on = forward_us(true), off = forward_us(false);
      std::printf("| %s | %s | %.2f | %.2f | %.2f |\n", shape.name, c.name.c_str(), on, off,
                  on - off);
      std::fflush(stdout);
    }
    // A prefill of one sequence whose token count changes at every call (65, 66, ..., 128, then
    // again): what a runtime's eager prefills of varying lengths pay, where the GEMMs on cuBLAS
    // meet shapes the layer has not chosen an algorithm for yet.
    constexpr std::int64_t kLeast = 65, kCounts = 64;
    const std::int64_t T_most = kLeast + kCounts - 1;
    std::vector<std::int64_t> cu(static_cast<std::size_t>(2 * kCounts));
    for (std::int64_t i = 0; i < kCounts; ++i) cu[2 * i + 1] = kLeast + i;
    DeviceMemory d_hidden(static_cast<std::size_t>(T_most * E) * 2), d_out(d_hidden.bytes);
    DeviceMemory d_cu(cu.size() * 8), d_slots(4);
    const std::int32_t slot = 0;
    CK(cudaMemcpy(d_cu.ptr, cu.data(), cu.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_slots.ptr, &slot, 4, cudaMemcpyHostToDevice));
    const StatePools pools(config, 1, kda::DType::kF32);
    const std::size_t ws_bytes =
        kda::layer::workspace_bytes(kda::Backend::kCuda, config, T_most, 1, 1);
    DeviceMemory workspace(ws_bytes);
    auto forward_us = [&](bool check_pointers) {
      kda::layer::RunOptions options;
      options.stream = stream;
      options.check_pointers = check_pointers;
      std::int64_t i = 0;
      return host_us_per_call(stream, 50, [&] {
        kda::layer::Batch batch;
        batch.tokens = cu[2 * i + 1];
        batch.sequences = 1;
        batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu.ptr) + 2 * i;
        batch.cu_seqlens_host = cu.data() + 2 * i;
        batch.slots = static_cast<const std::int32_t*>(d_slots.ptr);
        batch.slots_host = &slot;
        layer->forward(batch, static_cast<const kda::bf16_bits*>(d_hidden.ptr),
                       static_cast<kda::bf16_bits*>(d_out.ptr), pools.state(),
                       kda::Workspace{workspace.ptr, ws_bytes}, options);
        i = (i + 1) % kCounts;
      });
    };
    const double on = forward_us(true), off = forward_us(false);
    std::printf("| %s | prefill 1 x 65..128 tokens, a new count each call | %.2f | %.2f | %.2f |\n",
                shape.name, on, off, on - off);
    std::fflush(stdout);
  }
}

__global__ void empty_kernel() {}

// --host, second table: what the host calls that an eager forward is made of cost each, alone, in
// the same loop, for telling where a forward's host time goes: a kernel launch (plain and
// programmatic), a side stream's fork, cuBLAS's stream and workspace binding (every forward binds
// them with cublasGemmEx), and each shape's GEMMs at 64 rows through cublasGemmEx and through
// cublasLtMatmul as the layer calls it (past 8 rows the layer's GEMMs run on cuBLAS).
void run_host_pieces(const std::vector<std::string>& shapes_wanted, cudaStream_t stream) {
  std::printf(
      "\n### Host time of the pieces of an eager forward (us a call, alone; the same loop)\n\n");
  std::printf("| call | host us per call |\n|---|---:|\n");
  auto row = [](const std::string& what, double us) {
    std::printf("| %s | %.2f |\n", what.c_str(), us);
    std::fflush(stdout);
  };
  row("empty kernel, `<<<1, 32>>>`",
      host_us_per_call(stream, 50, [&] { empty_kernel<<<1, 32, 0, stream>>>(); }));
  cudaLaunchAttribute programmatic{};
  programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(1);
  launch.blockDim = dim3(32);
  launch.stream = stream;
  launch.attrs = &programmatic;
  launch.numAttrs = 1;
  row("empty kernel, `cudaLaunchKernelEx`, programmatic",
      host_us_per_call(stream, 50, [&] { CK(cudaLaunchKernelEx(&launch, empty_kernel)); }));
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  row("`cudaEventRecord` + `cudaStreamWaitEvent`", host_us_per_call(stream, 50, [&] {
        CK(cudaEventRecord(fork, stream));
        CK(cudaStreamWaitEvent(side, fork, 0));
      }));
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    std::exit(1);
  }
  cublasLtHandle_t lt = nullptr;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasLtCreate failed\n");
    std::exit(1);
  }
  constexpr std::size_t kCublasScratch = std::size_t{32} << 20;
  DeviceMemory scratch(kCublasScratch);
  // Each call is made once and its status checked before it is timed (the loop then ignores it).
  auto must = [&](cublasStatus_t status, const std::string& what) {
    if (status != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "%s failed: %s\n", what.c_str(), cublasGetStatusString(status));
      std::exit(1);
    }
    CK(cudaStreamSynchronize(stream));
  };
  auto bind = [&] {
    return cublasSetStream(handle, stream) == CUBLAS_STATUS_SUCCESS
               ? cublasSetWorkspace(handle, scratch.ptr, kCublasScratch)
               : CUBLAS_STATUS_INVALID_VALUE;
  };
  must(bind(), "cublasSetStream + cublasSetWorkspace");
  row("`cublasSetStream` + `cublasSetWorkspace`", host_us_per_call(stream, 50, bind));
  for (const kda::bench::LayerShape& shape : kda::bench::layer_shapes()) {
    if (!shapes_wanted.empty() &&
        std::find(shapes_wanted.begin(), shapes_wanted.end(), shape.key) == shapes_wanted.end()) {
      continue;
    }
    const kda::layer::Config& c = shape.config;
    const std::int64_t E = c.hidden_size, Cl = c.local_channels(), D = c.head_dim;
    const std::int64_t gate_a = c.full_rank_gate ? 0 : D;
    const std::int64_t stride = (3 * Cl + D + gate_a + c.local_heads() + 7) / 8 * 8;
    constexpr int kRows = 64;
    struct Gemm {
      const char* what;
      std::int64_t n_out, n_in;
    };
    const Gemm gemms[] = {{"input projection", stride, E}, {"o_proj", E, Cl}, {"f_a·W_fbᵀ", Cl, D}};
    for (const Gemm& g : gemms) {
      DeviceMemory weight(static_cast<std::size_t>(g.n_out * g.n_in) * 2);
      DeviceMemory in(static_cast<std::size_t>(kRows * g.n_in) * 2);
      DeviceMemory out(static_cast<std::size_t>(kRows * g.n_out) * 2);
      const float one = 1.0f, zero = 0.0f;
      auto gemm = [&] {
        return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(g.n_out), kRows,
                            static_cast<int>(g.n_in), &one, weight.ptr, CUDA_R_16BF,
                            static_cast<int>(g.n_in), in.ptr, CUDA_R_16BF, static_cast<int>(g.n_in),
                            &zero, out.ptr, CUDA_R_16BF, static_cast<int>(g.n_out),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      };
      const std::string gemm_name = std::string(shape.name) + " " + g.what + " [" +
                                    std::to_string(kRows) + " x " + std::to_string(g.n_in) +
                                    "] · [" + std::to_string(g.n_out) + " x " +
                                    std::to_string(g.n_in) + "]ᵀ";
      must(gemm(), "cublasGemmEx, " + gemm_name);
      row("`cublasGemmEx`, " + gemm_name, host_us_per_call(stream, 50, gemm));
      // The same through cuBLASLt, its descriptors built in place at each call as the layer builds
      // them and the algorithm chosen once (the layer's table of them; the layer also looks the
      // shape up there, and its operands may sit at column offsets of a wider row).
      cublasLtMatmulDescOpaque_t desc;
      cublasLtMatrixLayoutOpaque_t a, b, d;
      const cublasOperation_t transpose = CUBLAS_OP_T;
      auto describe = [&] {
        cublasStatus_t st = cublasLtMatmulDescInit(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        if (st == CUBLAS_STATUS_SUCCESS) {
          st = cublasLtMatmulDescSetAttribute(&desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                              sizeof(transpose));
        }
        if (st == CUBLAS_STATUS_SUCCESS)
          st = cublasLtMatrixLayoutInit(&a, CUDA_R_16BF, g.n_in, g.n_out, g.n_in);
        if (st == CUBLAS_STATUS_SUCCESS)
          st = cublasLtMatrixLayoutInit(&b, CUDA_R_16BF, g.n_in, kRows, g.n_in);
        if (st == CUBLAS_STATUS_SUCCESS)
          st = cublasLtMatrixLayoutInit(&d, CUDA_R_16BF, g.n_out, kRows, g.n_out);
        return st;
      };
      must(describe(), "cuBLASLt descriptors, " + gemm_name);
      cublasLtMatmulPreferenceOpaque_t preference;
      must(cublasLtMatmulPreferenceInit(&preference), "cublasLtMatmulPreferenceInit");
      const std::uint64_t workspace_bytes = kCublasScratch;
      must(cublasLtMatmulPreferenceSetAttribute(&preference,
                                                CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace_bytes, sizeof(workspace_bytes)),
           "cublasLtMatmulPreferenceSetAttribute");
      cublasLtMatmulHeuristicResult_t chosen{};
      int found = 0;
      if (cublasLtMatmulAlgoGetHeuristic(lt, &desc, &a, &b, &d, &d, &preference, 1, &chosen,
                                         &found) != CUBLAS_STATUS_SUCCESS ||
          found < 1 || chosen.state != CUBLAS_STATUS_SUCCESS) {
        row("`cublasLtMatmul`, " + gemm_name + ": no algorithm", 0.0);
        continue;
      }
      auto lt_gemm = [&] {
        const cublasStatus_t st = describe();
        return st != CUBLAS_STATUS_SUCCESS
                   ? st
                   : cublasLtMatmul(lt, &desc, &one, weight.ptr, &a, in.ptr, &b, &zero, out.ptr, &d,
                                    out.ptr, &d, &chosen.algo, scratch.ptr, kCublasScratch, stream);
      };
      must(lt_gemm(), "cublasLtMatmul, " + gemm_name);
      row("`cublasLtMatmul` (descriptors built each call), " + gemm_name,
          host_us_per_call(stream, 50, lt_gemm));
      // What a shape the layer has no algorithm for yet costs on top: the heuristic's choice.
      row("`cublasLtMatmulAlgoGetHeuristic` (first choice), " + gemm_name,
          host_us_per_call(stream, 50, [&] {
            cublasLtMatmulHeuristicResult_t result{};
            int count = 0;
            return cublasLtMatmulAlgoGetHeuristic(lt, &desc, &a, &b, &d, &d, &preference, 1,
                                                  &result, &count);
          }));
      row("`cublasLtMatmulAlgoCheck` (the chosen algorithm), " + gemm_name,
          host_us_per_call(stream, 50, [&] {
            cublasLtMatmulHeuristicResult_t result{};
            return cublasLtMatmulAlgoCheck(lt, &desc, &a, &b, &d, &d, &chosen.algo, &result);
          }));
    }
  }
  cublasLtDestroy(lt);
  cublasDestroy(handle);
  CK(cudaEventDestroy(fork));
  CK(cudaStreamDestroy(side));
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20, warmup = 5;
  bool decode_only = false, timeline = false, graph_only = false, host_only = false;
  std::vector<std::string> shapes_wanted;
  std::vector<std::int64_t> batches_wanted;
  kda::DType state_dtype = kda::DType::kF32;
  kda::layer::DecodeKernel verify_kernel = kda::layer::DecodeKernel::kAuto;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--decode-only") == 0) {
      decode_only = true;
    } else if (std::strcmp(argv[i], "--graph-only") == 0) {
      graph_only = true;
    } else if (std::strcmp(argv[i], "--host") == 0) {
      host_only = true;
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--warmup") == 0 && i + 1 < argc) {
      warmup = std::max(0, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "h32") == 0 || std::strcmp(argv[i + 1], "tp8") == 0 ||
                std::strcmp(argv[i + 1], "k3") == 0)) {
      shapes_wanted.emplace_back(argv[++i]);
    } else if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc && std::atoi(argv[i + 1]) > 0) {
      batches_wanted.push_back(std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--state") == 0 && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "f32") == 0 || std::strcmp(argv[i + 1], "bf16") == 0)) {
      state_dtype = std::strcmp(argv[++i], "bf16") == 0 ? kda::DType::kBF16 : kda::DType::kF32;
    } else if (std::strcmp(argv[i], "--verify-kernel") == 0 && i + 1 < argc &&
               kda::layer::parse_decode_kernel(argv[i + 1], &verify_kernel)) {
      ++i;
    } else if (std::strcmp(argv[i], "--timeline") == 0) {
#if defined(KDA_HAVE_CUPTI)
      timeline = true;
#else
      std::fprintf(stderr, "%s: --timeline needs a build with CUPTI (not found)\n", argv[0]);
      return 2;
#endif
    } else {
      std::fprintf(stderr,
                   "usage: %s [--iters N] [--warmup N] [--decode-only] [--shape h32|tp8|k3]... "
                   "[--batch B]... [--state f32|bf16] [--verify-kernel K] "
                   "[--timeline] [--graph-only] [--host]\n",
                   argv[0]);
      return 2;
    }
  }
  auto wanted_batch = [&](std::int64_t sequences) {
    return batches_wanted.empty() || std::find(batches_wanted.begin(), batches_wanted.end(),
                                               sequences) != batches_wanted.end();
  };
  try {
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    if (host_only) {
      std::printf("kda-layer-bench --host on %s\n", prop.name);
      cudaStream_t stream = nullptr;
      CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      run_host_table(shapes_wanted, stream);
      run_host_pieces(shapes_wanted, stream);
      CK(cudaStreamDestroy(stream));
      return 0;
    }
    const double bw = kda::bench::measure_copy_bandwidth();
    const auto state_bytes = static_cast<std::int64_t>(kda::dtype_size(state_dtype));
    const double peak = kda::bench::kPeakBf16Flops;
    std::printf(
        "kda-layer-bench on %s: Kimi-Linear-48B KDA layer (hidden 2304, H 32, D 128, W 4),"
        " %s recurrent state, median of %d runs after %d warm-up, microseconds; each phase"
        " \"time (floor)\"; floors from device-to-device copy %.2f TB/s (measured, bytes read +"
        " written) and %.0f TFLOP/s bf16 (H200 dense spec)\n\n",
        prop.name, kda::to_string(state_dtype), iters, warmup, bw / 1e12, peak / 1e12);
    std::printf(
        "| layer | case | total | floor sum | x floor | graph | graph x floor | projections | conv "
        "|"
        " core | norm | o_proj |\n");
    std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    cudaStream_t stream = nullptr;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<std::string> kernel_rows;      // the second table
    std::vector<std::string> checkpoint_rows;  // the third
    std::vector<std::string> verify_rows;      // the fourth
    std::vector<std::string> timelines;        // --timeline

    for (const kda::bench::LayerShape& shape : kda::bench::layer_shapes()) {
      if (!shapes_wanted.empty() &&
          std::find(shapes_wanted.begin(), shapes_wanted.end(), shape.key) == shapes_wanted.end()) {
        continue;
      }
      const kda::layer::Config& config = shape.config;
      const std::size_t weight_bytes = kda::layer::weight_image_bytes(kda::Backend::kCuda, config);
      const std::size_t l2 = static_cast<std::size_t>(std::max(prop.l2CacheSize, 1));
      const int instances = static_cast<int>(
          std::clamp<std::size_t>((3 * l2 + weight_bytes - 1) / weight_bytes, 1, 32));
      std::vector<std::unique_ptr<kda::layer::Layer>> layers;
      for (int l = 0; l < instances; ++l) {
        layers.push_back(
            kda::layer::make_layer(kda::Backend::kCuda, kda::layer::random_weights(config, 42, l)));
      }
      const auto& layer = layers.front();
      const std::int64_t E = config.hidden_size, Cl = config.local_channels();
      const std::int64_t Hl = config.local_heads(), D = config.head_dim;
      const std::string layer_name = shape.name;
      double plain_graph = 0.0;  // the prefill without checkpoints, graph per layer
      std::vector<Case> cases = {Case{"prefill T = 8192", 1, 8192, false},
                                 Case{"prefill T = 8192, 2 checkpoints", 1, 8192, false, -1},
                                 Case{"prefill T = 8192, 1 checkpoint / 256", 1, 8192, false, 256}};
      // The default decode rows, and any other batch size asked for (--batch), in order.
      std::vector<std::int64_t> decode_batches = {1, 2, 4, 8, 64, 256};
      for (const std::int64_t B : batches_wanted) decode_batches.push_back(B);
      std::sort(decode_batches.begin(), decode_batches.end());
      decode_batches.erase(std::unique(decode_batches.begin(), decode_batches.end()),
                           decode_batches.end());
      for (const std::int64_t B : decode_batches)
        cases.push_back(Case{"decode B = " + std::to_string(B), B, 1, true});
      for (const Case& c : cases) {
        if (decode_only && !c.decode) continue;
        if (c.decode && !wanted_batch(c.sequences)) continue;
        const std::int64_t N = c.sequences, T = N * c.tokens_per_sequence;
        // Checkpoint requests of each sequence into pool rows after the sequences' own.
        const kda::bench::CheckpointRequests requests = kda::bench::checkpoint_requests(
            std::vector<std::int64_t>(static_cast<std::size_t>(N), c.tokens_per_sequence),
            c.checkpoint_every, static_cast<std::int32_t>(N));
        const std::vector<std::int64_t>& offsets = requests.offsets;
        const std::vector<std::int32_t>& rows = requests.rows;
        const std::int64_t K = requests.columns;
        std::vector<std::int32_t> own;
        for (std::int64_t n = 0; n < N && K > 0; ++n) own.push_back(static_cast<std::int32_t>(n));
        const std::int64_t slots = N + N * K;
        std::vector<kda::bf16_bits> hidden(static_cast<std::size_t>(T * E));
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
        for (kda::bf16_bits& h : hidden) h = kda::float_to_bf16(dist(rng));
        std::vector<std::int64_t> cu(static_cast<std::size_t>(N + 1));
        for (std::int64_t n = 0; n <= N; ++n) cu[n] = n * c.tokens_per_sequence;

        DeviceMemory d_hidden(hidden.size() * 2), d_out(hidden.size() * 2);
        DeviceMemory d_cu(cu.size() * 8);
        std::vector<std::unique_ptr<StatePools>> pools;  // one set per layer of the graph
        for (int l = 0; l < instances; ++l) {
          pools.push_back(std::make_unique<StatePools>(config, slots, state_dtype));
        }
        const std::size_t ws_bytes =
            kda::layer::workspace_bytes(kda::Backend::kCuda, config, T, N, slots);
        DeviceMemory workspace(ws_bytes);
        CK(cudaMemcpy(d_hidden.ptr, hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_cu.ptr, cu.data(), cu.size() * 8, cudaMemcpyHostToDevice));
        DeviceMemory d_own(own.size() * 4 + 4), d_offsets(offsets.size() * 8 + 8),
            d_rows(rows.size() * 4 + 4);
        if (K > 0) {
          CK(cudaMemcpy(d_own.ptr, own.data(), own.size() * 4, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(d_offsets.ptr, offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(d_rows.ptr, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
        }

        kda::layer::Batch batch;
        batch.tokens = T;
        batch.sequences = N;
        batch.decode_tokens = c.decode ? c.tokens_per_sequence : 0;
        batch.cu_seqlens = static_cast<const std::int64_t*>(d_cu.ptr);
        batch.cu_seqlens_host = cu.data();
        if (K > 0) {
          batch.slots = static_cast<const std::int32_t*>(d_own.ptr);
          batch.slots_host = own.data();
          batch.checkpoints = K;
          batch.checkpoint_offsets = static_cast<const std::int64_t*>(d_offsets.ptr);
          batch.checkpoint_slots = static_cast<const std::int32_t*>(d_rows.ptr);
        }
        auto state_of = [&](int l) { return pools[l]->state(); };
        const kda::layer::State state = state_of(0);
        kda::layer::RunOptions options;
        options.stream = stream;

        std::vector<double> phase[5], total;
        for (int it = 0; it < warmup + iters; ++it) {
          // Pointers checked once, by the first (warm-up) call; each call's phases are timed with
          // the layer's events (RunOptions::times: the call waits for the layer).
          options.check_pointers = it == 0;
          kda::layer::Times times;
          options.times = &times;
          layer->forward(batch, static_cast<const kda::bf16_bits*>(d_hidden.ptr),
                         static_cast<kda::bf16_bits*>(d_out.ptr), state,
                         kda::Workspace{workspace.ptr, ws_bytes}, options);
          CK(cudaStreamSynchronize(stream));
          if (it < warmup) continue;
          const double seconds[5] = {times.projections, times.conv, times.core, times.norm,
                                     times.o_proj};
          double sum = 0.0;
          for (int p = 0; p < 5; ++p) {
            phase[p].push_back(seconds[p] * 1e6);
            sum += seconds[p] * 1e6;
          }
          total.push_back(sum);
        }
        // What kAuto's decode steps ran, named in the case column.
        kda::layer::DecodeKernel auto_ran = kda::layer::DecodeKernel::kAuto;
        // The forwards of every layer captured in one graph, replayed: each replay timed with
        // events around it, per layer.
        auto forwards = [&](kda::layer::DecodeKernel kernel, int cluster) {
          return [&, kernel, cluster] {
            kda::layer::RunOptions capture_options;
            capture_options.stream = stream;
            capture_options.check_pointers = false;
            capture_options.decode_kernel = kernel;
            capture_options.fused_cluster = cluster;
            if (kernel == kda::layer::DecodeKernel::kAuto) {
              capture_options.decode_kernel_ran = &auto_ran;
            }
            for (int l = 0; l < instances; ++l) {
              layers[l]->forward(batch, static_cast<const kda::bf16_bits*>(d_hidden.ptr),
                                 static_cast<kda::bf16_bits*>(d_out.ptr), state_of(l),
                                 kda::Workspace{workspace.ptr, ws_bytes}, capture_options);
            }
          };
        };
        auto graph_replays = [&](kda::layer::DecodeKernel kernel, int cluster = 0) {
          return replay_per_layer(stream, instances, warmup, iters, forwards(kernel, cluster));
        };
        const double graph = graph_replays(kda::layer::DecodeKernel::kAuto);
        if (timeline) {
          int untimed = 0;
          const std::vector<KernelSpan> spans =
              traced_replay(stream, forwards(kda::layer::DecodeKernel::kAuto, 0), &untimed);
          timelines.push_back(timeline_table(
              "Timeline: " + layer_name + ", " + c.name + ", one graph replay of " +
                  std::to_string(instances) +
                  " layers (us from the first kernel's start; CUPTI's timestamps, which add to "
                  "each kernel's time)",
              spans, untimed));
        }
        if (c.decode && !graph_only) {
          char line[320];
          const auto fused = kda::layer::DecodeKernel::kFusedFactors;
          std::snprintf(line, sizeof line,
                        "| %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |",
                        layer_name.c_str(), c.name.c_str(), instances, graph, graph_replays(fused),
                        graph_replays(kda::layer::DecodeKernel::kFused),
                        graph_replays(kda::layer::DecodeKernel::kSeparate), graph_replays(fused, 1),
                        graph_replays(fused, 2), graph_replays(fused, 4), graph_replays(fused, 8));
          kernel_rows.push_back(line);
        }
        // Floors per phase, microseconds (see the top of this file).
        const std::int64_t W = config.conv_width;
        const double t = static_cast<double>(T), n = static_cast<double>(N);
        // The low-rank gate's factors: D columns of the fused projection and a [Cl, D] product;
        // the full-rank gate's: a [Cl, E] product of its own.
        const std::int64_t gate_a = config.full_rank_gate ? 0 : D;
        const double gate_k = static_cast<double>(config.full_rank_gate ? E : D);
        const double in_cols = static_cast<double>(3 * Cl + D + gate_a + Hl);
        const double stride = static_cast<double>((3 * Cl + D + gate_a + Hl + 7) / 8 * 8);
        auto us = [](double seconds) { return seconds * 1e6; };
        const double proj_flops = 2.0 * t * E * in_cols + 2.0 * t * D * Cl + 2.0 * t * gate_k * Cl;
        // Weights; hidden read and proj written; f_a|g_a read, g (bf16) and gate (f32) written.
        const double proj_bytes = 2.0 * (stride * E + Cl * D + Cl * gate_k) +
                                  2.0 * t * (E + stride) + 2.0 * t * (D + gate_a) + 2.0 * t * Cl +
                                  4.0 * t * Cl;
        const double conv_bytes = 2.0 * 2 * 3 * t * Cl + 2.0 * 2 * t * Hl +
                                  2.0 * 2 * 3 * n * Cl * (W - 1) + 4.0 * 3 * Cl * W;
        // Checkpoints write a recurrent state and three conv states each.
        const double checkpoint_bytes =
            static_cast<double>(N * K) * (static_cast<double>(Hl * D * D * state_bytes) +
                                          static_cast<double>(3 * Cl * (W - 1)) * 2);
        const double core_bytes =
            kda::bench::kda_core_bytes(t, n, static_cast<double>(Hl), static_cast<double>(D),
                                       static_cast<double>(state_bytes), c.decode) +
            checkpoint_bytes;
        const double norm_bytes = (2.0 + 4.0 + 2.0) * t * Cl;
        const double o_flops = 2.0 * t * Cl * E;
        const double o_bytes = 2.0 * E * Cl + 2.0 * t * Cl + 2.0 * t * E;
        const double floors[5] = {us(std::max(proj_flops / peak, proj_bytes / bw)),
                                  us(conv_bytes / bw), us(core_bytes / bw), us(norm_bytes / bw),
                                  us(std::max(o_flops / peak, o_bytes / bw))};
        double floor_sum = 0.0;
        for (double f : floors) floor_sum += f;
        if (c.checkpoint_every == 0 && !c.decode) plain_graph = graph;
        if (c.checkpoint_every != 0) {
          char line[256];
          std::snprintf(line, sizeof line, "| %s | %s | %lld | %.1f | %.1f | %.3f |",
                        layer_name.c_str(), c.name.c_str(), static_cast<long long>(N * K),
                        plain_graph, graph, graph / plain_graph);
          checkpoint_rows.push_back(line);
        }
        const std::string case_name =
            c.name + (auto_ran == kda::layer::DecodeKernel::kAuto
                          ? std::string()
                          : std::string(" (") + kda::layer::to_string(auto_ran) + ")");
        std::printf("| %s | %s | %.1f | %.1f | %.2fx | %.1f | %.2fx |", layer_name.c_str(),
                    case_name.c_str(), median(total), floor_sum, median(total) / floor_sum, graph,
                    graph / floor_sum);
        for (int p = 0; p < 5; ++p) std::printf(" %.1f (%.1f) |", median(phase[p]), floors[p]);
        std::printf("\n");
        std::fflush(stdout);
      }
      // Speculative verify steps of T = 1 + k tokens a row, both forms, every shape.
      if (graph_only) continue;
      // B = 1, 64 and 256, or the batch sizes asked for (--batch).
      const std::vector<std::int64_t> verify_batches =
          batches_wanted.empty() ? std::vector<std::int64_t>{1, 64, 256} : batches_wanted;
      for (const std::int64_t T : {std::int64_t{4}, std::int64_t{8}}) {
        for (const std::int64_t B : verify_batches) {
          const std::int64_t W = config.conv_width, tokens = B * T, pool = B * T;
          std::vector<kda::bf16_bits> hidden(static_cast<std::size_t>(tokens * E));
          std::mt19937 rng(11);
          std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
          for (kda::bf16_bits& h : hidden) h = kda::float_to_bf16(dist(rng));
          // Per-token states: row b keeps its states in slots b T .. b T + T - 1 and starts from
          // the one after its num_accepted; records: row b on slot b.
          std::vector<std::int32_t> per_token_slots(static_cast<std::size_t>(B * T)),
              record_slots(static_cast<std::size_t>(B)), accepted(static_cast<std::size_t>(B));
          for (std::int64_t b = 0; b < B; ++b) {
            record_slots[b] = static_cast<std::int32_t>(b);
            accepted[b] = static_cast<std::int32_t>(1 + (b * 7 + 3) % T);
            for (std::int64_t t = 0; t < T; ++t) {
              per_token_slots[b * T + t] = static_cast<std::int32_t>(b * T + t);
            }
          }
          DeviceMemory d_hidden(hidden.size() * 2), d_out(hidden.size() * 2);
          DeviceMemory d_pt(per_token_slots.size() * 4), d_rs(record_slots.size() * 4),
              d_na(accepted.size() * 4);
          CK(cudaMemcpy(d_hidden.ptr, hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(d_pt.ptr, per_token_slots.data(), per_token_slots.size() * 4,
                        cudaMemcpyHostToDevice));
          CK(cudaMemcpy(d_rs.ptr, record_slots.data(), record_slots.size() * 4,
                        cudaMemcpyHostToDevice));
          CK(cudaMemcpy(d_na.ptr, accepted.data(), accepted.size() * 4, cudaMemcpyHostToDevice));
          // records / conv_records: what a records step writes; fold_*: a second region, the
          // records step before's, that a folding step reads.
          struct VerifyState {
            DeviceMemory conv_q, conv_k, conv_v, recurrent, records, conv_records, fold_records,
                fold_conv_records;
            VerifyState(std::size_t conv, std::size_t rec, std::size_t records_bytes,
                        std::size_t conv_records_bytes)
                : conv_q(conv),
                  conv_k(conv),
                  conv_v(conv),
                  recurrent(rec),
                  records(records_bytes),
                  conv_records(conv_records_bytes),
                  fold_records(records_bytes),
                  fold_conv_records(conv_records_bytes) {}
          };
          std::vector<std::unique_ptr<VerifyState>> vs;
          std::vector<kda::layer::State> states;
          for (int l = 0; l < instances; ++l) {
            vs.push_back(std::make_unique<VerifyState>(
                static_cast<std::size_t>(pool * Cl * (W - 1) * 2),
                static_cast<std::size_t>(pool * Hl * D * D * state_bytes),
                static_cast<std::size_t>(tokens * Hl * 3 * D * 4),
                static_cast<std::size_t>(tokens * 3 * Cl * 2)));
            kda::layer::State st;
            st.num_slots = pool;
            st.conv_q = static_cast<kda::bf16_bits*>(vs.back()->conv_q.ptr);
            st.conv_k = static_cast<kda::bf16_bits*>(vs.back()->conv_k.ptr);
            st.conv_v = static_cast<kda::bf16_bits*>(vs.back()->conv_v.ptr);
            st.recurrent = vs.back()->recurrent.ptr;
            st.recurrent_dtype = state_dtype;
            st.recurrent_records = static_cast<float*>(vs.back()->records.ptr);
            st.conv_records = static_cast<kda::bf16_bits*>(vs.back()->conv_records.ptr);
            st.record_rows = tokens;
            states.push_back(st);
          }
          const std::size_t ws =
              kda::layer::workspace_bytes(kda::Backend::kCuda, config, tokens, B, pool);
          DeviceMemory workspace(ws);
          kda::layer::Batch per_token;
          per_token.tokens = tokens;
          per_token.sequences = B;
          per_token.decode_tokens = T;
          per_token.slots = static_cast<const std::int32_t*>(d_pt.ptr);
          per_token.num_accepted = static_cast<const std::int32_t*>(d_na.ptr);
          kda::layer::Batch records = per_token;
          records.slots = static_cast<const std::int32_t*>(d_rs.ptr);
          records.num_accepted = nullptr;
          records.records = true;
          kda::layer::CommitBatch commit;
          commit.sequences = B;
          commit.decode_tokens = T;
          commit.slots = static_cast<const std::int32_t*>(d_rs.ptr);
          commit.num_accepted = static_cast<const std::int32_t*>(d_na.ptr);
          // One graph of every layer's call (or of the one commit over all layers), replayed:
          // microseconds per layer.
          auto replay = [&](const std::function<void(const kda::layer::RunOptions&)>& enqueue) {
            kda::layer::RunOptions o;
            o.stream = stream;
            o.check_pointers = false;
            enqueue(o);  // eager once: checks the arguments outside the capture
            CK(cudaStreamSynchronize(stream));
            return replay_per_layer(stream, instances, warmup, iters, [&] { enqueue(o); });
          };
          auto layers_of = [&](const kda::layer::Batch& batch) {
            return [&, batch](kda::layer::RunOptions o) {
              o.decode_kernel = verify_kernel;
              for (int l = 0; l < instances; ++l) {
                layers[l]->forward(batch, static_cast<const kda::bf16_bits*>(d_hidden.ptr),
                                   static_cast<kda::bf16_bits*>(d_out.ptr), states[l],
                                   kda::Workspace{workspace.ptr, ws}, o);
              }
            };
          };
          // The plain step of the same T tokens a row (no verify): the committed slots updated.
          kda::layer::Batch plain = records;
          plain.records = false;
          const double plain_us = replay(layers_of(plain));
          const double pt_us = replay(layers_of(per_token));
          const double rec_us = replay(layers_of(records));
          const double commit_us = replay([&](const kda::layer::RunOptions& o) {
            kda::layer::commit(kda::Backend::kCuda, config, commit, states.data(), instances, o);
          });
          // The records step that folds the one before it (Batch::fold_sequences) instead of a
          // commit: the regions the records steps above wrote, copied into the fold regions.
          kda::layer::Batch folding = records;
          folding.fold_sequences = B;
          folding.fold_decode_tokens = T;
          folding.fold_rows = static_cast<const std::int32_t*>(d_rs.ptr);  // row b on slot b
          folding.fold_counts = static_cast<const std::int32_t*>(d_na.ptr);
          std::vector<kda::layer::State> fold_states = states;
          for (int l = 0; l < instances; ++l) {
            CK(cudaMemcpy(vs[l]->fold_records.ptr, vs[l]->records.ptr, vs[l]->records.bytes,
                          cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(vs[l]->fold_conv_records.ptr, vs[l]->conv_records.ptr,
                          vs[l]->conv_records.bytes, cudaMemcpyDeviceToDevice));
            fold_states[l].fold_recurrent_records =
                static_cast<const float*>(vs[l]->fold_records.ptr);
            fold_states[l].fold_conv_records =
                static_cast<const kda::bf16_bits*>(vs[l]->fold_conv_records.ptr);
          }
          const double fold_us = replay([&](kda::layer::RunOptions o) {
            o.decode_kernel = verify_kernel;
            for (int l = 0; l < instances; ++l) {
              layers[l]->forward(folding, static_cast<const kda::bf16_bits*>(d_hidden.ptr),
                                 static_cast<kda::bf16_bits*>(d_out.ptr), fold_states[l],
                                 kda::Workspace{workspace.ptr, ws}, o);
            }
          });
          char line[320];
          std::snprintf(line, sizeof line,
                        "| %s | %lld | %lld | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2fx | "
                        "%.2fx | %.2fx | %.2fx |",
                        layer_name.c_str(), static_cast<long long>(T), static_cast<long long>(B),
                        plain_us, pt_us, rec_us, commit_us, rec_us + commit_us, fold_us,
                        (rec_us + commit_us) / pt_us, fold_us / pt_us, rec_us / plain_us,
                        fold_us / plain_us);
          verify_rows.push_back(line);
        }
      }
    }
    if (!kernel_rows.empty()) {
      std::printf(
          "\nDecode steps by RunOptions::decode_kernel, graph replays per layer (us), same "
          "run:\n\n"
          "| layer | case | layers in the graph | auto | fused, factors inside | fused after "
          "GEMMs | separate | fused, factors inside, 1 block a head | 2 blocks | 4 blocks | 8 "
          "blocks |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    for (const std::string& row : kernel_rows) std::printf("%s\n", row.c_str());
    if (!checkpoint_rows.empty()) {
      std::printf(
          "\nPrefill checkpoints (recurrent and conv states), graph replays per layer (us), same "
          "run:\n\n| layer | case | requests | without | with | x without |\n"
          "|---|---|---:|---:|---:|---:|\n");
    }
    for (const std::string& row : checkpoint_rows) std::printf("%s\n", row.c_str());
    if (!verify_rows.empty()) {
      std::printf(
          "\nSpeculative verify steps, graph replays per layer (us), same run: per-token states "
          "(Batch::num_accepted) against records (Batch::records) and the commit over all the "
          "graph's layers in one call, the records step that folds the one before it instead of a "
          "commit (Batch::fold_sequences), and the plain step of the same T tokens a row; the "
          "steps' RunOptions::decode_kernel %s:\n\n| "
          "layer | T | B | plain step | per-token states | records step | commit | records + "
          "commit | records step, folding | records + commit / per-token | folding / per-token | "
          "records step / plain | folding / plain |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
          kda::layer::to_string(verify_kernel));
    }
    for (const std::string& row : verify_rows) std::printf("%s\n", row.c_str());
    for (const std::string& table : timelines) std::printf("%s", table.c_str());
    cudaStreamDestroy(stream);
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "kda-layer-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
