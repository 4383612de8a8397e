// The CUDA moe device against the host device, on the same inputs, in the same ranks.
//
// Every rank runs two AllToAlls side by side (each with its own engine): the host device on host
// buffers and the CUDA device on GPU buffers. Dispatch outputs must be identical (counts, rows,
// scales) and so must combine outputs (the CUDA kernels sum in the host device's order with
// unfused fp32 operations). Ranks share the GPUs round-robin. Skips without a GPU.
//
// Run on the GPU machine: build/moe_cuda_test (or ctest -R MoeCuda).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe_inputs.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

bool HaveGpu() { return access("/dev/nvidia0", F_OK) == 0; }

struct Case {
  int world_size, tokens, hidden, experts, k;
  DispatchDtype dtype;
  Routing routing;
  int private_tokens = 4;
  bool rank1_empty = false;
  bool once_per_rank = false;
  bool reduce_at_expert_rank = false;
  int iterations = 3;
};

std::string Describe(const Case& c) {
  return "n" + std::to_string(c.world_size) + "_t" + std::to_string(c.tokens) + "_h" +
         std::to_string(c.hidden) + "_e" + std::to_string(c.experts) + "_k" +
         std::to_string(c.k) + (c.dtype == DispatchDtype::kBf16 ? "_bf16" : "_fp8") +
         (c.routing == Routing::kAllToOneExpert ? "_hot" : "") + (c.rank1_empty ? "_empty1" : "") +
         (c.once_per_rank ? "_a" : "") + (c.reduce_at_expert_rank ? "_b" : "");
}
void PrintTo(const Case& c, std::ostream* os) { *os << Describe(c); }

#define CUDA_OR_RETURN(expr)                                                               \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    CHECK_OR_RETURN(e_ == cudaSuccess, std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

