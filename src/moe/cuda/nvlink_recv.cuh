// DispatchRecv's kernel, Unpack: each received slot (pushed into our private region, pulled from
// its sender's send area, or our own) into the caller's expert-major or token-major rows, and
// where each combine row returns. Shared parts in nvlink_protocol.cuh; the design in
// cuda_device.h. Included by cuda_device_launch.cu only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "moe/cuda/nvlink_device.cuh"

namespace ferry::moe::nv {

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
  for (int q = threadIdx.x; q < v.world_size; q += blockDim.x) {
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
  uint64_t epoch, wait_start, budget_ns;
};

// offset[s][e]: rows of local expert e from senders before s (offset[N][e]: all of them), from
// every sender's counts row; block 0 also notes the epoch's received slots for CombineSend.
// Ends with a block barrier.
// The expert bases after the offsets table, 8-byte aligned.
__device__ inline int64_t* ExpertBase(const Nv& v, int32_t* offset) {
  return reinterpret_cast<int64_t*>(offset +
                                    (int64_t{v.world_size + 1} * v.local_experts + 1) / 2 * 2);
}

// base[e] (after offset's [N + 1][L]): expert e's first output row -- e * block (the
// expert's block rows: capacity, or DispatchOutput::expert_rows), or with expert padding p the
// sum over experts before it of their rows rounded up to p (one thread: a prefix over the
// local experts).
__device__ inline void BuildOffsets(const Nv& v, const int32_t* counts, int32_t* offset,
                                    int64_t total, int32_t padding, int64_t block) {
  for (int e = threadIdx.x; e < v.local_experts; e += blockDim.x) {
    int32_t rows = 0;
    for (int q = 0; q < v.world_size; ++q) {
      offset[q * v.local_experts + e] = rows;
      rows += counts[q * v.counts_stride + e];
    }
    offset[v.world_size * v.local_experts + e] = rows;
  }
  int64_t* base = ExpertBase(v, offset);
  if (padding == 0) {
    for (int e = threadIdx.x; e < v.local_experts; e += blockDim.x) {
      base[e] = int64_t{e} * block;
    }
  } else {
    __syncthreads();  // every total in
    if (threadIdx.x == 0) {
      int64_t next = 0;
      for (int e = 0; e < v.local_experts; ++e) {
        base[e] = next;
        next +=
            (int64_t{offset[v.world_size * v.local_experts + e]} + padding - 1) / padding * padding;
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    v.scratch->total_recv = static_cast<int32_t>(total);
    v.scratch->rows_out = 0;
  }
  __syncthreads();
}

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

// Unpack's received slots for groups of kGroup threads, each thread keeping kVec 16-byte
// vectors in flight: a group's visits are blockIdx.x + group * grid, + grid * groups ..., each
// taking slot `visit` (streamed: in order as claimed). Checks each slot, copies its row to each
// entry's output row, remembers where the entries' combine rows go. Builds the offsets table
// first where the kernel has not (the whole block, while each group's first slot loads).
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
  int32_t* offset = t.offset;
  // Vectors [0, used): header and entries; [used, meta): padding, not loaded; [meta, body):
  // the row; [body, end): the scales. Tested in 32 bits, a slot being far below 2^31 vectors
  // (with a block per slot, one block of 8 warps per SM in decode, every dependent
  // instruction's latency shows).
  using Index = int32_t;
  const Index used = static_cast<Index>(v.meta_used / 16);
  const Index meta = static_cast<Index>(v.meta_bytes / 16);
  const Index body = meta + static_cast<Index>(v.payload / 16);
  const Index end =
      static_cast<Index>((v.meta_bytes + v.payload + int64_t{v.scales_per_token} * 4 + 15) / 16);
  constexpr Index kBatch = Index{kVec} * kGroup;
  // Received slot g: its sender s, its index j among s's, where it is. Ours from our send area;
  // then what s pushed; the rest pulled from s's send area (a slot past what s may push to a
  // rank without a send area to pull from is malformed: null).
  int s = 0;
  int64_t j = 0;
  auto locate = [&](int64_t g) -> const uint4* {
    s = SenderOf(prefix, v.world_size, g);
    j = g - prefix[s];
    const PeerIn& from = from_of[s];
    const uint8_t* src = s == v.rank        ? v.own + v.send_off + (start[s] + j) * v.slot_bytes
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
      const bool pulled = s != v.rank && j >= from.slot_cap;
      const uint64_t* word =
          pulled ? from.dispatch_flag
                 : reinterpret_cast<const uint64_t*>(reinterpret_cast<const uint8_t*>(src4) +
                                                     SlotTagOffset(v));
      const uint64_t want = (t.epoch + 1) * uint64_t(pulled ? from.dispatch_step : 1);
      ok = AwaitCounted(v, a.wait_cost, word, want, t.wait_start, t.budget_ns, 0, s);
    }
    return GroupAll<kGroup>(ok);
  };
  // One round trip for the slot's first batch (metadata and, usually, the whole slot).
  uint4 r[kVec];
  auto load = [&](const uint4* src4, Index first) {
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      const Index i = first + tid + u * Index{kGroup};
      if (i < end && (i < used || i >= meta)) r[u] = __ldcg(src4 + i);
    }
  };
  const int64_t first_visit = blockIdx.x + int64_t{group} * gridDim.x;
  const int64_t step = int64_t{gridDim.x} * kGroups;
  int64_t visit = first_visit;
  // The first slot in flight while the offsets table is built, if not yet (streamed: once it
  // is there, after the table).
  const uint4* src4 = visit < total && !kStream ? locate(visit) : nullptr;
  if (src4) load(src4, 0);
  Mark(v, kTraceUnpack, 3);

