// The TransferEngine's caller side: construction, registration, peers, submission and the
// immediate counters, each checked on the caller's thread and handed to the worker
// (engine_worker.cc) through the submission queue or a control operation; then the handle
// Create returns. The design: engine.h.
#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "common/leak.h"
#include "fabric/engine.h"
#include "fabric/wire.h"

namespace ferry {
namespace fabric {
namespace {

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

}  // namespace

Engine::Engine(const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains)
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

Engine::~Engine() {
  // Close the endpoints while the WR contexts and buffers they may still reference exist.
  domains_.clear();
}

Status Engine::Init() {
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
  recv_slots_ = std::make_unique<PostedRecv[]>(num_recv_slots_);
  for (uint32_t i = 0; i < num_recv_slots_; ++i) {
    recv_slots_[i].index = i;
    recv_slots_[i].nic = i / rx;
    RETURN_IF_ERROR(PostRecvBuffer(i));
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

// ----- memory ------------------------------------------------------------------------------------

StatusOr<MemoryRegion> Engine::RegisterMemory(void* data, uint64_t length, MemoryKind kind,
                                              int device) {
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

void Engine::Deregister(MemoryRegion& region) {
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

StatusOr<MultiRegistration> Engine::RegisterAll(void* data, uint64_t length, MemoryKind kind,
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

void Engine::DeregisterAll(const MultiRegistration& reg) {
  for (uint32_t k = 0; k < reg.nics; ++k) domains_[k]->Deregister(reg.per_nic[k].handle);
}

// ----- peers -------------------------------------------------------------------------------------

StatusOr<PeerId> Engine::AddPeer(std::span<const uint8_t> address_bytes) {
  ASSIGN_OR_RETURN(EngineAddress address, EngineAddress::Parse(address_bytes));
  if (address.provider != info().provider) {
    return InvalidArgumentError("peer address is for provider '" + address.provider +
                                "', this engine uses '" + info().provider + "'");
  }
  std::lock_guard<std::mutex> lock(add_mu_);
  if (auto known = peer_by_engine_.find(address.engine_id); known != peer_by_engine_.end()) {
    const PeerId old = known->second;
    if (!peers_[PeerSlot(old)].lost.load(std::memory_order_acquire)) return old;
    // Lost, and back: the old entry goes first (its slot may serve the new one), so that no
    // provider address of the old connection outlives it beside the new one's.
    (void)RemovePeerLocked(old);
  }
  uint32_t slot;
  PeerId id;
  const bool reuse = !free_slots_.empty();
  if (reuse) {
    slot = free_slots_.back();
    id = peers_[slot].id.load(std::memory_order_relaxed) + kMaxPeerSlots;  // generation + 1
  } else {
    slot = num_slots_.load(std::memory_order_relaxed);
    if (slot >= options_.max_peers) {
      return ResourceExhaustedError("peer table full (" + std::to_string(options_.max_peers) +
                                    " peers; RemovePeer frees an entry)");
    }
    id = slot;
  }
  const uint32_t remote = static_cast<uint32_t>(address.nics.size());
  // Domain k inserts the peer NIC it sends to (k mod M) and every peer NIC that sends to it
  // (j mod N == k), so that messages name their sender.
  std::vector<std::pair<uint32_t, uint32_t>> links;  // (local NIC, peer NIC)
  for (uint32_t k = 0; k < nics_; ++k) links.push_back({k, k % remote});
  for (uint32_t j = 0; j < remote; ++j) {
    if ((j % nics_) % remote != j) links.push_back({j % nics_, j});
  }
  RETURN_IF_ERROR(
      RunOnWorker([this, address, links, slot, id, remote](ControlResult& out) -> Status {
        for (auto [k, j] : links) {
          auto addr = domains_[k]->InsertPeer(address.nics[j].name);
          if (!addr.ok()) {
            for (auto [k2, a2] : out.inserted) (void)domains_[k2]->RemovePeer(a2);
            return addr.status();
          }
          out.inserted.push_back({k, *addr});
        }
        PeerEntry& e = peers_[slot];
        for (auto [k, a] : out.inserted) peer_by_addr_[PeerKey(k, a)] = id;
        for (uint32_t k = 0; k < nics_; ++k) {
          e.addr[k] = out.inserted[k].second;  // the first nics_ links: (k, k mod remote)
          const NicAddress& to = address.nics[k % remote];
          e.sink[k] = {to.sink_base, to.sink_key};
        }
        e.inserted = out.inserted;
        e.remote_nics.store(remote, std::memory_order_relaxed);
        e.engine_id.store(address.engine_id, std::memory_order_relaxed);
        e.lost.store(false, std::memory_order_relaxed);
        e.id.store(id, std::memory_order_release);
        return Status::Ok();
      }).status());
  peers_[slot].removed = false;
  if (reuse) {
    free_slots_.pop_back();
  } else {
    num_slots_.store(slot + 1, std::memory_order_release);
  }
  peer_by_engine_[address.engine_id] = id;
  return id;
}

Status Engine::RemovePeer(PeerId peer) {
  std::lock_guard<std::mutex> lock(add_mu_);
  return RemovePeerLocked(peer);
}

Status Engine::RemovePeerLocked(PeerId peer) {
  Status current = CheckCurrent(peer);
  if (current.code() == StatusCode::kUnavailable) return Status::Ok();  // removed already
  RETURN_IF_ERROR(current);
  const uint32_t slot = PeerSlot(peer);
  PeerEntry& e = peers_[slot];
  if (e.removed) return Status::Ok();
  Status first = RunOnWorker([this, peer, &e](ControlResult&) -> Status {
                   MarkPeerLost(peer, UnavailableError(PeerName(peer) + " was removed"));
                   Status first;
                   auto inserted = std::exchange(e.inserted, {});
                   for (auto [k, addr] : inserted) {
                     peer_by_addr_.erase(PeerKey(k, addr));
                     Status s = domains_[k]->RemovePeer(addr);
                     if (first.ok()) first = s;
                   }
                   return first;
                 }).status();
  e.removed = true;
  const uint64_t engine = e.engine_id.load(std::memory_order_relaxed);
  if (auto it = peer_by_engine_.find(engine); it != peer_by_engine_.end() && it->second == peer) {
    peer_by_engine_.erase(it);
  }
  // A slot whose removal failed (its provider addresses may be left) is not used again.
  if (first.ok() && PeerGeneration(peer) < kMaxPeerGeneration) free_slots_.push_back(slot);
  return first;
}

StatusOr<bool> Engine::PeerLost(PeerId peer) const {
  Status current = CheckCurrent(peer);
  if (current.code() == StatusCode::kUnavailable) return true;  // removed: its slot moved on
  RETURN_IF_ERROR(current);
  return peers_[PeerSlot(peer)].lost.load(std::memory_order_acquire);
}

StatusOr<GroupId> Engine::AddPeerGroup(std::span<const PeerId> members) {
  if (members.empty()) return InvalidArgumentError("AddPeerGroup: no members");
  for (PeerId p : members) RETURN_IF_ERROR(CheckCurrent(p).WithContext("AddPeerGroup"));
  std::lock_guard<std::mutex> lock(add_mu_);
  uint32_t n = num_groups_.load(std::memory_order_relaxed);
  if (n >= options_.max_groups) return ResourceExhaustedError("peer group table full");
  groups_[n] = std::make_unique<PeerGroup>(PeerGroup{{members.begin(), members.end()}});
  num_groups_.store(n + 1, std::memory_order_release);
  return GroupId{n};
}

StatusOr<ScatterPlanId> Engine::PrepareScatter(GroupId group, const MemoryRegion& src,
                                               std::span<const RemoteRegion> dst) {
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
    const NicKey& to = dst[i].nics[k % dst[i].num_nics];  // CheckOwner: the peer's NIC count
    plan->members.push_back({p, k, to.base, to.key, dst[i].length});
  }
  std::lock_guard<std::mutex> lock(add_mu_);
  uint32_t n = num_plans_.load(std::memory_order_relaxed);
  if (n >= options_.max_scatter_plans) return ResourceExhaustedError("scatter plan table full");
  plans_[n] = std::move(plan);
  num_plans_.store(n + 1, std::memory_order_release);
  return ScatterPlanId{n};
}

// ----- submission --------------------------------------------------------------------------------

Status Engine::Write(const SingleWrite& w, Completion done) {
  RETURN_IF_ERROR(CheckEnds(w));
  if (w.length == 0 && !w.imm) {
    return InvalidArgumentError("Write: zero length and no immediate");
  }
  RETURN_IF_ERROR(CheckRange("src", w.src_offset, w.length, w.src->length()));
  RETURN_IF_ERROR(CheckRange("dst", w.dst_offset, w.length, w.dst.length));
  return Enqueue(WriteRequest(Kind::kSingle, w, w.length), std::move(done));
}

Status Engine::WritePaged(const PagedWrite& w, Completion done) {
  RETURN_IF_ERROR(CheckEnds(w));
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
  Request r = WriteRequest(Kind::kPaged, w, w.page_bytes);
  r.src_stride = w.src_stride;
  r.dst_stride = w.dst_stride;
  r.src_pages = w.src_pages.data();
  r.dst_pages = w.dst_pages.data();
  r.count = static_cast<uint32_t>(w.src_pages.size());
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

Status Engine::Scatter(const ScatterWrite& w, Completion done) {
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

Status Engine::Barrier(GroupId group, uint32_t imm, Completion done) {
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

Status Engine::WriteImm(PeerId peer, uint32_t imm, Completion done) {
  RETURN_IF_ERROR(CheckPeer(peer));
  Request r;
  r.kind = Kind::kImm;
  SetPeer(r, peer);
  SetImm(r, imm);
  return Enqueue(std::move(r), std::move(done));
}

Status Engine::Send(PeerId peer, std::span<const uint8_t> message, Completion done) {
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

void Engine::SetMessageHandler(MessageHandler handler) {
  SetOnWorker(&Engine::message_handler_, std::move(handler));
}

Status Engine::SetTaggedMessageHandler(uint32_t tag, MessageHandler handler) {
  // On the worker, which reads the table for every message: no lock on that path.
  return RunOnWorker([this, tag, handler = std::move(handler)](ControlResult&) mutable -> Status {
    auto& table = tagged_handlers_;
    auto it =
        std::find_if(table.begin(), table.end(), [&](const auto& e) { return e.first == tag; });
    if (!handler) {
      if (it != table.end()) table.erase(it);
      return Status::Ok();
    }
    if (it != table.end()) {
      return AlreadyExistsError("SetTaggedMessageHandler: tag " + std::to_string(tag) +
                                " has a handler already (give it up with a null one first)");
    }
    if (table.size() >= kMaxMessageTags) {
      return ResourceExhaustedError("SetTaggedMessageHandler: " +
                                    std::to_string(kMaxMessageTags) + " tags taken");
    }
    table.emplace_back(tag, std::move(handler));
    return Status::Ok();
  }).status();
}

// ----- immediate counters ------------------------------------------------------------------------

Status Engine::CreateWeightedImmCounter(uint32_t imm, uint32_t weight_mask) {
  if (weight_mask == 0) return InvalidArgumentError("CreateWeightedImmCounter: empty mask");
  return counters_.Create(imm, weight_mask);
}

StatusOr<uint64_t> Engine::ImmCount(uint32_t imm) const {
  ASSIGN_OR_RETURN(const ImmCounterTable::Slot* slot, Counter(imm));
  return slot->count.load(std::memory_order_acquire);
}

Status Engine::WaitImm(uint32_t imm, uint64_t target, Deadline deadline) const {
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

Status Engine::NotifyImm(uint32_t imm, uint64_t target, Deadline deadline, DoneCallback done) {
  ASSIGN_OR_RETURN(Request r, CounterRequest(Kind::kNotify, imm));
  r.target = target;
  r.deadline = deadline.at;
  return Push(std::move(r), Completion::Callback(std::move(done)));
}

Status Engine::MirrorImm(uint32_t imm, uint64_t* word) {
  if (reinterpret_cast<uintptr_t>(word) % alignof(uint64_t) != 0) {
    return InvalidArgumentError("MirrorImm: the word must be 8-byte aligned");
  }
  ASSIGN_OR_RETURN(ImmCounterTable::Slot* slot, Counter(imm));
  // On the worker, which owns the slot's mirror: once this returns, the old word is left alone.
  return RunOnWorker([this, slot, word](ControlResult&) -> Status {
           slot->mirror = word;
           if (word) StoreMirror(slot);
           return Status::Ok();
         })
      .status();
}

Status Engine::DisarmImm(uint32_t imm) {
  ASSIGN_OR_RETURN(Request r, CounterRequest(Kind::kDisarm, imm));
  return Push(std::move(r), Completion());
}

StatusOr<ImmCounterTable::Slot*> Engine::Counter(uint32_t imm) const {
  ImmCounterTable::Slot* slot = counters_.Find(imm);
  if (!slot) return NotFoundError("no immediate counter " + std::to_string(imm));
  return slot;
}

StatusOr<Request> Engine::CounterRequest(Kind kind, uint32_t imm) const {
  ASSIGN_OR_RETURN(ImmCounterTable::Slot* slot, Counter(imm));
  Request r;
  r.kind = kind;
  r.imm = imm;
  r.slot = slot;
  return r;
}

void Engine::SetUnmatchedImmHandler(UnmatchedImmHandler handler) {
  SetOnWorker(&Engine::unmatched_handler_, std::move(handler));
}

EngineStats Engine::stats() const {
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

// ----- validation (caller threads) ---------------------------------------------------------------

Status Engine::CheckLocal(const MemoryRegion* region) const {
  if (region == nullptr || !region->valid()) {
    return InvalidArgumentError("source region is null or not registered");
  }
  if (region->remote().engine_id != id_) {
    return InvalidArgumentError("source region was registered with another engine");
  }
  return Status::Ok();
}

Status Engine::CheckCurrent(PeerId peer) const {
  const uint32_t slot = PeerSlot(peer);
  if (slot < num_slots_.load(std::memory_order_acquire)) {
    const PeerId now = peers_[slot].id.load(std::memory_order_acquire);
    if (now == peer) return Status::Ok();
    if (PeerGeneration(peer) < PeerGeneration(now)) {
      return UnavailableError(PeerName(peer) + " was removed");
    }
  }
  return NotFoundError("unknown " + PeerName(peer));
}

Status Engine::CheckPeer(PeerId peer) const {
  RETURN_IF_ERROR(CheckCurrent(peer));
  if (peers_[PeerSlot(peer)].lost.load(std::memory_order_acquire)) {
    return UnavailableError(PeerName(peer) + " is lost");
  }
  return Status::Ok();
}

bool Engine::Usable(PeerId peer) const {
  const PeerEntry& e = peers_[PeerSlot(peer)];
  return e.id.load(std::memory_order_relaxed) == peer && !e.lost.load(std::memory_order_relaxed);
}

Status Engine::CheckOwner(PeerId peer, const RemoteRegion& region) const {
  RETURN_IF_ERROR(CheckCurrent(peer));
  const PeerEntry& e = peers_[PeerSlot(peer)];
  if (region.engine_id != e.engine_id.load(std::memory_order_relaxed)) {
    return InvalidArgumentError("region descriptor belongs to another engine than " +
                                PeerName(peer));
  }
  const uint32_t remote = e.remote_nics.load(std::memory_order_relaxed);
  if (region.num_nics != remote) {
    return InvalidArgumentError("region descriptor has " + std::to_string(region.num_nics) +
                                " NIC entries but " + PeerName(peer) + " has " +
                                std::to_string(remote) + " NICs");
  }
  return Status::Ok();
}

template <typename W>
Status Engine::CheckEnds(const W& w) const {
  RETURN_IF_ERROR(CheckLocal(w.src));
  RETURN_IF_ERROR(CheckPeer(w.peer));
  return CheckOwner(w.peer, w.dst);
}

template <typename W>
Request Engine::WriteRequest(Kind kind, const W& w, uint64_t length) {
  Request r;
  r.kind = kind;
  SetPeer(r, w.peer);
  r.src = static_cast<const uint8_t*>(w.src->data()) + w.src_offset;
  r.src_desc = LocalDescs(*w.src);
  SetDst(r, w.dst, w.dst_offset);
  r.length = length;
  SetImm(r, w.imm);
  return r;
}

Descs Engine::LocalDescs(const MemoryRegion& region) const {
  Descs d{};
  for (uint32_t k = 0; k < nics_; ++k) d[k] = region.local_desc(k);
  return d;
}

void Engine::SetDst(Request& r, const RemoteRegion& dst, uint64_t offset) const {
  const uint32_t remote = dst.num_nics;  // CheckOwner: the peer's NIC count
  for (uint32_t k = 0; k < nics_; ++k) {
    const NicKey& to = dst.nics[k % remote];
    r.dst[k] = {to.base + offset, to.key};
  }
}

StatusOr<const PeerGroup*> Engine::FindGroup(GroupId group) const {
  if (group >= num_groups_.load(std::memory_order_acquire)) {
    return NotFoundError("unknown peer group " + std::to_string(group));
  }
  return groups_[group].get();
}

void Engine::SetPeer(Request& r, PeerId peer) {
  r.peer = peer;
  r.entry = &peers_[PeerSlot(peer)];
  r.first_nic = NextNic();
}

uint32_t Engine::NextNic() {
  if (nics_ == 1) return 0;
  return next_nic_.fetch_add(1, std::memory_order_relaxed) % nics_;
}

void Engine::SetImm(Request& r, std::optional<uint32_t> imm) {
  r.has_imm = imm.has_value();
  r.imm = imm.value_or(0);
}

Status Engine::Enqueue(Request&& r, Completion&& done) {
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

Status Engine::Push(Request&& r, Completion&& done) {
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

void Engine::WakeWorker() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_relaxed)) {
    wake_word_.fetch_add(1, std::memory_order_release);
    Futex::WakeOne(&wake_word_);
  }
}

StatusOr<Engine::ControlResult> Engine::RunOnWorker(ControlFn fn) {
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

template <typename Handler>
void Engine::SetOnWorker(Handler Engine::*field, Handler handler) {
  // The interface returns nothing: a worker that is not running calls no handler, and one wedged
  // in a provider call past control_timeout_ms skips the change (RunOnWorker).
  (void)RunOnWorker([this, field, handler = std::move(handler)](ControlResult&) -> Status {
    this->*field = handler;
    return Status::Ok();
  });
}

// What Create hands out: forwards to the Engine and decides, at destruction, whether the Engine
// can be freed (its worker stopped) or must be leaked (its worker is wedged in the provider).
class EngineHandle final : public TransferEngine {
 public:
  explicit EngineHandle(std::unique_ptr<Engine> engine) : e_(engine.release()) {}
  ~EngineHandle() override {
    if (e_->StopWorker()) {
      delete e_;
    } else {
      LeakOnPurpose(e_);  // its worker is still inside the provider
    }
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
  StatusOr<bool> PeerLost(PeerId peer) const override { return e_->PeerLost(peer); }
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
  Status SetTaggedMessageHandler(uint32_t tag, MessageHandler handler) override {
    return e_->SetTaggedMessageHandler(tag, std::move(handler));
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
  Status MirrorImm(uint32_t imm, uint64_t* word) override { return e_->MirrorImm(imm, word); }
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
  if (options.max_peers == 0 || options.max_peers > kMaxPeerSlots) {
    return InvalidArgumentError("EngineOptions: max_peers must be in [1, " +
                                std::to_string(kMaxPeerSlots) + "]");
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
  if (options.max_peers > fabric::kMaxPeerSlots) {  // before the NICs open
    return InvalidArgumentError("EngineOptions: max_peers above " +
                                std::to_string(fabric::kMaxPeerSlots));
  }
  ASSIGN_OR_RETURN(auto domains, fabric::OpenDomains(options));
  return fabric::CreateEngineWithDomains(options, std::move(domains));
}

}  // namespace ferry
