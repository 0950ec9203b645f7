// layer/src/weights.cpp — a whole KDA layer's weights: their config's checks, random weights,
// tensor-parallel shards.
#include "kda/layer/weights.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <thread>

#include "kda/error.hpp"

namespace kda::layer {

namespace {

// A config's bounds (validate): heads, and channels a head.
constexpr std::int64_t kMaxHeads = 4096, kMaxHeadDim = 1024;

[[noreturn]] void invalid(const std::string& message) {
  throw Error(StatusCode::kInvalidArgument, message);
}

std::size_t to_size(std::int64_t n) { return static_cast<std::size_t>(n); }

// A float as a message shows it: every digit a float holds (std::to_string's six decimals showed
// a bound just past -5 as -5.000000 and -1e-10 as -0.000000).
std::string float_text(float value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(value));
  return text;
}

// Rows [begin, begin + count) of a row-major matrix with `cols` columns.
template <typename T>
std::vector<T> rows(const std::vector<T>& matrix, std::int64_t cols, std::int64_t begin,
                    std::int64_t count) {
  if (matrix.empty()) return {};
  return std::vector<T>(matrix.begin() + begin * cols, matrix.begin() + (begin + count) * cols);
}

// Columns [begin, begin + count) of a row-major matrix with `cols` columns.
template <typename T>
std::vector<T> columns(const std::vector<T>& matrix, std::int64_t cols, std::int64_t begin,
                       std::int64_t count) {
  const std::int64_t n_rows = static_cast<std::int64_t>(matrix.size()) / cols;
  std::vector<T> out;
  out.reserve(to_size(n_rows * count));
  for (std::int64_t r = 0; r < n_rows; ++r) {
    out.insert(out.end(), matrix.begin() + r * cols + begin,
               matrix.begin() + r * cols + begin + count);
  }
  return out;
}

// A shard's origin: the whole layer's, and which rank of how many.
std::string shard_origin(const std::string& origin, int tp_size, int tp_rank) {
  return origin + " (tp rank " + std::to_string(tp_rank) + " of " + std::to_string(tp_size) + ")";
}

}  // namespace

void validate(const Config& c) {
  // Each message built only when its check fails: a commit validates the config on every call and
  // allocates nothing.
  auto require = [](bool ok, auto&& what) {
    if (!ok) invalid("KDA layer config: " + what());
  };
  require(c.hidden_size > 0 && c.hidden_size <= (std::int64_t{1} << 20),
          [&] { return "hidden_size " + std::to_string(c.hidden_size) + " is not in [1, 2^20]"; });
  require(c.num_heads > 0 && c.num_heads <= kMaxHeads, [&] {
    return "num_heads " + std::to_string(c.num_heads) + " is not in [1, " +
           std::to_string(kMaxHeads) + "]";
  });
  require(c.head_dim > 0 && c.head_dim <= kMaxHeadDim, [&] {
    return "head_dim " + std::to_string(c.head_dim) + " is not in [1, " +
           std::to_string(kMaxHeadDim) + "]";
  });
  require(c.conv_width >= 1 && c.conv_width <= kMaxConvWidth, [&] {
    return "conv_width " + std::to_string(c.conv_width) + " is not in [1, " +
           std::to_string(kMaxConvWidth) + "]";
  });
  require(c.gate == GateMode::kLowerBound || c.gate == GateMode::kSoftplus, [&] {
    return "gate " + std::to_string(static_cast<int>(c.gate)) + " is not kLowerBound or kSoftplus";
  });
  require(c.gate != GateMode::kLowerBound ||
              (std::isfinite(c.lower_bound) && c.lower_bound >= -5.0f && c.lower_bound < 0.0f),
          [&] { return "lower_bound " + float_text(c.lower_bound) + " is not in [-5, 0)"; });
  require(std::isfinite(c.norm_eps) && c.norm_eps > 0.0f,
          [&] { return "norm_eps " + float_text(c.norm_eps) + " is not finite and > 0"; });
  require(c.tp_size >= 1 && c.num_heads % c.tp_size == 0, [&] {
    return "tp_size " + std::to_string(c.tp_size) + " does not divide num_heads " +
           std::to_string(c.num_heads);
  });
  require(c.tp_rank >= 0 && c.tp_rank < c.tp_size, [&] {
    return "tp_rank " + std::to_string(c.tp_rank) + " is not in [0, tp_size " +
           std::to_string(c.tp_size) + ")";
  });
}

