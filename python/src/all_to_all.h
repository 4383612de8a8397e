// The AllToAll binding's class (ferry.AllToAll), shared by the module's bindings (moe.cc) and
// the compatibility layers' C++ halves (compat.cc). Each step checks its arrays against the
// configuration (size, element type, host or the configured GPU, writable outputs) before a
// pointer reaches the core, and runs with the GIL released. With a stream set (CUDA), steps
// return once enqueued: the arrays of every step enqueued since the last synchronize() stay
// referenced until it returns.
#pragma once

#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "all_to_all_args.h"
#include "binding.h"
#include "compat.h"
#include "ferry/moe.h"

namespace ferry::python {

class PyAllToAll {
 public:
  PyAllToAll(const AllToAllConfig& config, py::object engine, Bootstrap& bootstrap)
      : engine_(std::move(engine)) {
    Make([&](TransferEngine* e) { return AllToAll::Create(config, e, bootstrap); });
  }
  // AllToAll::Join: a new process for a lost rank, meeting the survivors' readmit over `group`.
  struct Joining {};
  PyAllToAll(Joining, const AllToAllConfig& config, py::object engine, Bootstrap& group,
             double timeout)
      : engine_(std::move(engine)) {
    Make([&](TransferEngine* e) { return AllToAll::Join(config, e, group, ToMillis(timeout)); });
  }
  ~PyAllToAll() { Close(); }

  // Refused while a step runs on another thread (it has released the GIL); the destructor
  // cannot meet one (a running step holds a reference to this object).
  void Close() {
    if (busy_ > 0) {
      ThrowIfError(FailedPreconditionError("AllToAll.close: a step is running on another thread"));
    }
    if (!a2a_) return;
    {
      py::gil_scoped_release release;
      a2a_.reset();
    }
    ReleaseEngine(engine_);
    ClearHeld();
  }

  const AllToAllConfig& config() const { return a2a().config(); }

