// The libfabric backend of Domain: one fabric/domain/endpoint, a CQ and an AV.
//
// What differs between providers is settled here, once, when the endpoint opens:
// - mr_mode: FI_MR_VIRT_ADDR (remote address = virtual address) or offsets from the region start
//   (`tcp;ofi_rxm` in 1.17); FI_MR_PROV_KEY (provider picks keys) or ours; FI_MR_LOCAL (pass
//   descriptors for local buffers: we always do); FI_MR_ENDPOINT (bind MRs to the endpoint).
// - FI_CONTEXT / FI_CONTEXT2: every posted op carries its own OpContext, whose scratch space is
//   large enough for fi_context2, so either mode holds.
// - FI_RX_CQ_DATA: remote CQ data may consume a posted receive; a receive completion flagged as a
//   remote write is then an immediate, and its buffer is re-posted by the engine like any other.
// - cq_data_size: immediates are 32 bits everywhere (EFA carries 4 bytes).
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>

#include "fabric/domain.h"
#include "fabric/libfabric/fi_error.h"

namespace ferry::fabric {

Status FiError(std::string_view call, long ret) {
  int err = static_cast<int>(ret < 0 ? -ret : ret);
  std::string message(call);
  message += ": ";
  message += fi_strerror(err);
  message += " (" + std::to_string(-err) + ")";
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case FI_ENOSYS:
    case FI_EOPNOTSUPP: code = StatusCode::kUnimplemented; break;
    case FI_ENODATA: code = StatusCode::kNotFound; break;
    case FI_EINVAL: code = StatusCode::kInvalidArgument; break;
    case FI_EAGAIN:
    case FI_ENOMEM: code = StatusCode::kResourceExhausted; break;
    case FI_ETIMEDOUT: code = StatusCode::kDeadlineExceeded; break;
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_EHOSTUNREACH:
    case FI_ENOTCONN:
    case FI_EIO: code = StatusCode::kUnavailable; break;
    case FI_ECANCELED: code = StatusCode::kCancelled; break;
    default: break;
  }
  return Status(code, message);
}

namespace {

static_assert(sizeof(OpContext::provider_scratch) >= sizeof(fi_context2),
              "OpContext must hold a fi_context2 for FI_CONTEXT2 providers");

struct FidCloser {
  void operator()(fid* f) const {
    if (f) fi_close(f);
  }
};
template <typename T>
class Fid {
 public:
  Fid() = default;
  explicit Fid(T* p) : p_(p) {}
  Fid(Fid&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Fid& operator=(Fid&& o) noexcept {
    Reset();
    p_ = std::exchange(o.p_, nullptr);
    return *this;
  }
  ~Fid() { Reset(); }
  T* get() const { return p_; }
  T** out() { return &p_; }
  void Reset() {
    if (p_) fi_close(&p_->fid);
    p_ = nullptr;
  }

 private:
  T* p_ = nullptr;
};

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

constexpr uint64_t kMrModesWeHandle = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                      FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

// Every fi_info the provider offers for the endpoints ferry opens (RDM, manual progress, the
// mr_modes and context modes we handle), optionally on one domain and bound to `node`.
StatusOr<InfoPtr> QueryInfo(const std::string& provider, const std::string& domain,
                            const std::string& node, uint64_t optional_caps,
                            uint16_t port = 0) {
  InfoPtr hints(fi_allocinfo());
  if (!hints) return ResourceExhaustedError("fi_allocinfo failed");
  hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV | optional_caps;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = kMrModesWeHandle;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
  hints->addr_format = FI_FORMAT_UNSPEC;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());
  if (!domain.empty()) hints->domain_attr->name = strdup(domain.c_str());
  fi_info* info = nullptr;
  const char* node_arg = node.empty() ? nullptr : node.c_str();
  const std::string service = port ? std::to_string(port) : std::string();
  const char* service_arg = port ? service.c_str() : nullptr;
  // A node or a port given is where we listen (the source), not a peer to reach.
  uint64_t flags = node.empty() && !port ? 0 : FI_SOURCE;
  int ret = fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), node_arg, service_arg,
                       flags, hints.get(), &info);
  if (ret != 0) return FiError("fi_getinfo(provider=" + provider + ")", ret);
  return InfoPtr(info);
}

