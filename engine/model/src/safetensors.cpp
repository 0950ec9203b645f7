// engine/model/src/safetensors.cpp — a strict safetensors reader and an atomic writer.
#include "kda/engine/safetensors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <system_error>

#include "bounded_json.hpp"
#include "file_failure.hpp"
#include "kda/error.hpp"

namespace kda::engine {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The reference implementation's limit; a larger header is a corrupt length field, not a header.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::uint64_t kMaxU64 = std::numeric_limits<std::uint64_t>::max();

[[noreturn]] void fail(const std::string& source, const std::string& what,
                       StatusCode code = StatusCode::kInvalidArgument) {
  throw Error(code, source + ": " + what);
}

std::string in_quotes(const std::string& name) { return "'" + name + "'"; }

// The safetensors dtypes this reader holds no DType for, with their bits per element (0: packed
// below a byte, whose layout is not checked). Their tensors are listed (a checkpoint's FP8 experts
// or packed MXFP4 blocks sit beside the BF16 tensors the engine reads) and refused when read.
std::uint64_t foreign_dtype_bits(const std::string& text) {
  static const std::map<std::string, std::uint64_t> kBits = {
      {"F64", 64},    {"I8", 8},   {"U8", 8},   {"I16", 16},    {"U16", 16},
      {"U32", 32},    {"U64", 64}, {"BOOL", 8}, {"F8_E4M3", 8}, {"F8_E5M2", 8},
      {"F8_E8M0", 8}, {"C64", 64}, {"F4", 0},   {"F6_E2M3", 0}, {"F6_E3M2", 0}};
  const auto it = kBits.find(text);
  return it == kBits.end() ? ~std::uint64_t{0} : it->second;
}

std::uint64_t read_u64_le(const unsigned char* bytes) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

// A non-negative JSON integer that fits in 64 bits.
bool as_u64(const json& value, std::uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<std::uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<std::int64_t>() >= 0) {
    *out = static_cast<std::uint64_t>(value.get<std::int64_t>());
    return true;
  }
  return false;
}

std::string range_text(const TensorInfo& t) {
  return "[" + std::to_string(t.offset) + ", " + std::to_string(t.offset + t.bytes) + ")";
}

}  // namespace

bool parse_safetensors_dtype(const std::string& text, DType* dtype) noexcept {
  if (dtype == nullptr) return false;
  if (text == "BF16")
    *dtype = DType::kBF16;
  else if (text == "F16")
    *dtype = DType::kF16;
  else if (text == "F32")
    *dtype = DType::kF32;
  else if (text == "I32")
    *dtype = DType::kI32;
  else if (text == "I64")
    *dtype = DType::kI64;
  else
    return false;
  return true;
}

const char* safetensors_dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    default:
      return "NONE";
  }
}

bool shape_numel(const std::vector<std::int64_t>& shape, std::int64_t* numel) noexcept {
  std::int64_t product = 1;
  for (const std::int64_t dim : shape) {
    if (dim < 0) return false;
    if (dim != 0 && product > std::numeric_limits<std::int64_t>::max() / dim) return false;
    product *= dim;
  }
  *numel = product;
  return true;
}

