// engine/capi/src/c_api.cpp — the C API (kda/kda_engine.h) over kda::engine::Engine.
//
// Every entry point is noexcept and funnels its body through guarded(), which turns any exception
// into a status and a message. The per-handle message lives in a fixed char array, so recording an
// error never allocates (and so cannot itself fail while reporting out of memory).
#include "kda/kda_engine.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kda/engine/communicator.hpp"
#include "kda/engine/engine.hpp"
#include "kda/engine/model_spec.hpp"
#include "kda/error.hpp"

namespace {

using kda::StatusCode;

static_assert(KDA_OK == static_cast<int>(StatusCode::kOk), "kda_status mirrors kda::StatusCode");
static_assert(KDA_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument), "");
static_assert(KDA_UNSUPPORTED == static_cast<int>(StatusCode::kUnsupported), "");
static_assert(KDA_OVERFLOW == static_cast<int>(StatusCode::kOverflow), "");
static_assert(KDA_WORKSPACE_TOO_SMALL == static_cast<int>(StatusCode::kWorkspaceTooSmall), "");
static_assert(KDA_BACKEND_UNAVAILABLE == static_cast<int>(StatusCode::kBackendUnavailable), "");
static_assert(KDA_CUDA_ERROR == static_cast<int>(StatusCode::kCudaError), "");
static_assert(KDA_INTERNAL == static_cast<int>(StatusCode::kInternal), "");
static_assert(KDA_OUT_OF_MEMORY == static_cast<int>(StatusCode::kOutOfMemory), "");
constexpr int kLastStatus = KDA_OUT_OF_MEMORY;
// struct_size tells versions of kda_engine_options apart only if their sizes differ: the version
// before prefill_schedule was 48 bytes on LP64, the one before null_slot 56, the one before the
// runtime overrides (max_tokens .. reserved3) 64, the one before layer_mode and the communicators
// 88.
static_assert(sizeof(kda_state_dtype) == sizeof(int), "kda_state_dtype is int-sized");
static_assert(sizeof(kda_layer_mode) == sizeof(int), "kda_layer_mode is int-sized");
// kda_communicator is matched by its exact struct_size: fields only ever added at its end.
static_assert(sizeof(void*) != 8 || sizeof(kda_communicator) == 48,
              "kda_communicator changed size: add fields at its end");
static_assert(sizeof(void*) != 8 || sizeof(kda_engine_options) == 112,
              "kda_engine_options changed size: keep it apart from earlier versions");
// decode_step took the place of an int `reserved` that callers set to 0 (the default).
static_assert(sizeof(void*) != 8 || offsetof(kda_engine_options, decode_step) == 48,
              "kda_engine_options::decode_step moved");
static_assert(sizeof(kda_decode_step) == sizeof(int), "kda_decode_step is int-sized");

// kda_batch grows at its end; a caller's struct_size says which fields it holds. The first
// version with struct_size is the smallest one read (96 bytes on LP64, up to `reserved`); the
// fold's fields (records_region .. fold_counts) made it 120: keep the size in step with the
// fields, and fields added later at the end.
constexpr std::size_t kBatchFirstSize = offsetof(kda_batch, reserved) + sizeof(int);
static_assert(sizeof(void*) != 8 || kBatchFirstSize == 96, "the first kda_batch version moved");
static_assert(sizeof(void*) != 8 || sizeof(kda_batch) == 120,
              "kda_batch changed size: add fields at its end");

constexpr std::size_t kMessageCapacity = 1024;  // bytes, NUL included (documented in kda_engine.h)

kda_status to_c(StatusCode code) noexcept {
  const int value = static_cast<int>(code);
  if (value < KDA_OK || value > kLastStatus) return KDA_INTERNAL;
  return static_cast<kda_status>(value);
}

// Copies `prefix` + `message` into dst[size], truncated, NUL-terminated when size > 0; a
// `function` (may be null) goes first, with ": ", unless the message already begins with it (the
// C API's own argument errors name their function).
void write_message(char* dst, std::size_t size, const char* prefix, const char* message,
                   const char* function = nullptr) noexcept {
  if (dst == nullptr || size == 0) return;
  if (function != nullptr && message != nullptr && message[0] != '\0') {
    const std::size_t length = std::strlen(function);
    if (std::strncmp(message, function, length) == 0 && message[length] == ':') function = nullptr;
  } else {
    function = nullptr;
  }
  std::size_t used = 0;
  for (const char* part : {function, function != nullptr ? ": " : nullptr, prefix, message}) {
    if (part == nullptr) continue;
    const std::size_t n = std::min(std::strlen(part), size - 1 - used);
    std::memcpy(dst + used, part, n);
    used += n;
  }
  dst[used] = '\0';
}

// The C API's own argument errors (null pointers, counts) are thrown as kda::Error like the
// engine's, so one catch path reports everything.
[[noreturn]] void invalid(const char* function, const std::string& what) {
  throw kda::Error(StatusCode::kInvalidArgument, std::string(function) + ": " + what);
}

