// What DeepEP's and pplx's APIs need of the core, on the host device. fp8 e4m3 made inside the
// dispatch (DispatchInput::x_bf16): the conversion against a search over all 256 codes, the
// scales' two rules, and a dispatch delivering exactly what quantising the sender's rows gives,
// while refusing inputs that mix the two forms. Expert padding (DispatchOutput::expert_padding):
// each expert's block where the padded blocks before it end, padding rows untouched, and the
// combine reading the same layout. Fixed expert blocks (DispatchOutput::expert_rows): each
// expert's rows from its block's start, and a block one expert overflows failing the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/numerics.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// The e4m3 code nearest to f by exhaustive search: ties to the even code (the one whose lowest
// bit is clear), values beyond 448 to 448, NaN to NaN.
uint8_t NearestE4M3(float f) {
  if (std::isnan(f)) return std::signbit(f) ? 0xFF : 0x7F;
  const float a = std::fmin(std::fabs(f), 448.0f);
  int best = 0;
  double best_gap = 1e30;
  for (int q = 0; q < 0x7F; ++q) {  // 0x7F is NaN
    const double gap = std::fabs(double(E4M3ToFloat(uint8_t(q))) - a);
    if (gap < best_gap || (gap == best_gap && (q & 1) == 0)) best = q, best_gap = gap;
  }
  return uint8_t(best | (std::signbit(f) ? 0x80 : 0));
}

TEST(Fp8Test, ConversionIsRoundToNearestEvenSaturatedAndRoundTrips) {
  for (int q = 0; q < 256; ++q) {  // every code decodes and encodes back (NaN to a NaN code)
    if ((q & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(E4M3ToFloat(uint8_t(q))));
      continue;
    }
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(uint8_t(q))), q) << q;
  }
  EXPECT_EQ(E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int i = 0; i < 200000; ++i) {
    const float f = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(exponent(rng));
    ASSERT_EQ(FloatToE4M3(f), NearestE4M3(f)) << f;
  }
  // Midpoints between neighbouring codes go to the even one.
  for (int q = 0; q + 1 < 0x7F; ++q) {
    const float mid = (E4M3ToFloat(uint8_t(q)) + E4M3ToFloat(uint8_t(q + 1))) / 2;
    EXPECT_EQ(FloatToE4M3(mid), (q & 1) ? q + 1 : q) << mid;
  }
  EXPECT_EQ(FloatToE4M3(1e9f), 0x7E);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xFE);
  EXPECT_EQ(FloatToE4M3(NAN) & 0x7F, 0x7F);
}

void ExpectRanksOk(const std::vector<RankExit>& exits) {
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_TRUE(exits[r].ok()) << "rank " << r << ": exit " << exits[r].exit_code;
  }
}

// The combine half of a round whose result the test does not check (zero rows back), then the
// ranks meet before they leave.
Status CombineZerosAndMeet(AllToAll& a2a, int64_t expert_rows, int64_t tokens, int hidden,
                           Bootstrap& b) {
  std::vector<uint16_t> expert_out(size_t(expert_rows) * hidden, 0), y(size_t(tokens) * hidden);
  RETURN_IF_ERROR(a2a.CombineSend(expert_out.data()));
  RETURN_IF_ERROR(a2a.CombineRecv(y.data(), false, Deadline::After(30s)));
  return b.Barrier(30s);
}

std::vector<uint16_t> RandomRows(int rows, int hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(size_t(rows) * hidden);
  for (size_t i = 0; i < x.size(); ++i) {
    // Groups of very different magnitudes, and an all-zero group in row 0.
    const int group = int(i % hidden) / 128;
    x[i] = FloatToBf16(i < 128 ? 0.0f : normal(rng) * std::exp2(float(group * 5 - 6)));
  }
  return x;
}

