#include "fabric/verbs/verbs_domain.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <unordered_map>

#include "fabric/wire.h"

namespace ferry::fabric::verbs {
namespace {

constexpr uint32_t kUdMagic = 0x55595246;  // "FRYU"
constexpr size_t kGrhBytes = 40;           // UD receives start with the 40-byte GRH slot
constexpr uint32_t kUdSlots = 32;
constexpr uint32_t kUdMessageBytes = 128;
constexpr uint32_t kImmRecvs = 1024;
constexpr uint32_t kSendQueueDepth = 512;
constexpr uint32_t kMaxInline = 64;
constexpr auto kHelloInterval = std::chrono::milliseconds(20);

// Work-request ids: the engine's OpContext pointers (16-byte aligned), with bit 1 set for a
// message receive (a failed completion's opcode is undefined: the id alone says whether it was
// a receive or took a send queue slot); or ours with bit 0 set: (index << 3) | tag.
enum Tag : uint64_t { kUdRecv = 1, kUdSend = 3, kImmRecv = 5 };
constexpr uint64_t kMessageRecv = 2;
uint64_t WrId(Tag tag, uint64_t index) { return (index << 3) | tag; }

using Clock = std::chrono::steady_clock;

// Where a connection stands in its life (its handshake's progress aside):
//   kUnclaimed  made for a hello from a peer our engine was not given (OnUdMessage); InsertPeer
//               claims it (kOpen), or it ends (Close) when its peer says goodbye or room is
//               needed for a newer one
//   kOpen       one our engine added (or claimed)
//   kGone       the peer said goodbye: this connection is over, its token freed; the engine
//               hears kPeerGone and removes it
//   kClosed     we closed it (Close): its queue pairs drain until ReleaseClosed destroys them,
//               after which its index waits for the next CreatePeer
enum class PeerState : uint8_t { kUnclaimed, kOpen, kGone, kClosed };

struct Peer {
  UdAddress addr;
  OwnedAh ah;
  OwnedQp msg, write;
  uint32_t msg_psn = 0, write_psn = 0;
  PeerState state = PeerState::kOpen;
  bool have_theirs = false;  // our queue pairs are RTS towards theirs
  bool they_have_ours = false;
  uint32_t incarnation = 0;        // of our connection to them (Handshake::incarnation)
  uint32_t their_incarnation = 0;  // of theirs that our queue pairs are connected to
  Clock::time_point closed_at{};  // when its queue pairs went to the error state (Close)
  uint64_t passive_seq = 0;        // its key in unclaimed_ (oldest first) while kUnclaimed
  Clock::time_point last_hello{};
  WrChain write_chain{1, kMaxInline};
  WrChain msg_chain{1, kMaxInline};
  uint32_t outstanding = 0;  // WRs posted on both queue pairs, not completed

  bool closed() const { return state == PeerState::kClosed; }
  bool connected() const { return have_theirs && they_have_ours && !closed(); }
};

}  // namespace

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

namespace {

class VerbsDomain final : public Domain {
 public:
  VerbsDomain(std::shared_ptr<VerbsApi> api, const VerbsConfig& config, bool cuda_memory)
      : api_(std::move(api)), config_(config), cuda_memory_(cuda_memory) {}

  // The members own the device's objects and go in reverse order of declaration: peers' queue
  // pairs and address handles, registrations, then the UD queue pair, the SRQs, the CQ, the
  // protection domain and the device.
  ~VerbsDomain() override = default;

  Status Init(const EngineOptions& options, const std::string& device) {
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
      return ErrnoError("verbs: GID index " + std::to_string(config_.gid_index) + " of " + name,
                        rc);
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
    return Status::Ok();
  }

  const DomainCaps& caps() const override { return caps_; }
  const FabricInfo& info() const override { return info_; }
  std::vector<uint8_t> Name() const override { return name_; }

