// The NVLink AllToAll (design in nvlink_all_to_all.h): the host side that sets up the shared
// memory, the peer table and the relay, and enqueues the kernels (nvlink_send.cuh,
// nvlink_recv.cuh, nvlink_combine.cuh) step by step. The memory the ranks of a node share comes
// from common/cuda_shared_memory.h.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_shared_memory.h"
#include "common/fd_exchange.h"
#include "moe/cuda/nvlink_all_to_all.h"
#include "moe/cuda/nvlink_send.cuh"     // the kernels, in step order
#include "moe/cuda/nvlink_recv.cuh"
#include "moe/cuda/nvlink_combine.cuh"
#include "moe/cuda/nvlink_layout.h"
#include "moe/cuda/pinned_buffer.h"
#include "moe/cuda/relay_boxes.h"
#include "moe/steps.h"
#include "moe/relay.h"
#include "ferry/gpu_words.h"

namespace ferry::moe {
namespace {

using namespace nv;  // NOLINT: the kernels and their structs, this file's whole subject

// ---- the AllToAll -----------------------------------------------------------------------------

class NvlinkAllToAll final : public AllToAll {
 public:
  explicit NvlinkAllToAll(const AllToAllConfig& c) : c_(c), pairs_(c) {}

  // Waits for the device: kernels on the caller's stream (which may be gone by now) may still
  // use our memory.
  ~NvlinkAllToAll() override {
    cudaSetDevice(c_.cuda_device);
    cudaDeviceSynchronize();
    if (nv_.trace) PrintTrace();
    // A write the relay posted that never ended still reads the outbox: leak both boxes then.
    if (relay_ && !relay_->Stop()) boxes_.Leak();
    if (own_stream_) cudaStreamDestroy(own_stream_);
    if (order_event_) cudaEventDestroy(order_event_);
    for (cudaEvent_t e : marks_) {
      if (e) cudaEventDestroy(e);
    }
    if (error_) cudaFreeHost(error_);
  }

  // Collective; the stages below, in this order.
  Status Init(TransferEngine* engine, Bootstrap& bootstrap) {
    int sms = 0;
    RETURN_IF_ERROR(OpenDevice(&sms));
    ASSIGN_OR_RETURN(const int64_t bytes, PlanBuffer());
    RETURN_IF_ERROR(PlanGrids(sms));
    RETURN_IF_ERROR(CheckConfigurationsAgree(bootstrap));
    ASSIGN_OR_RETURN(const std::vector<uint8_t*> bases, MapNodeBuffers(bootstrap, bytes));
    const RelayLayout relay(c_, nv_.slot_bytes, c_.ranks_per_node);
    ASSIGN_OR_RETURN(const RelayBuffers mapped, StartRelay(relay, engine, bootstrap));
    ASSIGN_OR_RETURN(const std::vector<NvPeer> peers,
                     ExchangePeers(bootstrap, relay, mapped, bases));
    RETURN_IF_ERROR(AllocateDeviceState(peers, bases[c_.rank]));
    FERRY_CUDA(cudaDeviceSynchronize());
    // No rank writes into another before every buffer is zeroed and mapped.
    return bootstrap.Barrier(kExchangeTimeout);
  }

  const AllToAllConfig& config() const override { return c_; }

  Status SetStream(void* stream) override {
    RETURN_IF_ERROR(Sticky());
    if (stage_ != Stage::kIdle) {
      return FailedPreconditionError("SetStream: only between a CombineRecv and a DispatchSend");
    }
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    // Steps that waited for themselves left nothing to wait for (and a stream being captured
    // may be taken then: nothing here would end the capture).
    if (async_) FERRY_CUDA(cudaStreamSynchronize(stream_));
    stream_ = stream ? static_cast<cudaStream_t>(stream) : own_stream_;
    async_ = stream != nullptr;
    return Status::Ok();
  }

