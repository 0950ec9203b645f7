// Parallelism on CUDA (label `gpu`; every case prints "KDA_SKIP: ..." without a device): the CUDA
// in-process communicator's collectives over threads, each rank on its own stream of the one
// device, against host sums and the CPU communicator's bits; engines of tensor-parallel ranks and
// a context-parallel prefill on CUDA through it, equal to one engine (test_parallel.cpp's CPU
// cases on CUDA); the C API's kda_communicator over that group; and, where NCCL is built, one
// rank's NCCL communicator.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "c_communicator.hpp"
#include "cuda_runtime_util.hpp"
#include "cuda_test_util.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/communicator.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"
#include "layer_test_util.hpp"
#include "rank_threads.hpp"

#ifdef KDA_HAVE_CUDA
namespace {

using kda::bf16_bits;
using kda::engine::Communicator;
using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::ModelSpec;
using kda::test::DeviceBuffer;
using kda::test::Stream;

// Throws std::runtime_error on a failed status (on worker threads, where doctest assertions are
// avoided).
void ok_or_throw(const kda::Status& st, const char* what) {
  if (!st.ok()) throw std::runtime_error(std::string(what) + ": " + st.to_string());
}

using kda::test::run_on_rank_threads;

void check_no_errors(const std::vector<std::string>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CHECK(errors[r].empty());
  }
}

template <typename T>
std::vector<T> download(const void* device, std::size_t count, void* stream) {
  std::vector<T> host(count);
  if (count > 0) {
    ok_or_throw(kda::memcpy_to_host(host.data(), device, count * sizeof(T), stream), "download");
  }
  return host;
}

std::vector<float> random_floats(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> x(count);
  for (float& v : x) v = u(rng);
  return x;
}

}  // namespace
#endif  // KDA_HAVE_CUDA

