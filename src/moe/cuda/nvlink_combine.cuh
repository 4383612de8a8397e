// The combine's kernels: CombineSend (each received copy's expert output, or one weighted sum
// per token, pushed back into its sender's combine region) and CombineRecv (each token's
// returned rows summed into the caller's output), each also streamed. Shared parts in
// nvlink_protocol.cuh; the design in cuda_device.h. Included by cuda_device_launch.cu only.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "moe/cuda/nvlink_device.cuh"
#include "moe/numerics.h"

namespace ferry::moe::nv {

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

// Elem (moe/numerics.h): the combine row's element, one enum for both devices.

// A combine row's 16-byte vector: eight bf16 or fp16 values, or four fp32 ones, each widened
// to fp32 for the sums and rounded back to nearest even.
template <Elem kE>
struct CombineVec {
  static constexpr int kPer = 8;
  __device__ static float At(const uint4& v, int q) { return Bf16At(v, q); }
  __device__ static uint4 Pack(const float (&acc)[kPer]) { return PackBf16(acc); }
};
template <>
struct CombineVec<Elem::kFp16> {
  static constexpr int kPer = 8;
  __device__ static float At(const uint4& v, int q) {
    const uint32_t w = q < 2 ? v.x : q < 4 ? v.y : q < 6 ? v.z : v.w;
    const auto bits = static_cast<unsigned short>(q % 2 ? w >> 16 : w & 0xFFFF);
    return __half2float(__ushort_as_half(bits));
  }
  __device__ static uint4 Pack(const float (&acc)[kPer]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = uint32_t{__half_as_ushort(__float2half_rn(acc[2 * i]))} |
             uint32_t{__half_as_ushort(__float2half_rn(acc[2 * i + 1]))} << 16;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <>
struct CombineVec<Elem::kFp32> {
  static constexpr int kPer = 4;
  __device__ static float At(const uint4& v, int q) {
    return __uint_as_float(q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w);
  }
  __device__ static uint4 Pack(const float (&acc)[kPer]) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  }
};

// acc[u][c8[u]] (one vector's columns each, c8[u] < 0: none) += sum over c < count of weight[c]
// * rows[c][c8[u]], in c order, fp32, unfused: the host device's arithmetic. The loads of kR
// rows of all kG column groups are in flight at once.
template <Elem kE, int kG, int kR>
__device__ inline void WeightedSum(float (&acc)[kG][CombineVec<kE>::kPer],
                                   const uint4* const* rows, const float* weight, int count,
                                   const int64_t (&c8)[kG]) {
  using V = CombineVec<kE>;
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
        for (int q = 0; q < V::kPer; ++q) {
          acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w, V::At(vals[u][c], q)));
        }
      }
    }
  }
}

// Streamed combine: once the block stored rows [row, row + rows) of rank r's combine region,
// their tags "epoch + 1" (the barrier orders every thread's stores before the releases).
__device__ inline void TagRows(const Nv& v, int r, int64_t row, int rows, uint64_t epoch) {
  if (!v.modes.stream_combine()) return;
  __syncthreads();
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    StoreRelease(v.peer[r].combine_tags + row + i, epoch + 1);
  }
}