  // A stream is ordered with itself already: nothing to record or wait for.
  Status OrderAfter(void* stream) override {
    if (stream == stream_) return Status::Ok();
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    FERRY_CUDA(cudaEventRecord(order_event_, static_cast<cudaStream_t>(stream)));
    FERRY_CUDA(cudaStreamWaitEvent(stream_, order_event_, 0));
    return Status::Ok();
  }
  Status OrderBefore(void* stream) override {
    if (stream == stream_) return Status::Ok();
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    FERRY_CUDA(cudaEventRecord(order_event_, stream_));
    FERRY_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), order_event_, 0));
    return Status::Ok();
  }

  Status Mark(uint64_t* mark) override {
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    if (capturing(nullptr)) return FailedPreconditionError("Mark: the stream is being captured");
    cudaEvent_t& e = marks_[next_mark_ % kMarks];
    if (!e) FERRY_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    FERRY_CUDA(cudaEventRecord(e, stream_));
    *mark = next_mark_++;
    return Status::Ok();
  }
  Status Reached(uint64_t mark, bool wait, bool* reached) override {
    if (mark >= next_mark_) return InvalidArgumentError("Reached: mark " + std::to_string(mark) +
                                                        " was never made");
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    cudaEvent_t e = marks_[mark % kMarks];
    if (wait) {
      FERRY_CUDA(cudaEventSynchronize(e));
      *reached = true;
      return Status::Ok();
    }
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: still running
      *reached = false;
      return Status::Ok();
    }
    FERRY_CUDA(q);
    *reached = true;
    return Status::Ok();
  }

  bool capturing(void* stream) const override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    // An error here (a stream being destroyed) is not a capture: Poll's query then reports it.
    return cudaStreamIsCapturing(stream ? static_cast<cudaStream_t>(stream) : stream_, &status) ==
               cudaSuccess &&
           status != cudaStreamCaptureStatusNone;
  }

  Status Poll(bool* done) override {
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    if (capturing(nullptr)) {
      *done = false;
      return Status::Ok();
    }
    const cudaError_t idle = cudaStreamQuery(stream_);
    if (idle == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: still running
      volatile const int32_t* e = error_;
      if (failed_.ok() && e[0] == kNoError) {
        *done = false;
        return Status::Ok();
      }
    } else {
      FERRY_CUDA(idle);
    }
    *done = true;
    return Finish();
  }

  Status Synchronize() override {
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    return Finish();
  }

  // Checked as the host device checks them. Between a CombineRecv and a DispatchSend, once the
  // kernels read masks (mask_lost_peers, or a rank masked before), the mask is set at once on
  // the AllToAll's stream, ordered before whatever runs there next -- a CUDA graph's replay
  // included, which calls no step of ours; otherwise at the next DispatchSend (ApplyMasks).
  // No wait for the stream here: this may run while the stream is being captured.
  Status SetMasked(int rank, bool masked) override {
    const volatile int32_t* lost = error_ + 4;  // Nv::mask_mirror
    const bool now = rank >= 0 && rank < c_.world_size && (caller_masks_[rank] || lost[rank]);
    bool change = false;
    RETURN_IF_ERROR(CheckSetMasked(c_, rank, masked, now, &change));
    if (!change) return Status::Ok();
    caller_masks_[rank] = 1;
    pending_masks_[rank] = 1;
    if (stage_ == Stage::kIdle && nv_.masks) {
      FERRY_CUDA(cudaSetDevice(c_.cuda_device));
      return ApplyMasks();
    }
    return Status::Ok();
  }
  // Waits for the stream: the kernels mask a lost rank as they run (their mirror in host memory).
  StatusOr<std::vector<uint8_t>> Masked() const override {
    if (cudaSetDevice(c_.cuda_device) != cudaSuccess ||
        cudaStreamSynchronize(stream_) != cudaSuccess) {
      return InternalError("AllToAll::Masked: " +
                           std::string(cudaGetErrorString(cudaGetLastError())));
    }
    std::vector<uint8_t> masks(caller_masks_);
    volatile const int32_t* lost = error_ + 4;
    for (int r = 0; r < c_.world_size; ++r) masks[r] |= lost[r] != 0;
    return masks;
  }

  Status DispatchSend(const DispatchInput& given) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "DispatchSend"));
    RETURN_IF_ERROR(CheckDispatchInput(c_, given));
    DispatchInput in = given;
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    RETURN_IF_ERROR(ApplyMasks());
    if (in.x_bf16 && in.num_tokens > 0) {
      // Quantised on the stream into rows of ours, which the send kernels then read as the
      // caller's fp8 input (the next DispatchSend rewrites them only after this one's kernels,
      // in stream order).
      RETURN_IF_ERROR(Aligned(in.x_bf16, "DispatchSend: x_bf16"));
      if (!fp8_x_.get()) {
        RETURN_IF_ERROR(fp8_x_.Allocate(size_t(c_.max_tokens_per_rank) * c_.hidden));
        RETURN_IF_ERROR(
            fp8_scales_.Allocate(size_t(c_.max_tokens_per_rank) * nv_.scales_per_token));
      }
      const int64_t warps = int64_t{in.num_tokens} * nv_.scales_per_token;
      const int blocks = static_cast<int>((warps * 32 + kQuantizeThreads - 1) / kQuantizeThreads);
      QuantizeKernel<<<blocks, kQuantizeThreads, 0, stream_>>>(
          in.x_bf16, in.num_tokens, c_.hidden, in.device_num_tokens, in.scaling, fp8_x_.get(),
          fp8_scales_.get());
      FERRY_CUDA(cudaGetLastError());
      in.x = fp8_x_.get();
      in.scales = fp8_scales_.get();
    }
    RETURN_IF_ERROR(Aligned(in.x, "DispatchSend: x"));
    // Synchronous steps are strict: bad input sends nothing, and the step may be retried.
    const SendArgs args{static_cast<const uint8_t*>(in.x),
                        in.scales,
                        in.indices64 ? nullptr : in.indices,
                        in.indices64,
                        in.weights,
                        in.device_num_tokens,
                        in.num_tokens,
                        !async_};
    if (small_smem_ > 0) {
      if (nv_.masks) {
        SendSmallKernel<true><<<send_grid_, kSmallThreads, small_smem_, stream_>>>(nv_, args);
      } else {
        SendSmallKernel<false><<<send_grid_, kSmallThreads, small_smem_, stream_>>>(nv_, args);
      }
      FERRY_CUDA(cudaGetLastError());
      if (!async_) RETURN_IF_ERROR(Finish());
    } else {
      RouteKernel<<<nv_.scan_blocks + nv_.chunks, kRouteThreads, 0, stream_>>>(nv_, args);
      FERRY_CUDA(cudaGetLastError());
      if (!async_) RETURN_IF_ERROR(Finish());
      FERRY_CUDA(Launch(PackKernel, send_grid_, 2 * nv_.world_size * sizeof(int64_t), args));
    }
    token_bound_ = in.num_tokens;
    stage_ = Stage::kDispatchSent;
    return async_ ? Status::Ok() : Finish();
  }

  Status DispatchRecv(const DispatchOutput& out, Deadline deadline) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchSent, "DispatchRecv"));
    RETURN_IF_ERROR(CheckDispatchOutput(c_, out));
    RETURN_IF_ERROR(Aligned(out.x, "DispatchRecv: x"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    const int64_t block = out.expert_rows > 0 ? out.expert_rows : c_.expert_capacity();
    expert_rows_ = block;
    const RecvArgs args{static_cast<uint8_t*>(out.x),
                        out.scales,
                        out.num_tokens,
                        BudgetNs(deadline),
                        out.num_rows,
                        out.token_experts,
                        out.token_weights,
                        out.expert_padding,
                        out.expert_padding ? c_.padded_rows(out.expert_padding)
                                           : int64_t{nv_.local_experts} * block,
                        block,
                        out.wait_cost};
    auto* unpack = nv_.masks
                       ? (nv_.stream ? UnpackKernel<true, true> : UnpackKernel<false, true>)
                       : (nv_.stream ? UnpackKernel<true, false> : UnpackKernel<false, false>);
    FERRY_CUDA(Launch(unpack, unpack_grid_, unpack_smem_, args));
    stage_ = Stage::kDispatchDone;
    return async_ ? Status::Ok() : Finish();
  }

  using AllToAll::CombineSend;
  Status CombineSend(const CombineInput& in) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchDone, "CombineSend"));
    RETURN_IF_ERROR(CheckCombineInput(c_, in));
    RETURN_IF_ERROR(Aligned(in.expert_out, "CombineSend: expert output"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    const CombineArgs args{static_cast<const uint8_t*>(in.expert_out), nullptr, false, 0,
                           nullptr, nullptr};
    const Elem elem = ElemOf(in.fp16);
    auto* kernel = combine_copy_only_       ? CombineSendKernel<true, Elem::kBf16>
                   : elem == Elem::kFp32    ? CombineSendKernel<false, Elem::kFp32>
                   : elem == Elem::kFp16    ? CombineSendKernel<false, Elem::kFp16>
                                            : CombineSendKernel<false, Elem::kBf16>;
    kernel<<<recv_grid_, kCopyThreads, 0, stream_>>>(nv_, args);
    FERRY_CUDA(cudaGetLastError());
    sent_fp16_ = in.fp16;
    stage_ = Stage::kCombineSent;
    return async_ ? Status::Ok() : Finish();
  }

  Status CombineRecv(const CombineOutput& to, Deadline deadline) override {
    auto* out = static_cast<uint8_t*>(to.out);
    const bool accumulate = to.accumulate;
    RETURN_IF_ERROR(Step(Stage::kCombineSent, "CombineRecv"));
    RETURN_IF_ERROR(CheckCombineOutput(c_, to, sent_fp16_));
    if (!out && token_bound_ > 0) return InvalidArgumentError("CombineRecv: null output");
    RETURN_IF_ERROR(Aligned(out, "CombineRecv: output"));
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    auto* kernel = RecvKernel(ElemOf(to.fp16));
    FERRY_CUDA(Launch(kernel,
                      TokenGrid(token_bound_), nv_.world_size * sizeof(int64_t),
                      CombineArgs{nullptr, out, accumulate, BudgetNs(deadline), to.weights,
                                  to.wait_cost}));
    stage_ = Stage::kIdle;
    return async_ ? Status::Ok() : Finish();
  }

  // Read back after the steps ran (waits for them).
  uint64_t dispatch_bytes_sent() const override {
    std::vector<int32_t> totals(nv_.world_size, 0);
    cudaSetDevice(c_.cuda_device);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(totals.data(), nv_.totals, nv_.world_size * sizeof(int32_t), cudaMemcpyDeviceToHost);
    // What crosses per slot: its header and entries (and tag, streamed), row and scales (not
    // the padding that puts the row and the next slot on a line, which nobody writes).
    const uint64_t slot =
        nv_.meta_used + (nv_.stream ? 8 : 0) + nv_.payload + int64_t{nv_.scales_per_token} * 4;
    uint64_t bytes = 0;
    for (int r = 0; r < nv_.world_size; ++r) {
      if (r != c_.rank) bytes += uint64_t(totals[r]) * slot + (nv_.local_experts + 2) * 4;
    }
    return bytes;
  }
  uint64_t combine_bytes_sent() const override {
    Scratch s{};
    cudaSetDevice(c_.cuda_device);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(&s, nv_.scratch, sizeof s, cudaMemcpyDeviceToHost);
    // Each row, and its tag when streamed.
    return uint64_t(s.rows_out) * (nv_.row_bytes + (nv_.stream_combine ? 8 : 0));
  }

 private:
  Status Step(Stage want, const char* name) {
    RETURN_IF_ERROR(Sticky());
    return CheckStage(stage_, want, name);
  }

  // The masks SetMasked took since the last DispatchSend, into the device words before this
  // one's kernels (in stream order: the kernels of the epoch before still see the old ones).
  // From the first, the kernels read masks.
  Status ApplyMasks() {
    for (int r = 0; r < c_.world_size; ++r) {
      if (!pending_masks_[r]) continue;
      static_assert(kDeviceMaskedByCaller == 0x01010101, "each byte set to 1");
      FERRY_CUDA(cudaMemsetAsync(masks_.get() + r, 1, sizeof(int32_t), stream_));
      pending_masks_[r] = 0;
      nv_.masks = masks_.get();
    }
    return Status::Ok();
  }

  // A peer that missed a deadline ends this AllToAll (its flags can no longer be trusted); so
  // does a relay that stopped (a remote rank lost).
  Status Sticky() {
    if (!failed_.ok()) return failed_;
    if (relay_ && relay_->failed()) return failed_ = relay_->error();
    const int32_t code = reinterpret_cast<volatile int32_t*>(error_)[0];
    if (code == kPeerTimeout || code == kStepStalled) return Finish();
    return Status::Ok();
  }

  // For the last epoch, per kernel: each point's slowest and mean block time from the block's
  // start (µs) and, after @, when its last block reached it relative to the first DispatchSend
  // block (µs; the block's global-timer start plus its clock cycles at the nominal rate); then
  // its blocks' first and last start and last end relative to that block (µs, global timer).
  void PrintTrace() {
    static const char* const kNames[kTraceKernels] = {"DispatchSend", "Unpack", "CombineSend",
                                                      "CombineRecv", "Route"};
    std::vector<long long> stamps(size_t(kTraceKernels) * nv_.trace_blocks * kTraceSlots);
    int khz = 0;
    if (cudaMemcpy(stamps.data(), nv_.trace, stamps.size() * 8, cudaMemcpyDeviceToHost) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, c_.cuda_device) != cudaSuccess ||
        khz <= 0) {
      return;
    }
    auto block = [&](int k, int b) { return &stamps[(size_t(k) * nv_.trace_blocks + b) * kTraceSlots]; };
    long long epoch = 0, origin = 0;
    for (int b = 0; b < nv_.trace_blocks; ++b) epoch = std::max(epoch, block(kTraceSend, b)[kTraceEpoch]);
    for (int b = 0; b < nv_.trace_blocks; ++b) {
      const long long* at = block(kTraceSend, b);
      if (at[kTraceEpoch] == epoch && (origin == 0 || at[kTraceStartNs] < origin)) {
        origin = at[kTraceStartNs];
      }
    }
    // The origin itself, so that ranks sharing one GPU's timer (MPS) can be lined up.
    std::fprintf(stderr, "[rank %d] trace origin %lld ns; grids: send %d, unpack %d; %d SMs\n",
                 c_.rank, origin, send_grid_, unpack_grid_, recv_grid_limit_ / 4);
    for (int k = 0; k < kTraceKernels; ++k) {
      std::string line = "[rank " + std::to_string(c_.rank) + "] trace " + kNames[k] + ":";
      for (int p = 1; p < kTracePoints; ++p) {
        double slowest = 0, sum = 0, latest = 0;  // latest: from the origin, global timer
        int blocks = 0;
        for (int b = 0; b < nv_.trace_blocks; ++b) {
          const long long* at = block(k, b);
          if (at[kTraceEpoch] != epoch || at[p] == 0) continue;
          const double us = double(at[p] - at[0]) / khz * 1e3;
          slowest = std::max(slowest, us);
          latest = std::max(latest, (at[kTraceStartNs] - origin) / 1e3 + us);
          sum += us;
          ++blocks;
        }
        if (blocks == 0) continue;
        char part[96];
        std::snprintf(part, sizeof part, " p%d %.2f/%.2f@%.2f (%d)", p, slowest, sum / blocks,
                      latest, blocks);
        line += part;
      }
      long long first = 0, last = 0, end = 0;
      for (int b = 0; b < nv_.trace_blocks; ++b) {
        const long long* at = block(k, b);
        if (at[kTraceEpoch] != epoch) continue;
        first = first == 0 ? at[kTraceStartNs] : std::min(first, at[kTraceStartNs]);
        last = std::max(last, at[kTraceStartNs]);
        end = std::max(end, at[kTraceLastNs]);
      }
      if (first == 0) continue;  // not run this step (Route: decode batches)
      char part[128];
      std::snprintf(part, sizeof part, " | started %.2f..%.2f ended %.2f", (first - origin) / 1e3,
                    (last - origin) / 1e3, (end - origin) / 1e3);
      std::fprintf(stderr, "%s%s\n", line.c_str(), part);
    }
  }

  // ---- set-up stages (Init) ----

  static constexpr auto kExchangeTimeout = std::chrono::seconds(60);

  // Slots a rank may receive in one step: the receive grids and tables are sized by it.
  int64_t MaxReceived() const { return int64_t{c_.world_size} * pairs_.slots_per_pair; }

  // The device and our own stream; its SM count into *sms.
  Status OpenDevice(int* sms) {
    if (c_.cuda_device >= CudaDeviceCount()) {
      return FailedPreconditionError("AllToAll: CUDA device " + std::to_string(c_.cuda_device) +
                                     " does not exist (" + std::to_string(CudaDeviceCount()) +
                                     " visible)");
    }
    FERRY_CUDA(cudaSetDevice(c_.cuda_device));
    FERRY_CUDA(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    stream_ = own_stream_;
    // One event serves every ordering: a wait takes the event's state when it is enqueued.
    FERRY_CUDA(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
    FERRY_CUDA(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, c_.cuda_device));
    return Status::Ok();
  }

  // The shared buffer's layout (see nvlink_all_to_all.h) into nv_, with what decides it: which
  // DispatchSend kernels serve (SendSmall or Route + Pack) and which steps are streamed. Its
  // size in bytes.
  StatusOr<int64_t> PlanBuffer() {
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
    // Streaming (one node, no relay; CudaTuning::stream says which steps, the ranks agreeing
    // through the config's fingerprint): the default streams the dispatch where SendSmall
    // sends it. The dispatch's slot tag follows the entries, within the metadata's line.
    // Under mask_lost_peers nothing streams and the counts rows are read once the flags are up:
    // those waits are per block and per slot, and a step's masks are decided once (Nv::mask_lost).
    const int stream_mask = c_.mask_lost_peers  ? 0
                            : c_.cuda.stream >= 0 ? c_.cuda.stream
                            : small_smem_ > 0     ? 1
                                                  : 0;
    const NvlinkLayout layout(c_, stream_mask);
    v.counts_tagged = layout.counts_tagged && !c_.mask_lost_peers;
    v.mask_lost = c_.mask_lost_peers;
    v.stream = layout.stream;
    v.stream_combine = layout.stream_combine;
    v.meta_used = layout.slot.meta_used;
    v.meta_bytes = layout.slot.meta_bytes;
    v.slot_bytes = layout.slot.slot_bytes;
    v.row_bytes = c_.combine_row_bytes();
    v.capacity = c_.expert_capacity();
    v.once = c_.dispatch_once_per_rank;
    v.reduce = c_.combine_reduce_at_expert_rank;
    v.token_major = c_.dispatch_layout == DispatchLayout::kTokenMajor;
    v.slots_per_pair = pairs_.slots_per_pair;
    v.counts_off = layout.counts_off;
    v.counts_stride = layout.counts_stride;
    v.private_off = layout.private_off;
    v.combine_off = layout.combine_off;
    v.combine_tag_off = layout.combine_tag_off;
    v.send_off = layout.send_off;
    return layout.bytes;
  }

  // Every kernel's grid and shared memory, and the launch settings (CudaTuning).
  Status PlanGrids(int sms) {
    Nv& v = nv_;
    const int n = c_.world_size, t = c_.max_tokens_per_rank;
    const int64_t max_recv = MaxReceived();
    recv_grid_ = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_recv, 4 * sms)));
    recv_grid_limit_ = 4 * sms;
    // Token-major CombineSend only copies. Its copy-only instance (32 registers, not 124) is
    // faster when every received row has a block of its own (decode: 17.5 against 19.0 us), but
    // slower when blocks loop over many rows (prefill: 195-200 against 185 us, with 528 or 264
    // blocks; not explained yet), so it serves batches that fit the grid.
    combine_copy_only_ = v.token_major && max_recv <= recv_grid_;
    // Unpack's shared memory (see the kernel); above the default limit for very many ranks.
    unpack_smem_ = size_t(n) * sizeof(PeerIn) + size_t(RoundUp((3 * int64_t{n} + 1) * 8, 16)) +
                   size_t(n) * v.counts_stride * sizeof(int32_t) +
                   size_t((int64_t{n + 1} * v.local_experts + 1) / 2 * 2) * sizeof(int32_t) +
                   size_t(v.local_experts) * sizeof(int64_t);  // the expert bases
    if (unpack_smem_ > 48 * 1024) {
      for (auto* kernel : {UnpackKernel<false, false>, UnpackKernel<true, false>,
                           UnpackKernel<false, true>, UnpackKernel<true, true>}) {
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
    } else if (v.stream) {
      // Streamed, Unpack runs beside Pack: a block of each per SM (one block per SM already
      // stores into a peer at the link's rate: `ferry-bench p2p`), and Unpack's second block
      // per SM once Pack's leaves it (its groups claim slots as they come, see Claim).
      send_grid_ = std::min(t, sms);
    } else {
      int resident = 0;
      FERRY_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &resident, PackKernel, kCopyThreads, 2 * size_t(n) * sizeof(int64_t)));
      send_grid_ = std::min(t, std::max(resident, 1) * sms);
    }
    send_grid_ = std::max(send_grid_, 1);
    unpack_grid_ = recv_grid_;
    if (v.stream) {
      // Streamed, Unpack's groups claim slots until none is left (Claim), so no more blocks
      // than fit at once: a block past those starts only when one leaves, and blocks leave only
      // once every slot is claimed -- it would add its prologue (counts rows, offsets table,
      // ~2.4 us) to the step's end and take no slot (traced: with 256 blocks for 255 slots on
      // 66 SMs the last started 16-18 us in; EP8 decode: 528 blocks, 2 per SM fit).
      int resident = 0;
      FERRY_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, UnpackKernel<true, false>,
                                                               kCopyThreads, unpack_smem_));
      unpack_grid_ = static_cast<int>(
          std::min<int64_t>(recv_grid_, int64_t{std::max(resident, 1)} * sms));
    }
    // CudaTuning: the receive kernels launched early (programmatic dependent launch) or
    // plainly; received slots visited spread over their senders (SpreadOrder) or in order.
    pdl_ = c_.cuda.early_receive;
    v.spread = c_.cuda.spread;
    return Status::Ok();
  }

  // InvalidArgument naming a rank whose configuration differs from ours.
  Status CheckConfigurationsAgree(Bootstrap& bootstrap) {
    const int n = c_.world_size;
    ASSIGN_OR_RETURN(auto prints, bootstrap.AllGather(c_.Fingerprint(), kExchangeTimeout));
    for (int r = 0; r < n; ++r) {
      if (prints[r] != prints[c_.rank]) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                    " has a different configuration than rank " +
                                    std::to_string(c_.rank) + " (" + c_.ToString() + ")");
      }
    }
    return Status::Ok();
  }

  // Our buffer (cuMemCreate, exported) and every other member's of our node, mapped here; by
  // rank, null outside our node.
  StatusOr<std::vector<uint8_t*>> MapNodeBuffers(Bootstrap& bootstrap, int64_t bytes) {
    const int n = c_.world_size;
    int fd = -1;
    RETURN_IF_ERROR(shared_.Create(c_.cuda_device, bytes, &fd));
    const int per_node = c_.ranks_per_node, first = c_.rank / per_node * per_node;
    std::vector<int> members(per_node);
    for (int i = 0; i < per_node; ++i) members[i] = first + i;
    auto fds = ExchangeFds(bootstrap, members, fd, kExchangeTimeout);
    close(fd);
    RETURN_IF_ERROR(fds.status());
    std::vector<uint8_t*> bases(n, nullptr);
    Status imported = Status::Ok();
    for (int i = 0; i < per_node; ++i) {
      const int r = members[i];
      if (r == c_.rank) {
        bases[r] = shared_.own();
      } else if (imported.ok()) {
        auto base = shared_.Import((*fds)[i]);
        if (base.ok()) bases[r] = *base; else imported = base.status();
      }
      close((*fds)[i]);
    }
    RETURN_IF_ERROR(imported);
    return bases;
  }

  // Other nodes: the relay's inbox and outbox (GPU or pinned host memory), its control block
  // (pinned host memory), and the relay. The buffers as the kernels address them (nothing
  // where every rank is in our node).
  StatusOr<RelayBuffers> StartRelay(const RelayLayout& relay, TransferEngine* engine,
                                    Bootstrap& bootstrap) {
    Nv& v = nv_;
    v.first_remote = relay.remotes.empty() ? -1 : relay.remotes.front();
    if (!relay.remotes.empty() && relay.counts_bytes != int64_t{v.counts_stride} * 4) {
      return InternalError("moe: the relay's counts row and the kernels' differ in size");
    }
    if (relay.remotes.empty()) return RelayBuffers{};
    RETURN_IF_ERROR(boxes_.Place(c_, relay, engine));
    ASSIGN_OR_RETURN(relay_, Relay::Create(c_, relay, engine, bootstrap, boxes_.host(), 60000));
    return boxes_.mapped();
  }

  // Every rank as the kernels reach it: NodePeer in our node, RemotePeer (the relay) outside;
  // with what each rank's send grid adds to its flags (exchanged) and the check that every rank
  // streams the same steps.
  StatusOr<std::vector<NvPeer>> ExchangePeers(Bootstrap& bootstrap, const RelayLayout& relay,
                                              const RelayBuffers& mapped,
                                              const std::vector<uint8_t*>& bases) {
    const int n = c_.world_size;
    // Every rank's send grids (what its flags for us gain per epoch).
    std::vector<uint8_t> grids(2 * sizeof(int32_t));
    const int32_t mine[2] = {send_grid_, recv_grid_};
    std::memcpy(grids.data(), mine, sizeof mine);
    ASSIGN_OR_RETURN(auto all_grids, bootstrap.AllGather(grids, kExchangeTimeout));
    std::vector<NvPeer> peers(n);
    for (int r = 0; r < n; ++r) {
      if (all_grids[r].size() != sizeof mine) {
        return InternalError("AllToAll: rank " + std::to_string(r) + " sent malformed grids");
      }
      int32_t theirs[2];
      std::memcpy(theirs, all_grids[r].data(), sizeof theirs);
      if (relay.Remote(r)) {
        peers[r] = RemotePeer(relay, mapped, boxes_.device_flags(), r);
      } else {
        peers[r] = NodePeer(bases[c_.rank], bases[r], r);
        peers[r].dispatch_step = theirs[0];
        peers[r].combine_step = theirs[1];
      }
    }
    return peers;
  }

  // The kernels' device state (peers, scratch, routing copies, receive tables, the error words,
  // CudaTuning::trace's stamps) and nv_'s pointers to it.
  Status AllocateDeviceState(const std::vector<NvPeer>& peers, uint8_t* own) {
    Nv& v = nv_;
    const int n = c_.world_size, k = c_.experts_per_token, t = c_.max_tokens_per_rank;
    RETURN_IF_ERROR(peers_.Allocate(n));
    FERRY_CUDA(cudaMemcpy(peers_.get(), peers.data(), n * sizeof(NvPeer), cudaMemcpyHostToDevice));
    RETURN_IF_ERROR(scratch_.Allocate(1));
    FERRY_CUDA(cudaMemset(scratch_.get(), 0, sizeof(Scratch)));
    RETURN_IF_ERROR(indices_.Allocate(size_t(t) * k));
    RETURN_IF_ERROR(weights_.Allocate(size_t(t) * k));
    RETURN_IF_ERROR(row_pos_.Allocate(size_t(n) * t));
    RETURN_IF_ERROR(totals_.Allocate(2 * size_t(n)));
    if (small_smem_ == 0) {  // Route's output, read by Pack only
      RETURN_IF_ERROR(slot_pos_.Allocate(size_t(n) * t));
      RETURN_IF_ERROR(erank_.Allocate(size_t(t) * k));
      RETURN_IF_ERROR(chunk_counts_.Allocate(size_t(v.chunks) * v.experts));
      RETURN_IF_ERROR(scan_carry_.Allocate(size_t(t + kRouteThreads - 1) / kRouteThreads * n));
    }
    RETURN_IF_ERROR(rslots_.Allocate(MaxReceived()));
    RETURN_IF_ERROR(rentries_.Allocate(size_t(MaxReceived()) * k));
    RETURN_IF_ERROR(masks_.Allocate(n));
    FERRY_CUDA(cudaMemset(masks_.get(), 0, n * sizeof(int32_t)));
    // The error words [4], then the lost-rank mirror [N] (Nv::mask_mirror).
    const size_t host_words = 4 + size_t(n);
    void* error = nullptr;
    FERRY_CUDA(cudaHostAlloc(&error, host_words * sizeof(int32_t), cudaHostAllocMapped |
                                                                   cudaHostAllocPortable));
    error_ = static_cast<int32_t*>(error);
    std::memset(error_, 0, host_words * sizeof(int32_t));
    void* error_dev = nullptr;
    FERRY_CUDA(cudaHostGetDevicePointer(&error_dev, error, 0));
    v.masks = c_.mask_lost_peers ? masks_.get() : nullptr;  // else from the first SetMasked
    v.mask_mirror = static_cast<int32_t*>(error_dev) + 4;
    v.own = own;
    v.peer = peers_.get();
    v.scratch = scratch_.get();
    v.error = static_cast<int32_t*>(error_dev);
    v.indices = indices_.get();
    v.weights = weights_.get();
    v.slot_pos = slot_pos_.get();
    v.row_pos = row_pos_.get();
    v.totals = totals_.get();
    v.erank = erank_.get();
    v.chunk_counts = chunk_counts_.get();
    v.scan_carry = scan_carry_.get();
    v.rslots = rslots_.get();
    v.rentries = rentries_.get();
    if (c_.cuda.trace) {
      v.trace_blocks = recv_grid_limit_;
      RETURN_IF_ERROR(trace_.Allocate(size_t(kTraceKernels) * v.trace_blocks * kTraceSlots));
      FERRY_CUDA(cudaMemset(trace_.get(), 0,
                            size_t(kTraceKernels) * v.trace_blocks * kTraceSlots * 8));
      v.trace = trace_.get();
    }
    return Status::Ok();
  }

  // Rank r of our node: its buffer `theirs` (mapped here) and ours, `own`.
  NvPeer NodePeer(uint8_t* own, uint8_t* theirs, int r) const {
    const Nv& v = nv_;
    const int64_t width = v.counts_stride;
    NvPeer p{};
    p.dispatch_flag = reinterpret_cast<uint64_t*>(theirs) + v.rank;
    p.combine_flag = reinterpret_cast<uint64_t*>(theirs) + v.world_size + v.rank;
    p.counts = reinterpret_cast<int32_t*>(theirs + v.counts_off) + v.rank * width;
    p.slots = theirs + v.private_off + int64_t{v.rank} * v.private_slots * v.slot_bytes;
    p.combine = theirs + v.combine_off;
    if (v.stream_combine) p.combine_tags = reinterpret_cast<uint64_t*>(theirs + v.combine_tag_off);
    p.dispatch_flag_in = reinterpret_cast<uint64_t*>(own) + r;
    p.combine_flag_in = reinterpret_cast<uint64_t*>(own) + v.world_size + r;
    p.counts_in = reinterpret_cast<int32_t*>(own + v.counts_off) + r * width;
    p.slots_in = own + v.private_off + int64_t{r} * v.private_slots * v.slot_bytes;
    p.pull = theirs + v.send_off;
    p.combine_in = own + v.combine_off;
    p.slot_cap = v.private_slots;
    p.row_cap = static_cast<int32_t>(int64_t{v.max_tokens} * v.topk);
    return p;
  }

  // Rank r of another node: our outbox section for it, our inbox section from it, the relay's
  // control words and the flags it raises for us (device pointers: `mapped` as the kernels
  // address the relay's buffers, `flags_in` the inbox flags, [2N] dispatch then combine).
  static NvPeer RemotePeer(const RelayLayout& relay, const RelayBuffers& mapped,
                           uint64_t* flags_in, int r) {
    const int q = relay.RemoteIndex(relay.me, r);
    uint8_t* const inbox = mapped.inbox;
    uint8_t* const outbox = mapped.outbox;
    NvPeer p{};
    p.dispatch_flag = relay.OutboxFlag(mapped.control, false);
    p.combine_flag = relay.OutboxFlag(mapped.control, true);
    p.counts = reinterpret_cast<int32_t*>(outbox + relay.OutSection(q));
    p.slots = outbox + relay.OutSection(q) + relay.counts_bytes;
    p.combine = outbox + relay.OutRows(q);
    p.dispatch_flag_in = flags_in + r;
    p.combine_flag_in = flags_in + relay.n + r;
    p.counts_in = reinterpret_cast<int32_t*>(inbox + relay.InSection(q));
    p.slots_in = inbox + relay.InSection(q) + relay.counts_bytes;
    p.pull = nullptr;
    p.combine_in = inbox + relay.in_combine_off;
    p.slot_cap = static_cast<int32_t>(relay.slots_per_pair);
    p.row_cap = static_cast<int32_t>(relay.rows_per_pair);
    p.remote = 1;
    p.dispatch_step = p.combine_step = 1;  // the relay stores "epoch + 1"
    p.relay_slots = relay.OutSlots(mapped.control, q);
    p.relay_rows = relay.InRows(mapped.control, q);
    p.relay_mask = relay.MaskWord(mapped.control, r);
    return p;
  }

  // A kernel on our stream allowed to start while the kernel before it runs (see
  // LaunchDependents): the receive kernels, and Pack behind Route; CudaTuning::early_receive false
  // launches them plainly.
  template <typename Args>
  cudaError_t Launch(void (*kernel)(Nv, Args), int grid, size_t smem, const Args& args) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kCopyThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream_;
    cudaLaunchAttribute early{};
    early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &early;
    config.numAttrs = pdl_ ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, nv_, args);
  }

  // Blocks of the per-token kernels: one per token up to four per SM (then they loop).
  int TokenGrid(int tokens) const { return std::max(1, std::min(tokens, recv_grid_limit_)); }

  // The kernels move rows as 16-byte vectors.
  static Status Aligned(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return Status::Ok();
    return InvalidArgumentError(std::string(what) + " must be 16-byte aligned");
  }

  static uint64_t BudgetNs(Deadline deadline) {
    const auto left = deadline.at - Clock::now();
    return left.count() <= 0
               ? 0
               : static_cast<uint64_t>(
                     std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
  }

  // Waits for the stream; what a kernel reported becomes the Status (and is cleared, except a
  // peer timeout, which stays).
  Status Finish() {
    FERRY_CUDA(cudaStreamSynchronize(stream_));
    if (!failed_.ok()) return failed_;
    volatile int32_t* e = error_;
    const int32_t code = e[0], a = e[1], b = e[2];
    if (code == kNoError) return Status::Ok();
    e[1] = 0;
    e[2] = 0;
    e[0] = 0;
    FERRY_CUDA(cudaMemsetAsync(&nv_.scratch->error, 0, sizeof(int32_t), stream_));
    switch (code) {
      case kBadExpert:
        return OutOfRangeError("DispatchSend: token " + std::to_string(a) + " routes to expert " +
                               std::to_string(b) + ", valid ids are [0, " +
                               std::to_string(c_.num_experts) + ")");
      case kTooManyTokens:
        return InvalidArgumentError("DispatchSend: the device token count is " +
                                    std::to_string(a) + ", above num_tokens " +
                                    std::to_string(b) + " (nothing was sent)");
      case kBadSlot:
        return DataLossError("moe NVLink: malformed slot " + std::to_string(b) + " from rank " +
                             std::to_string(a));
      case kRowOverrun:
        return DataLossError("moe NVLink: local expert " + std::to_string(b) +
                             " received more rows than its capacity");
      case kExpertFull:
        (void)(failed_ = ResourceExhaustedError(
            "moe NVLink: local expert " + std::to_string(b) + " received " + std::to_string(a) +
            " copies, more than the " + std::to_string(expert_rows_) +
            " rows of its output block (DispatchOutput::expert_rows; the copies past it were "
            "dropped); this AllToAll is unusable"));
        return failed_;
      case kStepStalled:
        (void)(failed_ = DeadlineExceededError(
            std::string("moe NVLink: block ") + std::to_string(b) + " of the " +
            (a == 0 ? "dispatch" : "combine") +
            " receive kernel waited a second past the deadline for its first block's wait (a "
            "GPU too oversubscribed to run the step's blocks); this AllToAll is unusable"));
        return failed_;
      default:
        (void)(failed_ = DeadlineExceededError(
            std::string("moe NVLink: rank ") + std::to_string(b) + " did not deliver its " +
            (a == 0 ? "dispatch" : "combine") +
            " before the deadline (a lost or stalled peer); this AllToAll is unusable"));
        return failed_;
    }
  }

  const AllToAllConfig c_;
  const PairLimits pairs_;
  Nv nv_{};
  SharedCudaMemory shared_;
  RelayBoxes boxes_;  // other nodes: the relay's memory (relay_boxes.h)
  std::unique_ptr<Relay> relay_;
  DeviceArray<NvPeer> peers_;
  DeviceArray<Scratch> scratch_;
  DeviceArray<int32_t> indices_, slot_pos_, row_pos_, totals_, erank_, chunk_counts_;
  DeviceArray<int32_t> masks_;  // Nv::masks
  std::vector<uint8_t> caller_masks_ = std::vector<uint8_t>(size_t(c_.world_size));
  std::vector<uint8_t> pending_masks_ = std::vector<uint8_t>(size_t(c_.world_size));
  DeviceArray<int64_t> scan_carry_;
  DeviceArray<float> weights_;
  DeviceArray<uint8_t> fp8_x_;  // DispatchInput::x_bf16 quantised (allocated at its first use)
  DeviceArray<float> fp8_scales_;
  DeviceArray<RecvSlot> rslots_;
  DeviceArray<RecvEntry> rentries_;
  DeviceArray<long long> trace_;
  int32_t* error_ = nullptr;  // pinned, mapped: [4] the error words, [N] Nv::mask_mirror
  cudaStream_t own_stream_ = nullptr, stream_ = nullptr;
  cudaEvent_t order_event_ = nullptr;  // OrderAfter / OrderBefore
  std::array<cudaEvent_t, kMarks> marks_{};  // Mark's ring, created at their first use
  uint64_t next_mark_ = 0;
  bool async_ = false;
  int send_grid_ = 1;  // DispatchSend's (SendSmall or Pack), fixed
  int recv_grid_ = 1;  // CombineSend's, and Unpack's unless streamed
  int unpack_grid_ = 0;  // Unpack's
  bool combine_copy_only_ = false;  // CombineSend's copy-only instance (token-major, small batches)
  bool sent_fp16_ = false;  // the last CombineSend's CombineInput::fp16
  // The combine's element: fp32 (combines_fp32), else as the step was told.
  Elem ElemOf(bool fp16) const {
    return c_.combines_fp32() ? Elem::kFp32 : fp16 ? Elem::kFp16 : Elem::kBf16;
  }
  // CombineRecv's kernel for the element (streamed or not).
  using CombineKernel = void (*)(Nv, CombineArgs);
  CombineKernel RecvKernel(Elem e) const {
    if (nv_.stream_combine) {
      return e == Elem::kFp32   ? CombineRecvStreamedKernel<Elem::kFp32>
             : e == Elem::kFp16 ? CombineRecvStreamedKernel<Elem::kFp16>
                                : CombineRecvStreamedKernel<Elem::kBf16>;
    }
    return e == Elem::kFp32   ? CombineRecvKernel<Elem::kFp32>
           : e == Elem::kFp16 ? CombineRecvKernel<Elem::kFp16>
                              : CombineRecvKernel<Elem::kBf16>;
  }
  int recv_grid_limit_ = 1;
  bool pdl_ = true;    // receive kernels may start early (Launch)
  int token_bound_ = 0;
  size_t small_smem_ = 0;  // SendSmallKernel's shared memory; 0: Route and Pack instead
  size_t unpack_smem_ = 0;
  Stage stage_ = Stage::kIdle;
  Status failed_ = Status::Ok();
  int64_t expert_rows_ = 0;  // the last DispatchRecv's expert block (for its overflow's error)
};

}  // namespace

StatusOr<std::unique_ptr<AllToAll>> NewNvlinkAllToAll(const AllToAllConfig& config,
                                                      TransferEngine* engine,
                                                      Bootstrap& bootstrap) {
  if (config.device != MoeDeviceKind::kCuda) {
    return InvalidArgumentError("CUDA AllToAll: config.device is not kCuda");
  }
  auto a2a = std::make_unique<NvlinkAllToAll>(config);
  RETURN_IF_ERROR(a2a->Init(engine, bootstrap));
  return std::unique_ptr<AllToAll>(std::move(a2a));
}

}  // namespace ferry::moe