std::string shape_to_string(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

Tensor Tensor::zeros(std::string name, DType dtype, std::vector<std::int64_t> shape) {
  std::int64_t numel = 0;
  const std::uint64_t size = dtype_size(dtype);
  if (size == 0)
    throw Error(StatusCode::kInvalidArgument, "tensor " + in_quotes(name) + ": no dtype");
  if (!shape_numel(shape, &numel) || static_cast<std::uint64_t>(numel) > kMaxU64 / size ||
      static_cast<std::uint64_t>(numel) * size > std::numeric_limits<std::size_t>::max()) {
    throw Error(StatusCode::kOverflow, "tensor " + in_quotes(name) + ": shape " +
                                           shape_to_string(shape) +
                                           " is negative or its byte count overflows");
  }
  Tensor tensor;
  tensor.name = std::move(name);
  tensor.dtype = dtype;
  tensor.shape = std::move(shape);
  tensor.data.assign(static_cast<std::size_t>(numel) * size, 0);
  return tensor;
}

std::int64_t Tensor::numel() const noexcept {
  std::int64_t n = 0;
  return shape_numel(shape, &n) ? n : -1;
}

std::vector<TensorInfo> parse_safetensors_header(const std::string& header_json,
                                                 std::uint64_t data_bytes,
                                                 const std::string& source,
                                                 std::map<std::string, std::string>* metadata) {
  json header;
  try {
    header = parse_bounded_json(header_json);
  } catch (const JsonBoundsError& e) {
    fail(source, std::string("header ") + e.what());
  } catch (const json::exception& e) {
    fail(source, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) fail(source, "header is not a JSON object");

  std::vector<TensorInfo> tensors;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(source, "__metadata__ is not an object of strings");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          fail(source, "__metadata__ value of " + in_quotes(m.key()) + " is not a string");
        }
        if (metadata != nullptr) (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string who = "tensor " + in_quotes(name);
    if (!entry.is_object()) fail(source, who + ": header entry is not an object");

    TensorInfo info;
    info.name = name;
    const auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end() || !dtype_it->is_string()) fail(source, who + ": missing dtype");
    const std::string dtype_text = dtype_it->get<std::string>();
    info.dtype_text = dtype_text;
    std::uint64_t element_bits = 0;
    if (parse_safetensors_dtype(dtype_text, &info.dtype)) {
      element_bits = 8 * dtype_size(info.dtype);
    } else {
      element_bits = foreign_dtype_bits(dtype_text);
      if (element_bits == ~std::uint64_t{0}) {
        fail(source,
             who + ": unknown dtype " + in_quotes(dtype_text) + " (not a safetensors dtype)");
      }
    }

    const auto shape_it = entry.find("shape");
    if (shape_it == entry.end() || !shape_it->is_array()) fail(source, who + ": missing shape");
    for (std::size_t i = 0; i < shape_it->size(); ++i) {
      const json& dim = (*shape_it)[i];
      std::uint64_t value = 0;
      if (!as_u64(dim, &value) ||
          value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        // The entry as written, cut short: it may be a whole nested structure.
        std::string shown = dim.dump();
        if (shown.size() > 40) shown = shown.substr(0, 40) + "...";
        fail(source, who + ": shape entry " + std::to_string(i) + " (" + shown +
                         ") is not a non-negative 64-bit integer");
      }
      info.shape.push_back(static_cast<std::int64_t>(value));
    }

    const auto offsets_it = entry.find("data_offsets");
    std::uint64_t begin = 0, end = 0;
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !as_u64((*offsets_it)[0], &begin) || !as_u64((*offsets_it)[1], &end)) {
      fail(source, who + ": data_offsets must be [begin, end], two non-negative integers");
    }
    if (begin > end) {
      fail(source, who + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                       "] are reversed (begin > end)");
    }
    if (end > data_bytes) {
      fail(source, who + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                       "] run past the end of the data section (" + std::to_string(data_bytes) +
                       " bytes; file truncated?)");
    }
    info.offset = begin;
    info.bytes = end - begin;

    std::int64_t numel = 0;
    const std::uint64_t element = element_bits / 8;
    if (!shape_numel(info.shape, &numel) ||
        (element != 0 && static_cast<std::uint64_t>(numel) > kMaxU64 / element)) {
      fail(source, who + ": shape " + shape_to_string(info.shape) + " overflows 64 bits",
           StatusCode::kOverflow);
    }
    const std::uint64_t expected = static_cast<std::uint64_t>(numel) * element;
    if (element != 0 && expected != info.bytes) {
      fail(source, who + ": shape " + shape_to_string(info.shape) + " of " + dtype_text +
                       " needs " + std::to_string(expected) + " bytes but data_offsets hold " +
                       std::to_string(info.bytes));
    }
    tensors.push_back(std::move(info));
  }

  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset < b.offset || (a.offset == b.offset && a.bytes < b.bytes);
  });
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    const TensorInfo& prev = tensors[i - 1];
    const TensorInfo& cur = tensors[i];
    // Empty tensors occupy nothing and overlap nothing.
    if (cur.bytes != 0 && prev.bytes != 0 && cur.offset < prev.offset + prev.bytes) {
      fail(source, "tensor " + in_quotes(cur.name) + " data " + range_text(cur) +
                       " overlaps tensor " + in_quotes(prev.name) + " data " + range_text(prev));
    }
  }
  // An empty tensor between two others must not hide an overlap of its neighbours.
  std::uint64_t covered_end = 0;
  const TensorInfo* covered_by = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.bytes == 0) continue;
    if (covered_by != nullptr && t.offset < covered_end) {
      fail(source, "tensor " + in_quotes(t.name) + " data " + range_text(t) + " overlaps tensor " +
                       in_quotes(covered_by->name) + " data " + range_text(*covered_by));
    }
    if (t.offset + t.bytes > covered_end) {
      covered_end = t.offset + t.bytes;
      covered_by = &t;
    }
  }
  return tensors;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(path, "is a directory, not a safetensors file");
  if (is_special_file(path)) {
    fail(path, "is not a regular file (a FIFO, socket or device), not a safetensors file");
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, file_failure("cannot open the safetensors file", path, errno));
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (end < 0) fail(path, "cannot determine the file size");
  const std::uint64_t file_size = static_cast<std::uint64_t>(end);
  in.seekg(0, std::ios::beg);
  if (file_size == 0) fail(path, "file is empty");
  if (file_size < 8) {
    fail(path, "truncated: " + std::to_string(file_size) +
                   " bytes, shorter than the 8-byte header length");
  }
  unsigned char length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  if (!in) fail(path, "cannot read the header length");
  const std::uint64_t header_len = read_u64_le(length_bytes);
  if (header_len == 0) fail(path, "header length is 0 (no JSON header)");
  if (header_len > kMaxHeaderBytes) {
    fail(path, "header length " + std::to_string(header_len) + " is absurd (limit " +
                   std::to_string(kMaxHeaderBytes) + " bytes): not a safetensors file?");
  }
  if (header_len > file_size - 8) {
    fail(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(file_size) + " bytes): truncated?");
  }
  std::string header(static_cast<std::size_t>(header_len), '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  if (!in) fail(path, "cannot read the header");

  SafetensorsFile file;
  file.path_ = path;
  file.data_start_ = 8 + header_len;
  file.tensors_ =
      parse_safetensors_header(header, file_size - file.data_start_, path, &file.metadata_);
  return file;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const noexcept {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Tensor SafetensorsFile::read(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) fail(path_, "no tensor " + in_quotes(name));
  if (info->dtype == DType::kNone) {
    fail(path_, "tensor " + in_quotes(name) + " has dtype " + info->dtype_text +
                    ", which this reader does not read (it reads BF16, F16, F32, I32, I64)");
  }
  Tensor tensor;
  tensor.name = info->name;
  tensor.dtype = info->dtype;
  tensor.shape = info->shape;
  if (info->bytes > std::numeric_limits<std::size_t>::max()) {
    fail(path_, "tensor " + in_quotes(name) + " is too large for this machine",
         StatusCode::kOverflow);
  }
  tensor.data.resize(static_cast<std::size_t>(info->bytes));
  if (info->bytes == 0) return tensor;
  errno = 0;
  std::ifstream in(path_, std::ios::binary);
  if (!in) fail(path_, file_failure("cannot reopen the safetensors file", path_, errno));
  in.seekg(static_cast<std::streamoff>(data_start_ + info->offset), std::ios::beg);
  in.read(reinterpret_cast<char*>(tensor.data.data()), static_cast<std::streamsize>(info->bytes));
  if (!in || static_cast<std::uint64_t>(in.gcount()) != info->bytes) {
    fail(path_, "cannot read the data of tensor " + in_quotes(name) + " (file truncated?)");
  }
  return tensor;
}

std::vector<Tensor> SafetensorsFile::read_all() const {
  std::vector<Tensor> all;
  all.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) all.push_back(read(t.name));
  return all;
}