// Received slots again: each copy's expert output row (plain) or, summed at the expert rank, one
// weighted fp32 sum per token taken in (local expert, position) order as the host device does,
// pushed into the sender's combine region, in order (streamed, the order CombineRecv claims
// tokens in). Every block arrives at every rank's combine flag.
// Token-major, the caller summed each token's experts into row g of expert_out, which is copied
// as it is; kCopyOnly: an instance that only does that (few registers; see its launch). kE: the
// rows' element.
namespace combine {
template <bool kCopyOnly, Elem kE>
__global__ void __launch_bounds__(kCopyThreads) CombineSendKernel(Nv v, CombineArgs a) {
  using V = CombineVec<kE>;
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
    // A malformed slot (Unpack reported it and kept no entry) returns nothing: its row is not
    // one we checked, and a row written there could land on another token's.
    if (slot.entries == 0) continue;
    uint8_t* dst = v.peer[slot.sender].combine + int64_t{slot.row} * v.row_bytes;
    if (kCopyOnly || v.modes.token_major()) {
      CopyBytes(dst, a.expert_out + g * v.row_bytes, v.row_bytes);
      TagRows(v, slot.sender, slot.row, 1, epoch);
      if (slot.sender != v.rank) ++rows_out;
      continue;
    }
    if (!v.modes.reduce()) {
      for (int i = 0; i < slot.entries; ++i) {
        const RecvEntry entry = v.rentries[g * v.topk + i];
        CopyBytes(dst + i * v.row_bytes, a.expert_out + entry.out_row * v.row_bytes, v.row_bytes);
      }
      TagRows(v, slot.sender, slot.row, slot.entries, epoch);
      if (slot.sender != v.rank) rows_out += slot.entries;
      continue;
    }
    if (slot.part != 0) continue;  // the token's first slot sums them all
    // Warp 0 gathers the token's copies (lane i: entry i of this slot, or with one entry per
    // slot the token's i-th slot) and orders them by output row, i.e. (local expert, position),
    // ties in arrival order, as the host device sums them.
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int64_t h = v.modes.once() ? g : g + lane;
      bool exists = false;
      if (v.modes.once()) {
        exists = lane < slot.entries;
      } else if (lane < slot.parts && h < total) {
        const RecvSlot other = v.rslots[h];
        exists = other.sender == slot.sender && other.row == slot.row && other.entries > 0;
      }
      RecvEntry entry{};
      if (exists) entry = v.rentries[h * v.topk + (v.modes.once() ? lane : 0)];
      const unsigned present = __ballot_sync(~0u, exists);
      int order = 0;
      for (int i = 0; i < 32; ++i) {
        const int64_t other = __shfl_sync(~0u, entry.out_row, i);
        if ((present >> i & 1) && (other < entry.out_row || (other == entry.out_row && i < lane))) {
          ++order;
        }
      }
      if (exists && order < kMaxK) {
        rows[order] = reinterpret_cast<const uint4*>(a.expert_out + entry.out_row * v.row_bytes);
        weight[order] = entry.weight;
      }
      if (lane == 0) count = min(__popc(present), kMaxK);
    }
    __syncthreads();
    if (g == blockIdx.x) Mark(v, kTraceCombineSend, 1);
    auto* out = reinterpret_cast<uint4*>(dst);
    const int64_t groups = v.row_bytes / 16;
    for (int64_t c = threadIdx.x; c < groups; c += 2 * int64_t{blockDim.x}) {
      const int64_t c8[2] = {c, c + blockDim.x < groups ? c + blockDim.x : -1};
      float acc[2][V::kPer] = {};
      WeightedSum<kE, 2, 8>(acc, rows, weight, count, c8);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (c8[u] >= 0) out[c8[u]] = V::Pack(acc[u]);
      }
    }
    TagRows(v, slot.sender, slot.row, 1, epoch);
    if (slot.sender != v.rank) ++rows_out;
    __syncthreads();
  }
  if (threadIdx.x == 0 && rows_out) atomicAdd(reinterpret_cast<unsigned long long*>(
                                                  &v.scratch->rows_out),
                                              static_cast<unsigned long long>(rows_out));
  Mark(v, kTraceCombineSend, 2);
  Arrive(v, true, epoch);
  Mark(v, kTraceCombineSend, 3);
}
}  // namespace combine

