// The TCP rendezvous (ferry/bootstrap.h: JoinRendezvous). Frames, all integers u32 in host order
// (every rank runs the same build on the same kind of machine):
//
//   hello   rank r -> 0   magic, version, world size, rank
//   answer  0 -> rank r   status code (0: the world starts), message length, message
//   round   rank r -> 0   length, bytes;   0 -> rank r   count, (length, bytes) per rank
//
// Rank 0 keeps one connection per rank and relays each all-gather round over them.
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/env.h"
#include "common/frames.h"
#include "common/socket_io.h"
#include "ferry/bootstrap.h"

namespace ferry {
namespace {

using Millis = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x46525256;  // "FRRV"
constexpr uint32_t kVersion = 1;
// How long rank 0 gives a connection to say hello before it drops it (a stray client, a port
// scanner), so that one silent connection cannot stall the rendezvous.
constexpr Millis kHelloWait{5000};

struct HostPort {
  std::string host, port;
};

StatusOr<HostPort> ParseAddress(const std::string& address) {
  const auto bad = [&](const char* why) {
    return InvalidArgumentError("rendezvous address '" + address + "': " + why +
                                " (HOST:PORT or [IPv6]:PORT)");
  };
  HostPort hp;
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return bad("no ']:' after the IPv6 host");
    }
    hp.host = address.substr(1, close - 1);
    hp.port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    hp.host = address.substr(0, colon);
    hp.port = address.substr(colon + 1);
  }
  if (hp.host.empty()) return bad("no host");
  if (hp.port.empty() || hp.port.size() > 5 ||
      hp.port.find_first_not_of("0123456789") != std::string::npos || std::stoi(hp.port) > 65535) {
    return bad("the port is not a number in [0, 65535]");
  }
  return hp;
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

Status Resolve(const HostPort& hp, bool passive, AddrInfo* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const int rc = getaddrinfo(hp.host.c_str(), hp.port.c_str(), &hints, &out->list);
  if (rc != 0 || !out->list) {
    return InvalidArgumentError("rendezvous: cannot resolve '" + hp.host +
                                "': " + gai_strerror(rc));
  }
  return Status::Ok();
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

Status PutU32s(int fd, std::initializer_list<uint32_t> values, SteadyClock::time_point deadline) {
  std::vector<uint32_t> v(values);
  return IoExact(fd, v.data(), v.size() * 4, true, deadline);
}

Status SendAnswer(int fd, const Status& s, SteadyClock::time_point deadline) {
  const std::string message(s.message());
  RETURN_IF_ERROR(PutU32s(
      fd, {static_cast<uint32_t>(s.code()), static_cast<uint32_t>(message.size())}, deadline));
  return IoExact(fd, const_cast<char*>(message.data()), message.size(), true, deadline);
}

// Reads from `fd` until `deadline` (common/frames.h's frames are read through it).
ReadExact SocketReader(int fd, SteadyClock::time_point deadline) {
  return [fd, deadline](void* p, size_t n) { return IoExact(fd, p, n, false, deadline); };
}

// Rank 0: a connection per other rank (fds_[r], -1 for itself).
class RootBootstrap final : public Bootstrap {
 public:
  RootBootstrap(int world_size, std::vector<int> fds) : size_(world_size), fds_(std::move(fds)) {}
  ~RootBootstrap() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  int rank() const override { return 0; }
  int world_size() const override { return size_; }

  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(std::span<const uint8_t> mine,
                                                        Millis timeout) override {
    const auto deadline = SteadyClock::now() + timeout;
    std::vector<std::vector<uint8_t>> all(size_);
    all[0].assign(mine.begin(), mine.end());
    for (int r = 1; r < size_; ++r) {
      Status s = ReadFrame(SocketReader(fds_[r], deadline), &all[r]);
      if (!s.ok()) return Broken(s.WithContext("rendezvous: rank " + std::to_string(r)));
    }
    std::vector<uint8_t> answer = EncodeRound(all);
    for (int r = 1; r < size_; ++r) {
      Status s = IoExact(fds_[r], answer.data(), answer.size(), true, deadline);
      if (!s.ok()) return Broken(s.WithContext("rendezvous: rank " + std::to_string(r)));
    }
    return all;
  }

 private:
  // A rank lost: the world cannot gather again. Every other rank's link is shut so that its
  // all-gather ends now (Unavailable) rather than at its deadline.
  Status Broken(const Status& s) {
    for (int fd : fds_) {
      if (fd >= 0) shutdown(fd, SHUT_RDWR);
    }
    return s;
  }

  const int size_;
  std::vector<int> fds_;
};

// A world of one.
class SoloBootstrap final : public Bootstrap {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(std::span<const uint8_t> mine,
                                                        Millis) override {
    return std::vector<std::vector<uint8_t>>{std::vector<uint8_t>(mine.begin(), mine.end())};
  }
};

StatusOr<std::unique_ptr<Bootstrap>> Serve(const RendezvousOptions& o, const HostPort& hp,
                                           SteadyClock::time_point deadline) {
  AddrInfo ai;
  RETURN_IF_ERROR(Resolve(hp, true, &ai));
  const int listener = socket(ai.list->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return ErrnoError("rendezvous socket", errno);
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  std::vector<int> fds(o.world_size, -1);
  const auto close_all = [&] {
    close(listener);
    for (int& fd : fds) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
  };
  if (bind(listener, ai.list->ai_addr, ai.list->ai_addrlen) != 0 ||
      listen(listener, o.world_size) != 0) {
    const int e = errno;
    close_all();
    return ErrnoError("rendezvous: listening on " + o.address, e);
  }
  int missing = o.world_size - 1;
  while (missing > 0) {
    const auto left = std::chrono::duration_cast<Millis>(deadline - SteadyClock::now()).count();
    if (left <= 0) {
      std::string never;
      for (int r = 1; r < o.world_size; ++r) {
        if (fds[r] < 0) never += (never.empty() ? "" : ", ") + std::to_string(r);
      }
      // The ranks that came are let go with the reason rather than left to their deadline.
      const Status s = DeadlineExceededError("rendezvous at " + o.address + ": rank" +
                                             (missing > 1 ? "s " : " ") + never + " of " +
                                             std::to_string(o.world_size) + " never came within " +
                                             std::to_string(o.timeout.count()) + " ms");
      for (int fd : fds) {
        if (fd >= 0) (void)SendAnswer(fd, s, SteadyClock::now() + Millis(1000));
      }
      close_all();
      return s;
    }
    pollfd pfd{listener, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(std::min<long>(left, 200))) <= 0) continue;
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    NoDelay(fd);
    uint32_t hello[4] = {};
    const auto hello_by = std::min(deadline, SteadyClock::now() + kHelloWait);
    if (!IoExact(fd, hello, sizeof hello, false, hello_by).ok() || hello[0] != kMagic) {
      close(fd);  // not a ferry rank, or one that went silent
      continue;
    }
    const int world = static_cast<int>(hello[2]), rank = static_cast<int>(hello[3]);
    Status refused;
    if (hello[1] != kVersion) {
      refused = InvalidArgumentError("rendezvous: rank " + std::to_string(rank) +
                                     " speaks version " + std::to_string(hello[1]) +
                                     ", rank 0 speaks " + std::to_string(kVersion));
    } else if (world != o.world_size) {
      refused = InvalidArgumentError("rendezvous: rank " + std::to_string(rank) +
                                     " says the world size is " + std::to_string(world) +
                                     ", rank 0 says " + std::to_string(o.world_size));
    } else if (rank < 1 || rank >= o.world_size) {
      refused = InvalidArgumentError("rendezvous: rank " + std::to_string(rank) +
                                     " is outside [1, " + std::to_string(o.world_size) + ")");
    } else if (fds[rank] >= 0) {
      (void)SendAnswer(fd,
                       AlreadyExistsError("rendezvous: rank " + std::to_string(rank) +
                                          " has already joined from another connection"),
                       SteadyClock::now() + Millis(1000));
      close(fd);
      continue;  // the first stays; the world can still form
    }
    if (!refused.ok()) {
      // Ranks that disagree on the world cannot start it: every rank is told why.
      (void)SendAnswer(fd, refused, SteadyClock::now() + Millis(1000));
      close(fd);
      for (int other : fds) {
        if (other >= 0) (void)SendAnswer(other, refused, SteadyClock::now() + Millis(1000));
      }
      close_all();
      return refused;
    }
    fds[rank] = fd;
    --missing;
  }
  close(listener);
  for (int r = 1; r < o.world_size; ++r) {
    Status s = SendAnswer(fds[r], Status::Ok(), deadline);
    if (!s.ok()) {
      for (int& fd : fds) {
        if (fd >= 0) close(fd);
        fd = -1;
      }
      return s.WithContext("rendezvous: letting rank " + std::to_string(r) + " start");
    }
  }
  return std::unique_ptr<Bootstrap>(new RootBootstrap(o.world_size, std::move(fds)));
}

StatusOr<std::unique_ptr<Bootstrap>> Join(const RendezvousOptions& o, const HostPort& hp,
                                          SteadyClock::time_point deadline) {
  AddrInfo ai;
  RETURN_IF_ERROR(Resolve(hp, false, &ai));
  // Rank 0 may not be listening yet: connect until it is, or until the deadline.
  int fd = -1, last_errno = 0;
  for (auto wait = Millis(20);; wait = std::min(wait * 2, Millis(500))) {
    for (addrinfo* a = ai.list; a && fd < 0; a = a->ai_next) {
      fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return ErrnoError("rendezvous socket", errno);
      if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        last_errno = errno;
        close(fd);
        fd = -1;
      }
    }
    if (fd >= 0) break;
    const auto now = SteadyClock::now();
    if (now >= deadline) {
      return DeadlineExceededError("rendezvous: rank " + std::to_string(o.rank) +
                                   " could not reach rank 0 at " + o.address + " within " +
                                   std::to_string(o.timeout.count()) +
                                   " ms (last: " + std::strerror(last_errno) + ")");
    }
    std::this_thread::sleep_for(std::min<SteadyClock::duration>(wait, deadline - now));
  }
  NoDelay(fd);
  Status s = PutU32s(
      fd, {kMagic, kVersion, static_cast<uint32_t>(o.world_size), static_cast<uint32_t>(o.rank)},
      deadline);
  Status answer;
  if (s.ok()) s = ReadAnswer(SocketReader(fd, deadline), &answer);
  if (!s.ok()) {
    close(fd);
    if (s.code() == StatusCode::kDeadlineExceeded) {
      return DeadlineExceededError("rendezvous: rank 0 at " + o.address +
                                   " did not start the world within " +
                                   std::to_string(o.timeout.count()) + " ms (ranks missing)");
    }
    return s.WithContext("rendezvous: rank 0 at " + o.address);
  }
  if (!answer.ok()) {
    close(fd);
    return answer;
  }
  return NewRelayedBootstrap(o.rank, o.world_size, fd);
}

}  // namespace

StatusOr<RendezvousOptions> RendezvousOptions::FromEnv(RendezvousOptions o) {
  if (const char* a = std::getenv("FERRY_RENDEZVOUS")) o.address = a;
  RETURN_IF_ERROR(EnvNumber("FERRY_WORLD_SIZE", &o.world_size, 1, 1 << 16));
  RETURN_IF_ERROR(EnvNumber("FERRY_RANK", &o.rank, 0, (1 << 16) - 1));
  int64_t timeout_ms = o.timeout.count();
  RETURN_IF_ERROR(EnvNumber("FERRY_RENDEZVOUS_TIMEOUT_MS", &timeout_ms, 1, int64_t{1} << 40));
  o.timeout = Millis(timeout_ms);
  return o;
}

StatusOr<RendezvousOptions> RendezvousOptions::FromEnv() { return FromEnv(RendezvousOptions{}); }

StatusOr<std::unique_ptr<Bootstrap>> JoinRendezvous(const RendezvousOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return InvalidArgumentError("rendezvous: rank " + std::to_string(o.rank) + " of " +
                                std::to_string(o.world_size) +
                                " (ranks are [0, world size), the world at least 1)");
  }
  if (o.timeout.count() <= 0) return InvalidArgumentError("rendezvous: a timeout of 0 ms");
  if (o.world_size == 1) return std::unique_ptr<Bootstrap>(new SoloBootstrap);
  ASSIGN_OR_RETURN(const HostPort hp, ParseAddress(o.address));
  const auto deadline = SteadyClock::now() + o.timeout;
  return o.rank == 0 ? Serve(o, hp, deadline) : Join(o, hp, deadline);
}

}  // namespace ferry
