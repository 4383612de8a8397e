// Proxy: one thread per rank that runs the network side of dispatch and combine over the
// TransferEngine, driven by the device's flags (docs/DESIGN.md §2.2):
//
//   dispatch: wait route-ready -> peers done with our last writes -> counts to every peer
//             (scatter) -> wait send-ready -> private writes (scatter) -> wait every peer's
//             counts -> offsets -> overflow writes (scatter) -> wait the immediates of what
//             lands here and our own writes -> recv-ready -> wait recv-consumed -> barrier
//   combine:  wait combine-ready -> peers done with our last combine -> one write per peer
//             (scatter) -> wait their immediates and our writes -> combine-done -> wait
//             combine-consumed -> barrier
//
// Immediates carry a kind and the epoch mod 4 (a rank is at most one iteration ahead of any
// other, so this never aliases). A failure (a peer lost, a deadline) is posted to the channel
// and ends the thread; the device's next step reports it.
//
// Thread safety: constructed and destroyed by the AllToAll's thread; its own thread touches the
// engine, the send and receive regions' network side, and the Routing it publishes.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "ferry/fabric.h"
#include "ferry/immediates.h"
#include "ferry/moe.h"
#include "moe/channel.h"
#include "moe/layout.h"
#include "moe/own_writes.h"

namespace ferry::moe {

enum ImmKind : uint32_t {
  kCounts = 1,
  kPrivate = 2,
  kOverflow = 3,
  kCombine = 4,
  kDispatchConsumed = 5,
  kCombineConsumed = 6,
  kRelayDispatch = 7,  // the relay of the NVLink AllToAll (relay.h): a counts row and its slots
  kRelayCombine = 8,   // combine rows
};
// The AllToAll range of ferry/immediates.h: the epoch, the kind, the AllToAll's instance
// (AllToAllConfig::instance: AllToAlls on one engine count apart) in the fields it lays out.
inline constexpr uint32_t kImmBase = imm::kMoe.first;
inline constexpr uint32_t kEpochs = 1u << imm::kMoeEpochBits;
static_assert(kRelayCombine < (1u << imm::kMoeKindBits), "the kind has four bits");
static_assert(AllToAllConfig::kMaxInstances <= (1 << imm::kMoeInstanceBits),
              "the instance has four bits");
static_assert(AllToAllConfig::kMaxWorldSize <= (1 << imm::kMoeSenderBits),
              "the sender has sixteen bits");
inline uint32_t MoeImm(ImmKind kind, uint64_t epoch, int instance) {
  return kImmBase | static_cast<uint32_t>(instance) << imm::kMoeInstanceShift |
         (uint32_t{kind} << imm::kMoeKindShift) | static_cast<uint32_t>(epoch % kEpochs);
}
// The relay's immediates also carry the sending rank.
inline uint32_t RelayImm(ImmKind kind, uint64_t epoch, int instance, int sender) {
  return MoeImm(kind, epoch, instance) | static_cast<uint32_t>(sender) << imm::kMoeSenderShift;
}

// Why an AllToAll could not create one of its immediate counters: AlreadyExists naming the
// instance when another AllToAll on the engine has it; else the engine's reason.
inline Status CounterError(const Status& s, int instance) {
  if (s.code() != StatusCode::kAlreadyExists) return s.WithContext("AllToAll: immediate counter");
  return AlreadyExistsError("AllToAll: instance " + std::to_string(instance) +
                            " is taken on this engine (an AllToAll's immediate counters outlive "
                            "it): give each AllToAll on one engine an instance of its own");
}

struct ProxyParams {
  AllToAllConfig config;
  TransferEngine* engine = nullptr;
  Channel* channel = nullptr;
  Routing* routing = nullptr;  // published to the device with recv_ready
  uint8_t* recv = nullptr;     // [layout.recv_bytes] the registered receive region
  uint8_t* send = nullptr;     // [layout.send_bytes] the registered send region
  GroupId group = 0;           // every other rank, in rank order
  ScatterPlanId plan = 0;      // send region -> each member's receive region
  uint32_t peer_timeout_ms = 60000;  // how long to wait for a peer before failing
};

class Proxy {
 public:
  explicit Proxy(const ProxyParams& params);
  ~Proxy();  // Quiesce()

  // Stops the thread, then waits for the writes it posted. False if some never ended: then
  // their targets are leaked on purpose and the send region must be too (OwnWrites::Drain).
  bool Quiesce();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Bytes the last epoch put on the wire (payload and metadata), dispatch and combine.
  uint64_t dispatch_bytes() const { return dispatch_bytes_.load(std::memory_order_relaxed); }
  uint64_t combine_bytes() const { return combine_bytes_.load(std::memory_order_relaxed); }

 private:
  void Main();
  Status Dispatch(uint64_t epoch);
  Status Combine(uint64_t epoch);
  // Waits (without deadline: the device may idle between iterations) until flag > epoch.
  Status WaitDevice(const std::atomic<uint64_t>& flag, uint64_t epoch);
  Status AwaitPeers(ImmKind kind, uint64_t epoch, uint64_t count);
  Status Post(ImmKind kind, uint64_t epoch);  // targets_ as one scatter
  Status Barrier(ImmKind kind, uint64_t epoch);
  Status WaitOwnWrites();
  uint32_t Member(int rank) const {
    return static_cast<uint32_t>(rank < p_.config.rank ? rank : rank - 1);
  }

  const ProxyParams p_;
  const MoeLayout layout_;
  std::vector<ScatterTarget> targets_;  // reused; valid until WaitOwnWrites
  std::vector<std::vector<ScatterTarget>> posted_;
  OwnWrites writes_;
  std::atomic<uint64_t> dispatch_bytes_{0}, combine_bytes_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace ferry::moe
