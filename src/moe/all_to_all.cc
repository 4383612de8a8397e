// AllToAll::Create, and the host device's AllToAll: its relay's buffers, the agreement at
// setup, and the glue between the device and the relay (moe/device.h). The CUDA device's
// AllToAll is in cuda/nvlink_all_to_all.cu.
#include <memory>
#include <string>
#include <vector>

#include "common/leak.h"
#include "ferry/moe.h"
#include "moe/device.h"
#include "moe/relay.h"
#include "moe/steps.h"
#include "moe/wire.h"
#ifdef FERRY_HAVE_CUDA
#include "moe/cuda/nvlink_all_to_all.h"
#endif

namespace ferry {
namespace {

using moe::Stage;

class AllToAllImpl final : public AllToAll {
 public:
  AllToAllImpl(const AllToAllConfig& c, TransferEngine* engine)
      : c_(c),
        layout_(c, moe::SlotFormat(c, false).slot_bytes, 1),
        engine_(engine),
        boxes_(layout_) {}

  ~AllToAllImpl() override {
    // Stop the relay, then make sure no write still reads or fills our boxes before they go.
    // Writes to a dead peer end at the engine's transfer timeout; if some never end (a wedged
    // provider), the boxes are leaked rather than freed under the NIC (the relay leaks their
    // registrations).
    if (relay_ && !relay_->Stop()) LeakOnPurpose(new moe::HostBoxes(std::move(boxes_)));
    relay_.reset();
    device_.reset();
  }

  Status Init(Bootstrap& bootstrap) {
    const int n = c_.world_size, me = c_.rank;
    // What the ranks must agree on, before anything is sized from it.
    const auto timeout = std::chrono::seconds(60);
    ASSIGN_OR_RETURN(auto prints, bootstrap.AllGather(c_.Fingerprint(), timeout));
    for (int r = 0; r < n; ++r) {
      if (prints[r] != prints[me]) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                    " has a different configuration than rank " +
                                    std::to_string(me) + " (" + c_.ToString() + ")");
      }
    }
    const moe::RelayBuffers boxes = boxes_.buffers();
    if (!layout_.remotes.empty()) {
      ASSIGN_OR_RETURN(relay_, moe::Relay::Create(c_, layout_, engine_, bootstrap, boxes));
    } else {
      // One rank: nothing crosses, but the instance is still this AllToAll's on its engine
      // (each AllToAll on an engine has its own), claimed by a counter no relay creates.
      Status s = engine_->CreateImmCounter(moe::RelayImm(moe::kRelayDispatch, 0, c_.instance, me));
      if (!s.ok()) return moe::CounterError(s, c_.instance);
    }
    device_ = moe::NewHostDevice({c_, &layout_, boxes, relay_.get()});
    return Status::Ok();
  }

  const AllToAllConfig& config() const override { return c_; }
  Status SetStream(void*) override { return NoStreams("SetStream"); }
  static Status NoStreams(const char* call) {
    return UnimplementedError(std::string("AllToAll::") + call +
                              ": stream-ordered steps need the CUDA device; the host device's "
                              "steps wait for their own work");
  }
  Status Synchronize() override { return Step(stage_, "Synchronize"); }
  Status Poll(bool* done) override {
    *done = true;
    return Synchronize();
  }
  bool capturing(void*) const override { return false; }
  Status OrderAfter(void*) override { return NoStreams("OrderAfter"); }
  Status OrderBefore(void*) override { return NoStreams("OrderBefore"); }
  Status SetMasked(int rank, bool masked) override {
    const bool now = rank >= 0 && rank < c_.world_size &&
                     (pending_masks_[rank] || layout_.Masked(boxes_.control_bytes(), rank));
    bool change = false;
    RETURN_IF_ERROR(moe::CheckSetMasked(c_, rank, masked, now, &change));
    if (!change) return Status::Ok();
    // Mid-epoch, the steps left keep the ranks the epoch began with.
    if (stage_ == Stage::kIdle) {
      layout_.Mask(boxes_.control_bytes(), rank, moe::kMaskedByCaller);
    } else {
      pending_masks_[rank] = 1;
    }
    return Status::Ok();
  }
  StatusOr<std::vector<uint8_t>> Masked() const override {
    std::vector<uint8_t> masks(pending_masks_);
    for (int r = 0; r < c_.world_size; ++r) {
      masks[r] |= layout_.Masked(boxes_.control_bytes(), r);
    }
    return masks;
  }
  uint64_t dispatch_bytes_sent() const override { return relay_ ? relay_->dispatch_bytes() : 0; }
  uint64_t combine_bytes_sent() const override { return relay_ ? relay_->combine_bytes() : 0; }

