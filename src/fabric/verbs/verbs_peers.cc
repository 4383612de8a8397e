// A verbs domain's peers: each one's connection from creation (its queue pairs and address
// handle) through a reconnection to its close and release, and memory registrations.
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "fabric/verbs/verbs_domain_impl.h"

namespace ferry::fabric::verbs {

StatusOr<uint64_t> VerbsDomain::InsertPeer(std::span<const uint8_t> bytes) {
  ASSIGN_OR_RETURN(UdAddress addr, UdAddress::Parse(bytes));
  // A peer that reached us first (its hello made the connection, OnUdMessage): ours now.
  if (auto it = token_peer_.find(addr.token); it != token_peer_.end()) {
    Peer& p = *peers_[it->second];
    if (p.state == PeerState::kUnclaimed) {
      p.state = PeerState::kOpen;
      unclaimed_.erase(p.passive_seq);
      return it->second;
    }
  }
  return CreatePeer(addr);
}

StatusOr<uint64_t> VerbsDomain::CreatePeer(const UdAddress& addr) {
  auto peer = std::make_unique<Peer>();
  peer->addr = addr;
  peer->write_chain = WrChain(config_.max_chain, kMaxInline);
  peer->msg_chain = WrChain(config_.max_chain, kMaxInline);
  ibv_ah_attr ah{};
  ah.dlid = addr.lid;
  ah.sl = config_.service_level;
  ah.port_num = config_.port;
  if (local_.link_layer == IBV_LINK_LAYER_ETHERNET || addr.lid == 0) {
    ah.is_global = 1;
    ah.grh.dgid = addr.gid;
    ah.grh.sgid_index = static_cast<uint8_t>(config_.gid_index);
    ah.grh.hop_limit = config_.hop_limit;
    ah.grh.traffic_class = config_.traffic_class;
  }
  peer->ah.Reset(api_.get(), api_->CreateAh(pd_, &ah));
  if (!peer->ah) return ErrnoError("verbs: address handle for a peer", errno);
  Peer* p = peer.get();
  p->incarnation = next_incarnation_++;
  // A released peer's index first (ReleaseClosed): the table holds the peers of now.
  uint64_t index = peers_.size();
  if (!free_indices_.empty()) {
    index = free_indices_.back();
    free_indices_.pop_back();
    peers_[index] = std::move(peer);  // owns what follows, even on failure
  } else {
    peers_.push_back(std::move(peer));
  }
  peers_connected_ = 0;  // DriveHandshakes counts again (the table may not have grown)
  Status made = NewQueuePairs(*p, index);
  if (made.ok()) {
    token_peer_[addr.token] = index;
    auto early = early_hellos_.find(addr.token);
    if (early != early_hellos_.end()) {
      Handshake h = early->second;
      early_hellos_.erase(early);
      made = OnHandshake(index, h);
    }
  }
  if (!made.ok()) {
    Close(index, /*goodbye=*/false);  // what was made of it is released
    return made;
  }
  SendHello(*p);
  return index;
}

Status VerbsDomain::NewQueuePairs(Peer& p, uint64_t index) {
  ASSIGN_OR_RETURN(p.msg, CreateRc(srq_msg_));
  ASSIGN_OR_RETURN(p.write, CreateRc(srq_imm_));
  p.msg_psn = NewPsn();
  p.write_psn = NewPsn();
  qp_peer_[p.msg->qp_num] = index;
  qp_peer_[p.write->qp_num] = index;
  const QpStep init = RcInitStep(config_.port);
  RETURN_IF_ERROR(ApplySteps(*api_, p.msg, {&init, 1}, "messages to peer"));
  return ApplySteps(*api_, p.write, {&init, 1}, "writes to peer");
}

Status VerbsDomain::RemovePeer(uint64_t peer_addr) {
  if (peer_addr >= peers_.size()) return NotFoundError("verbs: unknown peer address");
  Close(peer_addr, /*goodbye=*/true);
  return Status::Ok();
}

StatusOr<Registration> VerbsDomain::Register(void* data, uint64_t length, MemoryKind kind, int) {
  if (kind == MemoryKind::kCuda && !cuda_memory_) {
    return FailedPreconditionError("CUDA memory needs an engine created with cuda_memory = true");
  }
  // Device memory: its dma-buf when the driver gives one, else nvidia-peermem's path.
  Dmabuf dmabuf = kind == MemoryKind::kCuda ? CudaDmabuf(data, length) : Dmabuf{};
  auto registered = RegisterWithFallback(*api_, pd_, data, length, dmabuf, MrAccess(config_));
  if (dmabuf.fd >= 0) close(dmabuf.fd);  // the registration holds its own reference
  ASSIGN_OR_RETURN(ibv_mr * mr, std::move(registered));
  live_mrs_.emplace(mr, OwnedMr(api_.get(), mr));
  Registration r;
  r.handle = mr;
  r.local_desc = mr;
  r.base = reinterpret_cast<uint64_t>(data);
  r.key = mr->rkey;
  return r;
}

void VerbsDomain::Deregister(void* handle) {
  auto* mr = static_cast<ibv_mr*>(handle);
  live_mrs_.erase(mr);  // deregisters it
}

void VerbsDomain::Close(uint64_t index, bool goodbye) {
  Peer& p = *peers_[index];
  if (p.closed()) return;
  if (goodbye && p.state != PeerState::kGone && p.msg && p.write) {
    SendHello(p, /*goodbye=*/true);
  }
  if (p.state == PeerState::kUnclaimed) unclaimed_.erase(p.passive_seq);
  p.state = PeerState::kClosed;
  p.closed_at = Clock::now();
  if (auto t = token_peer_.find(p.addr.token); t != token_peer_.end() && t->second == index) {
    token_peer_.erase(t);  // (after a goodbye it may name the peer's new connection)
  }
  ibv_qp_attr err{};
  err.qp_state = IBV_QPS_ERR;  // flushes what is outstanding
  for (ibv_qp* qp : {p.msg.get(), p.write.get()}) {
    if (qp) api_->ModifyQp(qp, &err, IBV_QP_STATE);
  }
  closing_.push_back(index);
}

void VerbsDomain::ReleaseClosed() {
  const Clock::time_point now = Clock::now();
  const auto delay = std::chrono::milliseconds(config_.release_delay_ms);
  auto destroy = [&](OwnedQp& qp, uint64_t index) {
    if (auto q = qp_peer_.find(qp->qp_num); q != qp_peer_.end() && q->second == index) {
      qp_peer_.erase(q);
    }
    qp.Reset();
  };
  for (size_t i = 0; i < replaced_.size();) {
    Replaced& r = replaced_[i];
    if (r.outstanding > 0 || now - r.at < delay) {
      ++i;
      continue;
    }
    for (OwnedQp& qp : r.qps) destroy(qp, r.index);
    r = std::move(replaced_.back());
    replaced_.pop_back();
  }
  for (size_t i = 0; i < closing_.size();) {
    const uint64_t index = closing_[i];
    Peer& p = *peers_[index];
    // (An index whose replaced queue pairs remain stays: their completions name it.)
    const bool replaced = std::any_of(replaced_.begin(), replaced_.end(),
                                      [&](const Replaced& r) { return r.index == index; });
    if (p.outstanding > 0 || !p.write_chain.empty() || !p.msg_chain.empty() || replaced ||
        now - p.closed_at < delay) {
      ++i;
      continue;
    }
    for (OwnedQp* qp : {&p.msg, &p.write}) {
      if (*qp) destroy(*qp, index);
    }
    peers_[index] = std::make_unique<Peer>();   // (the old one's address handle with it)
    peers_[index]->state = PeerState::kClosed;  // until CreatePeer takes the index again
    free_indices_.push_back(index);
    closing_[i] = closing_.back();
    closing_.pop_back();
  }
}

StatusOr<OwnedQp> VerbsDomain::CreateRc(ibv_srq* srq) {
  ibv_qp_init_attr attr{};
  attr.send_cq = cq_;
  attr.recv_cq = cq_;
  attr.srq = srq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = kSendQueueDepth;
  attr.cap.max_send_sge = 1;
  attr.cap.max_inline_data = kMaxInline;
  OwnedQp qp(api_.get(), api_->CreateQp(pd_, &attr));
  if (!qp) return ErrnoError("verbs: creating an RC queue pair", errno);
  return qp;
}

Status VerbsDomain::Reconnect(uint64_t index) {
  Peer& p = *peers_[index];
  if (!p.write_chain.empty()) Flush(p, p.write_chain, p.write);
  if (!p.msg_chain.empty()) Flush(p, p.msg_chain, p.msg);
  ibv_qp_attr err{};
  err.qp_state = IBV_QPS_ERR;
  for (ibv_qp* qp : {p.msg.get(), p.write.get()}) api_->ModifyQp(qp, &err, IBV_QP_STATE);
  replaced_.push_back(Replaced{{std::move(p.msg), std::move(p.write)},
                               index,
                               std::exchange(p.outstanding, 0),
                               Clock::now()});
  p.have_theirs = p.they_have_ours = false;
  peers_connected_ = 0;  // DriveHandshakes counts again
  return NewQueuePairs(p, index);
}

}  // namespace ferry::fabric::verbs
