// ferry.deep_ep's handles (deep_ep_handle.h).
#include "deep_ep_handle.h"

namespace ferry::python {

std::shared_ptr<DeepEpHandle> UnwrapHandle(PyObject* o) {
  static PyObject* const ferry = PyUnicode_InternFromString("_ferry");
  py::object inner = py::reinterpret_borrow<py::object>(o);
  if (PyTuple_Check(o)) {
    inner = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, ferry));
    if (!inner) {
      PyErr_Clear();
      return nullptr;
    }
  }
  if (!py::isinstance<DeepEpHandle>(inner)) return nullptr;
  return py::cast<std::shared_ptr<DeepEpHandle>>(inner);
}

// Made as tuple_subtype_new makes one (allocated, its items set), without the Python call.
py::object MakeV1Handle(const py::object& handle_type, py::handle src_info, py::handle layout_range,
                        int64_t m, int64_t hidden, int64_t experts,
                        const std::shared_ptr<DeepEpHandle>& handle) {
  static PyObject* const ferry = PyUnicode_InternFromString("_ferry");
  auto* type = reinterpret_cast<PyTypeObject*>(handle_type.ptr());
  py::object t = py::reinterpret_steal<py::object>(type->tp_alloc(type, 5));
  if (!t) throw py::error_already_set();
  PyObject* items[5] = {src_info.inc_ref().ptr(), layout_range.inc_ref().ptr(),
                        py::int_(m).release().ptr(), py::int_(hidden).release().ptr(),
                        py::int_(experts).release().ptr()};
  for (int i = 0; i < 5; ++i) PyTuple_SET_ITEM(t.ptr(), i, items[i]);
  if (PyObject_SetAttr(t.ptr(), ferry, py::cast(handle).ptr()) != 0) {
    throw py::error_already_set();
  }
  return t;
}

void BindDeepEpHandle(py::module_& m) {
  py::class_<DeepEpHandle, std::shared_ptr<DeepEpHandle>>(
      m, "DeepEpHandle",
      "What a ferry.deep_ep combine needs of its dispatch (the handle a dispatch returns; the "
      "layers' C++ makes them)")
      .def_readwrite("pooled", &DeepEpHandle::pooled)
      .def_readwrite("in_flight", &DeepEpHandle::in_flight)
      .def_readonly("tokens", &DeepEpHandle::tokens)
      .def_readonly("k", &DeepEpHandle::k)
      .def_readonly("hidden", &DeepEpHandle::hidden)
      .def_readonly("num_experts", &DeepEpHandle::num_experts)
      .def_readonly("topk_idx", &DeepEpHandle::topk_idx)
      .def_readonly("max_tokens", &DeepEpHandle::max_tokens)
      .def_readonly("topk_weights", &DeepEpHandle::topk_weights)
      .def_readwrite("rows", &DeepEpHandle::rows)
      .def_readwrite("combine_buffer", &DeepEpHandle::combine_buffer);
}

}  // namespace ferry::python