TEST(Fp8Test, GroupScalesFollowTheirRuleAndBoundTheError) {
  const int rows = 5, hidden = 512;
  const std::vector<uint16_t> x = RandomRows(rows, hidden, 3);
  for (Fp8Scaling scaling : {Fp8Scaling::kAmax, Fp8Scaling::kPowerOfTwo}) {
    std::vector<uint8_t> q(x.size());
    std::vector<float> s(size_t(rows) * hidden / 128);
    QuantizeFp8Rows(x.data(), rows, hidden, scaling, q.data(), s.data());
    for (int r = 0; r < rows; ++r) {
      for (int g = 0; g < hidden / 128; ++g) {
        float amax = 0;
        for (int i = 0; i < 128; ++i) {
          amax = std::fmax(amax, std::fabs(Bf16ToFloat(x[size_t(r) * hidden + g * 128 + i])));
        }
        const float scale = s[size_t(r) * hidden / 128 + g], floor = std::fmax(amax, 1e-4f) / 448;
        if (scaling == Fp8Scaling::kAmax) {
          EXPECT_EQ(scale, floor);
        } else {  // the smallest power of two at or above amax / 448
          int e;
          EXPECT_EQ(std::frexp(scale, &e), 0.5f) << scale;
          EXPECT_GE(scale, floor);
          EXPECT_LT(scale / 2, floor);
        }
        for (int i = 0; i < 128; ++i) {
          const size_t at = size_t(r) * hidden + g * 128 + i;
          const float v = Bf16ToFloat(x[at]), back = E4M3ToFloat(q[at]) * scale;
          // Half a step of e4m3's 3-bit mantissa, or of its subnormal spacing.
          EXPECT_LE(std::fabs(back - v), std::fmax(std::fabs(v) / 16, scale * 0x1p-10f))
              << r << " " << g << " " << i;
          EXPECT_EQ(q[at], FloatToE4M3(v / scale));
        }
      }
    }
  }
}

// Two ranks of an fp8 AllToAll: each sends bf16 rows through x_bf16 (rank 1 with power-of-two
// scales); every row a rank receives is the quantised sender row, bit for bit, with its scales.
TEST(Fp8Test, DispatchQuantisesBf16RowsAsItSends) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const int tokens = 9, hidden = 256, experts = 4, k = 2, spt = hidden / 128;
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = experts,
                       .experts_per_token = k, .max_tokens_per_rank = 16, .hidden = hidden,
                       .dtype = DispatchDtype::kFp8E4M3, .max_private_tokens = 4};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    const auto scaling_of = [](int rank) {
      return rank == 1 ? Fp8Scaling::kPowerOfTwo : Fp8Scaling::kAmax;
    };
    // Token t of rank s goes to experts (t + s) % 4 and, unless t is 0 mod 3, (t + s + 1) % 4.
    const auto route = [&](int s) {
      std::vector<int32_t> idx(size_t(tokens) * k);
      for (int t = 0; t < tokens; ++t) {
        idx[t * k] = (t + s) % experts;
        idx[t * k + 1] = t % 3 == 0 ? -1 : (t + s + 1) % experts;
      }
      return idx;
    };
    const std::vector<uint16_t> x = RandomRows(tokens, hidden, 11 + b.rank());
    const std::vector<int32_t> idx = route(b.rank());
    const std::vector<float> w(idx.size(), 0.5f);
    DispatchInput in{nullptr, nullptr, idx.data(), w.data(), tokens};
    in.x_bf16 = x.data();
    in.scaling = scaling_of(b.rank());
    // Both forms at once, and x_bf16 on a bf16 AllToAll, are refused.
    DispatchInput both = in;
    std::vector<uint8_t> fp8(x.size());
    both.x = fp8.data();
    Status s = a2a->DispatchSend(both);
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument, "x and x_bf16: " + s.ToString());
    RETURN_IF_ERROR(a2a->DispatchSend(in));
    const int local = cfg.local_experts();
    const int64_t capacity = cfg.expert_capacity();
    std::vector<uint8_t> out(size_t(local) * capacity * hidden);
    std::vector<float> scales(size_t(local) * capacity * spt);
    std::vector<int32_t> counts(local);
    DispatchOutput o{out.data(), scales.data(), counts.data()};
    RETURN_IF_ERROR(a2a->DispatchRecv(o, Deadline::After(30s)));
    for (int e = 0; e < local; ++e) {
      // What expert e must hold: each sender's quantised rows routed to it.
      std::vector<std::vector<uint8_t>> want, got;
      for (int src = 0; src < 2; ++src) {
        const std::vector<uint16_t> sx = RandomRows(tokens, hidden, 11 + src);
        std::vector<uint8_t> q(sx.size());
        std::vector<float> qs(size_t(tokens) * spt);
        QuantizeFp8Rows(sx.data(), tokens, hidden, scaling_of(src), q.data(), qs.data());
        const std::vector<int32_t> sidx = route(src);
        for (int t = 0; t < tokens; ++t) {
          for (int j = 0; j < k; ++j) {
            if (sidx[t * k + j] != b.rank() * local + e) continue;
            std::vector<uint8_t> row(q.begin() + t * hidden, q.begin() + (t + 1) * hidden);
            const auto* sb = reinterpret_cast<const uint8_t*>(&qs[size_t(t) * spt]);
            row.insert(row.end(), sb, sb + spt * 4);
            want.push_back(row);
          }
        }
      }
      for (int i = 0; i < counts[e]; ++i) {
        const size_t r = size_t(e) * capacity + i;
        std::vector<uint8_t> row(out.begin() + r * hidden, out.begin() + (r + 1) * hidden);
        const auto* sb = reinterpret_cast<const uint8_t*>(&scales[r * spt]);
        row.insert(row.end(), sb, sb + spt * 4);
        got.push_back(row);
      }
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      CHECK_OR_RETURN(got == want, "expert " + std::to_string(e) + ": " +
                                       std::to_string(got.size()) + " rows, " +
                                       std::to_string(want.size()) + " expected, or other bytes");
    }
    return CombineZerosAndMeet(*a2a, local * capacity, tokens, hidden, b);
  }, 120s);
  ExpectRanksOk(exits);
}

// Three ranks, expert padding 4: rows of each local expert back to back from the base the
// padded counts give, each row tagged with its (sender, token) in its first two columns; the
// padding rows keep the fill they had; experts that return twice their rows combine into
// each token times twice its weights' sum.
TEST(ExpertPaddingTest, BlocksBackToBackAndTheCombineReadsThem) {
  auto exits = RunLocalRanks(3, [](Bootstrap& b) -> Status {
    const int world = 3, tokens = 7, hidden = 128, experts = 6, k = 3, pad = 4;
    AllToAllConfig cfg{.world_size = world, .rank = b.rank(), .num_experts = experts,
                       .experts_per_token = k, .max_tokens_per_rank = 8, .hidden = hidden,
                       .dtype = DispatchDtype::kBf16, .max_private_tokens = 2};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    // Rank s's token t: experts (t + s + j) % 6 for j < 3, the last -1 for odd t; rank 2 none.
    const auto count = [&](int s) { return s == 2 ? 0 : tokens; };
    const auto route = [&](int s) {
      std::vector<int32_t> idx(size_t(count(s)) * k);
      for (int t = 0; t < count(s); ++t) {
        for (int j = 0; j < k; ++j) idx[t * k + j] = (t + s + j) % experts;
        if (t % 2) idx[t * k + k - 1] = -1;
      }
      return idx;
    };
    const auto row_of = [&](int s, int t) {
      std::vector<uint16_t> r(hidden, FloatToBf16(0.5f));
      r[0] = FloatToBf16(float(s));
      r[1] = FloatToBf16(float(t));
      return r;
    };
    std::vector<uint16_t> x;
    for (int t = 0; t < count(b.rank()); ++t) {
      const auto r = row_of(b.rank(), t);
      x.insert(x.end(), r.begin(), r.end());
    }
    const std::vector<int32_t> idx = route(b.rank());
    const std::vector<float> w(idx.size(), 0.25f);
    const int local = cfg.local_experts();
    const int64_t rows = cfg.padded_rows(pad);
    std::vector<uint16_t> out(size_t(rows) * hidden, 0xABCD);
    std::vector<int32_t> counts(local);
    for (int it = 0; it < 2; ++it) {
      RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(),
                                         count(b.rank())}));
      DispatchOutput o{out.data(), nullptr, counts.data()};
      o.expert_padding = pad;
      RETURN_IF_ERROR(a2a->DispatchRecv(o, Deadline::After(30s)));
      int64_t base = 0;
      std::vector<uint16_t> expert_out(out.size(), 0);
      for (int e = 0; e < local; ++e) {
        std::vector<std::pair<int, int>> want, got;
        for (int s = 0; s < world; ++s) {
          const auto sidx = route(s);
          for (int t = 0; t < count(s); ++t) {
            for (int j = 0; j < k; ++j) {
              if (sidx[t * k + j] == b.rank() * local + e) want.push_back({s, t});
            }
          }
        }
        CHECK_OR_RETURN(counts[e] == int(want.size()),
                        "expert " + std::to_string(e) + ": " + std::to_string(counts[e]) +
                            " rows, expected " + std::to_string(want.size()));
        for (int i = 0; i < counts[e]; ++i) {
          const uint16_t* r = out.data() + (base + i) * hidden;
          got.push_back({int(Bf16ToFloat(r[0])), int(Bf16ToFloat(r[1]))});
          for (int c = 0; c < hidden; ++c) {
            expert_out[(base + i) * hidden + c] = FloatToBf16(2 * Bf16ToFloat(r[c]));
          }
        }
        std::sort(want.begin(), want.end());
        std::sort(got.begin(), got.end());
        CHECK_OR_RETURN(got == want, "expert " + std::to_string(e) + ": other rows");
        const int64_t end = base + (counts[e] + pad - 1) / pad * pad;
        for (int64_t i = base + counts[e]; i < end; ++i) {
          CHECK_OR_RETURN(out[i * hidden] == 0xABCD, "padding row " + std::to_string(i) +
                                                         " written");
        }
        base = end;
      }
      RETURN_IF_ERROR(a2a->CombineSend(expert_out.data()));
      std::vector<uint16_t> y(x.size());
      RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, Deadline::After(30s)));
      for (int t = 0; t < count(b.rank()); ++t) {
        int copies = 0;
        for (int j = 0; j < k; ++j) copies += idx[t * k + j] >= 0;
        const auto r = row_of(b.rank(), t);
        for (int c = 0; c < hidden; ++c) {
          const float want = 2 * Bf16ToFloat(r[c]) * 0.25f * copies;
          CHECK_OR_RETURN(Bf16ToFloat(y[size_t(t) * hidden + c]) == want,
                          "token " + std::to_string(t) + " column " + std::to_string(c));
        }
      }
    }
    // Padding is for the expert-major layout; a negative one is refused, the step retried.
    RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(),
                                       count(b.rank())}));
    DispatchOutput bad{out.data(), nullptr, counts.data()};
    bad.expert_padding = -1;
    const Status s = a2a->DispatchRecv(bad, Deadline::After(30s));
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument, "padding -1: " + s.ToString());
    RETURN_IF_ERROR(a2a->DispatchRecv({out.data(), nullptr, counts.data()},
                                      Deadline::After(30s)));
    return CombineZerosAndMeet(*a2a, local * cfg.expert_capacity(), count(b.rank()), hidden, b);
  }, 120s);
  ExpectRanksOk(exits);
}

// Two ranks, fixed expert blocks of 7 rows (DispatchOutput::expert_rows; the capacity is 16):
// expert e's rows from row e * 7, the rows past its count keeping their fill, the combine
// reading the same layout; then the layouts a block cannot go with refused.
TEST(ExpertRowsTest, FixedBlocksAndTheCombineReadsThem) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const int world = 2, tokens = 5, hidden = 128, experts = 4, k = 2, block = 7;
    AllToAllConfig cfg{.world_size = world, .rank = b.rank(), .num_experts = experts,
                       .experts_per_token = k, .max_tokens_per_rank = 8, .hidden = hidden,
                       .dtype = DispatchDtype::kBf16, .max_private_tokens = 2};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    // Rank s's token t: experts (t + s + j) % 4 for j < 2; rows tagged (sender, token).
    const auto route = [&](int s) {
      std::vector<int32_t> idx(size_t(tokens) * k);
      for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < k; ++j) idx[t * k + j] = (t + s + j) % experts;
      }
      return idx;
    };
    std::vector<uint16_t> x;
    for (int t = 0; t < tokens; ++t) {
      std::vector<uint16_t> r(hidden, FloatToBf16(0.5f));
      r[0] = FloatToBf16(float(b.rank()));
      r[1] = FloatToBf16(float(t));
      x.insert(x.end(), r.begin(), r.end());
    }
    const std::vector<int32_t> idx = route(b.rank());
    const std::vector<float> w(idx.size(), 0.25f);
    const int local = cfg.local_experts();
    CHECK_OR_RETURN(cfg.output_rows(0, block) == int64_t{local} * block, "output_rows");
    std::vector<uint16_t> out(size_t(local) * block * hidden, 0xABCD);
    std::vector<int32_t> counts(local);
    RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), tokens}));
    DispatchOutput o{out.data(), nullptr, counts.data()};
    o.expert_rows = block;
    RETURN_IF_ERROR(a2a->DispatchRecv(o, Deadline::After(30s)));
    std::vector<uint16_t> expert_out(out.size(), 0);
    for (int e = 0; e < local; ++e) {
      std::vector<std::pair<int, int>> want, got;
      for (int s = 0; s < world; ++s) {
        const auto sidx = route(s);
        for (int t = 0; t < tokens; ++t) {
          for (int j = 0; j < k; ++j) {
            if (sidx[t * k + j] == b.rank() * local + e) want.push_back({s, t});
          }
        }
      }
      CHECK_OR_RETURN(counts[e] == int(want.size()), "expert " + std::to_string(e) + ": " +
                                                         std::to_string(counts[e]) + " rows");
      for (int64_t i = 0; i < block; ++i) {
        const uint16_t* r = out.data() + (int64_t{e} * block + i) * hidden;
        if (i >= counts[e]) {
          CHECK_OR_RETURN(r[0] == 0xABCD, "row " + std::to_string(i) + " of expert " +
                                              std::to_string(e) + " past its count written");
          continue;
        }
        got.push_back({int(Bf16ToFloat(r[0])), int(Bf16ToFloat(r[1]))});
        for (int c = 0; c < hidden; ++c) {
          expert_out[(int64_t{e} * block + i) * hidden + c] = FloatToBf16(2 * Bf16ToFloat(r[c]));
        }
      }
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      CHECK_OR_RETURN(got == want, "expert " + std::to_string(e) + ": other rows");
    }
    RETURN_IF_ERROR(a2a->CombineSend(expert_out.data()));
    std::vector<uint16_t> y(x.size());
    RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, Deadline::After(30s)));
    for (int t = 0; t < tokens; ++t) {
      for (int c = 0; c < hidden; ++c) {
        const float want = 2 * Bf16ToFloat(x[size_t(t) * hidden + c]) * 0.25f * k;
        CHECK_OR_RETURN(Bf16ToFloat(y[size_t(t) * hidden + c]) == want,
                        "token " + std::to_string(t) + " column " + std::to_string(c));
      }
    }
    // A block is for the unpadded expert-major layout; a negative one is refused.
    RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), tokens}));
    for (const auto& [rows, pad] : {std::pair{int64_t{-1}, 0}, std::pair{int64_t{block}, 2}}) {
      DispatchOutput bad{out.data(), nullptr, counts.data()};
      bad.expert_rows = rows;
      bad.expert_padding = pad;
      const Status s = a2a->DispatchRecv(bad, Deadline::After(30s));
      CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument &&
                          s.ToString().find("expert_rows") != std::string::npos,
                      "expert_rows " + std::to_string(rows) + ": " + s.ToString());
    }
    RETURN_IF_ERROR(a2a->DispatchRecv(o, Deadline::After(30s)));
    return CombineZerosAndMeet(*a2a, int64_t{local} * block, tokens, hidden, b);
  }, 120s);
  ExpectRanksOk(exits);
}

