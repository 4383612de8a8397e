// The one AllToAll: the shell over a device (moe/device.h). It owns what every device shares --
// the configuration's agreement between ranks, the order of the steps, epochs, the caller's
// masks, every step's argument checks, when x_bf16 is quantised -- and asks the device what it
// can do (streams, host-readable inputs, device token counts) instead of keeping a copy of the
// logic per device.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/moe.h"
#include "moe/device.h"
#include "moe/membership.h"
#include "moe/node_once.h"
#include "moe/steps.h"

namespace ferry {
namespace {

// A device that is over (a readmission failed after the shell let its device go): every step
// and question reports why.
class EndedDevice final : public moe::MoeDevice {
 public:
  explicit EndedDevice(Status why) : why_(std::move(why)) {}
  moe::DeviceCaps caps() const override { return {}; }
  Status DispatchSend(const DispatchInput&, uint64_t) override { return why_; }
  Status DispatchRecv(const DispatchOutput&, uint64_t, Deadline) override { return why_; }
  Status CombineSend(const CombineInput&, uint64_t) override { return why_; }
  Status CombineRecv(const CombineOutput&, uint64_t, Deadline) override { return why_; }
  Status Quantize(const DispatchInput&, const void**, const float**) override { return why_; }
  Status ApplyMasks(const std::vector<uint8_t>&) override { return why_; }
  bool masks_live() const override { return false; }
  StatusOr<std::vector<uint8_t>> Masked() const override { return why_; }
  bool masked_so_far(int) const override { return false; }
  Status Sticky() override { return why_; }
  uint64_t dispatch_bytes_sent() const override { return 0; }
  uint64_t combine_bytes_sent() const override { return 0; }

 private:
  const Status why_;
};

// Where a device starts: a new world's first epoch, or a running world's (AllToAll::Join, and
// a survivor's device made anew by Readmit or Resize, which takes over the counters of this
// instance on the engine); `hearing`: node-once's hops (CreateAllToAll).
struct DeviceStart {
  uint64_t epoch = 0;
  bool adopt_counters = false;
  const moe::Hearing* hearing = nullptr;
};

// The device `c` names. Node-once builds its hops as at creation wherever it starts: a world
// that changes builds them anew on every rank, whose epochs start at 0.
StatusOr<std::unique_ptr<moe::MoeDevice>> MakeDevice(const AllToAllConfig& c,
                                                     TransferEngine* engine, Bootstrap& group,
                                                     const DeviceStart& at) {
  if (c.forwarding == Forwarding::kNodeOnce) {
    return moe::CreateNodeOnceDevice(c, engine, group, at.adopt_counters);
  }
  if (c.device == MoeDeviceKind::kCuda) {
    return moe::CreateCudaDevice(c, engine, group, at.hearing, at.epoch, at.adopt_counters);
  }
  std::function<bool(int)> heard;
  if (at.hearing) heard = [h = *at.hearing](int r) { return h.Heard(r); };
  return moe::CreateHostDevice(c, engine, group, at.epoch, at.adopt_counters, std::move(heard));
}

using moe::Stage;

class Shell final : public AllToAll {
 public:
  // version, epoch: where a Join's AllToAll starts (the survivors' view).
  Shell(const AllToAllConfig& c, TransferEngine* engine, std::unique_ptr<moe::MoeDevice> device,
        uint64_t version = 0, uint64_t epoch = 0)
      : c_(c), engine_(engine), device_(std::move(device)), caps_(device_->caps()),
        version_(version), epoch_(epoch) {}

  const AllToAllConfig& config() const override { return c_; }

