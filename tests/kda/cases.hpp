// cases.hpp — the registry of operator test cases (cases.cpp), read by the backend-matrix tests
// (backend_matrix.hpp). Each entry names its shape, gate, varlen lengths, state dtypes, state
// slots, tolerances and the backends it runs on; a test walks the entries of its kind and runs
// those meant for its runner's backend. Adding a case here adds it to every test of that kind.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend_matrix.hpp"

namespace kda::test {

// Which backends a case runs on (the CUDA prefill implements K = V = 128 only, the CPU any size).
enum BackendMask : unsigned { kOnCpu = 1u, kOnCuda = 2u, kOnAll = 3u };
inline bool runs_on(unsigned mask, const Runner& runner) {
  return (mask & (runner.backend() == Backend::kCpu ? kOnCpu : kOnCuda)) != 0;
}

// Tolerances (relative errors ||x - ref|| / ||ref||).
inline constexpr double kCpuStateTol = 1e-3;  // CPU f32 state (fp32 accumulation)
inline constexpr double kBf16Tol = 2.5e-3;    // CPU bf16 out or bf16 state
inline constexpr double kFp64Tol = 2e-7;      // CPU fp64 mode: only the final rounding to f32
inline constexpr double kGpuOutTol = 4e-3;    // CUDA out vs the CPU backend (measured 2.8-3.2e-3)
inline constexpr double kGpuTol = 5e-3;       // CUDA state vs CPU, CUDA vs fp64, CUDA vs CUDA
// CUDA against the fp64 recurrence, the accuracy bar (measured 1.6-2.8e-3 on every case with the
// state update in fp16), and a bf16 final state, whose storage adds its own rounding.
inline constexpr double kGpuFp64Tol = 3e-3;
inline constexpr double kGpuFp64Bf16StateTol = 3.5e-3;

// What a prefill case's results are compared with.
enum class Against { kFp64, kCpu };

struct PrefillCase {
  std::string name;
  CaseOptions options;
  unsigned backends;
  Against against;
  double out_tol;
  double state_tol;  // an f32 final state (the CPU: bf16 states kBf16Tol, fp64 mode kFp64Tol)
  // CUDA cases against the CPU: also against the fp64 recurrence (a bf16 final state at least
  // kGpuFp64Bf16StateTol).
  double fp64_out_tol = kGpuFp64Tol;
  double fp64_state_tol = kGpuFp64Tol;
  // The CUDA prefill's schedule (CudaOptions::schedule): the cases that force one.
  PrefillSchedule schedule = PrefillSchedule::kAuto;
};
// Every prefill case: against == kFp64 ones are run by "prefill matches the fp64 reference" on
// their backends (the CPU in fp32 and fp64 mode), kCpu ones by "prefill matches the CPU backend".
const std::vector<PrefillCase>& prefill_cases();

// How the CUDA prepare kernel (kda/src/cuda/prefill_prepare.cu) treats a case's 16-token chunks,
// by its rule (kda/detail/prepare_paths.hpp, in fp64 here: a chunk right at a bound may count on
// the other side); the counts show which paths the CUDA cases reach.
struct PreparePaths {
  std::int64_t zero_ref = 0, middle_ref = 0, exact = 0;
};
PreparePaths prepare_paths(const CaseOptions& options);

// Prefill through state slots: the case's sequences are run through each of slot_lists() in a
// pool of 2N + 3 entries, and must equal the contiguous run bitwise.
struct SlotShape {
  std::string name;
  CaseOptions options;  // initial and final state in the same dtype
  unsigned backends;
};
const std::vector<SlotShape>& slot_shapes();

// Decode steps against the CPU decode; rows of every fourth sequence are padding (slot -1).
struct DecodeShape {
  std::int64_t batch, tokens, heads, num_slots;
  DType state;
  GateMode gate;
  std::uint64_t seed;
  unsigned backends;  // the CPU runs a few (it is every other backend's reference anyway)
  std::string name() const;
};
const std::vector<DecodeShape>& decode_shapes();
// B rows of `tokens` tokens, K = V = 128 unless given, pool values ~ N(0, 0.09), distinct
// shuffled slots.
DecodeCase make_decode_case(std::int64_t B, std::int64_t tokens, std::int64_t H,
                            std::int64_t num_slots, DType state_dtype, GateMode gate,
                            std::uint64_t seed, std::int64_t head_dim_k = 128,
                            std::int64_t head_dim_v = 128);

// Segment transitions. kFp64: applied to the initial state, equal to the fp64 final state within
// tol (and the empty first sequence's P^T is the identity); kCpu: P^T and H^T equal the CPU's.
struct TransitionCase {
  std::string name;
  CaseOptions options;
  unsigned backends;
  Against against;
  double tol;
};
const std::vector<TransitionCase>& transition_cases();

// A fixed-length case cut at `cut` tokens (one per backend): computed in two calls chained through
// the state (or the pool, or transitions), it must equal one call within tol (0: bitwise).
struct SplitCase {
  std::string name;
  CaseOptions options;
  std::vector<std::int64_t> cuts;
  unsigned backends;
  double tol;
  bool vs_fp64 = false;  // compared with the fp64 reference instead of the backend's one call
};
const std::vector<SplitCase>& split_cases();             // prefill chained through the state
const std::vector<SplitCase>& pooled_split_cases();      // through state slots of one pool
const std::vector<SplitCase>& transition_split_cases();  // through two transitions

// Cases whose repeated runs must be bitwise equal.
struct RepeatCase {
  std::string name;
  CaseOptions options;
  unsigned backends;
};
const std::vector<RepeatCase>& repeat_cases();

// CaseOptions for the CUDA backend's shapes: K = V = 128, f32 state in and out.
CaseOptions cuda_options(std::int64_t heads, std::uint64_t seed);

}  // namespace kda::test
