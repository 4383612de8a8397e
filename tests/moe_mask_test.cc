// Rank masks (AllToAll::SetMasked, AllToAllConfig::mask_lost_peers), and the per-rank wait
// costs (DispatchOutput / CombineOutput::wait_cost) that point at a slow or lost rank: ranks as
// processes on localhost. A masked rank is left out of every step: the copies routed to its
// experts add nothing, nothing it sends is read, no step waits for it. Each survivor checks its
// dispatch counts and rows and its combined output exactly against what the live ranks alone
// give.
// Every case runs on the host device over shm and, where there is a GPU, on the CUDA device:
// one node (NVLink, the kernels' own masks) and a node per rank (the relay's, which the kernels
// publish). Without a GPU the CUDA cases skip.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe_buf.h"
#if FERRY_HAVE_CUDA
#include "moe_cuda_util.h"
#include "moe/numerics.h"
#endif

namespace ferry {
namespace {

using namespace std::chrono_literals;

constexpr int kWorld = 3, kTokens = 4, kHidden = 128, kExperts = 6, kK = 2;
constexpr int kLocal = kExperts / kWorld;
constexpr int64_t kCapacity = int64_t{kWorld} * kTokens;

// Rank r's token t in epoch i: every column holds 1 + r + t / 4 + 2i (exact in bf16, and so
// are its weighted sums), routed to experts (t + r) % 6 and (t + r + 3) % 6 -- one on each of
// two ranks -- with weights 0.5 and 0.25.
float Value(int r, int t, int epoch) { return 1.0f + r + t * 0.25f + 2.0f * epoch; }
int Expert(int r, int t, int j) { return (t + r + 3 * j) % kExperts; }
float Weight(int j) { return j == 0 ? 0.5f : 0.25f; }

// Where the AllToAll runs: the host device, or the CUDA device with every rank in one node
// (NVLink) or each in a node of its own (the relay, over shm).
enum class Where { kHost, kCudaOneNode, kCudaRelay };

struct Rank {
  std::unique_ptr<TransferEngine> engine;  // null on the CUDA device in one node
  std::unique_ptr<AllToAll> a2a;
  Buf<uint16_t> x, out_x, y;
  Buf<int32_t> idx, counts;
  Buf<float> w;
  Buf<int64_t> dispatch_cost, combine_cost;  // [kWorld] wait costs, where a test asks for them
  int me = 0;
  int epoch = 0;  // of the next Dispatch
};

StatusOr<Rank> MakeRank(Bootstrap& b, Where where, bool mask_lost_peers) {
  Rank r;
  r.me = b.rank();
  AllToAllConfig cfg{.world_size = kWorld, .rank = b.rank(), .num_experts = kExperts,
                     .experts_per_token = kK, .max_tokens_per_rank = kTokens, .hidden = kHidden,
                     .dtype = DispatchDtype::kBf16, .mask_lost_peers = mask_lost_peers};
  const bool cuda = where != Where::kHost;
#if FERRY_HAVE_CUDA
  if (cuda) {
    cfg.ranks_per_node = where == Where::kCudaOneNode ? kWorld : 1;
    cfg.max_private_tokens = 2;
    RETURN_IF_ERROR(UseGpu(b, &cfg));
  }
#endif
  if (where != Where::kCudaOneNode) {
    EngineOptions options = testing_util::TestOptions("shm");
    // Without masks, writes to a dead peer end within a second. With them, the transfer timeout
    // is left long: a rank masked as lost is forgotten as the engine's peer, which must end the
    // writes still pending to it at once (else the survivors' next exchange waits for them, and
    // they mask each other).
    options.transfer_timeout_ms = mask_lost_peers ? 30000 : 1000;
    ASSIGN_OR_RETURN(r.engine, TransferEngine::Create(options));
  }
  ASSIGN_OR_RETURN(r.a2a, AllToAll::Create(cfg, r.engine.get(), b));
  RETURN_IF_ERROR(r.idx.Init(cuda, size_t(kTokens) * kK, 0));
  RETURN_IF_ERROR(r.w.Init(cuda, size_t(kTokens) * kK, 0.0f));
  for (int t = 0; t < kTokens; ++t) {
    for (int j = 0; j < kK; ++j) {
      r.idx.host[size_t(t) * kK + j] = Expert(b.rank(), t, j);
      r.w.host[size_t(t) * kK + j] = Weight(j);
    }
  }
  RETURN_IF_ERROR(r.idx.Push());
  RETURN_IF_ERROR(r.w.Push());
  RETURN_IF_ERROR(r.x.Init(cuda, size_t(kTokens) * kHidden, 0));
  RETURN_IF_ERROR(r.out_x.Init(cuda, size_t(kLocal) * kCapacity * kHidden, 0));
  RETURN_IF_ERROR(r.y.Init(cuda, size_t(kTokens) * kHidden, 0));
  RETURN_IF_ERROR(r.counts.Init(cuda, kLocal, -1));
  RETURN_IF_ERROR(r.dispatch_cost.Init(cuda, kWorld, 0));
  RETURN_IF_ERROR(r.combine_cost.Init(cuda, kWorld, 0));
  return r;
}

// The dispatch rank `me` received from the senders in `sent_by` (ranks whose tokens were sent to
// it this epoch; itself always), checked row by row.
Status CheckDispatch(Rank& r, int me, const std::vector<bool>& sent_by) {
  for (int e = 0; e < kLocal; ++e) {
    const int expert = me * kLocal + e;
    std::vector<float> want;  // sender-major, each sender's in token order
    for (int s = 0; s < kWorld; ++s) {
      for (int t = 0; s == me || sent_by[s] ? t < kTokens : false; ++t) {
        for (int j = 0; j < kK; ++j) {
          if (Expert(s, t, j) == expert) want.push_back(Value(s, t, r.epoch));
        }
      }
    }
    CHECK_OR_RETURN(r.counts.host[e] == static_cast<int>(want.size()),
                    "rank " + std::to_string(me) + " expert " + std::to_string(expert) + ": " +
                        std::to_string(r.counts.host[e]) + " rows, want " +
                        std::to_string(want.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      const float got = Bf16ToFloat(r.out_x.host[(size_t(e) * kCapacity + i) * kHidden]);
      CHECK_OR_RETURN(got == want[i], "rank " + std::to_string(me) + " expert " +
                                          std::to_string(expert) + " row " + std::to_string(i) +
                                          ": " + std::to_string(got));
    }
  }
  return Status::Ok();
}

// The combined output (the identity as the experts): for each token, its value times the
// weights of its copies routed to ranks in `live`. Ends the epoch.
Status CheckCombine(Rank& r, int me, const std::vector<bool>& live) {
  for (int t = 0; t < kTokens; ++t) {
    float weight = 0;
    for (int j = 0; j < kK; ++j) {
      if (live[Expert(me, t, j) / kLocal]) weight += Weight(j);
    }
    const float want = Value(me, t, r.epoch) * weight;
    for (int i = 0; i < kHidden; ++i) {
      const float got = Bf16ToFloat(r.y.host[size_t(t) * kHidden + i]);
      CHECK_OR_RETURN(got == Bf16ToFloat(FloatToBf16(want)),
                      "rank " + std::to_string(me) + " token " + std::to_string(t) + ": " +
                          std::to_string(got) + ", want " + std::to_string(want));
    }
  }
  ++r.epoch;
  return Status::Ok();
}

// CheckDispatch, then the combine run (its wait costs added to r.combine_cost with `cost`) and
// checked (CheckCombine).
Status CheckEpoch(Rank& r, int me, const std::vector<bool>& sent_by,
                  const std::vector<bool>& live, bool cost = false) {
  RETURN_IF_ERROR(CheckDispatch(r, me, sent_by));
  RETURN_IF_ERROR(r.a2a->CombineSend(r.out_x.ptr()));
  CombineOutput to{r.y.ptr(), false};
  if (cost) to.wait_cost = r.combine_cost.ptr();
  RETURN_IF_ERROR(r.a2a->CombineRecv(to, Deadline::After(1s)));
  RETURN_IF_ERROR(r.y.Pull());
  return CheckCombine(r, me, live);
}

// This epoch's rows into x, and counts reset, on the host and (CUDA) the GPU.
Status FillInputs(Rank& r) {
  for (int t = 0; t < kTokens; ++t) {
    std::fill_n(r.x.host.begin() + t * kHidden, kHidden, FloatToBf16(Value(r.me, t, r.epoch)));
  }
  RETURN_IF_ERROR(r.x.Push());
  std::fill(r.counts.host.begin(), r.counts.host.end(), -1);
  return r.counts.Push();
}

// One dispatch; with `cost`, its wait costs added to r.dispatch_cost.
Status Dispatch(Rank& r, Deadline deadline, bool cost = false) {
  RETURN_IF_ERROR(FillInputs(r));
  RETURN_IF_ERROR(r.a2a->DispatchSend({r.x.ptr(), nullptr, r.idx.ptr(), r.w.ptr(), kTokens}));
  DispatchOutput out{r.out_x.ptr(), nullptr, r.counts.ptr()};
  if (cost) out.wait_cost = r.dispatch_cost.ptr();
  RETURN_IF_ERROR(r.a2a->DispatchRecv(out, deadline));
  RETURN_IF_ERROR(r.out_x.Pull());
  return r.counts.Pull();
}

// The fewest seconds a wait cost can stand for: nanoseconds on the host device; GPU clock
// cycles on the CUDA device, read at 2 GHz, above the 1.98 GHz an H100's or H200's SMs run at
// most (the bounds below leave room for a GPU clocked at half that).
double LeastSeconds(const Rank& r, int64_t cost) {
  return static_cast<double>(cost) / (r.dispatch_cost.cuda ? 2e9 : 1e9);
}

// What a cost buffer's entries gained since they held `held` each, pulled to the host.
StatusOr<std::vector<int64_t>> Gained(Buf<int64_t>& b, int64_t held) {
  RETURN_IF_ERROR(b.Pull());
  std::vector<int64_t> gained = b.host;
  for (int64_t& g : gained) g -= held;
  return gained;
}

Status ExpectMasks(const AllToAll& a2a, const std::vector<uint8_t>& want) {
  ASSIGN_OR_RETURN(auto masks, a2a.Masked());
  CHECK_OR_RETURN(masks == want, "masks " + std::to_string(masks[0]) + std::to_string(masks[1]) +
                                     std::to_string(masks[2]));
  return Status::Ok();
}

class MoeMaskTest : public ::testing::TestWithParam<Where> {
 protected:
  void SetUp() override {
#if FERRY_HAVE_CUDA
    if (GetParam() != Where::kHost && !HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
#endif
  }
};

// Rank 2 dies before its first step. Under mask_lost_peers the survivors' first dispatch masks
// it at the deadline and finishes OK with each other's tokens; the combine leaves out what went
// to rank 2's experts; the next epoch waits for nobody.
TEST_P(MoeMaskTest, ARankThatDiedIsMaskedAtTheDeadlineAndTheSurvivorsGoOnExactly) {
  auto exits = RunLocalRanks(kWorld, [where = GetParam()](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Rank r, MakeRank(b, where, true));
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 2) {
      r.a2a.reset();
      r.engine.reset();
      raise(SIGKILL);
    }
    int64_t masked_cost = 0;
    const std::vector<bool> live = {true, true, false};
    for (int epoch = 0; epoch < 3; ++epoch) {
      const auto start = Clock::now();
      RETURN_IF_ERROR(Dispatch(r, Deadline::After(1s), true));
      RETURN_IF_ERROR(CheckEpoch(r, b.rank(), live, live, true));
      RETURN_IF_ERROR(ExpectMasks(*r.a2a, {0, 0, 1}));
      // The dispatch wait that masked rank 2 is in its entry; a masked rank is waited for no
      // more, by the dispatches after it or by any combine.
      ASSIGN_OR_RETURN(const std::vector<int64_t> cost, Gained(r.dispatch_cost, 0));
      ASSIGN_OR_RETURN(const std::vector<int64_t> combine, Gained(r.combine_cost, 0));
      if (epoch == 0) masked_cost = cost[2];
      CHECK_OR_RETURN(LeastSeconds(r, cost[2]) > 0.4 && cost[2] == masked_cost &&
                          combine[2] == 0,
                      "epoch " + std::to_string(epoch) + ": rank 2's wait costs " +
                          std::to_string(cost[2]) + " (" + std::to_string(masked_cost) +
                          " after epoch 0), combine " + std::to_string(combine[2]));
      const auto took = Clock::now() - start;
      CHECK_OR_RETURN(epoch == 0 ? took < 5s : took < 500ms,
                      "epoch " + std::to_string(epoch) + " took " +
                          std::to_string(std::chrono::duration<double>(took).count()) + " s");
    }
    const auto torn = Clock::now();
    r.a2a.reset();
    CHECK_OR_RETURN(Clock::now() - torn < 5s, "teardown hung on the relay");
    return Status::Ok();
  }, 120s);
  EXPECT_TRUE(exits[0].ok()) << exits[0].exit_code;
  EXPECT_TRUE(exits[1].ok()) << exits[1].exit_code;
  EXPECT_EQ(exits[2].signal, SIGKILL);
}

// After an epoch of all three, rank 2 dies after its dispatch, before it returns any combine
// rows: the survivors received its tokens, and their combine masks it at the deadline, leaving
// out what went to its experts (its rows of the epoch before, still where this epoch's would
// have landed, add nothing). The next epoch receives nothing from it.
TEST_P(MoeMaskTest, ARankThatDiedMidEpochIsMaskedAtTheCombine) {
  auto exits = RunLocalRanks(kWorld, [where = GetParam()](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Rank r, MakeRank(b, where, true));
    const std::vector<bool> all = {true, true, true}, live = {true, true, false};
    RETURN_IF_ERROR(Dispatch(r, Deadline::After(30s)));
    RETURN_IF_ERROR(CheckEpoch(r, b.rank(), all, all));
    RETURN_IF_ERROR(Dispatch(r, Deadline::After(30s)));
    // Rank 2's dispatch returns once the others' sections reached it; its relay may still be
    // posting its own. It dies once every rank has had this epoch's dispatch.
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 2) raise(SIGKILL);
    RETURN_IF_ERROR(CheckEpoch(r, b.rank(), all, live));
    RETURN_IF_ERROR(ExpectMasks(*r.a2a, {0, 0, 1}));
    RETURN_IF_ERROR(Dispatch(r, Deadline::After(1s)));
    RETURN_IF_ERROR(CheckEpoch(r, b.rank(), live, live));
    return Status::Ok();
  }, 120s);
  EXPECT_TRUE(exits[0].ok()) << exits[0].exit_code;
  EXPECT_TRUE(exits[1].ok()) << exits[1].exit_code;
  EXPECT_EQ(exits[2].signal, SIGKILL);
}

