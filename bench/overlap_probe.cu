// kda-overlap-probe: how the CUDA prefill's two phases share the GPU when they run at the same
// time, the question behind a fused kernel (docs/design/prefill.md). Not part of
// the library, and not a test: timings only.
//
// Two independent problems A and B of one shape (bounded gate, no states). A's chunk records are
// built once; then, median of 9 runs after 2 warm-ups each:
//   P        B's prepare kernel alone,
//   R        A's recurrence alone (one block shape per row of the table),
//   P + R    one after the other on one stream,
//   P || R   both at once on two streams (launched recurrence first, then prepare first).
// "hidden" = ((P + R) - (P || R)) / min(P, R), both measured: 0 when running them together gains
// nothing, 1 when the shorter one is hidden entirely. A fused kernel also saves the record round
// trip through DRAM, which this probe keeps (both phases still write and read their records), so it
// measures only how well the phases share the SMs' issue slots, memory pipes and shared memory.
//
//   kda-overlap-probe [--case NAME]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "cuda/prefill_kernels.cuh"

namespace d = kda::detail;
using kda_bench::fill;
using kda_bench::median_ms;

namespace {

void check(const kda::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "kda-overlap-probe: %s: %s\n", what, st.to_string().c_str());
    std::exit(1);
  }
}

// One fixed-length problem (N rows of L tokens, H heads) with its inputs, output and workspace.
struct Problem {
  int heads = 0;
  std::int64_t rows = 0, len = 0, slots = 0;
  std::vector<void*> buffers;
  d::PrefillParams prm{};

  Problem() = default;
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    CK(cudaMalloc(&p, bytes));
    buffers.push_back(p);
    return p;
  }
  ~Problem() {
    for (void* p : buffers) cudaFree(p);
  }
};

void make_problem(Problem* pb, int H, std::int64_t N, std::int64_t L, std::uint64_t seed) {
  pb->heads = H;
  pb->rows = N;
  pb->len = L;
  const std::int64_t T = N * L, elems = T * H * d::D;
  auto bf = [&](std::int64_t n, float lo, float hi, std::uint64_t sd) {
    auto* p = static_cast<std::uint16_t*>(pb->alloc(static_cast<std::size_t>(n) * 2));
    fill(p, n, sd, lo, hi);
    return reinterpret_cast<const d::bf16*>(p);
  };
  d::PrefillParams& p = pb->prm;
  p.in.q = bf(elems, -1, 1, seed + 1);
  p.in.k = bf(elems, -1, 1, seed + 2);
  p.in.v = bf(elems, -1, 1, seed + 3);
  p.in.g = bf(elems, -3, 1, seed + 4);
  p.in.beta = bf(T * H, -2, 2, seed + 5);
  auto* a_log = static_cast<float*>(pb->alloc(static_cast<std::size_t>(H) * 4));
  auto* dt_bias = static_cast<float*>(pb->alloc(static_cast<std::size_t>(H) * d::D * 4));
  fill(a_log, H, seed + 6, 0.0f, 2.7f);
  fill(dt_bias, H * d::D, seed + 7, -1.0f, 1.0f);
  p.in.A_log = a_log;
  p.in.dt_bias = dt_bias;
  p.seqs.cu = nullptr;
  p.seqs.cu_is_64 = 0;
  p.seqs.row_len = L;
  p.seqs.total = T;
  p.seqs.num_seqs = N;
  p.num_heads = H;
  p.gate = kda::GateMode::kLowerBound;
  p.lower_bound = -5.0f;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d::D));
  p.initial_kind = d::StateKind::kNone;
  p.final_kind = d::StateKind::kNone;
  p.out = static_cast<d::bf16*>(pb->alloc(static_cast<std::size_t>(elems) * 2));
  std::uint64_t slots = 0;
  d::num_chunk_slots(static_cast<std::uint64_t>(T), static_cast<std::uint64_t>(N), &slots);
  pb->slots = static_cast<std::int64_t>(slots);
  p.num_chunk_slots = pb->slots;
  p.records = static_cast<unsigned char*>(
      pb->alloc(static_cast<std::size_t>(pb->slots) * H * d::ChunkRecord::kBytes));
  p.seg_chunks = d::kNoSplit;
}

