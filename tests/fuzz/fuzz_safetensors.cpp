// libFuzzer harness for the safetensors reader and the case-file validation built on it.
//
// The input is the content of a file. It is written to an in-memory file (memfd; a temporary file
// where memfd is missing) and read back through the public path: SafetensorsFile::open (framing and
// header validation), read_all (every tensor's data), then both case-file contracts: load_case (the
// KDA core: prefill, checkpoints, decode mode) and load_layer_case (the whole layer), and for tiny
// valid cases one CPU forward of each. Contract under test: kda::Error is the only failure; a
// crash, undefined behaviour, a leak, another exception type, an accepted file whose tensors break
// the documented invariants, or a forward whose outputs are not the documented tensors of the
// documented shapes is a finding (abort, so that libFuzzer keeps the input).
//
// Mutations that insert or delete bytes in the JSON header break the 8-byte length field, so each
// input is also tried with that field rewritten to end the header at the input's last '}': the
// fuzzer then explores header contents, not only the length check.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include "case_file.hpp"
#include "fuzz_support.hpp"
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"

namespace {

using kda::fuzz::finding;

// One file, rewritten for every input; its /proc/self/fd path (memfd) or its real path.
class ScratchFile {
 public:
  ScratchFile() {
#ifdef MFD_CLOEXEC
    fd_ = memfd_create("kda-fuzz-safetensors", MFD_CLOEXEC);
    if (fd_ >= 0) path_ = "/proc/self/fd/" + std::to_string(fd_);
    if (fd_ >= 0 && access(path_.c_str(), R_OK) != 0) {  // no /proc: fall back to a real file
      close(fd_);
      fd_ = -1;
    }
#endif
    if (fd_ < 0) {
      const char* dir = std::getenv("TMPDIR");
      std::string pattern = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") +
                            "/kda-fuzz-safetensors-XXXXXX";
      std::vector<char> name(pattern.begin(), pattern.end());
      name.push_back('\0');
      fd_ = mkstemp(name.data());
      if (fd_ < 0) finding("cannot create a scratch file");
      path_ = name.data();
      unlink_ = true;
    }
  }
  ~ScratchFile() {
    close(fd_);
    if (unlink_) unlink(path_.c_str());
  }
  const std::string& write(const std::uint8_t* data, std::size_t size) {
    if (ftruncate(fd_, 0) != 0) finding("ftruncate failed");
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) finding("pwrite failed");
      done += static_cast<std::size_t>(n);
    }
    return path_;
  }

 private:
  int fd_ = -1;
  std::string path_;
  bool unlink_ = false;
};

void expect(bool condition, const std::string& what) {
  if (!condition) finding("accepted file breaks: " + what);
}

void check_file(const kda::engine::SafetensorsFile& file, std::size_t file_size) {
  using kda::engine::Tensor;
  using kda::engine::TensorInfo;
  const std::vector<TensorInfo>& infos = file.tensors();
  for (std::size_t i = 0; i < infos.size(); ++i) {
    const TensorInfo& t = infos[i];
    expect(t.offset <= file_size && t.bytes <= file_size - t.offset,
           "tensor '" + t.name + "' lies inside the file");
    std::int64_t numel = 0;
    expect(kda::engine::shape_numel(t.shape, &numel), "tensor '" + t.name + "' numel fits");
    // A dtype the reader does not read (F8_E4M3, F4, ...) is listed by its name; its data is
    // refused when read.
    expect(t.dtype != kda::DType::kNone || !t.dtype_text.empty(),
           "tensor '" + t.name + "' of a dtype not read keeps its name");
    expect(t.dtype == kda::DType::kNone ||
               static_cast<std::uint64_t>(numel) * kda::dtype_size(t.dtype) == t.bytes,
           "tensor '" + t.name + "' shape matches its bytes");
    if (i > 0) expect(infos[i - 1].offset <= t.offset, "tensors sorted by offset");
    expect(file.find(t.name) != nullptr, "find() finds '" + t.name + "'");
  }
  const std::vector<Tensor> all = file.read_all();
  expect(all.size() == infos.size(), "read_all reads every tensor");
  for (std::size_t i = 0; i < all.size(); ++i) {
    expect(all[i].data.size() == infos[i].bytes, "tensor '" + all[i].name + "' data size");
    expect(all[i].numel() >= 0, "tensor '" + all[i].name + "' numel");
  }
}

// A forward is run only on tiny cases: the point is the validation, not the arithmetic.
bool tiny(const kda::engine::KdaCase& c) {
  if (c.mode == kda::engine::CaseMode::kDecode) {
    const kda::DecodeProblem& d = c.decode;
    return d.batch * d.tokens <= 64 && d.num_heads <= 4 && d.head_dim_k <= 64 && d.head_dim_v <= 64;
  }
  const kda::Problem& p = c.problem;
  const std::int64_t tokens = p.batch * p.seq_len;
  return tokens <= 64 && p.num_heads <= 4 && p.head_dim_k <= 64 && p.head_dim_v <= 64 &&
         p.sequences() <= 8 && p.checkpoints <= 4;
}

bool tiny(const kda::engine::LayerCase& c) {
  const kda::layer::Config& config = c.weights.config;
  return c.tokens <= 64 && c.sequences <= 8 && config.hidden_size <= 128 &&
         config.num_heads * config.head_dim <= 128 && config.conv_width <= 8 && c.checkpoints <= 4;
}

