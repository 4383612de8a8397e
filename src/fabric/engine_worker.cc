// The engine's worker thread: the only thread that touches the Domain. It takes requests off
// the submission queue, posts their work requests as queue space allows, polls completions,
// finishes transfers, counts immediates, delivers messages, fails what outlives its deadline
// and runs control operations. The design: engine.h.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "fabric/engine.h"

namespace ferry::fabric {

void Engine::WorkerMain() {
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
  MutexLock lock(exit_mu_);
  worker_exited_ = true;
  exit_cv_.notify_all();
}

void Engine::Idle(Clock::duration idle_for) {
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

void Engine::RunControl() {
  std::deque<std::function<void()>> ops;
  {
    MutexLock lock(control_mu_);
    ops.swap(control_);
    control_pending_.store(false, std::memory_order_release);
  }
  for (auto& op : ops) op();
}

size_t Engine::DrainQueue() {
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

void Engine::Start(Request&& r) {
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
  // Checked at submit, but the peer may have been lost or removed (its slot even reused) while
  // the request waited in the queue.
  if (SinglePeer(t) && !Usable(t->req.peer)) {
    Fail(t, UnavailableError(PeerName(t->req.peer) + " is lost or was removed"));
    return;
  }
  Enqueue(t);
}

void Engine::PlanSingle(Transfer* t) {
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

void Engine::Enqueue(Transfer* t) {
  if (t->queued) return;
  t->queued = true;
  pending_[(pending_head_ + pending_size_) % pending_.size()] = t;
  ++pending_size_;
}

uint32_t Engine::ShardOf(const Transfer& t, uint32_t i) {
  return std::min(i / t.shard_wrs, t.shards - 1);
}

uint32_t Engine::TailWrs(const Transfer& t) const {
  if (!t.req.has_imm) return 0;
  if (t.req.kind == Kind::kSingle) return 1;
  if (t.req.kind == Kind::kPaged && t.req.imm_once) return std::min<uint32_t>(nics_, t.total);
  return 0;
}

bool Engine::TailWaits(const Transfer& t) const {
  if (!options_.trust_write_order) return true;
  const uint64_t wr_bytes = t.req.kind == Kind::kPaged ? t.req.length : t.chunk;
  if (wr_bytes > info_.ordered_write_bytes) return true;
  return t.req.kind == Kind::kSingle && t.shards > 1;
}

size_t Engine::PostPending() {
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
      Posted wr;
      PostResult res = PostOne(t, t->next, slot, &wr, &error);
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
      Stats::Add(stats_.wrs_per_nic[wr.nic]);
      PeerEntry::Traffic& to = peers_[wr.peer_slot].traffic[wr.nic];
      Stats::Add(wr.send ? to.sends : to.writes);
      Stats::Add(to.bytes, wr.bytes);
      if (wr.imm) Stats::Add(to.imms);
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

PostResult Engine::PostOne(Transfer* t, uint32_t i, WrSlot* slot, Posted* posted,
                           Status* error) {
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
      if (!Usable(m.peer)) {
        *error = UnavailableError(PeerName(m.peer) + " is lost or was removed");
        return PostResult::kError;
      }
      k = m.nic;
      wr.local = r.plan->src + target.src_offset;
      wr.length = target.length;
      wr.local_desc = r.plan->src_desc[k];
      wr.peer_addr = peers_[PeerSlot(m.peer)].addr[k];
      wr.remote_addr = m.base + target.dst_offset;
      wr.key = m.key;
      *posted = {k, PeerSlot(m.peer), wr.length, false, wr.has_imm};
      return domains_[k]->PostWrite(wr, error);
    }
    case Kind::kBarrier: {
      k = i % nics_;
      const PeerId member = r.group->members[i];
      if (!Usable(member)) {
        *error = UnavailableError(PeerName(member) + " is lost or was removed");
        return PostResult::kError;
      }
      const PeerEntry& p = r.peers[PeerSlot(member)];
      wr.peer_addr = p.addr[k];
      wr.remote_addr = p.sink[k].base;
      wr.key = p.sink[k].key;
      *posted = {k, PeerSlot(member), 0, false, wr.has_imm};
      return domains_[k]->PostWrite(wr, error);
    }
    case Kind::kImm:
      wr.remote_addr = r.entry->sink[k].base;
      wr.key = r.entry->sink[k].key;
      break;
    case Kind::kSend:
      *posted = {k, PeerSlot(r.peer), r.length, true, false};
      return domains_[k]->PostSend(r.src, r.length, r.src_desc[k], r.entry->addr[k],
                                   &slot->ctx, error);
    case Kind::kNotify:
    case Kind::kDisarm: break;
  }
  // Single-peer writes.
  wr.local_desc = r.src_desc[k];
  wr.peer_addr = r.entry->addr[k];
  *posted = {k, PeerSlot(r.peer), wr.length, false, wr.has_imm};
  return domains_[k]->PostWrite(wr, error);
}

size_t Engine::PollCompletions() {
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

bool Engine::IsPostedRecv(const OpContext* ctx) const {
  auto* p = reinterpret_cast<const PostedRecv*>(ctx);
  return p >= recv_slots_.get() && p < recv_slots_.get() + num_recv_slots_;
}

void Engine::Complete(DomainCompletion& c, uint32_t nic) {
  if (c.kind == CompletionKind::kPeerGone) {
    auto it = peer_by_addr_.find(PeerKey(nic, c.src_addr));
    if (it != peer_by_addr_.end()) {
      MarkPeerLost(it->second, UnavailableError(PeerName(it->second) + " removed us"));
    }
    return;
  }
  if (c.context && IsPostedRecv(c.context)) {
    auto* rs = reinterpret_cast<PostedRecv*>(c.context);
    if (c.error.ok()) {
      if (c.kind == CompletionKind::kRemoteImm) {
        CountImm(c.imm);
      } else {
        OnMessage(c, rs->index, nic);
      }
    }
    if (!stop_.load(std::memory_order_relaxed)) {
      Status s = PostRecvBuffer(rs->index);
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

std::string Engine::Describe(const Transfer* t) const {
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

void Engine::CountImm(uint32_t imm) {
  Stats::Add(stats_.imms);
  uint64_t weight = 1;
  ImmCounterTable::Slot* slot = counters_.FindWeighted(imm, &weight);
  if (!slot) {
    Stats::Add(stats_.imms_unmatched);
    if (unmatched_handler_) unmatched_handler_(imm);
    return;
  }
  uint64_t now = slot->count.fetch_add(weight, std::memory_order_acq_rel) + weight;
  slot->total += weight;
  if (slot->mirror) StoreMirror(slot);
  if (slot->armed && now >= slot->target) FireNotify(slot, Status::Ok());
}

void Engine::StoreMirror(ImmCounterTable::Slot* slot) {
  // Release: what the immediate announced (the bytes its write landed) is visible before the
  // total that counts it, to a reader that acquires the word.
  std::atomic_ref<uint64_t>(*slot->mirror).store(slot->total, std::memory_order_release);
  // A word in GPU memory behind GDRCopy's write-combining mapping (GpuWords): the store leaves
  // the CPU's write-combining buffer at the fence, not at some later one.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void Engine::OnMessage(const DomainCompletion& c, uint32_t index, uint32_t nic) {
  Stats::Add(stats_.messages);
  const uint8_t* data = recv_buffers_.data() + uint64_t{index} * options_.message_bytes;
  const MessageHandler* handler = &message_handler_;
  if (c.length >= 4 && !tagged_handlers_.empty()) {
    uint32_t tag;
    std::memcpy(&tag, data, 4);
    for (const auto& [t, h] : tagged_handlers_) {
      if (t == tag) {
        handler = &h;
        break;
      }
    }
  }
  if (!*handler) return;
  std::optional<PeerId> from;
  auto it = peer_by_addr_.find(PeerKey(nic, c.src_addr));
  if (c.src_addr != kNoPeerAddr && it != peer_by_addr_.end()) from = it->second;
  (*handler)(from, std::span<const uint8_t>(data, c.length));
}

Status Engine::PostRecvBuffer(uint32_t index) {
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

void Engine::Arm(Request&& r) {
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

void Engine::FireNotify(ImmCounterTable::Slot* slot, const Status& status) {
  slot->armed = false;
  auto it = std::find(armed_.begin(), armed_.end(), slot);
  if (it != armed_.end()) {
    *it = armed_.back();
    armed_.pop_back();
  }
  Completion done = std::move(slot->on_reached);
  done.Finish(status);
}

void Engine::Fail(Transfer* t, const Status& status) {
  if (t->error.ok()) t->error = status.WithContext(Describe(t));
  t->next = t->total;
  t->tail_deferred = false;
  MaybeFinish(t);
}

void Engine::MaybeFinish(Transfer* t) {
  if (t->next < t->total || t->tail_deferred) return;
  if (!t->finished) {
    if (t->outstanding == 0 || !t->error.ok()) Finish(t, t->error);  // releases when idle
  } else if (t->outstanding == 0 && !t->queued) {
    Release(t);
  }
}

void Engine::Finish(Transfer* t, const Status& status) {
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

void Engine::Release(Transfer* t) {
  if (t->active_prev) t->active_prev->active_next = t->active_next;
  if (t->active_next) t->active_next->active_prev = t->active_prev;
  if (active_ == t) active_ = t->active_next;
  t->active_prev = t->active_next = nullptr;
  t->req = Request{};
  free_transfers_.push_back(t);
  inflight_.fetch_sub(1, std::memory_order_acq_rel);
}

bool Engine::SinglePeer(const Transfer* t) {
  return t->req.kind == Kind::kSingle || t->req.kind == Kind::kPaged ||
         t->req.kind == Kind::kImm || t->req.kind == Kind::kSend;
}

void Engine::FailCollected(const Status& why) {
  for (Transfer* t : scratch_) {
    if (t->finished) continue;
    if (t->error.ok()) t->error = why;
    t->next = t->total;
    t->tail_deferred = false;
    Finish(t, t->error);
  }
  scratch_.clear();
}

bool Engine::Involves(const Transfer* t, PeerId peer) {
  if (SinglePeer(t)) return t->req.peer == peer;
  if (t->req.kind == Kind::kScatter) {
    for (uint32_t i = 0; i < t->req.count; ++i) {
      if (t->req.plan->members[t->req.targets[i].member].peer == peer) return true;
    }
  }
  return false;
}

void Engine::MarkPeerLost(PeerId peer, const Status& why) {
  PeerEntry& e = peers_[PeerSlot(peer)];
  if (e.id.load(std::memory_order_relaxed) != peer) return;  // its slot serves another now
  e.lost.store(true, std::memory_order_release);
  for (Transfer* t = active_; t; t = t->active_next) {
    if (!t->finished && Involves(t, peer)) scratch_.push_back(t);
  }
  FailCollected(why);
}

void Engine::ScanDeadlines(Clock::time_point now) {
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
    // The peer is marked lost before the transfer's failure is reported, so that a caller who
    // sees the failure and submits again is refused (Unavailable) rather than accepted.
    if (SinglePeer(t)) MarkPeerLost(t->req.peer, why);  // fails t with the rest of its peer's
    if (!t->finished) {
      scratch_.push_back(t);
      FailCollected(why);
    }
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

void Engine::Drain() {
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
    MutexLock lock(control_mu_);
    worker_running_ = false;
    ops.swap(control_);
  }
  // Control ops that raced with shutdown still run: they only touch the domain, which lives on.
  for (auto& op : ops) op();
}

bool Engine::Stop() {
  {
    MutexLock lock(owner_->mu);
    owner_->engine = nullptr;  // regions released from now on just forget their handles
  }
  stopping_.store(true, std::memory_order_release);
  stop_.store(true, std::memory_order_release);
  wake_word_.fetch_add(1, std::memory_order_release);
  Futex::WakeOne(&wake_word_);
  if (!worker_.joinable()) return true;
  MutexLock lock(exit_mu_);
  const auto until = Clock::now() + std::chrono::milliseconds(options_.shutdown_timeout_ms);
  while (!worker_exited_ && exit_cv_.wait_until(lock, until) == std::cv_status::no_timeout) {
  }
  if (worker_exited_) {
    lock.Unlock();
    worker_.join();
    return true;
  }
  abandoned_.store(true, std::memory_order_release);
  lock.Unlock();
  worker_.detach();
  std::fprintf(stderr,
               "ferry: engine worker did not stop within %u ms: stuck in a provider call; "
               "abandoning the engine (its memory is leaked, %u transfers never complete)\n",
               options_.shutdown_timeout_ms, inflight_.load());
  return false;
}

}  // namespace ferry::fabric
