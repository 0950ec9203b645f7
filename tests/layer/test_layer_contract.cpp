// The layer's contract on each backend: weights placed in caller memory equal self-allocated ones,
// regions and weights refused before anything is written, bad calls refused before anything is
// written, phase times; and, on the host alone, the sizes (which need no device), the config and
// weight checks, random weights and their shards.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/one_launch_exchange.hpp"  // one_launch_max_rows (layer/src)
#include "layer_runner.hpp"
#include "state_slots.hpp"  // find_repeated_slot (kda/src)

using namespace kda;
using namespace kda::test;

KDA_LAYER_CASE("weights placed in caller memory run as self-allocated ones, bit for bit") {
  const std::size_t align = layer::weight_image_alignment(runner.backend());
  const std::string region_error =
      std::string("KDA layer (") + runner.name() + "): the weight image region ";
  for (const bool full_rank : {false, true}) {
    for (const bool bias : {false, true}) {
      CAPTURE(full_rank);
      CAPTURE(bias);
      const layer::Config config =
          runner.config(bias ? GateMode::kLowerBound : GateMode::kSoftplus, full_rank);
      layer::Weights weights = layer::random_weights(config, 6, 3);
      if (bias) weights = with_bias_and_norm(weights);  // every tensor of the image is used
      const std::size_t needed = layer::weight_image_bytes(runner.backend(), config);
      CHECK(needed % align == 0);

      // A region larger than the image, filled with a pattern: the layer writes its image only.
      constexpr unsigned char kPattern = 0x3C;
      const std::unique_ptr<Memory> region = runner.allocate(needed + align);
      region->fill(kPattern);
      const auto own = runner.make(weights);
      const auto placed =
          layer::make_layer(runner.backend(), weights, region->get(), needed + align);
      CHECK(own->backend() == runner.backend());
      CHECK(placed->backend() == runner.backend());
      CHECK(own->weight_bytes() == needed);
      CHECK(placed->weight_bytes() == needed);
      const std::vector<unsigned char> image = region->download();
      CHECK(std::all_of(image.begin() + static_cast<std::ptrdiff_t>(needed), image.end(),
                        [](unsigned char b) { return b == kPattern; }));
      CHECK(region->guards_intact());

      const BatchSpec batch = prefill_batch({7, 1, 12});
      const std::vector<bf16_bits> hidden =
          random_bf16(static_cast<std::size_t>(20 * config.hidden_size), 2.0f, 12);
      Pools own_pools(config, 3);
      own_pools.randomize(13);
      Pools placed_pools = own_pools;
      const LayerRun expected = runner.forward(*own, hidden, batch, &own_pools);
      const LayerRun run = runner.forward(*placed, hidden, batch, &placed_pools);
      CHECK_MESSAGE(run.error.empty(), run.error);
      CHECK(run.all_written);
      CHECK(same_bits(run.out, expected.out));  // the same image, the same arithmetic
      CHECK(placed_pools == own_pools);
      CHECK(region->guards_intact());

      // Refused before a byte is written, naming the numbers.
      constexpr unsigned char kOther = 0x5A;
      const std::unique_ptr<Memory> other = runner.allocate(needed + align);
      other->fill(kOther);
      auto* at = static_cast<unsigned char*>(other->get());
      auto refusal = [&](void* where, std::size_t bytes) {
        return weight_region_refusal(runner.backend(), weights, where, bytes);
      };
      CHECK(refusal(at, needed - 1) == region_error +
                                           "is too small: " + std::to_string(needed - 1) +
                                           " bytes, the layer's weights need " +
                                           std::to_string(needed) + " (weight_image_bytes)");
      CHECK(refusal(at + 4, needed) ==
            region_error + "is not " + std::to_string(align) + "-byte aligned");
      CHECK(refusal(nullptr, needed) == region_error + "is null");
      const std::vector<unsigned char> untouched = other->download();
      CHECK(std::all_of(untouched.begin(), untouched.end(),
                        [](unsigned char b) { return b == kOther; }));
      CHECK(other->guards_intact());
    }
  }
  // A tensor-parallel rank holds its heads only: a smaller image.
  layer::Config shard = runner.config();
  const std::size_t whole_image = layer::weight_image_bytes(runner.backend(), shard);
  shard.tp_size = 2;
  CHECK(layer::weight_image_bytes(runner.backend(), shard) < whole_image);
  shard.tp_size = 3;  // does not divide the heads
  CHECK(error_of([&] { layer::weight_image_bytes(runner.backend(), shard); }).find("tp_size 3") !=
        std::string::npos);
}

KDA_LAYER_CPU_CASE("the CPU weight image is every tensor widened to fp32, each aligned") {
  const std::size_t align = layer::weight_image_alignment(Backend::kCpu);
  for (const bool full_rank : {false, true}) {
    for (const bool bias : {false, true}) {
      CAPTURE(full_rank);
      CAPTURE(bias);
      const layer::Config config = cpu_layer_runner().config(GateMode::kSoftplus, full_rank);
      layer::Weights weights = layer::random_weights(config, 6, 3);
      if (bias) weights = with_bias_and_norm(weights);
      const std::size_t needed = layer::weight_image_bytes(Backend::kCpu, config);
      const std::size_t elements =
          weights.q_proj.size() + weights.k_proj.size() + weights.v_proj.size() +
          weights.f_a_proj.size() + weights.f_b_proj.size() + weights.b_proj.size() +
          weights.g_a_proj.size() + weights.g_b_proj.size() + weights.g_proj.size() +
          weights.o_proj.size() + weights.q_conv.size() + weights.k_conv.size() +
          weights.v_conv.size() +
          static_cast<std::size_t>(config.local_channels()) /* g_b bias, kept without one */ +
          weights.o_norm.size() + weights.A_log.size() + weights.dt_bias.size();
      CHECK(needed >= 4 * elements);
      CHECK(needed < 4 * elements + 16 * align);
    }
  }
}

