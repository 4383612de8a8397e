// Byte formats that cross the wire between engines: an engine's address and a region descriptor.
//
// Both are little-endian, start with a 4-byte magic and a version, and are parsed with full
// validation: a peer's bytes are untrusted input.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::fabric {

inline constexpr uint16_t kWireVersion = 2;  // 2: one entry per NIC of a domain group

// One NIC of an engine: its provider endpoint name and the small region that receives
// immediate-only writes.
struct NicAddress {
  std::vector<uint8_t> name;  // provider endpoint name (fi_getname)
  uint64_t sink_base = 0;
  uint64_t sink_key = 0;
};

// What AddPeer needs: who the engine is, which provider it speaks, and its NICs (1 to kMaxNics).
struct EngineAddress {
  uint64_t engine_id = 0;
  std::string provider;
  std::vector<NicAddress> nics;

  std::vector<uint8_t> Serialize() const;
  static StatusOr<EngineAddress> Parse(std::span<const uint8_t> bytes);
};

// Little-endian writer/reader shared by the wire formats.
class ByteWriter {
 public:
  void U16(uint16_t v) { Raw(&v, sizeof v); }
  void U32(uint32_t v) { Raw(&v, sizeof v); }
  void U64(uint64_t v) { Raw(&v, sizeof v); }
  void Bytes(std::span<const uint8_t> b) {
    U32(static_cast<uint32_t>(b.size()));
    Raw(b.data(), b.size());
  }
  void Raw(const void* p, size_t n);
  std::vector<uint8_t> Take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> in, const char* what) : in_(in), what_(what) {}
  Status U16(uint16_t* v) { return Raw(v, sizeof *v); }
  Status U32(uint32_t* v) { return Raw(v, sizeof *v); }
  Status U64(uint64_t* v) { return Raw(v, sizeof *v); }
  Status Bytes(std::vector<uint8_t>* out, uint32_t max_len);
  Status Raw(void* p, size_t n);
  // Magic and version; InvalidArgument naming `what` otherwise.
  Status Header(uint32_t magic);
  // InvalidArgument if bytes remain.
  Status Finish() const;

 private:
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  const char* what_;
};

}  // namespace ferry::fabric
