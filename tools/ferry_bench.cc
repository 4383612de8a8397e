// ferry-bench: benchmarks and the demo driver.
//
//   ferry-bench fabric [--provider P] [--max-bytes N] [--quick] [--json]
//                      [--world-size 2 --rank R --rendezvous HOST:PORT]
//   ferry-bench moe    [--provider P] [--ranks N] [--tokens T] [--hidden H] [--experts E]
//                      [--topk K] [--dtype fp8|bf16] [--iters I] [--json]
//                      [--once-per-rank] [--reduce-at-expert-rank] [--compare] [--token-major]
//                      [--mask-lost-peers] [--wait-cost] [--fp16-combine] [--stream 0-3]
//                      [--device host|cuda] [--nvlink [--node-ranks N [--node-once]]]
//                      [--private N]
//                      [--world-size N --rank R --rendezvous HOST:PORT]: one process per
//                      rank, started apart (FERRY_WORLD_SIZE, FERRY_RANK, FERRY_RENDEZVOUS)
//                      [--timeout-ms N]: each host step's wait for the other ranks (60000)
//   ferry-bench kv     [--provider P] [--tokens T] [--decoders N] [--rounds R] [--pace F]
//                      [--json] [--world-size N --rank R --rendezvous HOST:PORT]
//   ferry-bench topo   [--sysfs DIR] [--exclude NIC,...]: which NICs and core serve each GPU
//   ferry-bench p2p    [--bytes N]: GPU 0 <-> 1 bandwidth (copy engine, SM stores and loads)
//   ferry-bench mirror [--provider P] [--iters I] [--rounds R]: a kernel waiting on a mirrored
//                      immediate counter (GpuWords) next to a host thread in WaitImm
//   ferry-bench buffers  what the AllToAll's buffers take per rank at EP 8-64, decode and
//                      prefill, against DeepEP's low-latency buffer (docs/DESIGN.md)
//   ferry-bench soak   [--provider P] [--cycles N] [--requests N] [--seconds S] [--decoders N]
//                      [--churn N] [--only moe|kv]: MoE cycles and KV requests with decoders
//                      coming and going, checked, with memory, descriptors and peer tables
//                      sampled (exit 1 on an error or growth above 1 %)
//                      [--only moe|kv --world-size N --rank R --rendezvous HOST:PORT]:
//                      one phase on ranks started apart (kv: rank 0 the prefill)
//   ferry-bench elastic [--provider P] [--cycles N] [--deadline-ms D] [--epochs E]: rank 2
//                      of four (host device, mask_lost_peers) killed and replaced N times (20):
//                      epochs lost per death, the time from a death to the first full epoch
//                      after it, the survivors' descriptors and private memory (exit 1 on an
//                      error, more than one epoch lost to a death, or growth)
//   ferry-bench scale  [--provider P] [--ranks N] [--node-ranks 8] [--nics 2] [--tokens T]
//                      [--hidden H] [--experts E] [--topk K] [--dtype fp8|bf16]
//                      [--node-once]: the MoE protocol on N host-device ranks, outputs checked,
//                      and the writes, bytes and immediates each rank posts per step through
//                      each NIC (JSON); --node-once adds node-once forwarding's variants
//   ferry-bench demo   the main job of `make demo`: short fabric, moe and kv runs on shm
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "tools/bench_elastic.h"
#include "tools/bench_fabric.h"
#include "tools/bench_kv.h"
#include "tools/bench_moe.h"
#include "tools/bench_scale.h"
#include "tools/bench_soak.h"
#ifdef FERRY_BENCH_CUDA
#include "tools/bench_mirror.h"
#include "tools/bench_p2p.h"
#endif
#include "common/strings.h"
#include "ferry/bootstrap.h"
#include "ferry/topology.h"
#include "moe/buffers.h"

