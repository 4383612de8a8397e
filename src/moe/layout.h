// MoeLayout: where everything lives in an AllToAll's buffers, and the routing arithmetic that
// device and proxy share. Pure functions of the configuration and the exchanged counts.
//
// Buffers of one rank (N ranks, E experts, L = E / N local experts, T = max_tokens_per_rank,
// K = experts_per_token, P = max_private_tokens, C = T * min(K, L) copies one sender can route to
// one receiver; a "slot" is 16 bytes of metadata + one token row + its scales):
//
//   receive region (registered, written by peers)     send region (registered, read by the NIC)
//   counts    [N][E] int32  every sender's routing     counts    [E] int32  our routing
//   private   [N][P] slots  first P from sender s      dispatch  [T * K] slots, grouped by
//   overflow  [N * C] slots the rest, packed in                   receiving rank, (t, k) order
//                           sender-rank order          combine   [N * C] bf16 rows, grouped by
//   combine   [T * K] rows  returned copies, grouped             the rank they return to, in
//                           by expert rank, in our                that rank's send order
//                           send order
//
// A receiver gets at most N * C copies (every sender routes all its copies to it); the overflow
// region holds that worst case, so no routing can overrun it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ferry/moe.h"

namespace ferry::moe {

struct SlotMeta {
  int32_t src_token;
  int32_t k;
  int32_t local_expert;
  int32_t reserved;
};
static_assert(sizeof(SlotMeta) == 16, "slot metadata is 16 bytes on the wire");

inline int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

struct MoeLayout {
  explicit MoeLayout(const AllToAllConfig& c) {
    const int64_t n = c.world_size, e = c.num_experts, t = c.max_tokens_per_rank,
                  k = c.experts_per_token, l = c.local_experts();
    copies_per_pair = t * std::min(k, l);
    slot_bytes = RoundUp(int64_t{sizeof(SlotMeta)} + c.token_bytes() +
                             int64_t{c.scales_per_token()} * 4, 16);
    row_bytes = int64_t{c.hidden} * 2;
    private_off = RoundUp(n * e * 4, 64);
    overflow_off = private_off + n * c.max_private_tokens * slot_bytes;
    combine_off = overflow_off + n * copies_per_pair * slot_bytes;
    recv_bytes = combine_off + t * k * row_bytes;
    send_dispatch_off = RoundUp(e * 4, 64);
    send_combine_off = send_dispatch_off + t * k * slot_bytes;
    send_bytes = send_combine_off + n * copies_per_pair * row_bytes;
  }
  int64_t copies_per_pair, slot_bytes, row_bytes;
  // Receive region.
  int64_t counts_off = 0, private_off, overflow_off, combine_off, recv_bytes;
  // Send region.
  int64_t send_counts_off = 0, send_dispatch_off, send_combine_off, send_bytes;
};

// The routing of one epoch, from every rank's per-expert counts ([N][E], row s = sender s).
class Routing {
 public:
  explicit Routing(const AllToAllConfig& c) : c_(c), counts_(size_t(c.world_size) * c.num_experts) {}

  int32_t* counts() { return counts_.data(); }
  const int32_t* counts() const { return counts_.data(); }

  // Copies sender s routes to rank r.
  int64_t Copies(int s, int r) const {
    const int l = c_.local_experts();
    const int32_t* row = counts_.data() + size_t(s) * c_.num_experts + size_t(r) * l;
    return std::accumulate(row, row + l, int64_t{0});
  }
  // First slot of sender s's overflow in receiver r's overflow region.
  int64_t OverflowStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < s; ++q) start += std::max<int64_t>(0, Copies(q, r) - c_.max_private_tokens);
    return start;
  }
  // First slot of receiver r's copies in sender s's dispatch send area (and first row of r's
  // returned copies in s's combine region: both keep s's send order).
  int64_t SendStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < r; ++q) start += Copies(s, q);
    return start;
  }

 private:
  const AllToAllConfig c_;
  std::vector<int32_t> counts_;
};

}  // namespace ferry::moe