using Shape = std::vector<std::int64_t>;

// The output named `name` with `shape`, at position `index` of `outputs`.
void expect_output(const std::vector<kda::engine::Tensor>& outputs, std::size_t index,
                   const std::string& name, const Shape& shape) {
  expect(index < outputs.size() && outputs[index].name == name,
         "output " + std::to_string(index) + " is '" + name + "'");
  expect(outputs[index].shape == shape, "output '" + name + "' has shape " +
                                            kda::engine::shape_to_string(shape) + ", not " +
                                            kda::engine::shape_to_string(outputs[index].shape));
}

void run_kda_case(const std::string& path) {
  const kda::engine::KdaCase c = kda::engine::load_case(path);
  if (!tiny(c)) return;
  const std::vector<kda::engine::Tensor> outputs =
      kda::engine::run_case(c, kda::engine::BackendChoice::kCpu);
  if (c.mode == kda::engine::CaseMode::kDecode) {
    const kda::DecodeProblem& d = c.decode;
    const std::int64_t H = d.num_heads, K = d.head_dim_k, V = d.head_dim_v;
    expect(outputs.size() == 3,
           "a decode case's outputs are out, final_state, intermediate_states");
    expect_output(outputs, 0, "out", {d.batch, d.tokens, H, V});
    expect_output(outputs, 1, "final_state", {d.batch, H, V, K});
    expect_output(outputs, 2, "intermediate_states", {d.batch, d.tokens, H, V, K});
    return;
  }
  const kda::Problem& p = c.problem;
  const std::int64_t N = p.sequences(), H = p.num_heads, K = p.head_dim_k, V = p.head_dim_v;
  expect_output(outputs, 0, "out", {p.batch, p.seq_len, H, V});
  std::size_t next = 1;
  if (next < outputs.size() && outputs[next].name == "final_state") {
    expect_output(outputs, next++, "final_state", {N, H, V, K});
  }
  if (p.checkpoints > 0) {
    expect_output(outputs, next++, "checkpoint_states", {N, p.checkpoints, H, V, K});
  }
  expect(outputs.size() == next, "a prefill case's outputs are the documented ones");
}

void run_layer_case(const std::string& path) {
  const kda::engine::LayerCase c = kda::engine::load_layer_case(path);
  if (!tiny(c)) return;
  const std::vector<kda::engine::Tensor> outputs =
      kda::engine::run_layer_case(c, kda::engine::BackendChoice::kCpu);
  const kda::layer::Config& config = c.weights.config;
  const std::int64_t N = c.sequences, H = config.num_heads, D = config.head_dim;
  const std::int64_t C = H * D, W1 = config.conv_width - 1;
  expect_output(outputs, 0, "out", {c.tokens, config.hidden_size});
  std::size_t next = 1;
  if (c.final_dtype != kda::DType::kNone) {
    for (const char* name : {"conv_state_q", "conv_state_k", "conv_state_v"}) {
      expect_output(outputs, next++, name, {N, C, W1});
    }
    expect_output(outputs, next++, "recurrent_state", {N, H, D, D});
  }
  if (c.checkpoints > 0) {
    expect_output(outputs, next++, "checkpoint_states", {N, c.checkpoints, H, D, D});
    for (const char* name :
         {"checkpoint_conv_state_q", "checkpoint_conv_state_k", "checkpoint_conv_state_v"}) {
      expect_output(outputs, next++, name, {N, c.checkpoints, C, W1});
    }
  }
  if (c.decode_tokens > 0) {
    const std::int64_t T = c.decode_tokens;
    expect_output(outputs, next++, "intermediate_states", {N, T, H, D, D});
    for (const char* name :
         {"intermediate_conv_state_q", "intermediate_conv_state_k", "intermediate_conv_state_v"}) {
      expect_output(outputs, next++, name, {N, T, C, W1});
    }
  }
  expect(outputs.size() == next, "a layer case's outputs are the documented ones");
}

void run_one(const std::string& path, std::size_t file_size) {
  try {
    const kda::engine::SafetensorsFile file = kda::engine::SafetensorsFile::open(path);
    check_file(file, file_size);
  } catch (const kda::Error&) {
    return;  // a bad file: the documented outcome (the case paths would fail the same way)
  }
  try {
    run_kda_case(path);
  } catch (const kda::Error&) {
  }
  try {
    run_layer_case(path);
  } catch (const kda::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static ScratchFile scratch;
  try {
    run_one(scratch.write(data, size), size);

    // The same bytes with the length field re-derived from the last '}' (see the file comment).
    if (size > 9) {
      std::size_t last = size;
      for (std::size_t i = size; i-- > 8;) {
        if (data[i] == '}') {
          last = i;
          break;
        }
      }
      if (last < size) {
        std::vector<std::uint8_t> framed(data, data + size);
        const std::uint64_t header_len = last + 1 - 8;
        for (int i = 0; i < 8; ++i) {
          framed[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(header_len >> (8 * i));
        }
        if (std::memcmp(framed.data(), data, 8) != 0) {
          run_one(scratch.write(framed.data(), framed.size()), framed.size());
        }
      }
    }
  } catch (const std::exception& e) {
    finding(std::string("exception other than kda::Error: ") + e.what());
  } catch (...) {
    finding("non-std exception");
  }
  return 0;
}
