// GpuLayerCounter: a layer counter the model's CUDA stream increments (see kv.h).
#include <cuda_runtime.h>

#include <atomic>
#include <new>
#include <string>

#include "ferry/kv.h"

namespace ferry {
namespace {

// The kernels before this one on the stream have finished (a kernel starts after its
// predecessors end), so their writes precede this store; the fence orders it for the host. One
// stream is the counter's only writer: a plain read and write suffice.
__global__ void IncrementKernel(unsigned long long* counter) {
  __threadfence_system();
  volatile unsigned long long* c = counter;
  *c = *c + 1;
}

Status CudaError(const char* what, cudaError_t e) {
  return InternalError(std::string("GpuLayerCounter: ") + what + ": " + cudaGetErrorString(e));
}

class CudaLayerCounter final : public GpuLayerCounter {
 public:
  explicit CudaLayerCounter(void* word) : word_(word) {}
  ~CudaLayerCounter() override { cudaFreeHost(word_); }
  const std::atomic<uint64_t>* host() const override {
    return static_cast<const std::atomic<uint64_t>*>(word_);
  }
  Status Increment(void* cuda_stream) override {
    IncrementKernel<<<1, 1, 0, static_cast<cudaStream_t>(cuda_stream)>>>(
        static_cast<unsigned long long*>(word_));
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? Status::Ok() : CudaError("launching the increment", e);
  }

 private:
  void* word_;
};

}  // namespace

StatusOr<std::unique_ptr<GpuLayerCounter>> GpuLayerCounter::Create() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return FailedPreconditionError("GpuLayerCounter: no CUDA device");
  }
  static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
                "the counter is one lock-free 64-bit word shared with the GPU");
  void* word = nullptr;
  cudaError_t e = cudaHostAlloc(&word, 64, cudaHostAllocPortable | cudaHostAllocMapped);
  if (e != cudaSuccess) return CudaError("cudaHostAlloc", e);
  new (word) std::atomic<uint64_t>(0);
  return std::unique_ptr<GpuLayerCounter>(new CudaLayerCounter(word));
}

}  // namespace ferry
