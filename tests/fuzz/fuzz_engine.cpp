// libFuzzer harness for the engine's batch metadata on the CPU backend: a tiny model of two whole
// KDA layers, and a sequence of up to six calls a serving runtime makes on it — prefills (varlen,
// padding, checkpoint requests), decode steps (plain, speculative verify with per-token states,
// records, folds of a records step), commits, slot copies, resets, releases and acquires — each
// with metadata the input chooses, valid or not.
//
// Two engines of the same model and weights run every call in lockstep, one CPU thread and three.
// Contract under test (kda/engine/engine.hpp; docs/API.md): kda::Error is the only failure; both
// engines accept or refuse the same call; a refused call changes no slot's states and writes
// nothing into out; an accepted one changes only the states of slots it names, gives the padding
// rows' out zeros, finite values elsewhere, and the same bits on both engines. Anything else is a
// finding (abort, so that libFuzzer keeps the input).
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"

namespace {

using kda::engine::BatchMetadata;
using kda::engine::Engine;
using kda::fuzz::expect;
using kda::fuzz::finding;
using kda::fuzz::metadata_array;
using kda::fuzz::metadata_value;

constexpr int kSlots = 6;
constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kMaxTokens = 40;

// Two whole layers, H = 2, D = 8, W = 3; records of up to 4 tokens in two regions.
std::string model_text(bool bf16_state, bool bounded_gate) {
  return std::string("name: fuzz-engine\nhidden_size: 16\nnum_hidden_layers: 2\n") +
         "linear_attn_config: {num_heads: 2, head_dim: 8, short_conv_kernel_size: 3, " +
         "kda_layers: [1, 2], " +
         (bounded_gate ? "gate: lower_bound, gate_lower_bound: -5.0}\n" : "gate: softplus}\n") +
         "runtime: {max_tokens: 40, max_sequences: 6, max_verify_tokens: 4, record_regions: 2, " +
         "backend: cpu, state_dtype: " + (bf16_state ? "bf16" : "fp32") + "}\n";
}

// Slots for `count` rows: distinct acquired ones in an order the input picks (what most batches
// are), or any values.
std::vector<std::int32_t> slot_array(FuzzedDataProvider& in, std::int64_t count,
                                     const std::vector<std::int32_t>& acquired) {
  if (count > static_cast<std::int64_t>(acquired.size()) ||
      in.ConsumeIntegralInRange<int>(0, 3) == 3) {
    return metadata_array(in, count, kSlots);
  }
  std::vector<std::int32_t> all = acquired;
  for (std::size_t i = all.size(); i > 1; --i) {
    std::swap(all[i - 1], all[in.ConsumeIntegralInRange<std::size_t>(0, i - 1)]);
  }
  all.resize(static_cast<std::size_t>(count > 0 ? count : 0));
  if (!all.empty() && in.ConsumeBool()) all[0] = -1;  // a padding row
  return all;
}

std::int64_t rows_of(FuzzedDataProvider& in) {
  return in.PickValueInArray<std::int64_t>({1, 1, 2, 2, 3, 4, 5, 0, kSlots + 1});
}

using States = std::vector<std::vector<std::uint8_t>>;  // every slot's sequence-state block

States states_of(const Engine& engine) {
  States all(kSlots);
  for (int s = 0; s < kSlots; ++s) {
    all[static_cast<std::size_t>(s)].resize(engine.sequence_state_bytes());
    engine.read_sequence_state(s, all[static_cast<std::size_t>(s)].data(),
                               engine.sequence_state_bytes());
  }
  return all;
}

bool padding(std::int32_t slot, int null_slot) { return slot < 0 || slot == null_slot; }

// One call, as both engines make it: its metadata, its hidden states, and what it may change.
struct Call {
  enum Kind { kPrefill, kDecode, kCommit, kCopy, kReset, kRelease } kind = kPrefill;
  BatchMetadata batch;
  std::vector<std::int32_t> slots, accepted, checkpoint_slots, fold_rows, fold_counts, dst;
  std::vector<std::int64_t> cu_seqlens, checkpoint_offsets;
  std::vector<std::int32_t> cu_seqlens_i32;
  std::vector<kda::bf16_bits> hidden;
  int region = 0;
  std::int64_t count = 0;  // commit rows, copy pairs, reset entries

