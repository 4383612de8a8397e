// The per-call halves of ferry.pplx.AllToAll (python/ferry/pplx.py subclasses PyPplx) and of
// ferry.deep_ep's low-latency calls (PyDeepEpLowLatency): their tensors checked and the steps
// run in one C++ call. The same checks in Python cost microseconds a call (a dozen tensor
// attributes read through the interpreter, each check a frame); here each tensor is read once
// (TorchArray) and checked from what was read. The constructors' checks, and everything decided
// once, stay in Python.
#include <memory>
#include <optional>
#include <string>

#include "all_to_all.h"
#include "binding.h"

namespace ferry::python {
namespace {

// torch's objects this file compares against or calls, looked up once (at the first layer
// made) and kept for the interpreter's life.
struct Torch {
  PyObject* bfloat16;
  PyObject* float32;
  PyObject* int32;
  PyObject* int64;
  PyObject* uint32;  // null before torch 2.3
  py::handle tensor_type;
  py::handle current_stream;  // (ordinal) -> the current cudaStream_t as an int

  static const Torch& Get() {
    static const Torch t = [] {
      py::module_ torch = py::module_::import("torch");
      auto dtype = [&](const char* name) {
        return py::hasattr(torch, name) ? py::object(torch.attr(name)).release().ptr() : nullptr;
      };
      Torch t{dtype("bfloat16"), dtype("float32"), dtype("int32"), dtype("int64"),
              dtype("uint32"),   py::object(torch.attr("Tensor")).release(),
              // torch's raw accessor where it has one (what compilers built on torch call),
              // else ferry's Python one over torch.cuda.current_stream.
              py::object(py::hasattr(torch.attr("_C"), "_cuda_getCurrentRawStream")
                             ? torch.attr("_C").attr("_cuda_getCurrentRawStream")
                             : py::module_::import("ferry._engine_api")
                                   .attr("current_stream_handle"))
                  .release()};
      return t;
    }();
    return t;
  }
};

// The caller's current torch stream on GPU `device` (a Tensor.get_device() ordinal), nullopt
// on the CPU (-1).
std::optional<void*> CurrentStream(int device) {
  if (device < 0) return std::nullopt;
  const py::object handle = Torch::Get().current_stream(device);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(py::cast<uint64_t>(handle)));
}

std::string Str(const py::handle& o) { return py::str(o); }
std::string Shape(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}
std::string Pair(int64_t a, int64_t b) {
  return "(" + std::to_string(a) + ", " + std::to_string(b) + ")";
}
[[noreturn]] void Invalid(const std::string& message) {
  ThrowIfError(InvalidArgumentError(message));
  throw std::logic_error("unreachable");
}

class PyPplx {
 public:
  // a2a: the ferry.AllToAll it runs on (expert-major, one shape); in_dtype: dp_x's torch dtype
  // (bfloat16, or e4m3 / uint8 with float32 scales per 128 columns); device: the tensors'
  // ordinal as Tensor.get_device() gives it (-1 the CPU).
  PyPplx(py::object a2a, py::object in_dtype, int64_t max_tokens, int64_t hidden, int64_t k,
         int64_t local_experts, int64_t max_recv_tokens, int padding, int device, double timeout)
      : a2a_object_(std::move(a2a)),
        a2a_(a2a_object_.cast<PyAllToAll*>()),
        in_dtype_(std::move(in_dtype)),
        fp8_(a2a_->config().dtype == DispatchDtype::kFp8E4M3),
        max_tokens_(max_tokens),
        hidden_(hidden),
        k_(k),
        local_experts_(local_experts),
        max_recv_tokens_(max_recv_tokens),
        padding_(padding),
        device_(device),
        timeout_(timeout),
        torch_(Torch::Get()) {
    CheckTimeout(timeout);
  }

