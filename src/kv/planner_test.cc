// Property tests of the reshard planner: over random models, layouts and TP sizes, the planned
// writes rebuild every decode page bit-exactly from the prefill pages, no byte is written twice,
// and the per-rank write counts match.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "ferry/kv.h"

namespace ferry {
namespace {

// The logical content of byte `k` of the vector (request page i, component c, head h, token t).
uint8_t Logical(size_t i, int c, int h, int t, int64_t k) {
  uint64_t x = (uint64_t(i) * 1000003u) ^ (uint64_t(c) << 40) ^ (uint64_t(h) << 24) ^
               (uint64_t(t) << 8) ^ uint64_t(k) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint8_t>(x >> 56);
}

// Fills prefill ranks' regions, applies the plan, checks the decode ranks' regions.
void CheckPlan(const KvSide& pre, const KvSide& dec, const std::vector<int64_t>& src_pages,
               const std::vector<int64_t>& dst_pages, const KvPlan& plan, const std::string& what) {
  const KvModel& m = pre.model;
  const int64_t vec = pre.vector_bytes();
  auto region_bytes = [&](const KvSide& side, const std::vector<int64_t>& pages) {
    int64_t max_page = pages.empty() ? 0 : *std::max_element(pages.begin(), pages.end()) + 1;
    return max_page * side.page_bytes();
  };
  std::vector<std::vector<uint8_t>> src(pre.tp, std::vector<uint8_t>(region_bytes(pre, src_pages)));
  for (int s = 0; s < pre.tp; ++s) {
    for (size_t i = 0; i < src_pages.size(); ++i) {
      for (int c = 0; c < m.components(); ++c) {
        for (int hl = 0; hl < pre.heads_per_rank(); ++hl) {
          for (int t = 0; t < m.page_tokens; ++t) {
            uint8_t* p = src[s].data() + pre.Offset(src_pages[i], c, hl, t);
            for (int64_t k = 0; k < vec; ++k) p[k] = Logical(i, c, pre.first_head(s) + hl, t, k);
          }
        }
      }
    }
  }
  const int64_t dst_bytes = region_bytes(dec, dst_pages);
  std::vector<std::vector<uint8_t>> dst(dec.tp, std::vector<uint8_t>(dst_bytes, 0));
  std::vector<std::vector<uint8_t>> written(dec.tp, std::vector<uint8_t>(dst_bytes, 0));
  std::vector<int64_t> per_dst(dec.tp, 0);
  for (const KvWrite& w : plan.writes) {
    ASSERT_GE(w.src_rank, 0) << what;
    ASSERT_LT(w.src_rank, pre.tp) << what;
    ASSERT_GE(w.dst_rank, 0) << what;
    ASSERT_LT(w.dst_rank, dec.tp) << what;
    ASSERT_GT(w.length, 0) << what;
    ASSERT_LE(w.src_offset + w.length, static_cast<int64_t>(src[w.src_rank].size())) << what;
    ASSERT_LE(w.dst_offset + w.length, dst_bytes) << what;
    std::memcpy(dst[w.dst_rank].data() + w.dst_offset, src[w.src_rank].data() + w.src_offset,
                w.length);
    for (int64_t k = 0; k < w.length; ++k) {
      ASSERT_EQ(written[w.dst_rank][w.dst_offset + k]++, 0) << what << ": byte written twice";
    }
    ++per_dst[w.dst_rank];
  }
  EXPECT_EQ(per_dst, plan.writes_per_dst) << what;
  for (int d = 0; d < dec.tp; ++d) {
    for (size_t i = 0; i < dst_pages.size(); ++i) {
      for (int c = 0; c < m.components(); ++c) {
        for (int hl = 0; hl < dec.heads_per_rank(); ++hl) {
          for (int t = 0; t < m.page_tokens; ++t) {
            const int64_t off = dec.Offset(dst_pages[i], c, hl, t);
            for (int64_t k = 0; k < vec; ++k) {
              ASSERT_EQ(written[d][off + k], 1) << what << ": byte never written";
              ASSERT_EQ(dst[d][off + k], Logical(i, c, dec.first_head(d) + hl, t, k))
                  << what << " rank " << d << " page " << i << " comp " << c << " head "
                  << dec.first_head(d) + hl << " token " << t;
            }
          }
        }
      }
    }
  }
}

std::string Describe(const KvSide& p, const KvSide& d, size_t pages) {
  auto side = [](const KvSide& s) {
    return std::string(s.order == KvOrder::kHND ? "HND" : "NHD") + "/tp" + std::to_string(s.tp);
  };
  return "heads=" + std::to_string(p.model.kv_heads) + (p.model.mla ? " mla" : "") +
         " dim=" + std::to_string(p.model.head_dim) + " dtype=" +
         std::to_string(p.model.dtype_bytes) + " page=" + std::to_string(p.model.page_tokens) +
         " pages=" + std::to_string(pages) + " prefill " + side(p) + " decode " + side(d);
}

TEST(KvPlannerTest, RandomConfigurationsRebuildEveryDecodePageExactly) {
  std::mt19937 rng(2026);
  const int heads_choices[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128};
  const int tp_choices[] = {1, 2, 4, 8};
  int planned = 0, refused = 0;
  for (int iter = 0; iter < 400; ++iter) {
    KvModel m;
    m.mla = rng() % 5 == 0;
    m.kv_heads = m.mla ? 1 : heads_choices[rng() % 11];
    m.head_dim = m.mla ? 9 : 1 + static_cast<int>(rng() % 8);
    m.dtype_bytes = rng() % 2 ? 2 : 1;
    m.page_tokens = 1 + static_cast<int>(rng() % 5) * 4;
    KvSide pre{m, rng() % 2 ? KvOrder::kHND : KvOrder::kNHD, tp_choices[rng() % 4]};
    KvSide dec{m, rng() % 2 ? KvOrder::kHND : KvOrder::kNHD, tp_choices[rng() % 4]};
    const size_t pages = rng() % 6;
    std::vector<int64_t> ids(2 * pages + 1);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int64_t> src(ids.begin(), ids.begin() + pages);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int64_t> dst(ids.begin(), ids.begin() + pages);
    const std::string what = Describe(pre, dec, pages);
    auto plan = PlanKvTransfer(pre, dec, src, dst, iter);
    if (!pre.Validate().ok() || !dec.Validate().ok()) {
      EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument) << what;
      ++refused;
      continue;
    }
    ASSERT_TRUE(plan.ok()) << what << ": " << plan.status();
    CheckPlan(pre, dec, src, dst, *plan, what);
    if (HasFatalFailure()) return;
    ++planned;
  }
  EXPECT_GT(planned, 250);
  EXPECT_GT(refused, 5);  // the generator does reach unshardable combinations
}

TEST(KvPlannerTest, MatchingHndShardsMoveOnePageComponentPerWriteAndTpMismatchSplits) {
  KvModel m{8, 128, 2, false, 64};  // Qwen3-Coder-like GQA
  KvSide tp8{m, KvOrder::kHND, 8}, tp4{m, KvOrder::kHND, 4}, tp2{m, KvOrder::kHND, 2};
  std::vector<int64_t> pages = {3, 7, 1};
  auto same = PlanKvTransfer(tp8, tp8, pages, pages, 1);
  ASSERT_TRUE(same.ok());
  // One head per rank: K and V of a page are adjacent, so each page is one write.
  EXPECT_EQ(same->writes.size(), 8u * 3);
  for (const KvWrite& w : same->writes) EXPECT_EQ(w.src_rank, w.dst_rank);
  // Prefill TP4 -> decode TP2: each decode page is rebuilt from two prefill ranks.
  auto down = PlanKvTransfer(tp4, tp2, pages, pages, 1);
  ASSERT_TRUE(down.ok());
  EXPECT_EQ(down->writes_per_dst, (std::vector<int64_t>{2 * 2 * 3, 2 * 2 * 3}));
  // Prefill TP2 -> decode TP4: each decode rank reads half a prefill rank's heads.
  auto up = PlanKvTransfer(tp2, tp4, pages, pages, 1);
  ASSERT_TRUE(up.ok());
  for (int64_t n : up->writes_per_dst) EXPECT_EQ(n, 2 * 3);
}

TEST(KvPlannerTest, ReplicatedSourcesSpreadOverReplicaSetsBySeed) {
  KvModel mla{1, 576, 2, true, 64};  // DeepSeek-R1-like latent
  KvSide pre{mla, KvOrder::kHND, 8}, dec{mla, KvOrder::kHND, 4};
  std::vector<int64_t> pages = {0, 1};
  std::vector<int> used(8, 0);
  for (uint64_t seed = 0; seed < 64; ++seed) {
    auto plan = PlanKvTransfer(pre, dec, pages, pages, seed);
    ASSERT_TRUE(plan.ok());
    for (const KvWrite& w : plan->writes) used[w.src_rank] = 1;
    auto again = PlanKvTransfer(pre, dec, pages, pages, seed);
    ASSERT_EQ(again->source_replica, plan->source_replica);  // deterministic per seed
  }
  EXPECT_EQ(std::accumulate(used.begin(), used.end(), 0), 8);  // every prefill NIC gets work
}

TEST(KvPlannerTest, BadRequestsAreRefused) {
  KvModel m{8, 128, 2, false, 64};
  KvSide a{m, KvOrder::kHND, 4};
  KvModel other = m;
  other.page_tokens = 32;
  KvSide b{other, KvOrder::kHND, 4};
  std::vector<int64_t> p1 = {1}, p2 = {1, 2}, neg = {-1};
  EXPECT_EQ(PlanKvTransfer(a, b, p1, p1, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanKvTransfer(a, a, p1, p2, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanKvTransfer(a, a, neg, p1, 0).status().code(), StatusCode::kInvalidArgument);
  KvSide three{m, KvOrder::kHND, 3};
  EXPECT_EQ(PlanKvTransfer(a, three, p1, p1, 0).status().code(), StatusCode::kInvalidArgument);
  // A page id whose byte offset overflows 64 bits (pages of a.page_bytes() = 64 KiB): refused,
  // on either side, where it used to wrap.
  const int64_t limit = std::numeric_limits<int64_t>::max() / a.page_bytes();
  std::vector<int64_t> last = {limit - 1}, over = {limit};
  EXPECT_TRUE(PlanKvTransfer(a, a, last, p1, 0).ok());
  EXPECT_EQ(PlanKvTransfer(a, a, over, p1, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanKvTransfer(a, a, p1, over, 0).status().code(), StatusCode::kInvalidArgument);
  // A model too large for 64-bit offsets.
  KvModel huge = m;
  huge.head_dim = kMaxHeadDim + 1;
  EXPECT_EQ(huge.Validate().code(), StatusCode::kInvalidArgument);
  huge.head_dim = kMaxHeadDim;
  huge.page_tokens = kMaxPageTokens;
  EXPECT_TRUE(huge.Validate().ok());  // the largest dimensions allowed
}

}  // namespace
}  // namespace ferry