TEST_CASE(
    "cuda local communicators: all-reduce and all-gather over streams equal host sums [cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  const int ranks = 3;
  // Counts that grow and shrink, so the scratch grows once and is reused; odd sizes for the tails.
  const std::vector<std::size_t> counts = {100, 10007, 50, 70001};
  const std::size_t most = 70001;
  auto group = kda::engine::make_cuda_local_communicators(ranks);
  REQUIRE(group.size() == 3);
  // Each rank's inputs per round, on the host; results downloaded per rank and round.
  std::vector<std::vector<std::vector<float>>> f32_in(ranks), f32_out(ranks);
  std::vector<std::vector<std::vector<bf16_bits>>> bf16_in(ranks), bf16_out(ranks);
  std::vector<std::vector<std::uint8_t>> gathered(ranks), gathered_in_place(ranks);
  const std::size_t gather_bytes = 777;
  for (int r = 0; r < ranks; ++r) {
    for (std::size_t round = 0; round < counts.size(); ++round) {
      const std::uint64_t seed = 1000 * static_cast<std::uint64_t>(r) + round;
      f32_in[r].push_back(random_floats(counts[round], seed));
      bf16_in[r].push_back(kda::test::random_bf16(counts[round], 3.0f, seed + 500));
    }
  }
  check_no_errors(run_on_rank_threads(ranks, [&](int r) {
    Stream stream;
    Communicator& c = *group[static_cast<std::size_t>(r)];
    if (c.rank() != r || c.size() != ranks || c.backend() != kda::Backend::kCuda) {
      throw std::runtime_error("rank, size or backend wrong");
    }
    DeviceBuffer f32(most * sizeof(float)), bf16(most * sizeof(bf16_bits));
    DeviceBuffer send(gather_bytes), recv(ranks * gather_bytes);
    ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");  // legacy-stream memsets done
    for (std::size_t round = 0; round < counts.size(); ++round) {
      const std::size_t n = counts[round];
      // Upload, reduce, download: all on the rank's stream (the download waits for it).
      ok_or_throw(kda::memcpy_to_device(f32.get(), f32_in[r][round].data(), n * sizeof(float),
                                        stream.stream),
                  "upload");
      c.all_reduce_sum(f32.get(), n, kda::DType::kF32, stream.stream);
      ok_or_throw(kda::memcpy_to_device(bf16.get(), bf16_in[r][round].data(), n * sizeof(bf16_bits),
                                        stream.stream),
                  "upload");
      c.all_reduce_sum(bf16.get(), n, kda::DType::kBF16, stream.stream);
      f32_out[r].push_back(download<float>(f32.get(), n, stream.stream));
      bf16_out[r].push_back(download<bf16_bits>(bf16.get(), n, stream.stream));
    }
    std::vector<std::uint8_t> mine(gather_bytes);
    for (std::size_t i = 0; i < gather_bytes; ++i) mine[i] = static_cast<std::uint8_t>(r * 31 + i);
    ok_or_throw(kda::memcpy_to_device(send.get(), mine.data(), gather_bytes, stream.stream),
                "upload");
    c.all_gather(send.get(), recv.get(), gather_bytes, stream.stream);
    gathered[r] = download<std::uint8_t>(recv.get(), ranks * gather_bytes, stream.stream);
    // In place: send is this rank's own range of recv.
    ok_or_throw(kda::memset_device(recv.get(), 0, ranks * gather_bytes, stream.stream), "clear");
    void* own = static_cast<std::uint8_t*>(recv.get()) + r * gather_bytes;
    ok_or_throw(kda::memcpy_to_device(own, mine.data(), gather_bytes, stream.stream), "upload");
    c.all_gather(own, recv.get(), gather_bytes, stream.stream);
    gathered_in_place[r] = download<std::uint8_t>(recv.get(), ranks * gather_bytes, stream.stream);
    c.all_reduce_sum(nullptr, 0, kda::DType::kF32, stream.stream);  // empty: nothing to do
  }));

  // The CPU communicator's bf16 results of the same inputs, for the bitwise comparison.
  auto cpu = kda::engine::make_local_communicators(ranks);
  std::vector<std::vector<std::vector<bf16_bits>>> cpu_out = bf16_in;
  check_no_errors(run_on_rank_threads(ranks, [&](int r) {
    for (auto& x : cpu_out[r])
      cpu[r]->all_reduce_sum(x.data(), x.size(), kda::DType::kBF16, nullptr);
  }));
  for (std::size_t round = 0; round < counts.size(); ++round) {
    CAPTURE(round);
    std::vector<float> want(counts[round]);
    for (std::size_t i = 0; i < want.size(); ++i) {
      float s = 0.0f;  // in rank order, as the communicator promises
      for (int r = 0; r < ranks; ++r) s += f32_in[r][round][i];
      want[i] = s;
    }
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(f32_out[r][round] == want);
      CHECK(bf16_out[r][round] == cpu_out[0][round]);
    }
  }
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    std::vector<std::uint8_t> want(ranks * gather_bytes);
    for (int j = 0; j < ranks; ++j) {
      for (std::size_t i = 0; i < gather_bytes; ++i)
        want[j * gather_bytes + i] = static_cast<std::uint8_t>(j * 31 + i);
    }
    CHECK(gathered[r] == want);
    CHECK(gathered_in_place[r] == want);
  }
#endif
}

