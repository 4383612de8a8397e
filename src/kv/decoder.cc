// The KV messenger's decode side (KvDecoder, kv.h): sends requests, counts the writes that land
// on one immediate counter per request slot, and cancels. The wire format: messages.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "ferry/kv.h"
#include "kv/messages.h"
#include "kv/peer_lru.h"

namespace ferry {
namespace kv {
namespace {

// Each request owns a slot: an immediate counter and the one notification armed on it. A slot is
// only freed from that notification's callback, so a late notification can never reach the next
// request using the slot:
//   waiting    --all writes counted-->                       done (ready OK), slot freed
//   waiting    --deadline or Cancel() or prefill's ack-->    cancelling (send cancel, await ack)
//   cancelling --ack with `posted`-->                        acked; count >= posted: user told
//                                                            (Cancelled/Deadline)
//   the ack also disarms the armed notification, which then fires at once: the slot is freed if
//   every acknowledged write landed, else draining: a last notification waits (bounded) for
//   them, after which the slot is freed, or retired for good if some never landed (one may
//   still land).
//   cancelling --no ack within kAckTimeout-->                removing: the remover thread takes
//   the prefill out of the engine (its transfers fail, nothing more goes to it), then tells the
//   user Unavailable and frees the slot; if the removal fails the slot is retired for good.
//
// Fencing. A prefill that never acknowledges may be hung rather than dead, and write again when
// it wakes. So each prefill writes under keys of its own -- a second registration of our regions'
// bytes, made when the prefill is added -- and the remover revokes them (deregisters) before the
// slot and the request's pages are given back: a write the prefill posts afterwards lands nowhere
// and counts on no immediate. Where removing the peer fences it already (FabricInfo::
// removal_fences: verbs), the regions' own keys serve and no prefill costs a registration.
class Decoder final : public KvDecoder {
 public:
  Decoder(TransferEngine* engine, const KvSide& decode, const KvRegions& regions,
          const MemoryRegion* aux, int max_requests)
      : engine_(engine), fence_(!engine->info().removal_fences), decode_(decode),
        regions_(regions), aux_(aux), slots_(static_cast<size_t>(max_requests)) {}

