// layer_runner.hpp — the whole-layer tests' backend matrix (as tests/kda/backend_matrix.hpp is the
// operator's).
//
// Every behaviour of kda::layer is written once, against a LayerRunner: the backend as a test sees
// it. A runner uploads a forward's inputs and state pools (host vectors) into buffers with guard
// bytes (HostBuffer on the CPU, DeviceBuffer on CUDA, common/cuda_test_util.hpp), poisons out and
// the workspace with 0xFF bytes (NaN in bf16 and fp32), runs make_layer(backend, ...)->forward with
// a workspace of exactly workspace_bytes(), downloads out and the pools, and reports what the call
// threw, the device status word and whether every guard byte survived. One implementation
// (BufferLayerRunner) serves both backends; they differ in the buffer type only.
//
// check_forward() then holds a forward to the fp64 reference (layer_reference.cpp) of the same call
// from the same pools, and, on CUDA, to the CPU layer as well (the CPU layer being the one the
// reference checks most tightly).
//
// Declaring cases (the backend is the last word of the case's name; tests/CMakeLists.txt labels
// "[cpu]" cases `cpu` and "[cuda]" cases `gpu`, and the latter skip without a device):
//   KDA_LAYER_CASE("name") { ... runner ... }  once per backend: "name [cpu]" and "name [cuda]"
//   KDA_LAYER_CPU_CASE("name") { ... }          the CPU backend or no backend: "name [cpu]"
//   KDA_LAYER_CUDA_CASE("name") { ... cuda ... }  CUDA only: "name [cuda]"
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kda/layer/layer.hpp"
#include "layer_test_util.hpp"

namespace kda::test {

// ---------------------------------------------------------------------------------------------
// A forward's data on the host
// ---------------------------------------------------------------------------------------------

// The state pools of one layer: conv states bf16, the recurrent state f32 or bf16.
struct Pools {
  std::int64_t num_slots = 0;
  DType dtype = DType::kF32;
  std::size_t conv_row = 0;       // elements of one slot's row of a conv pool: Cl * (W - 1)
  std::size_t recurrent_row = 0;  // ... of the recurrent pool: Hl * D * D
  std::vector<bf16_bits> conv_q, conv_k, conv_v;
  std::vector<float> rec_f32;       // when dtype is f32
  std::vector<bf16_bits> rec_bf16;  // when dtype is bf16
  // A records step's and a commit's regions (layer::State::recurrent_records / conv_records), for
  // record_rows row-token pairs; empty with record_rows 0.
  std::int64_t record_rows = 0;
  std::vector<float> recurrent_records;
  std::vector<bf16_bits> conv_records;
  // The records a step folds (layer::State::fold_recurrent_records / fold_conv_records): a records
  // step's, as it wrote them; empty: none.
  std::vector<float> fold_recurrent_records;
  std::vector<bf16_bits> fold_conv_records;

