// The token-major caller's permute and un-permute (bench_moe_caller.h): warps striding over the
// rows the device count says arrived.
#include "moe/cuda/cuda_util.cuh"
#include "tools/bench_moe_caller.h"
#include "moe/numerics.h"

namespace ferry::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxK = 16;    // ferry's top-k limit
constexpr int kBatch = 4;    // vectors per lane in one Permute task
constexpr int kSegment = 2;  // vectors per lane and copy in one Unpermute task
constexpr int kCopies = 8;   // copies loaded at once (Unpermute)

int Grid() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return 4 * std::max(sms, 1);
}

// Thread per (row, copy): the copy's place in its expert's group (an atomic on the group's
// fill), recorded in `where`.
__global__ void __launch_bounds__(kThreads) PlaceKernel(TokenMajorCaller c) {
  const int64_t entries = int64_t{*c.num_rows} * c.k;
  for (int64_t f = blockIdx.x * int64_t{kThreads} + threadIdx.x; f < entries;
       f += int64_t{gridDim.x} * kThreads) {
    const int32_t e = c.token_experts[f];
    c.where[f] = e >= 0 && e < c.local_experts ? atomicAdd(&c.fill[e], 1) : -1;
  }
}

// One warp per (row, segment of 32 * kBatch vectors): the segment loaded once and stored into
// every copy's place; the first segment's warp also copies the scales.
__global__ void __launch_bounds__(kThreads) PermuteKernel(TokenMajorCaller c) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = *c.num_rows;
  const int64_t vectors = c.row_bytes / 16;
  const int64_t segments = (vectors + 32 * kBatch - 1) / (32 * kBatch);
  for (int64_t task = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; task < rows * segments;
       task += int64_t{gridDim.x} * kWarps) {
    const int64_t g = task / segments, first = task % segments * 32 * kBatch;
    const int32_t pos = lane < c.k ? c.where[g * c.k + lane] : -1;
    const int64_t dst_row =
        pos >= 0 ? c.token_experts[g * c.k + lane] * c.expert_capacity + pos : -1;
    const uint32_t copies = __ballot_sync(~0u, pos >= 0);
    const auto* src = reinterpret_cast<const uint4*>(c.rows + g * c.row_bytes);
    uint4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = first + lane + 32 * u;
      if (i < vectors) v[u] = src[i];
    }
    for (uint32_t m = copies; m; m &= m - 1) {
      const int64_t row = __shfl_sync(~0u, dst_row, __ffs(m) - 1);
      auto* dst = reinterpret_cast<uint4*>(c.grouped + row * c.row_bytes);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t i = first + lane + 32 * u;
        if (i < vectors) dst[i] = v[u];
      }
    }
    if (first != 0) continue;
    for (int base = 0; base < c.scales_per_row; base += 32) {
      const int i = base + lane;
      const float scale = i < c.scales_per_row ? c.row_scales[g * c.scales_per_row + i] : 0.0f;
      for (uint32_t m = copies; m; m &= m - 1) {
        const int64_t row = __shfl_sync(~0u, dst_row, __ffs(m) - 1);
        if (i < c.scales_per_row) c.grouped_scales[row * c.scales_per_row + i] = scale;
      }
    }
  }
}

// One warp per (row, segment of 32 * kSegment vectors): the segment's vectors of kCopies
// copies loaded at once, then summed in fp32 in copy order.
__global__ void __launch_bounds__(kThreads) UnpermuteKernel(TokenMajorCaller c) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = *c.num_rows;
  const int64_t vectors = c.hidden / 8;  // eight bf16 per 16 bytes
  const int64_t segments = (vectors + 32 * kSegment - 1) / (32 * kSegment);
  for (int64_t task = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; task < rows * segments;
       task += int64_t{gridDim.x} * kWarps) {
    const int64_t g = task / segments, first = task % segments * 32 * kSegment;
    const int32_t e = lane < c.k ? c.token_experts[g * c.k + lane] : -1;
    const bool ours = e >= 0 && e < c.local_experts;
    const int64_t my_row = ours ? e * c.expert_capacity + c.where[g * c.k + lane] : 0;
    const float my_weight = ours ? c.token_weights[g * c.k + lane] : 0.0f;
    float acc[kSegment][8] = {};
    for (uint32_t m = __ballot_sync(~0u, ours); m;) {  // kCopies copies at a time
      int64_t row[kCopies];
      float weight[kCopies];
      int n = 0;
#pragma unroll
      for (int j = 0; j < kCopies; ++j) {
        const int from = m ? __ffs(m) - 1 : 0;
        n += m != 0;
        row[j] = __shfl_sync(~0u, my_row, from);
        weight[j] = __shfl_sync(~0u, my_weight, from);
        m &= m - 1;
      }
      uint4 v[kSegment][kCopies];
#pragma unroll
      for (int s = 0; s < kSegment; ++s) {
        const int64_t i = first + lane + 32 * s;
#pragma unroll
        for (int j = 0; j < kCopies; ++j) {
          if (j < n && i < vectors) {
            v[s][j] = reinterpret_cast<const uint4*>(c.gemm_out + row[j] * c.hidden)[i];
          }
        }
      }
#pragma unroll
      for (int s = 0; s < kSegment; ++s) {
#pragma unroll
        for (int j = 0; j < kCopies; ++j) {
          if (j >= n) break;
          const uint32_t words[4] = {v[s][j].x, v[s][j].y, v[s][j].z, v[s][j].w};
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            acc[s][2 * h] += weight[j] * moe::Bf16ToFloatD(static_cast<uint16_t>(words[h]));
            acc[s][2 * h + 1] +=
                weight[j] * moe::Bf16ToFloatD(static_cast<uint16_t>(words[h] >> 16));
          }
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kSegment; ++s) {
      const int64_t i = first + lane + 32 * s;
      if (i >= vectors) continue;
      uint32_t packed[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        packed[h] = uint32_t{moe::FloatToBf16D(acc[s][2 * h])} |
                    uint32_t{moe::FloatToBf16D(acc[s][2 * h + 1])} << 16;
      }
      reinterpret_cast<uint4*>(c.combined + g * c.hidden)[i] =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
  // The next Permute starts from empty groups. Every task has read `where` above; `fill` is
  // read only by Permute, which runs after this kernel in stream order.
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < c.local_experts; i += blockDim.x) c.fill[i] = 0;
  }
}

bool Valid(const TokenMajorCaller& c) {
  return c.k > 0 && c.k <= kMaxK && c.local_experts > 0 && c.expert_capacity > 0 &&
         c.row_bytes % 16 == 0 && c.hidden % 8 == 0;
}

}  // namespace

cudaError_t LaunchPermute(const TokenMajorCaller& c, cudaStream_t stream) {
  if (!Valid(c)) return cudaErrorInvalidValue;
  PlaceKernel<<<Grid(), kThreads, 0, stream>>>(c);
  PermuteKernel<<<Grid(), kThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

cudaError_t LaunchUnpermute(const TokenMajorCaller& c, cudaStream_t stream) {
  if (!Valid(c)) return cudaErrorInvalidValue;
  UnpermuteKernel<<<Grid(), kThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

}  // namespace ferry::bench
