// The per-call halves of ferry.pplx.AllToAll (python/ferry/pplx.py subclasses PyPplx): its
// tensors checked and the steps run in one C++ call. The same checks in Python cost
// microseconds a call (a dozen tensor attributes read through the interpreter, each check a
// frame); here each tensor is read once (TorchArray) and checked from what was read. The
// constructor's checks, and everything decided once, stay in Python. deep_ep.cc does the same
// for ferry.deep_ep's low-latency calls.
#include "compat.h"

#include <array>
#include <optional>
#include <string>

#include "all_to_all.h"
#include "binding.h"
#include "fast_call.h"

namespace ferry::python {
namespace {

class PyPplx {
 public:
  // a2a: the ferry.AllToAll it runs on (expert-major, one shape); in_dtype: dp_x's torch dtype
  // (bfloat16, float32 -- the combine's expert_y and out_tokens then float32 too --, or e4m3 /
  // uint8 with float32 scales per 128 columns); device: the tensors'
  // ordinal as Tensor.get_device() gives it (-1 the CPU); block: pplx's max_tokens_per_expert
  // (each local expert's rows at a fixed block of that many; 0: padded blocks back to back).
  PyPplx(py::object a2a, py::object in_dtype, int64_t max_tokens, int64_t hidden, int64_t k,
         int64_t local_experts, int64_t max_recv_tokens, int padding, int device, double timeout,
         int64_t block)
      : a2a_object_(std::move(a2a)),
        a2a_(a2a_object_.cast<PyAllToAll*>()),
        in_dtype_(std::move(in_dtype)),
        scales_(a2a_->config().scales_per_token()),
        max_tokens_(max_tokens),
        hidden_(hidden),
        k_(k),
        local_experts_(local_experts),
        max_recv_tokens_(max_recv_tokens),
        padding_(padding),
        device_(device),
        block_(block),
        timeout_(timeout),
        torch_(Torch::Get()),
        out_dtype_(a2a_->config().combines_fp32() ? torch_.float32 : torch_.bfloat16),
        // 2-byte rows move as they are, so float16 ones go where bfloat16 ones do; a 2-byte
        // combine takes either (CombineInput::fp16), as pplx-kernels' takes its expert_y.
        row_alt_(in_dtype_.ptr() == torch_.bfloat16 ? torch_.float16 : nullptr),
        out_alt_(out_dtype_ == torch_.bfloat16 ? torch_.float16 : nullptr) {
    CheckTimeout(timeout);
  }

