// ferry-bench elastic: how long a lost rank keeps an AllToAll below full strength when a new
// process replaces it (AllToAll::Readmit / Join), and what each death costs in epochs. Four
// ranks of an AllToAll on the host device under mask_lost_peers, as forked processes; rank 2's
// process is forked anew by a launcher process of its own for each cycle:
//   - it runs `epochs` full epochs with the others, then dies (SIGKILL) after the next
//     dispatch, having told its launcher the time;
//   - the survivors' step masks it at its deadline and finishes that epoch without it (the one
//     epoch a death loses);
//   - the launcher forks the next process, which meets the survivors at a rendezvous of the
//     cycle, joins, and the next epoch runs with all four.
// Every epoch's combined output is checked (identity experts: each token comes back as its
// value times the weights of the live ranks' experts, exact in bf16). The table gives, over
// the cycles, the time from each death to the end of the first full epoch after it, split into
// the deadline's part (until the survivors masked it) and the replacement's (a process start
// and its engine, the rendezvous, the readmission, the epoch). The survivors' descriptors and private memory
// are sampled from the third cycle on.
#include "tools/bench_elastic.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "moe/numerics.h"
#include "tools/bench_sample.h"
#include "tools/bench_util.h"

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

constexpr int kRanks = 4, kVictim = 2, kTokens = 8, kHidden = 128, kExperts = 8, kTopK = 2;
constexpr int kMaxCycles = 200;

// Token t of rank r: every column 1 + r + t / 8; experts (t + r) % 8 and (t + r + 4) % 8 (two
// ranks apart), weight 1/2 each: a token comes back whole, or halved where one expert's rank
// is masked.
float Value(int r, int t) { return 1.0f + float(r) + float(t) / 8.0f; }
int Expert(int r, int t, int j) { return (t + r + 4 * j) % kExperts; }

// What rank 0 reports: per cycle, the times of a death and of what followed it (µs on the
// monotonic clock every process on the host shares), and the survivors' samples.
struct Report {
  int cycles = 0;
  int64_t errors = 0, lost_epochs = 0, full_epochs = 0;
  double died[kMaxCycles] = {}, masked[kMaxCycles] = {}, met[kMaxCycles] = {},
         readmitted[kMaxCycles] = {}, whole[kMaxCycles] = {};
  Sample first, last;
};

// One rank's AllToAll, its buffers and its checks.
class Rank {
 public:
  explicit Rank(int me) : me_(me) {
    for (int t = 0; t < kTokens; ++t) {
      x_.insert(x_.end(), kHidden, FloatToBf16(Value(me, t)));
      for (int j = 0; j < kTopK; ++j) ids_.push_back(Expert(me, t, j));
    }
  }

  AllToAllConfig Config() const {
    return {.world_size = kRanks, .rank = me_, .num_experts = kExperts,
            .experts_per_token = kTopK, .max_tokens_per_rank = kTokens, .hidden = kHidden,
            .dtype = DispatchDtype::kBf16, .mask_lost_peers = true};
  }

  Status MakeEngine(const std::string& provider) {
    ASSIGN_OR_RETURN(const EngineOptions eo, BenchEngineOptions(provider));
    ASSIGN_OR_RETURN(engine_, TransferEngine::Create(eo));
    return Status::Ok();
  }

  // The AllToAll (its engine made first), made (Create) or joined (Join) over `group`.
  Status Make(Bootstrap& group, bool join) {
    const AllToAllConfig c = Config();
    expert_x_.assign(size_t(c.local_experts() * c.expert_capacity()) * kHidden, 0);
    counts_.assign(size_t(c.local_experts()), 0);
    if (join) {
      ASSIGN_OR_RETURN(a2a_, AllToAll::Join(c, engine_.get(), group, 60s));
    } else {
      ASSIGN_OR_RETURN(a2a_, AllToAll::Create(c, engine_.get(), group));
    }
    return Status::Ok();
  }

  Status Dispatch(Deadline deadline) {
    RETURN_IF_ERROR(a2a_->DispatchSend({x_.data(), nullptr, ids_.data(), w_.data(), kTokens}));
    return a2a_->DispatchRecv({expert_x_.data(), nullptr, counts_.data()}, deadline);
  }