  Status DispatchSend(const DispatchInput& given) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "DispatchSend"));
    RETURN_IF_ERROR(moe::CheckDispatchInput(c_, given));
    for (int r = 0; r < c_.world_size; ++r) {
      if (pending_masks_[r]) layout_.Mask(boxes_.control_bytes(), r, moe::kMaskedByCaller);
      pending_masks_[r] = 0;
    }
    if (given.device_num_tokens) {
      return InvalidArgumentError("DispatchSend: a device token count needs the CUDA device");
    }
    DispatchInput in = given;
    if (in.x_bf16 && in.num_tokens > 0) {
      // Quantised here, then sent as if the caller had: the rows stay ours until the next
      // DispatchSend (the device reads them while sending).
      fp8_x_.resize(size_t(in.num_tokens) * c_.hidden);
      fp8_scales_.resize(size_t(in.num_tokens) * c_.scales_per_token());
      QuantizeFp8Rows(in.x_bf16, in.num_tokens, c_.hidden, in.scaling, fp8_x_.data(),
                      fp8_scales_.data());
      in.x = fp8_x_.data();
      in.scales = fp8_scales_.data();
    }
    RETURN_IF_ERROR(CheckIds(in));
    if (in.indices64 && in.num_tokens > 0) {
      // Narrowed once CheckIds passed them.
      narrowed_.assign(in.indices64, in.indices64 + int64_t{in.num_tokens} * c_.experts_per_token);
      in.indices = narrowed_.data();
    }
    RETURN_IF_ERROR(device_->DispatchSend(in, epoch_));
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
    RETURN_IF_ERROR(device_->CombineRecv(out, epoch_, deadline));
    stage_ = Stage::kIdle;
    ++epoch_;
    return Status::Ok();
  }

 private:
  // Steps run in order; after a relay failure or a malformed section every step reports it.
  Status Step(Stage want, const char* name) const {
    if (relay_ && relay_->failed()) return relay_->error();
    RETURN_IF_ERROR(device_->error());
    return moe::CheckStage(stage_, want, name);
  }

  // Every expert id (the 64-bit ones before they are narrowed: a narrowed id could wrap into
  // range).
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

  const AllToAllConfig c_;
  const moe::RelayLayout layout_;  // every other rank remote: the host device has no NVLink
  TransferEngine* engine_;
  moe::HostBoxes boxes_;
  std::unique_ptr<moe::MoeDevice> device_;
  std::unique_ptr<moe::Relay> relay_;  // after what it reads: stopped first
  Stage stage_ = Stage::kIdle;
  bool sent_fp16_ = false;  // the last CombineSend's CombineInput::fp16
  uint64_t epoch_ = 0;
  std::vector<uint8_t> pending_masks_ = std::vector<uint8_t>(size_t(c_.world_size));  // mid-epoch
  std::vector<int32_t> narrowed_;  // DispatchInput::indices64 as int32
  std::vector<uint8_t> fp8_x_;     // DispatchInput::x_bf16 quantised
  std::vector<float> fp8_scales_;
};

}  // namespace

StatusOr<std::unique_ptr<AllToAll>> AllToAll::Create(const AllToAllConfig& config,
                                                     TransferEngine* engine, Bootstrap& bootstrap) {
  RETURN_IF_ERROR(config.Validate());
  // The CUDA device: kernels, NVLink inside a node, the relay between nodes. With one node
  // (a single rank included) it needs no engine.
  const bool one_node = config.ranks_per_node == config.world_size;
  if (!engine && !(config.device == MoeDeviceKind::kCuda && one_node)) {
    return InvalidArgumentError("AllToAll: null engine");
  }
  if (bootstrap.world_size() != config.world_size || bootstrap.rank() != config.rank) {
    return InvalidArgumentError("AllToAll: bootstrap has rank " + std::to_string(bootstrap.rank()) +
                                " of " + std::to_string(bootstrap.world_size()) + ", config says " +
                                std::to_string(config.rank) + " of " +
                                std::to_string(config.world_size));
  }
  if (config.device == MoeDeviceKind::kCuda) {
#ifdef FERRY_HAVE_CUDA
    return moe::NewNvlinkAllToAll(config, engine, bootstrap);
#else
    return UnimplementedError("AllToAll: ferry was built without CUDA; use the host device");
#endif
  }
  auto a2a = std::make_unique<AllToAllImpl>(config, engine);
  RETURN_IF_ERROR(a2a->Init(bootstrap));
  return std::unique_ptr<AllToAll>(std::move(a2a));
}

}  // namespace ferry
