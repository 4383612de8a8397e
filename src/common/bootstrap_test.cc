#include "ferry/bootstrap.h"

#include <gtest/gtest.h>

#include <csignal>
#include <thread>

namespace ferry {
namespace {

using namespace std::chrono_literals;

TEST(BootstrapTest, AllGatherRoundsAcrossForkedRanks) {
  auto exits = RunLocalRanks(4, [](Bootstrap& b) -> Status {
    for (int round = 0; round < 3; ++round) {
      std::vector<uint8_t> mine(static_cast<size_t>(b.rank() + round), static_cast<uint8_t>(b.rank()));
      ASSIGN_OR_RETURN(auto all, b.AllGather(mine, 10s));
      if (all.size() != 4u) return InternalError("wrong count");
      for (int r = 0; r < 4; ++r) {
        if (all[r] != std::vector<uint8_t>(static_cast<size_t>(r + round), static_cast<uint8_t>(r))) {
          return InternalError("rank " + std::to_string(r) + " contribution mismatch");
        }
      }
    }
    return b.Barrier(10s);
  }, 60s);
  ASSERT_EQ(exits.size(), 4u);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

TEST(BootstrapTest, ADeadRankFailsTheOthersInsteadOfHangingThem) {
  auto exits = RunLocalRanks(3, [](Bootstrap& b) -> Status {
    if (b.rank() == 1) raise(SIGKILL);
    auto r = b.AllGather({}, 20s);
    if (r.ok()) return InternalError("round completed without rank 1");
    if (r.status().code() != StatusCode::kUnavailable) return r.status();
    return Status::Ok();
  }, 60s);
  EXPECT_TRUE(exits[0].ok());
  EXPECT_EQ(exits[1].signal, SIGKILL);
  EXPECT_TRUE(exits[2].ok());
}

TEST(BootstrapTest, RanksPastTheTimeoutAreKilled) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    if (b.rank() == 0) std::this_thread::sleep_for(60s);
    return Status::Ok();
  }, 500ms);
  EXPECT_TRUE(exits[0].timed_out);
  EXPECT_TRUE(exits[1].ok());
}

}  // namespace
}  // namespace ferry