TEST_CASE(
    "cuda local communicators: misuse throws on every rank alike, the group still works [cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  const int ranks = 2;
  auto group = kda::engine::make_cuda_local_communicators(ranks);
  std::vector<std::vector<std::string>> messages(3, std::vector<std::string>(ranks));
  std::vector<float> after(ranks * 4);
  check_no_errors(run_on_rank_threads(ranks, [&](int r) {
    Stream stream;
    Communicator& c = *group[static_cast<std::size_t>(r)];
    DeviceBuffer x(64 * sizeof(float));
    ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
    // 1. A dtype it does not sum.
    messages[0][r] =
        kda::test::error_of([&] { c.all_reduce_sum(x.get(), 4, kda::DType::kI32, stream.stream); });
    // 2. Ranks that disagree on the count.
    messages[1][r] = kda::test::error_of(
        [&] { c.all_reduce_sum(x.get(), r == 0 ? 4 : 5, kda::DType::kF32, stream.stream); });
    // 3. Rank 0's stream being captured.
    kda::test::Graph graph;
    if (r == 0) {
      CUDA_REQUIRE(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
    }
    messages[2][r] =
        kda::test::error_of([&] { c.all_reduce_sum(x.get(), 4, kda::DType::kF32, stream.stream); });
    if (r == 0) CUDA_REQUIRE(cudaStreamEndCapture(stream.stream, &graph.graph));
    // The group still works.
    const std::vector<float> mine = {1.0f + r, 2.0f, -3.0f * r, 0.25f};
    ok_or_throw(kda::memcpy_to_device(x.get(), mine.data(), 4 * sizeof(float), stream.stream),
                "upload");
    c.all_reduce_sum(x.get(), 4, kda::DType::kF32, stream.stream);
    const std::vector<float> got = download<float>(x.get(), 4, stream.stream);
    std::memcpy(after.data() + 4 * r, got.data(), 4 * sizeof(float));
  }));
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(messages[0][r] ==
          "cuda local communicator: rank 0: all_reduce_sum of i32 (it sums bf16 and f32)");
    CHECK(messages[1][r] ==
          "cuda local communicator: ranks disagree: rank 0 calls all_reduce_sum of 4 f32, rank 1 "
          "all_reduce_sum of 5 f32");
    CHECK(messages[2][r].find("cuda local communicator: rank 0: all_reduce_sum on a capturing "
                              "stream") == 0);
    CHECK(std::vector<float>(after.begin() + 4 * r, after.begin() + 4 * r + 4) ==
          std::vector<float>{3.0f, 4.0f, -3.0f, 0.5f});
  }
  CHECK(kda::test::error_of([] { kda::engine::make_cuda_local_communicators(65); }) ==
        "make_cuda_local_communicators: ranks 65 is not in [1, 64]");
  CHECK(kda::test::error_of([] { kda::engine::make_cuda_local_communicators(2, {0}); }) ==
        "make_cuda_local_communicators: 1 devices for 2 ranks (give one per rank, or none: all on "
        "the current device)");
#endif
}

#ifdef KDA_HAVE_CUDA
namespace {

// test_parallel.cpp's tensor-parallel model with CUDA's head_dim (128).
ModelSpec tp_spec(int tp_size, int tp_rank) {
  return kda::engine::parse_model_spec(
      "name: tp\nhidden_size: 256\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 4, head_dim: 128, kda_layers: [1, 2], "
      "full_attn_layers: [], gate: lower_bound, gate_lower_bound: -5.0}\n"
      "runtime: {max_tokens: 64, max_sequences: 3, tp_size: " +
          std::to_string(tp_size) + ", tp_rank: " + std::to_string(tp_rank) + "}\n",
      "tp.yaml");
}

EngineOptions cuda_options(std::uint64_t seed, void* stream) {
  EngineOptions o;
  o.backend = kda::engine::BackendChoice::kCuda;
  o.seed = seed;
  o.stream = stream;
  o.poison_arena = true;  // no call may read arena memory nothing wrote (engine_matrix.hpp)
  return o;
}

// A prefill of two sequences (9 and 14 tokens), then a decode step of both, through both layers;
// every output, in order (test_parallel.cpp's run(), on device buffers).
std::vector<std::vector<bf16_bits>> run_tp(Engine& e, void* stream) {
  const std::int64_t E = 256;
  const std::vector<bf16_bits> prompt = kda::test::random_bf16(23 * E, 1.0f, 31);
  const std::vector<bf16_bits> step = kda::test::random_bf16(2 * E, 1.0f, 32);
  DeviceBuffer d_prompt = DeviceBuffer::from(prompt), d_step = DeviceBuffer::from(step);
  DeviceBuffer out(prompt.size() * sizeof(bf16_bits));
  ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
  const int a = e.acquire_slot(), b = e.acquire_slot();
  std::vector<std::vector<bf16_bits>> outs;
  for (int l = 0; l < e.num_layers(); ++l) {
    e.prefill_hidden(l, d_prompt.get(), out.get(), {a, b}, {0, 9, 23});
    outs.push_back(download<bf16_bits>(out.get(), prompt.size(), stream));
  }
  for (int l = 0; l < e.num_layers(); ++l) {
    e.decode_hidden(l, d_step.get(), out.get(), {b, a}, 1);
    outs.push_back(download<bf16_bits>(out.get(), step.size(), stream));
  }
  return outs;
}

// run_tp on rank r of `tp` whose engine all-reduces through `c` (null: its partial sums).
std::vector<std::vector<bf16_bits>> run_tp_rank(int tp, int r, Communicator* c, void* stream) {
  EngineOptions o = cuda_options(23, stream);
  o.communicator = c;
  Engine rank(tp_spec(tp, r), o);
  return run_tp(rank, stream);
}

}  // namespace
#endif  // KDA_HAVE_CUDA

