// ferry.deep_ep.Buffer's low-latency calls, as the Buffer's own methods in C++: Buffer
// (python/ferry/compat/deep_ep/_buffer.py) subclasses DeepEpLowLatency, whose
// low_latency_dispatch and low_latency_combine are written here once: every argument checked
// (InvalidArgument naming it; TypeError, as Python's, for a call that does not match DeepEP's
// signature), then the call run in one C++ call in every form DeepEP has -- bf16 or e4m3 with
// amax, power-of-two or UE8M0 scales, with or without the receive hook, async_finish or not,
// zero-copy or not, into out= or not, with or without the wait-cost statistics and the expert
// counters. What stays Python is asked for by name where it is needed: a shape's AllToAll and
// output sets (the Buffer's _ll_shape, at its first call), and for async_finish calls the
// communication stream (_stream_for), torch's stream context on it (_on_comm) and the event
// (_end).
//
// The two methods are METH_FASTCALL methods of the type, not pybind11 functions: DeepEP's
// calls pass up to eleven arguments, mostly by keyword, and pybind11's matching of them (with
// the Python frame of a method that forwarded to it) cost microseconds a call.
#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "all_to_all.h"
#include "binding.h"
#include "compat.h"
#include "deep_ep_handle.h"
#include "deep_ep_normal.h"
#include "fast_call.h"

namespace ferry::python {
namespace {

// Names looked up on Python objects, made once.
struct Names {
  PyObject* const shape = PyUnicode_InternFromString("_ll_shape");
  PyObject* const stream_for = PyUnicode_InternFromString("_stream_for");
  PyObject* const on_comm = PyUnicode_InternFromString("_on_comm");
  PyObject* const end = PyUnicode_InternFromString("_end");
  static const Names& Get() {
    static const Names n;
    return n;
  }
};

class PyDeepEpBuffer {
 public:
  // done: deep_ep's finished EventOverlap, what a call that waits returns.
  // handle_type: the tuple subclass V1's low-latency handles are made of (LowLatencyHandle).
  PyDeepEpBuffer(int world, double timeout, py::object done, py::object handle_type)
      : world_(world),
        timeout_(timeout),
        done_(std::move(done)),
        handle_type_(std::move(handle_type)),
        torch_(Torch::Get()),
        normal_(world, timeout, done_) {
    CheckTimeout(timeout);
    if (!PyType_Check(handle_type_.ptr()) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(handle_type_.ptr()), &PyTuple_Type)) {
      Invalid("handle_type: a tuple subclass");
    }
  }

  // A low-latency AllToAll of one shape (its pool entry) with its output sets (`sets`, the
  // list of two (recv_x, recv_count, scales, packed) tuples the calls take in turn) and the
  // dispatch's unused weights (`ones`: float32 [m, k]).
  void Add(int device, int64_t m, int64_t hidden, int64_t experts, int64_t k, bool fp8, bool ue8m0,
           std::shared_ptr<PooledAllToAll> pooled, py::list sets, py::object ones) {
    if (py::len(sets) != 2) Invalid("sets: two output sets");
    auto e = std::make_shared<Entry>(Entry{.device = device,
                                           .m = m,
                                           .hidden = hidden,
                                           .experts = experts,
                                           .k = k,
                                           .fp8 = fp8,
                                           .ue8m0 = ue8m0,
                                           .pooled = std::move(pooled),
                                           .sets = std::move(sets),
                                           .ones = TorchArray(ones)});
    if (!e->ones) Invalid("ones: not a contiguous CPU or CUDA tensor");
    entries_.push_back(std::move(e));
  }
  // The Buffer destroyed: every later call is refused.
  void Close() {
    entries_.clear();
    templates_.clear();
    closed_ = true;
    normal_.Close();
  }
  DeepEpNormal& normal() { return normal_; }

