// The host device without a network. First its receive half on a section written by hand where
// the relay would have put it: well-formed slots land in their experts' rows; a malformed section
// (a corrupt or hostile peer) is DataLoss naming the sender, ends the AllToAll, and writes
// nothing outside the output. Then two devices whose relay is the test itself (it copies each
// outbox section into the peer's inbox and raises the flags, as the relay's writes and
// immediates do): what a sender writes is the wire format the CUDA kernels read (moe/wire.h).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "moe/device.h"
#include "moe/wire.h"
#include "moe/numerics.h"

namespace ferry::moe {
namespace {

using namespace std::chrono_literals;

constexpr uint8_t kGuard = 0xA5;

// 4 experts (2 local), top-2, at most 4 tokens per rank, hidden 128, bf16; 2 ranks.
AllToAllConfig Config(int rank) {
  return {.world_size = 2,
          .rank = rank,
          .num_experts = 4,
          .experts_per_token = 2,
          .max_tokens_per_rank = 4,
          .hidden = 128,
          .dtype = DispatchDtype::kBf16,
          .max_private_tokens = 2};
}

// One rank's relay memory, as the host AllToAll allocates it.
struct Boxes : HostBoxes {
  explicit Boxes(const AllToAllConfig& c)
      : Boxes(RelayLayout(c, SlotFormat(c, false).slot_bytes, 1)) {}
  explicit Boxes(const RelayLayout& l) : HostBoxes(l), layout(l) {}
  RelayLayout layout;
};

// Rank 0 receives; rank 1 sent it kSlots slots, each one copy of token j for local expert
// j % 2, its row filled with 10 + j. Rank 1 numbers the rows it expects back from us from its
// row 2 on (rows 0 and 1 are its own experts').
constexpr int kSlots = 3;
constexpr int kRowStart = 2;

struct Receiver {
  Receiver()
      : c(Config(0)),
        boxes(c),
        slot(c, false),
        device(NewHostDevice({c, &boxes.layout, boxes.buffers(), nullptr})),
        x(size_t(Rows() + 1) * c.token_bytes(), kGuard),  // one guard row past the output
        num_tokens(size_t(c.local_experts()), -1) {
    int32_t* row = Counts();
    row[0] = 2;  // copies for local expert 0 (slots 0 and 2) and 1 (slot 1)
    row[1] = 1;
    row[2 + kColSlots] = kSlots;
    row[2 + kColRowStart] = kRowStart;
    row[2 + kColRows] = kSlots;
    for (int j = 0; j < kSlots; ++j) {
      Put(j, SlotHeader{j, 1, kRowStart + j, 0, 1}, SlotEntry{j % 2, 0, 0.5f, j / 2});
    }
  }

  int64_t Rows() const { return c.local_experts() * c.expert_capacity(); }
  uint8_t* Section() { return boxes.inbox.data() + boxes.layout.InSection(0); }
  int32_t* Counts() { return reinterpret_cast<int32_t*>(Section()); }

  void Put(int64_t j, SlotHeader header, SlotEntry entry) {
    uint8_t* s = Section() + boxes.layout.counts_bytes + j * slot.slot_bytes;
    std::memcpy(s, &header, sizeof header);
    std::memcpy(s + sizeof header, &entry, sizeof entry);
    std::memset(s + slot.meta_bytes, 10 + int(j), size_t(c.token_bytes()));
  }

