// ferry-bench soak: long runs that must leave nothing behind. Two phases, each on forked local
// ranks:
//   moe  4 ranks, host device: dispatch + combine cycles, every cycle's combined output checked
//        (identity experts, weights summing to 1: each token comes back as it left); with a
//        rendezvous (--world-size N --rank R --rendezvous HOST:PORT) this phase alone, one
//        process per rank started apart, N dividing the 16 experts (tests/netns_test.sh runs
//        it across network namespaces while a link goes down and comes back);
//   kv   a prefill and decoders that come and go (each a new engine every `churn` requests),
//        every request's pages checked byte for byte; the prefill's peer table is held to a few
//        entries, so decoders that left are evicted as new ones arrive. With a rendezvous
//        (--only kv), rank 0 is the prefill and every other rank a decoder.
// Each process samples its resident memory (private: less file and shared-memory pages), open
// descriptors and its engine's peer table every 1000 cycles or requests after a warm-up; the
// report shows the first sample, the middle one and the last, and the run fails on any error or
// on growth of private memory or descriptors above 1 % from first to last.
#include "tools/bench_soak.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/kv.h"
#include "ferry/moe.h"
#include "tools/bench_sample.h"
#include "tools/bench_util.h"
#include "moe/numerics.h"

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

constexpr int kMaxProcs = 9;
constexpr int64_t kEvery = 1000;  // cycles or requests between samples

// One process's run: how far it got, its errors, and its first, middle and last sample.
struct Row {
  int64_t done = 0, errors = 0;
  int64_t engines = 0;  // kv decoders: the engines that served its requests, one after another
  Sample at[3];
  double seconds = 0;
  double slowest_ms = 0;  // the longest cycle or decoder's request (a link down and back up)
};

struct Report {
  int procs = 0;
  Row rows[kMaxProcs];
};

// Samples taken along a run; the row keeps the first, the middle and the last.
struct Samples {
  std::vector<Sample> taken;
  void Fill(Row* row) const {
    if (taken.empty()) return;
    row->at[0] = taken.front();
    row->at[1] = taken[taken.size() / 2];
    row->at[2] = taken.back();
  }
};

// Every process's row into rank 0's report.
Status Gather(Bootstrap& b, const Row& mine, Report* out) {
  ASSIGN_OR_RETURN(auto rows, b.AllGather({reinterpret_cast<const uint8_t*>(&mine), sizeof mine},
                                          120s));
  out->procs = b.world_size();
  for (int r = 0; r < b.world_size(); ++r) {
    if (rows[r].size() != sizeof(Row)) return InternalError("a rank's row has the wrong size");
    std::memcpy(&out->rows[r], rows[r].data(), sizeof(Row));
  }
  return Status::Ok();
}

// ---- moe ---------------------------------------------------------------------------------------

constexpr int kRanks = 4, kTokens = 8, kHidden = 128, kExperts = 16, kTopK = 4;

