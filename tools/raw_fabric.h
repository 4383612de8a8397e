// RawFabric: the baseline for ferry-bench. A bare libfabric RDM endpoint driven inline by the
// calling thread, with no queue, no worker and no bookkeeping: what a hand-written loop over
// fi_write / fi_cq_read costs. ferry's numbers are reported as ratios against it.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::bench {

class RawFabric {
 public:
  RawFabric() = default;
  RawFabric(const RawFabric&) = delete;
  RawFabric& operator=(const RawFabric&) = delete;
  ~RawFabric() {
    if (mr_) fi_close(&mr_->fid);
    if (ep_) fi_close(&ep_->fid);
    if (cq_) fi_close(&cq_->fid);
    if (av_) fi_close(&av_->fid);
    if (domain_) fi_close(&domain_->fid);
    if (fabric_) fi_close(&fabric_->fid);
    if (all_) fi_freeinfo(all_);
  }

  Status Open(const std::string& provider, const std::string& node, void* buf, size_t len) {
    fi_info* hints = fi_allocinfo();
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    int ret = fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION),
                         node.empty() ? nullptr : node.c_str(), nullptr,
                         node.empty() ? 0 : FI_SOURCE, hints, &all_);
    fi_freeinfo(hints);
    if (ret) return Err("fi_getinfo", ret);
    for (info_ = all_; info_ && provider != info_->fabric_attr->prov_name;) info_ = info_->next;
    if (!info_) return NotFoundError("raw: provider not found");
    const uint64_t mr_mode = info_->domain_attr->mr_mode;
    virt_addr_ = mr_mode & FI_MR_VIRT_ADDR;
    if ((ret = fi_fabric(info_->fabric_attr, &fabric_, nullptr))) return Err("fi_fabric", ret);
    if ((ret = fi_domain(fabric_, info_, &domain_, nullptr))) return Err("fi_domain", ret);
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    if ((ret = fi_av_open(domain_, &av_attr, &av_, nullptr))) return Err("fi_av_open", ret);
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = info_->tx_attr->size + info_->rx_attr->size;
    if ((ret = fi_cq_open(domain_, &cq_attr, &cq_, nullptr))) return Err("fi_cq_open", ret);
    if ((ret = fi_endpoint(domain_, info_, &ep_, nullptr))) return Err("fi_endpoint", ret);
    fi_ep_bind(ep_, &av_->fid, 0);
    fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
    if ((ret = fi_enable(ep_))) return Err("fi_enable", ret);
    ret = fi_mr_reg(domain_, buf, len, FI_WRITE | FI_REMOTE_WRITE, 0, 1, 0, &mr_, nullptr);
    if (ret) return Err("fi_mr_reg", ret);
    if (mr_mode & FI_MR_ENDPOINT) {
      fi_mr_bind(mr_, &ep_->fid, 0);
      fi_mr_enable(mr_);
    }
    buf_ = static_cast<uint8_t*>(buf);
    desc_ = fi_mr_desc(mr_);
    contexts_.resize(info_->tx_attr->size + 1);
    return Status::Ok();
  }

  // Address, region base and key, as bytes for the bootstrap.
  std::vector<uint8_t> Describe() const {
    uint8_t name[256];
    size_t len = sizeof name;
    fi_getname(&ep_->fid, name, &len);
    std::vector<uint8_t> out(name, name + len);
    uint64_t base = virt_addr_ ? reinterpret_cast<uint64_t>(buf_) : 0, key = fi_mr_key(mr_);
    out.insert(out.end(), reinterpret_cast<uint8_t*>(&base), reinterpret_cast<uint8_t*>(&base) + 8);
    out.insert(out.end(), reinterpret_cast<uint8_t*>(&key), reinterpret_cast<uint8_t*>(&key) + 8);
    return out;
  }

  // Adds a peer (its Describe()); Post names peers by the order they were connected.
  Status Connect(const std::vector<uint8_t>& peer) {
    if (peer.size() <= 16) return InvalidArgumentError("raw: malformed peer description");
    const size_t name_len = peer.size() - 16;
    Peer p;
    std::memcpy(&p.base, peer.data() + name_len, 8);
    std::memcpy(&p.key, peer.data() + name_len + 8, 8);
    int ret = fi_av_insert(av_, peer.data(), 1, &p.addr, 0, nullptr);
    if (ret != 1) return Err("fi_av_insert", ret);
    peers_.push_back(p);
    return Status::Ok();
  }

  size_t tx_depth() const { return info_->tx_attr->size; }

  // Posts a write of [src_off, +len) to peer `peer` at dst_off; false when the provider is full.
  // Writes larger than the provider's message size are the caller's to split.
  bool Post(size_t peer, uint64_t src_off, uint64_t dst_off, uint64_t len, bool imm,
            uint32_t data) {
    const Peer& p = peers_[peer];
    fi_context2* ctx = &contexts_[next_ctx_++ % contexts_.size()];
    ssize_t ret = imm ? fi_writedata(ep_, buf_ + src_off, len, desc_, data, p.addr,
                                     p.base + dst_off, p.key, ctx)
                      : fi_write(ep_, buf_ + src_off, len, desc_, p.addr, p.base + dst_off,
                                 p.key, ctx);
    return ret == 0;
  }
  bool Post(uint64_t src_off, uint64_t dst_off, uint64_t len, bool imm, uint32_t data) {
    return Post(0, src_off, dst_off, len, imm, data);
  }

  // Reads completions; returns local completions and counts remote immediates in *imms
  // (recording the last value).
  int Poll(uint64_t* imms, uint32_t* last_imm) {
    fi_cq_data_entry e[32];
    ssize_t n = fi_cq_read(cq_, e, 32);
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq_, &err, 0);
      return -1;
    }
    int local = 0;
    for (ssize_t i = 0; i < n; ++i) {
      if (e[i].flags & FI_REMOTE_CQ_DATA) {
        ++*imms;
        *last_imm = static_cast<uint32_t>(e[i].data);
      } else {
        ++local;
      }
    }
    return local;
  }

 private:
  static Status Err(const char* call, int ret) {
    return InternalError(std::string(call) + ": " + fi_strerror(-ret));
  }
  fi_info* all_ = nullptr;
  fi_info* info_ = nullptr;  // the entry of all_ we use
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_ep* ep_ = nullptr;
  fid_mr* mr_ = nullptr;
  uint8_t* buf_ = nullptr;
  void* desc_ = nullptr;
  bool virt_addr_ = false;
  struct Peer {
    fi_addr_t addr = 0;
    uint64_t base = 0, key = 0;
  };
  std::vector<Peer> peers_;
  std::vector<fi_context2> contexts_;
  uint64_t next_ctx_ = 0;
};

}  // namespace ferry::bench
