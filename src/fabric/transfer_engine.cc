// TransferEngine's methods (ferry/fabric.h): each checks its arguments on the caller's thread
// and hands the work to the implementation's worker (engine.h) through the submission queue
// or a control operation. A method is written here once; the Engine it runs on holds the state
// and the worker. Peers, their groups and scatter plans: transfer_engine_peers.cc.
#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "common/leak.h"
#include "fabric/engine.h"
#include "fabric/wire.h"

namespace ferry {
namespace {

// OutOfRange unless [offset, offset + length) lies inside a region of region_length bytes.
Status CheckRange(const char* side, uint64_t offset, uint64_t length, uint64_t region_length) {
  if (offset > region_length || length > region_length - offset) {
    return OutOfRangeError(std::string(side) + " offset " + std::to_string(offset) + " + length " +
                           std::to_string(length) + " exceeds region length " +
                           std::to_string(region_length));
  }
  return Status::Ok();
}

// Byte offset of page `index`: base + index * stride, with overflow reported as OutOfRange.
Status PageOffset(const char* side, uint64_t base, uint32_t index, uint64_t stride, uint64_t* out) {
  unsigned __int128 v = static_cast<unsigned __int128>(index) * stride + base;
  if (v > ~uint64_t{0}) {
    return OutOfRangeError(std::string(side) + " page " + std::to_string(index) + " overflows");
  }
  *out = static_cast<uint64_t>(v);
  return Status::Ok();
}

}  // namespace

// The implementation's types and helpers, named as engine.cc names them.
using namespace fabric;  // NOLINT(build/namespaces)

// The Engine's checks and requests that only these methods use.
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

template <typename Handler>
void Engine::SetOnWorker(Handler Engine::*field, Handler handler) {
  // The interface returns nothing: a worker that is not running calls no handler, and one wedged
  // in a provider call past control_timeout_ms skips the change (RunOnWorker).
  (void)RunOnWorker([this, field, handler = std::move(handler)](ControlResult&) -> Status {
    this->*field = handler;
    return Status::Ok();
  });
}

TransferEngine::TransferEngine(Engine* impl) : impl_(impl) {
  MutexLock lock(impl_->owner_->mu);
  impl_->owner_->engine = this;
}

TransferEngine::~TransferEngine() {
  if (impl_->StopWorker()) {
    delete impl_;
  } else {
    LeakOnPurpose(impl_);  // its worker is still inside the provider
  }
}

std::unique_ptr<TransferEngine> Engine::Wrap(std::unique_ptr<Engine> engine) {
  return std::unique_ptr<TransferEngine>(new TransferEngine(engine.release()));
}

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

const FabricInfo& TransferEngine::info() const { return impl_->info_; }
const EngineOptions& TransferEngine::options() const { return impl_->options_; }
uint64_t TransferEngine::id() const { return impl_->id_; }
std::vector<uint8_t> TransferEngine::Address() const { return impl_->address_; }

// The methods below name the implementation `impl`, and what they hand the worker captures it,
// never `this`: a control operation may run after its caller gave up on it (RunOnWorker's
// timeout), when the TransferEngine may be gone but the Engine, leaked or not yet freed, is not.
StatusOr<MemoryRegion> TransferEngine::RegisterMemory(void* data, uint64_t length, MemoryKind kind,
                                                      int device) {
  Engine* const impl = impl_;
  if (data == nullptr || length == 0) {
    return InvalidArgumentError("RegisterMemory: null pointer or zero length");
  }
  ASSIGN_OR_RETURN(
      Engine::ControlResult done,
      impl->RunOnWorker([impl, data, length, kind, device](Engine::ControlResult& out) -> Status {
        ASSIGN_OR_RETURN(out.reg, impl->RegisterAll(data, length, kind, device));
        return Status::Ok();
      }));
  // The region's handle is its MultiRegistration, which the engine keeps until Deregister.
  MultiRegistration* reg;
  {
    auto owned = std::make_unique<MultiRegistration>(done.reg);
    reg = owned.get();
    MutexLock lock(impl->regs_mu_);
    impl->regs_.emplace(reg, std::move(owned));
  }
  MemoryRegion region;
  RemoteRegion remote;
  remote.engine_id = impl->id_;
  remote.length = length;
  remote.num_nics = impl->nics_;
  for (uint32_t k = 0; k < impl->nics_; ++k) {
    remote.nics[k] = {reg->per_nic[k].base, reg->per_nic[k].key};
  }
  region.owner_ = impl->owner_;
  region.handle_ = reg;
  region.data_ = data;
  region.length_ = length;
  region.kind_ = kind;
  region.device_ = device;
  region.local_descs_ = reg->descs();
  region.remote_ = remote;
  return region;
}

Status TransferEngine::Deregister(MemoryRegion& region) {
  Engine* const impl = impl_;
  auto* handle = static_cast<MultiRegistration*>(region.handle_);
  if (!handle) return Status::Ok();
  MultiRegistration copy;
  {
    MutexLock lock(impl->regs_mu_);
    auto it = impl->regs_.find(handle);
    if (it == impl->regs_.end()) return Status::Ok();
    copy = *it->second;
    impl->regs_.erase(it);
  }
  // If the worker is gone or wedged, the domains close the registration when they close: it
  // is out of regs_ already, so nothing deregisters it twice (an operation that timed out may
  // still run, once).
  return impl
      ->RunOnWorker([impl, copy](Engine::ControlResult&) -> Status {
        impl->DeregisterAll(copy);
        return Status::Ok();
      })
      .status();
}

Status TransferEngine::Revoke(MemoryRegion& region) {
  if (!region.valid()) return InvalidArgumentError("Revoke: an empty region");
  Status s;
  {
    MutexLock lock(region.owner_->mu);
    if (region.owner_->engine != this) {
      return InvalidArgumentError("Revoke: a region of another engine, or of one that is gone");
    }
    s = Deregister(region);
  }
  region.owner_.reset();
  region.handle_ = nullptr;
  if (!s.ok()) return s.WithContext("Revoke: the registration may still be open");
  // What landed under the key before it closed is counted before Revoke returns, so that a
  // caller that then zeroes a counter (a fence against a peer it gave up on) leaves no late
  // arrival behind it: a second operation on the worker, which polls every completion the
  // provider has reported between the two (it runs control operations between its polls).
  return impl_->RunOnWorker([](Engine::ControlResult&) { return Status::Ok(); })
      .status()
      .WithContext("Revoke: closed, but what landed before may not be counted yet");
}

Status TransferEngine::Write(const SingleWrite& w, Completion done) {
  Engine* const impl = impl_;
  RETURN_IF_ERROR(impl->CheckEnds(w));
  if (w.length == 0 && !w.imm) {
    return InvalidArgumentError("Write: zero length and no immediate");
  }
  RETURN_IF_ERROR(CheckRange("src", w.src_offset, w.length, w.src->length()));
  RETURN_IF_ERROR(CheckRange("dst", w.dst_offset, w.length, w.dst.length));
  return impl->Enqueue(impl->WriteRequest(Kind::kSingle, w, w.length), std::move(done));
}

Status TransferEngine::WritePaged(const PagedWrite& w, Completion done) {
  Engine* const impl = impl_;
  RETURN_IF_ERROR(impl->CheckEnds(w));
  if (w.src_pages.size() != w.dst_pages.size()) {
    return InvalidArgumentError("WritePaged: " + std::to_string(w.src_pages.size()) +
                                " source pages but " + std::to_string(w.dst_pages.size()) +
                                " destination pages");
  }
  if (w.page_bytes == 0) return InvalidArgumentError("WritePaged: page_bytes is 0");
  if (w.page_bytes > impl->max_chunk_) {
    return InvalidArgumentError("WritePaged: page of " + std::to_string(w.page_bytes) +
                                " bytes exceeds the provider's message size " +
                                std::to_string(impl->max_chunk_));
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
  Request r = impl->WriteRequest(Kind::kPaged, w, w.page_bytes);
  r.src_stride = w.src_stride;
  r.dst_stride = w.dst_stride;
  r.src_pages = w.src_pages.data();
  r.dst_pages = w.dst_pages.data();
  r.count = static_cast<uint32_t>(w.src_pages.size());
  if (w.imm_once) {
    const uint32_t m = w.imm_weight_mask;
    const uint64_t per_nic = (w.src_pages.size() + impl->nics_ - 1) / impl->nics_;
    if (!w.imm || !IsWeightMask(m) || (*w.imm & m) != 0 || per_nic > WeightLimit(m)) {
      return InvalidArgumentError(
          "WritePaged: imm_once needs an immediate and a contiguous imm_weight_mask outside it "
          "that holds the pages of one NIC (" +
          std::to_string(per_nic) + ")");
    }
    r.imm_once = true;
    r.imm_weight_mask = m;
  }
  return impl->Enqueue(std::move(r), std::move(done));
}

Status TransferEngine::Scatter(const ScatterWrite& w, Completion done) {
  Engine* const impl = impl_;
  if (w.plan >= impl->num_plans_.load(std::memory_order_acquire)) {
    return NotFoundError("Scatter: unknown plan " + std::to_string(w.plan));
  }
  const ScatterPlan* plan = impl->plans_[w.plan].get();
  if (w.targets.size() > UINT32_MAX) return InvalidArgumentError("Scatter: too many targets");
  for (size_t i = 0; i < w.targets.size(); ++i) {
    const ScatterTarget& t = w.targets[i];
    if (t.member >= plan->members.size()) {
      return OutOfRangeError("Scatter target " + std::to_string(i) + ": member " +
                             std::to_string(t.member) + " of a group of " +
                             std::to_string(plan->members.size()));
    }
    const ScatterMember& m = plan->members[t.member];
    if (t.length > impl->max_chunk_) {
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
    if (s.ok()) s = impl->CheckPeer(m.peer);
    if (!s.ok()) return s.WithContext("Scatter target " + std::to_string(i));
  }
  Request r;
  r.kind = Kind::kScatter;
  r.plan = plan;
  r.targets = w.targets.data();
  r.count = static_cast<uint32_t>(w.targets.size());
  impl->SetImm(r, w.imm);
  return impl->Enqueue(std::move(r), std::move(done));
}

Status TransferEngine::Barrier(GroupId group, uint32_t imm, Completion done) {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(const PeerGroup* g, impl->FindGroup(group));
  for (PeerId p : g->members) RETURN_IF_ERROR(impl->CheckPeer(p).WithContext("Barrier"));
  Request r;
  r.kind = Kind::kBarrier;
  r.group = g;
  r.peers = impl->peers_.get();
  r.count = static_cast<uint32_t>(g->members.size());
  impl->SetImm(r, imm);
  return impl->Enqueue(std::move(r), std::move(done));
}

Status TransferEngine::WriteImm(PeerId peer, uint32_t imm, Completion done) {
  Engine* const impl = impl_;
  RETURN_IF_ERROR(impl->CheckPeer(peer));
  Request r;
  r.kind = Kind::kImm;
  impl->SetPeer(r, peer);
  impl->SetImm(r, imm);
  return impl->Enqueue(std::move(r), std::move(done));
}

Status TransferEngine::Send(PeerId peer, std::span<const uint8_t> message, Completion done) {
  Engine* const impl = impl_;
  RETURN_IF_ERROR(impl->CheckPeer(peer));
  if (message.size() > impl->options_.message_bytes) {
    return InvalidArgumentError("Send: message of " + std::to_string(message.size()) +
                                " bytes exceeds message_bytes " +
                                std::to_string(impl->options_.message_bytes));
  }
  uint32_t index = 0;
  if (!impl->free_send_buffers_.TryPop(index)) {
    return ResourceExhaustedError("Send: all " + std::to_string(impl->options_.num_send_buffers) +
                                  " send buffers are in flight");
  }
  uint8_t* buf = impl->send_buffers_.data() + uint64_t{index} * impl->options_.message_bytes;
  if (!message.empty()) std::memcpy(buf, message.data(), message.size());
  Request r;
  r.kind = Kind::kSend;
  impl->SetPeer(r, peer);
  r.src = buf;
  r.src_desc = impl->send_reg_.descs();
  r.length = message.size();
  r.send_buffer = index;
  Status s = impl->Enqueue(std::move(r), std::move(done));
  if (!s.ok()) impl->free_send_buffers_.TryPush(std::move(index));
  return s;
}

void TransferEngine::SetMessageHandler(MessageHandler handler) {
  Engine* const impl = impl_;
  impl->SetOnWorker(&Engine::message_handler_, std::move(handler));
}

Status TransferEngine::SetTaggedMessageHandler(uint32_t tag, MessageHandler handler) {
  Engine* const impl = impl_;
  // On the worker, which reads the table for every message: no lock on that path.
  return impl
      ->RunOnWorker([impl, tag,
                     handler = std::move(handler)](Engine::ControlResult&) mutable -> Status {
        auto& table = impl->tagged_handlers_;
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
          return ResourceExhaustedError(
              "SetTaggedMessageHandler: " + std::to_string(kMaxMessageTags) + " tags taken");
        }
        table.emplace_back(tag, std::move(handler));
        return Status::Ok();
      })
      .status();
}

Status TransferEngine::CreateWeightedImmCounter(uint32_t imm, uint32_t weight_mask) {
  Engine* const impl = impl_;
  if (weight_mask == 0) return InvalidArgumentError("CreateWeightedImmCounter: empty mask");
  return impl->counters_.Create(imm, weight_mask);
}

StatusOr<uint64_t> TransferEngine::ImmCount(uint32_t imm) const {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(const ImmCounterTable::Slot* slot, impl->Counter(imm));
  return slot->count.load(std::memory_order_acquire);
}

Status TransferEngine::WaitImm(uint32_t imm, uint64_t target, Deadline deadline) const {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(const ImmCounterTable::Slot* slot, impl->Counter(imm));
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

Status TransferEngine::NotifyImm(uint32_t imm, uint64_t target, Deadline deadline,
                                 DoneCallback done) {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(Request r, impl->CounterRequest(Kind::kNotify, imm));
  r.target = target;
  r.deadline = deadline.at;
  return impl->Push(std::move(r), Completion::Callback(std::move(done)));
}

Status TransferEngine::MirrorImm(uint32_t imm, uint64_t* word) {
  Engine* const impl = impl_;
  if (reinterpret_cast<uintptr_t>(word) % alignof(uint64_t) != 0) {
    return InvalidArgumentError("MirrorImm: the word must be 8-byte aligned");
  }
  ASSIGN_OR_RETURN(ImmCounterTable::Slot * slot, impl->Counter(imm));
  // On the worker, which owns the slot's mirror: once this returns, the old word is left alone.
  return impl
      ->RunOnWorker([impl, slot, word](Engine::ControlResult&) -> Status {
        slot->mirror = word;
        if (word) impl->StoreMirror(slot);
        return Status::Ok();
      })
      .status();
}

Status TransferEngine::DisarmImm(uint32_t imm) {
  Engine* const impl = impl_;
  ASSIGN_OR_RETURN(Request r, impl->CounterRequest(Kind::kDisarm, imm));
  return impl->Push(std::move(r), Completion());
}

void TransferEngine::SetUnmatchedImmHandler(UnmatchedImmHandler handler) {
  Engine* const impl = impl_;
  impl->SetOnWorker(&Engine::unmatched_handler_, std::move(handler));
}

EngineStats TransferEngine::stats() const {
  Engine* const impl = impl_;
  EngineStats s;
  s.transfers_submitted = impl->stats_.submitted.load(std::memory_order_relaxed);
  s.transfers_completed = impl->stats_.completed.load(std::memory_order_relaxed);
  s.transfers_failed = impl->stats_.failed.load(std::memory_order_relaxed);
  s.wrs_posted = impl->stats_.wrs_posted.load(std::memory_order_relaxed);
  for (uint32_t k = 0; k < kMaxNics; ++k) {
    s.wrs_posted_per_nic[k] = impl->stats_.wrs_per_nic[k].load(std::memory_order_relaxed);
  }
  s.post_retries = impl->stats_.post_retries.load(std::memory_order_relaxed);
  s.imm_waits = impl->stats_.imm_waits.load(std::memory_order_relaxed);
  s.worker_sleeps = impl->stats_.sleeps.load(std::memory_order_relaxed);
  s.imms_received = impl->stats_.imms.load(std::memory_order_relaxed);
  s.imms_unmatched = impl->stats_.imms_unmatched.load(std::memory_order_relaxed);
  s.messages_received = impl->stats_.messages.load(std::memory_order_relaxed);
  {
    MutexLock lock(impl->add_mu_);
    s.peer_entries = impl->num_slots_.load(std::memory_order_relaxed);
    s.peers = s.peer_entries - impl->free_slots_.size();
  }
  if (impl->worker_.joinable()) {
    clockid_t cid;
    timespec ts{};
    if (pthread_getcpuclockid(const_cast<std::thread&>(impl->worker_).native_handle(), &cid) == 0 &&
        clock_gettime(cid, &ts) == 0) {
      s.worker_cpu_ns = uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
    }
  }
  return s;
}

Status TransferEngine::CreateImmCounter(uint32_t imm) { return impl_->counters_.Create(imm); }
Status TransferEngine::ConsumeImm(uint32_t imm, uint64_t n) {
  return impl_->counters_.Consume(imm, n);
}

}  // namespace ferry
