// ferry fabric: the TransferEngine.
//
// A TransferEngine owns the endpoints of one to four NICs (libfabric domains: `efa`, `shm`,
// `tcp;ofi_rxm`), a domain group serving one GPU, and one worker thread that posts work requests
// and polls completions on all of them. Large single writes are sharded by bytes across the NICs;
// paged writes stripe pages, and scatters and barriers shard peers across them. Callers register
// memory, exchange addresses and remote descriptors as bytes (through any bootstrap they like),
// and submit one-sided writes and two-sided messages from any thread. Every submit either returns
// an error at once (nothing was posted) or later ends in exactly one completion: the callback
// runs, or the counter moves.
//
//   auto engine = TransferEngine::Create(EngineOptions::FromEnv().value()).value();
//   MemoryRegion buf = engine->RegisterMemory(ptr, len).value();
//   std::vector<uint8_t> my_address = engine->Address();       // send to peers
//   std::vector<uint8_t> my_region = buf.remote().Serialize();  // send to peers
//   PeerId peer = engine->AddPeer(peer_address_bytes).value();
//   RemoteRegion dst = RemoteRegion::Parse(peer_region_bytes).value();
//   engine->Write({.src = &buf, .peer = peer, .dst = dst, .length = len, .imm = 7},
//                 Completion::Callback([](const Status& s) { ... }));
//   // on the peer: engine->WaitImm(7, 1, Deadline::After(1s));
//
// Remote addresses, memory-registration modes, context modes and message-size limits differ per
// provider; the engine adapts to what fi_getinfo returns and callers never see the difference.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ferry/export.h"
#include "ferry/inline_function.h"
#include "ferry/status.h"

namespace ferry {

using PeerId = uint32_t;
using GroupId = uint32_t;
using ScatterPlanId = uint32_t;

using Clock = std::chrono::steady_clock;

// A point in time after which a wait gives up with DeadlineExceeded.
struct FERRY_API Deadline {
  Clock::time_point at;
  static Deadline After(Clock::duration d) { return {Clock::now() + d}; }
  bool Expired(Clock::time_point now = Clock::now()) const { return now >= at; }
};

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// The most NICs one engine drives (a domain group).
inline constexpr uint32_t kMaxNics = 4;

// The ConnectX (libibverbs) backend's settings; the other backends ignore them. Each field's
// environment variable (read by EngineOptions::FromEnv) follows it. The domain checks them when
// it opens (InvalidArgument naming the field).
struct FERRY_API VerbsOptions {
  uint8_t port = 1;            // FERRY_IB_PORT
  int gid_index = 0;           // FERRY_IB_GID_INDEX (RoCE v2 often needs 3)
  uint32_t qkey = 0x1ffe7e11;  // FERRY_IB_QKEY: the UD queue pairs of the handshake
  uint32_t psn = 0;            // FERRY_IB_PSN: starting PSN (24 bits); 0 draws one per QP
  uint32_t mtu_bytes = 4096;   // FERRY_IB_MTU: 256..4096; the port's active MTU may lower it
  uint8_t timeout = 14;        // FERRY_IB_TIMEOUT: 4.096 us * 2^timeout per retry (0..31)
  uint8_t retry_count = 7;     // FERRY_IB_RETRY (0..7)
  uint8_t rnr_retry = 7;       // FERRY_IB_RNR_RETRY (0..7; 7 retries forever)
  uint8_t service_level = 0;   // FERRY_IB_SL (0..15)
  uint8_t traffic_class = 0;   // FERRY_IB_TC
  bool relaxed_ordering = true;  // FERRY_IB_RELAXED_ORDERING=0 turns it off
  // FERRY_IB_MAX_UNCLAIMED: connections made for peers that reached this engine before it added
  // them (it claims them when it does); past this many the oldest unclaimed one is closed.
  uint32_t max_unclaimed_peers = 1024;
  // FERRY_IB_RELEASE_MS: how long a removed peer's queue pairs stay in the error state, nothing
  // outstanding on them, before they are destroyed, so that the receives they had taken from a
  // shared queue complete (flushed) and are posted again first.
  uint32_t release_delay_ms = 1000;
};

struct FERRY_API EngineOptions {
  // Backend: a libfabric provider ("efa", "shm", "tcp;ofi_rxm") or "verbs" (libibverbs, for
  // ConnectX NICs); empty picks the first that opens of efa, verbs, shm.
  // Environment: FERRY_PROVIDER. The verbs backend's own settings: `verbs` below.
  std::string provider;
  // Address to bind (tcp: "127.0.0.1" on loopback). Empty lets the provider choose.
  // Environment: FERRY_NODE.
  std::string node;
  // The port to listen on, for libfabric's socket providers ("tcp;ofi_rxm", "tcp"); 0 lets the
  // provider choose. With one, an engine started again (a prefill restarted by its launcher)
  // has the address it had, so peers that knew it reach it without being told again. The k-th
  // NIC's endpoint takes port + k. shm names its endpoints instead (`node`), and verbs and EFA
  // have no ports: InvalidArgument there. Environment: FERRY_PORT.
  uint16_t port = 0;
  // The NICs of this engine's domain group: libfabric domain names (EFA: "rdmap79s0", ...), as
  // the topology pairs them with a GPU. Empty: num_nics domains, the provider's first distinct
  // ones (software providers have one domain; each entry is then its own endpoint on it).
  // Environment: FERRY_NICS (comma-separated), FERRY_NUM_NICS.
  std::vector<std::string> nics;
  uint32_t num_nics = 1;
  // Single writes of at least num_nics x this many bytes are split into one shard per NIC;
  // smaller ones go whole to one NIC, taken in turn.
  uint64_t nic_shard_min_bytes = 64 * 1024;
  // Allow registering CUDA device memory (asks the provider for FI_HMEM). Off by default: some
  // providers (shm) then lose their fastest path for host memory. Environment: FERRY_CUDA_MEMORY=1.
  bool cuda_memory = false;
  // Pin the worker thread to this CPU; -1 leaves it unpinned. Environment: FERRY_WORKER_CPU.
  int worker_cpu = -1;
  // Capacity of the lock-free submission queue (requests not yet taken by the worker).
  uint32_t submit_queue_depth = 4096;
  // Transfers in flight at once (submitted, not yet completed). Environment: FERRY_MAX_TRANSFERS.
  uint32_t max_transfers = 4096;
  // Work requests outstanding at the provider at once; capped by the provider's tx size.
  // Environment: FERRY_MAX_WRS.
  uint32_t max_outstanding_wrs = 1024;
  // Two-sided messages: receive bounce buffers (re-posted automatically) and their size, which is
  // also the largest message Send accepts. Environment: FERRY_MSG_BYTES.
  uint32_t num_recv_buffers = 64;
  uint32_t num_send_buffers = 64;
  uint32_t message_bytes = 16384;
  // Peers at once (at most 65536): RemovePeer frees an entry for the next AddPeer.
  uint32_t max_peers = 1024;
  uint32_t max_groups = 256;
  uint32_t max_scatter_plans = 256;
  // Immediate counters that can exist at once.
  uint32_t max_imm_counters = 4096;
  // A transfer not completed within this time fails with DeadlineExceeded and its peer is marked
  // lost (later submits to it fail with Unavailable). Environment: FERRY_TRANSFER_TIMEOUT_MS.
  uint32_t transfer_timeout_ms = 5000;
  // Bounds on the engine's own waits: a control operation (registration, AddPeer) waits this
  // long for the worker; destruction waits this long for the worker to stop, after which a
  // worker stuck in a provider call is abandoned (the engine is leaked, never freed under it).
  uint32_t control_timeout_ms = 10000;
  uint32_t shutdown_timeout_ms = 10000;
  // Worker idling: spin this long after the last event, then yield until idle_yield_us, then
  // sleep in steps of at most idle_sleep_us (a submit wakes it at once) -- but only yield while
  // writes are outstanding or a notification is armed: libfabric moves bytes and acknowledgements
  // only inside polls (tcp on both sides). spin_us < 0: never idle (production, pinned cores).
  // Environment: FERRY_SPIN_US, FERRY_IDLE_SLEEP_US.
  int spin_us = 50;
  uint32_t idle_yield_us = 1000;
  uint32_t idle_sleep_us = 100;
  // Post an immediate right behind the writes it counts when they share its connection and the
  // provider places writes in order (FabricInfo::ordered_write_bytes); false: always wait for
  // their completions first (a round trip more per transfer). Environment:
  // FERRY_TRUST_WRITE_ORDER=0.
  bool trust_write_order = true;
  VerbsOptions verbs;

