// The layer's states on each backend: scattered slots equal rows 0..N-1; chained prefills and
// prefill-then-decode equal one longer prefill; padding decode rows and prefill sequences (both
// with either output gate form); batches of no tokens. Every forward is also held to the fp64
// reference of its own call (check_forward), so an error of one call cannot hide in the next.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "layer_runner.hpp"

using namespace kda;
using namespace kda::test;

namespace {

// Appends rows [begin, end) of `m` to `to`.
void append_rows(std::vector<bf16_bits>* to, const std::vector<bf16_bits>& m, std::int64_t E,
                 std::int64_t begin, std::int64_t end) {
  to->insert(to->end(), m.begin() + begin * E, m.begin() + end * E);
}

// Runs `body` on the weights and the layer of the cases below, once per output gate form (low
// rank, full rank): the bounded gate, a g_b bias and a non-unit o_norm, so that every weight
// matters.
void for_each_gate_form(
    const LayerRunner& runner,
    const std::function<void(const layer::Weights&, const std::unique_ptr<layer::Layer>&)>& body) {
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    const layer::Weights weights = with_bias_and_norm(
        layer::random_weights(runner.config(GateMode::kLowerBound, full_rank), 4, 1));
    body(weights, runner.make(weights));
  }
}

}  // namespace

KDA_LAYER_CASE("sequences on scattered slots equal the same sequences on rows 0..N-1") {
  const layer::Config config = runner.config();
  const layer::Weights weights = layer::random_weights(config, 3, 0);
  const auto layer = runner.make(weights);
  const std::vector<std::int64_t> lengths = {4, 0, 9, 1};
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(14 * config.hidden_size), 2.0f, 5);
  Pools identity(config, 4);
  identity.randomize(6);
  const Pools identity_start = identity;
  const LayerRun expected = runner.forward(*layer, hidden, prefill_batch(lengths), &identity);
  check_forward(runner, weights, hidden, prefill_batch(lengths), identity_start, expected,
                identity);

  const std::vector<std::int32_t> slots = {5, 0, 1, 3};  // runs {5}, {0, 1}, {3}; 2 and 4 unused
  Pools scattered(config, 6);
  scattered.randomize(7);
  for (std::size_t n = 0; n < slots.size(); ++n) {  // the same starting states, elsewhere
    std::copy_n(identity_start.conv_q.begin() + n * identity.conv_row, identity.conv_row,
                scattered.conv_q.begin() + slots[n] * identity.conv_row);
    std::copy_n(identity_start.conv_k.begin() + n * identity.conv_row, identity.conv_row,
                scattered.conv_k.begin() + slots[n] * identity.conv_row);
    std::copy_n(identity_start.conv_v.begin() + n * identity.conv_row, identity.conv_row,
                scattered.conv_v.begin() + slots[n] * identity.conv_row);
    std::copy_n(identity_start.rec_f32.begin() + n * identity.recurrent_row, identity.recurrent_row,
                scattered.rec_f32.begin() + slots[n] * identity.recurrent_row);
  }
  const Pools scattered_start = scattered;
  const BatchSpec batch = prefill_batch(lengths, slots);
  const LayerRun run = runner.forward(*layer, hidden, batch, &scattered);
  check_forward(runner, weights, hidden, batch, scattered_start, run, scattered);
  CHECK(same_bits(run.out, expected.out));
  for (std::size_t n = 0; n < slots.size(); ++n) {
    CAPTURE(n);
    CHECK(scattered.row_equal(identity, slots[n], static_cast<std::int64_t>(n)));
  }
}

KDA_LAYER_CASE("chunked prefill: one prefill equals two chained prefills") {
  const layer::Config config = runner.config();
  const layer::Weights weights = layer::random_weights(config, 1, 2);
  const auto layer = runner.make(weights);
  const std::int64_t E = config.hidden_size;
  // Two sequences of 9 and 13 tokens, split 2 + 7 (shorter than W-1 first) and 8 + 5.
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(22 * E), 2.0f, 8);
  Pools start(config, 2);
  start.randomize(9);
  Pools whole = start;
  const LayerRun expected = runner.forward(*layer, hidden, prefill_batch({9, 13}), &whole);
  check_forward(runner, weights, hidden, prefill_batch({9, 13}), start, expected, whole);

  std::vector<bf16_bits> first, second;
  append_rows(&first, hidden, E, 0, 2);
  append_rows(&first, hidden, E, 9, 17);
  append_rows(&second, hidden, E, 2, 9);
  append_rows(&second, hidden, E, 17, 22);
  Pools chained = start;
  const LayerRun out1 = runner.forward(*layer, first, prefill_batch({2, 8}), &chained);
  check_forward(runner, weights, first, prefill_batch({2, 8}), start, out1, chained);
  const Pools between = chained;
  const LayerRun out2 = runner.forward(*layer, second, prefill_batch({7, 5}), &chained);
  check_forward(runner, weights, second, prefill_batch({7, 5}), between, out2, chained);

  std::vector<bf16_bits> out;  // back in the order of the whole prefill
  append_rows(&out, out1.out, E, 0, 2);
  append_rows(&out, out2.out, E, 0, 7);
  append_rows(&out, out1.out, E, 2, 10);
  append_rows(&out, out2.out, E, 7, 12);
  check_same_tokens(runner, out, expected.out, chained, whole);
}

KDA_LAYER_CASE("prefill then decode steps equal one longer prefill") {
  for_each_gate_form(runner, [&](const layer::Weights& weights,
                                 const std::unique_ptr<layer::Layer>& layer) {
    const layer::Config& config = weights.config;
    const std::int64_t E = config.hidden_size;
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const std::string dtype_name = to_string(dtype);
      CAPTURE(dtype_name);
      // Sequence 0 (11 tokens, rows 0..10 of hidden) on slot 2, sequence 1 (7 tokens, rows 11..17)
      // on slot 0; row 1 unused.
      const std::vector<std::int32_t> slots = {2, 0};
      const std::int64_t first_row[2] = {0, 11};
      const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(18 * E), 2.0f, 9);
      Pools whole(config, 3, dtype);
      const Pools start = whole;
      const LayerRun expected =
          runner.forward(*layer, hidden, prefill_batch({11, 7}, slots), &whole);
      check_forward(runner, weights, hidden, prefill_batch({11, 7}, slots), start, expected, whole);

      Pools stepped = start;
      std::vector<bf16_bits> out(hidden.size());
      std::int64_t done[2] = {0, 0};  // tokens of each sequence run so far
      // The next k0 and k1 tokens of the two sequences as one call (a decode step when k > 0).
      auto call = [&](std::int64_t k0, std::int64_t k1, std::int64_t decode_tokens) {
        CAPTURE(done[0]);
        CAPTURE(decode_tokens);
        std::vector<bf16_bits> in;
        append_rows(&in, hidden, E, first_row[0] + done[0], first_row[0] + done[0] + k0);
        append_rows(&in, hidden, E, first_row[1] + done[1], first_row[1] + done[1] + k1);
        const BatchSpec batch = decode_tokens > 0 ? decode_batch(2, decode_tokens, slots)
                                                  : prefill_batch({k0, k1}, slots);
        const Pools before = stepped;
        const LayerRun run = runner.forward(*layer, in, batch, &stepped);
        check_forward(runner, weights, in, batch, before, run, stepped);
        std::copy(run.out.begin(), run.out.begin() + k0 * E,
                  out.begin() + (first_row[0] + done[0]) * E);
        std::copy(run.out.begin() + k0 * E, run.out.end(),
                  out.begin() + (first_row[1] + done[1]) * E);
        done[0] += k0;
        done[1] += k1;
      };
      call(6, 2, 0);  // a prefill of 6 and 2 tokens (the second shorter than the conv history)
      for (int step = 0; step < 3; ++step) call(1, 1, 1);  // three one-token decode steps
      call(2, 2, 2);                                       // one two-token step
      REQUIRE(done[0] == 11);
      REQUIRE(done[1] == 7);
      check_same_tokens(runner, out, expected.out, stepped, whole);
    }
  });
}

// Padding (negative slots) as a serving runtime pads a captured batch: decode rows, and prefill
// sequences among real ones (an empty one too). The pools' nobody's rows hold non-zero states,
// which padding must neither read nor write.
KDA_LAYER_CASE("padding outputs zeros and touches no state, the rest runs as without it") {
  for_each_gate_form(
      runner, [&](const layer::Weights& weights, const std::unique_ptr<layer::Layer>& layer) {
        const layer::Config& config = weights.config;
        const std::int64_t E = config.hidden_size;
        for (DType dtype : {DType::kF32, DType::kBF16}) {
          for (std::int64_t decode_tokens : {0, 1, 2}) {
            const std::string dtype_name = to_string(dtype);
            CAPTURE(dtype_name);
            CAPTURE(decode_tokens);
            // Prefill: 5, 3, 0, 7 and 2 tokens on row 1, padding, row 3 (empty), row 0, padding.
            // Decode: rows 2 and 0 with a padding row between them and one after.
            const BatchSpec padded = decode_tokens > 0
                                         ? decode_batch(4, decode_tokens, {2, -1, 0, -4})
                                         : prefill_batch({5, 3, 0, 7, 2}, {1, -1, 3, 0, -2});
            const std::vector<bf16_bits> hidden = random_bf16(
                static_cast<std::size_t>(padded.tokens() * E), 2.0f, 41 + decode_tokens);
            Pools before(config, 5, dtype);
            before.randomize(42);
            Pools after = before;
            const LayerRun run = runner.forward(*layer, hidden, padded, &after);
            check_forward(runner, weights, hidden, padded, before, run, after);

            // The same batch without its padding.
            std::vector<std::int64_t> lengths;
            std::vector<std::int32_t> slots;
            std::vector<bf16_bits> real_in, real_out;
            for (std::int64_t n = 0; n < padded.sequences(); ++n) {
              const std::int64_t begin = padded.cu_seqlens[n], end = padded.cu_seqlens[n + 1];
              if (padded.slot(n) < 0) {
                CAPTURE(n);
                const std::vector<bf16_bits> zeros = token_rows(run.out, E, begin, end);
                CHECK(std::all_of(zeros.begin(), zeros.end(), [](bf16_bits b) { return b == 0; }));
                continue;
              }
              lengths.push_back(end - begin);
              slots.push_back(padded.slots[n]);
              append_rows(&real_in, hidden, E, begin, end);
              append_rows(&real_out, run.out, E, begin, end);
            }
            const BatchSpec plain =
                decode_tokens > 0
                    ? decode_batch(static_cast<std::int64_t>(slots.size()), decode_tokens, slots)
                    : prefill_batch(lengths, slots);
            for (std::int64_t r = 0; r < before.num_slots; ++r) {
              if (std::find(slots.begin(), slots.end(), r) != slots.end()) continue;
              CAPTURE(r);
              CHECK(after.row_equal(before, r));  // nobody's row
            }
            Pools plain_after = before;
            const LayerRun plain_run = runner.forward(*layer, real_in, plain, &plain_after);
            REQUIRE_MESSAGE(plain_run.error.empty(), plain_run.error);
            check_same_tokens(runner, real_out, plain_run.out, after, plain_after);
          }
        }
      });
}