// The one fi_info to open: exactly `provider` (and `domain`, if named).
StatusOr<InfoPtr> GetInfo(const std::string& provider, const std::string& domain,
                          const std::string& node, uint64_t optional_caps, uint16_t port = 0) {
  ASSIGN_OR_RETURN(InfoPtr all, QueryInfo(provider, domain, node, optional_caps, port));
  fi_info* info = all.get();
  // A provider name match in fi_getinfo is by prefix of the layered name; take an exact match.
  for (fi_info* cur = info; cur; cur = cur->next) {
    // Some providers (shm) ignore a domain name they do not have; we do not.
    if (!domain.empty() && (!cur->domain_attr->name || domain != cur->domain_attr->name)) continue;
    if (provider.empty() || provider == cur->fabric_attr->prov_name) {
      InfoPtr picked(fi_dupinfo(cur));
      if (!picked) return ResourceExhaustedError("fi_dupinfo failed");
      return picked;
    }
  }
  return NotFoundError("no libfabric provider named '" + provider + "'" +
                       (domain.empty() ? "" : " with domain '" + domain + "'"));
}

// shm names its shared-memory file after the source address, "fi_shm://<pid>" by default, and
// refuses (EBUSY) to reuse a file whose recorded owner is alive. A process killed before closing
// its endpoint leaves its file behind; once the PID is reused, the new process's first endpoint
// collides with that file and is refused. So ferry names shm endpoints itself,
// "ferry-<pid>-<random>", and removes files of earlier ferry endpoints whose process is gone.
constexpr std::string_view kShmNamePrefix = "ferry-";

void RemoveStaleShmFiles() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* entry = readdir(dir)) {
    std::string_view name(entry->d_name);
    if (!name.starts_with(kShmNamePrefix)) continue;
    name.remove_prefix(kShmNamePrefix.size());
    long pid = 0;
    size_t digits = 0;
    while (digits < name.size() && digits < 10 && name[digits] >= '0' && name[digits] <= '9') {
      pid = pid * 10 + (name[digits] - '0');
      ++digits;
    }
    if (digits == 0 || pid <= 0) continue;
    // Alive, or not ours to judge (EPERM): keep it.
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    shm_unlink(entry->d_name);  // best effort: another process may be removing it too
  }
  closedir(dir);
}

std::string UniqueShmNode() {
  RemoveStaleShmFiles();
  std::random_device entropy;
  uint64_t nonce = (uint64_t{entropy()} << 32) | entropy();
  char buf[64];
  snprintf(buf, sizeof buf, "%.*s%d-%016llx", static_cast<int>(kShmNamePrefix.size()),
           kShmNamePrefix.data(), static_cast<int>(getpid()),
           static_cast<unsigned long long>(nonce));
  return buf;
}

class LibfabricDomain final : public Domain {
 public:
  static StatusOr<std::unique_ptr<Domain>> Open(const EngineOptions& options,
                                                const std::string& domain) {
    std::vector<std::string> candidates;
    if (options.provider.empty()) {
      candidates = {"efa", "shm"};
    } else {
      candidates = {options.provider};
    }
    Status last;
    for (const std::string& provider : candidates) {
      auto d = std::unique_ptr<LibfabricDomain>(new LibfabricDomain());
      Status s = d->Init(provider, domain, options);
      if (s.ok()) return std::unique_ptr<Domain>(std::move(d));
      last = s;
    }
    return last;
  }

  ~LibfabricDomain() override {
    // Members close in reverse order of creation: endpoint, CQ, AV, domain, fabric. MRs the
    // engine did not deregister are closed here, before their domain.
    ep_.Reset();
    for (fid_mr* mr : live_mrs_) fi_close(&mr->fid);
  }

  const DomainCaps& caps() const override { return caps_; }
  const FabricInfo& info() const override { return info_; }

  std::vector<uint8_t> Name() const override { return name_; }

  StatusOr<uint64_t> InsertPeer(std::span<const uint8_t> name) override {
    // Names need not be as long as ours: shm's are strings that grow with the PID's digits.
    if (name.empty()) return InvalidArgumentError("peer address is empty");
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    int ret = fi_av_insert(av_.get(), name.data(), 1, &addr, 0, nullptr);
    if (ret != 1) return FiError("fi_av_insert", ret < 0 ? ret : -FI_EINVAL);
    return static_cast<uint64_t>(addr);
  }

