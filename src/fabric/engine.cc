// The engine's caller-side machinery that TransferEngine's methods (transfer_engine.cc) use:
// construction, the checks of peers and regions, the requests they build and how they reach
// the worker (engine_worker.cc): the submission queue or a control operation. The design:
// engine.h.
#include "fabric/engine.h"

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "common/leak.h"
#include "fabric/wire.h"

namespace ferry {
namespace fabric {

Engine::Engine(const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains)
    : options_(options),
      domains_(std::move(domains)),
      nics_(static_cast<uint32_t>(domains_.size())),
      queue_(options.submit_queue_depth),
      free_send_buffers_(std::max<uint32_t>(options.num_send_buffers, 1)),
      counters_(options.max_imm_counters),
      owner_(std::make_shared<RegistrationOwner>()) {
  std::random_device rd;
  id_ = (uint64_t{rd()} << 32 | rd()) | 1;  // never 0
}

Engine::~Engine() {
  // Close the endpoints while the WR contexts and buffers they may still reference exist.
  domains_.clear();
}

Status Engine::Init() {
  // What the engine adapts to comes from the domains' capabilities; their FabricInfo is kept
  // for logs, with the group's figures in place of the first NIC's.
  const DomainCaps& first = domains_[0]->caps();
  info_ = domains_[0]->info();
  info_.provider = first.provider;
  info_.domain = first.name;
  info_.num_nics = nics_;
  info_.ordered_write_bytes = first.ordered_write_bytes;
  max_chunk_ = uint64_t{1} << 30;
  uint64_t tx_total = 0;
  for (uint32_t k = 0; k < nics_; ++k) {
    const DomainCaps& caps = domains_[k]->caps();
    if (k > 0) info_.domain += "," + caps.name;
    max_chunk_ = std::min<uint64_t>(max_chunk_, caps.max_msg_bytes);
    info_.ordered_write_bytes = std::min(info_.ordered_write_bytes, caps.ordered_write_bytes);
    tx_total += caps.send_depth > 0 ? caps.send_depth : options_.max_outstanding_wrs;
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
    size_t rx_size = domains_[k]->caps().recv_depth;
    if (rx_size > 0) rx = std::min<uint32_t>(rx, static_cast<uint32_t>(rx_size));
  }
  num_recv_slots_ = rx * nics_;
  recv_buffers_.resize(uint64_t{num_recv_slots_} * options_.message_bytes);
  ASSIGN_OR_RETURN(recv_reg_,
                   RegisterAll(recv_buffers_.data(), recv_buffers_.size(), MemoryKind::kHost, 0));
  recv_slots_ = std::make_unique<PostedRecv[]>(num_recv_slots_);
  for (uint32_t i = 0; i < num_recv_slots_; ++i) {
    recv_slots_[i].index = i;
    recv_slots_[i].nic = i / rx;
    RETURN_IF_ERROR(PostRecvBuffer(i));
  }
  send_buffers_.resize(uint64_t{options_.num_send_buffers} * options_.message_bytes);
  if (!send_buffers_.empty()) {
    ASSIGN_OR_RETURN(send_reg_,
                     RegisterAll(send_buffers_.data(), send_buffers_.size(), MemoryKind::kHost, 0));
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

// ----- submission --------------------------------------------------------------------------------

// ----- immediate counters ------------------------------------------------------------------------

StatusOr<ImmCounterTable::Slot*> Engine::Counter(uint32_t imm) const {
  ImmCounterTable::Slot* slot = counters_.Find(imm);
  if (!slot) return NotFoundError("no immediate counter " + std::to_string(imm));
  return slot;
}

StatusOr<Request> Engine::CounterRequest(Kind kind, uint32_t imm) const {
  ASSIGN_OR_RETURN(ImmCounterTable::Slot * slot, Counter(imm));
  Request r;
  r.kind = kind;
  r.imm = imm;
  r.slot = slot;
  return r;
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

StatusOr<std::unique_ptr<PeerGroup>> Engine::BuildGroup(std::span<const PeerId> members) const {
  if (members.empty()) return InvalidArgumentError("peer group: no members");
  for (PeerId p : members) RETURN_IF_ERROR(CheckCurrent(p).WithContext("peer group"));
  return std::make_unique<PeerGroup>(PeerGroup{{members.begin(), members.end()}});
}

StatusOr<std::unique_ptr<ScatterPlan>> Engine::BuildPlan(GroupId group, const MemoryRegion& src,
                                                         std::span<const RemoteRegion> dst) const {
  RETURN_IF_ERROR(CheckLocal(&src));
  ASSIGN_OR_RETURN(const PeerGroup* g, FindGroup(group));
  if (dst.size() != g->members.size()) {
    return InvalidArgumentError("scatter plan: " + std::to_string(dst.size()) +
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
  return plan;
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
    return ResourceExhaustedError("submission queue full (" + std::to_string(queue_.capacity()) +
                                  " requests)");
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
    MutexLock lock(control_mu_);
    if (!worker_running_) return CancelledError("engine worker is not running");
    if (control_stuck_) {
      return DeadlineExceededError(
          "engine worker is stuck: a control operation timed out and it has not taken one up "
          "since (is it stuck in a provider call?)");
    }
    control_.push_back([op, this] {
      {
        MutexLock l(control_mu_);
        control_stuck_ = false;  // the worker takes control operations up again
        if (op->abandoned) return;
      }
      Status s = op->fn(op->out);
      MutexLock l(control_mu_);
      op->result = std::move(s);
      op->done = true;
      control_cv_.notify_all();
    });
    control_pending_.store(true, std::memory_order_release);
  }
  WakeWorker();
  MutexLock lock(control_mu_);
  if (!control_cv_.wait_for(lock, std::chrono::milliseconds(options_.control_timeout_ms),
                            [&] { return op->done; })) {
    op->abandoned = true;
    control_stuck_ = true;
    return DeadlineExceededError("engine worker did not run a control operation within " +
                                 std::to_string(options_.control_timeout_ms) +
                                 " ms (is it stuck in a provider call?)");
  }
  if (!op->result.ok()) return op->result;
  return op->out;
}

StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomains(
    const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains) {
  if (domains.empty() || domains.size() > kMaxNics) {
    return InvalidArgumentError("an engine drives 1 to " + std::to_string(kMaxNics) +
                                " NICs, not " + std::to_string(domains.size()));
  }
  for (size_t k = 1; k < domains.size(); ++k) {
    if (domains[k]->caps().provider != domains[0]->caps().provider) {
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
  return Engine::Wrap(std::move(engine));
}

StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomain(const EngineOptions& options,
                                                                 std::unique_ptr<Domain> domain) {
  std::vector<std::unique_ptr<Domain>> domains;
  domains.push_back(std::move(domain));
  return CreateEngineWithDomains(options, std::move(domains));
}

}  // namespace fabric

}  // namespace ferry
