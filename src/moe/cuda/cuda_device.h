// The CUDA device (moe/device.h): dispatch and combine between GPUs, kernels only; inside a node
// over NVLink, between nodes through the relay (relay.h). The shell (moe/all_to_all.cc) drives
// it as it drives the host device.
//
// Files: moe/wire.h (the counts row and slot format, which the host device speaks too),
// nvlink_layout.h (the buffer below), nvlink_protocol.cuh (what kernels and host share: the peer
// table, device state, flags and waits), step_modes.h (the modes a step runs with), the kernels
// step by step -- nvlink_send.cuh and nvlink_send_small.cuh (DispatchSend: Route, Pack;
// SendSmall), nvlink_recv.cuh (DispatchRecv: Unpack), nvlink_combine.cuh (CombineSend,
// CombineRecv) -- relay_boxes.h (the relay's memory as the kernels and the NIC
// see it); and the host side of this class by phase: cuda_device_setup.cu (memory, peers, relay,
// device state), cuda_device_launch.cu (the kernels' plan and launches: the only file that
// includes the kernels), cuda_device_sync.cu (streams, masks, errors, tracing).
//
// Memory. Every rank allocates one buffer with cuMemCreate (exportable as a POSIX descriptor),
// sends the descriptor to the other ranks of its node (ExchangeFds) and maps theirs; so each rank
// can write (and read) the buffers of its node. A rank's buffer (N ranks, L local experts,
// T max tokens, K experts per token, P private slots per sender):
//
//   flags     dispatch[N], combine[N]  u64   sender s's blocks arrived: its send grid added
//                                            per epoch (see Arrive)
//   counts    [N][L + 4] int32  sender s's copies per local expert of ours, then its slots for
//                               us, where they start in its send area, where our combine rows
//                               start in its combine region, how many it expects (CountsColumn)
//   private   [N][P] slots      sender s's first P slots for us, pushed by s
//   combine   [T * K] bf16 rows the rows returned to us, grouped by expert rank (pushed by them)
//   send      [T * K] slots     our slots past a peer's P, grouped by receiving rank: peers pull
//                               them from here; and our slots for ourselves
//
// The kernels reach every rank through a table (NvPeer): for a rank of our node, the places
// above in its buffer and ours; for a rank of another node, our outbox section for it and our
// inbox section from it, which the relay thread carries over the TransferEngine: GPU memory the
// NIC reads and writes directly where the engine registers CUDA memory (GPUDirect RDMA), else
// pinned host memory the GPU maps (AllToAllConfig::rdma_buffers; CudaTuning::relay_trace says
// which and why). The relay's flags and the two numbers of each counts row it needs stay in a
// control block of pinned host memory: the send kernel's block 0 stores our slot count for each
// remote rank there, Unpack's block 0 copies each remote sender's {first row, rows} there
// (relay.h). Where GDRCopy is installed (/dev/gdrdrv and libgdrapi, found at run time;
// CudaTuning::gdrcopy = false turns it off) the inbox flags live in our GPU's memory instead and
// the relay writes them through the GDRCopy mapping, so the kernels poll local memory
// (gdr_flags.h).
// Between nodes every slot is pushed (no pull), and the combine rows for a remote sender are
// rebased to the first one it expects from us. A flag from a rank of our node
// counts that rank's send blocks (each adds one when its writes are out); a flag from another
// node holds "epoch + 1", which the relay stores in our inbox. The receiver waits for "epoch + 1"
// times the sender's step per epoch (its grid, exchanged at creation; 1 through the relay). With
// one node there is no relay and no engine.
//
// A slot is a 16-byte header (source token, entries, combine row, which of the token's slots),
// K 16-byte entries (local expert, k, weight, position among the sender's copies for that
// expert), padding to a 128-byte line (never written or read), the token row and its fp32
// scales; slots are a whole number of lines. Each slot is written once: pushed to its receiver
// (the first P for a peer of our node, all of them for another node) or kept in our send area.
//
// Steps (one stream; kernels in order):
//   DispatchSend: Route (per chunk of 512 tokens: each token's slot and combine-row positions
//                 on every receiving rank within the chunk, by block scans, and the chunks'
//                 carries from the scan block that ends last; per chunk of (token, k) entries:
//                 each copy's rank among the chunk's copies for its expert, by warp matches and
//                 per-warp counts) -> Pack (the grid what is resident at once, started behind
//                 Route; adds the carries; a warp per token, tokens spread over the blocks; the
//                 warp lays out a token's slots, lane per copy; the row is read once and stored
//                 into each slot; block 0 writes the counts rows into every peer; every block
//                 then arrives at every peer's dispatch flag).
//                 Decode batches (a rank's T * K routing entries fit in shared memory) take one
//                 kernel instead, SendSmall: every block reads the whole routing and counts what
//                 Route computes for its own four tokens (shared-memory histograms over all
//                 tokens and over those before its own, warp ballots within), a warp per token
//                 stores the row; block 0 only writes the counts rows; every block arrives.
//   DispatchRecv: Unpack (every block reads the counts rows as soon as they are there -- in one
//                 node each carries a 32-bit tag, "epoch + 1", in the column after the
//                 CountsColumn values, released by the sender's block 0 once the rows are out
//                 (ld.acquire.sys, a thread per sender); across nodes once every flag is up --
//                 and builds its offsets table from them while the send blocks still store
//                 slots; then waits for all dispatch flags; slot by slot -- a block
//                 per slot when they fit the grid, a warp per slot when they outnumber it --
//                 from our private region, from the sender's send area over NVLink, or from our
//                 own send area; rows into the expert-major output at the sender's offset for
//                 that expert plus the copy's position (token-major: row g for slot g);
//                 remembers where each combine row returns).
//   CombineSend:  CombineSend (each received copy's expert output -- or, summed at the expert
//                 rank, one row per token -- pushed into its sender's combine region; every
//                 block arrives at every peer's combine flag).
//   CombineRecv:  CombineRecv (every block waits for all combine flags; per token -- a block
//                 each when they fit the grid, a warp each when they outnumber it -- its rows in
//                 rank then k order, fp32, unfused, as the host device sums them, eight columns
//                 per thread; the last block advances the epoch).
//
// Reuse needs no extra barrier: every pair of ranks exchanges both flags every epoch, and each
// rank's steps run in stream order, so a rank's DispatchSend of epoch i + 1 (which rewrites its
// send area and peers' private regions and counts) runs after its CombineRecv of epoch i, which
// waited for every peer's CombineSend of epoch i, which ran after that peer's DispatchRecv of
// epoch i had read everything. The same chain with dispatch and combine swapped covers the
// combine regions. Each block of a send step arrives with red.release.sys.add on the flag of
// every rank of our node (after a barrier: the release carries the block's stores, peers' memory
// included), read with ld.acquire.sys; for other nodes the blocks meet at a ticket taken with
// atom.acq_rel.sys and the last one stores the one outbox flag the relay watches (st.release.sys).
// Waits give up at a deadline (%globaltimer).
//
// Streaming (one node; AllToAllConfig::streaming, the same on every rank -- it is part of the
// config's fingerprint, so ranks that differ fail Create).
//
// Streamed dispatch: the receiver does not wait for every send block before it takes a slot.
// Each slot
// carries a 64-bit tag after its entries, stored "epoch + 1" with st.release.sys by a lane of
// the warp that wrote the slot once its lanes met at __syncwarp. Unpack, once the counts rows'
// tags are up (as unstreamed), does not wait for the flags: per slot its group's first thread
// waits for the slot's tag -- or, for a slot it pulls from the
// sender's send area, for that sender's dispatch flag, which the send blocks still raise -- and
// a vote hands it to the group. Pack and Unpack then run side by side, a block of each per SM
// (Route/Pack path), so the rows are unpacked while the link still carries the rest. Unpack
// then skips griddepcontrol.wait (see UnpackKernel); its groups claim slots from a counter, and
// its second block per SM starts once Pack's leaves.
//
// Streamed combine: every returned row has a 64-bit tag in the receiver's buffer (combine_tags,
// [T * K] after the combine region), "epoch + 1" released by the CombineSend block once its
// threads stored the row. CombineRecv's blocks claim tokens in order and sum each once the tags
// of its rows are up (a lane per row waits), instead of waiting for every CombineSend block of
// every rank first. The reuse chain above still needs every peer's CombineSend done before our
// next DispatchSend (a rank may need no row from a peer, and so see nothing of it): the block
// of CombineRecv that ends last waits for every combine flag before it advances the epoch.
//
// Early start: the receive kernels (Unpack, CombineRecv) are launched with programmatic
// stream serialization and the send kernels let them start at once (griddepcontrol); a receive
// kernel waits for its flags, reads counts and locates its first slot while the send kernel
// runs, and waits for the kernel before it (griddepcontrol.wait) only before its first store
// into the caller's memory.
//
// Rank masks (AllToAll::SetMasked, mask_lost_peers; Nv::masks): a device word per rank. The
// send kernels read an id of a masked rank's expert as -1; Unpack reads a masked sender's
// counts row as zeros; the combine leaves out a masked rank's rows; no flag of a masked rank is
// raised or waited for. SetMasked's words are set by a memset on the stream before the next
// DispatchSend; the send kernel's block 0 copies them into the relay's control block. Under
// mask_lost_peers a receive wait that reaches its deadline masks the ranks it still waits for:
// block 0 alone waits and decides, then publishes to the other blocks (WaitStep), so nothing
// streams and the counts rows are read after the flags. Instances built without masks serve
// steps while Nv::masks is null. A CUDA graph holds the masks pointer and kernels it was
// captured with: under mask_lost_peers (masks read from the start) a mask the caller sets
// between replays reaches them (SetMasked sets it on the stream at once); a graph captured
// without masks never reads one.
//
// Errors a kernel finds are claimed in device memory (the first wins) and mirrored into pinned
// host words the host reads; no atomics on host memory (not atomic over PCIe).
//
// Results are bit-identical to the host device (same rows, same order, same sums).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <memory>
#include <vector>