  // The combine, and whether its output is exact for the ranks unmasked now (*whole: all).
  Status Combine(Deadline deadline, bool* whole) {
    RETURN_IF_ERROR(a2a_->CombineSend(expert_x_.data()));
    RETURN_IF_ERROR(a2a_->CombineRecv(y_.data(), false, deadline));
    ASSIGN_OR_RETURN(const std::vector<uint8_t> masked, a2a_->Masked());
    *whole = std::none_of(masked.begin(), masked.end(), [](uint8_t m) { return m != 0; });
    for (int t = 0; t < kTokens; ++t) {
      float weight = 0;
      for (int j = 0; j < kTopK; ++j) weight += masked[Expert(me_, t, j) / 2] ? 0.0f : 0.5f;
      const uint16_t want = FloatToBf16(Value(me_, t) * weight);
      for (int i = 0; i < kHidden; ++i) {
        if (y_[size_t(t) * kHidden + i] != want) {
          return DataLossError("rank " + std::to_string(me_) + ": token " + std::to_string(t) +
                               " combined wrong");
        }
      }
    }
    return Status::Ok();
  }

  Status Epoch(Deadline deadline, bool* whole) {
    RETURN_IF_ERROR(Dispatch(deadline));
    return Combine(deadline, whole);
  }

  AllToAll& a2a() { return *a2a_; }
  const TransferEngine* engine() const { return engine_.get(); }

 private:
  const int me_;
  std::vector<uint16_t> x_, y_ = std::vector<uint16_t>(size_t(kTokens) * kHidden),
                            expert_x_;
  std::vector<int32_t> ids_, counts_;
  std::vector<float> w_ = std::vector<float>(size_t(kTokens) * kTopK, 0.5f);
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<AllToAll> a2a_;
};

// A loopback address no one listens on now (the rendezvous of a cycle).
std::string FreeAddress() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  uint16_t port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return "127.0.0.1:" + std::to_string(port);
}

StatusOr<std::unique_ptr<Bootstrap>> Meet(const std::string& address, int rank) {
  return JoinRendezvous({.address = address, .world_size = kRanks, .rank = rank,
                         .timeout = 60s});
}

// A process for rank 2 (forked by its launcher, which holds no engine): makes or joins the
// AllToAll at `address`, runs `epochs` full epochs, dispatches once more, writes the time to
// `pipe_fd` and dies. Returns (an exit code) only where something failed before.
int Victim(const ElasticOptions& o, const std::string& address, bool join, int pipe_fd) {
  Status s = [&]() -> Status {
    // As a launcher's new process would: its engine up, then the meeting.
    Rank r(kVictim);
    RETURN_IF_ERROR(r.MakeEngine(o.provider));
    ASSIGN_OR_RETURN(auto group, Meet(address, kVictim));
    RETURN_IF_ERROR(r.Make(*group, join));
    bool whole = false;
    for (int i = 0; i < o.epochs; ++i) {
      RETURN_IF_ERROR(r.Epoch(Deadline::After(60s), &whole));
      if (!whole) return DataLossError("rank 2 ran an epoch without every rank");
    }
    RETURN_IF_ERROR(r.Dispatch(Deadline::After(60s)));
    const double now = NowUs();
    if (write(pipe_fd, &now, sizeof now) != sizeof now) return InternalError("pipe");
    raise(SIGKILL);
    return Status::Ok();
  }();
  std::fprintf(stderr, "ferry-bench elastic: rank 2's process: %s\n", s.ToString().c_str());
  return 1;
}

// Process 2 of the launcher's world: forks rank 2's process for each cycle and reports the time
// it died; 0 where it failed before.
Status Launcher(const ElasticOptions& o, Bootstrap& b) {
  double died = 0;
  for (int cycle = 0; cycle <= o.cycles; ++cycle) {
    ASSIGN_OR_RETURN(auto said, b.AllGather({reinterpret_cast<const uint8_t*>(&died), 8}, 120s));
    if (cycle == o.cycles) break;
    const std::string address(said[0].begin(), said[0].end());
    died = 0;
    int status = 0;
    if (!RunChild([&](int fd) { return Victim(o, address, cycle > 0, fd); }, &died, &status)) {
      died = 0;
    }
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) died = 0;
  }
  return Status::Ok();
}

