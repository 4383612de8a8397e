// The TransferEngine: submission from any thread, one worker thread that owns the Domain.
//
// Life of a transfer:
//   caller thread: Submit validates everything (peer, descriptors, bounds, page indices), takes an
//     admission ticket (max_transfers), resolves addresses, pushes a Request on the lock-free
//     queue and wakes the worker if it sleeps. Nothing is allocated, nothing locked.
//   worker thread: pops the Request into a Transfer slot, expands it into work requests (one per
//     chunk, page, slice or member) as provider queue space and WR contexts allow, polls the CQ,
//     and finishes the transfer when its last WR completes: exactly one Completion::Finish.
// A transfer that outlives transfer_timeout_ms fails with DeadlineExceeded and marks its peer
// lost; its WRs still owned by the provider keep the slot until they complete or the engine closes.
//
// Control operations (registration, peers, groups, handlers) are rare and run on the worker too,
// because the provider is opened with FI_THREAD_DOMAIN: only the worker touches the Domain.
//
// Domain groups: the engine drives N NICs (1 to kMaxNics), each a Domain with its own queues.
// Regions are registered on every NIC; a region descriptor and the engine's address carry one
// entry per NIC. Local NIC k sends to the peer's NIC k mod M (M: the peer's NIC count). Which NIC
// posts a work request: single writes of at least N x nic_shard_min_bytes are cut into N shards,
// shard s on NIC (first + s) mod N, where `first` turns per transfer; paged writes stripe page i
// to NIC (first + i) mod N; scatter and barrier give group member i to NIC i mod N; immediates
// and messages go whole to NIC `first`. A transfer completes when all its WRs have, on whichever
// NICs; the first error fails it, once.
//
// Beside this file: fabric_types.cc (completions, regions, options from the environment) and
// domain_group.cc (opening the NICs an engine drives).
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/backoff.h"
#include "common/bounded_queue.h"
#include "fabric/domain.h"
#include "fabric/engine_internal.h"
#include "fabric/imm_counters.h"
#include "fabric/wire.h"
#include "ferry/fabric.h"

namespace ferry {

namespace fabric {
namespace {

std::string PeerName(PeerId peer) { return "peer " + std::to_string(peer); }

// OutOfRange unless [offset, offset + length) lies inside a region of region_length bytes.
Status CheckRange(const char* side, uint64_t offset, uint64_t length, uint64_t region_length) {
  if (offset > region_length || length > region_length - offset) {
    return OutOfRangeError(std::string(side) + " offset " + std::to_string(offset) +
                           " + length " + std::to_string(length) + " exceeds region length " +
                           std::to_string(region_length));
  }
  return Status::Ok();
}

// Byte offset of page `index`: base + index * stride, with overflow reported as OutOfRange.
Status PageOffset(const char* side, uint64_t base, uint32_t index, uint64_t stride,
                  uint64_t* out) {
  unsigned __int128 v = static_cast<unsigned __int128>(index) * stride + base;
  if (v > ~uint64_t{0}) {
    return OutOfRangeError(std::string(side) + " page " + std::to_string(index) + " overflows");
  }
  *out = static_cast<uint64_t>(v);
  return Status::Ok();
}

enum class Kind : uint8_t { kSingle, kPaged, kScatter, kBarrier, kImm, kSend, kNotify, kDisarm };

using Descs = std::array<void*, kMaxNics>;

// Indexed by local NIC k: what k sends to (the peer's NIC k mod remote_nics).
struct PeerEntry {
  std::array<uint64_t, kMaxNics> addr{};  // provider address (fi_addr_t) in domain k
  std::array<NicKey, kMaxNics> sink{};    // the peer's immediate sink, as seen from NIC k
  uint32_t remote_nics = 1;
  uint64_t engine_id = 0;
  std::vector<std::pair<uint32_t, uint64_t>> inserted;  // (local NIC, address): all AV entries
  std::atomic<bool> lost{false};
};

struct ScatterMember {
  PeerId peer;
  uint32_t nic;  // the local NIC that serves this member
  uint64_t addr;
  uint64_t base;
  uint64_t key;
  uint64_t length;
};

struct ScatterPlan {
  const uint8_t* src = nullptr;
  uint64_t src_length = 0;
  Descs src_desc{};
  std::vector<ScatterMember> members;
};

struct PeerGroup {
  std::vector<PeerId> members;
};

// A submitted transfer, as it travels through the submission queue. Everything the worker needs
// is resolved on the caller's thread.
struct Request {
  Kind kind = Kind::kSingle;
  bool has_imm = false;
  bool imm_once = false;        // paged: the immediate on each NIC's last page (PostPending)
  uint32_t imm_weight_mask = 0;  // imm_once: those immediates carry their NIC's pages here
  uint32_t imm = 0;
  PeerId peer = 0;                   // single-peer kinds
  const PeerEntry* entry = nullptr;  // single-peer kinds
  uint32_t first_nic = 0;            // see the file comment
  const uint8_t* src = nullptr;  // local bytes of offset 0 (after src_offset)
  Descs src_desc{};
  // Per local NIC: provider address of the destination's offset 0 (after dst_offset), and key.
  std::array<NicKey, kMaxNics> dst{};
  uint64_t length = 0;  // single: bytes; paged: page bytes; send: bytes
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
  const uint32_t* src_pages = nullptr;
  const uint32_t* dst_pages = nullptr;
  uint32_t count = 0;  // pages, targets or members
  const ScatterPlan* plan = nullptr;
  const ScatterTarget* targets = nullptr;
  const PeerGroup* group = nullptr;
  const PeerEntry* peers = nullptr;  // the peer table, for barrier members
  uint32_t send_buffer = 0;
  // kNotify
  ImmCounterTable::Slot* slot = nullptr;
  uint64_t target = 0;
  Clock::time_point deadline;
  Completion done;
};

struct Transfer;

// One posted work request. Its OpContext comes first so the provider's context pointer is ours.
struct WrSlot {
  OpContext ctx;
  Transfer* transfer = nullptr;
};
static_assert(offsetof(WrSlot, ctx) == 0, "the provider context must be WrSlot's first member");

struct Transfer {
  Request req;
  uint32_t total = 0;        // WRs this transfer posts
  uint32_t next = 0;         // next WR to post
  uint32_t outstanding = 0;  // posted, not completed
  uint64_t chunk = 0;        // single: bytes per WR
  uint32_t shards = 1;       // single: one per NIC when large enough
  uint64_t shard_bytes = 0;  // single: bytes of every shard but the last
  uint32_t shard_wrs = 0;    // single: WRs of every shard but the last
  bool finished = false;     // Completion already ran (a timed-out transfer may still own WRs)
  bool queued = false;       // on the pending-post list
  bool tail_deferred = false;  // single: the immediate-carrying last chunk waits for the others
  Clock::time_point deadline;
  Status error;
  // Intrusive lists owned by the worker.
  Transfer* active_prev = nullptr;
  Transfer* active_next = nullptr;
};

struct RecvSlot {
  OpContext ctx;
  uint32_t index = 0;
  uint32_t nic = 0;
};

// One buffer registered on every NIC of the engine.
struct MultiRegistration {
  std::array<Registration, kMaxNics> per_nic{};
  uint32_t nics = 0;
  Descs descs() const {
    Descs d{};
    for (uint32_t k = 0; k < nics; ++k) d[k] = per_nic[k].local_desc;
    return d;
  }
};

class Futex {
 public:
  static void Wait(std::atomic<uint32_t>* word, uint32_t expected, uint32_t timeout_us) {
    timespec ts{static_cast<time_t>(timeout_us / 1000000),
                static_cast<long>(timeout_us % 1000000) * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts,
            nullptr, 0);
  }
  static void WakeOne(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, 1, nullptr,
            nullptr, 0);
  }
};

class Engine final : public TransferEngine {
 public:
  Engine(const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains)
      : options_(options),
        domains_(std::move(domains)),
        nics_(static_cast<uint32_t>(domains_.size())),
        queue_(options.submit_queue_depth),
        free_send_buffers_(std::max<uint32_t>(options.num_send_buffers, 1)),
        counters_(options.max_imm_counters),
        owner_(std::make_shared<RegistrationOwner>()) {
    owner_->engine = this;
    std::random_device rd;
    id_ = (uint64_t{rd()} << 32 | rd()) | 1;  // never 0
  }

  // Stops the worker; false means the engine must be leaked (see Stop).
  bool StopWorker() { return Stop(); }

  // Precondition: StopWorker() returned true.
  ~Engine() override {
    // Close the endpoints while the WR contexts and buffers they may still reference exist.
    domains_.clear();
  }

  Status Init() {
    info_ = domains_[0]->info();
    info_.num_nics = nics_;
    max_chunk_ = uint64_t{1} << 30;
    uint64_t tx_total = 0;
    for (uint32_t k = 0; k < nics_; ++k) {
      const FabricInfo& info = domains_[k]->info();
      if (k > 0) info_.domain += "," + info.domain;
      max_chunk_ = std::min<uint64_t>(max_chunk_, info.max_msg_size);
      info_.ordered_write_bytes = std::min(info_.ordered_write_bytes, info.ordered_write_bytes);
      tx_total += info.tx_size > 0 ? info.tx_size : options_.max_outstanding_wrs;
    }
    uint32_t wrs = static_cast<uint32_t>(
        std::min<uint64_t>(options_.max_outstanding_wrs, std::max<uint64_t>(tx_total, 1)));
    wr_slots_ = std::make_unique<WrSlot[]>(wrs);
    wr_count_ = wrs;
    free_wrs_.reserve(wrs);
    for (uint32_t i = wrs; i > 0; --i) free_wrs_.push_back(&wr_slots_[i - 1]);

    transfers_ = std::make_unique<Transfer[]>(options_.max_transfers);
    free_transfers_.reserve(options_.max_transfers);
    for (uint32_t i = options_.max_transfers; i > 0; --i) {
      free_transfers_.push_back(&transfers_[i - 1]);
    }
    pending_.resize(options_.max_transfers);
    scratch_.reserve(options_.max_transfers);
    armed_.reserve(options_.max_imm_counters);
    peers_ = std::make_unique<PeerEntry[]>(options_.max_peers);
    groups_.resize(options_.max_groups);
    plans_.resize(options_.max_scatter_plans);

    // The sink receives immediate-only writes: zero bytes land there, the immediate is the point.
    sink_.resize(64);
    ASSIGN_OR_RETURN(sink_reg_, RegisterAll(sink_.data(), sink_.size(), MemoryKind::kHost, 0));

    // Every NIC gets its own receive buffers: a message may arrive on any of them.
    uint32_t rx = std::max<uint32_t>(options_.num_recv_buffers, 1);
    for (uint32_t k = 0; k < nics_; ++k) {
      size_t rx_size = domains_[k]->info().rx_size;
      if (rx_size > 0) rx = std::min<uint32_t>(rx, static_cast<uint32_t>(rx_size));
    }
    num_recv_slots_ = rx * nics_;
    recv_buffers_.resize(uint64_t{num_recv_slots_} * options_.message_bytes);
    ASSIGN_OR_RETURN(recv_reg_, RegisterAll(recv_buffers_.data(), recv_buffers_.size(),
                                            MemoryKind::kHost, 0));
    recv_slots_ = std::make_unique<RecvSlot[]>(num_recv_slots_);
    for (uint32_t i = 0; i < num_recv_slots_; ++i) {
      recv_slots_[i].index = i;
      recv_slots_[i].nic = i / rx;
      RETURN_IF_ERROR(PostRecvSlot(i));
    }
    send_buffers_.resize(uint64_t{options_.num_send_buffers} * options_.message_bytes);
    if (!send_buffers_.empty()) {
      ASSIGN_OR_RETURN(send_reg_, RegisterAll(send_buffers_.data(), send_buffers_.size(),
                                              MemoryKind::kHost, 0));
    }
    for (uint32_t i = 0; i < options_.num_send_buffers; ++i) {
      uint32_t index = i;
      free_send_buffers_.TryPush(std::move(index));
    }

    EngineAddress address;
    address.engine_id = id_;
    address.provider = info_.provider;
    for (uint32_t k = 0; k < nics_; ++k) {
      address.nics.push_back(
          {domains_[k]->Name(), sink_reg_.per_nic[k].base, sink_reg_.per_nic[k].key});
    }
    address_ = address.Serialize();

    worker_ = std::thread([this] { WorkerMain(); });
    return Status::Ok();
  }

  const FabricInfo& info() const override { return info_; }
  const EngineOptions& options() const override { return options_; }
  uint64_t id() const override { return id_; }
  std::vector<uint8_t> Address() const override { return address_; }

  // ----- memory -----------------------------------------------------------------------------

  StatusOr<MemoryRegion> RegisterMemory(void* data, uint64_t length, MemoryKind kind,
                                        int device) override {
    if (data == nullptr || length == 0) {
      return InvalidArgumentError("RegisterMemory: null pointer or zero length");
    }
    ASSIGN_OR_RETURN(ControlResult done, RunOnWorker([this, data, length, kind, device](
                                                         ControlResult& out) -> Status {
      ASSIGN_OR_RETURN(out.reg, RegisterAll(data, length, kind, device));
      return Status::Ok();
    }));
    // The region's handle is its MultiRegistration, which the engine keeps until Deregister.
    MultiRegistration* reg;
    {
      auto owned = std::make_unique<MultiRegistration>(done.reg);
      reg = owned.get();
      std::lock_guard<std::mutex> lock(regs_mu_);
      regs_.emplace(reg, std::move(owned));
    }
    MemoryRegion region;
    RemoteRegion remote;
    remote.engine_id = id_;
    remote.length = length;
    remote.num_nics = nics_;
    for (uint32_t k = 0; k < nics_; ++k) {
      remote.nics[k] = {reg->per_nic[k].base, reg->per_nic[k].key};
    }
    InitRegion(region, owner_, reg, data, length, kind, reg->descs(), remote);
    return region;
  }

  void Deregister(MemoryRegion& region) override {
    auto* handle = static_cast<MultiRegistration*>(RegionHandle(region));
    if (!handle) return;
    MultiRegistration copy;
    {
      std::lock_guard<std::mutex> lock(regs_mu_);
      auto it = regs_.find(handle);
      if (it == regs_.end()) return;
      copy = *it->second;
      regs_.erase(it);
    }
    auto s = RunOnWorker([this, copy](ControlResult&) -> Status {
      DeregisterAll(copy);
      return Status::Ok();
    });
    (void)s;  // if the worker is gone or wedged, the domains close their registrations themselves
  }

  // Registers [data, data + length) on every NIC; all or none.
  StatusOr<MultiRegistration> RegisterAll(void* data, uint64_t length, MemoryKind kind,
                                          int device) {
    MultiRegistration reg;
    for (uint32_t k = 0; k < nics_; ++k) {
      auto got = domains_[k]->Register(data, length, kind, device);
      if (!got.ok()) {
        DeregisterAll(reg);
        return nics_ > 1 ? got.status().WithContext("NIC " + std::to_string(k)) : got.status();
      }
      reg.per_nic[k] = *got;
      reg.nics = k + 1;
    }
    return reg;
  }

  void DeregisterAll(const MultiRegistration& reg) {
    for (uint32_t k = 0; k < reg.nics; ++k) domains_[k]->Deregister(reg.per_nic[k].handle);
  }

  // ----- peers ------------------------------------------------------------------------------

  StatusOr<PeerId> AddPeer(std::span<const uint8_t> address_bytes) override {
    ASSIGN_OR_RETURN(EngineAddress address, EngineAddress::Parse(address_bytes));
    if (address.provider != info().provider) {
      return InvalidArgumentError("peer address is for provider '" + address.provider +
                                  "', this engine uses '" + info().provider + "'");
    }
    std::lock_guard<std::mutex> lock(add_mu_);
    uint32_t n = num_peers_.load(std::memory_order_relaxed);
    if (n >= options_.max_peers) {
      return ResourceExhaustedError("peer table full (" + std::to_string(options_.max_peers) +
                                    ")");
    }
    const uint32_t remote = static_cast<uint32_t>(address.nics.size());
    PeerEntry& e = peers_[n];
    e.inserted.clear();
    e.remote_nics = remote;
    e.engine_id = address.engine_id;
    for (uint32_t k = 0; k < nics_; ++k) {
      const NicAddress& to = address.nics[k % remote];
      e.sink[k] = {to.sink_base, to.sink_key};
    }
    // Domain k inserts the peer NIC it sends to (k mod M) and every peer NIC that sends to it
    // (j mod N == k), so that messages name their sender.
    std::vector<std::pair<uint32_t, uint32_t>> links;  // (local NIC, peer NIC)
    for (uint32_t k = 0; k < nics_; ++k) links.push_back({k, k % remote});
    for (uint32_t j = 0; j < remote; ++j) {
      if ((j % nics_) % remote != j) links.push_back({j % nics_, j});
    }
    ASSIGN_OR_RETURN(ControlResult inserted,
                     RunOnWorker([this, address, links, n](ControlResult& out) -> Status {
                       for (auto [k, j] : links) {
                         auto addr = domains_[k]->InsertPeer(address.nics[j].name);
                         if (!addr.ok()) {
                           for (auto [k2, a2] : out.inserted) (void)domains_[k2]->RemovePeer(a2);
                           return addr.status();
                         }
                         out.inserted.push_back({k, *addr});
                         peer_by_addr_[PeerKey(k, *addr)] = n;
                       }
                       return Status::Ok();
                     }));
    for (size_t i = 0; i < links.size(); ++i) {
      if (i < nics_) e.addr[links[i].first] = inserted.inserted[i].second;
    }
    e.inserted = inserted.inserted;
    num_peers_.store(n + 1, std::memory_order_release);
    return PeerId{n};
  }

