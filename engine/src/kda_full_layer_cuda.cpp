// engine/kda_full_layer_cuda.cpp — the whole KDA layer on CUDA: cuBLAS projections, the fused conv
// and gated-norm kernels (engine/src/cuda/), the operator's CUDA core. The workspace and weight
// image layouts and every check that needs no device are plain C++ and built everywhere; the rest
// needs KDA_HAVE_CUDA (a CPU-only build gets constructors that say so).
#include "kda/engine/kda_full_layer_cuda.hpp"
#include "kda/detail/checked_math.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "aligned_regions.hpp"
#include "full_layer_checks.hpp"
#include "kda/engine/error.hpp"
#include "kda/nvtx.hpp"

#ifdef KDA_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda/full_layer_kernels.hpp"
#if defined(KDA_HAVE_NVTX) && !defined(NVTX_DISABLE)
#include <nvtx3/nvToolsExtMemCudaRt.h>
#endif
#endif

namespace kda::engine {

namespace {

[[noreturn]] void invalid(const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, "KDA layer forward (CUDA): " + message);
}

// cuBLAS wants its workspace and its matrices 256-byte aligned; so do the weight image's tensors.
constexpr std::size_t kAlignment = FullLayerCuda::kWeightImageAlignment;

using detail::AlignedRegions;
using kda::detail::align_up;

// Columns of the fused input projection x·W_inᵀ [T, proj_stride]: q | k | v | f_a | g_a | b | pad.
struct ProjColumns {
  std::int64_t q = 0, k = 0, v = 0, f_a = 0, g_a = 0, b = 0;
  std::int64_t stride = 0;  // rounded up to 8 columns: 16-byte rows for cuBLAS and the conv
};

ProjColumns proj_columns(const FullLayerConfig& c) {
  const std::int64_t Cl = c.local_channels(), D = c.head_dim;
  ProjColumns p;
  p.q = 0;
  p.k = Cl;
  p.v = 2 * Cl;
  p.f_a = 3 * Cl;
  p.g_a = 3 * Cl + D;
  p.b = 3 * Cl + 2 * D;
  p.stride = (p.b + c.local_heads() + 7) / 8 * 8;
  return p;
}

using detail::full_layer_core_problem;

// Byte offsets from the 256-byte aligned workspace base. The core's workspace shares its region
// with `proj`: the projections are consumed (second GEMMs, conv, beta copy) before the core runs.
struct Layout {
  std::size_t cublas = 0;
  std::size_t proj = 0;  // bf16 [T, proj_stride]; then the core's workspace
  std::size_t core_bytes = 0;
  std::size_t q = 0, k = 0, v = 0, g = 0, o = 0;  // bf16 [T, Cl]; q later holds y
  std::size_t gate = 0;                           // f32 [T, Cl]
  std::size_t beta = 0;                           // bf16 [T, Hl]
  std::size_t identity_slots = 0;                 // i32 [N]
  std::size_t total = 0;  // including slack for an unaligned workspace pointer
};

Layout make_layout(const FullLayerConfig& c, std::int64_t tokens, std::int64_t sequences,
                   std::int64_t num_slots) {
  if (tokens < 0 || sequences < 0 || num_slots < 0) {
    invalid("tokens, sequences and num_slots must be >= 0");
  }
  AlignedRegions regions("KDA layer (CUDA) workspace size", kAlignment);
  const std::int64_t Cl = c.local_channels();
  Layout layout;
  layout.cublas = regions.take(FullLayerCuda::kCublasWorkspaceBytes);
  const Problem core = full_layer_core_problem(c, tokens, sequences, num_slots, true, DType::kF32);
  if (Status st = workspace_size(core, Backend::kCuda, &layout.core_bytes); !st) {
    throw Error(st, "KDA layer (CUDA) workspace");
  }
  const std::uint64_t proj_bytes = regions.bytes_of(tokens, proj_columns(c).stride, 2);
  layout.proj = regions.take(std::max<std::uint64_t>(proj_bytes, layout.core_bytes));
  layout.q = regions.take(regions.bytes_of(tokens, Cl, 2));
  layout.k = regions.take(regions.bytes_of(tokens, Cl, 2));
  layout.v = regions.take(regions.bytes_of(tokens, Cl, 2));
  layout.g = regions.take(regions.bytes_of(tokens, Cl, 2));
  layout.o = regions.take(regions.bytes_of(tokens, Cl, 2));
  layout.gate = regions.take(regions.bytes_of(tokens, Cl, 4));
  layout.beta = regions.take(regions.bytes_of(tokens, c.local_heads(), 2));
  layout.identity_slots = regions.take(regions.bytes_of(sequences, 1, 4));
  // Slack for an unaligned workspace pointer: one alignment past the last region.
  layout.total = regions.take(kAlignment) + kAlignment;
  return layout;
}

// Byte offsets of the weight image's tensors from its kAlignment-aligned base: the one layout that
// weight_image_bytes() sizes and the constructors fill.
struct WeightLayout {
  std::size_t w_in = 0;     // bf16 [proj_stride, E]: q | k | v | f_a | g_a | b | zero rows
  std::size_t w_fb = 0;     // bf16 [Cl, D]
  std::size_t w_gb = 0;     // bf16 [Cl, D]
  std::size_t g_bias = 0;   // bf16 [Cl]; its place is kept when the layer has no bias
  std::size_t conv = 0;     // f32 [3 Cl, W]: q | k | v
  std::size_t A_log = 0;    // f32 [Hl]
  std::size_t dt_bias = 0;  // f32 [Cl]
  std::size_t o_norm = 0;   // f32 [D], widened
  std::size_t w_o = 0;      // bf16 [E, Cl]
  std::size_t total = 0;
};

WeightLayout make_weight_layout(const FullLayerConfig& c) {
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Cl = c.local_channels();
  AlignedRegions regions("KDA layer (CUDA) weight image size", kAlignment);
  WeightLayout layout;
  layout.w_in = regions.take(regions.bytes_of(proj_columns(c).stride, E, 2));
  layout.w_fb = regions.take(regions.bytes_of(Cl, D, 2));
  layout.w_gb = regions.take(regions.bytes_of(Cl, D, 2));
  layout.g_bias = regions.take(regions.bytes_of(Cl, 1, 2));
  layout.conv = regions.take(regions.bytes_of(3 * Cl, W, 4));
  layout.A_log = regions.take(regions.bytes_of(c.local_heads(), 1, 4));
  layout.dt_bias = regions.take(regions.bytes_of(Cl, 1, 4));
  layout.o_norm = regions.take(regions.bytes_of(D, 1, 4));
  layout.w_o = regions.take(regions.bytes_of(E, Cl, 2));
  layout.total = regions.end();
  return layout;
}

// The checks FullLayerCpu's constructor makes on the weights, plus the CUDA path's limits.
void check_weights(const FullLayerWeights& w) {
  check_sizes(w);
  const FullLayerConfig& c = w.config;
  if (c.head_dim != 128) {
    throw Error(StatusCode::kUnsupported,
                "KDA layer (CUDA): head_dim " + std::to_string(c.head_dim) +
                    " is not 128 (the CUDA core and the gated-norm kernel run D = 128)");
  }
  if (c.conv_width < 2 || c.conv_width > 4) {
    throw Error(StatusCode::kUnsupported, "KDA layer (CUDA): conv_width " +
                                              std::to_string(c.conv_width) +
                                              " is not in [2, 4] (the conv kernels' widths)");
  }
  detail::check_gate_weights(w.A_log, w.dt_bias);
}

}  // namespace