  void DispatchSend(const py::handle& x, const py::handle& indices, const py::handle& weights,
                    const py::handle& scales, std::optional<int> num_tokens,
                    const py::handle& device_num_tokens, Fp8Scaling scaling) {
    const std::optional<Array> sa = MaybeArray(scales), da = MaybeArray(device_num_tokens);
    DispatchSendArrays(ToArray(x), ToArray(indices), ToArray(weights), Pointer(sa), num_tokens,
                       Pointer(da), scaling);
  }
  // dispatch_send as Python calls it: an epoch's first step also lets go the arrays of the
  // steps finished before it (ReleaseFinished), so that a caller of the four steps on a stream
  // holds a bounded number of them however long it runs without synchronize().
  void DispatchSendStep(const py::handle& x, const py::handle& indices,
                        const py::handle& weights, const py::handle& scales,
                        std::optional<int> num_tokens, const py::handle& device_num_tokens,
                        Fp8Scaling scaling) {
    ReleaseFinished(std::nullopt);
    DispatchSend(x, indices, weights, scales, num_tokens, device_num_tokens, scaling);
  }
  // The same with the arrays converted (scales, device_num_tokens: null for none).
  void DispatchSendArrays(const Array& xa, const Array& ia, const Array& wa, const Array* sa,
                          std::optional<int> num_tokens, const Array* da, Fp8Scaling scaling) {
    const AllToAllConfig& c = config();
    if (!num_tokens && xa.rows() < 0) {
      ThrowIfError(InvalidArgumentError("dispatch_send: num_tokens is required with a flat x"));
    }
    const int64_t tokens = num_tokens ? *num_tokens : xa.rows();
    // The core checks this too, but the array sizes below follow from it.
    if (tokens < 0 || tokens > c.max_tokens_per_rank) {
      ThrowIfError(InvalidArgumentError("dispatch_send: " + std::to_string(tokens) +
                                        " tokens, configured maximum " +
                                        std::to_string(c.max_tokens_per_rank)));
    }
    const uint64_t copies = static_cast<uint64_t>(tokens) * c.experts_per_token;
    // An fp8 AllToAll given bf16 rows (2-byte elements) and no scales quantises them itself.
    const bool quantize = c.dtype == DispatchDtype::kFp8E4M3 && xa.item_bytes == 2 && !sa;
    Check(&xa, {"x", tokens * static_cast<uint64_t>(c.hidden) * (quantize ? 2 : ItemBytes(c)),
                false, quantize ? char{0} : ItemKind(c), quantize ? 2 : ItemBytes(c)});
    if (quantize && IsFloat16(xa)) {
      ThrowIfError(InvalidArgumentError(
          "x: float16 elements; the dispatch quantises bf16 rows to fp8 (a torch.bfloat16 "
          "tensor, or the bits as int16 / uint16)"));
    }
    Check(&wa, {"weights", copies * 4, false, 'f', 4});
    DispatchInput in;
    if (quantize) {
      in.x_bf16 = static_cast<const uint16_t*>(xa.pointer());
      in.scaling = scaling;
    } else {
      in.x = xa.pointer();
    }
    Indices(ia, copies, in);
    in.weights = static_cast<const float*>(wa.pointer());
    in.num_tokens = static_cast<int>(tokens);
    Owners used{xa.owner, ia.owner, wa.owner};
    if (Wanted(sa, "scales", c.scales_per_token() > 0 && !quantize)) {
      Check(sa,
            {"scales", tokens * static_cast<uint64_t>(c.scales_per_token()) * 4, false, 'f', 4});
      in.scales = static_cast<const float*>(sa->pointer());
      used.push_back(sa->owner);
    }
    if (da) {
      Check(da, {"device_num_tokens", 4, false, 'i', 4});
      in.device_num_tokens = static_cast<const int32_t*>(da->pointer());
      used.push_back(da->owner);
    }
    Run(std::move(used), [&](AllToAll& a) { return a.DispatchSend(in); });
    last_tokens_ = tokens;
  }

