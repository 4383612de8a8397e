// ferry-bench scale: the MoE protocol at EP16-64 on the host device, every rank's output
// checked, and what each rank posts per step to each peer through each NIC (the inputs of
// tools/moe_model.py).
#pragma once

#include <string>

namespace ferry::bench {

struct ScaleBenchOptions {
  std::string provider = "shm";
  int ranks = 16;           // EP: one forked process per rank
  int ranks_per_node = 8;   // the simulated node: which peers a GPU would reach over NVLink
  int nics = 2;             // NICs per rank's engine (peers sharded over them)
  int tokens = 128;
  int hidden = 256;         // scaled down from 7168 so that 64 ranks fit one machine
  int experts = 256;
  int topk = 8;
  bool fp8 = true;
  // Also node-once forwarding (Forwarding::kNodeOnce), plain and (a)+(b) inside the node, in
  // the same invocation as the per-rank variants.
  bool node_once = false;
};

// Prints one JSON object (rank 0's gathered report); returns the process exit code: 1 if a
// rank failed or any output differed from what its inputs imply.
int RunScaleBench(const ScaleBenchOptions& options);

}  // namespace ferry::bench
