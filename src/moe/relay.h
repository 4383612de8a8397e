// Relay: the host thread that carries an AllToAll's traffic between nodes -- the one protocol
// both devices speak across machines. The CUDA device's kernels write and read the boxes below;
// the host device (host/host_device.cc) writes and reads the same bytes (moe/wire.h) from the
// CPU, with every other rank in a node of its own, so CI runs what GPUs run between nodes.
//
// With several nodes of several GPUs (1 < ranks_per_node < world_size) the kernels treat every
// rank alike: they write what a peer must receive (its counts row, its slots, the combine rows
// it gets back) and raise a flag, and wait for flags before they read. For a rank of their own
// node those addresses are the peer's memory over NVLink (cuda/cuda_device.h). For a rank of
// another node they are in this rank's outbox; the relay forwards each outbox section over the
// TransferEngine into that rank's inbox, and when a peer's section has landed in our inbox it
// raises the flag our kernels wait for. The boxes are GPU memory the NIC reads and writes
// directly (GPUDirect RDMA, where the engine registers CUDA memory) or pinned host memory the GPU
// maps (RdmaBuffers in ferry/moe.h). What the relay's CPU reads -- the kernels' outbox flags and
// the two numbers it needs of each counts row -- is in a control block of pinned host memory the
// kernels write; the flags it raises for the kernels are the caller's inbox_flags (GpuWords):
//
//   dispatch: GPU raises control.outbox.dispatch -> one write per remote rank (counts row and all
//             the slots for it, contiguous; how many slots: control.out_slots) -> as sender s's
//             immediate arrives, inbox_flags.dispatch[s] -> our own writes complete
//   combine:  GPU raises control.outbox.combine -> one write per remote rank (the rows we return
//             to it, at the place its counts row named: control.in_rows, copied there by the
//             receive kernel) -> inbox_flags.combine[s] as each arrives -> our writes complete
//
// Immediates name their sender (RelayImm), so each flag goes up as its section lands and a lost
// rank is the one whose flag never does.
//
// Memory ordering: the GPU stores its outbox flag with st.release.sys after the data and the
// control words (the kernels' ticket carries every block's stores to the storing thread; the
// receive kernel that copies control.in_rows fences at system scope and ends before the combine
// send kernel starts); the relay loads it with acquire before it reads them and the NIC the
// data. The relay stores an inbox flag with release after its engine saw the peer's immediate
// (the data is in our memory); the kernels load it with ld.acquire.sys before they read the
// section. The inbox flags are the caller's (the CUDA AllToAll's GpuWords): GPU memory behind
// GDRCopy's write-combining mapping, or pinned host memory; each store is followed by a full
// fence, which sends it out of the CPU's write-combining buffers in order where there are any.
// Remote pairs have no "private" limit and no pull: every slot travels in the section.
//
// Reuse needs no barrier: the chain of flags that protects the NVLink buffers (see
// cuda/cuda_device.h) runs through the relay unchanged -- a rank rewrites its outbox (and, by
// its writes, a peer's inbox) for epoch i + 1 only after its CombineRecv of epoch i, which waited
// for every peer's combine rows of epoch i, sent after that peer had read our epoch-i slots.
//
// The relay needs no GPU: tests drive it with host memory standing for the kernels' side.
// Thread safety: created and destroyed by the AllToAll's thread; its own thread owns the engine
// traffic. error() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "ferry/immediates.h"
#include "moe/own_writes.h"
#include "moe/wire.h"