  // The relay's part: rank 1's section landed; then the device's receive half of epoch 0 (we
  // sent nothing ourselves: our own section is empty).
  Status Receive() {
    boxes.flags[1] = 1;
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
  Boxes boxes;
  SlotFormat slot;
  std::unique_ptr<MoeDevice> device;
  std::vector<uint8_t> x;
  std::vector<int32_t> num_tokens;
};

// The control: the same rig unchanged unpacks every slot, so the failures below are the
// corruption's and not the rig's. The relay is told where rank 1's rows go.
TEST(HostDeviceTest, WellFormedSlotsLandInTheirExpertsRows) {
  Receiver r;
  ASSERT_TRUE(r.Receive().ok());
  EXPECT_EQ(r.num_tokens, (std::vector<int32_t>{2, 1}));
  EXPECT_TRUE(r.RowHolds(0, 0, 10));  // tokens 0 and 2 to local expert 0, in order
  EXPECT_TRUE(r.RowHolds(0, 1, 12));
  EXPECT_TRUE(r.RowHolds(1, 0, 11));
  EXPECT_TRUE(r.GuardIntact());
  EXPECT_TRUE(r.device->Sticky().ok());
  const int64_t* in_rows = r.boxes.layout.InRows(r.boxes.control_bytes(), 0);
  EXPECT_EQ(in_rows[0], kRowStart);
  EXPECT_EQ(in_rows[1], kSlots);
}

// Without the section, the receive half waits until its deadline and names what it waited for.
TEST(HostDeviceTest, AMissingSectionEndsTheReceiveAtItsDeadline) {
  Receiver r;
  DispatchOutput out;
  out.x = r.x.data();
  out.num_tokens = r.num_tokens.data();
  const auto start = std::chrono::steady_clock::now();
  const Status s = r.device->DispatchRecv(out, 0, Deadline::After(200ms));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("rank 1's dispatch section of epoch 0"), std::string::npos)
      << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
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
  // Later steps report it (the AllToAll checks the device's error before each step).
  EXPECT_EQ(r.device->Sticky().message(), s.message());
  EXPECT_TRUE(r.GuardIntact());
}

const SlotHeader kRow2{2, 1, kRowStart + 2, 0, 1};
const Corruption kCorruptions[] = {
    {"no_entries",
     [](Receiver& r) {
       r.Put(1, {1, 0, kRowStart + 1, 0, 1}, {1, 0, 0.5f, 0});
     },
     "malformed slot 1"},
    {"more_entries_than_top_k",
     [](Receiver& r) {
       r.Put(1, {1, 3, kRowStart + 1, 0, 1}, {1, 0, 0.5f, 0});
     },
     "malformed slot 1"},
    {"negative_token",
     [](Receiver& r) {
       r.Put(0, {-1, 1, kRowStart, 0, 1}, {0, 0, 0.5f, 0});
     },
     "malformed slot 0"},
    {"token_past_the_maximum",
     [](Receiver& r) {
       r.Put(2, {4, 1, kRowStart + 2, 0, 1}, {0, 0, 0.5f, 1});
     },
     "malformed slot 2"},
    {"part_past_its_parts",
     [](Receiver& r) {
       r.Put(2, {2, 1, kRowStart + 2, 1, 1}, {0, 0, 0.5f, 1});
     },
     "malformed slot 2"},
    {"row_before_ours",  // a row the sender numbered for another expert rank
     [](Receiver& r) {
       r.Put(0, {0, 1, kRowStart - 1, 0, 1}, {0, 0, 0.5f, 0});
     },
     "malformed slot 0"},
    {"expert_not_local",
     [](Receiver& r) {
       r.Put(2, kRow2, {2, 0, 0.5f, 0});
     },
     "local expert 2"},
    {"negative_expert",
     [](Receiver& r) {
       r.Put(0, {0, 1, kRowStart, 0, 1}, {-1, 0, 0.5f, 0});
     },
     "local expert -1"},
    {"copy_past_top_k",
     [](Receiver& r) {
       r.Put(1, {1, 1, kRowStart + 1, 0, 1}, {1, 2, 0.5f, 0});
     },
     "copy 2"},
    {"position_past_the_announced_copies",
     [](Receiver& r) {
       r.Put(2, kRow2, {0, 0, 0.5f, 2});
     },
     "position 2"},
    // Three copies, but the sender's counts announced two combine rows.
    {"more_copies_than_rows", [](Receiver& r) { r.Counts()[2 + kColRows] = 2; },
     "of the 2 it expects back"},
    {"more_slots_than_a_sender_has", [](Receiver& r) { r.Counts()[2 + kColSlots] = 9; },
     "announces 9 slots"},
    {"more_rows_than_a_rank_returns", [](Receiver& r) { r.Counts()[2 + kColRows] = 9; },
     "and 9 combine rows"},
    {"rows_past_the_combine_region", [](Receiver& r) { r.Counts()[2 + kColRowStart] = 6; },
     "at row 6"},
    {"negative_copies", [](Receiver& r) { r.Counts()[1] = -1; }, "announces -1 copies"},
    {"copies_past_the_capacity", [](Receiver& r) { r.Counts()[0] = 9; }, "capacity 8"},
};

INSTANTIATE_TEST_SUITE_P(Sections, HostDeviceCorruptionTest, ::testing::ValuesIn(kCorruptions),
                         [](const auto& info) { return std::string(info.param.name); });

// Two devices, rank 0 and rank 1, with the test as their relay: each outbox section goes into
// the peer's inbox (the rows at the place the receiver's counts row named), then the peer's flag
// goes up. Rank 0 sends two tokens: token 0 to experts 1 and 2 (one on each rank), token 1 to
// experts 2 and 3 (both on rank 1); rank 1 sends nothing.
struct Pair {
  Pair() : c{Config(0), Config(1)}, boxes{Boxes(c[0]), Boxes(c[1])}, slot(c[0], false) {
    for (int r = 0; r < 2; ++r) {
      device[r] = NewHostDevice({c[r], &boxes[r].layout, boxes[r].buffers(), nullptr});
    }
  }
  // Rank `from`'s outbox section (its only remote rank: section 0) into the other's inbox.
  void RelayDispatch(int from) {
    Boxes& src = boxes[from];
    Boxes& dst = boxes[1 - from];
    const int64_t slots = *src.layout.OutSlots(src.control_bytes(), 0);
    std::memcpy(dst.inbox.data() + dst.layout.InSection(0), src.outbox.data(),
                size_t(src.layout.counts_bytes + slots * src.layout.slot_bytes));
    dst.flags[from] = 1;
  }
  void RelayCombine(int from) {
    Boxes& src = boxes[from];
    Boxes& dst = boxes[1 - from];
    const int64_t* in_rows = src.layout.InRows(src.control_bytes(), 0);
    std::memcpy(dst.inbox.data() + dst.layout.in_combine_off + in_rows[0] * dst.layout.row_bytes,
                src.outbox.data() + src.layout.OutRows(0),
                size_t(in_rows[1] * src.layout.row_bytes));
    dst.flags[2 + from] = 1;
  }
  const uint8_t* OutSlot(int j) const {
    return boxes[0].outbox.data() + boxes[0].layout.counts_bytes + j * slot.slot_bytes;
  }

