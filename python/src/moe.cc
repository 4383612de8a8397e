// AllToAll bindings. Each step checks its arrays against the configuration (size, element type,
// host or the configured GPU, writable outputs) before a pointer reaches the core, and runs with
// the GIL released. With a stream set (CUDA), steps return once enqueued: the arrays of every
// step enqueued since the last synchronize() stay referenced until it returns.
#include "ferry/moe.h"

#include <pybind11/stl.h>

#include "binding.h"

namespace ferry::python {
namespace {

class PyAllToAll {
 public:
  PyAllToAll(const AllToAllConfig& config, py::object engine, Bootstrap& bootstrap)
      : engine_(std::move(engine)) {
    TransferEngine* e = AcquireEngine(engine_);
    StatusOr<std::unique_ptr<AllToAll>> created = [&] {
      py::gil_scoped_release release;
      return AllToAll::Create(config, e, bootstrap);
    }();
    if (!created.ok()) ReleaseEngine(engine_);
    a2a_ = ValueOrThrow(std::move(created));
    output_rows_ = OutputRows(a2a_->config());
  }
  ~PyAllToAll() { Close(); }

  // Refused while a step runs on another thread (it has released the GIL); the destructor
  // cannot meet one (a running step holds a reference to this object).
  void Close() {
    if (busy_ > 0) {
      ThrowIfError(FailedPreconditionError("AllToAll.close: a step is running on another thread"));
    }
    if (!a2a_) return;
    {
      py::gil_scoped_release release;
      a2a_.reset();
    }
    ReleaseEngine(engine_);
    keep_.clear();
  }

  const AllToAllConfig& config() const { return a2a().config(); }

  void DispatchSend(const py::handle& x, const py::handle& indices, const py::handle& weights,
                    const py::handle& scales, std::optional<int> num_tokens,
                    const py::handle& device_num_tokens, Fp8Scaling scaling) {
    const AllToAllConfig& c = config();
    const Array xa = ToArray(x);
    if (!num_tokens && xa.rows() < 0) {
      ThrowIfError(InvalidArgumentError("dispatch_send: num_tokens is required with a flat x"));
    }
    const int64_t tokens = num_tokens ? *num_tokens : xa.rows();
    // The core checks this too, but the array sizes below follow from it.
    if (tokens < 0 || tokens > c.max_tokens_per_rank) {
      ThrowIfError(InvalidArgumentError("dispatch_send: " + std::to_string(tokens) +
                                        " tokens, configured maximum " +
                                        std::to_string(c.max_tokens_per_rank)));
    }
    const uint64_t copies = static_cast<uint64_t>(tokens) * c.experts_per_token;
    const Array ia = ToArray(indices), wa = ToArray(weights);
    // An fp8 AllToAll given bf16 rows (2-byte elements) and no scales quantises them itself.
    const bool quantize = c.dtype == DispatchDtype::kFp8E4M3 && xa.item_bytes == 2 &&
                          scales.is_none();
    Check(&xa, {"x", tokens * static_cast<uint64_t>(c.hidden) * (quantize ? 2 : ItemBytes(c)),
                false, 0, quantize ? 2 : ItemBytes(c)});
    Check(&wa, {"weights", copies * 4, false, 'f', 4});
    DispatchInput in;
    if (quantize) {
      in.x_bf16 = static_cast<const uint16_t*>(xa.pointer());
      in.scaling = scaling;
    } else {
      in.x = xa.pointer();
    }
    Indices(ia, copies, in);
    in.weights = static_cast<const float*>(wa.pointer());
    in.num_tokens = static_cast<int>(tokens);
    Owners used{xa.owner, ia.owner, wa.owner};
    if (auto sa = Optional(scales, "scales", c.scales_per_token() > 0 && !quantize)) {
      Check(&*sa,
            {"scales", tokens * static_cast<uint64_t>(c.scales_per_token()) * 4, false, 'f', 4});
      in.scales = static_cast<const float*>(sa->pointer());
      used.push_back(sa->owner);
    }
    if (!device_num_tokens.is_none()) {
      const Array da = ToArray(device_num_tokens);
      Check(&da, {"device_num_tokens", 4, false, 'i', 4});
      in.device_num_tokens = static_cast<const int32_t*>(da.pointer());
      used.push_back(da.owner);
    }
    Run(std::move(used), [&](AllToAll& a) { return a.DispatchSend(in); });
    last_tokens_ = tokens;
  }

  void DispatchRecv(const py::handle& x, const py::handle& num_tokens, const py::handle& scales,
                    const py::handle& num_rows, const py::handle& token_experts,
                    const py::handle& token_weights, double timeout, int expert_padding) {
    const AllToAllConfig& c = config();
    const Deadline deadline = DeadlineIn(timeout);
    const bool token_major = c.dispatch_layout == DispatchLayout::kTokenMajor;
    // A padding the layout cannot take is the core's to refuse (CheckDispatchOutput); the
    // sizes here follow from one it can.
    const uint64_t rows =
        expert_padding > 0 && !token_major ? c.padded_rows(expert_padding) : OutputRows(c);
    const Array xa = ToArray(x), na = ToArray(num_tokens);
    Check(&xa, {"x", rows * c.token_bytes(), true, 0, ItemBytes(c)});
    Check(&na, {"num_tokens", static_cast<uint64_t>(c.local_experts()) * 4, true, 'i', 4});
    DispatchOutput out;
    out.x = xa.pointer();
    out.num_tokens = static_cast<int32_t*>(na.pointer());
    out.expert_padding = expert_padding;
    Owners used{xa.owner, na.owner};
    if (auto sa = Optional(scales, "scales", c.scales_per_token() > 0)) {
      Check(&*sa, {"scales", rows * c.scales_per_token() * 4, true, 'f', 4});
      out.scales = static_cast<float*>(sa->pointer());
      used.push_back(sa->owner);
    }
    const uint64_t entries = static_cast<uint64_t>(c.expert_capacity()) * c.experts_per_token;
    auto ra = Optional(num_rows, "num_rows", token_major);
    auto ea = Optional(token_experts, "token_experts", token_major);
    auto wa = Optional(token_weights, "token_weights", token_major);
    if (token_major) {
      Check(&*ra, {"num_rows", 4, true, 'i', 4});
      Check(&*ea, {"token_experts", entries * 4, true, 'i', 4});
      Check(&*wa, {"token_weights", entries * 4, true, 'f', 4});
      out.num_rows = static_cast<int32_t*>(ra->pointer());
      out.token_experts = static_cast<int32_t*>(ea->pointer());
      out.token_weights = static_cast<float*>(wa->pointer());
      used.insert(used.end(), {ra->owner, ea->owner, wa->owner});
    }
    Run(std::move(used), [&](AllToAll& a) { return a.DispatchRecv(out, deadline); });
    // The rows received, where the host can read them (the CUDA device's count is on the GPU).
    received_rows_ = token_major && c.device == MoeDeviceKind::kHost ? *out.num_rows : -1;
    output_rows_ = rows;
  }

  void CombineSend(const py::handle& expert_out, std::optional<int64_t> num_rows) {
    const AllToAllConfig& c = config();
    const Array ea = ToArray(expert_out);
    uint64_t rows = output_rows_;  // as the last dispatch_recv laid them out
    if (num_rows) {
      // Token-major: the caller's rows may stop at those received (the step reads no more).
      if (c.dispatch_layout != DispatchLayout::kTokenMajor) {
        ThrowIfError(InvalidArgumentError("combine_send: num_rows is for the token-major layout"));
      }
      if (*num_rows < 0 || *num_rows > c.expert_capacity() ||
          (received_rows_ >= 0 && *num_rows < received_rows_)) {
        ThrowIfError(InvalidArgumentError(
            "combine_send: num_rows " + std::to_string(*num_rows) + ", dispatch_recv wrote " +
            (received_rows_ >= 0 ? std::to_string(received_rows_) : std::string("its num_rows")) +
            " (at most " + std::to_string(c.expert_capacity()) + ")"));
      }
      rows = static_cast<uint64_t>(*num_rows);
    }
    Check(&ea, {"expert_out", rows * c.hidden * 2, false, 0, 2});
    Run({ea.owner},
        [&](AllToAll& a) { return a.CombineSend(static_cast<const uint16_t*>(ea.pointer())); });
  }

  void CombineRecv(const py::handle& out, bool accumulate, double timeout,
                   const py::handle& weights) {
    const AllToAllConfig& c = config();
    const Deadline deadline = DeadlineIn(timeout);
    const Array oa = ToArray(out);
    Check(&oa, {"out", static_cast<uint64_t>(last_tokens_) * c.hidden * 2, true, 0, 2});
    CombineOutput to{static_cast<uint16_t*>(oa.pointer()), accumulate};
    Owners used{oa.owner};
    if (!weights.is_none()) {
      const Array wa = ToArray(weights);
      Check(&wa, {"weights", static_cast<uint64_t>(last_tokens_) * c.experts_per_token * 4, false,
                  'f', 4});
      to.weights = static_cast<const float*>(wa.pointer());
      used.push_back(wa.owner);
    }
    Run(std::move(used), [&](AllToAll& a) { return a.CombineRecv(to, deadline); });
  }

  // What ferry.deep_ep and ferry.pplx call once per call: the halves `halves` names (1 the
  // send, 2 the receive, 3 both, in that order) with the arguments dispatch_send and
  // dispatch_recv take. With `stream` (CUDA: a cudaStream_t as an int, 0 the legacy default
  // one) the steps start after what it holds (with `stream_first`) and it waits for them (with
  // `stream_waits`); the arrays of the steps finished before these are let go first, without
  // waiting (ReleaseFinished). One call instead of four: each call from Python costs
  // microseconds (argument conversion, the GIL).
  void Dispatch(const py::handle& x, const py::handle& indices, const py::handle& weights,
                const py::handle& scales, std::optional<int> num_tokens,
                const py::handle& device_num_tokens, Fp8Scaling scaling,
                const py::handle& out_x, const py::handle& out_num_tokens,
                const py::handle& out_scales, double timeout, int expert_padding,
                const py::handle& stream, int halves, bool stream_first, bool stream_waits) {
    Halves(halves, "dispatch");
    Ordered(stream, stream_first, stream_waits, [&] {
      if (halves & kSendHalf) {
        DispatchSend(x, indices, weights, scales, num_tokens, device_num_tokens, scaling);
      }
      if (halves & kReceiveHalf) {
        DispatchRecv(out_x, out_num_tokens, out_scales, py::none(), py::none(), py::none(),
                     timeout, expert_padding);
      }
    });
  }

  // combine_send and combine_recv as Dispatch runs dispatch's.
  void Combine(const py::handle& expert_out, const py::handle& out, const py::handle& weights,
               bool accumulate, double timeout, const py::handle& stream, int halves,
               bool stream_first, bool stream_waits) {
    Halves(halves, "combine");
    Ordered(stream, stream_first, stream_waits, [&] {
      if (halves & kSendHalf) CombineSend(expert_out, std::nullopt);
      if (halves & kReceiveHalf) CombineRecv(out, accumulate, timeout, weights);
    });
  }

  void SetStream(const py::handle& stream) {
    void* s = nullptr;
    if (!stream.is_none()) {
      s = StreamHandle(stream);
      // Handle 0 is the legacy default stream (torch's current stream unless one was set): taken
      // as "no stream" the steps would go back to waiting, unordered with the caller's kernels
      // on that stream, and read inputs not yet written.
      if (s == nullptr) {
        ThrowIfError(InvalidArgumentError(
            "set_stream: stream handle 0 (the legacy default stream) cannot order the steps; "
            "pass a stream of your own (torch.cuda.Stream()), or None to wait"));
      }
    }
    ThrowIfError(a2a().SetStream(s));
    streamed_ = s != nullptr;
  }

  // OrderAfter / OrderBefore with a stream as set_stream takes one (0, the legacy default
  // stream, allowed: it is only ordered against).
  void Order(const py::handle& stream, bool after) {
    void* s = StreamHandle(stream);
    ThrowIfError(after ? a2a().OrderAfter(s) : a2a().OrderBefore(s));
  }

  void Synchronize() {
    const Status s = Unlocked([](AllToAll& a) { return a.Synchronize(); });
    keep_.clear();
    ThrowIfError(s);
  }

  // Without waiting: true (and the arrays released, the kernels' findings raised) when every
  // step enqueued so far has finished.
  bool Poll() {
    bool done = false;
    const Status s = Unlocked([&](AllToAll& a) { return a.Poll(&done); });
    if (done) keep_.clear();
    ThrowIfError(s);
    return done;
  }
  size_t pending() const { return keep_.size(); }

