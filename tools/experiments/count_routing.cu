// Study (session 17), not part of the build: where SendSmall's counting time goes. Each
// variant loads a decode routing (128 tokens x top-8 over 256 experts) into shared memory as
// SendSmall does, then counts twice in one launch (cold, warm); cycles, median over 33 blocks x
// 49 launches; variant 0 (the counting before session 17) is the baseline of the same run.
// On the GPU machine: nvcc -O3 -std=c++20 -arch=sm_90 count_routing.cu -o /tmp/cr && /tmp/cr
// Variants 6-9 gave FastDiv and TransposeBits (nvlink_protocol.cuh); 11 (16-byte loads)
// gained 0.2 us here and nothing in the kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

struct P {
  int n, e, l, k, tokens;
  const int* idx;
  long long* out;  // [launch][block][4]
  int launch;
  unsigned magic;  // ceil(2^32 / l): e / l == umulhi(e, magic) for the small e used here
  int shift;
};

__device__ __forceinline__ bool Valid(const P& p, int e) { return e >= 0 && e < p.e; }

// kV: 0 as SendSmall (thread per token, runtime k), 1 the same with no atomics, 2 entry-strided
// hist atomics (conflict-free loads) + thread-per-token rank masks, 3 thread per token but
// compile-time K = 8, 4 rank masks only, 5 hist atomics only (thread per token).
template <int kV>
__device__ __forceinline__ void Count(const P& p, int* hist, int* hist_before, int* tall,
                                      int* tbefore, const int* idx, int first_token, int* sink) {
  const int lane = threadIdx.x % 32;
  const int tokens = p.tokens;
  if (kV == 2) {
    const int entries = tokens * p.k;
    for (int f = threadIdx.x; f < entries; f += blockDim.x) {
      const int e = idx[f];
      if (!Valid(p, e)) continue;
      atomicAdd(&hist[e], 1);
      if (f < first_token * p.k) atomicAdd(&hist_before[e], 1);
    }
  }
  for (int base = 0; base < tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool before = t < first_token;
    uint32_t ranks = 0;
    int acc = 0;
    if (kV == 11 && t < tokens) {
      const int4 a = reinterpret_cast<const int4*>(idx + t * 8)[0];
      const int4 b = reinterpret_cast<const int4*>(idx + t * 8)[1];
      const int es[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int e = es[i];
        if (!Valid(p, e)) continue;
        atomicAdd(&hist[e], 1);
        if (before) atomicAdd(&hist_before[e], 1);
        ranks |= 1u << __umulhi(static_cast<unsigned>(e), p.magic);
      }
    } else if (kV == 11) {
    } else if (kV == 3) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (t >= tokens) break;
        const int e = idx[t * 8 + i];
        if (!Valid(p, e)) continue;
        atomicAdd(&hist[e], 1);
        if (before) atomicAdd(&hist_before[e], 1);
        ranks |= 1u << (e / p.l);
      }
    } else {
      for (int f = t * p.k; t < tokens && f < (t + 1) * p.k; ++f) {
        const int e = idx[f];
        if (!Valid(p, e)) continue;
        if (kV == 0 || kV == 5 || kV == 10) {
          atomicAdd(&hist[e], 1);
          if (before) atomicAdd(&hist_before[e], 1);
        }
        if (kV == 1) acc += e;
        if (kV == 6 || kV == 9 || kV == 10) {
          ranks |= 1u << __umulhi(static_cast<unsigned>(e), p.magic);
        } else if (kV == 8) {
          ranks |= 1u << (e >> p.shift);
        } else if (kV != 5) {
          ranks |= 1u << (e / p.l);
        }
      }
    }
    if (kV == 1) sink[threadIdx.x] = acc;
    if (kV == 7) sink[threadIdx.x] = ranks;
    if (kV == 9 || kV == 10 || kV == 11) {
      uint32_t x = ranks, keep = 0x0000FFFFu;
#pragma unroll
      for (int s = 16; s >= 1; s >>= 1, keep ^= keep << s) {
        const uint32_t y = __shfl_xor_sync(~0u, x, s);
        x = lane & s ? (x & ~keep) | ((y & ~keep) >> s) : (x & keep) | ((y & keep) << s);
      }
      const int early = min(max(first_token - (t - lane), 0), 32);
      const int all = __popc(x), all_early = __popc(x & (early == 32 ? ~0u : (1u << early) - 1));
      if (lane < p.n && all) atomicAdd(&tall[lane], all);
      if (lane < p.n && all_early) atomicAdd(&tbefore[lane], all_early);
    }
    for (int r = 0; kV != 5 && kV != 7 && kV < 9 && r < p.n; ++r) {
      const int all = __popc(__ballot_sync(~0u, ranks >> r & 1));
      const int early = __popc(__ballot_sync(~0u, before && (ranks >> r & 1)));
      if (lane == 0 && all) atomicAdd(&tall[r], all);
      if (lane == 0 && early) atomicAdd(&tbefore[r], early);
    }
  }
}

