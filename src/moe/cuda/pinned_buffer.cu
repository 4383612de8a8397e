#include "moe/cuda/pinned_buffer.h"

#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <utility>

#include "moe/cuda/cuda_util.cuh"

namespace ferry::moe {

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFreeHost(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer b;
  void* p = nullptr;
  FERRY_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  std::memset(p, 0, bytes);
  b.data_ = static_cast<uint8_t*>(p);
  b.size_ = bytes;
  StatusOr<PinnedBuffer> out(std::move(b));  // nvcc's front end does not move implicitly
  return out;
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace ferry::moe