  // The arrays of the steps finished so far let go and their kernels' findings raised, without
  // waiting while fewer than kMaxPendingArrays are held (then it waits for every step). Never
  // while `stream` (a caller's, None: ours) or the AllToAll's own is being captured: a query
  // would end the capture, and the captured arrays are the graph owner's to keep.
  void ReleaseFinished(const py::handle& stream) {
    if (!streamed_ || keep_.empty()) return;
    if (a2a().capturing(stream.is_none() ? nullptr : StreamHandle(stream))) return;
    if (!Poll() && keep_.size() > kMaxPendingArrays) Synchronize();
  }

  uint64_t dispatch_bytes_sent() const { return a2a().dispatch_bytes_sent(); }
  uint64_t combine_bytes_sent() const { return a2a().combine_bytes_sent(); }

 private:
  // An int (a cudaStream_t's address), or a stream object that carries one: torch's
  // .cuda_stream, CuPy's .ptr.
  static void* StreamHandle(const py::handle& stream) {
    if (PyLong_Check(stream.ptr())) {
      return reinterpret_cast<void*>(static_cast<uintptr_t>(py::cast<uint64_t>(stream)));
    }
    py::object handle = py::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream")
                        : py::hasattr(stream, "ptr")       ? stream.attr("ptr")
                                                     : py::reinterpret_borrow<py::object>(stream);
    return reinterpret_cast<void*>(static_cast<uintptr_t>(py::cast<uint64_t>(handle)));
  }
  static constexpr int kSendHalf = 1, kReceiveHalf = 2;
  static void Halves(int halves, const char* call) {
    if (halves < 1 || halves > 3) {
      ThrowIfError(InvalidArgumentError(std::string(call) + ": halves " + std::to_string(halves) +
                                        ", 1 (send), 2 (receive) or 3 (both)"));
    }
  }
  // Arrays of enqueued steps kept before a layer's call waits for them: a few rounds' worth (a
  // CPU that runs ahead of the GPU keeps them referenced until their steps finish).
  static constexpr size_t kMaxPendingArrays = 64;
  // steps() after `stream` (with `first`) and before it (with `waits`; None: unordered), the
  // arrays of the steps finished before them let go first (ReleaseFinished).
  template <typename Steps>
  void Ordered(const py::handle& stream, bool first, bool waits, Steps steps) {
    ReleaseFinished(stream);
    const bool ordered = !stream.is_none();
    void* s = ordered ? StreamHandle(stream) : nullptr;
    if (ordered && first) ThrowIfError(a2a().OrderAfter(s));
    steps();
    if (ordered && waits) ThrowIfError(a2a().OrderBefore(s));
  }
  AllToAll& a2a() const {
    if (!a2a_) ThrowIfError(FailedPreconditionError("the AllToAll is closed"));
    return *a2a_;
  }
  int Device(const AllToAllConfig& c) const {
    return c.device == MoeDeviceKind::kHost ? kHostMemory : c.cuda_device;
  }
  // Rows of DispatchRecv's output, and so of CombineSend's input.
  static uint64_t OutputRows(const AllToAllConfig& c) {
    const bool token_major = c.dispatch_layout == DispatchLayout::kTokenMajor;
    return static_cast<uint64_t>(c.expert_capacity()) *
           (token_major ? 1 : static_cast<uint64_t>(c.local_experts()));
  }
  static int ItemBytes(const AllToAllConfig& c) { return c.dtype == DispatchDtype::kBf16 ? 2 : 1; }
  // The expert ids into `in`: int32 as they are, uint32 as the same bits (an id >= 2^31 is
  // then negative: -1 for 0xFFFFFFFF, a bad id otherwise), int64 (torch.topk's) as indices64,
  // narrowed by the core (on the CUDA device by a kernel on the step's stream).
  void Indices(const Array& ia, uint64_t copies, DispatchInput& in) const {
    if (ia.kind == 'i' && ia.item_bytes == 8) {
      Check(&ia, {"indices", copies * 8, false, 'i', 8});
      in.indices64 = static_cast<const int64_t*>(ia.pointer());
      return;
    }
    const char kind = ia.kind == 'u' && ia.item_bytes == 4 ? 'u' : 'i';
    Check(&ia, {"indices", copies * 4, false, kind, 4});  // names what it is and what we take
    in.indices = static_cast<const int32_t*>(ia.pointer());
  }
  void Check(const Array* array, const ArrayNeed& need) const {
    ThrowIfError(CheckArray(array, need, Device(config())));
  }
  // An optional argument: None where not `wanted` (else InvalidArgument: the configuration has
  // no use for it), an Array where wanted (else InvalidArgument: required).
  std::optional<Array> Optional(const py::handle& object, const char* name, bool wanted) const {
    if (object.is_none()) {
      if (wanted) ThrowIfError(InvalidArgumentError(std::string(name) + ": required"));
      return std::nullopt;
    }
    if (!wanted) {
      ThrowIfError(InvalidArgumentError(std::string(name) + ": this configuration takes none (" +
                                        config().ToString() + ")"));
    }
    return ToArray(object);
  }
  // The arrays a step reads or writes (their owners).
  using Owners = std::vector<py::object>;
  // step(AllToAll&) with the GIL released.
  template <typename Step>
  Status Unlocked(Step step) {
    AllToAll& a = a2a();
    Status s;
    ++busy_;
    {
      py::gil_scoped_release release;
      s = step(a);
    }
    --busy_;
    return s;
  }
  // A step that waits for itself is done with its arrays when it returns (the caller's
  // arguments hold them meanwhile); a step enqueued on a stream keeps them until synchronize().
  template <typename Step>
  void Run(Owners used, Step step) {
    if (streamed_) keep_.insert(keep_.end(), used.begin(), used.end());
    ThrowIfError(Unlocked(step));
  }

