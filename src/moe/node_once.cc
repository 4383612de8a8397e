// Node-once forwarding over a rail AllToAll and a node AllToAll (design in node_once.h).
#include "moe/node_once.h"

#include <algorithm>
#include <string>
#include <utility>

#include "moe/numerics.h"

namespace ferry::moe {
namespace {

class Subgroup final : public Bootstrap {
 public:
  Subgroup(Bootstrap& parent, std::vector<int> members, int rank)
      : parent_(parent), members_(std::move(members)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(members_.size()); }
  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(
      std::span<const uint8_t> mine, std::chrono::milliseconds timeout) override {
    ASSIGN_OR_RETURN(auto all, parent_.AllGather(mine, timeout));
    std::vector<std::vector<uint8_t>> ours;
    ours.reserve(members_.size());
    for (int r : members_) ours.push_back(std::move(all[size_t(r)]));
    return ours;
  }

 private:
  Bootstrap& parent_;
  const std::vector<int> members_;
  const int rank_;
};

class NodeOnceDevice final : public MoeDevice {
 public:
  NodeOnceDevice(const AllToAllConfig& c, const NodeOnceConfigs& inner,
                 std::unique_ptr<AllToAll> rail, std::unique_ptr<AllToAll> node)
      : c_(c), rail_(std::move(rail)), node_(std::move(node)) {
    const int64_t rows = inner.rail.expert_capacity();  // nodes x max_tokens_per_rank
    mid_x_.resize(size_t(rows * c.token_bytes()));
    mid_scales_.resize(size_t(rows * c.scales_per_token()));
    mid_counts_.resize(size_t(inner.rail.local_experts()));
    mid_experts_.resize(size_t(rows * c.experts_per_token));
    mid_weights_.resize(size_t(rows * c.experts_per_token));
    mid_out_.resize(size_t(rows * c.combine_row_bytes()));
  }

  DeviceCaps caps() const override { return {.host_inputs = true}; }

  // Across nodes: each token once to each node holding any of its experts, on our rail. (The
  // epochs are the inner AllToAlls' own.)
  Status DispatchSend(const DispatchInput& in, uint64_t /*epoch*/) override {
    return rail_->DispatchSend(in);
  }

  // The tokens our rail brought to this node, forwarded inside it; what the node's ranks
  // forwarded to us is the caller's output.
  Status DispatchRecv(const DispatchOutput& out, uint64_t /*epoch*/, Deadline deadline) override {
    DispatchOutput mid{.x = mid_x_.data(),
                       .scales = mid_scales_.empty() ? nullptr : mid_scales_.data(),
                       .num_tokens = mid_counts_.data(),
                       .num_rows = &mid_rows_,
                       .token_experts = mid_experts_.data(),
                       .token_weights = mid_weights_.data(),
                       .wait_cost = out.wait_cost ? Zeroed(rail_cost_) : nullptr};
    RETURN_IF_ERROR(rail_->DispatchRecv(mid, deadline));
    RETURN_IF_ERROR(node_->DispatchSend(DispatchInput{
        .x = mid_x_.data(),
        .scales = mid_scales_.empty() ? nullptr : mid_scales_.data(),
        .indices = mid_experts_.data(),  // local to the node: the node AllToAll's ids
        .weights = mid_weights_.data(),
        .num_tokens = mid_rows_}));
    DispatchOutput mine = out;
    mine.wait_cost = out.wait_cost ? Zeroed(node_cost_) : nullptr;
    RETURN_IF_ERROR(node_->DispatchRecv(mine, deadline));
    AddWaitCosts(out.wait_cost);
    return Status::Ok();
  }

  Status CombineSend(const CombineInput& in, uint64_t /*epoch*/) override {
    fp16_ = in.fp16;
    return node_->CombineSend(in);
  }

