// The MoE protocol from a peer's bytes: what other ranks' relays write into our inbox -- each
// sender's counts row and slots (moe/wire.h) -- read by the host device's receive half, the
// checks the CUDA kernels share (SlotHeaderValid, SlotEntryValid) included. The first byte
// picks the configuration (world 2 or 3, bf16 or fp8, options (a) and (b), the token-major
// layout, expert padding or a fixed expert block of three rows); the rest are the senders'
// sections, one after the other. The receive half either takes them or refuses them with
// DataLoss (or, with the fixed block, ResourceExhausted for an expert sent more than it holds);
// with them taken, the combine runs to the end. Every output is exactly its size, so AddressSanitizer sees any write outside it.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz.h"
#include "moe/device.h"
#include "moe/wire.h"

using namespace ferry;
using namespace ferry::moe;
using namespace std::chrono_literals;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t pick = data[0];
  const AllToAllConfig c = MoeFuzzConfig(pick, 0);
  const bool token_major = c.dispatch_layout == DispatchLayout::kTokenMajor;
  const int layout_pick = token_major ? 0 : pick >> 3 & 3;
  const int padding = std::vector<int>{0, 0, 1, 4}[layout_pick];
  const int64_t expert_rows = layout_pick == 1 ? 3 : 0;
  FUZZ_REQUIRE(c.Validate().ok(), "the harness's configuration");

  const RelayLayout layout(c, SlotFormat(c, false).slot_bytes, 1);
  HostBoxes boxes(layout);
  auto device = NewHostDevice({c, &layout, boxes.buffers(), nullptr});
  const int n = c.world_size, k = c.experts_per_token, l = c.local_experts();

  // Our own tokens: one to experts 0 and the last, one to expert 1 only.
  const int tokens = 2;
  const int64_t payload = c.token_bytes(), spt = c.scales_per_token();
  std::vector<uint8_t> x(size_t(tokens * payload), 0x3C);
  std::vector<float> scales(size_t(tokens * spt), 0.5f);
  std::vector<int32_t> ids = {0, c.num_experts - 1, 1, -1};
  std::vector<float> weights = {0.5f, 0.25f, 1.0f, 0.0f};
  DispatchInput in{x.data(), spt ? scales.data() : nullptr, ids.data(), weights.data(), tokens};
  FUZZ_REQUIRE(device->DispatchSend(in, 0).ok(), "our own dispatch");

  // The senders' sections, from the fuzzer's bytes.
  size_t at = 1;
  for (int s = 1; s < n; ++s) {
    uint8_t* section = boxes.inbox.data() + layout.InSection(layout.RemoteIndex(0, s));
    const size_t take = std::min(size_t(layout.section_bytes), size - at);
    std::memcpy(section, data + at, take);
    at += take;
    boxes.flags[s] = 1;
  }

  const int64_t capacity = c.expert_capacity();
  const int64_t rows = c.output_rows(padding, expert_rows);
  std::vector<uint8_t> out_x(size_t(rows * payload));
  std::vector<float> out_scales(size_t(rows * spt));
  std::vector<int32_t> num_tokens(static_cast<size_t>(l)), num_rows(1);
  std::vector<int32_t> token_experts(token_major ? size_t(capacity * k) : 0);
  std::vector<float> token_weights(token_major ? size_t(capacity * k) : 0);
  DispatchOutput out;
  out.x = out_x.data();
  out.scales = spt ? out_scales.data() : nullptr;
  out.num_tokens = num_tokens.data();
  if (token_major) {
    out.num_rows = num_rows.data();
    out.token_experts = token_experts.data();
    out.token_weights = token_weights.data();
  }
  out.expert_padding = padding;
  out.expert_rows = expert_rows;
  const Status received = device->DispatchRecv(out, 0, Deadline::After(1s));
  if (!received.ok()) {
    FUZZ_REQUIRE(received.code() == StatusCode::kDataLoss ||
                     (expert_rows && received.code() == StatusCode::kResourceExhausted),
                 received.ToString().c_str());
    FUZZ_REQUIRE(device->Sticky().code() == received.code(), "the device's error");
    return 0;
  }
  for (int e = 0; e < l; ++e) FUZZ_REQUIRE(num_tokens[e] >= 0, "a negative count");

  std::vector<uint16_t> expert_out(size_t(rows * c.hidden), 0x3F80);  // 1.0
  FUZZ_REQUIRE(device->CombineSend(CombineInput{expert_out.data()}, 0).ok(),
               "the combine's send half");
  for (int s = 1; s < n; ++s) boxes.flags[n + s] = 1;
  std::vector<uint16_t> y(size_t(tokens * c.hidden));
  const Status combined = device->CombineRecv({y.data()}, 0, Deadline::After(1s));
  FUZZ_REQUIRE(combined.ok(), combined.ToString().c_str());
  return 0;
}