  // No callback may run into a destroyed decoder: stop taking acknowledgements, end every armed
  // notification (their requests report Cancelled), and wait, bounded, for them and for the
  // completions of requests' messages still in flight to run.
  ~Decoder() override {
    if (tag_held_) (void)engine_->SetTaggedMessageHandler(kAckMagic, nullptr);
    closing_.store(true, std::memory_order_release);
    {
      MutexLock lock(remove_mu_);
      remover_stop_ = true;
    }
    remove_cv_.notify_all();
    if (remover_.joinable()) remover_.join();
    // Removals that never ran: their requests end Cancelled; their slots are not reused.
    for (auto [peer, slot] : to_remove_) {
      std::shared_ptr<DoneCallback> tell;
      {
        MutexLock lock(mu_);
        Slot& st = slots_[slot];
        if (!st.told) tell = st.ready;
        st.told = true;
        st.state = State::kRetired;
      }
      Tell(tell, CancelledError("KV decoder destroyed"));
    }
    for (size_t i = 0; i < slots_.size(); ++i) {
      (void)engine_->DisarmImm(kImmBase + static_cast<uint32_t>(i));
    }
    Deadline deadline = Deadline::After(std::chrono::seconds(10));
    while ((armed_.load(std::memory_order_acquire) > 0 ||
            sending_.load(std::memory_order_acquire) > 0) &&
           !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  Status Init() {
    {
      MutexLock lock(mu_);  // (nothing else runs yet: the analysis wants it held all the same)
      for (size_t i = 0; i < slots_.size(); ++i) {
        RETURN_IF_ERROR(engine_->CreateWeightedImmCounter(kImmBase + static_cast<uint32_t>(i),
                                                          kImmWeightMask));
        free_.push_back(static_cast<uint32_t>(i));
      }
    }
    // Runs on the worker: only lock-free engine calls and queue pushes from here. A decoder
    // takes the acknowledgements (the engine's other messages stay its other users').
    const Status tagged = engine_->SetTaggedMessageHandler(
        kAckMagic, [this](std::optional<PeerId>, std::span<const uint8_t> m) {
          auto f = ParseControl(kAckMagic, m);
          if (f.ok()) OnAck(f->request_id, f->imm, f->posted);
        });
    if (tagged.code() == StatusCode::kAlreadyExists) {
      return AlreadyExistsError("KvDecoder: the engine serves another KvDecoder already");
    }
    RETURN_IF_ERROR(tagged);
    tag_held_ = true;
    // Engine control calls (RemovePeer) must not run on the engine's worker, where the
    // notifications fire: a thread of our own takes unresponsive prefills out.
    remover_ = std::thread([this] { RemoveUnresponsive(); });
    return Status::Ok();
  }

  Status Submit(const Request& req, Deadline deadline, DoneCallback ready) override {
    const int64_t page_bytes = decode_.page_bytes();
    for (int64_t p : req.pages) {
      if (!PageInLayer(p, page_bytes, static_cast<uint64_t>(regions_.layer_stride))) {
        return OutOfRangeError("KV request: page " + std::to_string(p) +
                               " lies outside the layer of " +
                               std::to_string(regions_.layer_stride) + " bytes");
      }
    }
    ASSIGN_OR_RETURN(KvPlan plan, PlanKvTransfer(req.prefill, decode_, DummyPages(req.pages.size()),
                                                 req.pages, req.request_id));
    if (req.aux_bytes > 0 &&
        (!aux_ || !SliceInside(req.aux_offset, req.aux_bytes, aux_->length()))) {
      return OutOfRangeError("KV request: aux slot outside the aux region");
    }
    ASSIGN_OR_RETURN(Target target, TargetFor(req.prefill_address));
    const PeerId prefill = target.peer;
    const uint64_t expected = static_cast<uint64_t>(plan.writes.size()) * regions_.num_layers +
                              (req.aux_bytes > 0 ? 1 : 0);
    uint32_t slot;
    {
      MutexLock lock(mu_);
      if (by_request_.count(req.request_id)) {
        return AlreadyExistsError("KV request " + std::to_string(req.request_id) +
                                  " is in flight");
      }
      if (free_.empty()) return ResourceExhaustedError("KV decoder: all request slots in use");
      slot = free_.front();
      free_.pop_front();
      Slot& st = slots_[slot];
      st = Slot{};
      st.state = State::kWaiting;
      st.request_id = req.request_id;
      st.prefill = prefill;
      st.expected = expected;
      st.ready = std::make_shared<DoneCallback>(std::move(ready));
      by_request_[req.request_id] = slot;
    }
    WireRequest w;
    w.request_id = req.request_id;
    w.imm = kImmBase + slot;
    w.decoder_address = engine_->Address();
    w.decode = decode_;
    w.num_layers = static_cast<uint32_t>(regions_.num_layers);
    w.layer_stride = static_cast<uint64_t>(regions_.layer_stride);
    w.dst = std::move(target.dst);
    w.pages.assign(req.pages.begin(), req.pages.end());
    w.num_tokens = req.num_tokens;
    if (req.aux_bytes > 0) w.aux = target.aux;
    w.aux_offset = req.aux_offset;
    w.aux_bytes = req.aux_bytes;
    w.speculative = req.speculative;
    // Send, then arm: immediates that land first are counted all the same, and arming checks
    // the count at once. A refused send (queue full) leaves nothing behind.
    // A request that never reaches the prefill (its connection ended under it: the prefill
    // removed us to make room) ends at once, Unavailable, not at its deadline.
    const uint32_t imm = kImmBase + slot;
    const uint64_t id = req.request_id;
    sending_.fetch_add(1, std::memory_order_acq_rel);
    Status sent = engine_->Send(prefill, w.Serialize(),
                                Completion::Callback([this, id, imm](const Status& s) {
                                  if (!s.ok() && !closing_.load(std::memory_order_acquire)) {
                                    OnUndelivered(id, imm, s);
                                  }
                                  sending_.fetch_sub(1, std::memory_order_acq_rel);
                                }));
    if (!sent.ok()) {
      sending_.fetch_sub(1, std::memory_order_acq_rel);  // refused: its callback never runs
      MutexLock lock(mu_);
      by_request_.erase(req.request_id);
      slots_[slot].state = State::kFree;
      free_.push_back(slot);
      return sent;
    }
    return Arm(slot, expected, deadline);
  }

  Status Cancel(uint64_t request_id) override {
    PeerId prefill;
    uint32_t slot;
    {
      MutexLock lock(mu_);
      auto it = by_request_.find(request_id);
      if (it == by_request_.end()) {
        return NotFoundError("KV decoder: no request " + std::to_string(request_id) +
                             " in flight");
      }
      slot = it->second;
      Slot& st = slots_[slot];
      if (st.state != State::kWaiting) return Status::Ok();  // already ending
      st.state = State::kCancelling;
      st.outcome = CancelledError("KV request " + std::to_string(request_id) + " cancelled");
      prefill = st.prefill;
    }
    return engine_->Send(prefill, ControlMessage(kCancelMagic, request_id, kImmBase + slot, 0),
                         {});
  }

 private:
  // A slot's life (the diagram at the top of this file).
  enum class State {
    kFree,
    kWaiting,     // armed for the request's writes
    kCancelling,  // a cancel sent, its acknowledgement awaited (armed, bounded)
    kAcked,       // the prefill stopped after `posted` writes; the disarmed notification is due
    kDraining,    // armed again, bounded, for acknowledged writes still in flight
    kRemoving,    // no acknowledgement: the remover thread takes the prefill out
    kRetired,     // never reused: a write may still land on its counter
  };
  struct Slot {
    State state = State::kFree;
    uint64_t request_id = 0;
    PeerId prefill = 0;
    uint64_t expected = 0;
    std::shared_ptr<DoneCallback> ready;
    // The user's callback ran. Apart from the state: a cancelled request is told once its
    // acknowledged writes landed, while its slot still waits for the notification.
    bool told = false;
    uint64_t posted = 0;  // kAcked, kDraining: writes the prefill posted before it stopped
    Status outcome;       // what a cancelled request reports
  };

  // Where a request sends a prefill's writes: our regions, under the keys it writes with.
  struct Target {
    PeerId peer = 0;
    std::vector<RemoteRegion> dst;  // [tp]
    RemoteRegion aux;               // when there is an aux region
  };
  // A prefill's own registrations of our regions (fencing): destroying them revokes its keys.
  struct Keys {
    std::vector<MemoryRegion> ranks;  // [tp]
    MemoryRegion aux;
  };

  // How long to wait for the prefill's acknowledgement of a cancel before giving up on it.
  static constexpr auto kAckTimeout = std::chrono::seconds(5);

  Status Arm(uint32_t slot, uint64_t target, Deadline deadline) {
    armed_.fetch_add(1, std::memory_order_acq_rel);
    Status s =
        engine_->NotifyImm(kImmBase + slot, target, deadline, [this, slot](const Status& st) {
          OnNotify(slot, st);
          armed_.fetch_sub(1, std::memory_order_acq_rel);
        });
    if (!s.ok()) armed_.fetch_sub(1, std::memory_order_acq_rel);
    return s;
  }

  uint64_t Count(uint32_t slot) const {
    auto c = engine_->ImmCount(kImmBase + slot);
    return c.ok() ? *c : 0;
  }

  // Runs the user's callback once, outside the lock.
  void Tell(const std::shared_ptr<DoneCallback>& cb, const Status& s) {
    if (cb && *cb) (*cb)(s);
  }

  // The slot's armed notification fired (worker thread).
  void OnNotify(uint32_t slot, const Status& s) {
    std::shared_ptr<DoneCallback> tell;
    Status tell_status;
    bool rearm = false;
    uint64_t rearm_target = ~uint64_t{0};  // a timer: unreachable, it ends at its deadline
    {
      MutexLock lock(mu_);
      Slot& st = slots_[slot];
      if (closing_.load(std::memory_order_acquire)) {
        // The decoder is going away: report what did not end, re-arm nothing.
        if (!st.told && st.state != State::kFree && st.state != State::kRetired) {
          tell = st.ready;
          tell_status = s.ok() ? Status::Ok() : CancelledError("KV decoder destroyed");
          st.told = true;
        }
        st.state = State::kRetired;
      } else if (s.ok() && !st.told && st.state != State::kDraining) {
        // Every write landed (even if a cancel was on its way): the request is complete.
        (void)engine_->ConsumeImm(kImmBase + slot, st.expected);
        tell = st.ready;
        Free(slot);
      } else if (st.state == State::kWaiting) {
        // Deadline: ask the prefill to stop, and wait (bounded) for its acknowledgement.
        st.state = State::kCancelling;
        st.outcome = s.code() == StatusCode::kDeadlineExceeded
                         ? DeadlineExceededError("KV request " + std::to_string(st.request_id) +
                                                 " not ready by its deadline")
                         : s;
        (void)engine_->Send(
            st.prefill, ControlMessage(kCancelMagic, st.request_id, kImmBase + slot, 0), {});
        rearm = true;
      } else if (st.state == State::kCancelling) {
        rearm = !st.told && s.code() != StatusCode::kDeadlineExceeded;
        if (!rearm) {
          // No acknowledgement in time: the prefill may still write. It goes out of the engine
          // before the slot (and the request's pages) are given back.
          st.state = State::kRemoving;
          Forget(slot);
          {
            MutexLock remove_lock(remove_mu_);
            to_remove_.emplace_back(st.prefill, slot);
          }
          remove_cv_.notify_one();
        }
      } else if (st.state == State::kAcked || st.state == State::kDraining) {
        const uint64_t seen = Count(slot);
        if (seen >= st.posted) {
          (void)engine_->ConsumeImm(kImmBase + slot, seen);
          if (!st.told) {
            tell = st.ready;
            tell_status = st.outcome;
          }
          Free(slot);
        } else if (st.state == State::kAcked) {
          // Acknowledged writes are still in flight: wait for them, bounded.
          st.state = State::kDraining;
          rearm = true;
          rearm_target = st.posted;
        } else {
          st.state = State::kRetired;
          Forget(slot);
          if (!st.told) {
            tell = st.ready;
            tell_status = DataLossError("KV request " + std::to_string(st.request_id) + ": " +
                                        std::to_string(st.posted - seen) +
                                        " acknowledged writes never landed");
            st.told = true;
          }
        }
      }
    }
    if (rearm) {
      // Keeps the slot reserved until the target is reached or the timer ends.
      (void)Arm(slot, rearm_target, Deadline::After(kAckTimeout));
    }
    Tell(tell, tell_status);
  }

  // The prefill stopped the request after `posted` writes (worker thread).
  void OnAck(uint64_t request_id, uint32_t imm, uint64_t posted) {
    Stopped(request_id, imm, posted,
            CancelledError("KV request " + std::to_string(request_id) +
                           " cancelled by the prefill"));
  }

  // The request's message never reached the prefill: nothing of it will land, so the slot ends
  // as if the prefill had acknowledged no writes (worker thread).
  void OnUndelivered(uint64_t request_id, uint32_t imm, const Status& why) {
    Stopped(request_id, imm, 0,
            UnavailableError("KV request " + std::to_string(request_id) +
                             " did not reach the prefill (" + why.ToString() +
                             "); a request sent again adds it again"));
  }

  // The request stopped at the prefill after `posted` writes; `outcome` is what a request still
  // waiting reports.
  void Stopped(uint64_t request_id, uint32_t imm, uint64_t posted, const Status& outcome) {
    std::shared_ptr<DoneCallback> tell;
    Status tell_status;
    {
      MutexLock lock(mu_);
      const uint32_t slot = imm - kImmBase;
      if (imm < kImmBase || slot >= slots_.size()) return;
      Slot& st = slots_[slot];
      if (st.request_id != request_id) return;
      if (st.state == State::kWaiting) {
        st.state = State::kCancelling;
        st.outcome = outcome;
      }
      if (st.state != State::kCancelling) return;
      st.state = State::kAcked;
      st.posted = posted;
      // End the armed notification now (it would otherwise hold the slot until the request's
      // deadline): it fires Cancelled, after this, and frees or drains the slot.
      (void)engine_->DisarmImm(imm);
      // Once every acknowledged write has landed the pages are ours again: tell the user now.
      // The slot itself is freed when its armed notification fires.
      if (Count(slot) >= posted && !st.told) {
        tell = st.ready;
        tell_status = st.outcome;
        st.told = true;
        Forget(slot);  // the id is free again; the slot waits for its notification
      }
    }
    Tell(tell, tell_status);
  }

  // The remover thread: takes each unresponsive prefill out of the engine, then ends the requests
  // waiting on that and frees their slots.
  void RemoveUnresponsive() {
    std::unordered_map<PeerId, Status> removed;  // peer -> how its removal went
    for (;;) {
      std::pair<PeerId, uint32_t> job;
      {
        MutexLock lock(remove_mu_);
        while (!remover_stop_ && to_remove_.empty()) remove_cv_.wait(lock);
        if (remover_stop_) return;
        job = to_remove_.front();
        to_remove_.pop_front();
      }
      const auto [peer, slot] = job;
      auto it = removed.find(peer);
      if (it == removed.end()) {
        std::optional<Keys> keys;
        {
          MutexLock lock(peers_mu_);
          unresponsive_.insert(peer);
          keys = TakeKeys(peer);
        }
        // Revoked: nothing the prefill posts from now on lands. A revocation that did not take
        // counts as a removal that failed: the pages stay reserved.
        const Status fenced = keys ? Revoke(*keys) : Status::Ok();
        const Status gone = engine_->RemovePeer(peer);
        it = removed.emplace(peer, fenced.ok() ? gone : fenced).first;
      }
      std::shared_ptr<DoneCallback> tell;
      Status tell_status;
      {
        MutexLock lock(mu_);
        Slot& st = slots_[slot];
        if (st.state != State::kRemoving) continue;
        tell = st.told ? nullptr : st.ready;
        if (it->second.ok()) {
          // Fenced: nothing more counts on the slot, so what did count goes with the request
          // and the next one starts from zero.
          (void)engine_->ConsumeImm(kImmBase + slot, Count(slot));
          tell_status = UnavailableError(
              "KV request " + std::to_string(st.request_id) +
              ": the prefill did not acknowledge the cancel; it was removed from the engine and "
              "the request's pages are free");
          Free(slot);
        } else {
          tell_status = UnavailableError(
              "KV request " + std::to_string(st.request_id) +
              ": the prefill did not acknowledge the cancel and could not be fenced and removed (" +
              it->second.ToString() + "); the pages stay reserved");
          st.told = true;
          st.state = State::kRetired;
        }
      }
      Tell(tell, tell_status);
    }
  }

  // Drops the request id's mapping if it still names this slot.
  void Forget(uint32_t slot) REQUIRES(mu_) {
    auto it = by_request_.find(slots_[slot].request_id);
    if (it != by_request_.end() && it->second == slot) by_request_.erase(it);
  }

  void Free(uint32_t slot) REQUIRES(mu_) {
    Slot& st = slots_[slot];
    st.told = true;
    Forget(slot);
    st.state = State::kFree;
    free_.push_back(slot);
  }

  // The decoder only needs the prefill page count to plan; ids do not change the write count.
  static std::vector<int64_t> DummyPages(size_t n) {
    std::vector<int64_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<int64_t>(i);
    return v;
  }

  // The prefill at `address`, added to the engine (and given keys of its own) if it is not a
  // peer we hold.
  StatusOr<Target> TargetFor(std::span<const uint8_t> address) {
    std::string key(address.begin(), address.end());
    MutexLock lock(peers_mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) {
      // A prefill the engine lost (over verbs: it removed us, say to make room), or one we took
      // out for not acknowledging a cancel, is added again, which reconnects: a request naming
      // it again is the caller's word that it is back (a hung prefill that was continued). Its
      // old keys are revoked first: whatever it still posts under them lands nowhere.
      const PeerId known = it->second;
      const StatusOr<bool> lost = engine_->PeerLost(known);
      if (!unresponsive_.count(known) && lost.ok() && !*lost) {
        lru_.Touch(known);
        return TargetOf(known);
      }
      unresponsive_.erase(known);
      lru_.Forget(known);
      (void)TakeKeys(known);
      peers_.erase(it);
    }
    std::optional<Keys> keys;
    if (fence_) {
      ASSIGN_OR_RETURN(keys, RegisterKeys());
    }
    ASSIGN_OR_RETURN(
        PeerId p,
        lru_.AddMakingRoom(
            *engine_, address,
            [this] {  // the prefills a request slot names
              std::vector<PeerId> busy;
              MutexLock slots_lock(mu_);
              for (const Slot& st : slots_) {
                if (st.state != State::kFree) busy.push_back(st.prefill);
              }
              return busy;
            },
            // Called inside AddMakingRoom, with peers_mu_ still held.
            [this](PeerId gone) REQUIRES(peers_mu_) {
              std::erase_if(peers_, [gone](const auto& kv) { return kv.second == gone; });
              (void)TakeKeys(gone);
            }));
    peers_[key] = p;
    if (keys) keys_[p] = std::move(*keys);
    return TargetOf(p);
  }

  // Our regions registered once more: keys for one prefill alone.
  StatusOr<Keys> RegisterKeys() {
    Keys k;
    for (const MemoryRegion* r : regions_.ranks) {
      ASSIGN_OR_RETURN(MemoryRegion again,
                       engine_->RegisterMemory(r->data(), r->length(), r->kind(), r->device()));
      k.ranks.push_back(std::move(again));
    }
    if (aux_) {
      ASSIGN_OR_RETURN(k.aux, engine_->RegisterMemory(aux_->data(), aux_->length(), aux_->kind(),
                                                      aux_->device()));
    }
    return k;
  }

  // The keys `peer` writes with: its own where we fence, else the regions'.
  Target TargetOf(PeerId peer) REQUIRES(peers_mu_) {
    Target t;
    t.peer = peer;
    auto it = keys_.find(peer);
    if (it != keys_.end()) {
      for (const MemoryRegion& r : it->second.ranks) t.dst.push_back(r.remote());
      if (aux_) t.aux = it->second.aux.remote();
    } else {
      for (const MemoryRegion* r : regions_.ranks) t.dst.push_back(r->remote());
      if (aux_) t.aux = aux_->remote();
    }
    return t;
  }

  // Revokes a prefill's keys: the first error of the engine's Revoke, all of them tried.
  Status Revoke(Keys& keys) {
    Status first;
    auto revoke = [&](MemoryRegion& r) {
      if (!r.valid()) return;
      Status s = engine_->Revoke(r);
      if (first.ok()) first = std::move(s);
    };
    for (MemoryRegion& r : keys.ranks) revoke(r);
    revoke(keys.aux);
    return first;
  }

  // Takes `peer`'s keys out of the table; destroying what it returns revokes them.
  std::optional<Keys> TakeKeys(PeerId peer) REQUIRES(peers_mu_) {
    auto it = keys_.find(peer);
    if (it == keys_.end()) return std::nullopt;
    Keys k = std::move(it->second);
    keys_.erase(it);
    return k;
  }

  TransferEngine* engine_;
  const bool fence_;       // each prefill writes under keys of its own (Fencing, above)
  bool tag_held_ = false;  // the engine routes acknowledgements here (Init)
  const KvSide decode_;
  const KvRegions regions_;
  const MemoryRegion* aux_;
  Mutex mu_;
  std::vector<Slot> slots_ GUARDED_BY(mu_);
  std::deque<uint32_t> free_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, uint32_t> by_request_ GUARDED_BY(mu_);
  Mutex peers_mu_;
  std::unordered_map<std::string, PeerId> peers_ GUARDED_BY(peers_mu_);  // by engine address
  PeerLru lru_ GUARDED_BY(peers_mu_);
  // Prefills the remover took out.
  std::unordered_set<PeerId> unresponsive_ GUARDED_BY(peers_mu_);
  std::unordered_map<PeerId, Keys> keys_ GUARDED_BY(peers_mu_);  // where fence_
  std::atomic<int> armed_{0};    // notifications armed and not yet run
  std::atomic<int> sending_{0};  // requests' messages whose completion has not yet run
  std::atomic<bool> closing_{false};
  // Unresponsive prefills to take out of the engine: (peer, slot waiting on it).
  Mutex remove_mu_;
  CondVar remove_cv_;
  std::deque<std::pair<PeerId, uint32_t>> to_remove_ GUARDED_BY(remove_mu_);
  bool remover_stop_ GUARDED_BY(remove_mu_) = false;
  std::thread remover_;  // last: starts in Init, once everything above exists
};

}  // namespace
}  // namespace kv

StatusOr<std::unique_ptr<KvDecoder>> KvDecoder::Create(TransferEngine* engine,
                                                       const KvSide& decode,
                                                       const KvRegions& regions,
                                                       const MemoryRegion* aux,
                                                       int max_requests) {
  if (!engine) return InvalidArgumentError("KvDecoder: null engine");
  if (max_requests < 1 || static_cast<uint32_t>(max_requests) > imm::kKvMaxSlots) {
    return InvalidArgumentError("KvDecoder: max_requests must be in [1, 2^20] (a slot's "
                                "immediate has 20 bits)");
  }
  RETURN_IF_ERROR(kv::CheckRegions(decode, regions));
  auto d = std::make_unique<kv::Decoder>(engine, decode, regions, aux, max_requests);
  RETURN_IF_ERROR(d->Init());
  return std::unique_ptr<KvDecoder>(std::move(d));
}

}  // namespace ferry
