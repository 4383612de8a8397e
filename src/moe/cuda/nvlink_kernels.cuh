// The NVLink AllToAll's kernels, step by step: DispatchSend (Route + Pack, or SendSmall for
// decode batches), DispatchRecv (Unpack), CombineSend, CombineRecv. What they share with the host
// side is in nvlink_protocol.cuh; design in nvlink_all_to_all.h. Included by
// nvlink_all_to_all.cu only.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <cstring>

#include "moe/cuda/nvlink_protocol.cuh"

namespace ferry::moe::nv {

// ---- dispatch send ----------------------------------------------------------------------------

// Slots and combine rows a token takes on kScanRanks ranks at once, as Route's block scans sum
// them: per rank, slots in the low 16 bits, rows in the high 16 (a chunk's sums are at most
// kRouteThreads * kMaxK = 8192 each).
struct RankCounts {
  uint32_t v[kScanRanks];
  __device__ RankCounts operator+(const RankCounts& o) const {
    RankCounts s;
#pragma unroll
    for (int q = 0; q < kScanRanks; ++q) s.v[q] = v[q] + o.v[q];
    return s;
  }
};
static_assert(kRouteThreads * kMaxK < (1 << 16), "a chunk's sums must fit 16 bits");

using RouteScan = cub::BlockScan<RankCounts, kRouteThreads>;
constexpr int kRouteWarps = kRouteThreads / 32;
union RouteSmem {
  typename RouteScan::TempStorage scan;
  uint16_t per_warp[kRouteWarps][kMaxExperts];  // CountChunk: copies per (warp, expert)
};
static_assert(kChunk / kRouteWarps == 32 * kSortItems, "a warp's entries: kSortItems rounds");
static_assert(kChunk < (1 << 16), "a chunk's counts must fit 16 bits");

// Scan block b: tokens [c * kRouteThreads, (c + 1) * kRouteThreads), a token per thread, for
// ranks [r0, r0 + kScanRanks) (c = b / groups, r0 = (b % groups) * kScanRanks). Each token's
// slots and combine rows on those ranks, as exclusive prefix sums within the chunk, go to
// slot_pos and row_pos; the chunk's sums to scan_carry. The scan block that finishes last turns
// scan_carry into each chunk's carry (what the chunks before it hold, which Pack adds) and
// writes totals. The blocks of ranks [0, kScanRanks) report expert ids out of range, which every
// step then skips.
__device__ void ScanChunk(const Nv& v, const SendArgs& a, int tokens, int b, RouteSmem& smem) {
  const int groups = (v.n + kScanRanks - 1) / kScanRanks;
  const int c = b / groups, r0 = (b % groups) * kScanRanks;
  const int t = c * kRouteThreads + threadIdx.x;
  int rank_of[kMaxK];  // each copy's rank, -1 past k or for an id out of range
#pragma unroll
  for (int i = 0; i < kMaxK; ++i) rank_of[i] = -1;
  if (t < tokens) {
    int32_t e[kMaxK];
#pragma unroll
    for (int i = 0; i < kMaxK; ++i) {
      if (i < v.k) e[i] = a.indices[int64_t{t} * v.k + i];
    }
#pragma unroll
    for (int i = 0; i < kMaxK; ++i) {
      if (i >= v.k) break;
      if (ValidExpert(v, e[i])) {
        rank_of[i] = e[i] / v.l;
      } else if (r0 == 0) {
        Report(v, kBadExpert, t, e[i]);
      }
    }
  }
  RankCounts mine, chunk;
#pragma unroll
  for (int q = 0; q < kScanRanks; ++q) {
    int h = 0;
#pragma unroll
    for (int i = 0; i < kMaxK; ++i) h += rank_of[i] == r0 + q;
    const uint32_t slots = h == 0 ? 0 : (v.once ? 1 : h), rows = h == 0 ? 0 : (v.reduce ? 1 : h);
    mine.v[q] = slots | rows << 16;
  }
  RouteScan(smem.scan).ExclusiveSum(mine, mine, chunk);
#pragma unroll
  for (int q = 0; q < kScanRanks; ++q) {
    const int r = r0 + q;
    if (r >= v.n) break;
    if (t < tokens) {
      v.slot_pos[int64_t{r} * v.t_max + t] = static_cast<int32_t>(mine.v[q] & 0xFFFF);
      v.row_pos[int64_t{r} * v.t_max + t] = static_cast<int32_t>(mine.v[q] >> 16);
    }
    if (threadIdx.x == 0) {
      v.scan_carry[int64_t{c} * v.n + r] = (chunk.v[q] & 0xFFFF) | int64_t{chunk.v[q] >> 16} << 32;
    }
  }
  if (!LastBlock(&v.scratch->tickets[3], false, v.scan_blocks)) return;
  const int chunks = v.scan_blocks / groups;
  for (int r = threadIdx.x; r < v.n; r += blockDim.x) {
    int64_t sum = 0;
    for (int c0 = 0; c0 < chunks; c0 += 8) {  // eight chunks' sums loaded at once
      int64_t here[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (c0 + u < chunks) here[u] = __ldcg(&v.scan_carry[int64_t{c0 + u} * v.n + r]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (c0 + u >= chunks) break;
        v.scan_carry[int64_t{c0 + u} * v.n + r] = sum;
        sum += here[u];
      }
    }
    v.totals[r] = static_cast<int32_t>(sum & 0xFFFFFFFF);
    v.totals[v.n + r] = static_cast<int32_t>(sum >> 32);
  }
}

// Chunk c's block: entries [c * kChunk, (c + 1) * kChunk) of the (token, k) list. Gives each
// copy its rank among the chunk's copies for its expert, in entry order, and the chunk's count
// per expert. Warp w takes entries [w, w + 1) * 32 * kSortItems of the chunk, 32 at a time:
// copies of one expert within 32 entries find each other with one match, and a warp's running
// count per expert lives in shared memory (per_warp); then a prefix over the warps per expert
// turns those into each warp's start. Also copies the routing for the later steps.
__device__ void CountChunk(const Nv& v, const SendArgs& a, int tokens, int c, RouteSmem& smem) {
  const int64_t first = int64_t{c} * kChunk, entries = int64_t{tokens} * v.k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint16_t* mine = smem.per_warp[warp];
  for (int i = threadIdx.x; i < kRouteWarps * v.e; i += blockDim.x) {
    smem.per_warp[i / v.e][i % v.e] = 0;
  }
  __syncthreads();
  int32_t key[kSortItems];   // the expert, -1 past the end or for an id out of range
  int32_t rank[kSortItems];  // among the warp's copies of that expert so far
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int64_t f = first + (warp * kSortItems + j) * 32 + lane;
    key[j] = -1;
    if (f < entries) {
      const int32_t e = a.indices[f];
      v.indices[f] = e;
      v.weights[f] = a.weights[f];
      if (ValidExpert(v, e)) key[j] = e;
    }
    const unsigned same = __match_any_sync(~0u, key[j]);
    const int before = key[j] >= 0 ? mine[key[j]] : 0;
    rank[j] = before + __popc(same & ((1u << lane) - 1));
    __syncwarp();  // every lane read its count before the group's first lane moves it on
    if (key[j] >= 0 && lane == __ffs(same) - 1) mine[key[j]] = before + __popc(same);
    __syncwarp();
  }
  __syncthreads();
  int32_t* counts = v.chunk_counts + int64_t{c} * v.e;
  for (int e = threadIdx.x; e < v.e; e += blockDim.x) {  // each warp's start per expert
    int32_t sum = 0;
    for (int w = 0; w < kRouteWarps; ++w) {
      const int32_t here = smem.per_warp[w][e];
      smem.per_warp[w][e] = static_cast<uint16_t>(sum);
      sum += here;
    }
    counts[e] = sum;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int64_t f = first + (warp * kSortItems + j) * 32 + lane;
    if (key[j] >= 0) v.erank[f] = mine[key[j]] + rank[j];
  }
}

// Blocks [0, scan_blocks): ScanChunk; the next v.chunks: CountChunk. FERRY_NV_TRACE points: 1 a
// token chunk scanned, 2 a chunk counted (times relative to the first Pack block in the
// printout).
__global__ void __launch_bounds__(kRouteThreads) RouteKernel(Nv v, SendArgs a) {
  __shared__ RouteSmem smem;
  LaunchDependents();  // Pack's blocks take their SMs and wait for us there
  Mark(v, kTraceRoute, 0);
  const int tokens = SendTokens(v, a);
  if (blockIdx.x < v.scan_blocks) {
    ScanChunk(v, a, tokens, blockIdx.x, smem);
    Mark(v, kTraceRoute, 1);
  } else {
    CountChunk(v, a, tokens, blockIdx.x - v.scan_blocks, smem);
    Mark(v, kTraceRoute, 2);
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

// A warp's token row: LoadRowBatch loads 32 * kLaneVectors 16-byte vectors from `first`;
// StoreRowWarp stores the row into each of the token's ns slots (`dst`), batch by batch (the
// first already in `batch`), then its scales.
__device__ inline void LoadRowBatch(const Nv& v, const SendArgs& a, int t, int64_t first,
                                    uint4 (&batch)[kLaneVectors]) {
  const auto* row = reinterpret_cast<const uint4*>(a.x + int64_t{t} * v.payload);
  const int64_t vectors = v.payload / 16;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < kLaneVectors; ++u) {
    const int64_t i = first + lane + 32 * u;
    if (i < vectors) batch[u] = __ldg(row + i);
  }
}
__device__ inline void StoreRowWarp(const Nv& v, const SendArgs& a, int t, uint8_t* const* dst,
                                    int ns, uint4 (&batch)[kLaneVectors]) {
  const int lane = threadIdx.x % 32;
  const int64_t vectors = v.payload / 16, meta = v.meta_bytes / 16;
  for (int64_t first = 0; first < vectors; first += 32 * kLaneVectors) {
    if (first > 0) LoadRowBatch(v, a, t, first, batch);
    for (int slot = 0; slot < ns; ++slot) {
      uint4* d = reinterpret_cast<uint4*>(dst[slot]) + meta + first;
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
      auto* d = reinterpret_cast<float*>(dst[slot] + v.meta_bytes + v.payload);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + lane + 32 * u;
        if (i < v.spt) d[i] = scale[u];
      }
    }
  }
}

// A warp per token: token t goes to warp t / grid of block t % grid (consecutive tokens on
// different SMs), which loads the row's first batch, lays out the token's slots rank by rank
// (SlotDst; lane j places the token's j-th copy, its slot's first lane writes the header), then
// stores the row into every slot. Block 0 writes the counts rows into every rank first; every
// block arrives at every rank's dispatch flag.
// FERRY_NV_TRACE points (as DispatchSend): 1 offsets, 2 counts rows out, 3 and 4 warp 0's laying
// out and copying summed over its tokens (spans, not times), 5 loop done, 6 arrived.
__global__ void __launch_bounds__(kCopyThreads) PackKernel(Nv v, SendArgs a) {
  extern __shared__ int64_t starts[];  // [2N]: first slot per receiving rank in our send area,
                                       // first combine row per expert rank
  __shared__ uint8_t* dst_of[kCopyThreads / 32][kMaxK];  // each warp's token's slots
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;  // Route started after the epoch's last step ended
  Mark(v, kTraceSend, 0);
  WaitPrimary();  // Route's output
  const int tokens = v.scratch->tokens;
  int64_t* row_starts = starts + v.n;
  PrefixTotals(v.totals, v.n, starts);
  PrefixTotals(v.totals + v.n, v.n, row_starts);
  Mark(v, kTraceSend, 1);
  if (blockIdx.x == 0) {  // our counts row into every rank, before block 0 arrives
    WriteCountsRows(v, epoch, [&](int r, int c) {
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
  Mark(v, kTraceSend, 2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t** dst = dst_of[warp];
  long long route_cycles = 0, copy_cycles = 0;  // FERRY_NV_TRACE: summed over the tokens
  for (int t = blockIdx.x + warp * gridDim.x; t < tokens; t += gridDim.x * (kCopyThreads / 32)) {
    const long long loop_start = v.trace ? clock64() : 0;
    uint4 batch[kLaneVectors];
    LoadRowBatch(v, a, t, 0, batch);  // in flight while the slots are laid out
    const LaneRoute x = RouteLane(v, v.indices + int64_t{t} * v.k);
    int32_t row_pos = 0;  // the token's first combine row among those from rank x.r
    if (x.valid) {
      const int64_t f = int64_t{t} * v.k + lane;
      int32_t pos = v.erank[f];
      for (int c = 0; c < f / kChunk; ++c) pos += v.chunk_counts[int64_t{c} * v.e + x.e];
      const int r = x.r;
      const int o = v.once ? 0 : x.within;  // which of the token's slots for rank r
      const int64_t carry = v.scan_carry[int64_t{t / kRouteThreads} * v.n + r];
      const int64_t j = v.slot_pos[int64_t{r} * v.t_max + t] + (carry & 0xFFFFFFFF) + o;
      row_pos = static_cast<int32_t>(v.row_pos[int64_t{r} * v.t_max + t] + (carry >> 32));
      uint8_t* d = SlotDst(v, r, j, starts[r]);
      const NvEntry entry{x.e % v.l, lane, v.weights[f], pos};
      reinterpret_cast<NvEntry*>(d + sizeof(NvHeader))[v.once ? x.within : 0] = entry;
      if (!v.once || x.first) {
        const int32_t row =
            static_cast<int32_t>(row_starts[r] + row_pos + (v.once || v.reduce ? 0 : o));
        *reinterpret_cast<NvHeader*>(d) =
            NvHeader{t, v.once ? x.hits : 1, row, static_cast<int16_t>(o),
                     static_cast<int16_t>(v.once ? 1 : x.hits)};
        dst[v.once ? x.ranks_before : x.lanes_before + x.within] = d;
      }
    }
    const int ns = __popc(v.once ? x.firsts : x.valids);
    __syncwarp();  // every lane read row_pos before it is completed for CombineRecv
    if (x.first) v.row_pos[int64_t{x.r} * v.t_max + t] = row_pos;
    const long long copy_start = v.trace ? clock64() : 0;
    route_cycles += copy_start - loop_start;
    StoreRowWarp(v, a, t, dst, ns, batch);
    TagSlots(v, dst, ns, epoch);
    __syncwarp();  // dst is rewritten for the warp's next token
    if (v.trace) copy_cycles += clock64() - copy_start;
  }
  MarkSpan(v, kTraceSend, 3, route_cycles);
  MarkSpan(v, kTraceSend, 4, copy_cycles);
  Mark(v, kTraceSend, 5);
  Arrive(v, false, epoch);
  Mark(v, kTraceSend, 6);
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

// Block b > 0 sends tokens (b - 1) * W + w (warp w), so each block needs positions only for its
// own W tokens; block 0 writes the counts rows (and so sends no token: its tokens would wait
// behind them). Each block reads the whole routing into shared memory and counts, with shared
// atomics, copies per expert and tokens per rank over all tokens (the totals: slot and
// combine-row starts per rank) and over the tokens before its own; within its own tokens a warp
// counts with ballots.
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
  const int first_token = (static_cast<int>(blockIdx.x) - 1) * kSmallWarps;

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
    WriteCountsRows(v, epoch, [&](int r, int c) {
      if (c == v.l + kColSlots) return int64_t{m.slots[r]};
      if (c == v.l + kColSendStart) return m.starts[r];
      if (c == v.l + kColRowStart) return m.row_starts[r];
      if (c == v.l + kColRows) return int64_t{m.rows[r]};
      return int64_t{m.hist[r * v.l + c]};
    });
  }
  Mark(v, kTraceSend, 3);

  const int t = first_token + warp;
  if (blockIdx.x > 0 && t < tokens) {
    // The row's first batch and the token's weights, in flight while the slots are laid out.
    uint4 batch[kLaneVectors];
    LoadRowBatch(v, a, t, 0, batch);
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

    StoreRowWarp(v, a, t, dst_of[warp], ns, batch);
    TagSlots(v, dst_of[warp], ns, epoch);
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
  int64_t* relay_rows;
  const uint64_t* dispatch_flag;  // streamed: what a pulled slot waits for
  int32_t slot_cap, remote, row_cap, dispatch_step;
  int64_t pad;
};
static_assert(sizeof(PeerIn) % 16 == 0, "PeerIn keeps what follows it 16-byte aligned");

__device__ inline void LoadPeersIn(const Nv& v, PeerIn* out) {
  for (int q = threadIdx.x; q < v.n; q += blockDim.x) {
    const NvPeer& p = v.peer[q];
    out[q] = PeerIn{p.counts_in, p.slots_in,    p.pull,       p.relay_rows, p.dispatch_flag_in,
                    p.slot_cap,  p.remote,      p.row_cap,    p.dispatch_step, 0};
  }
}

// Unpack's tables in shared memory (see the kernel), and, streamed, what its waits need.
struct SlotTables {
  const PeerIn* from_of;
  const int64_t *prefix, *start, *rebase;
  const int32_t* counts;
  int32_t* offset;
  const SlotOrder* order;  // the order visits take slots in (UnpackSlots)
  uint64_t epoch, wait_start, budget_ns;
};

// A group of kGroup threads (a warp or the block) waits for itself: the slot metadata it shares.
template <int kGroup>
__device__ inline void GroupSync() {
  if constexpr (kGroup == 32) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}
// Also orders the group's shared-memory writes before it with its reads after it, as
// __syncthreads_and does for a block (a warp vote alone does not promise that; __syncwarp does).
template <int kGroup>
__device__ inline bool GroupAll(bool value) {
  if constexpr (kGroup == 32) {
    const bool all = __all_sync(~0u, value);
    __syncwarp();
    return all;
  } else {
    return __syncthreads_and(value);
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

// Unpack's received slots for groups of kGroup threads, each thread keeping kVec 16-byte
// vectors in flight: a group's visits are blockIdx.x + group * grid, + grid * groups ..., each
// taking slot order(visit) (with v.spread, SpreadOrder when slots outnumber blocks; else every
// slot in order; streamed, in order as claimed). Checks each slot, copies its row to each
// entry's output row, remembers where the entries' combine rows go. Also builds the offsets
// table (the whole block, while each group's first slot loads).
template <int kGroup, int kVec, bool kStream>
__device__ void UnpackSlots(const Nv& v, const RecvArgs& a, const SlotTables& t,
                            int64_t total) {
  constexpr int kGroups = kCopyThreads / kGroup;
  __shared__ uint4 meta_of[kGroups][1 + kMaxK];  // each group's slot header and entries
  __shared__ int64_t out_row_of[kGroups][kMaxK];
  const int tid = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  uint4* meta_v = meta_of[group];
  int64_t* out_row = out_row_of[group];
  const PeerIn* from_of = t.from_of;
  const int64_t *prefix = t.prefix, *start = t.start, *rebase = t.rebase;
  const int32_t* counts = t.counts;
  int32_t* offset = t.offset;
  // Vectors [0, used): header and entries; [used, meta): padding, not loaded; [meta, body):
  // the row; [body, end): the scales.
  const int64_t used = v.meta_used / 16, meta = v.meta_bytes / 16, body = meta + v.payload / 16;
  const int64_t end = (v.meta_bytes + v.payload + int64_t{v.spt} * 4 + 15) / 16;
  const int64_t batch = int64_t{kVec} * kGroup;
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
  // Streamed: the group's first thread waits until the slot is there -- its tag, or for a
  // pulled slot (in its sender's send area, no tag waited on over NVLink per slot) every send
  // block of its sender arrived -- and the vote hands that to the group (the barrier orders
  // the acquire before the group's loads). False: the wait gave up (reported; later waits give
  // up at once).
  auto ready = [&](const uint4* src4) -> bool {
    bool ok = true;
    if (tid == 0 && src4) {
      const PeerIn& from = from_of[s];
      const bool pulled = s != v.me && j >= from.slot_cap;
      const uint64_t* word =
          pulled ? from.dispatch_flag
                 : reinterpret_cast<const uint64_t*>(reinterpret_cast<const uint8_t*>(src4) +
                                                     SlotTagOffset(v));
      const uint64_t want = (t.epoch + 1) * uint64_t(pulled ? from.dispatch_step : 1);
      ok = AwaitWord(v, word, want, t.wait_start, t.budget_ns, 0, s);
    }
    return GroupAll<kGroup>(ok);
  };
  // One round trip for the slot's first batch (metadata and, usually, the whole slot).
  uint4 r[kVec];
  auto load = [&](const uint4* src4, int64_t first) {
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      const int64_t i = first + tid + u * int64_t{kGroup};
      if (i < end && (i < used || i >= meta)) r[u] = __ldcg(src4 + i);
    }
  };
  const SlotOrder& order = *t.order;
  const int64_t first_visit = blockIdx.x + int64_t{group} * gridDim.x;
  const int64_t step = int64_t{gridDim.x} * kGroups;
  int64_t visit = first_visit;
  // The first slot in flight while the offsets table is built (streamed: once it is there,
  // after the table).
  const uint4* src4 = visit < total && !kStream ? locate(order(visit)) : nullptr;
  if (src4) load(src4, 0);
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
  bool primary_done = false, marked = false;
  if constexpr (kStream) visit = Claim<kGroup>(&v.scratch->claimed);
  for (; visit < total; visit = kStream ? Claim<kGroup>(&v.scratch->claimed) : visit + step) {
    const int64_t g = kStream ? visit : order(visit);
    if (visit != first_visit || kStream) {
      src4 = locate(g);
      if (kStream && !ready(src4)) return;
      if (src4) load(src4, 0);
    }
    if (!src4) {
      if (tid == 0) {
        Report(v, kBadSlot, s, static_cast<int32_t>(j));
        v.rslots[g] = RecvSlot{s, 0, 0, 0, 1};
      }
      continue;
    }
    const PeerIn& from = from_of[s];
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      const int64_t i = tid + u * int64_t{kGroup};
      if (i < used) meta_v[i] = r[u];
    }
    GroupSync<kGroup>();
    // Checks in parallel: the header by every thread, entry i by thread i.
    NvHeader header;
    std::memcpy(&header, &meta_v[0], sizeof header);
    const int entries = min(max(header.entries, 0), v.k);
    // The combine row, counted from where our rows for s go (rebased for another node).
    const int64_t row = header.row - rebase[s];
    const SlotLimits limits{v.k, v.l, v.t_max, v.reduce, from.row_cap, v.capacity};
    bool valid = SlotHeaderValid(header, row, limits);
    if (tid < entries) {
      NvEntry entry;
      std::memcpy(&entry, &meta_v[1 + tid], sizeof entry);
      const int32_t le = entry.local_expert;
      valid = valid && SlotEntryValid(entry, offset, s, limits);
      if (valid) {
        const int64_t expert_row = int64_t{le} * v.capacity + offset[s * v.l + le] + entry.pos;
        out_row[tid] = v.token_major ? g : expert_row;
        // CombineSend's entries; token-major it copies row g and reads none.
        if (!v.token_major) {
          v.rentries[g * v.k + tid] = RecvEntry{expert_row, entry.weight};
        }
      }
    }
    valid = GroupAll<kGroup>(valid);
    if (!marked) Mark(v, kTraceUnpack, 5);
    marked = true;
    if (tid == 0) {
      if (!valid) Report(v, kBadSlot, s, static_cast<int32_t>(j));
      v.rslots[g] = RecvSlot{s, static_cast<int32_t>(row), valid ? entries : 0, header.part,
                             header.parts};
    }
    // Token-major: the slot is one output row, and column c of its experts and weights is the
    // entry whose k is c (thread c looks for it), or none.
    const int outs = valid ? (v.token_major ? 1 : entries) : 0;
    if (!primary_done) {  // the caller's memory from here on (a.out_x, a.out_scales, ...)
      if (!kStream) WaitPrimary();  // streamed: see UnpackKernel
      primary_done = true;
    }
    if (v.token_major && valid && tid < v.k) {
      int32_t expert = -1;
      float weight = 0.0f;
      for (int i = 0; i < entries; ++i) {
        NvEntry entry;
        std::memcpy(&entry, &meta_v[1 + i], sizeof entry);
        if (entry.k == tid) {
          expert = entry.local_expert;
          weight = entry.weight;
        }
      }
      a.token_experts[g * v.k + tid] = expert;
      a.token_weights[g * v.k + tid] = weight;
    }
    // The slot's vectors into every entry's output row (the row, then its scales), batch by
    // batch for slots longer than one.
    for (int64_t first = 0; outs > 0 && first < end; first += batch) {
      if (first > 0) load(src4, first);
      for (int e = 0; e < outs; ++e) {
        uint4* x = reinterpret_cast<uint4*>(a.out_x + out_row[e] * v.payload);
        float* scales = a.out_scales + out_row[e] * v.spt;
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
          const int64_t i = first + tid + u * int64_t{kGroup};
          if (i < meta || i >= end) continue;
          if (i < body) {
            x[i - meta] = r[u];
          } else {
            StoreScales(scales, (i - body) * 4, v.spt, r[u]);
          }
        }
      }
    }
    GroupSync<kGroup>();  // the shared slot metadata is rewritten for the next one
  }
}

// Every block waits for all dispatch flags, reads every sender's counts row, then takes its share
// of the received slots (UnpackSlots).
// Streamed, it waits for each sender's counts row instead, and for each slot as it takes it,
// and it does not wait for the kernel before it (our send kernel, which may still be storing
// slots) to end before writing the caller's outputs: what made WaitPrimary needed -- a kernel of
// the caller's that still reads them -- ended before our send kernel started (Route and
// SendSmall launch plainly), and every block saw our own counts row, which that kernel stored.
// A kernel the caller enqueues between DispatchSend and DispatchRecv ends before this one starts
// unless it lets dependents start early itself.
// Two blocks per SM (128 registers): one beside a Pack block when streamed, and otherwise two
// of Unpack's own.
template <bool kStream>
__global__ void __launch_bounds__(kCopyThreads, 2) UnpackKernel(Nv v, RecvArgs a) {
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
  __shared__ SlotOrder order;
  Mark(v, kTraceUnpack, 0);
  const uint64_t epoch = v.scratch->epoch;
  const uint64_t wait_start = GlobalTimerNs();
  LoadPeersIn(v, from_of);  // while thread 0 waits: no table load on the path after the flags
  if (kStream) {  // every sender's counts row, a thread per sender waiting for its tag
    bool there = true;
    for (int q = threadIdx.x; q < v.n; q += blockDim.x) {
      const NvPeer& p = v.peer[q];
      there = there && AwaitWord(v, reinterpret_cast<const uint32_t*>(p.counts_in + CountsTagColumn(v)),
                                 static_cast<uint32_t>(epoch + 1), wait_start, a.timeout_ns, 0, q);
    }
    if (!__syncthreads_and(there)) return;
  } else {
    if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 0);
    __syncthreads();
    if (!ok) return;
  }
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
    if (blockIdx.x == 0 && from_of[s].relay_rows) {  // for the relay's combine write (relay.h)
      from_of[s].relay_rows[0] = row[v.l + kColRowStart];
      from_of[s].relay_rows[1] = row[v.l + kColRows];
      __threadfence_system();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int s = 0; s < v.n; ++s) prefix[s + 1] += prefix[s];
    // Spread (v.spread) when groups loop (a block per slot otherwise); streamed, slots go as
    // claimed.
    order = SpreadOrder(prefix[v.n], v.spread && !kStream && prefix[v.n] > gridDim.x);
  }
  __syncthreads();
  const int64_t total = prefix[v.n];
  // Few slots (decode): a block per slot, the slot's vectors spread over the block. More slots
  // than blocks (prefill): a warp per slot, eight slots in flight per block, a lane's eight
  // vectors loaded at once -- one block copying slot after slot waits on each slot's load.
  // (Sixteen per lane take the kernel past 128 registers, one block per SM, or spill.)
  const SlotTables tables{from_of, prefix,     start,       rebase, counts, offset,
                          &order,  epoch,      wait_start,  a.timeout_ns};
  if (total > gridDim.x) {
    UnpackSlots<32, 8, kStream>(v, a, tables, total);
  } else {
    UnpackSlots<kCopyThreads, 4, kStream>(v, a, tables, total);
  }
  if (blockIdx.x == 0) {
    if (!kStream) WaitPrimary();
    if (v.token_major && threadIdx.x == 0) *a.num_rows = static_cast<int32_t>(total);
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
// rows[c][c8[u]], in c order, fp32, unfused: the host device's arithmetic. The loads of kR rows
// of all kG column groups are in flight at once.
template <int kG, int kR>
__device__ inline void WeightedSum(float (&acc)[kG][8], const uint4* const* rows,
                                   const float* weight, int count, const int64_t (&c8)[kG]) {
  for (int first = 0; first < count; first += kR) {
    uint4 vals[kG][kR];
#pragma unroll
    for (int c = 0; c < kR; ++c) {
#pragma unroll
      for (int u = 0; u < kG; ++u) {
        if (first + c < count && c8[u] >= 0) vals[u][c] = __ldcg(rows[first + c] + c8[u]);
      }
    }
#pragma unroll
    for (int c = 0; c < kR; ++c) {
      if (first + c >= count) break;
      const float w = weight[first + c];
#pragma unroll
      for (int u = 0; u < kG; ++u) {
        if (c8[u] < 0) continue;
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w, Bf16At(vals[u][c], q)));
      }
    }
  }
}

// Streamed combine: once the block stored rows [row, row + rows) of rank r's combine region,
// their tags "epoch + 1" (the barrier orders every thread's stores before the releases).
__device__ inline void TagRows(const Nv& v, int r, int64_t row, int rows, uint64_t epoch) {
  if (!v.stream_combine) return;
  __syncthreads();
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    StoreRelease(v.peer[r].combine_tags + row + i, epoch + 1);
  }
}

// Received slots again: each copy's expert output row (plain) or, summed at the expert rank, one
// weighted fp32 sum per token taken in (local expert, position) order as the host device does,
// pushed into the sender's combine region. Every block arrives at every rank's combine flag.
// With v.spread, blocks looping over slots take them in SpreadOrder (streamed combine: in
// order, the order CombineRecv claims tokens in).
// Token-major, the caller summed each token's experts into row g of expert_out, which is copied
// as it is; kCopyOnly: an instance that only does that (few registers; see its launch).
template <bool kCopyOnly>
__global__ void __launch_bounds__(kCopyThreads) CombineSendKernel(Nv v, CombineArgs a) {
  __shared__ const uint4* rows[kMaxK];
  __shared__ float weight[kMaxK];
  __shared__ int count;
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;
  Mark(v, kTraceCombineSend, 0);
  const int64_t total = v.scratch->total_recv;
  int64_t rows_out = 0;
  const SlotOrder order = SpreadOrder(total, v.spread && !v.stream_combine && total > gridDim.x);
  for (int64_t visit = blockIdx.x; visit < total; visit += gridDim.x) {
    const int64_t g = order(visit);
    const RecvSlot slot = v.rslots[g];
    // A malformed slot (Unpack reported it and kept no entry) returns nothing: its row is not
    // one we checked, and a row written there could land on another token's.
    if (slot.entries == 0) continue;
    uint8_t* dst = v.peer[slot.sender].combine + int64_t{slot.row} * v.row_bytes;
    if (kCopyOnly || v.token_major) {
      CopyBytes(dst, reinterpret_cast<const uint8_t*>(a.expert_out + g * v.hidden), v.row_bytes);
      TagRows(v, slot.sender, slot.row, 1, epoch);
      if (slot.sender != v.me) ++rows_out;
      continue;
    }
    if (!v.reduce) {
      for (int i = 0; i < slot.entries; ++i) {
        const RecvEntry entry = v.rentries[g * v.k + i];
        CopyBytes(dst + i * v.row_bytes,
                  reinterpret_cast<const uint8_t*>(a.expert_out + entry.out_row * v.hidden),
                  v.row_bytes);
      }
      TagRows(v, slot.sender, slot.row, slot.entries, epoch);
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
    if (visit == blockIdx.x) Mark(v, kTraceCombineSend, 1);
    auto* out = reinterpret_cast<uint4*>(dst);
    const int64_t groups = v.hidden / 8;
    for (int64_t c = threadIdx.x; c < groups; c += 2 * int64_t{blockDim.x}) {
      const int64_t c8[2] = {c, c + blockDim.x < groups ? c + blockDim.x : -1};
      float acc[2][8] = {};
      WeightedSum<2, 8>(acc, rows, weight, count, c8);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (c8[u] >= 0) out[c8[u]] = PackBf16(acc[u]);
      }
    }
    TagRows(v, slot.sender, slot.row, 1, epoch);
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

// Token t's returned rows, rank by rank and k by k, summed in fp32 (unfused, the host device's
// order) onto the previous output or zero, into y, by a group of kGroup threads (the block or
// a warp): eight columns per thread, kG groups of them at a time with kR rows' loads in flight
// (WeightedSum).
template <int kGroup, int kG, int kR>
__device__ inline void SumToken(const Nv& v, const CombineArgs& a, int t, const uint4* const* rows,
                                const float* weight, int count, bool wait_primary) {
  auto* y = reinterpret_cast<uint4*>(a.out + int64_t{t} * v.hidden);
  const int64_t groups = v.hidden / 8;
  for (int64_t c = threadIdx.x % kGroup; c < groups; c += int64_t{kG} * kGroup) {
    int64_t c8[kG];
#pragma unroll
    for (int u = 0; u < kG; ++u) c8[u] = c + u * kGroup < groups ? c + u * kGroup : -1;
    float acc[kG][8] = {};
    if (a.accumulate && wait_primary) WaitPrimary();  // a.out is the caller's memory
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      if (!a.accumulate || c8[u] < 0) continue;
      const uint4 prev = y[c8[u]];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = Bf16At(prev, q);
    }
    WeightedSum<kG, kR>(acc, rows, weight, count, c8);
    if (wait_primary) WaitPrimary();
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      if (c8[u] >= 0) y[c8[u]] = PackBf16(acc[u]);
    }
  }
}

// The last block of CombineRecv, once every step of the epoch is done: the streamed steps'
// claim counters start again (Unpack ended before this step began), and the epoch moves on.
__device__ inline void AdvanceEpoch(const Nv& v, uint64_t epoch) {
  v.scratch->claimed = 0;
  v.scratch->claimed_tokens = 0;
  v.scratch->epoch = epoch + 1;
}

// A warp: token t's returned rows in rank then k order (lane j: the token's j-th copy; summed at
// the expert rank, the first copy of each rank stands for its row) into rows / weight, their
// count into count; returns the lane's row (its index in our combine region, -1 for none) and
// the rank that returns it.
struct LaneRow {
  int64_t row;
  int rank;
};
__device__ inline LaneRow LocateRows(const Nv& v, int t, const int64_t* rank_start,
                                     const uint4** rows, float* weight, int* count) {
  const LaneRoute x = RouteLane(v, v.indices + int64_t{t} * v.k);
  LaneRow mine{-1, x.r};
  if (x.valid && (!v.reduce || x.first)) {
    const int c = v.reduce ? x.ranks_before : x.lanes_before + x.within;
    mine.row = rank_start[x.r] + v.row_pos[int64_t{x.r} * v.t_max + t] + (v.reduce ? 0 : x.within);
    rows[c] = reinterpret_cast<const uint4*>(v.peer[x.r].combine_in + mine.row * v.row_bytes);
    weight[c] = v.reduce ? 1.0f : v.weights[int64_t{t} * v.k + threadIdx.x % 32];
  }
  if (threadIdx.x % 32 == 0) *count = __popc(v.reduce ? x.firsts : x.valids);
  return mine;
}

// Streamed combine: tokens as claimed, by the block or, when tokens outnumber blocks
// (prefill), by each warp (as CombineRecvKernel); each token once its rows' tags are up (a lane
// per row waits), then summed as CombineRecvKernel does. It does not wait for the kernel before
// it (our CombineSend) before writing the caller's output: see UnpackKernel. The block that
// finishes last waits for every rank's combine flag -- every peer's CombineSend done, so its
// Unpack done reading what we sent it, before our next DispatchSend rewrites it
// (nvlink_all_to_all.h) -- then advances the epoch.
__global__ void __launch_bounds__(kCopyThreads) CombineRecvStreamedKernel(Nv v, CombineArgs a) {
  constexpr int kWarps = kCopyThreads / 32;
  extern __shared__ int64_t rank_start[];  // [N] our first combine row from each rank
  __shared__ const uint4* row_ptr[kWarps][kMaxK];  // the block per token: [0] only
  __shared__ float weight_of[kWarps][kMaxK];
  __shared__ int rows[kWarps];
  Mark(v, kTraceCombineRecv, 0);
  const uint64_t epoch = v.scratch->epoch;
  const uint64_t start = GlobalTimerNs();
  const int tokens = v.scratch->tokens;
  PrefixTotals(v.totals + v.n, v.n, rank_start);
  const uint64_t* tags = reinterpret_cast<const uint64_t*>(v.own + v.combine_tag_off);
  // Token t's rows located by a warp into table w and awaited: false if a wait gave up.
  auto arrived = [&](int t, int w) {
    const LaneRow mine = LocateRows(v, t, rank_start, row_ptr[w], weight_of[w], &rows[w]);
    return mine.row < 0 ||
           AwaitWord(v, tags + mine.row, epoch + 1, start, a.timeout_ns, 1, mine.rank);
  };
  bool ok = true, first = true;
  if (tokens > static_cast<int>(gridDim.x)) {
    const int w = threadIdx.x / 32;
    for (int t = Claim<32>(&v.scratch->claimed_tokens); t < tokens;
         t = Claim<32>(&v.scratch->claimed_tokens)) {
      ok = __all_sync(~0u, arrived(t, w));
      __syncwarp();  // the rows' acquires and the table, before every lane reads them
      if (!ok) break;
      if (first) Mark(v, kTraceCombineRecv, 1);
      first = false;
      SumToken<32, 4, 2>(v, a, t, row_ptr[w], weight_of[w], rows[w], false);
      __syncwarp();  // every lane read the token's rows before the next token's are located
    }
    if (__syncthreads_or(!ok)) return;
  } else {
    for (int t = Claim<kCopyThreads>(&v.scratch->claimed_tokens); t < tokens;
         t = Claim<kCopyThreads>(&v.scratch->claimed_tokens)) {
      if (!__syncthreads_and(threadIdx.x >= 32 || arrived(t, 0))) return;
      if (first) Mark(v, kTraceCombineRecv, 1);
      first = false;
      SumToken<kCopyThreads, 2, 8>(v, a, t, row_ptr[0], weight_of[0], rows[0], false);
    }
  }
  Mark(v, kTraceCombineRecv, 2);
  if (!LastBlock(&v.scratch->tickets[2], false) || threadIdx.x != 0) return;
  const uint64_t spent = GlobalTimerNs() - start;  // the deadline counts from the step's start
  if (!WaitAll(v, epoch, spent < a.timeout_ns ? a.timeout_ns - spent : 0, 1)) return;
  AdvanceEpoch(v, epoch);
  Mark(v, kTraceCombineRecv, 3);
}

// Once every combine flag is up, each token's returned rows, rank by rank and k by k, summed in
// fp32 (unfused, the host device's order) onto the previous output or zero: tokens t =
// blockIdx.x, + grid ... a block each, or, when tokens outnumber blocks (prefill), a warp each
// (eight tokens in flight per block, each warp locating its next token itself: a block per
// token waits on each token's routing loads and then its rows' loads, one after the other). The
// last block advances the epoch.
__global__ void __launch_bounds__(kCopyThreads) CombineRecvKernel(Nv v, CombineArgs a) {
  constexpr int kWarps = kCopyThreads / 32;
  extern __shared__ int64_t rank_start[];  // [N] our first combine row from each rank
  __shared__ bool ok;
  __shared__ const uint4* row_ptr[kWarps][kMaxK];  // a block per token: [0] only
  __shared__ float weight_of[kWarps][kMaxK];
  __shared__ int rows[kWarps];
  Mark(v, kTraceCombineRecv, 0);
  const uint64_t epoch = v.scratch->epoch;
  const int tokens = v.scratch->tokens;
  PrefixTotals(v.totals + v.n, v.n, rank_start);
  // Every block waits for every rank's combine flag, token or not: a rank's next DispatchSend
  // may reuse its buffers only after this (see nvlink_all_to_all.h). The first token's rows are
  // located before the wait.
  const bool warps = tokens > static_cast<int>(gridDim.x);
  const int w = warps ? threadIdx.x / 32 : 0;
  int t = warps ? blockIdx.x + w * gridDim.x : blockIdx.x;
  const int step = warps ? gridDim.x * kWarps : gridDim.x;
  auto locate = [&] {
    if (t < tokens && (warps || threadIdx.x < 32)) {
      LocateRows(v, t, rank_start, row_ptr[w], weight_of[w], &rows[w]);
    }
  };
  locate();
  if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 1);
  __syncthreads();
  if (!ok) return;
  Mark(v, kTraceCombineRecv, 1);
  if (warps) {
    for (; t < tokens; t += step) {
      if (t != static_cast<int>(blockIdx.x + w * gridDim.x)) {
        __syncwarp();  // every lane read the last token's rows
        locate();
      }
      __syncwarp();
      SumToken<32, 4, 2>(v, a, t, row_ptr[w], weight_of[w], rows[w], true);
    }
  } else {
    for (; t < tokens; t += step) {
      if (t != static_cast<int>(blockIdx.x)) {
        __syncthreads();  // the row table is rewritten for the next token
        locate();
        __syncthreads();
      }
      SumToken<kCopyThreads, 2, 8>(v, a, t, row_ptr[0], weight_of[0], rows[0], true);
    }
  }
  Mark(v, kTraceCombineRecv, 2);
  // Only our own epoch word changes: a device-scope fence is enough.
  if (LastBlock(&v.scratch->tickets[2], false) && threadIdx.x == 0) AdvanceEpoch(v, epoch);
  Mark(v, kTraceCombineRecv, 3);
}

}  // namespace ferry::moe::nv