void check_sizes(const Weights& w) {
  const Config& c = w.config;
  validate(c);
  const std::int64_t E = c.hidden_size, D = c.head_dim, W = c.conv_width;
  const std::int64_t Cl = c.local_channels(), Hl = c.local_heads();
  auto require = [](std::size_t size, std::int64_t expected, const char* name) {
    if (size != to_size(expected)) {
      invalid(std::string("KDA layer weights: ") + name + " holds " + std::to_string(size) +
              " values, expected " + std::to_string(expected));
    }
  };
  require(w.q_proj.size(), Cl * E, "q_proj");
  require(w.k_proj.size(), Cl * E, "k_proj");
  require(w.v_proj.size(), Cl * E, "v_proj");
  require(w.q_conv.size(), Cl * W, "q_conv");
  require(w.k_conv.size(), Cl * W, "k_conv");
  require(w.v_conv.size(), Cl * W, "v_conv");
  require(w.f_a_proj.size(), D * E, "f_a_proj");
  require(w.f_b_proj.size(), Cl * D, "f_b_proj");
  require(w.b_proj.size(), Hl * E, "b_proj");
  if (c.full_rank_gate) {
    require(w.g_proj.size(), Cl * E, "g_proj");
    require(w.g_a_proj.size(), 0, "g_a_proj (a full-rank gate has none)");
    require(w.g_b_proj.size(), 0, "g_b_proj (a full-rank gate has none)");
  } else {
    require(w.g_a_proj.size(), D * E, "g_a_proj");
    require(w.g_b_proj.size(), Cl * D, "g_b_proj");
    require(w.g_proj.size(), 0, "g_proj (a low-rank gate has none)");
  }
  if (!w.g_b_bias.empty()) require(w.g_b_bias.size(), Cl, "g_b_bias");
  require(w.A_log.size(), Hl, "A_log");
  require(w.dt_bias.size(), Cl, "dt_bias");
  require(w.o_norm.size(), D, "o_norm");
  require(w.o_proj.size(), E * Cl, "o_proj");
}

GateParameters random_gate_parameters(std::uint64_t seed, int layer_index, std::int64_t num_heads,
                                      std::int64_t head_dim) {
  // Any positive sizes (a core-only engine's heads may be wider than a whole layer's) whose
  // dt_bias stays a vector of at most 2^32 values.
  constexpr std::int64_t kMaxValues = std::int64_t{1} << 32;
  if (num_heads < 1 || head_dim < 1 || num_heads > kMaxValues / head_dim) {
    invalid("random_gate_parameters: " + std::to_string(num_heads) + " heads of head_dim " +
            std::to_string(head_dim) + ", expected positive sizes of at most 2^32 values");
  }
  // Distinct, reproducible streams per (seed, layer).
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(layer_index), 0x6b6461u};
  std::mt19937_64 generator(seq);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  GateParameters parameters;
  parameters.A_log.resize(static_cast<std::size_t>(num_heads));
  parameters.dt_bias.resize(static_cast<std::size_t>(num_heads * head_dim));
  for (float& a : parameters.A_log) a = static_cast<float>(std::log(1.0 + 15.0 * unit(generator)));
  const double log_lo = std::log(1e-3), log_hi = std::log(1e-1);
  for (float& bias : parameters.dt_bias) {
    const double dt = std::exp(log_lo + (log_hi - log_lo) * unit(generator));
    bias = static_cast<float>(dt + std::log(-std::expm1(-dt)));  // softplus^-1(dt)
  }
  return parameters;
}

