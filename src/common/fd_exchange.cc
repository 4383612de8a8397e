// ExchangeFds: SCM_RIGHTS over abstract Unix-domain sockets (see fd_exchange.h).
#include "common/fd_exchange.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

Status Errno(const std::string& what) {
  return UnavailableError("fd exchange: " + what + ": " + std::strerror(errno));
}

// The abstract socket address of `rank` for this exchange (leading NUL: no file is created).
sockaddr_un AddressOf(uint64_t token, int rank, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = "ferry-fd-" + std::to_string(token) + "-" + std::to_string(rank);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

// Waits until fd is readable or the deadline passes.
Status WaitReadable(int fd, Clock::time_point deadline, const char* what) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                            Clock::now());
    if (left.count() <= 0) return DeadlineExceededError(std::string("fd exchange: ") + what);
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (r > 0) return Status::Ok();
    if (r < 0 && errno != EINTR) return Errno(what);
  }
}

Status SendFd(int sock, int32_t rank, int fd) {
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{&rank, sizeof rank};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof rank)) return Errno("sendmsg");
  return Status::Ok();
}

// One (rank, descriptor) message; the descriptor is -1 if none came with it.
Status RecvFd(int sock, int32_t* rank, Fd* fd) {
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{rank, sizeof *rank};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Errno("recvmsg");
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int received;
      std::memcpy(&received, CMSG_DATA(c), sizeof received);
      *fd = Fd(received);
    }
  }
  if (n != static_cast<ssize_t>(sizeof *rank) || fd->get() < 0) {
    return DataLossError("fd exchange: a message without its rank or descriptor");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<int>> ExchangeFds(Bootstrap& bootstrap, std::span<const int> members,
                                       int mine, std::chrono::milliseconds timeout) {
  const int me = bootstrap.rank();
  const auto self = std::find(members.begin(), members.end(), me);
  if (self == members.end()) return InvalidArgumentError("ExchangeFds: caller not in members");
  for (int m : members) {
    if (m < 0 || m >= bootstrap.world_size()) {
      return InvalidArgumentError("ExchangeFds: member " + std::to_string(m) + " out of range");
    }
  }
  const auto deadline = Clock::now() + timeout;
  // Rank 0's token names this exchange's sockets.
  uint64_t token = std::random_device{}();
  token = token << 32 | std::random_device{}();
  std::vector<uint8_t> bytes(sizeof token);
  std::memcpy(bytes.data(), &token, sizeof token);
  ASSIGN_OR_RETURN(auto tokens, bootstrap.AllGather(bytes, timeout));
  if (tokens[0].size() != sizeof token) return DataLossError("ExchangeFds: bad token");
  std::memcpy(&token, tokens[0].data(), sizeof token);

  Fd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) return Errno("socket");
  socklen_t len;
  sockaddr_un addr = AddressOf(token, me, &len);
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) return Errno("bind");
  if (listen(listener.get(), static_cast<int>(members.size())) != 0) return Errno("listen");
  RETURN_IF_ERROR(bootstrap.Barrier(timeout));  // every listener is up

  for (int m : members) {
    if (m == me) continue;
    Fd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (sock.get() < 0) return Errno("socket");
    sockaddr_un peer = AddressOf(token, m, &len);
    if (connect(sock.get(), reinterpret_cast<sockaddr*>(&peer), len) != 0) {
      return Errno("connect to rank " + std::to_string(m));
    }
    RETURN_IF_ERROR(SendFd(sock.get(), me, mine));
  }

  std::vector<Fd> got(members.size());
  got[self - members.begin()] = Fd(dup(mine));
  if (got[self - members.begin()].get() < 0) return Errno("dup");
  for (size_t i = 1; i < members.size(); ++i) {
    RETURN_IF_ERROR(WaitReadable(listener.get(), deadline, "waiting for a peer's connection"));
    Fd conn(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (conn.get() < 0) return Errno("accept");
    RETURN_IF_ERROR(WaitReadable(conn.get(), deadline, "waiting for a peer's descriptor"));
    int32_t rank = -1;
    Fd fd;
    RETURN_IF_ERROR(RecvFd(conn.get(), &rank, &fd));
    const auto at = std::find(members.begin(), members.end(), rank);
    if (at == members.end() || rank == me || got[at - members.begin()].get() >= 0) {
      return DataLossError("ExchangeFds: unexpected descriptor from rank " +
                           std::to_string(rank));
    }
    got[at - members.begin()] = std::move(fd);
  }
  std::vector<int> out;
  for (Fd& f : got) out.push_back(f.Release());
  return out;
}

}  // namespace ferry
