// The engine's wire formats from a peer's bytes: an engine address (AddPeer) and a region
// descriptor (RemoteRegion::Parse). Each parse either refuses the bytes with InvalidArgument
// or gives a value whose serialization parses back to the same serialization.
#include <cstdint>
#include <span>
#include <vector>

#include "fabric/wire.h"
#include "ferry/fabric.h"
#include "fuzz.h"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  RoundTrip<fabric::EngineAddress>(bytes, "engine address");
  RoundTrip<RemoteRegion>(bytes, "remote region");
  return 0;
}
