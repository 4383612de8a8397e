// GdrFlags (gdr_flags.h): GDRCopy's C API, resolved with dlsym, over a cudaMalloc'ed range (or
// whatever memory the caller's Env gives).
#include "common/gdr_flags.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <string>

namespace ferry {
namespace {

constexpr size_t kGpuPage = size_t{1} << 16;  // GDRCopy pins whole 64 KiB GPU pages

// gdr_info_t / gdr_info_v2_t begin with the mapped range's device address; the rest differs
// between versions, so the struct is read into room to spare.
struct GdrInfoPrefix {
  uint64_t va;
  uint64_t mapped_size;
  uint8_t rest[240];
};

}  // namespace

struct GdrFlags::Api {
  void* lib = nullptr;
  void* (*open)() = nullptr;
  int (*close)(void*) = nullptr;
  int (*pin)(void*, unsigned long, size_t, uint64_t, uint32_t, unsigned long*) = nullptr;
  int (*unpin)(void*, unsigned long) = nullptr;
  int (*map)(void*, unsigned long, void**, size_t) = nullptr;
  int (*unmap)(void*, unsigned long, void*, size_t) = nullptr;
  int (*info)(void*, unsigned long, GdrInfoPrefix*) = nullptr;
  ~Api() {
    if (lib) dlclose(lib);
  }
};

StatusOr<std::unique_ptr<GdrFlags>> GdrFlags::Open(size_t words, int device) {
  Env env;
  env.where = "GPU " + std::to_string(device);
  env.alloc = [device](size_t bytes) -> void* {
    void* p = nullptr;
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  env.zero = [](void* p, size_t bytes) {
    return cudaMemset(p, 0, bytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  };
  env.free = [](void* p) { cudaFree(p); };
  return Open(words, std::move(env));
}

StatusOr<std::unique_ptr<GdrFlags>> GdrFlags::Open(size_t words, Env env) {
  if (words == 0) return InvalidArgumentError("GdrFlags: no words");
  if (!env.alloc || !env.zero || !env.free) {
    return InvalidArgumentError("GdrFlags: the Env lacks alloc, zero or free");
  }
  if (words * sizeof(uint64_t) > kGpuPage) {
    return InvalidArgumentError("GdrFlags: more than 64 KiB of flags");
  }
  if (access(env.device_node.c_str(), R_OK | W_OK) != 0) {
    return UnavailableError("GDRCopy: " + env.device_node +
                            " is absent (gdrdrv module not loaded)");
  }
  auto api = std::make_unique<Api>();
  for (const std::string& name : env.libraries) {
    if ((api->lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
  }
  if (!api->lib) {
    std::string tried;
    for (const std::string& name : env.libraries) tried += (tried.empty() ? "" : ", ") + name;
    return UnavailableError("GDRCopy: no library found (tried: " + tried + ")");
  }
  auto sym = [&](const char* name) { return dlsym(api->lib, name); };
  api->open = reinterpret_cast<decltype(api->open)>(sym("gdr_open"));
  api->close = reinterpret_cast<decltype(api->close)>(sym("gdr_close"));
  api->pin = reinterpret_cast<decltype(api->pin)>(sym("gdr_pin_buffer"));
  api->unpin = reinterpret_cast<decltype(api->unpin)>(sym("gdr_unpin_buffer"));
  api->map = reinterpret_cast<decltype(api->map)>(sym("gdr_map"));
  api->unmap = reinterpret_cast<decltype(api->unmap)>(sym("gdr_unmap"));
  void* info = sym("gdr_get_info_v2");
  api->info = reinterpret_cast<decltype(api->info)>(info ? info : sym("gdr_get_info"));
  if (!api->open || !api->close || !api->pin || !api->unpin || !api->map || !api->unmap ||
      !api->info) {
    return UnavailableError("GDRCopy: libgdrapi lacks the gdr_* calls ferry uses");
  }

  // From here each step's resource is the object's, released by its destructor on failure.
  std::unique_ptr<GdrFlags> f(new GdrFlags());
  f->env_ = std::move(env);
  f->api_ = std::move(api);
  Api& a = *f->api_;
  if (!(f->allocation_ = f->env_.alloc(2 * kGpuPage))) {
    return UnavailableError("GDRCopy: no device memory for the flags on " + f->env_.where);
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(f->allocation_);
  const uintptr_t aligned = (base + kGpuPage - 1) & ~(uintptr_t{kGpuPage} - 1);
  if (!f->env_.zero(reinterpret_cast<void*>(aligned), kGpuPage)) {
    return UnavailableError("GDRCopy: cannot zero the flags");
  }
  if (!(f->gdr_ = a.open())) return UnavailableError("GDRCopy: gdr_open failed");
  if (a.pin(f->gdr_, aligned, kGpuPage, 0, 0, &f->handle_) != 0) {
    return UnavailableError("GDRCopy: gdr_pin_buffer failed (no BAR1 space, or no P2P support)");
  }
  f->pinned_ = true;
  if (a.map(f->gdr_, f->handle_, &f->map_, kGpuPage) != 0) {
    f->map_ = nullptr;
    return UnavailableError("GDRCopy: gdr_map failed");
  }
  f->map_bytes_ = kGpuPage;
  GdrInfoPrefix i{};
  if (a.info(f->gdr_, f->handle_, &i) != 0) return UnavailableError("GDRCopy: gdr_get_info failed");
  if (aligned < i.va || aligned - i.va >= kGpuPage) {
    return UnavailableError("GDRCopy: gdr_get_info gives a mapping that does not hold the flags");
  }
  f->device_ = reinterpret_cast<uint64_t*>(aligned);
  f->host_ = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(f->map_) + (aligned - i.va));
  return StatusOr<std::unique_ptr<GdrFlags>>(std::move(f));
}

GdrFlags::~GdrFlags() {
  if (api_) {
    if (map_) api_->unmap(gdr_, handle_, map_, map_bytes_);
    if (pinned_) api_->unpin(gdr_, handle_);
    if (gdr_) api_->close(gdr_);
  }
  if (allocation_) env_.free(allocation_);
}

}  // namespace ferry
