// What the NVLink AllToAll's kernels share with its host side (cuda_device_*.cu): launch
// shapes, the per-rank device state (Scratch), the peer table (NvPeer), the
// argument structs, and the device helpers every kernel uses -- flags, waits, arrivals, errors,
// trace stamps, a token's routing, claims. Design in cuda_device.h; the kernels are in
// nvlink_send.cuh, nvlink_recv.cuh and nvlink_combine.cuh. Included by the cuda_device_*.cu files
// only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "moe/cuda/cuda_util.cuh"
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
  bool once, reduce;
  // One node (no relay): each counts row carries a 32-bit tag, "epoch + 1" once the row is in
  // place, in column CountsTagColumn; Unpack reads the rows and builds its offsets table as
  // soon as the tags are up, while the send blocks still store slots, and only then waits for
  // their arrivals (or, streamed, for each slot's tag).
  bool counts_tagged;
  // Streamed dispatch (one node; see cuda_device.h): each slot carries a 64-bit tag,
  // "epoch + 1" once its bytes are in place, at SlotTagOffset (right after the entries); Unpack
  // takes each slot as its tag comes up instead of waiting for every send block's arrival.
  bool stream;
  // Streamed combine (one node): each returned row's 64-bit tag, "epoch + 1" once the row is in
  // place, at combine_tag_off + row * 8 in the receiver's buffer; CombineRecv sums each token as
  // its rows' tags come up and waits for the combine flags only before the epoch ends.
  bool stream_combine;
  int64_t combine_tag_off;
  bool token_major;  // DispatchLayout::kTokenMajor: received slot g is output row g
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
  // mask_lost_peers: a receive wait that reaches its deadline masks the ranks it still waits
  // for (MaskLost) instead of failing the step. One thread decides for the whole step (WaitStep
  // through block 0), so that every block of the kernel reads the same ranks as masked; the
  // counts rows' tags and streaming, whose waits are per block and per slot, are off.
  bool mask_lost;
  int32_t* mask_mirror;  // [N] mapped pinned host memory: kMaskedLost where a wait masked r
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
  float* token_weights;    // token-major: [capacity, K]
  int32_t padding;         // expert-major: 0, or DispatchOutput::expert_padding
  int64_t out_rows;        // the rows out_x holds (a placement at or past them is dropped)
  int64_t expert_rows;     // expert-major unpadded: each local expert's block (capacity, or
                           // DispatchOutput::expert_rows: a copy past it is dropped)
  int64_t* wait_cost;      // [N] or null: DispatchOutput::wait_cost (AwaitCounted)
};
struct CombineArgs {
  const uint8_t* expert_out;  // rows of Nv::row_bytes (bf16, or fp32: combines_fp32)
  uint8_t* out;
  bool accumulate;
  uint64_t timeout_ns;
  const float* weights;  // [T, K] given at CombineRecv; null: the dispatch's copy (Nv::weights)
  int64_t* wait_cost;    // [N] or null: CombineOutput::wait_cost (AwaitCounted)
};

// ---- flags, fences, errors --------------------------------------------------------------------