  Status RemovePeer(uint64_t peer_addr) override {
    fi_addr_t addr = peer_addr;
    int ret = fi_av_remove(av_.get(), &addr, 1, 0);
    if (ret != 0) return FiError("fi_av_remove", ret);
    return Status::Ok();
  }

  StatusOr<Registration> Register(void* data, uint64_t length, MemoryKind kind,
                                  int device) override {
    if (kind == MemoryKind::kCuda && !cuda_memory_) {
      return FailedPreconditionError("CUDA memory needs an engine created with cuda_memory = true");
    }
    if (kind == MemoryKind::kCuda && !info_.hmem) {
      return UnimplementedError("provider '" + info_.provider +
                                "' does not support CUDA memory (no FI_HMEM)");
    }
    iovec iov{data, length};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV | FI_READ | FI_REMOTE_READ;
    attr.requested_key = next_key_++;
    attr.iface = kind == MemoryKind::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (kind == MemoryKind::kCuda) attr.device.cuda = device;
    fid_mr* mr = nullptr;
    int ret = fi_mr_regattr(domain_.get(), &attr, 0, &mr);
    if (ret != 0) {
      Status s = FiError("fi_mr_regattr", ret);
      if (kind == MemoryKind::kCuda && s.code() == StatusCode::kUnimplemented) {
        return UnimplementedError("provider '" + info_.provider +
                                  "' cannot register CUDA memory (FI_HMEM_CUDA): " +
                                  std::string(s.message()));
      }
      return s;
    }
    if (info_.mr_endpoint) {
      ret = fi_mr_bind(mr, &ep_.get()->fid, 0);
      if (ret == 0) ret = fi_mr_enable(mr);
      if (ret != 0) {
        fi_close(&mr->fid);
        return FiError("fi_mr_bind/fi_mr_enable", ret);
      }
    }
    live_mrs_.push_back(mr);
    Registration r;
    r.handle = mr;
    r.local_desc = fi_mr_desc(mr);
    r.key = fi_mr_key(mr);
    r.base = info_.virt_addr ? reinterpret_cast<uint64_t>(data) : 0;
    return r;
  }

  void Deregister(void* handle) override {
    auto* mr = static_cast<fid_mr*>(handle);
    for (size_t i = 0; i < live_mrs_.size(); ++i) {
      if (live_mrs_[i] == mr) {
        live_mrs_[i] = live_mrs_.back();
        live_mrs_.pop_back();
        fi_close(&mr->fid);
        return;
      }
    }
  }

  PostResult PostWrite(const WriteWr& wr, Status* error) override {
    ssize_t ret;
    if (wr.deliver) {
      iovec iov{const_cast<void*>(wr.local), wr.length};
      void* desc = wr.local_desc;
      fi_rma_iov rma{wr.remote_addr, wr.length, wr.key};
      fi_msg_rma msg{};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.addr = wr.peer_addr;
      msg.rma_iov = &rma;
      msg.rma_iov_count = 1;
      msg.context = wr.context;
      msg.data = wr.imm;
      const uint64_t flags =
          FI_COMPLETION | FI_DELIVERY_COMPLETE | (wr.has_imm ? FI_REMOTE_CQ_DATA : 0);
      ret = fi_writemsg(ep_.get(), &msg, flags);
    } else if (wr.has_imm) {
      ret = fi_writedata(ep_.get(), wr.local, wr.length, wr.local_desc, wr.imm, wr.peer_addr,
                         wr.remote_addr, wr.key, wr.context);
    } else {
      ret = fi_write(ep_.get(), wr.local, wr.length, wr.local_desc, wr.peer_addr, wr.remote_addr,
                     wr.key, wr.context);
    }
    return Result(ret, "fi_write", error);
  }

  PostResult PostSend(const void* data, uint64_t length, void* local_desc, uint64_t peer_addr,
                      OpContext* context, Status* error) override {
    ssize_t ret = fi_send(ep_.get(), data, length, local_desc, peer_addr, context);
    return Result(ret, "fi_send", error);
  }

  PostResult PostRecv(void* data, uint64_t length, void* local_desc, OpContext* context,
                      Status* error) override {
    ssize_t ret = fi_recv(ep_.get(), data, length, local_desc, FI_ADDR_UNSPEC, context);
    return Result(ret, "fi_recv", error);
  }

