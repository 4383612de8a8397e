// Pinned host memory the GPU maps, and how many GPUs there are: what the CUDA AllToAll needs
// from the runtime outside its kernels. Compiles without CUDA; the implementation is in
// pinned_buffer.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/status.h"

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

}  // namespace ferry::moe