// Rank 2 is slow: it sends its dispatch, and later its combine rows, 300 ms after the others.
// Ranks 0 and 1 find in both steps' wait costs (added to what the entries held) a good part of
// those 300 ms in rank 2's entry and a quarter of that or less in the other's; rank 2, whose peers'
// data was there, waited less for anyone than they did for it.
TEST_P(MoeMaskTest, WaitCostsNameTheRankThatKeptTheStepWaiting) {
  auto exits = RunLocalRanks(kWorld, [where = GetParam()](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Rank r, MakeRank(b, where, false));
    const int me = b.rank();
    constexpr int64_t kHeld = 1000;
    for (Buf<int64_t>* cost : {&r.dispatch_cost, &r.combine_cost}) {
      std::fill(cost->host.begin(), cost->host.end(), kHeld);
      RETURN_IF_ERROR(cost->Push());
    }
    const std::vector<bool> all = {true, true, true};
    RETURN_IF_ERROR(b.Barrier(30s));
    if (me == 2) std::this_thread::sleep_for(300ms);
    RETURN_IF_ERROR(Dispatch(r, Deadline::After(30s), true));
    RETURN_IF_ERROR(CheckDispatch(r, me, all));
    if (me == 2) std::this_thread::sleep_for(300ms);
    RETURN_IF_ERROR(r.a2a->CombineSend(r.out_x.ptr()));
    CombineOutput to{r.y.ptr(), false};
    to.wait_cost = r.combine_cost.ptr();
    RETURN_IF_ERROR(r.a2a->CombineRecv(to, Deadline::After(30s)));
    RETURN_IF_ERROR(r.y.Pull());
    RETURN_IF_ERROR(CheckCombine(r, me, all));
    ASSIGN_OR_RETURN(const std::vector<int64_t> dispatch, Gained(r.dispatch_cost, kHeld));
    ASSIGN_OR_RETURN(const std::vector<int64_t> combine, Gained(r.combine_cost, kHeld));
    // Each rank's longest wait for a peer in either step, and (ranks 0 and 1) for rank 2.
    int64_t longest = 0;
    for (int q = 0; q < kWorld; ++q) {
      if (q != me) longest = std::max({longest, dispatch[q], combine[q]});
    }
    const int64_t for_slow = me == 2 ? 0 : std::min(dispatch[2], combine[2]);
    std::vector<uint8_t> mine(sizeof longest + sizeof for_slow);
    std::memcpy(mine.data(), &longest, sizeof longest);
    std::memcpy(mine.data() + sizeof longest, &for_slow, sizeof for_slow);
    ASSIGN_OR_RETURN(const auto all_of, b.AllGather(mine, 30s));
    if (me == 2) {
      for (int q = 0; q < 2; ++q) {
        int64_t theirs;
        std::memcpy(&theirs, all_of[q].data() + sizeof longest, sizeof theirs);
        CHECK_OR_RETURN(longest < theirs, "rank 2 waited " + std::to_string(longest) +
                                              ", rank " + std::to_string(q) + " for it " +
                                              std::to_string(theirs));
      }
      return Status::Ok();
    }
    const int other = 1 - me;
    for (const auto& [step, cost] : {std::pair{"dispatch", &dispatch}, {"combine", &combine}}) {
      const std::string costs = std::string(step) + " costs " + std::to_string((*cost)[0]) +
                                " " + std::to_string((*cost)[1]) + " " +
                                std::to_string((*cost)[2]);
      CHECK_OR_RETURN(LeastSeconds(r, (*cost)[2]) > 0.1, costs);
      CHECK_OR_RETURN((*cost)[other] >= 0 && (*cost)[other] * 4 < (*cost)[2], costs);
    }
    return Status::Ok();
  }, 120s);
  for (const auto& exit : exits) EXPECT_TRUE(exit.ok()) << exit.exit_code;
}

