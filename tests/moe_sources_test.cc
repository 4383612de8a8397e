// DispatchOutput::source_tokens, source_ranks and sender_ranges (DeepEP's handles: where each
// received row came from) on the host device: against what every rank sent, for the unpadded
// and the padded expert-major layouts and the token-major one; sender_ranges refused for the
// token-major layout, all three under node-once forwarding. The CUDA device's are checked
// against these in moe_cuda_test.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/steps.h"
#include "moe_inputs.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

constexpr int kWorld = 3, kTokens = 9, kExperts = 12, kK = 4, kHidden = 64;

// Each expert's rows from each sender, as the senders' inputs give them: sender s's copies for
// global expert g, its tokens in order.
std::vector<int> TokensFor(int s, int g, const InputSpec& spec, const AllToAllConfig& c) {
  const Inputs in = MakeInputs(spec, c, s, 0);
  std::vector<int> tokens;
  for (int t = 0; t < in.tokens; ++t) {
    for (int j = 0; j < kK; ++j) {
      if (in.indices[size_t(t) * kK + j] == g) tokens.push_back(t);
    }
  }
  return tokens;
}

const InputSpec kSpec{.tokens = kTokens, .k = kK, .experts = kExperts, .rank1_empty = true,
                      .unrouted = true};

// Rank b.rank()'s AllToAll of config `c` (its world, rank and shape filled in here), its
// dispatch sent.
struct Sent {
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<AllToAll> a2a;
  Inputs in;
};
StatusOr<Sent> Send(Bootstrap& b, AllToAllConfig c) {
  c.world_size = kWorld;
  c.rank = b.rank();
  c.num_experts = kExperts;
  c.experts_per_token = kK;
  c.max_tokens_per_rank = kTokens;
  c.hidden = kHidden;
  Sent s;
  ASSIGN_OR_RETURN(s.engine, TransferEngine::Create(testing_util::TestOptions("shm")));
  ASSIGN_OR_RETURN(s.a2a, AllToAll::Create(c, s.engine.get(), b));
  s.in = MakeInputs(kSpec, c, b.rank(), 0);
  RETURN_IF_ERROR(s.a2a->DispatchSend({s.in.x.data(), nullptr, s.in.indices.data(),
                                       s.in.weights.data(), s.in.tokens}));
  return s;
}

Status CheckSources(Bootstrap& b, int padding) {
  ASSIGN_OR_RETURN(Sent sent, Send(b, {}));
  const AllToAllConfig& c = sent.a2a->config();
  auto& a2a = sent.a2a;
  const Inputs& in = sent.in;
  const InputSpec& spec = kSpec;
  const int l = c.local_experts();
  const int64_t rows = c.output_rows(padding, 0);
  std::vector<uint8_t> x(size_t(rows * c.token_bytes()));
  std::vector<int32_t> counts(static_cast<size_t>(l)), sources(static_cast<size_t>(rows), -7),
      senders(sources.size(), -7);
  std::vector<int64_t> ranges(size_t(l) * kWorld, -7);
  RETURN_IF_ERROR(a2a->DispatchRecv({.x = x.data(),
                                     .num_tokens = counts.data(),
                                     .expert_padding = padding,
                                     .source_tokens = sources.data(),
                                     .sender_ranges = ranges.data(),
                                     .source_ranks = senders.data()},
                                    Deadline::After(30s)));
  int64_t base = 0;  // expert e's first row: e x capacity, or (padded) after the blocks before
  for (int e = 0; e < l; ++e) {
    if (padding == 0) base = int64_t{e} * c.expert_capacity();
    int64_t first = 0;
    for (int s = 0; s < kWorld; ++s) {
      const std::vector<int> want = TokensFor(s, b.rank() * l + e, spec, c);
      const int64_t range = ranges[size_t(e) * kWorld + s];
      const std::string at = "expert " + std::to_string(e) + ", sender " + std::to_string(s);
      CHECK_OR_RETURN(range >> 32 == first && (range & 0xFFFFFFFF) == int64_t(want.size()),
                      at + ": range " + std::to_string(range >> 32) + "+" +
                          std::to_string(range & 0xFFFFFFFF) + ", want " +
                          std::to_string(first) + "+" + std::to_string(want.size()));
      for (size_t i = 0; i < want.size(); ++i) {
        CHECK_OR_RETURN(senders[size_t(base + first + int64_t(i))] == s,
                        at + ": row " + std::to_string(first + int64_t(i)) + " from rank " +
                            std::to_string(senders[size_t(base + first + int64_t(i))]));
        CHECK_OR_RETURN(sources[size_t(base + first + int64_t(i))] == want[i],
                        at + ": row " + std::to_string(first + int64_t(i)) + " from token " +
                            std::to_string(sources[size_t(base + first + int64_t(i))]) +
                            ", want " + std::to_string(want[i]));
      }
      first += int64_t(want.size());
    }
    CHECK_OR_RETURN(first == counts[size_t(e)], "expert " + std::to_string(e) + ": counts");
    if (padding > 0) base += (first + padding - 1) / padding * padding;
  }
  std::vector<uint16_t> y(size_t(in.tokens) * kHidden);
  RETURN_IF_ERROR(a2a->CombineSend(x.data()));
  RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, Deadline::After(30s)));
  return b.Barrier(30s);
}

