// TransferEngine's peers between two engines in one process, over every software provider: a
// removed peer refuses work and frees its slot, a revoked key refuses later writes, groups and
// scatter plans (made, replaced in place, with a removed member).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "fabric/engine_pair_test.h"
#include "fabric/test_util.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

TEST_P(EnginePairTest, ARemovedPeerRefusesWorkAndCanBeRemovedAgain) {
  TransferCounter done;
  ASSERT_TRUE(a_->Write(Single(0, 0, 4096), Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(1, Deadline::After(5s)).ok());
  // An engine that is a peer already keeps its PeerId (what shares this engine shares it).
  auto same = a_->AddPeer(b_->Address());
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, b_on_a_);
  ASSERT_TRUE(a_->RemovePeer(b_on_a_).ok());
  EXPECT_TRUE(*a_->PeerLost(b_on_a_));
  Status s = a_->Write(Single(0, 0, 64), Completion());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(a_->WriteImm(b_on_a_, 1, Completion()).code(), StatusCode::kUnavailable);
  // Lost or removed already: removing again succeeds (a caller cleaning up need not know which).
  EXPECT_TRUE(a_->RemovePeer(b_on_a_).ok());
  EXPECT_EQ(a_->RemovePeer(12345).code(), StatusCode::kNotFound);
  // The other direction is untouched.
  TransferCounter back;
  ASSERT_TRUE(b_->WriteImm(a_on_b_, 3, Completion::Counter(&back)).ok());
  ASSERT_TRUE(back.Wait(1, Deadline::After(5s)).ok());
  EXPECT_EQ(back.failed.load(), 0u);
  // Removed, the engine is a new peer when added again.
  auto again = a_->AddPeer(b_->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, b_on_a_);
  EXPECT_FALSE(*a_->PeerLost(*again));
}

// A second registration of the same bytes is a second key, and revoking it (Revoke: OK, the
// region empty after) revokes that key alone: a write under it, posted after, changes neither
// the bytes nor the immediate counter it names, while writes under the first key still land.
// (The KV decoder gives each prefill a key of its own this way, to fence one that hung.)
// Revoke refuses an empty region and one of another engine.
TEST_P(EnginePairTest, ADeregisteredKeyRefusesLaterWritesAndLeavesTheOtherKeysWorking) {
  ASSERT_TRUE(b_->CreateImmCounter(11).ok());
  auto second = b_->RegisterMemory(dst_.data(), dst_.size());
  ASSERT_TRUE(second.ok()) << second.status();
  MemoryRegion alias = std::move(second).value();
  SingleWrite w = Single(0, 0, 4096);
  w.dst = *RemoteRegion::Parse(alias.remote().Serialize());
  w.imm = 11;
  // Posts `write` (4 KiB at offset 0) and expects it landed and counted once.
  auto lands = [&](const SingleWrite& write) {
    TransferCounter landed;
    ASSERT_TRUE(a_->Write(write, Completion::Counter(&landed)).ok());
    ASSERT_TRUE(landed.Wait(1, Deadline::After(10s)).ok());
    ASSERT_EQ(landed.failed.load(), 0u);
    ASSERT_TRUE(b_->WaitImm(11, 1, Deadline::After(10s)).ok());
    ASSERT_EQ(0, std::memcmp(dst_.data(), src_.data(), 4096));
    ASSERT_TRUE(b_->ConsumeImm(11, 1).ok());
  };
  lands(w);

  MemoryRegion empty;
  EXPECT_EQ(b_->Revoke(empty).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->Revoke(alias).code(), StatusCode::kInvalidArgument);  // b's region
  ASSERT_TRUE(alias.valid());
  ASSERT_TRUE(b_->Revoke(alias).ok());
  EXPECT_FALSE(alias.valid());
  std::fill(dst_.begin(), dst_.end(), uint8_t{0xAB});
  TransferCounter refused;
  uint64_t posted = 0;
  for (uint64_t len : {uint64_t{64}, uint64_t{65536}}) {
    SingleWrite late = w;
    late.length = len;
    Status s = a_->Write(late, Completion::Counter(&refused));
    if (s.ok()) {
      ++posted;
    } else {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;  // the first failure lost the peer
    }
  }
  // What the writer hears is the provider's: tcp completes a write once it has left, and the
  // target drops it; shm fails it. Either way nothing lands.
  ASSERT_GE(posted, 1u);
  ASSERT_TRUE(refused.Wait(posted, Deadline::After(15s)).ok());
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(*b_->ImmCount(11), 0u);
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t c) { return c == 0xAB; }));

  // The first key still works (after adding the peer again where the failure lost it).
  PeerId peer = b_on_a_;
  if (*a_->PeerLost(peer)) {
    auto again = a_->AddPeer(b_->Address());
    ASSERT_TRUE(again.ok()) << again.status();
    peer = *again;
  }
  SingleWrite fine = Single(0, 0, 4096);
  fine.peer = peer;
  fine.imm = 11;
  lands(fine);
}

