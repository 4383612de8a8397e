// ferry-bench fabric: the TransferEngine against a raw libfabric loop, same provider, same
// processes, same run. Two local ranks are forked; rank 0 writes into rank 1.
//
// Rows: single writes 1 KiB..64 MiB, paged writes of 1..64 KiB pages (64 pages per request),
// and immediate round trips. Each row prints p50/p99 latency (window 1), GB/s and Mops/s
// (windowed), for ferry and raw, and the ratio ferry/raw of the throughput (or, for round
// trips, of the p50 latency).
#include "tools/bench_fabric.h"

#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "tools/bench_util.h"
#include "tools/raw_fabric.h"

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kStopImm = 0xFFFFFFF0u;
constexpr uint32_t kPingImm = 0xFFFFFFF1u;
constexpr uint32_t kPongImm = 0xFFFFFFF2u;
constexpr uint32_t kDataImm = 0x1u;

// How the measuring thread waits: it spins for a while, like the raw loop does, then naps so
// that on a 2-core machine the engine's worker gets the core (1 us naps with 1 us timer slack).
class Waiter {
 public:
  void operator()() {
    if (++spins_ < 20000) return;
    timespec ts{0, 1000};
    nanosleep(&ts, nullptr);
  }

 private:
  uint32_t spins_ = 0;
};

struct Figures {
  double p50_us = 0, p99_us = 0, gbps = 0, mops = 0;
};

struct Row {
  std::string kind;
  uint64_t bytes = 0;  // per write (per page for paged)
  Figures ferry, raw;
  double ratio = 0;
  const char* ratio_of = "rate";
  double worker_ns_per_wr = 0;
};

Figures Summarise(std::vector<double>& lat_us, double elapsed_us, uint64_t ops, uint64_t bytes) {
  Figures f;
  if (!lat_us.empty()) {
    std::sort(lat_us.begin(), lat_us.end());
    f.p50_us = lat_us[lat_us.size() / 2];
    f.p99_us = lat_us[std::min(lat_us.size() - 1, lat_us.size() * 99 / 100)];
  }
  if (elapsed_us > 0) {
    f.gbps = double(ops) * double(bytes) / elapsed_us * 1e-3;
    f.mops = double(ops) / elapsed_us;
  }
  return f;
}

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Field-wise median of one side's figures over the repetitions of a row.
Figures Median(const std::vector<Row>& samples, Figures Row::*side) {
  std::vector<double> p50, p99, gbps, mops;
  for (const Row& r : samples) {
    p50.push_back((r.*side).p50_us);
    p99.push_back((r.*side).p99_us);
    gbps.push_back((r.*side).gbps);
    mops.push_back((r.*side).mops);
  }
  return {MedianOf(p50), MedianOf(p99), MedianOf(gbps), MedianOf(mops)};
}

// One phase of the benchmark: what rank 0 posts.
struct Phase {
  enum Kind { kSingle, kPaged, kRoundTrip } kind;
  uint64_t bytes;
  uint64_t lat_iters;
  uint64_t bw_ops;  // writes (pages) in the bandwidth pass
};

class Runner {
 public:
  Runner(Bootstrap& b, const FabricBenchOptions& o) : b_(b), o_(o) {}

