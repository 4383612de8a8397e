// The binding layer's shared pieces: Status -> Python exceptions, deadlines from seconds, and the
// array views the Python side hands in (python/ferry/_arrays.py builds them from NumPy arrays,
// buffer-protocol objects, torch tensors and __cuda_array_interface__ objects). The C++ core
// never sees a Python type; this layer checks every array against what a call needs before a
// pointer goes further.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/fabric.h"
#include "ferry/status.h"
#include "torch_api.h"

namespace ferry::python {

namespace py = pybind11;

// Raises the exception class of status's code (ferry.InvalidArgument, ...; all subclasses of
// ferry.Error) carrying its message, unless status is OK.
void ThrowIfError(const Status& status);

template <typename T>
T ValueOrThrow(StatusOr<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// Raises InvalidArgument for negative, NaN or infinite seconds: every wait is bounded.
void CheckTimeout(double seconds);
// `seconds` from now (checked as above).
Deadline DeadlineIn(double seconds);
// A bootstrap's timeout of `seconds` (checked as above).
using Millis = std::chrono::milliseconds;
inline Millis ToMillis(double seconds) {
  CheckTimeout(seconds);
  return Millis(static_cast<int64_t>(seconds * 1000.0));
}

// Where an array's bytes live.
inline constexpr int kHostMemory = -1;
inline constexpr int kCudaUnknownDevice = -2;  // CUDA memory whose device the object did not say

// One contiguous array as the Python side described it. `owner` is the object the bytes belong
// to: whoever keeps the pointer keeps the owner.
struct Array {
  uint64_t data = 0;
  uint64_t num_bytes = 0;
  int device = kHostMemory;  // kHostMemory, a CUDA ordinal, or kCudaUnknownDevice
  char kind = 'V';           // NumPy typestr kind: 'i', 'u', 'f', 'b'; 'V' unknown
  int item_bytes = 1;
  bool readonly = false;
  std::vector<int64_t> shape;
  py::object owner;
  // A torch tensor's dtype (torch's dtypes live as long as the interpreter), null for other
  // arrays: what tells bfloat16 from float16, which kind and size do not.
  PyObject* dtype = nullptr;

  bool on_host() const { return device == kHostMemory; }
  // The first dimension of an array of two or more; -1 for a flat one.
  int64_t rows() const { return shape.size() >= 2 ? shape.front() : -1; }
  void* pointer() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(data)); }
};

// A flat array of `count` unsigned items of `item_bytes` at `data` (host memory or a CUDA
// ordinal), writable, that `owner` keeps: the views ferry's own objects hand out of memory they
// own (GpuWords' words, KvCudaShards' caches).
inline Array OwnedView(void* data, uint64_t count, int item_bytes, int device, py::object owner) {
  Array a;
  a.data = reinterpret_cast<uintptr_t>(data);
  a.num_bytes = count * static_cast<uint64_t>(item_bytes);
  a.device = device;
  a.kind = 'u';
  a.item_bytes = item_bytes;
  a.shape = {static_cast<int64_t>(count)};
  a.owner = std::move(owner);
  return a;
}

// What a call needs of one array argument.
struct ArrayNeed {
  const char* name;
  uint64_t num_bytes = 0;  // at least
  bool writable = false;
  char kind = 0;       // 0: any
  int item_bytes = 0;  // 0: any
};

// InvalidArgument naming the argument when `array` is missing, too small, read-only where
// written, of the wrong element type, or not in the memory `device` names (kHostMemory, or the
// CUDA ordinal the call runs on).
Status CheckArray(const Array* array, const ArrayNeed& need, int device);

void BindTorchGlue(py::module_& m);
void BindBootstrap(py::module_& m);
void BindFabric(py::module_& m);
void BindMoe(py::module_& m);
void BindKv(py::module_& m);
void BindCompat(py::module_& m);
void BindDeepEp(py::module_& m);
void BindDeepEpElastic(py::module_& m);

// The exception object (not raised) of a failed status, None for OK.
py::object ErrorObject(const Status& status);

}  // namespace ferry::python

namespace ferry::python {

// A registered array (ferry.Region); keeps the array's owner alive while registered.
struct Region {
  MemoryRegion region;
  Array array;
};

// `object` as an Array: an Array as is, anything else through ferry._arrays.as_array (NumPy,
// buffer protocol, torch tensors, __cuda_array_interface__).
Array ToArray(const py::handle& object);
// A contiguous torch tensor of CPU or CUDA memory as an Array, read through _ferry_torch where
// it is loaded, else through the tensor's own methods (without ferry._arrays between); nullopt
// for anything else.
std::optional<Array> TorchArray(const py::handle& tensor);

// ferry._ferry_torch's calls (torch_api.h) once torch is imported, where that module loads and
// is not switched off (ferry._ferry._use_torch_glue); null otherwise.
const TorchApi* TorchGlue();
// A new contiguous torch tensor of `dtype` (torch's dtype object) shaped `shape` on `device`
// (-1 the CPU, else the CUDA ordinal), made by _ferry_torch where it is loaded, else by
// torch.empty; its Array (owner: the tensor) in *array where given.
py::object EmptyTensor(PyObject* dtype, std::initializer_list<int64_t> shape, int device,
                       Array* array = nullptr);
py::object EmptyTensor(PyObject* dtype, const std::vector<int64_t>& shape, int device,
                       Array* array = nullptr);

}  // namespace ferry::python

namespace ferry::python {

// The TransferEngine of a ferry.TransferEngine object (None: null), which refuses to close until
// as many ReleaseEngine calls: what uses an engine (an AllToAll, a KV messenger) holds it this
// way.
TransferEngine* AcquireEngine(const py::handle& engine);
void ReleaseEngine(const py::handle& engine);

// Sets each keyword argument as an attribute of `target` (a bound options struct); an unknown
// name is a TypeError.
void SetFields(py::object& target, const py::kwargs& fields);

// `base` with each keyword argument set as a field (the constructors of the bound config
// structs: EngineOptions(**fields), AllToAllConfig(**fields), ...).
template <typename T>
T WithFields(T base, const py::kwargs& fields) {
  py::object o = py::cast(std::move(base));
  SetFields(o, fields);
  return o.cast<T>();
}

// close() on a bound class, and the context-manager protocol around it (`with ... as x:`).
template <typename PyClass>
PyClass BindClose(PyClass c) {
  using Class = typename PyClass::type;
  c.def("close", [](Class& o) { o.Close(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](Class& o, const py::args&) { o.Close(); });
  return c;
}

// "TypeError: message" of the Python exception being handled, without its traceback.
std::string Summary(const py::error_already_set& e);

}  // namespace ferry::python
