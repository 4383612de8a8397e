// ferry.deep_ep.Buffer's low-latency calls, as the Buffer's own methods in C++: Buffer
// (python/ferry/deep_ep.py) subclasses DeepEpLowLatency, whose low_latency_dispatch and
// low_latency_combine run the common path (bf16 or e4m3 dispatch with amax or power-of-two
// scales, with or without the receive hook, into out= or not, with or without the wait-cost
// statistics and the expert counters; no async_finish) in one C++ call. Python runs every other
// case, and the first calls of each shape (which make the AllToAll and its two output sets, then
// add them here): a call this path does not take is handed, before anything is touched, to the
// Buffer's Python method of the same name with a leading underscore, which raises Python's
// errors for bad arguments.
//
// The two methods are METH_FASTCALL methods of the type, not pybind11 functions: DeepEP's
// calls pass up to eleven arguments, mostly by keyword, and pybind11's matching of them (with
// the Python frame of a method that forwarded to it) cost microseconds a call.
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "all_to_all.h"
#include "binding.h"
#include "compat.h"

namespace ferry::python {
namespace {

// What a combine needs of its dispatch (deep_ep's handle): the AllToAll that carried it
// (`pooled`, held busy until the combine's receive half; another call may take the AllToAll
// after that, so the handle's own in_flight, not the AllToAll's flag, says whether it can still
// be combined) and the shapes the combine checks against. Python's path makes them too
// (ferry.deep_ep._Handle is this type); max_tokens is None for normal mode's, which have rows.
struct DeepEpHandle {
  py::object pooled;
  int64_t tokens, k, hidden, num_experts;
  py::object topk_idx, max_tokens, topk_weights, rows;
  bool in_flight = true;
  py::object combine_buffer;  // get_next_low_latency_combine_buffer's, once asked for
};

// Names looked up on Python objects at every call, made once.
struct Names {
  PyObject* const busy = PyUnicode_InternFromString("busy");
  PyObject* const dispatch = PyUnicode_InternFromString("_low_latency_dispatch");
  PyObject* const combine = PyUnicode_InternFromString("_low_latency_combine");
  static const Names& Get() {
    static const Names n;
    return n;
  }
};

bool Busy(const py::object& pooled) {
  const auto busy =
      py::reinterpret_steal<py::object>(PyObject_GetAttr(pooled.ptr(), Names::Get().busy));
  if (!busy) throw py::error_already_set();
  return busy.is(py::handle(Py_True));
}
void SetBusy(const py::object& pooled, bool busy) {
  if (PyObject_SetAttr(pooled.ptr(), Names::Get().busy, busy ? Py_True : Py_False) != 0) {
    throw py::error_already_set();
  }
}

// A vectorcall's arguments matched to `names` (positional first, then by keyword) into `out`
// (null: not given), or false where they do not match as Python's would (too many, an unknown
// or repeated name, one of the first `required` missing).
template <size_t N>
bool Match(const std::array<const char*, N>& names, size_t required, PyObject* const* args,
           Py_ssize_t nargs, PyObject* kwnames, std::array<PyObject*, N>& out) {
  out.fill(nullptr);
  if (nargs < 0 || static_cast<size_t>(nargs) > N) return false;
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t j = 0; j < keywords; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    size_t i = 0;
    while (i < N && PyUnicode_CompareWithASCIIString(name, names[i]) != 0) ++i;
    if (i == N || out[i]) return false;
    out[i] = args[nargs + j];
  }
  for (size_t i = 0; i < required; ++i) {
    if (!out[i]) return false;
  }
  return true;
}

// An argument's truth (`otherwise` where not given); nullopt where asking raised.
std::optional<bool> Flag(PyObject* o, bool otherwise) {
  if (!o) return otherwise;
  const int truth = PyObject_IsTrue(o);
  if (truth < 0) {
    PyErr_Clear();  // the Python path asks again and raises
    return std::nullopt;
  }
  return truth != 0;
}
// An argument that is a Python int, as int64 (nullopt for anything else).
std::optional<int64_t> Int(PyObject* o) {
  if (!o || !PyLong_Check(o)) return std::nullopt;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return std::nullopt;
  }
  return v;
}
bool IsNone(PyObject* o) { return !o || o == Py_None; }

