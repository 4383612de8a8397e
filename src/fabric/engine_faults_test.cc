// TransferEngine tests of what goes wrong, inside one process: a sender over a fault-injecting
// Domain (completion errors, writes that never complete, provider calls that wedge), shm files
// left by dead processes, and options read from the environment.
#include "ferry/fabric.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fabric/engine_internal.h"
#include "fabric/fault_domain.h"
#include "fabric/test_util.h"
#include "fabric/wire.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// Engines whose sender sits on a fault-injecting Domain.
class FaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  const int kTimeoutMs = 300 * testing_util::TimeScale();
  void SetUp() override {
    EngineOptions o = testing_util::TestOptions(GetParam());
    o.transfer_timeout_ms = kTimeoutMs;
    o.control_timeout_ms = kTimeoutMs;
    o.shutdown_timeout_ms = kTimeoutMs;
    auto base = fabric::OpenLibfabricDomain(o, "");
    ASSERT_TRUE(base.ok()) << base.status();
    auto fault = std::make_unique<fabric::FaultInjectionDomain>(std::move(base).value());
    fault_ = fault.get();
    auto a = fabric::CreateEngineWithDomain(o, std::move(fault));
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(a).value();
    auto b = TransferEngine::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(b).value();
    peer_ = *a_->AddPeer(b_->Address());
    src_.assign(1 << 16, 1);
    dst1_.assign(1 << 16, 0);
    dst2_.assign(1 << 16, 0);
    src_reg_ = *a_->RegisterMemory(src_.data(), src_.size());
    dst1_reg_ = *b_->RegisterMemory(dst1_.data(), dst1_.size());
    dst2_reg_ = *b_->RegisterMemory(dst2_.data(), dst2_.size());
  }
  SingleWrite To(const MemoryRegion& dst) {
    SingleWrite w;
    w.src = &src_reg_;
    w.peer = peer_;
    w.dst = dst.remote();
    w.length = 4096;
    return w;
  }
  fabric::FaultInjectionDomain* fault_ = nullptr;
  // A scatter's targets, read by the engine until the scatter ends: declared before the
  // engines, so that they outlive a_ even where an assertion ends a test early.
  std::vector<ScatterTarget> targets_;
  std::unique_ptr<TransferEngine> a_, b_;
  PeerId peer_ = 0;
  std::vector<uint8_t> src_, dst1_, dst2_;
  MemoryRegion src_reg_, dst1_reg_, dst2_reg_;
};