  static uint64_t PeerKey(uint32_t nic, uint64_t addr) { return addr * kMaxNics + nic; }

  // A lost peer can be removed too (that is when it is needed most); removing twice is a no-op.
  Status RemovePeer(PeerId peer) override {
    if (peer >= num_peers_.load(std::memory_order_acquire)) {
      return NotFoundError("unknown " + PeerName(peer));
    }
    return RunOnWorker([this, peer](ControlResult&) -> Status {
             MarkPeerLost(peer, UnavailableError(PeerName(peer) + " was removed"));
             Status first;
             auto inserted = std::exchange(peers_[peer].inserted, {});
             for (auto [k, addr] : inserted) {
               peer_by_addr_.erase(PeerKey(k, addr));
               Status s = domains_[k]->RemovePeer(addr);
               if (first.ok()) first = s;
             }
             return first;
           })
        .status();
  }

  StatusOr<GroupId> AddPeerGroup(std::span<const PeerId> members) override {
    if (members.empty()) return InvalidArgumentError("AddPeerGroup: no members");
    for (PeerId p : members) {
      if (p >= num_peers_.load(std::memory_order_acquire)) {
        return NotFoundError("AddPeerGroup: unknown " + PeerName(p));
      }
    }
    std::lock_guard<std::mutex> lock(add_mu_);
    uint32_t n = num_groups_.load(std::memory_order_relaxed);
    if (n >= options_.max_groups) return ResourceExhaustedError("peer group table full");
    groups_[n] = std::make_unique<PeerGroup>(PeerGroup{{members.begin(), members.end()}});
    num_groups_.store(n + 1, std::memory_order_release);
    return GroupId{n};
  }

  StatusOr<ScatterPlanId> PrepareScatter(GroupId group, const MemoryRegion& src,
                                         std::span<const RemoteRegion> dst) override {
    RETURN_IF_ERROR(CheckLocal(&src));
    ASSIGN_OR_RETURN(const PeerGroup* g, FindGroup(group));
    if (dst.size() != g->members.size()) {
      return InvalidArgumentError("PrepareScatter: " + std::to_string(dst.size()) +
                                  " regions for a group of " + std::to_string(g->members.size()));
    }
    auto plan = std::make_unique<ScatterPlan>();
    plan->src = static_cast<const uint8_t*>(src.data());
    plan->src_length = src.length();
    plan->src_desc = LocalDescs(src);
    for (size_t i = 0; i < dst.size(); ++i) {
      PeerId p = g->members[i];
      RETURN_IF_ERROR(CheckOwner(p, dst[i]));
      const uint32_t k = static_cast<uint32_t>(i % nics_);
      const NicKey& to = dst[i].nics[k % peers_[p].remote_nics];
      plan->members.push_back({p, k, peers_[p].addr[k], to.base, to.key, dst[i].length});
    }
    std::lock_guard<std::mutex> lock(add_mu_);
    uint32_t n = num_plans_.load(std::memory_order_relaxed);
    if (n >= options_.max_scatter_plans) return ResourceExhaustedError("scatter plan table full");
    plans_[n] = std::move(plan);
    num_plans_.store(n + 1, std::memory_order_release);
    return ScatterPlanId{n};
  }

  // ----- submission -------------------------------------------------------------------------

  Status Write(const SingleWrite& w, Completion done) override {
    RETURN_IF_ERROR(CheckLocal(w.src));
    RETURN_IF_ERROR(CheckPeer(w.peer));
    RETURN_IF_ERROR(CheckOwner(w.peer, w.dst));
    if (w.length == 0 && !w.imm) {
      return InvalidArgumentError("Write: zero length and no immediate");
    }
    RETURN_IF_ERROR(CheckRange("src", w.src_offset, w.length, w.src->length()));
    RETURN_IF_ERROR(CheckRange("dst", w.dst_offset, w.length, w.dst.length));
    Request r;
    r.kind = Kind::kSingle;
    SetPeer(r, w.peer);
    r.src = static_cast<const uint8_t*>(w.src->data()) + w.src_offset;
    r.src_desc = LocalDescs(*w.src);
    SetDst(r, w.dst, w.dst_offset);
    r.length = w.length;
    SetImm(r, w.imm);
    return Enqueue(std::move(r), std::move(done));
  }

  Status WritePaged(const PagedWrite& w, Completion done) override {
    RETURN_IF_ERROR(CheckLocal(w.src));
    RETURN_IF_ERROR(CheckPeer(w.peer));
    RETURN_IF_ERROR(CheckOwner(w.peer, w.dst));
    if (w.src_pages.size() != w.dst_pages.size()) {
      return InvalidArgumentError("WritePaged: " + std::to_string(w.src_pages.size()) +
                                  " source pages but " + std::to_string(w.dst_pages.size()) +
                                  " destination pages");
    }
    if (w.page_bytes == 0) return InvalidArgumentError("WritePaged: page_bytes is 0");
    if (w.page_bytes > max_chunk_) {
      return InvalidArgumentError("WritePaged: page of " + std::to_string(w.page_bytes) +
                                  " bytes exceeds the provider's message size " +
                                  std::to_string(max_chunk_));
    }
    if (w.src_pages.size() > UINT32_MAX) return InvalidArgumentError("WritePaged: too many pages");
    for (size_t i = 0; i < w.src_pages.size(); ++i) {
      uint64_t src_off, dst_off;
      RETURN_IF_ERROR(PageOffset("src", w.src_offset, w.src_pages[i], w.src_stride, &src_off));
      RETURN_IF_ERROR(PageOffset("dst", w.dst_offset, w.dst_pages[i], w.dst_stride, &dst_off));
      Status s = CheckRange("src", src_off, w.page_bytes, w.src->length());
      if (s.ok()) s = CheckRange("dst", dst_off, w.page_bytes, w.dst.length);
      if (!s.ok()) {
        return s.WithContext("WritePaged page " + std::to_string(i) + " (src page " +
                             std::to_string(w.src_pages[i]) + ", dst page " +
                             std::to_string(w.dst_pages[i]) + ")");
      }
    }
    Request r;
    r.kind = Kind::kPaged;
    SetPeer(r, w.peer);
    r.src = static_cast<const uint8_t*>(w.src->data()) + w.src_offset;
    r.src_desc = LocalDescs(*w.src);
    SetDst(r, w.dst, w.dst_offset);
    r.length = w.page_bytes;
    r.src_stride = w.src_stride;
    r.dst_stride = w.dst_stride;
    r.src_pages = w.src_pages.data();
    r.dst_pages = w.dst_pages.data();
    r.count = static_cast<uint32_t>(w.src_pages.size());
    SetImm(r, w.imm);
    if (w.imm_once) {
      const uint32_t m = w.imm_weight_mask;
      const uint64_t per_nic = (w.src_pages.size() + nics_ - 1) / nics_;
      if (!w.imm || !IsWeightMask(m) || (*w.imm & m) != 0 || per_nic > WeightLimit(m)) {
        return InvalidArgumentError(
            "WritePaged: imm_once needs an immediate and a contiguous imm_weight_mask outside it "
            "that holds the pages of one NIC (" + std::to_string(per_nic) + ")");
      }
      r.imm_once = true;
      r.imm_weight_mask = m;
    }
    return Enqueue(std::move(r), std::move(done));
  }

  Status Scatter(const ScatterWrite& w, Completion done) override {
    if (w.plan >= num_plans_.load(std::memory_order_acquire)) {
      return NotFoundError("Scatter: unknown plan " + std::to_string(w.plan));
    }
    const ScatterPlan* plan = plans_[w.plan].get();
    if (w.targets.size() > UINT32_MAX) return InvalidArgumentError("Scatter: too many targets");
    for (size_t i = 0; i < w.targets.size(); ++i) {
      const ScatterTarget& t = w.targets[i];
      if (t.member >= plan->members.size()) {
        return OutOfRangeError("Scatter target " + std::to_string(i) + ": member " +
                               std::to_string(t.member) + " of a group of " +
                               std::to_string(plan->members.size()));
      }
      const ScatterMember& m = plan->members[t.member];
      if (t.length > max_chunk_) {
        return InvalidArgumentError("Scatter target " + std::to_string(i) + ": " +
                                    std::to_string(t.length) +
                                    " bytes exceed the provider's message size");
      }
      if (t.length == 0 && !w.imm) {
        return InvalidArgumentError("Scatter target " + std::to_string(i) +
                                    ": zero length and no immediate");
      }
      Status s = CheckRange("src", t.src_offset, t.length, plan->src_length);
      if (s.ok()) s = CheckRange("dst", t.dst_offset, t.length, m.length);
      if (s.ok()) s = CheckPeer(m.peer);
      if (!s.ok()) return s.WithContext("Scatter target " + std::to_string(i));
    }
    Request r;
    r.kind = Kind::kScatter;
    r.plan = plan;
    r.targets = w.targets.data();
    r.count = static_cast<uint32_t>(w.targets.size());
    SetImm(r, w.imm);
    return Enqueue(std::move(r), std::move(done));
  }

