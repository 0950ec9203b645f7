// backend_matrix.hpp — the operator tests' backend matrix (after ggml's test-backend-ops).
//
// Every operator test is written once, against a Runner: the backend as a test sees it. A runner
// uploads a case's inputs (the host vectors of kda_reference.hpp) into buffers with guard bytes,
// poisons every output and the workspace with 0xFF bytes (NaN in bf16 and in f32), runs the
// prefill, decode or segment transition, downloads the results and reports whether every guard
// byte survived. One implementation (BufferRunner) serves both backends; they differ only in the
// buffer type and the operator entry points:
//   cpu_runner()           always: HostBuffer, forward_cpu / decode_cpu / segment_transition_cpu
//   cuda_runner_or_skip()  the CUDA backend when a device exists (DeviceBuffer, forward_cuda, ...);
//                          otherwise it prints "KDA_SKIP: no CUDA device" (CTest: skipped) and
//                          returns null. It builds without CUDA: buffers go through kda's device
//                          helpers (common/cuda_test_util.hpp), which report no device there.
//
// Declaring cases (the backend is the last word of the case's name):
//   KDA_MATRIX_CASE("name") { ... runner ... }   once per backend: "name [cpu]", "name [cuda]"
//   KDA_CPU_CASE("name") { ... }                  the CPU backend only: "name [cpu]"
//   KDA_CUDA_CASE("name") { ... cuda ... }        CUDA only, skipped without a device: "name
//   [cuda]"
//                                                 (`cuda` is the CUDA runner)
// tests/CMakeLists.txt registers the "[cpu]" cases of an executable with the CTest label `cpu` and
// its "[cuda]" cases with `gpu` (so `ctest -L gpu` runs every CUDA case, and CI without a device
// reports them skipped). A case's data (shapes, gates, varlen lengths, state dtypes in and out,
// state slots, tolerances, the backends it runs on) lives in the registry, cases.hpp; the fp64
// reference and the case generator in common/kda_reference.hpp.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda/kda.hpp"
#include "kda_reference.hpp"
#include "state_slots_util.hpp"

namespace kda::test {

// ---------------------------------------------------------------------------------------------
// What a run returns
// ---------------------------------------------------------------------------------------------
constexpr unsigned char kPoisonByte = 0xFF;  // outputs are filled with it before every run

struct PrefillOptions {
  CpuOptions cpu;                       // the CPU runner's threads and fp64 mode
  CudaOptions cuda;                     // the CUDA runner's options (the prefill's schedule)
  int extra_state_rows = 0;             // final-state rows past N: poisoned, must stay so
  std::size_t workspace_shortfall = 0;  // bytes less than workspace_size() asks for
  bool in_place = false;                // final_state = the initial state's buffer
};

// Outputs (downloaded) of one prefill; guards_intact: no byte outside the outputs and the
// workspace changed, and the extra state rows still hold the poison.
struct PrefillRun {
  Status status;
  Outputs out;
  bool guards_intact = true;
};

// A prefill through state slots, in place (initial == final == pool).
struct PooledRun {
  Status status;
  std::vector<std::uint16_t> out;
  std::vector<unsigned char> pool;
  std::uint32_t device_status = 0;  // the CUDA status word (always 0 on the CPU)
  bool guards_intact = true;
};

// A decode step's inputs: a fixed-length case of B rows of `tokens` tokens (decode's layout).
struct DecodeCase {
  KdaCase tokens;  // q, k, v, g, beta, A_log, dt_bias
  DecodeProblem problem;
  std::vector<std::int32_t> slots;         // [B], or [B, tokens] with problem.verify
  std::vector<std::int32_t> num_accepted;  // [B] with problem.verify
  std::vector<float> pool;  // [num_slots, H, V, K] as values (bf16-representable when bf16)
  CudaOptions cuda;         // the CUDA runner's options (the CPU runner ignores them)
};

// The pool as the operator sees it (f32 or bf16 bytes), and bytes of a pool as values.
inline std::vector<unsigned char> pool_bytes(const DecodeCase& d) {
  std::vector<unsigned char> b;
  if (d.problem.state_dtype == DType::kF32) {
    b.resize(d.pool.size() * 4);
    std::memcpy(b.data(), d.pool.data(), b.size());
  } else {
    auto h = to_bf16(d.pool);
    b.resize(h.size() * 2);
    std::memcpy(b.data(), h.data(), b.size());
  }
  return b;
}
inline std::vector<double> pool_values(const std::vector<unsigned char>& bytes, DType dt) {
  if (dt == DType::kF32) {
    std::vector<float> f(bytes.size() / 4);
    std::memcpy(f.data(), bytes.data(), bytes.size());
    return to_doubles(f);
  }
  std::vector<std::uint16_t> h(bytes.size() / 2);
  std::memcpy(h.data(), bytes.data(), bytes.size());
  return to_doubles(h);
}

struct DecodeRun {
  Status status;
  std::vector<unsigned char> pool;
  std::vector<std::uint16_t> out;
  std::uint32_t device_status = 0;  // the CUDA status word (always 0 on the CPU)
  bool guards_intact = true;
};

// A segment transition (P^T [pairs, K, K], H^T [pairs, V, K]) of a case's sequences.
struct TransitionRun {
  Status status;
  std::vector<float> p_t, h_t;
  bool guards_intact = true;
};

// ---------------------------------------------------------------------------------------------
// The runner interface
// ---------------------------------------------------------------------------------------------
class Runner {
 public:
  virtual ~Runner() = default;
  virtual const char* name() const = 0;
  virtual Backend backend() const = 0;
  // What every output holds before a run (a failed call must leave exactly this).
  std::vector<std::uint16_t> poisoned_out(const KdaCase& c) const {
    return std::vector<std::uint16_t>(static_cast<std::size_t>(c.out_elems()), 0xFFFF);
  }