KDA_LAYER_CASE("a batch of no tokens writes nothing and keeps every state") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 2, 0));
  Pools before(config, 3);
  before.randomize(4);
  for (const BatchSpec& batch : {prefill_batch({0, 0, 0}), prefill_batch({}), decode_batch(0, 1)}) {
    CAPTURE(batch.sequences());
    Pools after = before;
    const LayerRun run = runner.forward(*layer, {}, batch, &after);
    CHECK_MESSAGE(run.error.empty(), run.error);
    CHECK(run.out.empty());
    CHECK(run.guards_intact);
    CHECK(after == before);
  }
  // No sequence and no cu_seqlens at all (a default Batch's), which a prefill of no sequences may
  // leave out.
  ForwardSettings bare;
  bare.change = [](ForwardCall& call) {
    call.batch.cu_seqlens = nullptr;
    call.batch.cu_seqlens_i32 = nullptr;
    call.batch.cu_seqlens_host = nullptr;
    call.batch.cu_seqlens_host_i32 = nullptr;
  };
  Pools after = before;
  const LayerRun run = runner.forward(*layer, {}, prefill_batch({}), &after, bare);
  CHECK_MESSAGE(run.error.empty(), run.error);
  CHECK(run.guards_intact);
  CHECK(after == before);
  // A records step and a fold of no rows read and write no records: their regions (and the fold's
  // rows and counts) may be null.
  static const std::int32_t no_rows[1] = {0};
  BatchSpec records = decode_batch(0, 2);
  records.records = true;
  BatchSpec fold = decode_batch(0, 1);
  fold.fold_sequences = 1;
  for (const BatchSpec& batch : {records, fold}) {
    CAPTURE(batch.records);
    ForwardSettings no_records;
    no_records.change = [](ForwardCall& call) {
      call.batch.slots = no_rows;
      call.batch.slots_host = no_rows;
      call.state.record_rows = 1;
      call.state.recurrent_records = nullptr;
      call.state.conv_records = nullptr;
      call.batch.fold_rows = call.batch.fold_counts = nullptr;
      call.state.fold_recurrent_records = nullptr;
      call.state.fold_conv_records = nullptr;
    };
    Pools kept = before;
    const LayerRun empty = runner.forward(*layer, {}, batch, &kept, no_records);
    CHECK_MESSAGE(empty.error.empty(), empty.error);
    CHECK(empty.guards_intact);
    CHECK(kept == before);
  }
}

namespace {

// Row `from_row` of every pool of `from` into row `to_row` of `to`.
void copy_row(const Pools& from, std::int64_t from_row, Pools* to, std::int64_t to_row) {
  auto copy = [](const auto& src, auto& dst, std::size_t row, std::int64_t a, std::int64_t b) {
    std::copy(src.begin() + a * row, src.begin() + (a + 1) * row, dst.begin() + b * row);
  };
  copy(from.conv_q, to->conv_q, from.conv_row, from_row, to_row);
  copy(from.conv_k, to->conv_k, from.conv_row, from_row, to_row);
  copy(from.conv_v, to->conv_v, from.conv_row, from_row, to_row);
  if (from.dtype == DType::kF32) {
    copy(from.rec_f32, to->rec_f32, from.recurrent_row, from_row, to_row);
  } else {
    copy(from.rec_bf16, to->rec_bf16, from.recurrent_row, from_row, to_row);
  }
}

std::vector<double> conv_values(const Pools& p) {
  std::vector<double> v = to_doubles(p.conv_q);
  for (const auto* pool : {&p.conv_k, &p.conv_v}) {
    const std::vector<double> more = to_doubles(*pool);
    v.insert(v.end(), more.begin(), more.end());
  }
  return v;
}

}  // namespace

// A speculative verify step (Batch::num_accepted): each row starts from the states in its slot at
// num_accepted - 1 and keeps its recurrent and conv states after each token in that token's slot.
// The reference: plain one-token decode steps of the same rows on working slots of their own, the
// states copied out after every step. Rows: 1 of 4 accepted; 3 accepted and the last token's
// states not kept; a padding row (its start entry negative: zeros out, none of its slots
// touched). Both output gate forms (the low-rank pair, Kimi K3's full-rank g_proj). On CUDA with
// the separate kernels (kAuto's choice at three rows) and the fused kernel.
KDA_LAYER_CASE("a verify step keeps each token's states, starting after the last accepted one") {
  const std::vector<std::int32_t> slots = {5, 1, 9, 2, 7, 0, 4, -1, 10, -1, 11, 12};
  const std::vector<std::int32_t> accepted = {1, 3, 2};
  const std::int64_t N = 3, T = 4;
  std::vector<layer::DecodeKernel> kernels = {layer::DecodeKernel::kSeparate};
  if (runner.backend() == Backend::kCuda) kernels.push_back(layer::DecodeKernel::kFusedFactors);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const layer::DecodeKernel kernel : kernels) {
      for (const bool full_rank : {false, true}) {
        CAPTURE(full_rank);
        const bool bf16_pool = dtype == DType::kBF16;
        const bool separate = kernel == layer::DecodeKernel::kSeparate;
        CAPTURE(bf16_pool);
        CAPTURE(separate);
        const layer::Config config = runner.config(GateMode::kLowerBound, full_rank);
        const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 44, 1));
        const auto layer = runner.make(weights);
        const std::int64_t E = config.hidden_size;
        ForwardSettings settings;
        settings.change = [kernel](ForwardCall& call) { call.options.decode_kernel = kernel; };
        Pools before(config, 14, dtype);
        before.randomize(45);
        const std::vector<bf16_bits> hidden =
            random_bf16(static_cast<std::size_t>(N * T * E), 2.0f, 46);
        BatchSpec verify = decode_batch(N, T, slots);
        verify.num_accepted = accepted;
        Pools after = before;
        const LayerRun run = runner.forward(*layer, hidden, verify, &after, settings);
        REQUIRE_MESSAGE(run.error.empty(), run.error);
        CHECK(run.device_status == 0);
        CHECK(run.all_written);
        CHECK(run.guards_intact);
        // The fused step with 1, 2, 4 and 8 blocks a head (RunOptions::fused_cluster) keeps the
        // bits of the size chosen by shape: each block its own rows' per-token states, its own
        // channels' conv states. (The separate kernels keep other bits of a bf16 state: its
        // decode kernel sums each row's dot product over 8 channels a lane, not 4.)
        if (!separate) {
          for (const int cluster : {1, 2, 4, 8}) {
            CAPTURE(cluster);
            ForwardSettings clustered;
            clustered.change = [cluster](ForwardCall& call) {
              call.options.decode_kernel = layer::DecodeKernel::kFusedFactors;
              call.options.fused_cluster = cluster;
            };
            Pools split_after = before;
            const LayerRun split = runner.forward(*layer, hidden, verify, &split_after, clustered);
            REQUIRE_MESSAGE(split.error.empty(), split.error);
            CHECK(split.out == run.out);
            CHECK(split_after == after);
          }
        }

        // Rows 0 and 1 on working slots 3 and 6, one token at a time.
        Pools work = before, expected = before;
        copy_row(before, 5, &work, 3);
        copy_row(before, 4, &work, 6);
        std::vector<bf16_bits> want(hidden.size(), 0);  // the padding row's out: zeros
        for (std::int64_t t = 0; t < T; ++t) {
          std::vector<bf16_bits> step_in;
          append_rows(&step_in, hidden, E, t, t + 1);
          append_rows(&step_in, hidden, E, T + t, T + t + 1);
          const LayerRun step =
              runner.forward(*layer, step_in, decode_batch(2, 1, {3, 6}), &work, settings);
          REQUIRE_MESSAGE(step.error.empty(), step.error);
          for (std::int64_t n = 0; n < 2; ++n) {
            std::copy(step.out.begin() + n * E, step.out.begin() + (n + 1) * E,
                      want.begin() + (n * T + t) * E);
            const std::int32_t keep = slots[static_cast<std::size_t>(n * T + t)];
            if (keep >= 0) copy_row(work, n == 0 ? 3 : 6, &expected, keep);
          }
        }
        const Tolerances tol = runner.tolerances();
        const double out_error = relative_error(run.out, want);
        const double state_error = relative_error(after.recurrent(), expected.recurrent());
        const double conv_error = relative_error(conv_values(after), conv_values(expected));
        MESSAGE(runner.name() << " verify against one-token steps: out " << out_error << ", state "
                              << state_error << ", conv " << conv_error);
        // A bf16 pool: the one-token steps round the state after every token, the verify step only
        // where it keeps one, so they differ by rounding.
        CHECK(out_error <= (bf16_pool ? kBf16PoolTolerance : tol.split_out));
        CHECK(state_error <= (bf16_pool ? kBf16PoolTolerance : tol.split_state));
        CHECK(conv_error <= (tol.split_conv_exact ? 0.0 : tol.split_out));
        for (std::int64_t i = 2 * T * E; i < N * T * E; ++i) {
          if (run.out[static_cast<std::size_t>(i)] != 0) {
            FAIL_CHECK("the padding row's out is not zero at " << i);
            break;
          }
        }
        for (const std::int64_t r : {3, 6, 8, 13, 10, 11, 12}) {
          CAPTURE(r);
          CHECK(after.row_equal(before, r));
        }
      }
    }
  }
}