void require(const void* pointer, const char* function, const char* name) {
  if (pointer == nullptr) invalid(function, std::string(name) + " is null");
}

// Runs `body`; on an exception writes its message to dst[size] (after `function`, where given and
// not already there) and returns its status.
template <typename Body>
kda_status guarded(char* dst, std::size_t size, Body&& body,
                   const char* function = nullptr) noexcept {
  try {
    body();
    write_message(dst, size, nullptr, "");
    return KDA_OK;
  } catch (const kda::Error& e) {
    write_message(dst, size, nullptr, e.what(), function);
    return to_c(e.code());
  } catch (const std::bad_alloc&) {
    write_message(dst, size, nullptr, "out of host memory (std::bad_alloc)", function);
    return KDA_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    write_message(dst, size, "internal error: ", e.what(), function);
    return KDA_INTERNAL;
  } catch (...) {
    write_message(dst, size, nullptr, "internal error: unknown exception", function);
    return KDA_INTERNAL;
  }
}

// A C enum field as the int it holds. A C caller may store any int there, and in C++ a value
// outside the enum's range (a negative one: the enums' values are 0..INT_MAX) must not be loaded
// as the enum, so its bytes are read as an int.
template <typename C>
int enum_bits(const C& field) {
  static_assert(std::is_enum_v<C> && sizeof(C) == sizeof(int), "an int-sized C enum");
  int value = 0;
  std::memcpy(&value, &field, sizeof value);
  return value;
}

// A caller's kda_communicator as the engine's Communicator: each collective one callback, a
// non-zero return thrown as kda::Error (kInternal) naming the options field, the callback and the
// value, so that the engine call that made it fails with that message.
class CallbackCommunicator final : public kda::engine::Communicator {
 public:
  CallbackCommunicator(const kda_communicator& c, std::string name)
      : c_(c), name_(std::move(name)) {}
  int rank() const noexcept override { return c_.rank; }
  int size() const noexcept override { return c_.size; }
  kda::Backend backend() const noexcept override {
    return c_.memory == KDA_BACKEND_CUDA ? kda::Backend::kCuda : kda::Backend::kCpu;
  }
  void all_reduce_sum(void* data, std::size_t count, kda::DType dtype, void* stream) override {
    if (dtype != kda::DType::kF32 && dtype != kda::DType::kBF16) {
      throw kda::Error(StatusCode::kInvalidArgument,
                       name_ + ": all_reduce_sum sums f32 and bf16 values only");
    }
    const kda_collective_dtype d =
        dtype == kda::DType::kF32 ? KDA_COLLECTIVE_F32 : KDA_COLLECTIVE_BF16;
    returned("all_reduce_sum", c_.all_reduce_sum(c_.user, data, count, d, stream));
  }
  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    returned("all_gather", c_.all_gather(c_.user, send, recv, bytes, stream));
  }

 private:
  void returned(const char* callback, int value) const {
    if (value != 0) {
      throw kda::Error(StatusCode::kInternal,
                       name_ + ": " + callback + " returned " + std::to_string(value));
    }
  }
  kda_communicator c_;
  std::string name_;
};

// The options' communicator `given` (may be NULL: none), checked, as the engine's.
std::unique_ptr<CallbackCommunicator> adapt(const kda_communicator* given, const char* function,
                                            const char* field) {
  if (given == nullptr) return nullptr;
  const std::string name = std::string("options.") + field;
  if (given->struct_size != sizeof(kda_communicator)) {
    invalid(function, name + "->struct_size is " + std::to_string(given->struct_size) +
                          ", expected " + std::to_string(sizeof(kda_communicator)));
  }
  if (given->size < 1 || given->rank < 0 || given->rank >= given->size) {
    invalid(function, name + " is rank " + std::to_string(given->rank) + " of " +
                          std::to_string(given->size) +
                          ", expected size >= 1 and rank in [0, size)");
  }
  if (const int memory = enum_bits(given->memory);
      memory != KDA_BACKEND_CPU && memory != KDA_BACKEND_CUDA) {
    invalid(function, name + "->memory is " + std::to_string(memory) +
                          ", expected KDA_BACKEND_CPU or KDA_BACKEND_CUDA");
  }
  if (given->reserved != 0) {
    invalid(function, name + "->reserved is " + std::to_string(given->reserved) + ", must be 0");
  }
  if (given->all_reduce_sum == nullptr || given->all_gather == nullptr) {
    invalid(function, name + " needs all_reduce_sum and all_gather");
  }
  return std::make_unique<CallbackCommunicator>(*given, name);
}

// The options' two communicators, which the handle owns (they outlive its engine).
struct Communicators {
  std::unique_ptr<CallbackCommunicator> tensor_parallel, context_group;
};

Communicators adapt_communicators(const kda_engine_options* options, const char* function) {
  Communicators c;
  if (options == nullptr) return c;
  c.tensor_parallel = adapt(options->communicator, function, "communicator");
  c.context_group = adapt(options->context_group, function, "context_group");
  return c;
}

}  // namespace