template <typename T>
struct Gpu {
  T* p = nullptr;
  ~Gpu() {
    if (p) cudaFree(p);
  }
  Status Alloc(size_t count) {
    CUDA_OR_RETURN(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    return Status::Ok();
  }
  Status Put(const std::vector<T>& v) {
    if (!v.empty()) CUDA_OR_RETURN(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return Status::Ok();
  }
  Status Get(std::vector<T>& v) const {
    if (!v.empty()) CUDA_OR_RETURN(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return Status::Ok();
  }
};

Status RunRank(const Case& c, Bootstrap& b) {
  int gpus = 0;
  CUDA_OR_RETURN(cudaGetDeviceCount(&gpus));
  const AllToAllConfig cfg = ConfigFor(c, b.world_size(), b.rank());
  AllToAllConfig gpu_cfg = cfg;
  gpu_cfg.device = MoeDeviceKind::kCuda;
  gpu_cfg.cuda_device = b.rank() % gpus;
  CUDA_OR_RETURN(cudaSetDevice(gpu_cfg.cuda_device));
  ASSIGN_OR_RETURN(auto host_engine, TransferEngine::Create(testing_util::TestOptions("shm")));
  ASSIGN_OR_RETURN(auto gpu_engine, TransferEngine::Create(testing_util::TestOptions("shm")));
  ASSIGN_OR_RETURN(auto host, AllToAll::Create(cfg, host_engine.get(), b));
  ASSIGN_OR_RETURN(auto gpu, AllToAll::Create(gpu_cfg, gpu_engine.get(), b));

  const int l = cfg.local_experts(), h = cfg.hidden;
  const int64_t cap = cfg.expert_capacity(), row = cfg.token_bytes(), spt = cfg.scales_per_token();
  std::vector<uint8_t> out_x(size_t(l) * cap * row, 0), gpu_out_x(out_x.size());
  std::vector<float> out_scales(size_t(l) * cap * spt, 0), gpu_out_scales(out_scales.size());
  std::vector<int32_t> counts(l), gpu_counts(l);
  std::vector<uint16_t> expert_out(size_t(l) * cap * h, 0);
  Gpu<uint8_t> d_x, d_out_x;
  Gpu<float> d_scales, d_weights, d_out_scales;
  Gpu<int32_t> d_indices, d_counts;
  Gpu<uint16_t> d_expert_out, d_y;
  RETURN_IF_ERROR(d_x.Alloc(size_t(cfg.max_tokens_per_rank) * row));
  RETURN_IF_ERROR(d_scales.Alloc(size_t(cfg.max_tokens_per_rank) * spt));
  RETURN_IF_ERROR(d_indices.Alloc(size_t(cfg.max_tokens_per_rank) * c.k));
  RETURN_IF_ERROR(d_weights.Alloc(size_t(cfg.max_tokens_per_rank) * c.k));
  RETURN_IF_ERROR(d_out_x.Alloc(out_x.size()));
  RETURN_IF_ERROR(d_out_scales.Alloc(out_scales.size()));
  RETURN_IF_ERROR(d_counts.Alloc(l));
  RETURN_IF_ERROR(d_expert_out.Alloc(expert_out.size()));
  RETURN_IF_ERROR(d_y.Alloc(size_t(cfg.max_tokens_per_rank) * h));

  const InputSpec spec{c.tokens, c.k, c.experts, c.dtype, c.routing, c.rank1_empty};
  for (int it = 0; it < c.iterations; ++it) {
    const std::string at = " (iteration " + std::to_string(it) + ")";
    Inputs in = MakeInputs(spec, cfg, b.rank(), it);
    // Fewer tokens on later iterations: the same AllToAll serves any batch up to the maximum.
    if (it == 2 && in.tokens > 1) in.tokens /= 2;
    RETURN_IF_ERROR(d_x.Put(in.x));
    RETURN_IF_ERROR(d_scales.Put(in.scales));
    RETURN_IF_ERROR(d_indices.Put(in.indices));
    RETURN_IF_ERROR(d_weights.Put(in.weights));
    RETURN_IF_ERROR(host->DispatchSend({in.x.data(), in.scales.empty() ? nullptr : in.scales.data(),
                                        in.indices.data(), in.weights.data(), in.tokens}));
    RETURN_IF_ERROR(gpu->DispatchSend({d_x.p, spt ? d_scales.p : nullptr, d_indices.p,
                                       d_weights.p, in.tokens}));
    RETURN_IF_ERROR(host->DispatchRecv({out_x.data(), out_scales.data(), counts.data()},
                                       Deadline::After(30s)));
    RETURN_IF_ERROR(gpu->DispatchRecv({d_out_x.p, d_out_scales.p, d_counts.p},
                                      Deadline::After(30s)));
    RETURN_IF_ERROR(d_counts.Get(gpu_counts));
    RETURN_IF_ERROR(d_out_x.Get(gpu_out_x));
    RETURN_IF_ERROR(d_out_scales.Get(gpu_out_scales));
    for (int e = 0; e < l; ++e) {
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
          expert_out[r * h + col] = FloatToBf16(
              Dequant(cfg, out_x.data() + r * row, &out_scales[r * spt], col) * ExpertScale(g));
        }
      }
    }
    RETURN_IF_ERROR(d_expert_out.Put(expert_out));
    RETURN_IF_ERROR(host->CombineSend(expert_out.data()));
    RETURN_IF_ERROR(gpu->CombineSend(d_expert_out.p));
    const bool accumulate = it % 2 == 1;
    std::vector<uint16_t> y(size_t(in.tokens) * h, FloatToBf16(0.5f)), gpu_y(y.size());
    RETURN_IF_ERROR(d_y.Put(y));
    RETURN_IF_ERROR(host->CombineRecv(y.data(), accumulate, Deadline::After(30s)));
    RETURN_IF_ERROR(gpu->CombineRecv(d_y.p, accumulate, Deadline::After(30s)));
    RETURN_IF_ERROR(d_y.Get(gpu_y));
    for (size_t i = 0; i < y.size(); ++i) {
      CHECK_OR_RETURN(gpu_y[i] == y[i], "combine output " + std::to_string(i) + ": GPU " +
                                            std::to_string(Bf16ToFloat(gpu_y[i])) + ", host " +
                                            std::to_string(Bf16ToFloat(y[i])) + at);
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

// A GPU that is not there is a clear error at Create, on any machine.
TEST(MoeCudaConfigTest, AMissingGpuIsAFailedPrecondition) {
  auto exits = RunLocalRanks(1, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{1, 0, 1, 8, 2, 4, 128, DispatchDtype::kBf16, 2};
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

const auto bf16 = DispatchDtype::kBf16, fp8 = DispatchDtype::kFp8E4M3;
const auto rnd = Routing::kRandom, hot = Routing::kAllToOneExpert;

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeCudaTest,
    ::testing::Values(Case{2, 7, 128, 8, 2, bf16, rnd}, Case{2, 1, 128, 8, 1, fp8, rnd, 0},
                      Case{2, 128, 7168, 256, 8, fp8, rnd, 16},      // decode shape
                      Case{2, 128, 7168, 256, 8, bf16, rnd, 16, false, true, true},
                      Case{2, 333, 2176, 64, 8, bf16, hot, 4, true},
                      Case{3, 64, 256, 48, 16, fp8, rnd, 4, false, true, false},
                      Case{4, 128, 128, 256, 8, bf16, rnd, 8, false, false, true},
                      Case{2, 1024, 1024, 32, 4, fp8, rnd, 32}),
    [](const ::testing::TestParamInfo<Case>& info) { return Describe(info.param); });

}  // namespace
}  // namespace ferry
