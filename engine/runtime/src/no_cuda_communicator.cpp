// engine/runtime/src/no_cuda_communicator.cpp — make_cuda_local_communicators in a build (or
// library: kda_engine_cpu) without CUDA, so that the API is the same in every build.
#include "kda/engine/communicator.hpp"
#include "kda/error.hpp"

namespace kda::engine {

std::vector<std::unique_ptr<Communicator>> make_cuda_local_communicators(int,
                                                                         const std::vector<int>&) {
  throw Error(StatusCode::kBackendUnavailable,
              "make_cuda_local_communicators: this build has no CUDA backend");
}

}  // namespace kda::engine