  void DispatchRecv(const py::handle& x, const py::handle& num_tokens, const py::handle& scales,
                    const py::handle& num_rows, const py::handle& token_experts,
                    const py::handle& token_weights, double timeout, int expert_padding,
                    const py::handle& wait_cost, int64_t expert_rows,
                    const py::handle& source_tokens, const py::handle& sender_ranges,
                    const py::handle& source_ranks) {
    const bool token_major = config().dispatch_layout == DispatchLayout::kTokenMajor;
    const std::optional<Array> sa = MaybeArray(scales), ra = MaybeArray(num_rows),
                               ea = MaybeArray(token_experts), wa = MaybeArray(token_weights),
                               ca = MaybeArray(wait_cost), ta = MaybeArray(source_tokens),
                               ga = MaybeArray(sender_ranges), ka = MaybeArray(source_ranks);
    for (const auto& [name, a] : {std::pair{"num_rows", &ra}, std::pair{"token_experts", &ea},
                                  std::pair{"token_weights", &wa}}) {
      Wanted(Pointer(*a), name, token_major);
    }
    DispatchRecvArrays(ToArray(x), ToArray(num_tokens), Pointer(sa),
                       {Pointer(ra), Pointer(ea), Pointer(wa)}, timeout, expert_padding,
                       Pointer(ca), expert_rows, {Pointer(ta), Pointer(ga), Pointer(ka)});
  }
  // What a token-major DispatchRecv writes besides the rows (null: expert-major).
  struct TokenMajorArrays {
    const Array* num_rows = nullptr;
    const Array* token_experts = nullptr;
    const Array* token_weights = nullptr;
  };
  // Where the rows came from (DispatchOutput::source_tokens, sender_ranges, source_ranks), each
  // null or not.
  struct SourceArrays {
    const Array* source_tokens;
    const Array* sender_ranges;
    const Array* source_ranks;
  };
  // The same with the arrays converted (scales, wait_cost: null for none).
  void DispatchRecvArrays(const Array& xa, const Array& na, const Array* sa, TokenMajorArrays tm,
                          double timeout, int expert_padding, const Array* ca = nullptr,
                          int64_t expert_rows = 0,
                          SourceArrays sources = {nullptr, nullptr, nullptr}) {
    const AllToAllConfig& c = config();
    const Deadline deadline = DeadlineIn(timeout);
    const bool token_major = c.dispatch_layout == DispatchLayout::kTokenMajor;
    // A padding or block the layout cannot take is the core's to refuse (CheckDispatchOutput);
    // the sizes here follow from one it can.
    if (expert_padding < 0 || expert_rows < 0) {
      ThrowIfError(InvalidArgumentError("dispatch_recv: expert_padding " +
                                        std::to_string(expert_padding) + ", expert_rows " +
                                        std::to_string(expert_rows) + " (at least 0)"));
    }
    const uint64_t rows = static_cast<uint64_t>(c.output_rows(expert_padding, expert_rows));
    Check(&xa, {"x", rows * c.token_bytes(), true, ItemKind(c), ItemBytes(c)});
    Check(&na, {"num_tokens", static_cast<uint64_t>(c.local_experts()) * 4, true, 'i', 4});
    DispatchOutput out;
    out.x = xa.pointer();
    out.num_tokens = static_cast<int32_t*>(na.pointer());
    out.expert_padding = expert_padding;
    out.expert_rows = expert_rows;
    Owners used{xa.owner, na.owner};
    if (Wanted(sa, "scales", c.scales_per_token() > 0)) {
      Check(sa, {"scales", rows * c.scales_per_token() * 4, true, 'f', 4});
      out.scales = static_cast<float*>(sa->pointer());
      used.push_back(sa->owner);
    }
    const uint64_t entries = static_cast<uint64_t>(c.expert_capacity()) * c.experts_per_token;
    if (token_major) {
      if (!tm.num_rows || !tm.token_experts || !tm.token_weights) {
        ThrowIfError(InvalidArgumentError(
            "dispatch_recv: a token-major AllToAll writes num_rows, token_experts and "
            "token_weights: required"));
      }
      Check(tm.num_rows, {"num_rows", 4, true, 'i', 4});
      // int32 ids, or int64 (what torch indexes with), written as they are.
      const int id_bytes = tm.token_experts->item_bytes == 8 ? 8 : 4;
      Check(tm.token_experts, {"token_experts", entries * id_bytes, true, 'i', id_bytes});
      Check(tm.token_weights, {"token_weights", entries * 4, true, 'f', 4});
      out.num_rows = static_cast<int32_t*>(tm.num_rows->pointer());
      if (id_bytes == 8) {
        out.token_experts64 = static_cast<int64_t*>(tm.token_experts->pointer());
      } else {
        out.token_experts = static_cast<int32_t*>(tm.token_experts->pointer());
      }
      out.token_weights = static_cast<float*>(tm.token_weights->pointer());
      used.insert(used.end(),
                  {tm.num_rows->owner, tm.token_experts->owner, tm.token_weights->owner});
    }
    out.wait_cost = WaitCost(ca, used);
    if (sources.source_tokens) {
      Check(sources.source_tokens, {"source_tokens", rows * 4, true, 'i', 4});
      out.source_tokens = static_cast<int32_t*>(sources.source_tokens->pointer());
      used.push_back(sources.source_tokens->owner);
    }
    if (sources.source_ranks) {
      Check(sources.source_ranks, {"source_ranks", rows * 4, true, 'i', 4});
      out.source_ranks = static_cast<int32_t*>(sources.source_ranks->pointer());
      used.push_back(sources.source_ranks->owner);
    }
    if (sources.sender_ranges) {
      Check(sources.sender_ranges,
            {"sender_ranges", static_cast<uint64_t>(c.local_experts()) * c.world_size * 8, true,
             'i', 8});
      out.sender_ranges = static_cast<int64_t*>(sources.sender_ranges->pointer());
      used.push_back(sources.sender_ranges->owner);
    }
    Run(std::move(used), [&](AllToAll& a) { return a.DispatchRecv(out, deadline); });
    // The rows received, where the host can read them (the CUDA device's count is on the GPU).
    received_rows_ = token_major && c.device == MoeDeviceKind::kHost ? *out.num_rows : -1;
    output_rows_ = rows;
  }

