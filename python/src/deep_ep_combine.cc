// ferry.deep_ep.Buffer's normal-mode combine (deep_ep_normal.h).
#include <optional>
#include <string>

#include "all_to_all.h"
#include "deep_ep_hooks.h"
#include "deep_ep_normal.h"
#include "fast_call.h"

namespace ferry::python {

py::object DeepEpNormal::Combine(PyObject* self,
                                 const std::array<PyObject*, kCombineArgs.size()>& a) {
  if (closed_) Invalid("combine: the Buffer was destroyed");
  const Hooks& hooks = Hooks::Get();
  const Torch& torch = Torch::Get();
  const std::shared_ptr<DeepEpHandle> h = NormalHandleOf(a[1], "combine");
  if (!h->in_flight) Invalid("combine: the handle's dispatch was combined already");
  const py::object x = py::reinterpret_borrow<py::object>(a[0]);
  const Array xa = TensorArg("x", x, torch.bfloat16, 2, kAnyDevice);
  const int device = xa.device;
  const int64_t rows = py::cast<int64_t>(h->rows);
  if (xa.shape != std::vector<int64_t>{rows, h->hidden}) {
    Invalid("x: shape " + Shape(xa.shape) + ", the dispatch received " + Pair(rows, h->hidden));
  }
  const py::object topk_weights =
      IsNone(a[2]) ? py::object(py::none()) : py::reinterpret_borrow<py::object>(a[2]);
  if (!topk_weights.is_none()) {
    const Array wa = TensorArg("topk_weights", topk_weights, torch.float32, 2, device);
    if (wa.shape[0] != rows) {
      Invalid("topk_weights: " + std::to_string(wa.shape[0]) + " rows, the dispatch received " +
              std::to_string(rows));
    }
  }
  // The handle as Python's hooks take it, made where one is called.
  py::object h_object;
  auto handle_object = [&]() -> const py::object& {
    if (!h_object) h_object = py::cast(h);
    return h_object;
  };
  const py::tuple biases =
      IsNone(a[3]) ? py::tuple()
                   : py::tuple(CallHook(self, hooks.biases, py::handle(a[3]), handle_object(), x));
  const py::object previous =
      IsNone(a[5]) ? py::object(py::none()) : py::reinterpret_borrow<py::object>(a[5]);
  const bool async = Flag(a[6], false);
  PyAllToAll* const a2a = h->pooled->raw;
  const py::object& a2a_object = h->pooled->a2a;
  Array oa;
  const py::object out = EmptyTensor(torch.bfloat16, {h->tokens, h->hidden}, device, &oa);
  py::object sums = py::none(), kept = py::tuple();
  const std::optional<void*> stream = CurrentStream(device);
  const py::object current = StreamObject(stream);
  try {
    bool waited_previous = false;
    if (!previous.is_none() && !previous.attr(hooks.event).is_none()) {
      CallHook(self, hooks.wait_previous, previous, a2a_object, current, x.attr(hooks.device));
      waited_previous = true;
    }
    a2a->Ordered(stream, !waited_previous, !async, false, [&] {
      if (!biases.empty()) {  // the sums start from the bias: out, taken with accumulate
        CallHook(self, hooks.from_bias, out, biases, a2a_object, current, x.attr(hooks.device));
      }
      a2a->CombineSendArray(xa, rows);
      a2a->CombineRecvArrays(oa, !biases.empty(), timeout_, nullptr);
      if (!topk_weights.is_none()) {
        const py::tuple w =
            CallHook(self, hooks.combine_weights, handle_object(), x, topk_weights, current);
        sums = w[0];
        kept = w[1];
      }
    });
  } catch (...) {
    Release(*h);
    throw;
  }
  Release(*h);
  py::object event = done_;
  if (async) {
    py::dict kwargs;
    kwargs["waited"] = false;
    kwargs["device"] = x.attr(hooks.device);
    event = CallHook(self, hooks.end, a2a_object, current, true,
                     py::make_tuple(x, topk_weights) + biases + py::tuple(kept),
                     py::make_tuple(out, sums), **kwargs);
  }
  return py::make_tuple(out, sums, event);
}

}  // namespace ferry::python