  Status Barrier(GroupId group, uint32_t imm, Completion done) override {
    ASSIGN_OR_RETURN(const PeerGroup* g, FindGroup(group));
    for (PeerId p : g->members) RETURN_IF_ERROR(CheckPeer(p).WithContext("Barrier"));
    Request r;
    r.kind = Kind::kBarrier;
    r.group = g;
    r.peers = peers_.get();
    r.count = static_cast<uint32_t>(g->members.size());
    SetImm(r, imm);
    return Enqueue(std::move(r), std::move(done));
  }

  Status WriteImm(PeerId peer, uint32_t imm, Completion done) override {
    RETURN_IF_ERROR(CheckPeer(peer));
    Request r;
    r.kind = Kind::kImm;
    SetPeer(r, peer);
    SetImm(r, imm);
    return Enqueue(std::move(r), std::move(done));
  }

  Status Send(PeerId peer, std::span<const uint8_t> message, Completion done) override {
    RETURN_IF_ERROR(CheckPeer(peer));
    if (message.size() > options_.message_bytes) {
      return InvalidArgumentError("Send: message of " + std::to_string(message.size()) +
                                  " bytes exceeds message_bytes " +
                                  std::to_string(options_.message_bytes));
    }
    uint32_t index = 0;
    if (!free_send_buffers_.TryPop(index)) {
      return ResourceExhaustedError("Send: all " + std::to_string(options_.num_send_buffers) +
                                    " send buffers are in flight");
    }
    uint8_t* buf = send_buffers_.data() + uint64_t{index} * options_.message_bytes;
    if (!message.empty()) std::memcpy(buf, message.data(), message.size());
    Request r;
    r.kind = Kind::kSend;
    SetPeer(r, peer);
    r.src = buf;
    r.src_desc = send_reg_.descs();
    r.length = message.size();
    r.send_buffer = index;
    Status s = Enqueue(std::move(r), std::move(done));
    if (!s.ok()) free_send_buffers_.TryPush(std::move(index));
    return s;
  }

  void SetMessageHandler(MessageHandler handler) override {
    auto s = RunOnWorker([this, handler = std::move(handler)](ControlResult&) -> Status {
      message_handler_ = handler;
      return Status::Ok();
    });
    (void)s;
  }

  // ----- immediate counters -----------------------------------------------------------------

  Status CreateImmCounter(uint32_t imm) override { return counters_.Create(imm); }
  Status CreateWeightedImmCounter(uint32_t imm, uint32_t weight_mask) override {
    if (weight_mask == 0) return InvalidArgumentError("CreateWeightedImmCounter: empty mask");
    return counters_.Create(imm, weight_mask);
  }

  StatusOr<uint64_t> ImmCount(uint32_t imm) const override {
    ASSIGN_OR_RETURN(const ImmCounterTable::Slot* slot, Counter(imm));
    return slot->count.load(std::memory_order_acquire);
  }

  Status WaitImm(uint32_t imm, uint64_t target, Deadline deadline) const override {
    ASSIGN_OR_RETURN(const ImmCounterTable::Slot* slot, Counter(imm));
    Backoff backoff;
    for (;;) {
      uint64_t seen = slot->count.load(std::memory_order_acquire);
      if (seen >= target) return Status::Ok();
      if (deadline.Expired()) {
        return DeadlineExceededError("immediate counter " + std::to_string(imm) + ": expected " +
                                     std::to_string(target) + ", seen " + std::to_string(seen));
      }
      backoff.Pause();
    }
  }

  Status NotifyImm(uint32_t imm, uint64_t target, Deadline deadline,
                   DoneCallback done) override {
    ASSIGN_OR_RETURN(Request r, CounterRequest(Kind::kNotify, imm));
    r.target = target;
    r.deadline = deadline.at;
    return Push(std::move(r), Completion::Callback(std::move(done)));
  }

  Status ConsumeImm(uint32_t imm, uint64_t n) override { return counters_.Consume(imm, n); }

  Status DisarmImm(uint32_t imm) override {
    ASSIGN_OR_RETURN(Request r, CounterRequest(Kind::kDisarm, imm));
    return Push(std::move(r), Completion());
  }

  StatusOr<ImmCounterTable::Slot*> Counter(uint32_t imm) const {
    ImmCounterTable::Slot* slot = counters_.Find(imm);
    if (!slot) return NotFoundError("no immediate counter " + std::to_string(imm));
    return slot;
  }

  // A request about counter `imm` for the worker (arm or disarm its notification).
  StatusOr<Request> CounterRequest(Kind kind, uint32_t imm) const {
    ASSIGN_OR_RETURN(ImmCounterTable::Slot* slot, Counter(imm));
    Request r;
    r.kind = kind;
    r.imm = imm;
    r.slot = slot;
    return r;
  }

  void SetUnmatchedImmHandler(UnmatchedImmHandler handler) override {
    auto s = RunOnWorker([this, handler = std::move(handler)](ControlResult&) -> Status {
      unmatched_handler_ = handler;
      return Status::Ok();
    });
    (void)s;
  }

  EngineStats stats() const override {
    EngineStats s;
    s.transfers_submitted = stats_.submitted.load(std::memory_order_relaxed);
    s.transfers_completed = stats_.completed.load(std::memory_order_relaxed);
    s.transfers_failed = stats_.failed.load(std::memory_order_relaxed);
    s.wrs_posted = stats_.wrs_posted.load(std::memory_order_relaxed);
    for (uint32_t k = 0; k < kMaxNics; ++k) {
      s.wrs_posted_per_nic[k] = stats_.wrs_per_nic[k].load(std::memory_order_relaxed);
    }
    s.post_retries = stats_.post_retries.load(std::memory_order_relaxed);
    s.imm_waits = stats_.imm_waits.load(std::memory_order_relaxed);
    s.worker_sleeps = stats_.sleeps.load(std::memory_order_relaxed);
    s.imms_received = stats_.imms.load(std::memory_order_relaxed);
    s.imms_unmatched = stats_.imms_unmatched.load(std::memory_order_relaxed);
    s.messages_received = stats_.messages.load(std::memory_order_relaxed);
    if (worker_.joinable()) {
      clockid_t cid;
      timespec ts{};
      if (pthread_getcpuclockid(const_cast<std::thread&>(worker_).native_handle(), &cid) == 0 &&
          clock_gettime(cid, &ts) == 0) {
        s.worker_cpu_ns = uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
      }
    }
    return s;
  }

 private:
  // ----- validation (caller threads) ---------------------------------------------------------

  Status CheckLocal(const MemoryRegion* region) const {
    if (region == nullptr || !region->valid()) {
      return InvalidArgumentError("source region is null or not registered");
    }
    if (region->remote().engine_id != id_) {
      return InvalidArgumentError("source region was registered with another engine");
    }
    return Status::Ok();
  }

  Status CheckPeer(PeerId peer) const {
    if (peer >= num_peers_.load(std::memory_order_acquire)) {
      return NotFoundError("unknown " + PeerName(peer));
    }
    if (peers_[peer].lost.load(std::memory_order_acquire)) {
      return UnavailableError(PeerName(peer) + " is lost");
    }
    return Status::Ok();
  }

  // The descriptor must come from the engine we are writing to.
  Status CheckOwner(PeerId peer, const RemoteRegion& region) const {
    if (peer >= num_peers_.load(std::memory_order_acquire)) {
      return NotFoundError("unknown " + PeerName(peer));
    }
    if (region.engine_id != peers_[peer].engine_id) {
      return InvalidArgumentError("region descriptor belongs to another engine than " +
                                  PeerName(peer));
    }
    if (region.num_nics != peers_[peer].remote_nics) {
      return InvalidArgumentError("region descriptor has " + std::to_string(region.num_nics) +
                                  " NIC entries but " + PeerName(peer) + " has " +
                                  std::to_string(peers_[peer].remote_nics) + " NICs");
    }
    return Status::Ok();
  }

  Descs LocalDescs(const MemoryRegion& region) const {
    Descs d{};
    for (uint32_t k = 0; k < nics_; ++k) d[k] = region.local_desc(k);
    return d;
  }

  // The destination as each local NIC sees it (its paired peer NIC's address and key).
  void SetDst(Request& r, const RemoteRegion& dst, uint64_t offset) const {
    const uint32_t remote = peers_[r.peer].remote_nics;
    for (uint32_t k = 0; k < nics_; ++k) {
      const NicKey& to = dst.nics[k % remote];
      r.dst[k] = {to.base + offset, to.key};
    }
  }

  StatusOr<const PeerGroup*> FindGroup(GroupId group) const {
    if (group >= num_groups_.load(std::memory_order_acquire)) {
      return NotFoundError("unknown peer group " + std::to_string(group));
    }
    return groups_[group].get();
  }