  // Defaults overridden by the FERRY_* environment variables named above (and FERRY_IB_* in
  // VerbsOptions); the only place ferry reads them. A value that is not
  // what its field takes (a number that does not parse or is out of range, a flag not 0 or 1)
  // is InvalidArgument naming the variable, never a silent default.
  static StatusOr<EngineOptions> FromEnv();
};

// How a submitted transfer reports its end. Exactly one of done / error happens per submit.
struct FERRY_API TransferCounter {
  std::atomic<uint64_t> done{0};
  std::atomic<uint64_t> failed{0};
  // Waits until done + failed >= n. DeadlineExceeded says how many were seen.
  Status Wait(uint64_t n, Deadline deadline) const;
};

using DoneCallback = InlineFunction<void(const Status&), 48>;

class FERRY_API Completion {
 public:
  Completion() = default;  // fire and forget
  // Runs on the engine's worker thread: keep it short, never block in it.
  static Completion Callback(DoneCallback cb) {
    Completion c;
    c.callback_ = std::move(cb);
    return c;
  }
  // The cheaper form: no callback, one atomic increment.
  static Completion Counter(TransferCounter* counter) {
    Completion c;
    c.counter_ = counter;
    return c;
  }
  void Finish(const Status& status);

 private:
  DoneCallback callback_;
  TransferCounter* counter_ = nullptr;
};

// One NIC's view of a registered region.
struct FERRY_API NicKey {
  uint64_t base = 0;  // provider address of byte 0: a virtual address or 0 (offset mode)
  uint64_t key = 0;
};

// What a peer needs to write into one of our regions. Serialises to versioned bytes carrying the
// owning engine's id, the region length, and each NIC's provider address and key.
struct FERRY_API RemoteRegion {
  uint64_t engine_id = 0;
  uint64_t length = 0;
  uint32_t num_nics = 0;
  std::array<NicKey, kMaxNics> nics{};

  std::vector<uint8_t> Serialize() const;
  // Full validation: InvalidArgument on a wrong size, magic, version or field.
  static StatusOr<RemoteRegion> Parse(std::span<const uint8_t> bytes);
};

class TransferEngine;
namespace fabric {
class Engine;
}
struct RegistrationOwner;  // ties regions to their engine; outlives both

// A registered local buffer. Move-only; deregisters when destroyed (a no-op once its engine is
// gone: the engine closes its registrations). Must outlive every transfer that reads from or
// lands in it.
class FERRY_API MemoryRegion {
 public:
  MemoryRegion() = default;
  MemoryRegion(MemoryRegion&& other) noexcept;
  MemoryRegion& operator=(MemoryRegion&& other) noexcept;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ~MemoryRegion();

  bool valid() const { return owner_ != nullptr; }
  void* data() const { return data_; }
  uint64_t length() const { return length_; }
  MemoryKind kind() const { return kind_; }
  int device() const { return device_; }  // the CUDA device of kCuda memory
  const RemoteRegion& remote() const { return remote_; }
  // Provider descriptor (fi_mr_desc) on one of the engine's NICs.
  void* local_desc(uint32_t nic = 0) const { return nic < kMaxNics ? local_descs_[nic] : nullptr; }

