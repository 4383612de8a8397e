// ferry GpuWords: 64-bit words the host writes and CUDA kernels poll -- the GPU-visible flag an
// immediate counter can keep (TransferEngine::MirrorImm), so that a kernel waits for a transfer's
// arrival itself, or any flag of a caller's own.
//
// Where GDRCopy is there (/dev/gdrdrv and libgdrapi, loaded at run time) the words live in the
// GPU's own memory and the host writes them through GDRCopy's mapping of it: a kernel's poll
// stays in its GPU, and each host store crosses PCIe once. Elsewhere -- or with gdrcopy = false
// (the MoE relay's CudaTuning::gdrcopy, FERRY_GDRCOPY=0) -- they live in pinned host memory
// mapped into the GPU: the host's store is a local one and each of a kernel's polls a read
// across PCIe (about a microsecond). Poll a word
// from one thread and let it tell the others (shared memory, a barrier): more pollers of one
// mapped word make its arrival slower to see, not faster (`ferry-bench mirror`; one H200 host,
// shm: the round trip 4.1 us polled by one warp, 7.3 by four, 18.8 by sixteen).
//
// Memory ordering. The host stores with release ordering, then fences
// (std::atomic_thread_fence(std::memory_order_seq_cst)): GDRCopy's mapping is write-combining,
// and a store there may linger in the CPU until a fence. MirrorImm does both. A kernel reads the
// word volatile (or ld.acquire.sys) and, once it holds the value awaited, runs
// __threadfence_system() before it reads what the value announces.
//
// Thread safety: fixed once created; any thread may call any method. Destroy it after whatever
// writes the words (MirrorImm(imm, nullptr) first) and after the kernels that read them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ferry/export.h"
#include "ferry/status.h"

namespace ferry {

class FERRY_API GpuWords {
 public:
  enum class Placement : uint8_t {
    kGpuMemory,  // the GPU's memory, written through GDRCopy's mapping
    kMappedHost  // pinned host memory mapped into the GPU
  };
  static constexpr size_t kMaxWords = 8192;  // one 64 KiB GPU page

  // `count` (1 to kMaxWords) zeroed words for kernels on CUDA device `cuda_device`; gdrcopy =
  // false keeps them in host memory. InvalidArgument for a count or device out of range;
  // FailedPrecondition without a GPU; Unimplemented where ferry was built without CUDA.
  static StatusOr<std::unique_ptr<GpuWords>> Create(int cuda_device, size_t count,
                                                    bool gdrcopy = true);
  virtual ~GpuWords() = default;

  virtual size_t size() const = 0;
  virtual int cuda_device() const = 0;
  virtual Placement placement() const = 0;
  // Why the words are not in the GPU's memory (GDRCopy's reason, or that it was not asked for);
  // empty when they are.
  virtual const std::string& gdrcopy_status() const = 0;
  // The words as the host writes them (word i at host_words()[i]; pass &host_words()[i] to
  // MirrorImm) and as kernels on cuda_device() read them.
  virtual uint64_t* host_words() const = 0;
  virtual uint64_t* device_words() const = 0;
  // Word i read by the host with acquire ordering (in GPU memory: a read across PCIe, about a
  // microsecond); InvalidArgument past the end.
  StatusOr<uint64_t> Load(size_t i) const;
};

}  // namespace ferry
