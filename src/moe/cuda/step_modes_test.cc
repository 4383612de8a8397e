// The CUDA device's step modes: every combination the configuration can produce is one the rules
// admit, every combination of modes is admitted exactly when it breaks no rule, and each rule
// refuses by its own words.
#include "moe/cuda/step_modes.h"

#include <set>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "moe/cuda/nvlink_layout.h"

namespace ferry::moe {
namespace {

using Key = std::tuple<int, int, int, int, int, int, int, int>;
Key KeyOf(const StepModes& m) {
  return {int(m.routing), int(m.reduction), int(m.order),   int(m.reach),
          int(m.counts),  int(m.dispatch),  int(m.combine), int(m.loss)};
}

AllToAllConfig Base() {
  AllToAllConfig c;
  c.world_size = 4;
  c.rank = 0;
  c.ranks_per_node = 4;
  c.num_experts = 16;
  c.experts_per_token = 4;
  c.max_tokens_per_rank = 64;
  c.hidden = 256;
  c.device = MoeDeviceKind::kCuda;
  return c;
}

// Every valid configuration's modes pass Check, and say what the configuration asked for: tags
// only in one node without masking, the streamed steps as AllToAllConfig::streaming names them
// (kAuto: the dispatch where one kernel sends every batch).
TEST(StepModesTest, EveryConfigurationGivesSupportedModes) {
  int valid = 0;
  for (bool once : {false, true}) {
    for (bool reduce : {false, true}) {
      for (DispatchLayout layout : {DispatchLayout::kExpertMajor, DispatchLayout::kTokenMajor}) {
        for (int per_node : {4, 2}) {
          for (int s = 0; s <= int(Streaming::kBoth); ++s) {
            for (bool mask : {false, true}) {
              for (bool small : {false, true}) {
                AllToAllConfig c = Base();
                c.dispatch_once_per_rank = once;
                c.combine_reduce_at_expert_rank = reduce;
                c.dispatch_layout = layout;
                c.ranks_per_node = per_node;
                c.streaming = static_cast<Streaming>(s);
                c.mask_lost_peers = mask;
                if (!c.Validate().ok()) continue;
                ++valid;
                const StepModes m = StepModes::Of(c, small);
                SCOPED_TRACE(m.ToString());
                EXPECT_TRUE(m.Check().ok()) << m.Check();
                EXPECT_EQ(m.once(), once);
                EXPECT_EQ(m.reduce(), reduce);
                EXPECT_EQ(m.token_major(), layout == DispatchLayout::kTokenMajor);
                EXPECT_EQ(m.mask_lost(), mask);
                const bool tags = per_node == 4 && !mask;
                EXPECT_EQ(m.counts_tagged(), tags);
                const Streaming st = c.streaming;
                const bool dispatch = st == Streaming::kAuto ? small
                                                             : st == Streaming::kDispatch ||
                                                                   st == Streaming::kBoth;
                EXPECT_EQ(m.stream(), tags && dispatch);
                EXPECT_EQ(m.stream_combine(),
                          tags && (st == Streaming::kCombine || st == Streaming::kBoth));
                // The buffer's layout follows the modes: a tag column, slot tags, row tags.
                const NvlinkLayout layout_of(c, m);
                EXPECT_EQ(layout_of.counts_tagged, m.counts_tagged());
                EXPECT_EQ(layout_of.stream, m.stream());
                EXPECT_EQ(layout_of.stream_combine, m.stream_combine());
              }
            }
          }
        }
      }
    }
  }
  // Token-major needs once and reduce: 5 of the 8 (once, reduce, layout) choices are valid.
  EXPECT_EQ(valid, 5 * 2 * 5 * 2 * 2);
}

// Every combination of the eight modes: Check admits it exactly when no rule is broken; a refusal
// names the first broken rule. Each rule is broken alone by some combination, so none is dead.
TEST(StepModesTest, CheckWalksTheRuleTable) {
  constexpr int kRules = sizeof(kModeRules) / sizeof(kModeRules[0]);
  std::set<int> broken_alone;
  std::set<Key> admitted;
  for (int bits = 0; bits < 256; ++bits) {
    StepModes m;
    m.routing = static_cast<Routing>(bits & 1);
    m.reduction = static_cast<Reduction>((bits >> 1) & 1);
    m.order = static_cast<RowOrder>((bits >> 2) & 1);
    m.reach = static_cast<Reach>((bits >> 3) & 1);
    m.counts = static_cast<Readiness>((bits >> 4) & 1);
    m.dispatch = static_cast<Readiness>((bits >> 5) & 1);
    m.combine = static_cast<Readiness>((bits >> 6) & 1);
    m.loss = static_cast<PeerLoss>((bits >> 7) & 1);
    int first = -1, count = 0;
    for (int r = 0; r < kRules; ++r) {
      if (kModeRules[r].broken(m)) {
        if (first < 0) first = r;
        ++count;
      }
    }
    const Status s = m.Check();
    if (first < 0) {
      EXPECT_TRUE(s.ok()) << m.ToString() << ": " << s;
      admitted.insert(KeyOf(m));
    } else {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << m.ToString();
      EXPECT_NE(s.message().find(kModeRules[first].rule), std::string::npos) << s;
      if (count == 1) broken_alone.insert(first);
    }
  }
  EXPECT_EQ(int(broken_alone.size()), kRules);
  // Per (routing, reduction, order) choice the token-major rule allows (5 of 8): one node
  // without masking: counts by flags (nothing streamed) or by tags (4 streamed choices); one node
  // masking: flags; the relay: flags, failing or masking. 8 each.
  EXPECT_EQ(admitted.size(), 5u * 8u);
}

}  // namespace
}  // namespace ferry::moe
