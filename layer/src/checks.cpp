// layer/src/checks.cpp — the checks every backend of the layer makes (checks.hpp).
#include "checks.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>

#include "kda/detail/checked_math.hpp"
#include "kda/error.hpp"

namespace kda::layer::detail {

namespace {

using kda::detail::checked_mul;
using kda::detail::checked_product;

[[noreturn]] void invalid(const char* what, const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, std::string(what) + ": " + message);
}

}  // namespace

DecodeProblem decode_step_problem(const Config& c, const Batch& batch, const State& state) {
  DecodeProblem step =
      core_decode_problem(c, batch.sequences, std::max<std::int64_t>(batch.decode_tokens, 1),
                          state.num_slots, state.recurrent_dtype);
  step.verify = batch.num_accepted != nullptr || batch.records;
  step.records = batch.records;
  step.padding_slot = batch.padding_slot;
  step.fold_batch = batch.fold_sequences;
  step.fold_tokens = batch.fold_decode_tokens;
  return step;
}

void add_step_batch(DecodeTensors& t, const Batch& batch, const State& state) {
  t.slots = batch.slots;
  t.num_accepted = batch.num_accepted;
  t.state_pool = state.recurrent;
  t.records = batch.records ? state.recurrent_records : nullptr;
  if (batch.fold_sequences > 0) {
    t.fold_records = state.fold_recurrent_records;
    t.fold_rows = batch.fold_rows;
    t.fold_counts = batch.fold_counts;
  }
}

