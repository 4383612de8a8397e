// The CUDA device's kernels, planned and launched (design in cuda_device.h): the buffer's layout
// and every kernel's grid, then the four steps enqueued on the device's stream. The only file
// that includes the kernels (nvlink_send.cuh, nvlink_send_small.cuh, nvlink_recv.cuh,
// nvlink_combine.cuh): a kernel's attributes (shared memory) are set on the instance this file
// launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "moe/cuda/cuda_device.h"
#include "moe/cuda/nvlink_combine.cuh"
#include "moe/cuda/nvlink_layout.h"
#include "moe/cuda/nvlink_recv.cuh"
#include "moe/cuda/nvlink_send.cuh"  // the kernels, in step order
#include "moe/cuda/nvlink_send_small.cuh"

namespace ferry::moe {
namespace {

using namespace nv;  // NOLINT: the kernels and their structs, this file's whole subject

// CombineRecv's kernel for the element (streamed or not); `wide`: fp32 output from 2-byte rows
// (CombineOutput::fp32_out; fp32 rows give fp32 output anyway).
using CombineKernel = void (*)(Nv, CombineArgs);
template <bool kWide>
CombineKernel RecvKernelOf(bool streamed, Elem e) {
  if (streamed) {
    return e == Elem::kFp16 ? combine::CombineRecvStreamedKernel<Elem::kFp16, kWide>
                            : combine::CombineRecvStreamedKernel<Elem::kBf16, kWide>;
  }
  return e == Elem::kFp16 ? combine::CombineRecvKernel<Elem::kFp16, kWide>
                          : combine::CombineRecvKernel<Elem::kBf16, kWide>;
}
CombineKernel RecvKernel(bool streamed, Elem e, bool wide) {
  if (e == Elem::kFp32) {
    return streamed ? combine::CombineRecvStreamedKernel<Elem::kFp32, false>
                    : combine::CombineRecvKernel<Elem::kFp32, false>;
  }
  return wide ? RecvKernelOf<true>(streamed, e) : RecvKernelOf<false>(streamed, e);
}

}  // namespace

using namespace nv;  // NOLINT

// ---- launch helpers ----

template <typename Args>
cudaError_t CudaDevice::Launch(void (*kernel)(Nv, Args), int grid, size_t smem, const Args& args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kCopyThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream_;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &early;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, nv_, args);
}

Status CudaDevice::Aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return Status::Ok();
  return InvalidArgumentError(std::string(what) + " must be 16-byte aligned");
}