namespace ferry::moe {

// The AllToAll's immediates (the range ferry/immediates.h lays out): the kind, the epoch mod
// kEpochs (a rank is at most one epoch ahead of any other, so this never aliases), the
// AllToAll's instance (AllToAllConfig::instance: AllToAlls on one engine count apart) and the
// sending rank, so that each sender's section raises its own flag.
enum ImmKind : uint32_t {
  kRelayDispatch = 1,  // a counts row and its slots
  kRelayCombine = 2,   // combine rows
  kRelayAlive = 3,     // a heartbeat, no bytes (node-once under mask_lost_peers: liveness.h)
};
inline constexpr uint32_t kEpochs = 1u << imm::kMoeEpochBits;
static_assert(kRelayAlive < (1u << imm::kMoeKindBits), "the kind has four bits");
static_assert(AllToAllConfig::kMaxInstances <= (1 << imm::kMoeInstanceBits),
              "the instance has four bits");
static_assert(AllToAllConfig::kMaxWorldSize <= (1 << imm::kMoeSenderBits),
              "the sender has sixteen bits");
inline uint32_t RelayImm(ImmKind kind, uint64_t epoch, int instance, int sender) {
  return imm::kMoe.first | static_cast<uint32_t>(instance) << imm::kMoeInstanceShift |
         (uint32_t{kind} << imm::kMoeKindShift) | static_cast<uint32_t>(epoch % kEpochs) |
         static_cast<uint32_t>(sender) << imm::kMoeSenderShift;
}

// Why an AllToAll could not create one of its immediate counters: AlreadyExists naming the
// instance when another AllToAll on the engine has it; else the engine's reason.
inline Status CounterError(const Status& s, int instance) {
  if (s.code() != StatusCode::kAlreadyExists) return s.WithContext("AllToAll: immediate counter");
  return AlreadyExistsError("AllToAll: instance " + std::to_string(instance) +
                            " is taken on this engine (an AllToAll's immediate counters outlive "
                            "it): give each AllToAll on one engine an instance of its own");
}

// Where everything lives in one rank's inbox, outbox and control block. Nodes are blocks of
// node_ranks consecutive ranks (the CUDA device: ranks_per_node; the host device, which has no
// NVLink: 1, every other rank remote); "remote" ranks are those outside our node, in rank order.
//
//   inbox    sections  [remote senders] counts row + S slots, written by the peers' relays
//            combine   [T * K] rows, rows from remote expert ranks at their place in our region
//   outbox   per remote rank q: section (counts row + S slots), then R combine rows for it
//   control  outbox flags  dispatch, combine u64        raised by the kernels, polled by the relay
//            out_slots     [remote receivers] i64       our slots for q (the send kernel)
//            in_rows       [remote senders] {start, rows} i64: where sender q's combine rows go
//                          in its region and how many (the receive kernel, from q's counts row)
//            masks         [N] u64, MaskWord: written by the AllToAll's thread, read by the
//                          relay, which neither writes to a masked rank nor waits for it
// A rank's mask word: kUnmasked, or why it is masked -- by the caller (AllToAll::SetMasked), or
// lost (a step under mask_lost_peers gave up on it at its deadline: presumed gone, so the relay
// also forgets it as the engine's peer, which ends the writes to it still pending at once
// instead of at the engine's transfer timeout).
enum MaskWordValue : uint64_t { kUnmasked = 0, kMaskedByCaller = 1, kMaskedLost = 2 };

struct RelayLayout {
  RelayLayout(const AllToAllConfig& c, int64_t slot_bytes, int node_ranks);

  int Node(int rank) const { return rank / node_ranks; }
  bool Remote(int rank) const { return Node(rank) != Node(me); }
  // Index of `rank` among the ranks outside `of`'s node (-1 if it is in that node).
  int RemoteIndex(int of, int rank) const;

  int n, me, node_ranks;
  int64_t slot_bytes, row_bytes;
  int64_t slots_per_pair;  // S: the most slots one sender routes to one receiver
  int64_t rows_per_pair;   // R: the most combine rows one rank returns to one sender
  int64_t combine_rows;    // T * K: a rank's combine region
  int64_t counts_width;    // int32 columns of a counts row: local experts + kCountsColumns
  int64_t counts_bytes, section_bytes;
  std::vector<int> remotes;
  int64_t in_combine_off, inbox_bytes;
  int64_t out_peer_bytes, outbox_bytes;
  int64_t out_slots_off, in_rows_off, masks_off, control_bytes;