  StatusOr<uint64_t> InsertPeer(std::span<const uint8_t> bytes) override {
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

  // A peer's queue pairs (INIT), its address handle and our first hello to it.
  StatusOr<uint64_t> CreatePeer(const UdAddress& addr) {
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

  // The peer's two RC queue pairs, in INIT, waiting for its numbers.
  Status NewQueuePairs(Peer& p, uint64_t index) {
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

  Status RemovePeer(uint64_t peer_addr) override {
    if (peer_addr >= peers_.size()) return NotFoundError("verbs: unknown peer address");
    Close(peer_addr, /*goodbye=*/true);
    return Status::Ok();
  }

  StatusOr<Registration> Register(void* data, uint64_t length, MemoryKind kind, int) override {
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

  void Deregister(void* handle) override {
    auto* mr = static_cast<ibv_mr*>(handle);
    live_mrs_.erase(mr);  // deregisters it
  }

  PostResult PostWrite(const WriteWr& wr, Status* error) override {
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

  PostResult PostSend(const void* data, uint64_t length, void* local_desc, uint64_t peer_addr,
                      OpContext* context, Status* error) override {
    Peer* p = nullptr;
    if (PostResult r = Ready(peer_addr, &p, error); r != PostResult::kPosted) return r;
    if (p->msg_chain.full()) Flush(*p, p->msg_chain, p->msg);
    const uint32_t lkey = local_desc ? static_cast<ibv_mr*>(local_desc)->lkey : 0;
    p->msg_chain.AddSend(data, static_cast<uint32_t>(length), lkey,
                         reinterpret_cast<uint64_t>(context));
    return PostResult::kPosted;
  }

  PostResult PostRecv(void* data, uint64_t length, void* local_desc, OpContext* context,
                      Status* error) override {
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

  size_t Poll(std::span<DomainCompletion> out) override {
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

 private:
  // The end of a connection: RemovePeer's, an unclaimed one's whose peer said goodbye, or the
  // oldest unclaimed one's when a new peer needs room. With `goodbye`, the peer hears it (best
  // effort: UD may drop it), so that it knows this connection is over and connects again when
  // it next needs us, instead of writing into queue pairs that are gone until its transfers
  // time out. The queue pairs go to the error state (what is outstanding on them completes in
  // error) and are destroyed later (ReleaseClosed).
  void Close(uint64_t index, bool goodbye) {
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

  // Closed peers with nothing chained or outstanding, closed at least release_delay_ms ago:
  // their queue pairs and address handle destroyed, their index free for the next peer (no
  // completion can name it any more). Without this every peer a long-lived engine ever had kept
  // two queue pairs on the device, and every Poll walked them all.
  void ReleaseClosed() {
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

  uint32_t NewPsn() {
    if (config_.psn) return config_.psn;
    return std::uniform_int_distribution<uint32_t>(1, 0xffffff)(rng_);
  }

  StatusOr<OwnedQp> CreateRc(ibv_srq* srq) {
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

  // kPosted when the peer can take a WR now.
  PostResult Ready(uint64_t peer_addr, Peer** out, Status* error) {
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

  void Flush(Peer& p, WrChain& chain, ibv_qp* qp) {
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

  Status PostImmRecv(uint32_t index) {
    ibv_recv_wr wr{};
    wr.wr_id = WrId(kImmRecv, index);
    wr.num_sge = 0;  // WRITE_WITH_IMM: the immediate is all a receive carries
    ibv_recv_wr* bad = nullptr;
    int rc = api_->PostSrqRecv(srq_imm_, &wr, &bad);
    return rc ? ErrnoError("verbs: posting an immediate receive", rc) : Status::Ok();
  }

  uint8_t* UdRecvBuffer(uint32_t i) {
    return ud_buffers_.data() + i * (kGrhBytes + kUdMessageBytes);
  }
  uint8_t* UdSendBuffer(uint32_t i) {
    return ud_buffers_.data() + kUdSlots * (kGrhBytes + kUdMessageBytes) + i * kUdMessageBytes;
  }

  Status PostUdRecv(uint32_t index) {
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

  void SendHello(Peer& p, bool goodbye = false) {
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

  void DriveHandshakes() {
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

  // The peer's numbers arrived: our queue pairs go to RTR and RTS towards theirs.
  Status OnHandshake(uint64_t index, const Handshake& h) {
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

  // The other side lost our connection and made a new one: the queue pairs of the old one go
  // to the error state -- what is chained or outstanding on them completes in error -- and are
  // destroyed as a closed peer's are, once those completions came (ReleaseClosed); new ones
  // wait in INIT for the new connection's numbers, which the caller applies. Our PeerId stays.
  Status Reconnect(uint64_t index) {
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

  void OnUdMessage(const uint8_t* data, size_t length) {
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

  // Returns true when `wc` becomes an engine completion in *out.
  bool Translate(const ibv_wc& wc, DomainCompletion* out) {
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

  std::shared_ptr<VerbsApi> api_;
  VerbsConfig config_;
  const bool cuda_memory_;
  DomainCaps caps_;
  FabricInfo info_;
  std::vector<uint8_t> name_;
  uint64_t token_ = 0;
  LocalPort local_;
  uint16_t lid_ = 0;
  ibv_gid gid_{};
  std::mt19937 rng_{std::random_device{}()};

  // Owners of the device's objects, in the order they are made (destroyed in reverse).
  OwnedContext context_;
  OwnedPd pd_;
  OwnedCq cq_;
  OwnedSrq srq_msg_;
  OwnedSrq srq_imm_;
  OwnedMr ud_mr_;
  OwnedQp ud_;
  std::vector<uint8_t> ud_buffers_;
  std::vector<bool> ud_send_busy_;

  std::vector<std::unique_ptr<Peer>> peers_;  // index = the peer address handed to the engine
  size_t peers_connected_ = 0;
  std::unordered_map<uint32_t, uint64_t> qp_peer_;
  std::unordered_map<uint64_t, uint64_t> token_peer_;
  std::unordered_map<uint64_t, Handshake> early_hellos_;
  static constexpr size_t kMaxEarlyHellos = 4096;
  std::map<uint64_t, uint64_t> unclaimed_;  // Peer::passive_seq -> index: connections made
                                            // for hellos, not yet claimed by InsertPeer
  uint64_t next_passive_seq_ = 0;
  std::vector<uint64_t> closing_;       // closed peers whose queue pairs are not yet destroyed
  std::vector<uint64_t> free_indices_;  // released peers' indices, for the next CreatePeer
  uint32_t next_incarnation_ = 1;       // Handshake::incarnation of our next connection
  // Queue pairs of connections the other side replaced (Reconnect), with the WRs still
  // outstanding on them, until ReleaseClosed destroys them.
  struct Replaced {
    OwnedQp qps[2];
    uint64_t index;
    uint32_t outstanding;
    Clock::time_point at;
  };
  std::vector<Replaced> replaced_;
  std::unordered_map<ibv_mr*, OwnedMr> live_mrs_;  // the engine's registrations
  std::deque<DomainCompletion> refused_;           // WRs the device refused after we said kPosted
};

}  // namespace

StatusOr<std::unique_ptr<Domain>> OpenVerbsDomain(const EngineOptions& options,
                                                  const std::string& device,
                                                  std::shared_ptr<VerbsApi> api,
                                                  const VerbsConfig& config) {
  auto d = std::make_unique<VerbsDomain>(std::move(api), config, options.cuda_memory);
  RETURN_IF_ERROR(d->Init(options, device));
  return std::unique_ptr<Domain>(std::move(d));
}

}  // namespace ferry::fabric::verbs
