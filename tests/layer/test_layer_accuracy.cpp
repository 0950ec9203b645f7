// The whole layer against the fp64 reference (and, on CUDA, the CPU layer) on each backend: varlen
// batches with empty, 1- and 2-token sequences on scattered slots for both gates and both recurrent
// dtypes; conv widths with lengths around the conv history and CUDA's conv chunk, with padding
// sequences; tensor-parallel ranks summing to the whole layer (both output gate forms); a bf16
// recurrent pool against an f32 one; the full-rank output gate (Kimi K3) for both gates with and
// without a bias, in prefills and decode steps with padding rows, and against the low-rank form
// where both gates are the bias alone.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "layer_runner.hpp"

using namespace kda;
using namespace kda::test;

KDA_LAYER_CASE("matches the fp64 reference: varlen with empty, 1- and 2-token sequences") {
  for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const std::string gate_name = to_string(gate);
      const std::string dtype_name = to_string(dtype);
      CAPTURE(gate_name);
      CAPTURE(dtype_name);
      const layer::Config config = runner.config(gate);
      layer::Weights weights = layer::random_weights(config, 7, 3);
      // A g_b bias and a non-trivial o_norm: every weight matters.
      if (gate == GateMode::kLowerBound) weights = with_bias_and_norm(std::move(weights));
      const auto layer = runner.make(weights);
      // Lengths 5, 0, 1, 2, 17, 37 (the last over two CUDA conv chunks and several core chunks)
      // on rows 5, 0, 1, 3, 2, 6 of 8: rows 4 and 7 unused.
      const BatchSpec batch = prefill_batch({5, 0, 1, 2, 17, 37}, {5, 0, 1, 3, 2, 6});
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(62 * config.hidden_size), 2.0f, 11);
      Pools before(config, 8, dtype);
      before.randomize(21);  // every sequence continues from non-zero conv and recurrent states
      Pools after = before;
      const LayerRun run = runner.forward(*layer, hidden, batch, &after);
      check_forward(runner, weights, hidden, batch, before, run, after);
      // The empty sequence's row (0) and the unused rows keep their states bit for bit.
      for (std::int64_t r : {0, 4, 7}) {
        CAPTURE(r);
        CHECK(after.row_equal(before, r));
      }
    }
  }
}

// CUDA's prefill conv kernel hands each thread a chunk of 32 tokens of one sequence (kConvChunk in
// layer/src/cuda/kernels.hpp): lengths around that chunk and around the conv history (1, W-2, W-1,
// 15..17, 31..33, several chunks plus a tail), scattered slots, an unused row and two padding
// sequences (negative slots: zeros out, no state read or written). The CPU runs width 1 too (no
// conv state); CUDA's kernels run widths 2..4 and refuse the others as unsupported.
KDA_LAYER_CASE("conv widths 1-4: lengths around the conv history and chunk, padding sequences") {
  for (int width : {1, 2, 3, 4}) {
    CAPTURE(width);
    layer::Config config = runner.config();
    config.conv_width = width;
    const Status supported = layer::can_implement(runner.backend(), config);
    if (!supported.ok()) {
      MESSAGE(supported.to_string());
      CHECK(supported.code() == StatusCode::kUnsupported);
      CHECK(runner.backend() == Backend::kCuda);
      continue;
    }
    const layer::Weights weights = layer::random_weights(config, 13, 2);
    const auto layer = runner.make(weights);
    const std::int64_t W = width;
    const std::vector<std::int64_t> lengths = {
        1, std::max<std::int64_t>(W - 2, 0), W - 1, 15, 16, 17, 31, 32, 33, 101, 33, 2};
    // Rows 0..9 for the real sequences, row 10 unused; the last two sequences are padding.
    const BatchSpec batch = prefill_batch(lengths, {7, 0, 9, 2, 4, 1, 8, 3, 6, 5, -1, -3});
    const std::vector<bf16_bits> hidden =
        random_bf16(static_cast<std::size_t>(batch.tokens() * config.hidden_size), 2.0f, 17);
    Pools before(config, 11);
    before.randomize(31);
    Pools after = before;
    const LayerRun run = runner.forward(*layer, hidden, batch, &after);
    check_forward(runner, weights, hidden, batch, before, run, after);
    CHECK(after.row_equal(before, 10));
  }
}