  Status DispatchSend(const DispatchInput& given) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "DispatchSend"));
    RETURN_IF_ERROR(moe::CheckDispatchInput(c_, given));
    if (given.device_num_tokens && !caps_.device_token_count) {
      return InvalidArgumentError("DispatchSend: a device token count needs the CUDA device");
    }
    RETURN_IF_ERROR(ApplyPendingMasks());
    DispatchInput in = given;
    if (in.x_bf16 && in.num_tokens > 0 && !caps_.bf16_to_device) {
      // Quantised by the device into rows of its own, then sent as if the caller had: the
      // rows stay the device's until the next DispatchSend (it reads them while sending).
      RETURN_IF_ERROR(device_->Quantize(in, &in.x, &in.scales));
      in.x_bf16 = nullptr;
    }
    if (caps_.host_inputs) {
      RETURN_IF_ERROR(CheckIds(in));
      if (in.indices64 && in.num_tokens > 0) {
        // Narrowed once CheckIds passed them (a narrowed id could wrap into range).
        narrowed_.assign(in.indices64,
                         in.indices64 + int64_t{in.num_tokens} * c_.experts_per_token);
        in.indices = narrowed_.data();
        in.indices64 = nullptr;
      }
    }
    RETURN_IF_ERROR(device_->DispatchSend(in, epoch_));
    num_tokens_ = in.num_tokens;
    stage_ = Stage::kDispatchSent;
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, Deadline deadline) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchSent, "DispatchRecv"));
    RETURN_IF_ERROR(moe::CheckDispatchOutput(c_, out));
    RETURN_IF_ERROR(device_->DispatchRecv(out, epoch_, deadline));
    stage_ = Stage::kDispatchDone;
    return Status::Ok();
  }

  using AllToAll::CombineSend;
  Status CombineSend(const CombineInput& in) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchDone, "CombineSend"));
    RETURN_IF_ERROR(moe::CheckCombineInput(c_, in));
    RETURN_IF_ERROR(device_->CombineSend(in, epoch_));
    sent_fp16_ = in.fp16;
    stage_ = Stage::kCombineSent;
    return Status::Ok();
  }

  Status CombineRecv(const CombineOutput& out, Deadline deadline) override {
    RETURN_IF_ERROR(Step(Stage::kCombineSent, "CombineRecv"));
    RETURN_IF_ERROR(moe::CheckCombineOutput(c_, out, sent_fp16_));
    if (!out.out && num_tokens_ > 0) return InvalidArgumentError("CombineRecv: null output");
    RETURN_IF_ERROR(device_->CombineRecv(out, epoch_, deadline));
    stage_ = Stage::kIdle;
    ++epoch_;
    return Status::Ok();
  }

  // Stream calls: the device's where it has streams; else every step waited for itself.
  Status SetStream(void* stream) override {
    if (!caps_.streams) return NoStreams("SetStream");
    RETURN_IF_ERROR(device_->Sticky());
    if (stage_ != Stage::kIdle) {
      return FailedPreconditionError("SetStream: only between a CombineRecv and a DispatchSend");
    }
    RETURN_IF_ERROR(device_->SetStream(stream));
    stream_ = stream;
    return Status::Ok();
  }
  Status Synchronize() override { return device_->Synchronize(); }
  Status Poll(bool* done) override { return device_->Poll(done); }
  bool capturing(void* stream) const override { return device_->capturing(stream); }
  Status Mark(uint64_t* mark) override { return device_->Mark(mark); }
  Status Reached(uint64_t mark, bool wait, bool* reached) override {
    return device_->Reached(mark, wait, reached);
  }
  Status OrderAfter(void* stream) override {
    return caps_.streams ? device_->OrderAfter(stream) : NoStreams("OrderAfter");
  }
  Status OrderBefore(void* stream) override {
    return caps_.streams ? device_->OrderBefore(stream) : NoStreams("OrderBefore");
  }

  // A mask set between epochs reaches the device at once where what already runs reads masks
  // (a CUDA graph replayed after it sees it); otherwise, and mid-epoch (the steps left keep the
  // ranks the epoch began with), before the next DispatchSend.
  Status SetMasked(int rank, bool masked) override {
    const bool now =
        rank >= 0 && rank < c_.world_size && (caller_masks_[rank] || device_->masked_so_far(rank));
    bool change = false;
    RETURN_IF_ERROR(moe::CheckSetMasked(c_, rank, masked, now, &change));
    if (!change) return Status::Ok();
    caller_masks_[rank] = 1;
    pending_masks_[rank] = 1;
    any_pending_ = true;
    if (stage_ == Stage::kIdle && device_->masks_live()) return ApplyPendingMasks();
    return Status::Ok();
  }
  StatusOr<std::vector<uint8_t>> Masked() const override {
    ASSIGN_OR_RETURN(std::vector<uint8_t> masks, device_->Masked());
    for (int r = 0; r < c_.world_size; ++r) masks[r] |= caller_masks_[r];
    return masks;
  }

  Status Readmit(Bootstrap& group, std::chrono::milliseconds timeout) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "Readmit"));
    RETURN_IF_ERROR(moe::CheckMembershipGroup(c_, group));
    ASSIGN_OR_RETURN(const std::vector<uint8_t> masked, Masked());
    moe::MemberView mine{false, false, version_, epoch_, masked, c_.Fingerprint()};
    // Under node-once a rank knows of the losses on its own node and rail only.
    if (c_.forwarding == Forwarding::kNodeOnce) mine.cover = moe::MaskCover::kOwnHops;
    ASSIGN_OR_RETURN(const moe::Readmission agreed, moe::Meet(group, mine, timeout));
    bool any = false;
    for (uint8_t r : agreed.ranks) any |= r != 0;
    if (any) {
      // Masks still pending reach the device first: the ranks it readmits are all it masked.
      RETURN_IF_ERROR(ApplyPendingMasks());
      const Status s = device_->readmits_anew()
                           ? MakeDeviceAnew(c_, group)
                           : device_->Readmit(group, agreed.ranks, epoch_, timeout);
      // A failure past the point where the ranks' keys or devices changed ends the device
      // (it says so in Sticky, or it is gone): this AllToAll then reports it at every call.
      if (!s.ok() && (!device_ || !device_->Sticky().ok())) End(s);
      RETURN_IF_ERROR(s);
    }
    for (int r = 0; r < c_.world_size; ++r) {
      if (agreed.ranks[r]) caller_masks_[r] = 0;
    }
    version_ = agreed.version;
    return Status::Ok();
  }
  Status Resize(const AllToAllConfig& asked, Bootstrap& group,
                std::chrono::milliseconds timeout) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "Resize"));
    if (asked.device != c_.device) {
      return InvalidArgumentError(
          "AllToAll::Resize: onto another device (a resized AllToAll keeps its device; create a "
          "new AllToAll instead)");
    }
    ASSIGN_OR_RETURN(const AllToAllConfig config, moe::Resolve(asked, engine_, group));
    if (config.instance != c_.instance) {
      return InvalidArgumentError("AllToAll::Resize: instance " + std::to_string(config.instance) +
                                  ", this AllToAll's is " + std::to_string(c_.instance) +
                                  " (a resized AllToAll keeps its instance on the engine)");
    }
    ASSIGN_OR_RETURN(const std::vector<uint8_t> masked, Masked());
    if (std::any_of(masked.begin(), masked.end(), [](uint8_t m) { return m != 0; })) {
      return FailedPreconditionError(
          "AllToAll::Resize: this rank has masked ranks, which may still write under the keys "
          "they hold; readmit them first (AllToAll::Readmit)");
    }
    moe::MemberView mine{false, true, version_, epoch_,
                         std::vector<uint8_t>(size_t(config.world_size)), config.Fingerprint()};
    ASSIGN_OR_RETURN(const moe::Readmission agreed, moe::Meet(group, mine, timeout));
    // The host device per rank makes the new world's device beside this one, taking over this
    // instance's counters (this device's relay waits for a dispatch that never comes): if it
    // cannot be made, this one goes on. Elsewhere this one goes first -- a CUDA node's ranks map
    // each other's memory once, node-once's hops and heartbeats hold the instance's inboxes --
    // and a failure past it ends this AllToAll.
    const bool beside = !device_->readmits_anew() &&
                        c_.forwarding != Forwarding::kNodeOnce &&
                        config.forwarding != Forwarding::kNodeOnce;
    if (beside) {
      ASSIGN_OR_RETURN(device_, MakeDevice(config, engine_, group,
                                           {.epoch = epoch_, .adopt_counters = true}));
      caps_ = device_->caps();
    } else if (const Status s = MakeDeviceAnew(config, group); !s.ok()) {
      End(s.WithContext("AllToAll::Resize"));
      return s;
    }
    c_ = config;
    caller_masks_.assign(size_t(c_.world_size), 0);
    pending_masks_.assign(size_t(c_.world_size), 0);
    any_pending_ = false;
    version_ = agreed.version;
    return Status::Ok();
  }
  uint64_t membership_version() const override { return version_; }

  uint64_t dispatch_bytes_sent() const override { return device_->dispatch_bytes_sent(); }
  uint64_t combine_bytes_sent() const override { return device_->combine_bytes_sent(); }

 private:
  // Steps run in order; once the device failed (a lost peer, a malformed section, a stopped
  // relay) every step reports it.
  Status Step(Stage want, const char* name) {
    RETURN_IF_ERROR(device_->Sticky());
    return moe::CheckStage(stage_, want, name);
  }

  // A readmission where the device is made anew (MoeDevice::readmits_anew), or a resize (of
  // `config`'s world): this one goes first, then its successor is made over `group` at our
  // epoch, taking the instance's counters over, as the new processes make theirs
  // (AllToAll::Join), and given the caller's stream. Past the old one, a failure leaves no
  // device (the caller ends this AllToAll).
  Status MakeDeviceAnew(const AllToAllConfig& config, Bootstrap& group) {
    device_.reset();
    ASSIGN_OR_RETURN(device_, MakeDevice(config, engine_, group,
                                         {.epoch = epoch_, .adopt_counters = true}));
    caps_ = device_->caps();
    if (stream_) {
      const Status s = device_->SetStream(*stream_);
      if (!s.ok()) device_.reset();  // on another stream than the caller's: no use
      return s;
    }
    return Status::Ok();
  }

  // The device is over: every later call reports `why`.
  void End(const Status& why) {
    device_ = std::make_unique<EndedDevice>(why.WithContext(
        "after the ranks' keys or devices changed (a readmission or resize); this AllToAll is "
        "unusable"));
    caps_ = device_->caps();
  }

  // The masks SetMasked took since they were last applied (a flag, so that DispatchSend does
  // not scan world_size entries every epoch).
  Status ApplyPendingMasks() {
    if (!any_pending_) return Status::Ok();
    RETURN_IF_ERROR(device_->ApplyMasks(pending_masks_));
    std::fill(pending_masks_.begin(), pending_masks_.end(), 0);
    any_pending_ = false;
    return Status::Ok();
  }

  static Status NoStreams(const char* call) {
    return UnimplementedError(std::string("AllToAll::") + call +
                              ": stream-ordered steps need the CUDA device; the host device's "
                              "steps wait for their own work");
  }

  // Every expert id (the 64-bit ones before they are narrowed).
  Status CheckIds(const DispatchInput& in) const {
    const int64_t copies = int64_t{in.num_tokens} * c_.experts_per_token;
    for (int64_t i = 0; i < copies; ++i) {
      const int64_t e = in.indices64 ? in.indices64[i] : int64_t{in.indices[i]};
      if (e < -1 || e >= c_.num_experts) {
        return OutOfRangeError("DispatchSend: token " + std::to_string(i / c_.experts_per_token) +
                               " routes to expert " + std::to_string(e) + ", valid ids are [0, " +
                               std::to_string(c_.num_experts) + ") and -1 (none)");
      }
    }
    return Status::Ok();
  }

  AllToAllConfig c_;  // Resize's, from then on
  TransferEngine* const engine_;
  std::unique_ptr<moe::MoeDevice> device_;
  moe::DeviceCaps caps_;
  Stage stage_ = Stage::kIdle;
  uint64_t version_ = 0;  // readmissions so far (membership_version)
  std::optional<void*> stream_;  // SetStream's, where it was called: a device made anew too
  uint64_t epoch_ = 0;
  int num_tokens_ = 0;      // the last DispatchSend's
  bool sent_fp16_ = false;  // the last CombineSend's CombineInput::fp16
  std::vector<uint8_t> caller_masks_ = std::vector<uint8_t>(size_t(c_.world_size));
  std::vector<uint8_t> pending_masks_ = std::vector<uint8_t>(size_t(c_.world_size));
  bool any_pending_ = false;
  std::vector<int32_t> narrowed_;  // DispatchInput::indices64 as int32
};

