// kda/engine/safetensors.hpp — reading and writing safetensors files (weights and case files).
//
// Format: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) plus an optional "__metadata__" map of strings to strings.
//
// Dtypes read: BF16, F16, F32, I32, I64. A tensor of another safetensors dtype (F64, U8, BOOL,
// F8_E4M3, F4, ...: a quantized checkpoint's experts) is listed, with DType::kNone and its dtype in
// TensorInfo::dtype_text, and refused naming the tensor when read; a dtype safetensors does not
// define is an error when the header is read. The reader validates the whole header against the
// file size before any tensor is read: empty or truncated files, header lengths past the end of the
// file or above 100 MB, JSON that does not parse or is not an object, malformed entries, reversed
// offsets, offsets past the end of the data, overlapping tensors, shapes whose element or byte
// count overflows 64 bits or does not match the offsets — each throws kda::Error (kInvalidArgument;
// kOverflow for overflows) whose message starts with the file path and names the tensor. Gaps
// between tensors are tolerated.
//
// The writer lays tensors out in the order given, 8-byte aligned header, and writes atomically:
// a temporary file in the destination directory, renamed over the destination only once complete,
// so a failure never leaves a partial or stale-looking output behind.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kda/kda.hpp"

namespace kda::engine {

// Parses "BF16" / "F16" / "F32" / "I32" / "I64" (false on anything else) and the reverse.
bool parse_safetensors_dtype(const std::string& text, DType* dtype) noexcept;
const char* safetensors_dtype_name(DType dtype) noexcept;

// Element count of a shape; false when a dimension is negative or the product overflows.
bool shape_numel(const std::vector<std::int64_t>& shape, std::int64_t* numel) noexcept;
// "[2, 3, 4]"
std::string shape_to_string(const std::vector<std::int64_t>& shape);

// One tensor's header entry.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kNone;  // kNone: a dtype this reader does not read (dtype_text says which)
  std::string dtype_text;      // as the header writes it: "BF16", "F8_E4M3", ...
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;  // data_offsets[0], relative to the data section
  std::uint64_t bytes = 0;   // data_offsets[1] - data_offsets[0]
};

// A tensor held in host memory.
struct Tensor {
  std::string name;
  DType dtype = DType::kNone;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> data;  // numel * dtype_size bytes

  // A zero-filled tensor of the given shape. Throws kda::Error on a bad shape or overflow.
  static Tensor zeros(std::string name, DType dtype, std::vector<std::int64_t> shape);
  std::int64_t numel() const noexcept;

  template <typename T>
  T* data_as() noexcept {
    return reinterpret_cast<T*>(data.data());
  }
  template <typename T>
  const T* data_as() const noexcept {
    return reinterpret_cast<const T*>(data.data());
  }
};

// A safetensors file whose header has been read and validated; tensor data is read on demand, so
// opening a large checkpoint to take two small tensors out of it reads only those.
class SafetensorsFile {
 public:
  // Reads and validates the header. Throws kda::Error.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const noexcept { return path_; }
  // Sorted by data offset.
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  // nullptr when absent.
  const TensorInfo* find(const std::string& name) const noexcept;

  // Reads one tensor. Throws kda::Error when absent, of a dtype this reader does not read, or when
  // the file cannot be read.
  Tensor read(const std::string& name) const;
  // Reads every tensor, in offset order.
  std::vector<Tensor> read_all() const;

 private:
  std::string path_;
  std::uint64_t data_start_ = 0;  // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Validates and parses a header (the JSON text) for a data section of `data_bytes` bytes. `source`
// prefixes error messages. Exposed for tests and for in-memory use.
std::vector<TensorInfo> parse_safetensors_header(const std::string& header_json,
                                                 std::uint64_t data_bytes,
                                                 const std::string& source,
                                                 std::map<std::string, std::string>* metadata);

// The bytes of a safetensors file holding `tensors` (in that order) and `metadata`. Throws
// kda::Error on duplicate or empty names, a name "__metadata__", or a data size that does not match
// the shape and dtype.
std::vector<std::uint8_t> serialize_safetensors(
    const std::vector<Tensor>& tensors, const std::map<std::string, std::string>& metadata = {});

// serialize_safetensors() written atomically to `path` (temporary file + rename). A symbolic link
// is written through (its final target replaced, the link kept); a path that is not a regular
// file (a directory, a device, a pipe) is refused. Throws kda::Error; on failure `path` is left as
// it was and no temporary file remains.
void save_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kda::engine