  void CombineSend(const py::handle& expert_out, std::optional<int64_t> num_rows) {
    CombineSendArray(ToArray(expert_out), num_rows);
  }
  void CombineSendArray(const Array& ea, std::optional<int64_t> num_rows) {
    const AllToAllConfig& c = config();
    uint64_t rows = output_rows_;  // as the last dispatch_recv laid them out
    if (num_rows) {
      // Token-major: the caller's rows may stop at those received (the step reads no more).
      if (c.dispatch_layout != DispatchLayout::kTokenMajor) {
        ThrowIfError(InvalidArgumentError("combine_send: num_rows is for the token-major layout"));
      }
      if (*num_rows < 0 || *num_rows > c.expert_capacity() ||
          (received_rows_ >= 0 && *num_rows < received_rows_)) {
        ThrowIfError(InvalidArgumentError(
            "combine_send: num_rows " + std::to_string(*num_rows) + ", dispatch_recv wrote " +
            (received_rows_ >= 0 ? std::to_string(received_rows_) : std::string("its num_rows")) +
            " (at most " + std::to_string(c.expert_capacity()) + ")"));
      }
      rows = static_cast<uint64_t>(*num_rows);
    }
    Check(&ea,
          {"expert_out", rows * c.combine_row_bytes(), false, CombineItemKind(c),
           CombineItemBytes(c)});
    const CombineInput in{ea.pointer(), !c.combines_fp32() && IsFloat16(ea)};
    Run({ea.owner}, [&](AllToAll& a) { return a.CombineSend(in); });
    sent_fp16_ = in.fp16;
  }

  void CombineRecv(const py::handle& out, bool accumulate, double timeout,
                   const py::handle& weights, const py::handle& wait_cost) {
    const std::optional<Array> wa = MaybeArray(weights), ca = MaybeArray(wait_cost);
    CombineRecvArrays(ToArray(out), accumulate, timeout, Pointer(wa), Pointer(ca));
  }
  // The same with the arrays converted (wa: null for dispatch-time weights; ca: null for no
  // wait costs).
  void CombineRecvArrays(const Array& oa, bool accumulate, double timeout, const Array* wa,
                         const Array* ca = nullptr) {
    const AllToAllConfig& c = config();
    const Deadline deadline = DeadlineIn(timeout);
    // A float32 out for 2-byte rows takes the fp32 sums unrounded (CombineOutput::fp32_out);
    // the rows' element is then the one combine_send was given.
    const bool wide = !c.combines_fp32() && oa.kind == 'f' && oa.item_bytes == 4;
    const uint64_t tokens = static_cast<uint64_t>(last_tokens_);
    Check(&oa, {"out", wide ? tokens * c.hidden * 4 : tokens * c.combine_row_bytes(), true,
                wide ? 'f' : CombineItemKind(c), wide ? 4 : CombineItemBytes(c)});
    CombineOutput to{oa.pointer(), accumulate};
    to.fp32_out = wide;
    to.fp16 = wide ? sent_fp16_ : !c.combines_fp32() && IsFloat16(oa);
    Owners used{oa.owner};
    if (wa) {
      Check(wa, {"weights", static_cast<uint64_t>(last_tokens_) * c.experts_per_token * 4, false,
                 'f', 4});
      to.weights = static_cast<const float*>(wa->pointer());
      used.push_back(wa->owner);
    }
    to.wait_cost = WaitCost(ca, used);
    Run(std::move(used), [&](AllToAll& a) { return a.CombineRecv(to, deadline); });
  }
  // A receive step's wait_cost array (null: none): world_size int64 entries it adds to.
  int64_t* WaitCost(const Array* ca, std::vector<py::object>& used) const {
    if (!ca) return nullptr;
    Check(ca, {"wait_cost", static_cast<uint64_t>(config().world_size) * 8, true, 'i', 8});
    used.push_back(ca->owner);
    return static_cast<int64_t*>(ca->pointer());
  }

