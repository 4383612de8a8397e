// Elastic membership under node-once forwarding (AllToAll::Readmit / Join / Resize, which build
// every hop anew): ranks as processes over shm, a fifth standing by to replace one. A lost rank
// is replaced and every epoch after is exact; a replaced rank that was only stalled, woken
// before or after the readmission, writes nothing into the new hops; the world grows by a node
// and shrinks back.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "moe_node_once_cases.h"

namespace ferry {
namespace {

using namespace node_once_cases;

// The world as it starts: rank `me` of four meets the others at `address`, makes its AllToAll
// and runs epoch 0 with every rank, and every rank is past it (a barrier).
struct Started {
  std::unique_ptr<Bootstrap> world;
  std::unique_ptr<AllToAll> a2a;
};
StatusOr<Started> Start(const std::string& address, int me, const AllToAllConfig& c,
                        TransferEngine* engine, const EpochRun& run) {
  Started s;
  ASSIGN_OR_RETURN(s.world, JoinRendezvous({.address = address, .world_size = kWorld,
                                            .rank = me, .timeout = 60s}));
  ASSIGN_OR_RETURN(s.a2a, AllToAll::Create(c, engine, *s.world));
  RETURN_IF_ERROR(Epoch(*s.a2a, me, 0, std::vector<bool>(kWorld, false), run));
  RETURN_IF_ERROR(s.world->Barrier(30s));
  return s;
}

// Under node-once forwarding a lost rank comes back as a new process: rank 3 (of EP4 as two
// nodes of two) dies; the survivors mask it -- each only where it waits for it: rank 2 in its
// node, rank 1 on its rail, rank 0 not at all -- and go on without it; a fifth process joins
// as rank 3 (AllToAll::Join) while the survivors readmit (AllToAll::Readmit), which builds
// every hop anew; the next epochs are exact with every rank, on every rank. Both devices (the
// CUDA device's skipped without a GPU).
class MoeNodeOnceReplacedTest : public testing::TestWithParam<bool> {};

TEST_P(MoeNodeOnceReplacedTest, ALostRankIsReplacedAndEveryHopIsWholeAgain) {
  const bool cuda = GetParam();
  if (SkipCuda(cuda)) GTEST_SKIP() << "no GPU";
  const std::string first = LoopbackAddress();
  const std::string second = LoopbackAddress();
  auto exits = testing_util::RunRanks(kWorld + 1, [&](Bootstrap& launcher) -> Status {
    const int me = std::min(launcher.rank(), 3);  // process 4 is rank 3's replacement
    ASSIGN_OR_RETURN(const AllToAllConfig c, MaskingConfig(launcher, me, cuda));
    ASSIGN_OR_RETURN(auto engine, MaskingEngine());
    const std::vector<bool> everyone(kWorld, false);
    const EpochRun run{.cuda = cuda, .dispatch_wait = 600ms, .combine_wait = 600ms};
    if (launcher.rank() == kWorld) {
      ASSIGN_OR_RETURN(auto group, JoinRendezvous({.address = second, .world_size = kWorld,
                                                   .rank = me, .timeout = 60s}));
      ASSIGN_OR_RETURN(auto a2a, AllToAll::Join(c, engine.get(), *group, 30s));
      CHECK_OR_RETURN(a2a->membership_version() == 1, "joined at another version");
      for (int epoch = 3; epoch < 6; ++epoch) {
        RETURN_IF_ERROR(Epoch(*a2a, me, epoch, everyone, run));
      }
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(Started started, Start(first, me, c, engine.get(), run));
    auto& a2a = started.a2a;
    if (me == 3) {
      a2a.reset();
      engine.reset();
      raise(SIGKILL);
    }
    std::vector<bool> lost(kWorld, false);
    lost[3] = true;
    for (int epoch = 1; epoch < 3; ++epoch) RETURN_IF_ERROR(Epoch(*a2a, me, epoch, lost, run));
    ASSIGN_OR_RETURN(auto group, JoinRendezvous({.address = second, .world_size = kWorld,
                                                 .rank = me, .timeout = 60s}));
    RETURN_IF_ERROR(a2a->Readmit(*group, 30s));
    ASSIGN_OR_RETURN(auto masked, a2a->Masked());
    CHECK_OR_RETURN(std::none_of(masked.begin(), masked.end(), [](uint8_t m) { return m; }),
                    "a rank still masked after the readmission");
    for (int epoch = 3; epoch < 6; ++epoch) RETURN_IF_ERROR(Epoch(*a2a, me, epoch, everyone, run));
    return Status::Ok();
  }, 120s);
  for (int r : {0, 1, 2, 4}) EXPECT_TRUE(exits[size_t(r)].ok()) << "process " << r;
  EXPECT_EQ(exits[3].signal, SIGKILL);
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeNodeOnceReplacedTest, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& p) {
                           return std::string(p.param ? "Cuda" : "Host");
                         });

// The replaced process of the case above, only stalled -- its engine running, as a slow rank's
// would -- wakes either before the survivors readmit (kBefore: its epoch-1 dispatch lands in
// the old hops' inboxes, under keys still valid, and its immediates are counted) or after
// (kAfter: under keys revoked since, while the next epochs run). Either way nothing of it
// reaches the new hops: the old
// hops' relays revoke their keys when they stop, counting what landed, and the new ones take
// the instances' counters over emptied; the epochs after the readmission are exact, with the
// new process as rank 3. Host device.
enum class Woken { kBefore, kAfter };
class MoeNodeOnceFenceTest : public testing::TestWithParam<Woken> {};

TEST_P(MoeNodeOnceFenceTest, AReplacedRankThatWakesWritesNothingIntoTheNewHops) {
  const bool before = GetParam() == Woken::kBefore;
  const std::string first = LoopbackAddress();
  const std::string second = LoopbackAddress();
  int resume[2], woke[2];
  ASSERT_EQ(pipe(resume), 0);
  ASSERT_EQ(pipe(woke), 0);
  auto exits = testing_util::RunRanks(kWorld + 1, [&](Bootstrap& launcher) -> Status {
    const int me = std::min(launcher.rank(), 3);  // process 4 is rank 3's replacement
    ASSIGN_OR_RETURN(const AllToAllConfig c, MaskingConfig(launcher, me, false));
    ASSIGN_OR_RETURN(auto engine, MaskingEngine());
    const std::vector<bool> everyone(kWorld, false);
    const EpochRun run{.dispatch_wait = 300ms, .combine_wait = 300ms};
    // After the readmission: waits no jitter outlasts, and a pause before each epoch, so that
    // the old rank 3 (woken after it) writes while they run.
    const EpochRun whole{.dispatch_wait = 5s, .combine_wait = 5s};
    auto after = [&](AllToAll& a2a) -> Status {
      for (int epoch = 3; epoch < 9; ++epoch) {  // every epoch tag (four) seen again
        std::this_thread::sleep_for(100ms);
        RETURN_IF_ERROR(Epoch(a2a, me, epoch, everyone, whole));
      }
      return Status::Ok();
    };
    if (launcher.rank() == kWorld) {
      ASSIGN_OR_RETURN(auto group, JoinRendezvous({.address = second, .world_size = kWorld,
                                                   .rank = me, .timeout = 60s}));
      ASSIGN_OR_RETURN(auto a2a, AllToAll::Join(c, engine.get(), *group, 30s));
      return after(*a2a);
    }
    ASSIGN_OR_RETURN(Started started, Start(first, me, c, engine.get(), run));
    auto& a2a = started.a2a;
    if (me == 3) {
      // Stalled until rank 0 wakes it; then its epoch 1, which nobody reads: it sends, and its
      // waits end at their deadlines (its peers have moved on).
      char byte;
      CHECK_OR_RETURN(read(resume[0], &byte, 1) == 1, "never woken");
      (void)Epoch(*a2a, me, 1, everyone, EpochRun{.dispatch_wait = 300ms,
                                                  .combine_wait = 300ms, .exact = false});
      if (before) CHECK_OR_RETURN(write(woke[1], &byte, 1) == 1, "pipe");
      std::this_thread::sleep_for(3s);  // its relay's writes end before the process does
      return Status::Ok();
    }
    std::vector<bool> lost(kWorld, false);
    lost[3] = true;
    for (int epoch = 1; epoch < 3; ++epoch) RETURN_IF_ERROR(Epoch(*a2a, me, epoch, lost, run));
    const char byte = 1;
    if (me == 0 && before) {  // woken, and done sending, before anyone readmits
      CHECK_OR_RETURN(write(resume[1], &byte, 1) == 1, "pipe");
      char got;
      CHECK_OR_RETURN(read(woke[0], &got, 1) == 1, "the old rank 3 never said it sent");
    }
    ASSIGN_OR_RETURN(auto group, JoinRendezvous({.address = second, .world_size = kWorld,
                                                 .rank = me, .timeout = 60s}));
    RETURN_IF_ERROR(a2a->Readmit(*group, 30s));
    if (me == 0 && !before) CHECK_OR_RETURN(write(resume[1], &byte, 1) == 1, "pipe");
    return after(*a2a);
  }, 120s);
  for (int r = 0; r <= kWorld; ++r) EXPECT_TRUE(exits[size_t(r)].ok()) << "process " << r;
}

INSTANTIATE_TEST_SUITE_P(Woken, MoeNodeOnceFenceTest,
                         testing::Values(Woken::kBefore, Woken::kAfter),
                         [](const testing::TestParamInfo<Woken>& p) {
                           return std::string(p.param == Woken::kBefore ? "BeforeTheReadmission"
                                                                        : "AfterTheReadmission");
                         });

// Under node-once the world grows from two nodes of two to three and shrinks back
// (AllToAll::Resize on the four ranks that stay, AllToAll::Join on the two new processes, which
// leave again), twelve experts three and then two a rank: every hop and the heartbeats made
// anew over the new world on each survivor's engine, taking their instances' counters over;
// every epoch exact for the world it ran in. Both devices (the CUDA device's skipped without a
// GPU).
class MoeNodeOnceResizeTest : public testing::TestWithParam<bool> {};

TEST_P(MoeNodeOnceResizeTest, TheWorldGrowsFromTwoNodesToThreeAndShrinksBackExactly) {
  const bool cuda = GetParam();
  if (SkipCuda(cuda)) GTEST_SKIP() << "no GPU";
  const std::string first = LoopbackAddress();
  const std::string grown = LoopbackAddress();
  const std::string shrunk = LoopbackAddress();
  const World four{4, 12}, six{6, 12};
  auto exits = testing_util::RunRanks(6, [&](Bootstrap& launcher) -> Status {
    const int me = launcher.rank();
    ASSIGN_OR_RETURN(auto engine, MaskingEngine());
    const EpochRun run{.cuda = cuda, .dispatch_wait = 30s, .combine_wait = 30s};
    const std::vector<bool> all4(4, false), all6(6, false);
    auto rendezvous = [&](const std::string& at, int world) {
      return JoinRendezvous({.address = at, .world_size = world, .rank = me, .timeout = 60s});
    };
    if (me >= 4) {  // new in the grown world; leaves when it shrinks
      ASSIGN_OR_RETURN(auto group, rendezvous(grown, 6));
      ASSIGN_OR_RETURN(const AllToAllConfig c, MaskingConfig(launcher, me, cuda, six));
      ASSIGN_OR_RETURN(auto a2a, AllToAll::Join(c, engine.get(), *group, 30s));
      for (int epoch = 2; epoch < 4; ++epoch) {
        RETURN_IF_ERROR(Epoch(*a2a, me, epoch, all6, run, six));
      }
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(auto world, rendezvous(first, 4));
    ASSIGN_OR_RETURN(const AllToAllConfig c, MaskingConfig(launcher, me, cuda, four));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(c, engine.get(), *world));
    for (int epoch = 0; epoch < 2; ++epoch) {
      RETURN_IF_ERROR(Epoch(*a2a, me, epoch, all4, run, four));
    }
    // Into `to` over the rendezvous at `at` (the membership's `version`), then two epochs.
    auto resize = [&](const World& to, const std::string& at, uint64_t version,
                      int first_epoch) -> Status {
      ASSIGN_OR_RETURN(auto group, rendezvous(at, to.ranks));
      ASSIGN_OR_RETURN(const AllToAllConfig next, MaskingConfig(launcher, me, cuda, to));
      RETURN_IF_ERROR(a2a->Resize(next, *group, 30s));
      CHECK_OR_RETURN(a2a->config().world_size == to.ranks &&
                          a2a->membership_version() == version,
                      "resized: world " + std::to_string(a2a->config().world_size));
      const std::vector<bool> all(size_t(to.ranks), false);
      for (int epoch = first_epoch; epoch < first_epoch + 2; ++epoch) {
        RETURN_IF_ERROR(Epoch(*a2a, me, epoch, all, run, to));
      }
      return Status::Ok();
    };
    RETURN_IF_ERROR(resize(six, grown, 1, 2));
    RETURN_IF_ERROR(resize(four, shrunk, 2, 4));
    return Status::Ok();
  }, 180s);
  for (int r = 0; r < 6; ++r) EXPECT_TRUE(exits[size_t(r)].ok()) << "process " << r;
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeNodeOnceResizeTest, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& p) {
                           return std::string(p.param ? "Cuda" : "Host");
                         });

}  // namespace
}  // namespace ferry
