// VerbsApi: the one thin wrapper every libibverbs call of ferry goes through.
//
// Nothing here decides anything: each method is one ibverbs call with its return convention kept
// (pointers null on failure with errno set, ints 0 or an errno). The logic around the calls
// (handshake encoding, QP state sequencing, work-request chains, error mapping: verbs_logic.h)
// is tested against a fake of this interface, because no machine here has an RDMA device.
#pragma once

#include <infiniband/verbs.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ferry::fabric::verbs {

class VerbsApi {
 public:
  virtual ~VerbsApi() = default;

  virtual std::vector<std::string> DeviceNames() = 0;
  virtual ibv_context* OpenDevice(const std::string& name) = 0;
  virtual int CloseDevice(ibv_context* context) = 0;
  virtual int QueryDevice(ibv_context* context, ibv_device_attr* attr) = 0;
  virtual int QueryPort(ibv_context* context, uint8_t port, ibv_port_attr* attr) = 0;
  virtual int QueryGid(ibv_context* context, uint8_t port, int index, ibv_gid* gid) = 0;

  virtual ibv_pd* AllocPd(ibv_context* context) = 0;
  virtual int DeallocPd(ibv_pd* pd) = 0;
  virtual ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) = 0;
  virtual ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                              int access) = 0;
  virtual int DeregMr(ibv_mr* mr) = 0;

  virtual ibv_cq* CreateCq(ibv_context* context, int entries) = 0;
  virtual int DestroyCq(ibv_cq* cq) = 0;
  virtual ibv_srq* CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr) = 0;
  virtual int DestroySrq(ibv_srq* srq) = 0;
  virtual ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) = 0;
  virtual int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) = 0;
  virtual int DestroyQp(ibv_qp* qp) = 0;
  virtual ibv_ah* CreateAh(ibv_pd* pd, ibv_ah_attr* attr) = 0;
  virtual int DestroyAh(ibv_ah* ah) = 0;

  virtual int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) = 0;
  virtual int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) = 0;
  virtual int PostSrqRecv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) = 0;
  virtual int PollCq(ibv_cq* cq, int entries, ibv_wc* wc) = 0;
};

// The libibverbs implementation.
std::unique_ptr<VerbsApi> NewRealVerbsApi();

// An ibv_* object owned: destroyed through the api that made it (the real one or a test's
// fake) when its owner goes or takes another. The api must outlive it. It reads as the raw
// handle (the api's calls take those) but is moved, never copied.
template <typename T, int (VerbsApi::*Destroy)(T*)>
class VerbsOwned {
 public:
  VerbsOwned() = default;
  VerbsOwned(VerbsApi* api, T* handle) : api_(api), handle_(handle) {}
  VerbsOwned(VerbsOwned&& o) noexcept : api_(o.api_), handle_(o.Release()) {}
  VerbsOwned& operator=(VerbsOwned&& o) noexcept {
    if (this != &o) Reset(o.api_, o.Release());
    return *this;
  }
  VerbsOwned(const VerbsOwned&) = delete;
  VerbsOwned& operator=(const VerbsOwned&) = delete;
  ~VerbsOwned() { Reset(); }

  // Destroys what is owned now and owns `handle` (null: nothing).
  void Reset(VerbsApi* api = nullptr, T* handle = nullptr) {
    if (handle_) (api_->*Destroy)(handle_);
    api_ = api;
    handle_ = handle;
  }
  T* Release() { return std::exchange(handle_, nullptr); }
  T* get() const { return handle_; }
  operator T*() const { return handle_; }  // NOLINT(google-explicit-constructor)
  T* operator->() const { return handle_; }

 private:
  VerbsApi* api_ = nullptr;
  T* handle_ = nullptr;
};
using OwnedContext = VerbsOwned<ibv_context, &VerbsApi::CloseDevice>;
using OwnedPd = VerbsOwned<ibv_pd, &VerbsApi::DeallocPd>;
using OwnedMr = VerbsOwned<ibv_mr, &VerbsApi::DeregMr>;
using OwnedCq = VerbsOwned<ibv_cq, &VerbsApi::DestroyCq>;
using OwnedSrq = VerbsOwned<ibv_srq, &VerbsApi::DestroySrq>;
using OwnedQp = VerbsOwned<ibv_qp, &VerbsApi::DestroyQp>;
using OwnedAh = VerbsOwned<ibv_ah, &VerbsApi::DestroyAh>;

}  // namespace ferry::fabric::verbs