// Token-major: row by row, every sender's tokens that hold any of our experts, senders in rank
// order, each sender's in its token order.
Status CheckTokenMajorSources(Bootstrap& b) {
  ASSIGN_OR_RETURN(Sent sent, Send(b, {.dispatch_once_per_rank = true,
                                       .combine_reduce_at_expert_rank = true,
                                       .dispatch_layout = DispatchLayout::kTokenMajor}));
  const AllToAllConfig& c = sent.a2a->config();
  auto& a2a = sent.a2a;
  const Inputs& in = sent.in;
  const InputSpec& spec = kSpec;
  const int64_t rows = c.expert_capacity();
  std::vector<uint8_t> x(size_t(rows * c.token_bytes()));
  std::vector<int32_t> counts(size_t(c.local_experts())), experts(size_t(rows) * kK),
      sources(size_t(rows), -7), senders(size_t(rows), -7);
  std::vector<float> weights(experts.size());
  int32_t num_rows = -1;
  RETURN_IF_ERROR(a2a->DispatchRecv({.x = x.data(),
                                     .num_tokens = counts.data(),
                                     .num_rows = &num_rows,
                                     .token_experts = experts.data(),
                                     .token_weights = weights.data(),
                                     .source_tokens = sources.data(),
                                     .source_ranks = senders.data()},
                                    Deadline::After(30s)));
  int32_t row = 0;
  for (int s = 0; s < kWorld; ++s) {
    const Inputs sent = MakeInputs(spec, c, s, 0);
    for (int t = 0; t < sent.tokens; ++t) {
      bool ours = false;
      for (int j = 0; j < kK; ++j) {
        const int32_t g = sent.indices[size_t(t) * kK + j];
        ours = ours || (g >= 0 && g / c.local_experts() == b.rank());
      }
      if (!ours) continue;
      CHECK_OR_RETURN(row < num_rows, "fewer rows than rank " + std::to_string(s) + " sent");
      CHECK_OR_RETURN(senders[size_t(row)] == s && sources[size_t(row)] == t,
                      "row " + std::to_string(row) + ": rank " +
                          std::to_string(senders[size_t(row)]) + " token " +
                          std::to_string(sources[size_t(row)]) + ", want rank " +
                          std::to_string(s) + " token " + std::to_string(t));
      ++row;
    }
  }
  CHECK_OR_RETURN(row == num_rows, std::to_string(num_rows) + " rows, want " +
                                       std::to_string(row));
  std::vector<uint16_t> y(size_t(in.tokens) * kHidden);
  RETURN_IF_ERROR(a2a->CombineSend(x.data()));
  RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, Deadline::After(30s)));
  return b.Barrier(30s);
}

