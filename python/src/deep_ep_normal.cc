// ferry.deep_ep's normal mode in C++ (deep_ep_normal.h).
#include "deep_ep_normal.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "deep_ep_hooks.h"
#include "fast_call.h"
#include "torch_tensors.h"

namespace ferry::python {

// The Buffer's settings a normal-mode call reads, asked of it (_normal_settings) at the first
// call after it was made or its AllToAlls were dropped.
struct DeepEpNormal::Settings {
  int64_t buffer_bytes;      // num_nvl_bytes + num_rdma_bytes
  bool sources;              // per-rank forwarding: each received row's sender and token known
  int64_t ranks_per_node;    // the NVLink domain, which lays out V1's handle
  py::object received_type;  // _normal._Received
  py::object handle_type;    // _events.NormalHandle (a tuple subclass)
  py::dict not_kept;         // _events._NOT_KEPT: name -> NotKept
};

// One normal-mode AllToAll of the Buffer's pool (busy from a dispatch until its combine) and
// the dispatch-time weights its dispatches take where given none (all ones: the normal mode
// weights at the combine), made on its stream at its first call.
struct DeepEpNormal::Entry {
  int device;
  int64_t capacity, hidden, experts, k;
  bool fp8;
  std::shared_ptr<PooledAllToAll> pooled;
  py::object ones;
  Array ones_array;
};

namespace {

// A dispatch's x: bf16 rows, or (e4m3 rows, fp32 scales per 128 columns), checked.
void Rows(PyObject* x, py::object& rows, py::object& scales, Array& xa, std::optional<Array>& sa) {
  const Torch& torch = Torch::Get();
  if (PyTuple_Check(x)) {
    if (PyTuple_GET_SIZE(x) != 2) Invalid("x: a tensor, or a pair (e4m3 rows, scales)");
    rows = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(x, 0));
    scales = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(x, 1));
  } else {
    rows = py::reinterpret_borrow<py::object>(x);
    scales = py::none();
  }
  const bool fp8 = !scales.is_none();
  xa = fp8 ? TensorArg("x", rows, torch.fp8, 2, kAnyDevice, torch.uint8)
           : TensorArg("x", rows, torch.bfloat16, 2, kAnyDevice);
  const int64_t tokens = xa.shape[0], hidden = xa.shape[1], group = fp8 ? 128 : 16;
  if (hidden % group) {
    Invalid("x: hidden " + std::to_string(hidden) + " is not a multiple of " +
            std::to_string(group) + (fp8 ? " (fp8 rows)" : " (bf16 rows)"));
  }
  if (fp8) {
    sa = TensorArg("x scales", scales, torch.float32, 2, xa.device);
    if (sa->shape != std::vector<int64_t>{tokens, hidden / 128}) {
      Invalid("x scales: shape " + Shape(sa->shape) + ", expected " + Pair(tokens, hidden / 128));
    }
  }
}

}  // namespace

void DeepEpNormal::Request::SetX(PyObject* x_given) { Rows(x_given, x, scales, xa, sa); }

const DeepEpNormal::Settings& DeepEpNormal::Setup(PyObject* self) {
  if (!settings_) {
    const py::tuple s = CallHook(self, Hooks::Get().settings);
    settings_ = std::make_shared<Settings>(Settings{py::cast<int64_t>(s[0]), py::cast<bool>(s[1]),
                                                    py::cast<int64_t>(s[2]), s[3], s[4],
                                                    py::reinterpret_borrow<py::dict>(s[5])});
  }
  return *settings_;
}

std::shared_ptr<DeepEpNormal::Entry> DeepEpNormal::Take(PyObject* self, const py::handle& x,
                                                        int device, int64_t capacity,
                                                        int64_t hidden, int64_t experts, int64_t k,
                                                        bool fp8) {
  for (const std::shared_ptr<Entry>& e : entries_) {
    if (e->device == device && e->capacity == capacity && e->hidden == hidden &&
        e->experts == experts && e->k == k && e->fp8 == fp8 && !e->pooled->busy) {
      e->pooled->busy = true;
      return e;
    }
  }
  // Every AllToAll of the shape held, or none yet: the pool's next (taken, busy).
  auto pooled = py::cast<std::shared_ptr<PooledAllToAll>>(
      CallHook(self, Hooks::Get().pool, x, capacity, hidden, experts, k, fp8));
  for (const std::shared_ptr<Entry>& e : entries_) {
    if (e->pooled == pooled) return e;  // one the pool held that this list had
  }
  entries_.push_back(std::make_shared<Entry>(
      Entry{device, capacity, hidden, experts, k, fp8, std::move(pooled), py::object(), {}}));
  return entries_.back();
}

