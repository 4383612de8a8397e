// Membership: what the ranks of an AllToAll agree on before lost ranks come back
// (AllToAll::Readmit on the survivors, AllToAll::Join on the new processes). Each brings its
// view -- whether it joins, the membership version, the epoch it is at, which ranks it has
// masked, its configuration's fingerprint -- and every rank decides from all of them, the same
// way, whether the readmission goes ahead and for which ranks.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/status.h"

namespace ferry::moe {

// What a survivor's masks cover: every rank it lost (per rank forwarding: each rank waits for
// every other), or only those it waits for itself (node-once: its node's and its rail's), so
// that the world's lost ranks are the survivors' masks together.
enum class MaskCover : uint8_t { kWhole = 0, kOwnHops = 1 };

struct MemberView {
  bool joining = false;        // a new process (Join): for a lost rank, or the world growing
  bool resizing = false;       // a survivor's Resize (else Readmit; a joining rank's not read)
  uint64_t version = 0;        // readmissions so far (a joining rank's is not read)
  uint64_t epoch = 0;          // the survivor's next epoch (a joining rank's is not read)
  std::vector<uint8_t> masked;  // [world size] 1 where the survivor masked a rank
  std::vector<uint8_t> fingerprint;  // AllToAllConfig::Fingerprint
  MaskCover cover = MaskCover::kWhole;  // what `masked` covers (the configuration decides)

  std::vector<uint8_t> Serialize() const;
  // DataLoss for bytes that are not a view of this world size.
  static StatusOr<MemberView> Parse(std::span<const uint8_t> bytes, int world_size);
};

struct Readmission {
  uint64_t version = 0;        // after it
  uint64_t epoch = 0;          // the first epoch with the readmitted ranks
  std::vector<uint8_t> ranks;  // [world size] 1 where a rank joins (comes back, or is new)
};

// The decision from every rank's view (views[r] is rank r's): InvalidArgument naming a rank
// whose configuration differs; FailedPrecondition naming a rank that is on another view (no
// survivor at all, survivors on different versions or epochs, or some resizing and some
// readmitting). A readmission also needs the survivors to agree on the masks (MaskCover::
// kWhole; with kOwnHops the lost ranks are their masks together), and brings back exactly the
// masked ranks; a resize (a new world, numbered anew) takes any ranks joining.
StatusOr<Readmission> Decide(const std::vector<MemberView>& views);

// Every rank's view through `group`, then Decide.
StatusOr<Readmission> Meet(Bootstrap& group, const MemberView& mine,
                           std::chrono::milliseconds timeout);

}  // namespace ferry::moe