Status MoeRank(const SoakOptions& o, Bootstrap& b, Report* report) {
  const int me = b.rank();
  AllToAllConfig c{.world_size = b.world_size(), .rank = me, .num_experts = kExperts,
                   .experts_per_token = kTopK, .max_tokens_per_rank = kTokens,
                   .hidden = kHidden, .dtype = DispatchDtype::kBf16};
  ASSIGN_OR_RETURN(const EngineOptions eo, BenchEngineOptions(o.provider));
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(eo));
  ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(c, engine.get(), b));
  // Token t: every column 1 + me + t / 8; experts (t + me + 5j) % 16, weight 1/4 each, so the
  // combine of identity experts gives the token back bit for bit.
  std::vector<uint16_t> x, y(size_t(kTokens) * kHidden);
  std::vector<int32_t> ids;
  std::vector<float> w(size_t(kTokens) * kTopK, 0.25f);
  for (int t = 0; t < kTokens; ++t) {
    x.insert(x.end(), kHidden, FloatToBf16(1.0f + me + t / 8.0f));
    for (int j = 0; j < kTopK; ++j) ids.push_back((t + me + 5 * j) % kExperts);
  }
  std::vector<uint16_t> expert_x(size_t(c.local_experts() * c.expert_capacity()) * kHidden);
  std::vector<int32_t> counts(size_t(c.local_experts()));
  Row row;
  Samples samples;
  const int64_t warmup = std::min<int64_t>(kEvery, o.cycles / 10);
  const double start = NowUs();
  for (int64_t i = 0; i < o.cycles; ++i) {
    if (i >= warmup && (i - warmup) % kEvery == 0) {
      samples.taken.push_back(Take(engine.get()));
      // Whether to stop, agreed by all (the ranks must run the same cycles).
      const uint8_t late = o.seconds > 0 && NowUs() - start > o.seconds * 1e6;
      ASSIGN_OR_RETURN(auto votes, b.AllGather({&late, 1}, 120s));
      if (std::any_of(votes.begin(), votes.end(), [](const auto& v) { return v[0] != 0; })) {
        break;
      }
    }
    const Deadline deadline = Deadline::After(10s);
    const double cycle_start = NowUs();
    Status s = a2a->DispatchSend({x.data(), nullptr, ids.data(), w.data(), kTokens});
    if (s.ok()) s = a2a->DispatchRecv({expert_x.data(), nullptr, counts.data()}, deadline);
    if (s.ok()) s = a2a->CombineSend(expert_x.data());
    if (s.ok()) s = a2a->CombineRecv(y.data(), false, deadline);
    if (!s.ok()) {
      std::fprintf(stderr, "soak moe rank %d, cycle %lld: %s\n", me, (long long)i,
                   s.ToString().c_str());
      ++row.errors;
      break;  // the AllToAll ends with its first failed step
    }
    if (y != x) ++row.errors;
    ++row.done;
    row.slowest_ms = std::max(row.slowest_ms, (NowUs() - cycle_start) * 1e-3);
  }
  row.seconds = (NowUs() - start) * 1e-6;
  row.engines = 1;
  samples.taken.push_back(Take(engine.get()));
  samples.Fill(&row);
  return Gather(b, row, report);
}

// ---- kv ----------------------------------------------------------------------------------------

constexpr int kLayers = 2, kPages = 2;
const KvModel kModel{2, 64, 2, false, 16};  // 2 KV heads of 64 bf16, pages of 16 tokens

uint8_t Pattern(size_t i) { return uint8_t((i * 7 + 3) % 251); }

Status PrefillRank(const SoakOptions& o, Bootstrap& b, Report* report) {
  const KvSide side{kModel, KvOrder::kHND, 1};
  const int64_t stride = side.page_bytes() * kPages;
  ASSIGN_OR_RETURN(EngineOptions eo, BenchEngineOptions(o.provider));
  // A small table: the decoders that left are evicted (least recently used) as new ones come.
  eo.max_peers = 4;
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(eo));
  std::vector<uint8_t> memory(size_t(stride * kLayers));
  for (size_t i = 0; i < memory.size(); ++i) memory[i] = Pattern(i);
  ASSIGN_OR_RETURN(MemoryRegion region, engine->RegisterMemory(memory.data(), memory.size()));
  const KvRegions regions{{&region}, kLayers, stride};
  std::mutex mu;
  std::condition_variable cv;
  std::deque<uint64_t> arrived;
  std::atomic<int64_t> released{0}, failed{0};
  KvPrefill::Callbacks cb;
  cb.on_request = [&](const KvPrefill::Incoming& in) {
    std::lock_guard<std::mutex> l(mu);
    arrived.push_back(in.request_id);
    cv.notify_one();
  };
  cb.on_released = [&](uint64_t, const Status& s) {
    if (!s.ok()) failed.fetch_add(1);
    released.fetch_add(1);
  };
  const std::atomic<uint64_t> layers{uint64_t{1} << 40};  // every layer computed already
  ASSIGN_OR_RETURN(auto prefill,
                   KvPrefill::Create(engine.get(), side, regions, nullptr, &layers, cb));
  std::atomic<bool> stop{false};
  Row row;
  Samples samples;
  std::thread scheduler([&] {
    const std::vector<int64_t> pages = {0, 1};
    int64_t next_sample = kEvery;
    for (;;) {
      uint64_t id;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait_for(l, 10ms, [&] { return !arrived.empty() || stop.load(); });
        if (arrived.empty()) {
          if (stop.load()) return;
          continue;
        }
        id = arrived.front();
        arrived.pop_front();
      }
      if (!prefill->Schedule(id, pages, 0, 0).ok()) failed.fetch_add(1);
      if (released.load() >= next_sample) {
        samples.taken.push_back(Take(engine.get()));
        next_sample += kEvery;
      }
    }
  });
  const double start = NowUs();
  RETURN_IF_ERROR(b.AllGather(engine->Address(), 120s).status());
  Status done = b.Barrier(std::chrono::hours(24));  // the decoders' runs
  stop.store(true);
  scheduler.join();
  row.done = released.load();
  row.engines = 1;
  row.errors = failed.load() + (done.ok() ? 0 : 1);
  row.seconds = (NowUs() - start) * 1e-6;
  samples.taken.push_back(Take(engine.get()));
  samples.Fill(&row);
  prefill.reset();
  return Gather(b, row, report);
}