  // What ferry.deep_ep calls once per call: the halves `halves` names (1 the send, 2 the
  // receive, 3 both, in that order) with the arguments dispatch_send and dispatch_recv take,
  // ordered with `stream` as Ordered says. One call instead of four: each call from Python
  // costs microseconds (argument conversion, the GIL).
  void Dispatch(const py::handle& x, const py::handle& indices, const py::handle& weights,
                const py::handle& scales, std::optional<int> num_tokens,
                const py::handle& device_num_tokens, Fp8Scaling scaling,
                const py::handle& out_x, const py::handle& out_num_tokens,
                const py::handle& out_scales, double timeout, int expert_padding,
                const py::handle& stream, int halves, bool stream_first, bool stream_waits,
                const py::handle& wait_cost, int64_t expert_rows) {
    Halves(halves, "dispatch");
    Ordered(OptionalStream(stream), stream_first, stream_waits, halves & kSendHalf, [&] {
      if (halves & kSendHalf) {
        DispatchSend(x, indices, weights, scales, num_tokens, device_num_tokens, scaling);
      }
      if (halves & kReceiveHalf) {
        DispatchRecv(out_x, out_num_tokens, out_scales, py::none(), py::none(), py::none(),
                     timeout, expert_padding, wait_cost, expert_rows, py::none(), py::none(),
                     py::none());
      }
    });
  }

  // combine_send and combine_recv as Dispatch runs dispatch's.
  void Combine(const py::handle& expert_out, const py::handle& out, const py::handle& weights,
               bool accumulate, double timeout, const py::handle& stream, int halves,
               bool stream_first, bool stream_waits, const py::handle& wait_cost) {
    Halves(halves, "combine");
    Ordered(OptionalStream(stream), stream_first, stream_waits, false, [&] {
      if (halves & kSendHalf) CombineSend(expert_out, std::nullopt);
      if (halves & kReceiveHalf) CombineRecv(out, accumulate, timeout, weights, wait_cost);
    });
  }

  void SetStream(const py::handle& stream) {
    void* s = nullptr;
    if (!stream.is_none()) {
      s = StreamHandle(stream);
      // Handle 0 is the legacy default stream (torch's current stream unless one was set): taken
      // as "no stream" the steps would go back to waiting, unordered with the caller's kernels
      // on that stream, and read inputs not yet written.
      if (s == nullptr) {
        ThrowIfError(InvalidArgumentError(
            "set_stream: stream handle 0 (the legacy default stream) cannot order the steps; "
            "pass a stream of your own (torch.cuda.Stream()), or None to wait"));
      }
    }
    ThrowIfError(a2a().SetStream(s));
    stream_ = s;
    ClearHeld();  // the core waited for the steps enqueued on the stream before
  }
  // The stream the steps go on as a cudaStream_t (0: the legacy default stream), None while
  // they wait for themselves.
  py::object stream() const {
    if (!stream_) return py::none();
    return py::int_(stream_ == kLegacyStream ? 0 : reinterpret_cast<uintptr_t>(stream_));
  }

