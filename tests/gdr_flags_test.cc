// GdrFlags: where GDRCopy is missing (this CI, and the lent GPU machine: no /dev/gdrdrv) Open
// says Unavailable and why, touching no GPU; where it is there, words the host writes through the
// mapping (then fences) are what the GPU's memory holds. The same logic runs here against a fake
// libgdrapi over host memory (tests/fake_gdrapi.cc): the alignment, the host pointer from
// gdr_get_info, both info versions, each step's failure releasing what the steps before it
// took, and GpuWords in that memory as an immediate counter's mirror (MirrorImm).
#include "common/gdr_flags.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/gpu_words_internal.h"
#include "fabric/test_util.h"

namespace ferry {
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

// GdrFlags over the fake library: a device node that exists (a file of the test's), "device
// memory" mapped shared and filled with 0xAB (so Open's zeroing shows), each range counted until
// it is freed.
class FakeGdrTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A node of this process's own: ctest runs each test as a process, several at once, and
    // one's TearDown must not remove another's node.
    node_ = ::testing::TempDir() + "fake_gdrdrv." + std::to_string(getpid());
    std::ofstream(node_).put('\n');
    // Both versions held for the test, so that the library GdrFlags loads is the one whose
    // counter we read (and the counter lives on when GdrFlags unloads it).
    for (const char* library : {FAKE_GDRAPI, FAKE_GDRAPI_V1}) {
      void* lib = dlopen(library, RTLD_NOW | RTLD_LOCAL);
      ASSERT_NE(lib, nullptr) << dlerror();
      libs_.push_back(lib);
      live_of_[library] = reinterpret_cast<int (*)()>(dlsym(lib, "fake_gdr_live"));
      ASSERT_NE(live_of_[library], nullptr) << library;
    }
    unsetenv("FAKE_GDR_FAIL");
  }
  void TearDown() override {
    unsetenv("FAKE_GDR_FAIL");
    for (void* lib : libs_) dlclose(lib);
    unlink(node_.c_str());
  }

  // What the fake library `library` has open, pinned or mapped now.
  int Live(const char* library = FAKE_GDRAPI) { return live_of_.at(library)(); }

  GdrFlags::Env Env(const char* library = FAKE_GDRAPI) {
    GdrFlags::Env env;
    env.device_node = node_;
    env.libraries = {library};
    env.where = "host memory";
    env.alloc = [this](size_t bytes) -> void* {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
      std::memset(p, 0xAB, bytes);
      ranges_[p] = bytes;
      return p;
    };
    env.zero = [](void* p, size_t bytes) {
      std::memset(p, 0, bytes);
      return true;
    };
    env.free = [this](void* p) {
      munmap(p, ranges_.at(p));
      ranges_.erase(p);
    };
    return env;
  }

  // Open fails at the step FAKE_GDR_FAIL names, saying `text`, and leaves nothing behind.
  void ExpectFailure(const char* step, const std::string& text) {
    setenv("FAKE_GDR_FAIL", step, 1);
    auto flags = GdrFlags::Open(8, Env());
    ASSERT_FALSE(flags.ok()) << step;
    EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable) << step;
    EXPECT_NE(flags.status().message().find(text), std::string::npos) << flags.status();
    EXPECT_EQ(Live(), 0) << step << ": a handle, pin or mapping left";
    EXPECT_TRUE(ranges_.empty()) << step << ": the memory not freed";
  }

  std::string node_;
  std::vector<void*> libs_;
  std::map<std::string, int (*)()> live_of_;
  std::map<void*, size_t> ranges_;
};

TEST_F(FakeGdrTest, HostWritesShowInTheDeviceWords) {
  for (const char* library : {FAKE_GDRAPI, FAKE_GDRAPI_V1}) {  // gdr_get_info_v2, then v1 only
    {
      auto flags = GdrFlags::Open(8, Env(library));
      ASSERT_TRUE(flags.ok()) << library << ": " << flags.status();
      GdrFlags& f = **flags;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(f.device_words()) % (uintptr_t{1} << 16), 0u);
      EXPECT_NE(f.host_words(), f.device_words());  // a second mapping of the same pages
      EXPECT_EQ(Live(library), 3);                  // open, pinned, mapped
      for (int i = 0; i < 8; ++i) {
        EXPECT_EQ(f.device_words()[i], 0u) << i;
        f.host_words()[i] = 1000 + i;
      }
      for (int i = 0; i < 8; ++i) EXPECT_EQ(f.device_words()[i], uint64_t(1000 + i)) << i;
    }
    EXPECT_EQ(Live(library), 0) << library;
    EXPECT_TRUE(ranges_.empty()) << library;
  }
}