  virtual PrefillRun prefill(const KdaCase& c, const PrefillOptions& opt = {}) = 0;
  virtual PooledRun prefill_pooled(const SlotCase& sc, const PrefillOptions& opt = {}) = 0;
  // `repeats` decode calls on the same pool (each advances its state).
  virtual DecodeRun decode(const DecodeCase& d, int repeats = 1) = 0;
  // c's state dtypes are ignored: transitions start from no state.
  virtual TransitionRun transition(const KdaCase& c, const CpuOptions& cpu = {}) = 0;
  // s_out = s P^T + H^T for `pairs` (sequence, head) pairs; in place when asked (s_out = s).
  virtual Status apply_transition(std::int64_t pairs, std::int64_t K, std::int64_t V,
                                  const std::vector<float>& s, const std::vector<float>& p_t,
                                  const std::vector<float>& h_t, bool in_place,
                                  std::vector<float>* s_out) = 0;
};

// The one implementation, over a buffer type (HostBuffer or DeviceBuffer); a backend supplies its
// entry points.
template <class Buffer>
class BufferRunner : public Runner {
 public:
  PrefillRun prefill(const KdaCase& c, const PrefillOptions& opt) override {
    PrefillRun r;
    CaseBuffers<Buffer> d(c);
    const Problem& p = c.problem;
    Buffer out(static_cast<std::size_t>(c.out_elems()) * 2);
    out.fill(kPoisonByte);
    const std::size_t row = static_cast<std::size_t>(p.num_heads * p.head_dim_v * p.head_dim_k);
    const std::size_t state_elems =
        static_cast<std::size_t>(c.state_elems()) + opt.extra_state_rows * row;
    Buffer ht(p.final_state_dtype == DType::kNone || opt.in_place
                  ? 0
                  : state_elems * dtype_size(p.final_state_dtype));
    ht.fill(kPoisonByte);
    std::size_t ws_bytes = 0;
    r.status = workspace_size(p, backend(), &ws_bytes);
    if (!r.status.ok()) return r;
    ws_bytes = ws_bytes > opt.workspace_shortfall ? ws_bytes - opt.workspace_shortfall : 0;
    Buffer ws(ws_bytes);
    ws.fill(kPoisonByte);  // no call may depend on what a workspace held before it
    Tensors t = d.tensors();
    t.out = out.get();
    t.final_state = p.final_state_dtype == DType::kNone ? nullptr
                    : opt.in_place                      ? d.h0.get()
                                                        : ht.get();
    r.status = forward(c, t, Workspace{ws.get(), ws.bytes()}, opt);
    if (r.status.ok()) r.status = Buffer::synchronize();
    const Buffer& fin = opt.in_place ? d.h0 : ht;
    r.out.out = out.template download<std::uint16_t>();
    if (p.final_state_dtype == DType::kF32) r.out.final_f32 = fin.template download<float>();
    if (p.final_state_dtype == DType::kBF16) {
      r.out.final_bf16 = fin.template download<std::uint16_t>();
    }
    r.guards_intact = out.guards_intact() && fin.guards_intact() && ws.guards_intact();
    // The extra rows must still hold the poison; then drop them so that sizes match the case.
    const std::size_t n = static_cast<std::size_t>(c.state_elems());
    if (!r.out.final_f32.empty()) {
      for (std::size_t i = n; i < r.out.final_f32.size(); ++i) {
        std::uint32_t bits;
        std::memcpy(&bits, &r.out.final_f32[i], 4);
        if (bits != 0xFFFFFFFFu) r.guards_intact = false;
      }
      r.out.final_f32.resize(n);
    }
    if (!r.out.final_bf16.empty()) {
      for (std::size_t i = n; i < r.out.final_bf16.size(); ++i) {
        if (r.out.final_bf16[i] != 0xFFFF) r.guards_intact = false;
      }
      r.out.final_bf16.resize(n);
    }
    return r;
  }