 private:
  friend class TransferEngine;  // RegisterMemory fills a region in
  void Release();
  std::shared_ptr<RegistrationOwner> owner_;
  void* handle_ = nullptr;  // backend registration
  void* data_ = nullptr;
  uint64_t length_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
  int device_ = 0;
  std::array<void*, kMaxNics> local_descs_{};
  RemoteRegion remote_;
};

// One contiguous write, optionally carrying a 32-bit immediate that the receiver counts once the
// bytes have landed. Writes larger than the provider's message size are split; the immediate
// travels with the last piece: right behind the others where they share its connection and the
// provider places writes in order (FabricInfo::ordered_write_bytes), else posted after the
// others completed (pieces on other NICs than the last one's: after they were delivered into
// the target's memory, FI_DELIVERY_COMPLETE, since they travel on other connections).
struct FERRY_API SingleWrite {
  const MemoryRegion* src = nullptr;
  uint64_t src_offset = 0;
  PeerId peer = 0;
  RemoteRegion dst;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  std::optional<uint32_t> imm;
};

// Page i goes from src_offset + src_pages[i] * src_stride to dst_offset + dst_pages[i] *
// dst_stride, page_bytes long. With an immediate, every page write carries it (the receiver
// counts one per page), or with imm_once only the last page on each NIC the pages stripe over,
// weighted by the pages its NIC carried (WeightedImm with imm_weight_mask, required): a counter
// from CreateWeightedImmCounter(imm, imm_weight_mask) then counts the transfer's pages with one
// immediate per NIC. Those last pages go right behind the others where the provider places
// writes on a connection in order (FabricInfo::ordered_write_bytes: tcp, verbs), else after
// every other page's write completed (shm, efa). (One immediate per NIC: two NICs' connections
// are not ordered with each other -- and over tcp a write's local completion does not mean it
// landed.) The index spans, like the memory, must stay valid until the transfer completes.
struct FERRY_API PagedWrite {
  const MemoryRegion* src = nullptr;
  PeerId peer = 0;
  RemoteRegion dst;
  uint64_t page_bytes = 0;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  std::span<const uint32_t> src_pages;
  std::span<const uint32_t> dst_pages;
  std::optional<uint32_t> imm;
  bool imm_once = false;
  uint32_t imm_weight_mask = 0;  // imm_once: where each immediate carries its NIC's pages
};

// The immediate that a counter created with CreateWeightedImmCounter(imm, weight_mask) counts as
// `weight` arrivals: the weight in the mask's bits (contiguous, from its lowest set bit).
// weight must be in [1, WeightLimit(weight_mask)].
constexpr uint32_t WeightedImm(uint32_t imm, uint32_t weight_mask, uint32_t weight) {
  return imm | (weight << __builtin_ctz(weight_mask) & weight_mask);
}
constexpr uint32_t WeightLimit(uint32_t weight_mask) {
  return weight_mask >> __builtin_ctz(weight_mask);
}
// A usable weight mask: non-zero, its bits contiguous.
constexpr bool IsWeightMask(uint32_t weight_mask) {
  const uint32_t lowest = weight_mask & (~weight_mask + 1);
  return weight_mask != 0 && ((weight_mask + lowest) & weight_mask) == 0;
}

// One slice of a scatter: bytes [src_offset, src_offset + length) of the plan's source region
// go to member `member` of the plan's group at dst_offset in that member's region.
struct FERRY_API ScatterTarget {
  uint32_t member = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

// A scatter posted from a plan made by PrepareScatter. The target span must stay valid until the
// transfer completes. With an immediate, every slice carries it.
struct FERRY_API ScatterWrite {
  ScatterPlanId plan = 0;
  std::span<const ScatterTarget> targets;
  std::optional<uint32_t> imm;
};

// Engine counters for diagnostics and benchmarks. Monotonic.
struct FERRY_API EngineStats {
  uint64_t transfers_submitted = 0;
  uint64_t transfers_completed = 0;
  uint64_t transfers_failed = 0;
  uint64_t wrs_posted = 0;
  std::array<uint64_t, kMaxNics> wrs_posted_per_nic{};
  uint64_t post_retries = 0;  // provider said EAGAIN
  // Immediate-carrying last WRs held back until the transfer's other WRs completed (the
  // provider's connection does not place writes in order, or the others went on other NICs).
  uint64_t imm_waits = 0;
  uint64_t imms_received = 0;
  uint64_t imms_unmatched = 0;
  uint64_t messages_received = 0;
  uint64_t worker_cpu_ns = 0;  // CPU time the worker thread has used
  // Times the idle worker went to sleep (never while WRs are outstanding or a notification is
  // armed: transfers move only inside its polls).
  uint64_t worker_sleeps = 0;
  // The peer table (not monotonic): peers in it now (added and not removed), and the entries
  // it has ever used (removed peers' entries serve later peers, so this stays flat under churn).
  uint64_t peers = 0;
  uint64_t peer_entries = 0;
};

// What an engine posted to one peer through one of its NICs, since AddPeer gave the PeerId
// (TransferEngine::Traffic): work requests as the provider took them, so a write split into
// shards or pages counts each piece, on the NIC it went through. Monotonic.
struct FERRY_API PeerTraffic {
  uint64_t writes = 0;  // RDMA writes, immediate-only ones included
  uint64_t bytes = 0;   // payload bytes of the writes and sends
  uint64_t imms = 0;    // writes that carried an immediate
  uint64_t sends = 0;   // two-sided messages
};

// Provider facts, for logs and benchmarks, never needed to use the API. The mr_mode bits and
// context_mode are libfabric's (what its provider asked for), unset over verbs.
struct FERRY_API FabricInfo {
  std::string provider;
  std::string domain;       // the NICs' domain names, comma-separated
  uint32_t num_nics = 1;
  bool virt_addr = false;   // FI_MR_VIRT_ADDR: remote addresses are virtual addresses
  bool prov_key = false;    // FI_MR_PROV_KEY
  bool mr_local = false;    // FI_MR_LOCAL
  bool mr_endpoint = false; // FI_MR_ENDPOINT
  bool hmem = false;        // CUDA memory can be registered (libfabric: FI_HMEM offered)
  bool context_mode = false;
  size_t cq_data_size = 0;
  size_t max_msg_size = 0;
  size_t inject_size = 0;
  size_t tx_size = 0;
  size_t rx_size = 0;
  // Writes of up to this many bytes on one connection are placed in the target's memory in the
  // order they were posted, so an immediate posted after them is counted after their bytes
  // landed (libfabric: FI_ORDER_RMA_WAW with ep_attr max_order_waw_size; verbs: an RC queue
  // pair). 0: no such promise (shm, efa): the immediate waits for the others' completions.
  uint64_t ordered_write_bytes = 0;
  // RemovePeer stops a live peer's writes into our memory (verbs: its queue pairs go to the
  // error state). libfabric's endpoints cannot; there a peer is fenced by revoking the keys it
  // writes under (as the KV decoder does).
  bool removal_fences = false;
};

// Thread safety: every method may be called from any thread, concurrently. Callbacks run on the
// worker thread. Destroying the engine completes transfers still in flight with Cancelled and joins
// the worker; it must not race with other calls on the same engine.
class FERRY_API TransferEngine {
 public:
  static StatusOr<std::unique_ptr<TransferEngine>> Create(const EngineOptions& options);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  const FabricInfo& info() const;
  // The options the engine was created with (after FromEnv, when the caller used it).
  const EngineOptions& options() const;
  // A random id that tells this engine's descriptors from any other's.
  uint64_t id() const;
  // Our address, as bytes a peer passes to AddPeer.
  std::vector<uint8_t> Address() const;

