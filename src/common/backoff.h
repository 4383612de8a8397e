// Backoff for threads that wait by polling: spin briefly, then yield, then sleep in short steps.
//
// ferry's tests run up to 8 ranks with a worker thread each on 2 cores; a waiter that spins
// forever starves the very thread it waits for. Production pins threads and may spin longer.
#pragma once

#include <sched.h>

#include <chrono>
#include <cstdint>
#include <thread>

namespace ferry {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Backoff {
 public:
  // kYieldForever as `yields`: never sleeps (a thread on a core of its own).
  static constexpr uint32_t kYieldForever = UINT32_MAX;

  explicit Backoff(uint32_t spins = 64, uint32_t yields = 256, uint32_t sleep_us = 50)
      : spins_(spins), yields_(yields), sleep_us_(sleep_us) {}

  // may_sleep false: yields where it would sleep (something is due soon).
  void Pause(bool may_sleep = true) {
    if (round_ < spins_) {
      CpuRelax();
    } else if (yields_ == kYieldForever || round_ - spins_ < yields_ || !may_sleep) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    }
    ++round_;
  }
  void Reset() { round_ = 0; }

 private:
  uint32_t spins_, yields_, sleep_us_;
  uint32_t round_ = 0;
};

}  // namespace ferry
