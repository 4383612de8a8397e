// ferry-bench fabric: options and entry point.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/bootstrap.h"

namespace ferry::bench {

struct FabricBenchOptions {
  std::string provider = "shm";
  uint64_t max_bytes = 64u << 20;  // largest single write
  bool quick = false;              // fewer iterations (make demo)
  bool json = false;
  // --rendezvous (--world-size 2): the two ranks were started apart and met there; this process
  // is world->rank(), and only rank 0 prints the figures. Null: both ranks forked here.
  Bootstrap* world = nullptr;
};

// Returns the process exit code.
int RunFabricBench(const FabricBenchOptions& options);

}  // namespace ferry::bench
