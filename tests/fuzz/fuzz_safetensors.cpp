// libFuzzer harness for the safetensors reader and the case-file validation built on it.
//
// The input is the content of a file. It is written to an in-memory file (memfd; a temporary file
// where memfd is missing) and read back through the public path: SafetensorsFile::open (framing and
// header validation), read_all (every tensor's data), then load_case (the case-file contract) and,
// for tiny valid cases, one CPU forward. Contract under test: kda::Error is the only failure;
// a crash, undefined behaviour, a leak, another exception type, or an accepted file whose tensors
// break the documented invariants is a finding (abort, so that libFuzzer keeps the input).
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
#include "kda/engine/safetensors.hpp"
#include "kda/error.hpp"

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_safetensors: FINDING: %s\n", what.c_str());
  std::abort();
}

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
bool tiny(const kda::Problem& p) {
  const std::int64_t tokens = p.batch * p.seq_len;
  return tokens <= 64 && p.num_heads <= 4 && p.head_dim_k <= 64 && p.head_dim_v <= 64 &&
         p.sequences() <= 8;
}

void run_one(const std::string& path, std::size_t file_size) {
  try {
    const kda::engine::SafetensorsFile file = kda::engine::SafetensorsFile::open(path);
    check_file(file, file_size);
  } catch (const kda::Error&) {
    return;  // a bad file: the documented outcome (the case path would fail the same way)
  }
  try {
    const kda::engine::KdaCase kda_case = kda::engine::load_case(path);
    if (tiny(kda_case.problem)) {
      const std::vector<kda::engine::Tensor> outputs =
          kda::engine::run_case(kda_case, kda::engine::BackendChoice::kCpu);
      expect(!outputs.empty() && outputs[0].name == "out", "run_case returns out first");
    }
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
