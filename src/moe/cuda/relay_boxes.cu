#include "moe/cuda/relay_boxes.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <string>

namespace ferry::moe {
namespace {

// What makes a NIC's writes into GPU memory of `device` visible to its kernels once the CPU saw
// them land: nothing where the GPU orders them already (at least for itself), else
// cudaDeviceFlushGPUDirectRDMAWrites on the caller's thread; FailedPrecondition where it can do
// neither.
StatusOr<std::function<Status()>> LandedWritesFlush(int device) {
  int ordering = 0, options = 0;
  FERRY_CUDA(cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device));
  if (ordering >= cudaGPUDirectRDMAWritesOrderingOwner) return std::function<Status()>();
  FERRY_CUDA(cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device));
  if (!(options & cudaFlushGPUDirectRDMAWritesOptionHost)) {
    return FailedPreconditionError("CUDA device " + std::to_string(device) +
                                   " neither orders GPUDirect RDMA writes nor flushes them");
  }
  return std::function<Status()>([device]() -> Status {
    FERRY_CUDA(cudaSetDevice(device));
    FERRY_CUDA(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                  cudaFlushGPUDirectRDMAWritesToOwner));
    return Status::Ok();
  });
}

// The device address of mapped pinned host memory.
StatusOr<uint8_t*> MappedPointer(uint8_t* host) {
  void* p = nullptr;
  FERRY_CUDA(cudaHostGetDevicePointer(&p, host, 0));
  return static_cast<uint8_t*>(p);
}

}  // namespace

Status RelayBoxes::Place(const AllToAllConfig& c, const RelayLayout& relay,
                         TransferEngine* engine) {
  ASSIGN_OR_RETURN(control_, PinnedBuffer::Allocate(relay.control_bytes));
  host_.control = control_.data();
  ASSIGN_OR_RETURN(mapped_.control, MappedPointer(control_.data()));
  RETURN_IF_ERROR(PlaceBoxes(c, relay, engine));
  mapped_.inbox = host_.inbox;
  mapped_.outbox = host_.outbox;
  if (host_.boxes == MemoryKind::kHost) {
    ASSIGN_OR_RETURN(mapped_.inbox, MappedPointer(host_.inbox));
    ASSIGN_OR_RETURN(mapped_.outbox, MappedPointer(host_.outbox));
  }
  // The inbox flags: in our GPU's memory, written through GDRCopy, where it is there; else
  // pinned host memory mapped into the GPU (CudaTuning::gdrcopy false: always). GpuWords says
  // which.
  ASSIGN_OR_RETURN(flags_,
                   GpuWords::Create(c.cuda_device, 2 * size_t(c.world_size), c.cuda.gdrcopy));
  host_.inbox_flags = flags_->host_words();
  if (flags_->placement() != GpuWords::Placement::kGpuMemory && c.cuda.relay_trace) {
    std::fprintf(stderr, "[rank %d] relay: inbox flags in host memory: %s\n", c.rank,
                 flags_->gdrcopy_status().c_str());
  }
  return Status::Ok();
}

Status RelayBoxes::PlaceBoxes(const AllToAllConfig& c, const RelayLayout& relay,
                              TransferEngine* engine) {
  const bool trace = c.cuda.relay_trace;
  if (c.rdma_buffers != RdmaBuffers::kHost && engine) {
    std::function<Status()> flush;
    const Status placed = [&]() -> Status {
      RETURN_IF_ERROR(device_inbox_.Allocate(relay.inbox_bytes));
      RETURN_IF_ERROR(device_outbox_.Allocate(relay.outbox_bytes));
      FERRY_CUDA(cudaMemset(device_inbox_.get(), 0, relay.inbox_bytes));
      FERRY_CUDA(cudaMemset(device_outbox_.get(), 0, relay.outbox_bytes));
      // The probe's registration ends here; the relay makes its own.
      RETURN_IF_ERROR(engine
                          ->RegisterMemory(device_inbox_.get(), relay.inbox_bytes,
                                           MemoryKind::kCuda, c.cuda_device)
                          .status());
      ASSIGN_OR_RETURN(flush, LandedWritesFlush(c.cuda_device));
      return Status::Ok();
    }();
    if (placed.ok()) {
      host_.inbox = device_inbox_.get();
      host_.outbox = device_outbox_.get();
      host_.boxes = MemoryKind::kCuda;
      host_.device = c.cuda_device;
      host_.flush_landed = std::move(flush);
      if (trace) std::fprintf(stderr, "[rank %d] relay: buffers in GPU memory\n", c.rank);
      return Status::Ok();
    }
    device_inbox_.Free();
    device_outbox_.Free();
    if (c.rdma_buffers == RdmaBuffers::kDevice) {
      return placed.WithContext("AllToAll: rdma_buffers is kDevice, but the engine cannot "
                                "register GPU memory for the traffic between nodes");
    }
    if (trace) {
      std::fprintf(stderr, "[rank %d] relay: buffers in host memory: %s\n", c.rank,
                   placed.ToString().c_str());
    }
  }
  ASSIGN_OR_RETURN(inbox_, PinnedBuffer::Allocate(relay.inbox_bytes));
  ASSIGN_OR_RETURN(outbox_, PinnedBuffer::Allocate(relay.outbox_bytes));
  host_.inbox = inbox_.data();
  host_.outbox = outbox_.data();
  host_.boxes = MemoryKind::kHost;
  return Status::Ok();
}

void RelayBoxes::Leak() {
  inbox_.Leak();
  outbox_.Leak();
  device_inbox_.Leak();
  device_outbox_.Leak();
}

}  // namespace ferry::moe
