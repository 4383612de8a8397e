// Domain groups: one engine driving several NICs. Here each "NIC" is its own endpoint of a
// software provider on this host; the sharding logic is the same one that spreads work over EFA
// or ConnectX-7 NICs. Data is verified byte for byte; which NIC posted what is read from the
// engine's per-NIC counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "fabric/engine.h"
#include "fabric/engine_internal.h"
#include "fabric/fault_domain.h"
#include "fabric/test_util.h"
#include "ferry/fabric.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

struct GroupCase {
  std::string provider;
  uint32_t sender_nics;
  uint32_t receiver_nics;
};

void PrintTo(const GroupCase& c, std::ostream* os) {
  *os << c.provider << " " << c.sender_nics << "x" << c.receiver_nics;
}

std::string CaseName(const ::testing::TestParamInfo<GroupCase>& info) {
  std::string p;
  for (char c : info.param.provider) p += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return p + "_" + std::to_string(info.param.sender_nics) + "x" +
         std::to_string(info.param.receiver_nics);
}

std::vector<GroupCase> Cases() {
  std::vector<GroupCase> out;
  for (const std::string& p : testing_util::Providers()) {
    for (auto [n, m] : {std::pair{2u, 2u}, {2u, 1u}, {1u, 2u}, {4u, 2u}, {3u, 4u}}) {
      out.push_back({p, n, m});
    }
  }
  return out;
}

EngineOptions GroupOptions(const std::string& provider, uint32_t nics) {
  EngineOptions o = testing_util::TestOptions(provider);
  o.num_nics = nics;
  o.nic_shard_min_bytes = 4096;
  o.num_recv_buffers = 16;
  return o;
}

uint64_t Sum(const std::array<uint64_t, kMaxNics>& a) {
  return std::accumulate(a.begin(), a.end(), uint64_t{0});
}

std::array<uint64_t, kMaxNics> Delta(const std::array<uint64_t, kMaxNics>& after,
                                     const std::array<uint64_t, kMaxNics>& before) {
  std::array<uint64_t, kMaxNics> d{};
  for (uint32_t k = 0; k < kMaxNics; ++k) d[k] = after[k] - before[k];
  return d;
}

class DomainGroupTest : public ::testing::TestWithParam<GroupCase> {
 protected:
  void SetUp() override {
    const GroupCase& c = GetParam();
    auto a = TransferEngine::Create(GroupOptions(c.provider, c.sender_nics));
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(a).value();
    for (int i = 0; i < 3; ++i) {
      auto b = TransferEngine::Create(GroupOptions(c.provider, c.receiver_nics));
      ASSERT_TRUE(b.ok()) << b.status();
      b_.push_back(std::move(b).value());
      auto p = a_->AddPeer(b_.back()->Address());
      ASSERT_TRUE(p.ok()) << p.status();
      peers_.push_back(*p);
      ASSERT_TRUE(b_.back()->AddPeer(a_->Address()).ok());
    }
    ASSERT_EQ(a_->info().num_nics, c.sender_nics);
    src_.resize(kBytes);
    std::mt19937 rng(7);
    for (auto& x : src_) x = static_cast<uint8_t>(rng());
    src_reg_ = *a_->RegisterMemory(src_.data(), src_.size());
    for (auto& b : b_) {
      dst_.emplace_back(kBytes, 0);
      dst_reg_.push_back(*b->RegisterMemory(dst_.back().data(), dst_.back().size()));
    }
  }

  // The three peers as one group, and a scatter plan from src_ over it into their regions.
  StatusOr<std::pair<GroupId, ScatterPlanId>> GroupAndPlan() {
    ASSIGN_OR_RETURN(GroupId group, a_->AddPeerGroup(peers_));
    std::vector<RemoteRegion> dsts;
    for (auto& r : dst_reg_) dsts.push_back(r.remote());
    ASSIGN_OR_RETURN(ScatterPlanId plan, a_->PrepareScatter(group, src_reg_, dsts));
    return std::make_pair(group, plan);
  }

  static constexpr uint64_t kBytes = (1 << 20) + 13;  // not a multiple of anything

  std::unique_ptr<TransferEngine> a_;
  std::vector<std::unique_ptr<TransferEngine>> b_;
  std::vector<PeerId> peers_;
  std::vector<uint8_t> src_;
  MemoryRegion src_reg_;
  std::vector<std::vector<uint8_t>> dst_;
  std::vector<MemoryRegion> dst_reg_;
};

