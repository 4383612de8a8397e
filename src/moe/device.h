// MoeDevice: the compute side of dispatch and combine, one implementation per device kind.
//
// A device packs and unpacks; it never talks to the network. It tells the proxy what is ready
// through the Channel and waits on the proxy's flags. The host device (host/host_device.cc) does
// the four steps on the CPU and is the reference. (The CUDA device does not use this interface:
// its kernels and relay meet through flags in GPU-visible memory, cuda/nvlink_all_to_all.h.)
#pragma once

#include "ferry/moe.h"
#include "moe/channel.h"
#include "moe/layout.h"

namespace ferry::moe {

// What a device works on: the rank's registered buffers and the flags shared with its proxy.
struct DeviceParams {
  AllToAllConfig config;
  Channel* channel = nullptr;
  const Routing* routing = nullptr;  // valid from recv_ready until the next route_ready
  uint8_t* recv = nullptr;           // [layout.recv_bytes] receive region
  uint8_t* send = nullptr;           // [layout.send_bytes] send region
};

// Thread safety: one caller thread, steps in order (AllToAll enforces it).
class MoeDevice {
 public:
  virtual ~MoeDevice() = default;
  // Counts per expert into the send region (route-ready), packs slots grouped by receiving rank
  // (send-ready). Returns without waiting for the network.
  virtual Status DispatchSend(const DispatchInput& in, uint64_t epoch) = 0;
  // Waits for recv-ready, unpacks into expert-major rows, then signals recv-consumed.
  virtual Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) = 0;
  // Packs expert outputs grouped by the rank they return to (combine-ready).
  virtual Status CombineSend(const uint16_t* expert_out, uint64_t epoch) = 0;
  // Waits for combine-done, takes the weighted sums (out.weights, else the dispatch's), then
  // signals combine-consumed.
  virtual Status CombineRecv(const CombineOutput& out, uint64_t epoch, Deadline deadline) = 0;
};

std::unique_ptr<MoeDevice> NewHostDevice(const DeviceParams& params);

// Waits until flag > epoch, the proxy fails, or the deadline passes (DeadlineExceeded naming the
// flag and what it holds).
Status WaitForProxy(Channel& channel, const std::atomic<uint64_t>& flag, const char* name,
                    uint64_t epoch, Deadline deadline);

}  // namespace ferry::moe
