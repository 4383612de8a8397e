// The KV messenger's wire format (messages.h): a request and the control messages round-trip, and
// whatever a peer sends -- truncated, corrupted, or well formed with fields that would overflow
// the prefill's arithmetic -- is refused as InvalidArgument without a crash.
#include "kv/messages.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>

namespace ferry::kv {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kPage = 1024;  // bytes of a page of Request()'s decode side, per rank

RemoteRegion Region(uint64_t engine, uint64_t length) {
  RemoteRegion r;
  r.engine_id = engine;
  r.length = length;
  r.num_nics = 1;
  r.nics[0] = {0x7f0000001000ull, 0xbeefull};
  return r;
}

// A request as a decoder of TP 2 sends it (8 heads of 16 bf16, 4-token pages: K and V of 4 heads
// of 4 tokens, 1 KiB a page per rank; 24 pages a layer).
WireRequest Request() {
  WireRequest q;
  q.request_id = 0x1122334455667788ull;
  q.imm = kImmBase + 5;
  q.decoder_address = std::vector<uint8_t>(40, 7);
  q.decode = KvSide{KvModel{8, 16, 2, false, 4}, KvOrder::kNHD, 2};
  q.num_layers = 3;
  q.layer_stride = kPage * 24;
  q.dst = {Region(9, q.layer_stride * 3), Region(9, q.layer_stride * 3)};
  q.pages = {9, 3, 23, 0};
  q.num_tokens = 15;
  q.aux = Region(9, 4096);
  q.aux_offset = 1000;
  q.aux_bytes = 96;
  q.speculative = true;
  return q;
}

TEST(KvWireTest, ARequestRoundTrips) {
  const WireRequest q = Request();
  auto p = WireRequest::Parse(q.Serialize());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->request_id, q.request_id);
  EXPECT_EQ(p->imm, q.imm);
  EXPECT_EQ(p->decoder_address, q.decoder_address);
  EXPECT_EQ(p->decode.tp, 2);
  EXPECT_EQ(p->decode.order, KvOrder::kNHD);
  EXPECT_EQ(p->decode.model.head_dim, 16);
  EXPECT_EQ(p->num_layers, 3u);
  EXPECT_EQ(p->layer_stride, q.layer_stride);
  ASSERT_EQ(p->dst.size(), 2u);
  EXPECT_EQ(p->dst[1].length, q.dst[1].length);
  EXPECT_EQ(p->pages, q.pages);
  EXPECT_EQ(p->num_tokens, 15);
  EXPECT_EQ(p->aux.length, 4096u);
  EXPECT_EQ(p->aux_offset, 1000);
  EXPECT_EQ(p->aux_bytes, 96);
  EXPECT_TRUE(p->speculative);
  EXPECT_EQ(p->Serialize(), q.Serialize());

  auto c = ParseControl(kCancelMagic, ControlMessage(kCancelMagic, 42, kImmBase + 3, 17));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->request_id, 42u);
  EXPECT_EQ(c->imm, kImmBase + 3);
  EXPECT_EQ(c->posted, 17u);
  // A control message of the other kind is not this one.
  EXPECT_EQ(ParseControl(kAckMagic, ControlMessage(kCancelMagic, 42, 1, 0)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MagicOf(ControlMessage(kAckMagic, 1, 1, 1)), kAckMagic);
  EXPECT_EQ(MagicOf(std::vector<uint8_t>{1, 2, 3}), 0u);
}

TEST(KvWireTest, EveryTruncationIsRefused) {
  const std::vector<uint8_t> request = Request().Serialize();
  for (size_t n = 0; n < request.size(); ++n) {
    EXPECT_EQ(WireRequest::Parse(std::span(request).first(n)).status().code(),
              StatusCode::kInvalidArgument)
        << n << " of " << request.size() << " bytes";
  }
  std::vector<uint8_t> longer = request;
  longer.push_back(0);
  EXPECT_EQ(WireRequest::Parse(longer).status().code(), StatusCode::kInvalidArgument);
  const std::vector<uint8_t> cancel = ControlMessage(kCancelMagic, 1, 2, 3);
  for (size_t n = 0; n < cancel.size(); ++n) {
    EXPECT_EQ(ParseControl(kCancelMagic, std::span(cancel).first(n)).status().code(),
              StatusCode::kInvalidArgument);
  }
}

