// GpuWords (ferry/gpu_words.h): GdrFlags where GDRCopy is there, else pinned host memory mapped
// into the GPU. Built with or without CUDA; without, Create says Unimplemented.
#include "ferry/gpu_words.h"

#include <atomic>
#include <string>

#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/gdr_flags.h"
#include "common/gpu_words_internal.h"
#endif

namespace ferry {

StatusOr<uint64_t> GpuWords::Load(size_t i) const {
  if (i >= size()) {
    return InvalidArgumentError("GpuWords::Load: word " + std::to_string(i) + " of " +
                                std::to_string(size()));
  }
  return std::atomic_ref<uint64_t>(host_words()[i]).load(std::memory_order_acquire);
}

#if FERRY_HAVE_CUDA
namespace {

Status CudaError(const char* what, cudaError_t e) {
  return InternalError(std::string("GpuWords: ") + what + ": " + cudaGetErrorString(e));
}

class CudaGpuWords final : public GpuWords {
 public:
  CudaGpuWords(int device, size_t count) : device_(device), count_(count) {}
  ~CudaGpuWords() override {
    if (pinned_) cudaFreeHost(pinned_);
  }

  size_t size() const override { return count_; }
  int cuda_device() const override { return device_; }
  Placement placement() const override {
    return gdr_ ? Placement::kGpuMemory : Placement::kMappedHost;
  }
  const std::string& gdrcopy_status() const override { return gdrcopy_status_; }
  uint64_t* host_words() const override { return gdr_ ? gdr_->host_words() : pinned_; }
  uint64_t* device_words() const override { return gdr_ ? gdr_->device_words() : mapped_; }

  // The words in GPU memory, written through `gdr`.
  void UseGdr(std::unique_ptr<GdrFlags> gdr) { gdr_ = std::move(gdr); }

  // In GPU memory through GDRCopy unless `not_asked` says why not to try; else (or where
  // GDRCopy fails) in mapped host memory.
  Status Place(std::string not_asked) {
    if (not_asked.empty()) {
      auto gdr = GdrFlags::Open(count_, device_);
      if (gdr.ok()) {
        UseGdr(std::move(gdr).value());
        return Status::Ok();
      }
      gdrcopy_status_ = gdr.status().ToString();
    } else {
      gdrcopy_status_ = std::move(not_asked);
    }
    void* p = nullptr;
    // Portable: mapped into every GPU, so the pointer serves whichever device the caller's
    // current one is when it frees us.
    cudaError_t e =
        cudaHostAlloc(&p, count_ * sizeof(uint64_t), cudaHostAllocPortable | cudaHostAllocMapped);
    if (e != cudaSuccess) return CudaError("cudaHostAlloc", e);
    pinned_ = static_cast<uint64_t*>(p);
    for (size_t i = 0; i < count_; ++i) {
      std::atomic_ref<uint64_t>(pinned_[i]).store(0, std::memory_order_relaxed);
    }
    void* mapped = nullptr;
    if ((e = cudaHostGetDevicePointer(&mapped, p, 0)) != cudaSuccess) {
      return CudaError("cudaHostGetDevicePointer", e);
    }
    mapped_ = static_cast<uint64_t*>(mapped);
    return Status::Ok();
  }

 private:
  const int device_;
  const size_t count_;
  std::unique_ptr<GdrFlags> gdr_;
  uint64_t* pinned_ = nullptr;
  uint64_t* mapped_ = nullptr;
  std::string gdrcopy_status_;
};

}  // namespace

std::unique_ptr<GpuWords> GpuWordsOver(std::unique_ptr<GdrFlags> gdr, int cuda_device,
                                       size_t count) {
  auto words = std::make_unique<CudaGpuWords>(cuda_device, count);
  words->UseGdr(std::move(gdr));
  return words;
}

StatusOr<std::unique_ptr<GpuWords>> GpuWords::Create(int cuda_device, size_t count, bool gdrcopy) {
  if (count == 0 || count > kMaxWords) {
    return InvalidArgumentError("GpuWords: " + std::to_string(count) + " words (1 to " +
                                std::to_string(kMaxWords) + ")");
  }
  if (cuda_device < 0) {
    return InvalidArgumentError("GpuWords: CUDA device " + std::to_string(cuda_device));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return FailedPreconditionError("GpuWords: no CUDA device");
  }
  if (cuda_device >= devices) {
    return InvalidArgumentError("GpuWords: CUDA device " + std::to_string(cuda_device) + " of " +
                                std::to_string(devices));
  }
  // GdrFlags and the host allocation run on the caller's thread: keep its current device.
  int current = 0;
  cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess) return CudaError("cudaGetDevice", e);
  auto words = std::make_unique<CudaGpuWords>(cuda_device, count);
  Status placed = words->Place(gdrcopy ? "" : "GDRCopy not asked for");
  cudaSetDevice(current);
  RETURN_IF_ERROR(placed);
  return std::unique_ptr<GpuWords>(std::move(words));
}

#else

StatusOr<std::unique_ptr<GpuWords>> GpuWords::Create(int, size_t, bool) {
  return UnimplementedError("GpuWords: ferry was built without CUDA");
}

#endif

}  // namespace ferry
