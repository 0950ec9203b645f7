// kda/planner/memory_plan.cpp — validation, the two layout modes, and the table / JSON reports.
//
// Layout in kReuse follows the idea of TF Lite's arena planner and ggml-alloc: buffers are placed
// largest first; each goes into the smallest free gap (between buffers already placed whose
// lifetimes overlap its own) that holds it, or after the last of them when no gap does.
// Persistent buffers are placed first at the bottom of the arena and overlap every lifetime, so
// nothing is ever placed on top of them.
#include "kda/planner/memory_plan.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <unordered_map>

namespace kda::planner {

namespace {

constexpr std::uint64_t kMaxU64 = std::numeric_limits<std::uint64_t>::max();

bool is_power_of_two(std::uint64_t value) { return value != 0 && (value & (value - 1)) == 0; }

// Rounds value up to a multiple of alignment (a power of two); false when that overflows.
bool checked_align_up(std::uint64_t value, std::uint64_t alignment, std::uint64_t* out) {
  const std::uint64_t mask = alignment - 1;
  if (value > kMaxU64 - mask) return false;
  *out = (value + mask) & ~mask;
  return true;
}

bool checked_add(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  if (a > kMaxU64 - b) return false;
  *out = a + b;
  return true;
}

// A kind the planner knows (a request's kind may be any int cast to BufferKind).
bool known_kind(BufferKind kind) {
  return kind == BufferKind::kWorkspace || kind == BufferKind::kState ||
         kind == BufferKind::kScratch || kind == BufferKind::kParameter;
}

// How a request is called in error messages: by name, or by position when it has none.
std::string describe(const BufferRequest& request, std::size_t index) {
  if (request.name.empty()) return "buffer request #" + std::to_string(index) + " (unnamed)";
  return "buffer '" + request.name + "'";
}

// A planning error: its code and a message naming the buffer. status kOk: no error.
struct Failure {
  PlanStatus status = PlanStatus::kOk;
  std::string message;
  bool failed() const noexcept { return status != PlanStatus::kOk; }
};

Failure failure(PlanStatus status, std::string message) { return {status, std::move(message)}; }

bool lifetimes_overlap(const BufferRequest& a, const BufferRequest& b) {
  if (a.persistent || b.persistent) return true;
  return a.first_step <= b.last_step && b.first_step <= a.last_step;
}

// Checks everything that does not depend on the layout.
Failure validate(const std::vector<BufferRequest>& requests, std::uint64_t plan_alignment) {
  if (!is_power_of_two(plan_alignment)) {
    return failure(PlanStatus::kBadAlignment,
                   "plan alignment " + std::to_string(plan_alignment) + " is not a power of two");
  }
  if (requests.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    return failure(PlanStatus::kOverflow, std::to_string(requests.size()) +
                                              " buffer requests: more than a BufferHandle holds");
  }
  std::unordered_map<std::string, std::size_t> first_index_by_name;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const BufferRequest& request = requests[i];
    const std::string who = describe(request, i);
    if (request.name.empty()) return failure(PlanStatus::kEmptyName, who + ": name is empty");
    const auto inserted = first_index_by_name.emplace(request.name, i);
    if (!inserted.second) {
      return failure(PlanStatus::kDuplicateName, who + " (request #" + std::to_string(i) +
                                                     "): duplicate name, first used by request #" +
                                                     std::to_string(inserted.first->second));
    }
    if (request.bytes == 0) return failure(PlanStatus::kZeroBytes, who + ": bytes must be > 0");
    if (!known_kind(request.kind)) {
      return failure(PlanStatus::kBadField, who + ": kind " +
                                                std::to_string(static_cast<int>(request.kind)) +
                                                " is not a BufferKind");
    }
    if (request.layer < -1) {
      return failure(PlanStatus::kBadField,
                     who + ": layer " + std::to_string(request.layer) + " is below -1 (-1: none)");
    }
    if (request.alignment != 0 && !is_power_of_two(request.alignment)) {
      return failure(
          PlanStatus::kBadAlignment,
          who + ": alignment " + std::to_string(request.alignment) + " is not a power of two");
    }
    if (!request.persistent) {
      if (request.first_step < 0 || request.last_step < 0) {
        return failure(PlanStatus::kBadLifetime,
                       who + ": lifetime [" + std::to_string(request.first_step) + ", " +
                           std::to_string(request.last_step) + "] has a negative step");
      }
      if (request.first_step > request.last_step) {
        return failure(PlanStatus::kBadLifetime,
                       who + ": lifetime first_step " + std::to_string(request.first_step) +
                           " is after last_step " + std::to_string(request.last_step));
      }
    }
    const std::uint64_t alignment = std::max(plan_alignment, request.alignment);
    std::uint64_t aligned_bytes = 0;
    if (!checked_align_up(request.bytes, alignment, &aligned_bytes)) {
      return failure(PlanStatus::kOverflow, who + ": bytes " + std::to_string(request.bytes) +
                                                " rounded up to alignment " +
                                                std::to_string(alignment) + " overflows 64 bits");
    }
  }
  return {};
}

// A buffer placed in the arena: [offset, offset + bytes).
struct Placement {
  std::size_t index;  // into the requests
  std::uint64_t offset;
  std::uint64_t end;
};

// Places `bytes` at the first offset >= cursor aligned to `alignment`; false on overflow.
// The end must also round up to the alignment (hence to the plan's, which divides it) without
// overflow, so that the arena total computed from the high-water mark always fits.
bool place_after(std::uint64_t cursor, std::uint64_t bytes, std::uint64_t alignment,
                 std::uint64_t* offset, std::uint64_t* end) {
  std::uint64_t aligned_end = 0;
  return checked_align_up(cursor, alignment, offset) && checked_add(*offset, bytes, end) &&
         checked_align_up(*end, alignment, &aligned_end);
}

Failure overflow_error(const BufferRequest& request, std::size_t index) {
  return failure(PlanStatus::kOverflow,
                 describe(request, index) + ": arena offset overflows 64 bits (bytes " +
                     std::to_string(request.bytes) + " placed after the buffers before it)");
}

// kSum: each buffer after the previous one, in request order.
Failure layout_sum(const std::vector<BufferRequest>& requests, std::uint64_t plan_alignment,
                   std::vector<std::uint64_t>* offsets, std::uint64_t* high_water) {
  std::uint64_t cursor = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const std::uint64_t alignment = std::max(plan_alignment, requests[i].alignment);
    std::uint64_t end = 0;
    if (!place_after(cursor, requests[i].bytes, alignment, &(*offsets)[i], &end)) {
      return overflow_error(requests[i], i);
    }
    cursor = end;
  }
  *high_water = cursor;
  return {};
}

