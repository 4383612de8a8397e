// The host device's HopMemory (moe/node_once.h): node-once's work between its hops in host
// memory, as loops; the CUDA device's is cuda/node_once_hops.cu.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <vector>

#include "moe/host/host_sums.h"
#include "moe/node_once.h"

namespace ferry::moe {
namespace {

// The host device's HopMemory: host memory, loops.
class HostHops final : public HopMemory {
 public:
  StatusOr<uint8_t*> Allocate(int64_t bytes) override {
    blocks_.push_back(std::vector<uint8_t>(size_t(std::max<int64_t>(bytes, 1))));
    return blocks_.back().data();
  }
  Status SetStream(void*) override { return UnimplementedError("SetStream: the host device"); }
  Status Zero(int64_t* p, int n) override {
    std::fill(p, p + n, 0);
    return Status::Ok();
  }
  Status AddStrided(int64_t* out, const int64_t* in, int n, int stride) override {
    for (int i = 0; i < n; ++i) out[int64_t{i} * stride] += in[i];
    return Status::Ok();
  }
  Status CopyRows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                  int64_t width, int64_t rows) override {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<uint8_t*>(dst) + r * dst_pitch,
                  static_cast<const uint8_t*>(src) + r * src_pitch, size_t(width));
    }
    return Status::Ok();
  }
  Status Narrow(void* out, const float* sums, int64_t width, int64_t rows,
                const int32_t* device_rows, bool fp16, bool accumulate) override {
    if (device_rows) return InvalidArgumentError("Narrow: a device count on the host");
    const int64_t n = rows * width;
    const Elem e = fp16 ? Elem::kFp16 : Elem::kBf16;
    auto* o = static_cast<uint8_t*>(out);
    if (!accumulate) {
      host::StoreSums(o, sums, n, e);
      return Status::Ok();
    }
    std::vector<float> acc(static_cast<size_t>(n));
    host::LoadSums(acc.data(), o, n, e);
    for (int64_t i = 0; i < n; ++i) acc[size_t(i)] += sums[i];
    host::StoreSums(o, acc.data(), n, e);
    return Status::Ok();
  }
  Status Stamp(int point) override {
    stamps_[size_t(point)] = std::chrono::steady_clock::now();
    return Status::Ok();
  }
  StatusOr<double> Elapsed(int a, int b) override {
    return std::chrono::duration<double, std::micro>(stamps_[size_t(b)] - stamps_[size_t(a)])
        .count();
  }

 private:
  std::vector<std::vector<uint8_t>> blocks_;
  std::array<std::chrono::steady_clock::time_point, kHopPoints> stamps_{};
};

}  // namespace

std::unique_ptr<HopMemory> NewHostHopMemory() { return std::make_unique<HostHops>(); }

}  // namespace ferry::moe
