#include "common/fd_exchange.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// A memfd holding "rank R".
int MemFdOf(int rank) {
  const int fd = memfd_create("ferry-fd-test", MFD_CLOEXEC);
  const std::string text = "rank " + std::to_string(rank);
  if (fd >= 0 && write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string ContentOf(int fd) {
  char buf[32] = {};
  const ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  return n > 0 ? std::string(buf, n) : "";
}

// Two nodes of `per_node` ranks: each rank gets its node members' descriptors, in member order.
void ExpectExchange(int world, int per_node) {
  auto exits = RunLocalRanks(world, [&](Bootstrap& b) -> Status {
    const int node = b.rank() / per_node;
    std::vector<int> members;
    for (int r = node * per_node; r < (node + 1) * per_node; ++r) members.push_back(r);
    const int mine = MemFdOf(b.rank());
    CHECK_OR_RETURN(mine >= 0, "memfd");
    ASSIGN_OR_RETURN(auto fds, ExchangeFds(b, members, mine, 20s));
    close(mine);
    CHECK_OR_RETURN(fds.size() == members.size(), "wrong count");
    for (size_t i = 0; i < fds.size(); ++i) {
      const std::string got = ContentOf(fds[i]);
      CHECK_OR_RETURN(got == "rank " + std::to_string(members[i]),
                   "member " + std::to_string(members[i]) + " sent '" + got + "'");
      close(fds[i]);
    }
    return Status::Ok();
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

TEST(FdExchangeTest, OneNodeOfThree) { ExpectExchange(3, 3); }
TEST(FdExchangeTest, TwoNodesOfTwo) { ExpectExchange(4, 2); }

TEST(FdExchangeTest, ACallerOutsideItsMembersIsRefused) {
  auto exits = RunLocalRanks(1, [](Bootstrap& b) -> Status {
    const std::vector<int> members{1};
    auto fds = ExchangeFds(b, members, 0, 5s);
    CHECK_OR_RETURN(fds.status().code() == StatusCode::kInvalidArgument, fds.status().ToString());
    return Status::Ok();
  }, 30s);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_TRUE(exits[0].ok());
}

// A member that never sends: the others give up at the timeout instead of waiting forever.
TEST(FdExchangeTest, AMissingMemberTimesOut) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const int mine = MemFdOf(b.rank());
    if (b.rank() == 1) {
      // Takes part in the token round, listens where rank 0 will connect, passes the barrier,
      // and never sends its own descriptor.
      ASSIGN_OR_RETURN(auto tokens, b.AllGather(std::vector<uint8_t>(8), 20s));
      uint64_t token;
      std::memcpy(&token, tokens[0].data(), sizeof token);
      const std::string name = "ferry-fd-" + std::to_string(token) + "-1";
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path + 1, name.data(), name.size());
      const int sock = socket(AF_UNIX, SOCK_STREAM, 0);
      const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
      CHECK_OR_RETURN(bind(sock, reinterpret_cast<sockaddr*>(&addr), len) == 0, "bind");
      CHECK_OR_RETURN(listen(sock, 4) == 0, "listen");
      RETURN_IF_ERROR(b.Barrier(20s));
      sleep(3);
      close(sock);
      return Status::Ok();
    }
    const std::vector<int> members{0, 1};
    auto fds = ExchangeFds(b, members, mine, 1500ms);
    CHECK_OR_RETURN(fds.status().code() == StatusCode::kDeadlineExceeded, fds.status().ToString());
    return Status::Ok();
  }, 30s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry
