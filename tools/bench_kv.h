// ferry-bench kv: options and entry point.
#pragma once

#include <string>

#include "ferry/bootstrap.h"

namespace ferry::bench {

struct KvBenchOptions {
  std::string provider = "shm";
  int tokens = 4096;  // prompt length
  int decoders = 1;   // decode processes fed by the one prefill
  int rounds = 3;     // (raw, ferry) alternations; the median round is reported
  // The model's layer spacing as a multiple of one layer's raw transfer time. 1: compute and
  // transfer balanced (ratio measures throughput; any shortfall piles into the tail). Above 1:
  // layers computed slower than they move, as in a compute-bound prefill -- the tail then shows
  // the last layer's transfer and the ready signal alone; the ratio is at most 1 / pace.
  double pace = 1.0;
  bool json = false;
  // --rendezvous: the prefill (rank 0) and decoders were started apart and met there; this
  // process is world->rank(), and only rank 0 prints the figures. Null: ranks forked here.
  Bootstrap* world = nullptr;
};

// Returns the process exit code.
int RunKvBench(const KvBenchOptions& options);

}  // namespace ferry::bench