  Pools(const layer::Config& c, std::int64_t slots, DType recurrent_dtype = DType::kF32);
  // Non-zero states in every row (conv U(-2, 2), recurrent U(-0.5, 0.5), all bf16-representable).
  void randomize(std::uint64_t seed);
  // Records regions of `rows` row-token pairs, every value NaN (0xFF bytes, the poison), so that
  // a test sees which records a step wrote.
  void add_records(const layer::Config& c, std::int64_t rows);
  void zero_row(std::int64_t r);
  std::vector<double> recurrent() const;
  // Row r of each of the four pools, bit for bit as other's row `other_r`.
  bool row_equal(const Pools& other, std::int64_t r, std::int64_t other_r) const;
  bool row_equal(const Pools& other, std::int64_t r) const { return row_equal(other, r, r); }
  // Every pool bit for bit.
  bool operator==(const Pools& other) const;
  bool operator!=(const Pools& other) const { return !(*this == other); }
};

// One batch as the host holds it.
struct BatchSpec {
  std::vector<std::int64_t> cu_seqlens = {0};  // [N + 1]; a decode batch's: n * decode_tokens
  std::vector<std::int32_t> slots;             // [N], or empty: sequence n on row n
  std::int64_t decode_tokens = 0;              // 0: prefill
  // A verify step (layer::Batch::num_accepted): [N], slots then [N, decode_tokens].
  std::vector<std::int32_t> num_accepted;
  // A prefill's cu_seqlens handed to the layer as int32 (layer::Batch::cu_seqlens_i32, its host
  // copy cu_seqlens_host_i32) instead of int64.
  bool int32_cu_seqlens = false;
  // layer::Batch::padding_slot: slots entries equal to it are padding too (-1: none).
  std::int32_t padding_slot = -1;
  // A record-and-commit verify step (layer::Batch::records): slots [N], the pools' records.
  bool records = false;
  // A fold of the records step before (layer::Batch::fold_sequences > 0): [N] each; the records
  // come from the pools' fold regions.
  std::int64_t fold_sequences = 0, fold_decode_tokens = 1;
  std::vector<std::int32_t> fold_rows, fold_counts;
  std::int64_t tokens() const { return cu_seqlens.back(); }
  std::int64_t sequences() const { return static_cast<std::int64_t>(cu_seqlens.size()) - 1; }
  std::int64_t length(std::int64_t n) const { return cu_seqlens[n + 1] - cu_seqlens[n]; }
  std::int64_t slot(std::int64_t n) const { return slots.empty() ? n : slots[n]; }
};
BatchSpec prefill_batch(const std::vector<std::int64_t>& lengths,
                        std::vector<std::int32_t> slots = {});
BatchSpec decode_batch(std::int64_t sequences, std::int64_t tokens,
                       std::vector<std::int32_t> slots = {});

// Rows [begin, end) of a [T, E] matrix.
std::vector<bf16_bits> token_rows(const std::vector<bf16_bits>& m, std::int64_t E,
                                  std::int64_t begin, std::int64_t end);
// Whether two vectors hold the same bytes.
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// ---------------------------------------------------------------------------------------------
// The fp64 reference (layer_reference.cpp)
// ---------------------------------------------------------------------------------------------

// The layer token by token in fp64, written from the math alone, rounding to bf16 at the points the
// implementations round (docs/LAYER.md); for a shard, the rank's partial sum. States as the batch
// leaves `before`'s pools (as values); a padding sequence or decode row (negative slot) outputs
// zeros and touches no state.
struct LayerReference {
  std::vector<double> out;                     // [T, E]
  std::vector<double> conv_q, conv_k, conv_v;  // the pools
  std::vector<double> recurrent;
};
LayerReference reference_layer(const layer::Weights& w, const std::vector<bf16_bits>& hidden,
                               const BatchSpec& batch, const Pools& before);

// ---------------------------------------------------------------------------------------------
// Runners
// ---------------------------------------------------------------------------------------------

constexpr unsigned char kPoisonByte = 0xFF;  // out and the workspace hold it before every forward

// What one forward did.
struct LayerRun {
  std::vector<bf16_bits> out;
  std::string error;                  // what the forward threw (kda::Error), or empty
  StatusCode code = StatusCode::kOk;  // its code
  std::uint32_t device_status = 0;    // the batch's device status word (0 on the CPU)
  bool all_written = false;           // no poison left in out
  bool guards_intact = false;         // nothing written around out, the pools, the workspace
};

// The arguments of one forward, as a test may change them before the call.
struct ForwardCall {
  layer::Batch batch;
  const bf16_bits* hidden = nullptr;
  bf16_bits* out = nullptr;
  layer::State state;
  Workspace workspace;
  layer::RunOptions options;
};

struct ForwardSettings {
  // Pass the host copies cu_seqlens_host and slots_host (the CPU ignores them: it reads the
  // arrays themselves); without them CUDA sees the arrays on the device only.
  bool host_copies = true;
  std::function<void(ForwardCall&)> change;  // applied to the arguments just before the call
};

// Memory of a backend (host or device) behind one interface: regions for weight images.
class Memory {
 public:
  virtual ~Memory() = default;
  virtual void* get() const = 0;
  virtual void fill(unsigned char byte) = 0;
  virtual std::vector<unsigned char> download() const = 0;
  virtual bool guards_intact() const = 0;
};

// How close a backend comes.
struct Tolerances {
  double reference;       // relative L2 error of out and states against the fp64 reference
  double split_out;       // the same tokens in other calls (chained prefills, decode steps): out
  double split_state;     // ... the recurrent states (f32 pools); tensor-parallel ranks' states
  bool split_conv_exact;  // ... the conv states bit for bit
};
// Relative L2 error of CUDA against the CPU layer, on out and every state.
constexpr double kCudaVsCpuTolerance = 1e-2;
// Out and states of a bf16 recurrent pool against an f32 one, and split runs on bf16 pools (the
// state is rounded to bf16 at the end of every call).
constexpr double kBf16PoolTolerance = 1e-2;

class LayerRunner {
 public:
  virtual ~LayerRunner() = default;
  virtual Backend backend() const = 0;
  std::string name() const { return backend() == Backend::kCpu ? "CPU" : "CUDA"; }
  // A small layer this backend runs: head_dim 16 on the CPU (fast), 128 on CUDA (its only one);
  // the output gate low rank (Kimi-Linear) or full rank (Kimi K3).
  layer::Config config(GateMode gate = GateMode::kSoftplus, bool full_rank_gate = false) const;
  Tolerances tolerances() const;
  // The start of every message of a refused forward: "KDA layer forward (CPU): ".
  std::string forward_error_prefix() const;
  std::unique_ptr<layer::Layer> make(const layer::Weights& w) const {
    return layer::make_layer(backend(), w);
  }
  // `bytes` of this backend's memory, with guard bytes around it.
  virtual std::unique_ptr<Memory> allocate(std::size_t bytes) const = 0;
  // One forward of `batch` over `hidden` from `*pools` (updated in place: downloaded after).
  virtual LayerRun forward(const layer::Layer& layer, const std::vector<bf16_bits>& hidden,
                           const BatchSpec& batch, Pools* pools,
                           const ForwardSettings& settings = {}) const = 0;
  // One layer::commit() of the records step `batch` (its slots, decode_tokens and padding_slot;
  // num_accepted [N]) over the layers whose pools and records are `layers` (updated in place).
  // `host_copies`: hand the CUDA commit host copies of slots and num_accepted. `change`, when set,
  // is applied to the call's states, batch and options just before it. The run's out is empty.
  using CommitChange =
      std::function<void(std::vector<layer::State>&, layer::CommitBatch&, layer::RunOptions&)>;
  virtual LayerRun commit(const layer::Config& config, const BatchSpec& batch,
                          const std::vector<Pools*>& layers, bool host_copies = true,
                          const CommitChange& change = {}) const = 0;
};

// A forward's buffers on one backend: the inputs and pools uploaded, out and the workspace of
// `workspace_bytes` poisoned (the runner's forward, and tests that drive the layer themselves, e.g.
// a graph capture).
template <class Buffer>
struct ForwardBuffers {
  Buffer hidden, out, cu_seqlens, cu_seqlens_i32, slots, accepted, status, conv_q, conv_k, conv_v,
      recurrent, workspace, recurrent_records, conv_records, fold_rows, fold_counts,
      fold_recurrent_records, fold_conv_records;

