// ferry kv: KV-cache page layouts, tensor-parallel sharding, and the reshard planner of the KV
// messenger (docs/DESIGN.md §1.2, §2.3).
//
// A KvLayout describes one layer's cache pages as one TP rank holds them. The planner turns
// (prefill layout + TP size, decode layout + TP size, the request's page ids) into the list of
// contiguous writes that rebuild every decode rank's pages from the prefill ranks' pages, and
// the number of writes each decode rank must expect. It is pure and deterministic given a seed.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/bootstrap.h"
#include "ferry/export.h"
#include "ferry/fabric.h"
#include "ferry/status.h"

namespace ferry {

enum class KvOrder : uint8_t {
  kNHD = 0,  // [tokens][heads][head_dim]: FlashInfer's default
  kHND = 1,  // [heads][tokens][head_dim]: a head-shard of a page is contiguous
};

// The model's cache, independent of sharding. Validate bounds each dimension (far above any
// model), so that no page's byte offset overflows whatever a peer's request says.
constexpr int kMaxKvHeads = 1 << 16;
constexpr int kMaxHeadDim = 1 << 16;
constexpr int kMaxPageTokens = 1 << 20;
struct FERRY_API KvModel {
  int kv_heads = 0;     // KV heads (1 for MLA)
  int head_dim = 0;     // elements per head (MLA: the latent width, e.g. 576)
  int dtype_bytes = 2;  // bf16
  bool mla = false;     // one latent per token (no separate K and V); replicated on every rank
  int page_tokens = 0;  // tokens per page

  Status Validate() const;
  int components() const { return mla ? 1 : 2; }  // K and V, or the latent
};

// How one side (prefill or decode) lays out and shards the cache.
struct FERRY_API KvSide {
  KvModel model;
  KvOrder order = KvOrder::kHND;
  int tp = 1;  // tensor-parallel ranks

  Status Validate() const;
  // Heads each rank holds (all of them for MLA).
  int heads_per_rank() const;
  // Ranks holding the same heads: tp / kv_heads when replicated, tp for MLA, else 1.
  int replicas() const;
  // First (global) head that rank `r` holds.
  int first_head(int r) const;
  // Bytes of one page of one layer on one rank.
  int64_t page_bytes() const;
  // Byte offset, within one rank's layer region, of the head_dim vector of (page, component,
  // local head, token).
  int64_t Offset(int64_t page, int component, int local_head, int token) const;
  int64_t vector_bytes() const { return int64_t{model.head_dim} * model.dtype_bytes; }
};

// One contiguous write of the plan: bytes of a prefill rank's layer region to a decode rank's.
struct FERRY_API KvWrite {
  int src_rank = 0;
  int64_t src_offset = 0;
  int dst_rank = 0;
  int64_t dst_offset = 0;
  int64_t length = 0;
};

struct FERRY_API KvPlan {
  std::vector<KvWrite> writes;           // per layer; ordered by (dst rank, dst offset)
  std::vector<int64_t> writes_per_dst;   // [decode tp] writes each decode rank receives per layer
  std::vector<int> source_replica;       // [decode replicas] prefill replica set feeding each
};

// Plans one layer's transfer of a request. src_pages[i] (prefill page id) fills dst_pages[i]
// (decode page id); every rank of a side uses the same page ids. `seed` picks which prefill
// replica set feeds each decode replica set (a different seed per request spreads the NICs).
// InvalidArgument when the sides disagree on the model, a side cannot shard it, or page lists
// differ in length or hold negative ids or ids whose byte offsets overflow 64 bits.
FERRY_API StatusOr<KvPlan> PlanKvTransfer(const KvSide& prefill, const KvSide& decode,
                                          std::span<const int64_t> src_pages,
                                          std::span<const int64_t> dst_pages, uint64_t seed);

}  // namespace ferry

// ---------------------------------------------------------------------------------------------
// The KV messenger. One TransferEngine serves all TP ranks of a node: each rank's cache is a
// registered region (on GPUs, imported into the leader; in CPU tests, host regions standing for
// devices) holding num_layers layers, layer_stride bytes apart, pages at KvSide::Offset.

