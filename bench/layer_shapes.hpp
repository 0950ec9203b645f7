// layer_shapes.hpp — the whole layer's three benchmark shapes, shared by kda-layer-bench and the
// layer probes: Kimi-Linear-48B (hidden 2304, H = 32, softplus gate), its TP8 shard (H = 4 of 32),
// and Kimi K3's TP8 shard (hidden 7168, H = 12 of 96, bounded gate -5, full-rank output gate); D =
// 128, conv width 4.
#pragma once

#include <vector>

#include "kda/layer/layer.hpp"

namespace kda::bench {

struct LayerShape {
  const char* key;   // what --shape names
  const char* name;  // the tables' row name
  kda::layer::Config config;
};

inline std::vector<LayerShape> layer_shapes() {
  auto config = [](std::int64_t hidden, std::int64_t heads, int tp_size, kda::GateMode gate,
                   bool full_rank_gate) {
    kda::layer::Config c;
    c.hidden_size = hidden;
    c.num_heads = heads;
    c.head_dim = 128;
    c.conv_width = 4;
    c.gate = gate;
    c.lower_bound = -5.0f;
    c.full_rank_gate = full_rank_gate;
    c.tp_size = tp_size;
    c.tp_rank = 0;
    return c;
  };
  return {{"h32", "H = 32", config(2304, 32, 1, kda::GateMode::kSoftplus, false)},
          {"tp8", "TP8 shard (H = 4)", config(2304, 32, 8, kda::GateMode::kSoftplus, false)},
          {"k3", "K3 TP8 shard (H = 12)", config(7168, 96, 8, kda::GateMode::kLowerBound, true)}};
}

}  // namespace kda::bench
