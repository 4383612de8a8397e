// The NVLink AllToAll (design in nvlink_all_to_all.h): the five kernels and the AllToAll that
// enqueues them. The memory they share comes from common/cuda_shared_memory.h.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_shared_memory.h"
#include "common/fd_exchange.h"
#include "moe/cuda/gdr_flags.h"
#include "moe/cuda/pinned_buffer.h"
#include "moe/cuda/cuda_util.cuh"
#include "moe/cuda/nvlink_all_to_all.h"
#include "moe/layout.h"
#include "moe/relay.h"

namespace ferry::moe {
namespace {

constexpr int kRouteThreads = 512;
constexpr int kSortItems = 4;
constexpr int kChunk = kRouteThreads * kSortItems;  // (token, k) entries per sort chunk
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

struct NvHeader {
  int32_t src_token;
  int32_t entries;
  int32_t row;    // the combine row of the first entry (plain) or of the token (summed)
  int16_t part;   // which of the token's slots for this rank (one entry per slot), of
  int16_t parts;  // how many
};
struct NvEntry {
  int32_t local_expert;
  int32_t k;
  float weight;
  int32_t pos;  // among the sender's copies for this expert, in (token, k) order
};
static_assert(sizeof(NvHeader) == 16 && sizeof(NvEntry) == 16, "slot metadata layout");

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
  uint32_t tickets[3];      // last-block detection: the send steps' outbox flag (Arrive, with
                            // peers in other nodes), CombineRecv's epoch
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
};

// Everything the kernels share; passed by value.
struct Nv {
  int n, me, e, l, k, t_max, hidden, spt, priv, chunks;
  int counts_stride;  // int32 per counts row: L + kCountsColumns, rounded up to 16 bytes
  int64_t payload, slot_bytes, meta_bytes, row_bytes, capacity, slots_per_pair;
  bool once, reduce;
  int first_remote;  // the lowest rank of another node, -1 if none (WaitStep, Arrive)
  int64_t counts_off, private_off, combine_off, send_off;  // flags at 0
  uint8_t* own;          // our buffer (its send area holds the slots peers pull and our own)
  const NvPeer* peer;    // [N] every rank, ours included
  Scratch* scratch;
  int32_t* error;        // [3] code, detail, detail: mapped pinned host memory, the mirror of
                         // scratch->error the host reads
  int32_t* indices;      // [t_max, K] our copy of the routing
  float* weights;        // [t_max, K]
  int32_t* slot_pos;     // [N, t_max] token t's first slot among ours for rank r (Route -> Pack;
                         // null when SendSmall serves every batch, as erank and chunk_counts)
  int32_t* row_pos;      // [N, t_max] token t's first combine row among those from rank r
  int32_t* totals;       // [2N] slots per receiving rank, combine rows per expert rank
  int32_t* erank;        // [t_max * K] a copy's rank within its chunk's copies for its expert
  int32_t* chunk_counts; // [chunks, E]
  RecvSlot* rslots;      // [N * slots_per_pair]
  RecvEntry* rentries;   // [N * slots_per_pair, K]
  long long* trace;      // null, or [kTraceKernels][trace_blocks][kTraceSlots] (see Mark)
  int trace_blocks;
};

struct SendArgs {
  const uint8_t* x;
  const float* scales;
  const int32_t* indices;
  const float* weights;
  const int32_t* dev_tokens;
  int bound;
  bool strict;  // an input error (expert id, device count) sends nothing at all
};
struct RecvArgs {
  uint8_t* out_x;
  float* out_scales;
  int32_t* num_tokens;
  uint64_t timeout_ns;
};
struct CombineArgs {
  const uint16_t* expert_out;
  uint16_t* out;
  bool accumulate;
  uint64_t timeout_ns;
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
__device__ inline void AddRelease(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (sm_90): a send kernel lets the receive kernel behind it start
// at once (LaunchDependents); the receive kernel waits for its flags meanwhile and calls
// WaitPrimary -- which returns once the kernel before it finished and its writes are visible --
// before it touches memory the kernel before it (ours or the caller's) may still use: the
// caller's outputs. Launched without the attribute, WaitPrimary returns at once.
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

// Phase timing for tuning (FERRY_NV_TRACE=1 in the environment): thread 0 of each block stamps
// clock64() at numbered points of a kernel (0: its start), and the global timer at its start and
// at its latest point; the AllToAll prints, when destroyed, for the last epoch: each point's
// slowest and mean block time since that block's start, and when the kernel's blocks started and
// ended relative to the first DispatchSend block (the gaps between the kernels). No reset runs
// between launches (it would sit between the kernels): stamps carry their epoch.
enum TraceKernel { kTraceSend, kTraceUnpack, kTraceCombineSend, kTraceCombineRecv, kTraceKernels };
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

// Thread 0 of a block: until every rank's dispatch (which 0) or combine (1) flag for us shows
// epoch `epoch` done (the rank's step per epoch times epoch + 1), another block gave up, or the
// budget (from now) runs out, which is reported and makes every later wait give up.
__device__ bool WaitAll(const Nv& v, uint64_t epoch, uint64_t budget_ns, int which) {
  const uint64_t start = GlobalTimerNs();
  for (int r = 0; r < v.n; ++r) {
    const NvPeer& p = v.peer[r];
    const uint64_t* flag = which == 0 ? p.dispatch_flag_in : p.combine_flag_in;
    const uint64_t want = (epoch + 1) * uint64_t(which == 0 ? p.dispatch_step : p.combine_step);
    while (LoadAcquire(flag) < want) {
      if (*reinterpret_cast<volatile int32_t*>(&v.scratch->abort)) return false;
      if (GlobalTimerNs() - start > budget_ns) {
        atomicExch(&v.scratch->abort, 1);
        Report(v, kPeerTimeout, which, r);
        return false;
      }
    }
  }
  return true;
}

// Thread 0 of a block, at the start of a receive step: WaitAll, but with peers in other nodes
// only block 0 polls the flags (host memory: every poll is a PCIe read, and hundreds of blocks
// polling slow the very copies they wait for); it then publishes what it saw in device memory
// (release at GPU scope, after its system-scope acquires) and the other blocks wait for that.
__device__ bool WaitStep(const Nv& v, uint64_t epoch, uint64_t budget_ns, int which) {
  if (v.first_remote < 0) return WaitAll(v, epoch, budget_ns, which);
  uint64_t* seen = &v.scratch->seen[which];
  const uint64_t want = epoch + 1;
  if (blockIdx.x == 0) {
    if (!WaitAll(v, epoch, budget_ns, which)) return false;
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(seen), "l"(want) : "memory");
    return true;
  }
  const uint64_t start = GlobalTimerNs();
  for (;;) {
    uint64_t got;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(got) : "l"(seen) : "memory");
    if (got >= want) return true;
    // Block 0 reports a timeout and raises abort; the budget check is a backstop.
    if (*reinterpret_cast<volatile int32_t*>(&v.scratch->abort) ||
        GlobalTimerNs() - start > budget_ns + 1000000) {
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
__device__ bool LastBlock(uint32_t* ticket, bool system) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    last = TicketAdd(ticket, system) == gridDim.x - 1;
    if (last) atomicExch(ticket, 0u);
  }
  __syncthreads();
  return last;
}

__device__ inline bool ValidExpert(const Nv& v, int32_t e) { return e >= 0 && e < v.e; }

// Scales [first, first + 4) of a row of spt, as one 16-byte vector of the slot, into out (whose
// rows need not be 16-byte aligned).
__device__ inline void StoreScales(float* out, int64_t first, int spt, const uint4& value) {
  const uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (first + q < spt) out[first + q] = __uint_as_float(words[q]);
  }
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
__device__ LaneRoute RouteLane(const Nv& v, const int32_t* row) {
  const int lane = threadIdx.x % 32;
  LaneRoute x{};
  x.e = lane < v.k ? row[lane] : -1;
  x.valid = lane < v.k && ValidExpert(v, x.e);
  x.r = x.valid ? x.e / v.l : -1;
  x.valids = __ballot_sync(~0u, x.valid);
  unsigned same = 0;
  for (int i = 0; i < v.k; ++i) {
    const int ri = __shfl_sync(~0u, x.r, i);
    if ((x.valids >> i & 1) && ri == x.r) same |= 1u << i;
  }
  const unsigned below = (1u << lane) - 1;
  x.within = __popc(same & below);
  x.hits = __popc(same);
  x.first = x.valid && x.within == 0;
  x.firsts = __ballot_sync(~0u, x.first);
  for (int i = 0; i < v.k; ++i) {
    const int ri = __shfl_sync(~0u, x.r, i);
    if ((x.valids >> i & 1) && ri < x.r) {
      ++x.lanes_before;
      x.ranks_before += x.firsts >> i & 1;
    }
  }
  return x;
}

// Exclusive prefix sums of totals[0, n) into out[0, n) (loads in parallel). Block-wide.
__device__ void PrefixTotals(const int32_t* totals, int n, int64_t* out) {
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
__device__ int SendTokens(const Nv& v, const SendArgs& a) {
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

// Our counts row into every rank (value(r, c): column c of our row for rank r: copies per
// local expert of r, then the CountsColumn values).
template <typename Value>
__device__ void WriteCountsRows(const Nv& v, Value value) {
  const int width = v.l + kCountsColumns;
  for (int i = threadIdx.x; i < v.n * width; i += blockDim.x) {
    const int r = i / width, c = i % width;
    v.peer[r].counts[c] = static_cast<int32_t>(value(r, c));
  }
}

// Every block of a send step, once its writes are issued: for each rank of our node, one added
// to its dispatch (or combine) flag for us, with release semantics at system scope (the barrier
// orders the block's writes before it; the release carries them, peers' memory included); the
// receiver waits for the sum over our grid. Ranks of other nodes share our one outbox flag,
// which the relay watches: the last block through the ticket (whose acquire sees every block's
// writes) stores "epoch + 1" there -- the epoch each block read at its start: once every block
// has arrived our own CombineRecv (started early) may advance the word.
__device__ void Arrive(const Nv& v, bool combine, uint64_t epoch) {
  __syncthreads();
  for (int r = threadIdx.x; r < v.n; r += blockDim.x) {
    const NvPeer& p = v.peer[r];
    if (!p.remote) AddRelease(combine ? p.combine_flag : p.dispatch_flag, 1);
  }
  if (v.first_remote < 0 || !LastBlock(&v.scratch->tickets[combine ? 1 : 0], true)) return;
  if (threadIdx.x == 0) {
    const NvPeer& p = v.peer[v.first_remote];
    StoreRelease(combine ? p.combine_flag : p.dispatch_flag, epoch + 1);
  }
}

// ---- dispatch send ----------------------------------------------------------------------------

using RouteScan = cub::BlockScan<int32_t, kRouteThreads>;
using RouteSort = cub::BlockRadixSort<uint32_t, kRouteThreads, kSortItems, int32_t>;
union RouteSmem {
  typename RouteScan::TempStorage scan;
  typename RouteSort::TempStorage sort;
  uint32_t keys[kChunk];
};

// Rank r's block: for each token in order, its slots and combine rows on rank r as exclusive
// prefix sums. Reports expert ids out of range (rank 0's block), which every step then skips.
__device__ void RankScan(const Nv& v, const SendArgs& a, int tokens, int r, RouteSmem& smem) {
  auto count = [&](int t) {
    int32_t ids[kMaxK];  // all of the token's loads in flight at once
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) ids[j] = j < v.k ? a.indices[int64_t{t} * v.k + j] : 0;
    int hits = 0;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j >= v.k) break;
      const int32_t e = ids[j];
      if (!ValidExpert(v, e)) {
        if (r == 0) Report(v, kBadExpert, t, e);
        continue;
      }
      hits += e / v.l == r;
    }
    return make_int2(hits == 0 ? 0 : (v.once ? 1 : hits), hits == 0 ? 0 : (v.reduce ? 1 : hits));
  };
  ScanTokensForRank<kRouteThreads>(r, v.n, tokens, v.t_max, count, v.slot_pos, v.row_pos,
                                   v.totals, smem.scan);
}

// Chunk c's block: entries [c * kChunk, (c + 1) * kChunk) of the (token, k) list. A stable
// radix sort by expert gives each copy its rank among the chunk's copies for that expert, and
// the chunk's count per expert. Also copies the routing for the later steps.
__device__ void SortChunk(const Nv& v, const SendArgs& a, int tokens, int c, RouteSmem& smem) {
  __shared__ int32_t head[kMaxExperts + 1];
  const int64_t first = int64_t{c} * kChunk, entries = int64_t{tokens} * v.k;
  uint32_t keys[kSortItems];
  int32_t items[kSortItems];
  for (int i = 0; i < kSortItems; ++i) {
    const int p = threadIdx.x * kSortItems + i;
    const int64_t f = first + p;
    keys[i] = v.e;  // past the end, or an invalid id: sorts last, never counted
    items[i] = p;
    if (f < entries) {
      const int32_t e = a.indices[f];
      v.indices[f] = e;
      v.weights[f] = a.weights[f];
      if (ValidExpert(v, e)) keys[i] = e;
    }
  }
  for (int e = threadIdx.x; e <= v.e; e += blockDim.x) head[e] = -1;
  const int bits = 32 - __clz(v.e);
  RouteSort(smem.sort).Sort(keys, items, 0, bits);
  __syncthreads();
  for (int i = 0; i < kSortItems; ++i) smem.keys[threadIdx.x * kSortItems + i] = keys[i];
  __syncthreads();
  for (int i = 0; i < kSortItems; ++i) {
    const int p = threadIdx.x * kSortItems + i;
    if (p == 0 || smem.keys[p - 1] != keys[i]) head[keys[i]] = p;
  }
  __syncthreads();
  int32_t* counts = v.chunk_counts + int64_t{c} * v.e;
  for (int i = 0; i < kSortItems; ++i) {
    const int p = threadIdx.x * kSortItems + i;
    const uint32_t key = keys[i];
    if (key >= static_cast<uint32_t>(v.e)) continue;
    const int32_t rank = p - head[key];
    v.erank[first + items[i]] = rank;
    if (p == kChunk - 1 || smem.keys[p + 1] != key) counts[key] = rank + 1;
  }
  for (int e = threadIdx.x; e < v.e; e += blockDim.x) {
    if (head[e] < 0) counts[e] = 0;
  }
}

// Blocks [0, N): RankScan; blocks [N, N + chunks): SortChunk.
__global__ void __launch_bounds__(kRouteThreads) RouteKernel(Nv v, SendArgs a) {
  __shared__ RouteSmem smem;
  const int tokens = SendTokens(v, a);
  if (blockIdx.x < v.n) {
    RankScan(v, a, tokens, blockIdx.x, smem);
  } else {
    SortChunk(v, a, tokens, blockIdx.x - v.n, smem);
  }
}

// Where slot j of ours for rank r goes: pushed to r (its private region, or our outbox section
// for it) while j < r's slot cap, else into our send area (grouped by receiving rank, at `start`
// for r) for r to pull. Our own slots stay in the send area.
__device__ inline uint8_t* SlotDst(const Nv& v, int r, int64_t j, int64_t start,
                                   uint8_t* slots, int32_t slot_cap) {
  if (r != v.me && j < slot_cap) return slots + j * v.slot_bytes;
  return v.own + v.send_off + (start + j) * v.slot_bytes;
}
__device__ inline uint8_t* SlotDst(const Nv& v, int r, int64_t j, int64_t start) {
  return SlotDst(v, r, j, start, v.peer[r].slots, v.peer[r].slot_cap);
}

// Tokens t = blockIdx.x, + grid...: token t's slots, rank by rank (SlotDst). Warp 0 lays the
// slots out; then the token row is read once and stored into every slot. Block 0 writes the
// counts rows into every rank first; every block arrives at every rank's dispatch flag.
__global__ void __launch_bounds__(kCopyThreads) PackKernel(Nv v, SendArgs a) {
  extern __shared__ int64_t starts[];  // [2N]: first slot per receiving rank in our send area,
                                       // first combine row per expert rank
  __shared__ uint8_t* dst[kMaxK];      // the token's slots
  __shared__ int num_slots;
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;
  const int tokens = v.scratch->tokens;
  int64_t* row_starts = starts + v.n;
  PrefixTotals(v.totals, v.n, starts);
  PrefixTotals(v.totals + v.n, v.n, row_starts);
  if (blockIdx.x == 0) {  // our counts row into every rank, before block 0 arrives
    WriteCountsRows(v, [&](int r, int c) {
      if (c == v.l + kColSlots) return int64_t{v.totals[r]};
      if (c == v.l + kColSendStart) return starts[r];
      if (c == v.l + kColRowStart) return row_starts[r];
      if (c == v.l + kColRows) return int64_t{v.totals[v.n + r]};
      int64_t value = 0;
      for (int ch = 0; ch < v.chunks; ++ch) {
        value += v.chunk_counts[int64_t{ch} * v.e + r * v.l + c];
      }
      return value;
    });
  }
  for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
    // Warp 0: lane j places the token's j-th copy; its slot's first lane writes the header.
    if (threadIdx.x < 32) {
      const LaneRoute x = RouteLane(v, v.indices + int64_t{t} * v.k);
      const int lane = threadIdx.x;
      if (x.valid) {
        const int64_t f = int64_t{t} * v.k + lane;
        int32_t pos = v.erank[f];
        for (int c = 0; c < f / kChunk; ++c) pos += v.chunk_counts[int64_t{c} * v.e + x.e];
        const int r = x.r;
        const int o = v.once ? 0 : x.within;  // which of the token's slots for rank r
        const int64_t j = v.slot_pos[int64_t{r} * v.t_max + t] + o;
        uint8_t* d = SlotDst(v, r, j, starts[r]);
        const NvEntry entry{x.e % v.l, lane, v.weights[f], pos};
        reinterpret_cast<NvEntry*>(d + sizeof(NvHeader))[v.once ? x.within : 0] = entry;
        if (!v.once || x.first) {
          const int32_t row = static_cast<int32_t>(row_starts[r] +
                                                   v.row_pos[int64_t{r} * v.t_max + t] +
                                                   (v.once || v.reduce ? 0 : o));
          *reinterpret_cast<NvHeader*>(d) =
              NvHeader{t, v.once ? x.hits : 1, row, static_cast<int16_t>(o),
                       static_cast<int16_t>(v.once ? 1 : x.hits)};
          dst[v.once ? x.ranks_before : x.lanes_before + x.within] = d;
        }
      }
      if (lane == 0) num_slots = __popc(v.once ? x.firsts : x.valids);
    }
    __syncthreads();
    const int ns = num_slots;
    // The row: four vectors in flight per thread, each stored into every slot.
    if (ns > 0) {
      const auto* row = reinterpret_cast<const uint4*>(a.x + int64_t{t} * v.payload);
      const int64_t vectors = v.payload / 16, meta = v.meta_bytes / 16;
      for (int64_t base = threadIdx.x; base < vectors; base += 4 * int64_t{blockDim.x}) {
        uint4 r[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t i = base + u * int64_t{blockDim.x};
          if (i < vectors) r[u] = __ldg(row + i);
        }
        for (int slot = 0; slot < ns; ++slot) {
          uint4* d = reinterpret_cast<uint4*>(dst[slot]) + meta;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int64_t i = base + u * int64_t{blockDim.x};
            if (i < vectors) d[i] = r[u];
          }
        }
      }
      for (int i = threadIdx.x; i < v.spt; i += blockDim.x) {  // one load, every slot
        const float scale = a.scales[int64_t{t} * v.spt + i];
        for (int slot = 0; slot < ns; ++slot) {
          reinterpret_cast<float*>(dst[slot] + v.meta_bytes + v.payload)[i] = scale;
        }
      }
    }
    __syncthreads();  // dst and num_slots are rewritten for the next token
  }
  Arrive(v, false, epoch);
}