KDA_LAYER_CASE("bad weights are refused by name") {
  const layer::Weights weights = layer::random_weights(runner.config(), 1, 0);
  layer::Weights broken = weights;
  broken.dt_bias.pop_back();
  CHECK(error_of([&] { runner.make(broken); }).find("dt_bias") != std::string::npos);
  broken = weights;
  broken.A_log[1] = std::nanf("");
  CHECK(error_of([&] { runner.make(broken); }).find("A_log[1]") != std::string::npos);
  broken = weights;
  broken.A_log[2] = 30.0f;  // outside the operator's [-20, 20]
  CHECK(error_of([&] { runner.make(broken); }).find("A_log[2]") != std::string::npos);
  broken = weights;
  broken.dt_bias[5] = std::numeric_limits<float>::infinity();
  CHECK(error_of([&] { runner.make(broken); }).find("dt_bias[") != std::string::npos);
  // Each output gate form has its matrices and not the other's.
  const layer::Weights full_rank =
      layer::random_weights(runner.config(GateMode::kSoftplus, true), 1, 0);
  broken = full_rank;
  broken.g_proj.pop_back();
  CHECK(error_of([&] { runner.make(broken); }).find("g_proj holds") != std::string::npos);
  broken = full_rank;
  broken.g_a_proj = weights.g_a_proj;
  CHECK(error_of([&] { runner.make(broken); }).find("g_a_proj (a full-rank gate has none)") !=
        std::string::npos);
  broken = weights;
  broken.g_proj = full_rank.g_proj;
  CHECK(error_of([&] { runner.make(broken); }).find("g_proj (a low-rank gate has none)") !=
        std::string::npos);
}

KDA_LAYER_CASE("bad calls are refused before anything is written") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  const std::int64_t E = config.hidden_size;
  const std::vector<bf16_bits> hidden = random_bf16(static_cast<std::size_t>(6 * E), 1.0f, 3);
  Pools before(config, 2);
  before.randomize(5);
  BatchSpec batch = prefill_batch({2, 4}, {0, 1});
  ForwardSettings settings;
  auto refused = [&](const std::string& message, StatusCode code = StatusCode::kInvalidArgument) {
    const LayerRun run = check_refused(runner, *layer, hidden, batch, before, settings);
    INFO("the error: " << run.error);
    CHECK(run.code == code);
    CHECK(run.error.find(message) != std::string::npos);
  };
  // The batch as uploaded stays 6 tokens when a test edits cu_seqlens.
  auto six_tokens = [](ForwardCall& call) { call.batch.tokens = 6; };

  SUBCASE("workspace too small") {
    settings.change = [](ForwardCall& call) { call.workspace.bytes -= 1; };
    refused("workspace has", StatusCode::kWorkspaceTooSmall);
  }
  SUBCASE("a null workspace") {
    settings.change = [](ForwardCall& call) { call.workspace.ptr = nullptr; };
    refused("workspace.ptr is null");
  }
  SUBCASE("cu_seqlens not ending at tokens") {
    batch.cu_seqlens = {0, 2, 5};
    settings.change = six_tokens;
    refused("cu_seqlens[2] must equal seq_len 6 (got 5)");
  }
  SUBCASE("cu_seqlens not starting at 0") {
    batch.cu_seqlens = {1, 2, 6};
    refused("cu_seqlens[0] must be 0 (got 1)");
  }
  SUBCASE("decreasing cu_seqlens") {
    batch.cu_seqlens = {0, 7, 6};
    refused("cu_seqlens must be non-decreasing: cu_seqlens[2] = 6 < cu_seqlens[1] = 7");
  }
  SUBCASE("slot outside the pool") {
    batch.slots = {0, 2};
    refused("slot 2, outside [0, num_slots = 2)");
  }
  SUBCASE("two sequences on one slot") {
    batch.slots = {0, 0};
    refused("share slot 0");
  }
  SUBCASE("more sequences than rows without a slot list") {
    batch.slots = {};
    settings.change = [](ForwardCall& call) { call.state.num_slots = 1; };
    refused("2 sequences on rows 0..N-1 but num_slots = 1");
  }
  SUBCASE("decode tokens that do not match") {
    settings.change = [](ForwardCall& call) { call.batch.decode_tokens = 2; };
    refused("decode: tokens 6 is not sequences 2 x decode_tokens 2");
  }
  SUBCASE("decode rows whose token count overflows 64 bits") {
    settings.change = [](ForwardCall& call) {
      call.batch.sequences = std::int64_t{1} << 62;
      call.batch.decode_tokens = 4;
      call.batch.tokens = 0;
    };
    refused("decode: tokens 0 is not sequences 4611686018427387904 x decode_tokens 4");
  }
  SUBCASE("decode_tokens above kMaxDecodeTokens") {
    settings.change = [](ForwardCall& call) { call.batch.decode_tokens = kMaxDecodeTokens + 1; };
    refused("decode_tokens 17 is not in [0, 16]");
  }
  SUBCASE("negative decode_tokens") {
    settings.change = [](ForwardCall& call) { call.batch.decode_tokens = -1; };
    refused("decode_tokens -1 is not in [0, 16]");
  }
  SUBCASE("tokens but no sequence") {
    settings.change = [](ForwardCall& call) {
      call.batch.sequences = 0;
      call.batch.slots = nullptr;
      call.batch.slots_host = nullptr;
    };
    refused("6 tokens but no sequence");
  }
  SUBCASE("negative tokens") {
    settings.change = [](ForwardCall& call) { call.batch.tokens = -1; };
    refused("tokens and sequences must be >= 0");
  }
  SUBCASE("slots into a pool of no entries") {
    settings.change = [](ForwardCall& call) { call.state.num_slots = 0; };
    refused("slots are given but State::num_slots is 0 (a pool of no entries)");
  }
  SUBCASE("a null state pool") {
    settings.change = [](ForwardCall& call) { call.state.conv_k = nullptr; };
    refused("a state pool is null");
  }
  SUBCASE("a recurrent pool of another dtype") {
    settings.change = [](ForwardCall& call) { call.state.recurrent_dtype = DType::kI32; };
    refused("is not f32 or bf16");
  }
  SUBCASE("out overlapping hidden") {
    settings.change = [E](ForwardCall& call) {
      call.out = const_cast<bf16_bits*>(call.hidden) + E;
    };
    refused("out overlaps hidden");
  }
  SUBCASE("negative sequences") {
    settings.change = [](ForwardCall& call) { call.batch.sequences = -1; };
    refused("tokens and sequences must be >= 0");
  }
  SUBCASE("decode tokens that are not a multiple of decode_tokens") {
    // 5 / 2 rounds to the 2 sequences: the remainder is refused too.
    settings.change = [](ForwardCall& call) {
      call.batch.decode_tokens = 2;
      call.batch.tokens = 5;
    };
    refused("decode: tokens 5 is not sequences 2 x decode_tokens 2");
  }
  SUBCASE("one token but no sequence") {
    settings.change = [](ForwardCall& call) {
      call.batch.tokens = 1;
      call.batch.sequences = 0;
      call.batch.slots = nullptr;
      call.batch.slots_host = nullptr;
    };
    refused("1 tokens but no sequence");
  }
  SUBCASE("a host copy of num_accepted without num_accepted") {
    static const std::int32_t accepted[2] = {1, 1};
    settings.change = [](ForwardCall& call) { call.batch.num_accepted_host = accepted; };
    refused("num_accepted_host is given but num_accepted is null");
  }
  SUBCASE("a host copy of slots without slots") {
    static const std::int32_t rows[2] = {0, 1};
    settings.change = [](ForwardCall& call) {
      call.batch.slots = nullptr;
      call.batch.slots_host = rows;
    };
    refused("slots_host is given but slots is null");
  }
  SUBCASE("a null conv_v pool") {
    settings.change = [](ForwardCall& call) { call.state.conv_v = nullptr; };
    refused("a state pool is null");
  }
  SUBCASE("a null out") {
    settings.change = [](ForwardCall& call) { call.out = nullptr; };
    refused("hidden or out is null");
  }
  SUBCASE("out overlapping the last tokens of hidden") {
    // Out starts at token 5 of 6: the ranges share one token's E bf16 values (2E bytes).
    settings.change = [E](ForwardCall& call) {
      call.out = const_cast<bf16_bits*>(call.hidden) + 5 * E;
    };
    refused("out overlaps hidden");
  }
  SUBCASE("out overlapping the workspace, a state pool or the batch's arrays") {
    // A forward writes out last: over the states it has just written, the workspace o_proj
    // reads, or metadata a captured graph reads again.
    struct Target {
      const char* name;
      std::function<void*(const ForwardCall&)> at;
    };
    const Target targets[] = {
        {"workspace", [](const ForwardCall& c) { return c.workspace.ptr; }},
        {"recurrent pool", [](const ForwardCall& c) { return c.state.recurrent; }},
        {"conv_v pool", [](const ForwardCall& c) { return static_cast<void*>(c.state.conv_v); }},
        {"slots", [](const ForwardCall& c) { return const_cast<std::int32_t*>(c.batch.slots); }},
        {"cu_seqlens",
         [](const ForwardCall& c) { return const_cast<std::int64_t*>(c.batch.cu_seqlens); }},
    };
    for (const Target& target : targets) {
      CAPTURE(target.name);
      settings.change = [&target](ForwardCall& call) {
        call.out = static_cast<bf16_bits*>(target.at(call));
        call.options.check_pointers = false;
      };
      refused(std::string("out overlaps ") + target.name);
    }
  }
  SUBCASE("out beginning in one buffer and running on over another named before it") {
    // out at the workspace's start, hidden 256 bytes into it: both overlap out, and the message
    // names the buffer out begins in (on CUDA an out at the slots ran on over a pool allocated
    // after them, and the message had named the pool, the first of the list).
    settings.change = [](ForwardCall& call) {
      call.out = static_cast<bf16_bits*>(call.workspace.ptr);
      call.hidden =
          reinterpret_cast<const bf16_bits*>(static_cast<unsigned char*>(call.workspace.ptr) + 256);
      call.options.check_pointers = false;
    };
    refused("out overlaps workspace");
  }
  SUBCASE("the recurrent pool inside the workspace") {
    // What only the core's own checks find (its state against its intermediates): still before
    // the conv writes the conv states. (CUDA's pointer checks find the pool past the workspace's
    // allocation first.)
    if (runner.backend() != Backend::kCpu) return;
    settings.change = [](ForwardCall& call) {
      call.state.recurrent = static_cast<unsigned char*>(call.workspace.ptr) + 256;
    };
    refused("core: out overlaps initial_state");
  }
}

