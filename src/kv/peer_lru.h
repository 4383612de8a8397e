// The peers one side of the KV messenger added to its engine, by last use. Over a long life the
// other side comes and goes (each restart is a new engine), so the engine's peer table
// (EngineOptions::max_peers) fills: AddMakingRoom then removes the least recently used peer no
// request still needs, until the new one fits. The removed peer adds us again when it next
// needs us (over verbs it hears our goodbye first). Not thread-safe: the owner's lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include "ferry/fabric.h"

namespace ferry::kv {

class PeerLru {
 public:
  void Touch(PeerId peer) { use_[peer] = ++clock_; }
  void Forget(PeerId peer) { use_.erase(peer); }

  // engine.AddPeer(address); while the table is full, the least recently used peer outside
  // busy() leaves the engine (and this list: `evicted` hears of each) and AddPeer is tried
  // again. ResourceExhausted when every peer is busy. The peer added is touched.
  StatusOr<PeerId> AddMakingRoom(TransferEngine& engine, std::span<const uint8_t> address,
                                 const std::function<std::vector<PeerId>()>& busy,
                                 const std::function<void(PeerId)>& evicted = {}) {
    StatusOr<PeerId> peer = engine.AddPeer(address);
    std::vector<PeerId> needed;
    bool asked = false;
    while (peer.status().code() == StatusCode::kResourceExhausted) {
      if (!asked) needed = busy();
      asked = true;
      auto victim = use_.end();
      for (auto it = use_.begin(); it != use_.end(); ++it) {
        if (std::find(needed.begin(), needed.end(), it->first) != needed.end()) continue;
        if (victim == use_.end() || it->second < victim->second) victim = it;
      }
      if (victim == use_.end()) break;
      const PeerId gone = victim->first;
      use_.erase(victim);
      // A no-op for one the engine already let go (it frees no entry: the loop goes on).
      (void)engine.RemovePeer(gone);
      if (evicted) evicted(gone);
      peer = engine.AddPeer(address);
    }
    if (peer.ok()) Touch(*peer);
    return peer;
  }

 private:
  std::unordered_map<PeerId, uint64_t> use_;
  uint64_t clock_ = 0;
};

}  // namespace ferry::kv
