// KvCudaShards::Create's argument checks, the same in builds with and without CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/bootstrap.h"
#include "ferry/status.h"

namespace ferry {

inline Status CheckCudaShardsArgs(const Bootstrap& bootstrap, int leader, int64_t bytes) {
  if (leader < 0 || leader >= bootstrap.world_size()) {
    return InvalidArgumentError("KvCudaShards: leader " + std::to_string(leader) +
                                " is not a rank of the bootstrap");
  }
  if (bytes <= 0) return InvalidArgumentError("KvCudaShards: bytes must be positive");
  return Status::Ok();
}

}  // namespace ferry
