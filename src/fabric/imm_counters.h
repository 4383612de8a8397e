// ImmCounterTable: counts immediates by value, lock-free, with a fixed capacity.
//
// The worker thread increments counts as writes land; any thread creates counters, reads them,
// waits on them, or consumes from them. Counters are never deleted (a slot's key, once set, is
// permanent), which is what makes lookups lock-free: open addressing with linear probing over
// atomic keys. Notification state (target, deadline, callback) belongs to the worker alone.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "ferry/fabric.h"
#include "ferry/status.h"

namespace ferry::fabric {

class ImmCounterTable {
 public:
  struct Slot {
    std::atomic<uint64_t> key{0};  // imm + 1; 0 = empty
    std::atomic<uint64_t> count{0};
    // Worker-owned: the armed notification, if any.
    uint32_t imm = 0;  // set once, before the key is published
    // Immediates imm | w in these bits count w; stored once, right after the key is claimed
    // (counters exist before their immediates can arrive, so no lookup races it).
    std::atomic<uint32_t> weight_mask{0};
    bool armed = false;
    uint64_t target = 0;
    Clock::time_point deadline;
    Completion on_reached;
    // Worker-owned: every arrival's weight summed (Consume does not lower it), and the word
    // MirrorImm keeps it in (null: none).
    uint64_t total = 0;
    uint64_t* mirror = nullptr;
  };

  explicit ImmCounterTable(uint32_t capacity);

  // AlreadyExists if the counter exists; ResourceExhausted past capacity (or past kMaxMasks
  // distinct weight masks); InvalidArgument for a mask that is not contiguous or overlaps imm.
  Status Create(uint32_t imm, uint32_t weight_mask = 0);
  // Null if no counter exists for imm. Lock-free; any thread.
  Slot* Find(uint32_t imm) const;
  // The counter an arriving immediate counts on, and as how many: the exact counter (1), else a
  // weighted one whose mask holds a non-zero weight in imm. Lock-free; any thread.
  Slot* FindWeighted(uint32_t imm, uint64_t* weight) const;

  static constexpr int kMaxMasks = 4;
  // Subtracts n; FailedPrecondition if the count is below n.
  Status Consume(uint32_t imm, uint64_t n);

 private:
  // Adds weight_mask to masks_ unless there; false when kMaxMasks others are.
  bool RegisterMask(uint32_t weight_mask);
  static uint32_t Hash(uint32_t imm) {
    uint32_t h = imm * 0x9E3779B1u;
    return h ^ (h >> 16);
  }
  std::unique_ptr<Slot[]> slots_;
  uint32_t mask_ = 0;
  uint32_t capacity_ = 0;
  std::atomic<uint32_t> size_{0};
  std::atomic<uint32_t> masks_[kMaxMasks] = {};  // distinct weight masks in use; 0 = free
};

}  // namespace ferry::fabric
