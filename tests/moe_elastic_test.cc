// Elastic membership (AllToAll::Readmit / Join / Resize): four ranks as
// processes over shm, a fifth standing by to replace one. A lost rank is masked by the
// survivors, a new process takes its rank id, and the next epochs equal a world that never
// broke, bit for bit; the process it replaced, woken, writes nothing into them; a readmission
// that never completes leaves the survivors as they were; twenty readmissions leave the
// survivors flat; the world grows to six ranks and shrinks back (on both devices).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/numerics.h"
#include "moe_buf.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

constexpr int kWorld = 4, kTokens = 4, kHidden = 64, kK = 2;

// A world's shape: its ranks and experts (a resized world has others).
struct Shape {
  int world = kWorld, experts = 8;
  int local() const { return experts / world; }
  int64_t capacity() const { return int64_t{world} * kTokens; }
};

// Rank r's token t in epoch i holds 1 + r + t / 4 + (i mod 32) / 2 in every column (exact in
// bf16, and so are its weighted sums, rounded once), routed to experts (t + r) % E and
// (t + r + E / 2) % E (on two ranks, for 8 experts of 4 ranks and 12 of 4 or 6), weighted 0.5
// and 0.25: the experts are the identity, so each output is its value times the weights of the
// copies that live ranks took.
float Value(int r, int t, uint64_t epoch) {
  return 1.0f + r + t * 0.25f + 0.5f * float(epoch % 32);
}
int Expert(const Shape& s, int r, int t, int j) {
  return (t + r + s.experts / 2 * j) % s.experts;
}
float Weight(int j) { return j == 0 ? 0.5f : 0.25f; }
using Ranks = std::vector<bool>;
const Ranks kAll = {true, true, true, true}, kWithout2 = {true, true, false, true};

// Where the ranks run: the host device, or the CUDA device on this machine's first GPU with
// every rank a node of its own (the relay between them) or all in one node (their memory
// mapped into each other's).
enum class Where { kHost, kCudaNodeEach, kCudaOneNode };

AllToAllConfig Config(int rank, const Shape& s = {}, Where where = Where::kHost) {
  AllToAllConfig c{.world_size = s.world, .rank = rank, .num_experts = s.experts,
                   .experts_per_token = kK, .max_tokens_per_rank = kTokens, .hidden = kHidden,
                   .dtype = DispatchDtype::kBf16, .mask_lost_peers = true};
  if (where != Where::kHost) {
    c.device = MoeDeviceKind::kCuda;
    c.ranks_per_node = where == Where::kCudaNodeEach ? 1 : s.world;
  }
  return c;
}

// One rank's AllToAll and buffers; `epoch` is that of its next dispatch.
struct Member {
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<AllToAll> a2a;
  int rank = 0;
  Shape shape;
  uint64_t epoch = 0;
  bool cuda = false;  // the buffers' GPU halves are what the steps use
  Buf<uint16_t> x, out_x, y;
  Buf<int32_t> idx, counts;
  Buf<float> w;
};

StatusOr<std::unique_ptr<TransferEngine>> Engine() {
  EngineOptions options = testing_util::TestOptions("shm");
  // Long: a rank masked as lost is forgotten as the engine's peer, which ends what is pending
  // to it at once (see moe_mask_test).
  options.transfer_timeout_ms = 30000;
  return TransferEngine::Create(options);
}