  // The node's rows for each forwarded token summed here (one row per token), sent back on the
  // rail; the nodes' rows summed into the caller's output.
  Status CombineRecv(const CombineOutput& out, uint64_t /*epoch*/, Deadline deadline) override {
    if (out.weights) {
      return InvalidArgumentError(
          "CombineRecv: weights given at the combine under node-once forwarding (the node sums "
          "a token's experts before its row crosses back: the weights come with the dispatch)");
    }
    int64_t* const node_cost = out.wait_cost ? Zeroed(node_cost_) : nullptr;
    int64_t* const rail_cost = out.wait_cost ? Zeroed(rail_cost_) : nullptr;
    RETURN_IF_ERROR(node_->CombineRecv(CombineOutput{.out = mid_out_.data(),
                                                     .accumulate = false,
                                                     .wait_cost = node_cost,
                                                     .fp16 = fp16_},
                                       deadline));
    RETURN_IF_ERROR(rail_->CombineSend(CombineInput{mid_out_.data(), fp16_}));
    RETURN_IF_ERROR(rail_->CombineRecv(CombineOutput{.out = out.out,
                                                     .accumulate = out.accumulate,
                                                     .wait_cost = rail_cost,
                                                     .fp16 = fp16_},
                                       deadline));
    AddWaitCosts(out.wait_cost);
    return Status::Ok();
  }

  Status Quantize(const DispatchInput& in, const void** x, const float** scales) override {
    fp8_.Quantize(c_, in, x, scales);
    return Status::Ok();
  }

  // Rank r masked: on r's rail, the route into r's node; in r's node, r.
  Status ApplyMasks(const std::vector<uint8_t>& ranks) override {
    const int per_node = c_.ranks_per_node;
    for (int r = 0; r < c_.world_size; ++r) {
      if (!ranks[size_t(r)] || r == c_.rank) continue;
      if (r / per_node == c_.rank / per_node) {
        RETURN_IF_ERROR(node_->SetMasked(r % per_node, true));
      } else if (r % per_node == c_.rank % per_node) {
        RETURN_IF_ERROR(rail_->SetMasked(r / per_node, true));
      }
    }
    return Status::Ok();
  }
  bool masks_live() const override { return false; }

  // The ranks of our node and of our rail we know masked (by the caller or, under
  // mask_lost_peers, lost); the others' masks are their own nodes' and rails' to apply.
  StatusOr<std::vector<uint8_t>> Masked() const override {
    ASSIGN_OR_RETURN(const std::vector<uint8_t> node, node_->Masked());
    ASSIGN_OR_RETURN(const std::vector<uint8_t> rail, rail_->Masked());
    const int per_node = c_.ranks_per_node, first = c_.rank / per_node * per_node;
    std::vector<uint8_t> masked(size_t(c_.world_size), 0);
    for (int l = 0; l < per_node; ++l) masked[size_t(first + l)] = node[size_t(l)];
    for (size_t n = 0; n < rail.size(); ++n) {
      if (rail[n]) masked[n * size_t(per_node) + size_t(c_.rank % per_node)] = 1;
    }
    return masked;
  }
  bool masked_so_far(int rank) const override {
    auto masked = Masked();
    return masked.ok() && (*masked)[size_t(rank)] != 0;
  }

  // The inner AllToAlls report what ended them at their next step.
  Status Sticky() override { return Status::Ok(); }

  uint64_t dispatch_bytes_sent() const override {
    return rail_->dispatch_bytes_sent() + node_->dispatch_bytes_sent();
  }
  uint64_t combine_bytes_sent() const override {
    return rail_->combine_bytes_sent() + node_->combine_bytes_sent();
  }

 private:
  static int64_t* Zeroed(std::vector<int64_t>& v) {
    std::fill(v.begin(), v.end(), 0);
    return v.data();
  }

  // The hops' wait costs into the caller's [world_size]: a rank of our node is charged what our
  // node hop waited for it, the rank forwarding from another node what our rail hop waited for
  // that node (ranks of neither are never waited for directly).
  void AddWaitCosts(int64_t* out) const {
    if (!out) return;
    const int per_node = c_.ranks_per_node, first = c_.rank / per_node * per_node;
    for (int l = 0; l < per_node; ++l) out[first + l] += node_cost_[size_t(l)];
    for (size_t n = 0; n < rail_cost_.size(); ++n) {
      out[n * size_t(per_node) + size_t(c_.rank % per_node)] += rail_cost_[n];
    }
  }