KDA_LAYER_CASE("a verify step's bad num_accepted or slots are refused before anything is written") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  Pools pools(config, 8);
  pools.randomize(2);
  const Pools before = pools;
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(4 * config.hidden_size), 1.0f, 3);
  struct Bad {
    std::vector<std::int32_t> slots, accepted;
    std::string message;
  };
  for (const Bad& bad :
       {Bad{{0, 1, 2, 3}, {0, 1}, "row 0 has num_accepted 0, outside [1, decode_tokens = 2]"},
        Bad{{0, 1, 2, 3}, {1, 3}, "row 1 has num_accepted 3, outside [1, decode_tokens = 2]"},
        Bad{{0, 1, 2, 8}, {1, 1}, "row 1 token 1 has slot 8, outside [0, num_slots = 8)"},
        Bad{{0, 1, 2, 1}, {2, 1}, "row 0 token 1 and row 1 token 1 share slot 1"}}) {
    CAPTURE(bad.message);
    BatchSpec batch = decode_batch(2, 2, bad.slots);
    batch.num_accepted = bad.accepted;
    const LayerRun run = runner.forward(*layer, hidden, batch, &pools);
    CHECK(run.code == StatusCode::kInvalidArgument);
    CHECK(run.error == runner.forward_error_prefix() + bad.message);
    CHECK(pools == before);
  }
  // num_accepted needs slots (and a decode batch).
  BatchSpec no_slots = decode_batch(2, 2);
  no_slots.num_accepted = {1, 1};
  const LayerRun run = runner.forward(*layer, hidden, no_slots, &pools);
  CHECK(run.error == runner.forward_error_prefix() +
                         "num_accepted (a verify step) needs a decode batch with slots");
  CHECK(pools == before);
}

// The record-and-commit form of a verify step (Batch::records, then layer::commit over several
// layers at once) against the per-token-states form of the same tokens: every row's committed
// slot s_n as the start entry of a per-token verify row (num_accepted 1, slots {s_n, fresh...}), so
// that the per-token step keeps the state after token t in its row's slot t. After the records
// step and a commit of random counts, slot s_n of every layer holds bit for bit what the per-token
// step kept after token num_accepted - 1 (conv and recurrent), out is the per-token step's bit for
// bit, the pools are untouched by the records step itself, and the padding rows (a negative slot,
// the padding slot) touch no state and leave their records as they were. On CUDA both steps run
// the same decode kernels, each of: the separate kernels, the fused step with its second factors
// inside (blocks a head chosen by shape, 2 and 8) and the fused step after the factors' GEMMs with
// one block a head. Both output gate forms.
KDA_LAYER_CASE(
    "a records verify step and its commit over two layers equal the per-token-states verify") {
  const std::int64_t N = 5, T = 4, slots_in_pool = 24;
  const std::int32_t padding_slot = 23;
  const std::vector<std::int32_t> committed = {7, 2, -1, 11, padding_slot};
  std::vector<std::int32_t> per_token;  // row n: {s_n, fresh slots}
  std::int32_t fresh = 12;
  for (const std::int32_t s : committed) {
    per_token.push_back(s);
    for (std::int64_t t = 1; t < T; ++t)
      per_token.push_back(s < 0 || s == padding_slot ? -1 : fresh++);
  }
  struct Variant {
    layer::DecodeKernel kernel;
    int cluster;
    DType dtype;
  };
  std::vector<Variant> variants;
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    variants.push_back({layer::DecodeKernel::kSeparate, 0, dtype});
    if (runner.backend() == Backend::kCuda) {
      variants.push_back({layer::DecodeKernel::kFusedFactors, 0, dtype});
      variants.push_back({layer::DecodeKernel::kFusedFactors, 2, dtype});
      variants.push_back({layer::DecodeKernel::kFusedFactors, 8, dtype});
      variants.push_back({layer::DecodeKernel::kFused, 1, dtype});
    }
  }
  for (const Variant& v : variants) {
    for (const bool full_rank : {false, true}) {
      CAPTURE(full_rank);
      const DType dtype = v.dtype;
      CAPTURE(static_cast<int>(v.kernel));
      CAPTURE(v.cluster);
      const std::string dtype_name = to_string(dtype);
      CAPTURE(dtype_name);
      ForwardSettings same_kernel;
      same_kernel.change = [v](ForwardCall& call) {
        call.options.decode_kernel = v.kernel;
        call.options.fused_cluster = v.cluster;
      };
      const layer::Config config = runner.config(GateMode::kLowerBound, full_rank);
      const std::int64_t E = config.hidden_size;
      std::vector<layer::Weights> weights;
      std::vector<Pools> before;
      for (int l = 0; l < 2; ++l) {
        weights.push_back(with_bias_and_norm(layer::random_weights(config, 60 + l, 1)));
        before.emplace_back(config, slots_in_pool, dtype);
        before.back().randomize(70 + l);
        before.back().add_records(config, N * T + 3);  // a region larger than the step needs
      }
      for (std::uint64_t trial = 0; trial < 3; ++trial) {
        CAPTURE(trial);
        std::vector<std::int32_t> accepted(static_cast<std::size_t>(N));
        for (std::int64_t n = 0; n < N; ++n) {
          accepted[static_cast<std::size_t>(n)] =
              static_cast<std::int32_t>(1 + (n * 7 + trial * 3 + n * trial) % T);
        }
        std::string accepted_list;
        for (const std::int32_t a : accepted) accepted_list += std::to_string(a) + " ";
        CAPTURE(accepted_list);
        std::vector<Pools> got, want_pools;  // per layer: the records step's, the per-token step's
        for (int l = 0; l < 2; ++l) {
          CAPTURE(l);
          const auto layer = runner.make(weights[static_cast<std::size_t>(l)]);
          const std::vector<bf16_bits> hidden =
              random_bf16(static_cast<std::size_t>(N * T * E), 2.0f, 80 + l + 10 * trial);
          // The per-token-states reference.
          BatchSpec verify = decode_batch(N, T, per_token);
          verify.num_accepted.assign(static_cast<std::size_t>(N), 1);
          verify.padding_slot = padding_slot;
          Pools expected = before[static_cast<std::size_t>(l)];
          const LayerRun want = runner.forward(*layer, hidden, verify, &expected, same_kernel);
          REQUIRE_MESSAGE(want.error.empty(), want.error);
          // The records step.
          BatchSpec records = decode_batch(N, T, committed);
          records.records = true;
          records.padding_slot = padding_slot;
          Pools pools = before[static_cast<std::size_t>(l)];
          const LayerRun run = runner.forward(*layer, hidden, records, &pools, same_kernel);
          REQUIRE_MESSAGE(run.error.empty(), run.error);
          CHECK(run.device_status == 0);
          CHECK(run.all_written);
          CHECK(run.guards_intact);
          CHECK(same_bits(run.out, want.out));
          Pools states_only = pools;  // the step wrote records only
          states_only.recurrent_records = before[static_cast<std::size_t>(l)].recurrent_records;
          states_only.conv_records = before[static_cast<std::size_t>(l)].conv_records;
          CHECK(states_only == before[static_cast<std::size_t>(l)]);
          // The padding rows' records are as they were (NaN poison).
          for (const std::int64_t n : {2, 4}) {
            const std::size_t conv_pair = static_cast<std::size_t>(3 * config.local_channels());
            const std::size_t rec_pair =
                static_cast<std::size_t>(config.local_heads() * 3 * config.head_dim);
            CHECK(std::equal(
                pools.conv_records.begin() + n * T * conv_pair,
                pools.conv_records.begin() + (n + 1) * T * conv_pair,
                before[static_cast<std::size_t>(l)].conv_records.begin() + n * T * conv_pair));
            CHECK(std::memcmp(pools.recurrent_records.data() + n * T * rec_pair,
                              before[static_cast<std::size_t>(l)].recurrent_records.data() +
                                  n * T * rec_pair,
                              T * rec_pair * sizeof(float)) == 0);
          }
          got.push_back(pools);
          want_pools.push_back(expected);
        }
        std::vector<Pools*> commit_layers = {&got[0], &got[1]};
        BatchSpec commit = decode_batch(N, T, committed);
        commit.num_accepted = accepted;
        commit.padding_slot = padding_slot;
        const LayerRun done = runner.commit(config, commit, commit_layers);
        REQUIRE_MESSAGE(done.error.empty(), done.error);
        CHECK(done.device_status == 0);
        CHECK(done.guards_intact);
        for (int l = 0; l < 2; ++l) {
          CAPTURE(l);
          const Pools& mine = got[static_cast<std::size_t>(l)];
          const Pools& want = want_pools[static_cast<std::size_t>(l)];
          for (std::int64_t n = 0; n < N; ++n) {
            CAPTURE(n);
            const std::int32_t s = committed[static_cast<std::size_t>(n)];
            if (s < 0 || s == padding_slot) continue;
            const std::int32_t kept = per_token[static_cast<std::size_t>(
                n * T + accepted[static_cast<std::size_t>(n)] - 1)];
            CHECK(mine.row_equal(want, s, kept));
          }
          // Every other slot as before: the padding slot included.
          for (std::int64_t r = 0; r < slots_in_pool; ++r) {
            if (r == 7 || r == 2 || r == 11) continue;
            CAPTURE(r);
            CHECK(mine.row_equal(before[static_cast<std::size_t>(l)], r));
          }
        }
      }
    }
  }
}

