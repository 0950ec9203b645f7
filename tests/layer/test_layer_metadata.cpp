// The batch metadata a serving runtime hands the layer as it has it, on each backend: int32
// cu_seqlens (layer::Batch::cu_seqlens_i32) give the int64 ones' results bit for bit, and a batch
// naming both, neither or a host copy of the other dtype is refused before anything is written.
#include <doctest/doctest.h>

#include <algorithm>
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
