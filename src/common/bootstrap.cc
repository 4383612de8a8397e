// The embedded bootstrap: forked ranks, one socketpair each to the launcher, which relays
// all-gather rounds. Frames are [u32 length][bytes]; a round ends when every rank has sent one
// frame, and the launcher answers each rank with [u32 count]([u32 length][bytes])*.
#include "ferry/bootstrap.h"

#include "common/frames.h"
#include "common/socket_io.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ferry {
namespace {

using Millis = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// The launcher's side: collects one frame per live rank, then answers all of them.
class Relay {
 public:
  explicit Relay(std::vector<int> fds) : fds_(std::move(fds)), frames_(fds_.size()),
                                         have_(fds_.size(), false) {}

  // Reads what is readable on fd i; returns false when the rank hung up.
  bool OnReadable(size_t i) {
    Buffer& b = partial_[i];
    uint8_t chunk[4096];
    ssize_t got = ::recv(fds_[i], chunk, sizeof chunk, MSG_DONTWAIT);
    if (got <= 0) return got < 0 && (errno == EAGAIN || errno == EINTR);
    b.bytes.insert(b.bytes.end(), chunk, chunk + got);
    while (b.bytes.size() >= 4) {
      uint32_t len;
      std::memcpy(&len, b.bytes.data(), 4);
      if (len > kMaxFrameBytes) return false;  // not a frame ferry sends: the rank is broken
      if (b.bytes.size() < 4 + size_t{len}) break;
      frames_[i].assign(b.bytes.begin() + 4, b.bytes.begin() + 4 + len);
      have_[i] = true;
      b.bytes.erase(b.bytes.begin(), b.bytes.begin() + 4 + len);
    }
    return true;
  }

  bool RoundComplete() const {
    for (bool h : have_) if (!h) return false;
    return true;
  }

  void Answer() {
    std::vector<uint8_t> out = EncodeRound(frames_);
    for (int fd : fds_) {
      Status s = IoExact(fd, out.data(), out.size(), true, SteadyClock::now() + Millis(10000));
      (void)s;  // a rank that died will be seen by its peers
    }
    for (size_t i = 0; i < have_.size(); ++i) have_[i] = false;
  }

 private:
  struct Buffer {
    std::vector<uint8_t> bytes;
  };
  std::vector<int> fds_;
  std::vector<std::vector<uint8_t>> frames_;
  std::vector<bool> have_;
  std::unordered_map<size_t, Buffer> partial_;
};

// The (rank mod n)-th of a comma-separated list in environment variable `name`; empty when
// the variable is unset or empty.
std::string NthOf(const char* name, int rank) {
  const char* v = std::getenv(name);
  if (!v || !*v) return {};
  std::vector<std::string> items;
  std::string item;
  for (const char* c = v;; ++c) {
    if (*c == ',' || *c == '\0') {
      items.push_back(item);
      item.clear();
      if (*c == '\0') break;
    } else {
      item += *c;
    }
  }
  return items[static_cast<size_t>(rank) % items.size()];
}

// A rank's bootstrap with the address it was given (Bootstrap::node()).
class HostedBootstrap final : public Bootstrap {
 public:
  HostedBootstrap(std::unique_ptr<Bootstrap> inner, std::string node)
      : inner_(std::move(inner)), node_(std::move(node)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(std::span<const uint8_t> mine,
                                                        Millis timeout) override {
    return inner_->AllGather(mine, timeout);
  }
  std::string node() const override { return node_; }

 private:
  std::unique_ptr<Bootstrap> inner_;
  std::string node_;
};

// FERRY_LOCAL_RANK_NETNS / FERRY_LOCAL_RANK_NODES (see RunLocalRanks), in a forked rank: enters
// the rank's namespace and returns its address (empty: none given).
StatusOr<std::string> EnterRankHost(int rank) {
  const std::string ns = NthOf("FERRY_LOCAL_RANK_NETNS", rank);
  if (!ns.empty()) {
    const std::string path = "/var/run/netns/" + ns;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return UnavailableError("FERRY_LOCAL_RANK_NETNS: rank " + std::to_string(rank) +
                              " cannot open " + path + ": " + std::strerror(errno));
    }
    const int rc = setns(fd, CLONE_NEWNET);
    const int err = errno;
    close(fd);
    if (rc != 0) {
      return UnavailableError("FERRY_LOCAL_RANK_NETNS: rank " + std::to_string(rank) +
                              " cannot enter " + ns + ": " + std::strerror(err));
    }
  }
  return NthOf("FERRY_LOCAL_RANK_NODES", rank);
}

}  // namespace

