// The CPython calling convention for a layer's hot methods (deep_ep.cc): METH_FASTCALL methods
// of a bound class, their arguments matched by position and keyword as Python's would be, and
// the argument conversions they need. pybind11's own matching costs microseconds a call.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>

#include "compat.h"

namespace ferry::python {

// `names` as interned Python strings, made at the first call for that array (its address,
// which a static array keeps, is the key); Interned<N>() an empty set for a call without
// keywords.
template <size_t N>
const std::array<PyObject*, N>& Interned(const std::array<const char*, N>& names) {
  static std::map<const void*, std::array<PyObject*, N>> made;
  auto it = made.find(&names);
  if (it == made.end()) {
    std::array<PyObject*, N> strings;
    for (size_t i = 0; i < N; ++i) {
      strings[i] = PyUnicode_InternFromString(names[i]);
      if (!strings[i]) throw py::error_already_set();
    }
    it = made.emplace(&names, strings).first;
  }
  return it->second;
}
template <size_t N>
const std::array<PyObject*, N>& Interned() {
  static const std::array<PyObject*, N> none{};
  return none;
}

// A vectorcall's arguments matched to `names` (positional first, then by keyword; the first
// `required` must be given) into `out` (null: not given); TypeError as Python words it for a
// call of `call` that does not match.
template <size_t N>
inline void Match(const char* call, const std::array<const char*, N>& names, size_t required,
                  PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                  std::array<PyObject*, N>& out) {
  auto type_error = [&](const std::string& what) {
    throw py::type_error(std::string(call) + "() " + what);
  };
  out.fill(nullptr);
  if (static_cast<size_t>(nargs) > N) {
    type_error("takes at most " + std::to_string(N) + " arguments (" + std::to_string(nargs) +
               " given)");
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  const std::array<PyObject*, N>& interned = keywords ? Interned(names) : Interned<N>();
  for (Py_ssize_t j = 0; j < keywords; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    // A keyword written in the caller's code is an interned string, the same object as the
    // name's: found by address, without comparing the text of each name before it.
    size_t i = 0;
    while (i < N && interned[i] != name) ++i;
    if (i == N) {
      i = 0;
      while (i < N && PyUnicode_CompareWithASCIIString(name, names[i]) != 0) ++i;
    }
    if (i == N) type_error("got an unexpected keyword argument '" + Str(name) + "'");
    if (out[i]) type_error("got multiple values for argument '" + std::string(names[i]) + "'");
    out[i] = args[nargs + j];
  }
  for (size_t i = 0; i < required; ++i) {
    if (!out[i]) type_error("missing required argument '" + std::string(names[i]) + "'");
  }
}

// An argument's truth (`otherwise` where not given); what asking raised, raised.
inline bool Flag(PyObject* o, bool otherwise) {
  if (!o) return otherwise;
  const int truth = PyObject_IsTrue(o);
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}
// An argument that must be a Python int.
inline int64_t Int(const char* name, PyObject* o) {
  if (!PyLong_Check(o))
    Invalid(std::string(name) + ": an int, got " + Str(py::type::of(o).attr("__name__")));
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    Invalid(std::string(name) + ": out of range");
  }
  return v;
}
inline bool IsNone(PyObject* o) { return !o || o == Py_None; }

// Runs `call` as a CPython method body: its result (new reference), or null with the Python
// error set from what it threw.
template <typename Call>
PyObject* AsMethod(Call call) {
  try {
    return call();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// A layer's call as a METH_FASTCALL method: its arguments matched to `kNames` (the first
// `kRequired` required; `kCall` names it in TypeErrors), then (Of(self).*Call)(self, arguments)
// run, Of finding the C++ object of the instance that holds the call.
template <const char* kCall, const auto& kNames, size_t kRequired, auto Of, auto Call>
PyObject* FastMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return AsMethod([&]() -> PyObject* {
    auto& layer = Of(self);
    std::array<PyObject*, std::tuple_size_v<std::remove_cvref_t<decltype(kNames)>>> a;
    Match(kCall, kNames, kRequired, args, nargs, kwnames, a);
    return (layer.*Call)(self, a).release().ptr();
  });
}
// A FastMethod as PyMethodDef's ml_meth takes it.
template <auto Method>
PyCFunction AsCFunction() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Method));
}

// `function` as the METH_FASTCALL method `def->ml_name` of the bound class `cls`.
inline void AddFastMethod(py::handle cls, PyMethodDef* def) {
  py::object method = py::reinterpret_steal<py::object>(
      PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def));
  if (!method) throw py::error_already_set();
  cls.attr(def->ml_name) = method;
}

}  // namespace ferry::python
