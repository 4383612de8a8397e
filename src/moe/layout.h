// MoeLayout: where everything lives in an AllToAll's buffers, and the routing arithmetic that
// device and proxy share. Pure functions of the configuration and the exchanged counts.
//
// Buffers of one rank (N ranks, E experts, L = E / N local experts, T = max_tokens_per_rank,
// K = experts_per_token, P = max_private_tokens; S = the most slots one sender can route to one
// receiver: T * min(K, L), or T when a token goes once per rank; R = the most combine rows one
// rank returns to one sender, the same with "once per rank" read as "reduced at the expert
// rank"; a "slot" is the metadata of up to K (local expert, k, weight) entries + one token row +
// its scales):
//
//   receive region (registered, written by peers)    send region (registered, read by the NIC)
//   counts    [N][E + 2N] int32  every sender's       counts    [E + 2N] int32 our routing:
//                       routing (see Routing)                   per expert, slots per rank,
//   private   [N][P] slots  first P from sender s               combine rows per rank
//   overflow  [N * S] slots the rest, packed in       dispatch  [T * K] slots, grouped by
//                           sender-rank order                   receiving rank, token order
//   combine   [T * K] rows  returned rows, grouped    combine   [N * R] bf16 rows, grouped by
//                           by expert rank, in our              the rank they return to, in
//                           send order                          that rank's send order
//
// A receiver gets at most N * S slots (every sender routes everything to it); the overflow
// region holds that worst case, so no routing can overrun it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ferry/moe.h"

namespace ferry::moe {

// A slot starts with its header and K entries (only `entries` of them used).
struct SlotHeader {
  int32_t src_token;
  int32_t entries;
};
struct SlotEntry {
  int32_t local_expert;
  int32_t k;
  float weight;  // the token's combine weight for this expert
};
static_assert(sizeof(SlotHeader) == 8 && sizeof(SlotEntry) == 12, "slot metadata wire layout");

// InvalidArgument when `out` lacks a buffer the configuration's layout fills, or has one it
// does not (a caller mixing up the layouts). Both devices' DispatchRecv start with it.
Status CheckDispatchOutput(const AllToAllConfig& c, const DispatchOutput& out);
// DispatchInput's alternative forms: x_bf16 (quantised as it is sent) against x / scales and
// the dtype -- OK when absent, or present on an fp8 configuration in place of both -- and
// indices64 in place of indices, not beside them.
Status CheckInputForms(const AllToAllConfig& c, const DispatchInput& in);
// InvalidArgument for combine-time weights where the expert ranks summed with the dispatch's
// (combine_reduce_at_expert_rank). Both devices' CombineRecv start with it.
Status CheckCombineOutput(const AllToAllConfig& c, const CombineOutput& out);

inline int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

struct MoeLayout {
  explicit MoeLayout(const AllToAllConfig& c) {
    const int64_t n = c.world_size, e = c.num_experts, t = c.max_tokens_per_rank,
                  k = c.experts_per_token, l = c.local_experts();
    slots_per_pair = c.dispatch_once_per_rank ? t : t * std::min(k, l);
    rows_per_pair = c.combine_reduce_at_expert_rank ? t : t * std::min(k, l);
    meta_bytes = int64_t{sizeof(SlotHeader)} + k * int64_t{sizeof(SlotEntry)};
    slot_bytes = RoundUp(meta_bytes + c.token_bytes() + int64_t{c.scales_per_token()} * 4, 16);
    row_bytes = int64_t{c.hidden} * 2;
    counts_per_rank = e + 2 * n;
    private_off = RoundUp(n * counts_per_rank * 4, 64);
    overflow_off = private_off + n * c.max_private_tokens * slot_bytes;
    combine_off = overflow_off + n * slots_per_pair * slot_bytes;
    recv_bytes = combine_off + t * k * row_bytes;
    send_dispatch_off = RoundUp(counts_per_rank * 4, 64);
    send_combine_off = send_dispatch_off + t * k * slot_bytes;
    send_bytes = send_combine_off + n * rows_per_pair * row_bytes;
  }
  int64_t slots_per_pair, rows_per_pair, meta_bytes, slot_bytes, row_bytes, counts_per_rank;
  // Receive region.
  int64_t counts_off = 0, private_off, overflow_off, combine_off, recv_bytes;
  // Send region.
  int64_t send_counts_off = 0, send_dispatch_off, send_combine_off, send_bytes;
};

// The routing of one epoch, from every rank's counts row ([N][E + 2N], row s = sender s:
// copies per expert, then dispatch slots per receiving rank, then combine rows per rank).
class Routing {
 public:
  explicit Routing(const AllToAllConfig& c)
      : c_(c), width_(c.num_experts + 2 * c.world_size), counts_(size_t(c.world_size) * width_) {}

  int width() const { return width_; }
  int32_t* row(int s) { return counts_.data() + size_t(s) * width_; }
  const int32_t* row(int s) const { return counts_.data() + size_t(s) * width_; }

  // Dispatch slots sender s sends rank r.
  int64_t Slots(int s, int r) const { return row(s)[c_.num_experts + r]; }
  // Combine rows rank r returns to sender s.
  int64_t Rows(int s, int r) const { return row(s)[c_.num_experts + c_.world_size + r]; }
  // First slot of sender s's overflow in receiver r's overflow region.
  int64_t OverflowStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < s; ++q) start += std::max<int64_t>(0, Slots(q, r) - c_.max_private_tokens);
    return start;
  }
  // First slot for receiver r in sender s's dispatch send area.
  int64_t SlotStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < r; ++q) start += Slots(s, q);
    return start;
  }
  // First row from expert rank r in sender s's combine region.
  int64_t RowStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < r; ++q) start += Rows(s, q);
    return start;
  }

 private:
  const AllToAllConfig c_;
  const int width_;
  std::vector<int32_t> counts_;
};

// DataLoss when sender s's counts row, as it arrived, announces a negative number of dispatch
// slots or combine rows for receiver r, or more than one sender can route to one receiver (a
// corrupt or hostile peer). Every offset into the overflow and combine regions is computed from
// these counts, so the proxy checks each peer's row before using it.
Status CheckCountsRow(const AllToAllConfig& c, const MoeLayout& layout, const Routing& routing,
                      int s, int r);

}  // namespace ferry::moe
