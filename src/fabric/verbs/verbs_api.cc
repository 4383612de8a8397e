// The libibverbs side of VerbsApi: one call each, nothing else.
#include "fabric/verbs/verbs_api.h"

#include <cerrno>

namespace ferry::fabric::verbs {
namespace {

class RealVerbsApi final : public VerbsApi {
 public:
  std::vector<std::string> DeviceNames() override {
    std::vector<std::string> names;
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list) return names;
    for (int i = 0; i < n; ++i) names.push_back(ibv_get_device_name(list[i]));
    ibv_free_device_list(list);
    return names;
  }
  ibv_context* OpenDevice(const std::string& name) override {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list) return nullptr;
    ibv_context* context = nullptr;
    for (int i = 0; i < n && !context; ++i) {
      if (name == ibv_get_device_name(list[i])) context = ibv_open_device(list[i]);
    }
    ibv_free_device_list(list);
    if (!context && errno == 0) errno = ENODEV;
    return context;
  }
  int CloseDevice(ibv_context* c) override { return ibv_close_device(c); }
  int QueryDevice(ibv_context* c, ibv_device_attr* a) override { return ibv_query_device(c, a); }
  int QueryPort(ibv_context* c, uint8_t port, ibv_port_attr* a) override {
    return ibv_query_port(c, port, a);
  }
  int QueryGid(ibv_context* c, uint8_t port, int index, ibv_gid* gid) override {
    return ibv_query_gid(c, port, index, gid);
  }
  ibv_pd* AllocPd(ibv_context* c) override { return ibv_alloc_pd(c); }
  int DeallocPd(ibv_pd* pd) override { return ibv_dealloc_pd(pd); }
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) override {
    return ibv_reg_mr(pd, addr, length, access);
  }
  ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                      int access) override {
    return ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access);
  }
  int DeregMr(ibv_mr* mr) override { return ibv_dereg_mr(mr); }
  ibv_cq* CreateCq(ibv_context* c, int entries) override {
    return ibv_create_cq(c, entries, nullptr, nullptr, 0);
  }
  int DestroyCq(ibv_cq* cq) override { return ibv_destroy_cq(cq); }
  ibv_srq* CreateSrq(ibv_pd* pd, ibv_srq_init_attr* a) override { return ibv_create_srq(pd, a); }
  int DestroySrq(ibv_srq* srq) override { return ibv_destroy_srq(srq); }
  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* a) override { return ibv_create_qp(pd, a); }
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* a, int mask) override { return ibv_modify_qp(qp, a, mask); }
  int DestroyQp(ibv_qp* qp) override { return ibv_destroy_qp(qp); }
  ibv_ah* CreateAh(ibv_pd* pd, ibv_ah_attr* a) override { return ibv_create_ah(pd, a); }
  int DestroyAh(ibv_ah* ah) override { return ibv_destroy_ah(ah); }
  int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) override {
    return ibv_post_send(qp, wr, bad);
  }
  int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return ibv_post_recv(qp, wr, bad);
  }
  int PostSrqRecv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return ibv_post_srq_recv(srq, wr, bad);
  }
  int PollCq(ibv_cq* cq, int entries, ibv_wc* wc) override { return ibv_poll_cq(cq, entries, wc); }
};

}  // namespace

std::unique_ptr<VerbsApi> NewRealVerbsApi() { return std::make_unique<RealVerbsApi>(); }

}  // namespace ferry::fabric::verbs
