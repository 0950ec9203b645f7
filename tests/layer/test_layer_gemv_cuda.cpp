// The whole layer's small-row GEMMs (layer/src/cuda/small_gemm.cu; label `gpu`) against an fp64
// product of the same bf16 operands: the one-row streamed and sliced kernels, the tiled kernel of
// 1 to 64 rows with and without split K, the fragment kernel of 1 to 8 rows in every variant, and
// the warpgroup kernel (warpgroup_gemm.cu) of 1 to 256 rows in its plans, on the decode shapes of
// the layers the benchmarks run and on shapes that end in partial tiles and stages, bf16 and f32
// outputs, plain and programmatic launches; outputs poisoned first and guarded, two runs bitwise
// equal.
#include <doctest/doctest.h>

#include <algorithm>
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

// Element `at` of an f32 or bf16 output, as float.
float value_at(const std::vector<unsigned char>& out, bool f32, std::int64_t at) {
  if (f32) {
    float v;
    std::memcpy(&v, out.data() + 4 * at, 4);
    return v;
  }
  std::uint16_t bits;
  std::memcpy(&bits, out.data() + 2 * at, 2);
  return kda::bf16_to_float(bits);
}

// ‖out − ref‖ / ‖ref‖ over the sampled columns of rows [rows, n] of out (row stride ldo), and
// whether every element (sampled or not) is finite.
template <typename Sampled>
double relative_error(const std::vector<unsigned char>& out, bool f32, std::int64_t rows,
                      std::int64_t n, std::int64_t ldo, const std::vector<double>& ref,
                      const Sampled& sampled, bool* finite) {
  double err2 = 0.0, ref2 = 0.0;
  *finite = true;
  for (std::int64_t m = 0; m < rows; ++m) {
    for (std::int64_t c = 0; c < n; ++c) {
      const float v = value_at(out, f32, m * ldo + c);
      *finite = *finite && std::isfinite(v);
      if (!sampled(c)) continue;
      const double r = ref[m * n + c];
      err2 += (v - r) * (v - r);
      ref2 += r * r;
    }
  }
  return std::sqrt(err2 / ref2);
}

std::vector<std::uint16_t> random_bits(std::size_t count, float amplitude, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  std::vector<std::uint16_t> values(count);
  for (std::uint16_t& v : values) v = kda::float_to_bf16(dist(rng));
  return values;
}

struct Shape {
  std::int64_t n, k;
};

}  // namespace

#ifdef KDA_HAVE_CUDA
using kda::layer::cuda::SmallGemmKernel;
using kda::layer::cuda::SmallGemmParams;