__device__ inline uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline void StoreRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ inline uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ inline void AddRelease(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// For a word only threads of this GPU acquire: the release need not wait for the system.
__device__ inline void StoreReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (sm_90): a send kernel lets the receive kernel behind it start
// at once (LaunchDependents); the receive kernel waits for its flags meanwhile and calls
// WaitPrimary -- which returns once the kernel before it finished and its writes are visible --
// before it touches memory the kernel before it (ours or the caller's) may still use: the
// caller's outputs. Route lets Pack start the same way; Pack waits before reading Route's
// output. Launched without the attribute, WaitPrimary returns at once.
__device__ inline void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ inline void WaitPrimary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ inline uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

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
__device__ inline void Mark(const Nv& v, TraceKernel kernel, int point) {
  if (v.trace && threadIdx.x == 0 && static_cast<int>(blockIdx.x) < v.trace_blocks) {
    long long* at = v.trace + (int64_t{kernel} * v.trace_blocks + blockIdx.x) * kTraceSlots;
    const long long ns = static_cast<long long>(GlobalTimerNs());
    if (point == 0) {
      for (int p = 1; p < kTracePoints; ++p) at[p] = 0;
      at[kTraceEpoch] = static_cast<long long>(v.scratch->epoch) + 1;
      at[kTraceStartNs] = ns;
    }
    at[point] = clock64();
    at[kTraceLastNs] = ns;
  }
}
// A point that reports `cycles` (a span the block summed, e.g. over its loop) as its time since
// the block's start.
__device__ inline void MarkSpan(const Nv& v, TraceKernel kernel, int point, long long cycles) {
  if (v.trace && threadIdx.x == 0 && static_cast<int>(blockIdx.x) < v.trace_blocks) {
    long long* at = v.trace + (int64_t{kernel} * v.trace_blocks + blockIdx.x) * kTraceSlots;
    at[point] = at[0] + cycles;
  }
}

// The first error of a step wins the device word; its reporter mirrors it into the host's
// mapped words (plain stores: atomics on host memory over PCIe are not atomic, and
// compute-sanitizer rejects them), the code last.
__device__ inline void Report(const Nv& v, int32_t code, int32_t a, int32_t b) {
  if (atomicCAS(&v.scratch->error, 0, code) == 0) {
    volatile int32_t* host = v.error;
    host[1] = a;
    host[2] = b;
    __threadfence_system();
    host[0] = code;
  }
}

// One thread: until the word at `p` reaches `want` (acquire at system scope: what its writer
// released before it is visible to this thread, and to the threads this one then meets at a
// barrier), another wait gave up, or the budget from `start` runs out -- then reported as rank
// r's missing `which` flag (0 dispatch, 1 combine), and every later wait gives up at once.
// A 64-bit word counts up and is there at `want` or beyond; a 32-bit tag is there when it
// equals `want` (it wraps: "epoch + 1" modulo 2^32, whose previous value is want - 1).
__device__ inline bool Reached(uint64_t got, uint64_t want) { return got >= want; }
__device__ inline bool Reached(uint32_t got, uint32_t want) { return got == want; }
// `may_mask` (mask_lost_peers, WaitAll): at the budget, false without aborting or reporting --
// the caller masks r instead.
template <typename Word>
__device__ inline bool AwaitWord(const Nv& v, const Word* p, Word want, uint64_t start,
                          uint64_t budget_ns, int which, int r, bool may_mask = false) {
  while (!Reached(LoadAcquire(p), want)) {
    if (*reinterpret_cast<volatile int32_t*>(&v.scratch->abort)) return false;
    if (GlobalTimerNs() - start > budget_ns) {
      if (may_mask) return false;
      atomicExch(&v.scratch->abort, 1);
      Report(v, kPeerTimeout, which, r);
      return false;
    }
  }
  return true;
}

// AwaitWord, with the clock64 cycles it took added to cost[r] where cost is given (the step's
// wait_cost: what rank r kept this thread waiting). A caller whose wait every block repeats
// passes cost from one block only.
template <typename Word>
__device__ inline bool AwaitCounted(const Nv& v, int64_t* cost, const Word* p, Word want,
                                    uint64_t start, uint64_t budget_ns, int which, int r,
                                    bool may_mask = false) {
  if (!cost) return AwaitWord(v, p, want, start, budget_ns, which, r, may_mask);
  const long long begin = clock64();
  const bool ok = AwaitWord(v, p, want, start, budget_ns, which, r, may_mask);
  atomicAdd(reinterpret_cast<unsigned long long*>(cost + r),
            static_cast<unsigned long long>(clock64() - begin));
  return ok;
}

// Whether rank r is masked (Nv::masks; read from L2, where other blocks' masks land).
__device__ inline bool MaskedRank(const Nv& v, int r) {
  return v.masks && __ldcg(v.masks + r) != 0;
}

// Rank r masked as lost (mask_lost_peers): its device word unless already masked, then the host's
// mirror and, for another node, the relay's word (plain stores to host memory, then a system
// fence: the relay and the host read them, and no atomic on host memory is atomic over PCIe).
__device__ inline void MaskLost(const Nv& v, int r) {
  if (atomicCAS(v.masks + r, 0, static_cast<int32_t>(kMaskedLost)) != 0) return;
  reinterpret_cast<volatile int32_t*>(v.mask_mirror)[r] = static_cast<int32_t>(kMaskedLost);
  if (uint64_t* word = v.peer[r].relay_mask) {
    *reinterpret_cast<volatile uint64_t*>(word) = kMaskedLost;
  }
  __threadfence_system();
}

// Block 0 of a send kernel, at its start: every remote rank's device mask into the relay's
// control word, so that the relay leaves it out of this epoch's exchange (it reads the words
// once our outbox flag is up, which the fence and the arrivals order after these stores). A
// mask the caller set reaches the relay no earlier: the relay may still be in the epoch before.
__device__ inline void PublishMasks(const Nv& v) {
  if (!v.masks || v.first_remote < 0 || blockIdx.x != 0) return;
  for (int r = threadIdx.x; r < v.world_size; r += blockDim.x) {
    uint64_t* word = v.peer[r].relay_mask;
    const int32_t m = __ldcg(v.masks + r);
    if (word && m != 0) {
      *reinterpret_cast<volatile uint64_t*>(word) =
          m == static_cast<int32_t>(kMaskedLost) ? kMaskedLost : kMaskedByCaller;
    }
  }
  __threadfence_system();
}

// Thread 0 of a block: until every rank's dispatch (which 0) or combine (1) flag for us shows
// epoch `epoch` done (the rank's step per epoch times epoch + 1), another block gave up, or the
// budget (from now) runs out (AwaitWord). A masked rank is not waited for; under
// mask_lost_peers a rank whose flag is not up at the budget is masked (MaskLost) and the wait
// goes on without it. cost: the step's wait_cost, or null (AwaitCounted).
__device__ inline bool WaitAll(const Nv& v, uint64_t epoch, uint64_t budget_ns, int which,
                        int64_t* cost = nullptr) {
  const uint64_t start = GlobalTimerNs();
  for (int r = 0; r < v.world_size; ++r) {
    if (r != v.rank && MaskedRank(v, r)) continue;
    const NvPeer& p = v.peer[r];
    const uint64_t* flag = which == 0 ? p.dispatch_flag_in : p.combine_flag_in;
    const uint64_t want = (epoch + 1) * uint64_t(which == 0 ? p.dispatch_step : p.combine_step);
    const bool may_mask = v.mask_lost && r != v.rank;
    if (AwaitCounted(v, cost, flag, want, start, budget_ns, which, r, may_mask)) continue;
    if (!may_mask || *reinterpret_cast<volatile int32_t*>(&v.scratch->abort)) return false;
    MaskLost(v, r);
  }
  return true;
}

// Thread 0 of a block, at the start of a receive step: WaitAll, but with peers in other nodes
// (or under mask_lost_peers, where one thread decides which ranks are masked for the whole
// step) only block 0 polls the flags (host memory: every poll is a PCIe read, and hundreds of
// blocks polling slow the very copies they wait for); it then publishes what it saw in device
// memory (release at GPU scope, after its system-scope acquires and its masks) and the other
// blocks wait for that. cost: the step's wait_cost, or null; block 0's waits alone count.
__device__ inline bool WaitStep(const Nv& v, uint64_t epoch, uint64_t budget_ns, int which,
                         int64_t* cost = nullptr) {
  if (blockIdx.x != 0) cost = nullptr;
  if (v.first_remote < 0 && !v.mask_lost) return WaitAll(v, epoch, budget_ns, which, cost);
  uint64_t* seen = &v.scratch->seen[which];
  const uint64_t want = epoch + 1;
  if (blockIdx.x == 0) {
    if (!WaitAll(v, epoch, budget_ns, which, cost)) return false;
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(seen), "l"(want) : "memory");
    return true;
  }
  const uint64_t start = GlobalTimerNs();
  for (;;) {
    uint64_t got;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(got) : "l"(seen) : "memory");
    if (got >= want) return true;
    // Block 0 publishes by its budget or reports a timeout and raises abort. A second past the
    // budget is a backstop against a hang, reported: a block that left quietly would leave its
    // share of the step undone in a step that reports OK (block 0, descheduled with the whole
    // context by time slicing as its budget ran out, publishes late but publishes).
    if (*reinterpret_cast<volatile int32_t*>(&v.scratch->abort)) return false;
    if (GlobalTimerNs() - start > budget_ns + 1000000000) {
      atomicExch(&v.scratch->abort, 1);
      Report(v, kStepStalled, which, static_cast<int32_t>(blockIdx.x));
      return false;
    }
  }
}

