// The one interface the MoE shell (moe/all_to_all.cc) drives: a device runs the four steps on
// its memory and reports what it can do beyond them. Two implement it:
//   - the host device (host/host_device.cc): the steps on the CPU, on host memory. It is the
//     reference the CUDA kernels are checked against, and it speaks their protocol between
//     nodes (the counts rows and slots of moe/wire.h through the relay of moe/relay.h), every
//     other rank in a node of its own; so CI runs, over libfabric, what GPUs on several
//     machines run.
//   - the CUDA device (cuda/cuda_device.h): kernels, NVLink inside a node, the relay between
//     nodes; steps enqueued on a stream, capturable in CUDA graphs.
//
// The shell owns everything both share: the order of the steps, epochs, the caller's masks,
// the configuration's agreement between ranks (its fingerprint), the checks of every step's
// arguments, and when x_bf16 is quantised. A device packs and unpacks, launches, and waits; it
// never sees a step out of order or an argument the shell refused.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "moe/liveness.h"
#include "moe/relay.h"

namespace ferry::moe {

// What a device does beyond the four steps; the shell asks instead of keeping a copy of the
// logic per device (as NIXL's backends report theirs).
struct DeviceCaps {
  // Steps are enqueued on a stream and may be captured in a CUDA graph: the stream calls
  // (SetStream, Synchronize, Poll, Mark, OrderAfter, ...) are the device's. Without it every
  // step waits for its own work and the shell answers them.
  bool streams = false;
  // Step inputs are host memory the shell may read before the step runs: it checks every
  // expert id and narrows 64-bit ones. Without it the kernels read them as they run and
  // report a bad id when the step is synchronised.
  bool host_inputs = false;
  // DispatchInput::device_num_tokens: a token count the kernels read when they run.
  bool device_token_count = false;
  // DispatchInput::x_bf16 reaches DispatchSend as the caller gave it (Quantize is never
  // called): the device hands it to AllToAlls of its own, which quantise it (node-once's rail).
  bool bf16_to_device = false;
};

// Thread safety: one caller thread, the shell's; steps in order (the shell enforces it).
class MoeDevice {
 public:
  virtual ~MoeDevice() = default;
  virtual DeviceCaps caps() const = 0;

  // The four steps, arguments checked by the shell. DispatchSend routes and packs: our counts
  // row and slots for each rank into its section, then raises the flags that say so; it does
  // not wait for the network.
  virtual Status DispatchSend(const DispatchInput& in, uint64_t epoch) = 0;
  // Waits for every sender's section, checks it (DataLoss for one no well-behaved peer sends),
  // unpacks into expert-major or token-major rows.
  virtual Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) = 0;
  // Packs expert outputs into the rows each sender expects back, then raises the combine flags.
  virtual Status CombineSend(const CombineInput& in, uint64_t epoch) = 0;
  // Waits for every expert rank's rows, takes the weighted sums (out.weights, else the
  // dispatch's).
  virtual Status CombineRecv(const CombineOutput& out, uint64_t epoch, Deadline deadline) = 0;

  // fp8 configurations: in.x_bf16's rows quantised (in.scaling) into rows the device keeps
  // until the next DispatchSend has read them; *x and *scales point at them.
  virtual Status Quantize(const DispatchInput& in, const void** x, const float** scales) = 0;

  // Rank masks. ApplyMasks: the ranks set in `ranks` ([world_size]) masked by the caller from
  // the next step the device runs on (the shell calls it between a CombineRecv and a
  // DispatchSend). masks_live: whether masks applied between epochs reach what already runs
  // without another DispatchSend through the shell (a CUDA graph's replay): the shell then
  // applies each mask at once instead of at the next DispatchSend. Masked: [world_size], 1
  // where the device masked a rank (the caller's, applied, and those lost under
  // mask_lost_peers), after waiting for what it has enqueued.
  // masked_so_far: whether the device has masked `rank` by what it knows now, without waiting
  // (SetMasked may run while the CUDA stream is being captured, where a wait would end it).
  virtual Status ApplyMasks(const std::vector<uint8_t>& ranks) = 0;
  virtual bool masks_live() const = 0;
  virtual StatusOr<std::vector<uint8_t>> Masked() const = 0;
  virtual bool masked_so_far(int rank) const = 0;

