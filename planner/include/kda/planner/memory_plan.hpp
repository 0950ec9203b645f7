// kda/planner/memory_plan.hpp — a static memory planner: buffers with lifetimes laid out in one
// arena.
//
// Pure C++: knows nothing of CUDA or of KDA. Layers declare BufferRequests (name, kind, layer,
// bytes, alignment, lifetime); add() returns a BufferHandle, and plan() returns a MemoryPlan of
// offsets inside one arena that the handles resolve against (no look-up by name after planning).
//   - PlanMode::kSum (default): every buffer gets its own region; the arena is their aligned sum.
//   - PlanMode::kReuse: buffers whose lifetimes [first_step, last_step] do not overlap may share
//     memory; offsets by best fit (TF Lite arena planner / ggml-alloc style); persistent buffers
//     never share. The arena is the high-water mark (never larger than kSum's).
// Errors (zero sizes, overflow, bad alignment or lifetimes, duplicate names) come back as a
// PlanResult with a PlanStatus code and a message naming the buffer — the planner never throws and
// never aborts.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kda::planner {

enum class BufferKind : int {
  kWorkspace = 0,  // a kernel's scratch for one forward (from workspace_size())
  kState = 1,      // recurrent state slots: persistent across forwards
  kScratch = 2,    // engine-side temporaries for one forward (e.g. synthetic inputs, outputs)
  kParameter = 3,  // layer parameters (A_log, dt_bias) resident in the arena: persistent
};
const char* to_string(BufferKind kind) noexcept;

enum class PlanMode : int { kSum = 0, kReuse = 1 };
const char* to_string(PlanMode mode) noexcept;
// Parses "sum" / "reuse"; returns false on anything else.
bool parse_plan_mode(const std::string& text, PlanMode* mode) noexcept;

// Human-readable size in binary units: "512 B", "1.5 KiB", "2.0 MiB", "27.3 GiB".
std::string format_bytes(std::uint64_t bytes);

inline constexpr std::uint64_t kDefaultAlignment = 256;

// What plan() found wrong, one code per kind of mistake (the message says which buffer).
enum class PlanStatus : int {
  kOk = 0,
  kBadAlignment = 1,   // the plan's or a request's alignment is not a power of two
  kEmptyName = 2,      // a request has no name
  kDuplicateName = 3,  // two requests share a name
  kZeroBytes = 4,      // a request asks for 0 bytes
  kBadLifetime = 5,    // negative steps or first_step > last_step
  kOverflow = 6,       // sizes or offsets do not fit in 64 bits
  kBadMode = 7,        // not a PlanMode
  kBadField = 8,       // a kind not a BufferKind, a layer below -1
};
const char* to_string(PlanStatus status) noexcept;

// A request's position in its planner, as add() returned it; resolves against the plan.
struct BufferHandle {
  std::int32_t index = -1;
  bool valid() const noexcept { return index >= 0; }
};

struct BufferRequest {
  std::string name;  // unique within a plan
  BufferKind kind = BufferKind::kScratch;
  int layer = -1;               // owning layer (the engine: model layer, 1-based), -1 for none
  std::uint64_t bytes = 0;      // must be > 0
  std::uint64_t alignment = 0;  // 0: the plan's alignment; otherwise a power of two
  // Lifetime in execution steps (e.g. the index of the layer that runs). persistent = live always.
  bool persistent = false;
  int first_step = 0;
  int last_step = 0;
};

struct PlanEntry {
  std::string name;
  BufferKind kind = BufferKind::kScratch;
  int layer = -1;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  bool persistent = false;
  int first_step = 0;
  int last_step = 0;
};

// How MemoryPlan::to_table() shows layers and lifetimes; unset members print the raw numbers
// (the layer, "-" for none; "[first_step, last_step]"; "persistent").
struct TableFormat {
  std::function<std::string(int layer)> layer_text;  // called for layer >= 0 only
  std::function<std::string(int first_step, int last_step)> steps_text;  // non-persistent only
  std::string lifetime_heading = "lifetime";
};

struct MemoryPlan {
  PlanMode mode = PlanMode::kSum;
  std::uint64_t alignment = kDefaultAlignment;
  // The size of the one arena every buffer is placed in (a multiple of alignment). The same name
  // everywhere: Engine::arena_bytes(), kda_engine_arena_bytes(), the plan's JSON and table.
  std::uint64_t arena_bytes = 0;
  std::vector<PlanEntry> entries;  // in request order

  // The entry a planner handle stands for; nullptr for an invalid handle or one of another planner
  // (index out of range).
  const PlanEntry* entry(BufferHandle handle) const noexcept;
  // By name, for reports and tests (engine code resolves handles); nullptr when absent.
  const PlanEntry* find(const std::string& name) const noexcept;
  // Human-readable table: one line per buffer (name, kind, layer, offset, bytes, lifetime; a
  // name's control characters as \xNN), then mode, alignment, buffer count and arena_bytes.
  std::string to_table(const TableFormat& format = {}) const;
  // {"mode", "alignment", "arena_bytes", "buffers": [{"name","kind","layer","offset","bytes",...}]}
  std::string to_json() const;
};

struct PlanResult {
  bool ok = false;  // status == PlanStatus::kOk
  PlanStatus status = PlanStatus::kOk;
  std::string error;  // names the offending buffer when !ok
  MemoryPlan plan;
};

class MemoryPlanner {
 public:
  explicit MemoryPlanner(std::uint64_t alignment = kDefaultAlignment) : alignment_(alignment) {}
  // Queues a request; its handle resolves against the plan (MemoryPlan::entry). Nothing is checked
  // here: plan() reports every problem.
  BufferHandle add(BufferRequest request) {
    requests_.push_back(std::move(request));
    return BufferHandle{static_cast<std::int32_t>(requests_.size() - 1)};
  }
  const std::vector<BufferRequest>& requests() const noexcept { return requests_; }
  PlanResult plan(PlanMode mode) const;

 private:
  std::uint64_t alignment_;
  std::vector<BufferRequest> requests_;
};

}  // namespace kda::planner
