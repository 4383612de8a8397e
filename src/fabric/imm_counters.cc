#include "fabric/imm_counters.h"

#include <string>

namespace ferry::fabric {

ImmCounterTable::ImmCounterTable(uint32_t capacity) : capacity_(capacity) {
  uint32_t n = 16;
  while (n < 2 * capacity) n <<= 1;  // load factor <= 1/2 keeps probes short
  mask_ = n - 1;
  slots_ = std::make_unique<Slot[]>(n);
}

Status ImmCounterTable::Create(uint32_t imm, uint32_t weight_mask) {
  if (weight_mask != 0 && (!IsWeightMask(weight_mask) || (imm & weight_mask) != 0)) {
    return InvalidArgumentError("immediate counter " + std::to_string(imm) + ": weight mask " +
                                std::to_string(weight_mask) +
                                " must be contiguous bits that the immediate does not use");
  }
  if (size_.fetch_add(1, std::memory_order_relaxed) >= capacity_) {
    size_.fetch_sub(1, std::memory_order_relaxed);
    return ResourceExhaustedError("immediate counter table is full (" +
                                  std::to_string(capacity_) + " counters)");
  }
  if (weight_mask != 0 && !RegisterMask(weight_mask)) {
    size_.fetch_sub(1, std::memory_order_relaxed);
    return ResourceExhaustedError("immediate counters: more than " + std::to_string(kMaxMasks) +
                                  " distinct weight masks");
  }
  const uint64_t want = uint64_t{imm} + 1;
  for (uint32_t i = Hash(imm);; ++i) {
    Slot& slot = slots_[i & mask_];
    uint64_t key = slot.key.load(std::memory_order_acquire);
    if (key == 0 && slot.key.compare_exchange_strong(key, want, std::memory_order_acq_rel)) {
      slot.imm = imm;  // readers find the slot by key and compare keys, never read imm before
      slot.weight_mask.store(weight_mask, std::memory_order_release);
      return Status::Ok();
    }
    if (key == want) {
      size_.fetch_sub(1, std::memory_order_relaxed);
      return AlreadyExistsError("immediate counter " + std::to_string(imm) + " exists");
    }
  }
}

ImmCounterTable::Slot* ImmCounterTable::Find(uint32_t imm) const {
  const uint64_t want = uint64_t{imm} + 1;
  for (uint32_t i = Hash(imm), probes = 0; probes <= mask_; ++i, ++probes) {
    Slot& slot = slots_[i & mask_];
    uint64_t key = slot.key.load(std::memory_order_acquire);
    if (key == want) return &slot;
    if (key == 0) return nullptr;
  }
  return nullptr;
}

bool ImmCounterTable::RegisterMask(uint32_t weight_mask) {
  for (auto& m : masks_) {  // filled in order, so lookups stop at the first free entry
    uint32_t cur = m.load(std::memory_order_acquire);
    if (cur == 0 && m.compare_exchange_strong(cur, weight_mask, std::memory_order_acq_rel)) {
      return true;
    }
    if (cur == weight_mask) return true;
  }
  return false;
}

ImmCounterTable::Slot* ImmCounterTable::FindWeighted(uint32_t imm, uint64_t* weight) const {
  if (Slot* exact = Find(imm)) {
    *weight = 1;
    return exact;
  }
  for (const auto& m : masks_) {
    const uint32_t mask = m.load(std::memory_order_acquire);
    if (mask == 0) break;
    const uint32_t w = (imm & mask) >> __builtin_ctz(mask);
    if (w == 0) continue;
    Slot* slot = Find(imm & ~mask);
    if (slot && slot->weight_mask.load(std::memory_order_acquire) == mask) {
      *weight = w;
      return slot;
    }
  }
  return nullptr;
}

Status ImmCounterTable::Consume(uint32_t imm, uint64_t n) {
  Slot* slot = Find(imm);
  if (!slot) return NotFoundError("no immediate counter " + std::to_string(imm));
  uint64_t cur = slot->count.load(std::memory_order_acquire);
  do {
    if (cur < n) {
      return FailedPreconditionError("immediate counter " + std::to_string(imm) + " holds " +
                                     std::to_string(cur) + ", cannot consume " +
                                     std::to_string(n));
    }
  } while (!slot->count.compare_exchange_weak(cur, cur - n, std::memory_order_acq_rel));
  return Status::Ok();
}

}  // namespace ferry::fabric
