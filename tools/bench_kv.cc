// ferry-bench kv: the KV messenger moving one request's cache from a prefill process to a decode
// process, next to a raw libfabric loop writing the same bytes in the same write sizes, in the
// same run.
//
// In each round the prefill "model" first runs the raw loop to learn the provider's rate, then
// paces its layer counter at that rate (one layer per layer-transfer time, as if compute and
// transfer were balanced), so the figures say both how fast the messenger moves bytes (GB/s
// against raw) and how soon after the last layer the decoder is ready (against one layer's
// transfer time). The raw loop runs twice per round: pipelined (its rate paces the layers) and
// layer by layer, each layer alone as the last one moves (its mean is the second baseline for
// the tail). Rounds alternate so that a noisy host shows as a spread, not as a verdict.
#include "tools/bench_kv.h"

#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/kv.h"
#include "tools/bench_util.h"
#include "tools/raw_fabric.h"

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

struct Model {
  const char* name;
  KvModel model;
  int layers;
  int prefill_tp, decode_tp;
};

struct Result {
  double bytes;            // per request, all layers and ranks
  double ferry_us;         // first layer increment -> decode ready
  double tail_us;          // last layer increment -> decode ready
  double raw_us;           // raw loop, same bytes and write sizes
  double layer_us;         // one layer's transfer time at the raw rate
  double alone_us;         // one layer moved alone by the raw loop (mean over the layers)
  int64_t writes_per_layer;
  double ratio_min, ratio_max;  // raw / ferry over the rounds (the figures above: the median)
  // Tail over the same round's lone layer, every round: the median, the lowest, the highest.
  // (The figures above are one round's, chosen by its ratio; at a pace above 1 every round's
  // ratio is at 1 / pace, so that choice says nothing about the tail.)
  double tail_alone_p50, tail_alone_min, tail_alone_max;
  int rounds;
};

