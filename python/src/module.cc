// ferry._ferry: the extension module. This file holds what every part of the binding shares
// (errors, deadlines, array checks, host arrays from the buffer protocol) and the module's entry
// point; the bootstrap, fabric and moe bindings sit in files of their own.
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <string>
#include <unordered_map>

#include "binding.h"

namespace ferry::python {

namespace {

// ferry._errors defines one class per code, named as StatusCodeName names it.
py::object ErrorClass(StatusCode code) {
  py::object errors = py::module_::import("ferry._errors");
  const std::string name(StatusCodeName(code));
  return py::hasattr(errors, name.c_str()) ? errors.attr(name.c_str()) : errors.attr("Error");
}

}  // namespace

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  PyErr_SetString(ErrorClass(status.code()).ptr(), std::string(status.message()).c_str());
  throw py::error_already_set();
}

py::object ErrorObject(const Status& status) {
  if (status.ok()) return py::none();
  return ErrorClass(status.code())(std::string(status.message()));
}

void CheckTimeout(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    ThrowIfError(InvalidArgumentError("timeout must be a finite number of seconds >= 0, got " +
                                      std::to_string(seconds)));
  }
}

Deadline DeadlineIn(double seconds) {
  CheckTimeout(seconds);
  return Deadline::After(
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
}

namespace {

std::string DeviceName(int device) {
  if (device == kHostMemory) return "host memory";
  if (device == kCudaUnknownDevice) return "CUDA memory";
  return "CUDA memory of device " + std::to_string(device);
}

// A host array from any object with the buffer protocol (NumPy, array.array, bytearray,
// memoryview): C-contiguous only. Read-only ones too: CheckArray refuses them as outputs,
// naming the argument.
Array HostArray(const py::object& object) {
  Py_buffer view;
  if (PyObject_GetBuffer(object.ptr(), &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    ThrowIfError(InvalidArgumentError(
        "expected a C-contiguous array (NumPy, torch tensor, __cuda_array_interface__ or "
        "buffer protocol), got " +
        std::string(py::str(py::type::of(object).attr("__name__")))));
  }
  Array a;
  a.data = reinterpret_cast<uintptr_t>(view.buf);
  a.num_bytes = static_cast<uint64_t>(view.len);
  a.item_bytes = static_cast<int>(view.itemsize);
  a.readonly = view.readonly != 0;
  const std::string format = view.format ? view.format : "B";
  // struct-module format codes, byte order prefix dropped.
  const char code = format.empty() ? 'B' : format.back();
  if (std::string("bhilq").find(code) != std::string::npos) a.kind = 'i';
  if (std::string("BHILQ").find(code) != std::string::npos) a.kind = 'u';
  if (std::string("efd").find(code) != std::string::npos) a.kind = 'f';
  if (code == '?') a.kind = 'b';
  for (int i = 0; i < view.ndim; ++i) a.shape.push_back(view.shape[i]);
  a.owner = object;
  PyBuffer_Release(&view);  // the owner keeps the memory; `a` keeps the owner
  return a;
}

}  // namespace

namespace {

// torch.Tensor's type once torch is imported (ferry never imports it itself), null before.
PyTypeObject* TorchTensorType() {
  static PyTypeObject* type = nullptr;
  if (type == nullptr) {
    PyObject* modules = PyImport_GetModuleDict();  // borrowed
    PyObject* torch = PyDict_GetItemString(modules, "torch");  // borrowed
    if (torch == nullptr) return nullptr;
    PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
    if (tensor == nullptr) {
      PyErr_Clear();  // a torch still importing: the Python path below handles its tensors
      return nullptr;
    }
    if (PyType_Check(tensor)) type = reinterpret_cast<PyTypeObject*>(tensor);  // kept for good
    else Py_DECREF(tensor);
  }
  return type;
}

// One of the tensor's methods or attributes, looked up by a name made once (a C string would
// be turned into a Python one, and hashed, at every call).
struct TensorName {
  explicit TensorName(const char* name) : name(PyUnicode_InternFromString(name)) {}
  py::object Get(const py::handle& t) const {
    return py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), name));
  }
  py::object Call(const py::handle& t) const {
    PyObject* self = t.ptr();
    return py::reinterpret_steal<py::object>(
        PyObject_VectorcallMethod(name, &self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
  }
  PyObject* name;  // kept for the interpreter's life
};

template <typename T>
T Checked(py::object value) {
  if (!value) throw py::error_already_set();
  return py::cast<T>(value);
}

}  // namespace

// A torch tensor of CPU or CUDA memory read through its own methods, as
// ferry._arrays.as_array reads one, without the Python function between: every step converts
// several tensors, and the Python path costs a few microseconds each. Anything else (not a
// torch tensor, not contiguous, another device): nullopt, for as_array to read or refuse with
// a message that says what is wrong.
std::optional<Array> TorchArray(const py::handle& t) {
  PyTypeObject* tensor_type = TorchTensorType();
  if (tensor_type == nullptr || !PyObject_TypeCheck(t.ptr(), tensor_type)) return std::nullopt;
  static const TensorName is_contiguous("is_contiguous"), is_cuda("is_cuda"), is_cpu("is_cpu"),
      dtype_of("dtype"), get_device("get_device"), element_size("element_size"),
      data_ptr("data_ptr"), shape_of("shape");
  // dtype -> the array-interface kind letter, as _arrays._torch_kind decides it, remembered
  // per dtype (torch's dtypes are singletons that live as long as torch; each is held here).
  static const py::handle torch_kind =
      py::object(py::module_::import("ferry._arrays").attr("_torch_kind")).release();
  static std::unordered_map<PyObject*, char> kinds;
  auto kind_of = [&](PyObject* dtype) {
    auto kind = kinds.find(dtype);
    if (kind == kinds.end()) {
      const char letter = py::cast<std::string>(torch_kind(t)).front();
      kind = kinds.emplace(py::handle(dtype).inc_ref().ptr(), letter).first;
    }
    return kind;
  };
  Array a;
  uint64_t count = 1;
  if (const TorchApi* glue = TorchGlue()) {
    TorchFacts f;
    if (!glue->describe(t.ptr(), &f) || !f.contiguous) return std::nullopt;
    const auto kind = kind_of(f.dtype);
    a.device = f.device < 0 ? kHostMemory : f.device;
    a.kind = kind->second;
    a.dtype = kind->first;
    a.item_bytes = f.item_bytes;
    a.data = f.data;
    a.shape.assign(f.shape, f.shape + f.dims);
  } else {
    if (!Checked<bool>(is_contiguous.Call(t))) return std::nullopt;
    const bool cuda = Checked<bool>(is_cuda.Get(t));
    if (!cuda && !Checked<bool>(is_cpu.Get(t))) return std::nullopt;
    const py::object dtype = dtype_of.Get(t);
    if (!dtype) throw py::error_already_set();
    const auto kind = kind_of(dtype.ptr());
    a.device = cuda ? Checked<int>(get_device.Call(t)) : kHostMemory;
    a.kind = kind->second;
    a.dtype = kind->first;
    a.item_bytes = Checked<int>(element_size.Call(t));
    a.data = Checked<uint64_t>(data_ptr.Call(t));
    const py::object shape = shape_of.Get(t);
    if (!shape || !PyTuple_Check(shape.ptr())) throw py::error_already_set();
    const Py_ssize_t dims = PyTuple_GET_SIZE(shape.ptr());
    a.shape.resize(static_cast<size_t>(dims));
    for (Py_ssize_t i = 0; i < dims; ++i) {
      a.shape[static_cast<size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    }
  }
  for (int64_t n : a.shape) count *= static_cast<uint64_t>(n);
  a.num_bytes = count * static_cast<uint64_t>(a.item_bytes);
  a.owner = py::reinterpret_borrow<py::object>(t);
  return a;
}

Array ToArray(const py::handle& object) {
  if (py::isinstance<Array>(object)) return py::cast<Array>(object);
  if (std::optional<Array> a = TorchArray(object)) return std::move(*a);
  // Looked up once (every step converts several arrays); kept for the interpreter's life.
  static const py::handle as_array =
      py::object(py::module_::import("ferry._arrays").attr("as_array")).release();
  return py::cast<Array>(as_array(object));
}

std::string Summary(const py::error_already_set& e) {
  return std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
}

void SetFields(py::object& target, const py::kwargs& fields) {
  for (auto [name, value] : fields) {
    const std::string key = py::str(name);
    if (!py::hasattr(target, key.c_str())) {
      throw py::type_error(std::string(py::str(py::type::of(target).attr("__name__"))) +
                           " has no field '" + key + "'");
    }
    py::setattr(target, key.c_str(), value);
  }
}

Status CheckArray(const Array* array, const ArrayNeed& need, int device) {
  const std::string name = need.name;
  if (array == nullptr) return InvalidArgumentError(name + ": required");
  if (array->data == 0 && need.num_bytes > 0) return InvalidArgumentError(name + ": null data");
  const bool want_host = device == kHostMemory;
  const bool device_ok = want_host ? array->on_host()
                                   : !array->on_host() && (array->device == kCudaUnknownDevice ||
                                                           array->device == device);
  if (!device_ok) {
    return InvalidArgumentError(name + ": in " + DeviceName(array->device) + ", the call needs " +
                                DeviceName(device));
  }
  if (array->num_bytes < need.num_bytes) {
    return InvalidArgumentError(name + ": " + std::to_string(array->num_bytes) +
                                " bytes, the call needs at least " +
                                std::to_string(need.num_bytes));
  }
  if (need.writable && array->readonly) return InvalidArgumentError(name + ": read-only");
  const bool kind_ok = need.kind == 0 || array->kind == 'V' || array->kind == need.kind;
  const bool size_ok = need.item_bytes == 0 || array->item_bytes == need.item_bytes;
  if (!kind_ok || !size_ok) {
    return InvalidArgumentError(name + ": elements of kind '" + std::string(1, array->kind) +
                                "', " + std::to_string(array->item_bytes) + " bytes; expected '" +
                                std::string(1, need.kind ? need.kind : '?') + "', " +
                                std::to_string(need.item_bytes) + " bytes");
  }
  return Status::Ok();
}

namespace {

// CUDA memory described for torch.as_tensor, CuPy and Numba (version 3, C-contiguous); host
// memory has none (AttributeError, so hasattr says False).
py::dict CudaArrayInterface(const Array& a) {
  if (a.on_host()) throw py::attribute_error("a host ferry.Array has no __cuda_array_interface__");
  py::dict d;
  py::tuple shape(a.shape.size());
  for (size_t i = 0; i < a.shape.size(); ++i) shape[i] = a.shape[i];
  d["shape"] = shape;
  d["typestr"] = std::string(a.item_bytes == 1 ? "|" : "<") + a.kind + std::to_string(a.item_bytes);
  d["data"] = py::make_tuple(a.data, a.readonly);
  d["strides"] = py::none();
  d["version"] = 3;
  return d;
}

}  // namespace
}  // namespace ferry::python

PYBIND11_MODULE(_ferry, m) {
  using namespace ferry::python;
  m.doc() = "ferry: RDMA transfers, MoE dispatch/combine and KV streaming (C++ core bindings)";

  py::class_<Array>(m, "Array", "One contiguous array as ferry sees it (build with ferry.as_array)")
      .def(
          py::init([](uint64_t data, uint64_t num_bytes, int device, const std::string& kind,
                      int item_bytes, bool readonly, std::vector<int64_t> shape, py::object owner) {
            Array a;
            a.data = data;
            a.num_bytes = num_bytes;
            a.device = device;
            a.kind = kind.empty() ? 'V' : kind[0];
            a.item_bytes = item_bytes;
            a.readonly = readonly;
            a.shape = std::move(shape);
            a.owner = std::move(owner);
            return a;
          }),
          py::arg("data"), py::arg("num_bytes"), py::arg("device"), py::arg("kind"),
          py::arg("item_bytes"), py::arg("readonly"), py::arg("shape"), py::arg("owner"))
      .def_readonly("data", &Array::data)
      .def_readonly("num_bytes", &Array::num_bytes)
      .def_readonly("device", &Array::device)
      .def_readonly("item_bytes", &Array::item_bytes)
      .def_readonly("readonly", &Array::readonly)
      .def_readonly("shape", &Array::shape)
      .def_readonly("owner", &Array::owner)
      .def_property_readonly("kind", [](const Array& a) { return std::string(1, a.kind); })
      .def_property_readonly("__cuda_array_interface__", &CudaArrayInterface)
      .def("__repr__", [](const Array& a) {
        return "<ferry.Array " + std::to_string(a.num_bytes) + " bytes in " + DeviceName(a.device) +
               ">";
      });
  m.def("torch_array", &TorchArray, py::arg("tensor"),
        "An Array of a contiguous torch tensor in CPU or CUDA memory; None for any other");
  m.def("host_array", &HostArray, py::arg("object"),
        "A host Array from a buffer-protocol object (C-contiguous)");
  m.attr("HOST_MEMORY") = kHostMemory;
  m.attr("CUDA_UNKNOWN_DEVICE") = kCudaUnknownDevice;

  BindTorchGlue(m);
  BindBootstrap(m);
  BindFabric(m);
  BindMoe(m);
  BindKv(m);
  BindCompat(m);
  BindDeepEp(m);
}
