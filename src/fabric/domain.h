// Domain: the internal interface every NIC backend implements (libfabric and libibverbs).
//
// A Domain is one NIC: its endpoint, completion queue, address vector and memory registrations.
// It knows nothing of transfers, pages or immediates' meaning; the engine's worker is its only
// caller once the engine is running (the provider is opened with FI_THREAD_DOMAIN), so no method
// locks. Post* and Poll are the hot path: no allocation, no logging, errors only as Status on the
// failure path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/fabric.h"
#include "ferry/status.h"

namespace ferry::fabric {

// Scratch space each posted operation lends the backend (libfabric's fi_context2 under
// FI_CONTEXT/FI_CONTEXT2 modes). The engine embeds it first in its own per-operation records.
struct OpContext {
  alignas(16) unsigned char provider_scratch[64];
};

inline constexpr uint64_t kNoPeerAddr = ~uint64_t{0};

enum class CompletionKind : uint8_t {
  kLocal,      // one of our posted writes or sends finished (or failed)
  kRecv,       // a message landed in one of our receive buffers (or the receive failed)
  kRemoteImm,  // a peer's write carrying an immediate landed in our memory
  kPeerGone,   // the peer at src_addr removed us (verbs: its goodbye): its connection is over
};

struct DomainCompletion {
  CompletionKind kind = CompletionKind::kLocal;
  bool has_imm = false;
  uint32_t imm = 0;
  OpContext* context = nullptr;  // kLocal, kRecv: the context given at post; else null
  uint64_t length = 0;           // kRecv: bytes received
  uint64_t src_addr = kNoPeerAddr;
  Status error;                  // not OK: the operation failed, with the provider's message
};

struct WriteWr {
  const void* local = nullptr;  // null with length 0: an immediate alone
  uint64_t length = 0;
  void* local_desc = nullptr;
  uint64_t peer_addr = 0;
  uint64_t remote_addr = 0;  // provider address: region base + offset
  uint64_t key = 0;
  bool has_imm = false;
  uint32_t imm = 0;
  // Complete only once the bytes are in the target's memory (FI_DELIVERY_COMPLETE), not when
  // they left: a write whose completion lets an immediate go out on another NIC needs it (a
  // NIC's own immediate follows its bytes on the same, ordered connection).
  bool deliver = false;
  OpContext* context = nullptr;
};

enum class PostResult : uint8_t {
  kPosted,
  kAgain,  // the provider's queue is full: poll completions, then post again
  kError,
};

struct Registration {
  void* handle = nullptr;  // backend-owned; pass back to Deregister
  void* local_desc = nullptr;
  uint64_t base = 0;  // what a peer adds offsets to
  uint64_t key = 0;
};

// What the engine needs of a NIC, as its backend reports it in ferry's terms. The FabricInfo a
// backend gives beside it is for logs: libfabric's own facts (its mr_mode bits and the like),
// which other backends leave unset.
struct DomainCaps {
  std::string provider;              // what peers of one engine must all speak
  std::string name;                  // the NIC's domain name
  uint64_t max_msg_bytes = 0;        // the most one write or message work request carries
  size_t send_depth = 0;             // work requests the send queue holds (0: not said)
  size_t recv_depth = 0;             // receives the receive queue holds (0: not said)
  uint64_t ordered_write_bytes = 0;  // as FabricInfo::ordered_write_bytes
};

class Domain {
 public:
  virtual ~Domain() = default;

  virtual const DomainCaps& caps() const = 0;
  virtual const FabricInfo& info() const = 0;  // for logs
  virtual std::vector<uint8_t> Name() const = 0;

  virtual StatusOr<uint64_t> InsertPeer(std::span<const uint8_t> name) = 0;
  virtual Status RemovePeer(uint64_t peer_addr) = 0;

  virtual StatusOr<Registration> Register(void* data, uint64_t length, MemoryKind kind,
                                          int device) = 0;
  virtual void Deregister(void* handle) = 0;

  virtual PostResult PostWrite(const WriteWr& wr, Status* error) = 0;
  virtual PostResult PostSend(const void* data, uint64_t length, void* local_desc,
                              uint64_t peer_addr, OpContext* context, Status* error) = 0;
  virtual PostResult PostRecv(void* data, uint64_t length, void* local_desc, OpContext* context,
                              Status* error) = 0;
  // Fills up to out.size() completions; returns how many.
  virtual size_t Poll(std::span<DomainCompletion> out) = 0;
};

// Opens the libfabric provider named in options (or the first available of efa, shm), on the
// named domain (NIC) or, when `domain` is empty, the provider's first.
StatusOr<std::unique_ptr<Domain>> OpenLibfabricDomain(const EngineOptions& options,
                                                      const std::string& domain);

// The distinct domain (NIC) names a provider offers, in fi_getinfo's order; empty if none.
std::vector<std::string> ListLibfabricDomains(const std::string& provider);

}  // namespace ferry::fabric
