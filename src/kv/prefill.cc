// The KV messenger's prefill side (KvPrefill, kv.h): takes requests, follows the forward pass
// through the layer counter, writes each finished layer's pages, then the aux data, and releases
// the source pages. The wire format: messages.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/backoff.h"
#include "common/env.h"
#include "common/mutex.h"
#include "ferry/kv.h"
#include "kv/messages.h"
#include "kv/peer_lru.h"
#include "kv/shards_args.h"

namespace ferry {
namespace kv {
namespace {

class Prefill final : public KvPrefill {
 public:
  Prefill(TransferEngine* engine, const KvSide& prefill, const KvRegions& regions,
          const MemoryRegion* aux, const std::atomic<uint64_t>* layer_counter, Callbacks cb,
          const Options& options)
      : engine_(engine), prefill_(prefill), regions_(regions), aux_(aux), counter_(layer_counter),
        cb_(std::move(cb)), trace_(options.trace) {}

  // Writes still in flight read the caller's regions and count into our counters: wait for them
  // (the engine ends each within its transfer timeout); if some never end, leak their records.
  ~Prefill() override {
    stop_.store(true, std::memory_order_release);
    if (watcher_.joinable()) watcher_.join();
    if (tags_held_) {
      for (uint32_t tag : kTags) (void)engine_->SetTaggedMessageHandler(tag, nullptr);
    }
    bool quiet = true;
    for (auto& [id, a] : pending_) {
      quiet &= a.writes->Wait(a.submitted, Deadline::After(std::chrono::seconds(30))).ok();
    }
    if (!quiet) new std::unordered_map<uint64_t, Active>(std::move(pending_));
  }

  // The messages a prefill takes (the engine's other messages stay its other users').
  static constexpr uint32_t kTags[] = {kRequestMagic, kCancelMagic};

  Status Init() {
    // The handler runs on the engine's worker: it only queues; the watcher parses and adds
    // peers (engine control calls must not run on the worker).
    for (uint32_t tag : kTags) {
      const Status s = engine_->SetTaggedMessageHandler(
          tag, [this](std::optional<PeerId>, std::span<const uint8_t> m) {
            MutexLock lock(mu_);
            inbox_.emplace_back(m.begin(), m.end());
          });
      if (!s.ok()) {
        for (uint32_t t : kTags) {
          if (t == tag) break;
          (void)engine_->SetTaggedMessageHandler(t, nullptr);
        }
        return s.code() == StatusCode::kAlreadyExists
                   ? AlreadyExistsError("KvPrefill: the engine serves another KvPrefill already")
                   : s;
      }
    }
    tags_held_ = true;
    watcher_ = std::thread([this] { Watch(); });
    return Status::Ok();
  }

  Status Cancel(uint64_t request_id) override {
    MutexLock lock(mu_);
    if (!pending_.count(request_id)) {
      return NotFoundError("KV prefill: unknown request " + std::to_string(request_id));
    }
    CancelLocked(request_id);
    return Status::Ok();
  }