// A block smaller than what one expert receives: three copies for a block of two fail the
// dispatch with ResourceExhausted naming the expert, nothing written, and the AllToAll with it.
TEST(ExpertRowsTest, AnExpertSentMoreThanItsBlockFailsTheStep) {
  auto exits = RunLocalRanks(1, [](Bootstrap& b) -> Status {
    const int hidden = 128;
    AllToAllConfig cfg{.world_size = 1, .rank = 0, .num_experts = 2, .experts_per_token = 1,
                       .max_tokens_per_rank = 4, .hidden = hidden, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 4};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    std::vector<uint16_t> x(size_t(4) * hidden, FloatToBf16(1.0f));
    std::vector<uint16_t> out(size_t(2) * 2 * hidden, 0xABCD);  // two blocks of two rows
    const std::vector<int32_t> idx = {0, 1, 0, 0};  // expert 0 three times of four tokens
    const std::vector<float> w(4, 1.0f);
    std::vector<int32_t> counts(2, -7);
    RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 4}));
    DispatchOutput o{out.data(), nullptr, counts.data()};
    o.expert_rows = 2;
    const Status s = a2a->DispatchRecv(o, Deadline::After(30s));
    CHECK_OR_RETURN(s.code() == StatusCode::kResourceExhausted &&
                        s.ToString().find("local expert 0 received 3 copies") != std::string::npos,
                    "overflow: " + s.ToString());
    CHECK_OR_RETURN(std::all_of(out.begin(), out.end(), [](uint16_t v) { return v == 0xABCD; }),
                    "rows written");
    const Status next = a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 4});
    CHECK_OR_RETURN(next.code() == StatusCode::kResourceExhausted, "next step: " + next.ToString());
    return Status::Ok();
  }, 60s);
  EXPECT_TRUE(exits[0].ok());
}

TEST(Fp8Test, Bf16ConfigurationRefusesRowsToQuantise) {
  auto exits = RunLocalRanks(1, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 1, .rank = 0, .num_experts = 2, .experts_per_token = 1,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 4};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    std::vector<uint16_t> x(128);
    std::vector<int32_t> idx = {0};
    std::vector<float> w = {1.0f};
    DispatchInput in{nullptr, nullptr, idx.data(), w.data(), 1};
    in.x_bf16 = x.data();
    const Status s = a2a->DispatchSend(in);
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument && s.ToString().find("x_bf16") !=
                                                                     std::string::npos,
                    "x_bf16 on bf16: " + s.ToString());
    return Status::Ok();
  }, 60s);
  EXPECT_TRUE(exits[0].ok());
}

}  // namespace
}  // namespace ferry
