// kda-cpu-bench: tokens/s of the CPU backend on one Kimi-Linear KDA layer (H = 32, K = V = 128,
// softplus gate, fp32 state in and out), one sequence of --tokens tokens, at 1 and 2 threads.
// Prints a markdown table: threads, median ms over --runs runs, tokens/s.
//
//   kda-cpu-bench [--tokens 4096] [--heads 32] [--dim 128] [--runs 3] [--threads 1,2] [--fp64]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kda/bf16.hpp"
#include "kda/kda.hpp"

namespace {

struct Args {
  std::int64_t tokens = 4096;
  std::int64_t heads = 32;
  std::int64_t dim = 128;
  int runs = 3;
  std::vector<int> threads = {1, 2};
  bool fp64 = false;
};

[[noreturn]] void usage(const char* problem) {
  std::fprintf(stderr,
               "kda-cpu-bench: %s\n"
               "usage: kda-cpu-bench [--tokens N] [--heads H] [--dim D] [--runs R] "
               "[--threads 1,2,...] [--fp64]\n",
               problem);
  std::exit(2);
}

std::int64_t parse_positive(const char* flag, const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 1) {
    usage((std::string(flag) + " needs a positive integer, got '" + text + "'").c_str());
  }
  return value;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage((flag + " needs a value").c_str());
      return argv[++i];
    };
    if (flag == "--tokens") {
      a.tokens = parse_positive("--tokens", value());
    } else if (flag == "--heads") {
      a.heads = parse_positive("--heads", value());
    } else if (flag == "--dim") {
      a.dim = parse_positive("--dim", value());
    } else if (flag == "--runs") {
      a.runs = static_cast<int>(parse_positive("--runs", value()));
    } else if (flag == "--threads") {
      a.threads.clear();
      std::string list = value();
      for (std::size_t pos = 0; pos <= list.size();) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        a.threads.push_back(
            static_cast<int>(parse_positive("--threads", list.substr(pos, comma - pos).c_str())));
        pos = comma + 1;
      }
    } else if (flag == "--fp64") {
      a.fp64 = true;
    } else if (flag == "--help" || flag == "-h") {
      usage("help");
    } else {
      usage(("unknown flag " + flag).c_str());
    }
  }
  return a;
}

// Deterministic pseudo-random bf16 values in [-1, 1).
std::vector<kda::bf16_bits> random_bf16(std::size_t count, std::uint64_t seed) {
  std::vector<kda::bf16_bits> out(count);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = kda::float_to_bf16(static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-52 - 1.0));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  kda::Problem p;
  p.batch = 1;
  p.seq_len = args.tokens;
  p.num_heads = args.heads;
  p.head_dim_k = args.dim;
  p.head_dim_v = args.dim;
  p.gate = kda::GateMode::kSoftplus;
  p.initial_state_dtype = kda::DType::kF32;
  p.final_state_dtype = kda::DType::kF32;

  const std::size_t qk = static_cast<std::size_t>(args.tokens * args.heads * args.dim);
  const std::size_t state = static_cast<std::size_t>(args.heads * args.dim * args.dim);
  const auto q = random_bf16(qk, 1), k = random_bf16(qk, 2), v = random_bf16(qk, 3),
             g = random_bf16(qk, 4);
  const auto beta = random_bf16(static_cast<std::size_t>(args.tokens * args.heads), 5);
  std::vector<float> A_log(static_cast<std::size_t>(args.heads), 0.0f);
  std::vector<float> dt_bias(static_cast<std::size_t>(args.heads * args.dim), -2.0f);
  std::vector<float> initial(state, 0.0f), final_state(state);
  std::vector<kda::bf16_bits> out(qk);

  kda::Tensors t;
  t.q = q.data();
  t.k = k.data();
  t.v = v.data();
  t.g = g.data();
  t.beta = beta.data();
  t.A_log = A_log.data();
  t.dt_bias = dt_bias.data();
  t.initial_state = initial.data();
  t.final_state = final_state.data();
  t.out = out.data();
  std::size_t ws_bytes = 0;
  kda::Status st = kda::workspace_size(p, kda::Backend::kCpu, &ws_bytes);
  if (!st) {
    std::fprintf(stderr, "kda-cpu-bench: %s\n", st.to_string().c_str());
    return 1;
  }
  std::vector<unsigned char> workspace(ws_bytes);

  std::printf(
      "CPU backend, one KDA layer: T=%lld H=%lld K=V=%lld, softplus gate, f32 state, %s "
      "accumulation, %u hardware threads\n\n",
      static_cast<long long>(args.tokens), static_cast<long long>(args.heads),
      static_cast<long long>(args.dim), args.fp64 ? "fp64" : "fp32",
      std::thread::hardware_concurrency());
  std::printf("| threads | ms (median of %d) | tokens/s |\n|---:|---:|---:|\n", args.runs);
  for (int threads : args.threads) {
    kda::CpuOptions opt;
    opt.num_threads = threads;
    opt.fp64 = args.fp64;
    std::vector<double> ms;
    for (int r = 0; r < args.runs; ++r) {
      const auto start = std::chrono::steady_clock::now();
      st = kda::forward_cpu(p, t, kda::Workspace{workspace.data(), workspace.size()}, opt);
      const auto stop = std::chrono::steady_clock::now();
      if (!st) {
        std::fprintf(stderr, "kda-cpu-bench: %s\n", st.to_string().c_str());
        return 1;
      }
      ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    std::printf("| %d | %.1f | %.0f |\n", threads, median,
                static_cast<double>(args.tokens) / (median / 1000.0));
  }
  return 0;
}
