// The NVLink Unpack's slot checks (SlotHeaderValid, SlotEntryValid in nvlink_protocol.cuh), run
// on the host: the same functions the kernel calls, so CI checks what a corrupt slot must not get
// past without a GPU. (That the kernel reports kBadSlot and takes nothing is left to the GPU.)
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "moe/cuda/nvlink_protocol.cuh"

namespace ferry::moe::nv {
namespace {

// Top-4, 3 local experts, at most 8 tokens per rank, 2 senders; sender 1 expects at most 6
// combine rows from us; expert capacity 16.
constexpr SlotLimits kPlain{4, 3, 8, false, 6, 16};

// offset[s * L + e]: rows of local expert e from senders before s. Sender 0 sent 2 / 0 / 5
// copies to experts 0 / 1 / 2, sender 1 sent 3 / 1 / 0; in all 5 / 1 / 5.
const std::vector<int32_t> kOffset = {0, 0, 0, 2, 0, 5, 5, 1, 5};

TEST(SlotCheckTest, AWellFormedSlotPasses) {
  EXPECT_TRUE(SlotHeaderValid(SlotHeader{7, 4, 0, 0, 1}, 2, kPlain));  // rows 2..5 of 6
  EXPECT_TRUE(SlotHeaderValid(SlotHeader{0, 1, 5, 1, 2}, 5, kPlain));  // the last row
  SlotLimits reduce = kPlain;
  reduce.reduce = true;  // one row per token: 4 entries, row 5 of 6 still fits
  EXPECT_TRUE(SlotHeaderValid(SlotHeader{0, 4, 5, 0, 1}, 5, reduce));
  EXPECT_TRUE(SlotEntryValid(SlotEntry{0, 3, 0.5f, 2}, kOffset.data(), 1, kPlain));  // 3rd of 3
  EXPECT_TRUE(SlotEntryValid(SlotEntry{2, 0, 0.5f, 4}, kOffset.data(), 0, kPlain));  // 5th of 5
}

struct BadHeader {
  const char* name;
  SlotHeader header;
  int64_t row;
  bool reduce;
};
void PrintTo(const BadHeader& b, std::ostream* os) { *os << b.name; }

class SlotHeaderCheckTest : public ::testing::TestWithParam<BadHeader> {};

TEST_P(SlotHeaderCheckTest, IsRefused) {
  SlotLimits limits = kPlain;
  limits.reduce = GetParam().reduce;
  EXPECT_FALSE(SlotHeaderValid(GetParam().header, GetParam().row, limits));
}

INSTANTIATE_TEST_SUITE_P(
    Headers, SlotHeaderCheckTest,
    ::testing::Values(BadHeader{"no_entries", {1, 0, 0, 0, 1}, 0, false},
                      BadHeader{"more_entries_than_top_k", {1, 5, 0, 0, 1}, 0, false},
                      BadHeader{"negative_token", {-1, 1, 0, 0, 1}, 0, false},
                      BadHeader{"token_past_the_maximum", {8, 1, 0, 0, 1}, 0, false},
                      BadHeader{"row_below_those_for_us", {1, 1, 0, 0, 1}, -1, false},
                      BadHeader{"rows_past_what_the_sender_expects", {1, 2, 5, 0, 1}, 5, false},
                      BadHeader{"summed_row_past_it", {1, 1, 6, 0, 1}, 6, true},
                      BadHeader{"no_parts", {1, 1, 0, 0, 0}, 0, false},
                      BadHeader{"part_past_its_parts", {1, 1, 0, 2, 2}, 0, false},
                      BadHeader{"negative_part", {1, 1, 0, -1, 2}, 0, false}),
    [](const auto& info) { return std::string(info.param.name); });

struct BadEntry {
  const char* name;
  SlotEntry entry;
  int sender;
  int64_t capacity;
};
void PrintTo(const BadEntry& b, std::ostream* os) { *os << b.name; }

class SlotEntryCheckTest : public ::testing::TestWithParam<BadEntry> {};

TEST_P(SlotEntryCheckTest, IsRefused) {
  SlotLimits limits = kPlain;
  limits.capacity = GetParam().capacity;
  EXPECT_FALSE(SlotEntryValid(GetParam().entry, kOffset.data(), GetParam().sender, limits));
}

INSTANTIATE_TEST_SUITE_P(
    Entries, SlotEntryCheckTest,
    ::testing::Values(BadEntry{"expert_not_local", {3, 0, 0.5f, 0}, 0, 16},
                      BadEntry{"negative_expert", {-1, 0, 0.5f, 0}, 0, 16},
                      BadEntry{"k_past_top_k", {0, 4, 0.5f, 0}, 0, 16},
                      BadEntry{"negative_k", {0, -1, 0.5f, 0}, 0, 16},
                      BadEntry{"negative_position", {0, 0, 0.5f, -1}, 0, 16},
                      // Sender 1 sent expert 0 three copies and expert 2 none.
                      BadEntry{"position_past_the_senders_copies", {0, 0, 0.5f, 3}, 1, 16},
                      BadEntry{"a_copy_the_sender_never_counted", {2, 0, 0.5f, 0}, 1, 16},
                      // Expert 2 receives 5 rows in all: more than a capacity of 4.
                      BadEntry{"expert_rows_past_capacity", {2, 0, 0.5f, 0}, 0, 4}),
    [](const auto& info) { return std::string(info.param.name); });

// The offsets table is built from the senders' counts rows as they arrived: sender 0 announcing
// -3 copies for expert 0 and sender 1 three would put sender 1's copies at rows -3..-1 of the
// expert's block, before it. A copy from sender 1 is refused then, though its position is
// within the three it announced and the expert's total (0) within capacity.
TEST(SlotCheckTest, AnOffsetBelowTheExpertsBlockIsRefused) {
  const std::vector<int32_t> offset = {0, 0, 0, -3, 0, 0, 0, 0, 0};  // [2 senders + 1][3 experts]
  EXPECT_FALSE(SlotEntryValid(SlotEntry{0, 0, 0.5f, 0}, offset.data(), 1, kPlain));
  EXPECT_FALSE(SlotEntryValid(SlotEntry{0, 0, 0.5f, 2}, offset.data(), 1, kPlain));
}


// FastDiv (cuda_util.cuh) divides as the kernels do, by a multiply and a shift: every divisor
// up to 1024 (local experts, top-k) against `/` and `%` over the dividends up to 2^16, and the
// edges up to 2^31 - 1.
TEST(FastDivTest, MatchesIntegerDivision) {
  std::vector<int> edges = {(1 << 30) - 1, 1 << 30, (1 << 30) + 1, 0x7FFFFFFE, 0x7FFFFFFF};
  for (int d = 1; d <= 1024; ++d) {
    const FastDiv f = FastDiv::Of(d);
    for (int x = 0; x < (1 << 16); ++x) {
      if (f.Div(x) != x / d || f.Mod(x) != x % d) {
        ADD_FAILURE() << x << " / " << d << ": " << f.Div(x) << " rem " << f.Mod(x);
        return;
      }
    }
    for (int base : edges) {
      for (int x = base; x >= base - d && x >= 0; x -= 1 + d / 7) {
        ASSERT_EQ(f.Div(x), x / d) << x << " / " << d;
        ASSERT_EQ(f.Mod(x), x % d) << x << " % " << d;
      }
    }
  }
}

}  // namespace
}  // namespace ferry::moe::nv
