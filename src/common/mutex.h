// Mutex and MutexLock: std::mutex and its scoped lock, annotated for clang's thread-safety
// analysis (-Wthread-safety), so that a field marked GUARDED_BY(mu) read or written without mu
// held is a compile error where clang builds (the thread_safety test), and the lock each field
// needs is written beside it. Under other compilers the annotations are nothing.
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define FERRY_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define FERRY_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) FERRY_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY FERRY_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) FERRY_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) FERRY_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) FERRY_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) FERRY_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) FERRY_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) FERRY_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS FERRY_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace ferry {

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// Holds `mu` for its scope; Unlock() lets go early (a scope that goes on without it).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_.unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() {
    held_ = false;
    mu_.unlock();
  }

  // What a condition variable waits with (CondVar): the mutex, let go and taken again inside
  // the wait, which the analysis does not see.
  void lock() NO_THREAD_SAFETY_ANALYSIS { mu_.lock(); }
  void unlock() NO_THREAD_SAFETY_ANALYSIS { mu_.unlock(); }

 private:
  Mutex& mu_;
  bool held_ = true;
};

// A condition variable over Mutex (waits take the MutexLock that holds it).
using CondVar = std::condition_variable_any;

}  // namespace ferry
