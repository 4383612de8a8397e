// The KV messenger's wire format (messages.h).
#include "kv/messages.h"

#include <cstring>
#include <limits>
#include <string>

#include "fabric/wire.h"

namespace ferry::kv {
namespace {

void PutSide(fabric::ByteWriter& w, const KvSide& s) {
  for (int v : {s.model.kv_heads, s.model.head_dim, s.model.dtype_bytes, int{s.model.mla},
                s.model.page_tokens, static_cast<int>(s.order), s.tp}) {
    w.U32(static_cast<uint32_t>(v));
  }
}

Status GetSide(fabric::ByteReader& r, KvSide* s) {
  uint32_t v[7];
  for (uint32_t& x : v) RETURN_IF_ERROR(r.U32(&x));
  s->model = KvModel{int(v[0]), int(v[1]), int(v[2]), v[3] != 0, int(v[4])};
  if (v[5] > 1) return InvalidArgumentError("KV request: unknown page order");
  s->order = static_cast<KvOrder>(v[5]);
  s->tp = int(v[6]);
  return s->Validate();
}

}  // namespace

std::vector<uint8_t> WireRequest::Serialize() const {
  fabric::ByteWriter w;
  w.U32(kRequestMagic);
  w.U16(fabric::kWireVersion);
  w.U16(0);
  w.U64(request_id);
  w.U32(imm);
  w.Bytes(decoder_address);
  PutSide(w, decode);
  w.U32(num_layers);
  w.U64(layer_stride);
  for (const RemoteRegion& d : dst) w.Bytes(d.Serialize());
  w.U32(static_cast<uint32_t>(pages.size()));
  for (int64_t p : pages) w.U64(static_cast<uint64_t>(p));
  w.U64(static_cast<uint64_t>(num_tokens));
  w.Bytes(aux.Serialize());
  w.U64(static_cast<uint64_t>(aux_offset));
  w.U64(static_cast<uint64_t>(aux_bytes));
  w.U32(speculative ? 1 : 0);
  return w.Take();
}

StatusOr<WireRequest> WireRequest::Parse(std::span<const uint8_t> bytes) {
  fabric::ByteReader r(bytes, "KV request");
  WireRequest q;
  RETURN_IF_ERROR(r.Header(kRequestMagic));
  RETURN_IF_ERROR(r.U64(&q.request_id));
  RETURN_IF_ERROR(r.U32(&q.imm));
  if ((q.imm & kImmWeightMask) != 0) {
    return InvalidArgumentError("KV request: immediate " + std::to_string(q.imm) +
                                " uses the bits that carry a paged write's page count");
  }
  RETURN_IF_ERROR(r.Bytes(&q.decoder_address, 4096));
  RETURN_IF_ERROR(GetSide(r, &q.decode));
  RETURN_IF_ERROR(r.U32(&q.num_layers));
  RETURN_IF_ERROR(r.U64(&q.layer_stride));
  if (q.decode.tp > 64) return InvalidArgumentError("KV request: decode TP above 64");
  for (int d = 0; d < q.decode.tp; ++d) {
    std::vector<uint8_t> region;
    RETURN_IF_ERROR(r.Bytes(&region, 256));
    ASSIGN_OR_RETURN(RemoteRegion parsed, RemoteRegion::Parse(region));
    q.dst.push_back(parsed);
  }
  uint32_t n = 0;
  RETURN_IF_ERROR(r.U32(&n));
  if (n > bytes.size() / 8) return InvalidArgumentError("KV request: page count too large");
  q.pages.resize(n);
  for (int64_t& p : q.pages) {
    uint64_t v;
    RETURN_IF_ERROR(r.U64(&v));
    p = static_cast<int64_t>(v);
  }
  uint64_t tokens, off, len;
  RETURN_IF_ERROR(r.U64(&tokens));
  std::vector<uint8_t> aux;
  RETURN_IF_ERROR(r.Bytes(&aux, 256));
  RETURN_IF_ERROR(r.U64(&off));
  RETURN_IF_ERROR(r.U64(&len));
  uint32_t speculative = 0;
  RETURN_IF_ERROR(r.U32(&speculative));
  RETURN_IF_ERROR(r.Finish());
  if (speculative > 1) return InvalidArgumentError("KV request: bad speculative flag");
  q.speculative = speculative == 1;
  q.num_tokens = static_cast<int64_t>(tokens);
  q.aux_offset = static_cast<int64_t>(off);
  q.aux_bytes = static_cast<int64_t>(len);
  // What the prefill computes from: every page within the decoder's layer, every count and
  // offset non-negative (a peer's bytes, checked here once for all the arithmetic after).
  if (q.num_layers < 1 || q.layer_stride < 1 ||
      q.layer_stride > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return InvalidArgumentError("KV request: bad layer count or stride");
  }
  const int64_t page_bytes = q.decode.page_bytes();
  for (int64_t p : q.pages) {
    if (!PageInLayer(p, page_bytes, q.layer_stride)) {
      return InvalidArgumentError("KV request: page " + std::to_string(p) +
                                  " outside the decoder's layer");
    }
  }
  if (q.num_tokens < 0 || q.aux_offset < 0 || q.aux_bytes < 0) {
    return InvalidArgumentError("KV request: negative token count or aux slot");
  }
  if (q.aux_bytes > 0) {
    ASSIGN_OR_RETURN(q.aux, RemoteRegion::Parse(aux));
  }
  return q;
}

Status CheckRegions(const KvSide& side, const KvRegions& regions) {
  RETURN_IF_ERROR(side.Validate());
  if (static_cast<int>(regions.ranks.size()) != side.tp) {
    return InvalidArgumentError("KV: " + std::to_string(regions.ranks.size()) + " regions for TP " +
                                std::to_string(side.tp));
  }
  if (regions.num_layers < 1 || regions.layer_stride < 1) {
    return InvalidArgumentError("KV: num_layers and layer_stride must be >= 1");
  }
  for (const MemoryRegion* r : regions.ranks) {
    if (!r || !r->valid()) return InvalidArgumentError("KV: a rank's region is not registered");
    if (static_cast<uint64_t>(regions.layer_stride) * regions.num_layers > r->length()) {
      return InvalidArgumentError("KV: a rank's region is shorter than num_layers * stride");
    }
  }
  return Status::Ok();
}

std::vector<uint8_t> ControlMessage(uint32_t magic, uint64_t request_id, uint32_t imm,
                                    uint64_t posted) {
  fabric::ByteWriter w;
  w.U32(magic);
  w.U16(fabric::kWireVersion);
  w.U16(0);
  w.U64(request_id);
  w.U32(imm);
  w.U64(posted);
  return w.Take();
}

StatusOr<ControlFields> ParseControl(uint32_t magic, std::span<const uint8_t> m) {
  fabric::ByteReader r(m, "KV control message");
  ControlFields f;
  RETURN_IF_ERROR(r.Header(magic));
  RETURN_IF_ERROR(r.U64(&f.request_id));
  RETURN_IF_ERROR(r.U32(&f.imm));
  RETURN_IF_ERROR(r.U64(&f.posted));
  RETURN_IF_ERROR(r.Finish());
  return f;
}

uint32_t MagicOf(std::span<const uint8_t> m) {
  uint32_t magic = 0;
  if (m.size() >= 4) std::memcpy(&magic, m.data(), 4);
  return magic;
}

}  // namespace ferry::kv