std::size_t FullLayerCuda::workspace_bytes(const FullLayerConfig& config, std::int64_t tokens,
                                           std::int64_t sequences, std::int64_t num_slots) {
  validate(config);
  return make_layout(config, tokens, sequences, num_slots).total;
}

std::size_t FullLayerCuda::weight_image_bytes(const FullLayerConfig& config) {
  validate(config);
  return make_weight_layout(config).total;
}

#ifndef KDA_HAVE_CUDA

struct FullLayerCuda::Impl {
  [[noreturn]] static void unavailable() {
    throw Error(StatusCode::kBackendUnavailable,
                "KDA layer (CUDA): this build has no CUDA backend (configure with -DKDA_CUDA=ON)");
  }
  unsigned char* allocate_weight_image(std::size_t) { unavailable(); }
  void initialize(const FullLayerWeights&, unsigned char*) { unavailable(); }
};

FullLayerCuda::~FullLayerCuda() = default;
void FullLayerCuda::forward(const FullLayerCudaBatch&, const bf16_bits*, bf16_bits*,
                            const FullLayerState&, Workspace, void*, const CudaOptions&,
                            const FullLayerCudaEvents*) const {
  Impl::unavailable();
}

#else  // KDA_HAVE_CUDA

namespace {

DecodeProblem decode_problem(const FullLayerConfig& c, std::int64_t sequences,
                             std::int64_t decode_tokens, std::int64_t num_slots,
                             DType state_dtype) {
  DecodeProblem p;
  p.batch = sequences;
  p.tokens = decode_tokens;
  p.num_heads = c.local_heads();
  p.head_dim_k = p.head_dim_v = c.head_dim;
  p.num_slots = num_slots;
  p.state_dtype = state_dtype;
  p.gate = c.gate;
  p.lower_bound = c.lower_bound;
  return p;
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(StatusCode::kCudaError, std::string("KDA layer (CUDA): ") + what + ": " +
                                            cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                                            ")");
  }
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

// out[rows, n_out] (row stride ldo) = in[rows, n_in] (row stride ldi) · weight[n_out, n_in]ᵀ:
// bf16 operands, fp32 accumulation, bf16 or f32 out. In cuBLAS's column-major terms this is
// outᵀ = weightᵀᵀ · inᵀ, i.e. op(A) = T on the row-major weight.
void gemm(cublasHandle_t handle, cudaStream_t stream, const void* in, std::int64_t ldi,
          std::int64_t rows, std::int64_t n_in, const void* weight, std::int64_t n_out, void* out,
          cudaDataType out_type, std::int64_t ldo, const char* what) {
  const float one = 1.0f, zero = 0.0f;
  check_cublas(
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n_out),
                   static_cast<int>(rows), static_cast<int>(n_in), &one, weight, CUDA_R_16BF,
                   static_cast<int>(n_in), in, CUDA_R_16BF, static_cast<int>(ldi), &zero, out,
                   out_type, static_cast<int>(ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      what);
  if (rows > 0) {
    const std::size_t element = out_type == CUDA_R_32F ? 4 : 2;
    mark_initialized(stream, out, static_cast<std::size_t>((rows - 1) * ldo + n_out) * element);
  }
}

// A CUDA device is present and one the operator supports.
void require_device() {
  if (cuda_device_count() <= 0) {
    throw Error(StatusCode::kBackendUnavailable, "KDA layer (CUDA): no CUDA device is present");
  }
  throw_if_error(cuda_device_supported(), "KDA layer (CUDA)");
}

}  // namespace