TEST_CASE(
    "tensor parallel on CUDA: ranks on streams of one GPU return the whole layer's output [cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  std::vector<std::vector<bf16_bits>> want;
  {
    Stream stream;
    Engine whole(tp_spec(1, 0), cuda_options(23, stream.stream));
    want = run_tp(whole, stream.stream);
  }
  const int tp = 2;
  auto group = kda::engine::make_cuda_local_communicators(tp);
  std::vector<std::vector<std::vector<bf16_bits>>> got(tp), partial(tp);
  check_no_errors(run_on_rank_threads(tp, [&](int r) {
    Stream stream;
    got[r] = run_tp_rank(tp, r, group[static_cast<std::size_t>(r)].get(), stream.stream);
    partial[r] = run_tp_rank(tp, r, nullptr, stream.stream);  // the partial sums
  }));
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    REQUIRE(got[0].size() == want.size());
    for (int r = 1; r < tp; ++r) CHECK(got[r][i] == got[0][i]);
    // The all-reduce: the partial sums added in fp32 in rank order, rounded once.
    std::vector<bf16_bits> summed(want[i].size());
    for (std::size_t j = 0; j < summed.size(); ++j) {
      float s = 0.0f;
      for (int r = 0; r < tp; ++r) s += kda::bf16_to_float(partial[r][i][j]);
      summed[j] = kda::float_to_bf16(s);
    }
    CHECK(got[0][i] == summed);
    const double error = kda::test::relative_error(got[0][i], want[i]);
    MESSAGE("tensor parallel on CUDA, output " << i << ": relative error " << error);
    CHECK(error < 1e-2);
  }
#endif
}

#ifdef KDA_HAVE_CUDA
namespace {

// test_parallel.cpp's context-parallel model (the KDA cores alone, an f32 state) with CUDA's
// head_dim.
ModelSpec cp_spec() {
  return kda::engine::parse_model_spec(
      "name: cp\nhidden_size: 256\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 2, head_dim: 128, kda_layers: [1, 2], "
      "full_attn_layers: [], gate: softplus}\n"
      "runtime: {max_tokens: 128, max_sequences: 2, layers: core}\n",
      "cp.yaml");
}

}  // namespace
#endif  // KDA_HAVE_CUDA

