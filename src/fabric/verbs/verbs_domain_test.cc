// The verbs backend end to end: TransferEngines over VerbsDomains over FakeVerbs (no RDMA device
// exists here). Covers the asynchronous UD handshake (with lost messages), RC writes with
// immediates into a shared receive queue, two-sided messages, scatter and barrier, a domain group
// of two NICs, and completion errors.
#include "fabric/verbs/verbs_domain.h"

#include <gtest/gtest.h>

#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "fabric/engine_internal.h"
#include "fabric/test_util.h"
#include "fabric/verbs/fake_verbs.h"
#include "ferry/kv.h"

namespace ferry::fabric::verbs {
namespace {

using namespace std::chrono_literals;

class VerbsEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    net_ = std::make_shared<FakeNet>();
    for (const char* d : {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"}) net_->AddDevice(d);
  }

  std::unique_ptr<TransferEngine> Engine(std::vector<std::string> devices,
                                         uint32_t max_peers = 1024, VerbsConfig config = {}) {
    EngineOptions o = testing_util::TestOptions("verbs");
    o.max_peers = max_peers;
    o.transfer_timeout_ms = 3000;
    o.num_recv_buffers = 16;
    o.nic_shard_min_bytes = 4096;
    std::vector<std::unique_ptr<Domain>> domains;
    for (const std::string& d : devices) {
      auto domain = OpenVerbsDomain(o, d, std::make_shared<FakeVerbs>(net_), config);
      EXPECT_TRUE(domain.ok()) << domain.status();
      if (!domain.ok()) return nullptr;
      domains.push_back(std::move(domain).value());
    }
    auto e = CreateEngineWithDomains(o, std::move(domains));
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : nullptr;
  }

  // `from` writes immediate `imm` to `peer`, the engine `to`: true once the write completed
  // without error and `to` has counted `count` of that immediate in all.
  static bool ImmLands(TransferEngine& from, PeerId peer, TransferEngine& to, uint32_t imm,
                       uint64_t count) {
    TransferCounter done;
    if (!from.WriteImm(peer, imm, Completion::Counter(&done)).ok()) return false;
    if (!done.Wait(1, Deadline::After(10s)).ok() || done.failed.load() != 0) return false;
    return to.WaitImm(imm, count, Deadline::After(10s)).ok();
  }

  // True once `device` holds exactly `n` RC queue pairs (within 5 s: the engines' workers
  // release closed ones as they poll).
  bool RcQpsBecome(const std::string& device, int n) {
    Deadline wait = Deadline::After(5s);
    while (net_->LiveRcQps(device) != n && !wait.Expired()) std::this_thread::sleep_for(1ms);
    return net_->LiveRcQps(device) == n;
  }

  // Closed connections released after 20 ms instead of a second.
  static VerbsConfig FastRelease() {
    VerbsConfig c;
    c.release_delay_ms = 20;
    return c;
  }

  std::shared_ptr<FakeNet> net_;
};

TEST_F(VerbsEngineTest, WritesImmediatesAndMessagesFlowAfterTheHandshake) {
  net_->DropUdMessages(3);  // the first handshakes are lost: they must be sent again
  auto a = Engine({"mlx5_0"});
  auto b = Engine({"mlx5_1"});
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->info().provider, "verbs");
  EXPECT_TRUE(a->info().removal_fences);  // the KV decoder then needs no keys per prefill
  // AddPeer does not wait for the other side.
  PeerId pb = *a->AddPeer(b->Address());
  std::this_thread::sleep_for(30ms);
  PeerId pa = *b->AddPeer(a->Address());

  std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0);
  std::mt19937 rng(1);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  MemoryRegion src_reg = *a->RegisterMemory(src.data(), src.size());
  MemoryRegion dst_reg = *b->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(b->CreateImmCounter(1).ok());
  ASSERT_TRUE(b->CreateImmCounter(2).ok());

