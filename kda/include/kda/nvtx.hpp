// kda/nvtx.hpp — NVTX3 ranges in the `kda` domain, so a user profiling with Nsight Systems sees
// every layer and kernel. Compiled out when the NVTX3 headers are absent (CPU-only build) or when
// NVTX_DISABLE is defined.
#pragma once

#if defined(KDA_HAVE_NVTX) && !defined(NVTX_DISABLE)
#include <nvtx3/nvtx3.hpp>
namespace kda {
struct nvtx_domain {
  static constexpr char const* name{"kda"};
};
}  // namespace kda
#define KDA_NVTX_CAT2(a, b) a##b
#define KDA_NVTX_CAT(a, b) KDA_NVTX_CAT2(a, b)
// Scoped range with a string-literal or runtime name.
#define KDA_NVTX_RANGE(msg) \
  ::nvtx3::scoped_range_in<::kda::nvtx_domain> KDA_NVTX_CAT(kda_nvtx_range_, __LINE__) { msg }
#else
#define KDA_NVTX_RANGE(msg) \
  do {                      \
  } while (0)
#endif
