// The NVLink AllToAll: dispatch and combine between GPUs, kernels only; inside a node over
// NVLink, between nodes through the relay (relay.h).
//
// Files: moe/wire.h (the counts row and slot format, which the host device speaks too),
// nvlink_layout.h (the buffer below), nvlink_protocol.cuh (what kernels and host share: the peer
// table, device state, flags and waits), the kernels step by step -- nvlink_send.cuh (DispatchSend:
// Route, Pack, SendSmall), nvlink_recv.cuh (DispatchRecv: Unpack), nvlink_combine.cuh
// (CombineSend, CombineRecv) -- relay_boxes.h (the relay's memory as the kernels and the NIC
// see it) and nvlink_all_to_all.cu (the host side: memory, peers, relay, launches).
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
// FERRY_GDRCOPY=0 turns it off) the inbox flags live in our GPU's memory instead and the relay
// writes them through the GDRCopy mapping, so the kernels poll local memory (gdr_flags.h).
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
//                 remembers where each combine row returns; CudaTuning::spread: slots visited
//                 spread over their senders, see SpreadOrder).
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
// Streaming (one node; CudaTuning::stream, the same on every rank -- it is part of the
// config's fingerprint, so ranks that differ fail Create: 1 the dispatch, 2 the combine, 3
// both, 0 neither; -1, the dispatch where SendSmall serves it, decode batches, and nothing
// else).
//
// Streamed dispatch: the receiver does not wait for every send block before it takes a slot. Each slot
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
// into the caller's memory. CudaTuning::early_receive false launches them plainly.
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

#include <memory>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"

namespace ferry::moe {

// config.device == kCuda, any ranks_per_node (1: every peer through the relay). `engine`
// carries the traffic between nodes and may be null when there is one node. Collective.
StatusOr<std::unique_ptr<AllToAll>> NewNvlinkAllToAll(const AllToAllConfig& config,
                                                      TransferEngine* engine,
                                                      Bootstrap& bootstrap);

}  // namespace ferry::moe