const char* shape_name(d::RecurrenceShape s) {
  switch (s) {
    case d::RecurrenceShape::kCols32:
      return "32 columns, 2 warps";
    case d::RecurrenceShape::kCols64:
      return "64 columns, 4 warps";
    case d::RecurrenceShape::kCols128:
      return "128 columns, 8 warps";
    case d::RecurrenceShape::kCols128Paired:
      return "128 columns, 4 warps x 2 m-tiles";
  }
  return "?";
}

struct Case {
  const char* name;
  int heads;
  std::int64_t rows, len;
  std::vector<d::RecurrenceShape> shapes;  // the launcher's choice first
};

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--case" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: kda-overlap-probe [--case NAME]\n");
      return 2;
    }
  }
  using S = d::RecurrenceShape;
  const std::vector<Case> cases = {
      {"h64-8x1024", 64, 8, 1024, {S::kCols128Paired, S::kCols128}},
      {"h96-8x1024", 96, 8, 1024, {S::kCols128Paired, S::kCols128}},
      {"h32-16x2048", 32, 16, 2048, {S::kCols128Paired, S::kCols128}},
      {"h12-8x4096", 12, 8, 4096, {S::kCols64, S::kCols128}},
      {"h32-1seq", 32, 1, 8192, {S::kCols32, S::kCols64}},
  };
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n\n", prop.name, prop.multiProcessorCount);
  std::printf(
      "| case | recurrence block | P ms | R ms | P + R ms | P \\|\\| R ms (R first) | P \\|\\| R "
      "ms "
      "(P first) | hidden |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  for (const Case& c : cases) {
    if (!only.empty() && only != c.name) continue;
    Problem a, b;
    make_problem(&a, c.heads, c.rows, c.len, 100);
    make_problem(&b, c.heads, c.rows, c.len, 200);
    check(d::launch_prepare(a.prm, a.slots, d::kPrepPipelinedBlocksPerSm, s1), "prepare A");
    CK(cudaStreamSynchronize(s1));
    auto prep = [&](cudaStream_t s) {
      check(d::launch_prepare(b.prm, b.slots, d::kPrepPipelinedBlocksPerSm, s), "prepare B");
    };
    for (const S shape : c.shapes) {
      auto rec = [&](cudaStream_t s) {
        check(d::launch_recurrence(a.prm, d::RecurrencePass::kFirst, false, shape, a.rows, d::D, s),
              "recurrence A");
      };
      auto both = [&](bool rec_first) {
        CK(cudaEventRecord(fork, s1));
        CK(cudaStreamWaitEvent(s2, fork, 0));
        if (rec_first) {
          rec(s1);
          prep(s2);
        } else {
          prep(s2);
          rec(s1);
        }
        CK(cudaEventRecord(join, s2));
        CK(cudaStreamWaitEvent(s1, join, 0));
      };
      // Median of 9 timed runs after 2, each enqueued on s1 (`both` forks to s2 and joins).
      auto timed = [&](auto&& run) { return median_ms([&](int) { run(); }, 2, 9, s1); };
      const double p = timed([&] { prep(s1); });
      const double r = timed([&] { rec(s1); });
      const double seq = timed([&] {
        prep(s1);
        rec(s1);
      });
      const double par_r = timed([&] { both(true); });
      const double par_p = timed([&] { both(false); });
      const double par = std::min(par_r, par_p);
      std::printf("| %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f |\n", c.name,
                  shape_name(shape), p, r, seq, par_r, par_p, (seq - par) / std::min(p, r));
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
