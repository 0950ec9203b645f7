// bench/decode_gemm_shapes.hpp — the GEMMs a whole layer's decode step runs, as out[rows, n] =
// in[rows, k] · W[n, k]ᵀ: the stacked input projection, o_proj and the low-rank second factor of
// Kimi-Linear-48B (hidden 2304, H = 32), its TP8 shard, and Kimi K3's TP8 shard (hidden 7168,
// H = 12, full-rank gate). The probes of the decode GEMMs (kda-gemv-probe, kda-gemm-algo-probe)
// time the same list.
#pragma once

#include <cstdint>

namespace kda_bench {

struct DecodeGemmShape {
  const char* name;
  std::int64_t n, k;
};

inline constexpr DecodeGemmShape kDecodeGemmShapes[] = {{"H = 32 input projection", 12576, 2304},
                                                        {"H = 32 o_proj", 2304, 4096},
                                                        {"H = 32 f_b", 4096, 128},
                                                        {"TP8 input projection", 1800, 2304},
                                                        {"TP8 o_proj", 2304, 512},
                                                        {"K3 TP8 input projection", 4760, 7168},
                                                        {"K3 TP8 g_proj", 1536, 7168},
                                                        {"K3 TP8 o_proj", 7168, 1536}};

}  // namespace kda_bench
