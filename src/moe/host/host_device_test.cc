// The host device's receive half on slots written by hand where the proxy would have put them:
// well-formed slots land in their experts' rows; a malformed one (a corrupt or hostile peer) is
// DataLoss naming the sender and slot, stops the AllToAll, and writes nothing outside the output.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "moe/device.h"

namespace ferry::moe {
namespace {

using namespace std::chrono_literals;

constexpr uint8_t kGuard = 0xA5;

// Rank 0 of 2 receives; rank 1 sends it kSlots slots: two private, the third in the overflow.
// 4 experts (2 local), top-2, at most 4 tokens per rank, hidden 128, bf16, P = 2.
constexpr int kSlots = 3;

struct Receiver {
  Receiver()
      : c{2, 0, 1, 4, 2, 4, 128, DispatchDtype::kBf16, 2},
        layout(c),
        routing(c),
        recv(size_t(layout.recv_bytes)),
        send(size_t(layout.send_bytes)),
        device(NewHostDevice({c, &channel, &routing, recv.data(), send.data()})),
        x(size_t(Rows() + 1) * c.token_bytes(), kGuard),  // one guard row past the output
        num_tokens(size_t(c.local_experts()), -1) {
    routing.row(1)[c.num_experts + 0] = kSlots;              // slots from rank 1 to rank 0
    routing.row(1)[c.num_experts + c.world_size + 0] = kSlots;  // rows rank 0 returns to it
    for (int j = 0; j < kSlots; ++j) {
      // Token j of rank 1, copy 0, for local expert j % 2; its row filled with 10 + j.
      Put(j, SlotHeader{j, 1}, SlotEntry{j % 2, 0, 0.5f});
    }
  }

  int64_t Rows() const { return c.local_experts() * c.expert_capacity(); }

  // Rank 1's j-th slot to us, where the proxy's writes put it.
  uint8_t* Slot(int64_t j) {
    const int64_t p = c.max_private_tokens;
    const int64_t off = j < p ? layout.private_off + (1 * p + j) * layout.slot_bytes
                              : layout.overflow_off +
                                    (routing.OverflowStart(1, 0) + j - p) * layout.slot_bytes;
    return recv.data() + off;
  }

  void Put(int64_t j, SlotHeader header, SlotEntry entry) {
    uint8_t* slot = Slot(j);
    std::memcpy(slot, &header, sizeof header);
    std::memcpy(slot + sizeof header, &entry, sizeof entry);
    std::memset(slot + layout.meta_bytes, 10 + int(j), size_t(c.token_bytes()));
  }

  // The proxy's part: everything landed; then the device's receive half of epoch 0.
  Status Receive() {
    channel.recv_ready.store(1, std::memory_order_release);
    DispatchOutput out;
    out.x = x.data();
    out.num_tokens = num_tokens.data();
    return device->DispatchRecv(out, 0, Deadline::After(5s));
  }

  // Row `pos` of local expert e in the output: every byte `value`?
  bool RowHolds(int e, int64_t pos, uint8_t value) const {
    const uint8_t* row = x.data() + (e * c.expert_capacity() + pos) * c.token_bytes();
    for (int64_t i = 0; i < c.token_bytes(); ++i) {
      if (row[i] != value) return false;
    }
    return true;
  }

  bool GuardIntact() const {
    for (size_t i = size_t(Rows() * c.token_bytes()); i < x.size(); ++i) {
      if (x[i] != kGuard) return false;
    }
    return true;
  }

  AllToAllConfig c;
  MoeLayout layout;
  Routing routing;
  Channel channel;
  std::vector<uint8_t> recv, send;
  std::unique_ptr<MoeDevice> device;
  std::vector<uint8_t> x;
  std::vector<int32_t> num_tokens;
};

// The control: the same rig unchanged unpacks every slot, so the failures below are the
// corruption's and not the rig's.
TEST(HostDeviceTest, WellFormedSlotsLandInTheirExpertsRows) {
  Receiver r;
  ASSERT_TRUE(r.Receive().ok());
  EXPECT_EQ(r.num_tokens, (std::vector<int32_t>{2, 1}));
  EXPECT_TRUE(r.RowHolds(0, 0, 10));  // tokens 0 and 2 to local expert 0, in order
  EXPECT_TRUE(r.RowHolds(0, 1, 12));  // (slot 2 from the overflow region)
  EXPECT_TRUE(r.RowHolds(1, 0, 11));
  EXPECT_TRUE(r.GuardIntact());
  EXPECT_FALSE(r.channel.failed.load());
  EXPECT_EQ(r.channel.recv_consumed.load(), 1u);
}

struct Corruption {
  const char* name;
  std::function<void(Receiver&)> apply;
  const char* says;  // in the error message
};

void PrintTo(const Corruption& c, std::ostream* os) { *os << c.name; }

class HostDeviceCorruptionTest : public ::testing::TestWithParam<Corruption> {};

TEST_P(HostDeviceCorruptionTest, IsDataLossNamingTheSenderAndStopsTheAllToAll) {
  Receiver r;
  GetParam().apply(r);
  const Status s = r.Receive();
  ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("from rank 1"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(GetParam().says), std::string::npos) << s.ToString();
  // Later steps report it (AllToAll checks the channel before each step), and the receive
  // buffers are not handed back as if the epoch had been consumed.
  EXPECT_TRUE(r.channel.failed.load());
  EXPECT_EQ(r.channel.Error().message(), s.message());
  EXPECT_EQ(r.channel.recv_consumed.load(), 0u);
  EXPECT_TRUE(r.GuardIntact());
}

const Corruption kCorruptions[] = {
    {"no_entries", [](Receiver& r) { r.Put(1, {1, 0}, {1, 0, 0.5f}); }, "malformed slot 1"},
    {"more_entries_than_top_k",
     [](Receiver& r) { r.Put(1, {1, 3}, {1, 0, 0.5f}); }, "malformed slot 1"},
    {"negative_token", [](Receiver& r) { r.Put(0, {-1, 1}, {0, 0, 0.5f}); }, "malformed slot 0"},
    {"token_past_the_maximum",
     [](Receiver& r) { r.Put(2, {4, 1}, {0, 0, 0.5f}); }, "malformed slot 2"},
    {"expert_not_local", [](Receiver& r) { r.Put(2, {2, 1}, {2, 0, 0.5f}); }, "local expert 2"},
    {"negative_expert", [](Receiver& r) { r.Put(0, {0, 1}, {-1, 0, 0.5f}); }, "local expert -1"},
    {"copy_past_top_k", [](Receiver& r) { r.Put(1, {1, 1}, {1, 2, 0.5f}); }, "copy 2"},
    // Three copies, but the sender's counts announced two combine rows.
    {"more_copies_than_rows",
     [](Receiver& r) { r.routing.row(1)[r.c.num_experts + r.c.world_size] = 2; },
     "overruns its 2 rows"},
};

INSTANTIATE_TEST_SUITE_P(Slots, HostDeviceCorruptionTest, ::testing::ValuesIn(kCorruptions),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace ferry::moe