  PooledRun prefill_pooled(const SlotCase& sc, const PrefillOptions& opt) override {
    PooledRun r;
    CaseBuffers<Buffer> d(sc.contiguous);
    Buffer pool = Buffer::from(sc.pool);
    Buffer slots = Buffer::from(sc.slots);
    std::vector<std::int32_t> offsets_i32(sc.checkpoint_offsets.begin(),
                                          sc.checkpoint_offsets.end());
    Buffer checkpoint_offsets = sc.problem.checkpoint_offsets_dtype == DType::kI32
                                    ? Buffer::from(offsets_i32)
                                    : Buffer::from(sc.checkpoint_offsets);
    Buffer checkpoint_slots = Buffer::from(sc.checkpoint_slots);
    Buffer out(static_cast<std::size_t>(sc.contiguous.out_elems()) * 2);
    out.fill(kPoisonByte);
    Buffer status(backend() == Backend::kCuda ? 4 : 0);
    status.fill(0);
    std::size_t ws_bytes = 0;
    r.status = workspace_size(sc.problem, backend(), &ws_bytes);
    if (!r.status.ok()) return r;
    Buffer ws(ws_bytes);
    ws.fill(kPoisonByte);  // no call may depend on what a workspace held before it
    Tensors t = d.tensors();
    t.initial_state = pool.get();
    t.final_state = pool.get();
    t.state_slots = static_cast<const std::int32_t*>(slots.get());
    if (sc.problem.checkpoints > 0) {
      t.checkpoint_offsets = checkpoint_offsets.get();
      t.checkpoint_slots = static_cast<const std::int32_t*>(checkpoint_slots.get());
    }
    t.out = out.get();
    if (backend() == Backend::kCuda) t.device_status = static_cast<std::uint32_t*>(status.get());
    KdaCase pooled = sc.contiguous;  // the pooled problem with the contiguous case's host arrays
    pooled.problem = sc.problem;
    r.status = forward(pooled, t, Workspace{ws.get(), ws.bytes()}, opt);
    if (r.status.ok()) r.status = Buffer::synchronize();
    r.out = out.template download<std::uint16_t>();
    r.pool = pool.template download<unsigned char>();
    if (backend() == Backend::kCuda) r.device_status = status.template download<std::uint32_t>()[0];
    r.guards_intact = out.guards_intact() && pool.guards_intact() && ws.guards_intact();
    return r;
  }