struct FullLayerCuda::Impl {
  cublasHandle_t handle = nullptr;
  unsigned char* owned_image = nullptr;  // the one-argument constructor's allocation, else null
  const bf16_bits* w_in = nullptr;       // WeightLayout says what each points at
  const bf16_bits* w_fb = nullptr;
  const bf16_bits* w_gb = nullptr;
  const bf16_bits* g_bias = nullptr;  // null without a bias
  const float* conv = nullptr;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  const float* o_norm = nullptr;
  const bf16_bits* w_o = nullptr;

  ~Impl() {
    if (handle != nullptr) cublasDestroy(handle);
    if (owned_image != nullptr) cudaFree(owned_image);
  }

  unsigned char* allocate_weight_image(std::size_t bytes) {
    require_device();
    void* device = nullptr;
    check_cuda(cudaMalloc(&device, bytes), "cudaMalloc(weights)");
    owned_image = static_cast<unsigned char*>(device);
    return owned_image;
  }

  // Builds the weight image on the host in make_weight_layout's layout, copies it to `image`
  // (device memory of at least its size, checked by the caller), points the layer at its tensors
  // there and creates the cuBLAS handle.
  void initialize(const FullLayerWeights& w, unsigned char* image) {
    require_device();
    const FullLayerConfig& c = w.config;
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
    put(layout.w_in + cols.g_a * row_bytes, w.g_a_proj);
    put(layout.w_in + cols.b * row_bytes, w.b_proj);
    put(layout.w_fb, w.f_b_proj);
    put(layout.w_gb, w.g_b_proj);
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
    w_gb = reinterpret_cast<const bf16_bits*>(image + layout.w_gb);
    g_bias =
        w.g_b_bias.empty() ? nullptr : reinterpret_cast<const bf16_bits*>(image + layout.g_bias);
    conv = reinterpret_cast<const float*>(image + layout.conv);
    A_log = reinterpret_cast<const float*>(image + layout.A_log);
    dt_bias = reinterpret_cast<const float*>(image + layout.dt_bias);
    o_norm = reinterpret_cast<const float*>(image + layout.o_norm);
    w_o = reinterpret_cast<const bf16_bits*>(image + layout.w_o);
    check_cublas(cublasCreate(&handle), "cublasCreate");
  }
};

