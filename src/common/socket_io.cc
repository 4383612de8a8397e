#include "common/socket_io.h"

#include "common/frames.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

using Millis = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

Status IoExact(int fd, void* buf, size_t n, bool write, SteadyClock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    auto left = std::chrono::duration_cast<Millis>(deadline - SteadyClock::now()).count();
    if (left <= 0) return DeadlineExceededError("bootstrap: peer did not answer in time");
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    int r = poll(&pfd, 1, static_cast<int>(std::min<long>(left, 1000)));
    if (r < 0 && errno != EINTR) return ErrnoError("bootstrap poll", errno);
    if (r <= 0) continue;
    ssize_t got = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (got == 0) return UnavailableError("bootstrap: connection closed (a rank died)");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == EPIPE || errno == ECONNRESET) {
        return UnavailableError("bootstrap: connection lost (a rank died)");
      }
      return ErrnoError("bootstrap io", errno);
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return Status::Ok();
}

namespace {

class RelayedBootstrap final : public Bootstrap {
 public:
  RelayedBootstrap(int rank, int world_size, int fd) : rank_(rank), size_(world_size), fd_(fd) {}
  ~RelayedBootstrap() override { close(fd_); }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }

  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(std::span<const uint8_t> mine,
                                                        Millis timeout) override {
    const auto deadline = SteadyClock::now() + timeout;
    uint32_t len = static_cast<uint32_t>(mine.size());
    RETURN_IF_ERROR(IoExact(fd_, &len, sizeof len, true, deadline));
    RETURN_IF_ERROR(IoExact(fd_, const_cast<uint8_t*>(mine.data()), mine.size(), true, deadline));
    return ReadRound([&](void* p, size_t n) { return IoExact(fd_, p, n, false, deadline); },
                     size_);
  }

 private:
  const int rank_, size_, fd_;
};

}  // namespace

std::unique_ptr<Bootstrap> NewRelayedBootstrap(int rank, int world_size, int fd) {
  return std::make_unique<RelayedBootstrap>(rank, world_size, fd);
}

}  // namespace ferry
