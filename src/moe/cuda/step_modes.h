// The modes the CUDA device's kernels run a step with: one typed value, decided once from the
// configuration the ranks agree on (StepModes::Of) and checked there against the rules that say
// which combinations exist (kModeRules; step_modes_test walks every combination). The kernels
// read it as Nv::modes; the buffer's layout (nvlink_layout.h) follows from it. No CUDA here.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/moe.h"
#include "ferry/status.h"
#include "moe/numerics.h"

namespace ferry::moe {

// Where a token's copies for one rank go: one slot per (token, expert), or one per (token, rank)
// carrying the rank's expert list (AllToAllConfig::dispatch_once_per_rank).
enum class Routing : uint8_t { kPerCopy, kOncePerRank };
// Where a token's expert outputs are summed: at the token's rank, or at the expert rank before
// one row a (token, rank) returns (AllToAllConfig::combine_reduce_at_expert_rank).
enum class Reduction : uint8_t { kAtSender, kAtExpertRank };
// The received rows: grouped by local expert, or one row per received slot (DispatchLayout).
enum class RowOrder : uint8_t { kExpertMajor, kTokenMajor };
// Which peers a step reaches: NVLink only, or some through the relay (another node).
enum class Reach : uint8_t { kOneNode, kRelay };
// How a receiver learns that bytes are in place: from the senders' flags after all of them, or
// from a tag each piece carries ("epoch + 1"), piece by piece.
enum class Readiness : uint8_t { kFlags, kTags };
// A peer that misses a receive deadline: the step fails, or the peer is masked and the step
// goes on without it (AllToAllConfig::mask_lost_peers).
enum class PeerLoss : uint8_t { kFail, kMask };

struct StepModes {
  Routing routing = Routing::kPerCopy;
  Reduction reduction = Reduction::kAtSender;
  RowOrder order = RowOrder::kExpertMajor;
  Reach reach = Reach::kOneNode;
  Readiness counts = Readiness::kFlags;    // the counts rows
  Readiness dispatch = Readiness::kFlags;  // the slots (kTags: the streamed dispatch)
  Readiness combine = Readiness::kFlags;   // the returned rows (kTags: the streamed combine)
  PeerLoss loss = PeerLoss::kFail;

  // The modes for configuration `c`; `small_batches`: one kernel sends every batch (SendSmall),
  // where Streaming::kAuto streams the dispatch. Tags only where every peer is on NVLink; under
  // mask_lost_peers none, as a step's masks are decided once for the whole kernel (WaitStep)
  // while tags are waited for per block and per slot.
  static StepModes Of(const AllToAllConfig& c, bool small_batches) {
    StepModes m;
    m.routing = c.dispatch_once_per_rank ? Routing::kOncePerRank : Routing::kPerCopy;
    m.reduction = c.combine_reduce_at_expert_rank ? Reduction::kAtExpertRank
                                                  : Reduction::kAtSender;
    m.order = c.dispatch_layout == DispatchLayout::kTokenMajor ? RowOrder::kTokenMajor
                                                               : RowOrder::kExpertMajor;
    m.reach = c.ranks_per_node == c.world_size ? Reach::kOneNode : Reach::kRelay;
    m.loss = c.mask_lost_peers ? PeerLoss::kMask : PeerLoss::kFail;
    if (m.reach == Reach::kOneNode && m.loss == PeerLoss::kFail) {
      const bool dispatch = c.streaming == Streaming::kAuto
                                ? small_batches
                                : c.streaming == Streaming::kDispatch ||
                                      c.streaming == Streaming::kBoth;
      const bool combine = c.streaming == Streaming::kCombine || c.streaming == Streaming::kBoth;
      m.counts = Readiness::kTags;
      m.dispatch = dispatch ? Readiness::kTags : Readiness::kFlags;
      m.combine = combine ? Readiness::kTags : Readiness::kFlags;
    }
    return m;
  }

  // The first rule `*this` breaks, as InvalidArgument naming it; OK for a supported combination.
  Status Check() const;

  FERRY_HOST_DEVICE bool once() const { return routing == Routing::kOncePerRank; }
  FERRY_HOST_DEVICE bool reduce() const { return reduction == Reduction::kAtExpertRank; }
  FERRY_HOST_DEVICE bool token_major() const { return order == RowOrder::kTokenMajor; }
  FERRY_HOST_DEVICE bool counts_tagged() const { return counts == Readiness::kTags; }
  FERRY_HOST_DEVICE bool stream() const { return dispatch == Readiness::kTags; }
  FERRY_HOST_DEVICE bool stream_combine() const { return combine == Readiness::kTags; }
  FERRY_HOST_DEVICE bool mask_lost() const { return loss == PeerLoss::kMask; }

  std::string ToString() const;
};

// A rule of the supported combinations: `broken` says whether modes break it.
struct ModeRule {
  const char* rule;
  bool (*broken)(const StepModes&);
};

// The combinations the kernels implement are those that break none of these.
inline constexpr ModeRule kModeRules[] = {
    {"the token-major order needs routing once per rank and the reduction at the expert rank",
     [](const StepModes& m) { return m.token_major() && !(m.once() && m.reduce()); }},
    {"tags (counts rows, streamed slots or rows) need every peer on NVLink: the relay carries "
     "sections whole and raises flags",
     [](const StepModes& m) {
       return m.reach == Reach::kRelay &&
              (m.counts_tagged() || m.stream() || m.stream_combine());
     }},
    {"masking lost peers waits on flags only: a step's masks are decided once for the kernel, "
     "tags are waited for per block and per slot",
     [](const StepModes& m) {
       return m.mask_lost() && (m.counts_tagged() || m.stream() || m.stream_combine());
     }},
    {"streamed slots or rows need tagged counts rows (the receiver reads the rows as they come)",
     [](const StepModes& m) { return (m.stream() || m.stream_combine()) && !m.counts_tagged(); }},
};

inline Status StepModes::Check() const {
  for (const ModeRule& r : kModeRules) {
    if (r.broken(*this)) {
      return InvalidArgumentError("CUDA device modes " + ToString() + ": " + r.rule);
    }
  }
  return Status::Ok();
}

inline std::string StepModes::ToString() const {
  auto readiness = [](Readiness r) { return r == Readiness::kTags ? "tags" : "flags"; };
  return std::string("{routing ") + (once() ? "once per rank" : "per copy") + ", reduction " +
         (reduce() ? "at expert rank" : "at sender") + ", order " +
         (token_major() ? "token-major" : "expert-major") + ", reach " +
         (reach == Reach::kRelay ? "relay" : "one node") + ", counts " + readiness(counts) +
         ", dispatch " + readiness(dispatch) + ", combine " + readiness(combine) + ", loss " +
         (mask_lost() ? "mask" : "fail") + "}";
}

}  // namespace ferry::moe
