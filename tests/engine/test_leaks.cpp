// Leaks on the CPU path: create an Engine on examples/models/tiny.yaml, run 1000 small forwards
// (prefill of a few tokens + one decode step, every KDA layer), destroy it; three times. The heap
// in use must come back to its baseline after each round and must not grow while an engine runs,
// and the resident set must not keep the arena. Heap in use: mallinfo2() on glibc (uordblks +
// hblkhd: small chunks and mmap-ed blocks), the allocator's own count under AddressSanitizer (which
// replaces malloc).
#include <doctest/doctest.h>

#include <unistd.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define KDA_LEAKS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KDA_LEAKS_ASAN 1
#endif
#endif

#if defined(KDA_LEAKS_ASAN)
// From <sanitizer/allocator_interface.h>, which GCC does not install.
extern "C" std::size_t __sanitizer_get_current_allocated_bytes(void);
#elif defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#include <malloc.h>
#define KDA_LEAKS_MALLINFO2 1
#endif

#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda_reference.hpp"

using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;

namespace {

constexpr int kRounds = 3;
constexpr int kForwards = 1000;
constexpr std::int64_t kPrefillTokens = 3;
// Heap bytes that may differ between two measurements without a leak (allocator bookkeeping,
// one-time initialisation inside the standard library). A leak of one byte per forward, or of any
// engine-sized buffer, is far above it.
constexpr long long kHeapTolerance = 4 * 1024;
constexpr long long kRssTolerance = 4 * 1024 * 1024;

// Heap bytes in use; -1 where this platform cannot tell.
long long heap_in_use() {
#if defined(KDA_LEAKS_ASAN)
  return static_cast<long long>(__sanitizer_get_current_allocated_bytes());
#elif defined(KDA_LEAKS_MALLINFO2)
  // Chunks in use in the arenas plus large blocks served by mmap (the engine's arena is one).
  const struct mallinfo2 info = mallinfo2();
  return static_cast<long long>(info.uordblks) + static_cast<long long>(info.hblkhd);
#else
  return -1;
#endif
}

// Resident set size in bytes (Linux); -1 elsewhere, and under AddressSanitizer, whose quarantine
// keeps freed memory resident on purpose.
long long resident_bytes() {
#if defined(KDA_LEAKS_ASAN)
  return -1;
#else
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return -1;
  long long total_pages = 0, resident_pages = -1;
  if (std::fscanf(statm, "%lld %lld", &total_pages, &resident_pages) != 2) resident_pages = -1;
  std::fclose(statm);
  return resident_pages < 0 ? -1 : resident_pages * static_cast<long long>(sysconf(_SC_PAGESIZE));
#endif
}

// bf16 inputs for `tokens` tokens of the model ([tokens, H, D], beta [tokens, H]).
struct Inputs {
  std::vector<std::uint16_t> q, k, v, g, beta;
  Inputs(std::int64_t tokens, std::int64_t heads, std::int64_t dim, std::uint64_t seed) {
    kda::test::Rng rng(seed);
    q = kda::test::random_bf16(rng, tokens * heads * dim, 1.0);
    k = kda::test::random_bf16(rng, tokens * heads * dim, 1.0);
    v = kda::test::random_bf16(rng, tokens * heads * dim, 1.0);
    g = kda::test::random_bf16(rng, tokens * heads * dim, 1.0);
    beta = kda::test::random_bf16(rng, tokens * heads, 1.0);
  }
  LayerInputs layer_inputs() const {
    return LayerInputs{q.data(), k.data(), v.data(), g.data(), beta.data()};
  }
};

struct Round {
  long long heap_after_first = 0;    // while the engine lives, after its first forward
  long long heap_after_last = 0;     // ... and after its last
  long long heap_after_destroy = 0;  // once it is gone
  long long rss_after_destroy = 0;
  std::vector<std::uint16_t> first_out, last_out;  // decode output of the first and last forward
};

// One round: engine, kForwards forwards on a fresh slot each, engine destroyed. Everything the
// round needs outside the engine (inputs, outputs, `round` itself) is allocated before it starts,
// so the heap measurements see the engine alone.
void run_round(const kda::engine::ModelSpec& spec, const Inputs& prefill, const Inputs& decode,
               std::vector<std::uint16_t>* prefill_out, std::vector<std::uint16_t>* decode_out,
               Round* round) {
  const std::vector<std::int64_t> cu_seqlens = {0, kPrefillTokens};
  std::vector<int> slots(1);
  {
    EngineOptions options;
    options.backend = kda::engine::BackendChoice::kCpu;
    options.cpu_threads = 1;
    options.seed = 7;
    Engine engine(spec, options);
    for (int forward = 0; forward < kForwards; ++forward) {
      slots[0] = engine.acquire_slot();
      for (int layer = 0; layer < engine.num_layers(); ++layer) {
        engine.prefill(layer, prefill.layer_inputs(), prefill_out->data(), slots, cu_seqlens);
      }
      for (int layer = 0; layer < engine.num_layers(); ++layer) {
        engine.decode(layer, decode.layer_inputs(), decode_out->data(), slots, 1);
      }
      engine.release_slot(slots[0]);
      if (forward == 0) {
        round->heap_after_first = heap_in_use();
        round->first_out.assign(decode_out->begin(), decode_out->end());  // capacity reserved
      }
    }
    round->heap_after_last = heap_in_use();
    round->last_out.assign(decode_out->begin(), decode_out->end());
  }
  round->heap_after_destroy = heap_in_use();
  round->rss_after_destroy = resident_bytes();
}

}  // namespace

