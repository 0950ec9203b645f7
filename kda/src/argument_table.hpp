// The argument table of a prefill or decode call: one row per tensor the call touches.
//
// Why one table: the operator checks its tensors in several ways (non-null where needed, no output
// aliasing an input, the CUDA kernels' alignment, device memory large enough for the problem) and
// the engine checks its callers' tensors the same way. Each check used to carry its own list of
// the tensors, with the name, size and rules written again each time; a tensor added to one list
// and forgotten in another went unchecked. Here each tensor is described once, from the problem,
// with everything any check needs:
//
//   name            as messages spell it (the Tensors / DecodeTensors field)
//   ptr, bytes      the byte range the problem reads or writes (0 bytes: nothing to check)
//   cuda_alignment  what the CUDA kernels' vector loads and stores need of the pointer
//   role            what the call does with it; the aliasing rules follow from the role
//   space           backend memory (device for CUDA, host for CPU) or host memory always
//   dtype           element type (the state aliasing rule compares them)
//   presence        whether it must be set, may be null, or must be null for this problem
//
// and every check is a walk over the table (below). Building it allocates nothing, so the forward
// paths build it on every call.
#pragma once

#include <cstdint>
#include <limits>

#include "kda/kda.hpp"

namespace kda::detail {

// Every size of a valid problem stays below 2^63: the backends index with signed 64-bit integers.
inline constexpr std::uint64_t kMaxSize =
    static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

// What the call does with an argument.
enum class ArgumentRole : std::uint8_t {
  kInput,     // read: token tensors, gate parameters
  kIndex,     // read: cu_seqlens, slot indices (and their host copies)
  kStateIn,   // read: the prefill's initial_state
  kStateOut,  // written: the prefill's final_state; may be its kStateIn exactly (in-place update)
  kInOut,     // read and written in place: the decode's state_pool
  kOutput,    // written: out
  kStatus,    // written (bits ORed in): the device status word
  kScratch,   // written: the workspace (appended by the CUDA prefill for its device check)
};

// Whether the call writes the argument, so that it must overlap no other argument.
constexpr bool writes(ArgumentRole role) {
  return role == ArgumentRole::kStateOut || role == ArgumentRole::kInOut ||
         role == ArgumentRole::kOutput || role == ArgumentRole::kStatus ||
         role == ArgumentRole::kScratch;
}

enum class MemorySpace : std::uint8_t {
  kBackend,  // memory of the backend that runs the call: device memory for CUDA, host for CPU
  kHost,     // host memory whatever the backend (cu_seqlens_host, state_slots_host)
};

enum class Presence : std::uint8_t {
  kOptional,  // may be null
  kRequired,  // must be set: "<name> is null" (+ " but <why> is <dtype>" when why is given)
  kUnused,    // must be null for this problem: "<name> is set but <why>"
};

struct Argument {
  const char* name = nullptr;
  const void* ptr = nullptr;
  std::uint64_t bytes = 0;
  std::uint32_t cuda_alignment = 1;
  ArgumentRole role = ArgumentRole::kInput;
  MemorySpace space = MemorySpace::kBackend;
  DType dtype = DType::kNone;
  Presence presence = Presence::kOptional;
  const char* why = nullptr;  // see Presence

  // Setters for the builders' one-line rows.
  Argument& cuda(std::uint32_t alignment) {
    cuda_alignment = alignment;
    return *this;
  }
  Argument& host() {
    space = MemorySpace::kHost;
    return *this;
  }
  Argument& required_if(bool required, const char* dtype_field = nullptr) {
    if (required) {
      presence = Presence::kRequired;
      why = dtype_field;
    }
    return *this;
  }
  Argument& unused_because(const char* reason) {
    presence = Presence::kUnused;
    why = reason;
    return *this;
  }
};

// Fixed capacity, so that building a table allocates nothing.
struct ArgumentTable {
  static constexpr int kCapacity = 20;
  Argument items[kCapacity];
  int count = 0;

