// Channel: the flags between one rank's host device (the four steps) and its proxy thread (the
// network state machine).
//
// Each flag holds "epoch + 1" once its event happened for that epoch, so a flag is never reset
// and a waiter compares with the epoch it needs. Writers store with release after the data the
// flag announces is in place; readers load with acquire before touching that data. (The CUDA
// device's flags follow the same rule in GPU-visible memory: moe/relay.h.)
#pragma once

#include <atomic>
#include <cstdint>

#include "common/mutex.h"
#include "ferry/status.h"

namespace ferry::moe {

struct Channel {
  // device -> proxy
  std::atomic<uint64_t> route_ready{0};       // our counts are in the send region
  std::atomic<uint64_t> send_ready{0};        // our dispatch slots are packed
  std::atomic<uint64_t> recv_consumed{0};     // dispatch output unpacked: receive buffers free
  std::atomic<uint64_t> combine_ready{0};     // our combine rows are packed
  std::atomic<uint64_t> combine_consumed{0};  // combine rows read: combine region free
  // proxy -> device
  std::atomic<uint64_t> recv_ready{0};    // all dispatch data landed, routing published, our
                                          // dispatch writes complete (send area free)
  std::atomic<uint64_t> combine_done{0};  // all combine rows landed, our combine writes complete

  // A proxy failure, or malformed data the device found (a peer's slot): the state machine
  // stops; every later step returns this.
  std::atomic<bool> failed{false};
  Mutex error_mu;
  Status error GUARDED_BY(error_mu);

  void Fail(const Status& s) {
    {
      MutexLock lock(error_mu);
      if (error.ok()) error = s;
    }
    failed.store(true, std::memory_order_release);
  }
  Status Error() {
    MutexLock lock(error_mu);
    return error;
  }
};

}  // namespace ferry::moe
