// ferry-bench elastic: options and entry point.
#pragma once

#include <string>

namespace ferry::bench {

struct ElasticOptions {
  std::string provider = "shm";
  int cycles = 20;         // deaths and replacements of rank 2
  int deadline_ms = 1000;  // each step's deadline: how long a dead rank keeps the others waiting
  int epochs = 3;          // full epochs between a replacement and the next death
};

// Returns the process exit code: 0 when every epoch's outputs were exact, each death lost one
// epoch, and the survivors' open descriptors stayed flat and private memory within 1 % from the
// third cycle to the last.
int RunElasticBench(const ElasticOptions& options);

}  // namespace ferry::bench
