// The host device: the four steps of dispatch and combine on the CPU, on host memory. It is the
// reference the CUDA kernels are checked against, and it speaks their protocol between nodes:
// it writes the counts rows and slots of moe/wire.h into the relay's outbox and reads its peers'
// from the relay's inbox (moe/relay.h), every other rank in a node of its own. So CI runs, over
// libfabric, what GPUs on several machines run.
//
// A device packs and unpacks; it never talks to the network. It raises the relay's outbox flags
// when a section is ready and waits on the inbox flags the relay raises as peers' sections land.
#pragma once

#include <memory>

#include "ferry/moe.h"
#include "moe/relay.h"

namespace ferry::moe {

// What a device works on: the relay's layout (node_ranks 1) and its buffers in host memory.
struct DeviceParams {
  AllToAllConfig config;
  const RelayLayout* layout = nullptr;
  RelayBuffers boxes;
  const Relay* relay = nullptr;  // null with one rank; once it fails, every wait reports why
};

// Thread safety: one caller thread, steps in order (the AllToAll enforces it).
class MoeDevice {
 public:
  virtual ~MoeDevice() = default;
  // Routes and packs: our counts row and slots for each rank into its outbox section (our own
  // aside), then raises the outbox's dispatch flag. Returns without waiting for the network.
  virtual Status DispatchSend(const DispatchInput& in, uint64_t epoch) = 0;
  // Waits for every sender's section, checks it (DataLoss for one no well-behaved peer sends),
  // unpacks into expert-major or token-major rows.
  virtual Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) = 0;
  // Packs expert outputs into the rows each sender expects back, then raises the outbox's
  // combine flag.
  virtual Status CombineSend(const CombineInput& in, uint64_t epoch) = 0;
  // Waits for every expert rank's rows, takes the weighted sums (out.weights, else the
  // dispatch's).
  virtual Status CombineRecv(const CombineOutput& out, uint64_t epoch, Deadline deadline) = 0;
  // OK, or the malformed section that ended this AllToAll (its epoch cannot be finished: its
  // combine rows would go to the wrong places); every later step reports it.
  virtual Status error() const = 0;
};

std::unique_ptr<MoeDevice> NewHostDevice(const DeviceParams& params);

}  // namespace ferry::moe
