// The KV messenger: decode side (requests, counting) and prefill side (scheduling, the layer
// watcher, per-layer page writes, aux data, release).
//
// The request travels as one two-sided message: [magic, version] request id, immediate, the
// decoder's engine address, the decode side's layout, one region descriptor per decode rank,
// layer count and stride, page ids, token count, aux descriptor, offset and length. The decoder
// plans the same transfer with the same seed (the request id) to know how many writes to expect:
// writes per layer x layers, plus one for the aux data. Every write carries the request's
// immediate, so the decoder needs no other notification: a single write as it is, a paged write
// (the writes of one layer that share a length and a source/destination pair, up to
// kMaxBatchPages pages) once per NIC, on that NIC's last page after the others completed,
// weighted by that NIC's pages (WeightedImm), so that together they count as the writes.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "common/backoff.h"
#include "fabric/wire.h"
#include "ferry/kv.h"
#include "kv/shards_args.h"

namespace ferry {
namespace {

constexpr uint32_t kRequestMagic = 0x5152564B;  // "KVRQ"
constexpr uint32_t kImmBase = 0xC0000000u;       // request slot i counts immediate kImmBase + i
// A paged write carries one immediate per NIC for all its pages (imm_once), weighted by the
// pages in these bits (slots use the low 20), so the decoder counts page writes whatever the
// batching.
// Bit 29 stays out of the mask: the moe immediates (0xE0000000 | ...) set it, so none of them
// can ever read as a weighted KV immediate on an engine both use.
constexpr uint32_t kImmWeightMask = 0x1FF00000u;
constexpr uint32_t kMaxBatchPages = WeightLimit(kImmWeightMask);

void PutSide(fabric::ByteWriter& w, const KvSide& s) {
  for (int v : {s.model.kv_heads, s.model.head_dim, s.model.dtype_bytes, int{s.model.mla},
                s.model.page_tokens, static_cast<int>(s.order), s.tp}) {
    w.U32(static_cast<uint32_t>(v));
  }
}

Status GetSide(fabric::ByteReader& r, KvSide* s) {
  uint32_t v[7];
  for (uint32_t& x : v) RETURN_IF_ERROR(r.U32(&x));
  s->model = KvModel{int(v[0]), int(v[1]), int(v[2]), v[3] != 0, int(v[4])};
  if (v[5] > 1) return InvalidArgumentError("KV request: unknown page order");
  s->order = static_cast<KvOrder>(v[5]);
  s->tp = int(v[6]);
  return s->Validate();
}

struct WireRequest {
  uint64_t request_id = 0;
  uint32_t imm = 0;
  std::vector<uint8_t> decoder_address;
  KvSide decode;
  uint32_t num_layers = 0;
  uint64_t layer_stride = 0;
  std::vector<RemoteRegion> dst;  // [decode.tp]
  std::vector<int64_t> pages;
  int64_t num_tokens = 0;
  RemoteRegion aux;
  int64_t aux_offset = 0, aux_bytes = 0;
  bool speculative = false;

  std::vector<uint8_t> Serialize() const {
    fabric::ByteWriter w;
    w.U32(kRequestMagic);
    w.U16(fabric::kWireVersion);
    w.U16(0);
    w.U64(request_id);
    w.U32(imm);
    w.Bytes(decoder_address);
    PutSide(w, decode);
    w.U32(num_layers);
    w.U64(layer_stride);
    for (const RemoteRegion& d : dst) w.Bytes(d.Serialize());
    w.U32(static_cast<uint32_t>(pages.size()));
    for (int64_t p : pages) w.U64(static_cast<uint64_t>(p));
    w.U64(static_cast<uint64_t>(num_tokens));
    w.Bytes(aux.Serialize());
    w.U64(static_cast<uint64_t>(aux_offset));
    w.U64(static_cast<uint64_t>(aux_bytes));
    w.U32(speculative ? 1 : 0);
    return w.Take();
  }