KDA_LAYER_CASE("phase times are added when asked, and change nothing") {
  const layer::Config config = runner.config();
  const layer::Weights weights = layer::random_weights(config, 8, 1);
  const auto layer = runner.make(weights);
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(20 * config.hidden_size), 2.0f, 14);
  for (const BatchSpec& batch : {prefill_batch({13, 7}), decode_batch(4, 5)}) {
    CAPTURE(batch.decode_tokens);
    Pools start(config, 4);
    start.randomize(15);
    Pools plain_pools = start, timed_pools = start;
    const LayerRun plain = runner.forward(*layer, hidden, batch, &plain_pools);
    layer::Times times;
    times.conv = 1.0;  // added to, not overwritten
    ForwardSettings settings;
    settings.change = [&times](ForwardCall& call) { call.options.times = &times; };
    const LayerRun timed = runner.forward(*layer, hidden, batch, &timed_pools, settings);
    check_forward(runner, weights, hidden, batch, start, timed, timed_pools);
    MESSAGE("phases (s): projections " << times.projections << ", conv " << times.conv - 1.0
                                       << ", core " << times.core << ", norm " << times.norm
                                       << ", o_proj " << times.o_proj);
    CHECK(times.projections > 0.0);
    CHECK(times.conv >= 1.0);
    CHECK(times.core > 0.0);
    CHECK(times.norm >= 0.0);
    CHECK(times.o_proj > 0.0);
    CHECK(same_bits(timed.out, plain.out));
    CHECK(timed_pools == plain_pools);
  }
}

// RunOptions::decode_kernel_ran: a CUDA decode step names the kernel it ran (never kAuto), and
// changes nothing by being asked; a prefill, a step of no tokens and the CPU leave it untouched.
KDA_LAYER_CASE("the kernel a decode step ran is reported, and a prefill leaves it untouched") {
  const layer::Config config = runner.config();
  const layer::Weights weights = layer::random_weights(config, 9, 1);
  const auto layer = runner.make(weights);
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(40 * config.hidden_size), 2.0f, 16);
  const bool cuda = runner.backend() == Backend::kCuda;
  for (const BatchSpec& batch :
       {prefill_batch({13, 7}), prefill_batch({0, 0}), decode_batch(0, 1), decode_batch(1, 1),
        decode_batch(3, 1), decode_batch(4, 5), decode_batch(40, 1)}) {
    CAPTURE(batch.decode_tokens);
    CAPTURE(batch.sequences());
    Pools start(config, 40);
    start.randomize(17);
    Pools plain_pools = start, asked_pools = start;
    const LayerRun plain = runner.forward(*layer, hidden, batch, &plain_pools);
    // An out-of-range value, so that "untouched" cannot pass by chance.
    auto ran = static_cast<layer::DecodeKernel>(77);
    ForwardSettings settings;
    settings.change = [&ran](ForwardCall& call) { call.options.decode_kernel_ran = &ran; };
    const LayerRun asked = runner.forward(*layer, hidden, batch, &asked_pools, settings);
    CHECK(same_bits(asked.out, plain.out));
    CHECK(asked_pools == plain_pools);
    const std::string ran_name = layer::to_string(ran);
    CAPTURE(ran_name);
    if (cuda && batch.decode_tokens > 0 && batch.sequences() > 0) {
      CHECK(is_known(ran));
      CHECK(ran != layer::DecodeKernel::kAuto);
      CHECK((ran == layer::DecodeKernel::kOneLaunch) ==
            (batch.decode_tokens == 1 &&
             batch.sequences() <= layer::cuda::one_launch_max_rows(config.num_heads)));
    } else {
      CHECK(static_cast<int>(ran) == 77);
    }
  }
}

KDA_LAYER_CPU_CASE("sizes need no device: workspace and weight image on both backends") {
  layer::Config config = cpu_layer_runner().config();
  config.head_dim = 128;  // a layer either backend runs
  config.hidden_size = 256;
  for (Backend backend : {Backend::kCpu, Backend::kCuda}) {
    const std::string name = backend == Backend::kCpu ? "CPU" : "CUDA";
    CAPTURE(name);
    const std::size_t small = layer::workspace_bytes(backend, config, 1, 1, 1);
    const std::size_t large = layer::workspace_bytes(backend, config, 8192, 64, 64);
    CHECK(small > 0);
    CHECK(large > small + 8192 * 4 * 512);  // at least one fp32 [T, Cl] intermediate
    CHECK(error_of([&] { layer::workspace_bytes(backend, config, -1, 1, 1); }).find(">= 0") !=
          std::string::npos);
    try {
      (void)layer::workspace_bytes(backend, config, std::int64_t{1} << 60, 1, 1);
      FAIL("a workspace of 2^60 tokens was sized");
    } catch (const Error& e) {
      CHECK(e.code() == StatusCode::kOverflow);
    }
    const std::size_t image = layer::weight_image_bytes(backend, config);
    CHECK(image > 0);
    CHECK(image % layer::weight_image_alignment(backend) == 0);
    layer::Config bad = config;
    bad.num_heads = 0;
    CHECK(error_of([&] { layer::weight_image_bytes(backend, bad); }).find("num_heads 0") !=
          std::string::npos);
  }
  // The full-rank gate: g_proj [Cl, E] in place of g_a_proj [D, E] and g_b_proj [Cl, D] (every
  // tensor here a multiple of either backend's alignment, so the images differ by exactly that);
  // on CUDA the fused input projection loses its D columns of g_a, in the image and in the
  // workspace, the one-launch step's exchange words (8 bytes a projected row for each row of a
  // step, in the image: a step of the config's 4 heads takes up to 8 rows) gain the gate's Cl rows
  // for g_a's D, and the CPU's workspace stays as it is.
  layer::Config full_rank = config;
  full_rank.full_rank_gate = true;
  {
    REQUIRE(config.local_heads() == 4);
    const std::int64_t E = config.hidden_size, D = config.head_dim, Cl = config.local_channels();
    const auto delta = [](std::size_t full, std::size_t low) {
      return static_cast<std::int64_t>(full) - static_cast<std::int64_t>(low);
    };
    CHECK(delta(layer::weight_image_bytes(Backend::kCpu, full_rank),
                layer::weight_image_bytes(Backend::kCpu, config)) == 4 * (Cl * E - D * E - Cl * D));
    CHECK(delta(layer::weight_image_bytes(Backend::kCuda, full_rank),
                layer::weight_image_bytes(Backend::kCuda, config)) ==
          2 * (Cl * E - Cl * D - D * E) + 8 * 8 * (Cl - D));
    const std::int64_t T = 8192;
    CHECK(layer::workspace_bytes(Backend::kCpu, full_rank, T, 64, 64) ==
          layer::workspace_bytes(Backend::kCpu, config, T, 64, 64));
    const std::int64_t cuda_delta =
        delta(layer::workspace_bytes(Backend::kCuda, config, T, 64, 64),
              layer::workspace_bytes(Backend::kCuda, full_rank, T, 64, 64));
    MESSAGE("CUDA workspace, low-rank minus full-rank gate: " << cuda_delta << " bytes");
    CHECK(cuda_delta >= 0);
    CHECK(cuda_delta <= 2 * T * D);
  }
  CHECK(layer::can_implement(Backend::kCpu, config).ok());
  CHECK(layer::can_implement(Backend::kCpu, full_rank).ok());
  if (!cuda_compiled()) {
    CHECK(layer::can_implement(Backend::kCuda, config).code() == StatusCode::kBackendUnavailable);
    try {
      (void)layer::make_layer(Backend::kCuda, layer::random_weights(config, 1, 0));
      FAIL("a build without CUDA made a CUDA layer");
    } catch (const Error& e) {
      CHECK(e.code() == StatusCode::kBackendUnavailable);
    }
    CHECK(layer::can_implement(Backend::kCuda, full_rank).code() ==
          StatusCode::kBackendUnavailable);
  } else {
    CHECK(layer::can_implement(Backend::kCuda, config).ok());
    CHECK(layer::can_implement(Backend::kCuda, full_rank).ok());
    // The CUDA kernels run head_dim 128 and conv widths 2..4 only.
    layer::Config other = config;
    other.head_dim = 64;
    CHECK(layer::can_implement(Backend::kCuda, other).code() == StatusCode::kUnsupported);
    other = config;
    other.conv_width = 5;
    CHECK(layer::can_implement(Backend::kCuda, other).code() == StatusCode::kUnsupported);
  }
  layer::Config bad = config;
  bad.norm_eps = 0.0f;
  CHECK(layer::can_implement(Backend::kCpu, bad).code() == StatusCode::kInvalidArgument);
}

KDA_LAYER_CPU_CASE("weights: a rank's random weights are its shard of the whole layer's") {
  // Every tensor of a rank's random weights, generated for the shard alone, equals the shard
  // taken of the whole layer's.
  auto check_same = [](const layer::Weights& a, const layer::Weights& b) {
    CHECK(a.q_proj == b.q_proj);
    CHECK(a.k_proj == b.k_proj);
    CHECK(a.v_proj == b.v_proj);
    CHECK(a.q_conv == b.q_conv);
    CHECK(a.k_conv == b.k_conv);
    CHECK(a.v_conv == b.v_conv);
    CHECK(a.f_a_proj == b.f_a_proj);
    CHECK(a.f_b_proj == b.f_b_proj);
    CHECK(a.b_proj == b.b_proj);
    CHECK(a.g_a_proj == b.g_a_proj);
    CHECK(a.g_b_proj == b.g_b_proj);
    CHECK(a.g_proj == b.g_proj);
    CHECK(a.g_b_bias == b.g_b_bias);
    CHECK(a.A_log == b.A_log);
    CHECK(a.dt_bias == b.dt_bias);
    CHECK(a.o_norm == b.o_norm);
    CHECK(a.o_proj == b.o_proj);
    CHECK(a.origin == b.origin);
  };
  layer::Config config = cpu_layer_runner().config();
  const layer::Weights full = layer::random_weights(config, 5, 4);
  // Reproducible for (seed, layer), and other for another layer, another seed, another tensor.
  check_same(layer::random_weights(config, 5, 4), full);
  CHECK(layer::random_weights(config, 5, 3).q_proj != full.q_proj);
  CHECK(layer::random_weights(config, 6, 4).q_proj != full.q_proj);
  CHECK(full.k_proj != full.q_proj);
  // U(-b, b), b = 1/sqrt(fan_in): every value inside, none beyond, and the mean and the mean
  // square those of the distribution (within four standard deviations of their estimates).
  const double bound = 1.0 / std::sqrt(static_cast<double>(config.hidden_size));
  double sum = 0.0, sum_squares = 0.0, largest = 0.0;
  for (const bf16_bits bits : full.q_proj) {
    const double value = bf16_to_float(bits);
    sum += value;
    sum_squares += value * value;
    largest = std::max(largest, std::abs(value));
  }
  const double n = static_cast<double>(full.q_proj.size());
  CHECK(largest <= bound * (1.0 + 1.0 / 128));  // bf16 rounding
  CHECK(largest >= 0.99 * bound);
  // The mean's standard deviation is b / sqrt(3 n); the mean square's b^2 sqrt(4 / 45 / n).
  CHECK(std::abs(sum / n) < 4.0 * bound / std::sqrt(3.0 * n));
  CHECK(std::abs(sum_squares / n - bound * bound / 3.0) <
        4.0 * bound * bound * std::sqrt(4.0 / 45.0 / n));
  for (const int tp : {2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      CAPTURE(tp);
      CAPTURE(rank);
      config.tp_size = tp;
      config.tp_rank = rank;
      const layer::Weights shard = layer::shard_weights(full, tp, rank);
      check_same(layer::random_weights(config, 5, 4), shard);
      CHECK(shard.A_log.size() == static_cast<std::size_t>(config.num_heads / tp));
      CHECK(shard.f_a_proj == full.f_a_proj);  // replicated
    }
  }
  // Tensors of 2^21 values and more are filled by several threads where the machine has them:
  // the same values, and the same shards.
  layer::Config large = cpu_layer_runner().config();
  large.hidden_size = 2048;
  large.num_heads = 8;
  large.head_dim = 128;
  const layer::Weights large_full = layer::random_weights(large, 7, 1);
  REQUIRE(large_full.q_proj.size() >= (std::size_t{1} << 21));
  large.tp_size = 2;
  large.tp_rank = 1;
  check_same(layer::random_weights(large, 7, 1), layer::shard_weights(large_full, 2, 1));
  // The full-rank gate is column-parallel: rank r holds rows [r Cl, (r + 1) Cl) of g_proj.
  layer::Config full_rank = cpu_layer_runner().config(GateMode::kSoftplus, true);
  const layer::Weights whole = layer::random_weights(full_rank, 5, 4);
  const std::size_t rows = static_cast<std::size_t>(full_rank.num_heads * full_rank.head_dim / 2);
  const std::size_t E = static_cast<std::size_t>(full_rank.hidden_size);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    full_rank.tp_size = 2;
    full_rank.tp_rank = rank;
    const layer::Weights shard = layer::shard_weights(whole, 2, rank);
    REQUIRE(shard.g_proj.size() == rows * E);
    CHECK(std::equal(shard.g_proj.begin(), shard.g_proj.end(),
                     whole.g_proj.begin() + static_cast<std::ptrdiff_t>(rank * rows * E)));
    check_same(layer::random_weights(full_rank, 5, 4), shard);
    CHECK(shard.g_a_proj.empty());
    CHECK(shard.g_b_proj.empty());
  }
  // A shard of a shard, and a tp_size that does not divide the heads, are refused.
  CHECK(error_of([&] {
          layer::shard_weights(layer::shard_weights(full, 2, 0), 2, 0);
        }).find("already a shard") != std::string::npos);
  layer::Config three = cpu_layer_runner().config();
  three.tp_size = 3;
  CHECK(error_of([&] { layer::validate(three); }).find("tp_size 3") != std::string::npos);
  layer::Weights broken = full;
  broken.o_proj.pop_back();
  CHECK(error_of([&] { layer::check_sizes(broken); }).find("o_proj") != std::string::npos);
}

KDA_LAYER_CPU_CASE("random weights: each tensor uniform within 1/sqrt(fan_in), its own fan_in") {
  // PyTorch's default bound, 1/sqrt(fan_in), with each weight's own fan_in: E for the [., E]
  // matrices, D for the low-rank second factors, C for o_proj, W for a depthwise conv ([C, 1, W]).
  // Every value within it (bf16 rounding aside), the largest of each tensor near it.
  for (const bool full_rank : {false, true}) {
    CAPTURE(full_rank);
    const layer::Config config = cpu_layer_runner().config(GateMode::kSoftplus, full_rank);
    const std::int64_t E = config.hidden_size, D = config.head_dim, W = config.conv_width;
    const std::int64_t C = config.num_heads * D;
    REQUIRE(E != D);
    REQUIRE(E != C);
    const layer::Weights w = layer::random_weights(config, 11, 2);
    auto check_bound = [](const char* name, auto values, std::int64_t fan_in) {
      CAPTURE(name);
      REQUIRE(!values.empty());
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      double largest = 0.0;
      for (const auto value : values) largest = std::max(largest, std::abs(double{value}));
      CHECK(largest <= bound * (1.0 + 1.0 / 128));
      CHECK(largest >= 0.9 * bound);
    };
    auto floats = [](const std::vector<bf16_bits>& bits) {
      std::vector<float> values;
      for (const bf16_bits b : bits) values.push_back(bf16_to_float(b));
      return values;
    };
    check_bound("q_proj", floats(w.q_proj), E);
    check_bound("k_proj", floats(w.k_proj), E);
    check_bound("v_proj", floats(w.v_proj), E);
    check_bound("q_conv", w.q_conv, W);
    check_bound("k_conv", w.k_conv, W);
    check_bound("v_conv", w.v_conv, W);
    check_bound("f_a_proj", floats(w.f_a_proj), E);
    check_bound("f_b_proj", floats(w.f_b_proj), D);
    check_bound("b_proj", floats(w.b_proj), E);
    if (full_rank) {
      check_bound("g_proj", floats(w.g_proj), E);
    } else {
      check_bound("g_a_proj", floats(w.g_a_proj), E);
      check_bound("g_b_proj", floats(w.g_b_proj), D);
    }
    check_bound("o_proj", floats(w.o_proj), C);
    // o_norm is 1, no g_b bias.
    CHECK(w.o_norm == std::vector<bf16_bits>(static_cast<std::size_t>(D), float_to_bf16(1.0f)));
    CHECK(w.g_b_bias.empty());
  }
}

KDA_LAYER_CPU_CASE(
    "validate: each range holds its ends, refuses one past them, and a rank past the last") {
  const layer::Config base = cpu_layer_runner().config();
  // `change` applied to the base config: the message of validate's refusal, or "(no error)".
  auto refusal = [&](const std::function<void(layer::Config&)>& change) {
    layer::Config c = base;
    change(c);
    return error_of([&] { layer::validate(c); });
  };
  auto refused = [&](const std::function<void(layer::Config&)>& change, const std::string& what) {
    const std::string message = refusal(change);
    CAPTURE(message);
    return message.find("KDA layer config: " + what) != std::string::npos;
  };
  CHECK(refusal([](layer::Config&) {}) == "(no error)");
  // hidden_size [1, 2^20], num_heads [1, 4096], head_dim [1, 1024], conv_width [1, 16]: both ends
  // held, one past each refused.
  CHECK(refusal([](layer::Config& c) { c.hidden_size = std::int64_t{1} << 20; }) == "(no error)");
  CHECK(refused([](layer::Config& c) { c.hidden_size = (std::int64_t{1} << 20) + 1; },
                "hidden_size 1048577 is not in [1, 2^20]"));
  CHECK(refusal([](layer::Config& c) { c.hidden_size = 1; }) == "(no error)");
  CHECK(refused([](layer::Config& c) { c.hidden_size = 0; }, "hidden_size 0"));
  CHECK(refusal([](layer::Config& c) { c.num_heads = 4096; }) == "(no error)");
  CHECK(
      refused([](layer::Config& c) { c.num_heads = 4097; }, "num_heads 4097 is not in [1, 4096]"));
  CHECK(refusal([](layer::Config& c) { c.head_dim = 1024; }) == "(no error)");
  CHECK(refused([](layer::Config& c) { c.head_dim = 1025; }, "head_dim 1025 is not in [1, 1024]"));
  CHECK(refusal([](layer::Config& c) { c.conv_width = layer::kMaxConvWidth; }) == "(no error)");
  CHECK(refused([](layer::Config& c) { c.conv_width = layer::kMaxConvWidth + 1; },
                "conv_width 17 is not in [1, 16]"));
  CHECK(refusal([](layer::Config& c) { c.conv_width = 1; }) == "(no error)");
  CHECK(refused([](layer::Config& c) { c.conv_width = 0; }, "conv_width 0"));
  // The lower bound [-5, 0): -5 held, 0 and NaN refused (only where the gate uses it).
  auto bounded = [](float bound) {
    return [bound](layer::Config& c) {
      c.gate = GateMode::kLowerBound;
      c.lower_bound = bound;
    };
  };
  CHECK(refusal(bounded(-5.0f)) == "(no error)");
  CHECK(refusal(bounded(-1e-6f)) == "(no error)");
  CHECK(refused(bounded(0.0f), "lower_bound 0 is not in [-5, 0)"));
  CHECK(refused(bounded(std::nanf("")), "lower_bound"));
  CHECK(refused(bounded(-5.01f), "lower_bound"));
  // Every digit a float holds: the float just below -5 does not read as -5.
  CHECK(
      refused(bounded(std::nextafter(-5.0f, -6.0f)), "lower_bound -5.00000048 is not in [-5, 0)"));
  CHECK(refusal([](layer::Config& c) { c.lower_bound = 0.0f; }) == "(no error)");  // softplus
  // norm_eps finite and > 0: an infinite or NaN epsilon is refused as 0 is.
  CHECK(refused([](layer::Config& c) { c.norm_eps = std::numeric_limits<float>::infinity(); },
                "norm_eps inf is not finite and > 0"));
  CHECK(refused([](layer::Config& c) { c.norm_eps = std::nanf(""); }, "norm_eps"));
  CHECK(refused([](layer::Config& c) { c.norm_eps = 0.0f; }, "norm_eps"));
  CHECK(refused([](layer::Config& c) { c.norm_eps = -1e-10f; },
                "norm_eps -1.00000001e-10 is not finite and > 0"));
  // tp_rank in [0, tp_size): the last rank held, tp_size itself and -1 refused.
  CHECK(refusal([](layer::Config& c) {
          c.tp_size = 4;
          c.tp_rank = 3;
        }) == "(no error)");
  CHECK(refused(
      [](layer::Config& c) {
        c.tp_size = 4;
        c.tp_rank = 4;
      },
      "tp_rank 4 is not in [0, tp_size 4)"));
  CHECK(refused(
      [](layer::Config& c) {
        c.tp_size = 2;
        c.tp_rank = -1;
      },
      "tp_rank -1 is not in [0, tp_size 2)"));
  // A shard of a rank outside the ranks is refused, not read past the whole layer's tensors.
  const layer::Weights full = layer::random_weights(base, 3, 0);
  CHECK(error_of([&] { layer::shard_weights(full, 2, 2); }).find("tp_rank 2") != std::string::npos);
  CHECK(error_of([&] { layer::shard_weights(full, 2, -1); }).find("tp_rank -1") !=
        std::string::npos);
}

KDA_LAYER_CPU_CASE("check_sizes names each vector of the wrong size: A_log, o_norm, g_b_bias") {
  const layer::Config config = cpu_layer_runner().config();
  const layer::Weights weights = with_bias_and_norm(layer::random_weights(config, 2, 1));
  CHECK(error_of([&] { layer::check_sizes(weights); }) == "(no error)");
  auto refusal = [&](const std::function<void(layer::Weights&)>& change) {
    layer::Weights broken = weights;
    change(broken);
    return error_of([&] { layer::check_sizes(broken); });
  };
  // One value a head of A_log, one a channel of the bias, head_dim of the norm; each name and size.
  CHECK(refusal([](layer::Weights& w) {
          w.A_log.pop_back();
        }).find("KDA layer weights: A_log holds 3 values, expected 4") != std::string::npos);
  CHECK(refusal([](layer::Weights& w) {
          w.A_log.push_back(0.5f);
        }).find("A_log holds 5 values, expected 4") != std::string::npos);
  CHECK(refusal([](layer::Weights& w) {
          w.o_norm.pop_back();
        }).find("o_norm holds 15 values, expected 16") != std::string::npos);
  CHECK(refusal([](layer::Weights& w) {
          w.g_b_bias.pop_back();
        }).find("g_b_bias holds 63 values, expected 64") != std::string::npos);
  // A rank's bias is its channels': the whole layer's is refused for a shard.
  layer::Weights shard = layer::shard_weights(weights, 2, 1);
  CHECK(error_of([&] { layer::check_sizes(shard); }) == "(no error)");
  shard.g_b_bias = weights.g_b_bias;
  CHECK(error_of([&] {
          layer::check_sizes(shard);
        }).find("g_b_bias holds 64 values, expected 32") != std::string::npos);
  // No bias at all is a layer without one.
  CHECK(refusal([](layer::Weights& w) { w.g_b_bias.clear(); }) == "(no error)");
}

// Inputs at the extremes of the host-side entry points: refused by kda::Error naming them, where
// a size would otherwise leave int64 or a count index a vector of none.
KDA_LAYER_CPU_CASE("configs, sizes and random parameters at their extremes are refused by name") {
  const layer::Config config = cpu_layer_runner().config();
  layer::Config bad_gate = config;
  bad_gate.gate = static_cast<GateMode>(7);
  CHECK(error_of([&] { layer::validate(bad_gate); }) ==
        "KDA layer config: gate 7 is not kLowerBound or kSoftplus");
  CHECK(layer::can_implement(Backend::kCpu, bad_gate).code() == StatusCode::kInvalidArgument);
  // A tp_size of 0 gives problems without heads, refused by their own checks (no division).
  layer::Config no_ranks = config;
  no_ranks.tp_size = 0;
  CHECK(no_ranks.local_heads() == 0);
  CHECK(validate(layer::core_prefill_problem(no_ranks, 16, 1, 0, DType::kF32)).code() ==
        StatusCode::kInvalidArgument);
  CHECK(validate(layer::core_decode_problem(no_ranks, 1, 1, 1, DType::kF32)).code() ==
        StatusCode::kInvalidArgument);
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const Backend backend : {Backend::kCpu, Backend::kCuda}) {
    CAPTURE(static_cast<int>(backend));
    for (const auto& [tokens, sequences, slots] :
         {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, kMax, 0},
          {0, 0, kMax},
          {kMax, 1, 1},
          {(std::int64_t{1} << 62) + 1, 0, 0}}) {
      CHECK(error_of([&, tokens = tokens, sequences = sequences, slots = slots] {
              layer::workspace_bytes(backend, config, tokens, sequences, slots);
            }).find("overflows 64 bits") != std::string::npos);
    }
  }
  CHECK(error_of([] { layer::random_gate_parameters(1, 0, -1, 16); }) ==
        "random_gate_parameters: -1 heads of head_dim 16, expected positive sizes of at most 2^32 "
        "values");
  CHECK(error_of([] {
          layer::random_gate_parameters(1, 0, 2, std::int64_t{1} << 62);
        }).find("random_gate_parameters: 2 heads of head_dim") == 0);
  // A prefill whose tokens x hidden_size bytes leave 64 bits: refused as such (the overlap check
  // of out and hidden is the first to multiply them), not by a wrapped product.
  layer::Config wide = config;
  wide.hidden_size = std::int64_t{1} << 20;
  wide.num_heads = 1;
  wide.head_dim = 1;
  wide.tp_size = 1;
  wide.tp_rank = 0;
  const auto layer = layer::make_layer(Backend::kCpu, layer::random_weights(wide, 1, 0));
  const std::int64_t T = std::int64_t{1} << 44;
  const std::int64_t cu[2] = {0, T};
  layer::Batch batch;
  batch.tokens = T;
  batch.sequences = 1;
  batch.cu_seqlens = cu;
  std::vector<bf16_bits> conv(8), rows(8);
  std::vector<float> recurrent(8);
  layer::State state;
  state.num_slots = 1;
  state.conv_q = state.conv_k = state.conv_v = conv.data();
  state.recurrent = recurrent.data();
  CHECK(error_of([&] {
          layer->forward(batch, rows.data(), rows.data() + 4, state, Workspace{}, {});
        }) == "KDA layer forward (CPU): tokens x hidden_size overflows 64-bit byte counts");
}

// decode_tokens at its limit, kda::kMaxDecodeTokens, is a decode step like any other (the limit
// itself is taken; one more is refused, "bad calls are refused before anything is written").
KDA_LAYER_CPU_CASE("a decode step of kMaxDecodeTokens tokens a row runs") {
  LayerRunner& runner = cpu_layer_runner();
  const layer::Config config = runner.config();
  const layer::Weights weights = layer::random_weights(config, 1, 0);
  const auto layer = runner.make(weights);
  const std::int64_t N = 2, T = N * kMaxDecodeTokens;
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(T * config.hidden_size), 1.0f, 3);
  Pools pools(config, 3);
  pools.randomize(5);
  const Pools before = pools;
  const BatchSpec batch = decode_batch(N, kMaxDecodeTokens, {2, 0});
  const LayerRun run = runner.forward(*layer, hidden, batch, &pools);
  REQUIRE_MESSAGE(run.error.empty(), run.error);
  check_forward(runner, weights, hidden, batch, before, run, pools);
}

