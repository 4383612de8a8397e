// Node-once forwarding over a rail AllToAll and a node AllToAll (design in node_once.h).
#include "moe/node_once.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "moe/liveness.h"

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

// Our rail's ranks and our node's, in the caller's world.
std::vector<int> RailRanks(const AllToAllConfig& c) {
  std::vector<int> ranks;
  for (int n = 0; n < c.world_size / c.ranks_per_node; ++n) {
    ranks.push_back(n * c.ranks_per_node + c.rank % c.ranks_per_node);
  }
  return ranks;
}
std::vector<int> NodeRanks(const AllToAllConfig& c) {
  std::vector<int> ranks;
  const int first = c.rank / c.ranks_per_node * c.ranks_per_node;
  for (int l = 0; l < c.ranks_per_node; ++l) ranks.push_back(first + l);
  return ranks;
}

// The three hop AllToAlls, made on `engine` (collective over `bootstrap`: every rank makes its
// rail's, its weights rail's, then its node's, so that the parent's collectives line up),
// asking `liveness` (null: nobody) before they take a rank for lost. adopt_counters: built
// anew on the instances of hops gone (NodeOnceDevice::Readmit).
struct Hops {
  std::unique_ptr<AllToAll> rail, weights, node;
};
StatusOr<Hops> BuildHops(const AllToAllConfig& c, TransferEngine* engine, Bootstrap& bootstrap,
                         Liveness* liveness, bool adopt_counters) {
  const NodeOnceConfigs inner = NodeOnceConfigsOf(c);
  const Hearing rail_hearing{liveness, RailRanks(c)}, node_hearing{liveness, NodeRanks(c)};
  const Hearing* rail_heard = liveness ? &rail_hearing : nullptr;
  const Hearing* node_heard = liveness ? &node_hearing : nullptr;
  Hops h;
  auto rail_group = SubBootstrap(bootstrap, RailRanks(c));
  ASSIGN_OR_RETURN(h.rail,
                   CreateAllToAll(inner.rail, engine, *rail_group, rail_heard, adopt_counters));
  ASSIGN_OR_RETURN(h.weights, CreateAllToAll(inner.weights, engine, *rail_group, rail_heard,
                                             adopt_counters));
  auto node_group = SubBootstrap(bootstrap, NodeRanks(c));
  ASSIGN_OR_RETURN(h.node,
                   CreateAllToAll(inner.node, engine, *node_group, node_heard, adopt_counters));
  return h;
}

class NodeOnceDevice final : public MoeDevice {
 public:
  NodeOnceDevice(const AllToAllConfig& c, TransferEngine* engine, Hops hops_made,
                 std::unique_ptr<HopMemory> hops, std::unique_ptr<Liveness> liveness)
      : c_(c),
        engine_(engine),
        liveness_(std::move(liveness)),
        hops_(std::move(hops)),
        rail_(std::move(hops_made.rail)),
        node_(std::move(hops_made.node)),
        weights_(std::move(hops_made.weights)) {}
  // The heartbeats stop first: their thread writes into the CUDA hops' memory (Nv::heard).
  ~NodeOnceDevice() override {
    if (liveness_) liveness_->Stop();
    PrintTrace();
  }