  // Whether steps ordered with the caller's `stream` (a cudaStream_t; nullopt: the CPU) would
  // run on that stream itself: the AllToAll's own, or none yet on the CUDA device (so that a
  // dispatch takes it, as Ordered says). Work a caller adds after the steps may then go on the
  // caller's stream with no ordering.
  bool RunsOn(std::optional<void*> stream) const {
    if (!stream) return !stream_;
    return stream_ ? stream_ == CudaStream(*stream) : config().device == MoeDeviceKind::kCuda;
  }

  // An AllToAll of the CUDA device without a stream takes the caller's `stream` (a
  // cudaStream_t as CudaStream maps it, the legacy default stream allowed) as its own: from
  // then on a caller that keeps one current stream pays no ordering, its steps simply following
  // each other on it. The stream must outlive the AllToAll (torch's default and pooled streams
  // live as long as the process). Nothing where it has one, or on the host device.
  void Adopt(void* stream) {
    if (stream_ || config().device != MoeDeviceKind::kCuda) return;
    ThrowIfError(a2a().SetStream(stream));
    stream_ = stream;
  }
  void Adopt(const py::handle& stream) { Adopt(CudaStream(StreamHandle(stream))); }

  // OrderAfter / OrderBefore with a stream as set_stream takes one (0, the legacy default
  // stream, allowed: it is only ordered against).
  void Order(const py::handle& stream, bool after) { Order(StreamHandle(stream), after); }
  void Order(void* stream, bool after) {
    void* s = CudaStream(stream);
    ThrowIfError(after ? a2a().OrderAfter(s) : a2a().OrderBefore(s));
  }

  // `steps` ordered with `stream` (a cudaStream_t; nullopt: unordered): they start after what
  // it holds (with `first`) and it waits for them (with `waits`); the arrays of the steps
  // finished before them are let go first, without waiting, once kMarkEvery are held
  // (ReleaseFinished). An AllToAll without a stream of its own takes `stream` itself at such a
  // call that begins a dispatch (`may_adopt`): from then on a caller that keeps one current
  // stream pays no ordering (its steps simply follow each other on it), and one on another
  // stream is ordered by events as before. The stream taken must outlive the AllToAll (torch's
  // default and pooled streams live as long as the process).
  template <typename Steps>
  void Ordered(std::optional<void*> stream, bool first, bool waits, bool may_adopt,
               Steps steps) {
    if (!stream) {
      ReleaseFinished(std::nullopt);
      steps();
      return;
    }
    void* const s = CudaStream(*stream);
    ReleaseFinished(s);
    if (may_adopt) Adopt(s);
    if (first && s != stream_) ThrowIfError(a2a().OrderAfter(s));
    steps();
    if (waits && s != stream_) ThrowIfError(a2a().OrderBefore(s));
  }

  void Synchronize() {
    const Status s = Unlocked([](AllToAll& a) { return a.Synchronize(); });
    ClearHeld();
    ThrowIfError(s);
  }

  // Without waiting: true (and the arrays released, the kernels' findings raised) when every
  // step enqueued so far has finished.
  bool Poll() {
    bool done = false;
    const Status s = Unlocked([&](AllToAll& a) { return a.Poll(&done); });
    if (done) ClearHeld();
    ThrowIfError(s);
    return done;
  }
  size_t pending() const { return held_count_; }

  // The arrays of the steps finished so far let go and their kernels' findings raised, without
  // waiting while at most kMaxPendingArrays are held; past that, it waits for the oldest marked
  // part only. Nothing while fewer than kMarkEvery are held (each query is a CUDA call or three, a
  // microsecond: not one for every call), nor while `stream` (a caller's cudaStream_t; nullopt:
  // ours) or the AllToAll's own is being captured: a query would end the capture, and the captured
  // arrays are the graph owner's to keep. Poll answers for every step at once, and a stream the
  // caller's kernels share (one the AllToAll took) is seldom idle while a CPU runs ahead: the
  // arrays are held in parts, each closed by a Mark once kMarkEvery arrays are in it, and a part
  // goes when its mark is Reached.
  void ReleaseFinished(std::optional<void*> stream) {
    if (!stream_ || held_count_ < kMarkEvery) return;
    AllToAll& a = a2a();
    const bool ours = !stream || *stream == stream_;
    if (a.capturing(stream ? *stream : nullptr) || (!ours && a.capturing(nullptr))) return;
    if (Poll()) return;
    bool reached = true;
    while (!held_.empty() && held_.front().marked && reached) {
      ThrowIfError(a.Reached(held_.front().mark, false, &reached));
      if (reached) PopHeld();
    }
    if (!held_.empty() && !held_.back().marked && held_.back().arrays.size() >= kMarkEvery) {
      ThrowIfError(a.Mark(&held_.back().mark));
      held_.back().marked = true;
    }
    while (held_count_ > kMaxPendingArrays && !held_.empty() && held_.front().marked) {
      const uint64_t mark = held_.front().mark;
      ThrowIfError(Unlocked([&](AllToAll& x) { return x.Reached(mark, true, &reached); }));
      PopHeld();
    }
    if (held_count_ > kMaxPendingArrays) Synchronize();
  }
  void ReleaseFinished(const py::handle& stream) {
    ReleaseFinished(stream.is_none() ? std::nullopt
                                     : std::optional(CudaStream(StreamHandle(stream))));
  }

  void SetMasked(int rank, bool masked) { ThrowIfError(a2a().SetMasked(rank, masked)); }
  void Readmit(Bootstrap& group, double timeout) {
    const Millis limit = ToMillis(timeout);
    ThrowIfError(Unlocked([&](AllToAll& a) { return a.Readmit(group, limit); }));
  }
  void Resize(const AllToAllConfig& config, Bootstrap& group, double timeout) {
    const Millis limit = ToMillis(timeout);
    ThrowIfError(Unlocked([&](AllToAll& a) { return a.Resize(config, group, limit); }));
    output_rows_ = static_cast<uint64_t>(a2a().config().output_rows(0, 0));
  }
  uint64_t membership_version() const { return a2a().membership_version(); }
  std::vector<uint8_t> Masked() const { return ValueOrThrow(a2a().Masked()); }
  uint64_t dispatch_bytes_sent() const { return a2a().dispatch_bytes_sent(); }
  uint64_t combine_bytes_sent() const { return a2a().combine_bytes_sent(); }

  static constexpr int kSendHalf = 1, kReceiveHalf = 2;

 private:
  static void Halves(int halves, const char* call) {
    if (halves < 1 || halves > 3) {
      ThrowIfError(InvalidArgumentError(std::string(call) + ": halves " + std::to_string(halves) +
                                        ", 1 (send), 2 (receive) or 3 (both)"));
    }
  }
  // Arrays of enqueued steps kept before a call waits for the oldest of them: a CPU that runs
  // ahead of the GPU keeps them referenced until their steps finish, some twenty calls' worth;
  // a mark closes each kMarkEvery (at most kMaxPendingArrays / kMarkEvery + 1 marks
  // outstanding, within the AllToAll's ring of kMarks).
  static constexpr size_t kMaxPendingArrays = 128, kMarkEvery = 16;
  static_assert(kMaxPendingArrays / kMarkEvery + 1 < AllToAll::kMarks);
  AllToAll& a2a() const {
    if (!a2a_) ThrowIfError(FailedPreconditionError("the AllToAll is closed"));
    return *a2a_;
  }
  int Device(const AllToAllConfig& c) const {
    return c.device == MoeDeviceKind::kHost ? kHostMemory : c.cuda_device;
  }
  // The expert ids into `in`: int32 as they are, uint32 as the same bits (an id >= 2^31 is
  // then negative: -1 for 0xFFFFFFFF, a bad id otherwise), int64 (torch.topk's) as indices64,
  // narrowed by the core (on the CUDA device by the send kernels as they read them).
  void Indices(const Array& ia, uint64_t copies, DispatchInput& in) const {
    if (ia.kind == 'i' && ia.item_bytes == 8) {
      Check(&ia, {"indices", copies * 8, false, 'i', 8});
      in.indices64 = static_cast<const int64_t*>(ia.pointer());
      return;
    }
    const char kind = ia.kind == 'u' && ia.item_bytes == 4 ? 'u' : 'i';
    Check(&ia, {"indices", copies * 4, false, kind, 4});  // names what it is and what we take
    in.indices = static_cast<const int32_t*>(ia.pointer());
  }
  void Check(const Array* array, const ArrayNeed& need) const {
    ThrowIfError(CheckArray(array, need, Device(config())));
  }
  // Whether an optional array (null: not given) is there: InvalidArgument where it is missing
  // but `wanted` ("required") or given but not (the configuration has no use for it).
  bool Wanted(const Array* array, const char* name, bool wanted) const {
    if (!array && wanted) ThrowIfError(InvalidArgumentError(std::string(name) + ": required"));
    if (array && !wanted) {
      ThrowIfError(InvalidArgumentError(std::string(name) + ": this configuration takes none (" +
                                        config().ToString() + ")"));
    }
    return array != nullptr;
  }
  // The AllToAll that make(engine) returns, the engine acquired for it meanwhile.
  template <typename MakeFn>
  void Make(MakeFn make) {
    TransferEngine* e = AcquireEngine(engine_);
    StatusOr<std::unique_ptr<AllToAll>> made = [&] {
      py::gil_scoped_release release;
      return make(e);
    }();
    if (!made.ok()) ReleaseEngine(engine_);
    a2a_ = ValueOrThrow(std::move(made));
    output_rows_ = static_cast<uint64_t>(a2a_->config().output_rows(0, 0));
  }

  // The arrays a step reads or writes (their owners).
  using Owners = std::vector<py::object>;
  // step(AllToAll&) with the GIL released.
  template <typename Step>
  Status Unlocked(Step step) {
    AllToAll& a = a2a();
    Status s;
    ++busy_;
    {
      py::gil_scoped_release release;
      s = step(a);
    }
    --busy_;
    return s;
  }
  // A step that waits for itself is done with its arrays when it returns (the caller's
  // arguments hold them meanwhile); a step enqueued on a stream keeps them until synchronize().
  template <typename Step>
  void Run(Owners used, Step step) {
    if (stream_) {
      if (held_.empty() || held_.back().marked) held_.emplace_back();
      std::vector<py::object>& part = held_.back().arrays;
      part.insert(part.end(), used.begin(), used.end());
      held_count_ += used.size();
    }
    ThrowIfError(Unlocked(step));
  }

  py::object engine_;
  std::unique_ptr<AllToAll> a2a_;
  // The arrays enqueued steps use, oldest first, in parts each closed by a mark of the
  // AllToAll's stream (ReleaseFinished); the last part open while it fills.
  struct Held {
    std::vector<py::object> arrays;
    bool marked = false;
    uint64_t mark = 0;
  };
  void PopHeld() {
    held_count_ -= held_.front().arrays.size();
    held_.pop_front();
  }
  void ClearHeld() {
    held_.clear();
    held_count_ = 0;
  }
  std::deque<Held> held_;
  size_t held_count_ = 0;
  int64_t last_tokens_ = 0;
  int64_t received_rows_ = -1;  // token-major rows of the last dispatch_recv; -1: not known here
  bool sent_fp16_ = false;      // the last combine_send's rows were float16
  uint64_t output_rows_ = 0;    // rows the last dispatch_recv's x held (its padding's)
  void* stream_ = nullptr;  // the stream the steps go on (set_stream's or a layer's, adopted)
  int busy_ = 0;  // steps running with the GIL released (the GIL guards the count)
};

}  // namespace ferry::python
