// layer/src/layer_cuda.cpp — the whole KDA layer on CUDA: cuBLAS projections, the fused conv and
// gated-norm kernels (layer/src/cuda/), the operator's CUDA core. The workspace and weight image
// layouts and every check that needs no device are plain C++ and built everywhere; the rest needs
// KDA_HAVE_CUDA (a CPU-only build's make_cuda_layer() says so).
//
//   projections  x·[W_q; W_k; W_v; W_fa; W_ga; W_b]ᵀ as one GEMM, then the two low-rank second
//                factors; with a full-rank gate x·[W_q; W_k; W_v; W_fa; W_b]ᵀ, f_a·W_fbᵀ and the
//                gate's own GEMM x·W_gᵀ (f32 out, as g_a·W_gbᵀ). cuBLASLt (bf16 in, fp32
//                accumulation, CUBLAS_COMPUTE_32F), or for batches of one token (decode of one
//                sequence) the small-row kernel of cuda/small_gemm.cu; a decode step of up to
//                kConvFactorMaxTiles tiles (kConvFactorMaxTilesOneToken at one token a row)
//                computes the second factors in the conv's launch
//   conv         one fused kernel: causal conv + SiLU of q, k, v from and to the conv states
//   core         kda::forward_cuda (prefill) or the operator's decode step (decode), states in
//                the pool; a decode step runs the gated RMSNorm as its epilogue, or stores o
//                and runs the norm's kernel after it (cuda/decode_norm.cu)
//   norm         prefill: one fused kernel, gated RMSNorm
//   decode       conv, the low-rank second factors (RunOptions::decode_kernel), core and norm in
//                one kernel instead (cuda/fused_decode.cu)
//   o_proj       as the projections

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "aligned_regions.hpp"
#include "backends.hpp"
#include "checks.hpp"
#include "cuda/one_launch_exchange.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/error.hpp"
#include "kda/nvtx.hpp"
#include "workspace_layout.hpp"

#ifdef KDA_HAVE_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"  // cuda_status, current_device_sm_count (kda/src/cuda)
#include "cuda/kernels.hpp"
static_assert(kda::layer::cuda::kOneLaunchSyncWords == 4, "the weight image's step sync words");
#if defined(KDA_HAVE_NVTX) && !defined(NVTX_DISABLE)
#include <nvtx3/nvToolsExtMemCudaRt.h>
#endif
#endif