class PyDeepEpLowLatency {
 public:
  // done: deep_ep's finished EventOverlap, what a call that waits returns.
  PyDeepEpLowLatency(int world, double timeout, py::object done)
      : world_(world), timeout_(timeout), done_(std::move(done)), torch_(Torch::Get()) {
    CheckTimeout(timeout);
  }

  // A low-latency AllToAll of one shape (its `pooled` entry: .a2a, .busy) with its output sets
  // (`sets`, the list of two (recv_x, recv_count, scales, packed) tuples Python rotates) and
  // the dispatch's unused weights (`ones`: float32 [m, k]).
  void Add(int device, int64_t m, int64_t hidden, int64_t experts, int64_t k, bool fp8,
           py::object pooled, py::list sets, py::object ones) {
    if (py::len(sets) != 2) Invalid("sets: two output sets");
    auto e = std::make_shared<Entry>(Entry{.device = device,
                                           .m = m,
                                           .hidden = hidden,
                                           .experts = experts,
                                           .k = k,
                                           .fp8 = fp8,
                                           .pooled = pooled,
                                           .a2a = pooled.attr("a2a").cast<PyAllToAll*>(),
                                           .sets = std::move(sets),
                                           .ones = TorchArray(ones)});
    if (!e->ones) Invalid("ones: not a contiguous CPU or CUDA tensor");
    entries_.push_back(std::move(e));
  }
  void Clear() { entries_.clear(); }

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