  void SetPeer(Request& r, PeerId peer) {
    r.peer = peer;
    r.entry = &peers_[peer];
    r.first_nic = NextNic();
  }

  // The NIC that starts the next transfer: taken in turn so small transfers spread.
  uint32_t NextNic() {
    if (nics_ == 1) return 0;
    return next_nic_.fetch_add(1, std::memory_order_relaxed) % nics_;
  }
  static void SetImm(Request& r, std::optional<uint32_t> imm) {
    r.has_imm = imm.has_value();
    r.imm = imm.value_or(0);
  }

  // Admission: at most max_transfers in flight, so the worker always finds a free slot.
  Status Enqueue(Request&& r, Completion&& done) {
    if (inflight_.fetch_add(1, std::memory_order_acq_rel) >= options_.max_transfers) {
      inflight_.fetch_sub(1, std::memory_order_acq_rel);
      return ResourceExhaustedError("too many transfers in flight (max_transfers " +
                                    std::to_string(options_.max_transfers) + ")");
    }
    Status s = Push(std::move(r), std::move(done));
    if (!s.ok()) {
      inflight_.fetch_sub(1, std::memory_order_acq_rel);
    } else {
      stats_.submitted.fetch_add(1, std::memory_order_relaxed);
    }
    return s;
  }

  Status Push(Request&& r, Completion&& done) {
    if (stopping_.load(std::memory_order_acquire)) {
      return CancelledError("engine is shutting down");
    }
    r.done = std::move(done);
    if (!queue_.TryPush(std::move(r))) {
      // TryPush leaves r intact on failure; the caller keeps ownership of its completion.
      return ResourceExhaustedError("submission queue full (" +
                                    std::to_string(queue_.capacity()) + " requests)");
    }
    WakeWorker();
    return Status::Ok();
  }