namespace kda::layer::detail {

namespace {

// cuBLAS wants its workspace and its matrices 256-byte aligned; so do the weight image's tensors.
constexpr std::size_t kAlignment = kCudaWeightImageAlignment;

using kda::detail::align_up;

// Byte offsets of the weight image's tensors from its kAlignment-aligned base: the one layout that
// weight_image_bytes() sizes and the constructors fill.
struct WeightLayout {
  std::size_t w_in = 0;     // bf16 [proj_stride, E]: q | k | v | f_a | g_a | b | zero rows
  std::size_t w_fb = 0;     // bf16 [Cl, D]
  std::size_t w_gb = 0;     // bf16 [Cl, D]: the low-rank gate's second factor, or
  std::size_t w_g = 0;      // bf16 [Cl, E]: the full-rank gate (w_in then has no g_a rows)
  std::size_t g_bias = 0;   // bf16 [Cl]; its place is kept when the layer has no bias
  std::size_t conv = 0;     // f32 [3 Cl, W]: q | k | v
  std::size_t A_log = 0;    // f32 [Hl]
  std::size_t dt_bias = 0;  // f32 [Cl]
  std::size_t o_norm = 0;   // f32 [D], widened
  std::size_t w_o = 0;      // bf16 [E, Cl]
  // u32 [kStepSyncWords] and u64 [step exchange words]: the one-launch decode step's own state
  // between its launches (cuda/one_launch_step.cu), written as zeros with the weights.
  std::size_t step_sync = 0;
  std::size_t step_exchange = 0;
  std::size_t total = 0;
};
constexpr std::int64_t kStepSyncWords = 4;

// The one-launch step's exchange words: for the rows it projects (q | k | v | f_a | g_a | beta) of
// as many sequences as a step of the layer's heads takes.
std::int64_t step_exchange_words(const Config& c) {
  return cuda::one_launch_exchange_words(cuda::one_launch_max_rows(c.local_heads()),
                                         proj_columns(c).b + c.local_heads(), c.local_channels(),
                                         c.full_rank_gate);
}

WeightLayout make_weight_layout(const Config& c) {
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Cl = c.local_channels();
  AlignedRegions regions("KDA layer (CUDA) weight image size", kAlignment);
  WeightLayout layout;
  layout.w_in = regions.take(regions.bytes_of(proj_columns(c).stride, E, 2));
  layout.w_fb = regions.take(regions.bytes_of(Cl, D, 2));
  if (c.full_rank_gate) {
    layout.w_g = regions.take(regions.bytes_of(Cl, E, 2));
  } else {
    layout.w_gb = regions.take(regions.bytes_of(Cl, D, 2));
  }
  layout.g_bias = regions.take(regions.bytes_of(Cl, 1, 2));
  layout.conv = regions.take(regions.bytes_of(3 * Cl, W, 4));
  layout.A_log = regions.take(regions.bytes_of(c.local_heads(), 1, 4));
  layout.dt_bias = regions.take(regions.bytes_of(Cl, 1, 4));
  layout.o_norm = regions.take(regions.bytes_of(D, 1, 4));
  layout.w_o = regions.take(regions.bytes_of(E, Cl, 2));
  layout.step_sync = regions.take(regions.bytes_of(kStepSyncWords, 1, 4));
  layout.step_exchange = regions.take(regions.bytes_of(step_exchange_words(c), 1, 8));
  layout.total = regions.end();
  return layout;
}

// The CUDA path's limits, as a status (can_implement) and as the throw of make_cuda_layer(): the
// model's first (kUnsupported wherever it runs), then the build's (kBackendUnavailable), as the
// operator orders them, so that a caller planning for CUDA on any machine tells the two apart.
Status cuda_limits(const Config& c) {
  if (c.head_dim != 128) {
    return Status(StatusCode::kUnsupported,
                  "KDA layer (CUDA): head_dim " + std::to_string(c.head_dim) +
                      " is not 128 (the CUDA core and the gated-norm kernel run D = 128)");
  }
  if (c.conv_width < 2 || c.conv_width > 4) {
    return Status(StatusCode::kUnsupported, "KDA layer (CUDA): conv_width " +
                                                std::to_string(c.conv_width) +
                                                " is not in [2, 4] (the conv kernels' widths)");
  }
  if (!cuda_compiled()) {
    return Status(
        StatusCode::kBackendUnavailable,
        "KDA layer (CUDA): this build has no CUDA backend (configure with -DKDA_CUDA=ON)");
  }
  return Status::Ok();
}

// The checks the CPU layer makes on the weights, plus the CUDA path's limits.
void check_weights(const Weights& w) {
  check_sizes(w);
  throw_if_error(cuda_limits(w.config));
  check_gate_weights(w);
}

}  // namespace

Status cuda_can_implement(const Config& config) { return cuda_limits(config); }

std::size_t cuda_workspace_bytes(const Config& config, std::int64_t tokens, std::int64_t sequences,
                                 std::int64_t num_slots) {
  validate(config);
  return make_workspace_layout(Backend::kCuda, config, tokens, sequences, num_slots).total;
}

std::size_t cuda_weight_image_bytes(const Config& config) {
  validate(config);
  return make_weight_layout(config).total;
}

#ifndef KDA_HAVE_CUDA

std::unique_ptr<Layer> make_cuda_layer(const Weights& weights, void*, std::size_t) {
  check_weights(weights);  // kBackendUnavailable
  return nullptr;
}
std::unique_ptr<Layer> make_cuda_layer(const Weights& weights) {
  check_weights(weights);
  return nullptr;
}

#else  // KDA_HAVE_CUDA

namespace {

// kda's rule for a failed CUDA call (kda/src/cuda/cuda_check.hpp): the runtime's last error read
// and cleared, cudaMalloc's refusal kOutOfMemory.
void check_cuda(cudaError_t err, const char* what) {
  throw_if_error(kda::detail::cuda_status(err, what), "KDA layer (CUDA)");
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(StatusCode::kCudaError,
                std::string("KDA layer (CUDA): ") + what + ": " + cublasGetStatusString(status));
  }
}

// compute-sanitizer's initcheck does not see the writes of cuBLAS's Hopper kernels (a GEMM into a
// fresh buffer, then a kernel reading it, reports every read as uninitialized; a cudaMemset before
// the GEMM silences it: measured on the H200, docs/SANITIZERS.md). So each GEMM's output range is
// declared initialized through the NVTX memory API, which costs nothing when no tool is attached.
void mark_initialized(cudaStream_t stream, const void* ptr, std::size_t bytes) {
#if defined(KDA_HAVE_NVTX) && !defined(NVTX_DISABLE)
  const nvtxMemVirtualRangeDesc_t range{bytes, ptr};
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof(batch);
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof(range);
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(nvtx3::domain::get<kda::nvtx_domain>(), stream, 0, &batch);
#else
  (void)stream, (void)ptr, (void)bytes;
#endif
}

// The benchmark's knobs for the layer's decode GEMMs: environment variables read once a process,
// for A/B runs of kernels not (or not yet) the default; not part of the contract.
enum class SmallGemmChoice { kSliced, kStreamed, kCublas, kWarpgroup };
struct GemmKnobs {
  // KDA_LAYER_SMALL_GEMM: unset, one row on the sliced kernel, 2 to 8 rows of up to kFragmentMaxK
  // columns on the fragment kernel and the rest on cuBLAS; "streamed", one row on the streamed
  // kernel and 2 to 64 rows on the tiled one (where they take the shape; else as unset); "0",
  // cuBLAS for every GEMM; "warpgroup", every GEMM of 2 to 256 rows on the warpgroup kernel
  // (warpgroup_gemm.cu), "warpgroup9" those of 9 to 256 (the rest as unset). Neither the streamed
  // nor the tiled kernel is the
  // default: on the H200 neither beat the sliced kernel or cuBLAS inside the layer
  // (docs/PERFORMANCE.md).
  SmallGemmChoice choice = SmallGemmChoice::kSliced;
  std::int64_t warpgroup_min_rows = 2;
  // KDA_LAYER_SLICED_SPLIT: 1, 2, 4 or 8 forces the sliced kernel's slices a weight row
  // (SmallGemmParams::split) for every one-row GEMM; anything else (or unset) chooses by shape.
  int split = 0;
  // KDA_LAYER_PROGRAMMATIC_INPUT=1: a one-row input projection is launched as a programmatic
  // dependent of the kernel before it in the stream, so that its first round of weight loads is
  // in flight while that kernel (in a model, the layer before) drains; it reads the hidden row only
  // after griddepcontrol.wait. Not yet measured inside the layer. Not safe with the fused decode
  // step, which loads its states before its own wait: with every launch programmatic, a layer's
  // step may then start before its previous step's kernels have completed.
  bool programmatic_input = false;
  // KDA_LAYER_INPUT_GEMM / KDA_LAYER_OUTPUT_GEMM: the input projection alone (the first GEMM of a
  // step) / o_proj alone on "cublas", on the sliced kernel at "split2", or (one row) on the
  // streamed kernel ("streamed": o_proj's weights stream into shared memory while the fused step
  // before it runs); anything else (or unset): as every other GEMM. For measuring inside the layer
  // what kda-gemv-probe's chain table showed: after a kernel that writes its input, cuBLAS took the
  // H = 32 one-row input projection in 17.4 us against the sliced kernel's 19.3 and K3's o_proj
  // in 8.4 against 9.7, split 2 the TP8 shard's input projection in 4.6 against 5.7 (each worse
  // elsewhere).
  enum class SiteGemm { kAsOthers, kCublas, kSplit2, kStreamed };
  SiteGemm input = SiteGemm::kAsOthers, output = SiteGemm::kAsOthers;
  // KDA_LAYER_FUSED_LATE_DEPENDENTS=1: the fused decode step lets o_proj start only after its own
  // wait for the projection (FusedDecodeParams::late_dependents). With the streamed o_proj, whose
  // blocks start its weights' reads at once, this keeps them from queuing with the step's loads.
  bool fused_late_dependents = false;
  // KDA_LAYER_SIDE_GEMMS=0: a decode step's output gate and second factors by GEMMs on the
  // forward's stream before the conv, as every other GEMM, rather than on the layer's side stream
  // beside the conv (for measuring what the side stream gives).
  bool side_gemms = true;
  // KDA_LAYER_CUBLAS_API=gemmex: the GEMMs past the small-row kernels through cublasGemmEx rather
  // than cuBLASLt (lt_gemm), for measuring what each costs the host and the GPU.
  bool cublas_lt = true;
};
const GemmKnobs& gemm_knobs() {
  static const GemmKnobs knobs = [] {
    auto value = [](const char* name) {
      const char* env = std::getenv(name);
      return env == nullptr ? std::string() : std::string(env);
    };
    GemmKnobs k;
    const std::string choice = value("KDA_LAYER_SMALL_GEMM");
    k.choice = choice == "0"                                     ? SmallGemmChoice::kCublas
               : choice == "streamed"                            ? SmallGemmChoice::kStreamed
               : choice == "warpgroup" || choice == "warpgroup9" ? SmallGemmChoice::kWarpgroup
                                                                 : SmallGemmChoice::kSliced;
    if (choice == "warpgroup9") k.warpgroup_min_rows = 9;
    const std::string split = value("KDA_LAYER_SLICED_SPLIT");
    if (split == "1" || split == "2" || split == "4" || split == "8") k.split = std::stoi(split);
    k.programmatic_input = value("KDA_LAYER_PROGRAMMATIC_INPUT") == "1";
    auto site = [&](const char* name) {
      const std::string v = value(name);
      return v == "cublas"     ? GemmKnobs::SiteGemm::kCublas
             : v == "split2"   ? GemmKnobs::SiteGemm::kSplit2
             : v == "streamed" ? GemmKnobs::SiteGemm::kStreamed
                               : GemmKnobs::SiteGemm::kAsOthers;
    };
    k.input = site("KDA_LAYER_INPUT_GEMM");
    k.output = site("KDA_LAYER_OUTPUT_GEMM");
    k.fused_late_dependents = value("KDA_LAYER_FUSED_LATE_DEPENDENTS") == "1";
    k.side_gemms = value("KDA_LAYER_SIDE_GEMMS") != "0";
    k.cublas_lt = value("KDA_LAYER_CUBLAS_API") != "gemmex";
    return k;
  }();
  return knobs;
}

// Up to how many (row, head) blocks DecodeKernel::kAuto runs the fused kernel, with the low-rank
// second factors inside it: about one block per multiprocessor, where a step is bound by latency
// and every launch saved counts. Above, the separate kernels: their decode kernel keeps more state
// loads in flight than the fused one, whose blocks also read their head's 64 KB of W_fb and W_gb.
// A step of one token a row takes it over fewer pairs: with an fp32 state up to 32, and with the
// full-rank output gate never (the separate kernels run that gate's GEMM on the side stream
// beside the conv). Measured on the H200 (kda-layer-bench --decode-only, the table by decode
// kernel, graph replays per layer, fp32 state), fused against separate: H = 32 B = 2 / 3 / 4
// (64-128 pairs) 41.3 / 44.6 / 46.1 against 37.7 / 39.1 / 40.2 us, the TP8 shard B = 12-32
// (48-128 pairs) 23.0-26.7 against 20.9-23.9 but B = 2-8 (8-32 pairs) 15.7-19.2 against
// 17.2-20.1, K3's shard B = 2-8 (24-96 pairs) 49.6-57.1 against 47.3-50.3 (bf16 state 47.8-50.9
// against 46.8-48.2); with a bf16 state and the low-rank gate the fused kernel held its own up to
// 128 pairs (H = 32 B = 2 35.3 against 36.7, B = 3-8 within 0.4 us; the TP8 shard B = 12 / 16 18.9
// / 19.4 against 20.0 / 20.3).
constexpr std::int64_t kFusedDecodeMaxBlocks = 128;
constexpr std::int64_t kFusedOneTokenF32MaxBlocks = 32;

// A step of several tokens a row never takes the fused kernel under kAuto: the fused kernel's
// blocks run their tokens one after the other with a head's whole state each, where the separate
// core cuts a head into several blocks and the norm runs over every token at once. Measured on the
// H200 (kda-layer-bench --decode-only --verify-kernel fused, then separate, T = 4 and 8, two
// rounds, graph replays per layer), fused over separate for the plain step, per-token states, the
// records step and the folding step within the 128 pairs: at B = 2-48 H = 32 1.14-1.63x with an
// fp32 state and 1.10-1.33x with a bf16 one, the TP8 shard 0.98-2.01x and 0.98-1.60x (below 1
// only the folding step at B = 3 and 6, T = 4), K3's shard 1.01-1.52x and 1.02-1.34x; at B = 1
// 1.03-1.60x with an fp32 state (H = 32 T = 4 plain 48.7 against 41.7 us, T = 8 64.1 against
// 47.9; the TP8 shard T = 8 41.8 against 27.9) and 0.99-1.53x with a bf16 one (below 1 only K3's
// folding step at T = 4, 58.0 against 58.2 and 58.8).
bool auto_runs_fused(const Config& c, std::int64_t rows, std::int64_t heads,
                     std::int64_t decode_tokens, DType state_dtype) {
  const std::int64_t pairs = rows * heads;
  if (decode_tokens != 1) return false;
  if (c.full_rank_gate) return false;
  return pairs <= (state_dtype == DType::kF32 ? kFusedOneTokenF32MaxBlocks : kFusedDecodeMaxBlocks);
}

// Up to how many warp tiles (16 rows x 16 channels) of each low-rank second factor a decode step
// computes them in the conv's launch (conv_decode.cu) instead of two GEMMs. The GEMMs cost about
// 3.3 us each whatever the rows (launch and latency); the tiles cost the conv's launch about 1 ns
// each (their inputs and weights from L2). Measured on the H200 (kda-layer-bench, graph replays per
// layer, against the GEMMs): H = 32 B = 64 (1024 tiles a factor) 118.5 against 124.4 us, the TP8
// shard B = 256 (512) 61.8 against 68.6, K3's shard B = 256 (1536, f_b alone) 184.7 against 186.9;
// H = 32 B = 256 (4096) 351.5 against 353.2, the conv then 34.2 against 25.5 us.
// A step of one token a row takes them up to 4096 tiles (H = 32 up to B = 256), since the GEMMs
// moved to the side stream beside the conv: there the second GEMM's blocks wait for the conv's
// last wave, and the core for them. Graph replays per layer, one H200, 2026-12-05, three rounds
// alternating, 4096 against 2048, us: H = 32 B = 136 / 160 / 192 / 224 / 256 201.3-201.9 /
// 231.7-232.1 / 267.2-267.6 / 306.1-306.5 / 342.8-343.2 against 203.9-204.3 / 233.6-234.0 /
// 268.9-269.1 / 306.8-307.5 / 343.0-344.0 (fp32 state), 134.2-134.4 / 153.0-153.6 / 173.1-173.4 /
// 196.4-196.9 / 218.3-218.5 against 136.6-136.9 / 155.4-156.8 / 175.1-175.4 / 197.1-197.8 /
// 218.8-218.9 (bf16). Steps of several tokens a row keep 2048: at 256 tokens (B = 64 T = 4, B =
// 32 T = 8) the plain, records and folding steps took 0.7-1.9 us more with 4096.
constexpr std::int64_t kConvFactorMaxTiles = 2048;
constexpr std::int64_t kConvFactorMaxTilesOneToken = 4096;

// The fused step's blocks a (row, head) for RunOptions::fused_cluster 0: the most of 1, 2, 4 and 8
// that keep every block on a multiprocessor of its own. A step of few rows is bound by each
// multiprocessor's latency, so spreading a head's state over more of them pays until they run
// out. Measured on the H200 (132 multiprocessors; kda-layer-bench, graph replays per layer, the
// run of docs/PERFORMANCE.md): H = 32 B = 1 (4 a head) 40.4 us against 48.0 with one; the TP8
// shard (H = 4) B = 1 (8) 15.5 against 22.7, B = 8 (4) 21.9 against 24.3; K3's TP8 shard B = 1 (8)
// 55.0 against 64.9; at 256 pairs (H = 32 B = 8, run separate by kAuto) 2 a head already 66.8
// against 62.2.
int fused_cluster_for(std::int64_t pairs, int multiprocessors) {
  int cluster = 1;
  while (cluster < 8 && pairs * cluster * 2 <= multiprocessors) cluster *= 2;
  return cluster;
}

// Up to how many input columns a GEMM of 2..8 rows runs on the fragment kernel (small_gemm.cu)
// rather than cuBLAS. Measured on the H200 (kda-gemv-probe, after a kernel that writes the input,
// 8 rows, us): it won on every decode shape of at most 2304 columns: H = 32's input projection
// (2304) 16.2 against 17.5, the TP8 shard's 5.8 against 6.4 and its o_proj (512) 3.2 against 3.9,
// K3's TP8 o_proj (1536) 8.0 against 8.3; not on the longer rows: H = 32's o_proj (4096) 10.1
// against 9.9, K3's input projection (7168) 23.1 against 23.2 and its gate 12.0 against 10.6. Why
// the longer rows lose was not measured.
constexpr std::int64_t kFragmentMaxK = 2304;
// Up to how many bytes of weights the fragment kernel is launched as a programmatic dependent where
// the call asks for it (o_proj after the fused step); heavier ones are launched plainly. Its blocks
// then start while the step runs and load their first round of weights before waiting. Measured on
// the H200 (graph replays per layer, two rounds, against plain launches): the TP8 shard's o_proj
// (2.4 MB) B = 2 / 4 / 8 15.5 / 16.8 / 19.0 us against 17.1 / 18.1-18.2 / 20.7; K3's TP8 o_proj
// (22 MB) B = 8 60.8-60.9 against 57.4-57.5 (B = 2 / 4 50.2 / 52.8-52.9 against 49.2-49.4 /
// 52.5-52.7). Between the two, not measured.
constexpr std::int64_t kFragmentProgrammaticMaxWeightBytes = std::int64_t{8} << 20;

// A layer's cuBLASLt handle and the algorithms its heuristic chose for the GEMMs the layer ran:
// each entry one GEMM's shape (rows included: a prefill's vary by call) and its operands'
// alignments, a few entries replaced in turn, so that a forward asks the heuristic only for shapes
// it has not seen lately, and allocates nothing.
struct LtGemms {
  struct Entry {
    std::int64_t rows = -1, n_in = 0, n_out = 0, ldi = 0, ldo = 0;
    cudaDataType out_type = CUDA_R_16BF;
    unsigned alignment_in = 0, alignment_weight = 0, alignment_out = 0;
    cublasLtMatmulAlgo_t algo{};
  };
  cublasLtHandle_t handle = nullptr;
  // Room for the layer's 2-4 GEMM shapes at 32-64 row counts. A row count not there asks the
  // heuristic (0.6-1.1 us of host time a GEMM beside cublasLtMatmul's 6.4-8.7, one H100), so an
  // eager prefill of a new length pays about a microsecond a GEMM once.
  Entry entries[128];
  int next = 0;  // the entry replaced next
};

// Where a forward's GEMMs run: cuBLASLt's handle and the algorithms chosen (`lt`; or, with
// KDA_LAYER_CUBLAS_API=gemmex, cuBLAS's handle, its workspace set to `scratch`), the stream, and
// the same scratch for cuBLAS and the small-row kernels' partial sums (one GEMM at a time on the
// stream).
struct GemmContext {
  cublasHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  void* scratch = nullptr;
  std::size_t scratch_bytes = 0;
  LtGemms* lt = nullptr;
};

// The largest power of two (up to 256) that divides the address: what cuBLASLt's heuristic is told
// of each operand's alignment, since it assumes 256 bytes unless told otherwise and an operand at
// a column offset of the fused projection's rows has less.
unsigned address_alignment(const void* ptr) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  unsigned alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// One GEMM as cuBLASLt states it, built in place (the descriptors are opaque storage a handle
// points at, neither copied nor moved): column-major, as gemm() states it, the weight [n_in x
// n_out] (ld n_in) transposed, the input [n_in x rows] (ld ldi), the output [n_out x rows] (ld
// ldo).
struct LtDescriptors {
  cublasLtMatmulDescOpaque_t desc_storage;
  cublasLtMatrixLayoutOpaque_t a_storage, b_storage, c_storage;
  const cublasLtMatmulDesc_t desc = &desc_storage;
  const cublasLtMatrixLayout_t a = &a_storage, b = &b_storage, c = &c_storage;

