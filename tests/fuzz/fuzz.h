// What the libFuzzer harnesses share: a property that must hold, or the run stops there (and
// libFuzzer keeps the input that broke it).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "ferry/moe.h"
#include "ferry/status.h"

#define FUZZ_REQUIRE(cond, what)                                                           \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s does not hold: %s\n", __FILE__, __LINE__, #cond, what); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// A wire format's parse (T::Parse / Serialize) on a peer's bytes: refused with InvalidArgument,
// or a value whose serialization parses back to the same serialization.
template <typename T>
void RoundTrip(std::span<const uint8_t> bytes, const char* what) {
  auto parsed = T::Parse(bytes);
  if (!parsed.ok()) {
    FUZZ_REQUIRE(parsed.status().code() == ferry::StatusCode::kInvalidArgument, what);
    return;
  }
  const std::vector<uint8_t> once = parsed->Serialize();
  auto again = T::Parse(once);
  FUZZ_REQUIRE(again.ok(), what);
  FUZZ_REQUIRE(again->Serialize() == once, what);
}

// moe_section_fuzz's configuration for rank `rank`, from its input's first byte: world 2 or 3
// (bit 5), fp8 (bit 0), options (a)+(b) (bit 1), token-major (bit 2, with them); 2 experts a
// rank, top-2, 3 tokens, hidden 128. fuzz_seeds makes its sections from the same.
inline ferry::AllToAllConfig MoeFuzzConfig(uint8_t pick, int rank) {
  ferry::AllToAllConfig c{.world_size = (pick >> 5 & 1) ? 3 : 2,
                          .rank = rank,
                          .num_experts = 4,
                          .experts_per_token = 2,
                          .max_tokens_per_rank = 3,
                          .hidden = 128,
                          .dtype = (pick & 1) ? ferry::DispatchDtype::kFp8E4M3
                                              : ferry::DispatchDtype::kBf16};
  c.num_experts = 2 * c.world_size;
  const bool both = pick >> 1 & 1;
  c.dispatch_once_per_rank = c.combine_reduce_at_expert_rank = both;
  if (both && (pick >> 2 & 1)) c.dispatch_layout = ferry::DispatchLayout::kTokenMajor;
  return c;
}