  static constexpr std::array<const char*, 11> kDispatchArgs{"x",
                                                             "topk_idx",
                                                             "num_max_dispatch_tokens_per_rank",
                                                             "num_experts",
                                                             "cumulative_local_expert_recv_stats",
                                                             "dispatch_wait_recv_cost_stats",
                                                             "use_fp8",
                                                             "round_scale",
                                                             "use_ue8m0",
                                                             "async_finish",
                                                             "return_recv_hook"};
  static constexpr std::array<const char*, 10> kCombineArgs{
      "x",         "topk_idx",     "topk_weights",     "handle", "use_logfmt",
      "zero_copy", "async_finish", "return_recv_hook", "out",    "combine_wait_recv_cost_stats"};

  // low_latency_dispatch's arguments checked; its result, or a null object where the Buffer's
  // Python method runs the (checked) call. With return_recv_hook, the send half now and the
  // receive half in the returned hook.
  py::object Dispatch(PyObject* self, const std::array<PyObject*, kDispatchArgs.size()>& a) {
    if (closed_) Invalid("low_latency_dispatch: the Buffer was destroyed");
    const Array xa = TensorArg("x", a[0], torch_.bfloat16, 2, kAnyDevice);
    const int device = xa.device;
    const std::optional<Array> cost = WaitCost("dispatch_wait_recv_cost_stats", a[5], device);
    const Array ia = TensorArg("topk_idx", a[1], torch_.int64, 2, device, torch_.int32);
    const int64_t m = Int("num_max_dispatch_tokens_per_rank", a[2]);
    const int64_t experts = Int("num_experts", a[3]);
    const bool fp8 = Flag(a[6], true), round_scale = Flag(a[7], false), ue8m0 = Flag(a[8], false),
               async = Flag(a[9], false), hook = Flag(a[10], false);
    const int64_t tokens = xa.shape[0], hidden = xa.shape[1], k = ia.shape[1];
    if (ia.shape[0] != tokens) {
      Invalid("topk_idx: " + std::to_string(ia.shape[0]) + " rows, x has " +
              std::to_string(tokens));
    }
    if (tokens > m) {
      Invalid("x: " + std::to_string(tokens) +
              " tokens, more than "
              "num_max_dispatch_tokens_per_rank " +
              std::to_string(m));
    }
    if (experts <= 0 || experts % world_) {
      Invalid("num_experts " + std::to_string(experts) + ": not a positive multiple of " +
              std::to_string(world_) + " ranks");
    }
    const int64_t group = fp8 ? 128 : 16;
    if (hidden % group) {
      Invalid("x: hidden " + std::to_string(hidden) + " is not a multiple of " +
              std::to_string(group) + (fp8 ? " (fp8 rows)" : " (bf16 rows)"));
    }
    if (ue8m0 && !round_scale) Invalid("use_ue8m0 needs round_scale (UE8M0 holds powers of two)");
    if ((round_scale || ue8m0) && !fp8) Invalid("round_scale and use_ue8m0 need use_fp8");
    if (ue8m0 && hidden % 512) {
      Invalid("use_ue8m0: hidden " + std::to_string(hidden) + " is not a multiple of 512");
    }
    // The caller's expert counters (int32 [local experts] on x's device): the receive's counts
    // are added to them after it.
    py::object counters = py::none();
    if (!IsNone(a[4])) {
      const Array ca =
          TensorArg("cumulative_local_expert_recv_stats", a[4], torch_.int32, 1, device);
      if (ca.shape[0] != experts / world_) {
        Invalid("cumulative_local_expert_recv_stats: " + std::to_string(experts / world_) +
                " entries");
      }
      counters = py::reinterpret_borrow<py::object>(a[4]);
    }
    auto idle = [&](const Entry& c) {
      return c.device == device && c.m == m && c.hidden == hidden && c.experts == experts &&
             c.k == k && c.fp8 == fp8 && c.ue8m0 == ue8m0 && !c.pooled->busy;
    };
    std::shared_ptr<Entry> e = Find(idle);
    if (!e) {  // the shape's first call, or every AllToAll of it held: one more, made there
      py::handle(self).attr(Names::Get().shape)(py::handle(a[0]), m, experts, k, fp8, ue8m0);
      if (!(e = Find(idle))) Invalid("low_latency_dispatch: the Buffer made no AllToAll");
    }
    PyAllToAll* const a2a = e->pooled->raw;
    const std::optional<void*> stream = CurrentStream(device);
    // async_finish: the AllToAll's steps go on the communication stream from its first such
    // call on, so that its transfers overlap the caller's work -- unless an earlier call gave
    // it the caller's stream (DeepEP launches a hook's send half on the caller's stream).
    if (async && device >= 0 && !e->pooled->streamed) {
      if (a2a->stream().is_none()) py::handle(self).attr(Names::Get().stream_for)(e->pooled);
      e->pooled->streamed = true;
    }
    const py::tuple set = e->Next();
    const OutputArrays out = e->Arrays(set);
    const int64_t local = experts / world_, rows = world_ * m;
    // The receive half.
    const double timeout = timeout_;
    auto recv = [a2a, out, timeout, cost] {
      a2a->DispatchRecvArrays(out.recv_x, out.recv_count, out.scales ? &*out.scales : nullptr, {},
                              timeout, 0, cost ? &*cost : nullptr, 0,
                              {&out.src_info, &out.layout_range});
    };
    // After the receive: e4m3's scales into DeepEP's layout (UE8M0: each scale's exponent
    // byte, four groups per int32) and the counts onto the caller's counters.
    const bool after_work = fp8 || !counters.is_none();
    const Torch* const torch = &torch_;
    auto work = [set, fp8, ue8m0, counters, local, rows, hidden, torch] {
      if (fp8 && ue8m0) {
        const py::object exponents = set[2]
                                         .attr("view")(py::handle(torch->int32))
                                         .attr("__rshift__")(23)
                                         .attr("to")(py::handle(torch->uint8))
                                         .attr("view")(local, rows, hidden / 128)
                                         .attr("contiguous")()
                                         .attr("view")(py::handle(torch->int32));
        set[3].attr("copy_")(exponents);
      } else if (fp8) {
        set[3].attr("copy_")(set[2]);
      }
      if (!counters.is_none()) counters.attr("add_")(set[1]);
    };
    // Where the caller waits: the work on the stream current when it runs; a hook may be called
    // on another than the dispatch's, whose stream the receive went on: that stream then waits
    // for this work, and the work for the receive, as one stream would order them.
    auto after_waited = [a2a, work, stream, device] {
      const std::optional<void*> now = CurrentStream(device);
      const bool other = now && *now != *stream;
      if (other) a2a->Order(*now, false);
      work();
      if (other) a2a->Order(*now, true);
    };
    // async_finish: the work on the AllToAll's stream, in torch's context for it.
    const py::object buffer = py::reinterpret_borrow<py::object>(self);
    const py::object current = stream ? py::object(py::int_(reinterpret_cast<uintptr_t>(*stream)))
                                      : py::object(py::none());
    const py::object x_device = py::handle(a[0]).attr("device");
    auto after_async = [buffer, work, a2a_object = e->pooled->a2a, current, x_device] {
      const py::object context = buffer.attr(Names::Get().on_comm)(a2a_object, current, x_device);
      context.attr("__enter__")();
      try {
        work();
      } catch (...) {
        context.attr("__exit__")(py::none(), py::none(), py::none());
        throw;
      }
      context.attr("__exit__")(py::none(), py::none(), py::none());
    };
    // async_finish's event (with the tensors that must live until it fires).
    const py::tuple sent = py::make_tuple(py::handle(a[0]), py::handle(a[1]));
    auto event = [&] {
      if (!async) return done_;
      py::dict kwargs;
      kwargs["waited"] = false;
      kwargs["device"] = x_device;
      return py::object(buffer.attr(Names::Get().end)(e->pooled->a2a, current, true, sent,
                                                      py::tuple(), **kwargs));
    };
    e->pooled->busy = true;
    py::object finished;
    try {
      a2a->Ordered(stream, true, !async, true, [&] {
        a2a->DispatchSendArrays(xa, ia, *e->ones, nullptr, static_cast<int>(tokens), nullptr,
                                round_scale ? Fp8Scaling::kPowerOfTwo : Fp8Scaling::kAmax);
        if (!hook) recv();
      });
      if (!hook && after_work) async ? after_async() : after_waited();
      finished = event();
    } catch (...) {
      e->pooled->busy = false;  // a failed call frees its AllToAll (which reports the failure)
      throw;
    }
    auto handle = std::make_shared<DeepEpHandle>(
        DeepEpHandle{.pooled = e->pooled,
                     .tokens = tokens,
                     .k = k,
                     .hidden = hidden,
                     .num_experts = experts,
                     .topk_idx = py::reinterpret_borrow<py::object>(a[1]),
                     .max_tokens = py::int_(m),
                     .topk_weights = py::none(),
                     .rows = py::none(),
                     .device = device,
                     .combine_buffer = py::none()});
    py::object v1_handle =
        MakeV1Handle(handle_type_, set[4], set[5], m, hidden, experts, handle);
    py::object out_x = fp8 ? py::object(py::make_tuple(set[0], set[3])) : py::object(set[0]);
    py::object recv_hook = py::none();
    if (hook) {
      // The receive ordered before the caller's stream only: after it, it would wait for what
      // the caller overlapped with the transfer. The caller's stream then waits for it and the
      // work after it. A failure frees the handle (the AllToAll reports it to the next call).
      recv_hook = py::cpp_function(
          [a2a, stream, recv, after_work, async, after_waited, after_async, handle, device] {
            try {
              if (!async || !after_work) {
                a2a->Ordered(stream, false, true, false, recv);
                if (after_work) after_waited();
              } else {
                a2a->Ordered(stream, false, false, false, recv);
                after_async();
                if (const std::optional<void*> now = CurrentStream(device)) a2a->Order(*now, false);
              }
            } catch (...) {
              Release(*handle);
              throw;
            }
          });
    }
    return py::make_tuple(out_x, set[1], v1_handle, finished, recv_hook);
  }

