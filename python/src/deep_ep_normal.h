// ferry.deep_ep.Buffer's normal-mode calls (DeepEP V1's dispatch and combine) and the dispatch
// ElasticBuffer (V2) runs on, written once in C++ (deep_ep_normal.cc): every argument checked
// (InvalidArgument naming it; TypeError, as Python's, for a call that does not match DeepEP's
// signature), then the call run in one C++ call -- the AllToAll taken from the Buffer's pool,
// ordered with the caller's stream, its steps, the outputs made, the counts read, the views and
// the handle made. What stays Python is asked for by name on the Buffer where a call needs it
// (_streams.py, _normal.py): a shape's first AllToAll, the communication stream, an event,
// and the torch work of the less common forms (routing by is_token_in_rank, num_worst_tokens'
// masking, ElasticBuffer's epilogue, the combine's bias and top-k weights).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "compat.h"
#include "deep_ep_handle.h"

namespace ferry::python {

struct ReceivedTensors;  // torch_tensors.h

class DeepEpNormal {
 public:
  DeepEpNormal(int world, double timeout, py::object done)
      : world_(world), timeout_(timeout), done_(std::move(done)) {}

  static constexpr std::array<const char*, 14> kDispatchArgs{"x",
                                                             "handle",
                                                             "num_tokens_per_rank",
                                                             "num_tokens_per_rdma_rank",
                                                             "is_token_in_rank",
                                                             "num_tokens_per_expert",
                                                             "topk_idx",
                                                             "topk_weights",
                                                             "expert_alignment",
                                                             "num_worst_tokens",
                                                             "config",
                                                             "previous_event",
                                                             "async_finish",
                                                             "allocate_on_comm_stream"};
  static constexpr std::array<const char*, 8> kCombineArgs{
      "x",      "handle",         "topk_weights", "bias",
      "config", "previous_event", "async_finish", "allocate_on_comm_stream"};
  // What a dispatch is asked: V1's arguments, or ElasticBuffer's (deep_ep_elastic.cc), as the
  // core takes them.
  struct Request {
    py::object x, scales = py::none();  // scales None for bf16 rows
    Array xa;
    std::optional<Array> sa;
    // topk_idx None: routed by is_token_in_rank.
    py::object topk_idx = py::none(), topk_weights = py::none();
    std::optional<Array> ia, wa;  // ia: topk_idx checked (by Run where the caller did not)
    int64_t experts = 0, alignment = 1, worst = 0;
    py::object previous = py::none();  // an EventOverlap, or None
    bool async = false;
    std::shared_ptr<DeepEpHandle> cached;
    // Routing by is_token_in_rank: both given.
    py::object every_count = py::none(), is_token_in_rank = py::none();
    // epilogue(received): torch work on the AllToAll's stream before the dispatch's event
    // (_run_epilogue).
    py::object epilogue = py::none();
    bool keep_received = false;  // make the _Received (ElasticBuffer reads it)

    // x checked: bf16 rows, or (e4m3 rows, fp32 scales per 128 columns).
    void SetX(PyObject* x_given);
  };
  // What it gave: the received rows' views (out_x: rows, or (rows, scales)), the counts per
  // local expert rounded up to the alignment (a list; empty with num_worst_tokens), the
  // event, the _Received where it was made, and the new handle (null for a cached dispatch).
  struct Result {
    py::object out_x, recv_idx, recv_weights, per_expert, event, received, src_idx;
    int64_t rows = 0;
    bool counted = true;  // rows are those received (not num_worst_tokens' bound)
    std::shared_ptr<DeepEpHandle> handle;
    py::object handle_object;
  };

  // The dispatch of `r` on the Buffer `self`.
  Result Run(PyObject* self, Request& r);

  // V1's dispatch: (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
  // handle, event); a cached one (recv_x, None, None, None, None, event).
  py::object Dispatch(PyObject* self, const std::array<PyObject*, kDispatchArgs.size()>& a);
  // V1's combine: (combined_x, combined_topk_weights, event).
  py::object Combine(PyObject* self, const std::array<PyObject*, kCombineArgs.size()>& a);

  // The Buffer destroyed: every later call refused.
  void Close() {
    entries_.clear();
    closed_ = true;
  }
  // The Buffer's normal-mode AllToAlls dropped (a world remade): each shape's next call asks
  // for a new one.
  void Forget() {
    entries_.clear();
    settings_.reset();
  }

 private:
  struct Settings;
  struct Entry;

  const Settings& Setup(PyObject* self);
  std::shared_ptr<Entry> Take(PyObject* self, const py::handle& x, int device, int64_t capacity,
                              int64_t hidden, int64_t experts, int64_t k, bool fp8);
  py::object NormalHandle(PyObject* self, const Result& got, const py::object& is_token_in_rank);
  // The dispatch's _Received (_normal.py) of what it made (`got`); device() torch's device
  // object of its tensors.
  template <typename Device>
  py::object Received(PyObject* self, PyAllToAll& a2a, const std::optional<void*>& stream,
                      Device device, const ReceivedTensors& got);
  std::vector<int64_t> ReadCounts(const py::object& read_back, const Array& counts,
                                  int device) const;

  int world_;
  double timeout_;
  py::object done_;
  bool closed_ = false;
  std::shared_ptr<Settings> settings_;
  std::vector<std::shared_ptr<Entry>> entries_;
};

// Adds dispatch and combine, as METH_FASTCALL methods, to the bound class `cls`, whose
// instances hold a DeepEpNormal where `of(self)` finds it.
void AddNormalMethods(py::handle cls, DeepEpNormal& (*of)(PyObject* self));
// The DeepEpNormal of a Buffer (an instance of the class AddNormalMethods was given).
DeepEpNormal& NormalOf(PyObject* buffer);

}  // namespace ferry::python