// kReuse: persistent buffers stacked first, then the rest by best fit, largest first.
Failure layout_reuse(const std::vector<BufferRequest>& requests, std::uint64_t plan_alignment,
                     std::vector<std::uint64_t>* offsets, std::uint64_t* high_water) {
  std::vector<Placement> placed;  // kept sorted by offset (ties by placement order)
  placed.reserve(requests.size());
  std::uint64_t arena_end = 0;

  auto insert_sorted = [&placed](Placement placement) {
    const auto below = [](std::uint64_t offset, const Placement& p) { return offset < p.offset; };
    const auto position = std::upper_bound(placed.begin(), placed.end(), placement.offset, below);
    placed.insert(position, placement);
  };

  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!requests[i].persistent) continue;
    const std::uint64_t alignment = std::max(plan_alignment, requests[i].alignment);
    std::uint64_t offset = 0, end = 0;
    if (!place_after(arena_end, requests[i].bytes, alignment, &offset, &end)) {
      return overflow_error(requests[i], i);
    }
    (*offsets)[i] = offset;
    arena_end = end;
    insert_sorted({i, offset, end});
  }

  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!requests[i].persistent) order.push_back(i);
  }
  // Largest first: big buffers claim space early and small ones fill the gaps they leave.
  std::stable_sort(order.begin(), order.end(), [&requests](std::size_t a, std::size_t b) {
    return requests[a].bytes > requests[b].bytes;
  });

  for (const std::size_t i : order) {
    const BufferRequest& request = requests[i];
    const std::uint64_t alignment = std::max(plan_alignment, request.alignment);
    bool found_gap = false;
    std::uint64_t best_offset = 0;
    std::uint64_t best_gap_size = 0;
    std::uint64_t cursor = 0;  // end of the live memory seen so far, scanning upward
    for (const Placement& other : placed) {
      if (!lifetimes_overlap(request, requests[other.index])) continue;
      if (other.offset > cursor) {
        std::uint64_t offset = 0, end = 0;
        // Overflow here only means the candidate cannot fit below `other`.
        if (place_after(cursor, request.bytes, alignment, &offset, &end) && end <= other.offset) {
          const std::uint64_t gap_size = other.offset - cursor;
          if (!found_gap || gap_size < best_gap_size) {
            found_gap = true;
            best_gap_size = gap_size;
            best_offset = offset;
          }
        }
      }
      cursor = std::max(cursor, other.end);
    }
    std::uint64_t offset = best_offset;
    std::uint64_t end = 0;
    if (found_gap) {
      end = offset + request.bytes;  // fits below an existing buffer: cannot overflow
    } else if (!place_after(cursor, request.bytes, alignment, &offset, &end)) {
      return overflow_error(request, i);
    }
    (*offsets)[i] = offset;
    arena_end = std::max(arena_end, end);
    insert_sorted({i, offset, end});
  }
  *high_water = arena_end;
  return {};
}

