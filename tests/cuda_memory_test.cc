// CUDA device memory through the TransferEngine: registration succeeds where the provider has
// FI_HMEM_CUDA support, and says Unimplemented (never crashes) where it does not. Skips without
// a GPU, so CI (no GPU) only compiles it.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "fabric/test_util.h"
#include "ferry/fabric.h"

namespace ferry {
namespace {

class CudaMemoryTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaMemoryTest, RegistersDeviceMemoryOrSaysUnimplemented) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no GPU";
  void* ptr = nullptr;
  ASSERT_EQ(cudaMalloc(&ptr, 1 << 20), cudaSuccess);
  EngineOptions options = testing_util::TestOptions(GetParam());
  options.cuda_memory = true;
  auto engine = TransferEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto region = (*engine)->RegisterMemory(ptr, 1 << 20, MemoryKind::kCuda, 0);
  if (region.ok()) {
    EXPECT_EQ(region->kind(), MemoryKind::kCuda);
    EXPECT_EQ(region->remote().length, 1u << 20);
  } else {
    EXPECT_EQ(region.status().code(), StatusCode::kUnimplemented) << region.status();
    std::printf("provider %s: %s\n", GetParam().c_str(), region.status().ToString().c_str());
  }
  region = StatusOr<MemoryRegion>(CancelledError("released"));
  // Without cuda_memory the engine refuses device memory up front.
  auto plain = TransferEngine::Create(testing_util::TestOptions(GetParam()));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->RegisterMemory(ptr, 1 << 20, MemoryKind::kCuda, 0).status().code(),
            StatusCode::kFailedPrecondition);
  plain->reset();
  engine->reset();
  cudaFree(ptr);
}

INSTANTIATE_TEST_SUITE_P(Providers, CudaMemoryTest, ::testing::ValuesIn(testing_util::Providers()),
                         testing_util::ProviderTestName);

}  // namespace
}  // namespace ferry
