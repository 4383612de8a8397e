// KvCudaShards: each rank's cache from SharedCudaMemory; the leader imports them all.
#include <cuda_runtime.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common/cuda_shared_memory.h"
#include "common/fd_exchange.h"
#include "ferry/kv.h"
#include "kv/shards_args.h"

namespace ferry {
namespace {

class CudaShards final : public KvCudaShards {
 public:
  Status Init(Bootstrap& bootstrap, int leader, int cuda_device, int64_t bytes,
              std::chrono::milliseconds timeout) {
    const int n = bootstrap.world_size(), me = bootstrap.rank();
    int fd = -1;
    RETURN_IF_ERROR(memory_.Create(cuda_device, bytes, &fd));
    std::vector<int> members(n);
    for (int r = 0; r < n; ++r) members[r] = r;
    auto fds = ExchangeFds(bootstrap, members, fd, timeout);
    close(fd);
    RETURN_IF_ERROR(fds.status());
    Status imported = Status::Ok();
    for (int r = 0; r < n; ++r) {
      if (me == leader && imported.ok()) {
        if (r == me) {
          view_.push_back(memory_.own());
        } else {
          auto ptr = memory_.Import((*fds)[r]);
          if (ptr.ok()) view_.push_back(*ptr); else imported = ptr.status();
        }
      }
      close((*fds)[r]);
    }
    RETURN_IF_ERROR(imported);
    // Every cache is zeroed and, on the leader, mapped before anyone uses it.
    return bootstrap.Barrier(timeout);
  }

  void* local() const override { return memory_.own(); }
  std::span<void* const> leader_view() const override { return view_; }

 private:
  SharedCudaMemory memory_;
  std::vector<void*> view_;
};

}  // namespace

StatusOr<std::unique_ptr<KvCudaShards>> KvCudaShards::Create(Bootstrap& bootstrap, int leader,
                                                             int cuda_device, int64_t bytes,
                                                             std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(CheckCudaShardsArgs(bootstrap, leader, bytes));
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return FailedPreconditionError("KvCudaShards: no CUDA device");
  }
  if (cuda_device < 0 || cuda_device >= devices) {
    return FailedPreconditionError("KvCudaShards: CUDA device " + std::to_string(cuda_device) +
                                   " does not exist (" + std::to_string(devices) + " visible)");
  }
  auto shards = std::make_unique<CudaShards>();
  RETURN_IF_ERROR(shards->Init(bootstrap, leader, cuda_device, bytes, timeout));
  return std::unique_ptr<KvCudaShards>(std::move(shards));
}

}  // namespace ferry
