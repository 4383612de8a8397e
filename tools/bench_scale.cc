// ferry-bench scale: the MoE protocol at EP16-64 on the host device, as the processes of this
// machine. The host device speaks the protocol the CUDA device speaks between nodes (every peer
// its own node, one section write per peer through the relay), so what each rank posts per step
// is what a GPU's proxy would post to its remote peers. Nodes are simulated: ranks r and q share
// one when r / ranks_per_node == q / ranks_per_node, and the counts are reported apart for
// those peers (which a GPU would reach over NVLink) and for the others (the NICs' share).
//
// Inputs are a function of (rank, token), so every rank can work out what every other rank
// sent and check its own outputs in full:
//   token t of rank r: expert ids from a generator seeded by r (top-k distinct of E); row bytes
//     byte 0 = r mod 64, byte 1 = t mod 64, the rest a hash of (r, t, column) mod 64 (valid
//     e4m3 and bf16 bits);
//   dispatch: each local expert's received rows, as a multiset, equal the rows routed to it;
//     every scale 1;
//   experts: each received row's output is bf16(t mod 16 + 1) in every column (t read from the
//     row's byte 1), combine weights 1/8, so token t combines to (t mod 16 + 1) * k / 8 --
//     exact in bf16 whatever the order of the sums (integers below 256, over 8).
// Counts come from TransferEngine::Traffic around one checked cycle, with a barrier after each
// step so that every rank's writes of that step have been posted.
#include "tools/bench_scale.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "tools/bench_util.h"
#include "moe/numerics.h"