  LtDescriptors(const cuda::SmallGemmParams& p, const char* what) {
    check_cublas(cublasLtMatmulDescInit(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
    const cublasOperation_t transpose = CUBLAS_OP_T;
    check_cublas(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                sizeof(transpose)),
                 what);
    check_cublas(cublasLtMatrixLayoutInit(a, CUDA_R_16BF, static_cast<std::uint64_t>(p.k),
                                          static_cast<std::uint64_t>(p.n), p.k),
                 what);
    check_cublas(cublasLtMatrixLayoutInit(b, CUDA_R_16BF, static_cast<std::uint64_t>(p.k),
                                          static_cast<std::uint64_t>(p.rows), p.ldi),
                 what);
    check_cublas(cublasLtMatrixLayoutInit(c, p.out_f32 ? CUDA_R_32F : CUDA_R_16BF,
                                          static_cast<std::uint64_t>(p.n),
                                          static_cast<std::uint64_t>(p.rows), p.ldo),
                 what);
  }
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
};

// The algorithm cuBLASLt runs the GEMM `p` with: `lt`'s entry for its shape (rows, columns,
// strides, out type) and operands' alignments or, for one not there, the heuristic's first choice
// within the scratch (kept in the entry replaced next). Throws where cuBLASLt has none.
cublasLtMatmulAlgo_t lt_algorithm(const GemmContext& context, const cuda::SmallGemmParams& p,
                                  const char* what) {
  LtGemms& lt = *context.lt;
  const cudaDataType out_type = p.out_f32 ? CUDA_R_32F : CUDA_R_16BF;
  const unsigned alignment_in = address_alignment(p.in),
                 alignment_weight = address_alignment(p.weight),
                 alignment_out = address_alignment(p.out);
  for (const LtGemms::Entry& e : lt.entries) {
    if (e.rows == p.rows && e.n_in == p.k && e.n_out == p.n && e.ldi == p.ldi && e.ldo == p.ldo &&
        e.out_type == out_type && e.alignment_in == alignment_in &&
        e.alignment_weight == alignment_weight && e.alignment_out == alignment_out) {
      return e.algo;
    }
  }
  const LtDescriptors gemm_descriptors(p, what);
  cublasLtMatmulPreferenceOpaque_t preference_storage;
  const cublasLtMatmulPreference_t preference = &preference_storage;
  check_cublas(cublasLtMatmulPreferenceInit(preference), what);
  const std::uint64_t workspace_bytes = context.scratch_bytes;
  check_cublas(
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes)),
      what);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_weight},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_in},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_out}};
  for (const auto& [attribute, value] : alignments) {
    check_cublas(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)),
                 what);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t asked = cublasLtMatmulAlgoGetHeuristic(
      lt.handle, gemm_descriptors.desc, gemm_descriptors.a, gemm_descriptors.b, gemm_descriptors.c,
      gemm_descriptors.c, preference, 1, &result, &found);
  if (asked != CUBLAS_STATUS_NOT_SUPPORTED) check_cublas(asked, what);
  if (asked == CUBLAS_STATUS_NOT_SUPPORTED || found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
    throw Error(StatusCode::kCudaError,
                std::string("KDA layer (CUDA): ") + what + ": cuBLASLt has no algorithm for it");
  }
  LtGemms::Entry& e = lt.entries[lt.next];
  lt.next = (lt.next + 1) % static_cast<int>(std::size(lt.entries));
  e = LtGemms::Entry{p.rows,        p.k,        p.n,          p.ldi,
                     p.ldo,         out_type,   alignment_in, alignment_weight,
                     alignment_out, result.algo};
  return e.algo;
}

