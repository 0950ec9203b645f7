// A kda_communicator (the C API's, kda/kda_engine.h) whose callbacks forward to a rank of a C++
// communicator group (kda/engine/communicator.hpp): the tests of the C API's adapter run it over
// the in-process transports, which their own tests check.
#pragma once

#include <cstddef>
#include <cstring>

#include "kda/engine/communicator.hpp"
#include "kda/kda_engine.h"

namespace kda::test {

// `c`'s rank as a kda_communicator whose buffers live in `memory` (KDA_BACKEND_CPU or _CUDA); a
// collective that throws returns 99.
inline kda_communicator c_communicator(kda::engine::Communicator* c, kda_backend memory) {
  kda_communicator result;
  std::memset(&result, 0, sizeof result);
  result.struct_size = sizeof result;
  result.user = c;
  result.rank = c->rank();
  result.size = c->size();
  result.memory = memory;
  result.all_reduce_sum = [](void* user, void* data, std::size_t count, kda_collective_dtype dtype,
                             void* stream) {
    try {
      static_cast<kda::engine::Communicator*>(user)->all_reduce_sum(
          data, count, dtype == KDA_COLLECTIVE_F32 ? kda::DType::kF32 : kda::DType::kBF16, stream);
      return 0;
    } catch (...) {
      return 99;
    }
  };
  result.all_gather = [](void* user, const void* send, void* recv, std::size_t bytes,
                         void* stream) {
    try {
      static_cast<kda::engine::Communicator*>(user)->all_gather(send, recv, bytes, stream);
      return 0;
    } catch (...) {
      return 99;
    }
  };
  return result;
}

}  // namespace kda::test
