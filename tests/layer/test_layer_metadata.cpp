// The batch metadata a serving runtime hands the layer as it has it, on each backend: int32
// cu_seqlens (layer::Batch::cu_seqlens_i32) give the int64 ones' results bit for bit, and a batch
// naming both, neither or a host copy of the other dtype is refused before anything is written; a
// caller-chosen null row (layer::Batch::padding_slot) is padding exactly as a negative slot.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "layer_runner.hpp"

using namespace kda;
using namespace kda::test;

namespace {

bool contains(const std::string& text, const char* part) {
  INFO(text);
  return text.find(part) != std::string::npos;
}

}  // namespace

// One varlen prefill (an empty sequence, a padding one, one longer than a chunk) from non-zero
// states, with and without host copies: the int32 batch equals the int64 one in out and every pool
// byte. Without host copies CUDA plans from the device values alone, the same plan both ways.
KDA_LAYER_CASE("int32 cu_seqlens give the int64 ones' results bit for bit") {
  const layer::Weights weights =
      with_bias_and_norm(layer::random_weights(runner.config(GateMode::kLowerBound), 6, 1));
  const std::unique_ptr<layer::Layer> layer = runner.make(weights);
  const std::int64_t E = weights.config.hidden_size;
  const BatchSpec wide = prefill_batch({5, 0, 37, 3, 18}, {3, 1, 0, -1, 4});
  BatchSpec narrow = wide;
  narrow.int32_cu_seqlens = true;
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(wide.tokens() * E), 2.0f, 61);
  Pools before(weights.config, 5, DType::kF32);
  before.randomize(62);
  for (const bool host_copies : {true, false}) {
    CAPTURE(host_copies);
    ForwardSettings settings;
    settings.host_copies = host_copies;
    Pools after_wide = before, after_narrow = before;
    const LayerRun a = runner.forward(*layer, hidden, wide, &after_wide, settings);
    const LayerRun b = runner.forward(*layer, hidden, narrow, &after_narrow, settings);
    REQUIRE_MESSAGE(a.error.empty(), a.error);
    REQUIRE_MESSAGE(b.error.empty(), b.error);
    CHECK(b.device_status == 0);
    CHECK(b.all_written);
    CHECK(b.guards_intact);
    CHECK(same_bits(a.out, b.out));
    CHECK(after_narrow == after_wide);
    CHECK(after_narrow != before);  // the batch did move states
    if (host_copies) check_forward(runner, weights, hidden, narrow, before, b, after_narrow);
  }
}

KDA_LAYER_CASE(
    "a prefill naming both cu_seqlens dtypes, neither, or a mismatched host copy is "
    "refused") {
  const layer::Weights weights = layer::random_weights(runner.config(), 7, 1);
  const std::unique_ptr<layer::Layer> layer = runner.make(weights);
  const std::int64_t E = weights.config.hidden_size;
  const BatchSpec batch = prefill_batch({4, 9}, {1, 0});
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(batch.tokens() * E), 1.0f, 63);
  Pools before(weights.config, 2, DType::kF32);
  before.randomize(64);
  const std::vector<std::int32_t> host_i32(batch.cu_seqlens.begin(), batch.cu_seqlens.end());
  ForwardSettings both;
  both.change = [](ForwardCall& c) {
    // Any non-null pointer: the check comes before anything reads it.
    c.batch.cu_seqlens_i32 = reinterpret_cast<const std::int32_t*>(c.batch.cu_seqlens);
  };
  CHECK(contains(check_refused(runner, *layer, hidden, batch, before, both).error,
                 "cu_seqlens (int64) and cu_seqlens_i32 are both set"));
  ForwardSettings neither;
  neither.change = [](ForwardCall& c) { c.batch.cu_seqlens = nullptr; };
  CHECK(contains(check_refused(runner, *layer, hidden, batch, before, neither).error,
                 "cu_seqlens is null, and so is cu_seqlens_i32"));
  BatchSpec narrow = batch;
  narrow.int32_cu_seqlens = true;
  ForwardSettings wide_copy;
  wide_copy.change = [&](ForwardCall& c) {
    c.batch.cu_seqlens_host_i32 = nullptr;
    c.batch.cu_seqlens_host = batch.cu_seqlens.data();
  };
  CHECK(contains(check_refused(runner, *layer, hidden, narrow, before, wide_copy).error,
                 "another dtype"));
  ForwardSettings narrow_copy;
  narrow_copy.change = [&](ForwardCall& c) {
    c.batch.cu_seqlens_host = nullptr;
    c.batch.cu_seqlens_host_i32 = host_i32.data();
  };
  CHECK(contains(check_refused(runner, *layer, hidden, batch, before, narrow_copy).error,
                 "another dtype"));
  // Broken int32 offsets where the host can read them: named as the int64 ones are.
  BatchSpec broken = narrow;
  broken.cu_seqlens = {0, 9, 4};
  CHECK(
      contains(check_refused(runner, *layer, hidden, broken, before, {}).error, "non-decreasing"));
}

namespace {

// Row `r` of every pool set to all-ones bytes (NaN in bf16 and f32): a forward that read it would
// put NaN into out, one that wrote it would change its bytes.
void poison_row(Pools* pools, std::int64_t r) {
  auto fill = [r](auto& pool, std::size_t row) {
    std::memset(pool.data() + r * row, 0xFF, row * sizeof(pool[0]));
  };
  fill(pools->conv_q, pools->conv_row);
  fill(pools->conv_k, pools->conv_row);
  fill(pools->conv_v, pools->conv_row);
  if (pools->dtype == DType::kF32) {
    fill(pools->rec_f32, pools->recurrent_row);
  } else {
    fill(pools->rec_bf16, pools->recurrent_row);
  }
}

// `batch` with every slots entry equal to `null` made -1, and no padding_slot.
BatchSpec with_negative_padding(BatchSpec batch, std::int32_t null) {
  for (std::int32_t& s : batch.slots) s = s == null ? -1 : s;
  batch.padding_slot = -1;
  return batch;
}

}  // namespace

