// ferry-bench p2p (bench_p2p.h): GPU 0 <-> GPU 1 bandwidth, by the copy engines and by SM
// kernels storing into (push) or loading from (pull) the peer's memory, one way and both ways
// at once.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "tools/bench_p2p.h"

namespace ferry::bench {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte vectors per thread in flight
constexpr int kReps = 5;

// dst[i] = src[i] over n vectors, kUnroll loads in flight per thread before their stores.
__global__ void __launch_bounds__(kThreads) CopyKernel(const uint4* __restrict__ src,
                                                       uint4* __restrict__ dst, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t base = blockIdx.x * int64_t{kThreads} + threadIdx.x; base < n;
       base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < n) dst[i] = v[u];
    }
  }
}

#define P2P_CUDA(expr)                                                                      \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "ferry-bench p2p: %s: %s\n", #expr, cudaGetErrorString(e_));     \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

struct Gpu {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, end = nullptr;
  uint8_t* src = nullptr;  // what this GPU sends (or what the peer pulls)
  uint8_t* dst = nullptr;  // where the peer's bytes land
};

enum class Way { kCopy, kPush, kPull };

// One transfer of `bytes` from GPU `from` to GPU `to`, queued on the stream of the GPU that
// drives it (the source for copies and pushes, the destination for pulls), between its events.
int Queue(std::vector<Gpu>& g, int from, int to, Way way, int64_t bytes, int blocks,
          int offset) {
  Gpu& driver = g[way == Way::kPull ? to : from];
  P2P_CUDA(cudaSetDevice(driver.device));
  P2P_CUDA(cudaEventRecord(driver.start, driver.stream));
  if (way == Way::kCopy) {
    P2P_CUDA(cudaMemcpyPeerAsync(g[to].dst, g[to].device, g[from].src, g[from].device, bytes,
                                 driver.stream));
  } else {
    CopyKernel<<<blocks, kThreads, 0, driver.stream>>>(
        reinterpret_cast<const uint4*>(g[from].src) + offset,
        reinterpret_cast<uint4*>(g[to].dst) + offset, bytes / 16 - 8);
    P2P_CUDA(cudaGetLastError());
  }
  P2P_CUDA(cudaEventRecord(driver.end, driver.stream));
  return 0;
}

// Best of kReps runs: GB/s of 0 -> 1 and, with both, of 1 -> 0 measured at the same time.
int Measure(std::vector<Gpu>& g, Way way, bool both, int64_t bytes, int blocks, double gbps[2],
            int offset = 0) {
  gbps[0] = gbps[1] = 0;
  for (int rep = 0; rep < kReps + 1; ++rep) {  // the first run warms up
    for (Gpu& x : g) {
      P2P_CUDA(cudaSetDevice(x.device));
      P2P_CUDA(cudaDeviceSynchronize());
    }
    if (int rc = Queue(g, 0, 1, way, bytes, blocks, offset)) return rc;
    if (both) {
      if (int rc = Queue(g, 1, 0, way, bytes, blocks, offset)) return rc;
    }
    for (int dir = 0; dir < (both ? 2 : 1); ++dir) {
      const Gpu& driver = g[way == Way::kPull ? 1 - dir : dir];
      P2P_CUDA(cudaSetDevice(driver.device));
      P2P_CUDA(cudaEventSynchronize(driver.end));
      float ms = 0;
      P2P_CUDA(cudaEventElapsedTime(&ms, driver.start, driver.end));
      // Kernels move all but the last 128 bytes (room for the offset rows).
      const double moved = way == Way::kCopy ? bytes : bytes - 128;
      if (rep > 0) gbps[dir] = std::max(gbps[dir], moved / (ms * 1e6));
    }
  }
  return 0;
}

}  // namespace

