// AllToAllConfig validation and description.
#include <cstring>
#include <string>

#include "common/env.h"
#include "fabric/wire.h"
#include "ferry/moe.h"
#include "moe/steps.h"
#include "moe/numerics.h"

namespace ferry {
namespace {

const char* DtypeName(DispatchDtype d) {
  switch (d) {
    case DispatchDtype::kBf16:
      return "bf16";
    case DispatchDtype::kFp8E4M3:
      return "fp8_e4m3";
    case DispatchDtype::kFp32:
      return "fp32";
  }
  return "?";
}

// Why node-once forwarding cannot run for c, or null where it can.
const char* NodeOnceRefusal(const AllToAllConfig& c) {
  if (c.ranks_per_node < 2 || c.ranks_per_node >= c.world_size ||
      c.world_size % c.ranks_per_node != 0) {
    return "node-once forwarding needs several nodes of several ranks "
           "(1 < ranks_per_node < world_size)";
  }
  if (c.instance + 2 >= AllToAllConfig::kMaxInstances) {
    return "node-once forwarding takes the instances instance to instance + 2";
  }
  if (c.experts_per_token > c.num_experts / (c.world_size / c.ranks_per_node)) {
    return "node-once forwarding needs experts_per_token <= the experts of one node";
  }
  return nullptr;
}

}  // namespace

Forwarding AllToAllConfig::chosen_forwarding() const {
  if (forwarding != Forwarding::kAuto) return forwarding;
  return NodeOnceRefusal(*this) ? Forwarding::kPerRank : Forwarding::kNodeOnce;
}

Status AllToAllConfig::Validate() const {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError("AllToAllConfig: " + what + " (" + ToString() + ")");
  };
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return bad("world_size must be in [1, " + std::to_string(kMaxWorldSize) + "]");
  }
  if (instance < 0 || instance >= kMaxInstances) {
    return bad("instance must be in [0, " + std::to_string(kMaxInstances) + ")");
  }
  if (rank < 0 || rank >= world_size) return bad("rank out of [0, world_size)");
  if (ranks_per_node < 1 || world_size % ranks_per_node != 0) {
    return bad("ranks_per_node must divide world_size");
  }
  if (num_experts < world_size || num_experts % world_size != 0) {
    return bad("num_experts must be a positive multiple of world_size");
  }
  if (num_experts > 4096) return bad("num_experts above 4096");
  if (experts_per_token < 1 || experts_per_token > num_experts || experts_per_token > 32) {
    return bad("experts_per_token must be in [1, min(num_experts, 32)]");
  }
  if (max_tokens_per_rank < 1 || max_tokens_per_rank > (1 << 20)) {
    return bad("max_tokens_per_rank must be in [1, 2^20]");
  }
  if (dtype != DispatchDtype::kBf16 && dtype != DispatchDtype::kFp8E4M3 &&
      dtype != DispatchDtype::kFp32) {
    return bad("unknown dispatch dtype");
  }
  // Rows move in 16-byte vectors and are summed in blocks of 16 columns; fp8 rows with the
  // default scales carry one per 128 columns.
  if (dtype == DispatchDtype::kFp8E4M3 && fp8_scales == 0) {
    if (hidden < 128 || hidden % 128 != 0 || hidden > (1 << 16)) {
      return bad("hidden must be a multiple of 128 in [128, 65536] for fp8 with a scale per "
                 "128 columns (fp8_scales 0)");
    }
  } else if (hidden < 16 || hidden % 16 != 0 || hidden > (1 << 16)) {
    return bad("hidden must be a multiple of 16 in [16, 65536]");
  }
  if (fp8_scales != 0 && dtype != DispatchDtype::kFp8E4M3) {
    return bad("fp8_scales is for fp8 rows only");
  }
  if (fp8_scales < 0 || fp8_scales > hidden) return bad("fp8_scales must be in [0, hidden]");
  if (max_private_tokens < 0 || max_private_tokens > 65536) {
    return bad("max_private_tokens must be in [0, 65536]");
  }
  if (dispatch_layout != DispatchLayout::kExpertMajor &&
      dispatch_layout != DispatchLayout::kTokenMajor) {
    return bad("unknown dispatch layout");
  }
  if (dispatch_layout == DispatchLayout::kTokenMajor &&
      !(dispatch_once_per_rank && combine_reduce_at_expert_rank)) {
    return bad("the token-major layout needs dispatch_once_per_rank and "
               "combine_reduce_at_expert_rank");
  }
  if (device != MoeDeviceKind::kHost && device != MoeDeviceKind::kCuda) {
    return bad("unknown device kind");
  }
  if (rdma_buffers != RdmaBuffers::kAuto && rdma_buffers != RdmaBuffers::kHost &&
      rdma_buffers != RdmaBuffers::kDevice) {
    return bad("unknown rdma_buffers placement");
  }
  if (device == MoeDeviceKind::kCuda && (cuda_device < 0 || num_experts > 1024 ||
                                         experts_per_token > 16)) {
    return bad("the CUDA device takes cuda_device >= 0, up to 1024 experts and top-16");
  }
  if (streaming > Streaming::kBoth) return bad("unknown streaming");
  if (partial_sums != PartialSums::kCombineElement && partial_sums != PartialSums::kFp32) {
    return bad("unknown partial_sums");
  }
  if (forwarding != Forwarding::kPerRank && forwarding != Forwarding::kNodeOnce &&
      forwarding != Forwarding::kAuto) {
    return bad("unknown forwarding");
  }
  if (forwarding == Forwarding::kNodeOnce) {
    if (const char* why = NodeOnceRefusal(*this)) return bad(why);
  }
  return Status::Ok();
}

StatusOr<CudaTuning> CudaTuning::FromEnv() {
  CudaTuning t;
  RETURN_IF_ERROR(EnvNumber("FERRY_NV_TRACE", &t.trace));
  RETURN_IF_ERROR(EnvNumber("FERRY_RELAY_TRACE", &t.relay_trace));
  RETURN_IF_ERROR(EnvNumber("FERRY_GDRCOPY", &t.gdrcopy));
  return t;
}

int64_t AllToAllConfig::token_bytes() const {
  switch (dtype) {
    case DispatchDtype::kFp8E4M3:
      return hidden;
    case DispatchDtype::kFp32:
      return int64_t{hidden} * 4;
    default:
      return int64_t{hidden} * 2;
  }
}

int64_t AllToAllConfig::output_rows(int expert_padding, int64_t expert_rows) const {
  if (dispatch_layout == DispatchLayout::kTokenMajor) return expert_capacity();
  if (expert_padding > 0) return padded_rows(expert_padding);
  return int64_t{local_experts()} * (expert_rows > 0 ? expert_rows : expert_capacity());
}

std::vector<uint8_t> AllToAllConfig::Fingerprint() const {
  fabric::ByteWriter w;
  for (int v : {world_size, ranks_per_node, num_experts, experts_per_token, max_tokens_per_rank,
                hidden, static_cast<int>(dtype), fp8_scales, int{combines_fp32()},
                max_private_tokens, int{dispatch_once_per_rank},
                int{combine_reduce_at_expert_rank}, instance, static_cast<int>(streaming),
                int{mask_lost_peers}, static_cast<int>(chosen_forwarding()),
                static_cast<int>(partial_sums)}) {
    w.U32(static_cast<uint32_t>(v));
  }
  return w.Take();
}

std::string AllToAllConfig::ToString() const {
  return "world_size=" + std::to_string(world_size) + " rank=" + std::to_string(rank) +
         " ranks_per_node=" + std::to_string(ranks_per_node) +
         " num_experts=" + std::to_string(num_experts) +
         " experts_per_token=" + std::to_string(experts_per_token) +
         " max_tokens_per_rank=" + std::to_string(max_tokens_per_rank) +
         " hidden=" + std::to_string(hidden) +
         " dtype=" + DtypeName(dtype) +
         (fp8_scales ? " fp8_scales=" + std::to_string(fp8_scales) : std::string()) +
         (fp32_combine && dtype != DispatchDtype::kFp32 ? " fp32_combine" : "") +
         " max_private_tokens=" + std::to_string(max_private_tokens) +
         (dispatch_once_per_rank ? " once_per_rank" : "") +
         (combine_reduce_at_expert_rank ? " reduce_at_expert_rank" : "") +
         (dispatch_layout == DispatchLayout::kTokenMajor ? " token_major" : "") +
         (mask_lost_peers ? " mask_lost_peers" : "") +
         (chosen_forwarding() == Forwarding::kNodeOnce ? " node_once" : "") +
         (partial_sums == PartialSums::kFp32 ? " fp32_partial_sums" : "") +
         (streaming != Streaming::kAuto
              ? " streaming=" + std::to_string(static_cast<int>(streaming))
              : std::string()) +
         (device == MoeDeviceKind::kCuda ? " cuda:" + std::to_string(cuda_device) : "") +
         (instance ? " instance=" + std::to_string(instance) : "");
}