  Status Run(std::vector<Row>* rows) {
    // Room for the largest single write and for one paged request of the largest pages.
    const uint64_t kBuf = std::max<uint64_t>(o_.max_bytes, kPagesPerRequest * kMaxPageBytes);
    buf_.assign(kBuf, static_cast<uint8_t>(b_.rank() + 1));
    raw_buf_.assign(kBuf, static_cast<uint8_t>(b_.rank() + 1));

    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    ASSIGN_OR_RETURN(EngineOptions eo, BenchEngineOptions(o_.provider));
    // Like the raw loop, the worker keeps polling; it yields rather than sleeps when idle so
    // that on small machines the measuring thread still gets a core.
    if (!std::getenv("FERRY_SPIN_US")) eo.idle_yield_us = 10'000'000;
    ASSIGN_OR_RETURN(engine_, TransferEngine::Create(eo));
    ASSIGN_OR_RETURN(reg_, engine_->RegisterMemory(buf_.data(), buf_.size()));
    RETURN_IF_ERROR(raw_.Open(o_.provider, eo.node, raw_buf_.data(), raw_buf_.size()));

    ASSIGN_OR_RETURN(auto addrs, b_.AllGather(engine_->Address(), 30s));
    ASSIGN_OR_RETURN(auto regions, b_.AllGather(reg_.remote().Serialize(), 30s));
    ASSIGN_OR_RETURN(auto raws, b_.AllGather(raw_.Describe(), 30s));
    const int other = 1 - b_.rank();
    ASSIGN_OR_RETURN(peer_, engine_->AddPeer(addrs[other]));
    ASSIGN_OR_RETURN(dst_, RemoteRegion::Parse(regions[other]));
    RETURN_IF_ERROR(raw_.Connect(raws[other]));
    RETURN_IF_ERROR(engine_->CreateImmCounter(kPongImm));
    RETURN_IF_ERROR(engine_->CreateImmCounter(kDataImm));
    if (b_.rank() == 1) {
      // Rank 1 answers pings from its worker thread.
      engine_->SetUnmatchedImmHandler([this](uint32_t imm) {
        if (imm == kPingImm) (void)engine_->WriteImm(peer_, kPongImm, {});
      });
    }
    RETURN_IF_ERROR(b_.Barrier(30s));

    for (const Phase& p : Phases()) {
      Row row;
      row.bytes = p.bytes;
      row.kind = p.kind == Phase::kSingle ? "single" : p.kind == Phase::kPaged ? "paged" : "imm-rtt";
      // ferry and raw alternate, reps times, and each figure is the median over the reps: slow
      // drifts of the machine then hit both sides alike.
      const int reps = o_.quick ? 1 : 3;
      std::vector<Row> samples(reps, row);
      for (int rep = 0; rep < reps; ++rep) {
        if (b_.rank() == 0) {
          RETURN_IF_ERROR(FerryPhase(p, &samples[rep]));
          RETURN_IF_ERROR(b_.Barrier(60s));
          RETURN_IF_ERROR(RawPhase(p, &samples[rep]));
        } else {
          RETURN_IF_ERROR(b_.Barrier(60s));
          RETURN_IF_ERROR(ServeRaw());
        }
        RETURN_IF_ERROR(b_.Barrier(60s));
      }
      if (b_.rank() == 0) {
        row.ferry = Median(samples, &Row::ferry);
        row.raw = Median(samples, &Row::raw);
        std::vector<double> cpu;
        for (const Row& r : samples) cpu.push_back(r.worker_ns_per_wr);
        row.worker_ns_per_wr = MedianOf(cpu);
        if (p.kind == Phase::kRoundTrip) {
          row.ratio = row.ferry.p50_us / row.raw.p50_us;
          row.ratio_of = "p50";
        } else {
          row.ratio = row.ferry.mops / row.raw.mops;
        }
        rows->push_back(row);
      }
    }
    return Status::Ok();
  }

 private:
  std::vector<Phase> Phases() const {
    std::vector<Phase> out;
    const uint64_t budget = o_.quick ? (32u << 20) : (512u << 20);
    for (uint64_t s = 1024; s <= o_.max_bytes; s *= 4) {
      uint64_t ops = std::clamp<uint64_t>(budget / s, 16, o_.quick ? 2000 : 20000);
      out.push_back({Phase::kSingle, s, std::clamp<uint64_t>(ops / 4, 8, 500), ops});
    }
    for (uint64_t s = 1024; s <= kMaxPageBytes; s *= 4) {
      uint64_t ops = std::clamp<uint64_t>(budget / s, 512, o_.quick ? 4096 : 32768);
      ops -= ops % kPagesPerRequest;
      out.push_back({Phase::kPaged, s, 0, ops});
    }
    out.push_back({Phase::kRoundTrip, 0, o_.quick ? 500u : 5000u, 0});
    return out;
  }

  static constexpr uint64_t kPagesPerRequest = 64;
  static constexpr uint64_t kMaxPageBytes = 64u << 10;

