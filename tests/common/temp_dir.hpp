// temp_dir.hpp — a fresh temporary directory per test, removed with everything in it at scope exit.
#pragma once

#include <cstddef>
#include <filesystem>
#include <iterator>
#include <random>
#include <string>
#include <system_error>

namespace kda::test {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix = "kda-test-") {
    std::random_device random;
    path = std::filesystem::temp_directory_path() /
           (prefix + std::to_string(random()) + "-" + std::to_string(random()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
  // Number of directory entries (a failed write must leave no file behind).
  std::size_t entries() const {
    return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(path),
                                                  std::filesystem::directory_iterator()));
  }
};

}  // namespace kda::test
