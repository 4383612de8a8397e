// ferry-bench mirror: how soon a CUDA kernel sees an immediate that the engine mirrors into a
// GpuWords word (TransferEngine::MirrorImm), next to a host thread waiting for the same
// immediate in WaitImm -- the baseline, in the same process and run.
//
// Two engines of one process (B receives, A sends), one immediate at a time: A writes it and
// spins until the waiter answers through a word in host memory; the round trip is the sample.
// The waiter is a host thread in WaitImm (baseline), or a kernel spinning on the mirrored word,
// in each placement GpuWords has here (mapped host memory, polled by 1, 4 or 16 warps whose
// reads are staggered; GPU memory through GDRCopy where /dev/gdrdrv is). The kernel answers
// through a word in mapped host memory, so its rows hold one GPU store to host memory that a
// kernel acting on the count would not pay. Rounds alternate the waiters.
#pragma once

#include <string>

namespace ferry::bench {

struct MirrorBenchOptions {
  std::string provider = "shm";
  int iters = 2000;  // round trips per waiter and round
  int rounds = 3;
};

// 0 on success; 1 without a GPU or on an error; 2 on bad input.
int RunMirrorBench(const MirrorBenchOptions& options);

}  // namespace ferry::bench
