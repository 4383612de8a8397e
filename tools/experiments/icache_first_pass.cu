// Study (session 18), not part of the build: does a block pay for fetching straight-line code
// the first time it runs it? Unpack's setup after the flags (~185 instructions per warp between
// two trace points, 1.1-1.3 us) looked too slow for its instruction count. Each block runs the
// same 650 dependent ALU instructions (~10 KB of code) twice in one launch and stamps cycles
// around each pass; the launch before it runs other code (or, last, the same kernel).
// On the GPU machine: nvcc -O3 -arch=sm_90 icache_first_pass.cu -o /tmp/ic && /tmp/ic
// Result (H200; run as the scratch file this was tidied from, same body): first pass 1540-1545
// cycles, second 1524-1577, the same kernel twice alike: no fetch cost to speak of. The setup
// is slow because each warp waits ~9.5 cycles per instruction (ncu), one block of 8 warps per
// SM hiding little latency.
#include <cuda_runtime.h>

#include <cstdio>

#define REPEAT8(x) x x x x x x x x
#define REPEAT64(x) REPEAT8(REPEAT8(x))
// Five dependent instructions, four registers in a ring; kSalt makes two instances differ.
#define STEP(kSalt)                                       \
  asm volatile("add.u32 %0, %0, %1;" : "+r"(a) : "r"(b)); \
  asm volatile("xor.b32 %0, %0, %1;" : "+r"(b) : "r"(c)); \
  asm volatile("add.u32 %0, %0, %1;" : "+r"(c) : "r"(d)); \
  asm volatile("xor.b32 %0, %0, %1;" : "+r"(d) : "r"(a + kSalt));

template <int kSalt>
__global__ void StraightLine(long long* cycles, int* sink) {
  unsigned a = threadIdx.x, b = 1, c = 2, d = 3;
  long long stamp[3];
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    stamp[pass] = clock64();
    REPEAT64(STEP(kSalt)) REPEAT64(STEP(kSalt))
  }
  stamp[2] = clock64();
  if (threadIdx.x == 0) {
    cycles[blockIdx.x * 2] = stamp[1] - stamp[0];
    cycles[blockIdx.x * 2 + 1] = stamp[2] - stamp[1];
  }
  if (a + b + c + d == 12345) *sink = 1;  // keeps the chain
}

// Runs `before` then StraightLine<3> with `threads` per block; prints the mean of both passes.
void Measure(const char* label, void (*before)(long long*, int*), int threads, long long* cycles,
             int* sink) {
  constexpr int kBlocks = 132;
  before<<<kBlocks, threads>>>(cycles, sink);
  StraightLine<3><<<kBlocks, threads>>>(cycles, sink);
  long long host[2 * kBlocks];
  cudaMemcpy(host, cycles, sizeof host, cudaMemcpyDeviceToHost);
  double first = 0, second = 0;
  for (int b = 0; b < kBlocks; ++b) {
    first += host[2 * b];
    second += host[2 * b + 1];
  }
  std::printf("%-40s threads %3d: first pass %.0f cycles, second %.0f\n", label, threads,
              first / kBlocks, second / kBlocks);
}

int main() {
  long long* cycles;
  int* sink;
  cudaMalloc(&cycles, 2 * 132 * sizeof(long long));
  cudaMalloc(&sink, sizeof(int));
  for (int i = 0; i < 3; ++i) {
    Measure("after other code", StraightLine<7>, 256, cycles, sink);
    Measure("after other code", StraightLine<7>, 32, cycles, sink);
    Measure("after the same kernel", StraightLine<3>, 256, cycles, sink);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
