// The numbers ferry's MoE steps compute with: bf16, IEEE fp16 and fp8 e4m3 conversions bit for
// bit as the CUDA intrinsics give them (so the host device, the reference, and the kernels agree),
// the fp8 group scale both quantisers share, and the combine's element type. Internal: src/,
// tests and tools include it; the public contract is ferry/moe.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ferry/export.h"
#include "ferry/moe.h"

namespace ferry {

// bf16 helpers (round to nearest even, NaN kept), for callers and tests. Inline: the host
// device calls them per element.
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE fp16 helpers (round to nearest even, beyond 65504 infinite, subnormals kept, NaN as
// 0x7FFF): what the CUDA device's __float2half_rn and __half2float give.
inline uint16_t FloatToFp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFF;                              // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00;                      // 65520 and up round to infinity
  if (a >= 0x38800000u) {                                          // normal: 2^-14 and up
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);              // to nearest even at bit 13
    return sign | static_cast<uint16_t>((r - 0x38000000u) >> 13);  // exponent rebiased
  }
  if (a <= 0x33000000u) return sign;  // at most 2^-25: zero (2^-25 itself ties to even)
  // Subnormal: the 24-bit significand shifted to units of 2^-24, to nearest even.
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const int shift = 126 - static_cast<int>(a >> 23);
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}
inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, u;
  if (e == 0x1F) {
    u = sign | 0x7F800000u | (m << 13);  // infinity, NaN
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {  // subnormal: normalised
    e = 113;
    while (!(m & 0x400u)) {
      m <<= 1;
      --e;
    }
    u = sign | (e << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp8 e4m3 (the "fn" variant: no infinities, 0x7F / 0xFF NaN, largest finite 448) from a float:
// round to nearest even, saturated at +-448, NaN kept. What the CUDA device's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) gives.
inline uint8_t FloatToE4M3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;  // NaN
  if (a > 0x43E00000u) return sign | 0x7E;  // beyond 448 (infinity too): saturated
  const int exponent = static_cast<int>(a >> 23) - 127;
  if (exponent < -6) {  // e4m3 subnormals: multiples of 2^-9 (code 8 is the smallest normal)
    float magnitude;
    std::memcpy(&magnitude, &a, 4);
    const float units = magnitude * 512.0f;  // exact: a power-of-two multiple
    uint32_t q = static_cast<uint32_t>(units);
    const float rest = units - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: three of float's 23 mantissa bits, rounded to nearest even; a carry out of the
  // mantissa moves the exponent on (448 is the largest reached: larger values saturated above).
  uint32_t code = static_cast<uint32_t>(exponent + 7) << 3 | ((a >> 20) & 7u);
  const uint32_t rest = a & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
  return sign | static_cast<uint8_t>(code);
}
inline float E4M3ToFloat(uint8_t q) {
  const float sign = (q & 0x80) ? -1.0f : 1.0f;
  const int exponent = (q >> 3) & 0xF, mantissa = q & 7;
  if (exponent == 0xF && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
}

// One 128-column group's fp8 scale (Fp8Scaling), from its largest |x|. Shared by the host and
// the CUDA device's quantisers, so that both give the same bits.
#if defined(__CUDACC__)
#define FERRY_HOST_DEVICE __host__ __device__
#else
#define FERRY_HOST_DEVICE
#endif
FERRY_HOST_DEVICE inline float Fp8GroupScale(float amax, Fp8Scaling scaling) {
  const float s = (amax > 1e-4f ? amax : 1e-4f) / 448.0f;
  if (scaling == Fp8Scaling::kAmax) return s;
  uint32_t u;
  std::memcpy(&u, &s, 4);
  if (u & 0x007FFFFFu) u = (u & 0xFF800000u) + 0x00800000u;  // up to the next power of two
  float p;
  std::memcpy(&p, &u, 4);
  return p;
}

// rows [rows, hidden] bf16 -> out [rows, hidden] e4m3 and scales [rows, hidden / 128] fp32, as
// DispatchSend quantises x_bf16 (hidden a multiple of 128).
FERRY_API void QuantizeFp8Rows(const uint16_t* rows, int64_t num_rows, int hidden,
                               Fp8Scaling scaling, uint8_t* out, float* scales);

namespace moe {

// DispatchInput::x_bf16 quantised on the CPU (QuantizeFp8Rows) into rows kept here until the
// next call: MoeDevice::Quantize of the devices that run on the host.
class HostFp8Rows {
 public:
  void Quantize(const AllToAllConfig& c, const DispatchInput& in, const void** x,
                const float** scales) {
    x_.resize(size_t(in.num_tokens) * c.hidden);
    scales_.resize(size_t(in.num_tokens) * c.scales_per_token());
    QuantizeFp8Rows(in.x_bf16, in.num_tokens, c.hidden, in.scaling, x_.data(), scales_.data());
    *x = x_.data();
    *scales = scales_.data();
  }

 private:
  std::vector<uint8_t> x_;
  std::vector<float> scales_;
};

// A combine row's element (AllToAllConfig::combine_row_bytes): bf16, fp16 (CombineInput /
// CombineOutput::fp16) or fp32 (combines_fp32()). Both devices sum in fp32 and store this.
enum class Elem { kBf16, kFp16, kFp32 };
inline Elem ElemOf(const AllToAllConfig& c, bool fp16) {
  return c.combines_fp32() ? Elem::kFp32 : fp16 ? Elem::kFp16 : Elem::kBf16;
}

}  // namespace moe
}  // namespace ferry
