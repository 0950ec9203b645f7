#include "full_layer_checks.hpp"

#include <cmath>
#include <string>

#include "kda/engine/error.hpp"

namespace kda::engine::detail {

Problem full_layer_core_problem(const FullLayerConfig& c, std::int64_t tokens,
                                std::int64_t sequences, std::int64_t num_slots, bool slot_list,
                                DType state_dtype) {
  Problem p;
  p.seq_len = tokens;
  p.num_heads = c.local_heads();
  p.head_dim_k = p.head_dim_v = c.head_dim;
  p.num_seqs = sequences;
  p.cu_seqlens_dtype = DType::kI64;
  p.gate = c.gate;
  p.lower_bound = c.lower_bound;
  p.initial_state_dtype = p.final_state_dtype = state_dtype;
  p.num_state_slots = slot_list ? num_slots : 0;
  return p;
}

void check_gate_weights(const std::vector<float>& A_log, const std::vector<float>& dt_bias) {
  for (std::size_t h = 0; h < A_log.size(); ++h) {
    if (!std::isfinite(A_log[h]) || std::fabs(A_log[h]) > kMaxAbsALog) {
      throw Error(StatusCode::kInvalidArgument, "KDA layer weights: A_log[" + std::to_string(h) +
                                                    "] = " + std::to_string(A_log[h]) +
                                                    " is not finite or outside [-20, 20]");
    }
  }
  for (std::size_t i = 0; i < dt_bias.size(); ++i) {
    if (!std::isfinite(dt_bias[i])) {
      throw Error(StatusCode::kInvalidArgument,
                  "KDA layer weights: dt_bias[" + std::to_string(i) + "] is not finite");
    }
  }
}

void check_state_pools(const FullLayerState& state, std::int64_t sequences, std::int64_t conv_width,
                       const char* what) {
  if (sequences <= 0) return;
  const bool conv_missing = conv_width > 1 && (state.conv_q == nullptr || state.conv_k == nullptr ||
                                               state.conv_v == nullptr);
  if (state.recurrent == nullptr || conv_missing) {
    throw Error(StatusCode::kInvalidArgument, std::string(what) + ": a state pool is null");
  }
  if (state.recurrent_dtype != DType::kF32 && state.recurrent_dtype != DType::kBF16) {
    throw Error(StatusCode::kInvalidArgument, std::string(what) + ": recurrent state dtype " +
                                                  to_string(state.recurrent_dtype) +
                                                  " is not f32 or bf16");
  }
}

void check_hidden_and_out(const void* hidden, const void* out, std::int64_t tokens,
                          std::int64_t hidden_size, const char* what) {
  if (tokens <= 0) return;
  if (hidden == nullptr || out == nullptr) {
    throw Error(StatusCode::kInvalidArgument, std::string(what) + ": hidden or out is null");
  }
  const auto* h = static_cast<const unsigned char*>(hidden);
  const auto* o = static_cast<const unsigned char*>(out);
  const std::size_t bytes = static_cast<std::size_t>(tokens * hidden_size) * 2;
  if (h < o + bytes && o < h + bytes) {
    throw Error(StatusCode::kInvalidArgument, std::string(what) + ": out overlaps hidden");
  }
}

void check_weight_region(const void* image, std::size_t bytes, std::size_t needed,
                         std::size_t alignment, const char* what) {
  const std::string region = std::string(what) + ": the weight image region ";
  if (image == nullptr) throw Error(StatusCode::kInvalidArgument, region + "is null");
  if (reinterpret_cast<std::uintptr_t>(image) % alignment != 0) {
    throw Error(StatusCode::kInvalidArgument,
                region + "is not " + std::to_string(alignment) + "-byte aligned");
  }
  if (bytes < needed) {
    throw Error(StatusCode::kInvalidArgument, region + "is too small: " + std::to_string(bytes) +
                                                  " bytes, the layer's weights need " +
                                                  std::to_string(needed) + " (weight_image_bytes)");
  }
}

}  // namespace kda::engine::detail
