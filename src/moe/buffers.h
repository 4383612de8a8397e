// What an AllToAll's buffers take on each rank, from the layouts the devices use (RelayLayout,
// NvlinkLayout), and what DeepEP's low-latency buffer takes for the same shape (its
// LowLatencyLayout: two halves, each a send, a receive and a signalling region). The figures of
// docs/DESIGN.md ("Buffer memory") are these (`ferry-bench buffers`).
#pragma once

#include <cstdint>

#include "ferry/moe.h"

namespace ferry::moe {

struct BufferBytes {
  int64_t receive = 0;  // what peers write into: inbox, NVLink buffer less its send area
  int64_t send = 0;     // what peers and the NIC read: outbox, the NVLink send area
  int64_t total() const { return receive + send; }
};

// The host device: the relay's inbox and outbox, every other rank remote.
BufferBytes HostDeviceBuffers(const AllToAllConfig& c);
// The CUDA device: its NVLink buffer, and the relay's boxes where there are other nodes;
// `small_batches`: one kernel sends every batch (where Streaming::kAuto streams the dispatch).
BufferBytes CudaDeviceBuffers(const AllToAllConfig& c, bool small_batches = false);
// Node-once forwarding on the CUDA device: its rail's, its node's and its weights rail's
// AllToAll, and the middle buffers between them (counted as receive memory: the rail's receive
// writes them).
BufferBytes NodeOnceBuffers(const AllToAllConfig& c);
// DeepEP's low-latency mode for at most `max_tokens` per rank: messages of a 16-byte header and
// the larger of a bf16 row and an fp8 row with its scales (dispatch), or a bf16 row with
// per-128-column metadata (combine), a slot for every (expert, sending token) pair.
BufferBytes DeepEpLowLatencyBuffers(int64_t max_tokens, int64_t hidden, int64_t experts);

}  // namespace ferry::moe
