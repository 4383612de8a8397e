// ferry-bench moe: what a caller of the token-major dispatch layout does around its grouped GEMM,
// as two plain CUDA kernels, so the two layouts can be compared whole for whole.
//
// Expert-major hands the GEMM its rows grouped by expert and takes its outputs back in that
// layout (ferry's CombineSend weights and sums them). Token-major hands each token over once;
// before an expert-major grouped GEMM the caller permutes (each row into its local experts'
// groups), and after it un-permutes (the weighted sum of a row's expert outputs, one bf16 row per
// token, which CombineSend takes). A model that fuses these into its GEMMs (a gathering load, a
// summing epilogue) pays less; these kernels are the plain upper bound.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ferry::bench {

struct TokenMajorCaller {
  int k = 0;  // experts per token
  int local_experts = 0;
  int64_t expert_capacity = 0;  // rows per expert group, and token-major rows at most
  int64_t row_bytes = 0;        // dispatched payload per row (a multiple of 16)
  int scales_per_row = 0;       // fp32 scales per row (fp8), else 0
  int hidden = 0;
  // DispatchRecv's token-major output.
  const int32_t* num_rows = nullptr;
  const int32_t* token_experts = nullptr;  // [capacity, k]
  const float* token_weights = nullptr;    // [capacity, k]
  const uint8_t* rows = nullptr;           // [capacity, row_bytes]
  const float* row_scales = nullptr;       // [capacity, scales_per_row]
  // The permuted rows, grouped by local expert: the GEMM's input.
  uint8_t* grouped = nullptr;       // [local_experts, capacity, row_bytes]
  float* grouped_scales = nullptr;  // [local_experts, capacity, scales_per_row]
  int32_t* fill = nullptr;          // [local_experts] rows placed per group; zero between cycles
  int32_t* where = nullptr;         // [capacity, k] where each copy went, -1 if not ours
  // The GEMM's output (expert-major, bf16) and the un-permuted rows CombineSend takes.
  const uint16_t* gemm_out = nullptr;  // [local_experts, capacity, hidden]
  uint16_t* combined = nullptr;        // [capacity, hidden]
};

// Each received row into a free row of each of its local experts' groups (with its scales):
// one kernel places the copies (recording `where`), a second copies the rows. Needs `fill` zero:
// the first call after Unpermute (which zeroes it once it has read `where`) or after setup.
cudaError_t LaunchPermute(const TokenMajorCaller& c, cudaStream_t stream);
// Row g of `combined` = sum over its copies of weight * gemm_out[expert][where], fp32 sums,
// bf16 out; then zeroes `fill` for the next Permute.
cudaError_t LaunchUnpermute(const TokenMajorCaller& c, cudaStream_t stream);

}  // namespace ferry::bench
