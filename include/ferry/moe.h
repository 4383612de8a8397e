// ferry moe: expert-parallel dispatch and combine across ranks.
//
// Dispatch sends each token to the ranks that hold its experts; combine brings the expert outputs
// back and takes their weighted sum. Each is split into a send half and a receive half so the
// caller can overlap other work (shared experts, another micro-batch) while bytes are in flight:
//
//   a2a->DispatchSend(in);            // counts and tokens out; returns without waiting
//   a2a->DispatchRecv(out, deadline); // waits for every sender's, fills expert-major out
//   ... grouped GEMM on out ...
//   a2a->CombineSend(expert_out);     // one write back per rank
//   a2a->CombineRecv(y, deadline);    // weighted sum, fp32 accumulation, bf16 out
//
// Where the steps run (AllToAllConfig::device, ranks_per_node):
//   - host device: the four steps on host memory, every peer through the relay below (as if
//     in another node). The reference for the CUDA kernels; runs their protocol between nodes
//     in CI.
//   - CUDA device, any ranks_per_node: kernels only. Each rank's buffers come from cuMemCreate,
//     exported and mapped into every other rank of its node; the kernels push slots and rows
//     into peers' memory and raise flags there. With several nodes (ranks_per_node == 1
//     included: every peer is then in another node), what goes to another node
//     is staged in GPU memory the NIC reads (GPUDirect RDMA, where the engine registers CUDA
//     memory) or in pinned host memory (rdma_buffers), and a relay thread per rank carries it
//     over the engine
//     (RDMA between nodes), raising the receiver's flags as it lands; with one node there is no
//     host thread and no engine traffic (engine may be null). Either way the steps can be
//     enqueued on a stream (SetStream) and captured in a graph: the kernels and the relay
//     meet through flags, never through the calling thread.
//
// Protocol between nodes (docs/DESIGN.md §2.2; the bytes in src/moe/wire.h): each sender writes
// every receiver one section -- its counts row, then all of its tokens for that receiver -- into
// a region of the receiver's that is the sender's alone and holds the most it can send; no count
// is awaited before the tokens move. Combine returns each receiver's rows as one write to where
// the sender's counts row said. Immediates carry the kind, the epoch (iteration mod 4), the
// instance and the sender, so each sender's section raises its own flag; a sender rewrites its
// buffers only after its own combine, by which every peer had read them. Inside a node (CUDA),
// the first max_private_tokens slots for each peer are pushed into its memory and the rest pulled
// by the receiver from the sender's.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/export.h"
#include "ferry/fabric.h"
#include "ferry/status.h"

