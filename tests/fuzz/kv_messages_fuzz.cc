// The KV messenger's messages from a peer's bytes: a decoder's request at a prefill
// (WireRequest::Parse) and the control messages both sides exchange (ParseControl, under each
// magic the messenger uses). Each either refuses the bytes with InvalidArgument or gives a
// value whose serialization parses back to the same serialization; an accepted request's pages
// and aux slot lie inside the regions it names.
#include <cstdint>
#include <span>
#include <vector>

#include "fuzz.h"
#include "kv/messages.h"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto request = kv::WireRequest::Parse(bytes);
  if (!request.ok()) {
    FUZZ_REQUIRE(request.status().code() == StatusCode::kInvalidArgument, "kv request");
  } else {
    const std::vector<uint8_t> once = request->Serialize();
    auto again = kv::WireRequest::Parse(once);
    FUZZ_REQUIRE(again.ok() && again->Serialize() == once, "kv request round trip");
  }
  // The magic the message carries, and one it does not.
  for (uint32_t magic : {kv::MagicOf(bytes), kv::MagicOf(bytes) ^ 1u}) {
    auto control = kv::ParseControl(magic, bytes);
    if (!control.ok()) {
      FUZZ_REQUIRE(control.status().code() == StatusCode::kInvalidArgument, "kv control");
      continue;
    }
    const auto once = kv::ControlMessage(magic, control->request_id, control->imm,
                                         control->posted);
    auto again = kv::ParseControl(magic, once);
    FUZZ_REQUIRE(again.ok() && again->request_id == control->request_id &&
                     again->imm == control->imm && again->posted == control->posted,
                 "kv control round trip");
  }
  return 0;
}
