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

struct Case {
  int world_size, tokens, hidden, experts, k;
  DispatchDtype dtype;
  Routing routing;
  int private_tokens = 4;
  bool rank1_empty = false;
  bool once_per_rank = false;
  bool reduce_at_expert_rank = false;
  int iterations = 3;
  bool nvlink = false;  // one node: ranks_per_node = world_size (else 1: one rank per node)
  // The steps captured once in CUDA graphs (dispatch; combine with and without accumulate)
  // with the token count in device memory, replayed with a different count each iteration; the
  // last iteration's count on rank 0 is above the bound (nothing sent). Any topology: one node,
  // nodes of several ranks, one rank per node (every peer through the relay).
  bool graph = false;
  // With nvlink: nodes of this many ranks (NVLink inside, the relay over shm between them); 0:
  // one node.
  int node_ranks = 0;
  // DispatchLayout::kTokenMajor on both devices: 1 on every rank, 2 on odd ranks only (a rank's
  // own choice; the bytes that cross are the same).
  int token_major = 0;
  // One node: AllToAllConfig::streaming as a mask -- 1 the dispatch streamed, 2 the combine, 3
  // both; 0: neither, every receiver waits for its senders' flags. Always given, so that a case
  // takes the path it names whichever the default is (kAuto: the dispatch streamed where
  // SendSmall serves it).
  int stream = 0;
  // The CUDA AllToAll on the host reference's engine (instance 1 beside its 0), their steps
  // interleaved as RunRank runs them: two AllToAlls sharing one engine through the relay.
  bool shared_engine = false;
  int fp8_scales = 0;  // AllToAllConfig::fp8_scales
  bool fp32_combine = false;  // AllToAllConfig::fp32_combine
  bool fp16_combine = false;  // CombineInput / CombineOutput::fp16
};