  TransferCounter done;
  ASSERT_TRUE(a->Write({.src = &src_reg, .peer = pb, .dst = dst_reg.remote(),
                        .length = 300000, .imm = 1u},
                       Completion::Counter(&done))
                  .ok());
  std::vector<uint32_t> pages = {9, 3, 7}, to = {0, 1, 2};
  ASSERT_TRUE(a->WritePaged({.src = &src_reg, .peer = pb, .dst = dst_reg.remote(),
                             .page_bytes = 4096, .src_stride = 4096, .dst_stride = 4096,
                             .dst_offset = 512 * 1024, .src_pages = pages, .dst_pages = to,
                             .imm = 2u},
                            Completion::Counter(&done))
                  .ok());
  ASSERT_TRUE(a->WriteImm(pb, 2, Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(3, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  ASSERT_TRUE(b->WaitImm(1, 1, Deadline::After(5s)).ok());
  ASSERT_TRUE(b->WaitImm(2, 4, Deadline::After(5s)).ok());  // 3 pages + 1 immediate alone
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + 300000, dst.begin()));
  for (size_t i = 0; i < pages.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(dst.data() + 512 * 1024 + to[i] * 4096,
                             src.data() + pages[i] * 4096, 4096));
  }
  EXPECT_GT(net_->ud_dropped(), 0);

  // Messages both ways name their sender.
  std::atomic<int> at_b{0}, at_a{0};
  b->SetMessageHandler([&](std::optional<PeerId> from, std::span<const uint8_t> m) {
    if (from == pa && m.size() == 5 && m[4] == 5) at_b.fetch_add(1);
  });
  a->SetMessageHandler([&](std::optional<PeerId> from, std::span<const uint8_t> m) {
    if (from == pb && m.size() == 2) at_a.fetch_add(1);
  });
  const uint8_t five[5] = {1, 2, 3, 4, 5}, two[2] = {1, 2};
  TransferCounter sent;
  for (int i = 0; i < 40; ++i) {  // more than the receive buffers: they must be re-posted
    while (a->Send(pb, five, Completion::Counter(&sent)).code() ==
           StatusCode::kResourceExhausted) {
      std::this_thread::sleep_for(1ms);
    }
  }
  ASSERT_TRUE(b->Send(pa, two, Completion::Counter(&sent)).ok());
  ASSERT_TRUE(sent.Wait(41, Deadline::After(10s)).ok());
  EXPECT_EQ(sent.failed.load(), 0u);
  for (int i = 0; i < 2000 && (at_b.load() < 40 || at_a.load() < 1); ++i) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(at_b.load(), 40);
  EXPECT_EQ(at_a.load(), 1);
}

// A peer this engine lost (here: removed, its goodbye lost on the way) and added again, while
// the other side still holds the old connection's queue pairs: the new connection replaces
// them there, and writes flow both ways again (the other side keeps its PeerId). With the
// goodbye heard, see ARemovedPeerHearsGoodbyeAndReconnectsWhenItAddsUsAgain.
TEST_F(VerbsEngineTest, ALostPeerAddedAgainReconnectsBothWays) {
  auto a = Engine({"mlx5_0"}, 1024, FastRelease());
  auto b = Engine({"mlx5_1"}, 1024, FastRelease());
  ASSERT_TRUE(a && b);
  const PeerId pb = *a->AddPeer(b->Address());
  const PeerId pa = *b->AddPeer(a->Address());
  std::vector<uint8_t> src(4096, 7), dst(4096, 0);
  MemoryRegion src_reg = *a->RegisterMemory(src.data(), src.size());
  MemoryRegion dst_reg = *b->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(b->CreateImmCounter(1).ok());
  ASSERT_TRUE(a->CreateImmCounter(2).ok());
  auto write = [&](PeerId peer) {
    TransferCounter done;
    Status s = a->Write({.src = &src_reg, .peer = peer, .dst = dst_reg.remote(), .length = 4096,
                         .imm = 1u},
                        Completion::Counter(&done));
    if (s.ok()) s = done.Wait(1, Deadline::After(10s));
    return s.ok() && done.failed.load() == 0;
  };
  auto answer = [&] {
    TransferCounter done;
    Status s = b->WriteImm(pa, 2, Completion::Counter(&done));
    if (s.ok()) s = done.Wait(1, Deadline::After(10s));
    return s.ok() && done.failed.load() == 0;
  };
  ASSERT_TRUE(write(pb));
  ASSERT_TRUE(answer());
  net_->DropUdMessages(1);  // the goodbye
  ASSERT_TRUE(a->RemovePeer(pb).ok());
  const PeerId again = *a->AddPeer(b->Address());
  EXPECT_NE(again, pb);
  EXPECT_TRUE(write(again)) << "a write over the new connection";
  EXPECT_TRUE(answer()) << "the other side's write over the new connection";
  EXPECT_TRUE(b->WaitImm(1, 2, Deadline::After(5s)).ok());
  EXPECT_TRUE(a->WaitImm(2, 2, Deadline::After(5s)).ok());
  EXPECT_FALSE(*b->PeerLost(pa));
  // The replaced queue pairs (b) and the removed peer's (a) are destroyed: each side holds the
  // new connection's two.
  EXPECT_TRUE(RcQpsBecome("mlx5_0", 2));
  EXPECT_TRUE(RcQpsBecome("mlx5_1", 2));
  EXPECT_TRUE(answer()) << "and the connection still carries writes";
}