// Thread 0 of each block adds to the ticket with acquire-release semantics at the scope the
// block's writes must reach (system: peers' memory): the release carries the block's writes
// (ordered before it by the barrier), the acquire in the last block sees every block's. True in
// the block that finishes last, which resets the ticket for the next launch.
__device__ inline uint32_t TicketAdd(uint32_t* ticket, bool system) {
  uint32_t old;
  if (system) {
    asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
  } else {
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
  }
  return old;
}
// `blocks`: how many blocks take part (the first ones of the grid; default all).
__device__ inline bool LastBlock(uint32_t* ticket, bool system, int blocks = 0) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    last = TicketAdd(ticket, system) == (blocks > 0 ? blocks : gridDim.x) - 1;
    if (last) atomicExch(ticket, 0u);
  }
  __syncthreads();
  return last;
}

__device__ inline bool ValidExpert(const Nv& v, int32_t e) { return e >= 0 && e < v.experts; }
// -1 is "no expert" (a token that chose fewer than K): skipped like a bad id, but not an error.
__device__ inline bool BadExpert(const Nv& v, int32_t e) { return e != -1 && !ValidExpert(v, e); }
// A valid expert's rank, and its index among that rank's experts.
__device__ inline int RankOf(const Nv& v, int32_t e) { return v.div_local_experts.Div(e); }
__device__ inline int LocalOf(const Nv& v, int32_t e) { return v.div_local_experts.Mod(e); }

