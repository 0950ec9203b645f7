// The C API (kda/kda_engine.h): every entry point and its errors (null handle and pointers, bad
// YAML, options, layer and slot out of range, the plan-JSON buffer), the layer mode, and tensor
// and context parallelism through a caller's kda_communicator (ranks as threads) on the CPU; on the
// backend matrix, prefill + decode and their whole-layer twins through a handle on either backend
// equal the same calls on the C++ Engine on the CPU (bitwise on the CPU; 5e-3 on CUDA, 1e-2 for
// whole layers), and check_pointers = 0 changes no bit; on CUDA alone, host pointers and short
// buffers come back as status codes and per-handle messages, never as exceptions or faults.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "c_communicator.hpp"
#include "engine_matrix.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/communicator.hpp"
#include "kda/engine/engine.hpp"
#include "kda/error.hpp"
#include "kda/kda_engine.h"
#include "kda_reference.hpp"
#include "layer_test_util.hpp"
#include "rank_threads.hpp"

using kda::engine::Engine;
using kda::engine::EngineOptions;
using kda::engine::LayerInputs;
using kda::engine::ModelSpec;
using kda::test::Activations;
using kda::test::allowed;
using kda::test::deviation;
using kda::test::Memory;
using kda::test::OnBackend;
using kda::test::Runner;

#if defined(__SANITIZE_ADDRESS__)
#define KDA_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KDA_UNDER_ASAN 1
#endif
#endif
#ifndef KDA_UNDER_ASAN
#define KDA_UNDER_ASAN 0
#endif

