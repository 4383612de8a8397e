// ferry-bench: benchmarks and the demo driver.
//
//   ferry-bench fabric [--provider shm|tcp;ofi_rxm|efa] [--max-bytes N] [--quick] [--json]
//   ferry-bench demo            the main job of `make demo`: a short fabric sweep on shm
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tools/bench_fabric.h"

namespace {

void Usage() {
  std::fprintf(stderr,
               "usage: ferry-bench fabric [--provider P] [--max-bytes N] [--quick] [--json]\n"
               "       ferry-bench demo\n"
               "Provider from --provider, else FERRY_PROVIDER, else shm.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage();
    return 2;
  }
  std::string command = argv[1];
  ferry::bench::FabricBenchOptions o;
  if (const char* p = std::getenv("FERRY_PROVIDER")) o.provider = p;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--provider" && i + 1 < argc) {
      o.provider = argv[++i];
    } else if (a == "--max-bytes" && i + 1 < argc) {
      o.max_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--json") {
      o.json = true;
    } else {
      Usage();
      return 2;
    }
  }
  if (o.max_bytes < 1024) {
    std::fprintf(stderr, "--max-bytes must be at least 1024\n");
    return 2;
  }
  if (command == "fabric") return ferry::bench::RunFabricBench(o);
  if (command == "demo") {
    std::printf("== ferry demo: TransferEngine vs raw libfabric, %s provider ==\n",
                o.provider.c_str());
    o.quick = true;
    o.max_bytes = 16u << 20;
    return ferry::bench::RunFabricBench(o);
  }
  Usage();
  return 2;
}