  Status FerryPhase(const Phase& p, Row* row) {
    TransferEngine& e = *engine_;
    std::vector<double> lat;
    if (p.kind == Phase::kRoundTrip) {
      uint64_t base = *e.ImmCount(kPongImm);
      for (uint64_t i = 0; i < p.lat_iters; ++i) {
        double t0 = NowUs();
        RETURN_IF_ERROR(e.WriteImm(peer_, kPingImm, {}));
        Deadline deadline = Deadline::After(10s);
        Waiter wait;
        while (*e.ImmCount(kPongImm) < base + i + 1) {
          wait();
          if (deadline.Expired()) return DeadlineExceededError("no pong from rank 1");
        }
        lat.push_back(NowUs() - t0);
      }
      row->ferry = Summarise(lat, 0, 0, 0);
      return Status::Ok();
    }
    if (p.kind == Phase::kSingle) {
      for (uint64_t i = 0; i < p.lat_iters; ++i) {
        TransferCounter c;
        double t0 = NowUs();
        RETURN_IF_ERROR(e.Write(Single(p.bytes), Completion::Counter(&c)));
        Deadline deadline = Deadline::After(30s);
        Waiter wait;
        while (c.done.load(std::memory_order_acquire) + c.failed.load() == 0) {
          wait();
          if (deadline.Expired()) return DeadlineExceededError("ferry write did not complete");
        }
        if (c.failed.load()) return InternalError("ferry write failed");
        lat.push_back(NowUs() - t0);
      }
    }
    // Bandwidth: keep a window of writes (or paged requests) in flight.
    const EngineStats before = e.stats();
    TransferCounter c;
    std::vector<uint32_t> pages(kPagesPerRequest);
    std::iota(pages.begin(), pages.end(), 0);
    const uint64_t requests = p.kind == Phase::kPaged ? p.bw_ops / kPagesPerRequest : p.bw_ops;
    const uint64_t window = p.kind == Phase::kPaged ? 8 : Window(p.bytes);
    double t0 = NowUs();
    for (uint64_t i = 0; i < requests; ++i) {
      Waiter wait;
      while (i - c.done.load(std::memory_order_acquire) >= window) wait();
      Status s = p.kind == Phase::kPaged ? e.WritePaged(Paged(p.bytes, pages), Completion::Counter(&c))
                                         : e.Write(Single(p.bytes), Completion::Counter(&c));
      RETURN_IF_ERROR(s);
    }
    RETURN_IF_ERROR(c.Wait(requests, Deadline::After(120s)));
    double elapsed = NowUs() - t0;
    if (c.failed.load()) return InternalError("ferry writes failed");
    const EngineStats after = e.stats();
    row->ferry = Summarise(lat, elapsed, p.bw_ops, p.bytes);
    uint64_t wrs = after.wrs_posted - before.wrs_posted;
    if (wrs) row->worker_ns_per_wr = double(after.worker_cpu_ns - before.worker_cpu_ns) / wrs;
    return Status::Ok();
  }

  Status RawPhase(const Phase& p, Row* row) {
    std::vector<double> lat;
    uint64_t imms = 0;
    uint32_t last = 0;
    auto wait_local = [&](uint64_t n) -> Status {
      uint64_t got = 0;
      Deadline deadline = Deadline::After(30s);
      while (got < n) {
        int r = raw_.Poll(&imms, &last);
        if (r < 0) return InternalError("raw completion error");
        got += static_cast<uint64_t>(r);
        if (deadline.Expired()) return DeadlineExceededError("raw write did not complete");
      }
      return Status::Ok();
    };
    auto post = [&](uint64_t off, uint64_t len, bool imm, uint32_t data) -> Status {
      Deadline deadline = Deadline::After(30s);
      while (!raw_.Post(off, off, len, imm, data)) {
        if (raw_.Poll(&imms, &last) < 0) return InternalError("raw completion error");
        if (deadline.Expired()) return DeadlineExceededError("raw post stuck");
      }
      return Status::Ok();
    };
    if (p.kind == Phase::kRoundTrip) {
      for (uint64_t i = 0; i < p.lat_iters; ++i) {
        double t0 = NowUs();
        uint64_t want = imms + 1;
        RETURN_IF_ERROR(post(0, 0, true, kPingImm));
        RETURN_IF_ERROR(wait_local(1));
        Deadline deadline = Deadline::After(10s);
        while (imms < want) {
          if (raw_.Poll(&imms, &last) < 0) return InternalError("raw completion error");
          if (deadline.Expired()) return DeadlineExceededError("no raw pong");
        }
        lat.push_back(NowUs() - t0);
      }
      row->raw = Summarise(lat, 0, 0, 0);
    } else {
      if (p.kind == Phase::kSingle) {
        for (uint64_t i = 0; i < p.lat_iters; ++i) {
          double t0 = NowUs();
          RETURN_IF_ERROR(post(0, p.bytes, true, kDataImm));
          RETURN_IF_ERROR(wait_local(1));
          lat.push_back(NowUs() - t0);
        }
      }
      // Same window of WRs in flight as ferry keeps (paged: 8 requests of 64 pages).
      const uint64_t window =
          std::min<uint64_t>(p.kind == Phase::kPaged ? 8 * kPagesPerRequest : Window(p.bytes),
                             raw_.tx_depth());
      uint64_t posted = 0, done = 0;
      double t0 = NowUs();
      while (done < p.bw_ops) {
        while (posted < p.bw_ops && posted - done < window) {
          uint64_t off = p.kind == Phase::kPaged ? (posted % kPagesPerRequest) * p.bytes : 0;
          if (!raw_.Post(off, off, p.bytes, true, kDataImm)) break;
          ++posted;
        }
        int r = raw_.Poll(&imms, &last);
        if (r < 0) return InternalError("raw completion error");
        done += static_cast<uint64_t>(r);
      }
      row->raw = Summarise(lat, NowUs() - t0, p.bw_ops, p.bytes);
    }
    return post(0, 0, true, kStopImm).ok() ? wait_local(1) : InternalError("raw stop failed");
  }