namespace ferry {

struct FERRY_API KvRegions {
  std::vector<const MemoryRegion*> ranks;  // [tp] one region per TP rank
  int num_layers = 0;
  int64_t layer_stride = 0;  // bytes between consecutive layers in a rank's region
};

// Decode side: sends requests and counts the writes that land. It takes
// the engine's acknowledgement messages by their tag (TransferEngine::SetTaggedMessageHandler):
// an engine serves one KvDecoder (AlreadyExists for a second) beside a KvPrefill and other users
// of messages. Destroy it before its engine. Thread safety: Submit and Cancel from any thread;
// callbacks run on the engine's worker.
// Prefills are added to the engine as requests name them; when its peer table is full
// (EngineOptions::max_peers), the least recently used prefill no request waits on is removed to
// make room (added again when a request names it).
class FERRY_API KvDecoder {
 public:
  static StatusOr<std::unique_ptr<KvDecoder>> Create(TransferEngine* engine, const KvSide& decode,
                                                     const KvRegions& regions,
                                                     const MemoryRegion* aux,
                                                     int max_requests = 256);
  virtual ~KvDecoder() = default;

  struct Request {
    uint64_t request_id = 0;  // unique among in-flight requests (a prefill that has one with
                              // this id in flight cancels the newcomer); seeds the plan
    std::span<const uint8_t> prefill_address;
    KvSide prefill;                         // the prefill side's layout, to count the writes
    std::span<const int64_t> pages;         // our page ids, in prompt order
    int64_t num_tokens = 0;                 // prompt tokens the prefill computes
    int64_t aux_offset = 0;                 // where in `aux` the prefill's aux bytes go
    int64_t aux_bytes = 0;                  // 0: no aux data
    // Speculative decoding / structured output: the prefill leaves out the prompt's last token
    // (the decoder runs it as its first step) and the aux bytes carry the hidden state / logits
    // of the token before it.
    bool speculative = false;
  };
  // Sends the request and calls `ready` once: OK when every page of every layer and the aux
  // data have landed. At `deadline` (or after Cancel, or when the prefill cancels) the decoder
  // asks the prefill to stop and reports DeadlineExceeded (or Cancelled) only once every write
  // the prefill acknowledges having posted has landed: the pages are then safe to reuse. If the
  // prefill never acknowledges (a few seconds), the decoder removes it from the engine, then
  // reports Unavailable; a later request to it adds it again (a new connection: a prefill that
  // hung and was continued serves it). A prefill removed so is fenced first: nothing it posts
  // afterwards lands in our memory or counts toward a request. Over verbs its queue pairs go to
  // the error state; over libfabric each prefill writes under keys of its own (our regions and
  // aux registered once more for it when it is added, a registration per region and prefill),
  // and those keys are revoked (TransferEngine::Revoke); if the fence cannot be set (the
  // engine's worker wedged), the removal counts as failed: Unavailable, and the request's pages
  // stay reserved. A request whose message never reached the prefill
  // -- sent just as the prefill removed us to make room in its peer table -- reports
  // Unavailable at once; sent again, it adds the prefill again (over verbs the prefill's
  // goodbye has by then marked it lost here, and the new connection replaces the old).
  virtual Status Submit(const Request& request, Deadline deadline, DoneCallback ready) = 0;
  // Asks the prefill to stop the request; `ready` reports the outcome as above.
  virtual Status Cancel(uint64_t request_id) = 0;
};

// A layer counter for a model whose attention runs on a CUDA stream: a 64-bit word in pinned host
// memory mapped into the GPU. Increment(stream) enqueues "counter += 1" behind the work already on
// the stream, so the prefill's watcher (pass host() as its layer counter) never sees a layer
// before the kernels that wrote its KV pages have finished. One stream increments a counter.
// Unimplemented where ferry was built without CUDA; FailedPrecondition on a machine without GPU.
class FERRY_API GpuLayerCounter {
 public:
  static StatusOr<std::unique_ptr<GpuLayerCounter>> Create();
  virtual ~GpuLayerCounter() = default;
  virtual const std::atomic<uint64_t>* host() const = 0;
  // `cuda_stream` is a cudaStream_t; null is the legacy default stream.
  virtual Status Increment(void* cuda_stream) = 0;
};

// The caches of a node's TP ranks in GPU memory, seen by one leader process that owns the engine
// (one engine serves every shard of a node). Each rank allocates its cache here (cuMemCreate,
// exportable); the descriptors go to the leader over a Unix socket, and the leader maps every
// rank's cache into its own address space: it registers those mappings with its engine
// (EngineOptions::cuda_memory; a provider without CUDA memory says Unimplemented there) and
// passes them to KvPrefill / KvDecoder as KvRegions. A rank that dies leaves its cache mapped
// in the leader until the leader lets go, so writes still landing in it never fault.
// Collective over `bootstrap` (the ranks of one node, the leader among them). FailedPrecondition
// without a GPU; Unimplemented where ferry was built without CUDA.
class FERRY_API KvCudaShards {
 public:
  static StatusOr<std::unique_ptr<KvCudaShards>> Create(Bootstrap& bootstrap, int leader,
                                                        int cuda_device, int64_t bytes,
                                                        std::chrono::milliseconds timeout);
  virtual ~KvCudaShards() = default;
  // This rank's cache: device memory of `cuda_device`, at least `bytes` long, zeroed.
  virtual void* local() const = 0;
  // Leader: every rank's cache as mapped here, indexed by rank (its own included). Others: empty.
  virtual std::span<void* const> leader_view() const = 0;
};

// A KvPrefill's settings (KvPrefill::Options).
struct FERRY_API KvPrefillOptions {
  // Each released request's last layer on stderr: when the watcher saw it counted, posted its
  // writes and saw them complete (CLOCK_MONOTONIC microseconds, the clock of a caller's own
  // stamps). FERRY_KV_TRACE.
  bool trace = false;
  // The defaults, with each variable that is set taking its field's place (InvalidArgument
  // naming a variable whose value the field cannot take).
  static StatusOr<KvPrefillOptions> FromEnv();
};

// Prefill side: takes requests, follows the forward pass through a layer counter, writes each
// finished layer's pages, then the aux data, and releases the source pages when done. It takes
// the engine's request and cancel messages by their tags (one KvPrefill per engine, beside a
// KvDecoder and other users of messages) and runs one watcher thread; destroy it before its
// engine.
// While a scheduled chunk awaits a layer the watcher polls the counter without sleeping (a core
// for the forward pass's length: it sees each layer within microseconds); with nothing to wait
// for it idles as the engine does (EngineOptions::spin_us).
// Thread safety: Schedule* and Cancel from any thread; callbacks run on the watcher thread.
// Decoders are added to the engine as their requests arrive; when its peer table is full
// (EngineOptions::max_peers) the least recently used decoder no request is being served for is
// removed to make room (it adds us again with its next request).
class FERRY_API KvPrefill {
 public:
  struct Incoming {
    uint64_t request_id = 0;
    int64_t num_pages = 0;
    int64_t num_tokens = 0;  // tokens to compute: the prompt, less its last in speculative mode
    bool speculative = false;
  };
  struct Callbacks {
    std::function<void(const Incoming&)> on_request;                 // hand to the scheduler
    std::function<void(uint64_t request_id, const Status&)> on_released;  // source pages free
  };
  using Options = KvPrefillOptions;
  // `layer_counter` counts attention output projections finished, cumulatively over passes.
  static StatusOr<std::unique_ptr<KvPrefill>> Create(TransferEngine* engine,
                                                     const KvSide& prefill,
                                                     const KvRegions& regions,
                                                     const MemoryRegion* aux,
                                                     const std::atomic<uint64_t>* layer_counter,
                                                     Callbacks callbacks, Options options = {});
  virtual ~KvPrefill() = default;

  // Stops posting the request's writes; once those posted have completed, releases its source
  // pages (on_released with Cancelled) and tells the decoder how many writes it posted.
  virtual Status Cancel(uint64_t request_id) = 0;
  // Chunked prefill: the scheduler placed the request's pages [first_page, first_page +
  // src_pages.size()) in the pass that starts after layer count `pass_base`; layer l of those
  // pages goes once the counter reaches pass_base + l + 1. `src_pages` are our page ids for them.
  // Chunks come in page order; the one that completes the request also sends the aux bytes, read
  // at `aux_offset` of our aux region, after its last layer.
  virtual Status ScheduleChunk(uint64_t request_id, int64_t first_page,
                               std::span<const int64_t> src_pages, uint64_t pass_base,
                               int64_t aux_offset) = 0;
  // The whole request in one pass (ScheduleChunk's arguments, in its order, from page 0).
  Status Schedule(uint64_t request_id, std::span<const int64_t> src_pages, uint64_t pass_base,
                  int64_t aux_offset) {
    return ScheduleChunk(request_id, 0, src_pages, pass_base, aux_offset);
  }
};

}  // namespace ferry