namespace {

void Usage() {
  std::fprintf(
      stderr,
      "usage: ferry-bench fabric [--provider P] [--max-bytes N] [--quick] [--json]\n"
      "                          [--world-size 2 --rank R --rendezvous HOST:PORT]\n"
      "       ferry-bench moe [--provider P] [--ranks N] [--tokens T] [--hidden H]\n"
      "                       [--experts E] [--topk K] [--dtype fp8|bf16] [--iters I]"
      " [--json]\n"
      "                       [--once-per-rank] [--reduce-at-expert-rank] [--compare]"
      " [--token-major] [--mask-lost-peers] [--wait-cost]\n"
      "                       [--fp16-combine] [--stream 0-3]\n"
      "                       [--device host|cuda] [--nvlink [--node-ranks N [--node-once]]]"
      " [--private N]\n"
      "                       [--world-size N --rank R --rendezvous HOST:PORT]"
      " [--timeout-ms N]\n"
      "       ferry-bench kv [--provider P] [--tokens T] [--decoders N] [--rounds R]"
      " [--pace F]"
      " [--json]\n"
      "                      [--world-size N --rank R --rendezvous HOST:PORT]\n"
      "       ferry-bench topo [--sysfs DIR] [--exclude NIC,...]\n"
      "       ferry-bench p2p [--bytes N]   (GPU 0 <-> 1: copy engine, SM stores and loads)\n"
      "       ferry-bench mirror [--provider P] [--iters I] [--rounds R]   (a kernel waiting"
      " on MirrorImm)\n"
      "       ferry-bench buffers   (per-rank buffer bytes against DeepEP's low-latency mode)\n"
      "       ferry-bench soak [--provider P] [--cycles N] [--requests N] [--seconds S]\n"
      "                        [--decoders N] [--churn N] [--only moe|kv]\n"
      "                        [--only moe|kv --world-size N --rank R --rendezvous HOST:PORT]\n"
      "       ferry-bench elastic [--provider P] [--cycles N] [--deadline-ms D] [--epochs E]\n"
      "       ferry-bench scale [--provider P] [--ranks N] [--node-ranks 8] [--nics 2]"
      " [--tokens T]\n"
      "                         [--hidden H] [--experts E] [--topk K] [--dtype fp8|bf16]\n"
      "                         [--node-once]\n"
      "       ferry-bench demo\n"
      "Provider from --provider, else FERRY_PROVIDER, else shm.\n");
}

bool ParseInt(const char* s, int* out) {
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (!end || *end || v < 0 || v > (1 << 30)) return false;
  *out = static_cast<int>(v);
  return true;
}

// The table of docs/DESIGN.md ("Buffer memory"): DeepSeek-V3's MoE layer (256 experts, top-8,
// hidden 7168, fp8), nodes of 8 GPUs, the CUDA device with nothing streamed; MiB per rank.
int PrintBuffers() {
  std::printf("| EP | tokens | ferry receive, plain | ferry receive, (a)+(b) | ferry send, (a)+(b) "
              "| ferry receive, node-once | DeepEP LL receive | DeepEP LL send "
              "| (a)+(b) receive / DeepEP's | node-once receive / DeepEP's |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  const double mib = 1024.0 * 1024.0;
  for (int tokens : {128, 4096}) {
    for (int ep : {8, 16, 32, 64}) {
      ferry::AllToAllConfig c;
      c.world_size = ep;
      c.ranks_per_node = ep < 8 ? ep : 8;
      c.num_experts = 256;
      c.experts_per_token = 8;
      c.max_tokens_per_rank = tokens;
      c.hidden = 7168;
      c.dtype = ferry::DispatchDtype::kFp8E4M3;
      c.device = ferry::MoeDeviceKind::kCuda;
      const ferry::moe::BufferBytes plain = ferry::moe::CudaDeviceBuffers(c);
      c.dispatch_once_per_rank = c.combine_reduce_at_expert_rank = true;
      const ferry::moe::BufferBytes ab = ferry::moe::CudaDeviceBuffers(c);
      const ferry::moe::BufferBytes deep_ep =
          ferry::moe::DeepEpLowLatencyBuffers(tokens, c.hidden, c.num_experts);
      // Node-once where there are several nodes (EP8 is one node).
      c.forwarding = ferry::Forwarding::kNodeOnce;
      char once[32] = "-", once_ratio[32] = "-";
      if (ep > c.ranks_per_node) {
        const double receive = double(ferry::moe::NodeOnceBuffers(c).receive);
        std::snprintf(once, sizeof once, "%.0f", receive / mib);
        std::snprintf(once_ratio, sizeof once_ratio, "%.2f", receive / double(deep_ep.receive));
      }
      std::printf("| %d | %d | %.0f | %.0f | %.0f | %s | %.0f | %.0f | %.2f | %s |\n", ep, tokens,
                  plain.receive / mib, ab.receive / mib, ab.send / mib, once,
                  deep_ep.receive / mib, deep_ep.send / mib,
                  double(ab.receive) / double(deep_ep.receive), once_ratio);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage();
    return 2;
  }
  const std::string command = argv[1];
  ferry::bench::FabricBenchOptions f;
  ferry::bench::MoeBenchOptions m;
  ferry::bench::KvBenchOptions kv;
  ferry::bench::SoakOptions soak;
  ferry::bench::ElasticOptions elastic;
  int64_t p2p_bytes = int64_t{256} << 20;
  bool iters_given = false, rounds_given = false;  // mirror's own defaults otherwise
  int nics = 2;  // ferry-bench scale: NICs per rank
  bool node_once = false;  // ferry-bench scale: node-once forwarding's variants too
  bool hidden_given = false, ranks_given = false;  // scale's own defaults otherwise
  ferry::TopologyOptions topo = ferry::TopologyOptions::FromEnv();
  ferry::RendezvousOptions rendezvous;  // the flags over FERRY_RENDEZVOUS and friends
  {
    auto from_env = ferry::RendezvousOptions::FromEnv();
    if (!from_env.ok()) {
      std::fprintf(stderr, "%s\n", from_env.status().ToString().c_str());
      return 2;
    }
    rendezvous = *from_env;
  }
  if (const char* p = std::getenv("FERRY_PROVIDER")) {
    f.provider = m.provider = kv.provider = soak.provider = elastic.provider = p;
  }
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    bool ok = true;
    if (a == "--provider" && has_value) {
      f.provider = m.provider = kv.provider = soak.provider = elastic.provider = argv[++i];
    } else if (a == "--max-bytes" && has_value) {
      f.max_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--quick") {
      f.quick = true;
    } else if (a == "--json") {
      f.json = m.json = kv.json = true;
    } else if (a == "--ranks" && has_value) {
      ok = ParseInt(argv[++i], &m.ranks);
      ranks_given = true;
    } else if (a == "--tokens" && has_value) {
      ok = ParseInt(argv[++i], &m.tokens) && m.tokens >= 1;
      kv.tokens = m.tokens;
    } else if (a == "--hidden" && has_value) {
      ok = ParseInt(argv[++i], &m.hidden);
      hidden_given = true;
    } else if (a == "--experts" && has_value) {
      ok = ParseInt(argv[++i], &m.experts);
    } else if (a == "--topk" && has_value) {
      ok = ParseInt(argv[++i], &m.topk);
    } else if (a == "--decoders" && has_value) {
      ok = ParseInt(argv[++i], &kv.decoders) && kv.decoders >= 1 && kv.decoders <= 16;
      soak.decoders = kv.decoders;
    } else if (a == "--cycles" && has_value) {
      int v = 0;
      ok = ParseInt(argv[++i], &v) && v >= 1;
      soak.cycles = elastic.cycles = v;
    } else if (a == "--deadline-ms" && has_value) {
      ok = ParseInt(argv[++i], &elastic.deadline_ms) && elastic.deadline_ms >= 1;
    } else if (a == "--epochs" && has_value) {
      ok = ParseInt(argv[++i], &elastic.epochs) && elastic.epochs >= 1;
    } else if (a == "--requests" && has_value) {
      int v = 0;
      ok = ParseInt(argv[++i], &v) && v >= 1;
      soak.requests = v;
    } else if (a == "--seconds" && has_value) {
      ok = ParseInt(argv[++i], &soak.seconds);
    } else if (a == "--only" && has_value) {
      soak.only = argv[++i];
    } else if (a == "--churn" && has_value) {
      ok = ParseInt(argv[++i], &soak.churn) && soak.churn >= 1;
    } else if (a == "--rounds" && has_value) {
      ok = ParseInt(argv[++i], &kv.rounds) && kv.rounds >= 1 && kv.rounds <= 100;
      rounds_given = true;
    } else if (a == "--pace" && has_value) {
      char* end = nullptr;
      kv.pace = std::strtod(argv[++i], &end);
      ok = end && *end == '\0' && kv.pace >= 1.0 && kv.pace <= 10.0;
    } else if (a == "--iters" && has_value) {
      ok = ParseInt(argv[++i], &m.iters);
      iters_given = true;
    } else if (a == "--device" && has_value) {
      std::string d = argv[++i];
      ok = d == "host" || d == "cuda";
      m.cuda = d == "cuda" || m.nvlink;
    } else if (a == "--sysfs" && has_value) {
      topo.sysfs_root = argv[++i];
    } else if (a == "--exclude" && has_value) {
      topo.exclude_nics = ferry::SplitCommaList(argv[++i]);
    } else if (a == "--bytes" && has_value) {
      char* end = nullptr;
      p2p_bytes = std::strtoll(argv[++i], &end, 10);
      ok = end && *end == '\0' && p2p_bytes > 0;
    } else if (a == "--nvlink") {
      m.nvlink = m.cuda = true;
    } else if (a == "--nics" && has_value) {
      ok = ParseInt(argv[++i], &nics) && nics >= 1;
    } else if (a == "--node-ranks" && has_value) {
      ok = ParseInt(argv[++i], &m.node_ranks) && m.node_ranks >= 1;
    } else if (a == "--private" && has_value) {
      ok = ParseInt(argv[++i], &m.private_tokens) && m.private_tokens >= 0;
    } else if (a == "--node-once") {
      node_once = m.node_once = true;
    } else if (a == "--once-per-rank") {
      m.once_per_rank = true;
    } else if (a == "--reduce-at-expert-rank") {
      m.reduce_at_expert_rank = true;
    } else if (a == "--compare") {
      m.compare = true;
    } else if (a == "--token-major") {
      m.token_major = true;
    } else if (a == "--mask-lost-peers") {
      m.mask_lost_peers = true;
    } else if (a == "--wait-cost") {
      m.wait_cost = true;
    } else if (a == "--fp16-combine") {
      m.fp16_combine = true;
    } else if (a == "--stream" && has_value) {
      ok = ParseInt(argv[++i], &m.stream) && m.stream >= 0 && m.stream <= 3;
    } else if (a == "--timeout-ms" && has_value) {
      ok = ParseInt(argv[++i], &m.step_timeout_ms) && m.step_timeout_ms >= 1;
    } else if (a == "--world-size" && has_value) {
      ok = ParseInt(argv[++i], &rendezvous.world_size) && rendezvous.world_size >= 1;
    } else if (a == "--rank" && has_value) {
      ok = ParseInt(argv[++i], &rendezvous.rank);
    } else if (a == "--rendezvous" && has_value) {
      rendezvous.address = argv[++i];
    } else if (a == "--dtype" && has_value) {
      std::string d = argv[++i];
      ok = d == "fp8" || d == "bf16";
      m.fp8 = d == "fp8";
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "bad argument: %s\n", a.c_str());
      Usage();
      return 2;
    }
  }
  if (f.max_bytes < 1024) {
    std::fprintf(stderr, "--max-bytes must be at least 1024\n");
    return 2;
  }
  if (m.ranks < 1 || m.iters < 1) {
    std::fprintf(stderr, "--ranks and --iters must be at least 1\n");
    return 2;
  }
  if (command == "scale") {
    ferry::bench::ScaleBenchOptions so;
    so.provider = m.provider;
    so.ranks = m.ranks;
    if (m.node_ranks > 0) so.ranks_per_node = m.node_ranks;
    so.nics = nics;
    so.tokens = m.tokens;
    if (hidden_given) so.hidden = m.hidden;
    if (!ranks_given) so.ranks = ferry::bench::ScaleBenchOptions{}.ranks;
    so.experts = m.experts;
    so.topk = m.topk;
    so.fp8 = m.fp8;
    so.node_once = node_once;
    return ferry::bench::RunScaleBench(so);
  }
  if (m.node_ranks > 0 && (!m.nvlink || m.ranks % m.node_ranks != 0)) {
    std::fprintf(stderr, "--node-ranks needs --nvlink and must divide --ranks\n");
    return 2;
  }
  if (command == "moe" && m.node_once &&
      (m.node_ranks < 2 || m.node_ranks >= m.ranks || m.mask_lost_peers)) {
    std::fprintf(stderr, "ferry-bench moe --node-once needs nodes of several ranks (--node-ranks "
                         "N, 1 < N < --ranks) and no --mask-lost-peers\n");
    return 2;
  }
  if (command == "buffers") return PrintBuffers();
  std::unique_ptr<ferry::Bootstrap> world;  // ranks started apart, met at the rendezvous
  if (!rendezvous.address.empty()) {
    if (command != "moe" && command != "kv" && command != "fabric" && command != "soak") {
      std::fprintf(stderr, "--rendezvous: ferry-bench fabric, moe, kv and soak run one process "
                           "per rank; %s does not\n", command.c_str());
      return 2;
    }
    m.ranks = rendezvous.world_size;  // one process per rank
    auto joined = ferry::JoinRendezvous(rendezvous);
    if (!joined.ok()) {
      std::fprintf(stderr, "ferry-bench: %s\n", joined.status().ToString().c_str());
      return 1;
    }
    world = std::move(*joined);
    m.world = kv.world = f.world = soak.world = world.get();
  }
  if (command == "fabric") return ferry::bench::RunFabricBench(f);
  if (command == "moe") return ferry::bench::RunMoeBench(m);
  if (command == "kv") return ferry::bench::RunKvBench(kv);
  if (command == "soak") return ferry::bench::RunSoakBench(soak);
  if (command == "elastic") return ferry::bench::RunElasticBench(elastic);
  if (command == "p2p") {
#ifdef FERRY_BENCH_CUDA
    return ferry::bench::RunP2pBench(p2p_bytes);
#else
    std::fprintf(stderr, "ferry-bench p2p: built without CUDA\n");
    return 1;
#endif
  }
  if (command == "mirror") {
#ifdef FERRY_BENCH_CUDA
    ferry::bench::MirrorBenchOptions mo;
    mo.provider = f.provider;
    if (iters_given) mo.iters = m.iters;
    if (rounds_given) mo.rounds = kv.rounds;
    return ferry::bench::RunMirrorBench(mo);
#else
    std::fprintf(stderr, "ferry-bench mirror: built without CUDA\n");
    return 1;
#endif
  }
  if (command == "topo") {
    auto t = ferry::Topology::Discover(topo);
    if (!t.ok()) {
      std::fprintf(stderr, "topology: %s\n", t.status().ToString().c_str());
      return 1;
    }
    std::printf("%s", t->Describe().c_str());
    return 0;
  }
  if (command == "demo") {
    std::printf("ferry demo: three short runs on local ranks. Ratios against the raw baselines "
                "swing on machines with few cores (every rank polls); docs/PERFORMANCE.md has "
                "figures from a 16-core host.\n\n");
    std::printf("== ferry demo 1/3: TransferEngine vs raw libfabric, %s provider ==\n",
                f.provider.c_str());
    f.quick = true;
    f.max_bytes = 16u << 20;
    if (int rc = ferry::bench::RunFabricBench(f)) return rc;
    std::printf("\n== ferry demo 2/3: MoE dispatch + combine, host device, 4 ranks ==\n");
    m.ranks = 4;
    m.tokens = 64;
    m.hidden = 2048;
    m.experts = 32;
    m.topk = 4;
    m.iters = 20;
    m.compare = true;
    m.token_major = true;  // and (a)+(b) in the token-major layout
    if (int rc = ferry::bench::RunMoeBench(m)) return rc;
    std::printf(
        "\n== ferry demo 3/3: KV messenger, 1 prefill -> 2 decoders, 1024-token prompt ==\n");
    kv.tokens = 1024;
    kv.decoders = 2;
    return ferry::bench::RunKvBench(kv);
  }
  Usage();
  return 2;
}