// Rank `rank`'s buffers and routing in a world of `shape` (on the GPU where m.cuda).
Status Buffers(Member& m, int rank, const Shape& shape = {}) {
  m.rank = rank;
  m.shape = shape;
#if FERRY_HAVE_CUDA
  if (m.cuda) CUDA_OR_RETURN(cudaSetDevice(0));
#endif
  RETURN_IF_ERROR(m.idx.Init(m.cuda, kTokens * kK, 0));
  RETURN_IF_ERROR(m.w.Init(m.cuda, kTokens * kK, 0.0f));
  for (int t = 0; t < kTokens; ++t) {
    for (int j = 0; j < kK; ++j) {
      m.idx.host[t * kK + j] = Expert(shape, rank, t, j);
      m.w.host[t * kK + j] = Weight(j);
    }
  }
  RETURN_IF_ERROR(m.idx.Push());
  RETURN_IF_ERROR(m.w.Push());
  RETURN_IF_ERROR(m.x.Init(m.cuda, kTokens * kHidden, 0));
  RETURN_IF_ERROR(m.out_x.Init(m.cuda, size_t(shape.local() * shape.capacity() * kHidden), 0));
  RETURN_IF_ERROR(m.y.Init(m.cuda, kTokens * kHidden, 0));
  return m.counts.Init(m.cuda, size_t(shape.local()), 0);
}

// A rank of the world as it starts, over `bootstrap`.
StatusOr<Member> Create(Bootstrap& bootstrap, Where where = Where::kHost) {
  Member m;
  m.cuda = where != Where::kHost;
  RETURN_IF_ERROR(Buffers(m, bootstrap.rank()));
  ASSIGN_OR_RETURN(m.engine, Engine());
  ASSIGN_OR_RETURN(m.a2a, AllToAll::Create(Config(bootstrap.rank(), {}, where), m.engine.get(),
                                           bootstrap));
  return m;
}

// A new process for rank `group.rank()`, joining the survivors over `group`.
StatusOr<Member> Join(Bootstrap& group, const Shape& shape = {}, Where where = Where::kHost) {
  Member m;
  m.cuda = where != Where::kHost;
  RETURN_IF_ERROR(Buffers(m, group.rank(), shape));
  ASSIGN_OR_RETURN(m.engine, Engine());
  ASSIGN_OR_RETURN(m.a2a, AllToAll::Join(Config(group.rank(), shape, where), m.engine.get(),
                                         group, 30s));
  return m;
}

Status Dispatch(Member& m, Deadline deadline) {
  for (int t = 0; t < kTokens; ++t) {
    std::fill_n(m.x.host.begin() + t * kHidden, kHidden,
                FloatToBf16(Value(m.rank, t, m.epoch)));
  }
  RETURN_IF_ERROR(m.x.Push());
  std::fill(m.counts.host.begin(), m.counts.host.end(), -1);
  RETURN_IF_ERROR(m.counts.Push());
  RETURN_IF_ERROR(m.a2a->DispatchSend({m.x.ptr(), nullptr, m.idx.ptr(), m.w.ptr(), kTokens}));
  return m.a2a->DispatchRecv({m.out_x.ptr(), nullptr, m.counts.ptr()}, deadline);
}