template <typename Device>
py::object DeepEpNormal::Received(PyObject* self, PyAllToAll& a2a,
                                  const std::optional<void*>& stream, Device device,
                                  const ReceivedTensors& got) {
  const Hooks& hooks = Hooks::Get();
  // The caller's torch stream where the AllToAll's is another: what the epilogue allocates on
  // the AllToAll's is marked used on it.
  const py::object caller = stream && !a2a.RunsOn(stream)
                                ? CallHook(self, hooks.caller_stream, device())
                                : py::object(py::none());
  // Made as its class's __init__ would fill its slots, without the Python call.
  auto* type = reinterpret_cast<PyTypeObject*>(Setup(self).received_type.ptr());
  py::object r = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!r) throw py::error_already_set();
  const std::pair<PyObject*, py::object> slots[] = {
      {hooks.read_back, got.counts}, {hooks.tokens, got.tokens}, {hooks.senders, got.ranks},
      {hooks.recv, got.x},           {hooks.scales, got.scales}, {hooks.experts, got.experts},
      {hooks.weights, got.weights},  {hooks.made, py::tuple()},  {hooks.caller, caller},
      {hooks.src_idx, py::none()}};
  for (const auto& [name, value] : slots) {
    if (PyObject_SetAttr(r.ptr(), name, value.ptr()) != 0) throw py::error_already_set();
  }
  return r;
}

std::vector<int64_t> DeepEpNormal::ReadCounts(const py::object& read_back, const Array& counts,
                                              int device) const {
  const int64_t n = Elements(counts);
  std::vector<int32_t> host(static_cast<size_t>(n));
  if (device < 0) {  // the host device's receive has written them when it returns
    std::memcpy(host.data(), counts.pointer(), host.size() * 4);
  } else if (const TorchApi* glue = TorchGlue()) {
    if (!glue->to_host(read_back.ptr(), host.data(), n * 4)) throw py::error_already_set();
  } else {
    const py::list read = read_back.attr("tolist")();
    for (int64_t i = 0; i < n; ++i) host[size_t(i)] = py::cast<int32_t>(read[size_t(i)]);
  }
  return {host.begin(), host.end()};
}

DeepEpNormal::Result DeepEpNormal::Run(PyObject* self, Request& r) {
  if (closed_) Invalid("dispatch: the Buffer was destroyed");
  const Settings& settings = Setup(self);
  const Torch& torch = Torch::Get();
  const Hooks& hooks = Hooks::Get();
  const bool fp8 = r.sa.has_value(), by_rank = !r.every_count.is_none();
  const int device = r.xa.device;
  const int64_t tokens = r.xa.shape[0], hidden = r.xa.shape[1];
  if (r.alignment < 1) Invalid("expert_alignment " + std::to_string(r.alignment) + ": at least 1");
  if (!by_rank) {
    if (!r.ia) r.ia = TensorArg("topk_idx", r.topk_idx, torch.int64, 2, device, torch.int32);
    if (r.ia->shape[0] != tokens) {
      Invalid("topk_idx: " + std::to_string(r.ia->shape[0]) + " rows, x has " +
              std::to_string(tokens));
    }
    if (!r.topk_weights.is_none()) {
      r.wa = TensorArg("topk_weights", r.topk_weights, torch.float32, 2, device);
      if (r.wa->shape != r.ia->shape) {
        Invalid("topk_weights: shape " + Shape(r.wa->shape) + ", topk_idx " + Shape(r.ia->shape));
      }
    }
  }
  // The tokens per rank num_nvl_bytes + num_rdma_bytes hold of every rank's rows at this
  // hidden size (at least one).
  const int64_t per_token = world_ * (hidden * 2 + hidden / 128 * 4 + 16);
  const int64_t capacity = std::max<int64_t>(1, settings.buffer_bytes / per_token);
  if (tokens > capacity) {
    ThrowIfError(ResourceExhaustedError(
        "dispatch: " + std::to_string(tokens) +
        " tokens, the Buffer's num_nvl_bytes + num_rdma_bytes hold " + std::to_string(capacity) +
        " per rank at hidden " + std::to_string(hidden) + " (" + std::to_string(world_) +
        " ranks): make it larger"));
  }
  const int64_t rows = world_ * capacity;
  if (r.worst > rows) {
    Invalid("num_worst_tokens " + std::to_string(r.worst) + ": more than the " +
            std::to_string(rows) + " rows ranks can send here");
  }
  const int64_t k = by_rank ? world_ : r.ia->shape[1];
  const std::shared_ptr<Entry> e = Take(self, r.x, device, capacity, hidden, r.experts, k, fp8);
  // A call whose steps fail frees its AllToAll (which reports the failure to its next call).
  // Once the receive has run, the AllToAll awaits that dispatch's combine (its next step must
  // be CombineSend): a failure after it (a hook's torch work, the counts' read) leaves it held,
  // and the shape's next call takes another from the pool.
  struct FreedIfStepsFail {
    PooledAllToAll* pooled;
    bool ran = false;
    ~FreedIfStepsFail() {
      if (!ran) pooled->busy = false;
    }
  } held{e->pooled.get()};
  PyAllToAll* const a2a = e->pooled->raw;
  const py::object& a2a_object = e->pooled->a2a;
  const std::optional<void*> stream = CurrentStream(device);
  const py::object current = StreamObject(stream);
  py::object x_device;  // torch's device object, for the hooks that need one
  auto torch_device = [&]() -> const py::object& {
    if (!x_device) x_device = r.x.attr(hooks.device);
    return x_device;
  };
  ReceivedTensors got;
  py::object weights = r.topk_weights, received, made = py::tuple();
  // async_finish: the AllToAll's steps go on the communication stream from its first call
  // on, so that its transfers overlap the caller's work; a first call that waits gives it the
  // caller's stream (Ordered's may_adopt).
  if (r.async && stream && a2a->stream().is_none()) CallHook(self, hooks.stream_for, e->pooled);
  bool waited_previous = false;
  if (!r.previous.is_none() && !r.previous.attr(hooks.event).is_none()) {
    CallHook(self, hooks.wait_previous, r.previous, a2a_object, current, torch_device());
    waited_previous = true;
  }
  a2a->Ordered(stream, !waited_previous, !r.async, true, [&] {
    if (!r.wa) {
      if (!e->ones) {  // made on the stream the steps go on, which reads it
        e->ones = CallHook(self, hooks.constant, r.x, capacity, k, 1.0, a2a_object, current);
        e->ones_array = TensorArg("ones", e->ones, torch.float32, 2, device);
      }
      weights = e->ones;
    }
    if (by_rank) {  // rank r's column holds r where the token goes there
      r.topk_idx = CallHook(self, hooks.rank_ids, r.is_token_in_rank, k, a2a_object, current,
                            torch_device());
      r.ia = TensorArg("topk_idx", r.topk_idx, torch.int32, 2, device);
    }
    a2a->DispatchSendArrays(r.xa, *r.ia, r.wa ? *r.wa : e->ones_array, fp8 ? &*r.sa : nullptr,
                            static_cast<int>(tokens), nullptr, Fp8Scaling::kAmax);
    // The outputs, made on the caller's stream (DeepEP's allocate_on_comm_stream=False);
    // the rows received and the per-expert counts side by side, one read to the host.
    got = DispatchRecvNew(*a2a, py::handle(r.xa.dtype), device, settings.sources, timeout_);
    held.ran = true;
    if (r.worst > 0) {  // no wait for the count: rows past it hold no token
      CallHook(self, hooks.mask_worst, got.experts, got.weights, got.counts, r.worst, a2a_object,
               current, torch_device());
    }
    if (r.keep_received || !r.epilogue.is_none()) {
      received = Received(self, *a2a, stream, torch_device, got);
    }
    if (!r.epilogue.is_none()) {
      made =
          CallHook(self, hooks.epilogue, r.epilogue, received, a2a_object, current, torch_device());
    }
  });
  Result out;
  out.received = received;
  if (r.async) {  // an event the caller waits on, with what must live until it fires
    py::dict kwargs;
    kwargs["waited"] = false;
    kwargs["device"] = torch_device();
    py::tuple outputs = py::make_tuple(got.x, got.scales, got.counts, got.experts, got.weights,
                                       got.tokens, got.ranks) +
                        py::tuple(made);
    out.event = CallHook(self, hooks.end, a2a_object, current, true,
                         py::make_tuple(r.x, r.scales, r.topk_idx, weights), outputs, **kwargs);
  } else {
    out.event = done_;
  }
  int64_t received_rows;
  py::list per_expert;
  if (r.worst > 0) {
    received_rows = r.worst;
  } else {
    if (r.async) out.event.attr(hooks.wait)();
    const std::vector<int64_t> read = ReadCounts(got.counts, got.counts_array, device);
    received_rows = read[0];
    if (by_rank) {  // the ids that would count them stayed with their senders
      const py::list every = CallHook(self, hooks.per_expert, r.every_count);
      for (const py::handle c : every) {
        const int64_t n = py::cast<int64_t>(c);
        per_expert.append((n + r.alignment - 1) / r.alignment * r.alignment);
      }
    } else {
      for (size_t i = 1; i < read.size(); ++i) {
        per_expert.append((read[i] + r.alignment - 1) / r.alignment * r.alignment);
      }
    }
  }
  out.rows = received_rows;
  out.counted = r.worst == 0;
  // The received rows, as views.
  const py::object recv_x = FirstRowsOf(got.x, received_rows);
  out.out_x =
      fp8 ? py::object(py::make_tuple(recv_x, FirstRowsOf(got.scales, received_rows))) : recv_x;
  out.src_idx = FirstRowsOf(got.tokens, received_rows);
  if (received) received.attr(hooks.src_idx) = out.src_idx;
  if (r.cached) {
    r.cached->pooled = e->pooled;
    r.cached->rows = py::int_(received_rows);
    r.cached->in_flight = true;
    out.recv_idx = out.recv_weights = out.per_expert = py::none();
    return out;
  }
  out.per_expert = per_expert;
  out.handle = std::make_shared<DeepEpHandle>(DeepEpHandle{.pooled = e->pooled,
                                                           .tokens = tokens,
                                                           .k = k,
                                                           .hidden = hidden,
                                                           .num_experts = r.experts,
                                                           .topk_idx = r.topk_idx,
                                                           .max_tokens = py::none(),
                                                           .topk_weights = r.topk_weights,
                                                           .rows = py::int_(received_rows),
                                                           .device = device,
                                                           .combine_buffer = py::none()});
  out.handle_object = py::cast(out.handle);
  if (by_rank) {
    out.recv_idx = out.recv_weights = py::none();
  } else {
    out.recv_idx = FirstRowsOf(got.experts, received_rows);  // int64, as the receive wrote them
    out.recv_weights = r.wa ? FirstRowsOf(got.weights, received_rows) : py::object(py::none());
  }
  if (!received && world_ > settings.ranks_per_node && settings.sources) {
    // V1's internode handle holds the rows' prefix sums per sender, which the _Received counts.
    received = Received(self, *a2a, stream, torch_device, got);
    out.received = received;
  }
  return out;
}

// V1's handle: its tuple as V1 lays it out within one node or across nodes, what ferry does not
// keep as NotKept entries (_events.NormalHandle says which), ferry's handle in `_ferry`.
py::object DeepEpNormal::NormalHandle(PyObject* self, const Result& got,
                                      const py::object& is_token_in_rank) {
  static PyObject* const ferry = PyUnicode_InternFromString("_ferry");
  const Settings& s = Setup(self);
  auto not_kept = [&](const char* name) { return py::object(s.not_kept[name]); };
  std::vector<py::object> items;
  if (world_ <= s.ranks_per_node) {
    items = {not_kept("rank_prefix_matrix"),
             not_kept("channel_prefix_matrix"),
             not_kept("recv_channel_prefix_matrix"),
             got.src_idx.is_none() ? not_kept("recv_src_idx") : got.src_idx,
             is_token_in_rank,
             not_kept("send_head")};
  } else {
    py::object gbl = not_kept("recv_gbl_rank_prefix_sum"),
               rdma = not_kept("recv_rdma_rank_prefix_sum");
    if (got.received) {
      const py::object sums =
          CallHook(self, Hooks::Get().prefix_sums, got.received,
                   got.counted ? py::object(py::int_(got.rows)) : py::object(py::none()));
      if (!sums.is_none()) {
        gbl = py::tuple(sums)[0];
        rdma = py::tuple(sums)[1];
      }
    }
    items = {is_token_in_rank,
             not_kept("rdma_channel_prefix_matrix"),
             not_kept("gbl_channel_prefix_matrix"),
             not_kept("recv_rdma_channel_prefix_matrix"),
             rdma,
             not_kept("recv_gbl_channel_prefix_matrix"),
             gbl,
             not_kept("recv_src_meta"),
             not_kept("send_rdma_head"),
             not_kept("send_nvl_head")};
  }
  // Made as tuple_subtype_new makes one (allocated, its items set), without the Python call.
  auto* type = reinterpret_cast<PyTypeObject*>(s.handle_type.ptr());
  py::object t = py::reinterpret_steal<py::object>(
      type->tp_alloc(type, static_cast<Py_ssize_t>(items.size())));
  if (!t) throw py::error_already_set();
  for (size_t i = 0; i < items.size(); ++i) {
    PyTuple_SET_ITEM(t.ptr(), static_cast<Py_ssize_t>(i), items[i].release().ptr());
  }
  if (PyObject_SetAttr(t.ptr(), ferry, got.handle_object.ptr()) != 0) {
    throw py::error_already_set();
  }
  return t;
}

