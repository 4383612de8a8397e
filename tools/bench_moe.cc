// ferry-bench moe: the AllToAll (host device, or the CUDA device with --device cuda) across
// forked local ranks.
//
// Per step (dispatch send / recv, combine send / recv) it reports p50 and p99 over the
// iterations, as seen by the slowest rank of each iteration, plus the bytes each rank put on the
// wire. Baseline in the same run: the same bytes moved as one scatter (one write per peer, with
// an immediate) and awaited on every rank: the transport's floor for what dispatch and combine
// move. The ratio is step time over that floor.
#include "tools/bench_moe.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "tools/bench_moe_steps.h"
#include "tools/bench_util.h"

#ifdef FERRY_BENCH_CUDA
#include <cuda_runtime.h>

#include "tools/bench_moe_caller.h"
#include "moe/numerics.h"
#endif

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

// Bytes that must leave `rank`: each token's row (and scales) once per other rank holding one
// of its experts, and one bf16 row back from each of those ranks.
void MinimalBytes(const AllToAllConfig& c, const std::vector<int32_t>& idx, int tokens,
                  Result* r) {
  const int64_t row = c.token_bytes() + int64_t{c.scales_per_token()} * 4;
  r->min_dispatch_bytes = r->min_combine_bytes = 0;
  std::vector<char> seen(c.world_size);
  for (int t = 0; t < tokens; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    for (int j = 0; j < c.experts_per_token; ++j) {
      const int dst = idx[size_t(t) * c.experts_per_token + j] / c.local_experts();
      if (dst == c.rank || seen[dst]) continue;
      seen[dst] = 1;
      r->min_dispatch_bytes += row;
      r->min_combine_bytes += uint64_t(c.hidden) * 2;
    }
  }
}

// GPU 0 -> GPU 1 copy bandwidth in GB/s, 0 without two GPUs (or without CUDA).
double MeasurePeerBandwidth() {
#ifdef FERRY_BENCH_CUDA
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) return 0;
  constexpr size_t kBytes = size_t{256} << 20;
  void *a = nullptr, *b = nullptr;
  cudaSetDevice(1);
  if (cudaMalloc(&b, kBytes) != cudaSuccess) return 0;
  cudaSetDevice(0);
  if (cudaMalloc(&a, kBytes) != cudaSuccess) return 0;
  cudaDeviceEnablePeerAccess(1, 0);
  cudaGetLastError();  // already enabled is fine
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const double t0 = NowUs();
    cudaMemcpyPeer(b, 1, a, 0, kBytes);
    cudaDeviceSynchronize();
    const double us = NowUs() - t0;
    if (i > 0) best = std::max(best, kBytes / us / 1e3);
  }
  cudaFree(a);
  cudaSetDevice(1);
  cudaFree(b);
  return best;
#else
  return 0;
#endif
}


