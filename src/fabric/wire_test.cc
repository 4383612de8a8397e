#include "fabric/wire.h"

#include <gtest/gtest.h>

#include <random>

#include "ferry/fabric.h"

namespace ferry::fabric {
namespace {

TEST(WireTest, RegionRoundTrips) {
  RemoteRegion r{0x1234, 0x7f0000001000, 0xdeadbeef, 1 << 20};
  auto p = RemoteRegion::Parse(r.Serialize());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->engine_id, r.engine_id);
  EXPECT_EQ(p->base, r.base);
  EXPECT_EQ(p->key, r.key);
  EXPECT_EQ(p->length, r.length);
}

TEST(WireTest, AddressRoundTrips) {
  EngineAddress a{77, "tcp;ofi_rxm", {1, 2, 3, 4, 5}, 0x1000, 9};
  auto p = EngineAddress::Parse(a.Serialize());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->engine_id, 77u);
  EXPECT_EQ(p->provider, "tcp;ofi_rxm");
  EXPECT_EQ(p->name, a.name);
  EXPECT_EQ(p->sink_base, 0x1000u);
  EXPECT_EQ(p->sink_key, 9u);
}

TEST(WireTest, EveryTruncationAndCorruptionIsRejectedCleanly) {
  std::vector<uint8_t> region = RemoteRegion{1, 2, 3, 4}.Serialize();
  std::vector<uint8_t> address = EngineAddress{1, "shm", std::vector<uint8_t>(40, 7), 0, 0}.Serialize();
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
  auto overflow = RemoteRegion{1, ~uint64_t{0} - 10, 3, 100}.Serialize();
  EXPECT_EQ(RemoteRegion::Parse(overflow).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::fabric
