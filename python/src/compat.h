// What the compatibility layers' C++ calls share (compat.cc: pplx; deep_ep.cc: deep_ep's
// low-latency calls): torch's objects looked up once, the caller's current stream, and the
// pieces of their error messages.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding.h"

namespace ferry::python {

// torch's objects the layers' calls compare against or call, looked up once (at the first layer
// made) and kept for the interpreter's life.
struct Torch {
  PyObject* bfloat16;
  PyObject* float16;
  PyObject* float32;
  PyObject* int32;
  PyObject* int64;
  PyObject* uint32;  // null before torch 2.3
  PyObject* uint8;
  PyObject* bool_;
  PyObject* fp8;  // float8_e4m3fn, or uint8 (the same bytes) before torch 2.1
  py::handle tensor_type;
  py::handle current_stream;  // (ordinal) -> the current cudaStream_t as an int
  py::handle empty_like;      // torch.empty_like

  static const Torch& Get() {
    static const Torch t = [] {
      py::module_ torch = py::module_::import("torch");
      auto dtype = [&](const char* name) {
        return py::hasattr(torch, name) ? py::object(torch.attr(name)).release().ptr() : nullptr;
      };
      PyObject* const e4m3 = dtype("float8_e4m3fn");
      Torch t{
          dtype("bfloat16"), dtype("float16"), dtype("float32"), dtype("int32"), dtype("int64"),
          dtype("uint32"), dtype("uint8"), dtype("bool"), e4m3 ? e4m3 : dtype("uint8"),
          py::object(torch.attr("Tensor")).release(),
          // torch's raw accessor where it has one (what compilers built on torch call),
          // else ferry's Python one over torch.cuda.current_stream.
          py::object(py::hasattr(torch.attr("_C"), "_cuda_getCurrentRawStream")
                         ? torch.attr("_C").attr("_cuda_getCurrentRawStream")
                         : py::module_::import("ferry.compat._group").attr("current_stream_handle"))
              .release(),
          py::object(torch.attr("empty_like")).release()};
      return t;
    }();
    return t;
  }
};

// The caller's current torch stream on GPU `device` (a Tensor.get_device() ordinal), nullopt
// on the CPU (-1).
inline std::optional<void*> CurrentStream(int device) {
  if (device < 0) return std::nullopt;
  const py::object handle = Torch::Get().current_stream(device);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(py::cast<uint64_t>(handle)));
}

inline std::string Str(const py::handle& o) { return py::str(o); }
inline std::string Shape(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}
inline std::string Pair(int64_t a, int64_t b) {
  return "(" + std::to_string(a) + ", " + std::to_string(b) + ")";
}
[[noreturn]] inline void Invalid(const std::string& message) {
  ThrowIfError(InvalidArgumentError(message));
  throw std::logic_error("unreachable");
}

// A layer's tensor argument `t` as an Array; InvalidArgument naming it unless it is a contiguous
// CPU or CUDA torch tensor of `dtype` (null: any; `alt` too where given), `dims` dimensions (-1:
// any) on `device` (a Tensor.get_device() ordinal: -1 the CPU; kAnyDevice: any). The messages
// are ferry.compat._group.check_tensor's, which the layers' Python calls use.
constexpr int kAnyDevice = -2;
Array TensorArg(const char* name, const py::handle& t, PyObject* dtype, int dims, int device,
                PyObject* alt = nullptr);

class PyAllToAll;  // all_to_all.h (which includes this file)

// One AllToAll of a layer's pool (ferry.compat._group.Group): `busy` while a call holds it
// (from a dispatch until its combine's receive half), `streamed` once its stream is decided.
// A C++ type, so that the layers' C++ paths read and set `busy` as a field.
struct PooledAllToAll {
  explicit PooledAllToAll(py::object a2a);
  py::object a2a;
  PyAllToAll* raw;  // a2a's, which a2a keeps
  bool busy = false;
  bool streamed = false;
};

}  // namespace ferry::python