Status RunRank(const MoeBenchOptions& o, Bootstrap& b, Result* result) {
  AllToAllConfig cfg;
  cfg.world_size = b.world_size();
  cfg.rank = b.rank();
  cfg.num_experts = o.experts;
  cfg.experts_per_token = o.topk;
  cfg.max_tokens_per_rank = o.tokens;
  cfg.hidden = o.hidden;
  cfg.dtype = o.fp8 ? DispatchDtype::kFp8E4M3 : DispatchDtype::kBf16;
  cfg.max_private_tokens = o.private_tokens;
  cfg.streaming = o.stream < 0 ? Streaming::kAuto : static_cast<Streaming>(o.stream + 1);
  cfg.dispatch_once_per_rank = o.once_per_rank;
  cfg.combine_reduce_at_expert_rank = o.reduce_at_expert_rank;
  cfg.mask_lost_peers = o.masked_variant;
  if (o.token_major) cfg.dispatch_layout = DispatchLayout::kTokenMajor;
  cfg.ranks_per_node = !o.nvlink ? 1 : o.node_ranks > 0 ? o.node_ranks : b.world_size();
  cfg.forwarding = o.forwarding;
  if (o.cuda) {
    cfg.device = MoeDeviceKind::kCuda;
#ifdef FERRY_BENCH_CUDA
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
      return FailedPreconditionError("bench: --device cuda, but no GPU");
    }
    cfg.cuda_device = b.rank() % gpus;
    cudaSetDevice(cfg.cuda_device);
#endif
  }
  // The CUDA kernels' scheduling from FERRY_NV_* / FERRY_RELAY_TRACE, as tools/gpu_check.sh's
  // modes set them.
  ASSIGN_OR_RETURN(cfg.cuda, CudaTuning::FromEnv());
  RETURN_IF_ERROR(cfg.Validate());
  ASSIGN_OR_RETURN(EngineOptions eo, BenchEngineOptions(o.provider));
  std::unique_ptr<TransferEngine> a2a_engine;  // one node over NVLink needs none
  if (cfg.ranks_per_node < cfg.world_size) {
    ASSIGN_OR_RETURN(a2a_engine, TransferEngine::Create(eo));
  }
  ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, a2a_engine.get(), b));

  const int l = cfg.local_experts();
  const int64_t cap = cfg.expert_capacity();
  std::mt19937 rng(b.rank() + 1);
  std::vector<uint8_t> x(size_t(o.tokens) * cfg.token_bytes());
  for (auto& v : x) v = static_cast<uint8_t>(rng() & 0x3F);
  std::vector<float> scales(size_t(o.tokens) * cfg.scales_per_token(), 1.0f);
  std::vector<int32_t> idx(size_t(o.tokens) * o.topk);
  std::vector<float> w(idx.size(), 1.0f / o.topk);
  std::vector<int32_t> experts(o.experts);
  for (int e = 0; e < o.experts; ++e) experts[e] = e;
  for (int t = 0; t < o.tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy(experts.begin(), experts.begin() + o.topk, idx.begin() + size_t(t) * o.topk);
  }
  std::vector<uint8_t> out_x(size_t(l) * cap * cfg.token_bytes());
  std::vector<float> out_scales(size_t(l) * cap * cfg.scales_per_token());
  std::vector<int32_t> counts(l);
  std::vector<uint16_t> expert_out(size_t(l) * cap * o.hidden, FloatToBf16(1.0f));
  std::vector<uint16_t> y(size_t(o.tokens) * o.hidden);
  std::vector<int32_t> num_rows(1), token_experts(size_t(cap) * o.topk);
  std::vector<float> token_weights(token_experts.size());
  StepBuffers sb;
  ASSIGN_OR_RETURN(uint8_t* px, Place(sb, x, o.cuda));
  ASSIGN_OR_RETURN(float* pscales, Place(sb, scales, o.cuda));
  ASSIGN_OR_RETURN(int32_t* pidx, Place(sb, idx, o.cuda));
  ASSIGN_OR_RETURN(float* pw, Place(sb, w, o.cuda));
  ASSIGN_OR_RETURN(uint8_t* pout_x, Place(sb, out_x, o.cuda));
  ASSIGN_OR_RETURN(float* pout_scales, Place(sb, out_scales, o.cuda));
  ASSIGN_OR_RETURN(int32_t* pcounts, Place(sb, counts, o.cuda));
  ASSIGN_OR_RETURN(uint16_t* pexpert_out, Place(sb, expert_out, o.cuda));
  ASSIGN_OR_RETURN(uint16_t* py, Place(sb, y, o.cuda));

  sb.in = {px, pscales, pidx, pw, o.tokens};
  sb.out = {pout_x, pout_scales, pcounts};
  if (o.token_major) {
    ASSIGN_OR_RETURN(sb.out.num_rows, Place(sb, num_rows, o.cuda));
    ASSIGN_OR_RETURN(sb.out.token_experts, Place(sb, token_experts, o.cuda));
    ASSIGN_OR_RETURN(sb.out.token_weights, Place(sb, token_weights, o.cuda));
  }
  sb.expert_out = pexpert_out;
  sb.y = py;
  std::vector<int64_t> dispatch_cost(o.ranks), combine_cost(o.ranks);
  if (o.cost_variant) {
    ASSIGN_OR_RETURN(sb.out.wait_cost, Place(sb, dispatch_cost, o.cuda));
    ASSIGN_OR_RETURN(sb.combine_cost, Place(sb, combine_cost, o.cuda));
  }
#ifdef FERRY_BENCH_CUDA
  if (o.caller) RETURN_IF_ERROR(SetUpCaller(cfg, sb));
#endif
  std::vector<double> steps[10];
  if (o.cuda) {  // every CUDA AllToAll runs from a stream: timed on the GPU, in graphs
#ifdef FERRY_BENCH_CUDA
    RETURN_IF_ERROR(TimeGraphCycles(o, b, *a2a, sb, steps));
    if (sb.with_caller) RETURN_IF_ERROR(CheckCaller(sb.caller));
#endif
  }
  const std::chrono::milliseconds step_timeout(o.step_timeout_ms);
  for (int it = 0; !o.cuda && it < o.warmup + o.iters; ++it) {
    RETURN_IF_ERROR(b.Barrier(step_timeout));
    double t0 = NowUs();
    RETURN_IF_ERROR(a2a->DispatchSend({px, pscales, pidx, pw, o.tokens}));
    double t1 = NowUs();
    RETURN_IF_ERROR(a2a->DispatchRecv(sb.out, Deadline::After(step_timeout)));
    double t2 = NowUs();
    RETURN_IF_ERROR(a2a->CombineSend(CombineInput{pexpert_out, o.fp16_combine}));
    double t3 = NowUs();
    RETURN_IF_ERROR(
        a2a->CombineRecv(CombineOutput{py, false, nullptr, sb.combine_cost, o.fp16_combine},
                         Deadline::After(step_timeout)));
    double t4 = NowUs();
    if (it >= o.warmup) {
      steps[0].push_back(t1 - t0);
      steps[1].push_back(t2 - t1);
      steps[2].push_back(t3 - t2);
      steps[3].push_back(t4 - t3);
      steps[4].push_back(t2 - t0);
      steps[5].push_back(t4 - t2);
    }
  }
  if (!steps[6].empty()) {
    ASSIGN_OR_RETURN(steps[6], SlowestPerIteration(b, steps[6]));
    result->empty_step_p50 = Percentile(steps[6], 0.5);
  }
  if (!steps[7].empty()) {
    ASSIGN_OR_RETURN(steps[7], SlowestPerIteration(b, steps[7]));
    result->cycle_in_graph_p50 = Percentile(steps[7], 0.5);
    result->cycle_in_graph_p99 = Percentile(steps[7], 0.99);
  }
  for (int h = 0; h < 2; ++h) {
    if (steps[8 + h].empty()) continue;
    ASSIGN_OR_RETURN(steps[8 + h], SlowestPerIteration(b, steps[8 + h]));
    result->step_in_graph_p50[h] = Percentile(steps[8 + h], 0.5);
    result->step_in_graph_p99[h] = Percentile(steps[8 + h], 0.99);
  }
  for (int s = 0; s < 6; ++s) {
    ASSIGN_OR_RETURN(steps[s], SlowestPerIteration(b, steps[s]));
    (s < 4 ? result->p50[s] : result->total_p50[s - 4]) = Percentile(steps[s], 0.5);
    (s < 4 ? result->p99[s] : result->total_p99[s - 4]) = Percentile(steps[s], 0.99);
  }
  result->dispatch_bytes = a2a->dispatch_bytes_sent();
  result->combine_bytes = a2a->combine_bytes_sent();
  MinimalBytes(cfg, idx, o.tokens, result);
  result->p2p_gbps = 0;
#ifdef FERRY_BENCH_CUDA
  if (o.cuda && b.rank() == 0) {
    result->p2p_gbps = MeasurePeerBandwidth();
    cudaSetDevice(cfg.cuda_device);
  }
#endif

  // Floor: the same bytes per peer as one scatter with an immediate, awaited on every rank.
  const int n = b.world_size();
  if (n > 1 && !o.nvlink) {
    // A second engine, so the floor's peers and counters are its own.
    ASSIGN_OR_RETURN(auto floor_engine, TransferEngine::Create(eo));
    TransferEngine* engine = floor_engine.get();
    // Every rank sizes its landing area for the largest sender.
    uint64_t most = std::max(result->dispatch_bytes, result->combine_bytes) / (n - 1) + 64;
    std::vector<uint8_t> mine(sizeof most);
    std::memcpy(mine.data(), &most, sizeof most);
    ASSIGN_OR_RETURN(auto sizes, b.AllGather(mine, 60s));
    for (const auto& sz : sizes) {
      uint64_t v = 0;
      if (sz.size() == sizeof v) std::memcpy(&v, sz.data(), sizeof v);
      most = std::max(most, v);
    }
    std::vector<uint8_t> src(most), dst(most * n);
    ASSIGN_OR_RETURN(MemoryRegion src_reg, engine->RegisterMemory(src.data(), src.size()));
    ASSIGN_OR_RETURN(MemoryRegion dst_reg, engine->RegisterMemory(dst.data(), dst.size()));
    ASSIGN_OR_RETURN(auto addresses, b.AllGather(engine->Address(), 60s));
    ASSIGN_OR_RETURN(auto regions, b.AllGather(dst_reg.remote().Serialize(), 60s));
    std::vector<PeerId> members;
    std::vector<RemoteRegion> dsts;
    for (int r = 0; r < n; ++r) {
      if (r == b.rank()) continue;
      ASSIGN_OR_RETURN(PeerId p, engine->AddPeer(addresses[r]));
      members.push_back(p);
      ASSIGN_OR_RETURN(RemoteRegion region, RemoteRegion::Parse(regions[r]));
      dsts.push_back(region);
    }
    ASSIGN_OR_RETURN(GroupId group, engine->AddPeerGroup(members));
    ASSIGN_OR_RETURN(ScatterPlanId plan, engine->PrepareScatter(group, src_reg, dsts));
    constexpr uint32_t kFloorImm = 0xD0000001u;
    RETURN_IF_ERROR(engine->CreateImmCounter(kFloorImm));
    for (int which = 0; which < 2; ++which) {
      const uint64_t per_peer = (which == 0 ? result->dispatch_bytes : result->combine_bytes) /
                                (n - 1);
      std::vector<ScatterTarget> targets;
      for (uint32_t m = 0; m < members.size(); ++m) {
        targets.push_back({m, 0, uint64_t(b.rank()) * most, per_peer});
      }
      std::vector<double> t;
      for (int it = 0; it < o.warmup + o.iters; ++it) {
        RETURN_IF_ERROR(b.Barrier(60s));
        TransferCounter c;
        double t0 = NowUs();
        RETURN_IF_ERROR(engine->Scatter({plan, targets, kFloorImm}, Completion::Counter(&c)));
        RETURN_IF_ERROR(engine->WaitImm(kFloorImm, n - 1, Deadline::After(60s)));
        RETURN_IF_ERROR(engine->ConsumeImm(kFloorImm, n - 1));
        double elapsed = NowUs() - t0;
        RETURN_IF_ERROR(c.Wait(1, Deadline::After(60s)));
        if (it >= o.warmup) t.push_back(elapsed);
      }
      ASSIGN_OR_RETURN(t, SlowestPerIteration(b, t));
      (which == 0 ? result->floor_dispatch_p50 : result->floor_combine_p50) = Percentile(t, 0.5);
    }
  }
  return b.Barrier(60s);
}

}  // namespace

namespace {

// Runs one variant across forked ranks; rank 0's figures come back.
bool RunVariant(const MoeBenchOptions& o, Result* out) {
  return RunRanksAndCollect<Result>(
      "moe", o.ranks, 0, [&](Bootstrap& b, Result* r) { return RunRank(o, b, r); }, out,
      std::chrono::minutes(10), o.world);
}

const char* VariantName(const MoeBenchOptions& o) {
  // One row per variant (14 characters at most: the table's first column); its columns: the
  // plain run, shrink mode (--mask-lost-peers), wait costs counted (--wait-cost), node-once
  // forwarding (--node-once).
  static constexpr const char* kNames[][4] = {
      {"tok+permute", "tok+perm shrk", "tok+perm cost", "tok+perm node1"},
      {"(a)+(b) tok", "(a)+(b)t shrk", "(a)+(b)t cost", "(a)+(b)t node1"},
      {"(a)+(b)", "(a)+(b) shrk", "(a)+(b) cost", "(a)+(b) node1"},
      {"(a) once/rank", "(a) shrink", "(a) cost", "(a) node1"},
      {"(b) reduce", "(b) shrink", "(b) cost", "(b) node1"},
      {"plain", "plain shrink", "plain cost", "plain node1"},
  };
  const int row = o.caller                                    ? 0
                  : o.token_major                             ? 1
                  : o.once_per_rank && o.reduce_at_expert_rank ? 2
                  : o.once_per_rank                           ? 3
                  : o.reduce_at_expert_rank                   ? 4
                                                              : 5;
  return kNames[row][o.forwarding == Forwarding::kNodeOnce ? 3
                     : o.cost_variant                      ? 2
                     : o.masked_variant                    ? 1
                                                           : 0];
}

}  // namespace

