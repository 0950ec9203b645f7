// Parallelism through a communicator (kda/engine/communicator.hpp): the in-process communicator's
// collectives over threads; engines of tensor-parallel ranks that all-reduce their whole layers'
// outputs, each returning what one engine of the whole model returns; and a context-parallel
// prefill of one sequence over ranks, equal to one engine's prefill.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/engine/communicator.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"
#include "layer_test_util.hpp"

namespace {

using kda::bf16_bits;
using kda::engine::Communicator;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::ModelSpec;

// Runs body(rank) on one thread per rank and waits for all.
void on_threads(int ranks, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(errors[static_cast<std::size_t>(r)].empty());
  }
}

ModelSpec spec(int tp_size, int tp_rank) {
  return kda::engine::parse_model_spec(
      "name: tp\nhidden_size: 64\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 4, head_dim: 16, kda_layers: [1, 2], "
      "full_attn_layers: [], gate: lower_bound, gate_lower_bound: -5.0}\n"
      "runtime: {max_tokens: 64, max_sequences: 3, tp_size: " +
          std::to_string(tp_size) + ", tp_rank: " + std::to_string(tp_rank) + "}\n",
      "tp.yaml");
}

EngineOptions options(Communicator* communicator) {
  EngineOptions o;
  o.backend = kda::engine::BackendChoice::kCpu;
  o.seed = 23;
  o.cpu_threads = 1;
  o.communicator = communicator;
  return o;
}

// A prefill of two sequences (9 and 14 tokens), then a decode step of both, through both layers;
// every output, in order.
std::vector<std::vector<bf16_bits>> run(Engine& e) {
  const std::int64_t E = 64;
  const std::vector<bf16_bits> prompt = kda::test::random_bf16(23 * E, 1.0f, 31);
  const std::vector<bf16_bits> step = kda::test::random_bf16(2 * E, 1.0f, 32);
  const int a = e.acquire_slot(), b = e.acquire_slot();
  std::vector<std::vector<bf16_bits>> outs;
  for (int l = 0; l < e.num_layers(); ++l) {
    std::vector<bf16_bits> out(prompt.size(), 0xFFFF);
    e.prefill_hidden(l, prompt.data(), out.data(), {a, b}, {0, 9, 23});
    outs.push_back(out);
  }
  for (int l = 0; l < e.num_layers(); ++l) {
    std::vector<bf16_bits> out(step.size(), 0xFFFF);
    e.decode_hidden(l, step.data(), out.data(), {b, a}, 1);
    outs.push_back(out);
  }
  return outs;
}

}  // namespace

TEST_CASE("local communicators: all-reduce and all-gather over threads, every rank the same") {
  const int ranks = 3;
  auto group = kda::engine::make_local_communicators(ranks);
  REQUIRE(group.size() == 3);
  std::vector<std::vector<float>> f32(ranks);
  std::vector<std::vector<bf16_bits>> bf16(ranks);
  std::vector<std::vector<int>> gathered(ranks, std::vector<int>(3 * 2, -1));
  on_threads(ranks, [&](int r) {
    Communicator& c = *group[static_cast<std::size_t>(r)];
    CHECK(c.rank() == r);
    CHECK(c.size() == ranks);
    CHECK(c.backend() == kda::Backend::kCpu);
    for (int round = 0; round < 20; ++round) {  // collectives back to back reuse the rendezvous
      f32[static_cast<std::size_t>(r)] = {1.0f + r, 0.5f * r, -2.0f, 1e-3f * round};
      c.all_reduce_sum(f32[static_cast<std::size_t>(r)].data(), 4, kda::DType::kF32, nullptr);
      bf16[static_cast<std::size_t>(r)] = {kda::float_to_bf16(0.1f * (r + 1)),
                                           kda::float_to_bf16(-3.0f)};
      c.all_reduce_sum(bf16[static_cast<std::size_t>(r)].data(), 2, kda::DType::kBF16, nullptr);
      const int mine[2] = {10 * r, 10 * r + round};
      c.all_gather(mine, gathered[static_cast<std::size_t>(r)].data(), sizeof mine, nullptr);
    }
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const float last = 1e-3f * 19;  // summed in rank order
    CHECK(f32[static_cast<std::size_t>(r)] ==
          std::vector<float>{6.0f, 1.5f, -6.0f, ((0.0f + last) + last) + last});
    // bf16 summed in fp32 in rank order, rounded once.
    const float sum = (0.0f + kda::bf16_to_float(kda::float_to_bf16(0.1f)) +
                       kda::bf16_to_float(kda::float_to_bf16(0.2f))) +
                      kda::bf16_to_float(kda::float_to_bf16(0.3f));
    CHECK(bf16[static_cast<std::size_t>(r)][0] == kda::float_to_bf16(sum));
    CHECK(bf16[static_cast<std::size_t>(r)][1] == kda::float_to_bf16(-9.0f));
    CHECK(gathered[static_cast<std::size_t>(r)] == std::vector<int>{0, 19, 10, 29, 20, 39});
  }
  CHECK(kda::test::error_of([&] {
          std::vector<int> x(2);
          group[0]->all_reduce_sum(x.data(), 2, kda::DType::kI32, nullptr);
        }) == "local communicator: all_reduce_sum of i32 (it sums bf16 and f32)");
  CHECK(kda::test::error_of([] { kda::engine::make_local_communicators(0); }) ==
        "make_local_communicators: ranks 0 is not in [1, 1024]");
}

TEST_CASE("tensor parallel: ranks with a communicator each return the whole layer's output") {
  Engine whole(spec(1, 0), options(nullptr));
  const auto want = run(whole);
  for (const int tp : {2, 4}) {
    CAPTURE(tp);
    auto group = kda::engine::make_local_communicators(tp);
    std::vector<std::vector<std::vector<bf16_bits>>> got(static_cast<std::size_t>(tp)),
        partial(static_cast<std::size_t>(tp));
    on_threads(tp, [&](int r) {
      Engine rank(spec(tp, r), options(group[static_cast<std::size_t>(r)].get()));
      got[static_cast<std::size_t>(r)] = run(rank);
      Engine alone(spec(tp, r), options(nullptr));  // the partial sums, for the check below
      partial[static_cast<std::size_t>(r)] = run(alone);
    });
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      for (int r = 1; r < tp; ++r) CHECK(got[static_cast<std::size_t>(r)][i] == got[0][i]);
      // The all-reduce: the partial sums added in fp32 in rank order, rounded once.
      std::vector<bf16_bits> summed(want[i].size());
      for (std::size_t j = 0; j < summed.size(); ++j) {
        float s = 0.0f;
        for (int r = 0; r < tp; ++r)
          s += kda::bf16_to_float(partial[static_cast<std::size_t>(r)][i][j]);
        summed[j] = kda::float_to_bf16(s);
      }
      CHECK(got[0][i] == summed);
      // And the whole model's output, to the rounding of the partial sums.
      CHECK(kda::test::relative_error(got[0][i], want[i]) < 1e-2);
    }
  }
}

TEST_CASE("EngineOptions::communicator must be the engine's rank of its group, on its backend") {
  auto group = kda::engine::make_local_communicators(2);
  CHECK(kda::test::error_of([&] { Engine e(spec(2, 0), options(group[1].get())); }) ==
        "tp on cpu: EngineOptions::communicator is rank 1 of 2 on cpu; the engine is "
        "tensor-parallel rank 0 of 2 on cpu");
  auto three = kda::engine::make_local_communicators(3);
  CHECK(kda::test::error_of([&] {
          Engine e(spec(2, 0), options(three[0].get()));
        }).find("rank 0 of 3") != std::string::npos);
  ModelSpec cores = spec(1, 0);
  cores.runtime.layer_mode = kda::engine::LayerMode::kCoreOnly;
  auto one = kda::engine::make_local_communicators(1);
  CHECK(kda::test::error_of([&] {
          Engine e(cores, options(one[0].get()));
        }).find("with the KDA cores alone") != std::string::npos);
}

namespace {

// The KDA cores alone of a 2-layer model, an f32 state.
ModelSpec core_spec() {
  return kda::engine::parse_model_spec(
      "name: cp\nhidden_size: 64\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 2, head_dim: 16, kda_layers: [1, 2], "
      "full_attn_layers: [], gate: softplus}\n"
      "runtime: {max_tokens: 128, max_sequences: 2, layers: core}\n",
      "cp.yaml");
}

EngineOptions core_options(Communicator* group) {
  EngineOptions o;
  o.backend = kda::engine::BackendChoice::kCpu;
  o.seed = 41;
  o.cpu_threads = 1;
  o.context_group = group;
  return o;
}

}  // namespace

