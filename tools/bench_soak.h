// ferry-bench soak: options and entry point.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/bootstrap.h"

namespace ferry::bench {

struct SoakOptions {
  std::string provider = "shm";
  int64_t cycles = 1000000;   // MoE dispatch + combine cycles per rank (host device, 4 ranks)
  int64_t requests = 100000;  // KV requests, over all decoders
  int seconds = 0;            // > 0: each phase also stops after this long
  int decoders = 2;           // decode processes, each a new engine every `churn` requests
  int churn = 100;
  std::string only;  // "moe" or "kv": that phase alone
  // Ranks started apart and met at a rendezvous (--rendezvous): the moe phase alone, on them.
  Bootstrap* world = nullptr;
};

// Returns the process exit code: 0 when both phases ran without an error and every process's
// private resident memory and open descriptors grew by at most 1 % from the first sample to the
// last.
int RunSoakBench(const SoakOptions& options);

}  // namespace ferry::bench
