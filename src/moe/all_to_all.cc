// AllToAll::Create, and the host device's AllToAll: buffers, the exchange at setup, and the glue
// between the host device and its proxy. The CUDA device's AllToAll is in
// cuda/nvlink_all_to_all.cu.
#include <memory>
#include <string>
#include <vector>

#include "common/leak.h"
#include "ferry/moe.h"
#include "moe/device.h"
#include "moe/layout.h"
#include "moe/proxy.h"
#ifdef FERRY_HAVE_CUDA
#include "moe/cuda/nvlink_all_to_all.h"
#endif

namespace ferry {
namespace {

using moe::Channel;
using moe::MoeLayout;

class AllToAllImpl final : public AllToAll {
 public:
  AllToAllImpl(const AllToAllConfig& c, TransferEngine* engine)
      : c_(c), layout_(c), engine_(engine), routing_(c) {}

  ~AllToAllImpl() override {
    if (!proxy_) return;
    // Stop the proxy, then make sure no write still reads our buffers before they go. Writes to
    // a dead peer end at the engine's transfer timeout; if some never end (a wedged provider),
    // the buffers and registrations are leaked rather than freed under the NIC.
    if (!proxy_->Quiesce()) {
      LeakOnPurpose(new std::vector<uint8_t>(std::move(send_)));
      LeakOnPurpose(new std::vector<uint8_t>(std::move(recv_)));
      LeakOnPurpose(new MemoryRegion(std::move(send_reg_)));
      LeakOnPurpose(new MemoryRegion(std::move(recv_reg_)));
    }
    proxy_.reset();
    device_.reset();
  }

  Status Init(Bootstrap& bootstrap) {
    const int n = c_.world_size, me = c_.rank;
    recv_.assign(layout_.recv_bytes, 0);
    send_.assign(layout_.send_bytes, 0);
    ASSIGN_OR_RETURN(recv_reg_, engine_->RegisterMemory(recv_.data(), layout_.recv_bytes));
    ASSIGN_OR_RETURN(send_reg_, engine_->RegisterMemory(send_.data(), layout_.send_bytes));
    for (uint32_t kind = moe::kCounts; kind <= moe::kCombineConsumed; ++kind) {
      for (uint32_t epoch = 0; epoch < moe::kEpochs; ++epoch) {
        Status s = engine_->CreateImmCounter(
            moe::MoeImm(static_cast<moe::ImmKind>(kind), epoch, c_.instance));
        if (!s.ok()) return moe::CounterError(s, c_.instance);
      }
    }
    // Exchange: configuration fingerprint, engine address, receive-region descriptor.
    const auto timeout = std::chrono::seconds(60);
    ASSIGN_OR_RETURN(auto prints, bootstrap.AllGather(c_.Fingerprint(), timeout));
    for (int r = 0; r < n; ++r) {
      if (prints[r] != prints[me]) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                    " has a different configuration than rank " +
                                    std::to_string(me) + " (" + c_.ToString() + ")");
      }
    }
    ASSIGN_OR_RETURN(auto addresses, bootstrap.AllGather(engine_->Address(), timeout));
    ASSIGN_OR_RETURN(auto regions, bootstrap.AllGather(recv_reg_.remote().Serialize(), timeout));
    moe::ProxyParams pp;
    std::vector<PeerId> members;
    std::vector<RemoteRegion> dsts;
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      ASSIGN_OR_RETURN(PeerId peer, engine_->AddPeer(addresses[r]));
      ASSIGN_OR_RETURN(RemoteRegion region, RemoteRegion::Parse(regions[r]));
      if (region.length != static_cast<uint64_t>(layout_.recv_bytes)) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                    " registered a receive region of another size");
      }
      members.push_back(peer);
      dsts.push_back(region);
    }
    if (n > 1) {
      ASSIGN_OR_RETURN(pp.group, engine_->AddPeerGroup(members));
      ASSIGN_OR_RETURN(pp.plan, engine_->PrepareScatter(pp.group, send_reg_, dsts));
    }
    RETURN_IF_ERROR(bootstrap.Barrier(timeout));
    pp.config = c_;
    pp.engine = engine_;
    pp.channel = &channel_;
    pp.routing = &routing_;
    pp.recv = recv_.data();
    pp.send = send_.data();
    device_ = moe::NewHostDevice({c_, &channel_, &routing_, recv_.data(), send_.data()});
    proxy_ = std::make_unique<moe::Proxy>(pp);
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
  uint64_t dispatch_bytes_sent() const override { return proxy_->dispatch_bytes(); }
  uint64_t combine_bytes_sent() const override { return proxy_->combine_bytes(); }

  Status DispatchSend(const DispatchInput& given) override {
    RETURN_IF_ERROR(Step(Stage::kIdle, "DispatchSend"));
    RETURN_IF_ERROR(moe::CheckInputForms(c_, given));
    DispatchInput in = given;
    if (in.x_bf16 && in.num_tokens > 0 && in.num_tokens <= c_.max_tokens_per_rank) {
      // Quantised here, then sent as if the caller had: the rows stay ours until the next
      // DispatchSend (the device reads them while sending).
      fp8_x_.resize(size_t(in.num_tokens) * c_.hidden);
      fp8_scales_.resize(size_t(in.num_tokens) * c_.scales_per_token());
      QuantizeFp8Rows(in.x_bf16, in.num_tokens, c_.hidden, in.scaling, fp8_x_.data(),
                      fp8_scales_.data());
      in.x = fp8_x_.data();
      in.scales = fp8_scales_.data();
    }
    RETURN_IF_ERROR(CheckInput(in));
    if (in.indices64 && in.num_tokens > 0) {
      // Narrowed once checked (CheckInput checks the 64-bit ids themselves: a narrowed id
      // could wrap into range).
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

  Status CombineSend(const uint16_t* expert_out) override {
    RETURN_IF_ERROR(Step(Stage::kDispatchDone, "CombineSend"));
    if (!expert_out) return InvalidArgumentError("CombineSend: null expert output");
    RETURN_IF_ERROR(device_->CombineSend(expert_out, epoch_));
    stage_ = Stage::kCombineSent;
    return Status::Ok();
  }

  Status CombineRecv(const CombineOutput& out, Deadline deadline) override {
    RETURN_IF_ERROR(Step(Stage::kCombineSent, "CombineRecv"));
    RETURN_IF_ERROR(moe::CheckCombineOutput(c_, out));
    RETURN_IF_ERROR(device_->CombineRecv(out, epoch_, deadline));
    stage_ = Stage::kIdle;
    ++epoch_;
    return Status::Ok();
  }

 private:
  enum class Stage { kIdle, kDispatchSent, kDispatchDone, kCombineSent };

  // Steps run in order; after a proxy failure every step reports it.
  Status Step(Stage want, const char* name) const {
    if (channel_.failed.load(std::memory_order_acquire)) return channel_.Error();
    if (stage_ != want) {
      return FailedPreconditionError(std::string(name) +
                                     " out of order: the steps run DispatchSend, DispatchRecv, "
                                     "CombineSend, CombineRecv");
    }
    return Status::Ok();
  }

  Status CheckInput(const DispatchInput& in) const {
    if (in.num_tokens < 0 || in.num_tokens > c_.max_tokens_per_rank) {
      return InvalidArgumentError("DispatchSend: " + std::to_string(in.num_tokens) +
                                  " tokens, configured maximum " +
                                  std::to_string(c_.max_tokens_per_rank));
    }
    if (in.device_num_tokens) {
      return InvalidArgumentError("DispatchSend: a device token count needs the CUDA device");
    }
    if (in.num_tokens == 0) return Status::Ok();
    if (!in.x || (!in.indices && !in.indices64) || !in.weights ||
        (c_.scales_per_token() && !in.scales)) {
      return InvalidArgumentError("DispatchSend: null input buffer");
    }
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
  const MoeLayout layout_;
  TransferEngine* engine_;
  std::vector<uint8_t> recv_, send_;
  MemoryRegion recv_reg_, send_reg_;
  mutable Channel channel_;  // Error() takes its lock
  moe::Routing routing_;
  std::unique_ptr<moe::MoeDevice> device_;
  std::unique_ptr<moe::Proxy> proxy_;
  Stage stage_ = Stage::kIdle;
  uint64_t epoch_ = 0;
  std::vector<int32_t> narrowed_;  // DispatchInput::indices64 as int32
  std::vector<uint8_t> fp8_x_;  // DispatchInput::x_bf16 quantised
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