TEST_CASE(
    "leaks: create / 1000 forwards / destroy x3 on the CPU returns the heap to its baseline") {
  const kda::engine::ModelSpec spec =
      kda::engine::load_model_spec(std::string(KDA_SOURCE_DIR) + "/examples/models/tiny.yaml");
  const std::int64_t heads = spec.num_heads, dim = spec.head_dim;
  const Inputs prefill(kPrefillTokens, heads, dim, 1001);
  const Inputs decode(1, heads, dim, 1002);
  std::vector<std::uint16_t> prefill_out(static_cast<std::size_t>(kPrefillTokens * heads * dim));
  std::vector<std::uint16_t> decode_out(static_cast<std::size_t>(heads * dim));

  std::vector<Round> rounds(kRounds + 1);  // [0]: a warm-up round
  for (Round& round : rounds) {
    round.first_out.reserve(decode_out.size());
    round.last_out.reserve(decode_out.size());
  }
  // The warm-up round runs before the baseline is taken: one-time allocations of the standard
  // library and the backend (locale data, thread bookkeeping) belong to the baseline, not to a
  // round.
  run_round(spec, prefill, decode, &prefill_out, &decode_out, &rounds[0]);
  const long long heap_baseline = heap_in_use();
  const long long rss_baseline = resident_bytes();
  for (int r = 1; r <= kRounds; ++r) {
    run_round(spec, prefill, decode, &prefill_out, &decode_out,
              &rounds[static_cast<std::size_t>(r)]);
  }

  // 0 bytes in use is no statistic: malloc has been replaced (valgrind), and then the resident set
  // says nothing about the engine either.
  const bool heap_known = heap_baseline > 0;
  if (!heap_known) {
    MESSAGE(
        "no heap statistics here (other platform, or malloc replaced): only the outputs are "
        "checked");
  }
  for (int r = 1; r <= kRounds; ++r) {
    const Round& round = rounds[static_cast<std::size_t>(r)];
    CAPTURE(r);
    CAPTURE(heap_baseline);
    CAPTURE(round.heap_after_first);
    CAPTURE(round.heap_after_last);
    CAPTURE(round.heap_after_destroy);
    // Same inputs on a fresh slot every time: every forward of every engine gives the same bits.
    CHECK(round.first_out == round.last_out);
    CHECK(round.last_out == rounds[0].first_out);  // the warm-up round's
    CHECK(kda::test::all_finite(round.last_out));
    if (heap_known) {
      // Nothing accumulates while an engine runs ...
      CHECK(round.heap_after_last - round.heap_after_first <= kHeapTolerance);
      // ... and everything the engine held is released with it.
      CHECK(round.heap_after_destroy - heap_baseline <= kHeapTolerance);
      CHECK(heap_baseline - round.heap_after_destroy <= kHeapTolerance);
    }
    if (heap_known && rss_baseline >= 0 && round.rss_after_destroy >= 0) {
      CAPTURE(rss_baseline);
      CAPTURE(round.rss_after_destroy);
      CHECK(round.rss_after_destroy - rss_baseline <= kRssTolerance);
    }
  }
  // The engine itself is not small: had it leaked, the heap check would have seen it.
  CHECK(Engine::plan_for(spec, kda::Backend::kCpu).arena_bytes > 1024 * 1024);
}