struct kda_engine {
  // Before the engine, so that they are destroyed after it.
  Communicators communicators;
  std::unique_ptr<kda::engine::Engine> engine;
  std::string plan_json;  // the plan never changes after creation: rendered once
  char last_error[kMessageCapacity] = {};
};

namespace {

const char kNullHandle[] = "the kda_engine handle is null";

// guarded() on a handle, its message naming `function`: a NULL handle is KDA_INVALID_ARGUMENT
// (nowhere to keep a message; the message is what kda_engine_last_error(NULL) returns).
template <typename Body>
kda_status on_handle(kda_engine* handle, const char* function, Body&& body) noexcept {
  if (handle == nullptr || !handle->engine) return KDA_INVALID_ARGUMENT;
  return guarded(
      handle->last_error, sizeof handle->last_error, [&] { body(*handle->engine); }, function);
}

// A query: *out, written only on success, is `get` of the engine.
template <typename T, typename Get>
kda_status query(kda_engine* handle, const char* function, T* out, Get&& get) noexcept {
  return on_handle(handle, function, [&](kda::engine::Engine& e) {
    require(out, function, "out");
    *out = get(e);
  });
}

// An option that must be 0.
void require_zero(std::int64_t value, const char* function, const char* name) {
  if (value != 0) {
    invalid(function,
            std::string("options.") + name + " is " + std::to_string(value) + ", expected 0");
  }
}

// The C enum option `name` as its C++ value: unset for its DEFAULT (0 in every such enum), the
// table's value for the others, refused naming the values there are otherwise.
template <typename C, typename T, std::size_t N>
std::optional<T> mapped(const C& field, const std::pair<C, T> (&table)[N], const char* function,
                        const char* name, const char* expected) {
  const int value = enum_bits(field);
  if (value == 0) return std::nullopt;
  for (const auto& entry : table) {
    if (static_cast<int>(entry.first) == value) return entry.second;
  }
  invalid(function, std::string("options.") + name + " is " + std::to_string(value) +
                        ", expected " + expected);
}

kda::engine::EngineOptions to_engine_options(const kda_engine_options* options,
                                             const char* function) {
  using kda::engine::BackendChoice;
  using kda::layer::DecodeKernel;
  kda::engine::EngineOptions result;
  if (options == nullptr) return result;
  if (options->struct_size != sizeof(kda_engine_options)) {
    invalid(function, "options.struct_size is " + std::to_string(options->struct_size) +
                          ", expected " + std::to_string(sizeof(kda_engine_options)) +
                          " (initialise options with kda_engine_options_init)");
  }
  static const std::pair<kda_backend, BackendChoice> backends[] = {
      {KDA_BACKEND_AUTO, BackendChoice::kAuto},
      {KDA_BACKEND_CPU, BackendChoice::kCpu},
      {KDA_BACKEND_CUDA, BackendChoice::kCuda}};
  result.backend = mapped(options->backend, backends, function, "backend",
                          "KDA_BACKEND_DEFAULT, _AUTO, _CPU or _CUDA");
  if (options->cpu_threads < 0) {
    invalid(function, "options.cpu_threads is " + std::to_string(options->cpu_threads) +
                          ", expected >= 0 (0: all hardware threads)");
  }
  result.stream = options->cuda_stream;
  result.cpu_threads = options->cpu_threads;
  result.seed = options->seed;
  if (options->check_pointers != 0 && options->check_pointers != 1) {
    invalid(function, "options.check_pointers is " + std::to_string(options->check_pointers) +
                          ", expected 0 or 1");
  }
  result.check_pointers = options->check_pointers != 0;
  static const std::pair<kda_prefill_schedule, kda::PrefillSchedule> schedules[] = {
      {KDA_PREFILL_SCHEDULE_AUTO, kda::PrefillSchedule::kAuto},
      {KDA_PREFILL_SCHEDULE_TWO_PHASE, kda::PrefillSchedule::kTwoPhase},
      {KDA_PREFILL_SCHEDULE_PIPELINED, kda::PrefillSchedule::kPipelined}};
  result.prefill_schedule =
      mapped(options->prefill_schedule, schedules, function, "prefill_schedule",
             "KDA_PREFILL_SCHEDULE_DEFAULT, _AUTO, _TWO_PHASE or _PIPELINED");
  static const std::pair<kda_decode_step, DecodeKernel> steps[] = {
      {KDA_DECODE_STEP_AUTO, DecodeKernel::kAuto},
      {KDA_DECODE_STEP_ONE_LAUNCH, DecodeKernel::kOneLaunch},
      {KDA_DECODE_STEP_FUSED, DecodeKernel::kFusedFactors},
      {KDA_DECODE_STEP_FUSED_AFTER_GEMMS, DecodeKernel::kFused},
      {KDA_DECODE_STEP_SEPARATE, DecodeKernel::kSeparate}};
  result.decode_step = mapped(options->decode_step, steps, function, "decode_step",
                              "KDA_DECODE_STEP_DEFAULT, _AUTO, _ONE_LAUNCH, _FUSED, "
                              "_FUSED_AFTER_GEMMS or _SEPARATE");
  require_zero(options->reserved2, function, "reserved2");
  static const std::pair<kda_layer_mode, kda::engine::LayerMode> modes[] = {
      {KDA_LAYER_MODE_WHOLE, kda::engine::LayerMode::kWhole},
      {KDA_LAYER_MODE_CORE, kda::engine::LayerMode::kCoreOnly}};
  result.layer_mode = mapped(options->layer_mode, modes, function, "layer_mode",
                             "KDA_LAYER_MODE_DEFAULT, _WHOLE or _CORE");
  if (options->poison_arena != 0 && options->poison_arena != 1) {
    invalid(function, "options.poison_arena is " + std::to_string(options->poison_arena) +
                          ", expected 0 or 1");
  }
  result.poison_arena = options->poison_arena == 1;
  result.null_slot = options->null_slot;
  return result;
}

// The options' runtime overrides for the description's loader (none without options).
kda::engine::ModelSpecOptions to_spec_options(const kda_engine_options* options,
                                              const char* function) {
  kda::engine::ModelSpecOptions result;
  if (options == nullptr) return result;
  if (options->max_tokens < 0) {
    invalid(function, "options.max_tokens is " + std::to_string(options->max_tokens) +
                          ", expected >= 0 (0: the description's runtime.max_tokens)");
  }
  if (options->max_sequences < 0) {
    invalid(function, "options.max_sequences is " + std::to_string(options->max_sequences) +
                          ", expected >= 0 (0: the description's runtime.max_sequences)");
  }
  if (options->max_tokens > 0) result.runtime.max_tokens = options->max_tokens;
  if (options->max_sequences > 0) result.runtime.max_sequences = options->max_sequences;
  static const std::pair<kda_state_dtype, kda::DType> dtypes[] = {
      {KDA_STATE_DTYPE_FP32, kda::DType::kF32}, {KDA_STATE_DTYPE_BF16, kda::DType::kBF16}};
  result.runtime.state_dtype = mapped(options->state_dtype, dtypes, function, "state_dtype",
                                      "KDA_STATE_DTYPE_DEFAULT, _FP32 or _BF16");
  require_zero(options->reserved3, function, "reserved3");
  return result;
}

// The description as creation reads it: from a file or text, with the options' overrides.
kda::engine::ModelSpec load_spec(const char* function, bool from_file, const char* yaml,
                                 const kda_engine_options* options) {
  require(yaml, function, from_file ? "yaml_path" : "yaml_text");
  const kda::engine::ModelSpecOptions spec_options = to_spec_options(options, function);
  return from_file ? kda::engine::load_model_spec(yaml, spec_options)
                   : kda::engine::parse_model_spec(yaml, "<yaml string>", {}, spec_options);
}

kda_status plan(const char* function, bool from_file, const char* yaml,
                const kda_engine_options* options, std::uint64_t* arena_bytes, kda_backend* backend,
                char* err, std::size_t err_size) noexcept {
  return guarded(
      err, err_size,
      [&] {
        require(arena_bytes, function, "arena_bytes");
        const kda::engine::EngineOptions engine_options = to_engine_options(options, function);
        kda::engine::ModelSpec spec = load_spec(function, from_file, yaml, options);
        // The communicators checked in creation's order; the plan needs the context group's size.
        const Communicators communicators = adapt_communicators(options, function);
        const int context_ranks =
            communicators.context_group ? communicators.context_group->size() : 0;
        if (engine_options.layer_mode) spec.runtime.layer_mode = *engine_options.layer_mode;
        kda::engine::check_weights_file(spec);
        const kda::Backend kind = kda::engine::resolve_backend(
            spec, engine_options.backend.value_or(spec.runtime.backend));
        const std::uint64_t bytes =
            kda::engine::Engine::plan_for(spec, kind, context_ranks).arena_bytes;
        *arena_bytes = bytes;
        if (backend != nullptr) {
          *backend = kind == kda::Backend::kCuda ? KDA_BACKEND_CUDA : KDA_BACKEND_CPU;
        }
      },
      function);
}

kda_status create(const char* function, bool from_file, const char* yaml,
                  const kda_engine_options* options, kda_engine** out_engine, char* err,
                  std::size_t err_size) noexcept {
  if (out_engine != nullptr) *out_engine = nullptr;
  return guarded(
      err, err_size,
      [&] {
        require(out_engine, function, "out_engine");
        kda::engine::EngineOptions engine_options = to_engine_options(options, function);
        kda::engine::ModelSpec spec = load_spec(function, from_file, yaml, options);
        auto handle = std::make_unique<kda_engine>();
        handle->communicators = adapt_communicators(options, function);
        engine_options.communicator = handle->communicators.tensor_parallel.get();
        engine_options.context_group = handle->communicators.context_group.get();
        handle->engine = std::make_unique<kda::engine::Engine>(std::move(spec), engine_options);
        handle->plan_json = handle->engine->plan().to_json();
        *out_engine = handle.release();
      },
      function);
}

void check_count(int count, const kda::engine::Engine& engine, const char* function,
                 const char* name) {
  if (count < 1 || count > engine.num_slots()) {
    invalid(function, std::string(name) + " is " + std::to_string(count) + ", expected 1.." +
                          std::to_string(engine.num_slots()) + " (runtime.max_sequences)");
  }
}

void require_tensors(const char* function, const void* q, const void* k, const void* v,
                     const void* g, const void* beta, const void* out) {
  require(q, function, "q");
  require(k, function, "k");
  require(v, function, "v");
  require(g, function, "g");
  require(beta, function, "beta");
  require(out, function, "out");
}

// The C batch as the engine's.
kda::engine::BatchMetadata batch_metadata(const kda_batch* given, const char* function) {
  require(given, function, "batch");
  // The sizes of the versions there are: a size between them would cut a field in two.
  if (given->struct_size != kBatchFirstSize && given->struct_size != sizeof(kda_batch)) {
    invalid(function, "batch->struct_size is " + std::to_string(given->struct_size) +
                          ", expected " + std::to_string(kBatchFirstSize) + " or " +
                          std::to_string(sizeof(kda_batch)) +
                          " (initialise the batch with kda_batch_init)");
  }
  // The fields the caller's version holds; later ones stay unset (zero).
  kda_batch copy{};
  std::memcpy(&copy, given, given->struct_size);
  const kda_batch* batch = &copy;
  if (batch->reserved != 0) {
    invalid(function, "batch->reserved is " + std::to_string(batch->reserved) + ", must be 0");
  }
  kda::engine::BatchMetadata b;
  b.tokens = batch->tokens;
  b.sequences = batch->sequences;
  b.decode_tokens = batch->decode_tokens;
  b.slots = batch->slots;
  b.cu_seqlens = batch->cu_seqlens;
  b.cu_seqlens_i32 = batch->cu_seqlens_i32;
  b.num_accepted = batch->num_accepted;
  b.checkpoints = batch->checkpoints;
  b.checkpoint_offsets = batch->checkpoint_offsets;
  b.checkpoint_slots = batch->checkpoint_slots;
  b.records = batch->records != 0;
  b.records_region = batch->records_region;
  b.fold_region = batch->fold_region;
  b.fold_rows = batch->fold_rows;
  b.fold_counts = batch->fold_counts;
  return b;
}

}  // namespace