// ---- dispatch send in one kernel (small batches) ------------------------------------------------

// Dynamic shared memory of SendSmallKernel. "Before": in the entries of tokens before the
// block's first token.
struct SmallSmem {
  int64_t* starts;      // [N] first slot per receiving rank in our send area
  int64_t* row_starts;  // [N] first combine row per expert rank
  uint8_t** peer_slots; // [N] v.peer[r].slots, loaded at the start (SlotDst)
  int32_t* peer_cap;    // [N] v.peer[r].slot_cap
  int32_t* slots;       // [N] our slots per receiving rank
  int32_t* rows;        // [N] combine rows per expert rank
  int32_t* copies_before;  // [N] copies for rank r
  int32_t* tokens_all;     // [N] tokens with a copy for rank r
  int32_t* tokens_before;  // [N]
  int32_t* hist;           // [E] copies per expert
  int32_t* hist_before;    // [E]
  int32_t* idx;            // [T * K] the routing, as given
};
__host__ __device__ inline size_t SmallSmemBytes(int n, int e, int64_t entries) {
  return size_t(n) * (3 * sizeof(int64_t) + 6 * sizeof(int32_t)) + 2 * size_t(e) * sizeof(int32_t) +
         size_t(entries) * sizeof(int32_t);
}
__device__ inline SmallSmem CarveSmallSmem(void* raw, int n, int e) {
  SmallSmem m;
  m.starts = static_cast<int64_t*>(raw);
  m.row_starts = m.starts + n;
  m.peer_slots = reinterpret_cast<uint8_t**>(m.row_starts + n);
  m.peer_cap = reinterpret_cast<int32_t*>(m.peer_slots + n);
  m.slots = m.peer_cap + n;
  m.rows = m.slots + n;
  m.copies_before = m.rows + n;
  m.tokens_all = m.copies_before + n;
  m.tokens_before = m.tokens_all + n;
  m.hist = m.tokens_before + n;
  m.hist_before = m.hist + e;
  m.idx = m.hist_before + e;
  return m;
}

