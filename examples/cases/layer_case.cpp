// examples/cases/layer_case.cpp — a layer case file (case_file.hpp): validate it completely, run
// one whole KDA layer (kda::layer, on the CPU or CUDA), write the result.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>

#include "backend.hpp"
#include "case_file.hpp"
#include "case_metadata.hpp"
#include "kda/bf16.hpp"
#include "kda/engine/checkpoint.hpp"
#include "kda/engine/layer_weights_io.hpp"
#include "kda/error.hpp"
#include "kda/layer/layer.hpp"

namespace kda::engine {

namespace {

const char* const kConvNames[3] = {"conv_state_q", "conv_state_k", "conv_state_v"};
const char* const kCheckpointConvNames[3] = {"checkpoint_conv_state_q", "checkpoint_conv_state_k",
                                             "checkpoint_conv_state_v"};

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw Error(StatusCode::kInvalidArgument, source + ": " + what);
}

// `source: ` in front of a message that does not name it yet.
Error naming(const Error& e, const std::string& source) {
  const std::string what = e.what();
  if (what.rfind(source, 0) == 0) return e;
  return Error(e.code(), source + ": " + what);
}

using detail::parse_case_number;

const TensorInfo& require(const SafetensorsFile& file, const std::string& name,
                          const std::string& why) {
  const TensorInfo* info = file.find(name);
  if (info == nullptr) fail(file.path(), "missing tensor '" + name + "' (" + why + ")");
  return *info;
}

void expect(const std::string& source, const Tensor& t, std::initializer_list<DType> dtypes,
            const std::vector<std::int64_t>& shape, const std::string& shape_text) {
  bool dtype_ok = false;
  std::string names;
  for (const DType d : dtypes) {
    dtype_ok = dtype_ok || t.dtype == d;
    names += std::string(names.empty() ? "" : " or ") + safetensors_dtype_name(d);
  }
  if (!dtype_ok) {
    fail(source, "tensor '" + t.name + "' has dtype " + safetensors_dtype_name(t.dtype) +
                     ", expected " + names);
  }
  if (t.shape != shape) {
    fail(source, "tensor '" + t.name + "' has shape " + shape_to_string(t.shape) + ", expected " +
                     shape_to_string(shape) + " (" + shape_text + ")");
  }
}

}  // namespace