extern "C" {

const char* kda_status_string(kda_status status) {
  const int value = enum_bits(status);  // any int a C caller passes, negative ones too
  if (value < KDA_OK || value > kLastStatus) return "unknown status";
  return kda::to_string(static_cast<StatusCode>(value));
}

kda_status kda_engine_create_from_file(const char* yaml_path, const kda_engine_options* options,
                                       kda_engine** out_engine, char* err, size_t err_size) {
  return create("kda_engine_create_from_file", true, yaml_path, options, out_engine, err, err_size);
}

kda_status kda_engine_create_from_string(const char* yaml_text, const kda_engine_options* options,
                                         kda_engine** out_engine, char* err, size_t err_size) {
  return create("kda_engine_create_from_string", false, yaml_text, options, out_engine, err,
                err_size);
}

kda_status kda_engine_plan_from_file(const char* yaml_path, const kda_engine_options* options,
                                     uint64_t* arena_bytes, kda_backend* backend, char* err,
                                     size_t err_size) {
  return plan("kda_engine_plan_from_file", true, yaml_path, options, arena_bytes, backend, err,
              err_size);
}

kda_status kda_engine_plan_from_string(const char* yaml_text, const kda_engine_options* options,
                                       uint64_t* arena_bytes, kda_backend* backend, char* err,
                                       size_t err_size) {
  return plan("kda_engine_plan_from_string", false, yaml_text, options, arena_bytes, backend, err,
              err_size);
}

kda_status kda_engine_destroy(kda_engine* engine) {
  if (engine == nullptr) return KDA_OK;
  // ~Engine waits for the stream and frees the arena; it does not throw.
  delete engine;
  return KDA_OK;
}

const char* kda_engine_last_error(const kda_engine* engine) {
  return engine == nullptr ? kNullHandle : engine->last_error;
}

kda_status kda_engine_num_layers(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_num_layers", out,
               [&](const kda::engine::Engine& e) { return e.num_layers(); });
}

