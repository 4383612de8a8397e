// The bootstrap's frames as bytes arrive from a peer -- the forked ranks' launcher, or rank 0 of
// a rendezvous -- checked before anything is sized from them: a length past its bound is
// DataLoss, never an allocation, and a frame's buffer grows only as its bytes arrive. The reads
// come through a ReadExact, a socket's in the bootstraps (IoExact) and a span's in the tests and
// the fuzzer.
//
//   frame   [u32 length][bytes]                   a rank's part of an all-gather round
//   round   [u32 count]([u32 length][bytes])*      every rank's part, from the relay
//   answer  [u32 status code][u32 length][text]    rank 0 of a rendezvous: 0 starts the world
//
// Integers are in host order (every rank runs the same build on the same kind of machine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "ferry/status.h"

namespace ferry {

// One rank's part of an all-gather round at most (what ferry gathers is addresses, configs and
// region descriptors: kilobytes).
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;
// A rendezvous answer's message at most.
inline constexpr uint32_t kMaxAnswerBytes = 64u << 10;

// Reads exactly n bytes into p, or says why not.
using ReadExact = std::function<Status(void* p, size_t n)>;

// A frame into *out.
Status ReadFrame(const ReadExact& read, std::vector<uint8_t>* out);
// A round of `world_size` frames (a count that differs is DataLoss).
StatusOr<std::vector<std::vector<uint8_t>>> ReadRound(const ReadExact& read, int world_size);
// What ReadRound reads: a round of `frames` as the relay sends it.
std::vector<uint8_t> EncodeRound(const std::vector<std::vector<uint8_t>>& frames);
// A rendezvous answer: the Status it carries into *carried (OK: the world starts). The read's
// own failure, or DataLoss for a code ferry does not have or an overlong message, is returned.
Status ReadAnswer(const ReadExact& read, Status* carried);

// A ReadExact over `bytes` (consumed as it reads; Unavailable past the end, as a closed
// connection is).
ReadExact SpanReader(std::span<const uint8_t>* bytes);

}  // namespace ferry