// Every object a domain made on the device goes with it, whatever its connections were left
// doing: the queue pairs of live, closed and replaced connections (not yet released: that
// waits a second), address handles, registrations (one outliving its engine), and the domain's
// own CQ, SRQs, UD queue pair, PD and device.
TEST_F(VerbsEngineTest, ADomainDestroysEveryObjectItMadeOnTheDevice) {
  {
    auto a = Engine({"mlx5_0"});
    auto b = Engine({"mlx5_1"});
    ASSERT_TRUE(a && b);
    EXPECT_GT(net_->live_objects.load(), 0);
    const PeerId pb = *a->AddPeer(b->Address());
    const PeerId pa = *b->AddPeer(a->Address());
    ASSERT_TRUE(b->CreateImmCounter(4).ok());
    ASSERT_TRUE(a->CreateImmCounter(5).ok());
    ASSERT_TRUE(ImmLands(*a, pb, *b, 4, 1));
    net_->DropUdMessages(1);  // the goodbye: b replaces its connection when a comes again
    ASSERT_TRUE(a->RemovePeer(pb).ok());
    const PeerId again = *a->AddPeer(b->Address());
    ASSERT_TRUE(ImmLands(*a, again, *b, 4, 2));
    ASSERT_TRUE(ImmLands(*b, pa, *a, 5, 1));
    std::vector<uint8_t> buf(4096);
    MemoryRegion kept = *a->RegisterMemory(buf.data(), buf.size());
    MemoryRegion dropped = *b->RegisterMemory(buf.data(), buf.size());
    dropped = MemoryRegion();  // deregistered before its engine goes
    a.reset();
    b.reset();  // `kept` outlives its engine
  }
  EXPECT_EQ(net_->live_objects.load(), 0);
}

