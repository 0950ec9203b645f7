// engine/model/src/checkpoint.cpp — one safetensors file or a sharded Hugging Face checkpoint.
#include "kda/engine/checkpoint.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>

#include "bounded_json.hpp"
#include "json_error.hpp"
#include "kda/error.hpp"
#include "text_file.hpp"

namespace kda::engine {

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(StatusCode::kInvalidArgument, path + ": " + what);
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

Checkpoint Checkpoint::from_file(SafetensorsFile file) {
  Checkpoint checkpoint;
  checkpoint.path_ = file.path();
  checkpoint.files_.push_back(std::move(file));
  return checkpoint;
}

Checkpoint Checkpoint::open(const std::string& path) {
  std::error_code ec;
  std::string index_path = path;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "model.safetensors.index.json", ec)) {
      index_path = (dir / "model.safetensors.index.json").string();
    } else if (fs::exists(dir / "model.safetensors", ec)) {
      Checkpoint checkpoint =
          from_file(SafetensorsFile::open((dir / "model.safetensors").string()));
      checkpoint.path_ = path;
      return checkpoint;
    } else {
      fail(path, "directory holds neither model.safetensors.index.json nor model.safetensors");
    }
  }
  if (!ends_with(index_path, ".json")) return from_file(SafetensorsFile::open(path));

  // A sharded checkpoint: {"metadata": {...}, "weight_map": {"tensor": "shard file", ...}}.
  const std::string text = read_text_file(
      index_path, "the checkpoint index",
      "it should be the JSON text of model.safetensors.index.json, a map from each tensor's name "
      "to its shard file");
  nlohmann::json index;
  try {
    index = parse_bounded_json(text);
  } catch (const JsonBoundsError& e) {
    fail(index_path, std::string("the checkpoint index ") + e.what());
  } catch (const nlohmann::json::exception& e) {
    // "parse error at line 3, column 7: ...": the position is kept, the library's tag is not.
    fail(index_path, "is not valid JSON: " + json_error_text(e));
  }
  if (!index.is_object()) fail(index_path, "is not a JSON object");
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    fail(index_path, "has no \"weight_map\" object (tensor name -> shard file)");
  }

  Checkpoint checkpoint;
  checkpoint.path_ = index_path;
  const fs::path dir = fs::path(index_path).parent_path();
  std::map<std::string, std::size_t> file_of_shard;
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    if (!it.value().is_string()) {
      fail(index_path, "weight_map entry '" + it.key() + "' is not a file name");
    }
    const std::string shard = it.value().get<std::string>();
    // Shards lie beside the index (Hugging Face's layout): an index downloaded with a model must
    // not make the loader open files elsewhere.
    const fs::path shard_path(shard);
    const bool climbs = std::any_of(shard_path.begin(), shard_path.end(),
                                    [](const fs::path& part) { return part == ".."; });
    if (shard.empty() || shard_path.has_root_path() || climbs) {
      fail(index_path, "weight_map entry '" + it.key() + "' names the shard '" + shard +
                           "', not a file under the index's directory (empty, absolute or "
                           "climbing with '..')");
    }
    auto [position, added] = file_of_shard.emplace(shard, checkpoint.files_.size());
    if (added) checkpoint.files_.push_back(SafetensorsFile::open((dir / shard).string()));
    const SafetensorsFile& file = checkpoint.files_[position->second];
    if (file.find(it.key()) == nullptr) {
      fail(index_path,
           "weight_map puts tensor '" + it.key() + "' in " + shard + ", which does not hold it");
    }
    checkpoint.weight_map_.emplace_back(it.key(), position->second);
  }
  std::sort(checkpoint.weight_map_.begin(), checkpoint.weight_map_.end());
  return checkpoint;
}

const TensorInfo* Checkpoint::find(const std::string& name, const SafetensorsFile** file) const {
  const SafetensorsFile* holder = nullptr;
  if (weight_map_.empty()) {
    if (!files_.empty()) holder = &files_.front();
  } else {
    auto it = std::lower_bound(weight_map_.begin(), weight_map_.end(), name,
                               [](const std::pair<std::string, std::size_t>& entry,
                                  const std::string& key) { return entry.first < key; });
    if (it != weight_map_.end() && it->first == name) holder = &files_[it->second];
  }
  const TensorInfo* info = holder == nullptr ? nullptr : holder->find(name);
  if (file != nullptr) *file = info == nullptr ? nullptr : holder;
  return info;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  if (weight_map_.empty()) {
    for (const SafetensorsFile& file : files_) {
      for (const TensorInfo& t : file.tensors()) names.push_back(t.name);
    }
    std::sort(names.begin(), names.end());
  } else {
    for (const auto& entry : weight_map_) names.push_back(entry.first);  // sorted already
  }
  return names;
}

Tensor Checkpoint::read(const std::string& name) const {
  const SafetensorsFile* file = nullptr;
  if (find(name, &file) == nullptr) fail(path_, "no tensor '" + name + "'");
  return file->read(name);
}

}  // namespace kda::engine