namespace {

// The operands of out[rows, n] = in[rows, k] · weight[n, k]ᵀ (rows ldi and ldo elements apart) in
// device buffers; the kernel and its options are the caller's to set.
SmallGemmParams gemm_operands(const DeviceBuffer& in, std::int64_t ldi, const DeviceBuffer& weight,
                              const DeviceBuffer& out, std::int64_t ldo, std::int64_t rows,
                              std::int64_t n, std::int64_t k) {
  SmallGemmParams p;
  p.in = static_cast<const std::uint16_t*>(in.get());
  p.ldi = ldi;
  p.weight = static_cast<const std::uint16_t*>(weight.get());
  p.out = out.get();
  p.ldo = ldo;
  p.rows = rows;
  p.n = n;
  p.k = k;
  return p;
}

// The fp64 product in[rows, k] (row stride ldi) · w[n, k]ᵀ at the weight rows `sampled` takes
// (zero elsewhere), [rows, n].
template <typename Sampled>
std::vector<double> sampled_product(const std::vector<std::uint16_t>& w,
                                    const std::vector<std::uint16_t>& x, std::int64_t rows,
                                    std::int64_t n, std::int64_t k, std::int64_t ldi,
                                    const Sampled& sampled) {
  std::vector<double> ref(static_cast<std::size_t>(rows * n), 0.0);
  for (std::int64_t m = 0; m < rows; ++m) {
    for (std::int64_t r = 0; r < n; ++r) {
      if (!sampled(r)) continue;
      double acc = 0.0;
      for (std::int64_t c = 0; c < k; ++c) {
        acc += static_cast<double>(kda::bf16_to_float(w[r * k + c])) *
               static_cast<double>(kda::bf16_to_float(x[m * ldi + c]));
      }
      ref[m * n + r] = acc;
    }
  }
  return ref;
}

// One few-row case's operands: random weights [n, k] and `rows` input rows ldi = k + 8 apart (the
// next two seeds), on the device; the output's row stride ldo = n + ldo_gap (3 unless given: its
// gaps must stay untouched); and the fp64 product at the weight rows `sampled` takes.
struct FewRowCase {
  std::int64_t rows, n, k, ldi, ldo;
  std::vector<double> ref;
  DeviceBuffer w, x;
  template <typename Sampled>
  FewRowCase(const Shape& s, std::int64_t rows_, std::uint64_t& seed, const Sampled& sampled,
             std::int64_t ldo_gap = 3)
      : rows(rows_), n(s.n), k(s.k), ldi(s.k + 8), ldo(s.n + ldo_gap) {
    const std::vector<std::uint16_t> w_host =
        random_bits(static_cast<std::size_t>(n * k), 1.0f, ++seed);
    const std::vector<std::uint16_t> x_host =
        random_bits(static_cast<std::size_t>(rows * ldi), 1.0f, ++seed);
    ref = sampled_product(w_host, x_host, rows, n, k, ldi, sampled);
    w = DeviceBuffer::from(w_host);
    x = DeviceBuffer::from(x_host);
  }
  DeviceBuffer output(bool f32) const {
    return DeviceBuffer(static_cast<std::size_t>(rows * ldo) * (f32 ? 4 : 2));
  }
  // The product into `out` (bf16, or f32); the kernel and its options are the caller's to set.
  SmallGemmParams params(const DeviceBuffer& out, bool f32) const {
    SmallGemmParams p = gemm_operands(x, ldi, w, out, ldo, rows, n, k);
    p.out_f32 = f32;
    return p;
  }
};

// Launches `p` twice into `out` (poisoned with 0xFF first) and checks what a few-row GEMM must
// give: the two runs bitwise equal, the guards intact, every element finite, the sampled rows
// within the tolerance of `ref`, and the gaps between output rows (ldo > n) untouched.
template <typename Sampled>
void check_few_row_gemm(const SmallGemmParams& p, DeviceBuffer& out, const std::vector<double>& ref,
                        const Sampled& sampled) {
  const std::size_t element = p.out_f32 ? 4 : 2;
  std::vector<std::vector<unsigned char>> runs;
  for (int run = 0; run < 2; ++run) {
    out.fill(0xFF);  // NaN in both formats: every element must be written
    REQUIRE(kda::layer::cuda::launch_small_gemm(p, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    runs.push_back(out.download<unsigned char>());
  }
  CHECK(runs[0] == runs[1]);
  CHECK(out.guards_intact());
  bool finite = false;
  const double rel = relative_error(runs[0], p.out_f32, p.rows, p.n, p.ldo, ref, sampled, &finite);
  CHECK(finite);
  CHECK(rel < (p.out_f32 ? 1e-5 : 4e-3));
  bool gaps = true;
  for (std::int64_t m = 0; m + 1 < p.rows; ++m) {
    for (std::int64_t c = p.n; c < p.ldo; ++c) {
      for (std::size_t b = 0; b < element; ++b) {
        gaps = gaps && runs[0][(m * p.ldo + c) * element + b] == 0xFF;
      }
    }
  }
  CHECK(gaps);
}

// What a few-row kernel refuses, through `fits` and its launch: rows past `max_rows`, a K not a
// multiple of 8, ldi below k, an input not 16-byte aligned.
void check_refusals(SmallGemmKernel kernel, std::int64_t max_rows,
                    bool (*fits)(const SmallGemmParams&)) {
  const DeviceBuffer dw(64 * 64 * 2), dx(16 * 72 * 2), dout(16 * 64 * 4);
  SmallGemmParams bad = gemm_operands(dx, 64, dw, dout, 64, 4, 64, 64);
  bad.kernel = kernel;
  CHECK(fits(bad));
  bad.rows = max_rows + 1;
  CHECK_FALSE(fits(bad));
  CHECK(kda::layer::cuda::launch_small_gemm(bad, nullptr) == cudaErrorInvalidValue);
  bad.rows = 4;
  bad.k = 60;
  CHECK_FALSE(fits(bad));
  bad.k = 64;
  bad.ldi = 56;
  CHECK_FALSE(fits(bad));
  bad.ldi = 64;
  bad.in = static_cast<const std::uint16_t*>(dx.get()) + 4;
  CHECK_FALSE(fits(bad));
  CHECK(kda::layer::cuda::launch_small_gemm(bad, nullptr) == cudaErrorInvalidValue);
}

}  // namespace
#endif

TEST_CASE("one-row GEMM: streamed and sliced kernels against fp64, every decode shape") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  // The benchmarks' layers (input projection, o_proj, g_proj, f_b of H = 32, its TP8 shard, K3's
  // TP8 shard), then partial last stages, a grid smaller than the device, rows of the streamed
  // kernel's bounds (256 and 16384 columns), shapes only the sliced kernel takes, and last stages
  // of fewer rows than the others where warps share a row.
  const Shape shapes[] = {{12576, 2304}, {2304, 4096}, {1800, 2304}, {2304, 512},   {4760, 7168},
                          {1536, 7168},  {7168, 1536}, {257, 256},   {3, 4096},     {999, 16384},
                          {4096, 128},   {77, 8},      {5, 16392},   {12575, 2304}, {4761, 7168}};
  std::uint64_t seed = 90;
  for (const Shape& s : shapes) {
    CAPTURE(s.n);
    CAPTURE(s.k);
    const std::vector<std::uint16_t> w =
        random_bits(static_cast<std::size_t>(s.n * s.k), 1.0f, ++seed);
    const std::vector<std::uint16_t> x = random_bits(static_cast<std::size_t>(s.k), 1.0f, ++seed);
    const std::vector<double> ref =
        sampled_product(w, x, 1, s.n, s.k, s.k, [](std::int64_t) { return true; });
    const DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
    for (const SmallGemmKernel kernel : {SmallGemmKernel::kStreamed, SmallGemmKernel::kSliced}) {
      for (const bool f32 : {false, true}) {
        for (const bool programmatic : {false, true}) {
          const int kernel_index = static_cast<int>(kernel);
          CAPTURE(kernel_index);
          CAPTURE(f32);
          CAPTURE(programmatic);
          DeviceBuffer out(static_cast<std::size_t>(s.n) * (f32 ? 4 : 2));
          SmallGemmParams p = gemm_operands(dx, s.k, dw, out, s.n, 1, s.n, s.k);
          p.out_f32 = f32;
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
          bool finite = false;
          const double rel = relative_error(
              runs[0], f32, 1, s.n, s.n, ref, [](std::int64_t) { return true; }, &finite);
          CHECK(finite);
          CHECK(rel < (f32 ? 1e-5 : 4e-3));
        }
      }
    }
  }
#endif
}

TEST_CASE("few-row GEMM: the tiled kernel against fp64, 1 to 64 rows, split K or not") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  // The benchmarks' layers' shapes, a K of one partial tile, N and K tails, the smallest K, and
  // K of two and three tiles (a ring never filled).
  const Shape shapes[] = {{12576, 2304}, {2304, 4096}, {1800, 2304}, {2304, 512}, {4760, 7168},
                          {1536, 7168},  {7168, 1536}, {100, 40},    {129, 200},  {3, 8},
                          {300, 128},    {70, 136},    {65, 192}};
  std::uint64_t seed = 300;
  for (const Shape& s : shapes) {
    for (const std::int64_t rows : {1, 2, 7, 8, 9, 17, 33, 64}) {
      CAPTURE(s.n);
      CAPTURE(s.k);
      CAPTURE(rows);
      // The reference on every 7th weight row and the last 70 (the partial last block): the
      // kernel's tiles do not tell these rows apart from the others.
      auto sampled = [&](std::int64_t r) { return r % 7 == 0 || r >= s.n - 70; };
      const FewRowCase c(s, rows, seed, sampled);
      DeviceBuffer scratch(std::size_t{8} << 20);
      // Workspace: none (no split), 8 MB (as many splits as the plan takes), and room for the
      // partial sums of two splits only (the plan's workspace bound).
      const std::size_t two_splits = static_cast<std::size_t>(2 * rows * s.n * 4);
      for (const std::size_t workspace : {std::size_t{0}, scratch.bytes(), two_splits}) {
        for (const bool f32 : {false, true}) {
          const bool programmatic = f32 == (workspace == 0);
          CAPTURE(workspace);
          CAPTURE(f32);
          CAPTURE(programmatic);
          DeviceBuffer out = c.output(f32);
          SmallGemmParams p = c.params(out, f32);
          p.kernel = SmallGemmKernel::kTiled;
          p.programmatic = programmatic;
          p.workspace = workspace > 0 ? scratch.get() : nullptr;
          p.workspace_bytes = std::min(workspace, scratch.bytes());
          REQUIRE(kda::layer::cuda::tiled_gemm_fits(p));
          check_few_row_gemm(p, out, c.ref, sampled);
        }
      }
    }
  }
  // What it refuses: rows past kTiledGemmMaxRows, a K not a multiple of 8, ldi below k.
  SmallGemmParams bad;
  bad.kernel = SmallGemmKernel::kTiled;
  bad.rows = kda::layer::cuda::kTiledGemmMaxRows + 1;
  bad.n = 64;
  bad.k = 64;
  bad.ldi = 64;
  bad.ldo = 64;
  CHECK_FALSE(kda::layer::cuda::tiled_gemm_fits(bad));
  bad.rows = 4;
  bad.k = 60;
  CHECK_FALSE(kda::layer::cuda::tiled_gemm_fits(bad));
  bad.k = 64;
  bad.ldi = 56;
  CHECK_FALSE(kda::layer::cuda::tiled_gemm_fits(bad));
  CHECK(kda::layer::cuda::launch_small_gemm(bad, nullptr) == cudaErrorInvalidValue);
#endif
}