std::vector<std::uint8_t> serialize_safetensors(
    const std::vector<Tensor>& tensors, const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps the tensors in the order given, which is also their data order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = meta;
  }
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    const std::string who = "tensor " + in_quotes(t.name);
    if (t.name.empty() || t.name == "__metadata__") {
      throw Error(StatusCode::kInvalidArgument, who + ": not a valid tensor name");
    }
    if (!names.insert(t.name).second) {
      throw Error(StatusCode::kInvalidArgument, who + ": name used twice");
    }
    std::int64_t numel = 0;
    const std::uint64_t element = dtype_size(t.dtype);
    DType supported = DType::kNone;
    if (element == 0 || !parse_safetensors_dtype(safetensors_dtype_name(t.dtype), &supported)) {
      throw Error(StatusCode::kInvalidArgument, who + ": unsupported dtype");
    }
    if (!shape_numel(t.shape, &numel) || static_cast<std::uint64_t>(numel) > kMaxU64 / element ||
        static_cast<std::uint64_t>(numel) * element != t.data.size()) {
      throw Error(StatusCode::kInvalidArgument, who + ": " + std::to_string(t.data.size()) +
                                                    " bytes of data do not match shape " +
                                                    shape_to_string(t.shape) + " of " +
                                                    safetensors_dtype_name(t.dtype));
    }
    nlohmann::ordered_json entry;
    entry["dtype"] = safetensors_dtype_name(t.dtype);
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + t.data.size()};
    header[t.name] = entry;
    offset += t.data.size();
  }
  std::string text = header.dump();
  // The format recommends padding the header with spaces to a multiple of 8 bytes, so that the
  // data section is aligned for readers that map the file.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<std::uint8_t> bytes;
  bytes.reserve(8 + text.size() + offset);
  std::uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<std::uint8_t>(length >> (8 * i)));
  bytes.insert(bytes.end(), text.begin(), text.end());
  for (const Tensor& t : tensors) bytes.insert(bytes.end(), t.data.begin(), t.data.end());
  return bytes;
}