  void Dispatch(const py::handle& out_expert_num_tokens, const py::handle& out_expert_x,
                const py::handle& out_expert_x_scale, const py::handle& dp_x,
                const py::handle& dp_x_scale, const py::handle& indices,
                const py::handle& weights, const py::handle& bound_m, bool do_send,
                bool do_recv) {
    if (!do_send && !do_recv) Invalid("dispatch: do_send or do_recv (or both)");
    Expect(do_send ? Stage::kIdle : Stage::kDispatched, "dispatch");
    std::optional<Array> x, x_scale, ids, w, bound, counts, out_x, out_scale;
    int64_t tokens = 0;
    if (do_send) {
      x = Tensor("dp_x", dp_x, in_dtype_.ptr(), 2);
      tokens = x->shape[0];
      if (x->shape[1] != hidden_ || tokens > max_tokens_) {
        Invalid("dp_x: shape " + Shape(x->shape) + ", at most " + Pair(max_tokens_, hidden_));
      }
      if (fp8_) {
        x_scale = Tensor("dp_x_scale", dp_x_scale, torch_.float32, 2);
        if (x_scale->shape != std::vector<int64_t>{tokens, hidden_ / 128}) {
          Invalid("dp_x_scale: shape " + Shape(x_scale->shape) + ", expected " +
                  Pair(tokens, hidden_ / 128));
        }
      } else if (!dp_x_scale.is_none()) {
        Invalid("dp_x_scale: bfloat16 input has no scales");
      }
      ids = Tensor("indices", indices, nullptr, 2);
      if (ids->dtype != torch_.int32 && ids->dtype != torch_.int64 &&
          (ids->dtype == nullptr || ids->dtype != torch_.uint32)) {
        Invalid("indices: dtype " + Str(ids->dtype) + ", expected int32, int64 or uint32");
      }
      w = Tensor("weights", weights, torch_.float32, 2);
      for (const auto& [name, a] : {std::pair{"indices", &*ids}, std::pair{"weights", &*w}}) {
        if (a->shape != std::vector<int64_t>{tokens, k_}) {
          Invalid(std::string(name) + ": shape " + Shape(a->shape) + ", expected " +
                  Pair(tokens, k_));
        }
      }
      if (!bound_m.is_none()) {
        // bound_m's value bounds the tokens sent: read here on the host device; on the GPU the
        // kernels read it (dp_x's rows being the most it may hold).
        bound = Tensor("bound_m", bound_m, torch_.int32, -1);
        if (bound->num_bytes != 4) {
          Invalid("bound_m: one int32, got " + std::to_string(bound->num_bytes / 4));
        }
        if (bound->on_host()) {
          const int32_t m = *static_cast<const int32_t*>(bound->pointer());
          if (m < 0 || m > tokens) {
            Invalid("bound_m " + std::to_string(m) + ": dp_x has " + std::to_string(tokens) +
                    " rows");
          }
          tokens = m;
          bound.reset();
        }
      }
    }
    if (do_recv) {
      counts = Tensor("out_expert_num_tokens", out_expert_num_tokens, torch_.int32, 1);
      if (counts->shape[0] != local_experts_) {
        Invalid("out_expert_num_tokens: " + std::to_string(local_experts_) + " entries, got " +
                std::to_string(counts->shape[0]));
      }
      out_x = Tensor("out_expert_x", out_expert_x, in_dtype_.ptr(), 2);
      if (out_x->shape[1] != hidden_ || out_x->shape[0] < max_recv_tokens_) {
        Invalid("out_expert_x: shape " + Shape(out_x->shape) + ", needs at least " +
                Pair(max_recv_tokens_, hidden_) +
                " (max_recv_tokens: the worst routing's padded blocks)");
      }
      if (fp8_) {
        out_scale = Tensor("out_expert_x_scale", out_expert_x_scale, torch_.float32, 2);
        if (out_scale->shape != std::vector<int64_t>{out_x->shape[0], hidden_ / 128}) {
          Invalid("out_expert_x_scale: shape " + Shape(out_scale->shape) + ", expected " +
                  Pair(out_x->shape[0], hidden_ / 128));
        }
      } else if (!out_expert_x_scale.is_none()) {
        Invalid("out_expert_x_scale: bfloat16 input has no scales");
      }
    }
    // ferry lays the padded blocks out itself (DispatchOutput::expert_padding).
    a2a_->Ordered(CurrentStream(device_), true, true, do_send, [&] {
      if (do_send) {
        a2a_->DispatchSendArrays(*x, *ids, *w, x_scale ? &*x_scale : nullptr,
                           static_cast<int>(tokens), bound ? &*bound : nullptr,
                           Fp8Scaling::kAmax);
      }
      if (do_recv) {
        a2a_->DispatchRecvArrays(*out_x, *counts, out_scale ? &*out_scale : nullptr, {}, timeout_,
                           padding_);
      }
    });
    if (do_recv) recv_rows_ = out_x->shape[0];
    stage_ = do_recv ? Stage::kReceived : Stage::kDispatched;
  }

