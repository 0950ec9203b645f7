// kda/planner/memory_plan.hpp — a static memory planner: buffers with lifetimes laid out in one arena.
//
// Pure C++: knows nothing of CUDA or of KDA. Layers declare BufferRequests (name, kind, layer, bytes,
// alignment, lifetime); plan() returns a MemoryPlan of offsets inside one arena.
//   - PlanMode::kSum (default): every buffer gets its own region; the arena is their aligned sum.
//   - PlanMode::kReuse: buffers whose lifetimes [first_step, last_step] do not overlap may share
//     memory; offsets by best fit (TF Lite arena planner / ggml-alloc style); persistent buffers never
//     share. The arena is the high-water mark (never larger than kSum's).
// Errors (zero sizes, overflow, bad alignment or lifetimes, duplicate names) come back as a
// PlanResult naming the buffer — the planner never throws and never aborts.
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

struct BufferRequest {
  std::string name;            // unique within a plan
  BufferKind kind = BufferKind::kScratch;
  int layer = -1;              // owning layer (the engine: model layer, 1-based), -1 for none
  std::uint64_t bytes = 0;     // must be > 0
  std::uint64_t alignment = 0; // 0: the plan's alignment; otherwise a power of two
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
  std::vector<PlanEntry> entries; // in request order

  // nullptr when absent.
  const PlanEntry* find(const std::string& name) const noexcept;
  // Human-readable table: one line per buffer (name, kind, layer, offset, bytes, lifetime), then
  // mode, alignment, buffer count and arena_bytes.
  std::string to_table(const TableFormat& format = {}) const;
  // {"mode", "alignment", "arena_bytes", "buffers": [{"name","kind","layer","offset","bytes",...}]}
  std::string to_json() const;
};

struct PlanResult {
  bool ok = false;
  std::string error;  // names the offending buffer when !ok
  MemoryPlan plan;
};

class MemoryPlanner {
 public:
  explicit MemoryPlanner(std::uint64_t alignment = kDefaultAlignment) : alignment_(alignment) {}
  void add(BufferRequest request) { requests_.push_back(std::move(request)); }
  const std::vector<BufferRequest>& requests() const noexcept { return requests_; }
  PlanResult plan(PlanMode mode) const;

 private:
  std::uint64_t alignment_;
  std::vector<BufferRequest> requests_;
};

}  // namespace kda::planner
