// PeerLru: room is made in a full peer table by removing the least recently used peer no request
// needs; entries the engine already let go are passed over (they free nothing), and a table of
// busy peers stays full.
#include "kv/peer_lru.h"

#include <gtest/gtest.h>

#include <memory>

#include "fabric/test_util.h"

namespace ferry::kv {
namespace {

std::unique_ptr<TransferEngine> Make(uint32_t max_peers) {
  EngineOptions o = testing_util::TestOptions(testing_util::Providers().front());
  o.max_peers = max_peers;
  auto e = TransferEngine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

TEST(PeerLruTest, MakesRoomFromTheLeastRecentlyUsedIdlePeerPastOnesAlreadyGone) {
  auto self = Make(2);
  auto a = Make(4), b = Make(4), c = Make(4), d = Make(4);
  ASSERT_TRUE(self && a && b && c && d);
  PeerLru lru;
  auto none = [] { return std::vector<PeerId>{}; };
  std::vector<PeerId> evicted;
  auto note = [&](PeerId p) { evicted.push_back(p); };
  auto pa = lru.AddMakingRoom(*self, a->Address(), none, note);
  auto pb = lru.AddMakingRoom(*self, b->Address(), none, note);
  ASSERT_TRUE(pa.ok() && pb.ok());
  // a went away without this list knowing (removed directly): its entry is stale. Then c takes
  // the free entry, so the table is full of b and c.
  ASSERT_TRUE(self->RemovePeer(*pa).ok());
  auto pc = self->AddPeer(c->Address());
  ASSERT_TRUE(pc.ok()) << pc.status();
  lru.Touch(*pc);
  lru.Touch(*pb);  // b used after c: c is now the least recently used live peer
  // d: a (stale, oldest) is passed over, c makes room; b stays.
  auto pd = lru.AddMakingRoom(*self, d->Address(), none, note);
  ASSERT_TRUE(pd.ok()) << pd.status();
  EXPECT_EQ(evicted, (std::vector<PeerId>{*pa, *pc}));
  EXPECT_TRUE(*self->PeerLost(*pc));
  EXPECT_FALSE(*self->PeerLost(*pb));
  // Every peer busy: the table stays full.
  const std::vector<PeerId> all = {*pb, *pd};
  auto pa2 = lru.AddMakingRoom(*self, a->Address(), [&] { return all; }, note);
  EXPECT_EQ(pa2.status().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(*self->PeerLost(*pb));
  EXPECT_FALSE(*self->PeerLost(*pd));
}

}  // namespace
}  // namespace ferry::kv
