// The whole layer's one-row GEMM (layer/src/cuda/small_gemm.cu; label `gpu`): the streamed and the
// sliced kernel against an fp64 product of the same bf16 operands, on the decode shapes of the
// layers the benchmarks run and on shapes that end in a partial stage, bf16 and f32 outputs, plain
// and programmatic launches; outputs poisoned first and guarded, two runs bitwise equal.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda/bf16.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/kernels.hpp"
#endif

namespace {

using kda::test::DeviceBuffer;

std::vector<std::uint16_t> random_bits(std::size_t count, float amplitude, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  std::vector<std::uint16_t> values(count);
  for (std::uint16_t& v : values) v = kda::float_to_bf16(dist(rng));
  return values;
}

}  // namespace

TEST_CASE("one-row GEMM: streamed and sliced kernels against fp64, every decode shape") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  using kda::layer::cuda::SmallGemmKernel;
  using kda::layer::cuda::SmallGemmParams;
  struct Shape {
    std::int64_t n, k;
  };
  // The benchmarks' layers (input projection, o_proj, g_proj, f_b of H = 32, its TP8 shard, K3's
  // TP8 shard), then partial last stages, a grid smaller than the device, rows of the streamed
  // kernel's bounds (256 and 16384 columns) and shapes only the sliced kernel takes.
  const Shape shapes[] = {{12576, 2304}, {2304, 4096}, {1800, 2304}, {2304, 512}, {4760, 7168},
                          {1536, 7168},  {7168, 1536}, {257, 256},   {3, 4096},   {999, 16384},
                          {4096, 128},   {77, 8},      {5, 16392}};
  std::uint64_t seed = 90;
  for (const Shape& s : shapes) {
    CAPTURE(s.n);
    CAPTURE(s.k);
    const std::vector<std::uint16_t> w =
        random_bits(static_cast<std::size_t>(s.n * s.k), 1.0f, ++seed);
    const std::vector<std::uint16_t> x = random_bits(static_cast<std::size_t>(s.k), 1.0f, ++seed);
    std::vector<double> ref(static_cast<std::size_t>(s.n));
    double ref_norm = 0.0;
    for (std::int64_t r = 0; r < s.n; ++r) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < s.k; ++c) {
        acc += static_cast<double>(kda::bf16_to_float(w[r * s.k + c])) *
               static_cast<double>(kda::bf16_to_float(x[c]));
      }
      ref[r] = acc;
      ref_norm += acc * acc;
    }
    ref_norm = std::sqrt(ref_norm);
    const DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
    for (const SmallGemmKernel kernel : {SmallGemmKernel::kStreamed, SmallGemmKernel::kSliced}) {
      for (const bool f32 : {false, true}) {
        for (const bool programmatic : {false, true}) {
          const int kernel_index = static_cast<int>(kernel);
          CAPTURE(kernel_index);
          CAPTURE(f32);
          CAPTURE(programmatic);
          DeviceBuffer out(static_cast<std::size_t>(s.n) * (f32 ? 4 : 2));
          SmallGemmParams p;
          p.in = static_cast<const std::uint16_t*>(dx.get());
          p.ldi = s.k;
          p.weight = static_cast<const std::uint16_t*>(dw.get());
          p.out = out.get();
          p.ldo = s.n;
          p.out_f32 = f32;
          p.rows = 1;
          p.n = s.n;
          p.k = s.k;
          p.kernel = kernel;
          p.programmatic = programmatic;
          std::vector<std::vector<unsigned char>> runs;
          bool taken = true;
          for (int run = 0; run < 2; ++run) {
            out.fill(0xFF);  // NaN in both formats: every element must be written
            const cudaError_t err = kda::layer::cuda::launch_small_gemm(p, nullptr);
            if (err == cudaErrorInvalidValue && kernel == SmallGemmKernel::kStreamed) {
              taken = false;
              break;
            }
            REQUIRE(err == cudaSuccess);
            REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
            runs.push_back(out.download<unsigned char>());
          }
          // The streamed kernel takes rows of 256 to 16384 columns.
          CHECK(taken == (kernel != SmallGemmKernel::kStreamed || (s.k >= 256 && s.k <= 16384)));
          CHECK(taken ==
                (kernel != SmallGemmKernel::kStreamed || kda::layer::cuda::streamed_gemm_fits(p)));
          if (!taken) continue;
          CHECK(runs[0] == runs[1]);
          CHECK(out.guards_intact());
          double err2 = 0.0;
          bool finite = true;
          for (std::int64_t r = 0; r < s.n; ++r) {
            float v;
            if (f32) {
              std::memcpy(&v, runs[0].data() + 4 * r, 4);
            } else {
              std::uint16_t bits;
              std::memcpy(&bits, runs[0].data() + 2 * r, 2);
              v = kda::bf16_to_float(bits);
            }
            finite = finite && std::isfinite(v);
            err2 += (v - ref[r]) * (v - ref[r]);
          }
          const double rel = std::sqrt(err2) / ref_norm;
          CHECK(finite);
          CHECK(rel < (f32 ? 1e-5 : 4e-3));
        }
      }
    }
  }
#endif
}