  // low_latency_dispatch's result, or a null object where Python's path must run the call.
  // With return_recv_hook, the send half now and the receive half in the returned hook.
  py::object Dispatch(const std::array<PyObject*, kDispatchArgs.size()>& a) {
    const std::optional<int64_t> m = Int(a[2]), experts = Int(a[3]);
    const std::optional<bool> fp8 = Flag(a[6], true), round_scale = Flag(a[7], false),
                              ue8m0 = Flag(a[8], false), async = Flag(a[9], false),
                              hook = Flag(a[10], false);
    if (!m || !experts || !fp8 || !round_scale || !ue8m0 || !async || !hook || *ue8m0 || *async) {
      return {};
    }
    std::optional<Array> xa = TorchArray(a[0]);
    if (!xa || xa->dtype != torch_.bfloat16 || xa->shape.size() != 2) return {};
    std::optional<Array> cost;
    if (!IsNone(a[5]) && !(cost = WaitCost(a[5], xa->device))) return {};
    // The caller's expert counters (int32 [local experts] on x's device): the receive's counts
    // are added to them after it.
    py::object counters = py::none();
    if (!IsNone(a[4])) {
      const std::optional<Array> ca = TorchArray(a[4]);
      if (!ca || ca->dtype != torch_.int32 || ca->device != xa->device ||
          ca->shape != std::vector<int64_t>{*experts / world_}) {
        return {};
      }
      counters = py::reinterpret_borrow<py::object>(a[4]);
    }
    std::optional<Array> ia = TorchArray(a[1]);
    if (!ia || (ia->dtype != torch_.int64 && ia->dtype != torch_.int32) || ia->shape.size() != 2 ||
        ia->device != xa->device || ia->shape[0] != xa->shape[0]) {
      return {};
    }
    const int64_t tokens = xa->shape[0], hidden = xa->shape[1], k = ia->shape[1];
    if (tokens > *m || *experts % world_ || hidden % (*fp8 ? 128 : 16)) return {};
    const std::optional<void*> stream = CurrentStream(xa->device);
    std::shared_ptr<Entry> e = Find([&](const Entry& c) {
      return c.device == xa->device && c.m == *m && c.hidden == hidden && c.experts == *experts &&
             c.k == k && c.fp8 == *fp8 && !Busy(c.pooled);
    });
    // e4m3's scales are copied into DeepEP's layout, and the counters added to, after the
    // receive: here only where that work may go on the caller's stream.
    if (!e || ((*fp8 || !counters.is_none()) && !e->a2a->RunsOn(stream))) return {};
    const py::tuple set = e->Next();
    const OutputArrays out = e->Arrays(set);
    // The receive half.
    const double timeout = timeout_;
    auto recv = [e, out, timeout, cost] {
      e->a2a->DispatchRecvArrays(out.recv_x, out.recv_count, out.scales ? &*out.scales : nullptr,
                                 {}, timeout, 0, cost ? &*cost : nullptr);
    };
    // After the receive: e4m3's scales into DeepEP's layout and the counts onto the caller's
    // counters, on the stream current when it runs: a hook may be called on another than the
    // dispatch's, whose stream (the AllToAll's) the receive went on; that stream then waits for
    // this work, and the work for the receive, as one stream would order them.
    auto after = [e, set, fp8 = *fp8, counters, stream, device = xa->device] {
      if (!fp8 && counters.is_none()) return;
      const std::optional<void*> now = CurrentStream(device);
      const bool other = now && *now != *stream;
      if (other) e->a2a->Order(*now, false);
      if (fp8) set[3].attr("copy_")(set[2]);
      if (!counters.is_none()) counters.attr("add_")(set[1]);
      if (other) e->a2a->Order(*now, true);
    };
    SetBusy(e->pooled, true);
    try {
      e->a2a->Ordered(stream, true, true, true, [&] {
        e->a2a->DispatchSendArrays(*xa, *ia, *e->ones, nullptr, static_cast<int>(tokens), nullptr,
                                   *round_scale ? Fp8Scaling::kPowerOfTwo : Fp8Scaling::kAmax);
        if (!*hook) recv();
      });
      if (!*hook) after();
    } catch (...) {
      SetBusy(e->pooled, false);  // a failed call frees its AllToAll, as Python's does
      throw;
    }
    auto handle = std::make_shared<DeepEpHandle>(
        DeepEpHandle{.pooled = e->pooled,
                     .tokens = tokens,
                     .k = k,
                     .hidden = hidden,
                     .num_experts = *experts,
                     .topk_idx = py::reinterpret_borrow<py::object>(a[1]),
                     .max_tokens = py::int_(*m),
                     .topk_weights = py::none(),
                     .rows = py::none(),
                     .combine_buffer = py::none()});
    py::object out_x = *fp8 ? py::object(py::make_tuple(set[0], set[3])) : py::object(set[0]);
    py::object recv_hook = py::none();
    if (*hook) {
      // The receive ordered before the caller's stream only: after it, it would wait for what
      // the caller overlapped with the transfer. A failure frees the handle (the AllToAll
      // reports it to the next call), as Python's hook does.
      recv_hook = py::cpp_function([e, stream, recv, after, handle]() {
        try {
          e->a2a->Ordered(stream, false, true, false, recv);
          after();
        } catch (...) {
          Release(*handle);
          throw;
        }
      });
    }
    return py::make_tuple(out_x, set[1], py::cast(handle), done_, recv_hook);
  }