namespace ferry {

enum class DispatchDtype : uint8_t {
  kBf16 = 0,     // 2 bytes per element, moved as they are: bf16, or fp16 (the combine is told
                 // which: CombineInput / CombineOutput::fp16)
  kFp8E4M3 = 1,  // 1 byte per element, plus one fp32 scale per 128 columns
  kFp32 = 2      // 4 bytes per element; the combine's rows and its output are fp32 too
                 // (AllToAllConfig::fp32_combine for the other elements)
};

// How a token reaches the ranks of another node (several nodes: ranks_per_node < world_size).
// Part of what ranks agree on: it changes what crosses.
enum class Forwarding : uint8_t {
  // A token's row crosses to every rank of another node that holds one of its experts (once
  // per rank with dispatch_once_per_rank, else once per expert).
  kPerRank = 0,
  // A token's row crosses to each other node once, to the rank with the sender's index in its
  // node (rail-aligned: each rank talks across nodes only to its counterparts), carrying that
  // node's experts and weights; that rank forwards it inside its node. The combine sums a
  // token's rows inside the node at that rank (fp32, rounded to the combine's element) and one
  // row per (token, node) crosses back. Two AllToAlls built from this one's configuration (a
  // rail AllToAll between nodes, a node AllToAll inside each, and for weights given at the
  // combine a weights rail) carry it, on the instances `instance` to `instance + 2`. Weights
  // given at the dispatch cost nothing; CombineOutput::weights cross to the forwarders first (a
  // round trip more on the rail), where the node sums with them (routed by the dispatch's ids,
  // kept from DispatchSend). The dispatch's device token count is read again at CombineRecv. Token-major rows arrive ordered by forwarder, then
  // by the sender's node, then by token. Both devices (on the CUDA device: NVLink inside the
  // node, the relay on the rail, CUDA graphs as per rank). A masked rank's experts and the
  // routes it forwards are out; under mask_lost_peers a lost forwarder masks the route through
  // it (see there). The partial sums' precision: AllToAllConfig::partial_sums.
  kNodeOnce = 1,
  // Whichever the scale model (tools/moe_model.py, docs/SCALE.md) finds faster for the
  // configuration: node-once where there are several nodes of several ranks and node-once can
  // run (top-k within a node's experts, instance + 2 free), per rank
  // otherwise. The model puts node-once ahead at every multi-node size it covers (decode,
  // EP16 / 32 / 64 on EFA: 258 / 357 / 467 us against per rank's 344 / 498 / 613 with (a)+(b);
  // on CX7 127 / 230 / 349 against 261 / 411 / 514): a token's row crosses to a node once
  // instead of once per rank there. AllToAllConfig::chosen_forwarding says which; the
  // AllToAll's config() holds it.
  kAuto = 2,
};

// Under node-once forwarding, how a node's partial sums (a token's rows of one node, summed at
// its forwarder) cross back to the token's rank. Part of what ranks agree on: it sizes the rows
// the rail's combine moves.
enum class PartialSums : uint8_t {
  // In the combine's element: the forwarder rounds the node's sum, the origin rounds the sum of
  // the nodes' (DeepEP V2's allow_multiple_reduction). A 2-byte combine rounds once more than
  // per-rank forwarding does (plain: twice against once; with option (b): three times against
  // twice).
  kCombineElement = 0,
  // In fp32: the forwarder's sum crosses unrounded and the origin rounds once, where per-rank
  // forwarding rounds (plain: once; with option (b), the expert rank's sum of its own experts
  // once more). The rail's combine rows are twice as wide (fp32 against bf16 or fp16). With an
  // fp32 combine (combines_fp32), and under per-rank forwarding, the two are the same.
  kFp32 = 1,
};

// Where the four steps run.
enum class MoeDeviceKind : uint8_t {
  kHost = 0,  // on the CPU; every pointer of the step calls is host memory
  kCuda = 1,  // CUDA kernels on cuda_device; the step calls take device pointers (or mapped
              // pinned memory) and return once their kernels finished. The kernels run on the
              // AllToAll's own non-blocking stream (or SetStream's), which waits for no other:
              // inputs written on another stream, or by cudaMemcpy from pageable host memory
              // (which may return before its last bytes land), must be complete first
              // (synchronize).
};

// What DispatchRecv hands the caller, and so what CombineSend takes back.
enum class DispatchLayout : uint8_t {
  // One row per (token, local expert), grouped by expert: the layout grouped GEMMs eat. The
  // receiver writes a token once for each of its local experts.
  kExpertMajor = 0,
  // Each received token once, with its local experts and weights beside it (DeepEP's
  // high-throughput layout): the receiver writes a token once, the caller permutes or gathers for
  // its GEMMs and returns one row per token -- its experts' outputs already weighted and summed.
  // Needs dispatch_once_per_rank and combine_reduce_at_expert_rank (what then crosses: one row
  // each way per token and rank).
  kTokenMajor = 1,
};

// CUDA device with several nodes: where the buffers the NIC reads and writes between nodes live.
enum class RdmaBuffers : uint8_t {
  kAuto = 0,    // GPU memory when the engine registers CUDA memory (GPUDirect RDMA), else host
  kHost = 1,    // pinned host memory the GPU maps (what a provider without FI_HMEM needs)
  kDevice = 2,  // GPU memory, or AllToAll::Create fails saying why
};

// Which steps of the CUDA device a receiver takes slot by slot as they land (one node) instead
// of after each sender's flag. A streamed slot or row carries a tag, so this changes the bytes
// that cross: it is part of what ranks agree on (AllToAllConfig::Fingerprint).
enum class Streaming : uint8_t {
  // The dispatch where a decode batch is sent by one kernel (its T * K routing entries fit in
  // shared memory: streaming gains about a microsecond there), nothing else (prefill gains
  // nothing; a streamed combine costs a few percent there). Under mask_lost_peers, nothing.
  kAuto = 0,
  kNone = 1,
  kDispatch = 2,
  kCombine = 3,
  kBoth = 4,
};

// Where the CUDA device keeps its flags and what it reports on itself. None of it changes a
// result or the bytes that cross; FromEnv reads the variables named below (what the benchmarks
// and tools/gpu_check.sh set), once, where a caller asks for it.
struct FERRY_API CudaTuning {
  // Every kernel block stamps its phases; the stamps are printed when the AllToAll closes.
  // FERRY_NV_TRACE.
  bool trace = false;
  // The relay's per-step timings, printed when it stops. FERRY_RELAY_TRACE.
  bool relay_trace = false;
  // The relay's inbox flags in the GPU's memory, written through GDRCopy where it opens (see
  // GpuWords); false keeps them in pinned host memory. FERRY_GDRCOPY.
  bool gdrcopy = true;

