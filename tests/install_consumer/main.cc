// Links against an installed ferry and uses its public API only.
#include <cstdio>

#include "ferry/fabric.h"

int main() {
  ferry::EngineOptions options;
  options.provider = "shm";
  auto engine = ferry::TransferEngine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  auto bad = ferry::RemoteRegion::Parse({});
  if (bad.ok()) return 1;
  std::printf("consumer: engine on %s, %zu-byte address\n", (*engine)->info().provider.c_str(),
              (*engine)->Address().size());
  return 0;
}