  // low_latency_combine's result, or a null object where Python's path must run the call.
  py::object Combine(const std::array<PyObject*, kCombineArgs.size()>& a) {
    const std::optional<bool> logfmt = Flag(a[4], false), zero_copy = Flag(a[5], false),
                              async = Flag(a[6], false), hook = Flag(a[7], false);
    if (!logfmt || !zero_copy || !async || !hook || *logfmt || *zero_copy || *async ||
        !py::isinstance<DeepEpHandle>(a[3])) {
      return {};
    }
    auto h = py::cast<std::shared_ptr<DeepEpHandle>>(a[3]);
    if (!h->rows.is_none() || !h->in_flight) return {};
    std::shared_ptr<Entry> e = Find([&](const Entry& c) { return c.pooled.is(h->pooled); });
    if (!e) return {};
    std::optional<Array> xa = TorchArray(a[0]), ia = TorchArray(a[1]), wa = TorchArray(a[2]);
    if (!xa || !ia || !wa || xa->dtype != torch_.bfloat16 || xa->device != e->device ||
        xa->shape != std::vector<int64_t>{e->experts / world_, world_ * e->m, e->hidden} ||
        (ia->dtype != torch_.int64 && ia->dtype != torch_.int32) || wa->dtype != torch_.float32 ||
        ia->device != e->device || wa->device != e->device ||
        ia->shape != std::vector<int64_t>{h->tokens, e->k} || wa->shape != ia->shape) {
      return {};
    }
    std::optional<Array> cost;
    if (!IsNone(a[9]) && !(cost = WaitCost(a[9], e->device))) return {};
    py::object result;
    std::optional<Array> oa;
    if (IsNone(a[8])) {
      result = torch_.empty_like(e->OutputTemplate(a[0], h->tokens));
      // Made as x is (bf16, contiguous, on x's device): x's description with the new tensor's
      // address and shape, one attribute call rather than TorchArray's eight.
      static PyObject* const data_ptr = PyUnicode_InternFromString("data_ptr");
      const py::object address =
          py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(result.ptr(), data_ptr));
      if (!address) throw py::error_already_set();
      oa = *xa;
      oa->data = PyLong_AsUnsignedLongLong(address.ptr());
      oa->shape = {h->tokens, e->hidden};
      oa->num_bytes = static_cast<uint64_t>(h->tokens) * static_cast<uint64_t>(e->hidden) * 2;
      oa->readonly = false;
      oa->owner = result;
    } else {
      result = py::reinterpret_borrow<py::object>(a[8]);
      oa = TorchArray(result);
      if (!oa || oa->dtype != torch_.bfloat16 || oa->device != e->device ||
          oa->shape != std::vector<int64_t>{h->tokens, e->hidden}) {
        return {};
      }
    }
    const std::optional<void*> stream = CurrentStream(e->device);
    const double timeout = timeout_;
    auto recv = [e, out = *oa, w = *wa, timeout, cost] {
      e->a2a->CombineRecvArrays(out, false, timeout, &w, cost ? &*cost : nullptr);
    };
    try {
      e->a2a->Ordered(stream, true, true, false, [&] {
        e->a2a->CombineSendArray(*xa, std::nullopt);
        if (!*hook) recv();
      });
    } catch (...) {
      Release(*h);
      throw;
    }
    if (!*hook) {
      Release(*h);
      return py::make_tuple(result, done_, py::none());
    }
    return py::make_tuple(result, done_, py::cpp_function([e, stream, recv, h] {
                            try {
                              e->a2a->Ordered(stream, false, true, false, recv);
                            } catch (...) {
                              Release(*h);
                              throw;
                            }
                            Release(*h);
                          }));
  }

 private:
  // A wait-cost statistics tensor as this path takes it: int64 [world] on `device`; nullopt
  // for anything else (Python's path then checks it and raises).
  std::optional<Array> WaitCost(PyObject* o, int device) const {
    std::optional<Array> c = TorchArray(o);
    if (!c || c->dtype != torch_.int64 || c->device != device ||
        c->shape != std::vector<int64_t>{world_}) {
      return std::nullopt;
    }
    return c;
  }

  // The handle combined (or failed): its AllToAll free for the next call.
  static void Release(DeepEpHandle& h) {
    SetBusy(h.pooled, false);
    h.in_flight = false;
  }

  struct OutputArrays {
    Array recv_x, recv_count;
    std::optional<Array> scales;
  };
  struct Entry {
    int device;
    int64_t m, hidden, experts, k;
    bool fp8;
    py::object pooled;
    PyAllToAll* a2a;  // pooled.a2a, which pooled keeps
    py::list sets;
    std::optional<Array> ones;
    // Each output set read once (its tensors never change): keyed by the set's tuple.
    std::vector<std::pair<py::object, OutputArrays>> arrays;
    // Per token count, one bf16 element of x's device expanded to [tokens, hidden]: what
    // torch.empty_like makes a combine's output from. It takes a third less than x.new_empty
    // of the shape (1.96 against 2.93 us on an H200 host, 2026-12-04): one tensor argument to
    // parse, not a shape. Expanded, it holds 2 bytes, and empty_like lays out a tensor that is
    // not dense contiguously.
    // Indexed by the token count (at most m), made at a count's first combine.
    std::vector<py::object> out_templates;

    py::handle OutputTemplate(PyObject* x, int64_t tokens) {
      if (out_templates.empty()) out_templates.resize(size_t(m) + 1);
      py::object& o = out_templates[size_t(tokens)];
      if (!o) {
        o = py::handle(x).attr("new_empty")(py::make_tuple(1, 1)).attr("expand")(tokens, hidden);
      }
      return o;
    }

    // The older of the two sets, moved to the list's end as Python's _ll_outputs takes it.
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
                           scales = set[2].is_none() ? std::nullopt : TorchArray(set[2]);
      if (!x || !counts || (!set[2].is_none() && !scales)) {
        Invalid("an output set of the Buffer's: not contiguous CPU or CUDA tensors");
      }
      OutputArrays a{std::move(*x), std::move(*counts), std::move(scales)};
      arrays.emplace_back(set, std::move(a));
      return arrays.back().second;
    }
  };

  template <typename Match>
  std::shared_ptr<Entry> Find(Match match) {
    for (const std::shared_ptr<Entry>& e : entries_) {
      if (match(*e)) return e;
    }
    return nullptr;
  }

  int world_;
  double timeout_;
  py::object done_;
  const Torch& torch_;
  // Shared with the hooks a call returns: a hook outlives the call, and Add may move entries.
  std::vector<std::shared_ptr<Entry>> entries_;
};

