#include "moe/buffers.h"

#include <algorithm>

#include "moe/cuda/nvlink_layout.h"
#include "moe/node_once.h"
#include "moe/relay.h"
#include "moe/wire.h"

namespace ferry::moe {

BufferBytes HostDeviceBuffers(const AllToAllConfig& c) {
  const RelayLayout relay(c, SlotFormat(c, false).slot_bytes, 1);
  return {relay.inbox_bytes, relay.outbox_bytes};
}

BufferBytes CudaDeviceBuffers(const AllToAllConfig& c, bool small_batches) {
  const NvlinkLayout nv(c, StepModes::Of(c, small_batches));
  BufferBytes b{nv.send_off, nv.bytes - nv.send_off};
  if (!nv.one_node) {
    const RelayLayout relay(c, nv.slot.slot_bytes, c.ranks_per_node);
    b.receive += relay.inbox_bytes;
    b.send += relay.outbox_bytes;
  }
  return b;
}

BufferBytes NodeOnceBuffers(const AllToAllConfig& c) {
  const NodeOnceConfigs inner = NodeOnceConfigsOf(c);
  const BufferBytes rail = CudaDeviceBuffers(inner.rail), node = CudaDeviceBuffers(inner.node),
                    weights = CudaDeviceBuffers(inner.weights);
  return {rail.receive + node.receive + weights.receive + MiddleBytesOf(c).total(),
          rail.send + node.send + weights.send};
}

BufferBytes DeepEpLowLatencyBuffers(int64_t max_tokens, int64_t hidden, int64_t experts) {
  const int64_t scales = hidden / 128;
  const int64_t dispatch_msg = 16 + std::max(hidden * 2, hidden + scales * 4);
  const int64_t combine_msg = scales * 4 + hidden * 2;
  const int64_t send = std::max(max_tokens * dispatch_msg, experts * max_tokens * combine_msg);
  const int64_t recv = experts * max_tokens * std::max(dispatch_msg, combine_msg);
  const int64_t signalling = RoundUp(experts * 4, 128);
  return {2 * (recv + signalling), 2 * send};
}

}  // namespace ferry::moe
