// Where everything lives in a rank's NVLink buffer (cuda_device.h draws it), and the two
// choices that shape it: pure arithmetic on the configuration and the steps to stream, so that
// the kernels' host side and the buffer-size figures (moe/buffers.h) decide them once. No CUDA
// here.
#pragma once

#include <cstdint>

#include "ferry/moe.h"
#include "moe/wire.h"

namespace ferry::moe {

struct NvlinkLayout {
  // stream_mask: the steps AllToAllConfig::streaming streams (1 dispatch, 2 combine); one node
  // (no relay) streams.
  NvlinkLayout(const AllToAllConfig& c, int stream_mask)
      : one_node(c.ranks_per_node == c.world_size),
        counts_tagged(one_node),
        stream(one_node && (stream_mask & 1)),
        stream_combine(one_node && (stream_mask & 2)),
        slot(c, stream) {
    const int64_t n = c.world_size, rows = int64_t{c.max_tokens_per_rank} * c.experts_per_token;
    counts_off = RoundUp(2 * n * 8, 128);  // after the dispatch and combine flags
    counts_stride = static_cast<int>(RoundUp(CountsWidth(c) + (counts_tagged ? 1 : 0), 4));
    private_off = RoundUp(counts_off + n * counts_stride * 4, 128);
    combine_off = RoundUp(private_off + n * c.max_private_tokens * slot.slot_bytes, 128);
    combine_tag_off = RoundUp(combine_off + rows * c.combine_row_bytes(), 128);
    send_off = RoundUp(combine_tag_off + (stream_combine ? rows * 8 : 0), 128);
    bytes = send_off + rows * slot.slot_bytes;  // the send area: a slot for each of our copies
  }
  bool one_node;
  bool counts_tagged;   // each counts row carries a tag (one node)
  bool stream;          // each slot carries a tag (one node, streamed dispatch)
  bool stream_combine;  // each returned row carries a tag (one node, streamed combine)
  SlotFormat slot;
  int counts_stride;  // int32 per counts row, rounded up to 16 bytes
  int64_t counts_off, private_off, combine_off, combine_tag_off, send_off, bytes;
};

}  // namespace ferry::moe