  ForwardBuffers(const std::vector<bf16_bits>& hidden_rows, const BatchSpec& batch,
                 const Pools& pools, std::size_t workspace_bytes)
      : hidden(Buffer::from(hidden_rows)),
        out(hidden_rows.size() * sizeof(bf16_bits)),
        cu_seqlens(Buffer::from(batch.cu_seqlens)),
        cu_seqlens_i32(Buffer::from(narrowed(batch.cu_seqlens))),
        slots(Buffer::from(batch.slots)),
        accepted(Buffer::from(batch.num_accepted)),
        status(sizeof(std::uint32_t)),
        conv_q(Buffer::from(pools.conv_q)),
        conv_k(Buffer::from(pools.conv_k)),
        conv_v(Buffer::from(pools.conv_v)),
        recurrent(pools.dtype == DType::kF32 ? Buffer::from(pools.rec_f32)
                                             : Buffer::from(pools.rec_bf16)),
        workspace(workspace_bytes),
        recurrent_records(Buffer::from(pools.recurrent_records)),
        conv_records(Buffer::from(pools.conv_records)),
        fold_rows(Buffer::from(batch.fold_rows)),
        fold_counts(Buffer::from(batch.fold_counts)),
        fold_recurrent_records(Buffer::from(pools.fold_recurrent_records)),
        fold_conv_records(Buffer::from(pools.fold_conv_records)) {
    out.fill(kPoisonByte);
    // The workspace too: no forward may read a workspace byte it did not write in the same call
    // (an arena's workspace holds whatever the layer before left there), and NaN bytes read by any
    // kernel or library call would show in out or the states.
    workspace.fill(kPoisonByte);
    status.fill(0);
    (void)Buffer::synchronize();
  }