TEST_P(FaultTest, CompletionErrorFailsOnlyThatTransferWithTheProviderMessage) {
  fault_->FailWritesToKey(dst1_reg_.remote().nics[0].key);
  std::atomic<int> n{0};
  Status bad, good;
  ASSERT_TRUE(a_->Write(To(dst1_reg_), Completion::Callback([&](const Status& s) {
                          bad = s;
                          n.fetch_add(1);
                        })).ok());
  ASSERT_TRUE(a_->Write(To(dst2_reg_), Completion::Callback([&](const Status& s) {
                          good = s;
                          n.fetch_add(1);
                        })).ok());
  for (int i = 0; i < 10000 && n.load() < 2; ++i) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(n.load(), 2);
  EXPECT_TRUE(good.ok()) << good;
  EXPECT_EQ(bad.code(), StatusCode::kInternal);
  EXPECT_NE(bad.message().find("write to peer 0"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("injected fault"), std::string::npos) << bad;
  // The peer is not lost by one failed write.
  TransferCounter c;
  ASSERT_TRUE(a_->Write(To(dst2_reg_), Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(c.done.load(), 1u);
}

TEST_P(FaultTest, AWriteThatNeverCompletesFailsAtTheDeadlineAndMarksThePeerLost) {
  fault_->SwallowWritesToKey(dst1_reg_.remote().nics[0].key);
  EXPECT_FALSE(*a_->PeerLost(peer_));
  EXPECT_EQ(a_->PeerLost(peer_ + 1).status().code(), StatusCode::kNotFound);
  TransferCounter c;
  auto start = Clock::now();
  ASSERT_TRUE(a_->Write(To(dst1_reg_), Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  auto waited = Clock::now() - start;
  EXPECT_EQ(c.failed.load(), 1u);
  EXPECT_GE(waited, std::chrono::milliseconds(kTimeoutMs));
  EXPECT_LT(waited, 5s * testing_util::TimeScale());
  EXPECT_EQ(a_->Write(To(dst2_reg_), {}).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(*a_->PeerLost(peer_));
  // Added again, the peer it was is a new one that carries writes.
  auto again = a_->AddPeer(b_->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, peer_);
  EXPECT_FALSE(*a_->PeerLost(*again));
  peer_ = *again;
  TransferCounter d;
  ASSERT_TRUE(a_->Write(To(dst2_reg_), Completion::Counter(&d)).ok());
  ASSERT_TRUE(d.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(d.done.load(), 1u);
}

// A scatter with a target in a peer that is then removed (the moe relay forgets a rank it
// masked as lost) fails at once with Unavailable, not at its deadline with DeadlineExceeded.
TEST_P(FaultTest, AScatterToARemovedPeerFailsAtOnce) {
  fault_->SwallowWritesToKey(dst1_reg_.remote().nics[0].key);
  const PeerId members[] = {peer_};
  auto group = a_->AddPeerGroup(members);
  ASSERT_TRUE(group.ok()) << group.status();
  const RemoteRegion dsts[] = {dst1_reg_.remote()};
  auto plan = a_->PrepareScatter(*group, src_reg_, dsts);
  ASSERT_TRUE(plan.ok()) << plan.status();
  targets_ = {{0, 0, 0, 4096}};
  auto ended = std::make_shared<std::atomic<bool>>(false);
  auto got = std::make_shared<Status>();
  ASSERT_TRUE(a_->Scatter({*plan, targets_, 5u}, Completion::Callback([=](const Status& s) {
                            *got = s;
                            ended->store(true);
                          })).ok());
  std::this_thread::sleep_for(20ms);  // posted, and swallowed
  EXPECT_FALSE(ended->load());
  const Status removed = a_->RemovePeer(peer_);
  ASSERT_TRUE(removed.ok()) << removed;
  for (int i = 0; i < 10000 && !ended->load(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(ended->load());
  EXPECT_EQ(got->code(), StatusCode::kUnavailable) << *got;
}

// A provider call that never returns (shm does this when a peer dies holding its lock) must not
// hang the engine's callers: a control operation times out, and later ones fail at once while
// the worker takes none up; destruction abandons the engine. A Revoke then says its
// registration may still be open (and leaves the region empty).
TEST_P(FaultTest, AWedgedProviderCallNeverHangsTheCaller) {
  constexpr uint32_t kMirrored = 41;
  ASSERT_TRUE(a_->CreateImmCounter(kMirrored).ok());
  std::vector<uint8_t> fenced_bytes(4096);
  auto fenced = a_->RegisterMemory(fenced_bytes.data(), fenced_bytes.size());
  ASSERT_TRUE(fenced.ok()) << fenced.status();
  fault_->Wedge();
  TransferCounter c;
  ASSERT_TRUE(a_->Write(To(dst2_reg_), Completion::Counter(&c)).ok());
  for (int i = 0; i < 5000 && !fault_->InsideWedge(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(fault_->InsideWedge());
  std::vector<uint8_t> more(4096);
  auto start = Clock::now();
  auto reg = a_->RegisterMemory(more.data(), more.size());
  EXPECT_EQ(reg.status().code(), StatusCode::kDeadlineExceeded) << reg.status();
  EXPECT_LT(Clock::now() - start, 5s * testing_util::TimeScale());
  uint64_t word = 7;  // MirrorImm runs on the worker too: it fails at once, the worker stuck
  start = Clock::now();
  Status mirrored = a_->MirrorImm(kMirrored, &word);
  EXPECT_EQ(mirrored.code(), StatusCode::kDeadlineExceeded) << mirrored;
  EXPECT_NE(mirrored.message().find("stuck"), std::string::npos) << mirrored;
  EXPECT_LT(Clock::now() - start, 5s * testing_util::TimeScale());
  start = Clock::now();
  Status revoked = a_->Revoke(*fenced);
  EXPECT_EQ(revoked.code(), StatusCode::kDeadlineExceeded) << revoked;
  EXPECT_NE(revoked.message().find("may still be open"), std::string::npos) << revoked;
  EXPECT_FALSE(fenced->valid());
  EXPECT_LT(Clock::now() - start, 5s * testing_util::TimeScale());
  src_reg_ = MemoryRegion();  // releasing a region of a wedged engine returns too
  start = Clock::now();
  a_.reset();  // abandons the engine: returns after shutdown_timeout_ms
  EXPECT_LT(Clock::now() - start, 5s * testing_util::TimeScale());
  EXPECT_EQ(c.done.load() + c.failed.load(), 0u);  // the abandoned transfer never reports
  fault_->Unwedge();  // let the leaked worker run off before the peer goes away
  for (int i = 0; i < 5000 && fault_->InsideWedge(); ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(word, 7u) << "the worker took up the word of a MirrorImm that had timed out";
}

// A rank killed before closing its shm endpoint leaves its file in /dev/shm. libfabric's shm
// refuses (EBUSY) to reuse a file whose recorded owner is alive, which is what a reused PID looks
// like; CI once failed that way. Engines name their own files and sweep those of dead processes.
TEST(ShmFilesTest, LeftoverFilesOfDeadProcessesAreRemovedAndNeverCollide) {
  const auto providers = testing_util::Providers();
  if (std::find(providers.begin(), providers.end(), "shm") == providers.end()) {
    GTEST_SKIP() << "shm is not among FERRY_TEST_PROVIDERS";
  }
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);  // reaped: the PID is dead
  const std::string dead = "ferry-" + std::to_string(child) + "-00000000deadbeef:0:0";
  const std::string live = "ferry-" + std::to_string(getpid()) + "-00000000feedface:0:0";
  for (const std::string& name : {dead, live}) {
    int fd = shm_open(name.c_str(), O_RDWR | O_CREAT, S_IRUSR | S_IWUSR);
    ASSERT_GE(fd, 0) << name;
    close(fd);
  }
  auto engine = TransferEngine::Create(testing_util::TestOptions("shm"));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto exists = [](const std::string& name) {
    return access(("/dev/shm/" + name).c_str(), F_OK) == 0;
  };
  EXPECT_FALSE(exists(dead)) << "a dead process's file survived";
  EXPECT_TRUE(exists(live)) << "a live process's file was removed";
  shm_unlink(live.c_str());
}

INSTANTIATE_TEST_SUITE_P(Providers, FaultTest, ::testing::ValuesIn(testing_util::Providers()),
                         testing_util::ProviderTestName);

// EngineOptions::FromEnv takes what the FERRY_* variables say and refuses what they cannot mean,
// naming the variable; unset or empty variables leave the defaults.
TEST(EngineOptionsTest, FromEnvTakesTheVariablesAndRefusesGarbage) {
  const char* const kVars[] = {"FERRY_SPIN_US",    "FERRY_MAX_WRS",  "FERRY_CUDA_MEMORY",
                               "FERRY_WORKER_CPU", "FERRY_NUM_NICS", "FERRY_PORT"};
  for (const char* v : kVars) unsetenv(v);
  const EngineOptions defaults;
  auto plain = EngineOptions::FromEnv();
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->spin_us, defaults.spin_us);
  EXPECT_EQ(plain->max_outstanding_wrs, defaults.max_outstanding_wrs);

  setenv("FERRY_SPIN_US", "-1", 1);
  setenv("FERRY_MAX_WRS", "64", 1);
  setenv("FERRY_CUDA_MEMORY", "1", 1);
  setenv("FERRY_WORKER_CPU", "", 1);  // empty: the default
  setenv("FERRY_PORT", "40123", 1);
  auto set = EngineOptions::FromEnv();
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->spin_us, -1);
  EXPECT_EQ(set->max_outstanding_wrs, 64u);
  EXPECT_TRUE(set->cuda_memory);
  EXPECT_EQ(set->worker_cpu, defaults.worker_cpu);
  EXPECT_EQ(set->port, 40123);

  testing_util::ExpectEnvRefused(EngineOptions::FromEnv,
                                 {{"FERRY_MAX_WRS", "lots"},
                                  {"FERRY_MAX_WRS", "64k"},
                                  {"FERRY_MAX_WRS", "-1"},
                                  {"FERRY_MAX_WRS", "99999999999"},
                                  {"FERRY_CUDA_MEMORY", "2"},
                                  {"FERRY_WORKER_CPU", "-2"},
                                  {"FERRY_NUM_NICS", "two"},
                                  {"FERRY_PORT", "65536"},
                                  {"FERRY_PORT", "-1"}});
  for (const char* v : kVars) unsetenv(v);
}

// The verbs backend's settings come through EngineOptions::verbs: FromEnv reads FERRY_IB_* in
// decimal and 0x hex, refuses what a field cannot hold (naming the variable), and leaves the
// defaults where they are unset.
TEST(EngineOptionsTest, FromEnvReadsTheVerbsSettings) {
  const char* const kVars[] = {"FERRY_IB_QKEY", "FERRY_IB_PORT", "FERRY_IB_RELAXED_ORDERING",
                               "FERRY_IB_TIMEOUT", "FERRY_IB_MAX_UNCLAIMED",
                               "FERRY_IB_RELEASE_MS"};
  for (const char* v : kVars) unsetenv(v);
  auto plain = EngineOptions::FromEnv();
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->verbs.qkey, VerbsOptions{}.qkey);
  setenv("FERRY_IB_QKEY", "0x11", 1);
  setenv("FERRY_IB_PORT", "2", 1);
  setenv("FERRY_IB_RELAXED_ORDERING", "0", 1);
  setenv("FERRY_IB_MAX_UNCLAIMED", "64", 1);
  setenv("FERRY_IB_RELEASE_MS", "250", 1);
  auto set = EngineOptions::FromEnv();
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->verbs.qkey, 0x11u);
  EXPECT_EQ(set->verbs.port, 2);
  EXPECT_FALSE(set->verbs.relaxed_ordering);
  EXPECT_EQ(set->verbs.max_unclaimed_peers, 64u);
  EXPECT_EQ(set->verbs.release_delay_ms, 250u);
  testing_util::ExpectEnvRefused(EngineOptions::FromEnv, {{"FERRY_IB_PORT", "300"},
                                                         {"FERRY_IB_PORT", "one"},
                                                         {"FERRY_IB_RELAXED_ORDERING", "yes"},
                                                         {"FERRY_IB_TIMEOUT", "14us"},
                                                         {"FERRY_IB_RELEASE_MS", "-1"}});
  for (const char* v : kVars) unsetenv(v);
}

// EngineOptions::port: a tcp engine listens there (its endpoint name, a sockaddr, carries it),
// a second engine on the same port is refused while the first lives and takes it once the first
// is gone; NICs take port + k; a provider without ports refuses one, saying so.
TEST(EngineOptionsTest, APortIsWhereATcpEngineListens) {
  EngineOptions options = testing_util::TestOptions("tcp;ofi_rxm");
  options.port = testing_util::FreeLoopbackPort();
  ASSERT_NE(options.port, 0);
  auto port_of = [](const std::vector<uint8_t>& address) -> int {
    auto parsed = fabric::EngineAddress::Parse(address);
    if (!parsed.ok() || parsed->nics.empty() || parsed->nics[0].name.size() < 4) return -1;
    const std::vector<uint8_t>& name = parsed->nics[0].name;  // sockaddr_in: family, port (BE)
    return name[2] << 8 | name[3];
  };
  auto first = TransferEngine::Create(options);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(port_of((*first)->Address()), options.port);
  auto second = TransferEngine::Create(options);
  EXPECT_FALSE(second.ok()) << "two engines listen on port " << options.port;
  const std::vector<uint8_t> before = (*first)->Address();
  first->reset();
  auto again = TransferEngine::Create(options);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(port_of((*again)->Address()), options.port);
  EXPECT_NE((*again)->Address(), before) << "a new engine keeps its own id and keys";
  again->reset();

  options.num_nics = 2;  // one interface, two endpoints: port and port + 1
  auto two = TransferEngine::Create(options);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  auto parsed = fabric::EngineAddress::Parse((*two)->Address());
  ASSERT_TRUE(parsed.ok() && parsed->nics.size() == 2);
  EXPECT_EQ(parsed->nics[1].name[2] << 8 | parsed->nics[1].name[3], options.port + 1);
  two->reset();

  EngineOptions shm = testing_util::TestOptions("shm");
  shm.port = 40000;
  auto refused = TransferEngine::Create(shm);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("FERRY_PORT"), std::string::npos)
      << refused.status().ToString();
}

}  // namespace
}  // namespace ferry