  void WakeWorker() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_relaxed)) {
      wake_word_.fetch_add(1, std::memory_order_release);
      Futex::WakeOne(&wake_word_);
    }
  }

  // What a control operation hands back to its caller.
  struct ControlResult {
    MultiRegistration reg;
    std::vector<std::pair<uint32_t, uint64_t>> inserted;  // AddPeer: (local NIC, address)
  };
  using ControlFn = std::function<Status(ControlResult&)>;

  // Runs `fn` on the worker and waits at most options_.control_timeout_ms. `fn` must capture by
  // value: after a timeout the caller is gone while the op may still be queued (it is then
  // skipped) or running inside a wedged provider call (it then owns only its own copies).
  StatusOr<ControlResult> RunOnWorker(ControlFn fn) {
    struct Op {
      ControlFn fn;
      ControlResult out;
      Status result;
      bool done = false;
      bool abandoned = false;
    };
    auto op = std::make_shared<Op>();
    op->fn = std::move(fn);
    {
      std::unique_lock<std::mutex> lock(control_mu_);
      if (!worker_running_) return CancelledError("engine worker is not running");
      control_.push_back([op, this] {
        {
          std::lock_guard<std::mutex> l(control_mu_);
          if (op->abandoned) return;
        }
        Status s = op->fn(op->out);
        std::lock_guard<std::mutex> l(control_mu_);
        op->result = std::move(s);
        op->done = true;
        control_cv_.notify_all();
      });
      control_pending_.store(true, std::memory_order_release);
    }
    WakeWorker();
    std::unique_lock<std::mutex> lock(control_mu_);
    if (!control_cv_.wait_for(lock, std::chrono::milliseconds(options_.control_timeout_ms),
                              [&] { return op->done; })) {
      op->abandoned = true;
      return DeadlineExceededError("engine worker did not run a control operation within " +
                                   std::to_string(options_.control_timeout_ms) +
                                   " ms (is it stuck in a provider call?)");
    }
    if (!op->result.ok()) return op->result;
    return op->out;
  }

  // ----- worker -------------------------------------------------------------------------------

  void WorkerMain() {
    if (options_.worker_cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(options_.worker_cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    Clock::time_point last_event = Clock::now();
    Clock::time_point last_scan = last_event;
    while (!stop_.load(std::memory_order_acquire)) {
      size_t events = PollCompletions();
      events += DrainQueue();
      events += PostPending();
      if (control_pending_.load(std::memory_order_acquire)) {
        RunControl();
        ++events;
      }
      Clock::time_point now = Clock::now();
      if (now - last_scan > std::chrono::milliseconds(1)) {
        ScanDeadlines(now);
        last_scan = now;
      }
      if (events > 0) {
        last_event = now;
        continue;
      }
      Idle(now - last_event);
    }
    // An abandoned engine's worker that comes back from a wedged provider call touches nothing
    // its owner may have freed: no callbacks, no counters.
    if (!abandoned_.load(std::memory_order_acquire)) Drain();
    std::lock_guard<std::mutex> lock(exit_mu_);
    worker_exited_ = true;
    exit_cv_.notify_all();
  }

  void Idle(Clock::duration idle_for) {
    if (options_.spin_us < 0) return;
    auto idle_us = std::chrono::duration_cast<std::chrono::microseconds>(idle_for).count();
    // Posted WRs, and writes a notification waits for, move only inside polls (libfabric's
    // manual progress: tcp sends, receives and acknowledges there, on both sides), so while any
    // WR is outstanding or a notification armed the worker yields, never sleeps. (Over tcp,
    // sleeping here once made transfers whose immediates wait for completions 5-10x slower.)
    const bool in_flight = free_wrs_.size() < wr_count_ || !armed_.empty();
    if (idle_us < options_.spin_us) {
      CpuRelax();
    } else if (idle_us < options_.idle_yield_us || in_flight) {
      sched_yield();
    } else {
      uint32_t seen = wake_word_.load(std::memory_order_acquire);
      sleeping_.store(true, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (queue_.ApproxEmpty() && !control_pending_.load(std::memory_order_relaxed) &&
          !stop_.load(std::memory_order_relaxed)) {
        Stats::Add(stats_.sleeps);
        Futex::Wait(&wake_word_, seen, options_.idle_sleep_us);
      }
      sleeping_.store(false, std::memory_order_relaxed);
    }
  }

  void RunControl() {
    std::deque<std::function<void()>> ops;
    {
      std::lock_guard<std::mutex> lock(control_mu_);
      ops.swap(control_);
      control_pending_.store(false, std::memory_order_release);
    }
    for (auto& op : ops) op();
  }

  size_t DrainQueue() {
    size_t n = 0;
    Request r;
    while (n < 64 && queue_.TryPop(r)) {
      ++n;
      if (r.kind == Kind::kNotify) {
        Arm(std::move(r));
        continue;
      }
      if (r.kind == Kind::kDisarm) {
        if (r.slot->armed) FireNotify(r.slot, CancelledError("notification disarmed"));
        continue;
      }
      Start(std::move(r));
    }
    return n;
  }

  void Start(Request&& r) {
    Transfer* t = free_transfers_.back();  // admission guarantees one
    free_transfers_.pop_back();
    *t = Transfer{};
    t->req = std::move(r);
    t->deadline = Clock::now() + std::chrono::milliseconds(options_.transfer_timeout_ms);
    switch (t->req.kind) {
      case Kind::kSingle: PlanSingle(t); break;
      case Kind::kImm:
      case Kind::kSend: t->total = 1; break;
      default: t->total = t->req.count; break;
    }
    // Link into the active list.
    t->active_next = active_;
    if (active_) active_->active_prev = t;
    active_ = t;
    if (t->total == 0) {
      Finish(t, Status::Ok());
      return;
    }
    Enqueue(t);
  }

  // Cuts a single write into shards (one per NIC when it is large enough) and each shard into
  // chunks of at most max_chunk_ bytes.
  void PlanSingle(Transfer* t) {
    const uint64_t length = t->req.length;
    t->chunk = max_chunk_;
    t->shards = 1;
    if (nics_ > 1 && length >= nics_ * std::max<uint64_t>(options_.nic_shard_min_bytes, 1)) {
      t->shards = nics_;
    }
    // Shards of whole 64-byte lines: NICs move cache lines, and the last shard takes the rest.
    t->shard_bytes = t->shards == 1 ? length : (length / t->shards + 63) / 64 * 64;
    t->shard_wrs = static_cast<uint32_t>(std::max<uint64_t>(
        (t->shard_bytes + t->chunk - 1) / t->chunk, 1));
    const uint64_t last = length - (t->shards - 1) * t->shard_bytes;
    const uint32_t last_wrs =
        static_cast<uint32_t>(std::max<uint64_t>((last + t->chunk - 1) / t->chunk, 1));
    t->total = (t->shards - 1) * t->shard_wrs + last_wrs;
  }

  void Enqueue(Transfer* t) {
    if (t->queued) return;
    t->queued = true;
    pending_[(pending_head_ + pending_size_) % pending_.size()] = t;
    ++pending_size_;
  }

  // The shard (hence NIC: first_nic + shard) of a single write's WR i.
  static uint32_t ShardOf(const Transfer& t, uint32_t i) {
    return std::min(i / t.shard_wrs, t.shards - 1);
  }

  // How many of a transfer's last WRs carry its immediate: the last chunk of a split single
  // write; each NIC's last page of a paged write with imm_once (the last min(NICs, pages) WRs,
  // since page i goes to NIC first + i).
  uint32_t TailWrs(const Transfer& t) const {
    if (!t.req.has_imm) return 0;
    if (t.req.kind == Kind::kSingle) return 1;
    if (t.req.kind == Kind::kPaged && t.req.imm_once) return std::min<uint32_t>(nics_, t.total);
    return 0;
  }

  // Whether those WRs wait for all the others to complete. Not when each immediate only counts
  // WRs posted before it on its own connection and that connection places writes in order
  // (FabricInfo::ordered_write_bytes): a paged write's pages (each NIC's immediate counts that
  // NIC's pages), a single write in one shard. A single write over several NICs still waits:
  // its one immediate counts the other NICs' shards too.
  bool TailWaits(const Transfer& t) const {
    if (!options_.trust_write_order) return true;
    const uint64_t wr_bytes = t.req.kind == Kind::kPaged ? t.req.length : t.chunk;
    if (wr_bytes > info_.ordered_write_bytes) return true;
    return t.req.kind == Kind::kSingle && t.shards > 1;
  }

  // Posts WRs of pending transfers, oldest first, while WR contexts and provider space last.
  size_t PostPending() {
    size_t posted = 0;
    while (pending_size_ > 0) {
      Transfer* t = pending_[pending_head_];
      bool blocked = false;
      while (t->next < t->total && !t->finished) {
        const uint32_t tails = TailWrs(*t);
        if (t->tail_deferred || (tails && t->total > tails && t->next == t->total - tails &&
                                 t->outstanding && TailWaits(*t))) {
          // The immediate must not overtake the data: post the immediate-carrying last WRs
          // after the others completed.
          if (!t->tail_deferred) {
            Stats::Add(stats_.imm_waits);
          }
          t->tail_deferred = true;
          break;
        }
        if (free_wrs_.empty()) {
          blocked = true;
          break;
        }
        WrSlot* slot = free_wrs_.back();
        slot->transfer = t;
        Status error;
        uint32_t nic = 0;
        PostResult res = PostOne(t, t->next, slot, &nic, &error);
        if (res == PostResult::kAgain) {
          Stats::Add(stats_.post_retries);
          blocked = true;
          break;
        }
        if (res == PostResult::kError) {
          Fail(t, error);
          break;
        }
        free_wrs_.pop_back();
        ++t->next;
        ++t->outstanding;
        ++posted;
        auto& per_nic = stats_.wrs_per_nic[nic];
        Stats::Add(per_nic);
      }
      if (blocked) break;
      // Done posting (or deferred, or failed): off the pending list.
      pending_head_ = (pending_head_ + 1) % pending_.size();
      --pending_size_;
      t->queued = false;
      MaybeFinish(t);
    }
    if (posted) {
      Stats::Add(stats_.wrs_posted, posted);
    }
    return posted;
  }

  // Posts WR i of transfer t on the NIC the file comment assigns it to; *nic says which.
  PostResult PostOne(Transfer* t, uint32_t i, WrSlot* slot, uint32_t* nic, Status* error) {
    const Request& r = t->req;
    WriteWr wr;
    wr.context = &slot->ctx;
    wr.has_imm = r.has_imm;
    wr.imm = r.imm;
    uint32_t k = r.first_nic;
    switch (r.kind) {
      case Kind::kSingle: {
        const uint32_t shard = ShardOf(*t, i);
        const uint64_t shard_start = shard * t->shard_bytes;
        const uint64_t shard_end = shard + 1 == t->shards ? r.length : shard_start + t->shard_bytes;
        const uint64_t off = shard_start + uint64_t{i - shard * t->shard_wrs} * t->chunk;
        k = (r.first_nic + shard) % nics_;
        wr.local = r.src + off;
        wr.length = std::min(t->chunk, shard_end - off);
        wr.remote_addr = r.dst[k].base + off;
        wr.key = r.dst[k].key;
        wr.has_imm = r.has_imm && i == t->total - 1;
        // A piece on another NIC than the immediate-carrying last one: that NIC's connection
        // is not ordered with the last one's, so this piece must be in the target's memory,
        // not merely sent (tcp completes a write when it is sent), before the last goes out.
        wr.deliver = r.has_imm && i + 1 < t->total && shard != ShardOf(*t, t->total - 1);
        break;
      }
      case Kind::kPaged:
        k = (r.first_nic + i) % nics_;
        if (r.imm_once) {  // each NIC's last page: the pages that NIC carried (i / nics_ + 1)
          wr.has_imm = r.has_imm && i >= t->total - TailWrs(*t);
          wr.imm = WeightedImm(r.imm, r.imm_weight_mask, i / nics_ + 1);
        }
        wr.local = r.src + uint64_t{r.src_pages[i]} * r.src_stride;
        wr.length = r.length;
        wr.remote_addr = r.dst[k].base + uint64_t{r.dst_pages[i]} * r.dst_stride;
        wr.key = r.dst[k].key;
        break;
      case Kind::kScatter: {
        const ScatterTarget& target = r.targets[i];
        const ScatterMember& m = r.plan->members[target.member];
        k = m.nic;
        wr.local = r.plan->src + target.src_offset;
        wr.length = target.length;
        wr.local_desc = r.plan->src_desc[k];
        wr.peer_addr = m.addr;
        wr.remote_addr = m.base + target.dst_offset;
        wr.key = m.key;
        *nic = k;
        return domains_[k]->PostWrite(wr, error);
      }
      case Kind::kBarrier: {
        k = i % nics_;
        const PeerEntry& p = r.peers[r.group->members[i]];
        wr.peer_addr = p.addr[k];
        wr.remote_addr = p.sink[k].base;
        wr.key = p.sink[k].key;
        *nic = k;
        return domains_[k]->PostWrite(wr, error);
      }
      case Kind::kImm:
        wr.remote_addr = r.entry->sink[k].base;
        wr.key = r.entry->sink[k].key;
        break;
      case Kind::kSend:
        *nic = k;
        return domains_[k]->PostSend(r.src, r.length, r.src_desc[k], r.entry->addr[k],
                                     &slot->ctx, error);
      case Kind::kNotify:
      case Kind::kDisarm: break;
    }
    // Single-peer writes.
    wr.local_desc = r.src_desc[k];
    wr.peer_addr = r.entry->addr[k];
    *nic = k;
    return domains_[k]->PostWrite(wr, error);
  }

  size_t PollCompletions() {
    DomainCompletion batch[32];
    size_t total = 0;
    for (uint32_t k = 0; k < nics_; ++k) {
      for (;;) {
        size_t n = domains_[k]->Poll(batch);
        for (size_t i = 0; i < n; ++i) Complete(batch[i], k);
        total += n;
        if (n < std::size(batch)) break;
      }
    }
    return total;
  }

  bool IsRecvSlot(const OpContext* ctx) const {
    auto* p = reinterpret_cast<const RecvSlot*>(ctx);
    return p >= recv_slots_.get() && p < recv_slots_.get() + num_recv_slots_;
  }

  void Complete(DomainCompletion& c, uint32_t nic) {
    if (c.context && IsRecvSlot(c.context)) {
      auto* rs = reinterpret_cast<RecvSlot*>(c.context);
      if (c.error.ok()) {
        if (c.kind == CompletionKind::kRemoteImm) {
          CountImm(c.imm);
        } else {
          OnMessage(c, rs->index, nic);
        }
      }
      if (!stop_.load(std::memory_order_relaxed)) {
        Status s = PostRecvSlot(rs->index);
        (void)s;  // a receive we cannot re-post shrinks the pool; messages still flow
      }
      return;
    }
    if (c.kind == CompletionKind::kRemoteImm) {
      if (c.has_imm) CountImm(c.imm);
      return;
    }
    if (!c.context) return;
    auto* slot = reinterpret_cast<WrSlot*>(c.context);
    Transfer* t = slot->transfer;
    free_wrs_.push_back(slot);
    --t->outstanding;
    if (!c.error.ok() && t->error.ok()) {
      t->error = c.error.WithContext(Describe(t));
      t->next = t->total;  // post nothing more of a failed transfer
    }
    if (t->req.kind == Kind::kSend && t->outstanding == 0) {
      uint32_t index = t->req.send_buffer;
      free_send_buffers_.TryPush(std::move(index));
    }
    if (t->tail_deferred && t->outstanding == 0 && t->error.ok()) {
      t->tail_deferred = false;
      Enqueue(t);
      return;
    }
    MaybeFinish(t);
  }

  std::string Describe(const Transfer* t) const {
    static constexpr const char* kNames[] = {"write",     "paged write", "scatter", "barrier",
                                             "immediate", "send",        "notify",  "disarm"};
    std::string s = kNames[static_cast<int>(t->req.kind)];
    switch (t->req.kind) {
      case Kind::kSingle:
      case Kind::kPaged:
      case Kind::kImm:
      case Kind::kSend: s += " to " + PeerName(t->req.peer); break;
      default: s += " of " + std::to_string(t->total) + " WRs"; break;
    }
    return s;
  }

  void CountImm(uint32_t imm) {
    Stats::Add(stats_.imms);
    uint64_t weight = 1;
    ImmCounterTable::Slot* slot = counters_.FindWeighted(imm, &weight);
    if (!slot) {
      Stats::Add(stats_.imms_unmatched);
      if (unmatched_handler_) unmatched_handler_(imm);
      return;
    }
    uint64_t now = slot->count.fetch_add(weight, std::memory_order_acq_rel) + weight;
    if (slot->armed && now >= slot->target) FireNotify(slot, Status::Ok());
  }

  void OnMessage(const DomainCompletion& c, uint32_t index, uint32_t nic) {
    Stats::Add(stats_.messages);
    if (!message_handler_) return;
    std::optional<PeerId> from;
    auto it = peer_by_addr_.find(PeerKey(nic, c.src_addr));
    if (c.src_addr != kNoPeerAddr && it != peer_by_addr_.end()) from = it->second;
    const uint8_t* data = recv_buffers_.data() + uint64_t{index} * options_.message_bytes;
    message_handler_(from, std::span<const uint8_t>(data, c.length));
  }

  Status PostRecvSlot(uint32_t index) {
    uint8_t* data = recv_buffers_.data() + uint64_t{index} * options_.message_bytes;
    Status error;
    for (int attempt = 0;; ++attempt) {
      const uint32_t nic = recv_slots_[index].nic;
      PostResult r = domains_[nic]->PostRecv(data, options_.message_bytes,
                                             recv_reg_.per_nic[nic].local_desc,
                                       &recv_slots_[index].ctx, &error);
      if (r == PostResult::kPosted) return Status::Ok();
      if (r == PostResult::kError || attempt > 1000) return error;
    }
  }

  void Arm(Request&& r) {
    ImmCounterTable::Slot* slot = r.slot;
    if (slot->armed) {
      r.done.Finish(FailedPreconditionError("immediate counter " + std::to_string(r.imm) +
                                            " already has a notification armed"));
      return;
    }
    if (slot->count.load(std::memory_order_acquire) >= r.target) {
      r.done.Finish(Status::Ok());
      return;
    }
    slot->armed = true;
    slot->target = r.target;
    slot->deadline = r.deadline;
    slot->on_reached = std::move(r.done);
    armed_.push_back(slot);
  }

  void FireNotify(ImmCounterTable::Slot* slot, const Status& status) {
    slot->armed = false;
    auto it = std::find(armed_.begin(), armed_.end(), slot);
    if (it != armed_.end()) {
      *it = armed_.back();
      armed_.pop_back();
    }
    Completion done = std::move(slot->on_reached);
    done.Finish(status);
  }

  void Fail(Transfer* t, const Status& status) {
    if (t->error.ok()) t->error = status.WithContext(Describe(t));
    t->next = t->total;
    t->tail_deferred = false;
    MaybeFinish(t);
  }

  // Finishes a transfer once nothing is left to post; releases its slot once nothing is left
  // outstanding.
  void MaybeFinish(Transfer* t) {
    if (t->next < t->total || t->tail_deferred) return;
    if (!t->finished) {
      if (t->outstanding == 0 || !t->error.ok()) Finish(t, t->error);  // releases when idle
    } else if (t->outstanding == 0 && !t->queued) {
      Release(t);
    }
  }

  void Finish(Transfer* t, const Status& status) {
    if (abandoned_.load(std::memory_order_relaxed)) return;  // the owner may be gone
    t->finished = true;
    t->next = t->total;
    if (status.ok()) {
      Stats::Add(stats_.completed);
    } else {
      Stats::Add(stats_.failed);
    }
    t->req.done.Finish(status);
    if (t->outstanding == 0 && !t->queued) Release(t);
  }

  void Release(Transfer* t) {
    if (t->active_prev) t->active_prev->active_next = t->active_next;
    if (t->active_next) t->active_next->active_prev = t->active_prev;
    if (active_ == t) active_ = t->active_next;
    t->active_prev = t->active_next = nullptr;
    t->req = Request{};
    free_transfers_.push_back(t);
    inflight_.fetch_sub(1, std::memory_order_acq_rel);
  }

  static bool SinglePeer(const Transfer* t) {
    return t->req.kind == Kind::kSingle || t->req.kind == Kind::kPaged ||
           t->req.kind == Kind::kImm || t->req.kind == Kind::kSend;
  }

  // Finishing a transfer may release it (unlinking it from the active list), so failures are
  // collected first and applied after the walk.
  void FailCollected(const Status& why) {
    for (Transfer* t : scratch_) {
      if (t->finished) continue;
      if (t->error.ok()) t->error = why;
      t->next = t->total;
      t->tail_deferred = false;
      Finish(t, t->error);
    }
    scratch_.clear();
  }

  // Single-peer transfers of a lost peer fail at once; multi-peer ones by their own deadline.
  void MarkPeerLost(PeerId peer, const Status& why) {
    peers_[peer].lost.store(true, std::memory_order_release);
    for (Transfer* t = active_; t; t = t->active_next) {
      if (!t->finished && SinglePeer(t) && t->req.peer == peer) scratch_.push_back(t);
    }
    FailCollected(why);
  }

  void ScanDeadlines(Clock::time_point now) {
    std::vector<Transfer*> expired;  // rare path: a transfer timed out
    for (Transfer* t = active_; t; t = t->active_next) {
      if (!t->finished && now >= t->deadline) expired.push_back(t);
    }
    for (Transfer* t : expired) {
      if (t->finished) continue;
      Status why = DeadlineExceededError(
          Describe(t) + " not completed within " + std::to_string(options_.transfer_timeout_ms) +
          " ms (" + std::to_string(t->next) + " of " + std::to_string(t->total) +
          " WRs posted, " + std::to_string(t->outstanding) + " outstanding)");
      scratch_.push_back(t);
      FailCollected(why);
      if (SinglePeer(t)) MarkPeerLost(t->req.peer, why);
    }
    for (size_t i = armed_.size(); i > 0; --i) {
      ImmCounterTable::Slot* slot = armed_[i - 1];
      if (now >= slot->deadline) {
        FireNotify(slot, DeadlineExceededError(
                             "immediate counter " + std::to_string(slot->imm) + ": expected " +
                             std::to_string(slot->target) + ", seen " +
                             std::to_string(slot->count.load(std::memory_order_acquire))));
      }
    }
  }

  // Worker exit: everything still owed a completion gets Cancelled.
  void Drain() {
    Status cancelled = CancelledError("engine shut down");
    Request r;
    while (queue_.TryPop(r)) {
      if (r.kind == Kind::kNotify || r.kind == Kind::kDisarm) {
        r.done.Finish(cancelled);
        continue;
      }
      Stats::Add(stats_.failed);
      r.done.Finish(cancelled);
      inflight_.fetch_sub(1, std::memory_order_acq_rel);
    }
    for (Transfer* t = active_; t; t = t->active_next) {
      if (!t->finished) {
        t->finished = true;
        Stats::Add(stats_.failed);
        t->req.done.Finish(cancelled);
      }
    }
    while (!armed_.empty()) FireNotify(armed_.back(), cancelled);
    std::deque<std::function<void()>> ops;
    {
      std::lock_guard<std::mutex> lock(control_mu_);
      worker_running_ = false;
      ops.swap(control_);
    }
    // Control ops that raced with shutdown still run: they only touch the domain, which lives on.
    for (auto& op : ops) op();
  }

  // Stops the worker. Returns false if it did not exit within shutdown_timeout_ms: it is stuck
  // inside a provider call (seen with shm when a peer died holding its shared-memory lock). The
  // engine is then abandoned: the thread is detached, and the caller must leak this object,
  // because the thread may still touch it if the provider call ever returns.
  bool Stop() {
    {
      std::lock_guard<std::mutex> lock(owner_->mu);
      owner_->engine = nullptr;  // regions released from now on just forget their handles
    }
    stopping_.store(true, std::memory_order_release);
    stop_.store(true, std::memory_order_release);
    wake_word_.fetch_add(1, std::memory_order_release);
    Futex::WakeOne(&wake_word_);
    if (!worker_.joinable()) return true;
    std::unique_lock<std::mutex> lock(exit_mu_);
    if (exit_cv_.wait_for(lock, std::chrono::milliseconds(options_.shutdown_timeout_ms),
                          [&] { return worker_exited_; })) {
      lock.unlock();
      worker_.join();
      return true;
    }
    abandoned_.store(true, std::memory_order_release);
    lock.unlock();
    worker_.detach();
    std::fprintf(stderr,
                 "ferry: engine worker did not stop within %u ms: stuck in a provider call; "
                 "abandoning the engine (its memory is leaked, %u transfers never complete)\n",
                 options_.shutdown_timeout_ms, inflight_.load());
    return false;
  }

  const EngineOptions options_;
  std::vector<std::unique_ptr<Domain>> domains_;  // the domain group: one per NIC
  const uint32_t nics_;
  FabricInfo info_;
  std::atomic<uint32_t> next_nic_{0};
  uint64_t id_ = 0;
  uint64_t max_chunk_ = 0;
  std::vector<uint8_t> address_;

  BoundedQueue<Request> queue_;
  std::atomic<uint32_t> inflight_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<uint32_t> wake_word_{0};

  // Peers, groups and plans: append-only tables, entries immutable once published by the count.
  std::mutex add_mu_;  // serialises appends
  std::unique_ptr<PeerEntry[]> peers_;
  std::atomic<uint32_t> num_peers_{0};
  std::vector<std::unique_ptr<PeerGroup>> groups_;
  std::atomic<uint32_t> num_groups_{0};
  std::vector<std::unique_ptr<ScatterPlan>> plans_;
  std::atomic<uint32_t> num_plans_{0};

  // Buffers for immediates and messages.
  std::vector<uint8_t> sink_;
  MultiRegistration sink_reg_;
  std::vector<uint8_t> recv_buffers_;
  MultiRegistration recv_reg_;
  std::unique_ptr<RecvSlot[]> recv_slots_;
  uint32_t num_recv_slots_ = 0;
  std::vector<uint8_t> send_buffers_;
  MultiRegistration send_reg_;
  // Registrations of user regions, keyed by the handle their MemoryRegion holds.
  std::mutex regs_mu_;
  std::unordered_map<MultiRegistration*, std::unique_ptr<MultiRegistration>> regs_;
  BoundedQueue<uint32_t> free_send_buffers_;

  ImmCounterTable counters_;
  std::shared_ptr<RegistrationOwner> owner_;

  // Worker-owned state.
  std::unique_ptr<Transfer[]> transfers_;
  std::vector<Transfer*> free_transfers_;
  Transfer* active_ = nullptr;
  std::vector<Transfer*> pending_;  // ring of transfers with WRs left to post
  size_t pending_head_ = 0;
  size_t pending_size_ = 0;
  std::unique_ptr<WrSlot[]> wr_slots_;
  size_t wr_count_ = 0;
  std::vector<WrSlot*> free_wrs_;
  std::vector<Transfer*> scratch_;  // reserved to max_transfers: failing many never allocates
  std::unordered_map<uint64_t, PeerId> peer_by_addr_;
  std::vector<ImmCounterTable::Slot*> armed_;  // reserved to max_imm_counters: never allocates
  MessageHandler message_handler_;
  UnmatchedImmHandler unmatched_handler_;

  struct Stats {
    std::atomic<uint64_t> submitted{0}, completed{0}, failed{0}, wrs_posted{0}, post_retries{0},
        imm_waits{0}, imms{0}, imms_unmatched{0}, messages{0}, sleeps{0};
    std::array<std::atomic<uint64_t>, kMaxNics> wrs_per_nic{};
    // The worker's own counters: one writer, so a load and a store, not an atomic add.
    static void Add(std::atomic<uint64_t>& counter, uint64_t n = 1) {
      counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    }
  } stats_;

  // Control operations for the worker.
  std::mutex control_mu_;
  std::condition_variable control_cv_;
  std::deque<std::function<void()>> control_;
  std::atomic<bool> control_pending_{false};
  bool worker_running_ = true;

  std::mutex exit_mu_;
  std::condition_variable exit_cv_;
  bool worker_exited_ = false;
  std::atomic<bool> abandoned_{false};

  std::thread worker_;  // last: starts after everything above exists
};

}  // namespace
}  // namespace fabric