  Argument& add(const char* name, const void* ptr, std::uint64_t bytes, DType dtype,
                ArgumentRole role);
  const Argument* begin() const { return items; }
  const Argument* end() const { return items + count; }
};

// The table of a problem. Fails only where a size overflows 64-bit signed sizes (kOverflow naming
// it), so validate(p) is the field checks plus building the table with no tensors.
Status prefill_arguments(const Problem& p, const Tensors& t, ArgumentTable* table);
Status decode_arguments(const DecodeProblem& p, const DecodeTensors& t, ArgumentTable* table);
// A segment transition (kda.hpp): the prefill's inputs, p_t and h_t in place of out and states.
Status transition_arguments(const Problem& p, const Tensors& t, const float* p_t, const float* h_t,
                            ArgumentTable* table);
// apply_transition_*: s_in, p_t, h_t and s_out (an exact alias of s_in or disjoint from it).
Status apply_transition_arguments(std::int64_t pairs, std::int64_t head_dim_k,
                                  std::int64_t head_dim_v, const float* s_in, const float* p_t,
                                  const float* h_t, const float* s_out, ArgumentTable* table);

// One layer of a commit (kda.hpp): its records and pool, then the shared slots and num_accepted.
// With a default CommitLayer and null slots: the sizes alone (validate(p) builds it so).
Status commit_arguments(const CommitProblem& p, const CommitLayer& layer, const std::int32_t* slots,
                        const std::int32_t* num_accepted, ArgumentTable* table);

// validate(p)'s checks of the problem's fields, without building its table (problem.cpp): a
// table built with the tensors fails where validate(p)'s empty one would, so validate_arguments
// builds one table, not two.
Status check_problem_fields(const Problem& p);
Status check_problem_fields(const DecodeProblem& p);

// can_implement(p, backend) and then validate(p, t), for the backends' own calls: the same checks
// in the same order (the backend, the problem's fields, its sizes, the backend's limits, the
// tensors), with one argument table built (handed back) where the two calls built three.
Status implement_and_validate(const Problem& p, const Tensors& t, Backend backend,
                              ArgumentTable* table);
Status implement_and_validate(const DecodeProblem& p, const DecodeTensors& t, Backend backend,
                              ArgumentTable* table);

// workspace_size(p, backend) of a problem these checks passed (a backend's own call): the bytes
// without checking the problem a second time.
Status checked_workspace_size(const Problem& p, Backend backend, std::size_t* bytes);
Status checked_workspace_size(const DecodeProblem& p, Backend backend, std::size_t* bytes);

// validate(p, t) that also hands back the table, for the backends' further walks.
Status validate_arguments(const Problem& p, const Tensors& t, ArgumentTable* table);
Status validate_arguments(const DecodeProblem& p, const DecodeTensors& t, ArgumentTable* table);

// Whether two rows' byte ranges overlap (a null pointer or 0 bytes overlaps nothing).
bool overlaps(const Argument& a, const Argument& b);
// A bare byte range as a row, for overlap checks between ranges no table holds.
inline Argument byte_range(const void* ptr, std::uint64_t bytes) {
  Argument a;
  a.ptr = ptr;
  a.bytes = bytes;
  return a;
}

// ---- The walks. Each returns the first failing row's kInvalidArgument, in table order. ----------
// Presence: required rows set, unused rows null.
Status check_presence(const ArgumentTable& table);
// Aliasing: a kStateOut row equals its kStateIn row exactly (same dtype) or overlaps it not at all;
// every other written row overlaps no other row.
Status check_no_overlap(const ArgumentTable& table);
// A call's tensors: presence, then aliasing (every table of a call is walked both ways, in order).
Status check_tensors(const ArgumentTable& table);
// The `bytes` of workspace a call uses overlap none of its tensors: the backends write it (the CPU
// before its last checks), so an overlap would change an input or an output of a refused call.
Status check_workspace_apart(const ArgumentTable& table, const void* workspace,
                             std::uint64_t bytes);
// CUDA: every backend row's pointer is a multiple of its cuda_alignment; `user` ends the message
// ("q must be 16-byte aligned for <user>").
Status check_cuda_alignment(const ArgumentTable& table, const char* user);
// CudaOptions::decode_blocks_per_head's counts of blocks a (sequence, head) (0, choose, aside).
constexpr bool valid_blocks_per_head(int blocks) {
  return blocks == 1 || blocks == 2 || blocks == 4;
}
// The host copies a CUDA call was handed (Tensors::cu_seqlens_host, state_slots_host), checked as
// the CPU checks the arrays themselves.
Status check_host_copies(const Problem& p, const Tensors& t);
// kda::check_cuda_call (kda.hpp), handing back the call's table for the backend's further walks:
// the checks forward_cuda / decode_cuda make before their workspace and pointer checks.
Status check_cuda_call(const Problem& p, const Tensors& t, const CudaOptions& opt,
                       ArgumentTable* table);
Status check_cuda_call(const DecodeProblem& p, const DecodeTensors& t, const CudaOptions& opt,
                       ArgumentTable* table);
// CUDA builds: every backend row lies in device (or managed) memory of the current device, inside
// one allocation that holds its bytes (kda/src/cuda/device.cu). Without CUDA: kBackendUnavailable.
Status check_device_arguments(const ArgumentTable& table);
// The same with the call's workspace as one more row (the prefill's and the transition's).
Status check_device_arguments(ArgumentTable table, const void* workspace, std::uint64_t bytes);

}  // namespace kda::detail
