// kda-step-probe — where the one-launch decode step's time goes
// (layer/src/cuda/one_launch_step.cu). For Kimi-Linear-48B (hidden 2304, H = 32), its TP8 shard (H
// = 4) and Kimi K3's TP8 shard (hidden 7168, H = 12, full-rank gate): the kernel launched directly
// on copies of the weights beyond three times L2 (each launch reads the next copy), CUDA events
// around 50 launches after 10 warm-up (the median of 5 such rounds), then one launch traced: each
// block's device-clock stamps where its phases end, as microseconds from the first block's start
// (the minimum, median and maximum over the head blocks and over the o_proj blocks). A stamp is
// thread 0 reading the global timer and storing it; on the H200 two stamps with only a branch on a
// kernel parameter between them came out 0.3 us apart, so a short interval holds costs beside its
// code. Then five pairs of launches back to back, both traced: the hand-off from the first's last
// block leaving to the second's first block, its wait for the kernel before and its hidden row.
// The weights' values are arbitrary (every byte 0x3c); the timing does not depend on them.
// CUDA only.
// Usage: kda-step-probe [--rows R]...: steps of R rows (sequences of one token; default 1), each
// R a table of its own per shape.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "cuda/kernels.hpp"

namespace {

void* device_bytes(std::size_t bytes, int fill) {
  void* p = nullptr;
  CK(cudaMalloc(&p, bytes));
  CK(cudaMemset(p, fill, bytes));
  return p;
}

struct Shape {
  const char* name;
  std::int64_t hidden, heads;
  bool full_rank;
};

constexpr std::int64_t D = 128, W = 4, kSlots = 8;

// One copy of a layer's weights (the parts the step reads), freed with it.
struct WeightCopy {
  std::vector<void*> owned;
  kda::layer::cuda::OneLaunchStepParams p;
  WeightCopy(const Shape& s, std::int64_t proj_rows, int rows) {
    const std::int64_t E = s.hidden, Cl = s.heads * D;
    auto take = [&](std::size_t bytes, int fill) {
      owned.push_back(device_bytes(bytes, fill));
      return owned.back();
    };
    p.w_in = static_cast<const std::uint16_t*>(take(proj_rows * E * 2, 0x3c));
    p.w_fb = static_cast<const std::uint16_t*>(take(Cl * D * 2, 0x3c));
    if (s.full_rank) {
      p.w_g = static_cast<const std::uint16_t*>(take(Cl * E * 2, 0x3c));
    } else {
      p.w_gb = static_cast<const std::uint16_t*>(take(Cl * D * 2, 0x3c));
    }
    p.w_o = static_cast<const std::uint16_t*>(take(E * Cl * 2, 0x3c));
    p.conv_weight = static_cast<const float*>(take(3 * Cl * W * 4, 0x3c));
    p.A_log = static_cast<const float*>(take(s.heads * 4, 0));
    p.dt_bias = static_cast<const float*>(take(Cl * 4, 0));
    p.o_norm = static_cast<const float*>(take(D * 4, 0x3c));
    p.sync = static_cast<std::uint32_t*>(take(kda::layer::cuda::kOneLaunchSyncWords * 4, 0));
    const std::int64_t words =
        kda::layer::cuda::one_launch_exchange_words(rows, proj_rows, Cl, s.full_rank);
    p.exchange = static_cast<std::uint64_t*>(take(words * 8, 0));
  }
  std::size_t bytes(const Shape& s, std::int64_t proj_rows) const {
    const std::int64_t E = s.hidden, Cl = s.heads * D;
    return static_cast<std::size_t>(proj_rows * E + Cl * D + (s.full_rank ? Cl * E : Cl * D) +
                                    E * Cl) *
           2;
  }
  ~WeightCopy() {
    for (void* q : owned) cudaFree(q);
  }
  WeightCopy(const WeightCopy&) = delete;
  WeightCopy& operator=(const WeightCopy&) = delete;
};

using kda_bench::median;

// "min / median / max" of `v`, in us to two places, signed where `sign` ("-" when empty).
std::string spread(std::vector<double> v, bool sign) {
  if (v.empty()) return "-";
  std::sort(v.begin(), v.end());
  char buf[96];
  const double lo = v.front(), mid = v[v.size() / 2], hi = v.back();
  if (sign) {
    std::snprintf(buf, sizeof buf, "%+.2f / %+.2f / %+.2f", lo, mid, hi);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f / %.2f / %.2f", lo, mid, hi);
  }
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> row_counts;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc && std::atoi(argv[i + 1]) >= 1 &&
        std::atoi(argv[i + 1]) <= kSlots) {
      row_counts.push_back(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--rows R (1..%d)]...\n", argv[0], static_cast<int>(kSlots));
      return 2;
    }
  }
  if (row_counts.empty()) row_counts.push_back(1);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const Shape shapes[] = {{"H = 32", 2304, 32, false},
                          {"TP8 shard (H = 4)", 2304, 4, false},
                          {"K3 TP8 shard (H = 12)", 7168, 12, true}};
  const char* stamp_names[kda::layer::cuda::kOneLaunchTraceStamps] = {
      "start",
      "hidden row loaded",
      "projection rows done",
      "values taken (head: projection, conv and second factors done; o_proj: y)",
      "o_proj: W_o landed",
      "head: state's store issued; o_proj: rows done",
      "leaving",
      "head: state in registers",
      "head: step computed",
      "head: state back in shared memory",
      "head: norm done, y written (warp 0)",
      "own words taken (thread 0)",
      "the wait for the kernel before returned"};
  std::printf("# kda-step-probe, %s, %d multiprocessors\n", prop.name, prop.multiProcessorCount);
  for (const Shape& s : shapes) {
    for (const int R : row_counts) {
      const std::int64_t E = s.hidden, H = s.heads, Cl = H * D;
      const std::int64_t proj_rows = 3 * Cl + D + (s.full_rank ? 0 : D) + H;
      std::vector<WeightCopy*> copies;
      copies.push_back(new WeightCopy(s, proj_rows, R));
      const std::size_t copy_bytes = copies[0]->bytes(s, proj_rows);
      const std::size_t wanted =
          std::max<std::size_t>(2, 3 * static_cast<std::size_t>(prop.l2CacheSize) / copy_bytes + 1);
      while (copies.size() < wanted) copies.push_back(new WeightCopy(s, proj_rows, R));
      // The batch's buffers, shared by the copies.
      void* hidden = device_bytes(R * E * 2, 0x3c);
      void* out = device_bytes(R * E * 2, 0);
      void* state = device_bytes(kSlots * H * D * D * 4, 0x3c);
      void* conv[3] = {device_bytes(kSlots * Cl * (W - 1) * 2, 0x3c),
                       device_bytes(kSlots * Cl * (W - 1) * 2, 0x3c),
                       device_bytes(kSlots * Cl * (W - 1) * 2, 0x3c)};
      void* status = device_bytes(4, 0);
      const int blocks = prop.multiProcessorCount;
      auto* trace = static_cast<std::uint64_t*>(
          device_bytes(blocks * kda::layer::cuda::kOneLaunchTraceStamps * 8, 0));
      for (WeightCopy* c : copies) {
        auto& p = c->p;
        p.rows = R;
        p.hidden = static_cast<const std::uint16_t*>(hidden);
        p.hidden_size = E;
        p.proj_rows = proj_rows;
        p.f_a_col = 3 * Cl;
        p.g_a_col = 3 * Cl + D;
        p.beta_col = 3 * Cl + D + (s.full_rank ? 0 : D);
        for (int b = 0; b < 3; ++b) p.conv_pools[b] = static_cast<std::uint16_t*>(conv[b]);
        p.state = state;
        p.f32_state = true;
        p.num_slots = kSlots;
        p.heads = static_cast<int>(H);
        p.width = static_cast<int>(W);
        p.gate_mode = s.full_rank ? kda::GateMode::kLowerBound : kda::GateMode::kSoftplus;
        p.scale = 0.0883883f;
        p.out = static_cast<std::uint16_t*>(out);
        p.status = static_cast<std::uint32_t*>(status);
      }
      if (!kda::layer::cuda::one_launch_step_fits(copies[0]->p)) {
        std::printf("\n## %s, %d rows: the one-launch step does not take this shape\n", s.name, R);
        for (WeightCopy* c : copies) delete c;
        for (void* q :
             {hidden, out, state, conv[0], conv[1], conv[2], status, static_cast<void*>(trace)}) {
          cudaFree(q);
        }
        continue;
      }
      cudaEvent_t start, stop;
      CK(cudaEventCreate(&start));
      CK(cudaEventCreate(&stop));
      std::size_t next = 0;
      auto launch = [&]() {
        CK(kda::layer::cuda::launch_one_launch_step(copies[next]->p, nullptr));
        next = (next + 1) % copies.size();
      };
      for (int i = 0; i < 10; ++i) launch();
      std::vector<double> rounds;
      for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(start));
        for (int i = 0; i < 50; ++i) launch();
        CK(cudaEventRecord(stop));
        CK(cudaEventSynchronize(stop));
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, start, stop));
        rounds.push_back(ms * 1e3 / 50.0);
      }
      std::vector<double> traced_rounds;
      std::vector<std::uint64_t> stamps(static_cast<std::size_t>(blocks) *
                                        kda::layer::cuda::kOneLaunchTraceStamps);
      // The traced launch: the median of 5 (each after 3 untraced launches) by its span.
      std::vector<std::vector<std::uint64_t>> traces;
      for (int r = 0; r < 5; ++r) {
        for (int i = 0; i < 3; ++i) launch();
        copies[next]->p.trace = trace;
        launch();
        copies[(next + copies.size() - 1) % copies.size()]->p.trace = nullptr;
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(stamps.data(), trace, stamps.size() * 8, cudaMemcpyDeviceToHost));
        traces.push_back(stamps);
      }
      std::uint32_t status_word = 0;
      CK(cudaMemcpy(&status_word, status, 4, cudaMemcpyDeviceToHost));
      const double weight_mb = static_cast<double>(copy_bytes) / 1e6;
      std::printf(
          "\n## %s, %d rows: %.1f us a launch (median of 5 rounds of 50), %.1f MB of weights,"
          " %.2f TB/s; status %u\n\n",
          s.name, R, median(rounds), weight_mb, weight_mb / median(rounds), status_word);
      std::printf(
          "| stamp | head blocks min / median / max (us) | o_proj blocks min / median / max |\n"
          "|---|---|---|\n");
      const std::vector<std::uint64_t>& t = traces[2];
      std::uint64_t t0 = ~0ull;
      for (int b = 0; b < blocks; ++b)
        t0 = std::min(t0, t[b * kda::layer::cuda::kOneLaunchTraceStamps]);
      for (int k = 0; k < kda::layer::cuda::kOneLaunchTraceStamps; ++k) {
        std::vector<double> head, rest;
        for (int b = 0; b < blocks; ++b) {
          const std::uint64_t v = t[b * kda::layer::cuda::kOneLaunchTraceStamps + k];
          if (v == 0) continue;
          (b < R * H ? head : rest).push_back(static_cast<double>(v - t0) * 1e-3);
        }
        std::printf("| %d %s | %s | %s |\n", k, stamp_names[k], spread(head, false).c_str(),
                    spread(rest, false).c_str());
      }
      // The hand-off between two launches back to back: the second's blocks against the first's
      // last block leaving (stamps of both launches on the one global timer).
      auto* trace_next = static_cast<std::uint64_t*>(device_bytes(stamps.size() * 8, 0));
      std::printf(
          "\n| launch after launch | first's last block leaving (us from its start) | second's "
          "first block start | second's wait returned min / median / max | second's hidden row "
          "loaded min / median / max |\n|---|---|---|---|---|\n");
      std::vector<std::uint64_t> next_stamps(stamps.size());
      for (int r = 0; r < 5; ++r) {
        for (int i = 0; i < 3; ++i) launch();
        const std::size_t first = next;
        copies[first]->p.trace = trace;
        copies[(first + 1) % copies.size()]->p.trace = trace_next;
        launch();
        launch();
        copies[first]->p.trace = nullptr;
        copies[(first + 1) % copies.size()]->p.trace = nullptr;
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(stamps.data(), trace, stamps.size() * 8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(next_stamps.data(), trace_next, stamps.size() * 8, cudaMemcpyDeviceToHost));
        const int S = kda::layer::cuda::kOneLaunchTraceStamps;
        std::uint64_t a0 = ~0ull, a_left = 0, b0 = ~0ull;
        std::vector<double> wait_back, row_in;
        for (int b = 0; b < blocks; ++b) {
          a0 = std::min(a0, stamps[b * S]);
          a_left = std::max(a_left, stamps[b * S + kda::layer::cuda::kStampLeaving]);
          b0 = std::min(b0, next_stamps[b * S]);
        }
        for (int b = 0; b < blocks; ++b) {
          wait_back.push_back(
              (static_cast<double>(next_stamps[b * S + kda::layer::cuda::kStampWaitReturned]) -
               static_cast<double>(a_left)) *
              1e-3);
          row_in.push_back(
              (static_cast<double>(next_stamps[b * S + kda::layer::cuda::kStampHiddenLoaded]) -
               static_cast<double>(a_left)) *
              1e-3);
        }
        std::printf("| %d | %.2f | %+.2f | %s | %s |\n", r, static_cast<double>(a_left - a0) * 1e-3,
                    (static_cast<double>(b0) - static_cast<double>(a_left)) * 1e-3,
                    spread(wait_back, true).c_str(), spread(row_in, true).c_str());
      }
      cudaFree(trace_next);
      CK(cudaMemset(trace, 0, stamps.size() * 8));
      for (WeightCopy* c : copies) delete c;
      for (void* q :
           {hidden, out, state, conv[0], conv[1], conv[2], status, static_cast<void*>(trace)}) {
        cudaFree(q);
      }
    }
  }
  return 0;
}
