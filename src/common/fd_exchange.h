// File descriptors between the ranks of one node, for memory they map into each other (CUDA
// allocations exported as POSIX file descriptors for the NVLink path).
//
// A descriptor cannot travel through the bootstrap (bytes only); it crosses a Unix-domain socket
// as SCM_RIGHTS ancillary data. Each rank listens on an abstract socket named after a token rank 0
// draws (so concurrent jobs never meet) and its rank; after a barrier each rank connects to every
// other member of its node and sends its descriptor; then it accepts one connection per member.
// Every wait is bounded by the timeout.
#pragma once

#include <chrono>
#include <span>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/status.h"

namespace ferry {

// Collective over the whole bootstrap (every rank calls it, node members or not). `members` are
// the ranks of the caller's node, the caller included, the same list on each of them. Returns,
// indexed like `members`, a descriptor of the caller's own (the caller's own entry is a dup of
// `mine`); the caller closes them.
StatusOr<std::vector<int>> ExchangeFds(Bootstrap& bootstrap, std::span<const int> members,
                                       int mine, std::chrono::milliseconds timeout);

}  // namespace ferry
