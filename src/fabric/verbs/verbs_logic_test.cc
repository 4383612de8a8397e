// The verbs backend's logic against a fake VerbsApi: no RDMA device exists on these machines.
#include "fabric/verbs/verbs_logic.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "fabric/test_util.h"

namespace ferry::fabric::verbs {
namespace {

// Records what the logic asks of the device; fails where told to.
class FakeVerbs final : public VerbsApi {
 public:
  struct Modify {
    uint32_t qpn;
    ibv_qp_attr attr;
    int mask;
  };
  std::vector<std::string> devices;
  std::vector<Modify> modifies;
  int fail_state = -1;  // ModifyQp to this state fails with EINVAL
  std::vector<std::vector<ibv_send_wr>> posts;
  int refuse_at = -1;  // PostSend refuses the WR at this index with ENOMEM
  bool dmabuf_works = true;
  int reg_mr_calls = 0, reg_dmabuf_calls = 0;
  ibv_mr mr{};

  std::vector<std::string> DeviceNames() override { return devices; }
  ibv_context* OpenDevice(const std::string&) override { return nullptr; }
  int CloseDevice(ibv_context*) override { return 0; }
  int QueryDevice(ibv_context*, ibv_device_attr*) override { return 0; }
  int QueryPort(ibv_context*, uint8_t, ibv_port_attr*) override { return 0; }
  int QueryGid(ibv_context*, uint8_t, int, ibv_gid*) override { return 0; }
  ibv_pd* AllocPd(ibv_context*) override { return nullptr; }
  int DeallocPd(ibv_pd*) override { return 0; }
  ibv_mr* RegMr(ibv_pd*, void*, size_t, int) override {
    ++reg_mr_calls;
    return &mr;
  }
  uint64_t last_dmabuf_offset = 0;
  ibv_mr* RegDmabufMr(ibv_pd*, uint64_t offset, size_t, uint64_t, int, int) override {
    ++reg_dmabuf_calls;
    last_dmabuf_offset = offset;
    if (dmabuf_works) return &mr;
    errno = EOPNOTSUPP;
    return nullptr;
  }
  int DeregMr(ibv_mr*) override { return 0; }
  ibv_cq* CreateCq(ibv_context*, int) override { return nullptr; }
  int DestroyCq(ibv_cq*) override { return 0; }
  ibv_srq* CreateSrq(ibv_pd*, ibv_srq_init_attr*) override { return nullptr; }
  int DestroySrq(ibv_srq*) override { return 0; }
  ibv_qp* CreateQp(ibv_pd*, ibv_qp_init_attr*) override { return nullptr; }
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) override {
    modifies.push_back({qp->qp_num, *attr, mask});
    return static_cast<int>(attr->qp_state) == fail_state ? EINVAL : 0;
  }
  int DestroyQp(ibv_qp*) override { return 0; }
  ibv_ah* CreateAh(ibv_pd*, ibv_ah_attr*) override { return nullptr; }
  int DestroyAh(ibv_ah*) override { return 0; }
  int PostSend(ibv_qp*, ibv_send_wr* wr, ibv_send_wr** bad) override {
    std::vector<ibv_send_wr> chain;
    int i = 0;
    for (ibv_send_wr* w = wr; w; w = w->next, ++i) {
      if (i == refuse_at) {
        *bad = w;
        posts.push_back(chain);
        return ENOMEM;
      }
      chain.push_back(*w);
    }
    posts.push_back(chain);
    return 0;
  }
  int PostRecv(ibv_qp*, ibv_recv_wr*, ibv_recv_wr**) override { return 0; }
  int PostSrqRecv(ibv_srq*, ibv_recv_wr*, ibv_recv_wr**) override { return 0; }
  int PollCq(ibv_cq*, int, ibv_wc*) override { return 0; }
};

Handshake Remote() {
  Handshake h;
  h.token = 0xabc;
  h.peer_token = 0xdef;
  for (int i = 0; i < 16; ++i) h.gid.raw[i] = static_cast<uint8_t>(0xf0 + i);
  h.lid = 17;
  h.port = 1;
  h.mtu = IBV_MTU_2048;
  h.msg = {0x1234, 0x111};
  h.write = {0x1235, 0x222};
  h.have_yours = true;
  h.incarnation = 0x9abcdef;
  return h;
}

TEST(VerbsLogicTest, HandshakesRoundTripAndMalformedOnesAreRefused) {
  Handshake h = Remote();
  std::vector<uint8_t> bytes = h.Serialize();
  auto p = Handshake::Parse(bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->token, h.token);
  EXPECT_EQ(p->peer_token, h.peer_token);
  EXPECT_EQ(0, std::memcmp(p->gid.raw, h.gid.raw, 16));
  EXPECT_EQ(p->lid, 17);
  EXPECT_EQ(p->mtu, IBV_MTU_2048);
  EXPECT_EQ(p->msg.qpn, 0x1234u);
  EXPECT_EQ(p->write.psn, 0x222u);
  EXPECT_TRUE(p->have_yours);
  EXPECT_EQ(p->incarnation, 0x9abcdefu);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_EQ(Handshake::Parse(std::span(bytes).first(n)).status().code(),
              StatusCode::kInvalidArgument);
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 5000; ++i) {
    std::vector<uint8_t> b = bytes;
    b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    auto q = Handshake::Parse(b);
    if (q.ok()) EXPECT_EQ(q->Serialize(), b);
  }
  Handshake bad = h;
  bad.write.qpn = 1u << 24;  // QP numbers have 24 bits
  EXPECT_FALSE(Handshake::Parse(bad.Serialize()).ok());
  bad = h;
  bad.token = 0;
  EXPECT_FALSE(Handshake::Parse(bad.Serialize()).ok());
}