Status Bootstrap::Barrier(Millis timeout) {
  uint8_t none = 0;
  auto r = AllGather(std::span<const uint8_t>(&none, 1), timeout);
  return r.status();
}

std::vector<RankExit> RunLocalRanks(int world_size, const std::function<Status(Bootstrap&)>& body,
                                    Millis timeout) {
  std::vector<RankExit> exits(world_size);
  std::vector<pid_t> pids(world_size, -1);
  std::vector<int> parent_fds;
  std::fflush(nullptr);
  for (int r = 0; r < world_size; ++r) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
      std::perror("socketpair");
      break;
    }
    pid_t pid = fork();
    if (pid == 0) {
      for (int fd : parent_fds) close(fd);
      close(sv[0]);
      StatusOr<std::string> node = EnterRankHost(r);
      Status s = node.status();
      if (s.ok()) {
        HostedBootstrap bootstrap(NewRelayedBootstrap(r, world_size, sv[1]), *std::move(node));
        s = body(bootstrap);
      }
      if (!s.ok()) std::fprintf(stderr, "[rank %d] %s\n", r, s.ToString().c_str());
      std::fflush(nullptr);
      _exit(s.ok() ? 0 : 1);
    }
    close(sv[1]);
    if (pid < 0) {
      std::perror("fork");
      close(sv[0]);
      break;
    }
    pids[r] = pid;
    parent_fds.push_back(sv[0]);
  }

  Relay relay(parent_fds);
  std::vector<bool> open(parent_fds.size(), true);
  int running = static_cast<int>(parent_fds.size());
  auto deadline = SteadyClock::now() + timeout;
  while (running > 0) {
    // Reap ranks that finished.
    for (int r = 0; r < static_cast<int>(pids.size()); ++r) {
      if (pids[r] <= 0) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        exits[r].exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        exits[r].signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
        pids[r] = -1;
        --running;
      }
    }
    if (SteadyClock::now() >= deadline) {
      for (int r = 0; r < static_cast<int>(pids.size()); ++r) {
        if (pids[r] <= 0) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        exits[r].timed_out = true;
        pids[r] = -1;
        --running;
      }
      break;
    }
    std::vector<pollfd> pfds;
    std::vector<size_t> which;
    for (size_t i = 0; i < parent_fds.size(); ++i) {
      if (open[i]) {
        pfds.push_back({parent_fds[i], POLLIN, 0});
        which.push_back(i);
      }
    }
    int n = pfds.empty() ? (usleep(2000), 0) : poll(pfds.data(), pfds.size(), 5);
    for (int k = 0; n > 0 && k < static_cast<int>(pfds.size()); ++k) {
      if (pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) {
        size_t i = which[k];
        if (!relay.OnReadable(i)) {
          // A rank hung up: the round can never complete; close everyone's link so that
          // ranks blocked in AllGather see Unavailable instead of waiting out their deadline.
          for (size_t j = 0; j < parent_fds.size(); ++j) {
            if (open[j]) shutdown(parent_fds[j], SHUT_RDWR);
            open[j] = false;
          }
        }
      }
    }
    if (relay.RoundComplete()) relay.Answer();
  }
  for (int fd : parent_fds) close(fd);
  return exits;
}

}  // namespace ferry
