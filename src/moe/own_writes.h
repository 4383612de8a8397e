// OwnWrites: the writes the relay posted and must see end before it reuses or frees what they
// read. Their counter lives on the heap so that, when some never end (a
// wedged provider), Drain leaks it together with what they read instead of freeing it under
// the engine's worker, which still counts into it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/leak.h"
#include "ferry/fabric.h"

namespace ferry::moe {

class OwnWrites {
 public:
  // submit(completion) posts one transfer; it counts only when the engine took it (a refused
  // submit posted nothing and never completes).
  template <typename Submit>
  Status Post(Submit&& submit) {
    Status s = submit(Completion::Counter(counter_.get()));
    if (s.ok()) ++posted_;
    return s;
  }
  // Every posted write ended: Unavailable if one ever failed, DeadlineExceeded past deadline.
  Status Wait(Deadline deadline) const {
    RETURN_IF_ERROR(counter_->Wait(posted_, deadline));
    const uint64_t failed = counter_->failed.load();
    if (failed > 0) return UnavailableError(std::to_string(failed) + " writes to peers failed");
    return Status::Ok();
  }
  // Every posted write ended, failed or not; DeadlineExceeded past deadline.
  Status WaitEnded(Deadline deadline) const { return counter_->Wait(posted_, deadline); }
  // Before the owner goes: true once every posted write ended, failed or not. False if some did
  // not within timeout (the engine fails each within its transfer timeout, so this is rare):
  // the counter is then leaked, and the owner must leak what the writes read. False again on
  // every later call.
  bool Drain(std::chrono::milliseconds timeout) {
    if (!counter_) return false;
    if (counter_->Wait(posted_, Deadline::After(timeout)).ok()) return true;
    LeakOnPurpose(counter_.release());
    return false;
  }

 private:
  std::unique_ptr<TransferCounter> counter_ = std::make_unique<TransferCounter>();
  uint64_t posted_ = 0;
};

}  // namespace ferry::moe
