// TransferEngine's peers (ferry/fabric.h): adding and forgetting them, their traffic, the groups
// of them and the scatter plans over a group, checked on the caller's thread as
// transfer_engine.cc checks the transfers.
#include <string>
#include <vector>

#include "fabric/engine.h"
#include "fabric/wire.h"

namespace ferry {

using namespace fabric;  // NOLINT(build/namespaces)

StatusOr<PeerId> TransferEngine::AddPeer(std::span<const uint8_t> address_bytes) {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(EngineAddress address, EngineAddress::Parse(address_bytes));
  if (address.provider != info().provider) {
    return InvalidArgumentError("peer address is for provider '" + address.provider +
                                "', this engine uses '" + info().provider + "'");
  }
  MutexLock lock(impl->add_mu_);
  if (auto known = impl->peer_by_engine_.find(address.engine_id);
      known != impl->peer_by_engine_.end()) {
    const PeerId old = known->second;
    if (!impl->peers_[PeerSlot(old)].lost.load(std::memory_order_acquire)) return old;
    // Lost, and back: the old entry goes first (its slot may serve the new one), so that no
    // provider address of the old connection outlives it beside the new one's.
    (void)impl->RemovePeerLocked(old);
  }
  uint32_t slot;
  PeerId id;
  const bool reuse = !impl->free_slots_.empty();
  if (reuse) {
    slot = impl->free_slots_.back();
    id = impl->peers_[slot].id.load(std::memory_order_relaxed) + kMaxPeerSlots;  // generation + 1
  } else {
    slot = impl->num_slots_.load(std::memory_order_relaxed);
    if (slot >= impl->options_.max_peers) {
      return ResourceExhaustedError("peer table full (" + std::to_string(impl->options_.max_peers) +
                                    " peers; RemovePeer frees an entry)");
    }
    id = slot;
  }
  const uint32_t remote = static_cast<uint32_t>(address.nics.size());
  // Domain k inserts the peer NIC it sends to (k mod M) and every peer NIC that sends to it
  // (j mod N == k), so that messages name their sender.
  std::vector<std::pair<uint32_t, uint32_t>> links;  // (local NIC, peer NIC)
  for (uint32_t k = 0; k < impl->nics_; ++k) links.push_back({k, k % remote});
  for (uint32_t j = 0; j < remote; ++j) {
    if ((j % impl->nics_) % remote != j) links.push_back({j % impl->nics_, j});
  }
  RETURN_IF_ERROR(impl->RunOnWorker([impl, address, links, slot, id,
                                     remote](Engine::ControlResult& out) -> Status {
                        for (auto [k, j] : links) {
                          auto addr = impl->domains_[k]->InsertPeer(address.nics[j].name);
                          if (!addr.ok()) {
                            for (auto [k2, a2] : out.inserted)
                              (void)impl->domains_[k2]->RemovePeer(a2);
                            return addr.status();
                          }
                          out.inserted.push_back({k, *addr});
                        }
                        PeerEntry& e = impl->peers_[slot];
                        for (auto [k, a] : out.inserted)
                          impl->peer_by_addr_[impl->PeerKey(k, a)] = id;
                        for (uint32_t k = 0; k < impl->nics_; ++k) {
                          e.addr[k] =
                              out.inserted[k].second;  // the first nics_ links: (k, k mod remote)
                          const NicAddress& to = address.nics[k % remote];
                          e.sink[k] = {to.sink_base, to.sink_key};
                        }
                        e.inserted = out.inserted;
                        e.remote_nics.store(remote, std::memory_order_relaxed);
                        e.engine_id.store(address.engine_id, std::memory_order_relaxed);
                        e.lost.store(false, std::memory_order_relaxed);
                        for (PeerEntry::Traffic& t : e.traffic) {
                          for (auto* c : {&t.writes, &t.bytes, &t.imms, &t.sends}) {
                            c->store(0, std::memory_order_relaxed);
                          }
                        }
                        e.id.store(id, std::memory_order_release);
                        return Status::Ok();
                      })
                      .status());
  impl->peers_[slot].removed = false;
  if (reuse) {
    impl->free_slots_.pop_back();
  } else {
    impl->num_slots_.store(slot + 1, std::memory_order_release);
  }
  impl->peer_by_engine_[address.engine_id] = id;
  return id;
}

Status TransferEngine::RemovePeer(PeerId peer) {
  Engine* const impl = impl_;
  MutexLock lock(impl->add_mu_);
  return impl->RemovePeerLocked(peer);
}

StatusOr<bool> TransferEngine::PeerLost(PeerId peer) const {
  Engine* const impl = impl_;
  Status current = impl->CheckCurrent(peer);
  if (current.code() == StatusCode::kUnavailable) return true;  // removed: its slot moved on
  RETURN_IF_ERROR(current);
  return impl->peers_[PeerSlot(peer)].lost.load(std::memory_order_acquire);
}

StatusOr<std::vector<PeerTraffic>> TransferEngine::Traffic(PeerId peer) const {
  Engine* const impl = impl_;
  RETURN_IF_ERROR(impl->CheckCurrent(peer).WithContext("Traffic"));
  const PeerEntry& e = impl->peers_[PeerSlot(peer)];
  std::vector<PeerTraffic> out(impl->nics_);
  for (uint32_t k = 0; k < impl->nics_; ++k) {
    const PeerEntry::Traffic& t = e.traffic[k];
    out[k] = {t.writes.load(std::memory_order_relaxed), t.bytes.load(std::memory_order_relaxed),
              t.imms.load(std::memory_order_relaxed), t.sends.load(std::memory_order_relaxed)};
  }
  // The slot may have passed to another peer while we read: its counts are not this peer's.
  RETURN_IF_ERROR(impl->CheckCurrent(peer).WithContext("Traffic"));
  return out;
}

StatusOr<GroupId> TransferEngine::AddPeerGroup(std::span<const PeerId> members) {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(auto group, impl->BuildGroup(members));
  MutexLock lock(impl->add_mu_);
  uint32_t n = impl->num_groups_.load(std::memory_order_relaxed);
  if (n >= impl->options_.max_groups) return ResourceExhaustedError("peer group table full");
  impl->groups_[n] = std::move(group);
  impl->num_groups_.store(n + 1, std::memory_order_release);
  return GroupId{n};
}

Status TransferEngine::ReplacePeerGroup(GroupId id, std::span<const PeerId> members) {
  Engine* const impl = impl_;
  RETURN_IF_ERROR(impl->FindGroup(id).status().WithContext("ReplacePeerGroup"));
  ASSIGN_OR_RETURN(auto group, impl->BuildGroup(members));
  MutexLock lock(impl->add_mu_);
  impl->groups_[id] = std::move(group);
  return Status::Ok();
}

StatusOr<ScatterPlanId> TransferEngine::PrepareScatter(GroupId group, const MemoryRegion& src,
                                                       std::span<const RemoteRegion> dst) {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(auto plan, impl->BuildPlan(group, src, dst));
  MutexLock lock(impl->add_mu_);
  uint32_t n = impl->num_plans_.load(std::memory_order_relaxed);
  if (n >= impl->options_.max_scatter_plans)
    return ResourceExhaustedError("scatter plan table full");
  impl->plans_[n] = std::move(plan);
  impl->num_plans_.store(n + 1, std::memory_order_release);
  return ScatterPlanId{n};
}

Status TransferEngine::RePrepareScatter(ScatterPlanId id, GroupId group, const MemoryRegion& src,
                                        std::span<const RemoteRegion> dst) {
  Engine* const impl = impl_;
  if (id >= impl->num_plans_.load(std::memory_order_acquire)) {
    return NotFoundError("RePrepareScatter: unknown plan " + std::to_string(id));
  }
  ASSIGN_OR_RETURN(auto plan, impl->BuildPlan(group, src, dst));
  MutexLock lock(impl->add_mu_);
  impl->plans_[id] = std::move(plan);
  return Status::Ok();
}

}  // namespace ferry