TEST(MoeSourcesTest, TokenMajorRowsSenderAndToken) {
  auto exits = testing_util::RunRanks(kWorld, CheckTokenMajorSources, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

TEST(MoeSourcesTest, EachRowsTokenAndEachSendersRangeUnpadded) {
  auto exits = testing_util::RunRanks(kWorld, [](Bootstrap& b) { return CheckSources(b, 0); },
                                      60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

TEST(MoeSourcesTest, EachRowsTokenAndEachSendersRangePadded) {
  auto exits = testing_util::RunRanks(kWorld, [](Bootstrap& b) { return CheckSources(b, 4); },
                                      60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Token-major rows lie in no expert block; node-once's rows come from forwarders.
TEST(MoeSourcesTest, RefusedWhereRowsHaveNoSingleSender) {
  AllToAllConfig c{.world_size = 4, .rank = 0, .ranks_per_node = 2, .num_experts = 8,
                   .experts_per_token = 2, .max_tokens_per_rank = 4, .hidden = 64};
  int32_t sources[64], counts[2];
  int64_t ranges[8];
  uint8_t x[4096];
  const DispatchOutput out{.x = x, .num_tokens = counts, .source_tokens = sources,
                           .sender_ranges = ranges};
  c.forwarding = Forwarding::kNodeOnce;
  ASSERT_TRUE(c.Validate().ok());
  Status s = moe::CheckDispatchOutput(c, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("node-once"), std::string::npos) << s.ToString();
  c.forwarding = Forwarding::kPerRank;
  c.dispatch_layout = DispatchLayout::kTokenMajor;
  int32_t num_rows, experts[64];
  float weights[64];
  DispatchOutput token_major = out;
  token_major.num_rows = &num_rows;
  token_major.token_experts = experts;
  token_major.token_weights = weights;
  s = moe::CheckDispatchOutput(c, token_major);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("token-major"), std::string::npos) << s.ToString();
  token_major.sender_ranges = nullptr;
  token_major.source_ranks = counts;
  EXPECT_TRUE(moe::CheckDispatchOutput(c, token_major).ok());
  c.forwarding = Forwarding::kNodeOnce;
  c.dispatch_once_per_rank = c.combine_reduce_at_expert_rank = true;
  s = moe::CheckDispatchOutput(c, token_major);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("source_ranks"), std::string::npos) << s.ToString();
}

// A token-major receive writes its ids at one width: 32-bit (token_experts) or 64-bit
// (token_experts64), either alone, never both.
TEST(MoeOutputChecksTest, TokenMajorIdsTakeOneWidth) {
  AllToAllConfig c{.world_size = 2, .rank = 0, .num_experts = 8, .experts_per_token = 2,
                   .max_tokens_per_rank = 4, .hidden = 128, .dispatch_once_per_rank = true,
                   .combine_reduce_at_expert_rank = true,
                   .dispatch_layout = DispatchLayout::kTokenMajor};
  ASSERT_TRUE(c.Validate().ok());
  uint16_t x[8 * 128];
  int32_t counts[4], num_rows, narrow[16];
  int64_t wide[16];
  float weights[16];
  DispatchOutput out{.x = x, .num_tokens = counts, .num_rows = &num_rows,
                     .token_weights = weights};
  Status s = moe::CheckDispatchOutput(c, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  out.token_experts = narrow;
  EXPECT_TRUE(moe::CheckDispatchOutput(c, out).ok());
  out.token_experts64 = wide;
  s = moe::CheckDispatchOutput(c, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("both"), std::string::npos) << s.ToString();
  out.token_experts = nullptr;
  EXPECT_TRUE(moe::CheckDispatchOutput(c, out).ok());
  c.dispatch_layout = DispatchLayout::kExpertMajor;
  s = moe::CheckDispatchOutput(c, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("expert-major"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace ferry
