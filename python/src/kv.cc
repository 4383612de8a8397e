// KV messenger bindings: the layouts and the planner, layer counters, and the two roles. Each
// role keeps what its C++ object points to -- the engine (held open), the regions of every TP
// rank and the aux region, the layer counter -- for as long as it lives. Its callbacks only
// record: a decoder's request ends in a ferry.Transfer; a prefill's incoming requests and
// released pages queue for next_request() and next_release().
#include "ferry/kv.h"

#include <pybind11/stl.h>

#include "completion.h"

namespace ferry::python {
namespace {

// The layer counter a prefill follows from the host: the model's loop calls increment() once
// per layer's attention output (ferry.GpuLayerCounter when that runs on a CUDA stream).
struct LayerCounter {
  std::atomic<uint64_t> value{0};
};

KvRegions RegionsOf(const std::vector<py::object>& ranks, int num_layers, int64_t layer_stride) {
  KvRegions r;
  for (const py::object& rank : ranks) r.ranks.push_back(&py::cast<const Region&>(rank).region);
  r.num_layers = num_layers;
  r.layer_stride = layer_stride;
  return r;
}

const MemoryRegion* AuxOf(const py::object& aux) {
  return aux.is_none() ? nullptr : &py::cast<const Region&>(aux).region;
}

// A messenger role's C++ object (KvDecoder, KvPrefill) and the engine it is made on, held open
// while the object lives. The derived class's destructor calls Close(): the object goes before
// the regions and counter the derived class keeps for it.
template <typename T>
class Role {
 public:
  explicit Role(py::object engine) : engine_(std::move(engine)) {}

  void Close() {
    if (!role_) return;
    {
      py::gil_scoped_release release;
      role_.reset();  // the role ends what is in flight (bounded), see include/ferry/kv.h
    }
    ReleaseEngine(engine_);
  }

 protected:
  // create(TransferEngine*) -> StatusOr<std::unique_ptr<T>>; the engine is let go again when
  // it fails.
  template <typename Create>
  void Open(Create create) {
    StatusOr<std::unique_ptr<T>> created = create(AcquireEngine(engine_));
    if (!created.ok()) ReleaseEngine(engine_);
    role_ = ValueOrThrow(std::move(created));
  }
  T& role() {
    if (!role_) ThrowIfError(FailedPreconditionError("the KV messenger role is closed"));
    return *role_;
  }

 private:
  py::object engine_;
  std::unique_ptr<T> role_;
};

class Decoder : public Role<KvDecoder> {
 public:
  Decoder(py::object engine, const KvSide& decode, std::vector<py::object> regions, int num_layers,
          int64_t layer_stride, py::object aux, int max_requests)
      : Role(std::move(engine)), regions_(std::move(regions)), aux_(std::move(aux)) {
    Open([&](TransferEngine* e) {
      return KvDecoder::Create(e, decode, RegionsOf(regions_, num_layers, layer_stride),
                               AuxOf(aux_), max_requests);
    });
  }
  ~Decoder() { Close(); }

  Transfer Submit(uint64_t request_id, const py::bytes& prefill_address, const KvSide& prefill,
                  const std::vector<int64_t>& pages, int64_t num_tokens, int64_t aux_offset,
                  int64_t aux_bytes, bool speculative, double timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    const std::string address = prefill_address;
    KvDecoder::Request r;
    r.request_id = request_id;
    r.prefill_address = {reinterpret_cast<const uint8_t*>(address.data()), address.size()};
    r.prefill = prefill;
    r.pages = pages;
    r.num_tokens = num_tokens;
    r.aux_offset = aux_offset;
    r.aux_bytes = aux_bytes;
    r.speculative = speculative;
    auto pending = std::make_shared<Pending>();
    ThrowIfError(role().Submit(r, deadline, Pending::Callback(pending)));
    return Transfer(pending, py::make_tuple());  // the regions stay with the decoder
  }
  void Cancel(uint64_t request_id) { ThrowIfError(role().Cancel(request_id)); }

 private:
  std::vector<py::object> regions_;
  py::object aux_;
};

class Prefill : public Role<KvPrefill> {
 public:
  using Released = std::pair<uint64_t, Status>;