// Random bit flips never crash the parser (run under `make sanitize`, never a read out of
// bounds or an overflow), and whatever still parses holds only what the prefill can compute
// with: its pages inside the decoder's layer, no negative count or offset.
TEST(KvWireTest, CorruptedRequestsParseToSafeFieldsOrNotAtAll) {
  const std::vector<uint8_t> request = Request().Serialize();
  std::mt19937 rng(3);
  int parsed = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b = request;
    for (int flips = 1 + i % 3; flips > 0; --flips) {
      b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    }
    auto p = WireRequest::Parse(b);
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
      continue;
    }
    ++parsed;
    ASSERT_TRUE(p->decode.Validate().ok());
    ASSERT_EQ(p->dst.size(), static_cast<size_t>(p->decode.tp));
    for (int64_t page : p->pages) {
      ASSERT_TRUE(PageInLayer(page, p->decode.page_bytes(), p->layer_stride)) << page;
    }
    ASSERT_GE(p->num_tokens, 0);
    ASSERT_GE(p->aux_offset, 0);
    ASSERT_GE(p->aux_bytes, 0);
    ASSERT_GE(p->num_layers, 1u);
    // What parsed serialises back and parses the same (the aux descriptor is dropped when the
    // request has no aux bytes, so compare the second round).
    auto again = WireRequest::Parse(p->Serialize());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->Serialize(), p->Serialize());
  }
  // Flips in the request id, the immediate's low bits or a page id leave a valid request: the
  // check above ran on some.
  EXPECT_GT(parsed, 0);
}

// Well formed, but with what would overflow or go negative in the prefill's arithmetic.
TEST(KvWireTest, HostileFieldsAreRefused) {
  auto refused = [](const WireRequest& q, const char* what) {
    auto p = WireRequest::Parse(q.Serialize());
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << what;
  };
  WireRequest q = Request();
  q.pages[2] = 24;  // one past the layer
  refused(q, "a page past the layer");
  q.pages[2] = kMax / kPage + 1;  // page * page_bytes overflows
  refused(q, "a page whose offset overflows");
  q.pages[2] = -1;
  refused(q, "a negative page");
  q = Request();
  q.layer_stride = 0;
  refused(q, "a zero layer stride");
  q.layer_stride = ~uint64_t{0};
  refused(q, "a layer stride above 2^63");
  q = Request();
  q.num_layers = 0;
  refused(q, "no layers");
  q = Request();
  q.num_tokens = std::numeric_limits<int64_t>::min();
  refused(q, "a negative token count");
  q = Request();
  q.aux_offset = -8;
  refused(q, "a negative aux offset");
  q = Request();
  q.aux_bytes = -8;
  refused(q, "a negative aux size");
  q = Request();
  q.decode.model.head_dim = kMaxHeadDim * 2;
  q.decode.model.page_tokens = kMaxPageTokens;
  refused(q, "a page of 2^60 bytes");
  q = Request();
  q.imm |= kImmWeightMask;
  refused(q, "an immediate in the page-count bits");
  q = Request();
  q.decode.tp = 3;  // 8 heads over 3 ranks
  q.dst.push_back(Region(9, 1));
  refused(q, "an unshardable decode side");
}

TEST(KvWireTest, RangeChecksCannotOverflow) {
  EXPECT_TRUE(PageInLayer(23, kPage, kPage * 24));
  EXPECT_FALSE(PageInLayer(24, kPage, kPage * 24));
  EXPECT_FALSE(PageInLayer(-1, kPage, kPage * 24));
  EXPECT_FALSE(PageInLayer(kMax, kPage, kPage * 24));
  EXPECT_FALSE(PageInLayer(0, 0, 512));
  EXPECT_TRUE(PageInLayer(kMax / kPage - 1, kPage, ~uint64_t{0}));

  EXPECT_TRUE(SliceInside(0, 100, 100));
  EXPECT_TRUE(SliceInside(100, 0, 100));
  EXPECT_FALSE(SliceInside(1, 100, 100));
  EXPECT_FALSE(SliceInside(101, 0, 100));
  EXPECT_FALSE(SliceInside(kMax, kMax, 100));  // the sum wraps in int64_t
  EXPECT_FALSE(SliceInside(2, kMax, uint64_t(kMax)));
  EXPECT_TRUE(SliceInside(1, kMax, ~uint64_t{0}));
  EXPECT_FALSE(SliceInside(-1, 1, 100));
  EXPECT_FALSE(SliceInside(0, -1, 100));
}

}  // namespace
}  // namespace ferry::kv
