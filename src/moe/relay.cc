#include "moe/relay.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/backoff.h"
#include "common/leak.h"

namespace ferry::moe {
namespace {

// How the relay thread waits (for the kernels' flags, for peers' sections): spin, then yield for
// about ten milliseconds (it is a dedicated thread, and the next event is usually that close),
// then sleep in short steps so an idle AllToAll costs no CPU.
constexpr uint32_t kSpins = 256, kYields = 1u << 14, kSleepUs = 20;

}  // namespace

RelayLayout::RelayLayout(const AllToAllConfig& c, int64_t slot_bytes_in, int node_ranks_in)
    : n(c.world_size), me(c.rank), node_ranks(node_ranks_in), slot_bytes(slot_bytes_in) {
  const PairLimits pairs(c);
  row_bytes = c.combine_row_bytes();
  slots_per_pair = pairs.slots_per_pair;
  rows_per_pair = pairs.rows_per_pair;
  combine_rows = int64_t{c.max_tokens_per_rank} * c.experts_per_token;
  counts_width = CountsWidth(c);
  counts_bytes = RoundUp(counts_width * 4, 16);
  section_bytes = counts_bytes + slots_per_pair * slot_bytes;
  for (int r = 0; r < n; ++r) {
    if (Remote(r)) remotes.push_back(r);
  }
  const int64_t q = static_cast<int64_t>(remotes.size());
  in_combine_off = RoundUp(q * section_bytes, 128);
  inbox_bytes = in_combine_off + combine_rows * row_bytes;
  out_peer_bytes = RoundUp(section_bytes + rows_per_pair * row_bytes, 128);
  outbox_bytes = q * out_peer_bytes;
  out_slots_off = 2 * 8;  // after the outbox flags
  in_rows_off = out_slots_off + q * 8;
  masks_off = in_rows_off + q * 16;
  control_bytes = RoundUp(masks_off + int64_t{n} * 8, 128);
}

int RelayLayout::RemoteIndex(int of, int rank) const {
  const int first = Node(of) * node_ranks;
  if (rank >= first && rank < first + node_ranks) return -1;
  return rank < first ? rank : rank - node_ranks;
}

Relay::Relay(const AllToAllConfig& config, const RelayLayout& layout, TransferEngine* engine,
             RelayBuffers buffers, uint32_t peer_timeout_ms)
    : c_(config),
      layout_(layout),
      engine_(engine),
      buffers_(buffers),
      peer_timeout_ms_(peer_timeout_ms),
      trace_(config.cuda.relay_trace) {
  targets_.reserve(layout_.remotes.size());
}

StatusOr<std::unique_ptr<Relay>> Relay::Create(const AllToAllConfig& config,
                                               const RelayLayout& layout, TransferEngine* engine,
                                               Bootstrap& bootstrap, RelayBuffers buffers,
                                               uint32_t peer_timeout_ms, uint64_t first_epoch,
                                               bool adopt_counters) {
  if (!engine) {
    return InvalidArgumentError(
        "AllToAll: several nodes need an engine for the traffic between them");
  }
  if (layout.remotes.empty()) return InvalidArgumentError("Relay: no rank outside this node");
  if (!buffers.inbox || !buffers.outbox || !buffers.control || !buffers.inbox_flags) {
    return InvalidArgumentError(
        "Relay: inbox, outbox, control block and inbox flags are all needed");
  }
  std::unique_ptr<Relay> relay(new Relay(config, layout, engine, buffers, peer_timeout_ms));
  RETURN_IF_ERROR(relay->Connect(bootstrap, adopt_counters));
  relay->Start(first_epoch);
  return relay;
}

void Relay::Start(uint64_t epoch) {
  parked_at_ = UINT64_MAX;
  thread_ = std::thread([this, epoch] { Main(epoch); });
}

Relay::~Relay() { Stop(); }

void Relay::RaiseInboxFlag(bool combine, int s, uint64_t epoch) {
  uint64_t* flag = buffers_.inbox_flags + (combine ? layout_.n : 0) + s;
  std::atomic_ref<uint64_t>(*flag).store(epoch + 1, std::memory_order_release);
  // Out of a write-combining buffer (GDRCopy's mapping), in order; a few per step.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool Relay::Stop() {
  if (stopped_) return drained_;
  stopped_ = true;
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
  for (int step = 0; trace_ && step < 2; ++step) {
    const double n = double(std::max<uint64_t>(trace_count_[step], 1));
    std::fprintf(stderr,
                 "[rank %d] relay %s (mean of %llu, us): kernels' flag %.1f, posted %.1f, "
                 "sections landed %.1f, own writes done %.1f\n",
                 c_.rank, step ? "combine" : "dispatch", (unsigned long long)trace_count_[step],
                 trace_us_[step][0] / n, trace_us_[step][1] / n, trace_us_[step][2] / n,
                 trace_us_[step][3] / n);
  }
  // Writes still in flight read the outbox and targets_; the engine ends each within its
  // transfer timeout, so this wait is bounded. If one never ends, leak what it reads.
  drained_ = writes_.Drain(std::chrono::milliseconds(peer_timeout_ms_));
  if (drained_ && inbox_reg_.valid()) {
    // Nothing lands after this, and what landed is counted first (TransferEngine::Revoke): a
    // relay built anew on this instance (a readmission that makes the device or node-once's
    // hops anew) takes the counters over emptied, holding nothing of a peer that wrote late.
    (void)engine_->Revoke(inbox_reg_);
  }
  if (!drained_) {
    LeakOnPurpose(new std::vector<ScatterTarget>(std::move(targets_)));
    LeakOnPurpose(new MemoryRegion(std::move(outbox_reg_)));
    LeakOnPurpose(new MemoryRegion(std::move(inbox_reg_)));
  }
  return drained_;
}

Status Relay::Connect(Bootstrap& bootstrap, bool adopt_counters) {
  ASSIGN_OR_RETURN(inbox_reg_, engine_->RegisterMemory(buffers_.inbox, layout_.inbox_bytes,
                                                       buffers_.boxes, buffers_.device));
  ASSIGN_OR_RETURN(outbox_reg_, engine_->RegisterMemory(buffers_.outbox, layout_.outbox_bytes,
                                                        buffers_.boxes, buffers_.device));
  for (ImmKind kind : {kRelayDispatch, kRelayCombine}) {
    for (uint32_t epoch = 0; epoch < kEpochs; ++epoch) {
      for (int r : layout_.remotes) {
        const uint32_t imm = RelayImm(kind, epoch, c_.instance, r);
        Status s = engine_->CreateImmCounter(imm);
        if (adopt_counters && s.code() == StatusCode::kAlreadyExists) s = Empty(imm);
        if (!s.ok()) return CounterError(s, c_.instance);
      }
    }
  }
  const std::chrono::milliseconds timeout = std::chrono::seconds(60);
  RETURN_IF_ERROR(Meet(bootstrap, inbox_reg_, std::vector<uint8_t>(size_t(c_.world_size), 1),
                       timeout));
  return bootstrap.Barrier(timeout);
}

Status Relay::Meet(Bootstrap& group, const MemoryRegion& inbox,
                   const std::vector<uint8_t>& fresh, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(auto addresses, group.AllGather(engine_->Address(), timeout));
  ASSIGN_OR_RETURN(auto regions, group.AllGather(inbox.remote().Serialize(), timeout));
  std::vector<PeerId> members = peers_;
  members.resize(layout_.remotes.size());
  std::vector<RemoteRegion> inboxes;
  for (size_t q = 0; q < layout_.remotes.size(); ++q) {
    const int r = layout_.remotes[q];
    if (fresh[r]) {
      ASSIGN_OR_RETURN(members[q], engine_->AddPeer(addresses[r]));
    }
    ASSIGN_OR_RETURN(RemoteRegion region, RemoteRegion::Parse(regions[r]));
    if (region.length != static_cast<uint64_t>(layout_.inbox_bytes)) {
      return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                  " registered an inbox of another size");
    }
    inboxes.push_back(region);
  }
  // The first meeting takes a group and a plan; later ones change them in place (the
  // engine's tables only grow), the relay's thread parked, so no scatter of ours is in flight.
  if (peers_.empty()) {
    ASSIGN_OR_RETURN(group_, engine_->AddPeerGroup(members));
    ASSIGN_OR_RETURN(plan_, engine_->PrepareScatter(group_, outbox_reg_, inboxes));
    forgotten_.assign(members.size(), 0);
  } else {
    RETURN_IF_ERROR(engine_->ReplacePeerGroup(group_, members));
    RETURN_IF_ERROR(engine_->RePrepareScatter(plan_, group_, outbox_reg_, inboxes));
    for (size_t q = 0; q < members.size(); ++q) {
      if (fresh[layout_.remotes[q]]) forgotten_[q] = 0;
    }
  }
  peers_ = members;
  return Status::Ok();
}