int RunP2pBench(int64_t bytes) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    std::fprintf(stderr, "ferry-bench p2p: needs two GPUs (found %d)\n", gpus);
    return 1;
  }
  if (bytes < (1 << 20) || bytes % 16 != 0) {
    std::fprintf(stderr, "ferry-bench p2p: --bytes must be a multiple of 16, at least 1 MiB\n");
    return 2;
  }
  std::vector<Gpu> g(2);
  int sms = 0;
  for (int d = 0; d < 2; ++d) {
    Gpu& x = g[d];
    x.device = d;
    P2P_CUDA(cudaSetDevice(d));
    int can = 0;
    P2P_CUDA(cudaDeviceCanAccessPeer(&can, d, 1 - d));
    if (!can) {
      std::fprintf(stderr, "ferry-bench p2p: GPU %d cannot reach GPU %d\n", d, 1 - d);
      return 1;
    }
    const cudaError_t e = cudaDeviceEnablePeerAccess(1 - d, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) P2P_CUDA(e);
    cudaGetLastError();
    P2P_CUDA(cudaStreamCreateWithFlags(&x.stream, cudaStreamNonBlocking));
    P2P_CUDA(cudaEventCreate(&x.start));
    P2P_CUDA(cudaEventCreate(&x.end));
    P2P_CUDA(cudaMalloc(&x.src, bytes));
    P2P_CUDA(cudaMalloc(&x.dst, bytes));
    P2P_CUDA(cudaMemset(x.src, d + 1, bytes));
    P2P_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
  }
  std::printf("ferry-bench p2p: GPU 0 <-> GPU 1, %.1f MB per direction, best of %d; kernels of "
              "%d threads, %d 16-byte vectors per thread in flight; %d SMs\n",
              bytes / 1e6, kReps, kThreads, kUnroll, sms);
  std::printf("%-34s %7s | %10s %10s | %8s\n", "way", "blocks", "0->1 GB/s", "1->0 GB/s",
              "/ copy");
  double base[2];
  if (int rc = Measure(g, Way::kCopy, false, bytes, 0, base)) return rc;
  auto row = [&](const char* name, Way way, bool both, int blocks, int offset = 0) -> int {
    double gbps[2];
    if (int rc = Measure(g, way, both, bytes, blocks, gbps, offset)) return rc;
    char back[32] = "-";
    if (both) std::snprintf(back, sizeof back, "%.1f", gbps[1]);
    std::printf("%-34s %7d | %10.1f %10s | %8.2f\n", name, blocks, gbps[0], back,
                gbps[0] / base[0]);
    return 0;
  };
  std::printf("%-34s %7s | %10.1f %10s | %8.2f\n", "copy engine, one way", "-", base[0], "-",
              1.0);
  double copy_both[2];
  if (int rc = Measure(g, Way::kCopy, true, bytes, 0, copy_both)) return rc;
  std::printf("%-34s %7s | %10.1f %10.1f | %8.2f\n", "copy engine, both ways at once", "-",
              copy_both[0], copy_both[1], copy_both[0] / base[0]);
  // One block per SM, one way; then both ways from a few SMs up (how many it takes to fill
  // the link decides how many a streaming kernel can leave to the receiving side).
  if (int rc = row("SM stores (push), one way", Way::kPush, false, sms)) return rc;
  if (int rc = row("SM loads (pull), one way", Way::kPull, false, sms)) return rc;
  for (const int blocks : {8, 16, 32, 64, sms, 2 * sms}) {
    if (int rc = row("SM stores (push), both ways", Way::kPush, true, blocks)) return rc;
  }
  for (const int blocks : {8, 16, 32, 64, sms, 2 * sms}) {
    if (int rc = row("SM loads (pull), both ways", Way::kPull, true, blocks)) return rc;
  }
  // Rows that start 16 bytes past a 128-byte line (a slot's row behind its 144-byte header):
  // every warp's 512 contiguous bytes then touch five lines, two of them in part.
  if (int rc = row("push, both ways, 16 B off the line", Way::kPush, true, sms, 1)) return rc;
  if (int rc = row("pull, both ways, 16 B off the line", Way::kPull, true, sms, 1)) return rc;
  if (int rc = row("push, both ways, 128 B aligned", Way::kPush, true, sms, 8)) return rc;
  std::printf("/ copy: 0->1 over the copy engine's one-way 0->1 of the same run\n");
  for (Gpu& x : g) {
    cudaSetDevice(x.device);
    cudaFree(x.src);
    cudaFree(x.dst);
    cudaEventDestroy(x.start);
    cudaEventDestroy(x.end);
    cudaStreamDestroy(x.stream);
  }
  return 0;
}

}  // namespace ferry::bench