  void Combine(const py::handle& out_tokens, const py::handle& /*indices*/,
               const py::handle& weights, const py::handle& expert_y,
               const py::handle& /*bound_m*/, bool do_send, bool do_recv, bool accumulate) {
    // The dispatch's ids and bound hold for its combine: ferry routes the rows back by what
    // the dispatch sent.
    if (!do_send && !do_recv) Invalid("combine: do_send or do_recv (or both)");
    Expect(do_send ? Stage::kReceived : Stage::kCombining, "combine");
    std::optional<Array> y, out, w;
    if (do_send) {
      y = Tensor("expert_y", expert_y, torch_.bfloat16, 2);
      if (y->shape != std::vector<int64_t>{recv_rows_, hidden_}) {
        Invalid("expert_y: shape " + Shape(y->shape) + ", out_expert_x was " +
                Pair(recv_rows_, hidden_));
      }
    }
    if (do_recv) {
      out = Tensor("out_tokens", out_tokens, torch_.bfloat16, 2);
      w = Tensor("weights", weights, torch_.float32, 2);
    }
    a2a_->Ordered(CurrentStream(device_), true, true, false, [&] {
      if (do_send) a2a_->CombineSendArray(*y, std::nullopt);
      if (do_recv) a2a_->CombineRecvArrays(*out, accumulate, timeout_, &*w);
    });
    stage_ = do_recv ? Stage::kIdle : Stage::kCombining;
  }

  std::string stage() const { return StageName(stage_); }

 private:
  enum class Stage { kIdle, kDispatched, kReceived, kCombining };
  static const char* StageName(Stage s) {
    switch (s) {
      case Stage::kIdle: return "idle";
      case Stage::kDispatched: return "dispatched";
      case Stage::kReceived: return "received";
      case Stage::kCombining: return "combining";
    }
    return "?";
  }
  void Expect(Stage stage, const char* call) const {
    if (stage_ != stage) {
      ThrowIfError(FailedPreconditionError(
          std::string(call) +
          " out of order: the halves run dispatch send, dispatch receive, combine send, "
          "combine receive (this AllToAll is at '" + StageName(stage_) + "')"));
    }
  }

  // `t` as an Array, InvalidArgument naming it unless it is a contiguous torch tensor of
  // `dtype` (null: any), `dims` dimensions (-1: any) and the layer's device.
  Array Tensor(const char* name, const py::handle& t, PyObject* dtype, int dims) const {
    const std::string n = name;
    std::optional<Array> a = TorchArray(t);
    if (!a) {
      if (!PyObject_TypeCheck(t.ptr(), reinterpret_cast<PyTypeObject*>(torch_.tensor_type.ptr()))) {
        Invalid(n + ": expected a torch.Tensor, got " + Str(py::type::of(t).attr("__name__")));
      }
      if (!py::cast<bool>(t.attr("is_contiguous")())) {
        Invalid(n + ": not contiguous (call .contiguous())");
      }
      Invalid(n + ": on " + Str(t.attr("device")) + ", ferry takes CPU and CUDA tensors");
    }
    if (dtype && a->dtype != dtype) {
      Invalid(n + ": dtype " + Str(a->dtype) + ", expected " + Str(dtype));
    }
    if (dims >= 0 && a->shape.size() != static_cast<size_t>(dims)) {
      Invalid(n + ": " + std::to_string(a->shape.size()) + " dimensions " + Shape(a->shape) +
              ", expected " + std::to_string(dims));
    }
    if (a->device != device_) {
      Invalid(n + ": on " + Str(t.attr("device")) + ", the others on " +
              (device_ < 0 ? std::string("cpu") : "cuda:" + std::to_string(device_)));
    }
    return std::move(*a);
  }

  py::object a2a_object_;  // keeps a2a_
  PyAllToAll* a2a_;
  py::object in_dtype_;
  bool fp8_;
  int64_t max_tokens_, hidden_, k_, local_experts_, max_recv_tokens_;
  int padding_, device_;
  double timeout_;
  const Torch& torch_;
  Stage stage_ = Stage::kIdle;
  int64_t recv_rows_ = 0;  // out_expert_x's rows at the last dispatch (expert_y's at combine)
};


// The common path of ferry.deep_ep.Buffer's low_latency_dispatch and low_latency_combine (bf16
// or e4m3 dispatch with amax or power-of-two scales, with or without the receive hook; no
// async_finish, no counters) in
// one C++ call, as PyPplx runs pplx's: in Python its checks and bookkeeping cost about ten
// microseconds a call. Python runs every other case, and the first calls of each shape (which
// make the AllToAll and its two output sets, then Add them here); a call this class does not
// take returns None before touching anything, and Python's path then runs it (with its error
// messages for bad arguments).
class PyDeepEpLowLatency {
 public:
  // handle_type: deep_ep's _Handle (made here as Python makes it); done: its finished
  // EventOverlap, what a call that waits returns.
  PyDeepEpLowLatency(int world, double timeout, py::object handle_type, py::object done)
      : world_(world),
        timeout_(timeout),
        handle_type_(std::move(handle_type)),
        done_(std::move(done)),
        torch_(Torch::Get()) {
    CheckTimeout(timeout);
  }

  // A low-latency AllToAll of one shape (its `pooled` entry: .a2a, .busy) with its output sets
  // (`sets`, the list of two (recv_x, recv_count, scales, packed) tuples Python rotates) and
  // the dispatch's unused weights (`ones`: float32 [m, k]).
  void Add(int device, int64_t m, int64_t hidden, int64_t experts, int64_t k, bool fp8,
           py::object pooled, py::list sets, py::object ones) {
    auto e = std::make_shared<Entry>(Entry{device, m, hidden, experts, k, fp8, pooled,
                                           pooled.attr("a2a").cast<PyAllToAll*>(),
                                           std::move(sets), TorchArray(ones), {}});
    if (!e->ones) Invalid("ones: not a contiguous CPU or CUDA tensor");
    entries_.push_back(std::move(e));
  }
  void Clear() { entries_.clear(); }

