// Node-once's HopMemory on the CUDA device (moe/node_once.h): the middle buffers in GPU memory,
// the wait costs' bookkeeping as work on the hops' stream, so that an epoch's steps enqueue
// without a host wait and capture into CUDA graphs.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <vector>

#include "moe/cuda/cuda_util.cuh"
#include "moe/node_once.h"

namespace ferry::moe {
namespace {

__global__ void AddStridedKernel(int64_t* out, const int64_t* in, int n, int stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[int64_t{i} * stride] += in[i];
}

// HopMemory::Narrow: out[i] = round(out[i] (with accumulate) + sums[i]) for the first n rows,
// n read from device_rows where given; each element one addition and one rounding, as the host
// device's.
namespace combine {
__global__ void NarrowKernel(uint16_t* out, const float* sums, int64_t width, int64_t rows,
                             const int32_t* device_rows, bool fp16, bool accumulate) {
  const int64_t n =
      (device_rows ? std::min<int64_t>(std::max(*device_rows, 0), rows) : rows) * width;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float prev = 0.0f;
    if (accumulate) prev = fp16 ? __half2float(__ushort_as_half(out[i])) : Bf16ToFloatD(out[i]);
    const float sum = prev + sums[i];
    out[i] = fp16 ? __half_as_ushort(__float2half_rn(sum)) : FloatToBf16D(sum);
  }
}
}  // namespace combine

class CudaHops final : public HopMemory {
 public:
  explicit CudaHops(int device) : device_(device) {}
  ~CudaHops() override {
    cudaSetDevice(device_);
    for (void* p : blocks_) cudaFree(p);  // waits for the device: steps may still read them
    for (cudaEvent_t e : stamps_) {
      if (e) cudaEventDestroy(e);
    }
    if (own_) cudaStreamDestroy(own_);
  }

  Status Open() {
    FERRY_CUDA(cudaSetDevice(device_));
    FERRY_CUDA(cudaStreamCreateWithFlags(&own_, cudaStreamNonBlocking));
    stream_ = own_;
    return Status::Ok();
  }

  StatusOr<uint8_t*> Allocate(int64_t bytes) override {
    FERRY_CUDA(cudaSetDevice(device_));
    void* p = nullptr;
    FERRY_CUDA(cudaMalloc(&p, size_t(std::max<int64_t>(bytes, 1))));
    blocks_.push_back(p);
    FERRY_CUDA(cudaMemset(p, 0, size_t(std::max<int64_t>(bytes, 1))));
    return static_cast<uint8_t*>(p);
  }

  Status SetStream(void* stream) override {
    stream_ = stream ? static_cast<cudaStream_t>(stream) : own_;
    return Status::Ok();
  }

  Status Zero(int64_t* p, int n) override {
    FERRY_CUDA(cudaSetDevice(device_));
    FERRY_CUDA(cudaMemsetAsync(p, 0, size_t(n) * sizeof(int64_t), stream_));
    return Done();
  }

  Status AddStrided(int64_t* out, const int64_t* in, int n, int stride) override {
    FERRY_CUDA(cudaSetDevice(device_));
    AddStridedKernel<<<(n + 127) / 128, 128, 0, stream_>>>(out, in, n, stride);
    FERRY_CUDA(cudaGetLastError());
    return Done();
  }

  Status CopyRows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                  int64_t width, int64_t rows) override {
    FERRY_CUDA(cudaSetDevice(device_));
    FERRY_CUDA(cudaMemcpy2DAsync(dst, size_t(dst_pitch), src, size_t(src_pitch), size_t(width),
                                 size_t(rows), cudaMemcpyDeviceToDevice, stream_));
    return Done();
  }

  Status Narrow(void* out, const float* sums, int64_t width, int64_t rows,
                const int32_t* device_rows, bool fp16, bool accumulate) override {
    FERRY_CUDA(cudaSetDevice(device_));
    const int64_t blocks = std::min<int64_t>((rows * width + 255) / 256, 1024);
    if (blocks > 0) {
      combine::NarrowKernel<<<int(blocks), 256, 0, stream_>>>(static_cast<uint16_t*>(out), sums, width,
                                                      rows, device_rows, fp16, accumulate);
      FERRY_CUDA(cudaGetLastError());
    }
    return Done();
  }

  // Captured, the record is an event node of the graph (cudaEventRecordExternal), recorded at
  // each replay.
  Status Stamp(int point) override {
    FERRY_CUDA(cudaSetDevice(device_));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FERRY_CUDA(cudaStreamIsCapturing(stream_, &capture));
    cudaEvent_t& e = stamps_[size_t(point)];
    if (!e) FERRY_CUDA(cudaEventCreate(&e));
    FERRY_CUDA(cudaEventRecordWithFlags(
        e, stream_, capture == cudaStreamCaptureStatusNone ? 0 : cudaEventRecordExternal));
    return Done();
  }
  StatusOr<double> Elapsed(int a, int b) override {
    FERRY_CUDA(cudaSetDevice(device_));
    FERRY_CUDA(cudaEventSynchronize(stamps_[size_t(b)]));
    float ms = 0;
    FERRY_CUDA(cudaEventElapsedTime(&ms, stamps_[size_t(a)], stamps_[size_t(b)]));
    return double{ms} * 1e3;
  }

 private:
  // Without a caller's stream every call waits for its work, as the hops' steps then do.
  Status Done() {
    if (stream_ == own_) FERRY_CUDA(cudaStreamSynchronize(own_));
    return Status::Ok();
  }

  const int device_;
  cudaStream_t own_ = nullptr, stream_ = nullptr;
  std::vector<void*> blocks_;
  std::array<cudaEvent_t, kHopPoints> stamps_{};
};

}  // namespace

StatusOr<std::unique_ptr<HopMemory>> NewCudaHopMemory(int cuda_device) {
  auto hops = std::make_unique<CudaHops>(cuda_device);
  RETURN_IF_ERROR(hops->Open());
  return std::unique_ptr<HopMemory>(std::move(hops));
}

}  // namespace ferry::moe