  // --- memory ---
  // kCuda needs options.cuda_memory (else FailedPrecondition) and a provider with FI_HMEM_CUDA
  // support (else Unimplemented).
  StatusOr<MemoryRegion> RegisterMemory(void* data, uint64_t length,
                                        MemoryKind kind = MemoryKind::kHost, int device = 0);
  // Deregisters `region` now and says whether that took: OK once its key lands nothing more
  // (what a peer writes under it from then on is refused or dropped), the fence a caller needs
  // before it reuses memory a peer it gave up on could still write. The immediates of writes
  // that landed under it before (as the provider reported them by then) are counted before
  // Revoke returns, so that a counter zeroed after it holds nothing of that peer's. If the worker, which
  // deregisters, is gone or does not answer within control_timeout_ms, the error says so and
  // the registration may still be open (it is closed with the engine, never deregistered
  // twice). Either way `region` is empty after. InvalidArgument for an empty region or one of
  // another engine.
  Status Revoke(MemoryRegion& region);

  // --- peers ---
  // The engine at `address` as a peer. An engine that is already a peer, and not lost, keeps
  // its PeerId: whatever shares this engine (several AllToAlls, an AllToAll and a KV messenger)
  // shares its peers, and RemovePeer forgets one for all of them. (A second connection to one
  // engine would be wasted, and over verbs its handshake would cross the first.)
  // ResourceExhausted when max_peers peers are in the table.
  StatusOr<PeerId> AddPeer(std::span<const uint8_t> address);
  // Forgets a peer: its pending transfers fail with Unavailable, later submits are refused, and
  // its table entry serves a later AddPeer under another PeerId (a PeerId is never given out
  // twice: an old one stays Unavailable whoever holds its entry now). Over verbs the peer hears
  // a goodbye and marks us lost (PeerLost), so that it adds us again to talk to us; connectionless
  // providers need none: a peer's later messages still arrive.
  Status RemovePeer(PeerId peer);
  // Whether `peer` is lost: a transfer to it outlived its deadline (transfer_timeout_ms), or
  // RemovePeer forgot it. Every later submit to it fails with Unavailable; a peer that is back
  // is added again (AddPeer gives it a new PeerId and removes the lost one; over verbs the new
  // connection replaces the old one on the other side too, which keeps its PeerId). NotFound
  // for an unknown peer.
  StatusOr<bool> PeerLost(PeerId peer) const;
  StatusOr<GroupId> AddPeerGroup(std::span<const PeerId> members);
  // Pre-builds the work-request templates of a scatter from `src` to one region per group member.
  StatusOr<ScatterPlanId> PrepareScatter(GroupId group, const MemoryRegion& src,
                                         std::span<const RemoteRegion> dst);
  // A group's members and a plan's targets changed in place (a peer replaced, a region
  // registered anew), keeping their ids: the tables only grow, so a membership that changes
  // again and again must not take a new entry each time. The caller's promise: no Scatter or
  // Barrier on them is in flight or posted until the call returns (the old ones are freed).
  // Checked as AddPeerGroup and PrepareScatter check; on an error nothing changed.
  Status ReplacePeerGroup(GroupId group, std::span<const PeerId> members);
  Status RePrepareScatter(ScatterPlanId plan, GroupId group, const MemoryRegion& src,
                          std::span<const RemoteRegion> dst);