  py::object engine_;
  std::unique_ptr<AllToAll> a2a_;
  std::vector<py::object> keep_;
  int64_t last_tokens_ = 0;
  int64_t received_rows_ = -1;  // token-major rows of the last dispatch_recv; -1: not known here
  uint64_t output_rows_ = 0;    // rows the last dispatch_recv's x held (its padding's)
  bool streamed_ = false;
  int busy_ = 0;  // steps running with the GIL released (the GIL guards the count)
};

}  // namespace

void BindMoe(py::module_& m) {
  py::enum_<DispatchDtype>(m, "DispatchDtype")
      .value("BF16", DispatchDtype::kBf16)
      .value("FP8_E4M3", DispatchDtype::kFp8E4M3);
  py::enum_<Fp8Scaling>(m, "Fp8Scaling", "How dispatch_send makes fp8 from bf16 rows")
      .value("AMAX", Fp8Scaling::kAmax)
      .value("POWER_OF_TWO", Fp8Scaling::kPowerOfTwo);
  py::enum_<MoeDeviceKind>(m, "MoeDevice")
      .value("HOST", MoeDeviceKind::kHost)
      .value("CUDA", MoeDeviceKind::kCuda);
  py::enum_<DispatchLayout>(m, "DispatchLayout")
      .value("EXPERT_MAJOR", DispatchLayout::kExpertMajor)
      .value("TOKEN_MAJOR", DispatchLayout::kTokenMajor);
  py::enum_<RdmaBuffers>(m, "RdmaBuffers")
      .value("AUTO", RdmaBuffers::kAuto)
      .value("HOST", RdmaBuffers::kHost)
      .value("DEVICE", RdmaBuffers::kDevice);

  py::class_<CudaTuning>(m, "CudaTuning",
                         "How the CUDA device schedules its kernels (CudaTuning in "
                         "include/ferry/moe.h); changes no result")
      .def(py::init([](const py::kwargs& f) { return WithFields(CudaTuning{}, f); }))
      .def_readwrite("stream", &CudaTuning::stream)
      .def_readwrite("early_receive", &CudaTuning::early_receive)
      .def_readwrite("spread", &CudaTuning::spread)
      .def_readwrite("trace", &CudaTuning::trace)
      .def_readwrite("relay_trace", &CudaTuning::relay_trace)
      .def_static("from_env", [] { return ValueOrThrow(CudaTuning::FromEnv()); },
                  "The defaults with FERRY_NV_STREAM, FERRY_NV_PDL, FERRY_NV_SPREAD, "
                  "FERRY_NV_TRACE and FERRY_RELAY_TRACE applied where set");

  py::class_<AllToAllConfig>(m, "AllToAllConfig",
                             "What an AllToAll moves (AllToAllConfig in include/ferry/moe.h)")
      .def(py::init([](const py::kwargs& f) { return WithFields(AllToAllConfig{}, f); }))
      .def_readwrite("world_size", &AllToAllConfig::world_size)
      .def_readwrite("rank", &AllToAllConfig::rank)
      .def_readwrite("ranks_per_node", &AllToAllConfig::ranks_per_node)
      .def_readwrite("instance", &AllToAllConfig::instance)
      .def_readwrite("num_experts", &AllToAllConfig::num_experts)
      .def_readwrite("experts_per_token", &AllToAllConfig::experts_per_token)
      .def_readwrite("max_tokens_per_rank", &AllToAllConfig::max_tokens_per_rank)
      .def_readwrite("hidden", &AllToAllConfig::hidden)
      .def_readwrite("dtype", &AllToAllConfig::dtype)
      .def_readwrite("max_private_tokens", &AllToAllConfig::max_private_tokens)
      .def_readwrite("dispatch_once_per_rank", &AllToAllConfig::dispatch_once_per_rank)
      .def_readwrite("combine_reduce_at_expert_rank",
                     &AllToAllConfig::combine_reduce_at_expert_rank)
      .def_readwrite("dispatch_layout", &AllToAllConfig::dispatch_layout)
      .def_readwrite("device", &AllToAllConfig::device)
      .def_readwrite("cuda_device", &AllToAllConfig::cuda_device)
      .def_readwrite("rdma_buffers", &AllToAllConfig::rdma_buffers)
      .def_readwrite("cuda", &AllToAllConfig::cuda)
      .def("validate", [](const AllToAllConfig& c) { ThrowIfError(c.Validate()); })
      .def_property_readonly("local_experts", &AllToAllConfig::local_experts)
      .def_property_readonly("token_bytes", &AllToAllConfig::token_bytes)
      .def_property_readonly("scales_per_token", &AllToAllConfig::scales_per_token)
      .def_property_readonly("expert_capacity", &AllToAllConfig::expert_capacity)
      .def("padded_rows", &AllToAllConfig::padded_rows, py::arg("expert_padding"),
           "Rows of the expert-major output with that expert padding")
      .def("__repr__", &AllToAllConfig::ToString);

  BindClose(py::class_<PyAllToAll>(
                m, "AllToAll",
                "Expert-parallel dispatch and combine, each a send and a receive half; "
                "one thread drives an AllToAll"))
      .def(py::init<const AllToAllConfig&, py::object, Bootstrap&>(), py::arg("config"),
           py::arg("engine"), py::arg("bootstrap"),
           "Collective: every rank with the same config (its own rank); engine may be None on "
           "the CUDA device with one node")
      .def_property_readonly(  // a copy: the AllToAll's own goes with it at close()
          "config", [](const PyAllToAll& a) { return AllToAllConfig(a.config()); })
      .def("dispatch_send", &PyAllToAll::DispatchSend, py::arg("x"), py::arg("indices"),
           py::arg("weights"), py::arg("scales") = py::none(), py::arg("num_tokens") = py::none(),
           py::arg("device_num_tokens") = py::none(), py::arg("scaling") = Fp8Scaling::kAmax,
           "x [T, hidden] (bf16 as 2-byte or fp8 as 1-byte elements), indices [T, k] int32, "
           "int64 or uint32 (-1: no expert), weights [T, k] "
           "float32, scales [T, hidden/128] float32 (fp8); T = num_tokens or x's first "
           "dimension (num_tokens is required for a flat x). An fp8 AllToAll given bf16 x and "
           "no scales quantises x as it sends, its scales as `scaling` says (Fp8Scaling)")
      .def("dispatch_recv", &PyAllToAll::DispatchRecv, py::arg("x"), py::arg("num_tokens"),
           py::arg("scales") = py::none(), py::arg("num_rows") = py::none(),
           py::arg("token_experts") = py::none(), py::arg("token_weights") = py::none(),
           py::arg("timeout") = 30.0, py::arg("expert_padding") = 0,
           "Expert-major: x [local_experts, expert_capacity, hidden], num_tokens [local_experts] "
           "int32 (copies per expert); with expert_padding p the experts' blocks back to back "
           "in x's config.padded_rows(p) rows, each rounded up to p rows; token-major also "
           "num_rows [1], token_experts and token_weights [expert_capacity, k]; scales as x's "
           "rows (fp8). Peers' data is checked before it is used (DataLoss naming the sender)")
      .def("combine_send", &PyAllToAll::CombineSend, py::arg("expert_out"),
           py::arg("num_rows") = py::none(),
           "expert_out: bf16 rows as dispatch_recv laid them out (token-major: one per row, "
           "its experts' outputs already weighted and summed; num_rows: expert_out holds only "
           "that many, at least the rows received)")
      .def("combine_recv", &PyAllToAll::CombineRecv, py::arg("out"), py::arg("accumulate") = false,
           py::arg("timeout") = 30.0, py::arg("weights") = py::none(),
           "out [T, hidden] bf16 for the T of the last dispatch_send: each token's weighted sum "
           "(added to out with accumulate); weights [T, k] float32: the combine weights given "
           "now instead of dispatch_send's (not with combine_reduce_at_expert_rank)")
      .def("dispatch", &PyAllToAll::Dispatch, py::arg("x"), py::arg("indices"),
           py::arg("weights"), py::arg("scales"), py::arg("num_tokens"),
           py::arg("device_num_tokens"), py::arg("scaling"), py::arg("out_x"),
           py::arg("out_num_tokens"), py::arg("out_scales"),
           py::arg("timeout"), py::arg("expert_padding"), py::arg("stream"), py::arg("halves"),
           py::arg("stream_first"), py::arg("stream_waits"),
           "Expert-major dispatch_send and dispatch_recv in one call (halves: 1 send, 2 "
           "receive, 3 both; the other half's arguments unused, None), ordered after `stream` "
           "(a cudaStream_t as an int, 0 allowed; None: unordered) with stream_first and "
           "before it with stream_waits; finished steps' arrays let go first. What "
           "ferry.deep_ep and ferry.pplx call")
      .def("combine", &PyAllToAll::Combine, py::arg("expert_out"), py::arg("out"),
           py::arg("weights"), py::arg("accumulate"), py::arg("timeout"), py::arg("stream"),
           py::arg("halves"), py::arg("stream_first"), py::arg("stream_waits"),
           "combine_send and combine_recv in one call, as dispatch() runs dispatch's halves")
      .def("set_stream", &PyAllToAll::SetStream, py::arg("stream"),
           "CUDA device, several ranks: enqueue the steps on `stream` (a torch or CuPy stream, or "
           "a cudaStream_t as an int, not the legacy default stream 0; None: back to waiting) and "
           "return at once; the arrays stay referenced until synchronize()")
      .def("synchronize", &PyAllToAll::Synchronize,
           "Waits for the steps enqueued so far and raises what their kernels found")
      .def("order_after", [](PyAllToAll& a, const py::handle& s) { a.Order(s, true); },
           py::arg("stream"),
           "CUDA device: the steps enqueued from now on start after what `stream` (a torch or "
           "CuPy stream, or a cudaStream_t as an int; 0 allowed) holds so far; no host wait")
      .def("order_before", [](PyAllToAll& a, const py::handle& s) { a.Order(s, false); },
           py::arg("stream"),
           "CUDA device: what is enqueued on `stream` from now on starts after the steps "
           "enqueued so far; no host wait")
      .def("poll", &PyAllToAll::Poll,
           "synchronize() without the wait: True (the arrays released, what the kernels found "
           "raised) once every step enqueued so far has finished, else False; not during a "
           "graph capture")
      .def("release_finished", &PyAllToAll::ReleaseFinished, py::arg("stream") = py::none(),
           "The arrays of finished steps let go (what their kernels found raised) without "
           "waiting, unless more than a few rounds' are held; nothing while `stream` (a "
           "caller's cudaStream_t as an int, or ours) is being captured. dispatch() and "
           "combine() do this first")
      .def_property_readonly("pending_arrays", &PyAllToAll::pending,
                             "Arrays of enqueued steps still referenced (until poll() or "
                             "synchronize() finds them done)")
      .def_property_readonly("dispatch_bytes_sent", &PyAllToAll::dispatch_bytes_sent,
                             "Bytes the last dispatch put on the wire (payload and metadata)")
      .def_property_readonly("combine_bytes_sent", &PyAllToAll::combine_bytes_sent,
                             "Bytes the last combine put on the wire");
}

}  // namespace ferry::python
