// A stand-in for GDRCopy's libgdrapi, for gdr_flags_test, where no /dev/gdrdrv and no GPU are.
// The "GPU memory" is host memory the test maps shared (MAP_SHARED | MAP_ANONYMOUS); gdr_map
// hands back a second mapping of the same pages (mremap with an old size of 0), so what the
// host writes through the mapping shows at the pinned address, as it would on the GPU.
// FAKE_GDR_FAIL=open|pin|map|info makes that call fail, =va makes gdr_get_info describe a range
// away from the pinned one; fake_gdr_live() counts what is open, pinned or mapped right now.
// Built twice: with gdr_get_info_v2 beside gdr_get_info (GDRCopy 2.4 on), and, with FAKE_GDR_V1,
// with gdr_get_info only.
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr uint64_t kGpuPage = uint64_t{1} << 16;

struct Pin {
  uint64_t addr;
  size_t size;
};
std::vector<Pin> pins;  // by handle
int live = 0;
int session;  // what gdr_open returns a pointer to

bool Fails(const char* call) {
  const char* f = std::getenv("FAKE_GDR_FAIL");
  return f && std::strcmp(f, call) == 0;
}

int Info(unsigned long handle, void* info) {
  if (Fails("info") || handle >= pins.size()) return -1;
  uint64_t* words = static_cast<uint64_t*>(info);  // va, mapped_size: where every version starts
  words[0] = pins[handle].addr + (Fails("va") ? 4 * kGpuPage : 0);
  words[1] = pins[handle].size;
  return 0;
}

}  // namespace

extern "C" {

int fake_gdr_live() { return live; }

void* gdr_open() {
  if (Fails("open")) return nullptr;
  ++live;
  return &session;
}
int gdr_close(void*) {
  --live;
  return 0;
}
int gdr_pin_buffer(void*, unsigned long addr, size_t size, uint64_t, uint32_t,
                   unsigned long* handle) {
  if (Fails("pin") || addr % kGpuPage != 0 || size % kGpuPage != 0) return -1;
  *handle = pins.size();
  pins.push_back({addr, size});
  ++live;
  return 0;
}
int gdr_unpin_buffer(void*, unsigned long) {
  --live;
  return 0;
}
int gdr_map(void*, unsigned long handle, void** va, size_t size) {
  if (Fails("map") || handle >= pins.size() || size > pins[handle].size) return -1;
  void* alias = mremap(reinterpret_cast<void*>(pins[handle].addr), 0, size, MREMAP_MAYMOVE);
  if (alias == MAP_FAILED) return -1;
  *va = alias;
  ++live;
  return 0;
}
int gdr_unmap(void*, unsigned long, void* va, size_t size) {
  munmap(va, size);
  --live;
  return 0;
}
int gdr_get_info(void*, unsigned long handle, void* info) { return Info(handle, info); }
#ifndef FAKE_GDR_V1
int gdr_get_info_v2(void*, unsigned long handle, void* info) { return Info(handle, info); }
#endif

}  // extern "C"