TEST_CASE("few-row GEMM: the fragment kernel against fp64, every variant, 1 to 8 rows") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  // The decode shapes, tails of N (not a multiple of 16 or 32) and of K (not a multiple of 64,
  // 16-byte chunks past K within the last step), and the smallest K.
  const Shape shapes[] = {{12576, 2304}, {2304, 4096}, {1800, 2304}, {2304, 512}, {4760, 7168},
                          {1536, 7168},  {7168, 1536}, {4096, 128},  {100, 40},   {129, 200},
                          {3, 8},        {70, 136},    {65, 1000}};
  std::uint64_t seed = 900;
  for (const Shape& s : shapes) {
    for (const std::int64_t rows : {1, 2, 3, 7, 8}) {
      CAPTURE(s.n);
      CAPTURE(s.k);
      CAPTURE(rows);
      auto sampled = [&](std::int64_t r) { return r % 5 == 0 || r >= s.n - 40; };
      const FewRowCase c(s, rows, seed, sampled);
      // Every variant: warps a panel 0 (by shape) / 1 / 2 / 4 / 8, one or two 16-row tiles a
      // warp (0: by shape), 8 or 16 loads a lane in flight (0: by shape); bf16 and f32 out, plain
      // and programmatic.
      int variant = 0;
      for (const int split : {0, 1, 2, 4, 8}) {
        for (const int row_tiles : {0, 1, 2}) {
          for (const int loads : {0, 8, 16}) {
            const bool f32 = variant % 2 == 0, programmatic = variant % 3 == 0;
            ++variant;
            CAPTURE(split);
            CAPTURE(row_tiles);
            CAPTURE(loads);
            CAPTURE(f32);
            DeviceBuffer out = c.output(f32);
            SmallGemmParams p = c.params(out, f32);
            p.kernel = SmallGemmKernel::kFragment;
            p.programmatic = programmatic;
            p.split = split;
            p.fragment_row_tiles = row_tiles;
            p.fragment_loads = loads;
            REQUIRE(kda::layer::cuda::fragment_gemm_fits(p));
            check_few_row_gemm(p, out, c.ref, sampled);
          }
        }
      }
    }
  }
  check_refusals(SmallGemmKernel::kFragment, kda::layer::cuda::kFragmentGemmMaxRows,
                 kda::layer::cuda::fragment_gemm_fits);