  // The defaults, with each variable that is set taking its field's place (InvalidArgument
  // naming a variable whose value the field cannot take).
  static StatusOr<CudaTuning> FromEnv();
};

struct FERRY_API AllToAllConfig {
  int world_size = 0;
  int rank = 0;
  int ranks_per_node = 1;  // the NVLink domain; the host device moves everything over the engine
  int num_experts = 0;     // divisible by world_size
  int experts_per_token = 0;
  int max_tokens_per_rank = 0;
  int hidden = 0;  // multiple of 16 (of 128 for fp8 with the default scales)
  DispatchDtype dtype = DispatchDtype::kBf16;
  // fp8 only: the fp32 scales each row carries. 0: one per 128 columns (hidden / 128, what
  // DispatchInput::x_bf16's quantisation makes). Any count in [1, hidden] instead travels with
  // its row as it is, its meaning the caller's: 1 for per-token or per-tensor scales,
  // ceil(hidden / b) for groups of b columns (pplx's hidden_dim_scale).
  int fp8_scales = 0;
  // The combine's rows (CombineSend's input), its output and every sum in fp32 rather than bf16,
  // whatever the dispatch moves (pplx's out_dtype float32 with bf16 or fp8 input; kFp32 rows
  // always combine in fp32). Part of what ranks must agree on: it sizes the rows that cross.
  bool fp32_combine = false;
  Streaming streaming = Streaming::kAuto;  // CUDA device, one node
  int max_private_tokens = 16;  // per (sender, receiver) in one node: pushed; the rest pulled
  // Beyond the seed, each measured against the plain protocol (ferry-bench moe --once-per-rank
  // --reduce-at-expert-rank):
  // (a) a token goes once to each rank that holds any of its experts (not once per expert); the
  //     receiver fans it out to its local experts.
  bool dispatch_once_per_rank = false;
  // (b) the expert rank sums its experts' outputs for a token in fp32, weights applied, and
  //     returns one row per token (bf16, or fp32: combines_fp32) instead of one per expert.
  bool combine_reduce_at_expert_rank = false;
  Forwarding forwarding = Forwarding::kAuto;  // several nodes: see Forwarding
  PartialSums partial_sums = PartialSums::kCombineElement;  // node-once: see PartialSums
  // Per rank, not part of what ranks must agree on: each may run its steps where it likes, and
  // take its output in either layout (the bytes that cross are the same).
  DispatchLayout dispatch_layout = DispatchLayout::kExpertMajor;
  MoeDeviceKind device = MoeDeviceKind::kHost;
  int cuda_device = 0;
  RdmaBuffers rdma_buffers = RdmaBuffers::kAuto;  // CUDA device, several nodes
  CudaTuning cuda;  // CUDA device: its diagnostics (per rank)
  // Lost ranks masked instead of failing a step (DeepEP's shrink mode): a receive step that
  // reaches its deadline while ranks it waits for have sent nothing masks those ranks (see
  // AllToAll::SetMasked) and finishes OK with what the others sent. A rank masked that way is
  // presumed gone: one that was only slow must be stopped for good by its launcher, for if it
  // woke it could still deliver the combine rows of the epoch it missed into the rows the live
  // ranks share. Part of what ranks must agree on. On the CUDA device one thread per step
  // decides which ranks are masked, so the steps it changes run unstreamed (cuda.stream as 0)
  // and the receive kernels wait for the flags before reading the counts rows.
  // Under node-once forwarding a step waits at two hops, and a rank that waits for a lost rank
  // at one is late for the ranks waiting for it at the next. So while a rank is inside a
  // receive step it sends heartbeats to its rail and its node (an immediate every 20 ms), and a
  // rank that misses the deadline but was heard from within 200 ms is late, not lost: it is
  // waited for on while it stays heard from, up to three more times the step's wait (the
  // deadline's distance from the receive call), then masked. A rank late for its own reasons
  // (outside a step) is silent and masked at the deadline, as per rank. Each hop waits the
  // step's wait from its own start, so a step takes at most twice that, plus the late waits. A
  // lost forwarder masks the route through it: the tokens of its rail's senders for its node's
  // experts.
  bool mask_lost_peers = false;
  // Several AllToAlls on one engine (two micro-batches overlapped, or one created after
  // another) each take an instance of their own, 0 to kMaxInstances - 1, the same on every
  // rank: it keeps their immediates apart. An engine's immediate counters outlive the AllToAll
  // that made them, so an instance serves once per engine.
  int instance = 0;
  static constexpr int kMaxInstances = 16;
  static constexpr int kMaxWorldSize = 1 << 16;