TEST_P(DomainGroupTest, LargeSingleWritesShardAcrossEveryNicAndLandWhole) {
  const uint32_t n = GetParam().sender_nics;
  ASSERT_TRUE(b_[0]->CreateImmCounter(5).ok());
  for (int round = 0; round < 3; ++round) {
    auto before = a_->stats().wrs_posted_per_nic;
    TransferCounter done;
    SingleWrite w{.src = &src_reg_, .peer = peers_[0], .dst = dst_reg_[0].remote(),
                  .length = kBytes - round, .imm = 5u};
    std::fill(dst_[0].begin(), dst_[0].end(), uint8_t{0});
    ASSERT_TRUE(a_->Write(w, Completion::Counter(&done)).ok());
    // The immediate arrives once, after every shard's bytes.
    ASSERT_TRUE(b_[0]->WaitImm(5, round + 1, Deadline::After(10s)).ok());
    EXPECT_TRUE(std::equal(src_.begin(), src_.end() - round, dst_[0].begin())) << round;
    ASSERT_TRUE(done.Wait(1, Deadline::After(10s)).ok());
    EXPECT_EQ(done.failed.load(), 0u);
    auto d = Delta(a_->stats().wrs_posted_per_nic, before);
    for (uint32_t k = 0; k < n; ++k) EXPECT_GE(d[k], 1u) << "NIC " << k << " posted nothing";
    for (uint32_t k = n; k < kMaxNics; ++k) EXPECT_EQ(d[k], 0u);
  }
  // Small writes go whole to one NIC, the NICs taking turns.
  auto before = a_->stats().wrs_posted_per_nic;
  TransferCounter done;
  for (uint32_t i = 0; i < 2 * n; ++i) {
    SingleWrite w{.src = &src_reg_, .src_offset = 100 * i, .peer = peers_[0],
                  .dst = dst_reg_[0].remote(), .dst_offset = 100 * i, .length = 100};
    ASSERT_TRUE(a_->Write(w, Completion::Counter(&done)).ok());
  }
  ASSERT_TRUE(done.Wait(2 * n, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  auto d = Delta(a_->stats().wrs_posted_per_nic, before);
  EXPECT_EQ(Sum(d), 2u * n);
  for (uint32_t k = 0; k < n; ++k) EXPECT_EQ(d[k], 2u) << "NIC " << k;
}

TEST_P(DomainGroupTest, PagedWritesStripePagesOverTheNics) {
  const uint32_t n = GetParam().sender_nics;
  constexpr uint32_t kPages = 60, kPage = 4096;
  std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(3));
  ASSERT_TRUE(b_[1]->CreateImmCounter(9).ok());
  auto before = a_->stats().wrs_posted_per_nic;
  TransferCounter done;
  PagedWrite w{.src = &src_reg_, .peer = peers_[1], .dst = dst_reg_[1].remote(),
               .page_bytes = kPage, .src_stride = kPage, .dst_stride = kPage,
               .src_pages = src_pages, .dst_pages = dst_pages, .imm = 9u};
  ASSERT_TRUE(a_->WritePaged(w, Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  ASSERT_TRUE(b_[1]->WaitImm(9, kPages, Deadline::After(10s)).ok());
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(dst_[1].data() + uint64_t{dst_pages[i]} * kPage,
                             src_.data() + uint64_t{src_pages[i]} * kPage, kPage))
        << "page " << i;
  }
  auto d = Delta(a_->stats().wrs_posted_per_nic, before);
  for (uint32_t k = 0; k < n; ++k) EXPECT_EQ(d[k], kPages / n + (k < kPages % n)) << "NIC " << k;
}

// imm_once across NICs: the pages stripe as before, and each NIC's last page carries an
// immediate weighted by that NIC's pages, after every page completed; once they all counted,
// every page is in place (over tcp, one immediate on one NIC did not guarantee the other NIC's
// pages had landed).
TEST_P(DomainGroupTest, APagedWriteWithOneImmediateStripesAndCountsItsPages) {
  const uint32_t n = GetParam().sender_nics;
  constexpr uint32_t kPages = 60, kPage = 4096, kImm = 0x11000000, kMask = 0x000FF000;
  std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(5));
  ASSERT_TRUE(b_[1]->CreateWeightedImmCounter(kImm, kMask).ok());
  auto before = a_->stats().wrs_posted_per_nic;
  const uint64_t imms_before = b_[1]->stats().imms_received;
  TransferCounter done;
  PagedWrite w{.src = &src_reg_, .peer = peers_[1], .dst = dst_reg_[1].remote(),
               .page_bytes = kPage, .src_stride = kPage, .dst_stride = kPage,
               .src_pages = src_pages, .dst_pages = dst_pages,
               .imm = kImm, .imm_once = true, .imm_weight_mask = kMask};
  ASSERT_TRUE(a_->WritePaged(w, Completion::Counter(&done)).ok());
  ASSERT_TRUE(b_[1]->WaitImm(kImm, kPages, Deadline::After(10s)).ok());
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(dst_[1].data() + uint64_t{dst_pages[i]} * kPage,
                             src_.data() + uint64_t{src_pages[i]} * kPage, kPage))
        << "page " << i;
  }
  ASSERT_TRUE(done.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  EXPECT_EQ(*b_[1]->ImmCount(kImm), kPages);
  EXPECT_EQ(b_[1]->stats().imms_received - imms_before, n);  // one per NIC
  auto d = Delta(a_->stats().wrs_posted_per_nic, before);
  for (uint32_t k = 0; k < n; ++k) EXPECT_EQ(d[k], kPages / n + (k < kPages % n)) << "NIC " << k;
}

TEST_P(DomainGroupTest, ScatterAndBarrierShardPeersOverTheNics) {
  const uint32_t n = GetParam().sender_nics;
  auto group_and_plan = GroupAndPlan();
  ASSERT_TRUE(group_and_plan.ok()) << group_and_plan.status();
  const auto [group, plan] = *group_and_plan;
  for (auto& b : b_) ASSERT_TRUE(b->CreateImmCounter(21).ok() && b->CreateImmCounter(22).ok());
  // Member i gets two slices, at 1000 * i and 50000 + 1000 * i.
  std::vector<ScatterTarget> targets;
  for (uint32_t m = 0; m < 3; ++m) {
    targets.push_back({m, 1000 * m, 1000 * m, 1000});
    targets.push_back({m, 50000 + 1000 * m, 50000 + 1000 * m, 1000});
  }
  auto before = a_->stats().wrs_posted_per_nic;
  TransferCounter done;
  ASSERT_TRUE(a_->Scatter({plan, targets, 21u}, Completion::Counter(&done)).ok());
  ASSERT_TRUE(a_->Barrier(group, 22, Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(2, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  for (uint32_t m = 0; m < 3; ++m) {
    ASSERT_TRUE(b_[m]->WaitImm(21, 2, Deadline::After(10s)).ok()) << m;
    ASSERT_TRUE(b_[m]->WaitImm(22, 1, Deadline::After(10s)).ok()) << m;
    for (const ScatterTarget& t : targets) {
      if (t.member != m) continue;
      EXPECT_EQ(0, std::memcmp(dst_[m].data() + t.dst_offset, src_.data() + t.src_offset,
                               t.length));
    }
  }
  // Member m's 2 slices and 1 barrier write all left from NIC m mod n.
  auto d = Delta(a_->stats().wrs_posted_per_nic, before);
  std::array<uint64_t, kMaxNics> want{};
  for (uint32_t m = 0; m < 3; ++m) want[m % n] += 3;
  EXPECT_EQ(d, want);
}

// TransferEngine::Traffic: what went to each peer through each NIC, as the work requests were
// posted (ferry-bench moe's per-peer, per-NIC counts at scale read it).
TEST_P(DomainGroupTest, TrafficCountsWhatWentToEachPeerThroughEachNic) {
  const uint32_t n = GetParam().sender_nics;
  auto group_and_plan = GroupAndPlan();
  ASSERT_TRUE(group_and_plan.ok()) << group_and_plan.status();
  const auto [group, plan] = *group_and_plan;
  for (auto& b : b_) ASSERT_TRUE(b->CreateImmCounter(41).ok() && b->CreateImmCounter(42).ok());
  // Member m: two slices of 100 * (m + 1) bytes, each with the immediate, then a barrier.
  std::vector<ScatterTarget> targets;
  for (uint32_t m = 0; m < 3; ++m) {
    targets.push_back({m, 0, 0, 100 * (m + 1)});
    targets.push_back({m, 4096, 4096, 100 * (m + 1)});
  }
  TransferCounter done;
  ASSERT_TRUE(a_->Scatter({plan, targets, 41u}, Completion::Counter(&done)).ok());
  ASSERT_TRUE(a_->Barrier(group, 42, Completion::Counter(&done)).ok());
  // Peer 1 also gets a message of 3 bytes and an immediate alone; peer 0 a write sharded over
  // every NIC.
  const uint8_t three[3] = {1, 2, 3};
  ASSERT_TRUE(a_->Send(peers_[1], three, Completion::Counter(&done)).ok());
  ASSERT_TRUE(a_->WriteImm(peers_[1], 41, Completion::Counter(&done)).ok());
  SingleWrite w{.src = &src_reg_, .peer = peers_[0], .dst = dst_reg_[0].remote(),
                .length = kBytes};
  ASSERT_TRUE(a_->Write(w, Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(5, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  uint64_t writes_everywhere = 0;
  for (uint32_t m = 0; m < 3; ++m) {
    auto t = a_->Traffic(peers_[m]);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->size(), n);
    PeerTraffic sum;
    for (uint32_t k = 0; k < n; ++k) {
      const PeerTraffic& got = (*t)[k];
      writes_everywhere += got.writes;
      sum = {sum.writes + got.writes, sum.bytes + got.bytes, sum.imms + got.imms,
             sum.sends + got.sends};
      if (m == 2) {  // the scatter's and the barrier's writes, all from the member's NIC
        const bool serves = k == m % n;
        EXPECT_EQ(got.writes, serves ? 3u : 0u) << k;
        EXPECT_EQ(got.imms, serves ? 3u : 0u) << k;
        EXPECT_EQ(got.bytes, serves ? 600u : 0u) << k;
        EXPECT_EQ(got.sends, 0u) << k;
      }
    }
    if (m == 1) {  // and the message and the immediate alone, on the NIC that serves peer 1
      EXPECT_EQ(sum.writes, 4u);
      EXPECT_EQ(sum.imms, 4u);
      EXPECT_EQ(sum.bytes, 403u);
      EXPECT_EQ(sum.sends, 1u);
    }
    if (m == 0) {  // two slices, the barrier and the write sharded over every NIC
      EXPECT_EQ(sum.bytes, 200u + kBytes);
      EXPECT_EQ(sum.imms, 3u);
      EXPECT_EQ(sum.sends, 0u);
      for (uint32_t k = 0; k < n; ++k) {
        EXPECT_GT((*t)[k].writes, 0u) << "NIC " << k << " carried none of peer 0's writes";
      }
    }
  }
  EXPECT_EQ(writes_everywhere, a_->stats().wrs_posted - 1);  // all but the send
  // A removed peer's counts stay readable (final) until its slot serves another peer; the
  // next peer there starts from zero.
  const std::vector<PeerTraffic> before_removal = *a_->Traffic(peers_[2]);
  ASSERT_TRUE(a_->RemovePeer(peers_[2]).ok());
  auto removed = a_->Traffic(peers_[2]);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ((*removed)[2 % n].bytes, before_removal[2 % n].bytes);
  auto again = a_->AddPeer(b_[2]->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_NE(*again, peers_[2]);
  ASSERT_EQ(fabric::PeerSlot(*again), fabric::PeerSlot(peers_[2]));  // the freed entry, reused
  EXPECT_EQ(a_->Traffic(peers_[2]).status().code(), StatusCode::kUnavailable);
  auto fresh = a_->Traffic(*again);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  for (const PeerTraffic& t : *fresh) EXPECT_EQ(t.writes + t.bytes + t.imms + t.sends, 0u);
  EXPECT_EQ(a_->Traffic(PeerId{999}).status().code(), StatusCode::kNotFound);
}

TEST_P(DomainGroupTest, MessagesAndImmediatesNameTheirSenderWhicheverNicCarriesThem) {
  std::mutex mu;
  std::vector<std::optional<PeerId>> from_a;
  b_[2]->SetMessageHandler([&](std::optional<PeerId> from, std::span<const uint8_t> m) {
    std::lock_guard<std::mutex> lock(mu);
    if (m.size() == 3) from_a.push_back(from);
  });
  std::vector<std::optional<PeerId>> from_b;
  a_->SetMessageHandler([&](std::optional<PeerId> from, std::span<const uint8_t> m) {
    std::lock_guard<std::mutex> lock(mu);
    if (m.size() == 4) from_b.push_back(from);
  });
  ASSERT_TRUE(b_[2]->CreateImmCounter(31).ok());
  constexpr int kMessages = 12;
  TransferCounter done;
  const uint8_t three[3] = {1, 2, 3}, four[4] = {1, 2, 3, 4};
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(a_->Send(peers_[2], three, Completion::Counter(&done)).ok());
    ASSERT_TRUE(a_->WriteImm(peers_[2], 31, Completion::Counter(&done)).ok());
    ASSERT_TRUE(b_[2]->Send(0, four, Completion::Counter(&done)).ok());
  }
  ASSERT_TRUE(done.Wait(3 * kMessages, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  ASSERT_TRUE(b_[2]->WaitImm(31, kMessages, Deadline::After(10s)).ok());
  for (int i = 0; i < 1000; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (from_a.size() == kMessages && from_b.size() == kMessages) break;
    }
    std::this_thread::sleep_for(5ms);
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(from_a.size(), size_t{kMessages});
  ASSERT_EQ(from_b.size(), size_t{kMessages});
  for (auto f : from_a) EXPECT_EQ(f, std::optional<PeerId>(0));  // a is b_[2]'s peer 0
  for (auto f : from_b) EXPECT_EQ(f, std::optional<PeerId>(peers_[2]));
}

TEST_P(DomainGroupTest, ADescriptorWithTheWrongNicCountIsRefused) {
  RemoteRegion wrong = dst_reg_[0].remote();
  wrong.num_nics = GetParam().receiver_nics == 1 ? 2 : 1;
  SingleWrite w{.src = &src_reg_, .peer = peers_[0], .dst = wrong, .length = 8};
  Status s = a_->Write(w, Completion());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("NIC"), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(Groups, DomainGroupTest, ::testing::ValuesIn(Cases()), CaseName);

// A failing shard fails its transfer exactly once, with the provider's message; transfers on the
// healthy NIC are untouched.
TEST(DomainGroupFaultTest, AFailedShardFailsTheWholeTransferOnce) {
  const std::string provider = testing_util::Providers().front();
  EngineOptions o = GroupOptions(provider, 2);
  std::vector<std::unique_ptr<fabric::Domain>> domains;
  fabric::FaultInjectionDomain* fault = nullptr;
  for (int k = 0; k < 2; ++k) {
    auto d = fabric::OpenLibfabricDomain(o, "");
    ASSERT_TRUE(d.ok()) << d.status();
    if (k == 1) {
      auto f = std::make_unique<fabric::FaultInjectionDomain>(std::move(d).value());
      fault = f.get();
      domains.push_back(std::move(f));
    } else {
      domains.push_back(std::move(d).value());
    }
  }
  auto a = fabric::CreateEngineWithDomains(o, std::move(domains));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = TransferEngine::Create(GroupOptions(provider, 2));
  ASSERT_TRUE(b.ok()) << b.status();
  PeerId peer = *(*a)->AddPeer((*b)->Address());
  std::vector<uint8_t> src(1 << 20, 7), dst(1 << 20, 0);
  MemoryRegion src_reg = *(*a)->RegisterMemory(src.data(), src.size());
  MemoryRegion dst_reg = *(*b)->RegisterMemory(dst.data(), dst.size());
  fault->FailWritesToKey(dst_reg.remote().nics[1].key);  // what the sender's NIC 1 writes to

  std::atomic<int> calls{0};
  std::string message;
  SingleWrite big{.src = &src_reg, .peer = peer, .dst = dst_reg.remote(), .length = 1 << 20};
  ASSERT_TRUE((*a)->Write(big, Completion::Callback([&](const Status& s) {
                            if (!s.ok()) message = std::string(s.message());
                            calls.fetch_add(1);
                          }))
                  .ok());
  for (int i = 0; i < 2000 && calls.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);  // a second completion would show up by now
  EXPECT_EQ(calls.load(), 1);
  EXPECT_NE(message.find("injected fault"), std::string::npos) << message;
  // Small writes alternate NICs: the one on NIC 0 succeeds, the one on NIC 1 fails.
  TransferCounter small;
  for (int i = 0; i < 2; ++i) {
    SingleWrite w{.src = &src_reg, .peer = peer, .dst = dst_reg.remote(), .length = 64};
    ASSERT_TRUE((*a)->Write(w, Completion::Counter(&small)).ok());
  }
  ASSERT_TRUE(small.Wait(2, Deadline::After(10s)).ok());
  EXPECT_EQ(small.done.load(), 1u);
  EXPECT_EQ(small.failed.load(), 1u);
}

TEST(DomainGroupOptionsTest, NicCountsOutsideOneToFourAreRefused) {
  const std::string provider = testing_util::Providers().front();
  for (uint32_t n : {0u, kMaxNics + 1}) {
    EngineOptions o = GroupOptions(provider, n);
    auto e = TransferEngine::Create(o);
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << n;
  }
  EngineOptions o = GroupOptions(provider, 1);
  o.nics = {"a", "b", "c", "d", "e"};
  EXPECT_EQ(TransferEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.nics = {"no-such-nic"};
  EXPECT_FALSE(TransferEngine::Create(o).ok());
}

}  // namespace
}  // namespace ferry