kda_status kda_engine_num_heads(kda_engine* engine, int64_t* out) {
  return query(engine, "kda_engine_num_heads", out,
               [&](const kda::engine::Engine& e) { return e.spec().num_heads; });
}

kda_status kda_engine_head_dim(kda_engine* engine, int64_t* out) {
  return query(engine, "kda_engine_head_dim", out,
               [&](const kda::engine::Engine& e) { return e.spec().head_dim; });
}

kda_status kda_engine_backend(kda_engine* engine, kda_backend* out) {
  return on_handle(engine, "kda_engine_backend", [&](kda::engine::Engine& e) {
    require(out, "kda_engine_backend", "out");
    switch (e.backend()) {  // the C names of kda::Backend
      case kda::Backend::kCpu:
        *out = KDA_BACKEND_CPU;
        break;
      case kda::Backend::kCuda:
        *out = KDA_BACKEND_CUDA;
        break;
    }
  });
}

kda_status kda_engine_max_tokens(kda_engine* engine, int64_t* out) {
  return query(engine, "kda_engine_max_tokens", out,
               [&](const kda::engine::Engine& e) { return e.spec().runtime.max_tokens; });
}

kda_status kda_engine_max_sequences(kda_engine* engine, int64_t* out) {
  return query(engine, "kda_engine_max_sequences", out,
               [&](const kda::engine::Engine& e) { return e.spec().runtime.max_sequences; });
}

kda_status kda_engine_free_slots(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_free_slots", out,
               [&](const kda::engine::Engine& e) { return e.free_slots(); });
}

kda_status kda_engine_arena_bytes(kda_engine* engine, uint64_t* out) {
  return query(engine, "kda_engine_arena_bytes", out,
               [&](const kda::engine::Engine& e) { return e.arena_bytes(); });
}

kda_status kda_engine_model_layer(kda_engine* engine, int layer, int* out) {
  return query(engine, "kda_engine_model_layer", out,
               [&](const kda::engine::Engine& e) { return e.layer(layer).model_layer; });
}

kda_status kda_engine_conv_width(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_conv_width", out, [&](const kda::engine::Engine& e) {
    return static_cast<int>(e.spec().short_conv_kernel_size);
  });
}

kda_status kda_engine_state_dtype(kda_engine* engine, kda_state_dtype* out) {
  return query(engine, "kda_engine_state_dtype", out, [&](const kda::engine::Engine& e) {
    return e.spec().runtime.state_dtype == kda::DType::kBF16 ? KDA_STATE_DTYPE_BF16
                                                             : KDA_STATE_DTYPE_FP32;
  });
}

kda_status kda_engine_tensor_parallel(kda_engine* engine, int* rank, int* size) {
  return on_handle(engine, "kda_engine_tensor_parallel", [&](kda::engine::Engine& e) {
    if (rank == nullptr && size == nullptr) {
      invalid("kda_engine_tensor_parallel", "rank and size are both null");
    }
    if (rank != nullptr) *rank = e.spec().runtime.tp_rank;
    if (size != nullptr) *size = e.spec().runtime.tp_size;
  });
}

kda_status kda_engine_max_verify_tokens(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_max_verify_tokens", out, [&](const kda::engine::Engine& e) {
    return static_cast<int>(e.spec().runtime.max_verify_tokens);
  });
}

kda_status kda_engine_record_regions(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_record_regions", out, [&](const kda::engine::Engine& e) {
    return static_cast<int>(e.spec().runtime.record_regions);
  });
}

kda_status kda_engine_null_slot(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_null_slot", out,
               [&](const kda::engine::Engine& e) { return e.null_slot(); });
}

kda_status kda_engine_slot_in_use(kda_engine* engine, int slot, int* out) {
  return on_handle(engine, "kda_engine_slot_in_use", [&](kda::engine::Engine& e) {
    require(out, "kda_engine_slot_in_use", "out");
    if (slot < 0 || slot >= e.num_slots()) {
      invalid("kda_engine_slot_in_use", "slot " + std::to_string(slot) + " is not in 0.." +
                                            std::to_string(e.num_slots() - 1) +
                                            " (runtime.max_sequences)");
    }
    *out = e.slot_in_use(slot) ? 1 : 0;
  });
}

kda_status kda_engine_plan_json(kda_engine* engine, char* buffer, size_t buffer_size,
                                size_t* length) {
  return on_handle(engine, "kda_engine_plan_json", [&](kda::engine::Engine&) {
    const std::string& json = engine->plan_json;
    if (length != nullptr) *length = json.size();
    if (buffer == nullptr && buffer_size == 0) return;  // size query
    require(buffer, "kda_engine_plan_json", "buffer (with buffer_size > 0)");
    if (buffer_size < json.size() + 1) {
      if (buffer_size > 0) buffer[0] = '\0';
      invalid("kda_engine_plan_json", "buffer of " + std::to_string(buffer_size) +
                                          " bytes is too small: the plan JSON needs " +
                                          std::to_string(json.size() + 1) +
                                          " bytes (its length + 1)");
    }
    std::memcpy(buffer, json.c_str(), json.size() + 1);
  });
}

kda_status kda_engine_acquire_slot(kda_engine* engine, int* out_slot) {
  return on_handle(engine, "kda_engine_acquire_slot", [&](kda::engine::Engine& e) {
    require(out_slot, "kda_engine_acquire_slot", "out_slot");
    *out_slot = e.acquire_slot();
  });
}

kda_status kda_engine_release_slot(kda_engine* engine, int slot) {
  return on_handle(engine, "kda_engine_release_slot",
                   [&](kda::engine::Engine& e) { e.release_slot(slot); });
}