// One sequence of 100 tokens from a non-zero initial state, its ranges 37 / 33 / 30 and 0 / 100 / 0
// on three ranks (threads, streams of one GPU): each rank's out rows are one engine's prefill to
// rounding, and every rank's slot ends with the final state.
TEST_CASE("context parallel on CUDA: a prefill split over ranks equals one engine's [cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  const std::int64_t T = 100, H = 2, D = 128;
  const std::size_t width = static_cast<std::size_t>(H * D);
  const std::vector<bf16_bits> q = kda::test::random_bf16(T * width, 1.0f, 1),
                               k = kda::test::random_bf16(T * width, 1.0f, 2),
                               v = kda::test::random_bf16(T * width, 1.0f, 3),
                               g = kda::test::random_bf16(T * width, 1.0f, 4),
                               beta = kda::test::random_bf16(T * H, 1.0f, 5);
  DeviceBuffer dq = DeviceBuffer::from(q), dk = DeviceBuffer::from(k), dv = DeviceBuffer::from(v),
               dg = DeviceBuffer::from(g), dbeta = DeviceBuffer::from(beta);
  std::vector<float> initial(static_cast<std::size_t>(H * D * D));
  for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = 0.01f * static_cast<float>(i % 13);
  ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");

  std::vector<std::vector<bf16_bits>> want_out(2);
  std::vector<std::vector<float>> want_state(2, std::vector<float>(initial.size()));
  {
    Stream stream;
    EngineOptions o = cuda_options(41, stream.stream);
    Engine one(cp_spec(), o);
    DeviceBuffer out(T * width * sizeof(bf16_bits));
    ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
    const int s = one.acquire_slot();
    for (int l = 0; l < 2; ++l) {
      one.write_slot_state(l, s, initial.data());
      one.prefill(l, {dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get()}, out.get(), {s}, {0, T});
      want_out[l] = download<bf16_bits>(out.get(), T * width, stream.stream);
      one.read_slot_state(l, s, want_state[l].data());
    }
  }

  for (const std::vector<std::int64_t>& ranges :
       {std::vector<std::int64_t>{37, 33, 30}, std::vector<std::int64_t>{0, 100, 0}}) {
    CAPTURE(ranges[0]);
    const int ranks = static_cast<int>(ranges.size());
    auto group = kda::engine::make_cuda_local_communicators(ranks);
    std::vector<std::vector<bf16_bits>> out(2, std::vector<bf16_bits>(T * width, 0xFFFF));
    std::vector<std::vector<std::vector<float>>> states(ranks, std::vector<std::vector<float>>(2));
    check_no_errors(run_on_rank_threads(ranks, [&](int r) {
      Stream stream;
      EngineOptions o = cuda_options(41, stream.stream);
      o.context_group = group[static_cast<std::size_t>(r)].get();
      Engine e(cp_spec(), o);
      DeviceBuffer d_out(T * width * sizeof(bf16_bits));
      ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
      const int slot = e.acquire_slot();
      std::int64_t begin = 0;
      for (int j = 0; j < r; ++j) begin += ranges[static_cast<std::size_t>(j)];
      const std::int64_t n = ranges[static_cast<std::size_t>(r)];
      auto at = [&](const DeviceBuffer& x, std::size_t w) {
        return static_cast<const bf16_bits*>(x.get()) + begin * w;
      };
      bf16_bits* rows = static_cast<bf16_bits*>(d_out.get()) + begin * width;
      for (int l = 0; l < 2; ++l) {
        e.write_slot_state(l, slot, initial.data());
        e.prefill_context_parallel(
            l, {at(dq, width), at(dk, width), at(dv, width), at(dg, width), at(dbeta, H)}, rows,
            slot, n);
        const std::vector<bf16_bits> mine = download<bf16_bits>(rows, n * width, stream.stream);
        std::copy(mine.begin(), mine.end(), out[l].begin() + begin * width);
        states[r][l].resize(initial.size());
        e.read_slot_state(l, slot, states[r][l].data());
      }
    }));
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      const double out_error = kda::test::relative_error(out[l], want_out[l]);
      MESSAGE("context parallel on CUDA over " << ranks << " ranks, layer " << l << ": out "
                                               << out_error);
      CHECK(out_error < 5e-3);
      // The ranks' prefills start from states chained through fp32 transitions, the one engine's
      // runs on: on CUDA each path rounds in its own tensor-core steps (measured 5.3-6.6e-4 over
      // three ranks), so the CUDA-against-CUDA tolerance, not the CPU's 1e-4.
      for (int r = 0; r < ranks; ++r) {
        CAPTURE(r);
        const double state_error = kda::test::relative_error(states[r][l], want_state[l]);
        MESSAGE("rank " << r << " final state " << state_error);
        CHECK(state_error < 5e-3);
      }
    }
  }
#endif
}

