// engine/runtime/src/no_nccl.cpp — the NCCL factories of communicator.hpp in a build without
// NCCL (KDA_NCCL off or not found): they throw, so that the API is the same in every build.
#include "kda/engine/communicator.hpp"
#include "kda/error.hpp"

namespace kda::engine {

namespace {

[[noreturn]] void no_nccl(const char* what) {
  throw Error(StatusCode::kBackendUnavailable,
              std::string(what) + ": this build has no NCCL (configure with KDA_NCCL=ON)");
}

}  // namespace

bool nccl_compiled() noexcept { return false; }

NcclUniqueId nccl_unique_id() { no_nccl("nccl_unique_id"); }

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm*, bool) {
  no_nccl("make_nccl_communicator");
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int, int, int) {
  no_nccl("make_nccl_communicator");
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>&) {
  no_nccl("make_nccl_communicators");
}

}  // namespace kda::engine
