// Tensors through ferry._ferry_torch (torch_api.h) where it loads, else through torch's Python
// API: the loader, the switch, and the allocation the layers' calls make their outputs with.
#include <optional>
#include <utility>

#include "binding.h"
#include "compat.h"

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
  py::object t;
  if (const TorchApi* glue = TorchGlue()) {
    uint64_t data = 0;
    t = py::reinterpret_steal<py::object>(
        glue->empty(dtype, shape.begin(), static_cast<int>(shape.size()), device, &data));
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

void BindTorchGlue(py::module_& m) {
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