  if (!v.modes.counts_tagged()) {  // tagged, the kernel built it from the rows before the flags
    BuildOffsets(v, t.counts, t.offset, total, a.padding, a.expert_rows);
    Mark(v, kTraceUnpack, 4);
  }
  bool primary_done = false, marked = false;
  if constexpr (kStream) visit = Claim<kGroup>(&v.scratch->claimed);
  for (; visit < total; visit = kStream ? Claim<kGroup>(&v.scratch->claimed) : visit + step) {
    const int64_t g = visit;
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
      const Index i = tid + u * Index{kGroup};
      if (i < used) meta_v[i] = r[u];
    }
    GroupSync<kGroup>();
    // Checks in parallel: the header by every thread, entry i by thread i.
    SlotHeader header;
    std::memcpy(&header, &meta_v[0], sizeof header);
    const int entries = min(max(header.entries, 0), v.topk);
    // The combine row, counted from where our rows for s go (rebased for another node).
    const int64_t row = header.row - rebase[s];
    const SlotLimits limits{v.topk, v.local_experts, v.max_tokens,
                            v.modes.reduce(), from.row_cap, v.capacity};
    bool valid = SlotHeaderValid(header, row, limits);
    bool fits = true;  // within its expert's block (a copy past it is dropped, not malformed)
    if (tid < entries) {
      SlotEntry entry;
      std::memcpy(&entry, &meta_v[1 + tid], sizeof entry);
      const int32_t le = entry.local_expert;
      valid = valid && SlotEntryValid(entry, offset, s, limits);
      if (valid) {
        const int64_t at = int64_t{offset[s * v.local_experts + le]} + entry.pos;
        const int64_t expert_row = ExpertBase(v, offset)[le] + at;
        fits = v.modes.token_major() || a.padding != 0 || at < a.expert_rows;
        valid = valid && (v.modes.token_major() || expert_row < a.out_rows);
        out_row[tid] = v.modes.token_major() ? g : expert_row;
        // CombineSend's entries; token-major it copies row g and reads none.
        if (!v.modes.token_major()) {
          v.rentries[g * v.topk + tid] = RecvEntry{expert_row, entry.weight};
        }
      }
    }
    valid = GroupAll<kGroup>(valid);
    // Only a block smaller than the capacity can overflow: the vote is skipped otherwise (the
    // condition is the same for the whole group).
    const bool placed = valid && (a.expert_rows >= v.capacity || GroupAll<kGroup>(fits));
    if (!marked) Mark(v, kTraceUnpack, 5);
    marked = true;
    if (tid == 0) {
      if (!valid) Report(v, kBadSlot, s, static_cast<int32_t>(j));
      v.rslots[g] = RecvSlot{s, static_cast<int32_t>(row), placed ? entries : 0, header.part,
                             header.parts};
    }
    // Token-major: the slot is one output row, and column c of its experts and weights is the
    // entry whose k is c (thread c looks for it), or none.
    const int outs = placed ? (v.modes.token_major() ? 1 : entries) : 0;
    if (!primary_done) {  // the caller's memory from here on (a.out_x, a.out_scales, ...)
      if (!kStream) WaitPrimary();  // streamed: see UnpackKernel
      primary_done = true;
    }
    // Each placed row's token, as its sender numbers it, and its sender
    // (DispatchOutput::source_tokens, source_ranks); token-major out_row[0] is g.
    if (tid < outs) {
      if (a.source_tokens) a.source_tokens[out_row[tid]] = header.src_token;
      if (a.source_ranks) a.source_ranks[out_row[tid]] = s;
    }
    if (v.modes.token_major() && valid && tid < v.topk) {
      int32_t expert = -1;
      float weight = 0.0f;
      for (int i = 0; i < entries; ++i) {
        SlotEntry entry;
        std::memcpy(&entry, &meta_v[1 + i], sizeof entry);
        if (entry.k == tid) {
          expert = entry.local_expert;
          weight = entry.weight;
        }
      }
      if (a.token_experts) a.token_experts[g * v.topk + tid] = expert;
      if (a.token_experts64) a.token_experts64[g * v.topk + tid] = expert;
      a.token_weights[g * v.topk + tid] = weight;
    }
    // The slot's vectors into every entry's output row (the row, then its scales), batch by
    // batch for slots longer than one. Which of a thread's vectors are row and which scales
    // is decided once per batch, as bit masks (tested per entry and vector, the bounds were
    // most of the loop's instructions).
    for (Index first = 0; outs > 0 && first < end; first += kBatch) {
      if (first > 0) load(src4, first);
      uint32_t in_row = 0, in_scales = 0;
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const Index i = first + tid + u * kGroup;
        if (i >= meta && i < body) in_row |= 1u << u;
        if (i >= body && i < end) in_scales |= 1u << u;
      }
      // Vector u's index in the row, and its first scale (either negative for a vector that is
      // neither).
      const Index at = first + tid - meta, scale_at = (first + tid - body) * 4;
      for (int e = 0; e < outs; ++e) {
        uint4* x = reinterpret_cast<uint4*>(a.out_x + out_row[e] * v.payload);
        float* scales = a.out_scales + out_row[e] * v.scales_per_token;
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
          if (in_row & (1u << u)) x[at + u * kGroup] = r[u];
          if (in_scales & (1u << u)) {
            StoreScales(scales, scale_at + u * kGroup * 4, v.scales_per_token, r[u]);
          }
        }
      }
    }
    GroupSync<kGroup>();  // the shared slot metadata is rewritten for the next one
  }
}

