// What ferry._ferry_torch lends _ferry: torch's tensors read and made in C++ by the running
// torch's own library. Read through its Python methods, a tensor's pointer, device, dtype and
// shape cost a microsecond or more each, and a new tensor several: the layers' hot calls read
// and make several a call. _ferry does not link torch (one build serves any torch, and none);
// _ferry_torch is built against the torch found at configure time, refuses to load beside
// another version, and hands these functions over in a capsule. Without it _ferry reads and
// makes tensors through torch's Python API, as before.
#pragma once

#include <Python.h>

#include <cstdint>

namespace ferry::python {

inline constexpr int kTorchMaxDims = 8;

// What the layers read of a tensor.
struct TorchFacts {
  uint64_t data;  // the first element's address
  int device;     // -1 the CPU, else the CUDA ordinal
  int item_bytes;
  int dims;  // at most kTorchMaxDims (a tensor of more is not described)
  int64_t shape[kTorchMaxDims];
  bool contiguous;
  PyObject* dtype;  // torch's dtype object (borrowed: dtypes live as long as torch)
};

struct TorchApi {
  static constexpr uint32_t kVersion = 2;
  uint32_t version;  // kVersion of the module that filled it
  // Fills `facts` from `t`: false, no error set, where t is not a torch tensor of CPU or CUDA
  // memory with at most kTorchMaxDims dimensions.
  bool (*describe)(PyObject* t, TorchFacts* facts);
  // A new contiguous tensor of `dtype` (torch's dtype object) shaped `shape` (`dims` of them)
  // on `device` (-1 the CPU, else the CUDA ordinal; allocated for the device's current
  // stream, as torch.empty allocates); its first element's address in *data. A new reference,
  // or null with a Python error set.
  PyObject* (*empty)(PyObject* dtype, const int64_t* shape, int dims, int device,
                     uint64_t* data);
  // t[:count] (a view of t's first `count` rows; count past them: all of them). A new
  // reference, or null with a Python error set.
  PyObject* (*first_rows)(PyObject* t, int64_t count);
  // t's first `bytes` bytes (t contiguous) copied to host memory at `dst`, ordered on the
  // current stream of t's device and waited for, as Tensor.tolist() reads: false, with a Python
  // error set, where that fails.
  bool (*to_host)(PyObject* t, void* dst, int64_t bytes);
  // t.clone(): a new reference, or null with a Python error set.
  PyObject* (*clone)(PyObject* t);
};

// The capsule's name, as PyCapsule_Import takes it (module.attribute).
inline constexpr const char* kTorchApiCapsule = "ferry._ferry_torch._api";

}  // namespace ferry::python
