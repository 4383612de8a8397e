// ferry-bench moe: options and entry point.
#pragma once

#include <string>

#include "ferry/bootstrap.h"
#include "ferry/moe.h"

namespace ferry::bench {

struct MoeBenchOptions {
  std::string provider = "shm";
  int ranks = 2;
  int tokens = 128;
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  bool fp8 = true;
  // --fp16-combine: the combine's 2-byte rows and output taken as fp16 (CombineInput /
  // CombineOutput::fp16): the same bytes, summed as fp16 (the rows' values are then not the
  // experts' but the timing is the combine's).
  bool fp16_combine = false;
  int private_tokens = 16;
  // --stream: AllToAllConfig::streaming as a mask, 1 the dispatch, 2 the combine, 3 both, 0
  // neither; -1 (unset) kAuto.
  int stream = -1;
  bool once_per_rank = false;          // option (a)
  bool reduce_at_expert_rank = false;  // option (b)
  bool compare = false;                // plain, (a), (b), (a)+(b) in one invocation
  // --token-major: after the variants above, (a)+(b) once more with the token-major dispatch
  // layout (DispatchLayout::kTokenMajor), in the same invocation.
  bool token_major = false;
  // The token-major variant once more with the caller's side timed in: a permute into expert
  // groups after DispatchRecv and the weighted un-permute before CombineSend
  // (bench_moe_caller.h). Added by --token-major on the CUDA device; not an option of its own.
  bool caller = false;
  // --mask-lost-peers: each variant once more under AllToAllConfig::mask_lost_peers (shrink
  // mode; no rank is lost, so what it costs a healthy step), in the same invocation.
  bool mask_lost_peers = false;
  bool masked_variant = false;  // this run is that second one (set per variant, not a flag)
  // --wait-cost: each variant (but the shrink-mode ones) once more with the receive steps'
  // per-rank wait costs counted (DispatchOutput / CombineOutput::wait_cost, DeepEP's
  // *_wait_recv_cost_stats), in the same invocation: what a caller that asks for them pays.
  bool wait_cost = false;
  bool cost_variant = false;  // this run is that one (set per variant, not a flag)
  int iters = 50;
  // --timeout-ms: how long each host-device step, and the barrier before each iteration, waits
  // for the other ranks (a lost or unreachable peer fails the run this long after).
  int step_timeout_ms = 60000;
  int warmup = 5;
  bool json = false;
  bool cuda = false;  // --device cuda: the CUDA device, GPU buffers (rank r on GPU r mod count)
  // --nvlink: the ranks are one node (ranks_per_node = ranks): the CUDA NVLink path, timed on
  // the GPU from CUDA graph replays, next to the NVLink floor.
  bool nvlink = false;
  // --node-ranks N (with --nvlink): nodes of N ranks, NVLink inside and the relay over the
  // provider between them; 0: one node.
  int node_ranks = 0;
  // --node-once (with --node-ranks): each variant once more with node-once forwarding
  // (Forwarding::kNodeOnce), in the same invocation.
  bool node_once = false;
  Forwarding forwarding = Forwarding::kPerRank;  // this run's (set per variant, not a flag)
  // --rendezvous (with --world-size and --rank): the ranks were started apart and met there;
  // this process is world->rank(), and only rank 0 prints the figures. Null: ranks forked here.
  Bootstrap* world = nullptr;
};

// Returns the process exit code.
int RunMoeBench(const MoeBenchOptions& options);

}  // namespace ferry::bench