  void Dispatch(const py::handle& out_expert_num_tokens, const py::handle& out_expert_x,
                const py::handle& out_expert_x_scale, const py::handle& dp_x,
                const py::handle& dp_x_scale, const py::handle& indices, const py::handle& weights,
                const py::handle& bound_m, bool do_send, bool do_recv) {
    if (!do_send && !do_recv) Invalid("dispatch: do_send or do_recv (or both)");
    Expect(do_send ? Stage::kIdle : Stage::kDispatched, "dispatch");
    std::optional<Array> x, x_scale, ids, w, bound, counts, out_x, out_scale;
    const Array* w_used = nullptr;  // w, or ones_ for a dispatch given no weights
    int64_t tokens = 0;
    if (do_send) {
      x = Tensor("dp_x", dp_x, in_dtype_.ptr(), 2, row_alt_);
      tokens = x->shape[0];
      if (x->shape[1] != hidden_ || tokens > max_tokens_) {
        Invalid("dp_x: shape " + Shape(x->shape) + ", at most " + Pair(max_tokens_, hidden_));
      }
      if (scales_ > 0) {  // fp8 rows carry scales
        x_scale = Tensor("dp_x_scale", dp_x_scale, torch_.float32, 2);
        if (x_scale->shape != std::vector<int64_t>{tokens, scales_}) {
          Invalid("dp_x_scale: shape " + Shape(x_scale->shape) + ", expected " +
                  Pair(tokens, scales_));
        }
      } else if (!dp_x_scale.is_none()) {
        Invalid("dp_x_scale: " + Str(in_dtype_.ptr()) + " input has no scales");
      }
      ids = Tensor("indices", indices, nullptr, 2);
      if (ids->dtype != torch_.int32 && ids->dtype != torch_.int64 &&
          (ids->dtype == nullptr || ids->dtype != torch_.uint32)) {
        Invalid("indices: dtype " + Str(ids->dtype) + ", expected int32, int64 or uint32");
      }
      const auto expect_tokens_by_k = [&](const char* name, const Array& a) {
        if (a.shape != std::vector<int64_t>{tokens, k_}) {
          Invalid(std::string(name) + ": shape " + Shape(a.shape) + ", expected " +
                  Pair(tokens, k_));
        }
      };
      expect_tokens_by_k("indices", *ids);
      if (weights.is_none() && ones_) {
        w_used = &*ones_;  // [max_tokens, k]: its first rows serve any token count
      } else {
        w = Tensor("weights", weights, torch_.float32, 2);
        expect_tokens_by_k("weights", *w);
        w_used = &*w;
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
      // [rows, hidden], or with max_tokens_per_expert also [local experts, it, hidden] (pplx's
      // batched layout).
      out_x = Tensor("out_expert_x", out_expert_x, in_dtype_.ptr(), -1, row_alt_);
      std::vector<int64_t> scale_shape = out_x->shape;
      if (out_x->shape.size() == 3 && block_ > 0) {
        if (out_x->shape != std::vector<int64_t>{local_experts_, block_, hidden_}) {
          Invalid("out_expert_x: shape " + Shape(out_x->shape) + ", expected [" +
                  std::to_string(local_experts_) + ", " + std::to_string(block_) + ", " +
                  std::to_string(hidden_) + "] (local experts, max_tokens_per_expert, hidden)");
        }
      } else if (out_x->shape.size() != 2 || out_x->shape[1] != hidden_ ||
                 out_x->shape[0] < max_recv_tokens_) {
        Invalid("out_expert_x: shape " + Shape(out_x->shape) + ", needs at least " +
                Pair(max_recv_tokens_, hidden_) +
                (block_ > 0
                     ? " (local experts times max_tokens_per_expert rows), or [" +
                           std::to_string(local_experts_) + ", " + std::to_string(block_) + ", " +
                           std::to_string(hidden_) + "]"
                     : std::string(" (max_recv_tokens: the worst routing's padded blocks)")));
      }
      scale_shape.back() = scales_;
      if (scales_ > 0) {  // fp8 rows carry scales
        out_scale = Tensor("out_expert_x_scale", out_expert_x_scale, torch_.float32, -1);
        if (out_scale->shape != scale_shape) {
          Invalid("out_expert_x_scale: shape " + Shape(out_scale->shape) + ", expected " +
                  Shape(scale_shape));
        }
      } else if (!out_expert_x_scale.is_none()) {
        Invalid("out_expert_x_scale: " + Str(in_dtype_.ptr()) + " input has no scales");
      }
    }
    // ferry lays the padded blocks out itself (DispatchOutput::expert_padding).
    a2a_->Ordered(CurrentStream(device_), true, true, do_send, [&] {
      if (do_send) {
        a2a_->DispatchSendArrays(*x, *ids, *w_used, x_scale ? &*x_scale : nullptr,
                                 static_cast<int>(tokens), bound ? &*bound : nullptr,
                                 Fp8Scaling::kAmax);
      }
      if (do_recv) {
        a2a_->DispatchRecvArrays(*out_x, *counts, out_scale ? &*out_scale : nullptr, {}, timeout_,
                                 padding_, nullptr, block_);
      }
    });
    if (do_recv) recv_shape_ = out_x->shape;
    stage_ = do_recv ? Stage::kReceived : Stage::kDispatched;
  }

  void Combine(const py::handle& out_tokens, const py::handle& /*indices*/,
               const py::handle& weights, const py::handle& expert_y, const py::handle& /*bound_m*/,
               bool do_send, bool do_recv, bool accumulate) {
    // The dispatch's ids and bound hold for its combine: ferry routes the rows back by what
    // the dispatch sent.
    if (!do_send && !do_recv) Invalid("combine: do_send or do_recv (or both)");
    Expect(do_send ? Stage::kReceived : Stage::kCombining, "combine");
    std::optional<Array> y, out, w;
    if (do_send) {
      y = Tensor("expert_y", expert_y, out_dtype_, -1, out_alt_);
      if (y->shape != recv_shape_) {
        Invalid("expert_y: shape " + Shape(y->shape) + ", out_expert_x was " + Shape(recv_shape_));
      }
    }
    if (do_recv) {
      out = Tensor("out_tokens", out_tokens, out_dtype_, 2, out_alt_);
      w = Tensor("weights", weights, torch_.float32, 2);
      // The sums come back in expert_y's element: out_tokens holds the same.
      PyObject* sent = do_send ? y->dtype : sent_dtype_;
      if (out->dtype != sent) {
        Invalid("out_tokens: dtype " + Str(out->dtype) + ", and expert_y was " + Str(sent) +
                " (ferry returns the sums in expert_y's dtype)");
      }
    }
    if (do_send) sent_dtype_ = y->dtype;
    a2a_->Ordered(CurrentStream(device_), true, true, false, [&] {
      if (do_send) a2a_->CombineSendArray(*y, std::nullopt);
      if (do_recv) a2a_->CombineRecvArrays(*out, accumulate, timeout_, &*w);
    });
    stage_ = do_recv ? Stage::kIdle : Stage::kCombining;
  }

  // pplx-kernels' dispatch: no weights (the combine takes them); `ones` (float32 [max_tokens,
  // k], set by UseOnes) stands in for them, its values unused.
  void DispatchUnweighted(const py::handle& out_expert_num_tokens, const py::handle& out_expert_x,
                          const py::handle& out_expert_x_scale, const py::handle& dp_x,
                          const py::handle& dp_x_scale, const py::handle& indices,
                          const py::handle& bound_m, bool do_send, bool do_recv) {
    if (!ones_) Invalid("dispatch without weights: this AllToAll has no stand-in (use_ones)");
    Dispatch(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices,
             py::none(), bound_m, do_send, do_recv);
  }
  void UseOnes(const py::handle& ones) {
    Array a = Tensor("ones", ones, torch_.float32, 2);
    if (a.shape != std::vector<int64_t>{max_tokens_, k_}) {
      Invalid("ones: shape " + Shape(a.shape) + ", expected " + Pair(max_tokens_, k_));
    }
    ones_ = std::move(a);
  }

  std::string stage() const { return StageName(stage_); }

 private:
  enum class Stage { kIdle, kDispatched, kReceived, kCombining };
  static const char* StageName(Stage s) {
    switch (s) {
      case Stage::kIdle:
        return "idle";
      case Stage::kDispatched:
        return "dispatched";
      case Stage::kReceived:
        return "received";
      case Stage::kCombining:
        return "combining";
    }
    return "?";
  }
  void Expect(Stage stage, const char* call) const {
    if (stage_ != stage) {
      ThrowIfError(FailedPreconditionError(
          std::string(call) +
          " out of order: the halves run dispatch send, dispatch receive, combine send, "
          "combine receive (this AllToAll is at '" +
          StageName(stage_) + "')"));
    }
  }

  // `t` as an Array (TensorArg) on the layer's device.
  Array Tensor(const char* name, const py::handle& t, PyObject* dtype, int dims,
               PyObject* alt = nullptr) const {
    return TensorArg(name, t, dtype, dims, device_, alt);
  }

  py::object a2a_object_;  // keeps a2a_
  PyAllToAll* a2a_;
  py::object in_dtype_;
  int64_t scales_;  // fp32 scales per row: fp8 only (AllToAllConfig::scales_per_token)
  int64_t max_tokens_, hidden_, k_, local_experts_, max_recv_tokens_;
  int padding_, device_;
  int64_t block_;
  double timeout_;
  const Torch& torch_;
  PyObject* out_dtype_;  // expert_y's and out_tokens': float32 where the combine is, else bfloat16
  PyObject* row_alt_;    // float16 where the rows are bfloat16 (2 bytes), else null
  PyObject* out_alt_;    // float16 where out_dtype_ is bfloat16, else null
  PyObject* sent_dtype_ = nullptr;  // expert_y's at the last combine's send half
  Stage stage_ = Stage::kIdle;
  std::optional<Array> ones_;        // a dispatch's weights where it is given none (UseOnes)
  std::vector<int64_t> recv_shape_;  // out_expert_x's at the last dispatch (expert_y's then)
};
}  // namespace

Array TensorArg(const char* name, const py::handle& t, PyObject* dtype, int dims, int device,
                PyObject* alt) {
  const std::string n = name;
  std::optional<Array> a = TorchArray(t);
  if (!a) {
    if (!PyObject_TypeCheck(t.ptr(),
                            reinterpret_cast<PyTypeObject*>(Torch::Get().tensor_type.ptr()))) {
      Invalid(n + ": expected a torch.Tensor, got " + Str(py::type::of(t).attr("__name__")));
    }
    if (!py::cast<bool>(t.attr("is_contiguous")())) {
      Invalid(n + ": not contiguous (call .contiguous())");
    }
    Invalid(n + ": on " + Str(t.attr("device")) + ", ferry takes CPU and CUDA tensors");
  }
  if (dtype && a->dtype != dtype && (!alt || a->dtype != alt)) {
    Invalid(n + ": dtype " + Str(a->dtype) + ", expected " + Str(dtype) +
            (alt ? " or " + Str(alt) : std::string()));
  }
  if (dims >= 0 && a->shape.size() != static_cast<size_t>(dims)) {
    Invalid(n + ": " + std::to_string(a->shape.size()) + " dimensions " + Shape(a->shape) +
            ", expected " + std::to_string(dims));
  }
  if (device != kAnyDevice && a->device != device) {
    Invalid(n + ": on " + Str(t.attr("device")) + ", the others on " +
            (device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device)));
  }
  return std::move(*a);
}

namespace {

// ferry.compat._group.check_tensor(name, t, dtype=None, dims=None, device=None): TensorArg from
// Python, its dtype None (any), a dtype, or a tuple of one or two; dims and device None (any).
// Every Python check of a layer's tensor is this one, so the layers' messages are one set.
PyObject* CheckTensor(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static constexpr std::array<const char*, 5> kNames{"name", "t", "dtype", "dims", "device"};
  return AsMethod([&]() -> PyObject* {
    std::array<PyObject*, 5> a;
    Match("check_tensor", kNames, 2, args, nargs, kwnames, a);
    if (!PyUnicode_Check(a[0])) throw py::type_error("check_tensor(): name is a str");
    PyObject* dtype = IsNone(a[2]) ? nullptr : a[2];
    PyObject* alt = nullptr;
    if (dtype && PyTuple_Check(dtype)) {
      const Py_ssize_t n = PyTuple_GET_SIZE(dtype);
      if (n < 1 || n > 2) throw py::type_error("check_tensor(): one or two dtypes");
      alt = n == 2 ? PyTuple_GET_ITEM(dtype, 1) : nullptr;
      dtype = PyTuple_GET_ITEM(dtype, 0);
    }
    const int dims = IsNone(a[3]) ? -1 : static_cast<int>(Int("dims", a[3]));
    const int device = IsNone(a[4]) ? kAnyDevice : static_cast<int>(Int("device", a[4]));
    TensorArg(PyUnicode_AsUTF8(a[0]), a[1], dtype, dims, device, alt);
    Py_RETURN_NONE;
  });
}

PyMethodDef check_tensor_def = {
    "check_tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(CheckTensor)),
    METH_FASTCALL | METH_KEYWORDS,
    "check_tensor(name, t, dtype=None, dims=None, device=None): InvalidArgument naming `name` "
    "unless t is a contiguous CPU or CUDA torch tensor of dtype (one, or a tuple of two), dims "
    "dimensions, on device (Tensor.get_device()'s ordinal: -1 the CPU)"};

}  // namespace

PooledAllToAll::PooledAllToAll(py::object a2a)
    : a2a(std::move(a2a)), raw(this->a2a.cast<PyAllToAll*>()) {}

void BindCompat(py::module_& m) {
  py::object check_tensor =
      py::reinterpret_steal<py::object>(PyCFunction_NewEx(&check_tensor_def, nullptr, m.ptr()));
  if (!check_tensor) throw py::error_already_set();
  m.attr("check_tensor") = check_tensor;
  py::class_<PooledAllToAll, std::shared_ptr<PooledAllToAll>>(
      m, "PooledAllToAll",
      "One AllToAll of a compatibility layer's pool, busy while a call holds it")
      .def(py::init<py::object>(), py::arg("a2a"))
      .def_readonly("a2a", &PooledAllToAll::a2a)
      .def_readwrite("busy", &PooledAllToAll::busy);
  py::class_<PyPplx>(m, "PplxSteps",
                     "pplx-garden's dispatch and combine over a ferry.AllToAll (what "
                     "ferry.pplx.AllToAll subclasses; construct that instead)")
      .def(py::init<py::object, py::object, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                    double, int64_t>(),
           py::arg("a2a"), py::arg("in_dtype"), py::arg("max_tokens"), py::arg("hidden"),
           py::arg("k"), py::arg("local_experts"), py::arg("max_recv_tokens"), py::arg("padding"),
           py::arg("device"), py::arg("timeout"), py::arg("block") = 0)
      .def("dispatch", &PyPplx::Dispatch, py::arg("out_expert_num_tokens"), py::arg("out_expert_x"),
           py::arg("out_expert_x_scale"), py::arg("dp_x"), py::arg("dp_x_scale"),
           py::arg("indices"), py::arg("weights"), py::arg("bound_m") = py::none(),
           py::arg("do_send") = true, py::arg("do_recv") = true,
           "Each local expert's tokens into out_expert_x, expert-major, each block's rows "
           "rounded up to expert_padding; out_expert_num_tokens the unpadded counts")
      .def("combine", &PyPplx::Combine, py::arg("out_tokens"), py::arg("indices"),
           py::arg("weights"), py::arg("expert_y"), py::arg("bound_m") = py::none(),
           py::arg("do_send") = true, py::arg("do_recv") = true, py::arg("accumulate") = false,
           "Each token's weighted sum of its experts' rows of expert_y into out_tokens (added "
           "to it with accumulate)")
      .def("dispatch_unweighted", &PyPplx::DispatchUnweighted, py::arg("out_expert_num_tokens"),
           py::arg("out_expert_x"), py::arg("out_expert_x_scale"), py::arg("dp_x"),
           py::arg("dp_x_scale"), py::arg("indices"), py::arg("bound_m") = py::none(),
           py::arg("do_send") = true, py::arg("do_recv") = true,
           "dispatch without weights (pplx-kernels' signature): the combine takes them")
      .def("use_ones", &PyPplx::UseOnes, py::arg("ones"),
           "The float32 [max_tokens, k] tensor a dispatch given no weights reads in their place")
      .def_property_readonly("stage", &PyPplx::stage,
                             "Where the halves stand: idle, dispatched, received, combining");
}

}  // namespace ferry::python
