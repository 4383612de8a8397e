// Bootstrap: how ranks find each other before any RDMA exists.
//
// ferry needs only two collectives to start: an all-gather of byte strings (addresses, region
// descriptors) and a barrier. The embedded implementation forks local ranks from one launcher and
// connects each to it by a socketpair; the launcher relays rounds. Tests, `make demo` and the
// benchmarks use it. Processes started apart meet at a TCP rendezvous (JoinRendezvous). MPI or
// torch.distributed can implement the same interface.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
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
  // The address this rank's engines should bind (EngineOptions::node) when its launcher ran it
  // as a host of its own (RunLocalRanks under FERRY_LOCAL_RANK_NODES); empty otherwise.
  virtual std::string node() const { return {}; }
};

// Ranks started independently -- by mpirun, torchrun, Slurm or by hand, on one machine or many --
// meet at a rendezvous over TCP: rank 0 listens on `address`; every other rank connects to it,
// retrying until `timeout`, and says its rank and the world size; once every rank has come, rank
// 0 lets them all start. Collectives then go through rank 0 (each all-gather is one round trip
// per rank).
struct FERRY_API RendezvousOptions {
  std::string address;  // HOST:PORT (or [IPv6]:PORT) where rank 0 listens
  int world_size = 0;
  int rank = -1;
  std::chrono::milliseconds timeout{60000};  // for every rank to come
  // The fields given, each replaced by its variable where that is set: FERRY_RENDEZVOUS,
  // FERRY_WORLD_SIZE, FERRY_RANK, FERRY_RENDEZVOUS_TIMEOUT_MS (InvalidArgument naming a variable
  // whose value is not a number in range).
  static StatusOr<RendezvousOptions> FromEnv(RendezvousOptions given);
  static StatusOr<RendezvousOptions> FromEnv();  // over the defaults
};

// Joins the rendezvous (collective over every rank). InvalidArgument for an address that does
// not parse or resolve, a rank outside [0, world_size), or a world size the ranks disagree on
// (rank 0 and the disagreeing rank are both told, and the others are let go with the reason);
// AlreadyExists for a rank that another connection already claimed; DeadlineExceeded, after
// `timeout`, naming the ranks that never came (rank 0) or saying rank 0 was never reached or
// never let the world start (the others).
FERRY_API StatusOr<std::unique_ptr<Bootstrap>> JoinRendezvous(const RendezvousOptions& options);

struct FERRY_API RankExit {
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;      // the signal that killed the rank, or 0
  bool timed_out = false;
  bool ok() const { return signal == 0 && !timed_out && exit_code == 0; }
};

// Forks `world_size` ranks; each runs `body(bootstrap)` and exits 0 if it returned OK (its
// status is printed to stderr otherwise). Ranks still running after `timeout` are killed.
// Call it from a process with no other threads running (fork copies only the caller's thread).
// Ranks as hosts of their own: with FERRY_LOCAL_RANK_NETNS set (network namespace names,
// comma-separated, as `ip netns` keeps them under /var/run/netns), rank r enters the (r mod n)-th
// before `body` runs, and with FERRY_LOCAL_RANK_NODES (addresses, comma-separated) its
// Bootstrap::node() is the (r mod n)-th; the ranks still meet through the launcher's sockets.
// tests/netns_test.sh runs the multi-process suites so. A rank that cannot enter its namespace
// fails, saying why (entering one needs CAP_SYS_ADMIN).
FERRY_API std::vector<RankExit> RunLocalRanks(int world_size,
                                              const std::function<Status(Bootstrap&)>& body,
                                              std::chrono::milliseconds timeout);

}  // namespace ferry