#ifdef KDA_HAVE_CUDA
namespace {

// test_parallel.cpp's whole-layer context-parallel model with CUDA's head_dim.
ModelSpec whole_cp_spec() {
  return kda::engine::parse_model_spec(
      "name: cpw\nhidden_size: 256\nnum_hidden_layers: 2\n"
      "linear_attn_config: {num_heads: 2, head_dim: 128, kda_layers: [1, 2], "
      "full_attn_layers: [], gate: softplus, short_conv_kernel_size: 4}\n"
      "runtime: {max_tokens: 128, max_sequences: 2}\n",
      "cpw.yaml");
}

}  // namespace
#endif  // KDA_HAVE_CUDA

// test_parallel.cpp's whole-layer case on CUDA: 100 hidden rows from non-zero initial conv and
// recurrent states, split over ranks (threads, streams of one GPU) so that ranges of 0, 1 and 2
// tokens pass the conv history on; each rank's out rows are one engine's prefill_hidden to
// rounding, and every rank's slot ends with the sequence's final states.
TEST_CASE(
    "context parallel whole layers on CUDA: a prefill split over ranks equals one engine's "
    "[cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  const std::int64_t T = 100, E = 256, H = 2, D = 128, W = 4;
  const std::vector<bf16_bits> x = kda::test::random_bf16(T * E, 1.0f, 7);
  DeviceBuffer dx = DeviceBuffer::from(x);
  const kda::test::SlotStates starting = kda::test::starting_slot_states(H, D, W);
  const std::vector<float>& initial = starting.recurrent;
  const std::vector<std::vector<bf16_bits>>& initial_conv = starting.conv;
  ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
  auto start = [&](Engine& e, int l, int slot) {
    kda::test::write_slot_states(e, l, slot, initial, initial_conv);
  };
  using States = kda::test::SlotStates;
  auto read = [&](const Engine& e, int l, int slot) {
    return kda::test::read_slot_states(e, l, slot, initial.size(), initial_conv[0].size());
  };

  std::vector<std::vector<bf16_bits>> want_out(2);
  std::vector<States> want;
  {
    Stream stream;
    Engine one(whole_cp_spec(), cuda_options(41, stream.stream));
    DeviceBuffer out(T * E * sizeof(bf16_bits));
    ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
    const int s = one.acquire_slot();
    for (int l = 0; l < 2; ++l) {
      start(one, l, s);
      one.prefill_hidden(l, dx.get(), out.get(), {s}, {0, T});
      want_out[l] = download<bf16_bits>(out.get(), T * E, stream.stream);
      want.push_back(read(one, l, s));
    }
  }

  for (const std::vector<std::int64_t>& ranges :
       {std::vector<std::int64_t>{63, 37}, std::vector<std::int64_t>{37, 33, 30},
        std::vector<std::int64_t>{0, 100, 0}, std::vector<std::int64_t>{1, 2, 97}}) {
    const int ranks = static_cast<int>(ranges.size());
    std::string name;
    for (const std::int64_t n : ranges) name += (name.empty() ? "" : "/") + std::to_string(n);
    CAPTURE(name);
    auto group = kda::engine::make_cuda_local_communicators(ranks);
    std::vector<std::vector<bf16_bits>> out(2, std::vector<bf16_bits>(T * E, 0xFFFF));
    std::vector<std::vector<States>> states(ranks);
    check_no_errors(run_on_rank_threads(ranks, [&](int r) {
      Stream stream;
      EngineOptions o = cuda_options(41, stream.stream);
      o.context_group = group[static_cast<std::size_t>(r)].get();
      Engine e(whole_cp_spec(), o);
      DeviceBuffer d_out(T * E * sizeof(bf16_bits));
      ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
      const int slot = e.acquire_slot();
      std::int64_t begin = 0;
      for (int j = 0; j < r; ++j) begin += ranges[static_cast<std::size_t>(j)];
      const std::int64_t n = ranges[static_cast<std::size_t>(r)];
      const bf16_bits* rows_in = static_cast<const bf16_bits*>(dx.get()) + begin * E;
      bf16_bits* rows = static_cast<bf16_bits*>(d_out.get()) + begin * E;
      for (int l = 0; l < 2; ++l) {
        start(e, l, slot);
        e.prefill_hidden_context_parallel(l, rows_in, rows, slot, n);
        const std::vector<bf16_bits> mine = download<bf16_bits>(rows, n * E, stream.stream);
        std::copy(mine.begin(), mine.end(), out[l].begin() + begin * E);
        states[r].push_back(read(e, l, slot));
      }
    }));
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      REQUIRE(states[0].size() == 2);
      const double out_error = kda::test::relative_error(out[l], want_out[l]);
      MESSAGE("whole layers on CUDA over " << name << ", layer " << l << ": out " << out_error);
      CHECK(out_error < 5e-3);
      for (int r = 0; r < ranks; ++r) {
        CAPTURE(r);
        const States& st = states[r][l];
        const double state_error = kda::test::relative_error(st.recurrent, want[l].recurrent);
        MESSAGE("rank " << r << " final state " << state_error);
        CHECK(state_error < 5e-3);
        for (int p = 0; p < 3; ++p) {
          CAPTURE(p);
          CHECK(kda::test::relative_error(st.conv[p], want[l].conv[p]) < 5e-3);
        }
      }
    }
  }