// The commit deferred into the next step (Batch::fold_sequences): after a records step, a step
// that folds its accepted tokens (recurrent and conv states) computes, bit for bit, what commit()
// followed by the same step computes: out, and the pools (a plain step), or the records and the
// folded states (a records step, which stores them). The next step takes the records step's rows
// reversed (its padding rows included, their fold entries garbage), and one row on a slot the
// records step did not read, which folds nothing. Every decode kernel on CUDA, both state dtypes,
// both output gate forms.
KDA_LAYER_CASE("a step that folds the records step before it equals commit() and then that step") {
  const std::int64_t N = 5, T = 4, slots_in_pool = 24;
  const std::int32_t padding_slot = 23;
  const std::vector<std::int32_t> committed = {7, 2, -1, 11, padding_slot};
  struct Variant {
    layer::DecodeKernel kernel;
    int cluster;
  };
  std::vector<Variant> variants = {{layer::DecodeKernel::kSeparate, 0}};
  if (runner.backend() == Backend::kCuda) {
    variants.push_back({layer::DecodeKernel::kFusedFactors, 0});
    variants.push_back({layer::DecodeKernel::kFusedFactors, 8});
    variants.push_back({layer::DecodeKernel::kFused, 1});
  }
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    const layer::Config config = runner.config(GateMode::kLowerBound, full_rank);
    const std::int64_t E = config.hidden_size;
    const auto layer = runner.make(with_bias_and_norm(layer::random_weights(config, 90, 1)));
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      for (const Variant& v : variants) {
        for (const bool next_records : {false, true}) {
          const std::string dtype_name = to_string(dtype);
          CAPTURE(dtype_name);
          CAPTURE(static_cast<int>(v.kernel));
          CAPTURE(v.cluster);
          CAPTURE(next_records);
          ForwardSettings same_kernel;
          same_kernel.change = [v](ForwardCall& call) {
            call.options.decode_kernel = v.kernel;
            call.options.fused_cluster = v.cluster;
          };
          Pools start(config, slots_in_pool, dtype);
          start.randomize(91);
          start.add_records(config, N * T);
          // The records step, then the commit of random counts: the reference's starting pools.
          BatchSpec records = decode_batch(N, T, committed);
          records.records = true;
          records.padding_slot = padding_slot;
          Pools p0 = start;
          const LayerRun first =
              runner.forward(*layer, random_bf16(static_cast<std::size_t>(N * T * E), 2.0f, 92),
                             records, &p0, same_kernel);
          REQUIRE_MESSAGE(first.error.empty(), first.error);
          const std::vector<std::int32_t> accepted = {3, 1, 2, 4, 2};
          BatchSpec commit = decode_batch(N, T, committed);
          commit.num_accepted = accepted;
          commit.padding_slot = padding_slot;
          Pools p1 = p0;
          std::vector<Pools*> commit_layers = {&p1};
          const LayerRun done = runner.commit(config, commit, commit_layers);
          REQUIRE_MESSAGE(done.error.empty(), done.error);

          // The next step: rows reversed, then slot 5 (read by no row of the records step).
          const std::int64_t N2 = N + 1, T2 = next_records ? 3 : 1;
          std::vector<std::int32_t> slots2;
          BatchSpec next;
          for (std::int64_t n = N - 1; n >= 0; --n) {
            const std::int32_t s = committed[static_cast<std::size_t>(n)];
            slots2.push_back(s);
            const bool padding = s < 0 || s == padding_slot;
            next.fold_rows.push_back(padding ? 777 : static_cast<std::int32_t>(n));
            next.fold_counts.push_back(padding ? -3 : accepted[static_cast<std::size_t>(n)]);
          }
          slots2.push_back(5);
          next.fold_rows.push_back(-1);
          next.fold_counts.push_back(0);
          BatchSpec plain = decode_batch(N2, T2, slots2);
          plain.padding_slot = padding_slot;
          plain.records = next_records;
          const std::vector<bf16_bits> hidden =
              random_bf16(static_cast<std::size_t>(N2 * T2 * E), 2.0f, 93);
          Pools want_pools = p1;
          want_pools.add_records(config, N * T);  // both regions sized alike (at least N2 x T2)
          const LayerRun want = runner.forward(*layer, hidden, plain, &want_pools, same_kernel);
          REQUIRE_MESSAGE(want.error.empty(), want.error);

          BatchSpec folding = plain;
          folding.fold_sequences = N;
          folding.fold_decode_tokens = T;
          folding.fold_rows = next.fold_rows;
          folding.fold_counts = next.fold_counts;
          Pools got_pools = p0;  // the records step's pools: nothing committed
          got_pools.fold_recurrent_records = p0.recurrent_records;
          got_pools.fold_conv_records = p0.conv_records;
          got_pools.add_records(config, N * T);
          const LayerRun got = runner.forward(*layer, hidden, folding, &got_pools, same_kernel);
          REQUIRE_MESSAGE(got.error.empty(), got.error);
          CHECK(got.device_status == 0);
          CHECK(got.guards_intact);
          CHECK(same_bits(got.out, want.out));
          got_pools.fold_recurrent_records.clear();
          got_pools.fold_conv_records.clear();
          CHECK(got_pools == want_pools);  // pools (folded, stepped) and this step's records
        }
      }
    }
  }
}

KDA_LAYER_CASE("a fold refuses bad input before anything is written") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  Pools pools(config, 8);
  pools.randomize(2);
  pools.add_records(config, 4);
  pools.fold_recurrent_records = pools.recurrent_records;
  pools.fold_conv_records = pools.conv_records;
  const Pools before = pools;
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(4 * config.hidden_size), 1.0f, 3);
  auto folding = [](BatchSpec b) {
    b.fold_sequences = 2;
    b.fold_decode_tokens = 2;
    b.fold_rows = {1, 0};
    b.fold_counts = {2, 1};
    return b;
  };
  struct Bad {
    BatchSpec batch;
    std::string message;
  };
  std::vector<Bad> cases;
  {
    BatchSpec b = folding(decode_batch(2, 2, {0, 1}));
    b.num_accepted = {1, 1};
    b.slots = {0, 1, 2, 3};
    cases.push_back({b,
                     "fold_sequences (a fold of the last records step) needs a decode batch with "
                     "slots and no num_accepted"});
  }
  {
    BatchSpec b = folding(decode_batch(2, 1, {0, 1}));
    b.fold_decode_tokens = 3;
    cases.push_back({b,
                     "fold: State::record_rows 4 is below the records step's 2 x 3 row-token "
                     "pairs"});
  }
  for (const std::int64_t tokens : {17, 0}) {  // one past either end of [1, 16]
    BatchSpec b = folding(decode_batch(2, 1, {0, 1}));
    b.fold_decode_tokens = tokens;
    cases.push_back({b, "fold_decode_tokens " + std::to_string(tokens) + " is not in [1, 16]"});
  }
  if (runner.backend() == Backend::kCpu) {  // CUDA reads them on the device (below)
    BatchSpec b = folding(decode_batch(2, 1, {0, 1}));
    b.fold_rows = {1, 2};
    cases.push_back({b, "row 1 has fold row 2, outside [0, fold_sequences = 2)"});
    b = folding(decode_batch(2, 1, {0, 1}));
    b.fold_counts = {0, 1};
    cases.push_back({b, "row 0 has fold count 0, outside [1, fold_decode_tokens = 2]"});
  } else {
    // CUDA: the row with a fold row or count out of range is written as padding (out zeros, its
    // states untouched) and reported; the other row runs. Every decode kernel.
    for (const layer::DecodeKernel kernel :
         {layer::DecodeKernel::kAuto, layer::DecodeKernel::kSeparate,
          layer::DecodeKernel::kFused}) {
      for (const bool bad_count : {false, true}) {
        CAPTURE(static_cast<int>(kernel));
        CAPTURE(bad_count);
        BatchSpec b = folding(decode_batch(2, 1, {0, 1}));
        if (bad_count) {
          b.fold_counts = {1, 3};
        } else {
          b.fold_rows = {0, 2};
        }
        ForwardSettings settings;
        settings.change = [kernel](ForwardCall& call) { call.options.decode_kernel = kernel; };
        Pools p = before;
        const std::vector<bf16_bits> in(hidden.begin(), hidden.begin() + 2 * config.hidden_size);
        const LayerRun run = runner.forward(*layer, in, b, &p, settings);
        REQUIRE_MESSAGE(run.error.empty(), run.error);
        CHECK(run.device_status == kda::kDeviceStatusAccepted);
        CHECK(p.row_equal(before, 1));
        CHECK(!p.row_equal(before, 0));
        CHECK(std::all_of(run.out.begin() + config.hidden_size, run.out.end(),
                          [](bf16_bits x) { return x == 0; }));
      }
    }
  }
  for (const Bad& bad : cases) {
    CAPTURE(bad.message);
    Pools p = before;
    const std::vector<bf16_bits> in(hidden.begin(),
                                    hidden.begin() + bad.batch.tokens() * config.hidden_size);
    const LayerRun run = runner.forward(*layer, in, bad.batch, &p);
    CHECK(run.error == runner.forward_error_prefix() + bad.message);
    CHECK(p == before);
  }
  // Refusals of the step's arguments themselves: a null fold region; a records step that folds
  // (it writes its records while it reads the fold's), whose rows share a slot or whose fold
  // regions overlap the records regions it writes, the conv's or the recurrent's from the fold's
  // second row-token pair on (a fold of 2 x 2 pairs reads four).
  const std::size_t recurrent_pair = before.recurrent_records.size() / 4;
  Pools wide = before;  // fold regions of 8 pairs: the records regions fit inside after one pair
  wide.fold_recurrent_records.resize(8 * recurrent_pair);
  struct BadCall {
    BatchSpec batch;
    std::function<void(ForwardCall&)> change;
    std::string message;
  };
  BatchSpec records_fold = folding(decode_batch(2, 2, {0, 1}));
  records_fold.records = true;
  BatchSpec shared = records_fold;
  shared.slots = {3, 3};
  const std::string overlap =
      "fold: a records step folds records that overlap the region it writes (keep two records "
      "regions a layer and alternate)";
  for (const BadCall& bad :
       {BadCall{folding(decode_batch(2, 1, {0, 1})),
                [](ForwardCall& call) { call.state.fold_conv_records = nullptr; },
                "fold: fold_rows, fold_counts, State::fold_recurrent_records or "
                "State::fold_conv_records is null"},
        BadCall{shared, nullptr, "sequences 0 and 1 share slot 3"},
        BadCall{records_fold,
                [](ForwardCall& call) { call.state.fold_conv_records = call.state.conv_records; },
                overlap},
        BadCall{records_fold,
                [recurrent_pair](ForwardCall& call) {
                  call.state.recurrent_records =
                      const_cast<float*>(call.state.fold_recurrent_records) + recurrent_pair;
                },
                overlap}}) {
    CAPTURE(bad.message);
    ForwardSettings settings;
    settings.change = bad.change;
    const std::vector<bf16_bits> in(hidden.begin(),
                                    hidden.begin() + bad.batch.tokens() * config.hidden_size);
    const LayerRun run = check_refused(runner, *layer, in, bad.batch, wide, settings);
    CHECK(run.error == runner.forward_error_prefix() + bad.message);
  }
}

