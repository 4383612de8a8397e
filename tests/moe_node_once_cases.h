// What the node-once tests over ranks share (moe_node_once_ranks_test,
// moe_node_once_elastic_test): EP4 as two nodes of two, every output of an epoch checked
// against the ranks that are out, and the configuration the masking cases run.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe/numerics.h"
#include "moe_buf.h"

namespace ferry::node_once_cases {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// EP4 as two nodes of two (ranks 0, 1 | 2, 3), 8 experts (2 a rank, 4 a node), top-2: token t
// of rank r goes to expert (t + 2r) % 8 and that + 4 -- one in each node -- with weights 0.5
// and 0.25; every column holds 1 + r + t / 4 + 2 * epoch (exact in bf16, as are its sums).
// A resized world (World) has other ranks and experts: there the second copy goes E / 2 on.
constexpr int kWorld = 4, kPerNode = 2, kTokens = 4, kHidden = 128, kExperts = 8, kK = 2;
constexpr int kLocal = kExperts / kWorld;
constexpr int64_t kCapacity = int64_t{kWorld} * kTokens;
struct World {
  int ranks = kWorld, experts = kExperts;
  int local() const { return experts / ranks; }
  int64_t capacity() const { return int64_t{ranks} * kTokens; }
};
inline float Value(int r, int t, int epoch) { return 1.0f + r + t * 0.25f + 2.0f * epoch; }
inline int Expert(int r, int t, int j, const World& w = {}) {
  return (t + 2 * r + w.experts / 2 * j) % w.experts;
}
inline float Weight(int j) { return j == 0 ? 0.5f : 0.25f; }

// Whether rank s's copies reach rank `me` (and their rows come back) while `masked` ranks are
// out: inside a node directly; across nodes through the rank of me's node with s's index there,
// which must not be masked.
inline bool Reaches(int s, int me, const std::vector<bool>& masked) {
  if (s == me) return true;
  if (masked[size_t(s)] || masked[size_t(me)]) return false;
  if (s / kPerNode == me / kPerNode) return true;
  return !masked[size_t(me / kPerNode * kPerNode + s % kPerNode)];
}

// How an epoch runs: on which device (the CUDA device: every buffer on the GPU), each
// receive's wait, whether its outputs are checked (an epoch that a rank died in is not: what it
// sent before it died arrived), and what runs after each send step (0: DispatchSend, 1:
// CombineSend), where a test kills a rank between its hops.
struct EpochRun {
  bool cuda = false;
  std::chrono::milliseconds dispatch_wait{30s}, combine_wait{30s};
  bool exact = true;
  std::function<void(int step)> after_send;
};

// One epoch of rank `me` in world `w`, every output checked against `masked` (the ranks out,
// as me sees the world): each local expert's rows as a multiset, and each token's sum over the
// copies whose expert rank its route reaches. Odd epochs give the weights at the combine too
// (the weights rail then crosses the same routes, masked alike).
inline Status Epoch(AllToAll& a2a, int me, int epoch, const std::vector<bool>& masked,
                    const EpochRun& run = {}, const World& world = {}) {
  const World& w = world;
  const int local = w.local();
  const int64_t capacity = w.capacity();
  Buf<uint16_t> x, out_x, y;
  Buf<int32_t> ids, counts;
  Buf<float> weights;
  RETURN_IF_ERROR(x.Init(run.cuda, size_t(kTokens) * kHidden, 0));
  RETURN_IF_ERROR(ids.Init(run.cuda, size_t(kTokens) * kK, 0));
  RETURN_IF_ERROR(weights.Init(run.cuda, size_t(kTokens) * kK, 0.0f));
  RETURN_IF_ERROR(out_x.Init(run.cuda, size_t(local * capacity * kHidden), 0));
  RETURN_IF_ERROR(counts.Init(run.cuda, local, -1));
  RETURN_IF_ERROR(y.Init(run.cuda, size_t(kTokens) * kHidden, 0));
  for (int t = 0; t < kTokens; ++t) {
    std::fill_n(x.host.begin() + t * kHidden, kHidden, FloatToBf16(Value(me, t, epoch)));
    for (int j = 0; j < kK; ++j) {
      ids.host[size_t(t) * kK + j] = Expert(me, t, j, w);
      weights.host[size_t(t) * kK + j] = Weight(j);
    }
  }
  RETURN_IF_ERROR(x.Push());
  RETURN_IF_ERROR(ids.Push());
  RETURN_IF_ERROR(weights.Push());
  RETURN_IF_ERROR(a2a.DispatchSend({x.ptr(), nullptr, ids.ptr(), weights.ptr(), kTokens}));
  if (run.after_send) run.after_send(0);
  RETURN_IF_ERROR(a2a.DispatchRecv({out_x.ptr(), nullptr, counts.ptr()},
                                   Deadline::After(run.dispatch_wait)));
  RETURN_IF_ERROR(out_x.Pull());
  RETURN_IF_ERROR(counts.Pull());
  for (int e = 0; e < local && run.exact; ++e) {
    const int expert = me * local + e;
    std::vector<float> want, got;
    for (int s = 0; s < w.ranks; ++s) {
      for (int t = 0; t < kTokens && Reaches(s, me, masked); ++t) {
        for (int j = 0; j < kK; ++j) {
          if (Expert(s, t, j, w) == expert) want.push_back(Value(s, t, epoch));
        }
      }
    }
    for (int i = 0; i < counts.host[size_t(e)]; ++i) {
      got.push_back(Bf16ToFloat(out_x.host[(size_t(e) * capacity + i) * kHidden]));
    }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    CHECK_OR_RETURN(got == want, "rank " + std::to_string(me) + " expert " +
                                     std::to_string(expert) + " epoch " +
                                     std::to_string(epoch) + ": " + std::to_string(got.size()) +
                                     " rows, want " + std::to_string(want.size()));
  }
  RETURN_IF_ERROR(a2a.CombineSend(out_x.ptr()));  // the experts: the identity
  if (run.after_send) run.after_send(1);
  RETURN_IF_ERROR(a2a.CombineRecv(
      CombineOutput{.out = y.ptr(), .weights = epoch % 2 ? weights.ptr() : nullptr},
      Deadline::After(run.combine_wait)));
  RETURN_IF_ERROR(y.Pull());
  for (int t = 0; t < kTokens && run.exact; ++t) {
    float weight = 0;
    for (int j = 0; j < kK; ++j) {
      if (Reaches(me, Expert(me, t, j, w) / local, masked)) weight += Weight(j);
    }
    const uint16_t want = FloatToBf16(Value(me, t, epoch) * weight);
    CHECK_OR_RETURN(y.host[size_t(t) * kHidden] == want,
                    "rank " + std::to_string(me) + " token " + std::to_string(t) + " epoch " +
                        std::to_string(epoch) + ": " +
                        std::to_string(Bf16ToFloat(y.host[size_t(t) * kHidden])) + ", want " +
                        std::to_string(Bf16ToFloat(want)));
  }
  return Status::Ok();
}

// Under mask_lost_peers, node-once with EP4 as two nodes of two, on the host device or the CUDA
// device (the four ranks on one GPU: NVLink inside a node, the relay on the rail; skipped
// without a GPU): rank `me`'s AllToAll and engine.
struct MaskingRank {
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<AllToAll> a2a;
};
// Rank `rank`'s configuration (its GPU taken with `cuda`, through b) and engine.
inline StatusOr<AllToAllConfig> MaskingConfig(Bootstrap& b, int rank, bool cuda,
                                              const World& w = {}) {
  AllToAllConfig c{.world_size = w.ranks, .rank = rank, .ranks_per_node = kPerNode,
                   .num_experts = w.experts, .experts_per_token = kK,
                   .max_tokens_per_rank = kTokens, .hidden = kHidden,
                   .forwarding = Forwarding::kNodeOnce, .mask_lost_peers = true};
#if FERRY_HAVE_CUDA
  if (cuda) RETURN_IF_ERROR(UseGpu(b, &c));
#else
  CHECK_OR_RETURN(!cuda, "built without CUDA");
#endif
  return c;
}
inline StatusOr<std::unique_ptr<TransferEngine>> MaskingEngine() {
  // A rank masked as lost is forgotten as the engine's peer, which ends the writes pending to
  // it at once; the transfer timeout bounds the rest (a dead rank's heartbeats).
  EngineOptions options = testing_util::TestOptions("shm");
  options.transfer_timeout_ms = 1000;
  return TransferEngine::Create(options);
}
inline StatusOr<MaskingRank> MakeMaskingRank(Bootstrap& b, bool cuda) {
  ASSIGN_OR_RETURN(const AllToAllConfig c, MaskingConfig(b, b.rank(), cuda));
  MaskingRank r;
  ASSIGN_OR_RETURN(r.engine, MaskingEngine());
  ASSIGN_OR_RETURN(r.a2a, AllToAll::Create(c, r.engine.get(), b));
  return r;
}

// A rendezvous address on loopback, its port free now.
inline std::string LoopbackAddress() {
  return "127.0.0.1:" + std::to_string(testing_util::FreeLoopbackPort());
}

inline bool SkipCuda(bool cuda) {
#if FERRY_HAVE_CUDA
  return cuda && !HaveGpu();
#else
  return cuda;
#endif
}

}  // namespace ferry::node_once_cases