  // The middle buffers, in the hops' memory.
  Status Init() {
    const MiddleBytes m = MiddleBytesOf(c_);
    ASSIGN_OR_RETURN(uint8_t* x, hops_->Allocate(m.x));
    ASSIGN_OR_RETURN(uint8_t* scales, hops_->Allocate(m.scales));
    ASSIGN_OR_RETURN(uint8_t* counts, hops_->Allocate(m.counts));
    ASSIGN_OR_RETURN(uint8_t* num_rows, hops_->Allocate(m.num_rows));
    ASSIGN_OR_RETURN(uint8_t* experts, hops_->Allocate(m.experts));
    ASSIGN_OR_RETURN(uint8_t* weights, hops_->Allocate(m.weights));
    ASSIGN_OR_RETURN(mid_out_, hops_->Allocate(m.out));
    if (m.sums) {
      ASSIGN_OR_RETURN(uint8_t* sums, hops_->Allocate(m.sums));
      sums_ = reinterpret_cast<float*>(sums);
    }
    ASSIGN_OR_RETURN(uint8_t* rail_cost, hops_->Allocate(m.rail_cost));
    // The weights rail's.
    const int64_t rows = rail_->config().expert_capacity(), k = c_.experts_per_token;
    ASSIGN_OR_RETURN(ids_, hops_->Allocate(m.ids));
    ASSIGN_OR_RETURN(uint8_t* padded, hops_->Allocate(m.padded));
    ASSIGN_OR_RETURN(uint8_t* wx, hops_->Allocate(rows * kWeightsWidth * 4));
    ASSIGN_OR_RETURN(uint8_t* wcounts, hops_->Allocate(int64_t{rail_->config().local_experts()} * 4));
    ASSIGN_OR_RETURN(uint8_t* wrows, hops_->Allocate(4));
    ASSIGN_OR_RETURN(uint8_t* wexperts, hops_->Allocate(rows * k * 4));
    ASSIGN_OR_RETURN(uint8_t* wweights, hops_->Allocate(rows * k * 4));
    ASSIGN_OR_RETURN(uint8_t* node_weights, hops_->Allocate(rows * k * 4));
    padded_ = reinterpret_cast<float*>(padded);
    node_weights_ = reinterpret_cast<float*>(node_weights);
    weights_mid_ = DispatchOutput{.x = wx,
                                  .num_tokens = reinterpret_cast<int32_t*>(wcounts),
                                  .num_rows = reinterpret_cast<int32_t*>(wrows),
                                  .token_experts = reinterpret_cast<int32_t*>(wexperts),
                                  .token_weights = reinterpret_cast<float*>(wweights)};
    rail_cost_ = reinterpret_cast<int64_t*>(rail_cost);
    mid_ = DispatchOutput{.x = x,
                          .scales = c_.scales_per_token() ? reinterpret_cast<float*>(scales)
                                                          : nullptr,
                          .num_tokens = reinterpret_cast<int32_t*>(counts),
                          .num_rows = reinterpret_cast<int32_t*>(num_rows),
                          .token_experts = reinterpret_cast<int32_t*>(experts),
                          .token_weights = reinterpret_cast<float*>(weights)};
    return Status::Ok();
  }

  // The shell's checks hold for the rail's inputs (the caller's); the rail quantises bf16 rows
  // and, on the CUDA device, reads a device token count.
  DeviceCaps caps() const override {
    if (on_gpu()) {
      return DeviceCaps{.streams = true, .device_token_count = true, .bf16_to_device = true};
    }
    return DeviceCaps{.host_inputs = true, .bf16_to_device = true};
  }

  // Across nodes: each token once to each node holding any of its experts, on our rail. (The
  // epochs are the inner AllToAlls' own.)
  Status DispatchSend(const DispatchInput& in, uint64_t /*epoch*/) override {
    stamps_ = 0;  // an epoch begins
    RETURN_IF_ERROR(rail_->DispatchSend(in));
    // The ids, kept for a combine given its weights (the weights rail routes as the rail did):
    // every row the step may send, the device count read again then.
    sent_ = in;
    const int64_t k = c_.experts_per_token, id_bytes = in.indices64 ? 8 : 4;
    if (in.num_tokens > 0) {
      RETURN_IF_ERROR(hops_->CopyRows(ids_, k * id_bytes, in.indices64
                                                              ? static_cast<const void*>(in.indices64)
                                                              : static_cast<const void*>(in.indices),
                                      k * id_bytes, k * id_bytes, in.num_tokens));
    }
    return Status::Ok();
  }

  // The tokens our rail brought to this node, forwarded inside it; what the node's ranks
  // forwarded to us is the caller's output.
  Status DispatchRecv(const DispatchOutput& out, uint64_t /*epoch*/, Deadline deadline) override {
    const Liveness::Stepping stepping(liveness_.get());  // our heartbeats while we wait
    const Clock::time_point start = Clock::now();
    DispatchOutput mid = mid_;
    mid.wait_cost = out.wait_cost ? rail_cost_ : nullptr;
    if (mid.wait_cost) RETURN_IF_ERROR(hops_->Zero(rail_cost_, rail_->config().world_size));
    RETURN_IF_ERROR(Stamp(kDispatchRecvStart));
    RETURN_IF_ERROR(rail_->DispatchRecv(mid, deadline));
    RETURN_IF_ERROR(Stamp(kRailDispatched));
    DispatchInput forward{
        .x = mid_.x,
        .scales = mid_.scales,
        .indices = mid_.token_experts,  // local to the node: the node AllToAll's ids
        .weights = mid_.token_weights};
    if (on_gpu()) {
      // The rows the rail brought, as the GPU counted them: no host wait between the hops.
      forward.num_tokens = static_cast<int>(rail_->config().expert_capacity());
      forward.device_num_tokens = mid_.num_rows;
    } else {
      forward.num_tokens = *mid_.num_rows;
    }
    RETURN_IF_ERROR(node_->DispatchSend(forward));
    DispatchOutput mine = out;
    mine.wait_cost = NodeCosts(out.wait_cost);
    RETURN_IF_ERROR(node_->DispatchRecv(mine, HopDeadline(deadline, start)));
    RETURN_IF_ERROR(Stamp(kNodeDispatched));
    return AddRailCosts(out.wait_cost);
  }