py::object DeepEpNormal::Dispatch(PyObject* self,
                                  const std::array<PyObject*, kDispatchArgs.size()>& a) {
  Request r;
  r.SetX(a[0]);
  const int64_t tokens = r.xa.shape[0], hidden = r.xa.shape[1];
  auto given = [&](int i) { return !IsNone(a[size_t(i)]); };
  auto object = [&](int i) {
    return given(i) ? py::reinterpret_borrow<py::object>(a[size_t(i)]) : py::object(py::none());
  };
  r.topk_idx = object(6);
  r.topk_weights = object(7);
  r.alignment = given(8) ? Int("expert_alignment", a[8]) : 1;
  r.worst = given(9) ? Int("num_worst_tokens", a[9]) : 0;
  r.previous = object(11);
  r.async = Flag(a[12], false);
  py::object is_token_in_rank = object(4);
  if (given(1)) {  // a cached dispatch: the routing of the handle's again
    if (given(6) || given(7)) {
      Invalid(
          "a cached dispatch (handle) takes no topk_idx / topk_weights: the handle's are "
          "used");
    }
    r.cached = NormalHandleOf(a[1], "dispatch");
    if (r.cached->in_flight) Invalid("dispatch: the handle's dispatch is not combined yet");
    r.topk_idx = r.cached->topk_idx;
    r.topk_weights = r.cached->topk_weights;
    r.experts = r.cached->num_experts;
    if (tokens != r.cached->tokens || hidden != r.cached->hidden) {
      Invalid("x: shape " + Pair(tokens, hidden) + ", the handle's dispatch had " +
              Pair(r.cached->tokens, r.cached->hidden));
    }
  } else {
    if (!given(5)) Invalid("num_tokens_per_expert: required (get_dispatch_layout's)");
    r.experts = Elements(TensorArg("num_tokens_per_expert", a[5], nullptr, 1, kAnyDevice));
    if (r.experts % world_) {
      Invalid("num_experts " + std::to_string(r.experts) + ": not divisible by " +
              std::to_string(world_) + " ranks");
    }
    if (!given(2)) Invalid("num_tokens_per_rank: required (get_dispatch_layout's)");
    const int64_t per_rank =
        Elements(TensorArg("num_tokens_per_rank", a[2], nullptr, -1, kAnyDevice));
    if (per_rank != world_) {
      Invalid("num_tokens_per_rank: " + std::to_string(per_rank) + " entries, expected " +
              std::to_string(world_));
    }
    if (!given(4)) Invalid("is_token_in_rank: required (get_dispatch_layout's)");
    if (!given(6)) {  // DeepEP routes by is_token_in_rank alone: one expert per rank
      if (given(7)) {
        Invalid("topk_weights: given without topk_idx (the weights follow the ids)");
      }
      if (r.worst > 0) {
        Invalid("num_worst_tokens " + std::to_string(r.worst) +
                ": needs topk_idx (the rows past those received are marked by their ids)");
      }
      const Array in_rank = TensorArg("is_token_in_rank", a[4], Torch::Get().bool_, 2, r.xa.device);
      if (in_rank.shape != std::vector<int64_t>{tokens, world_}) {
        Invalid("is_token_in_rank: shape " + Shape(in_rank.shape) + ", expected " +
                Pair(tokens, world_));
      }
      r.every_count = object(5);
      r.is_token_in_rank = is_token_in_rank;
      r.experts = world_;
    }
  }
  Result got = Run(self, r);
  if (r.cached) {
    return py::make_tuple(got.out_x, py::none(), py::none(), py::none(), py::none(), got.event);
  }
  return py::make_tuple(got.out_x, got.recv_idx, got.recv_weights, got.per_expert,
                        NormalHandle(self, got, is_token_in_rank), got.event);
}

