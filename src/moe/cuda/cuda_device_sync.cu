// The CUDA device's host side that waits and reports (design in cuda_device.h): the stream
// calls, the rank masks, the error words the kernels fill, and CudaTuning::trace's stamps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "moe/cuda/cuda_device.h"

namespace ferry::moe {

using namespace nv;  // NOLINT: the kernels' structs, what this file reads back

// ---- streams ----

Status CudaDevice::SetStream(void* stream) {
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  // Steps that waited for themselves left nothing to wait for (and a stream being captured
  // may be taken then: nothing here would end the capture).
  if (!waited()) FERRY_CUDA(cudaStreamSynchronize(stream_));
  stream_ = stream ? static_cast<cudaStream_t>(stream) : own_stream_;
  completion_ = stream ? Completion::kOnCallerStream : Completion::kWaited;
  return Status::Ok();
}

// A stream is ordered with itself already: nothing to record or wait for.
Status CudaDevice::OrderAfter(void* stream) {
  if (stream == stream_) return Status::Ok();
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  FERRY_CUDA(cudaEventRecord(order_event_, static_cast<cudaStream_t>(stream)));
  FERRY_CUDA(cudaStreamWaitEvent(stream_, order_event_, 0));
  return Status::Ok();
}

Status CudaDevice::OrderBefore(void* stream) {
  if (stream == stream_) return Status::Ok();
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  FERRY_CUDA(cudaEventRecord(order_event_, stream_));
  FERRY_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), order_event_, 0));
  return Status::Ok();
}

Status CudaDevice::Mark(uint64_t* mark) {
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  if (capturing(nullptr)) return FailedPreconditionError("Mark: the stream is being captured");
  cudaEvent_t& e = marks_[next_mark_ % AllToAll::kMarks];
  if (!e) FERRY_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  FERRY_CUDA(cudaEventRecord(e, stream_));
  *mark = next_mark_++;
  return Status::Ok();
}

