// The CUDA device's set-up (design in cuda_device.h): the device and stream, the buffer every
// rank of a node maps (common/cuda_shared_memory.h), the relay to other nodes, the peer table
// and the kernels' device state. The kernels' plan (PlanBuffer, PlanGrids) is in
// cuda_device_launch.cu, beside the kernels it sizes.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/fd_exchange.h"
#include "ferry/gpu_words.h"
#include "moe/cuda/cuda_device.h"
#include "moe/cuda/nvlink_layout.h"
#include "moe/cuda/pinned_buffer.h"

namespace ferry::moe {

using namespace nv;  // NOLINT: the kernels' structs, what this file lays out

CudaDevice::~CudaDevice() {
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
  if (hearing_.liveness) hearing_.liveness->Unmirror(error_ + 4 + nv_.world_size);
  if (error_) cudaFreeHost(error_);
}

Status CudaDevice::Init(TransferEngine* engine, Bootstrap& bootstrap, uint64_t first_epoch,
                        bool adopt_counters) {
  int sms = 0;
  RETURN_IF_ERROR(OpenDevice(&sms));
  ASSIGN_OR_RETURN(const int64_t bytes, PlanBuffer());
  RETURN_IF_ERROR(PlanGrids(sms));
  ASSIGN_OR_RETURN(const std::vector<uint8_t*> bases, MapNodeBuffers(bootstrap, bytes));
  const RelayLayout relay(c_, nv_.slot_bytes, c_.ranks_per_node);
  ASSIGN_OR_RETURN(const RelayBuffers mapped,
                   StartRelay(relay, engine, bootstrap, first_epoch, adopt_counters));
  ASSIGN_OR_RETURN(const std::vector<NvPeer> peers, ExchangePeers(bootstrap, relay, mapped, bases));
  RETURN_IF_ERROR(AllocateDeviceState(peers, bases[c_.rank]));
  if (first_epoch > 0) {
    // The kernels count epochs in their scratch (Scratch::epoch), and the flags of our node's
    // ranks in our buffer (NvPeer) gain a grid's worth per epoch: all as if the survivors'
    // epochs had run here. (The relay's flags are epoch numbers: nothing to set.)
    FERRY_CUDA(cudaMemcpy(&scratch_.get()->epoch, &first_epoch, sizeof first_epoch,
                          cudaMemcpyHostToDevice));
    for (int r = 0; r < c_.world_size; ++r) {
      if (relay.Remote(r)) continue;
      const uint64_t at[2] = {first_epoch * uint64_t(peers[r].dispatch_step),
                              first_epoch * uint64_t(peers[r].combine_step)};
      FERRY_CUDA(cudaMemcpy(const_cast<uint64_t*>(peers[r].dispatch_flag_in), &at[0], 8,
                            cudaMemcpyHostToDevice));
      FERRY_CUDA(cudaMemcpy(const_cast<uint64_t*>(peers[r].combine_flag_in), &at[1], 8,
                            cudaMemcpyHostToDevice));
    }
  }
  FERRY_CUDA(cudaDeviceSynchronize());
  if (hearing_.liveness) hearing_.liveness->Mirror(error_ + 4 + c_.world_size, hearing_.ranks);
  // No rank writes into another before every buffer is zeroed and mapped.
  return bootstrap.Barrier(kExchangeTimeout);
}

Status CudaDevice::OpenDevice(int* sms) {
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

StatusOr<std::vector<uint8_t*>> CudaDevice::MapNodeBuffers(Bootstrap& bootstrap, int64_t bytes) {
  const int n = c_.world_size;
  int fd = -1;
  RETURN_IF_ERROR(shared_.Create(c_.cuda_device, bytes, &fd));
  const int per_node = c_.ranks_per_node, first = c_.rank / per_node * per_node;
  std::vector<uint8_t*> bases(n, nullptr);
  if (per_node == 1) {  // a node of one: nothing to exchange (and no collective to run)
    close(fd);
    bases[c_.rank] = shared_.own();
    return bases;
  }
  std::vector<int> members(per_node);
  for (int i = 0; i < per_node; ++i) members[i] = first + i;
  auto fds = ExchangeFds(bootstrap, members, fd, kExchangeTimeout);
  close(fd);
  RETURN_IF_ERROR(fds.status());
  Status imported = Status::Ok();
  for (int i = 0; i < per_node; ++i) {
    const int r = members[i];
    if (r == c_.rank) {
      bases[r] = shared_.own();
    } else if (imported.ok()) {
      auto base = shared_.Import((*fds)[i]);
      if (base.ok())
        bases[r] = *base;
      else
        imported = base.status();
    }
    close((*fds)[i]);
  }
  RETURN_IF_ERROR(imported);
  return bases;
}

StatusOr<RelayBuffers> CudaDevice::StartRelay(const RelayLayout& relay, TransferEngine* engine,
                                              Bootstrap& bootstrap, uint64_t first_epoch,
                                              bool adopt_counters) {
  Nv& v = nv_;
  v.first_remote = relay.remotes.empty() ? -1 : relay.remotes.front();
  if (!relay.remotes.empty() && relay.counts_bytes != int64_t{v.counts_stride} * 4) {
    return InternalError("moe: the relay's counts row and the kernels' differ in size");
  }
  if (relay.remotes.empty()) return RelayBuffers{};
  RETURN_IF_ERROR(boxes_.Place(c_, relay, engine));
  ASSIGN_OR_RETURN(relay_, Relay::Create(c_, relay, engine, bootstrap, boxes_.host(), 60000,
                                         first_epoch, adopt_counters));
  return boxes_.mapped();
}

StatusOr<std::vector<NvPeer>> CudaDevice::ExchangePeers(Bootstrap& bootstrap,
                                                        const RelayLayout& relay,
                                                        const RelayBuffers& mapped,
                                                        const std::vector<uint8_t*>& bases) {
  const int n = c_.world_size;
  // Every rank's send grids (what its flags for us gain per epoch): only our node's are read,
  // so a node of one gathers none.
  std::vector<uint8_t> grids(2 * sizeof(int32_t));
  const int32_t mine[2] = {send_grid_, recv_grid_};
  std::memcpy(grids.data(), mine, sizeof mine);
  std::vector<std::vector<uint8_t>> all_grids(size_t(n), grids);
  if (c_.ranks_per_node > 1) {
    ASSIGN_OR_RETURN(all_grids, bootstrap.AllGather(grids, kExchangeTimeout));
  }
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

Status CudaDevice::AllocateDeviceState(const std::vector<NvPeer>& peers, uint8_t* own) {
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
  // The error words [4], the lost-rank mirror [N] (Nv::mask_mirror), the heard words [N].
  const size_t host_words = 4 + 2 * size_t(n);
  void* error = nullptr;
  FERRY_CUDA(cudaHostAlloc(&error, host_words * sizeof(int32_t),
                           cudaHostAllocMapped | cudaHostAllocPortable));
  error_ = static_cast<int32_t*>(error);
  std::memset(error_, 0, host_words * sizeof(int32_t));
  void* error_dev = nullptr;
  FERRY_CUDA(cudaHostGetDevicePointer(&error_dev, error, 0));
  v.masks = c_.mask_lost_peers ? masks_.get() : nullptr;  // else from the first SetMasked
  v.mask_mirror = static_cast<int32_t*>(error_dev) + 4;
  v.heard = hearing_.liveness ? static_cast<int32_t*>(error_dev) + 4 + n : nullptr;
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
    FERRY_CUDA(
        cudaMemset(trace_.get(), 0, size_t(kTraceKernels) * v.trace_blocks * kTraceSlots * 8));
    v.trace = trace_.get();
  }
  return Status::Ok();
}

NvPeer CudaDevice::NodePeer(uint8_t* own, uint8_t* theirs, int r) const {
  const Nv& v = nv_;
  const int64_t width = v.counts_stride;
  NvPeer p{};
  p.dispatch_flag = reinterpret_cast<uint64_t*>(theirs) + v.rank;
  p.combine_flag = reinterpret_cast<uint64_t*>(theirs) + v.world_size + v.rank;
  p.counts = reinterpret_cast<int32_t*>(theirs + v.counts_off) + v.rank * width;
  p.slots = theirs + v.private_off + int64_t{v.rank} * v.private_slots * v.slot_bytes;
  p.combine = theirs + v.combine_off;
  if (v.modes.stream_combine())
    p.combine_tags = reinterpret_cast<uint64_t*>(theirs + v.combine_tag_off);
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

NvPeer CudaDevice::RemotePeer(const RelayLayout& relay, const RelayBuffers& mapped,
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

StatusOr<std::unique_ptr<MoeDevice>> CreateCudaDevice(const AllToAllConfig& config,
                                                      TransferEngine* engine,
                                                      Bootstrap& bootstrap,
                                                      const Hearing* hearing,
                                                      uint64_t first_epoch, bool adopt_counters) {
  if (config.device != MoeDeviceKind::kCuda) {
    return InvalidArgumentError("CUDA AllToAll: config.device is not kCuda");
  }
  auto device = std::make_unique<CudaDevice>(config, hearing);
  RETURN_IF_ERROR(device->Init(engine, bootstrap, first_epoch, adopt_counters));
  return std::unique_ptr<MoeDevice>(std::move(device));
}

}  // namespace ferry::moe

namespace ferry {
bool CudaDeviceBuilt() { return true; }
}  // namespace ferry