kda_status kda_engine_reset_slot(kda_engine* engine, int slot) {
  return on_handle(engine, "kda_engine_reset_slot",
                   [&](kda::engine::Engine& e) { e.reset_slot(slot); });
}

kda_status kda_engine_sequence_state_bytes(kda_engine* engine, uint64_t* out) {
  return query(engine, "kda_engine_sequence_state_bytes", out,
               [&](const kda::engine::Engine& e) { return e.sequence_state_bytes(); });
}

kda_status kda_engine_read_sequence_state(kda_engine* engine, int slot, void* host_dst,
                                          uint64_t bytes) {
  return on_handle(engine, "kda_engine_read_sequence_state",
                   [&](kda::engine::Engine& e) { e.read_sequence_state(slot, host_dst, bytes); });
}

kda_status kda_engine_write_sequence_state(kda_engine* engine, int slot, const void* host_src,
                                           uint64_t bytes) {
  return on_handle(engine, "kda_engine_write_sequence_state",
                   [&](kda::engine::Engine& e) { e.write_sequence_state(slot, host_src, bytes); });
}

kda_status kda_engine_copy_slot(kda_engine* engine, int src, int dst) {
  return on_handle(engine, "kda_engine_copy_slot", [&](kda::engine::Engine& e) {
    // One pair names two slots: neither is padding here.
    for (const auto& [slot, name] :
         {std::pair<int, const char*>{src, "src"}, std::pair<int, const char*>{dst, "dst"}}) {
      if (!e.slot_in_use(slot)) {
        invalid("kda_engine_copy_slot",
                std::string(name) + " slot " + std::to_string(slot) + " is not acquired");
      }
    }
    e.copy_slots({src}, {dst});
  });
}

kda_status kda_engine_copy_slots(kda_engine* engine, int64_t pairs, const int32_t* src,
                                 const int32_t* dst) {
  return on_handle(engine, "kda_engine_copy_slots",
                   [&](kda::engine::Engine& e) { e.copy_slots(pairs, src, dst); });
}

kda_status kda_engine_reset_slots(kda_engine* engine, int64_t count, const int32_t* slots) {
  return on_handle(engine, "kda_engine_reset_slots",
                   [&](kda::engine::Engine& e) { e.reset_slots(count, slots); });
}

kda_status kda_engine_prefill(kda_engine* engine, int layer, const void* q, const void* k,
                              const void* v, const void* g, const void* beta, void* out,
                              const int* slots, int num_sequences, const int64_t* cu_seqlens) {
  return on_handle(engine, "kda_engine_prefill", [&](kda::engine::Engine& e) {
    const char* const function = "kda_engine_prefill";
    require_tensors(function, q, k, v, g, beta, out);
    require(slots, function, "slots");
    require(cu_seqlens, function, "cu_seqlens");
    check_count(num_sequences, e, function, "num_sequences");
    const auto n = static_cast<std::size_t>(num_sequences);
    // The caller's arrays as they are: the engine reads them through spans, without a copy.
    e.prefill(layer, kda::engine::LayerInputs{q, k, v, g, beta}, out, {slots, n},
              {cu_seqlens, n + 1});
  });
}

kda_status kda_engine_decode(kda_engine* engine, int layer, const void* q, const void* k,
                             const void* v, const void* g, const void* beta, void* out,
                             const int* slots, int batch, int tokens) {
  return on_handle(engine, "kda_engine_decode", [&](kda::engine::Engine& e) {
    const char* const function = "kda_engine_decode";
    require_tensors(function, q, k, v, g, beta, out);
    require(slots, function, "slots");
    check_count(batch, e, function, "batch");
    e.decode(layer, kda::engine::LayerInputs{q, k, v, g, beta}, out,
             {slots, static_cast<std::size_t>(batch)}, tokens);
  });
}

kda_status kda_engine_prefill_context_parallel(kda_engine* engine, int layer, const void* q,
                                               const void* k, const void* v, const void* g,
                                               const void* beta, void* out, int slot,
                                               int64_t tokens) {
  return on_handle(engine, "kda_engine_prefill_context_parallel", [&](kda::engine::Engine& e) {
    // A rank may hold no tokens, and then no tensors; the engine checks the rest before its
    // first collective.
    if (tokens > 0) require_tensors("kda_engine_prefill_context_parallel", q, k, v, g, beta, out);
    e.prefill_context_parallel(layer, kda::engine::LayerInputs{q, k, v, g, beta}, out, slot,
                               tokens);
  });
}

kda_status kda_engine_prefill_hidden_context_parallel(kda_engine* engine, int layer,
                                                      const void* hidden, void* out, int slot,
                                                      int64_t tokens) {
  return on_handle(engine, "kda_engine_prefill_hidden_context_parallel",
                   [&](kda::engine::Engine& e) {
                     e.prefill_hidden_context_parallel(layer, hidden, out, slot, tokens);
                   });
}

kda_status kda_engine_hidden_size(kda_engine* engine, int64_t* out) {
  return query(engine, "kda_engine_hidden_size", out,
               [&](const kda::engine::Engine& e) { return e.spec().hidden_size; });
}

