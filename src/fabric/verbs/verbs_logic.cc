#include "fabric/verbs/verbs_logic.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "fabric/wire.h"

namespace ferry::fabric::verbs {
namespace {

constexpr uint32_t kHandshakeMagic = 0x56595246;  // "FRYV"
constexpr uint16_t kHandshakeVersion = 3;  // 3: the sender's UD queue pair
constexpr uint32_t kPsnMask = 0xffffff;

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

Status VerbsConfig::Validate() const {
  if (port == 0) return InvalidArgumentError("verbs: port numbers start at 1");
  if (gid_index < 0 || gid_index > 255) return InvalidArgumentError("verbs: GID index 0..255");
  if (psn > kPsnMask) return InvalidArgumentError("verbs: a PSN has 24 bits");
  if (timeout > 31) return InvalidArgumentError("verbs: timeout exponent 0..31");
  if (retry_count > 7 || rnr_retry > 7) return InvalidArgumentError("verbs: retry counts 0..7");
  if (service_level > 15) return InvalidArgumentError("verbs: service level 0..15");
  if (max_chain == 0) return InvalidArgumentError("verbs: max_chain must be at least 1");
  if (max_unclaimed_peers == 0) {
    return InvalidArgumentError("verbs: max_unclaimed_peers must be at least 1");
  }
  return MtuFromBytes(mtu_bytes).status();
}

StatusOr<ibv_mtu> MtuFromBytes(uint32_t bytes) {
  switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    case 4096: return IBV_MTU_4096;
    default:
      return InvalidArgumentError("verbs: MTU of " + std::to_string(bytes) +
                                  " bytes (256, 512, 1024, 2048 or 4096)");
  }
}

std::vector<uint8_t> Handshake::Serialize() const {
  ByteWriter w;
  w.U32(kHandshakeMagic);
  w.U16(kHandshakeVersion);
  w.U16(0);
  w.U64(token);
  w.U64(peer_token);
  w.Raw(gid.raw, sizeof gid.raw);
  w.U16(lid);
  w.Raw(&port, 1);
  w.Raw(&mtu, 1);
  w.U32(msg.qpn);
  w.U32(msg.psn);
  w.U32(write.qpn);
  w.U32(write.psn);
  uint8_t flags = (have_yours ? 1 : 0) | (goodbye ? 2 : 0);
  w.Raw(&flags, 1);
  w.U32(incarnation);
  w.U32(ud_qpn);
  return w.Take();
}

StatusOr<Handshake> Handshake::Parse(std::span<const uint8_t> bytes) {
  ByteReader r(bytes, "verbs handshake");
  Handshake h;
  uint32_t magic = 0;
  uint16_t version = 0, reserved = 0;
  uint8_t flags = 0;
  RETURN_IF_ERROR(r.U32(&magic));
  if (magic != kHandshakeMagic) return InvalidArgumentError("verbs handshake: bad magic");
  RETURN_IF_ERROR(r.U16(&version));
  RETURN_IF_ERROR(r.U16(&reserved));
  if (version != kHandshakeVersion || reserved != 0) {
    return InvalidArgumentError("verbs handshake: version " + std::to_string(version) +
                                ", this build reads " + std::to_string(kHandshakeVersion));
  }
  RETURN_IF_ERROR(r.U64(&h.token));
  RETURN_IF_ERROR(r.U64(&h.peer_token));
  RETURN_IF_ERROR(r.Raw(h.gid.raw, sizeof h.gid.raw));
  RETURN_IF_ERROR(r.U16(&h.lid));
  RETURN_IF_ERROR(r.Raw(&h.port, 1));
  RETURN_IF_ERROR(r.Raw(&h.mtu, 1));
  RETURN_IF_ERROR(r.U32(&h.msg.qpn));
  RETURN_IF_ERROR(r.U32(&h.msg.psn));
  RETURN_IF_ERROR(r.U32(&h.write.qpn));
  RETURN_IF_ERROR(r.U32(&h.write.psn));
  RETURN_IF_ERROR(r.Raw(&flags, 1));
  RETURN_IF_ERROR(r.U32(&h.incarnation));
  RETURN_IF_ERROR(r.U32(&h.ud_qpn));
  RETURN_IF_ERROR(r.Finish());
  if (h.token == 0) return InvalidArgumentError("verbs handshake: token is 0");
  if (h.port == 0) return InvalidArgumentError("verbs handshake: port 0");
  if (h.mtu < IBV_MTU_256 || h.mtu > IBV_MTU_4096) {
    return InvalidArgumentError("verbs handshake: MTU code " + std::to_string(h.mtu));
  }
  if (flags > 3) return InvalidArgumentError("verbs handshake: unknown flags");
  for (const RcEndpoint* ep : {&h.msg, &h.write}) {
    if (ep->qpn == 0 || ep->qpn > kPsnMask || ep->psn > kPsnMask) {
      return InvalidArgumentError("verbs handshake: QP number or PSN out of 24 bits");
    }
  }
  h.have_yours = flags & 1;
  h.goodbye = flags & 2;
  return h;
}

QpStep RcInitStep(uint8_t port) {
  QpStep init;
  init.name = "INIT";
  init.attr = {};
  init.attr.qp_state = IBV_QPS_INIT;
  init.attr.pkey_index = 0;
  init.attr.port_num = port;
  init.attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                              IBV_ACCESS_REMOTE_READ;
  init.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return init;
}

StatusOr<std::vector<QpStep>> RcSteps(const VerbsConfig& config, const LocalPort& local,
                                      uint32_t local_psn, const Handshake& remote,
                                      const RcEndpoint& remote_ep) {
  ASSIGN_OR_RETURN(ibv_mtu configured, MtuFromBytes(config.mtu_bytes));
  const ibv_mtu mtu = static_cast<ibv_mtu>(
      std::min({static_cast<int>(configured), static_cast<int>(local.active_mtu),
                static_cast<int>(remote.mtu)}));
  const bool ethernet = local.link_layer == IBV_LINK_LAYER_ETHERNET;
  static const ibv_gid kZeroGid{};
  const bool remote_has_gid = std::memcmp(remote.gid.raw, kZeroGid.raw, sizeof kZeroGid.raw) != 0;
  if (ethernet && !remote_has_gid) {
    return InvalidArgumentError("verbs: RoCE needs the peer's GID, and its handshake has none");
  }
  if (!ethernet && remote.lid == 0 && !remote_has_gid) {
    return InvalidArgumentError("verbs: the peer's handshake has neither LID nor GID");
  }
  std::vector<QpStep> steps(3);
  steps[0] = RcInitStep(local.port);

  QpStep& rtr = steps[1];
  rtr.name = "RTR";
  rtr.attr = {};
  rtr.attr.qp_state = IBV_QPS_RTR;
  rtr.attr.path_mtu = mtu;
  rtr.attr.dest_qp_num = remote_ep.qpn;
  rtr.attr.rq_psn = remote_ep.psn;
  rtr.attr.max_dest_rd_atomic = config.max_rd_atomic;
  rtr.attr.min_rnr_timer = config.min_rnr_timer;
  rtr.attr.ah_attr.dlid = remote.lid;
  rtr.attr.ah_attr.sl = config.service_level;
  rtr.attr.ah_attr.port_num = local.port;
  // Routed through the GID (GRH) on RoCE always, on InfiniBand when the peer has a GID and no
  // LID (another subnet).
  if (ethernet || remote.lid == 0) {
    rtr.attr.ah_attr.is_global = 1;
    rtr.attr.ah_attr.grh.dgid = remote.gid;
    rtr.attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(local.gid_index);
    rtr.attr.ah_attr.grh.hop_limit = config.hop_limit;
    rtr.attr.ah_attr.grh.traffic_class = config.traffic_class;
  }
  rtr.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;

  QpStep& rts = steps[2];
  rts.name = "RTS";
  rts.attr = {};
  rts.attr.qp_state = IBV_QPS_RTS;
  rts.attr.sq_psn = local_psn & kPsnMask;
  rts.attr.timeout = config.timeout;
  rts.attr.retry_cnt = config.retry_count;
  rts.attr.rnr_retry = config.rnr_retry;
  rts.attr.max_rd_atomic = config.max_rd_atomic;
  rts.mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
             IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  return steps;
}

std::vector<QpStep> UdSteps(const VerbsConfig& config, uint32_t psn) {
  std::vector<QpStep> steps(3);
  steps[0].name = "INIT";
  steps[0].attr = {};
  steps[0].attr.qp_state = IBV_QPS_INIT;
  steps[0].attr.pkey_index = 0;
  steps[0].attr.port_num = config.port;
  steps[0].attr.qkey = config.qkey;
  steps[0].mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
  steps[1].name = "RTR";
  steps[1].attr = {};
  steps[1].attr.qp_state = IBV_QPS_RTR;
  steps[1].mask = IBV_QP_STATE;
  steps[2].name = "RTS";
  steps[2].attr = {};
  steps[2].attr.qp_state = IBV_QPS_RTS;
  steps[2].attr.sq_psn = psn & kPsnMask;
  steps[2].mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  return steps;
}

Status ApplySteps(VerbsApi& api, ibv_qp* qp, std::span<const QpStep> steps,
                  const std::string& what) {
  for (const QpStep& step : steps) {
    ibv_qp_attr attr = step.attr;
    int rc = api.ModifyQp(qp, &attr, step.mask);
    if (rc != 0) {
      return ErrnoError("verbs: moving QP " + Hex(qp ? qp->qp_num : 0) + " (" + what + ") to " +
                            step.name,
                        rc > 0 ? rc : errno);
    }
  }
  return Status::Ok();
}

WrChain::WrChain(uint32_t max_wrs, uint32_t max_inline)
    : wrs_(std::max<uint32_t>(max_wrs, 1)), sges_(wrs_.size()), max_inline_(max_inline) {}

ibv_send_wr& WrChain::Append(const void* local, uint32_t length, uint32_t lkey, uint64_t wr_id,
                            ibv_wr_opcode opcode) {
  ibv_send_wr& wr = wrs_[count_];
  ibv_sge& sge = sges_[count_];
  wr = {};
  sge = {reinterpret_cast<uint64_t>(local), length, lkey};
  wr.wr_id = wr_id;
  wr.sg_list = length ? &sge : nullptr;
  wr.num_sge = length ? 1 : 0;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (length > 0 && length <= max_inline_) wr.send_flags |= IBV_SEND_INLINE;
  if (count_ > 0) wrs_[count_ - 1].next = &wr;
  ++count_;
  return wr;
}

void WrChain::AddWrite(const void* local, uint32_t length, uint32_t lkey, uint64_t remote_addr,
                       uint32_t rkey, std::optional<uint32_t> imm, uint64_t wr_id) {
  ibv_send_wr& wr = Append(local, length, lkey, wr_id,
                           imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE);
  if (imm) wr.imm_data = htonl(*imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
}

void WrChain::AddSend(const void* local, uint32_t length, uint32_t lkey, uint64_t wr_id) {
  Append(local, length, lkey, wr_id, IBV_WR_SEND);
}

uint32_t WrChain::Post(VerbsApi& api, ibv_qp* qp, Status* error) {
  if (count_ == 0) return 0;
  ibv_send_wr* bad = nullptr;
  int rc = api.PostSend(qp, &wrs_[0], &bad);
  uint32_t accepted = count_;
  if (rc != 0) {
    accepted = 0;
    for (uint32_t i = 0; i < count_; ++i) {
      if (&wrs_[i] == bad) {
        accepted = i;
        break;
      }
    }
    *error = ErrnoError("verbs: post to QP " + Hex(qp ? qp->qp_num : 0) + " refused WR " +
                            std::to_string(accepted) + " of " + std::to_string(count_) +
                            " (id " + Hex(bad ? bad->wr_id : 0) + ")",
                        rc > 0 ? rc : errno);
  }
  count_ = 0;
  return accepted;
}

const char* WcStatusName(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "flushed (QP in error state)";
    case IBV_WC_BAD_RESP_ERR: return "bad response";
    case IBV_WC_LOC_ACCESS_ERR: return "local access error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error (key or bounds)";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retries exhausted (peer unreachable)";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "receiver-not-ready retries exhausted";
    case IBV_WC_REM_ABORT_ERR: return "remote abort";
    case IBV_WC_FATAL_ERR: return "fatal device error";
    case IBV_WC_RESP_TIMEOUT_ERR: return "response timeout";
    case IBV_WC_GENERAL_ERR: return "general error";
    default: return "other error";
  }
}

Status WcToStatus(const ibv_wc& wc, const std::string& peer) {
  if (wc.status == IBV_WC_SUCCESS) return Status::Ok();
  std::string message = "verbs: WR " + Hex(wc.wr_id) + " on QP " + Hex(wc.qp_num) + " to " +
                        peer + ": " + WcStatusName(wc.status) + " (status " +
                        std::to_string(static_cast<int>(wc.status)) + ", vendor error " +
                        Hex(wc.vendor_err) + ")";
  switch (wc.status) {
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
    case IBV_WC_REM_ABORT_ERR: return UnavailableError(message);
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR: return InvalidArgumentError(message);
    case IBV_WC_WR_FLUSH_ERR: return CancelledError(message);
    default: return InternalError(message);
  }
}

int MrAccess(const VerbsConfig& config) {
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (config.relaxed_ordering) access |= IBV_ACCESS_RELAXED_ORDERING;
  return access;
}

StatusOr<ibv_mr*> RegisterWithFallback(VerbsApi& api, ibv_pd* pd, void* addr, size_t length,
                                       const Dmabuf& dmabuf, int access) {
  std::string attempts;
  if (dmabuf.fd >= 0) {
    errno = 0;
    ibv_mr* mr = api.RegDmabufMr(pd, dmabuf.offset, length, reinterpret_cast<uint64_t>(addr),
                                 dmabuf.fd, access);
    if (mr) return mr;
    attempts = std::string("ibv_reg_dmabuf_mr: ") + std::strerror(errno) + "; ";
  }
  errno = 0;
  ibv_mr* mr = api.RegMr(pd, addr, length, access);
  if (mr) return mr;
  attempts += std::string("ibv_reg_mr: ") + std::strerror(errno);
  return InternalError("verbs: cannot register " + std::to_string(length) + " bytes at " +
                       Hex(reinterpret_cast<uint64_t>(addr)) + " (" + attempts + ")");
}

Dmabuf CudaDmabuf(void* addr, size_t length) {
  // CUresult cuMemGetHandleForAddressRange(void* handle, CUdeviceptr dptr, size_t size,
  //                                        CUmemRangeHandleType type, unsigned long long flags)
  using GetHandle = int (*)(void*, uint64_t, size_t, int, unsigned long long);
  constexpr int kDmabufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
  static GetHandle get = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<GetHandle>(dlsym(lib, "cuMemGetHandleForAddressRange"))
               : nullptr;
  }();
  Dmabuf out;
  if (!get || !addr || length == 0) return out;
  // The range must be page aligned; the registration then starts `offset` bytes into it.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = reinterpret_cast<uint64_t>(addr) / page * page;
  const uint64_t end = (reinterpret_cast<uint64_t>(addr) + length + page - 1) / page * page;
  int fd = -1;
  if (get(&fd, start, end - start, kDmabufFd, 0) != 0 || fd < 0) return out;
  out.fd = fd;
  out.offset = reinterpret_cast<uint64_t>(addr) - start;
  return out;
}

StatusOr<std::string> PickDevice(const std::vector<std::string>& available,
                                 const std::string& wanted) {
  if (available.empty()) return UnavailableError("verbs: no RDMA device found");
  if (wanted.empty()) return available.front();
  for (const std::string& name : available) {
    if (name == wanted) return name;
  }
  std::string list;
  for (const std::string& name : available) list += (list.empty() ? "" : ", ") + name;
  return NotFoundError("verbs: no RDMA device '" + wanted + "' (have: " + list + ")");
}

}  // namespace ferry::fabric::verbs