// Token t's returned rows, rank by rank and k by k, summed in fp32 (unfused, the host device's
// order) onto the previous output or zero, into y, by a group of kGroup threads (the block or
// a warp): one 16-byte vector of columns per thread, kG of them at a time with kR rows' loads
// in flight (WeightedSum). kWide (2-byte rows, CombineOutput::fp32_out): y holds the fp32 sums
// unrounded, two 16-byte vectors for each of the rows'.
template <Elem kE, bool kWide, int kGroup, int kG, int kR>
__device__ inline void SumToken(const Nv& v, const CombineArgs& a, int t, const uint4* const* rows,
                                const float* weight, int count, bool wait_primary) {
  using V = CombineVec<kE>;
  static_assert(!kWide || V::kPer == 8, "fp32 output from 2-byte rows only");
  constexpr int kOut = kWide ? 2 : 1;  // output vectors per row vector
  auto* y = reinterpret_cast<uint4*>(a.out + int64_t{t} * v.row_bytes * kOut);
  const int64_t groups = v.row_bytes / 16;
  for (int64_t c = threadIdx.x % kGroup; c < groups; c += int64_t{kG} * kGroup) {
    int64_t c8[kG];
#pragma unroll
    for (int u = 0; u < kG; ++u) c8[u] = c + u * kGroup < groups ? c + u * kGroup : -1;
    float acc[kG][V::kPer] = {};
    if (a.accumulate && wait_primary) WaitPrimary();  // a.out is the caller's memory
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      if (!a.accumulate || c8[u] < 0) continue;
      if constexpr (kWide) {
        using W = CombineVec<Elem::kFp32>;
#pragma unroll
        for (int q = 0; q < V::kPer; ++q) acc[u][q] = W::At(y[c8[u] * 2 + q / 4], q % 4);
      } else {
        const uint4 prev = y[c8[u]];
#pragma unroll
        for (int q = 0; q < V::kPer; ++q) acc[u][q] = V::At(prev, q);
      }
    }
    WeightedSum<kE, kG, kR>(acc, rows, weight, count, c8);
    if (wait_primary) WaitPrimary();
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      if (c8[u] < 0) continue;
      if constexpr (kWide) {
        const float(&q)[V::kPer] = acc[u];
        y[c8[u] * 2] = make_uint4(__float_as_uint(q[0]), __float_as_uint(q[1]),
                                  __float_as_uint(q[2]), __float_as_uint(q[3]));
        y[c8[u] * 2 + 1] = make_uint4(__float_as_uint(q[4]), __float_as_uint(q[5]),
                                      __float_as_uint(q[6]), __float_as_uint(q[7]));
      } else {
        y[c8[u]] = V::Pack(acc[u]);
      }
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
__device__ inline LaneRow LocateRows(const Nv& v, const CombineArgs& a, int t,
                                     const int64_t* rank_start, const uint4** rows, float* weight,
                                     int* count) {
  const LaneRoute x = RouteLane(v, v.indices + int64_t{t} * v.topk, true);
  LaneRow mine{-1, x.r};
  if (x.valid && (!v.modes.reduce() || x.first)) {
    const int c = v.modes.reduce() ? x.ranks_before : x.lanes_before + x.within;
    mine.row = rank_start[x.r] + v.row_pos[int64_t{x.r} * v.max_tokens + t] +
               (v.modes.reduce() ? 0 : x.within);
    rows[c] = reinterpret_cast<const uint4*>(v.peer[x.r].combine_in + mine.row * v.row_bytes);
    const float* weights = a.weights ? a.weights : v.weights;
    weight[c] = v.modes.reduce() ? 1.0f : weights[int64_t{t} * v.topk + threadIdx.x % 32];
  }
  if (threadIdx.x % 32 == 0) *count = __popc(v.modes.reduce() ? x.firsts : x.valids);
  return mine;
}

// Streamed combine: tokens as claimed, by the block or, when tokens outnumber blocks
// (prefill), by each warp (as CombineRecvKernel); each token once its rows' tags are up (a lane
// per row waits), then summed as CombineRecvKernel does. It does not wait for the kernel before
// it (our CombineSend) before writing the caller's output: see UnpackKernel. The block that
// finishes last waits for every rank's combine flag -- every peer's CombineSend done, so its
// Unpack done reading what we sent it, before our next DispatchSend rewrites it
// (cuda_device.h) -- then advances the epoch.
namespace combine {
template <Elem kE, bool kWide>
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
  PrefixTotals(v.totals + v.world_size, v.world_size, rank_start);
  const uint64_t* tags = reinterpret_cast<const uint64_t*>(v.own + v.combine_tag_off);
  // Token t's rows located by a warp into table w and awaited: false if a wait gave up.
  auto arrived = [&](int t, int w) {
    const LaneRow mine = LocateRows(v, a, t, rank_start, row_ptr[w], weight_of[w], &rows[w]);
    return mine.row < 0 ||
           AwaitCounted(v, a.wait_cost, tags + mine.row, epoch + 1, start, a.timeout_ns, 1,
                        mine.rank);
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
      SumToken<kE, kWide, 32, 4, 2>(v, a, t, row_ptr[w], weight_of[w], rows[w], false);
      __syncwarp();  // every lane read the token's rows before the next token's are located
    }
    if (__syncthreads_or(!ok)) return;
  } else {
    for (int t = Claim<kCopyThreads>(&v.scratch->claimed_tokens); t < tokens;
         t = Claim<kCopyThreads>(&v.scratch->claimed_tokens)) {
      if (!__syncthreads_and(threadIdx.x >= 32 || arrived(t, 0))) return;
      if (first) Mark(v, kTraceCombineRecv, 1);
      first = false;
      SumToken<kE, kWide, kCopyThreads, 2, 8>(v, a, t, row_ptr[0], weight_of[0], rows[0], false);
    }
  }
  Mark(v, kTraceCombineRecv, 2);
  if (!LastBlock(&v.scratch->tickets[2], false) || threadIdx.x != 0) return;
  const uint64_t spent = GlobalTimerNs() - start;  // the deadline counts from the step's start
  if (!WaitAll(v, epoch, spent < a.timeout_ns ? a.timeout_ns - spent : 0, 1, a.wait_cost)) {
    return;
  }
  AdvanceEpoch(v, epoch);
  Mark(v, kTraceCombineRecv, 3);
}
}  // namespace combine

