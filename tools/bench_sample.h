// What a long run samples of each process, to hold it flat: resident memory (and the private
// part of it), open descriptors, the engine's peer table (ferry-bench soak and elastic).
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

#include "ferry/fabric.h"

namespace ferry::bench {

struct Sample {
  double rss_mib = 0;
  // Resident memory less the file and shared-memory pages in it: what this process holds of
  // its own. The shared part follows the peers the shm provider maps (up and down as they come
  // and go), so it is reported but not held flat.
  double private_mib = 0;
  int64_t fds = 0;
  int64_t peers = 0, peer_entries = 0;
};

// This process's sample now (the engine's peer table where it has one).
inline Sample Take(const TransferEngine* engine) {
  Sample s;
  long pages = 0, resident = 0, shared = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld %ld", &pages, &resident, &shared) != 3) resident = 0;
    std::fclose(f);
  }
  const double page_mib = double(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
  s.rss_mib = double(resident) * page_mib;
  s.private_mib = double(resident - shared) * page_mib;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) s.fds += e->d_name[0] != '.';
    closedir(d);
    --s.fds;  // the directory's own descriptor
  }
  if (engine) {
    const EngineStats st = engine->stats();
    s.peers = int64_t(st.peers);
    s.peer_entries = int64_t(st.peer_entries);
  }
  return s;
}

}  // namespace ferry::bench
