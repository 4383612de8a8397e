// GdrFlags: a few words of GPU memory that the host writes through a GDRCopy mapping (the GPU's
// BAR1, mapped into this process), for flags the host raises and kernels poll: GpuWords' GPU
// memory placement (the moe relay's inbox flags and MirrorImm's words are GpuWords). The kernels
// then poll their own memory instead of reading host memory over PCIe on every poll.
//
// GDRCopy is optional and loaded at run time (dlopen of libgdrapi); without the library, without
// /dev/gdrdrv, or when pinning fails, Open says Unavailable and why, and the caller keeps its
// flags in pinned host memory. Only the host -> GPU direction uses it: the GPU's own flags for
// the relay stay in pinned host memory, where the CPU polls its cache instead of reading the BAR
// (uncached, about a microsecond per read).
//
// Memory ordering: the mapping is write-combining. A host store there is not guaranteed to leave
// the CPU soon, nor ordered with later stores, until a fence: the writer stores, then fences
// (std::atomic_thread_fence(seq_cst), an mfence on x86: the relay and MirrorImm do).
// Compiles without CUDA; the implementation is in gdr_flags.cu, built only with CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry {

class GdrFlags {
 public:
  // What Open touches outside the process, so that a test can stand in for each (gdr_flags_test
  // runs a fake libgdrapi over host memory): the driver's device node, the library, and the GPU
  // memory the words live in.
  struct Env {
    std::string device_node = "/dev/gdrdrv";
    std::vector<std::string> libraries = {"libgdrapi.so.2", "libgdrapi.so"};  // tried in order
    std::function<void*(size_t bytes)> alloc;  // device memory (null: none to be had)
    std::function<bool(void* p, size_t bytes)> zero;  // done before Open returns
    std::function<void(void* p)> free;
    std::string where;  // the memory, for messages ("GPU 0")
  };
  // `words` zeroed 64-bit words on CUDA device `device`, mapped for the host.
  static StatusOr<std::unique_ptr<GdrFlags>> Open(size_t words, int device);
  // The same over `env`: `words` zeroed words inside memory from env.alloc.
  static StatusOr<std::unique_ptr<GdrFlags>> Open(size_t words, Env env);
  ~GdrFlags();
  GdrFlags(const GdrFlags&) = delete;
  GdrFlags& operator=(const GdrFlags&) = delete;

  uint64_t* device_words() const { return device_; }  // for the kernels
  uint64_t* host_words() const { return host_; }      // for the host: store, then fence

 private:
  struct Api;
  GdrFlags() = default;
  Env env_;
  std::unique_ptr<Api> api_;
  void* gdr_ = nullptr;       // gdr_t
  unsigned long handle_ = 0;  // gdr_mh_t
  bool pinned_ = false;
  void* map_ = nullptr;       // the mapping of the pinned range
  size_t map_bytes_ = 0;
  void* allocation_ = nullptr;  // from env_.alloc, over-allocated for the 64 KiB alignment
  uint64_t* device_ = nullptr;
  uint64_t* host_ = nullptr;
};

}  // namespace ferry