#endif
}

TEST_CASE("nccl communicator: one rank's all-reduce and all-gather [cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  if (!kda::engine::nccl_compiled()) {
    std::printf("KDA_SKIP: this build has no NCCL (configure with KDA_NCCL=ON)\n");
    return;
  }
  auto comms = kda::engine::make_nccl_communicators({0});
  REQUIRE(comms.size() == 1);
  Communicator& c = *comms[0];
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.backend() == kda::Backend::kCuda);
  Stream stream;
  const std::vector<float> f32 = random_floats(1001, 7);
  const std::vector<bf16_bits> bf16 = kda::test::random_bf16(1001, 2.0f, 8);
  DeviceBuffer d_f32 = DeviceBuffer::from(f32), d_bf16 = DeviceBuffer::from(bf16);
  DeviceBuffer recv(1001 * sizeof(float));
  ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
  c.all_reduce_sum(d_f32.get(), f32.size(), kda::DType::kF32, stream.stream);
  c.all_reduce_sum(d_bf16.get(), bf16.size(), kda::DType::kBF16, stream.stream);
  c.all_gather(d_f32.get(), recv.get(), f32.size() * sizeof(float), stream.stream);
  CHECK(download<float>(d_f32.get(), f32.size(), stream.stream) == f32);  // one rank: the input
  CHECK(download<bf16_bits>(d_bf16.get(), bf16.size(), stream.stream) == bf16);
  CHECK(download<float>(recv.get(), f32.size(), stream.stream) == f32);
  // Captured in a graph and replayed, as NCCL allows.
  kda::test::Graph graph;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeThreadLocal));
  c.all_gather(d_f32.get(), recv.get(), f32.size() * sizeof(float), stream.stream);
  CUDA_REQUIRE(cudaStreamEndCapture(stream.stream, &graph.graph));
  CUDA_REQUIRE(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  ok_or_throw(kda::memset_device(recv.get(), 0, recv.bytes(), stream.stream), "clear");
  CUDA_REQUIRE(cudaGraphLaunch(graph.exec, stream.stream));
  CHECK(download<float>(recv.get(), f32.size(), stream.stream) == f32);
  CHECK(kda::test::error_of([&] {
          c.all_reduce_sum(d_f32.get(), 4, kda::DType::kI32, stream.stream);
        }) == "nccl communicator: all_reduce_sum of i32 (it sums bf16 and f32)");
#endif
}

// The C API's communicator on CUDA memory: tensor-parallel ranks made through kda_engine.h with a
// kda_communicator over the CUDA in-process group return, bit for bit, what the C++ engines with
// that group return (run_tp's prefill of two sequences and decode step, both layers).
TEST_CASE("tensor parallel on CUDA through the C API's kda_communicator [cuda]") {
  if (!kda::test::gpu_or_skip()) return;  // prints the skip marker without CUDA too
#ifdef KDA_HAVE_CUDA
  const int tp = 2;
  const std::int64_t E = 256;
  auto cpp_group = kda::engine::make_cuda_local_communicators(tp);
  auto c_group = kda::engine::make_cuda_local_communicators(tp);
  std::vector<std::vector<std::vector<bf16_bits>>> want(tp), got(tp);
  check_no_errors(run_on_rank_threads(tp, [&](int r) {
    Stream stream;
    want[r] = run_tp_rank(tp, r, cpp_group[static_cast<std::size_t>(r)].get(), stream.stream);
    const kda_communicator c =
        kda::test::c_communicator(c_group[static_cast<std::size_t>(r)].get(), KDA_BACKEND_CUDA);
    kda_engine_options options;
    if (kda_engine_options_init(&options) != KDA_OK) throw std::runtime_error("options_init");
    options.backend = KDA_BACKEND_CUDA;
    options.seed = 23;
    options.cuda_stream = stream.stream;
    options.communicator = &c;
    options.poison_arena = 1;
    const std::string yaml =
        "name: tp\nhidden_size: 256\nnum_hidden_layers: 2\n"
        "linear_attn_config: {num_heads: 4, head_dim: 128, kda_layers: [1, 2], "
        "full_attn_layers: [], gate: lower_bound, gate_lower_bound: -5.0}\n"
        "runtime: {max_tokens: 64, max_sequences: 3, tp_size: " +
        std::to_string(tp) + ", tp_rank: " + std::to_string(r) + "}\n";
    kda_engine* e = nullptr;
    char err[512] = "";
    if (kda_engine_create_from_string(yaml.c_str(), &options, &e, err, sizeof err) != KDA_OK) {
      c_group[static_cast<std::size_t>(r)]->abort();
      throw std::runtime_error(err);
    }
    const std::vector<bf16_bits> prompt = kda::test::random_bf16(23 * E, 1.0f, 31);
    const std::vector<bf16_bits> step = kda::test::random_bf16(2 * E, 1.0f, 32);
    DeviceBuffer d_prompt = DeviceBuffer::from(prompt), d_step = DeviceBuffer::from(step);
    DeviceBuffer out(prompt.size() * sizeof(bf16_bits));
    ok_or_throw(DeviceBuffer::synchronize(), "buffer setup");
    int slots[2] = {-1, -1};
    kda_status st = kda_engine_acquire_slot(e, &slots[0]);
    if (st == KDA_OK) st = kda_engine_acquire_slot(e, &slots[1]);
    const std::int64_t cu[3] = {0, 9, 23};
    for (int l = 0; l < 2 && st == KDA_OK; ++l) {
      st = kda_engine_prefill_hidden(e, l, d_prompt.get(), out.get(), slots, 2, cu);
      if (st == KDA_OK)
        got[r].push_back(download<bf16_bits>(out.get(), prompt.size(), stream.stream));
    }
    const int reversed[2] = {slots[1], slots[0]};
    for (int l = 0; l < 2 && st == KDA_OK; ++l) {
      st = kda_engine_decode_hidden(e, l, d_step.get(), out.get(), reversed, 2, 1);
      if (st == KDA_OK)
        got[r].push_back(download<bf16_bits>(out.get(), step.size(), stream.stream));
    }
    const std::string message = st == KDA_OK ? "" : kda_engine_last_error(e);
    if (st != KDA_OK) c_group[static_cast<std::size_t>(r)]->abort();
    kda_engine_destroy(e);
    if (st != KDA_OK) throw std::runtime_error(message);
  }));
  for (int r = 0; r < tp; ++r) {
    CAPTURE(r);
    REQUIRE(got[r].size() == want[r].size());
    for (std::size_t i = 0; i < want[r].size(); ++i) {
      CAPTURE(i);
      CHECK(got[r][i] == want[r][i]);
    }
  }
#endif
}
