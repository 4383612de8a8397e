// Writes each harness's seed corpus (tests/fuzz/corpus/<harness>/) from ferry's own serializers:
// well-formed inputs the fuzzers mutate from. Run once after a wire format changes:
//   build-fuzz/fuzz_seeds tests/fuzz/corpus
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/frames.h"
#include "fabric/wire.h"
#include "fuzz.h"
#include "ferry/fabric.h"
#include "kv/messages.h"
#include "moe/device.h"
#include "moe/wire.h"
#ifdef FERRY_HAVE_VERBS
#include "fabric/verbs/verbs_domain.h"
#include "fabric/verbs/verbs_logic.h"
#endif

using namespace ferry;
namespace fs = std::filesystem;

namespace {

void Write(const fs::path& dir, const std::string& name, const std::vector<uint8_t>& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

RemoteRegion Region(uint64_t engine, uint64_t length, uint32_t nics) {
  RemoteRegion r;
  r.engine_id = engine;
  r.length = length;
  r.num_nics = nics;
  for (uint32_t i = 0; i < nics; ++i) r.nics[i] = {0x7f0000001000ull + i * 4096, 0xbeefull + i};
  return r;
}

// What rank `s` of the moe harness's configuration `pick` writes into rank 0's inbox: its
// section, made by a host device's own DispatchSend.
std::vector<uint8_t> MoeSection(uint8_t pick, int s) {
  const AllToAllConfig c = MoeFuzzConfig(pick, s);
  const moe::RelayLayout layout(c, moe::SlotFormat(c, false).slot_bytes, 1);
  moe::HostBoxes boxes(layout);
  auto device = moe::NewHostDevice({c, &layout, boxes.buffers(), nullptr});
  const int tokens = 3;
  std::vector<uint8_t> x(size_t(tokens * c.token_bytes()), uint8_t(0x30 + s));
  std::vector<float> scales(size_t(tokens * c.scales_per_token()), 0.25f);
  // Token 0 to both of rank 0's experts, token 1 to one of rank 0's and one elsewhere, token 2
  // to none of rank 0's.
  std::vector<int32_t> ids = {0, 1, 1, c.num_experts - 1, c.num_experts - 1, -1};
  std::vector<float> w = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f};
  DispatchInput in{x.data(), c.scales_per_token() ? scales.data() : nullptr, ids.data(), w.data(),
                   tokens};
  if (!device->DispatchSend(in, 0).ok()) std::abort();
  const uint8_t* section = boxes.outbox.data() + layout.OutSection(layout.RemoteIndex(s, 0));
  return std::vector<uint8_t>(section, section + layout.section_bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];

  fabric::EngineAddress address;
  address.engine_id = 0x1234567890ull;
  address.provider = "tcp;ofi_rxm";
  address.nics = {{std::vector<uint8_t>(16, 0x11), 0x1000, 7}, {{1, 2, 3}, 0x2000, 8}};
  Write(root / "wire_fuzz", "address", address.Serialize());
  Write(root / "wire_fuzz", "region", Region(9, 1 << 20, 2).Serialize());

  kv::WireRequest q;
  q.request_id = 0x1122334455667788ull;
  q.imm = kv::kImmBase + 5;
  q.decoder_address = address.Serialize();
  q.decode = KvSide{KvModel{8, 16, 2, false, 4}, KvOrder::kHND, 2};
  q.num_layers = 3;
  q.layer_stride = 1024 * 24;
  q.dst = {Region(9, q.layer_stride * 3, 1), Region(9, q.layer_stride * 3, 1)};
  q.pages = {9, 3, 23, 0};
  q.num_tokens = 15;
  q.aux = Region(9, 4096, 1);
  q.aux_offset = 1000;
  q.aux_bytes = 96;
  q.speculative = true;
  Write(root / "kv_messages_fuzz", "request", q.Serialize());
  Write(root / "kv_messages_fuzz", "cancel", kv::ControlMessage(kv::kCancelMagic, 42, 7, 0));
  Write(root / "kv_messages_fuzz", "ack", kv::ControlMessage(kv::kAckMagic, 42, 7, 96));

#ifdef FERRY_HAVE_VERBS
  fabric::verbs::Handshake h;
  h.token = 0xabc;
  h.peer_token = 0xdef;
  for (int i = 0; i < 16; ++i) h.gid.raw[i] = static_cast<uint8_t>(0xf0 + i);
  h.lid = 17;
  h.port = 1;
  h.mtu = IBV_MTU_2048;
  h.msg = {0x1234, 0x111};
  h.write = {0x1235, 0x222};
  h.have_yours = true;
  h.incarnation = 3;
  h.ud_qpn = 0x77;
  Write(root / "verbs_handshake_fuzz", "handshake", h.Serialize());
  fabric::verbs::UdAddress ud;
  ud.token = 0xabc;
  ud.lid = 17;
  ud.qpn = 0x77;
  Write(root / "verbs_handshake_fuzz", "ud_address", ud.Serialize());
#endif

  // fp8 or not, (a)+(b) or not, token-major, padding 1 and 4, worlds of 2 and 3.
  for (uint8_t pick : {0x00, 0x01, 0x02, 0x06, 0x07, 0x10, 0x18, 0x20, 0x23, 0x39}) {
    std::vector<uint8_t> bytes = {pick};
    for (int s = 1; s < ((pick >> 5 & 1) ? 3 : 2); ++s) {
      const std::vector<uint8_t> section = MoeSection(pick, s);
      bytes.insert(bytes.end(), section.begin(), section.end());
    }
    char name[32];
    std::snprintf(name, sizeof name, "pick_%02x", pick);
    Write(root / "moe_section_fuzz", name, bytes);
  }

  // A world started and a round of w frames (the relay's answer as rank 0 writes it); a world
  // refused with a message; lone frames as ranks send them.
  auto put32 = [](std::vector<uint8_t>& b, uint32_t v) {
    b.insert(b.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + 4);
  };
  for (int w : {1, 2, 4, 8}) {
    std::vector<uint8_t> b = {static_cast<uint8_t>(w - 1)};
    put32(b, 0);  // the answer: the world starts
    put32(b, 0);
    std::vector<std::vector<uint8_t>> frames(static_cast<size_t>(w));
    for (int r = 0; r < w; ++r) {
      for (int k = 0; k < r * 3; ++k) frames[r].push_back(static_cast<uint8_t>(r + k));
    }
    const std::vector<uint8_t> round = EncodeRound(frames);
    b.insert(b.end(), round.begin(), round.end());
    Write(root / "bootstrap_frames_fuzz", "round_w" + std::to_string(w), b);
  }
  {
    const std::string why = "rendezvous: rank 3 says the world size is 4, rank 0 says 8";
    std::vector<uint8_t> b = {1};
    put32(b, static_cast<uint32_t>(StatusCode::kInvalidArgument));
    put32(b, static_cast<uint32_t>(why.size()));
    b.insert(b.end(), why.begin(), why.end());
    Write(root / "bootstrap_frames_fuzz", "refused", b);
  }
  for (uint32_t len : {0u, 5u, 64u}) {
    std::vector<uint8_t> b = {8};
    put32(b, len);
    b.resize(b.size() + len, 0x5a);
    Write(root / "bootstrap_frames_fuzz", "frame" + std::to_string(len), b);
  }

  int i = 0;
  for (const char* list : {"0-3,8,10-11", "0", "7-7", "0-1,4-5,16"}) {
    const std::string s = list;
    Write(root / "user_input_fuzz", "list" + std::to_string(i++),
          std::vector<uint8_t>(s.begin(), s.end()));
  }
  return 0;
}