#include "common/cuda_shared_memory.h"
#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "moe/cuda/cuda_util.cuh"
#include "moe/cuda/nvlink_protocol.cuh"
#include "moe/cuda/relay_boxes.h"
#include "moe/device.h"
#include "moe/numerics.h"
#include "moe/relay.h"
#include "moe/wire.h"

namespace ferry::moe {

// Thread safety: the shell's thread (moe/device.h). Created by CreateCudaDevice: Init runs the
// set-up stages (collective); the steps enqueue kernels on stream_ and, without a caller's
// stream, wait for them.
class CudaDevice final : public MoeDevice {
 public:
  CudaDevice(const AllToAllConfig& c, const Hearing* hearing)
      : c_(c), pairs_(c), hearing_(hearing ? *hearing : Hearing{}) {}
  // Waits for the device: kernels on the caller's stream (which may be gone by now) may still
  // use our memory.
  ~CudaDevice() override;

  // Collective; the set-up stages (cuda_device_setup.cu), in order. first_epoch: where a
  // device that joins a running world starts (AllToAll::Join and Readmit: the survivors'
  // epoch, in the kernels' scratch, the node's flags in our buffer and the relay's thread).
  // adopt_counters: as the relay's (Relay::Create; node-once's hops built anew).
  Status Init(TransferEngine* engine, Bootstrap& bootstrap, uint64_t first_epoch = 0,
              bool adopt_counters = false);

  // Membership (AllToAll::Readmit): made anew, survivors and new processes alike, from the
  // survivors' epoch (Init's first_epoch).
  bool readmits_anew() const override { return true; }

  DeviceCaps caps() const override { return {.streams = true, .device_token_count = true}; }

  // cuda_device_launch.cu
  Status DispatchSend(const DispatchInput& in, uint64_t epoch) override;
  Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) override;
  Status CombineSend(const CombineInput& in, uint64_t epoch) override;
  Status CombineRecv(const CombineOutput& out, uint64_t epoch, Deadline deadline) override;
  Status Quantize(const DispatchInput& in, const void** x, const float** scales) override;

  // cuda_device_sync.cu
  Status ApplyMasks(const std::vector<uint8_t>& ranks) override;
  bool masks_live() const override { return nv_.masks != nullptr; }
  // The kernels' lost-rank mirror in pinned host memory, read without waiting for the stream.
  bool masked_so_far(int rank) const override {
    return reinterpret_cast<const volatile int32_t*>(error_)[4 + rank] != 0;
  }
  StatusOr<std::vector<uint8_t>> Masked() const override;
  Status Sticky() override;
  uint64_t dispatch_bytes_sent() const override;
  uint64_t combine_bytes_sent() const override;
  Status SetStream(void* stream) override;
  Status Synchronize() override;
  Status Poll(bool* done) override;
  bool capturing(void* stream) const override;
  Status Mark(uint64_t* mark) override;
  Status Reached(uint64_t mark, bool wait, bool* reached) override;
  Status OrderAfter(void* stream) override;
  Status OrderBefore(void* stream) override;

 private:
  static constexpr auto kExchangeTimeout = std::chrono::seconds(60);

  // ---- set-up stages (cuda_device_setup.cu; the kernel plan in cuda_device_launch.cu) ----
  // The device and our own stream; its SM count into *sms.
  Status OpenDevice(int* sms);
  // The shared buffer's layout (see above) into nv_, with what decides it: which DispatchSend
  // kernels serve (SendSmall or Route + Pack) and which steps are streamed. Its size in bytes.
  StatusOr<int64_t> PlanBuffer();
  // Every kernel's grid and shared memory, and the launch settings (CudaTuning).
  Status PlanGrids(int sms);
  // Our buffer (cuMemCreate, exported) and every other member's of our node, mapped here; by
  // rank, null outside our node.
  StatusOr<std::vector<uint8_t*>> MapNodeBuffers(Bootstrap& bootstrap, int64_t bytes);
  // Other nodes: the relay's inbox and outbox (GPU or pinned host memory), its control block
  // (pinned host memory), and the relay, from first_epoch (taking this instance's counters over
  // with adopt_counters). The buffers as the kernels address them (nothing where every rank is
  // in our node).
  StatusOr<RelayBuffers> StartRelay(const RelayLayout& relay, TransferEngine* engine,
                                    Bootstrap& bootstrap, uint64_t first_epoch,
                                    bool adopt_counters);
  // Every rank as the kernels reach it: NodePeer in our node, RemotePeer (the relay) outside;
  // with what each rank's send grid adds to its flags (exchanged).
  StatusOr<std::vector<nv::NvPeer>> ExchangePeers(Bootstrap& bootstrap, const RelayLayout& relay,
                                                  const RelayBuffers& mapped,
                                                  const std::vector<uint8_t*>& bases);
  // The kernels' device state (peers, scratch, routing copies, receive tables, the error words,
  // CudaTuning::trace's stamps) and nv_'s pointers to it.
  Status AllocateDeviceState(const std::vector<nv::NvPeer>& peers, uint8_t* own);
  // Rank r of our node: its buffer `theirs` (mapped here) and ours, `own`.
  nv::NvPeer NodePeer(uint8_t* own, uint8_t* theirs, int r) const;
  // Rank r of another node: our outbox section for it, our inbox section from it, the relay's
  // control words and the flags it raises for us (device pointers: `mapped` as the kernels
  // address the relay's buffers, `flags_in` the inbox flags, [2N] dispatch then combine).
  static nv::NvPeer RemotePeer(const RelayLayout& relay, const RelayBuffers& mapped,
                               uint64_t* flags_in, int r);
  // Slots a rank may receive in one step: the receive grids and tables are sized by it.
  int64_t MaxReceived() const { return int64_t{c_.world_size} * pairs_.slots_per_pair; }

