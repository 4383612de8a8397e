// The CUDA moe device when something is wrong: no GPU, a rank lost before the combine or on
// another node, expert ids out of range, ranks that disagree on streaming, GPU buffers between
// nodes without an engine. Each failure must reach every rank within its deadline and leave the
// AllToAll failed, not hung. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <utility>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe_cuda_util.h"
#include "moe_inputs.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// A GPU that is not there is a clear error at Create, on any machine.
TEST(MoeCudaConfigTest, AMissingGpuIsAFailedPrecondition) {
  auto exits = RunLocalRanks(1, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 1, .rank = 0, .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    cfg.device = MoeDeviceKind::kCuda;
    cfg.cuda_device = 64;
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    auto a2a = AllToAll::Create(cfg, engine.get(), b);
    CHECK_OR_RETURN(a2a.status().code() == StatusCode::kFailedPrecondition,
                    "got " + a2a.status().ToString());
    CHECK_OR_RETURN(a2a.status().message().find("CUDA device 64") != std::string::npos,
                    a2a.status().ToString());
    cfg.cuda_device = -1;
    CHECK_OR_RETURN(cfg.Validate().code() == StatusCode::kInvalidArgument, "device -1 accepted");
    cfg.cuda_device = 0;
    cfg.experts_per_token = 17;
    cfg.num_experts = 32;
    CHECK_OR_RETURN(cfg.Validate().code() == StatusCode::kInvalidArgument, "top-17 accepted");
    return Status::Ok();
  }, 60s);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_TRUE(exits[0].ok()) << "exit " << exits[0].exit_code;
}

// The failure tests' run: the configured tokens per rank (four, unless a test needs more),
// token i routed to experts 2i and 2i + 1 (mod 8; 8 experts, top-2, hidden 128, bf16).
struct SmallRun {
  AllToAll* a2a = nullptr;
  int tokens = 0;
  Gpu<uint16_t> x, expert_out, y;
  Gpu<int32_t> indices, counts;
  Gpu<float> weights;

  Status Setup(AllToAll* all_to_all) {
    a2a = all_to_all;
    const AllToAllConfig& cfg = a2a->config();
    tokens = cfg.max_tokens_per_rank;
    RETURN_IF_ERROR(x.Alloc(size_t(tokens) * 128));
    RETURN_IF_ERROR(indices.Alloc(size_t(tokens) * 2));
    RETURN_IF_ERROR(weights.Alloc(size_t(tokens) * 2));
    RETURN_IF_ERROR(counts.Alloc(cfg.local_experts()));
    RETURN_IF_ERROR(expert_out.Alloc(size_t(cfg.local_experts()) * cfg.expert_capacity() * 128));
    RETURN_IF_ERROR(y.Alloc(size_t(tokens) * 128));
    RETURN_IF_ERROR(weights.Put(std::vector<float>(size_t(tokens) * 2, 0.5f)));
    std::vector<int32_t> experts(size_t(tokens) * 2);
    for (size_t i = 0; i < experts.size(); ++i) experts[i] = static_cast<int32_t>(i % 8);
    return indices.Put(experts);
  }
  DispatchInput In() const { return {x.p, nullptr, indices.p, weights.p, tokens}; }

  // One whole iteration; every rank's tokens reach each expert tokens / 4 times, so a local
  // expert gets that many rows per rank.
  Status GoodIteration(Bootstrap& b) {
    RETURN_IF_ERROR(a2a->DispatchSend(In()));
    RETURN_IF_ERROR(a2a->DispatchRecv({expert_out.p, nullptr, counts.p}, Deadline::After(30s)));
    std::vector<int32_t> got(a2a->config().local_experts());
    RETURN_IF_ERROR(counts.Get(got));
    for (int32_t rows : got) {
      CHECK_OR_RETURN(rows == b.world_size() * tokens / 4, "expert rows " + std::to_string(rows));
    }
    RETURN_IF_ERROR(a2a->CombineSend(expert_out.p));
    RETURN_IF_ERROR(a2a->CombineRecv(y.p, false, Deadline::After(30s)));
    return b.Barrier(30s);
  }

  // After rank `lost` stopped taking part: DispatchRecv ends at its 1 s deadline naming it, and
  // later steps fail too.
  Status ExpectLost(int lost) {
    RETURN_IF_ERROR(a2a->DispatchSend(In()));
    // Through the relay the error is the relay's, in its own words: only the rank is checked.
    RETURN_IF_ERROR(ExpectTimeout(lost, "", [&](Deadline deadline) {
      return a2a->DispatchRecv({expert_out.p, nullptr, counts.p}, deadline);
    }));
    CHECK_OR_RETURN(!a2a->CombineSend(expert_out.p).ok(), "a later step ran after a rank was lost");
    return Status::Ok();
  }