KDA_LAYER_CASE("a records verify step and a commit refuse bad input before anything is written") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  Pools pools(config, 8);
  pools.randomize(2);
  pools.add_records(config, 4);
  const Pools before = pools;
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(4 * config.hidden_size), 1.0f, 3);
  {
    BatchSpec batch = decode_batch(2, 2, {0, 1});
    batch.records = true;
    batch.num_accepted = {1, 1};
    const LayerRun run = runner.forward(*layer, hidden, batch, &pools);
    CHECK(run.error == runner.forward_error_prefix() +
                           "records and num_accepted are both set: a records step takes no "
                           "num_accepted (the commit does)");
    CHECK(pools == before);
  }
  {
    Pools small = before;
    small.add_records(config, 3);
    const Pools small_before = small;
    BatchSpec batch = decode_batch(2, 2, {0, 1});
    batch.records = true;
    const LayerRun run = runner.forward(*layer, hidden, batch, &small);
    CHECK(run.error == runner.forward_error_prefix() +
                           "records: State::record_rows 3 is below the step's 2 x 2 row-token "
                           "pairs");
    CHECK(small == small_before);
  }
  {
    BatchSpec batch = decode_batch(2, 2, {0, 1});
    batch.records = true;
    ForwardSettings settings;
    settings.change = [](ForwardCall& call) { call.state.conv_records = nullptr; };
    const LayerRun run = check_refused(runner, *layer, hidden, batch, before, settings);
    CHECK(run.error == runner.forward_error_prefix() +
                           "records: State::recurrent_records or State::conv_records is null");
  }
  {
    BatchSpec batch = decode_batch(2, 2);
    batch.records = true;
    const LayerRun run = runner.forward(*layer, hidden, batch, &pools);
    CHECK(run.error == runner.forward_error_prefix() +
                           "records (a record-and-commit verify step) needs a decode batch with "
                           "slots");
    CHECK(pools == before);
  }
  {
    // Rows may share a slot in a records step (the pool is only read).
    BatchSpec batch = decode_batch(2, 2, {3, 3});
    batch.records = true;
    const LayerRun run = runner.forward(*layer, hidden, batch, &pools);
    CHECK_MESSAGE(run.error.empty(), run.error);
    pools = before;
  }
  const std::string prefix = std::string("KDA layer commit (") + runner.name() + "): ";
  struct Bad {
    std::vector<std::int32_t> slots, accepted;
    std::string message;
  };
  for (const Bad& bad :
       {Bad{{0, 1}, {0, 1}, "row 0 has num_accepted 0, outside [1, decode_tokens = 2]"},
        Bad{{0, 1}, {1, 3}, "row 1 has num_accepted 3, outside [1, decode_tokens = 2]"},
        Bad{{0, 8}, {1, 1}, "row 1 has slot 8, outside [0, num_slots = 8)"},
        Bad{{5, 5}, {2, 1}, "rows 0 and 1 share slot 5 (a commit writes each state once)"}}) {
    CAPTURE(bad.message);
    BatchSpec commit = decode_batch(2, 2, bad.slots);
    commit.num_accepted = bad.accepted;
    Pools layer0 = before, layer1 = before;
    const LayerRun run = runner.commit(config, commit, {&layer0, &layer1});
    CHECK(run.code == StatusCode::kInvalidArgument);
    CHECK(run.error == prefix + bad.message);
    CHECK(layer0 == before);
    CHECK(layer1 == before);
  }
  // A padding row's num_accepted is not read.
  BatchSpec commit = decode_batch(2, 2, {-1, 4});
  commit.num_accepted = {0, 2};
  Pools layer0 = before;
  const LayerRun run = runner.commit(config, commit, {&layer0});
  CHECK_MESSAGE(run.error.empty(), run.error);
  for (std::int64_t r = 0; r < 8; ++r) {
    if (r != 4) CHECK(layer0.row_equal(before, r));
  }
}

namespace {

// Checkpoint requests of a prefill: sequence 0 (37 tokens, slot 0) after 16 and 37 tokens into
// rows 2 and 3; sequence 1 (20 tokens, slot 1) after 0 and 16 tokens into rows 4 and 5.
ForwardSettings with_checkpoints(const std::vector<std::int64_t>* offsets,
                                 const std::vector<std::int32_t>* rows, std::int64_t k) {
  ForwardSettings settings;
  settings.change = [=](ForwardCall& call) {
    call.batch.checkpoints = k;
    call.batch.checkpoint_offsets = offsets->data();
    call.batch.checkpoint_slots = rows->data();
  };
  return settings;
}

// Requests where a sequence's initial conv state is read (an empty sequence at offset 0, a
// two-token one at its length and at 0) beside many a sequence in any order: sequences of 0, 2 and
// 200 tokens on slots 2, 0, 1, K = 14 requests each; sequence 2's offsets 192, 176, ..., 16, then
// 200 and 0 (rows 3 + 2K + k); sequence 0's offset 0 (row 3), sequence 1's 2 and 0 (rows 3 + K,
// 4 + K); the rest none. Rows 4 .. 3 + 2K but those two are named by no request.
struct SpreadRequests {
  static constexpr std::int64_t K = 14;
  static constexpr std::int64_t kPoolRows = 3 + 3 * K;
  std::vector<std::int64_t> lengths = {0, 2, 200};
  std::vector<std::int32_t> own = {2, 0, 1};
  std::vector<std::int64_t> offsets = std::vector<std::int64_t>(3 * K, -1);
  std::vector<std::int32_t> rows = std::vector<std::int32_t>(3 * K, -1);
  SpreadRequests() {
    offsets[0] = 0, rows[0] = 3;
    offsets[K] = 2, rows[K] = 3 + K;
    offsets[K + 1] = 0, rows[K + 1] = 4 + K;
    for (std::int64_t k = 0; k < K; ++k) {
      offsets[2 * K + k] = k < 12 ? 192 - 16 * k : (k == 12 ? 200 : 0);
      rows[2 * K + k] = static_cast<std::int32_t>(3 + 2 * K + k);
    }
  }
  bool named(std::int64_t row) const {
    return row < 4 || row == 3 + K || row == 4 + K || row >= 3 + 2 * K;
  }
};

}  // namespace

// Each checkpoint row holds the states (recurrent and conv) of a prefill of that many of its
// sequence's tokens, bit for bit, and a prefill continued from it ends where the one-pass prefill
// ends; out and the sequences' own rows are those of the call without checkpoints.
KDA_LAYER_CPU_CASE(
    "prefill checkpoints hold each offset's states, and continuing from one matches") {
  LayerRunner& runner = cpu_layer_runner();
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    const layer::Config config = runner.config(GateMode::kLowerBound, full_rank);
    const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 51, 2));
    const auto layer = runner.make(weights);
    const std::int64_t E = config.hidden_size;
    const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(57 * E), 2.0f, 52);
    const BatchSpec batch = prefill_batch({37, 20}, {0, 1});
    Pools before(config, 6);
    before.randomize(53);
    const std::vector<std::int64_t> offsets = {16, 37, 0, 16};
    const std::vector<std::int32_t> rows = {2, 3, 4, 5};
    Pools after = before;
    const LayerRun run =
        runner.forward(*layer, hidden, batch, &after, with_checkpoints(&offsets, &rows, 2));
    REQUIRE_MESSAGE(run.error.empty(), run.error);
    Pools plain = before;
    const LayerRun plain_run = runner.forward(*layer, hidden, batch, &plain);
    CHECK(same_bits(run.out, plain_run.out));
    CHECK(after.row_equal(plain, 0));
    CHECK(after.row_equal(plain, 1));

    struct Request {
      std::int64_t sequence, offset, row;
    };
    for (const Request& r :
         {Request{0, 16, 2}, Request{0, 37, 3}, Request{1, 0, 4}, Request{1, 16, 5}}) {
      CAPTURE(r.row);
      Pools prefix = before;
      const std::int64_t begin = r.sequence == 0 ? 0 : 37;
      const LayerRun p = runner.forward(
          *layer, token_rows(hidden, E, begin, begin + r.offset),
          prefill_batch({r.offset}, {static_cast<std::int32_t>(r.sequence)}), &prefix);
      REQUIRE_MESSAGE(p.error.empty(), p.error);
      CHECK(after.row_equal(prefix, r.row, r.sequence));
    }
    // Sequence 0 continued from its checkpoint after 16 tokens: its last 21 tokens.
    Pools resumed = after;
    const LayerRun rest =
        runner.forward(*layer, token_rows(hidden, E, 16, 37), prefill_batch({21}, {2}), &resumed);
    REQUIRE_MESSAGE(rest.error.empty(), rest.error);
    // An f32 checkpoint holds the state exactly, and the CPU layer continues with the same
    // operations: bit for bit.
    CHECK(same_bits(rest.out, token_rows(run.out, E, 16, 37)));
    CHECK(resumed.row_equal(after, 2, 0));
  }
}