// InvalidArgument naming a rank whose configuration differs from ours: before anything is sized
// from it.
Status CheckConfigurationsAgree(const AllToAllConfig& c, Bootstrap& bootstrap) {
  ASSIGN_OR_RETURN(auto prints, bootstrap.AllGather(c.Fingerprint(), std::chrono::seconds(60)));
  for (int r = 0; r < c.world_size; ++r) {
    if (prints[r] != prints[c.rank]) {
      return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                  " has a different configuration than rank " +
                                  std::to_string(c.rank) + " (" + c.ToString() + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<AllToAll>> AllToAll::Join(const AllToAllConfig& asked,
                                                   TransferEngine* engine, Bootstrap& group,
                                                   std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(const AllToAllConfig config, moe::Resolve(asked, engine, group));
  const moe::MemberView mine{true, false, 0, 0, std::vector<uint8_t>(size_t(config.world_size)),
                             config.Fingerprint()};
  ASSIGN_OR_RETURN(const moe::Readmission agreed, moe::Meet(group, mine, timeout));
  ASSIGN_OR_RETURN(auto device, MakeDevice(config, engine, group, {.epoch = agreed.epoch}));
  return std::unique_ptr<AllToAll>(
      std::make_unique<Shell>(config, engine, std::move(device), agreed.version, agreed.epoch));
}

StatusOr<std::unique_ptr<AllToAll>> AllToAll::Create(const AllToAllConfig& asked,
                                                     TransferEngine* engine, Bootstrap& bootstrap) {
  return moe::CreateAllToAll(asked, engine, bootstrap, nullptr, false);
}

StatusOr<std::unique_ptr<AllToAll>> moe::CreateAllToAll(const AllToAllConfig& asked,
                                                        TransferEngine* engine,
                                                        Bootstrap& bootstrap,
                                                        const moe::Hearing* hearing,
                                                        bool adopt_counters) {
  ASSIGN_OR_RETURN(const AllToAllConfig config, moe::Resolve(asked, engine, bootstrap));
  RETURN_IF_ERROR(CheckConfigurationsAgree(config, bootstrap));
  ASSIGN_OR_RETURN(auto device,
                   MakeDevice(config, engine, bootstrap,
                              {.adopt_counters = adopt_counters, .hearing = hearing}));
  return std::unique_ptr<AllToAll>(std::make_unique<Shell>(config, engine, std::move(device)));
}

}  // namespace ferry
