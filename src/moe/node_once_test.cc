// Node-once forwarding's configuration: what the ranks agree on, what is refused, the rail and
// node AllToAlls derived from it, and the sub-group bootstrap they meet through. The protocol
// itself runs in moe_host_test (its nodeonce cases) and ferry-bench scale --node-once.
#include "moe/node_once.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ferry::moe {
namespace {

AllToAllConfig NodeOnce(int world, int per_node, int rank) {
  return {.world_size = world, .rank = rank, .ranks_per_node = per_node, .num_experts = 256,
          .experts_per_token = 8, .max_tokens_per_rank = 128, .hidden = 7168,
          .dtype = DispatchDtype::kFp8E4M3, .dispatch_once_per_rank = true,
          .forwarding = Forwarding::kNodeOnce};
}

// Forwarding is agreed (it changes what crosses); node-once needs several nodes of several
// ranks, two instances, and at most a node's experts per token.
TEST(NodeOnceTest, ConfigurationAgreedAndRefusedWhereItCannotRun) {
  const AllToAllConfig c = NodeOnce(16, 8, 3);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  AllToAllConfig per_rank = c;
  per_rank.forwarding = Forwarding::kPerRank;
  EXPECT_NE(c.Fingerprint(), per_rank.Fingerprint());
  EXPECT_NE(c.ToString().find("node_once"), std::string::npos);
  auto refused = [](AllToAllConfig bad, const std::string& why) {
    const Status s = bad.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s;
  };
  AllToAllConfig bad = c;
  bad.ranks_per_node = 16;  // one node: nothing to forward
  refused(bad, "several nodes of several ranks");
  bad.ranks_per_node = 1;  // every rank its own node: nobody to forward to
  refused(bad, "several nodes of several ranks");
  bad = c;
  bad.instance = AllToAllConfig::kMaxInstances - 2;
  refused(bad, "instance + 2");
  bad = NodeOnce(16, 2, 0);  // 8 nodes of 32 experts: top-8 fits
  EXPECT_TRUE(bad.Validate().ok());
  bad.num_experts = 32;  // 8 nodes of 4 experts: a token's 8 cannot all be in one node
  refused(bad, "experts of one node");
  bad = c;
  bad.mask_lost_peers = true;  // both devices hear heartbeats before they mask
  EXPECT_TRUE(bad.Validate().ok()) << bad.Validate();
  bad.device = MoeDeviceKind::kCuda;
  EXPECT_TRUE(bad.Validate().ok()) << bad.Validate();
  bad = c;
  bad.forwarding = static_cast<Forwarding>(3);
  refused(bad, "unknown forwarding");
}

// The default (kAuto) takes node-once wherever there are several nodes of several ranks and
// node-once can run, per rank elsewhere; ranks agree on the choice, not on how it was asked.
TEST(NodeOnceTest, TheDefaultTakesNodeOnceWhereItCanRun) {
  EXPECT_EQ(AllToAllConfig{}.forwarding, Forwarding::kAuto);
  AllToAllConfig c = NodeOnce(16, 8, 3);
  c.forwarding = Forwarding::kAuto;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  EXPECT_EQ(c.chosen_forwarding(), Forwarding::kNodeOnce);
  EXPECT_EQ(c.Fingerprint(), NodeOnce(16, 8, 3).Fingerprint());
  EXPECT_NE(c.ToString().find("node_once"), std::string::npos);
  for (int world : {4, 32, 64}) {
    AllToAllConfig w = NodeOnce(world, world == 4 ? 2 : 8, 1);
    w.forwarding = Forwarding::kAuto;
    EXPECT_EQ(w.chosen_forwarding(), Forwarding::kNodeOnce) << world;
  }
  auto per_rank = [](AllToAllConfig a, const char* why) {
    ASSERT_TRUE(a.Validate().ok()) << why << ": " << a.Validate();
    EXPECT_EQ(a.chosen_forwarding(), Forwarding::kPerRank) << why;
    AllToAllConfig explicit_per_rank = a;
    explicit_per_rank.forwarding = Forwarding::kPerRank;
    EXPECT_EQ(a.Fingerprint(), explicit_per_rank.Fingerprint()) << why;
  };
  AllToAllConfig a = c;
  a.ranks_per_node = 16;
  per_rank(a, "one node");
  a.ranks_per_node = 1;
  per_rank(a, "a rank per node");
  a = c;
  a.mask_lost_peers = true;
  EXPECT_EQ(a.chosen_forwarding(), Forwarding::kNodeOnce) << "mask_lost_peers";
  a.mask_lost_peers = false;
  a.instance = AllToAllConfig::kMaxInstances - 2;
  per_rank(a, "instances");
  a = NodeOnce(16, 2, 0);
  a.forwarding = Forwarding::kAuto;
  a.num_experts = 32;
  per_rank(a, "top-k beyond a node's experts");
}

// The rail AllToAll: one rank per node (ours: our node's index), our index in the node the same
// on every member, each node's experts, token-major with both options; the node AllToAll: our
// node's ranks, its experts, every node's tokens as input, the caller's options and layout, the
// next instance.
TEST(NodeOnceTest, TheRailAndNodeConfigurations) {
  AllToAllConfig c = NodeOnce(32, 8, 19);  // node 2, index 3
  c.instance = 5;
  c.dispatch_layout = DispatchLayout::kExpertMajor;
  const NodeOnceConfigs inner = NodeOnceConfigsOf(c);
  EXPECT_EQ(inner.rail.world_size, 4);
  EXPECT_EQ(inner.rail.rank, 2);
  EXPECT_EQ(inner.rail.ranks_per_node, 1);
  EXPECT_EQ(inner.rail.num_experts, 256);
  EXPECT_EQ(inner.rail.local_experts(), 64);  // a node's experts
  EXPECT_TRUE(inner.rail.dispatch_once_per_rank && inner.rail.combine_reduce_at_expert_rank);
  EXPECT_EQ(inner.rail.dispatch_layout, DispatchLayout::kTokenMajor);
  EXPECT_EQ(inner.rail.instance, 5);
  EXPECT_EQ(inner.rail.forwarding, Forwarding::kPerRank);
  EXPECT_EQ(inner.node.world_size, 8);
  EXPECT_EQ(inner.node.rank, 3);
  EXPECT_EQ(inner.node.num_experts, 64);
  EXPECT_EQ(inner.node.local_experts(), c.local_experts());
  EXPECT_EQ(inner.node.max_tokens_per_rank, 4 * 128);
  EXPECT_EQ(inner.node.expert_capacity(), c.expert_capacity());
  EXPECT_TRUE(inner.node.dispatch_once_per_rank);
  EXPECT_FALSE(inner.node.combine_reduce_at_expert_rank);
  // The weights rail: the rail's routing, fp32 rows of the padded top-k weights, instance + 2.
  EXPECT_EQ(inner.weights.world_size, inner.rail.world_size);
  EXPECT_EQ(inner.weights.rank, inner.rail.rank);
  EXPECT_EQ(inner.weights.num_experts, inner.rail.num_experts);
  EXPECT_EQ(inner.weights.dispatch_layout, DispatchLayout::kTokenMajor);
  EXPECT_EQ(inner.weights.dtype, DispatchDtype::kFp32);
  EXPECT_EQ(inner.weights.hidden, kWeightsWidth);
  EXPECT_EQ(inner.weights.instance, 7);
  EXPECT_TRUE(inner.weights.Validate().ok()) << inner.weights.Validate();
  EXPECT_EQ(inner.node.dispatch_layout, DispatchLayout::kExpertMajor);
  EXPECT_EQ(inner.node.instance, 6);
  EXPECT_EQ(inner.node.forwarding, Forwarding::kPerRank);
  EXPECT_TRUE(inner.rail.Validate().ok()) << inner.rail.Validate();
  EXPECT_TRUE(inner.node.Validate().ok()) << inner.node.Validate();
}

// A parent whose all-gather hands back each rank's contribution as "r<rank>".
class FakeParent final : public Bootstrap {
 public:
  FakeParent(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(std::span<const uint8_t> mine,
                                                        std::chrono::milliseconds) override {
    ++gathers;
    std::vector<std::vector<uint8_t>> all;
    for (int r = 0; r < world_; ++r) {
      const std::string s = r == rank_ ? std::string(mine.begin(), mine.end())
                                       : "r" + std::to_string(r);
      all.emplace_back(s.begin(), s.end());
    }
    return all;
  }
  int gathers = 0;

 private:
  int rank_, world_;
};

// A sub-group numbers its members in the order given and hands back theirs alone, each
// collective one of the parent's.
TEST(NodeOnceTest, ASubgroupGathersItsMembersThroughTheParent) {
  FakeParent parent(5, 8);
  auto rail = SubBootstrap(parent, {1, 3, 5, 7});
  EXPECT_EQ(rail->world_size(), 4);
  EXPECT_EQ(rail->rank(), 2);
  const std::string mine = "me";
  auto got = rail->AllGather({reinterpret_cast<const uint8_t*>(mine.data()), mine.size()},
                             std::chrono::seconds(1));
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<std::string> strings;
  for (const auto& g : *got) strings.emplace_back(g.begin(), g.end());
  EXPECT_EQ(strings, (std::vector<std::string>{"r1", "r3", "me", "r7"}));
  EXPECT_TRUE(rail->Barrier(std::chrono::seconds(1)).ok());
  EXPECT_EQ(parent.gathers, 2);
}

}  // namespace
}  // namespace ferry::moe
