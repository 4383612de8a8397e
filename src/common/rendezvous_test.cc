// The TCP rendezvous on loopback, each rank a thread of this process with its own sockets: the
// world forms whichever rank starts first, its all-gathers return every rank's bytes in rank
// order, and every way a world fails to form or breaks ends with a clear error within the
// timeout.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// A loopback address nothing listens on now.
std::string FreeAddress() {
  const uint16_t port = testing_util::FreeLoopbackPort();
  EXPECT_NE(port, 0);
  return "127.0.0.1:" + std::to_string(port);
}

RendezvousOptions Options(const std::string& address, int world, int rank,
                          std::chrono::milliseconds timeout = 10s) {
  RendezvousOptions o;
  o.address = address;
  o.world_size = world;
  o.rank = rank;
  o.timeout = timeout;
  return o;
}

// Runs body(i) for each entry i of `ranks` on a thread of its own (rank 0's after `root_delay`,
// so that the others must retry until it listens); the statuses, in that order.
std::vector<Status> RunRanks(const std::vector<int>& ranks, const std::function<Status(int)>& body,
                             std::chrono::milliseconds root_delay = 0ms) {
  std::vector<Status> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      if (ranks[i] == 0) std::this_thread::sleep_for(root_delay);
      out[i] = body(static_cast<int>(i));
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(RendezvousTest, FourRanksGatherInRankOrderWhoeverStartsFirst) {
  const std::string address = FreeAddress();
  const std::vector<int> ranks = {0, 1, 2, 3};
  auto statuses = RunRanks(
      ranks,
      [&](int r) -> Status {
        ASSIGN_OR_RETURN(auto b, JoinRendezvous(Options(address, 4, r)));
        CHECK_OR_RETURN(b->rank() == r && b->world_size() == 4, "rank or world size");
        for (int round = 0; round < 3; ++round) {
          // Rank r contributes r + round + 1 bytes of value 10 * r + round (rank 2 nothing in round
          // 1).
          std::vector<uint8_t> mine(r == 2 && round == 1 ? 0 : r + round + 1,
                                    static_cast<uint8_t>(10 * r + round));
          ASSIGN_OR_RETURN(auto all, b->AllGather(mine, 10s));
          CHECK_OR_RETURN(all.size() == 4, "entries");
          for (int q = 0; q < 4; ++q) {
            const std::vector<uint8_t> want(q == 2 && round == 1 ? 0 : q + round + 1,
                                            static_cast<uint8_t>(10 * q + round));
            CHECK_OR_RETURN(all[q] == want, "round " + std::to_string(round) + ": rank " +
                                                std::to_string(q) + "'s bytes");
          }
        }
        return b->Barrier(10s);
      },
      300ms);
  for (size_t i = 0; i < statuses.size(); ++i) {
    EXPECT_TRUE(statuses[i].ok()) << "rank " << i << ": " << statuses[i].ToString();
  }
}

TEST(RendezvousTest, RanksThatDisagreeOnTheWorldSizeAreAllTold) {
  const std::string address = FreeAddress();
  // Rank 1 comes first and is let go with the reason once rank 2 disagrees.
  auto statuses = RunRanks({0, 1, 2}, [&](int r) -> Status {
    if (r == 2) std::this_thread::sleep_for(500ms);
    return JoinRendezvous(Options(address, r == 2 ? 4 : 3, r)).status();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << r << statuses[r].ToString();
    EXPECT_NE(statuses[r].message().find("rank 2 says the world size is 4, rank 0 says 3"),
              std::string::npos)
        << statuses[r].ToString();
  }
}

TEST(RendezvousTest, ARankThatNeverComesIsNamedAtTheTimeout) {
  const std::string address = FreeAddress();
  const auto start = std::chrono::steady_clock::now();
  auto statuses = RunRanks({0, 1}, [&](int r) -> Status {
    // Rank 1 waits longer than rank 0, so it hears rank 0's reason.
    return JoinRendezvous(Options(address, 3, r, r == 0 ? 800ms : 3000ms)).status();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(statuses[0].code(), StatusCode::kDeadlineExceeded) << statuses[0].ToString();
  EXPECT_NE(statuses[0].message().find("rank 2 of 3 never came"), std::string::npos)
      << statuses[0].ToString();
  // Rank 1 came, and is let go with rank 0's reason.
  EXPECT_EQ(statuses[1].code(), StatusCode::kDeadlineExceeded) << statuses[1].ToString();
  EXPECT_NE(statuses[1].message().find("rank 2 of 3 never came"), std::string::npos)
      << statuses[1].ToString();
}

TEST(RendezvousTest, WithoutRankZeroTheOthersGiveUpAtTheTimeout) {
  const std::string address = FreeAddress();
  const auto start = std::chrono::steady_clock::now();
  const Status s = JoinRendezvous(Options(address, 2, 1, 500ms)).status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("could not reach rank 0 at " + address), std::string::npos)
      << s.ToString();
}

// A second connection claiming rank 1 is refused; the world still forms with the first.
TEST(RendezvousTest, ARankClaimedTwiceIsRefusedAndTheWorldStillForms) {
  const std::string address = FreeAddress();
  auto statuses = RunRanks({0, 1, 1, 2}, [&](int i) -> Status {
    const int rank = i == 3 ? 2 : i == 2 ? 1 : i;
    if (i == 2) std::this_thread::sleep_for(200ms);  // the second rank 1
    if (i == 3) std::this_thread::sleep_for(600ms);
    ASSIGN_OR_RETURN(auto b, JoinRendezvous(Options(address, 3, rank)));
    return b->Barrier(10s);
  });
  EXPECT_TRUE(statuses[0].ok()) << statuses[0].ToString();
  EXPECT_TRUE(statuses[1].ok()) << statuses[1].ToString();
  EXPECT_EQ(statuses[2].code(), StatusCode::kAlreadyExists) << statuses[2].ToString();
  EXPECT_TRUE(statuses[3].ok()) << statuses[3].ToString();
}

// A rank lost after the world formed: rank 0's next all-gather names it, and the rank still
// waiting on rank 0 is let go at once (Unavailable), not at its deadline.
TEST(RendezvousTest, ARankLostAfterTheStartEndsTheNextGatherAtOnce) {
  const std::string address = FreeAddress();
  auto statuses = RunRanks({0, 1, 2}, [&](int r) -> Status {
    ASSIGN_OR_RETURN(auto b, JoinRendezvous(Options(address, 3, r)));
    RETURN_IF_ERROR(b->Barrier(10s));
    if (r == 2) return Status::Ok();  // leaves: its connection closes
    const auto start = std::chrono::steady_clock::now();
    const Status s = b->Barrier(20s);
    CHECK_OR_RETURN(std::chrono::steady_clock::now() - start < 5s, "waited out the deadline");
    return s;
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kUnavailable) << statuses[0].ToString();
  EXPECT_NE(statuses[0].message().find("rank 2"), std::string::npos) << statuses[0].ToString();
  EXPECT_EQ(statuses[1].code(), StatusCode::kUnavailable) << statuses[1].ToString();
  EXPECT_TRUE(statuses[2].ok()) << statuses[2].ToString();
}

// A rank 0 that is not ferry's, or is corrupt: it listens at the address and answers with
// lengths no ferry rank sends -- a 4 GiB answer message to one rank, and to the next a world
// start followed by a round whose second frame claims 4 GiB. Each joining rank ends with
// DataLoss at once, having allocated nothing of the sort.
TEST(RendezvousTest, ARankZeroSendingAbsurdLengthsIsDataLossNotAnAllocation) {
  const uint16_t port = testing_util::FreeLoopbackPort();
  ASSERT_NE(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  std::thread fake([listener] {
    for (int conn = 0; conn < 2; ++conn) {
      const int fd = accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      uint32_t hello[4];
      if (recv(fd, hello, sizeof hello, MSG_WAITALL) != sizeof hello) return;
      if (conn == 0) {
        const uint32_t answer[2] = {static_cast<uint32_t>(StatusCode::kInternal), 0xFFFFFFFFu};
        (void)!send(fd, answer, sizeof answer, MSG_NOSIGNAL);
      } else {
        const uint32_t start[2] = {0, 0};
        (void)!send(fd, start, sizeof start, MSG_NOSIGNAL);
        uint32_t len = 0;
        std::vector<uint8_t> frame;
        if (recv(fd, &len, 4, MSG_WAITALL) == 4) {
          frame.resize(len);
          if (len) (void)!recv(fd, frame.data(), len, MSG_WAITALL);
        }
        // Count 2; a frame of one byte; then a frame claiming 4 GiB.
        std::vector<uint8_t> round;
        for (uint32_t v : {2u, 1u}) round.insert(round.end(), (uint8_t*)&v, (uint8_t*)&v + 4);
        round.push_back(0x2a);
        for (int i = 0; i < 4; ++i) round.push_back(0xFF);
        (void)!send(fd, round.data(), round.size(), MSG_NOSIGNAL);
      }
      std::this_thread::sleep_for(200ms);
      close(fd);
    }
  });
  auto first = JoinRendezvous(Options(address, 2, 1, 5s));
  EXPECT_EQ(first.status().code(), StatusCode::kDataLoss) << first.status().ToString();
  auto second = JoinRendezvous(Options(address, 2, 1, 5s));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  const auto start = std::chrono::steady_clock::now();
  auto round = (*second)->AllGather(std::vector<uint8_t>{7}, 5s);
  EXPECT_EQ(round.status().code(), StatusCode::kDataLoss) << round.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  fake.join();
  close(listener);
}

TEST(RendezvousTest, BadOptionsAreRefusedBeforeAnyConnection) {
  for (const auto& [address, world, rank] :
       std::vector<std::tuple<std::string, int, int>>{{"127.0.0.1:1", 0, 0},
                                                      {"127.0.0.1:1", 2, 2},
                                                      {"127.0.0.1:1", 2, -1},
                                                      {"no-port", 2, 1},
                                                      {"127.0.0.1:99999", 2, 1},
                                                      {"[::1:5", 2, 1},
                                                      {":5000", 2, 1}}) {
    const Status s = JoinRendezvous(Options(address, world, rank, 200ms)).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument)
        << address << " " << world << " " << rank << ": " << s.ToString();
  }
  // A world of one needs no address.
  auto solo = JoinRendezvous(Options("", 1, 0));
  ASSERT_TRUE(solo.ok()) << solo.status().ToString();
  const std::vector<uint8_t> mine = {7};
  auto all = (*solo)->AllGather(mine, 1s);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, std::vector<std::vector<uint8_t>>{mine});
}

TEST(RendezvousTest, FromEnvReadsEachVariableAndRefusesBadValues) {
  setenv("FERRY_RENDEZVOUS", "10.0.0.1:29500", 1);
  setenv("FERRY_WORLD_SIZE", "16", 1);
  setenv("FERRY_RANK", "3", 1);
  setenv("FERRY_RENDEZVOUS_TIMEOUT_MS", "1500", 1);
  auto o = RendezvousOptions::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->address, "10.0.0.1:29500");
  EXPECT_EQ(o->world_size, 16);
  EXPECT_EQ(o->rank, 3);
  EXPECT_EQ(o->timeout, 1500ms);
  setenv("FERRY_RANK", "three", 1);
  const Status s = RendezvousOptions::FromEnv().status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("FERRY_RANK"), std::string::npos) << s.ToString();
  for (const char* v :
       {"FERRY_RENDEZVOUS", "FERRY_WORLD_SIZE", "FERRY_RANK", "FERRY_RENDEZVOUS_TIMEOUT_MS"}) {
    unsetenv(v);
  }
  RendezvousOptions given;
  given.world_size = 2;
  auto kept = RendezvousOptions::FromEnv(given);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->world_size, 2);  // unset variables leave the fields given
}

}  // namespace
}  // namespace ferry
