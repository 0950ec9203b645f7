// kda-bench: times the CUDA prefill and decode on the cases of docs/KDA.md §6.
//
// Method (docs/PERFORMANCE.md): CUDA events around each forward, median of many runs after warm-up,
// input sets rotated so that their total exceeds the L2 several times, floor = bytes that must move
// (q, k, v, g, beta read, out written, fp32 state read and written) over the device-to-device copy
// bandwidth measured at start. Prints markdown tables.
//
//   kda-bench [--prefill] [--decode] [--verify] [--copy] [--host] [--iters N] [--case NAME]
//             [--batch B]...
//   (--verify: a speculative verify step, per-token states against records + commit and records
//   folding the step before; --copy: the slot copy of a model's states; neither in the default
//   set, which stays prefill, decode and host; --batch: the decode, verify and copy rows' batch
//   sizes instead of theirs, B = 1, 16, 64, 256, B = 1, 64, 256 and 1, 8, 64 pairs)
//   kda-bench --paths [--case NAME]   (host only: the softplus cases' prepare paths)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "bench_device.cuh"
#include "bench_floors.hpp"
#include "checkpoint_requests.hpp"
#include "kda/bf16.hpp"
#include "kda/detail/prepare_paths.hpp"
#include "kda/kda.hpp"

namespace {

using kda_bench::fill;
using kda_bench::median_ms;

void check(const kda::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "kda-bench: %s: %s\n", what, st.to_string().c_str());
    std::exit(1);
  }
}

// How a case addresses its states: [N, H, V, K] blocks, or a pool of 2N + 2 entries through
// state slot indices (Problem::num_state_slots), reversed or strided as a serving runtime's slots
// become once sequences come and go.
enum class Slots { kContiguous, kReversed, kStrided };

struct PrefillCase {
  std::string name;
  int heads;
  std::vector<std::int64_t> lengths;  // one entry: fixed single sequence; several: varlen
  bool fixed_batch;                   // lengths all equal and run as [B, T] rows
  kda::GateMode gate;
  double flashkda_ms;  // KDA.md §6, FlashKDA with the same state dtype; 0 when none
  double fla_ms;       // fla chunk_kda; 0 when none
  kda::DType state = kda::DType::kF32;
  Slots slots = Slots::kContiguous;
  // Added to dt_bias (drawn from [-1, 1]): -3 keeps the softplus gate's decay below ~5 nats a
  // token, so that its chunks take the prepare kernel's reference-0 path like the bounded gate's.
  float dt_shift = 0.0f;
  // Prefill checkpoints (Problem::checkpoints; --checkpoints), as checkpoint_requests.hpp reads
  // it. The states then live on a pool (strided slots) that also holds the checkpoints.
  std::int64_t checkpoint_every = kda::bench::kNoCheckpoints;
};

struct Prefill {
  kda::Problem p;
  std::int64_t T = 0, N = 0;
  std::vector<kda::Tensors> sets;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
  std::vector<void*> allocations;
  double bytes = 0;           // the floor's bytes
  std::int64_t requests = 0;  // checkpoint requests that name an offset
};

void* dalloc(Prefill& pf, std::size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, bytes == 0 ? 16 : bytes));
  pf.allocations.push_back(p);
  return p;
}

// The inputs' distributions (make_prefill; --paths replays the gate's on the host): exp(A_log)
// in [1, 15], dt_bias in [-1, 1] (plus the case's dt_shift), g_raw in [-3, 1].
constexpr float kALogLo = 0.0f, kALogHi = 2.7f;
constexpr float kDtBiasLo = -1.0f, kDtBiasHi = 1.0f;
constexpr float kGLo = -3.0f, kGHi = 1.0f;
constexpr std::uint64_t kCaseSeed = 1234;  // every case's inputs
// The seed of input set s (the sets rotate so that the inputs exceed the L2).
std::uint64_t set_seed(std::uint64_t seed, int s) {
  return seed * 1000 + static_cast<std::uint64_t>(s) * 10;
}