// Which kernel one GEMM runs on, and its operands: a small-row kernel's launch (`small`), or
// cuBLAS's, with cuBLASLt the algorithm chosen for it. Choosing is the part that can fail for want
// of an algorithm, so a forward chooses its o_proj's before the conv writes any state.
struct GemmPlan {
  cuda::SmallGemmParams params;  // the operands; with `small`, the whole launch
  bool small = false;
  cublasLtMatmulAlgo_t algo{};  // cuBLASLt's, where it runs it
};

// out[rows, n_out] (row stride ldo) = in[rows, n_in] (row stride ldi) · weight[n_out, n_in]ᵀ:
// bf16 operands, fp32 accumulation, bf16 or f32 out. In cuBLAS's column-major terms this is
// outᵀ = weightᵀᵀ · inᵀ, i.e. op(A) = T on the row-major weight.
// Few rows on the small-row kernels (gemm_knobs()), the rest on cuBLAS; `programmatic` launches
// a small-row kernel as a programmatic dependent of the kernel before it; `site`: the knob of the
// call site (GemmKnobs::input, ::output), if any. Enqueues nothing: run_gemm() does.
GemmPlan plan_gemm(const GemmContext& context, const void* in, std::int64_t ldi, std::int64_t rows,
                   std::int64_t n_in, const void* weight, std::int64_t n_out, void* out,
                   cudaDataType out_type, std::int64_t ldo, const char* what,
                   bool programmatic = false,
                   GemmKnobs::SiteGemm site = GemmKnobs::SiteGemm::kAsOthers) {
  GemmPlan plan;
  cuda::SmallGemmParams& small = plan.params;
  small.workspace = context.scratch;
  small.workspace_bytes = context.scratch_bytes;
  small.programmatic = programmatic;
  small.in = static_cast<const std::uint16_t*>(in);
  small.ldi = ldi;
  small.weight = static_cast<const std::uint16_t*>(weight);
  small.out = out;
  small.ldo = ldo;
  small.out_f32 = out_type == CUDA_R_32F;
  small.rows = rows;
  small.n = n_out;
  small.k = n_in;
  small.split = gemm_knobs().split;
  plan.small = true;
  SmallGemmChoice choice = gemm_knobs().choice;
  if (site == GemmKnobs::SiteGemm::kCublas) choice = SmallGemmChoice::kCublas;
  if (site == GemmKnobs::SiteGemm::kSplit2) {
    choice = SmallGemmChoice::kSliced;
    small.split = 2;
  }
  if (site == GemmKnobs::SiteGemm::kStreamed && rows == 1) choice = SmallGemmChoice::kStreamed;
  if (choice == SmallGemmChoice::kWarpgroup && rows >= gemm_knobs().warpgroup_min_rows) {
    small.kernel = cuda::SmallGemmKernel::kWarpgroup;
    if (cuda::warpgroup_gemm_fits(small)) return plan;
  }
  if (choice == SmallGemmChoice::kWarpgroup) choice = SmallGemmChoice::kSliced;
  if (choice == SmallGemmChoice::kSliced && rows > 1 && n_in <= kFragmentMaxK) {
    small.kernel = cuda::SmallGemmKernel::kFragment;
    const int split = small.split;
    small.split = 0;  // KDA_LAYER_SLICED_SPLIT is the one-row kernel's
    if (cuda::fragment_gemm_fits(small)) {
      small.programmatic = programmatic && n_out * n_in * 2 <= kFragmentProgrammaticMaxWeightBytes;
      return plan;
    }
    small.split = split;
  }
  if (choice == SmallGemmChoice::kStreamed && rows > 1) {
    small.kernel = cuda::SmallGemmKernel::kTiled;
    if (cuda::tiled_gemm_fits(small)) return plan;
  }
  small.kernel = cuda::SmallGemmKernel::kSliced;
  if (choice != SmallGemmChoice::kCublas && cuda::small_gemm_fits(small)) {
    if (choice == SmallGemmChoice::kStreamed && cuda::streamed_gemm_fits(small)) {
      small.kernel = cuda::SmallGemmKernel::kStreamed;
    }
    return plan;
  }
  plan.small = false;
  if (context.lt != nullptr && rows > 0) plan.algo = lt_algorithm(context, small, what);
  return plan;
}

