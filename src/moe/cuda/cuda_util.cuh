// Small pieces both CUDA moe paths share: error checks, bf16 conversions, block copies, device
// arrays. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ferry/status.h"

namespace ferry::moe {

#define FERRY_CUDA(expr)                                                               \
  do {                                                                                 \
    cudaError_t ferry_err_ = (expr);                                                   \
    if (ferry_err_ != cudaSuccess) {                                                   \
      return InternalError(std::string("CUDA: ") + #expr + ": " +                      \
                           cudaGetErrorString(ferry_err_));                            \
    }                                                                                  \
  } while (0)

__device__ inline float Bf16ToFloatD(uint16_t b) { return __uint_as_float(uint32_t{b} << 16); }

__device__ inline uint16_t FloatToBf16D(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Copies n bytes with the widest access the pointers and n allow; the block's threads share it.
// With dst2, the same bytes go there too (a local copy and a peer's, read once). Loads bypass L1
// (ld.global.cg): the source may be memory a peer wrote over NVLink.
__device__ inline void CopyBytes(uint8_t* dst, const uint8_t* src, int64_t n,
                                 uint8_t* dst2 = nullptr) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         reinterpret_cast<uintptr_t>(dst2) | static_cast<uintptr_t>(n);
  if ((align & 15) == 0) {
    // Four loads in flight per thread before their stores: one round trip covers 16 KiB.
    const auto* s4 = reinterpret_cast<const uint4*>(src);
    auto* d4 = reinterpret_cast<uint4*>(dst);
    auto* e4 = reinterpret_cast<uint4*>(dst2);
    const int64_t m = n / 16;
    for (int64_t base = threadIdx.x; base < m; base += 4 * int64_t{blockDim.x}) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t i = base + u * int64_t{blockDim.x};
        if (i < m) v[u] = __ldcg(s4 + i);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t i = base + u * int64_t{blockDim.x};
        if (i < m) {
          d4[i] = v[u];
          if (e4) e4[i] = v[u];
        }
      }
    }
  } else if ((align & 7) == 0) {
    for (int64_t i = threadIdx.x; i < n / 8; i += blockDim.x) {
      const uint2 v = __ldcg(reinterpret_cast<const uint2*>(src) + i);
      reinterpret_cast<uint2*>(dst)[i] = v;
      if (dst2) reinterpret_cast<uint2*>(dst2)[i] = v;
    }
  } else if ((align & 3) == 0) {
    for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) {
      const uint32_t v = __ldcg(reinterpret_cast<const uint32_t*>(src) + i);
      reinterpret_cast<uint32_t*>(dst)[i] = v;
      if (dst2) reinterpret_cast<uint32_t*>(dst2)[i] = v;
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      dst[i] = src[i];
      if (dst2) dst2[i] = src[i];
    }
  }
}

// Division by a divisor fixed when the kernels are set up (the local expert count, top-k) as a
// multiply and a shift. A runtime `/` compiles to a dependent chain of ~20 instructions
// (reciprocal, conversions, two corrections): ~170 cycles each in SendSmall's counting loop,
// where eight of them per thread took 0.7 us. Round-up method
// (Granlund & Montgomery 1994): with s = ceil(log2 d) and m = ceil(2^(31+s) / d) < 2^32, x / d
// == (x * m) >> (31 + s) for every 0 <= x < 2^31, since m * d - 2^(31+s) < d <= 2^s.
struct FastDiv {
  uint32_t d = 1;
  uint32_t m = 0;  // unused when d == 1
  uint32_t s = 0;  // 31 + ceil(log2 d) - 32

  static FastDiv Of(int divisor) {
    FastDiv f;
    f.d = static_cast<uint32_t>(std::max(divisor, 1));
    if (f.d == 1) return f;
    uint32_t log2 = 0;
    while ((uint64_t{1} << log2) < f.d) ++log2;
    f.m = static_cast<uint32_t>(((uint64_t{1} << (31 + log2)) + f.d - 1) / f.d);
    f.s = log2 - 1;
    return f;
  }
  // x / d for 0 <= x < 2^31.
  __host__ __device__ int Div(int x) const {
    const uint32_t u = static_cast<uint32_t>(x);
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(u, m);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{u} * m) >> 32);
#endif
    return static_cast<int>(d == 1 ? u : hi >> s);
  }
  __host__ __device__ int Mod(int x) const { return x - Div(x) * static_cast<int>(d); }
};

// The sender of received slot g, given prefix[s] = slots received before sender s (n senders).
__device__ inline int SenderOf(const int64_t* prefix, int n, int64_t g) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  Status Allocate(size_t count) {
    count = std::max<size_t>(count, 1);
    FERRY_CUDA(cudaMalloc(&p_, count * sizeof(T)));
    return Status::Ok();
  }
  T* get() const { return p_; }
  void Free() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
  }
  // Leaks the memory (a NIC may still read it).
  void Leak() { p_ = nullptr; }

 private:
  T* p_ = nullptr;
};

}  // namespace ferry::moe
