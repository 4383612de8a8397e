// DispatchSend in one kernel for decode batches (SendSmall: the routing's scan, the slots and the
// rows of up to kSmallEntries copies, in shared memory), over the helpers of nvlink_send.cuh. The
// design in cuda_device.h. Included by cuda_device_launch.cu only.
#pragma once

#include <cstdint>

#include "moe/cuda/nvlink_send.cuh"

namespace ferry::moe::nv {

// Dynamic shared memory of SendSmallKernel. "Before": in the entries of tokens before the
// block's first token.
struct SmallSmem {
  int64_t* starts;         // [N] first slot per receiving rank in our send area
  int64_t* row_starts;     // [N] first combine row per expert rank
  uint8_t** peer_slots;    // [N] v.peer[r].slots, loaded at the start (SlotDst)
  CountsDst* peer_counts;  // [N] block 0: where its counts rows go, loaded at the start
  int32_t* peer_cap;       // [N] v.peer[r].slot_cap
  int32_t* slots;          // [N] our slots per receiving rank
  int32_t* rows;           // [N] combine rows per expert rank
  int32_t* copies_before;  // [N] copies for rank r
  int32_t* tokens_all;     // [N] tokens with a copy for rank r
  int32_t* tokens_before;  // [N]
  int32_t* hist;           // [E] copies per expert
  int32_t* hist_before;    // [E]
  int32_t* idx;            // [T * K] the routing, as given
};
__host__ __device__ inline size_t SmallSmemBytes(int n, int e, int64_t entries) {
  return size_t(n) * (3 * sizeof(int64_t) + sizeof(CountsDst) + 6 * sizeof(int32_t)) +
         (2 * size_t(e) + size_t(entries)) * sizeof(int32_t);
}
__device__ inline SmallSmem CarveSmallSmem(void* raw, int n, int e) {
  SmallSmem m;
  m.starts = static_cast<int64_t*>(raw);
  m.row_starts = m.starts + n;
  m.peer_slots = reinterpret_cast<uint8_t**>(m.row_starts + n);
  m.peer_counts = reinterpret_cast<CountsDst*>(m.peer_slots + n);
  m.peer_cap = reinterpret_cast<int32_t*>(m.peer_counts + n);
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
  for (int i = f - v.div_topk.Mod(f); i < f; ++i) {
    if (ValidExpert(v, idx[i]) && RankOf(v, idx[i]) == r) return false;
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
// kMasks: see Arrive.
namespace dispatch {
template <bool kMasks>
__global__ void __launch_bounds__(kSmallThreads) SendSmallKernel(Nv v, SendArgs a) {
  extern __shared__ int64_t small_raw[];
  __shared__ uint8_t* dst_of[kSmallWarps][kMaxK];  // a token's slots (SlotDst)
  const SmallSmem m = CarveSmallSmem(small_raw, v.world_size, v.experts);
  LaunchDependents();
  const uint64_t epoch = v.scratch->epoch;
  Mark(v, kTraceSend, 0);
  if (kMasks) PublishMasks(v);
  const int tokens = SendTokens(v, a);
  const int entries = tokens * v.topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_token = (static_cast<int>(blockIdx.x) - 1) * kSmallWarps;

  for (int i = threadIdx.x; i < v.experts; i += blockDim.x) m.hist[i] = m.hist_before[i] = 0;
  for (int i = threadIdx.x; i < v.world_size; i += blockDim.x) {
    m.tokens_all[i] = m.tokens_before[i] = 0;
  }
  // The peers' slot areas (SlotDst), or in block 0 where its counts rows go: loaded now, stored
  // to shared memory once counted, so that no thread waits for them before its routing loads.
  uint8_t* peer_slots = nullptr;
  int32_t peer_cap = 0;
  CountsDst peer_counts{};
  if (threadIdx.x < v.world_size && blockIdx.x == 0) {
    peer_counts = PeerCountsDst(v, threadIdx.x);
  } else if (threadIdx.x < v.world_size) {
    peer_slots = v.peer[threadIdx.x].slots;
    peer_cap = v.peer[threadIdx.x].slot_cap;
  }
  for (int base = 0; base < entries; base += 8 * blockDim.x) {  // eight loads in flight
    int32_t ids[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int f = base + threadIdx.x + u * blockDim.x;
      if (f < entries) ids[u] = IdAt(a, f);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int f = base + threadIdx.x + u * blockDim.x;
      if (f < entries) m.idx[f] = kMasks ? MaskId(v, ids[u]) : ids[u];
    }
  }
  __syncthreads();
  Mark(v, kTraceSend, 1);
  // Thread per token. Tokens per rank: up to 32 ranks, a rank mask per token, transposed over
  // the warp so that lane r counts rank r's tokens (same-address shared atomics from a whole
  // warp serialise); beyond, atomics.
  bool bad = a.dev_tokens && *a.dev_tokens != tokens;
  for (int base = 0; base < tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool before = t < first_token;
    uint32_t ranks = 0;
    for (int f = t * v.topk; t < tokens && f < (t + 1) * v.topk; ++f) {
      const int32_t e = m.idx[f];
      if (!ValidExpert(v, e)) {
        if (BadExpert(v, e)) {
          bad = true;
          if (blockIdx.x == 0) Report(v, kBadExpert, t, e);
        }
        continue;
      }
      atomicAdd(&m.hist[e], 1);
      if (before) atomicAdd(&m.hist_before[e], 1);
      const int r = RankOf(v, e);
      if (v.world_size <= 32) {
        ranks |= 1u << r;
      } else if (FirstForRank(v, m.idx, f, r)) {
        atomicAdd(&m.tokens_all[r], 1);
        if (before) atomicAdd(&m.tokens_before[r], 1);
      }
    }
    if (v.world_size <= 32) {
      const uint32_t of_rank = TransposeBits(ranks);  // bit i: the warp's token i goes to `lane`
      const int early = min(max(first_token - (t - lane), 0), 32);  // its tokens before ours
      const int all = __popc(of_rank);
      const int all_early = __popc(of_rank & (early == 32 ? ~0u : (1u << early) - 1));
      if (lane < v.world_size && all) atomicAdd(&m.tokens_all[lane], all);
      if (lane < v.world_size && all_early) atomicAdd(&m.tokens_before[lane], all_early);
    }
  }
  if (__syncthreads_or(bad) && a.strict) return;  // nothing sent; the step may be retried
  Mark(v, kTraceSend, 2);

  for (int i = threadIdx.x; i < v.world_size; i += blockDim.x) {
    if (blockIdx.x == 0) {
      m.peer_counts[i] = i == threadIdx.x ? peer_counts : PeerCountsDst(v, i);
    } else {
      m.peer_slots[i] = i == threadIdx.x ? peer_slots : v.peer[i].slots;
      m.peer_cap[i] = i == threadIdx.x ? peer_cap : v.peer[i].slot_cap;
    }
  }
  // Copies per rank, from the expert counts.
  for (int r = warp; r < v.world_size; r += kSmallWarps) {
    int32_t all = 0, before = 0;
    for (int i = lane; i < v.local_experts; i += 32) {
      all += m.hist[r * v.local_experts + i];
      before += m.hist_before[r * v.local_experts + i];
    }
    all = __reduce_add_sync(~0u, all);
    before = __reduce_add_sync(~0u, before);
    if (lane == 0) {
      m.slots[r] = v.modes.once() ? m.tokens_all[r] : all;
      m.rows[r] = v.modes.reduce() ? m.tokens_all[r] : all;
      m.copies_before[r] = before;
    }
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix sums over the ranks, 32 at a time
    int64_t carry_slots = 0, carry_rows = 0;
    for (int b = 0; b < v.world_size; b += 32) {
      const int r = b + lane;
      const int64_t my_slots = r < v.world_size ? m.slots[r] : 0,
                    my_rows = r < v.world_size ? m.rows[r] : 0;
      int64_t slots = my_slots, rows = my_rows;
      for (int d = 1; d < 32; d *= 2) {
        const int64_t s2 = __shfl_up_sync(~0u, slots, d), r2 = __shfl_up_sync(~0u, rows, d);
        if (lane >= d) {
          slots += s2;
          rows += r2;
        }
      }
      if (r < v.world_size) {
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
    for (int r = threadIdx.x; r < v.world_size; r += blockDim.x) {  // for CombineRecv
      v.totals[r] = m.slots[r];
      v.totals[v.world_size + r] = m.rows[r];
    }
    WriteCountsRows(v, epoch, [&](int r, int c) {
      if (c == v.local_experts + kColSlots) return int64_t{m.slots[r]};
      if (c == v.local_experts + kColSendStart) return m.starts[r];
      if (c == v.local_experts + kColRowStart) return m.row_starts[r];
      if (c == v.local_experts + kColRows) return int64_t{m.rows[r]};
      return int64_t{m.hist[r * v.local_experts + c]};
    }, [&](int r) { return m.peer_counts[r]; });
  }
  Mark(v, kTraceSend, 3);

  const int t = first_token + warp;
  if (blockIdx.x > 0 && t < tokens) {
    // The row's first batch and the token's weights, in flight while the slots are laid out.
    uint4 batch[kLaneVectors];
    LoadRowBatch(v, a, t, 0, batch);
    const float weight = lane < v.topk ? a.weights[int64_t{t} * v.topk + lane] : 0.0f;

    // Lane j: the token's j-th copy. Counts over the block's earlier entries (its tokens before
    // this one, and this token's copies before j), 32 entries per ballot.
    const LaneRoute x = RouteLane(v, m.idx + t * v.topk);
    const int own = t * v.topk;
    int32_t pos = x.valid ? m.hist_before[x.e] : 0;
    int32_t rank_copies = x.valid ? m.copies_before[x.r] : 0;  // before token t, on its rank
    int32_t rank_tokens = x.valid ? m.tokens_before[x.r] : 0;
    for (int base = first_token * v.topk; base < own + v.topk; base += 32) {
      const int f = base + lane;
      const int32_t e = f < own + v.topk ? m.idx[f] : -1;
      const bool valid = ValidExpert(v, e);
      const int r = valid ? RankOf(v, e) : -1;
      const bool earlier = f < own;
      const bool first = valid && earlier && FirstForRank(v, m.idx, f, r);
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        if (j >= v.topk) break;
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
      const int o = v.modes.once() ? 0 : x.within;
      const int64_t j = (v.modes.once() ? rank_tokens : rank_copies) + o;
      uint8_t* d = SlotDst(v, r, j, m.starts[r], m.peer_slots[r], m.peer_cap[r]);
      const SlotEntry entry{LocalOf(v, x.e), lane, weight, pos};
      reinterpret_cast<SlotEntry*>(d + sizeof(SlotHeader))[v.modes.once() ? x.within : 0] = entry;
      if (!v.modes.once() || x.first) {
        const int32_t row_pos = v.modes.reduce() ? rank_tokens : rank_copies;
        const int32_t row = static_cast<int32_t>(m.row_starts[r] + row_pos +
                                                 (v.modes.once() || v.modes.reduce() ? 0 : o));
        *reinterpret_cast<SlotHeader*>(d) =
            SlotHeader{t, v.modes.once() ? x.hits : 1, row, static_cast<int16_t>(o),
                     static_cast<int16_t>(v.modes.once() ? 1 : x.hits)};
        dst_of[warp][v.modes.once() ? x.ranks_before : x.lanes_before + x.within] = d;
        if (x.first) v.row_pos[int64_t{r} * v.max_tokens + t] = row_pos;  // for CombineRecv
      }
    }
    const int ns = __popc(v.modes.once() ? x.firsts : x.valids);
    __syncwarp();

    StoreRowWarp(v, a, t, dst_of[warp], ns, batch);
    TagSlots(v, dst_of[warp], ns, epoch);
  }
  Mark(v, kTraceSend, 5);
  Arrive<kMasks>(v, false, epoch);
  Mark(v, kTraceSend, 6);
  // The routing for the combine steps, spread over the blocks, after the arrival (off the
  // critical path: only CombineSend and CombineRecv read it, behind this kernel in stream order).
  for (int f = blockIdx.x * blockDim.x + threadIdx.x; f < entries; f += gridDim.x * blockDim.x) {
    v.indices[f] = m.idx[f];
    v.weights[f] = a.weights[f];
  }
}
}  // namespace dispatch

}  // namespace ferry::moe::nv
