#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include "moe/steps.h"
#include "moe/wire.h"
#include "moe/numerics.h"

namespace ferry::moe {
namespace {

// The slot of DeepSeek-V3's decode shape (hidden 7168, fp8, top-8 of 256 experts over EP 4):
// metadata on its own 128-byte line (a 16-byte header and 8 entries of 16), the row and its 56
// scales, the whole rounded to a line; a streamed slot's tag still fits the metadata's line.
// What one sender can route to one receiver: T * min(K, L) slots and rows, or T per token once
// per rank (options (a) and (b)).
TEST(WireTest, SlotFormatAndPairLimits) {
  AllToAllConfig c{.world_size = 4, .rank = 1, .num_experts = 256, .experts_per_token = 8,
                   .max_tokens_per_rank = 128, .hidden = 7168, .dtype = DispatchDtype::kFp8E4M3,
                   .max_private_tokens = 16};
  ASSERT_TRUE(c.Validate().ok());
  const SlotFormat plain(c, false), tagged(c, true);
  EXPECT_EQ(plain.meta_used, 16 + 8 * 16);
  EXPECT_EQ(plain.meta_bytes, 256);
  EXPECT_EQ(plain.slot_bytes, 7680);  // 256 + 7168 + 224 = 7648, to a line
  EXPECT_EQ(tagged.meta_bytes, 256);
  EXPECT_EQ(CountsWidth(c), 64 + kCountsColumns);
  const PairLimits plain_pairs(c);
  EXPECT_EQ(plain_pairs.slots_per_pair, 128 * 8);
  EXPECT_EQ(plain_pairs.rows_per_pair, 128 * 8);
  c.dispatch_once_per_rank = true;
  const PairLimits once(c);
  EXPECT_EQ(once.slots_per_pair, 128);
  EXPECT_EQ(once.rows_per_pair, 128 * 8);
  c.combine_reduce_at_expert_rank = true;
  EXPECT_EQ(PairLimits(c).rows_per_pair, 128);
  c.num_experts = 8;  // 2 local experts: a token takes at most two of them
  c.dispatch_once_per_rank = c.combine_reduce_at_expert_rank = false;
  EXPECT_EQ(PairLimits(c).slots_per_pair, 128 * 2);
}

TEST(AllToAllConfigTest, ValidateNamesTheBadField) {
  AllToAllConfig c{.world_size = 4, .rank = 0, .ranks_per_node = 2, .num_experts = 64,
                   .experts_per_token = 8, .max_tokens_per_rank = 128, .hidden = 7168,
                   .dtype = DispatchDtype::kBf16, .max_private_tokens = 16};
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
  // bf16 and fp32 rows take any multiple of 16 columns (gpt-oss's 2880, pplx's 16); fp8 keeps
  // 128, a scale per 128 columns.
  bad.hidden = 2880;
  EXPECT_TRUE(bad.Validate().ok());
  bad.dtype = DispatchDtype::kFp32;
  bad.hidden = 16;
  EXPECT_TRUE(bad.Validate().ok());
  bad.hidden = 8;
  EXPECT_NE(bad.Validate().message().find("multiple of 16"), std::string::npos);
  bad.dtype = DispatchDtype::kFp8E4M3;
  bad.hidden = 2880;
  EXPECT_NE(bad.Validate().message().find("multiple of 128"), std::string::npos);
  // fp8 rows with scales of the caller's count: any multiple of 16 columns, 1 to hidden scales,
  // agreed among the ranks; fp8 only.
  bad.fp8_scales = 23;
  EXPECT_TRUE(bad.Validate().ok());
  EXPECT_EQ(bad.scales_per_token(), 23);
  AllToAllConfig other = bad;
  other.fp8_scales = 1;
  EXPECT_NE(bad.Fingerprint(), other.Fingerprint());
  bad.fp8_scales = 2881;
  EXPECT_NE(bad.Validate().message().find("fp8_scales"), std::string::npos);
  bad.fp8_scales = 1;
  bad.dtype = DispatchDtype::kBf16;
  EXPECT_NE(bad.Validate().message().find("fp8_scales is for fp8"), std::string::npos);
  bad = c;
  bad.rank = 3;
  EXPECT_EQ(c.Fingerprint(), bad.Fingerprint());  // rank is not part of the agreement
  // Masking lost peers changes what the CUDA kernels wait for (no counts-row tags): agreed.
  bad = c;
  bad.mask_lost_peers = true;
  EXPECT_NE(c.Fingerprint(), bad.Fingerprint());
  // An fp32 combine doubles a combine row's bytes: agreed. fp32 rows combine in fp32 whether
  // it is set or not.
  bad = c;
  bad.fp32_combine = true;
  EXPECT_TRUE(bad.Validate().ok());
  EXPECT_TRUE(bad.combines_fp32());
  EXPECT_EQ(bad.combine_row_bytes(), 7168 * 4);
  EXPECT_EQ(c.combine_row_bytes(), 7168 * 2);
  EXPECT_NE(c.Fingerprint(), bad.Fingerprint());
  EXPECT_NE(bad.ToString().find("fp32_combine"), std::string::npos);
  AllToAllConfig f32 = c;
  f32.dtype = DispatchDtype::kFp32;
  EXPECT_TRUE(f32.combines_fp32());
  AllToAllConfig flagged = f32;
  flagged.fp32_combine = true;
  EXPECT_EQ(f32.combine_row_bytes(), 7168 * 4);
  EXPECT_EQ(f32.Fingerprint(), flagged.Fingerprint());
}

// Which steps stream changes what crosses, so it is part of the agreement (a rank that streams
// differently fails Create with the other fields' message); the diagnostics are each rank's own.
// A value outside the enum is refused.
TEST(AllToAllConfigTest, StreamingIsAgreedTheDiagnosticsArePerRank) {
  AllToAllConfig c{.world_size = 4, .rank = 0, .ranks_per_node = 2, .num_experts = 64,
                   .experts_per_token = 8, .max_tokens_per_rank = 128, .hidden = 7168,
                   .dtype = DispatchDtype::kBf16, .max_private_tokens = 16};
  AllToAllConfig other = c;
  other.cuda.trace = other.cuda.relay_trace = true;
  EXPECT_EQ(c.Fingerprint(), other.Fingerprint());
  for (Streaming s : {Streaming::kNone, Streaming::kDispatch, Streaming::kCombine,
                      Streaming::kBoth}) {
    other = c;
    other.streaming = s;
    EXPECT_TRUE(other.Validate().ok()) << int(s);
    EXPECT_NE(c.Fingerprint(), other.Fingerprint()) << int(s);  // kAuto (the default) differs too
  }
  other.streaming = static_cast<Streaming>(5);
  EXPECT_NE(other.Validate().message().find("streaming"), std::string::npos);
}

// CudaTuning::FromEnv: unset variables leave the defaults; each one set takes its field's
// place; a value the field cannot take is refused naming the variable.
TEST(CudaTuningTest, FromEnvReadsEachVariableAndRefusesBadValues) {
  const char* names[] = {"FERRY_NV_TRACE", "FERRY_RELAY_TRACE", "FERRY_GDRCOPY"};
  for (const char* n : names) unsetenv(n);
  StatusOr<CudaTuning> d = CudaTuning::FromEnv();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_FALSE(d->trace || d->relay_trace);
  EXPECT_TRUE(d->gdrcopy);
  setenv("FERRY_NV_TRACE", "1", 1);
  setenv("FERRY_RELAY_TRACE", "1", 1);
  setenv("FERRY_GDRCOPY", "0", 1);
  StatusOr<CudaTuning> t = CudaTuning::FromEnv();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->trace && t->relay_trace);
  EXPECT_FALSE(t->gdrcopy);
  for (const char* n : names) unsetenv(n);
  const std::pair<const char*, const char*> bad[] = {{"FERRY_NV_TRACE", "2"},
                                                     {"FERRY_NV_TRACE", "1x"},
                                                     {"FERRY_RELAY_TRACE", "on"},
                                                     {"FERRY_GDRCOPY", "yes"}};
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

TEST(Fp16Test, RoundsToNearestEvenAndKeepsSubnormalsAndSpecials) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3C00);
  EXPECT_EQ(FloatToFp16(-2.5f), 0xC100);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7BFF);                      // largest finite
  EXPECT_EQ(FloatToFp16(65519.99f), 0x7BFF);                     // below the halfway point
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7C00);                      // halfway: to infinity
  EXPECT_EQ(FloatToFp16(-1e30f), 0xFC00);
  EXPECT_EQ(FloatToFp16(1.0f + 0x1p-11f), 0x3C00);               // halfway, rounds to even
  EXPECT_EQ(FloatToFp16(1.0f + 3 * 0x1p-11f), 0x3C02);           // halfway, rounds up to even
  EXPECT_EQ(FloatToFp16(0x1p-14f), 0x0400);                      // smallest normal
  EXPECT_EQ(FloatToFp16(0x1p-24f), 0x0001);                      // smallest subnormal
  EXPECT_EQ(FloatToFp16(0x1p-25f), 0x0000);                      // halfway to it: even, zero
  EXPECT_EQ(FloatToFp16(0x1.8p-25f), 0x0001);                    // above halfway
  EXPECT_EQ(FloatToFp16(3 * 0x1p-25f), 0x0002);                  // 1.5 units: to even, 2
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16(std::nanf("")), 0x7FFF);
  // Every fp16 value, NaNs aside, widens exactly and rounds back to itself; between two
  // neighbours, the midpoint goes to the even one and a float either side of it to its side.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto b = static_cast<uint16_t>(h);
    const float f = Fp16ToFloat(b);
    if ((b & 0x7C00) == 0x7C00 && (b & 0x3FF)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      continue;
    }
    ASSERT_EQ(FloatToFp16(f), b) << h;
    if ((b & 0x7FFF) >= 0x7BFF) continue;  // no finite neighbour above
    const float next = Fp16ToFloat(static_cast<uint16_t>(b + 1));
    const float mid = (f + next) / 2;  // exact in float: fp16 has 11 significant bits
    const uint16_t even = (b & 1) ? static_cast<uint16_t>(b + 1) : b;
    ASSERT_EQ(FloatToFp16(mid), even) << h;
    ASSERT_EQ(FloatToFp16(std::nextafter(mid, f)), b) << h;
    ASSERT_EQ(FloatToFp16(std::nextafter(mid, next)), static_cast<uint16_t>(b + 1)) << h;
  }
}

