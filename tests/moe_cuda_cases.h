// The cases moe_cuda_test runs: shapes, dtypes, routings, options, topologies (one node,
// nodes of several ranks, one rank per node), graphs, layouts and streaming, each compared bit for
// bit with the host device there.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "ferry/moe.h"
#include "moe_inputs.h"

namespace ferry {
namespace moe_cuda_cases {

struct Case {
  int world_size, tokens, hidden, experts, k;
  DispatchDtype dtype;
  Routing routing;
  int private_tokens = 4;
  bool rank1_empty = false;
  bool once_per_rank = false;
  bool reduce_at_expert_rank = false;
  int iterations = 3;
  bool nvlink = false;  // one node: ranks_per_node = world_size (else 1: one rank per node)
  // The steps captured once in CUDA graphs (dispatch; combine with and without accumulate)
  // with the token count in device memory, replayed with a different count each iteration; the
  // last iteration's count on rank 0 is above the bound (nothing sent). Any topology: one node,
  // nodes of several ranks, one rank per node (every peer through the relay).
  bool graph = false;
  // With nvlink: nodes of this many ranks (NVLink inside, the relay over shm between them); 0:
  // one node.
  int node_ranks = 0;
  // DispatchLayout::kTokenMajor on both devices: 1 on every rank, 2 on odd ranks only (a rank's
  // own choice; the bytes that cross are the same).
  int token_major = 0;
  // One node: AllToAllConfig::streaming as a mask -- 1 the dispatch streamed, 2 the combine, 3
  // both; 0: neither, every receiver waits for its senders' flags. Always given, so that a case
  // takes the path it names whichever the default is (kAuto: the dispatch streamed where
  // SendSmall serves it).
  int stream = 0;
  // The CUDA AllToAll on the host reference's engine (instance 1 beside its 0), their steps
  // interleaved as RunRank runs them: two AllToAlls sharing one engine through the relay.
  bool shared_engine = false;
  int fp8_scales = 0;  // AllToAllConfig::fp8_scales
  bool fp32_combine = false;  // AllToAllConfig::fp32_combine
  bool fp16_combine = false;  // CombineInput / CombineOutput::fp16
  // Forwarding::kNodeOnce on both devices (nvlink, node_ranks: several nodes of several
  // ranks): the rail AllToAll through the relay, the node AllToAll over NVLink.
  bool node_once = false;
  bool fp32_partials = false;  // node-once: AllToAllConfig::partial_sums = kFp32
};

inline std::string Describe(const Case& c) {
  return ShapeName(c.world_size, c.hidden,
                   {c.tokens, c.k, c.experts, c.dtype, c.routing, c.rank1_empty}) +
         (c.once_per_rank ? "_a" : "") + (c.reduce_at_expert_rank ? "_b" : "") +
         (c.nvlink ? "_nvlink" : "") + (c.graph ? "_graph" : "") +
         (c.node_ranks ? "_nodes" + std::to_string(c.world_size / c.node_ranks) : "") +
         (c.token_major == 1 ? "_tokmajor" : c.token_major == 2 ? "_mixedlayout" : "") +
         (c.stream == 1 ? "_streamed" : c.stream == 2 ? "_combstreamed"
                          : c.stream == 3 ? "_allstreamed" : "") +
         (c.shared_engine ? "_sharedengine" : "") +
         (c.fp8_scales ? "_scales" + std::to_string(c.fp8_scales) : "") +
         (c.fp32_combine ? "_f32comb" : "") + (c.fp16_combine ? "_f16comb" : "") +
         (c.node_once ? "_nodeonce" : "") + (c.fp32_partials ? "_p32" : "");
}

// gtest prints a case by its name (found by argument-dependent lookup).
inline void PrintTo(const Case& c, std::ostream* os) { *os << Describe(c); }

// The same case streamed: the dispatch (1), the combine (2) or both (3).
inline Case Streamed(Case c, int mask = 1) {
  c.stream = mask;
  return c;
}
// The same case with the CUDA AllToAll on the host reference's engine (Case::shared_engine).
inline Case SharedEngine(Case c) {
  c.shared_engine = true;
  return c;
}

// The same case with node-once forwarding (Case::node_once).
inline Case NodeOnce(Case c) {
  c.node_once = true;
  return c;
}

// The same case with node-once forwarding's fp32 partial sums (Case::fp32_partials).
inline Case Fp32Partials(Case c) {
  c.node_once = c.fp32_partials = true;
  return c;
}

// Every case, in the order gtest lists them.
inline std::vector<Case> AllCases() {
  const auto bf16 = DispatchDtype::kBf16, fp8 = DispatchDtype::kFp8E4M3;
  const auto fp32 = DispatchDtype::kFp32;
  const auto rnd = Routing::kRandom, hot = Routing::kAllToOneExpert;
  return {Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
              .dtype = bf16, .routing = rnd},
         Case{.world_size = 2, .tokens = 1, .hidden = 128, .experts = 8, .k = 1,
              .dtype = fp8, .routing = rnd, .private_tokens = 0},
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = fp8, .routing = rnd, .private_tokens = 16},  // decode shape
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = bf16, .routing = rnd, .private_tokens = 16,
              .once_per_rank = true, .reduce_at_expert_rank = true},
         Case{.world_size = 2, .tokens = 333, .hidden = 2176, .experts = 64, .k = 8,
              .dtype = bf16, .routing = hot, .rank1_empty = true},
         Case{.world_size = 3, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
              .dtype = fp8, .routing = rnd, .once_per_rank = true},
         Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256, .k = 8,
              .dtype = bf16, .routing = rnd, .private_tokens = 8,
              .reduce_at_expert_rank = true},
         Case{.world_size = 2, .tokens = 1024, .hidden = 1024, .experts = 32, .k = 4,
              .dtype = fp8, .routing = rnd, .private_tokens = 32},
         // The NVLink path (both GPUs as one node; 3 and 4 ranks share them).
         Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
              .dtype = bf16, .routing = rnd, .nvlink = true},
         Case{.world_size = 2, .tokens = 1, .hidden = 128, .experts = 8, .k = 1,
              .dtype = fp8, .routing = rnd, .private_tokens = 0, .nvlink = true},
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = fp8, .routing = rnd, .private_tokens = 16, .nvlink = true},
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = bf16, .routing = rnd, .private_tokens = 16,
              .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true},
         Case{.world_size = 2, .tokens = 333, .hidden = 2176, .experts = 64, .k = 8,
              .dtype = bf16, .routing = hot, .rank1_empty = true, .nvlink = true},
         Case{.world_size = 3, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
              .dtype = fp8, .routing = rnd, .once_per_rank = true, .nvlink = true},
         Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256, .k = 8,
              .dtype = bf16, .routing = rnd, .private_tokens = 8,
              .reduce_at_expert_rank = true, .nvlink = true},
         Case{.world_size = 2, .tokens = 1024, .hidden = 1024, .experts = 32, .k = 4,
              .dtype = fp8, .routing = rnd, .private_tokens = 32, .nvlink = true},
         Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256, .k = 16,
              .dtype = fp8, .routing = rnd, .private_tokens = 64, .iterations = 2,
              .nvlink = true},
         Case{.world_size = 2, .tokens = 64, .hidden = 128, .experts = 1024, .k = 16,
              .dtype = bf16, .routing = rnd, .private_tokens = 8, .rank1_empty = true,
              .reduce_at_expert_rank = true, .iterations = 2, .nvlink = true},
         // Top-k that does not divide a warp (SendSmall counts whole tokens per
         // warp pass, lanes past them idle): plain, (a)+(b) over three ranks,
         // graphs with device counts.
         Case{.world_size = 2, .tokens = 77, .hidden = 128, .experts = 40, .k = 3,
              .dtype = fp8, .routing = rnd, .nvlink = true},
         Case{.world_size = 3, .tokens = 90, .hidden = 256, .experts = 48, .k = 6,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .nvlink = true},
         Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 60, .k = 5,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
              .graph = true},
         // Route's scan under graph replays with device counts (chunks left
         // empty, then a count across two chunks), and over two groups of ranks.
         Case{.world_size = 2, .tokens = 700, .hidden = 256, .experts = 64, .k = 4,
              .dtype = bf16, .routing = rnd, .once_per_rank = true, .iterations = 4,
              .nvlink = true, .graph = true},
         Case{.world_size = 6, .tokens = 600, .hidden = 128, .experts = 48, .k = 8,
              .dtype = fp8, .routing = rnd, .once_per_rank = true, .iterations = 2,
              .nvlink = true},
         // Graph capture and replay with device token counts: one node, then
         // one rank per node (the relay carries every step; its thread waits on
         // the replayed kernels' flags).
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = fp8, .routing = rnd, .private_tokens = 16, .iterations = 4,
              .nvlink = true, .graph = true},
         Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
              .graph = true},
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = fp8, .routing = rnd, .private_tokens = 16, .iterations = 4,
              .graph = true},
         Case{.world_size = 3, .tokens = 96, .hidden = 256, .experts = 48, .k = 4,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 4, .graph = true},
         // Several nodes of several GPUs: NVLink inside, the relay between (ranks
         // share the GPUs round-robin, so each node spans both).
         Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = fp8, .routing = rnd, .private_tokens = 16, .nvlink = true,
              .node_ranks = 2},
         Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = bf16, .routing = rnd, .private_tokens = 16,
              .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
              .node_ranks = 2},
         Case{.world_size = 4, .tokens = 333, .hidden = 2176, .experts = 64, .k = 8,
              .dtype = bf16, .routing = hot, .rank1_empty = true, .nvlink = true,
              .node_ranks = 2},
         Case{.world_size = 6, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
              .dtype = fp8, .routing = rnd, .once_per_rank = true, .nvlink = true,
              .node_ranks = 2},
         Case{.world_size = 6, .tokens = 33, .hidden = 384, .experts = 96, .k = 8,
              .dtype = bf16, .routing = rnd, .rank1_empty = true,
              .reduce_at_expert_rank = true, .nvlink = true, .node_ranks = 3},
         Case{.world_size = 4, .tokens = 1024, .hidden = 1024, .experts = 32, .k = 4,
              .dtype = fp8, .routing = rnd, .private_tokens = 32, .iterations = 2,
              .nvlink = true, .node_ranks = 2},
         Case{.world_size = 4, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
              .graph = true, .node_ranks = 2},
         // The token-major layout: one node, graphs, nodes of two, one rank per
         // node; then ranks of both layouts in one node and in nodes of two.
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = fp8, .routing = rnd, .private_tokens = 16,
              .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
              .token_major = 1},
         Case{.world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48, .k = 8,
              .dtype = bf16, .routing = hot, .rank1_empty = true,
              .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
              .token_major = 1},
         Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
              .graph = true, .token_major = 1},
         Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
              .dtype = fp8, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .nvlink = true, .node_ranks = 2,
              .token_major = 1},
         Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64, .k = 8,
              .dtype = fp8, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .token_major = 1},
         Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
              .dtype = bf16, .routing = rnd, .private_tokens = 16,
              .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
              .token_major = 2},
         Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
              .dtype = fp8, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .nvlink = true, .node_ranks = 2,
              .token_major = 2},
         // Eight ranks (four per GPU here): EP8 as one node and as two of four.
         Case{.world_size = 8, .tokens = 32, .hidden = 256, .experts = 64, .k = 8,
              .dtype = bf16, .routing = rnd, .iterations = 2, .nvlink = true},
         Case{.world_size = 8, .tokens = 32, .hidden = 256, .experts = 64, .k = 8,
              .dtype = fp8, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 2, .nvlink = true,
              .node_ranks = 4},
         // Streamed with every slot pushed (private slots for all a rank may send
         // a peer): SendSmall, Pack, Pack with (a)+(b).
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 1024,
                       .iterations = 2, .nvlink = true}),
         Streamed(Case{.world_size = 2, .tokens = 600, .hidden = 256, .experts = 64,
                       .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 4800,
                       .iterations = 2, .nvlink = true}),
         Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 512, .experts = 64,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 700,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .iterations = 2, .nvlink = true}),
         // Streamed with pulled slots too: each receiver waits for each slot's tag
         // (pulled: for its sender's flag).
         Streamed(Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8,
                       .k = 2, .dtype = bf16, .routing = rnd, .nvlink = true}),
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .nvlink = true}),
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true}),
         Streamed(Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256,
                       .k = 16, .dtype = fp8, .routing = rnd, .private_tokens = 64,
                       .iterations = 2, .nvlink = true}),
         Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 256, .experts = 64,
                       .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                       .iterations = 4, .nvlink = true, .graph = true}),
         Streamed(Case{.world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48,
                       .k = 8, .dtype = bf16, .routing = hot, .rank1_empty = true,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .token_major = 1}),
         // What decode runs by default: SendSmall streamed, (a)+(b),
         // captured graphs replayed with device token counts.
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .graph = true}),
         // ... with more received slots (~460 a rank) than Unpack's streamed grid
         // (what fits at once: 264 blocks on an H200) and at most twice it: a
         // block per slot, each block claiming slots one after another.
         Streamed(Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256,
                       .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 8,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true}),
         // The combine streamed: rows summed at the expert rank, copied per entry,
         // copied per token-major row; graphs; with the dispatch streamed too.
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true}, 2),
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .nvlink = true}, 3),
         Streamed(Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64,
                       .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                       .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                       .graph = true, .token_major = 1}, 3),
         Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 256, .experts = 64,
                       .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                       .iterations = 4, .nvlink = true, .graph = true}, 2),
         Streamed(Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256,
                       .k = 16, .dtype = fp8, .routing = rnd, .private_tokens = 64,
                       .reduce_at_expert_rank = true, .iterations = 2,
                       .nvlink = true}, 3),
         Streamed(Case{.world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48,
                       .k = 8, .dtype = bf16, .routing = hot, .rank1_empty = true,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true},
                  3),
         Streamed(Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256,
                       .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 8,
                       .reduce_at_expert_rank = true, .nvlink = true}, 3),
         // More received slots than blocks, visited in order: pulled and pushed,
         // one slot per copy summed at the expert rank; token-major.
         Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256,
              .k = 16, .dtype = fp8, .routing = rnd, .private_tokens = 64,
              .reduce_at_expert_rank = true, .iterations = 2, .nvlink = true},
         Case{.world_size = 2, .tokens = 1024, .hidden = 1024, .experts = 32,
              .k = 4, .dtype = fp8, .routing = rnd, .private_tokens = 32,
              .once_per_rank = true, .reduce_at_expert_rank = true,
              .iterations = 2, .nvlink = true, .token_major = 1},
         // Two AllToAlls on one engine: one rank per node (every peer through the
         // relay), and nodes of two with graphs.
         SharedEngine(Case{.world_size = 2, .tokens = 128, .hidden = 7168,
                           .experts = 256, .k = 8, .dtype = fp8, .routing = rnd,
                           .private_tokens = 16, .once_per_rank = true,
                           .reduce_at_expert_rank = true}),
         SharedEngine(Case{.world_size = 4, .tokens = 96, .hidden = 256, .experts = 64,
                           .k = 4, .dtype = bf16, .routing = rnd,
                           .once_per_rank = true, .reduce_at_expert_rank = true,
                           .iterations = 4, .nvlink = true, .graph = true,
                           .node_ranks = 2}),
         // fp32 rows and sums (kFp32): rows returned per copy and summed at the
         // origin, by blocks and by warps; summed at the expert rank; token-major;
         // the combine streamed; a graph; through the relay between two nodes.
         Case{.world_size = 2, .tokens = 77, .hidden = 384, .experts = 40, .k = 3,
              .dtype = fp32, .routing = rnd, .rank1_empty = true, .nvlink = true},
         Case{.world_size = 2, .tokens = 1024, .hidden = 256, .experts = 32, .k = 4,
              .dtype = fp32, .routing = rnd, .private_tokens = 32, .nvlink = true},
         Case{.world_size = 3, .tokens = 90, .hidden = 256, .experts = 48, .k = 6,
              .dtype = fp32, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .nvlink = true},
         Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
              .dtype = fp32, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
              .graph = true, .token_major = 2},
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                       .k = 8, .dtype = fp32, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true}, 3),
         Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 128, .experts = 64,
                       .k = 4, .dtype = fp32, .routing = rnd, .iterations = 2,
                       .nvlink = true}, 2),
         Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
              .dtype = fp32, .routing = rnd, .reduce_at_expert_rank = true,
              .nvlink = true, .node_ranks = 2},
         // Rows of any multiple of 16 columns (gpt-oss's hidden 2880, pplx's 16):
         // streamed (a)+(b) token-major with a graph, plain by warps, through the
         // relay.
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 2880, .experts = 64,
                       .k = 4, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .iterations = 3, .nvlink = true, .graph = true,
                       .token_major = 1}, 3),
         Case{.world_size = 2, .tokens = 1024, .hidden = 16, .experts = 32, .k = 4,
              .dtype = fp32, .routing = rnd, .private_tokens = 32, .nvlink = true},
         Case{.world_size = 4, .tokens = 64, .hidden = 48, .experts = 48, .k = 8,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .nvlink = true, .node_ranks = 2},
         // fp8 rows with scales of the caller's count: per token, streamed
         // (a)+(b); 23 groups of 128 over a hidden of 2880, through the relay.
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .fp8_scales = 1}, 3),
         Case{.world_size = 4, .tokens = 64, .hidden = 2880, .experts = 48, .k = 4,
              .dtype = fp8, .routing = rnd, .nvlink = true, .node_ranks = 2,
              .fp8_scales = 23},
         // bf16 and fp8 rows combined in fp32 (pplx's out_dtype float32): rows
         // returned per copy, streamed (a)+(b), through the relay.
         Case{.world_size = 2, .tokens = 77, .hidden = 384, .experts = 40, .k = 3,
              .dtype = bf16, .routing = rnd, .rank1_empty = true, .nvlink = true,
              .fp32_combine = true},
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .fp32_combine = true}, 3),
         Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
              .dtype = bf16, .routing = rnd, .reduce_at_expert_rank = true,
              .nvlink = true, .node_ranks = 2, .fp32_combine = true},
         // Rows combined in fp16 (pplx's float16 expert outputs): per copy, streamed
         // (a)+(b), token-major in a graph, (b) through the relay.
         Case{.world_size = 2, .tokens = 77, .hidden = 384, .experts = 40, .k = 3,
              .dtype = bf16, .routing = rnd, .rank1_empty = true, .nvlink = true,
              .fp16_combine = true},
         Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .fp8_scales = 1, .fp16_combine = true}, 3),
         Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
              .dtype = bf16, .routing = rnd, .once_per_rank = true,
              .reduce_at_expert_rank = true, .nvlink = true, .graph = true,
              .token_major = 1, .fp16_combine = true},
         Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
              .dtype = bf16, .routing = rnd, .reduce_at_expert_rank = true,
              .nvlink = true, .node_ranks = 2, .fp16_combine = true},
         // Node-once forwarding (a token crosses to each node once, its rail peer
         // forwards it over NVLink): the decode shape; (a)+(b) token-major; a hot
         // expert, an empty rank, mixed layouts; three nodes; graphs with device
         // counts; fp16 and fp32 combines.
         NodeOnce(Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .nvlink = true, .node_ranks = 2}),
         NodeOnce(Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .node_ranks = 2, .token_major = 1}),
         NodeOnce(Case{.world_size = 4, .tokens = 333, .hidden = 2176, .experts = 64,
                       .k = 8, .dtype = bf16, .routing = hot, .rank1_empty = true,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .nvlink = true, .node_ranks = 2, .token_major = 2}),
         NodeOnce(Case{.world_size = 6, .tokens = 64, .hidden = 256, .experts = 48,
                       .k = 8, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                       .nvlink = true, .node_ranks = 2}),
         NodeOnce(Case{.world_size = 4, .tokens = 96, .hidden = 256, .experts = 64,
                       .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                       .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                       .graph = true, .node_ranks = 2}),
         NodeOnce(Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256,
                       .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                       .once_per_rank = true, .reduce_at_expert_rank = true,
                       .iterations = 4, .nvlink = true, .graph = true, .node_ranks = 2,
                       .token_major = 1}),
         NodeOnce(Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48,
                       .k = 8, .dtype = bf16, .routing = rnd, .reduce_at_expert_rank = true,
                       .nvlink = true, .node_ranks = 2, .fp16_combine = true}),
         NodeOnce(Case{.world_size = 4, .tokens = 77, .hidden = 384, .experts = 40,
                       .k = 3, .dtype = fp32, .routing = rnd, .nvlink = true,
                       .node_ranks = 2}),
         // Node-once's fp32 partial sums: the node's sums kept fp32 (the wide combine
         // kernels, bf16 and fp16 rows), fp32 rows on the rail, rounded once at the end
         // (with a graph: the count read on the GPU, accumulate).
         Fp32Partials(Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256,
                           .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                           .nvlink = true, .node_ranks = 2}),
         Fp32Partials(Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48,
                           .k = 8, .dtype = bf16, .routing = rnd, .nvlink = true,
                           .node_ranks = 2, .fp16_combine = true}),
         Fp32Partials(Case{.world_size = 4, .tokens = 96, .hidden = 256, .experts = 64,
                           .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                           .graph = true, .node_ranks = 2})};
}

}  // namespace moe_cuda_cases
}  // namespace ferry