  size_t Poll(std::span<DomainCompletion> out) override {
    constexpr size_t kBatch = 32;
    fi_cq_data_entry entries[kBatch];
    fi_addr_t sources[kBatch];
    size_t want = std::min(out.size(), kBatch);
    ssize_t n = fi_cq_readfrom(cq_.get(), entries, want, sources);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) Translate(entries[i], sources[i], out[i]);
      return static_cast<size_t>(n);
    }
    if (n == -FI_EAVAIL && !out.empty()) return ReadError(out[0]);
    return 0;
  }

 private:
  LibfabricDomain() = default;

  static PostResult Result(ssize_t ret, const char* call, Status* error) {
    if (ret == 0) return PostResult::kPosted;
    if (ret == -FI_EAGAIN) return PostResult::kAgain;
    *error = FiError(call, ret);
    return PostResult::kError;
  }

  void Translate(const fi_cq_data_entry& e, fi_addr_t source, DomainCompletion& c) {
    c.error = Status::Ok();
    c.src_addr = source == FI_ADDR_NOTAVAIL ? kNoPeerAddr : source;
    c.has_imm = (e.flags & FI_REMOTE_CQ_DATA) != 0;
    c.imm = static_cast<uint32_t>(e.data);
    c.length = e.len;
    c.context = static_cast<OpContext*>(e.op_context);
    if (e.flags & FI_REMOTE_WRITE) {
      // An immediate from a peer's write. Under FI_RX_CQ_DATA it consumed one of our receive
      // buffers: report that too so the engine re-posts it.
      c.kind = CompletionKind::kRemoteImm;
    } else if (e.flags & FI_RECV) {
      c.kind = CompletionKind::kRecv;
    } else {
      c.kind = CompletionKind::kLocal;
    }
  }

  size_t ReadError(DomainCompletion& c) {
    fi_cq_err_entry err{};
    ssize_t ret = fi_cq_readerr(cq_.get(), &err, 0);
    if (ret != 1) return 0;
    char buf[256];
    const char* detail = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, buf, sizeof buf);
    std::string message = "completion error: ";
    message += fi_strerror(err.err);
    if (detail && *detail) {
      message += " (provider: ";
      message += detail;
      message += ")";
    }
    c = DomainCompletion{};
    c.context = static_cast<OpContext*>(err.op_context);
    c.kind = (err.flags & FI_RECV) ? CompletionKind::kRecv : CompletionKind::kLocal;
    c.error = FiError("", err.err);
    c.error = Status(c.error.code(), message);
    return 1;
  }

  Status Init(const std::string& provider, const std::string& domain,
              const EngineOptions& options) {
    // Ask for the optional capabilities first (the sender's address on receives; CUDA memory
    // only when asked: shm with FI_HMEM gives up its single-copy path for large host writes and
    // runs at half the bandwidth), then settle for less: a provider without them still runs,
    // reporting what it lacks.
    InfoPtr info;
    Status status;
    const uint64_t hmem = options.cuda_memory ? uint64_t{FI_HMEM} : 0;
    const std::string node =
        provider == "shm" && options.node.empty() ? UniqueShmNode() : options.node;
    for (uint64_t caps : {uint64_t{hmem | FI_SOURCE}, hmem, uint64_t{FI_SOURCE}, uint64_t{0}}) {
      auto got = GetInfo(provider, domain, node, caps, options.port);
      if (got.ok()) {
        info = std::move(got).value();
        break;
      }
      status = got.status();
    }
    if (!info) return status;
    const fi_domain_attr& d = *info->domain_attr;
    if (d.mr_mode & ~kMrModesWeHandle & ~uint64_t{FI_MR_BASIC | FI_MR_SCALABLE}) {
      return UnimplementedError("provider '" + provider + "' needs mr_mode bits ferry lacks");
    }
    if (d.cq_data_size < 4) {
      return UnimplementedError("provider '" + provider + "' carries " +
                                std::to_string(d.cq_data_size) +
                                " bytes of CQ data; ferry needs 4 for immediates");
    }
    cuda_memory_ = options.cuda_memory;
    info_.provider = info->fabric_attr->prov_name;
    info_.domain = d.name ? d.name : "";
    info_.virt_addr = (d.mr_mode & FI_MR_VIRT_ADDR) || d.mr_mode == FI_MR_BASIC;
    info_.prov_key = (d.mr_mode & FI_MR_PROV_KEY) || d.mr_mode == FI_MR_BASIC;
    info_.mr_local = d.mr_mode & FI_MR_LOCAL;
    info_.mr_endpoint = d.mr_mode & FI_MR_ENDPOINT;
    info_.hmem = info->caps & FI_HMEM;
    info_.context_mode = info->mode & (FI_CONTEXT | FI_CONTEXT2);
    info_.cq_data_size = d.cq_data_size;
    info_.max_msg_size = info->ep_attr->max_msg_size;
    info_.inject_size = info->tx_attr->inject_size;
    info_.tx_size = info->tx_attr->size;
    if (info->tx_attr->msg_order & FI_ORDER_RMA_WAW) {
      info_.ordered_write_bytes = info->ep_attr->max_order_waw_size;
    }
    info_.rx_size = info->rx_attr->size;
    caps_.provider = info_.provider;
    caps_.name = info_.domain;
    caps_.max_msg_bytes = info_.max_msg_size;
    caps_.send_depth = info_.tx_size;
    caps_.recv_depth = info_.rx_size;
    caps_.ordered_write_bytes = info_.ordered_write_bytes;

    int ret = fi_fabric(info->fabric_attr, fabric_.out(), nullptr);
    if (ret) return FiError("fi_fabric", ret);
    ret = fi_domain(fabric_.get(), info.get(), domain_.out(), nullptr);
    if (ret) return FiError("fi_domain", ret);

    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = options.max_peers;
    ret = fi_av_open(domain_.get(), &av_attr, av_.out(), nullptr);
    if (ret == -FI_ENOSYS || ret == -FI_EINVAL) {
      // Some providers cap the AV size (shm: 256 peers) and refuse larger hints; take theirs.
      av_attr.count = 0;
      ret = fi_av_open(domain_.get(), &av_attr, av_.out(), nullptr);
    }
    if (ret) return FiError("fi_av_open", ret);

    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = info_.tx_size + info_.rx_size;
    ret = fi_cq_open(domain_.get(), &cq_attr, cq_.out(), nullptr);
    if (ret) return FiError("fi_cq_open", ret);

    ret = fi_endpoint(domain_.get(), info.get(), ep_.out(), nullptr);
    if (ret) return FiError("fi_endpoint", ret);
    ret = fi_ep_bind(ep_.get(), &av_.get()->fid, 0);
    if (ret) return FiError("fi_ep_bind(av)", ret);
    ret = fi_ep_bind(ep_.get(), &cq_.get()->fid, FI_TRANSMIT | FI_RECV);
    if (ret) return FiError("fi_ep_bind(cq)", ret);
    ret = fi_enable(ep_.get());
    if (ret) return FiError("fi_enable", ret);

    size_t len = 0;
    ret = fi_getname(&ep_.get()->fid, nullptr, &len);
    if (ret != -FI_ETOOSMALL && ret != 0) return FiError("fi_getname", ret);
    name_.resize(len);
    ret = fi_getname(&ep_.get()->fid, name_.data(), &len);
    if (ret) return FiError("fi_getname", ret);
    name_.resize(len);
    return Status::Ok();
  }

  // Creation order; destroyed in reverse.
  Fid<fid_fabric> fabric_;
  Fid<fid_domain> domain_;
  Fid<fid_av> av_;
  Fid<fid_cq> cq_;
  Fid<fid_ep> ep_;
  DomainCaps caps_;
  FabricInfo info_;
  std::vector<uint8_t> name_;
  std::vector<fid_mr*> live_mrs_;
  bool cuda_memory_ = false;
  // Keys we request when the provider does not pick them (no FI_MR_PROV_KEY). Unique per domain.
  uint64_t next_key_ = 1;
};

}  // namespace

StatusOr<std::unique_ptr<Domain>> OpenLibfabricDomain(const EngineOptions& options,
                                                      const std::string& domain) {
  return LibfabricDomain::Open(options, domain);
}

std::vector<std::string> ListLibfabricDomains(const std::string& provider) {
  std::vector<std::string> names;
  auto all = QueryInfo(provider, "", "", 0);
  if (!all.ok()) return names;
  for (fi_info* cur = all->get(); cur; cur = cur->next) {
    if (provider != cur->fabric_attr->prov_name || !cur->domain_attr->name) continue;
    std::string name = cur->domain_attr->name;
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

}  // namespace ferry::fabric
