// The decisions of the ConnectX-7 (ibverbs) backend, apart from the calls themselves:
//
// - VerbsConfig: port, GID index, PSNs, qkey, MTU, retry and timeout settings, traffic class and
//   service level; the caller's from EngineOptions::verbs, none hard-coded into a call.
// - Handshake: what two domains tell each other over their UD queue pairs to connect their RC
//   queue pairs (two per peer: one for SEND/RECV messages, one for WRITE_WITH_IMM, whose
//   immediates land in a shared receive queue). Versioned bytes, fully validated.
// - RcSteps / UdSteps: the RESET -> INIT -> RTR -> RTS attribute sets and masks, applied in order
//   by ApplySteps, which names the step and QP that failed.
// - WrChain: several work requests linked into one ibv_post_send, every one signalled (the engine
//   needs one completion per WR), small payloads inlined; a partial post says where it stopped.
// - WcToStatus: a work completion's status as a ferry Status with peer, QP and WR in the message.
// - RegisterWithFallback: GPU memory through ibv_reg_dmabuf_mr, else plain ibv_reg_mr (the
//   nvidia-peermem path), relaxed PCIe ordering where the device allows.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/verbs/verbs_api.h"
#include "ferry/fabric.h"
#include "ferry/status.h"

namespace ferry::fabric::verbs {

// What the backend runs with: the caller's VerbsOptions (EngineOptions::verbs) and the settings
// no caller has needed to change.
struct VerbsConfig : VerbsOptions {
  VerbsConfig() = default;
  explicit VerbsConfig(const VerbsOptions& options) : VerbsOptions(options) {}
  uint8_t min_rnr_timer = 12;
  uint8_t hop_limit = 64;
  uint8_t max_rd_atomic = 16;
  uint32_t max_chain = 16;  // WRs linked into one post

  // What the numbers mean checked: InvalidArgument naming the first that is out of range.
  Status Validate() const;
};

// The MTU enum for a byte count (256..4096); InvalidArgument otherwise.
StatusOr<ibv_mtu> MtuFromBytes(uint32_t bytes);

struct RcEndpoint {
  uint32_t qpn = 0;
  uint32_t psn = 0;  // 24 bits
};

// One domain's half of a connection, sent to the peer's UD queue pair (and re-sent until the
// peer's reply says it has it: UD may drop).
struct Handshake {
  uint64_t token = 0;       // the sender domain's random id
  uint64_t peer_token = 0;  // the domain it is meant for; 0 when not yet known
  ibv_gid gid{};
  uint16_t lid = 0;
  uint8_t port = 1;
  uint8_t mtu = IBV_MTU_4096;  // ibv_mtu
  RcEndpoint msg;              // SEND/RECV queue pair
  RcEndpoint write;            // WRITE_WITH_IMM queue pair
  bool have_yours = false;     // the sender already holds the receiver's handshake
  bool goodbye = false;        // the sender removed the receiver: this connection is over
  // Which of the sender's connections to the receiver this is: each one the sender makes gets a
  // larger number than the last (it added the receiver again after losing it), so a receiver
  // that holds an older one moves over and a late hello of an older one is ignored.
  uint32_t incarnation = 0;
  // The sender's UD queue pair: with token, gid, lid and port, its whole address, so that a
  // domain can answer a peer it was never given (KvPrefill adds a decoder only once the
  // decoder's first request has arrived).
  uint32_t ud_qpn = 0;

