// The device helpers every NVLink kernel uses: flags, fences and errors, programmatic dependent
// launch, phase stamps, waits with deadlines and masks, arrivals, a token's routing, claims. The
// host side never includes this file (it needs only nvlink_protocol.cuh's structs); the kernel
// headers (nvlink_send.cuh, nvlink_recv.cuh, nvlink_combine.cuh) do. Design in cuda_device.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe/cuda/nvlink_protocol.cuh"

namespace ferry::moe::nv {

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

// Phase stamps (CudaTuning::trace; the slots in nvlink_protocol.cuh).
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

// Whether rank r is heard from (Nv::heard: its heartbeats, as the host last mirrored them).
__device__ inline bool HeardRank(const Nv& v, int r) {
  return v.heard && reinterpret_cast<const volatile int32_t*>(v.heard)[r] != 0;
}

// After a budget rank r missed under mask_lost_peers: whether its flag came while r stayed
// heard from, within kLateWaits more budgets from `start` (a rank late because it waited for a
// lost one, under node-once: moe/liveness.h). False: r is lost. The wait is added to cost[r].
__device__ inline bool AwaitHeard(const Nv& v, int64_t* cost, const uint64_t* flag,
                                  uint64_t want, uint64_t start, uint64_t budget_ns, int r) {
  const long long begin = clock64();
  bool came = false;
  while (HeardRank(v, r) && GlobalTimerNs() - start <= (1 + kLateWaits) * budget_ns &&
         !*reinterpret_cast<volatile int32_t*>(&v.scratch->abort)) {
    if ((came = Reached(LoadAcquire(flag), want))) break;
  }
  if (cost) {
    atomicAdd(reinterpret_cast<unsigned long long*>(cost + r),
              static_cast<unsigned long long>(clock64() - begin));
  }
  return came;
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
    const bool may_mask = v.modes.mask_lost() && r != v.rank;
    if (AwaitCounted(v, cost, flag, want, start, budget_ns, which, r, may_mask)) continue;
    if (!may_mask || *reinterpret_cast<volatile int32_t*>(&v.scratch->abort)) return false;
    if (AwaitHeard(v, cost, flag, want, start, budget_ns, r)) continue;
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
  if (v.first_remote < 0 && !v.modes.mask_lost()) return WaitAll(v, epoch, budget_ns, which, cost);
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
    if (GlobalTimerNs() - start > (v.heard ? 1 + kLateWaits : 1) * budget_ns + 1000000000) {
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
  if (!v.modes.counts_tagged()) return;
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
  if (!v.modes.stream()) return;
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
