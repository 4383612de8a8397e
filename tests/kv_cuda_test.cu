// The GPU-visible layer counter: increments enqueued on a stream reach the host in order, after
// the work before them. Without a GPU, Create says so.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "ferry/kv.h"

namespace ferry {
namespace {

__global__ void Fill(uint64_t* data, uint64_t value, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    data[i] = value;
  }
}

TEST(GpuLayerCounterTest, IncrementsFollowTheStreamsWork) {
  auto counter = GpuLayerCounter::Create();
  if (access("/dev/nvidia0", F_OK) != 0) {
    EXPECT_EQ(counter.status().code(), StatusCode::kFailedPrecondition) << counter.status();
    GTEST_SKIP() << "no GPU: Create refused cleanly";
  }
  ASSERT_TRUE(counter.ok()) << counter.status();
  const std::atomic<uint64_t>* word = (*counter)->host();
  EXPECT_EQ(word->load(), 0u);
  // Each "layer" writes pinned memory, then counts: when the host sees layer l, layer l's
  // writes are there.
  constexpr size_t kWords = 1 << 20;
  uint64_t* pages = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pages), kWords * 8, cudaHostAllocMapped),
            cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  constexpr uint64_t kLayers = 61;
  for (uint64_t l = 1; l <= kLayers; ++l) {
    Fill<<<64, 256, 0, stream>>>(pages, l, kWords);
    ASSERT_TRUE((*counter)->Increment(stream).ok());
  }
  uint64_t seen = 0;
  while (seen < kLayers) {
    const uint64_t now = word->load(std::memory_order_acquire);
    ASSERT_GE(now, seen);  // monotonic
    if (now > seen) {
      // Layer `now` finished writing before it was counted (a later one may be writing on).
      ASSERT_GE(pages[0], now);
      ASSERT_GE(pages[kWords - 1], now);
      seen = now;
    }
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(word->load(), kLayers);
  cudaStreamDestroy(stream);
  cudaFreeHost(pages);
}

}  // namespace
}  // namespace ferry
