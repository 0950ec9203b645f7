// Safetensors: round trip of every supported dtype, atomic writes, one clear error per kind of
// malformed file, and tensors of dtypes not read (a quantized checkpoint's) listed but refused.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kda/engine/error.hpp"
#include "kda/engine/safetensors.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using kda::DType;
using kda::engine::SafetensorsFile;
using kda::engine::Tensor;

using kda::test::TempDir;

namespace {

Tensor random_tensor(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
                     std::mt19937_64& rng) {
  Tensor t = Tensor::zeros(name, dtype, std::move(shape));
  for (auto& byte : t.data) byte = static_cast<std::uint8_t>(rng());
  return t;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[static_cast<std::size_t>(i)] = static_cast<char>(value >> (8 * i));
  return bytes;
}

// A file with the given header text and `data_bytes` bytes of data.
std::string file_with_header(const std::string& header, std::size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

// Opens `path` expecting kda::Error; returns the message.
std::string open_error(const std::string& path, kda::StatusCode* code = nullptr) {
  try {
    SafetensorsFile::open(path);
  } catch (const kda::Error& e) {
    if (code != nullptr) *code = e.code();
    return e.what();
  }
  return {};
}

void check_bad(const TempDir& dir, const std::string& bytes,
               std::initializer_list<const char*> parts) {
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, bytes);
  const std::string message = open_error(path);
  INFO("message: " << message);
  REQUIRE_FALSE(message.empty());
  CHECK(message.rfind(path, 0) == 0);  // names the file first
  for (const char* part : parts) CHECK(message.find(part) != std::string::npos);
}

}  // namespace

TEST_CASE("round trip: every dtype / odd shapes / metadata") {
  TempDir dir;
  std::mt19937_64 rng(42);
  std::vector<Tensor> tensors;
  tensors.push_back(random_tensor("q", DType::kBF16, {2, 3, 4, 5}, rng));
  tensors.push_back(random_tensor("A_log", DType::kF32, {7}, rng));
  tensors.push_back(random_tensor("half", DType::kF16, {2, 5}, rng));
  tensors.push_back(random_tensor("cu_seqlens", DType::kI64, {3}, rng));
  tensors.push_back(random_tensor("slots", DType::kI32, {1, 3}, rng));
  tensors.push_back(random_tensor("scalar", DType::kF32, {}, rng));
  tensors.push_back(random_tensor("empty", DType::kBF16, {0, 4}, rng));
  tensors.push_back(random_tensor("last", DType::kBF16, {3}, rng));  // 6 bytes: odd end
  const std::map<std::string, std::string> metadata = {{"gate", "softplus"}, {"scale", "0.125"}};
  const std::string path = dir.file("round.safetensors");
  kda::engine::save_safetensors(path, tensors, metadata);
  CHECK(dir.entries() == 1);  // no temporary left behind

  // The header length is a multiple of 8 (data section aligned).
  std::ifstream in(path, std::ios::binary);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  CHECK(length[0] % 8 == 0);

  const SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.metadata() == metadata);
  REQUIRE(file.tensors().size() == tensors.size());
  for (const Tensor& expected : tensors) {
    CAPTURE(expected.name);
    const Tensor got = file.read(expected.name);
    CHECK(got.dtype == expected.dtype);
    CHECK(got.shape == expected.shape);
    CHECK(got.data == expected.data);
  }
  CHECK(file.read_all().size() == tensors.size());
  CHECK(file.find("missing") == nullptr);
  CHECK_THROWS_WITH_AS(file.read("missing"), doctest::Contains("no tensor 'missing'"), kda::Error);

  // Serialized bytes equal the file's bytes.
  const std::vector<std::uint8_t> bytes = kda::engine::serialize_safetensors(tensors, metadata);
  std::ifstream again(path, std::ios::binary);
  const std::vector<std::uint8_t> on_disk((std::istreambuf_iterator<char>(again)),
                                          std::istreambuf_iterator<char>());
  CHECK(on_disk == bytes);
}

