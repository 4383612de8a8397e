// The host device's combine arithmetic: rows of the combine's element (bf16, fp16, fp32)
// summed in fp32 in the CUDA kernels' order of rounded operations, and the sums stored back.
#pragma once

#include <cstdint>

#include "moe/numerics.h"

namespace ferry::moe::host {

// Each combine element (moe/numerics.h's Elem) read into and written from fp32.
struct Bf16 {
  using T = uint16_t;
  static float Load(T b) { return Bf16ToFloat(b); }
  static T Store(float f) { return FloatToBf16(f); }
};
struct Fp16 {
  using T = uint16_t;
  static float Load(T b) { return Fp16ToFloat(b); }
  static T Store(float f) { return FloatToFp16(f); }
};
struct Fp32 {
  using T = float;
  static float Load(T f) { return f; }
  static T Store(float f) { return f; }
};

// fn.template operator()<E>() for the element type of e.
template <typename Fn>
void WithElem(Elem e, Fn&& fn) {
  switch (e) {
    case Elem::kFp32:
      fn.template operator()<Fp32>();
      return;
    case Elem::kFp16:
      fn.template operator()<Fp16>();
      return;
    case Elem::kBf16:
      fn.template operator()<Bf16>();
      return;
  }
}

// acc[i] += w * row[i] over a row of h columns (a multiple of 16: AllToAllConfig::Validate).
// In blocks of a fixed 16 columns, which -O2 vectorizes; its cost model leaves a loop of unknown
// length scalar (which took the combine's sums twice as long). The two never overlap
// (restrict). Each element's product and sum stay two rounded operations, as the CUDA kernels
// do them.
template <typename E>
void AddScaledRow(float* __restrict acc, const typename E::T* __restrict row, float w, int h) {
  constexpr int kBlock = 16;
  for (int b = 0; b < h; b += kBlock) {
    for (int i = b; i < b + kBlock; ++i) acc[i] += w * E::Load(row[i]);
  }
}
inline void AddScaledRow(float* acc, const uint8_t* row, float w, int h, Elem e) {
  WithElem(e, [&]<typename E>() {
    AddScaledRow<E>(acc, reinterpret_cast<const typename E::T*>(row), w, h);
  });
}
// acc's n sums into the combine elements at dst (a row, or every row of the output), rounded
// to the element.
inline void StoreSums(uint8_t* dst, const float* acc, int64_t n, Elem e) {
  WithElem(e, [&]<typename E>() {
    auto* out = reinterpret_cast<typename E::T*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = E::Store(acc[i]);
  });
}
// The n combine elements at src, widened to fp32, into acc.
inline void LoadSums(float* acc, const uint8_t* src, int64_t n, Elem e) {
  WithElem(e, [&]<typename E>() {
    const auto* in = reinterpret_cast<const typename E::T*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] = E::Load(in[i]);
  });
}

}  // namespace ferry::moe::host
