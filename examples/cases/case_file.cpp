// examples/cases/case_file.cpp — validate a case file completely, run one forward, write the
// result.
#include "case_file.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>

#include "backend.hpp"
#include "case_metadata.hpp"
#include "kda/error.hpp"

namespace kda::engine {

namespace {

[[noreturn]] void fail(const std::string& source, const std::string& what,
                       StatusCode code = StatusCode::kInvalidArgument) {
  throw Error(code, source + ": " + what);
}

// Every tensor the contract names; anything else in the file is ignored.
const char* const kInputNames[] = {"q",          "k",
                                   "v",          "g",
                                   "beta",       "A_log",
                                   "dt_bias",    "initial_state",
                                   "cu_seqlens", "checkpoint_offsets"};

using detail::case_number_text;
using detail::parse_case_number;

const Tensor& require(const std::map<std::string, Tensor>& tensors, const std::string& name,
                      const std::string& source) {
  const auto it = tensors.find(name);
  if (it == tensors.end()) fail(source, "missing tensor '" + name + "'");
  return it->second;
}

void expect_dtype(const Tensor& t, std::initializer_list<DType> allowed,
                  const std::string& source) {
  for (const DType d : allowed) {
    if (t.dtype == d) return;
  }
  std::string names;
  for (const DType d : allowed)
    names += std::string(names.empty() ? "" : " or ") + safetensors_dtype_name(d);
  fail(source, "tensor '" + t.name + "' has dtype " + safetensors_dtype_name(t.dtype) +
                   ", expected " + names);
}

void expect_shape(const Tensor& t, const std::vector<std::int64_t>& shape, const std::string& what,
                  const std::string& source) {
  if (t.shape != shape) {
    fail(source, "tensor '" + t.name + "' has shape " + shape_to_string(t.shape) + ", expected " +
                     shape_to_string(shape) + " (" + what + ")");
  }
}

// A non-null stand-in for the host copy of an empty cu_seqlens.
alignas(256) unsigned char g_empty[256];

// The prefill run_case runs. With checkpoints the states live on a pool of N + N * R slots
// (sequence n on slot n, its request r on slot N + n * R + r), and a final state is written (f32
// where the file asks for none) since the checkpoints are written in its dtype.
Problem pooled_problem(const Problem& p) {
  if (p.checkpoints == 0) return p;
  Problem pooled = p;
  pooled.num_state_slots = p.sequences() * (1 + p.checkpoints);
  if (pooled.final_state_dtype == DType::kNone) pooled.final_state_dtype = DType::kF32;
  return pooled;
}

}  // namespace

KdaCase make_case(std::map<std::string, Tensor> tensors,
                  const std::map<std::string, std::string>& metadata, const std::string& source) {
  const Tensor& q = require(tensors, "q", source);
  const Tensor& k = require(tensors, "k", source);
  const Tensor& v = require(tensors, "v", source);
  const Tensor& g = require(tensors, "g", source);
  const Tensor& beta = require(tensors, "beta", source);
  const Tensor& a_log = require(tensors, "A_log", source);
  const Tensor& dt_bias = require(tensors, "dt_bias", source);
  for (const Tensor* t : {&q, &k, &v, &g, &beta}) expect_dtype(*t, {DType::kBF16}, source);
  for (const Tensor* t : {&a_log, &dt_bias}) expect_dtype(*t, {DType::kF32}, source);

  if (q.shape.size() != 4) {
    fail(source, "tensor 'q' has shape " + shape_to_string(q.shape) + ", expected [B, T, H, K]");
  }
  const std::int64_t B = q.shape[0], T = q.shape[1], H = q.shape[2], K = q.shape[3];
  if (H < 1 || K < 1)
    fail(source, "tensor 'q' has shape " + shape_to_string(q.shape) + ": H and K must be >= 1");
  expect_shape(k, q.shape, "same as q: [B, T, H, K]", source);
  expect_shape(g, q.shape, "same as q: [B, T, H, K]", source);
  if (v.shape.size() != 4 || v.shape[0] != B || v.shape[1] != T || v.shape[2] != H ||
      v.shape[3] < 1) {
    fail(source, "tensor 'v' has shape " + shape_to_string(v.shape) + ", expected [" +
                     std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(H) +
                     ", V] with V >= 1");
  }
  const std::int64_t V = v.shape[3];
  expect_shape(beta, {B, T, H}, "[B, T, H]", source);
  // Also as Kimi-Linear's checkpoints store them (A_log [1, 1, H, 1], dt_bias [H * K]): the same
  // values in the same order, so a checkpoint's tensors go into a case as they are.
  if (a_log.shape != std::vector<std::int64_t>{1, 1, H, 1}) {
    expect_shape(a_log, {H}, "[H] or [1, 1, H, 1]", source);
  }
  if (dt_bias.shape != std::vector<std::int64_t>{H * K}) {
    expect_shape(dt_bias, {H, K}, "[H, K] or [H * K]", source);
  }

  CaseMode mode = CaseMode::kPrefill;
  if (const auto it = metadata.find("mode"); it != metadata.end()) {
    if (it->second == "decode") {
      mode = CaseMode::kDecode;
    } else if (it->second != "prefill") {
      fail(source, "metadata 'mode' is '" + it->second + "', expected prefill or decode");
    }
  }
  if (mode == CaseMode::kDecode) {
    if (T < 1 || T > kMaxDecodeTokens) {
      fail(source, "tensor 'q' has shape " + shape_to_string(q.shape) +
                       ": decode mode takes 1 to " + std::to_string(kMaxDecodeTokens) +
                       " tokens per row (T), got T = " + std::to_string(T));
    }
    for (const char* name : {"cu_seqlens", "checkpoint_offsets"}) {
      if (tensors.count(name) != 0) {
        fail(source, std::string("tensor '") + name +
                         "' is given, but decode mode takes none (it runs B rows of T new tokens "
                         "each; metadata 'mode' is decode)");
      }
    }
  }

  Problem p;
  p.batch = B;
  p.seq_len = T;
  p.num_heads = H;
  p.head_dim_k = K;
  p.head_dim_v = V;

  std::int64_t N = B;
  if (const auto it = tensors.find("cu_seqlens"); it != tensors.end()) {
    const Tensor& cu = it->second;
    expect_dtype(cu, {DType::kI64, DType::kI32}, source);
    if (cu.shape.size() != 1 || cu.shape[0] < 2) {
      fail(source, "tensor 'cu_seqlens' has shape " + shape_to_string(cu.shape) +
                       ", expected [N + 1] with N >= 1");
    }
    if (B != 1)
      fail(source, "cu_seqlens is given, so B must be 1, but q has B = " + std::to_string(B));
    N = cu.shape[0] - 1;
    p.num_seqs = N;
    p.cu_seqlens_dtype = cu.dtype;
    if (const Status st = validate_cu_seqlens(p, cu.data.data()); !st.ok()) {
      fail(source, st.message());
    }
  }

  if (const auto it = tensors.find("checkpoint_offsets"); it != tensors.end()) {
    const Tensor& offsets = it->second;
    expect_dtype(offsets, {DType::kI64, DType::kI32}, source);
    if (offsets.shape.size() != 2 || offsets.shape[0] != N || offsets.shape[1] < 1) {
      fail(source, "tensor 'checkpoint_offsets' has shape " + shape_to_string(offsets.shape) +
                       ", expected [" + std::to_string(N) + ", R] (N = " + std::to_string(N) +
                       " sequences, R >= 1 requests each)");
    }
    p.checkpoints = offsets.shape[1];
    p.checkpoint_offsets_dtype = offsets.dtype;
  }

  DType final_dtype = DType::kF32;
  if (const auto it = tensors.find("initial_state"); it != tensors.end()) {
    const Tensor& s = it->second;
    expect_dtype(s, {DType::kF32, DType::kBF16}, source);
    expect_shape(s, {N, H, V, K}, "[N, H, V, K]", source);
    p.initial_state_dtype = s.dtype;
    final_dtype = s.dtype;
  }

  // Metadata.
  detail::read_case_gate(metadata, source, &p.gate, &p.lower_bound);
  if (const auto it = metadata.find("scale"); it != metadata.end()) {
    double scale = 0.0;
    if (!parse_case_number(it->second, &scale)) {
      fail(source, "metadata 'scale' is '" + it->second + "', not a number");
    }
    if (!std::isfinite(scale) || scale <= 0.0 || !std::isfinite(static_cast<float>(scale)) ||
        !(static_cast<float>(scale) > 0.0f)) {
      // A float of 0 would mean K^-1/2 to the operator: a tiny scale is refused, not replaced.
      fail(source, "metadata 'scale' is " + case_number_text(scale) +
                       ", expected a finite value > 0 (as a float: from 1.4e-45 up)");
    }
    p.scale = static_cast<float>(scale);
  }
  p.final_state_dtype = detail::read_case_final_state(metadata, source, final_dtype);

  KdaCase result;
  result.source = source;
  result.mode = mode;
  if (mode == CaseMode::kDecode) {
    if (p.final_state_dtype == DType::kNone) {
      fail(source,
           "metadata 'final_state' is 'none', but decode mode always writes its states (f32 or "
           "bf16)");
    }
    DecodeProblem& d = result.decode;
    d.batch = B;
    d.tokens = T;
    d.num_heads = H;
    d.head_dim_k = K;
    d.head_dim_v = V;
    d.num_slots = B * T;  // overflow-free: B * T * H * K elements fit the file
    d.state_dtype = p.final_state_dtype;
    d.gate = p.gate;
    d.lower_bound = p.lower_bound;
    d.scale = p.scale;
    d.verify = true;
    const Status st = validate(d);
    if (!st.ok()) throw Error(st, source);
  } else {
    const Status st = validate(pooled_problem(p));
    if (!st.ok()) throw Error(st, source);
  }
  result.problem = p;
  for (const char* name : kInputNames) {
    auto it = tensors.find(name);
    if (it != tensors.end()) result.tensors.emplace(name, std::move(it->second));
  }
  return result;
}

KdaCase load_case(const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::map<std::string, Tensor> tensors;
  for (const char* name : kInputNames) {
    if (file.find(name) != nullptr) tensors.emplace(name, file.read(name));
  }
  return make_case(std::move(tensors), file.metadata(), path);
}

namespace {

// One run_case call on one backend: its tensors in the backend's memory (0 bytes still get a valid
// pointer, so length-0 problems pass the pointer checks), freed after the backend is done with
// them. Every failure names the case it came from: the operator's own messages ("A_log[0] is not
// finite") do not know the file.
class CaseRun {
 public:
  // `can_run`: can_implement() of the case's problem on `backend`, reported before the backend is
  // made.
  CaseRun(const KdaCase& kda_case, Backend backend, const Status& can_run)
      : kda_case_(kda_case),
        where_(kda_case.source.empty() ? std::string() : kda_case.source + ": ") {
    check(can_run, std::string("backend ") + to_string(backend));
    try {
      engine_backend_ = make_engine_backend(backend, BackendOptions{}, where_ + "backend");
    } catch (const Error& e) {
      throw Error(e.code(), where_.empty() ? e.what() : where_ + e.what());
    }
    // "CPU forward", "CUDA decode"
    what_ = std::string(to_string(backend));
    std::transform(what_.begin(), what_.end(), what_.begin(),
                   [](char c) { return static_cast<char>(std::toupper(c)); });
    what_ += kda_case.mode == CaseMode::kDecode ? " decode" : " forward";
  }
  ~CaseRun() {
    // The buffers go only after the backend is done with them.
    try {
      if (engine_backend_) engine_backend_->synchronize();
    } catch (const Error&) {
    }
  }

