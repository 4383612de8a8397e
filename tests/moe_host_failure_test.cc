// The moe protocol on the host device when a peer fails: a rank that dies mid-protocol or at
// each step, and one that hangs, end their peers' waits at the deadline, naming the rank and
// what they waited for, and the epoch finishes after it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/numerics.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// A rank that dies mid-protocol: the survivor's receive half ends at its deadline naming the
// rank and the section it waited for, and tearing the AllToAll down does not hang on the relay.
TEST(MoeHostFailureTest, ADeadPeerEndsTheReceiveHalfAtItsDeadline) {
  auto exits = testing_util::RunRanks(2, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    EngineOptions options = testing_util::TestOptions("shm");
    options.transfer_timeout_ms = 1000;  // writes to the dead peer end within a second
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(options));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    if (b.rank() == 1) {
      a2a.reset();
      engine.reset();
      raise(SIGKILL);
    }
    std::vector<uint16_t> x(4 * 128, 0), out_x(4 * 8 * 128);
    std::vector<int32_t> idx = {0, 5, 7, 2}, counts(4);
    std::vector<float> w(4, 0.5f);
    RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 2}));
    auto start = Clock::now();
    Status s = a2a->DispatchRecv({out_x.data(), nullptr, counts.data()}, Deadline::After(1s));
    CHECK_OR_RETURN(s.code() == StatusCode::kDeadlineExceeded, "got " + s.ToString());
    CHECK_OR_RETURN(s.message().find("rank 1's dispatch section of epoch 0") != std::string::npos,
                    s.ToString());
    CHECK_OR_RETURN(Clock::now() - start < 5s, "deadline not kept");
    // Teardown waits (bounded) for the writes to the dead peer to end before freeing buffers.
    start = Clock::now();
    a2a.reset();
    CHECK_OR_RETURN(Clock::now() - start < 5s, "teardown hung on the relay");
    std::this_thread::sleep_for(1500ms);  // had a write outlived the buffers, it would crash now
    return Status::Ok();
  }, 120s);
  EXPECT_TRUE(exits[0].ok()) << exits[0].exit_code;
  EXPECT_EQ(exits[1].signal, SIGKILL);
}

// A rank killed after each of the four steps (0: before any): the survivor's first step that
// needs it fails within its deadline (1 s) naming rank 1 -- its section or rows never came, or
// its relay's write to the dead rank failed -- every later step reports the same, and teardown
// does not hang. Where the dead rank's last data did arrive, the survivor finishes that epoch and
// fails in the next. A rank killed inside an shm call can leave a lock of shm's shared memory
// held, wedging the survivor's engine worker in its next call: teardown then costs one control
// timeout (1 s here), every later control operation failing at once.
class MoeHostKillTest : public ::testing::TestWithParam<int> {};

TEST_P(MoeHostKillTest, ThePeersNextStepFailsWithinItsDeadline) {
  const int killed_after = GetParam();
  auto exits = testing_util::RunRanks(2, [&](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    EngineOptions options = testing_util::TestOptions("shm");
    options.transfer_timeout_ms = 1000;
    options.control_timeout_ms = 1000;
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(options));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    std::vector<uint16_t> x(2 * 128, 0), out_x(4 * 8 * 128), y(2 * 128);
    std::vector<int32_t> idx = {0, 5, 7, 2}, counts(4);
    std::vector<float> w(4, 0.5f);
    RETURN_IF_ERROR(b.Barrier(30s));
    const DispatchOutput out{out_x.data(), nullptr, counts.data()};
    if (b.rank() == 1) {
      const std::function<Status()> steps[] = {
          [&] { return a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 2}); },
          [&] { return a2a->DispatchRecv(out, Deadline::After(30s)); },
          [&] { return a2a->CombineSend(out_x.data()); },
      };
      for (int i = 0; i < killed_after; ++i) RETURN_IF_ERROR(steps[i]());
      raise(SIGKILL);
    }
    Status first;  // the survivor's first failed step
    const auto start = Clock::now();
    for (int epoch = 0; epoch < 2 && first.ok(); ++epoch) {
      first = a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 2});
      if (first.ok()) first = a2a->DispatchRecv(out, Deadline::After(1s));
      if (first.ok()) first = a2a->CombineSend(out_x.data());
      if (first.ok()) first = a2a->CombineRecv(y.data(), false, Deadline::After(1s));
    }
    CHECK_OR_RETURN(!first.ok(), "every step succeeded with rank 1 dead");
    CHECK_OR_RETURN(Clock::now() - start < 5s, "failing took too long: " + first.ToString());
    CHECK_OR_RETURN(first.message().find("rank 1") != std::string::npos, first.ToString());
    const auto torn = Clock::now();
    a2a.reset();
    CHECK_OR_RETURN(Clock::now() - torn < 5s, "teardown hung on the relay");
    return Status::Ok();
  }, 120s);
  EXPECT_TRUE(exits[0].ok()) << exits[0].exit_code;
  EXPECT_EQ(exits[1].signal, SIGKILL);
}

