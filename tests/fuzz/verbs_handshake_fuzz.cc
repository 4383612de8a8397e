// The verbs backend's bootstrap messages from a peer's bytes: the handshake a UD datagram
// carries (Handshake::Parse) and a UD address (UdAddress::Parse). Each either refuses the bytes
// with InvalidArgument or gives a value whose serialization parses back to the same
// serialization.
#include <cstdint>
#include <span>
#include <vector>

#include "fabric/verbs/verbs_domain.h"
#include "fabric/verbs/verbs_logic.h"
#include "fuzz.h"

using namespace ferry;
using namespace ferry::fabric::verbs;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  RoundTrip<Handshake>(bytes, "verbs handshake");
  RoundTrip<UdAddress>(bytes, "UD address");
  return 0;
}