// Scales [first, first + 4) of a row of spt, as one 16-byte vector of the slot, into out (whose
// rows need not be 16-byte aligned).
__device__ inline void StoreScales(float* out, int64_t first, int spt, const uint4& value) {
  const uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (first + q < spt) out[first + q] = __uint_as_float(words[q]);
  }
}

// A 32 x 32 bit transpose over a warp: lane r gets bit i = lane i's bit r (five exchanges, each
// swapping the off-diagonal blocks of half the size). With a rank mask per lane, __popc of lane
// r's result counts the lanes that go to rank r: five shuffles for up to 32 ranks, where a
// ballot per rank costs one each.
__device__ inline uint32_t TransposeBits(uint32_t x) {
  const int lane = threadIdx.x % 32;
  uint32_t keep = 0x0000FFFFu;  // the bits whose index has bit s clear
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1, keep ^= keep << s) {
    const uint32_t y = __shfl_xor_sync(~0u, x, s);
    x = lane & s ? (x & ~keep) | ((y & ~keep) >> s) : (x & keep) | ((y & keep) << s);
  }
  return x;
}

// One token's routing, worked out by warp 0: lane j < K holds the token's j-th copy.
struct LaneRoute {
  bool valid;         // expert id in range
  int32_t e;          // the expert
  int r;              // its rank
  int within;         // this copy's index among the token's copies for rank r, in k order
  int hits;           // the token's copies for rank r
  int lanes_before;   // the token's valid copies for lower ranks
  int ranks_before;   // distinct lower ranks the token goes to
  bool first;         // within == 0
  unsigned firsts;    // lanes that are first for their rank
  unsigned valids;    // lanes with a valid copy
};

