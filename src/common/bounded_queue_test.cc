#include "common/bounded_queue.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace ferry {
namespace {

TEST(BoundedQueueTest, RefusesWhenFullAndKeepsFifoOrder) {
  BoundedQueue<int> q(3);  // rounds up to 4
  EXPECT_EQ(q.capacity(), 4u);
  for (int i = 0; i < 4; ++i) {
    int v = i;
    EXPECT_TRUE(q.TryPush(std::move(v)));
  }
  int extra = 99;
  EXPECT_FALSE(q.TryPush(std::move(extra)));
  EXPECT_EQ(extra, 99);  // a refused value stays with the caller
  for (int i = 0; i < 4; ++i) {
    int v = -1;
    ASSERT_TRUE(q.TryPop(v));
    EXPECT_EQ(v, i);
  }
  int v;
  EXPECT_FALSE(q.TryPop(v));
}

TEST(BoundedQueueTest, ManyProducersOneConsumerLoseNothing) {
  BoundedQueue<uint64_t> q(64);
  constexpr int kProducers = 4;
  constexpr uint64_t kEach = 20000;
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (uint64_t i = 0; i < kEach; ++i) {
        uint64_t v = (uint64_t(p) << 32) | i;
        while (!q.TryPush(std::move(v))) std::this_thread::yield();
      }
    });
  }
  std::vector<uint64_t> next(kProducers, 0);
  uint64_t got = 0;
  while (got < kProducers * kEach) {
    uint64_t v;
    if (!q.TryPop(v)) {
      std::this_thread::yield();
      continue;
    }
    int p = static_cast<int>(v >> 32);
    ASSERT_EQ(v & 0xFFFFFFFF, next[p]) << "per-producer order broken";
    ++next[p];
    ++got;
  }
  for (auto& t : producers) t.join();
}

}  // namespace
}  // namespace ferry