TEST(VerbsLogicTest, RcQueuePairsGoThroughInitRtrRtsWithThePeersNumbers) {
  FakeVerbs api;
  VerbsConfig config;
  config.service_level = 3;
  config.traffic_class = 106;
  LocalPort port{1, IBV_MTU_4096, IBV_LINK_LAYER_ETHERNET, 3};
  Handshake remote = Remote();
  auto steps = RcSteps(config, port, 0x777, remote, remote.write);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ibv_qp qp{};
  qp.qp_num = 0x99;
  ASSERT_TRUE(ApplySteps(api, &qp, *steps, "writes to peer 0").ok());
  ASSERT_EQ(api.modifies.size(), 3u);
  EXPECT_EQ(api.modifies[0].attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(api.modifies[0].attr.port_num, 1);
  EXPECT_TRUE(api.modifies[0].attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(api.modifies[0].mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                      IBV_QP_ACCESS_FLAGS);
  const ibv_qp_attr& rtr = api.modifies[1].attr;
  EXPECT_EQ(rtr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(rtr.dest_qp_num, 0x1235u);  // the peer's write QP
  EXPECT_EQ(rtr.rq_psn, 0x222u);
  EXPECT_EQ(rtr.path_mtu, IBV_MTU_2048);  // the smaller of the two sides
  EXPECT_EQ(rtr.ah_attr.is_global, 1);    // RoCE routes by GID
  EXPECT_EQ(rtr.ah_attr.grh.sgid_index, 3);
  EXPECT_EQ(rtr.ah_attr.grh.traffic_class, 106);
  EXPECT_EQ(rtr.ah_attr.sl, 3);
  EXPECT_EQ(0, std::memcmp(rtr.ah_attr.grh.dgid.raw, remote.gid.raw, 16));
  EXPECT_TRUE(api.modifies[1].mask & IBV_QP_DEST_QPN);
  EXPECT_TRUE(api.modifies[1].mask & IBV_QP_AV);
  const ibv_qp_attr& rts = api.modifies[2].attr;
  EXPECT_EQ(rts.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(rts.sq_psn, 0x777u);
  EXPECT_EQ(rts.timeout, config.timeout);
  EXPECT_EQ(rts.retry_cnt, config.retry_count);
  EXPECT_TRUE(api.modifies[2].mask & IBV_QP_SQ_PSN);

  // InfiniBand with a LID: no GRH.
  LocalPort ib{1, IBV_MTU_4096, IBV_LINK_LAYER_INFINIBAND, 0};
  auto ib_steps = RcSteps(config, ib, 1, remote, remote.msg);
  ASSERT_TRUE(ib_steps.ok());
  EXPECT_EQ((*ib_steps)[1].attr.ah_attr.is_global, 0);
  EXPECT_EQ((*ib_steps)[1].attr.ah_attr.dlid, 17);
  EXPECT_EQ((*ib_steps)[1].attr.dest_qp_num, 0x1234u);
  // RoCE without the peer's GID cannot route.
  Handshake no_gid = remote;
  no_gid.gid = {};
  EXPECT_EQ(RcSteps(config, port, 1, no_gid, no_gid.msg).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(VerbsLogicTest, AFailedTransitionNamesTheQpAndTheStep) {
  FakeVerbs api;
  api.fail_state = IBV_QPS_RTR;
  LocalPort port;
  Handshake remote = Remote();
  auto steps = RcSteps(VerbsConfig{}, port, 1, remote, remote.msg);
  ASSERT_TRUE(steps.ok());
  ibv_qp qp{};
  qp.qp_num = 0x42;
  Status s = ApplySteps(api, &qp, *steps, "messages to peer 3");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("0x42"), std::string::npos) << s;
  EXPECT_NE(s.message().find("RTR"), std::string::npos) << s;
  EXPECT_NE(s.message().find("messages to peer 3"), std::string::npos) << s;
  EXPECT_EQ(api.modifies.size(), 2u);  // stopped at RTR: RTS never attempted
  auto ud = UdSteps(VerbsConfig{}, 5);
  EXPECT_EQ(ud[0].attr.qkey, VerbsConfig{}.qkey);
  EXPECT_TRUE(ud[0].mask & IBV_QP_QKEY);
}

TEST(VerbsLogicTest, WorkRequestsChainIntoOnePostWithImmediatesInNetworkOrder) {
  FakeVerbs api;
  ibv_qp qp{};
  qp.qp_num = 7;
  WrChain chain(4, 64);
  uint8_t buf[4096];
  chain.AddWrite(buf, 4096, 11, 0x10000, 22, std::nullopt, 1);
  chain.AddWrite(buf, 32, 11, 0x20000, 22, 0x01020304u, 2);  // small: inlined
  chain.AddWrite(nullptr, 0, 0, 0x30000, 23, 9u, 3);         // immediate alone
  chain.AddSend(buf, 100, 11, 4);
  EXPECT_TRUE(chain.full());
  Status error;
  EXPECT_EQ(chain.Post(api, &qp, &error), 4u);
  EXPECT_TRUE(error.ok());
  EXPECT_TRUE(chain.empty());
  ASSERT_EQ(api.posts.size(), 1u);  // one doorbell for four WRs
  const auto& posted = api.posts[0];
  ASSERT_EQ(posted.size(), 4u);
  EXPECT_EQ(posted[0].opcode, IBV_WR_RDMA_WRITE);
  EXPECT_EQ(posted[0].wr.rdma.remote_addr, 0x10000u);
  EXPECT_EQ(posted[0].sg_list->length, 4096u);
  EXPECT_EQ(posted[0].send_flags, unsigned(IBV_SEND_SIGNALED));
  EXPECT_EQ(posted[1].opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
  EXPECT_EQ(posted[1].imm_data, htonl(0x01020304u));
  EXPECT_EQ(posted[1].send_flags, unsigned(IBV_SEND_SIGNALED | IBV_SEND_INLINE));
  EXPECT_EQ(posted[2].num_sge, 0);
  EXPECT_EQ(posted[2].wr.rdma.rkey, 23u);
  EXPECT_EQ(posted[3].opcode, IBV_WR_SEND);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(posted[i].wr_id, uint64_t(i + 1));

  // A refusal part-way: the WRs before it were taken, the error names the first refused.
  api.refuse_at = 2;
  for (uint64_t id = 10; id < 14; ++id) chain.AddWrite(buf, 8, 11, 0, 22, std::nullopt, id);
  EXPECT_EQ(chain.Post(api, &qp, &error), 2u);
  EXPECT_EQ(error.code(), StatusCode::kResourceExhausted) << error;
  EXPECT_NE(error.message().find("0xc"), std::string::npos) << error;  // WR id 12
  EXPECT_TRUE(chain.empty());
}

TEST(VerbsLogicTest, CompletionErrorsMapToStatusWithFullContext) {
  ibv_wc wc{};
  wc.wr_id = 0x55;
  wc.qp_num = 0x66;
  wc.vendor_err = 0x81;
  wc.status = IBV_WC_SUCCESS;
  EXPECT_TRUE(WcToStatus(wc, "peer 2").ok());
  struct {
    ibv_wc_status status;
    StatusCode code;
  } cases[] = {{IBV_WC_RETRY_EXC_ERR, StatusCode::kUnavailable},
               {IBV_WC_RNR_RETRY_EXC_ERR, StatusCode::kUnavailable},
               {IBV_WC_REM_ACCESS_ERR, StatusCode::kInvalidArgument},
               {IBV_WC_LOC_PROT_ERR, StatusCode::kInvalidArgument},
               {IBV_WC_WR_FLUSH_ERR, StatusCode::kCancelled},
               {IBV_WC_FATAL_ERR, StatusCode::kInternal}};
  for (const auto& c : cases) {
    wc.status = c.status;
    Status s = WcToStatus(wc, "peer 2");
    EXPECT_EQ(s.code(), c.code) << s;
    for (const char* part : {"peer 2", "0x55", "0x66", "0x81"}) {
      EXPECT_NE(s.message().find(part), std::string::npos) << s;
    }
  }
}

TEST(VerbsLogicTest, GpuMemoryFallsBackFromDmabufToPlainRegistration) {
  FakeVerbs api;
  const int access = MrAccess(VerbsConfig{});
  EXPECT_TRUE(access & IBV_ACCESS_RELAXED_ORDERING);
  VerbsConfig strict;
  strict.relaxed_ordering = false;
  EXPECT_FALSE(MrAccess(strict) & IBV_ACCESS_RELAXED_ORDERING);
  uint8_t buf[64];
  ASSERT_TRUE(RegisterWithFallback(api, nullptr, buf, 64, {5, 16}, access).ok());
  EXPECT_EQ(api.reg_dmabuf_calls, 1);
  EXPECT_EQ(api.last_dmabuf_offset, 16u);
  EXPECT_EQ(api.reg_mr_calls, 0);
  api.dmabuf_works = false;
  ASSERT_TRUE(RegisterWithFallback(api, nullptr, buf, 64, {5, 0}, access).ok());
  EXPECT_EQ(api.reg_dmabuf_calls, 2);
  EXPECT_EQ(api.reg_mr_calls, 1);
  ASSERT_TRUE(RegisterWithFallback(api, nullptr, buf, 64, {}, access).ok());  // no dma-buf
  EXPECT_EQ(api.reg_dmabuf_calls, 2);
  // Host memory has no dma-buf (and without a CUDA driver nothing has one).
  EXPECT_EQ(CudaDmabuf(buf, sizeof buf).fd, -1);
}

TEST(VerbsLogicTest, DeviceChoiceAndConfigurationAreChecked) {
  EXPECT_EQ(PickDevice({}, "").status().code(), StatusCode::kUnavailable);
  EXPECT_NE(PickDevice({}, "").status().message().find("no RDMA device found"),
            std::string::npos);
  EXPECT_EQ(*PickDevice({"mlx5_0", "mlx5_1"}, ""), "mlx5_0");
  EXPECT_EQ(*PickDevice({"mlx5_0", "mlx5_1"}, "mlx5_1"), "mlx5_1");
  EXPECT_EQ(PickDevice({"mlx5_0"}, "mlx5_7").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(VerbsConfig{}.Validate().ok());
  VerbsConfig c;
  c.mtu_bytes = 3000;
  EXPECT_FALSE(c.Validate().ok());
  c = VerbsConfig{};
  c.psn = 1u << 24;
  EXPECT_FALSE(c.Validate().ok());
  c = VerbsConfig{};
  c.port = 0;
  EXPECT_FALSE(c.Validate().ok());
  c = VerbsConfig{};
  c.max_unclaimed_peers = 0;  // a peer that adds us first could never connect
  EXPECT_FALSE(c.Validate().ok());
}

}  // namespace
}  // namespace ferry::fabric::verbs
