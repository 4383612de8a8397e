// The CUDA AllToAll's memory for the relay (moe/relay.h): the inbox and outbox in GPU memory the
// NIC reads and writes directly (GPUDirect RDMA, where the engine registers CUDA memory) or in
// pinned host memory the GPU maps (AllToAllConfig::rdma_buffers), the control block in pinned
// host memory, and the inbox flags the relay raises for the kernels (GpuWords: GPU memory behind
// GDRCopy where it is there, else mapped pinned host memory). Nothing here runs a kernel.
#pragma once

#include <memory>

#include "ferry/gpu_words.h"
#include "ferry/moe.h"
#include "moe/cuda/cuda_util.cuh"
#include "moe/cuda/pinned_buffer.h"
#include "moe/relay.h"

namespace ferry::moe {

class RelayBoxes {
 public:
  // Allocates and zeroes everything `relay` lays out, for configuration c (rdma_buffers,
  // cuda_device, cuda.relay_trace); `engine` is asked whether it registers GPU memory.
  Status Place(const AllToAllConfig& c, const RelayLayout& relay, TransferEngine* engine);

  // As the relay's CPU and the NIC use them (RelayBuffers::inbox_flags: the host's words).
  const RelayBuffers& host() const { return host_; }
  // As the kernels address them (device pointers; no inbox_flags: see device_flags).
  const RelayBuffers& mapped() const { return mapped_; }
  // [2N] the inbox flags as the kernels read them, dispatch then combine.
  uint64_t* device_flags() const { return flags_ ? flags_->device_words() : nullptr; }

  // For writes that never ended: they still read the outbox and may still fill the inbox.
  void Leak();

 private:
  // The inbox and outbox into host_: GPU memory unless rdma_buffers is kHost, when the engine
  // registers it (tried with the inbox) and the NIC's writes can be made visible to the kernels
  // before a flag goes up; else pinned host memory, or, for kDevice, why not.
  Status PlaceBoxes(const AllToAllConfig& c, const RelayLayout& relay, TransferEngine* engine);

  RelayBuffers host_, mapped_;
  PinnedBuffer inbox_, outbox_;                        // in host memory
  DeviceArray<uint8_t> device_inbox_, device_outbox_;  // or in GPU memory
  PinnedBuffer control_;
  std::unique_ptr<GpuWords> flags_;
};

}  // namespace ferry::moe