// Whether entry f (valid, rank r) is the first of its token's copies for rank r.
__device__ inline bool FirstForRank(const Nv& v, const int32_t* idx, int f, int r) {
  for (int i = f - f % v.k; i < f; ++i) {
    if (ValidExpert(v, idx[i]) && idx[i] / v.l == r) return false;
  }
  return true;
}

// Block b sends tokens b * W + w (warp w), so each block needs positions only for its own W
// tokens. It reads the whole routing into shared memory and counts, with shared atomics, copies
// per expert and tokens per rank over all tokens (the totals: slot and combine-row starts per
// rank) and over the tokens before its own; within its own tokens a warp counts with ballots.
// That gives what Route computes -- each copy's position among the copies for its expert, each
// token's first slot and combine row on each rank -- with no grid-wide step, so DispatchSend is
// one launch. The row's first batch is loaded before the slots are laid out.
__global__ void __launch_bounds__(kSmallThreads) SendSmallKernel(Nv v, SendArgs a) {
  extern __shared__ int64_t small_raw[];
  __shared__ uint8_t* dst_of[kSmallWarps][kMaxK];  // a token's slots (SlotDst)
  const SmallSmem m = CarveSmallSmem(small_raw, v.n, v.e);
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;
  Mark(v, kTraceSend, 0);
  const int tokens = SendTokens(v, a);
  const int entries = tokens * v.k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_token = blockIdx.x * kSmallWarps;

  for (int i = threadIdx.x; i < v.e; i += blockDim.x) m.hist[i] = m.hist_before[i] = 0;
  for (int i = threadIdx.x; i < v.n; i += blockDim.x) m.tokens_all[i] = m.tokens_before[i] = 0;
  // The peers' slot areas (SlotDst): loaded now, stored to shared memory once counted, so that
  // no thread waits for them before its routing loads are out.
  uint8_t* peer_slots = nullptr;
  int32_t peer_cap = 0;
  if (threadIdx.x < v.n) {
    peer_slots = v.peer[threadIdx.x].slots;
    peer_cap = v.peer[threadIdx.x].slot_cap;
  }
  for (int base = 0; base < entries; base += 8 * blockDim.x) {  // eight loads in flight
    int32_t ids[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int f = base + threadIdx.x + u * blockDim.x;
      if (f < entries) ids[u] = a.indices[f];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int f = base + threadIdx.x + u * blockDim.x;
      if (f < entries) m.idx[f] = ids[u];
    }
  }
  __syncthreads();
  Mark(v, kTraceSend, 1);
  // Thread per token. Tokens per rank: up to 32 ranks, a rank mask per token and one ballot per
  // rank and warp (same-address shared atomics from a whole warp serialise); beyond, atomics.
  bool bad = a.dev_tokens && *a.dev_tokens != tokens;
  for (int base = 0; base < tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool before = t < first_token;
    uint32_t ranks = 0;
    for (int f = t * v.k; t < tokens && f < (t + 1) * v.k; ++f) {
      const int32_t e = m.idx[f];
      if (!ValidExpert(v, e)) {
        bad = true;
        if (blockIdx.x == 0) Report(v, kBadExpert, t, e);
        continue;
      }
      atomicAdd(&m.hist[e], 1);
      if (before) atomicAdd(&m.hist_before[e], 1);
      const int r = e / v.l;
      if (v.n <= 32) {
        ranks |= 1u << r;
      } else if (FirstForRank(v, m.idx, f, r)) {
        atomicAdd(&m.tokens_all[r], 1);
        if (before) atomicAdd(&m.tokens_before[r], 1);
      }
    }
    for (int r = 0; v.n <= 32 && r < v.n; ++r) {
      const int all = __popc(__ballot_sync(~0u, ranks >> r & 1));
      const int early = __popc(__ballot_sync(~0u, before && (ranks >> r & 1)));
      if (lane == 0 && all) atomicAdd(&m.tokens_all[r], all);
      if (lane == 0 && early) atomicAdd(&m.tokens_before[r], early);
    }
  }
  if (__syncthreads_or(bad) && a.strict) return;  // nothing sent; the step may be retried
  Mark(v, kTraceSend, 2);

  for (int i = threadIdx.x; i < v.n; i += blockDim.x) {
    m.peer_slots[i] = i == threadIdx.x ? peer_slots : v.peer[i].slots;
    m.peer_cap[i] = i == threadIdx.x ? peer_cap : v.peer[i].slot_cap;
  }
  for (int r = warp; r < v.n; r += kSmallWarps) {  // copies per rank, from the expert counts
    int32_t all = 0, before = 0;
    for (int i = lane; i < v.l; i += 32) {
      all += m.hist[r * v.l + i];
      before += m.hist_before[r * v.l + i];
    }
    all = __reduce_add_sync(~0u, all);
    before = __reduce_add_sync(~0u, before);
    if (lane == 0) {
      m.slots[r] = v.once ? m.tokens_all[r] : all;
      m.rows[r] = v.reduce ? m.tokens_all[r] : all;
      m.copies_before[r] = before;
    }
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix sums over the ranks, 32 at a time
    int64_t carry_slots = 0, carry_rows = 0;
    for (int b = 0; b < v.n; b += 32) {
      const int r = b + lane;
      const int64_t my_slots = r < v.n ? m.slots[r] : 0, my_rows = r < v.n ? m.rows[r] : 0;
      int64_t slots = my_slots, rows = my_rows;
      for (int d = 1; d < 32; d *= 2) {
        const int64_t s2 = __shfl_up_sync(~0u, slots, d), r2 = __shfl_up_sync(~0u, rows, d);
        if (lane >= d) {
          slots += s2;
          rows += r2;
        }
      }
      if (r < v.n) {
        m.starts[r] = carry_slots + slots - my_slots;
        m.row_starts[r] = carry_rows + rows - my_rows;
      }
      carry_slots += __shfl_sync(~0u, slots, 31);
      carry_rows += __shfl_sync(~0u, rows, 31);
    }
  }
  __syncthreads();
  // Block 0 writes our counts rows into every rank now; every block arrives once its rows are out.
  if (blockIdx.x == 0) {
    for (int r = threadIdx.x; r < v.n; r += blockDim.x) {  // for CombineRecv
      v.totals[r] = m.slots[r];
      v.totals[v.n + r] = m.rows[r];
    }
    WriteCountsRows(v, [&](int r, int c) {
      if (c == v.l + kColSlots) return int64_t{m.slots[r]};
      if (c == v.l + kColSendStart) return m.starts[r];
      if (c == v.l + kColRowStart) return m.row_starts[r];
      if (c == v.l + kColRows) return int64_t{m.rows[r]};
      return int64_t{m.hist[r * v.l + c]};
    });
  }
  Mark(v, kTraceSend, 3);

  const int64_t vectors = v.payload / 16, meta = v.meta_bytes / 16;
  const int t = first_token + warp;
  if (t < tokens) {
    // The row's first batch and the token's weights, in flight while the slots are laid out.
    const auto* row = reinterpret_cast<const uint4*>(a.x + int64_t{t} * v.payload);
    uint4 batch[kLaneVectors];
#pragma unroll
    for (int u = 0; u < kLaneVectors; ++u) {
      const int64_t i = lane + 32 * u;
      if (i < vectors) batch[u] = __ldg(row + i);
    }
    const float weight = lane < v.k ? a.weights[int64_t{t} * v.k + lane] : 0.0f;

    // Lane j: the token's j-th copy. Counts over the block's earlier entries (its tokens before
    // this one, and this token's copies before j), 32 entries per ballot.
    const LaneRoute x = RouteLane(v, m.idx + t * v.k);
    const int own = t * v.k;
    int32_t pos = x.valid ? m.hist_before[x.e] : 0;
    int32_t rank_copies = x.valid ? m.copies_before[x.r] : 0;  // before token t, on its rank
    int32_t rank_tokens = x.valid ? m.tokens_before[x.r] : 0;
    for (int base = first_token * v.k; base < own + v.k; base += 32) {
      const int f = base + lane;
      const int32_t e = f < own + v.k ? m.idx[f] : -1;
      const bool valid = ValidExpert(v, e);
      const int r = valid ? e / v.l : -1;
      const bool earlier = f < own;
      const bool first = valid && earlier && FirstForRank(v, m.idx, f, r);
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        if (j >= v.k) break;
        const int32_t ej = __shfl_sync(~0u, x.valid ? x.e : -1, j);
        const int rj = __shfl_sync(~0u, x.r, j);
        const int p = __popc(__ballot_sync(~0u, valid && e == ej && f < own + j));
        const int c = __popc(__ballot_sync(~0u, valid && earlier && r == rj));
        const int n = __popc(__ballot_sync(~0u, first && r == rj));
        if (lane == j) {
          pos += p;
          rank_copies += c;
          rank_tokens += n;
        }
      }
    }
    Mark(v, kTraceSend, 4);

    // Lay out the token's slots (as PackKernel does).
    if (x.valid) {
      const int r = x.r;
      const int o = v.once ? 0 : x.within;
      const int64_t j = (v.once ? rank_tokens : rank_copies) + o;
      uint8_t* d = SlotDst(v, r, j, m.starts[r], m.peer_slots[r], m.peer_cap[r]);
      const NvEntry entry{x.e % v.l, lane, weight, pos};
      reinterpret_cast<NvEntry*>(d + sizeof(NvHeader))[v.once ? x.within : 0] = entry;
      if (!v.once || x.first) {
        const int32_t row_pos = v.reduce ? rank_tokens : rank_copies;
        const int32_t row = static_cast<int32_t>(m.row_starts[r] + row_pos +
                                                 (v.once || v.reduce ? 0 : o));
        *reinterpret_cast<NvHeader*>(d) =
            NvHeader{t, v.once ? x.hits : 1, row, static_cast<int16_t>(o),
                     static_cast<int16_t>(v.once ? 1 : x.hits)};
        dst_of[warp][v.once ? x.ranks_before : x.lanes_before + x.within] = d;
        if (x.first) v.row_pos[int64_t{r} * v.t_max + t] = row_pos;  // for CombineRecv
      }
    }
    const int ns = __popc(v.once ? x.firsts : x.valids);
    __syncwarp();

    // The row into every slot, batch by batch; then the scales.
    for (int64_t first = 0; first < vectors; first += 32 * kLaneVectors) {
      if (first > 0) {
#pragma unroll
        for (int u = 0; u < kLaneVectors; ++u) {
          const int64_t i = first + lane + 32 * u;
          if (i < vectors) batch[u] = __ldg(row + i);
        }
      }
      for (int slot = 0; slot < ns; ++slot) {
        uint4* d = reinterpret_cast<uint4*>(dst_of[warp][slot]) + meta + first;
#pragma unroll
        for (int u = 0; u < kLaneVectors; ++u) {
          const int64_t i = lane + 32 * u;
          if (first + i < vectors) d[i] = batch[u];
        }
      }
    }
    for (int base = 0; base < v.spt; base += 4 * 32) {
      float scale[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + lane + 32 * u;
        if (i < v.spt) scale[u] = a.scales[int64_t{t} * v.spt + i];
      }
      for (int slot = 0; slot < ns; ++slot) {
        auto* d = reinterpret_cast<float*>(dst_of[warp][slot] + v.meta_bytes + v.payload);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = base + lane + 32 * u;
          if (i < v.spt) d[i] = scale[u];
        }
      }
    }
  }
  Mark(v, kTraceSend, 5);
  Arrive(v, false, epoch);
  Mark(v, kTraceSend, 6);
  // The routing for the combine steps, spread over the blocks, after the arrival (off the
  // critical path: only CombineSend and CombineRecv read it, behind this kernel in stream order).
  for (int f = blockIdx.x * blockDim.x + threadIdx.x; f < entries; f += gridDim.x * blockDim.x) {
    v.indices[f] = m.idx[f];
    v.weights[f] = a.weights[f];
  }
}