  EngineBackend& backend() { return *engine_backend_; }
  const std::string& what() const { return what_; }

  void check(const Status& st, const std::string& what) const {
    if (!st.ok()) throw Error(st, where_ + what);
  }
  const Tensor* input(const char* name) const {
    const auto it = kda_case_.tensors.find(name);
    return it == kda_case_.tensors.end() ? nullptr : &it->second;
  }
  void* buffer(std::size_t bytes, const char* what) {
    try {
      allocations_.emplace_back(*engine_backend_, bytes, what);
    } catch (const Error& e) {
      throw Error(e.code(), where_ + e.what());
    }
    return allocations_.back().get();
  }
  // Host memory (which must stay valid until download() or finish()) into a new buffer.
  void* upload(const void* src, std::size_t bytes, const char* what) {
    void* ptr = buffer(bytes, what);
    guarded([&] { engine_backend_->copy_to_device(ptr, src, bytes); });
    return ptr;
  }
  const void* upload(const char* name) {
    const Tensor* tensor = input(name);
    if (tensor == nullptr) return nullptr;
    return upload(tensor->data.data(), tensor->data.size(), name);
  }
  // The case's q, k, v, g, beta, A_log and dt_bias into `t` (Tensors or DecodeTensors).
  template <typename CallTensors>
  void upload_inputs(CallTensors* t) {
    t->q = upload("q");
    t->k = upload("k");
    t->v = upload("v");
    t->g = upload("g");
    t->beta = upload("beta");
    t->A_log = static_cast<const float*>(upload("A_log"));
    t->dt_bias = static_cast<const float*>(upload("dt_bias"));
  }
  // A device status word, cleared, where the backend's kernels report through one (CUDA).
  std::uint32_t* device_status() {
    if (!engine_backend_->has_device_status()) return nullptr;
    auto* word = static_cast<std::uint32_t*>(buffer(sizeof(std::uint32_t), "the status word"));
    check(engine_backend_->clear_device_status(word), what_);
    return word;
  }
  void download(void* dst, const void* src, std::size_t bytes) {
    guarded([&] { engine_backend_->copy_to_host(dst, src, bytes); });
  }
  // Waits for the backend and reports what its kernels saw (`word` from device_status()).
  void finish(const std::uint32_t* word) {
    guarded([&] { engine_backend_->synchronize(); });
    if (word != nullptr) check(engine_backend_->check_device_status(word), what_);
  }