LayerCase load_layer_case(const std::string& path) {
  SafetensorsFile file = SafetensorsFile::open(path);
  const std::map<std::string, std::string> metadata = file.metadata();
  LayerCase c;
  c.source = path;

  // Sizes: from hidden_states and the weights that carry them.
  const TensorInfo& hidden_info = require(file, "hidden_states", "BF16 [T, hidden]");
  if (hidden_info.shape.size() != 2 || hidden_info.shape[1] < 1) {
    fail(path, "tensor 'hidden_states' has shape " + shape_to_string(hidden_info.shape) +
                   ", expected [T, hidden] with hidden >= 1");
  }
  const std::int64_t T = hidden_info.shape[0], E = hidden_info.shape[1];
  const TensorInfo& norm = require(file, "o_norm.weight", "BF16 [head_dim]: gives the head dim");
  if (norm.shape.size() != 1 || norm.shape[0] < 1) {
    fail(path, "tensor 'o_norm.weight' has shape " + shape_to_string(norm.shape) +
                   ", expected [head_dim]");
  }
  const TensorInfo& beta = require(file, "b_proj.weight", "BF16 [heads, hidden]: gives the heads");
  if (beta.shape.size() != 2 || beta.shape[0] < 1) {
    fail(path, "tensor 'b_proj.weight' has shape " + shape_to_string(beta.shape) +
                   ", expected [heads, hidden]");
  }
  const TensorInfo& conv = require(file, "q_conv1d.weight", "[H*D, 1, W]: gives the conv width W");
  if ((conv.shape.size() != 3 && conv.shape.size() != 2) || conv.shape.back() < 1) {
    fail(path, "tensor 'q_conv1d.weight' has shape " + shape_to_string(conv.shape) +
                   ", expected [H*D, 1, W]");
  }
  layer::Config config;
  config.hidden_size = E;
  config.num_heads = beta.shape[0];
  config.head_dim = norm.shape[0];
  config.conv_width = conv.shape.back();
  // The output gate's form is told by its tensors: g_proj (full rank, Kimi K3) or g_a_proj /
  // g_b_proj (low rank); a file holding both is refused when the weights are read.
  config.full_rank_gate = file.find("g_proj.weight") != nullptr;

  // Metadata.
  detail::read_case_gate(metadata, path, &config.gate, &config.lower_bound);
  if (const auto eps = metadata.find("norm_eps"); eps != metadata.end()) {
    double value = 0.0;
    if (!parse_case_number(eps->second, &value) || !std::isfinite(value) || value <= 0.0 ||
        !(static_cast<float>(value) > 0.0f)) {
      fail(path, "metadata 'norm_eps' is '" + eps->second + "', expected a finite number > 0" +
                     (std::isfinite(value) && value > 0.0 ? " (as a float it is 0)" : ""));
    }
    config.norm_eps = static_cast<float>(value);
  }
  try {
    validate(config);
  } catch (const Error& e) {
    throw naming(e, path);
  }
  const std::int64_t H = config.num_heads, D = config.head_dim, C = H * D;
  const std::int64_t W1 = config.conv_width - 1;

  c.hidden = file.read("hidden_states");
  expect(path, c.hidden, {DType::kBF16}, {T, E}, "[T, hidden]");
  c.tokens = T;
  bool decode = false;
  if (const auto mode = metadata.find("mode"); mode != metadata.end()) {
    decode = mode->second == "decode";
    if (!decode && mode->second != "prefill") {
      fail(path, "metadata 'mode' is '" + mode->second + "', expected prefill or decode");
    }
  }
  if (decode) {
    // N rows of `tokens` tokens each, as one verify step.
    const auto tokens = metadata.find("tokens");
    double value = 0.0;
    if (tokens == metadata.end() || !parse_case_number(tokens->second, &value) ||
        value != std::floor(value) || value < 1 || value > static_cast<double>(kMaxDecodeTokens)) {
      fail(path,
           "metadata 'tokens' is " +
               (tokens == metadata.end() ? std::string("missing") : "'" + tokens->second + "'") +
               ", expected the tokens of each row in decode mode, 1 to " +
               std::to_string(kMaxDecodeTokens));
    }
    c.decode_tokens = static_cast<std::int64_t>(value);
    if (T % c.decode_tokens != 0 || T == 0) {
      fail(path, "tensor 'hidden_states' has " + std::to_string(T) + " rows, not a whole number " +
                     "of rows of " + std::to_string(c.decode_tokens) +
                     " tokens (metadata 'tokens')");
    }
    for (const char* name : {"cu_seqlens", "checkpoint_offsets"}) {
      if (file.find(name) != nullptr) {
        fail(path, std::string("tensor '") + name +
                       "' is given, but decode mode takes none (N rows of 'tokens' tokens each)");
      }
    }
    for (std::int64_t n = 0; n <= T / c.decode_tokens; ++n) {
      c.cu_seqlens.push_back(n * c.decode_tokens);
    }
  } else if (file.find("cu_seqlens") != nullptr) {
    const Tensor cu = file.read("cu_seqlens");
    if ((cu.dtype != DType::kI64 && cu.dtype != DType::kI32) || cu.shape.size() != 1 ||
        cu.shape[0] < 2) {
      fail(path, "tensor 'cu_seqlens' is " + std::string(safetensors_dtype_name(cu.dtype)) + " " +
                     shape_to_string(cu.shape) + ", expected I64 or I32 [N + 1] with N >= 1");
    }
    const std::int64_t N = cu.shape[0] - 1;
    for (std::int64_t i = 0; i <= N; ++i) {
      c.cu_seqlens.push_back(cu.dtype == DType::kI64 ? cu.data_as<std::int64_t>()[i]
                                                     : cu.data_as<std::int32_t>()[i]);
    }
    // The operator's rule, T being the rows of hidden_states.
    if (const Status st = validate_cu_seqlens(c.cu_seqlens.data(), N, T); !st.ok()) {
      fail(path, st.message() + " (T: the rows of hidden_states)");
    }
  } else {
    c.cu_seqlens = {0, T};
  }
  const std::int64_t N = static_cast<std::int64_t>(c.cu_seqlens.size()) - 1;
  c.sequences = N;
  for (int i = 0; i < 3; ++i) {
    if (file.find(kConvNames[i]) == nullptr) continue;
    c.conv_state[i] = file.read(kConvNames[i]);
    expect(path, c.conv_state[i], {DType::kBF16}, {N, C, W1}, "[N, heads * head_dim, W - 1]");
  }
  c.final_dtype = DType::kF32;
  if (file.find("recurrent_state") != nullptr) {
    c.recurrent_state = file.read("recurrent_state");
    expect(path, c.recurrent_state, {DType::kF32, DType::kBF16}, {N, H, D, D}, "[N, H, V, K]");
    c.final_dtype = c.recurrent_state.dtype;
  }
  c.final_dtype = detail::read_case_final_state(metadata, path, c.final_dtype);
  if (decode && c.final_dtype == DType::kNone) {
    fail(path,
         "metadata 'final_state' is 'none', but decode mode always writes its states (f32 "
         "or bf16)");
  }
  if (file.find("checkpoint_offsets") != nullptr) {
    const Tensor offsets = file.read("checkpoint_offsets");
    if (offsets.dtype != DType::kI64 && offsets.dtype != DType::kI32) {
      fail(path, "tensor 'checkpoint_offsets' has dtype " +
                     std::string(safetensors_dtype_name(offsets.dtype)) + ", expected I64 or I32");
    }
    if (offsets.shape.size() != 2 || offsets.shape[0] != N || offsets.shape[1] < 1) {
      fail(path, "tensor 'checkpoint_offsets' has shape " + shape_to_string(offsets.shape) +
                     ", expected [" + std::to_string(N) + ", R] (N = " + std::to_string(N) +
                     " sequences, R >= 1 requests each)");
    }
    c.checkpoints = offsets.shape[1];
    for (std::int64_t i = 0; i < offsets.numel(); ++i) {
      c.checkpoint_offsets.push_back(offsets.dtype == DType::kI64
                                         ? offsets.data_as<std::int64_t>()[i]
                                         : offsets.data_as<std::int32_t>()[i]);
    }
  }

  // The weights, by their checkpoint names (messages name the file and the tensor).
  const Checkpoint checkpoint = Checkpoint::from_file(std::move(file));
  try {
    c.weights = load_layer_weights(checkpoint, -1, config);
  } catch (const Error& e) {
    // The shapes a weight is held to come from other tensors: a shape error says which, so that a
    // wrong hidden_states width is not taken for a wrong weight.
    const Error named = naming(e, path);
    if (std::string(named.what()).find("' has shape ") == std::string::npos) throw named;
    throw Error(named.code(), std::string(named.what()) + " (the sizes expected: hidden " +
                                  std::to_string(E) + " from hidden_states, heads " +
                                  std::to_string(H) + " from b_proj.weight, head_dim " +
                                  std::to_string(D) + " from o_norm.weight, W " +
                                  std::to_string(config.conv_width) + " from q_conv1d.weight)");
  }
  return c;
}