  Prefill(py::object engine, const KvSide& prefill, std::vector<py::object> regions, int num_layers,
          int64_t layer_stride, py::object aux, py::object layer_counter)
      : Role(std::move(engine)),
        regions_(std::move(regions)),
        aux_(std::move(aux)),
        counter_(std::move(layer_counter)),
        requests_(std::make_shared<WaitQueue<KvPrefill::Incoming>>("requests", 4096)),
        released_(std::make_shared<WaitQueue<Released>>("releases", 4096)) {
    const std::atomic<uint64_t>* counter = nullptr;
    if (py::isinstance<LayerCounter>(counter_)) {
      counter = &py::cast<const LayerCounter&>(counter_).value;
    } else if (py::isinstance<GpuLayerCounter>(counter_)) {
      counter = py::cast<const GpuLayerCounter&>(counter_).host();
    } else {
      ThrowIfError(InvalidArgumentError(
          "layer_counter must be a ferry.LayerCounter or a ferry.GpuLayerCounter"));
    }
    KvPrefill::Callbacks callbacks;
    callbacks.on_request = [q = requests_](const KvPrefill::Incoming& in) { q->Push(in); };
    callbacks.on_released = [q = released_](uint64_t id, const Status& s) { q->Push({id, s}); };
    // FERRY_KV_TRACE as ferry-bench kv reads it (Options::FromEnv).
    const KvPrefill::Options options = ValueOrThrow(KvPrefill::Options::FromEnv());
    Open([&](TransferEngine* e) {
      return KvPrefill::Create(e, prefill, RegionsOf(regions_, num_layers, layer_stride),
                               AuxOf(aux_), counter, std::move(callbacks), options);
    });
  }
  ~Prefill() { Close(); }

  py::dict NextRequest(double timeout) { return RequestDict(requests_->PopForPython(timeout)); }
  py::tuple NextRelease(double timeout) { return ReleaseTuple(released_->PopForPython(timeout)); }
  // What the next_* calls would give, all of it, without waiting.
  py::list PollRequests() { return requests_->PopAllForPython(RequestDict); }
  // Transfers that end once something waits in either queue (asyncio: await, then poll_*).
  py::object RequestReady() { return py::cast(Transfer(requests_->Ready(), py::tuple())); }
  py::object ReleaseReady() { return py::cast(Transfer(released_->Ready(), py::tuple())); }
  // The role ends what is in flight (its releases still queue), then the queues close.
  void Close() {
    Role::Close();
    requests_->Close(CancelledError("the KvPrefill is closed"));
    released_->Close(CancelledError("the KvPrefill is closed"));
  }
  py::list PollReleases() { return released_->PopAllForPython(ReleaseTuple); }
  void ScheduleChunk(uint64_t request_id, int64_t first_page, const std::vector<int64_t>& pages,
                     uint64_t pass_base, int64_t aux_offset) {
    ThrowIfError(role().ScheduleChunk(request_id, first_page, pages, pass_base, aux_offset));
  }
  void Cancel(uint64_t request_id) { ThrowIfError(role().Cancel(request_id)); }

 private:
  static py::dict RequestDict(const KvPrefill::Incoming& in) {
    py::dict d;
    d["request_id"] = in.request_id;
    d["num_pages"] = in.num_pages;
    d["num_tokens"] = in.num_tokens;
    d["speculative"] = in.speculative;
    return d;
  }
  static py::tuple ReleaseTuple(const Released& r) {
    return py::make_tuple(r.first, ErrorObject(r.second));
  }

  std::vector<py::object> regions_;
  py::object aux_;
  py::object counter_;
  std::shared_ptr<WaitQueue<KvPrefill::Incoming>> requests_;
  std::shared_ptr<WaitQueue<Released>> released_;
};

// A node's TP caches in GPU memory (KvCudaShards). `local` and `leader_view` are flat byte
// Arrays on cuda_device owned by this object: whoever keeps one (a Region registered from it, a
// torch tensor made from its __cuda_array_interface__) keeps the mappings.
class CudaShards {
 public:
  CudaShards(Bootstrap& bootstrap, int leader, int cuda_device, int64_t num_bytes, double timeout)
      : device_(cuda_device), num_bytes_(num_bytes) {
    const Millis limit = ToMillis(timeout);
    StatusOr<std::unique_ptr<KvCudaShards>> created = [&] {
      py::gil_scoped_release release;  // a CallbackBootstrap's all-gather takes it back
      return KvCudaShards::Create(bootstrap, leader, cuda_device, num_bytes, limit);
    }();
    shards_ = ValueOrThrow(std::move(created));
  }

  static Array Local(const py::object& self) {
    const CudaShards& s = py::cast<const CudaShards&>(self);
    return s.View(s.shards_->local(), self);
  }
  static py::list LeaderView(const py::object& self) {
    const CudaShards& s = py::cast<const CudaShards&>(self);
    py::list views;
    for (void* cache : s.shards_->leader_view()) views.append(s.View(cache, self));
    return views;
  }

 private:
  Array View(void* cache, const py::object& self) const {
    return OwnedView(cache, static_cast<uint64_t>(num_bytes_), 1, device_, self);
  }

  int device_;
  int64_t num_bytes_;
  std::unique_ptr<KvCudaShards> shards_;
};

}  // namespace

void BindKv(py::module_& m) {
  py::enum_<KvOrder>(m, "KvOrder").value("NHD", KvOrder::kNHD).value("HND", KvOrder::kHND);

  py::class_<KvModel>(m, "KvModel", "The model's cache, independent of sharding")
      .def(py::init([](const py::kwargs& f) { return WithFields(KvModel{}, f); }))
      .def_readwrite("kv_heads", &KvModel::kv_heads)
      .def_readwrite("head_dim", &KvModel::head_dim)
      .def_readwrite("dtype_bytes", &KvModel::dtype_bytes)
      .def_readwrite("mla", &KvModel::mla)
      .def_readwrite("page_tokens", &KvModel::page_tokens)
      .def("validate", [](const KvModel& k) { ThrowIfError(k.Validate()); });

  py::class_<KvSide>(m, "KvSide", "How one side (prefill or decode) lays out and shards the cache")
      .def(py::init([](const py::kwargs& f) { return WithFields(KvSide{}, f); }))
      .def_readwrite("model", &KvSide::model)
      .def_readwrite("order", &KvSide::order)
      .def_readwrite("tp", &KvSide::tp)
      .def("validate", [](const KvSide& s) { ThrowIfError(s.Validate()); })
      .def_property_readonly("heads_per_rank", &KvSide::heads_per_rank)
      .def_property_readonly("page_bytes", &KvSide::page_bytes)
      .def("offset", &KvSide::Offset, py::arg("page"), py::arg("component"), py::arg("local_head"),
           py::arg("token"), "Byte offset, in one rank's layer region, of that head_dim vector");

  py::class_<KvWrite>(m, "KvWrite")
      .def_readonly("src_rank", &KvWrite::src_rank)
      .def_readonly("src_offset", &KvWrite::src_offset)
      .def_readonly("dst_rank", &KvWrite::dst_rank)
      .def_readonly("dst_offset", &KvWrite::dst_offset)
      .def_readonly("length", &KvWrite::length);
  py::class_<KvPlan>(m, "KvPlan")
      .def_readonly("writes", &KvPlan::writes)
      .def_readonly("writes_per_dst", &KvPlan::writes_per_dst)
      .def_readonly("source_replica", &KvPlan::source_replica);
  m.def(
      "plan_kv_transfer",
      [](const KvSide& prefill, const KvSide& decode, const std::vector<int64_t>& src_pages,
         const std::vector<int64_t>& dst_pages, uint64_t seed) {
        return ValueOrThrow(PlanKvTransfer(prefill, decode, src_pages, dst_pages, seed));
      },
      py::arg("prefill"), py::arg("decode"), py::arg("src_pages"), py::arg("dst_pages"),
      py::arg("seed") = 0, "One layer's writes that rebuild the decode ranks' pages");

  py::class_<LayerCounter>(m, "LayerCounter", "A host layer counter for KvPrefill")
      .def(py::init<>())
      .def(
          "increment",
          [](LayerCounter& c, uint64_t n) { c.value.fetch_add(n, std::memory_order_release); },
          py::arg("n") = 1, "After the layer's KV pages are written")
      .def_property_readonly("value", [](const LayerCounter& c) { return c.value.load(); });
  py::class_<GpuLayerCounter>(m, "GpuLayerCounter",
                              "A layer counter the model's CUDA stream increments")
      .def(py::init([] { return ValueOrThrow(GpuLayerCounter::Create()); }))
      .def(
          "increment",
          [](GpuLayerCounter& c, uint64_t stream) {
            ThrowIfError(c.Increment(reinterpret_cast<void*>(static_cast<uintptr_t>(stream))));
          },
          py::arg("stream") = 0, "Enqueues counter += 1 on the stream (a cudaStream_t)")
      .def_property_readonly("value", [](const GpuLayerCounter& c) { return c.host()->load(); });
  py::class_<CudaShards>(m, "KvCudaShards",
                         "A node's TP caches in GPU memory, mapped into the leader rank "
                         "(collective over the node's ranks)")
      .def(py::init<Bootstrap&, int, int, int64_t, double>(), py::arg("bootstrap"),
           py::arg("leader"), py::arg("cuda_device"), py::arg("num_bytes"),
           py::arg("timeout") = 60.0,
           "Every rank of the node calls it: each gets num_bytes of cache on cuda_device, the "
           "leader maps them all (register leader_view with its engine)")
      .def_property_readonly("local", &CudaShards::Local,
                             "This rank's cache: a ferry.Array of num_bytes on cuda_device, zeroed")
      .def_property_readonly("leader_view", &CudaShards::LeaderView,
                             "Leader: every rank's cache as mapped here, by rank; others: []");

  BindClose(
      py::class_<Decoder>(m, "KvDecoder",
                          "Decode side: sends requests, counts the pages that land. Takes the "
                          "engine's messages while it lives"))
      .def(py::init<py::object, const KvSide&, std::vector<py::object>, int, int64_t, py::object,
                    int>(),
           py::arg("engine"), py::arg("decode"), py::arg("regions"), py::arg("num_layers"),
           py::arg("layer_stride"), py::arg("aux") = py::none(), py::arg("max_requests") = 256,
           "regions: this node's TP ranks' cache Regions (engine.register); layer l of page p "
           "at l * layer_stride + decode.offset(p, ...); aux: the Region the prefill's aux "
           "bytes land in")
      .def("submit", &Decoder::Submit, py::arg("request_id"), py::arg("prefill_address"),
           py::arg("prefill"), py::arg("pages"), py::arg("num_tokens"), py::arg("aux_offset") = 0,
           py::arg("aux_bytes") = 0, py::arg("speculative") = false, py::arg("timeout") = 30.0,
           "A ferry.Transfer that ends once every page of every layer and the aux bytes landed")
      .def("cancel", &Decoder::Cancel, py::arg("request_id"),
           "Asks the prefill to stop the request; its Transfer ends Cancelled once every write "
           "the prefill posted has landed (the pages are then safe to reuse)");

  BindClose(
      py::class_<Prefill>(m, "KvPrefill",
                          "Prefill side: writes each finished layer's pages to the decoders. Takes "
                          "the engine's messages while it lives"))
      .def(py::init<py::object, const KvSide&, std::vector<py::object>, int, int64_t, py::object,
                    py::object>(),
           py::arg("engine"), py::arg("prefill"), py::arg("regions"), py::arg("num_layers"),
           py::arg("layer_stride"), py::arg("aux"), py::arg("layer_counter"),
           "regions: this node's TP ranks' cache Regions; aux: a Region (or None) the aux bytes "
           "are read from; layer_counter: a ferry.LayerCounter or ferry.GpuLayerCounter, "
           "counting attention output projections finished over every pass")
      .def("next_request", &Prefill::NextRequest, py::arg("timeout") = 30.0,
           "The next request a decoder sent: {request_id, num_pages, num_tokens, speculative}")
      .def("next_release", &Prefill::NextRelease, py::arg("timeout") = 30.0,
           "(request_id, None or the ferry.Error it ended with) once its source pages are free")
      .def("poll_requests", &Prefill::PollRequests,
           "Every request queued now, as next_request gives them, without waiting")
      .def("poll_releases", &Prefill::PollReleases,
           "Every release queued now, as next_release gives them, without waiting")
      .def("request_ready", &Prefill::RequestReady,
           "A ferry.Transfer that ends once a request waits to be taken (at once if one does; "
           "Cancelled once closed and empty): `await prefill.request_ready()`, then "
           "poll_requests()")
      .def("release_ready", &Prefill::ReleaseReady,
           "The same for releases: await it, then poll_releases()")
      .def(
          "schedule",
          [](Prefill& p, uint64_t id, const std::vector<int64_t>& pages, uint64_t pass_base,
             int64_t aux_offset) { p.ScheduleChunk(id, 0, pages, pass_base, aux_offset); },
          py::arg("request_id"), py::arg("src_pages"), py::arg("pass_base") = 0,
          py::arg("aux_offset") = 0,
          "The whole request in the pass after layer count pass_base: layer l of src_pages (our "
          "page ids) goes once the counter reaches pass_base + l + 1, then the aux bytes at "
          "aux_offset")
      .def("schedule_chunk", &Prefill::ScheduleChunk, py::arg("request_id"), py::arg("first_page"),
           py::arg("src_pages"), py::arg("pass_base"), py::arg("aux_offset") = 0,
           "Chunked prefill: the request's pages [first_page, first_page + len(src_pages)) in "
           "the pass after pass_base; chunks in page order, the last one also sends the aux bytes")
      .def("cancel", &Prefill::Cancel, py::arg("request_id"),
           "Stops posting the request's writes; once those posted completed, its source pages "
           "are released (next_release: Cancelled)");
}

}  // namespace ferry::python