namespace ferry::bench {
namespace {

using namespace std::chrono_literals;

constexpr int kMaxRanks = 64;
constexpr int kMaxReportNics = 4;

// What one rank posted in one step through one NIC: to peers of other (simulated) nodes, and
// to peers of its own node.
struct NicCounts {
  int64_t inter_writes = 0, inter_bytes = 0, inter_imms = 0, inter_peers = 0;
  int64_t intra_writes = 0, intra_bytes = 0, intra_imms = 0;
  int64_t max_peer_bytes = 0;  // the most bytes to one peer of another node
};

struct RankCounts {
  NicCounts step[2][kMaxReportNics];  // [dispatch, combine][NIC]
  int32_t ok = 0;
  char error[200] = {};
};

struct Report {
  int32_t ranks = 0;
  RankCounts rank[kMaxRanks];
};
static_assert(sizeof(Report) < 60000, "a report crosses a pipe in one write");

uint8_t RowByte(int rank, int token, int column) {
  if (column == 0) return uint8_t(rank & 0x3F);
  if (column == 1) return uint8_t(token & 0x3F);
  uint32_t h = uint32_t(rank) * 2654435761u ^ uint32_t(token) * 40503u ^ uint32_t(column) * 97u;
  h ^= h >> 13;
  return uint8_t((h * 0x5bd1e995u >> 24) & 0x3F);
}

// Rank r's expert ids, [T * K].
std::vector<int32_t> Ids(const ScaleBenchOptions& o, int rank) {
  std::mt19937 rng(uint32_t(rank) * 7919u + 1);
  std::vector<int32_t> experts(o.experts), ids;
  for (int e = 0; e < o.experts; ++e) experts[e] = e;
  for (int t = 0; t < o.tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    ids.insert(ids.end(), experts.begin(), experts.begin() + o.topk);
  }
  return ids;
}

std::string Row(const AllToAllConfig& c, int rank, int token) {
  std::string row(size_t(c.token_bytes()), '\0');
  for (size_t j = 0; j < row.size(); ++j) row[j] = char(RowByte(rank, token, int(j)));
  return row;
}

Status Check(bool ok, const std::string& what) {
  return ok ? Status::Ok() : DataLossError(what);
}

// The per-NIC deltas between two snapshots of every peer's traffic.
void Count(const AllToAllConfig& c, int ranks_per_node,
           const std::vector<std::vector<PeerTraffic>>& before,
           const std::vector<std::vector<PeerTraffic>>& after, NicCounts* out) {
  for (int q = 0; q < c.world_size; ++q) {
    if (q == c.rank) continue;
    const bool same_node = q / ranks_per_node == c.rank / ranks_per_node;
    for (size_t k = 0; k < after[q].size() && k < size_t(kMaxReportNics); ++k) {
      const int64_t writes = int64_t(after[q][k].writes - before[q][k].writes);
      const int64_t bytes = int64_t(after[q][k].bytes - before[q][k].bytes);
      const int64_t imms = int64_t(after[q][k].imms - before[q][k].imms);
      NicCounts& n = out[k];
      if (same_node) {
        n.intra_writes += writes;
        n.intra_bytes += bytes;
        n.intra_imms += imms;
      } else {
        n.inter_writes += writes;
        n.inter_bytes += bytes;
        n.inter_imms += imms;
        n.inter_peers += writes > 0;
        n.max_peer_bytes = std::max(n.max_peer_bytes, bytes);
      }
    }
  }
}

// The options' AllToAll configuration for `rank` of `world` ranks.
AllToAllConfig ConfigOf(const ScaleBenchOptions& o, int world, int rank) {
  return {.world_size = world, .rank = rank, .num_experts = o.experts,
          .experts_per_token = o.topk, .max_tokens_per_rank = o.tokens, .hidden = o.hidden,
          .dtype = o.fp8 ? DispatchDtype::kFp8E4M3 : DispatchDtype::kBf16};
}

// One variant: the options (a) and (b), node-once forwarding and its partial sums' form.
struct Variant {
  const char* name;
  bool once_per_rank, reduce, node_once;
  PartialSums sums = PartialSums::kCombineElement;
};

Status RunRank(const ScaleBenchOptions& o, const Variant& v, Bootstrap& b, RankCounts* mine) {
  AllToAllConfig c = ConfigOf(o, b.world_size(), b.rank());
  c.dispatch_once_per_rank = v.once_per_rank;
  c.combine_reduce_at_expert_rank = v.reduce;
  c.forwarding = v.node_once ? Forwarding::kNodeOnce : Forwarding::kPerRank;
  if (v.node_once) {
    c.ranks_per_node = o.ranks_per_node;
    c.partial_sums = v.sums;
  }
  RETURN_IF_ERROR(c.Validate());
  ASSIGN_OR_RETURN(EngineOptions eo, BenchEngineOptions(o.provider));
  eo.num_nics = uint32_t(o.nics);
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(eo));
  ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(c, engine.get(), b));
  // Every rank's PeerId: AddPeer of an engine already a peer (the AllToAll added them) gives
  // the PeerId it has.
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(engine->Address(), 120s));
  std::vector<PeerId> peer(c.world_size);
  for (int q = 0; q < c.world_size; ++q) {
    if (q == c.rank) continue;
    ASSIGN_OR_RETURN(peer[q], engine->AddPeer(addresses[q]));
  }
  auto snapshot = [&]() -> StatusOr<std::vector<std::vector<PeerTraffic>>> {
    std::vector<std::vector<PeerTraffic>> s(c.world_size);
    for (int q = 0; q < c.world_size; ++q) {
      if (q == c.rank) continue;
      ASSIGN_OR_RETURN(s[q], engine->Traffic(peer[q]));
    }
    return s;
  };

  const int me = c.rank, l = c.local_experts(), k = o.topk;
  const int64_t cap = c.expert_capacity(), row_bytes = c.token_bytes();
  std::string x;
  for (int t = 0; t < o.tokens; ++t) x += Row(c, me, t);
  const std::vector<float> scales(size_t(o.tokens) * c.scales_per_token(), 1.0f);
  const std::vector<int32_t> ids = Ids(o, me);
  const std::vector<float> w(ids.size(), 1.0f / 8);
  std::vector<uint8_t> out_x(size_t(l * cap * row_bytes));
  std::vector<float> out_scales(size_t(l * cap) * c.scales_per_token(), -1.0f);
  std::vector<int32_t> counts(l, -1);
  std::vector<uint16_t> expert_out(size_t(l * cap) * o.hidden);
  std::vector<uint16_t> y(size_t(o.tokens) * o.hidden);

  RETURN_IF_ERROR(b.Barrier(120s));
  ASSIGN_OR_RETURN(auto s0, snapshot());
  const Deadline deadline = Deadline::After(120s);
  RETURN_IF_ERROR(a2a->DispatchSend({x.data(), o.fp8 ? scales.data() : nullptr, ids.data(),
                                     w.data(), o.tokens}));
  RETURN_IF_ERROR(a2a->DispatchRecv({out_x.data(), o.fp8 ? out_scales.data() : nullptr,
                                     counts.data()}, deadline));
  RETURN_IF_ERROR(b.Barrier(120s));
  ASSIGN_OR_RETURN(auto s1, snapshot());

  // Dispatch: each local expert's rows, as a multiset, are the rows routed to it.
  std::vector<std::vector<std::string>> want(l);
  for (int r = 0; r < c.world_size; ++r) {
    const std::vector<int32_t> theirs = r == me ? ids : Ids(o, r);
    for (int t = 0; t < o.tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        const int e = theirs[size_t(t) * k + j];
        if (e / l == me) want[e % l].push_back(Row(c, r, t));
      }
    }
  }
  for (int e = 0; e < l; ++e) {
    RETURN_IF_ERROR(Check(counts[e] == int32_t(want[e].size()),
                          "expert " + std::to_string(e) + " received " +
                              std::to_string(counts[e]) + " rows, not " +
                              std::to_string(want[e].size())));
    std::vector<std::string> got;
    for (int i = 0; i < counts[e]; ++i) {
      const uint8_t* row = out_x.data() + (size_t(e) * cap + i) * row_bytes;
      got.emplace_back(reinterpret_cast<const char*>(row), size_t(row_bytes));
      const float* s = out_scales.data() + (size_t(e) * cap + i) * c.scales_per_token();
      for (int g = 0; g < c.scales_per_token(); ++g) {
        RETURN_IF_ERROR(Check(s[g] == 1.0f, "a scale of expert " + std::to_string(e) + " is " +
                                                std::to_string(s[g])));
      }
      // The expert's output for this row: t mod 16 + 1 in every column.
      const uint16_t v = FloatToBf16(float((row[1] & 0x3F) % 16 + 1));
      std::fill_n(expert_out.begin() + (size_t(e) * cap + i) * o.hidden, o.hidden, v);
    }
    std::sort(got.begin(), got.end());
    std::sort(want[e].begin(), want[e].end());
    RETURN_IF_ERROR(Check(got == want[e], "expert " + std::to_string(e) +
                                              " received other rows than were routed to it"));
  }

  RETURN_IF_ERROR(a2a->CombineSend(expert_out.data()));
  RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, deadline));
  RETURN_IF_ERROR(b.Barrier(120s));
  ASSIGN_OR_RETURN(auto s2, snapshot());
  // Combine: token t is (t mod 16 + 1) * k / 8 in every column (64 distinct tokens per value:
  // t mod 64 travelled in the row, so a row of another token would show).
  for (int t = 0; t < o.tokens; ++t) {
    const uint16_t v = FloatToBf16(float((t & 0x3F) % 16 + 1) * float(k) / 8.0f);
    for (int j = 0; j < o.hidden; ++j) {
      const uint16_t got = y[size_t(t) * o.hidden + j];
      if (got != v) {
        return DataLossError("token " + std::to_string(t) + " combined to " +
                             std::to_string(Bf16ToFloat(got)) + " at column " +
                             std::to_string(j) + ", not " + std::to_string(Bf16ToFloat(v)));
      }
    }
  }
  Count(c, o.ranks_per_node, s0, s1, mine->step[0]);
  Count(c, o.ranks_per_node, s1, s2, mine->step[1]);
  mine->ok = 1;
  return Status::Ok();
}

