// What the CUDA moe tests share: whether this machine has a GPU, device arrays, and a rank's
// GPU for its AllToAll.
#pragma once

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "ferry/status.h"

#define CUDA_OR_RETURN(expr)                                                               \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    CHECK_OR_RETURN(e_ == cudaSuccess, std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

namespace ferry {

inline bool HaveGpu() { return access("/dev/nvidia0", F_OK) == 0; }

template <typename T>
struct Gpu {
  T* p = nullptr;
  Gpu() = default;
  Gpu(const Gpu&) = delete;  // one owner frees
  Gpu& operator=(const Gpu&) = delete;
  Gpu(Gpu&& o) noexcept : p(std::exchange(o.p, nullptr)) {}
  Gpu& operator=(Gpu&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~Gpu() {
    if (p) cudaFree(p);
  }
  Status Alloc(size_t count) {
    CUDA_OR_RETURN(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    return Status::Ok();
  }
  // cudaMemcpy from pageable memory may return before its last bytes land, and the AllToAll's
  // kernels run on a stream that does not wait for the legacy one: synchronize first (without
  // it, CombineRecv with accumulate read the tail of a stale output now and then).
  Status Put(const std::vector<T>& v) {
    if (v.empty()) return Status::Ok();
    CUDA_OR_RETURN(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    CUDA_OR_RETURN(cudaDeviceSynchronize());
    return Status::Ok();
  }
  Status Get(std::vector<T>& v) const {
    if (!v.empty()) {
      CUDA_OR_RETURN(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return Status::Ok();
  }
};

// cfg on the CUDA device: rank r on GPU r mod count, made current.
inline Status UseGpu(Bootstrap& b, AllToAllConfig* cfg) {
  int gpus = 0;
  CUDA_OR_RETURN(cudaGetDeviceCount(&gpus));
  CHECK_OR_RETURN(gpus > 0, "no GPU");
  cfg->device = MoeDeviceKind::kCuda;
  cfg->cuda_device = b.rank() % gpus;
  CUDA_OR_RETURN(cudaSetDevice(cfg->cuda_device));
  return Status::Ok();
}

}  // namespace ferry