// Ranks 0, 1 and 3: every cycle the world made whole (made, or rank 2 readmitted), full epochs
// until rank 2 dies, the epoch it died in finished without it.
Status Survivor(const ElasticOptions& o, Bootstrap& b, Report* out) {
  const int me = b.rank();
  Rank r(me);
  Report report;
  report.cycles = o.cycles;
  const std::chrono::milliseconds step(o.deadline_ms);
  for (int cycle = 0; cycle <= o.cycles; ++cycle) {
    const std::string mine = me == 0 ? FreeAddress() : std::string();
    ASSIGN_OR_RETURN(auto said, b.AllGather({reinterpret_cast<const uint8_t*>(mine.data()),
                                             mine.size()}, 120s));
    if (cycle > 0) std::memcpy(&report.died[cycle - 1], said[kVictim].data(), 8);
    if (cycle == o.cycles) break;
    const std::string address(said[0].begin(), said[0].end());
    ASSIGN_OR_RETURN(auto group, Meet(address, me));
    if (cycle == 0) {
      RETURN_IF_ERROR(r.MakeEngine(o.provider));
      RETURN_IF_ERROR(r.Make(*group, false));
    } else {
      report.met[cycle - 1] = NowUs();
      RETURN_IF_ERROR(r.a2a().Readmit(*group, 60s));
      report.readmitted[cycle - 1] = NowUs();
    }
    // Full epochs while rank 2 lives; the one it dies in ends without it.
    for (;;) {
      bool whole = false;
      RETURN_IF_ERROR(r.Epoch(Deadline::After(step), &whole));
      if (whole) {
        ++report.full_epochs;
        if (cycle > 0 && report.whole[cycle - 1] == 0) report.whole[cycle - 1] = NowUs();
        continue;
      }
      ++report.lost_epochs;
      report.masked[cycle] = NowUs();
      break;
    }
    if (cycle == 2) report.first = Take(r.engine());
  }
  report.last = Take(r.engine());
  *out = report;
  return Status::Ok();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int RunElasticBench(const ElasticOptions& o) {
  if (o.cycles < 3 || o.cycles > kMaxCycles || o.deadline_ms < 1 || o.epochs < 1) {
    std::fprintf(stderr, "ferry-bench elastic: 3 to %d cycles, a deadline and epochs >= 1\n",
                 kMaxCycles);
    return 2;
  }
  std::printf("ferry-bench elastic: %s, 4 ranks (host device, mask_lost_peers), rank 2 killed "
              "and replaced %d times, step deadline %d ms, %d full epochs between\n\n",
              o.provider.c_str(), o.cycles, o.deadline_ms, o.epochs);
  std::fflush(stdout);
  Report r{};
  const bool ran = RunRanksAndCollect<Report>(
      "elastic", kRanks, 0,
      [&](Bootstrap& b, Report* out) -> Status {
        return b.rank() == kVictim ? Launcher(o, b) : Survivor(o, b, out);
      },
      &r, std::chrono::minutes(30));
  if (!ran) return 1;
  // The last cycle's death has no replacement: its readmission is not measured.
  // Per death (ms): until the survivors masked it; then until the group met (the new
  // process forked, its engine, the rendezvous); the readmission itself; the first full
  // epoch; and from the death to the end of that epoch.
  std::vector<double> spans[5];
  bool measured = true;
  for (int c = 0; c + 1 < r.cycles; ++c) {
    if (r.died[c] == 0 || r.whole[c] == 0) measured = false;
    const double at[] = {r.died[c], r.masked[c], r.met[c], r.readmitted[c], r.whole[c]};
    for (int i = 0; i < 4; ++i) spans[i].push_back((at[i + 1] - at[i]) * 1e-3);
    spans[4].push_back((r.whole[c] - r.died[c]) * 1e-3);
  }
  const double fds_growth = double(r.last.fds - r.first.fds);
  const double private_growth =
      r.first.private_mib > 0 ? (r.last.private_mib - r.first.private_mib) / r.first.private_mib
                              : 0;
  std::printf("| deaths replaced | epochs lost per death | death -> masked | -> group met | "
              "readmission | first full epoch | death -> first full epoch | rank 0's fds, "
              "private MiB, engine peers (entries) (third cycle -> last) |\n| --- | --- | --- | "
              "--- | --- | --- | --- | --- |\n| %d | %.2f |",
              r.cycles - 1, double(r.lost_epochs) / r.cycles);
  for (const auto& span : spans) {
    std::printf(" %.1f / %.1f |", Median(span), *std::max_element(span.begin(), span.end()));
  }
  std::printf(" %lld -> %lld, %.2f -> %.2f (%+.2f %%), %lld (%lld) -> %lld (%lld) |\n"
              "(ms, median / max over the deaths)\n\n",
              (long long)r.first.fds, (long long)r.last.fds, r.first.private_mib,
              r.last.private_mib, 100 * private_growth, (long long)r.first.peers,
              (long long)r.first.peer_entries, (long long)r.last.peers,
              (long long)r.last.peer_entries);
  const bool ok = measured && r.lost_epochs == r.cycles && fds_growth <= 0 &&
                  private_growth <= 0.01;
  std::printf("elastic: %s\n", ok ? "clean" : "FAILED (a death not measured, more than one "
                                              "epoch lost to one, or a survivor grew)");
  return ok ? 0 : 1;
}

}  // namespace ferry::bench