namespace fabric {

// What Create hands out: forwards to the Engine and decides, at destruction, whether the Engine
// can be freed (its worker stopped) or must be leaked (its worker is wedged in the provider).
class EngineHandle final : public TransferEngine {
 public:
  explicit EngineHandle(std::unique_ptr<Engine> engine) : e_(engine.release()) {}
  ~EngineHandle() override {
    if (e_->StopWorker()) delete e_;
  }
  const FabricInfo& info() const override { return e_->info(); }
  const EngineOptions& options() const override { return e_->options(); }
  uint64_t id() const override { return e_->id(); }
  std::vector<uint8_t> Address() const override { return e_->Address(); }
  StatusOr<MemoryRegion> RegisterMemory(void* data, uint64_t length, MemoryKind kind,
                                        int device) override {
    return e_->RegisterMemory(data, length, kind, device);
  }
  StatusOr<PeerId> AddPeer(std::span<const uint8_t> address) override {
    return e_->AddPeer(address);
  }
  Status RemovePeer(PeerId peer) override { return e_->RemovePeer(peer); }
  StatusOr<GroupId> AddPeerGroup(std::span<const PeerId> members) override {
    return e_->AddPeerGroup(members);
  }
  StatusOr<ScatterPlanId> PrepareScatter(GroupId group, const MemoryRegion& src,
                                         std::span<const RemoteRegion> dst) override {
    return e_->PrepareScatter(group, src, dst);
  }
  Status Write(const SingleWrite& w, Completion done) override {
    return e_->Write(w, std::move(done));
  }
  Status WritePaged(const PagedWrite& w, Completion done) override {
    return e_->WritePaged(w, std::move(done));
  }
  Status Scatter(const ScatterWrite& w, Completion done) override {
    return e_->Scatter(w, std::move(done));
  }
  Status Barrier(GroupId group, uint32_t imm, Completion done) override {
    return e_->Barrier(group, imm, std::move(done));
  }
  Status WriteImm(PeerId peer, uint32_t imm, Completion done) override {
    return e_->WriteImm(peer, imm, std::move(done));
  }
  Status Send(PeerId peer, std::span<const uint8_t> message, Completion done) override {
    return e_->Send(peer, message, std::move(done));
  }
  void SetMessageHandler(MessageHandler handler) override {
    e_->SetMessageHandler(std::move(handler));
  }
  Status CreateImmCounter(uint32_t imm) override { return e_->CreateImmCounter(imm); }
  Status CreateWeightedImmCounter(uint32_t imm, uint32_t weight_mask) override {
    return e_->CreateWeightedImmCounter(imm, weight_mask);
  }
  StatusOr<uint64_t> ImmCount(uint32_t imm) const override { return e_->ImmCount(imm); }
  Status WaitImm(uint32_t imm, uint64_t target, Deadline deadline) const override {
    return e_->WaitImm(imm, target, deadline);
  }
  Status NotifyImm(uint32_t imm, uint64_t target, Deadline deadline,
                   DoneCallback done) override {
    return e_->NotifyImm(imm, target, deadline, std::move(done));
  }
  Status ConsumeImm(uint32_t imm, uint64_t n) override { return e_->ConsumeImm(imm, n); }
  Status DisarmImm(uint32_t imm) override { return e_->DisarmImm(imm); }
  void SetUnmatchedImmHandler(UnmatchedImmHandler handler) override {
    e_->SetUnmatchedImmHandler(std::move(handler));
  }
  EngineStats stats() const override { return e_->stats(); }

