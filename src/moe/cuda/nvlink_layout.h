// Where everything lives in a rank's NVLink buffer (cuda_device.h draws it): pure arithmetic on
// the configuration and the step's modes (step_modes.h: which pieces carry tags), so that the
// kernels' host side and the buffer-size figures (moe/buffers.h) decide it once. No CUDA here.
#pragma once

#include <cstdint>

#include "ferry/moe.h"
#include "moe/cuda/step_modes.h"
#include "moe/wire.h"

namespace ferry::moe {

struct NvlinkLayout {
  NvlinkLayout(const AllToAllConfig& c, const StepModes& modes)
      : one_node(modes.reach == Reach::kOneNode),
        counts_tagged(modes.counts_tagged()),
        stream(modes.stream()),
        stream_combine(modes.stream_combine()),
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
  bool counts_tagged;   // each counts row carries a tag
  bool stream;          // each slot carries a tag (the streamed dispatch)
  bool stream_combine;  // each returned row carries a tag (the streamed combine)
  SlotFormat slot;
  int counts_stride;  // int32 per counts row, rounded up to 16 bytes
  int64_t counts_off, private_off, combine_off, combine_tag_off, send_off, bytes;
};

}  // namespace ferry::moe
