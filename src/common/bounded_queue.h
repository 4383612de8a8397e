// BoundedQueue: a fixed-capacity lock-free multi-producer multi-consumer queue.
//
// The engine's submission path: any thread enqueues, the worker dequeues. We use our own ring
// rather than moodycamel::ConcurrentQueue because the capacity must be a hard bound (a full queue
// is ResourceExhausted to the caller, never a silent allocation) and because the ring allocates
// exactly once, at construction. The algorithm is Dmitry Vyukov's bounded MPMC queue: each cell
// carries a sequence number that tells producers and consumers whose turn it is, so a push or pop
// is one CAS on the shared index plus one release store on the cell.
//
// Thread safety: TryPush and TryPop may be called from any number of threads concurrently.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <new>
#include <utility>

namespace ferry {

inline constexpr size_t kCacheLine = 64;

template <typename T>
class BoundedQueue {
 public:
  // `capacity` is rounded up to a power of two (at least 2).
  explicit BoundedQueue(size_t capacity) {
    size_t n = 2;
    while (n < capacity) n <<= 1;
    mask_ = n - 1;
    cells_ = std::make_unique<Cell[]>(n);
    for (size_t i = 0; i < n; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }

  size_t capacity() const { return mask_ + 1; }

  // Returns false (and leaves `value` untouched) when the queue is full.
  bool TryPush(T&& value) {
    size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      size_t seq = cell.sequence.load(std::memory_order_acquire);
      intptr_t diff = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          cell.value = std::move(value);
          cell.sequence.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // Returns false when the queue is empty.
  bool TryPop(T& out) {
    size_t pos = head_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      size_t seq = cell.sequence.load(std::memory_order_acquire);
      intptr_t diff = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos + 1);
      if (diff == 0) {
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          out = std::move(cell.value);
          cell.sequence.store(pos + mask_ + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = head_.load(std::memory_order_relaxed);
      }
    }
  }

  // A hint only: concurrent pushes and pops may change it at once.
  bool ApproxEmpty() const {
    return head_.load(std::memory_order_relaxed) == tail_.load(std::memory_order_relaxed);
  }

 private:
  struct Cell {
    std::atomic<size_t> sequence;
    T value;
  };
  std::unique_ptr<Cell[]> cells_;
  size_t mask_ = 0;
  alignas(kCacheLine) std::atomic<size_t> tail_{0};
  alignas(kCacheLine) std::atomic<size_t> head_{0};
};

}  // namespace ferry