// A caller-chosen null row (layer::Batch::padding_slot = 0, as vLLM's null slot) in a prefill, in
// decode steps of 1 and 3 tokens (named by two rows at once) and in a verify step (a padding start
// entry, a per-token entry not kept): the null row's states, poisoned, keep every byte and are
// never read (out holds no NaN); its rows output zeros; out and every pool equal, bit for bit, the
// same batch padded with negative slots instead. Both recurrent dtypes, both decode kernels.
KDA_LAYER_CASE("a padding_slot entry is padding: zeros out, no state of any row touched") {
  const layer::Weights weights =
      with_bias_and_norm(layer::random_weights(runner.config(GateMode::kLowerBound), 8, 1));
  const std::unique_ptr<layer::Layer> layer = runner.make(weights);
  const std::int64_t E = weights.config.hidden_size;
  constexpr std::int32_t kNull = 0;
  std::vector<BatchSpec> batches = {
      prefill_batch({5, 3, 0, 7, 2, 20}, {1, 0, 3, 4, 0, 2}),
      decode_batch(4, 1, {2, 0, 0, 4}),
      decode_batch(4, 3, {0, 3, 0, 1}),
  };
  BatchSpec verify = decode_batch(3, 2, {1, 0, 0, 0, 3, 4});
  verify.num_accepted = {1, 2, 2};  // row 0 from 1 (its token 1 not kept), row 1 padding
  batches.push_back(verify);
  for (BatchSpec& b : batches) b.padding_slot = kNull;
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const layer::DecodeKernel kernel :
         {layer::DecodeKernel::kAuto, layer::DecodeKernel::kSeparate}) {
      for (std::size_t i = 0; i < batches.size(); ++i) {
        const BatchSpec& padded = batches[i];
        if (padded.decode_tokens == 0 && kernel != layer::DecodeKernel::kAuto) continue;
        CAPTURE(i);
        const std::string dtype_name = to_string(dtype);
        CAPTURE(dtype_name);
        CAPTURE(static_cast<int>(kernel));
        ForwardSettings settings;
        settings.change = [kernel](ForwardCall& call) { call.options.decode_kernel = kernel; };
        const std::vector<bf16_bits> hidden =
            random_bf16(static_cast<std::size_t>(padded.tokens() * E), 2.0f, 70 + i);
        Pools before(weights.config, 5, dtype);
        before.randomize(71);
        poison_row(&before, kNull);
        Pools after = before, negative_after = before;
        const LayerRun run = runner.forward(*layer, hidden, padded, &after, settings);
        REQUIRE_MESSAGE(run.error.empty(), run.error);
        const LayerRun negative = runner.forward(
            *layer, hidden, with_negative_padding(padded, kNull), &negative_after, settings);
        REQUIRE_MESSAGE(negative.error.empty(), negative.error);
        CHECK(run.device_status == 0);
        CHECK(run.all_written);  // no NaN: the poisoned row was not read
        CHECK(run.guards_intact);
        CHECK(after.row_equal(before, kNull));
        CHECK(after != before);  // the other rows did move
        CHECK(same_bits(run.out, negative.out));
        CHECK(after == negative_after);
        // The padding rows' out: zeros (a verify row is padding by its start entry).
        const std::int64_t per_row = padded.num_accepted.empty() ? 1 : padded.decode_tokens;
        for (std::int64_t n = 0; n < padded.sequences(); ++n) {
          const std::int64_t start =
              n * per_row + (padded.num_accepted.empty() ? 0 : padded.num_accepted[n] - 1);
          if (padded.slots[start] != kNull) continue;
          CAPTURE(n);
          const std::vector<bf16_bits> rows =
              token_rows(run.out, E, padded.cu_seqlens[n], padded.cu_seqlens[n + 1]);
          CHECK(std::all_of(rows.begin(), rows.end(), [](bf16_bits b) { return b == 0; }));
        }
      }
    }
  }
}

KDA_LAYER_CASE("a padding_slot outside the pool or without slots is refused") {
  const layer::Weights weights = layer::random_weights(runner.config(), 9, 1);
  const std::unique_ptr<layer::Layer> layer = runner.make(weights);
  const std::int64_t E = weights.config.hidden_size;
  Pools before(weights.config, 3, DType::kF32);
  before.randomize(72);
  BatchSpec outside = decode_batch(2, 1, {0, 1});
  outside.padding_slot = 3;
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(2 * E), 1.0f, 73);
  CHECK(contains(check_refused(runner, *layer, hidden, outside, before, {}).error,
                 "padding_slot 3 is outside [0, num_slots = 3)"));
  BatchSpec rows = decode_batch(2, 1);
  rows.padding_slot = 1;
  CHECK(contains(check_refused(runner, *layer, hidden, rows, before, {}).error,
                 "padding_slot 1 needs slots"));
  rows.padding_slot = 0;  // the first entry is a slots entry too
  CHECK(contains(check_refused(runner, *layer, hidden, rows, before, {}).error,
                 "padding_slot 0 needs slots (it names a slots entry)"));
  // Several sequences may name it; two naming another row still may not.
  BatchSpec twice = prefill_batch({1, 1}, {2, 2});
  twice.padding_slot = 0;
  CHECK(contains(check_refused(runner, *layer, hidden, twice, before, {}).error, "share slot 2"));
}