 private:
  template <typename F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      throw Error(e.code(), where_ + what_ + ": " + e.what());
    }
  }

  const KdaCase& kda_case_;
  std::string where_;
  std::string what_;
  std::unique_ptr<EngineBackend> engine_backend_;
  std::vector<BackendBuffer> allocations_;
};

std::vector<Tensor> run_prefill(const KdaCase& kda_case, Backend backend) {
  const Problem& file_problem = kda_case.problem;
  const Problem p = pooled_problem(file_problem);  // with checkpoints: on a state pool
  const bool pooled = p.num_state_slots > 0;
  const std::int64_t N = p.sequences(), R = p.checkpoints;
  const std::int64_t H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  CaseRun run(kda_case, backend, can_implement(p, backend));
  std::size_t workspace_bytes = 0;
  run.check(workspace_size(p, backend, &workspace_bytes), "workspace size");

  Tensor out = Tensor::zeros("out", DType::kBF16, {p.batch, p.seq_len, H, V});
  const bool has_final = file_problem.final_state_dtype != DType::kNone;
  // The final states: [N, ...], or the pool [N + N * R, ...] whose first N rows they are.
  Tensor final_state;
  if (p.final_state_dtype != DType::kNone) {
    final_state = Tensor::zeros("final_state", p.final_state_dtype,
                                {pooled ? p.num_state_slots : N, H, V, K});
  }
  const std::size_t state_bytes =
      static_cast<std::size_t>(H * V * K) * dtype_size(p.final_state_dtype);

  Tensors t;
  run.upload_inputs(&t);
  t.cu_seqlens = run.upload("cu_seqlens");
  if (const Tensor* cu = run.input("cu_seqlens")) {
    t.cu_seqlens_host = cu->data.empty() ? static_cast<const void*>(g_empty) : cu->data.data();
  }
  std::vector<std::uint8_t> initial_pool;  // pooled: the initial states on rows 0..N-1
  std::vector<std::int32_t> state_slots, checkpoint_slots;
  if (!pooled) {
    t.initial_state = run.upload("initial_state");
  } else {
    if (const Tensor* initial = run.input("initial_state")) {
      initial_pool.assign(static_cast<std::size_t>(p.num_state_slots) *
                              static_cast<std::size_t>(H * V * K) * dtype_size(initial->dtype),
                          0);
      std::memcpy(initial_pool.data(), initial->data.data(), initial->data.size());
      t.initial_state = run.upload(initial_pool.data(), initial_pool.size(), "initial_state");
    }
    // Sequence n on slot n; its request r on slot N + n * R + r (none where the offset is -1).
    const Tensor& offsets = *run.input("checkpoint_offsets");
    for (std::int64_t n = 0; n < N; ++n) state_slots.push_back(static_cast<std::int32_t>(n));
    for (std::int64_t i = 0; i < N * R; ++i) {
      const std::int64_t offset = offsets.dtype == DType::kI64 ? offsets.data_as<std::int64_t>()[i]
                                                               : offsets.data_as<std::int32_t>()[i];
      checkpoint_slots.push_back(offset >= 0 ? static_cast<std::int32_t>(N + i) : -1);
    }
    t.state_slots = static_cast<const std::int32_t*>(
        run.upload(state_slots.data(), state_slots.size() * sizeof(std::int32_t), "state_slots"));
    t.state_slots_host = state_slots.data();
    t.checkpoint_offsets = run.upload("checkpoint_offsets");
    t.checkpoint_slots = static_cast<const std::int32_t*>(
        run.upload(checkpoint_slots.data(), checkpoint_slots.size() * sizeof(std::int32_t),
                   "checkpoint_slots"));
    // The pool starts as zeros: the rows of the requests not written stay so.
    t.final_state = run.upload(final_state.data.data(), final_state.data.size(), "final_state");
  }
  t.out = run.buffer(out.data.size(), "out");
  if (has_final && !pooled) t.final_state = run.buffer(final_state.data.size(), "final_state");
  t.device_status = run.device_status();
  void* workspace = workspace_bytes > 0 ? run.buffer(workspace_bytes, "the workspace") : nullptr;
  run.check(run.backend().prefill(p, t, Workspace{workspace, workspace_bytes}, CudaOptions{}),
            run.what());
  run.download(out.data.data(), t.out, out.data.size());
  if (t.final_state != nullptr) {
    run.download(final_state.data.data(), t.final_state, final_state.data.size());
  }
  run.finish(t.device_status);

  std::vector<Tensor> outputs;
  outputs.push_back(std::move(out));
  Tensor checkpoint_states;
  if (pooled) {
    checkpoint_states = Tensor::zeros("checkpoint_states", p.final_state_dtype, {N, R, H, V, K});
    for (std::int64_t i = 0; i < N * R; ++i) {
      if (checkpoint_slots[static_cast<std::size_t>(i)] < 0) continue;  // stays zeros
      std::memcpy(checkpoint_states.data.data() + static_cast<std::size_t>(i) * state_bytes,
                  final_state.data.data() + static_cast<std::size_t>(N + i) * state_bytes,
                  state_bytes);
    }
    final_state.shape[0] = N;
    final_state.data.resize(static_cast<std::size_t>(N) * state_bytes);
  }
  if (has_final) outputs.push_back(std::move(final_state));
  if (pooled) outputs.push_back(std::move(checkpoint_states));
  return outputs;
}

