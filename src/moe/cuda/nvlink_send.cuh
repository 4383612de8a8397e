// DispatchSend's kernels for prefill batches: Route counts and scans the routing, Pack lays out
// each token's slots and stores its row into them; the helpers SendSmall (decode batches, both
// in one kernel: nvlink_send_small.cuh) shares with them; and the bf16 -> fp8 quantiser. What
// every step shares with the host side is in nvlink_protocol.cuh; the design in cuda_device.h.
// Included by cuda_device_launch.cu only.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "moe/cuda/nvlink_device.cuh"
#include "moe/numerics.h"

namespace ferry::moe::nv {

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

// The caller's id `f` of the routing: int32 as given, int64 narrowed (one outside int32 becomes
// INT32_MAX, out of range for any configuration, so the kernels skip and report it as they do
// any bad id). Read where the kernels read the routing, not by a kernel of its own first: a
// launch costs the caller microseconds of host time per dispatch.
__device__ __forceinline__ int32_t IdAt(const SendArgs& a, int64_t f) {
  if (!a.indices64) return a.indices[f];
  const int64_t e = a.indices64[f];
  return e >= -1 && e <= INT32_MAX ? static_cast<int32_t>(e) : INT32_MAX;
}

// An id as the send steps take it: an expert of a masked rank reads as -1 (no expert: nothing
// sent, nothing summed), so every send step, and the routing copy the combine reads, leave the
// rank out. Applied once a thread's ids are loaded, not between the loads: a check after each
// load waits for it, and a decode dispatch then paid ~2 us for loads no longer in flight
// together, masks or not.
__device__ __forceinline__ int32_t MaskId(const Nv& v, int32_t id) {
  return v.masks && ValidExpert(v, id) && MaskedRank(v, RankOf(v, id)) ? -1 : id;
}

// Scan block b: tokens [c * kRouteThreads, (c + 1) * kRouteThreads), a token per thread, for
// ranks [r0, r0 + kScanRanks) (c = b / groups, r0 = (b % groups) * kScanRanks). Each token's
// slots and combine rows on those ranks, as exclusive prefix sums within the chunk, go to
// slot_pos and row_pos; the chunk's sums to scan_carry. The scan block that finishes last turns
// scan_carry into each chunk's carry (what the chunks before it hold, which Pack adds) and
// writes totals. The blocks of ranks [0, kScanRanks) report expert ids out of range, which every
// step then skips.
__device__ void ScanChunk(const Nv& v, const SendArgs& a, int tokens, int b, RouteSmem& smem) {
  const int groups = (v.world_size + kScanRanks - 1) / kScanRanks;
  const int c = b / groups, r0 = (b % groups) * kScanRanks;
  const int t = c * kRouteThreads + threadIdx.x;
  int rank_of[kMaxK];  // each copy's rank, -1 past k or for an id out of range
#pragma unroll
  for (int i = 0; i < kMaxK; ++i) rank_of[i] = -1;
  if (t < tokens) {
    int32_t e[kMaxK];
#pragma unroll
    for (int i = 0; i < kMaxK; ++i) {
      if (i < v.topk) e[i] = IdAt(a, int64_t{t} * v.topk + i);
    }
#pragma unroll
    for (int i = 0; i < kMaxK; ++i) {
      if (i >= v.topk) break;
      e[i] = MaskId(v, e[i]);
      if (ValidExpert(v, e[i])) {
        rank_of[i] = RankOf(v, e[i]);
      } else if (r0 == 0 && BadExpert(v, e[i])) {
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
    const uint32_t slots = h == 0 ? 0 : (v.modes.once() ? 1 : h);
    const uint32_t rows = h == 0 ? 0 : (v.modes.reduce() ? 1 : h);
    mine.v[q] = slots | rows << 16;
  }
  RouteScan(smem.scan).ExclusiveSum(mine, mine, chunk);
#pragma unroll
  for (int q = 0; q < kScanRanks; ++q) {
    const int r = r0 + q;
    if (r >= v.world_size) break;
    if (t < tokens) {
      v.slot_pos[int64_t{r} * v.max_tokens + t] = static_cast<int32_t>(mine.v[q] & 0xFFFF);
      v.row_pos[int64_t{r} * v.max_tokens + t] = static_cast<int32_t>(mine.v[q] >> 16);
    }
    if (threadIdx.x == 0) {
      v.scan_carry[int64_t{c} * v.world_size + r] =
          (chunk.v[q] & 0xFFFF) | int64_t{chunk.v[q] >> 16} << 32;
    }
  }
  if (!LastBlock(&v.scratch->tickets[3], false, v.scan_blocks)) return;
  const int chunks = v.scan_blocks / groups;
  for (int r = threadIdx.x; r < v.world_size; r += blockDim.x) {
    int64_t sum = 0;
    for (int c0 = 0; c0 < chunks; c0 += 8) {  // eight chunks' sums loaded at once
      int64_t here[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (c0 + u < chunks) here[u] = __ldcg(&v.scan_carry[int64_t{c0 + u} * v.world_size + r]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (c0 + u >= chunks) break;
        v.scan_carry[int64_t{c0 + u} * v.world_size + r] = sum;
        sum += here[u];
      }
    }
    v.totals[r] = static_cast<int32_t>(sum & 0xFFFFFFFF);
    v.totals[v.world_size + r] = static_cast<int32_t>(sum >> 32);
  }
}

// Chunk c's block: entries [c * kChunk, (c + 1) * kChunk) of the (token, k) list. Gives each
// copy its rank among the chunk's copies for its expert, in entry order, and the chunk's count
// per expert. Warp w takes entries [w, w + 1) * 32 * kSortItems of the chunk, 32 at a time:
// copies of one expert within 32 entries find each other with one match, and a warp's running
// count per expert lives in shared memory (per_warp); then a prefix over the warps per expert
// turns those into each warp's start. Also copies the routing for the later steps.
__device__ void CountChunk(const Nv& v, const SendArgs& a, int tokens, int c, RouteSmem& smem) {
  const int64_t first = int64_t{c} * kChunk, entries = int64_t{tokens} * v.topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint16_t* mine = smem.per_warp[warp];
  for (int i = threadIdx.x; i < kRouteWarps * v.experts; i += blockDim.x) {
    smem.per_warp[i / v.experts][i % v.experts] = 0;
  }
  __syncthreads();
  int32_t key[kSortItems];   // the expert, -1 past the end or for an id out of range
  int32_t rank[kSortItems];  // among the warp's copies of that expert so far
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int64_t f = first + (warp * kSortItems + j) * 32 + lane;
    key[j] = -1;
    if (f < entries) {
      const int32_t e = MaskId(v, IdAt(a, f));
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
  int32_t* counts = v.chunk_counts + int64_t{c} * v.experts;
  for (int e = threadIdx.x; e < v.experts; e += blockDim.x) {  // each warp's start per expert
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

// Blocks [0, scan_blocks): ScanChunk; the next v.chunks: CountChunk. CudaTuning::trace points: 1 a
// token chunk scanned, 2 a chunk counted (times relative to the first Pack block in the
// printout).
namespace dispatch {
__global__ void __launch_bounds__(kRouteThreads) RouteKernel(Nv v, SendArgs a) {
  __shared__ RouteSmem smem;
  LaunchDependents();  // Pack's blocks take their SMs and wait for us there
  Mark(v, kTraceRoute, 0);
  PublishMasks(v);
  const int tokens = SendTokens(v, a);
  if (blockIdx.x < v.scan_blocks) {
    ScanChunk(v, a, tokens, blockIdx.x, smem);
    Mark(v, kTraceRoute, 1);
  } else {
    CountChunk(v, a, tokens, blockIdx.x - v.scan_blocks, smem);
    Mark(v, kTraceRoute, 2);
  }
}
}  // namespace dispatch

// Where slot j of ours for rank r goes: pushed to r (its private region, or our outbox section
// for it) while j < r's slot cap, else into our send area (grouped by receiving rank, at `start`
// for r) for r to pull. Our own slots stay in the send area.
__device__ inline uint8_t* SlotDst(const Nv& v, int r, int64_t j, int64_t start,
                                   uint8_t* slots, int32_t slot_cap) {
  if (r != v.rank && j < slot_cap) return slots + j * v.slot_bytes;
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
  for (int base = 0; base < v.scales_per_token; base += 4 * 32) {
    float scale[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + lane + 32 * u;
      if (i < v.scales_per_token) scale[u] = a.scales[int64_t{t} * v.scales_per_token + i];
    }
    for (int slot = 0; slot < ns; ++slot) {
      auto* d = reinterpret_cast<float*>(dst[slot] + v.meta_bytes + v.payload);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + lane + 32 * u;
        if (i < v.scales_per_token) d[i] = scale[u];
      }
    }
  }
}

// A warp per token: token t goes to warp t / grid of block t % grid (consecutive tokens on
// different SMs), which loads the row's first batch, lays out the token's slots rank by rank
// (SlotDst; lane j places the token's j-th copy, its slot's first lane writes the header), then
// stores the row into every slot. Block 0 writes the counts rows into every rank first; every
// block arrives at every rank's dispatch flag.
// CudaTuning::trace points (as DispatchSend): 1 offsets, 2 counts rows out, 3 and 4 warp 0's laying
// out and copying summed over its tokens (spans, not times), 5 loop done, 6 arrived.
namespace dispatch {
__global__ void __launch_bounds__(kCopyThreads) PackKernel(Nv v, SendArgs a) {
  extern __shared__ int64_t starts[];  // [2N]: first slot per receiving rank in our send area,
                                       // first combine row per expert rank
  __shared__ uint8_t* dst_of[kCopyThreads / 32][kMaxK];  // each warp's token's slots
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;  // Route started after the epoch's last step ended
  Mark(v, kTraceSend, 0);
  WaitPrimary();  // Route's output
  const int tokens = v.scratch->tokens;
  int64_t* row_starts = starts + v.world_size;
  PrefixTotals(v.totals, v.world_size, starts);
  PrefixTotals(v.totals + v.world_size, v.world_size, row_starts);
  Mark(v, kTraceSend, 1);
  if (blockIdx.x == 0) {  // our counts row into every rank, before block 0 arrives
    WriteCountsRows(v, epoch, [&](int r, int c) {
      if (c == v.local_experts + kColSlots) return int64_t{v.totals[r]};
      if (c == v.local_experts + kColSendStart) return starts[r];
      if (c == v.local_experts + kColRowStart) return row_starts[r];
      if (c == v.local_experts + kColRows) return int64_t{v.totals[v.world_size + r]};
      int64_t value = 0;
      for (int ch = 0; ch < v.chunks; ++ch) {
        value += v.chunk_counts[int64_t{ch} * v.experts + r * v.local_experts + c];
      }
      return value;
    }, [&](int r) { return PeerCountsDst(v, r); });
  }
  Mark(v, kTraceSend, 2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t** dst = dst_of[warp];
  long long route_cycles = 0, copy_cycles = 0;  // CudaTuning::trace: summed over the tokens
  for (int t = blockIdx.x + warp * gridDim.x; t < tokens; t += gridDim.x * (kCopyThreads / 32)) {
    const long long loop_start = v.trace ? clock64() : 0;
    uint4 batch[kLaneVectors];
    LoadRowBatch(v, a, t, 0, batch);  // in flight while the slots are laid out
    const LaneRoute x = RouteLane(v, v.indices + int64_t{t} * v.topk);
    int32_t row_pos = 0;  // the token's first combine row among those from rank x.r
    if (x.valid) {
      const int64_t f = int64_t{t} * v.topk + lane;
      int32_t pos = v.erank[f];
      for (int c = 0; c < f / kChunk; ++c) pos += v.chunk_counts[int64_t{c} * v.experts + x.e];
      const int r = x.r;
      const int o = v.modes.once() ? 0 : x.within;  // which of the token's slots for rank r
      const int64_t carry = v.scan_carry[int64_t{t / kRouteThreads} * v.world_size + r];
      const int64_t j = v.slot_pos[int64_t{r} * v.max_tokens + t] + (carry & 0xFFFFFFFF) + o;
      row_pos = static_cast<int32_t>(v.row_pos[int64_t{r} * v.max_tokens + t] + (carry >> 32));
      uint8_t* d = SlotDst(v, r, j, starts[r]);
      const SlotEntry entry{LocalOf(v, x.e), lane, v.weights[f], pos};
      reinterpret_cast<SlotEntry*>(d + sizeof(SlotHeader))[v.modes.once() ? x.within : 0] = entry;
      if (!v.modes.once() || x.first) {
        const int32_t row = static_cast<int32_t>(row_starts[r] + row_pos +
                                                 (v.modes.once() || v.modes.reduce() ? 0 : o));
        *reinterpret_cast<SlotHeader*>(d) =
            SlotHeader{t, v.modes.once() ? x.hits : 1, row, static_cast<int16_t>(o),
                     static_cast<int16_t>(v.modes.once() ? 1 : x.hits)};
        dst[v.modes.once() ? x.ranks_before : x.lanes_before + x.within] = d;
      }
    }
    const int ns = __popc(v.modes.once() ? x.firsts : x.valids);
    __syncwarp();  // every lane read row_pos before it is completed for CombineRecv
    if (x.first) v.row_pos[int64_t{x.r} * v.max_tokens + t] = row_pos;
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
}  // namespace dispatch

// ---- fp8 made from bf16 as DispatchSend sends (DispatchInput::x_bf16) ---------------------------

// A warp per 128-column group of a row, four columns a lane: the group's largest |x| by shuffle,
// its scale as the host's QuantizeFp8Rows takes it (Fp8GroupScale), each element divided by it
// with round-to-nearest (__fdiv_rn: the host's IEEE division) and converted as FloatToE4M3 does.
// Rows past the device token count (when one is given) are left alone: nobody reads them.
constexpr int kQuantizeThreads = 256;
namespace dispatch {
__global__ void __launch_bounds__(kQuantizeThreads)
    QuantizeKernel(const uint16_t* x, int rows, int hidden, const int32_t* dev_tokens,
                   Fp8Scaling scaling, uint8_t* out, float* scales) {
  const int groups = hidden / 128, lane = threadIdx.x % 32;
  const int64_t group = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int row = static_cast<int>(group / groups), g = static_cast<int>(group % groups);
  const int limit = dev_tokens ? min(rows, *dev_tokens) : rows;
  if (row >= limit) return;  // whole warps: a group's lanes share row and g
  const int64_t first = int64_t{row} * hidden + g * 128 + lane * 4;
  const uint2 packed = *reinterpret_cast<const uint2*>(x + first);
  float v[4];
  v[0] = __uint_as_float(packed.x << 16);
  v[1] = __uint_as_float(packed.x & 0xFFFF0000u);
  v[2] = __uint_as_float(packed.y << 16);
  v[3] = __uint_as_float(packed.y & 0xFFFF0000u);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, d));
  const float s = Fp8GroupScale(amax, scaling);
  uint32_t q = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t byte = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], s), __NV_SATFINITE, __NV_E4M3);
    q |= byte << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(out + first) = q;
  if (lane == 0) scales[int64_t{row} * groups + g] = s;
}
}  // namespace dispatch

}  // namespace ferry::moe::nv
