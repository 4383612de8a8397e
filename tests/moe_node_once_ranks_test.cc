// Node-once forwarding (Forwarding::kNodeOnce) with ranks as processes over shm, beyond the
// cases moe_host_test runs it through: what it refuses, a rank killed, and rank masks, whose
// meaning under node-once is that a masked rank's experts and the routes it forwards are out.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/numerics.h"
#include "moe_node_once_cases.h"

namespace ferry {
namespace {

using namespace node_once_cases;

// Masks set by hand between epochs: ranks 0, 1 and 2 mask rank 3, and rank 3 masks them all.
// From the next dispatch rank 3 keeps its own tokens only; the others lose rank 3's experts and
// the route it forwarded (rank 1's tokens into node 1, rank 2's experts included); no step waits
// for a masked rank, and nothing more crosses to or from rank 3. Masked() names rank 3 (the
// others, on rank 3). The configuration leaves forwarding to its default (kAuto), which for
// two nodes of two takes node-once: the routes lost to a mask are node-once's.
TEST(MoeNodeOnceTest, AMaskedRankTakesItsExpertsAndTheRouteItForwardsOut) {
  auto exits = testing_util::RunRanks(kWorld, [](Bootstrap& b) -> Status {
    const int me = b.rank();
    AllToAllConfig c{.world_size = kWorld, .rank = me, .ranks_per_node = kPerNode,
                     .num_experts = kExperts, .experts_per_token = kK,
                     .max_tokens_per_rank = kTokens, .hidden = kHidden};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(c, engine.get(), b));
    CHECK_OR_RETURN(c.forwarding == Forwarding::kAuto &&
                        a2a->config().forwarding == Forwarding::kNodeOnce,
                    "the default forwarding for two nodes of two: not node-once");
    const std::vector<bool> none(kWorld, false);
    RETURN_IF_ERROR(Epoch(*a2a, me, 0, none));
    std::vector<bool> masked(kWorld, false);
    for (int r = 0; r < kWorld; ++r) {
      if (r == me || (me != 3 && r != 3)) continue;
      RETURN_IF_ERROR(a2a->SetMasked(r, true));
      masked[size_t(r)] = true;
    }
    ASSIGN_OR_RETURN(auto reported, a2a->Masked());
    for (int r = 0; r < kWorld; ++r) {
      CHECK_OR_RETURN(bool(reported[size_t(r)]) == masked[size_t(r)],
                      "Masked()[" + std::to_string(r) + "] on rank " + std::to_string(me));
    }
    RETURN_IF_ERROR(b.Barrier(30s));  // every rank's epoch-0 writes posted
    const uint64_t submitted = engine->stats().transfers_submitted;
    for (int epoch = 1; epoch < 3; ++epoch) {
      const auto start = Clock::now();
      RETURN_IF_ERROR(Epoch(*a2a, me, epoch, masked));
      CHECK_OR_RETURN(Clock::now() - start < 2s, "a step waited for a masked rank");
    }
    RETURN_IF_ERROR(b.Barrier(30s));
    if (me == 3) {
      CHECK_OR_RETURN(engine->stats().transfers_submitted == submitted,
                      "rank 3 wrote to the ranks it masked");
    }
    return Status::Ok();
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Combine weights given at CombineRecv under node-once forwarding cross to the forwarders (the
// weights rail) before the node sums with them: epochs with weights at the combine, at the
// dispatch, then at the combine again, with 64-bit ids, each token's sum exact. The epochs'
// wait costs charge only ranks waited for directly: our node's and, on our rail, the other
// nodes'.
TEST(MoeNodeOnceTest, WeightsAtTheCombineCrossToTheForwarders) {
  auto exits = testing_util::RunRanks(4, [](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    AllToAllConfig c{.world_size = 4, .rank = b.rank(), .ranks_per_node = 2, .num_experts = 8,
                     .experts_per_token = 2, .max_tokens_per_rank = 4, .hidden = 128,
                     .forwarding = Forwarding::kNodeOnce};
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(c, engine.get(), b));
    const std::vector<uint16_t> x(4 * 128, FloatToBf16(1.0f));
    // Token t's experts: one in each node, or (t = 3) both in the other node's first rank.
    const std::vector<int64_t> ids = {0, 7, 2, 5, 4, 3, (b.rank() + 2) % 4 * 2,
                                      (b.rank() + 2) % 4 * 2 + 1};
    const std::vector<float> half(8, 0.5f);
    // At the combine: token t's weights 0.25 and 0.125 * (t + 1) -- each row 1, so each token's
    // sum is their sum, exact in bf16.
    std::vector<float> late(8);
    for (int t = 0; t < 4; ++t) late[2 * t] = 0.25f, late[2 * t + 1] = 0.125f * (t + 1);
    std::vector<uint16_t> out_x(size_t(c.local_experts() * c.expert_capacity() * 128));
    std::vector<int32_t> counts(size_t(c.local_experts()));
    std::vector<int64_t> dispatch_cost(4, 0), combine_cost(4, 0);
    for (int epoch = 0; epoch < 3; ++epoch) {
      const bool at_combine = epoch != 1;
      RETURN_IF_ERROR(a2a->DispatchSend({.x = x.data(), .weights = half.data(), .num_tokens = 4,
                                         .indices64 = ids.data()}));
      RETURN_IF_ERROR(a2a->DispatchRecv({.x = out_x.data(),
                                         .num_tokens = counts.data(),
                                         .wait_cost = dispatch_cost.data()},
                                        Deadline::After(30s)));
      RETURN_IF_ERROR(a2a->CombineSend(out_x.data()));
      std::vector<uint16_t> y(4 * 128);
      RETURN_IF_ERROR(a2a->CombineRecv(CombineOutput{.out = y.data(),
                                                     .weights = at_combine ? late.data() : nullptr,
                                                     .wait_cost = combine_cost.data()},
                                       Deadline::After(30s)));
      for (int t = 0; t < 4; ++t) {
        const float want = at_combine ? late[2 * t] + late[2 * t + 1] : 1.0f;
        for (int col = 0; col < 128; ++col) {
          const uint16_t v = y[size_t(t) * 128 + col];
          CHECK_OR_RETURN(v == FloatToBf16(want),
                          "epoch " + std::to_string(epoch) + ", token " + std::to_string(t) +
                              ": " + std::to_string(Bf16ToFloat(v)) + ", want " +
                              std::to_string(want));
        }
      }
    }
    const int other = 3 - b.rank();  // of the other node, on the other rail
    for (int r = 0; r < 4; ++r) {
      CHECK_OR_RETURN(dispatch_cost[size_t(r)] >= 0 && combine_cost[size_t(r)] >= 0,
                      "a negative wait cost");
    }
    CHECK_OR_RETURN(dispatch_cost[size_t(other)] == 0 && combine_cost[size_t(other)] == 0,
                    "rank " + std::to_string(other) + " charged a wait on rank " +
                        std::to_string(b.rank()));
    return b.Barrier(30s);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// bf16 rows given to an fp8 node-once AllToAll (DispatchInput::x_bf16) go to the rail as they
// came and are quantised there: every output, dispatched rows, scales and combined sums, equals
// a node-once AllToAll's given those rows quantised by the caller (power-of-two scales).
TEST(MoeNodeOnceTest, Bf16RowsAreQuantisedOnTheRailAsACallerWould) {
  auto exits = testing_util::RunRanks(kWorld, [](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    AllToAllConfig c{.world_size = kWorld, .rank = b.rank(), .ranks_per_node = kPerNode,
                     .num_experts = kExperts, .experts_per_token = kK,
                     .max_tokens_per_rank = kTokens, .hidden = kHidden,
                     .dtype = DispatchDtype::kFp8E4M3, .forwarding = Forwarding::kNodeOnce};
    AllToAllConfig d = c;
    d.instance = 3;  // node-once takes three instances
    ASSIGN_OR_RETURN(auto given_bf16, AllToAll::Create(c, engine.get(), b));
    ASSIGN_OR_RETURN(auto given_fp8, AllToAll::Create(d, engine.get(), b));
    std::vector<uint16_t> x(size_t(kTokens) * kHidden);
    std::vector<int32_t> ids(size_t(kTokens) * kK);
    std::vector<float> w(ids.size());
    for (int t = 0; t < kTokens; ++t) {
      for (int col = 0; col < kHidden; ++col) {
        x[size_t(t) * kHidden + col] = FloatToBf16((col % 7 - 3) * 0.37f * Value(b.rank(), t, 0));
      }
      for (int j = 0; j < kK; ++j) {
        ids[size_t(t) * kK + j] = Expert(b.rank(), t, j);
        w[size_t(t) * kK + j] = Weight(j);
      }
    }
    const DispatchInput bf16{.indices = ids.data(), .weights = w.data(), .num_tokens = kTokens,
                             .x_bf16 = x.data(), .scaling = Fp8Scaling::kPowerOfTwo};
    moe::HostFp8Rows quantiser;
    DispatchInput quantised = bf16;
    quantised.x_bf16 = nullptr;
    quantiser.Quantize(c, bf16, &quantised.x, &quantised.scales);
    const DispatchInput& fp8 = quantised;
    struct Outputs {
      std::vector<uint8_t> x = std::vector<uint8_t>(size_t(kLocal * kCapacity * kHidden));
      std::vector<float> scales = std::vector<float>(size_t(kLocal * kCapacity * kHidden / 128));
      std::vector<int32_t> counts = std::vector<int32_t>(size_t(kLocal));
      std::vector<uint16_t> y = std::vector<uint16_t>(size_t(kTokens) * kHidden);
    } a, e;
    for (auto [a2a, in, out] : {std::tuple{given_bf16.get(), &bf16, &a},
                                std::tuple{given_fp8.get(), &fp8, &e}}) {
      RETURN_IF_ERROR(a2a->DispatchSend(*in));
      RETURN_IF_ERROR(a2a->DispatchRecv(
          {.x = out->x.data(), .scales = out->scales.data(), .num_tokens = out->counts.data()},
          Deadline::After(30s)));
      // Each expert returns its rows dequantised (exact in bf16: e4m3 times a power of two).
      std::vector<uint16_t> expert_out(size_t(kLocal * kCapacity * kHidden), 0);
      for (int l = 0; l < kLocal; ++l) {
        for (int i = 0; i < out->counts[size_t(l)]; ++i) {
          const int64_t row = l * kCapacity + i;
          for (int col = 0; col < kHidden; ++col) {
            expert_out[size_t(row * kHidden + col)] = FloatToBf16(
                E4M3ToFloat(out->x[size_t(row * kHidden + col)]) *
                out->scales[size_t(row * (kHidden / 128) + col / 128)]);
          }
        }
      }
      RETURN_IF_ERROR(a2a->CombineSend(expert_out.data()));
      RETURN_IF_ERROR(a2a->CombineRecv(out->y.data(), false, Deadline::After(30s)));
    }
    CHECK_OR_RETURN(a.counts == e.counts, "copies per expert differ");
    for (int l = 0; l < kLocal; ++l) {
      const size_t first = size_t(l * kCapacity), rows = size_t(a.counts[size_t(l)]);
      CHECK_OR_RETURN(rows > 0, "expert " + std::to_string(l) + " received nothing");
      CHECK_OR_RETURN(std::equal(a.x.begin() + first * kHidden,
                                 a.x.begin() + (first + rows) * kHidden,
                                 e.x.begin() + first * kHidden),
                      "expert " + std::to_string(l) + ": rows differ");
      CHECK_OR_RETURN(std::equal(a.scales.begin() + first, a.scales.begin() + first + rows,
                                 e.scales.begin() + first),
                      "expert " + std::to_string(l) + ": scales differ");
    }
    CHECK_OR_RETURN(a.y == e.y, "combined sums differ");
    CHECK_OR_RETURN(std::any_of(a.y.begin(), a.y.end(), [](uint16_t v) { return v != 0; }),
                    "nothing combined");
    return b.Barrier(30s);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Node-once forwarding with a rank killed before its dispatch (EP4 as two nodes of two): every
// survivor's epoch fails within the step's deadline -- the rank's rail peer waits for its
// section, its node peer for what it would have forwarded, and the rest for the survivors that
// could not forward -- and teardown does not hang.
TEST(MoeNodeOnceTest, ADeadRankEndsEverySurvivorsEpochAtItsDeadline) {
  auto exits = testing_util::RunRanks(4, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 4, .rank = b.rank(), .ranks_per_node = 2, .num_experts = 8,
                       .experts_per_token = 2, .max_tokens_per_rank = 4, .hidden = 128,
                       .forwarding = Forwarding::kNodeOnce};
    EngineOptions options = testing_util::TestOptions("shm");
    options.transfer_timeout_ms = 1000;  // writes to the dead peer end within a second
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(options));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 3) {
      a2a.reset();
      engine.reset();
      raise(SIGKILL);
    }
    std::vector<uint16_t> x(4 * 128, 0), out_x(2 * 16 * 128), y(4 * 128);
    std::vector<int32_t> idx = {0, 7, 2, 5, 4, 3, 6, 1}, counts(2);
    std::vector<float> w(8, 0.5f);
    const auto start = Clock::now();
    const Deadline deadline = Deadline::After(2s);
    Status s = a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 4});
    if (s.ok()) s = a2a->DispatchRecv({out_x.data(), nullptr, counts.data()}, deadline);
    if (s.ok()) s = a2a->CombineSend(out_x.data());
    if (s.ok()) s = a2a->CombineRecv(CombineOutput{.out = y.data()}, deadline);
    CHECK_OR_RETURN(!s.ok(), "the epoch finished without rank 3");
    CHECK_OR_RETURN(Clock::now() - start < 6s, "deadline not kept: " + s.ToString());
    const auto torn = Clock::now();
    a2a.reset();
    CHECK_OR_RETURN(Clock::now() - torn < 10s, "teardown hung");
    return Status::Ok();
  }, 120s);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(exits[size_t(r)].ok()) << "rank " << r;
  EXPECT_EQ(exits[3].signal, SIGKILL);
}

// Rank 3 dies in epoch 1 at one of three points: before its dispatch, between its rail and
// node sends (after DispatchSend), or between its node and rail combines (after CombineSend).
// The rank that finds it lost at one hop is late at the next for the ranks that wait for it
// there -- past their deadline, for the combine's wait is half the dispatch's -- and those ranks
// hear it (its heartbeats) and wait for it instead of masking it. Every survivor's epochs go on;
// from epoch 2 (from epoch 1 where rank 3 sent nothing in it) each output is exact with rank 3
// out: its experts and the route it forwarded. No survivor masks a live rank; rank 3's rail
// and node peers name it masked.
class MoeNodeOnceLostTest : public testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(MoeNodeOnceLostTest, ALostRankIsMaskedAndTheRanksItDelayedAreNot) {
  // The send step after which rank 3 dies (0: dispatch, 1: combine; -1: before both).
  const auto [cuda, dies_after] = GetParam();
  if (SkipCuda(cuda)) GTEST_SKIP() << "no GPU";
  auto exits = testing_util::RunRanks(kWorld, [cuda, dies_after](Bootstrap& b) -> Status {
    const int me = b.rank();
    ASSIGN_OR_RETURN(MaskingRank rank, MakeMaskingRank(b, cuda));
    RETURN_IF_ERROR(Epoch(*rank.a2a, me, 0, std::vector<bool>(kWorld, false), {.cuda = cuda}));
    RETURN_IF_ERROR(b.Barrier(30s));
    // Rank 3 dies once what it sent has left (its engine gone first: a process killed inside
    // the shm provider could leave its lock held).
    auto die = [&] {
      std::this_thread::sleep_for(100ms);
      rank.a2a.reset();
      rank.engine.reset();
      raise(SIGKILL);
    };
    EpochRun run{.cuda = cuda, .dispatch_wait = 600ms, .combine_wait = 300ms,
                 .exact = dies_after < 0};
    if (me == 3) {
      if (dies_after < 0) die();
      run.after_send = [&](int step) {
        if (step == dies_after) die();
      };
    }
    std::vector<bool> lost(kWorld, false);
    lost[3] = true;
    for (int epoch = 1; epoch < 5; ++epoch) {
      const auto start = Clock::now();
      RETURN_IF_ERROR(Epoch(*rank.a2a, me, epoch, lost, run));
      // At most each hop's wait and late waits: 2 x 4 x (600 + 300) ms.
      CHECK_OR_RETURN(Clock::now() - start < 8s,
                      "epoch " + std::to_string(epoch) + " outlived its hops' bounds");
      run.exact = true;
    }
    ASSIGN_OR_RETURN(auto masked, rank.a2a->Masked());
    for (int r = 0; r < 3; ++r) {
      CHECK_OR_RETURN(!masked[size_t(r)], "rank " + std::to_string(me) + " masked live rank " +
                                              std::to_string(r));
    }
    CHECK_OR_RETURN(me == 0 || masked[3], "rank " + std::to_string(me) +
                                              " waits for rank 3 but did not mask it");
    return Status::Ok();
  }, 120s);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(exits[size_t(r)].ok()) << "rank " << r;
  EXPECT_EQ(exits[3].signal, SIGKILL);
}

INSTANTIATE_TEST_SUITE_P(
    WhereItDies, MoeNodeOnceLostTest,
    testing::Combine(testing::Bool(), testing::Values(-1, 0, 1)),
    [](const testing::TestParamInfo<std::tuple<bool, int>>& p) {
      const int at = std::get<1>(p.param);
      return std::string(std::get<0>(p.param) ? "Cuda" : "Host") +
             (at < 0 ? "BeforeItsDispatch" : at == 0 ? "BetweenItsRailAndNodeSends"
                                                     : "BetweenItsNodeAndRailCombines");
    });

// Under mask_lost_peers a rank late for its own reasons -- asleep for three times the step's
// wait before its dispatch, its process alive -- sends no heartbeats (it is in no step) and is
// masked at the deadline by the ranks that wait for it, as per rank forwarding masks it; the
// ranks it delays are heard while they wait for it and are not masked. Every survivor's next
// two epochs are exact with rank 3 out, and no survivor names a live rank masked. (A rank
// masked as lost must not run its steps again -- moe.h -- so rank 3 only wakes and leaves.)
class MoeNodeOnceLateTest : public testing::TestWithParam<bool> {};

TEST_P(MoeNodeOnceLateTest, ARankLateOutsideItsStepIsMaskedAndTheRanksItDelaysAreNot) {
  const bool cuda = GetParam();
  if (SkipCuda(cuda)) GTEST_SKIP() << "no GPU";
  auto exits = testing_util::RunRanks(kWorld, [cuda](Bootstrap& b) -> Status {
    const int me = b.rank();
    ASSIGN_OR_RETURN(MaskingRank rank, MakeMaskingRank(b, cuda));
    const EpochRun run{.cuda = cuda, .dispatch_wait = 400ms, .combine_wait = 400ms};
    RETURN_IF_ERROR(Epoch(*rank.a2a, me, 0, std::vector<bool>(kWorld, false), run));
    RETURN_IF_ERROR(b.Barrier(30s));
    if (me == 3) {
      std::this_thread::sleep_for(1200ms);
      return Status::Ok();
    }
    std::vector<bool> lost(kWorld, false);
    lost[3] = true;
    for (int epoch = 1; epoch < 3; ++epoch) RETURN_IF_ERROR(Epoch(*rank.a2a, me, epoch, lost, run));
    ASSIGN_OR_RETURN(auto masked, rank.a2a->Masked());
    for (int r = 0; r < 3; ++r) {
      CHECK_OR_RETURN(!masked[size_t(r)], "rank " + std::to_string(me) + " masked live rank " +
                                              std::to_string(r));
    }
    CHECK_OR_RETURN(me == 0 || masked[3], "rank " + std::to_string(me) + " did not mask rank 3");
    return Status::Ok();
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeNodeOnceLateTest, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& p) {
                           return std::string(p.param ? "Cuda" : "Host");
                         });

}  // namespace
}  // namespace ferry