// Without mask_lost_peers a lost rank still fails the step at its deadline, and masks nothing.
TEST_P(MoeMaskTest, WithoutMaskLostPeersALostRankFailsTheStep) {
  auto exits = RunLocalRanks(kWorld, [where = GetParam()](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Rank r, MakeRank(b, where, false));
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 2) {
      r.a2a.reset();
      r.engine.reset();
      raise(SIGKILL);
    }
    const Status s = Dispatch(r, Deadline::After(1s));
    CHECK_OR_RETURN(s.code() == StatusCode::kDeadlineExceeded, "got " + s.ToString());
    return ExpectMasks(*r.a2a, {0, 0, 0});
  }, 120s);
  EXPECT_TRUE(exits[0].ok()) << exits[0].exit_code;
  EXPECT_TRUE(exits[1].ok()) << exits[1].exit_code;
  EXPECT_EQ(exits[2].signal, SIGKILL);
}

// Masks set by hand, mid-epoch: after its dispatch, ranks 0 and 1 mask rank 2 and rank 2 masks
// them both; that epoch's combine still runs among all three. Every rank's next epochs run at
// once (no step waits for a masked rank): 0 and 1 exchange with each other only, rank 2 keeps
// its own tokens only, and nothing crosses to or from it. The calls' own checks: range, self,
// unmasking.
TEST_P(MoeMaskTest, MasksSetByHandLeaveTheRankOutOfEveryStepFromTheNextDispatch) {
  auto exits = RunLocalRanks(kWorld, [where = GetParam()](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Rank r, MakeRank(b, where, false));
    const int me = b.rank();
    const std::vector<bool> all = {true, true, true};
    RETURN_IF_ERROR(Dispatch(r, Deadline::After(30s)));
    RETURN_IF_ERROR(ExpectMasks(*r.a2a, {0, 0, 0}));
    CHECK_OR_RETURN(r.a2a->SetMasked(me, true).code() == StatusCode::kInvalidArgument, "self");
    CHECK_OR_RETURN(r.a2a->SetMasked(3, true).code() == StatusCode::kInvalidArgument, "rank 3");
    CHECK_OR_RETURN(r.a2a->SetMasked(-1, true).code() == StatusCode::kInvalidArgument, "rank -1");
    std::vector<bool> live;
    if (me == 2) {
      RETURN_IF_ERROR(r.a2a->SetMasked(0, true));
      RETURN_IF_ERROR(r.a2a->SetMasked(1, true));
      RETURN_IF_ERROR(r.a2a->SetMasked(1, true));  // again: no change
      RETURN_IF_ERROR(ExpectMasks(*r.a2a, {1, 1, 0}));
      live = {false, false, true};
    } else {
      RETURN_IF_ERROR(r.a2a->SetMasked(2, true));
      RETURN_IF_ERROR(r.a2a->SetMasked(1 - me, false));  // an unmasked rank: no change
      RETURN_IF_ERROR(ExpectMasks(*r.a2a, {0, 0, 1}));
      live = {true, true, false};
    }
    RETURN_IF_ERROR(CheckEpoch(r, me, all, all));
    const int masked = me == 2 ? 0 : 2;
    const Status unmask = r.a2a->SetMasked(masked, false);
    CHECK_OR_RETURN(unmask.code() == StatusCode::kUnimplemented, "unmasked: " + unmask.ToString());
    // Rank 2's relay may still be posting its epoch-0 combine: its count of transfers is read
    // once every rank has had the epoch's rows.
    RETURN_IF_ERROR(b.Barrier(30s));
    const uint64_t submitted = r.engine ? r.engine->stats().transfers_submitted : 0;
    for (int epoch = 1; epoch < 3; ++epoch) {
      const auto start = Clock::now();
      RETURN_IF_ERROR(Dispatch(r, Deadline::After(30s)));
      RETURN_IF_ERROR(CheckEpoch(r, me, live, live));
      CHECK_OR_RETURN(Clock::now() - start < 1s, "a step waited");
    }
    // Everyone is done before anyone tears down (no traffic is in flight).
    RETURN_IF_ERROR(b.Barrier(30s));
    if (me == 2 && r.engine) {
      CHECK_OR_RETURN(r.engine->stats().transfers_submitted == submitted,
                      "rank 2 wrote to the ranks it masked");
    }
    return Status::Ok();
  }, 120s);
  for (size_t i = 0; i < exits.size(); ++i) EXPECT_TRUE(exits[i].ok()) << "rank " << i;
}