// GpuWords in "GPU memory" (the fake's) as MirrorImm's word: the engine's worker stores the
// counter's total through the write-combining host mapping, and the device side holds it.
TEST_F(FakeGdrTest, MirrorImmReachesTheDeviceWordsThroughTheMapping) {
  using namespace std::chrono_literals;
  {
    auto flags = GdrFlags::Open(4, Env());
    ASSERT_TRUE(flags.ok()) << flags.status();
    std::unique_ptr<GpuWords> words = GpuWordsOver(std::move(flags).value(), 0, 4);
    EXPECT_EQ(words->placement(), GpuWords::Placement::kGpuMemory);
    EXPECT_TRUE(words->gdrcopy_status().empty()) << words->gdrcopy_status();
    EXPECT_NE(words->host_words(), words->device_words());

    auto engines = testing_util::MakeEnginePair("shm");
    ASSERT_TRUE(engines.ok()) << engines.status();
    auto& [a, b, b_on_a] = *engines;
    ASSERT_TRUE(b->CreateImmCounter(31).ok());
    ASSERT_TRUE(b->MirrorImm(31, &words->host_words()[2]).ok());
    TransferCounter sent;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(a->WriteImm(b_on_a, 31, Completion::Counter(&sent)).ok());
    }
    ASSERT_TRUE(sent.Wait(3, Deadline::After(10s)).ok());
    ASSERT_TRUE(b->WaitImm(31, 3, Deadline::After(10s)).ok());
    const Deadline deadline = Deadline::After(10s);
    std::atomic_ref<uint64_t> on_device(words->device_words()[2]);
    while (on_device.load(std::memory_order_acquire) != 3 && !deadline.Expired()) {
    }
    EXPECT_EQ(on_device.load(std::memory_order_acquire), 3u);
    EXPECT_EQ(*words->Load(2), 3u);
    EXPECT_EQ(*words->Load(1), 0u) << "a neighbour written";
    ASSERT_TRUE(b->MirrorImm(31, nullptr).ok());  // before the words go
  }
  EXPECT_EQ(Live(), 0);
  EXPECT_TRUE(ranges_.empty());
}

TEST_F(FakeGdrTest, EachFailingStepSaysWhichAndReleasesTheOthers) {
  ExpectFailure("open", "gdr_open");
  ExpectFailure("pin", "gdr_pin_buffer");
  ExpectFailure("map", "gdr_map");
  ExpectFailure("info", "gdr_get_info failed");
  ExpectFailure("va", "does not hold the flags");
}

TEST_F(FakeGdrTest, NoNodeNoLibraryOrNoMemorySaysSo) {
  GdrFlags::Env env = Env();
  env.device_node = node_ + ".absent";
  auto flags = GdrFlags::Open(8, env);
  EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(flags.status().message().find(env.device_node), std::string::npos) << flags.status();

  flags = GdrFlags::Open(8, Env("/nonexistent/libgdrapi.so.2"));
  EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(flags.status().message().find("no library found (tried: /nonexistent/libgdrapi.so.2)"),
            std::string::npos)
      << flags.status();

  flags = GdrFlags::Open(8, Env("libc.so.6"));  // a library, without the gdr_* calls
  EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(flags.status().message().find("lacks"), std::string::npos) << flags.status();

  env = Env();
  env.free = nullptr;
  EXPECT_EQ(GdrFlags::Open(8, env).status().code(), StatusCode::kInvalidArgument);

  env = Env();
  env.alloc = [](size_t) -> void* { return nullptr; };
  flags = GdrFlags::Open(8, env);
  EXPECT_EQ(flags.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(flags.status().message().find("no device memory for the flags on host memory"),
            std::string::npos)
      << flags.status();
  EXPECT_EQ(Live(), 0);
}

}  // namespace
}  // namespace ferry