namespace {

// The recurrent states of heads [rank * Hl, (rank + 1) * Hl) of every row of a whole layer's pool.
std::vector<float> rank_heads(const Pools& whole, const layer::Config& shard) {
  const std::int64_t Hl = shard.local_heads(), D = shard.head_dim;
  std::vector<float> states;
  for (std::int64_t n = 0; n < whole.num_slots; ++n) {
    const auto begin = whole.rec_f32.begin() + ((n * shard.num_heads + shard.tp_rank * Hl) * D * D);
    states.insert(states.end(), begin, begin + Hl * D * D);
  }
  return states;
}

// A prefill, then a decode step, through the whole layer of `full` and through its tp_size = 2
// ranks: each rank's forward against the reference, its recurrent states against the whole layer's
// for its heads, and the ranks' partial outputs summed against the whole layer's output.
void check_tensor_parallel(const LayerRunner& runner, const layer::Weights& full) {
  const layer::Config& config = full.config;
  const std::int64_t E = config.hidden_size;
  // A prefill, then a decode step on rows 0..N-1 (no slot list).
  const BatchSpec prefill = prefill_batch({11, 1, 18});
  const BatchSpec step = decode_batch(3, 1);
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(30 * E), 2.0f, 6);
  const std::vector<bf16_bits> step_in = random_bf16(static_cast<std::size_t>(3 * E), 2.0f, 7);

  const auto whole = runner.make(full);
  Pools whole_pools(config, 3);
  const Pools whole_start = whole_pools;
  const LayerRun expected = runner.forward(*whole, hidden, prefill, &whole_pools);
  check_forward(runner, full, hidden, prefill, whole_start, expected, whole_pools);
  const Pools whole_prefilled = whole_pools;
  const LayerRun expected_step = runner.forward(*whole, step_in, step, &whole_pools);
  check_forward(runner, full, step_in, step, whole_prefilled, expected_step, whole_pools);

  std::vector<double> sum(expected.out.size(), 0.0), step_sum(expected_step.out.size(), 0.0);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const layer::Weights shard = layer::shard_weights(full, 2, rank);
    const auto layer = runner.make(shard);
    Pools pools(shard.config, 3);
    const Pools start = pools;
    const LayerRun partial = runner.forward(*layer, hidden, prefill, &pools);
    check_forward(runner, shard, hidden, prefill, start, partial, pools);
    // The rank's recurrent states are the whole layer's states of its heads.
    const double prefill_state =
        relative_error(pools.rec_f32, rank_heads(whole_prefilled, shard.config));
    const Pools prefilled = pools;
    const LayerRun partial_step = runner.forward(*layer, step_in, step, &pools);
    check_forward(runner, shard, step_in, step, prefilled, partial_step, pools);
    const double step_state = relative_error(pools.rec_f32, rank_heads(whole_pools, shard.config));
    MESSAGE("rank " << rank << " recurrent states vs the whole layer's heads: after the prefill "
                    << prefill_state << ", after the step " << step_state);
    CHECK(prefill_state <= runner.tolerances().split_state);
    CHECK(step_state <= runner.tolerances().split_state);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += bf16_to_float(partial.out[i]);
    for (std::size_t i = 0; i < step_sum.size(); ++i) {
      step_sum[i] += bf16_to_float(partial_step.out[i]);
    }
  }
  const double error = relative_error(sum, to_doubles(expected.out));
  const double step_error = relative_error(step_sum, to_doubles(expected_step.out));
  MESSAGE("tp 2 sum vs tp 1: prefill " << error << ", decode step " << step_error);
  CHECK(error <= runner.tolerances().reference);
  CHECK(step_error <= runner.tolerances().reference);
}

}  // namespace

KDA_LAYER_CASE("tensor parallel: the tp_size = 2 ranks' partial outputs sum to the whole layer") {
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    const layer::Config config = runner.config(GateMode::kSoftplus, full_rank);
    const layer::Weights full = with_bias_and_norm(layer::random_weights(config, 5, 4));
    // A rank holds the rows of its heads of the full-rank gate, the whole low-rank first factor.
    const layer::Weights rank1 = layer::shard_weights(full, 2, 1);
    const std::size_t half = full.g_proj.size() / 2;
    CHECK(rank1.g_proj.size() == half);
    CHECK(std::equal(rank1.g_proj.begin(), rank1.g_proj.end(), full.g_proj.begin() + half));
    CHECK(rank1.g_a_proj == full.g_a_proj);
    check_tensor_parallel(runner, full);
  }
}