TEST_CASE("writer refuses bad tensors and leaves the destination untouched") {
  TempDir dir;
  std::mt19937_64 rng(7);
  const std::string path = dir.file("out.safetensors");
  kda::engine::save_safetensors(path, {random_tensor("a", DType::kF32, {4}, rng)});
  const auto before = fs::file_size(path);

  Tensor wrong = random_tensor("b", DType::kF32, {4}, rng);
  wrong.data.pop_back();  // 15 bytes for 4 floats
  CHECK_THROWS_WITH_AS(kda::engine::save_safetensors(path, {wrong}),
                       doctest::Contains("do not match shape"), kda::Error);
  const Tensor x = random_tensor("x", DType::kF32, {1}, rng);
  CHECK_THROWS_AS(kda::engine::save_safetensors(path, {x, x}), kda::Error);  // duplicate name
  Tensor meta = x;
  meta.name = "__metadata__";
  CHECK_THROWS_AS(kda::engine::save_safetensors(path, {meta}), kda::Error);
  CHECK(fs::file_size(path) == before);
  CHECK(SafetensorsFile::open(path).find("a") != nullptr);

  // A directory that does not exist: error, nothing created.
  const std::string nowhere = dir.file("no/such/dir/out.safetensors");
  CHECK_THROWS_AS(kda::engine::save_safetensors(nowhere, {x}), kda::Error);
  CHECK_FALSE(fs::exists(nowhere));
  CHECK(dir.entries() == 1);
}

TEST_CASE("writer: a symbolic link is written through, a path that is not a file refused") {
  TempDir dir;
  std::mt19937_64 rng(8);
  const Tensor x = random_tensor("x", DType::kF32, {3}, rng);
  fs::create_directory(dir.path / "data");
  // A link (relative, through a second link) to a file that does not exist yet, then to it.
  fs::create_symlink("data/real.safetensors", dir.path / "hop");
  fs::create_symlink("hop", dir.path / "out.safetensors");
  for (int round = 0; round < 2; ++round) {
    kda::engine::save_safetensors(dir.file("out.safetensors"), {x});
    CHECK(fs::is_symlink(dir.path / "out.safetensors"));
    CHECK(fs::is_symlink(dir.path / "hop"));
    CHECK(fs::is_regular_file(dir.path / "data" / "real.safetensors"));
    CHECK(SafetensorsFile::open(dir.file("out.safetensors")).find("x") != nullptr);
  }
  CHECK(dir.entries() == 3);  // no temporary file left beside the link or the target
  // A directory, directly or through a link: refused, nothing written.
  fs::create_symlink("data", dir.path / "to-dir");
  for (const std::string& path : {dir.file("data"), dir.file("to-dir")}) {
    CAPTURE(path);
    CHECK_THROWS_WITH_AS(kda::engine::save_safetensors(path, {x}),
                         doctest::Contains("is not a regular file"), kda::Error);
  }
  CHECK(fs::is_directory(dir.path / "data"));
  // A pipe through a /proc link (as /dev/stdout into a pipe is): refused as what it is, not as a
  // path that cannot be created.
  int ends[2];
  REQUIRE(pipe(ends) == 0);
  const std::string through_proc = "/proc/self/fd/" + std::to_string(ends[1]);
  if (fs::exists(through_proc)) {
    const std::string refused = through_proc + ": is not a regular file";
    CHECK_THROWS_WITH_AS(kda::engine::save_safetensors(through_proc, {x}),
                         doctest::Contains(refused.c_str()), kda::Error);
  }
  close(ends[0]);
  close(ends[1]);
  // A loop of links: refused by name.
  fs::create_symlink("loop-b", dir.path / "loop-a");
  fs::create_symlink("loop-a", dir.path / "loop-b");
  CHECK_THROWS_WITH_AS(kda::engine::save_safetensors(dir.file("loop-a"), {x}),
                       doctest::Contains("too many levels"), kda::Error);
}

