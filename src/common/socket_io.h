// Blocking I/O on a stream socket, bounded by a deadline: what the bootstraps' frames go over.
#pragma once

#include <chrono>
#include <cstddef>

#include "ferry/status.h"

namespace ferry {

// Reads or writes exactly n bytes before `deadline`: DeadlineExceeded past it, Unavailable when
// the other end closed or reset the connection.
Status IoExact(int fd, void* buf, size_t n, bool write,
               std::chrono::steady_clock::time_point deadline);

}  // namespace ferry
