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