  Status ScheduleChunk(uint64_t request_id, int64_t first_page,
                       std::span<const int64_t> src_pages, uint64_t pass_base,
                       int64_t aux_offset) override {
    MutexLock lock(mu_);
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
      if (!PageInLayer(p, page_bytes, static_cast<uint64_t>(regions_.layer_stride))) {
        return OutOfRangeError("KV prefill: source page " + std::to_string(p) + " out of range");
      }
    }
    const bool last = first_page + static_cast<int64_t>(src_pages.size()) == total;
    if (last && a.req.aux_bytes > 0 &&
        (!aux_ || !SliceInside(aux_offset, a.req.aux_bytes, aux_->length()))) {
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

  // Options::trace: each released request prints its last layer's phases to stderr -- the
  // watcher seeing the count, its writes posted, all writes complete -- on CLOCK_MONOTONIC, the
  // clock of the caller's own stamps (ferry-bench kv prints when it bumped the last layer).
  static double MonotonicUs() {  // steady_clock is CLOCK_MONOTONIC on Linux
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void Watch() {
    // The engine's idle policy: with an engine that never idles (spin_us < 0: production, cores
    // of their own) the watcher never sleeps either, and sees a layer counted at once instead of
    // up to a 50 us sleep later (traced: 1-54 us of the tail). An idling engine's
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
      MutexLock lock(mu_);
      inbox.swap(inbox_);
    }
    const bool fresh = !inbox.empty();
    // Requests put off for want of a peer entry go first, in their order.
    const auto now = std::chrono::steady_clock::now();
    std::deque<Deferred> work;
    work.swap(deferred_);
    for (auto& m : inbox) work.push_back({std::move(m), now});
    for (auto& [m, first_seen] : work) {
      if (MagicOf(m) == kCancelMagic) {
        auto f = ParseControl(kCancelMagic, m);
        if (f.ok()) {
          MutexLock lock(mu_);
          auto it = pending_.find(f->request_id);
          if (it != pending_.end() && it->second.req.imm == f->imm) CancelLocked(f->request_id);
        }
        continue;
      }
      auto req = WireRequest::Parse(m);
      if (!req.ok()) continue;  // a malformed request has nobody to answer; drop it
      // One PeerId per decoder however many requests it sends (AddPeer keeps an engine's PeerId
      // until the engine loses it; per request, the peer table once filled up).
      // A full table: the least recently used decoder no request here is being served for
      // leaves the engine (it adds us again with its next request).
      auto peer = decoders_.AddMakingRoom(*engine_, req->decoder_address, [this] {
        std::vector<PeerId> busy;
        MutexLock lock(mu_);
        for (const auto& [id, a] : pending_) busy.push_back(a.peer);
        return busy;
      });
      const bool full = peer.status().code() == StatusCode::kResourceExhausted;
      if (full && now - first_seen < kDeferLimit) {
        // Every entry serves a request still in flight (one ending now releases its entry in a
        // moment): try again on a later pass rather than drop it.
        deferred_.push_back({std::move(m), first_seen});
        continue;
      }
      if (!peer.ok()) continue;
      Incoming in{req->request_id, static_cast<int64_t>(req->pages.size()),
                  req->speculative ? std::max<int64_t>(0, req->num_tokens - 1) : req->num_tokens,
                  req->speculative};
      bool taken = false;
      {
        MutexLock lock(mu_);
        taken = pending_.count(in.request_id) > 0;
        if (!taken) {
          Active a;
          a.req = std::move(*req);
          a.peer = *peer;
          pending_.emplace(in.request_id, std::move(a));
        }
      }
      if (taken) {
        // Another request with this id is in flight here (ids must be unique among in-flight
        // requests): the one in flight goes on, the newcomer is refused as a prefill cancels --
        // an acknowledgement of no writes, which ends it at its decoder at once (Cancelled)
        // instead of at its deadline. The scheduler never hears of it.
        (void)engine_->Send(*peer, ControlMessage(kAckMagic, req->request_id, req->imm, 0), {});
        continue;
      }
      if (cb_.on_request) cb_.on_request(in);
    }
    return fresh;  // (a deferred request alone does not keep the watcher spinning)
  }

  // Posts every layer the counter says is done, for every scheduled chunk; the aux bytes once
  // every chunk of a fully scheduled request has posted its last layer. When the engine's queues
  // are full, posting stops where it is and resumes on the watcher's next pass: the lock is
  // never held while waiting, and a busy engine never fails a request.
  bool PostReadyLayers() {
    const uint64_t done = counter_->load(std::memory_order_acquire);
    bool progress = false;
    awaiting_layers_ = false;
    MutexLock lock(mu_);
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
      MutexLock lock(mu_);
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
  Mutex mu_;
  std::deque<std::vector<uint8_t>> inbox_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, Active> pending_;
  PeerLru decoders_;  // watcher: the decoders we added, by their last request
  // Requests waiting for a peer entry (watcher), at most kDeferLimit from their arrival.
  struct Deferred {
    std::vector<uint8_t> m;
    std::chrono::steady_clock::time_point since;
  };
  static constexpr auto kDeferLimit = std::chrono::seconds(2);
  std::deque<Deferred> deferred_;
  const bool trace_;
  bool tags_held_ = false;  // the engine routes our kTags here (Init), given up at destruction
  bool awaiting_layers_ = false;  // the watcher's last pass: a scheduled chunk awaits a layer
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace
}  // namespace kv

StatusOr<std::unique_ptr<KvPrefill>> KvPrefill::Create(TransferEngine* engine,
                                                       const KvSide& prefill,
                                                       const KvRegions& regions,
                                                       const MemoryRegion* aux,
                                                       const std::atomic<uint64_t>* layer_counter,
                                                       Callbacks callbacks, Options options) {
  if (!engine || !layer_counter) return InvalidArgumentError("KvPrefill: null engine or counter");
  RETURN_IF_ERROR(kv::CheckRegions(prefill, regions));
  auto p = std::make_unique<kv::Prefill>(engine, prefill, regions, aux, layer_counter,
                                         std::move(callbacks), options);
  RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<KvPrefill>(std::move(p));
}

StatusOr<KvPrefillOptions> KvPrefillOptions::FromEnv() {
  KvPrefillOptions o;
  int trace = o.trace;
  RETURN_IF_ERROR(EnvNumber("FERRY_KV_TRACE", &trace, 0, 1));
  o.trace = trace != 0;
  return o;
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
