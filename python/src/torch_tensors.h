// The layers' tensors made by ferry (torch_tensors.cc): a token-major receive into new ones and
// the views of their first rows, through _ferry_torch where it is loaded.
#pragma once

#include <cstdint>

#include "all_to_all.h"

namespace ferry::python {

// What a token-major receive into new tensors made (dispatch_recv_new's docstring, moe.cc, says
// what each holds): scales None for bf16 rows, tokens and ranks None unless the origins were
// asked for; counts' Array (int32 [1 + local experts]: the rows, then the copies per expert).
struct ReceivedTensors {
  py::object x, scales, counts, experts, weights, tokens, ranks;
  Array counts_array;
  py::tuple Tuple() const {
    return py::make_tuple(x, scales, counts, experts, weights, tokens, ranks);
  }
};

// A token-major dispatch_recv of `a2a` into tensors it makes (EmptyTensor), for the layers whose
// calls return new ones (ferry.deep_ep's normal mode). torch_tensors.cc.
ReceivedTensors DispatchRecvNew(PyAllToAll& a2a, const py::handle& dtype, int device, bool sources,
                                double timeout);

// t[:count] (None stays None), through _ferry_torch where it is loaded.
py::object FirstRowsOf(const py::handle& t, int64_t count);

}  // namespace ferry::python
