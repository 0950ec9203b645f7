// kda-gemm-algo-probe — how far cuBLASLt's own kernels can take the whole layer's decode GEMMs of
// 8 to 256 rows (decode_gemm_shapes.hpp: the input projection, the full-rank gate, o_proj and the
// low-rank second factor of Kimi-Linear-48B, its TP8 shard and Kimi K3's TP8 shard), against the
// `cublasGemmEx` default the layer calls:
//   - "heuristic": the best of cuBLASLt's heuristic candidates (up to 16), each timed;
//   - "enumerated": the best of every algorithm id cuBLASLt lists for bf16 x bf16 -> bf16 with fp32
//     accumulation, crossed with each tile it supports and split-K 1, 2, 4, 8, 16 (with a
//     reduction scheme it supports), each configuration that cublasLtMatmulAlgoCheck accepts within
//     a 32 MB workspace timed;
//   - "split-K batched": K cut into 2 or 4 slices, one `cublasGemmStridedBatchedEx` call of the
//     `cublasGemmEx` class (its batch the slices, so its grid that many times the plain call's)
//     into fp32 partial sums, then a kernel adding them in slice order into the bf16 out; the best
//     of the two, both launches in each timed call, and the larger relative error of the two
//     against `cublasGemmEx`'s out (|split - plain| / |plain| over the bf16 outputs).
// Each timing: 20 calls captured in one CUDA graph, each call on the next copy of random weights
// (copies beyond three times L2), median of 7 replays, us per call. out = in · Wᵀ as the layer
// computes it (row-major weight [n, k], op(A) = T in cuBLAS's column-major terms). The floor: the
// weights, the input and the output once at the copy bandwidth given (default 4.25 TB/s).
// Usage: kda-gemm-algo-probe [--rows R]... [--shape NAME]... [--bandwidth TBPS] [--max-tiles N]
//                            [--no-lt]
// (--shape: only the shapes whose name contains NAME; --no-lt: neither cuBLASLt column, which take
// most of the run). CUDA only.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_device.cuh"  // CK, kda_bench::fill
#include "decode_gemm_shapes.hpp"

namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, cublasGetStatusString(status));
    std::exit(1);
  }
}

constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;  // the layer's cuBLAS workspace

struct Best {
  double us = -1.0;
  std::string config;
  void offer(double t, const std::string& what) {
    if (t > 0.0 && (us < 0.0 || t < us)) {
      us = t;
      config = what;
    }
  }
};