Status Run(const KvBenchOptions& o, const Model& m, Bootstrap& b, Result* out) {
  const KvSide pre{m.model, KvOrder::kHND, m.prefill_tp};
  const KvSide dec{m.model, KvOrder::kHND, m.decode_tp};
  const int64_t pages = (o.tokens + m.model.page_tokens - 1) / m.model.page_tokens;
  const bool prefill = b.rank() == 0;
  const KvSide& side = prefill ? pre : dec;
  const int64_t stride = side.page_bytes() * pages;
  ASSIGN_OR_RETURN(EngineOptions eo, BenchEngineOptions(o.provider));
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(eo));
  // All shards of this side in one allocation: the messenger registers one region per shard,
  // the raw loop the whole, so both read and write exactly the same memory.
  const int64_t shard_bytes = stride * m.layers;
  std::vector<uint8_t> memory(static_cast<size_t>(shard_bytes) * side.tp, 1);
  std::vector<MemoryRegion> regs;
  KvRegions regions;
  for (int s = 0; s < side.tp; ++s) {
    ASSIGN_OR_RETURN(MemoryRegion r,
                     engine->RegisterMemory(memory.data() + s * shard_bytes, shard_bytes));
    regs.push_back(std::move(r));
  }
  for (auto& r : regs) regions.ranks.push_back(&r);
  regions.num_layers = m.layers;
  regions.layer_stride = stride;
  std::vector<int64_t> page_ids(pages);
  std::iota(page_ids.begin(), page_ids.end(), 0);
  ASSIGN_OR_RETURN(KvPlan plan, PlanKvTransfer(pre, dec, page_ids, page_ids, 1));
  const double layer_bytes = std::accumulate(plan.writes.begin(), plan.writes.end(), 0.0,
                                             [](double a, const KvWrite& w) { return a + w.length; });
  out->bytes = layer_bytes * m.layers;
  out->writes_per_layer = static_cast<int64_t>(plan.writes.size());

  // Raw baseline: the same writes (same offsets in the same memory), one raw endpoint.
  const int64_t dst_shard_bytes = dec.page_bytes() * pages * m.layers;
  const int64_t src_shard_bytes = pre.page_bytes() * pages * m.layers;
  RawFabric raw;
  RETURN_IF_ERROR(raw.Open(o.provider, eo.node, memory.data(), memory.size()));
  ASSIGN_OR_RETURN(auto raws, b.AllGather(raw.Describe(), 60s));
  // The raw baseline writes every decoder's bytes, as the messenger does: the prefill connects
  // to every decoder, each decoder to the prefill.
  if (prefill) {
    for (int r = 1; r < b.world_size(); ++r) RETURN_IF_ERROR(raw.Connect(raws[r]));
  } else {
    RETURN_IF_ERROR(raw.Connect(raws[0]));
  }
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(engine->Address(), 60s));

  // The messenger's two sides, for every round.
  const int decoders = b.world_size() - 1;
  std::atomic<uint64_t> layers_done{0};
  std::mutex mu;
  std::vector<uint64_t> arrived;
  std::atomic<int> released{0}, failed{0};
  std::unique_ptr<KvPrefill> prefill_messenger;
  std::unique_ptr<KvDecoder> decoder;
  if (prefill) {
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    KvPrefill::Callbacks cb;
    cb.on_request = [&](const KvPrefill::Incoming& in) {
      std::lock_guard<std::mutex> l(mu);
      arrived.push_back(in.request_id);
    };
    cb.on_released = [&](uint64_t, const Status& s) {
      if (!s.ok()) failed.fetch_add(1);
      released.fetch_add(1);
    };
    ASSIGN_OR_RETURN(const KvPrefill::Options options, KvPrefill::Options::FromEnv());
    ASSIGN_OR_RETURN(prefill_messenger, KvPrefill::Create(engine.get(), pre, regions, nullptr,
                                                          &layers_done, cb, options));
  } else {
    ASSIGN_OR_RETURN(decoder, KvDecoder::Create(engine.get(), dec, regions, nullptr));
  }
  RETURN_IF_ERROR(b.Barrier(60s));

  // Rounds of (raw, messenger), alternating, so that both see the same host conditions; the
  // messenger's layers in a round are paced at that round's raw rate. The round of median ratio
  // is reported, with the lowest and highest ratio.
  struct Round {
    double raw_us, alone_us, ferry_us, tail_us;
  };
  std::vector<Round> rounds;
  uint64_t imms = 0;
  uint32_t last = 0;
  // One raw pass over every layer's writes. Pipelined: the window of writes in flight spans
  // layers (the raw rate the layers are paced at). Layer by layer: each layer's writes complete
  // before the next layer's are posted, so each layer moves alone as the last one must; the mean
  // of those times is one layer's transfer time by itself. Write i goes to decoder i % decoders:
  // the plan's writes layer by layer, each to every decoder in turn; the last write to each
  // decoder carries its one immediate per pass.
  const uint64_t per_decoder = plan.writes.size() * m.layers;
  const uint64_t per_layer = plan.writes.size() * decoders;
  auto raw_pass = [&](bool by_layer, double* alone_us) -> StatusOr<double> {
    const uint64_t window = std::min<uint64_t>(64, raw.tx_depth());
    const uint64_t total = per_decoder * decoders;
    uint64_t posted = 0, done = 0;
    const double t0 = NowUs();
    double layer_start = t0, alone_sum = 0;
    while (done < total) {
      const uint64_t bound = by_layer ? (done / per_layer + 1) * per_layer : total;
      while (posted < bound && posted - done < window) {
        const uint64_t k = posted / decoders;
        const KvWrite& w = plan.writes[k % plan.writes.size()];
        const int64_t layer = static_cast<int64_t>(k / plan.writes.size());
        const uint64_t src = w.src_rank * src_shard_bytes + layer * stride + w.src_offset;
        const uint64_t dst = w.dst_rank * dst_shard_bytes + layer * dec.page_bytes() * pages +
                             w.dst_offset;
        if (!raw.Post(posted % decoders, src, dst, w.length, k + 1 == per_decoder, 1)) break;
        ++posted;
      }
      int r = raw.Poll(&imms, &last);
      if (r < 0) return InternalError("raw completion error");
      done += r;
      if (by_layer && r > 0 && done % per_layer == 0) {
        const double now = NowUs();
        alone_sum += now - layer_start;
        layer_start = now;
      }
    }
    if (alone_us) *alone_us = alone_sum / m.layers;
    return NowUs() - t0;
  };
  for (int round = 0; round < o.rounds; ++round) {
    double raw_us = 0, alone_us = 0;
    if (prefill) {
      ASSIGN_OR_RETURN(raw_us, raw_pass(false, nullptr));
      RETURN_IF_ERROR(raw_pass(true, &alone_us).status());
    } else {
      while (imms < 2 * static_cast<uint64_t>(round + 1)) {  // one immediate per raw pass
        if (raw.Poll(&imms, &last) < 0) return InternalError("raw completion error");
      }
    }
    RETURN_IF_ERROR(b.Barrier(60s));
    // Share the raw times so both sides know the layer pacing.
    std::vector<uint8_t> mine(2 * sizeof(double));
    std::memcpy(mine.data(), &raw_us, sizeof(double));
    std::memcpy(mine.data() + sizeof(double), &alone_us, sizeof(double));
    ASSIGN_OR_RETURN(auto raw_times, b.AllGather(mine, 60s));
    std::memcpy(&raw_us, raw_times[0].data(), sizeof(double));
    std::memcpy(&alone_us, raw_times[0].data() + sizeof(double), sizeof(double));
    const double layer_us = raw_us / m.layers;
    const double spacing_us = o.pace * layer_us;  // the model's time per layer

    if (prefill) {
      Deadline deadline = Deadline::After(60s);
      // Every decoder's request in the same pass (the same source pages: one prompt, N decoders).
      std::vector<uint64_t> ids;
      for (;;) {
        {
          std::lock_guard<std::mutex> l(mu);
          if (static_cast<int>(arrived.size()) == decoders * (round + 1)) {
            ids.assign(arrived.end() - decoders, arrived.end());
            break;
          }
        }
        if (deadline.Expired()) return DeadlineExceededError("prefill: requests did not arrive");
        std::this_thread::sleep_for(50us);
      }
      const uint64_t base = layers_done.load();
      for (uint64_t id : ids) RETURN_IF_ERROR(prefill_messenger->Schedule(id, page_ids, base, 0));
      // Layers at the raw transfer rate (times the pace); the decoder timestamps the increments
      // it sees through the shared start time below.
      double start = NowUs();
      for (int l = 0; l < m.layers; ++l) {
        // Sleep, not spin: on small machines the engine's worker and the watcher need the cores.
        SleepUntilUs(start + l * spacing_us);
        layers_done.fetch_add(1, std::memory_order_release);
      }
      double last_inc = NowUs();
      std::vector<uint8_t> times(2 * sizeof(double));
      std::memcpy(times.data(), &start, sizeof start);
      std::memcpy(times.data() + sizeof start, &last_inc, sizeof last_inc);
      RETURN_IF_ERROR(b.AllGather(times, 60s).status());
      while (released.load() < decoders * (round + 1) && !deadline.Expired()) {
        std::this_thread::sleep_for(50us);
      }
      if (released.load() < decoders * (round + 1) || failed.load() > 0) {
        return InternalError("prefill: requests not all released cleanly");
      }
    } else {
      std::atomic<bool> ready{false};
      std::atomic<double> ready_at{0};
      Status result;
      KvDecoder::Request req;
      req.request_id = static_cast<uint64_t>(round) * 1000 + static_cast<uint64_t>(b.rank());
      req.prefill_address = addresses[0];
      req.prefill = pre;
      req.pages = page_ids;
      req.num_tokens = o.tokens;
      RETURN_IF_ERROR(decoder->Submit(req, Deadline::After(60s), [&](const Status& s) {
        ready_at = NowUs();  // same host: CLOCK_MONOTONIC is shared between the processes
        result = s;
        ready = true;
      }));
      ASSIGN_OR_RETURN(auto times, b.AllGather({}, 60s));
      Deadline deadline = Deadline::After(60s);
      while (!ready && !deadline.Expired()) std::this_thread::sleep_for(20us);
      if (!ready) return DeadlineExceededError("decoder never ready");
      RETURN_IF_ERROR(result);
      double start, last_inc;
      std::memcpy(&start, times[0].data(), sizeof start);
      std::memcpy(&last_inc, times[0].data() + sizeof start, sizeof last_inc);
      rounds.push_back({raw_us, alone_us, ready_at - start, ready_at - last_inc});
      if (const char* t = std::getenv("FERRY_KV_TRACE"); t && *t && *t != '0') {
        std::fprintf(stderr, "kv trace decoder %d: last layer marked at %.1f us, ready +%.1f\n",
                     b.rank(), last_inc, ready_at - last_inc);
      }
    }
    RETURN_IF_ERROR(b.Barrier(60s));
  }
  if (!prefill) {
    std::sort(rounds.begin(), rounds.end(), [](const Round& x, const Round& y) {
      return x.raw_us / x.ferry_us < y.raw_us / y.ferry_us;
    });
    const Round& median = rounds[rounds.size() / 2];
    out->raw_us = median.raw_us;
    out->ferry_us = median.ferry_us;
    out->tail_us = median.tail_us;
    out->layer_us = median.raw_us / m.layers;
    out->alone_us = median.alone_us;
    out->ratio_min = rounds.front().raw_us / rounds.front().ferry_us;
    out->ratio_max = rounds.back().raw_us / rounds.back().ferry_us;
    out->rounds = static_cast<int>(rounds.size());
    std::vector<double> tails;
    for (const Round& r : rounds) tails.push_back(r.tail_us / r.alone_us);
    std::sort(tails.begin(), tails.end());
    out->tail_alone_p50 = tails[tails.size() / 2];
    out->tail_alone_min = tails.front();
    out->tail_alone_max = tails.back();
  }
  return Status::Ok();
}

}  // namespace