void append_json_string(std::string* out, const std::string& text) {
  static const char* const kHex = "0123456789abcdef";
  out->push_back('"');
  const std::size_t size = text.size();
  for (std::size_t i = 0; i < size;) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    switch (c) {
      case '"':
        *out += "\\\"";
        ++i;
        continue;
      case '\\':
        *out += "\\\\";
        ++i;
        continue;
      case '\b':
        *out += "\\b";
        ++i;
        continue;
      case '\f':
        *out += "\\f";
        ++i;
        continue;
      case '\n':
        *out += "\\n";
        ++i;
        continue;
      case '\r':
        *out += "\\r";
        ++i;
        continue;
      case '\t':
        *out += "\\t";
        ++i;
        continue;
      default:
        break;
    }
    if (c < 0x20) {
      *out += "\\u00";
      out->push_back(kHex[c >> 4]);
      out->push_back(kHex[c & 0xF]);
      ++i;
      continue;
    }
    if (c < 0x80) {
      out->push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    // Multi-byte UTF-8 passes through when well formed; a stray byte becomes U+FFFD so the
    // document stays valid JSON whatever bytes a name holds.
    std::size_t length = 0;
    std::uint32_t code_point = 0;
    if ((c & 0xE0) == 0xC0) {
      length = 2;
      code_point = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      length = 3;
      code_point = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      length = 4;
      code_point = c & 0x07;
    }
    bool well_formed = length != 0 && i + length <= size;
    for (std::size_t k = 1; well_formed && k < length; ++k) {
      const unsigned char continuation = static_cast<unsigned char>(text[i + k]);
      if ((continuation & 0xC0) != 0x80) {
        well_formed = false;
      } else {
        code_point = (code_point << 6) | (continuation & 0x3F);
      }
    }
    if (well_formed) {
      static const std::uint32_t kMinByLength[5] = {0, 0, 0x80, 0x800, 0x10000};
      well_formed = code_point >= kMinByLength[length] && code_point <= 0x10FFFF &&
                    !(code_point >= 0xD800 && code_point <= 0xDFFF);
    }
    if (well_formed) {
      out->append(text, i, length);
      i += length;
    } else {
      *out += "\\ufffd";
      ++i;
    }
  }
  out->push_back('"');
}

std::string lifetime_text(const PlanEntry& entry, const TableFormat& format) {
  if (entry.persistent) return "persistent";
  if (format.steps_text) return format.steps_text(entry.first_step, entry.last_step);
  return "[" + std::to_string(entry.first_step) + ", " + std::to_string(entry.last_step) + "]";
}

std::string pad_right(const std::string& text, std::size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

std::string pad_left(const std::string& text, std::size_t width) {
  return text.size() >= width ? text : std::string(width - text.size(), ' ') + text;
}

}  // namespace

const char* to_string(BufferKind kind) noexcept {
  switch (kind) {
    case BufferKind::kWorkspace:
      return "workspace";
    case BufferKind::kState:
      return "state";
    case BufferKind::kScratch:
      return "scratch";
    case BufferKind::kParameter:
      return "parameter";
  }
  return "unknown";
}