namespace {

// The pools of `layers` layers of 2 slots, random states, records regions of 4 row-token pairs.
std::vector<Pools> commit_pools(const layer::Config& config, int layers) {
  std::vector<Pools> pools;
  pools.reserve(static_cast<std::size_t>(layers));
  for (int l = 0; l < layers; ++l) {
    pools.emplace_back(config, 2);
    pools.back().randomize(static_cast<std::uint64_t>(l) + 1);
    pools.back().add_records(config, 4);
  }
  return pools;
}

}  // namespace

// Past kda::kMaxCommitLayers layers the operator's commit runs a group at a time: every group is
// checked, and the pools of different groups against each other, before any layer is committed.
KDA_LAYER_CPU_CASE(
    "a commit of more layers than one operator call refuses bad input before writing") {
  const layer::Config config = cpu_layer_runner().config();
  const int L = kMaxCommitLayers + 3;
  std::vector<Pools> pools = commit_pools(config, L);
  const std::vector<Pools> before = pools;
  std::vector<layer::State> states(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    Pools& p = pools[static_cast<std::size_t>(l)];
    layer::State& s = states[static_cast<std::size_t>(l)];
    s.num_slots = p.num_slots;
    s.conv_q = p.conv_q.data();
    s.conv_k = p.conv_k.data();
    s.conv_v = p.conv_v.data();
    s.recurrent = p.rec_f32.data();
    s.record_rows = p.record_rows;
    s.recurrent_records = p.recurrent_records.data();
    s.conv_records = p.conv_records.data();
  }
  const std::int32_t slots[2] = {0, 1}, accepted[2] = {1, 2};
  layer::CommitBatch batch;
  batch.sequences = 2;
  batch.slots = slots;
  batch.num_accepted = accepted;
  batch.decode_tokens = 2;
  auto error_of = [&] {
    try {
      layer::commit(Backend::kCpu, config, batch, states.data(), L);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // Two layers of the last group on one pool: found by that group's check, before the first
  // group is committed.
  states[L - 1].recurrent = states[L - 2].recurrent;
  CHECK(error_of() ==
        "KDA layer commit (CPU): layers 128 to 130 of the call (the message counts "
        "from the first of them): layers[1].state_pool overlaps layers[2].state_pool "
        "(each layer updates its own pool)");
  CHECK(pools == before);
  // Layers of different groups on one pool: no group's check sees both.
  states[L - 1].recurrent = pools[static_cast<std::size_t>(L - 1)].rec_f32.data();
  states[kMaxCommitLayers].recurrent = states[0].recurrent;
  CHECK(error_of() ==
        "KDA layer commit (CPU): layers 0 and 128 of the call: a recurrent pool "
        "overlaps the other's pool or records");
  CHECK(pools == before);
  // The last layer against the first group (the last pair the cross-group check compares).
  states[kMaxCommitLayers].recurrent = pools[kMaxCommitLayers].rec_f32.data();
  states[L - 1].recurrent = states[0].recurrent;
  CHECK(error_of() ==
        "KDA layer commit (CPU): layers 0 and 130 of the call: a recurrent pool "
        "overlaps the other's pool or records");
  CHECK(pools == before);
  states[L - 1].recurrent = pools[static_cast<std::size_t>(L - 1)].rec_f32.data();
  // Layers whose records hold different row counts.
  states[L - 1].record_rows = 3;
  CHECK(error_of() ==
        "KDA layer commit (CPU): layer 130 of the call: num_slots, recurrent_dtype or "
        "record_rows differs from layer 0's");
  CHECK(pools == before);
  // Records of fewer rows than the call's row-token pairs (3 < 2 x 2), in every layer.
  for (layer::State& s : states) s.record_rows = 3;
  CHECK(error_of() ==
        "KDA layer commit (CPU): layer 0 of the call: record_rows 3 is below 2 x 2 "
        "row-token pairs");
  CHECK(pools == before);
  for (layer::State& s : states) s.record_rows = 4;
  // Conv pools the commit writes, aliased within a layer, across layers, or over records.
  struct Alias {
    bf16_bits** pool;
    bf16_bits* onto;
    const char* message;
  };
  for (const Alias& alias : {Alias{&states[0].conv_k, states[0].conv_q,
                                   "layer 0's conv_q pool overlaps layer 0's conv_k pool"},
                             Alias{&states[5].conv_v, states[130].conv_q,
                                   "layer 5's conv_v pool overlaps layer 130's conv_q pool"},
                             Alias{&states[7].conv_q, states[2].conv_records,
                                   "layer 7's conv_q pool overlaps layer 2's conv_records"}}) {
    bf16_bits* const own = *alias.pool;
    *alias.pool = alias.onto;
    CHECK(error_of() == std::string("KDA layer commit (CPU): ") + alias.message +
                            " (a commit writes each conv pool)");
    *alias.pool = own;
  }
  CHECK(pools == before);
  // A negative pool size is named as such (not as the default padding_slot outside it).
  for (layer::State& s : states) s.num_slots = -1;
  CHECK(error_of() == "KDA layer commit (CPU): State::num_slots -1 is negative");
  CHECK(pools == before);
  for (std::size_t l = 0; l < states.size(); ++l) states[l].num_slots = pools[l].num_slots;
  // A row count whose row-token pairs overflow 64 bits is below any record_rows.
  batch.sequences = (std::int64_t{1} << 60) + 1;
  batch.decode_tokens = 16;
  CHECK(error_of() ==
        "KDA layer commit (CPU): layer 0 of the call: record_rows 4 is below "
        "1152921504606846977 x 16 row-token pairs");
  CHECK(pools == before);
  // The same layers, well formed, commit.
  batch.sequences = 2;
  batch.decode_tokens = 2;
  CHECK(error_of().empty());
  CHECK(pools != before);
}

// On CUDA each group's alignment is checked with the rest before the first group is committed (the
// operator's commit checks it only for its own call).
KDA_LAYER_CUDA_CASE(
    "a commit of more layers than one operator call checks every group's alignment") {
  const layer::Config config = cuda.config();
  const int L = kMaxCommitLayers + 3;
  std::vector<Pools> pools = commit_pools(config, L);
  const std::vector<Pools> before = pools;
  std::vector<Pools*> layers;
  for (Pools& p : pools) layers.push_back(&p);
  BatchSpec batch = decode_batch(2, 2, {0, 1});
  batch.records = true;
  batch.num_accepted = {1, 2};
  // The last layer's records 4 bytes past a 16-byte boundary (the pointer checks off: they would
  // refuse the records first, as reaching past their allocation).
  const LayerRun run = cuda.commit(
      config, batch, layers, true,
      [](std::vector<layer::State>& states, layer::CommitBatch&, layer::RunOptions& options) {
        states.back().recurrent_records += 1;
        options.check_pointers = false;
      });
  CHECK(run.code == StatusCode::kInvalidArgument);
  CHECK(run.error ==
        "KDA layer commit (CUDA): layers 128 to 130 of the call (the message counts from the "
        "first of them): layers[2]: records must be 16-byte aligned for the CUDA commit");
  CHECK(run.device_status == 0);
  CHECK(pools == before);
  // The same layers as they are commit.
  const LayerRun committed = cuda.commit(config, batch, layers);
  CHECK(committed.error.empty());
  CHECK(pools != before);
}

// The same requests as the CUDA case below (an empty sequence at offset 0, a two-token one at its
// length and at 0, 14 a sequence in any order): each row bit for bit the states of a prefill of
// that many of its sequence's tokens (offset 0: the initial states), rows no request names
// untouched, out and the sequences' own rows those of the call without checkpoints.
KDA_LAYER_CPU_CASE("prefill checkpoints from an empty sequence to many a sequence") {
  LayerRunner& runner = cpu_layer_runner();
  const layer::Config config = runner.config(GateMode::kLowerBound, false);
  const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 71, 2));
  const auto layer = runner.make(weights);
  const std::int64_t E = config.hidden_size;
  const SpreadRequests spread;
  const BatchSpec batch = prefill_batch(spread.lengths, spread.own);
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(batch.tokens() * E), 2.0f, 72);
  Pools before(config, SpreadRequests::kPoolRows);
  before.randomize(73);
  Pools after = before;
  const LayerRun run =
      runner.forward(*layer, hidden, batch, &after,
                     with_checkpoints(&spread.offsets, &spread.rows, SpreadRequests::K));
  REQUIRE_MESSAGE(run.error.empty(), run.error);
  Pools plain = before;
  const LayerRun plain_run = runner.forward(*layer, hidden, batch, &plain);
  CHECK(same_bits(run.out, plain_run.out));
  for (std::int64_t r = 0; r < SpreadRequests::kPoolRows; ++r) {
    if (r < 3) CHECK(after.row_equal(plain, r));
    if (!spread.named(r)) CHECK(after.row_equal(before, r));
  }
  for (std::size_t i = 0; i < spread.offsets.size(); ++i) {
    if (spread.rows[i] < 0) continue;
    const std::int64_t n = static_cast<std::int64_t>(i) / SpreadRequests::K;
    const std::int32_t own = spread.own[static_cast<std::size_t>(n)];
    CAPTURE(n);
    CAPTURE(spread.offsets[i]);
    Pools prefix = before;
    const std::int64_t begin = batch.cu_seqlens[n];
    const LayerRun p =
        runner.forward(*layer, token_rows(hidden, E, begin, begin + spread.offsets[i]),
                       prefill_batch({spread.offsets[i]}, {own}), &prefix);
    REQUIRE_MESSAGE(p.error.empty(), p.error);
    CHECK(after.row_equal(prefix, spread.rows[i], own));
  }
}

