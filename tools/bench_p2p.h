// ferry-bench p2p: what the link between GPU 0 and GPU 1 carries, the ways ferry's kernels use it.
//
// The moe benchmark's NVLink floor divides the bytes that must cross by the copy engine's
// one-way GPU 0 -> GPU 1 bandwidth. Dispatch and combine move bytes both ways at once and from
// SM kernels (stores into the peer's memory, or loads from it), so this measures those too, next
// to the copy engine in the same run: each row's 0 -> 1 figure over the copy engine's one-way.
#pragma once

#include <cstdint>

namespace ferry::bench {

// 0 on success; 1 without two GPUs that reach each other (or on a CUDA error); 2 on bad input.
int RunP2pBench(int64_t bytes);

}  // namespace ferry::bench