const char* to_string(PlanStatus status) noexcept {
  switch (status) {
    case PlanStatus::kOk:
      return "ok";
    case PlanStatus::kBadAlignment:
      return "bad alignment";
    case PlanStatus::kEmptyName:
      return "empty name";
    case PlanStatus::kDuplicateName:
      return "duplicate name";
    case PlanStatus::kZeroBytes:
      return "zero bytes";
    case PlanStatus::kBadLifetime:
      return "bad lifetime";
    case PlanStatus::kOverflow:
      return "overflow";
    case PlanStatus::kBadField:
      return "bad field";
    case PlanStatus::kBadMode:
      return "bad mode";
  }
  return "unknown";
}

const char* to_string(PlanMode mode) noexcept {
  switch (mode) {
    case PlanMode::kSum:
      return "sum";
    case PlanMode::kReuse:
      return "reuse";
  }
  return "unknown";
}

bool parse_plan_mode(const std::string& text, PlanMode* mode) noexcept {
  if (mode == nullptr) return false;
  if (text == "sum") {
    *mode = PlanMode::kSum;
    return true;
  }
  if (text == "reuse") {
    *mode = PlanMode::kReuse;
    return true;
  }
  return false;
}

std::string format_bytes(std::uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  std::size_t unit = 0;
  // Move up while the value would print as 1024.0 or more in this unit.
  while (value >= 1023.95 && unit + 1 < sizeof(kUnits) / sizeof(kUnits[0])) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f %s", value, kUnits[unit]);
  return text;
}

const PlanEntry* MemoryPlan::entry(BufferHandle handle) const noexcept {
  if (!handle.valid() || static_cast<std::size_t>(handle.index) >= entries.size()) return nullptr;
  return &entries[static_cast<std::size_t>(handle.index)];
}

const PlanEntry* MemoryPlan::find(const std::string& name) const noexcept {
  for (const PlanEntry& entry : entries) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

namespace {
// A name as one cell of the table: control characters as \xNN, so that a row stays one line.
std::string table_cell(const std::string& name) {
  std::string cell;
  for (const char ch : name) {
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte == 0x7F) {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02X", byte);
      cell += escaped;
    } else {
      cell += ch;
    }
  }
  return cell;
}
}  // namespace

std::string MemoryPlan::to_table(const TableFormat& format) const {
  struct Row {
    std::string name, kind, layer, offset, bytes, lifetime;
  };
  std::vector<Row> rows;
  rows.push_back({"name", "kind", "layer", "offset", "bytes", format.lifetime_heading});
  for (const PlanEntry& entry : entries) {
    rows.push_back({table_cell(entry.name), to_string(entry.kind),
                    entry.layer < 0     ? std::string("-")
                    : format.layer_text ? format.layer_text(entry.layer)
                                        : std::to_string(entry.layer),
                    std::to_string(entry.offset),
                    std::to_string(entry.bytes) + " (" + format_bytes(entry.bytes) + ")",
                    lifetime_text(entry, format)});
  }
  std::size_t widths[6] = {0, 0, 0, 0, 0, 0};
  for (const Row& row : rows) {
    widths[0] = std::max(widths[0], row.name.size());
    widths[1] = std::max(widths[1], row.kind.size());
    widths[2] = std::max(widths[2], row.layer.size());
    widths[3] = std::max(widths[3], row.offset.size());
    widths[4] = std::max(widths[4], row.bytes.size());
    widths[5] = std::max(widths[5], row.lifetime.size());
  }
  std::string out;
  for (const Row& row : rows) {
    // Names and words left-aligned, numbers right-aligned so digits line up.
    // A custom layer text is words ("4 (KDA index 2)"): left-aligned too.
    const std::string layer =
        format.layer_text ? pad_right(row.layer, widths[2]) : pad_left(row.layer, widths[2]);
    std::string line = pad_right(row.name, widths[0]) + "  " + pad_right(row.kind, widths[1]) +
                       "  " + layer + "  " + pad_left(row.offset, widths[3]) + "  " +
                       pad_left(row.bytes, widths[4]) + "  " + row.lifetime;
    out += line + "\n";
  }
  out += "mode: " + std::string(to_string(mode)) + "  alignment: " + std::to_string(alignment) +
         "  buffers: " + std::to_string(entries.size()) +
         "  arena_bytes: " + std::to_string(arena_bytes) + " (" + format_bytes(arena_bytes) + ")\n";
  return out;
}

std::string MemoryPlan::to_json() const {
  std::string out = "{\"mode\": ";
  append_json_string(&out, to_string(mode));
  out += ", \"alignment\": " + std::to_string(alignment);
  out += ", \"arena_bytes\": " + std::to_string(arena_bytes);
  out += ", \"buffers\": [";
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const PlanEntry& entry = entries[i];
    if (i != 0) out += ", ";
    out += "{\"name\": ";
    append_json_string(&out, entry.name);
    out += ", \"kind\": ";
    append_json_string(&out, to_string(entry.kind));
    out += ", \"layer\": " + std::to_string(entry.layer);
    out += ", \"offset\": " + std::to_string(entry.offset);
    out += ", \"bytes\": " + std::to_string(entry.bytes);
    out += ", \"persistent\": ";
    out += entry.persistent ? "true" : "false";
    out += ", \"first_step\": " + std::to_string(entry.first_step);
    out += ", \"last_step\": " + std::to_string(entry.last_step);
    out += "}";
  }
  out += "]}";
  return out;
}

PlanResult MemoryPlanner::plan(PlanMode mode) const {
  PlanResult result;
  result.plan.mode = mode;
  result.plan.alignment = alignment_;
  auto fail = [&result](Failure f) {
    result.status = f.status;
    result.error = std::move(f.message);
    return std::move(result);
  };
  if (mode != PlanMode::kSum && mode != PlanMode::kReuse) {
    return fail(failure(PlanStatus::kBadMode,
                        "unknown plan mode " + std::to_string(static_cast<int>(mode))));
  }
  if (Failure f = validate(requests_, alignment_); f.failed()) return fail(std::move(f));

  std::vector<std::uint64_t> offsets(requests_.size(), 0);
  std::uint64_t high_water = 0;
  Failure sum_failure = layout_sum(requests_, alignment_, &offsets, &high_water);
  if (mode == PlanMode::kReuse) {
    // Best fit is greedy: with mixed per-buffer alignments its padding can exceed the sum layout's
    // by a little. The sum layout is also a valid reuse layout, so keep whichever is smaller.
    // (A sum layout that overflows does not stop reuse, which may need far less; a best-fit layout
    // that overflows, its largest buffers placed first, does not stop the sum layout.)
    std::vector<std::uint64_t> reuse_offsets(requests_.size(), 0);
    std::uint64_t reuse_high_water = 0;
    Failure reuse_failure = layout_reuse(requests_, alignment_, &reuse_offsets, &reuse_high_water);
    if (reuse_failure.failed() && sum_failure.failed()) return fail(std::move(reuse_failure));
    bool take_reuse = !reuse_failure.failed();
    if (take_reuse && !sum_failure.failed()) {
      std::uint64_t sum_total = 0, reuse_total = 0;
      checked_align_up(high_water, alignment_, &sum_total);  // place_after made these safe
      checked_align_up(reuse_high_water, alignment_, &reuse_total);
      take_reuse = reuse_total <= sum_total;
    }
    if (take_reuse) {
      sum_failure = {};
      offsets.swap(reuse_offsets);
      high_water = reuse_high_water;
    }
  }
  if (sum_failure.failed()) return fail(std::move(sum_failure));
  // Cannot overflow: place_after checked that every buffer's end rounds up within 64 bits.
  checked_align_up(high_water, alignment_, &result.plan.arena_bytes);

  result.plan.entries.reserve(requests_.size());
  for (std::size_t i = 0; i < requests_.size(); ++i) {
    const BufferRequest& request = requests_[i];
    PlanEntry entry;
    entry.name = request.name;
    entry.kind = request.kind;
    entry.layer = request.layer;
    entry.offset = offsets[i];
    entry.bytes = request.bytes;
    entry.persistent = request.persistent;
    entry.first_step = request.first_step;
    entry.last_step = request.last_step;
    result.plan.entries.push_back(std::move(entry));
  }
  result.ok = true;
  return result;
}

}  // namespace kda::planner