// A decode case as one speculative verify step: row b's tokens on slots b * T + t of a pool of
// B * T states, the initial state in slot b * T (read first: num_accepted is 1), the state after
// token t written to slot b * T + t. The pool is then the intermediate states [B, T, H, V, K].
std::vector<Tensor> run_decode(const KdaCase& kda_case, Backend backend) {
  const DecodeProblem& p = kda_case.decode;
  const std::int64_t B = p.batch, T = p.tokens, H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  CaseRun run(kda_case, backend, can_implement(p, backend));
  std::size_t workspace_bytes = 0;
  run.check(decode_workspace_size(p, backend, &workspace_bytes), "workspace size");

  Tensor out = Tensor::zeros("out", DType::kBF16, {B, T, H, V});
  Tensor states = Tensor::zeros("intermediate_states", p.state_dtype, {B, T, H, V, K});
  const std::size_t state_bytes = static_cast<std::size_t>(H * V * K) * dtype_size(p.state_dtype);
  if (const Tensor* initial = run.input("initial_state")) {
    const std::vector<std::uint8_t> values =
        detail::case_state_values(*initial, p.state_dtype, static_cast<std::size_t>(B * H * V * K));
    for (std::int64_t b = 0; b < B; ++b) {
      std::memcpy(states.data.data() + static_cast<std::size_t>(b * T) * state_bytes,
                  values.data() + static_cast<std::size_t>(b) * state_bytes, state_bytes);
    }
  }
  std::vector<std::int32_t> slots, num_accepted(static_cast<std::size_t>(B), 1);
  for (std::int64_t i = 0; i < B * T; ++i) slots.push_back(static_cast<std::int32_t>(i));

  DecodeTensors t;
  run.upload_inputs(&t);
  t.slots = static_cast<const std::int32_t*>(
      run.upload(slots.data(), slots.size() * sizeof(std::int32_t), "slots"));
  t.num_accepted = static_cast<const std::int32_t*>(
      run.upload(num_accepted.data(), num_accepted.size() * sizeof(std::int32_t), "num_accepted"));
  t.state_pool = run.upload(states.data.data(), states.data.size(), "the state pool");
  t.out = run.buffer(out.data.size(), "out");
  t.device_status = run.device_status();
  void* workspace = workspace_bytes > 0 ? run.buffer(workspace_bytes, "the workspace") : nullptr;
  run.check(run.backend().decode(p, t, Workspace{workspace, workspace_bytes}, CudaOptions{}),
            run.what());
  run.download(out.data.data(), t.out, out.data.size());
  run.download(states.data.data(), t.state_pool, states.data.size());
  run.finish(t.device_status);

  Tensor final_state = Tensor::zeros("final_state", p.state_dtype, {B, H, V, K});
  for (std::int64_t b = 0; b < B; ++b) {
    std::memcpy(final_state.data.data() + static_cast<std::size_t>(b) * state_bytes,
                states.data.data() + static_cast<std::size_t>(b * T + T - 1) * state_bytes,
                state_bytes);
  }
  std::vector<Tensor> outputs;
  outputs.push_back(std::move(out));
  outputs.push_back(std::move(final_state));
  outputs.push_back(std::move(states));
  return outputs;
}

}  // namespace

