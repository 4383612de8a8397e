// The TransferEngine: submission from any thread, one worker thread that owns the Domain.
// This header: the Engine, TransferEngine's implementation, and the types its three parts
// share: TransferEngine's methods (transfer_engine.cc, the caller side), the machinery they
// use (engine.cc: construction, checks, requests, control operations) and the worker
// (engine_worker.cc).
//
// Life of a transfer:
//   caller thread: Submit validates everything (peer, descriptors, bounds, page indices), takes an
//     admission ticket (max_transfers), resolves addresses, pushes a Request on the lock-free
//     queue and wakes the worker if it sleeps. Nothing is allocated, nothing locked.
//   worker thread: pops the Request into a Transfer slot, expands it into work requests (one per
//     chunk, page, slice or member) as provider queue space and WR contexts allow, polls the CQ,
//     and finishes the transfer when its last WR completes: exactly one Completion::Finish.
// A transfer that outlives transfer_timeout_ms fails with DeadlineExceeded and marks its peer
// lost; its WRs still owned by the provider keep the slot until they complete or the engine
// closes.
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
// Beside these: fabric_types.cc (completions, regions, options from the environment),
// domain_group.cc (opening the NICs an engine drives) and engine_internal.h (creating an engine
// over given Domains, as tests do: what needs no more of the engine than that includes it, not
// this header).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/bounded_queue.h"
#include "common/mutex.h"
#include "fabric/domain.h"
#include "fabric/engine_internal.h"
#include "fabric/imm_counters.h"
#include "ferry/fabric.h"

namespace ferry::fabric {

inline std::string PeerName(PeerId peer) { return "peer " + std::to_string(peer); }

// A PeerId is a slot of the peer table (low 16 bits) and that slot's generation (high 16): a
// removed peer's slot serves the next AddPeer with the generation one up, so the table holds
// the peers of now (max_peers), not every peer there ever was, and an old PeerId never reaches
// the slot's new peer. A slot whose generation would wrap is retired instead.
constexpr uint32_t kPeerSlotBits = 16;
constexpr uint32_t kMaxPeerSlots = 1u << kPeerSlotBits;
constexpr uint32_t kMaxPeerGeneration = (1u << (32 - kPeerSlotBits)) - 1;
inline uint32_t PeerSlot(PeerId peer) { return peer & (kMaxPeerSlots - 1); }
inline uint32_t PeerGeneration(PeerId peer) { return peer >> kPeerSlotBits; }

enum class Kind : uint8_t { kSingle, kPaged, kScatter, kBarrier, kImm, kSend, kNotify, kDisarm };

using Descs = std::array<void*, kMaxNics>;

// One slot of the peer table; addr and sink indexed by local NIC k: what k sends to (the peer's
// NIC k mod remote_nics). Written on the worker only (AddPeer and RemovePeer run there), `id`
// last: a caller thread that reads a field for a PeerId checks `id` (acquire) first, and the
// worker checks it again before it posts anything (a slot may be reused in between).
struct PeerEntry {
  std::atomic<PeerId> id{0};              // the PeerId now in this slot
  std::array<uint64_t, kMaxNics> addr{};  // provider address (fi_addr_t) in domain k
  std::array<NicKey, kMaxNics> sink{};    // the peer's immediate sink, as seen from NIC k
  std::atomic<uint32_t> remote_nics{1};
  std::atomic<uint64_t> engine_id{0};
  std::vector<std::pair<uint32_t, uint64_t>> inserted;  // (local NIC, address): all AV entries
  std::atomic<bool> lost{false};
  bool removed = false;  // add_mu_: RemovePeer ran (the slot is free or retired)
  // What the worker posted to this peer through each local NIC (TransferEngine::Traffic): the
  // worker's own counters, zeroed when AddPeer fills the slot.
  struct Traffic {
    std::atomic<uint64_t> writes{0}, bytes{0}, imms{0}, sends{0};
  };
  std::array<Traffic, kMaxNics> traffic{};
};

// One member of a prepared scatter: its peer, the local NIC that posts to it, and its
// destination region as that NIC sees it (provider address, base, key, length).
struct ScatterMember {
  PeerId peer;
  uint32_t nic;  // the local NIC that serves this member (its address: the peer's entry)
  uint64_t base;
  uint64_t key;
  uint64_t length;
};

// A scatter prepared once (PrepareScatter) and replayed by each Scatter on it.
struct ScatterPlan {
  const uint8_t* src = nullptr;
  uint64_t src_length = 0;
  Descs src_desc{};
  std::vector<ScatterMember> members;
};

// A group of peers (AddPeerGroup), for Scatter and Barrier.
struct PeerGroup {
  std::vector<PeerId> members;
};

// A submitted transfer, as it travels through the submission queue. Everything the worker needs
// is resolved on the caller's thread.
struct Request {
  Kind kind = Kind::kSingle;
  bool has_imm = false;
  bool imm_once = false;         // paged: the immediate on each NIC's last page (PostPending)
  uint32_t imm_weight_mask = 0;  // imm_once: those immediates carry their NIC's pages here
  uint32_t imm = 0;
  PeerId peer = 0;                   // single-peer kinds
  const PeerEntry* entry = nullptr;  // single-peer kinds
  uint32_t first_nic = 0;            // see the file comment
  const uint8_t* src = nullptr;      // local bytes of offset 0 (after src_offset)
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

// A Request in flight on the worker: its work requests posted and outstanding, its deadline,
// its first error.
struct Transfer {
  Request req;
  uint32_t total = 0;          // WRs this transfer posts
  uint32_t next = 0;           // next WR to post
  uint32_t outstanding = 0;    // posted, not completed
  uint64_t chunk = 0;          // single: bytes per WR
  uint32_t shards = 1;         // single: one per NIC when large enough
  uint64_t shard_bytes = 0;    // single: bytes of every shard but the last
  uint32_t shard_wrs = 0;      // single: WRs of every shard but the last
  bool finished = false;       // Completion already ran (a timed-out transfer may still own WRs)
  bool queued = false;         // on the pending-post list
  bool tail_deferred = false;  // single: the immediate-carrying last chunk waits for the others
  Clock::time_point deadline;
  Status error;
  // Intrusive lists owned by the worker.
  Transfer* active_prev = nullptr;
  Transfer* active_next = nullptr;
};

// A receive buffer posted for two-sided messages: its index in the receive buffers, its NIC.
struct PostedRecv {
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

// Where the idle worker sleeps: a futex on a word that WakeWorker and Stop advance.
class Futex {
 public:
  static void Wait(std::atomic<uint32_t>* word, uint32_t expected, uint32_t timeout_us) {
    timespec ts{static_cast<time_t>(timeout_us / 1000000),
                static_cast<long>(timeout_us % 1000000) * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts,
            nullptr, 0);
  }
  static void WakeOne(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr,
            0);
  }
};

// TransferEngine's implementation: its methods (transfer_engine.cc) run on this state; the
// worker's and the checks' code is the Engine's own.
class Engine final {
 public:
  using MessageHandler = TransferEngine::MessageHandler;
  using UnmatchedImmHandler = TransferEngine::UnmatchedImmHandler;

