// The verbs domain's class (verbs_domain.h says how it works), and what the files that
// implement it share. They follow a connection's life: verbs_device.cc (the device, the UD
// queue pair and the handshakes over it), verbs_peers.cc (peers, their queue pairs from
// creation to release, registrations) and verbs_post.cc (posting work requests and polling
// their completions).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "fabric/verbs/verbs_domain.h"

namespace ferry::fabric::verbs {

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
inline uint64_t WrId(Tag tag, uint64_t index) { return (index << 3) | tag; }

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
  Clock::time_point closed_at{};   // when its queue pairs went to the error state (Close)
  uint64_t passive_seq = 0;        // its key in unclaimed_ (oldest first) while kUnclaimed
  Clock::time_point last_hello{};
  WrChain write_chain{1, kMaxInline};
  WrChain msg_chain{1, kMaxInline};
  uint32_t outstanding = 0;  // WRs posted on both queue pairs, not completed

  bool closed() const { return state == PeerState::kClosed; }
  bool connected() const { return have_theirs && they_have_ours && !closed(); }
};

class VerbsDomain final : public Domain {
 public:
  VerbsDomain(std::shared_ptr<VerbsApi> api, const VerbsConfig& config, bool cuda_memory)
      : api_(std::move(api)), config_(config), cuda_memory_(cuda_memory) {}

  // The members own the device's objects and go in reverse order of declaration: peers' queue
  // pairs and address handles, registrations, then the UD queue pair, the SRQs, the CQ, the
  // protection domain and the device.
  ~VerbsDomain() override = default;

  Status Init(const EngineOptions& options, const std::string& device);

  const DomainCaps& caps() const override { return caps_; }
  const FabricInfo& info() const override { return info_; }
  std::vector<uint8_t> Name() const override { return name_; }

  StatusOr<uint64_t> InsertPeer(std::span<const uint8_t> bytes) override;

  // A peer's queue pairs (INIT), its address handle and our first hello to it.
  StatusOr<uint64_t> CreatePeer(const UdAddress& addr);

  // The peer's two RC queue pairs, in INIT, waiting for its numbers.
  Status NewQueuePairs(Peer& p, uint64_t index);

  Status RemovePeer(uint64_t peer_addr) override;

  StatusOr<Registration> Register(void* data, uint64_t length, MemoryKind kind, int) override;

  void Deregister(void* handle) override;

  PostResult PostWrite(const WriteWr& wr, Status* error) override;

  PostResult PostSend(const void* data, uint64_t length, void* local_desc, uint64_t peer_addr,
                      OpContext* context, Status* error) override;

  PostResult PostRecv(void* data, uint64_t length, void* local_desc, OpContext* context,
                      Status* error) override;

  size_t Poll(std::span<DomainCompletion> out) override;

 private:
  // The end of a connection: RemovePeer's, an unclaimed one's whose peer said goodbye, or the
  // oldest unclaimed one's when a new peer needs room. With `goodbye`, the peer hears it (best
  // effort: UD may drop it), so that it knows this connection is over and connects again when
  // it next needs us, instead of writing into queue pairs that are gone until its transfers
  // time out. The queue pairs go to the error state (what is outstanding on them completes in
  // error) and are destroyed later (ReleaseClosed).
  void Close(uint64_t index, bool goodbye);

  // Closed peers with nothing chained or outstanding, closed at least release_delay_ms ago:
  // their queue pairs and address handle destroyed, their index free for the next peer (no
  // completion can name it any more). Without this every peer a long-lived engine ever had kept
  // two queue pairs on the device, and every Poll walked them all.
  void ReleaseClosed();

  uint32_t NewPsn();

  StatusOr<OwnedQp> CreateRc(ibv_srq* srq);

  // kPosted when the peer can take a WR now.
  PostResult Ready(uint64_t peer_addr, Peer** out, Status* error);

  void Flush(Peer& p, WrChain& chain, ibv_qp* qp);

  Status PostImmRecv(uint32_t index);

  uint8_t* UdRecvBuffer(uint32_t i) {
    return ud_buffers_.data() + i * (kGrhBytes + kUdMessageBytes);
  }
  uint8_t* UdSendBuffer(uint32_t i) {
    return ud_buffers_.data() + kUdSlots * (kGrhBytes + kUdMessageBytes) + i * kUdMessageBytes;
  }

  Status PostUdRecv(uint32_t index);

  void SendHello(Peer& p, bool goodbye = false);

  void DriveHandshakes();

  // The peer's numbers arrived: our queue pairs go to RTR and RTS towards theirs.
  Status OnHandshake(uint64_t index, const Handshake& h);

  // The other side lost our connection and made a new one: the queue pairs of the old one go
  // to the error state -- what is chained or outstanding on them completes in error -- and are
  // destroyed as a closed peer's are, once those completions came (ReleaseClosed); new ones
  // wait in INIT for the new connection's numbers, which the caller applies. Our PeerId stays.
  Status Reconnect(uint64_t index);

  void OnUdMessage(const uint8_t* data, size_t length);

  // Returns true when `wc` becomes an engine completion in *out.
  bool Translate(const ibv_wc& wc, DomainCompletion* out);

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

}  // namespace ferry::fabric::verbs
