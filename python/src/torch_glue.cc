// ferry._ferry_torch: the TorchApi (torch_api.h) over the torch this module was built against.
// Importing it fails where the running torch is another major.minor version than that one (its
// C++ layout may differ): _ferry then keeps to torch's Python API.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <exception>
#include <string>

#include "torch_api.h"

namespace ferry::python {
namespace {

bool Describe(PyObject* object, TorchFacts* facts) {
  if (!THPVariable_Check(object)) return false;
  const at::Tensor& t = THPVariable_Unpack(object);
  if (!t.defined() || t.dim() > kTorchMaxDims) return false;
  const c10::Device device = t.device();
  if (!device.is_cpu() && !device.is_cuda()) return false;
  facts->data = reinterpret_cast<uint64_t>(t.data_ptr());
  facts->device = device.is_cpu() ? -1 : device.index();
  facts->item_bytes = static_cast<int>(t.element_size());
  facts->dims = static_cast<int>(t.dim());
  for (int i = 0; i < facts->dims; ++i) facts->shape[i] = t.size(i);
  facts->contiguous = t.is_contiguous();
  facts->dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  return true;
}

PyObject* Empty(PyObject* dtype, const int64_t* shape, int dims, int device, uint64_t* data) {
  if (!THPDtype_Check(dtype)) {
    PyErr_SetString(PyExc_TypeError, "ferry._ferry_torch: not a torch dtype");
    return nullptr;
  }
  try {
    const at::TensorOptions options =
        at::TensorOptions()
            .dtype(reinterpret_cast<THPDtype*>(dtype)->scalar_type)
            .device(device < 0 ? c10::Device(c10::kCPU)
                               : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    at::Tensor t = at::empty(at::IntArrayRef(shape, static_cast<size_t>(dims)), options);
    *data = reinterpret_cast<uint64_t>(t.data_ptr());
    return THPVariable_Wrap(std::move(t));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* FirstRows(PyObject* object, int64_t count) {
  if (!THPVariable_Check(object)) {
    PyErr_SetString(PyExc_TypeError, "ferry._ferry_torch: not a torch tensor");
    return nullptr;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(object);
    return THPVariable_Wrap(t.slice(0, 0, count));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

bool ToHost(PyObject* object, void* dst, int64_t bytes) {
  if (!THPVariable_Check(object)) {
    PyErr_SetString(PyExc_TypeError, "ferry._ferry_torch: not a torch tensor");
    return false;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(object);
    if (!t.is_contiguous() || bytes < 0 || bytes > t.numel() * t.element_size()) {
      PyErr_SetString(PyExc_ValueError, "ferry._ferry_torch: to_host past the tensor");
      return false;
    }
    const at::Tensor from = t.view({-1}).view(at::kByte).slice(0, 0, bytes);
    at::from_blob(dst, {bytes}, at::TensorOptions().dtype(at::kByte)).copy_(from);
    return true;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return false;
  }
}

PyObject* Clone(PyObject* object) {
  if (!THPVariable_Check(object)) {
    PyErr_SetString(PyExc_TypeError, "ferry._ferry_torch: not a torch tensor");
    return nullptr;
  }
  try {
    return THPVariable_Wrap(THPVariable_Unpack(object).clone());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

TorchApi api{TorchApi::kVersion, Describe, Empty, FirstRows, ToHost, Clone};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                          "_ferry_torch",
                          "torch's tensors read and made in C++ for ferry._ferry",
                          -1,
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr};

}  // namespace
}  // namespace ferry::python

PyMODINIT_FUNC PyInit__ferry_torch() {
  // The running torch must be the one whose headers this was built from.
  PyObject* torch = PyImport_ImportModule("torch");
  if (!torch) return nullptr;
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (!version) return nullptr;
  const char* running = PyUnicode_AsUTF8(version);
  const std::string built =
      std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ".";
  const bool same = running && std::string(running).rfind(built, 0) == 0;
  const std::string running_text = running ? running : "?";
  Py_DECREF(version);
  if (!same) {
    PyErr_SetString(PyExc_ImportError, ("ferry._ferry_torch: built for torch " + built +
                                        "x, running " + running_text)
                                           .c_str());
    return nullptr;
  }
  PyObject* m = PyModule_Create(&ferry::python::module_def);
  if (!m) return nullptr;
  PyObject* capsule = PyCapsule_New(&ferry::python::api, ferry::python::kTorchApiCapsule, nullptr);
  if (!capsule || PyModule_AddObject(m, "_api", capsule) != 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