std::string Describe(const Case& c) {
  return "n" + std::to_string(c.world_size) + "_t" + std::to_string(c.tokens) + "_h" +
         std::to_string(c.hidden) + "_e" + std::to_string(c.experts) + "_k" +
         std::to_string(c.k) +
         (c.dtype == DispatchDtype::kBf16   ? "_bf16"
          : c.dtype == DispatchDtype::kFp32 ? "_fp32"
                                            : "_fp8") +
         (c.routing == Routing::kAllToOneExpert ? "_hot" : "") + (c.rank1_empty ? "_empty1" : "") +
         (c.once_per_rank ? "_a" : "") + (c.reduce_at_expert_rank ? "_b" : "") +
         (c.nvlink ? "_nvlink" : "") + (c.graph ? "_graph" : "") +
         (c.node_ranks ? "_nodes" + std::to_string(c.world_size / c.node_ranks) : "") +
         (c.token_major == 1 ? "_tokmajor" : c.token_major == 2 ? "_mixedlayout" : "") +
         (c.stream == 1 ? "_streamed" : c.stream == 2 ? "_combstreamed"
                          : c.stream == 3 ? "_allstreamed" : "") +
         (c.shared_engine ? "_sharedengine" : "") +
         (c.fp8_scales ? "_scales" + std::to_string(c.fp8_scales) : "") +
         (c.fp32_combine ? "_f32comb" : "") + (c.fp16_combine ? "_f16comb" : "");
}
void PrintTo(const Case& c, std::ostream* os) { *os << Describe(c); }

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
  Gpu<float> d_token_weights;
  RETURN_IF_ERROR(d_rows.Alloc(1));
  RETURN_IF_ERROR(d_experts.Alloc(experts.size()));
  RETURN_IF_ERROR(d_token_weights.Alloc(weights.size()));
  DispatchOutput host_out{out_x.data(), out_scales.data(), counts.data()};
  DispatchOutput gpu_out{d_out_x.p, d_out_scales.p, d_counts.p};
  if (token_major) {
    host_out.num_rows = &rows;
    host_out.token_experts = experts.data();
    host_out.token_weights = weights.data();
    gpu_out.num_rows = d_rows.p;
    gpu_out.token_experts = d_experts.p;
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
      RETURN_IF_ERROR(d_experts.Get(gpu_experts));
      RETURN_IF_ERROR(d_token_weights.Get(gpu_weights));
      RETURN_IF_ERROR(CompareTokenMajor(cfg, host_out, rows, gpu_rows[0], gpu_out_x,
                                        gpu_out_scales, gpu_experts, gpu_weights, gpu_counts));
      SumTokenMajorExperts(cfg, out_x.data(), out_scales.data(), experts.data(), weights.data(),
                           rows, expert_out.data(), fp16);
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

// The same case streamed: the dispatch (1), the combine (2) or both (3).
Case Streamed(Case c, int mask = 1) {
  c.stream = mask;
  return c;
}
// The same case with the CUDA AllToAll on the host reference's engine (Case::shared_engine).
Case SharedEngine(Case c) {
  c.shared_engine = true;
  return c;
}

const auto bf16 = DispatchDtype::kBf16, fp8 = DispatchDtype::kFp8E4M3;
const auto fp32 = DispatchDtype::kFp32;
const auto rnd = Routing::kRandom, hot = Routing::kAllToOneExpert;

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeCudaTest,
    ::testing::Values(Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
                           .dtype = bf16, .routing = rnd},
                      Case{.world_size = 2, .tokens = 1, .hidden = 128, .experts = 8, .k = 1,
                           .dtype = fp8, .routing = rnd, .private_tokens = 0},
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = fp8, .routing = rnd, .private_tokens = 16},  // decode shape
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = bf16, .routing = rnd, .private_tokens = 16,
                           .once_per_rank = true, .reduce_at_expert_rank = true},
                      Case{.world_size = 2, .tokens = 333, .hidden = 2176, .experts = 64, .k = 8,
                           .dtype = bf16, .routing = hot, .rank1_empty = true},
                      Case{.world_size = 3, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true},
                      Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256, .k = 8,
                           .dtype = bf16, .routing = rnd, .private_tokens = 8,
                           .reduce_at_expert_rank = true},
                      Case{.world_size = 2, .tokens = 1024, .hidden = 1024, .experts = 32, .k = 4,
                           .dtype = fp8, .routing = rnd, .private_tokens = 32},
                      // The NVLink path (both GPUs as one node; 3 and 4 ranks share them).
                      Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
                           .dtype = bf16, .routing = rnd, .nvlink = true},
                      Case{.world_size = 2, .tokens = 1, .hidden = 128, .experts = 8, .k = 1,
                           .dtype = fp8, .routing = rnd, .private_tokens = 0, .nvlink = true},
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = fp8, .routing = rnd, .private_tokens = 16, .nvlink = true},
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = bf16, .routing = rnd, .private_tokens = 16,
                           .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true},
                      Case{.world_size = 2, .tokens = 333, .hidden = 2176, .experts = 64, .k = 8,
                           .dtype = bf16, .routing = hot, .rank1_empty = true, .nvlink = true},
                      Case{.world_size = 3, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true, .nvlink = true},
                      Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256, .k = 8,
                           .dtype = bf16, .routing = rnd, .private_tokens = 8,
                           .reduce_at_expert_rank = true, .nvlink = true},
                      Case{.world_size = 2, .tokens = 1024, .hidden = 1024, .experts = 32, .k = 4,
                           .dtype = fp8, .routing = rnd, .private_tokens = 32, .nvlink = true},
                      Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256, .k = 16,
                           .dtype = fp8, .routing = rnd, .private_tokens = 64, .iterations = 2,
                           .nvlink = true},
                      Case{.world_size = 2, .tokens = 64, .hidden = 128, .experts = 1024, .k = 16,
                           .dtype = bf16, .routing = rnd, .private_tokens = 8, .rank1_empty = true,
                           .reduce_at_expert_rank = true, .iterations = 2, .nvlink = true},
                      // Top-k that does not divide a warp (SendSmall counts whole tokens per
                      // warp pass, lanes past them idle): plain, (a)+(b) over three ranks,
                      // graphs with device counts.
                      Case{.world_size = 2, .tokens = 77, .hidden = 128, .experts = 40, .k = 3,
                           .dtype = fp8, .routing = rnd, .nvlink = true},
                      Case{.world_size = 3, .tokens = 90, .hidden = 256, .experts = 48, .k = 6,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .nvlink = true},
                      Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 60, .k = 5,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                           .graph = true},
                      // Route's scan under graph replays with device counts (chunks left
                      // empty, then a count across two chunks), and over two groups of ranks.
                      Case{.world_size = 2, .tokens = 700, .hidden = 256, .experts = 64, .k = 4,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true, .iterations = 4,
                           .nvlink = true, .graph = true},
                      Case{.world_size = 6, .tokens = 600, .hidden = 128, .experts = 48, .k = 8,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true, .iterations = 2,
                           .nvlink = true},
                      // Graph capture and replay with device token counts: one node, then
                      // one rank per node (the relay carries every step; its thread waits on
                      // the replayed kernels' flags).
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = fp8, .routing = rnd, .private_tokens = 16, .iterations = 4,
                           .nvlink = true, .graph = true},
                      Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                           .graph = true},
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = fp8, .routing = rnd, .private_tokens = 16, .iterations = 4,
                           .graph = true},
                      Case{.world_size = 3, .tokens = 96, .hidden = 256, .experts = 48, .k = 4,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .graph = true},
                      // Several nodes of several GPUs: NVLink inside, the relay between (ranks
                      // share the GPUs round-robin, so each node spans both).
                      Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = fp8, .routing = rnd, .private_tokens = 16, .nvlink = true,
                           .node_ranks = 2},
                      Case{.world_size = 4, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = bf16, .routing = rnd, .private_tokens = 16,
                           .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
                           .node_ranks = 2},
                      Case{.world_size = 4, .tokens = 333, .hidden = 2176, .experts = 64, .k = 8,
                           .dtype = bf16, .routing = hot, .rank1_empty = true, .nvlink = true,
                           .node_ranks = 2},
                      Case{.world_size = 6, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true, .nvlink = true,
                           .node_ranks = 2},
                      Case{.world_size = 6, .tokens = 33, .hidden = 384, .experts = 96, .k = 8,
                           .dtype = bf16, .routing = rnd, .rank1_empty = true,
                           .reduce_at_expert_rank = true, .nvlink = true, .node_ranks = 3},
                      Case{.world_size = 4, .tokens = 1024, .hidden = 1024, .experts = 32, .k = 4,
                           .dtype = fp8, .routing = rnd, .private_tokens = 32, .iterations = 2,
                           .nvlink = true, .node_ranks = 2},
                      Case{.world_size = 4, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                           .graph = true, .node_ranks = 2},
                      // The token-major layout: one node, graphs, nodes of two, one rank per
                      // node; then ranks of both layouts in one node and in nodes of two.
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = fp8, .routing = rnd, .private_tokens = 16,
                           .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
                           .token_major = 1},
                      Case{.world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48, .k = 8,
                           .dtype = bf16, .routing = hot, .rank1_empty = true,
                           .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
                           .token_major = 1},
                      Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                           .graph = true, .token_major = 1},
                      Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 16,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .nvlink = true, .node_ranks = 2,
                           .token_major = 1},
                      Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64, .k = 8,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .token_major = 1},
                      Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256, .k = 8,
                           .dtype = bf16, .routing = rnd, .private_tokens = 16,
                           .once_per_rank = true, .reduce_at_expert_rank = true, .nvlink = true,
                           .token_major = 2},
                      Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .nvlink = true, .node_ranks = 2,
                           .token_major = 2},
                      // Eight ranks (four per GPU here): EP8 as one node and as two of four.
                      Case{.world_size = 8, .tokens = 32, .hidden = 256, .experts = 64, .k = 8,
                           .dtype = bf16, .routing = rnd, .iterations = 2, .nvlink = true},
                      Case{.world_size = 8, .tokens = 32, .hidden = 256, .experts = 64, .k = 8,
                           .dtype = fp8, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 2, .nvlink = true,
                           .node_ranks = 4},
                      // Streamed with every slot pushed (private slots for all a rank may send
                      // a peer): SendSmall, Pack, Pack with (a)+(b).
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 1024,
                                    .iterations = 2, .nvlink = true}),
                      Streamed(Case{.world_size = 2, .tokens = 600, .hidden = 256, .experts = 64,
                                    .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 4800,
                                    .iterations = 2, .nvlink = true}),
                      Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 512, .experts = 64,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 700,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .iterations = 2, .nvlink = true}),
                      // Streamed with pulled slots too: each receiver waits for each slot's tag
                      // (pulled: for its sender's flag).
                      Streamed(Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8,
                                    .k = 2, .dtype = bf16, .routing = rnd, .nvlink = true}),
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                                    .nvlink = true}),
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                                    .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true}),
                      Streamed(Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256,
                                    .k = 16, .dtype = fp8, .routing = rnd, .private_tokens = 64,
                                    .iterations = 2, .nvlink = true}),
                      Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 256, .experts = 64,
                                    .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                                    .iterations = 4, .nvlink = true, .graph = true}),
                      Streamed(Case{.world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48,
                                    .k = 8, .dtype = bf16, .routing = hot, .rank1_empty = true,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true, .token_major = 1}),
                      // What decode runs by default: SendSmall streamed, (a)+(b),
                      // captured graphs replayed with device token counts.
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true, .graph = true}),
                      // ... with more received slots (~460 a rank) than Unpack's streamed grid
                      // (what fits at once: 264 blocks on an H200) and at most twice it: a
                      // block per slot, each block claiming slots one after another.
                      Streamed(Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256,
                                    .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 8,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true}),
                      // The combine streamed: rows summed at the expert rank, copied per entry,
                      // copied per token-major row; graphs; with the dispatch streamed too.
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                                    .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true}, 2),
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 7168, .experts = 256,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                                    .nvlink = true}, 3),
                      Streamed(Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64,
                                    .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                                    .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                                    .graph = true, .token_major = 1}, 3),
                      Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 256, .experts = 64,
                                    .k = 4, .dtype = bf16, .routing = rnd, .once_per_rank = true,
                                    .iterations = 4, .nvlink = true, .graph = true}, 2),
                      Streamed(Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256,
                                    .k = 16, .dtype = fp8, .routing = rnd, .private_tokens = 64,
                                    .reduce_at_expert_rank = true, .iterations = 2,
                                    .nvlink = true}, 3),
                      Streamed(Case{.world_size = 3, .tokens = 333, .hidden = 2176, .experts = 48,
                                    .k = 8, .dtype = bf16, .routing = hot, .rank1_empty = true,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true},
                               3),
                      Streamed(Case{.world_size = 4, .tokens = 128, .hidden = 128, .experts = 256,
                                    .k = 8, .dtype = bf16, .routing = rnd, .private_tokens = 8,
                                    .reduce_at_expert_rank = true, .nvlink = true}, 3),
                      // More received slots than blocks, visited in order: pulled and pushed,
                      // one slot per copy summed at the expert rank; token-major.
                      Case{.world_size = 2, .tokens = 2048, .hidden = 128, .experts = 256,
                           .k = 16, .dtype = fp8, .routing = rnd, .private_tokens = 64,
                           .reduce_at_expert_rank = true, .iterations = 2, .nvlink = true},
                      Case{.world_size = 2, .tokens = 1024, .hidden = 1024, .experts = 32,
                           .k = 4, .dtype = fp8, .routing = rnd, .private_tokens = 32,
                           .once_per_rank = true, .reduce_at_expert_rank = true,
                           .iterations = 2, .nvlink = true, .token_major = 1},
                      // Two AllToAlls on one engine: one rank per node (every peer through the
                      // relay), and nodes of two with graphs.
                      SharedEngine(Case{.world_size = 2, .tokens = 128, .hidden = 7168,
                                        .experts = 256, .k = 8, .dtype = fp8, .routing = rnd,
                                        .private_tokens = 16, .once_per_rank = true,
                                        .reduce_at_expert_rank = true}),
                      SharedEngine(Case{.world_size = 4, .tokens = 96, .hidden = 256, .experts = 64,
                                        .k = 4, .dtype = bf16, .routing = rnd,
                                        .once_per_rank = true, .reduce_at_expert_rank = true,
                                        .iterations = 4, .nvlink = true, .graph = true,
                                        .node_ranks = 2}),
                      // fp32 rows and sums (kFp32): rows returned per copy and summed at the
                      // origin, by blocks and by warps; summed at the expert rank; token-major;
                      // the combine streamed; a graph; through the relay between two nodes.
                      Case{.world_size = 2, .tokens = 77, .hidden = 384, .experts = 40, .k = 3,
                           .dtype = fp32, .routing = rnd, .rank1_empty = true, .nvlink = true},
                      Case{.world_size = 2, .tokens = 1024, .hidden = 256, .experts = 32, .k = 4,
                           .dtype = fp32, .routing = rnd, .private_tokens = 32, .nvlink = true},
                      Case{.world_size = 3, .tokens = 90, .hidden = 256, .experts = 48, .k = 6,
                           .dtype = fp32, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .nvlink = true},
                      Case{.world_size = 2, .tokens = 96, .hidden = 256, .experts = 64, .k = 4,
                           .dtype = fp32, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .iterations = 4, .nvlink = true,
                           .graph = true, .token_major = 2},
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                                    .k = 8, .dtype = fp32, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true}, 3),
                      Streamed(Case{.world_size = 2, .tokens = 700, .hidden = 128, .experts = 64,
                                    .k = 4, .dtype = fp32, .routing = rnd, .iterations = 2,
                                    .nvlink = true}, 2),
                      Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
                           .dtype = fp32, .routing = rnd, .reduce_at_expert_rank = true,
                           .nvlink = true, .node_ranks = 2},
                      // Rows of any multiple of 16 columns (gpt-oss's hidden 2880, pplx's 16):
                      // streamed (a)+(b) token-major with a graph, plain by warps, through the
                      // relay.
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 2880, .experts = 64,
                                    .k = 4, .dtype = bf16, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .iterations = 3, .nvlink = true, .graph = true,
                                    .token_major = 1}, 3),
                      Case{.world_size = 2, .tokens = 1024, .hidden = 16, .experts = 32, .k = 4,
                           .dtype = fp32, .routing = rnd, .private_tokens = 32, .nvlink = true},
                      Case{.world_size = 4, .tokens = 64, .hidden = 48, .experts = 48, .k = 8,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .nvlink = true, .node_ranks = 2},
                      // fp8 rows with scales of the caller's count: per token, streamed
                      // (a)+(b); 23 groups of 128 over a hidden of 2880, through the relay.
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true, .fp8_scales = 1}, 3),
                      Case{.world_size = 4, .tokens = 64, .hidden = 2880, .experts = 48, .k = 4,
                           .dtype = fp8, .routing = rnd, .nvlink = true, .node_ranks = 2,
                           .fp8_scales = 23},
                      // bf16 and fp8 rows combined in fp32 (pplx's out_dtype float32): rows
                      // returned per copy, streamed (a)+(b), through the relay.
                      Case{.world_size = 2, .tokens = 77, .hidden = 384, .experts = 40, .k = 3,
                           .dtype = bf16, .routing = rnd, .rank1_empty = true, .nvlink = true,
                           .fp32_combine = true},
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true, .fp32_combine = true}, 3),
                      Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
                           .dtype = bf16, .routing = rnd, .reduce_at_expert_rank = true,
                           .nvlink = true, .node_ranks = 2, .fp32_combine = true},
                      // Rows combined in fp16 (pplx's float16 expert outputs): per copy, streamed
                      // (a)+(b), token-major in a graph, (b) through the relay.
                      Case{.world_size = 2, .tokens = 77, .hidden = 384, .experts = 40, .k = 3,
                           .dtype = bf16, .routing = rnd, .rank1_empty = true, .nvlink = true,
                           .fp16_combine = true},
                      Streamed(Case{.world_size = 2, .tokens = 128, .hidden = 1024, .experts = 64,
                                    .k = 8, .dtype = fp8, .routing = rnd, .private_tokens = 16,
                                    .once_per_rank = true, .reduce_at_expert_rank = true,
                                    .nvlink = true, .fp8_scales = 1, .fp16_combine = true}, 3),
                      Case{.world_size = 2, .tokens = 7, .hidden = 128, .experts = 8, .k = 2,
                           .dtype = bf16, .routing = rnd, .once_per_rank = true,
                           .reduce_at_expert_rank = true, .nvlink = true, .graph = true,
                           .token_major = 1, .fp16_combine = true},
                      Case{.world_size = 4, .tokens = 64, .hidden = 256, .experts = 48, .k = 8,
                           .dtype = bf16, .routing = rnd, .reduce_at_expert_rank = true,
                           .nvlink = true, .node_ranks = 2, .fp16_combine = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return Describe(info.param); });

}  // namespace
}  // namespace ferry