  std::vector<uint8_t> Serialize() const;
  static StatusOr<Handshake> Parse(std::span<const uint8_t> bytes);
};

struct QpStep {
  const char* name;  // "INIT", "RTR", "RTS"
  ibv_qp_attr attr;
  int mask;
};

// What the local port says about itself.
struct LocalPort {
  uint8_t port = 1;
  ibv_mtu active_mtu = IBV_MTU_4096;
  uint8_t link_layer = IBV_LINK_LAYER_INFINIBAND;
  int gid_index = 0;
};

// RC RESET -> INIT alone: a queue pair can wait in INIT for its peer's numbers.
QpStep RcInitStep(uint8_t port);
// RC: RESET -> INIT -> RTR -> RTS towards `remote_ep` of the peer described by `remote`.
StatusOr<std::vector<QpStep>> RcSteps(const VerbsConfig& config, const LocalPort& local,
                                      uint32_t local_psn, const Handshake& remote,
                                      const RcEndpoint& remote_ep);
// UD (the handshake QP): RESET -> INIT -> RTR -> RTS.
std::vector<QpStep> UdSteps(const VerbsConfig& config, uint32_t psn);

// Applies the steps in order; the error names the QP, `what` it is for, and the failed step.
Status ApplySteps(VerbsApi& api, ibv_qp* qp, std::span<const QpStep> steps,
                  const std::string& what);

// Work requests linked into one post. Storage is reserved once; Add* never allocates.
class WrChain {
 public:
  WrChain(uint32_t max_wrs, uint32_t max_inline);
  bool full() const { return count_ == wrs_.size(); }
  bool empty() const { return count_ == 0; }
  uint32_t size() const { return count_; }
  // A write of [local, local + length) to remote_addr; with an immediate, WRITE_WITH_IMM (the
  // immediate travels in network byte order, as verbs requires). length 0: the immediate alone.
  void AddWrite(const void* local, uint32_t length, uint32_t lkey, uint64_t remote_addr,
                uint32_t rkey, std::optional<uint32_t> imm, uint64_t wr_id);
  void AddSend(const void* local, uint32_t length, uint32_t lkey, uint64_t wr_id);
  // Posts the chain and empties it. Returns how many WRs, from the front, the device took; on a
  // refusal `error` names the first WR refused (its id) and the errno.
  uint32_t Post(VerbsApi& api, ibv_qp* qp, Status* error);
  const ibv_send_wr& wr(uint32_t i) const { return wrs_[i]; }

 private:
  // The next WR, signalled, inlined when small, linked after the previous one.
  ibv_send_wr& Append(const void* local, uint32_t length, uint32_t lkey, uint64_t wr_id,
                      ibv_wr_opcode opcode);
  std::vector<ibv_send_wr> wrs_;
  std::vector<ibv_sge> sges_;
  uint32_t count_ = 0;
  uint32_t max_inline_;
};

// A completion's status as a Status (Ok for success); the message carries the peer, the QP
// number, the WR id and the vendor error.
Status WcToStatus(const ibv_wc& wc, const std::string& peer);
const char* WcStatusName(ibv_wc_status status);

// Access flags for a registration: local write and remote write/read, plus relaxed ordering
// when configured (a hint the device ignores if it cannot).
int MrAccess(const VerbsConfig& config);

// A dma-buf for CUDA device memory: the descriptor and where `addr` sits inside it.
struct Dmabuf {
  int fd = -1;
  uint64_t offset = 0;
};

// GPU memory: ibv_reg_dmabuf_mr on `dmabuf` when there is one, then plain ibv_reg_mr (which
// needs nvidia-peermem for device memory). The error names every attempt.
StatusOr<ibv_mr*> RegisterWithFallback(VerbsApi& api, ibv_pd* pd, void* addr, size_t length,
                                       const Dmabuf& dmabuf, int access);

// The dma-buf of a CUDA allocation range, through the driver's cuMemGetHandleForAddressRange
// (libcuda loaded at run time: ferry needs no CUDA to build or run). fd -1 where the driver, the
// kernel or the allocation cannot give one. The caller closes a returned fd.
Dmabuf CudaDmabuf(void* addr, size_t length);

// The device to open: `wanted` if named (NotFound if absent), else the first. Unavailable
// ("no RDMA device found") on a machine without any.
StatusOr<std::string> PickDevice(const std::vector<std::string>& available,
                                 const std::string& wanted);

}  // namespace ferry::fabric::verbs
