// The KV messenger's wire format: what the decode side (decoder.cc) and the prefill side
// (prefill.cc) send each other, and the checks both make.
//
// The request travels as one two-sided message: [magic, version] request id, immediate, the
// decoder's engine address, the decode side's layout, one region descriptor per decode rank,
// layer count and stride, page ids, token count, aux descriptor, offset and length. The decoder
// plans the same transfer with the same seed (the request id) to know how many writes to expect:
// writes per layer x layers, plus one for the aux data. Every write carries the request's
// immediate, so the decoder needs no other notification: a single write as it is, a paged write
// (the writes of one layer that share a length and a source/destination pair, up to
// kMaxBatchPages pages) once per NIC, on that NIC's last page after the others completed,
// weighted by that NIC's pages (WeightedImm), so that together they count as the writes.
//
// Cancel and its acknowledgement: [magic, version] request id, request immediate, writes posted
// (0 in a cancel). The immediate names the decoder's slot, so an acknowledgement can never be
// taken for a later request that reuses the id.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ferry/fabric.h"
#include "ferry/immediates.h"
#include "ferry/kv.h"

namespace ferry::kv {

constexpr uint32_t kRequestMagic = 0x5152564B;  // "KVRQ"
constexpr uint32_t kCancelMagic = 0x4E43564B;   // "KVCN"
constexpr uint32_t kAckMagic = 0x4143564B;      // "KVCA"
// Request slot i counts immediate kImmBase + i (the KV range of ferry/immediates.h). A paged
// write carries one immediate per NIC for all its pages (imm_once), weighted by the pages in
// kImmWeightMask, so the decoder counts page writes whatever the batching.
constexpr uint32_t kImmBase = imm::kKv.first;
constexpr uint32_t kImmWeightMask = imm::kKvWeightMask;
constexpr uint32_t kMaxBatchPages = WeightLimit(kImmWeightMask);

struct WireRequest {
  uint64_t request_id = 0;
  uint32_t imm = 0;
  std::vector<uint8_t> decoder_address;
  KvSide decode;
  uint32_t num_layers = 0;
  uint64_t layer_stride = 0;
  std::vector<RemoteRegion> dst;  // [decode.tp]
  std::vector<int64_t> pages;
  int64_t num_tokens = 0;
  RemoteRegion aux;
  int64_t aux_offset = 0, aux_bytes = 0;
  bool speculative = false;

  std::vector<uint8_t> Serialize() const;
  // InvalidArgument for a message that is not a well-formed request.
  static StatusOr<WireRequest> Parse(std::span<const uint8_t> bytes);
};

// Whether page `page` of `page_bytes` lies within a layer of `layer_stride` bytes, and whether
// [offset, offset + bytes) lies within `length` bytes: the checks on a request's pages and aux
// slot, written so that no operand a peer sends can overflow them.
inline bool PageInLayer(int64_t page, int64_t page_bytes, uint64_t layer_stride) {
  return page >= 0 && page_bytes > 0 && static_cast<uint64_t>(page) < layer_stride / page_bytes;
}
inline bool SliceInside(int64_t offset, int64_t bytes, uint64_t length) {
  return offset >= 0 && bytes >= 0 && static_cast<uint64_t>(bytes) <= length &&
         static_cast<uint64_t>(offset) <= length - static_cast<uint64_t>(bytes);
}

// A side's layout against its regions: one registered region per TP rank, each holding
// num_layers layers layer_stride apart.
Status CheckRegions(const KvSide& side, const KvRegions& regions);

std::vector<uint8_t> ControlMessage(uint32_t magic, uint64_t request_id, uint32_t imm,
                                    uint64_t posted);
struct ControlFields {
  uint64_t request_id = 0;
  uint32_t imm = 0;
  uint64_t posted = 0;
};
StatusOr<ControlFields> ParseControl(uint32_t magic, std::span<const uint8_t> m);
// A message's magic (0 if it is shorter than one).
uint32_t MagicOf(std::span<const uint8_t> m);

}  // namespace ferry::kv
