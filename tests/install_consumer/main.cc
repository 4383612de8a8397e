// Links against an installed ferry and uses its public API only: the README's example between two
// forked ranks (a write with an immediate over shm), and each part's entry points refusing bad
// input. libferry exports only include/ferry (hidden visibility), so this also checks that what a
// user calls is exported.
#include <cstdio>
#include <cstring>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/kv.h"
#include "ferry/moe.h"
#include "ferry/topology.h"

namespace {

using namespace std::chrono_literals;

// Rank 0 writes 4 KiB into rank 1 with immediate 7; rank 1 counts it and checks the bytes.
ferry::Status WriteBetweenRanks(ferry::Bootstrap& bootstrap) {
  ferry::EngineOptions options;
  options.provider = "shm";
  auto engine = ferry::TransferEngine::Create(options);
  if (!engine.ok()) return engine.status();
  std::vector<uint8_t> buf(4096, static_cast<uint8_t>(bootstrap.rank() == 0 ? 0xab : 0));
  auto region = (*engine)->RegisterMemory(buf.data(), buf.size());
  if (!region.ok()) return region.status();
  if (ferry::Status s = (*engine)->CreateImmCounter(7); !s.ok()) return s;
  auto addresses = bootstrap.AllGather((*engine)->Address(), 10s);
  if (!addresses.ok()) return addresses.status();
  auto regions = bootstrap.AllGather(region->remote().Serialize(), 10s);
  if (!regions.ok()) return regions.status();
  const int other = 1 - bootstrap.rank();
  auto peer = (*engine)->AddPeer((*addresses)[other]);
  if (!peer.ok()) return peer.status();
  auto dst = ferry::RemoteRegion::Parse((*regions)[other]);
  if (!dst.ok()) return dst.status();
  if (bootstrap.rank() == 0) {
    ferry::TransferCounter done;
    ferry::Status s = (*engine)->Write(
        {.src = &*region, .peer = *peer, .dst = *dst, .length = buf.size(), .imm = 7},
        ferry::Completion::Counter(&done));
    if (s.ok()) s = done.Wait(1, ferry::Deadline::After(10s));
    if (!s.ok()) return s;
  } else {
    ferry::Status s = (*engine)->WaitImm(7, 1, ferry::Deadline::After(10s));
    if (!s.ok()) return s;
    for (uint8_t b : buf) {
      if (b != 0xab) return ferry::DataLossError("the written bytes differ");
    }
  }
  return bootstrap.Barrier(10s);  // rank 1 has counted before rank 0's engine goes
}

int Fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  // Forked before this process starts any thread of its own (an engine's worker).
  const std::vector<ferry::RankExit> exits = ferry::RunLocalRanks(2, WriteBetweenRanks, 60s);
  for (const ferry::RankExit& e : exits) {
    if (!e.ok()) return Fail("a rank's write with an immediate failed (its status is above)");
  }
  if (ferry::RemoteRegion::Parse({}).ok()) return Fail("an empty region descriptor was accepted");
  if (ferry::AllToAllConfig{}.Validate().ok()) return Fail("an empty moe config was accepted");
  if (ferry::KvModel{}.Validate().ok()) return Fail("an empty KV model was accepted");
  auto cpus = ferry::ParseCpuList("0-3,8");
  if (!cpus.ok() || cpus->size() != 5) return Fail("ParseCpuList(\"0-3,8\") is not 5 CPUs");
  if (ferry::ParseCpuList("3-1").ok()) return Fail("a reversed CPU range was accepted");
  const ferry::Status lost = ferry::UnavailableError("peer lost");
  if (lost.code() != ferry::StatusCode::kUnavailable) return Fail("UnavailableError's code");
  std::printf("consumer: two ranks wrote over shm; %s\n", lost.ToString().c_str());
  return 0;
}