  uint64_t* OutboxFlag(uint8_t* control, bool combine) const {
    return reinterpret_cast<uint64_t*>(control) + (combine ? 1 : 0);
  }
  int64_t* OutSlots(uint8_t* control, int q) const {
    return reinterpret_cast<int64_t*>(control + out_slots_off) + q;
  }
  int64_t* InRows(uint8_t* control, int q) const {  // {start, rows}
    return reinterpret_cast<int64_t*>(control + in_rows_off) + 2 * q;
  }
  uint64_t* MaskWord(uint8_t* control, int rank) const {
    return reinterpret_cast<uint64_t*>(control + masks_off) + rank;
  }
  // (atomic_ref takes no const object; a load writes nothing.)
  uint64_t MaskOf(const uint8_t* control, int rank) const {
    return std::atomic_ref<uint64_t>(*MaskWord(const_cast<uint8_t*>(control), rank))
        .load(std::memory_order_acquire);
  }
  bool Masked(const uint8_t* control, int rank) const { return MaskOf(control, rank) != 0; }
  void Mask(uint8_t* control, int rank, uint64_t why) const {
    std::atomic_ref<uint64_t>(*MaskWord(control, rank)).store(why, std::memory_order_release);
  }
  int64_t InSection(int q) const { return q * section_bytes; }
  int64_t OutSection(int q) const { return q * out_peer_bytes; }
  int64_t OutRows(int q) const { return OutSection(q) + section_bytes; }
};

// The relay's memory (RelayLayout's sizes), the caller's until the relay is gone: inbox and
// outbox in GPU memory (boxes = kCuda on CUDA device `device`, registered as such: GPUDirect
// RDMA) or host memory; control always host memory.
struct RelayBuffers {
  uint8_t* inbox = nullptr;
  uint8_t* outbox = nullptr;
  uint8_t* control = nullptr;
  MemoryKind boxes = MemoryKind::kHost;
  int device = 0;
  // Called on the relay's thread after a peer's section landed in the inbox and before its flag
  // goes up, where the NIC's writes into GPU memory need a flush to be visible to the kernels
  // (cudaDeviceFlushGPUDirectRDMAWrites); empty where they need none. An error fails the relay.
  std::function<Status()> flush_landed;
  // [2N] the inbox flags the relay raises for the kernels, dispatch then combine, as the host
  // writes them: the CUDA AllToAll's GpuWords (gpu_words.h).
  uint64_t* inbox_flags = nullptr;
};

// The relay's memory in host memory, zeroed: the host device's boxes, and what tests hand a
// relay in place of the kernels' side. The control block and the flags are 8-byte words, as the
// relay reads them.
struct HostBoxes {
  explicit HostBoxes(const RelayLayout& layout)
      : inbox(size_t(layout.inbox_bytes)),
        outbox(size_t(layout.outbox_bytes)),
        control(size_t(layout.control_bytes) / 8),
        flags(2 * size_t(layout.n)) {}
  RelayBuffers buffers() {
    RelayBuffers b;
    b.inbox = inbox.data();
    b.outbox = outbox.data();
    b.control = control_bytes();
    b.inbox_flags = flags.data();
    return b;
  }
  uint8_t* control_bytes() { return reinterpret_cast<uint8_t*>(control.data()); }
  const uint8_t* control_bytes() const {
    return reinterpret_cast<const uint8_t*>(control.data());
  }
  std::vector<uint8_t> inbox, outbox;
  std::vector<uint64_t> control, flags;  // flags: [2N], dispatch then combine
};

class Relay {
 public:
  // Collective over every rank (when there is more than one node). Registers the inbox and
  // outbox (as buffers.boxes says), exchanges addresses, connects to the remote ranks and starts
  // the thread. peer_timeout_ms bounds each wait for a peer. A relay that replaces a lost
  // rank's (AllToAll::Join) starts at the survivors' epoch, `first_epoch`, and meets their
  // Readmit over `bootstrap`. adopt_counters: the immediate counters of this instance that an
  // earlier relay on the engine made (AllToAll::Resize: that relay parked for good) are taken
  // over, emptied, instead of refused.
  static StatusOr<std::unique_ptr<Relay>> Create(const AllToAllConfig& config,
                                                 const RelayLayout& layout,
                                                 TransferEngine* engine, Bootstrap& bootstrap,
                                                 RelayBuffers buffers,
                                                 uint32_t peer_timeout_ms = 60000,
                                                 uint64_t first_epoch = 0,
                                                 bool adopt_counters = false);
  ~Relay();  // Stop()
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  // Stops the thread, then waits for the writes it posted (each ends within the engine's
  // transfer timeout). False if some never ended: their registrations are leaked, and the
  // outbox (which they read) must be too.
  bool Stop();

  // Membership (AllToAll::Readmit): between epochs -- the relay waiting for the kernels'
  // dispatch flag of `epoch`, its writes of the epoch before ended -- the ranks set in
  // `readmitted` ([N]) are connected again as the new processes that run Create over `group`
  // (every rank of the world; collective) with first_epoch = epoch, and the relay goes on.
  // The fence against the processes they replace, which may still be writing under the keys
  // they were given: our inbox takes a new key, the old one is revoked (nothing written under
  // it lands after), and what landed under it from a readmitted rank is counted and dropped
  // (TransferEngine::Revoke counts it first), so no late section of theirs raises a flag of
  // a later epoch. Our outbox keeps its key: a revoked peer never had ours to write. If the
  // exchange fails (a new process that never came: `timeout`), the new key is revoked and the
  // relay goes on as it was, the old keys standing; a failure after it (a rank lost before the
  // closing barrier) fails the relay, for the ranks no longer share one set of keys. Nobody
  // writes under the new keys before that barrier, so the immediates dropped are all stale.
  // FailedPrecondition where the relay is not between epochs at `epoch`, or has failed.
  Status Readmit(Bootstrap& group, const std::vector<uint8_t>& readmitted, uint64_t epoch,
                 std::chrono::milliseconds timeout);