// Runs `call` as a CPython method body: its result (new reference), or null with the Python
// error set from what it threw.
template <typename Call>
PyObject* AsMethod(Call call) {
  try {
    return call();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// The method `name` of `self` (the Buffer's Python path) called with a vectorcall's arguments.
PyObject* CallPython(PyObject* self, PyObject* name, PyObject* const* args, Py_ssize_t nargs,
                     PyObject* kwnames) {
  const Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  std::vector<PyObject*> stack(1 + nargs + keywords);
  stack[0] = self;
  std::copy(args, args + nargs + keywords, stack.begin() + 1);
  return PyObject_VectorcallMethod(name, stack.data(), static_cast<size_t>(1 + nargs), kwnames);
}

// A low-latency call as a METH_FASTCALL method of the layer: its arguments matched to `kNames`
// (the first four required) and run by `Call`, or handed as they came to the Buffer's Python
// method `kFallback` where they do not match or `Call` does not take them.
template <const auto& kNames, auto Call, PyObject* const Names::*kFallback>
PyObject* FastMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return AsMethod([&]() -> PyObject* {
    auto& layer = py::cast<PyDeepEpLowLatency&>(py::handle(self));
    std::array<PyObject*, std::tuple_size_v<std::remove_cvref_t<decltype(kNames)>>> a;
    if (Match(kNames, 4, args, nargs, kwnames, a)) {
      if (py::object done = (layer.*Call)(a)) return done.release().ptr();
    }
    return CallPython(self, Names::Get().*kFallback, args, nargs, kwnames);
  });
}
constexpr auto LowLatencyDispatch =
    &FastMethod<PyDeepEpLowLatency::kDispatchArgs, &PyDeepEpLowLatency::Dispatch, &Names::dispatch>;
constexpr auto LowLatencyCombine =
    &FastMethod<PyDeepEpLowLatency::kCombineArgs, &PyDeepEpLowLatency::Combine, &Names::combine>;

// `function` as the METH_FASTCALL method `def->ml_name` of the bound class `cls`.
void AddFastMethod(py::handle cls, PyMethodDef* def) {
  py::object method = py::reinterpret_steal<py::object>(
      PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def));
  if (!method) throw py::error_already_set();
  cls.attr(def->ml_name) = method;
}

