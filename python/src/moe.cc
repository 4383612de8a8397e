// AllToAll bindings: the configuration structs and ferry.AllToAll (its class in all_to_all.h).
#include <pybind11/stl.h>

#include "all_to_all.h"
#include "torch_tensors.h"
#include "binding.h"
#include "ferry/moe.h"

namespace ferry::python {

void BindMoe(py::module_& m) {
  m.def("cuda_device_built", &CudaDeviceBuilt,
        "Whether this build of ferry has the CUDA device (its kernels built for sm_90)");
  py::enum_<DispatchDtype>(m, "DispatchDtype")
      .value("BF16", DispatchDtype::kBf16)
      .value("FP8_E4M3", DispatchDtype::kFp8E4M3)
      .value("FP32", DispatchDtype::kFp32);
  py::enum_<Fp8Scaling>(m, "Fp8Scaling", "How dispatch_send makes fp8 from bf16 rows")
      .value("AMAX", Fp8Scaling::kAmax)
      .value("POWER_OF_TWO", Fp8Scaling::kPowerOfTwo);
  py::enum_<MoeDeviceKind>(m, "MoeDevice")
      .value("HOST", MoeDeviceKind::kHost)
      .value("CUDA", MoeDeviceKind::kCuda);
  py::enum_<DispatchLayout>(m, "DispatchLayout")
      .value("EXPERT_MAJOR", DispatchLayout::kExpertMajor)
      .value("TOKEN_MAJOR", DispatchLayout::kTokenMajor);
  py::enum_<RdmaBuffers>(m, "RdmaBuffers")
      .value("AUTO", RdmaBuffers::kAuto)
      .value("HOST", RdmaBuffers::kHost)
      .value("DEVICE", RdmaBuffers::kDevice);
  py::enum_<Streaming>(m, "Streaming")
      .value("AUTO", Streaming::kAuto)
      .value("NONE", Streaming::kNone)
      .value("DISPATCH", Streaming::kDispatch)
      .value("COMBINE", Streaming::kCombine)
      .value("BOTH", Streaming::kBoth);
  py::enum_<Forwarding>(m, "Forwarding",
                        "How a token reaches the ranks of another node (ferry/moe.h's Forwarding)")
      .value("PER_RANK", Forwarding::kPerRank)
      .value("NODE_ONCE", Forwarding::kNodeOnce)
      .value("AUTO", Forwarding::kAuto);
  py::enum_<PartialSums>(m, "PartialSums",
                         "Under node-once forwarding, how a node's partial sums cross back "
                         "(ferry/moe.h's PartialSums)")
      .value("COMBINE_ELEMENT", PartialSums::kCombineElement)
      .value("FP32", PartialSums::kFp32);

  py::class_<CudaTuning>(m, "CudaTuning",
                         "Where the CUDA device keeps its flags and what it reports on itself "
                         "(CudaTuning in include/ferry/moe.h); changes no result")
      .def(py::init([](const py::kwargs& f) { return WithFields(CudaTuning{}, f); }))
      .def_readwrite("trace", &CudaTuning::trace)
      .def_readwrite("relay_trace", &CudaTuning::relay_trace)
      .def_readwrite("gdrcopy", &CudaTuning::gdrcopy)
      .def_static("from_env", [] { return ValueOrThrow(CudaTuning::FromEnv()); },
                  "The defaults with FERRY_NV_TRACE, FERRY_RELAY_TRACE and FERRY_GDRCOPY applied "
                  "where set");

  py::class_<AllToAllConfig>(m, "AllToAllConfig",
                             "What an AllToAll moves (AllToAllConfig in include/ferry/moe.h)")
      .def(py::init([](const py::kwargs& f) { return WithFields(AllToAllConfig{}, f); }))
      .def_readwrite("world_size", &AllToAllConfig::world_size)
      .def_readwrite("rank", &AllToAllConfig::rank)
      .def_readwrite("ranks_per_node", &AllToAllConfig::ranks_per_node)
      .def_readwrite("instance", &AllToAllConfig::instance)
      .def_readwrite("num_experts", &AllToAllConfig::num_experts)
      .def_readwrite("experts_per_token", &AllToAllConfig::experts_per_token)
      .def_readwrite("max_tokens_per_rank", &AllToAllConfig::max_tokens_per_rank)
      .def_readwrite("hidden", &AllToAllConfig::hidden)
      .def_readwrite("dtype", &AllToAllConfig::dtype)
      .def_readwrite("fp8_scales", &AllToAllConfig::fp8_scales)
      .def_readwrite("fp32_combine", &AllToAllConfig::fp32_combine)
      .def_readwrite("streaming", &AllToAllConfig::streaming)
      .def_readwrite("max_private_tokens", &AllToAllConfig::max_private_tokens)
      .def_readwrite("dispatch_once_per_rank", &AllToAllConfig::dispatch_once_per_rank)
      .def_readwrite("combine_reduce_at_expert_rank",
                     &AllToAllConfig::combine_reduce_at_expert_rank)
      .def_readwrite("dispatch_layout", &AllToAllConfig::dispatch_layout)
      .def_readwrite("device", &AllToAllConfig::device)
      .def_readwrite("cuda_device", &AllToAllConfig::cuda_device)
      .def_readwrite("rdma_buffers", &AllToAllConfig::rdma_buffers)
      .def_readwrite("cuda", &AllToAllConfig::cuda)
      .def_readwrite("mask_lost_peers", &AllToAllConfig::mask_lost_peers)
      .def_readwrite("forwarding", &AllToAllConfig::forwarding)
      .def_readwrite("partial_sums", &AllToAllConfig::partial_sums)
      .def("validate", [](const AllToAllConfig& c) { ThrowIfError(c.Validate()); })
      .def("chosen_forwarding", &AllToAllConfig::chosen_forwarding,
           "forwarding with AUTO resolved: what an AllToAll made from this runs")
      .def_property_readonly("local_experts", &AllToAllConfig::local_experts)
      .def_property_readonly("token_bytes", &AllToAllConfig::token_bytes)
      .def_property_readonly("scales_per_token", &AllToAllConfig::scales_per_token)
      .def_property_readonly("expert_capacity", &AllToAllConfig::expert_capacity)
      .def("padded_rows", &AllToAllConfig::padded_rows, py::arg("expert_padding"),
           "Rows of the expert-major output with that expert padding")
      .def("__repr__", &AllToAllConfig::ToString);

  BindClose(py::class_<PyAllToAll>(
                m, "AllToAll",
                "Expert-parallel dispatch and combine, each a send and a receive half; "
                "one thread drives an AllToAll"))
      .def(py::init<const AllToAllConfig&, py::object, Bootstrap&>(), py::arg("config"),
           py::arg("engine"), py::arg("bootstrap"),
           "Collective: every rank with the same config (its own rank); engine may be None on "
           "the CUDA device with one node")
      .def_property_readonly(  // a copy: the AllToAll's own goes with it at close()
          "config", [](const PyAllToAll& a) { return AllToAllConfig(a.config()); })
      .def("dispatch_send", &PyAllToAll::DispatchSendStep, py::arg("x"), py::arg("indices"),
           py::arg("weights"), py::arg("scales") = py::none(), py::arg("num_tokens") = py::none(),
           py::arg("device_num_tokens") = py::none(), py::arg("scaling") = Fp8Scaling::kAmax,
           "x [T, hidden] (bf16 or float16 as 2-byte, fp8 as 1-byte or fp32 as float32 "
           "elements: moved as they are), "
           "indices [T, k] int32, int64 or uint32 (-1: no expert), weights [T, k] "
           "float32, scales [T, hidden/128] float32 (fp8); T = num_tokens or x's first "
           "dimension (num_tokens is required for a flat x). An fp8 AllToAll given bf16 x and "
           "no scales quantises x as it sends, its scales as `scaling` says (Fp8Scaling)")
      .def("dispatch_recv", &PyAllToAll::DispatchRecv, py::arg("x"), py::arg("num_tokens"),
           py::arg("scales") = py::none(), py::arg("num_rows") = py::none(),
           py::arg("token_experts") = py::none(), py::arg("token_weights") = py::none(),
           py::arg("timeout") = 30.0, py::arg("expert_padding") = 0,
           py::arg("wait_cost") = py::none(), py::arg("expert_rows") = 0,
           py::arg("source_tokens") = py::none(), py::arg("sender_ranges") = py::none(),
           py::arg("source_ranks") = py::none(),
           "Expert-major: x [local_experts, expert_capacity, hidden], num_tokens [local_experts] "
           "int32 (copies per expert); with expert_padding p the experts' blocks back to back "
           "in x's config.padded_rows(p) rows, each rounded up to p rows; with expert_rows r "
           "x [local_experts, r, hidden] (an expert sent more than r copies: ResourceExhausted, "
           "the AllToAll unusable); token-major also "
           "num_rows [1], token_experts (int32 or int64) and token_weights [expert_capacity, "
           "k]; scales as x's "
           "rows (fp8). Peers' data is checked before it is used (DataLoss naming the sender). "
           "wait_cost [world_size] int64: the time waited for each sender added to it "
           "(nanoseconds on the host device, GPU clock cycles on the CUDA device). "
           "Where the rows came from (per rank forwarding): source_tokens and source_ranks "
           "(int32, one per row of x) each row's token index in its sender and its sender; "
           "expert-major also sender_ranges [local_experts, world_size] int64 (first row << 32) "
           "| rows of each sender in each expert's block")
      .def("dispatch_recv_new",
           [](PyAllToAll& a2a, const py::handle& dtype, int device, bool sources,
              double timeout) {
             return DispatchRecvNew(a2a, dtype, device, sources, timeout).Tuple();
           },
           py::arg("dtype"), py::arg("device"), py::arg("sources") = false,
           py::arg("timeout") = 30.0,
           "Token-major: dispatch_recv into tensors it makes on `device` (Tensor.get_device(): "
           "-1 the CPU), returned as (x [expert_capacity, hidden] of torch dtype `dtype`, "
           "scales [expert_capacity, scales per row] float32 or None, counts [1 + local "
           "experts] int32 (num_rows, then num_tokens), token_experts (int64), token_weights, "
           "source_tokens and source_ranks [expert_capacity] int32 (with sources; else None, "
           "None))")
      .def("combine_send", &PyAllToAll::CombineSend, py::arg("expert_out"),
           py::arg("num_rows") = py::none(),
           "expert_out: bf16 or float16 rows (summed as what they are; float32 for "
           "DispatchDtype.FP32 and fp32_combine) as dispatch_recv laid them out (token-major: "
           "one per row, "
           "its experts' outputs already weighted and summed; num_rows: expert_out holds only "
           "that many, at least the rows received)")
      .def("combine_recv", &PyAllToAll::CombineRecv, py::arg("out"), py::arg("accumulate") = false,
           py::arg("timeout") = 30.0, py::arg("weights") = py::none(),
           py::arg("wait_cost") = py::none(),
           "out [T, hidden] of combine_send's element (bf16 or float16; float32 for "
           "DispatchDtype.FP32 and fp32_combine), or float32 for any (the fp32 sums stored "
           "unrounded), for the T of the last dispatch_send: each "
           "token's weighted sum in fp32, rounded once "
           "(added to out with accumulate); weights [T, k] float32: the combine weights given "
           "now instead of dispatch_send's (not with combine_reduce_at_expert_rank); wait_cost "
           "as dispatch_recv's, per expert rank")
      .def("dispatch", &PyAllToAll::Dispatch, py::arg("x"), py::arg("indices"),
           py::arg("weights"), py::arg("scales"), py::arg("num_tokens"),
           py::arg("device_num_tokens"), py::arg("scaling"), py::arg("out_x"),
           py::arg("out_num_tokens"), py::arg("out_scales"),
           py::arg("timeout"), py::arg("expert_padding"), py::arg("stream"), py::arg("halves"),
           py::arg("stream_first"), py::arg("stream_waits"), py::arg("wait_cost") = py::none(),
           py::arg("expert_rows") = 0,
           "Expert-major dispatch_send and dispatch_recv in one call (halves: 1 send, 2 "
           "receive, 3 both; the other half's arguments unused, None), ordered after `stream` "
           "(a cudaStream_t as an int, 0 allowed; None: unordered) with stream_first and "
           "before it with stream_waits; finished steps' arrays let go first. An AllToAll "
           "without a stream takes `stream` itself at a call that sends (it must outlive the "
           "AllToAll): calls on it are then ordered by stream order alone. What ferry.deep_ep "
           "calls")
      .def("combine", &PyAllToAll::Combine, py::arg("expert_out"), py::arg("out"),
           py::arg("weights"), py::arg("accumulate"), py::arg("timeout"), py::arg("stream"),
           py::arg("halves"), py::arg("stream_first"), py::arg("stream_waits"),
           py::arg("wait_cost") = py::none(),
           "combine_send and combine_recv in one call, as dispatch() runs dispatch's halves")
      .def("set_stream", &PyAllToAll::SetStream, py::arg("stream"),
           "CUDA device, several ranks: enqueue the steps on `stream` (a torch or CuPy stream, or "
           "a cudaStream_t as an int, not the legacy default stream 0; None: back to waiting) and "
           "return at once; the arrays stay referenced until their steps have run (each "
           "dispatch_send lets go those of the steps finished before it, as release_finished "
           "does; synchronize() all)")
      .def_property_readonly("stream", &PyAllToAll::stream,
                             "The stream the steps go on (a cudaStream_t as an int, 0 the legacy "
                             "default stream), None while they wait for themselves")
      .def("synchronize", &PyAllToAll::Synchronize,
           "Waits for the steps enqueued so far and raises what their kernels found")
      .def("adopt_stream", [](PyAllToAll& a, const py::handle& s) { a.Adopt(s); },
           py::arg("stream"),
           "CUDA device: an AllToAll without a stream takes `stream` (a torch or CuPy stream, "
           "or a cudaStream_t as an int; 0, the legacy default stream, allowed) as its own, so "
           "that calls made on it are ordered by stream order alone (it must outlive the "
           "AllToAll); nothing where it has one already")
      .def("order_after", [](PyAllToAll& a, const py::handle& s) { a.Order(s, true); },
           py::arg("stream"),
           "CUDA device: the steps enqueued from now on start after what `stream` (a torch or "
           "CuPy stream, or a cudaStream_t as an int; 0 allowed) holds so far; no host wait")
      .def("order_before", [](PyAllToAll& a, const py::handle& s) { a.Order(s, false); },
           py::arg("stream"),
           "CUDA device: what is enqueued on `stream` from now on starts after the steps "
           "enqueued so far; no host wait")
      .def("poll", &PyAllToAll::Poll,
           "synchronize() without the wait: True (the arrays released, what the kernels found "
           "raised) once every step enqueued so far has finished, else False; not during a "
           "graph capture")
      .def("release_finished",
           [](PyAllToAll& a, const py::handle& stream) { a.ReleaseFinished(stream); },
           py::arg("stream") = py::none(),
           "The arrays of finished steps let go (what their kernels found raised) without "
           "waiting, once 16 or more are held, unless more than 128 are (then it waits for the "
           "oldest); nothing while `stream` (a caller's cudaStream_t as an int, or ours) is "
           "being captured. dispatch_send, dispatch() and combine() do this first")
      .def_property_readonly("pending_arrays", &PyAllToAll::pending,
                             "Arrays of enqueued steps still referenced (until poll() or "
                             "synchronize() finds them done)")
      .def("set_masked", &PyAllToAll::SetMasked, py::arg("rank"), py::arg("masked") = true,
           "Leave `rank` out of every step from the next dispatch on (AllToAll::SetMasked); "
           "a masked rank comes back only through readmit()")
      .def_static(
          "join",
          [](const AllToAllConfig& config, py::object engine, Bootstrap& group, double timeout) {
            return std::make_unique<PyAllToAll>(PyAllToAll::Joining{}, config,
                                                std::move(engine), group, timeout);
          },
          py::arg("config"), py::arg("engine"), py::arg("group"), py::arg("timeout") = 60.0,
          "A new process for a rank the others lost and masked (AllToAll::Join): meets their "
          "readmit() (or a grown world's resize()) over `group`, a bootstrap of the whole world, "
          "and starts at their epoch (both devices, either forwarding); timeout in seconds")
      .def("readmit", &PyAllToAll::Readmit, py::arg("group"), py::arg("timeout") = 60.0,
           "Between epochs, on every survivor: the masked ranks come back as the new processes "
           "that call AllToAll.join over `group` (a bootstrap of the whole world), fenced from "
           "the processes they replace (AllToAll::Readmit); a meeting that fails (timeout "
           "seconds) leaves this AllToAll as it was")
      .def("resize", &PyAllToAll::Resize, py::arg("config"), py::arg("group"),
           py::arg("timeout") = 60.0,
           "Between epochs, on every rank of a new world that ran in the old one: the world "
           "grows or shrinks to config's (new processes call AllToAll.join with it, all over "
           "`group`, a bootstrap of the new world), this handle and its epoch count kept "
           "(AllToAll::Resize); a meeting that fails (timeout seconds) leaves it as it was (on the "
           "CUDA device and under node-once a failure past the old device ends it)")
      .def_property_readonly("membership_version", &PyAllToAll::membership_version,
                             "Readmissions so far")
      .def("masked", &PyAllToAll::Masked,
           "[world_size] 1 where a rank is masked (by set_masked, or by a step under "
           "mask_lost_peers); the CUDA device waits for its stream first")
      .def_property_readonly("dispatch_bytes_sent", &PyAllToAll::dispatch_bytes_sent,
                             "Bytes the last dispatch put on the wire (payload and metadata)")
      .def_property_readonly("combine_bytes_sent", &PyAllToAll::combine_bytes_sent,
                             "Bytes the last combine put on the wire");
}

}  // namespace ferry::python