kda_status kda_engine_whole_layers(kda_engine* engine, int* out) {
  return query(engine, "kda_engine_whole_layers", out, [&](const kda::engine::Engine& e) {
    return e.layer_mode() == kda::engine::LayerMode::kWhole ? 1 : 0;
  });
}

kda_status kda_engine_decode_step_ran(kda_engine* engine, int layer, kda_decode_step* out) {
  return on_handle(engine, "kda_engine_decode_step_ran", [&](kda::engine::Engine& e) {
    require(out, "kda_engine_decode_step_ran", "out");
    const kda::layer::DecodeKernel ran = e.decode_step_ran(layer);
    *out = KDA_DECODE_STEP_AUTO;  // kAuto: none ran
    switch (ran) {
      case kda::layer::DecodeKernel::kAuto:
        break;
      case kda::layer::DecodeKernel::kOneLaunch:
        *out = KDA_DECODE_STEP_ONE_LAUNCH;
        break;
      case kda::layer::DecodeKernel::kFusedFactors:
        *out = KDA_DECODE_STEP_FUSED;
        break;
      case kda::layer::DecodeKernel::kFused:
        *out = KDA_DECODE_STEP_FUSED_AFTER_GEMMS;
        break;
      case kda::layer::DecodeKernel::kSeparate:
        *out = KDA_DECODE_STEP_SEPARATE;
        break;
    }
  });
}

kda_status kda_engine_prefill_hidden(kda_engine* engine, int layer, const void* hidden, void* out,
                                     const int* slots, int num_sequences,
                                     const int64_t* cu_seqlens) {
  return on_handle(engine, "kda_engine_prefill_hidden", [&](kda::engine::Engine& e) {
    const char* const function = "kda_engine_prefill_hidden";
    require(slots, function, "slots");
    require(cu_seqlens, function, "cu_seqlens");
    check_count(num_sequences, e, function, "num_sequences");
    const auto n = static_cast<std::size_t>(num_sequences);
    // hidden / out may be NULL only for a batch of no tokens (the engine checks).
    e.prefill_hidden(layer, hidden, out, {slots, n}, {cu_seqlens, n + 1});
  });
}

kda_status kda_engine_decode_hidden(kda_engine* engine, int layer, const void* hidden, void* out,
                                    const int* slots, int batch, int tokens) {
  return on_handle(engine, "kda_engine_decode_hidden", [&](kda::engine::Engine& e) {
    const char* const function = "kda_engine_decode_hidden";
    require(hidden, function, "hidden");
    require(out, function, "out");
    require(slots, function, "slots");
    check_count(batch, e, function, "batch");
    e.decode_hidden(layer, hidden, out, {slots, static_cast<std::size_t>(batch)}, tokens);
  });
}

kda_status kda_engine_forward_batch(kda_engine* engine, int layer, const void* q, const void* k,
                                    const void* v, const void* g, const void* beta, void* out,
                                    const kda_batch* batch) {
  return on_handle(engine, "kda_engine_forward_batch", [&](kda::engine::Engine& e) {
    const kda::engine::BatchMetadata b = batch_metadata(batch, "kda_engine_forward_batch");
    const kda::engine::LayerInputs inputs{q, k, v, g, beta};
    if (b.decode_tokens == 0) {
      e.prefill(layer, inputs, out, b);
    } else {
      e.decode(layer, inputs, out, b);
    }
  });
}

kda_status kda_engine_forward_hidden_batch(kda_engine* engine, int layer, const void* hidden,
                                           void* out, const kda_batch* batch) {
  return on_handle(engine, "kda_engine_forward_hidden_batch", [&](kda::engine::Engine& e) {
    const kda::engine::BatchMetadata b = batch_metadata(batch, "kda_engine_forward_hidden_batch");
    if (b.decode_tokens == 0) {
      e.prefill_hidden(layer, hidden, out, b);
    } else {
      e.decode_hidden(layer, hidden, out, b);
    }
  });
}

kda_status kda_engine_commit(kda_engine* engine, int64_t sequences, const int32_t* slots,
                             const int32_t* num_accepted) {
  return on_handle(engine, "kda_engine_commit",
                   [&](kda::engine::Engine& e) { e.commit(sequences, slots, num_accepted); });
}

kda_status kda_engine_commit_region(kda_engine* engine, int64_t sequences, const int32_t* slots,
                                    const int32_t* num_accepted, int records_region) {
  return on_handle(engine, "kda_engine_commit_region", [&](kda::engine::Engine& e) {
    e.commit(sequences, slots, num_accepted, records_region);
  });
}

kda_status kda_engine_synchronize(kda_engine* engine) {
  return on_handle(engine, "kda_engine_synchronize",
                   [&](kda::engine::Engine& e) { e.synchronize(); });
}

kda_status kda_engine_check_device_status(kda_engine* engine) {
  return on_handle(engine, "kda_engine_check_device_status",
                   [&](kda::engine::Engine& e) { e.check_device_status(); });
}

}  // extern "C"