int RunKvBench(const KvBenchOptions& o) {
  const Model models[] = {
      {"deepseek-r1 mla", {1, 576, 2, true, 64}, 61, 1, 1},
      {"qwen3-coder tp8>tp8", {8, 128, 2, false, 64}, 62, 8, 8},
      {"qwen3-coder tp8>tp4", {8, 128, 2, false, 64}, 62, 8, 4},
  };
  const auto run_model = [&](const Model& m, Result* r) {
    return RunRanksAndCollect<Result>(
        "kv", 1 + o.decoders, 1, [&](Bootstrap& b, Result* out) { return Run(o, m, b, out); }, r,
        std::chrono::minutes(5), o.world);
  };
  if (o.world && o.world->rank() != 0) {  // one rank of a rendezvous: rank 0 reports
    for (const Model& m : models) {
      Result r{};
      if (!run_model(m, &r)) return 1;
      std::printf("ferry-bench kv [rank %d of %d] %s: done (rank 0 prints the figures)\n",
                  o.world->rank(), o.world->world_size(), m.name);
    }
    return 0;
  }
  if (!o.json) {
    std::printf(
        "ferry-bench kv  provider=%s prompt=%d tokens  (1 prefill -> %d decode "
        "process%s; figures of decoder 1; raw writes every decoder's bytes; layers "
        "%.2f x one layer's raw transfer time apart)\n",
        o.provider.c_str(), o.tokens, o.decoders, o.decoders > 1 ? "es" : "", o.pace);
    std::printf("%-20s %9s %9s | %10s %10s %8s %13s | %10s %10s %6s %10s %6s | %7s %11s\n",
                "cache", "MB", "writes/l", "ferry ms", "raw ms", "ratio", "(min..max)",
                "tail us", "layer us", "tail/l", "alone us", "tail/a", "t/a p50", "(min..max)");
  }
  bool first = true;
  if (o.json) {
    std::printf("{\"bench\":\"kv\",\"tokens\":%d,\"pace\":%.2f,\"rows\":[", o.tokens, o.pace);
  }
  for (const Model& m : models) {
    Result r{};
    if (!run_model(m, &r)) return 1;
    // Throughput: bytes over the time from the first layer to ready, against the raw loop's
    // time for the same bytes. Pacing layers at the raw rate makes raw the lower bound.
    const double ratio = r.raw_us / r.ferry_us;
    if (o.json) {
      std::printf("%s{\"cache\":\"%s\",\"bytes\":%.0f,\"writes_per_layer\":%lld,\"ferry_us\":%.1f,"
                  "\"raw_us\":%.1f,\"ratio\":%.3f,\"ratio_min\":%.3f,\"ratio_max\":%.3f,"
                  "\"rounds\":%d,\"tail_us\":%.1f,\"layer_us\":%.1f,\"alone_us\":%.1f,"
                  "\"tail_alone_p50\":%.3f,\"tail_alone_min\":%.3f,\"tail_alone_max\":%.3f}",
                  first ? "" : ",", m.name, r.bytes, (long long)r.writes_per_layer, r.ferry_us,
                  r.raw_us, ratio, r.ratio_min, r.ratio_max, r.rounds, r.tail_us, r.layer_us,
                  r.alone_us, r.tail_alone_p50, r.tail_alone_min, r.tail_alone_max);
    } else {
      std::printf(
          "%-20s %9.1f %9lld | %10.2f %10.2f %8.3f  (%.3f..%.3f) | %10.1f %10.1f %6.2f %10.1f "
          "%6.2f | %7.2f (%.2f..%.2f)\n",
          m.name, r.bytes / 1e6, (long long)r.writes_per_layer, r.ferry_us / 1e3, r.raw_us / 1e3,
          ratio, r.ratio_min, r.ratio_max, r.tail_us, r.layer_us, r.tail_us / r.layer_us,
          r.alone_us, r.tail_us / r.alone_us, r.tail_alone_p50, r.tail_alone_min,
          r.tail_alone_max);
    }
    first = false;
  }
  if (o.json) std::printf("]}\n");
  else {
    std::printf(
        "%d rounds of (raw, ferry) alternating; the figures of the round of median ratio, "
        "then the lowest and highest ratio; ratio = raw time / ferry time for the same "
        "bytes (ferry's layers paced at %.2f x that round's raw rate%s); tail = last "
        "layer increment -> decode ready; layer = one layer's raw transfer time (the "
        "pipelined raw loop's time / layers); alone = one layer's time when the raw loop "
        "moves the layers one after another, each waiting for the last (mean; what the last "
        "layer, which has nothing to overlap with, costs at best); t/a = tail / alone of "
        "every round: median (lowest..highest)\n",
        o.rounds, o.pace, o.pace > 1 ? ", so the ratio is at most 1 / pace" : "");
  }
  return 0;
}

}  // namespace ferry::bench
