// GPU memory shared between the processes of a node: one allocation per process from
// cuMemCreate, exportable as a POSIX file descriptor (send it with ExchangeFds), which the others
// import and map into their own address space. Used by the moe NVLink path (every rank maps
// every peer) and by the kv leader (one process maps every TP rank's cache).
//
// The driver's calls are found at run time through the CUDA runtime, so nothing links against
// libcuda. This header compiles without CUDA; the implementation is a .cu file and exists only
// in CUDA builds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ferry/status.h"

namespace ferry {

// Thread safety: none; one owner. Destruction unmaps the imports and releases the allocation
// (a peer that imported it keeps the memory alive until it unmaps too).
class SharedCudaMemory {
 public:
  SharedCudaMemory() = default;
  SharedCudaMemory(const SharedCudaMemory&) = delete;
  SharedCudaMemory& operator=(const SharedCudaMemory&) = delete;
  ~SharedCudaMemory();

  // Our allocation of at least `bytes` on `device`, zeroed, mapped for `device`; its descriptor
  // in *fd (the caller closes it).
  Status Create(int device, int64_t bytes, int* fd);
  // Maps another process's allocation (from its descriptor, which stays the caller's to close)
  // for our device. The allocation must be as large as ours (peers of one kind agree on sizes).
  StatusOr<uint8_t*> Import(int fd);

  uint8_t* own() const { return maps_.empty() ? nullptr : reinterpret_cast<uint8_t*>(maps_[0].ptr); }
  size_t size() const { return size_; }

 private:
  struct Mapping {
    uint64_t handle;  // CUmemGenericAllocationHandle
    uint64_t ptr;     // CUdeviceptr, 0 until mapped
  };
  StatusOr<uint64_t> Map(uint64_t handle);

  int device_ = 0;
  size_t size_ = 0;
  std::vector<Mapping> maps_;  // ours first
};

}  // namespace ferry