// Requests [first, last) of decoder `rank` through one engine of its own, made here and gone
// when this returns; every request's pages checked. Samples every kEvery requests from `warmup`
// on (of this process).
void ServeRequests(const SoakOptions& o, int rank, std::span<const uint8_t> prefill_address,
                   int64_t first, int64_t last, int64_t warmup, double start, Row* row,
                   Samples* samples) {
  const KvSide side{kModel, KvOrder::kHND, 1};
  const int64_t stride = side.page_bytes() * kPages;
  std::vector<uint8_t> memory(size_t(stride * kLayers));
  std::vector<uint8_t> want(memory.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = Pattern(i);
  const std::vector<int64_t> pages = {0, 1};
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "soak kv decoder %d: %s\n", rank, s.ToString().c_str());
    ++row->errors;
  };
  auto options = BenchEngineOptions(o.provider);
  if (!options.ok()) return fail(options.status());
  auto engine = TransferEngine::Create(*options);
  if (!engine.ok()) return fail(engine.status());
  auto region = (*engine)->RegisterMemory(memory.data(), memory.size());
  if (!region.ok()) return fail(region.status());
  auto decoder = KvDecoder::Create(engine->get(), side, KvRegions{{&*region}, kLayers, stride},
                                   nullptr);
  if (!decoder.ok()) return fail(decoder.status());
  for (int64_t n = first; n < last; ++n) {
    if (o.seconds > 0 && NowUs() - start > o.seconds * 1e6) break;
    if (samples && n >= warmup && (n - warmup) % kEvery == 0) {
      samples->taken.push_back(Take(engine->get()));
    }
    std::fill(memory.begin(), memory.end(), 0);
    const double request_start = NowUs();
    std::mutex mu;
    std::condition_variable cv;
    bool ready = false;
    Status result;
    KvDecoder::Request req;
    req.request_id = uint64_t(rank) << 40 | uint64_t(n);
    req.prefill_address = prefill_address;
    req.prefill = side;
    req.pages = pages;
    req.num_tokens = kPages * kModel.page_tokens;
    Status s = (*decoder)->Submit(req, Deadline::After(30s), [&](const Status& st) {
      std::lock_guard<std::mutex> l(mu);
      result = st;
      ready = true;
      cv.notify_one();
    });
    if (s.ok()) {
      std::unique_lock<std::mutex> l(mu);
      s = cv.wait_for(l, 60s, [&] { return ready; })
              ? result
              : DeadlineExceededError("the request's callback never came");
    }
    if (!s.ok()) {
      fail(s.WithContext("request " + std::to_string(n)));
      if (s.code() == StatusCode::kDeadlineExceeded) break;  // its callback may still come
      continue;
    }
    if (memory != want) fail(DataLossError("request " + std::to_string(n) + ": pages differ"));
    ++row->done;
    row->slowest_ms = std::max(row->slowest_ms, (NowUs() - request_start) * 1e-3);
  }
  if (samples) samples->taken.push_back(Take(engine->get()));
  decoder->reset();
}

// Decoder 1 keeps one engine for its whole run (a decode node's steady state); the others come
// and go: each `churn` requests are served by a process of their own with a new engine, forked
// and ended in turn, so the prefill keeps meeting decoders it has never seen. Those rows sample
// the parent that forks them (flat by construction) and count the engines that came and went.
Status DecoderRank(const SoakOptions& o, Bootstrap& b, Report* report) {
  ASSIGN_OR_RETURN(auto addresses, b.AllGather({}, 120s));
  const std::vector<uint8_t>& prefill_address = addresses[0];
  const int64_t quota = o.requests / (b.world_size() - 1);
  const int64_t warmup = std::min<int64_t>(kEvery, quota / 10);
  Row row;
  Samples samples;
  const double start = NowUs();
  if (b.rank() == 1) {
    ServeRequests(o, b.rank(), prefill_address, 0, quota, warmup, start, &row, &samples);
    row.engines = 1;
  } else {
    for (int64_t first = 0; first < quota; first += o.churn) {
      if (o.seconds > 0 && NowUs() - start > o.seconds * 1e6) break;
      if (first >= warmup && first / kEvery != (first + o.churn - 1) / kEvery) {
        samples.taken.push_back(Take(nullptr));
      }
      int64_t counts[3] = {0, 1, 0};  // requests, errors, slowest µs
      int status = 0;
      const bool got = RunChild(
          [&](int fd) {
            Row mine;
            ServeRequests(o, b.rank(), prefill_address, first, std::min(first + o.churn, quota),
                          quota, start, &mine, nullptr);
            const int64_t sent[3] = {mine.done, mine.errors, int64_t(mine.slowest_ms * 1e3)};
            return write(fd, sent, sizeof sent) == sizeof sent ? 0 : 1;
          },
          &counts, &status);
      row.done += counts[0];
      row.errors += got && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? counts[1] : 1;
      row.slowest_ms = std::max(row.slowest_ms, double(counts[2]) * 1e-3);
      ++row.engines;
    }
    samples.taken.push_back(Take(nullptr));
  }
  row.seconds = (NowUs() - start) * 1e-6;
  samples.Fill(&row);
  RETURN_IF_ERROR(b.Barrier(120s));
  return Gather(b, row, report);
}

// ---- the report --------------------------------------------------------------------------------

double Growth(double first, double last) { return first > 0 ? (last - first) / first : 0; }

// Whether a process's row passes: no error, and growth of at most 1 % from the first sample to
// the last in private resident memory and in open descriptors.
bool Flat(const Row& w) {
  return Growth(w.at[0].private_mib, w.at[2].private_mib) <= 0.01 &&
         Growth(double(w.at[0].fds), double(w.at[2].fds)) <= 0.01;
}
bool Passes(const Report& r) {
  for (int p = 0; p < r.procs; ++p) {
    if (r.rows[p].errors != 0 || !Flat(r.rows[p])) return false;
  }
  return true;
}

// Prints the phase's table; false if it failed (Passes).
bool Print(const char* phase, const char* unit, const Report& r) {
  std::printf("soak %s\n| process | %s | engines | errors | seconds | slowest ms | private MiB "
              "first / mid / last | RSS MiB first / last | open fds first / mid / last | peers "
              "first / last (entries) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- "
              "| --- |\n",
              phase, unit);
  for (int p = 0; p < r.procs; ++p) {
    const Row& w = r.rows[p];
    const Sample* a = w.at;
    const double own = Growth(a[0].private_mib, a[2].private_mib);
    char slowest[32] = "-";  // not timed: the prefill's requests
    if (w.slowest_ms > 0) std::snprintf(slowest, sizeof slowest, "%.1f", w.slowest_ms);
    std::printf("| %d | %lld | %lld | %lld | %.1f | %s | %.2f / %.2f / %.2f (%+.2f %%) | "
                "%.2f / %.2f | %lld / %lld / %lld | %lld / %lld (%lld) |%s\n",
                p, (long long)w.done, (long long)w.engines, (long long)w.errors, w.seconds,
                slowest, a[0].private_mib, a[1].private_mib, a[2].private_mib, 100 * own,
                a[0].rss_mib, a[2].rss_mib, (long long)a[0].fds, (long long)a[1].fds,
                (long long)a[2].fds, (long long)a[0].peers, (long long)a[2].peers,
                (long long)a[2].peer_entries, Flat(w) ? "" : " GREW");
  }
  std::printf("\n");
  return Passes(r);
}