template <int kV>
__global__ void __launch_bounds__(128) CountKernel(P p) {
  extern __shared__ int smem[];
  int* hist = smem;
  int* hist_before = hist + p.e;
  int* tall = hist_before + p.e;
  int* tbefore = tall + 32;
  int* sink = tbefore + 32;
  int* idx = sink + 128;
  const long long t0 = clock64();
  const int entries = p.tokens * p.k;
  for (int i = threadIdx.x; i < p.e; i += blockDim.x) hist[i] = hist_before[i] = 0;
  if (threadIdx.x < 32) tall[threadIdx.x] = tbefore[threadIdx.x] = 0;
  for (int base = 0; base < entries; base += 8 * blockDim.x) {
    int ids[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int f = base + threadIdx.x + u * blockDim.x;
      if (f < entries) ids[u] = p.idx[f];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int f = base + threadIdx.x + u * blockDim.x;
      if (f < entries) idx[f] = ids[u];
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  const int first_token = (static_cast<int>(blockIdx.x) - 1) * 4;
  Count<kV>(p, hist, hist_before, tall, tbefore, idx, first_token, sink);
  __syncthreads();
  const long long t2 = clock64();
  Count<kV>(p, hist, hist_before, tall, tbefore, idx, first_token, sink);
  __syncthreads();
  const long long t3 = clock64();
  if (threadIdx.x == 0) {
    long long* o = p.out + (int64_t(p.launch) * gridDim.x + blockIdx.x) * 4;
    o[0] = t1 - t0;
    o[1] = t2 - t1;
    o[2] = t3 - t2;
    o[3] = hist[threadIdx.x] + tall[0] + sink[0];
  }
}

template <int kV>
void Run(const char* name, const P& base, int blocks, int launches, long long* dout) {
  P p = base;
  p.out = dout;
  const size_t smem = (2 * p.e + 64 + 128 + p.tokens * p.k) * sizeof(int);
  for (int i = 0; i < launches; ++i) {
    p.launch = i;
    CountKernel<kV><<<blocks, 128, smem>>>(p);
  }
  cudaDeviceSynchronize();
  std::vector<long long> h(size_t(launches) * blocks * 4);
  cudaMemcpy(h.data(), dout, h.size() * 8, cudaMemcpyDeviceToHost);
  double med[3];
  for (int c = 0; c < 3; ++c) {
    std::vector<long long> v;
    for (int i = 1; i < launches; ++i)
      for (int b = 0; b < blocks; ++b) v.push_back(h[(size_t(i) * blocks + b) * 4 + c]);
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    med[c] = v[v.size() / 2];
  }
  std::printf("%-34s load %6.0f  count cold %6.0f  warm %6.0f cycles\n", name, med[0], med[1],
              med[2]);
}

int main() {
  const int tokens = 128, k = 8, e = 256;
  std::mt19937 rng(1);
  std::vector<int> idx(tokens * k), ex(e);
  for (int i = 0; i < e; ++i) ex[i] = i;
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(ex.begin(), ex.end(), rng);
    std::copy(ex.begin(), ex.begin() + k, idx.begin() + t * k);
  }
  int* didx;
  long long* dout;
  cudaMalloc(&didx, idx.size() * 4);
  cudaMemcpy(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice);
  const int launches = 50, blocks = 33;
  cudaMalloc(&dout, size_t(launches) * blocks * 4 * 8);
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  std::printf("SM clock attribute %d kHz\n", clock_khz);
  for (int n : {1, 2, 8}) {
    P p{n, e, e / n, k, tokens, didx, nullptr, 0};
    p.magic = static_cast<unsigned>((0x100000000ull + p.l - 1) / p.l);
    p.shift = __builtin_ctz(p.l);
    for (int x = 0; x < e; ++x)
      if (static_cast<int>((uint64_t(x) * p.magic) >> 32) != x / p.l) std::printf("magic wrong\n");
    std::printf("-- ranks %d\n", n);
    Run<0>("0 as SendSmall", p, blocks, launches, dout);
    Run<1>("1 no atomics", p, blocks, launches, dout);
    Run<2>("2 entry-strided hist + rank masks", p, blocks, launches, dout);
    Run<3>("3 compile-time K", p, blocks, launches, dout);
    Run<4>("4 rank masks only", p, blocks, launches, dout);
    Run<5>("5 hist atomics only", p, blocks, launches, dout);
    Run<6>("6 rank masks, umulhi division", p, blocks, launches, dout);
    Run<7>("7 rank masks, no ballots", p, blocks, launches, dout);
    Run<8>("8 rank masks, shift division", p, blocks, launches, dout);
    Run<9>("9 umulhi + transposed rank masks", p, blocks, launches, dout);
    Run<10>("10 = SendSmall now", p, blocks, launches, dout);
    Run<11>("11 now, entries as two int4", p, blocks, launches, dout);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
