// FakeVerbs: an in-process stand-in for RDMA devices, for tests on machines without any.
//
// A FakeNet holds devices; every FakeVerbs over the same net sees them all, as hosts on one
// fabric would. It keeps the rules the backend depends on: queue pairs move RESET -> INIT -> RTR
// -> RTS with the attributes each step needs (else EINVAL); RC writes land only inside a
// registered region of the right rkey (else a remote access error); WRITE_WITH_IMM and SEND
// consume a receive from the target queue pair's SRQ (none: receiver-not-ready); UD receives
// start with a 40-byte GRH slot and a wrong qkey drops the message; a dead device's queue pairs
// never answer (retries exhausted). Completions go to the CQs the queue pairs were created with.
// Tests can drop UD messages and kill devices.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "fabric/verbs/verbs_api.h"

namespace ferry::fabric::verbs {

class FakeNet {
 public:
  void AddDevice(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    uint16_t lid = static_cast<uint16_t>(devices.size() + 1);
    devices.push_back(name);
    lids[name] = lid;
  }
  void DropUdMessages(int n) {
    std::lock_guard<std::mutex> lock(mu);
    drop_ud = n;
  }
  void KillDevice(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    dead.insert(name);
  }
  int ud_dropped() {
    std::lock_guard<std::mutex> lock(mu);
    return dropped;
  }
  // RC queue pairs that exist on `device`, in any state (destroyed ones are gone).
  int LiveRcQps(const std::string& device);
  // Objects of every kind (devices opened, PDs, MRs, CQs, SRQs, QPs, AHs) made and not yet
  // destroyed, on all devices.
  std::atomic<int> live_objects{0};

  struct Cq {
    ibv_cq cq{};
    std::deque<ibv_wc> wcs;
  };
  struct RecvWr {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
  };
  struct Srq {
    ibv_srq srq{};
    std::deque<RecvWr> wrs;
    uint32_t max = 0;
  };
  // A work request held back by receiver-not-ready: rnr_retry 7 retries until a receive comes.
  struct Blocked {
    ibv_send_wr wr{};
    std::vector<ibv_sge> sges;
  };
  struct Qp {
    ibv_qp qp{};
    uint8_t rnr_retry = 0;
    std::deque<Blocked> blocked;  // in order: RC delivers in order
    std::string device;
    Cq* send_cq = nullptr;
    Cq* recv_cq = nullptr;
    Srq* srq = nullptr;
    std::deque<RecvWr> rq;
    uint32_t dest_qpn = 0;
    uint32_t qkey = 0;
  };
  struct Mr {
    ibv_mr mr{};
  };

  std::mutex mu;
  std::vector<std::string> devices;
  std::map<std::string, uint16_t> lids;
  std::set<std::string> dead;
  std::map<uint32_t, Qp*> qps;
  std::map<uint32_t, Mr*> mrs;  // by rkey
  uint32_t next_id = 0x100;
  int drop_ud = 0;
  int dropped = 0;
};

inline int FakeNet::LiveRcQps(const std::string& device) {
  std::lock_guard<std::mutex> lock(mu);
  int n = 0;
  for (const auto& [num, qp] : qps) n += qp->device == device && qp->qp.qp_type == IBV_QPT_RC;
  return n;
}

class FakeVerbs final : public VerbsApi {
  // One object fewer alive (FakeNet::live_objects); the destroy calls' success.
  int Gone() {
    --net_->live_objects;
    return 0;
  }

 public:
  explicit FakeVerbs(std::shared_ptr<FakeNet> net) : net_(std::move(net)) {}
  ~FakeVerbs() override {
    std::lock_guard<std::mutex> lock(net_->mu);
    for (auto& [qpn, qp] : qps_) net_->qps.erase(qpn);
    for (auto& [key, mr] : mrs_) net_->mrs.erase(key);
  }