Status CudaDevice::Reached(uint64_t mark, bool wait, bool* reached) {
  if (mark >= next_mark_)
    return InvalidArgumentError("Reached: mark " + std::to_string(mark) + " was never made");
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  cudaEvent_t e = marks_[mark % AllToAll::kMarks];
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

bool CudaDevice::capturing(void* stream) const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  // An error here (a stream being destroyed) is not a capture: Poll's query then reports it.
  return cudaStreamIsCapturing(stream ? static_cast<cudaStream_t>(stream) : stream_, &status) ==
             cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

Status CudaDevice::Poll(bool* done) {
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

Status CudaDevice::Synchronize() {
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  return Finish();
}

// ---- masks ----

// The caller's masks into the device words before the next kernels (in stream order: the
// kernels of the epoch before still see the old ones); from the first, the kernels read masks.
// No wait for the stream here: this may run while the stream is being captured.
Status CudaDevice::ApplyMasks(const std::vector<uint8_t>& ranks) {
  FERRY_CUDA(cudaSetDevice(c_.cuda_device));
  for (int r = 0; r < c_.world_size; ++r) {
    if (!ranks[r]) continue;
    static_assert(kDeviceMaskedByCaller == 0x01010101, "each byte set to 1");
    FERRY_CUDA(cudaMemsetAsync(masks_.get() + r, 1, sizeof(int32_t), stream_));
    nv_.masks = masks_.get();
  }
  return Status::Ok();
}

// Waits for the stream: the kernels mask a lost rank as they run (their mirror in host memory).
// The caller's masks are the shell's; this reports the ranks the kernels masked.
StatusOr<std::vector<uint8_t>> CudaDevice::Masked() const {
  if (cudaSetDevice(c_.cuda_device) != cudaSuccess ||
      cudaStreamSynchronize(stream_) != cudaSuccess) {
    return InternalError("AllToAll::Masked: " +
                         std::string(cudaGetErrorString(cudaGetLastError())));
  }
  std::vector<uint8_t> masks(size_t(c_.world_size));
  volatile const int32_t* lost = error_ + 4;  // Nv::mask_mirror
  for (int r = 0; r < c_.world_size; ++r) masks[r] = lost[r] != 0;
  return masks;
}

// ---- bytes on the wire ----

// Read back after the steps ran (waits for them).
uint64_t CudaDevice::dispatch_bytes_sent() const {
  std::vector<int32_t> totals(nv_.world_size, 0);
  cudaSetDevice(c_.cuda_device);
  cudaStreamSynchronize(stream_);
  cudaMemcpy(totals.data(), nv_.totals, nv_.world_size * sizeof(int32_t), cudaMemcpyDeviceToHost);
  // What crosses per slot: its header and entries (and tag, streamed), row and scales (not
  // the padding that puts the row and the next slot on a line, which nobody writes).
  const uint64_t slot = nv_.meta_used + (nv_.modes.stream() ? 8 : 0) + nv_.payload +
                        int64_t{nv_.scales_per_token} * 4;
  uint64_t bytes = 0;
  for (int r = 0; r < nv_.world_size; ++r) {
    if (r != c_.rank) bytes += uint64_t(totals[r]) * slot + (nv_.local_experts + 2) * 4;
  }
  return bytes;
}

uint64_t CudaDevice::combine_bytes_sent() const {
  Scratch s{};
  cudaSetDevice(c_.cuda_device);
  cudaStreamSynchronize(stream_);
  cudaMemcpy(&s, nv_.scratch, sizeof s, cudaMemcpyDeviceToHost);
  // Each row, and its tag when streamed.
  return uint64_t(s.rows_out) * (nv_.row_bytes + (nv_.modes.stream_combine() ? 8 : 0));
}

// ---- errors ----

// A peer that missed a deadline ends this device (its flags can no longer be trusted); so does a
// relay that stopped (a remote rank lost).
Status CudaDevice::Sticky() {
  if (!failed_.ok()) return failed_;
  if (relay_ && relay_->failed()) return failed_ = relay_->error();
  const int32_t code = reinterpret_cast<volatile int32_t*>(error_)[0];
  if (code == kPeerTimeout || code == kStepStalled) return Finish();
  return Status::Ok();
}

Status CudaDevice::Finish() {
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
      return InvalidArgumentError("DispatchSend: the device token count is " + std::to_string(a) +
                                  ", above num_tokens " + std::to_string(b) +
                                  " (nothing was sent)");
    case kBadSlot:
      return DataLossError("moe NVLink: malformed slot " + std::to_string(b) + " from rank " +
                           std::to_string(a));
    case kRowOverrun:
      return DataLossError("moe NVLink: local expert " + std::to_string(b) +
                           " received more rows than its capacity");
    case kExpertFull:
      (void)(failed_ = ResourceExhaustedError(
                 "moe NVLink: local expert " + std::to_string(b) + " received " +
                 std::to_string(a) + " copies, more than the " + std::to_string(expert_rows_) +
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

// ---- tracing ----

// Per kernel: each point's slowest and mean block time from the block's start (us) and, after
// @, when its last block reached it relative to the first DispatchSend block (us; the block's
// global-timer start plus its clock cycles at the nominal rate); then its blocks' first and last
// start and last end relative to that block (us, global timer).
void CudaDevice::PrintTrace() {
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
  auto block = [&](int k, int b) {
    return &stamps[(size_t(k) * nv_.trace_blocks + b) * kTraceSlots];
  };
  long long epoch = 0, origin = 0;
  for (int b = 0; b < nv_.trace_blocks; ++b) {
    epoch = std::max(epoch, block(kTraceSend, b)[kTraceEpoch]);
  }
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
      std::snprintf(part, sizeof part, " p%d %.2f/%.2f@%.2f (%d)", p, slowest, sum / blocks, latest,
                    blocks);
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

}  // namespace ferry::moe
