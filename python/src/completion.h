// How completions reach Python: the engine's worker (and the KV messenger's threads) never run
// Python. A completion records its status in a Pending that Python waits on with the GIL
// released (ferry.Transfer); events -- received messages, KV requests, released pages -- go
// into a bounded WaitQueue that Python drains.
#pragma once

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "binding.h"

namespace ferry::python {

// One submitted operation's end, shared by its ferry.Transfer and the callback that ends it.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  // Set under mu (so that a waiter on cv cannot miss it) after `status`, with release: a
  // reader that sees it true, with or without the lock, sees the status.
  std::atomic<bool> ended{false};
  Status status;
  // What the engine reads until the end: a paged write's page lists, a scatter's targets.
  std::vector<uint32_t> src_pages, dst_pages;
  std::vector<ScatterTarget> targets;

  void Finish(const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      status = s;
      ended.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
  bool Done() const { return ended.load(std::memory_order_acquire); }
  // A short transfer ends within microseconds, sooner than a sleeping thread wakes: Wait polls
  // first (spinning, then yielding the core), and only then sleeps on the condition variable.
  Status Wait(Deadline deadline) {
    for (int i = 0; i < kSpins + kYields && !ended.load(std::memory_order_acquire); ++i) {
      if (i < kSpins) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        sched_yield();
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_until(lock, deadline.at, [&] { return Done(); })) {
      return DeadlineExceededError("still in flight at the deadline");
    }
    return status;
  }
  static constexpr int kSpins = 2000, kYields = 200;

  // The callback that ends it (fits DoneCallback's inline storage).
  static DoneCallback Callback(std::shared_ptr<Pending> pending) {
    return [pending = std::move(pending)](const Status& s) { pending->Finish(s); };
  }
};

// ferry.Transfer: a submitted transfer (or KV request) as Python holds it.
class Transfer {
 public:
  Transfer(std::shared_ptr<Pending> pending, py::tuple keep)
      : pending_(std::move(pending)), keep_(std::move(keep)) {}
  bool done() const { return pending_->Done(); }
  // Raises the operation's error, or DeadlineExceeded if it has not ended by then (it may
  // still end later).
  void Wait(double timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    Status s;
    {
      py::gil_scoped_release release;
      s = pending_->Wait(deadline);
    }
    ThrowIfError(s);
  }

 private:
  std::shared_ptr<Pending> pending_;
  py::tuple keep_;  // the local regions it reads or that bytes land in
};

// Events for Python to take, pushed from threads that run no Python. Bounded: past `capacity`
// the newest are dropped and counted, and the next Pop reports how many.
template <typename T>
class WaitQueue {
 public:
  WaitQueue(std::string what, size_t capacity) : what_(std::move(what)), capacity_(capacity) {}

  void Push(T item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.size() >= capacity_) {
        ++dropped_;
        return;
      }
      queue_.push_back(std::move(item));
    }
    cv_.notify_one();
  }
  StatusOr<T> Pop(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (dropped_ > 0) {
      const uint64_t n = dropped_;
      dropped_ = 0;
      return ResourceExhaustedError(std::to_string(n) + " " + what_ + " dropped: more than " +
                                    std::to_string(capacity_) + " waited to be taken");
    }
    if (!cv_.wait_until(lock, deadline.at, [&] { return !queue_.empty(); })) {
      return DeadlineExceededError("no " + what_ + " before the deadline");
    }
    T item = std::move(queue_.front());
    queue_.pop_front();
    return item;
  }
  // Pop with the GIL released.
  T PopForPython(double timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    StatusOr<T> item = [&] {
      py::gil_scoped_release release;
      return Pop(deadline);
    }();
    return ValueOrThrow(std::move(item));
  }

 private:
  const std::string what_;
  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> queue_;
  uint64_t dropped_ = 0;
};

}  // namespace ferry::python