// Layer::core_inputs() is a prefill's: checkpoints (as decode, verify and records) are refused
// before the conv writes a state.
KDA_LAYER_CPU_CASE("core_inputs refuses checkpoints before anything is written") {
  LayerRunner& runner = cpu_layer_runner();
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  const std::vector<bf16_bits> hidden =
      random_bf16(static_cast<std::size_t>(20 * config.hidden_size), 1.0f, 3);
  Pools pools(config, 4);
  pools.randomize(4);
  const BatchSpec batch = prefill_batch({16, 4}, {0, 1});
  ForwardBuffers<HostBuffer> buffers(
      hidden, batch, pools,
      layer::workspace_bytes(Backend::kCpu, config, batch.tokens(), batch.sequences(), 4));
  ForwardCall call = buffers.call(batch, pools, true);
  const std::vector<std::int64_t> offsets{16, -1};
  const std::vector<std::int32_t> rows{2, -1};
  call.batch.checkpoints = 1;
  call.batch.checkpoint_offsets = offsets.data();
  call.batch.checkpoint_slots = rows.data();
  CHECK(
      error_of([&] { layer->core_inputs(call.batch, call.hidden, call.state, call.workspace); }) ==
      "KDA layer core inputs (CPU): core inputs are a prefill's: no decode, verify, records or "
      "checkpoints");
  Pools after = pools;
  buffers.download(&after);
  CHECK(after == pools);
  CHECK(buffers.guards_intact());
}

TEST_CASE(
    "find_repeated_slot: the first repeat, below and above the bitmap's slots, padding skipped "
    "[cpu]") {
  using kda::detail::find_repeated_slot;
  using Found = std::pair<std::int64_t, std::int64_t>;
  auto find = [](const std::vector<std::int32_t>& slots, std::int32_t padding = -1) {
    return find_repeated_slot(slots.data(), static_cast<std::int64_t>(slots.size()),
                              [&](std::int32_t s) { return s < 0 || s == padding; });
  };
  CHECK(find({}) == Found{-1, -1});
  CHECK(find({0, 1, 2, 65535}) == Found{-1, -1});
  CHECK(find({3, 1, 3}) == Found{0, 2});
  CHECK(find({5, 7, 7, 5}) == Found{1, 2});  // the first entry that repeats an earlier one
  CHECK(find({-1, -1, -7, -7}) == Found{-1, -1});
  CHECK(find({0, 4, 0}, 0) == Found{-1, -1});  // the padding slot may repeat
  // Slots past the bitmap's 65,536 are found by a scan of the earlier entries.
  CHECK(find({65536, 70000, 65536}) == Found{0, 2});
  CHECK(find({1 << 30, 2, 1 << 30}) == Found{0, 2});
  CHECK(find({65536, 65535, 65537, 65535}) == Found{1, 3});
  CHECK(find({std::numeric_limits<std::int32_t>::max(), 0,
              std::numeric_limits<std::int32_t>::max()}) == Found{0, 2});
  // Many distinct rows, then one repeat at the end.
  std::vector<std::int32_t> many(100000);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = static_cast<std::int32_t>(i * 3);
  CHECK(find(many) == Found{-1, -1});
  many.push_back(3 * 40000);
  CHECK(find(many) == Found{40000, 100000});
  many.back() = 3;
  CHECK(find(many) == Found{1, 100000});
}

// The CPU layer uses none of these options, but refuses what no backend knows, as CUDA does.
KDA_LAYER_CASE(
    "a decode_kernel or schedule that is none of the enumeration's is refused before anything "
    "runs") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  Pools pools(config, 2);
  const Pools before = pools;
  ForwardSettings settings;
  settings.change = [](ForwardCall& call) {
    call.options.decode_kernel = static_cast<layer::DecodeKernel>(7);
  };
  const LayerRun run =
      runner.forward(*layer, random_bf16(static_cast<std::size_t>(2 * config.hidden_size), 1.0f, 5),
                     decode_batch(2, 1), &pools, settings);
  CHECK(run.code == StatusCode::kInvalidArgument);
  CHECK(run.error == runner.forward_error_prefix() +
                         "RunOptions::decode_kernel 7 is not a kda::layer::DecodeKernel");
  CHECK(pools == before);
  settings.change = [](ForwardCall& call) {
    call.options.schedule = static_cast<PrefillSchedule>(77);
  };
  const LayerRun prefill =
      runner.forward(*layer, random_bf16(static_cast<std::size_t>(2 * config.hidden_size), 1.0f, 5),
                     prefill_batch({2}, {0}), &pools, settings);
  CHECK(prefill.code == StatusCode::kInvalidArgument);
  CHECK(prefill.error ==
        runner.forward_error_prefix() + "RunOptions::schedule 77 is not a kda::PrefillSchedule");
  CHECK(pools == before);
}

KDA_LAYER_CASE("a fused_cluster other than 0, 1, 2, 4 or 8 is refused before anything runs") {
  const layer::Config config = runner.config();
  const auto layer = runner.make(layer::random_weights(config, 1, 0));
  for (const int cluster : {3, 16, -1, 5}) {
    CAPTURE(cluster);
    Pools pools(config, 2);
    const Pools before = pools;
    ForwardSettings settings;
    settings.change = [cluster](ForwardCall& call) { call.options.fused_cluster = cluster; };
    const LayerRun run = runner.forward(
        *layer, random_bf16(static_cast<std::size_t>(2 * config.hidden_size), 1.0f, 5),
        decode_batch(2, 1), &pools, settings);
    CHECK(run.code == StatusCode::kInvalidArgument);
    CHECK(run.error == runner.forward_error_prefix() + "RunOptions::fused_cluster " +
                           std::to_string(cluster) + " is not 0, 1, 2, 4 or 8");
    CHECK(pools == before);
  }
}

TEST_CASE(
    "Config's head and channel counts of a config validate refuses are 0, not an overflow [cpu]") {
  layer::Config c;
  c.num_heads = std::numeric_limits<std::int64_t>::max();
  c.head_dim = 2;
  CHECK(c.local_heads() == c.num_heads);
  CHECK(c.local_channels() == 0);
  c.head_dim = -128;
  CHECK(c.local_channels() == 0);
  c.num_heads = 8;
  c.head_dim = 128;
  c.tp_size = 2;
  CHECK(c.local_channels() == 512);
  c.tp_size = 0;
  CHECK(c.local_heads() == 0);
  CHECK(c.local_channels() == 0);
}