  // low_latency_combine's arguments checked; its result, or a null object where the Buffer's
  // Python method runs the (checked) call.
  py::object Combine(PyObject* self, const std::array<PyObject*, kCombineArgs.size()>& a) {
    if (closed_) Invalid("low_latency_combine: the Buffer was destroyed");
    if (Flag(a[4], false)) {
      ThrowIfError(UnimplementedError("use_logfmt=True: LogFMT-encoded combine is not supported"));
    }
    const bool zero_copy = Flag(a[5], false), async = Flag(a[6], false), hook = Flag(a[7], false);
    auto h = UnwrapHandle(a[3]);
    if (!h) Invalid("low_latency_combine: handle is not one this Buffer's dispatch returned");
    if (!h->in_flight) Invalid("low_latency_combine: the handle's dispatch was combined already");
    if (!h->rows.is_none()) Invalid("handle: from a normal-mode dispatch (use combine)");
    py::object x = py::reinterpret_borrow<py::object>(a[0]);
    if (zero_copy) {
      if (h->combine_buffer.is_none()) {
        Invalid("zero_copy: call get_next_low_latency_combine_buffer first");
      }
      x = h->combine_buffer;
    }
    const int device = h->device;
    const int64_t m = py::cast<int64_t>(h->max_tokens);
    const Array xa = TensorArg("x", x, torch_.bfloat16, 3, device);
    const std::vector<int64_t> want{h->num_experts / world_, world_ * m, h->hidden};
    if (xa.shape != want) {
      Invalid("x: shape " + Shape(xa.shape) + ", the dispatch gave " + Shape(want));
    }
    const Array ia = TensorArg("topk_idx", a[1], torch_.int64, 2, device, torch_.int32);
    const Array wa = TensorArg("topk_weights", a[2], torch_.float32, 2, device);
    const std::optional<Array> cost = WaitCost("combine_wait_recv_cost_stats", a[9], device);
    const std::vector<int64_t> routed{h->tokens, h->k};
    if (ia.shape != routed || wa.shape != routed) {
      Invalid("topk_idx / topk_weights: shapes " + Shape(ia.shape) + " / " + Shape(wa.shape) +
              ", the dispatch had " + Shape(routed));
    }
    const std::vector<int64_t> rows{h->tokens, h->hidden};
    std::optional<Array> given;
    if (!IsNone(a[8])) {
      given = TensorArg("out", a[8], torch_.bfloat16, 2, device);
      if (given->shape != rows) {
        Invalid("out: shape " + Shape(given->shape) + ", expected " + Shape(rows));
      }
    }
    PyAllToAll* const a2a = h->pooled->raw;
    // The AllToAll's steps go where its dispatch's went (the pool keeps each on one stream).
    py::object result;
    std::optional<Array> oa = std::move(given);
    if (oa) {
      result = py::reinterpret_borrow<py::object>(a[8]);
    } else if (TorchGlue()) {
      Array made;
      result = EmptyTensor(torch_.bfloat16, {h->tokens, h->hidden}, xa.device, &made);
      oa = std::move(made);
    } else {
      result = torch_.empty_like(OutputTemplate(x.ptr(), h->tokens, h->hidden, m));
      // Made as x is (bf16, contiguous, on x's device): x's description with the new tensor's
      // address and shape, one attribute call rather than TorchArray's eight.
      static PyObject* const data_ptr = PyUnicode_InternFromString("data_ptr");
      const py::object address =
          py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(result.ptr(), data_ptr));
      if (!address) throw py::error_already_set();
      oa = xa;
      oa->data = PyLong_AsUnsignedLongLong(address.ptr());
      oa->shape = rows;
      oa->num_bytes = static_cast<uint64_t>(h->tokens) * static_cast<uint64_t>(h->hidden) * 2;
      oa->readonly = false;
      oa->owner = result;
    }
    const std::optional<void*> stream = CurrentStream(device);
    const double timeout = timeout_;
    auto recv = [a2a, out = *oa, w = wa, timeout, cost] {
      a2a->CombineRecvArrays(out, false, timeout, &w, cost ? &*cost : nullptr);
    };
    // async_finish's event (with the tensors that must live until it fires).
    auto event = [&](py::tuple inputs, py::tuple outputs) {
      if (!async) return done_;
      py::dict kwargs;
      kwargs["waited"] = false;
      kwargs["device"] = x.attr("device");
      const py::object current = stream ? py::object(py::int_(reinterpret_cast<uintptr_t>(*stream)))
                                        : py::object(py::none());
      return py::object(py::handle(self).attr(Names::Get().end)(h->pooled->a2a, current, true,
                                                                inputs, outputs, **kwargs));
    };
    py::object finished;
    try {
      a2a->Ordered(stream, true, !async, false, [&] {
        a2a->CombineSendArray(xa, std::nullopt);
        if (!hook) recv();
      });
      finished = hook ? event(py::make_tuple(x), py::tuple())
                      : event(py::make_tuple(x, py::handle(a[2])), py::make_tuple(result));
    } catch (...) {
      Release(*h);
      throw;
    }
    if (!hook) {
      Release(*h);
      return py::make_tuple(result, finished, py::none());
    }
    return py::make_tuple(result, finished, py::cpp_function([a2a, stream, recv, h] {
                            try {
                              a2a->Ordered(stream, false, true, false, recv);
                            } catch (...) {
                              Release(*h);
                              throw;
                            }
                            Release(*h);
                          }));
  }

 private:
  // A wait-cost statistics argument: None, or int64 [world] on `device`.
  std::optional<Array> WaitCost(const char* name, PyObject* o, int device) const {
    if (IsNone(o)) return std::nullopt;
    Array c = TensorArg(name, o, torch_.int64, 1, device);
    if (c.shape[0] != world_) {
      Invalid(std::string(name) + ": " + std::to_string(c.shape[0]) + " entries, expected " +
              std::to_string(world_) + " (one per rank)");
    }
    return c;
  }

  struct OutputArrays {
    Array recv_x, recv_count;
    std::optional<Array> scales;
    Array src_info, layout_range;  // the handle's: DispatchOutput::source_tokens, sender_ranges
  };
  struct Entry {
    int device;
    int64_t m, hidden, experts, k;
    bool fp8, ue8m0;
    std::shared_ptr<PooledAllToAll> pooled;
    py::list sets;
    std::optional<Array> ones;
    // Each output set read once (its tensors never change): keyed by the set's tuple.
    std::vector<std::pair<py::object, OutputArrays>> arrays;
    // The older of the two sets, moved to the list's end: each set serves every second call.
    py::tuple Next() {
      PyObject* list = sets.ptr();
      PyObject* older = PyList_GET_ITEM(list, 0);
      PyList_SET_ITEM(list, 0, PyList_GET_ITEM(list, 1));
      PyList_SET_ITEM(list, 1, older);
      return py::reinterpret_borrow<py::tuple>(older);
    }

    const OutputArrays& Arrays(const py::tuple& set) {
      for (const auto& [t, a] : arrays) {
        if (t.is(set)) return a;
      }
      std::optional<Array> x = TorchArray(set[0]), counts = TorchArray(set[1]),
                           scales = set[2].is_none() ? std::nullopt : TorchArray(set[2]),
                           src_info = TorchArray(set[4]), layout_range = TorchArray(set[5]);
      if (!x || !counts || (!set[2].is_none() && !scales) || !src_info || !layout_range) {
        Invalid("an output set of the Buffer's: not contiguous CPU or CUDA tensors");
      }
      OutputArrays a{std::move(*x), std::move(*counts), std::move(scales), std::move(*src_info),
                     std::move(*layout_range)};
      arrays.emplace_back(set, std::move(a));
      return arrays.back().second;
    }
  };

  // Per (device, hidden) and token count, one bf16 element of x's device expanded to [tokens,
  // hidden]: what torch.empty_like makes a combine's output from, without _ferry_torch. It
  // takes a third less than x.new_empty of the shape (1.96 against 2.93 us on an H200 host,
  // 2026-12-04): one tensor argument to parse, not a shape. Expanded, it holds 2 bytes, and
  // empty_like lays out a tensor that is not dense contiguously. Made at a count's first
  // combine.
  py::handle OutputTemplate(PyObject* x, int64_t tokens, int64_t hidden, int64_t m) {
    const int device = TorchArray(x)->device;
    std::vector<py::object>& by_tokens = templates_[{device, hidden}];
    if (by_tokens.size() < size_t(m) + 1) by_tokens.resize(size_t(m) + 1);
    py::object& o = by_tokens[size_t(tokens)];
    if (!o) {
      o = py::handle(x).attr("new_empty")(py::make_tuple(1, 1)).attr("expand")(tokens, hidden);
    }
    return o;
  }

