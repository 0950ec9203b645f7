// cuda_test_util.hpp — buffers with guard bytes (device: DeviceBuffer; host: HostBuffer, the same
// interface) and a case's inputs uploaded into them (CaseBuffers<Buffer>, DeviceCase), through the
// kda device helpers only (no CUDA headers), so that the tests build — and skip — without CUDA.
// tests/kda/backend_matrix.hpp builds its backend runners (which run the cases) on these.
#pragma once

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kda/kda.hpp"
#include "kda_reference.hpp"

namespace kda::test {

// True when a CUDA device is present; otherwise prints the marker CTest reads as "skipped".
inline bool gpu_or_skip() {
  if (cuda_device_count() > 0) return true;
  std::printf("KDA_SKIP: no CUDA device (this test needs one)\n");
  return false;
}

// A device allocation with `guard` bytes of a known pattern before and after the payload, so that a
// test can check that nothing is written outside the tensor.
class DeviceBuffer {
 public:
  static constexpr unsigned char kGuardByte = 0xA5;
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes, std::size_t guard = 256) : bytes_(bytes), guard_(guard) {
    Status st = device_malloc(&base_, bytes + 2 * guard);
    if (!st.ok()) throw std::runtime_error(st.to_string());
    if (guard > 0) {
      memset_device(base_, kGuardByte, guard);
      memset_device(static_cast<unsigned char*>(base_) + guard + bytes, kGuardByte, guard);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    std::swap(guard_, o.guard_);
    return *this;
  }
  ~DeviceBuffer() { device_free(base_); }

  void* get() const { return base_ ? static_cast<unsigned char*>(base_) + guard_ : nullptr; }
  std::size_t bytes() const { return bytes_; }

  template <typename T>
  static DeviceBuffer from(const std::vector<T>& host) {
    DeviceBuffer b(host.size() * sizeof(T));
    // Complete before returning: a copy from pageable memory may still be in flight when the
    // call returns, and work on a non-blocking stream does not wait for the null stream.
    if (!host.empty()) {
      memcpy_to_device(b.get(), host.data(), b.bytes());
      synchronize();
    }
    return b;
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    if (!host.empty()) memcpy_to_host(host.data(), get(), bytes_);
    return host;
  }
  void fill(unsigned char byte) {
    memset_device(get(), byte, bytes_);
    synchronize();
  }
  static Status synchronize() { return stream_synchronize(nullptr); }
  // Whether both guard regions still hold the pattern.
  bool guards_intact() const {
    if (guard_ == 0) return true;
    std::vector<unsigned char> g(guard_);
    for (int side = 0; side < 2; ++side) {
      const unsigned char* p =
          static_cast<const unsigned char*>(base_) + (side ? guard_ + bytes_ : 0);
      memcpy_to_host(g.data(), p, guard_);
      for (unsigned char x : g) {
        if (x != kGuardByte) return false;
      }
    }
    return true;
  }

 private:
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t guard_ = 0;
};

// Host memory with the same interface and the same guard bytes as DeviceBuffer (the CPU backend's
// side of the backend matrix). The payload starts `guard` bytes into a 64-byte aligned block.
class HostBuffer {
 public:
  static constexpr unsigned char kGuardByte = DeviceBuffer::kGuardByte;
  HostBuffer() = default;
  explicit HostBuffer(std::size_t bytes, std::size_t guard = 256)
      : bytes_(bytes), guard_(guard), block_((bytes + 2 * guard + 63) / 64 + 1) {
    unsigned char* base = this->base();
    std::memset(base, kGuardByte, guard);
    std::memset(base + guard + bytes, kGuardByte, guard);
  }
  void* get() const { return block_.empty() ? nullptr : base() + guard_; }
  std::size_t bytes() const { return bytes_; }
  template <typename T>
  static HostBuffer from(const std::vector<T>& host) {
    HostBuffer b(host.size() * sizeof(T));
    if (!host.empty()) std::memcpy(b.get(), host.data(), b.bytes());
    return b;
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    if (!host.empty()) std::memcpy(host.data(), get(), bytes_);
    return host;
  }
  void fill(unsigned char byte) { std::memset(get(), byte, bytes_); }
  bool guards_intact() const {
    const unsigned char* base = this->base();
    for (std::size_t i = 0; i < guard_; ++i) {
      if (base[i] != kGuardByte || base[guard_ + bytes_ + i] != kGuardByte) return false;
    }
    return true;
  }
  static Status synchronize() { return Status(); }  // host work is done when the call returns

 private:
  struct alignas(64) Line {
    unsigned char bytes[64];
  };
  unsigned char* base() const { return const_cast<unsigned char*>(block_.data()->bytes); }
  std::size_t bytes_ = 0;
  std::size_t guard_ = 0;
  std::vector<Line> block_;
};

// A case's inputs in buffers of one kind (DeviceBuffer: on the device; HostBuffer: on the host).
template <class Buffer>
struct CaseBuffers {
  Buffer q, k, v, g, beta, A_log, dt_bias, cu, h0;
  explicit CaseBuffers(const KdaCase& c)
      : q(Buffer::from(c.q)),
        k(Buffer::from(c.k)),
        v(Buffer::from(c.v)),
        g(Buffer::from(c.g)),
        beta(Buffer::from(c.beta)),
        A_log(Buffer::from(c.A_log)),
        dt_bias(Buffer::from(c.dt_bias)) {
    if (c.problem.varlen()) {
      cu = c.problem.cu_seqlens_dtype == DType::kI32 ? Buffer::from(c.cu_seqlens_i32)
                                                     : Buffer::from(c.cu_seqlens);
    }
    if (c.problem.initial_state_dtype == DType::kF32) h0 = Buffer::from(c.initial_state);
    if (c.problem.initial_state_dtype == DType::kBF16) h0 = Buffer::from(c.initial_state_bf16);
    Buffer::synchronize();  // uploads done before work on any other stream starts
  }
  Tensors tensors() const {
    Tensors t;
    t.q = q.get();
    t.k = k.get();
    t.v = v.get();
    t.g = g.get();
    t.beta = beta.get();
    t.A_log = static_cast<const float*>(A_log.get());
    t.dt_bias = static_cast<const float*>(dt_bias.get());
    t.cu_seqlens = cu.get();
    t.initial_state = h0.get();
    return t;
  }
  // The same inputs and parameters as a decode's (its rows are the case's first tokens).
  DecodeTensors decode_tensors() const {
    const Tensors in = tensors();
    DecodeTensors t;
    t.q = in.q;
    t.k = in.k;
    t.v = in.v;
    t.g = in.g;
    t.beta = in.beta;
    t.A_log = in.A_log;
    t.dt_bias = in.dt_bias;
    return t;
  }
};

// A case's inputs on the device.
using DeviceCase = CaseBuffers<DeviceBuffer>;

}  // namespace kda::test