  static std::vector<std::int32_t> narrowed(const std::vector<std::int64_t>& values) {
    return std::vector<std::int32_t>(values.begin(), values.end());
  }

  // The forward's arguments; `batch` and `pools` must be those the buffers were made from.
  ForwardCall call(const BatchSpec& batch, const Pools& pools, bool host_copies) const {
    const bool decode = batch.decode_tokens > 0;
    const bool i32 = batch.int32_cu_seqlens && !decode;
    ForwardCall c;
    c.batch.tokens = batch.tokens();
    c.batch.sequences = batch.sequences();
    c.batch.decode_tokens = batch.decode_tokens;
    c.batch.padding_slot = batch.padding_slot;
    c.batch.records = batch.records;
    if (batch.fold_sequences > 0) {
      c.batch.fold_sequences = batch.fold_sequences;
      c.batch.fold_decode_tokens = batch.fold_decode_tokens;
      c.batch.fold_rows = static_cast<const std::int32_t*>(fold_rows.get());
      c.batch.fold_counts = static_cast<const std::int32_t*>(fold_counts.get());
      c.state.fold_recurrent_records = static_cast<const float*>(fold_recurrent_records.get());
      c.state.fold_conv_records = static_cast<const bf16_bits*>(fold_conv_records.get());
    }
    // A decode batch's cu_seqlens is not read: null shows it.
    if (i32) {
      c.batch.cu_seqlens_i32 = static_cast<const std::int32_t*>(cu_seqlens_i32.get());
    } else if (!decode) {
      c.batch.cu_seqlens = static_cast<const std::int64_t*>(cu_seqlens.get());
    }
    c.batch.slots = batch.slots.empty() ? nullptr : static_cast<const std::int32_t*>(slots.get());
    if (!batch.num_accepted.empty()) {
      c.batch.num_accepted = static_cast<const std::int32_t*>(accepted.get());
    }
    if (host_copies) {
      host_cu_i32 = narrowed(batch.cu_seqlens);
      if (i32) {
        c.batch.cu_seqlens_host_i32 = host_cu_i32.data();
      } else if (!decode) {
        c.batch.cu_seqlens_host = batch.cu_seqlens.data();
      }
      c.batch.slots_host = batch.slots.empty() ? nullptr : batch.slots.data();
      c.batch.num_accepted_host = batch.num_accepted.empty() ? nullptr : batch.num_accepted.data();
    }
    c.batch.device_status = static_cast<std::uint32_t*>(status.get());
    c.hidden = static_cast<const bf16_bits*>(hidden.get());
    c.out = static_cast<bf16_bits*>(out.get());
    c.state.num_slots = pools.num_slots;
    c.state.conv_q = static_cast<bf16_bits*>(conv_q.get());
    c.state.conv_k = static_cast<bf16_bits*>(conv_k.get());
    c.state.conv_v = static_cast<bf16_bits*>(conv_v.get());
    c.state.recurrent = recurrent.get();
    c.state.recurrent_dtype = pools.dtype;
    c.state.record_rows = pools.record_rows;
    if (pools.record_rows > 0) {
      c.state.recurrent_records = static_cast<float*>(recurrent_records.get());
      c.state.conv_records = static_cast<bf16_bits*>(conv_records.get());
    }
    c.workspace = Workspace{workspace.get(), workspace.bytes()};
    return c;
  }
  void download(Pools* pools) const {
    pools->conv_q = conv_q.template download<bf16_bits>();
    pools->conv_k = conv_k.template download<bf16_bits>();
    pools->conv_v = conv_v.template download<bf16_bits>();
    if (pools->dtype == DType::kF32) pools->rec_f32 = recurrent.template download<float>();
    if (pools->dtype == DType::kBF16) pools->rec_bf16 = recurrent.template download<bf16_bits>();
    pools->recurrent_records = recurrent_records.template download<float>();
    pools->conv_records = conv_records.template download<bf16_bits>();
  }
  mutable std::vector<std::int32_t> host_cu_i32;  // the int32 host copy call() hands out

