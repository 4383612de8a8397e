// The buffer figures of docs/DESIGN.md ("Buffer memory"): one worked by hand from the layouts' definitions,
// and ferry's receive memory within DeepEP's low-latency buffer at every shape the table shows.
#include "moe/buffers.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "moe/node_once.h"
#include "moe/wire.h"

namespace ferry::moe {
namespace {

// DeepSeek-V3's MoE layer: 256 experts, top-8, hidden 7168, fp8; nodes of 8 GPUs.
AllToAllConfig Shape(int ep, int tokens, bool a_and_b) {
  AllToAllConfig c;
  c.world_size = ep;
  c.ranks_per_node = std::min(ep, 8);
  c.num_experts = 256;
  c.experts_per_token = 8;
  c.max_tokens_per_rank = tokens;
  c.hidden = 7168;
  c.dtype = DispatchDtype::kFp8E4M3;
  c.dispatch_once_per_rank = c.combine_reduce_at_expert_rank = a_and_b;
  c.device = MoeDeviceKind::kCuda;
  return c;
}

// EP16 decode with options (a) and (b), rank 0: 8 remote senders, each a counts row (16 local
// experts + 4 columns: 80 bytes) and 128 slots of 7680 bytes (256 of metadata, 7168 of row,
// 224 of scales) in the inbox, then 128 * 8 combine rows of 14336 bytes; the NVLink buffer's
// flags (16 * 2 * 8), counts rows (16 * 20 * 4, from 256), 16 * 16 private slots, and the same
// combine rows. DeepEP's: 256 experts * 128 tokens * 14560-byte messages (16 + 14336 and
// 224 + 14336: the larger), twice, and 1024 bytes of counts twice.
TEST(BufferBytesTest, Ep16DecodeWorkedByHand) {
  const AllToAllConfig c = Shape(16, 128, true);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
  const int64_t inbox = 8 * (80 + 128 * 7680) + 128 * 8 * 14336;
  const int64_t nvlink = 256 + 1280 + 16 * 16 * 7680 + 128 * 8 * 14336;
  EXPECT_EQ(CudaDeviceBuffers(c).receive, inbox + nvlink);
  // The host device: 15 remote senders, their sections' end rounded up to a 128-byte line.
  EXPECT_EQ(HostDeviceBuffers(c).receive, RoundUp(15 * (80 + 128 * 7680), 128) + 128 * 8 * 14336);
  EXPECT_EQ(DeepEpLowLatencyBuffers(128, 7168, 256).receive, 2 * (256 * 128 * 14560 + 1024));
}

// At EP 8, 16, 32 and 64, decode (128 tokens) and prefill (4096), with and without options (a)
// and (b): what peers write into on each rank stays within DeepEP's low-latency receive region
// for the same shape (a bounded region per sender, written once, as DeepEP's is).
TEST(BufferBytesTest, ReceiveMemoryWithinDeepEpLowLatency) {
  for (int ep : {8, 16, 32, 64}) {
    for (int tokens : {128, 4096}) {
      const int64_t deep_ep = DeepEpLowLatencyBuffers(tokens, 7168, 256).receive;
      for (bool a_and_b : {false, true}) {
        AllToAllConfig c = Shape(ep, tokens, a_and_b);
        ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
        for (Streaming s : {Streaming::kNone, Streaming::kDispatch, Streaming::kBoth}) {
          c.streaming = s;
          EXPECT_LE(CudaDeviceBuffers(c).receive, deep_ep)
              << "EP" << ep << " T=" << tokens << (a_and_b ? " (a)+(b)" : "") << " streaming "
              << int(s);
        }
        EXPECT_LE(HostDeviceBuffers(c).receive, deep_ep) << "EP" << ep << " T=" << tokens;
      }
    }
  }
}

// Node-once forwarding at EP 16, 32 and 64 (nodes of 8), decode and prefill: its two
// AllToAlls and the middle buffers together stay within DeepEP's low-latency receive region
// too, and above the rail's and the node's own (nothing is left out of the sum).
TEST(BufferBytesTest, NodeOnceReceiveMemoryWithinDeepEpLowLatency) {
  for (int ep : {16, 32, 64}) {
    for (int tokens : {128, 4096}) {
      AllToAllConfig c = Shape(ep, tokens, true);
      c.forwarding = Forwarding::kNodeOnce;
      ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
      const NodeOnceConfigs inner = NodeOnceConfigsOf(c);
      const int64_t parts = CudaDeviceBuffers(inner.rail).receive +
                            CudaDeviceBuffers(inner.node).receive +
                            CudaDeviceBuffers(inner.weights).receive;
      const int64_t once = NodeOnceBuffers(c).receive;
      EXPECT_EQ(once, parts + MiddleBytesOf(c).total()) << "EP" << ep << " T=" << tokens;
      EXPECT_GT(MiddleBytesOf(c).out, int64_t{ep / 8} * tokens * 7168 * 2 - 1);
      EXPECT_LE(once, DeepEpLowLatencyBuffers(tokens, 7168, 256).receive)
          << "EP" << ep << " T=" << tokens;
    }
  }
}

}  // namespace
}  // namespace ferry::moe