KDA_LAYER_CPU_CASE("bad checkpoint requests are refused before anything is written") {
  LayerRunner& runner = cpu_layer_runner();
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(57 * config.hidden_size), 1.0f, 3);
  Pools pools(config, 6);
  pools.randomize(4);
  const Pools before = pools;
  struct Bad {
    std::vector<std::int64_t> offsets;
    std::vector<std::int32_t> rows;
    std::string message;
  };
  for (const Bad& bad :
       {Bad{{16, 36, 0, 16},
            {2, 3, 4, 5},
            "sequence 0 checkpoint 1: offset 36 is not -1, a multiple of 16 up to the sequence's "
            "length 37, or that length"},
        Bad{{16, 37, 0, 32},
            {2, 3, 4, 5},
            "sequence 1 checkpoint 1: offset 32 is not -1, a multiple of 16 up to the sequence's "
            "length 20, or that length"},
        Bad{{16, 37, 0, 16},
            {2, 3, 6, 5},
            "sequence 1 checkpoint 0: slot 6 is outside [0, "
            "num_slots = 6)"},
        Bad{{16, 37, 0, 16},
            {2, 1, 4, 5},
            "sequence 0 checkpoint 1: slot 1 is written twice in the call (another checkpoint or "
            "a sequence's state)"},
        Bad{{16, 37, 0, 16},
            {2, 3, 2, 5},
            "sequence 1 checkpoint 0: slot 2 is written twice in the call (another checkpoint or "
            "a sequence's state)"}}) {
    CAPTURE(bad.message);
    const LayerRun run = runner.forward(*layer, hidden, prefill_batch({37, 20}, {0, 1}), &pools,
                                        with_checkpoints(&bad.offsets, &bad.rows, 2));
    CHECK(run.code == StatusCode::kInvalidArgument);
    CHECK(run.error == runner.forward_error_prefix() + bad.message);
    CHECK(pools == before);
  }
  // Refusals of the call before its requests are read (the arrays here hold two columns): a column
  // count whose [N, checkpoints] int64 byte count wraps 64 bits (kOverflow), alone or only times
  // the N = 2 sequences; a negative count; requests of a decode step; a null checkpoint_slots.
  std::vector<std::int64_t> offsets{16, 37, 0, 16};
  std::vector<std::int32_t> rows{2, 3, 4, 5};
  ForwardSettings no_slots;
  no_slots.change = [&offsets](ForwardCall& call) {
    call.batch.checkpoints = 2;
    call.batch.checkpoint_offsets = offsets.data();
    call.batch.checkpoint_slots = nullptr;
  };
  const BatchSpec two = prefill_batch({37, 20}, {0, 1});
  struct BadCall {
    BatchSpec batch;
    ForwardSettings settings;
    StatusCode code;
    std::string message;
  };
  for (const BadCall& bad :
       {BadCall{two, with_checkpoints(&offsets, &rows, std::int64_t{1} << 62),
                StatusCode::kOverflow,
                "checkpoint_offsets bytes N*checkpoints*8 (2 x 4611686018427387904 x 8) overflow "
                "64-bit sizes"},
        BadCall{two, with_checkpoints(&offsets, &rows, std::int64_t{1} << 59),
                StatusCode::kOverflow,
                "checkpoint_offsets bytes N*checkpoints*8 (2 x 576460752303423488 x 8) overflow "
                "64-bit sizes"},
        BadCall{two, with_checkpoints(&offsets, &rows, -1), StatusCode::kInvalidArgument,
                "checkpoints must be >= 0"},
        BadCall{decode_batch(2, 1, {0, 1}), with_checkpoints(&offsets, &rows, 1),
                StatusCode::kInvalidArgument, "checkpoints need a prefill with slots"},
        BadCall{two, no_slots, StatusCode::kInvalidArgument,
                "checkpoint_offsets or checkpoint_slots is null"}}) {
    CAPTURE(bad.message);
    const LayerRun run = runner.forward(*layer, hidden, bad.batch, &pools, bad.settings);
    CHECK(run.code == bad.code);
    CHECK(run.error == runner.forward_error_prefix() + bad.message);
    CHECK(pools == before);
  }
  // A request of offset -1 asks for nothing: its slot may be a sequence's own or another
  // request's, and is not written by it.
  std::vector<std::int64_t> none_offsets{16, -1, -1, 16};
  std::vector<std::int32_t> none_rows{2, 0, 2, 5};
  const LayerRun none = runner.forward(*layer, hidden, prefill_batch({37, 20}, {0, 1}), &pools,
                                       with_checkpoints(&none_offsets, &none_rows, 2));
  CHECK_MESSAGE(none.error.empty(), none.error);
  for (const std::int64_t row : {3, 4}) CHECK(pools.row_equal(before, row));
  for (const std::int64_t row : {0, 1, 2, 5}) CHECK_FALSE(pools.row_equal(before, row));
  pools = before;
  // A padding sequence's requests are not read: offsets and rows no request may name pass there
  // and write nothing; the other sequence's requests are written.
  std::vector<std::int64_t> padded_offsets{16, 37, 7, 99};
  std::vector<std::int32_t> padded_rows{2, 3, 99, 1};
  const LayerRun padded = runner.forward(*layer, hidden, prefill_batch({37, 20}, {0, -1}), &pools,
                                         with_checkpoints(&padded_offsets, &padded_rows, 2));
  CHECK(padded.error.empty());
  CHECK(padded.code == StatusCode::kOk);
  for (const std::int64_t row : {1, 4, 5}) CHECK(pools.row_equal(before, row));
  for (const std::int64_t row : {0, 2, 3}) CHECK_FALSE(pools.row_equal(before, row));
}

// A request whose slot is -1 or the batch's padding slot asks for nothing: neither its conv states
// nor its recurrent state are written anywhere, while the call's other requests are.
KDA_LAYER_CPU_CASE("checkpoint requests naming no slot or the padding slot write nothing") {
  LayerRunner& runner = cpu_layer_runner();
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 5, 0));
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(57 * config.hidden_size), 1.0f, 6);
  Pools pools(config, 6);
  pools.randomize(7);
  const Pools before = pools;
  BatchSpec batch = prefill_batch({37, 20}, {0, 1});
  batch.padding_slot = 5;
  // Sequence 0: after 16 tokens into no slot, after 37 into the padding slot; sequence 1: after
  // 16 into the padding slot, after 20 into row 3.
  const std::vector<std::int64_t> offsets{16, 37, 16, 20};
  const std::vector<std::int32_t> rows{-1, 5, 5, 3};
  const LayerRun run =
      runner.forward(*layer, hidden, batch, &pools, with_checkpoints(&offsets, &rows, 2));
  REQUIRE_MESSAGE(run.error.empty(), run.error);
  for (const std::int64_t row : {2, 4, 5}) CHECK(pools.row_equal(before, row));
  for (const std::int64_t row : {0, 1, 3}) CHECK_FALSE(pools.row_equal(before, row));
  CHECK(pools.row_equal(pools, 3, 1));  // the request at the length: the sequence's final state
}

namespace {

// Checkpoint requests [N, k] in device memory, as the CUDA layer reads them.
ForwardSettings with_device_checkpoints(const DeviceBuffer& offsets, const DeviceBuffer& rows,
                                        std::int64_t k) {
  ForwardSettings settings;
  settings.change = [&offsets, &rows, k](ForwardCall& call) {
    call.batch.checkpoints = k;
    call.batch.checkpoint_offsets = static_cast<const std::int64_t*>(offsets.get());
    call.batch.checkpoint_slots = static_cast<const std::int32_t*>(rows.get());
  };
  return settings;
}

// Row `row` of `after` (its three conv states and its recurrent state) against row `ref_row` of
// the reference's pools, within `tolerance`.
void check_checkpoint_row(const Pools& after, std::int64_t row, const LayerReference& ref,
                          std::int64_t ref_row, double tolerance) {
  auto slice = [](const auto& pool, std::size_t width, std::int64_t r) {
    using T = typename std::decay_t<decltype(pool)>::value_type;
    return std::vector<T>(pool.begin() + static_cast<std::ptrdiff_t>(r * width),
                          pool.begin() + static_cast<std::ptrdiff_t>((r + 1) * width));
  };
  const std::size_t cw = after.conv_row, rw = after.recurrent_row;
  CHECK(relative_error(slice(after.conv_q, cw, row), slice(ref.conv_q, cw, ref_row)) <= tolerance);
  CHECK(relative_error(slice(after.conv_k, cw, row), slice(ref.conv_k, cw, ref_row)) <= tolerance);
  CHECK(relative_error(slice(after.conv_v, cw, row), slice(ref.conv_v, cw, ref_row)) <= tolerance);
  CHECK(relative_error(slice(after.recurrent(), rw, row), slice(ref.recurrent, rw, ref_row)) <=
        tolerance);
}

}  // namespace