  // With `hook`, the send half now and the receive half in the returned hook, as DeepEP's
  // return_recv_hook=True.
  py::object Dispatch(const py::handle& x, const py::handle& topk_idx, int64_t m,
                      int64_t experts, bool fp8, bool round_scale, bool hook) {
    std::optional<Array> xa = TorchArray(x);
    if (!xa || xa->dtype != torch_.bfloat16 || xa->shape.size() != 2) return py::none();
    std::optional<Array> ia = TorchArray(topk_idx);
    if (!ia || (ia->dtype != torch_.int64 && ia->dtype != torch_.int32) ||
        ia->shape.size() != 2 || ia->device != xa->device || ia->shape[0] != xa->shape[0]) {
      return py::none();
    }
    const int64_t tokens = xa->shape[0], hidden = xa->shape[1], k = ia->shape[1];
    if (tokens > m || experts % world_ || hidden % 128) return py::none();
    const std::optional<void*> stream = CurrentStream(xa->device);
    std::shared_ptr<Entry> e = Find([&](const Entry& c) {
      return c.device == xa->device && c.m == m && c.hidden == hidden && c.experts == experts &&
             c.k == k && c.fp8 == fp8 && !c.pooled.attr("busy").cast<bool>();
    });
    // e4m3's scales are copied into DeepEP's layout after the receive: here only where that
    // copy may go on the caller's stream.
    if (!e || (fp8 && !e->a2a->RunsOn(stream))) return py::none();
    py::list sets = e->sets;
    sets.append(sets.attr("pop")(0));  // the older set, as Python's _ll_outputs takes it
    const py::tuple set = sets[py::len(sets) - 1];
    const OutputArrays out = e->Arrays(set);
    // The receive half, and e4m3's scales into DeepEP's layout (on the caller's stream).
    const double timeout = timeout_;
    auto recv = [e, out, timeout] {
      e->a2a->DispatchRecvArrays(out.recv_x, out.recv_count,
                                 out.scales ? &*out.scales : nullptr, {}, timeout, 0);
    };
    // The copy goes on the stream current when it runs: a hook may be called on another than
    // the dispatch's, whose stream (the AllToAll's) the receive went on; that stream then waits
    // for the copy, and the copy for the receive, as one stream would order them.
    auto layout = [e, set, fp8, stream, device = xa->device] {
      if (!fp8) return;
      const std::optional<void*> now = CurrentStream(device);
      const bool other = now && *now != *stream;
      if (other) e->a2a->Order(*now, false);
      set[3].attr("copy_")(set[2]);
      if (other) e->a2a->Order(*now, true);
    };
    e->pooled.attr("busy") = true;
    try {
      e->a2a->Ordered(stream, true, true, true, [&] {
        e->a2a->DispatchSendArrays(*xa, *ia, *e->ones, nullptr, static_cast<int>(tokens),
                                   nullptr,
                                   round_scale ? Fp8Scaling::kPowerOfTwo : Fp8Scaling::kAmax);
        if (!hook) recv();
      });
      if (!hook) layout();
    } catch (...) {
      e->pooled.attr("busy") = false;  // a failed call frees its AllToAll, as Python's does
      throw;
    }
    py::object handle = handle_type_(e->pooled, tokens, k, hidden, experts, topk_idx, m);
    py::object out_x = fp8 ? py::object(py::make_tuple(set[0], set[3])) : py::object(set[0]);
    py::object recv_hook = py::none();
    if (hook) {
      // The receive ordered before the caller's stream only: after it, it would wait for what
      // the caller overlapped with the transfer. A failure frees the handle (the AllToAll
      // reports it to the next call), as Python's hook does.
      recv_hook = py::cpp_function([e, stream, recv, layout, handle]() {
        try {
          e->a2a->Ordered(stream, false, true, false, recv);
          layout();
        } catch (...) {
          handle.attr("pooled").attr("busy") = false;
          handle.attr("in_flight") = false;
          throw;
        }
      });
    }
    return py::make_tuple(out_x, set[1], handle, done_, recv_hook);
  }

  py::object Combine(const py::handle& x, const py::handle& topk_idx,
                     const py::handle& topk_weights, const py::handle& handle,
                     const py::handle& out, bool hook) {
    if (!py::isinstance(handle, handle_type_) || !handle.attr("rows").is_none() ||
        !handle.attr("in_flight").cast<bool>()) {
      return py::none();
    }
    const py::object pooled = handle.attr("pooled");
    std::shared_ptr<Entry> e = Find([&](const Entry& c) { return c.pooled.is(pooled); });
    if (!e) return py::none();
    const int64_t tokens = handle.attr("tokens").cast<int64_t>();
    std::optional<Array> xa = TorchArray(x), ia = TorchArray(topk_idx),
                         wa = TorchArray(topk_weights);
    if (!xa || !ia || !wa || xa->dtype != torch_.bfloat16 || xa->device != e->device ||
        xa->shape != std::vector<int64_t>{e->experts / world_, world_ * e->m, e->hidden} ||
        (ia->dtype != torch_.int64 && ia->dtype != torch_.int32) || wa->dtype != torch_.float32 ||
        ia->device != e->device || wa->device != e->device ||
        ia->shape != std::vector<int64_t>{tokens, e->k} || wa->shape != ia->shape) {
      return py::none();
    }
    py::object result = py::reinterpret_borrow<py::object>(out);
    std::optional<Array> oa;
    if (out.is_none()) {
      result = x.attr("new_empty")(py::make_tuple(tokens, e->hidden));  // bf16, x's device
      oa = TorchArray(result);
    } else {
      oa = TorchArray(out);
      if (!oa || oa->dtype != torch_.bfloat16 || oa->device != e->device ||
          oa->shape != std::vector<int64_t>{tokens, e->hidden}) {
        return py::none();
      }
    }
    const std::optional<void*> stream = CurrentStream(e->device);
    const py::object h = py::reinterpret_borrow<py::object>(handle);
    const auto release = [e, h] {  // the handle combined (or failed), its AllToAll free
      e->pooled.attr("busy") = false;
      h.attr("in_flight") = false;
    };
    const double timeout = timeout_;
    auto recv = [e, out = *oa, w = *wa, timeout] {
      e->a2a->CombineRecvArrays(out, false, timeout, &w);
    };
    try {
      e->a2a->Ordered(stream, true, true, false, [&] {
        e->a2a->CombineSendArray(*xa, std::nullopt);
        if (!hook) recv();
      });
    } catch (...) {
      release();
      throw;
    }
    if (!hook) {
      release();
      return py::make_tuple(result, done_, py::none());
    }
    return py::make_tuple(result, done_, py::cpp_function([e, stream, recv, release] {
      try {
        e->a2a->Ordered(stream, false, true, false, recv);
      } catch (...) {
        release();
        throw;
      }
      release();
    }));
  }

 private:
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
  py::object handle_type_, done_;
  const Torch& torch_;
  // Shared with the hooks a call returns: a hook outlives the call, and Add may move entries.
  std::vector<std::shared_ptr<Entry>> entries_;
};
}  // namespace

void BindEngineApi(py::module_& m) {
  py::class_<PyPplx>(m, "PplxSteps",
                     "pplx-garden's dispatch and combine over a ferry.AllToAll (what "
                     "ferry.pplx.AllToAll subclasses; construct that instead)")
      .def(py::init<py::object, py::object, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                    double>(),
           py::arg("a2a"), py::arg("in_dtype"), py::arg("max_tokens"), py::arg("hidden"),
           py::arg("k"), py::arg("local_experts"), py::arg("max_recv_tokens"),
           py::arg("padding"), py::arg("device"), py::arg("timeout"))
      .def("dispatch", &PyPplx::Dispatch, py::arg("out_expert_num_tokens"),
           py::arg("out_expert_x"), py::arg("out_expert_x_scale"), py::arg("dp_x"),
           py::arg("dp_x_scale"), py::arg("indices"), py::arg("weights"),
           py::arg("bound_m") = py::none(), py::arg("do_send") = true, py::arg("do_recv") = true,
           "Each local expert's tokens into out_expert_x, expert-major, each block's rows "
           "rounded up to expert_padding; out_expert_num_tokens the unpadded counts")
      .def("combine", &PyPplx::Combine, py::arg("out_tokens"), py::arg("indices"),
           py::arg("weights"), py::arg("expert_y"), py::arg("bound_m") = py::none(),
           py::arg("do_send") = true, py::arg("do_recv") = true, py::arg("accumulate") = false,
           "Each token's weighted sum of its experts' rows of expert_y into out_tokens (added "
           "to it with accumulate)")
      .def_property_readonly("stage", &PyPplx::stage,
                             "Where the halves stand: idle, dispatched, received, combining");
  py::class_<PyDeepEpLowLatency>(m, "DeepEpLowLatency",
                                 "The common path of ferry.deep_ep.Buffer's low-latency calls "
                                 "(what the Buffer uses; call the Buffer instead)")
      .def(py::init<int, double, py::object, py::object>(), py::arg("world"),
           py::arg("timeout"), py::arg("handle_type"), py::arg("done"))
      .def("add", &PyDeepEpLowLatency::Add, py::arg("device"), py::arg("m"), py::arg("hidden"),
           py::arg("experts"), py::arg("k"), py::arg("fp8"), py::arg("pooled"), py::arg("sets"),
           py::arg("ones"))
      .def("clear", &PyDeepEpLowLatency::Clear)
      .def("dispatch", &PyDeepEpLowLatency::Dispatch, py::arg("x"), py::arg("topk_idx"),
           py::arg("m"), py::arg("experts"), py::arg("fp8"), py::arg("round_scale"),
           py::arg("hook"),
           "low_latency_dispatch's result, or None where the Buffer's Python path must run it")
      .def("combine", &PyDeepEpLowLatency::Combine, py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("handle"), py::arg("out"), py::arg("hook"),
           "low_latency_combine's result, or None where the Buffer's Python path must run it");
}

}  // namespace ferry::python
