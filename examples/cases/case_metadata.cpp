#include "case_metadata.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "kda/bf16.hpp"
#include "kda/error.hpp"
#include "kda/kda.hpp"

namespace kda::engine::detail {

void case_fail(const std::string& source, const std::string& what) {
  throw Error(StatusCode::kInvalidArgument, source + ": " + what);
}

bool parse_case_number(const std::string& text, double* value) {
  // Decimal only, as written by the tools that make case files: no leading space (strtod skips
  // it, where a trailing one is refused) and no hexadecimal ("0x2", "0x1p-3").
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front())) ||
      text.find_first_of("xX") != std::string::npos) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const double parsed = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return false;
  *value = parsed;
  return true;
}

std::string case_number_text(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

void read_case_gate(const CaseMetadata& metadata, const std::string& source, GateMode* gate,
                    float* lower_bound) {
  const auto gate_it = metadata.find("gate");
  if (gate_it == metadata.end()) {
    case_fail(source, "metadata 'gate' is missing (lower_bound or softplus)");
  }
  if (gate_it->second == "lower_bound") {
    *gate = GateMode::kLowerBound;
  } else if (gate_it->second == "softplus") {
    *gate = GateMode::kSoftplus;
  } else {
    case_fail(source,
              "metadata 'gate' is '" + gate_it->second + "', expected lower_bound or softplus");
  }
  const auto bound_it = metadata.find("lower_bound");
  if (*gate == GateMode::kLowerBound && bound_it == metadata.end()) {
    case_fail(source, "metadata 'lower_bound' is required with gate lower_bound");
  }
  if (*gate == GateMode::kSoftplus && bound_it != metadata.end()) {
    // A model description refuses a stray bound too: a file that names one probably meant the
    // bounded gate, and running it as softplus would compare against the wrong reference.
    case_fail(source, "metadata 'lower_bound' is given with gate softplus, which takes none");
  }
  if (bound_it != metadata.end()) {
    double bound = 0.0;
    if (!parse_case_number(bound_it->second, &bound)) {
      case_fail(source, "metadata 'lower_bound' is '" + bound_it->second + "', not a number");
    }
    // Shown as written.
    if (const Status st = lower_bound_from_double(bound, lower_bound); !st.ok()) {
      case_fail(source, "metadata 'lower_bound' is " + bound_it->second + ", " + st.message());
    }
  }
}

DType read_case_final_state(const CaseMetadata& metadata, const std::string& source,
                            DType fallback) {
  const auto it = metadata.find("final_state");
  if (it == metadata.end()) return fallback;
  if (it->second == "f32") return DType::kF32;
  if (it->second == "bf16") return DType::kBF16;
  if (it->second == "none") return DType::kNone;
  case_fail(source, "metadata 'final_state' is '" + it->second + "', expected f32, bf16 or none");
}

std::vector<std::uint8_t> case_state_values(const Tensor& initial, DType dtype, std::size_t count) {
  std::vector<std::uint8_t> values(count * dtype_size(dtype), 0);
  const std::size_t given =
      std::min(count, initial.data.size() / std::max<std::size_t>(1, dtype_size(initial.dtype)));
  if (initial.dtype == dtype) {
    if (given > 0) std::memcpy(values.data(), initial.data.data(), given * dtype_size(dtype));
    return values;
  }
  for (std::size_t i = 0; i < given; ++i) {
    if (dtype == DType::kF32) {  // bf16 -> f32: exact
      const float v = bf16_to_float(initial.data_as<bf16_bits>()[i]);
      std::memcpy(values.data() + i * 4, &v, 4);
    } else {  // f32 -> bf16, round to nearest even
      const bf16_bits v = float_to_bf16(initial.data_as<float>()[i]);
      std::memcpy(values.data() + i * 2, &v, 2);
    }
  }
  return values;
}

}  // namespace kda::engine::detail