  AllToAllConfig c[2];
  Boxes boxes[2];
  SlotFormat slot;
  std::unique_ptr<MoeDevice> device[2];
};

TEST(HostDeviceTest, WhatASenderWritesIsTheKernelsWireFormatAndComesBackCombined) {
  Pair p;
  const int h = 128;
  std::vector<uint16_t> x(2 * h);
  for (int i = 0; i < 2 * h; ++i) x[i] = FloatToBf16(i < h ? 1.0f : 2.0f);
  const int32_t ids[] = {1, 2, 2, 3};
  const float w[] = {0.25f, 0.75f, 0.5f, 0.5f};
  ASSERT_TRUE(p.device[0]->DispatchSend({x.data(), nullptr, ids, w, 2}, 0).ok());
  ASSERT_TRUE(p.device[1]->DispatchSend({x.data(), nullptr, ids, w, 0}, 0).ok());
  EXPECT_EQ(*p.boxes[0].layout.OutboxFlag(p.boxes[0].control_bytes(), false), 1u);

  // Rank 0's counts row for rank 1: copies per local expert (2 and 3), then its columns; rank 1
  // returns three rows, numbered after the one rank 0 returns itself (token 0's expert 1).
  const auto* row = reinterpret_cast<const int32_t*>(p.boxes[0].outbox.data());
  EXPECT_EQ(std::vector<int32_t>(row, row + 6), (std::vector<int32_t>{2, 1, 3, 1, 1, 3}));
  EXPECT_EQ(*p.boxes[0].layout.OutSlots(p.boxes[0].control_bytes(), 0), 3);
  // One slot per copy (no option (a)): token 0's one part, token 1's two, each entry's position
  // among rank 0's copies for its expert.
  const SlotHeader want_headers[] = {{0, 1, 1, 0, 1}, {1, 1, 2, 0, 2}, {1, 1, 3, 1, 2}};
  const SlotEntry want_entries[] = {{0, 1, 0.75f, 0}, {0, 0, 0.5f, 1}, {1, 1, 0.5f, 0}};
  for (int j = 0; j < 3; ++j) {
    SlotHeader hd;
    SlotEntry en;
    std::memcpy(&hd, p.OutSlot(j), sizeof hd);
    std::memcpy(&en, p.OutSlot(j) + sizeof hd, sizeof en);
    EXPECT_EQ(std::memcmp(&hd, &want_headers[j], sizeof hd), 0) << "slot " << j;
    EXPECT_EQ(std::memcmp(&en, &want_entries[j], sizeof en), 0) << "slot " << j;
    EXPECT_EQ(std::memcmp(p.OutSlot(j) + p.slot.meta_bytes, x.data() + (j == 0 ? 0 : h), 2 * h), 0)
        << "slot " << j;
  }

  // Through the steps: each expert's output is its input times (expert id + 1).
  p.RelayDispatch(0);
  p.RelayDispatch(1);
  std::vector<std::vector<uint16_t>> out_x(2), expert_out(2);
  std::vector<std::vector<int32_t>> counts(2, std::vector<int32_t>(2, -1));
  for (int r = 0; r < 2; ++r) {
    const int64_t rows = int64_t{2} * p.c[r].expert_capacity();
    out_x[r].assign(size_t(rows) * h, 0);
    ASSERT_TRUE(
        p.device[r]
            ->DispatchRecv({out_x[r].data(), nullptr, counts[r].data()}, 0, Deadline::After(5s))
            .ok());
    expert_out[r].assign(out_x[r].size(), 0);
    for (int e = 0; e < 2; ++e) {
      for (int i = 0; i < counts[r][e]; ++i) {
        const int64_t at = (e * p.c[r].expert_capacity() + i) * h;
        for (int col = 0; col < h; ++col) {
          const float v = Bf16ToFloat(out_x[r][at + col]) * float(r * 2 + e + 1);
          expert_out[r][at + col] = FloatToBf16(v);
        }
      }
    }
    ASSERT_TRUE(p.device[r]->CombineSend(CombineInput{expert_out[r].data()}, 0).ok());
  }
  EXPECT_EQ(counts[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(counts[1], (std::vector<int32_t>{2, 1}));
  p.RelayCombine(1);
  p.RelayCombine(0);
  std::vector<uint16_t> y(2 * h, 0);
  ASSERT_TRUE(p.device[0]->CombineRecv({y.data(), false, nullptr}, 0, Deadline::After(5s)).ok());
  // Token 0: 0.25 * 2 + 0.75 * 3 = 2.75; token 1 (inputs 2): 0.5 * 6 + 0.5 * 8 = 7.
  EXPECT_EQ(Bf16ToFloat(y[0]), 2.75f);
  EXPECT_EQ(Bf16ToFloat(y[h + 5]), 7.0f);
}

}  // namespace
}  // namespace ferry::moe