  // --- one-sided writes (non-blocking; ResourceExhausted when the queue or slots are full) ---
  Status Write(const SingleWrite& write, Completion done);
  Status WritePaged(const PagedWrite& write, Completion done);
  Status Scatter(const ScatterWrite& write, Completion done);
  // An immediate to every member of the group.
  Status Barrier(GroupId group, uint32_t imm, Completion done);
  // An immediate alone.
  Status WriteImm(PeerId peer, uint32_t imm, Completion done);

  // --- two-sided messages ---
  // Copies `message` (at most options.message_bytes) into a send buffer; returns at once.
  Status Send(PeerId peer, std::span<const uint8_t> message, Completion done);
  // Called on the worker thread for every message received that no tagged handler takes;
  // `from` is empty when the sender is not one of our peers. The bytes are valid during the
  // call only.
  using MessageHandler =
      std::function<void(std::optional<PeerId> from, std::span<const uint8_t> message)>;
  void SetMessageHandler(MessageHandler handler);
  // Messages whose first four bytes, read as a uint32 (host byte order: what a memcpy of a
  // uint32_t wrote), are `tag` go to `handler` instead: one engine serves several users of
  // messages, each with tags of its own (a KV decoder and a KV prefill, the caller's own
  // protocol). AlreadyExists when another handler holds the tag (a null handler gives it up);
  // ResourceExhausted past kMaxMessageTags tags.
  static constexpr size_t kMaxMessageTags = 16;
  Status SetTaggedMessageHandler(uint32_t tag, MessageHandler handler);

