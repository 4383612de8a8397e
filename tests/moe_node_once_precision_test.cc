// Node-once forwarding's precision (AllToAllConfig::partial_sums): the same epochs through a
// node-once AllToAll of each form and a per-rank one, ranks as processes over shm (EP4 as two
// nodes of two), every combined element measured against a float64 sum of the same bf16 expert
// outputs, in halves of a bf16 unit in the last place of that sum.
//   - kFp32 and per rank round once: within half a unit (and the fp32 additions' own error);
//   - kCombineElement rounds at the forwarder and again at the origin: beyond half a unit on
//     some elements (it is not the same arithmetic), which the test requires so that the
//     comparison above could fail.
// Each rank prints the three forms' largest and mean errors: the figures docs/PERFORMANCE.md
// quotes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/numerics.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

constexpr int kWorld = 4, kPerNode = 2, kTokens = 24, kHidden = 256, kExperts = 16, kK = 6;
constexpr int kLocal = kExperts / kWorld;
constexpr int kEpochs = 2;

// Half a bf16 unit in the last place of x (x normal: 8 significant bits).
double HalfUlp(double x) {
  int e = 0;
  std::frexp(std::max(std::abs(x), 1e-30), &e);  // |x| = f 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - 1 - 7) / 2;
}

struct Errors {
  double max = 0, sum = 0;  // in half units in the last place
  int64_t n = 0;
  void Add(double halves) {
    max = std::max(max, halves);
    sum += halves;
    ++n;
  }
  double mean() const { return n ? sum / double(n) : 0; }
};

// Rank s's inputs of an epoch: random bf16 rows (either sign), kK distinct experts per token
// spread over both nodes, positive weights (a softmax's).
struct Inputs {
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
};
Inputs InputsOf(int s, int epoch) {
  std::mt19937 rng(1000 * epoch + s);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f), weight(0.05f, 1.0f);
  Inputs in{std::vector<uint16_t>(size_t(kTokens) * kHidden), {}, {}};
  for (uint16_t& v : in.x) v = FloatToBf16(value(rng));
  for (int t = 0; t < kTokens; ++t) {
    std::vector<int32_t> experts(kExperts);
    for (int e = 0; e < kExperts; ++e) experts[size_t(e)] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < kK; ++j) {
      in.ids.push_back(experts[size_t(j)]);
      in.w.push_back(weight(rng));
    }
  }
  return in;
}

// One epoch of `a2a` with the experts as the identity; the combined output's errors against
// float64 added to `errors`.
Status Epoch(AllToAll& a2a, int me, int epoch, Errors* errors) {
  const Inputs in = InputsOf(me, epoch);
  RETURN_IF_ERROR(a2a.DispatchSend({in.x.data(), nullptr, in.ids.data(), in.w.data(), kTokens}));
  const AllToAllConfig& c = a2a.config();
  std::vector<uint16_t> out_x(size_t(kLocal) * c.expert_capacity() * kHidden);
  std::vector<int32_t> counts(kLocal);
  RETURN_IF_ERROR(
      a2a.DispatchRecv({out_x.data(), nullptr, counts.data()}, Deadline::After(30s)));
  RETURN_IF_ERROR(a2a.CombineSend(out_x.data()));
  std::vector<uint16_t> y(size_t(kTokens) * kHidden);
  RETURN_IF_ERROR(a2a.CombineRecv(CombineOutput{.out = y.data()}, Deadline::After(30s)));
  for (int t = 0; t < kTokens; ++t) {
    for (int col = 0; col < kHidden; ++col) {
      double ref = 0, size = 0;
      for (int j = 0; j < kK; ++j) {
        const double term = double(in.w[size_t(t) * kK + j]) *
                            Bf16ToFloat(in.x[size_t(t) * kHidden + col]);
        ref += term;
        size += std::abs(term);
      }
      // The fp32 additions' own error (a few of 2^-24 of the terms' size) widens the half unit
      // a single rounding may add.
      const double slack = 1e-6 * size;
      const double got = Bf16ToFloat(y[size_t(t) * kHidden + col]);
      errors->Add(std::max(0.0, std::abs(got - ref) - slack) / HalfUlp(std::abs(ref) + slack));
    }
  }
  return Status::Ok();
}

TEST(MoeNodeOncePrecisionTest, Fp32PartialSumsRoundOnceAsPerRankDoes) {
  auto exits = testing_util::RunRanks(kWorld, [](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    const AllToAllConfig base{.world_size = kWorld, .rank = b.rank(),
                              .ranks_per_node = kPerNode, .num_experts = kExperts,
                              .experts_per_token = kK, .max_tokens_per_rank = kTokens,
                              .hidden = kHidden};
    struct Form {
      const char* name;
      Forwarding forwarding;
      PartialSums sums;
      int instance;
    };
    const Form forms[] = {{"per rank", Forwarding::kPerRank, PartialSums::kCombineElement, 0},
                          {"node-once, fp32 partial sums", Forwarding::kNodeOnce,
                           PartialSums::kFp32, 1},
                          {"node-once, combine-element partial sums", Forwarding::kNodeOnce,
                           PartialSums::kCombineElement, 4}};
    Errors errors[3];
    for (int f = 0; f < 3; ++f) {
      AllToAllConfig c = base;
      c.forwarding = forms[f].forwarding;
      c.partial_sums = forms[f].sums;
      c.instance = forms[f].instance;
      ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(c, engine.get(), b));
      for (int epoch = 0; epoch < kEpochs; ++epoch) {
        RETURN_IF_ERROR(Epoch(*a2a, b.rank(), epoch, &errors[f]));
      }
      std::printf("[rank %d] %s: largest error %.3f, mean %.3f half-units (bf16) over %lld\n",
                  b.rank(), forms[f].name, errors[f].max, errors[f].mean(),
                  static_cast<long long>(errors[f].n));
    }
    for (int f = 0; f < 2; ++f) {
      CHECK_OR_RETURN(errors[f].max <= 1.0 + 1e-9,
                      std::string(forms[f].name) + ": an error of " +
                          std::to_string(errors[f].max) + " half-units, beyond one rounding");
    }
    CHECK_OR_RETURN(errors[2].max > 1.0, std::string(forms[2].name) +
                                             ": no error beyond one rounding (largest " +
                                             std::to_string(errors[2].max) + ")");
    return b.Barrier(30s);
  }, 180s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry
