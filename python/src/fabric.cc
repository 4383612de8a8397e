// TransferEngine bindings. Transfers complete on the engine's worker thread, which never runs
// Python: a completion only records its status in the transfer's shared state, and Python
// waits on that (Transfer.wait) with the GIL released, or has ferry's callback thread run the
// transfer's done callbacks (add_done_callback; `await` goes through one). Messages are queued the
// same way and taken with recv(). Whatever the engine may still read or write for a transfer -- its
// local region, its page lists -- stays referenced by the engine until the transfer has ended, so
// dropping a Transfer or a Region early cannot pull memory from under the NIC.
#include <pybind11/stl.h>

#include <map>
#include <optional>

#include "completion.h"
#include "ferry/gpu_words.h"

namespace ferry::python {
namespace {

using Message = std::pair<std::optional<PeerId>, std::vector<uint8_t>>;
using MessageQueue = WaitQueue<Message>;

RemoteRegion ToRemote(const py::handle& object) {
  if (py::isinstance<RemoteRegion>(object)) return py::cast<RemoteRegion>(object);
  if (!PyBytes_Check(object.ptr())) {
    ThrowIfError(
        InvalidArgumentError("dst must be a ferry.RemoteRegion or the bytes of Region.descriptor"));
  }
  const auto* data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(object.ptr()));
  return ValueOrThrow(
      RemoteRegion::Parse({data, static_cast<size_t>(PyBytes_GET_SIZE(object.ptr()))}));
}

std::span<const uint8_t> BytesOf(const py::bytes& bytes) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  PyBytes_AsStringAndSize(bytes.ptr(), &data, &size);
  return {reinterpret_cast<const uint8_t*>(data), static_cast<size_t>(size)};
}

