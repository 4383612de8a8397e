// GpuWords: its refusals (these run in CI, where no GPU is), and on a GPU a kernel that waits on
// an immediate counter the engine mirrors into one of its words (TransferEngine::MirrorImm), in
// each placement this machine offers: mapped host memory always, GPU memory where GDRCopy is.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include "fabric/test_util.h"
#include "ferry/gpu_words.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

bool HaveGpu() { return access("/dev/nvidia0", F_OK) == 0; }

TEST(GpuWordsTest, RefusesBadCountsAndDevices) {
  for (size_t count : {size_t{0}, GpuWords::kMaxWords + 1}) {
    auto words = GpuWords::Create(0, count);
    EXPECT_EQ(words.status().code(), StatusCode::kInvalidArgument) << count;
    EXPECT_NE(words.status().message().find("words"), std::string::npos) << words.status();
  }
  EXPECT_EQ(GpuWords::Create(-1, 4).status().code(), StatusCode::kInvalidArgument);
  auto far = GpuWords::Create(4096, 4);
  EXPECT_EQ(far.status().code(),
            HaveGpu() ? StatusCode::kInvalidArgument : StatusCode::kFailedPrecondition)
      << far.status();
}

// gdrcopy = false keeps the words in mapped host memory and says why; the environment is not
// read here (CudaTuning::FromEnv reads FERRY_GDRCOPY for the relay).
TEST(GpuWordsTest, GdrcopyFalseKeepsTheWordsInHostMemory) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  setenv("FERRY_GDRCOPY", "yes", 1);  // would be refused if anything here read it
  auto words = GpuWords::Create(0, 4, /*gdrcopy=*/false);
  unsetenv("FERRY_GDRCOPY");
  ASSERT_TRUE(words.ok()) << words.status();
  EXPECT_EQ((*words)->placement(), GpuWords::Placement::kMappedHost);
  EXPECT_NE((*words)->gdrcopy_status().find("not asked for"), std::string::npos);
}

TEST(GpuWordsTest, WithoutAGpuCreateSaysSo) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is here";
  auto words = GpuWords::Create(0, 4);
  EXPECT_EQ(words.status().code(), StatusCode::kFailedPrecondition) << words.status();
}

// Spins, acquiring at system scope, until *word reaches `target` or `budget_ns` pass; records
// what it saw in *seen (0 if it gave up).
__global__ void WaitForTotalKernel(const uint64_t* word, uint64_t target, uint64_t budget_ns,
                                   uint64_t* seen) {
  uint64_t start = 0, now = 0, value = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
    if (value >= target) {
      *seen = value;
      return;
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < budget_ns);
  *seen = 0;
}

// Three immediates over shm raise counter 21's total to 3 while a kernel waits on word 0 of
// `words` (word 1 takes what the kernel saw).
void KernelWaitsOnTheMirroredCount(GpuWords& words) {
  auto engines = testing_util::MakeEnginePair("shm");
  ASSERT_TRUE(engines.ok()) << engines.status();
  auto& [a, b, b_on_a] = *engines;
  ASSERT_TRUE(b->CreateImmCounter(21).ok());
  ASSERT_TRUE(b->MirrorImm(21, &words.host_words()[0]).ok());
  uint64_t* on_gpu = words.device_words();
  WaitForTotalKernel<<<1, 1>>>(on_gpu, 3, 10'000'000'000ull, on_gpu + 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  TransferCounter sent;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(a->WriteImm(b_on_a, 21, Completion::Counter(&sent)).ok());
  }
  ASSERT_TRUE(sent.Wait(3, Deadline::After(10s)).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto seen = words.Load(1);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, 3u) << "the kernel gave up (0) or saw another total";
  EXPECT_EQ(*words.Load(0), 3u);
  ASSERT_TRUE(b->MirrorImm(21, nullptr).ok());  // before the words go
}

TEST(GpuWordsTest, AKernelWaitsOnAMirroredCountInMappedHostMemory) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  auto words = GpuWords::Create(0, 2, /*gdrcopy=*/false);
  ASSERT_TRUE(words.ok()) << words.status();
  EXPECT_EQ((*words)->placement(), GpuWords::Placement::kMappedHost);
  EXPECT_EQ((*words)->gdrcopy_status(), "GDRCopy not asked for");
  EXPECT_EQ((*words)->size(), 2u);
  EXPECT_EQ(*(*words)->Load(0), 0u) << "not zeroed";
  EXPECT_EQ((*words)->Load(2).status().code(), StatusCode::kInvalidArgument);
  KernelWaitsOnTheMirroredCount(**words);
}

// GPU memory where GDRCopy works here; otherwise mapped host memory, saying why.
TEST(GpuWordsTest, AKernelWaitsOnAMirroredCountWhereverGpuWordsPutIt) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  auto words = GpuWords::Create(0, 2);
  ASSERT_TRUE(words.ok()) << words.status();
  if ((*words)->placement() == GpuWords::Placement::kGpuMemory) {
    EXPECT_TRUE((*words)->gdrcopy_status().empty()) << (*words)->gdrcopy_status();
  } else {
    EXPECT_NE((*words)->gdrcopy_status().find("GDRCopy"), std::string::npos)
        << (*words)->gdrcopy_status();
    if (access("/dev/gdrdrv", F_OK) != 0) {
      EXPECT_NE((*words)->gdrcopy_status().find("/dev/gdrdrv"), std::string::npos)
          << (*words)->gdrcopy_status();
    }
  }
  KernelWaitsOnTheMirroredCount(**words);
}

}  // namespace
}  // namespace ferry
