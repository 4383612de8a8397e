// ferry-bench mirror (bench_mirror.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <future>
#include <memory>
#include <vector>

#include "ferry/fabric.h"
#include "ferry/gpu_words.h"
#include "tools/bench_mirror.h"
#include "tools/bench_util.h"
#include "tools/bench_util.h"

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

constexpr int kWarmup = 100;          // round trips left out of each sample set
constexpr double kAnswerUs = 1e6;     // a waiter that takes longer has failed
constexpr uint32_t kFirstImm = 0x40;  // one counter per (round, waiter)

constexpr int kMaxPollers = 32;

// Answers each of `n` immediates: waits (acquire, system scope) until the mirrored total
// reaches the round trip's, then stores its number into its answer word (release, system
// scope). One lane per warp polls; warp w starts w * stagger_ns late, so that with several
// warps their reads (each a PCIe round trip where the word is in host memory) are spread over
// that round trip rather than in flight together. Gives up, setting *failed, if one wait
// outlasts budget_ns.
__global__ void EchoKernel(const uint64_t* mirror, uint64_t* answers, int n, uint64_t budget_ns,
                           unsigned stagger_ns, int* failed) {
  if (threadIdx.x % 32 != 0) return;
  const unsigned warp = threadIdx.x / 32;
  uint64_t* answer = answers + warp;
  for (unsigned i = 0; i < warp; ++i) __nanosleep(stagger_ns);
  for (uint64_t want = 1; want <= uint64_t(n); ++want) {
    uint64_t start = 0, now = 0, value = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(mirror) : "memory");
      if (value >= want) break;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > budget_ns) {
        *failed = 1;
        return;
      }
    }
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(answer), "l"(want) : "memory");
  }
}

struct Figures {
  double p50 = 0, p99 = 0;
};

Figures Summarise(std::vector<double> us) {
  us.erase(us.begin(), us.begin() + std::min<size_t>(kWarmup, us.size()));
  if (us.empty()) return {};
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]};
}

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

class Runner {
 public:
  explicit Runner(const MirrorBenchOptions& o) : o_(o) {}

  Status Open() {
    ASSIGN_OR_RETURN(EngineOptions eo, BenchEngineOptions(o_.provider));
    ASSIGN_OR_RETURN(a_, TransferEngine::Create(eo));
    ASSIGN_OR_RETURN(b_, TransferEngine::Create(eo));
    ASSIGN_OR_RETURN(b_on_a_, a_->AddPeer(b_->Address()));
    ASSIGN_OR_RETURN(answers_, GpuWords::Create(0, kMaxPollers, /*gdrcopy=*/false));
    if (cudaMalloc(&failed_, sizeof(int)) != cudaSuccess) return InternalError("cudaMalloc");
    return Status::Ok();
  }
  ~Runner() {
    if (failed_) cudaFree(failed_);
  }

  // Round trips answered by a host thread in WaitImm.
  StatusOr<std::vector<double>> HostWaiter() {
    const uint32_t imm = NextImm();
    RETURN_IF_ERROR(b_->CreateImmCounter(imm));
    std::atomic<uint64_t> answer{0};
    auto waiter = std::async(std::launch::async, [&]() -> Status {
      for (uint64_t want = 1; want <= uint64_t(o_.iters); ++want) {
        RETURN_IF_ERROR(b_->WaitImm(imm, want, Deadline::After(5s)));
        answer.store(want, std::memory_order_release);
      }
      return Status::Ok();
    });
    auto lat = RoundTrips(imm, [&] { return answer.load(std::memory_order_acquire); });
    RETURN_IF_ERROR(waiter.get());
    return lat;
  }

  // Round trips answered by EchoKernel polling `mirror` (word 0) from `pollers` warps.
  StatusOr<std::vector<double>> KernelWaiter(GpuWords& mirror, int pollers) {
    const uint32_t imm = NextImm();
    RETURN_IF_ERROR(b_->CreateImmCounter(imm));
    RETURN_IF_ERROR(b_->MirrorImm(imm, mirror.host_words()));
    uint64_t* answers = answers_->host_words();
    for (int w = 0; w < pollers; ++w) {
      std::atomic_ref<uint64_t>(answers[w]).store(0, std::memory_order_release);
    }
    cudaMemset(failed_, 0, sizeof(int));
    EchoKernel<<<1, 32 * pollers>>>(mirror.device_words(), answers_->device_words(), o_.iters,
                                    2'000'000'000ull, 1000 / pollers, failed_);
    if (cudaGetLastError() != cudaSuccess) return InternalError("launching EchoKernel");
    auto lat = RoundTrips(imm, [&] {
      uint64_t most = 0;
      for (int w = 0; w < pollers; ++w) {
        most =
            std::max(most, std::atomic_ref<uint64_t>(answers[w]).load(std::memory_order_acquire));
      }
      return most;
    });
    const cudaError_t e = cudaDeviceSynchronize();
    int failed = 0;
    cudaMemcpy(&failed, failed_, sizeof failed, cudaMemcpyDeviceToHost);
    RETURN_IF_ERROR(b_->MirrorImm(imm, nullptr));
    if (e != cudaSuccess) return InternalError(std::string("EchoKernel: ") + cudaGetErrorString(e));
    if (failed) return DeadlineExceededError("EchoKernel: the mirrored total stopped short");
    return lat;
  }

 private:
  uint32_t NextImm() { return kFirstImm + next_++; }

  // A writes the immediate, then spins until `answered()` says the waiter saw it.
  template <typename Answered>
  StatusOr<std::vector<double>> RoundTrips(uint32_t imm, Answered answered) {
    std::vector<double> lat;
    lat.reserve(o_.iters);
    for (uint64_t want = 1; want <= uint64_t(o_.iters); ++want) {
      const double t0 = NowUs();
      RETURN_IF_ERROR(a_->WriteImm(b_on_a_, imm, Completion()));
      while (answered() < want) {
        if (NowUs() - t0 > kAnswerUs) {
          return DeadlineExceededError("no answer to immediate " + std::to_string(want));
        }
      }
      lat.push_back(NowUs() - t0);
    }
    return lat;
  }

  const MirrorBenchOptions o_;
  std::unique_ptr<TransferEngine> a_, b_;
  PeerId b_on_a_{};
  std::unique_ptr<GpuWords> answers_;  // the kernel's answers (a word per warp), in host memory
  int* failed_ = nullptr;
  uint32_t next_ = 0;
};

}  // namespace

int RunMirrorBench(const MirrorBenchOptions& o) {
  if (o.iters <= kWarmup || o.rounds < 1) {
    std::fprintf(stderr, "ferry-bench mirror: --iters must exceed %d, --rounds be >= 1\n", kWarmup);
    return 2;
  }
  Runner runner(o);
  if (Status s = runner.Open(); !s.ok()) {
    std::fprintf(stderr, "ferry-bench mirror: %s\n", s.ToString().c_str());
    return 1;
  }
  struct Waiter {
    std::string name;
    std::shared_ptr<GpuWords> mirror;  // null: the host thread
    int pollers = 1;                   // warps polling the word
    std::vector<double> p50s, p99s;
  };
  std::vector<Waiter> waiters;
  waiters.push_back({"host thread (WaitImm)", nullptr});
  auto mapped = GpuWords::Create(0, 1, /*gdrcopy=*/false);
  if (!mapped.ok()) {
    std::fprintf(stderr, "ferry-bench mirror: %s\n", mapped.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<GpuWords> host_word = std::move(mapped).value();
  for (int pollers : {1, 4, 16}) {
    waiters.push_back({"kernel, mapped host word, " + std::to_string(pollers) +
                           (pollers == 1 ? " warp" : " warps"),
                       host_word, pollers});
  }
  std::string no_gdr;
  if (auto gdr = GpuWords::Create(0, 1);
      gdr.ok() && (*gdr)->placement() == GpuWords::Placement::kGpuMemory) {
    waiters.push_back({"kernel, GPU memory word, 1 warp", std::move(gdr).value(), 1});
  } else {
    no_gdr = gdr.ok() ? (*gdr)->gdrcopy_status() : gdr.status().ToString();
  }

  for (int round = 0; round < o.rounds; ++round) {
    for (Waiter& w : waiters) {
      auto lat = w.mirror ? runner.KernelWaiter(*w.mirror, w.pollers) : runner.HostWaiter();
      if (!lat.ok()) {
        std::fprintf(stderr, "ferry-bench mirror: %s: %s\n", w.name.c_str(),
                     lat.status().ToString().c_str());
        return 1;
      }
      const Figures f = Summarise(std::move(lat).value());
      w.p50s.push_back(f.p50);
      w.p99s.push_back(f.p99);
    }
  }
  std::printf(
      "ferry-bench mirror: immediate -> waiter -> answer, provider %s, %d round trips "
      "per waiter and round (first %d left out), median of %d rounds\n",
      o.provider.c_str(), o.iters, kWarmup, o.rounds);
  std::printf("%-36s %8s %8s %12s\n", "waiter", "p50 us", "p99 us", "p50 / host");
  const double host_p50 = MedianOf(waiters[0].p50s);
  for (const Waiter& w : waiters) {
    const double p50 = MedianOf(w.p50s);
    std::printf("%-36s %8.2f %8.2f %12.2f\n", w.name.c_str(), p50, MedianOf(w.p99s),
                host_p50 > 0 ? p50 / host_p50 : 0.0);
  }
  if (!no_gdr.empty()) {
    std::printf("%-36s not here: %s\n", "kernel, GPU memory word", no_gdr.c_str());
  }
  return 0;
}

}  // namespace ferry::bench