  // Membership (AllToAll::Readmit): between epochs, the ranks set in `readmitted` ([N], each
  // masked here) come back as new processes that meet us over `group` at `epoch` (they create
  // their device with first_epoch = epoch), and are unmasked. Collective over `group`. A failed
  // meeting leaves the device as it was, those ranks masked.
  virtual Status Readmit(Bootstrap& /*group*/, const std::vector<uint8_t>& /*readmitted*/,
                         uint64_t /*epoch*/, std::chrono::milliseconds /*timeout*/) {
    return UnimplementedError("MoeDevice::Readmit");
  }
  // Whether a readmission makes the device anew instead (the shell lets this one go, then
  // creates its successor over the group at the epoch, taking its counters over, as the new
  // processes create theirs): the CUDA device, whose node's ranks reach each other through
  // memory each maps once. What this one still holds (its relay's inbox keys: Relay::Stop
  // revokes them) is let go first.
  virtual bool readmits_anew() const { return false; }

  // OK, or what ended this device (a malformed section, a lost peer, a stopped relay): every
  // later step reports it.
  virtual Status Sticky() = 0;

  // Bytes the last dispatch and combine put on the wire (see AllToAll).
  virtual uint64_t dispatch_bytes_sent() const = 0;
  virtual uint64_t combine_bytes_sent() const = 0;

  // The stream calls of AllToAll, where caps().streams (the shell refuses them otherwise).
  virtual Status SetStream(void* /*stream*/) { return UnimplementedError("SetStream"); }
  virtual Status Synchronize() { return Sticky(); }
  virtual Status Poll(bool* done) {
    *done = true;
    return Sticky();
  }
  virtual bool capturing(void* /*stream*/) const { return false; }
  virtual Status Mark(uint64_t* mark) {
    *mark = 0;
    return Status::Ok();
  }
  virtual Status Reached(uint64_t /*mark*/, bool /*wait*/, bool* reached) {
    *reached = true;
    return Status::Ok();
  }
  virtual Status OrderAfter(void* /*stream*/) { return UnimplementedError("OrderAfter"); }
  virtual Status OrderBefore(void* /*stream*/) { return UnimplementedError("OrderBefore"); }
};

// What a host device works on without owning it (its tests build the buffers themselves): the
// relay's layout (node_ranks 1) and its buffers in host memory.
struct DeviceParams {
  AllToAllConfig config;
  const RelayLayout* layout = nullptr;
  RelayBuffers boxes;
  const Relay* relay = nullptr;  // null with one rank; once it fails, every wait reports why
  // Under mask_lost_peers: whether a sender of this AllToAll's world that missed the step's
  // deadline is late rather than lost -- heard from lately (node-once's heartbeats,
  // moe/liveness.h). Such a sender is waited for on while it stays heard from, up to
  // kLateWaits more of the step's wait; empty: every sender past the deadline is lost.
  std::function<bool(int rank)> heard;
};
std::unique_ptr<MoeDevice> NewHostDevice(const DeviceParams& params);

// The host device with its own buffers and relay over `engine` (collective: the relay
// exchanges descriptors through `bootstrap`). The configuration is validated and agreed.
// first_epoch: where a device that joins a running world starts (AllToAll::Join and Resize:
// the survivors' epoch; its relay meets theirs). adopt_counters: the device replaces one of
// this instance on the engine (Resize), whose immediate counters it takes over. heard:
// DeviceParams::heard.
StatusOr<std::unique_ptr<MoeDevice>> CreateHostDevice(const AllToAllConfig& config,
                                                      TransferEngine* engine, Bootstrap& bootstrap,
                                                      uint64_t first_epoch = 0,
                                                      bool adopt_counters = false,
                                                      std::function<bool(int)> heard = {});

// AllToAll::Create, where the device's steps also ask `hearing` (null: nobody) before they
// take a rank for lost: the hops of node-once forwarding under mask_lost_peers. adopt_counters:
// as CreateHostDevice's -- hops built anew on the instances of hops gone.
StatusOr<std::unique_ptr<AllToAll>> CreateAllToAll(const AllToAllConfig& config,
                                                   TransferEngine* engine, Bootstrap& bootstrap,
                                                   const Hearing* hearing, bool adopt_counters);

// The CUDA device (cuda/cuda_device.h; config.device == kCuda, any ranks_per_node). `engine`
// carries the traffic between nodes and may be null with one node. Collective. Unimplemented
// where ferry was built without CUDA.
// hearing: as DeviceParams::heard, mirrored into the kernels' memory (Nv::heard).
// first_epoch, adopt_counters: as CreateHostDevice's (AllToAll::Join with every rank its own
// node; node-once's hops built anew).
StatusOr<std::unique_ptr<MoeDevice>> CreateCudaDevice(const AllToAllConfig& config,
                                                      TransferEngine* engine, Bootstrap& bootstrap,
                                                      const Hearing* hearing = nullptr,
                                                      uint64_t first_epoch = 0,
                                                      bool adopt_counters = false);

}  // namespace ferry::moe