  Engine(const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains);

  // Stops the worker; false means the engine must be leaked (see Stop).
  bool StopWorker() { return Stop(); }

  // Precondition: StopWorker() returned true.
  ~Engine();

  Status Init();
  // The TransferEngine that Create hands out, over `engine` (Init done).
  static std::unique_ptr<TransferEngine> Wrap(std::unique_ptr<Engine> engine);

  // Registers [data, data + length) on every NIC; all or none.
  StatusOr<MultiRegistration> RegisterAll(void* data, uint64_t length, MemoryKind kind, int device);
  void DeregisterAll(const MultiRegistration& reg);

  static uint64_t PeerKey(uint32_t nic, uint64_t addr) { return addr * kMaxNics + nic; }
  // A lost peer can be removed too (that is when it is needed most); removing twice is a no-op.
  Status RemovePeerLocked(PeerId peer) REQUIRES(add_mu_);

  StatusOr<ImmCounterTable::Slot*> Counter(uint32_t imm) const;
  // A request about counter `imm` for the worker (arm or disarm its notification).
  StatusOr<Request> CounterRequest(Kind kind, uint32_t imm) const;

 private:
  friend class ferry::TransferEngine;  // its methods are the Engine's caller side

  // ----- validation (caller threads) ---------------------------------------------------------

  Status CheckLocal(const MemoryRegion* region) const;
  Status CheckPeer(PeerId peer) const;
  // OK when `peer` is the PeerId now in its slot; else NotFound (never added) or Unavailable
  // (removed: its slot is free or serves a later peer). Any thread.
  Status CheckCurrent(PeerId peer) const;
  // The worker's check before it posts to a peer: still in its slot and not lost.
  bool Usable(PeerId peer) const;

  // The descriptor must come from the engine we are writing to.
  Status CheckOwner(PeerId peer, const RemoteRegion& region) const;

  // A SingleWrite's or PagedWrite's ends: its source region, its peer, and a destination of
  // that peer's engine.
  template <typename W>
  Status CheckEnds(const W& w) const;
  // The Request of a SingleWrite or PagedWrite: its peer, its ends at their offsets, `length`
  // (bytes, or page bytes), its immediate.
  template <typename W>
  Request WriteRequest(Kind kind, const W& w, uint64_t length);

  Descs LocalDescs(const MemoryRegion& region) const;

  // The destination as each local NIC sees it (its paired peer NIC's address and key).
  void SetDst(Request& r, const RemoteRegion& dst, uint64_t offset) const;

  StatusOr<const PeerGroup*> FindGroup(GroupId group) const;
  // A group of current peers, and a plan from `src` to one region per member of `group`, as
  // AddPeerGroup / PrepareScatter (and their Replace / RePrepare forms) store them.
  StatusOr<std::unique_ptr<PeerGroup>> BuildGroup(std::span<const PeerId> members) const;
  StatusOr<std::unique_ptr<ScatterPlan>> BuildPlan(GroupId group, const MemoryRegion& src,
                                                   std::span<const RemoteRegion> dst) const;
  void SetPeer(Request& r, PeerId peer);

  // The NIC that starts the next transfer: taken in turn so small transfers spread.
  uint32_t NextNic();
  static void SetImm(Request& r, std::optional<uint32_t> imm);

  // Admission: at most max_transfers in flight, so the worker always finds a free slot.
  Status Enqueue(Request&& r, Completion&& done);

  Status Push(Request&& r, Completion&& done);
  void WakeWorker();

  // What a control operation hands back to its caller.
  struct ControlResult {
    MultiRegistration reg;
    std::vector<std::pair<uint32_t, uint64_t>> inserted;  // AddPeer: (local NIC, address)
  };
  using ControlFn = std::function<Status(ControlResult&)>;

  // Runs `fn` on the worker and waits at most options_.control_timeout_ms. `fn` must capture by
  // value: after a timeout the caller is gone while the op may still be queued (it is then
  // skipped) or running inside a wedged provider call (it then owns only its own copies).
  StatusOr<ControlResult> RunOnWorker(ControlFn fn);
  // A handler the worker calls (messages, unmatched immediates), set on the worker.
  template <typename Handler>
  void SetOnWorker(Handler Engine::*field, Handler handler);

  // ----- worker -------------------------------------------------------------------------------

  void WorkerMain();
  void Idle(Clock::duration idle_for);
  void RunControl();
  size_t DrainQueue();
  void Start(Request&& r);

  // Cuts a single write into shards (one per NIC when it is large enough) and each shard into
  // chunks of at most max_chunk_ bytes.
  void PlanSingle(Transfer* t);

  void Enqueue(Transfer* t);

  // The shard (hence NIC: first_nic + shard) of a single write's WR i.
  static uint32_t ShardOf(const Transfer& t, uint32_t i);

  // How many of a transfer's last WRs carry its immediate: the last chunk of a split single
  // write; each NIC's last page of a paged write with imm_once (the last min(NICs, pages) WRs,
  // since page i goes to NIC first + i).
  uint32_t TailWrs(const Transfer& t) const;

  // Whether those WRs wait for all the others to complete. Not when each immediate only counts
  // WRs posted before it on its own connection and that connection places writes in order
  // (FabricInfo::ordered_write_bytes): a paged write's pages (each NIC's immediate counts that
  // NIC's pages), a single write in one shard. A single write over several NICs still waits:
  // its one immediate counts the other NICs' shards too.
  bool TailWaits(const Transfer& t) const;

  // Posts WRs of pending transfers, oldest first, while WR contexts and provider space last.
  size_t PostPending();

  // Posts WR i of transfer t on the NIC the file comment assigns it to; *nic says which.
  // What PostOne posted: through which NIC, to which peer slot, how many bytes, and whether it
  // was a write (else a send) carrying an immediate.
  struct Posted {
    uint32_t nic = 0;
    uint32_t peer_slot = 0;
    uint64_t bytes = 0;
    bool send = false;
    bool imm = false;
  };
  PostResult PostOne(Transfer* t, uint32_t i, WrSlot* slot, Posted* posted, Status* error);

