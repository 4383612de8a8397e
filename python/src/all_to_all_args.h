// What the AllToAll binding (all_to_all.h) reads off its Python arguments before the core sees
// them: a stream object's handle, the element size and kind a configuration's rows take, whether
// 2-byte rows are fp16, and optional arrays.
#pragma once

#include <cstdint>
#include <optional>

#include "binding.h"
#include "compat.h"
#include "ferry/moe.h"

namespace ferry::python {

// An int (a cudaStream_t's address), or a stream object that carries one: torch's
// .cuda_stream, CuPy's .ptr.
inline void* StreamHandle(const py::handle& stream) {
  if (PyLong_Check(stream.ptr())) {
    return reinterpret_cast<void*>(static_cast<uintptr_t>(py::cast<uint64_t>(stream)));
  }
  py::object handle = py::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream")
                      : py::hasattr(stream, "ptr")       ? stream.attr("ptr")
                                                   : py::reinterpret_borrow<py::object>(stream);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(py::cast<uint64_t>(handle)));
}
inline std::optional<void*> OptionalStream(const py::handle& stream) {
  return stream.is_none() ? std::nullopt : std::optional(StreamHandle(stream));
}
// The legacy default stream as the runtime API names it to a call that takes a stream of its
// own (cudaStreamLegacy): handle 0 there means "none" to the core (SetStream), and the
// legacy stream to the runtime.
inline void* const kLegacyStream = reinterpret_cast<void*>(uintptr_t{1});
inline void* CudaStream(void* handle) { return handle ? handle : kLegacyStream; }

// The element of the dispatch's rows (bf16, fp8 or fp32) and of the combine's (bf16 or fp32),
// and its kind: float for fp32; bf16 and fp8 take any 2- or 1-byte element (torch.uint8
// stands for fp8 where torch has no float8_e4m3fn; Check refuses float16).
inline int ItemBytes(const AllToAllConfig& c) {
  return static_cast<int>(c.token_bytes() / c.hidden);
}
inline int CombineItemBytes(const AllToAllConfig& c) {
  return static_cast<int>(c.combine_row_bytes() / c.hidden);
}
inline char ItemKind(const AllToAllConfig& c) {
  return c.dtype == DispatchDtype::kFp32 ? 'f' : char{0};
}
inline char CombineItemKind(const AllToAllConfig& c) { return c.combines_fp32() ? 'f' : char{0}; }

// Whether 2-byte rows are IEEE fp16: a 2-byte float other than a torch.bfloat16 tensor
// (NumPy's 2-byte float is float16). bf16 bits in int16 / uint16 arrays are bf16. The
// dispatch moves either as it is; the combine sums each as what it is (CombineInput::fp16).
inline bool IsFloat16(const Array& a) {
  return a.kind == 'f' && a.item_bytes == 2 &&
         (a.dtype == nullptr || a.dtype != Torch::Get().bfloat16);
}
// An optional argument as an Array (None: nullopt), and its address (null for none).
inline std::optional<Array> MaybeArray(const py::handle& object) {
  return object.is_none() ? std::nullopt : std::optional(ToArray(object));
}
inline const Array* Pointer(const std::optional<Array>& a) { return a ? &*a : nullptr; }

}  // namespace ferry::python