// ---- dispatch receive -------------------------------------------------------------------------

// What Unpack needs of a sender's NvPeer, in shared memory.
struct PeerIn {
  const int32_t* counts;
  const uint8_t* slots;
  const uint8_t* pull;
  int32_t slot_cap, remote, row_cap, pad[3];
};
static_assert(sizeof(PeerIn) % 16 == 0, "PeerIn keeps what follows it 16-byte aligned");

__device__ inline void LoadPeersIn(const Nv& v, PeerIn* out) {
  for (int q = threadIdx.x; q < v.n; q += blockDim.x) {
    const NvPeer& p = v.peer[q];
    out[q] = PeerIn{p.counts_in, p.slots_in, p.pull, p.slot_cap, p.remote, p.row_cap, {}};
  }
}

// Every block waits for all dispatch flags, then takes received slots g = blockIdx.x, +grid...
// (sender-major, each sender in its send order): checks the slot, copies its row to each entry's
// output row, and remembers where the entries' combine rows go.
__global__ void __launch_bounds__(kCopyThreads) UnpackKernel(Nv v, RecvArgs a) {
  extern __shared__ int64_t unpack_raw[];  // [N] PeerIn; [N + 1] slots before sender s; [N]
                                           // start[s] (where they start in its send area); [N]
                                           // rebase[s] (the first combine row s expects from
                                           // us, if remote); then counts[N][counts_stride];
                                           // then offset[N + 1][L]
  PeerIn* from_of = reinterpret_cast<PeerIn*>(unpack_raw);
  int64_t* prefix = unpack_raw + v.n * (sizeof(PeerIn) / 8);
  int64_t* start = prefix + v.n + 1;
  int64_t* rebase = start + v.n;
  int32_t* counts = reinterpret_cast<int32_t*>(  // 16-byte aligned
      reinterpret_cast<uint8_t*>(prefix) + ((3 * int64_t{v.n} + 1) * 8 + 15) / 16 * 16);
  // offset[s][e]: rows of local expert e from senders before s (offset[N][e]: all of them).
  int32_t* offset = counts + v.n * v.counts_stride;
  __shared__ bool ok;
  __shared__ uint4 meta_v[1 + kMaxK];  // the slot's header and entries
  __shared__ int64_t out_row[kMaxK];
  Mark(v, kTraceUnpack, 0);
  const uint64_t epoch = v.scratch->epoch;
  LoadPeersIn(v, from_of);  // while thread 0 waits: no table load on the path after the flags
  if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 0);
  __syncthreads();
  if (!ok) return;
  Mark(v, kTraceUnpack, 1);
  // Every sender's counts row in one round trip (16-byte vectors; from another node they are in
  // host memory, where every small load is a PCIe transaction).
  const int vectors = v.counts_stride / 4;
  for (int i = threadIdx.x; i < v.n * vectors; i += blockDim.x) {
    const int q = i / vectors;
    reinterpret_cast<uint4*>(counts + q * v.counts_stride)[i % vectors] =
        __ldcg(reinterpret_cast<const uint4*>(from_of[q].counts) + i % vectors);
  }
  __syncthreads();
  Mark(v, kTraceUnpack, 2);
  // Where each sender's slots are: the block's first slot is then in flight while the offsets
  // table is built.
  for (int s = threadIdx.x; s < v.n; s += blockDim.x) {
    const int32_t* row = counts + s * v.counts_stride;
    int64_t slots = row[v.l + kColSlots];
    if (slots < 0 || slots > v.slots_per_pair) {  // none of them is taken
      if (blockIdx.x == 0) Report(v, kBadSlot, s, static_cast<int32_t>(slots));
      slots = 0;
    }
    prefix[s + 1] = slots;
    start[s] = row[v.l + kColSendStart];
    rebase[s] = from_of[s].remote ? row[v.l + kColRowStart] : 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int s = 0; s < v.n; ++s) prefix[s + 1] += prefix[s];
  }
  __syncthreads();
  const int64_t total = prefix[v.n];
  // Vectors [0, meta): header and entries; [meta, body): the row; [body, end): the scales.
  const int64_t meta = v.meta_bytes / 16, body = meta + v.payload / 16;
  const int64_t end = (v.meta_bytes + v.payload + int64_t{v.spt} * 4 + 15) / 16;
  const int64_t batch = 4 * int64_t{blockDim.x};
  // Received slot g: its sender s, its index j among s's, where it is. Ours from our send area;
  // then what s pushed; the rest pulled from s's send area (a slot past what s may push to a
  // rank without a send area to pull from is malformed: null).
  int s = 0;
  int64_t j = 0;
  auto locate = [&](int64_t g) -> const uint4* {
    s = SenderOf(prefix, v.n, g);
    j = g - prefix[s];
    const PeerIn& from = from_of[s];
    const uint8_t* src = s == v.me        ? v.own + v.send_off + (start[s] + j) * v.slot_bytes
                         : j < from.slot_cap ? from.slots + j * v.slot_bytes
                         : from.pull         ? from.pull + (start[s] + j) * v.slot_bytes
                                             : nullptr;
    return reinterpret_cast<const uint4*>(src);
  };
  // One round trip for the slot's first 16 KiB (metadata and, usually, the whole slot).
  uint4 r[4];
  auto load = [&](const uint4* src4) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t i = threadIdx.x + u * int64_t{blockDim.x};
      if (i < end) r[u] = __ldcg(src4 + i);
    }
  };
  int64_t g = blockIdx.x;
  const uint4* src4 = g < total ? locate(g) : nullptr;
  if (src4) load(src4);
  Mark(v, kTraceUnpack, 3);

  for (int e = threadIdx.x; e < v.l; e += blockDim.x) {
    int32_t rows = 0;
    for (int q = 0; q < v.n; ++q) {
      offset[q * v.l + e] = rows;
      rows += counts[q * v.counts_stride + e];
    }
    offset[v.n * v.l + e] = rows;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      v.scratch->total_recv = static_cast<int32_t>(total);
      v.scratch->rows_out = 0;
    }
  }
  Mark(v, kTraceUnpack, 4);
  bool primary_done = false;
  for (; g < total; g += gridDim.x) {
    if (g != blockIdx.x) {
      src4 = locate(g);
      if (src4) load(src4);
    }
    if (!src4) {
      if (threadIdx.x == 0) {
        Report(v, kBadSlot, s, static_cast<int32_t>(j));
        v.rslots[g] = RecvSlot{s, 0, 0, 0, 1};
      }
      continue;
    }
    const PeerIn& from = from_of[s];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t i = threadIdx.x + u * int64_t{blockDim.x};
      if (i < meta) meta_v[i] = r[u];
    }
    __syncthreads();
    // Checks in parallel: the header by every thread, entry i by thread i.
    NvHeader header;
    std::memcpy(&header, &meta_v[0], sizeof header);
    const int entries = min(max(header.entries, 0), v.k);
    // The combine row, counted from where our rows for s go (rebased for another node).
    const int64_t row = header.row - rebase[s];
    bool valid = header.entries >= 1 && header.entries <= v.k && header.src_token >= 0 &&
                 header.src_token < v.t_max && row >= 0 && header.parts >= 1 &&
                 header.part >= 0 && header.part < header.parts &&
                 row + (v.reduce ? 1 : header.entries) <= from.row_cap;
    if (threadIdx.x < entries) {
      NvEntry entry;
      std::memcpy(&entry, &meta_v[1 + threadIdx.x], sizeof entry);
      const int32_t le = entry.local_expert;
      valid = valid && le >= 0 && le < v.l && entry.pos >= 0 &&
              entry.pos < offset[(s + 1) * v.l + le] - offset[s * v.l + le] &&
              offset[(s + 1) * v.l + le] <= v.capacity;
      if (valid) {
        out_row[threadIdx.x] = int64_t{le} * v.capacity + offset[s * v.l + le] + entry.pos;
        v.rentries[g * v.k + threadIdx.x] = RecvEntry{out_row[threadIdx.x], entry.weight};
      }
    }
    valid = __syncthreads_and(valid);
    if (g == blockIdx.x) Mark(v, kTraceUnpack, 5);
    if (threadIdx.x == 0) {
      if (!valid) Report(v, kBadSlot, s, static_cast<int32_t>(j));
      v.rslots[g] = RecvSlot{s, static_cast<int32_t>(row), valid ? entries : 0, header.part,
                             header.parts};
    }
    const int outs = valid ? entries : 0;
    if (!primary_done) {  // the caller's memory from here on (a.out_x, a.out_scales)
      WaitPrimary();
      primary_done = true;
    }
    // Vector i of the slot into every entry's output row (its row or its scales).
    auto store = [&](int64_t i, const uint4& value) {
      if (i < meta || i >= end) return;
      for (int e = 0; e < outs; ++e) {
        if (i < body) {
          reinterpret_cast<uint4*>(a.out_x + out_row[e] * v.payload)[i - meta] = value;
        } else {
          StoreScales(a.out_scales + out_row[e] * v.spt, (i - body) * 4, v.spt, value);
        }
      }
    };
