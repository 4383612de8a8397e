// What deep_ep_normal.cc and deep_ep_combine.cc share: the Buffer's Python methods they call
// by name, and the small conversions of their arguments.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "compat.h"
#include "deep_ep_handle.h"

namespace ferry::python {

// The Buffer's Python methods the calls use, by name, made once.
struct Hooks {
  PyObject* const settings = PyUnicode_InternFromString("_normal_settings");
  PyObject* const pool = PyUnicode_InternFromString("_normal_pool");
  PyObject* const constant = PyUnicode_InternFromString("_constant");
  PyObject* const stream_for = PyUnicode_InternFromString("_stream_for");
  PyObject* const wait_previous = PyUnicode_InternFromString("_wait_previous");
  PyObject* const rank_ids = PyUnicode_InternFromString("_rank_ids");
  PyObject* const mask_worst = PyUnicode_InternFromString("_mask_worst");
  PyObject* const caller_stream = PyUnicode_InternFromString("_caller_stream");
  PyObject* const epilogue = PyUnicode_InternFromString("_run_epilogue");
  PyObject* const per_expert = PyUnicode_InternFromString("_received_per_expert");
  PyObject* const prefix_sums = PyUnicode_InternFromString("_rank_prefix_sums");
  PyObject* const end = PyUnicode_InternFromString("_end");
  PyObject* const biases = PyUnicode_InternFromString("_biases");
  PyObject* const from_bias = PyUnicode_InternFromString("_start_from_bias");
  PyObject* const combine_weights = PyUnicode_InternFromString("_combine_weights");
  PyObject* const wait = PyUnicode_InternFromString("current_stream_wait");
  PyObject* const event = PyUnicode_InternFromString("event");
  // _Received's slots.
  PyObject* const read_back = PyUnicode_InternFromString("read_back");
  PyObject* const tokens = PyUnicode_InternFromString("tokens");
  PyObject* const senders = PyUnicode_InternFromString("senders");
  PyObject* const recv = PyUnicode_InternFromString("recv");
  PyObject* const scales = PyUnicode_InternFromString("scales");
  PyObject* const experts = PyUnicode_InternFromString("experts");
  PyObject* const weights = PyUnicode_InternFromString("weights");
  PyObject* const made = PyUnicode_InternFromString("made");
  PyObject* const caller = PyUnicode_InternFromString("caller");
  PyObject* const src_idx = PyUnicode_InternFromString("src_idx");
  PyObject* const device = PyUnicode_InternFromString("device");
  static const Hooks& Get() {
    static const Hooks h;
    return h;
  }
};

template <typename... Args>
inline py::object CallHook(PyObject* self, PyObject* name, Args&&... args) {
  return py::handle(self).attr(name)(std::forward<Args>(args)...);
}

// The caller's stream as Python's hooks take it: the handle as an int, None on the CPU.
inline py::object StreamObject(const std::optional<void*>& stream) {
  if (!stream) return py::none();
  return py::int_(reinterpret_cast<uintptr_t>(*stream));
}

inline int64_t Elements(const Array& a) {
  int64_t n = 1;
  for (int64_t s : a.shape) n *= s;
  return n;
}

// ferry's handle in a normal-mode handle (V1's tuple, or ElasticBuffer's ferry handle).
inline std::shared_ptr<DeepEpHandle> NormalHandleOf(PyObject* handle, const char* call) {
  std::shared_ptr<DeepEpHandle> h = UnwrapHandle(handle);
  if (!h || h->rows.is_none()) {
    Invalid(std::string(call) + ": handle is not one this Buffer's dispatch returned");
  }
  return h;
}

}  // namespace ferry::python