#if FERRY_HAVE_CUDA
// A whole epoch captured once as a CUDA graph, under mask_lost_peers (so the kernels read masks
// from the start), then replayed: masks set by hand between replays -- ranks 0 and 1 mask rank
// 2, rank 2 masks both -- reach the replays, which call no step of the AllToAll's. Each replay
// is checked exactly, before and after.
TEST_P(MoeMaskTest, MasksSetByHandReachAGraphsReplays) {
  if (GetParam() == Where::kHost) GTEST_SKIP() << "CUDA graphs: the CUDA device";
  auto exits = RunLocalRanks(kWorld, [where = GetParam()](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(Rank r, MakeRank(b, where, true));
    const int me = b.rank();
    const std::vector<bool> all = {true, true, true};
    cudaStream_t stream = nullptr;
    CUDA_OR_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    RETURN_IF_ERROR(r.a2a->SetStream(stream));
    RETURN_IF_ERROR(FillInputs(r));
    CUDA_OR_RETURN(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    RETURN_IF_ERROR(r.a2a->DispatchSend({r.x.ptr(), nullptr, r.idx.ptr(), r.w.ptr(), kTokens}));
    RETURN_IF_ERROR(r.a2a->DispatchRecv({r.out_x.ptr(), nullptr, r.counts.ptr()},
                                        Deadline::After(30s)));
    RETURN_IF_ERROR(r.a2a->CombineSend(r.out_x.ptr()));
    RETURN_IF_ERROR(r.a2a->CombineRecv(r.y.ptr(), false, Deadline::After(30s)));
    cudaGraph_t graph = nullptr;
    CUDA_OR_RETURN(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_OR_RETURN(cudaGraphInstantiate(&exec, graph, 0));
    cudaGraphDestroy(graph);
    auto replay = [&](const std::vector<bool>& live) -> Status {
      RETURN_IF_ERROR(FillInputs(r));
      CUDA_OR_RETURN(cudaGraphLaunch(exec, stream));
      CUDA_OR_RETURN(cudaStreamSynchronize(stream));
      RETURN_IF_ERROR(r.out_x.Pull());
      RETURN_IF_ERROR(r.counts.Pull());
      RETURN_IF_ERROR(r.y.Pull());
      RETURN_IF_ERROR(CheckDispatch(r, me, live));
      return CheckCombine(r, me, live);
    };
    Status s = replay(all);
    // Every rank's first replay is done before any masks: else a rank masked early would skip
    // rows a slower rank still sends it this epoch.
    if (s.ok()) s = b.Barrier(30s);
    std::vector<bool> live;
    for (int q = 0; q < kWorld && s.ok(); ++q) {
      if (q != me && (q == 2) != (me == 2)) s = r.a2a->SetMasked(q, true);
    }
    live = me == 2 ? std::vector<bool>{false, false, true} : std::vector<bool>{true, true, false};
    for (int epoch = 0; epoch < 2 && s.ok(); ++epoch) s = replay(live);
    if (s.ok()) s = ExpectMasks(*r.a2a, me == 2 ? std::vector<uint8_t>{1, 1, 0}
                                                : std::vector<uint8_t>{0, 0, 1});
    cudaGraphExecDestroy(exec);
    if (s.ok()) s = b.Barrier(30s);  // no replay in flight when any rank tears down
    r.a2a.reset();
    cudaStreamDestroy(stream);
    return s;
  }, 120s);
  for (size_t i = 0; i < exits.size(); ++i) EXPECT_TRUE(exits[i].ok()) << "rank " << i;
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeMaskTest,
                         ::testing::Values(Where::kHost, Where::kCudaOneNode, Where::kCudaRelay),
                         [](const ::testing::TestParamInfo<Where>& info) {
                           return info.param == Where::kHost        ? std::string("Host")
                                  : info.param == Where::kCudaOneNode ? std::string("CudaOneNode")
                                                                      : std::string("CudaRelay");
                         });
#else
INSTANTIATE_TEST_SUITE_P(Devices, MoeMaskTest, ::testing::Values(Where::kHost),
                         [](const ::testing::TestParamInfo<Where>&) { return std::string("Host"); });
#endif

}  // namespace
}  // namespace ferry
