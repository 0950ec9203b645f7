// kda/engine/checkpoint.hpp — a Hugging Face checkpoint: one safetensors file, or several shards
// listed by a `model.safetensors.index.json`.
//
// Checkpoint::open(path) accepts
//   - a .safetensors file;
//   - an index file (`*.index.json`, Hugging Face's sharded layout): {"weight_map": {"tensor name":
//     "shard file name", ...}, ...}, shard names relative to the index's directory (an empty or
//     absolute name, or one with a '..' component, is refused);
//   - a directory holding `model.safetensors.index.json` or else `model.safetensors`.
// Every shard the index names is opened (its header read and validated, no tensor data) when the
// checkpoint is opened; tensor data is read on demand. An index entry whose shard lacks the tensor,
// an index that does not parse, or a shard that is missing throws kda::Error naming the file.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kda/engine/safetensors.hpp"

namespace kda::engine {

class Checkpoint {
 public:
  // Throws kda::Error (kInvalidArgument) naming the path and the problem.
  static Checkpoint open(const std::string& path);
  // A checkpoint made of one already opened file (tests, case files).
  static Checkpoint from_file(SafetensorsFile file);

  // What was opened: the file, the index or the directory.
  const std::string& path() const noexcept { return path_; }

  // The header entry of `name` and the file holding it; nullptr when no shard has it.
  const TensorInfo* find(const std::string& name, const SafetensorsFile** file = nullptr) const;
  // Reads one tensor. Throws kda::Error when absent (naming the tensor and the checkpoint).
  Tensor read(const std::string& name) const;
  // Every tensor's name, sorted (what the index lists, or the one file holds).
  std::vector<std::string> tensor_names() const;

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  // For an index: tensor name -> position in files_, sorted by name. Empty for a single file.
  std::vector<std::pair<std::string, std::size_t>> weight_map_;
};

}  // namespace kda::engine