namespace moe {

Status CheckSetMasked(const AllToAllConfig& c, int rank, bool masked, bool now, bool* change) {
  *change = false;
  if (rank < 0 || rank >= c.world_size) {
    return InvalidArgumentError("SetMasked: rank " + std::to_string(rank) + " of " +
                                std::to_string(c.world_size));
  }
  if (rank == c.rank) return InvalidArgumentError("SetMasked: a rank cannot mask itself");
  if (masked == now) return Status::Ok();
  if (!masked) {
    return UnimplementedError(
        "SetMasked: rank " + std::to_string(rank) +
        " is masked until it comes back as a new process, fenced from the one it replaces: "
        "AllToAll::Readmit on the survivors, AllToAll::Join on the new process");
  }
  *change = true;
  return Status::Ok();
}

Status CheckMembershipGroup(const AllToAllConfig& c, const Bootstrap& group) {
  if (group.world_size() == c.world_size && group.rank() == c.rank) return Status::Ok();
  return InvalidArgumentError("AllToAll: bootstrap has rank " + std::to_string(group.rank()) +
                              " of " + std::to_string(group.world_size()) + ", config says " +
                              std::to_string(c.rank) + " of " + std::to_string(c.world_size));
}

StatusOr<AllToAllConfig> Resolve(const AllToAllConfig& asked, TransferEngine* engine,
                                 const Bootstrap& bootstrap) {
  RETURN_IF_ERROR(asked.Validate());
  AllToAllConfig config = asked;
  config.forwarding = asked.chosen_forwarding();
  // The CUDA device with one node (a single rank included) needs no engine.
  const bool one_node = config.ranks_per_node == config.world_size;
  if (!engine && !(config.device == MoeDeviceKind::kCuda && one_node)) {
    return InvalidArgumentError("AllToAll: null engine");
  }
  RETURN_IF_ERROR(CheckMembershipGroup(config, bootstrap));
  return config;
}

Status CheckStage(Stage at, Stage want, const char* step) {
  if (at == want) return Status::Ok();
  return FailedPreconditionError(std::string(step) +
                                 " out of order: the steps run DispatchSend, DispatchRecv, "
                                 "CombineSend, CombineRecv");
}

Status CheckDispatchOutput(const AllToAllConfig& c, const DispatchOutput& out) {
  if (!out.x || !out.num_tokens || (c.scales_per_token() && !out.scales)) {
    return InvalidArgumentError("DispatchRecv: null output buffer");
  }
  const bool token_major = c.dispatch_layout == DispatchLayout::kTokenMajor;
  const bool has_token_fields =
      out.num_rows || out.token_experts || out.token_experts64 || out.token_weights;
  if (token_major &&
      !(out.num_rows && (out.token_experts || out.token_experts64) && out.token_weights)) {
    return InvalidArgumentError(
        "DispatchRecv: the token-major layout needs num_rows, token_experts and token_weights");
  }
  if (out.token_experts && out.token_experts64) {
    return InvalidArgumentError(
        "DispatchRecv: token_experts and token_experts64 both given (one of them)");
  }
  if (out.expert_padding < 0 || (token_major && out.expert_padding != 0)) {
    return InvalidArgumentError("DispatchRecv: expert_padding " +
                                std::to_string(out.expert_padding) +
                                (token_major ? " (the token-major layout has no expert blocks)"
                                             : " (at least 0)"));
  }
  if (out.expert_rows < 0 || (out.expert_rows > 0 && (token_major || out.expert_padding > 0))) {
    return InvalidArgumentError(
        "DispatchRecv: expert_rows " + std::to_string(out.expert_rows) +
        (out.expert_rows < 0 ? " (at least 0)"
                             : " with " + std::string(token_major ? "the token-major layout"
                                                                  : "expert_padding") +
                                   " (each expert's block is fixed only in the unpadded "
                                   "expert-major layout)"));
  }
  if (token_major && out.sender_ranges) {
    return InvalidArgumentError(
        "DispatchRecv: sender_ranges describes expert blocks; this AllToAll is token-major "
        "(source_ranks gives each row's sender)");
  }
  if (c.chosen_forwarding() == Forwarding::kNodeOnce &&
      (out.source_tokens || out.sender_ranges || out.source_ranks)) {
    return InvalidArgumentError(
        "DispatchRecv: source_tokens, source_ranks and sender_ranges under node-once forwarding "
        "(the rows come from the forwarders of their nodes, not from their senders)");
  }
  if (!token_major && has_token_fields) {
    return InvalidArgumentError(
        "DispatchRecv: num_rows, token_experts and token_weights are outputs of the token-major "
        "layout; this AllToAll is expert-major");
  }
  return Status::Ok();
}

Status CheckCombineInput(const AllToAllConfig& c, const CombineInput& in) {
  if (!in.expert_out) return InvalidArgumentError("CombineSend: null expert output");
  if (in.fp16 && c.combines_fp32()) {
    return InvalidArgumentError("CombineSend: fp16 rows, and this AllToAll combines in fp32");
  }
  return Status::Ok();
}

Status CheckCombineOutput(const AllToAllConfig& c, const CombineOutput& out, bool sent_fp16) {
  if (out.weights && c.combine_reduce_at_expert_rank) {
    return InvalidArgumentError(
        "CombineRecv: combine-time weights with combine_reduce_at_expert_rank (the expert ranks "
        "weighted each row with the dispatch's weights)");
  }
  if (out.fp16 != sent_fp16) {
    return InvalidArgumentError(std::string("CombineRecv: ") + (out.fp16 ? "fp16" : "bf16") +
                                " output, and its CombineSend was given " +
                                (sent_fp16 ? "fp16" : "bf16") + " rows");
  }
  return Status::Ok();
}

Status CheckDispatchInput(const AllToAllConfig& c, const DispatchInput& in) {
  if (in.indices && in.indices64) {
    return InvalidArgumentError("DispatchSend: indices or indices64, not both");
  }
  if (in.x_bf16) {
    if (c.dtype != DispatchDtype::kFp8E4M3) {
      return InvalidArgumentError(
          "DispatchSend: x_bf16 is quantised to fp8, and this AllToAll moves " +
          std::string(DtypeName(c.dtype)) + " (pass x)");
    }
    if (in.x || in.scales) {
      return InvalidArgumentError(
          "DispatchSend: x_bf16 is quantised into x and scales: give it or them, not both");
    }
    if (c.fp8_scales != 0) {
      return InvalidArgumentError("DispatchSend: x_bf16 is quantised with a scale per 128 "
                                  "columns, and this AllToAll carries fp8_scales " +
                                  std::to_string(c.fp8_scales) + " (pass x and scales)");
    }
    if (in.scaling != Fp8Scaling::kAmax && in.scaling != Fp8Scaling::kPowerOfTwo) {
      return InvalidArgumentError("DispatchSend: unknown Fp8Scaling " +
                                  std::to_string(static_cast<int>(in.scaling)));
    }
  }
  if (in.num_tokens < 0 || in.num_tokens > c.max_tokens_per_rank) {
    return InvalidArgumentError("DispatchSend: " + std::to_string(in.num_tokens) +
                                " tokens, configured maximum " +
                                std::to_string(c.max_tokens_per_rank));
  }
  if (in.num_tokens > 0 &&
      ((!in.x && !in.x_bf16) || (!in.indices && !in.indices64) || !in.weights ||
       (c.scales_per_token() && !in.scales && !in.x_bf16))) {
    return InvalidArgumentError("DispatchSend: null input buffer");
  }
  return Status::Ok();
}

}  // namespace moe

void QuantizeFp8Rows(const uint16_t* rows, int64_t num_rows, int hidden, Fp8Scaling scaling,
                     uint8_t* out, float* scales) {
  const int groups = hidden / 128;
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int g = 0; g < groups; ++g) {
      const int64_t first = r * hidden + g * 128;
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i) {
        amax = std::fmax(amax, std::fabs(Bf16ToFloat(rows[first + i])));
      }
      const float s = Fp8GroupScale(amax, scaling);
      scales[r * groups + g] = s;
      for (int i = 0; i < 128; ++i) {
        out[first + i] = FloatToE4M3(Bf16ToFloat(rows[first + i]) / s);
      }
    }
  }
}

}  // namespace ferry
