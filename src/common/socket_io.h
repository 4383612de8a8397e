// Blocking I/O on a stream socket, bounded by a deadline, and the bootstrap of a rank behind a
// relay: what the forked ranks and the rendezvous share.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "ferry/bootstrap.h"
#include "ferry/status.h"

namespace ferry {

// Reads or writes exactly n bytes before `deadline`: DeadlineExceeded past it, Unavailable when
// the other end closed or reset the connection.
Status IoExact(int fd, void* buf, size_t n, bool write,
               std::chrono::steady_clock::time_point deadline);

// A rank that reaches the others through one stream socket to a relay -- the forked ranks'
// launcher, or rank 0 of a rendezvous -- which answers each round with every rank's frame: the
// rank sends [u32 length][bytes] and reads [u32 count]([u32 length][bytes])*. Owns fd.
std::unique_ptr<Bootstrap> NewRelayedBootstrap(int rank, int world_size, int fd);

}  // namespace ferry