// Once every combine flag is up, each token's returned rows, rank by rank and k by k, summed in
// fp32 (unfused, the host device's order) onto the previous output or zero: tokens t =
// blockIdx.x, + grid ... a block each, or, when tokens outnumber blocks (prefill), a warp each
// (eight tokens in flight per block, each warp locating its next token itself: a block per
// token waits on each token's routing loads and then its rows' loads, one after the other). The
// last block advances the epoch.
namespace combine {
template <Elem kE, bool kWide>
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
  PrefixTotals(v.totals + v.world_size, v.world_size, rank_start);
  // Every block waits for every rank's combine flag, token or not: a rank's next DispatchSend
  // may reuse its buffers only after this (see cuda_device.h). The first token's rows are
  // located before the wait.
  const bool warps = tokens > static_cast<int>(gridDim.x);
  const int w = warps ? threadIdx.x / 32 : 0;
  int t = warps ? blockIdx.x + w * gridDim.x : blockIdx.x;
  const int step = warps ? gridDim.x * kWarps : gridDim.x;
  auto locate = [&] {
    if (t < tokens && (warps || threadIdx.x < 32)) {
      LocateRows(v, a, t, rank_start, row_ptr[w], weight_of[w], &rows[w]);
    }
  };
  // Under mask_lost_peers the wait may mask ranks whose rows then count as none: located after.
  if (!v.modes.mask_lost()) locate();
  if (threadIdx.x == 0) ok = WaitStep(v, epoch, a.timeout_ns, 1, a.wait_cost);
  __syncthreads();
  if (!ok) return;
  if (v.modes.mask_lost()) {
    locate();
    __syncthreads();
  }
  Mark(v, kTraceCombineRecv, 1);
  if (warps) {
    for (; t < tokens; t += step) {
      if (t != static_cast<int>(blockIdx.x + w * gridDim.x)) {
        __syncwarp();  // every lane read the last token's rows
        locate();
      }
      __syncwarp();
      SumToken<kE, kWide, 32, 4, 2>(v, a, t, row_ptr[w], weight_of[w], rows[w], true);
    }
  } else {
    for (; t < tokens; t += step) {
      if (t != static_cast<int>(blockIdx.x)) {
        __syncthreads();  // the row table is rewritten for the next token
        locate();
        __syncthreads();
      }
      SumToken<kE, kWide, kCopyThreads, 2, 8>(v, a, t, row_ptr[0], weight_of[0], rows[0], true);
    }
  }
  Mark(v, kTraceCombineRecv, 2);
  // Only our own epoch word changes: a device-scope fence is enough.
  if (LastBlock(&v.scratch->tickets[2], false) && threadIdx.x == 0) AdvanceEpoch(v, epoch);
  Mark(v, kTraceCombineRecv, 3);
}
}  // namespace combine

}  // namespace ferry::moe::nv
