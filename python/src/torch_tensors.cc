// Tensors through ferry._ferry_torch (torch_api.h) where it loads, else through torch's Python
// API: the loader, the switch, the allocation the layers' calls make their outputs with, and
// the token-major receive into tensors it makes (DispatchRecvNew).
#include "torch_tensors.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "binding.h"
#include "compat.h"
#include "fast_call.h"

namespace ferry::python {
namespace {

// Whether TorchGlue may hand out the module's calls (ferry._ferry._use_torch_glue switches it,
// so that the tests run the Python path too and the benchmarks compare the two).
bool glue_enabled = true;

const TorchApi* LoadGlue() {
  // Imported by its full name first: PyCapsule_Import looks a submodule up as an attribute
  // of its package, which it is only once imported.
  PyObject* module = PyImport_ImportModule("ferry._ferry_torch");
  PyObject* capsule = module ? PyObject_GetAttrString(module, "_api") : nullptr;
  Py_XDECREF(module);
  void* api = capsule ? PyCapsule_GetPointer(capsule, kTorchApiCapsule) : nullptr;
  Py_XDECREF(capsule);  // the module, which torch's lifetime keeps, holds it
  if (!api) {
    PyErr_Clear();  // not built, or built for another torch: the Python path
    return nullptr;
  }
  const auto* a = static_cast<const TorchApi*>(api);
  return a->version == TorchApi::kVersion ? a : nullptr;
}

}  // namespace

const TorchApi* TorchGlue() {
  if (!glue_enabled) return nullptr;
  // Imported at the first call, which a torch tensor or dtype brought (torch imported already:
  // ferry never imports it itself).
  static const TorchApi* const api = LoadGlue();
  return api;
}

py::object EmptyTensor(PyObject* dtype, std::initializer_list<int64_t> shape, int device,
                       Array* array) {
  return EmptyTensor(dtype, std::vector<int64_t>(shape), device, array);
}

py::object EmptyTensor(PyObject* dtype, const std::vector<int64_t>& shape, int device,
                       Array* array) {
  py::object t;
  if (const TorchApi* glue = TorchGlue()) {
    uint64_t data = 0;
    t = py::reinterpret_steal<py::object>(
        glue->empty(dtype, shape.data(), static_cast<int>(shape.size()), device, &data));
    if (!t) throw py::error_already_set();
  } else {
    static const py::handle empty =
        py::object(py::module_::import("torch").attr("empty")).release();
    py::tuple sizes(shape.size());
    size_t i = 0;
    for (int64_t n : shape) sizes[i++] = py::int_(n);
    t = empty(sizes, py::arg("dtype") = py::handle(dtype),
              py::arg("device") = device < 0 ? py::object(py::str("cpu")) : py::int_(device));
  }
  if (array) {
    std::optional<Array> a = TorchArray(t);
    if (!a) Invalid("EmptyTensor: torch made no contiguous tensor");
    *array = std::move(*a);
  }
  return t;
}

namespace {

// _ferry.first_rows(count, *tensors): each tensor's first `count` rows (t[:count]), None as
// None; one call for the several views a layer's call returns.
PyObject* FirstRows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return AsMethod([&]() -> PyObject* {
    if (nargs < 1) throw py::type_error("first_rows() takes the count, then tensors");
    const int64_t count = Int("count", args[0]);
    if (count < 0) Invalid("first_rows: count " + std::to_string(count) + " (at least 0)");
    py::tuple out(nargs - 1);
    for (Py_ssize_t i = 1; i < nargs; ++i) {
      PyTuple_SET_ITEM(out.ptr(), i - 1, FirstRowsOf(args[i], count).release().ptr());
    }
    return out.release().ptr();
  });
}

// _ferry.empty(dtype, device, *shape): EmptyTensor from Python, for the layers' outputs made
// in Python code (torch.empty costs microseconds more on the GPU).
PyObject* Empty(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return AsMethod([&]() -> PyObject* {
    if (nargs < 2 || nargs > 2 + kTorchMaxDims) {
      throw py::type_error("empty() takes a dtype, a device, then up to " +
                           std::to_string(kTorchMaxDims) + " sizes");
    }
    const int64_t device = Int("device", args[1]);
    std::vector<int64_t> shape;
    for (Py_ssize_t i = 2; i < nargs; ++i) {
      shape.push_back(Int("size", args[i]));
      if (shape.back() < 0) Invalid("empty: size " + std::to_string(shape.back()));
    }
    if (device < -1) Invalid("empty: device " + std::to_string(device));
    return EmptyTensor(args[0], shape, static_cast<int>(device)).release().ptr();
  });
}

PyMethodDef empty_def = {
    "empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Empty)), METH_FASTCALL,
    "empty(dtype, device, *shape): a new contiguous tensor (device: Tensor.get_device()'s "
    "ordinal, -1 the CPU), made in C++ where _ferry_torch is loaded, else by torch.empty"};

PyMethodDef first_rows_def = {
    "first_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FirstRows)),
    METH_FASTCALL,
    "first_rows(count, *tensors): each tensor's first count rows (t[:count]; None stays None), "
    "as a tuple"};

}  // namespace

