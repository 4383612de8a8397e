#include "fabric/wire.h"

#include <cstring>

#include "ferry/fabric.h"

namespace ferry::fabric {
namespace {
constexpr uint32_t kAddressMagic = 0x41595246;  // "FRYA"
constexpr uint32_t kRegionMagic = 0x52595246;   // "FRYR"
constexpr uint32_t kMaxNameBytes = 1024;
}  // namespace

void ByteWriter::Raw(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out_.insert(out_.end(), b, b + n);
}

Status ByteReader::Raw(void* p, size_t n) {
  if (in_.size() - pos_ < n) {
    return InvalidArgumentError(std::string(what_) + " is truncated (" +
                                std::to_string(in_.size()) + " bytes)");
  }
  std::memcpy(p, in_.data() + pos_, n);
  pos_ += n;
  return Status::Ok();
}

Status ByteReader::Bytes(std::vector<uint8_t>* out, uint32_t max_len) {
  uint32_t len = 0;
  RETURN_IF_ERROR(U32(&len));
  if (len > max_len || len > in_.size() - pos_) {
    return InvalidArgumentError(std::string(what_) + " has a field of " + std::to_string(len) +
                                " bytes, more than it holds or allows");
  }
  out->assign(in_.begin() + pos_, in_.begin() + pos_ + len);
  pos_ += len;
  return Status::Ok();
}

Status ByteReader::Header(uint32_t magic) {
  uint32_t got_magic = 0;
  uint16_t version = 0, reserved = 0;
  RETURN_IF_ERROR(U32(&got_magic));
  if (got_magic != magic) return InvalidArgumentError(std::string(what_) + ": bad magic");
  RETURN_IF_ERROR(U16(&version));
  RETURN_IF_ERROR(U16(&reserved));
  if (reserved != 0) return InvalidArgumentError(std::string(what_) + ": reserved field is set");
  if (version != kWireVersion) {
    return InvalidArgumentError(std::string(what_) + ": version " + std::to_string(version) +
                                ", this build reads " + std::to_string(kWireVersion));
  }
  return Status::Ok();
}

Status ByteReader::Finish() const {
  if (pos_ != in_.size()) {
    return InvalidArgumentError(std::string(what_) + " has " + std::to_string(in_.size() - pos_) +
                                " trailing bytes");
  }
  return Status::Ok();
}

std::vector<uint8_t> EngineAddress::Serialize() const {
  ByteWriter w;
  w.U32(kAddressMagic);
  w.U16(kWireVersion);
  w.U16(0);
  w.U64(engine_id);
  w.Bytes({reinterpret_cast<const uint8_t*>(provider.data()), provider.size()});
  w.U32(static_cast<uint32_t>(nics.size()));
  for (const NicAddress& nic : nics) {
    w.Bytes(nic.name);
    w.U64(nic.sink_base);
    w.U64(nic.sink_key);
  }
  return w.Take();
}

StatusOr<EngineAddress> EngineAddress::Parse(std::span<const uint8_t> bytes) {
  ByteReader r(bytes, "engine address");
  EngineAddress a;
  std::vector<uint8_t> provider;
  uint32_t nics = 0;
  RETURN_IF_ERROR(r.Header(kAddressMagic));
  RETURN_IF_ERROR(r.U64(&a.engine_id));
  RETURN_IF_ERROR(r.Bytes(&provider, 64));
  RETURN_IF_ERROR(r.U32(&nics));
  if (nics == 0 || nics > kMaxNics) {
    return InvalidArgumentError("engine address: " + std::to_string(nics) +
                                " NICs (1 to " + std::to_string(kMaxNics) + " allowed)");
  }
  a.nics.resize(nics);
  for (NicAddress& nic : a.nics) {
    RETURN_IF_ERROR(r.Bytes(&nic.name, kMaxNameBytes));
    RETURN_IF_ERROR(r.U64(&nic.sink_base));
    RETURN_IF_ERROR(r.U64(&nic.sink_key));
    if (nic.name.empty()) return InvalidArgumentError("engine address: empty NIC name");
  }
  RETURN_IF_ERROR(r.Finish());
  if (a.engine_id == 0 || provider.empty()) {
    return InvalidArgumentError("engine address: empty id or provider");
  }
  a.provider.assign(provider.begin(), provider.end());
  return a;
}

}  // namespace ferry::fabric

namespace ferry {

std::vector<uint8_t> RemoteRegion::Serialize() const {
  fabric::ByteWriter w;
  w.U32(fabric::kRegionMagic);
  w.U16(fabric::kWireVersion);
  w.U16(static_cast<uint16_t>(num_nics));
  w.U64(engine_id);
  w.U64(length);
  for (uint32_t i = 0; i < num_nics && i < kMaxNics; ++i) {
    w.U64(nics[i].base);
    w.U64(nics[i].key);
  }
  return w.Take();
}

StatusOr<RemoteRegion> RemoteRegion::Parse(std::span<const uint8_t> bytes) {
  fabric::ByteReader r(bytes, "region descriptor");
  RemoteRegion region;
  uint32_t magic = 0;
  uint16_t version = 0, nics = 0;
  RETURN_IF_ERROR(r.U32(&magic));
  if (magic != fabric::kRegionMagic) return InvalidArgumentError("region descriptor: bad magic");
  RETURN_IF_ERROR(r.U16(&version));
  if (version != fabric::kWireVersion) {
    return InvalidArgumentError("region descriptor: version " + std::to_string(version) +
                                ", this build reads " + std::to_string(fabric::kWireVersion));
  }
  RETURN_IF_ERROR(r.U16(&nics));
  if (nics == 0 || nics > kMaxNics) {
    return InvalidArgumentError("region descriptor has " + std::to_string(nics) +
                                " NIC entries (1 to " + std::to_string(kMaxNics) + " allowed)");
  }
  region.num_nics = nics;
  RETURN_IF_ERROR(r.U64(&region.engine_id));
  RETURN_IF_ERROR(r.U64(&region.length));
  for (uint32_t i = 0; i < nics; ++i) {
    RETURN_IF_ERROR(r.U64(&region.nics[i].base));
    RETURN_IF_ERROR(r.U64(&region.nics[i].key));
    if (region.nics[i].base + region.length < region.nics[i].base) {
      return InvalidArgumentError("region descriptor: base + length overflows");
    }
  }
  RETURN_IF_ERROR(r.Finish());
  if (region.engine_id == 0) return InvalidArgumentError("region descriptor: engine id is 0");
  return region;
}

}  // namespace ferry
