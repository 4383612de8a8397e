// What the KV messenger's tests share: each side's memory on a node (Shards) and the layer count
// their model streams.
#pragma once

#include <cstdint>
#include <vector>

#include "ferry/fabric.h"
#include "ferry/kv.h"
#include "ferry/status.h"

namespace ferry::kv_test {

constexpr int kLayers = 3;

// One side's memory on this node: one region per TP rank, layers back to back.
struct Shards {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<MemoryRegion> regs;
  KvRegions regions;

  Status Init(TransferEngine& e, const KvSide& side, int pages_per_layer) {
    const int64_t stride = side.page_bytes() * pages_per_layer;
    bytes.assign(side.tp, std::vector<uint8_t>(stride * kLayers, 0));
    for (auto& b : bytes) {
      ASSIGN_OR_RETURN(MemoryRegion r, e.RegisterMemory(b.data(), b.size()));
      regs.push_back(std::move(r));
    }
    for (auto& r : regs) regions.ranks.push_back(&r);
    regions.num_layers = kLayers;
    regions.layer_stride = stride;
    return Status::Ok();
  }
};

}  // namespace ferry::kv_test
