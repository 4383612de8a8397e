// Helpers the ferry-bench benchmarks share: a microsecond clock and running forked ranks that
// hand one fixed-size result back to the launcher.
#pragma once

#include <errno.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"

namespace ferry::bench {

// CLOCK_MONOTONIC in microseconds: comparable between processes of one host.
inline double NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// Sleeps until NowUs() reaches `until_us` (any length; an interrupted sleep resumes).
inline void SleepUntilUs(double until_us) {
  if (until_us <= 0) return;
  const auto ns = static_cast<long long>(until_us * 1e3);
  const timespec at{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, nullptr) == EINTR) {
  }
}

// Forks `ranks` ranks running `body`; the result `reporter` fills comes back through a pipe.
// With `world` (ferry-bench --rendezvous: ranks started apart, this process one of them), runs
// `body` once on it instead, and every rank gets the reporter's result by an all-gather.
// False (after printing why) if a rank failed or nothing came back.
template <typename Result>
bool RunRanksAndCollect(const char* bench, int ranks, int reporter,
                        const std::function<Status(Bootstrap&, Result*)>& body, Result* out,
                        std::chrono::milliseconds timeout, Bootstrap* world = nullptr) {
  static_assert(std::is_trivially_copyable_v<Result>, "results cross a pipe as bytes");
  if (world) {
    if (world->world_size() != ranks) {
      std::fprintf(stderr, "ferry-bench %s: its options make %d ranks, the rendezvous has %d\n",
                   bench, ranks, world->world_size());
      return false;
    }
    Result mine{};
    Status s = body(*world, &mine);
    if (s.ok()) {
      auto all = world->AllGather(
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&mine), sizeof mine),
          timeout);
      if (all.ok() && (*all)[reporter].size() == sizeof *out) {
        std::memcpy(out, (*all)[reporter].data(), sizeof *out);
        return true;
      }
      s = all.ok() ? DataLossError("the reporter's result has another size") : all.status();
    }
    std::fprintf(stderr, "ferry-bench %s: [rank %d] %s\n", bench, world->rank(),
                 s.ToString().c_str());
    return false;
  }
  int fds[2];
  if (pipe(fds) != 0) return false;
  auto exits = RunLocalRanks(ranks, [&](Bootstrap& b) -> Status {
    close(fds[0]);
    Result r{};
    RETURN_IF_ERROR(body(b, &r));
    if (b.rank() == reporter && write(fds[1], &r, sizeof r) != sizeof r) {
      return InternalError("could not report the result");
    }
    return Status::Ok();
  }, timeout);
  close(fds[1]);
  const bool got = read(fds[0], out, sizeof *out) == sizeof *out;
  close(fds[0]);
  for (const RankExit& e : exits) {
    if (!e.ok()) {
      std::fprintf(stderr, "ferry-bench %s: a rank failed (exit %d, signal %d%s)\n", bench,
                   e.exit_code, e.signal, e.timed_out ? ", timed out" : "");
      return false;
    }
  }
  return got;
}

// The FERRY_* environment's engine options (a variable its field cannot take is an error, not
// a silent default) on `provider`; over tcp on loopback unless FERRY_NODE says otherwise.
inline StatusOr<EngineOptions> BenchEngineOptions(const std::string& provider) {
  ASSIGN_OR_RETURN(EngineOptions eo, EngineOptions::FromEnv());
  eo.provider = provider;
  if (provider.find("tcp") != std::string::npos && eo.node.empty()) eo.node = "127.0.0.1";
  return eo;
}

// Runs child(fd) in a forked process, which ends with child's return value as its exit code,
// and reads `*out` (a trivially copyable value) from what it writes to fd; then waits for it.
// Whether the value came whole; `*status` is waitpid's. Fork only where no other thread holds
// a lock the child needs (the caller holds no engine).
template <typename Value, typename Child>
bool RunChild(Child child, Value* out, int* status) {
  static_assert(std::is_trivially_copyable_v<Value>, "the value crosses a pipe as bytes");
  int fds[2];
  if (pipe(fds) != 0) return false;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return false;
  }
  if (pid == 0) {
    close(fds[0]);
    _exit(child(fds[1]));
  }
  close(fds[1]);
  const bool got = read(fds[0], out, sizeof *out) == sizeof *out;
  close(fds[0]);
  waitpid(pid, status, 0);
  return got;
}

}  // namespace ferry::bench