  Status CombineSend(const CombineInput& in, uint64_t /*epoch*/) override {
    fp16_ = in.fp16;
    RETURN_IF_ERROR(Stamp(kCombineStart));
    return node_->CombineSend(in);
  }

  // The node's rows for each forwarded token summed here (one row per token), sent back on the
  // rail; the nodes' rows summed into the caller's output.
  Status CombineRecv(const CombineOutput& out, uint64_t /*epoch*/, Deadline deadline) override {
    const Liveness::Stepping stepping(liveness_.get());
    const Clock::time_point start = Clock::now();
    // Weights given now cross to the forwarders first, where the node sums with them.
    if (out.weights) RETURN_IF_ERROR(WeightsToForwarders(out.weights, deadline));
    // fp32 partial sums (sums_ made): the node's sum stays fp32 and the rail moves fp32 rows.
    const bool wide = sums_ != nullptr;
    RETURN_IF_ERROR(node_->CombineRecv(CombineOutput{.out = mid_out_,
                                                     .accumulate = false,
                                                     .weights = out.weights ? node_weights_
                                                                            : nullptr,
                                                     .wait_cost = NodeCosts(out.wait_cost),
                                                     .fp16 = fp16_,
                                                     .fp32_out = wide},
                                       HopDeadline(deadline, start)));
    RETURN_IF_ERROR(Stamp(kNodeCombined));
    const bool rail_fp16 = fp16_ && !wide;
    RETURN_IF_ERROR(rail_->CombineSend(CombineInput{mid_out_, rail_fp16}));
    // The weights rail's epoch ends beside the rail's (its rows read by nobody).
    if (out.weights) RETURN_IF_ERROR(weights_->CombineSend(CombineInput{weights_mid_.x}));
    int64_t* const rail_cost = out.wait_cost ? rail_cost_ : nullptr;
    if (rail_cost) RETURN_IF_ERROR(hops_->Zero(rail_cost_, rail_->config().world_size));
    // The rail's fp32 sums go to the caller's fp32 output as they are, else are rounded once
    // into its 2-byte output.
    const bool narrow = wide && !out.fp32_out;
    RETURN_IF_ERROR(rail_->CombineRecv(CombineOutput{.out = narrow ? sums_ : out.out,
                                                     .accumulate = !narrow && out.accumulate,
                                                     .wait_cost = rail_cost,
                                                     .fp16 = rail_fp16,
                                                     .fp32_out = out.fp32_out},
                                       HopDeadline(deadline, start)));
    if (narrow) {
      RETURN_IF_ERROR(hops_->Narrow(out.out, sums_, c_.hidden, sent_.num_tokens,
                                    sent_.device_num_tokens, fp16_, out.accumulate));
    }
    if (out.weights) {
      RETURN_IF_ERROR(
          weights_->CombineRecv(CombineOutput{.out = padded_}, HopDeadline(deadline, start)));
    }
    RETURN_IF_ERROR(Stamp(kRailCombined));
    return AddRailCosts(out.wait_cost);
  }

  // Never asked (caps().bf16_to_device): the rail's own device quantises.
  Status Quantize(const DispatchInput&, const void**, const float**) override {
    return InternalError("node-once: Quantize is the rail's");
  }

