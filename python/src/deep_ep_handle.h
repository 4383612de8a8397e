// ferry.deep_ep's handles: what a combine needs of its dispatch (DeepEpHandle), and DeepEP V1's
// low-latency handle, the tuple callers index, that holds one (deep_ep.cc makes them).
#pragma once

#include <cstdint>
#include <memory>

#include "binding.h"
#include "compat.h"

namespace ferry::python {

// What a combine needs of its dispatch (deep_ep's handle): the AllToAll that carried it
// (`pooled`, held busy until the combine's receive half; another call may take the AllToAll
// after that, so the handle's own in_flight, not the AllToAll's flag, says whether it can still
// be combined) and the shapes the combine checks against. The layers' C++ makes them
// (deep_ep.cc, deep_ep_normal.cc); max_tokens is None for normal mode's, which have rows.
struct DeepEpHandle {
  std::shared_ptr<PooledAllToAll> pooled;
  int64_t tokens, k, hidden, num_experts;
  py::object topk_idx, max_tokens, topk_weights, rows;
  int device;  // the dispatch's tensors' (Tensor.get_device(): -1 the CPU)
  bool in_flight = true;
  py::object combine_buffer;  // get_next_low_latency_combine_buffer's, once asked for
};

// The handle's dispatch combined, or its call failed: its AllToAll free for the next call, the
// handle no longer combinable.
inline void Release(DeepEpHandle& h) {
  h.pooled->busy = false;
  h.in_flight = false;
}

// The DeepEpHandle a low-latency handle (V1's tuple, its ferry part in `_ferry`) or a
// normal-mode one holds; null for anything else.
std::shared_ptr<DeepEpHandle> UnwrapHandle(PyObject* o);

// DeepEP V1's low-latency handle: (src_info, layout_range, num_max_dispatch_tokens_per_rank,
// hidden, num_experts), a tuple of `type` (a tuple subclass) callers may index, ferry's handle in
// its `_ferry` attribute.
py::object MakeV1Handle(const py::object& type, py::handle src_info, py::handle layout_range,
                        int64_t m, int64_t hidden, int64_t experts,
                        const std::shared_ptr<DeepEpHandle>& handle);

// ferry._ferry.DeepEpHandle.
void BindDeepEpHandle(py::module_& m);

}  // namespace ferry::python