namespace {

// A counter-based stream of uniform values in [-1, 1): value i of a tensor is a function of (seed,
// layer, tensor, i) alone (SplitMix64's finalizer on the key plus i times its increment), so a
// shard's rows and columns are the whole tensor's values there without generating the rest, and
// a rank of a model of many layers builds in the time of its own shard (a sequential generator
// made each rank of Kimi K3's TP8 shard generate the whole layer: 9.6 s a layer on one core).
class UniformStream {
 public:
  UniformStream(std::uint64_t seed, int layer_index, std::uint64_t tensor)
      : key_(mix(mix(seed ^ 0x6c61796e00000000ull) ^
                 (static_cast<std::uint64_t>(static_cast<std::uint32_t>(layer_index)) << 16) ^
                 tensor)) {}
  float at(std::uint64_t i) const {
    const std::uint64_t bits = mix(key_ + (i + 1) * kIncrement);
    // The top 24 bits as a float in [0, 1) exactly, then scaled to [-1, 1).
    return static_cast<float>(bits >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }

 private:
  static constexpr std::uint64_t kIncrement = 0x9e3779b97f4a7c15ull;
  static std::uint64_t mix(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t key_;
};

}  // namespace

Weights random_weights(const Config& config, std::uint64_t seed, int layer_index) {
  validate(config);
  const std::int64_t E = config.hidden_size, H = config.num_heads, D = config.head_dim;
  const std::int64_t W = config.conv_width, C = H * D;
  // The shard's heads and channels (all of them without tensor parallelism).
  const std::int64_t Hl = config.local_heads(), Cl = config.local_channels();
  const std::int64_t h0 = config.tp_rank * Hl, c0 = config.tp_rank * Cl;
  enum Tensor : std::uint64_t {
    kQ = 1,
    kK,
    kV,
    kQConv,
    kKConv,
    kVConv,
    kFa,
    kFb,
    kB,
    kGa,
    kGb,
    kG,
    kO
  };
  // Rows [first, first + count) of tensor `t`, a row-major [rows, cols] matrix, columns
  // [col0, col0 + width): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) rounded to bf16.
  auto uniform_bf16 = [&](Tensor t, std::int64_t cols, std::int64_t first, std::int64_t count,
                          std::int64_t fan_in, std::int64_t col0 = 0, std::int64_t width = -1) {
    if (width < 0) width = cols;
    const UniformStream stream(seed, layer_index, t);
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    std::vector<bf16_bits> values(to_size(count * width));
    auto fill = [&](std::int64_t row_begin, std::int64_t row_end) {
      for (std::int64_t r = row_begin; r < row_end; ++r) {
        const std::uint64_t base = static_cast<std::uint64_t>((first + r) * cols + col0);
        bf16_bits* row = values.data() + r * width;
        for (std::int64_t c = 0; c < width; ++c) {
          row[c] = float_to_bf16(bound * stream.at(base + static_cast<std::uint64_t>(c)));
        }
      }
    };
    // Every value is a function of its index alone: the threads' split does not change them.
    const std::int64_t threads = std::min<std::int64_t>(
        std::max(1u, std::thread::hardware_concurrency()), count * width / (std::int64_t{1} << 20));
    if (threads <= 1) {
      fill(0, count);
      return values;
    }
    std::vector<std::thread> pool;
    try {
      for (std::int64_t t = 1; t < threads; ++t) {
        pool.emplace_back(fill, count * t / threads, count * (t + 1) / threads);
      }
    } catch (...) {  // a thread that could not start: its rows below, on this one
    }
    const std::int64_t started = static_cast<std::int64_t>(pool.size()) + 1;
    fill(0, count / threads);
    if (started < threads) fill(count * started / threads, count);
    for (std::thread& thread : pool) thread.join();
    return values;
  };
  auto uniform_conv = [&](Tensor t) {  // bf16-representable, as in a bf16 checkpoint
    const std::vector<bf16_bits> bits = uniform_bf16(t, W, c0, Cl, W);
    std::vector<float> values(bits.size());
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
    return values;
  };

  Weights w;
  w.config = config;
  w.q_proj = uniform_bf16(kQ, E, c0, Cl, E);
  w.k_proj = uniform_bf16(kK, E, c0, Cl, E);
  w.v_proj = uniform_bf16(kV, E, c0, Cl, E);
  w.q_conv = uniform_conv(kQConv);
  w.k_conv = uniform_conv(kKConv);
  w.v_conv = uniform_conv(kVConv);
  w.f_a_proj = uniform_bf16(kFa, E, 0, D, E);  // replicated: every rank needs all of it
  w.f_b_proj = uniform_bf16(kFb, D, c0, Cl, D);
  w.b_proj = uniform_bf16(kB, E, h0, Hl, E);
  if (config.full_rank_gate) {
    w.g_proj = uniform_bf16(kG, E, c0, Cl, E);
  } else {
    w.g_a_proj = uniform_bf16(kGa, E, 0, D, E);
    w.g_b_proj = uniform_bf16(kGb, D, c0, Cl, D);
  }
  w.o_norm.assign(to_size(D), float_to_bf16(1.0f));
  w.o_proj = uniform_bf16(kO, C, 0, E, C, c0, Cl);  // [E, C]: the shard's columns
  GateParameters gate = random_gate_parameters(seed, layer_index, H, D);
  w.A_log = rows(gate.A_log, 1, h0, Hl);
  w.dt_bias = rows(gate.dt_bias, 1, c0, Cl);
  w.origin = "random (seed " + std::to_string(seed) + ")";
  if (config.tp_size > 1) w.origin = shard_origin(w.origin, config.tp_size, config.tp_rank);
  return w;
}

Weights shard_weights(const Weights& full, int tp_size, int tp_rank) {
  check_sizes(full);
  if (full.config.tp_size != 1) invalid("shard_weights: the weights are already a shard");
  Weights shard;
  shard.config = full.config;
  shard.config.tp_size = tp_size;
  shard.config.tp_rank = tp_rank;
  validate(shard.config);
  const std::int64_t E = full.config.hidden_size, D = full.config.head_dim;
  const std::int64_t W = full.config.conv_width;
  const std::int64_t Hl = shard.config.local_heads(), Cl = shard.config.local_channels();
  const std::int64_t h0 = tp_rank * Hl, c0 = tp_rank * Cl;  // first head / channel of the shard

  shard.q_proj = rows(full.q_proj, E, c0, Cl);
  shard.k_proj = rows(full.k_proj, E, c0, Cl);
  shard.v_proj = rows(full.v_proj, E, c0, Cl);
  shard.q_conv = rows(full.q_conv, W, c0, Cl);
  shard.k_conv = rows(full.k_conv, W, c0, Cl);
  shard.v_conv = rows(full.v_conv, W, c0, Cl);
  shard.f_a_proj = full.f_a_proj;  // replicated: every rank needs the whole low-rank factor
  shard.f_b_proj = rows(full.f_b_proj, D, c0, Cl);
  shard.b_proj = rows(full.b_proj, E, h0, Hl);
  shard.g_a_proj = full.g_a_proj;
  shard.g_b_proj = rows(full.g_b_proj, D, c0, Cl);
  shard.g_proj = rows(full.g_proj, E, c0, Cl);
  shard.g_b_bias = rows(full.g_b_bias, 1, c0, Cl);
  shard.A_log = rows(full.A_log, 1, h0, Hl);
  shard.dt_bias = rows(full.dt_bias, 1, c0, Cl);
  shard.o_norm = full.o_norm;
  shard.o_proj = columns(full.o_proj, Cl * tp_size, c0, Cl);
  shard.origin = shard_origin(full.origin, tp_size, tp_rank);
  return shard;
}

}  // namespace kda::layer