INSTANTIATE_TEST_SUITE_P(Steps, MoeHostKillTest, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) {
                           return std::string("killed_after_step_") + std::to_string(info.param);
                         });

// A rank that hangs with its connections open (SIGSTOP from its peer, before it sends its
// dispatch): the peer's receive half ends at its deadline naming the rank, and the AllToAll
// stays usable -- after SIGCONT the hung rank sends, the same receive half called again gets
// its section, and both ranks finish the epoch and one more with exact outputs.
TEST(MoeHostFailureTest, AHungPeerFailsTheWaitAtItsDeadlineAndTheEpochFinishesAfterIt) {
  auto exits = testing_util::RunRanks(2, [](Bootstrap& b) -> Status {
    const int32_t pid = getpid();
    ASSIGN_OR_RETURN(auto pids, b.AllGather({reinterpret_cast<const uint8_t*>(&pid), 4}, 30s));
    int32_t peer_pid = 0;
    std::memcpy(&peer_pid, pids[1 - b.rank()].data(), 4);
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    // Rank r's tokens: rows of value 1 + r, token 0 to expert 0 and 5, token 1 to 7 and 2.
    std::vector<uint16_t> x(2 * 128, FloatToBf16(1.0f + b.rank())), out_x(4 * 8 * 128);
    std::vector<uint16_t> expert_out(4 * 8 * 128), y(2 * 128);
    std::vector<int32_t> idx = {0, 5, 7, 2}, counts(4);
    std::vector<float> w(4, 0.5f);
    for (int epoch = 0; epoch < 2; ++epoch) {
      RETURN_IF_ERROR(b.Barrier(30s));
      if (epoch == 0 && b.rank() == 0) {
        CHECK_OR_RETURN(kill(peer_pid, SIGSTOP) == 0, "SIGSTOP");
      }
      if (epoch == 0 && b.rank() == 1) std::this_thread::sleep_for(300ms);  // stopped in here
      RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 2}));
      const DispatchOutput out{out_x.data(), nullptr, counts.data()};
      if (epoch == 0 && b.rank() == 0) {
        const auto start = Clock::now();
        const Status s = a2a->DispatchRecv(out, Deadline::After(1s));
        CHECK_OR_RETURN(s.code() == StatusCode::kDeadlineExceeded, "got " + s.ToString());
        CHECK_OR_RETURN(s.message().find("rank 1's dispatch section of epoch 0") !=
                            std::string::npos,
                        s.ToString());
        CHECK_OR_RETURN(Clock::now() - start < 3s, "deadline not kept");
        CHECK_OR_RETURN(kill(peer_pid, SIGCONT) == 0, "SIGCONT");
      }
      RETURN_IF_ERROR(a2a->DispatchRecv(out, Deadline::After(30s)));
      // Each local expert got one copy from each rank: values 1 and 2, in rank order.
      for (int e = 0; e < 4; ++e) {
        CHECK_OR_RETURN(counts[e] == 2 || counts[e] == 0, "expert " + std::to_string(e));
        for (int i = 0; i < counts[e]; ++i) {
          const float v = Bf16ToFloat(out_x[(size_t(e) * 8 + i) * 128]);
          CHECK_OR_RETURN(v == 1.0f + i, "expert " + std::to_string(e) + " row " +
                                             std::to_string(i) + " holds " + std::to_string(v));
        }
      }
      std::copy(out_x.begin(), out_x.end(), expert_out.begin());  // experts: the identity
      RETURN_IF_ERROR(a2a->CombineSend(expert_out.data()));
      RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, Deadline::After(30s)));
      // Both copies of each token come back with weight 0.5 each: the token's own row.
      for (int i = 0; i < 2 * 128; ++i) {
        CHECK_OR_RETURN(Bf16ToFloat(y[i]) == 1.0f + b.rank(), "combined column " +
                                                                   std::to_string(i));
      }
    }
    return b.Barrier(30s);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry
