// kda-gemv-probe — the whole layer's small-row GEMMs (layer/src/cuda/small_gemm.cu) against cuBLAS
// on the shapes a decode step runs (decode_gemm_shapes.hpp): the input projection, o_proj and the
// low-rank second factors of Kimi-Linear-48B (hidden 2304, H = 32), its TP8 shard and Kimi K3's TP8
// shard. One row (a decode step of one sequence): the kernel as the layer runs it (the sliced
// kernel, slices by shape), the streamed kernel launched plainly and as a programmatic dependent of
// the call before (its first stages then load while that call finishes), and the sliced kernel with
// each row cut in two. 8 and 64 rows (decode steps of a small batch): the tiled kernel (split K in
// a 32 MB workspace, as the layer gives it) against cuBLAS. Each call reads another copy of the
// weights (copies beyond three times L2), CUDA events around 50 calls after 10 warm-up, median of 5
// such rounds; bandwidth = weight bytes / time. Back-to-back calls of one GEMM overlap their tails,
// which a decode step's GEMM cannot: it waits for the kernel before it. The third table therefore
// times one row in a chain, as the layer runs it: 50 pairs of (a one-block kernel that writes the
// GEMM's input row, the GEMM) captured in a CUDA graph and replayed, each GEMM on another copy of
// the weights, the pair's time less the writer's alone; "programmatic" launches the GEMM as a
// programmatic dependent of the writer, which allows it at its start (as the fused decode step
// allows o_proj), so the GEMM's first weight loads are in flight before the row is written; and 8
// and 64 rows, the tiled kernel against cuBLAS, in the same chain. The last table: 1, 2 and 8 rows
// on the fragment kernel, as the layer plans it and the best of its variants, in the same chain.
// Then 8 to 256 rows on the warpgroup kernel (warpgroup_gemm.cu), its plan by shape and the best
// of every forced plan (consumer warpgroups 1-4, K slices 1-8), against cuBLAS in the same chain.
// CUDA only.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/kernels.hpp"
#include "decode_gemm_shapes.hpp"
#include "gemm_chain.cuh"

namespace {

using kda_bench::check;

using Shape = kda_bench::DecodeGemmShape;

using kda_bench::Operands;

}  // namespace