py::bytes ToBytes(const std::vector<uint8_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

class Engine {
 public:
  explicit Engine(const EngineOptions& options)
      : engine_(ValueOrThrow(TransferEngine::Create(options))),
        messages_(std::make_shared<MessageQueue>("messages", 4096)) {
    // Received messages go to recv(), but for those a KV messenger on this engine takes (its
    // tags: TransferEngine::SetTaggedMessageHandler).
    engine().SetMessageHandler(
        [messages = messages_](std::optional<PeerId> from, std::span<const uint8_t> bytes) {
          messages->Push({from, std::vector<uint8_t>(bytes.begin(), bytes.end())});
        });
  }

  // Nothing that uses the engine can outlive this object (each holds a reference to it), but a
  // destructor must not raise: should one still, the engine is left running, never freed under
  // it.
  ~Engine() {
    if (users_ > 0 || waiting_ > 0) {
      (void)engine_.release();
      (void)new auto(std::move(mirrors_));  // words it may still write: kept with it
      (void)new auto(std::move(mirrors_left_));
      return;
    }
    Close();
  }

  // Ends every transfer still in flight (Cancelled) and stops the worker; refused while an
  // AllToAll or a KV role uses the engine, or another thread waits on it.
  void Close() {
    if (waiting_ > 0) {
      ThrowIfError(FailedPreconditionError(
          "TransferEngine.close: another thread is waiting on this engine (wait_imm)"));
    }
    if (users_ > 0) {
      ThrowIfError(
          FailedPreconditionError("TransferEngine.close: " + std::to_string(users_) +
                                  " objects (AllToAll, KvPrefill, KvDecoder) still use this "
                                  "engine; close them first"));
    }
    if (engine_) {
      py::gil_scoped_release release;
      engine_.reset();
    }
    messages_->Close(CancelledError("the TransferEngine is closed"));
    inflight_.clear();
    scatter_sources_.clear();
    mirrors_.clear();
    mirrors_left_.clear();
  }

  TransferEngine& engine() {
    if (!engine_) ThrowIfError(FailedPreconditionError("the TransferEngine is closed"));
    return *engine_;
  }
  TransferEngine* Acquire() {
    TransferEngine* e = &engine();
    ++users_;
    return e;
  }
  void Release() { --users_; }

  Region Register(const py::handle& object) {
    Array array = ToArray(object);
    if (array.readonly) {
      ThrowIfError(InvalidArgumentError(
          "register: the array is read-only, and peers may write into a registered region"));
    }
    if (array.device == kCudaUnknownDevice) {
      ThrowIfError(
          InvalidArgumentError("register: the array is CUDA memory of no known device; pass "
                               "ferry.as_array(obj, device=N)"));
    }
    const MemoryKind kind = array.on_host() ? MemoryKind::kHost : MemoryKind::kCuda;
    Region r;
    r.region = ValueOrThrow(engine().RegisterMemory(array.pointer(), array.num_bytes, kind,
                                                    array.on_host() ? 0 : array.device));
    r.array = std::move(array);
    return r;
  }

  py::object Write(const py::object& src, PeerId peer, const py::handle& dst, uint64_t src_offset,
                   uint64_t dst_offset, std::optional<uint64_t> length,
                   std::optional<uint32_t> imm) {
    const Region& region = py::cast<const Region&>(src);
    SingleWrite w;
    w.src = &region.region;
    w.src_offset = src_offset;
    w.peer = peer;
    w.dst = ToRemote(dst);
    w.dst_offset = dst_offset;
    if (!length && src_offset > region.region.length()) {
      ThrowIfError(OutOfRangeError("write: src_offset " + std::to_string(src_offset) +
                                   " is past the region's " +
                                   std::to_string(region.region.length()) + " bytes"));
    }
    w.length = length ? *length : region.region.length() - src_offset;
    w.imm = imm;
    auto state = std::make_shared<Pending>();
    return Track(state, py::make_tuple(src), engine().Write(w, Done(state)));
  }

  py::object WritePaged(const py::object& src, PeerId peer, const py::handle& dst,
                        uint64_t page_bytes, std::vector<uint32_t> src_pages,
                        std::vector<uint32_t> dst_pages, std::optional<uint64_t> src_stride,
                        std::optional<uint64_t> dst_stride, uint64_t src_offset,
                        uint64_t dst_offset, std::optional<uint32_t> imm, bool imm_once,
                        uint32_t imm_weight_mask) {
    const Region& region = py::cast<const Region&>(src);
    auto state = std::make_shared<Pending>();
    state->src_pages = std::move(src_pages);
    state->dst_pages = std::move(dst_pages);
    PagedWrite w;
    w.src = &region.region;
    w.peer = peer;
    w.dst = ToRemote(dst);
    w.page_bytes = page_bytes;
    w.src_stride = src_stride.value_or(page_bytes);
    w.dst_stride = dst_stride.value_or(page_bytes);
    w.src_offset = src_offset;
    w.dst_offset = dst_offset;
    w.src_pages = state->src_pages;
    w.dst_pages = state->dst_pages;
    w.imm = imm;
    w.imm_once = imm_once;
    w.imm_weight_mask = imm_weight_mask;
    return Track(state, py::make_tuple(src), engine().WritePaged(w, Done(state)));
  }

  ScatterPlanId PrepareScatter(GroupId group, const py::object& src, const py::list& dst) {
    std::vector<RemoteRegion> regions;
    for (py::handle d : dst) regions.push_back(ToRemote(d));
    const Region& region = py::cast<const Region&>(src);
    const ScatterPlanId plan = ValueOrThrow(engine().PrepareScatter(group, region.region, regions));
    scatter_sources_[plan] = src;
    return plan;
  }

  py::object Scatter(ScatterPlanId plan,
                     const std::vector<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>>& targets,
                     std::optional<uint32_t> imm) {
    auto state = std::make_shared<Pending>();
    for (const auto& [member, src_offset, dst_offset, length] : targets) {
      state->targets.push_back({member, src_offset, dst_offset, length});
    }
    auto source = scatter_sources_.find(plan);
    py::tuple keep =
        source == scatter_sources_.end() ? py::tuple() : py::make_tuple(source->second);
    return Track(state, keep, engine().Scatter({plan, state->targets, imm}, Done(state)));
  }

  py::object Barrier(GroupId group, uint32_t imm) {
    auto state = std::make_shared<Pending>();
    return Track(state, py::tuple(), engine().Barrier(group, imm, Done(state)));
  }

  py::object WriteImm(PeerId peer, uint32_t imm) {
    auto state = std::make_shared<Pending>();
    return Track(state, py::tuple(), engine().WriteImm(peer, imm, Done(state)));
  }

  py::object Send(PeerId peer, const py::bytes& message) {
    auto state = std::make_shared<Pending>();
    return Track(state, py::tuple(), engine().Send(peer, BytesOf(message), Done(state)));
  }

  py::tuple Recv(double timeout) { return MessageTuple(messages_->PopForPython(timeout)); }
  py::list PollMessages() { return messages_->PopAllForPython(MessageTuple); }
  py::object MessageReady() { return py::cast(Transfer(messages_->Ready(), py::tuple())); }

  // MirrorImm into the first 8 bytes of `word` (a writable host array: a NumPy uint64, a
  // pinned torch tensor a CUDA kernel reads mapped); None stops it. The array stays referenced
  // while the engine may write it.
  void MirrorImm(uint32_t imm, const py::handle& word) {
    uint64_t* at = nullptr;
    py::object keep;
    if (!word.is_none()) {
      const Array array = ToArray(word);
      ThrowIfError(CheckArray(&array, {"mirror_imm: word", 8, true}, kHostMemory));
      at = static_cast<uint64_t*>(array.pointer());
      keep = array.owner;
    }
    TransferEngine& e = engine();
    Status s;
    {
      py::gil_scoped_release release;
      s = e.MirrorImm(imm, at);
    }
    // A wedged worker (DeadlineExceeded) may still take up the new word later, or keep the old:
    // both stay referenced.
    if (s.code() == StatusCode::kDeadlineExceeded && keep) mirrors_left_.push_back(keep);
    ThrowIfError(s);
    if (at) {
      mirrors_[imm] = std::move(keep);
    } else {
      mirrors_.erase(imm);
    }
  }

  // A Transfer that ends once imm's count reaches target (DeadlineExceeded at the timeout,
  // Cancelled by disarm_imm): wait_imm without a thread, for await and callbacks.
  py::object NotifyImm(uint32_t imm, uint64_t target, double timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    auto state = std::make_shared<Pending>();
    return Track(state, py::tuple(),
                 engine().NotifyImm(imm, target, deadline, Pending::Callback(state)));
  }

  void WaitImm(uint32_t imm, uint64_t target, double timeout) {
    const Deadline deadline = DeadlineIn(timeout);
    TransferEngine& e = engine();
    Status s;
    ++waiting_;  // close() refuses meanwhile (the GIL guards the count)
    {
      py::gil_scoped_release release;
      s = e.WaitImm(imm, target, deadline);
    }
    --waiting_;
    ThrowIfError(s);
  }

 private:
  static py::tuple MessageTuple(const Message& m) {
    const auto& [from, bytes] = m;
    return py::make_tuple(from ? py::cast(*from) : py::none(), ToBytes(bytes));
  }
  static Completion Done(const std::shared_ptr<Pending>& state) {
    return Completion::Callback(Pending::Callback(state));
  }

  // A submit that failed posted nothing: raise. Otherwise the Transfer stays in inflight_ (and
  // with it what it keeps) until seen done.
  py::object Track(const std::shared_ptr<Pending>& state, py::tuple keep, const Status& submitted) {
    ThrowIfError(submitted);
    std::erase_if(inflight_, [](const py::object& t) { return py::cast<Transfer&>(t).done(); });
    py::object transfer = py::cast(Transfer(state, std::move(keep)));
    inflight_.push_back(transfer);
    return transfer;
  }

  std::unique_ptr<TransferEngine> engine_;
  std::shared_ptr<MessageQueue> messages_;
  std::vector<py::object> inflight_;
  std::map<ScatterPlanId, py::object> scatter_sources_;
  std::map<uint32_t, py::object> mirrors_;  // mirror_imm's words, by counter
  std::vector<py::object> mirrors_left_;     // words a timed-out mirror_imm may have handed over
  int users_ = 0;    // AllToAll and KV objects using the engine (the GIL guards both counts)
  int waiting_ = 0;  // calls waiting with the GIL released
};

}  // namespace

