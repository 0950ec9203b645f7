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
const char* const kInputNames[] = {
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"};

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
  expect_shape(a_log, {H}, "[H]", source);
  expect_shape(dt_bias, {H, K}, "[H, K]", source);

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
    if (!std::isfinite(scale) || scale <= 0.0 || !std::isfinite(static_cast<float>(scale))) {
      fail(source,
           "metadata 'scale' is " + case_number_text(scale) + ", expected a finite value > 0");
    }
    p.scale = static_cast<float>(scale);
  }
  p.final_state_dtype = detail::read_case_final_state(metadata, source, final_dtype);

  const Status st = validate(p);
  if (!st.ok()) throw Error(st, source);

  KdaCase result;
  result.source = source;
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

std::vector<Tensor> run_case(const KdaCase& kda_case, BackendChoice choice, Backend* used) {
  const Problem& p = kda_case.problem;
  // Every failure names the case it came from: the operator's own messages ("A_log[0] is not
  // finite") do not know the file.
  const std::string where = kda_case.source.empty() ? std::string() : kda_case.source + ": ";
  auto check = [&where](const Status& st, const std::string& what) {
    if (!st.ok()) throw Error(st, where + what);
  };
  const Backend backend =
      choose_backend(choice, [&p] { return can_implement(p, Backend::kCuda).ok(); });
  check(can_implement(p, backend), std::string("backend ") + to_string(backend));
  std::size_t workspace_bytes = 0;
  check(workspace_size(p, backend, &workspace_bytes), "workspace size");
  std::unique_ptr<EngineBackend> engine_backend;
  try {
    engine_backend = make_engine_backend(backend, BackendOptions{}, where + "backend");
  } catch (const Error& e) {
    throw Error(e.code(), where.empty() ? e.what() : where + e.what());
  }
  EngineBackend& b = *engine_backend;

  Tensor out = Tensor::zeros("out", DType::kBF16, {p.batch, p.seq_len, p.num_heads, p.head_dim_v});
  Tensor final_state;
  const bool has_final = p.final_state_dtype != DType::kNone;
  if (has_final) {
    final_state = Tensor::zeros("final_state", p.final_state_dtype,
                                {p.sequences(), p.num_heads, p.head_dim_v, p.head_dim_k});
  }
  auto input = [&kda_case](const char* name) -> const Tensor* {
    const auto it = kda_case.tensors.find(name);
    return it == kda_case.tensors.end() ? nullptr : &it->second;
  };

  // Every tensor in the backend's memory (0 bytes still get a valid pointer, so length-0
  // problems pass the pointer checks), freed after the backend is done with it.
  std::vector<BackendBuffer> allocations;
  auto buffer = [&](std::size_t bytes, const char* what) -> void* {
    try {
      allocations.emplace_back(b, bytes, what);
    } catch (const Error& e) {
      throw Error(e.code(), where + e.what());
    }
    return allocations.back().get();
  };
  auto upload = [&](const char* name) -> const void* {
    const Tensor* tensor = input(name);
    if (tensor == nullptr) return nullptr;
    void* ptr = buffer(tensor->data.size(), name);
    b.copy_to_device(ptr, tensor->data.data(), tensor->data.size());
    return ptr;
  };
  Tensors t;
  t.q = upload("q");
  t.k = upload("k");
  t.v = upload("v");
  t.g = upload("g");
  t.beta = upload("beta");
  t.A_log = static_cast<const float*>(upload("A_log"));
  t.dt_bias = static_cast<const float*>(upload("dt_bias"));
  t.cu_seqlens = upload("cu_seqlens");
  if (const Tensor* cu = input("cu_seqlens")) {
    t.cu_seqlens_host = cu->data.empty() ? static_cast<const void*>(g_empty) : cu->data.data();
  }
  t.initial_state = upload("initial_state");
  t.out = buffer(out.data.size(), "out");
  if (has_final) t.final_state = buffer(final_state.data.size(), "final_state");
  void* workspace = workspace_bytes > 0 ? buffer(workspace_bytes, "the workspace") : nullptr;
  std::string forward = std::string(to_string(backend)) + " forward";  // "CPU forward"
  std::transform(forward.begin(), forward.begin() + static_cast<std::ptrdiff_t>(forward.find(' ')),
                 forward.begin(), [](char c) { return static_cast<char>(std::toupper(c)); });
  check(b.prefill(p, t, Workspace{workspace, workspace_bytes}, CudaOptions{}), forward);
  try {
    b.copy_to_host(out.data.data(), t.out, out.data.size());
    if (has_final) b.copy_to_host(final_state.data.data(), t.final_state, final_state.data.size());
    b.synchronize();
  } catch (const Error& e) {
    throw Error(e.code(), where + forward + ": " + e.what());
  }
  if (used != nullptr) *used = backend;
  std::vector<Tensor> outputs;
  outputs.push_back(std::move(out));
  if (has_final) outputs.push_back(std::move(final_state));
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
