// The cases moe_host_test runs through the protocol on the host device: shapes, dtypes,
// routings, options, layouts, providers, combine forms and node-once forwarding; and what a
// case says of its ranks (the layout each takes, the order token-major rows arrive in).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/moe.h"
#include "moe_inputs.h"

namespace ferry {
namespace moe_host_cases {

// The dispatch layout each rank takes (a rank's own choice: the wire is the same).
enum class Layouts { kExpertMajor, kTokenMajor, kMixed /* odd ranks token-major */ };

struct Case {
  std::string provider;
  int world_size, tokens, hidden, experts, k;
  DispatchDtype dtype;
  Routing routing;
  int private_tokens = 4;
  bool rank1_empty = false;  // rank 1 sends no tokens
  int iterations = 2;
  bool once_per_rank = false;          // option (a)
  bool reduce_at_expert_rank = false;  // option (b)
  Layouts layouts = Layouts::kExpertMajor;
  bool unrouted = false;  // some copies' expert id is -1 (see InputSpec)
  bool late_weights = false;  // the combine weights given at CombineRecv, not at DispatchSend
  int fp8_scales = 0;         // AllToAllConfig::fp8_scales
  bool fp32_combine = false;  // AllToAllConfig::fp32_combine
  bool fp16_combine = false;  // CombineInput / CombineOutput::fp16
  // Nodes of this many ranks with node-once forwarding (Forwarding::kNodeOnce); 0: per rank.
  int node_ranks = 0;
  bool fp32_partials = false;  // AllToAllConfig::partial_sums = kFp32 (node-once)
};

inline InputSpec Spec(const Case& c) {
  return {c.tokens, c.k, c.experts, c.dtype, c.routing, c.rank1_empty, c.unrouted};
}

inline std::string Describe(const Case& c) {
  std::string p = c.provider == "shm" ? "shm" : "tcp";
  return p + "_" + ShapeName(c.world_size, c.hidden, Spec(c)) + "_it" + std::to_string(c.iterations) + (c.once_per_rank ? "_a" : "") +
         (c.reduce_at_expert_rank ? "_b" : "") +
         (c.layouts == Layouts::kTokenMajor ? "_tokmajor"
          : c.layouts == Layouts::kMixed    ? "_mixedlayout"
                                            : "") +
         (c.unrouted ? "_unrouted" : "") + (c.late_weights ? "_lateweights" : "") +
         (c.fp8_scales ? "_scales" + std::to_string(c.fp8_scales) : "") +
         (c.fp32_combine ? "_f32comb" : "") + (c.fp16_combine ? "_f16comb" : "") +
         (c.node_ranks ? "_nodeonce" + std::to_string(c.node_ranks) : "") +
         (c.fp32_partials ? "_p32" : "");
}

// The senders in the order the token-major rows arrive: rank order; under node-once forwarding
// by forwarder (the index in the node), then by the sender's node.
inline std::vector<int> SenderOrder(const Case& c, int world_size) {
  std::vector<int> order;
  const int per_node = c.node_ranks ? c.node_ranks : world_size;
  for (int l = 0; l < (c.node_ranks ? per_node : 1); ++l) {
    for (int r = 0; r < world_size; ++r) {
      if (!c.node_ranks || r % per_node == l) order.push_back(r);
    }
  }
  return order;
}

inline bool TokenMajor(const Case& c, int rank) {
  return c.layouts == Layouts::kTokenMajor || (c.layouts == Layouts::kMixed && rank % 2 == 1);
}

// gtest prints a case by its name (found by argument-dependent lookup).
inline void PrintTo(const Case& c, std::ostream* os) { *os << Describe(c); }

// Every case, in the order gtest lists them: those of this build's providers.
inline std::vector<Case> Cases() {
  const auto bf16 = DispatchDtype::kBf16, fp8 = DispatchDtype::kFp8E4M3;
  const auto fp32 = DispatchDtype::kFp32;
  const auto rnd = Routing::kRandom, hot = Routing::kAllToOneExpert;
  std::vector<Case> out = {
      {.provider = "shm", .world_size = 2, .tokens = 0, .hidden = 128, .experts = 8, .k = 2,
       .dtype = bf16, .routing = rnd},
      {.provider = "shm", .world_size = 2, .tokens = 1, .hidden = 128, .experts = 8, .k = 1,
       .dtype = bf16, .routing = rnd},
      {.provider = "shm", .world_size = 2, .tokens = 7, .hidden = 2176, .experts = 8, .k = 2,
       .dtype = fp8, .routing = rnd},
      {.provider = "shm", .world_size = 2, .tokens = 128, .hidden = 128, .experts = 64, .k = 8,
       .dtype = bf16, .routing = hot},
      {.provider = "shm", .world_size = 2, .tokens = 333, .hidden = 128, .experts = 8, .k = 8,
       .dtype = fp8, .routing = rnd, .private_tokens = 16},
      {.provider = "shm", .world_size = 3, .tokens = 7, .hidden = 128, .experts = 48, .k = 2,
       .dtype = bf16, .routing = rnd, .rank1_empty = true},
      {.provider = "shm", .world_size = 3, .tokens = 128, .hidden = 2176, .experts = 48, .k = 8,
       .dtype = bf16, .routing = hot},
      {.provider = "shm", .world_size = 4, .tokens = 1, .hidden = 128, .experts = 8, .k = 1,
       .dtype = fp8, .routing = rnd, .private_tokens = 0},
      {.provider = "shm", .world_size = 4, .tokens = 128, .hidden = 128, .experts = 256, .k = 8,
       .dtype = fp8, .routing = rnd, .rank1_empty = true},
      {.provider = "shm", .world_size = 4, .tokens = 333, .hidden = 128, .experts = 64, .k = 2,
       .dtype = bf16, .routing = hot, .private_tokens = 32},
      {.provider = "shm", .world_size = 8, .tokens = 7, .hidden = 128, .experts = 64, .k = 8,
       .dtype = bf16, .routing = rnd},
      {.provider = "shm", .world_size = 8, .tokens = 128, .hidden = 128, .experts = 256, .k = 2,
       .dtype = fp8, .routing = hot, .private_tokens = 8, .rank1_empty = true},
      {.provider = "tcp;ofi_rxm", .world_size = 2, .tokens = 128, .hidden = 2176, .experts = 64,
       .k = 8, .dtype = fp8, .routing = rnd},
      {.provider = "tcp;ofi_rxm", .world_size = 3, .tokens = 7, .hidden = 128, .experts = 48,
       .k = 2, .dtype = bf16, .routing = hot, .rank1_empty = true},
      {.provider = "tcp;ofi_rxm", .world_size = 4, .tokens = 333, .hidden = 128, .experts = 8,
       .k = 1, .dtype = bf16, .routing = rnd},
      // Many iterations back to back, without re-initialisation.
      {.provider = "shm", .world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
       .dtype = bf16, .routing = rnd, .private_tokens = 2, .iterations = 1000},
  };
  // Options (a) once per rank and (b) reduce at the expert rank pass the same checks.
  const size_t plain = out.size();
  for (size_t i = 0; i < plain; ++i) {
    if (out[i].iterations > 2 || out[i].provider != "shm") continue;
    if (i % 3 == 0 || i % 3 == 1) {
      Case a = out[i];
      a.once_per_rank = true;
      a.reduce_at_expert_rank = i % 3 == 1;
      out.push_back(a);
    }
    if (i % 3 == 2) {
      Case b = out[i];
      b.reduce_at_expert_rank = true;
      out.push_back(b);
    }
  }
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 3, .tokens = 128, .hidden = 128,
                 .experts = 48, .k = 8, .dtype = fp8, .routing = rnd, .rank1_empty = true,
                 .once_per_rank = true, .reduce_at_expert_rank = true});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 7, .hidden = 128, .experts = 8,
                 .k = 2, .dtype = bf16, .routing = rnd, .private_tokens = 2, .iterations = 1000,
                 .once_per_rank = true, .reduce_at_expert_rank = true});
  // The token-major layout, and ranks that differ in the layout they take.
  const auto token = Layouts::kTokenMajor, mixed = Layouts::kMixed;
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 128, .hidden = 128, .experts = 64,
                 .k = 8, .dtype = fp8, .routing = rnd, .iterations = 3, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = token});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 0, .hidden = 128, .experts = 8,
                 .k = 1, .dtype = bf16, .routing = rnd, .private_tokens = 0, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = token});
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 1, .hidden = 128, .experts = 48,
                 .k = 1, .dtype = fp8, .routing = rnd, .private_tokens = 0, .rank1_empty = true,
                 .once_per_rank = true, .reduce_at_expert_rank = true, .layouts = mixed});
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48,
                 .k = 8, .dtype = bf16, .routing = hot, .private_tokens = 16, .rank1_empty = true,
                 .once_per_rank = true, .reduce_at_expert_rank = true, .layouts = token});
  out.push_back({.provider = "shm", .world_size = 4, .tokens = 7, .hidden = 128, .experts = 8,
                 .k = 2, .dtype = bf16, .routing = rnd, .private_tokens = 0, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 3, .tokens = 64, .hidden = 128,
                 .experts = 48, .k = 16, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed});
  // Copies routed to no expert (-1), in each layout, with and without the options.
  const auto expert = Layouts::kExpertMajor;
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 19, .hidden = 128, .experts = 8,
                 .k = 2, .dtype = bf16, .routing = rnd, .layouts = expert, .unrouted = true});
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 99, .hidden = 128, .experts = 48,
                 .k = 4, .dtype = fp8, .routing = rnd, .rank1_empty = true, .once_per_rank = true,
                 .layouts = expert, .unrouted = true});
  out.push_back({.provider = "shm", .world_size = 4, .tokens = 33, .hidden = 128, .experts = 64,
                 .k = 8, .dtype = bf16, .routing = hot, .private_tokens = 2, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = token, .unrouted = true});
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 7, .hidden = 128, .experts = 48,
                 .k = 2, .dtype = bf16, .routing = rnd, .private_tokens = 0, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .unrouted = true});
  // Combine weights given at CombineRecv (the sums taken at the origin).
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 19, .hidden = 128, .experts = 8,
                 .k = 2, .dtype = bf16, .routing = rnd, .layouts = expert, .late_weights = true});
  // fp32 rows and fp32 sums (kFp32): each path of the combine -- rows returned as they are,
  // summed at the expert rank, token-major -- and late weights, over both providers.
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 256, .experts = 48,
                 .k = 4, .dtype = fp32, .routing = rnd, .rank1_empty = true, .unrouted = true});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 128, .hidden = 128, .experts = 64,
                 .k = 8, .dtype = fp32, .routing = hot, .iterations = 3, .once_per_rank = true,
                 .reduce_at_expert_rank = true});
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 19, .hidden = 128, .experts = 48,
                 .k = 4, .dtype = fp32, .routing = rnd, .private_tokens = 0, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .unrouted = true});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 19, .hidden = 128, .experts = 8,
                 .k = 2, .dtype = fp32, .routing = rnd, .layouts = expert, .late_weights = true});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 2, .tokens = 64, .hidden = 384,
                 .experts = 16, .k = 4, .dtype = fp32, .routing = rnd, .once_per_rank = true});
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 128, .experts = 48,
                 .k = 4, .dtype = fp8, .routing = rnd, .rank1_empty = true, .iterations = 3,
                 .once_per_rank = true, .layouts = expert, .unrouted = true, .late_weights = true});
  // Rows of any multiple of 16 columns in bf16 and fp32 (gpt-oss's hidden 2880, pplx's 16).
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 2880, .experts = 48,
                 .k = 4, .dtype = bf16, .routing = rnd, .rank1_empty = true,
                 .once_per_rank = true, .reduce_at_expert_rank = true, .layouts = mixed,
                 .unrouted = true});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 19, .hidden = 16, .experts = 8,
                 .k = 2, .dtype = fp32, .routing = rnd, .layouts = expert, .unrouted = true});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 2, .tokens = 64, .hidden = 48,
                 .experts = 16, .k = 4, .dtype = bf16, .routing = hot, .private_tokens = 2,
                 .late_weights = true});
  // fp8 rows with scales of the caller's count (per token: 1; groups of 64 columns: 4;
  // groups of 128 over a hidden of 2880 that 128 does not divide: 23).
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 256, .experts = 48,
                 .k = 4, .dtype = fp8, .routing = rnd, .rank1_empty = true, .unrouted = true,
                 .fp8_scales = 1});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 64, .hidden = 256, .experts = 16,
                 .k = 4, .dtype = fp8, .routing = hot, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .fp8_scales = 4});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 2, .tokens = 19, .hidden = 2880,
                 .experts = 8, .k = 2, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .late_weights = true, .fp8_scales = 23});
  // Rows combined in fp16 (pplx's float16 expert outputs; the 2-byte rows carry bf16 values,
  // which the dispatch moves as bits): per copy with the sums at the origin, summed at the
  // expert rank with mixed layouts, fp8 rows with late weights.
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 256, .experts = 48,
                 .k = 4, .dtype = bf16, .routing = rnd, .rank1_empty = true, .unrouted = true,
                 .fp16_combine = true});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 64, .hidden = 256, .experts = 16,
                 .k = 4, .dtype = bf16, .routing = hot, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .fp16_combine = true});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 2, .tokens = 19, .hidden = 2880,
                 .experts = 8, .k = 2, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .late_weights = true, .fp8_scales = 23, .fp16_combine = true});
  // bf16 and fp8 rows combined in fp32 (pplx's out_dtype float32): rows returned per copy and
  // summed at the origin, summed at the expert rank, token-major, late weights.
  out.push_back({.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 256, .experts = 48,
                 .k = 4, .dtype = bf16, .routing = rnd, .rank1_empty = true, .unrouted = true,
                 .fp32_combine = true});
  out.push_back({.provider = "shm", .world_size = 2, .tokens = 64, .hidden = 256, .experts = 16,
                 .k = 4, .dtype = fp8, .routing = hot, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .fp32_combine = true});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 2, .tokens = 19, .hidden = 2880,
                 .experts = 8, .k = 2, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .late_weights = true, .fp8_scales = 23, .fp32_combine = true});
  // Node-once forwarding (Forwarding::kNodeOnce): EP4 as two nodes of two, EP8 as two of four
  // and four of two, EP16 as four of four; each layout, the options, fp8, fp16 sums, copies
  // routed nowhere, a hot expert, a rank with no tokens.
  out.push_back({.provider = "shm", .world_size = 4, .tokens = 33, .hidden = 128, .experts = 16,
                 .k = 4, .dtype = bf16, .routing = rnd, .iterations = 3, .node_ranks = 2});
  out.push_back({.provider = "shm", .world_size = 4, .tokens = 64, .hidden = 256, .experts = 32,
                 .k = 8, .dtype = fp8, .routing = rnd, .rank1_empty = true, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .unrouted = true, .node_ranks = 2});
  out.push_back({.provider = "shm", .world_size = 4, .tokens = 19, .hidden = 128, .experts = 16,
                 .k = 4, .dtype = bf16, .routing = hot, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .node_ranks = 2});
  out.push_back({.provider = "shm", .world_size = 8, .tokens = 33, .hidden = 128, .experts = 64,
                 .k = 8, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                 .fp16_combine = true, .node_ranks = 4});
  out.push_back({.provider = "shm", .world_size = 8, .tokens = 20, .hidden = 256, .experts = 32,
                 .k = 4, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = token, .unrouted = true,
                 .node_ranks = 2});
  out.push_back({.provider = "shm", .world_size = 16, .tokens = 12, .hidden = 128, .experts = 64,
                 .k = 8, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .node_ranks = 4});
  out.push_back({.provider = "tcp;ofi_rxm", .world_size = 4, .tokens = 16, .hidden = 128,
                 .experts = 16, .k = 4, .dtype = fp32, .routing = rnd, .node_ranks = 2});
  // Node-once's fp32 partial sums (PartialSums::kFp32): rounded once, as per rank (each element
  // checked within half a unit where nothing else rounds); with (a)+(b), fp8 rows and fp16 sums.
  out.push_back({.provider = "shm", .world_size = 4, .tokens = 21, .hidden = 128, .experts = 16,
                 .k = 4, .dtype = bf16, .routing = rnd, .iterations = 3, .unrouted = true,
                 .node_ranks = 2, .fp32_partials = true});
  out.push_back({.provider = "shm", .world_size = 8, .tokens = 20, .hidden = 256, .experts = 32,
                 .k = 4, .dtype = fp8, .routing = rnd, .once_per_rank = true,
                 .reduce_at_expert_rank = true, .layouts = mixed, .fp16_combine = true,
                 .node_ranks = 4, .fp32_partials = true});
  std::vector<Case> filtered;
  for (const Case& c : out) {
    for (const std::string& p : testing_util::Providers()) {
      if (p == c.provider) filtered.push_back(c);
    }
  }
  return filtered;
}

}  // namespace moe_host_cases
}  // namespace ferry