// One sequence of 100 tokens from a non-zero initial state, its ranges 37 / 33 / 30 (and 0 / 100 /
// 0: a rank may hold nothing) on three ranks: each rank's out rows are one engine's prefill of the
// whole sequence to rounding, and every rank's slot ends with its final state.
TEST_CASE("context parallel: a prefill split over ranks equals one engine's, every rank's state") {
  const std::int64_t T = 100, H = 2, D = 16;
  const std::size_t width = static_cast<std::size_t>(H * D);
  const std::vector<bf16_bits> q = kda::test::random_bf16(T * width, 1.0f, 1),
                               k = kda::test::random_bf16(T * width, 1.0f, 2),
                               v = kda::test::random_bf16(T * width, 1.0f, 3),
                               g = kda::test::random_bf16(T * width, 1.0f, 4),
                               beta = kda::test::random_bf16(T * H, 1.0f, 5);
  std::vector<float> initial(static_cast<std::size_t>(H * D * D));
  for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = 0.01f * static_cast<float>(i % 13);

  Engine one(core_spec(), core_options(nullptr));
  const int s = one.acquire_slot();
  std::vector<std::vector<bf16_bits>> want_out(2, std::vector<bf16_bits>(T * width));
  std::vector<std::vector<float>> want_state(2, std::vector<float>(initial.size()));
  for (int l = 0; l < 2; ++l) {
    one.write_slot_state(l, s, initial.data());
    one.prefill(l, {q.data(), k.data(), v.data(), g.data(), beta.data()},
                want_out[static_cast<std::size_t>(l)].data(), {s}, {0, T});
    one.read_slot_state(l, s, want_state[static_cast<std::size_t>(l)].data());
  }

  for (const std::vector<std::int64_t>& ranges :
       {std::vector<std::int64_t>{37, 33, 30}, std::vector<std::int64_t>{0, 100, 0}}) {
    CAPTURE(ranges[0]);
    const int ranks = static_cast<int>(ranges.size());
    auto group = kda::engine::make_local_communicators(ranks);
    std::vector<std::vector<bf16_bits>> out(2, std::vector<bf16_bits>(T * width, 0xFFFF));
    std::vector<std::vector<std::vector<float>>> states(static_cast<std::size_t>(ranks),
                                                        std::vector<std::vector<float>>(2));
    on_threads(ranks, [&](int r) {
      Engine e(core_spec(), core_options(group[static_cast<std::size_t>(r)].get()));
      const int slot = e.acquire_slot();
      std::int64_t begin = 0;
      for (int j = 0; j < r; ++j) begin += ranges[static_cast<std::size_t>(j)];
      const std::int64_t n = ranges[static_cast<std::size_t>(r)];
      auto at = [&](const std::vector<bf16_bits>& x, std::size_t w) {
        return x.data() + begin * w;
      };
      for (int l = 0; l < 2; ++l) {
        e.write_slot_state(l, slot, initial.data());
        e.prefill_context_parallel(
            l, {at(q, width), at(k, width), at(v, width), at(g, width), at(beta, H)},
            out[static_cast<std::size_t>(l)].data() + begin * width, slot, n);
        std::vector<float>& st = states[static_cast<std::size_t>(r)][static_cast<std::size_t>(l)];
        st.resize(initial.size());
        e.read_slot_state(l, slot, st.data());
      }
    });
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      const double out_error = kda::test::relative_error(out[static_cast<std::size_t>(l)],
                                                         want_out[static_cast<std::size_t>(l)]);
      MESSAGE("context parallel over " << ranks << " ranks, layer " << l << ": out " << out_error);
      CHECK(out_error < 5e-3);
      for (int r = 0; r < ranks; ++r) {
        CAPTURE(r);
        CHECK(kda::test::relative_error(
                  states[static_cast<std::size_t>(r)][static_cast<std::size_t>(l)],
                  want_state[static_cast<std::size_t>(l)]) < 1e-4);
      }
    }
  }
}

TEST_CASE("context parallel needs a group, the cores alone and an f32 state") {
  Engine plain(core_spec(), core_options(nullptr));
  const int slot = plain.acquire_slot();
  CHECK(kda::test::error_of([&] { plain.prefill_context_parallel(0, {}, nullptr, slot, 0); }) ==
        "prefill_context_parallel: the engine has no context_group");
  auto group = kda::engine::make_local_communicators(1);
  CHECK(kda::test::error_of([&] {
          Engine e(spec(1, 0), core_options(group[0].get()));
        }).find("needs the KDA cores alone (runtime.layers: core)") != std::string::npos);
}

TEST_CASE("the CUDA transports of a build without them throw kBackendUnavailable") {
  if (!kda::cuda_compiled()) {
    const std::string message =
        kda::test::error_of([] { kda::engine::make_cuda_local_communicators(2); });
    CHECK(message == "make_cuda_local_communicators: this build has no CUDA backend");
  }
  if (!kda::engine::nccl_compiled()) {
    CHECK(kda::test::error_of([] { kda::engine::make_nccl_communicators({0}); }) ==
          "make_nccl_communicators: this build has no NCCL (configure with KDA_NCCL=ON)");
    CHECK(kda::test::error_of([] { kda::engine::nccl_unique_id(); })
              .find("this build has no "
                    "NCCL") != std::string::npos);
    try {
      kda::engine::make_nccl_communicator(nullptr);
      FAIL("no throw");
    } catch (const kda::Error& e) {
      CHECK(e.code() == kda::StatusCode::kBackendUnavailable);
    }
  }
}