FullLayerCuda::~FullLayerCuda() = default;

void FullLayerCuda::forward(const FullLayerCudaBatch& batch, const bf16_bits* hidden,
                            bf16_bits* out, const FullLayerState& state, Workspace workspace,
                            void* stream_ptr, const CudaOptions& options,
                            const FullLayerCudaEvents* events) const {
  const FullLayerConfig& c = config_;
  const std::int64_t T = batch.tokens, N = batch.sequences, E = c.hidden_size, D = c.head_dim;
  const std::int64_t W = c.conv_width, Hl = c.local_heads(), Cl = c.local_channels();
  const bool decode = batch.decode_tokens > 0;

  // ---- checks, before anything is enqueued ---------------------------------------------------
  if (T < 0 || N < 0) invalid("tokens and sequences must be >= 0");
  if (batch.decode_tokens < 0 || batch.decode_tokens > 16) {
    invalid("decode_tokens " + std::to_string(batch.decode_tokens) + " is not in [0, 16]");
  }
  const Layout layout = make_layout(c, T, N, state.num_slots);  // also: sizes fit 64 bits
  constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();
  if (T > kMaxInt || (T + cuda::kConvChunk - 1) / cuda::kConvChunk + N > kMaxInt) {
    throw Error(StatusCode::kUnsupported, "KDA layer forward (CUDA): " + std::to_string(T) +
                                              " tokens in " + std::to_string(N) +
                                              " sequences exceed one launch (2^31 - 1 rows)");
  }
  if (decode) {
    if (T != N * batch.decode_tokens) {
      invalid("decode: tokens " + std::to_string(T) + " is not sequences " + std::to_string(N) +
              " x decode_tokens " + std::to_string(batch.decode_tokens));
    }
  } else {
    if (N == 0 && T > 0) invalid(std::to_string(T) + " tokens but no sequence");
    if (N > 0 && batch.cu_seqlens == nullptr) invalid("cu_seqlens is null");
    if (const std::int64_t* cu = batch.cu_seqlens_host; cu != nullptr) {
      if (cu[0] != 0) invalid("cu_seqlens[0] is not 0");
      for (std::int64_t n = 0; n < N; ++n) {
        if (cu[n + 1] < cu[n]) invalid("cu_seqlens decreases at entry " + std::to_string(n + 1));
      }
      if (cu[N] != T) {
        invalid("cu_seqlens[" + std::to_string(N) + "] = " + std::to_string(cu[N]) +
                " is not tokens = " + std::to_string(T));
      }
    }
  }
  if (batch.slots == nullptr && N > state.num_slots) {
    invalid(std::to_string(N) +
            " sequences on rows 0..N-1 but num_slots = " + std::to_string(state.num_slots));
  }
  if (batch.slots == nullptr && batch.slots_host != nullptr) {
    invalid("slots_host is given but slots (the device list) is null");
  }
  if (const std::int32_t* slots = batch.slots_host; slots != nullptr) {
    for (std::int64_t n = 0; n < N; ++n) {
      if (slots[n] >= state.num_slots) {
        invalid("sequence " + std::to_string(n) + " has slot " + std::to_string(slots[n]) +
                ", outside [0, num_slots = " + std::to_string(state.num_slots) + ")");
      }
      for (std::int64_t m = 0; m < n && slots[n] >= 0; ++m) {
        if (slots[m] == slots[n]) {
          invalid("sequences " + std::to_string(m) + " and " + std::to_string(n) + " share slot " +
                  std::to_string(slots[n]));
        }
      }
    }
  }
  detail::check_state_pools(state, N, c.conv_width, "KDA layer forward (CUDA)");
  detail::check_hidden_and_out(hidden, out, T, E, "KDA layer forward (CUDA)");
  const std::size_t hidden_bytes = static_cast<std::size_t>(T * E) * sizeof(bf16_bits);
  const Problem core = full_layer_core_problem(c, T, N, state.num_slots, batch.slots != nullptr,
                                               state.recurrent_dtype);
  const DecodeProblem step = decode_problem(c, N, std::max<std::int64_t>(batch.decode_tokens, 1),
                                            state.num_slots, state.recurrent_dtype);
  if (decode) {
    throw_if_error(validate(step), "KDA layer forward (CUDA): decode core problem");
  } else {
    throw_if_error(validate(core), "KDA layer forward (CUDA): core problem");
  }
  if (workspace.bytes < layout.total) {
    throw Error(StatusCode::kWorkspaceTooSmall,
                "KDA layer forward (CUDA): workspace has " + std::to_string(workspace.bytes) +
                    " bytes, a forward of " + std::to_string(T) + " tokens in " +
                    std::to_string(N) + " sequences needs " + std::to_string(layout.total));
  }
  if (workspace.ptr == nullptr) invalid("workspace.ptr is null");
  if (options.check_pointers && N > 0) {
    const std::size_t conv_pool = static_cast<std::size_t>(state.num_slots * Cl * (W - 1)) * 2;
    const std::size_t recurrent_pool =
        static_cast<std::size_t>(state.num_slots * Hl * D * D) * dtype_size(state.recurrent_dtype);
    const struct {
      const void* ptr;
      std::size_t bytes;
      const char* name;
    } buffers[] = {
        {hidden, hidden_bytes, "hidden"},
        {out, hidden_bytes, "out"},
        {workspace.ptr, workspace.bytes, "workspace"},
        {state.conv_q, conv_pool, "conv_q pool"},
        {state.conv_k, conv_pool, "conv_k pool"},
        {state.conv_v, conv_pool, "conv_v pool"},
        {state.recurrent, recurrent_pool, "recurrent pool"},
        {decode ? nullptr : batch.cu_seqlens, static_cast<std::size_t>(N + 1) * 8, "cu_seqlens"},
        {batch.slots, static_cast<std::size_t>(N) * 4, "slots"},
        {batch.device_status, 4, "device_status"},
    };
    for (const auto& b : buffers) {
      throw_if_error(check_device_pointer(b.ptr, b.bytes, b.name), "KDA layer forward (CUDA)");
    }
  }
  if (T == 0) return;  // nothing to compute; every state stays as it is

  // ---- enqueue -----------------------------------------------------------------------------
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(workspace.ptr);
  auto* base = reinterpret_cast<unsigned char*>(align_up<std::uintptr_t>(address, kAlignment));
  auto* proj = reinterpret_cast<bf16_bits*>(base + layout.proj);
  auto* q = reinterpret_cast<bf16_bits*>(base + layout.q);
  auto* k = reinterpret_cast<bf16_bits*>(base + layout.k);
  auto* v = reinterpret_cast<bf16_bits*>(base + layout.v);
  auto* g = reinterpret_cast<bf16_bits*>(base + layout.g);
  auto* o = reinterpret_cast<bf16_bits*>(base + layout.o);
  auto* gate = reinterpret_cast<float*>(base + layout.gate);
  auto* beta = reinterpret_cast<bf16_bits*>(base + layout.beta);
  auto* identity = reinterpret_cast<std::int32_t*>(base + layout.identity_slots);
  bf16_bits* y = q;  // q is dead once the core has run
  const ProjColumns cols = proj_columns(c);
  auto mark = [&](int boundary) {
    if (events != nullptr && events->boundary[boundary] != nullptr) {
      check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(events->boundary[boundary]), stream),
                 "cudaEventRecord");
    }
  };
  const Impl& m = *impl_;

  mark(0);
  {
    KDA_NVTX_RANGE("projections");
    // cublasSetStream resets the workspace to cuBLAS's own pool: set the workspace after it.
    check_cublas(cublasSetStream(m.handle, stream), "cublasSetStream");
    check_cublas(cublasSetWorkspace(m.handle, base + layout.cublas, kCublasWorkspaceBytes),
                 "cublasSetWorkspace");
    gemm(m.handle, stream, hidden, E, T, E, m.w_in, cols.stride, proj, CUDA_R_16BF, cols.stride,
         "x·[W_q; W_k; W_v; W_fa; W_ga; W_b]ᵀ");
    gemm(m.handle, stream, proj + cols.f_a, cols.stride, T, D, m.w_fb, Cl, g, CUDA_R_16BF, Cl,
         "f_a·W_fbᵀ");
    gemm(m.handle, stream, proj + cols.g_a, cols.stride, T, D, m.w_gb, Cl, gate, CUDA_R_32F, Cl,
         "g_a·W_gbᵀ");
  }
  mark(1);
  {
    KDA_NVTX_RANGE("conv");
    cuda::ConvParams p;
    p.proj = proj;
    p.proj_stride = cols.stride;
    p.tokens = T;
    p.sequences = N;
    p.channels = Cl;
    p.width = static_cast<int>(W);
    p.conv_weight = m.conv;
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
    p.status = batch.device_status;
    if (decode) {
      p.decode_tokens = batch.decode_tokens;
      p.identity_slots = batch.slots == nullptr ? identity : nullptr;
      check_cuda(cuda::launch_conv_decode(p, stream), "conv_decode_kernel");
    } else {
      p.cu_seqlens = batch.cu_seqlens;
      check_cuda(cuda::launch_conv_prefill(p, stream), "conv_prefill_kernel");
    }
  }
  mark(2);
  {
    KDA_NVTX_RANGE("core");
    if (decode) {
      // Padding rows (negative slots) are skipped by the core: zero them so that their y and out
      // are zeros rather than stale workspace.
      check_cuda(cudaMemsetAsync(o, 0, static_cast<std::size_t>(T * Cl) * 2, stream),
                 "cudaMemsetAsync(o)");
      DecodeTensors t;
      t.q = q;
      t.k = k;
      t.v = v;
      t.g = g;
      t.beta = beta;
      t.A_log = m.A_log;
      t.dt_bias = m.dt_bias;
      t.slots = batch.slots != nullptr ? batch.slots : identity;
      t.state_pool = state.recurrent;
      t.out = o;
      t.device_status = batch.device_status;
      throw_if_error(decode_cuda(step, t, stream, options), "KDA layer forward (CUDA): core");
    } else {
      Tensors t;
      t.q = q;
      t.k = k;
      t.v = v;
      t.g = g;
      t.beta = beta;
      t.A_log = m.A_log;
      t.dt_bias = m.dt_bias;
      t.cu_seqlens = batch.cu_seqlens;
      // Checked above already (O(N) again); the core also plans its segments from it.
      t.cu_seqlens_host = batch.cu_seqlens_host;
      t.initial_state = state.recurrent;
      t.final_state = state.recurrent;  // updated in place
      t.state_slots = batch.slots;
      t.out = o;
      t.device_status = batch.device_status;
      throw_if_error(
          forward_cuda(core, t, Workspace{base + layout.proj, layout.core_bytes}, stream, options),
          "KDA layer forward (CUDA): core");
    }
  }
  mark(3);
  {
    KDA_NVTX_RANGE("norm");
    cuda::GatedNormParams p;
    p.o = o;
    p.gate = gate;
    p.bias = m.g_bias;
    p.o_norm = m.o_norm;
    p.y = y;
    p.rows = T * Hl;
    p.heads = Hl;
    p.eps = c.norm_eps;
    check_cuda(cuda::launch_gated_rmsnorm(p, stream), "gated_rmsnorm_kernel");
  }
  mark(4);
  {
    KDA_NVTX_RANGE("o_proj");
    gemm(m.handle, stream, y, Cl, T, Cl, m.w_o, E, out, CUDA_R_16BF, E, "y·W_oᵀ");
  }
  mark(5);
}

#endif  // KDA_HAVE_CUDA

// Both constructors check everything that needs no device first, then hand the image's memory
// (the caller's, or the layer's own from allocate_weight_image) to the one Impl::initialize.
FullLayerCuda::FullLayerCuda(const FullLayerWeights& weights, void* weight_image, std::size_t bytes)
    : config_(weights.config), impl_(std::make_unique<Impl>()) {
  check_weights(weights);
  weight_image_bytes_ = weight_image_bytes(config_);
  detail::check_weight_region(weight_image, bytes, weight_image_bytes_, kAlignment,
                              "KDA layer (CUDA)");
  impl_->initialize(weights, static_cast<unsigned char*>(weight_image));
}

FullLayerCuda::FullLayerCuda(const FullLayerWeights& weights)
    : config_(weights.config), impl_(std::make_unique<Impl>()) {
  check_weights(weights);
  weight_image_bytes_ = weight_image_bytes(config_);
  impl_->initialize(weights, impl_->allocate_weight_image(weight_image_bytes_));
}

}  // namespace kda::engine
