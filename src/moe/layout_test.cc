#include "moe/layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

namespace ferry::moe {
namespace {

// 3 ranks, 6 experts (2 per rank), P = 2. Slots per receiving rank, by sender:
//   rank 0 -> 1, 3, 0     rank 1 -> 4, 0, 2     rank 2 -> 4, 1, 3
TEST(RoutingTest, OverflowAndSendOffsets) {
  AllToAllConfig c{3, 0, 1, 6, 2, 8, 128, DispatchDtype::kBf16, 2};
  ASSERT_TRUE(c.Validate().ok());
  Routing r(c);
  const int32_t slots[3][3] = {{1, 3, 0}, {4, 0, 2}, {4, 1, 3}};
  for (int s = 0; s < 3; ++s) {
    for (int q = 0; q < 3; ++q) {
      r.row(s)[6 + q] = slots[s][q];
      r.row(s)[9 + q] = slots[s][q] + 1;  // rows: one more, to tell the columns apart
    }
  }
  EXPECT_EQ(r.Slots(0, 1), 3);
  EXPECT_EQ(r.Slots(1, 0), 4);
  EXPECT_EQ(r.Rows(2, 2), 4);
  // Overflow into rank 0: rank 0 sends 1 (no overflow), rank 1 sends 4 (2 over), rank 2 4.
  EXPECT_EQ(r.OverflowStart(0, 0), 0);
  EXPECT_EQ(r.OverflowStart(1, 0), 0);
  EXPECT_EQ(r.OverflowStart(2, 0), 2);
  // Sender 2's send area: rank 0's 4 slots, then rank 1's 1, then its own 3.
  EXPECT_EQ(r.SlotStart(2, 0), 0);
  EXPECT_EQ(r.SlotStart(2, 1), 4);
  EXPECT_EQ(r.SlotStart(2, 2), 5);
  EXPECT_EQ(r.RowStart(2, 2), 5 + 2);
}

// A peer's counts row is checked before any offset is computed from it: at most S slots and R
// rows for one receiver, none negative; the limits themselves pass.
TEST(RoutingTest, CountsRowsBeyondWhatFitsAreDataLoss) {
  AllToAllConfig c{3, 0, 1, 6, 2, 8, 128, DispatchDtype::kBf16, 2};
  c.dispatch_once_per_rank = true;  // S = T = 8; rows: R = T * min(K, L) = 16
  ASSERT_TRUE(c.Validate().ok());
  const MoeLayout l(c);
  ASSERT_EQ(l.slots_per_pair, 8);
  ASSERT_EQ(l.rows_per_pair, 16);
  Routing r(c);
  auto set = [&](int32_t slots, int32_t rows) {  // sender 2's counts for receiver 1
    r.row(2)[6 + 1] = slots;
    r.row(2)[9 + 1] = rows;
  };
  set(8, 16);
  EXPECT_TRUE(CheckCountsRow(c, l, r, 2, 1).ok());
  set(0, 0);
  EXPECT_TRUE(CheckCountsRow(c, l, r, 2, 1).ok());
  const int32_t bad[][2] = {{9, 16}, {8, 17}, {-1, 0}, {0, -1}, {std::numeric_limits<int32_t>::max(), 0}};
  for (const auto& b : bad) {
    set(b[0], b[1]);
    const Status s = CheckCountsRow(c, l, r, 2, 1);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << b[0] << " " << b[1];
    EXPECT_NE(s.message().find("rank 2's counts row"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("for rank 1"), std::string::npos) << s.ToString();
  }
  // Only the pair asked about: sender 2's counts for receiver 0 are still fine.
  EXPECT_TRUE(CheckCountsRow(c, l, r, 2, 0).ok());
}

TEST(MoeLayoutTest, RegionsDoNotOverlapAndHoldTheWorstCase) {
  AllToAllConfig c{4, 1, 1, 256, 8, 128, 7168, DispatchDtype::kFp8E4M3, 16};
  ASSERT_TRUE(c.Validate().ok());
  MoeLayout l(c);
  EXPECT_EQ(l.slot_bytes % 16, 0);
  EXPECT_GE(l.slot_bytes, 8 + 8 * 12 + 7168 + 56 * 4);
  EXPECT_EQ(l.slots_per_pair, 128 * 8);
  EXPECT_GE(l.private_off, 4 * (256 + 8) * 4);
  EXPECT_EQ(l.overflow_off, l.private_off + 4 * 16 * l.slot_bytes);
  EXPECT_EQ(l.combine_off, l.overflow_off + 4 * l.slots_per_pair * l.slot_bytes);
  c.dispatch_once_per_rank = true;
  c.combine_reduce_at_expert_rank = true;
  MoeLayout once(c);
  EXPECT_EQ(once.slots_per_pair, 128);
  EXPECT_EQ(once.rows_per_pair, 128);
  EXPECT_EQ(l.recv_bytes, l.combine_off + 128 * 8 * 7168 * 2);
  EXPECT_EQ(l.send_combine_off, l.send_dispatch_off + 128 * 8 * l.slot_bytes);
}

TEST(AllToAllConfigTest, ValidateNamesTheBadField) {
  AllToAllConfig c{4, 0, 2, 64, 8, 128, 7168, DispatchDtype::kBf16, 16};
  EXPECT_TRUE(c.Validate().ok());
  AllToAllConfig bad = c;
  bad.rank = 4;
  EXPECT_NE(bad.Validate().message().find("rank out of"), std::string::npos);
  bad = c;
  bad.ranks_per_node = 3;
  EXPECT_NE(bad.Validate().message().find("ranks_per_node"), std::string::npos);
  bad = c;
  bad.experts_per_token = 65;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
  bad = c;
  bad.hidden = 7000;
  EXPECT_NE(bad.Validate().message().find("hidden"), std::string::npos);
  EXPECT_NE(c.Fingerprint(), bad.Fingerprint());
  bad = c;
  bad.rank = 3;
  EXPECT_EQ(c.Fingerprint(), bad.Fingerprint());  // rank is not part of the agreement
}

// The CUDA kernels' scheduling: which steps stream changes what crosses, so it is part of the
// agreement (a rank that streams differently fails Create with the other fields' message);
// the rest is each rank's own. A stream mask the kernels cannot take is refused.
TEST(AllToAllConfigTest, CudaTuningStreamIsAgreedTheRestIsPerRank) {
  AllToAllConfig c{4, 0, 2, 64, 8, 128, 7168, DispatchDtype::kBf16, 16};
  AllToAllConfig other = c;
  other.cuda.early_receive = false;
  other.cuda.spread = other.cuda.trace = other.cuda.relay_trace = true;
  EXPECT_EQ(c.Fingerprint(), other.Fingerprint());
  for (int stream : {0, 1, 2, 3}) {
    other = c;
    other.cuda.stream = stream;
    EXPECT_TRUE(other.Validate().ok()) << stream;
    EXPECT_NE(c.Fingerprint(), other.Fingerprint()) << stream;  // -1 (the default) differs too
  }
  for (int stream : {-2, 4, 7}) {
    other.cuda.stream = stream;
    EXPECT_NE(other.Validate().message().find("cuda.stream"), std::string::npos) << stream;
  }
}

// CudaTuning::FromEnv: unset variables leave the defaults; each one set takes its field's
// place; a value the field cannot take is refused naming the variable.
TEST(CudaTuningTest, FromEnvReadsEachVariableAndRefusesBadValues) {
  const char* names[] = {"FERRY_NV_STREAM", "FERRY_NV_PDL", "FERRY_NV_SPREAD", "FERRY_NV_TRACE",
                         "FERRY_RELAY_TRACE"};
  for (const char* n : names) unsetenv(n);
  StatusOr<CudaTuning> d = CudaTuning::FromEnv();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->stream, -1);
  EXPECT_TRUE(d->early_receive);
  EXPECT_FALSE(d->spread || d->trace || d->relay_trace);
  setenv("FERRY_NV_STREAM", "3", 1);
  setenv("FERRY_NV_PDL", "0", 1);
  setenv("FERRY_NV_SPREAD", "1", 1);
  setenv("FERRY_NV_TRACE", "1", 1);
  setenv("FERRY_RELAY_TRACE", "1", 1);
  StatusOr<CudaTuning> t = CudaTuning::FromEnv();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->stream, 3);
  EXPECT_FALSE(t->early_receive);
  EXPECT_TRUE(t->spread && t->trace && t->relay_trace);
  for (const char* n : names) unsetenv(n);
  const std::pair<const char*, const char*> bad[] = {{"FERRY_NV_STREAM", "7"},
                                                     {"FERRY_NV_STREAM", "1x"},
                                                     {"FERRY_NV_STREAM", "-1"},
                                                     {"FERRY_NV_SPREAD", "2"},
                                                     {"FERRY_NV_PDL", "yes"},
                                                     {"FERRY_NV_TRACE", "2"},
                                                     {"FERRY_RELAY_TRACE", "on"}};
  for (const auto& [name, value] : bad) {
    setenv(name, value, 1);
    const Status s = CudaTuning::FromEnv().status();
    unsetenv(name);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << name << "=" << value;
    EXPECT_NE(s.message().find(name), std::string::npos) << s.ToString();
  }
}

TEST(Bf16Test, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(3.140625f)), 3.140625f);
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3F80);  // halfway, rounds to even
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3F82);  // halfway, rounds up to even
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::max()))));
}

}  // namespace
}  // namespace ferry::moe
