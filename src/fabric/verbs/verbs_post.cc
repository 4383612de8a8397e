// A verbs domain's hot path: work requests chained per queue pair and posted, receives
// re-posted, and completions polled and translated for the engine.
#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>

#include "fabric/verbs/verbs_domain_impl.h"

namespace ferry::fabric::verbs {

PostResult VerbsDomain::PostWrite(const WriteWr& wr, Status* error) {
  Peer* p = nullptr;
  if (PostResult r = Ready(wr.peer_addr, &p, error); r != PostResult::kPosted) return r;
  if (wr.length > UINT32_MAX) {
    *error = InvalidArgumentError("verbs: a work request carries at most 4 GiB");
    return PostResult::kError;
  }
  if (p->write_chain.full()) Flush(*p, p->write_chain, p->write);
  const uint32_t lkey = wr.local_desc ? static_cast<ibv_mr*>(wr.local_desc)->lkey : 0;
  p->write_chain.AddWrite(wr.local, static_cast<uint32_t>(wr.length), lkey, wr.remote_addr,
                          static_cast<uint32_t>(wr.key),
                          wr.has_imm ? std::optional<uint32_t>(wr.imm) : std::nullopt,
                          reinterpret_cast<uint64_t>(wr.context));
  return PostResult::kPosted;
}

PostResult VerbsDomain::PostSend(const void* data, uint64_t length, void* local_desc,
                                 uint64_t peer_addr, OpContext* context, Status* error) {
  Peer* p = nullptr;
  if (PostResult r = Ready(peer_addr, &p, error); r != PostResult::kPosted) return r;
  if (p->msg_chain.full()) Flush(*p, p->msg_chain, p->msg);
  const uint32_t lkey = local_desc ? static_cast<ibv_mr*>(local_desc)->lkey : 0;
  p->msg_chain.AddSend(data, static_cast<uint32_t>(length), lkey,
                       reinterpret_cast<uint64_t>(context));
  return PostResult::kPosted;
}

PostResult VerbsDomain::PostRecv(void* data, uint64_t length, void* local_desc, OpContext* context,
                                 Status* error) {
  ibv_sge sge{reinterpret_cast<uint64_t>(data), static_cast<uint32_t>(length),
              local_desc ? static_cast<ibv_mr*>(local_desc)->lkey : 0};
  ibv_recv_wr wr{};
  wr.wr_id = reinterpret_cast<uint64_t>(context) | kMessageRecv;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  int rc = api_->PostSrqRecv(srq_msg_, &wr, &bad);
  if (rc == 0) return PostResult::kPosted;
  if (rc == ENOMEM) return PostResult::kAgain;
  *error = ErrnoError("verbs: posting a receive", rc);
  return PostResult::kError;
}

size_t VerbsDomain::Poll(std::span<DomainCompletion> out) {
  for (auto& p : peers_) {
    if (!p->write_chain.empty()) Flush(*p, p->write_chain, p->write);
    if (!p->msg_chain.empty()) Flush(*p, p->msg_chain, p->msg);
  }
  DriveHandshakes();
  if (!closing_.empty() || !replaced_.empty()) ReleaseClosed();
  size_t n = 0;
  while (n < out.size() && !refused_.empty()) {
    out[n++] = std::move(refused_.front());
    refused_.pop_front();
  }
  ibv_wc wcs[32];
  while (n < out.size()) {
    int want = static_cast<int>(std::min<size_t>(std::size(wcs), out.size() - n));
    int got = api_->PollCq(cq_, want, wcs);
    if (got <= 0) break;
    for (int i = 0; i < got; ++i) {
      if (Translate(wcs[i], &out[n])) ++n;
    }
    if (got < want) break;
  }
  return n;
}

PostResult VerbsDomain::Ready(uint64_t peer_addr, Peer** out, Status* error) {
  if (peer_addr >= peers_.size() || peers_[peer_addr]->closed()) {
    *error = UnavailableError("verbs: peer address " + std::to_string(peer_addr) +
                              " is unknown or removed");
    return PostResult::kError;
  }
  Peer* p = peers_[peer_addr].get();
  if (!p->connected()) return PostResult::kAgain;  // the handshake is under way
  if (p->outstanding + p->write_chain.size() + p->msg_chain.size() >= kSendQueueDepth) {
    return PostResult::kAgain;
  }
  *out = p;
  return PostResult::kPosted;
}

void VerbsDomain::Flush(Peer& p, WrChain& chain, ibv_qp* qp) {
  const uint32_t count = chain.size();
  Status error;
  const uint32_t accepted = chain.Post(*api_, qp, &error);
  p.outstanding += accepted;
  for (uint32_t i = accepted; i < count; ++i) {
    DomainCompletion c;
    c.kind = CompletionKind::kLocal;
    c.context = reinterpret_cast<OpContext*>(chain.wr(i).wr_id);
    c.error = error;
    refused_.push_back(std::move(c));  // rare path
  }
}

Status VerbsDomain::PostImmRecv(uint32_t index) {
  ibv_recv_wr wr{};
  wr.wr_id = WrId(kImmRecv, index);
  wr.num_sge = 0;  // WRITE_WITH_IMM: the immediate is all a receive carries
  ibv_recv_wr* bad = nullptr;
  int rc = api_->PostSrqRecv(srq_imm_, &wr, &bad);
  return rc ? ErrnoError("verbs: posting an immediate receive", rc) : Status::Ok();
}

bool VerbsDomain::Translate(const ibv_wc& wc, DomainCompletion* out) {
  auto peer_of = [&](uint32_t qpn) -> uint64_t {
    auto it = qp_peer_.find(qpn);
    return it == qp_peer_.end() ? kNoPeerAddr : it->second;
  };
  if (wc.wr_id & 1) {
    const uint32_t index = static_cast<uint32_t>(wc.wr_id >> 3);
    switch (static_cast<Tag>(wc.wr_id & 7)) {
      case kUdRecv:
        if (wc.status == IBV_WC_SUCCESS && wc.byte_len > kGrhBytes) {
          OnUdMessage(UdRecvBuffer(index) + kGrhBytes, wc.byte_len - kGrhBytes);
        }
        if (wc.status != IBV_WC_WR_FLUSH_ERR) (void)PostUdRecv(index);
        return false;
      case kUdSend:
        if (index < ud_send_busy_.size()) ud_send_busy_[index] = false;
        return false;
      case kImmRecv: {
        // Flushed too (a queue pair closed while it held the receive): the shared queue
        // would lose it for good otherwise.
        (void)PostImmRecv(index);
        if (wc.status != IBV_WC_SUCCESS || !(wc.wc_flags & IBV_WC_WITH_IMM)) return false;
        *out = DomainCompletion{};
        out->kind = CompletionKind::kRemoteImm;
        out->has_imm = true;
        out->imm = ntohl(wc.imm_data);
        out->src_addr = peer_of(wc.qp_num);
        return true;
      }
    }
    return false;
  }
  *out = DomainCompletion{};
  out->context = reinterpret_cast<OpContext*>(wc.wr_id & ~kMessageRecv);
  const uint64_t peer = peer_of(wc.qp_num);
  const bool receive = wc.wr_id & kMessageRecv;
  const bool recv = wc.status == IBV_WC_SUCCESS && receive;
  out->kind = recv ? CompletionKind::kRecv : CompletionKind::kLocal;
  if (recv) {
    out->length = wc.byte_len;
    out->src_addr = peer;
  } else if (!receive && peer != kNoPeerAddr && wc.qp_num != 0) {
    // A send-side completion (or its error): the WR no longer occupies its queue pair.
    uint32_t* outstanding = &peers_[peer]->outstanding;
    for (Replaced& r : replaced_) {
      if (r.qps[0]->qp_num == wc.qp_num || r.qps[1]->qp_num == wc.qp_num) {
        outstanding = &r.outstanding;
      }
    }
    if (*outstanding > 0) --*outstanding;
  }
  out->error = WcToStatus(wc, peer == kNoPeerAddr ? std::string("an unknown peer")
                                                  : "peer address " + std::to_string(peer));
  return true;
}

}  // namespace ferry::fabric::verbs