  // --- immediate counters (receiving side) ---
  // Immediates with a counter are counted; others go to the unmatched handler. Create the counter
  // before any peer can send its immediate. ferry's own parts (a KV messenger, AllToAlls) on
  // this engine take the top of the immediate space; a caller's own immediates stay in
  // imm::kCaller (ferry/immediates.h lays the space out).
  Status CreateImmCounter(uint32_t imm);
  // A counter for imm that also counts WeightedImm(imm, weight_mask, w) as w arrivals: one
  // immediate can stand for many writes (a paged write with imm_once). weight_mask: contiguous
  // bits, none of them set in imm; at most four distinct masks per engine. An immediate that
  // matches a counter exactly always counts one. The counter claims every immediate of that
  // form that no exact counter takes: keep the family apart from other senders' immediates.
  Status CreateWeightedImmCounter(uint32_t imm, uint32_t weight_mask);
  StatusOr<uint64_t> ImmCount(uint32_t imm) const;
  // Blocks the calling thread until the count reaches `target`.
  Status WaitImm(uint32_t imm, uint64_t target, Deadline deadline) const;
  // Calls `done` (on the worker) once the count reaches `target`, or with DeadlineExceeded.
  // One armed notification per counter at a time.
  Status NotifyImm(uint32_t imm, uint64_t target, Deadline deadline, DoneCallback done);
  // Ends the counter's armed notification, if any, by calling it with Cancelled (on the worker,
  // after the submissions before this one). Then a new NotifyImm may be armed.
  Status DisarmImm(uint32_t imm);
  // Subtracts n from the count so the counter can serve the next round; FailedPrecondition if
  // fewer than n arrived.
  Status ConsumeImm(uint32_t imm, uint64_t n);
  // Mirrors the counter into `word` for a waiter that cannot call WaitImm -- a GPU kernel
  // spinning on a word of GpuWords (ferry/gpu_words.h: GPU memory through GDRCopy where it is
  // there, else pinned host memory mapped into the GPU): the worker stores the counter's total
  // (every arrival since the counter was created, weighted; ConsumeImm does not lower it) into
  // the 8-byte aligned `word` with release ordering, then fences, now and after each arrival.
  // The kernel's side of the ordering: gpu_words.h. One word per counter; another replaces it.
  // Keep the word alive until null stops the mirror -- once that returns OK the worker writes
  // the old word no more (DeadlineExceeded, a wedged worker: keep it) -- or until the engine is
  // destroyed.
  Status MirrorImm(uint32_t imm, uint64_t* word);
  using UnmatchedImmHandler = std::function<void(uint32_t imm)>;
  void SetUnmatchedImmHandler(UnmatchedImmHandler handler);

  EngineStats stats() const;
  // One PeerTraffic per local NIC (num_nics of them) for `peer`: lost or removed, its final
  // counts, until its table entry serves another peer (then Unavailable; NotFound for an id
  // never given). Read while the worker posts: each counter is exact, the set a moment's view.
  StatusOr<std::vector<PeerTraffic>> Traffic(PeerId peer) const;

 private:
  friend class MemoryRegion;  // Deregister
  friend class fabric::Engine;  // Wrap
  explicit TransferEngine(fabric::Engine* impl);
  // Deregisters region's registration on the worker: whether it ran there in time.
  Status Deregister(MemoryRegion& region);

  // The implementation (src/fabric/engine.h): owned, and leaked on purpose at destruction when
  // its worker cannot be stopped (wedged in a provider call that may still touch it).
  fabric::Engine* impl_;
};

}  // namespace ferry