void check_forward(const Config& c, const Batch& batch, HostCuSeqlens cu_host,
                   const std::int32_t* slots_host, const std::int32_t* accepted_host,
                   HostFold fold_host, const State& state, const void* hidden, const void* out,
                   const char* what, bool core_inputs) {
  const std::int64_t T = batch.tokens, N = batch.sequences;
  const bool decode = batch.decode_tokens > 0;
  if (T < 0 || N < 0) invalid(what, "tokens and sequences must be >= 0");
  if (core_inputs &&
      (decode || batch.checkpoints != 0 || batch.records || batch.num_accepted != nullptr)) {
    invalid(what, "core inputs are a prefill's: no decode, verify, records or checkpoints");
  }
  if (batch.decode_tokens < 0 || batch.decode_tokens > kMaxDecodeTokens) {
    invalid(what, "decode_tokens " + std::to_string(batch.decode_tokens) + " is not in [0, " +
                      std::to_string(kMaxDecodeTokens) + "]");
  }
  Problem core = core_prefill_problem(c, T, N, batch.slots != nullptr ? state.num_slots : 0,
                                      state.recurrent_dtype);
  core.cu_seqlens_dtype = cu_seqlens_dtype(batch);
  if (batch.cu_seqlens != nullptr && batch.cu_seqlens_i32 != nullptr) {
    invalid(what, "cu_seqlens (int64) and cu_seqlens_i32 are both set: a batch gives one of them");
  }
  if (batch.cu_seqlens_host != nullptr && batch.cu_seqlens_host_i32 != nullptr) {
    invalid(what,
            "cu_seqlens_host and cu_seqlens_host_i32 are both set: give the one of the "
            "batch's cu_seqlens dtype");
  }
  if ((batch.cu_seqlens_host != nullptr && batch.cu_seqlens_i32 != nullptr) ||
      (batch.cu_seqlens_host_i32 != nullptr && batch.cu_seqlens != nullptr)) {
    invalid(what,
            "the host copy of cu_seqlens has another dtype than the batch's cu_seqlens "
            "(cu_seqlens_host goes with cu_seqlens, cu_seqlens_host_i32 with "
            "cu_seqlens_i32)");
  }
  if (decode) {
    if (T % batch.decode_tokens != 0 || T / batch.decode_tokens != N) {  // T != N x decode_tokens
      invalid(what, "decode: tokens " + std::to_string(T) + " is not sequences " +
                        std::to_string(N) + " x decode_tokens " +
                        std::to_string(batch.decode_tokens));
    }
  } else {
    if (N == 0 && T > 0) invalid(what, std::to_string(T) + " tokens but no sequence");
    if (N > 0 && batch.cu_seqlens == nullptr && batch.cu_seqlens_i32 == nullptr) {
      invalid(what, "cu_seqlens is null, and so is cu_seqlens_i32: a prefill gives one of them");
    }
    if (cu_host.present() && N > 0) {
      throw_if_error(cu_host.i64 != nullptr ? validate_cu_seqlens(cu_host.i64, N, T)
                                            : validate_cu_seqlens(cu_host.i32, N, T),
                     what);
    }
  }
  const bool verify = batch.num_accepted != nullptr;
  if (batch.num_accepted == nullptr && batch.num_accepted_host != nullptr) {
    invalid(what, "num_accepted_host is given but num_accepted is null");
  }
  if (verify && (!decode || batch.slots == nullptr)) {
    invalid(what, "num_accepted (a verify step) needs a decode batch with slots");
  }
  if (batch.records) {
    if (!decode || batch.slots == nullptr) {
      invalid(what, "records (a record-and-commit verify step) needs a decode batch with slots");
    }
    if (verify) {
      invalid(what,
              "records and num_accepted are both set: a records step takes no num_accepted "
              "(the commit does)");
    }
    if (state.record_rows < T) {
      invalid(what, "records: State::record_rows " + std::to_string(state.record_rows) +
                        " is below the step's " + std::to_string(N) + " x " +
                        std::to_string(batch.decode_tokens) + " row-token pairs");
    }
    if (T > 0 && (state.recurrent_records == nullptr || state.conv_records == nullptr)) {
      invalid(what, "records: State::recurrent_records or State::conv_records is null");
    }
  }
  if (batch.fold_sequences < 0) invalid(what, "fold_sequences must be >= 0");
  if (batch.fold_sequences > 0) {
    if (!decode || batch.slots == nullptr || verify) {
      invalid(what,
              "fold_sequences (a fold of the last records step) needs a decode batch with slots "
              "and no num_accepted");
    }
    if (batch.fold_decode_tokens < 1 || batch.fold_decode_tokens > kMaxDecodeTokens) {
      invalid(what, "fold_decode_tokens " + std::to_string(batch.fold_decode_tokens) +
                        " is not in [1, " + std::to_string(kMaxDecodeTokens) + "]");
    }
    // record_rows < fold_sequences x fold_decode_tokens, which could overflow
    if (state.record_rows / batch.fold_decode_tokens < batch.fold_sequences) {
      invalid(what, "fold: State::record_rows " + std::to_string(state.record_rows) +
                        " is below the records step's " + std::to_string(batch.fold_sequences) +
                        " x " + std::to_string(batch.fold_decode_tokens) + " row-token pairs");
    }
    if (N > 0 && (batch.fold_rows == nullptr || batch.fold_counts == nullptr ||
                  state.fold_recurrent_records == nullptr || state.fold_conv_records == nullptr)) {
      invalid(what,
              "fold: fold_rows, fold_counts, State::fold_recurrent_records or "
              "State::fold_conv_records is null");
    }
    // A records step writes its region while it reads the fold's: they may not overlap.
    const std::int64_t Hl = c.local_heads(), Cl = c.local_channels(), D = c.head_dim;
    // Both at most record_rows row-token pairs (above), whose bytes may still overflow.
    const std::int64_t fold_pairs = batch.fold_sequences * batch.fold_decode_tokens;
    std::uint64_t recurrent_row = 0, conv_row = 0, records_recurrent = 0, records_conv = 0;
    const auto rows = static_cast<std::uint64_t>(state.record_rows);
    if (!checked_product({static_cast<std::uint64_t>(Hl), 3, static_cast<std::uint64_t>(D), 4},
                         &recurrent_row) ||
        !checked_product({3, static_cast<std::uint64_t>(Cl), 2}, &conv_row) ||
        !checked_mul(rows, recurrent_row, &records_recurrent) ||
        !checked_mul(rows, conv_row, &records_conv)) {
      throw Error(StatusCode::kOverflow,
                  std::string(what) + ": fold: the records regions' bytes (State::record_rows " +
                      std::to_string(state.record_rows) + ") overflow 64-bit sizes");
    }
    const auto pairs = static_cast<std::uint64_t>(fold_pairs);
    if (batch.records && (byte_ranges_overlap(state.fold_recurrent_records, pairs * recurrent_row,
                                              state.recurrent_records, records_recurrent) ||
                          byte_ranges_overlap(state.fold_conv_records, pairs * conv_row,
                                              state.conv_records, records_conv))) {
      invalid(what,
              "fold: a records step folds records that overlap the region it writes (keep two "
              "records regions a layer and alternate)");
    }
  }
  if (fold_host.rows != nullptr && batch.fold_sequences > 0 && slots_host != nullptr) {
    for (std::int64_t n = 0; n < N; ++n) {
      if (is_padding(batch, slots_host[n]) || fold_host.rows[n] < 0) continue;
      if (fold_host.rows[n] >= batch.fold_sequences) {
        invalid(what,
                "row " + std::to_string(n) + " has fold row " + std::to_string(fold_host.rows[n]) +
                    ", outside [0, fold_sequences = " + std::to_string(batch.fold_sequences) + ")");
      }
      if (fold_host.counts[n] < 1 || fold_host.counts[n] > batch.fold_decode_tokens) {
        invalid(what, "row " + std::to_string(n) + " has fold count " +
                          std::to_string(fold_host.counts[n]) +
                          ", outside [1, fold_decode_tokens = " +
                          std::to_string(batch.fold_decode_tokens) + "]");
      }
    }
  }
  if (verify && accepted_host != nullptr) {
    for (std::int64_t n = 0; n < N; ++n) {
      if (accepted_host[n] < 1 || accepted_host[n] > batch.decode_tokens) {
        invalid(what, "row " + std::to_string(n) + " has num_accepted " +
                          std::to_string(accepted_host[n]) + ", outside [1, decode_tokens = " +
                          std::to_string(batch.decode_tokens) + "]");
      }
    }
  }
  if (batch.checkpoints < 0) invalid(what, "checkpoints must be >= 0");
  // The requests' [N, checkpoints] int64 offsets in bytes must fit 64 bits before anything indexes
  // them (the operator's sizes are checked the same way).
  if (batch.checkpoints > 0 && batch.checkpoints > std::numeric_limits<std::int64_t>::max() / 8 /
                                                       std::max<std::int64_t>(N, 1)) {
    throw Error(StatusCode::kOverflow,
                std::string(what) + ": checkpoint_offsets bytes N*checkpoints*8 (" +
                    std::to_string(N) + " x " + std::to_string(batch.checkpoints) +
                    " x 8) overflow 64-bit sizes");
  }
  if (batch.checkpoints > 0) {
    if (decode || batch.slots == nullptr) {
      invalid(what, "checkpoints need a prefill with slots");
    }
    if (N > 0 && (batch.checkpoint_offsets == nullptr || batch.checkpoint_slots == nullptr)) {
      invalid(what, "checkpoint_offsets or checkpoint_slots is null");
    }
  }
  if (batch.slots == nullptr && N > state.num_slots) {
    invalid(what, std::to_string(N) + " sequences on rows 0..N-1 but num_slots = " +
                      std::to_string(state.num_slots));
  }
  if (batch.slots == nullptr && batch.slots_host != nullptr) {
    invalid(what, "slots_host is given but slots is null");
  }
  if (batch.slots != nullptr && N > 0 && state.num_slots < 1) {
    // Every row would be padding; the core takes slots only into a pool of entries.
    invalid(what, "slots are given but State::num_slots is " + std::to_string(state.num_slots) +
                      " (a pool of no entries)");
  }
  if (batch.padding_slot >= 0 &&
      (batch.slots == nullptr || batch.padding_slot >= state.num_slots)) {
    invalid(what, "padding_slot " + std::to_string(batch.padding_slot) +
                      (batch.slots == nullptr
                           ? " needs slots (it names a slots entry)"
                           : " is outside [0, num_slots = " + std::to_string(state.num_slots) +
                                 ") (negative: none)"));
  }
  if (slots_host != nullptr) {
    // Negative slots are padding; the rest are distinct rows of the pools. A verify step's
    // entries are each row's tokens' slots.
    const std::int64_t per_row = verify ? batch.decode_tokens : 1;
    auto entry = [&](std::int64_t i) {
      return verify ? "row " + std::to_string(i / per_row) + " token " + std::to_string(i % per_row)
                    : "sequence " + std::to_string(i);
    };
    for (std::int64_t n = 0; n < N * per_row; ++n) {
      if (slots_host[n] >= state.num_slots) {
        invalid(what, entry(n) + " has slot " + std::to_string(slots_host[n]) +
                          ", outside [0, num_slots = " + std::to_string(state.num_slots) + ")");
      }
    }
    // A records step only reads its slots (unless it folds): rows may share one.
    const bool shared_ok = batch.records && batch.fold_sequences == 0;
    const auto [m, n] =
        shared_ok ? std::pair<std::int64_t, std::int64_t>{-1, -1}
                  : find_repeated_slot(slots_host, N * per_row,
                                       [&](std::int32_t s) { return is_padding(batch, s); });
    if (m >= 0) {
      invalid(what, (verify ? entry(m) + " and " + entry(n)
                            : "sequences " + std::to_string(m) + " and " + std::to_string(n)) +
                        " share slot " + std::to_string(slots_host[n]));
    }
  }
  if (N > 0) {
    const bool conv_missing =
        c.conv_width > 1 &&
        (state.conv_q == nullptr || state.conv_k == nullptr || state.conv_v == nullptr);
    if ((state.recurrent == nullptr && !core_inputs) || conv_missing) {
      invalid(what, "a state pool is null");
    }
    if (state.recurrent_dtype != DType::kF32 && state.recurrent_dtype != DType::kBF16) {
      invalid(what, "recurrent state dtype " + std::string(to_string(state.recurrent_dtype)) +
                        " is not f32 or bf16");
    }
  }
  if (T > 0) {
    if (core_inputs) {
      if (hidden == nullptr) invalid(what, "hidden is null");
    } else if (hidden == nullptr || out == nullptr) {
      invalid(what, "hidden or out is null");
    }
    std::uint64_t bytes = 0;
    if (!kda::detail::checked_product(
            {static_cast<std::uint64_t>(T), static_cast<std::uint64_t>(c.hidden_size),
             sizeof(bf16_bits)},
            &bytes)) {
      throw Error(StatusCode::kOverflow,
                  std::string(what) + ": tokens x hidden_size overflows 64-bit byte counts");
    }
  }
  // The messages' context only for an error: a forward allocates nothing.
  if (decode) {
    if (const Status st = validate(decode_step_problem(c, batch, state)); !st.ok()) {
      throw Error(st, std::string(what) + ": decode core problem");
    }
  } else if (const Status st = validate(core); !st.ok()) {
    throw Error(st, std::string(what) + ": core problem");
  }
}

