// engine_matrix.hpp — the engine's tests on the operator tests' backend matrix
// (kda/backend_matrix.hpp: KDA_MATRIX_CASE, KDA_CPU_CASE, KDA_CUDA_CASE, and the CTest labels they
// get). A case is written once against `runner`, the backend as the test sees it; an engine test
// only needs to know which backend that is, because an engine takes its caller's tensors on its
// own backend (host pointers on the CPU, device pointers on CUDA). So this header adds:
//   engine_options(runner, seed)  EngineOptions for an engine on the runner's backend, its arena
//                                 poisoned
//   Memory(runner, bytes)         caller memory on that backend (HostBuffer / DeviceBuffer: guard
//                                 bytes on both sides), Memory::from(runner, host) uploads,
//                                 download<T>() brings it back
//   Activations, OnBackend        seeded bf16 q, k, v, g, beta on the host, and their copy on a
//                                 backend (OnBackend::inputs() is what prefill / decode take)
//   deviation(got, want)          0 when the two are the same bits, else their relative L2 error
//                                 (infinite where NaN)
//   allowed(runner, cuda[, cpu])  what a comparison may deviate by on the runner's backend: CPU
//                                 references are the CPU's own code, so 0 there unless a case says
//                                 otherwise
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "../kda/backend_matrix.hpp"
#include "kda/engine/engine.hpp"
#include "kda_reference.hpp"

namespace kda::test {

inline engine::BackendChoice backend_choice(const Runner& runner) {
  return runner.backend() == Backend::kCuda ? engine::BackendChoice::kCuda
                                            : engine::BackendChoice::kCpu;
}

// An engine on the runner's backend with seeded random weights; two CPU threads (CI has two
// cores; the results do not depend on the count); its arena poisoned (EngineOptions::
// poison_arena), so that every case also checks that no call reads arena memory nothing wrote.
inline engine::EngineOptions engine_options(const Runner& runner, std::uint64_t seed = 0) {
  engine::EngineOptions options;
  options.backend = backend_choice(runner);
  options.seed = seed;
  options.cpu_threads = 2;
  options.poison_arena = true;
  return options;
}

// Caller memory on a runner's backend, with guard bytes around it.
class Memory {
 public:
  Memory() = default;
  Memory(const Runner& runner, std::size_t bytes, std::size_t guard = 256) {
    if (runner.backend() == Backend::kCuda) {
      buffer_.emplace<DeviceBuffer>(bytes, guard);
    } else {
      buffer_.emplace<HostBuffer>(bytes, guard);
    }
  }
  template <typename T>
  static Memory from(const Runner& runner, const std::vector<T>& host) {
    Memory m;
    if (runner.backend() == Backend::kCuda) {
      m.buffer_ = DeviceBuffer::from(host);
    } else {
      m.buffer_ = HostBuffer::from(host);
    }
    return m;
  }

  void* get() const {
    return std::visit([](const auto& b) { return b.get(); }, buffer_);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(get());
  }
  std::size_t bytes() const {
    return std::visit([](const auto& b) { return b.bytes(); }, buffer_);
  }
  template <typename T>
  std::vector<T> download() const {
    return std::visit([](const auto& b) { return b.template download<T>(); }, buffer_);
  }
  void fill(unsigned char byte) {
    std::visit([byte](auto& b) { b.fill(byte); }, buffer_);
  }
  bool guards_intact() const {
    return std::visit([](const auto& b) { return b.guards_intact(); }, buffer_);
  }

 private:
  std::variant<HostBuffer, DeviceBuffer> buffer_;
};

// `count` values of type T at `ptr`, memory the engine's caller owns on the engine's backend
// (e.g. examples' SyntheticInputs), after the engine's work on it.
template <typename T>
std::vector<T> download(const engine::Engine& engine, const void* ptr, std::size_t count) {
  std::vector<T> host(count);
  if (engine.backend() == Backend::kCuda) {
    REQUIRE(memcpy_to_host(host.data(), ptr, count * sizeof(T), engine.stream()).ok());
  } else {
    std::memcpy(host.data(), ptr, count * sizeof(T));
  }
  return host;
}
inline void fill(const engine::Engine& engine, void* ptr, unsigned char byte, std::size_t bytes) {
  if (engine.backend() == Backend::kCuda) {
    REQUIRE(memset_device(ptr, byte, bytes, engine.stream()).ok());
  } else {
    std::memset(ptr, byte, bytes);
  }
}

// bf16 activations of `tokens` tokens on the host: q, k, v, g [tokens, H, D], beta [tokens, H].
struct Activations {
  std::int64_t tokens = 0, H = 0, D = 0;
  std::vector<std::uint16_t> q, k, v, g, beta;

  Activations(std::int64_t t, std::int64_t h, std::int64_t d, std::uint64_t seed)
      : tokens(t), H(h), D(d) {
    Rng rng(seed);
    q = random_bf16(rng, t * h * d, 1.0);
    k = random_bf16(rng, t * h * d, 1.0);
    v = random_bf16(rng, t * h * d, 1.0);
    g = random_bf16(rng, t * h * d, 1.0);
    beta = random_bf16(rng, t * h, 1.0);
  }
  Activations(std::int64_t h, std::int64_t d) : H(h), D(d) {}  // no tokens yet

  // Appends tokens [t0, t1) of `other`.
  void append(const Activations& other, std::int64_t t0, std::int64_t t1) {
    auto add = [&](std::vector<std::uint16_t>& dst, const std::vector<std::uint16_t>& src,
                   std::int64_t width) {
      dst.insert(dst.end(), src.begin() + t0 * width, src.begin() + t1 * width);
    };
    add(q, other.q, H * D);
    add(k, other.k, H * D);
    add(v, other.v, H * D);
    add(g, other.g, H * D);
    add(beta, other.beta, H);
    tokens += t1 - t0;
  }
  // Tokens [t0, t1).
  Activations slice(std::int64_t t0, std::int64_t t1) const {
    Activations part(H, D);
    part.append(*this, t0, t1);
    return part;
  }
  // The host pointers: what a CPU engine takes.
  engine::LayerInputs host_inputs() const {
    return {q.data(), k.data(), v.data(), g.data(), beta.data()};
  }
  std::size_t out_elems() const { return static_cast<std::size_t>(tokens * H * D); }
};

// Activations on a runner's backend.
struct OnBackend {
  Memory q, k, v, g, beta;
  OnBackend(const Runner& runner, const Activations& a)
      : q(Memory::from(runner, a.q)),
        k(Memory::from(runner, a.k)),
        v(Memory::from(runner, a.v)),
        g(Memory::from(runner, a.g)),
        beta(Memory::from(runner, a.beta)) {}
  engine::LayerInputs inputs() const { return {q.get(), k.get(), v.get(), g.get(), beta.get()}; }
};

// 0 when `got` holds the same bits as `want`; otherwise ||got - want|| / ||want|| (bf16 bits or
// float), at least the smallest positive double, so that `deviation(...) <= 0` means bitwise, and
// infinite when that is NaN (a NaN that is not bit for bit in both fails every comparison).
inline double deviation_of(bool same_bits, const std::vector<double>& got,
                           const std::vector<double>& want) {
  if (same_bits) return 0.0;
  const double e = rel_error(got, want);
  if (std::isnan(e)) return std::numeric_limits<double>::infinity();
  return e > 0.0 ? e : std::numeric_limits<double>::min();
}
inline double deviation(const std::vector<std::uint16_t>& got,
                        const std::vector<std::uint16_t>& want) {
  return deviation_of(got == want, to_doubles(got), to_doubles(want));
}
inline double deviation(const std::vector<float>& got, const std::vector<float>& want) {
  return deviation_of(same_bits(got, want), to_doubles(got), to_doubles(want));
}
// What a comparison with a CPU reference may deviate by on the runner's backend.
inline double allowed(const Runner& runner, double cuda, double cpu = 0.0) {
  return runner.backend() == Backend::kCuda ? cuda : cpu;
}

// One slot's recurrent state of one layer (fp32 states), and its raw bytes.
inline std::vector<float> slot_state(const engine::Engine& e, int layer, int slot) {
  std::vector<float> state(e.state_slot_bytes() / sizeof(float));
  e.read_slot_state(layer, slot, state.data());
  return state;
}
inline std::vector<std::uint8_t> slot_bytes(const engine::Engine& e, int layer, int slot) {
  std::vector<std::uint8_t> bytes(e.state_slot_bytes());
  e.read_slot_state(layer, slot, bytes.data());
  return bytes;
}

// Rows [r0, r1) of a [rows, width] vector.
template <typename T>
std::vector<T> rows_of(const std::vector<T>& x, std::int64_t width, std::int64_t r0,
                       std::int64_t r1) {
  return std::vector<T>(x.begin() + r0 * width, x.begin() + r1 * width);
}
// The same vector without rows [r0, r1) (e.g. a decode batch's padding row).
template <typename T>
std::vector<T> without_rows(const std::vector<T>& x, std::int64_t width, std::int64_t r0,
                            std::int64_t r1) {
  std::vector<T> rest(x.begin(), x.begin() + r0 * width);
  rest.insert(rest.end(), x.begin() + r1 * width, x.end());
  return rest;
}

}  // namespace kda::test
