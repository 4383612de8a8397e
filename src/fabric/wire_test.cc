#include "fabric/wire.h"

#include <gtest/gtest.h>

#include <random>

#include "ferry/fabric.h"

namespace ferry::fabric {
namespace {

RemoteRegion Region(uint64_t engine, uint64_t length, std::vector<NicKey> nics) {
  RemoteRegion r;
  r.engine_id = engine;
  r.length = length;
  r.num_nics = static_cast<uint32_t>(nics.size());
  for (size_t i = 0; i < nics.size() && i < kMaxNics; ++i) r.nics[i] = nics[i];
  return r;
}

TEST(WireTest, RegionRoundTripsWithEveryNicCount) {
  for (uint32_t n = 1; n <= kMaxNics; ++n) {
    std::vector<NicKey> nics;
    for (uint32_t i = 0; i < n; ++i) nics.push_back({0x7f0000001000ull + i, 0xdeadbeef00ull + i});
    RemoteRegion r = Region(0x1234, 1 << 20, nics);
    auto p = RemoteRegion::Parse(r.Serialize());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->engine_id, r.engine_id);
    EXPECT_EQ(p->length, r.length);
    ASSERT_EQ(p->num_nics, n);
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_EQ(p->nics[i].base, nics[i].base);
      EXPECT_EQ(p->nics[i].key, nics[i].key);
    }
  }
  // No NIC, or more than an engine can have, is malformed.
  EXPECT_EQ(RemoteRegion::Parse(Region(1, 8, {}).Serialize()).status().code(),
            StatusCode::kInvalidArgument);
  RemoteRegion five = Region(1, 8, {{1, 1}});
  five.num_nics = kMaxNics + 1;
  auto bytes = five.Serialize();
  EXPECT_EQ(RemoteRegion::Parse(bytes).status().code(), StatusCode::kInvalidArgument);
}

TEST(WireTest, AddressRoundTrips) {
  EngineAddress a{77, "tcp;ofi_rxm", {{{1, 2, 3, 4, 5}, 0x1000, 9}, {{6, 7}, 0x2000, 10}}};
  auto p = EngineAddress::Parse(a.Serialize());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->engine_id, 77u);
  EXPECT_EQ(p->provider, "tcp;ofi_rxm");
  ASSERT_EQ(p->nics.size(), 2u);
  EXPECT_EQ(p->nics[0].name, a.nics[0].name);
  EXPECT_EQ(p->nics[1].name, a.nics[1].name);
  EXPECT_EQ(p->nics[0].sink_base, 0x1000u);
  EXPECT_EQ(p->nics[1].sink_key, 10u);
  EngineAddress none{77, "shm", {}};
  EXPECT_EQ(EngineAddress::Parse(none.Serialize()).status().code(), StatusCode::kInvalidArgument);
}

TEST(WireTest, EveryTruncationAndCorruptionIsRejectedCleanly) {
  std::vector<uint8_t> region = Region(1, 4, {{2, 3}, {5, 6}}).Serialize();
  std::vector<uint8_t> address =
      EngineAddress{1, "shm", {{std::vector<uint8_t>(40, 7), 0, 0}}}.Serialize();
  for (size_t n = 0; n < region.size(); ++n) {
    EXPECT_EQ(RemoteRegion::Parse(std::span(region).first(n)).status().code(),
              StatusCode::kInvalidArgument);
  }
  for (size_t n = 0; n < address.size(); ++n) {
    EXPECT_EQ(EngineAddress::Parse(std::span(address).first(n)).status().code(),
              StatusCode::kInvalidArgument);
  }
  // Random corruption never crashes; whatever parses must re-serialise to the same bytes.
  std::mt19937 rng(1);
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b = (i % 2) ? region : address;
    b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    if (i % 2) {
      auto p = RemoteRegion::Parse(b);
      if (p.ok()) EXPECT_EQ(p->Serialize(), b);
    } else {
      auto p = EngineAddress::Parse(b);
      if (p.ok()) EXPECT_EQ(p->Serialize(), b);
    }
  }
  // Trailing bytes, wrong version, overflowing length.
  region.push_back(0);
  EXPECT_EQ(RemoteRegion::Parse(region).status().code(), StatusCode::kInvalidArgument);
  region.pop_back();
  region[4] = 9;
  EXPECT_NE(RemoteRegion::Parse(region).status().message().find("version 9"), std::string::npos);
  auto overflow = Region(1, 100, {{~uint64_t{0} - 10, 3}}).Serialize();
  EXPECT_EQ(RemoteRegion::Parse(overflow).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::fabric