// fp16 is a 2-byte combine's other element: refused where the combine is fp32, and the output
// must be what the CombineSend was told.
TEST(AllToAllConfigTest, Fp16CombinesTwoByteRowsAndBothHalvesAgree) {
  AllToAllConfig c{.world_size = 2, .rank = 0, .num_experts = 8, .experts_per_token = 2,
                   .max_tokens_per_rank = 4, .hidden = 256};
  const uint16_t rows[4] = {};
  uint16_t out[4] = {};
  EXPECT_TRUE(CheckCombineInput(c, CombineInput{rows, true}).ok());
  EXPECT_TRUE(CheckCombineOutput(c, CombineOutput{.out = out, .fp16 = true}, true).ok());
  Status s = CheckCombineOutput(c, CombineOutput{.out = out}, true);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bf16 output, and its CombineSend was given fp16"),
            std::string::npos) << s.message();
  EXPECT_EQ(CheckCombineInput(c, CombineInput{nullptr, true}).code(),
            StatusCode::kInvalidArgument);
  c.fp32_combine = true;
  s = CheckCombineInput(c, CombineInput{rows, true});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("combines in fp32"), std::string::npos) << s.message();
  EXPECT_FALSE(CheckCombineOutput(c, CombineOutput{.out = out, .fp16 = true}, false).ok());
}

// bf16 rows quantised inside the dispatch get one scale per 128 columns, so an AllToAll that
// carries scales of another count refuses them, naming the count.
TEST(AllToAllConfigTest, QuantisingInTheDispatchNeedsTheDefaultScales) {
  AllToAllConfig c{.world_size = 2, .rank = 0, .num_experts = 8, .experts_per_token = 2,
                   .max_tokens_per_rank = 4, .hidden = 256, .dtype = DispatchDtype::kFp8E4M3};
  const uint16_t rows[4 * 256] = {};
  const int32_t ids[8] = {};
  const float weights[8] = {};
  DispatchInput in;
  in.x_bf16 = rows;
  in.indices = ids;
  in.weights = weights;
  in.num_tokens = 4;
  EXPECT_TRUE(CheckDispatchInput(c, in).ok());
  c.fp8_scales = 1;
  const Status s = CheckDispatchInput(c, in);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("fp8_scales 1"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace ferry::moe
