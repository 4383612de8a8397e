// GdrFlags: where GDRCopy is missing (this CI, and the lent GPU machine: no /dev/gdrdrv) Open
// says Unavailable and why, touching no GPU; where it is there, words the host writes through the
// mapping (then fences) are what the GPU's memory holds.
#include "moe/cuda/gdr_flags.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <vector>

namespace ferry::moe {
namespace {

TEST(GdrFlagsTest, OpensOrSaysWhyNot) {
  auto flags = GdrFlags::Open(8, 0);
  if (access("/dev/gdrdrv", F_OK) != 0) {
    ASSERT_FALSE(flags.ok());
    EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(flags.status().message().find("/dev/gdrdrv"), std::string::npos) << flags.status();
    return;
  }
  if (!flags.ok()) {  // the driver is there, the library or the pinning is not
    EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable) << flags.status();
    GTEST_SKIP() << flags.status();
  }
  GdrFlags& f = **flags;
  for (int i = 0; i < 8; ++i) {
    std::atomic_ref<uint64_t>(f.host_words()[i]).store(1000 + i, std::memory_order_release);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  std::vector<uint64_t> back(8, 0);
  ASSERT_EQ(cudaMemcpy(back.data(), f.device_words(), 8 * sizeof(uint64_t),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(back[i], uint64_t(1000 + i)) << i;
}

TEST(GdrFlagsTest, NoWordsOrMoreThanOnePageIsRefused) {
  EXPECT_EQ(GdrFlags::Open(0, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(GdrFlags::Open(8193, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::moe