namespace {

// Items [first, first + count) of a flat view of `a`'s (contiguous) items.
Array Part(const Array& a, int64_t first, int64_t count) {
  Array p = a;
  p.data += static_cast<uint64_t>(first * a.item_bytes);
  p.num_bytes = static_cast<uint64_t>(count * a.item_bytes);
  p.shape = {count};
  return p;
}

}  // namespace

py::object FirstRowsOf(const py::handle& t, int64_t count) {
  if (t.is_none()) return py::none();
  PyObject* view;
  if (const TorchApi* glue = TorchGlue()) {
    view = glue->first_rows(t.ptr(), count);
  } else {
    const py::object slice = py::reinterpret_steal<py::object>(
        PySlice_New(py::int_(0).ptr(), py::int_(count).ptr(), nullptr));
    view = PyObject_GetItem(t.ptr(), slice.ptr());
  }
  if (!view) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(view);
}

ReceivedTensors DispatchRecvNew(PyAllToAll& a2a, const py::handle& dtype, int device,
                                bool sources, double timeout) {
  const AllToAllConfig& c = a2a.config();
  if (c.dispatch_layout != DispatchLayout::kTokenMajor) {
    ThrowIfError(InvalidArgumentError("dispatch_recv_new: for a token-major AllToAll"));
  }
  const Torch& torch = Torch::Get();
  const int64_t rows = c.expert_capacity(), k = c.experts_per_token;
  Array xa, sa, ca, ea, wa, ta, ka;
  py::object x = EmptyTensor(dtype.ptr(), {rows, c.hidden}, device, &xa);
  py::object scales = c.scales_per_token() > 0
                          ? EmptyTensor(torch.float32, {rows, c.scales_per_token()}, device, &sa)
                          : py::none();
  py::object counts = EmptyTensor(torch.int32, {1 + c.local_experts()}, device, &ca);
  py::object experts = EmptyTensor(torch.int64, {rows, k}, device, &ea);
  py::object weights = EmptyTensor(torch.float32, {rows, k}, device, &wa);
  py::object tokens = sources ? EmptyTensor(torch.int32, {rows}, device, &ta) : py::none();
  py::object ranks = sources ? EmptyTensor(torch.int32, {rows}, device, &ka) : py::none();
  const Array num_rows = Part(ca, 0, 1), per_expert = Part(ca, 1, c.local_experts());
  a2a.DispatchRecvArrays(xa, per_expert, scales.is_none() ? nullptr : &sa, {&num_rows, &ea, &wa},
                         timeout, 0, nullptr, 0,
                         {sources ? &ta : nullptr, nullptr, sources ? &ka : nullptr});
  return {std::move(x),       std::move(scales), std::move(counts), std::move(experts),
          std::move(weights), std::move(tokens), std::move(ranks),  std::move(ca)};
}

void BindTorchGlue(py::module_& m) {
  py::object first_rows =
      py::reinterpret_steal<py::object>(PyCFunction_NewEx(&first_rows_def, nullptr, m.ptr()));
  if (!first_rows) throw py::error_already_set();
  m.attr("first_rows") = first_rows;
  py::object empty =
      py::reinterpret_steal<py::object>(PyCFunction_NewEx(&empty_def, nullptr, m.ptr()));
  if (!empty) throw py::error_already_set();
  m.attr("empty") = empty;
  m.def(
      "_use_torch_glue",
      [](bool enabled) {
        const bool was = glue_enabled && TorchGlue() != nullptr;
        glue_enabled = enabled;
        return was;
      },
      py::arg("enabled"),
      "Whether the bindings read and make torch tensors through ferry._ferry_torch (where it "
      "loads) or through torch's Python API; returns whether they did. For tests and "
      "benchmarks");
  m.def("_torch_glue_loaded", [] { return TorchGlue() != nullptr; },
        "Whether ferry._ferry_torch is loaded and switched on");
}

}  // namespace ferry::python