// What the epoch's dispatch gave us from the senders in `sent` (each in token order, sender by
// sender), then its combine, summed from the expert ranks in `live`: both exact.
Status Finish(Member& m, const Ranks& sent, const Ranks& live, Deadline deadline) {
  const std::string at = "rank " + std::to_string(m.rank) + " epoch " + std::to_string(m.epoch);
  const Shape& shape = m.shape;
  RETURN_IF_ERROR(m.counts.Pull());
  RETURN_IF_ERROR(m.out_x.Pull());
  for (int e = 0; e < shape.local(); ++e) {
    std::vector<float> want;
    for (int s = 0; s < shape.world; ++s) {
      for (int t = 0; sent[s] && t < kTokens; ++t) {
        for (int j = 0; j < kK; ++j) {
          if (Expert(shape, s, t, j) == m.rank * shape.local() + e) {
            want.push_back(Value(s, t, m.epoch));
          }
        }
      }
    }
    CHECK_OR_RETURN(m.counts.host[e] == int(want.size()),
                    at + ": " + std::to_string(m.counts.host[e]) + " rows for local expert " +
                        std::to_string(e) + ", want " + std::to_string(want.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      const float got =
          Bf16ToFloat(m.out_x.host[(e * shape.capacity() + int64_t(i)) * kHidden + i % kHidden]);
      CHECK_OR_RETURN(got == want[i], at + ": row " + std::to_string(i) + " of local expert " +
                                          std::to_string(e) + " holds " + std::to_string(got));
    }
  }
  RETURN_IF_ERROR(m.a2a->CombineSend(m.out_x.ptr()));
  RETURN_IF_ERROR(m.a2a->CombineRecv({m.y.ptr(), false}, deadline));
  RETURN_IF_ERROR(m.y.Pull());
  for (int t = 0; t < kTokens; ++t) {
    float weight = 0;
    for (int j = 0; j < kK; ++j) {
      weight += live[Expert(shape, m.rank, t, j) / shape.local()] ? Weight(j) : 0;
    }
    const float want = Bf16ToFloat(FloatToBf16(Value(m.rank, t, m.epoch) * weight));
    for (int i = 0; i < kHidden; ++i) {
      const float got = Bf16ToFloat(m.y.host[t * kHidden + i]);
      CHECK_OR_RETURN(got == want, at + ": token " + std::to_string(t) + " combined to " +
                                       std::to_string(got) + ", want " + std::to_string(want));
    }
  }
  ++m.epoch;
  return Status::Ok();
}

Status Epoch(Member& m, const Ranks& ranks, Deadline deadline) {
  RETURN_IF_ERROR(Dispatch(m, deadline));
  return Finish(m, ranks, ranks, deadline);
}

Status ExpectView(const Member& m, const std::vector<uint8_t>& masked, uint64_t version) {
  ASSIGN_OR_RETURN(auto got, m.a2a->Masked());
  CHECK_OR_RETURN(got == masked && m.a2a->membership_version() == version,
                  "rank " + std::to_string(m.rank) + ": rank 2 masked " +
                      std::to_string(got[2]) + ", membership version " +
                      std::to_string(m.a2a->membership_version()));
  return Status::Ok();
}

StatusOr<std::unique_ptr<Bootstrap>> Rendezvous(const std::string& address, int rank,
                                                 int world = kWorld) {
  return JoinRendezvous({.address = address, .world_size = world, .rank = rank, .timeout = 60s});
}

std::string LoopbackAddress() {
  return "127.0.0.1:" + std::to_string(testing_util::FreeLoopbackPort());
}

// One byte through a pipe between two ranks' processes, read within `within`.
Status Signal(int fd) {
  const char c = 1;
  CHECK_OR_RETURN(write(fd, &c, 1) == 1, "pipe write");
  return Status::Ok();
}
Status AwaitSignal(int fd, std::chrono::milliseconds within = 20s) {
  pollfd p{fd, POLLIN, 0};
  CHECK_OR_RETURN(poll(&p, 1, int(within.count())) == 1, "no signal through the pipe in time");
  char c;
  CHECK_OR_RETURN(read(fd, &c, 1) == 1, "pipe read");
  return Status::Ok();
}

// Rank 2 stalls after epoch 2's dispatch, before it returns any combine rows (its test thread
// waits; its engine runs on, as a slow rank's would: a process stopped whole could stop inside
// the shm provider holding a lock its peers then spin on, which no real NIC has): the
// survivors mask it at their combine's deadline and run epoch 3 without it. A fifth process
// joins as rank 2 and the survivors readmit it. The old rank 2 is woken -- before the
// readmission (kBefore: its epoch-2 combine rows land under the keys it holds, and their
// immediates are counted; one left standing would raise the flag of epoch 6, which shares
// epoch 2's tag) or after it (kAfter: they go under keys revoked since, and are refused) --
// and sends its epoch-2 combine rows. Epochs 4 to 11 (every epoch tag twice) run all four
// ranks and equal a world that never broke, bit for bit. (Without the counted immediates
// dropped, kBefore fails at epoch 6 or 7; without the old keys revoked, so does kAfter.)
enum class Woken { kBefore, kAfter };

// On the host device, and on the CUDA device both ways (skipped without a GPU).
class MoeElasticTest : public ::testing::TestWithParam<std::tuple<Woken, Where>> {};

TEST_P(MoeElasticTest, ALostRankIsReplacedFencedAndTheNextEpochsAreWholeAgain) {
  const bool before = std::get<0>(GetParam()) == Woken::kBefore;
  const Where where = std::get<1>(GetParam());
#if FERRY_HAVE_CUDA
  if (where != Where::kHost && !HaveGpu()) GTEST_SKIP() << "no GPU";
#else
  if (where != Where::kHost) GTEST_SKIP() << "built without CUDA";
#endif
  const std::string first = LoopbackAddress(), second = LoopbackAddress();
  // Rank 0 to the old rank 2 (go on); it to rank 0 (it sent); ranks 1 and 3 to rank 0 (their
  // epoch 3 is over: rows that land after it are no epoch's they still read).
  int resume[2], woke[2], quiet[2];
  ASSERT_EQ(pipe(resume), 0);
  ASSERT_EQ(pipe(woke), 0);
  ASSERT_EQ(pipe(quiet), 0);
  auto exits = RunLocalRanks(kWorld + 1, [&](Bootstrap& launcher) -> Status {
    const int me = launcher.rank();  // 4: the replacement
    if (me == kWorld) {
      RETURN_IF_ERROR(launcher.Barrier(60s));
      ASSIGN_OR_RETURN(auto group, Rendezvous(second, 2));
      ASSIGN_OR_RETURN(Member m, Join(*group, {}, where));
      CHECK_OR_RETURN(m.a2a->membership_version() == 1,
                      "joined at version " + std::to_string(m.a2a->membership_version()));
      m.epoch = 4;  // the survivors' next epoch, where Join's AllToAll starts
      for (int i = 0; i < 8; ++i) {
        // Our combine rows come late, so that a survivor whose flag for them went up early
        // (a stale immediate) reads the rows of an epoch before.
        RETURN_IF_ERROR(Dispatch(m, Deadline::After(30s)));
        std::this_thread::sleep_for(50ms);
        RETURN_IF_ERROR(Finish(m, kAll, kAll, Deadline::After(30s)));
      }
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(auto world, Rendezvous(first, me));
    ASSIGN_OR_RETURN(Member m, Create(*world, where));
    for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    RETURN_IF_ERROR(Dispatch(m, Deadline::After(30s)));
    RETURN_IF_ERROR(launcher.Barrier(60s));  // every rank has had epoch 2's dispatch
    if (me == 2) {
      RETURN_IF_ERROR(AwaitSignal(resume[0], 120s));
      // Woken by rank 0: this epoch's combine rows go out under the keys we were given.
      (void)m.a2a->CombineSend(m.out_x.ptr());
      (void)m.a2a->CombineRecv({m.y.ptr(), false}, Deadline::After(1s));
      std::this_thread::sleep_for(300ms);  // our relay's writes end (shm: microseconds)
      return Signal(woke[1]);
    }
    RETURN_IF_ERROR(Finish(m, kAll, kWithout2, Deadline::After(1s)));
    RETURN_IF_ERROR(ExpectView(m, {0, 0, 1, 0}, 0));
    RETURN_IF_ERROR(Epoch(m, kWithout2, Deadline::After(30s)));
    // Rank 0 wakes the old rank 2 once no survivor reads an epoch it could still write into
    // (moe.h: a rank masked as lost is presumed gone until the fence).
    if (me != 0) RETURN_IF_ERROR(Signal(quiet[1]));
    auto wake = [&]() -> Status {
      RETURN_IF_ERROR(AwaitSignal(quiet[0]));
      RETURN_IF_ERROR(AwaitSignal(quiet[0]));
      RETURN_IF_ERROR(Signal(resume[1]));
      return AwaitSignal(woke[0]);
    };
    if (me == 0 && before) RETURN_IF_ERROR(wake());
    ASSIGN_OR_RETURN(auto group, Rendezvous(second, me));
    const auto start = Clock::now();
    RETURN_IF_ERROR(m.a2a->Readmit(*group, 30s));
    if (me == 0) {
      std::fprintf(stderr, "readmission took %.1f ms\n",
                   std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
    RETURN_IF_ERROR(ExpectView(m, {0, 0, 0, 0}, 1));
    if (me == 0 && !before) RETURN_IF_ERROR(wake());
    for (int i = 0; i < 8; ++i) RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    return Status::Ok();
  }, 180s);
  for (int r = 0; r <= kWorld; ++r) EXPECT_TRUE(exits[r].ok()) << "process " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Woken, MoeElasticTest,
    ::testing::Combine(::testing::Values(Woken::kBefore, Woken::kAfter),
                       ::testing::Values(Where::kHost, Where::kCudaNodeEach, Where::kCudaOneNode)),
    [](const auto& info) {
      const Where w = std::get<1>(info.param);
      return std::string(w == Where::kHost           ? "Host"
                         : w == Where::kCudaNodeEach ? "CudaNodeEach"
                                                     : "CudaOneNode") +
             (std::get<0>(info.param) == Woken::kBefore ? "BeforeTheFence" : "AfterTheFence");
    });

// Rank 2 leaves cleanly: the others mask it before the same epoch and go on without it. A new
// process takes rank 2's place in a group and dies before it joins: every survivor's Readmit
// fails within its timeout, and the world is as it was (rank 2 masked, version 0, the next
// epoch exact without it). The process that left then comes back (a new engine, AllToAll::Join)
// and the world is whole again.
TEST(MoeElasticJoinTest, AJoinThatNeverCompletesLeavesTheWorldAsItWas) {
  const std::string first = LoopbackAddress(), failing = LoopbackAddress(),
                    again = LoopbackAddress();
  auto exits = RunLocalRanks(kWorld + 1, [&](Bootstrap& launcher) -> Status {
    const int me = launcher.rank();
    if (me == kWorld) {  // joins the group, then dies before it meets the survivors
      ASSIGN_OR_RETURN(auto group, Rendezvous(failing, 2));
      raise(SIGKILL);
    }
    ASSIGN_OR_RETURN(auto world, Rendezvous(first, me));
    ASSIGN_OR_RETURN(Member m, Create(*world));
    RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    if (me == 2) {  // leaves; comes back as a new AllToAll on a new engine
      m.a2a.reset();
      m.engine.reset();
      ASSIGN_OR_RETURN(auto group, Rendezvous(again, 2));
      ASSIGN_OR_RETURN(Member back, Join(*group));
      back.epoch = 3;
      return Epoch(back, kAll, Deadline::After(30s));
    }
    RETURN_IF_ERROR(m.a2a->SetMasked(2, true));
    RETURN_IF_ERROR(Epoch(m, kWithout2, Deadline::After(30s)));
    {
      ASSIGN_OR_RETURN(auto group, Rendezvous(failing, me));
      const auto start = Clock::now();
      Status s = m.a2a->Readmit(*group, 3s);
      CHECK_OR_RETURN(!s.ok() && Clock::now() - start < 20s,
                      "a readmission with a dead joiner: " + s.ToString());
    }
    RETURN_IF_ERROR(ExpectView(m, {0, 0, 1, 0}, 0));
    RETURN_IF_ERROR(Epoch(m, kWithout2, Deadline::After(30s)));
    {
      ASSIGN_OR_RETURN(auto group, Rendezvous(again, me));
      RETURN_IF_ERROR(m.a2a->Readmit(*group, 30s));
    }
    RETURN_IF_ERROR(ExpectView(m, {0, 0, 0, 0}, 1));
    RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    return Status::Ok();
  }, 180s);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(exits[r].ok()) << "process " << r;
  EXPECT_EQ(exits[kWorld].signal, SIGKILL);
}

// The world grows from four ranks to six and shrinks back (AllToAll::Resize on the ranks that
// stay, AllToAll::Join on the two new processes, which leave again), twelve experts laid out
// three and then two per rank: every epoch exact for the world it ran in, the handle's
// config() and membership version following. A rank that has masked another may not resize,
// and a resize to another device is refused by name. On the host device, and on the CUDA
// device both ways (made anew at each resize; skipped without a GPU).
class MoeElasticResizeTest : public ::testing::TestWithParam<Where> {};

TEST_P(MoeElasticResizeTest, TheWorldGrowsFromFourToSixRanksAndShrinksBackExactly) {
  const Where where = GetParam();
#if FERRY_HAVE_CUDA
  if (where != Where::kHost && !HaveGpu()) GTEST_SKIP() << "no GPU";
#else
  if (where != Where::kHost) GTEST_SKIP() << "built without CUDA";
#endif
  const std::string first = LoopbackAddress(), grown = LoopbackAddress(),
                    shrunk = LoopbackAddress();
  const Shape four{4, 12}, six{6, 12};
  const Ranks all6(6, true);
  auto exits = RunLocalRanks(6, [&](Bootstrap& launcher) -> Status {
    const int me = launcher.rank();
    Member m;
    m.cuda = where != Where::kHost;
    if (me >= 4) {  // new in the grown world; leaves when it shrinks
      ASSIGN_OR_RETURN(auto group, Rendezvous(grown, me, 6));
      ASSIGN_OR_RETURN(m, Join(*group, six, where));
      m.epoch = 2;
      for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(Epoch(m, all6, Deadline::After(30s)));
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(auto world, Rendezvous(first, me));
    RETURN_IF_ERROR(Buffers(m, me, four));
    ASSIGN_OR_RETURN(m.engine, Engine());
    ASSIGN_OR_RETURN(m.a2a,
                     AllToAll::Create(Config(me, four, where), m.engine.get(), *world));
    for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    AllToAllConfig other = Config(me, four);
    other.device = where == Where::kHost ? MoeDeviceKind::kCuda : MoeDeviceKind::kHost;
    CHECK_OR_RETURN(m.a2a->Resize(other, *world, 1s).code() == StatusCode::kInvalidArgument,
                    "a resize onto another device was not refused");
    {
      ASSIGN_OR_RETURN(auto group, Rendezvous(grown, me, 6));
      RETURN_IF_ERROR(m.a2a->Resize(Config(me, six, where), *group, 30s));
    }
    RETURN_IF_ERROR(Buffers(m, me, six));
    CHECK_OR_RETURN(m.a2a->config().world_size == 6 && m.a2a->membership_version() == 1,
                    "grown: world " + std::to_string(m.a2a->config().world_size));
    for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(Epoch(m, all6, Deadline::After(30s)));
    {
      ASSIGN_OR_RETURN(auto group, Rendezvous(shrunk, me));
      RETURN_IF_ERROR(m.a2a->Resize(Config(me, four, where), *group, 30s));
    }
    RETURN_IF_ERROR(Buffers(m, me, four));
    CHECK_OR_RETURN(m.a2a->config().world_size == 4 && m.a2a->membership_version() == 2,
                    "shrunk: world " + std::to_string(m.a2a->config().world_size));
    for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    // A rank that has masked another may not resize: what the masked rank sends could land.
    if (me != 1) RETURN_IF_ERROR(m.a2a->SetMasked(1, true));
    if (me != 1) {
      CHECK_OR_RETURN(m.a2a->Resize(Config(me, four, where), *world, 1s).code() ==
                          StatusCode::kFailedPrecondition,
                      "a resize with a masked rank was not refused");
    }
    return Status::Ok();
  }, 180s);
  for (int r = 0; r < 6; ++r) EXPECT_TRUE(exits[r].ok()) << "process " << r;
}

INSTANTIATE_TEST_SUITE_P(Where, MoeElasticResizeTest,
                         ::testing::Values(Where::kHost, Where::kCudaNodeEach,
                                           Where::kCudaOneNode),
                         [](const auto& info) {
                           return std::string(info.param == Where::kHost ? "Host"
                                              : info.param == Where::kCudaNodeEach
                                                  ? "CudaNodeEach"
                                                  : "CudaOneNode");
                         });

// This process's open descriptors and resident pages.
int OpenDescriptors() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += fcntl(fd, F_GETFD) != -1;
  return n;
}
// This process's anonymous memory (its heap and stacks: /proc/self/smaps_rollup's Anonymous),
// not the shm provider's file-backed regions, whose pages count as private once the peer that
// shared them is gone.
long AnonymousKiB() {
  long kib = 0;
  if (FILE* f = std::fopen("/proc/self/smaps_rollup", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f)) {
      if (std::sscanf(line, "Anonymous: %ld kB", &kib) == 1) break;
    }
    std::fclose(f);
  }
  return kib;
}

// Twenty cycles of a rank leaving and coming back (a new engine and AllToAll each time; the
// launcher's bootstrap is the group, both processes being the same): each cycle's epoch after
// the readmission is exact, and from the third cycle to the last the survivor's descriptors
// stay flat and its anonymous memory within 256 KiB (a readmission takes no engine table
// entries: the group and scatter plan change in place, the old inbox key is revoked).
// Measured over shm, 2026-12-07: 64 KiB more anonymous memory over 77 readmissions, the count
// of mappings flat; resident memory grew about 10 KiB a readmission, all of it the shm
// provider's shared regions, whose pages a peer's exit moves from shared to private.
TEST(MoeElasticSoakTest, TwentyReadmissionsKeepDescriptorsFlatAndMemoryBounded) {
  constexpr int kCycles = 20;
  auto exits = RunLocalRanks(kWorld, [](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Member m, Create(b));
    RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
    int fds = 0;
    long kib = 0;
    for (int cycle = 0; cycle < kCycles; ++cycle) {
      if (m.rank == 2) {  // leaves, then comes back on a new engine
        const uint64_t next = m.epoch + 1;
        m.a2a.reset();
        m.engine.reset();
        ASSIGN_OR_RETURN(m.engine, Engine());
        ASSIGN_OR_RETURN(m.a2a, AllToAll::Join(Config(2), m.engine.get(), b, 30s));
        m.epoch = next;
      } else {
        RETURN_IF_ERROR(m.a2a->SetMasked(2, true));
        RETURN_IF_ERROR(Epoch(m, kWithout2, Deadline::After(30s)));
        RETURN_IF_ERROR(m.a2a->Readmit(b, 30s));
        RETURN_IF_ERROR(ExpectView(m, {0, 0, 0, 0}, uint64_t(cycle + 1)));
      }
      RETURN_IF_ERROR(Epoch(m, kAll, Deadline::After(30s)));
      if (m.rank == 0 && cycle == 2) {
        fds = OpenDescriptors();
        kib = AnonymousKiB();
      }
    }
    if (m.rank == 0) {
      const int fds_now = OpenDescriptors();
      const long kib_now = AnonymousKiB();
      std::fprintf(stderr, "after %d readmissions: %d descriptors (%d at the third), %ld KiB "
                   "anonymous (%ld)\n", kCycles, fds_now, fds, kib_now, kib);
      CHECK_OR_RETURN(kib > 0, "no Anonymous line in /proc/self/smaps_rollup");
      CHECK_OR_RETURN(fds_now == fds && kib_now - kib < 256,
                      "descriptors " + std::to_string(fds) + " -> " + std::to_string(fds_now) +
                          ", anonymous KiB " + std::to_string(kib) + " -> " +
                          std::to_string(kib_now));
    }
    return Status::Ok();
  }, 300s);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry
