// The host device: dispatch and combine on host memory over a TransferEngine.
//
// Buffers of one rank (N ranks, E experts, L = E / N local experts, T = max_tokens_per_rank,
// K = experts_per_token, P = max_private_tokens, C = T * min(K, L) copies one sender can route to
// one receiver; a "slot" is 16 bytes of metadata + one token row + its scales):
//
//   receive region                                   send region
//   counts    [N][E] int32   (every sender's routing) counts    [E] int32
//   private   [N][P] slots   (first P from sender s)  dispatch  [T * K] slots, grouped by receiver
//   overflow  [N * C] slots  (the rest, packed by     combine   [N * C] bf16 rows, grouped by
//                             sender rank)                       the rank they return to
//   combine   [T * K] bf16 rows (returned copies,
//                             grouped by expert rank)
//
// A receiver gets at most N * C copies (every sender routes all its copies to it); the overflow
// region holds that worst case, so no configuration can overrun it.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "ferry/moe.h"

namespace ferry {
namespace {

constexpr uint32_t kImmBase = 0xE0000000u;
enum ImmKind : uint32_t {
  kCounts = 1,
  kPrivate = 2,
  kOverflow = 3,
  kCombine = 4,
  kDispatchConsumed = 5,
  kCombineConsumed = 6,
};
constexpr uint32_t kEpochs = 4;  // a rank is never more than one iteration ahead of another
uint32_t Imm(ImmKind kind, uint64_t epoch) {
  return kImmBase | (uint32_t{kind} << 4) | static_cast<uint32_t>(epoch % kEpochs);
}

struct SlotMeta {
  int32_t src_token;
  int32_t k;
  int32_t local_expert;
  int32_t reserved;
};
static_assert(sizeof(SlotMeta) == 16, "slot metadata is 16 bytes on the wire");

int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

class HostAllToAll final : public AllToAll {
 public:
  HostAllToAll(const AllToAllConfig& c, TransferEngine* engine) : c_(c), engine_(engine) {
    const int64_t n = c.world_size, e = c.num_experts, t = c.max_tokens_per_rank,
                  k = c.experts_per_token, l = c.local_experts();
    copies_per_pair_ = t * std::min(k, l);
    slot_bytes_ = RoundUp(int64_t{sizeof(SlotMeta)} + c.token_bytes() +
                              int64_t{c.scales_per_token()} * 4, 16);
    row_bytes_ = int64_t{c.hidden} * 2;
    counts_off_ = 0;
    private_off_ = RoundUp(n * e * 4, 64);
    overflow_off_ = private_off_ + n * c.max_private_tokens * slot_bytes_;
    combine_off_ = overflow_off_ + n * copies_per_pair_ * slot_bytes_;
    recv_bytes_ = combine_off_ + t * k * row_bytes_;
    send_counts_off_ = 0;
    send_dispatch_off_ = RoundUp(e * 4, 64);
    send_combine_off_ = send_dispatch_off_ + t * k * slot_bytes_;
    send_bytes_ = send_combine_off_ + n * copies_per_pair_ * row_bytes_;
  }

  Status Init(Bootstrap& bootstrap) {
    const int n = c_.world_size, me = c_.rank;
    recv_.assign(recv_bytes_, 0);
    send_.assign(send_bytes_, 0);
    ASSIGN_OR_RETURN(recv_reg_, engine_->RegisterMemory(recv_.data(), recv_.size()));
    ASSIGN_OR_RETURN(send_reg_, engine_->RegisterMemory(send_.data(), send_.size()));
    for (uint32_t kind = kCounts; kind <= kCombineConsumed; ++kind) {
      for (uint32_t epoch = 0; epoch < kEpochs; ++epoch) {
        Status s = engine_->CreateImmCounter(Imm(static_cast<ImmKind>(kind), epoch));
        if (!s.ok() && s.code() != StatusCode::kAlreadyExists) return s;
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
    peer_of_rank_.assign(n, 0);
    std::vector<PeerId> members;
    std::vector<RemoteRegion> dsts;
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      ASSIGN_OR_RETURN(peer_of_rank_[r], engine_->AddPeer(addresses[r]));
      ASSIGN_OR_RETURN(RemoteRegion region, RemoteRegion::Parse(regions[r]));
      if (region.length != static_cast<uint64_t>(recv_bytes_)) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) +
                                    " registered a receive region of another size");
      }
      members.push_back(peer_of_rank_[r]);
      dsts.push_back(region);
    }
    if (n > 1) {
      ASSIGN_OR_RETURN(group_, engine_->AddPeerGroup(members));
      ASSIGN_OR_RETURN(plan_, engine_->PrepareScatter(group_, send_reg_, dsts));
    }
    counts_.assign(size_t(n) * c_.num_experts, 0);
    targets_.reserve(n);
    return bootstrap.Barrier(timeout);
  }

  const AllToAllConfig& config() const override { return c_; }
  uint64_t dispatch_bytes_sent() const override { return dispatch_bytes_; }
  uint64_t combine_bytes_sent() const override { return combine_bytes_; }

  Status DispatchSend(const DispatchInput& in) override {
    if (stage_ != Stage::kIdle) return FailedPreconditionError("DispatchSend out of order");
    RETURN_IF_ERROR(CheckInput(in));
    const int n = c_.world_size, me = c_.rank, k = c_.experts_per_token, l = c_.local_experts();
    // Buffers of the previous iteration: our own writes done, every peer done reading ours.
    RETURN_IF_ERROR(WaitSends());
    if (epoch_ > 0) RETURN_IF_ERROR(AwaitFromPeers(kDispatchConsumed, epoch_ - 1));

    // Routing: copies grouped by receiving rank, in (token, k) order.
    num_tokens_ = in.num_tokens;
    weights_.assign(in.weights, in.weights + size_t(in.num_tokens) * k);
    sent_.assign(n, {});
    int32_t* my_counts = reinterpret_cast<int32_t*>(send_.data() + send_counts_off_);
    std::fill(my_counts, my_counts + c_.num_experts, 0);
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        int32_t e = in.indices[size_t(t) * k + j];
        sent_[e / l].push_back({t, j, e % l});
        ++my_counts[e];
      }
    }
    // Pack each receiver's slots contiguously.
    send_slot_start_.assign(n + 1, 0);
    for (int r = 0; r < n; ++r) send_slot_start_[r + 1] = send_slot_start_[r] + sent_[r].size();
    const int64_t payload = c_.token_bytes(), scale_bytes = int64_t{c_.scales_per_token()} * 4;
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < sent_[r].size(); ++i) {
        const Copy& cp = sent_[r][i];
        uint8_t* slot = SendSlot(send_slot_start_[r] + i);
        SlotMeta meta{cp.token, cp.k, cp.local_expert, 0};
        std::memcpy(slot, &meta, sizeof meta);
        std::memcpy(slot + sizeof meta,
                    static_cast<const uint8_t*>(in.x) + int64_t{cp.token} * payload, payload);
        if (scale_bytes) {
          std::memcpy(slot + sizeof meta + payload,
                      in.scales + int64_t{cp.token} * c_.scales_per_token(), scale_bytes);
        }
      }
    }
    // Counts to everyone, then the private part of every receiver's slots. Both are scatters
    // over the peer group: one write per peer each.
    std::memcpy(recv_.data() + counts_off_ + int64_t{me} * c_.num_experts * 4, my_counts,
                size_t(c_.num_experts) * 4);
    dispatch_bytes_ = 0;
    targets_.clear();
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      targets_.push_back({Member(r), uint64_t(send_counts_off_),
                          uint64_t(counts_off_) + uint64_t(me) * c_.num_experts * 4,
                          uint64_t(c_.num_experts) * 4});
    }
    RETURN_IF_ERROR(ScatterTargets(kCounts));
    targets_.clear();
    for (int r = 0; r < n; ++r) {
      int64_t count = std::min<int64_t>(sent_[r].size(), c_.max_private_tokens);
      uint64_t src = SendSlotOffset(send_slot_start_[r]);
      uint64_t dst = private_off_ + (uint64_t(me) * c_.max_private_tokens) * slot_bytes_;
      if (r == me) {
        std::memcpy(recv_.data() + dst, send_.data() + src, count * slot_bytes_);
        continue;
      }
      targets_.push_back({Member(r), src, dst, uint64_t(count * slot_bytes_)});
    }
    RETURN_IF_ERROR(ScatterTargets(kPrivate));
    stage_ = Stage::kDispatchSent;
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, Deadline deadline) override {
    if (stage_ != Stage::kDispatchSent) return FailedPreconditionError("DispatchRecv out of order");
    if (!out.x || !out.num_tokens || (c_.scales_per_token() && !out.scales)) {
      return InvalidArgumentError("DispatchRecv: null output buffer");
    }
    const int n = c_.world_size, me = c_.rank, l = c_.local_experts();
    const int64_t p = c_.max_private_tokens;
    // Every rank's routing, then where our overflow goes in each receiver.
    RETURN_IF_ERROR(AwaitFromPeers(kCounts, epoch_, deadline));
    std::memcpy(counts_.data(), recv_.data() + counts_off_, counts_.size() * 4);
    targets_.clear();
    for (int r = 0; r < n; ++r) {
      int64_t sent = static_cast<int64_t>(sent_[r].size());
      if (sent <= p) continue;
      uint64_t src = SendSlotOffset(send_slot_start_[r] + p);
      uint64_t dst = overflow_off_ + OverflowStart(me, r) * slot_bytes_;
      uint64_t len = uint64_t(sent - p) * slot_bytes_;
      if (r == me) {
        std::memcpy(recv_.data() + dst, send_.data() + src, len);
        continue;
      }
      targets_.push_back({Member(r), src, dst, len});
    }
    RETURN_IF_ERROR(ScatterTargets(kOverflow));

    // Wait for what lands here: a private write from every peer, an overflow write from each
    // peer that sent us more than P copies.
    RETURN_IF_ERROR(AwaitFromPeers(kPrivate, epoch_, deadline));
    uint64_t overflow_writes = 0;
    for (int s = 0; s < n; ++s) {
      if (s != me && Copies(s, me) > p) ++overflow_writes;
    }
    RETURN_IF_ERROR(Await(kOverflow, epoch_, overflow_writes, deadline));

    // Unpack into expert-major rows, sender by sender, each in its send order.
    std::fill(out.num_tokens, out.num_tokens + l, 0);
    routes_.assign(size_t(l) * c_.expert_capacity(), Route{});
    const int64_t payload = c_.token_bytes(), spt = c_.scales_per_token();
    for (int s = 0; s < n; ++s) {
      const int64_t copies = Copies(s, me);
      for (int64_t j = 0; j < copies; ++j) {
        const uint8_t* slot =
            j < p ? recv_.data() + private_off_ + (int64_t{s} * p + j) * slot_bytes_
                  : recv_.data() + overflow_off_ + (OverflowStart(s, me) + j - p) * slot_bytes_;
        SlotMeta meta;
        std::memcpy(&meta, slot, sizeof meta);
        if (meta.local_expert < 0 || meta.local_expert >= l) {
          return DataLossError("DispatchRecv: slot from rank " + std::to_string(s) +
                               " names local expert " + std::to_string(meta.local_expert));
        }
        int32_t row = out.num_tokens[meta.local_expert]++;
        int64_t dst_row = int64_t{meta.local_expert} * c_.expert_capacity() + row;
        std::memcpy(static_cast<uint8_t*>(out.x) + dst_row * payload, slot + sizeof meta, payload);
        if (spt) {
          std::memcpy(out.scales + dst_row * spt, slot + sizeof meta + payload, spt * 4);
        }
        routes_[dst_row] = Route{s, static_cast<int32_t>(j)};
      }
    }
    expert_rows_.assign(out.num_tokens, out.num_tokens + l);
    // Our receive buffers are free again: tell every sender.
    RETURN_IF_ERROR(BarrierPeers(kDispatchConsumed));
    stage_ = Stage::kDispatchDone;
    return Status::Ok();
  }

  Status CombineSend(const uint16_t* expert_out) override {
    if (stage_ != Stage::kDispatchDone) return FailedPreconditionError("CombineSend out of order");
    if (!expert_out) return InvalidArgumentError("CombineSend: null expert output");
    const int n = c_.world_size, me = c_.rank, l = c_.local_experts();
    RETURN_IF_ERROR(WaitSends());
    if (epoch_ > 0) RETURN_IF_ERROR(AwaitFromPeers(kCombineConsumed, epoch_ - 1));
    // Rows go back to their sender in the order it sent them: copy j of sender s sits at row j
    // of s's segment, and lands at row j of our segment in s's combine region.
    std::vector<int64_t> seg(n + 1, 0);
    for (int s = 0; s < n; ++s) seg[s + 1] = seg[s] + Copies(s, me);
    for (int e = 0; e < l; ++e) {
      for (int32_t row = 0; row < expert_rows_[e]; ++row) {
        int64_t src_row = int64_t{e} * c_.expert_capacity() + row;
        const Route& route = routes_[src_row];
        std::memcpy(send_.data() + send_combine_off_ + (seg[route.src] + route.copy) * row_bytes_,
                    expert_out + src_row * c_.hidden, row_bytes_);
      }
    }
    combine_bytes_ = 0;
    targets_.clear();
    for (int s = 0; s < n; ++s) {
      uint64_t src = send_combine_off_ + seg[s] * row_bytes_;
      uint64_t dst = combine_off_ + CombineStart(s, me) * row_bytes_;
      uint64_t len = uint64_t(seg[s + 1] - seg[s]) * row_bytes_;
      if (s == me) {
        std::memcpy(recv_.data() + dst, send_.data() + src, len);
        continue;
      }
      targets_.push_back({Member(s), src, dst, len});
    }
    RETURN_IF_ERROR(ScatterTargets(kCombine));
    stage_ = Stage::kCombineSent;
    return Status::Ok();
  }

  Status CombineRecv(uint16_t* out, bool accumulate, Deadline deadline) override {
    if (stage_ != Stage::kCombineSent) return FailedPreconditionError("CombineRecv out of order");
    if (!out && num_tokens_ > 0) return InvalidArgumentError("CombineRecv: null output");
    const int n = c_.world_size, me = c_.rank, k = c_.experts_per_token, h = c_.hidden;
    RETURN_IF_ERROR(AwaitFromPeers(kCombine, epoch_, deadline));
    std::vector<float> acc(size_t(num_tokens_) * h, 0.0f);
    if (accumulate) {
      for (size_t i = 0; i < acc.size(); ++i) acc[i] = Bf16ToFloat(out[i]);
    }
    for (int r = 0; r < n; ++r) {
      const uint8_t* base = recv_.data() + combine_off_ + CombineStart(me, r) * row_bytes_;
      for (size_t j = 0; j < sent_[r].size(); ++j) {
        const Copy& cp = sent_[r][j];
        const float w = weights_[size_t(cp.token) * k + cp.k];
        const uint16_t* row = reinterpret_cast<const uint16_t*>(base + j * row_bytes_);
        float* dst = acc.data() + size_t(cp.token) * h;
        for (int i = 0; i < h; ++i) dst[i] += w * Bf16ToFloat(row[i]);
      }
    }
    for (size_t i = 0; i < acc.size(); ++i) out[i] = FloatToBf16(acc[i]);
    RETURN_IF_ERROR(BarrierPeers(kCombineConsumed));
    stage_ = Stage::kIdle;
    ++epoch_;
    return Status::Ok();
  }

 private:
  enum class Stage { kIdle, kDispatchSent, kDispatchDone, kCombineSent };
  struct Copy {
    int32_t token;
    int32_t k;
    int32_t local_expert;
  };
  struct Route {
    int32_t src = -1;   // sending rank
    int32_t copy = -1;  // index in that rank's list for us
  };

  Status CheckInput(const DispatchInput& in) const {
    if (in.num_tokens < 0 || in.num_tokens > c_.max_tokens_per_rank) {
      return InvalidArgumentError("DispatchSend: " + std::to_string(in.num_tokens) +
                                  " tokens, configured maximum " +
                                  std::to_string(c_.max_tokens_per_rank));
    }
    if (in.num_tokens == 0) return Status::Ok();
    if (!in.x || !in.indices || !in.weights || (c_.scales_per_token() && !in.scales)) {
      return InvalidArgumentError("DispatchSend: null input buffer");
    }
    const int64_t copies = int64_t{in.num_tokens} * c_.experts_per_token;
    for (int64_t i = 0; i < copies; ++i) {
      if (in.indices[i] < 0 || in.indices[i] >= c_.num_experts) {
        return OutOfRangeError("DispatchSend: token " + std::to_string(i / c_.experts_per_token) +
                               " routes to expert " + std::to_string(in.indices[i]) +
                               ", valid ids are [0, " + std::to_string(c_.num_experts) + ")");
      }
    }
    return Status::Ok();
  }

  uint32_t Member(int rank) const { return static_cast<uint32_t>(rank < c_.rank ? rank : rank - 1); }

  // Copies rank s routes to rank r this epoch (from the exchanged counts).
  int64_t Copies(int s, int r) const {
    if (s == c_.rank) return static_cast<int64_t>(sent_[r].size());
    const int l = c_.local_experts();
    const int32_t* row = counts_.data() + size_t(s) * c_.num_experts + size_t(r) * l;
    return std::accumulate(row, row + l, int64_t{0});
  }
  // Slot where sender s's overflow starts in receiver r's overflow region.
  int64_t OverflowStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < s; ++q) start += std::max<int64_t>(0, Copies(q, r) - c_.max_private_tokens);
    return start;
  }
  // Row where expert rank r's returned copies start in sender s's combine region.
  int64_t CombineStart(int s, int r) const {
    int64_t start = 0;
    for (int q = 0; q < r; ++q) start += Copies(s, q);
    return start;
  }

  uint64_t SendSlotOffset(int64_t slot) const { return send_dispatch_off_ + slot * slot_bytes_; }
  uint8_t* SendSlot(int64_t slot) { return send_.data() + SendSlotOffset(slot); }

  // Posts targets_ as one scatter carrying the kind's immediate for this epoch. Empty targets
  // still announce themselves (zero bytes), so receivers can count one write per peer.
  Status ScatterTargets(ImmKind kind) {
    if (targets_.empty()) return Status::Ok();
    uint64_t bytes = 0;
    for (const ScatterTarget& t : targets_) bytes += t.length;
    (kind == kCombine ? combine_bytes_ : dispatch_bytes_) += bytes;
    // The targets must outlive the transfer: keep this epoch's in a list that WaitSends frees.
    in_flight_targets_.push_back(targets_);
    ++submitted_;
    return engine_->Scatter({plan_, in_flight_targets_.back(), Imm(kind, epoch_)},
                            Completion::Counter(&sends_));
  }

  Status BarrierPeers(ImmKind kind) {
    if (c_.world_size == 1) return Status::Ok();
    ++submitted_;
    return engine_->Barrier(group_, Imm(kind, epoch_), Completion::Counter(&sends_));
  }

  Status WaitSends() {
    RETURN_IF_ERROR(sends_.Wait(submitted_, Deadline::After(std::chrono::seconds(30))));
    if (sends_.failed.load() > 0) {
      return UnavailableError("AllToAll: " + std::to_string(sends_.failed.load()) +
                              " writes to peers failed");
    }
    in_flight_targets_.clear();
    return Status::Ok();
  }

  Status AwaitFromPeers(ImmKind kind, uint64_t epoch,
                        Deadline deadline = Deadline::After(std::chrono::seconds(30))) {
    return Await(kind, epoch, uint64_t(c_.world_size - 1), deadline);
  }
  Status Await(ImmKind kind, uint64_t epoch, uint64_t count, Deadline deadline) {
    if (count == 0) return Status::Ok();
    uint32_t imm = Imm(kind, epoch);
    Status s = engine_->WaitImm(imm, count, deadline);
    if (!s.ok()) {
      return s.WithContext("AllToAll rank " + std::to_string(c_.rank) + " epoch " +
                           std::to_string(epoch) + " kind " + std::to_string(kind));
    }
    return engine_->ConsumeImm(imm, count);
  }

  const AllToAllConfig c_;
  TransferEngine* engine_;
  int64_t copies_per_pair_ = 0, slot_bytes_ = 0, row_bytes_ = 0;
  int64_t counts_off_ = 0, private_off_ = 0, overflow_off_ = 0, combine_off_ = 0, recv_bytes_ = 0;
  int64_t send_counts_off_ = 0, send_dispatch_off_ = 0, send_combine_off_ = 0, send_bytes_ = 0;
  std::vector<uint8_t> recv_, send_;
  MemoryRegion recv_reg_, send_reg_;
  std::vector<PeerId> peer_of_rank_;
  GroupId group_ = 0;
  ScatterPlanId plan_ = 0;

  Stage stage_ = Stage::kIdle;
  uint64_t epoch_ = 0;
  int num_tokens_ = 0;
  std::vector<float> weights_;                 // [T, K] of the current iteration
  std::vector<std::vector<Copy>> sent_;        // per receiving rank, in send order
  std::vector<int64_t> send_slot_start_;       // [N + 1] first send slot of each receiver
  std::vector<int32_t> counts_;                // [N, E] exchanged routing
  std::vector<Route> routes_;                  // [L, capacity] where each received row came from
  std::vector<int32_t> expert_rows_;           // [L]
  std::vector<ScatterTarget> targets_;
  std::vector<std::vector<ScatterTarget>> in_flight_targets_;
  TransferCounter sends_;
  uint64_t submitted_ = 0;
  uint64_t dispatch_bytes_ = 0, combine_bytes_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<AllToAll>> AllToAll::Create(const AllToAllConfig& config,
                                                     TransferEngine* engine, Bootstrap& bootstrap) {
  RETURN_IF_ERROR(config.Validate());
  if (!engine) return InvalidArgumentError("AllToAll: null engine");
  if (bootstrap.world_size() != config.world_size || bootstrap.rank() != config.rank) {
    return InvalidArgumentError("AllToAll: bootstrap has rank " +
                                std::to_string(bootstrap.rank()) + " of " +
                                std::to_string(bootstrap.world_size()) + ", config says " +
                                std::to_string(config.rank) + " of " +
                                std::to_string(config.world_size));
  }
  auto a2a = std::make_unique<HostAllToAll>(config, engine);
  RETURN_IF_ERROR(a2a->Init(bootstrap));
  return std::unique_ptr<AllToAll>(std::move(a2a));
}

}  // namespace ferry