  // `step`, given a 1 s deadline, fails with DeadlineExceeded naming rank `lost` and saying
  // `which` (any words when empty), within 3 s.
  static Status ExpectTimeout(int lost, const std::string& which,
                              const std::function<Status(Deadline)>& step) {
    const auto start = Clock::now();
    const Status s = step(Deadline::After(1s));
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    CHECK_OR_RETURN(s.code() == StatusCode::kDeadlineExceeded &&
                        s.message().find("rank " + std::to_string(lost)) != std::string::npos &&
                        s.message().find(which) != std::string::npos,
                    "lost rank: " + s.ToString());
    CHECK_OR_RETURN(waited < 3.0, "the wait took " + std::to_string(waited) + " s");
    return Status::Ok();
  }
};

// A one-node AllToAll of two ranks on the GPU (top-2 of 8 experts, hidden 128, `tokens` per
// rank), created with what the environment set up for it.
// `stream`: AllToAllConfig::streaming as a mask (-1: kAuto, the dispatch streamed where
// SendSmall sends; 0 none, 1 the dispatch, 2 the combine, 3 both).
StatusOr<std::unique_ptr<AllToAll>> CreateOneNode(Bootstrap& b, int tokens = 4,
                                                  int stream = -1) {
  AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .ranks_per_node = 2, .num_experts = 8,
                     .experts_per_token = 2, .max_tokens_per_rank = tokens, .hidden = 128,
                     .dtype = DispatchDtype::kBf16, .max_private_tokens = 2};
  cfg.streaming = stream < 0 ? Streaming::kAuto : static_cast<Streaming>(stream + 1);
  RETURN_IF_ERROR(UseGpu(b, &cfg));
  return AllToAll::Create(cfg, nullptr, b);
}

// The failure tests' AllToAll (CreateOneNode) and its run.
Status OpenOneNode(Bootstrap& b, std::unique_ptr<AllToAll>* a2a, SmallRun* run, int tokens,
                   int stream) {
  ASSIGN_OR_RETURN(*a2a, CreateOneNode(b, tokens, stream));
  return run->Setup(a2a->get());
}

// One node, two ranks: after a good iteration and a dispatch, rank 1 never returns its combine
// rows. Rank 0's CombineRecv ends at its 1 s deadline naming rank 1 and the combine step.
// `stream`: CudaTuning::stream (3: rank 0 waits for rank 1's row tags, not its flag); `tokens`
// per rank (more than CombineRecv's blocks: a warp per token).
void APeerLostBeforeCombine(int stream, int tokens = 4) {
  auto exits = RunLocalRanks(2, [&](Bootstrap& b) -> Status {
    std::unique_ptr<AllToAll> a2a;
    SmallRun run;
    RETURN_IF_ERROR(OpenOneNode(b, &a2a, &run, tokens, stream));
    RETURN_IF_ERROR(run.GoodIteration(b));
    RETURN_IF_ERROR(a2a->DispatchSend(run.In()));
    RETURN_IF_ERROR(a2a->DispatchRecv({run.expert_out.p, nullptr, run.counts.p},
                                      Deadline::After(30s)));
    if (b.rank() == 1) {
      sleep(4);  // never sends its combine rows
      return Status::Ok();
    }
    RETURN_IF_ERROR(a2a->CombineSend(run.expert_out.p));
    return SmallRun::ExpectTimeout(1, "combine", [&](Deadline deadline) {
      return a2a->CombineRecv(run.y.p, false, deadline);
    });
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}
TEST(MoeNvlinkTest, APeerLostBeforeCombine) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  APeerLostBeforeCombine(0);
}
TEST(MoeNvlinkTest, APeerLostBeforeCombineStreamed) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  APeerLostBeforeCombine(3);
}
TEST(MoeNvlinkTest, APeerLostBeforeCombineStreamedManyTokens) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  APeerLostBeforeCombine(3, 2048);
}

// One node, two ranks: an expert id out of range fails DispatchSend with nothing sent (the step
// can be retried); then a rank that stops taking part makes its peer's wait end at the
// deadline, and the AllToAll stays failed. `streamed`: the dispatch streamed (the peer waits for
// the lost rank's counts row) or not (for its flag).
void BadExpertsAndALostPeer(bool streamed) {
  auto exits = RunLocalRanks(2, [&](Bootstrap& b) -> Status {
    std::unique_ptr<AllToAll> a2a;
    SmallRun run;
    RETURN_IF_ERROR(OpenOneNode(b, &a2a, &run, 4, streamed ? 1 : 0));
    if (b.rank() == 0) {
      RETURN_IF_ERROR(run.indices.Put({0, 1, 2, 3, 4, 8, 6, 7}));
      const Status bad = a2a->DispatchSend(run.In());
      CHECK_OR_RETURN(bad.code() == StatusCode::kOutOfRange &&
                          bad.message().find("expert 8") != std::string::npos,
                      "bad expert: " + bad.ToString());
      CHECK_OR_RETURN(a2a->DispatchRecv({run.x.p, nullptr, run.counts.p}, Deadline::After(1s))
                              .code() == StatusCode::kFailedPrecondition,
                      "DispatchRecv ran after a refused DispatchSend");
      RETURN_IF_ERROR(run.indices.Put({0, 1, 2, 3, 4, 5, 6, 7}));
    }
    RETURN_IF_ERROR(run.GoodIteration(b));
    if (b.rank() == 1) {
      sleep(4);  // stops taking part (its memory stays mapped in rank 0)
      return Status::Ok();
    }
    return run.ExpectLost(1);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}
TEST(MoeNvlinkTest, BadExpertsAndALostPeer) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  BadExpertsAndALostPeer(false);
}
TEST(MoeNvlinkTest, BadExpertsAndALostPeerStreamed) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  BadExpertsAndALostPeer(true);
}