#pragma unroll
    for (int u = 0; u < 4; ++u) store(threadIdx.x + u * int64_t{blockDim.x}, r[u]);
    // Slots longer than one batch: the rest, batch by batch.
    for (int64_t base = threadIdx.x + batch; outs > 0 && base < end; base += batch) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t i = base + u * int64_t{blockDim.x};
        if (i < end) r[u] = __ldcg(src4 + i);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) store(base + u * int64_t{blockDim.x}, r[u]);
    }
    __syncthreads();  // the shared slot metadata is rewritten for the next one
  }
  if (blockIdx.x == 0) {
    WaitPrimary();
    for (int e = threadIdx.x; e < v.l; e += blockDim.x) {
      const int32_t rows = offset[v.n * v.l + e];
      a.num_tokens[e] = rows;
      if (rows > v.capacity) Report(v, kRowOverrun, -1, e);
    }
  }
  Mark(v, kTraceUnpack, 6);
}

// ---- combine ----------------------------------------------------------------------------------

// Eight bf16 values as one 16-byte vector.
__device__ inline float Bf16At(const uint4& v, int q) {
  const uint32_t w = q < 2 ? v.x : q < 4 ? v.y : q < 6 ? v.z : v.w;
  return Bf16ToFloatD(static_cast<uint16_t>(q % 2 ? w >> 16 : w & 0xFFFF));
}
__device__ inline uint4 PackBf16(const float (&acc)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = uint32_t{FloatToBf16D(acc[2 * i])} | uint32_t{FloatToBf16D(acc[2 * i + 1])} << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// acc[u][c8[u]] (eight columns each, c8[u] < 0: none) += sum over c < count of weight[c] *
// rows[c][c8[u]], in c order, fp32, unfused: the host device's arithmetic. Both groups' loads of
// eight rows are in flight at once.
__device__ inline void WeightedSum2x8(float (&acc)[2][8], const uint4* const* rows,
                                      const float* weight, int count, const int64_t (&c8)[2]) {
  for (int first = 0; first < count; first += 8) {
    uint4 vals[2][8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (first + c < count && c8[u] >= 0) vals[u][c] = __ldcg(rows[first + c] + c8[u]);
      }
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (first + c >= count) break;
      const float w = weight[first + c];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (c8[u] < 0) continue;
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w, Bf16At(vals[u][c], q)));
      }
    }
  }
}

// Received slots again: each copy's expert output row (plain) or, summed at the expert rank, one
// weighted fp32 sum per token taken in (local expert, position) order as the host device does,
// pushed into the sender's combine region. Every block arrives at every rank's combine flag.
__global__ void __launch_bounds__(kCopyThreads) CombineSendKernel(Nv v, CombineArgs a) {
  __shared__ const uint4* rows[kMaxK];
  __shared__ float weight[kMaxK];
  __shared__ int count;
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;
  Mark(v, kTraceCombineSend, 0);
  const int64_t total = v.scratch->total_recv;
  int64_t rows_out = 0;
  for (int64_t g = blockIdx.x; g < total; g += gridDim.x) {
    const RecvSlot slot = v.rslots[g];
    uint8_t* dst = v.peer[slot.sender].combine + int64_t{slot.row} * v.row_bytes;
    if (!v.reduce) {
      for (int i = 0; i < slot.entries; ++i) {
        const RecvEntry entry = v.rentries[g * v.k + i];
        CopyBytes(dst + i * v.row_bytes,
                  reinterpret_cast<const uint8_t*>(a.expert_out + entry.out_row * v.hidden),
                  v.row_bytes);
      }
      if (slot.sender != v.me) rows_out += slot.entries;
      continue;
    }
    if (slot.part != 0) continue;  // the token's first slot sums them all
    // Warp 0 gathers the token's copies (lane i: entry i of this slot, or with one entry per
    // slot the token's i-th slot) and orders them by output row, i.e. (local expert, position),
    // ties in arrival order, as the host device sums them.
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int64_t h = v.once ? g : g + lane;
      bool exists = false;
      if (v.once) {
        exists = lane < slot.entries;
      } else if (lane < slot.parts && h < total) {
        const RecvSlot other = v.rslots[h];
        exists = other.sender == slot.sender && other.row == slot.row && other.entries > 0;
      }
      RecvEntry entry{};
      if (exists) entry = v.rentries[h * v.k + (v.once ? lane : 0)];
      const unsigned present = __ballot_sync(~0u, exists);
      int order = 0;
      for (int i = 0; i < 32; ++i) {
        const int64_t other = __shfl_sync(~0u, entry.out_row, i);
        if ((present >> i & 1) && (other < entry.out_row || (other == entry.out_row && i < lane))) {
          ++order;
        }
      }
      if (exists && order < kMaxK) {
        rows[order] = reinterpret_cast<const uint4*>(a.expert_out + entry.out_row * v.hidden);
        weight[order] = entry.weight;
      }
      if (lane == 0) count = min(__popc(present), kMaxK);
    }
    __syncthreads();
    if (g == blockIdx.x) Mark(v, kTraceCombineSend, 1);
    auto* out = reinterpret_cast<uint4*>(dst);
    const int64_t groups = v.hidden / 8;
    for (int64_t c = threadIdx.x; c < groups; c += 2 * int64_t{blockDim.x}) {
      const int64_t c8[2] = {c, c + blockDim.x < groups ? c + blockDim.x : -1};
      float acc[2][8] = {};
      WeightedSum2x8(acc, rows, weight, count, c8);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (c8[u] >= 0) out[c8[u]] = PackBf16(acc[u]);
      }
    }
    if (slot.sender != v.me) ++rows_out;
    __syncthreads();
  }
  if (threadIdx.x == 0 && rows_out) atomicAdd(reinterpret_cast<unsigned long long*>(
                                                  &v.scratch->rows_out),
                                              static_cast<unsigned long long>(rows_out));
  Mark(v, kTraceCombineSend, 2);
  Arrive(v, true, epoch);
  Mark(v, kTraceCombineSend, 3);
}

// Tokens t = blockIdx.x, + grid...: once every combine flag is up, token t's returned rows, rank
// by rank and k by k, summed in fp32 (unfused, the host device's order) onto the previous output
// or zero. The last block advances the epoch.
__global__ void __launch_bounds__(kCopyThreads) CombineRecvKernel(Nv v, CombineArgs a) {
  extern __shared__ int64_t rank_start[];  // [N] our first combine row from each rank
  __shared__ bool ok;
  __shared__ const uint4* row_ptr[kMaxK];
  __shared__ float weight_of[kMaxK];
  __shared__ int rows;
  Mark(v, kTraceCombineRecv, 0);
  const uint64_t epoch = v.scratch->epoch;
  const int tokens = v.scratch->tokens;
  PrefixTotals(v.totals + v.n, v.n, rank_start);
  // Every block waits for every rank's combine flag, token or not: a rank's next DispatchSend
  // may reuse its buffers only after this (see nvlink_all_to_all.h). The first token's rows are
  // located before the wait.
  bool waited = false;
  for (int t = blockIdx.x; !waited || t < tokens; t += gridDim.x) {
    const bool mine = t < tokens;
    // Lane j: the token's j-th copy; rows in rank then k order (summed: the first copy of each
    // rank stands for its row).
    if (mine && threadIdx.x < 32) {
      const LaneRoute x = RouteLane(v, v.indices + int64_t{t} * v.k);
      if (x.valid && (!v.reduce || x.first)) {
        const int c = v.reduce ? x.ranks_before : x.lanes_before + x.within;
        const int64_t row = rank_start[x.r] + v.row_pos[int64_t{x.r} * v.t_max + t] +
                            (v.reduce ? 0 : x.within);
        row_ptr[c] = reinterpret_cast<const uint4*>(v.peer[x.r].combine_in + row * v.row_bytes);
        weight_of[c] = v.reduce ? 1.0f : v.weights[int64_t{t} * v.k + threadIdx.x];
      }
      if (threadIdx.x == 0) rows = __popc(v.reduce ? x.firsts : x.valids);
    }
    if (!waited) {
      if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 1);
      waited = true;
    }
    __syncthreads();
    if (!ok) return;
    if (t == static_cast<int>(blockIdx.x)) Mark(v, kTraceCombineRecv, 1);
    if (mine) {
      auto* y = reinterpret_cast<uint4*>(a.out + int64_t{t} * v.hidden);
      const int64_t groups = v.hidden / 8;
      for (int64_t c = threadIdx.x; c < groups; c += 2 * int64_t{blockDim.x}) {
        const int64_t c8[2] = {c, c + blockDim.x < groups ? c + blockDim.x : -1};
        float acc[2][8] = {};
        if (a.accumulate) WaitPrimary();  // a.out is the caller's memory
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (!a.accumulate || c8[u] < 0) continue;
          const uint4 prev = y[c8[u]];
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[u][q] = Bf16At(prev, q);
        }
        WeightedSum2x8(acc, row_ptr, weight_of, rows, c8);
        WaitPrimary();
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (c8[u] >= 0) y[c8[u]] = PackBf16(acc[u]);
        }
      }
    }
    __syncthreads();  // the row table is rewritten for the next token
  }
  Mark(v, kTraceCombineRecv, 2);
  // Only our own epoch word changes: a device-scope fence is enough.
  if (LastBlock(&v.scratch->tickets[2], false) && threadIdx.x == 0) v.scratch->epoch = epoch + 1;
  Mark(v, kTraceCombineRecv, 3);
}

// ---- sharing memory between the ranks of a node -----------------------------------------------

// ---- the AllToAll -----------------------------------------------------------------------------

class NvlinkAllToAll final : public AllToAll {
 public:
  explicit NvlinkAllToAll(const AllToAllConfig& c) : c_(c), layout_(c) {}

  // Waits for the device: kernels on the caller's stream (which may be gone by now) may still
  // use our memory.
  ~NvlinkAllToAll() override {
    cudaSetDevice(c_.cuda_device);
    cudaDeviceSynchronize();
    if (nv_.trace) PrintTrace();
    // A write the relay posted that never ended still reads the outbox: leak both boxes then.
    if (relay_ && !relay_->Stop()) {
      inbox_.Leak();
      outbox_.Leak();
    }
    if (own_stream_) cudaStreamDestroy(own_stream_);
    if (error_) cudaFreeHost(error_);
  }

  Status Init(TransferEngine* engine, Bootstrap& bootstrap) {
    const int n = c_.world_size, k = c_.experts_per_token, t = c_.max_tokens_per_rank;
    if (c_.cuda_device >= CudaDeviceCount()) {
      return FailedPreconditionError("AllToAll: CUDA device " + std::to_string(c_.cuda_device) +
                                     " does not exist (" + std::to_string(CudaDeviceCount()) +
                                     " visible)");
    }
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    FERRY_CUDA(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    stream_ = own_stream_;
    int sms = 0;
    FERRY_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c_.cuda_device));