 protected:
  void Deregister(MemoryRegion&) override {}  // regions point at the Engine, never the handle

 private:
  Engine* e_;  // owned; leaked on purpose when its worker cannot be stopped
};

StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomains(
    const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains) {
  if (domains.empty() || domains.size() > kMaxNics) {
    return InvalidArgumentError("an engine drives 1 to " + std::to_string(kMaxNics) +
                                " NICs, not " + std::to_string(domains.size()));
  }
  for (size_t k = 1; k < domains.size(); ++k) {
    if (domains[k]->info().provider != domains[0]->info().provider) {
      return InvalidArgumentError("the NICs of one engine must share a provider");
    }
  }
  auto engine = std::make_unique<Engine>(options, std::move(domains));
  Status s = engine->Init();
  if (!s.ok()) {
    if (!engine->StopWorker()) (void)engine.release();
    return s;
  }
  return std::unique_ptr<TransferEngine>(new EngineHandle(std::move(engine)));
}

StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomain(const EngineOptions& options,
                                                                 std::unique_ptr<Domain> domain) {
  std::vector<std::unique_ptr<Domain>> domains;
  domains.push_back(std::move(domain));
  return CreateEngineWithDomains(options, std::move(domains));
}

}  // namespace fabric

StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options) {
  if (options.max_transfers == 0 || options.submit_queue_depth == 0 ||
      options.max_outstanding_wrs == 0 || options.max_peers == 0 || options.message_bytes == 0) {
    return InvalidArgumentError("EngineOptions: queue depths, pools and message_bytes must be > 0");
  }
  ASSIGN_OR_RETURN(auto domains, fabric::OpenDomains(options));
  return fabric::CreateEngineWithDomains(options, std::move(domains));
}

}  // namespace ferry