  template <typename Match>
  std::shared_ptr<Entry> Find(Match match) {
    for (const std::shared_ptr<Entry>& e : entries_) {
      if (match(*e)) return e;
    }
    return nullptr;
  }

  int world_;
  double timeout_;
  bool closed_ = false;
  py::object done_;
  py::object handle_type_;
  const Torch& torch_;
  // Shared with the hooks a call returns: a hook outlives the call, and Add may move entries.
  std::vector<std::shared_ptr<Entry>> entries_;
  std::map<std::pair<int, int64_t>, std::vector<py::object>> templates_;
  DeepEpNormal normal_;  // the normal-mode calls (deep_ep_normal.cc)
};

// The low-latency calls as METH_FASTCALL methods (their first four arguments required).
PyDeepEpBuffer& BufferOf(PyObject* self) { return py::cast<PyDeepEpBuffer&>(py::handle(self)); }
constexpr char kDispatchName[] = "Buffer.low_latency_dispatch";
constexpr char kCombineName[] = "Buffer.low_latency_combine";
constexpr auto LowLatencyDispatch =
    &FastMethod<kDispatchName, PyDeepEpBuffer::kDispatchArgs, 4, BufferOf,
                &PyDeepEpBuffer::Dispatch>;
constexpr auto LowLatencyCombine =
    &FastMethod<kCombineName, PyDeepEpBuffer::kCombineArgs, 4, BufferOf,
                &PyDeepEpBuffer::Combine>;

// The methods' text signatures (what inspect.signature and help() show) lead their docs.
PyMethodDef dispatch_def{
    "low_latency_dispatch",
    AsCFunction<LowLatencyDispatch>(),
    METH_FASTCALL | METH_KEYWORDS,
    "low_latency_dispatch($self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
    "cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, "
    "use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, "
    "return_recv_hook=False)\n--\n\n"
    "DeepEP's low-latency dispatch: ((recv_x, recv_scales) or recv_x, recv_count, handle, "
    "event, hook); recv_x is [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, "
    "hidden], valid until the second dispatch after it of the same shape"};
PyMethodDef combine_def{
    "low_latency_combine",
    AsCFunction<LowLatencyCombine>(),
    METH_FASTCALL | METH_KEYWORDS,
    "low_latency_combine($self, x, topk_idx, topk_weights, handle, use_logfmt=False, "
    "zero_copy=False, async_finish=False, return_recv_hook=False, out=None, "
    "combine_wait_recv_cost_stats=None)\n--\n\n"
    "DeepEP's low-latency combine: (combined_x, event, hook), each token's sum of its experts' "
    "rows of x weighted by topk_weights"};
}  // namespace

void BindDeepEp(py::module_& m) {
  BindDeepEpHandle(m);
  BindDeepEpElastic(m);
  py::class_<PyDeepEpBuffer> layer(
      m, "DeepEpBuffer",
      "The low-latency and normal-mode calls of ferry.deep_ep.Buffer (what the Buffer "
      "subclasses; construct that instead)");
  layer
      .def(py::init<int, double, py::object, py::object>(), py::arg("world"), py::arg("timeout"),
           py::arg("done"), py::arg("handle_type"))
      .def_static(
          "_unwrap",
          [](py::handle handle) -> py::object {
            std::shared_ptr<DeepEpHandle> h = UnwrapHandle(handle.ptr());
            return h ? py::cast(h) : py::object(py::none());
          },
          py::arg("handle"),
          "ferry's handle in a low-latency (V1 tuple) or normal-mode handle; None for another")
      .def("_add_shape", &PyDeepEpBuffer::Add, py::arg("device"), py::arg("m"),
           py::arg("hidden"), py::arg("experts"), py::arg("k"), py::arg("fp8"), py::arg("ue8m0"),
           py::arg("pooled"), py::arg("sets"), py::arg("ones"),
           "A shape's AllToAll and its two output sets, for the C++ path to take calls on")
      .def("_close_shapes", &PyDeepEpBuffer::Close,
           "The Buffer destroyed: every later call is refused")
      .def("_forget_normal", [](PyDeepEpBuffer& b) { b.normal().Forget(); },
           "The normal-mode AllToAlls dropped: each shape's next call asks _normal_pool again");
  AddFastMethod(layer, &dispatch_def);
  AddFastMethod(layer, &combine_def);
  AddNormalMethods(layer, [](PyObject* self) -> DeepEpNormal& {
    return BufferOf(self).normal();
  });
}

}  // namespace ferry::python