std::vector<Tensor> run_layer_case(const LayerCase& lc, BackendChoice choice, Backend* used) {
  const layer::Config& config = lc.weights.config;
  const std::string where = lc.source.empty() ? std::string("layer case") : lc.source;
  const std::int64_t T = lc.tokens, N = lc.sequences, E = config.hidden_size;
  const std::int64_t H = config.num_heads, D = config.head_dim, C = H * D;
  const std::int64_t W1 = config.conv_width - 1;
  const std::int64_t R = lc.checkpoints;
  const Backend backend = choose_backend(
      choice, [&config] { return layer::can_implement(Backend::kCuda, config).ok(); });

  // Host copies of the states (the pools), filled from the inputs or zero. With checkpoints the
  // pools have N + N * R rows: sequence n on row n, its request r on row N + n * R + r. The
  // checkpoints are written in the recurrent pool's dtype: final_state's, f32 when that is none.
  const DType pool_dtype =
      lc.final_dtype != DType::kNone
          ? lc.final_dtype
          : (lc.recurrent_state.data.empty() || R > 0 ? DType::kF32 : lc.recurrent_state.dtype);
  // Decode mode: row n's token t keeps its states on pool row n * Td + t; the row starts from
  // row n * Td (its initial states copied there), as a verify step with one accepted token.
  const std::int64_t Td = lc.decode_tokens;
  const std::int64_t rows = Td > 0 ? N * Td : N + N * R;
  const std::int64_t first_row_stride = Td > 0 ? Td : 1;  // pool row of sequence n's start: n * it
  const auto conv_row = static_cast<std::size_t>(C * W1);
  const auto state_row = static_cast<std::size_t>(H * D * D);
  const std::size_t conv_count = static_cast<std::size_t>(rows) * conv_row;
  const std::size_t state_count = static_cast<std::size_t>(rows) * state_row;
  std::vector<bf16_bits> conv[3];
  for (int i = 0; i < 3; ++i) {
    conv[i].assign(conv_count, 0);
    for (std::int64_t n = 0; n < N && !lc.conv_state[i].data.empty(); ++n) {
      std::memcpy(conv[i].data() + static_cast<std::size_t>(n * first_row_stride) * conv_row,
                  lc.conv_state[i].data.data() + static_cast<std::size_t>(n) * conv_row * 2,
                  conv_row * sizeof(bf16_bits));
    }
  }
  std::vector<std::uint8_t> recurrent =
      detail::case_state_values(lc.recurrent_state, pool_dtype, state_count);
  if (Td > 1) {  // sequence n's initial state from row n to row n * Td, the rows between zero
    const std::size_t bytes = state_row * dtype_size(pool_dtype);
    for (std::int64_t n = N - 1; n >= 1; --n) {
      std::memcpy(recurrent.data() + static_cast<std::size_t>(n * Td) * bytes,
                  recurrent.data() + static_cast<std::size_t>(n) * bytes, bytes);
      std::memset(recurrent.data() + static_cast<std::size_t>(n) * bytes, 0, bytes);
    }
  }
  std::vector<std::int32_t> slots, checkpoint_slots, accepted;
  if (Td > 0) {
    for (std::int64_t i = 0; i < N * Td; ++i) slots.push_back(static_cast<std::int32_t>(i));
    accepted.assign(static_cast<std::size_t>(N), 1);
  }
  if (R > 0) {
    for (std::int64_t n = 0; n < N; ++n) slots.push_back(static_cast<std::int32_t>(n));
    for (std::int64_t i = 0; i < N * R; ++i) {
      checkpoint_slots.push_back(lc.checkpoint_offsets[static_cast<std::size_t>(i)] >= 0
                                     ? static_cast<std::int32_t>(N + i)
                                     : -1);
    }
  }
  Tensor out = Tensor::zeros("out", DType::kBF16, {T, E});

  try {
    // Every tensor in the backend's memory (host memory on the CPU), freed after the backend is
    // done with it.
    std::unique_ptr<EngineBackend> b = make_engine_backend(backend, BackendOptions{}, where);
    const std::unique_ptr<layer::Layer> layer = layer::make_layer(backend, lc.weights);
    std::vector<BackendBuffer> buffers;
    auto upload = [&](const void* src, std::size_t bytes, const char* what) {
      buffers.emplace_back(*b, bytes, what);
      b->copy_to_device(buffers.back().get(), src, bytes);
      return static_cast<void*>(buffers.back().get());
    };
    auto* hidden = upload(lc.hidden.data.data(), lc.hidden.data.size(), "hidden_states");
    void* conv_device[3];
    for (int i = 0; i < 3; ++i) {
      conv_device[i] = upload(conv[i].data(), conv_count * sizeof(bf16_bits), kConvNames[i]);
    }
    void* state_device = upload(recurrent.data(), recurrent.size(), "recurrent_state");
    auto* cu =
        upload(lc.cu_seqlens.data(), lc.cu_seqlens.size() * sizeof(std::int64_t), "cu_seqlens");
    buffers.emplace_back(*b, out.data.size(), "out");
    void* out_device = buffers.back().get();
    const std::size_t workspace_bytes = layer::workspace_bytes(backend, config, T, N, rows);
    buffers.emplace_back(*b, workspace_bytes, "the workspace");
    void* workspace = buffers.back().get();
    const layer::State state{rows,
                             static_cast<bf16_bits*>(conv_device[0]),
                             static_cast<bf16_bits*>(conv_device[1]),
                             static_cast<bf16_bits*>(conv_device[2]),
                             state_device,
                             pool_dtype};
    layer::Batch batch;
    batch.tokens = T;
    batch.sequences = N;
    batch.cu_seqlens = reinterpret_cast<const std::int64_t*>(cu);
    batch.cu_seqlens_host = lc.cu_seqlens.data();
    if (Td > 0) {
      batch.decode_tokens = Td;
      batch.cu_seqlens = nullptr;
      batch.cu_seqlens_host = nullptr;
      batch.slots = static_cast<const std::int32_t*>(
          upload(slots.data(), slots.size() * sizeof(std::int32_t), "slots"));
      batch.slots_host = slots.data();
      batch.num_accepted = static_cast<const std::int32_t*>(
          upload(accepted.data(), accepted.size() * sizeof(std::int32_t), "num_accepted"));
      batch.num_accepted_host = accepted.data();
    }
    if (R > 0) {
      batch.slots = static_cast<const std::int32_t*>(
          upload(slots.data(), slots.size() * sizeof(std::int32_t), "slots"));
      batch.slots_host = slots.data();
      batch.checkpoints = R;
      batch.checkpoint_offsets = static_cast<const std::int64_t*>(
          upload(lc.checkpoint_offsets.data(), lc.checkpoint_offsets.size() * sizeof(std::int64_t),
                 "checkpoint_offsets"));
      batch.checkpoint_slots = static_cast<const std::int32_t*>(
          upload(checkpoint_slots.data(), checkpoint_slots.size() * sizeof(std::int32_t),
                 "checkpoint_slots"));
    }
    layer::RunOptions options;
    options.stream = b->stream();
    layer->forward(batch, reinterpret_cast<const bf16_bits*>(hidden),
                   static_cast<bf16_bits*>(out_device), state,
                   Workspace{workspace, workspace_bytes}, options);
    b->copy_to_host(out.data.data(), out_device, out.data.size());
    for (int i = 0; i < 3; ++i) {
      b->copy_to_host(conv[i].data(), conv_device[i], conv_count * sizeof(bf16_bits));
    }
    b->copy_to_host(recurrent.data(), state_device, recurrent.size());
    b->synchronize();
  } catch (const Error& e) {
    throw naming(e, where);
  }
  if (used != nullptr) *used = backend;

  // Rows [first, first + count) of a pool as a tensor; rows whose checkpoint slot is -1 are zeros.
  const std::size_t state_row_bytes = state_row * dtype_size(pool_dtype);
  // With `stride` > 1 (decode mode's final states), row i of the tensor is pool row
  // first + i * stride.
  auto rows_of = [&](const char* name, DType dtype, const std::uint8_t* pool, std::size_t row_bytes,
                     std::vector<std::int64_t> shape, std::int64_t first, bool checkpoint_rows,
                     std::int64_t count = -1, std::int64_t stride = 1) {
    Tensor t = Tensor::zeros(name, dtype, std::move(shape));
    if (count < 0) count = checkpoint_rows ? N * R : N;
    for (std::int64_t i = 0; i < count; ++i) {
      if (checkpoint_rows && checkpoint_slots[static_cast<std::size_t>(i)] < 0) continue;
      std::memcpy(t.data.data() + static_cast<std::size_t>(i) * row_bytes,
                  pool + static_cast<std::size_t>(first + i * stride) * row_bytes, row_bytes);
    }
    return t;
  };
  auto conv_bytes = [&](int i) { return reinterpret_cast<const std::uint8_t*>(conv[i].data()); };
  std::vector<Tensor> outputs;
  outputs.push_back(std::move(out));
  if (Td > 0) {
    // The final states: each row's state after its last token; then every token's.
    for (int i = 0; i < 3; ++i) {
      outputs.push_back(rows_of(kConvNames[i], DType::kBF16, conv_bytes(i),
                                conv_row * sizeof(bf16_bits), {N, C, W1}, Td - 1, false, N, Td));
    }
    outputs.push_back(rows_of("recurrent_state", pool_dtype, recurrent.data(), state_row_bytes,
                              {N, H, D, D}, Td - 1, false, N, Td));
    outputs.push_back(rows_of("intermediate_states", pool_dtype, recurrent.data(), state_row_bytes,
                              {N, Td, H, D, D}, 0, false, N * Td));
    const char* names[3] = {"intermediate_conv_state_q", "intermediate_conv_state_k",
                            "intermediate_conv_state_v"};
    for (int i = 0; i < 3; ++i) {
      outputs.push_back(rows_of(names[i], DType::kBF16, conv_bytes(i), conv_row * sizeof(bf16_bits),
                                {N, Td, C, W1}, 0, false, N * Td));
    }
    return outputs;
  }
  if (lc.final_dtype != DType::kNone) {
    for (int i = 0; i < 3; ++i) {
      outputs.push_back(rows_of(kConvNames[i], DType::kBF16, conv_bytes(i),
                                conv_row * sizeof(bf16_bits), {N, C, W1}, 0, false));
    }
    outputs.push_back(rows_of("recurrent_state", pool_dtype, recurrent.data(), state_row_bytes,
                              {N, H, D, D}, 0, false));
  }
  if (R > 0) {
    outputs.push_back(rows_of("checkpoint_states", pool_dtype, recurrent.data(), state_row_bytes,
                              {N, R, H, D, D}, N, true));
    for (int i = 0; i < 3; ++i) {
      outputs.push_back(rows_of(kCheckpointConvNames[i], DType::kBF16, conv_bytes(i),
                                conv_row * sizeof(bf16_bits), {N, R, C, W1}, N, true));
    }
  }
  return outputs;
}

void run_layer_case_file(const std::string& input_path, const std::string& output_path,
                         BackendChoice backend, Backend* used) {
  check_output_is_not_input(input_path, output_path);
  const LayerCase layer_case = load_layer_case(input_path);
  Backend ran = Backend::kCpu;
  const std::vector<Tensor> outputs = run_layer_case(layer_case, backend, &ran);
  const std::map<std::string, std::string> metadata = {
      {"backend", to_string(ran)},
      {"gate", to_string(layer_case.weights.config.gate)},
      {"producer", "kda-run --layer-case"},
  };
  save_safetensors(output_path, outputs, metadata);
  if (used != nullptr) *used = ran;
}

}  // namespace kda::engine
