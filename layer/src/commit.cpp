// layer/src/commit.cpp — kda::layer::commit: a record-and-commit verify step's accepted tokens
// folded into the states of many layers at once (layer.hpp). The recurrent states through the
// operator's commit, the conv states here (CPU) or by one kernel (cuda/conv_commit.cu).
#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "backends.hpp"
#include "checks.hpp"
#include "kda/detail/checked_math.hpp"
#include "kda/error.hpp"
#include "kda/layer/layer.hpp"
#include "kda/nvtx.hpp"

#ifdef KDA_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/kernels.hpp"
#endif

namespace kda::layer {

namespace {

[[noreturn]] void invalid(const char* what, const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, std::string(what) + ": " + message);
}

bool padding_row(const CommitBatch& b, std::int64_t slot) {
  return slot < 0 || slot == b.padding_slot;
}

// The bytes of each layer's pools and records regions in a commit (the States agree on num_slots,
// recurrent_dtype and record_rows, each >= 0, once check_commit's loop has run); kOverflow past 64
// bits.
struct CommitRegionBytes {
  std::uint64_t conv_pool = 0, conv_records = 0, recurrent = 0, recurrent_records = 0;
};
CommitRegionBytes commit_region_bytes(const Config& c, const State& first, const char* what) {
  const auto slots = static_cast<std::uint64_t>(first.num_slots);
  const auto rows = static_cast<std::uint64_t>(first.record_rows);
  const auto Cl = static_cast<std::uint64_t>(c.local_channels());
  const auto Hl = static_cast<std::uint64_t>(c.local_heads());
  const auto D = static_cast<std::uint64_t>(c.head_dim);
  const auto W1 = static_cast<std::uint64_t>(c.conv_width - 1);
  const auto state_element = static_cast<std::uint64_t>(dtype_size(first.recurrent_dtype));
  CommitRegionBytes b;
  if (!kda::detail::checked_product({slots, Cl, W1, 2}, &b.conv_pool) ||
      !kda::detail::checked_product({rows, 3, Cl, 2}, &b.conv_records) ||
      !kda::detail::checked_product({slots, Hl, D, D, state_element}, &b.recurrent) ||
      !kda::detail::checked_product({rows, Hl, 3, D, 4}, &b.recurrent_records)) {
    throw Error(StatusCode::kOverflow,
                std::string(what) + ": a layer's pool or records bytes overflow 64-bit sizes");
  }
  return b;
}

// The conv pools a commit writes overlap none of the call's other pools and records regions, in
// any layer (the operator's commit checks the recurrent pools and records against each other).
void check_conv_pools_apart(const Config& c, const State* states, int num_layers,
                            const char* what) {
  if (c.conv_width <= 1) return;
  const CommitRegionBytes bytes = commit_region_bytes(c, states[0], what);
  struct Region {
    const void* ptr;
    std::uint64_t bytes;
    const char* name;
  };
  auto regions_of = [&](const State& s) {
    return std::array<Region, 6>{
        Region{s.conv_q, bytes.conv_pool, "conv_q pool"},
        Region{s.conv_k, bytes.conv_pool, "conv_k pool"},
        Region{s.conv_v, bytes.conv_pool, "conv_v pool"},
        Region{s.conv_records, bytes.conv_records, "conv_records"},
        Region{s.recurrent, bytes.recurrent, "recurrent pool"},
        Region{s.recurrent_records, bytes.recurrent_records, "recurrent_records"}};
  };
  for (int l = 0; l < num_layers; ++l) {
    const auto written = regions_of(states[l]);
    for (int w = 0; w < 3; ++w) {  // the conv pools
      for (int m = 0; m < num_layers; ++m) {
        const auto other = regions_of(states[m]);
        for (int r = 0; r < 6; ++r) {
          if (m == l && r == w) continue;
          if (m < l && r < 3) continue;  // a pair of conv pools once, named by the first
          if (detail::byte_ranges_overlap(written[w].ptr, written[w].bytes, other[r].ptr,
                                          other[r].bytes)) {
            invalid(what, "layer " + std::to_string(l) + "'s " + written[w].name +
                              " overlaps layer " + std::to_string(m) + "'s " + other[r].name +
                              " (a commit writes each conv pool)");
          }
        }
      }
    }
  }
}

// Everything the host can check, before anything is written. `slots_host` / `accepted_host`:
// where the host can read them (the arrays on the CPU, their optional copies on CUDA), else null.
void check_commit(const Config& c, const CommitBatch& b, const State* states, int num_layers,
                  const std::int32_t* slots_host, const std::int32_t* accepted_host,
                  const char* what) {
  validate(c);
  const std::int64_t N = b.sequences, T = b.decode_tokens;
  if (N < 0) invalid(what, "sequences must be >= 0");
  if (T < 1 || T > kMaxDecodeTokens) {
    invalid(what, "decode_tokens " + std::to_string(T) + " is not in [1, " +
                      std::to_string(kMaxDecodeTokens) + "]");
  }
  if (num_layers < 0) invalid(what, "num_layers must be >= 0");
  if (num_layers > 0 && states == nullptr) invalid(what, "states is null");
  if (N == 0 || num_layers == 0) return;
  if (b.slots == nullptr || b.num_accepted == nullptr)
    invalid(what, "slots or num_accepted is null");
  const State& first = states[0];
  for (int l = 0; l < num_layers; ++l) {
    const State& s = states[l];
    auto layer = [l] { return "layer " + std::to_string(l) + " of the call"; };  // for an error
    if (s.num_slots != first.num_slots || s.recurrent_dtype != first.recurrent_dtype ||
        s.record_rows != first.record_rows) {
      invalid(what, layer() + ": num_slots, recurrent_dtype or record_rows differs from layer 0's");
    }
    if (s.record_rows / T < N) {  // record_rows < N x T, T in [1, kMaxDecodeTokens]
      invalid(what, layer() + ": record_rows " + std::to_string(s.record_rows) + " is below " +
                        std::to_string(N) + " x " + std::to_string(T) + " row-token pairs");
    }
    const bool conv_missing =
        c.conv_width > 1 && (s.conv_q == nullptr || s.conv_k == nullptr || s.conv_v == nullptr ||
                             s.conv_records == nullptr);
    if (s.recurrent == nullptr || s.recurrent_records == nullptr || conv_missing) {
      invalid(what, layer() + ": a state pool or a records region is null");
    }
  }
  if (first.num_slots < 0) {
    invalid(what, "State::num_slots " + std::to_string(first.num_slots) + " is negative");
  }
  check_conv_pools_apart(c, states, num_layers, what);
  if (b.padding_slot >= first.num_slots) {
    invalid(what, "padding_slot " + std::to_string(b.padding_slot) +
                      " is outside [0, num_slots = " + std::to_string(first.num_slots) +
                      ") (negative: none)");
  }
  if (slots_host == nullptr) return;
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t slot = slots_host[n];
    if (padding_row(b, slot)) continue;
    if (slot >= first.num_slots) {
      invalid(what, "row " + std::to_string(n) + " has slot " + std::to_string(slot) +
                        ", outside [0, num_slots = " + std::to_string(first.num_slots) + ")");
    }
    if (accepted_host != nullptr && (accepted_host[n] < 1 || accepted_host[n] > T)) {
      invalid(what, "row " + std::to_string(n) + " has num_accepted " +
                        std::to_string(accepted_host[n]) +
                        ", outside [1, decode_tokens = " + std::to_string(T) + "]");
    }
  }
  const auto [m, n] = detail::find_repeated_slot(
      slots_host, N, [&](std::int32_t slot) { return padding_row(b, slot); });
  if (m >= 0) {
    invalid(what, "rows " + std::to_string(m) + " and " + std::to_string(n) + " share slot " +
                      std::to_string(slots_host[n]) + " (a commit writes each state once)");
  }
}

CommitProblem commit_problem(const Config& c, const CommitBatch& b, const State& s) {
  CommitProblem p;
  p.batch = b.sequences;
  p.tokens = b.decode_tokens;
  p.num_heads = c.local_heads();
  p.head_dim_k = p.head_dim_v = c.head_dim;
  p.num_slots = s.num_slots;
  p.state_dtype = s.recurrent_dtype;
  p.padding_slot = b.padding_slot;
  return p;
}

// The conv states of one layer on the CPU: the last W-1 of old ++ the first n inputs.
void commit_conv_cpu(const Config& c, const CommitBatch& b, const State& s) {
  const std::int64_t W = c.conv_width, Cl = c.local_channels(), hist = W - 1;
  if (hist <= 0) return;
  bf16_bits* const pools[3] = {s.conv_q, s.conv_k, s.conv_v};
  for (std::int64_t row = 0; row < b.sequences; ++row) {
    const std::int64_t slot = b.slots[row];
    if (padding_row(b, slot)) continue;
    const bf16_bits* inputs = s.conv_records + row * b.decode_tokens * 3 * Cl;
    for (int branch = 0; branch < 3; ++branch) {
      detail::shift_conv_states(pools[branch] + slot * Cl * hist, Cl, hist, b.num_accepted[row],
                                inputs + branch * Cl, 3 * Cl);
    }
  }
}

// With more layers than the operator's commit takes a call, its groups are checked one by one:
// the recurrent pools of layers in different groups, against each other and against the other's
// records (which the commit reads while it writes the pool), here. O(num_layers^2) comparisons,
// only past kMaxCommitLayers layers.
void check_pools_across_groups(const Config& c, const State* states, int num_layers,
                               const char* what) {
  const CommitRegionBytes bytes = commit_region_bytes(c, states[0], what);
  const std::uint64_t pool_bytes = bytes.recurrent, record_bytes = bytes.recurrent_records;
  for (int l = 0; l < num_layers; ++l) {
    for (int m = (l / kMaxCommitLayers + 1) * kMaxCommitLayers; m < num_layers; ++m) {
      const State &a = states[l], &b = states[m];
      if (detail::byte_ranges_overlap(a.recurrent, pool_bytes, b.recurrent, pool_bytes) ||
          detail::byte_ranges_overlap(a.recurrent, pool_bytes, b.recurrent_records, record_bytes) ||
          detail::byte_ranges_overlap(b.recurrent, pool_bytes, a.recurrent_records, record_bytes)) {
        invalid(what, "layers " + std::to_string(l) + " and " + std::to_string(m) +
                          " of the call: a recurrent pool overlaps the other's pool or records");
      }
    }
  }
}

}  // namespace