std::vector<Tensor> run_case(const KdaCase& kda_case, BackendChoice choice, Backend* used) {
  Backend backend = Backend::kCpu;
  std::vector<Tensor> outputs;
  if (kda_case.mode == CaseMode::kDecode) {
    const DecodeProblem& p = kda_case.decode;
    backend = choose_backend(choice, [&p] { return can_implement(p, Backend::kCuda).ok(); });
    outputs = run_decode(kda_case, backend);
  } else {
    const Problem p = pooled_problem(kda_case.problem);
    backend = choose_backend(choice, [&p] { return can_implement(p, Backend::kCuda).ok(); });
    outputs = run_prefill(kda_case, backend);
  }
  if (used != nullptr) *used = backend;
  return outputs;
}

void check_output_is_not_input(const std::string& input_path, const std::string& output_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  bool same = false;
  if (fs::exists(output_path, ec)) {
    // Same device and inode (what equivalent() compares), through symlinks and hard links.
    std::error_code equivalent_ec;
    same = fs::equivalent(input_path, output_path, equivalent_ec);
  } else {
    // No file to compare by inode: compare where the two paths lead.
    std::error_code in_ec, out_ec;
    const fs::path in = fs::weakly_canonical(input_path, in_ec);
    const fs::path out = fs::weakly_canonical(output_path, out_ec);
    same = !in_ec && !out_ec && in == out;
  }
  if (same) {
    fail(output_path, "is the case file '" + input_path +
                          "' itself (same file); refusing to overwrite the input, nothing written");
  }
}

void run_case_file(const std::string& input_path, const std::string& output_path,
                   BackendChoice backend, Backend* used) {
  check_output_is_not_input(input_path, output_path);
  const KdaCase kda_case = load_case(input_path);
  Backend ran = Backend::kCpu;
  const std::vector<Tensor> outputs = run_case(kda_case, backend, &ran);
  std::map<std::string, std::string> metadata = {
      {"backend", to_string(ran)},
      {"gate", to_string(kda_case.problem.gate)},
      {"producer", "kda-run"},
  };
  save_safetensors(output_path, outputs, metadata);
  if (used != nullptr) *used = ran;
}

}  // namespace kda::engine