// Called by all 32 lanes of a warp; every lane loads its own index (one round trip).
// `skip_masked`: a copy for a masked rank counts as none (the combine, for ranks masked after
// the dispatch sent; the send kernels' ids read as -1 already, see IdAt).
__device__ inline LaneRoute RouteLane(const Nv& v, const int32_t* row, bool skip_masked = false) {
  const int lane = threadIdx.x % 32;
  LaneRoute x{};
  x.e = lane < v.topk ? row[lane] : -1;
  x.valid = lane < v.topk && ValidExpert(v, x.e) &&
            !(skip_masked && MaskedRank(v, RankOf(v, x.e)));
  x.r = x.valid ? RankOf(v, x.e) : -1;
  x.valids = __ballot_sync(~0u, x.valid);
  unsigned same = 0;
  for (int i = 0; i < v.topk; ++i) {
    const int ri = __shfl_sync(~0u, x.r, i);
    if ((x.valids >> i & 1) && ri == x.r) same |= 1u << i;
  }
  const unsigned below = (1u << lane) - 1;
  x.within = __popc(same & below);
  x.hits = __popc(same);
  x.first = x.valid && x.within == 0;
  x.firsts = __ballot_sync(~0u, x.first);
  for (int i = 0; i < v.topk; ++i) {
    const int ri = __shfl_sync(~0u, x.r, i);
    if ((x.valids >> i & 1) && ri < x.r) {
      ++x.lanes_before;
      x.ranks_before += x.firsts >> i & 1;
    }
  }
  return x;
}

// Exclusive prefix sums of totals[0, n) into out[0, n) (loads in parallel). Block-wide.
__device__ inline void PrefixTotals(const int32_t* totals, int n, int64_t* out) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = totals[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t sum = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t here = out[i];
      out[i] = sum;
      sum += here;
    }
  }
  __syncthreads();
}

// This epoch's token count: the host's bound, or the device count when one is given (a count
// above the bound is reported, and nothing is sent). Block 0 records it for the later steps.
__device__ inline int SendTokens(const Nv& v, const SendArgs& a) {
  int tokens = a.bound;
  if (a.dev_tokens) {
    const int32_t d = *a.dev_tokens;
    tokens = d >= 0 && d <= a.bound ? d : 0;
    if (tokens != d && blockIdx.x == 0 && threadIdx.x == 0) {
      Report(v, kTooManyTokens, d, a.bound);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) v.scratch->tokens = tokens;
  return tokens;
}

// Where our counts row for rank r goes: r's counts row for us, and (another node) the relay's
// slot count for r. SendSmall's block 0 loads them at its start (shared memory); Pack's reads
// them from the peer table when it writes.
struct CountsDst {
  int32_t* counts;
  int64_t* relay_slots;
};
__device__ inline CountsDst PeerCountsDst(const Nv& v, int r) {
  return CountsDst{v.peer[r].counts, v.peer[r].relay_slots};
}

// Our counts row into every rank (value(r, c): column c of our row for rank r: copies per
// local expert of r, then the CountsColumn values; dst(r): where it goes). In one node, each
// row's tag follows, released once the block's stores of every row are out (the barrier orders
// them before it).
template <typename Value, typename Dst>
__device__ inline void WriteCountsRows(const Nv& v, uint64_t epoch, Value value, Dst dst) {
  const int width = v.local_experts + kCountsColumns;
  // Element i = r * width + c, i stepping by the block: r and c step along (one division each,
  // at the start, not one per element).
  const int step_r = blockDim.x / width, step_c = blockDim.x % width;
  for (int r = threadIdx.x / width, c = threadIdx.x % width; r < v.world_size;) {
    dst(r).counts[c] = static_cast<int32_t>(value(r, c));
    r += step_r;
    c += step_c;
    if (c >= width) {  // step_c < width: one carry at most
      c -= width;
      ++r;
    }
  }
  // The relay sizes its write by this.
  for (int r = threadIdx.x; r < v.world_size; r += blockDim.x) {
    if (int64_t* relay_slots = dst(r).relay_slots) {
      *relay_slots = value(r, v.local_experts + kColSlots);
    }
  }
  if (!v.counts_tagged) return;
  __syncthreads();
  for (int r = threadIdx.x; r < v.world_size; r += blockDim.x) {
    StoreRelease(reinterpret_cast<uint32_t*>(dst(r).counts + CountsTagColumn(v)),
                 static_cast<uint32_t>(epoch + 1));
  }
}

// Streamed: a warp's token, once its lanes stored the token's ns slots (dst), tags each slot
// "epoch + 1", a lane per slot, with release -- __syncwarp orders every lane's stores of the
// slot before it, and the release carries them to the receiver that acquires the tag. At
// system scope into a peer; at GPU scope in our own send area, whose tags only our own Unpack
// waits for (a peer pulling a slot from there waits for our dispatch flag instead).
__device__ inline void TagSlots(const Nv& v, uint8_t* const* dst, int ns, uint64_t epoch) {
  if (!v.stream) return;
  __syncwarp();
  const int lane = threadIdx.x % 32;
  if (lane >= ns) return;
  const uintptr_t area = reinterpret_cast<uintptr_t>(v.own + v.send_off);
  const uintptr_t at = reinterpret_cast<uintptr_t>(dst[lane]);
  auto* tag = reinterpret_cast<uint64_t*>(dst[lane] + SlotTagOffset(v));
  if (at >= area && at < area + SendAreaBytes(v)) {
    StoreReleaseGpu(tag, epoch + 1);
  } else {
    StoreRelease(tag, epoch + 1);
  }
}

// kMasks false: an instance for steps that read no mask (Nv::masks null), whose code is what
// it was before masks existed -- a masked-rank test per peer in the decode kernels' hot loops
// cost their step about 0.3 us each, masks or not.
// Every block of a send step, once its writes are issued: for each rank of our node, one added
// to its dispatch (or combine) flag for us, with release semantics at system scope (the barrier
// orders the block's writes before it; the release carries them, peers' memory included); the
// receiver waits for the sum over our grid. Ranks of other nodes share our one outbox flag,
// which the relay watches: the last block through the ticket (whose acquire sees every block's
// writes) stores "epoch + 1" there -- the epoch each block read at its start: once every block
// has arrived our own CombineRecv (started early) may advance the word.
template <bool kMasks = true>
__device__ inline void Arrive(const Nv& v, bool combine, uint64_t epoch) {
  __syncthreads();
  for (int r = threadIdx.x; r < v.world_size; r += blockDim.x) {
    const NvPeer& p = v.peer[r];
    if (!p.remote && !(kMasks && MaskedRank(v, r))) {
      AddRelease(combine ? p.combine_flag : p.dispatch_flag, 1);
    }
  }
  if (v.first_remote < 0 || !LastBlock(&v.scratch->tickets[combine ? 1 : 0], true)) return;
  if (threadIdx.x == 0) {
    const NvPeer& p = v.peer[v.first_remote];
    StoreRelease(combine ? p.combine_flag : p.dispatch_flag, epoch + 1);
  }
}

// Streamed: the next item (a received slot for Unpack, a token for CombineRecv) a group of
// kGroup threads (a warp or the block) takes, claimed from a counter, so that items are taken in
// order by whichever groups are running -- those beside the send kernel first, then also those
// that start once its blocks leave their SMs.
template <int kGroup>
__device__ inline uint32_t Claim(uint32_t* counter) {
  if constexpr (kGroup == 32) {
    uint32_t c = 0;
    if (threadIdx.x % 32 == 0) c = atomicAdd(counter, 1u);
    return __shfl_sync(~0u, c, 0);
  } else {
    __shared__ uint32_t claim;
    __syncthreads();  // every thread read the last claim (and the group's tables may be rewritten)
    if (threadIdx.x == 0) claim = atomicAdd(counter, 1u);
    __syncthreads();
    return claim;
  }
}

}  // namespace ferry::moe::nv