TEST_CASE("malformed files: empty / truncated / absurd or overlong header length") {
  TempDir dir;
  check_bad(dir, std::string(), {"file is empty"});
  check_bad(dir, std::string("\x10\x00\x00", 3), {"truncated", "3 bytes"});
  check_bad(dir, le64(0), {"header length is 0"});
  check_bad(dir, le64(1ull << 40) + "{}", {"absurd"});
  check_bad(dir, le64(1000) + "{\"a\": 1}", {"runs past the end of the file"});

  // A valid file cut short: the data offsets now run past the end.
  std::mt19937_64 rng(3);
  const std::string good = dir.file("good.safetensors");
  kda::engine::save_safetensors(good, {random_tensor("t", DType::kF32, {64}, rng)});
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  check_bad(dir, bytes.substr(0, bytes.size() - 10), {"tensor 't'", "past the end"});
  check_bad(dir, bytes.substr(0, 20), {"runs past the end of the file"});
  CHECK(fs::is_directory(dir.path));
  CHECK_THROWS_WITH_AS(SafetensorsFile::open(dir.path.string()), doctest::Contains("directory"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(SafetensorsFile::open(dir.file("missing.safetensors")),
                       doctest::Contains("cannot open"), kda::Error);
  // A FIFO would block the reader forever: refused before it is opened.
  const std::string fifo = dir.file("fifo.safetensors");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(SafetensorsFile::open(fifo),
                       doctest::Contains("is not a regular file (a FIFO, socket or device)"),
                       kda::Error);
}

TEST_CASE("malformed files: header garbage") {
  TempDir dir;
  check_bad(dir, file_with_header("{not json", 0), {"not valid JSON"});
  check_bad(dir, file_with_header("\xff\xfe garbage", 0), {"not valid JSON"});
  check_bad(dir, file_with_header("[1, 2, 3]", 0), {"not a JSON object"});
  check_bad(dir, file_with_header(R"({"t": 5})", 0), {"tensor 't'", "not an object"});
  check_bad(dir, file_with_header(R"({"t": {"shape": [1], "data_offsets": [0, 4]}})", 4),
            {"tensor 't'", "missing dtype"});
  check_bad(dir, file_with_header(R"({"t": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
            {"tensor 't'", "missing shape"});
  check_bad(dir, file_with_header(R"({"t": {"dtype": "F32", "shape": [1]}})", 4),
            {"tensor 't'", "data_offsets"});
  check_bad(dir,
            file_with_header(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4),
            {"data_offsets must be [begin, end]"});
  check_bad(
      dir, file_with_header(R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4),
      {"tensor 't'", "non-negative"});
  check_bad(
      dir,
      file_with_header(R"({"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4),
      {"tensor 't'", "non-negative"});
  check_bad(dir, file_with_header(R"({"__metadata__": {"gate": 3}})", 0),
            {"__metadata__", "'gate'", "not a string"});
  check_bad(dir, file_with_header(R"({"__metadata__": [1]})", 0), {"__metadata__"});
  // A shape entry that is a whole structure is shown cut short, never dumped whole.
  const std::string nested = "[[[[\"" + std::string(200, 'a') + "\"]]]]";
  const std::string shown = "tensor 't': shape entry 1 ([[[[\"" + std::string(35, 'a') +
                            "...) is not a non-negative 64-bit integer";
  check_bad(
      dir,
      file_with_header(
          R"({"t": {"dtype": "F32", "shape": [1, )" + nested + R"(], "data_offsets": [0, 4]}})", 4),
      {shown.c_str()});
}

TEST_CASE("malformed files: a repeated key, deep nesting, a zero byte in the header") {
  TempDir dir;
  // nlohmann would keep the second 't' (here the one whose bytes are NaN).
  check_bad(dir,
            file_with_header(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                             R"( "t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                             8),
            {"header repeats the key 't' in one object"});
  check_bad(dir, file_with_header(R"({"__metadata__": {"a": "1", "a": "2"}})", 0),
            {"header repeats the key 'a' in one object"});
  // Nesting that would only be dumped or walked: refused by the first pass, which builds no tree
  // (a shape nested 100,000 deep crashed the message that showed it).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  check_bad(dir,
            file_with_header(
                R"({"t": {"dtype": "F32", "shape": )" + deep + R"(, "data_offsets": [0, 0]}})", 0),
            {"header nests objects and arrays more than 8 deep"});
  // A zero byte: nlohmann would stop reading there and take "{}".
  check_bad(dir, file_with_header(std::string("{}\0 garbage", 11), 0),
            {"header holds a zero byte at offset 2"});
}

TEST_CASE("dtypes: F16 is read, other safetensors dtypes are listed, refused when read, unknown") {
  TempDir dir;
  const std::string path = dir.file("mixed.safetensors");
  // An FP8 tensor and a packed FP4 one beside an F16 one, as quantized checkpoints hold them.
  write_bytes(path,
              file_with_header(R"({"h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
      "e": {"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [4, 10]},
      "p": {"dtype": "F4", "shape": [4], "data_offsets": [10, 12]},
      "d": {"dtype": "F64", "shape": [1], "data_offsets": [12, 20]}})",
                               20));
  const SafetensorsFile file = SafetensorsFile::open(path);
  REQUIRE(file.tensors().size() == 4);
  const Tensor half = file.read("h");
  CHECK(half.dtype == DType::kF16);
  CHECK(half.data.size() == 4);
  CHECK(file.find("h")->dtype_text == "F16");
  REQUIRE(file.find("e") != nullptr);
  CHECK(file.find("e")->dtype == DType::kNone);
  CHECK(file.find("e")->dtype_text == "F8_E4M3");
  for (const char* name : {"e", "p", "d"}) {
    CAPTURE(name);
    const std::string expected = path + ": tensor '" + name + "' has dtype " +
                                 file.find(name)->dtype_text + ", which this reader does not read";
    CHECK_THROWS_WITH_AS(file.read(name), doctest::Contains(expected.c_str()), kda::Error);
  }
  // Their byte counts are still checked where an element is a whole number of bytes.
  check_bad(
      dir,
      file_with_header(R"({"e": {"dtype": "F8_E5M2", "shape": [3], "data_offsets": [0, 2]}})", 2),
      {"tensor 'e'", "shape [3] of F8_E5M2 needs 3 bytes but data_offsets hold 2"});
  check_bad(dir,
            file_with_header(R"({"h": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}})", 1),
            {"tensor 'h'", "unknown dtype 'Q4'"});
}

TEST_CASE("malformed files: data offsets past the end / reversed / overlapping / shape mismatch") {
  TempDir dir;
  check_bad(
      dir,
      file_with_header(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12),
      {"tensor 't'", "run past the end of the data section (12 bytes"});
  check_bad(
      dir, file_with_header(R"({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 12),
      {"tensor 't'", "reversed"});
  check_bad(dir,
            file_with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                             R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                             12),
            {"tensor 'b'", "overlaps tensor 'a'"});
  // An empty tensor between two overlapping ones does not hide the overlap.
  check_bad(dir,
            file_with_header(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                             R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},)"
                             R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                             16),
            {"overlaps"});
  check_bad(
      dir,
      file_with_header(R"({"t": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 10),
      {"tensor 't'", "shape [2, 3] of BF16 needs 12 bytes but data_offsets hold 10"});
  // More bytes than the shape needs is as wrong as fewer: the header does not describe the data.
  check_bad(
      dir,
      file_with_header(R"({"t": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 14]}})", 14),
      {"tensor 't'", "shape [2, 3] of BF16 needs 12 bytes but data_offsets hold 14"});

  const std::string path = dir.file("overflow.safetensors");
  write_bytes(
      path,
      file_with_header(
          R"({"t": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 4]}})",
          4));
  kda::StatusCode code = kda::StatusCode::kOk;
  const std::string message = open_error(path, &code);
  CHECK(message.find("overflows 64 bits") != std::string::npos);
  CHECK(code == kda::StatusCode::kOverflow);

  // Gaps are tolerated, and tensors may be listed out of data order.
  write_bytes(path,
              file_with_header(R"({"b": {"dtype": "I32", "shape": [1], "data_offsets": [8, 12]},)"
                               R"( "a": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}})",
                               12));
  const SafetensorsFile file = SafetensorsFile::open(path);
  REQUIRE(file.tensors().size() == 2);
  CHECK(file.tensors()[0].name == "a");
  CHECK(file.read("b").data == std::vector<std::uint8_t>{0x5a, 0x5a, 0x5a, 0x5a});
}
