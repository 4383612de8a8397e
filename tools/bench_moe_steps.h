// ferry-bench moe's pieces that a rank's run (bench_moe.cc) and its CUDA graph timing
// (bench_moe_graphs.cc) share: the step buffers, the results, and the percentiles over ranks.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "tools/bench_moe.h"

#ifdef FERRY_BENCH_CUDA
#include <cuda_runtime.h>

#include "tools/bench_moe_caller.h"
#endif

namespace ferry::bench {

constexpr int kInGraphCycles = 20;  // CUDA: cycles per graph in TimeInGraph

inline double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

// The slowest rank's time for each iteration: all-gather every rank's samples.
inline StatusOr<std::vector<double>> SlowestPerIteration(Bootstrap& b,
                                                        const std::vector<double>& mine) {
  std::vector<uint8_t> bytes(mine.size() * sizeof(double));
  std::memcpy(bytes.data(), mine.data(), bytes.size());
  ASSIGN_OR_RETURN(auto all, b.AllGather(bytes, std::chrono::seconds(60)));
  std::vector<double> out(mine);
  for (auto& r : all) {
    for (size_t i = 0; i < out.size() && (i + 1) * sizeof(double) <= r.size(); ++i) {
      double v;
      std::memcpy(&v, r.data() + i * sizeof(double), sizeof v);
      out[i] = std::max(out[i], v);
    }
  }
  return out;
}

// The step buffers: host vectors, or their copies in GPU memory for the CUDA device.
struct StepBuffers {
  DispatchInput in;
  DispatchOutput out;
  const uint16_t* expert_out = nullptr;
  uint16_t* y = nullptr;
  int64_t* combine_cost = nullptr;  // MoeBenchOptions::cost_variant: CombineOutput::wait_cost
  std::vector<void*> owned;  // device allocations
#ifdef FERRY_BENCH_CUDA
  TokenMajorCaller caller;  // MoeBenchOptions::caller: the caller's kernels around the GEMM
  bool with_caller = false;
#endif
  ~StepBuffers() {
#ifdef FERRY_BENCH_CUDA
    for (void* p : owned) cudaFree(p);
#endif
  }
};

// Points `b` at the host buffers, or (cuda) at device copies of them.
template <typename T>
StatusOr<T*> Place(StepBuffers& b, std::vector<T>& host, bool cuda) {
  if (!cuda) return host.data();
#ifdef FERRY_BENCH_CUDA
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(host.size(), 1) * sizeof(T)) != cudaSuccess ||
      cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) !=
          cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {  // pageable copies may land after returning
    return InternalError("bench: GPU buffer of " + std::to_string(host.size() * sizeof(T)) +
                         " bytes");
  }
  b.owned.push_back(p);
  return static_cast<T*>(p);
#else
  (void)b;
  return UnimplementedError("ferry-bench was built without CUDA");
#endif
}

struct Result {
  double p50[4], p99[4];
  double total_p50[2], total_p99[2];  // dispatch (send + recv), combine (send + recv)
  double empty_step_p50;              // NVLink timing: an empty step between the same events
  double cycle_in_graph_p50, cycle_in_graph_p99;  // dispatch + combine, one graph of many cycles
  double step_in_graph_p50[2], step_in_graph_p99[2];  // the same with event nodes between steps
  double floor_dispatch_p50, floor_combine_p50;
  uint64_t dispatch_bytes, combine_bytes;
  // The NVLink floor (CUDA device, >= 2 GPUs): the fewest bytes that must leave this rank (each
  // token once per other destination rank; one bf16 row per token per other expert rank) over
  // the measured GPU-to-GPU copy bandwidth.
  uint64_t min_dispatch_bytes, min_combine_bytes;
  double p2p_gbps;
};

#ifdef FERRY_BENCH_CUDA
// bench_moe_graphs.cc: every CUDA AllToAll runs from a stream, timed on the GPU in graphs
// (samples[0..3] the steps, [4] dispatch, [5] combine, [6] the empty step, [7..9] the cycles in
// one graph, in microseconds); the token-major caller's buffers and its check.
Status TimeGraphCycles(const MoeBenchOptions& o, Bootstrap& b, AllToAll& a2a,
                       const StepBuffers& sb, std::vector<double> (&samples)[10]);
Status SetUpCaller(const AllToAllConfig& cfg, StepBuffers& sb);
Status CheckCaller(const TokenMajorCaller& c);
#endif

}  // namespace ferry::bench