void check_checkpoints(const Batch& batch, HostCuSeqlens cu_host, const std::int32_t* slots_host,
                       std::int64_t num_slots, std::uint64_t* seen, const char* what) {
  const std::int64_t N = batch.sequences, K = batch.checkpoints;
  std::fill(seen, seen + (num_slots + 63) / 64, std::uint64_t{0});
  auto mark = [&](std::int64_t slot) {
    const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
    const bool twice = (seen[slot / 64] & bit) != 0;
    seen[slot / 64] |= bit;
    return twice;
  };
  for (std::int64_t n = 0; n < N; ++n) {
    if (!is_padding(batch, slots_host[n])) mark(slots_host[n]);
  }
  for (std::int64_t n = 0; n < N; ++n) {
    if (is_padding(batch, slots_host[n])) continue;  // a padding sequence's requests are not read
    const std::int64_t length = cu_host[n + 1] - cu_host[n];
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t offset = batch.checkpoint_offsets[n * K + k];
      const std::int64_t slot = batch.checkpoint_slots[n * K + k];
      auto request = [&] {  // only for an error: a forward allocates nothing
        return "sequence " + std::to_string(n) + " checkpoint " + std::to_string(k);
      };
      if (offset < -1 || offset > length ||
          (offset >= 0 && offset % kCheckpointAlignment != 0 && offset != length)) {
        invalid(what, request() + ": offset " + std::to_string(offset) +
                          " is not -1, a multiple of " + std::to_string(kCheckpointAlignment) +
                          " up to the sequence's length " + std::to_string(length) +
                          ", or that length");
      }
      if (slot >= num_slots) {
        invalid(what, request() + ": slot " + std::to_string(slot) +
                          " is outside [0, num_slots = " + std::to_string(num_slots) + ")");
      }
      if (is_padding(batch, slot) || offset < 0) continue;
      if (mark(slot)) {
        invalid(what, request() + ": slot " + std::to_string(slot) +
                          " is written twice in the call (another checkpoint or a sequence's "
                          "state)");
      }
    }
  }
}