void commit(Backend backend, const Config& config, const CommitBatch& batch, const State* states,
            int num_layers, const RunOptions& options) {
  const bool cpu = backend == Backend::kCpu;
  const char* what = cpu ? "KDA layer commit (CPU)" : "KDA layer commit (CUDA)";
  if (!cpu && backend != Backend::kCuda) {
    throw Error(StatusCode::kInvalidArgument, "KDA layer commit: backend " +
                                                  std::to_string(static_cast<int>(backend)) +
                                                  " is neither kCpu nor kCuda");
  }
  if (!cpu) throw_if_error(can_implement(backend, config), what);
  check_commit(config, batch, states, num_layers, cpu ? batch.slots : batch.slots_host,
               cpu ? batch.num_accepted : batch.num_accepted_host, what);
  if (batch.sequences == 0 || num_layers == 0) return;
  KDA_NVTX_RANGE("commit");
  const CommitProblem problem = commit_problem(config, batch, states[0]);
  CommitLayer layers[kMaxCommitLayers];
  // The operator's commit takes kMaxCommitLayers layers a call: `layers` holds the group from
  // `first` on, and its count is returned.
  auto group = [&](int first) {
    const int count = std::min(kMaxCommitLayers, num_layers - first);
    for (int l = 0; l < count; ++l) {
      layers[l].records = states[first + l].recurrent_records;
      layers[l].state_pool = states[first + l].recurrent;
    }
    return count;
  };
  // Every group checked before any is committed, so that a refused call writes nothing: the
  // operator's checks of each group (its pools against each other and the records; on CUDA also
  // their alignment, kda::check_cuda_call), the pools of different groups against each other, and
  // on CUDA the pointers.
  for (int first = 0; first < num_layers; first += kMaxCommitLayers) {
    const int count = group(first);
    const Status st = cpu ? validate(problem, layers, count, batch.slots, batch.num_accepted)
                          : check_cuda_call(problem, layers, count, batch.slots, batch.num_accepted,
                                            batch.device_status);
    if (!st.ok()) {
      throw Error(st, std::string(what) + ": layers " + std::to_string(first) + " to " +
                          std::to_string(first + count - 1) +
                          " of the call (the message counts from the first of them)");
    }
#ifdef KDA_HAVE_CUDA
    if (!cpu && options.check_pointers) {
      throw_if_error(check_device_pointers(problem, layers, count, batch.slots, batch.num_accepted),
                     what);
      throw_if_error(check_device_pointer(batch.device_status, 4, "device_status"), what);
      const std::int64_t Cl = config.local_channels(), hist = config.conv_width - 1;
      const auto pool_bytes = static_cast<std::size_t>(states[0].num_slots * Cl * hist) * 2;
      const auto record_bytes =
          static_cast<std::size_t>(batch.sequences * batch.decode_tokens * 3 * Cl) * 2;
      for (int l = 0; l < count && hist > 0; ++l) {
        const State& s = states[first + l];
        throw_if_error(check_device_pointer(s.conv_q, pool_bytes, "conv_q pool"), what);
        throw_if_error(check_device_pointer(s.conv_k, pool_bytes, "conv_k pool"), what);
        throw_if_error(check_device_pointer(s.conv_v, pool_bytes, "conv_v pool"), what);
        throw_if_error(check_device_pointer(s.conv_records, record_bytes, "conv_records"), what);
      }
    }
#endif
  }
  if (num_layers > kMaxCommitLayers) check_pools_across_groups(config, states, num_layers, what);
  for (int first = 0; first < num_layers; first += kMaxCommitLayers) {
    const int count = group(first);
    if (cpu) {
      throw_if_error(commit_cpu(problem, layers, count, batch.slots, batch.num_accepted,
                                CpuOptions{options.cpu_threads}),
                     what);
      for (int l = 0; l < count; ++l) commit_conv_cpu(config, batch, states[first + l]);
      continue;
    }
#ifdef KDA_HAVE_CUDA
    CudaOptions cuda_options;
    cuda_options.check_pointers = false;  // checked above when asked
    throw_if_error(commit_cuda(problem, layers, count, batch.slots, batch.num_accepted,
                               batch.device_status, options.stream, cuda_options),
                   what);
    if (config.conv_width <= 1) continue;
    cuda::ConvCommitParams p;
    p.slots = batch.slots;
    p.num_accepted = batch.num_accepted;
    p.status = batch.device_status;
    p.num_slots = states[0].num_slots;
    p.sequences = batch.sequences;
    p.decode_tokens = batch.decode_tokens;
    p.channels = config.local_channels();
    p.padding_slot = batch.padding_slot;
    p.width = config.conv_width;
    p.num_layers = count;
    for (int l = 0; l < count; ++l) {
      const State& s = states[first + l];
      p.layers[l].records = s.conv_records;
      p.layers[l].pools[0] = s.conv_q;
      p.layers[l].pools[1] = s.conv_k;
      p.layers[l].pools[2] = s.conv_v;
    }
    const cudaError_t err = cuda::launch_conv_commit(p, static_cast<cudaStream_t>(options.stream));
    if (err != cudaSuccess) {
      throw Error(StatusCode::kCudaError, std::string(what) +
                                              ": conv_commit_kernel: " + cudaGetErrorName(err) +
                                              " (" + cudaGetErrorString(err) + ")");
    }
#endif
  }
}

}  // namespace kda::layer
