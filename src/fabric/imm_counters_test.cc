#include "fabric/imm_counters.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace ferry::fabric {
namespace {

TEST(ImmCounterTableTest, CreateFindConsume) {
  ImmCounterTable t(4);
  EXPECT_TRUE(t.Create(0).ok());
  EXPECT_TRUE(t.Create(0xFFFFFFFFu).ok());
  EXPECT_EQ(t.Create(0).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(t.Find(1), nullptr);
  ImmCounterTable::Slot* s = t.Find(0xFFFFFFFFu);
  ASSERT_NE(s, nullptr);
  s->count.fetch_add(5);
  EXPECT_TRUE(t.Consume(0xFFFFFFFFu, 3).ok());
  EXPECT_EQ(s->count.load(), 2u);
  EXPECT_EQ(t.Consume(0xFFFFFFFFu, 3).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Consume(7, 1).code(), StatusCode::kNotFound);
}

TEST(ImmCounterTableTest, WeightedImmediatesCountTheirWeightOnTheirCounterOnly) {
  constexpr uint32_t kMask = 0x3FF00000u;
  ImmCounterTable t(8);
  ASSERT_TRUE(t.Create(0xC0000005u, kMask).ok());
  ASSERT_TRUE(t.Create(0xC0000006u).ok());  // plain: weighted forms of it are not its own
  uint64_t w = 0;
  ImmCounterTable::Slot* s = t.FindWeighted(WeightedImm(0xC0000005u, kMask, 37), &w);
  ASSERT_EQ(s, t.Find(0xC0000005u));
  EXPECT_EQ(w, 37u);
  s = t.FindWeighted(WeightedImm(0xC0000005u, kMask, WeightLimit(kMask)), &w);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(w, 1023u);
  EXPECT_EQ(t.FindWeighted(0xC0000005u, &w), t.Find(0xC0000005u));  // exact: one
  EXPECT_EQ(w, 1u);
  EXPECT_EQ(t.FindWeighted(WeightedImm(0xC0000006u, kMask, 3), &w), nullptr);
  EXPECT_EQ(t.FindWeighted(WeightedImm(0xC0000007u, kMask, 3), &w), nullptr);  // no counter
}

TEST(ImmCounterTableTest, WeightMasksAreCheckedAndBounded) {
  ImmCounterTable t(16);
  EXPECT_EQ(t.Create(1, 0x5u << 8).code(), StatusCode::kInvalidArgument);  // not contiguous
  EXPECT_EQ(t.Create(0x100, 0xFu << 8).code(), StatusCode::kInvalidArgument);  // overlaps imm
  for (uint32_t i = 0; i < ImmCounterTable::kMaxMasks; ++i) {
    EXPECT_TRUE(t.Create(i, 0xFu << (8 + 4 * i)).ok()) << i;
  }
  EXPECT_TRUE(t.Create(9, 0xFu << 8).ok());  // a mask already in use
  EXPECT_EQ(t.Create(10, 0xFu << 28).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(t.Find(10), nullptr);
}

TEST(ImmCounterTableTest, CapacityIsAHardBound) {
  ImmCounterTable t(3);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(t.Create(i * 1000).ok());
  EXPECT_EQ(t.Create(99).code(), StatusCode::kResourceExhausted);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_NE(t.Find(i * 1000), nullptr);
}

TEST(ImmCounterTableTest, ConcurrentCreatorsNeverDuplicate) {
  ImmCounterTable t(1024);
  std::vector<std::thread> threads;
  std::atomic<int> created{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (uint32_t i = 0; i < 1000; ++i) {
        if (t.Create(i * 7919u).ok()) created.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(created.load(), 1000);
  for (uint32_t i = 0; i < 1000; ++i) ASSERT_NE(t.Find(i * 7919u), nullptr);
}

}  // namespace
}  // namespace ferry::fabric