  // Every slot the call names (any array): the only ones whose states may change.
  std::set<std::int64_t> named() const {
    std::set<std::int64_t> all;
    for (const auto* a : {&slots, &checkpoint_slots, &dst}) {
      for (const std::int32_t s : *a) all.insert(s);
    }
    return all;
  }
};

// The last records step each region holds (both layers ran it): what a commit or a fold takes.
struct RecordsStep {
  std::int64_t rows = 0;
  int tokens = 0;
  std::vector<std::int32_t> slots;
};

// Counts in 1..tokens, now and then out of range.
std::vector<std::int32_t> accepted_counts(FuzzedDataProvider& in, std::int64_t rows, int tokens) {
  std::vector<std::int32_t> a;
  for (std::int64_t r = 0; r < rows; ++r) {
    a.push_back(in.ConsumeIntegralInRange<int>(0, 7) == 7
                    ? metadata_value(in, tokens + 1)
                    : in.ConsumeIntegralInRange<std::int32_t>(1, tokens > 0 ? tokens : 1));
  }
  return a;
}

// What follows a records step: a runtime commits it or folds it into the next step; made so
// more often than the input's bytes alone would.
enum class FollowUp { kNone, kCommit, kFold };

Call make_call(FuzzedDataProvider& in, std::mt19937& rng, const std::vector<std::int32_t>& acquired,
               const RecordsStep (&records)[2], FollowUp follow_up) {
  Call c;
  c.kind = follow_up == FollowUp::kCommit ? Call::kCommit
           : follow_up == FollowUp::kFold
               ? Call::kDecode
               : static_cast<Call::Kind>(in.ConsumeIntegralInRange<int>(0, 5));
  BatchMetadata& b = c.batch;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  switch (c.kind) {
    case Call::kPrefill: {
      b.sequences = rows_of(in);
      c.cu_seqlens.push_back(0);
      for (std::int64_t s = 0; s < b.sequences; ++s) {
        c.cu_seqlens.push_back(c.cu_seqlens.back() +
                               in.PickValueInArray<std::int64_t>({0, 1, 2, 3, 5, 16, 17}));
      }
      b.tokens = c.cu_seqlens.back();
      if (in.ConsumeIntegralInRange<int>(0, 7) == 7) {  // a broken entry or total
        c.cu_seqlens[in.ConsumeIntegralInRange<std::size_t>(0, c.cu_seqlens.size() - 1)] =
            metadata_value(in, b.tokens + 1);
      }
      if (in.ConsumeIntegralInRange<int>(0, 7) == 7) b.tokens = metadata_value(in, kMaxTokens);
      c.slots = slot_array(in, b.sequences, acquired);
      if (in.ConsumeBool()) {
        for (const std::int64_t v : c.cu_seqlens) {
          c.cu_seqlens_i32.push_back(static_cast<std::int32_t>(v));
        }
      }
      if (in.ConsumeIntegralInRange<int>(0, 3) == 3) {
        b.checkpoints = in.ConsumeIntegralInRange<std::int64_t>(1, 2);
        for (std::int64_t i = 0; i < b.sequences * b.checkpoints; ++i) {
          c.checkpoint_offsets.push_back(
              in.PickValueInArray<std::int64_t>({-1, 0, 16, 17, 3, metadata_value(in, 20)}));
          c.checkpoint_slots.push_back(metadata_value(in, kSlots));
        }
      }
      break;
    }
    case Call::kDecode: {
      b.sequences = rows_of(in);
      b.decode_tokens = in.PickValueInArray<int>({1, 1, 2, 4, 5, 0, 17});
      const int form = follow_up == FollowUp::kFold
                           ? in.PickValueInArray({2, 0})
                           : in.PickValueInArray({2, 0, 1});  // records, plain, verify
      const std::int64_t T = b.decode_tokens > 0 ? b.decode_tokens : 0;
      b.tokens = b.sequences * T;
      c.slots = form == 1 ? metadata_array(in, b.sequences * T, kSlots)
                          : slot_array(in, b.sequences, acquired);
      if (form == 1) {
        for (std::int64_t r = 0; r < b.sequences; ++r) {
          c.accepted.push_back(in.ConsumeIntegralInRange<int>(0, 7) == 7
                                   ? metadata_value(in, T + 1)
                                   : in.ConsumeIntegralInRange<std::int32_t>(
                                         1, static_cast<std::int32_t>(T > 0 ? T : 1)));
        }
      }
      b.records = form == 2;
      b.records_region = in.ConsumeIntegralInRange<int>(0, 1);
      if (form != 1 && (follow_up == FollowUp::kFold || in.ConsumeBool())) {  // a fold
        b.fold_region = follow_up == FollowUp::kFold && records[0].rows == 0
                            ? 1
                            : in.ConsumeIntegralInRange<int>(0, 1);
        const RecordsStep& step = records[b.fold_region];
        b.records_region = 1 - b.fold_region;  // a folding records step writes the other region
        if (in.ConsumeIntegralInRange<int>(0, 3) != 3 && step.rows > 0) {
          // That step's rows on their slots, as a runtime folds: row r of this step is the row of
          // that step that read the same slot.
          c.slots = std::vector<std::int32_t>(step.slots.begin(), step.slots.end());
          b.sequences = static_cast<std::int64_t>(c.slots.size());
          b.tokens = b.sequences * T;
          for (std::int64_t r = 0; r < b.sequences; ++r) {
            c.fold_rows.push_back(in.ConsumeBool() ? static_cast<std::int32_t>(r) : -1);
          }
          c.fold_counts = accepted_counts(in, b.sequences, step.tokens);
        } else {
          c.fold_rows = metadata_array(in, b.sequences, b.sequences);
          c.fold_counts = metadata_array(in, b.sequences, 5);
        }
      }
      break;
    }
    case Call::kCommit:
      c.region = follow_up == FollowUp::kCommit && records[0].rows == 0
                     ? 1
                     : in.PickValueInArray<int>({0, 0, 1, -1, 2});
      if (c.region >= 0 && c.region <= 1 && records[c.region].rows > 0 &&
          in.ConsumeIntegralInRange<int>(0, 3) != 3) {  // the records step's rows and slots
        const RecordsStep& step = records[c.region];
        c.count = step.rows;
        c.slots = step.slots;
        c.accepted = accepted_counts(in, c.count, step.tokens);
      } else {
        c.count = rows_of(in);
        c.slots = slot_array(in, c.count, acquired);
        c.accepted = metadata_array(in, c.count, 5);
      }
      break;
    case Call::kCopy:
      c.count = rows_of(in);
      c.slots = metadata_array(in, c.count, kSlots);  // the sources
      c.dst = slot_array(in, c.count, acquired);
      break;
    case Call::kReset:
      c.count = rows_of(in);
      c.dst = metadata_array(in, c.count, kSlots);
      break;
    case Call::kRelease:
      c.dst = {metadata_value(in, kSlots)};  // released, then the lowest free slot acquired
      break;
  }
  const std::int64_t rows = b.tokens > 0 && b.tokens <= kMaxTokens ? b.tokens : 0;
  c.hidden.resize(static_cast<std::size_t>(rows * kHidden));
  for (auto& h : c.hidden) h = kda::float_to_bf16(unit(rng));
  b.slots = c.slots.empty() ? nullptr : c.slots.data();
  if (c.kind == Call::kPrefill) {
    if (c.cu_seqlens_i32.empty()) {
      b.cu_seqlens = c.cu_seqlens.data();
    } else {
      b.cu_seqlens_i32 = c.cu_seqlens_i32.data();
    }
  }
  b.num_accepted = c.accepted.empty() || c.kind != Call::kDecode ? nullptr : c.accepted.data();
  b.checkpoint_offsets = c.checkpoint_offsets.empty() ? nullptr : c.checkpoint_offsets.data();
  b.checkpoint_slots = c.checkpoint_slots.empty() ? nullptr : c.checkpoint_slots.data();
  b.fold_rows = c.fold_rows.empty() ? nullptr : c.fold_rows.data();
  b.fold_counts = c.fold_counts.empty() ? nullptr : c.fold_counts.data();
  return c;
}

// Runs call `c` on layer `layer` of `engine` (forwards) or on the engine (the rest); `out` has
// room for the call's rows. Returns the refusal's message, or "" when the call was accepted.
std::string run(Engine& engine, const Call& c, int layer, std::vector<kda::bf16_bits>* out) {
  try {
    switch (c.kind) {
      case Call::kPrefill:
        engine.prefill_hidden(layer, c.hidden.data(), out->data(), c.batch);
        break;
      case Call::kDecode:
        engine.decode_hidden(layer, c.hidden.data(), out->data(), c.batch);
        break;
      case Call::kCommit:
        engine.commit(c.count, c.slots.empty() ? nullptr : c.slots.data(),
                      c.accepted.empty() ? nullptr : c.accepted.data(), c.region);
        break;
      case Call::kCopy:
        engine.copy_slots(c.count, c.slots.empty() ? nullptr : c.slots.data(),
                          c.dst.empty() ? nullptr : c.dst.data());
        break;
      case Call::kReset:
        engine.reset_slots(c.count, c.dst.empty() ? nullptr : c.dst.data());
        break;
      case Call::kRelease:
        engine.release_slot(c.dst[0]);
        (void)engine.acquire_slot();
        break;
    }
  } catch (const kda::Error& e) {
    const std::string message = e.what();
    expect(!message.empty(), "a refusal without a message");
    return message;
  }
  return std::string();
}

// Whether out's rows of padding rows are zeros, and every value finite.
void check_out(const Call& c, const std::vector<kda::bf16_bits>& out, int null_slot) {
  const BatchMetadata& b = c.batch;
  auto rows_zero = [&](std::int64_t begin, std::int64_t end, std::int64_t row) {
    for (std::int64_t t = begin; t < end; ++t) {
      for (std::int64_t e = 0; e < kHidden; ++e) {
        expect((out[static_cast<std::size_t>(t * kHidden + e)] & 0x7fff) == 0,
               "padding row " + std::to_string(row) + ": out not zero");
      }
    }
  };
  for (std::int64_t r = 0; r < b.sequences; ++r) {
    if (c.kind == Call::kPrefill) {
      if (padding(c.slots[static_cast<std::size_t>(r)], null_slot)) {
        rows_zero(c.cu_seqlens[static_cast<std::size_t>(r)],
                  c.cu_seqlens[static_cast<std::size_t>(r + 1)], r);
      }
    } else {
      const std::int64_t T = b.decode_tokens;
      const std::int32_t start = b.num_accepted != nullptr
                                     ? c.slots[static_cast<std::size_t>(
                                           r * T + c.accepted[static_cast<std::size_t>(r)] - 1)]
                                     : c.slots[static_cast<std::size_t>(r)];
      if (padding(start, null_slot)) rows_zero(r * T, (r + 1) * T, r);
    }
  }
  for (const kda::bf16_bits v : out) {
    expect(std::isfinite(kda::bf16_to_float(v)), "out holds a value that is not finite");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  try {
    kda::engine::ModelSpec spec =
        kda::engine::parse_model_spec(model_text(in.ConsumeBool(), in.ConsumeBool()), "fuzz.yaml");
    const int null_slot = in.ConsumeBool() ? kSlots - 1 : -1;
    std::unique_ptr<Engine> engines[2];
    for (int i = 0; i < 2; ++i) {
      kda::engine::EngineOptions options;
      options.backend = kda::engine::BackendChoice::kCpu;
      options.cpu_threads = i == 0 ? 1 : 3;
      options.seed = 5;
      options.null_slot = null_slot;
      engines[i] = std::make_unique<Engine>(spec, options);
    }
    // Every slot acquired but one (never the null slot), then states from a first prefill.
    const int chosen = in.ConsumeIntegralInRange<int>(0, kSlots - 1);
    const int free_slot = chosen == null_slot ? 0 : chosen;
    std::mt19937 rng(in.ConsumeIntegral<std::uint32_t>());
    std::vector<int> acquired;
    for (int s = 0; s < kSlots; ++s) {
      if (s == null_slot) continue;
      for (auto& e : engines) (void)e->acquire_slot();
      acquired.push_back(s);
    }
    for (auto& e : engines) e->release_slot(free_slot);
    {
      std::vector<int> seq_slots;
      std::vector<std::int64_t> cu = {0};
      for (const int s : acquired) {
        if (s == free_slot) continue;
        seq_slots.push_back(s);
        cu.push_back(cu.back() + 5);
      }
      std::vector<kda::bf16_bits> hidden(static_cast<std::size_t>(cu.back() * kHidden));
      std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
      for (auto& h : hidden) h = kda::float_to_bf16(unit(rng));
      std::vector<kda::bf16_bits> out(hidden.size());
      for (auto& e : engines) {
        for (int l = 0; l < 2; ++l) e->prefill_hidden(l, hidden.data(), out.data(), seq_slots, cu);
      }
    }

    RecordsStep records[2];
    FollowUp follow_up = FollowUp::kNone;
    const int calls = in.ConsumeIntegralInRange<int>(1, 6);
    for (int i = 0; i < calls && (in.remaining_bytes() > 0 || follow_up != FollowUp::kNone); ++i) {
      std::vector<std::int32_t> acquired_now;
      for (int s = 0; s < kSlots; ++s) {
        if (engines[0]->slot_in_use(s)) acquired_now.push_back(s);
      }
      const Call c = make_call(in, rng, acquired_now, records, follow_up);
      follow_up = FollowUp::kNone;
      const bool forward = c.kind == Call::kPrefill || c.kind == Call::kDecode;
      const std::set<std::int64_t> named = c.named();
      for (int layer = 0; layer < (forward ? 2 : 1); ++layer) {
        const std::string what = "call " + std::to_string(i) + " (kind " +
                                 std::to_string(static_cast<int>(c.kind)) + ", layer " +
                                 std::to_string(layer) + ")";
        const States before = states_of(*engines[0]);
        std::vector<kda::bf16_bits> outs[2];
        std::string refusals[2];
        for (int e = 0; e < 2; ++e) {
          outs[e].assign(c.hidden.size(), 0x7fc1);  // poison: NaN
          refusals[e] = run(*engines[e], c, layer, &outs[e]);
        }
        expect(refusals[0].empty() == refusals[1].empty(),
               what + ": one engine refused, the other not: '" + refusals[0] + "' / '" +
                   refusals[1] + "'");
        const States after = states_of(*engines[0]);
        expect(after == states_of(*engines[1]), what + ": states differ between thread counts");
        if (!refusals[0].empty()) {
          expect(after == before, what + ": refused ('" + refusals[0] + "') but changed states");
          for (const kda::bf16_bits v : outs[0]) {
            expect(v == 0x7fc1, what + ": refused ('" + refusals[0] + "') but wrote out");
          }
          break;  // the later layers would be refused the same way
        }
        for (int s = 0; s < kSlots; ++s) {
          if (named.count(s) == 0 && c.kind != Call::kRelease) {
            expect(after[static_cast<std::size_t>(s)] == before[static_cast<std::size_t>(s)],
                   what + ": slot " + std::to_string(s) + ", which it does not name, changed");
          }
        }
        if (forward) {
          expect(outs[0] == outs[1], what + ": out differs between thread counts");
          check_out(c, outs[0], null_slot);
        }
        if (c.kind == Call::kDecode && c.batch.records && layer == 1) {
          records[c.batch.records_region] = {c.batch.sequences, c.batch.decode_tokens, c.slots};
          // Drawn from the input's seed, not its bytes, so that short inputs get both.
          const FollowUp choices[] = {FollowUp::kCommit, FollowUp::kFold, FollowUp::kNone};
          follow_up = choices[std::uniform_int_distribution<int>(0, 2)(rng)];
        }
      }
    }
  } catch (const kda::Error& e) {
    finding(std::string("setup refused: ") + e.what());
  } catch (const std::exception& e) {
    finding(std::string("an exception other than kda::Error: ") + e.what());
  } catch (...) {
    finding("a non-std exception");
  }
  return 0;
}