  DecodeRun decode(const DecodeCase& dc, int repeats) override {
    DecodeRun r;
    CaseBuffers<Buffer> d(dc.tokens);
    Buffer slots = Buffer::from(dc.slots);
    Buffer accepted = Buffer::from(dc.num_accepted);
    Buffer pool = Buffer::from(pool_bytes(dc));
    Buffer out(static_cast<std::size_t>(dc.tokens.out_elems()) * 2);
    out.fill(kPoisonByte);
    Buffer status(backend() == Backend::kCuda ? 4 : 0);
    if (backend() == Backend::kCuda) status.fill(0);
    DecodeTensors t = d.decode_tensors();
    t.slots = static_cast<const std::int32_t*>(slots.get());
    if (!dc.num_accepted.empty()) {
      t.num_accepted = static_cast<const std::int32_t*>(accepted.get());
    }
    if (backend() == Backend::kCuda) t.device_status = static_cast<std::uint32_t*>(status.get());
    t.state_pool = pool.get();
    t.out = out.get();
    for (int i = 0; i < repeats && r.status.ok(); ++i) {
      r.status = decode_call(dc.problem, t, dc.cuda);
    }
    if (r.status.ok()) r.status = Buffer::synchronize();
    r.pool = pool.template download<unsigned char>();
    r.out = out.template download<std::uint16_t>();
    if (backend() == Backend::kCuda) r.device_status = status.template download<std::uint32_t>()[0];
    r.guards_intact = pool.guards_intact() && out.guards_intact();
    return r;
  }

  TransitionRun transition(const KdaCase& c, const CpuOptions& cpu) override {
    TransitionRun r;
    Problem p = c.problem;
    p.initial_state_dtype = p.final_state_dtype = DType::kNone;
    const std::size_t pairs = static_cast<std::size_t>(c.num_seqs() * p.num_heads);
    std::size_t bytes = 0;
    r.status = transition_workspace_size(p, backend(), &bytes);
    if (!r.status.ok()) return r;
    CaseBuffers<Buffer> d(c);
    Buffer pt(pairs * static_cast<std::size_t>(p.head_dim_k * p.head_dim_k) * 4);
    Buffer ht(pairs * static_cast<std::size_t>(p.head_dim_v * p.head_dim_k) * 4);
    Buffer ws(bytes);
    ws.fill(kPoisonByte);  // no call may depend on what a workspace held before it
    pt.fill(kPoisonByte);
    ht.fill(kPoisonByte);
    Tensors t = d.tensors();
    t.initial_state = nullptr;
    r.status = transition_call(p, t, static_cast<float*>(pt.get()), static_cast<float*>(ht.get()),
                               Workspace{ws.get(), bytes}, cpu);
    if (r.status.ok()) r.status = Buffer::synchronize();
    r.p_t = pt.template download<float>();
    r.h_t = ht.template download<float>();
    r.guards_intact = pt.guards_intact() && ht.guards_intact() && ws.guards_intact();
    return r;
  }

  Status apply_transition(std::int64_t pairs, std::int64_t K, std::int64_t V,
                          const std::vector<float>& s, const std::vector<float>& p_t,
                          const std::vector<float>& h_t, bool in_place,
                          std::vector<float>* s_out) override {
    Buffer ds = Buffer::from(s), dp = Buffer::from(p_t), dh = Buffer::from(h_t);
    Buffer dout(in_place ? 0 : s.size() * 4);
    dout.fill(kPoisonByte);
    float* target = static_cast<float*>(in_place ? ds.get() : dout.get());
    Status st = apply_call(pairs, K, V, static_cast<const float*>(ds.get()),
                           static_cast<const float*>(dp.get()), static_cast<const float*>(dh.get()),
                           target);
    if (st.ok()) st = Buffer::synchronize();
    *s_out = (in_place ? ds : dout).template download<float>();
    return st;
  }

 protected:
  // The backend's entry points. `c` carries the problem and the host copies of the inputs (the
  // CUDA prefill is given cu_seqlens_host from it).
  virtual Status forward(const KdaCase& c, Tensors t, Workspace ws, const PrefillOptions& opt) = 0;
  virtual Status decode_call(const DecodeProblem& p, const DecodeTensors& t,
                             const CudaOptions& cuda) = 0;
  virtual Status transition_call(const Problem& p, const Tensors& t, float* p_t, float* h_t,
                                 Workspace ws, const CpuOptions& cpu) = 0;
  virtual Status apply_call(std::int64_t pairs, std::int64_t K, std::int64_t V, const float* s,
                            const float* p_t, const float* h_t, float* s_out) = 0;
};

class CpuRunner final : public BufferRunner<HostBuffer> {
 public:
  const char* name() const override { return "cpu"; }
  Backend backend() const override { return Backend::kCpu; }

