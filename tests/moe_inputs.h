// Inputs of the moe tests: every rank can regenerate every other rank's inputs from (seed, rank,
// iteration), and the expert function they all apply.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ferry/moe.h"
#include "moe/numerics.h"

namespace ferry {

enum class Routing { kRandom, kAllToOneExpert };

struct InputSpec {
  int tokens = 0;
  int k = 1;
  int experts = 1;
  DispatchDtype dtype = DispatchDtype::kBf16;
  Routing routing = Routing::kRandom;
  bool rank1_empty = false;  // rank 1 sends no tokens
  // Copies routed to no expert (id -1), as a router that picked fewer experts leaves them: the
  // last copy of every third token, and every copy of every seventh (host device only).
  bool unrouted = false;
};

// A case's shape in a test's name: n<ranks>_t<tokens>_h<hidden>_e<experts>_k<k>, the rows' dtype,
// then _hot (every token to expert 0) and _empty1 (rank 1 sends nothing) where they hold.
inline std::string ShapeName(int world_size, int hidden, const InputSpec& s) {
  return "n" + std::to_string(world_size) + "_t" + std::to_string(s.tokens) + "_h" +
         std::to_string(hidden) + "_e" + std::to_string(s.experts) + "_k" + std::to_string(s.k) +
         (s.dtype == DispatchDtype::kBf16   ? "_bf16"
          : s.dtype == DispatchDtype::kFp32 ? "_fp32"
                                            : "_fp8") +
         (s.routing == Routing::kAllToOneExpert ? "_hot" : "") + (s.rank1_empty ? "_empty1" : "");
}

inline float DecodeE4M3(uint8_t b) {
  int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  float v = exp == 0 ? std::ldexp(man / 8.0f, -6) : std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -v : v;
}

// One rank's inputs for one iteration, reproducible anywhere.
struct Inputs {
  int tokens = 0;
  std::vector<uint8_t> x;  // [T, row bytes]
  std::vector<float> scales;
  std::vector<int32_t> indices;
  std::vector<float> weights;
};

inline Inputs MakeInputs(const InputSpec& c, const AllToAllConfig& cfg, int rank, int iteration) {
  Inputs in;
  in.tokens = (c.rank1_empty && rank == 1) ? 0 : c.tokens;
  std::mt19937 rng(1000003u * rank + 7919u * iteration + 17);
  const int64_t row = cfg.token_bytes();
  in.x.resize(size_t(in.tokens) * row);
  if (c.dtype == DispatchDtype::kBf16) {
    std::uniform_real_distribution<float> val(-2.0f, 2.0f);
    for (size_t i = 0; i < in.x.size(); i += 2) {
      uint16_t b = FloatToBf16(val(rng));
      std::memcpy(&in.x[i], &b, 2);
    }
  } else if (c.dtype == DispatchDtype::kFp32) {
    // Full fp32 values, which bf16 cannot hold: a path that rounded them would show.
    std::uniform_real_distribution<float> val(-2.0f, 2.0f);
    for (size_t i = 0; i < in.x.size(); i += 4) {
      const float f = val(rng);
      std::memcpy(&in.x[i], &f, 4);
    }
  } else {
    for (auto& b : in.x) {
      b = static_cast<uint8_t>(rng());
      if ((b & 0x7F) == 0x7F) b = 0;  // no NaNs
    }
    std::uniform_real_distribution<float> scale(0.01f, 1.0f);
    in.scales.resize(size_t(in.tokens) * cfg.scales_per_token());
    for (auto& s : in.scales) s = scale(rng);
  }
  in.indices.resize(size_t(in.tokens) * c.k);
  in.weights.resize(size_t(in.tokens) * c.k);
  std::vector<int32_t> experts(c.experts);
  std::iota(experts.begin(), experts.end(), 0);
  for (int t = 0; t < in.tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    if (c.routing == Routing::kAllToOneExpert) {
      auto it = std::find(experts.begin(), experts.end(), 0);
      std::iter_swap(experts.begin(), it);
    }
    for (int j = 0; j < c.k; ++j) {
      const bool none = c.unrouted && (t % 7 == 3 || (t % 3 == 1 && j == c.k - 1));
      in.indices[size_t(t) * c.k + j] = none ? -1 : experts[j];
      in.weights[size_t(t) * c.k + j] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    }
  }
  return in;
}

// The expert function every rank applies: a per-expert scale of the dequantised row.
inline float ExpertScale(int global_expert) { return 1.0f + 0.01f * static_cast<float>(global_expert); }

inline float Dequant(const AllToAllConfig& cfg, const uint8_t* row, const float* scales, int i) {
  if (cfg.dtype == DispatchDtype::kBf16) {
    uint16_t b;
    std::memcpy(&b, row + 2 * i, 2);
    return Bf16ToFloat(b);
  }
  if (cfg.dtype == DispatchDtype::kFp32) {
    float f;
    std::memcpy(&f, row + 4 * i, 4);
    return f;
  }
  // Scale j covers columns [j * g, (j + 1) * g), g = ceil(hidden / scales_per_token): 128 by
  // default, the whole row for one scale.
  const int spt = cfg.scales_per_token(), g = (cfg.hidden + spt - 1) / spt;
  return DecodeE4M3(row[i]) * scales[i / g];
}

// The combine's element (AllToAllConfig::combine_row_bytes): fp32 where combines_fp32(), else
// bf16, or fp16 where the combine is told so (`fp16`: CombineInput / CombineOutput::fp16).
// Element i of `rows` as a float, and v stored there (rounded to the element).
inline float GetCombine(const AllToAllConfig& cfg, const void* rows, int64_t i, bool fp16 = false) {
  if (cfg.combines_fp32()) return static_cast<const float*>(rows)[i];
  const uint16_t b = static_cast<const uint16_t*>(rows)[i];
  return fp16 ? Fp16ToFloat(b) : Bf16ToFloat(b);
}
inline void PutCombine(const AllToAllConfig& cfg, void* rows, int64_t i, float v,
                       bool fp16 = false) {
  if (cfg.combines_fp32()) {
    static_cast<float*>(rows)[i] = v;
  } else {
    static_cast<uint16_t*>(rows)[i] = fp16 ? FloatToFp16(v) : FloatToBf16(v);
  }
}
// v as the combine's element holds it.
inline float CombineRound(const AllToAllConfig& cfg, float v, bool fp16 = false) {
  if (cfg.combines_fp32()) return v;
  return fp16 ? Fp16ToFloat(FloatToFp16(v)) : Bf16ToFloat(FloatToBf16(v));
}
// `n` combine elements of value v (an output to accumulate onto).
inline std::vector<uint8_t> CombineFilled(const AllToAllConfig& cfg, int64_t n, float v,
                                          bool fp16 = false) {
  std::vector<uint8_t> rows(size_t(n) * size_t(cfg.combine_row_bytes() / cfg.hidden));
  for (int64_t i = 0; i < n; ++i) PutCombine(cfg, rows.data(), i, v, fp16);
  return rows;
}

// The caller's side of a token-major combine: row i of expert_out ([rows, hidden], the
// combine's element) is the weighted fp32 sum, in k order, of row i's local experts applied to
// it (each expert's output rounded to the combine's element first, as an expert-major caller's
// would be). experts / weights: [rows, K].
inline void SumTokenMajorExperts(const AllToAllConfig& cfg, const uint8_t* x, const float* scales,
                                 const int32_t* experts, const float* weights, int rows,
                                 void* expert_out, bool fp16 = false) {
  const int k = cfg.experts_per_token, h = cfg.hidden, first = cfg.rank * cfg.local_experts();
  const int64_t row = cfg.token_bytes(), spt = cfg.scales_per_token();
  for (int64_t i = 0; i < rows; ++i) {
    for (int col = 0; col < h; ++col) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int32_t e = experts[i * k + j];
        if (e < 0) continue;
        const float y = Dequant(cfg, x + i * row, scales + i * spt, col) * ExpertScale(first + e);
        sum += weights[i * k + j] * CombineRound(cfg, y, fp16);
      }
      PutCombine(cfg, expert_out, i * h + col, sum, fp16);
    }
  }
}

// The AllToAll configuration of a test case (any struct with the fields read here).
template <typename Case>
AllToAllConfig ConfigFor(const Case& c, int world_size, int rank) {
  AllToAllConfig cfg;
  cfg.world_size = world_size;
  cfg.rank = rank;
  cfg.num_experts = c.experts;
  cfg.experts_per_token = c.k;
  cfg.max_tokens_per_rank = std::max(c.tokens, 1);
  cfg.hidden = c.hidden;
  cfg.dtype = c.dtype;
  cfg.fp8_scales = c.fp8_scales;
  cfg.fp32_combine = c.fp32_combine;
  cfg.max_private_tokens = c.private_tokens;
  cfg.dispatch_once_per_rank = c.once_per_rank;
  cfg.combine_reduce_at_expert_rank = c.reduce_at_expert_rank;
  return cfg;
}

}  // namespace ferry
