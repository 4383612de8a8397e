// Node-once forwarding (Forwarding::kNodeOnce): a token crosses to each other node once, to the
// rank with the sender's index there (its rail), which forwards it inside its node; the combine
// sums inside the node at that rank and one row per (token, node) crosses back.
//
// It is built from two AllToAlls of the one protocol, both derived from the caller's
// configuration:
//   - the rail AllToAll, among the ranks with our index in their nodes (one per node), whose
//     "rank n" holds node n's experts. Token-major with options (a) and (b): a token goes once
//     to each node that holds any of its experts, carrying their ids (local to the node) and
//     weights, and one row per (token, node) -- the node's weighted sum -- comes back.
//   - the node AllToAll, among the ranks of our node, over the node's experts: the forwarder's
//     received tokens are its input (up to nodes x max_tokens_per_rank of them), its output is
//     the caller's, in the caller's layout and options.
// Each keeps the single-write-per-peer property of the protocol (moe/wire.h): between nodes, one
// section per (sender, node) on the sender's rail; inside a node, one per (forwarder, rank).
// Tokens for the sender's own node go to itself on the rail (no bytes cross) and from there
// directly to their ranks.
//
// Precision (AllToAllConfig::partial_sums): the node AllToAll's combine sums a token's experts
// of the node in fp32 at the forwarder (after the expert rank's own rounding under option (b)).
// kCombineElement rounds that sum to the combine's element and the rail's combine sums the
// nodes' rows in fp32 and rounds once more: a bf16 combine rounds twice (three times with (b))
// against the per-rank protocol's once (twice with (b)). kFp32 keeps the node's sum in fp32
// (the node hop's CombineOutput::fp32_out), the rail's combine moves fp32 rows, sums them and
// stores fp32 sums, and the last step rounds once into the caller's output (HopMemory::Narrow):
// the per-rank protocol's roundings, the fp32 additions in another order.
//
// Masks: masking rank r masks, on r's rail, the route into r's node (r forwards it) and, in r's
// node, r itself: copies routed to r's experts, and every copy r would have forwarded, are lost.
//
// Combine weights given at CombineRecv (as DeepEP's and pplx's combines take them) are not at
// the forwarders when they sum: a third AllToAll on the rail (the weights rail) carries each
// token's weights to the nodes its row went to first, routed as the row was (its rows arrive in
// the same order), then the node sums with them. That is one more round trip on the rail per
// combine; weights given at the dispatch cost nothing.
//
// Devices: the hops are AllToAlls of the caller's device, so the host device and the CUDA device
// (NVLink inside the node, the relay on the rail) run the same composition. What node-once does
// itself between the hops -- the middle buffers, the wait costs' bookkeeping -- is HopMemory's,
// on the hops' memory and stream. On the CUDA device the forwarder's row count stays on the GPU
// (the node hop reads it as DispatchInput::device_num_tokens), so every step is enqueued without
// a host wait and an epoch captures into CUDA graphs as the per-rank protocol's does.
#pragma once

#include <memory>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"
#include "moe/device.h"

