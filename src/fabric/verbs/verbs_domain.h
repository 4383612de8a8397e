// VerbsDomain: the Domain of one ConnectX NIC over libibverbs (through VerbsApi).
//
// Per domain: a protection domain, one completion queue, a UD queue pair for handshakes, and two
// shared receive queues: one holds the engine's message buffers, the other zero-length receives
// that WRITE_WITH_IMM consumes. Per peer: two RC queue pairs, one for SEND/RECV (on the message
// SRQ), one for RDMA writes (on the immediate SRQ).
//
// Connecting is asynchronous, so AddPeer never waits for the other side: InsertPeer creates the
// peer's queue pairs (INIT) and sends our handshake to the peer's UD queue pair; Poll re-sends it
// until the peer's handshake arrives and says it holds ours, then moves both queue pairs to RTR
// and RTS. Until then posts to that peer answer kAgain; the engine retries them within the
// transfer deadline. A handshake from a peer we were not given connects at once (its hello
// carries its whole UD address): what it sends arrives before our engine adds it (KvPrefill
// adds a decoder on its first request), and InsertPeer of that peer then claims the connection.
// Each connection a domain makes carries a larger incarnation than the last: a peer that lost
// us and adds us again sends a newer one, and we move our side over to it (Reconnect: the old
// queue pairs to the error state, new ones connected to its), keeping the peer's address; a
// late handshake of an older connection is ignored.
//
// Posts are chained: PostWrite/PostSend link WRs per queue pair and Poll rings the doorbell once
// per chain (or sooner when a chain fills). A WR the device refuses completes with the error.
#pragma once

#include <memory>
#include <string>

#include "fabric/domain.h"
#include "fabric/verbs/verbs_api.h"
#include "fabric/verbs/verbs_logic.h"

namespace ferry::fabric::verbs {

// The address a verbs domain publishes (Domain::Name): where its UD queue pair listens.
struct UdAddress {
  uint64_t token = 0;
  ibv_gid gid{};
  uint16_t lid = 0;
  uint8_t port = 1;
  uint32_t qpn = 0;

  std::vector<uint8_t> Serialize() const;
  static StatusOr<UdAddress> Parse(std::span<const uint8_t> bytes);
};

// Opens `device` (empty: the first) through `api`. Unavailable ("no RDMA device found") where
// there is none.
StatusOr<std::unique_ptr<Domain>> OpenVerbsDomain(const EngineOptions& options,
                                                  const std::string& device,
                                                  std::shared_ptr<VerbsApi> api,
                                                  const VerbsConfig& config);

}  // namespace ferry::fabric::verbs
