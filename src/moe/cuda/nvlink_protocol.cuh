// What the NVLink AllToAll's kernels share with its host side (cuda_device_*.cu): launch
// shapes, the per-rank device state (Scratch), the peer table (NvPeer), the argument structs,
// the error codes and the trace slots. The device helpers the kernels use are in
// nvlink_device.cuh; the kernels in nvlink_send.cuh, nvlink_send_small.cuh, nvlink_recv.cuh and
// nvlink_combine.cuh. Each kernel lives in the namespace of its step, nv::dispatch or
// nv::combine (node-once's rounding kernel too), so that a profiler finds a step's kernels by the
// names "dispatch" and "combine", as it finds DeepEP's.
// Design in cuda_device.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "moe/cuda/cuda_util.cuh"
#include "moe/cuda/step_modes.h"
#include "moe/liveness.h"
#include "moe/relay.h"
#include "moe/wire.h"

namespace ferry::moe::nv {

constexpr int kRouteThreads = 512;
constexpr int kSortItems = 4;                       // entries per thread in Route's CountChunk
constexpr int kChunk = kRouteThreads * kSortItems;  // (token, k) entries per CountChunk block
constexpr int kScanRanks = 4;  // ranks one Route scan block counts (tokens: kRouteThreads)
constexpr int kCopyThreads = 256;
constexpr int kMaxK = 16;                           // the CUDA device's top-k limit
constexpr int kMaxExperts = 1024;
// DispatchSend as one kernel (SendSmallKernel) when a rank's (token, k) entries fit in shared
// memory: decode batches. Warp per token.
constexpr int kSmallEntries = 2048;
constexpr int kSmallWarps = 4;
constexpr int kSmallThreads = 32 * kSmallWarps;
constexpr int kLaneVectors = 16;  // 16-byte vectors a lane keeps in flight in the warp copies

// ---- what travels and what stays -------------------------------------------------------------

// The slot format, the counts row and the slot checks are moe/wire.h's (both devices').

// What Unpack learned about a received slot, for CombineSend.
struct RecvSlot {
  int32_t sender, row, entries, part, parts, pad[3];
};
struct RecvEntry {
  int64_t out_row;  // local expert * capacity + row within it
  float weight;
  int32_t pad;
};

enum ErrorCode : int32_t {
  kNoError = 0,
  kBadExpert = 1,      // token, expert id
  kTooManyTokens = 2,  // device count, bound
  kBadSlot = 3,        // sender, slot
  kRowOverrun = 4,     // -1, local expert
  kPeerTimeout = 5,    // which flag (0 dispatch, 1 combine), rank
  kStepStalled = 6,    // which flag, block: block 0's wait was not published in time (WaitStep)
  kExpertFull = 7,     // copies, local expert: more than its block (DispatchOutput::expert_rows)
};

// Device-side state of one rank.
struct Scratch {
  uint64_t epoch;           // advanced by the last block of CombineRecv
  int64_t rows_out;         // combine rows this rank returned to peers this epoch
  int32_t tokens;           // T of this epoch (after the device count is checked)
  int32_t total_recv;       // slots received this epoch
  int32_t abort;            // a wait timed out: later waits give up at once
  int32_t error;            // an ErrorCode, claimed by the first Report (see Nv::error)
  uint64_t seen[2];         // with remote peers: the dispatch [0] / combine [1] flags block 0 saw
                            // all raised ("epoch + 1"), which the other blocks wait for
  uint32_t tickets[4];      // last-block detection: the send steps' outbox flag (Arrive, with
                            // peers in other nodes), CombineRecv's epoch, Route's carries
  uint32_t claimed;         // streamed: received slots Unpack's groups took so far (reset by
                            // CombineRecv's last block)
  uint32_t claimed_tokens;  // streamed combine: tokens CombineRecv's blocks took so far (the
                            // same)
};

// Rank r as our kernels see it: where what r must receive from us goes, and where what r sent
// us is. A rank of our node: its buffer over NVLink, and ours. A rank of another node: our outbox
// section for it and our inbox section from it, which the relay connects (relay.h).
struct NvPeer {
  // Sending to r.
  uint64_t* dispatch_flag;  // "epoch + 1" once our counts row and slots for r are in place
  uint64_t* combine_flag;   // the same for the combine rows we return to r
  int32_t* counts;          // [counts_stride] our counts row for r (L + kCountsColumns used)
  uint8_t* slots;           // [slot_cap] slots our kernels push for r (r's private region)
  uint8_t* combine;         // rows we return to r: r's combine region (row: r's row), or our
                            // outbox section (row: from the first one r expects from us)
  uint64_t* combine_tags;   // streamed combine: r's row tags (row: r's row); null otherwise
  // Receiving from r.
  const uint64_t* dispatch_flag_in;
  const uint64_t* combine_flag_in;
  const int32_t* counts_in;  // [counts_stride] r's counts row for us, 16-byte aligned
  const uint8_t* slots_in;   // [slot_cap] the slots r pushed
  const uint8_t* pull;       // r's send area, where we pull slots past slot_cap; null: none
  const uint8_t* combine_in; // our combine region as r's rows land in it (row: our row)
  int32_t slot_cap;          // slots pushed per pair: P in a node, all of them between nodes
  int32_t row_cap;           // rows `combine` holds
  int32_t remote;            // another node (combine rows rebased, see combine)
  // What r's dispatch and combine flags for us gain per epoch: in our node every block of r's
  // send kernel adds one (its grid); from another node the relay stores "epoch + 1" (1).
  int32_t dispatch_step, combine_step;
  // Another node: the relay's control words (relay.h) -- our slot count for r, which the send
  // kernel's block 0 stores with our counts row, and {start, rows} of r's counts row for us,
  // which Unpack's block 0 copies there; the relay reads them in host memory. Null in our node.
  int64_t* relay_slots;
  int64_t* relay_rows;
  // Another node: r's mask word in the relay's control block (relay.h's MaskWordValue), which
  // the send kernel's block 0 copies r's device mask into (PublishMasks) and a receive wait
  // sets when it masks r as lost; the relay neither writes to a masked rank nor waits for it.
  // Null in our node.
  uint64_t* relay_mask;
};

// A rank's word in Nv::masks: 0, masked by the caller (AllToAll::SetMasked: the host sets the
// word's four bytes with cudaMemsetAsync, in stream order before the DispatchSend it applies
// to), or kMaskedLost (a receive wait under mask_lost_peers gave up on the rank; relay.h).
constexpr int32_t kDeviceMaskedByCaller = 0x01010101;
static_assert(kMaskedLost != 0 && int32_t{kMaskedLost} != kDeviceMaskedByCaller,
              "the two reasons stay apart");

// Everything the kernels share; passed by value.
struct Nv {
  // The shape, with the letters the comments below use: N ranks, E experts, L = E / N local
  // experts, top-K, at most T tokens a rank.
  int world_size, rank;              // N, and ours
  int experts, local_experts, topk;  // E, L, K
  int max_tokens, hidden;            // T, a row's columns
  int scales_per_token;              // fp32 scales per row (fp8: hidden / 128; bf16: 0)
  int private_slots;  // per (sender, receiver): slots written before the counts are known
  int chunks;         // Route's chunks of kChunk routed copies
  // By local_experts and by topk without a runtime division (RankOf, LocalOf).
  FastDiv div_local_experts, div_topk;
  int scan_blocks;  // Route's token chunks x rank groups (ScanChunk)
  int counts_stride;  // int32 per counts row: L + kCountsColumns, rounded up to 16 bytes
  int64_t payload, slot_bytes, meta_bytes, row_bytes, capacity, slots_per_pair;
  int64_t meta_used;  // header and entries; meta_bytes rounds it up to a 128-byte line
  // The step's modes (step_modes.h). Where they say tags:
  // - counts_tagged(): each counts row carries a 32-bit tag, "epoch + 1" once the row is in
  //   place, in column CountsTagColumn; Unpack reads the rows and builds its offsets table as
  //   soon as the tags are up, while the send blocks still store slots, and only then waits for
  //   their arrivals (or, streamed, for each slot's tag).
  // - stream() (see cuda_device.h): each slot carries a 64-bit tag, "epoch + 1" once its bytes
  //   are in place, at SlotTagOffset (right after the entries); Unpack takes each slot as its
  //   tag comes up instead of waiting for every send block's arrival.
  // - stream_combine(): each returned row's 64-bit tag, "epoch + 1" once the row is in place, at
  //   combine_tag_off + row * 8 in the receiver's buffer; CombineRecv sums each token as its
  //   rows' tags come up and waits for the combine flags only before the epoch ends.
  // token_major(): received slot g is output row g.
  StepModes modes;
  int64_t combine_tag_off;
  int first_remote;  // the lowest rank of another node, -1 if none (WaitStep, Arrive)
  int64_t counts_off, private_off, combine_off, send_off;  // flags at 0
  uint8_t* own;          // our buffer (its send area holds the slots peers pull and our own)
  const NvPeer* peer;    // [N] every rank, ours included
  Scratch* scratch;
  int32_t* error;        // [3] code, detail, detail: mapped pinned host memory, the mirror of
                         // scratch->error the host reads
  int32_t* indices;      // [T, K] our copy of the routing
  float* weights;        // [T, K]
  int32_t* slot_pos;     // [N, T] token t's first slot among ours for rank r, less its
                         // token chunk's carry (Route -> Pack; null when SendSmall serves every
                         // batch, as erank, chunk_counts and scan_carry)
  int32_t* row_pos;      // [N, T] token t's first combine row among those from rank r (Route
                         // leaves the carry out, Pack adds it; CombineRecv reads the sum)
  int32_t* totals;       // [2N] slots per receiving rank, combine rows per expert rank
  int64_t* scan_carry;   // [T / kRouteThreads rounded up, N] what the token chunks before
                         // chunk c take on rank r: slots, rows << 32 (Route -> Pack)
  int32_t* erank;        // [T * K] a copy's rank within its chunk's copies for its expert
  int32_t* chunk_counts; // [chunks, E]
  RecvSlot* rslots;      // [N * slots_per_pair]
  RecvEntry* rentries;   // [N * slots_per_pair, K]
  long long* trace;      // null, or [kTraceKernels][trace_blocks][kTraceSlots] (see Mark)
  int trace_blocks;
  // Rank masks (AllToAll::SetMasked, AllToAllConfig::mask_lost_peers): [N] device words (see
  // kDeviceMaskedByCaller), null while no rank was ever masked and mask_lost_peers is off --
  // then no kernel reads one. A masked rank's expert ids read as -1 when the send kernels read
  // the routing (IdAt), its counts row as zeros, its rows as none in the combine (LocateRows);
  // no flag of it is waited for or raised.
  int32_t* masks;
  // modes.mask_lost(): a receive wait that reaches its deadline masks the ranks it still waits
  // for (MaskLost) instead of failing the step. One thread decides for the whole step (WaitStep
  // through block 0), so that every block of the kernel reads the same ranks as masked; the
  // counts rows' tags and streaming, whose waits are per block and per slot, are off.
  int32_t* mask_mirror;  // [N] mapped pinned host memory: kMaskedLost where a wait masked r
  // modes.mask_lost() under node-once (moe/liveness.h): [N] mapped pinned host memory, 1 while
  // rank r is heard from (its heartbeats, mirrored by the host), else 0. A rank that misses the
  // budget but is heard from is late, not lost: waited for on while it stays heard from, up to
  // kLateWaits more budgets (WaitAll). Null elsewhere: a rank past the budget is lost.
  const int32_t* heard;
};

// Streamed dispatch: where a slot's tag is (the bytes right after its header and entries,
// within the metadata's line), and which int32 of a counts row is the row's tag (the one after
// the CountsColumn values).
__host__ __device__ inline int64_t SlotTagOffset(const Nv& v) { return v.meta_used; }
// The send area at send_off: a slot for each of our T * K copies (the most we can send).
__host__ __device__ inline int64_t SendAreaBytes(const Nv& v) {
  return int64_t{v.max_tokens} * v.topk * v.slot_bytes;
}
__host__ __device__ inline int CountsTagColumn(const Nv& v) {
  return v.local_experts + kCountsColumns;
}

struct SendArgs {
  const uint8_t* x;
  const float* scales;
  const int32_t* indices;    // the routing, [T, K]: int32 ids, or
  const int64_t* indices64;  // int64 ones (the other null), narrowed as they are read (IdAt)
  const float* weights;
  const int32_t* dev_tokens;
  int bound;
  bool strict;  // an input error (expert id, device count) sends nothing at all
};
struct RecvArgs {
  uint8_t* out_x;        // [L * capacity] rows, or token-major [capacity] rows
  float* out_scales;     // the same rows' scales; fp8 only
  int32_t* num_tokens;   // [L]
  uint64_t timeout_ns;
  int32_t* num_rows;       // token-major: [1]
  int32_t* token_experts;  // token-major: [capacity, K]
  int64_t* token_experts64;  // token-major, instead of token_experts: [capacity, K]
  float* token_weights;    // token-major: [capacity, K]
  int32_t padding;         // expert-major: 0, or DispatchOutput::expert_padding
  int64_t out_rows;        // the rows out_x holds (a placement at or past them is dropped)
  int64_t expert_rows;     // expert-major unpadded: each local expert's block (capacity, or
                           // DispatchOutput::expert_rows: a copy past it is dropped)
  int64_t* wait_cost;      // [N] or null: DispatchOutput::wait_cost (AwaitCounted)
  int32_t* source_tokens;  // or null: DispatchOutput::source_tokens
  int64_t* sender_ranges;  // expert-major, or null: DispatchOutput::sender_ranges
  int32_t* source_ranks;   // or null: DispatchOutput::source_ranks
};
struct CombineArgs {
  const uint8_t* expert_out;  // rows of Nv::row_bytes (bf16, or fp32: combines_fp32)
  uint8_t* out;
  bool accumulate;
  uint64_t timeout_ns;
  const float* weights;  // [T, K] given at CombineRecv; null: the dispatch's copy (Nv::weights)
  int64_t* wait_cost;    // [N] or null: CombineOutput::wait_cost (AwaitCounted)
};

// Phase timing for tuning (CudaTuning::trace): thread 0 of each block stamps
// clock64() at numbered points of a kernel (0: its start), and the global timer at its start and
// at its latest point; the AllToAll prints, when destroyed, for the last epoch: each point's
// slowest and mean block time since that block's start, and when the kernel's blocks started and
// ended relative to the first DispatchSend block (the gaps between the kernels). No reset runs
// between launches (it would sit between the kernels): stamps carry their epoch.
enum TraceKernel {
  kTraceSend,
  kTraceUnpack,
  kTraceCombineSend,
  kTraceCombineRecv,
  kTraceRoute,
  kTraceKernels
};
constexpr int kTracePoints = 8;
enum TraceSlot { kTraceEpoch = kTracePoints, kTraceStartNs, kTraceLastNs, kTraceSlots };

}  // namespace ferry::moe::nv
