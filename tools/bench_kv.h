// ferry-bench kv: options and entry point.
#pragma once

#include <string>

namespace ferry::bench {

struct KvBenchOptions {
  std::string provider = "shm";
  int tokens = 4096;  // prompt length
  int decoders = 1;   // decode processes fed by the one prefill
  int rounds = 3;     // (raw, ferry) alternations; the median round is reported
  bool json = false;
};

// Returns the process exit code.
int RunKvBench(const KvBenchOptions& options);

}  // namespace ferry::bench
