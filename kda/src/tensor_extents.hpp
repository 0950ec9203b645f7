// The byte ranges of a problem's tensors, for checks that need them beyond validate(): the CUDA
// backend asks the driver whether each range lies in device memory of the current device.
#pragma once

#include <cstdint>

#include "kda/kda.hpp"

namespace kda::detail {

struct TensorExtent {
  const char* name = nullptr;
  const void* ptr = nullptr;
  std::uint64_t bytes = 0;  // 0 or a null ptr: nothing to check
};

// Fixed capacity, so that collecting them allocates nothing.
struct TensorExtents {
  static constexpr int kCapacity = 16;
  TensorExtent items[kCapacity];
  int count = 0;
  void add(const char* name, const void* ptr, std::uint64_t bytes) {
    if (count < kCapacity) items[count++] = TensorExtent{name, ptr, bytes};
  }
};

// The device-side tensors of a problem the caller has already validated (validate(p, t)), so that
// the forward does not validate twice; cu_seqlens_host is a host pointer and not listed. Fails only
// where the size computation itself does.
Status prefill_extents(const Problem& p, const Tensors& t, TensorExtents* out);
Status decode_extents(const DecodeProblem& p, const DecodeTensors& t, TensorExtents* out);

// CUDA builds: every listed range lies in device (or managed) memory of the current device, inside
// one allocation. The first failing range gives kInvalidArgument naming it.
Status check_device_extents(const TensorExtents& extents);

}  // namespace kda::detail
