// kda/detail/prepare_paths.hpp — which of its paths the CUDA prepare kernel
// (kda/src/cuda/prefill_prepare.cu) takes for a (16-token chunk, head), stated once for the kernel
// and for the host code that predicts it: the tests (the CUDA cases must reach every path) and
// kda-bench --paths (each benchmark case's share per path). Not part of the operator's contract.
#pragma once

#include <algorithm>

namespace kda::detail {

// The factored paths write exp(G_i - G_j) = exp(G_i - r) exp(r - G_j) around a reference r per
// channel; every factor must stay a normal fp32 (and bf16) number, so the decay that r spans may
// not reach this bound (nats). The kernel compares in log2 units: this times log2(e).
inline constexpr double kPrepareFactoredBoundNats = 80.0;

enum class PreparePath : int {
  kReference0 = 0,  // r = 0 (the chunk start): every channel decays < the bound over the chunk
  kMiddle = 1,      // r = the middle of each channel's decay range: every half range < the bound
  kExact = 2,       // differences G_i - G_j <= 0 only (scalar exps)
};

// The rule, in fp64 on the host (the kernel decides in fp32, so a chunk right at the bound may
// fall on the other side). Feed it each channel of one (chunk, head), then ask for the path.
class PrepareChunkRule {
 public:
  // g: the channel's cumulative log decay over the chunk's 16 tokens, g[t] = sum of the first
  // t + 1 tokens' log decays (<= 0, non-increasing; a padded token past the sequence adds 0).
  void add_channel(const double* g, int chunk) {
    decay_ = std::max(decay_, -g[chunk - 1]);
    half_range_ = std::max(half_range_, 0.5 * (g[0] - g[chunk - 1]));
    const int h = chunk / 2;
    half_of_half_ = std::max({half_of_half_, 0.5 * (g[0] - g[h - 1]), 0.5 * (g[h] - g[chunk - 1])});
  }
  PreparePath path() const {
    return decay_ < kPrepareFactoredBoundNats        ? PreparePath::kReference0
           : half_range_ < kPrepareFactoredBoundNats ? PreparePath::kMiddle
                                                     : PreparePath::kExact;
  }
  // Whether a two-level reference (each 8-token half around its own middle, the cross block
  // around the first half's end) would keep this chunk factored: an experiment measured slower
  // (docs/design/prefill.md, "What was learned") and not in the kernel; kda-bench --paths reports
  // the exact path's share that it would take.
  bool within_two_levels() const { return half_of_half_ < kPrepareFactoredBoundNats; }

 private:
  double decay_ = 0, half_range_ = 0, half_of_half_ = 0;
};

}  // namespace kda::detail