// CUDA: each checkpoint row within the fp64 reference's tolerance of a prefill of that many of
// its sequence's tokens (conv states and the recurrent state), a request at the length bit for bit
// the sequence's own row, out and the sequences' rows those of the call without checkpoints, rows
// no request names untouched, and a prefill continued from a checkpoint as the one pass.
KDA_LAYER_CUDA_CASE(
    "prefill checkpoints hold each offset's states, and continuing from one matches") {
  for (const bool full_rank : {false, true}) {
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      CAPTURE(full_rank);
      const std::string dtype_name = to_string(dtype);
      CAPTURE(dtype_name);
      const layer::Config config = cuda.config(GateMode::kLowerBound, full_rank);
      const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 61, 2));
      const auto layer = cuda.make(weights);
      const std::int64_t E = config.hidden_size;
      const std::vector<std::int64_t> lengths = {37, 20, 300, 1};
      const BatchSpec batch = prefill_batch(lengths, {0, 1, 2, 3});
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(batch.tokens() * E), 2.0f, 62);
      Pools before(config, 12, dtype);
      before.randomize(63);
      const std::vector<std::int64_t> offsets = {16, 37, 0, 16, 256, 300, 1, -1};
      const std::vector<std::int32_t> rows = {4, 5, 6, 7, 8, 9, 10, -1};
      const DeviceBuffer offsets_dev = DeviceBuffer::from(offsets);
      const DeviceBuffer rows_dev = DeviceBuffer::from(rows);
      Pools after = before;
      const LayerRun run = cuda.forward(*layer, hidden, batch, &after,
                                        with_device_checkpoints(offsets_dev, rows_dev, 2));
      REQUIRE_MESSAGE(run.error.empty(), run.error);
      CHECK(run.device_status == 0u);
      CHECK(run.guards_intact);
      Pools plain = before;
      const LayerRun plain_run = cuda.forward(*layer, hidden, batch, &plain);
      check_forward(cuda, weights, hidden, batch, before, plain_run, plain);
      CHECK(same_bits(run.out, plain_run.out));
      for (std::int64_t r = 0; r < 4; ++r) CHECK(after.row_equal(plain, r));
      CHECK(after.row_equal(before, 11));
      CHECK(after.row_equal(after, 5, 0));  // sequence 0 after its 37 tokens
      CHECK(after.row_equal(after, 9, 2));  // sequence 2 after its 300
      CHECK(after.row_equal(after, 10, 3));

      const double tolerance = cuda.tolerances().reference;
      for (std::size_t i = 0; i < offsets.size(); ++i) {
        if (rows[i] < 0 || offsets[i] < 0) continue;
        const std::int64_t n = static_cast<std::int64_t>(i) / 2, row = rows[i];
        CAPTURE(row);
        const std::int64_t begin = batch.cu_seqlens[n];
        const LayerReference ref =
            reference_layer(weights, token_rows(hidden, E, begin, begin + offsets[i]),
                            prefill_batch({offsets[i]}, {static_cast<std::int32_t>(n)}), before);
        check_checkpoint_row(after, row, ref, n, tolerance);
      }
      // Sequence 2 continued from its checkpoint after 256 tokens: its last 44 tokens.
      Pools resumed = after;
      const std::int64_t begin2 = batch.cu_seqlens[2];
      const LayerRun rest = cuda.forward(*layer, token_rows(hidden, E, begin2 + 256, begin2 + 300),
                                         prefill_batch({44}, {8}), &resumed);
      REQUIRE_MESSAGE(rest.error.empty(), rest.error);
      const std::vector<bf16_bits> one_pass = token_rows(run.out, E, begin2 + 256, begin2 + 300);
      CHECK(relative_error(rest.out, one_pass) <= cuda.tolerances().split_out);
      const std::size_t rw = after.recurrent_row;
      const std::vector<double> resumed_rec = resumed.recurrent(), one_pass_rec = after.recurrent();
      CHECK(
          relative_error(
              std::vector<double>(resumed_rec.begin() + 8 * rw, resumed_rec.begin() + 9 * rw),
              std::vector<double>(one_pass_rec.begin() + 2 * rw, one_pass_rec.begin() + 3 * rw)) <=
          (dtype == DType::kF32 ? cuda.tolerances().split_state : kBf16PoolTolerance));
    }
  }
}

// CUDA: checkpoints where a sequence's initial conv state is read (an empty sequence at offset 0,
// a two-token one at its length and at 0) beside many requests a sequence in any order (every 16
// tokens of 200, and its length): rows at offset 0 hold the sequence's initial states bit for bit,
// rows at a length its final states, the others the fp64 reference's states of that prefix; the
// sequences' own rows and out as without checkpoints.
KDA_LAYER_CUDA_CASE("prefill checkpoints from an empty sequence to many a sequence") {
  const layer::Config config = cuda.config(GateMode::kLowerBound, false);
  const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 71, 2));
  const auto layer = cuda.make(weights);
  const std::int64_t E = config.hidden_size;
  const SpreadRequests spread;
  const std::vector<std::int64_t>& lengths = spread.lengths;
  const std::vector<std::int64_t>& offsets = spread.offsets;
  const std::vector<std::int32_t>& rows = spread.rows;
  constexpr std::int64_t K = SpreadRequests::K;
  const BatchSpec batch = prefill_batch(lengths, spread.own);
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(batch.tokens() * E), 2.0f, 72);
  Pools before(config, SpreadRequests::kPoolRows);
  before.randomize(73);
  const DeviceBuffer offsets_dev = DeviceBuffer::from(offsets);
  const DeviceBuffer rows_dev = DeviceBuffer::from(rows);
  Pools after = before;
  const LayerRun run = cuda.forward(*layer, hidden, batch, &after,
                                    with_device_checkpoints(offsets_dev, rows_dev, K));
  REQUIRE_MESSAGE(run.error.empty(), run.error);
  CHECK(run.device_status == 0u);
  CHECK(run.guards_intact);
  Pools plain = before;
  const LayerRun plain_run = cuda.forward(*layer, hidden, batch, &plain);
  CHECK(same_bits(run.out, plain_run.out));
  for (std::int64_t r = 0; r < 3; ++r) CHECK(after.row_equal(plain, r));
  for (std::int64_t r = 0; r < SpreadRequests::kPoolRows; ++r) {
    if (!spread.named(r)) CHECK(after.row_equal(before, r));
  }

  const std::vector<std::int32_t>& own = spread.own;
  const double tolerance = cuda.tolerances().reference;
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    if (rows[i] < 0) continue;
    const std::int64_t n = static_cast<std::int64_t>(i) / K, row = rows[i];
    CAPTURE(n);
    CAPTURE(row);
    if (offsets[i] == 0) {
      CHECK(after.row_equal(before, row, own[n]));
      continue;
    }
    if (offsets[i] == lengths[static_cast<std::size_t>(n)]) {
      CHECK(after.row_equal(after, row, own[n]));
      continue;
    }
    const std::int64_t begin = batch.cu_seqlens[n];
    const LayerReference ref =
        reference_layer(weights, token_rows(hidden, E, begin, begin + offsets[i]),
                        prefill_batch({offsets[i]}, {own[n]}), before);
    check_checkpoint_row(after, row, ref, own[n], tolerance);
  }
}

// A prefill of empty sequences only: nothing computed, but each checkpoint request (offset 0, all
// such a sequence takes) holds its sequence's initial states bit for bit, as a request of an empty
// sequence beside sequences with tokens does; a padding sequence's request (a negative slot, or
// the caller's padding slot) is not read, and every other row keeps its bits. Both state dtypes,
// int64 and int32 cu_seqlens.
KDA_LAYER_CASE("a prefill of empty sequences writes their checkpoints' initial states") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 81, 0));
  const std::vector<std::int64_t> offsets = {0, -1, 0, 0, -1, -1, 0, -1};
  const std::vector<std::int32_t> rows = {4, -1, 5, 6, -1, -1, 7, -1};
  const bool on_device = runner.backend() == Backend::kCuda;
  const DeviceBuffer offsets_dev = on_device ? DeviceBuffer::from(offsets) : DeviceBuffer();
  const DeviceBuffer rows_dev = on_device ? DeviceBuffer::from(rows) : DeviceBuffer();
  const ForwardSettings requests = on_device ? with_device_checkpoints(offsets_dev, rows_dev, 2)
                                             : with_checkpoints(&offsets, &rows, 2);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const bool padding_slot : {false, true}) {
      const std::string dtype_name = to_string(dtype);
      CAPTURE(dtype_name);
      CAPTURE(padding_slot);
      // Sequence 3 is padding: slot -1, or slot 8 named as the padding slot.
      BatchSpec batch = prefill_batch({0, 0, 0, 0}, {2, 0, 1, padding_slot ? 8 : -1});
      batch.int32_cu_seqlens = padding_slot;
      ForwardSettings settings = requests;
      if (padding_slot) {
        settings.change = [base = requests.change](ForwardCall& call) {
          base(call);
          call.batch.padding_slot = 8;
        };
      }
      Pools before(config, 9, dtype);
      before.randomize(82);
      Pools after = before;
      const LayerRun run = runner.forward(*layer, {}, batch, &after, settings);
      REQUIRE_MESSAGE(run.error.empty(), run.error);
      CHECK(run.out.empty());
      CHECK(run.guards_intact);
      CHECK(run.device_status == 0u);
      CHECK(after.row_equal(before, 4, 2));
      CHECK(after.row_equal(before, 5, 0));
      CHECK(after.row_equal(before, 6, 0));
      for (const std::int64_t r : {0, 1, 2, 3, 7, 8}) {
        CAPTURE(r);
        CHECK(after.row_equal(before, r));
      }
    }
  }
}