  // OK while the relay runs; then why it stopped (a peer lost, a malformed counts row).
  Status error() const;
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Bytes the last epoch's dispatch and combine writes carried.
  uint64_t dispatch_bytes() const { return dispatch_bytes_.load(std::memory_order_relaxed); }
  uint64_t combine_bytes() const { return combine_bytes_.load(std::memory_order_relaxed); }

 private:
  Relay(const AllToAllConfig& config, const RelayLayout& layout, TransferEngine* engine,
        RelayBuffers buffers, uint32_t peer_timeout_ms);
  // Raises sender s's dispatch or combine flag in our inbox to epoch + 1 (release).
  void RaiseInboxFlag(bool combine, int s, uint64_t epoch);
  Status Connect(Bootstrap& bootstrap, bool adopt_counters);
  // Every rank's engine address and inbox descriptor (ours: `inbox`) through `group`, then,
  // for each remote rank that `fresh` sets (all of them when the relay starts), its engine as
  // our peer; then the group and the scatter plan to every remote inbox.
  Status Meet(Bootstrap& group, const MemoryRegion& inbox, const std::vector<uint8_t>& fresh,
              std::chrono::milliseconds timeout);
  // Parks the thread where it waits for the kernels' dispatch flag and waits for our writes:
  // the epoch it was waiting for. Start runs it again from `epoch`.
  StatusOr<uint64_t> Park();
  // What counter `imm` holds, consumed: immediates no epoch of this relay will read.
  Status Empty(uint32_t imm);
  void Start(uint64_t epoch);
  void Main(uint64_t first_epoch);
  Status Dispatch(uint64_t epoch);
  Status Combine(uint64_t epoch);
  // Until the kernels raised an outbox flag past epoch (no deadline: the GPU may idle).
  Status WaitDevice(bool combine, uint64_t epoch);
  // targets_ as one scatter; then, as each unmasked remote rank's write lands, its inbox flag;
  // then our writes.
  Status Exchange(ImmKind kind, uint64_t epoch, std::atomic<uint64_t>& bytes);
  bool Masked(int rank) const { return layout_.Masked(buffers_.control, rank); }
  // A rank masked as lost: forgotten as the engine's peer (once), so that what is pending to it
  // fails now (see MaskWordValue).
  Status ForgetIfLost(int rank);
  // Whether remote rank q is gone as our peer: forgotten here, or, under mask_lost_peers, lost
  // on the engine -- forgotten by another AllToAll on it that took it for lost (node-once's
  // hops share their peers), or past the engine's transfer timeout -- and forgotten here then
  // (once; the engine is asked until then). Nothing is sent to it (a scatter naming a lost
  // peer is refused whole), and this AllToAll's steps mask it at their deadline.
  bool Gone(size_t q);
  void Fail(const Status& s);

  const AllToAllConfig c_;
  const RelayLayout layout_;
  TransferEngine* const engine_;
  const RelayBuffers buffers_;
  const uint32_t peer_timeout_ms_;
  MemoryRegion inbox_reg_, outbox_reg_;
  GroupId group_ = 0;
  ScatterPlanId plan_ = 0;
  std::vector<ScatterTarget> targets_;  // read by the engine until the writes complete
  std::vector<int> pending_;            // Exchange: the remote ranks whose section has not landed
  std::vector<PeerId> peers_;           // [remote index] each remote rank as the engine's peer
  std::vector<char> forgotten_;         // [remote index] removed as the engine's peer
  OwnWrites writes_;
  std::atomic<uint64_t> dispatch_bytes_{0}, combine_bytes_{0};
  mutable Mutex error_mu_;
  Status error_ GUARDED_BY(error_mu_);
  std::atomic<bool> failed_{false};
  // CudaTuning::relay_trace: mean µs per phase of dispatch [0] and combine [1] -- waiting for the
  // kernels' flag, posting, until every remote section landed, until our writes completed --
  // printed by Stop (a tuning aid, like CudaTuning::trace).
  bool trace_ = false;
  double trace_us_[2][4] = {};
  uint64_t trace_count_[2] = {};
  Clock::time_point phase_start_;
  std::atomic<bool> stop_{false};
  // Where Main returned: the epoch whose dispatch flag it waited for when stop_ came (Park's
  // between epochs), or UINT64_MAX where it stopped anywhere else.
  uint64_t parked_at_ = UINT64_MAX;
  bool stopped_ = false;  // Stop ran
  bool drained_ = true;   // what Stop found
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace ferry::moe
