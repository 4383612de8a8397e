// What one rank's dispatch and combine put in another's memory, byte for byte: the counts row and
// the slot format. Both devices write and read exactly these (the CUDA kernels and the host
// device alike), so the host device runs, on CPUs, the protocol the GPUs run between nodes
// (moe/relay.h), and checks a received slot with the same predicates as the kernels.
//
// A counts row (int32, `CountsWidth` of them, padded to 16 bytes): the copies the sender routes
// to each of the receiver's local experts, then the CountsColumn values.
//
// A slot: a SlotHeader and K SlotEntry (`entries` of them used), padding to a 128-byte line
// (`meta_bytes`), the token's row (token_bytes), its fp32 scales, padding to the next line.
// Slot j of a sender for a receiver is its j-th in token order; without option (a) a token that
// goes to several experts of one rank takes one slot per expert (its "parts"), each with one
// entry.
//
// Combine rows: the receiver of a sender's slots returns its rows in the order the sender
// numbered them (SlotHeader::row), one per entry, or one per token where the expert rank sums
// (option (b)). A sender numbers the rows it expects from rank r from kColRowStart on, rank by
// rank, so every rank's rows have a disjoint place in the sender's combine region.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ferry/moe.h"

#if defined(__CUDACC__)
#define FERRY_HD __host__ __device__
#else
#define FERRY_HD
#endif

namespace ferry::moe {

inline int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// The counts row's columns after the local experts' copies.
enum CountsColumn : int {
  kColSlots = 0,      // slots for the receiver
  kColSendStart = 1,  // where they start in the sender's send area (pulled over NVLink)
  kColRowStart = 2,   // where the receiver's combine rows start in the sender's combine region
  kColRows = 3,       // how many combine rows the sender expects back from the receiver
  kCountsColumns = 4,
};
inline int CountsWidth(const AllToAllConfig& c) { return c.local_experts() + kCountsColumns; }

struct SlotHeader {
  int32_t src_token;
  int32_t entries;
  int32_t row;    // the combine row of the first entry (plain) or of the token (summed)
  int16_t part;   // which of the token's slots for this rank (one entry per slot), of
  int16_t parts;  // how many
};
struct SlotEntry {
  int32_t local_expert;
  int32_t k;
  float weight;  // the token's combine weight for this expert
  int32_t pos;   // among the sender's copies for this expert, in (token, k) order
};
static_assert(sizeof(SlotHeader) == 16 && sizeof(SlotEntry) == 16, "slot metadata layout");

// Where a slot's parts lie. The row starts on a 128-byte line, and so does every slot: a warp's
// 512 contiguous bytes then fill four lines, not five of which two in part (`ferry-bench p2p`:
// SM stores into a peer 6-7 % faster so, loads 2-3 %); the rest of the metadata's line is
// padding nobody writes or reads. `tagged`: the CUDA device inside one node streams its
// dispatch, and a 64-bit tag follows the entries (within the metadata's line).
struct SlotFormat {
  SlotFormat(const AllToAllConfig& c, bool tagged)
      : meta_used(int64_t{sizeof(SlotHeader)} + int64_t{c.experts_per_token} * sizeof(SlotEntry)),
        meta_bytes(RoundUp(meta_used + (tagged ? 8 : 0), 128)),
        slot_bytes(RoundUp(meta_bytes + c.token_bytes() + int64_t{c.scales_per_token()} * 4, 128)) {
  }
  int64_t meta_used;   // header and entries
  int64_t meta_bytes;  // where the row starts: the metadata rounded up to a 128-byte line
  int64_t slot_bytes;  // the row starts on a line, and so does every slot
};

// The most one sender routes to one receiver: slots (S) and combine rows it expects back (R).
struct PairLimits {
  explicit PairLimits(const AllToAllConfig& c) {
    const int64_t t = c.max_tokens_per_rank,
                  per_rank = std::min(c.experts_per_token, c.local_experts());
    slots_per_pair = c.dispatch_once_per_rank ? t : t * per_rank;
    rows_per_pair = c.combine_reduce_at_expert_rank ? t : t * per_rank;
  }
  int64_t slots_per_pair, rows_per_pair;
};

// A received slot's metadata is checked before anything is taken from it, so that a corrupt or
// hostile sender cannot make the receiver write outside its output. The header: entries in
// [1, K], a source token below the most a rank sends, a part among its parts, and its combine
// rows -- from `row`, the header's row rebased to the first one the sender expects from us --
// within the `row_cap` it expects. Each entry: local expert and k in range, its position among
// sender s's copies for that expert, and that expert's rows from senders up to s within
// capacity; `offset` is the receiver's table, offset[s * L + e] the rows of local expert e from
// senders before s, built from the senders' counts rows as they arrived -- so it is held to be
// non-negative too (an earlier sender announcing a negative count would place s's rows before
// the expert's block).
struct SlotLimits {
  int k, l, t_max;
  bool reduce;  // one combine row per token (summed at the expert rank), else one per entry
  int64_t row_cap, capacity;
};
FERRY_HD inline bool SlotHeaderValid(const SlotHeader& h, int64_t row, const SlotLimits& lim) {
  return h.entries >= 1 && h.entries <= lim.k && h.src_token >= 0 && h.src_token < lim.t_max &&
         row >= 0 && h.parts >= 1 && h.part >= 0 && h.part < h.parts &&
         row + (lim.reduce ? 1 : h.entries) <= lim.row_cap;
}
FERRY_HD inline bool SlotEntryValid(const SlotEntry& e, const int32_t* offset, int s,
                                    const SlotLimits& lim) {
  const int32_t le = e.local_expert;
  return le >= 0 && le < lim.l && e.k >= 0 && e.k < lim.k && e.pos >= 0 &&
         offset[s * lim.l + le] >= 0 &&
         e.pos < offset[(s + 1) * lim.l + le] - offset[s * lim.l + le] &&
         offset[(s + 1) * lim.l + le] <= lim.capacity;
}

// DispatchOutput::sender_ranges' entry for sender s and local expert e, from the offsets
// (offset[s][e]: rows of e from the senders before s): (first row << 32) | rows.
FERRY_HD inline int64_t SenderRange(const int32_t* offset, int l, int s, int e) {
  const int32_t first = offset[s * l + e], rows = offset[(s + 1) * l + e] - first;
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(first)) << 32) |
                              static_cast<uint32_t>(rows));
}

}  // namespace ferry::moe
