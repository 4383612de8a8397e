// The host AllToAll's proxy without its device: each rank's "device" is the test body, writing
// its counts row into the send region and raising the device flags as the host device does.
// Ranks run as processes over the shm provider.
#include "moe/proxy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fabric/test_util.h"

namespace ferry::moe {
namespace {

using namespace std::chrono_literals;

// One of two ranks (4 experts, top-2, 4 tokens, hidden 128, P = 2): the buffers, counters,
// peers and scatter plan AllToAll's Init sets up, and a proxy on them (peer timeout 1 s).
struct Rank {
  explicit Rank(int rank)
      : c{2, rank, 1, 4, 2, 4, 128, DispatchDtype::kBf16, 2}, layout(c), peer(1 - rank) {}

  Status Open(Bootstrap& b) {
    recv.assign(size_t(layout.recv_bytes), 0);
    send.assign(size_t(layout.send_bytes), 0);
    ASSIGN_OR_RETURN(engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(recv_reg, engine->RegisterMemory(recv.data(), recv.size()));
    ASSIGN_OR_RETURN(send_reg, engine->RegisterMemory(send.data(), send.size()));
    for (uint32_t kind = kCounts; kind <= kCombineConsumed; ++kind) {
      for (uint32_t epoch = 0; epoch < kEpochs; ++epoch) {
        RETURN_IF_ERROR(engine->CreateImmCounter(MoeImm(static_cast<ImmKind>(kind), epoch, 0)));
      }
    }
    ASSIGN_OR_RETURN(auto addresses, b.AllGather(engine->Address(), 30s));
    ASSIGN_OR_RETURN(auto regions, b.AllGather(recv_reg.remote().Serialize(), 30s));
    std::vector<PeerId> members;
    std::vector<RemoteRegion> dsts;
    for (int r = 0; r < c.world_size; ++r) {
      if (r == c.rank) continue;
      ASSIGN_OR_RETURN(PeerId peer, engine->AddPeer(addresses[r]));
      ASSIGN_OR_RETURN(RemoteRegion region, RemoteRegion::Parse(regions[r]));
      members.push_back(peer);
      dsts.push_back(region);
    }
    ProxyParams pp;
    ASSIGN_OR_RETURN(pp.group, engine->AddPeerGroup(members));
    ASSIGN_OR_RETURN(pp.plan, engine->PrepareScatter(pp.group, send_reg, dsts));
    RETURN_IF_ERROR(b.Barrier(30s));
    routing = std::make_unique<Routing>(c);
    pp.config = c;
    pp.engine = engine.get();
    pp.channel = &channel;
    pp.routing = routing.get();
    pp.recv = recv.data();
    pp.send = send.data();
    pp.peer_timeout_ms = 1000;
    proxy = std::make_unique<Proxy>(pp);
    return Status::Ok();
  }

  // The device's part of epoch 0: no copies for anyone, `rows` combine rows expected back from
  // the peer; then route-ready and send-ready.
  void Announce(int32_t rows) {
    auto* counts = reinterpret_cast<int32_t*>(send.data() + layout.send_counts_off);
    counts[c.num_experts + c.world_size + peer] = rows;
    channel.route_ready.store(1, std::memory_order_release);
    channel.send_ready.store(1, std::memory_order_release);
  }

  // Waits (at most `limit`) for the proxy to fail; its error, or Ok if it did not.
  Status AwaitFailure(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!channel.failed.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    return channel.failed.load() ? channel.Error() : Status::Ok();
  }

  // Waits (at most `limit`) for the proxy to publish the epoch's routing (recv-ready).
  Status AwaitRecvReady(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (channel.recv_ready.load(std::memory_order_acquire) < 1 && !channel.failed.load() &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    if (channel.recv_ready.load() == 1) return Status::Ok();
    return InternalError("no recv-ready: " + channel.Error().ToString());
  }

  const AllToAllConfig c;
  const MoeLayout layout;
  const int peer;
  std::vector<uint8_t> recv, send;
  std::unique_ptr<TransferEngine> engine;
  MemoryRegion recv_reg, send_reg;
  Channel channel;
  std::unique_ptr<Routing> routing;
  std::unique_ptr<Proxy> proxy;  // last: stopped before what it uses goes
};

// Every AllToAll immediate -- each kind, epoch, instance and (the relay's) sender at its
// extremes -- lies in the AllToAll range of ferry/immediates.h, and distinct fields give
// distinct immediates; the KV range's extremes lie in the KV range.
TEST(ImmediatesTest, EachPartsImmediatesStayInTheirRange) {
  std::vector<uint32_t> seen;
  for (ImmKind kind : {kCounts, kPrivate, kOverflow, kCombine, kDispatchConsumed,
                       kCombineConsumed, kRelayDispatch, kRelayCombine}) {
    for (uint64_t epoch : {uint64_t{0}, uint64_t{3}, uint64_t{1} << 40}) {
      for (int instance : {0, AllToAllConfig::kMaxInstances - 1}) {
        for (int sender : {0, 1, AllToAllConfig::kMaxWorldSize - 1}) {
          const uint32_t v = RelayImm(kind, epoch, instance, sender);
          EXPECT_TRUE(imm::kMoe.Holds(v)) << std::hex << v;
          EXPECT_FALSE(imm::kKv.Holds(v) || imm::kCaller.Holds(v)) << std::hex << v;
          if (epoch < kEpochs) seen.push_back(v);
        }
        EXPECT_TRUE(imm::kMoe.Holds(MoeImm(kind, epoch, instance)));
      }
    }
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "two fields collide";
  const uint32_t kv_last = imm::kKv.first | imm::kKvWeightMask | (imm::kKvMaxSlots - 1);
  EXPECT_TRUE(imm::kKv.Holds(imm::kKv.first) && imm::kKv.Holds(kv_last));
  EXPECT_FALSE(imm::kMoe.Holds(kv_last));
}

// Rank 1's counts row asks rank 0 for one combine row more than a rank can return (a corrupt or
// hostile peer). Rank 0's proxy refuses it when it arrives -- DataLoss naming rank 1 and what it
// asked -- before computing any offset from it; the channel then carries the error every later
// step of the AllToAll reports. Rank 1, whose routing is fine, gets everything it waits for.
TEST(ProxyTest, APeersImpossibleCountsRowIsDataLoss) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    Rank rank(b.rank());
    RETURN_IF_ERROR(rank.Open(b));
    const int64_t too_many = rank.layout.rows_per_pair + 1;
    rank.Announce(b.rank() == 1 ? static_cast<int32_t>(too_many) : 0);
    if (b.rank() == 0) {
      const Status s = rank.AwaitFailure(10s);
      CHECK_OR_RETURN(s.code() == StatusCode::kDataLoss &&
                          s.message().find("rank 1's counts row announces 0 dispatch slots and " +
                                           std::to_string(too_many) +
                                           " combine rows for rank 0") != std::string::npos,
                      "rank 0: " + s.ToString());
    } else {
      RETURN_IF_ERROR(rank.AwaitRecvReady(10s));
    }
    return b.Barrier(30s);  // rank 0's writes reach rank 1 before rank 0's engine goes
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// The control: the same two ranks with rows that fit get past the counts exchange and publish
// the routing (recv-ready), with the peer's row as it sent it.
TEST(ProxyTest, CountsRowsThatFitArePublished) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    Rank rank(b.rank());
    RETURN_IF_ERROR(rank.Open(b));
    const int64_t most = rank.layout.rows_per_pair;
    rank.Announce(static_cast<int32_t>(most));
    RETURN_IF_ERROR(rank.AwaitRecvReady(10s));
    CHECK_OR_RETURN(rank.routing->Rows(rank.peer, b.rank()) == most,
                    "the peer's row as published: " +
                        std::to_string(rank.routing->Rows(rank.peer, b.rank())));
    // Both consumed the epoch's dispatch before either leaves (the proxies' barrier).
    rank.channel.recv_consumed.store(1, std::memory_order_release);
    return b.Barrier(30s);
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry::moe
