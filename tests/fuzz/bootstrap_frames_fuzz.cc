// What a bootstrap reads from its relay -- the forked ranks' launcher or rank 0 of a rendezvous
// (common/frames.h): a rendezvous answer, then an all-gather round, or a lone frame (what rank 0
// reads from each rank). The first byte picks the world size (1 to 8) and bit 3 of it which
// reads run. Whatever the bytes, each read returns what it may -- a round of exactly the world's
// frames, none past its bound, no more bytes than the input holds; an answer with a code ferry
// has -- or fails with DataLoss or, past the input's end, Unavailable; and nothing is allocated
// from a length the input claims beyond its bound.
#include <cstdint>
#include <span>
#include <vector>

#include "common/frames.h"
#include "fuzz.h"

using namespace ferry;

namespace {

void RequireRefusal(const Status& s, const char* what) {
  FUZZ_REQUIRE(s.code() == StatusCode::kDataLoss || s.code() == StatusCode::kUnavailable, what);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int world = 1 + data[0] % 8;
  const bool lone_frame = data[0] & 8;
  std::span<const uint8_t> rest(data + 1, size - 1);
  const ReadExact read = SpanReader(&rest);
  if (lone_frame) {
    std::vector<uint8_t> frame;
    const Status s = ReadFrame(read, &frame);
    if (!s.ok()) return RequireRefusal(s, "frame"), 0;
    FUZZ_REQUIRE(frame.size() <= kMaxFrameBytes && frame.size() + 4 <= size - 1, "frame size");
    return 0;
  }
  Status carried;
  const Status answered = ReadAnswer(read, &carried);
  if (!answered.ok()) return RequireRefusal(answered, "answer"), 0;
  FUZZ_REQUIRE(carried.code() <= StatusCode::kDataLoss, "an answer's code");
  FUZZ_REQUIRE(carried.message().size() <= kMaxAnswerBytes, "an answer's message");
  auto round = ReadRound(read, world);
  if (!round.ok()) return RequireRefusal(round.status(), "round"), 0;
  FUZZ_REQUIRE(round->size() == size_t(world), "a round's count");
  size_t bytes = 0;
  for (const auto& frame : *round) {
    FUZZ_REQUIRE(frame.size() <= kMaxFrameBytes, "a round's frame");
    bytes += frame.size() + 4;
  }
  FUZZ_REQUIRE(bytes + 12 <= size - 1, "a round larger than its input");
  return 0;
}