Prefill make_prefill(const PrefillCase& c, std::uint64_t seed) {
  Prefill pf;
  const int H = c.heads, D = 128;
  std::int64_t T = 0;
  for (auto l : c.lengths) T += l;
  const std::int64_t N = static_cast<std::int64_t>(c.lengths.size());
  kda::Problem& p = pf.p;
  if (c.fixed_batch || N == 1) {
    p.batch = N;
    p.seq_len = c.lengths[0];
  } else {
    p.batch = 1;
    p.seq_len = T;
    p.num_seqs = N;
    p.cu_seqlens_dtype = kda::DType::kI64;
  }
  p.num_heads = H;
  p.head_dim_k = p.head_dim_v = D;
  p.gate = c.gate;
  p.lower_bound = -5.0f;
  p.initial_state_dtype = c.state;
  p.final_state_dtype = c.state;
  pf.T = T;
  pf.N = N;
  const std::int64_t tok_elems = T * H * D;
  const std::size_t state_size = kda::dtype_size(c.state);
  const std::size_t state_bytes = static_cast<std::size_t>(N) * H * D * D * state_size;
  // A pool of 2N + 2 states addressed through slot indices (and the checkpoints' entries after
  // them), or the [N, H, V, K] blocks.
  const kda::bench::CheckpointRequests requests = kda::bench::checkpoint_requests(
      c.lengths, c.checkpoint_every, static_cast<std::int32_t>(2 * N + 2));
  const std::int64_t K = requests.columns, num_requests = requests.count;
  const bool pooled = c.slots != Slots::kContiguous || K > 0;
  const std::int64_t pool_entries = 2 * N + 2 + num_requests;
  if (pooled) p.num_state_slots = pool_entries;
  const std::size_t pool_bytes =
      pooled ? static_cast<std::size_t>(pool_entries) * H * D * D * state_size : state_bytes;
  std::int32_t* d_slots = nullptr;
  if (pooled) {
    std::vector<std::int32_t> slots(N);
    for (std::int64_t i = 0; i < N; ++i) {
      slots[i] = static_cast<std::int32_t>(c.slots == Slots::kReversed ? 2 * N + 1 - i : 2 * i + 1);
    }
    d_slots = static_cast<std::int32_t*>(dalloc(pf, N * 4));
    CK(cudaMemcpy(d_slots, slots.data(), N * 4, cudaMemcpyHostToDevice));
  }
  void* d_offsets = nullptr;
  std::int32_t* d_checkpoint_slots = nullptr;
  if (K > 0) {
    const auto& offsets = requests.offsets;
    const auto& entries = requests.rows;
    d_offsets = dalloc(pf, offsets.size() * 8);
    d_checkpoint_slots = static_cast<std::int32_t*>(dalloc(pf, entries.size() * 4));
    CK(cudaMemcpy(d_offsets, offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_checkpoint_slots, entries.data(), entries.size() * 4, cudaMemcpyHostToDevice));
    p.checkpoints = K;
    p.checkpoint_offsets_dtype = kda::DType::kI64;
  }
  const double set_bytes = kda::bench::kda_core_bytes(
      static_cast<double>(T), static_cast<double>(N), H, D, static_cast<double>(state_size), false);
  // The checkpoints' writes add to the floor.
  pf.bytes = set_bytes + static_cast<double>(num_requests) * H * D * D * state_size;
  pf.requests = num_requests;
  // Rotate input sets so that one pass over all of them is at least 4x the 60 MB L2.
  const int nsets =
      static_cast<int>(std::min<double>(8, std::max<double>(2, 240e6 / set_bytes + 1)));
  std::vector<std::int64_t> cu(N + 1, 0);
  for (std::int64_t i = 0; i < N; ++i) cu[i + 1] = cu[i] + c.lengths[i];
  void* d_cu = dalloc(pf, (N + 1) * 8);
  CK(cudaMemcpy(d_cu, cu.data(), (N + 1) * 8, cudaMemcpyHostToDevice));
  float* A_log = static_cast<float*>(dalloc(pf, H * 4));
  float* dt_bias = static_cast<float*>(dalloc(pf, H * D * 4));
  fill(A_log, H, seed + 1, kALogLo, kALogHi);
  fill(dt_bias, H * D, seed + 2, kDtBiasLo + c.dt_shift, kDtBiasHi + c.dt_shift);
  for (int s = 0; s < nsets; ++s) {
    kda::Tensors t;
    auto bf = [&](std::int64_t n, float lo, float hi, std::uint64_t sd) {
      auto* ptr = static_cast<std::uint16_t*>(dalloc(pf, n * 2));
      fill(ptr, n, sd, lo, hi);
      return ptr;
    };
    const std::uint64_t sd = set_seed(seed, s);
    t.q = bf(tok_elems, -1, 1, sd + 1);
    t.k = bf(tok_elems, -1, 1, sd + 2);
    t.v = bf(tok_elems, -1, 1, sd + 3);
    t.g = bf(tok_elems, kGLo, kGHi, sd + 4);
    t.beta = bf(T * H, -2, 2, sd + 5);
    t.A_log = A_log;
    t.dt_bias = dt_bias;
    if (p.varlen()) {
      t.cu_seqlens = d_cu;
      t.cu_seqlens_host = cu.data();  // validated once; the vector lives in this function only
    }
    void* h0 = dalloc(pf, pool_bytes);
    if (c.state == kda::DType::kF32) {
      fill(static_cast<float*>(h0), static_cast<std::int64_t>(pool_bytes / 4), sd + 6, -0.1f, 0.1f);
    } else {
      fill(static_cast<std::uint16_t*>(h0), static_cast<std::int64_t>(pool_bytes / 2), sd + 6,
           -0.1f, 0.1f);
    }
    t.initial_state = h0;
    t.final_state = pooled ? h0 : dalloc(pf, state_bytes);  // a pool is updated in place
    t.state_slots = d_slots;
    t.checkpoint_offsets = d_offsets;
    t.checkpoint_slots = d_checkpoint_slots;
    t.out = dalloc(pf, tok_elems * 2);
    pf.sets.push_back(t);
  }
  check(kda::workspace_size(p, kda::Backend::kCuda, &pf.ws_bytes), "workspace_size");
  pf.ws = dalloc(pf, pf.ws_bytes);
  // Validate cu_seqlens once through the host copy, then drop the pointer (it dies with `cu`).
  check(kda::forward_cuda(p, pf.sets[0], {pf.ws, pf.ws_bytes}, nullptr),
        "forward_cuda (first run)");
  for (auto& t : pf.sets) t.cu_seqlens_host = nullptr;
  CK(cudaDeviceSynchronize());
  return pf;
}

void free_prefill(Prefill& pf) {
  for (void* p : pf.allocations) CK(cudaFree(p));
  pf.allocations.clear();
}

bool matches(const std::string& list, const std::string& name) {
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string pat = list.substr(start, end - start);
    if (!pat.empty() && pat.back() == '*') {
      if (name.compare(0, pat.size() - 1, pat, 0, pat.size() - 1) == 0) return true;
    } else if (pat == name) {
      return true;
    }
    start = end + 1;
  }
  return false;
}

std::string lengths_label(const PrefillCase& c) {
  if (c.lengths.size() == 1) return "1 x " + std::to_string(c.lengths[0]);
  bool same =
      std::all_of(c.lengths.begin(), c.lengths.end(), [&](auto l) { return l == c.lengths[0]; });
  if (same) return std::to_string(c.lengths.size()) + " x " + std::to_string(c.lengths[0]);
  std::string s = "varlen ";
  for (std::size_t i = 0; i < c.lengths.size(); ++i)
    s += (i ? "," : "") + std::to_string(c.lengths[i]);
  return s;
}