namespace ferry::moe {

struct NodeOnceConfigs {
  AllToAllConfig rail;  // world: the nodes; rank: our node; instance: the caller's
  AllToAllConfig node;  // world: ranks_per_node; rank: our index; instance: the caller's + 1
  // The rail again, its rows the tokens' combine weights (fp32, kWeightsWidth columns), for
  // weights given at CombineRecv: they cross to the forwarders before the node sums. Instance:
  // the caller's + 2.
  AllToAllConfig weights;
};
// The weights rail's row: the top-k weights padded to a whole number of 16-byte vectors.
constexpr int kWeightsWidth = 16;
// The two AllToAlls' configurations for rank c.rank of a node-once AllToAll (c validated).
NodeOnceConfigs NodeOnceConfigsOf(const AllToAllConfig& c);

// The middle buffers' bytes: what the rail brings to the node (token-major: rows, scales,
// counts, the row count, each row's experts and weights), what goes back on it (one combine row
// per received token) and the rail's wait costs (one per node).
struct MiddleBytes {
  int64_t x, scales, counts, num_rows, experts, weights, out, rail_cost;
  // The weights rail's: the caller's ids kept from the dispatch, its padded weights rows, what
  // it brings (rows, counts, experts, weights), the node's weights.
  int64_t ids, padded, weights_in;
  // PartialSums::kFp32 with a 2-byte combine: the rail's fp32 sums, before they are rounded
  // into the caller's output (else 0).
  int64_t sums;
  int64_t total() const {
    return x + scales + counts + num_rows + experts + weights + out + rail_cost + ids + padded +
           weights_in + sums;
  }
};
MiddleBytes MiddleBytesOf(const AllToAllConfig& c);

// The bootstrap of `members` (parent ranks, in the order that numbers them) over `parent`: every
// collective is the parent's, which every parent rank must call in the same order (each takes
// what its group contributed). The caller must be a member.
std::unique_ptr<Bootstrap> SubBootstrap(Bootstrap& parent, std::vector<int> members);

// What node-once does itself between its hops, on the memory the hops' steps take: host memory
// and loops on the host device; GPU memory and kernels on the CUDA device
// (cuda/node_once_hops.cu), in order on the hops' stream (SetStream's; none: each call waits for
// its work, as the hops' steps then wait for theirs).
class HopMemory {
 public:
  virtual ~HopMemory() = default;
  // `bytes` (at least one) the steps read and write, zeroed; kept as long as this.
  virtual StatusOr<uint8_t*> Allocate(int64_t bytes) = 0;
  virtual Status SetStream(void* stream) = 0;
  virtual Status Zero(int64_t* p, int n) = 0;
  // out[i * stride] += in[i] for i < n: the rail's wait costs, per node, into the caller's per
  // rank.
  virtual Status AddStrided(int64_t* out, const int64_t* in, int n, int stride) = 0;
  // `rows` rows of `width` bytes from src (rows `src_pitch` bytes apart) to dst (`dst_pitch`
  // apart): weights padded to the weights rail's rows and back.
  virtual Status CopyRows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                          int64_t width, int64_t rows) = 0;
  // The first n rows of `width` fp32 sums rounded (nearest even) into out's bf16 or fp16
  // (`fp16`) elements, added to what out holds with `accumulate`; n is `rows`, or the GPU's
  // count at device_rows where given (at most `rows`).
  virtual Status Narrow(void* out, const float* sums, int64_t width, int64_t rows,
                        const int32_t* device_rows, bool fp16, bool accumulate) = 0;
  // Phase stamps (CudaTuning::trace): point p (< kHopPoints) of the epoch reached, in stream
  // order (a CUDA event, an event node of a graph being captured; the clock on the host);
  // Elapsed: microseconds from point a to point b as last stamped, after waiting for b.
  static constexpr int kHopPoints = 6;
  virtual Status Stamp(int point) = 0;
  virtual StatusOr<double> Elapsed(int a, int b) = 0;
};
std::unique_ptr<HopMemory> NewHostHopMemory();
// Unimplemented where ferry was built without CUDA.
StatusOr<std::unique_ptr<HopMemory>> NewCudaHopMemory(int cuda_device);

// The node-once device over the rail and node AllToAlls, made on `engine` (collective over
// `bootstrap`), on the caller's device. adopt_counters: made on the instance of a device gone
// from this engine (AllToAll::Resize), whose immediate counters it takes over emptied.
StatusOr<std::unique_ptr<MoeDevice>> CreateNodeOnceDevice(const AllToAllConfig& config,
                                                          TransferEngine* engine,
                                                          Bootstrap& bootstrap,
                                                          bool adopt_counters = false);

}  // namespace ferry::moe