KDA_LAYER_CASE("a bf16 recurrent state pool runs the same layer within bf16 accuracy") {
  const layer::Config config = runner.config();
  const layer::Weights weights = layer::random_weights(config, 6, 1);
  const auto layer = runner.make(weights);
  const BatchSpec batch = prefill_batch({9, 1, 14});
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(24 * config.hidden_size), 2.0f, 2);
  Pools f32(config, 3, DType::kF32), bf16(config, 3, DType::kBF16);
  const Pools f32_start = f32, bf16_start = bf16;
  const LayerRun expected = runner.forward(*layer, hidden, batch, &f32);
  check_forward(runner, weights, hidden, batch, f32_start, expected, f32);
  const LayerRun run = runner.forward(*layer, hidden, batch, &bf16);
  check_forward(runner, weights, hidden, batch, bf16_start, run, bf16);
  CHECK(relative_error(run.out, expected.out) <= kBf16PoolTolerance);
  CHECK(relative_error(bf16.recurrent(), f32.recurrent()) <= kBf16PoolTolerance);
  // The conv states do not depend on the recurrent pool's dtype.
  CHECK(same_bits(bf16.conv_q, f32.conv_q));
  CHECK(same_bits(bf16.conv_k, f32.conv_k));
  CHECK(same_bits(bf16.conv_v, f32.conv_v));
}

// Kimi K3's output gate: one full-rank projection g_proj [C, E] in place of g_a_proj, g_b_proj.
KDA_LAYER_CASE(
    "the full-rank output gate matches the fp64 reference: prefill and decode, padding") {
  for (GateMode gate : {GateMode::kSoftplus, GateMode::kLowerBound}) {
    for (const bool bias : {false, true}) {
      const std::string gate_name = to_string(gate);
      CAPTURE(gate_name);
      CAPTURE(bias);
      const layer::Config config = runner.config(gate, true);
      layer::Weights weights = layer::random_weights(config, 17, 5);
      REQUIRE(weights.g_proj.size() ==
              static_cast<std::size_t>(config.local_channels() * config.hidden_size));
      REQUIRE(weights.g_a_proj.empty());
      REQUIRE(weights.g_b_proj.empty());
      if (bias) weights = with_bias_and_norm(std::move(weights));
      const auto layer = runner.make(weights);
      const std::int64_t E = config.hidden_size;

      // A varlen prefill on scattered slots with an empty and a padding sequence: rows 4 and 6
      // of 7 unused.
      const BatchSpec prefill = prefill_batch({5, 0, 1, 17, 3, 37}, {5, 0, 1, 2, -1, 3});
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(prefill.tokens() * E), 2.0f, 23);
      Pools before(config, 7);
      before.randomize(24);
      Pools pools = before;
      const LayerRun run = runner.forward(*layer, hidden, prefill, &pools);
      check_forward(runner, weights, hidden, prefill, before, run, pools);

      // Decode steps continuing those sequences: one token of one sequence (on CUDA, the
      // small-row kernel's products), then one and two tokens of three rows and a padding row.
      for (const BatchSpec& step : {decode_batch(1, 1, {2}), decode_batch(4, 1, {5, -1, 3, 0}),
                                    decode_batch(4, 2, {3, 2, -2, 5})}) {
        CAPTURE(step.sequences());
        CAPTURE(step.decode_tokens);
        const std::vector<bf16_bits> in =
            random_bf16(static_cast<std::size_t>(step.tokens() * E), 2.0f, 25 + step.tokens());
        const Pools step_before = pools;
        const LayerRun step_run = runner.forward(*layer, in, step, &pools);
        check_forward(runner, weights, in, step, step_before, step_run, pools);
      }
    }
  }
}