// Enqueues the GEMM `plan` on the context's stream.
void run_gemm(const GemmContext& context, const GemmPlan& plan, const char* what) {
  const cuda::SmallGemmParams& p = plan.params;
  if (plan.small) {
    check_cuda(cuda::launch_small_gemm(p, context.stream), what);
    return;
  }
  if (p.rows == 0) return;
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType out_type = p.out_f32 ? CUDA_R_32F : CUDA_R_16BF;
  if (context.lt != nullptr) {
    const LtDescriptors d(p, what);
    check_cublas(cublasLtMatmul(context.lt->handle, d.desc, &one, p.weight, d.a, p.in, d.b, &zero,
                                p.out, d.c, p.out, d.c, &plan.algo, context.scratch,
                                context.scratch_bytes, context.stream),
                 what);
  } else {
    check_cublas(cublasGemmEx(context.handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(p.n),
                              static_cast<int>(p.rows), static_cast<int>(p.k), &one, p.weight,
                              CUDA_R_16BF, static_cast<int>(p.k), p.in, CUDA_R_16BF,
                              static_cast<int>(p.ldi), &zero, p.out, out_type,
                              static_cast<int>(p.ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 what);
  }
  const std::size_t element = p.out_f32 ? 4 : 2;
  mark_initialized(context.stream, p.out,
                   static_cast<std::size_t>((p.rows - 1) * p.ldo + p.n) * element);
}

// plan_gemm() and run_gemm() at once: for the GEMMs enqueued before any state is written.
void gemm(const GemmContext& context, const void* in, std::int64_t ldi, std::int64_t rows,
          std::int64_t n_in, const void* weight, std::int64_t n_out, void* out,
          cudaDataType out_type, std::int64_t ldo, const char* what, bool programmatic = false,
          GemmKnobs::SiteGemm site = GemmKnobs::SiteGemm::kAsOthers) {
  run_gemm(context,
           plan_gemm(context, in, ldi, rows, n_in, weight, n_out, out, out_type, ldo, what,
                     programmatic, site),
           what);
}

// Gives `handle` the stream and workspace of `context`: cublasSetStream resets the workspace to
// cuBLAS's own pool, so the workspace is set after it. Nothing for cuBLASLt.
void bind_cublas(const GemmContext& context) {
  if (context.lt != nullptr) return;  // cuBLASLt takes both with each call
  check_cublas(cublasSetStream(context.handle, context.stream), "cublasSetStream");
  check_cublas(cublasSetWorkspace(context.handle, context.scratch, context.scratch_bytes),
               "cublasSetWorkspace");
}

// A CUDA device is present and one the operator supports.
void require_device() {
  if (cuda_device_count() <= 0) {
    throw Error(StatusCode::kBackendUnavailable, "KDA layer (CUDA): no CUDA device is present");
  }
  throw_if_error(cuda_device_supported(), "KDA layer (CUDA)");
}

}  // namespace

class CudaLayer final : public Layer {
 public:
  // Checks everything that needs no device first, then the caller's region (or, with `allocate`,
  // allocates the layer's own), then writes the image and creates the handle and the events.
  CudaLayer(const Weights& w, void* weight_image, std::size_t bytes, bool allocate)
      : Layer(w.config, cuda_weight_image_bytes(w.config)) {
    check_weights(w);
    if (allocate) {
      require_device();
      check_cuda(cudaMalloc(&weight_image, weight_bytes()), "cudaMalloc(weights)");
      owned_image = static_cast<unsigned char*>(weight_image);
      bytes = weight_bytes();
    }
    try {
      check_weight_region(weight_image, bytes, weight_bytes(), kAlignment, "KDA layer (CUDA)");
      initialize(w, static_cast<unsigned char*>(weight_image));
    } catch (...) {  // no destructor runs for an object whose constructor throws
      release();
      throw;
    }
  }
  ~CudaLayer() override { release(); }

  Backend backend() const noexcept override { return Backend::kCuda; }

 private:
  // What the layer holds (whatever of it was created): events, side stream, handle, own image.
  void release() noexcept {
    for (cudaEvent_t event : events) {
      if (event != nullptr) (void)cudaEventDestroy(event);
    }
    for (cudaEvent_t event : {side_fork, side_done}) {
      if (event != nullptr) (void)cudaEventDestroy(event);
    }
    if (side != nullptr) (void)cudaStreamDestroy(side);
    if (handle != nullptr) cublasDestroy(handle);
    if (lt.handle != nullptr) cublasLtDestroy(lt.handle);
    if (owned_image != nullptr) cudaFree(owned_image);
  }
  void run(const Batch& batch, const bf16_bits* hidden, bf16_bits* out, const State& state,
           Workspace workspace, const RunOptions& options, CoreInputs* inputs) const override;
  void initialize(const Weights& w, unsigned char* image);
  // Seconds between the phase events of the last forward, added to `times` (waits for the last).
  void add_times(Times* times) const;

  // The GEMMs' library: cuBLASLt's handle and the algorithms chosen so far (a forward adds the
  // shapes it meets), or with KDA_LAYER_CUBLAS_API=gemmex cuBLAS's handle (the other one null).
  cublasHandle_t handle = nullptr;
  mutable LtGemms lt;
  unsigned char* owned_image = nullptr;  // the layer's own allocation, else null
  // Phase boundaries: before the projections, after them, the conv, the core, the norm, o_proj.
  cudaEvent_t events[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  // The stream a decode step's GEMMs that only the core reads run on beside the conv, and the
  // events that fork it from the forward's stream and join it back. Waits between streams on the
  // device only: the host never waits, and a capture takes both streams into one graph.
  cudaStream_t side = nullptr;
  cudaEvent_t side_fork = nullptr, side_done = nullptr;
  const bf16_bits* w_in = nullptr;  // WeightLayout says what each points at
  const bf16_bits* w_fb = nullptr;
  const bf16_bits* w_gb = nullptr;    // the low-rank gate, else null
  const bf16_bits* w_g = nullptr;     // the full-rank gate, else null
  const bf16_bits* g_bias = nullptr;  // null without a bias
  const float* conv = nullptr;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  const float* o_norm = nullptr;
  const bf16_bits* w_o = nullptr;
  std::uint32_t* step_sync = nullptr;      // the one-launch step's state between launches
  std::uint64_t* step_exchange = nullptr;  // (device-side, in the weight image)
};

void CudaLayer::initialize(const Weights& w, unsigned char* image) {
  require_device();
  const Config& c = w.config;
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Cl = c.local_channels();
  const WeightLayout layout = make_weight_layout(c);
  throw_if_error(check_device_pointer(image, layout.total, "weight image"), "KDA layer (CUDA)");

  std::vector<unsigned char> host(layout.total, 0);  // zeros: w_in's padding rows
  auto put = [&](std::size_t at, const auto& values) {
    if (!values.empty()) {
      std::memcpy(host.data() + at, values.data(), values.size() * sizeof(values[0]));
    }
  };
  const ProjColumns cols = proj_columns(c);
  const std::size_t row_bytes = static_cast<std::size_t>(E) * sizeof(bf16_bits);
  put(layout.w_in + cols.q * row_bytes, w.q_proj);
  put(layout.w_in + cols.k * row_bytes, w.k_proj);
  put(layout.w_in + cols.v * row_bytes, w.v_proj);
  put(layout.w_in + cols.f_a * row_bytes, w.f_a_proj);
  if (c.full_rank_gate) {
    put(layout.w_g, w.g_proj);
  } else {
    put(layout.w_in + cols.g_a * row_bytes, w.g_a_proj);
    put(layout.w_gb, w.g_b_proj);
  }
  put(layout.w_in + cols.b * row_bytes, w.b_proj);
  put(layout.w_fb, w.f_b_proj);
  put(layout.g_bias, w.g_b_bias);
  const std::size_t branch_bytes = static_cast<std::size_t>(Cl * W) * sizeof(float);
  put(layout.conv, w.q_conv);
  put(layout.conv + branch_bytes, w.k_conv);
  put(layout.conv + 2 * branch_bytes, w.v_conv);
  put(layout.A_log, w.A_log);
  put(layout.dt_bias, w.dt_bias);
  std::vector<float> o_norm_widened(static_cast<std::size_t>(D));
  for (std::int64_t d = 0; d < D; ++d) o_norm_widened[d] = bf16_to_float(w.o_norm[d]);
  put(layout.o_norm, o_norm_widened);
  put(layout.w_o, w.o_proj);
  check_cuda(cudaMemcpy(image, host.data(), host.size(), cudaMemcpyHostToDevice),
             "cudaMemcpy(weights)");

  w_in = reinterpret_cast<const bf16_bits*>(image + layout.w_in);
  w_fb = reinterpret_cast<const bf16_bits*>(image + layout.w_fb);
  if (c.full_rank_gate) {
    w_g = reinterpret_cast<const bf16_bits*>(image + layout.w_g);
  } else {
    w_gb = reinterpret_cast<const bf16_bits*>(image + layout.w_gb);
  }
  g_bias = w.g_b_bias.empty() ? nullptr : reinterpret_cast<const bf16_bits*>(image + layout.g_bias);
  conv = reinterpret_cast<const float*>(image + layout.conv);
  A_log = reinterpret_cast<const float*>(image + layout.A_log);
  dt_bias = reinterpret_cast<const float*>(image + layout.dt_bias);
  o_norm = reinterpret_cast<const float*>(image + layout.o_norm);
  w_o = reinterpret_cast<const bf16_bits*>(image + layout.w_o);
  step_sync = reinterpret_cast<std::uint32_t*>(image + layout.step_sync);
  step_exchange = reinterpret_cast<std::uint64_t*>(image + layout.step_exchange);
  if (gemm_knobs().cublas_lt) {
    check_cublas(cublasLtCreate(&lt.handle), "cublasLtCreate");
  } else {
    check_cublas(cublasCreate(&handle), "cublasCreate");
  }
  for (cudaEvent_t& event : events) check_cuda(cudaEventCreate(&event), "cudaEventCreate");
  for (cudaEvent_t* event : {&side_fork, &side_done}) {
    check_cuda(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "cudaEventCreate");
  }
  check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
}

void CudaLayer::add_times(Times* times) const {
  check_cuda(cudaEventSynchronize(events[5]), "waiting for the phase events");
  double* phases[5] = {&times->projections, &times->conv, &times->core, &times->norm,
                       &times->o_proj};
  for (int i = 0; i < 5; ++i) {
    float ms = 0.0f;
    check_cuda(cudaEventElapsedTime(&ms, events[i], events[i + 1]), "cudaEventElapsedTime");
    *phases[i] += ms * 1e-3;
  }
}

void CudaLayer::run(const Batch& batch, const bf16_bits* hidden, bf16_bits* out, const State& state,
                    Workspace workspace, const RunOptions& options, CoreInputs* inputs) const {
  const Config& c = config();
  const std::int64_t T = batch.tokens, N = batch.sequences, E = c.hidden_size, D = c.head_dim;
  const std::int64_t W = c.conv_width, Hl = c.local_heads(), Cl = c.local_channels();
  const bool decode = batch.decode_tokens > 0;

  // ---- checks, before anything is enqueued ---------------------------------------------------
  const char* const kForward =
      inputs != nullptr ? "KDA layer core inputs (CUDA)" : "KDA layer forward (CUDA)";
  const WorkspaceLayout layout = checked_forward_layout(
      Backend::kCuda, c, batch,
      decode ? HostCuSeqlens{} : HostCuSeqlens{batch.cu_seqlens_host, batch.cu_seqlens_host_i32},
      batch.slots_host, batch.num_accepted_host, HostFold{}, state, hidden, out, workspace,
      kForward, inputs != nullptr);
  check_run_options(options, kForward);
  constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();
  if (T > kMaxInt || (T + cuda::kConvChunk - 1) / cuda::kConvChunk + N > kMaxInt) {
    throw Error(StatusCode::kUnsupported, "KDA layer forward (CUDA): " + std::to_string(T) +
                                              " tokens in " + std::to_string(N) +
                                              " sequences exceed one launch (2^31 - 1 rows)");
  }
  Problem core = core_prefill_problem(c, T, N, batch.slots != nullptr ? state.num_slots : 0,
                                      state.recurrent_dtype);
  core.cu_seqlens_dtype = cu_seqlens_dtype(batch);  // the core reads int32 ones as they are
  core.padding_slot = batch.padding_slot;           // and skips the rows the conv skipped
  const bool cu_i32 = core.cu_seqlens_dtype == DType::kI32;
  const DecodeProblem step = decode_step_problem(c, batch, state);
  // The commit of the records step before, deferred into this one (Batch::fold_sequences).
  const bool folds = decode && batch.fold_sequences > 0;
  // The records regions are read and written 16 bytes at a time.
  auto require_aligned16 = [&](bool used, const void* a, const void* b, const char* names) {
    if (used &&
        ((reinterpret_cast<std::uintptr_t>(a) | reinterpret_cast<std::uintptr_t>(b)) & 15)) {
      throw Error(StatusCode::kInvalidArgument,
                  std::string(kForward) + ": " + names + " must be 16-byte aligned");
    }
  };
  require_aligned16(batch.records && N > 0, state.recurrent_records, state.conv_records,
                    "State::recurrent_records and conv_records");
  require_aligned16(folds && N > 0, state.fold_recurrent_records, state.fold_conv_records,
                    "State::fold_recurrent_records and fold_conv_records");
  if (options.check_pointers && N > 0) {
    const auto buffers = forward_buffers(c, batch, state, hidden, out, workspace);
    for (const auto& b : buffers) {
      throw_if_error(check_device_pointer(b.ptr, b.bytes, b.name), "KDA layer forward (CUDA)");
    }
  }
  const WorkspaceRegions regions(layout, workspace.ptr);
  const Intermediates m = regions.intermediates();
  if (inputs != nullptr) *inputs = CoreInputs{m.q, m.k, m.v, m.g, m.beta, A_log, dt_bias};

  // ---- enqueue -----------------------------------------------------------------------------
  cudaStream_t stream = static_cast<cudaStream_t>(options.stream);
  using L = WorkspaceLayout;
  auto* proj = regions.at<bf16_bits>(&L::proj);
  bf16_bits *q = m.q, *k = m.k, *v = m.v, *g = m.g, *o = m.o, *beta = m.beta;
  float* gate = m.gate;
  auto* identity = regions.at<std::int32_t>(&L::identity_slots);
  bf16_bits* y = q;  // q is dead once the core has run
  const ProjColumns cols = proj_columns(c);
  auto mark = [&](int boundary) {
    if (options.times != nullptr)
      check_cuda(cudaEventRecord(events[boundary], stream), "cudaEventRecord");
  };
  CudaOptions core_options;
  // The core's buffers are those checked above (the workspace's regions, the pools, the batch's
  // metadata) or the layer's own weights: asking the driver about them again cost a call a second
  // round of pointer queries.
  core_options.check_pointers = false;
  core_options.schedule = options.schedule;
  // The conv's launch: what its prefill and decode forms share.
  auto conv_params = [&] {
    cuda::ConvParams p;
    p.proj = proj;
    p.proj_stride = cols.stride;
    p.tokens = T;
    p.sequences = N;
    p.channels = Cl;
    p.width = static_cast<int>(W);
    p.conv_weight = conv;
    p.pools[0] = state.conv_q;
    p.pools[1] = state.conv_k;
    p.pools[2] = state.conv_v;
    p.out[0] = q;
    p.out[1] = k;
    p.out[2] = v;
    p.beta_col = cols.b;
    p.heads = Hl;
    p.beta = beta;
    p.slots = batch.slots;
    p.num_slots = state.num_slots;
    p.padding_slot = batch.padding_slot;
    p.status = batch.device_status;
    return p;
  };
  auto launch_conv_prefill = [&] {
    cuda::ConvParams p = conv_params();
    p.cu_seqlens = batch.cu_seqlens;
    p.checkpoints = batch.checkpoints;
    p.checkpoint_offsets = batch.checkpoint_offsets;
    p.checkpoint_slots = batch.checkpoint_slots;
    p.cu_seqlens_i32 = batch.cu_seqlens_i32;
    check_cuda(cuda::launch_conv_prefill(p, stream), "conv_prefill_kernel");
  };
  // The core's prefill, states in place in the pool.
  auto core_prefill_tensors = [&](Problem* prefill) {
    Tensors t = core_tensors<Tensors>(m, A_log, dt_bias);
    t.cu_seqlens = cu_i32 ? static_cast<const void*>(batch.cu_seqlens_i32) : batch.cu_seqlens;
    // Checked above already (O(N) again); the core also plans its segments from it.
    t.cu_seqlens_host =
        cu_i32 ? static_cast<const void*>(batch.cu_seqlens_host_i32) : batch.cu_seqlens_host;
    t.initial_state = state.recurrent;
    t.final_state = state.recurrent;  // updated in place
    t.state_slots = batch.slots;
    t.device_status = batch.device_status;
    *prefill = with_checkpoints(core, batch, &t);
    return t;
  };
  auto run_core_prefill = [&] {
    Problem prefill;
    const Tensors t = core_prefill_tensors(&prefill);
    throw_if_error(forward_cuda(prefill, t, regions.core(), stream, core_options),
                   "KDA layer forward (CUDA): core");
  };
  // The separate kernels' step (decode_with_gated_norm).
  auto core_step_tensors = [&] {
    DecodeTensors t = core_tensors<DecodeTensors>(m, A_log, dt_bias);
    add_step_batch(t, batch, state);
    if (t.slots == nullptr) t.slots = identity;
    t.device_status = batch.device_status;
    return t;
  };
  // The core's own checks of its call (its tensors against each other and their alignment: the
  // pools, the workspace, the records, the batch's metadata; the schedule) before the conv is
  // enqueued to write any state. The one-launch and fused steps, which take the same pools and
  // metadata, are held to the same rules.
  if (inputs == nullptr && N > 0) {
    if (decode) {
      throw_if_error(check_cuda_call(step, core_step_tensors(), core_options),
                     "KDA layer forward (CUDA): core");
    } else {
      Problem prefill;
      Tensors t = core_prefill_tensors(&prefill);
      // The host copy's contents were checked with the batch (checked_forward_layout), and the
      // core's own call checks them again: not a third walk here.
      t.cu_seqlens_host = nullptr;
      throw_if_error(check_cuda_call(prefill, t, core_options), "KDA layer forward (CUDA): core");
    }
  }
  if (T == 0) {
    // Nothing to compute, every sequence's state stays as it is; but a prefill's checkpoint
    // requests of empty sequences (offset 0; checked: a prefill, not core inputs) hold their
    // initial states, as in a batch with tokens: the conv's checkpoint blocks and the core copy
    // them.
    if (batch.checkpoints > 0 && N > 0) {
      launch_conv_prefill();
      run_core_prefill();
    }
    return;
  }

  // What the one-launch and the fused step both take of the layer and the batch (the fields of the
  // same names in OneLaunchStepParams and FusedDecodeParams).
  auto set_step_fields = [&](auto& p) {
    p.f_a_col = cols.f_a;
    p.g_a_col = cols.g_a;
    p.beta_col = cols.b;
    p.g_bias = g_bias;
    p.conv_weight = conv;
    p.conv_pools[0] = state.conv_q;
    p.conv_pools[1] = state.conv_k;
    p.conv_pools[2] = state.conv_v;
    p.A_log = A_log;
    p.dt_bias = dt_bias;
    p.o_norm = o_norm;
    p.state = state.recurrent;
    p.f32_state = state.recurrent_dtype == DType::kF32;
    p.slots = batch.slots;
    p.num_slots = state.num_slots;
    p.padding_slot = batch.padding_slot;
    p.heads = static_cast<int>(Hl);
    p.width = static_cast<int>(W);
    p.gate_mode = c.gate;
    p.lower_bound = c.lower_bound;
    p.scale = step.effective_scale();
    p.eps = c.norm_eps;
    p.status = batch.device_status;
  };

  // A plain step of one token of each of a few sequences in one launch (one_launch_step.cu), where
  // it fits.
  const DecodeKernel kernel = options.decode_kernel;
  if (decode && N >= 1 && N <= cuda::one_launch_max_rows(Hl) && batch.decode_tokens == 1 &&
      batch.num_accepted == nullptr && !batch.records && !folds && inputs == nullptr &&
      (kernel == DecodeKernel::kAuto || kernel == DecodeKernel::kOneLaunch)) {
    cuda::OneLaunchStepParams whole;
    set_step_fields(whole);
    whole.rows = static_cast<int>(N);
    whole.hidden = hidden;
    whole.hidden_size = E;
    whole.w_in = w_in;
    whole.proj_rows = cols.b + Hl;
    whole.w_g = w_g;
    whole.w_fb = w_fb;
    whole.w_gb = w_gb;
    whole.w_o = w_o;
    whole.out = out;
    whole.sync = step_sync;
    whole.exchange = step_exchange;
    if (cuda::one_launch_step_fits(whole)) {
      // Its time counts as the projections'.
      mark(0);
      {
        KDA_NVTX_RANGE("one-launch step");
        check_cuda(cuda::launch_one_launch_step(whole, stream), "one_launch_step_kernel");
      }
      for (int boundary = 1; boundary <= 5; ++boundary) mark(boundary);
      if (options.times != nullptr) add_times(options.times);
      if (options.decode_kernel_ran != nullptr)
        *options.decode_kernel_ran = DecodeKernel::kOneLaunch;
      return;
    }
  }

  // A decode step in one kernel after the input projection (fused_decode.cu), where it fits.
  cuda::FusedDecodeParams fused;
  const bool auto_fused = auto_runs_fused(c, N, Hl, batch.decode_tokens, state.recurrent_dtype);
  bool fuse =
      decode &&
      (kernel == DecodeKernel::kFusedFactors || kernel == DecodeKernel::kFused ||
       ((kernel == DecodeKernel::kAuto || kernel == DecodeKernel::kOneLaunch) && auto_fused));
  bool fuse_factors = fuse && kernel != DecodeKernel::kFused;
  if (fuse) {
    set_step_fields(fused);
    fused.proj = proj;
    fused.gate = gate;
    fused.y = y;
    fused.proj_stride = cols.stride;
    fused.w_fb = fuse_factors ? w_fb : nullptr;
    fused.late_dependents = gemm_knobs().fused_late_dependents;
    fused.g = g;
    fused.w_gb = fuse_factors ? w_gb : nullptr;  // null with the full-rank gate
    fused.num_accepted = batch.num_accepted;
    fused.sequences = N;
    fused.decode_tokens = static_cast<int>(batch.decode_tokens);
    fused.records = batch.records ? state.recurrent_records : nullptr;
    fused.conv_records = batch.records ? state.conv_records : nullptr;
    if (folds) {
      fused.fold_records = state.fold_recurrent_records;
      fused.fold_conv_records = state.fold_conv_records;
      fused.fold_rows = batch.fold_rows;
      fused.fold_counts = batch.fold_counts;
      fused.fold_sequences = static_cast<int>(batch.fold_sequences);
      fused.fold_tokens = static_cast<int>(batch.fold_decode_tokens);
    }
    fused.cluster = options.fused_cluster != 0
                        ? options.fused_cluster
                        : fused_cluster_for(N * Hl, kda::detail::current_device_sm_count());
    fuse = cuda::fused_decode_fits(fused);
    fuse_factors = fuse_factors && fuse;
  }

  // Other decode steps: the low-rank second factors run in the conv's launch (conv_decode.cu),
  // where the layout allows, rather than as two GEMMs of their own.
  cuda::ConvParams::Factors conv_factors;
  if (decode && !fuse) {
    cuda::ConvParams fit;
    fit.proj = proj;
    fit.proj_stride = cols.stride;
    fit.channels = Cl;
    fit.factors.w_fb = w_fb;
    fit.factors.f_a_col = cols.f_a;
    fit.factors.g = g;
    if (inputs == nullptr && !c.full_rank_gate) {
      fit.factors.w_gb = w_gb;
      fit.factors.g_a_col = cols.g_a;
      fit.factors.gate = gate;
    }
    const std::int64_t max_tiles =
        batch.decode_tokens == 1 ? kConvFactorMaxTilesOneToken : kConvFactorMaxTiles;
    if (cuda::conv_decode_factor_tiles(T, Cl) <= max_tiles && cuda::conv_decode_factors_fit(fit)) {
      conv_factors = fit.factors;
    }
  }
  const bool factor_gemms = !fuse_factors && conv_factors.w_fb == nullptr;
  // A decode step's output gate (x·W_gᵀ, or g_a·W_gbᵀ where the second factors are GEMMs) and
  // f_a·W_fbᵀ are read first by the core (the gate by its norm epilogue): their GEMMs run on the
  // side stream beside the conv, forked after the input projection (one cuBLAS workspace: no two
  // GEMMs at once) and joined before the core. Not beside a fused step (launched as a programmatic
  // dependent of the GEMMs), nor with phase events (each phase its own kernels), nor in a prefill,
  // where the conv and the GEMMs are each bound by memory bandwidth or the tensor cores and gained
  // nothing from running together (docs/design/layer.md).
  const bool gate_gemm = inputs == nullptr && (c.full_rank_gate || factor_gemms);
  const bool sided = decode && !fuse && options.times == nullptr && gemm_knobs().side_gemms &&
                     (gate_gemm || factor_gemms);
  // Joins the side stream back into the forward's, and gives the cuBLAS handle the forward's
  // stream again, where a throw leaves the forward between the fork and the join: a capture then
  // ends without an unjoined branch, and the side GEMMs stay ordered before the caller's next work.
  struct SideBranch {
    cudaStream_t stream, side;
    cudaEvent_t done;
    cublasHandle_t handle;
    bool open = false;
    void fork() { open = true; }
    void joined() { open = false; }
    ~SideBranch() {
      if (!open) return;
      (void)cudaEventRecord(done, side);
      (void)cudaStreamWaitEvent(stream, done, 0);
      if (handle != nullptr) (void)cublasSetStream(handle, stream);
    }
  } side_branch{stream, side, side_done, handle};

  const GemmContext gemms{handle, stream, regions.at<unsigned char>(&L::cublas),
                          kCublasWorkspaceBytes, lt.handle != nullptr ? &lt : nullptr};
  // o_proj's kernel, and cuBLASLt's algorithm for it, chosen before anything is enqueued: a shape
  // or an alignment of `out` that cuBLASLt has no algorithm for is refused here, not found after
  // the conv and the core have written the states. After the fused step, the small-row kernel
  // streams W_o while that step runs (`fuse`: launched as its programmatic dependent).
  GemmPlan o_proj;
  if (inputs == nullptr) {
    o_proj = plan_gemm(gemms, y, Cl, T, Cl, w_o, E, out, CUDA_R_16BF, E, "y·W_oᵀ", fuse,
                       gemm_knobs().output);
  }
  mark(0);
  {
    KDA_NVTX_RANGE("projections");
    bind_cublas(gemms);
    gemm(gemms, hidden, E, T, E, w_in, cols.stride, proj, CUDA_R_16BF, cols.stride,
         c.full_rank_gate ? "x·[W_q; W_k; W_v; W_fa; W_b]ᵀ" : "x·[W_q; W_k; W_v; W_fa; W_ga; W_b]ᵀ",
         gemm_knobs().programmatic_input, gemm_knobs().input);
    GemmContext at = gemms;  // where the factors' and the gate's GEMMs run
    if (sided) {
      check_cuda(cudaEventRecord(side_fork, stream), "cudaEventRecord(side fork)");
      check_cuda(cudaStreamWaitEvent(side, side_fork, 0), "cudaStreamWaitEvent(side fork)");
      side_branch.fork();
      at.stream = side;
      bind_cublas(at);
    }
    if (factor_gemms) {
      gemm(at, proj + cols.f_a, cols.stride, T, D, w_fb, Cl, g, CUDA_R_16BF, Cl, "f_a·W_fbᵀ");
    }
    // The output gate in f32, so that the norm kernel adds its bias before rounding it. The
    // full-rank gate's columns would come out of the fused GEMM in bf16: it has a GEMM of its own.
    if (gate_gemm && c.full_rank_gate) {
      gemm(at, hidden, E, T, E, w_g, Cl, gate, CUDA_R_32F, Cl, "x·W_gᵀ");
    } else if (gate_gemm) {
      gemm(at, proj + cols.g_a, cols.stride, T, D, w_gb, Cl, gate, CUDA_R_32F, Cl, "g_a·W_gbᵀ");
    }
    if (sided) {
      check_cuda(cudaEventRecord(side_done, side), "cudaEventRecord(side done)");
      bind_cublas(gemms);
    }
  }
  mark(1);
  // A fused step runs conv, core and norm in one kernel: its time counts as the core's.
  if (!fuse) {
    KDA_NVTX_RANGE("conv");
    if (decode) {
      cuda::ConvParams p = conv_params();
      p.decode_tokens = batch.decode_tokens;
      p.identity_slots = batch.slots == nullptr ? identity : nullptr;
      p.num_accepted = batch.num_accepted;
      p.conv_records = batch.records ? state.conv_records : nullptr;
      if (folds) {
        p.fold_conv_records = state.fold_conv_records;
        p.fold_rows = batch.fold_rows;
        p.fold_counts = batch.fold_counts;
        p.fold_sequences = batch.fold_sequences;
        p.fold_tokens = batch.fold_decode_tokens;
      }
      p.factors = conv_factors;
      check_cuda(cuda::launch_conv_decode(p, stream), "conv_decode_kernel");
    } else {
      launch_conv_prefill();
    }
  }
  mark(2);
  // The side stream's GEMMs before the core (and before a caller's core inputs are there).
  if (sided) {
    check_cuda(cudaStreamWaitEvent(stream, side_done, 0), "cudaStreamWaitEvent(side join)");
    side_branch.joined();
  }
  if (inputs != nullptr) return;  // q, k, v, beta from the conv, g from f_a·W_fbᵀ: all there
  cuda::GatedNormParams norm;
  norm.o = o;
  norm.gate = gate;
  norm.bias = g_bias;
  norm.o_norm = o_norm;
  norm.y = y;
  norm.rows = T * Hl;
  norm.heads = Hl;
  norm.eps = c.norm_eps;
  if (fuse) {
    KDA_NVTX_RANGE("fused decode");
    check_cuda(cuda::launch_fused_decode(fused, stream), "fused_decode_kernel");
  } else {
    KDA_NVTX_RANGE("core");
    if (decode) {
      // One token a row up to 256 (row, head) pairs (or at one block a head): the norm runs in
      // the core's launch, as its epilogue (decode_norm.cu): y straight from the step's rows,
      // zeros for the rows it skips (padding), o never stored. Otherwise o stored (zeros for the
      // rows it skips), then the norm's own launch, both in decode_with_gated_norm (their time
      // counts as the core's).
      const DecodeTensors t = core_step_tensors();
      throw_if_error(cuda::decode_with_gated_norm(step, t, norm, stream, core_options),
                     "KDA layer forward (CUDA): core");
    } else {
      run_core_prefill();
    }
  }
  mark(3);
  if (!fuse && !decode) {
    KDA_NVTX_RANGE("norm");
    check_cuda(cuda::launch_gated_rmsnorm(norm, stream), "gated_rmsnorm_kernel");
  }
  mark(4);
  {
    KDA_NVTX_RANGE("o_proj");
    run_gemm(gemms, o_proj, "y·W_oᵀ");
  }
  mark(5);
  if (options.times != nullptr) add_times(options.times);
  if (decode && options.decode_kernel_ran != nullptr) {
    *options.decode_kernel_ran = !fuse          ? DecodeKernel::kSeparate
                                 : fuse_factors ? DecodeKernel::kFusedFactors
                                                : DecodeKernel::kFused;
  }
}

std::unique_ptr<Layer> make_cuda_layer(const Weights& weights, void* weight_image,
                                       std::size_t bytes) {
  return std::make_unique<CudaLayer>(weights, weight_image, bytes, false);
}

std::unique_ptr<Layer> make_cuda_layer(const Weights& weights) {
  return std::make_unique<CudaLayer>(weights, nullptr, 0, true);
}

#endif  // KDA_HAVE_CUDA

}  // namespace kda::layer::detail