// out[r, c] (bf16, [rows, n]) = the sum over s < splits, in order, of partial[s][r][c] (fp32,
// [splits, rows, n]); four columns a thread (n a multiple of 4).
__global__ void sum_slices(const float* partial, int splits, std::int64_t count,
                           std::uint16_t* out) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= count) return;
  float4 acc = *reinterpret_cast<const float4*>(partial + i);
  for (int s = 1; s < splits; ++s) {
    const float4 f = *reinterpret_cast<const float4*>(partial + s * count + i);
    acc.x += f.x, acc.y += f.y, acc.z += f.z, acc.w += f.w;
  }
  const float v[4] = {acc.x, acc.y, acc.z, acc.w};
  std::uint16_t bits[4];
  for (int j = 0; j < 4; ++j) bits[j] = __bfloat16_as_ushort(__float2bfloat16_rn(v[j]));
  *reinterpret_cast<uint2*>(out + i) = make_uint2(bits[0] | (static_cast<unsigned>(bits[1]) << 16),
                                                  bits[2] | (static_cast<unsigned>(bits[3]) << 16));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> rows_list;
  std::vector<std::string> shape_filters;
  double bandwidth = 4.25e12;
  int max_tiles = 32;
  bool lt_columns = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc && std::atoi(argv[i + 1]) > 0) {
      rows_list.push_back(std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
      shape_filters.emplace_back(argv[++i]);
    } else if (std::strcmp(argv[i], "--bandwidth") == 0 && i + 1 < argc &&
               std::atof(argv[i + 1]) > 0.0) {
      bandwidth = std::atof(argv[++i]) * 1e12;
    } else if (std::strcmp(argv[i], "--max-tiles") == 0 && i + 1 < argc &&
               std::atoi(argv[i + 1]) > 0) {
      max_tiles = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--no-lt") == 0) {
      lt_columns = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--rows R]... [--shape NAME]... [--bandwidth TBPS] [--max-tiles N] "
                   "[--no-lt]\n",
                   argv[0]);
      return 2;
    }
  }
  if (rows_list.empty()) rows_list = {8, 64, 256};
  const std::int64_t max_rows = *std::max_element(rows_list.begin(), rows_list.end());

  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream = nullptr;
  CK(cudaStreamCreate(&stream));
  cublasHandle_t handle = nullptr;
  check(cublasCreate(&handle), "cublasCreate");
  check(cublasSetStream(handle, stream), "cublasSetStream");
  cublasLtHandle_t lt = nullptr;
  check(cublasLtCreate(&lt), "cublasLtCreate");
  void* workspace = nullptr;
  CK(cudaMalloc(&workspace, kWorkspaceBytes));
  check(cublasSetWorkspace(handle, workspace, kWorkspaceBytes), "cublasSetWorkspace");
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));

  // The algorithm ids cuBLASLt lists for the layer's types.
  int ids[256];
  int id_count = 0;
  check(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                                 CUDA_R_16BF, CUDA_R_16BF, 256, ids, &id_count),
        "cublasLtMatmulAlgoGetIds");

  std::printf(
      "kda-gemm-algo-probe on %s: us per call (median of 7 graph replays of 20 calls, weights "
      "beyond L2); %d cuBLASLt algorithm ids, up to %d tiles each, split-K 1-16\n\n",
      prop.name, id_count, max_tiles);
  std::printf(
      "| shape | rows | floor | cublasGemmEx | split-K batched | its slices | its error | "
      "heuristic | enumerated | its configuration | configurations timed |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n");
  std::fflush(stdout);

  for (const kda_bench::DecodeGemmShape& s : kda_bench::kDecodeGemmShapes) {
    if (!shape_filters.empty() &&
        std::none_of(shape_filters.begin(), shape_filters.end(), [&](const std::string& f) {
          return std::string(s.name).find(f) != std::string::npos;
        })) {
      continue;
    }
    const std::size_t weight_bytes = static_cast<std::size_t>(s.n * s.k) * 2;
    const std::size_t copies =
        std::max<std::size_t>(2, 3 * static_cast<std::size_t>(prop.l2CacheSize) / weight_bytes + 1);
    std::vector<void*> weights(copies);
    for (std::size_t c = 0; c < copies; ++c) {
      CK(cudaMalloc(&weights[c], weight_bytes));
      // Random bits, as real weights have (constant bytes draw less power and can clock higher).
      kda_bench::fill(static_cast<std::uint16_t*>(weights[c]),
                      static_cast<std::int64_t>(weight_bytes / 2), 17 + c, -0.05f, 0.05f);
    }
    void* in = nullptr;
    void* out = nullptr;
    CK(cudaMalloc(&in, static_cast<std::size_t>(max_rows * s.k) * 2));
    CK(cudaMalloc(&out, static_cast<std::size_t>(max_rows * s.n) * 2));
    constexpr int kMaxSlices = 4;
    float* partial = nullptr;
    CK(cudaMalloc(&partial, static_cast<std::size_t>(kMaxSlices * max_rows * s.n) * 4));
    kda_bench::fill(static_cast<std::uint16_t*>(in), max_rows * s.k, 5, -1.0f, 1.0f);
    CK(cudaDeviceSynchronize());  // the fills run on the default stream

    for (const std::int64_t rows : rows_list) {
      // 20 calls of `call` (false: it refused) in one graph; median of 7 replays, us per call;
      // -1 where a call or the capture failed.
      auto time_calls = [&](auto&& call) {
        constexpr int kCalls = 20;
        cudaGraph_t graph = nullptr;
        if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
          return -1.0;
        }
        bool ok = true;
        for (int i = 0; i < kCalls && ok; ++i) ok = call(weights[i % copies]);
        const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
        cudaGraphExec_t exec = nullptr;
        if (!ok || ended != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
          if (graph != nullptr) cudaGraphDestroy(graph);
          (void)cudaGetLastError();
          return -1.0;
        }
        std::vector<double> replays;
        bool ran = true;
        for (int r = 0; r < 7 && ran; ++r) {
          cudaEventRecord(start, stream);
          ran = cudaGraphLaunch(exec, stream) == cudaSuccess;
          cudaEventRecord(stop, stream);
          ran = ran && cudaEventSynchronize(stop) == cudaSuccess;
          float ms = 0.0f;
          cudaEventElapsedTime(&ms, start, stop);
          replays.push_back(ms * 1e3 / kCalls);
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        if (!ran) {
          (void)cudaGetLastError();
          return -1.0;
        }
        std::sort(replays.begin(), replays.end());
        return replays[replays.size() / 2];
      };
      const float one = 1.0f, zero = 0.0f;
      auto plain_call = [&](void* w) {
        return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n),
                            static_cast<int>(rows), static_cast<int>(s.k), &one, w, CUDA_R_16BF,
                            static_cast<int>(s.k), in, CUDA_R_16BF, static_cast<int>(s.k), &zero,
                            out, CUDA_R_16BF, static_cast<int>(s.n), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT);
      };
      const double gemm_ex =
          time_calls([&](void* w) { return plain_call(w) == CUBLAS_STATUS_SUCCESS; });
      // One call of each into `out`, copied back: the plain product, then each split's.
      auto host_out = [&] {
        std::vector<std::uint16_t> h(static_cast<std::size_t>(rows * s.n));
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(h.data(), out, h.size() * 2, cudaMemcpyDeviceToHost));
        return h;
      };
      auto as_float = [](std::uint16_t bits) {
        return static_cast<double>(__bfloat162float(__ushort_as_bfloat16(bits)));
      };
      check(plain_call(weights[0]), "cublasGemmEx");
      const std::vector<std::uint16_t> reference = host_out();
      Best batched;
      double batched_error = 0.0;
      for (const int slices : {2, 4}) {
        if (s.k % (8 * slices) != 0 || s.n % 4 != 0) continue;
        const int k_slice = static_cast<int>(s.k / slices);
        const std::int64_t count = rows * s.n;
        auto split_call = [&](void* w) {
          if (cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n),
                                         static_cast<int>(rows), k_slice, &one, w, CUDA_R_16BF,
                                         static_cast<int>(s.k), k_slice, in, CUDA_R_16BF,
                                         static_cast<int>(s.k), k_slice, &zero, partial, CUDA_R_32F,
                                         static_cast<int>(s.n), count, slices, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            return false;
          }
          const unsigned blocks = static_cast<unsigned>((count / 4 + 255) / 256);
          sum_slices<<<blocks, 256, 0, stream>>>(partial, slices, count,
                                                 static_cast<std::uint16_t*>(out));
          return cudaGetLastError() == cudaSuccess;
        };
        if (!split_call(weights[0])) continue;
        const std::vector<std::uint16_t> split = host_out();
        double diff = 0.0, norm = 0.0;
        for (std::size_t i = 0; i < split.size(); ++i) {
          const double p = as_float(reference[i]), q = as_float(split[i]);
          diff += (q - p) * (q - p);
          norm += p * p;
        }
        batched_error = std::max(batched_error, norm > 0.0 ? std::sqrt(diff / norm) : diff);
        batched.offer(time_calls(split_call), std::to_string(slices));
      }

      cublasLtMatmulDesc_t op = nullptr;
      check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
      const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
      check(
          cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)),
          "TRANSA");
      check(
          cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)),
          "TRANSB");
      cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
      check(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.k, s.n, s.k), "layout A");
      check(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.k, rows, s.k), "layout B");
      check(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, s.n, rows, s.n), "layout C");
      auto lt_call = [&](const cublasLtMatmulAlgo_t& algo) {
        return [&, algo_copy = algo](void* w) {
          return cublasLtMatmul(lt, op, &one, w, a, in, b, &zero, out, c, out, c, &algo_copy,
                                workspace, kWorkspaceBytes, stream) == CUBLAS_STATUS_SUCCESS;
        };
      };

      Best heuristic;
      if (lt_columns) {
        cublasLtMatmulPreference_t preference = nullptr;
        check(cublasLtMatmulPreferenceCreate(&preference), "PreferenceCreate");
        const std::size_t limit = kWorkspaceBytes;
        check(cublasLtMatmulPreferenceSetAttribute(
                  preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &limit, sizeof(limit)),
              "MAX_WORKSPACE_BYTES");
        cublasLtMatmulHeuristicResult_t results[16];
        int found = 0;
        if (cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, preference, 16, results, &found) ==
            CUBLAS_STATUS_SUCCESS) {
          for (int i = 0; i < found; ++i) {
            heuristic.offer(time_calls(lt_call(results[i].algo)), "#" + std::to_string(i));
          }
        }
        cublasLtMatmulPreferenceDestroy(preference);
      }

      Best enumerated;
      int timed = 0;
      for (int i = 0; i < (lt_columns ? id_count : 0); ++i) {
        cublasLtMatmulAlgo_t algo;
        if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                                   CUDA_R_16BF, CUDA_R_16BF, ids[i],
                                   &algo) != CUBLAS_STATUS_SUCCESS) {
          continue;
        }
        std::size_t written = 0;
        std::vector<std::uint32_t> tiles;
        if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0,
                                              &written) == CUBLAS_STATUS_SUCCESS &&
            written >= sizeof(std::uint32_t)) {
          tiles.resize(written / sizeof(std::uint32_t));
          if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(),
                                                tiles.size() * sizeof(std::uint32_t),
                                                &written) != CUBLAS_STATUS_SUCCESS) {
            tiles.clear();
          }
        }
        if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
        if (static_cast<int>(tiles.size()) > max_tiles) tiles.resize(max_tiles);
        std::int32_t splitk_support = 0;
        std::uint32_t reduction_mask = 0;
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk_support,
                                          sizeof(splitk_support), &written);
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK,
                                          &reduction_mask, sizeof(reduction_mask), &written);
        std::uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
        for (const std::uint32_t candidate :
             {static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE),
              static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE),
              static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE)}) {
          if (scheme == CUBLASLT_REDUCTION_SCHEME_NONE && (reduction_mask & candidate) != 0) {
            scheme = candidate;
          }
        }
        for (const std::uint32_t tile : tiles) {
          for (const std::uint32_t splits : {1u, 2u, 4u, 8u, 16u}) {
            if (splits > 1 && (splitk_support == 0 || scheme == CUBLASLT_REDUCTION_SCHEME_NONE)) {
              continue;
            }
            cublasLtMatmulAlgo_t configured = algo;
            const std::uint32_t reduction = splits > 1 ? scheme : CUBLASLT_REDUCTION_SCHEME_NONE;
            if (cublasLtMatmulAlgoConfigSetAttribute(&configured, CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                     &tile,
                                                     sizeof(tile)) != CUBLAS_STATUS_SUCCESS ||
                cublasLtMatmulAlgoConfigSetAttribute(&configured, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                     &splits,
                                                     sizeof(splits)) != CUBLAS_STATUS_SUCCESS ||
                cublasLtMatmulAlgoConfigSetAttribute(
                    &configured, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                    sizeof(reduction)) != CUBLAS_STATUS_SUCCESS) {
              continue;
            }
            cublasLtMatmulHeuristicResult_t result{};
            if (cublasLtMatmulAlgoCheck(lt, op, a, b, c, c, &configured, &result) !=
                    CUBLAS_STATUS_SUCCESS ||
                result.workspaceSize > kWorkspaceBytes) {
              continue;
            }
            ++timed;
            enumerated.offer(time_calls(lt_call(configured)),
                             "id " + std::to_string(ids[i]) + " tile " + std::to_string(tile) +
                                 " split-K " + std::to_string(splits));
          }
        }
      }
      cublasLtMatrixLayoutDestroy(a);
      cublasLtMatrixLayoutDestroy(b);
      cublasLtMatrixLayoutDestroy(c);
      cublasLtMatmulDescDestroy(op);

      const double bytes = static_cast<double>(weight_bytes) +
                           2.0 * static_cast<double>(rows) * static_cast<double>(s.k + s.n);
      std::printf("| %s | %lld | %.2f | %.2f | %.2f | %s | %.1e | %.2f | %.2f | %s | %d |\n",
                  s.name, static_cast<long long>(rows), bytes / bandwidth * 1e6, gemm_ex,
                  batched.us, batched.config.empty() ? "-" : batched.config.c_str(), batched_error,
                  heuristic.us, enumerated.us,
                  enumerated.config.empty() ? "-" : enumerated.config.c_str(), timed);
      std::fflush(stdout);
    }
    for (void* w : weights) cudaFree(w);
    cudaFree(in);
    cudaFree(out);
    cudaFree(partial);
  }
  cudaFree(workspace);
  cublasLtDestroy(lt);
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  return 0;
}