#endif
}

TEST_CASE("few-row GEMM: the warpgroup kernel against fp64, 1 to 256 rows, every plan") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  // The decode shapes, tails of N (not a multiple of 64) and of K (not a multiple of 64: the last
  // stage's columns past K arrive as zeros), K of one stage, and the smallest K.
  const Shape shapes[] = {{12576, 2304}, {2304, 4096}, {1800, 2304}, {2304, 512}, {4760, 7168},
                          {1536, 7168},  {7168, 1536}, {4096, 128},  {100, 40},   {129, 200},
                          {3, 8},        {70, 136},    {65, 1000}};
  std::uint64_t seed = 1200;
  // Runs whose plan splits K over a cluster: a forced split plan may be refused (the device's
  // cluster capacity), but not all of them, or the distributed shared memory sums went untested.
  int cluster_runs = 0;
  for (const Shape& s : shapes) {
    for (const std::int64_t rows : {1, 2, 7, 8, 9, 16, 32, 33, 64, 65, 128, 200, 256}) {
      CAPTURE(s.n);
      CAPTURE(s.k);
      CAPTURE(rows);
      auto sampled = [&](std::int64_t r) { return r % 13 == 0 || r >= s.n - 70; };
      // Even row counts with output rows a multiple of 4 apart where n is one: the stores of four
      // values at once; odd ones with rows 3 apart: one value at a time.
      const FewRowCase c(s, rows, seed, sampled, rows % 2 == 0 ? 4 : 3);
      // The plan by shape, then forced consumer warpgroups (64 weight rows each) and K slices
      // (blocks a cluster); bf16 and f32 out, plain and programmatic.
      const int plans[][2] = {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 8}, {1, 5}, {2, 1}};
      int variant = 0;
      for (const auto& plan : plans) {
        const bool f32 = variant % 2 == 1, programmatic = variant % 3 == 2;
        ++variant;
        CAPTURE(plan[0]);
        CAPTURE(plan[1]);
        CAPTURE(f32);
        CAPTURE(programmatic);
        DeviceBuffer out = c.output(f32);
        SmallGemmParams p = c.params(out, f32);
        p.kernel = SmallGemmKernel::kWarpgroup;
        p.programmatic = programmatic;
        p.warpgroup_consumers = plan[0];
        p.warpgroup_splits = plan[1];
        if (!kda::layer::cuda::warpgroup_gemm_fits(p)) {
          // Forced plans the kernel has no variant for (registers), with more slices than stages
          // of K, or of clusters the device may not hold; the plan by shape always has one.
          CHECK(plan[0] + plan[1] > 0);
          const std::int64_t chunks = (s.k + 63) / 64;
          const bool registers = (rows > 64 && plan[0] == 4) || (rows > 128 && plan[0] >= 3);
          CHECK((registers || plan[1] > chunks || plan[1] > 1));
          continue;
        }
        const kda::layer::cuda::WarpgroupGemmPlan chosen = kda::layer::cuda::warpgroup_gemm_plan(p);
        CHECK(chosen.n_rows >= rows);
        CHECK(chosen.tiles * 64 * chosen.consumers >= s.n);
        if (chosen.splits > 1) ++cluster_runs;
        check_few_row_gemm(p, out, c.ref, sampled);
      }
    }
  }
  INFO("no plan ran K split over a cluster");
  CHECK(cluster_runs > 0);
  check_refusals(SmallGemmKernel::kWarpgroup, kda::layer::cuda::kWarpgroupGemmMaxRows,
                 kda::layer::cuda::warpgroup_gemm_fits);
