// Bootstrap: how ranks find each other before any RDMA exists.
//
// ferry needs only two collectives to start: an all-gather of byte strings (addresses, region
// descriptors) and a barrier. The embedded implementation forks local ranks from one launcher and
// connects each to it by a socketpair; the launcher relays rounds. Tests, `make demo` and the
// benchmarks use it. MPI or torch.distributed can implement the same interface.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "ferry/export.h"
#include "ferry/status.h"

namespace ferry {

// Thread safety: one thread per rank at a time.
class FERRY_API Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Every rank contributes `mine`; returns all contributions indexed by rank. Unavailable if a
  // rank died; DeadlineExceeded after `timeout`.
  virtual StatusOr<std::vector<std::vector<uint8_t>>> AllGather(
      std::span<const uint8_t> mine, std::chrono::milliseconds timeout) = 0;
  Status Barrier(std::chrono::milliseconds timeout);
};

struct FERRY_API RankExit {
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;      // the signal that killed the rank, or 0
  bool timed_out = false;
  bool ok() const { return signal == 0 && !timed_out && exit_code == 0; }
};

// Forks `world_size` ranks; each runs `body(bootstrap)` and exits 0 if it returned OK (its
// status is printed to stderr otherwise). Ranks still running after `timeout` are killed.
// Call it from a process with no other threads running (fork copies only the caller's thread).
FERRY_API std::vector<RankExit> RunLocalRanks(int world_size,
                                              const std::function<Status(Bootstrap&)>& body,
                                              std::chrono::milliseconds timeout);

}  // namespace ferry