  const AllToAllConfig c_;
  const std::unique_ptr<AllToAll> rail_, node_;
  // The hops' wait costs (DispatchOutput / CombineOutput::wait_cost), per node and per rank of
  // ours.
  std::vector<int64_t> rail_cost_ =
      std::vector<int64_t>(size_t(c_.world_size / c_.ranks_per_node));
  std::vector<int64_t> node_cost_ = std::vector<int64_t>(size_t(c_.ranks_per_node));
  // What the rail brought to this node (token-major) and what goes back on it.
  std::vector<uint8_t> mid_x_;
  std::vector<float> mid_scales_;
  std::vector<int32_t> mid_counts_;
  int32_t mid_rows_ = 0;
  std::vector<int32_t> mid_experts_;
  std::vector<float> mid_weights_;
  std::vector<uint8_t> mid_out_;
  bool fp16_ = false;
  HostFp8Rows fp8_;  // DispatchInput::x_bf16 quantised (Quantize)
};

}  // namespace

NodeOnceConfigs NodeOnceConfigsOf(const AllToAllConfig& c) {
  const int per_node = c.ranks_per_node, nodes = c.world_size / per_node;
  NodeOnceConfigs o{c, c};
  o.rail.forwarding = o.node.forwarding = Forwarding::kPerRank;
  // Between nodes: rank n holds node n's experts; a token once per node, one row back.
  o.rail.world_size = nodes;
  o.rail.rank = c.rank / per_node;
  o.rail.ranks_per_node = 1;
  o.rail.dispatch_once_per_rank = true;
  o.rail.combine_reduce_at_expert_rank = true;
  o.rail.dispatch_layout = DispatchLayout::kTokenMajor;
  // Inside the node: the node's experts, the forwarder's received tokens as its input.
  o.node.world_size = per_node;
  o.node.rank = c.rank % per_node;
  o.node.num_experts = c.num_experts / nodes;
  o.node.max_tokens_per_rank = nodes * c.max_tokens_per_rank;
  o.node.instance = c.instance + 1;
  return o;
}

std::unique_ptr<Bootstrap> SubBootstrap(Bootstrap& parent, std::vector<int> members) {
  const int rank = static_cast<int>(std::find(members.begin(), members.end(), parent.rank()) -
                                    members.begin());
  return std::make_unique<Subgroup>(parent, std::move(members), rank);
}

StatusOr<std::unique_ptr<MoeDevice>> CreateNodeOnceDevice(const AllToAllConfig& config,
                                                          TransferEngine* engine,
                                                          Bootstrap& bootstrap) {
  if (config.device != MoeDeviceKind::kHost) {
    return UnimplementedError("AllToAll: node-once forwarding runs on the host device only, "
                              "for now (" + config.ToString() + ")");
  }
  const NodeOnceConfigs inner = NodeOnceConfigsOf(config);
  const int per_node = config.ranks_per_node, nodes = config.world_size / per_node;
  std::vector<int> rail_ranks, node_ranks;
  for (int n = 0; n < nodes; ++n) rail_ranks.push_back(n * per_node + config.rank % per_node);
  for (int l = 0; l < per_node; ++l) node_ranks.push_back(config.rank / per_node * per_node + l);
  // Every rank makes its rail's AllToAll, then its node's: the parent's collectives line up.
  auto rail_group = SubBootstrap(bootstrap, std::move(rail_ranks));
  ASSIGN_OR_RETURN(auto rail, AllToAll::Create(inner.rail, engine, *rail_group));
  auto node_group = SubBootstrap(bootstrap, std::move(node_ranks));
  ASSIGN_OR_RETURN(auto node, AllToAll::Create(inner.node, engine, *node_group));
  return std::unique_ptr<MoeDevice>(
      std::make_unique<NodeOnceDevice>(config, inner, std::move(rail), std::move(node)));
}

}  // namespace ferry::moe