uint64_t CudaDevice::BudgetNs(Deadline deadline) {
  const auto left = deadline.at - Clock::now();
  return left.count() <= 0
             ? 0
             : static_cast<uint64_t>(
                   std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
}

// ---- the plan (Init's stages that size the kernels) ----

StatusOr<int64_t> CudaDevice::PlanBuffer() {
  const int n = c_.world_size, k = c_.experts_per_token, t = c_.max_tokens_per_rank;
  Nv& v = nv_;
  v.world_size = n;
  v.rank = c_.rank;
  v.experts = c_.num_experts;
  v.local_experts = c_.local_experts();
  v.topk = k;
  v.div_local_experts = FastDiv::Of(v.local_experts);
  v.div_topk = FastDiv::Of(k);
  v.max_tokens = t;
  v.hidden = c_.hidden;
  v.scales_per_token = c_.scales_per_token();
  v.private_slots = c_.max_private_tokens;
  v.chunks = static_cast<int>((int64_t{t} * k + kChunk - 1) / kChunk);
  v.scan_blocks = ((t + kRouteThreads - 1) / kRouteThreads) * ((n + kScanRanks - 1) / kScanRanks);
  v.payload = c_.token_bytes();
  // Decode batches: DispatchSend in one kernel, its shared memory within the default limit.
  const size_t small_smem = SmallSmemBytes(n, v.experts, int64_t{t} * k);
  if (int64_t{t} * k <= kSmallEntries && small_smem <= 48 * 1024) small_smem_ = small_smem;
  // The step's modes, from the configuration the ranks agree on (step_modes.h): kAuto streams
  // the dispatch where SendSmall sends it.
  v.modes = StepModes::Of(c_, small_smem_ > 0);
  RETURN_IF_ERROR(v.modes.Check());
  const NvlinkLayout layout(c_, v.modes);
  v.meta_used = layout.slot.meta_used;
  v.meta_bytes = layout.slot.meta_bytes;
  v.slot_bytes = layout.slot.slot_bytes;
  v.row_bytes = c_.combine_row_bytes();
  v.capacity = c_.expert_capacity();
  v.slots_per_pair = pairs_.slots_per_pair;
  v.counts_off = layout.counts_off;
  v.counts_stride = layout.counts_stride;
  v.private_off = layout.private_off;
  v.combine_off = layout.combine_off;
  v.combine_tag_off = layout.combine_tag_off;
  v.send_off = layout.send_off;
  return layout.bytes;
}

Status CudaDevice::PlanGrids(int sms) {
  Nv& v = nv_;
  const int n = c_.world_size, t = c_.max_tokens_per_rank;
  const int64_t max_recv = MaxReceived();
  recv_grid_ = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_recv, 4 * sms)));
  recv_grid_limit_ = 4 * sms;
  // Token-major CombineSend only copies. Its copy-only instance (32 registers, not 124) is
  // faster when every received row has a block of its own (decode: 17.5 against 19.0 us), but
  // slower when blocks loop over many rows (prefill: 195-200 against 185 us, with 528 or 264
  // blocks; not explained yet), so it serves batches that fit the grid.
  combine_send_ = v.modes.token_major() && max_recv <= recv_grid_ ? CombineSendForm::kCopyOnly
                                                                  : CombineSendForm::kGeneral;
  // Unpack's shared memory (see the kernel); above the default limit for very many ranks.
  unpack_smem_ = size_t(n) * sizeof(PeerIn) + size_t(RoundUp((3 * int64_t{n} + 1) * 8, 16)) +
                 size_t(n) * v.counts_stride * sizeof(int32_t) +
                 size_t((int64_t{n + 1} * v.local_experts + 1) / 2 * 2) * sizeof(int32_t) +
                 size_t(v.local_experts) * sizeof(int64_t);  // the expert bases
  if (unpack_smem_ > 48 * 1024) {
    for (auto* kernel : {dispatch::UnpackKernel<false, false>, dispatch::UnpackKernel<true, false>,
                         dispatch::UnpackKernel<false, true>, dispatch::UnpackKernel<true, true>}) {
      FERRY_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(unpack_smem_)));
    }
  }
  // The send kernels' grids are fixed (peers count our blocks' arrivals, see Arrive). Pack's is
  // what is resident at once: its warps stream rows one after another, and a second wave of
  // blocks only repeats the prologue (a few microseconds of a decode step; Unpack, whose
  // warps wait on pulled slots, keeps four blocks per SM).
  if (small_smem_ > 0) {
    send_grid_ = 1 + (t + kSmallWarps - 1) / kSmallWarps;  // block 0: the counts rows
  } else if (v.modes.stream()) {
    // Streamed, Unpack runs beside Pack: a block of each per SM (one block per SM already
    // stores into a peer at the link's rate: `ferry-bench p2p`), and Unpack's second block
    // per SM once Pack's leaves it (its groups claim slots as they come, see Claim).
    send_grid_ = std::min(t, sms);
  } else {
    int resident = 0;
    FERRY_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, dispatch::PackKernel, kCopyThreads,
                                                             2 * size_t(n) * sizeof(int64_t)));
    send_grid_ = std::min(t, std::max(resident, 1) * sms);
  }
  send_grid_ = std::max(send_grid_, 1);
  unpack_grid_ = recv_grid_;
  if (v.modes.stream()) {
    // Streamed, Unpack's groups claim slots until none is left (Claim), so no more blocks
    // than fit at once: a block past those starts only when one leaves, and blocks leave only
    // once every slot is claimed -- it would add its prologue (counts rows, offsets table,
    // ~2.4 us) to the step's end and take no slot (traced: with 256 blocks for 255 slots on
    // 66 SMs the last started 16-18 us in; EP8 decode: 528 blocks, 2 per SM fit).
    int resident = 0;
    FERRY_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, dispatch::UnpackKernel<true, false>,
                                                             kCopyThreads, unpack_smem_));
    unpack_grid_ =
        static_cast<int>(std::min<int64_t>(recv_grid_, int64_t{std::max(resident, 1)} * sms));
  }
  return Status::Ok();
}

// ---- the steps ----

// Quantised on the stream into rows of ours, which the send kernels then read as the caller's
// fp8 input (the next DispatchSend rewrites them only after this one's kernels, in stream order).
Status CudaDevice::Quantize(const DispatchInput& in, const void** x, const float** scales) {
  RETURN_IF_ERROR(Aligned(in.x_bf16, "DispatchSend: x_bf16"));
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  if (!fp8_x_.get()) {
    RETURN_IF_ERROR(fp8_x_.Allocate(size_t(c_.max_tokens_per_rank) * c_.hidden));
    RETURN_IF_ERROR(fp8_scales_.Allocate(size_t(c_.max_tokens_per_rank) * nv_.scales_per_token));
  }
  const int64_t warps = int64_t{in.num_tokens} * nv_.scales_per_token;
  const int blocks = static_cast<int>((warps * 32 + kQuantizeThreads - 1) / kQuantizeThreads);
  dispatch::QuantizeKernel<<<blocks, kQuantizeThreads, 0, stream_>>>(in.x_bf16, in.num_tokens, c_.hidden,
                                                           in.device_num_tokens, in.scaling,
                                                           fp8_x_.get(), fp8_scales_.get());
  FERRY_CUDA(cudaGetLastError());
  *x = fp8_x_.get();
  *scales = fp8_scales_.get();
  return Status::Ok();
}

Status CudaDevice::DispatchSend(const DispatchInput& in, uint64_t /*epoch: the kernels' own*/) {
  RETURN_IF_ERROR(Aligned(in.x, "DispatchSend: x"));
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  // Synchronous steps are strict: bad input sends nothing, and the step may be retried.
  const SendArgs args{static_cast<const uint8_t*>(in.x),
                      in.scales,
                      in.indices64 ? nullptr : in.indices,
                      in.indices64,
                      in.weights,
                      in.device_num_tokens,
                      in.num_tokens,
                      waited()};
  if (small_smem_ > 0) {
    if (nv_.masks) {
      dispatch::SendSmallKernel<true><<<send_grid_, kSmallThreads, small_smem_, stream_>>>(nv_, args);
    } else {
      dispatch::SendSmallKernel<false><<<send_grid_, kSmallThreads, small_smem_, stream_>>>(nv_, args);
    }
    FERRY_CUDA(cudaGetLastError());
    if (waited()) RETURN_IF_ERROR(Finish());
  } else {
    dispatch::RouteKernel<<<nv_.scan_blocks + nv_.chunks, kRouteThreads, 0, stream_>>>(nv_, args);
    FERRY_CUDA(cudaGetLastError());
    if (waited()) RETURN_IF_ERROR(Finish());
    FERRY_CUDA(Launch(dispatch::PackKernel, send_grid_, 2 * nv_.world_size * sizeof(int64_t), args));
  }
  token_bound_ = in.num_tokens;
  return Done();
}

Status CudaDevice::DispatchRecv(const DispatchOutput& out, uint64_t /*epoch*/, Deadline deadline) {
  RETURN_IF_ERROR(Aligned(out.x, "DispatchRecv: x"));
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  const int64_t block = out.expert_rows > 0 ? out.expert_rows : c_.expert_capacity();
  expert_rows_ = block;
  const RecvArgs args{
      static_cast<uint8_t*>(out.x),
      out.scales,
      out.num_tokens,
      BudgetNs(deadline),
      out.num_rows,
      out.token_experts,
      out.token_experts64,
      out.token_weights,
      out.expert_padding,
      out.expert_padding ? c_.padded_rows(out.expert_padding) : int64_t{nv_.local_experts} * block,
      block,
      out.wait_cost,
      out.source_tokens,
      out.sender_ranges,
      out.source_ranks};
  auto* unpack =
      nv_.masks ? (nv_.modes.stream() ? dispatch::UnpackKernel<true, true> : dispatch::UnpackKernel<false, true>)
                : (nv_.modes.stream() ? dispatch::UnpackKernel<true, false> : dispatch::UnpackKernel<false, false>);
  FERRY_CUDA(Launch(unpack, unpack_grid_, unpack_smem_, args));
  return Done();
}

Status CudaDevice::CombineSend(const CombineInput& in, uint64_t /*epoch*/) {
  RETURN_IF_ERROR(Aligned(in.expert_out, "CombineSend: expert output"));
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  const CombineArgs args{
      static_cast<const uint8_t*>(in.expert_out), nullptr, false, 0, nullptr, nullptr};
  const Elem elem = ElemOf(in.fp16);
  auto* kernel = combine_send_ == CombineSendForm::kCopyOnly ? combine::CombineSendKernel<true, Elem::kBf16>
                 : elem == Elem::kFp32                       ? combine::CombineSendKernel<false, Elem::kFp32>
                 : elem == Elem::kFp16                       ? combine::CombineSendKernel<false, Elem::kFp16>
                                       : combine::CombineSendKernel<false, Elem::kBf16>;
  kernel<<<recv_grid_, kCopyThreads, 0, stream_>>>(nv_, args);
  FERRY_CUDA(cudaGetLastError());
  return Done();
}

Status CudaDevice::CombineRecv(const CombineOutput& to, uint64_t /*epoch*/, Deadline deadline) {
  auto* out = static_cast<uint8_t*>(to.out);
  RETURN_IF_ERROR(Aligned(out, "CombineRecv: output"));
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  FERRY_CUDA(Launch(
      RecvKernel(nv_.modes.stream_combine(), ElemOf(to.fp16), to.fp32_out), TokenGrid(token_bound_),
      nv_.world_size * sizeof(int64_t),
      CombineArgs{nullptr, out, to.accumulate, BudgetNs(deadline), to.weights, to.wait_cost}));
  return Done();
}

}  // namespace ferry::moe