  // InvalidArgument naming the first bad field.
  Status Validate() const;
  int local_experts() const { return num_experts / world_size; }
  // Bytes of one token row as dispatched (payload only).
  int64_t token_bytes() const;
  // `forwarding`, kAuto resolved (see Forwarding::kAuto): what crosses, and so what the ranks
  // agree on.
  Forwarding chosen_forwarding() const;
  // Whether the combine's rows, output and sums are fp32 (else bf16).
  bool combines_fp32() const { return fp32_combine || dtype == DispatchDtype::kFp32; }
  // Bytes of one combine row (CombineSend's rows, CombineRecv's output).
  int64_t combine_row_bytes() const { return int64_t{hidden} * (combines_fp32() ? 4 : 2); }
  // fp32 scales per token (fp8 only): fp8_scales, or hidden / 128 where that is 0.
  int scales_per_token() const {
    if (dtype != DispatchDtype::kFp8E4M3) return 0;
    return fp8_scales > 0 ? fp8_scales : hidden / 128;
  }
  // Rows of the expert-major dispatch output per local expert: the worst case, every token of
  // every rank routed to one expert.
  int64_t expert_capacity() const { return int64_t{world_size} * max_tokens_per_rank; }
  // Rows of the expert-major output with DispatchOutput::expert_padding p >= 1: every copy that
  // can land on one rank (each token of every rank at most min(k, local experts) times) and
  // each expert's block rounded up to a multiple of p.
  int64_t padded_rows(int p) const {
    const int64_t l = local_experts(), per_token = experts_per_token < l ? experts_per_token : l;
    return expert_capacity() * per_token + l * (p - 1);
  }
  // Rows of DispatchRecv's x (and CombineSend's input) for DispatchOutput's expert_padding and
  // expert_rows: padded_rows(p), local_experts blocks of expert_rows (or of expert_capacity);
  // token-major, expert_capacity.
  int64_t output_rows(int expert_padding, int64_t expert_rows) const;
  // What must agree between ranks, as bytes (rank excluded).
  std::vector<uint8_t> Fingerprint() const;
  std::string ToString() const;
};

// How DispatchSend turns bf16 rows into fp8 e4m3 (DispatchInput::x_bf16): each row's columns
// in groups of 128, each group with one fp32 scale s, element q = e4m3(x / s) (round to nearest
// even, saturated at +-448), so that x ~ q * s. amax is the group's largest |x|, at least 1e-4
// (an all-zero group keeps a finite scale).
enum class Fp8Scaling : uint8_t {
  kAmax = 0,        // s = amax / 448: the group's largest element maps to e4m3's largest
  kPowerOfTwo = 1,  // s = amax / 448 rounded up to a power of two (a UE8M0 exponent, what
                    // DeepGEMM's scaled GEMMs on Blackwell take)
};

// Dispatch input of one rank. Shapes in the comments; T = num_tokens <= max_tokens_per_rank.
struct FERRY_API DispatchInput {
  const void* x = nullptr;           // [T, hidden] bf16, fp8 e4m3 or fp32 (dtype), row-major
  const float* scales = nullptr;     // [T, scales_per_token()] fp32; fp8 only
  const int32_t* indices = nullptr;  // [T, experts_per_token] global expert ids; -1: none (the
                                     // copy goes nowhere and adds nothing)
  const float* weights = nullptr;    // [T, experts_per_token] combine weights
  int num_tokens = 0;
  // CUDA device only (any ranks_per_node): the token count in device memory, read by the
  // kernels when they run, so that one captured graph serves any batch. num_tokens is then the
  // most it may hold (the rows the buffers have); a larger device count sends nothing (peers
  // receive no token from this rank) and reports InvalidArgument.
  const int32_t* device_num_tokens = nullptr;
  // fp8 configurations: bf16 rows [T, hidden] that the device quantises as it sends (see
  // Fp8Scaling), given instead of x and scales; the receiver gets fp8 rows and fp32 scales as
  // if the caller had quantised them.
  const uint16_t* x_bf16 = nullptr;
  Fp8Scaling scaling = Fp8Scaling::kAmax;
  // 64-bit expert ids (what torch.topk gives) instead of indices, narrowed by the device as it
  // sends (on the CUDA device by the send kernels as they read them); an id outside int32 is a
  // bad id like any other.
  const int64_t* indices64 = nullptr;
};

// Dispatch output. Expert-major (the default): x holds [local_experts, expert_capacity] rows,
// expert e's first num_tokens[e] filled (with expert_padding: blocks back to back). Token-major:
// x holds [expert_capacity] rows, the first num_rows[0] filled -- every sender's tokens in rank
// order, each sender's in its token order -- and row i's copies are described by token_experts
// / token_weights. Rows past the counts are not written.
struct FERRY_API DispatchOutput {
  void* x = nullptr;              // [local_experts, expert_capacity, hidden] in dtype;
                                  // token-major: [expert_capacity, hidden]
  float* scales = nullptr;        // the same rows, scales_per_token() fp32 each; fp8 only
  int32_t* num_tokens = nullptr;  // [local_experts] copies each local expert received
  // Token-major only (null otherwise):
  int32_t* num_rows = nullptr;       // [1] rows received
  int32_t* token_experts = nullptr;  // [expert_capacity, experts_per_token] column k: the local
                                     // expert of the token's k-th copy, -1 if not ours
  // The same as 64-bit ids instead (what torch indexes with: the int64 ids DeepEP returns,
  // written without a widening pass); exactly one of the two.
  int64_t* token_experts64 = nullptr;
  float* token_weights = nullptr;    // [expert_capacity, experts_per_token] column k: its
                                     // combine weight, 0 if not ours
  // Expert-major only. 0: x is [local_experts, expert_capacity] rows. p >= 1: the experts'
  // rows back to back in x's padded_rows(p) rows, expert e's block starting where the blocks
  // before it end, each block rounded up to a multiple of p (pplx-garden's layout: what a
  // contiguous grouped GEMM reads in tiles of p rows). Padding rows are not written;
  // num_tokens holds the unpadded counts. CombineSend then takes its rows in the same layout.
  int expert_padding = 0;
  // Expert-major, without expert_padding: the rows of each local expert's block, x holding
  // [local_experts, expert_rows] rows (pplx-garden's batched layout, its max_tokens_per_expert);
  // 0: expert_capacity. A block smaller than expert_capacity bounds what one expert may receive:
  // a local expert sent more copies than its block holds fails the step with ResourceExhausted
  // (nothing written past the block) and leaves the AllToAll unusable, as a routing no output
  // could take. CombineSend then takes its rows in the same layout.
  int64_t expert_rows = 0;
  // [world_size] or null: the time this step spent waiting for each sender's data, added to
  // what each entry holds (DeepEP's dispatch_wait_recv_cost_stats: a rank that is slow, or lost
  // and masked at the deadline, stands out in its entry). The host device counts nanoseconds;
  // the CUDA device counts GPU clock cycles (clock64, as DeepEP's kernels do), into memory the
  // kernels write (device or mapped), when the step runs. A masked rank is not waited for: its
  // entry grows no more.
  int64_t* wait_cost = nullptr;
  // Where the rows came from, each null or not (DeepEP's handles hold them: the low-latency
  // one source_tokens and sender_ranges, V2's source token index per row). source_tokens:
  // [the rows x holds] int32, row r's token index in its sender; source_ranks: the same rows,
  // row r's sender (rows past the counts are not written). sender_ranges, expert-major only:
  // [local_experts, world_size] int64, sender s's rows in expert e's block as (first row << 32)
  // | rows -- the senders' rows lie in rank order, so the first row is the rows of the senders
  // before s. Not under node-once forwarding (its rows come from forwarders). On the CUDA
  // device, memory the kernels write.
  int32_t* source_tokens = nullptr;
  int64_t* sender_ranges = nullptr;
  int32_t* source_ranks = nullptr;
};

// Combine input of one rank (AllToAll::CombineSend).
struct FERRY_API CombineInput {
  // [local_experts, expert_capacity, hidden] bf16 (fp32 where combines_fp32(): the combine's
  // element, AllToAllConfig::combine_row_bytes), rows as DispatchRecv laid them out
  // (padded_rows(p) rows after a DispatchRecv with expert_padding p, local_experts blocks of
  // expert_rows with that); token-major: [expert_capacity, hidden], row i the weighted sum of
  // row i's experts' outputs.
  const void* expert_out = nullptr;
  // A 2-byte combine's rows (not combines_fp32()) are IEEE fp16 rather than bf16: an expert
  // rank that sums them (combine_reduce_at_expert_rank) reads and rounds fp16. Each combine
  // chooses (as pplx's combine takes the expert outputs' dtype); every rank gives the same for
  // one combine, and CombineOutput::fp16 the same.
  bool fp16 = false;
};

// Combine output of one rank.
struct FERRY_API CombineOutput {
  // [T, hidden] bf16 (fp16 with `fp16`; fp32 where combines_fp32()), T of the last
  // DispatchSend.
  void* out = nullptr;
  bool accumulate = false;  // add the sums to what out holds
  // [T, experts_per_token] fp32: the combine weights given now rather than at DispatchSend (as
  // DeepEP's and pplx's combine take them); null: DispatchInput::weights. Only with the sums
  // taken here (not combine_reduce_at_expert_rank: its expert ranks weighted the rows already,
  // InvalidArgument). On the CUDA device, memory the kernels read (device or mapped), read when
  // the step runs.
  const float* weights = nullptr;
  // [world_size] or null: the time this step spent waiting for each expert rank's rows, added
  // to what each entry holds (DeepEP's combine_wait_recv_cost_stats), as DispatchOutput's.
  int64_t* wait_cost = nullptr;
  // The returned rows and `out` are IEEE fp16 rather than bf16 (2-byte combines only; as
  // CombineInput::fp16, which this combine's CombineSend was given): sums in fp32, rounded to
  // fp16 (nearest even; beyond 65504 infinite).
  bool fp16 = false;
  // `out` is [T, hidden] fp32 whatever the rows' element: the fp32 sums are stored unrounded
  // (and, with accumulate, added to the fp32 values out holds).
  bool fp32_out = false;
};

// Thread safety: one thread drives an AllToAll; the steps run in order DispatchSend,
// DispatchRecv, CombineSend, CombineRecv, and again.
class FERRY_API AllToAll {
 public:
  // Collective: every rank calls it with the same configuration (but its own rank). `engine` may
  // be null on the CUDA device with one node (ranks_per_node == world_size), which does not use
  // it. Registers the buffers with `engine`, exchanges addresses and descriptors through
  // `bootstrap`, and checks that the configurations agree (InvalidArgument naming the rank that
  // differs). An engine serves one AllToAll per instance (AllToAllConfig::instance); another
  // with an instance already taken on it is AlreadyExists.
  static StatusOr<std::unique_ptr<AllToAll>> Create(const AllToAllConfig& config,
                                                    TransferEngine* engine, Bootstrap& bootstrap);
  // Elastic membership: a rank the others lost comes back without the survivors rebuilding
  // anything (NIXL's connect_ranks, DeepEP's low_latency_update_mask_buffer(rank, False)).
  // Between epochs, every survivor calls Readmit and a new process for each masked rank calls
  // Join with that rank's id and the configuration the survivors run, all over `group`: a
  // bootstrap of the whole world (the survivors at their ranks, the new processes at theirs),
  // typically a rendezvous the launcher starts for the purpose. Every rank that is masked
  // comes back at once: the survivors agree on the epoch, the membership version and which
  // ranks are masked, and those ranks are exactly the ones joining (FailedPrecondition naming
  // a rank that is on another view -- a survivor that missed a change fails fast instead of
  // exchanging wrong bytes; InvalidArgument for a configuration that differs). The survivors'
  // next epoch then runs with every rank, and Join's AllToAll starts at that epoch. A rank
  // that leaves cleanly is one every live rank masks (SetMasked) before the same epoch.
  //
  // Fence: a replaced process that was only slow may still write under the keys it was
  // given. Each survivor's receive buffers take new keys and the old ones are revoked before
  // the next epoch (TransferEngine::Revoke), and what had landed under them from the replaced
  // ranks is counted and dropped, so nothing of theirs lands in, or completes, a later epoch.
  // A meeting that fails (a new process that never came, `timeout`) leaves the survivors as
  // they were, those ranks still masked, and Readmit may be called again. The membership
  // version counts the readmissions and resizes. Both devices, both forwardings: the host
  // device per rank re-keys its receive buffers in place; the CUDA device is made anew on
  // every rank (its node's ranks reach each other through memory each maps once, which a new
  // process cannot take over; what the old one held goes first); node-once builds its hops
  // anew, and there each survivor has masked only the ranks it waits for (the lost ranks are
  // their masks together). CUDA graphs captured before a readmission on the CUDA device hold
  // the old device's memory: capture them again. Join also brings a new process into a world
  // that grows (Resize).
  static StatusOr<std::unique_ptr<AllToAll>> Join(const AllToAllConfig& config,
                                                  TransferEngine* engine, Bootstrap& group,
                                                  std::chrono::milliseconds timeout);
  virtual Status Readmit(Bootstrap& group, std::chrono::milliseconds timeout) = 0;
  // The world changes size, shrinking or growing, between epochs: every rank of the new world
  // that ran in the old one calls Resize with the new configuration (its new world_size, its
  // rank there, the experts as the engine laid them out anew), every new process calls Join
  // with it, all over `group`, a bootstrap of the new world; a rank of the old world that is
  // not in the new one destroys its AllToAll after its last epoch. The ranks agree as for
  // Readmit (a survivor on another epoch or version is refused by name); each survivor builds
  // its buffers for the new world on the same engine and instance, keeping this handle and
  // its epoch count, and the next epoch runs the new world, config() reporting it.
  // FailedPrecondition while this rank has masked a rank (its process may still write under
  // the keys it holds, which Resize does not fence: readmit a replacement first); InvalidArgument
  // for another device. A meeting that fails leaves this AllToAll as it was. Both devices, both
  // forwardings: the host device per rank makes the new world's device beside the old one (one
  // it cannot make leaves the old one running); the CUDA device, and node-once's hops, are made
  // anew as in a readmission, the old ones first (a failure past them ends this AllToAll, as
  // Readmit's does), and CUDA graphs captured before must be captured again.
  virtual Status Resize(const AllToAllConfig& config, Bootstrap& group,
                        std::chrono::milliseconds timeout) = 0;
  virtual uint64_t membership_version() const = 0;
  virtual ~AllToAll() = default;

  virtual const AllToAllConfig& config() const = 0;

  virtual Status DispatchSend(const DispatchInput& in) = 0;
  // What peers sent is checked before it is used: a counts row announcing more slots or combine
  // rows than one rank can route to another, or a slot naming a token, expert, copy or combine
  // row out of range, is DataLoss naming the sender; nothing is written outside `out`. On the
  // host device that stops the AllToAll (every later step reports it); on the CUDA device the
  // slot is dropped and the error surfaces as kernel errors do (see SetStream).
  virtual Status DispatchRecv(const DispatchOutput& out, Deadline deadline) = 0;
  // The expert outputs (CombineInput says their form); InvalidArgument for fp16 where the
  // combine is fp32.
  virtual Status CombineSend(const CombineInput& in) = 0;
  Status CombineSend(const void* expert_out) { return CombineSend(CombineInput{expert_out}); }
  // out: [T, hidden] bf16 (fp16, fp32: CombineOutput) for the T of the last DispatchSend;
  // with accumulate, adds to it.
  virtual Status CombineRecv(const CombineOutput& out, Deadline deadline) = 0;
  Status CombineRecv(void* out, bool accumulate, Deadline deadline) {
    return CombineRecv(CombineOutput{out, accumulate}, deadline);
  }

  // CUDA device (any ranks_per_node): enqueue the steps on `stream` (a cudaStream_t; nullptr: back
  // to waiting) and return at once; only between a CombineRecv and a DispatchSend, and after
  // waiting for the steps enqueued on the stream before (none when they waited for themselves: a
  // stream being captured may be taken then). The four steps of one AllToAll must go on one stream,
  // in order: the flags that make buffer reuse safe rely on it. Errors a kernel finds (expert ids
  // out of range: those copies are dropped; a device token count above num_tokens: nothing is sent)
  // surface at Synchronize; a peer that never raised its flag before the step's deadline also fails
  // every later step. Graph capture works: the epoch the flags compare against lives in device
  // memory; a captured wait keeps the deadline budget (from the kernel's start) it had when
  // captured. The host device: Unimplemented.
  // The receive kernels wait on the GPU, their blocks resident and polling flags, for what
  // peers' send kernels write. A rank's own send kernel always finds room beside them (stream
  // order and their grids see to it), but kernels of other streams on the same GPU get only the
  // SMs left: two AllToAlls overlapped on two streams must be enqueued in the same order on
  // every rank (else each rank's waiting blocks can hold off the send kernel its peer waits for),
  // and ranks that share one GPU as MPS clients need SMs of their own
  // (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; seen: prefill steps that all waited out their deadline
  // with every client on every SM). Without MPS, ranks sharing a GPU are time-sliced: correct,
  // milliseconds a step.
  virtual Status SetStream(void* stream) = 0;
  // Waits for the steps enqueued so far and reports what their kernels found. Without a stream
  // the steps wait themselves and this returns OK.
  virtual Status Synchronize() = 0;
  // Synchronize without the wait: *done says whether every step enqueued so far has finished
  // (then what their kernels found is reported, as Synchronize does); while some still run,
  // OK unless a kernel has reported an error already (then it waits for them and reports it,
  // *done true). While the AllToAll's stream is being captured into a CUDA graph: *done false
  // and nothing queried (querying a capturing stream would end the capture). The host device:
  // its steps waited for themselves, *done true.
  virtual Status Poll(bool* done) = 0;
  // Whether `stream` (a cudaStream_t; nullptr: the AllToAll's own) is being captured into a
  // CUDA graph now: steps enqueued are then recorded, not run, and there is nothing to poll or
  // wait for (a query or Synchronize would end the capture). A caller asks of its own stream
  // before ordering the AllToAll's after it (which joins the AllToAll's to the capture). The
  // host device: false.
  virtual bool capturing(void* stream) const = 0;
  // A point in the AllToAll's stream, for a caller that holds what the steps use and lets it
  // go part by part while later steps still run (Poll answers for every step at once; on a
  // stream the caller's kernels share it is seldom idle). Mark: *mark names the point after the
  // steps enqueued so far (CUDA device: an event of a ring of kMarks recorded on the stream;
  // not while it is being captured). Reached: whether the steps before `mark` have finished
  // (with `wait`, after waiting for them); a mark kMarks or more behind the newest reads its
  // slot's later mark, so it may answer false for a while longer, never true too early. The
  // host device: every step waited for itself, each mark reached.
  static constexpr int kMarks = 16;
  virtual Status Mark(uint64_t* mark) {
    *mark = 0;
    return Status::Ok();
  }
  virtual Status Reached(uint64_t /*mark*/, bool /*wait*/, bool* reached) {
    *reached = true;
    return Status::Ok();
  }
  // CUDA device: order the AllToAll's stream and another without the host waiting (an event of
  // the AllToAll's recorded on one, waited for on the other; graph capture works). OrderAfter:
  // the steps enqueued from now on start after what `stream` holds so far. OrderBefore: what is
  // enqueued on `stream` from now on starts after the steps enqueued so far. `stream` may be
  // the legacy default stream (0). The AllToAll's own stream (SetStream's) is ordered with
  // itself: nothing is recorded. The host device: Unimplemented.
  virtual Status OrderAfter(void* stream) = 0;
  virtual Status OrderBefore(void* stream) = 0;

  // Rank masks (DeepEP's low-latency mask buffer). A masked rank is left out of every step from
  // the next DispatchSend on: the copies routed to its experts go nowhere and add nothing to the
  // combine (as id -1 does), nothing it sends is read, no step waits for it. Set mid-epoch, a
  // mask takes effect at the next DispatchSend (Masked reports it at once). A rank cannot mask
  // itself (InvalidArgument), nor is a masked rank unmasked here (Unimplemented: its late
  // sections could be read as a later epoch's; it comes back fenced through Readmit). For a manual
  // mask to hold every rank's steps to the same ranks, every live rank masks it before the same
  // epoch. On the CUDA device a mask is set in stream order: between a CombineRecv and a
  // DispatchSend, once its kernels read masks (mask_lost_peers, or a rank masked before), at once
  // on the AllToAll's stream, so that a CUDA graph replayed there after it sees it; otherwise
  // before the next DispatchSend's kernels (a graph captured without masks never reads one).
  virtual Status SetMasked(int rank, bool masked) = 0;
  // [world_size], 1 where a rank is masked (by SetMasked, or by a step under mask_lost_peers).
  // The CUDA device waits for the AllToAll's stream first: a step masks a rank as it runs.
  virtual StatusOr<std::vector<uint8_t>> Masked() const = 0;

  // Bytes this rank's last dispatch and combine put on the wire (payload and metadata; on the
  // CUDA device, to other ranks over NVLink or the relay, read back from the GPU after waiting
  // for the stream).
  virtual uint64_t dispatch_bytes_sent() const = 0;
  virtual uint64_t combine_bytes_sent() const = 0;
};

// Whether this build of ferry has the CUDA device (MoeDeviceKind::kCuda; its kernels built for
// sm_90). Without it a CUDA configuration's Create is Unimplemented.
FERRY_API bool CudaDeviceBuilt();

}  // namespace ferry