  static StatusOr<WireRequest> Parse(std::span<const uint8_t> bytes) {
    fabric::ByteReader r(bytes, "KV request");
    WireRequest q;
    RETURN_IF_ERROR(r.Header(kRequestMagic));
    RETURN_IF_ERROR(r.U64(&q.request_id));
    RETURN_IF_ERROR(r.U32(&q.imm));
    if ((q.imm & kImmWeightMask) != 0) {
      return InvalidArgumentError("KV request: immediate " + std::to_string(q.imm) +
                                  " uses the bits that carry a paged write's page count");
    }
    RETURN_IF_ERROR(r.Bytes(&q.decoder_address, 4096));
    RETURN_IF_ERROR(GetSide(r, &q.decode));
    RETURN_IF_ERROR(r.U32(&q.num_layers));
    RETURN_IF_ERROR(r.U64(&q.layer_stride));
    if (q.decode.tp > 64) return InvalidArgumentError("KV request: decode TP above 64");
    for (int d = 0; d < q.decode.tp; ++d) {
      std::vector<uint8_t> region;
      RETURN_IF_ERROR(r.Bytes(&region, 256));
      ASSIGN_OR_RETURN(RemoteRegion parsed, RemoteRegion::Parse(region));
      q.dst.push_back(parsed);
    }
    uint32_t n = 0;
    RETURN_IF_ERROR(r.U32(&n));
    if (n > bytes.size() / 8) return InvalidArgumentError("KV request: page count too large");
    q.pages.resize(n);
    for (int64_t& p : q.pages) {
      uint64_t v;
      RETURN_IF_ERROR(r.U64(&v));
      p = static_cast<int64_t>(v);
    }
    uint64_t tokens, off, len;
    RETURN_IF_ERROR(r.U64(&tokens));
    std::vector<uint8_t> aux;
    RETURN_IF_ERROR(r.Bytes(&aux, 256));
    RETURN_IF_ERROR(r.U64(&off));
    RETURN_IF_ERROR(r.U64(&len));
    uint32_t speculative = 0;
    RETURN_IF_ERROR(r.U32(&speculative));
    RETURN_IF_ERROR(r.Finish());
    if (speculative > 1) return InvalidArgumentError("KV request: bad speculative flag");
    q.speculative = speculative == 1;
    q.num_tokens = static_cast<int64_t>(tokens);
    q.aux_offset = static_cast<int64_t>(off);
    q.aux_bytes = static_cast<int64_t>(len);
    if (q.aux_bytes > 0) {
      ASSIGN_OR_RETURN(q.aux, RemoteRegion::Parse(aux));
    }
    return q;
  }
};

Status CheckRegions(const KvSide& side, const KvRegions& regions) {
  RETURN_IF_ERROR(side.Validate());
  if (static_cast<int>(regions.ranks.size()) != side.tp) {
    return InvalidArgumentError("KV: " + std::to_string(regions.ranks.size()) +
                                " regions for TP " + std::to_string(side.tp));
  }
  if (regions.num_layers < 1 || regions.layer_stride < 1) {
    return InvalidArgumentError("KV: num_layers and layer_stride must be >= 1");
  }
  for (const MemoryRegion* r : regions.ranks) {
    if (!r || !r->valid()) return InvalidArgumentError("KV: a rank's region is not registered");
    if (static_cast<uint64_t>(regions.layer_stride) * regions.num_layers > r->length()) {
      return InvalidArgumentError("KV: a rank's region is shorter than num_layers * stride");
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------

// Cancel and its acknowledgement: [magic, version] request id, request immediate, writes posted
// (0 in a cancel). The immediate names the decoder's slot, so an acknowledgement can never be
// taken for a later request that reuses the id.
constexpr uint32_t kCancelMagic = 0x4E43564B;  // "KVCN"
constexpr uint32_t kAckMagic = 0x4143564B;     // "KVCA"

std::vector<uint8_t> ControlMessage(uint32_t magic, uint64_t request_id, uint32_t imm,
                                    uint64_t posted) {
  fabric::ByteWriter w;
  w.U32(magic);
  w.U16(fabric::kWireVersion);
  w.U16(0);
  w.U64(request_id);
  w.U32(imm);
  w.U64(posted);
  return w.Take();
}

struct ControlFields {
  uint64_t request_id = 0;
  uint32_t imm = 0;
  uint64_t posted = 0;
};

StatusOr<ControlFields> ParseControl(uint32_t magic, std::span<const uint8_t> m) {
  fabric::ByteReader r(m, "KV control message");
  ControlFields f;
  RETURN_IF_ERROR(r.Header(magic));
  RETURN_IF_ERROR(r.U64(&f.request_id));
  RETURN_IF_ERROR(r.U32(&f.imm));
  RETURN_IF_ERROR(r.U64(&f.posted));
  RETURN_IF_ERROR(r.Finish());
  return f;
}

uint32_t MagicOf(std::span<const uint8_t> m) {
  uint32_t magic = 0;
  if (m.size() >= 4) std::memcpy(&magic, m.data(), 4);
  return magic;
}

// Each request owns a slot: an immediate counter and the one notification armed on it. A slot is
// only freed from that notification's callback, so a late notification can never reach the next
// request using the slot:
//   waiting    --all writes counted-->                       done (ready OK), slot freed
//   waiting    --deadline or Cancel() or prefill's ack-->    cancelling (send cancel, await ack)
//   cancelling --ack with `posted` and count >= posted-->    user told (Cancelled/Deadline)
//   the ack also disarms the armed notification, which then fires at once: the slot is freed if
//   every acknowledged write landed, else a last notification waits (bounded) for them, after
//   which the slot is freed, or retired for good if some never landed (one may still land).
//   cancelling --no ack within kAckTimeout-->                removing: the remover thread takes
//   the prefill out of the engine (its transfers fail, nothing more goes to it), then tells the
//   user Unavailable and frees the slot; if the removal fails the slot is retired for good.
class Decoder final : public KvDecoder {
 public:
  Decoder(TransferEngine* engine, const KvSide& decode, const KvRegions& regions,
          const MemoryRegion* aux, int max_requests)
      : engine_(engine), decode_(decode), regions_(regions), aux_(aux),
        slots_(static_cast<size_t>(max_requests)) {}

  // No callback may run into a destroyed decoder: stop taking acknowledgements, end every armed
  // notification (their requests report Cancelled), and wait, bounded, for them to run.
  ~Decoder() override {
    engine_->SetMessageHandler(nullptr);
    closing_.store(true, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(remove_mu_);
      remover_stop_ = true;
    }
    remove_cv_.notify_all();
    if (remover_.joinable()) remover_.join();
    // Removals that never ran: their requests end Cancelled; their slots are not reused.
    for (auto [peer, slot] : to_remove_) {
      std::shared_ptr<DoneCallback> tell;
      {
        std::lock_guard<std::mutex> lock(mu_);
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
    while (armed_.load(std::memory_order_acquire) > 0 && !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  Status Init() {
    for (size_t i = 0; i < slots_.size(); ++i) {
      RETURN_IF_ERROR(engine_->CreateWeightedImmCounter(kImmBase + static_cast<uint32_t>(i),
                                                        kImmWeightMask));
      free_.push_back(static_cast<uint32_t>(i));
    }
    // Runs on the worker: only lock-free engine calls and queue pushes from here.
    engine_->SetMessageHandler([this](std::optional<PeerId>, std::span<const uint8_t> m) {
      if (MagicOf(m) != kAckMagic) return;
      auto f = ParseControl(kAckMagic, m);
      if (f.ok()) OnAck(f->request_id, f->imm, f->posted);
    });
    // Engine control calls (RemovePeer) must not run on the engine's worker, where the
    // notifications fire: a thread of our own takes unresponsive prefills out.
    remover_ = std::thread([this] { RemoveUnresponsive(); });
    return Status::Ok();
  }

  Status Submit(const Request& req, Deadline deadline, DoneCallback ready) override {
    ASSIGN_OR_RETURN(KvPlan plan, PlanKvTransfer(req.prefill, decode_, DummyPages(req.pages.size()),
                                                 req.pages, req.request_id));
    const int64_t page_bytes = decode_.page_bytes();
    for (int64_t p : req.pages) {
      if ((p + 1) * page_bytes > regions_.layer_stride) {
        return OutOfRangeError("KV request: page " + std::to_string(p) +
                               " lies outside the layer of " +
                               std::to_string(regions_.layer_stride) + " bytes");
      }
    }
    if (req.aux_bytes > 0 &&
        (!aux_ || req.aux_offset < 0 ||
         static_cast<uint64_t>(req.aux_offset + req.aux_bytes) > aux_->length())) {
      return OutOfRangeError("KV request: aux slot outside the aux region");
    }
    ASSIGN_OR_RETURN(PeerId prefill, PeerFor(req.prefill_address));
    const uint64_t expected = static_cast<uint64_t>(plan.writes.size()) * regions_.num_layers +
                              (req.aux_bytes > 0 ? 1 : 0);
    uint32_t slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
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
    for (const MemoryRegion* r : regions_.ranks) w.dst.push_back(r->remote());
    w.pages.assign(req.pages.begin(), req.pages.end());
    w.num_tokens = req.num_tokens;
    if (req.aux_bytes > 0) w.aux = aux_->remote();
    w.aux_offset = req.aux_offset;
    w.aux_bytes = req.aux_bytes;
    w.speculative = req.speculative;
    // Send, then arm: immediates that land first are counted all the same, and arming checks
    // the count at once. A refused send (queue full) leaves nothing behind.
    Status sent = engine_->Send(prefill, w.Serialize(), {});
    if (!sent.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
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
      std::lock_guard<std::mutex> lock(mu_);
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
  enum class State { kFree, kWaiting, kCancelling, kRemoving, kRetired };
  struct Slot {
    State state = State::kFree;
    uint64_t request_id = 0;
    PeerId prefill = 0;
    uint64_t expected = 0;
    std::shared_ptr<DoneCallback> ready;
    bool told = false;       // the user's callback ran
    bool acked = false;      // the prefill acknowledged a cancel
    uint64_t posted = 0;     // writes the prefill posted before it stopped
    bool draining = false;   // armed to wait for the acknowledged writes still in flight
    Status outcome;          // what a cancelled request reports
  };

  // How long to wait for the prefill's acknowledgement of a cancel before giving up on it.
  static constexpr auto kAckTimeout = std::chrono::seconds(5);

  Status Arm(uint32_t slot, uint64_t target, Deadline deadline) {
    armed_.fetch_add(1, std::memory_order_acq_rel);
    Status s = engine_->NotifyImm(kImmBase + slot, target, deadline, [this, slot](const Status& st) {
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
      std::lock_guard<std::mutex> lock(mu_);
      Slot& st = slots_[slot];
      if (closing_.load(std::memory_order_acquire)) {
        // The decoder is going away: report what did not end, re-arm nothing.
        if (!st.told && st.state != State::kFree && st.state != State::kRetired) {
          tell = st.ready;
          tell_status = s.ok() ? Status::Ok() : CancelledError("KV decoder destroyed");
          st.told = true;
        }
        st.state = State::kRetired;
      } else if (s.ok() && !st.told && !st.draining) {
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
      } else if (st.state == State::kCancelling && !st.acked) {
        rearm = !st.told && s.code() != StatusCode::kDeadlineExceeded;
        if (!rearm) {
          // No acknowledgement in time: the prefill may still write. It goes out of the engine
          // before the slot (and the request's pages) are given back.
          st.state = State::kRemoving;
          Forget(slot);
          {
            std::lock_guard<std::mutex> remove_lock(remove_mu_);
            to_remove_.emplace_back(st.prefill, slot);
          }
          remove_cv_.notify_one();
        }
      } else if (st.state == State::kCancelling && st.acked) {
        const uint64_t seen = Count(slot);
        if (seen >= st.posted) {
          (void)engine_->ConsumeImm(kImmBase + slot, seen);
          if (!st.told) {
            tell = st.ready;
            tell_status = st.outcome;
          }
          Free(slot);
        } else if (!st.draining) {
          // Acknowledged writes are still in flight: wait for them, bounded.
          st.draining = true;
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
    std::shared_ptr<DoneCallback> tell;
    Status tell_status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint32_t slot = imm - kImmBase;
      if (imm < kImmBase || slot >= slots_.size()) return;
      Slot& st = slots_[slot];
      if (st.request_id != request_id) return;
      if (st.state == State::kWaiting) {  // the prefill cancelled on its own
        st.state = State::kCancelling;
        st.outcome = CancelledError("KV request " + std::to_string(request_id) +
                                    " cancelled by the prefill");
      }
      if (st.state != State::kCancelling || st.acked) return;
      st.acked = true;
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
        std::unique_lock<std::mutex> lock(remove_mu_);
        remove_cv_.wait(lock, [&] { return remover_stop_ || !to_remove_.empty(); });
        if (remover_stop_) return;
        job = to_remove_.front();
        to_remove_.pop_front();
      }
      const auto [peer, slot] = job;
      auto it = removed.find(peer);
      if (it == removed.end()) it = removed.emplace(peer, engine_->RemovePeer(peer)).first;
      std::shared_ptr<DoneCallback> tell;
      Status tell_status;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Slot& st = slots_[slot];
        if (st.state != State::kRemoving) continue;
        tell = st.told ? nullptr : st.ready;
        if (it->second.ok()) {
          tell_status = UnavailableError(
              "KV request " + std::to_string(st.request_id) +
              ": the prefill did not acknowledge the cancel; it was removed from the engine and "
              "the request's pages are free");
          Free(slot);
        } else {
          tell_status = UnavailableError(
              "KV request " + std::to_string(st.request_id) +
              ": the prefill did not acknowledge the cancel and could not be removed (" +
              it->second.ToString() + "); the pages stay reserved");
          st.told = true;
          st.state = State::kRetired;
        }
      }
      Tell(tell, tell_status);
    }
  }

  // Drops the request id's mapping if it still names this slot (mu_ held).
  void Forget(uint32_t slot) {
    auto it = by_request_.find(slots_[slot].request_id);
    if (it != by_request_.end() && it->second == slot) by_request_.erase(it);
  }

  void Free(uint32_t slot) {  // mu_ held
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

  StatusOr<PeerId> PeerFor(std::span<const uint8_t> address) {
    std::string key(address.begin(), address.end());
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) return it->second;
    ASSIGN_OR_RETURN(PeerId p, engine_->AddPeer(address));
    peers_[key] = p;
    return p;
  }

  TransferEngine* engine_;
  const KvSide decode_;
  const KvRegions regions_;
  const MemoryRegion* aux_;
  std::mutex mu_;
  std::vector<Slot> slots_;
  std::deque<uint32_t> free_;
  std::unordered_map<uint64_t, uint32_t> by_request_;
  std::mutex peers_mu_;
  std::unordered_map<std::string, PeerId> peers_;
  std::atomic<int> armed_{0};  // notifications armed and not yet run
  std::atomic<bool> closing_{false};
  // Unresponsive prefills to take out of the engine: (peer, slot waiting on it).
  std::mutex remove_mu_;
  std::condition_variable remove_cv_;
  std::deque<std::pair<PeerId, uint32_t>> to_remove_;
  bool remover_stop_ = false;
  std::thread remover_;  // last: starts in Init, once everything above exists
};

// ---------------------------------------------------------------------------------------------

class Prefill final : public KvPrefill {
 public:
  Prefill(TransferEngine* engine, const KvSide& prefill, const KvRegions& regions,
          const MemoryRegion* aux, const std::atomic<uint64_t>* layer_counter, Callbacks cb)
      : engine_(engine), prefill_(prefill), regions_(regions), aux_(aux), counter_(layer_counter),
        cb_(std::move(cb)), trace_(TraceOn()) {}

  // Writes still in flight read the caller's regions and count into our counters: wait for them
  // (the engine ends each within its transfer timeout); if some never end, leak their records.
  ~Prefill() override {
    stop_.store(true, std::memory_order_release);
    if (watcher_.joinable()) watcher_.join();
    engine_->SetMessageHandler(nullptr);
    bool quiet = true;
    for (auto& [id, a] : pending_) {
      quiet &= a.writes->Wait(a.submitted, Deadline::After(std::chrono::seconds(30))).ok();
    }
    if (!quiet) new std::unordered_map<uint64_t, Active>(std::move(pending_));
  }

  Status Init() {
    // The handler runs on the engine's worker: it only queues; the watcher parses and adds
    // peers (engine control calls must not run on the worker).
    engine_->SetMessageHandler([this](std::optional<PeerId>, std::span<const uint8_t> m) {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_.emplace_back(m.begin(), m.end());
    });
    watcher_ = std::thread([this] { Watch(); });
    return Status::Ok();
  }

  Status Cancel(uint64_t request_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pending_.count(request_id)) {
      return NotFoundError("KV prefill: unknown request " + std::to_string(request_id));
    }
    CancelLocked(request_id);
    return Status::Ok();
  }

  Status ScheduleChunk(uint64_t request_id, int64_t first_page,
                       std::span<const int64_t> src_pages, uint64_t pass_base,
                       int64_t aux_offset) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(request_id);
    if (it == pending_.end()) {
      return NotFoundError("KV prefill: unknown request " + std::to_string(request_id));
    }
    Active& a = it->second;
    const int64_t total = static_cast<int64_t>(a.req.pages.size());
    if (first_page != a.pages_scheduled) {
      return FailedPreconditionError("KV prefill: chunk starts at page " +
                                     std::to_string(first_page) + ", expected " +
                                     std::to_string(a.pages_scheduled));
    }
    if (static_cast<int64_t>(src_pages.size()) > total - first_page ||
        (src_pages.empty() && total > 0)) {
      return InvalidArgumentError("KV prefill: chunk of " + std::to_string(src_pages.size()) +
                                  " pages from page " + std::to_string(first_page) +
                                  " of a request of " + std::to_string(total));
    }
    const int64_t page_bytes = prefill_.page_bytes();
    for (int64_t p : src_pages) {
      if (p < 0 || (p + 1) * page_bytes > regions_.layer_stride) {
        return OutOfRangeError("KV prefill: source page " + std::to_string(p) + " out of range");
      }
    }
    const bool last = first_page + static_cast<int64_t>(src_pages.size()) == total;
    if (last && a.req.aux_bytes > 0 &&
        (!aux_ || aux_offset < 0 ||
         static_cast<uint64_t>(aux_offset + a.req.aux_bytes) > aux_->length())) {
      return OutOfRangeError("KV prefill: aux source outside the aux region");
    }
    if (a.req.num_layers != static_cast<uint32_t>(regions_.num_layers)) {
      return InvalidArgumentError("KV prefill: the decoder has " +
                                  std::to_string(a.req.num_layers) + " layers, we have " +
                                  std::to_string(regions_.num_layers));
    }
    Chunk chunk;
    ASSIGN_OR_RETURN(chunk.plan,
                     PlanKvTransfer(prefill_, a.req.decode, src_pages,
                                    std::span<const int64_t>(a.req.pages)
                                        .subspan(first_page, src_pages.size()),
                                    request_id));
    chunk.pass_base = pass_base;
    chunk.batches = Batch::Group(chunk.plan.writes, engine_->info().max_msg_size);
    a.chunks.push_back(std::move(chunk));
    a.pages_scheduled += static_cast<int64_t>(src_pages.size());
    if (last) {
      a.aux_src_offset = aux_offset;
      a.scheduled = true;
    }
    return Status::Ok();
  }

 private:
  // A layer's writes with one source shard, one destination shard and one length: posted as
  // one paged write (one submission, one completion and one weighted immediate, not one each),
  // page i from src_index[i] * src_stride to dst_index[i] * dst_stride past the layer's base.
  // Writes that cannot share one (see Group) go alone, as single writes (which split).
  struct Batch {
    int src_rank = 0, dst_rank = 0;
    uint64_t length = 0, src_stride = 1, dst_stride = 1;
    std::vector<uint32_t> src_index, dst_index;
    std::optional<KvWrite> single;

    // The plan's writes grouped by (source rank, destination rank, length), in the order each
    // group first appears: each group can be one paged write (a paged write takes any list of
    // pages). A group whose write is longer than the message size, or whose offsets do not fit
    // 32-bit page indices, goes write by write.
    static std::vector<Batch> Group(const std::vector<KvWrite>& writes, uint64_t max_page) {
      std::vector<std::vector<size_t>> groups;
      std::map<std::tuple<int, int, int64_t>, size_t> group_of;
      for (size_t k = 0; k < writes.size(); ++k) {
        const KvWrite& w = writes[k];
        auto [it, fresh] = group_of.try_emplace({w.src_rank, w.dst_rank, w.length}, groups.size());
        if (fresh) groups.emplace_back();
        groups[it->second].push_back(k);
      }
      std::vector<Batch> out;
      for (const auto& members : groups) {
        const KvWrite& first = writes[members.front()];
        Batch b;
        b.src_rank = first.src_rank;
        b.dst_rank = first.dst_rank;
        b.length = uint64_t(first.length);
        uint64_t src_gcd = 0, dst_gcd = 0;
        for (size_t k : members) {
          src_gcd = std::gcd(src_gcd, uint64_t(writes[k].src_offset));
          dst_gcd = std::gcd(dst_gcd, uint64_t(writes[k].dst_offset));
        }
        b.src_stride = std::max<uint64_t>(src_gcd, 1);
        b.dst_stride = std::max<uint64_t>(dst_gcd, 1);
        bool paged = b.length <= max_page;
        for (size_t k : members) {
          if (!paged) break;
          const uint64_t src = uint64_t(writes[k].src_offset) / b.src_stride;
          const uint64_t dst = uint64_t(writes[k].dst_offset) / b.dst_stride;
          paged = src <= UINT32_MAX && dst <= UINT32_MAX;
          b.src_index.push_back(uint32_t(src));
          b.dst_index.push_back(uint32_t(dst));
        }
        if (paged) {  // in even pieces of at most kMaxBatchPages pages (one weighted immediate
                      // each): 512 pages go as 256 + 256, not 511 + a straggler of 1
          const size_t pages = b.src_index.size();
          const size_t pieces = (pages + kMaxBatchPages - 1) / kMaxBatchPages;
          const size_t per = (pages + pieces - 1) / pieces;
          for (size_t lo = 0; lo < pages; lo += per) {
            const size_t hi = std::min(pages, lo + per);
            Batch piece = b;
            piece.src_index.assign(b.src_index.begin() + lo, b.src_index.begin() + hi);
            piece.dst_index.assign(b.dst_index.begin() + lo, b.dst_index.begin() + hi);
            out.push_back(std::move(piece));
          }
        } else {
          for (size_t k : members) out.push_back(Batch{.single = writes[k]});
        }
      }
      return out;
    }
  };
  struct Chunk {
    KvPlan plan;
    std::vector<Batch> batches;  // the plan's writes of one layer, grouped
    uint64_t pass_base = 0;
    int next_layer = 0;     // layers fully posted so far
    size_t next_batch = 0;  // first batch of next_layer not yet posted
  };
  struct Active {
    WireRequest req;
    PeerId peer = 0;
    std::vector<Chunk> chunks;
    int64_t pages_scheduled = 0;
    bool scheduled = false;  // every page is in some chunk
    bool aux_posted = false;
    bool cancelled = false;  // post nothing more; acknowledge once the posted writes complete
    int64_t aux_src_offset = 0;
    Status failure;  // a post that could not be made; reported at release
    std::shared_ptr<TransferCounter> writes = std::make_shared<TransferCounter>();
    uint64_t submitted = 0;  // transfers (each ends in one completion)
    uint64_t posted = 0;     // writes (each carries one immediate)
    // FERRY_KV_TRACE: when the watcher first saw a chunk's last layer counted, had posted
    // every chunk's last layer, and saw all writes complete (CLOCK_MONOTONIC µs; 0 until then).
    double last_seen_us = 0, last_posted_us = 0, done_us = 0;
  };

  // FERRY_KV_TRACE=1: each released request prints its last layer's phases to stderr -- the
  // watcher seeing the count, its writes posted, all writes complete -- on CLOCK_MONOTONIC, the
  // clock of the caller's own stamps (ferry-bench kv prints when it bumped the last layer).
  static bool TraceOn() {
    const char* t = std::getenv("FERRY_KV_TRACE");
    return t && *t && *t != '0';
  }
  static double MonotonicUs() {  // steady_clock is CLOCK_MONOTONIC on Linux
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void Watch() {
    // The engine's idle policy: with an engine that never idles (spin_us < 0: production, cores
    // of their own) the watcher never sleeps either, and sees a layer counted at once instead of
    // up to a 50 us sleep later (session 9's trace: 1-54 us of the tail). An idling engine's
    // watcher still never sleeps while a scheduled chunk awaits a layer (as the engine's worker
    // never sleeps while a notification is armed): it yields, and sees the layer within
    // microseconds; it sleeps only with no layer to wait for.
    const bool never_idle = engine_->options().spin_us < 0;
    Backoff backoff(64, never_idle ? Backoff::kYieldForever : 256, 50);
    while (!stop_.load(std::memory_order_acquire)) {
      bool progress = DrainInbox();
      progress |= PostReadyLayers();
      progress |= ReleaseFinished();
      if (progress) {
        backoff.Reset();
      } else {
        backoff.Pause(!awaiting_layers_);
      }
    }
  }

  bool DrainInbox() {
    std::deque<std::vector<uint8_t>> inbox;
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox.swap(inbox_);
    }
    for (auto& m : inbox) {
      if (MagicOf(m) == kCancelMagic) {
        auto f = ParseControl(kCancelMagic, m);
        if (f.ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = pending_.find(f->request_id);
          if (it != pending_.end() && it->second.req.imm == f->imm) CancelLocked(f->request_id);
        }
        continue;
      }
      auto req = WireRequest::Parse(m);
      if (!req.ok()) continue;  // a malformed request has nobody to answer; drop it
      auto peer = engine_->AddPeer(req->decoder_address);
      if (!peer.ok()) continue;
      Incoming in{req->request_id, static_cast<int64_t>(req->pages.size()),
                  req->speculative ? std::max<int64_t>(0, req->num_tokens - 1) : req->num_tokens,
                  req->speculative};
      {
        std::lock_guard<std::mutex> lock(mu_);
        Active a;
        a.req = std::move(req).value();
        a.peer = *peer;
        pending_.emplace(in.request_id, std::move(a));
      }
      if (cb_.on_request) cb_.on_request(in);
    }
    return !inbox.empty();
  }

  // Posts every layer the counter says is done, for every scheduled chunk; the aux bytes once
  // every chunk of a fully scheduled request has posted its last layer. When the engine's queues
  // are full, posting stops where it is and resumes on the watcher's next pass: the lock is
  // never held while waiting, and a busy engine never fails a request.
  bool PostReadyLayers() {
    const uint64_t done = counter_->load(std::memory_order_acquire);
    bool progress = false;
    awaiting_layers_ = false;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, a] : pending_) {
      if (a.cancelled) continue;
      bool all_posted = true;
      for (Chunk& chunk : a.chunks) {
        if (trace_ && a.last_seen_us == 0 && done >= chunk.pass_base + regions_.num_layers) {
          a.last_seen_us = MonotonicUs();
        }
        while (a.failure.ok() && chunk.next_layer < regions_.num_layers &&
               done >= chunk.pass_base + chunk.next_layer + 1) {
          const uint64_t before = a.submitted;
          const bool layer_done = PostLayer(a, chunk);
          progress |= a.submitted != before;
          if (!layer_done) break;
          ++chunk.next_layer;
        }
        if (a.failure.ok() && chunk.next_layer < regions_.num_layers) {
          all_posted = false;
          // Not yet counted (rather than waiting for room in the engine's queues).
          awaiting_layers_ |= done < chunk.pass_base + chunk.next_layer + 1;
        }
      }
      if (trace_ && a.scheduled && all_posted && a.last_posted_us == 0) {
        a.last_posted_us = MonotonicUs();
      }
      if (!a.scheduled || !all_posted || a.aux_posted) continue;
      if (a.req.aux_bytes > 0 && a.failure.ok()) {
        SingleWrite w{aux_, static_cast<uint64_t>(a.aux_src_offset), a.peer, a.req.aux,
                      static_cast<uint64_t>(a.req.aux_offset),
                      static_cast<uint64_t>(a.req.aux_bytes), a.req.imm};
        if (!Post(a, w)) continue;  // queues full: next pass
      }
      a.aux_posted = true;
      progress = true;
    }
    return progress;
  }

  // Posts the rest of `chunk`'s current layer, from chunk.next_batch. True when the whole layer
  // is posted (or the request failed); false when the engine's queues are full.
  bool PostLayer(Active& a, Chunk& chunk) {
    const uint64_t src_base = uint64_t(chunk.next_layer) * regions_.layer_stride;
    const uint64_t dst_base = uint64_t(chunk.next_layer) * a.req.layer_stride;
    for (; chunk.next_batch < chunk.batches.size(); ++chunk.next_batch) {
      const Batch& b = chunk.batches[chunk.next_batch];
      if (b.single) {
        const KvWrite& kw = *b.single;
        SingleWrite w{regions_.ranks[kw.src_rank], src_base + kw.src_offset, a.peer,
                      a.req.dst[kw.dst_rank], dst_base + kw.dst_offset,
                      static_cast<uint64_t>(kw.length), a.req.imm};
        if (!Post(a, w)) return !a.failure.ok();
        continue;
      }
      PagedWrite w{regions_.ranks[b.src_rank], a.peer, a.req.dst[b.dst_rank], b.length,
                   b.src_stride, b.dst_stride, src_base, dst_base, b.src_index, b.dst_index,
                   a.req.imm, /*imm_once=*/true, kImmWeightMask};
      Status s = engine_->WritePaged(w, Completion::Counter(a.writes.get()));
      if (!Counted(a, s, b.src_index.size())) return !a.failure.ok();
    }
    chunk.next_batch = 0;
    return true;
  }

  // One write of a request. False when it was not posted: the queues are full (retry later) or
  // the engine refused it (recorded as the request's failure).
  bool Post(Active& a, const SingleWrite& w) {
    return Counted(a, engine_->Write(w, Completion::Counter(a.writes.get())), 1);
  }

  // Books a submission of `writes` writes; false if it was refused.
  bool Counted(Active& a, const Status& s, uint64_t writes) {
    if (s.ok()) {
      ++a.submitted;
      a.posted += writes;
      return true;
    }
    if (s.code() != StatusCode::kResourceExhausted) a.failure = s;
    return false;
  }

  // Stops a request (mu_ held). Unknown ids (already released) need no answer: a request that
  // completed has told its decoder through the immediates.
  void CancelLocked(uint64_t request_id) {
    auto it = pending_.find(request_id);
    if (it != pending_.end()) it->second.cancelled = true;
  }

  // Requests whose writes all completed release their source pages.
  bool ReleaseFinished() {
    std::vector<std::pair<uint64_t, Status>> released;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        Active& a = it->second;
        const uint64_t ended = a.writes->done.load() + a.writes->failed.load();
        if (trace_ && a.last_posted_us != 0 && a.done_us == 0 && ended == a.submitted) {
          a.done_us = MonotonicUs();
        }
        if (a.cancelled && ended == a.submitted) {
          // Every write we posted has completed: acknowledge with their number, so the decoder
          // knows when the last one has landed.
          (void)engine_->Send(a.peer, ControlMessage(kAckMagic, it->first, a.req.imm, a.posted),
                              {});
          released.emplace_back(it->first,
                                CancelledError("KV request " + std::to_string(it->first) +
                                               " cancelled"));
          it = pending_.erase(it);
        } else if (a.scheduled && a.aux_posted && ended == a.submitted) {
          Status s = a.failure;
          if (trace_) {
            std::fprintf(stderr,
                         "kv trace request %llu: last layer seen at %.1f us, posted +%.1f, "
                         "writes complete +%.1f (%llu writes)\n",
                         (unsigned long long)it->first, a.last_seen_us,
                         a.last_posted_us - a.last_seen_us, a.done_us - a.last_seen_us,
                         (unsigned long long)a.posted);
          }
          if (s.ok() && a.writes->failed.load() > 0) {
            s = UnavailableError("KV prefill: " + std::to_string(a.writes->failed.load()) +
                                 " writes of request " + std::to_string(it->first) + " failed");
          }
          released.emplace_back(it->first, s);
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& [id, s] : released) {
      if (cb_.on_released) cb_.on_released(id, s);
    }
    return !released.empty();
  }

  TransferEngine* engine_;
  const KvSide prefill_;
  const KvRegions regions_;
  const MemoryRegion* aux_;
  const std::atomic<uint64_t>* counter_;
  const Callbacks cb_;
  std::mutex mu_;
  std::deque<std::vector<uint8_t>> inbox_;
  std::unordered_map<uint64_t, Active> pending_;
  const bool trace_;
  bool awaiting_layers_ = false;  // the watcher's last pass: a scheduled chunk awaits a layer
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace

StatusOr<std::unique_ptr<KvDecoder>> KvDecoder::Create(TransferEngine* engine,
                                                       const KvSide& decode,
                                                       const KvRegions& regions,
                                                       const MemoryRegion* aux,
                                                       int max_requests) {
  if (!engine) return InvalidArgumentError("KvDecoder: null engine");
  if (max_requests < 1 || max_requests > (1 << 20)) {
    return InvalidArgumentError("KvDecoder: max_requests must be in [1, 2^20]");
  }
  RETURN_IF_ERROR(CheckRegions(decode, regions));
  auto d = std::make_unique<Decoder>(engine, decode, regions, aux, max_requests);
  RETURN_IF_ERROR(d->Init());
  return std::unique_ptr<KvDecoder>(std::move(d));
}

StatusOr<std::unique_ptr<KvPrefill>> KvPrefill::Create(TransferEngine* engine,
                                                       const KvSide& prefill,
                                                       const KvRegions& regions,
                                                       const MemoryRegion* aux,
                                                       const std::atomic<uint64_t>* layer_counter,
                                                       Callbacks callbacks) {
  if (!engine || !layer_counter) return InvalidArgumentError("KvPrefill: null engine or counter");
  RETURN_IF_ERROR(CheckRegions(prefill, regions));
  auto p = std::make_unique<Prefill>(engine, prefill, regions, aux, layer_counter,
                                     std::move(callbacks));
  RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<KvPrefill>(std::move(p));
}

#ifndef FERRY_HAVE_CUDA
StatusOr<std::unique_ptr<GpuLayerCounter>> GpuLayerCounter::Create() {
  return UnimplementedError("GpuLayerCounter: ferry was built without CUDA");
}
StatusOr<std::unique_ptr<KvCudaShards>> KvCudaShards::Create(Bootstrap& bootstrap, int leader, int,
                                                             int64_t bytes,
                                                             std::chrono::milliseconds) {
  RETURN_IF_ERROR(CheckCudaShardsArgs(bootstrap, leader, bytes));
  return UnimplementedError("KvCudaShards: ferry was built without CUDA");
}
#endif

}  // namespace ferry
