// CreateCudaDevice (and node-once's CUDA HopMemory) where ferry was built without CUDA (no nvcc): the host device is the one there
// is, and a CUDA configuration says so instead of failing at link time.
#include "moe/device.h"
#include "moe/node_once.h"

namespace ferry::moe {

StatusOr<std::unique_ptr<MoeDevice>> CreateCudaDevice(const AllToAllConfig&, TransferEngine*,
                                                      Bootstrap&, const Hearing*, uint64_t, bool) {
  return UnimplementedError("AllToAll: ferry was built without CUDA; use the host device");
}

StatusOr<std::unique_ptr<HopMemory>> NewCudaHopMemory(int) {
  return UnimplementedError("AllToAll: ferry was built without CUDA; use the host device");
}

}  // namespace ferry::moe

namespace ferry {
bool CudaDeviceBuilt() { return false; }
}  // namespace ferry