// Runs one phase on `ranks` ranks (forked, or the rendezvous' world) and prints its table at
// the reporter; the other ranks of a world print their own line. False if it failed (Passes).
bool RunPhase(const SoakOptions& o, const char* phase, const char* unit, int ranks,
              const std::function<Status(Bootstrap&, Report*)>& body) {
  Report r{};
  if (!RunRanksAndCollect<Report>("soak", ranks, 0, body, &r, std::chrono::hours(24), o.world)) {
    return false;
  }
  if (!o.world || o.world->rank() == 0) return Print(phase, unit, r);
  // Every rank holds rank 0's report: its exit says what rank 0's does.
  const Row& w = r.rows[o.world->rank()];
  const bool ok = Passes(r);
  std::printf("ferry-bench soak [rank %d of %d]: %lld %s, %lld errors; the world's run %s "
              "(rank 0 prints the table)\n", o.world->rank(), ranks, (long long)w.done, unit,
              (long long)w.errors, ok ? "clean" : "FAILED");
  return ok;
}

}  // namespace

int RunSoakBench(const SoakOptions& o) {
  const int moe_ranks = o.world ? o.world->world_size() : kRanks;
  const int decoders = o.world ? o.world->world_size() - 1 : o.decoders;
  if (decoders < 1 || decoders + 1 > kMaxProcs || o.churn < 1 || o.cycles < 1 ||
      o.requests < decoders || (!o.only.empty() && o.only != "moe" && o.only != "kv")) {
    std::fprintf(stderr, "ferry-bench soak: 1 to %d decoders, churn, cycles and requests >= 1, "
                 "--only moe or kv\n", kMaxProcs - 1);
    return 2;
  }
  // A world is one phase's: moe on every rank, or kv with rank 0 the prefill.
  if (o.world && (o.only.empty() || moe_ranks > kMaxProcs ||
                  (o.only == "moe" && kExperts % moe_ranks != 0))) {
    std::fprintf(stderr, "ferry-bench soak --rendezvous: --only moe (a world whose size divides "
                 "%d experts) or --only kv (rank 0 the prefill), at most %d ranks\n", kExperts,
                 kMaxProcs);
    return 2;
  }
  const bool reporter = !o.world || o.world->rank() == 0;
  if (reporter) {
    const std::string moe = "MoE " + std::to_string(o.cycles) + " cycles on " +
                            std::to_string(moe_ranks) + " ranks";
    const std::string kv = "KV " + std::to_string(o.requests) + " requests from " +
                           std::to_string(decoders) + " decoders (a new engine every " +
                           std::to_string(o.churn) + ")";
    std::printf("ferry-bench soak: %s, %s%s%s%s\n\n", o.provider.c_str(),
                o.only == "kv" ? kv.c_str() : moe.c_str(),
                o.only.empty() ? (", " + kv).c_str() : "",
                o.world ? "; ranks met at a rendezvous" : "",
                o.seconds > 0 ? (", each phase at most " + std::to_string(o.seconds) +
                                 " s").c_str() : "");
    std::fflush(stdout);
  }
  bool ok = true;
  if (o.only != "kv") {
    ok = RunPhase(o, "moe (host device)", "cycles", moe_ranks,
                  [&](Bootstrap& b, Report* r) { return MoeRank(o, b, r); });
    std::fflush(stdout);
  }
  if (ok && o.only != "moe") {
    ok = RunPhase(o, "kv (process 0: the prefill)", "requests", decoders + 1,
                  [&](Bootstrap& b, Report* r) {
                    return b.rank() == 0 ? PrefillRank(o, b, r) : DecoderRank(o, b, r);
                  });
  }
  if (reporter) std::printf("soak: %s\n", ok ? "clean" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace ferry::bench
