// The 32-bit immediate space that the users of one TransferEngine share.
//
// An immediate names a counter on the receiving engine (TransferEngine::CreateImmCounter), so
// two users of one engine -- a KV messenger, AllToAlls, the caller's own protocol -- must never
// send the same value. ferry's parts take the top quarter of the space; everything below it is
// the caller's, and ferry never sends a value there:
//
//   0x00000000 .. 0xBFFFFFFF   the caller's own (its writes, barriers and immediates)
//   0xC0000000 .. 0xDFFFFFFF   the KV messenger: request slot in bits 0..19, the pages a
//                              weighted immediate stands for in bits 20..28
//   0xE0000000 .. 0xEFFFFFFF   the AllToAlls: epoch bits 0..1, kind 4..7, sending rank 8..23
//                              (the relay's), instance 24..27
//   0xF0000000 .. 0xFFFFFFFF   not used
//
// The static_asserts below keep every field inside its range and the ranges apart.
#pragma once

#include <cstdint>

namespace ferry::imm {

struct Range {
  uint32_t first;
  uint32_t last;  // inclusive
  constexpr bool Holds(uint32_t v) const { return first <= v && v <= last; }
};
constexpr bool Disjoint(Range a, Range b) { return a.last < b.first || b.last < a.first; }

inline constexpr Range kCaller{0x00000000u, 0xBFFFFFFFu};
inline constexpr Range kKv{0xC0000000u, 0xDFFFFFFFu};
inline constexpr Range kMoe{0xE0000000u, 0xEFFFFFFFu};

static_assert(Disjoint(kCaller, kKv) && Disjoint(kCaller, kMoe) && Disjoint(kKv, kMoe));
static_assert(kCaller.last + 1 == kKv.first && kKv.last + 1 == kMoe.first);

// KV: slot i of a decoder counts kv::kImmBase + i; a paged write's one immediate per NIC also
// carries its page count in kKvWeightMask (a weighted counter, CreateWeightedImmCounter).
inline constexpr uint32_t kKvSlotBits = 20;
inline constexpr uint32_t kKvMaxSlots = 1u << kKvSlotBits;
inline constexpr uint32_t kKvWeightMask = 0x1FF00000u;
static_assert((kKvWeightMask & (kKvMaxSlots - 1)) == 0, "slot and weight bits overlap");
static_assert(kKv.Holds(kKv.first | kKvWeightMask | (kKvMaxSlots - 1)),
              "a weighted KV immediate leaves the KV range");
// Bit 29 is clear in every KV immediate and set in every AllToAll's: neither can read as the
// other, also to a weighted counter that claims every immediate of its form.
static_assert((kKv.first & 0x20000000u) == 0 && (kKvWeightMask & 0x20000000u) == 0 &&
              (kMoe.first & 0x20000000u) != 0);

// AllToAll: the fields of moe::MoeImm / moe::RelayImm.
inline constexpr uint32_t kMoeEpochBits = 2;
inline constexpr uint32_t kMoeKindShift = 4, kMoeKindBits = 4;
inline constexpr uint32_t kMoeSenderShift = 8, kMoeSenderBits = 16;
inline constexpr uint32_t kMoeInstanceShift = 24, kMoeInstanceBits = 4;
static_assert(kMoeEpochBits <= kMoeKindShift && kMoeKindShift + kMoeKindBits <= kMoeSenderShift &&
                  kMoeSenderShift + kMoeSenderBits <= kMoeInstanceShift,
              "AllToAll immediate fields overlap");
static_assert(kMoe.Holds(kMoe.first | ((1u << (kMoeInstanceShift + kMoeInstanceBits)) - 1)),
              "an AllToAll immediate leaves the AllToAll range");

}  // namespace ferry::imm
