// ferry-bench fabric: options and entry point.
#pragma once

#include <cstdint>
#include <string>

namespace ferry::bench {

struct FabricBenchOptions {
  std::string provider = "shm";
  uint64_t max_bytes = 64u << 20;  // largest single write
  bool quick = false;              // fewer iterations (make demo)
  bool json = false;
};

// Returns the process exit code.
int RunFabricBench(const FabricBenchOptions& options);

}  // namespace ferry::bench