#endif
}

// A programmatic launch reads its input only after the kernel before it is done: that kernel (the
// sliced one-row kernel, the tiled kernel, or past its 64 rows the warpgroup kernel) writes the
// input, the streamed / tiled / warpgroup kernel launched right after it as its programmatic
// dependent reads it, against fp64 of what the first one wrote.
TEST_CASE(
    "few-row GEMMs launched as programmatic dependents read the input the kernel before wrote") {
  if (!kda::test::gpu_or_skip()) return;
#ifdef KDA_HAVE_CUDA
  const std::int64_t k0 = 4096, k = 2304, n = 12576;
  std::uint64_t seed = 700;
  for (const std::int64_t rows : {1, 64, 200}) {
    CAPTURE(rows);
    const std::vector<std::uint16_t> w0 =
        random_bits(static_cast<std::size_t>(k * k0), 0.05f, ++seed);
    const std::vector<std::uint16_t> x0 =
        random_bits(static_cast<std::size_t>(rows * k0), 1.0f, ++seed);
    const std::vector<std::uint16_t> w = random_bits(static_cast<std::size_t>(n * k), 1.0f, ++seed);
    const DeviceBuffer dw0 = DeviceBuffer::from(w0), dx0 = DeviceBuffer::from(x0),
                       dw = DeviceBuffer::from(w);
    DeviceBuffer x(static_cast<std::size_t>(rows * k) * 2),
        out(static_cast<std::size_t>(rows * n) * 2);
    DeviceBuffer scratch(std::size_t{8} << 20);
    SmallGemmParams first = gemm_operands(dx0, k0, dw0, x, k, rows, k, k0);
    first.kernel = rows == 1    ? SmallGemmKernel::kSliced
                   : rows <= 64 ? SmallGemmKernel::kTiled
                                : SmallGemmKernel::kWarpgroup;
    first.workspace = scratch.get();
    first.workspace_bytes = scratch.bytes();
    SmallGemmParams second = gemm_operands(x, k, dw, out, n, rows, n, k);
    second.kernel = rows == 1    ? SmallGemmKernel::kStreamed
                    : rows <= 64 ? SmallGemmKernel::kTiled
                                 : SmallGemmKernel::kWarpgroup;
    second.programmatic = true;
    second.workspace = first.workspace;
    second.workspace_bytes = first.workspace_bytes;
    // Two rounds on a stream: the second round's first kernel rewrites x while nothing waits.
    cudaStream_t stream = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    x.fill(0xFF);
    for (int round = 0; round < 2; ++round) {
      REQUIRE(kda::layer::cuda::launch_small_gemm(first, stream) == cudaSuccess);
      REQUIRE(kda::layer::cuda::launch_small_gemm(second, stream) == cudaSuccess);
    }
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    cudaStreamDestroy(stream);
    const std::vector<std::uint16_t> xs = x.download<std::uint16_t>();
    const std::vector<unsigned char> got = out.download<unsigned char>();
    auto sampled = [](std::int64_t r) { return r % 11 == 0; };
    const std::vector<double> ref = sampled_product(w, xs, rows, n, k, k, sampled);
    bool finite = false;
    const double rel = relative_error(got, false, rows, n, n, ref, sampled, &finite);
    CHECK(finite);
    CHECK(rel < 4e-3);
  }
#endif
}