TEST_F(VerbsEngineTest, ScatterBarrierAndATwoNicGroupShardOverQueuePairs) {
  auto a = Engine({"mlx5_0", "mlx5_1"});
  std::vector<std::unique_ptr<TransferEngine>> bs;
  bs.push_back(Engine({"mlx5_2", "mlx5_3"}));
  bs.push_back(Engine({"mlx5_2"}));
  ASSERT_TRUE(a && bs[0] && bs[1]);
  std::vector<PeerId> peers;
  for (auto& b : bs) {
    peers.push_back(*a->AddPeer(b->Address()));
    ASSERT_TRUE(b->AddPeer(a->Address()).ok());
  }
  std::vector<uint8_t> src(1 << 20);
  std::iota(src.begin(), src.end(), 0);
  MemoryRegion src_reg = *a->RegisterMemory(src.data(), src.size());
  std::vector<std::vector<uint8_t>> dst(2, std::vector<uint8_t>(1 << 20, 0));
  std::vector<MemoryRegion> dst_reg;
  std::vector<RemoteRegion> remote;
  for (int i = 0; i < 2; ++i) {
    dst_reg.push_back(*bs[i]->RegisterMemory(dst[i].data(), dst[i].size()));
    remote.push_back(dst_reg.back().remote());
    ASSERT_TRUE(bs[i]->CreateImmCounter(7).ok() && bs[i]->CreateImmCounter(8).ok());
  }
  GroupId group = *a->AddPeerGroup(peers);
  ScatterPlanId plan = *a->PrepareScatter(group, src_reg, remote);
  std::vector<ScatterTarget> targets = {{0, 0, 100, 5000}, {1, 5000, 0, 7000}};
  TransferCounter done;
  ASSERT_TRUE(a->Scatter({plan, targets, 7u}, Completion::Counter(&done)).ok());
  ASSERT_TRUE(a->Barrier(group, 8, Completion::Counter(&done)).ok());
  // A large write to the two-NIC peer is sharded over both of our NICs.
  auto before = a->stats().wrs_posted_per_nic;
  ASSERT_TRUE(a->Write({.src = &src_reg, .peer = peers[0], .dst = remote[0],
                        .dst_offset = 8192, .length = 900000},
                       Completion::Counter(&done))
                  .ok());
  ASSERT_TRUE(done.Wait(3, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  auto after = a->stats().wrs_posted_per_nic;
  EXPECT_GE(after[0] - before[0], 1u);
  EXPECT_GE(after[1] - before[1], 1u);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(bs[i]->WaitImm(7, 1, Deadline::After(5s)).ok());
    ASSERT_TRUE(bs[i]->WaitImm(8, 1, Deadline::After(5s)).ok());
  }
  EXPECT_EQ(0, std::memcmp(dst[0].data() + 100, src.data(), 5000));
  EXPECT_EQ(0, std::memcmp(dst[1].data(), src.data() + 5000, 7000));
  EXPECT_EQ(0, std::memcmp(dst[0].data() + 8192, src.data(), 900000));
}

TEST_F(VerbsEngineTest, CompletionErrorsFailTheirTransferWithContext) {
  auto a = Engine({"mlx5_0"}, 1024, FastRelease());
  auto b = Engine({"mlx5_1"});
  ASSERT_TRUE(a && b);
  PeerId pb = *a->AddPeer(b->Address());
  ASSERT_TRUE(b->AddPeer(a->Address()).ok());
  std::vector<uint8_t> src(4096, 1), dst(4096, 0);
  MemoryRegion src_reg = *a->RegisterMemory(src.data(), src.size());
  MemoryRegion dst_reg = *b->RegisterMemory(dst.data(), dst.size());
  // A stale key (as after the peer deregistered): the device reports a remote access error.
  RemoteRegion stale = dst_reg.remote();
  stale.nics[0].key += 1000;
  // One write's outcome, waited for.
  struct Outcome {
    std::atomic<bool> called{false};
    Status status;
  };
  auto outcome = [&](const RemoteRegion& dst) -> Status {
    auto out = std::make_shared<Outcome>();  // outlives a late callback
    Status posted = a->Write({.src = &src_reg, .peer = pb, .dst = dst, .length = 64},
                             Completion::Callback([out](const Status& s) {
                               out->status = s;
                               out->called = true;
                             }));
    if (!posted.ok()) return posted;
    for (int i = 0; i < 5000 && !out->called; ++i) std::this_thread::sleep_for(1ms);
    return out->called ? out->status : InternalError("no completion");
  };
  Status seen = outcome(stale);
  EXPECT_EQ(seen.code(), StatusCode::kInvalidArgument) << seen;
  EXPECT_NE(seen.message().find("remote access error"), std::string::npos) << seen;
  EXPECT_NE(seen.message().find("QP"), std::string::npos) << seen;
  // A dead peer: retries exhausted, the transfer fails Unavailable.
  net_->KillDevice("mlx5_1");
  seen = outcome(dst_reg.remote());
  EXPECT_EQ(seen.code(), StatusCode::kUnavailable) << seen;
  // Failed WRs left the send queue too (their opcode undefined, their id says so): once
  // removed, the peer's queue pairs are destroyed.
  ASSERT_TRUE(a->RemovePeer(pb).ok());
  EXPECT_TRUE(RcQpsBecome("mlx5_0", 0));
}

// Only one side adds the other: the other's domain connects when the hello arrives, so writes
// and messages flow at once; the messages arrive naming no PeerId until the receiver adds the
// sender, which then takes over that connection (one connection, not two: replies flow too).
TEST_F(VerbsEngineTest, APeerAddedOnOneSideOnlyConnectsAndIsClaimedWhenAddedBack) {
  auto a = Engine({"mlx5_0"});
  auto b = Engine({"mlx5_1"});
  ASSERT_TRUE(a && b);
  std::mutex mu;
  std::vector<std::optional<PeerId>> from;
  b->SetMessageHandler([&](std::optional<PeerId> f, std::span<const uint8_t>) {
    std::lock_guard<std::mutex> lock(mu);
    from.push_back(f);
  });
  PeerId pb = *a->AddPeer(b->Address());  // b has not added a
  ASSERT_TRUE(b->CreateImmCounter(9).ok());
  std::vector<uint8_t> src(4096), dst(4096, 0);
  std::iota(src.begin(), src.end(), 0);
  MemoryRegion src_reg = *a->RegisterMemory(src.data(), src.size());
  MemoryRegion dst_reg = *b->RegisterMemory(dst.data(), dst.size());
  TransferCounter done;
  const std::vector<uint8_t> hello = {1, 2, 3};
  ASSERT_TRUE(a->Send(pb, hello, Completion::Counter(&done)).ok());
  ASSERT_TRUE(a->Write({.src = &src_reg, .peer = pb, .dst = dst_reg.remote(), .length = 4096,
                        .imm = 9},
                       Completion::Counter(&done))
                  .ok());
  ASSERT_TRUE(done.Wait(2, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  ASSERT_TRUE(b->WaitImm(9, 1, Deadline::After(10s)).ok());
  EXPECT_EQ(dst, src);
  // Now b adds a (as KvPrefill does on a's request): the connection a made is b's too.
  auto pa = b->AddPeer(a->Address());
  ASSERT_TRUE(pa.ok()) << pa.status();
  ASSERT_TRUE(a->CreateImmCounter(10).ok());
  ASSERT_TRUE(ImmLands(*b, *pa, *a, 10, 1));
  ASSERT_TRUE(a->Send(pb, hello, Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(3, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  Deadline wait = Deadline::After(10s);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (from.size() == 2 || wait.Expired()) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(from.size(), 2u);
  EXPECT_FALSE(from[0].has_value());  // before b knew a
  EXPECT_EQ(from[1], std::optional<PeerId>(*pa));
}

// One side of the KV tests over verbs: TP 2 shards of a small cache (8 heads of 16, 4-token
// pages), kKvPages pages a layer, kKvLayers layers, random bytes.
constexpr int kKvLayers = 2, kKvPages = 8;
const KvSide kKvSide{KvModel{8, 16, 2, false, 4}, KvOrder::kHND, 2};
struct KvShards {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<MemoryRegion> regs;
  KvRegions regions;
  int64_t stride = kKvSide.page_bytes() * kKvPages;

  explicit KvShards(TransferEngine& e, uint32_t seed) {
    std::mt19937 rng(seed);
    bytes.assign(2, std::vector<uint8_t>(stride * kKvLayers));
    for (auto& b : bytes) {
      for (auto& v : b) v = static_cast<uint8_t>(rng());
      regs.push_back(*e.RegisterMemory(b.data(), b.size()));
    }
    regions = {{&regs[0], &regs[1]}, kKvLayers, stride};
  }
  // Whether our pages `mine` hold `from`'s pages `theirs`, every rank and layer.
  bool Holds(const KvShards& from, std::span<const int64_t> mine,
             std::span<const int64_t> theirs) const {
    const int64_t page = kKvSide.page_bytes();
    for (int r = 0; r < 2; ++r) {
      for (int l = 0; l < kKvLayers; ++l) {
        for (size_t i = 0; i < mine.size(); ++i) {
          if (std::memcmp(bytes[r].data() + l * stride + mine[i] * page,
                          from.bytes[r].data() + l * stride + theirs[i] * page, page) != 0) {
            return false;
          }
        }
      }
    }
    return true;
  }
};

// A prefill that schedules source pages {5, 1, 6} for every request as it arrives.
struct KvServer {
  std::atomic<uint64_t> layers{0};
  std::unique_ptr<KvPrefill> prefill;
  const std::vector<int64_t> pages = {5, 1, 6};

  Status Open(TransferEngine* e, const KvShards& shards) {
    KvPrefill::Callbacks cb;
    cb.on_request = [this](const KvPrefill::Incoming& in) {
      EXPECT_TRUE(prefill->Schedule(in.request_id, pages, 0, 0).ok());
      layers.store(kKvLayers);
    };
    ASSIGN_OR_RETURN(prefill, KvPrefill::Create(e, kKvSide, shards.regions, nullptr, &layers, cb));
    return Status::Ok();
  }
};

// Asks the prefill at `address` for request `id` into pages {2, 7, 0} and waits for its end.
Status KvAskOnce(KvDecoder& decoder, std::span<const uint8_t> address, uint64_t id) {
  const std::vector<int64_t> pages = {2, 7, 0};
  std::atomic<int> calls{0};
  Status outcome;
  KvDecoder::Request req{.request_id = id, .prefill_address = address, .prefill = kKvSide,
                         .pages = pages};
  RETURN_IF_ERROR(decoder.Submit(req, Deadline::After(10s), [&](const Status& s) {
    outcome = s;
    calls.fetch_add(1);
  }));
  Deadline wait = Deadline::After(15s);
  while (calls.load() == 0 && !wait.Expired()) std::this_thread::sleep_for(1ms);
  if (calls.load() == 0) return DeadlineExceededError("request never ended");
  return outcome;
}
// The same, asking again once when the request did not reach the prefill (sent as the prefill
// removed us: Unavailable at once); `undelivered` counts those.
Status KvAsk(KvDecoder& decoder, std::span<const uint8_t> address, uint64_t id,
             int* undelivered = nullptr) {
  Status s = KvAskOnce(decoder, address, id);
  if (s.code() != StatusCode::kUnavailable) return s;
  if (undelivered) ++*undelivered;
  return KvAskOnce(decoder, address, id);
}

// The KV messenger over verbs: the prefill adds a decoder only once its request has arrived,
// which needs the connection the decoder's hello makes on the prefill's side.
TEST_F(VerbsEngineTest, AKvRequestReachesAPrefillThatNeverAddedItsDecoder) {
  auto pe = Engine({"mlx5_0"});
  auto de = Engine({"mlx5_1"});
  ASSERT_TRUE(pe && de);
  KvShards src(*pe, 5), dst(*de, 6);
  KvServer server;
  ASSERT_TRUE(server.Open(pe.get(), src).ok());
  auto d = KvDecoder::Create(de.get(), kKvSide, dst.regions, nullptr);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::vector<uint8_t> address = pe->Address();
  Status s = KvAsk(**d, address, 3);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<int64_t> mine = {2, 7, 0};
  EXPECT_TRUE(dst.Holds(src, mine, server.pages));
  d->reset();
}

// A prefill whose engine holds one peer, two decoders taking turns over verbs: each newcomer
// takes the entry of the idle decoder, whose engine gets our goodbye and marks the prefill
// lost; its next request adds the prefill again, which reconnects.
TEST_F(VerbsEngineTest, APrefillOfOnePeerEntryServesTwoDecodersTakingTurns) {
  auto pe = Engine({"mlx5_0"}, /*max_peers=*/1);
  auto d1e = Engine({"mlx5_1"});
  auto d2e = Engine({"mlx5_2"});
  ASSERT_TRUE(pe && d1e && d2e);
  KvShards src(*pe, 5), dst1(*d1e, 6), dst2(*d2e, 7);
  KvServer server;
  ASSERT_TRUE(server.Open(pe.get(), src).ok());
  auto d1 = KvDecoder::Create(d1e.get(), kKvSide, dst1.regions, nullptr);
  auto d2 = KvDecoder::Create(d2e.get(), kKvSide, dst2.regions, nullptr);
  ASSERT_TRUE(d1.ok() && d2.ok());
  const std::vector<uint8_t> address = pe->Address();
  const std::vector<int64_t> mine = {2, 7, 0};
  int undelivered = 0;
  for (int turn = 0; turn < 4; ++turn) {
    KvDecoder& d = turn % 2 ? **d2 : **d1;
    const auto start = std::chrono::steady_clock::now();
    Status s = KvAsk(d, address, 10 + turn, &undelivered);
    ASSERT_TRUE(s.ok()) << "turn " << turn << ": " << s;
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "turn " << turn;
  }
  EXPECT_LE(undelivered, 2);  // at most once per returning decoder
  EXPECT_TRUE(dst1.Holds(src, mine, server.pages));
  EXPECT_TRUE(dst2.Holds(src, mine, server.pages));
  d1->reset();
  d2->reset();
}

// RemovePeer says goodbye: the other side marks us lost at once (not when its next transfer
// times out), and adding us again reconnects both ways.
TEST_F(VerbsEngineTest, ARemovedPeerHearsGoodbyeAndReconnectsWhenItAddsUsAgain) {
  auto a = Engine({"mlx5_0"});
  auto b = Engine({"mlx5_1"});
  ASSERT_TRUE(a && b);
  PeerId pb = *a->AddPeer(b->Address());
  PeerId pa = *b->AddPeer(a->Address());
  ASSERT_TRUE(b->CreateImmCounter(4).ok());
  ASSERT_TRUE(ImmLands(*a, pb, *b, 4, 1));
  ASSERT_TRUE(b->RemovePeer(pa).ok());
  Deadline wait = Deadline::After(5s);
  while (!*a->PeerLost(pb) && !wait.Expired()) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(*a->PeerLost(pb));
  EXPECT_EQ(a->WriteImm(pb, 4, Completion()).code(), StatusCode::kUnavailable);
  auto again = a->AddPeer(b->Address());  // b has not added a again: its domain connects
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(ImmLands(*a, *again, *b, 4, 2));
  auto back = b->AddPeer(a->Address());
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(a->CreateImmCounter(5).ok());
  EXPECT_TRUE(ImmLands(*b, *back, *a, 5, 1));
}

// A long-lived engine's peers come and go (a KV prefill's decoders): a removed peer's queue
// pairs are destroyed once drained, and its table index serves the next peer. Before, every
// peer ever added kept two queue pairs on the device (and a table entry every Poll walked).
TEST_F(VerbsEngineTest, RemovedPeersReleaseTheirQueuePairs) {
  auto a = Engine({"mlx5_0"}, 1024, FastRelease());
  auto b = Engine({"mlx5_1"}, 1024, FastRelease());
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(b->CreateImmCounter(4).ok());
  ASSERT_TRUE(a->CreateImmCounter(5).ok());
  for (int round = 1; round <= 6; ++round) {
    SCOPED_TRACE(round);
    PeerId pb = *a->AddPeer(b->Address());
    PeerId pa = *b->AddPeer(a->Address());
    ASSERT_TRUE(ImmLands(*a, pb, *b, 4, round));
    ASSERT_TRUE(ImmLands(*b, pa, *a, 5, round));
    EXPECT_EQ(net_->LiveRcQps("mlx5_0"), 2);
    EXPECT_EQ(net_->LiveRcQps("mlx5_1"), 2);
    ASSERT_TRUE(a->RemovePeer(pb).ok());
    ASSERT_TRUE(b->RemovePeer(pa).ok());
    EXPECT_TRUE(RcQpsBecome("mlx5_0", 0));
    EXPECT_TRUE(RcQpsBecome("mlx5_1", 0));
  }
}

// Connections a domain made for peers its engine never added: one whose peer removes us ends
// with the peer's goodbye, and at max_unclaimed_peers the oldest one ends to make room (its
// peer hears goodbye: lost at once, not at its transfers' deadline). Before, an unclaimed
// connection lived until the domain closed and counted against the bound for good: past it,
// no new peer could reach an engine that had not added it (a KV prefill, which adds a decoder
// only once its first request has arrived, stopped serving new decoders).
TEST_F(VerbsEngineTest, UnclaimedConnectionsEndWithAGoodbyeOrMakeRoomOldestFirst) {
  VerbsConfig one = FastRelease();
  one.max_unclaimed_peers = 1;
  auto b = Engine({"mlx5_1"}, 1024, one);
  auto a = Engine({"mlx5_0"}, 1024, FastRelease());
  auto c = Engine({"mlx5_2"}, 1024, FastRelease());
  auto d = Engine({"mlx5_3"}, 1024, FastRelease());
  ASSERT_TRUE(a && b && c && d);
  ASSERT_TRUE(b->CreateImmCounter(7).ok());
  PeerId ab = *a->AddPeer(b->Address());  // b never adds a
  ASSERT_TRUE(ImmLands(*a, ab, *b, 7, 1));
  ASSERT_TRUE(a->RemovePeer(ab).ok());
  EXPECT_TRUE(RcQpsBecome("mlx5_1", 0));  // a's goodbye ended b's connection for it
  PeerId cb = *c->AddPeer(b->Address());  // ... whose room serves the next peer
  ASSERT_TRUE(ImmLands(*c, cb, *b, 7, 2));
  PeerId db = *d->AddPeer(b->Address());  // b is at its bound: c's connection makes room
  ASSERT_TRUE(ImmLands(*d, db, *b, 7, 3));
  Deadline wait = Deadline::After(5s);
  while (!*c->PeerLost(cb) && !wait.Expired()) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(*c->PeerLost(cb));
  EXPECT_EQ(c->WriteImm(cb, 7, Completion()).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(RcQpsBecome("mlx5_1", 2));  // d's alone
  // b adds d: it claims d's connection (no new queue pairs), which is then no longer at risk.
  auto bd = b->AddPeer(d->Address());
  ASSERT_TRUE(bd.ok()) << bd.status();
  ASSERT_TRUE(d->CreateImmCounter(8).ok());
  EXPECT_TRUE(ImmLands(*b, *bd, *d, 8, 1));
  EXPECT_EQ(net_->LiveRcQps("mlx5_1"), 2);
  // c adds b again: a new unclaimed connection, d's claimed one untouched.
  auto again = c->AddPeer(b->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(ImmLands(*c, *again, *b, 7, 4));
  EXPECT_TRUE(ImmLands(*b, *bd, *d, 8, 2));
  EXPECT_TRUE(RcQpsBecome("mlx5_1", 4));
}

TEST_F(VerbsEngineTest, AnUnansweredHandshakeEndsInTheTransferDeadline) {
  auto a = Engine({"mlx5_0"});
  auto b = Engine({"mlx5_1"});
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> src(64, 1), dst(64, 0);
  MemoryRegion src_reg = *a->RegisterMemory(src.data(), src.size());
  MemoryRegion dst_reg = *b->RegisterMemory(dst.data(), dst.size());
  net_->KillDevice("mlx5_1");  // b never answers
  PeerId pb = *a->AddPeer(b->Address());
  TransferCounter done;
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(a->Write({.src = &src_reg, .peer = pb, .dst = dst_reg.remote(), .length = 64},
                       Completion::Counter(&done))
                  .ok());
  ASSERT_TRUE(done.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 8s);
}

TEST(VerbsDomainTest, NoDeviceMeansACleanRefusal) {
  auto net = std::make_shared<FakeNet>();
  EngineOptions o;
  auto d = OpenVerbsDomain(o, "", std::make_shared<FakeVerbs>(net), VerbsConfig{});
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("no RDMA device found"), std::string::npos) << d.status();
  net->AddDevice("mlx5_0");
  d = OpenVerbsDomain(o, "mlx5_9", std::make_shared<FakeVerbs>(net), VerbsConfig{});
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound) << d.status();
  VerbsConfig bad;
  bad.gid_index = 4;  // the fake has GID 0 only
  d = OpenVerbsDomain(o, "", std::make_shared<FakeVerbs>(net), bad);
  EXPECT_FALSE(d.ok());
  // This machine's real devices: none here, so the real wrapper refuses the same way.
  auto real = NewRealVerbsApi();
  if (real->DeviceNames().empty()) {
    d = OpenVerbsDomain(o, "", std::move(real), VerbsConfig{});
    EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status();
  }
  // Addresses are validated like every other wire format.
  UdAddress addr{7, {}, 3, 1, 0x1234};
  auto bytes = addr.Serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(UdAddress::Parse(std::span(bytes).first(n)).ok());
  }
  EXPECT_TRUE(UdAddress::Parse(bytes).ok());
}

TEST(VerbsDomainTest, EnginesPickTheBackendAndRefuseVerbsWithoutADevice) {
  if (!NewRealVerbsApi()->DeviceNames().empty()) GTEST_SKIP() << "this machine has RDMA devices";
  EngineOptions o = testing_util::TestOptions("verbs");
  auto verbs = TransferEngine::Create(o);
  EXPECT_EQ(verbs.status().code(), StatusCode::kUnavailable) << verbs.status();
  EXPECT_NE(verbs.status().message().find("no RDMA device found"), std::string::npos);
  // Automatic: no EFA and no RDMA device here, so shared memory.
  o.provider.clear();
  auto any = TransferEngine::Create(o);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ((*any)->info().provider, "shm");
}

}  // namespace
}  // namespace ferry::fabric::verbs