void check_workspace(Workspace workspace, std::size_t needed, const Batch& batch,
                     const char* what) {
  if (workspace.bytes < needed) {
    throw Error(StatusCode::kWorkspaceTooSmall,
                std::string(what) + ": workspace has " + std::to_string(workspace.bytes) +
                    " bytes, a forward of " + std::to_string(batch.tokens) + " tokens in " +
                    std::to_string(batch.sequences) + " sequences needs " + std::to_string(needed));
  }
  if (workspace.ptr == nullptr) invalid(what, "workspace.ptr is null");
}

std::array<ForwardBuffer, kForwardBuffers> forward_buffers(const Config& c, const Batch& batch,
                                                           const State& state, const void* hidden,
                                                           const void* out, Workspace workspace) {
  const auto T = static_cast<std::uint64_t>(batch.tokens),
             N = static_cast<std::uint64_t>(batch.sequences);
  const auto E = static_cast<std::uint64_t>(c.hidden_size),
             D = static_cast<std::uint64_t>(c.head_dim);
  const auto Hl = static_cast<std::uint64_t>(c.local_heads()),
             Cl = static_cast<std::uint64_t>(c.local_channels());
  const auto W = static_cast<std::uint64_t>(c.conv_width > 1 ? c.conv_width - 1 : 0);
  const auto slots = static_cast<std::uint64_t>(state.num_slots);
  const auto checkpoints = static_cast<std::uint64_t>(batch.checkpoints);
  const auto fold_pairs = static_cast<std::uint64_t>(batch.fold_sequences) *
                          static_cast<std::uint64_t>(batch.fold_decode_tokens);
  const bool decode = batch.decode_tokens > 0;
  const bool folds = decode && batch.fold_sequences > 0;
  // A verify step's slots are [N, decode_tokens].
  const auto slots_a_row = static_cast<std::uint64_t>(
      batch.num_accepted != nullptr && batch.decode_tokens > 0 ? batch.decode_tokens : 1);
  // Products of sizes check_forward bounded; checked all the same, since a wrong byte count here
  // would pass a bad pointer.
  auto bytes = [](std::initializer_list<std::uint64_t> factors) {
    std::uint64_t product = 0;
    if (!checked_product(factors, &product)) {
      throw Error(StatusCode::kOverflow, "KDA layer forward: a buffer's bytes overflow 64 bits");
    }
    return product;
  };
  const std::uint64_t conv_pool = bytes({slots, Cl, W, 2});
  return {{
      {hidden, bytes({T, E, 2}), "hidden"},
      {out, bytes({T, E, 2}), "out"},
      {workspace.ptr, workspace.bytes, "workspace"},
      {state.conv_q, conv_pool, "conv_q pool"},
      {state.conv_k, conv_pool, "conv_k pool"},
      {state.conv_v, conv_pool, "conv_v pool"},
      {state.recurrent, bytes({slots, Hl, D, D, dtype_size(state.recurrent_dtype)}),
       "recurrent pool"},
      {decode ? nullptr : batch.cu_seqlens, bytes({N + 1, 8}), "cu_seqlens"},
      {decode ? nullptr : batch.cu_seqlens_i32, bytes({N + 1, 4}), "cu_seqlens_i32"},
      {batch.slots, bytes({N, slots_a_row, 4}), "slots"},
      {batch.records ? state.recurrent_records : nullptr, bytes({T, Hl, 3, D, 4}),
       "recurrent_records"},
      {batch.records ? state.conv_records : nullptr, bytes({T, 3, Cl, 2}), "conv_records"},
      {batch.num_accepted, bytes({N, 4}), "num_accepted"},
      {folds ? batch.fold_rows : nullptr, bytes({N, 4}), "fold_rows"},
      {folds ? batch.fold_counts : nullptr, bytes({N, 4}), "fold_counts"},
      {folds ? state.fold_recurrent_records : nullptr, bytes({fold_pairs, Hl, 3, D, 4}),
       "fold_recurrent_records"},
      {folds ? state.fold_conv_records : nullptr, bytes({fold_pairs, 3, Cl, 2}),
       "fold_conv_records"},
      {batch.checkpoint_offsets, bytes({N, checkpoints, 8}), "checkpoint_offsets"},
      {batch.checkpoint_slots, bytes({N, checkpoints, 4}), "checkpoint_slots"},
      {batch.device_status, 4, "device_status"},
  }};
}