  bool guards_intact() const {
    return hidden.guards_intact() && out.guards_intact() && conv_q.guards_intact() &&
           conv_k.guards_intact() && conv_v.guards_intact() && recurrent.guards_intact() &&
           workspace.guards_intact() && recurrent_records.guards_intact() &&
           conv_records.guards_intact() && fold_recurrent_records.guards_intact() &&
           fold_conv_records.guards_intact();
  }
};

LayerRunner& cpu_layer_runner();
// The CUDA runner, or null (after printing the skip marker) when there is no device.
LayerRunner* cuda_layer_runner_or_skip();

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

// A forward that should have run: no error, a clear device status, every value of out written,
// every guard intact; out (as a whole and sequence by sequence) and the pools within the backend's
// tolerance of the fp64 reference of the call from `before`; padding rows exactly zero;
// every pool row no sequence with tokens uses bit for bit as before. On CUDA also out and the pools
// against the CPU layer's forward of the same call. Prints the errors it measures.
void check_forward(const LayerRunner& runner, const layer::Weights& weights,
                   const std::vector<bf16_bits>& hidden, const BatchSpec& batch,
                   const Pools& before, const LayerRun& run, const Pools& after);

// Two runs of the same tokens split into other calls (out in the same token order): out and
// states within the runner's split tolerances (kBf16PoolTolerance on bf16 pools).
void check_same_tokens(const LayerRunner& runner, const std::vector<bf16_bits>& out,
                       const std::vector<bf16_bits>& expected_out, const Pools& pools,
                       const Pools& expected_pools);

// A forward that must be refused before anything is written: runs it from `before` and checks
// that it threw with the backend's prefix, and that out still holds the poison, every pool its
// values and every guard its bytes. Returns the run (its error, for the message's check).
LayerRun check_refused(const LayerRunner& runner, const layer::Layer& layer,
                       const std::vector<bf16_bits>& hidden, const BatchSpec& batch,
                       const Pools& before, const ForwardSettings& settings);

}  // namespace kda::test

#define KDA_LAYER_CAT_(a, b) a##b
#define KDA_LAYER_CAT(a, b) KDA_LAYER_CAT_(a, b)
#define KDA_LAYER_CASE_(name, body)                                                        \
  static void body(const ::kda::test::LayerRunner& runner);                                \
  TEST_CASE(name " [cpu]") { body(::kda::test::cpu_layer_runner()); }                      \
  TEST_CASE(name " [cuda]") {                                                              \
    if (const ::kda::test::LayerRunner* cuda = ::kda::test::cuda_layer_runner_or_skip()) { \
      body(*cuda);                                                                         \
    }                                                                                      \
  }                                                                                        \
  static void body(const ::kda::test::LayerRunner& runner)
#define KDA_LAYER_CASE(name) KDA_LAYER_CASE_(name, KDA_LAYER_CAT(kda_layer_case_, __LINE__))
#define KDA_LAYER_CPU_CASE(name) TEST_CASE(name " [cpu]")
// The body receives `cuda`, the CUDA runner.
#define KDA_LAYER_CUDA_CASE_(name, body)                                                   \
  static void body(const ::kda::test::LayerRunner& cuda);                                  \
  TEST_CASE(name " [cuda]") {                                                              \
    if (const ::kda::test::LayerRunner* cuda = ::kda::test::cuda_layer_runner_or_skip()) { \
      body(*cuda);                                                                         \
    }                                                                                      \
  }                                                                                        \
  static void body([[maybe_unused]] const ::kda::test::LayerRunner& cuda)
#define KDA_LAYER_CUDA_CASE(name) \
  KDA_LAYER_CUDA_CASE_(name, KDA_LAYER_CAT(kda_layer_cuda_case_, __LINE__))