// The peer table holds the peers of now: a removed peer's slot serves the next AddPeer, so an
// engine of two slots can add and remove peers without end, and a PeerId of a removed peer never
// reaches whoever holds its slot later.
TEST_P(EnginePairTest, RemovedPeersFreeTheirSlotsAndTheirIdsStayDead) {
  EngineOptions o = testing_util::TestOptions(GetParam());
  o.max_peers = 2;
  auto small = TransferEngine::Create(o);
  ASSERT_TRUE(small.ok()) << small.status();
  TransferEngine& c = **small;
  auto third = TransferEngine::Create(testing_util::TestOptions(GetParam()));
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(b_->CreateImmCounter(77).ok());
  ASSERT_TRUE((*third)->CreateImmCounter(77).ok());

  std::vector<PeerId> old;
  uint64_t landed_on_b = 0;
  for (int round = 0; round < 6; ++round) {
    // Two engines fill the table; a third does not fit until one is removed.
    auto pb = c.AddPeer(b_->Address());
    ASSERT_TRUE(pb.ok()) << "round " << round << ": " << pb.status();
    auto pa = c.AddPeer(a_->Address());
    ASSERT_TRUE(pa.ok()) << pa.status();
    EXPECT_EQ(c.AddPeer((*third)->Address()).status().code(), StatusCode::kResourceExhausted);
    for (PeerId p : old) EXPECT_NE(p, *pb) << "a PeerId came back";
    TransferCounter sent;
    ASSERT_TRUE(c.WriteImm(*pb, 77, Completion::Counter(&sent)).ok());
    ASSERT_TRUE(sent.Wait(1, Deadline::After(10s)).ok());
    EXPECT_EQ(sent.failed.load(), 0u);
    ++landed_on_b;
    ASSERT_TRUE(c.RemovePeer(*pb).ok());
    ASSERT_TRUE(c.RemovePeer(*pa).ok());
    old.push_back(*pb);
    old.push_back(*pa);
    // The slots are now the third engine's (and then b's again): every old PeerId is refused
    // as removed, reports lost, and removing it again touches nobody.
    auto p3 = c.AddPeer((*third)->Address());
    ASSERT_TRUE(p3.ok()) << p3.status();
    for (PeerId p : old) {
      EXPECT_EQ(c.WriteImm(p, 77, Completion()).code(), StatusCode::kUnavailable) << p;
      EXPECT_TRUE(*c.PeerLost(p));
      EXPECT_TRUE(c.RemovePeer(p).ok());
    }
    EXPECT_FALSE(*c.PeerLost(*p3));
    std::vector<PeerId> stale_group = {old.back()};
    EXPECT_EQ(c.AddPeerGroup(stale_group).status().code(), StatusCode::kUnavailable);
    ASSERT_TRUE(c.WriteImm(*p3, 77, Completion::Counter(&sent)).ok());
    ASSERT_TRUE(sent.Wait(2, Deadline::After(10s)).ok());
    EXPECT_EQ(sent.failed.load(), 0u);
    ASSERT_TRUE(c.RemovePeer(*p3).ok());
  }
  // Only what went to each engine's current PeerId arrived: the stale submits were refused.
  ASSERT_TRUE(b_->WaitImm(77, landed_on_b, Deadline::After(10s)).ok());
  EXPECT_EQ(*b_->ImmCount(77), landed_on_b);
  ASSERT_TRUE((*third)->WaitImm(77, 6, Deadline::After(10s)).ok());
  EXPECT_EQ(*(*third)->ImmCount(77), 6u);
  // A PeerId whose slot was never used, or of a generation not yet reached, is unknown.
  EXPECT_EQ(c.WriteImm(old.back() + (1u << 16) * 100, 77, Completion()).code(),
            StatusCode::kNotFound);
  o.max_peers = 1u << 17;
  EXPECT_EQ(TransferEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
}

// A group member removed after the group was made: scatters and barriers that name it fail
// (Unavailable), at submit and, for one already queued, when the worker reaches it.
TEST_P(EnginePairTest, AGroupWithARemovedMemberFailsItsWrites) {
  GroupId group = 0;
  ScatterPlanId plan = 0;
  ASSERT_NO_FATAL_FAILURE(GroupOfB(&group, &plan));
  std::vector<ScatterTarget> targets = {{0, 0, 0, 4096}};
  ASSERT_TRUE(a_->RemovePeer(b_on_a_).ok());
  EXPECT_EQ(a_->Scatter({plan, targets, std::nullopt}, {}).code(), StatusCode::kUnavailable);
  EXPECT_EQ(a_->Barrier(group, 5, {}).code(), StatusCode::kUnavailable);
  // Added again (into the same slot, a new generation): the old group still names the old
  // PeerId, and stays refused.
  auto again = a_->AddPeer(b_->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(a_->Scatter({plan, targets, std::nullopt}, {}).code(), StatusCode::kUnavailable);
  EXPECT_EQ(a_->Barrier(group, 5, {}).code(), StatusCode::kUnavailable);
}

TEST_P(EnginePairTest, ScatterAndBarrierOverAGroupOfOne) {
  GroupId group = 0;
  ScatterPlanId plan = 0;
  ASSERT_NO_FATAL_FAILURE(GroupOfB(&group, &plan));
  ASSERT_TRUE(b_->CreateImmCounter(42).ok());
  std::vector<ScatterTarget> targets = {
      {0, 0, 1000, 100}, {0, 5000, 3000, 1}, {0, 9000, 20000, 65536}};
  TransferCounter c;
  ASSERT_TRUE(a_->Scatter({plan, targets, 42}, Completion::Counter(&c)).ok());
  ASSERT_TRUE(a_->Barrier(group, 42, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(2, Deadline::After(10s)).ok());
  EXPECT_EQ(c.failed.load(), 0u);
  ASSERT_TRUE(b_->WaitImm(42, 4, Deadline::After(10s)).ok());
  for (auto& t : targets) {
    EXPECT_EQ(0, std::memcmp(dst_.data() + t.dst_offset, src_.data() + t.src_offset, t.length));
  }
  std::vector<ScatterTarget> bad = {{1, 0, 0, 8}};
  EXPECT_EQ(a_->Scatter({plan, bad, 42}, {}).code(), StatusCode::kOutOfRange);
  bad = {{0, 0, kBytes - 4, 8}};
  EXPECT_EQ(a_->Scatter({plan, bad, 42}, {}).code(), StatusCode::kOutOfRange);
}

// A plan re-prepared in place keeps its id and writes under the new key: b's first key is
// revoked and the scatter still lands, under the second; the group replaced in place keeps
// its id too. Bad arguments leave both as they were.
TEST_P(EnginePairTest, APlanRePreparedInPlaceWritesUnderTheNewKey) {
  GroupId group = 0;
  ScatterPlanId plan = 0;
  ASSERT_NO_FATAL_FAILURE(GroupOfB(&group, &plan));
  ASSERT_TRUE(b_->CreateImmCounter(43).ok());
  auto second = b_->RegisterMemory(dst_.data(), dst_.size());
  ASSERT_TRUE(second.ok()) << second.status();
  MemoryRegion alias = std::move(second).value();
  const RemoteRegion alias_remote = *RemoteRegion::Parse(alias.remote().Serialize());

  std::vector<PeerId> members = {b_on_a_};
  EXPECT_EQ(a_->ReplacePeerGroup(group + 7, members).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->ReplacePeerGroup(group, {}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(a_->ReplacePeerGroup(group, members).ok());
  std::vector<RemoteRegion> two = {alias_remote, alias_remote};
  EXPECT_EQ(a_->RePrepareScatter(plan, group, src_reg_, two).code(),
            StatusCode::kInvalidArgument);
  std::vector<RemoteRegion> one = {alias_remote};
  EXPECT_EQ(a_->RePrepareScatter(plan + 7, group, src_reg_, one).code(), StatusCode::kNotFound);
  ASSERT_TRUE(a_->RePrepareScatter(plan, group, src_reg_, one).ok());
  ASSERT_TRUE(b_->Revoke(dst_reg_).ok());

  std::vector<ScatterTarget> targets = {{0, 0, 512, 4096}, {0, 8192, 70000, 100}};
  TransferCounter c;
  ASSERT_TRUE(a_->Scatter({plan, targets, 43}, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(c.failed.load(), 0u);
  ASSERT_TRUE(b_->WaitImm(43, 2, Deadline::After(10s)).ok());
  for (auto& t : targets) {
    EXPECT_EQ(0, std::memcmp(dst_.data() + t.dst_offset, src_.data() + t.src_offset, t.length));
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, EnginePairTest, ::testing::ValuesIn(testing_util::Providers()),
                         testing_util::ProviderTestName);

}  // namespace
}  // namespace ferry