WorkspaceLayout checked_forward_layout(Backend backend, const Config& c, const Batch& batch,
                                       HostCuSeqlens cu_host, const std::int32_t* slots_host,
                                       const std::int32_t* accepted_host, HostFold fold_host,
                                       const State& state, const void* hidden, const void* out,
                                       Workspace workspace, const char* what, bool core_inputs) {
  check_forward(c, batch, cu_host, slots_host, accepted_host, fold_host, state, hidden, out, what,
                core_inputs);
  const WorkspaceLayout layout =
      forward_workspace_layout(backend, c, batch.tokens, batch.sequences, state.num_slots, what);
  check_workspace(workspace, layout.total, batch, what);
  if (!core_inputs && batch.tokens > 0) {
    const auto buffers = forward_buffers(c, batch, state, hidden, out, workspace);
    const ForwardBuffer& written = buffers[1];  // out
    // The message names the buffer out begins in, where there is one: out may run on over
    // buffers that lie after it, and the first of the list it overlaps says less.
    const auto begins_in = [&](const ForwardBuffer& b) {
      const auto at = reinterpret_cast<std::uintptr_t>(written.ptr),
                 start = reinterpret_cast<std::uintptr_t>(b.ptr);
      return b.ptr != nullptr && at >= start && at - start < b.bytes;
    };
    std::size_t named = buffers.size();
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      if (i == 1 ||
          !byte_ranges_overlap(written.ptr, written.bytes, buffers[i].ptr, buffers[i].bytes)) {
        continue;
      }
      if (begins_in(buffers[i])) {
        named = i;
        break;
      }
      if (named == buffers.size()) named = i;
    }
    if (named < buffers.size()) invalid(what, std::string("out overlaps ") + buffers[named].name);
  }
  return layout;
}

void check_run_options(const RunOptions& options, const char* what) {
  if (static_cast<unsigned>(options.decode_kernel) >
      static_cast<unsigned>(DecodeKernel::kOneLaunch)) {
    invalid(what, "RunOptions::decode_kernel " +
                      std::to_string(static_cast<int>(options.decode_kernel)) +
                      " is not a kda::layer::DecodeKernel");
  }
  if (!is_known(options.schedule)) {
    invalid(what, "RunOptions::schedule " + std::to_string(static_cast<int>(options.schedule)) +
                      " is not a kda::PrefillSchedule");
  }
  if (options.fused_cluster != 0 && options.fused_cluster != 1 && options.fused_cluster != 2 &&
      options.fused_cluster != 4 && options.fused_cluster != 8) {
    invalid(what, "RunOptions::fused_cluster " + std::to_string(options.fused_cluster) +
                      " is not 0, 1, 2, 4 or 8");
  }
}

void check_gate_weights(const Weights& w) {
  throw_if_error(validate_gate_parameters(w.A_log.data(), w.dt_bias.data(), w.config.local_heads(),
                                          w.config.head_dim),
                 "KDA layer weights");
}

void check_weight_region(const void* image, std::size_t bytes, std::size_t needed,
                         std::size_t alignment, const char* what) {
  const std::string region = std::string(what) + ": the weight image region ";
  if (image == nullptr) throw Error(StatusCode::kInvalidArgument, region + "is null");
  if (reinterpret_cast<std::uintptr_t>(image) % alignment != 0) {
    throw Error(StatusCode::kInvalidArgument,
                region + "is not " + std::to_string(alignment) + "-byte aligned");
  }
  if (bytes < needed) {
    throw Error(StatusCode::kInvalidArgument, region + "is too small: " + std::to_string(bytes) +
                                                  " bytes, the layer's weights need " +
                                                  std::to_string(needed) + " (weight_image_bytes)");
  }
}

}  // namespace kda::layer::detail
