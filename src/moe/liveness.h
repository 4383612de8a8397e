// Liveness: heartbeats that tell a late rank from a lost one, for node-once forwarding under
// mask_lost_peers.
//
// Why. Under node-once a step waits at two hops (the rail, then the node), and a rank that waits
// at one hop for a lost rank is late at the next for the ranks that wait for it. No split of a
// step's deadline tells that late rank from a lost one: a loss before the rail send delays the
// node hop, one before the node send delays the next rail hop, and each hop's share would have
// to outlast the other's. So a rank that misses the deadline is asked whether it is itself
// waiting: while a rank is inside a receive step (Stepping), its heartbeat thread sends an
// immediate to each rank that may wait for it (its rail and its node) every kBeat, and a
// sender heard from within kSilence is late, not lost -- its waiters wait on while it stays
// heard from, up to a bound (kLateWaits more of the step's wait). A rank whose process died,
// or that is late for its own reasons (stalled outside a step, as a slow rank is), is silent
// and is masked at the deadline, as per rank forwarding masks it. A rank that hangs inside a
// step with its process alive is waited for up to the bound; the ranks it delays may then be
// taken for lost.
//
// The heartbeats are immediates of the AllToAll's range (kind kRelayAlive, the node-once
// AllToAll's instance, the sending rank of its world); kinds keep them apart from the rail's
// sections, which share the instance.
//
// Thread safety: Heard and Mirror may be called from any thread; created, stopped and destroyed
// by one.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"

namespace ferry::moe {

// How many times the step's wait (its deadline's distance from the receive call) a heard
// sender is waited for past the deadline. A rank waiting at one hop for a lost rank falls
// silent within Liveness::kSilence after the deadline and is masked then; the ranks it kept
// waiting are late by about that much, which one more step's wait covers; the rest is margin
// for a second loss in the same epoch.
inline constexpr int kLateWaits = 3;

class Liveness {
 public:
  static constexpr std::chrono::milliseconds kBeat{20};
  static constexpr std::chrono::milliseconds kSilence{200};

  // Collective over `bootstrap` (config's world): counters for the heartbeats of `watched`
  // (ranks of that world, each of which watches us too), their engines as our peers, then the
  // thread. adopt_counters: a counter an earlier Liveness of this instance made on the engine
  // (AllToAll::Resize) is taken over, what it counted so far not a heartbeat.
  static StatusOr<std::unique_ptr<Liveness>> Create(const AllToAllConfig& config,
                                                    TransferEngine* engine, Bootstrap& bootstrap,
                                                    std::vector<int> watched,
                                                    bool adopt_counters = false);
  ~Liveness();  // stops the thread; waits for its heartbeats (each ends within the transfer
                // timeout) or leaks what they count into
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // Whether `rank` (watched) was heard from within kSilence. A rank not watched: false.
  bool Heard(int rank) const;
  // While one lives, this rank is inside a receive step and its heartbeats go out.
  class Stepping {
   public:
    explicit Stepping(Liveness* l) : l_(l) {
      if (l_) l_->stepping_.fetch_add(1, std::memory_order_acq_rel);
    }
    ~Stepping() {
      if (l_) l_->stepping_.fetch_sub(1, std::memory_order_acq_rel);
    }
    Stepping(const Stepping&) = delete;
    Stepping& operator=(const Stepping&) = delete;

   private:
    Liveness* const l_;
  };
  // At each beat from now on, Heard(ranks[i]) as 1 or 0 into words[i] (plain int32 stores: a
  // GPU kernel reads them from pinned host memory, where no atomic crosses PCIe), until Unmirror
  // or Stop.
  void Mirror(volatile int32_t* words, std::vector<int> ranks);
  // No more stores into `words` once this returns (their owner frees them next).
  void Unmirror(volatile int32_t* words);
  // Ends the thread (the heartbeats and the mirrors); Heard then falls silent. Idempotent.
  void Stop();
  // A readmission (NodeOnceDevice::Readmit): the thread stopped, every rank's engine met again
  // over `group` (a new process's is a new peer; the one it replaced is forgotten), then the
  // thread again. Its collectives are those of Create, which the new processes run.
  Status Rejoin(Bootstrap& group, std::chrono::milliseconds timeout);

 private:
  Liveness(const AllToAllConfig& config, TransferEngine* engine, std::vector<int> watched);
  // Every rank's engine through `group`: each watched rank's as our peer (a new PeerId where
  // its engine is new: the old one forgotten, our heartbeats to it given up); then a barrier.
  Status Meet(Bootstrap& group, std::chrono::milliseconds timeout);
  void Main();
  // One beat: a heartbeat to each watched rank whose last one ended, and what arrived.
  void Beat(std::chrono::steady_clock::time_point now);

  const AllToAllConfig c_;
  TransferEngine* const engine_;
  const std::vector<int> watched_;
  std::vector<int> index_;           // [world] position in watched_, or -1
  std::vector<PeerId> peers_;        // [watched]
  std::vector<uint32_t> imms_;       // [watched] the counter of each one's heartbeats
  std::vector<uint64_t> counts_;     // [watched] what each counter held at the last beat
  // [watched] steady-clock nanoseconds of the last heartbeat seen (the thread writes).
  std::unique_ptr<std::atomic<int64_t>[]> heard_ns_;
  // Our heartbeats' completions, one counter per watched rank (a rank gets a new one only when
  // its last ended); on the heap, leaked if some never end.
  std::vector<std::unique_ptr<TransferCounter>> sent_;
  std::vector<uint64_t> posted_;
  struct Mirrored {
    volatile int32_t* words;
    std::vector<int> ranks;
  };
  Mutex mirrors_mu_;
  std::vector<Mirrored> mirrors_ GUARDED_BY(mirrors_mu_);
  std::atomic<int> stepping_{0};  // Stepping guards alive
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// What one hop of node-once hears (DeviceParams::heard, the CUDA device's Nv::heard): the
// Liveness and, for each rank of the hop's world, that rank in the Liveness's world.
struct Hearing {
  Liveness* liveness = nullptr;
  std::vector<int> ranks;
  bool Heard(int rank) const { return liveness->Heard(ranks[size_t(rank)]); }
};

}  // namespace ferry::moe