  // ---- launches (cuda_device_launch.cu) ----
  // A kernel on our stream allowed to start while the kernel before it runs (see
  // LaunchDependents): the receive kernels, and Pack behind Route.
  template <typename Args>
  cudaError_t Launch(void (*kernel)(nv::Nv, Args), int grid, size_t smem, const Args& args);
  // Blocks of the per-token kernels: one per token up to four per SM (then they loop).
  int TokenGrid(int tokens) const { return std::max(1, std::min(tokens, recv_grid_limit_)); }
  // The kernels move rows as 16-byte vectors.
  static Status Aligned(const void* p, const char* what);
  static uint64_t BudgetNs(Deadline deadline);
  // The combine's element: fp32 (combines_fp32), else as the step was told.
  Elem ElemOf(bool fp16) const { return moe::ElemOf(c_, fp16); }

  // ---- errors and tracing (cuda_device_sync.cu) ----
  // Waits for the stream; what a kernel reported becomes the Status (and is cleared, except a
  // peer timeout, which stays).
  Status Finish();
  // How a step completes: it waits for its kernels on the device's own stream (strict: bad input
  // sends nothing, and the step may be retried), or leaves them queued on a caller's stream
  // (SetStream), where a kernel's error surfaces at a later step.
  enum class Completion : uint8_t { kWaited, kOnCallerStream };
  // CombineSend's instance: the general one, or the copy-only one (token-major batches whose
  // received rows each have a block of their own).
  enum class CombineSendForm : uint8_t { kGeneral, kCopyOnly };
  bool waited() const { return completion_ == Completion::kWaited; }
  Status Done() { return waited() ? Finish() : Status::Ok(); }
  // For the last epoch, per kernel: each point's slowest and mean block time (CudaTuning::trace).
  void PrintTrace();

  const AllToAllConfig c_;
  const PairLimits pairs_;
  nv::Nv nv_{};
  SharedCudaMemory shared_;
  RelayBoxes boxes_;  // other nodes: the relay's memory (relay_boxes.h)
  std::unique_ptr<Relay> relay_;
  DeviceArray<nv::NvPeer> peers_;
  DeviceArray<nv::Scratch> scratch_;
  DeviceArray<int32_t> indices_, slot_pos_, row_pos_, totals_, erank_, chunk_counts_;
  DeviceArray<int32_t> masks_;  // Nv::masks
  DeviceArray<int64_t> scan_carry_;
  DeviceArray<float> weights_;
  DeviceArray<uint8_t> fp8_x_;  // DispatchInput::x_bf16 quantised (allocated at its first use)
  DeviceArray<float> fp8_scales_;
  DeviceArray<nv::RecvSlot> rslots_;
  DeviceArray<nv::RecvEntry> rentries_;
  DeviceArray<long long> trace_;
  // Pinned, mapped: [4] the error words, [N] Nv::mask_mirror, [N] Nv::heard (hearing_'s
  // mirror, where it has a Liveness).
  int32_t* error_ = nullptr;
  const Hearing hearing_;
  cudaStream_t own_stream_ = nullptr, stream_ = nullptr;
  cudaEvent_t order_event_ = nullptr;  // OrderAfter / OrderBefore
  std::array<cudaEvent_t, AllToAll::kMarks> marks_{};  // Mark's ring, made at their first use
  uint64_t next_mark_ = 0;
  Completion completion_ = Completion::kWaited;
  int send_grid_ = 1;    // DispatchSend's (SendSmall or Pack), fixed
  int recv_grid_ = 1;    // CombineSend's, and Unpack's unless streamed
  int unpack_grid_ = 0;  // Unpack's
  int recv_grid_limit_ = 1;
  CombineSendForm combine_send_ = CombineSendForm::kGeneral;
  int token_bound_ = 0;             // the last DispatchSend's num_tokens
  size_t small_smem_ = 0;           // SendSmallKernel's shared memory; 0: Route and Pack instead
  size_t unpack_smem_ = 0;
  Status failed_ = Status::Ok();
  int64_t expert_rows_ = 0;  // the last DispatchRecv's expert block (for its overflow's error)
};

}  // namespace ferry::moe