namespace {

DeepEpNormal& (*normal_of)(PyObject* self) = nullptr;

DeepEpNormal& NormalOfSelf(PyObject* self) { return normal_of(self); }
constexpr char kDispatch[] = "Buffer.dispatch";
constexpr char kCombine[] = "Buffer.combine";

PyMethodDef dispatch_def{
    "dispatch",
    AsCFunction<&FastMethod<kDispatch, DeepEpNormal::kDispatchArgs, 1, NormalOfSelf,
                            &DeepEpNormal::Dispatch>>(),
    METH_FASTCALL | METH_KEYWORDS,
    "dispatch($self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, "
    "is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, "
    "expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False)\n--\n\n"
    "DeepEP's normal-mode dispatch: (recv_x, recv_topk_idx, recv_topk_weights, "
    "num_recv_tokens_per_expert_list, handle, event); with a handle (a cached dispatch: the "
    "routing of that dispatch again), (recv_x, None, None, None, None, event). x: [tokens, "
    "hidden] bf16, or (x e4m3, scales [tokens, hidden / 128] fp32). The layout arguments must "
    "be get_dispatch_layout's for topk_idx; ferry routes from topk_idx itself (without it, by "
    "is_token_in_rank: one expert per rank)"};
PyMethodDef combine_def{
    "combine",
    AsCFunction<&FastMethod<kCombine, DeepEpNormal::kCombineArgs, 2, NormalOfSelf,
                            &DeepEpNormal::Combine>>(),
    METH_FASTCALL | METH_KEYWORDS,
    "combine($self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False)\n--\n\n"
    "DeepEP's normal-mode combine: (combined_x [tokens, hidden] bf16: each token's rows from "
    "every rank that got it, summed without weights, plus bias; combined_topk_weights [tokens, "
    "columns] fp32 or None; event). bias: a [tokens, hidden] bf16 tensor or a pair of them, "
    "added in fp32 before the rows (a pair is first summed in fp32 and rounded to bf16 once). "
    "topk_weights: [received rows, columns] fp32, summed over the ranks as the rows are (a "
    "second AllToAll; every rank passes it or none)"};
}  // namespace

DeepEpNormal& NormalOf(PyObject* buffer) { return normal_of(buffer); }

void AddNormalMethods(py::handle cls, DeepEpNormal& (*of)(PyObject* self)) {
  normal_of = of;
  AddFastMethod(cls, &dispatch_def);
  AddFastMethod(cls, &combine_def);
}

}  // namespace ferry::python
