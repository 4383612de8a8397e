// The CUDA device: the four steps of dispatch and combine as kernels, on one GPU.
//
// First form (this file): the RDMA buffers (send and receive regions) live in pinned host memory
// mapped into the GPU, the placement the lent H200 machine needs (its libfabric has no CUDA memory
// support, DESIGN.md §2.2); the kernels write and read them through the mapping and the proxy
// thread moves them over the engine exactly as for the host device. Each step launches its
// kernels on the device's stream and waits for them before it raises the proxy flag, so a step
// returns with its work done and its errors known (expert ids out of range, malformed slots).
// Not yet here: GPU-side flags for a capturable graph, the NVLink path, device-resident buffers.
//
// Results are bit-identical to the host device: slots, rows and positions are placed in the same
// order, and sums are taken in the same order with unfused fp32 multiply and add.
//
// This header compiles without CUDA; the implementation is in cuda_device.cu.
#pragma once

#include <cstddef>
#include <memory>

#include "moe/device.h"

namespace ferry::moe {

// Pinned host memory, mapped into every GPU (cudaHostAllocPortable | Mapped). Zeroed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  ~PinnedBuffer();
  static StatusOr<PinnedBuffer> Allocate(size_t bytes);
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Leaks the memory (a NIC may still read it).
  void Leak() { data_ = nullptr; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Number of CUDA devices this process sees; 0 without a driver or GPU.
int CudaDeviceCount();

// params.send and params.recv must be pinned (PinnedBuffer) memory.
StatusOr<std::unique_ptr<MoeDevice>> NewCudaDevice(const DeviceParams& params, int device);

}  // namespace ferry::moe