// CreateOneNode fails with `code`, its message naming `text`.
Status CreateFails(Bootstrap& b, StatusCode code, const std::string& text, int tokens = 4,
                   int stream = -1) {
  auto a2a = CreateOneNode(b, tokens, stream);
  CHECK_OR_RETURN(a2a.status().code() == code &&
                      a2a.status().message().find(text) != std::string::npos,
                  text + ": " + a2a.status().ToString());
  return Status::Ok();
}

// Ranks of one node that stream differently fail Create on every rank, naming the rank that
// differs (CudaTuning::stream is part of the config's fingerprint): rank 1 streaming the
// combine, or giving the default's choice explicitly, against rank 0's default, in a decode
// shape (SendSmall) and a prefill one (Route and Pack: 1025 tokens of top-2, past SendSmall's
// 2048 entries). Ranks that give the same value create their AllToAll.
TEST(MoeNvlinkTest, RanksThatStreamDifferentlyFailCreate) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const struct {
      int tokens;
      int rank1;  // the streaming mask on rank 1 (rank 0: kAuto, -1)
    } differ[] = {{4, 2}, {4, 1}, {1025, 0}, {1025, 3}};
    for (const auto& c : differ) {
      const Status s = CreateFails(b, StatusCode::kInvalidArgument, "different configuration",
                                   c.tokens, b.rank() == 1 ? c.rank1 : -1);
      if (!s.ok()) {
        return InternalError(std::to_string(c.tokens) + " tokens, rank 1 stream " +
                             std::to_string(c.rank1) + ": " + s.ToString());
      }
    }
    for (int stream : {-1, 0, 3}) RETURN_IF_ERROR(CreateOneNode(b, 4, stream).status());
    return Status::Ok();
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Two nodes of two ranks: after a good iteration rank 3 stops taking part. Every other rank's
// DispatchRecv -- over NVLink in rank 3's node, through the relay in the other -- ends at its
// deadline naming rank 3, and the AllToAll stays failed.
TEST(MoeNvlinkTest, ALostRankOfAnotherNode) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  auto exits = RunLocalRanks(4, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 4, .rank = b.rank(), .ranks_per_node = 2, .num_experts = 8,
                       .experts_per_token = 2, .max_tokens_per_rank = 4, .hidden = 128,
                       .dtype = DispatchDtype::kBf16, .max_private_tokens = 2,
                       .forwarding = Forwarding::kPerRank};  // the relay between ranks
    RETURN_IF_ERROR(UseGpu(b, &cfg));
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    SmallRun run;
    RETURN_IF_ERROR(run.Setup(a2a.get()));
    RETURN_IF_ERROR(run.GoodIteration(b));
    if (b.rank() == 3) {
      sleep(4);  // stops taking part (its memory stays mapped in rank 2)
      return Status::Ok();
    }
    return run.ExpectLost(3);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Between nodes, buffers in GPU memory need an engine that registers it: asked for (kDevice)
// with an engine without EngineOptions::cuda_memory, Create fails on every rank and says why;
// kAuto then takes pinned host memory and an iteration runs.
TEST(MoeNvlinkTest, GpuBuffersBetweenNodesNeedAnEngineForThem) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    RETURN_IF_ERROR(UseGpu(b, &cfg));
    EngineOptions options = testing_util::TestOptions("shm");
    options.cuda_memory = false;
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(options));
    cfg.rdma_buffers = RdmaBuffers::kDevice;
    auto refused = AllToAll::Create(cfg, engine.get(), b);
    CHECK_OR_RETURN(!refused.ok() && refused.status().message().find("rdma_buffers is kDevice") !=
                                         std::string::npos,
                    "kDevice without CUDA registration: " + refused.status().ToString());
    cfg.rdma_buffers = RdmaBuffers::kAuto;
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    SmallRun run;
    RETURN_IF_ERROR(run.Setup(a2a.get()));
    return run.GoodIteration(b);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry
