// ferry.deep_ep.ElasticBuffer's dispatch and combine (DeepEP V2), written once in C++ as the
// V1 Buffer's are (deep_ep_normal.h): ElasticBuffer (python/ferry/compat/deep_ep/_elastic.py)
// subclasses DeepEpElastic, whose METH_FASTCALL methods check every argument, run the Buffer's
// normal-mode dispatch or combine in the same call and make the EPHandle. What stays Python is
// asked for by name where a call needs it: the settings (at the first call), the epilogue of a
// dispatch with statistics or without the CPU sync, the expanded layout and TMA-aligned
// scales, an expanded combine's fold, and the device's SM count (once per device).
#include <array>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>

#include "deep_ep_hooks.h"
#include "deep_ep_normal.h"
#include "fast_call.h"

namespace ferry::python {
namespace {

// Names of ElasticBuffer's hooks and of EPHandle's attributes, made once.
struct ElasticNames {
  PyObject* const settings = PyUnicode_InternFromString("_elastic_settings");
  PyObject* const epilogue = PyUnicode_InternFromString("_epilogue");
  PyObject* const expand_outputs = PyUnicode_InternFromString("_expand_outputs");
  PyObject* const fold = PyUnicode_InternFromString("_fold");
  PyObject* const device_sms = PyUnicode_InternFromString("_device_sms");
  PyObject* const do_expand = PyUnicode_InternFromString("do_expand");
  PyObject* const num_experts = PyUnicode_InternFromString("num_experts");
  PyObject* const expert_alignment = PyUnicode_InternFromString("expert_alignment");
  PyObject* const num_max_tokens_per_rank = PyUnicode_InternFromString("num_max_tokens_per_rank");
  PyObject* const num_sms = PyUnicode_InternFromString("num_sms");
  PyObject* const topk_idx = PyUnicode_InternFromString("topk_idx");
  PyObject* const num_recv_tokens = PyUnicode_InternFromString("num_recv_tokens");
  PyObject* const num_expanded_tokens = PyUnicode_InternFromString("num_expanded_tokens");
  PyObject* const per_expert_list = PyUnicode_InternFromString("num_recv_tokens_per_expert_list");
  PyObject* const psum = PyUnicode_InternFromString("_psum");
  PyObject* const unaligned = PyUnicode_InternFromString("num_unaligned_recv_tokens_per_expert");
  PyObject* const slot_idx = PyUnicode_InternFromString("dst_buffer_slot_idx");
  PyObject* const at_forward = PyUnicode_InternFromString("token_metadata_at_forward");
  PyObject* const linked_list = PyUnicode_InternFromString("channel_linked_list");
  PyObject* const ferry = PyUnicode_InternFromString("_ferry");
  PyObject* const slots = PyUnicode_InternFromString("_slots");
  PyObject* const received = PyUnicode_InternFromString("_received");
  PyObject* const scaleup = PyUnicode_InternFromString("_scaleup");
  PyObject* const world = PyUnicode_InternFromString("_world");
  PyObject* const metadata = PyUnicode_InternFromString("_metadata");
  PyObject* const psum_scaleup = PyUnicode_InternFromString("_psum_scaleup");
  PyObject* const dict = PyUnicode_InternFromString("__dict__");
  static const ElasticNames& Get() {
    static const ElasticNames n;
    return n;
  }
};

py::object Attr(const py::handle& o, PyObject* name) { return o.attr(name); }

class PyDeepEpElastic {
 public:
  static constexpr std::array<const char*, 19> kDispatchArgs{"x",
                                                             "topk_idx",
                                                             "topk_weights",
                                                             "cumulative_local_expert_recv_stats",
                                                             "num_experts",
                                                             "num_max_tokens_per_rank",
                                                             "expert_alignment",
                                                             "num_sms",
                                                             "num_qps",
                                                             "previous_event",
                                                             "previous_event_before_epilogue",
                                                             "async_with_compute_stream",
                                                             "allocate_on_comm_stream",
                                                             "handle",
                                                             "do_handle_copy",
                                                             "do_cpu_sync",
                                                             "do_expand",
                                                             "do_zero_padding",
                                                             "use_tma_aligned_col_major_sf"};
  static constexpr std::array<const char*, 10> kCombineArgs{"x",
                                                            "handle",
                                                            "topk_weights",
                                                            "bias",
                                                            "num_sms",
                                                            "num_qps",
                                                            "previous_event",
                                                            "previous_event_before_epilogue",
                                                            "async_with_compute_stream",
                                                            "allocate_on_comm_stream"};

  // (recv_x, recv_topk_idx, recv_topk_weights, handle, event): _elastic.py's ElasticBuffer
  // docstring says what each form gives.
  py::object Dispatch(PyObject* self, const std::array<PyObject*, kDispatchArgs.size()>& a) {
    const Settings& s = Setup(self);
    const ElasticNames& n = ElasticNames::Get();
    auto given = [&](size_t i) { return !IsNone(a[i]); };
    auto object = [&](size_t i) {
      return given(i) ? py::reinterpret_borrow<py::object>(a[i]) : py::object(py::none());
    };
    DeepEpNormal::Request r;
    r.topk_idx = object(1);
    r.topk_weights = object(2);
    const bool do_expand = Flag(a[16], false), zero = Flag(a[17], false);
    const bool tma = Flag(a[18], false);
    std::optional<bool> cpu_sync;
    if (given(15)) cpu_sync = Flag(a[15], true);
    py::object cached = py::none();
    r.experts = given(4) ? Int("num_experts", a[4]) : 0;
    r.alignment = given(6) ? Int("expert_alignment", a[6]) : 1;
    if (given(13)) {  // a cached dispatch: the routing of the handle's again
      cached = object(13);
      if (!PyObject_TypeCheck(cached.ptr(), reinterpret_cast<PyTypeObject*>(s.handle_type.ptr()))) {
        Invalid("dispatch: handle is not one this ElasticBuffer returned");
      }
      if (given(1)) Invalid("dispatch: a cached dispatch (handle) takes no topk_idx");
      if (cpu_sync && *cpu_sync) Invalid("dispatch: a cached dispatch cannot sync with the CPU");
      const bool had = py::cast<bool>(Attr(cached, n.do_expand));
      if (do_expand != had) {
        Invalid(std::string("dispatch: do_expand=") + (do_expand ? "True" : "False") +
                ", the handle's dispatch had " + (had ? "True" : "False"));
      }
      r.topk_idx = Attr(cached, n.topk_idx);
      if (!given(4)) r.experts = py::cast<int64_t>(Attr(cached, n.num_experts));
      const int64_t alignment = py::cast<int64_t>(Attr(cached, n.expert_alignment));
      if (!given(6)) r.alignment = alignment;
      if (r.alignment != alignment) {
        Invalid("expert_alignment " + std::to_string(r.alignment) + ": the handle's dispatch had " +
                std::to_string(alignment));
      }
      cpu_sync = false;
    }
    if (zero && !do_expand) {
      Invalid("do_zero_padding: zeroes the expanded layout's padding; needs do_expand");
    }
    if (r.topk_idx.is_none()) Invalid("dispatch: topk_idx (or a cached handle)");
    if (!given(4) && cached.is_none()) Invalid("dispatch: num_experts (or a cached handle)");
    const bool sync = cpu_sync.value_or(true);
    int64_t m = given(5) ? Int("num_max_tokens_per_rank", a[5]) : 0;
    if (m == 0) m = s.max_tokens;
    if (!cached.is_none()) {
      const int64_t had = py::cast<int64_t>(Attr(cached, n.num_max_tokens_per_rank));
      if (m != had) {
        Invalid("num_max_tokens_per_rank " + std::to_string(m) + ": the handle's dispatch had " +
                std::to_string(had));
      }
    }
    r.SetX(a[0]);
    const int device = r.xa.device;
    const int64_t tokens = r.xa.shape[0];
    if (m <= 0) Invalid("num_max_tokens_per_rank: given neither here nor at construction");
    if (tokens > m) {
      Invalid("x: " + std::to_string(tokens) + " tokens, more than num_max_tokens_per_rank " +
              std::to_string(m));
    }
    if (r.experts % s.ranks) {
      Invalid("num_experts " + std::to_string(r.experts) + ": not divisible by " +
              std::to_string(s.ranks) + " ranks");
    }
    if (r.experts <= 0) Invalid("num_experts " + std::to_string(r.experts) + ": at least 1");
    // ferry has no separate epilogue: the earlier of the two events orders the whole call.
    const py::object previous = given(9) ? object(9) : object(10);
    if (!previous.is_none()) r.previous = s.event_type(previous);
    r.async = Flag(a[11], false);
    // Rows without a host wait: a cached dispatch's routing is its handle's, so are its
    // received rows; otherwise every rank's most.
    if (!sync) {
      r.worst = cached.is_none() ? s.ranks * m : py::cast<int64_t>(Attr(cached, n.num_recv_tokens));
    }
    const int64_t local = r.experts / s.ranks;
    r.ia = TensorArg("topk_idx", r.topk_idx, Torch::Get().int64, 2, device, Torch::Get().int32);
    const py::object stats = object(3);
    if (!stats.is_none()) {
      const Array sa =
          TensorArg("cumulative_local_expert_recv_stats", stats, Torch::Get().int32, 1, device);
      if (sa.shape[0] != local) {
        Invalid("cumulative_local_expert_recv_stats: " + std::to_string(local) + " entries");
      }
    }
    py::object made = py::dict();  // what the epilogue or the expansion makes
    if (!stats.is_none() || !sync) {
      const py::tuple e = CallHook(self, n.epilogue, stats, sync, r.alignment, do_expand, r.worst,
                                   local, r.ia->shape[1], zero, cached);
      r.epilogue = e[0];
      made = e[1];
    }
    r.keep_received = true;
    DeepEpNormal::Result got = s.normal->Run(s.buffer.ptr(), r);
    py::object recv_x = got.out_x, recv_idx = got.recv_idx, recv_weights = got.recv_weights;
    py::object event = got.event, psum, total = py::int_(0), unaligned = py::none(),
               slots = py::none();
    const bool fp8 = r.sa.has_value();
    if (do_expand || (fp8 && tma) || !sync) {
      const py::tuple o =
          CallHook(self, n.expand_outputs, recv_x, recv_idx, recv_weights, got.per_expert, event,
                   got.received, made, sync, do_expand, r.async, local, r.alignment, zero,
                   !r.topk_weights.is_none(), tma, cached);
      recv_x = o[0];
      recv_idx = o[1];
      recv_weights = o[2];
      event = o[3];
      psum = o[4];
      total = o[5];
      unaligned = o[6];
      slots = o[7];
    } else {
      // The aligned counts are on the host already: their prefix sums go over in one copy at
      // the handle's first reading (a few device ops on int32 cost tens of microseconds).
      py::list sums;
      int64_t sum = 0;
      for (const py::handle c : py::list(got.per_expert)) {
        sum += py::cast<int64_t>(c);
        sums.append(sum);
      }
      psum = sums;
    }
    if (!cached.is_none()) {
      cached.attr(n.ferry) = got.handle_object;
      return py::make_tuple(recv_x, recv_idx, recv_weights, cached, event);
    }
    py::object sms = given(7) ? object(7) : py::object(py::int_(0));
    if (!PyObject_IsTrue(sms.ptr())) sms = DeviceSms(self, device);
    // do_handle_copy (default True): the handle keeps its own copy of the ids.
    const py::object handle_ids = Flag(a[14], true) ? Clone(r.topk_idx) : r.topk_idx;
    // The handle's attributes, set as one dict (EPHandle's docstring says which).
    py::dict d;
    d[n.do_expand] = py::bool_(do_expand);
    d[n.num_experts] = py::int_(r.experts);
    d[n.expert_alignment] = py::int_(r.alignment);
    d[n.num_max_tokens_per_rank] = py::int_(m);
    d[n.num_sms] = sms;
    d[n.topk_idx] = handle_ids;
    d[n.num_recv_tokens] = py::int_(got.rows);
    d[n.num_expanded_tokens] = do_expand ? total : py::object(py::int_(0));
    d[n.per_expert_list] = sync ? got.per_expert : py::object(py::none());
    d[n.psum] = psum;
    d[n.unaligned] = unaligned;
    d[n.slot_idx] = py::none();
    d[n.at_forward] = py::none();
    d[n.linked_list] = py::none();
    d[n.ferry] = got.handle_object;
    d[n.slots] = slots;
    d[n.received] = got.received;
    d[n.scaleup] = py::int_(s.scaleup);
    d[n.world] = py::int_(s.ranks);
    d[n.metadata] = py::none();
    d[n.psum_scaleup] = py::none();
    auto* type = reinterpret_cast<PyTypeObject*>(s.handle_type.ptr());
    py::object handle = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
    if (!handle || PyObject_SetAttr(handle.ptr(), n.dict, d.ptr()) != 0) {
      throw py::error_already_set();
    }
    return py::make_tuple(recv_x, recv_idx, recv_weights, handle, event);
  }

  // (combined_x, combined_topk_weights, event): the V1 Buffer's combine of the handle's
  // dispatch; after an expanded one, each token's copies first folded into one row
  // (ElasticBuffer._fold).
  py::object Combine(PyObject* self, const std::array<PyObject*, kCombineArgs.size()>& a) {
    const Settings& s = Setup(self);
    const ElasticNames& n = ElasticNames::Get();
    const py::handle handle(a[1]);
    if (!PyObject_TypeCheck(handle.ptr(), reinterpret_cast<PyTypeObject*>(s.handle_type.ptr()))) {
      Invalid("combine: handle is not one this ElasticBuffer's dispatch returned");
    }
    py::object x = py::reinterpret_borrow<py::object>(a[0]);
    py::object weights =
        IsNone(a[2]) ? py::object(py::none()) : py::reinterpret_borrow<py::object>(a[2]);
    py::object previous = !IsNone(a[6])   ? py::reinterpret_borrow<py::object>(a[6])
                          : !IsNone(a[7]) ? py::reinterpret_borrow<py::object>(a[7])
                                          : py::object(py::none());
    if (!previous.is_none()) previous = s.event_type(previous);
    if (py::cast<bool>(Attr(handle, n.do_expand))) {
      const py::tuple folded = CallHook(self, n.fold, x, weights, handle, previous);
      x = folded[0];
      weights = folded[1];
      previous = py::none();  // the current stream waited for it, and the combine follows that
    }
    const py::object inner = Attr(handle, n.ferry);
    std::array<PyObject*, DeepEpNormal::kCombineArgs.size()> args{
        x.ptr(), inner.ptr(), weights.ptr(), a[3], nullptr, previous.ptr(), a[8], nullptr};
    return s.normal->Combine(s.buffer.ptr(), args);
  }

 private:
  // What the calls read of the ElasticBuffer, asked (_elastic_settings) at the first call.
  struct Settings {
    py::object buffer;  // the V1 Buffer it runs on
    DeepEpNormal* normal;
    int64_t max_tokens, ranks, scaleup;
    py::object handle_type, event_type;  // EPHandle, EventOverlap
  };

  const Settings& Setup(PyObject* self) {
    if (!settings_) {
      const py::tuple t = CallHook(self, ElasticNames::Get().settings);
      settings_ = Settings{t[0],
                           &NormalOf(t[0].ptr()),
                           py::cast<int64_t>(t[1]),
                           py::cast<int64_t>(t[2]),
                           py::cast<int64_t>(t[3]),
                           t[4],
                           t[5]};
    }
    return *settings_;
  }

  py::object DeviceSms(PyObject* self, int device) {
    py::object& sms = sms_[device];
    if (!sms) sms = CallHook(self, ElasticNames::Get().device_sms, device);
    return sms;
  }

  static py::object Clone(const py::object& t) {
    if (const TorchApi* glue = TorchGlue()) {
      PyObject* c = glue->clone(t.ptr());
      if (!c) throw py::error_already_set();
      return py::reinterpret_steal<py::object>(c);
    }
    return t.attr("clone")();
  }

  std::optional<Settings> settings_;
  std::map<int, py::object> sms_;
};

PyDeepEpElastic& ElasticOf(PyObject* self) { return py::cast<PyDeepEpElastic&>(py::handle(self)); }
constexpr char kDispatch[] = "ElasticBuffer.dispatch";
constexpr char kCombine[] = "ElasticBuffer.combine";

PyMethodDef dispatch_def{
    "dispatch",
    AsCFunction<&FastMethod<kDispatch, PyDeepEpElastic::kDispatchArgs, 1, ElasticOf,
                            &PyDeepEpElastic::Dispatch>>(),
    METH_FASTCALL | METH_KEYWORDS,
    "dispatch($self, x, topk_idx=None, topk_weights=None, "
    "cumulative_local_expert_recv_stats=None, num_experts=None, num_max_tokens_per_rank=None, "
    "expert_alignment=None, num_sms=0, num_qps=0, previous_event=None, "
    "previous_event_before_epilogue=None, async_with_compute_stream=False, "
    "allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None, "
    "do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False)\n--\n\n"
    "(recv_x, recv_topk_idx, recv_topk_weights, handle, event): each token once on every rank "
    "that holds any of its experts, its ids there local to the rank (-1: another rank's) with "
    "their weights. do_cpu_sync (default: unless `handle`): the rows are exactly those "
    "received; without it, num_max_tokens_per_rank x ranks rows, those past the received ones "
    "with ids -1 and weights 0 (no host wait). A cached dispatch (`handle`) routes as the "
    "handle's did. do_expand: each token's copy for each of this rank's experts in a row of "
    "its own, grouped by expert, each expert's rows rounded up to expert_alignment (the "
    "padding zeroed with do_zero_padding); recv_topk_idx is then None and recv_topk_weights "
    "each row's weight. use_tma_aligned_col_major_sf: fp8 scales in the TMA-aligned "
    "column-major layout"};
PyMethodDef combine_def{
    "combine",
    AsCFunction<&FastMethod<kCombine, PyDeepEpElastic::kCombineArgs, 2, ElasticOf,
                            &PyDeepEpElastic::Combine>>(),
    METH_FASTCALL | METH_KEYWORDS,
    "combine($self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, "
    "previous_event=None, previous_event_before_epilogue=None, "
    "async_with_compute_stream=False, allocate_on_comm_stream=False)\n--\n\n"
    "(combined_x, combined_topk_weights, event): each token's rows from every rank that "
    "received it summed (in fp32, rounded to bf16 once, at the token's rank), plus bias; the "
    "top-k weights, if given, summed alike. After an expanded dispatch x holds a row per copy "
    "and topk_weights a weight per row: each token's copies are summed in fp32 on this rank "
    "first and rounded to bf16 (one rounding more, as V2's multiple reduction)"};

}  // namespace

void BindDeepEpElastic(py::module_& m) {
  py::class_<PyDeepEpElastic> elastic(
      m, "DeepEpElastic",
      "The dispatch and combine of ferry.deep_ep.ElasticBuffer (what it subclasses; construct "
      "that instead)");
  elastic.def(py::init<>());
  AddFastMethod(elastic, &dispatch_def);
  AddFastMethod(elastic, &combine_def);
}

}  // namespace ferry::python