// GpuWords: `host` and `device` are Arrays of the words owned by this object (whoever keeps one
// keeps the words); word(i) is word i alone as a host Array, for mirror_imm.
class Words {
 public:
  Words(int cuda_device, size_t count, bool gdrcopy)
      : words_(ValueOrThrow(GpuWords::Create(cuda_device, count, gdrcopy))) {}

  const GpuWords& words() const { return *words_; }
  static Array Host(const py::object& self) {
    const GpuWords& w = py::cast<const Words&>(self).words();
    return OwnedView(w.host_words(), w.size(), sizeof(uint64_t), kHostMemory, self);
  }
  static Array Device(const py::object& self) {
    const GpuWords& w = py::cast<const Words&>(self).words();
    return OwnedView(w.device_words(), w.size(), sizeof(uint64_t), w.cuda_device(), self);
  }
  static Array Word(const py::object& self, size_t i) {
    const GpuWords& w = py::cast<const Words&>(self).words();
    if (i >= w.size()) {
      ThrowIfError(InvalidArgumentError("GpuWords.word: word " + std::to_string(i) + " of " +
                                        std::to_string(w.size())));
    }
    return OwnedView(w.host_words() + i, 1, sizeof(uint64_t), kHostMemory, self);
  }

 private:
  std::unique_ptr<GpuWords> words_;
};

TransferEngine* AcquireEngine(const py::handle& engine) {
  if (engine.is_none()) return nullptr;
  if (!py::isinstance<Engine>(engine)) {
    ThrowIfError(InvalidArgumentError("engine must be a ferry.TransferEngine or None"));
  }
  return py::cast<Engine&>(engine).Acquire();
}

void ReleaseEngine(const py::handle& engine) {
  if (engine.is_none()) return;
  Engine& e = py::cast<Engine&>(engine);
  e.Release();
}

void BindFabric(py::module_& m) {
  py::class_<VerbsOptions>(m, "VerbsOptions",
                           "The verbs backend's settings (VerbsOptions in include/ferry/fabric.h)")
      .def(py::init([](const py::kwargs& f) { return WithFields(VerbsOptions{}, f); }),
           "The defaults, with any field given as a keyword argument")
      .def_readwrite("port", &VerbsOptions::port)
      .def_readwrite("gid_index", &VerbsOptions::gid_index)
      .def_readwrite("qkey", &VerbsOptions::qkey)
      .def_readwrite("psn", &VerbsOptions::psn)
      .def_readwrite("mtu_bytes", &VerbsOptions::mtu_bytes)
      .def_readwrite("timeout", &VerbsOptions::timeout)
      .def_readwrite("retry_count", &VerbsOptions::retry_count)
      .def_readwrite("rnr_retry", &VerbsOptions::rnr_retry)
      .def_readwrite("service_level", &VerbsOptions::service_level)
      .def_readwrite("traffic_class", &VerbsOptions::traffic_class)
      .def_readwrite("relaxed_ordering", &VerbsOptions::relaxed_ordering)
      .def_readwrite("max_unclaimed_peers", &VerbsOptions::max_unclaimed_peers)
      .def_readwrite("release_delay_ms", &VerbsOptions::release_delay_ms);

  py::class_<EngineOptions>(m, "EngineOptions",
                            "TransferEngine settings (EngineOptions in include/ferry/fabric.h)")
      .def(py::init([](const py::kwargs& f) { return WithFields(EngineOptions{}, f); }),
           "The defaults, with any field given as a keyword argument")
      .def_static(
          "from_env",
          [](const py::kwargs& f) { return WithFields(ValueOrThrow(EngineOptions::FromEnv()), f); },
          "Defaults overridden by the FERRY_* environment variables, then by any field "
          "given as a keyword argument")
      .def_readwrite("provider", &EngineOptions::provider)
      .def_readwrite("node", &EngineOptions::node)
      .def_readwrite("port", &EngineOptions::port)
      .def_readwrite("nics", &EngineOptions::nics)
      .def_readwrite("num_nics", &EngineOptions::num_nics)
      .def_readwrite("nic_shard_min_bytes", &EngineOptions::nic_shard_min_bytes)
      .def_readwrite("cuda_memory", &EngineOptions::cuda_memory)
      .def_readwrite("worker_cpu", &EngineOptions::worker_cpu)
      .def_readwrite("submit_queue_depth", &EngineOptions::submit_queue_depth)
      .def_readwrite("max_transfers", &EngineOptions::max_transfers)
      .def_readwrite("max_outstanding_wrs", &EngineOptions::max_outstanding_wrs)
      .def_readwrite("num_recv_buffers", &EngineOptions::num_recv_buffers)
      .def_readwrite("num_send_buffers", &EngineOptions::num_send_buffers)
      .def_readwrite("message_bytes", &EngineOptions::message_bytes)
      .def_readwrite("max_peers", &EngineOptions::max_peers)
      .def_readwrite("max_groups", &EngineOptions::max_groups)
      .def_readwrite("max_scatter_plans", &EngineOptions::max_scatter_plans)
      .def_readwrite("max_imm_counters", &EngineOptions::max_imm_counters)
      .def_readwrite("transfer_timeout_ms", &EngineOptions::transfer_timeout_ms)
      .def_readwrite("control_timeout_ms", &EngineOptions::control_timeout_ms)
      .def_readwrite("shutdown_timeout_ms", &EngineOptions::shutdown_timeout_ms)
      .def_readwrite("spin_us", &EngineOptions::spin_us)
      .def_readwrite("idle_yield_us", &EngineOptions::idle_yield_us)
      .def_readwrite("idle_sleep_us", &EngineOptions::idle_sleep_us)
      .def_readwrite("trust_write_order", &EngineOptions::trust_write_order)
      .def_readwrite("verbs", &EngineOptions::verbs);

  py::class_<FabricInfo>(m, "FabricInfo", "Provider facts the engine adapted to")
      .def_readonly("provider", &FabricInfo::provider)
      .def_readonly("domain", &FabricInfo::domain)
      .def_readonly("num_nics", &FabricInfo::num_nics)
      .def_readonly("virt_addr", &FabricInfo::virt_addr)
      .def_readonly("hmem", &FabricInfo::hmem)
      .def_readonly("cq_data_size", &FabricInfo::cq_data_size)
      .def_readonly("max_msg_size", &FabricInfo::max_msg_size)
      .def_readonly("ordered_write_bytes", &FabricInfo::ordered_write_bytes);

  py::class_<Words>(m, "GpuWords",
                    "64-bit words the host writes and CUDA kernels poll (mirror_imm's words): in "
                    "the GPU's memory through GDRCopy where it is there, else pinned host memory "
                    "mapped into the GPU. Zeroed")
      .def(py::init<int, size_t, bool>(), py::arg("cuda_device"), py::arg("count"),
           py::arg("gdrcopy") = true,
           "count (1 to 8192) words for kernels on cuda_device; gdrcopy=False keeps them in "
           "host memory")
      .def_property_readonly("size", [](const Words& w) { return w.words().size(); })
      .def_property_readonly("cuda_device", [](const Words& w) { return w.words().cuda_device(); })
      .def_property_readonly(
          "placement",
          [](const Words& w) {
            return w.words().placement() == GpuWords::Placement::kGpuMemory ? "gpu_memory"
                                                                            : "mapped_host";
          },
          "'gpu_memory' (GDRCopy) or 'mapped_host'")
      .def_property_readonly(
          "gdrcopy_status", [](const Words& w) { return w.words().gdrcopy_status(); },
          "Why the words are not in GPU memory; '' when they are")
      .def_property_readonly("host", &Words::Host,
                             "The words as the host writes them: a uint64 ferry.Array")
      .def_property_readonly("device", &Words::Device,
                             "The words as kernels read them: a uint64 ferry.Array on "
                             "cuda_device (__cuda_array_interface__)")
      .def("word", &Words::Word, py::arg("i"), "Word i alone as a host ferry.Array (mirror_imm)")
      .def(
          "load", [](const Words& w, size_t i) { return ValueOrThrow(w.words().Load(i)); },
          py::arg("i"), "Word i as the host reads it now");
  py::class_<RemoteRegion>(m, "RemoteRegion",
                           "A peer's registered region, parsed once from its descriptor bytes")
      .def_static(
          "parse", [](const py::bytes& b) { return ToRemote(b); }, py::arg("descriptor"))
      .def_readonly("length", &RemoteRegion::length)
      .def_readonly("engine_id", &RemoteRegion::engine_id)
      .def("serialize", [](const RemoteRegion& r) { return ToBytes(r.Serialize()); });

  py::class_<Region>(m, "Region", "A registered array; deregistered when dropped")
      .def_property_readonly(
          "descriptor", [](const Region& r) { return ToBytes(r.region.remote().Serialize()); },
          "Bytes a peer passes as dst (RemoteRegion.parse)")
      .def_property_readonly("length", [](const Region& r) { return r.region.length(); })
      .def_property_readonly("device", [](const Region& r) { return r.array.device; })
      .def_property_readonly("array", [](const Region& r) { return r.array.owner; });

  py::class_<Transfer>(m, "Transfer", "A submitted transfer")
      .def_property_readonly("done", &Transfer::done)
      .def_property_readonly("error", &Transfer::Error,
                             "The ferry.Error it ended with; None while in flight or after success")
      .def_property_readonly("ended_at", &Transfer::ended_at,
                             "When it ended, in time.time()'s seconds (taken as it ended, not "
                             "when Python heard of it); None while in flight")
      .def("wait", &Transfer::Wait, py::arg("timeout") = 30.0,
           "Returns once the transfer ended well; raises its error, or DeadlineExceeded")
      .def("add_done_callback", &Transfer::AddDoneCallback, py::arg("fn"),
           "fn(transfer) once it has ended: at once if it has, else on ferry's callback thread")
      .def("__await__", [](const py::object& self) {
        return py::module_::import("ferry._async")
            .attr("transfer_future")(self)
            .attr("__await__")();
      });

  BindClose(
      py::class_<Engine>(m, "TransferEngine",
                         "One-sided writes and two-sided messages over libfabric or verbs; every "
                         "method may be called from any thread"))
      .def(py::init([](std::optional<EngineOptions> options) {
             return std::make_unique<Engine>(options ? *options
                                                     : ValueOrThrow(EngineOptions::FromEnv()));
           }),
           py::arg("options") = py::none())
      .def_property_readonly(
          "info", [](Engine& e) { return e.engine().info(); },
          "What the provider offers (ferry.FabricInfo)")
      .def_property_readonly(
          "id", [](Engine& e) { return e.engine().id(); }, "This engine's id (in descriptors)")
      .def_property_readonly(
          "address", [](Engine& e) { return ToBytes(e.engine().Address()); },
          "Bytes a peer passes to add_peer")
      .def("register", &Engine::Register, py::arg("array"),
           "Registers an array (host, or CUDA with options.cuda_memory); the Region keeps it")
      .def(
          "add_peer",
          [](Engine& e, const py::bytes& address) {
            return ValueOrThrow(e.engine().AddPeer(BytesOf(address)));
          },
          py::arg("address"), "The peer at `address` (a peer's engine.address): its id")
      .def(
          "remove_peer", [](Engine& e, PeerId p) { ThrowIfError(e.engine().RemovePeer(p)); },
          py::arg("peer"),
          "Forgets a peer: its pending transfers fail with Unavailable, later submits are refused")
      .def(
          "peer_lost", [](Engine& e, PeerId p) { return ValueOrThrow(e.engine().PeerLost(p)); },
          py::arg("peer"),
          "Whether the peer is lost (a transfer to it outlived its deadline, or remove_peer): "
          "later submits to it fail; add it again once it is back")
      .def(
          "add_peer_group",
          [](Engine& e, const std::vector<PeerId>& members) {
            return ValueOrThrow(e.engine().AddPeerGroup(members));
          },
          py::arg("members"), "A group of peers (ids) for prepare_scatter and barrier: its id")
      .def("write", &Engine::Write, py::arg("src"), py::arg("peer"), py::arg("dst"),
           py::arg("src_offset") = 0, py::arg("dst_offset") = 0, py::arg("length") = py::none(),
           py::arg("imm") = py::none(),
           "Writes src[src_offset:src_offset+length] (default: the rest of src) into dst at "
           "dst_offset; imm is counted by the peer once the bytes landed")
      .def("write_paged", &Engine::WritePaged, py::arg("src"), py::arg("peer"), py::arg("dst"),
           py::arg("page_bytes"), py::arg("src_pages"), py::arg("dst_pages"),
           py::arg("src_stride") = py::none(), py::arg("dst_stride") = py::none(),
           py::arg("src_offset") = 0, py::arg("dst_offset") = 0, py::arg("imm") = py::none(),
           py::arg("imm_once") = false, py::arg("imm_weight_mask") = 0,
           "Page i from src_offset + src_pages[i] * src_stride to dst_offset + dst_pages[i] * "
           "dst_stride, page_bytes long (strides default to page_bytes). imm: counted once per "
           "page, or with imm_once once per NIC weighted by its pages (a counter made with "
           "create_imm_counter(imm, weight_mask=imm_weight_mask) then counts every page)")
      .def("prepare_scatter", &Engine::PrepareScatter, py::arg("group"), py::arg("src"),
           py::arg("dst"),
           "A scatter plan from the Region src to dst[i] (descriptors) of the group's member i, "
           "built once and used by scatter()")
      .def("scatter", &Engine::Scatter, py::arg("plan"), py::arg("targets"),
           py::arg("imm") = py::none(), "targets: (member, src_offset, dst_offset, length) tuples")
      .def("barrier", &Engine::Barrier, py::arg("group"), py::arg("imm"),
           "An immediate to every member of the group (a ferry.Transfer)")
      .def("write_imm", &Engine::WriteImm, py::arg("peer"), py::arg("imm"),
           "An immediate alone (a ferry.Transfer)")
      .def("send", &Engine::Send, py::arg("peer"), py::arg("message"),
           "A message (bytes, at most options.message_bytes) the peer takes with recv()")
      .def("recv", &Engine::Recv, py::arg("timeout") = 30.0,
           "(peer or None, bytes) of the next message received")
      .def("poll_messages", &Engine::PollMessages,
           "Every message received and not yet taken, as recv gives them, without waiting")
      .def("message_ready", &Engine::MessageReady,
           "A ferry.Transfer that ends once a message waits to be taken (at once if one does; "
           "Cancelled when the engine closes): `await engine.message_ready()`, then "
           "poll_messages(). Messages a KV role takes never count")
      .def(
          "create_imm_counter",
          [](Engine& e, uint32_t imm, uint32_t weight_mask) {
            ThrowIfError(weight_mask ? e.engine().CreateWeightedImmCounter(imm, weight_mask)
                                     : e.engine().CreateImmCounter(imm));
          },
          py::arg("imm"), py::arg("weight_mask") = 0,
          "Counts the immediates `imm` that arrive; with weight_mask, also those carrying a "
          "weight in weight_mask's bits (write_paged's imm_once)")
      .def(
          "imm_count",
          [](Engine& e, uint32_t imm) { return ValueOrThrow(e.engine().ImmCount(imm)); },
          py::arg("imm"), "Immediates `imm` counted so far (less those consumed)")
      .def("wait_imm", &Engine::WaitImm, py::arg("imm"), py::arg("target"),
           py::arg("timeout") = 30.0,
           "Returns once imm_count(imm) reaches target (GIL released); DeadlineExceeded after "
           "timeout seconds")
      .def("notify_imm", &Engine::NotifyImm, py::arg("imm"), py::arg("target"),
           py::arg("timeout") = 30.0,
           "A ferry.Transfer that ends once imm_count(imm) reaches target (DeadlineExceeded "
           "after timeout seconds, Cancelled by disarm_imm): await it, or add callbacks. One "
           "armed per counter at a time")
      .def("mirror_imm", &Engine::MirrorImm, py::arg("imm"), py::arg("word"),
           "Keeps the counter's total (every arrival, weighted; consume_imm does not lower it) in "
           "the first 8 bytes of `word`, a writable 8-byte aligned host array -- a "
           "ferry.GpuWords word(i), which a CUDA kernel polls -- updated after each arrival; "
           "None stops it")
      .def(
          "disarm_imm", [](Engine& e, uint32_t imm) { ThrowIfError(e.engine().DisarmImm(imm)); },
          py::arg("imm"), "Ends the counter's armed notify_imm, if any, with Cancelled")
      .def(
          "consume_imm",
          [](Engine& e, uint32_t imm, uint64_t n) { ThrowIfError(e.engine().ConsumeImm(imm, n)); },
          py::arg("imm"), py::arg("n"),
          "Subtracts n from the count for the next round; FailedPrecondition if fewer arrived")
      .def(
          "stats",
          [](Engine& e) {
            const EngineStats s = e.engine().stats();
            py::dict d;
            d["transfers_submitted"] = s.transfers_submitted;
            d["transfers_completed"] = s.transfers_completed;
            d["transfers_failed"] = s.transfers_failed;
            d["wrs_posted"] = s.wrs_posted;
            d["post_retries"] = s.post_retries;
            d["imm_waits"] = s.imm_waits;
            d["imms_received"] = s.imms_received;
            d["imms_unmatched"] = s.imms_unmatched;
            d["messages_received"] = s.messages_received;
            d["worker_cpu_ns"] = s.worker_cpu_ns;
            return d;
          },
          "The engine's counters (transfers, work requests, immediates, messages, worker CPU)");
}

}  // namespace ferry::python