StatusOr<uint64_t> Relay::Park() {
  if (stopped_ || !thread_.joinable()) return FailedPreconditionError("the relay has stopped");
  stop_.store(true, std::memory_order_release);
  thread_.join();
  stop_.store(false, std::memory_order_release);
  if (failed()) return error();
  if (parked_at_ == UINT64_MAX) {
    const Status s = FailedPreconditionError("the relay was stopped inside an epoch's exchange");
    Fail(s);
    return s;
  }
  if (!writes_.WaitEnded(Deadline::After(std::chrono::milliseconds(peer_timeout_ms_))).ok()) {
    const Status s = DeadlineExceededError("our writes of the last epoch did not end");
    Fail(s);
    return s;
  }
  return parked_at_;
}

Status Relay::Readmit(Bootstrap& group, const std::vector<uint8_t>& readmitted, uint64_t epoch,
                      std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(const uint64_t parked, Park());
  if (parked != epoch) {
    Start(parked);
    return FailedPreconditionError("the relay waits for epoch " + std::to_string(parked) +
                                   "'s dispatch, not " + std::to_string(epoch) + "'s");
  }
  // The processes replaced are forgotten as the engine's peers (those masked as lost already
  // are): nothing of ours goes to them again.
  for (size_t q = 0; q < layout_.remotes.size(); ++q) {
    if (!readmitted[layout_.remotes[q]] || forgotten_[q]) continue;
    forgotten_[q] = 1;
    (void)engine_->RemovePeer(peers_[q]);  // NotFound: gone already
  }
  // The new key first: until every rank has it, the others still write under the old one.
  auto fresh = engine_->RegisterMemory(buffers_.inbox, layout_.inbox_bytes, buffers_.boxes,
                                       buffers_.device);
  if (!fresh.ok()) {
    Start(epoch);
    return fresh.status().WithContext("registering the inbox anew");
  }
  MemoryRegion inbox = std::move(fresh).value();
  if (Status met = Meet(group, inbox, readmitted, timeout); !met.ok()) {
    (void)engine_->Revoke(inbox);
    Start(epoch);
    return met;
  }
  // The fence (see Readmit in relay.h): the old key revoked, then the readmitted ranks'
  // immediates that landed under it dropped, every kind and epoch -- all before the barrier,
  // after which the new processes write under the new keys (an immediate of theirs dropped
  // here would be a section lost). Past the exchange the keys have changed everywhere: if this
  // fails, or a rank is lost before the barrier, the ranks cannot meet again under the old
  // ones, and this AllToAll is over (a new one is created).
  const Status fenced = [&]() -> Status {
    RETURN_IF_ERROR(engine_->Revoke(inbox_reg_).WithContext("revoking the inbox's old key"));
    inbox_reg_ = std::move(inbox);
    for (int r : layout_.remotes) {
      if (!readmitted[r]) continue;
      for (ImmKind kind : {kRelayDispatch, kRelayCombine}) {
        for (uint32_t e = 0; e < kEpochs; ++e) {
          RETURN_IF_ERROR(Empty(RelayImm(kind, e, c_.instance, r)));
        }
      }
    }
    return group.Barrier(timeout);
  }();
  if (!fenced.ok()) {
    const Status over = fenced.WithContext(
        "AllToAll::Readmit, after the new keys were exchanged; this AllToAll is unusable");
    Fail(over);
    return over;
  }
  Start(epoch);
  return Status::Ok();
}

Status Relay::Empty(uint32_t imm) {
  ASSIGN_OR_RETURN(const uint64_t stale, engine_->ImmCount(imm));
  return stale > 0 ? engine_->ConsumeImm(imm, stale) : Status::Ok();
}

Status Relay::error() const {
  MutexLock lock(error_mu_);
  return error_;
}

void Relay::Fail(const Status& s) {
  {
    MutexLock lock(error_mu_);
    if (error_.ok()) error_ = s;
  }
  failed_.store(true, std::memory_order_release);
}

void Relay::Main(uint64_t first_epoch) {
  for (uint64_t epoch = first_epoch;; ++epoch) {
    phase_start_ = Clock::now();
    Status s = WaitDevice(false, epoch);
    if (s.code() == StatusCode::kCancelled) {
      parked_at_ = epoch;  // between epochs: Park's to take up again
      return;
    }
    if (s.ok()) s = Dispatch(epoch);
    if (s.ok()) s = Combine(epoch);
    if (!s.ok()) {
      if (s.code() != StatusCode::kCancelled) {
        Fail(s.WithContext("moe relay, rank " + std::to_string(c_.rank) + ", epoch " +
                           std::to_string(epoch)));
      }
      return;
    }
  }
}

// After the kernels' dispatch flag of `epoch` (Main waits for it).
Status Relay::Dispatch(uint64_t epoch) {
  targets_.clear();
  for (size_t q = 0; q < layout_.remotes.size(); ++q) {
    const int r = layout_.remotes[q];
    if (Masked(r) || Gone(q)) continue;
    const int64_t slots = *layout_.OutSlots(buffers_.control, static_cast<int>(q));
    if (slots < 0 || slots > layout_.slots_per_pair) {
      return InternalError("our counts row for rank " + std::to_string(r) + " holds " +
                           std::to_string(slots) + " slots, at most " +
                           std::to_string(layout_.slots_per_pair) + " fit");
    }
    targets_.push_back({static_cast<uint32_t>(q), uint64_t(layout_.OutSection(q)),
                        uint64_t(layout_.InSection(layout_.RemoteIndex(r, c_.rank))),
                        uint64_t(layout_.counts_bytes + slots * layout_.slot_bytes)});
  }
  return Exchange(kRelayDispatch, epoch, dispatch_bytes_);
}

Status Relay::Combine(uint64_t epoch) {
  phase_start_ = Clock::now();
  RETURN_IF_ERROR(WaitDevice(true, epoch));
  targets_.clear();
  for (size_t q = 0; q < layout_.remotes.size(); ++q) {
    const int s = layout_.remotes[q];
    if (Masked(s) || Gone(q)) continue;  // its counts row may never have come
    // Sender s's counts row of this epoch names where our rows go (copied into the control
    // block by the receive kernel); s rewrites it only after it got them (relay.h).
    const int64_t* in_rows = layout_.InRows(buffers_.control, static_cast<int>(q));
    const int64_t start = in_rows[0], rows = in_rows[1];
    if (rows < 0 || rows > layout_.rows_per_pair || start < 0 ||
        start + rows > layout_.combine_rows) {
      return DataLossError("rank " + std::to_string(s) + " expects " + std::to_string(rows) +
                           " combine rows at row " + std::to_string(start) + " (at most " +
                           std::to_string(layout_.rows_per_pair) + ", within its " +
                           std::to_string(layout_.combine_rows) + " rows)");
    }
    targets_.push_back({static_cast<uint32_t>(q), uint64_t(layout_.OutRows(q)),
                        uint64_t(layout_.in_combine_off + start * layout_.row_bytes),
                        uint64_t(rows * layout_.row_bytes)});
  }
  return Exchange(kRelayCombine, epoch, combine_bytes_);
}

bool Relay::Gone(size_t q) {
  if (forgotten_[q]) return true;
  if (!c_.mask_lost_peers) return false;
  const StatusOr<bool> lost = engine_->PeerLost(peers_[q]);
  if (!lost.ok() || !*lost) return false;
  forgotten_[q] = 1;  // asked of the engine once
  (void)engine_->RemovePeer(peers_[q]);  // ends what is pending to it (removed already: OK)
  return true;
}

Status Relay::ForgetIfLost(int rank) {
  const int q = layout_.RemoteIndex(c_.rank, rank);
  if (forgotten_[q] || layout_.MaskOf(buffers_.control, rank) != kMaskedLost) return Status::Ok();
  forgotten_[q] = 1;
  return engine_->RemovePeer(peers_[q]).WithContext("forgetting lost rank " +
                                                    std::to_string(rank));
}

Status Relay::WaitDevice(bool combine, uint64_t epoch) {
  std::atomic_ref<uint64_t> flag(*layout_.OutboxFlag(buffers_.control, combine));
  Backoff backoff(kSpins, kYields, kSleepUs);
  while (flag.load(std::memory_order_acquire) <= epoch) {
    if (stop_.load(std::memory_order_acquire)) return CancelledError("relay stopped");
    backoff.Pause();
  }
  return Status::Ok();
}

Status Relay::Exchange(ImmKind kind, uint64_t epoch, std::atomic<uint64_t>& bytes) {
  const bool combine = kind == kRelayCombine;
  Clock::time_point stamps[4];
  stamps[0] = Clock::now();
  uint64_t sum = 0;
  for (const ScatterTarget& t : targets_) sum += t.length;
  bytes.store(sum, std::memory_order_relaxed);
  if (!targets_.empty()) {
    RETURN_IF_ERROR(writes_.Post([&](Completion done) {
      return engine_->Scatter({plan_, targets_, RelayImm(kind, epoch, c_.instance, c_.rank)},
                              std::move(done));
    }));
  }
  stamps[1] = Clock::now();
  // Each sender's section as it lands, in whatever order they land: its flag goes up at once,
  // so that a lost rank is the one whose flag the kernels time out on, and so that a step that
  // masks ranks at its deadline (mask_lost_peers) finds every section that had landed raised.
  // Polled with the relay's own patience: a section lands within microseconds to a
  // millisecond, and the engine's WaitImm sleeps sooner than a dedicated thread should. A rank
  // masked meanwhile is waited for no longer. Under mask_lost_peers the steps' deadlines decide
  // who is lost, so the relay waits on without one of its own.
  const Deadline deadline = Deadline::After(std::chrono::milliseconds(peer_timeout_ms_));
  pending_.assign(layout_.remotes.begin(), layout_.remotes.end());
  Backoff backoff(kSpins, kYields, kSleepUs);
  while (!pending_.empty()) {
    bool landed = false;
    for (size_t i = 0; i < pending_.size();) {
      const int s = pending_[i];
      const uint32_t imm = RelayImm(kind, epoch, c_.instance, s);
      ASSIGN_OR_RETURN(const uint64_t count, engine_->ImmCount(imm));
      if (count == 0 && !Masked(s)) {
        ++i;
        continue;
      }
      if (count == 0) {
        RETURN_IF_ERROR(ForgetIfLost(s));
      } else {
        RETURN_IF_ERROR(engine_->ConsumeImm(imm, 1));
        if (buffers_.flush_landed) {
          RETURN_IF_ERROR(buffers_.flush_landed().WithContext(
              "making rank " + std::to_string(s) + "'s section visible to the GPU"));
        }
        RaiseInboxFlag(combine, s, epoch);
        landed = true;
      }
      pending_[i] = pending_.back();
      pending_.pop_back();
    }
    if (pending_.empty()) break;
    if (stop_.load(std::memory_order_acquire)) return CancelledError("relay stopped");
    if (!c_.mask_lost_peers && deadline.Expired()) {
      return DeadlineExceededError("rank " + std::to_string(pending_.front()) + " sent no " +
                                   (combine ? "combine rows" : "dispatch section") + " within " +
                                   std::to_string(peer_timeout_ms_) + " ms");
    }
    if (landed) {
      backoff.Reset();  // the next section is likely close behind
    } else {
      backoff.Pause();
    }
  }
  // Our own writes, before the kernels may rewrite the outbox (relay.h says why they would not
  // anyway) and before targets_ is reused. Under mask_lost_peers a write to a rank that died
  // fails without failing the relay: the steps' deadlines mask that rank.
  stamps[2] = Clock::now();
  RETURN_IF_ERROR(c_.mask_lost_peers ? writes_.WaitEnded(deadline) : writes_.Wait(deadline));
  if (trace_) {
    stamps[3] = Clock::now();
    Clock::time_point from = phase_start_;
    for (int i = 0; i < 4; ++i) {
      trace_us_[combine][i] += std::chrono::duration<double, std::micro>(stamps[i] - from).count();
      from = stamps[i];
    }
    ++trace_count_[combine];
  }
  return Status::Ok();
}

}  // namespace ferry::moe