void PrintNic(const NicCounts& n, bool first) {
  std::printf("%s{\"inter_writes\":%lld,\"inter_bytes\":%lld,\"inter_imms\":%lld,"
              "\"inter_peers\":%lld,\"intra_writes\":%lld,\"intra_bytes\":%lld,"
              "\"intra_imms\":%lld,\"max_peer_bytes\":%lld}",
              first ? "" : ",", (long long)n.inter_writes, (long long)n.inter_bytes,
              (long long)n.inter_imms, (long long)n.inter_peers, (long long)n.intra_writes,
              (long long)n.intra_bytes, (long long)n.intra_imms, (long long)n.max_peer_bytes);
}

}  // namespace

int RunScaleBench(const ScaleBenchOptions& o) {
  if (o.ranks < 2 || o.ranks > kMaxRanks || o.ranks_per_node < 1 ||
      o.ranks % o.ranks_per_node != 0 || o.nics < 1 || o.nics > kMaxReportNics ||
      o.topk > 15) {
    std::fprintf(stderr, "ferry-bench scale: 2 to %d ranks, --node-ranks dividing them, 1 to %d "
                 "NICs, top-k at most 15 (the checked sums stay exact in bf16)\n", kMaxRanks,
                 kMaxReportNics);
    return 2;
  }
  const AllToAllConfig c = ConfigOf(o, o.ranks, 0);
  if (Status s = c.Validate(); !s.ok()) {
    std::fprintf(stderr, "ferry-bench scale: %s\n", s.ToString().c_str());
    return 2;
  }
  std::printf("{\"bench\":\"scale\",\"provider\":\"%s\",\"ep\":%d,\"ranks_per_node\":%d,"
              "\"nics\":%d,\"tokens\":%d,\"hidden\":%d,\"experts\":%d,\"topk\":%d,"
              "\"dtype\":\"%s\",\"token_bytes\":%lld,\"variants\":[",
              o.provider.c_str(), o.ranks, o.ranks_per_node, o.nics, o.tokens, o.hidden,
              o.experts, o.topk, o.fp8 ? "fp8" : "bf16", (long long)c.token_bytes());
  const Variant all_variants[] = {
      {"plain", false, false, false},
      {"(a)", true, false, false},
      {"(b)", false, true, false},
      {"(a)+(b)", true, true, false},
      {"node-once plain", false, false, true},
      {"node-once (a)+(b)", true, true, true},
      {"node-once (a)+(b) fp32 sums", true, true, true, PartialSums::kFp32}};
  const size_t count = o.node_once ? std::size(all_variants) : 4;
  const auto* variants = all_variants;
  bool all_ok = true;
  for (size_t v = 0; v < count; ++v) {
    Report report{};
    const bool ran = RunRanksAndCollect<Report>(
        "scale", o.ranks, 0,
        [&](Bootstrap& b, Report* out) -> Status {
          RankCounts mine{};
          Status s = RunRank(o, variants[v], b, &mine);
          if (!s.ok()) std::snprintf(mine.error, sizeof mine.error, "%s", s.ToString().c_str());
          // Every rank's counts (or its error) to rank 0, which reports them all.
          ASSIGN_OR_RETURN(auto all, b.AllGather({reinterpret_cast<const uint8_t*>(&mine),
                                                  sizeof mine}, 600s));
          out->ranks = b.world_size();
          for (int r = 0; r < b.world_size(); ++r) {
            if (all[r].size() != sizeof(RankCounts)) return DataLossError("a rank's counts");
            std::memcpy(&out->rank[r], all[r].data(), sizeof(RankCounts));
          }
          return s;
        },
        &report, std::chrono::minutes(20));
    bool ok = ran && report.ranks == o.ranks;
    for (int r = 0; ok && r < report.ranks; ++r) {
      if (!report.rank[r].ok) {
        std::fprintf(stderr, "ferry-bench scale %s: rank %d: %s\n", variants[v].name, r,
                     report.rank[r].error);
        ok = false;
      }
    }
    all_ok = all_ok && ok;
    std::printf("%s{\"variant\":\"%s\",\"checked\":%s,\"ranks\":[", v ? "," : "",
                variants[v].name, ok ? "true" : "false");
    for (int r = 0; ok && r < report.ranks; ++r) {
      std::printf("%s{\"rank\":%d", r ? "," : "", r);
      for (int step = 0; step < 2; ++step) {
        std::printf(",\"%s\":[", step == 0 ? "dispatch" : "combine");
        for (int k = 0; k < o.nics; ++k) PrintNic(report.rank[r].step[step][k], k == 0);
        std::printf("]");
      }
      std::printf("}");
    }
    std::printf("]}");
    std::fflush(stdout);
  }
  std::printf("]}\n");
  return all_ok ? 0 : 1;
}

}  // namespace ferry::bench