  // Rank r masked: on r's rail, the route into r's node; in r's node, r.
  Status ApplyMasks(const std::vector<uint8_t>& ranks) override {
    const int per_node = c_.ranks_per_node;
    for (int r = 0; r < c_.world_size; ++r) {
      if (!ranks[size_t(r)] || r == c_.rank) continue;
      if (r / per_node == c_.rank / per_node) {
        RETURN_IF_ERROR(node_->SetMasked(r % per_node, true));
      } else if (r % per_node == c_.rank % per_node) {
        // The weights rail routes as the rail does: the same route out of it.
        RETURN_IF_ERROR(rail_->SetMasked(r / per_node, true));
        RETURN_IF_ERROR(weights_->SetMasked(r / per_node, true));
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

  // The inner AllToAlls report what ended them at their next step; a readmission that failed
  // after the old hops went, here (the shell then ends: no call reaches the missing hops).
  Status Sticky() override { return broken_; }

  // Membership (AllToAll::Readmit): the hops are built anew over `group`, as the new
  // processes build theirs (AllToAll::Join makes a node-once device): the old ones go first,
  // their relays revoking their inboxes' keys and counting what landed under them (Relay::
  // Stop), then the new ones take over the instances' immediate counters emptied -- so
  // nothing the replaced processes sent lands in, or completes, a later epoch. Every rank
  // rebuilds, since every hop's collectives run over the whole world: on the CUDA device the
  // node's mapped memory is made anew too. The hops' epochs start again at 0 on every rank. A
  // failure past the old hops ends this device.
  Status Readmit(Bootstrap& group, const std::vector<uint8_t>& /*readmitted*/,
                 uint64_t /*epoch*/, std::chrono::milliseconds timeout) override {
    rail_.reset();
    weights_.reset();
    node_.reset();
    broken_ = [&]() -> Status {
      if (liveness_) RETURN_IF_ERROR(liveness_->Rejoin(group, timeout));
      ASSIGN_OR_RETURN(Hops h, BuildHops(c_, engine_, group, liveness_.get(), true));
      rail_ = std::move(h.rail);
      weights_ = std::move(h.weights);
      node_ = std::move(h.node);
      // The caller's stream, where it gave one, for the new hops too.
      if (stream_) RETURN_IF_ERROR(SetHopStreams(*stream_));
      return Status::Ok();
    }();
    if (!broken_.ok()) {
      broken_ = broken_.WithContext(
          "AllToAll::Readmit, node-once, after the old hops went; this AllToAll is unusable");
    }
    return broken_;
  }

  uint64_t dispatch_bytes_sent() const override {
    return rail_->dispatch_bytes_sent() + node_->dispatch_bytes_sent();
  }
  uint64_t combine_bytes_sent() const override {
    return rail_->combine_bytes_sent() + node_->combine_bytes_sent();
  }

  // Stream calls (the CUDA device): both hops and the work between them on one stream.
  Status SetStream(void* stream) override {
    RETURN_IF_ERROR(SetHopStreams(stream));
    stream_ = stream;
    return hops_->SetStream(stream);
  }
  Status Synchronize() override {
    const Status rail = rail_->Synchronize(), node = node_->Synchronize();
    return rail.ok() ? node : rail;
  }
  Status Poll(bool* done) override {
    bool rail = false, node = false;
    RETURN_IF_ERROR(rail_->Poll(&rail));
    RETURN_IF_ERROR(node_->Poll(&node));
    *done = rail && node;
    return Status::Ok();
  }
  bool capturing(void* stream) const override { return rail_->capturing(stream); }
  // A mark on the rail's stream: the node hop's steps are on the same one (SetStream's), or
  // waited for themselves.
  Status Mark(uint64_t* mark) override { return rail_->Mark(mark); }
  Status Reached(uint64_t mark, bool wait, bool* reached) override {
    return rail_->Reached(mark, wait, reached);
  }
  Status OrderAfter(void* stream) override {
    RETURN_IF_ERROR(rail_->OrderAfter(stream));
    return node_->OrderAfter(stream);
  }
  Status OrderBefore(void* stream) override {
    RETURN_IF_ERROR(rail_->OrderBefore(stream));
    return node_->OrderBefore(stream);
  }

 private:
  bool on_gpu() const { return c_.device == MoeDeviceKind::kCuda; }
  Status SetHopStreams(void* stream) {
    RETURN_IF_ERROR(rail_->SetStream(stream));
    return node_->SetStream(stream);
  }

  // A hop's deadline. Under mask_lost_peers each hop waits the step's wait (the caller's
  // deadline less the step's call) from its own start: a hop after one that waited for a lost
  // rank would otherwise start past the deadline and take the ranks that rank delayed for lost
  // (they are heard from, liveness.h, and waited for on). Else every hop keeps the caller's
  // deadline, which then bounds the whole step.
  Deadline HopDeadline(Deadline caller, Clock::time_point start) const {
    if (!c_.mask_lost_peers) return caller;
    return Deadline::After(std::max(caller.at - start, Clock::duration{}));
  }

  // The caller's combine weights ([T, K] fp32, T the dispatch's) to the forwarders of the nodes
  // each token went to, on the weights rail, routed by the dispatch's ids; what arrives (in the
  // rail's row order) into node_weights_, the node's weights for its rows.
  Status WeightsToForwarders(const float* weights, Deadline deadline) {
    const int64_t k = c_.experts_per_token, tokens = sent_.num_tokens;
    const int64_t rows = rail_->config().expert_capacity();
    if (tokens > 0) {
      RETURN_IF_ERROR(hops_->CopyRows(padded_, kWeightsWidth * 4, weights, k * 4, k * 4, tokens));
    }
    DispatchInput in{.x = padded_,
                     .weights = mid_.token_weights,  // read, unused: any [T, K] floats
                     .num_tokens = sent_.num_tokens,
                     .device_num_tokens = sent_.device_num_tokens};
    if (sent_.indices64) {
      in.indices64 = reinterpret_cast<const int64_t*>(ids_);
    } else {
      in.indices = reinterpret_cast<const int32_t*>(ids_);
    }
    RETURN_IF_ERROR(weights_->DispatchSend(in));
    RETURN_IF_ERROR(weights_->DispatchRecv(weights_mid_, deadline));
    return hops_->CopyRows(node_weights_, k * 4, weights_mid_.x, kWeightsWidth * 4, k * 4, rows);
  }

  // CudaTuning::trace: the phases of the last epoch (the last replay of captured steps) printed
  // at the end, as the CUDA kernels' stamps are. The hops' own costs are kRailDispatched ->
  // kNodeDispatched (the node hop's send and receive: the forwarding) and kCombineStart ->
  // kNodeCombined (the node's combine, summed at the forwarder); the rail's receives include
  // their waits for other nodes.
  enum Point { kDispatchRecvStart, kRailDispatched, kNodeDispatched, kCombineStart,
               kNodeCombined, kRailCombined };
  struct Phase {
    Point from, to;
    const char* name;
  };
  static constexpr std::array<Phase, 4> kPhases{{
      {kDispatchRecvStart, kRailDispatched, "rail dispatch recv"},
      {kRailDispatched, kNodeDispatched, "node hop dispatch (forwarding)"},
      {kCombineStart, kNodeCombined, "node hop combine (send + recv)"},
      {kNodeCombined, kRailCombined, "rail combine (send + recv)"}}};
  Status Stamp(Point p) {
    if (!c_.cuda.trace) return Status::Ok();
    RETURN_IF_ERROR(hops_->Stamp(p));
    ++stamps_;
    return Status::Ok();
  }
  void PrintTrace() {
    if (!c_.cuda.trace || stamps_ != HopMemory::kHopPoints) return;
    std::string line = "[rank " + std::to_string(c_.rank) + "] node-once trace, last epoch, us:";
    for (const Phase& p : kPhases) {
      const StatusOr<double> us = hops_->Elapsed(p.from, p.to);
      line += std::string(" ") + p.name + " " + (us.ok() ? std::to_string(*us) : "?") + ";";
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }

  // Wait costs. A rank of our node is charged what our node hop waited for it (its entries are
  // the caller's, contiguous); the rank forwarding from another node what our rail hop waited
  // for that node (one entry per node, ranks_per_node apart in the caller's). Ranks of neither
  // are never waited for directly.
  int64_t* NodeCosts(int64_t* out) const {
    return out ? out + c_.rank / c_.ranks_per_node * c_.ranks_per_node : nullptr;
  }
  Status AddRailCosts(int64_t* out) {
    if (!out) return Status::Ok();
    return hops_->AddStrided(out + c_.rank % c_.ranks_per_node, rail_cost_,
                             rail_->config().world_size, c_.ranks_per_node);
  }

  const AllToAllConfig c_;
  TransferEngine* const engine_;
  // Before the hops, which ask it (mask_lost_peers; else null).
  const std::unique_ptr<Liveness> liveness_;
  // Before the hops: their steps may still use its memory until they are gone.
  const std::unique_ptr<HopMemory> hops_;
  std::unique_ptr<AllToAll> rail_, node_, weights_;  // built anew by Readmit
  Status broken_;  // what ended this device (Readmit)
  std::optional<void*> stream_;  // SetStream's, where it was called
  DispatchOutput mid_;       // what the rail brings to this node (token-major), in hops_
  uint8_t* mid_out_ = nullptr;  // what goes back on it
  int64_t* rail_cost_ = nullptr;  // [nodes] the rail hop's wait costs
  // The weights rail's: the last dispatch's input (its ids kept in ids_), the caller's weights
  // padded to its rows (and its combine's output, read by nobody), what it brings, and the
  // node's weights for the forwarded rows.
  DispatchInput sent_;
  uint8_t* ids_ = nullptr;
  float* padded_ = nullptr;
  DispatchOutput weights_mid_;
  float* node_weights_ = nullptr;
  float* sums_ = nullptr;  // PartialSums::kFp32 with a 2-byte combine (MiddleBytes::sums)
  bool fp16_ = false;
  int stamps_ = 0;  // CudaTuning::trace: the points of this epoch stamped
};

}  // namespace

NodeOnceConfigs NodeOnceConfigsOf(const AllToAllConfig& c) {
  const int per_node = c.ranks_per_node, nodes = c.world_size / per_node;
  NodeOnceConfigs o{c, c};
  o.rail.forwarding = o.node.forwarding = Forwarding::kPerRank;
  o.rail.partial_sums = o.node.partial_sums = PartialSums::kCombineElement;
  // fp32 partial sums: the rail's combine moves the nodes' sums as fp32 rows.
  o.rail.fp32_combine = c.combines_fp32() || c.partial_sums == PartialSums::kFp32;
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
  // The weights rail: the rail's routing, fp32 rows of the tokens' weights.
  o.weights = o.rail;
  o.weights.dtype = DispatchDtype::kFp32;
  o.weights.hidden = kWeightsWidth;
  o.weights.fp8_scales = 0;
  o.weights.fp32_combine = false;
  o.weights.instance = c.instance + 2;
  return o;
}

MiddleBytes MiddleBytesOf(const AllToAllConfig& c) {
  const AllToAllConfig rail = NodeOnceConfigsOf(c).rail;
  const int64_t rows = rail.expert_capacity();  // nodes x max_tokens_per_rank
  const int64_t k = c.experts_per_token;
  return {.x = rows * c.token_bytes(),
          .scales = rows * c.scales_per_token() * 4,
          .counts = int64_t{rail.local_experts()} * 4,
          .num_rows = 4,
          .experts = rows * k * 4,
          .weights = rows * k * 4,
          .out = rows * rail.combine_row_bytes(),
          .rail_cost = int64_t{rail.world_size} * 8,
          .ids = int64_t{c.max_tokens_per_rank} * k * 8,
          .padded = int64_t{c.max_tokens_per_rank} * kWeightsWidth * 4,
          .weights_in = rows * kWeightsWidth * 4 + int64_t{rail.local_experts()} * 4 + 4 +
                        rows * k * 4 * 3,
          .sums = rail.combines_fp32() && !c.combines_fp32()
                      ? int64_t{c.max_tokens_per_rank} * c.hidden * 4
                      : 0};
}

std::unique_ptr<Bootstrap> SubBootstrap(Bootstrap& parent, std::vector<int> members) {
  const int rank = static_cast<int>(std::find(members.begin(), members.end(), parent.rank()) -
                                    members.begin());
  return std::make_unique<Subgroup>(parent, std::move(members), rank);
}

StatusOr<std::unique_ptr<MoeDevice>> CreateNodeOnceDevice(const AllToAllConfig& config,
                                                          TransferEngine* engine,
                                                          Bootstrap& bootstrap,
                                                          bool adopt_counters) {
  std::unique_ptr<HopMemory> hops;
  if (config.device == MoeDeviceKind::kCuda) {
    ASSIGN_OR_RETURN(hops, NewCudaHopMemory(config.cuda_device));
  } else {
    hops = NewHostHopMemory();
  }
  // Under mask_lost_peers the ranks that wait for each other -- our rail's and our node's --
  // hear each other's heartbeats, and each hop asks them before it takes a rank for lost.
  std::unique_ptr<Liveness> liveness;
  if (config.mask_lost_peers) {
    std::vector<int> watched;
    for (const std::vector<int>& ranks : {RailRanks(config), NodeRanks(config)}) {
      for (int r : ranks) {
        if (r != config.rank) watched.push_back(r);
      }
    }
    ASSIGN_OR_RETURN(liveness, Liveness::Create(config, engine, bootstrap, std::move(watched),
                                                adopt_counters));
  }
  ASSIGN_OR_RETURN(Hops made,
                   BuildHops(config, engine, bootstrap, liveness.get(), adopt_counters));
  auto device = std::make_unique<NodeOnceDevice>(config, engine, std::move(made), std::move(hops),
                                                 std::move(liveness));
  RETURN_IF_ERROR(device->Init());
  return std::unique_ptr<MoeDevice>(std::move(device));
}

}  // namespace ferry::moe
