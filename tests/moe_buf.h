// A buffer an MoE test fills and checks on the host and, on the CUDA device, a GPU copy the
// steps use, moved across around each step. Tests built with FERRY_HAVE_CUDA=1 get the GPU
// half; the others run the host device only.
#pragma once

#include <vector>

#include "ferry/status.h"
#if FERRY_HAVE_CUDA
#include "moe_cuda_util.h"
#endif

namespace ferry {

template <typename T>
struct Buf {
  std::vector<T> host;
#if FERRY_HAVE_CUDA
  Gpu<T> gpu;
#endif
  bool cuda = false;
  Status Init(bool on_gpu, size_t n, T fill) {
    host.assign(n, fill);
    cuda = on_gpu;
#if FERRY_HAVE_CUDA
    if (cuda) return gpu.Alloc(n);
#endif
    return Status::Ok();
  }
  T* ptr() {
#if FERRY_HAVE_CUDA
    if (cuda) return gpu.p;
#endif
    return host.data();
  }
  Status Push() {
#if FERRY_HAVE_CUDA
    if (cuda) return gpu.Put(host);
#endif
    return Status::Ok();
  }
  Status Pull() {
#if FERRY_HAVE_CUDA
    if (cuda) return gpu.Get(host);
#endif
    return Status::Ok();
  }
};

}  // namespace ferry
