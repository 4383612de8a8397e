// ferry-bench moe on the CUDA device: the steps timed on the GPU from CUDA graph replays, and
// the token-major caller's side (its kernels around the GEMM) set up and checked. Built with
// CUDA only (FERRY_BENCH_CUDA).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "moe/numerics.h"
#include "tools/bench_moe_steps.h"
#include "tools/bench_util.h"

namespace ferry::bench {

using namespace std::chrono_literals;

#define BENCH_CUDA(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) return InternalError(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

// Dispatch and combine as a model's graph runs them, one layer after another: kInGraphCycles
// cycles captured in one graph, timed as a whole between events and divided by the cycles, so
// neither a graph launch nor an event sits between the steps (only the gaps between kernels).
// Each round: the aligning cycle, then the graph; samples[7]: one per round, microseconds per
// cycle (dispatch + combine). Then the same cycles with an event node before each dispatch and
// each combine (`marks`, 2 * kInGraphCycles + 1 events recorded inside the graph): samples[8]
// and [9], each cycle's dispatch and combine as a model's graph sees them -- from the end of
// the step before to the end of the step, the event node included.
static Status TimeInGraph(const MoeBenchOptions& o, Bootstrap& b, cudaStream_t stream,
                          cudaGraphExec_t cycle, cudaGraphExec_t cycles, cudaGraphExec_t marked,
                          const std::vector<cudaEvent_t>& marks,
                          std::vector<double> (&samples)[10]) {
  cudaEvent_t ev[2] = {};
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  const int rounds = 1 + std::max(10, o.iters / kInGraphCycles);
  for (int round = 0; round < rounds; ++round) {
    RETURN_IF_ERROR(b.Barrier(60s));
    BENCH_CUDA(cudaGraphLaunch(cycle, stream));
    BENCH_CUDA(cudaEventRecord(ev[0], stream));
    BENCH_CUDA(cudaGraphLaunch(cycles, stream));
    BENCH_CUDA(cudaEventRecord(ev[1], stream));
    BENCH_CUDA(cudaGraphLaunch(cycle, stream));
    BENCH_CUDA(cudaGraphLaunch(marked, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    if (round == 0) continue;  // warm-up
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    samples[7].push_back(ms * 1e3 / kInGraphCycles);
    for (int k = 0; k < kInGraphCycles; ++k) {
      float step_ms[2];
      for (int h = 0; h < 2; ++h) {
        BENCH_CUDA(cudaEventElapsedTime(&step_ms[h], marks[2 * k + h], marks[2 * k + h + 1]));
        samples[8 + h].push_back(step_ms[h] * 1e3);
      }
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return Status::Ok();
}

// The NVLink path, timed on the GPU. Captured once: a whole dispatch + combine cycle, each step
// as a graph of its own, and dispatch and combine as one graph each (send and receive back to
// back, as a model's graph runs them). Each iteration launches the cycle (it aligns the ranks: a
// CombineRecv waits for every rank's CombineSend), then the four step graphs with events between
// them; then the cycle again and the dispatch and combine graphs between events. The host queues
// everything while the aligning cycle runs, so the events see GPU time, not launch gaps.
// samples[0..3] the steps, [4] dispatch, [5] combine, [6] the empty step, [7..9] TimeInGraph,
// in microseconds.
Status TimeGraphCycles(const MoeBenchOptions& o, Bootstrap& b, AllToAll& a2a,
                       const StepBuffers& sb, std::vector<double> (&samples)[10]) {
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev[9] = {};
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  RETURN_IF_ERROR(a2a.SetStream(stream));
  const Deadline later = Deadline::After(std::chrono::minutes(5));
  // With the caller's side (MoeBenchOptions::caller), the permute ends the dispatch receive
  // step and the un-permute starts the combine send step.
  const std::function<Status()> steps[4] = {[&] { return a2a.DispatchSend(sb.in); },
                                            [&] {
                                              RETURN_IF_ERROR(a2a.DispatchRecv(sb.out, later));
                                              if (sb.with_caller)
                                                BENCH_CUDA(LaunchPermute(sb.caller, stream));
                                              return Status::Ok();
                                            },
                                            [&] {
                                              if (sb.with_caller)
                                                BENCH_CUDA(LaunchUnpermute(sb.caller, stream));
                                              return a2a.CombineSend(
                                                  CombineInput{sb.expert_out, o.fp16_combine});
                                            },
                                            [&] {
                                              return a2a.CombineRecv(
                                                  CombineOutput{sb.y, false, nullptr,
                                                                sb.combine_cost, o.fp16_combine},
                                                  later);
                                            }};
  // Steps first..last, `repeats` times over, as one graph; with `marks`, an event node before
  // each dispatch and each combine and one at the end.
  auto capture = [&](int first, int last, cudaGraphExec_t* exec, int repeats = 1,
                     const std::vector<cudaEvent_t>* marks = nullptr) -> Status {
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    Status s = Status::Ok();
    int marked = 0;
    auto mark = [&] {
      if (!marks || !s.ok()) return;
      const cudaError_t e = cudaEventRecordWithFlags((*marks)[marked++], stream,
                                                     cudaEventRecordExternal);
      if (e != cudaSuccess) s = InternalError(std::string("event node: ") + cudaGetErrorString(e));
    };
    for (int k = 0; k < repeats; ++k) {
      for (int i = first; i <= last && s.ok(); ++i) {
        if (i % 2 == 0) mark();
        s = steps[i]();
      }
    }
    mark();
    cudaGraph_t graph = nullptr;
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    RETURN_IF_ERROR(s);
    BENCH_CUDA(cudaGraphInstantiate(exec, graph, 0));
    cudaGraphDestroy(graph);
    return Status::Ok();
  };
  cudaGraphExec_t cycle = nullptr, step[4] = {}, half[2] = {}, empty = nullptr;
  RETURN_IF_ERROR(capture(0, 3, &cycle));
  cudaGraphExec_t cycles = nullptr, marked = nullptr;  // kInGraphCycles cycles (TimeInGraph)
  RETURN_IF_ERROR(capture(0, 3, &cycles, kInGraphCycles));
  std::vector<cudaEvent_t> marks(2 * kInGraphCycles + 1);
  for (auto& e : marks) BENCH_CUDA(cudaEventCreate(&e));
  RETURN_IF_ERROR(capture(0, 3, &marked, kInGraphCycles, &marks));
  for (int i = 0; i < 4; ++i) RETURN_IF_ERROR(capture(i, i, &step[i]));
  RETURN_IF_ERROR(capture(0, 1, &half[0]));
  RETURN_IF_ERROR(capture(2, 3, &half[1]));
  // Baseline for the cost of a step boundary: a graph of one 4-byte memset between two events.
  void* word = nullptr;
  BENCH_CUDA(cudaMalloc(&word, 4));
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t memset = cudaMemsetAsync(word, 0, 4, stream);
  cudaGraph_t empty_graph = nullptr;
  BENCH_CUDA(cudaStreamEndCapture(stream, &empty_graph));
  BENCH_CUDA(memset);
  BENCH_CUDA(cudaGraphInstantiate(&empty, empty_graph, 0));
  cudaGraphDestroy(empty_graph);
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    RETURN_IF_ERROR(b.Barrier(60s));
    BENCH_CUDA(cudaGraphLaunch(cycle, stream));
    for (int i = 0; i < 4; ++i) {
      BENCH_CUDA(cudaEventRecord(ev[i], stream));
      BENCH_CUDA(cudaGraphLaunch(step[i], stream));
    }
    BENCH_CUDA(cudaEventRecord(ev[4], stream));
    BENCH_CUDA(cudaGraphLaunch(empty, stream));
    BENCH_CUDA(cudaEventRecord(ev[5], stream));
    BENCH_CUDA(cudaGraphLaunch(cycle, stream));
    BENCH_CUDA(cudaEventRecord(ev[6], stream));
    BENCH_CUDA(cudaGraphLaunch(half[0], stream));
    BENCH_CUDA(cudaEventRecord(ev[7], stream));
    BENCH_CUDA(cudaGraphLaunch(half[1], stream));
    BENCH_CUDA(cudaEventRecord(ev[8], stream));
    RETURN_IF_ERROR(a2a.Synchronize());
    if (it < o.warmup) continue;
    float ms[4];
    for (int i = 0; i < 4; ++i) BENCH_CUDA(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
    for (int i = 0; i < 4; ++i) samples[i].push_back(ms[i] * 1e3);
    float half_ms[2];
    for (int i = 0; i < 2; ++i) BENCH_CUDA(cudaEventElapsedTime(&half_ms[i], ev[6 + i], ev[7 + i]));
    samples[4].push_back(half_ms[0] * 1e3);
    samples[5].push_back(half_ms[1] * 1e3);
    float empty_ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&empty_ms, ev[4], ev[5]));
    samples[6].push_back(empty_ms * 1e3);
  }
  RETURN_IF_ERROR(TimeInGraph(o, b, stream, cycle, cycles, marked, marks, samples));
  cudaGraphExecDestroy(cycles);
  cudaGraphExecDestroy(marked);
  for (auto& e : marks) cudaEventDestroy(e);
  RETURN_IF_ERROR(a2a.SetStream(nullptr));
  cudaFree(word);
  for (cudaGraphExec_t g : {cycle, step[0], step[1], step[2], step[3], half[0], half[1], empty}) {
    cudaGraphExecDestroy(g);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cudaStreamDestroy(stream);
  return Status::Ok();
}

// The token-major caller's buffers (MoeBenchOptions::caller): expert groups for the permuted
// rows, where each copy went, the un-permuted rows CombineSend then takes. The GEMM's output is
// the expert-major expert_out the other variants hand CombineSend.
Status SetUpCaller(const AllToAllConfig& cfg, StepBuffers& sb) {
  TokenMajorCaller& c = sb.caller;
  const int64_t cap = cfg.expert_capacity();
  c.k = cfg.experts_per_token;
  c.local_experts = cfg.local_experts();
  c.expert_capacity = cap;
  c.row_bytes = cfg.token_bytes();
  c.scales_per_row = cfg.scales_per_token();
  c.hidden = cfg.hidden;
  c.num_rows = sb.out.num_rows;
  c.token_experts = sb.out.token_experts;
  c.token_weights = sb.out.token_weights;
  c.rows = static_cast<const uint8_t*>(sb.out.x);
  c.row_scales = sb.out.scales;
  auto alloc = [&](int64_t bytes, auto** p) -> Status {
    void* raw = nullptr;
    BENCH_CUDA(cudaMalloc(&raw, std::max<int64_t>(bytes, 16)));
    BENCH_CUDA(cudaMemset(raw, 0, std::max<int64_t>(bytes, 16)));
    sb.owned.push_back(raw);
    *p = static_cast<std::remove_pointer_t<decltype(p)>>(raw);
    return Status::Ok();
  };
  RETURN_IF_ERROR(alloc(c.local_experts * cap * c.row_bytes, &c.grouped));
  RETURN_IF_ERROR(alloc(c.local_experts * cap * c.scales_per_row * 4, &c.grouped_scales));
  RETURN_IF_ERROR(alloc(int64_t{c.local_experts} * 4, &c.fill));
  RETURN_IF_ERROR(alloc(cap * c.k * 4, &c.where));
  uint16_t* combined = nullptr;
  RETURN_IF_ERROR(alloc(cap * c.hidden * 2, &combined));
  c.combined = combined;
  c.gemm_out = sb.expert_out;
  sb.expert_out = combined;
  sb.with_caller = true;
  return Status::Ok();
}

// After the timed cycles (the last one ran DispatchRecv, the permute, the un-permute and
// CombineSend): every received copy sits in its expert's group, byte for byte (up to 2048 copies
// checked, spread over the rows), no two copies in one place, and each un-permuted row is the sum
// of its copies' weights (the GEMM output the bench hands over is 1.0 everywhere).
Status CheckCaller(const TokenMajorCaller& c) {
  int32_t rows = 0;
  BENCH_CUDA(cudaMemcpy(&rows, c.num_rows, 4, cudaMemcpyDeviceToHost));
  if (rows < 0 || rows > c.expert_capacity) return InternalError("caller check: row count");
  std::vector<int32_t> experts(size_t(rows) * c.k), where(experts.size());
  std::vector<float> weights(experts.size());
  BENCH_CUDA(
      cudaMemcpy(experts.data(), c.token_experts, experts.size() * 4, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(where.data(), c.where, where.size() * 4, cudaMemcpyDeviceToHost));
  BENCH_CUDA(
      cudaMemcpy(weights.data(), c.token_weights, weights.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<std::vector<char>> taken(c.local_experts, std::vector<char>(c.expert_capacity));
  const int64_t copies =
      std::count_if(experts.begin(), experts.end(), [](int32_t e) { return e >= 0; });
  const int64_t every = std::max<int64_t>(1, copies / 2048);
  std::vector<uint8_t> want(c.row_bytes), got(c.row_bytes);
  std::vector<uint16_t> sum(c.hidden);
  int64_t seen = 0;
  for (int64_t g = 0; g < rows; ++g) {
    float total = 0;
    for (int k = 0; k < c.k; ++k) {
      const int32_t e = experts[g * c.k + k], pos = where[g * c.k + k];
      if (e < 0) continue;
      if (e >= c.local_experts || pos < 0 || pos >= c.expert_capacity || taken[e][pos]) {
        return InternalError("caller check: row " + std::to_string(g) + " copy " +
                             std::to_string(k) + " placed at " + std::to_string(pos));
      }
      taken[e][pos] = 1;
      total += weights[g * c.k + k];
      if (seen++ % every != 0) continue;
      BENCH_CUDA(
          cudaMemcpy(want.data(), c.rows + g * c.row_bytes, c.row_bytes, cudaMemcpyDeviceToHost));
      BENCH_CUDA(cudaMemcpy(got.data(), c.grouped + (e * c.expert_capacity + pos) * c.row_bytes,
                            c.row_bytes, cudaMemcpyDeviceToHost));
      if (want != got)
        return InternalError("caller check: row " + std::to_string(g) + " permuted wrong");
    }
    if (g % every != 0) continue;
    BENCH_CUDA(
        cudaMemcpy(sum.data(), c.combined + g * c.hidden, c.hidden * 2, cudaMemcpyDeviceToHost));
    for (uint16_t v : sum) {
      if (v != FloatToBf16(total)) {
        return InternalError("caller check: row " + std::to_string(g) + " summed to " +
                             std::to_string(Bf16ToFloat(v)) + ", not " + std::to_string(total));
      }
    }
  }
  return Status::Ok();
}

}  // namespace ferry::bench