 protected:
  Status forward(const KdaCase& c, Tensors t, Workspace ws, const PrefillOptions& opt) override {
    return forward_cpu(c.problem, t, ws, opt.cpu);
  }
  Status decode_call(const DecodeProblem& p, const DecodeTensors& t, const CudaOptions&) override {
    return decode_cpu(p, t);
  }
  Status transition_call(const Problem& p, const Tensors& t, float* p_t, float* h_t, Workspace ws,
                         const CpuOptions& cpu) override {
    return segment_transition_cpu(p, t, p_t, h_t, ws, cpu);
  }
  Status apply_call(std::int64_t pairs, std::int64_t K, std::int64_t V, const float* s,
                    const float* p_t, const float* h_t, float* s_out) override {
    return apply_transition_cpu(pairs, K, V, s, p_t, h_t, s_out);
  }
};

class CudaRunner final : public BufferRunner<DeviceBuffer> {
 public:
  const char* name() const override { return "cuda"; }
  Backend backend() const override { return Backend::kCuda; }

 protected:
  Status forward(const KdaCase& c, Tensors t, Workspace ws, const PrefillOptions& opt) override {
    t.cu_seqlens_host = c.cu_seqlens_ptr();
    return forward_cuda(c.problem, t, ws, nullptr, opt.cuda);
  }
  Status decode_call(const DecodeProblem& p, const DecodeTensors& t,
                     const CudaOptions& cuda) override {
    return decode_cuda(p, t, nullptr, cuda);
  }
  Status transition_call(const Problem& p, const Tensors& t, float* p_t, float* h_t, Workspace ws,
                         const CpuOptions&) override {
    return segment_transition_cuda(p, t, p_t, h_t, ws, nullptr);
  }
  Status apply_call(std::int64_t pairs, std::int64_t K, std::int64_t V, const float* s,
                    const float* p_t, const float* h_t, float* s_out) override {
    return apply_transition_cuda(pairs, K, V, s, p_t, h_t, s_out, nullptr);
  }
};

inline Runner& cpu_runner() {
  static CpuRunner runner;
  return runner;
}
// The CUDA runner, or null (after printing the skip marker) when there is no device.
inline Runner* cuda_runner_or_skip() {
  static CudaRunner runner;
  return gpu_or_skip() ? &runner : nullptr;
}

}  // namespace kda::test

#define KDA_MATRIX_CAT_(a, b) a##b
#define KDA_MATRIX_CAT(a, b) KDA_MATRIX_CAT_(a, b)
#define KDA_MATRIX_CASE_(name, body)                                                 \
  static void body(::kda::test::Runner& runner);                                     \
  TEST_CASE(name " [cpu]") { body(::kda::test::cpu_runner()); }                      \
  TEST_CASE(name " [cuda]") {                                                        \
    if (::kda::test::Runner* cuda = ::kda::test::cuda_runner_or_skip()) body(*cuda); \
  }                                                                                  \
  static void body(::kda::test::Runner& runner)
#define KDA_MATRIX_CASE(name) KDA_MATRIX_CASE_(name, KDA_MATRIX_CAT(kda_matrix_case_, __LINE__))
#define KDA_CPU_CASE(name) TEST_CASE(name " [cpu]")
// The body receives `cuda`, the CUDA runner.
#define KDA_CUDA_CASE_(name, body)                                                   \
  static void body([[maybe_unused]] ::kda::test::Runner& cuda);                      \
  TEST_CASE(name " [cuda]") {                                                        \
    if (::kda::test::Runner* cuda = ::kda::test::cuda_runner_or_skip()) body(*cuda); \
  }                                                                                  \
  static void body([[maybe_unused]] ::kda::test::Runner& cuda)
#define KDA_CUDA_CASE(name) KDA_CUDA_CASE_(name, KDA_MATRIX_CAT(kda_cuda_case_, __LINE__))
