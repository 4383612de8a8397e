// A verbs domain's device and handshakes: opening the device and making the domain's own
// objects (PD, CQ, SRQs, the UD queue pair and its buffers), our address, and the hellos over
// UD that connect each peer's queue pairs (verbs_domain.h).
#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "fabric/verbs/verbs_domain_impl.h"
#include "fabric/wire.h"

namespace ferry::fabric::verbs {

std::vector<uint8_t> UdAddress::Serialize() const {
  ByteWriter w;
  w.U32(kUdMagic);
  w.U16(kWireVersion);
  w.U16(0);
  w.U64(token);
  w.Raw(gid.raw, sizeof gid.raw);
  w.U16(lid);
  w.Raw(&port, 1);
  w.U32(qpn);
  return w.Take();
}

StatusOr<UdAddress> UdAddress::Parse(std::span<const uint8_t> bytes) {
  ByteReader r(bytes, "verbs address");
  UdAddress a;
  RETURN_IF_ERROR(r.Header(kUdMagic));
  RETURN_IF_ERROR(r.U64(&a.token));
  RETURN_IF_ERROR(r.Raw(a.gid.raw, sizeof a.gid.raw));
  RETURN_IF_ERROR(r.U16(&a.lid));
  RETURN_IF_ERROR(r.Raw(&a.port, 1));
  RETURN_IF_ERROR(r.U32(&a.qpn));
  RETURN_IF_ERROR(r.Finish());
  if (a.token == 0 || a.port == 0 || a.qpn == 0 || a.qpn > 0xffffff) {
    return InvalidArgumentError("verbs address: token, port or QP number out of range");
  }
  return a;
}

Status VerbsDomain::Init(const EngineOptions& options, const std::string& device) {
  RETURN_IF_ERROR(config_.Validate());
  ASSIGN_OR_RETURN(std::string name, PickDevice(api_->DeviceNames(), device));
  errno = 0;
  context_.Reset(api_.get(), api_->OpenDevice(name));
  if (!context_) return ErrnoError("verbs: opening " + name, errno ? errno : ENODEV);
  ibv_port_attr port{};
  if (int rc = api_->QueryPort(context_, config_.port, &port)) {
    return ErrnoError("verbs: querying port " + std::to_string(config_.port) + " of " + name, rc);
  }
  if (port.state != IBV_PORT_ACTIVE) {
    return UnavailableError("verbs: port " + std::to_string(config_.port) + " of " + name +
                            " is not active");
  }
  local_ = {config_.port, port.active_mtu, port.link_layer, config_.gid_index};
  lid_ = port.lid;
  if (int rc = api_->QueryGid(context_, config_.port, config_.gid_index, &gid_)) {
    return ErrnoError("verbs: GID index " + std::to_string(config_.gid_index) + " of " + name, rc);
  }
  pd_.Reset(api_.get(), api_->AllocPd(context_));
  if (!pd_) return ErrnoError("verbs: ibv_alloc_pd", errno);
  const uint32_t rx = std::max<uint32_t>(options.num_recv_buffers, 1);
  cq_.Reset(api_.get(), api_->CreateCq(context_, static_cast<int>(kImmRecvs + rx + kUdSlots * 2 +
                                                                  kSendQueueDepth * 4)));
  if (!cq_) return ErrnoError("verbs: ibv_create_cq", errno);
  ibv_srq_init_attr srq_attr{};
  srq_attr.attr.max_wr = rx;
  srq_attr.attr.max_sge = 1;
  srq_msg_.Reset(api_.get(), api_->CreateSrq(pd_, &srq_attr));
  srq_attr.attr.max_wr = kImmRecvs;
  srq_imm_.Reset(api_.get(), api_->CreateSrq(pd_, &srq_attr));
  if (!srq_msg_ || !srq_imm_) return ErrnoError("verbs: ibv_create_srq", errno);
  for (uint32_t i = 0; i < kImmRecvs; ++i) RETURN_IF_ERROR(PostImmRecv(i));

  // The UD queue pair and its buffers: kUdSlots receives (GRH + message), kUdSlots sends.
  ud_buffers_.assign(kUdSlots * (kGrhBytes + kUdMessageBytes) + kUdSlots * kUdMessageBytes, 0);
  ud_mr_.Reset(api_.get(),
               api_->RegMr(pd_, ud_buffers_.data(), ud_buffers_.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!ud_mr_) return ErrnoError("verbs: registering handshake buffers", errno);
  ibv_qp_init_attr ud_attr{};
  ud_attr.send_cq = cq_;
  ud_attr.recv_cq = cq_;
  ud_attr.qp_type = IBV_QPT_UD;
  ud_attr.cap.max_send_wr = kUdSlots;
  ud_attr.cap.max_recv_wr = kUdSlots;
  ud_attr.cap.max_send_sge = 1;
  ud_attr.cap.max_recv_sge = 1;
  ud_.Reset(api_.get(), api_->CreateQp(pd_, &ud_attr));
  if (!ud_) return ErrnoError("verbs: creating the UD queue pair", errno);
  RETURN_IF_ERROR(ApplySteps(*api_, ud_, UdSteps(config_, NewPsn()), "handshakes"));
  for (uint32_t i = 0; i < kUdSlots; ++i) RETURN_IF_ERROR(PostUdRecv(i));
  ud_send_busy_.assign(kUdSlots, false);

  std::random_device rd;
  token_ = ((uint64_t{rd()} << 32) | rd()) | 1;
  UdAddress me{token_, gid_, lid_, config_.port, ud_->qp_num};
  name_ = me.Serialize();

  caps_.provider = "verbs";
  caps_.name = name;
  caps_.max_msg_bytes = port.max_msg_sz ? port.max_msg_sz : (uint64_t{1} << 30);
  caps_.send_depth = kSendQueueDepth;
  caps_.recv_depth = rx;
  // An RC queue pair executes requests in order, and a write with immediate completes at the
  // responder only after the writes before it were placed (what NCCL's IB transport relies on).
  caps_.ordered_write_bytes = UINT64_MAX;
  // For logs: the facts that verbs has too (libfabric's mr_mode bits it has not: left unset).
  info_.provider = caps_.provider;
  info_.domain = name;
  info_.hmem = true;  // GPU memory through dmabuf or nvidia-peermem
  info_.cq_data_size = 4;
  info_.max_msg_size = caps_.max_msg_bytes;
  info_.inject_size = kMaxInline;
  info_.tx_size = caps_.send_depth;
  info_.rx_size = rx;
  info_.ordered_write_bytes = caps_.ordered_write_bytes;
  info_.removal_fences = true;
  return Status::Ok();
}

uint32_t VerbsDomain::NewPsn() {
  if (config_.psn) return config_.psn;
  return std::uniform_int_distribution<uint32_t>(1, 0xffffff)(rng_);
}

Status VerbsDomain::PostUdRecv(uint32_t index) {
  ibv_sge sge{reinterpret_cast<uint64_t>(UdRecvBuffer(index)),
              static_cast<uint32_t>(kGrhBytes + kUdMessageBytes), ud_mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = WrId(kUdRecv, index);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  int rc = api_->PostRecv(ud_, &wr, &bad);
  return rc ? ErrnoError("verbs: posting a handshake receive", rc) : Status::Ok();
}

void VerbsDomain::SendHello(Peer& p, bool goodbye) {
  p.last_hello = Clock::now();
  uint32_t slot = kUdSlots;
  for (uint32_t i = 0; i < kUdSlots; ++i) {
    if (!ud_send_busy_[i]) {
      slot = i;
      break;
    }
  }
  if (slot == kUdSlots) return;  // all in flight: the next round re-sends
  Handshake h;
  h.token = token_;
  h.peer_token = p.addr.token;
  h.gid = gid_;
  h.lid = lid_;
  h.port = config_.port;
  h.mtu = static_cast<uint8_t>(local_.active_mtu);
  h.msg = {p.msg->qp_num, p.msg_psn};
  h.write = {p.write->qp_num, p.write_psn};
  h.have_yours = p.have_theirs;
  h.incarnation = p.incarnation;
  h.ud_qpn = ud_->qp_num;
  h.goodbye = goodbye;
  std::vector<uint8_t> bytes = h.Serialize();
  std::memcpy(UdSendBuffer(slot), bytes.data(), bytes.size());
  ibv_sge sge{reinterpret_cast<uint64_t>(UdSendBuffer(slot)), static_cast<uint32_t>(bytes.size()),
              ud_mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = WrId(kUdSend, slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.ud.ah = p.ah;
  wr.wr.ud.remote_qpn = p.addr.qpn;
  wr.wr.ud.remote_qkey = config_.qkey;
  ibv_send_wr* bad = nullptr;
  if (api_->PostSend(ud_, &wr, &bad) == 0) ud_send_busy_[slot] = true;
}

void VerbsDomain::DriveHandshakes() {
  if (peers_connected_ == peers_.size()) return;
  const Clock::time_point now = Clock::now();
  size_t connected = 0;
  for (auto& p : peers_) {
    if (p->connected() || p->closed() || p->state == PeerState::kGone) {
      ++connected;
      continue;
    }
    if (now - p->last_hello >= kHelloInterval) SendHello(*p);
  }
  peers_connected_ = connected;
}

Status VerbsDomain::OnHandshake(uint64_t index, const Handshake& h) {
  Peer& p = *peers_[index];
  if (h.have_yours) p.they_have_ours = true;
  if (p.have_theirs) return Status::Ok();
  ASSIGN_OR_RETURN(auto msg_steps, RcSteps(config_, local_, p.msg_psn, h, h.msg));
  ASSIGN_OR_RETURN(auto write_steps, RcSteps(config_, local_, p.write_psn, h, h.write));
  RETURN_IF_ERROR(ApplySteps(*api_, p.msg, std::span(msg_steps).subspan(1), "messages"));
  RETURN_IF_ERROR(ApplySteps(*api_, p.write, std::span(write_steps).subspan(1), "writes"));
  p.have_theirs = true;
  p.their_incarnation = h.incarnation;
  SendHello(p);  // tell them we hold theirs
  return Status::Ok();
}

void VerbsDomain::OnUdMessage(const uint8_t* data, size_t length) {
  auto h = Handshake::Parse({data, length});
  if (!h.ok() || h->peer_token != token_) return;  // not for us: stale or foreign
  auto it = token_peer_.find(h->token);
  if (it == token_peer_.end()) {
    if (h->goodbye) return;  // of a connection we no longer have
    // CreatePeer takes it (bounded: a peer's hellos come again while it is not connected).
    if (early_hellos_.size() < kMaxEarlyHellos || early_hellos_.count(h->token)) {
      early_hellos_[h->token] = *h;
    }
    // A peer we were not given reaches us: connect now, so that what it sends arrives (its
    // messages name no PeerId until the engine adds it, which then claims this connection).
    // Without this a one-sided AddPeer never connected: KvPrefill adds a decoder only when
    // its first request arrives. Bounded: at max_unclaimed_peers the oldest unclaimed
    // connection ends (its peer hears goodbye, and connects again when it next adds us).
    if (h->ud_qpn != 0) {
      if (unclaimed_.size() >= config_.max_unclaimed_peers) {
        Close(unclaimed_.begin()->second, /*goodbye=*/true);
      }
      auto index = CreatePeer(UdAddress{h->token, h->gid, h->lid, h->port, h->ud_qpn});
      if (index.ok()) {
        Peer& made = *peers_[*index];
        made.state = PeerState::kUnclaimed;
        made.passive_seq = next_passive_seq_++;
        unclaimed_[made.passive_seq] = *index;
      }
    }
    return;
  }
  Peer& p = *peers_[it->second];
  if (p.closed()) return;
  if (h->goodbye) {
    // The peer removed us. Only its current connection's goodbye counts (an older one's is
    // late news). Unclaimed, nobody here knows the connection: it ends. Otherwise the engine
    // marks the peer lost; its token is free, so that its next hello (it adds us again) makes
    // a new connection, which our engine claims when it adds the peer again -- the old one is
    // removed then, without a goodbye of ours.
    if (!p.have_theirs || h->incarnation != p.their_incarnation || p.state == PeerState::kGone) {
      return;
    }
    if (p.state == PeerState::kUnclaimed) {
      Close(it->second, /*goodbye=*/false);
      return;
    }
    p.state = PeerState::kGone;
    DomainCompletion gone;
    gone.kind = CompletionKind::kPeerGone;
    gone.src_addr = it->second;
    refused_.push_back(std::move(gone));
    token_peer_.erase(it);
    return;
  }
  if (p.have_theirs && h->incarnation > p.their_incarnation) {
    // The other side lost our connection and made a new one (it added us again).
    Status s = Reconnect(it->second);
    if (!s.ok()) {
      Close(it->second, /*goodbye=*/false);  // its transfers fail (Ready says why)
      return;
    }
  }
  const bool answer = !h->have_yours && p.have_theirs;
  Status s = OnHandshake(it->second, *h);
  (void)s;  // a failed transition leaves the peer unconnected: its transfers hit their deadline
  if (answer) SendHello(p);  // our earlier reply was lost
}

StatusOr<std::unique_ptr<Domain>> OpenVerbsDomain(const EngineOptions& options,
                                                  const std::string& device,
                                                  std::shared_ptr<VerbsApi> api,
                                                  const VerbsConfig& config) {
  auto d = std::make_unique<VerbsDomain>(std::move(api), config, options.cuda_memory);
  RETURN_IF_ERROR(d->Init(options, device));
  return std::unique_ptr<Domain>(std::move(d));
}

}  // namespace ferry::fabric::verbs