  std::vector<std::string> DeviceNames() override {
    std::lock_guard<std::mutex> lock(net_->mu);
    return net_->devices;
  }
  ibv_context* OpenDevice(const std::string& name) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    if (!net_->lids.count(name)) {
      errno = ENODEV;
      return nullptr;
    }
    auto c = std::make_unique<Context>();
    c->device = name;
    ibv_context* out = &c->context;
    contexts_.push_back(std::move(c));
    ++net_->live_objects;
    return out;
  }
  int CloseDevice(ibv_context*) override { return Gone(); }
  int QueryDevice(ibv_context*, ibv_device_attr* attr) override {
    *attr = {};
    attr->max_qp_wr = 4096;
    return 0;
  }
  int QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* attr) override {
    if (port != 1) return EINVAL;
    std::lock_guard<std::mutex> lock(net_->mu);
    *attr = {};
    attr->state = IBV_PORT_ACTIVE;
    attr->active_mtu = IBV_MTU_4096;
    attr->link_layer = IBV_LINK_LAYER_INFINIBAND;
    attr->lid = net_->lids[Ctx(c)->device];
    attr->max_msg_sz = 1u << 30;
    return 0;
  }
  int QueryGid(ibv_context* c, uint8_t, int index, ibv_gid* gid) override {
    if (index != 0) return EINVAL;
    *gid = {};
    gid->raw[0] = 0xfe;
    gid->raw[1] = 0x80;
    std::lock_guard<std::mutex> lock(net_->mu);
    gid->raw[15] = static_cast<uint8_t>(net_->lids[Ctx(c)->device]);
    return 0;
  }
  ibv_pd* AllocPd(ibv_context* c) override {
    auto pd = std::make_unique<Pd>();
    pd->pd.context = c;
    ibv_pd* out = &pd->pd;
    pds_.push_back(std::move(pd));
    ++net_->live_objects;
    return out;
  }
  int DeallocPd(ibv_pd*) override { return Gone(); }
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) override {
    if (!addr || length == 0 || !(access & IBV_ACCESS_LOCAL_WRITE)) {
      errno = EINVAL;
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(net_->mu);
    auto mr = std::make_unique<FakeNet::Mr>();
    mr->mr.pd = pd;
    mr->mr.addr = addr;
    mr->mr.length = length;
    mr->mr.lkey = mr->mr.rkey = ++net_->next_id;
    net_->mrs[mr->mr.rkey] = mr.get();
    ibv_mr* out = &mr->mr;
    mrs_[mr->mr.rkey] = std::move(mr);
    ++net_->live_objects;
    return out;
  }
  ibv_mr* RegDmabufMr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) override {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  int DeregMr(ibv_mr* mr) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    net_->mrs.erase(mr->rkey);
    mrs_.erase(mr->rkey);
    return Gone();
  }
  ibv_cq* CreateCq(ibv_context* c, int) override {
    auto cq = std::make_unique<FakeNet::Cq>();
    cq->cq.context = c;
    ibv_cq* out = &cq->cq;
    cqs_.push_back(std::move(cq));
    ++net_->live_objects;
    return out;
  }
  int DestroyCq(ibv_cq*) override { return Gone(); }
  ibv_srq* CreateSrq(ibv_pd*, ibv_srq_init_attr* attr) override {
    auto srq = std::make_unique<FakeNet::Srq>();
    srq->max = attr->attr.max_wr;
    ibv_srq* out = &srq->srq;
    srqs_.push_back(std::move(srq));
    ++net_->live_objects;
    return out;
  }
  int DestroySrq(ibv_srq*) override { return Gone(); }
  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto qp = std::make_unique<FakeNet::Qp>();
    qp->qp.qp_num = ++net_->next_id;
    qp->qp.qp_type = attr->qp_type;
    qp->qp.state = IBV_QPS_RESET;
    qp->qp.pd = pd;
    qp->device = Ctx(pd->context)->device;
    qp->send_cq = reinterpret_cast<FakeNet::Cq*>(attr->send_cq);
    qp->recv_cq = reinterpret_cast<FakeNet::Cq*>(attr->recv_cq);
    qp->srq = reinterpret_cast<FakeNet::Srq*>(attr->srq);
    net_->qps[qp->qp.qp_num] = qp.get();
    ibv_qp* out = &qp->qp;
    qps_[qp->qp.qp_num] = std::move(qp);
    ++net_->live_objects;
    return out;
  }
  int ModifyQp(ibv_qp* ibv, ibv_qp_attr* attr, int mask) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto* qp = reinterpret_cast<FakeNet::Qp*>(ibv);
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    const bool rc = ibv->qp_type == IBV_QPT_RC;
    const ibv_qp_state from = ibv->state, to = attr->qp_state;
    auto has = [&](int bits) { return (mask & bits) == bits; };
    if (to == IBV_QPS_ERR) {
      ibv->state = to;
      return 0;
    }
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT) {
      if (!has(IBV_QP_PKEY_INDEX | IBV_QP_PORT) || attr->port_num != 1) return EINVAL;
      if (rc ? !has(IBV_QP_ACCESS_FLAGS) : !has(IBV_QP_QKEY)) return EINVAL;
      qp->qkey = attr->qkey;
    } else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
      if (rc) {
        if (!has(IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
          return EINVAL;
        }
        if (!net_->qps.count(attr->dest_qp_num)) return EINVAL;
        qp->dest_qpn = attr->dest_qp_num;
      }
    } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
      if (!has(IBV_QP_SQ_PSN)) return EINVAL;
      qp->rnr_retry = attr->rnr_retry;
      if (rc && !has(IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                     IBV_QP_MAX_QP_RD_ATOMIC)) {
        return EINVAL;
      }
    } else {
      return EINVAL;
    }
    ibv->state = to;
    return 0;
  }
  int DestroyQp(ibv_qp* qp) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    net_->qps.erase(qp->qp_num);
    qps_.erase(qp->qp_num);
    return Gone();
  }
  ibv_ah* CreateAh(ibv_pd*, ibv_ah_attr*) override {
    auto ah = std::make_unique<ibv_ah>();
    ibv_ah* out = ah.get();
    ahs_.push_back(std::move(ah));
    ++net_->live_objects;
    return out;
  }
  int DestroyAh(ibv_ah*) override { return Gone(); }

  int PostSend(ibv_qp* ibv, ibv_send_wr* wr, ibv_send_wr** bad) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto* qp = reinterpret_cast<FakeNet::Qp*>(ibv);
    for (; wr; wr = wr->next) {
      if (ibv->state != IBV_QPS_RTS) {
        *bad = wr;
        return EINVAL;
      }
      if (ibv->qp_type == IBV_QPT_UD) {
        SendUd(*qp, *wr);
      } else if (!qp->blocked.empty() || !SendRc(*qp, *wr)) {
        FakeNet::Blocked b;
        b.wr = *wr;
        b.wr.next = nullptr;
        b.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
        qp->blocked.push_back(std::move(b));
      }
    }
    return 0;
  }
  int PostRecv(ibv_qp* ibv, ibv_recv_wr* wr, ibv_recv_wr**) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto* qp = reinterpret_cast<FakeNet::Qp*>(ibv);
    for (; wr; wr = wr->next) qp->rq.push_back(ToRecv(*wr));
    return 0;
  }
  int PostSrqRecv(ibv_srq* ibv, ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto* srq = reinterpret_cast<FakeNet::Srq*>(ibv);
    for (; wr; wr = wr->next) {
      if (srq->wrs.size() >= srq->max) {
        *bad = wr;
        return ENOMEM;
      }
      srq->wrs.push_back(ToRecv(*wr));
    }
    // Senders held back by receiver-not-ready towards this SRQ go on, in order.
    for (auto& [qpn, qp] : net_->qps) {
      auto dst = net_->qps.find(qp->dest_qpn);
      if (qp->blocked.empty() || dst == net_->qps.end() || dst->second->srq != srq) continue;
      while (!qp->blocked.empty()) {
        FakeNet::Blocked& b = qp->blocked.front();
        b.wr.sg_list = b.sges.data();
        if (!SendRc(*qp, b.wr)) break;
        qp->blocked.pop_front();
      }
    }
    return 0;
  }
  int PollCq(ibv_cq* ibv, int entries, ibv_wc* wc) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto* cq = reinterpret_cast<FakeNet::Cq*>(ibv);
    int n = 0;
    while (n < entries && !cq->wcs.empty()) {
      wc[n++] = cq->wcs.front();
      cq->wcs.pop_front();
    }
    return n;
  }

 private:
  struct Context {
    ibv_context context{};
    std::string device;
  };
  struct Pd {
    ibv_pd pd{};
  };
  static Context* Ctx(ibv_context* c) { return reinterpret_cast<Context*>(c); }

  static FakeNet::RecvWr ToRecv(const ibv_recv_wr& wr) {
    return {wr.wr_id, wr.num_sge ? wr.sg_list[0].addr : 0,
            wr.num_sge ? wr.sg_list[0].length : 0u};
  }
  static uint32_t Length(const ibv_send_wr& wr) {
    uint32_t n = 0;
    for (int i = 0; i < wr.num_sge; ++i) n += wr.sg_list[i].length;
    return n;
  }
  static void Gather(const ibv_send_wr& wr, uint8_t* to) {
    for (int i = 0; i < wr.num_sge; ++i) {
      std::memcpy(to, reinterpret_cast<const void*>(wr.sg_list[i].addr), wr.sg_list[i].length);
      to += wr.sg_list[i].length;
    }
  }
  static void Complete(FakeNet::Cq* cq, uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode op,
                       uint32_t qpn, uint32_t length = 0) {
    ibv_wc wc{};
    wc.wr_id = wr_id;
    wc.status = status;
    // A failed completion's opcode is undefined (man ibv_poll_cq): the fake gives the one most
    // likely to mislead, a receive's.
    wc.opcode = status == IBV_WC_SUCCESS ? op : IBV_WC_RECV_RDMA_WITH_IMM;
    wc.qp_num = qpn;
    wc.byte_len = length;
    cq->wcs.push_back(wc);
  }

  void SendUd(FakeNet::Qp& qp, const ibv_send_wr& wr) {
    Complete(qp.send_cq, wr.wr_id, IBV_WC_SUCCESS, IBV_WC_SEND, qp.qp.qp_num);
    auto it = net_->qps.find(wr.wr.ud.remote_qpn);
    if (net_->drop_ud > 0) {
      --net_->drop_ud;
      ++net_->dropped;
      return;
    }
    if (it == net_->qps.end() || net_->dead.count(it->second->device)) return;
    FakeNet::Qp& dst = *it->second;
    if (dst.qkey != wr.wr.ud.remote_qkey || dst.rq.empty()) return;  // UD drops silently
    FakeNet::RecvWr r = dst.rq.front();
    const uint32_t len = Length(wr);
    if (r.length < 40 + len) return;
    dst.rq.pop_front();
    Gather(wr, reinterpret_cast<uint8_t*>(r.addr) + 40);
    Complete(dst.recv_cq, r.wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, dst.qp.qp_num, 40 + len);
  }

  // False when the receiver has no receive posted and the QP retries forever (rnr_retry 7).
  bool SendRc(FakeNet::Qp& qp, const ibv_send_wr& wr) {
    const ibv_wc_opcode done_op = wr.opcode == IBV_WR_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE;
    auto fail = [&](ibv_wc_status s) {
      Complete(qp.send_cq, wr.wr_id, s, done_op, qp.qp.qp_num);
      return true;
    };
    const bool rnr_forever = qp.rnr_retry == 7;
    auto it = net_->qps.find(qp.dest_qpn);
    // A reliable connection is a pair: a queue pair connected to another one than ours answers
    // nothing we can use (its PSNs are not ours), and we retry until we give up.
    if (it == net_->qps.end() || net_->dead.count(it->second->device) ||
        net_->dead.count(qp.device) || it->second->qp.state < IBV_QPS_RTR ||
        it->second->qp.state == IBV_QPS_ERR || it->second->dest_qpn != qp.qp.qp_num) {
      return fail(IBV_WC_RETRY_EXC_ERR);
    }
    FakeNet::Qp& dst = *it->second;
    const uint32_t len = Length(wr);
    if (wr.opcode == IBV_WR_RDMA_WRITE || wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
      if (len > 0) {
        auto mr = net_->mrs.find(wr.wr.rdma.rkey);
        const uint64_t start = mr == net_->mrs.end()
                                   ? 0
                                   : reinterpret_cast<uint64_t>(mr->second->mr.addr);
        if (mr == net_->mrs.end() || wr.wr.rdma.remote_addr < start ||
            wr.wr.rdma.remote_addr + len > start + mr->second->mr.length) {
          return fail(IBV_WC_REM_ACCESS_ERR);
        }
        Gather(wr, reinterpret_cast<uint8_t*>(wr.wr.rdma.remote_addr));
      }
      if (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        if (dst.srq && dst.srq->wrs.empty() && rnr_forever) return false;
        if (!dst.srq || dst.srq->wrs.empty()) return fail(IBV_WC_RNR_RETRY_EXC_ERR);
        FakeNet::RecvWr r = dst.srq->wrs.front();
        dst.srq->wrs.pop_front();
        ibv_wc wc{};
        wc.wr_id = r.wr_id;
        wc.status = IBV_WC_SUCCESS;
        wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = wr.imm_data;
        wc.qp_num = dst.qp.qp_num;
        wc.byte_len = len;
        dst.recv_cq->wcs.push_back(wc);
      }
    } else if (wr.opcode == IBV_WR_SEND) {
      if (dst.srq && dst.srq->wrs.empty() && rnr_forever) return false;
      if (!dst.srq || dst.srq->wrs.empty()) return fail(IBV_WC_RNR_RETRY_EXC_ERR);
      FakeNet::RecvWr r = dst.srq->wrs.front();
      if (r.length < len) return fail(IBV_WC_REM_INV_REQ_ERR);
      dst.srq->wrs.pop_front();
      Gather(wr, reinterpret_cast<uint8_t*>(r.addr));
      Complete(dst.recv_cq, r.wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, dst.qp.qp_num, len);
    } else {
      return fail(IBV_WC_LOC_QP_OP_ERR);
    }
    if (wr.send_flags & IBV_SEND_SIGNALED) {
      Complete(qp.send_cq, wr.wr_id, IBV_WC_SUCCESS, done_op, qp.qp.qp_num);
    }
    return true;
  }

  std::shared_ptr<FakeNet> net_;
  std::vector<std::unique_ptr<Context>> contexts_;
  std::vector<std::unique_ptr<Pd>> pds_;
  std::map<uint32_t, std::unique_ptr<FakeNet::Mr>> mrs_;
  std::vector<std::unique_ptr<FakeNet::Cq>> cqs_;
  std::vector<std::unique_ptr<FakeNet::Srq>> srqs_;
  std::map<uint32_t, std::unique_ptr<FakeNet::Qp>> qps_;
  std::vector<std::unique_ptr<ibv_ah>> ahs_;
};

}  // namespace ferry::fabric::verbs