// Every block reads every sender's counts row once its tag is up (one node; with other nodes,
// once every dispatch flag is), builds the offsets table, waits for all dispatch flags, then
// takes its share of the received slots (UnpackSlots). Trace points: 1 counts rows there, 2 read,
// 4 offsets built, 7 flags seen (one node), 3 first slot's loads issued, 5 it is checked.
// Streamed, it waits for each slot as it takes it instead of for the flags,
// and it does not wait for the kernel before it (our send kernel, which may still be storing
// slots) to end before writing the caller's outputs: what made WaitPrimary needed -- a kernel of
// the caller's that still reads them -- ended before our send kernel started (Route and
// SendSmall launch plainly), and every block saw our own counts row, which that kernel stored.
// A kernel the caller enqueues between DispatchSend and DispatchRecv ends before this one starts
// unless it lets dependents start early itself.
// Two blocks per SM (128 registers): one beside a Pack block when streamed, and otherwise two
// of Unpack's own.
// kMasks: see Arrive.
namespace dispatch {
template <bool kStream, bool kMasks>
__global__ void __launch_bounds__(kCopyThreads, 2) UnpackKernel(Nv v, RecvArgs a) {
  extern __shared__ int64_t unpack_raw[];  // [N] PeerIn; [N + 1] slots before sender s; [N]
                                           // start[s] (where they start in its send area); [N]
                                           // rebase[s] (the first combine row s expects from
                                           // us, if remote); then counts[N][counts_stride];
                                           // then offset[N + 1][L]
  PeerIn* from_of = reinterpret_cast<PeerIn*>(unpack_raw);
  int64_t* prefix = unpack_raw + v.world_size * (sizeof(PeerIn) / 8);
  int64_t* start = prefix + v.world_size + 1;
  int64_t* rebase = start + v.world_size;
  int32_t* counts = reinterpret_cast<int32_t*>(  // 16-byte aligned
      reinterpret_cast<uint8_t*>(prefix) + ((3 * int64_t{v.world_size} + 1) * 8 + 15) / 16 * 16);
  // offset[s][e]: rows of local expert e from senders before s (offset[N][e]: all of them).
  int32_t* offset = counts + v.world_size * v.counts_stride;
  __shared__ bool ok;
  Mark(v, kTraceUnpack, 0);
  const uint64_t epoch = v.scratch->epoch;
  const uint64_t wait_start = GlobalTimerNs();
  LoadPeersIn(v, from_of);  // while thread 0 waits: no table load on the path after the flags
  // Every sender's counts row, a thread per sender waiting for its tag.
  if (v.modes.counts_tagged()) {
    bool there = true;
    int64_t* cost = blockIdx.x == 0 ? a.wait_cost : nullptr;  // every block waits the same
    for (int q = threadIdx.x; q < v.world_size; q += blockDim.x) {
      const NvPeer& p = v.peer[q];
      there = there && ((kMasks && q != v.rank && MaskedRank(v, q)) ||
                        AwaitCounted(v, cost,
                                     reinterpret_cast<const uint32_t*>(p.counts_in +
                                                                       CountsTagColumn(v)),
                                     static_cast<uint32_t>(epoch + 1), wait_start, a.timeout_ns,
                                     0, q));
    }
    if (!__syncthreads_and(there)) return;
  } else {
    if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 0, a.wait_cost);
    __syncthreads();
    if (!ok) return;
  }
  Mark(v, kTraceUnpack, 1);
  // Every sender's counts row in one round trip (16-byte vectors; from another node they are in
  // host memory, where every small load is a PCIe transaction).
  const int vectors = v.counts_stride / 4;
  for (int i = threadIdx.x; i < v.world_size * vectors; i += blockDim.x) {
    const int q = i / vectors;
    reinterpret_cast<uint4*>(counts + q * v.counts_stride)[i % vectors] =
        __ldcg(reinterpret_cast<const uint4*>(from_of[q].counts) + i % vectors);
  }
  __syncthreads();
  // A masked sender sent nothing we read: its row as zeros (no copies, no slots, no rows). Every
  // block reads the same masks: they change during a step only in the wait above, which under
  // mask_lost_peers block 0 alone decides before the others pass it (WaitStep).
  if (kMasks) {
    for (int i = threadIdx.x; i < v.world_size * v.counts_stride; i += blockDim.x) {
      const int q = i / v.counts_stride;
      if (q != v.rank && MaskedRank(v, q)) counts[i] = 0;
    }
    __syncthreads();
  }
  Mark(v, kTraceUnpack, 2);
  // Where each sender's slots are: the block's first slot is then in flight while the offsets
  // table is built.
  for (int s = threadIdx.x; s < v.world_size; s += blockDim.x) {
    const int32_t* row = counts + s * v.counts_stride;
    int64_t slots = row[v.local_experts + kColSlots];
    if (slots < 0 || slots > v.slots_per_pair) {  // none of them is taken
      if (blockIdx.x == 0) Report(v, kBadSlot, s, static_cast<int32_t>(slots));
      slots = 0;
    }
    prefix[s + 1] = slots;
    start[s] = row[v.local_experts + kColSendStart];
    rebase[s] = from_of[s].remote ? row[v.local_experts + kColRowStart] : 0;
    if (blockIdx.x == 0 && from_of[s].relay_rows) {  // for the relay's combine write (relay.h)
      from_of[s].relay_rows[0] = row[v.local_experts + kColRowStart];
      from_of[s].relay_rows[1] = row[v.local_experts + kColRows];
      __threadfence_system();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int s = 0; s < v.world_size; ++s) prefix[s + 1] += prefix[s];
  }
  __syncthreads();
  const int64_t total = prefix[v.world_size];
  // Counts rows from their tags: the offsets table now, then (not streamed) every send block's
  // arrival -- the table no longer waits behind the senders' last slots.
  if (v.modes.counts_tagged()) {
    BuildOffsets(v, counts, offset, total, a.padding, a.expert_rows);
    Mark(v, kTraceUnpack, 4);
    if (!kStream) {
      if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 0, a.wait_cost);
      __syncthreads();
      if (!ok) return;
      Mark(v, kTraceUnpack, 7);
    }
  }
  // Few slots (decode): a block per slot, the slot's vectors spread over the block. More slots
  // than blocks (prefill): a warp per slot, eight slots in flight per block, a lane's eight
  // vectors loaded at once -- one block copying slot after slot waits on each slot's load.
  // (Sixteen per lane take the kernel past 128 registers, one block per SM, or spill.)
  const SlotTables tables{from_of, prefix, start,      rebase,     counts,
                          offset,  epoch,  wait_start, a.timeout_ns};
  // A block per slot keeps two vectors per thread in flight (fp8 rows of hidden 7168, 470
  // vectors, fit in one batch; longer slots take more): four cost their bounds tests on
  // vectors past the slot's end, and a third instance, four where two do not fit, made the
  // kernel spill and a warp per slot 20 % slower.
  // Streamed, the grid is what fits at once (PlanGrids) and blocks claim slot after slot: a
  // block per slot up to two slots a block (two ranks on half a GPU's SMs each: a warp per slot
  // was 2.5-3 us slower expert-major, eight output rows a slot).
  if (total > (kStream ? 2 : 1) * int64_t{gridDim.x}) {
    UnpackSlots<32, 8, kStream>(v, a, tables, total);
  } else {
    UnpackSlots<kCopyThreads, 2, kStream>(v, a, tables, total);
  }
  if (blockIdx.x == 0) {
    if (!kStream) WaitPrimary();
    if (v.modes.token_major() && threadIdx.x == 0) *a.num_rows = static_cast<int32_t>(total);
    for (int e = threadIdx.x; e < v.local_experts; e += blockDim.x) {
      const int32_t rows = offset[v.world_size * v.local_experts + e];
      a.num_tokens[e] = rows;
      for (int s = 0; a.sender_ranges && s < v.world_size; ++s) {
        a.sender_ranges[int64_t{e} * v.world_size + s] =
            SenderRange(offset, v.local_experts, s, e);
      }
      if (rows > v.capacity) {
        Report(v, kRowOverrun, -1, e);
      } else if (!v.modes.token_major() && a.padding == 0 && rows > a.expert_rows) {
        Report(v, kExpertFull, rows, e);
      }
    }
  }
  Mark(v, kTraceUnpack, 6);
}
}  // namespace dispatch

}  // namespace ferry::moe::nv