    // The shared buffer's layout (see nvlink_all_to_all.h).
    Nv& v = nv_;
    v.n = n;
    v.me = c_.rank;
    v.e = c_.num_experts;
    v.l = c_.local_experts();
    v.k = k;
    v.t_max = t;
    v.hidden = c_.hidden;
    v.spt = c_.scales_per_token();
    v.priv = c_.max_private_tokens;
    v.chunks = static_cast<int>((int64_t{t} * k + kChunk - 1) / kChunk);
    v.payload = c_.token_bytes();
    v.meta_bytes = sizeof(NvHeader) + int64_t{k} * sizeof(NvEntry);
    v.slot_bytes = RoundUp(v.meta_bytes + v.payload + int64_t{v.spt} * 4, 16);
    v.row_bytes = int64_t{c_.hidden} * 2;
    v.capacity = c_.expert_capacity();
    v.once = c_.dispatch_once_per_rank;
    v.reduce = c_.combine_reduce_at_expert_rank;
    v.slots_per_pair = layout_.slots_per_pair;
    v.counts_off = RoundUp(2 * n * 8, 128);
    v.counts_stride = static_cast<int>(RoundUp(v.l + kCountsColumns, 4));
    v.private_off = RoundUp(v.counts_off + int64_t{n} * v.counts_stride * 4, 128);
    v.combine_off = RoundUp(v.private_off + int64_t{n} * v.priv * v.slot_bytes, 128);
    v.send_off = RoundUp(v.combine_off + int64_t{t} * k * v.row_bytes, 128);
    const int64_t bytes = v.send_off + int64_t{t} * k * v.slot_bytes;
    const int64_t max_recv = int64_t{n} * layout_.slots_per_pair;
    recv_grid_ = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_recv, 4 * sms)));
    recv_grid_limit_ = 4 * sms;
    // Unpack's shared memory (see the kernel); above the default limit for very many ranks.
    unpack_smem_ = size_t(n) * sizeof(PeerIn) + size_t(RoundUp((3 * int64_t{n} + 1) * 8, 16)) +
                   size_t(n) * v.counts_stride * sizeof(int32_t) +
                   size_t(n + 1) * v.l * sizeof(int32_t);
    if (unpack_smem_ > 48 * 1024) {
      FERRY_CUDA(cudaFuncSetAttribute(UnpackKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(unpack_smem_)));
    }
    // Decode batches: DispatchSend in one kernel, its shared memory within the default limit.
    const size_t small_smem = SmallSmemBytes(n, v.e, int64_t{t} * k);
    if (int64_t{t} * k <= kSmallEntries && small_smem <= 48 * 1024) small_smem_ = small_smem;
    // The send kernels' grids are fixed (peers count our blocks' arrivals, see Arrive).
    send_grid_ = small_smem_ > 0 ? (t + kSmallWarps - 1) / kSmallWarps : TokenGrid(t);
    send_grid_ = std::max(send_grid_, 1);
    if (const char* pdl = std::getenv("FERRY_NV_PDL"); pdl && *pdl == '0') pdl_ = false;

    // Exchange: the configuration, then the buffers.
    const auto timeout = std::chrono::seconds(60);
    ASSIGN_OR_RETURN(auto prints, bootstrap.AllGather(c_.Fingerprint(), timeout));
    for (int r = 0; r < n; ++r) {
      if (prints[r] != prints[c_.rank]) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                    " has a different configuration than rank " +
                                    std::to_string(c_.rank) + " (" + c_.ToString() + ")");
      }
    }
    // Within our node: every member's buffer mapped here.
    int fd = -1;
    RETURN_IF_ERROR(shared_.Create(c_.cuda_device, bytes, &fd));
    const int per_node = c_.ranks_per_node, first = c_.rank / per_node * per_node;
    std::vector<int> members(per_node);
    for (int i = 0; i < per_node; ++i) members[i] = first + i;
    auto fds = ExchangeFds(bootstrap, members, fd, timeout);
    close(fd);
    RETURN_IF_ERROR(fds.status());
    std::vector<uint8_t*> bases(n, nullptr);
    Status imported = Status::Ok();
    for (int i = 0; i < per_node; ++i) {
      const int r = members[i];
      if (r == c_.rank) {
        bases[r] = shared_.own();
      } else if (imported.ok()) {
        auto base = shared_.Import((*fds)[i]);
        if (base.ok()) bases[r] = *base; else imported = base.status();
      }
      close((*fds)[i]);
    }
    RETURN_IF_ERROR(imported);

    // Other nodes: the relay's inbox and outbox, pinned and mapped, and the relay.
    const RelayLayout relay(c_, v.slot_bytes);
    v.first_remote = relay.remotes.empty() ? -1 : relay.remotes.front();
    if (relay.counts_bytes != int64_t{v.counts_stride} * 4) {
      return InternalError("moe: the relay's counts row and the kernels' differ in size");
    }
    uint8_t* inbox = nullptr;
    uint8_t* outbox = nullptr;
    if (!relay.remotes.empty()) {
      ASSIGN_OR_RETURN(inbox_, PinnedBuffer::Allocate(relay.inbox_bytes));
      ASSIGN_OR_RETURN(outbox_, PinnedBuffer::Allocate(relay.outbox_bytes));
      void* p = nullptr;
      FERRY_CUDA(cudaHostGetDevicePointer(&p, inbox_.data(), 0));
      inbox = static_cast<uint8_t*>(p);
      FERRY_CUDA(cudaHostGetDevicePointer(&p, outbox_.data(), 0));
      outbox = static_cast<uint8_t*>(p);
      // The inbox flags in our GPU's memory when GDRCopy is there (FERRY_GDRCOPY=0: never).
      RelayFlags flags;
      const char* gdr_env = std::getenv("FERRY_GDRCOPY");
      if (!(gdr_env && *gdr_env == '0')) {
        auto gdr = GdrFlags::Open(2 * size_t(n), c_.cuda_device);
        if (gdr.ok()) {
          gdr_ = std::move(gdr).value();
          flags = {gdr_->host_words(), true};
        } else if (const char* t = std::getenv("FERRY_RELAY_TRACE"); t && *t && *t != '0') {
          std::fprintf(stderr, "[rank %d] relay: inbox flags in host memory: %s\n", c_.rank,
                       gdr.status().ToString().c_str());
        }
      }
      ASSIGN_OR_RETURN(relay_, Relay::Create(c_, relay, engine, bootstrap, inbox_.data(),
                                             outbox_.data(), 60000, flags));
    }
    // Every rank's send grids: what its flags for us gain per epoch.
    std::vector<uint8_t> grids(2 * sizeof(int32_t));
    const int32_t mine[2] = {send_grid_, recv_grid_};
    std::memcpy(grids.data(), mine, sizeof mine);
    ASSIGN_OR_RETURN(auto all_grids, bootstrap.AllGather(grids, timeout));
    std::vector<NvPeer> peers(n);
    for (int r = 0; r < n; ++r) {
      if (all_grids[r].size() != sizeof mine) {
        return InternalError("AllToAll: rank " + std::to_string(r) + " sent malformed grids");
      }
      if (relay.Remote(r)) {
        peers[r] = RemotePeer(relay, inbox, outbox, r);
        if (gdr_) {  // the relay raises them in our GPU's memory
          peers[r].dispatch_flag_in = gdr_->device_words() + r;
          peers[r].combine_flag_in = gdr_->device_words() + n + r;
        }
      } else {
        peers[r] = NodePeer(bases[c_.rank], bases[r], r);
        int32_t theirs[2];
        std::memcpy(theirs, all_grids[r].data(), sizeof theirs);
        peers[r].dispatch_step = theirs[0];
        peers[r].combine_step = theirs[1];
      }
    }

    // Device state.
    RETURN_IF_ERROR(peers_.Allocate(n));
    FERRY_CUDA(cudaMemcpy(peers_.get(), peers.data(), n * sizeof(NvPeer), cudaMemcpyHostToDevice));
    RETURN_IF_ERROR(scratch_.Allocate(1));
    FERRY_CUDA(cudaMemset(scratch_.get(), 0, sizeof(Scratch)));
    RETURN_IF_ERROR(indices_.Allocate(size_t(t) * k));
    RETURN_IF_ERROR(weights_.Allocate(size_t(t) * k));
    RETURN_IF_ERROR(row_pos_.Allocate(size_t(n) * t));
    RETURN_IF_ERROR(totals_.Allocate(2 * size_t(n)));
    if (small_smem_ == 0) {  // Route's output, read by Pack only
      RETURN_IF_ERROR(slot_pos_.Allocate(size_t(n) * t));
      RETURN_IF_ERROR(erank_.Allocate(size_t(t) * k));
      RETURN_IF_ERROR(chunk_counts_.Allocate(size_t(v.chunks) * v.e));
    }
    RETURN_IF_ERROR(rslots_.Allocate(max_recv));
    RETURN_IF_ERROR(rentries_.Allocate(size_t(max_recv) * k));
    void* error = nullptr;
    FERRY_CUDA(cudaHostAlloc(&error, 4 * sizeof(int32_t), cudaHostAllocMapped |
                                                          cudaHostAllocPortable));
    error_ = static_cast<int32_t*>(error);
    std::memset(error_, 0, 4 * sizeof(int32_t));
    void* error_dev = nullptr;
    FERRY_CUDA(cudaHostGetDevicePointer(&error_dev, error, 0));
    v.own = bases[c_.rank];
    v.peer = peers_.get();
    v.scratch = scratch_.get();
    v.error = static_cast<int32_t*>(error_dev);
    v.indices = indices_.get();
    v.weights = weights_.get();
    v.slot_pos = slot_pos_.get();
    v.row_pos = row_pos_.get();
    v.totals = totals_.get();
    v.erank = erank_.get();
    v.chunk_counts = chunk_counts_.get();
    v.rslots = rslots_.get();
    v.rentries = rentries_.get();
    if (const char* trace = std::getenv("FERRY_NV_TRACE"); trace && *trace && *trace != '0') {
      v.trace_blocks = recv_grid_limit_;
      RETURN_IF_ERROR(trace_.Allocate(size_t(kTraceKernels) * v.trace_blocks * kTraceSlots));
      FERRY_CUDA(cudaMemset(trace_.get(), 0,
                            size_t(kTraceKernels) * v.trace_blocks * kTraceSlots * 8));
      v.trace = trace_.get();
    }
    FERRY_CUDA(cudaDeviceSynchronize());
    // No rank writes into another before every buffer is zeroed and mapped.
    return bootstrap.Barrier(timeout);
  }

  const AllToAllConfig& config() const override { return c_; }

  Status SetStream(void* stream) override {
    RETURN_IF_ERROR(Sticky());
    if (stage_ != Stage::kIdle) {
      return FailedPreconditionError("SetStream: only between a CombineRecv and a DispatchSend");
    }
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    FERRY_CUDA(cudaStreamSynchronize(stream_));
    stream_ = stream ? static_cast<cudaStream_t>(stream) : own_stream_;
    async_ = stream != nullptr;
    return Status::Ok();
  }

  Status Synchronize() override {
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    return Finish();
  }

  Status DispatchSend(const DispatchInput& in) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "DispatchSend"));
    if (in.num_tokens < 0 || in.num_tokens > c_.max_tokens_per_rank) {
      return InvalidArgumentError("DispatchSend: " + std::to_string(in.num_tokens) +
                                  " tokens, configured maximum " +
                                  std::to_string(c_.max_tokens_per_rank));
    }
    if ((in.num_tokens > 0) &&
        (!in.x || !in.indices || !in.weights || (nv_.spt && !in.scales))) {
      return InvalidArgumentError("DispatchSend: null input buffer");
    }
    RETURN_IF_ERROR(Aligned(in.x, "DispatchSend: x"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    // Synchronous steps are strict: bad input sends nothing, and the step may be retried.
    const SendArgs args{static_cast<const uint8_t*>(in.x), in.scales, in.indices, in.weights,
                        in.device_num_tokens, in.num_tokens, !async_};
    if (small_smem_ > 0) {
      SendSmallKernel<<<send_grid_, kSmallThreads, small_smem_, stream_>>>(nv_, args);
      FERRY_CUDA(cudaGetLastError());
      if (!async_) RETURN_IF_ERROR(Finish());
    } else {
      RouteKernel<<<nv_.n + nv_.chunks, kRouteThreads, 0, stream_>>>(nv_, args);
      FERRY_CUDA(cudaGetLastError());
      if (!async_) RETURN_IF_ERROR(Finish());
      PackKernel<<<send_grid_, kCopyThreads, 2 * nv_.n * sizeof(int64_t), stream_>>>(nv_,
                                                                                   args);
      FERRY_CUDA(cudaGetLastError());
    }
    token_bound_ = in.num_tokens;
    stage_ = Stage::kDispatchSent;
    return async_ ? Status::Ok() : Finish();
  }

  Status DispatchRecv(const DispatchOutput& out, Deadline deadline) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchSent, "DispatchRecv"));
    if (!out.x || !out.num_tokens || (nv_.spt && !out.scales)) {
      return InvalidArgumentError("DispatchRecv: null output buffer");
    }
    RETURN_IF_ERROR(Aligned(out.x, "DispatchRecv: x"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    const RecvArgs args{static_cast<uint8_t*>(out.x), out.scales, out.num_tokens,
                        BudgetNs(deadline)};
    FERRY_CUDA(Launch(UnpackKernel, recv_grid_, unpack_smem_, args));
    stage_ = Stage::kDispatchDone;
    return async_ ? Status::Ok() : Finish();
  }

  Status CombineSend(const uint16_t* expert_out) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchDone, "CombineSend"));
    if (!expert_out) return InvalidArgumentError("CombineSend: null expert output");
    RETURN_IF_ERROR(Aligned(expert_out, "CombineSend: expert output"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    CombineSendKernel<<<recv_grid_, kCopyThreads, 0, stream_>>>(
        nv_, CombineArgs{expert_out, nullptr, false, 0});
    FERRY_CUDA(cudaGetLastError());
    stage_ = Stage::kCombineSent;
    return async_ ? Status::Ok() : Finish();
  }

  Status CombineRecv(uint16_t* out, bool accumulate, Deadline deadline) override {
    RETURN_IF_ERROR(Step(Stage::kCombineSent, "CombineRecv"));
    if (!out && token_bound_ > 0) return InvalidArgumentError("CombineRecv: null output");
    RETURN_IF_ERROR(Aligned(out, "CombineRecv: output"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    FERRY_CUDA(Launch(CombineRecvKernel, TokenGrid(token_bound_), nv_.n * sizeof(int64_t),
                      CombineArgs{nullptr, out, accumulate, BudgetNs(deadline)}));
    stage_ = Stage::kIdle;
    return async_ ? Status::Ok() : Finish();
  }

  // Read back after the steps ran (waits for them).
  uint64_t dispatch_bytes_sent() const override {
    std::vector<int32_t> totals(nv_.n, 0);
    cudaSetDevice(c_.cuda_device);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(totals.data(), nv_.totals, nv_.n * sizeof(int32_t), cudaMemcpyDeviceToHost);
    uint64_t bytes = 0;
    for (int r = 0; r < nv_.n; ++r) {
      if (r != c_.rank) bytes += uint64_t(totals[r]) * nv_.slot_bytes + (nv_.l + 2) * 4;
    }
    return bytes;
  }
  uint64_t combine_bytes_sent() const override {
    Scratch s{};
    cudaSetDevice(c_.cuda_device);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(&s, nv_.scratch, sizeof s, cudaMemcpyDeviceToHost);
    return uint64_t(s.rows_out) * nv_.row_bytes;
  }

 private:
  enum class Stage { kIdle, kDispatchSent, kDispatchDone, kCombineSent };

  Status Step(Stage want, const char* name) {
    RETURN_IF_ERROR(Sticky());
    if (stage_ != want) {
      return FailedPreconditionError(std::string(name) +
                                     " out of order: the steps run DispatchSend, DispatchRecv, "
                                     "CombineSend, CombineRecv");
    }
    return Status::Ok();
  }

  // A peer that missed a deadline ends this AllToAll (its flags can no longer be trusted); so
  // does a relay that stopped (a remote rank lost).
  Status Sticky() {
    if (!failed_.ok()) return failed_;
    if (relay_ && relay_->failed()) return failed_ = relay_->error();
    if (reinterpret_cast<volatile int32_t*>(error_)[0] == kPeerTimeout) return Finish();
    return Status::Ok();
  }

  // For the last epoch, per kernel: each point's slowest and mean block time from the block's
  // start (µs), then its blocks' first and last start and last end relative to the first
  // DispatchSend block (µs, global timer).
  void PrintTrace() {
    static const char* const kNames[kTraceKernels] = {"DispatchSend", "Unpack", "CombineSend",
                                                      "CombineRecv"};
    std::vector<long long> stamps(size_t(kTraceKernels) * nv_.trace_blocks * kTraceSlots);
    int khz = 0;
    if (cudaMemcpy(stamps.data(), nv_.trace, stamps.size() * 8, cudaMemcpyDeviceToHost) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, c_.cuda_device) != cudaSuccess ||
        khz <= 0) {
      return;
    }
    auto block = [&](int k, int b) { return &stamps[(size_t(k) * nv_.trace_blocks + b) * kTraceSlots]; };
    long long epoch = 0, origin = 0;
    for (int b = 0; b < nv_.trace_blocks; ++b) epoch = std::max(epoch, block(kTraceSend, b)[kTraceEpoch]);
    for (int b = 0; b < nv_.trace_blocks; ++b) {
      const long long* at = block(kTraceSend, b);
      if (at[kTraceEpoch] == epoch && (origin == 0 || at[kTraceStartNs] < origin)) {
        origin = at[kTraceStartNs];
      }
    }
    for (int k = 0; k < kTraceKernels; ++k) {
      std::string line = "[rank " + std::to_string(c_.rank) + "] trace " + kNames[k] + ":";
      for (int p = 1; p < kTracePoints; ++p) {
        double slowest = 0, sum = 0;
        int blocks = 0;
        for (int b = 0; b < nv_.trace_blocks; ++b) {
          const long long* at = block(k, b);
          if (at[kTraceEpoch] != epoch || at[p] == 0) continue;
          const double us = double(at[p] - at[0]) / khz * 1e3;
          slowest = std::max(slowest, us);
          sum += us;
          ++blocks;
        }
        if (blocks == 0) continue;
        char part[96];
        std::snprintf(part, sizeof part, " p%d %.2f/%.2f (%d)", p, slowest, sum / blocks, blocks);
        line += part;
      }
      long long first = 0, last = 0, end = 0;
      for (int b = 0; b < nv_.trace_blocks; ++b) {
        const long long* at = block(k, b);
        if (at[kTraceEpoch] != epoch) continue;
        first = first == 0 ? at[kTraceStartNs] : std::min(first, at[kTraceStartNs]);
        last = std::max(last, at[kTraceStartNs]);
        end = std::max(end, at[kTraceLastNs]);
      }
      if (first != 0) {
        char part[128];
        std::snprintf(part, sizeof part, " | started %.2f..%.2f ended %.2f", (first - origin) / 1e3,
                      (last - origin) / 1e3, (end - origin) / 1e3);
        line += part;
      }
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }

  // Rank r of our node: its buffer `theirs` (mapped here) and ours, `own`.
  NvPeer NodePeer(uint8_t* own, uint8_t* theirs, int r) const {
    const Nv& v = nv_;
    const int64_t width = v.counts_stride;
    NvPeer p{};
    p.dispatch_flag = reinterpret_cast<uint64_t*>(theirs) + v.me;
    p.combine_flag = reinterpret_cast<uint64_t*>(theirs) + v.n + v.me;
    p.counts = reinterpret_cast<int32_t*>(theirs + v.counts_off) + v.me * width;
    p.slots = theirs + v.private_off + int64_t{v.me} * v.priv * v.slot_bytes;
    p.combine = theirs + v.combine_off;
    p.dispatch_flag_in = reinterpret_cast<uint64_t*>(own) + r;
    p.combine_flag_in = reinterpret_cast<uint64_t*>(own) + v.n + r;
    p.counts_in = reinterpret_cast<int32_t*>(own + v.counts_off) + r * width;
    p.slots_in = own + v.private_off + int64_t{r} * v.priv * v.slot_bytes;
    p.pull = theirs + v.send_off;
    p.combine_in = own + v.combine_off;
    p.slot_cap = v.priv;
    p.row_cap = static_cast<int32_t>(int64_t{v.t_max} * v.k);
    return p;
  }

  // Rank r of another node: our outbox section for it, our inbox section from it (device
  // pointers of the mapped buffers).
  static NvPeer RemotePeer(const RelayLayout& relay, uint8_t* inbox, uint8_t* outbox, int r) {
    const int q = relay.RemoteIndex(relay.me, r);
    NvPeer p{};
    p.dispatch_flag = relay.OutboxFlag(outbox, false);
    p.combine_flag = relay.OutboxFlag(outbox, true);
    p.counts = reinterpret_cast<int32_t*>(outbox + relay.OutSection(q));
    p.slots = outbox + relay.OutSection(q) + relay.counts_bytes;
    p.combine = outbox + relay.OutRows(q);
    p.dispatch_flag_in = relay.InboxFlag(inbox, false, r);
    p.combine_flag_in = relay.InboxFlag(inbox, true, r);
    p.counts_in = reinterpret_cast<int32_t*>(inbox + relay.InSection(q));
    p.slots_in = inbox + relay.InSection(q) + relay.counts_bytes;
    p.pull = nullptr;
    p.combine_in = inbox + relay.in_combine_off;
    p.slot_cap = static_cast<int32_t>(relay.slots_per_pair);
    p.row_cap = static_cast<int32_t>(relay.rows_per_pair);
    p.remote = 1;
    p.dispatch_step = p.combine_step = 1;  // the relay stores "epoch + 1"
    return p;
  }

  // A receive kernel on our stream, allowed to start while the kernel before it runs (see
  // LaunchDependents); FERRY_NV_PDL=0 launches it plainly.
  template <typename Args>
  cudaError_t Launch(void (*kernel)(Nv, Args), int grid, size_t smem, const Args& args) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kCopyThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream_;
    cudaLaunchAttribute early{};
    early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &early;
    config.numAttrs = pdl_ ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, nv_, args);
  }

  // Blocks of the per-token kernels: one per token up to four per SM (then they loop).
  int TokenGrid(int tokens) const { return std::max(1, std::min(tokens, recv_grid_limit_)); }

  // The kernels move rows as 16-byte vectors.
  static Status Aligned(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return Status::Ok();
    return InvalidArgumentError(std::string(what) + " must be 16-byte aligned");
  }

  static uint64_t BudgetNs(Deadline deadline) {
    const auto left = deadline.at - Clock::now();
    return left.count() <= 0
               ? 0
               : static_cast<uint64_t>(
                     std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
  }

  // Waits for the stream; what a kernel reported becomes the Status (and is cleared, except a
  // peer timeout, which stays).
  Status Finish() {
    FERRY_CUDA(cudaStreamSynchronize(stream_));
    if (!failed_.ok()) return failed_;
    volatile int32_t* e = error_;
    const int32_t code = e[0], a = e[1], b = e[2];
    if (code == kNoError) return Status::Ok();
    e[1] = 0;
    e[2] = 0;
    e[0] = 0;
    FERRY_CUDA(cudaMemsetAsync(&nv_.scratch->error, 0, sizeof(int32_t), stream_));
    switch (code) {
      case kBadExpert:
        return OutOfRangeError("DispatchSend: token " + std::to_string(a) + " routes to expert " +
                               std::to_string(b) + ", valid ids are [0, " +
                               std::to_string(c_.num_experts) + ")");
      case kTooManyTokens:
        return InvalidArgumentError("DispatchSend: the device token count is " +
                                    std::to_string(a) + ", above num_tokens " +
                                    std::to_string(b) + " (nothing was sent)");
      case kBadSlot:
        return DataLossError("moe NVLink: malformed slot " + std::to_string(b) + " from rank " +
                             std::to_string(a));
      case kRowOverrun:
        return DataLossError("moe NVLink: local expert " + std::to_string(b) +
                             " received more rows than its capacity");
      default:
        (void)(failed_ = DeadlineExceededError(
            std::string("moe NVLink: rank ") + std::to_string(b) + " did not raise its " +
            (a == 0 ? "dispatch" : "combine") +
            " flag before the deadline (a lost or stalled peer); this AllToAll is unusable"));
        return failed_;
    }
  }

  const AllToAllConfig c_;
  const MoeLayout layout_;  // slots_per_pair: the most slots one sender routes to one receiver
  Nv nv_{};
  SharedCudaMemory shared_;
  PinnedBuffer inbox_, outbox_;  // other nodes (relay.h); the relay reads and writes them
  std::unique_ptr<GdrFlags> gdr_;  // the inbox flags in GPU memory, when GDRCopy is there
  std::unique_ptr<Relay> relay_;
  DeviceArray<NvPeer> peers_;
  DeviceArray<Scratch> scratch_;
  DeviceArray<int32_t> indices_, slot_pos_, row_pos_, totals_, erank_, chunk_counts_;
  DeviceArray<float> weights_;
  DeviceArray<RecvSlot> rslots_;
  DeviceArray<RecvEntry> rentries_;
  DeviceArray<long long> trace_;
  int32_t* error_ = nullptr;  // pinned, mapped
  cudaStream_t own_stream_ = nullptr, stream_ = nullptr;
  bool async_ = false;
  int send_grid_ = 1;  // DispatchSend's (SendSmall or Pack), fixed
  int recv_grid_ = 1;  // Unpack's and CombineSend's
  int recv_grid_limit_ = 1;
  bool pdl_ = true;    // receive kernels may start early (Launch)
  int token_bound_ = 0;
  size_t small_smem_ = 0;  // SendSmallKernel's shared memory; 0: Route and Pack instead
  size_t unpack_smem_ = 0;
  Stage stage_ = Stage::kIdle;
  Status failed_ = Status::Ok();
};

}  // namespace

StatusOr<std::unique_ptr<AllToAll>> NewNvlinkAllToAll(const AllToAllConfig& config,
                                                      TransferEngine* engine,
                                                      Bootstrap& bootstrap) {
  if (config.device != MoeDeviceKind::kCuda) {
    return InvalidArgumentError("CUDA AllToAll: config.device is not kCuda");
  }
  auto a2a = std::make_unique<NvlinkAllToAll>(config);
  RETURN_IF_ERROR(a2a->Init(engine, bootstrap));
  return std::unique_ptr<AllToAll>(std::move(a2a));
}

}  // namespace ferry::moe