  // Rank 1 during a raw phase: progress the endpoint, answer pings, until rank 0 says stop.
  Status ServeRaw() {
    uint64_t imms = 0, seen = 0;
    uint32_t last = 0;
    Deadline deadline = Deadline::After(300s);
    for (;;) {
      if (raw_.Poll(&imms, &last) < 0) return InternalError("raw completion error on rank 1");
      if (imms != seen) {
        seen = imms;
        if (last == kStopImm) return Status::Ok();
        if (last == kPingImm) {
          while (!raw_.Post(0, 0, 0, true, kPongImm)) raw_.Poll(&imms, &last);
        }
      }
      if (deadline.Expired()) return DeadlineExceededError("rank 1: no stop from rank 0");
    }
  }

  static uint64_t Window(uint64_t bytes) {
    return bytes >= (4u << 20) ? 4 : bytes >= (256u << 10) ? 16 : 64;
  }

  SingleWrite Single(uint64_t bytes) const {
    return SingleWrite{&reg_, 0, peer_, dst_, 0, bytes, kDataImm};
  }
  PagedWrite Paged(uint64_t page, const std::vector<uint32_t>& pages) const {
    PagedWrite w;
    w.src = &reg_;
    w.peer = peer_;
    w.dst = dst_;
    w.page_bytes = page;
    w.src_stride = w.dst_stride = page;
    w.src_pages = pages;
    w.dst_pages = pages;
    w.imm = kDataImm;
    return w;
  }

  Bootstrap& b_;
  const FabricBenchOptions& o_;
  std::vector<uint8_t> buf_, raw_buf_;
  std::unique_ptr<TransferEngine> engine_;
  MemoryRegion reg_;
  RawFabric raw_;
  PeerId peer_ = 0;
  RemoteRegion dst_;
};

std::string Fmt(const char* format, double v) {
  char buf[32];
  snprintf(buf, sizeof buf, format, v);
  return buf;
}
std::string Fmt(const char* format, const char* v) {
  char buf[32];
  snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string Size(uint64_t b) {
  if (b == 0) return "-";
  if (b >= (1u << 20)) return std::to_string(b >> 20) + " MiB";
  return std::to_string(b >> 10) + " KiB";
}

}  // namespace