// The methods' text signatures (what inspect.signature and help() show) lead their docs.
PyMethodDef dispatch_def{
    "low_latency_dispatch",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(LowLatencyDispatch)),
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
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(LowLatencyCombine)),
    METH_FASTCALL | METH_KEYWORDS,
    "low_latency_combine($self, x, topk_idx, topk_weights, handle, use_logfmt=False, "
    "zero_copy=False, async_finish=False, return_recv_hook=False, out=None, "
    "combine_wait_recv_cost_stats=None)\n--\n\n"
    "DeepEP's low-latency combine: (combined_x, event, hook), each token's sum of its experts' "
    "rows of x weighted by topk_weights"};
}  // namespace

void BindDeepEp(py::module_& m) {
  py::class_<DeepEpHandle, std::shared_ptr<DeepEpHandle>>(
      m, "DeepEpHandle",
      "What a ferry.deep_ep combine needs of its dispatch (the handle a dispatch returns)")
      .def(py::init([](py::object pooled, int64_t tokens, int64_t k, int64_t hidden,
                       int64_t num_experts, py::object topk_idx, py::object max_tokens,
                       py::object topk_weights, py::object rows) {
             return DeepEpHandle{std::move(pooled),
                                 tokens,
                                 k,
                                 hidden,
                                 num_experts,
                                 std::move(topk_idx),
                                 std::move(max_tokens),
                                 std::move(topk_weights),
                                 std::move(rows),
                                 true,
                                 py::none()};
           }),
           py::arg("pooled"), py::arg("tokens"), py::arg("k"), py::arg("hidden"),
           py::arg("num_experts"), py::arg("topk_idx"), py::arg("max_tokens") = py::none(),
           py::arg("topk_weights") = py::none(), py::arg("rows") = py::none())
      .def_readwrite("pooled", &DeepEpHandle::pooled)
      .def_readwrite("in_flight", &DeepEpHandle::in_flight)
      .def_readonly("tokens", &DeepEpHandle::tokens)
      .def_readonly("k", &DeepEpHandle::k)
      .def_readonly("hidden", &DeepEpHandle::hidden)
      .def_readonly("num_experts", &DeepEpHandle::num_experts)
      .def_readonly("topk_idx", &DeepEpHandle::topk_idx)
      .def_readonly("max_tokens", &DeepEpHandle::max_tokens)
      .def_readonly("topk_weights", &DeepEpHandle::topk_weights)
      .def_readwrite("rows", &DeepEpHandle::rows)
      .def_readwrite("combine_buffer", &DeepEpHandle::combine_buffer);
  py::class_<PyDeepEpLowLatency> layer(
      m, "DeepEpLowLatency",
      "The low-latency calls of ferry.deep_ep.Buffer (what the Buffer subclasses; construct "
      "that instead)");
  layer
      .def(py::init<int, double, py::object>(), py::arg("world"), py::arg("timeout"),
           py::arg("done"))
      .def("_add_shape", &PyDeepEpLowLatency::Add, py::arg("device"), py::arg("m"),
           py::arg("hidden"), py::arg("experts"), py::arg("k"), py::arg("fp8"), py::arg("pooled"),
           py::arg("sets"), py::arg("ones"),
           "A shape's AllToAll and its two output sets, for the C++ path to take calls on")
      .def("_clear_shapes", &PyDeepEpLowLatency::Clear,
           "Forgets every shape: the Buffer's calls all run in Python after this");
  AddFastMethod(layer, &dispatch_def);
  AddFastMethod(layer, &combine_def);
}

}  // namespace ferry::python