namespace {

// 3 KDA layers, H = 2, K = V = 32, 4 slots, CPU (head_dim 32 is not a CUDA problem).
const char* const kSpec =
    "name: c-api-test\n"
    "hidden_size: 64\n"
    "num_hidden_layers: 4\n"
    "linear_attn_config:\n"
    "  num_heads: 2\n"
    "  head_dim: 32\n"
    "  kda_layers: [1, 2, 4]\n"
    "  full_attn_layers: [3]\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 128\n"
    "  max_sequences: 4\n"
    "  state_dtype: fp32\n"
    "  workspace_plan: reuse\n"
    "  backend: cpu\n";

// Owns a handle: destroyed at scope exit, so a failed CHECK does not leak.
struct Handle {
  kda_engine* engine = nullptr;
  Handle() = default;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { CHECK(kda_engine_destroy(engine) == KDA_OK); }
  operator kda_engine*() const { return engine; }  // NOLINT: a handle stands for its engine
};

// The matrix cases' model: two KDA layers of two heads of 128, which both backends run.
const char* const kMatrixSpec =
    "name: c-api-matrix-test\n"
    "hidden_size: 256\n"
    "num_hidden_layers: 2\n"
    "linear_attn_config:\n"
    "  num_heads: 2\n"
    "  head_dim: 128\n"
    "  kda_layers: [1, 2]\n"
    "  full_attn_layers: []\n"
    "  gate: softplus\n"
    "runtime:\n"
    "  max_tokens: 256\n"
    "  max_sequences: 4\n"
    "  state_dtype: fp32\n";
constexpr std::int64_t H = 2, D = 128, E = 256;

kda_engine_options cpu_options(std::uint64_t seed = 0) {
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  options.backend = KDA_BACKEND_CPU;
  options.cpu_threads = 2;
  options.seed = seed;
  return options;
}

void create(Handle* handle, const char* yaml = kSpec, std::uint64_t seed = 0,
            kda_backend backend = KDA_BACKEND_CPU, int check_pointers = 1) {
  kda_engine_options options = cpu_options(seed);
  options.backend = backend;
  options.check_pointers = check_pointers;
  char err[512] = "untouched";
  REQUIRE_MESSAGE(
      kda_engine_create_from_string(yaml, &options, &handle->engine, err, sizeof err) == KDA_OK,
      err);
  REQUIRE(handle->engine != nullptr);
  CHECK(std::string(err).empty());
}

kda_backend backend_of(const Runner& runner) {
  return runner.backend() == kda::Backend::kCuda ? KDA_BACKEND_CUDA : KDA_BACKEND_CPU;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
std::string last_error(const kda_engine* engine) { return kda_engine_last_error(engine); }

}  // namespace

KDA_CPU_CASE("status strings and options_init") {
  CHECK(std::string(kda_status_string(KDA_OK)) == "ok");
  CHECK(std::string(kda_status_string(KDA_INVALID_ARGUMENT)) == "invalid argument");
  CHECK(std::string(kda_status_string(KDA_BACKEND_UNAVAILABLE)) == "backend unavailable");
  CHECK(std::string(kda_status_string(static_cast<kda_status>(99))) == "unknown status");
  // A negative int, as a C caller may store (written as bytes: in C++ the enum's values are
  // 0..INT_MAX).
  {
    kda_status negative;
    const int minus_one = -1;
    std::memcpy(&negative, &minus_one, sizeof minus_one);
    CHECK(std::string(kda_status_string(negative)) == "unknown status");
  }
  // Value for value the C++ codes, with the same names.
  for (int code = 0; code <= static_cast<int>(kda::StatusCode::kOutOfMemory); ++code) {
    CAPTURE(code);
    CHECK(std::string(kda_status_string(static_cast<kda_status>(code))) ==
          kda::to_string(static_cast<kda::StatusCode>(code)));
  }
  CHECK(KDA_OUT_OF_MEMORY == static_cast<int>(kda::StatusCode::kOutOfMemory));
  CHECK(std::string(kda_status_string(KDA_OUT_OF_MEMORY)) == "out of memory");
  CHECK(std::string(kda_status_string(static_cast<kda_status>(KDA_OUT_OF_MEMORY + 1))) ==
        "unknown status");

  kda_engine_options options;
  std::memset(&options, 0xAB, sizeof options);
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  CHECK(options.struct_size == sizeof(kda_engine_options));
  CHECK(options.backend == KDA_BACKEND_DEFAULT);
  CHECK(options.cuda_stream == nullptr);
  CHECK(options.cpu_threads == 0);
  CHECK(options.seed == 0);
  CHECK(options.check_pointers == 1);
  CHECK(options.prefill_schedule == KDA_PREFILL_SCHEDULE_DEFAULT);
  CHECK(options.decode_step == KDA_DECODE_STEP_DEFAULT);
  CHECK(options.null_slot == -1);
  CHECK(options.reserved2 == 0);
  CHECK(options.max_tokens == 0);
  CHECK(options.max_sequences == 0);
  CHECK(options.state_dtype == KDA_STATE_DTYPE_DEFAULT);
  CHECK(options.reserved3 == 0);
  CHECK(options.layer_mode == KDA_LAYER_MODE_DEFAULT);
  CHECK(options.poison_arena == 0);
  CHECK(options.communicator == nullptr);
  CHECK(options.context_group == nullptr);
  CHECK(kda_engine_options_init(nullptr) == KDA_INVALID_ARGUMENT);
}

KDA_CPU_CASE("plan without creating: the arena creation would allocate, and its backend") {
  kda_engine_options options = cpu_options();
  std::uint64_t planned = 0;
  kda_backend backend = KDA_BACKEND_DEFAULT;
  char err[512] = "untouched";
  REQUIRE(kda_engine_plan_from_string(kSpec, &options, &planned, &backend, err, sizeof err) ==
          KDA_OK);
  CHECK(std::string(err).empty());
  CHECK(backend == KDA_BACKEND_CPU);
  Handle made;
  create(&made);
  std::uint64_t arena = 0;
  REQUIRE(kda_engine_arena_bytes(made, &arena) == KDA_OK);
  CHECK(planned == arena);
  // The overrides count: twice the slots, a larger arena; the same as an engine made so.
  options.max_sequences = 8;
  std::uint64_t larger = 0;
  REQUIRE(kda_engine_plan_from_string(kSpec, &options, &larger, nullptr, err, sizeof err) ==
          KDA_OK);
  CHECK(larger > planned);
  Handle eight;
  REQUIRE(kda_engine_create_from_string(kSpec, &options, &eight.engine, nullptr, 0) == KDA_OK);
  REQUIRE(kda_engine_arena_bytes(eight, &arena) == KDA_OK);
  CHECK(larger == arena);
  // From a file, the backend left to the description (auto).
  const std::string path = std::string(KDA_SOURCE_DIR) + "/examples/models/tiny.yaml";
  kda_engine_options defaults = cpu_options();
  defaults.backend = KDA_BACKEND_DEFAULT;
  REQUIRE(kda_engine_plan_from_file(path.c_str(), &defaults, &planned, &backend, err, sizeof err) ==
          KDA_OK);
  CHECK(backend == (kda::cuda_device_count() > 0 ? KDA_BACKEND_CUDA : KDA_BACKEND_CPU));
  Handle tiny;
  REQUIRE(kda_engine_create_from_file(path.c_str(), &defaults, &tiny.engine, nullptr, 0) == KDA_OK);
  REQUIRE(kda_engine_arena_bytes(tiny, &arena) == KDA_OK);
  CHECK(planned == arena);
  // Refusals: a message, *arena_bytes untouched.
  planned = 7;
  CHECK(kda_engine_plan_from_string("hidden_size: [", &options, &planned, nullptr, err,
                                    sizeof err) == KDA_INVALID_ARGUMENT);
  CHECK(std::string(err).find("<yaml string>") != std::string::npos);
  CHECK(kda_engine_plan_from_file("/no/such/model.yaml", nullptr, &planned, nullptr, err,
                                  sizeof err) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_plan_from_string(kSpec, nullptr, nullptr, nullptr, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(err).find("arena_bytes is null") != std::string::npos);
  CHECK(kda_engine_plan_from_string(nullptr, nullptr, &planned, nullptr, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  options.max_sequences = -1;
  CHECK(kda_engine_plan_from_string(kSpec, &options, &planned, nullptr, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  CHECK(planned == 7);
  // A weights file that does not exist is named, as creation would.
  const std::string missing = std::string(kSpec) + "weights: /no/such/weights.safetensors\n";
  CHECK(kda_engine_plan_from_string(missing.c_str(), nullptr, &planned, nullptr, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(err).find("does not exist") != std::string::npos);
}

KDA_CPU_CASE("create from string and from file, every query") {
  Handle handle;
  create(&handle);
  const ModelSpec spec = kda::engine::parse_model_spec(kSpec, "t.yaml");

  int layers = 0, free_slots = 0;
  std::int64_t heads = 0, head_dim = 0, max_tokens = 0, max_sequences = 0;
  kda_backend backend = KDA_BACKEND_DEFAULT;
  std::uint64_t arena = 0;
  CHECK(kda_engine_num_layers(handle, &layers) == KDA_OK);
  CHECK(kda_engine_num_heads(handle, &heads) == KDA_OK);
  CHECK(kda_engine_head_dim(handle, &head_dim) == KDA_OK);
  CHECK(kda_engine_backend(handle, &backend) == KDA_OK);
  CHECK(kda_engine_max_tokens(handle, &max_tokens) == KDA_OK);
  CHECK(kda_engine_max_sequences(handle, &max_sequences) == KDA_OK);
  CHECK(kda_engine_free_slots(handle, &free_slots) == KDA_OK);
  CHECK(kda_engine_arena_bytes(handle, &arena) == KDA_OK);
  CHECK(layers == 3);
  CHECK(heads == 2);
  CHECK(head_dim == 32);
  CHECK(backend == KDA_BACKEND_CPU);
  CHECK(max_tokens == 128);
  CHECK(max_sequences == 4);
  CHECK(free_slots == 4);
  // The C API reports the plan the C++ planner makes for this spec.
  const kda::planner::MemoryPlan plan = Engine::plan_for(spec, kda::Backend::kCpu);
  CHECK(arena == plan.arena_bytes);
  std::size_t length = 0;
  REQUIRE(kda_engine_plan_json(handle, nullptr, 0, &length) == KDA_OK);
  std::vector<char> json(length + 1, 'x');
  REQUIRE(kda_engine_plan_json(handle, json.data(), json.size(), nullptr) == KDA_OK);
  CHECK(std::string(json.data()) == plan.to_json());
  CHECK(last_error(handle).empty());
  // Too small: refused, the buffer's first byte cleared; of 0 bytes: not written at all.
  std::vector<char> short_buffer(8, 'x');
  CHECK(kda_engine_plan_json(handle, short_buffer.data(), short_buffer.size(), nullptr) ==
        KDA_INVALID_ARGUMENT);
  CHECK(short_buffer[0] == '\0');
  CHECK(short_buffer[1] == 'x');
  char untouched = 'x';
  CHECK(kda_engine_plan_json(handle, &untouched, 0, &length) == KDA_INVALID_ARGUMENT);
  CHECK(untouched == 'x');

  // What the engine was made with: the model layers it runs, W, the state dtype, tensor
  // parallelism, the verify settings, the null slot, the slots in use.
  int model_layers[3] = {0, 0, 0}, value = -7, rank = -1, ranks = -1;
  for (int l = 0; l < 3; ++l) CHECK(kda_engine_model_layer(handle, l, &model_layers[l]) == KDA_OK);
  CHECK(std::vector<int>(model_layers, model_layers + 3) == std::vector<int>{1, 2, 4});
  CHECK(kda_engine_model_layer(handle, 3, &value) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_model_layer(handle, -1, &value) == KDA_INVALID_ARGUMENT);
  CHECK(value == -7);  // written only on success
  CHECK(kda_engine_conv_width(handle, &value) == KDA_OK);
  CHECK(value == 4);
  kda_state_dtype dtype = KDA_STATE_DTYPE_DEFAULT;
  CHECK(kda_engine_state_dtype(handle, &dtype) == KDA_OK);
  CHECK(dtype == KDA_STATE_DTYPE_FP32);
  CHECK(kda_engine_tensor_parallel(handle, &rank, &ranks) == KDA_OK);
  CHECK((rank == 0 && ranks == 1));
  CHECK(kda_engine_tensor_parallel(handle, nullptr, &ranks) == KDA_OK);
  CHECK(kda_engine_tensor_parallel(handle, nullptr, nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_max_verify_tokens(handle, &value) == KDA_OK);
  CHECK(value == 0);
  CHECK(kda_engine_record_regions(handle, &value) == KDA_OK);
  CHECK(value == 1);
  CHECK(kda_engine_null_slot(handle, &value) == KDA_OK);
  CHECK(value == -1);
  int slot = -1, in_use = -1;
  REQUIRE(kda_engine_acquire_slot(handle, &slot) == KDA_OK);
  CHECK(kda_engine_slot_in_use(handle, slot, &in_use) == KDA_OK);
  CHECK(in_use == 1);
  CHECK(kda_engine_slot_in_use(handle, 3, &in_use) == KDA_OK);
  CHECK(in_use == 0);
  CHECK(kda_engine_slot_in_use(handle, 4, &in_use) == KDA_INVALID_ARGUMENT);
  CHECK(last_error(handle).find("slot 4 is not in 0..3") != std::string::npos);
  CHECK(kda_engine_release_slot(handle, slot) == KDA_OK);
  {  // A bf16 state, records of 4 tokens in two regions, a null slot.
    const std::string text = std::string(kSpec) + "  max_verify_tokens: 4\n  record_regions: 2\n";
    kda_engine_options options = cpu_options();
    options.state_dtype = KDA_STATE_DTYPE_BF16;
    options.null_slot = 3;
    Handle verify;
    REQUIRE(kda_engine_create_from_string(text.c_str(), &options, &verify.engine, nullptr, 0) ==
            KDA_OK);
    CHECK(kda_engine_state_dtype(verify, &dtype) == KDA_OK);
    CHECK(dtype == KDA_STATE_DTYPE_BF16);
    CHECK(kda_engine_max_verify_tokens(verify, &value) == KDA_OK);
    CHECK(value == 4);
    CHECK(kda_engine_record_regions(verify, &value) == KDA_OK);
    CHECK(value == 2);
    CHECK(kda_engine_null_slot(verify, &value) == KDA_OK);
    CHECK(value == 3);
  }

  // From the example model's file, backend left to the options' default (the YAML's `auto`, which
  // is the CPU here unless a CUDA device is present).
  Handle tiny;
  kda_engine_options options = cpu_options();
  options.backend = KDA_BACKEND_DEFAULT;
  char err[256];
  const std::string path = std::string(KDA_SOURCE_DIR) + "/examples/models/tiny.yaml";
  REQUIRE(kda_engine_create_from_file(path.c_str(), &options, &tiny.engine, err, sizeof err) ==
          KDA_OK);
  CHECK(kda_engine_num_layers(tiny, &layers) == KDA_OK);
  CHECK(kda_engine_num_heads(tiny, &heads) == KDA_OK);
  CHECK(kda_engine_max_sequences(tiny, &max_sequences) == KDA_OK);
  CHECK(kda_engine_backend(tiny, &backend) == KDA_OK);
  CHECK(layers == 3);
  CHECK(heads == 4);
  CHECK(max_sequences == 4);
  CHECK(backend == (kda::cuda_device_count() > 0 ? KDA_BACKEND_CUDA : KDA_BACKEND_CPU));
  // NULL options: the defaults.
  Handle defaults;
  REQUIRE(kda_engine_create_from_file(path.c_str(), nullptr, &defaults.engine, nullptr, 0) ==
          KDA_OK);
  // The runtime overrides replace the description's max_tokens (2048), max_sequences (4) and
  // state_dtype (fp32), from a file and from a string: a bf16 state is half the bytes.
  auto state_bytes = [](kda_engine* engine) {
    std::size_t length = 0;
    REQUIRE(kda_engine_plan_json(engine, nullptr, 0, &length) == KDA_OK);
    std::vector<char> json(length + 1);
    REQUIRE(kda_engine_plan_json(engine, json.data(), json.size(), nullptr) == KDA_OK);
    const nlohmann::json plan = nlohmann::json::parse(json.data());
    for (const auto& buffer : plan["buffers"]) {
      if (buffer["name"] == "layer1.state") return buffer["bytes"].get<std::uint64_t>();
    }
    FAIL("no layer1.state buffer");
    return std::uint64_t{0};
  };
  kda_engine_options overridden = options;
  overridden.max_tokens = 64;
  overridden.max_sequences = 6;
  overridden.state_dtype = KDA_STATE_DTYPE_BF16;
  Handle small;
  REQUIRE_MESSAGE(kda_engine_create_from_file(path.c_str(), &overridden, &small.engine, err,
                                              sizeof err) == KDA_OK,
                  err);
  // (max_tokens, max_sequences) as the engine reports them.
  auto sizes = [](kda_engine* engine) {
    std::int64_t tokens = 0, sequences = 0;
    CHECK(kda_engine_max_tokens(engine, &tokens) == KDA_OK);
    CHECK(kda_engine_max_sequences(engine, &sequences) == KDA_OK);
    return std::vector<std::int64_t>{tokens, sequences};
  };
  CHECK(sizes(small) == std::vector<std::int64_t>{64, 6});
  // 6 bf16 slots against 4 fp32 ones.
  CHECK(4 * state_bytes(small) == 3 * state_bytes(tiny));
  overridden.max_sequences = 0;  // the description's
  Handle from_string;
  REQUIRE_MESSAGE(kda_engine_create_from_string(kSpec, &overridden, &from_string.engine, err,
                                                sizeof err) == KDA_OK,
                  err);
  CHECK(sizes(from_string) == std::vector<std::int64_t>{64, 4});
}

KDA_CPU_CASE("creation errors: message in the caller's buffer, no handle") {
  const kda_engine_options options = cpu_options();
  char err[512];
  kda_engine* engine = reinterpret_cast<kda_engine*>(0x1);  // must be reset to NULL on failure

  SUBCASE("bad YAML string") {
    const std::string bad =
        std::string(kSpec).replace(std::string(kSpec).find("num_heads: 2"), 12, "num_heads: many");
    CHECK(kda_engine_create_from_string(bad.c_str(), &options, &engine, err, sizeof err) ==
          KDA_INVALID_ARGUMENT);
    // The loader's message after the C function's name, as every failed call's.
    CHECK(std::string(err).rfind("kda_engine_create_from_string: <yaml string>:5:", 0) == 0);
    CHECK(contains(err, "linear_attn_config.num_heads"));
    CHECK(contains(err, "many"));
    std::uint64_t arena_bytes = 0;
    CHECK(kda_engine_plan_from_string(bad.c_str(), &options, &arena_bytes, nullptr, err,
                                      sizeof err) == KDA_INVALID_ARGUMENT);
    CHECK(std::string(err).rfind("kda_engine_plan_from_string: <yaml string>:5:", 0) == 0);
    CHECK(kda_engine_create_from_string("[1, 2", &options, &engine, err, sizeof err) ==
          KDA_INVALID_ARGUMENT);
    CHECK(std::strlen(err) > 0);
  }
  SUBCASE("missing file") {
    CHECK(kda_engine_create_from_file("/nonexistent/model.yaml", &options, &engine, err,
                                      sizeof err) == KDA_INVALID_ARGUMENT);
    CHECK(std::string(err).rfind("kda_engine_create_from_file: ", 0) == 0);
    CHECK(contains(err, "/nonexistent/model.yaml"));
  }
  SUBCASE("null arguments") {
    CHECK(kda_engine_create_from_string(nullptr, &options, &engine, err, sizeof err) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(err, "yaml_text is null"));
    CHECK(kda_engine_create_from_file(nullptr, &options, &engine, err, sizeof err) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(err, "yaml_path is null"));
    CHECK(kda_engine_create_from_string(kSpec, &options, nullptr, err, sizeof err) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(err, "out_engine is null"));
  }
  SUBCASE("bad options") {
    // Each a change to valid options, and what the refusal names.
    struct Bad {
      void (*change)(kda_engine_options*);
      const char* message;
    };
    const Bad cases[] = {
        // a struct from another version of the header
        {[](kda_engine_options* o) { o->struct_size -= 8; }, "struct_size"},
        // a later, larger version is refused as well: the size is matched exactly
        {[](kda_engine_options* o) { o->struct_size += 8; },
         "options.struct_size is 120, expected 112"},
        {[](kda_engine_options* o) { o->backend = static_cast<kda_backend>(7); },
         "options.backend is 7"},
        {[](kda_engine_options* o) { o->cpu_threads = -3; }, "cpu_threads is -3"},
        {[](kda_engine_options* o) { o->cpu_threads = -1; },
         "options.cpu_threads is -1, expected >= 0"},
        {[](kda_engine_options* o) { o->reserved2 = 1; }, "options.reserved2 is 1, expected 0"},
        {[](kda_engine_options* o) { o->check_pointers = 2; },
         "options.check_pointers is 2, expected 0 or 1"},
        {[](kda_engine_options* o) { o->prefill_schedule = static_cast<kda_prefill_schedule>(4); },
         "options.prefill_schedule is 4"},
        {[](kda_engine_options* o) { o->decode_step = static_cast<kda_decode_step>(6); },
         "options.decode_step is 6"},
        {[](kda_engine_options* o) { o->max_tokens = -1; }, "options.max_tokens is -1"},
        {[](kda_engine_options* o) { o->max_sequences = -2; }, "options.max_sequences is -2"},
        // the loader's range, as for the description's own value
        {[](kda_engine_options* o) { o->max_sequences = (1 << 20) + 1; },
         "runtime.max_sequences: 1048577 (overriding the model description's)"},
        {[](kda_engine_options* o) { o->state_dtype = static_cast<kda_state_dtype>(3); },
         "options.state_dtype is 3"},
        {[](kda_engine_options* o) { o->reserved3 = 1; }, "options.reserved3 is 1, expected 0"},
        // a negative int, as a C caller may store (written as bytes: in C++ the enums' values
        // are 0..INT_MAX)
        {[](kda_engine_options* o) {
           const int minus_one = -1;
           std::memcpy(&o->backend, &minus_one, sizeof minus_one);
         },
         "options.backend is -1"},
        {[](kda_engine_options* o) {
           const int minimum = std::numeric_limits<int>::min();
           std::memcpy(&o->layer_mode, &minimum, sizeof minimum);
         },
         "options.layer_mode is -2147483648"},
    };
    for (const Bad& b : cases) {
      CAPTURE(b.message);
      kda_engine_options bad = options;
      b.change(&bad);
      CHECK(kda_engine_create_from_string(kSpec, &bad, &engine, err, sizeof err) ==
            KDA_INVALID_ARGUMENT);
      CHECK(contains(err, b.message));
      CHECK(engine == nullptr);
    }
  }
  SUBCASE("CUDA without a device; head_dim the CUDA backend cannot run") {
    kda_engine_options cuda = options;
    cuda.backend = KDA_BACKEND_CUDA;
    const kda_status status = kda_engine_create_from_string(kSpec, &cuda, &engine, err, sizeof err);
    if (kda::cuda_device_count() == 0) {
      CHECK(status == KDA_BACKEND_UNAVAILABLE);
      CHECK(contains(err, "no CUDA device"));
    } else {
      CHECK(status == KDA_UNSUPPORTED);  // head_dim 32: the CUDA backend needs 128
    }
  }
  SUBCASE("byte counts overflowing 64 bits: KDA_OVERFLOW") {
    std::string huge = std::string(kSpec);
    huge.replace(huge.find("max_tokens: 128"), 15, "max_tokens: 4611686018427387904");  // 2^62
    CHECK(kda_engine_create_from_string(huge.c_str(), &options, &engine, err, sizeof err) ==
          KDA_OVERFLOW);
    CHECK(contains(err, "overflow"));
  }
#if !KDA_UNDER_ASAN  // ASan aborts on an allocation this large instead of returning NULL
  SUBCASE("an arena that cannot be allocated: KDA_OUT_OF_MEMORY, no crash") {
    std::string huge = std::string(kSpec);
    huge.replace(huge.find("num_heads: 2"), 12, "num_heads: 1024");
    huge.replace(huge.find("head_dim: 32"), 12, "head_dim: 1024");
    huge.replace(huge.find("max_sequences: 4"), 16, "max_sequences: 1048576");
    huge.replace(huge.find("kda_layers: [1, 2, 4]"), 21, "kda_layers: [1]");
    // 4 PiB of state: beyond any address space, so the one allocation fails cleanly.
    CHECK(kda_engine_create_from_string(huge.c_str(), &options, &engine, err, sizeof err) ==
          KDA_OUT_OF_MEMORY);
    CHECK(contains(err, "cannot allocate the arena"));
  }
#endif
  SUBCASE("the message is truncated to the buffer, always terminated") {
    char small[8];
    std::memset(small, 'x', sizeof small);
    CHECK(kda_engine_create_from_string("hidden_size: many", &options, &engine, small,
                                        sizeof small) == KDA_INVALID_ARGUMENT);
    CHECK(std::strlen(small) == sizeof small - 1);
    CHECK(std::string(small) == "kda_eng");
    // No buffer at all is allowed.
    CHECK(kda_engine_create_from_string("hidden_size: many", &options, &engine, nullptr, 0) ==
          KDA_INVALID_ARGUMENT);
  }
  CHECK(engine == nullptr);
}

KDA_CPU_CASE("a forced prefill schedule is accepted") {
  // On the CPU backend the schedule has no effect; on CUDA it picks the path (the operator's
  // tests check the paths and their results).
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  char err[256] = {};
  for (kda_prefill_schedule schedule :
       {KDA_PREFILL_SCHEDULE_TWO_PHASE, KDA_PREFILL_SCHEDULE_PIPELINED}) {
    options.prefill_schedule = schedule;
    kda_engine* e = nullptr;
    REQUIRE(kda_engine_create_from_string(kSpec, &options, &e, err, sizeof err) == KDA_OK);
    CHECK(e != nullptr);
    CHECK(kda_engine_destroy(e) == KDA_OK);
  }
}

KDA_CPU_CASE("every decode step is accepted") {
  // The CPU layer has one way to run a step; on CUDA the choice picks the kernels (the layer's
  // tests compare them).
  kda_engine_options options;
  REQUIRE(kda_engine_options_init(&options) == KDA_OK);
  char err[256] = {};
  for (kda_decode_step step :
       {KDA_DECODE_STEP_AUTO, KDA_DECODE_STEP_ONE_LAUNCH, KDA_DECODE_STEP_FUSED,
        KDA_DECODE_STEP_FUSED_AFTER_GEMMS, KDA_DECODE_STEP_SEPARATE}) {
    options.decode_step = step;
    kda_engine* e = nullptr;
    REQUIRE(kda_engine_create_from_string(kSpec, &options, &e, err, sizeof err) == KDA_OK);
    CHECK(e != nullptr);
    CHECK(kda_engine_destroy(e) == KDA_OK);
  }
}

// options.layer_mode replaces the description's runtime.layers, in creation and in the plan alike;
// a value outside the enum is refused, naming the field.
KDA_CPU_CASE("options.layer_mode: whole layers or cores, as the plan says") {
  const char* const whole_spec =
      "name: c-layer-mode\nhidden_size: 64\nnum_hidden_layers: 1\n"
      "linear_attn_config: {num_heads: 2, head_dim: 32, kda_layers: [1], full_attn_layers: [], "
      "gate: softplus}\nruntime: {max_tokens: 32, max_sequences: 2}\n";
  std::uint64_t arena[3] = {};
  const kda_layer_mode modes[3] = {KDA_LAYER_MODE_DEFAULT, KDA_LAYER_MODE_WHOLE,
                                   KDA_LAYER_MODE_CORE};
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    kda_engine_options options = cpu_options();
    options.layer_mode = modes[i];
    char err[512] = "";
    std::uint64_t planned = 0;
    REQUIRE(kda_engine_plan_from_string(whole_spec, &options, &planned, nullptr, err, sizeof err) ==
            KDA_OK);
    Handle e;
    REQUIRE(kda_engine_create_from_string(whole_spec, &options, &e.engine, err, sizeof err) ==
            KDA_OK);
    int whole = -1;
    REQUIRE(kda_engine_whole_layers(e, &whole) == KDA_OK);
    CHECK(whole == (modes[i] == KDA_LAYER_MODE_CORE ? 0 : 1));
    REQUIRE(kda_engine_arena_bytes(e, &arena[i]) == KDA_OK);
    CHECK(planned == arena[i]);
  }
  CHECK(arena[0] == arena[1]);
  CHECK(arena[2] < arena[1]);  // cores alone: no weights of the projections, no conv states
  kda_engine_options options = cpu_options();
  char err[512] = "";
  kda_engine* e = nullptr;
  options.layer_mode = static_cast<kda_layer_mode>(7);
  CHECK(kda_engine_create_from_string(whole_spec, &options, &e, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(err).find("options.layer_mode is 7, expected KDA_LAYER_MODE_DEFAULT, _WHOLE "
                              "or _CORE") != std::string::npos);
  CHECK(e == nullptr);
}

// options.poison_arena (EngineOptions::poison_arena): 0 or 1, anything else refused naming it; an
// engine with it computes the same bits as one without (a prefill of two sequences and a decode
// step with a padding row, every layer).
KDA_CPU_CASE("options.poison_arena: the same outputs with the arena poisoned, 0 or 1 only") {
  std::vector<std::uint16_t> outs[2];
  for (const int poison : {0, 1}) {
    CAPTURE(poison);
    kda_engine_options options = cpu_options(5);
    options.poison_arena = poison;
    char err[512] = "";
    Handle e;
    REQUIRE(kda_engine_create_from_string(kMatrixSpec, &options, &e.engine, err, sizeof err) ==
            KDA_OK);
    int slots[2];
    for (int& slot : slots) REQUIRE(kda_engine_acquire_slot(e, &slot) == KDA_OK);
    kda::test::Rng rng(6);
    const std::vector<std::uint16_t> x = kda::test::random_bf16(rng, 12 * E, 1.0);
    const std::int64_t cu[3] = {0, 5, 12};
    const int rows[3] = {slots[1], -1, slots[0]};
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<std::uint16_t> prefill(x.size(), 0x7FC1),
          step(static_cast<std::size_t>(3 * E), 0x7FC1);
      REQUIRE(kda_engine_prefill_hidden(e, layer, x.data(), prefill.data(), slots, 2, cu) ==
              KDA_OK);
      REQUIRE(kda_engine_decode_hidden(e, layer, x.data(), step.data(), rows, 3, 1) == KDA_OK);
      CHECK(kda::test::rows_of(step, E, 1, 2) == std::vector<std::uint16_t>(E, 0));
      outs[poison].insert(outs[poison].end(), prefill.begin(), prefill.end());
      outs[poison].insert(outs[poison].end(), step.begin(), step.end());
    }
  }
  CHECK(outs[0] == outs[1]);
  kda_engine_options options = cpu_options();
  options.poison_arena = 2;
  char err[512] = "";
  kda_engine* e = nullptr;
  CHECK(kda_engine_create_from_string(kMatrixSpec, &options, &e, err, sizeof err) ==
        KDA_INVALID_ARGUMENT);
  CHECK(std::string(err).find("options.poison_arena is 2, expected 0 or 1") != std::string::npos);
  CHECK(e == nullptr);
}

KDA_CPU_CASE("a NULL handle: KDA_INVALID_ARGUMENT from every call, a message, destroy is a no-op") {
  int i = 0;
  std::int64_t n = 0;
  std::uint64_t u = 0;
  std::size_t length = 0;
  kda_backend backend = KDA_BACKEND_DEFAULT;
  std::uint16_t data[4] = {};
  const int slot = 0;
  const std::int64_t cu[2] = {0, 1};
  CHECK(kda_engine_num_layers(nullptr, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_num_heads(nullptr, &n) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_head_dim(nullptr, &n) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_backend(nullptr, &backend) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_max_tokens(nullptr, &n) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_max_sequences(nullptr, &n) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_free_slots(nullptr, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_model_layer(nullptr, 0, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_conv_width(nullptr, &i) == KDA_INVALID_ARGUMENT);
  kda_state_dtype dtype = KDA_STATE_DTYPE_DEFAULT;
  CHECK(kda_engine_state_dtype(nullptr, &dtype) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_tensor_parallel(nullptr, &i, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_max_verify_tokens(nullptr, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_record_regions(nullptr, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_null_slot(nullptr, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_slot_in_use(nullptr, 0, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_arena_bytes(nullptr, &u) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_plan_json(nullptr, nullptr, 0, &length) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_acquire_slot(nullptr, &i) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_release_slot(nullptr, 0) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_reset_slot(nullptr, 0) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_copy_slot(nullptr, 0, 1) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_copy_slots(nullptr, 0, nullptr, nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_reset_slots(nullptr, 0, nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_sequence_state_bytes(nullptr, nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_read_sequence_state(nullptr, 0, nullptr, 0) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_write_sequence_state(nullptr, 0, nullptr, 0) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_prefill(nullptr, 0, data, data, data, data, data, data, &slot, 1, cu) ==
        KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_decode(nullptr, 0, data, data, data, data, data, data, &slot, 1, 1) ==
        KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_synchronize(nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(nullptr), "null"));
  CHECK(kda_engine_destroy(nullptr) == KDA_OK);
}

KDA_CPU_CASE(
    "errors on a handle: null outputs, layer and slot out of range, counts, cleared on OK") {
  Handle handle;
  create(&handle);
  const Activations x(8, 2, 32, 5);  // host memory: a CPU handle
  std::vector<std::uint16_t> out(8 * 2 * 32);
  const std::uint16_t* q = x.q.data();
  const std::uint16_t* k = x.k.data();
  const std::uint16_t* v = x.v.data();
  const std::uint16_t* g = x.g.data();
  const std::uint16_t* beta = x.beta.data();
  const std::int64_t cu[2] = {0, 8};

  SUBCASE("null output pointers of queries") {
    CHECK(kda_engine_num_layers(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_num_layers: out is null");
    CHECK(kda_engine_num_heads(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_head_dim(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_backend(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_max_tokens(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_max_sequences(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_free_slots(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_model_layer(handle, 0, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_conv_width(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_state_dtype(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_max_verify_tokens(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_record_regions(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_null_slot(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_slot_in_use(handle, 0, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_arena_bytes(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_arena_bytes: out is null");
    CHECK(kda_engine_acquire_slot(handle, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "out_slot is null"));
    // A successful call clears the message.
    int layers = 0;
    CHECK(kda_engine_num_layers(handle, &layers) == KDA_OK);
    CHECK(last_error(handle).empty());
  }
  SUBCASE("slots: out of range, not acquired, all in use") {
    CHECK(kda_engine_release_slot(handle, 0) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "slot 0 is not acquired"));
    CHECK(kda_engine_reset_slot(handle, 9) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "slot 9"));
    CHECK(kda_engine_release_slot(handle, -1) == KDA_INVALID_ARGUMENT);
    int slots[4];
    for (int& slot : slots) REQUIRE(kda_engine_acquire_slot(handle, &slot) == KDA_OK);
    CHECK(slots[0] == 0);
    CHECK(slots[3] == 3);
    int free_slots = -1;
    CHECK(kda_engine_free_slots(handle, &free_slots) == KDA_OK);
    CHECK(free_slots == 0);
    int fifth = -7;
    CHECK(kda_engine_acquire_slot(handle, &fifth) == KDA_INVALID_ARGUMENT);
    CHECK(fifth == -7);  // untouched on failure
    CHECK(contains(last_error(handle), "state slots are in use"));
    CHECK(kda_engine_release_slot(handle, 2) == KDA_OK);
    CHECK(kda_engine_reset_slot(handle, 1) == KDA_OK);
    CHECK(kda_engine_acquire_slot(handle, &fifth) == KDA_OK);
    CHECK(fifth == 2);
    // Copies between acquired slots only, and never a slot onto itself.
    // The copy goes from src to dst: slot 0 given states of its own, slot 1 then holds them.
    std::uint64_t block_bytes = 0;
    REQUIRE(kda_engine_sequence_state_bytes(handle, &block_bytes) == KDA_OK);
    std::vector<unsigned char> written(block_bytes), copied(block_bytes, 0xFF);
    REQUIRE(kda_engine_read_sequence_state(handle, 0, written.data(), block_bytes) == KDA_OK);
    std::fill(written.begin() + 64, written.end(), std::uint8_t{0x3F});  // past the header
    REQUIRE(kda_engine_write_sequence_state(handle, 0, written.data(), block_bytes) == KDA_OK);
    CHECK(kda_engine_copy_slot(handle, 0, 1) == KDA_OK);
    REQUIRE(kda_engine_read_sequence_state(handle, 1, copied.data(), block_bytes) == KDA_OK);
    CHECK(copied == written);
    CHECK(kda_engine_copy_slots(handle, -1, slots, slots) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "-1 pairs, expected 0..4"));
    CHECK(kda_engine_copy_slot(handle, -1, 1) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "kda_engine_copy_slot: src slot -1 is not acquired"));
    CHECK(kda_engine_release_slot(handle, 3) == KDA_OK);
    CHECK(kda_engine_copy_slot(handle, 0, 3) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "dst slot 3 is not acquired"));
    CHECK(kda_engine_copy_slot(handle, 1, 1) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "slot 1 is both a source (pair 0) and a destination"));
    CHECK(kda_engine_copy_slots(handle, 0, nullptr, nullptr) == KDA_OK);  // nothing to copy
    CHECK(kda_engine_copy_slots(handle, 1, nullptr, nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "copy_slots: src or dst is null"));
    const std::int32_t to_reset[2] = {0, -1};
    CHECK(kda_engine_reset_slots(handle, 2, to_reset) == KDA_OK);
    const std::int32_t released[1] = {3};
    CHECK(kda_engine_reset_slots(handle, 1, released) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "reset_slots: entry 0 names slot 3"));
    // A sequence's states through host memory: a block written into slot 0 and read back.
    std::uint64_t bytes = 0;
    REQUIRE(kda_engine_sequence_state_bytes(handle, &bytes) == KDA_OK);
    CHECK(bytes > 0);
    std::vector<unsigned char> block(bytes, 0x5A), again(bytes), before(bytes);
    // A block without the header read_sequence_state writes: refused, nothing written.
    CHECK(kda_engine_read_sequence_state(handle, 0, before.data(), bytes) == KDA_OK);
    CHECK(kda_engine_write_sequence_state(handle, 0, block.data(), bytes) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "does not begin with a sequence-state header"));
    CHECK(kda_engine_read_sequence_state(handle, 0, block.data(), bytes) == KDA_OK);
    CHECK(block == before);
    CHECK(std::string(reinterpret_cast<const char*>(block.data()), 8) == "KDASTATE");
    std::fill(block.begin() + 64, block.end(), static_cast<unsigned char>(0x5A));
    CHECK(kda_engine_write_sequence_state(handle, 0, block.data(), bytes) == KDA_OK);
    CHECK(kda_engine_read_sequence_state(handle, 0, again.data(), bytes) == KDA_OK);
    CHECK(again == block);
    CHECK(kda_engine_read_sequence_state(handle, 0, again.data(), bytes + 1) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "(sequence_state_bytes)"));
    CHECK(kda_engine_write_sequence_state(handle, 3, block.data(), bytes) == KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_sequence_state_bytes(handle, nullptr) == KDA_INVALID_ARGUMENT);
  }
  SUBCASE("prefill and decode arguments") {
    int slot = -1;
    REQUIRE(kda_engine_acquire_slot(handle, &slot) == KDA_OK);
    CHECK(kda_engine_prefill(handle, 3, q, k, v, g, beta, out.data(), &slot, 1, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "KDA layer 3 is out of range [0, 3)"));
    CHECK(kda_engine_prefill(handle, -1, q, k, v, g, beta, out.data(), &slot, 1, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_decode(handle, 3, q, k, v, g, beta, out.data(), &slot, 1, 1) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "KDA layer 3 is out of range"));
    CHECK(kda_engine_prefill(handle, 0, nullptr, k, v, g, beta, out.data(), &slot, 1, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_prefill: q is null");
    // Null tensors are named by the C function before the engine sees the call: a token held
    // needs them (no context group here either), and so does a hidden decode on a core engine.
    CHECK(kda_engine_prefill_context_parallel(handle, 0, nullptr, nullptr, nullptr, nullptr,
                                              nullptr, nullptr, slot, 1) == KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_prefill_context_parallel: q is null");
    CHECK(kda_engine_decode_hidden(handle, 0, nullptr, out.data(), &slot, 1, 1) ==
          KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_decode_hidden: hidden is null");
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, nullptr, &slot, 1, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_prefill: out is null");
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, out.data(), nullptr, 1, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, out.data(), &slot, 1, nullptr) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "cu_seqlens is null"));
    CHECK(kda_engine_decode(handle, 0, q, k, v, g, nullptr, out.data(), &slot, 1, 1) ==
          KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_decode: beta is null");
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, out.data(), &slot, 0, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "num_sequences is 0, expected 1..4"));
    CHECK(kda_engine_decode(handle, 0, q, k, v, g, beta, out.data(), &slot, 5, 1) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "batch is 5, expected 1..4"));
    CHECK(kda_engine_decode(handle, 0, q, k, v, g, beta, out.data(), &slot, 1, 17) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "tokens 17"));
    // A slot that is not acquired, and cu_seqlens the engine rejects.
    const int unacquired = 3;
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, out.data(), &unacquired, 1, cu) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "slot 3, which is not an acquired slot"));
    // The engine's message after the C function's name (the C API's own errors begin with it).
    CHECK(last_error(handle).rfind("kda_engine_prefill: prefill: ", 0) == 0);
    CHECK(kda_engine_decode(handle, 0, q, k, v, g, beta, out.data(), &unacquired, 1, 1) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "slot 3, which is not an acquired slot"));
    const std::int64_t too_long[2] = {0, 129};  // max_tokens is 128
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, out.data(), &slot, 1, too_long) ==
          KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "129 tokens exceed runtime.max_tokens 128"));
    // The handle still works after all that.
    CHECK(kda_engine_prefill(handle, 0, q, k, v, g, beta, out.data(), &slot, 1, cu) == KDA_OK);
    CHECK(last_error(handle).empty());
    CHECK(kda_engine_synchronize(handle) == KDA_OK);
  }
}

KDA_CPU_CASE("plan JSON: size query, buffer too small reports the size needed, exact fit") {
  Handle handle;
  create(&handle);
  std::size_t length = 0;
  REQUIRE(kda_engine_plan_json(handle, nullptr, 0, &length) == KDA_OK);
  REQUIRE(length > 100);
  const std::string expected =
      Engine::plan_for(kda::engine::parse_model_spec(kSpec, "t.yaml"), kda::Backend::kCpu)
          .to_json();
  CHECK(length == expected.size());

  std::vector<char> buffer(length + 1, 'x');
  std::size_t reported = 0;
  CHECK(kda_engine_plan_json(handle, buffer.data(), length, &reported) == KDA_INVALID_ARGUMENT);
  CHECK(reported == length);
  CHECK(buffer[0] == '\0');  // no half JSON
  CHECK(buffer[1] == 'x');
  CHECK(contains(last_error(handle), "needs " + std::to_string(length + 1) + " bytes"));
  CHECK(kda_engine_plan_json(handle, buffer.data(), 1, nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(kda_engine_plan_json(handle, nullptr, 16, &reported) == KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(handle), "buffer"));

  reported = 0;
  CHECK(kda_engine_plan_json(handle, buffer.data(), buffer.size(), &reported) == KDA_OK);
  CHECK(reported == length);
  CHECK(std::string(buffer.data()) == expected);
  CHECK(last_error(handle).empty());
}

namespace {

// The C++ Engine the C API's handles are compared to: kMatrixSpec on the CPU, two threads, the same
// seed.
Engine cpp_twin(std::uint64_t seed) {
  EngineOptions options;
  options.backend = kda::engine::BackendChoice::kCpu;
  options.cpu_threads = 2;
  options.seed = seed;
  return Engine(kda::engine::parse_model_spec(kMatrixSpec, "t.yaml"), options);
}

// `elems` bf16 values on a runner's backend, all `value`, brought back by download().
struct Out {
  Memory memory;
  Out(const Runner& runner, std::size_t elems, std::uint16_t value)
      : memory(Memory::from(runner, std::vector<std::uint16_t>(elems, value))) {}
  void* get() const { return memory.get(); }
  std::vector<std::uint16_t> download(kda_engine* engine) const {
    REQUIRE(kda_engine_synchronize(engine) == KDA_OK);
    return memory.download<std::uint16_t>();
  }
};

kda_status prefill(kda_engine* engine, int layer, const LayerInputs& in, void* out,
                   const int* slots, int n, const std::int64_t* cu) {
  return kda_engine_prefill(engine, layer, in.q, in.k, in.v, in.g, in.beta, out, slots, n, cu);
}
kda_status decode(kda_engine* engine, int layer, const LayerInputs& in, void* out, const int* slots,
                  int n, int tokens) {
  return kda_engine_decode(engine, layer, in.q, in.k, in.v, in.g, in.beta, out, slots, n, tokens);
}

}  // namespace

KDA_MATRIX_CASE("prefill + decode through the C API equal the C++ Engine on the CPU") {
  const std::uint64_t seed = 23;
  Handle handle;
  create(&handle, kMatrixSpec, seed, backend_of(runner));
  Engine engine = cpp_twin(seed);
  kda_backend backend = KDA_BACKEND_DEFAULT;
  REQUIRE(kda_engine_backend(handle, &backend) == KDA_OK);
  CHECK(backend == backend_of(runner));
  // The device status word is planned on CUDA only (the CPU reports at once).
  std::size_t length = 0;
  REQUIRE(kda_engine_plan_json(handle, nullptr, 0, &length) == KDA_OK);
  std::string json(length + 1, '\0');
  REQUIRE(kda_engine_plan_json(handle, json.data(), json.size(), nullptr) == KDA_OK);
  CHECK((json.find("engine.device_status") != std::string::npos) ==
        (runner.backend() == kda::Backend::kCuda));

  // Three sequences of 150, 1 and 52 tokens on slots 0, 1, 2, both engines.
  int c_slots[3];
  for (int& slot : c_slots) REQUIRE(kda_engine_acquire_slot(handle, &slot) == KDA_OK);
  const std::vector<int> slots = {engine.acquire_slot(), engine.acquire_slot(),
                                  engine.acquire_slot()};
  REQUIRE(slots == std::vector<int>(c_slots, c_slots + 3));
  const std::vector<std::int64_t> cu = {0, 150, 151, 203};
  const Activations x(203, H, D, seed + 1);
  const OnBackend x_in(runner, x);
  for (int layer = 0; layer < engine.num_layers(); ++layer) {
    CAPTURE(layer);
    Out out_c(runner, x.out_elems(), 0);
    std::vector<std::uint16_t> out_cpp(x.out_elems(), 1);
    REQUIRE_MESSAGE(
        prefill(handle, layer, x_in.inputs(), out_c.get(), c_slots, 3, cu.data()) == KDA_OK,
        last_error(handle));
    engine.prefill(layer, x.host_inputs(), out_cpp.data(), slots, cu);
    CHECK(deviation(out_c.download(handle), out_cpp) <= allowed(runner, 5e-3));
  }

  // Decode: three steps of two tokens, rows {slot 2, padding, slot 0}; the padding row's out stays
  // as it was in both.
  const int c_rows[3] = {c_slots[2], -1, c_slots[0]};
  const std::vector<int> rows = {slots[2], -1, slots[0]};
  const std::size_t row = static_cast<std::size_t>(2 * H * D);
  for (int step = 0; step < 3; ++step) {
    const Activations t(3 * 2, H, D, seed + 10 + static_cast<std::uint64_t>(step));
    const OnBackend t_in(runner, t);
    for (int layer = 0; layer < engine.num_layers(); ++layer) {
      CAPTURE(step);
      CAPTURE(layer);
      Out out_c(runner, t.out_elems(), 0x7FC1);
      std::vector<std::uint16_t> out_cpp(t.out_elems(), 0x7FC1);
      REQUIRE_MESSAGE(decode(handle, layer, t_in.inputs(), out_c.get(), c_rows, 3, 2) == KDA_OK,
                      last_error(handle));
      engine.decode(layer, t.host_inputs(), out_cpp.data(), rows, 2);
      const std::vector<std::uint16_t> got = out_c.download(handle);
      CHECK(deviation(kda::test::without_rows(got, row, 1, 2),
                      kda::test::without_rows(out_cpp, row, 1, 2)) <= allowed(runner, 5e-3));
      // The padding row untouched, in both.
      CHECK(kda::test::rows_of(got, row, 1, 2) == std::vector<std::uint16_t>(row, 0x7FC1));
      CHECK(kda::test::rows_of(out_cpp, row, 1, 2) == std::vector<std::uint16_t>(row, 0x7FC1));
      CHECK(kda::test::all_finite(kda::test::rows_of(got, row, 0, 1)));  // real rows written
      CHECK(kda::test::all_finite(kda::test::rows_of(got, row, 2, 3)));
    }
  }
  CHECK_MESSAGE(kda_engine_check_device_status(handle) == KDA_OK, last_error(handle));

  // reset_slot through the C API zeroes the state like the C++ one: the next decode agrees again.
  REQUIRE(kda_engine_reset_slot(handle, c_slots[0]) == KDA_OK);
  engine.reset_slot(slots[0]);
  const Activations one(1, H, D, seed + 99);
  const OnBackend one_in(runner, one);
  Out out_c(runner, one.out_elems(), 0), out_unreset(runner, one.out_elems(), 0);
  std::vector<std::uint16_t> out_cpp(one.out_elems());
  REQUIRE(decode(handle, 0, one_in.inputs(), out_c.get(), c_slots, 1, 1) == KDA_OK);
  engine.decode(0, one.host_inputs(), out_cpp.data(), {slots[0]}, 1);
  const std::vector<std::uint16_t> reset = out_c.download(handle);
  CHECK(deviation(reset, out_cpp) <= allowed(runner, 5e-3));
  // ... and differs from a slot that kept its state (the reset did something).
  REQUIRE(decode(handle, 0, one_in.inputs(), out_unreset.get(), &c_slots[1], 1, 1) == KDA_OK);
  CHECK(out_unreset.download(handle) != reset);

  for (const int slot : c_slots) CHECK(kda_engine_release_slot(handle, slot) == KDA_OK);
  int free_slots = 0;
  CHECK(kda_engine_free_slots(handle, &free_slots) == KDA_OK);
  CHECK(free_slots == 4);
}

KDA_MATRIX_CASE(
    "whole layers through the C API: prefill_hidden + decode_hidden equal the C++ Engine on the "
    "CPU") {
  const std::uint64_t seed = 31;
  Handle handle;
  create(&handle, kMatrixSpec, seed, backend_of(runner));
  Engine engine = cpp_twin(seed);
  int whole = -1;
  std::int64_t hidden_size = 0;
  REQUIRE(kda_engine_whole_layers(handle, &whole) == KDA_OK);
  REQUIRE(kda_engine_hidden_size(handle, &hidden_size) == KDA_OK);
  CHECK(whole == 1);
  CHECK(hidden_size == E);

  int c_slots[2];
  for (int& slot : c_slots) REQUIRE(kda_engine_acquire_slot(handle, &slot) == KDA_OK);
  const std::vector<int> slots = {engine.acquire_slot(), engine.acquire_slot()};
  const std::vector<std::int64_t> cu = {0, 9, 20};
  kda::test::Rng rng(seed);
  const std::vector<std::uint16_t> x = kda::test::random_bf16(rng, 20 * E, 1.0);
  const Memory x_in = Memory::from(runner, x);
  for (int layer = 0; layer < engine.num_layers(); ++layer) {
    CAPTURE(layer);
    Out out_c(runner, x.size(), 0);
    std::vector<std::uint16_t> out_cpp(x.size(), 1);
    REQUIRE_MESSAGE(kda_engine_prefill_hidden(handle, layer, x_in.get(), out_c.get(), c_slots, 2,
                                              cu.data()) == KDA_OK,
                    last_error(handle));
    engine.prefill_hidden(layer, x.data(), out_cpp.data(), slots, cu);
    CHECK(deviation(out_c.download(handle), out_cpp) <= allowed(runner, 1e-2));
    // A decode step of two tokens on rows {slot 1, padding, slot 0}: the padding row's out zeros.
    const int c_rows[3] = {c_slots[1], -1, c_slots[0]};
    Out step_c(runner, static_cast<std::size_t>(6 * E), 1);
    std::vector<std::uint16_t> step_cpp(static_cast<std::size_t>(6 * E), 1);
    kda_decode_step ran = KDA_DECODE_STEP_MAX_ENUM_;
    REQUIRE(kda_engine_decode_step_ran(handle, layer, &ran) == KDA_OK);
    CHECK(ran == KDA_DECODE_STEP_AUTO);  // no decode step yet
    REQUIRE(kda_engine_decode_hidden(handle, layer, x_in.get(), step_c.get(), c_rows, 3, 2) ==
            KDA_OK);
    // Three rows of two tokens: the separate kernels on CUDA (auto's choice); the CPU has none.
    REQUIRE(kda_engine_decode_step_ran(handle, layer, &ran) == KDA_OK);
    CHECK(ran == (runner.backend() == kda::Backend::kCuda ? KDA_DECODE_STEP_SEPARATE
                                                          : KDA_DECODE_STEP_AUTO));
    engine.decode_hidden(layer, x.data(), step_cpp.data(), {slots[1], -1, slots[0]}, 2);
    const std::vector<std::uint16_t> got = step_c.download(handle);
    CHECK(deviation(kda::test::rows_of(got, E, 0, 2), kda::test::rows_of(step_cpp, E, 0, 2)) <=
          allowed(runner, 1e-2));
    CHECK(deviation(kda::test::rows_of(got, E, 4, 6), kda::test::rows_of(step_cpp, E, 4, 6)) <=
          allowed(runner, 1e-2));
    CHECK(kda::test::rows_of(got, E, 2, 4) == std::vector<std::uint16_t>(2 * E, 0));
  }

  // Errors: a NULL hidden, too many tokens per decode row; a core-only engine has no hidden calls.
  Out out(runner, static_cast<std::size_t>(20 * E), 0);
  CHECK(kda_engine_decode_hidden(handle, 0, nullptr, out.get(), c_slots, 1, 1) ==
        KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(handle), "hidden"));
  CHECK(kda_engine_decode_hidden(handle, 0, x_in.get(), out.get(), c_slots, 1, 17) ==
        KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(handle), "tokens 17"));
  kda_decode_step ran = KDA_DECODE_STEP_MAX_ENUM_;
  CHECK(kda_engine_decode_step_ran(handle, 0, nullptr) == KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(handle), "out is null"));
  CHECK(kda_engine_decode_step_ran(handle, 2, &ran) == KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(handle), "KDA layer 2 is out of range"));
  CHECK(ran == KDA_DECODE_STEP_MAX_ENUM_);
  const std::string core_yaml = std::string(kMatrixSpec) + "  layers: core\n";
  Handle core;
  create(&core, core_yaml.c_str(), seed, backend_of(runner));
  REQUIRE(kda_engine_whole_layers(core, &whole) == KDA_OK);
  CHECK(whole == 0);
  REQUIRE(kda_engine_decode_step_ran(core, 0, &ran) == KDA_OK);
  CHECK(ran == KDA_DECODE_STEP_AUTO);
  int slot = -1;
  REQUIRE(kda_engine_acquire_slot(core, &slot) == KDA_OK);
  CHECK(kda_engine_prefill_hidden(core, 0, x_in.get(), out.get(), &slot, 1, cu.data()) ==
        KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(core), "runtime.layers: core"));
}

KDA_MATRIX_CASE("check_pointers = 0 gives bitwise the same results as the default") {
  Handle checked, unchecked;
  create(&checked, kMatrixSpec, 29, backend_of(runner));
  create(&unchecked, kMatrixSpec, 29, backend_of(runner), 0);
  const std::int64_t T = 77;
  const std::int64_t cu[3] = {0, 33, T};
  int a[2], b[2];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(kda_engine_acquire_slot(checked, &a[i]) == KDA_OK);
    REQUIRE(kda_engine_acquire_slot(unchecked, &b[i]) == KDA_OK);
  }
  const Activations x(T, H, D, 47);
  const OnBackend in(runner, x);
  Out out_a(runner, x.out_elems(), 0), out_b(runner, x.out_elems(), 1);
  for (int layer = 0; layer < 2; ++layer) {
    REQUIRE(prefill(checked, layer, in.inputs(), out_a.get(), a, 2, cu) == KDA_OK);
    REQUIRE(prefill(unchecked, layer, in.inputs(), out_b.get(), b, 2, cu) == KDA_OK);
    REQUIRE(decode(checked, layer, in.inputs(), out_a.get(), a, 2, 1) == KDA_OK);
    REQUIRE(decode(unchecked, layer, in.inputs(), out_b.get(), b, 2, 1) == KDA_OK);
  }
  CHECK(out_a.download(checked) == out_b.download(unchecked));
  CHECK(kda_engine_check_device_status(unchecked) == KDA_OK);
}

KDA_CUDA_CASE(
    "host pointers and short buffers come back as KDA_INVALID_ARGUMENT with a message, writing "
    "nothing") {
  Handle gpu;
  create(&gpu, kMatrixSpec, 29, KDA_BACKEND_CUDA);
  int slot = -1;
  REQUIRE(kda_engine_acquire_slot(gpu, &slot) == KDA_OK);
  const std::int64_t T = 40;
  const Activations x(T, H, D, 43);
  const OnBackend in(cuda, x);
  Out out(cuda, x.out_elems(), 0xFFFF);
  const std::int64_t cu[2] = {0, T};

  // q on the host.
  LayerInputs host_q = in.inputs();
  host_q.q = x.q.data();
  CHECK(prefill(gpu, 0, host_q, out.get(), &slot, 1, cu) == KDA_INVALID_ARGUMENT);
  CHECK_MESSAGE(contains(last_error(gpu), "q points to unregistered host memory"), last_error(gpu));
  // out one token short of T (no guard bytes: the allocation ends where the buffer does).
  Memory short_out(cuda, static_cast<std::size_t>((T - 1) * H * D) * 2, 0);
  CHECK(prefill(gpu, 0, in.inputs(), short_out.get(), &slot, 1, cu) == KDA_INVALID_ARGUMENT);
  CHECK_MESSAGE(contains(last_error(gpu), "out needs"), last_error(gpu));
  // Decode with beta on the host.
  LayerInputs host_beta = in.inputs();
  host_beta.beta = x.beta.data();
  CHECK(decode(gpu, 0, host_beta, out.get(), &slot, 1, 1) == KDA_INVALID_ARGUMENT);
  CHECK(contains(last_error(gpu), "beta points to"));
  // Nothing was written, and the engine still works.
  CHECK(out.download(gpu) == std::vector<std::uint16_t>(x.out_elems(), 0xFFFF));
  CHECK(prefill(gpu, 0, in.inputs(), out.get(), &slot, 1, cu) == KDA_OK);
  CHECK(kda_engine_check_device_status(gpu) == KDA_OK);
  CHECK(last_error(gpu).empty());
  CHECK(out.memory.guards_intact());
}

// ---- communicators ------------------------------------------------------------------------------

namespace {

// Two KDA layers of 4 heads of 16, whole layers or cores, on tp_size ranks.
std::string parallel_spec(int tp_size, int tp_rank, const char* layers) {
  return "name: c-parallel\nhidden_size: 64\nnum_hidden_layers: 2\n"
         "linear_attn_config: {num_heads: 4, head_dim: 16, kda_layers: [1, 2], "
         "full_attn_layers: [], gate: softplus}\n"
         "runtime: {max_tokens: 64, max_sequences: 2, layers: " +
         std::string(layers) + ", tp_size: " + std::to_string(tp_size) +
         ", tp_rank: " + std::to_string(tp_rank) + "}\n";
}

kda_status create_with(const std::string& yaml, const kda_communicator* communicator,
                       const kda_communicator* context_group, kda_engine** engine,
                       std::string* message) {
  kda_engine_options options;
  if (kda_engine_options_init(&options) != KDA_OK) return KDA_INTERNAL;
  options.backend = KDA_BACKEND_CPU;
  options.cpu_threads = 1;
  options.seed = 5;
  options.communicator = communicator;
  options.context_group = context_group;
  char err[512] = "";
  const kda_status status =
      kda_engine_create_from_string(yaml.c_str(), &options, engine, err, sizeof err);
  *message = err;
  return status;
}

// Every rank's thread ended without an exception (errors) and without a failed call (failures).
void check_ranks(const std::vector<std::string>& errors, const std::vector<std::string>& failures) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CHECK(errors[r].empty());
    CHECK(failures[r].empty());
  }
}

// Whether a's rows [0, count) are b's, bit for bit.
bool same_prefix(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b,
                 std::size_t count) {
  return std::equal(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(count), b.begin());
}

// A slot's sequence state block (kda_engine_read_sequence_state) cut at its layout: per KDA layer
// the fp32 recurrent state [H, V, K], then with whole layers the q, k and v conv states (bf16
// bits).
struct SequenceStates {
  std::vector<std::vector<float>> recurrent;
  std::vector<std::vector<std::uint16_t>> conv;  // the layers' three conv states, one after another
};

SequenceStates read_sequence_states(kda_engine* engine, int slot) {
  std::uint64_t bytes = 0;
  REQUIRE(kda_engine_sequence_state_bytes(engine, &bytes) == KDA_OK);
  std::vector<unsigned char> block(bytes);
  REQUIRE(kda_engine_read_sequence_state(engine, slot, block.data(), bytes) == KDA_OK);
  std::uint32_t f[5];  // layers, heads, head_dim, conv width, state value bytes (from byte 24)
  std::memcpy(f, block.data() + 24, sizeof f);
  REQUIRE(f[4] == 4);
  const std::size_t state = std::size_t{f[1]} * f[2] * f[2];
  const std::size_t conv = f[3] == 0 ? 0 : 3 * std::size_t{f[1]} * f[2] * (f[3] - 1);
  REQUIRE(bytes == 64 + f[0] * (state * 4 + conv * 2));
  SequenceStates s;
  const unsigned char* at = block.data() + 64;
  for (std::uint32_t l = 0; l < f[0]; ++l) {
    s.recurrent.emplace_back(state);
    std::memcpy(s.recurrent.back().data(), at, state * 4);
    at += state * 4;
    s.conv.emplace_back(conv);
    if (conv > 0) std::memcpy(s.conv.back().data(), at, conv * 2);  // no conv: data() may be null
    at += conv * 2;
  }
  return s;
}

}  // namespace

// Each rank's engine made through the C API with a kda_communicator (its callbacks forwarding to a
// C++ in-process group), on threads: tensor-parallel ranks return the all-reduce of their partial
// sums (every rank the same bits); context-parallel ranges of one sequence (whole layers and
// cores) return one engine's prefill (rank 0's rows bit for bit); a failing callback fails the
// call with its name and value; malformed communicators are refused at creation.
KDA_CPU_CASE("communicators: tensor and context parallelism through callbacks") {
  const std::int64_t T = 40, E = 64, H = 4, D = 16;
  const std::vector<std::uint16_t> x =
      kda::test::random_bf16(static_cast<std::size_t>(T * E), 1.0f, 11);
  const std::int64_t cu[2] = {0, T};

  SUBCASE("tensor parallel: the ranks' outputs are the all-reduce of their partial sums") {
    const int ranks = 2;
    std::vector<std::vector<std::vector<std::uint16_t>>> got(ranks), partial(ranks);
    std::vector<std::string> failures(ranks);
    auto group = kda::engine::make_local_communicators(ranks);
    const std::vector<std::string> errors = kda::test::run_on_rank_threads(ranks, [&](int r) {
      const kda_communicator c =
          kda::test::c_communicator(group[static_cast<std::size_t>(r)].get(), KDA_BACKEND_CPU);
      for (const bool with_group : {true, false}) {
        kda_engine* e = nullptr;
        std::string message;
        if (create_with(parallel_spec(ranks, r, "whole"), with_group ? &c : nullptr, nullptr, &e,
                        &message) != KDA_OK) {
          failures[static_cast<std::size_t>(r)] = message;
          group[static_cast<std::size_t>(r)]->abort();  // the other ranks' collectives fail too
          return;
        }
        int slot = -1;
        kda_status st = kda_engine_acquire_slot(e, &slot);
        for (int l = 0; l < 2 && st == KDA_OK; ++l) {
          std::vector<std::uint16_t> out(static_cast<std::size_t>(T * E), 0xFFFF);
          st = kda_engine_prefill_hidden(e, l, x.data(), out.data(), &slot, 1, cu);
          (with_group ? got : partial)[static_cast<std::size_t>(r)].push_back(out);
        }
        if (st != KDA_OK) {
          failures[static_cast<std::size_t>(r)] = kda_engine_last_error(e);
          group[static_cast<std::size_t>(r)]->abort();
        }
        kda_engine_destroy(e);
      }
    });
    check_ranks(errors, failures);
    REQUIRE(got[0].size() == 2);
    REQUIRE(got[1].size() == 2);
    REQUIRE(partial[0].size() == 2);
    REQUIRE(partial[1].size() == 2);
    for (int l = 0; l < 2; ++l) {
      CAPTURE(l);
      CHECK(got[1][l] == got[0][l]);
      std::vector<std::uint16_t> summed(got[0][l].size());
      for (std::size_t j = 0; j < summed.size(); ++j) {
        summed[j] = kda::float_to_bf16(kda::bf16_to_float(partial[0][l][j]) +
                                       kda::bf16_to_float(partial[1][l][j]));
      }
      CHECK(got[0][l] == summed);
      CHECK(got[0][l] != partial[0][l]);  // the partial sum is not the whole layer's output
    }
  }

  SUBCASE("context parallel: ranges of one sequence equal one engine's prefill") {
    const std::vector<std::int64_t> ranges = {23, 0, 17};
    const int ranks = static_cast<int>(ranges.size());
    const std::size_t qk = static_cast<std::size_t>(T * H * D);
    const std::vector<std::uint16_t> q = kda::test::random_bf16(qk, 1.0f, 21),
                                     k = kda::test::random_bf16(qk, 1.0f, 22),
                                     v = kda::test::random_bf16(qk, 1.0f, 23),
                                     g = kda::test::random_bf16(qk, 1.0f, 24),
                                     beta = kda::test::random_bf16(static_cast<std::size_t>(T * H),
                                                                   1.0f, 25);
    for (const char* layers : {"whole", "core"}) {
      CAPTURE(std::string(layers));
      const bool whole = std::string(layers) == "whole";
      const std::int64_t width = whole ? E : H * D;  // out's values a token
      // One engine, no group.
      std::vector<std::vector<std::uint16_t>> want;
      SequenceStates want_states;
      {
        Handle one;
        std::string message;
        REQUIRE(create_with(parallel_spec(1, 0, layers), nullptr, nullptr, &one.engine, &message) ==
                KDA_OK);
        int slot = -1;
        REQUIRE(kda_engine_acquire_slot(one, &slot) == KDA_OK);
        for (int l = 0; l < 2; ++l) {
          std::vector<std::uint16_t> out(static_cast<std::size_t>(T * width), 0xFFFF);
          const kda_status st =
              whole ? kda_engine_prefill_hidden(one, l, x.data(), out.data(), &slot, 1, cu)
                    : kda_engine_prefill(one, l, q.data(), k.data(), v.data(), g.data(),
                                         beta.data(), out.data(), &slot, 1, cu);
          REQUIRE(st == KDA_OK);
          want.push_back(out);
        }
        want_states = read_sequence_states(one, slot);
      }
      std::vector<std::vector<std::uint16_t>> out(
          2, std::vector<std::uint16_t>(static_cast<std::size_t>(T * width), 0xFFFF));
      std::vector<std::string> failures(static_cast<std::size_t>(ranks));
      std::vector<SequenceStates> states(static_cast<std::size_t>(ranks));
      auto group = kda::engine::make_local_communicators(ranks);
      const std::vector<std::string> errors = kda::test::run_on_rank_threads(ranks, [&](int r) {
        const kda_communicator c =
            kda::test::c_communicator(group[static_cast<std::size_t>(r)].get(), KDA_BACKEND_CPU);
        kda_engine* e = nullptr;
        std::string& failure = failures[static_cast<std::size_t>(r)];
        if (create_with(parallel_spec(1, 0, layers), nullptr, &c, &e, &failure) != KDA_OK) {
          // A rank that cannot take part wakes the others' collectives.
          group[static_cast<std::size_t>(r)]->abort();
          return;
        }
        std::int64_t begin = 0;
        for (int j = 0; j < r; ++j) begin += ranges[static_cast<std::size_t>(j)];
        const std::int64_t n = ranges[static_cast<std::size_t>(r)];
        int slot = -1;
        kda_status st = kda_engine_acquire_slot(e, &slot);
        for (int l = 0; l < 2 && st == KDA_OK; ++l) {
          std::uint16_t* o = out[static_cast<std::size_t>(l)].data() + begin * width;
          const std::int64_t at = begin * H * D;
          st = whole ? kda_engine_prefill_hidden_context_parallel(e, l, x.data() + begin * E, o,
                                                                  slot, n)
                     : kda_engine_prefill_context_parallel(e, l, q.data() + at, k.data() + at,
                                                           v.data() + at, g.data() + at,
                                                           beta.data() + begin * H, o, slot, n);
        }
        if (st != KDA_OK) {
          failure = kda_engine_last_error(e);
          group[static_cast<std::size_t>(r)]->abort();
        } else {
          states[static_cast<std::size_t>(r)] = read_sequence_states(e, slot);
        }
        kda_engine_destroy(e);
      });
      check_ranks(errors, failures);
      // Every rank's slot ends with the sequence's final state: the recurrent states through the
      // gathered fp32 transitions (to rounding), the conv states the last inputs (bit for bit).
      for (int r = 0; r < ranks; ++r) {
        CAPTURE(r);
        const SequenceStates& got = states[static_cast<std::size_t>(r)];
        REQUIRE(got.recurrent.size() == want_states.recurrent.size());
        for (std::size_t l = 0; l < got.recurrent.size(); ++l) {
          CAPTURE(l);
          CHECK(kda::test::relative_error(got.recurrent[l], want_states.recurrent[l]) < 1e-4);
          CHECK(got.conv[l].size() == (whole ? want_states.conv[l].size() : 0));
          CHECK(got.conv[l] == want_states.conv[l]);
        }
      }
      for (int l = 0; l < 2; ++l) {
        CAPTURE(l);
        const double error = kda::test::relative_error(out[static_cast<std::size_t>(l)],
                                                       want[static_cast<std::size_t>(l)]);
        MESSAGE(std::string(layers) << " layer " << l << " over 23/0/17 tokens: out " << error);
        CHECK(error < 2e-4);
        CHECK(same_prefix(out[static_cast<std::size_t>(l)], want[static_cast<std::size_t>(l)],
                          static_cast<std::size_t>(ranges[0] * width)));
      }
    }
  }

  SUBCASE("a failing callback fails the call, naming it; bad communicators are refused") {
    kda_communicator failing;
    std::memset(&failing, 0, sizeof failing);
    failing.struct_size = sizeof failing;
    failing.size = 1;
    failing.memory = KDA_BACKEND_CPU;
    failing.all_reduce_sum = [](void*, void*, size_t, kda_collective_dtype, void*) { return 7; };
    failing.all_gather = [](void*, const void*, void*, size_t, void*) { return 7; };
    Handle e;
    std::string message;
    REQUIRE(create_with(parallel_spec(1, 0, "whole"), nullptr, &failing, &e.engine, &message) ==
            KDA_OK);
    int slot = -1;
    REQUIRE(kda_engine_acquire_slot(e, &slot) == KDA_OK);
    std::vector<std::uint16_t> out(static_cast<std::size_t>(T * E), 0xFFFF);
    CHECK(kda_engine_prefill_hidden_context_parallel(e, 0, x.data(), out.data(), slot, T) ==
          KDA_INTERNAL);
    CHECK(
        std::string(kda_engine_last_error(e)) ==
        "kda_engine_prefill_hidden_context_parallel: options.context_group: all_gather returned 7");
    // Tensors missing for tokens the rank holds: refused before the first collective.
    CHECK(kda_engine_prefill_hidden_context_parallel(e, 0, nullptr, out.data(), slot, T) ==
          KDA_INVALID_ARGUMENT);
    // A collective that fails after an earlier one succeeded (the transitions' all_gather, after
    // the conv histories') still leaves the slot's states as they were.
    {
      kda_communicator second_fails = failing;
      int gathers = 0;
      second_fails.user = &gathers;
      second_fails.rank = 1;
      second_fails.size = 2;
      second_fails.all_gather = [](void* user, const void* send, void* recv, size_t bytes, void*) {
        if (++*static_cast<int*>(user) == 2) return 7;
        // Rank 0's conv-history block: 3 tokens of inputs 1.0, after its 8-byte token count.
        auto* block = static_cast<unsigned char*>(recv);
        std::memset(block, 0, bytes);
        const std::int64_t held = 3;
        std::memcpy(block, &held, sizeof held);
        const std::uint16_t one = 0x3f80;
        for (size_t i = 16; i + 2 <= bytes; i += 2) std::memcpy(block + i, &one, 2);
        std::memcpy(block + bytes, send, bytes);  // this rank's
        return 0;
      };
      Handle ranked;
      REQUIRE(create_with(parallel_spec(1, 0, "whole"), nullptr, &second_fails, &ranked.engine,
                          &message) == KDA_OK);
      int s = -1;
      REQUIRE(kda_engine_acquire_slot(ranked, &s) == KDA_OK);
      std::uint64_t bytes = 0;
      REQUIRE(kda_engine_sequence_state_bytes(ranked, &bytes) == KDA_OK);
      std::vector<unsigned char> before(bytes), after(bytes);
      REQUIRE(kda_engine_read_sequence_state(ranked, s, before.data(), bytes) == KDA_OK);
      CHECK(kda_engine_prefill_hidden_context_parallel(ranked, 0, x.data(), out.data(), s, T) ==
            KDA_INTERNAL);
      CHECK(gathers == 2);
      REQUIRE(kda_engine_read_sequence_state(ranked, s, after.data(), bytes) == KDA_OK);
      CHECK(after == before);
    }
    // A plan counts the context group's buffers, as creation does.
    {
      kda_engine_options options = cpu_options(5);
      options.cpu_threads = 1;
      options.context_group = &failing;
      std::uint64_t planned = 0, arena = 0, alone = 0;
      char err[512] = "";
      REQUIRE(kda_engine_plan_from_string(parallel_spec(1, 0, "whole").c_str(), &options, &planned,
                                          nullptr, err, sizeof err) == KDA_OK);
      REQUIRE(kda_engine_arena_bytes(e, &arena) == KDA_OK);
      CHECK(planned == arena);
      options.context_group = nullptr;
      REQUIRE(kda_engine_plan_from_string(parallel_spec(1, 0, "whole").c_str(), &options, &alone,
                                          nullptr, err, sizeof err) == KDA_OK);
      CHECK(alone < planned);
    }
    // The KDA core's form: a missing tensor named by the C function, nothing gathered.
    {
      Handle core;
      REQUIRE(create_with(parallel_spec(1, 0, "core"), nullptr, &failing, &core.engine, &message) ==
              KDA_OK);
      int core_slot = -1;
      REQUIRE(kda_engine_acquire_slot(core, &core_slot) == KDA_OK);
      const std::vector<std::uint16_t> qkv(static_cast<std::size_t>(T * H * D), 0);
      CHECK(kda_engine_prefill_context_parallel(core, 0, qkv.data(), qkv.data(), qkv.data(),
                                                qkv.data(), qkv.data(), nullptr, core_slot,
                                                T) == KDA_INVALID_ARGUMENT);
      CHECK(std::string(kda_engine_last_error(core)) ==
            "kda_engine_prefill_context_parallel: out is null");
      // No tokens: no tensors needed; the failing gather is reached and named.
      CHECK(kda_engine_prefill_context_parallel(core, 0, nullptr, nullptr, nullptr, nullptr,
                                                nullptr, nullptr, core_slot, 0) == KDA_INTERNAL);
      CHECK(std::string(kda_engine_last_error(core)) ==
            "kda_engine_prefill_context_parallel: options.context_group: all_gather returned 7");
    }
    // A group whose size is not the model's tp_size, through the engine's own check.
    kda_communicator two = failing;
    two.size = 2;
    Handle wrong;
    CHECK(create_with(parallel_spec(1, 0, "whole"), &two, nullptr, &wrong.engine, &message) ==
          KDA_INVALID_ARGUMENT);
    CHECK(wrong.engine == nullptr);
    CHECK(message.find("EngineOptions::communicator is rank 0 of 2 on cpu; the engine is "
                       "tensor-parallel rank 0 of 1") != std::string::npos);
    // A group whose buffers live in device memory, for an engine on the CPU.
    kda_communicator device = failing;
    device.memory = KDA_BACKEND_CUDA;
    Handle elsewhere;
    CHECK(create_with(parallel_spec(1, 0, "whole"), &device, nullptr, &elsewhere.engine,
                      &message) == KDA_INVALID_ARGUMENT);
    CHECK(elsewhere.engine == nullptr);
    CHECK(message.find("EngineOptions::communicator is rank 0 of 1 on cuda; the engine is "
                       "tensor-parallel rank 0 of 1 on cpu") != std::string::npos);

    // A tensor-parallel rank's all-reduce that fails (returns 7) or throws (a C++ caller's
    // callback) fails the call with KDA_INTERNAL (KDA_OUT_OF_MEMORY for std::bad_alloc) and a
    // message; nothing crosses the C API.
    {
      struct FailingReduce {
        int (*all_reduce_sum)(void*, void*, size_t, kda_collective_dtype, void*);
        const char* expected;
        kda_status status;
      };
      const FailingReduce reduces[] = {
          {failing.all_reduce_sum,
           "kda_engine_prefill_hidden: options.communicator: all_reduce_sum returned 7",
           KDA_INTERNAL},
          {[](void*, void*, size_t, kda_collective_dtype, void*) -> int {
             throw std::runtime_error("transport down");
           },
           "kda_engine_prefill_hidden: internal error: transport down", KDA_INTERNAL},
          {[](void*, void*, size_t, kda_collective_dtype, void*) -> int { throw std::bad_alloc(); },
           "kda_engine_prefill_hidden: out of host memory (std::bad_alloc)", KDA_OUT_OF_MEMORY},
          {[](void*, void*, size_t, kda_collective_dtype, void*) -> int { throw 42; },
           "kda_engine_prefill_hidden: internal error: unknown exception", KDA_INTERNAL},
      };
      for (const FailingReduce& t : reduces) {
        CAPTURE(std::string(t.expected));
        kda_communicator reduce = failing;
        reduce.size = 2;
        reduce.all_reduce_sum = t.all_reduce_sum;
        Handle rank0;
        REQUIRE(create_with(parallel_spec(2, 0, "whole"), &reduce, nullptr, &rank0.engine,
                            &message) == KDA_OK);
        int tp_slot = -1;
        REQUIRE(kda_engine_acquire_slot(rank0, &tp_slot) == KDA_OK);
        CHECK(kda_engine_prefill_hidden(rank0, 0, x.data(), out.data(), &tp_slot, 1, cu) ==
              t.status);
        CHECK(std::string(kda_engine_last_error(rank0)) == t.expected);
      }
    }

    struct Bad {
      const char* name;
      void (*spoil)(kda_communicator*);
      const char* expected;
    };
    const Bad bad[] = {
        {"struct_size", [](kda_communicator* c) { c->struct_size = 8; },
         "options.context_group->struct_size is 8, expected "},
        {"larger struct_size",
         [](kda_communicator* c) { c->struct_size = sizeof(kda_communicator) + 8; },
         "options.context_group->struct_size is 56, expected 48"},
        {"negative rank", [](kda_communicator* c) { c->rank = -1; },
         "options.context_group is rank -1 of 1, expected size >= 1 and rank in [0, size)"},
        {"rank", [](kda_communicator* c) { c->rank = 1; },
         "options.context_group is rank 1 of 1, expected size >= 1 and rank in [0, size)"},
        {"size", [](kda_communicator* c) { c->size = 0; },
         "options.context_group is rank 0 of 0, expected size >= 1 and rank in [0, size)"},
        {"memory", [](kda_communicator* c) { c->memory = KDA_BACKEND_AUTO; },
         "options.context_group->memory is 1, expected KDA_BACKEND_CPU or KDA_BACKEND_CUDA"},
        {"reserved", [](kda_communicator* c) { c->reserved = 3; },
         "options.context_group->reserved is 3, must be 0"},
        {"callback", [](kda_communicator* c) { c->all_gather = nullptr; },
         "options.context_group needs all_reduce_sum and all_gather"},
    };
    for (const Bad& b : bad) {
      CAPTURE(std::string(b.name));
      kda_communicator c = failing;
      b.spoil(&c);
      Handle refused;
      CHECK(create_with(parallel_spec(1, 0, "whole"), nullptr, &c, &refused.engine, &message) ==
            KDA_INVALID_ARGUMENT);
      CHECK(refused.engine == nullptr);
      CHECK(message.find(b.expected) != std::string::npos);
      // A plan checks them as creation does.
      kda_engine_options options = cpu_options();
      options.context_group = &c;
      std::uint64_t bytes = 0;
      char err[512] = "";
      CHECK(kda_engine_plan_from_string(parallel_spec(1, 0, "whole").c_str(), &options, &bytes,
                                        nullptr, err, sizeof err) == KDA_INVALID_ARGUMENT);
      CHECK(std::string(err).find(b.expected) != std::string::npos);
    }
  }
}

KDA_CPU_CASE("the caller's kda_batch: struct_size of either version, reserved, decode equals") {
  Handle handle;
  create(&handle);
  const Activations x(8, 2, 32, 5);  // host memory: a CPU handle
  const Activations step(1, 2, 32, 6);
  std::vector<std::uint16_t> out(8 * 2 * 32);
  const std::int64_t cu[2] = {0, 8};
  int slots[3] = {-1, -1, -1};
  for (int& slot : slots) {
    REQUIRE(kda_engine_acquire_slot(handle, &slot) == KDA_OK);
    REQUIRE(kda_engine_prefill(handle, 0, x.q.data(), x.k.data(), x.v.data(), x.g.data(),
                               x.beta.data(), out.data(), &slot, 1, cu) == KDA_OK);
  }
  const auto decode_batch = [&](int slot) {
    kda_batch b;
    REQUIRE(kda_batch_init(&b) == KDA_OK);
    b.tokens = 1;
    b.sequences = 1;
    b.decode_tokens = 1;
    b.slots = &slots[slot];
    return b;
  };
  const auto forward = [&](const kda_batch& b, std::vector<std::uint16_t>* result) {
    return kda_engine_forward_batch(handle, 0, step.q.data(), step.k.data(), step.v.data(),
                                    step.g.data(), step.beta.data(), result->data(), &b);
  };

  SUBCASE("refused: a size between the versions or past the last, reserved, NULL") {
    for (const std::size_t size : {std::size_t{100}, sizeof(kda_batch) + 8, std::size_t{8}}) {
      CAPTURE(size);
      kda_batch b = decode_batch(0);
      b.struct_size = size;
      CHECK(forward(b, &out) == KDA_INVALID_ARGUMENT);
      CHECK(last_error(handle) == "kda_engine_forward_batch: batch->struct_size is " +
                                      std::to_string(size) +
                                      ", expected 96 or 120 (initialise the batch with "
                                      "kda_batch_init)");
    }
    kda_batch b = decode_batch(0);
    b.reserved = 1;
    CHECK(forward(b, &out) == KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_forward_batch: batch->reserved is 1, must be 0");
    // A records step needs runtime.max_verify_tokens, which this model has not.
    b = decode_batch(0);
    b.records = 1;
    CHECK(forward(b, &out) == KDA_INVALID_ARGUMENT);
    CHECK(contains(last_error(handle), "max_verify_tokens"));
    CHECK(kda_engine_forward_batch(handle, 0, step.q.data(), step.k.data(), step.v.data(),
                                   step.g.data(), step.beta.data(), out.data(),
                                   nullptr) == KDA_INVALID_ARGUMENT);
    CHECK(last_error(handle) == "kda_engine_forward_batch: batch is null");
  }
  SUBCASE("a decode step of one token equals kda_engine_decode, in either version") {
    std::vector<std::uint16_t> direct(2 * 32, 0), full(2 * 32, 1), first(2 * 32, 2);
    REQUIRE(kda_engine_decode(handle, 0, step.q.data(), step.k.data(), step.v.data(), step.g.data(),
                              step.beta.data(), direct.data(), &slots[0], 1, 1) == KDA_OK);
    CHECK(forward(decode_batch(1), &full) == KDA_OK);
    CHECK(last_error(handle).empty());
    CHECK(full == direct);
    // The first version (96 bytes, up to `reserved`): the fields after it are not read, whatever
    // the caller's memory holds there.
    kda_batch b = decode_batch(2);
    b.struct_size = 96;
    const std::int32_t rows[1] = {0}, counts[1] = {1};
    b.records_region = 1;
    b.fold_region = 1;
    b.fold_rows = rows;
    b.fold_counts = counts;
    CHECK(forward(b, &first) == KDA_OK);
    CHECK(last_error(handle).empty());
    CHECK(first == direct);
  }
  SUBCASE("a prefill's checkpoint is written to its checkpoint slot") {
    int checkpoint = -1;
    REQUIRE(kda_engine_acquire_slot(handle, &checkpoint) == KDA_OK);
    std::uint64_t bytes = 0;
    REQUIRE(kda_engine_sequence_state_bytes(handle, &bytes) == KDA_OK);
    std::vector<unsigned char> before(bytes), after(bytes);
    REQUIRE(kda_engine_read_sequence_state(handle, checkpoint, before.data(), bytes) == KDA_OK);
    const std::int64_t offsets[1] = {8};  // the sequence's length
    kda_batch b;
    REQUIRE(kda_batch_init(&b) == KDA_OK);
    b.tokens = 8;
    b.sequences = 1;
    b.slots = &slots[0];
    b.cu_seqlens = cu;
    b.checkpoints = 1;
    b.checkpoint_offsets = offsets;
    b.checkpoint_slots = &checkpoint;
    CHECK(kda_engine_forward_batch(handle, 0, x.q.data(), x.k.data(), x.v.data(), x.g.data(),
                                   x.beta.data(), out.data(), &b) == KDA_OK);
    CHECK_MESSAGE(last_error(handle).empty(), last_error(handle));
    REQUIRE(kda_engine_read_sequence_state(handle, checkpoint, after.data(), bytes) == KDA_OK);
    CHECK(after != before);
  }
}