  size_t PollCompletions();
  bool IsPostedRecv(const OpContext* ctx) const;
  void Complete(DomainCompletion& c, uint32_t nic);
  std::string Describe(const Transfer* t) const;
  void CountImm(uint32_t imm);
  // The slot's total into its MirrorImm word.
  void StoreMirror(ImmCounterTable::Slot* slot);
  void OnMessage(const DomainCompletion& c, uint32_t index, uint32_t nic);
  Status PostRecvBuffer(uint32_t index);
  void Arm(Request&& r);
  void FireNotify(ImmCounterTable::Slot* slot, const Status& status);
  void Fail(Transfer* t, const Status& status);

  // Finishes a transfer once nothing is left to post; releases its slot once nothing is left
  // outstanding.
  void MaybeFinish(Transfer* t);

  void Finish(Transfer* t, const Status& status);
  void Release(Transfer* t);
  static bool SinglePeer(const Transfer* t);

  // Finishing a transfer may release it (unlinking it from the active list), so failures are
  // collected first and applied after the walk.
  void FailCollected(const Status& why);

  // Whether t writes to `peer`: a single-peer transfer to it, or a scatter with a target in it.
  static bool Involves(const Transfer* t, PeerId peer);
  // The transfers that write to a lost peer fail at once: single-peer ones, and scatters with a
  // target in it (they cannot complete; a scatter's WRs already posted to other members still
  // land, those not yet posted are dropped). Barriers end by their own deadline.
  void MarkPeerLost(PeerId peer, const Status& why);

  void ScanDeadlines(Clock::time_point now);

  // Worker exit: everything still owed a completion gets Cancelled.
  void Drain();

  // Stops the worker. Returns false if it did not exit within shutdown_timeout_ms: it is stuck
  // inside a provider call (seen with shm when a peer died holding its shared-memory lock). The
  // engine is then abandoned: the thread is detached, and the caller must leak this object,
  // because the thread may still touch it if the provider call ever returns.
  bool Stop();

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

  // Groups and plans: append-only tables, entries immutable once published by the count. Peers:
  // slots published by num_slots_ and reused after RemovePeer (PeerEntry).
  Mutex add_mu_;  // serialises appends, and AddPeer / RemovePeer
  // Engine id -> latest PeerId.
  std::unordered_map<uint64_t, PeerId> peer_by_engine_ GUARDED_BY(add_mu_);
  std::unique_ptr<PeerEntry[]> peers_;
  std::atomic<uint32_t> num_slots_{0};
  std::vector<uint32_t> free_slots_ GUARDED_BY(add_mu_);  // removed peers' slots, reused first
  std::vector<std::unique_ptr<PeerGroup>> groups_;
  std::atomic<uint32_t> num_groups_{0};
  std::vector<std::unique_ptr<ScatterPlan>> plans_;
  std::atomic<uint32_t> num_plans_{0};

  // Buffers for immediates and messages.
  std::vector<uint8_t> sink_;
  MultiRegistration sink_reg_;
  std::vector<uint8_t> recv_buffers_;
  MultiRegistration recv_reg_;
  std::unique_ptr<PostedRecv[]> recv_slots_;
  uint32_t num_recv_slots_ = 0;
  std::vector<uint8_t> send_buffers_;
  MultiRegistration send_reg_;
  // Registrations of user regions, keyed by the handle their MemoryRegion holds.
  Mutex regs_mu_;
  std::unordered_map<MultiRegistration*, std::unique_ptr<MultiRegistration>> regs_
      GUARDED_BY(regs_mu_);
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
  std::vector<std::pair<uint32_t, MessageHandler>> tagged_handlers_;  // worker-owned
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
  Mutex control_mu_;
  CondVar control_cv_;
  std::deque<std::function<void()>> control_ GUARDED_BY(control_mu_);
  std::atomic<bool> control_pending_{false};
  bool worker_running_ GUARDED_BY(control_mu_) = true;
  // A control operation timed out and the worker has not started one since: it is stuck (in a
  // provider call). Later operations fail at once instead of each waiting control_timeout_ms,
  // so that tearing down what uses a wedged engine costs one timeout, not one per operation.
  bool control_stuck_ GUARDED_BY(control_mu_) = false;

  Mutex exit_mu_;
  CondVar exit_cv_;
  bool worker_exited_ GUARDED_BY(exit_mu_) = false;
  std::atomic<bool> abandoned_{false};

  std::thread worker_;  // last: starts after everything above exists
};

}  // namespace ferry::fabric
