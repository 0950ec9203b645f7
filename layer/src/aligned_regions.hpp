// layer/src/aligned_regions.hpp — internal: regions laid one after another from offset 0, each at
// an aligned offset, sizes and offsets checked against 64-bit overflow. The layer's layouts
// (both backends' workspaces and weight images) are computed with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kda/detail/checked_math.hpp"
#include "kda/error.hpp"

namespace kda::layer::detail {

class AlignedRegions {
 public:
  // `what` names the size in the kOverflow message ("<what> overflows 64 bits"); `alignment` is a
  // power of two.
  AlignedRegions(const char* what, std::size_t alignment) : what_(what), alignment_(alignment) {}

  // Bytes of `rows` x `width` elements of `element` bytes each.
  std::uint64_t bytes_of(std::int64_t rows, std::int64_t width, std::uint64_t element) const {
    std::uint64_t n = 0, bytes = 0;
    if (!kda::detail::checked_mul(static_cast<std::uint64_t>(rows),
                                  static_cast<std::uint64_t>(width), &n) ||
        !kda::detail::checked_mul(n, element, &bytes)) {
      overflow();
    }
    return bytes;
  }
  // The offset of a new region of `bytes`.
  std::size_t take(std::uint64_t bytes) {
    if (bytes > kLimit) overflow();
    const std::uint64_t at = offset_;
    offset_ = kda::detail::align_up<std::uint64_t>(offset_ + bytes, alignment_);
    if (offset_ > kLimit) overflow();
    return static_cast<std::size_t>(at);
  }
  // Where the next region would start: the bytes of every region so far.
  std::size_t end() const noexcept { return static_cast<std::size_t>(offset_); }

 private:
  static constexpr std::uint64_t kLimit = std::uint64_t{1} << 62;
  [[noreturn]] void overflow() const {
    throw Error(StatusCode::kOverflow, std::string(what_) + " overflows 64 bits");
  }
  const char* what_;
  std::uint64_t alignment_;
  std::uint64_t offset_ = 0;
};

}  // namespace kda::layer::detail