// With every output gate matrix zero the gate is the bias alone, whichever its form: a full-rank
// layer and a low-rank one of the same other weights compute the same layer. On the CPU bit for
// bit (the rest of the arithmetic is the same); CUDA's fused input GEMM has other widths in the
// two forms (its kernels may sum in another order), so within its tolerance.
KDA_LAYER_CASE("a zero gate matrix: the full-rank and the low-rank layer are the same layer") {
  const layer::Config low_config = runner.config(GateMode::kLowerBound);
  layer::Weights low = with_bias_and_norm(layer::random_weights(low_config, 8, 6));
  std::fill(low.g_b_proj.begin(), low.g_b_proj.end(), bf16_bits{0});
  layer::Weights full = low;
  full.config.full_rank_gate = true;
  full.g_a_proj.clear();
  full.g_b_proj.clear();
  full.g_proj.assign(static_cast<std::size_t>(low_config.local_channels() * low_config.hidden_size),
                     bf16_bits{0});
  const BatchSpec batch = prefill_batch({9, 1, 14}, {2, 0, 1});
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(batch.tokens() * low_config.hidden_size), 2.0f, 26);
  Pools before(low_config, 3);
  before.randomize(27);
  Pools low_pools = before, full_pools = before;
  const LayerRun low_run = runner.forward(*runner.make(low), hidden, batch, &low_pools);
  const LayerRun full_run = runner.forward(*runner.make(full), hidden, batch, &full_pools);
  check_forward(runner, full, hidden, batch, before, full_run, full_pools);
  REQUIRE_MESSAGE(low_run.error.empty(), low_run.error);
  const double error = relative_error(full_run.out, low_run.out);
  MESSAGE(runner.name() << ": full-rank vs low-rank layer, zero gate matrices: out " << error);
  if (runner.backend() == Backend::kCpu) {
    CHECK(same_bits(full_run.out, low_run.out));
    CHECK(full_pools == low_pools);
  } else {
    CHECK(error <= kCudaVsCpuTolerance);
    CHECK(relative_error(full_pools.recurrent(), low_pools.recurrent()) <= kCudaVsCpuTolerance);
  }
  // The bias is what the gate is: without it the output changes.
  full.g_b_bias.clear();
  Pools unbiased_pools = before;
  const LayerRun unbiased = runner.forward(*runner.make(full), hidden, batch, &unbiased_pools);
  REQUIRE_MESSAGE(unbiased.error.empty(), unbiased.error);
  const double bias_effect = relative_error(unbiased.out, full_run.out);
  MESSAGE("without the bias: out changes by " << bias_effect);
  CHECK(bias_effect > 0.05);
}

KDA_LAYER_CPU_CASE("the CPU layer gives the same bits on 1, 2, 3 or all threads") {
  // The projections run in blocks of 256 output columns on RunOptions::cpu_threads threads, as the
  // core runs its (sequence, head) pairs: neither may depend on the thread count. A layer wide
  // enough for three or more blocks in q, k, v, f_b (768 columns each) and o_proj (640: two whole
  // blocks and a narrower one), and a prefill long enough that 0 (all threads) starts more than one
  // on a machine that has them; 3 runs more threads than blocks of some projections.
  LayerRunner& runner = cpu_layer_runner();
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    layer::Config config = runner.config(GateMode::kSoftplus, full_rank);
    config.hidden_size = 640;
    config.num_heads = 12;
    config.head_dim = 64;
    const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 61, 2));
    const auto layer = runner.make(weights);
    const std::int64_t E = config.hidden_size;
    for (const bool decode : {false, true}) {
      CAPTURE(decode);
      const BatchSpec batch =
          decode ? decode_batch(3, 1, {2, 0, 1}) : prefill_batch({29, 0, 6}, {2, 0, 1});
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(batch.tokens() * E), 2.0f, 62);
      Pools before(config, 3);
      before.randomize(63);
      std::vector<LayerRun> runs;
      std::vector<Pools> pools;
      for (const int threads : {1, 2, 3, 0}) {
        CAPTURE(threads);
        Pools after = before;
        ForwardSettings settings;
        settings.change = [threads](ForwardCall& call) { call.options.cpu_threads = threads; };
        runs.push_back(runner.forward(*layer, hidden, batch, &after, settings));
        REQUIRE_MESSAGE(runs.back().error.empty(), runs.back().error);
        CHECK(runs.back().all_written);
        pools.push_back(after);
      }
      for (std::size_t i = 1; i < runs.size(); ++i) {
        CAPTURE(i);
        CHECK(same_bits(runs[i].out, runs[0].out));
        CHECK(pools[i] == pools[0]);
      }
      CHECK(pools[0] != before);  // the forward did update the states
    }
  }
}
