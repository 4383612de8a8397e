// The GPU-visible layer counter: increments enqueued on a stream reach the host in order, after
// the work before them. The leader's view of every TP rank's GPU cache (KvCudaShards). Without a
// GPU, both say so at Create.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/kv.h"

namespace ferry {
namespace {

__global__ void Fill(uint64_t* data, uint64_t value, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    data[i] = value;
  }
}

using namespace std::chrono_literals;

#define CUDA_OK(expr) CHECK_OR_RETURN((expr) == cudaSuccess, #expr)

// First in the file: it forks ranks, which must happen before this process touches CUDA.
// Three ranks (round-robin on the GPUs), rank 0 the leader: the leader reads every rank's cache
// through its mapping, writes into rank 1's, and rank 1 sees it.
TEST(KvCudaShardsTest, TheLeaderMapsEveryRanksCache) {
  const bool gpu = access("/dev/nvidia0", F_OK) == 0;
  auto exits = RunLocalRanks(gpu ? 3 : 1, [&](Bootstrap& b) -> Status {
    CHECK_OR_RETURN(KvCudaShards::Create(b, 7, 0, 4096, 10s).status().code() ==
                        StatusCode::kInvalidArgument,
                    "a leader outside the ranks was accepted");
    if (!gpu) {
      auto none = KvCudaShards::Create(b, 0, 0, 4096, 10s);
      CHECK_OR_RETURN(none.status().code() == StatusCode::kFailedPrecondition ||
                          none.status().code() == StatusCode::kUnimplemented,
                      "without a GPU: " + none.status().ToString());
      return Status::Ok();
    }
    int devices = 0;
    CUDA_OK(cudaGetDeviceCount(&devices));
    const int device = b.rank() % devices;
    CUDA_OK(cudaSetDevice(device));
    constexpr int64_t kBytes = 3 << 20;
    ASSIGN_OR_RETURN(auto shards, KvCudaShards::Create(b, 0, device, kBytes, 30s));
    CUDA_OK(cudaMemset(shards->local(), 0x10 + b.rank(), kBytes));
    CUDA_OK(cudaDeviceSynchronize());
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 0) {
      CHECK_OR_RETURN(shards->leader_view().size() == 3, "leader view of the wrong size");
      std::vector<uint8_t> host(kBytes);
      for (int r = 0; r < 3; ++r) {
        CUDA_OK(cudaMemcpy(host.data(), shards->leader_view()[r], kBytes, cudaMemcpyDefault));
        for (int64_t i = 0; i < kBytes; i += 4093) {
          CHECK_OR_RETURN(host[i] == 0x10 + r, "rank " + std::to_string(r) + " byte " +
                                                   std::to_string(i) + " reads " +
                                                   std::to_string(host[i]));
        }
      }
      CUDA_OK(cudaMemset(shards->leader_view()[1], 0x77, 4096));
      CUDA_OK(cudaDeviceSynchronize());
      // The engine: registering a shard needs CUDA memory support in the provider (shm here
      // has none on the lent machine: Unimplemented, not a crash or a wrong region).
      EngineOptions options = testing_util::TestOptions("shm");
      options.cuda_memory = true;
      auto engine = TransferEngine::Create(options);
      if (engine.ok()) {
        auto region = (*engine)->RegisterMemory(shards->leader_view()[1], kBytes,
                                                MemoryKind::kCuda, 1 % devices);
        CHECK_OR_RETURN(region.ok() || region.status().code() == StatusCode::kUnimplemented,
                        "registering a shard: " + region.status().ToString());
      }
    } else {
      CHECK_OR_RETURN(shards->leader_view().empty(), "a non-leader has a leader view");
    }
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 1) {
      std::vector<uint8_t> host(8192);
      CUDA_OK(cudaMemcpy(host.data(), shards->local(), host.size(), cudaMemcpyDeviceToHost));
      CHECK_OR_RETURN(host[0] == 0x77 && host[4095] == 0x77 && host[4096] == 0x11,
                      "the leader's write did not reach rank 1's cache");
    }
    return b.Barrier(30s);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
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