void save_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::vector<std::uint8_t> bytes = serialize_safetensors(tensors, metadata);

  // A symbolic link is written through, as a plain write would: its final target is replaced and
  // the link kept. The temporary file lies beside that target, so the rename stays in one
  // directory.
  fs::path target(path);
  std::error_code link_ec;
  // What the path resolves to, as the system resolves it (through every link), before the links
  // are followed by hand: a link into /proc to a pipe (/dev/stdout) leads to no path the loop
  // below could follow.
  if (const fs::file_status status = fs::status(target, link_ec);
      fs::exists(status) && !fs::is_regular_file(status)) {
    fail(path,
         "is not a regular file (a directory, device or pipe): the output is a file written "
         "whole, then moved into place");
  }
  for (int hops = 0; fs::is_symlink(fs::symlink_status(target, link_ec)); ++hops) {
    const fs::path link = fs::read_symlink(target, link_ec);
    if (link_ec || hops == 40) {
      fail(path, "cannot follow the symbolic link " + target.string() +
                     (link_ec ? " (" + link_ec.message() + ")" : " (too many levels)"));
    }
    target = link.is_absolute() ? link : target.parent_path() / link;
  }
  // Messages name the path given and, where links led elsewhere, where they led.
  const std::string where =
      target.string() == path ? path : path + " (through links: " + target.string() + ")";
  std::random_device random;
  const std::string suffix = ".tmp-" + std::to_string(random()) + std::to_string(random());
  const fs::path temp = target.parent_path() / (target.filename().string() + suffix);
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) fail(where, std::string("cannot create output (") + std::strerror(errno) + ")");
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      const int saved = errno;
      out.close();
      std::error_code ignored;
      fs::remove(temp, ignored);
      fail(where, std::string("cannot write output (") + std::strerror(saved) + ")");
    }
    out.close();
    if (out.fail()) {
      std::error_code ignored;
      fs::remove(temp, ignored);
      fail(where, "cannot close output");
    }
  }
  std::error_code ec;
  fs::rename(temp, target, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    fail(where, "cannot move the finished output into place (" + ec.message() + ")");
  }
}

}  // namespace kda::engine