int RunFabricBench(const FabricBenchOptions& o) {
  // Rank 0's rows, a line each.
  const auto run = [&](Bootstrap& b, std::string* out) -> Status {
    std::vector<Row> rows;
    Runner runner(b, o);
    RETURN_IF_ERROR(runner.Run(&rows));
    if (b.rank() != 0) return Status::Ok();
    char line[512];
    for (const Row& r : rows) {
      snprintf(line, sizeof line,
               "%s %llu %.3f %.3f %.4f %.5f %.3f %.3f %.4f %.5f %.4f %s %.1f\n", r.kind.c_str(),
               (unsigned long long)r.bytes, r.ferry.p50_us, r.ferry.p99_us, r.ferry.gbps,
               r.ferry.mops, r.raw.p50_us, r.raw.p99_us, r.raw.gbps, r.raw.mops, r.ratio,
               r.ratio_of, r.worker_ns_per_wr);
      *out += line;
    }
    return Status::Ok();
  };
  std::string text;
  if (o.world) {  // one rank of a rendezvous: the two ranks were started apart
    if (o.world->world_size() != 2) {
      std::fprintf(stderr, "ferry-bench fabric: a world of 2 ranks, not %d\n",
                   o.world->world_size());
      return 2;
    }
    const Status s = run(*o.world, &text);
    if (!s.ok()) {
      std::fprintf(stderr, "ferry-bench fabric: [rank %d] %s\n", o.world->rank(),
                   s.ToString().c_str());
      return 1;
    }
    if (o.world->rank() != 0) {
      std::printf("ferry-bench fabric [rank 1 of 2]: done (rank 0 prints the figures)\n");
      return 0;
    }
  } else {
    // Rank 0 writes its rows to a pipe the launcher reads once the ranks have exited.
    int fds[2];
    if (pipe(fds) != 0) return 1;
    auto exits = RunLocalRanks(2, [&](Bootstrap& b) -> Status {
      close(fds[0]);
      std::string out;
      RETURN_IF_ERROR(run(b, &out));
      if (write(fds[1], out.data(), out.size()) != static_cast<ssize_t>(out.size())) {
        return InternalError("could not report rows");
      }
      return Status::Ok();
    }, std::chrono::minutes(20));
    close(fds[1]);
    char buf[4096];
    ssize_t n;
    while ((n = read(fds[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
    close(fds[0]);
    for (const RankExit& e : exits) {
      if (!e.ok()) {
        std::fprintf(stderr, "ferry-bench fabric: a rank failed (exit %d, signal %d%s)\n",
                     e.exit_code, e.signal, e.timed_out ? ", timed out" : "");
        return 1;
      }
    }
  }
  if (o.json) std::printf("{\"bench\":\"fabric\",\"provider\":\"%s\",\"rows\":[", o.provider.c_str());
  else {
    std::printf("ferry-bench fabric  provider=%s  (2 %s ranks; rank 0 writes into rank 1)\n",
                o.provider.c_str(), o.world ? "rendezvous" : "local");
    std::printf("%-8s %8s | %9s %9s %8s %8s | %9s %9s %8s %8s | %6s %4s | %9s\n", "kind", "size",
                "ferry p50", "p99 us", "GB/s", "Mops/s", "raw p50", "p99 us", "GB/s", "Mops/s",
                "ratio", "of", "wkr ns/wr");
  }
  bool first = true;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    std::string l = text.substr(pos, end - pos);
    pos = end + 1;
    char kind[32], of[8];
    unsigned long long bytes;
    double f50, f99, fg, fm, r50, r99, rg, rm, ratio, cpu;
    if (sscanf(l.c_str(), "%31s %llu %lf %lf %lf %lf %lf %lf %lf %lf %lf %7s %lf", kind, &bytes,
               &f50, &f99, &fg, &fm, &r50, &r99, &rg, &rm, &ratio, of, &cpu) != 13) {
      continue;
    }
    if (o.json) {
      std::printf("%s{\"kind\":\"%s\",\"bytes\":%llu,\"ferry\":{\"p50_us\":%.3f,\"p99_us\":%.3f,"
                  "\"gbps\":%.4f,\"mops\":%.5f},\"raw\":{\"p50_us\":%.3f,\"p99_us\":%.3f,"
                  "\"gbps\":%.4f,\"mops\":%.5f},\"ratio\":%.4f,\"ratio_of\":\"%s\","
                  "\"worker_ns_per_wr\":%.1f}",
                  first ? "" : ",", kind, bytes, f50, f99, fg, fm, r50, r99, rg, rm, ratio, of, cpu);
    } else {
      // Paged rows have no window-1 latency pass, and round trips no rate: print "-", not 0.
      auto lat = [](double v) { return v > 0 ? Fmt("%9.2f", v) : Fmt("%9s", "-"); };
      auto rate = [](double v, const char* f) { return v > 0 ? Fmt(f, v) : Fmt("%8s", "-"); };
      std::printf("%-8s %8s | %s %s %s %s | %s %s %s %s | %6.3f %4s | %9.0f\n", kind,
                  Size(bytes).c_str(), lat(f50).c_str(), lat(f99).c_str(),
                  rate(fg, "%8.3f").c_str(), rate(fm, "%8.4f").c_str(), lat(r50).c_str(),
                  lat(r99).c_str(), rate(rg, "%8.3f").c_str(), rate(rm, "%8.4f").c_str(), ratio,
                  of, cpu);
    }
    first = false;
  }
  if (o.json) std::printf("]}\n");
  return 0;
}

}  // namespace ferry::bench
