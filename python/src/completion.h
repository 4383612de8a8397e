// How completions reach Python: the engine's worker (and the KV messenger's threads) never run
// Python. A completion records its status in a Pending that Python waits on with the GIL
// released (ferry.Transfer) or that hands it to ferry's callback thread, which runs the
// transfer's done callbacks with the GIL (Transfer.add_done_callback, and through it `await`);
// events -- received messages, KV requests, released pages -- go into a bounded WaitQueue that
// Python drains: waiting (with the GIL released), polling, or awaiting a Transfer that ends when
// something is there.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "binding.h"

namespace ferry::python {

struct Pending;

// ferry's callback thread (one per process, started when the first transfer with callbacks
// ends; a forked child starts its own): runs ended transfers' done callbacks with the GIL, in
// the order they ended, so that neither the engine's worker nor the KV messenger's threads ever
// wait for Python. Lock order: the GIL, then a Pending's mu (nothing waits for the GIL while
// holding mu).
class CallbackThread {
 public:
  // The thread of this process (it is never destroyed: at exit it may still wait for work).
  static CallbackThread& Get();
  void Push(std::shared_ptr<Pending> pending);

 private:
  CallbackThread();
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> ended_;
};

// One submitted operation's end, shared by its ferry.Transfer and the callback that ends it.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  // Set under mu (so that a waiter on cv cannot miss it) after `status`, with release: a
  // reader that sees it true, with or without the lock, sees the status.
  std::atomic<bool> ended{false};
  Status status;
  // When it ended, on the system clock (time.time()'s), set with `status`: the moment itself,
  // which a Python callback (it waits for the GIL) would see only later.
  double ended_at = 0;
  // What the engine reads until the end: a paged write's page lists, a scatter's targets.
  std::vector<uint32_t> src_pages, dst_pages;
  std::vector<ScatterTarget> targets;
  // Done callbacks added while in flight, each with the ferry.Transfer it is called with: Python
  // objects, touched only with the GIL (and, where `ended` may change meanwhile, under mu).
  std::vector<std::pair<py::object, py::object>> callbacks;

  ~Pending();

  static void Finish(const std::shared_ptr<Pending>& p, const Status& s) {
    bool hand_over = false;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->status = s;
      p->ended_at = std::chrono::duration<double>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
      p->ended.store(true, std::memory_order_release);
      hand_over = !p->callbacks.empty();  // reads the vector's size only: no Python touched
    }
    p->cv.notify_all();
    if (hand_over) CallbackThread::Get().Push(p);
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
    return [pending = std::move(pending)](const Status& s) { Pending::Finish(pending, s); };
  }
};

// ferry.Transfer: a submitted transfer (or KV request) as Python holds it.
class Transfer {
 public:
  Transfer(std::shared_ptr<Pending> pending, py::tuple keep)
      : pending_(std::move(pending)), keep_(std::move(keep)) {}
  bool done() const { return pending_->Done(); }
  std::optional<double> ended_at() const {
    if (!pending_->Done()) return std::nullopt;
    return pending_->ended_at;
  }
  // The ferry.Error it ended with (not raised); None while in flight or after success.
  py::object Error() const {
    return pending_->Done() ? ErrorObject(pending_->status) : py::object(py::none());
  }
  // fn(transfer) once it has ended: at once on this thread if it has, else on ferry's callback
  // thread (with the GIL). An exception fn raises is reported (sys.unraisablehook) and ignored.
  static void AddDoneCallback(const py::object& self, py::function fn);
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
    std::shared_ptr<Pending> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.size() >= capacity_) {
        ++dropped_;
      } else {
        queue_.push_back(std::move(item));
      }
      ready = std::move(ready_);
    }
    cv_.notify_one();
    if (ready) Pending::Finish(ready, Status::Ok());
  }
  // What a ferry.Transfer of "something to take" waits on: it ends OK once something is queued
  // (at once if something is, or a drop waits to be reported), or with Close's status once the
  // queue is closed and empty. Then take what is queued without waiting (PopAll). The waiters
  // of one moment share one Pending.
  std::shared_ptr<Pending> Ready() {
    Status ended = Status::Ok();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty() && dropped_ == 0) {
        if (closed_.ok()) {
          if (!ready_) ready_ = std::make_shared<Pending>();
          return ready_;
        }
        ended = closed_;
      }
    }
    auto p = std::make_shared<Pending>();
    Pending::Finish(p, ended);
    return p;
  }
  // No more items will come (`why`: the engine or role closed): ends the waiting Ready(), and
  // every later one once the queue is empty, with `why`.
  void Close(Status why) {
    std::shared_ptr<Pending> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = why;
      ready = std::move(ready_);
    }
    if (ready) Pending::Finish(ready, why);
  }
  StatusOr<T> Pop(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (dropped_ > 0) return DroppedError();
    if (!cv_.wait_until(lock, deadline.at, [&] { return !queue_.empty(); })) {
      return DeadlineExceededError("no " + what_ + " before the deadline");
    }
    T item = std::move(queue_.front());
    queue_.pop_front();
    return item;
  }
  // Everything queued now, without waiting (empty if nothing is): for a scheduler that polls
  // once per step. Drops are reported first, as Pop does.
  StatusOr<std::vector<T>> PopAll() {
    std::lock_guard<std::mutex> lock(mu_);
    if (dropped_ > 0) return DroppedError();
    std::vector<T> items(std::make_move_iterator(queue_.begin()),
                         std::make_move_iterator(queue_.end()));
    queue_.clear();
    return items;
  }
  // PopAll as a Python list, each item through to_python.
  template <typename ToPython>
  py::list PopAllForPython(ToPython to_python) {
    py::list out;
    for (const T& item : ValueOrThrow(PopAll())) out.append(to_python(item));
    return out;
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
  // ResourceExhausted saying how many were dropped since the last report (resets the count).
  Status DroppedError() {
    const uint64_t n = dropped_;
    dropped_ = 0;
    return ResourceExhaustedError(std::to_string(n) + " " + what_ + " dropped: more than " +
                                  std::to_string(capacity_) + " waited to be taken");
  }

  const std::string what_;
  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> queue_;
  uint64_t dropped_ = 0;
  std::shared_ptr<Pending> ready_;  // what Ready() handed out since the last Push
  Status closed_;                   // not OK once closed
};

}  // namespace ferry::python
