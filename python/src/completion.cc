// ferry's callback thread and what goes through it (completion.h).
#include "completion.h"

#include <thread>

namespace ferry::python {
namespace {

// A done callback, with the GIL: an exception it raises is reported (sys.unraisablehook) and
// ignored, as concurrent.futures does.
void CallDone(const py::object& fn, const py::object& transfer) {
  try {
    fn(transfer);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable(fn);
  }
}

}  // namespace

CallbackThread& CallbackThread::Get() {
  // One per process: a forked child starts its own (its parent's, copied without its thread,
  // is left as it was -- its lock perhaps held at the fork -- and never touched again).
  struct Owned {
    pid_t owner;
    CallbackThread* thread;
  };
  static std::atomic<Owned*> current{nullptr};
  static std::mutex mu;  // held only while one is made
  const pid_t me = getpid();
  Owned* o = current.load(std::memory_order_acquire);
  if (o && o->owner == me) return *o->thread;
  std::lock_guard<std::mutex> lock(mu);
  o = current.load(std::memory_order_acquire);
  if (!o || o->owner != me) {
    o = new Owned{me, new CallbackThread()};  // never destroyed: see the header
    current.store(o, std::memory_order_release);
  }
  return *o->thread;
}

CallbackThread::CallbackThread() {
  std::thread([this] { Run(); }).detach();
}

void CallbackThread::Push(std::shared_ptr<Pending> pending) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_.push_back(std::move(pending));
  }
  cv_.notify_one();
}

void CallbackThread::Run() {
  for (;;) {
    std::shared_ptr<Pending> pending;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !ended_.empty(); });
      pending = std::move(ended_.front());
      ended_.pop_front();
    }
    py::gil_scoped_acquire gil;
    std::vector<std::pair<py::object, py::object>> callbacks;
    {
      std::lock_guard<std::mutex> lock(pending->mu);
      callbacks.swap(pending->callbacks);
    }
    for (const auto& [fn, transfer] : callbacks) CallDone(fn, transfer);
    callbacks.clear();  // with the GIL
    pending.reset();
  }
}

Pending::~Pending() {
  // Callbacks of a transfer that never ended (its engine gone without ending it): the Python
  // objects go with the GIL, unless the interpreter is gone (then they are left).
  if (callbacks.empty()) return;
  if (!Py_IsInitialized()) {
    new std::vector<std::pair<py::object, py::object>>(std::move(callbacks));  // left
    return;
  }
  py::gil_scoped_acquire gil;
  callbacks.clear();
}

void Transfer::AddDoneCallback(const py::object& self, py::function fn) {
  Transfer& t = py::cast<Transfer&>(self);
  {
    std::lock_guard<std::mutex> lock(t.pending_->mu);
    if (!t.pending_->Done()) {
      t.pending_->callbacks.emplace_back(std::move(fn), self);
      return;
    }
  }
  CallDone(fn, self);  // ended already: here and now, as concurrent.futures does
}

}  // namespace ferry::python
