// The CUDA moe device against the host device, on the same inputs, in the same ranks: as one
// node (NVLink), as nodes of several ranks (NVLink inside, the relay between) and as one rank
// per node (every peer through the relay).
//
// Every rank runs two AllToAlls side by side (each with its own engine): the host device on host
// buffers and the CUDA device on GPU buffers. Dispatch outputs must be identical (counts, rows,
// scales) and so must combine outputs (the CUDA kernels sum in the host device's order with
// unfused fp32 operations). Ranks share the GPUs round-robin. Skips without a GPU.
//
// Run on the GPU machine: build/moe_cuda_test (or ctest -R MoeCuda). A lost peer, bad experts and
// refused configurations on the CUDA device: moe_cuda_faults_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe_cuda_cases.h"
#include "moe_cuda_util.h"
#include "moe_inputs.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

using moe_cuda_cases::Case;
using moe_cuda_cases::Describe;

// The NVLink path's steps captured in graphs on a stream of their own.
struct Graphs {
  cudaStream_t stream = nullptr;
  cudaGraphExec_t dispatch = nullptr, combine = nullptr, combine_accumulate = nullptr;
  ~Graphs() {
    for (cudaGraphExec_t g : {dispatch, combine, combine_accumulate}) {
      if (g) cudaGraphExecDestroy(g);
    }
    if (stream) cudaStreamDestroy(stream);
  }
  static Status CaptureInto(cudaStream_t stream, cudaGraphExec_t* exec,
                            const std::function<Status()>& steps) {
    CUDA_OR_RETURN(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status s = steps();
    cudaGraph_t graph = nullptr;
    CUDA_OR_RETURN(cudaStreamEndCapture(stream, &graph));
    RETURN_IF_ERROR(s);
    CUDA_OR_RETURN(cudaGraphInstantiate(exec, graph, 0));
    cudaGraphDestroy(graph);
    return Status::Ok();
  }
  // Dispatch, combine and combine-with-accumulate; the AllToAll is left on `stream`.
  Status Capture(AllToAll& a2a, const DispatchInput& in,
                 const DispatchOutput& out, const void* expert_out, void* y, bool fp16) {
    CUDA_OR_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    RETURN_IF_ERROR(a2a.SetStream(stream));
    const Deadline later = Deadline::After(30s);
    auto dispatch_steps = [&] {
      RETURN_IF_ERROR(a2a.DispatchSend(in));
      return a2a.DispatchRecv(out, later);
    };
    RETURN_IF_ERROR(CaptureInto(stream, &dispatch, dispatch_steps));
    RETURN_IF_ERROR(CaptureInto(stream, &combine, [&] {
      RETURN_IF_ERROR(a2a.CombineSend(CombineInput{expert_out, fp16}));
      return a2a.CombineRecv(CombineOutput{.out = y, .fp16 = fp16}, later);
    }));
    // The steps are captured in their order, so the second combine graph needs a dispatch
    // captured before it; that copy of the dispatch graph is not kept.
    cudaGraphExec_t again = nullptr;
    RETURN_IF_ERROR(CaptureInto(stream, &again, dispatch_steps));
    cudaGraphExecDestroy(again);
    return CaptureInto(stream, &combine_accumulate, [&] {
      RETURN_IF_ERROR(a2a.CombineSend(CombineInput{expert_out, fp16}));
      return a2a.CombineRecv(CombineOutput{.out = y, .accumulate = true, .fp16 = fp16}, later);
    });
  }
};

// Token-major outputs: the GPU's rows, scales, experts, weights and per-expert copies equal the
// host device's, row for row.
Status CompareTokenMajor(const AllToAllConfig& cfg, const DispatchOutput& host, int32_t rows,
                         int32_t gpu_rows, const std::vector<uint8_t>& x,
                         const std::vector<float>& scales, const std::vector<int32_t>& experts,
                         const std::vector<float>& weights, const std::vector<int32_t>& counts) {
  const int64_t row = cfg.token_bytes(), spt = cfg.scales_per_token(), k = cfg.experts_per_token;
  CHECK_OR_RETURN(gpu_rows == rows, "GPU " + std::to_string(gpu_rows) + " rows, host " +
                                        std::to_string(rows));
  CHECK_OR_RETURN(std::memcmp(x.data(), host.x, size_t(rows) * row) == 0, "rows differ");
  CHECK_OR_RETURN(std::memcmp(scales.data(), host.scales, size_t(rows) * spt * 4) == 0,
                  "scales differ");
  CHECK_OR_RETURN(std::equal(experts.begin(), experts.begin() + rows * k, host.token_experts),
                  "token experts differ");
  CHECK_OR_RETURN(std::equal(weights.begin(), weights.begin() + rows * k, host.token_weights),
                  "token weights differ");
  CHECK_OR_RETURN(std::equal(counts.begin(), counts.end(), host.num_tokens),
                  "copies per expert differ");
  return Status::Ok();
}

Status RunRank(const Case& c, Bootstrap& b) {
  AllToAllConfig cfg = ConfigFor(c, b.world_size(), b.rank());
  const bool token_major = c.token_major == 1 || (c.token_major == 2 && b.rank() % 2 == 1);
  const bool fp16 = c.fp16_combine;
  if (token_major) cfg.dispatch_layout = DispatchLayout::kTokenMajor;
  if (c.nvlink) cfg.ranks_per_node = c.node_ranks > 0 ? c.node_ranks : b.world_size();
  cfg.forwarding = c.node_once ? Forwarding::kNodeOnce : Forwarding::kPerRank;
  if (c.fp32_partials) cfg.partial_sums = PartialSums::kFp32;
  AllToAllConfig gpu_cfg = cfg;
  RETURN_IF_ERROR(UseGpu(b, &gpu_cfg));
  gpu_cfg.streaming = static_cast<Streaming>(c.stream + 1);  // kNone is 1: the mask less one
  ASSIGN_OR_RETURN(auto host_engine, TransferEngine::Create(testing_util::TestOptions("shm")));
  std::unique_ptr<TransferEngine> own_engine;
  if (!c.shared_engine) {
    ASSIGN_OR_RETURN(own_engine, TransferEngine::Create(testing_util::TestOptions("shm")));
  } else {
    gpu_cfg.instance = 1;
  }
  TransferEngine* gpu_engine = c.shared_engine ? host_engine.get() : own_engine.get();
  ASSIGN_OR_RETURN(auto host, AllToAll::Create(cfg, host_engine.get(), b));
  ASSIGN_OR_RETURN(auto gpu, AllToAll::Create(gpu_cfg, gpu_engine, b));

  const int l = cfg.local_experts(), h = cfg.hidden;
  const int64_t cap = cfg.expert_capacity(), row = cfg.token_bytes(), spt = cfg.scales_per_token();
  std::vector<uint8_t> out_x(size_t(l) * cap * row, 0), gpu_out_x(out_x.size());
  std::vector<float> out_scales(size_t(l) * cap * spt, 0), gpu_out_scales(out_scales.size());
  std::vector<int32_t> counts(l), gpu_counts(l);
  // The combine's rows and output in its element (bf16, or fp32: combines_fp32), as bytes.
  const int64_t crow = cfg.combine_row_bytes();
  std::vector<uint8_t> expert_out(size_t(l) * cap * crow, 0);
  Gpu<uint8_t> d_x, d_out_x;
  Gpu<float> d_scales, d_weights, d_out_scales;
  Gpu<int32_t> d_indices, d_counts;
  Gpu<uint8_t> d_expert_out, d_y;
  RETURN_IF_ERROR(d_x.Alloc(size_t(cfg.max_tokens_per_rank) * row));
  RETURN_IF_ERROR(d_scales.Alloc(size_t(cfg.max_tokens_per_rank) * spt));
  RETURN_IF_ERROR(d_indices.Alloc(size_t(cfg.max_tokens_per_rank) * c.k));
  RETURN_IF_ERROR(d_weights.Alloc(size_t(cfg.max_tokens_per_rank) * c.k));
  RETURN_IF_ERROR(d_out_x.Alloc(out_x.size()));
  RETURN_IF_ERROR(d_out_scales.Alloc(out_scales.size()));
  RETURN_IF_ERROR(d_counts.Alloc(l));
  RETURN_IF_ERROR(d_expert_out.Alloc(expert_out.size()));
  RETURN_IF_ERROR(d_y.Alloc(size_t(cfg.max_tokens_per_rank) * crow));
  // Token-major: rows, and each row's experts and weights.
  int32_t rows = 0;
  std::vector<int32_t> gpu_rows(1), experts(size_t(cap) * c.k), gpu_experts(experts.size());
  std::vector<float> weights(experts.size()), gpu_weights(experts.size());
  Gpu<int32_t> d_rows, d_experts;
  Gpu<int64_t> d_experts64;
  Gpu<float> d_token_weights;
  // Odd ranks' GPUs write 64-bit ids (DispatchOutput::token_experts64), even ranks' 32-bit:
  // each case checks both against the host's.
  const bool wide_ids = b.rank() % 2 == 1;
  std::vector<int64_t> gpu_experts64(wide_ids ? experts.size() : 0);
  RETURN_IF_ERROR(d_rows.Alloc(1));
  RETURN_IF_ERROR(wide_ids ? d_experts64.Alloc(experts.size()) : d_experts.Alloc(experts.size()));
  RETURN_IF_ERROR(d_token_weights.Alloc(weights.size()));
  DispatchOutput host_out{out_x.data(), out_scales.data(), counts.data()};
  DispatchOutput gpu_out{d_out_x.p, d_out_scales.p, d_counts.p};
  // Per rank: where each row came from (DispatchOutput::source_tokens, source_ranks; expert-major
  // also sender_ranges), as the host device says.
  const bool sources = !c.node_once;
  const size_t source_rows = token_major ? size_t(cap) : size_t(l) * cap;
  std::vector<int32_t> host_sources(source_rows), gpu_sources(source_rows),
      host_senders(source_rows), gpu_senders(source_rows);
  std::vector<int64_t> host_ranges(size_t(l) * b.world_size()), gpu_ranges(host_ranges.size());
  Gpu<int32_t> d_sources, d_senders;
  Gpu<int64_t> d_ranges;
  if (sources) {
    RETURN_IF_ERROR(d_sources.Alloc(source_rows));
    RETURN_IF_ERROR(d_senders.Alloc(source_rows));
    host_out.source_tokens = host_sources.data();
    host_out.source_ranks = host_senders.data();
    gpu_out.source_tokens = d_sources.p;
    gpu_out.source_ranks = d_senders.p;
    if (!token_major) {
      RETURN_IF_ERROR(d_ranges.Alloc(host_ranges.size()));
      host_out.sender_ranges = host_ranges.data();
      gpu_out.sender_ranges = d_ranges.p;
    }
  }
  // Node-once: the dispatch's wait costs, which charge only the ranks of our node and of our
  // rail (the hops' costs moved into the caller's entries on the GPU).
  Gpu<int64_t> d_cost;
  if (c.node_once) {
    RETURN_IF_ERROR(d_cost.Alloc(size_t(b.world_size())));
    RETURN_IF_ERROR(d_cost.Put(std::vector<int64_t>(size_t(b.world_size()), 0)));
    gpu_out.wait_cost = d_cost.p;
  }
  if (token_major) {
    host_out.num_rows = &rows;
    host_out.token_experts = experts.data();
    host_out.token_weights = weights.data();
    gpu_out.num_rows = d_rows.p;
    gpu_out.token_experts = wide_ids ? nullptr : d_experts.p;
    gpu_out.token_experts64 = wide_ids ? d_experts64.p : nullptr;
    gpu_out.token_weights = d_token_weights.p;
  }

  Graphs graphs;
  Gpu<int32_t> d_count;
  RETURN_IF_ERROR(d_count.Alloc(1));
  if (c.graph) {
    RETURN_IF_ERROR(graphs.Capture(*gpu, {d_x.p, spt ? d_scales.p : nullptr, d_indices.p,
                                               d_weights.p, cfg.max_tokens_per_rank, d_count.p},
                                   gpu_out, d_expert_out.p, d_y.p, c.fp16_combine));
  }

  const InputSpec spec{c.tokens, c.k, c.experts, c.dtype, c.routing, c.rank1_empty};
  for (int it = 0; it < c.iterations; ++it) {
    const std::string at = " (iteration " + std::to_string(it) + ")";
    Inputs in = MakeInputs(spec, cfg, b.rank(), it);
    // Fewer tokens on later iterations: the same AllToAll serves any batch up to the maximum.
    if (it == 2 && in.tokens > 1) in.tokens /= 2;
    // Graphs: a different count each replay (700 tokens: 1 / 6 on ranks 0 / 1, then 538 / 543,
    // which span two of Route's 512-token chunks, then 350 / 350, then 212 / 217).
    if (c.graph) in.tokens = std::min(in.tokens, (it * 537 + 5 * b.rank()) % c.tokens + 1);
    // The graph case's last iteration: rank 0's device count exceeds the bound; it sends
    // nothing (the host reference gets 0 tokens from it) and Synchronize says why.
    const bool over = c.graph && it == c.iterations - 1 && b.rank() == 0;
    const int32_t device_count = over ? cfg.max_tokens_per_rank + 3 : in.tokens;
    RETURN_IF_ERROR(d_count.Put({device_count}));
    RETURN_IF_ERROR(d_x.Put(in.x));
    RETURN_IF_ERROR(d_scales.Put(in.scales));
    RETURN_IF_ERROR(d_indices.Put(in.indices));
    RETURN_IF_ERROR(d_weights.Put(in.weights));
    if (over) in.tokens = 0;
    RETURN_IF_ERROR(host->DispatchSend({in.x.data(), in.scales.empty() ? nullptr : in.scales.data(),
                                        in.indices.data(), in.weights.data(), in.tokens}));
    if (c.graph) {
      CUDA_OR_RETURN(cudaGraphLaunch(graphs.dispatch, graphs.stream));
      const Status s = gpu->Synchronize();
      CHECK_OR_RETURN(over ? s.code() == StatusCode::kInvalidArgument : s.ok(),
                      "dispatch replay: " + s.ToString() + at);
    } else {
      RETURN_IF_ERROR(gpu->DispatchSend({d_x.p, spt ? d_scales.p : nullptr, d_indices.p,
                                         d_weights.p, in.tokens}));
    }
    RETURN_IF_ERROR(host->DispatchRecv(host_out, Deadline::After(30s)));
    if (!c.graph) RETURN_IF_ERROR(gpu->DispatchRecv(gpu_out, Deadline::After(30s)));
    RETURN_IF_ERROR(d_counts.Get(gpu_counts));
    RETURN_IF_ERROR(d_out_x.Get(gpu_out_x));
    RETURN_IF_ERROR(d_out_scales.Get(gpu_out_scales));
    if (token_major) {
      RETURN_IF_ERROR(d_rows.Get(gpu_rows));
      if (wide_ids) {
        RETURN_IF_ERROR(d_experts64.Get(gpu_experts64));
        // Whole 64-bit values in the received rows (a 32-bit write would leave the high half
        // as it was), then compared as the host's.
        const size_t written = size_t(std::max(gpu_rows[0], 0)) * size_t(c.k);
        for (size_t i = 0; i < gpu_experts64.size(); ++i) {
          CHECK_OR_RETURN(i >= written ||
                              (gpu_experts64[i] >= -1 && gpu_experts64[i] < cfg.local_experts()),
                          "64-bit token expert " + std::to_string(gpu_experts64[i]) + at);
          gpu_experts[i] = static_cast<int32_t>(gpu_experts64[i]);
        }
      } else {
        RETURN_IF_ERROR(d_experts.Get(gpu_experts));
      }
      RETURN_IF_ERROR(d_token_weights.Get(gpu_weights));
      RETURN_IF_ERROR(CompareTokenMajor(cfg, host_out, rows, gpu_rows[0], gpu_out_x,
                                        gpu_out_scales, gpu_experts, gpu_weights, gpu_counts));
      SumTokenMajorExperts(cfg, out_x.data(), out_scales.data(), experts.data(), weights.data(),
                           rows, expert_out.data(), fp16);
    }
    if (sources) {
      RETURN_IF_ERROR(d_sources.Get(gpu_sources));
      RETURN_IF_ERROR(d_senders.Get(gpu_senders));
      // The filled rows: token-major the first `rows`, expert-major each block's first counts.
      std::vector<std::pair<size_t, size_t>> filled;
      if (token_major) {
        filled.emplace_back(0, size_t(rows));
      } else {
        RETURN_IF_ERROR(d_ranges.Get(gpu_ranges));
        CHECK_OR_RETURN(gpu_ranges == host_ranges, "sender ranges differ" + at);
        for (int e = 0; e < l; ++e) filled.emplace_back(size_t(e) * cap, size_t(counts[e]));
      }
      for (const auto& [first, n] : filled) {
        CHECK_OR_RETURN(std::equal(host_sources.begin() + first, host_sources.begin() + first + n,
                                   gpu_sources.begin() + first),
                        "rows from " + std::to_string(first) + ": source tokens differ" + at);
        CHECK_OR_RETURN(std::equal(host_senders.begin() + first, host_senders.begin() + first + n,
                                   gpu_senders.begin() + first),
                        "rows from " + std::to_string(first) + ": source ranks differ" + at);
      }
    }
    for (int e = 0; e < l && !token_major; ++e) {
      CHECK_OR_RETURN(gpu_counts[e] == counts[e],
                      "expert " + std::to_string(e) + ": GPU " + std::to_string(gpu_counts[e]) +
                          " rows, host " + std::to_string(counts[e]) + at);
      const size_t first = size_t(e) * cap;
      CHECK_OR_RETURN(std::memcmp(&gpu_out_x[first * row], &out_x[first * row],
                                  size_t(counts[e]) * row) == 0,
                      "expert " + std::to_string(e) + ": rows differ" + at);
      if (spt) {
        CHECK_OR_RETURN(std::memcmp(&gpu_out_scales[first * spt], &out_scales[first * spt],
                                    size_t(counts[e]) * spt * 4) == 0,
                        "expert " + std::to_string(e) + ": scales differ" + at);
      }
      const int g = b.rank() * l + e;
      for (int i = 0; i < counts[e]; ++i) {
        const int64_t r = int64_t{e} * cap + i;
        for (int col = 0; col < h; ++col) {
          const float x = Dequant(cfg, out_x.data() + r * row, out_scales.data() + r * spt, col);
          PutCombine(cfg, expert_out.data(), r * h + col, x * ExpertScale(g), fp16);
        }
      }
    }
    RETURN_IF_ERROR(d_expert_out.Put(expert_out));
    RETURN_IF_ERROR(host->CombineSend(CombineInput{expert_out.data(), fp16}));
    const bool accumulate = it % 2 == 1;
    std::vector<uint8_t> y = CombineFilled(cfg, int64_t{in.tokens} * h, 0.5f, fp16),
                         gpu_y(y.size());
    RETURN_IF_ERROR(d_y.Put(y));
    if (c.graph) {
      CUDA_OR_RETURN(cudaGraphLaunch(accumulate ? graphs.combine_accumulate : graphs.combine,
                                     graphs.stream));
      RETURN_IF_ERROR(gpu->Synchronize());
    } else {
      RETURN_IF_ERROR(gpu->CombineSend(CombineInput{d_expert_out.p, fp16}));
      RETURN_IF_ERROR(gpu->CombineRecv(
          CombineOutput{.out = d_y.p, .accumulate = accumulate, .fp16 = fp16},
          Deadline::After(30s)));
    }
    RETURN_IF_ERROR(host->CombineRecv(
        CombineOutput{.out = y.data(), .accumulate = accumulate, .fp16 = fp16},
        Deadline::After(30s)));
    RETURN_IF_ERROR(d_y.Get(gpu_y));
    const int64_t item = crow / h;
    for (int64_t i = 0; i < int64_t{in.tokens} * h; ++i) {
      CHECK_OR_RETURN(std::memcmp(&gpu_y[i * item], &y[i * item], item) == 0,
                      "combine output " + std::to_string(i) + ": GPU " +
                          std::to_string(GetCombine(cfg, gpu_y.data(), i, fp16)) + ", host " +
                          std::to_string(GetCombine(cfg, y.data(), i, fp16)) + at);
    }
  }
  if (c.node_once) {
    std::vector<int64_t> cost(size_t(b.world_size()));
    RETURN_IF_ERROR(d_cost.Get(cost));
    const int per_node = cfg.ranks_per_node;
    for (int r = 0; r < b.world_size(); ++r) {
      const bool waited =
          r / per_node == b.rank() / per_node || r % per_node == b.rank() % per_node;
      CHECK_OR_RETURN(cost[size_t(r)] >= 0 && (waited || cost[size_t(r)] == 0),
                      "dispatch wait cost of rank " + std::to_string(r) + ": " +
                          std::to_string(cost[size_t(r)]));
    }
  }
  return b.Barrier(30s);
}

class MoeCudaTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeCudaTest, MatchesTheHostDeviceBitForBit) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU (/dev/nvidia0)";
  const Case c = GetParam();
  // The parent never touches CUDA: forked children could not use it.
  auto exits = RunLocalRanks(c.world_size, [&](Bootstrap& b) { return RunRank(c, b); }, 240s);
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_TRUE(exits[r].ok()) << "rank " << r << ": exit " << exits[r].exit_code << " signal "
                               << exits[r].signal << (exits[r].timed_out ? " (timed out)" : "");
  }
}


INSTANTIATE_TEST_SUITE_P(
    Cases, MoeCudaTest,
    ::testing::ValuesIn(moe_cuda_cases::AllCases()),
    [](const ::testing::TestParamInfo<Case>& info) { return Describe(info.param); });

}  // namespace
}  // namespace ferry