std::vector<PrefillCase> prefill_cases() {
  const std::vector<std::int64_t> varlen = {1300, 547, 2048, 963, 271, 3063};
  const std::vector<std::int64_t> ragged16 = {1300, 547, 2048, 963, 271, 3063, 17000, 7000};
  const std::vector<std::int64_t> b8(8, 1024), b16(16, 2048), b8x4096(8, 4096);
  using G = kda::GateMode;
  constexpr kda::DType F32 = kda::DType::kF32, BF16 = kda::DType::kBF16;
  std::vector<PrefillCase> cases = {
      {"h96-1seq", 96, {8192}, false, G::kLowerBound, 1.400, 2.626},
      {"h96-varlen", 96, varlen, false, G::kLowerBound, 1.392, 2.670},
      {"h96-8x1024", 96, b8, true, G::kLowerBound, 1.196, 2.642},
      {"h64-1seq", 64, {8192}, false, G::kLowerBound, 1.195, 1.749},
      {"h64-varlen", 64, varlen, false, G::kLowerBound, 1.008, 2.035},
      {"h64-8x1024", 64, b8, true, G::kLowerBound, 0.812, 2.003},
      {"h32-1seq", 32, {8192}, false, G::kLowerBound, 0.980, 2.039},
      {"h32-32k", 32, {32768}, false, G::kLowerBound, 3.821, 3.870},
      {"h32-16x2048", 32, b16, true, G::kLowerBound, 1.581, 3.457},
      {"softplus-h32-1seq", 32, {8192}, false, G::kSoftplus, 0, 1.107},
      {"softplus-h96-1seq", 96, {8192}, false, G::kSoftplus, 0, 2.918},
      {"softplus-h32-16x2048", 32, b16, true, G::kSoftplus, 0, 3.848},
      // Slots through indices (one launch whatever the slots): against the contiguous rows.
      {"slots-reversed-h32-16x2048", 32, b16, true, G::kLowerBound, 1.581, 3.457, F32,
       Slots::kReversed},
      {"slots-strided-h32-16x2048", 32, b16, true, G::kLowerBound, 1.581, 3.457, F32,
       Slots::kStrided},
      {"slots-reversed-h64-8x1024", 64, b8, true, G::kLowerBound, 0.812, 2.003, F32,
       Slots::kReversed},
      {"slots-strided-h64-8x1024", 64, b8, true, G::kLowerBound, 0.812, 2.003, F32,
       Slots::kStrided},
  };
  // Low-head shapes (tensor-parallel serving, KDA.md §6), fp32 and bf16 state, FlashKDA (serial).
  const struct {
    int heads;
    double fk_f32[3], fk_bf16[3];
  } low[] = {{4, {0.800, 3.041, 12.268}, {0.821, 3.139, 12.752}},
             {8, {0.828, 3.220, 12.754}, {0.852, 3.328, 13.212}},
             {12, {0.860, 3.314, 13.181}, {0.878, 3.427, 13.609}},
             {16, {0.879, 3.406, 13.583}, {0.902, 3.526, 14.038}}};
  const std::int64_t low_lengths[3] = {8192, 32768, 131072};
  for (const auto& l : low) {
    for (int i = 0; i < 3; ++i) {
      const std::string base =
          "h" + std::to_string(l.heads) + "-" + std::to_string(low_lengths[i] / 1024) + "k";
      cases.push_back(
          {base, l.heads, {low_lengths[i]}, false, G::kLowerBound, l.fk_f32[i], 0, F32});
      cases.push_back({base + "-bf16",
                       l.heads,
                       {low_lengths[i]},
                       false,
                       G::kLowerBound,
                       l.fk_bf16[i],
                       0,
                       BF16});
    }
  }
  cases.push_back({"h12-24k+8k", 12, {24576, 8192}, false, G::kLowerBound, 2.752, 0, F32});
  cases.push_back({"h12-24k+8k-bf16", 12, {24576, 8192}, false, G::kLowerBound, 2.625, 0, BF16});
  cases.push_back({"h12-8x4096", 12, b8x4096, true, G::kLowerBound, 0.755, 0, F32});
  cases.push_back({"h12-8x4096-bf16", 12, b8x4096, true, G::kLowerBound, 0.726, 0, BF16});
  cases.push_back({"h16-ragged", 16, ragged16, false, G::kLowerBound, 2.117, 0, F32});
  cases.push_back({"h16-ragged-bf16", 16, ragged16, false, G::kLowerBound, 2.031, 0, BF16});
  // Many short sequences beside a long one (no anchor): a split plan with more than two (segment,
  // head) items per SM, the paired recurrence block in its first pass.
  std::vector<std::int64_t> many_and_long(20, 300);
  many_and_long.push_back(20000);
  cases.push_back({"h16-20x300+20k", 16, many_and_long, false, G::kLowerBound, 0, 0, F32});
  // Softplus twins (the released Kimi-Linear-48B's gate; FlashKDA cannot run it).
  cases.push_back({"softplus-h4-32k", 4, {32768}, false, G::kSoftplus, 0, 0, F32});
  cases.push_back({"softplus-h12-8x4096-bf16", 12, b8x4096, true, G::kSoftplus, 0, 0, BF16});
  cases.push_back({"softplus-h16-ragged", 16, ragged16, false, G::kSoftplus, 0, 0, F32});
  // The softplus gate with mild decay: what the gate itself costs, apart from the prepare
  // kernel's middle-reference and exact paths that the strong decays above reach (the twins' inputs
  // decay up to ~30 nats a token).
  {
    PrefillCase mild{"softplus-mild-h32-1seq", 32, {8192}, false, G::kSoftplus, 0, 0, F32};
    mild.dt_shift = -3.0f;
    cases.push_back(mild);
  }
  return cases;
}

// --paths (on the host, no device needed): how the CUDA prepare kernel's rule
// (kda/detail/prepare_paths.hpp) shares each softplus case's chunk-heads between its paths, on the
// case's input set 0 replayed from the fills' hash. The last column is the exact path's share that
// a two-level reference would keep factored (an experiment measured slower, docs/design/prefill.md;
// not a path of the kernel).
void print_paths(const std::string& only) {
  constexpr int C = 16, D = 128;
  std::printf("\n### Prepare paths of the softplus cases (input set 0, %% of chunk-heads)\n\n");
  std::printf("| case | chunk-heads | reference 0 | middle | exact | exact within two levels |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  for (const PrefillCase& c : prefill_cases()) {
    if (c.gate != kda::GateMode::kSoftplus) continue;
    if (!only.empty() && !matches(only, c.name)) continue;
    const int H = c.heads;
    const std::uint64_t g_seed = set_seed(kCaseSeed, 0) + 4;
    double counts[3] = {0, 0, 0}, two_levels = 0;
    std::int64_t tok0 = 0;  // the sequence's first token (rows of a fixed batch are contiguous)
    for (std::int64_t len : c.lengths) {
      for (int h = 0; h < H; ++h) {
        const double a = std::exp(
            static_cast<double>(kda_bench::hashed_f32(h, kCaseSeed + 1, kALogLo, kALogHi)));
        for (std::int64_t t0 = 0; t0 < len; t0 += C) {
          kda::detail::PrepareChunkRule rule;
          for (int d = 0; d < D; ++d) {
            const double dt =
                kda_bench::hashed_f32(static_cast<std::int64_t>(h) * D + d, kCaseSeed + 2,
                                      kDtBiasLo + c.dt_shift, kDtBiasHi + c.dt_shift);
            double G[C], sum = 0;
            for (int t = 0; t < C; ++t) {
              if (t0 + t < len) {
                const std::int64_t idx = ((tok0 + t0 + t) * H + h) * D + d;
                const double x =
                    kda::bf16_to_float(kda_bench::hashed_bf16(idx, g_seed, kGLo, kGHi)) + dt;
                sum -= a * (x > 20 ? x : std::log1p(std::exp(x)));
              }
              G[t] = sum;
            }
            rule.add_channel(G, C);
          }
          const kda::detail::PreparePath path = rule.path();
          ++counts[static_cast<int>(path)];
          if (path == kda::detail::PreparePath::kExact && rule.within_two_levels()) ++two_levels;
        }
      }
      tok0 += len;
    }
    const double total = counts[0] + counts[1] + counts[2];
    std::printf("| %s | %.0f | %.1f | %.1f | %.1f | %.1f |\n", c.name.c_str(), total,
                100 * counts[0] / total, 100 * counts[1] / total, 100 * counts[2] / total,
                100 * two_levels / total);
    std::fflush(stdout);
  }
}

void run_prefill(double bw, int iters, const std::string& only) {
  const std::vector<PrefillCase> cases = prefill_cases();
  std::printf("\n### CUDA prefill (K = V = 128, state in and out, median of %d)\n\n", iters);
  std::printf(
      "| case | gate | state | H | sequences | ms | GB/s | floor ms | x floor | FlashKDA ms | "
      "speedup vs FlashKDA | fla ms | speedup vs fla |\n");
  std::printf("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& c : cases) {
    // --case: a comma-separated list of names; a trailing '*' matches a prefix.
    if (!only.empty() && !matches(only, c.name)) continue;
    Prefill pf = make_prefill(c, kCaseSeed);
    const kda::Workspace ws{pf.ws, pf.ws_bytes};
    const double ms = median_ms(
        [&](int i) {
          check(kda::forward_cuda(pf.p, pf.sets[i % pf.sets.size()], ws, nullptr), "forward_cuda");
        },
        5, iters);
    const double floor_ms = pf.bytes / bw * 1e3;
    char fk[32] = "-", fks[32] = "-", fl[32] = "-", fls[32] = "-";
    if (c.flashkda_ms > 0) {
      std::snprintf(fk, sizeof fk, "%.3f", c.flashkda_ms);
      std::snprintf(fks, sizeof fks, "%.2fx", c.flashkda_ms / ms);
    }
    if (c.fla_ms > 0) {
      std::snprintf(fl, sizeof fl, "%.3f", c.fla_ms);
      std::snprintf(fls, sizeof fls, "%.2fx", c.fla_ms / ms);
    }
    std::printf("| %s | %s | %s | %d | %s | %.3f | %.0f | %.3f | %.1f | %s | %s | %s | %s |\n",
                c.name.c_str(), c.gate == kda::GateMode::kSoftplus ? "softplus" : "lower_bound",
                kda::to_string(c.state), c.heads, lengths_label(c).c_str(), ms,
                pf.bytes / (ms * 1e-3) / 1e9, floor_ms, ms / floor_ms, fk, fks, fl, fls);
    std::fflush(stdout);
    free_prefill(pf);
  }
}

// --checkpoints: prefills with prefix-cache checkpoints against the same prefill without them
// (both on a pool of strided slots), in the same run: two columns that request nothing (the
// checkpoint kernels' fixed cost), two per sequence, and one every 256 tokens.
void run_checkpoints(double bw, int iters, const std::string& only) {
  const char* names[] = {"h32-1seq",   "h96-varlen", "h32-16x2048",   "h64-8x1024",
                         "h12-32k",    "h4-128k",    "h16-128k-bf16", "h12-8x4096-bf16",
                         "h16-ragged", "h12-24k+8k"};
  std::printf(
      "\n### CUDA prefill with checkpoints (median of %d; against the same prefill on a "
      "pool without them)\n\n",
      iters);
  std::printf(
      "| case | state | H | sequences | requests | plain ms | ms | x plain | floor ms | x "
      "floor |\n");
  std::printf("|---|---|---:|---|---:|---:|---:|---:|---:|---:|\n");
  for (const PrefillCase& base : prefill_cases()) {
    bool wanted = false;
    for (const char* n : names) wanted = wanted || base.name == n;
    if (!wanted || (!only.empty() && !matches(only, base.name))) continue;
    PrefillCase plain = base;
    if (plain.slots == Slots::kContiguous) plain.slots = Slots::kStrided;
    auto time = [&](const PrefillCase& c, double* bytes, std::int64_t* requests) {
      Prefill pf = make_prefill(c, kCaseSeed);
      const kda::Workspace ws{pf.ws, pf.ws_bytes};
      const double ms = median_ms(
          [&](int i) {
            check(kda::forward_cuda(pf.p, pf.sets[i % pf.sets.size()], ws, nullptr),
                  "forward_cuda");
          },
          5, iters);
      *bytes = pf.bytes;
      *requests = pf.requests;
      free_prefill(pf);
      return ms;
    };
    double plain_bytes = 0;
    std::int64_t none = 0;
    const double plain_ms = time(plain, &plain_bytes, &none);
    for (const std::int64_t every :
         {kda::bench::kUnusedCheckpointColumns, kda::bench::kTwoPerSequence, std::int64_t{256}}) {
      PrefillCase c = plain;
      c.checkpoint_every = every;
      double bytes = 0;
      std::int64_t requests = 0;  // what the prefill was handed, not what the label says
      const double ms = time(c, &bytes, &requests);
      const double floor_ms = bytes / bw * 1e3;
      const char* label = every == kda::bench::kUnusedCheckpointColumns ? "2 columns of -1"
                          : every == kda::bench::kTwoPerSequence        ? "2 a sequence"
                                                                        : "1 / 256 tokens";
      std::printf("| %s %s | %s | %d | %s | %lld | %.3f | %.3f | %.3f | %.3f | %.2f |\n",
                  base.name.c_str(), label, kda::to_string(c.state), c.heads,
                  lengths_label(c).c_str(), static_cast<long long>(requests), plain_ms, ms,
                  ms / plain_ms, floor_ms, ms / floor_ms);
      std::fflush(stdout);
    }
  }
}

// Microseconds per call of `enqueue` (one call on stream s): a graph of 50 calls replayed (no
// launch gaps), the median of `iters` replays after three.
template <typename F>
double graph_us(int iters, F&& enqueue) {
  const int steps = 50;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < steps; ++i) enqueue(s);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(s));
  return ms[iters / 2] * 1e3 / steps;
}

// Eager calls, as a runtime makes host-driven ones: events around `steps` enqueues, the median of
// `iters` rounds after one; a call's share of the stream's time between the events (the GPU's
// work, or the host's enqueueing where that is slower) and of the host's enqueue time.
struct EagerTimes {
  double stream_us, host_us;
};
template <typename F>
EagerTimes eager_us(int iters, F&& enqueue) {
  const int steps = 50;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < steps; ++i) enqueue(s);
  CK(cudaStreamSynchronize(s));
  std::vector<float> ms(iters);
  std::vector<double> host(iters);
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(e0, s));
    const auto t0 = std::chrono::steady_clock::now();
    for (int j = 0; j < steps; ++j) enqueue(s);
    host[i] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  std::sort(host.begin(), host.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(s));
  return {ms[iters / 2] * 1e3 / steps, host[iters / 2] / steps};
}

// Device allocations freed together.
struct Allocations {
  std::vector<void*> ptrs;
  void* get(std::size_t bytes) {
    void* ptr = nullptr;
    CK(cudaMalloc(&ptr, bytes == 0 ? 16 : bytes));
    ptrs.push_back(ptr);
    return ptr;
  }
  ~Allocations() {
    for (void* ptr : ptrs) cudaFree(ptr);
  }
};

// A decode step's token inputs, parameters and out for B rows of T tokens (the plain decode rows'
// distributions).
kda::DecodeTensors decode_inputs(Allocations& a, int B, int T, int H, int D) {
  const std::int64_t tok = static_cast<std::int64_t>(B) * T * H * D;
  kda::DecodeTensors t;
  auto* q = static_cast<std::uint16_t*>(a.get(tok * 2));
  auto* k = static_cast<std::uint16_t*>(a.get(tok * 2));
  auto* v = static_cast<std::uint16_t*>(a.get(tok * 2));
  auto* g = static_cast<std::uint16_t*>(a.get(tok * 2));
  auto* beta = static_cast<std::uint16_t*>(a.get(static_cast<std::size_t>(B) * T * H * 2));
  fill(q, tok, 11, -1, 1);
  fill(k, tok, 12, -1, 1);
  fill(v, tok, 13, -1, 1);
  fill(g, tok, 14, -3, 1);
  fill(beta, static_cast<std::int64_t>(B) * T * H, 15, -2, 2);
  auto* A_log = static_cast<float*>(a.get(H * 4));
  auto* dt_bias = static_cast<float*>(a.get(static_cast<std::size_t>(H) * D * 4));
  fill(A_log, H, 16, 0, 2.7f);
  fill(dt_bias, static_cast<std::int64_t>(H) * D, 17, -1, 1);
  t.q = q;
  t.k = k;
  t.v = v;
  t.g = g;
  t.beta = beta;
  t.A_log = A_log;
  t.dt_bias = dt_bias;
  t.out = a.get(tok * 2);
  return t;
}

// A pool of `slots` states, random values in [-0.1, 0.1).
void* state_pool(Allocations& a, std::int64_t slots, int H, int D, kda::DType state) {
  const std::int64_t elems = slots * H * D * D;
  void* pool = a.get(static_cast<std::size_t>(elems) * kda::dtype_size(state));
  if (state == kda::DType::kBF16) {
    fill(static_cast<std::uint16_t*>(pool), elems, 18, -0.1f, 0.1f);
  } else {
    fill(static_cast<float*>(pool), elems, 18, -0.1f, 0.1f);
  }
  return pool;
}

std::int32_t* device_ints(Allocations& a, const std::vector<std::int32_t>& host) {
  auto* d = static_cast<std::int32_t*>(a.get(host.size() * 4));
  CK(cudaMemcpy(d, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

void run_decode(double bw, int iters, std::vector<int> batches) {
  const int H = 32, D = 128;
  if (batches.empty()) batches = {1, 16, 64, 256};
  // fla's fused_recurrent_kda (KDA.md §6), ms, where it was measured.
  auto fla_ms = [](int B) { return B == 16 ? 0.061 : B == 64 ? 0.094 : B == 256 ? 0.379 : 0.0; };
  std::printf(
      "\n### CUDA decode (one token per sequence, H = 32, K = V = 128, state in place in a pool)"
      "\n\n");
  std::printf(
      "| B | state | us per step | GB moved | GB/s | %% of copy bw | floor us | fla "
      "fused_recurrent us |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---:|---:|\n");
  for (const kda::DType state : {kda::DType::kF32, kda::DType::kBF16}) {
    const bool bf16_state = state == kda::DType::kBF16;
    const int state_size = bf16_state ? 2 : 4;
    for (const int B : batches) {
      kda::DecodeProblem p;
      p.batch = B;
      p.tokens = 1;
      p.num_heads = H;
      p.num_slots = 2 * B;
      p.state_dtype = state;
      p.gate = kda::GateMode::kSoftplus;
      Allocations a;
      kda::DecodeTensors t = decode_inputs(a, B, 1, H, D);
      std::vector<std::int32_t> slots(B);
      for (int b = 0; b < B; ++b) slots[b] = 2 * b;  // every other slot: a gappy pool as in serving
      t.slots = device_ints(a, slots);
      t.state_pool = state_pool(a, p.num_slots, H, D, state);
      // A graph of decode steps, replayed: per-step time without launch gaps.
      const double step_us =
          graph_us(iters, [&](cudaStream_t s) { check(kda::decode_cuda(p, t, s), "decode_cuda"); });
      const double bytes = kda::bench::kda_core_bytes(B, B, H, D, state_size, true);
      const double gbps = bytes / (step_us * 1e-6) / 1e9;
      // fla's figure (KDA.md §6) is for an fp32 state.
      const bool fla = fla_ms(B) > 0 && !bf16_state;
      std::printf("| %d | %s | %.2f | %.4f | %.0f | %.0f%% | %.2f | %s |\n", B,
                  bf16_state ? "bf16" : "f32", step_us, bytes / 1e9, gbps,
                  100.0 * bytes / (step_us * 1e-6) / bw, bytes / bw * 1e6,
                  fla ? std::to_string(static_cast<int>(fla_ms(B) * 1e3 + 0.5)).c_str() : "-");
      std::fflush(stdout);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// --verify: a speculative verify step's two forms (kda.hpp): per-token states (the state after
// every token written to a slot of its own) against records + commit (small per-token records
// written, then the accepted ones folded into the one committed state) and against a records step
// that folds the records of the step before instead of a commit (kda.hpp, "Fold"), each against
// the plain step of the same T tokens (one state read and written; "verify / plain step": the
// verify step's time over it, the records step without its commit).
// ---------------------------------------------------------------------------------------------

void run_verify(double bw, int iters, std::vector<int> batches) {
  const int H = 32, D = 128;
  if (batches.empty()) batches = {1, 64, 256};
  const double record_bytes = 3.0 * D * 4;  // one (token, head) record: alpha, k^, u in fp32
  std::printf(
      "\n### CUDA verify step: per-token states vs records + commit vs records folding the step "
      "before (H = 32, K = V = 128; every token accepted, the most records a commit or a fold "
      "reads)\n\n");
  std::printf(
      "| tokens | B | state | form | verify us | verify floor us | commit us | commit floor us | "
      "total us | floor us | total / floor | verify / plain step |\n");
  std::printf("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  auto floor_us = [&](double bytes) { return bytes / bw * 1e6; };
  for (const kda::DType state : {kda::DType::kF32, kda::DType::kBF16}) {
    const double state_bytes = static_cast<double>(kda::dtype_size(state)) * D * D;
    const char* state_name = state == kda::DType::kBF16 ? "bf16" : "f32";
    for (const int T : {4, 8}) {
      for (const int B : batches) {
        Allocations a;
        kda::DecodeTensors t = decode_inputs(a, B, T, H, D);
        // q, k, v, g, beta read and out written: the same in both forms.
        const double token_bytes = kda::bench::kda_core_bytes(static_cast<double>(B) * T, 0, H, D,
                                                              state_bytes / (D * D), false);
        const double rows_heads = static_cast<double>(B) * H;

        // The plain step of T tokens (no verify): one state read and written a row, what the
        // verify forms are compared with.
        kda::DecodeProblem pp;
        pp.batch = B;
        pp.tokens = T;
        pp.num_heads = H;
        pp.num_slots = B;
        pp.state_dtype = state;
        std::vector<std::int32_t> rows(B);
        for (int b = 0; b < B; ++b) rows[b] = b;
        kda::DecodeTensors tp = t;
        tp.slots = device_ints(a, rows);
        tp.state_pool = state_pool(a, pp.num_slots, H, D, state);
        const double plain_us =
            graph_us(iters, [&](cudaStream_t s) { check(kda::decode_cuda(pp, tp, s), "plain"); });
        const double plain_bytes = token_bytes + 2 * rows_heads * state_bytes + 4.0 * B;
        // A row of a form with no commit: its step alone, against its floor and the plain step.
        auto print_step_row = [&](const char* form, double us, double bytes) {
          std::printf("| %d | %d | %s | %s | %.2f | %.2f | - | - | %.2f | %.2f | %.2fx | %.2fx |\n",
                      T, B, state_name, form, us, floor_us(bytes), us, floor_us(bytes),
                      us / floor_us(bytes), us / plain_us);
          std::fflush(stdout);
        };
        print_step_row("plain step of T tokens", plain_us, plain_bytes);

        // Per-token states: row b starts from slots[b][0] (num_accepted 1) and writes T states.
        kda::DecodeProblem pt;
        pt.batch = B;
        pt.tokens = T;
        pt.num_heads = H;
        pt.num_slots = static_cast<std::int64_t>(B) * T;
        pt.state_dtype = state;
        pt.verify = true;
        std::vector<std::int32_t> slots(static_cast<std::size_t>(B) * T);
        for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<std::int32_t>(i);
        kda::DecodeTensors tt = t;
        tt.slots = device_ints(a, slots);
        tt.num_accepted = device_ints(a, std::vector<std::int32_t>(B, 1));
        tt.state_pool = state_pool(a, pt.num_slots, H, D, state);
        const double pt_us =
            graph_us(iters, [&](cudaStream_t s) { check(kda::decode_cuda(pt, tt, s), "verify"); });
        const double pt_bytes =
            token_bytes + rows_heads * state_bytes * (1 + T) + 4.0 * B * T + 4.0 * B;
        print_step_row("per-token states", pt_us, pt_bytes);

        // Records + commit: row b's committed state in slot 2b (a gappy pool), T records a row.
        kda::DecodeProblem pr = pt;
        pr.records = true;
        pr.num_slots = 2 * static_cast<std::int64_t>(B);
        std::vector<std::int32_t> committed(B);
        for (int b = 0; b < B; ++b) committed[b] = 2 * b;
        kda::DecodeTensors tr = t;
        tr.slots = device_ints(a, committed);
        tr.state_pool = state_pool(a, pr.num_slots, H, D, state);
        tr.records =
            static_cast<float*>(a.get(static_cast<std::size_t>(rows_heads * T * record_bytes)));
        kda::CommitProblem cp;
        cp.batch = B;
        cp.tokens = T;
        cp.num_heads = H;
        cp.num_slots = pr.num_slots;
        cp.state_dtype = state;
        const kda::CommitLayer layer{tr.records, tr.state_pool};
        const std::int32_t* accepted = device_ints(a, std::vector<std::int32_t>(B, T));
        auto verify = [&](cudaStream_t s) { check(kda::decode_cuda(pr, tr, s), "records"); };
        auto commit = [&](cudaStream_t s) {
          check(kda::commit_cuda(cp, &layer, 1, tr.slots, accepted, nullptr, s), "commit");
        };
        const double rv_us = graph_us(iters, verify);
        const double c_us = graph_us(iters, commit);
        const double both_us = graph_us(iters, [&](cudaStream_t s) {
          verify(s);
          commit(s);
        });
        const double records = rows_heads * T * record_bytes;
        const double rv_bytes = token_bytes + rows_heads * state_bytes + records + 4.0 * B;
        const double c_bytes = 2 * rows_heads * state_bytes + records + 8.0 * B;
        std::printf(
            "| %d | %d | %s | records + commit | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2fx "
            "| %.2fx |\n",
            T, B, state_name, rv_us, floor_us(rv_bytes), c_us, floor_us(c_bytes), both_us,
            floor_us(rv_bytes + c_bytes), both_us / floor_us(rv_bytes + c_bytes), rv_us / plain_us);
        std::fflush(stdout);

        // Records, the commit of the step before folded in (DecodeProblem::fold_batch): the
        // records written above, every token of row b folded into its own slot, the step's own
        // records into a second region. One state read and written a row, as a plain step.
        kda::DecodeProblem pf = pr;
        pf.fold_batch = B;
        pf.fold_tokens = T;
        kda::DecodeTensors tf = tr;
        tf.fold_records = tr.records;
        tf.records =
            static_cast<float*>(a.get(static_cast<std::size_t>(rows_heads * T * record_bytes)));
        std::vector<std::int32_t> identity(B);
        for (int b = 0; b < B; ++b) identity[b] = b;
        tf.fold_rows = device_ints(a, identity);
        tf.fold_counts = accepted;
        const double f_us =
            graph_us(iters, [&](cudaStream_t s) { check(kda::decode_cuda(pf, tf, s), "fold"); });
        const double f_bytes = rv_bytes + rows_heads * state_bytes + records + 8.0 * B;
        print_step_row("records, folding the step before", f_us, f_bytes);
      }
    }
  }

  // One commit launch for a model's KDA layers (B = 64, 20 layers, each its own pool and records).
  const int B = 64, layers = 20;
  std::printf(
      "\n### CUDA commit of %d layers in one launch (B = %d, H = 32, every token accepted)\n\n",
      layers, B);
  std::printf(
      "| tokens | B | state | layers | total us | us per layer | MB moved | floor us | total / "
      "floor |\n");
  std::printf("|---:|---:|---|---:|---:|---:|---:|---:|---:|\n");
  for (const kda::DType state : {kda::DType::kF32, kda::DType::kBF16}) {
    const double state_bytes = static_cast<double>(kda::dtype_size(state)) * D * D;
    for (const int T : {4, 8}) {
      Allocations a;
      kda::CommitProblem cp;
      cp.batch = B;
      cp.tokens = T;
      cp.num_heads = H;
      cp.num_slots = 2 * B;
      cp.state_dtype = state;
      std::vector<kda::CommitLayer> ls;
      const std::int64_t record_floats = static_cast<std::int64_t>(B) * T * H * 3 * D;
      for (int l = 0; l < layers; ++l) {
        auto* rec = static_cast<float*>(a.get(static_cast<std::size_t>(record_floats) * 4));
        // Decays and keys in [0.5, 1), u alike: the states stay finite over the replays.
        fill(rec, record_floats, 40 + l, 0.5f, 1.0f);
        ls.push_back({rec, state_pool(a, cp.num_slots, H, D, state)});
      }
      std::vector<std::int32_t> committed(B);
      for (int b = 0; b < B; ++b) committed[b] = 2 * b;
      const std::int32_t* slots = device_ints(a, committed);
      const std::int32_t* accepted = device_ints(a, std::vector<std::int32_t>(B, T));
      const double us = graph_us(iters, [&](cudaStream_t s) {
        check(kda::commit_cuda(cp, ls.data(), layers, slots, accepted, nullptr, s), "commit");
      });
      const double bytes =
          layers * (2.0 * B * H * state_bytes + B * H * T * record_bytes) + 8.0 * B;
      std::printf("| %d | %d | %s | %d | %.2f | %.2f | %.1f | %.2f | %.2fx |\n", T, B,
                  state == kda::DType::kBF16 ? "bf16" : "f32", layers, us, us / layers, bytes / 1e6,
                  floor_us(bytes), us / floor_us(bytes));
      std::fflush(stdout);
    }
  }
}

// The slot copy of a model's states (kda::copy_slots_cuda, what Engine::copy_slots launches) and
// the zeroing of its destinations (kda::zero_slots_cuda, Engine::reset_slots): 20
// layers of H = 32, each its recurrent pool and three conv pools (4096 bf16 channels x W - 1 = 3),
// P pairs copying slots [0, P) into [P, 2P) of a set. Below 8 pairs the captured calls rotate over
// sets of slots of their own, so that every call's bytes come from memory, not the L2.
void run_copy(double bw, int iters, std::vector<int> batches) {
  const int H = 32, D = 128, layers = 20;
  const std::uint64_t conv_bytes = 4096 * 3 * 2;
  if (batches.empty()) batches = {1, 8, 64};
  struct EagerZero {
    const char* state;
    EagerTimes one_launch, memsets;
  };
  std::vector<EagerZero> eager;
  std::printf(
      "\n### CUDA slot copy of %d layers in one launch (H = 32, recurrent and conv states)\n\n",
      layers);
  std::printf("| pairs | state | form | us | MB moved | floor us | x floor |\n");
  std::printf("|---:|---|---|---:|---:|---:|---:|\n");
  for (const kda::DType state : {kda::DType::kF32, kda::DType::kBF16}) {
    const std::uint64_t state_bytes = kda::dtype_size(state) * H * D * D;
    for (const int P : batches) {
      Allocations a;
      const int sets = P >= 8 ? 1 : (8 + P - 1) / P;
      kda::SlotCopyProblem p;
      p.pairs = P;
      p.num_slots = 2 * static_cast<std::int64_t>(P) * sets;
      std::vector<kda::SlotPool> pools;
      for (int l = 0; l < layers; ++l) {
        pools.push_back({a.get(p.num_slots * state_bytes), state_bytes});
        for (int c = 0; c < 3; ++c) pools.push_back({a.get(p.num_slots * conv_bytes), conv_bytes});
      }
      std::vector<const std::int32_t*> src, dst;
      for (int set = 0; set < sets; ++set) {
        std::vector<std::int32_t> from(P), into(P);
        for (int i = 0; i < P; ++i) {
          from[i] = 2 * P * set + i;
          into[i] = 2 * P * set + P + i;
        }
        src.push_back(device_ints(a, from));
        dst.push_back(device_ints(a, into));
      }
      const int num_pools = static_cast<int>(pools.size());
      int call = 0;
      const double copy_us = graph_us(iters, [&](cudaStream_t s) {
        const int set = call++ % sets;
        check(kda::copy_slots_cuda(p, pools.data(), num_pools, src[set], dst[set], nullptr, s),
              "copy_slots");
      });
      // The zeroing of the destinations (Engine::reset_slots): their bytes written only.
      call = 0;
      const double zero_us = graph_us(iters, [&](cudaStream_t s) {
        const int set = call++ % sets;
        check(kda::zero_slots_cuda(p, pools.data(), num_pools, dst[set], nullptr, s), "zero_slots");
      });
      const double slot_bytes = static_cast<double>(layers) * (state_bytes + 3.0 * conv_bytes);
      for (const auto& [form, us, bytes] :
           {std::tuple<const char*, double, double>{"copy", copy_us,
                                                    2.0 * P * slot_bytes + 8.0 * P},
            std::tuple<const char*, double, double>{"zero", zero_us, P * slot_bytes + 4.0 * P}}) {
        const double floor = bytes / bw * 1e6;
        std::printf("| %d | %s | %s | %.2f | %.1f | %.2f | %.2fx |\n", P, kda::to_string(state),
                    form, us, bytes / 1e6, floor, us / floor);
      }
      if (P == 1) {
        // One slot zeroed eagerly, as Engine::acquire_slot and reset_slot zero it: the slot's
        // index copied from pageable host memory, then the zeroing kernel's one launch (the
        // pools the engine's own: no pointer queries); against a cudaMemsetAsync of the slot's
        // entry in each pool. The slots rotate as the copy's rows do.
        kda::CudaOptions unchecked;
        unchecked.check_pointers = false;
        auto* staged = static_cast<std::int32_t*>(a.get(sizeof(std::int32_t)));
        auto next_slot = [&] { return 2 * (call++ % sets) + 1; };  // dst[set]'s one entry
        call = 0;
        const EagerTimes one_launch = eager_us(iters, [&](cudaStream_t s) {
          const std::int32_t slot = next_slot();
          CK(cudaMemcpyAsync(staged, &slot, sizeof(slot), cudaMemcpyHostToDevice, s));
          check(kda::zero_slots_cuda(p, pools.data(), num_pools, staged, nullptr, s, unchecked),
                "zero_slots");
        });
        call = 0;
        const EagerTimes memsets = eager_us(iters, [&](cudaStream_t s) {
          const std::int64_t slot = next_slot();
          for (const kda::SlotPool& pool : pools) {
            CK(cudaMemsetAsync(static_cast<std::uint8_t*>(pool.base) + slot * pool.entry_bytes, 0,
                               pool.entry_bytes, s));
          }
        });
        eager.push_back({kda::to_string(state), one_launch, memsets});
      }
      std::fflush(stdout);
    }
  }
  if (eager.empty()) return;  // no row of one pair asked for
  std::printf(
      "\n### One slot zeroed eagerly (%d pools): its index copied and one launch, against a "
      "memset a pool (us a call; stream: events around 50 calls, so the host's enqueue time "
      "where it is the longer)\n\n"
      "| state | copy + one launch: stream | host | a memset a pool: stream | host |\n"
      "|---|---:|---:|---:|---:|\n",
      4 * layers);
  for (const EagerZero& z : eager) {
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", z.state, z.one_launch.stream_us,
                z.one_launch.host_us, z.memsets.stream_us, z.memsets.host_us);
  }
}

// Host time per call (enqueue only, no sync inside), median over repeats of 100 calls: what the
// checks of CudaOptions::check_pointers (driver queries per pointer) cost on top of validation
// and the launches. The GPU keeps up (100 short kernels), so the loop measures the host.
void run_host_overhead() {
  const int H = 32, D = 128, T = 64;
  std::vector<void*> allocs;
  auto al = [&](std::size_t n) {
    void* ptr;
    CK(cudaMalloc(&ptr, n));
    CK(cudaMemset(ptr, 0, n));
    allocs.push_back(ptr);
    return ptr;
  };
  const std::size_t tok = static_cast<std::size_t>(T) * H * D;
  void* q = al(tok * 2);
  void* k = al(tok * 2);
  void* v = al(tok * 2);
  void* g = al(tok * 2);
  void* beta = al(T * H * 2);
  void* out = al(tok * 2);
  auto* A_log = static_cast<float*>(al(H * 4));
  auto* dt_bias = static_cast<float*>(al(H * D * 4));
  void* pool = al(static_cast<std::size_t>(2) * H * D * D * 4);
  auto* slots = static_cast<std::int32_t*>(al(4));
  auto* status = static_cast<std::uint32_t*>(al(4));
  std::int64_t cu_host[2] = {0, T};
  auto* cu = static_cast<std::int64_t*>(al(16));
  CK(cudaMemcpy(cu, cu_host, 16, cudaMemcpyHostToDevice));

  kda::Problem pp;
  pp.seq_len = T;
  pp.num_heads = H;
  pp.num_seqs = 1;
  pp.cu_seqlens_dtype = kda::DType::kI64;
  pp.initial_state_dtype = pp.final_state_dtype = kda::DType::kF32;
  std::size_t ws_bytes = 0;
  check(kda::workspace_size(pp, kda::Backend::kCuda, &ws_bytes), "workspace_size");
  void* ws = al(ws_bytes);
  kda::Tensors pt;
  pt.q = q;
  pt.k = k;
  pt.v = v;
  pt.g = g;
  pt.beta = beta;
  pt.A_log = A_log;
  pt.dt_bias = dt_bias;
  pt.cu_seqlens = cu;
  pt.cu_seqlens_host = cu_host;
  pt.initial_state = pool;
  pt.final_state = pool;
  pt.out = out;
  pt.device_status = status;

  kda::DecodeProblem dp;
  dp.batch = 1;
  dp.tokens = 1;
  dp.num_heads = H;
  dp.num_slots = 2;
  dp.state_dtype = kda::DType::kF32;
  kda::DecodeTensors dt;
  dt.q = q;
  dt.k = k;
  dt.v = v;
  dt.g = g;
  dt.beta = beta;
  dt.A_log = A_log;
  dt.dt_bias = dt_bias;
  dt.slots = slots;
  dt.state_pool = pool;
  dt.out = out;
  dt.device_status = status;

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto host_us = [&](auto&& call) { return kda_bench::host_us_per_call(s, 100, call); };
  kda::CudaOptions on, off;
  off.check_pointers = false;
  std::printf("\n### Host time per call (enqueue only; H = 32; median of 20 x 100 calls)\n\n");
  std::printf("| call | pointers checked | host us per call | checks off | cost of the checks |\n");
  std::printf("|---|---:|---:|---:|---:|\n");
  const double d_on = host_us([&] { check(kda::decode_cuda(dp, dt, s, on), "decode_cuda"); });
  const double d_off = host_us([&] { check(kda::decode_cuda(dp, dt, s, off), "decode_cuda"); });
  std::printf("| decode_cuda B = 1 | 11 | %.2f | %.2f | %.2f |\n", d_on, d_off, d_on - d_off);
  const double p_on = host_us([&] {
    check(kda::forward_cuda(pp, pt, {ws, ws_bytes}, s, on), "forward_cuda");
  });
  const double p_off = host_us([&] {
    check(kda::forward_cuda(pp, pt, {ws, ws_bytes}, s, off), "forward_cuda");
  });
  std::printf("| forward_cuda T = 64, 1 sequence | 13 | %.2f | %.2f | %.2f |\n", p_on, p_off,
              p_on - p_off);

  // 64 sequences of 16 tokens on fragmented slots (every other entry of a pool of 128): one call
  // through state slot indices, against 64 calls of one sequence each (what an engine without
  // slot indices must do when no two slots are consecutive).
  {
    const int n = 64, len = 16, tn = n * len;
    const std::size_t tk = static_cast<std::size_t>(tn) * H * D;
    void* q64 = al(tk * 2);
    void* k64 = al(tk * 2);
    void* v64 = al(tk * 2);
    void* g64 = al(tk * 2);
    void* b64 = al(static_cast<std::size_t>(tn) * H * 2);
    void* o64 = al(tk * 2);
    void* pool64 = al(static_cast<std::size_t>(2 * n) * H * D * D * 4);
    std::vector<std::int64_t> cu64(n + 1);
    std::vector<std::int32_t> slot64(n);
    for (int i = 0; i <= n; ++i) cu64[i] = static_cast<std::int64_t>(i) * len;
    for (int i = 0; i < n; ++i) slot64[i] = 2 * i + 1;
    auto* d_cu64 = static_cast<std::int64_t*>(al((n + 1) * 8));
    auto* d_slot64 = static_cast<std::int32_t*>(al(n * 4));
    CK(cudaMemcpy(d_cu64, cu64.data(), (n + 1) * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_slot64, slot64.data(), n * 4, cudaMemcpyHostToDevice));
    kda::Problem bp = pp;
    bp.seq_len = tn;
    bp.num_seqs = n;
    bp.num_state_slots = 2 * n;
    std::size_t ws64 = 0;
    check(kda::workspace_size(bp, kda::Backend::kCuda, &ws64), "workspace_size");
    void* w64 = al(ws64);
    kda::Tensors bt = pt;
    bt.q = q64;
    bt.k = k64;
    bt.v = v64;
    bt.g = g64;
    bt.beta = b64;
    bt.out = o64;
    bt.cu_seqlens = d_cu64;
    bt.cu_seqlens_host = cu64.data();
    bt.initial_state = bt.final_state = pool64;
    bt.state_slots = d_slot64;
    const double one = host_us([&] {
      check(kda::forward_cuda(bp, bt, {w64, ws64}, s, off), "forward_cuda");
    });
    // One sequence per call, each on its own state block (pointer arithmetic into the pool).
    kda::Problem sp = pp;  // one fixed-length row of 16 tokens
    sp.seq_len = len;
    sp.num_seqs = 0;
    sp.cu_seqlens_dtype = kda::DType::kNone;
    const std::size_t state1 = static_cast<std::size_t>(H) * D * D * 4;
    const double many = host_us([&] {
      for (int i = 0; i < n; i += 1) {
        kda::Tensors st = pt;
        const std::size_t off_tok = static_cast<std::size_t>(i) * len * H * D * 2;
        st.q = static_cast<char*>(q64) + off_tok;
        st.k = static_cast<char*>(k64) + off_tok;
        st.v = static_cast<char*>(v64) + off_tok;
        st.g = static_cast<char*>(g64) + off_tok;
        st.beta = static_cast<char*>(b64) + static_cast<std::size_t>(i) * len * H * 2;
        st.out = static_cast<char*>(o64) + off_tok;
        st.cu_seqlens = nullptr;
        st.cu_seqlens_host = nullptr;
        st.initial_state = st.final_state = static_cast<char*>(pool64) + slot64[i] * state1;
        check(kda::forward_cuda(sp, st, {w64, ws64}, s, off), "forward_cuda");
      }
    });
    std::printf(
        "| forward_cuda 64 x 16 tokens, fragmented slots: one call via state_slots | - | - | %.2f "
        "| - |\n",
        one);
    std::printf("| the same as 64 calls of one sequence (no slot indices) | - | - | %.2f | - |\n",
                many);
  }
  std::fflush(stdout);
  CK(cudaStreamDestroy(s));
  for (void* ptr : allocs) CK(cudaFree(ptr));
}

}  // namespace

int main(int argc, char** argv) {
  bool prefill = false, decode = false, host = false, paths = false, checkpoints = false,
       verify = false, copy = false;
  int iters = 30;
  std::string only;
  std::vector<int> batches;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--prefill")
      prefill = true;
    else if (a == "--decode")
      decode = true;
    else if (a == "--verify")
      verify = true;
    else if (a == "--copy")
      copy = true;
    else if (a == "--host")
      host = true;
    else if (a == "--paths")
      paths = true;
    else if (a == "--checkpoints")
      checkpoints = true;
    else if (a == "--iters" && i + 1 < argc)
      iters = std::max(3, std::atoi(argv[++i]));
    else if (a == "--case" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--batch" && i + 1 < argc && std::atoi(argv[i + 1]) >= 1 &&
             std::atoi(argv[i + 1]) <= 4096)
      batches.push_back(std::atoi(argv[++i]));
    else {
      std::fprintf(
          stderr,
          "usage: kda-bench [--prefill] [--decode] [--verify] [--copy] [--checkpoints] [--host] "
          "[--paths] [--iters N] [--case NAME] [--batch B (1..4096)]...\n");
      return 2;
    }
  }
  if (paths) {  // host only: before the device check
    print_paths(only);
    if (!prefill && !decode && !host && !checkpoints && !verify && !copy) return 0;
  }
  if (!prefill && !decode && !host && !checkpoints && !verify && !copy)
    prefill = decode = host = true;
  if (kda::cuda_device_count() == 0) {
    std::fprintf(stderr, "kda-bench: no CUDA device\n");
    return 1;
  }
  const double bw = kda::bench::measure_copy_bandwidth();
  std::printf("device: %s; device-to-device copy: %.2f TB/s (bytes read + written)\n",
              kda::device_name(0).c_str(), bw / 1e12);
  if (prefill) run_prefill(bw, iters, only);
  if (checkpoints) run_checkpoints(bw, iters, only);
  if (decode) run_decode(bw, iters, batches);
  if (verify) run_verify(bw, iters, batches);
  if (copy) run_copy(bw, iters, batches);
  if (host) run_host_overhead();
  return 0;
}