int main(int argc, char** argv) {
  // --warpgroup: the last table alone.
  const bool warpgroup_only = argc > 1 && std::string(argv[1]) == "--warpgroup";
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  cudaStream_t stream = nullptr;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cublasSetStream(handle, stream);
  constexpr std::size_t kWorkspace = std::size_t{32} << 20;
  void* workspace = nullptr;
  check(cudaMalloc(&workspace, kWorkspace), "cudaMalloc");
  const auto& shapes = kda_bench::kDecodeGemmShapes;
  using kda::layer::cuda::SmallGemmKernel;
  using kda::layer::cuda::SmallGemmParams;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  // Median over 5 rounds of 50 calls (after 10), each call on the next copy of the weights, us;
  // -1 where `launch` refuses the shape (returns false).
  auto time_calls = [&](const std::vector<void*>& weights, auto&& launch) {
    std::vector<double> rounds;
    for (int round = 0; round < 5; ++round) {
      for (int it = 0; it < 60; ++it) {
        if (it == 10) cudaEventRecord(a, stream);
        if (!launch(weights[it % weights.size()])) return -1.0;
      }
      cudaEventRecord(b, stream);
      check(cudaEventSynchronize(b), "run");
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      rounds.push_back(ms * 1e3 / 50);
    }
    std::sort(rounds.begin(), rounds.end());
    return rounds[2];
  };
  auto cublas = [&](void* w, const void* in, void* out, const Shape& s, std::int64_t rows) {
    kda_bench::cublas_gemm(handle, w, in, out, s, rows);
    return true;
  };
  auto params = [&](void* w, const void* in, void* out, const Shape& s, std::int64_t rows,
                    SmallGemmKernel kernel, bool programmatic, int split) {
    SmallGemmParams p;
    p.kernel = kernel;
    p.programmatic = programmatic;
    p.split = split;
    p.in = static_cast<const std::uint16_t*>(in);
    p.ldi = s.k;
    p.weight = static_cast<const std::uint16_t*>(w);
    p.out = out;
    p.ldo = s.n;
    p.rows = rows;
    p.n = s.n;
    p.k = s.k;
    p.workspace = workspace;
    p.workspace_bytes = kWorkspace;
    return p;
  };
  auto small = [&](void* w, const void* in, void* out, const Shape& s, std::int64_t rows,
                   SmallGemmKernel kernel, bool programmatic, int split) {
    const cudaError_t err = kda::layer::cuda::launch_small_gemm(
        params(w, in, out, s, rows, kernel, programmatic, split), stream);
    if (err == cudaErrorInvalidValue) {
      cudaGetLastError();
      return false;
    }
    check(err, "launch_small_gemm");
    return true;
  };
  auto cell = [](double us, double bytes) {
    if (us < 0) {
      std::printf(" - |");
    } else {
      std::printf(" %.2f (%.2f) |", us, bytes / us / 1e6);
    }
  };
  // us per (writer, GEMM) pair (gemm_chain.cuh); without the GEMM, the writer's alone.
  auto chain_us = [&](const Shape& s, const Operands& operands, auto&& launch_gemm,
                      bool with_gemm) {
    return kda_bench::chain_us(stream, operands.in, s.k, operands.weights, launch_gemm, with_gemm);
  };
  // cuBLAS allocates nothing under capture with a workspace of the caller's.
  cublasSetWorkspace(handle, workspace, kWorkspace);
  if (!warpgroup_only) {
    for (const bool one_row : {true, false}) {
      if (one_row) {
        std::printf(
            "kda-gemv-probe on %s: one row, bf16 weights [n, k], us (TB/s of weight reads)\n\n"
            "| shape | n | k | weights MB | as the layer runs it | streamed | streamed, "
            "programmatic | sliced, split 2 | cuBLAS "
            "|\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            "\n",
            prop.name);
      } else {
        std::printf(
            "\nA few rows: the tiled kernel against cuBLAS, us (TB/s of weight reads)\n\n"
            "| shape | n | k | weights MB | tiled, 8 rows | cuBLAS, 8 rows | tiled, 64 rows | "
            "cuBLAS, "
            "64 rows |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
      }
      for (const Shape& s : shapes) {
        const Operands operands(s, prop);
        const std::size_t bytes = operands.bytes;
        const std::vector<void*>& weights = operands.weights;
        void *in = operands.in, *out = operands.out;
        std::printf("| %s | %lld | %lld | %.1f |", s.name, static_cast<long long>(s.n),
                    static_cast<long long>(s.k), bytes / 1e6);
        if (one_row) {
          const SmallGemmKernel sliced = SmallGemmKernel::kSliced,
                                streamed = SmallGemmKernel::kStreamed;
          cell(time_calls(weights,
                          [&](void* w) { return small(w, in, out, s, 1, sliced, false, 0); }),
               bytes);
          cell(time_calls(weights,
                          [&](void* w) { return small(w, in, out, s, 1, streamed, false, 0); }),
               bytes);
          cell(time_calls(weights,
                          [&](void* w) { return small(w, in, out, s, 1, streamed, true, 0); }),
               bytes);
          cell(time_calls(weights,
                          [&](void* w) { return small(w, in, out, s, 1, sliced, false, 2); }),
               bytes);
          cell(time_calls(weights, [&](void* w) { return cublas(w, in, out, s, 1); }), bytes);
        } else {
          for (const std::int64_t rows : {8, 64}) {
            cell(time_calls(weights,
                            [&](void* w) {
                              return small(w, in, out, s, rows, SmallGemmKernel::kTiled, false, 0);
                            }),
                 bytes);
            cell(time_calls(weights, [&](void* w) { return cublas(w, in, out, s, rows); }), bytes);
          }
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }

    // One row in a chain (the top of this file): us per GEMM, the pair's time less the writer's.
    std::printf(
        "\nIn a chain (after a kernel that writes the input's first row; graph replays), us (TB/s "
        "of "
        "weight reads)\n\n| shape | writer alone | sliced (as the layer) | sliced, programmatic | "
        "sliced, split 2 | streamed, programmatic | cuBLAS | tiled, 8 rows | cuBLAS, 8 rows | "
        "tiled, 64 rows | cuBLAS, 64 rows "
        "|\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "\n");
    for (const Shape& s : shapes) {
      const Operands operands(s, prop);
      const std::size_t bytes = operands.bytes;
      const std::vector<void*>& weights = operands.weights;
      void *in = operands.in, *out = operands.out;
      const double writer = chain_us(
          s, operands, [](void*) {}, false);
      std::printf("| %s | %.2f |", s.name, writer);
      const SmallGemmKernel sliced = SmallGemmKernel::kSliced,
                            streamed = SmallGemmKernel::kStreamed;
      auto gemm_cell = [&](auto&& launch_gemm) {
        cell(chain_us(s, operands, launch_gemm, true) - writer, static_cast<double>(bytes));
      };
      gemm_cell([&](void* w) { small(w, in, out, s, 1, sliced, false, 0); });
      gemm_cell([&](void* w) { small(w, in, out, s, 1, sliced, true, 0); });
      gemm_cell([&](void* w) { small(w, in, out, s, 1, sliced, false, 2); });
      if (kda::layer::cuda::streamed_gemm_fits(
              params(weights[0], in, out, s, 1, streamed, true, 0))) {
        gemm_cell([&](void* w) { small(w, in, out, s, 1, streamed, true, 0); });
      } else {
        cell(-1.0, 0.0);
      }
      gemm_cell([&](void* w) { cublas(w, in, out, s, 1); });
      for (const std::int64_t rows : {8, 64}) {
        gemm_cell([&](void* w) { small(w, in, out, s, rows, SmallGemmKernel::kTiled, false, 0); });
        gemm_cell([&](void* w) { cublas(w, in, out, s, rows); });
      }
      std::printf("\n");
      std::fflush(stdout);
    }

    // The fragment kernel (1 to 8 rows) in the same chain: its plan by shape, and the best of its
    // variants (warps a panel 1-8, one or two 16-row tiles a warp, 8 or 16 loads a lane in flight).
    std::printf(
        "\nThe fragment kernel in the chain, us (TB/s of weight reads); best variant as (warps a "
        "panel, row tiles a warp, loads a lane)\n\n| shape | rows | cuBLAS | tiled | fragment | "
        "best fragment | variant |\n|---|---:|---:|---:|---:|---:|---|\n");
    for (const Shape& s : shapes) {
      const Operands operands(s, prop);
      const std::size_t bytes = operands.bytes;
      void *in = operands.in, *out = operands.out;
      const double writer = chain_us(
          s, operands, [](void*) {}, false);
      auto fragment = [&](void* w, std::int64_t rows, int split, int row_tiles, int loads) {
        SmallGemmParams p = params(w, in, out, s, rows, SmallGemmKernel::kFragment, false, split);
        p.fragment_row_tiles = row_tiles;
        p.fragment_loads = loads;
        check(kda::layer::cuda::launch_small_gemm(p, stream), "fragment");
      };
      for (const std::int64_t rows : {1, 2, 8}) {
        std::printf("| %s | %lld |", s.name, static_cast<long long>(rows));
        auto gemm_us = [&](auto&& launch_gemm) {
          return chain_us(s, operands, launch_gemm, true) - writer;
        };
        cell(gemm_us([&](void* w) { cublas(w, in, out, s, rows); }), static_cast<double>(bytes));
        cell(gemm_us(
                 [&](void* w) { small(w, in, out, s, rows, SmallGemmKernel::kTiled, false, 0); }),
             static_cast<double>(bytes));
        cell(gemm_us([&](void* w) { fragment(w, rows, 0, 0, 0); }), static_cast<double>(bytes));
        double best = 1e30;
        int best_split = 0, best_tiles = 0, best_loads = 0;
        for (const int split : {1, 2, 4, 8}) {
          for (const int row_tiles : {1, 2}) {
            for (const int loads : {8, 16}) {
              const double us =
                  gemm_us([&](void* w) { fragment(w, rows, split, row_tiles, loads); });
              if (us < best) {
                best = us;
                best_split = split;
                best_tiles = row_tiles;
                best_loads = loads;
              }
            }
          }
        }
        cell(best, static_cast<double>(bytes));
        std::printf(" (%d, %d, %d) |\n", best_split, best_tiles, best_loads);
        std::fflush(stdout);
      }
    }
  }
  // The warpgroup kernel (8 to 256 rows) in the same chain: its plan by shape, and the best of
  // every forced plan.
  std::printf(
      "\nThe warpgroup kernel in the chain, us (TB/s of weight reads); plans as (consumer "
      "warpgroups, K slices)\n\n| shape | rows | cuBLAS | warpgroup | plan | best warpgroup | "
      "best plan |\n|---|---:|---:|---:|---|---:|---|\n");
  for (const Shape& s : shapes) {
    const Operands operands(s, prop);
    const std::size_t bytes = operands.bytes;
    void *in = operands.in, *out = operands.out;
    const double writer = chain_us(
        s, operands, [](void*) {}, false);
    for (const std::int64_t rows : {8, 16, 32, 64, 128, 256}) {
      auto gemm_us = [&](auto&& launch_gemm) {
        return chain_us(s, operands, launch_gemm, true) - writer;
      };
      auto warpgroup_params = [&](void* w, int consumers, int splits) {
        SmallGemmParams p = params(w, in, out, s, rows, SmallGemmKernel::kWarpgroup, false, 0);
        p.warpgroup_consumers = consumers;
        p.warpgroup_splits = splits;
        return p;
      };
      const kda::layer::cuda::WarpgroupGemmPlan plan =
          kda::layer::cuda::warpgroup_gemm_plan(warpgroup_params(operands.weights[0], 0, 0));
      std::printf("| %s | %lld |", s.name, static_cast<long long>(rows));
      cell(gemm_us([&](void* w) { cublas(w, in, out, s, rows); }), static_cast<double>(bytes));
      cell(gemm_us([&](void* w) {
             check(kda::layer::cuda::launch_small_gemm(warpgroup_params(w, 0, 0), stream),
                   "warpgroup");
           }),
           static_cast<double>(bytes));
      std::printf(" (%d, %d) |", plan.consumers, plan.splits);
      double best = 1e30;
      int best_c = 0, best_s = 0;
      for (int c = 1; c <= 4; ++c) {
        for (int split = 1; split <= 8; ++split) {
          if (!kda::layer::cuda::warpgroup_gemm_fits(
                  warpgroup_params(operands.weights[0], c, split))) {
            continue;
          }
          const double us = gemm_us([&](void* w) {
            check(kda::layer::cuda::launch_small_gemm(warpgroup_params(w, c, split), stream),
                  "warpgroup");
          });
          if (us < best) {
            best = us;
            best_c = c;
            best_s = split;
          }
        }
      }
      cell(best, static_cast<double>(bytes));
      std::printf(" (%d, %d) |\n", best_c, best_s);
      std::fflush(stdout);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(workspace);
  cublasDestroy(handle);
  return 0;
}