int RunMoeBench(const MoeBenchOptions& options) {
  std::vector<MoeBenchOptions> variants = {options};
  if (options.compare) {
    variants.assign(4, options);
    variants[1].once_per_rank = true;
    variants[2].reduce_at_expert_rank = true;
    variants[3].once_per_rank = variants[3].reduce_at_expert_rank = true;
    variants[0].once_per_rank = variants[0].reduce_at_expert_rank = false;
  }
  for (MoeBenchOptions& v : variants) v.token_major = false;
  if (options.token_major) {
    MoeBenchOptions token = options;
    token.once_per_rank = token.reduce_at_expert_rank = true;
    variants.push_back(token);
#ifdef FERRY_BENCH_CUDA
    if (options.cuda) {  // and with the caller's permute and un-permute timed in
      token.caller = true;
      variants.push_back(token);
    }
#endif
  }
  if (options.mask_lost_peers) {  // each variant again, in shrink mode
    const size_t plain = variants.size();
    for (size_t i = 0; i < plain; ++i) {
      variants.push_back(variants[i]);
      variants.back().masked_variant = true;
    }
  }
  if (options.wait_cost) {  // each variant not in shrink mode again, counting wait costs
    const size_t before = variants.size();
    for (size_t i = 0; i < before; ++i) {
      if (variants[i].masked_variant) continue;
      variants.push_back(variants[i]);
      variants.back().cost_variant = true;
    }
  }
  if (options.node_once) {  // each variant again, node-once (after its per-rank run)
    std::vector<MoeBenchOptions> both;
    for (const MoeBenchOptions& v : variants) {
      both.push_back(v);
      both.push_back(v);
      both.back().forwarding = Forwarding::kNodeOnce;
    }
    variants = std::move(both);
  }
  const MoeBenchOptions& o = options;
  if (o.world && o.world->rank() != 0) {  // one rank of a rendezvous: rank 0 reports
    for (const MoeBenchOptions& v : variants) {
      Result r{};
      if (!RunVariant(v, &r)) return 1;
      std::printf("ferry-bench moe [rank %d of %d] %s: done (rank 0 prints the figures)\n",
                  o.world->rank(), o.world->world_size(), VariantName(v));
    }
    return 0;
  }
  if (!o.json) {
    std::printf("ferry-bench moe  device=%s provider=%s ranks=%d nodes=%d tokens=%d hidden=%d "
                "experts=%d topk=%d dtype=%s%s  (slowest rank per iteration, %d iterations)\n",
                o.cuda ? "cuda" : "host", o.provider.c_str(), o.ranks,
                o.nvlink && o.node_ranks > 0 ? o.ranks / o.node_ranks : o.nvlink ? 1 : o.ranks,
                o.tokens, o.hidden, o.experts, o.topk, o.fp8 ? "fp8" : "bf16",
                o.fp16_combine ? " combine=fp16" : "", o.iters);
    std::printf("%-14s | %21s %21s | %21s %21s | %21s %21s | %10s %10s | %7s %7s | %9s %9s | "
                "%6s %6s\n",
                "variant", "dispatch send p50/p99", "dispatch recv p50/p99",
                "combine send p50/p99", "combine recv p50/p99", "dispatch p50/p99",
                "combine p50/p99", "disp bytes", "comb bytes", "d GB/s", "c GB/s", "floor d",
                "floor c", "d/fl", "c/fl");
  } else {
    std::printf("{\"bench\":\"moe\",\"device\":\"%s\",\"provider\":\"%s\",\"ranks\":%d,"
                "\"tokens\":%d,\"hidden\":%d,\"experts\":%d,\"topk\":%d,\"dtype\":\"%s\","
                "\"variants\":[",
                o.cuda ? "cuda" : "host", o.provider.c_str(), o.ranks, o.tokens, o.hidden, o.experts, o.topk,
                o.fp8 ? "fp8" : "bf16");
  }
  Result last{};  // the last variant's figures, for the NVLink floor line
  for (size_t v = 0; v < variants.size(); ++v) {
    Result r{};
    if (!RunVariant(variants[v], &r)) return 1;
    last = r;
    if (o.nvlink) {  // the floor is NVLink's: the fewest bytes at the measured bandwidth
      r.floor_dispatch_p50 = r.p2p_gbps > 0 ? r.min_dispatch_bytes / (r.p2p_gbps * 1e3) : 0;
      r.floor_combine_p50 = r.p2p_gbps > 0 ? r.min_combine_bytes / (r.p2p_gbps * 1e3) : 0;
    }
    const double dispatch = r.total_p50[0], combine = r.total_p50[1];
    // What crossed to other ranks over the p50 step time (bytes per µs / 1e3 = GB/s).
    const double d_gbps = dispatch > 0 ? r.dispatch_bytes / (dispatch * 1e3) : 0;
    const double c_gbps = combine > 0 ? r.combine_bytes / (combine * 1e3) : 0;
    const double d_ratio = r.floor_dispatch_p50 > 0 ? dispatch / r.floor_dispatch_p50 : 0;
    const double c_ratio = r.floor_combine_p50 > 0 ? combine / r.floor_combine_p50 : 0;
    if (o.json) {
      std::printf("%s{\"variant\":\"%s\",\"p50_us\":[%.2f,%.2f,%.2f,%.2f],"
                  "\"p99_us\":[%.2f,%.2f,%.2f,%.2f],\"dispatch_bytes\":%llu,"
                  "\"combine_bytes\":%llu,\"dispatch_gbps\":%.3f,\"combine_gbps\":%.3f,"
                  "\"floor_dispatch_p50_us\":%.2f,"
                  "\"floor_combine_p50_us\":%.2f,\"cycle_in_graph_p50_us\":%.2f,"
                  "\"step_in_graph_p50_us\":[%.2f,%.2f]}",
                  v ? "," : "", VariantName(variants[v]), r.p50[0], r.p50[1], r.p50[2], r.p50[3],
                  r.p99[0], r.p99[1], r.p99[2], r.p99[3], (unsigned long long)r.dispatch_bytes,
                  (unsigned long long)r.combine_bytes, d_gbps, c_gbps, r.floor_dispatch_p50,
                  r.floor_combine_p50,
                  r.cycle_in_graph_p50, r.step_in_graph_p50[0], r.step_in_graph_p50[1]);
    } else {
      std::printf("%-14s | %10.1f %10.1f %10.1f %10.1f | %10.1f %10.1f %10.1f %10.1f | "
                  "%10.1f %10.1f %10.1f %10.1f | %10llu %10llu | %7.2f %7.2f | %9.1f %9.1f | "
                  "%6.2f %6.2f\n",
                  VariantName(variants[v]), r.p50[0], r.p99[0], r.p50[1], r.p99[1], r.p50[2],
                  r.p99[2], r.p50[3], r.p99[3], r.total_p50[0], r.total_p99[0], r.total_p50[1],
                  r.total_p99[1], (unsigned long long)r.dispatch_bytes,
                  (unsigned long long)r.combine_bytes, d_gbps, c_gbps, r.floor_dispatch_p50,
                  r.floor_combine_p50, d_ratio, c_ratio);
      if (o.cuda) {
        std::printf("%-14s   per cycle in one graph of %d cycles: p50/p99 %.1f / %.1f us "
                    "(dispatch + combine above: %.1f us); in that graph with an event node "
                    "before each step: dispatch %.1f / %.1f, combine %.1f / %.1f us\n",
                    "", kInGraphCycles, r.cycle_in_graph_p50, r.cycle_in_graph_p99,
                    dispatch + combine, r.step_in_graph_p50[0], r.step_in_graph_p99[0],
                    r.step_in_graph_p50[1], r.step_in_graph_p99[1]);
      }
    }
  }
  if (o.json) std::printf("]}\n");
  else {
    if (o.cuda) {
      std::printf("times in us, GPU time between events (CUDA graph replays, a cycle before each "
                  "timed one aligns the ranks); each half is a graph of its own, dispatch and "
                  "combine one graph of both halves; bytes = what rank 0 sent to other ranks; "
                  "floor = %s; an empty step (4-byte memset graph) between the same events takes "
                  "%.1f us\n",
                  o.nvlink ? "the NVLink floor below"
                           : "the same bytes as one engine scatter per peer (host-timed)",
                  last.empty_step_p50);
    } else {
      std::printf("times in us; bytes = what rank 0 put on the wire; floor = the same bytes as "
                  "one scatter per peer\n");
    }
  }
  if (o.cuda) {
    // The NVLink floor of the last variant run (rank 0's bytes; routing is the same for all).
    const Result& r = last;
    if (r.p2p_gbps > 0) {
      std::printf("NVLink floor (rank 0): dispatch %llu B, combine %llu B at %.1f GB/s (GPU0->GPU1 "
                  "copy) = %.1f us / %.1f us\n",
                  (unsigned long long)r.min_dispatch_bytes, (unsigned long long)r.min_combine_bytes,
                  r.p2p_gbps, r.min_dispatch_bytes / (r.p2p_gbps * 1e3),
                  r.min_combine_bytes / (r.p2p_gbps * 1e3));
    } else {
      std::printf("NVLink floor: needs two GPUs (minimal bytes: dispatch %llu, combine %llu)\n",
                  (unsigned long long)r.min_dispatch_bytes,
                  (unsigned long long)r.min_combine_bytes);
    }
  }
  return 0;
}

}  // namespace ferry::bench
