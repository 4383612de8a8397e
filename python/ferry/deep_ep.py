"""DeepEP's Python API (deep_ep.Buffer, its V1 interface) over ferry's AllToAll.

A DeepEP user changes `import deep_ep` to `from ferry import deep_ep`, or changes no code and
puts shim_path() on PYTHONPATH (a `deep_ep` package of this module's names, found by every
process started with it). The calls take and return what DeepEP's do, in its shapes, dtypes
and strides:

- low-latency mode: `low_latency_dispatch` hands back `[num_local_experts, num_ranks *
  num_max_dispatch_tokens_per_rank, hidden]` (bf16, or e4m3 with fp32 scales whose last two
  dimensions are column-major, or UE8M0 exponents packed four to an int32), the per-expert
  counts and a handle; `low_latency_combine` takes that layout back with the top-k weights and
  returns each token's weighted sum. Both map onto an expert-major AllToAll whose combine
  weights are given at the combine.
- normal mode: `get_dispatch_layout`, `dispatch` (each token once per rank that holds any of its
  experts, with `recv_topk_idx` local to the rank, -1 elsewhere) and `combine` (an unweighted
  sum over the ranks) map onto a token-major AllToAll with both of ferry's options (a token once
  per rank; its experts' outputs summed at the expert rank).

Tensors on the CPU run on ferry's host device; CUDA tensors on its CUDA device. Normal-mode calls,
and low-latency ones whose first call asks for async_finish, go on a stream of the Buffer's own that
waits for the caller's current stream (or `previous_event`), as DeepEP's communication stream does;
other low-latency calls go on the caller's stream, as DeepEP launches a hook's send half, with no
event between the caller's kernels and ferry's. An argument ferry cannot honour raises Unimplemented
naming it (ferry.Error); a bad tensor raises InvalidArgument. Tuning knobs that change no result
(`Config`, `num_sms`, `num_qps_per_rank`, `allocate_on_comm_stream`) are taken and kept.
"""

import contextlib

import torch

from . import _ferry
from ._engine_api import (Group, check_tensor, current_stream_handle, device_kind,
                          env_timeout, fp8_dtype, refuse, shim_path as _shim_path)
from ._errors import Error, InvalidArgument, ResourceExhausted, Unimplemented

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "shim_path"]


def shim_path():
    """The folder to put on PYTHONPATH for `import deep_ep` to find ferry's."""
    return _shim_path("deep_ep")


class Config:
    """DeepEP's performance configuration. ferry sizes its own grids and chunks, so these are
    kept, not used."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return _round_up(2 * num_ranks * self.num_max_nvl_chunked_recv_tokens * hidden_bytes, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return _round_up(2 * num_ranks * self.num_max_rdma_chunked_recv_tokens * hidden_bytes,
                         128)


class EventHandle:
    """DeepEP's EventHandle (deep_ep.utils'): an event recorded on the current CUDA stream as it
    is made, for a call's previous_event (EventOverlap(EventHandle())). Where CUDA is not, it
    holds none: every call there has finished when it returns."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """A CUDA event (None on the CPU, where every call has finished when it returns) and the
    tensors that must live until it fires. `with event:` and current_stream_wait() make the
    current stream wait for it. The event may be given as a torch.cuda.Event or, as DeepEP's
    callers give it, an EventHandle."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event.event if isinstance(event, EventHandle) else event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


_DONE = EventOverlap()  # the event of a call the caller's stream already waits for
_NO_STREAM = contextlib.nullcontext()
_SEND, _RECV, _BOTH = 1, 2, 3  # AllToAll.dispatch / combine's halves


def _token_major(num_experts, k, capacity, hidden, dtype):
    """The normal mode's AllToAll configuration: token-major, each token sent once per rank
    that holds any of its experts, their outputs summed at that rank."""
    return dict(num_experts=num_experts, experts_per_token=k, max_tokens_per_rank=capacity,
                hidden=hidden, dtype=dtype, dispatch_once_per_rank=True,
                combine_reduce_at_expert_rank=True,
                dispatch_layout=_ferry.DispatchLayout.TOKEN_MAJOR)


def _round_up(n, to):
    return (n + to - 1) // to * to


# What a combine needs of its dispatch (the handle a dispatch returns); the C++ path makes them
# too.
_Handle = _ferry.DeepEpHandle


class Buffer(_ferry.DeepEpLowLatency):
    """DeepEP's communication buffer: dispatch and combine among the ranks of `group`.

    group: a torch.distributed ProcessGroup (gloo or NCCL; None for the default group), or a
    ferry.Bootstrap. num_nvl_bytes + num_rdma_bytes bound the tokens a normal-mode dispatch
    takes per rank (ferry's buffers for `num_ranks` ranks' tokens of that hidden size must fit);
    the low-latency mode sizes its buffers from each call's num_max_dispatch_tokens_per_rank.
    engine: a ferry.TransferEngine to use (default: one from the FERRY_* environment, made when
    an AllToAll first needs one). ranks_per_node: the NVLink domain (default: ranks on one host).

    low_latency_dispatch and low_latency_combine are the C++ base's (_ferry.DeepEpLowLatency):
    it runs their common path itself and hands every other call to _low_latency_dispatch /
    _low_latency_combine here.
    """

    num_sms = 20

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, enable_shrink=False, *, engine=None,
                 ranks_per_node=None, timeout=None):
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise InvalidArgument("num_nvl_bytes and num_rdma_bytes: at least 0")
        refuse("allow_mnnvl", allow_mnnvl, False, "multi-node NVLink domains are not supported")
        self._group = Group(group, engine, ranks_per_node)
        self.rank, self.group_size = self._group.rank, self._group.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        # Shrink mode (DeepEP's mask buffer): the low-latency AllToAlls mask a rank that missed
        # a call's deadline instead of failing the call, and the mask calls below work.
        self.enable_shrink = bool(enable_shrink)
        self._masked = [0] * self.group_size  # what the mask calls set or found
        self._timeout = env_timeout() if timeout is None else float(timeout)
        self._constants = {}   # (device, rows, columns, value, comm) -> _constant's tensor
        self._weights_scratch = {}  # weights AllToAll key -> its dispatch's unread outputs
        self._outputs = {}     # (AllToAll, fp8 form) -> the low-latency outputs (_ll_outputs)
        self._combine_buffers = {}  # AllToAll -> get_next_low_latency_combine_buffer's tensor
        self._stream = None    # the communication stream (CUDA)
        self._streams = {}     # torch objects for other streams AllToAlls took (_stream_of)
        # The low-latency calls' common path, in C++ once a shape's AllToAll and its two
        # output sets exist (_ll_outputs adds them).
        super().__init__(self.group_size, self._timeout, _DONE)
        self._destroyed = False

    # ---- DeepEP's static helpers ------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms):
        if new_num_sms % 2:
            raise InvalidArgument("set_num_sms: an even number of SMs")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """Bytes of what ferry's expert-major AllToAll keeps per rank for these shapes (its send
        rows, receive rows and counts), as DeepEP's hint sizes num_rdma_bytes."""
        m = num_max_dispatch_tokens_per_rank
        row = hidden * 2 + hidden // 128 * 4 + 16
        dispatch = num_ranks * m * row + (num_experts // max(num_ranks, 1)) * num_ranks * m * row
        combine = 2 * num_ranks * m * hidden * 2
        return _round_up(dispatch + combine + num_ranks * num_experts * 8, 128)

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise Unimplemented("get_local_buffer_tensor: ferry's buffers are not one tensor")

    def destroy(self):
        if not self.explicitly_destroy:
            raise InvalidArgument("destroy: the Buffer was made with explicitly_destroy=False")
        self._close()

    def _close(self):
        if not self._destroyed:
            self._destroyed = True
            self._clear_shapes()
            self._group.close()

    def __del__(self):
        try:
            if not self.explicitly_destroy:
                self._close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    # ---- what both modes share ------------------------------------------------------------

    def _check_open(self, call):
        if self._destroyed:
            raise InvalidArgument(f"{call}: the Buffer was destroyed")

    def _constant(self, x, rows, columns, value, comm=False):
        """A float32 [rows, columns] tensor of `value` on x's device, made once, for step
        inputs whose values no result reads (dispatch-time weights the combine does not use,
        the rows of a dispatch that moves only its routing). With `comm` it is made on the
        communication stream, where the normal mode's steps read it: made on the caller's, a
        call ordered after previous_event alone could read it before it was filled."""
        key = (x.get_device(), rows, columns, value, comm)
        t = self._constants.get(key)
        if t is None:
            with torch.cuda.stream(self._stream) if comm and x.is_cuda else _NO_STREAM:
                t = self._constants[key] = torch.full((rows, columns), value,
                                                      dtype=torch.float32, device=x.device)
        return t

    def _acquire(self, key, x, fields, comm):
        """The idle AllToAll of `key` (made from fields(), the config's keywords, when there is
        none: the call that makes it is the only one that builds them). The key names x's
        device (Tensor.get_device()). With `comm` its steps go on the communication stream,
        unless an earlier call gave it the caller's (see _stream_of)."""
        pooled = self._group.acquire(key)
        if pooled is None:
            pooled = self._create(key, x, fields)
        if comm and x.is_cuda and not pooled.streamed:
            if pooled.a2a.stream is None:
                self._stream_for(pooled)
            pooled.streamed = True
        return pooled

    def _create(self, key, x, fields):
        device = device_kind(x)
        low_latency = key[0] == "ll"

        def make():
            c = _ferry.AllToAllConfig(**fields())
            c.device = device
            c.mask_lost_peers = low_latency and self.enable_shrink
            if device == _ferry.MoeDevice.CUDA:
                c.cuda_device = x.device.index or 0
                c.ranks_per_node = self._group.ranks_per_node()
            return c

        pooled = self._group.acquire(key, make)
        if low_latency:
            for rank, masked in enumerate(self._masked):
                if masked:
                    pooled.a2a.set_masked(rank)
        return pooled

    def _stream_for(self, pooled):
        """The AllToAll on the communication stream (set once: its four steps must share
        one)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        pooled.a2a.set_stream(self._stream)

    def _stream_of(self, a2a, current, device):
        """torch's object for the stream a2a's steps go on, None where that is the caller's
        current stream (handle `current`). A low-latency AllToAll whose first call waits for its
        result (no async_finish) takes the caller's stream as its own in that call, as DeepEP
        launches a hook's send half on the caller's stream: the steps then follow the caller's
        kernels on it with no event between them. The first async_finish call gives it the
        communication stream instead, so that its transfers overlap the caller's work."""
        s = a2a.stream
        if s is None or s == current:
            return None
        if self._stream is not None and s == self._stream.cuda_stream:
            return self._stream
        stream = self._streams.get(s)
        if stream is None:
            stream = self._streams[s] = (torch.cuda.default_stream(device) if s == 0
                                         else torch.cuda.ExternalStream(s, device))
        return stream

    @staticmethod
    def _current(x):
        """The caller's current stream (a handle) where x is on the GPU, else None."""
        return current_stream_handle(x.get_device()) if x.is_cuda else None

    def _begin(self, a2a, x, previous_event):
        """The normal mode's steps, made one by one: what the AllToAll enqueued before and has
        finished let go (its kernels' errors raised), then the communication
        stream (where the AllToAll's steps go) ordered after the caller's stream, or after
        previous_event; returns the caller's stream handle, for _end. The ordering is the
        AllToAll's own (an event recorded and waited for in C++): torch's stream objects cost
        several microseconds a call. The low-latency calls have the AllToAll do all of this in
        its dispatch() / combine()."""
        current = self._current(x)
        if current is None:
            return None
        a2a.release_finished(current)
        if previous_event is not None and previous_event.event is not None:
            self._stream.wait_event(previous_event.event)
        else:
            a2a.order_after(current)
        return current

    def _end(self, a2a, current, async_finish, inputs, outputs=(), waited=False, device=None):
        """DeepEP's finish: the caller's stream waits for the communication stream (done
        already where `waited`), or (with async_finish) gets an event to wait on. The AllToAll
        keeps the tensors its enqueued steps use referenced until they finish, so none is
        freed (and its memory reused) under them."""
        if current is None:
            return EventOverlap(None, inputs + outputs) if async_finish else _DONE
        if not async_finish:
            if not waited:
                a2a.order_before(current)
            return _DONE
        event = torch.cuda.Event()
        event.record(self._stream_of(a2a, current, device) or torch.cuda.current_stream(device))
        return EventOverlap(event, inputs + outputs)

    def _on_comm(self, a2a, current, device):
        """torch's stream context for torch ops of ours that must run on the AllToAll's stream
        (fp8 scale layouts, counters); nothing on the CPU or where that is the caller's."""
        stream = None if current is None else self._stream_of(a2a, current, device)
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    # ---- low-latency mode ------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: ferry's flags carry an epoch, so no buffer needs zeroing between
        the modes."""
        self._check_open("clean_low_latency_buffer")

    def _low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats=None,
                              dispatch_wait_recv_cost_stats=None, use_fp8=True,
                              round_scale=False, use_ue8m0=False, async_finish=False,
                              return_recv_hook=False):
        """low_latency_dispatch where the C++ base does not take the call (a destroyed
        Buffer's has no shapes left there)."""
        self._check_open("low_latency_dispatch")
        check_tensor("x", x, torch.bfloat16, 2)
        self._check_wait_cost("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, x)
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, x.get_device())
        tokens, hidden = x.shape
        m, world = num_max_dispatch_tokens_per_rank, self.group_size
        if topk_idx.shape[0] != tokens:
            raise InvalidArgument(f"topk_idx: {topk_idx.shape[0]} rows, x has {tokens}")
        if tokens > m:
            raise InvalidArgument(f"x: {tokens} tokens, more than "
                                  f"num_max_dispatch_tokens_per_rank {m}")
        if num_experts % world:
            raise InvalidArgument(f"num_experts {num_experts}: not divisible by {world} ranks")
        if hidden % (128 if use_fp8 else 16):
            raise InvalidArgument(f"x: hidden {hidden} is not a multiple of "
                                  f"{128 if use_fp8 else 16} ({'fp8' if use_fp8 else 'bf16'} rows)")
        if use_ue8m0 and not round_scale:
            raise InvalidArgument("use_ue8m0 needs round_scale (UE8M0 holds powers of two)")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise InvalidArgument("round_scale and use_ue8m0 need use_fp8")
        if use_ue8m0 and hidden % 512:
            raise InvalidArgument(f"use_ue8m0: hidden {hidden} is not a multiple of 512")
        local = num_experts // world
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                         torch.int32, 1, x.get_device())
            if cumulative_local_expert_recv_stats.numel() != local:
                raise InvalidArgument(f"cumulative_local_expert_recv_stats: {local} entries")
        k = topk_idx.shape[1]
        dtype = _ferry.DispatchDtype.FP8_E4M3 if use_fp8 else _ferry.DispatchDtype.BF16
        pooled = self._acquire(
            ("ll", x.get_device(), m, hidden, num_experts, k, use_fp8), x, lambda: dict(
                num_experts=num_experts, experts_per_token=k, max_tokens_per_rank=m,
                hidden=hidden, dtype=dtype), comm=async_finish)
        a2a = pooled.a2a
        rows = world * m
        current = self._current(x)
        scaling = _ferry.Fp8Scaling.POWER_OF_TWO if round_scale else _ferry.Fp8Scaling.AMAX
        recv_x, recv_count, scales, packed = self._ll_outputs(
            pooled, x, (m, num_experts, k), use_fp8, use_ue8m0)
        # Work of ours left on the communication stream after the receive (the scales' layout,
        # the counters): the caller's stream waits after it, not in the AllToAll's call.
        after = packed is not None or cumulative_local_expert_recv_stats is not None
        # The send half, or both in one call (the AllToAll orders them with the caller's
        # stream). The dispatch's weights are unused (the combine's come at the combine): a
        # tensor of ones for up to m tokens, read for the first `tokens`. int64 or int32 ids:
        # ferry narrows int64 ones as it sends.
        halves = _SEND if return_recv_hook else _BOTH
        waits = not async_finish and (return_recv_hook or not after)
        try:
            a2a.dispatch(x, topk_idx, self._constant(x, m, k, 1.0), None, tokens, None,
                         scaling, recv_x, recv_count, scales, self._timeout, 0, current, halves,
                         True, waits, dispatch_wait_recv_cost_stats)
        except BaseException:
            pooled.busy = False  # a failed call frees its AllToAll (which reports the failure)
            raise
        handle = _Handle(pooled, tokens, k, hidden, num_experts, topk_idx, max_tokens=m)
        sent = (x, topk_idx)

        def finish(waited):
            if after:
                with self._on_comm(a2a, current, x.device):
                    if use_ue8m0:
                        exponents = (scales.view(torch.int32) >> 23).to(torch.uint8)
                        packed.copy_(exponents.view(local, rows, hidden // 128)
                                     .contiguous().view(torch.int32))
                    elif packed is not None:
                        packed.copy_(scales)
                    if cumulative_local_expert_recv_stats is not None:
                        cumulative_local_expert_recv_stats.add_(recv_count)
            return self._end(a2a, current, async_finish, sent, waited=waited, device=x.device)

        out_x = (recv_x, packed) if use_fp8 else recv_x
        if not return_recv_hook:
            return out_x, recv_count, handle, finish(waits), None
        event = self._end(a2a, current, async_finish, sent, waited=waits, device=x.device)

        def hook():
            try:
                # The receive half: ordered before the caller's stream only (after it, it would
                # wait for what the caller overlapped with the transfer).
                a2a.dispatch(None, None, None, None, None, None, scaling, recv_x, recv_count,
                             scales, self._timeout, 0, current, _RECV, False, not after,
                             dispatch_wait_recv_cost_stats)
            except BaseException:
                self._release(handle)  # the AllToAll reports its failure to the next call
                raise
            if after:
                finish(False).current_stream_wait()
        return out_x, recv_count, handle, event, hook

    def _ll_outputs(self, pooled, x, shape, use_fp8, use_ue8m0):
        """The output tensors of a low-latency dispatch: two sets per AllToAll, taken in turn,
        so that (as DeepEP's buffers are) a result stays valid until the second dispatch after
        it on the same AllToAll. Made once, not per call: on the CPU torch caches no large
        blocks, and every call paid for fresh pages. Once both of a set list exist, the C++
        path (the C++ base) takes the calls it can and shares the list's turns. shape: (m, experts,
        k)."""
        key = (use_fp8, use_ue8m0)
        sets = self._outputs.setdefault((id(pooled), key), [])
        m, experts, k = shape
        hidden, local, rows = x.shape[1], experts // self.group_size, self.group_size * m
        if len(sets) < 2:
            device = x.device
            recv_x = torch.empty(local, rows, hidden, device=device,
                                 dtype=fp8_dtype() if use_fp8 else torch.bfloat16)
            recv_count = torch.empty(local, dtype=torch.int32, device=device)
            scales = packed = None
            if use_fp8:
                scales = torch.empty(local, rows, hidden // 128, dtype=torch.float32,
                                     device=device)
                # DeepEP's scale layouts: the last two dimensions column-major (the storage is
                # [local, groups, rows]); UE8M0: each scale's exponent byte, four groups per
                # int32.
                if use_ue8m0:
                    packed = torch.empty(local, hidden // 512, rows, dtype=torch.int32,
                                         device=device).transpose(1, 2)
                else:
                    packed = torch.empty(local, hidden // 128, rows, dtype=torch.float32,
                                         device=device).transpose(1, 2)
            sets.append((recv_x, recv_count, scales, packed))
            if len(sets) == 2 and not use_ue8m0:
                self._add_shape(x.get_device(), m, hidden, experts, k, use_fp8, pooled, sets,
                                self._constant(x, m, k, 1.0))
            return sets[-1]
        sets.append(sets.pop(0))
        return sets[-1]

    def get_next_low_latency_combine_buffer(self, handle):
        """The tensor a zero-copy low_latency_combine sends from: [num_local_experts,
        num_ranks * num_max_dispatch_tokens_per_rank, hidden] bf16, one per AllToAll (made at
        its first use; a handle's combine is the only one its AllToAll has in flight)."""
        h = self._live_handle(handle, "get_next_low_latency_combine_buffer")
        if h.rows is not None:
            raise InvalidArgument("handle: from a normal-mode dispatch (no zero-copy combine)")
        buffer = self._combine_buffers.get(id(h.pooled))
        if buffer is None:
            local = h.num_experts // self.group_size
            buffer = self._combine_buffers[id(h.pooled)] = torch.empty(
                local, self.group_size * h.max_tokens, h.hidden, dtype=torch.bfloat16,
                device=h.topk_idx.device)
        h.combine_buffer = buffer
        return buffer

    def _low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                             zero_copy=False, async_finish=False, return_recv_hook=False,
                             out=None, combine_wait_recv_cost_stats=None):
        """low_latency_combine where the C++ base does not take the call."""
        self._check_open("low_latency_combine")
        refuse("use_logfmt", use_logfmt, False, "LogFMT-encoded combine is not supported")
        h = self._live_handle(handle, "low_latency_combine")
        if h.rows is not None:
            raise InvalidArgument("handle: from a normal-mode dispatch (use combine)")
        if zero_copy:
            if h.combine_buffer is None:
                raise InvalidArgument("zero_copy: call get_next_low_latency_combine_buffer first")
            x = h.combine_buffer
        local = h.num_experts // self.group_size
        check_tensor("x", x, torch.bfloat16, 3, h.topk_idx.get_device())
        want = (local, self.group_size * h.max_tokens, h.hidden)
        if tuple(x.shape) != want:
            raise InvalidArgument(f"x: shape {tuple(x.shape)}, the dispatch gave {want}")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, x.get_device())
        check_tensor("topk_weights", topk_weights, torch.float32, 2, x.get_device())
        self._check_wait_cost("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, x)
        if tuple(topk_idx.shape) != (h.tokens, h.k) or tuple(topk_weights.shape) != (h.tokens,
                                                                                     h.k):
            raise InvalidArgument(f"topk_idx / topk_weights: shapes {tuple(topk_idx.shape)} / "
                                  f"{tuple(topk_weights.shape)}, the dispatch had "
                                  f"{(h.tokens, h.k)}")
        if out is None:
            out = x.new_empty((h.tokens, h.hidden))  # x's dtype (bf16) and device
        else:
            check_tensor("out", out, torch.bfloat16, 2, x.get_device())
            if tuple(out.shape) != (h.tokens, h.hidden):
                raise InvalidArgument(f"out: shape {tuple(out.shape)}, expected "
                                      f"{(h.tokens, h.hidden)}")
        a2a = h.pooled.a2a
        current = self._current(x)
        waits = not async_finish
        if not return_recv_hook:
            try:
                a2a.combine(x, out, topk_weights, False, self._timeout, current, _BOTH, True,
                            waits, combine_wait_recv_cost_stats)
            finally:
                self._release(h)
            return out, self._end(a2a, current, async_finish, (x, topk_weights), (out,),
                                  waited=waits, device=x.device), None
        a2a.combine(x, None, None, False, self._timeout, current, _SEND, True, waits)
        event = self._end(a2a, current, async_finish, (x,), waited=waits, device=x.device)

        def hook():
            try:  # the receive half, ordered before the caller's stream only (as dispatch's)
                a2a.combine(None, out, topk_weights, False, self._timeout, current, _RECV,
                            False, True, combine_wait_recv_cost_stats)
            finally:
                self._release(h)
        return out, event, hook

    # Python's errors for a call that does not fit DeepEP's signature name the methods a
    # caller called (the C++ base's), not these.
    _low_latency_dispatch.__qualname__ = "Buffer.low_latency_dispatch"
    _low_latency_combine.__qualname__ = "Buffer.low_latency_combine"

    def _check_wait_cost(self, name, stats, x):
        """A low-latency call's wait-cost statistics (None, or int64 [num_ranks] on x's device):
        the time the receive waited for each rank is added to it -- GPU clock cycles on CUDA
        tensors (clock64, as DeepEP counts), nanoseconds on CPU ones."""
        if stats is None:
            return
        check_tensor(name, stats, torch.int64, 1, x.get_device())
        if stats.numel() != self.group_size:
            raise InvalidArgument(f"{name}: {stats.numel()} entries, expected {self.group_size} "
                                  "(one per rank)")

    def _live_handle(self, handle, call):
        if not isinstance(handle, _Handle):
            raise InvalidArgument(f"{call}: handle is not one this Buffer's dispatch returned")
        if not handle.in_flight:
            raise InvalidArgument(f"{call}: the handle's dispatch was combined already")
        return handle

    def _release(self, h):
        """The handle's dispatch combined (or failed): its AllToAll free for the next call."""
        h.pooled.busy = False
        h.in_flight = False

    # ---- normal (high-throughput) mode ------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """(num_tokens_per_rank [ranks] int32, num_tokens_per_rdma_rank [nodes] int32 or None
        within one node, num_tokens_per_expert [experts] int32, is_token_in_rank [tokens, ranks]
        bool, event), computed with torch on topk_idx's device."""
        self._check_open("get_dispatch_layout")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2)
        world = self.group_size
        if num_experts % world:
            raise InvalidArgument(f"num_experts {num_experts}: not divisible by {world} ranks")
        if previous_event is not None:
            previous_event.current_stream_wait()
        ids = topk_idx.long()
        valid = ids >= 0
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
        per_expert.scatter_add_(0, torch.where(valid, ids, num_experts).flatten(),
                                torch.ones(ids.numel(), dtype=torch.int64, device=ids.device))
        num_tokens_per_expert = per_expert[:num_experts].int()
        rank_of = torch.where(valid, ids // (num_experts // world), world)
        in_rank = torch.zeros(ids.shape[0], world + 1, dtype=torch.bool, device=ids.device)
        in_rank.scatter_(1, rank_of, True)
        is_token_in_rank = in_rank[:, :world].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0).int()
        nodes = world // self._group.ranks_per_node() if ids.device.type == "cuda" else 1
        per_rdma = None
        if nodes > 1:
            per_rdma = is_token_in_rank.view(-1, nodes, world // nodes).any(2).sum(0).int()
        return (num_tokens_per_rank, per_rdma, num_tokens_per_expert, is_token_in_rank,
                EventOverlap(None))

    def _normal_capacity(self, hidden):
        """Tokens per rank a normal-mode dispatch takes: what num_nvl_bytes + num_rdma_bytes
        hold of every rank's rows of this hidden size (at least one)."""
        per_token = self.group_size * (hidden * 2 + hidden // 128 * 4 + 16)
        return max(1, (self.num_nvl_bytes + self.num_rdma_bytes) // per_token)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); with a handle (a cached dispatch: the routing of that dispatch again), (recv_x,
        None, None, None, None, event). x: [tokens, hidden] bf16, or (x e4m3, scales [tokens,
        hidden / 128] fp32). The layout arguments must be get_dispatch_layout's for topk_idx;
        ferry routes from topk_idx itself."""
        self._check_open("dispatch")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        fp8 = x_scales is not None
        check_tensor("x", x, (fp8_dtype(), torch.uint8) if fp8 else torch.bfloat16, 2)
        tokens, hidden = x.shape
        if hidden % (128 if fp8 else 16):
            raise InvalidArgument(f"x: hidden {hidden} is not a multiple of "
                                  f"{128 if fp8 else 16} ({'fp8' if fp8 else 'bf16'} rows)")
        if fp8:
            check_tensor("x scales", x_scales, torch.float32, 2, x.get_device())
            if tuple(x_scales.shape) != (tokens, hidden // 128):
                raise InvalidArgument(f"x scales: shape {tuple(x_scales.shape)}, expected "
                                      f"{(tokens, hidden // 128)}")
        if expert_alignment < 1:
            raise InvalidArgument(f"expert_alignment {expert_alignment}: at least 1")
        every_count = None  # without topk_idx: num_tokens_per_expert, the counts' source
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgument("a cached dispatch (handle) takes no topk_idx / "
                                      "topk_weights: the handle's are used")
            cached = self._normal_handle(handle, "dispatch")
            if cached.in_flight:
                raise InvalidArgument("dispatch: the handle's dispatch is not combined yet")
            topk_idx, topk_weights = cached.topk_idx, cached.topk_weights
            num_experts = cached.num_experts
            if tokens != cached.tokens or hidden != cached.hidden:
                raise InvalidArgument(f"x: shape {(tokens, hidden)}, the handle's dispatch had "
                                      f"{(cached.tokens, cached.hidden)}")
        else:
            if num_tokens_per_expert is None:
                raise InvalidArgument("num_tokens_per_expert: required (get_dispatch_layout's)")
            check_tensor("num_tokens_per_expert", num_tokens_per_expert, None, 1)
            num_experts = num_tokens_per_expert.numel()
            if num_experts % self.group_size:
                raise InvalidArgument(f"num_experts {num_experts}: not divisible by "
                                      f"{self.group_size} ranks")
            for name, t, n in (("num_tokens_per_rank", num_tokens_per_rank, self.group_size),
                               ("is_token_in_rank", is_token_in_rank, None)):
                if t is None:
                    raise InvalidArgument(f"{name}: required (get_dispatch_layout's)")
                if n is not None and t.numel() != n:
                    raise InvalidArgument(f"{name}: {t.numel()} entries, expected {n}")
            if topk_idx is None:
                self._check_rank_routing(is_token_in_rank, topk_weights, num_worst_tokens, x)
                # One expert per rank; the ids are made once the AllToAll's stream is ordered.
                every_count, num_experts = num_tokens_per_expert, self.group_size
        if every_count is None:
            check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, x.get_device())
            if topk_idx.shape[0] != tokens:
                raise InvalidArgument(f"topk_idx: {topk_idx.shape[0]} rows, x has {tokens}")
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, torch.float32, 2, x.get_device())
                if topk_weights.shape != topk_idx.shape:
                    raise InvalidArgument(f"topk_weights: shape {tuple(topk_weights.shape)}, "
                                          f"topk_idx {tuple(topk_idx.shape)}")
        capacity = self._normal_capacity(hidden)
        if tokens > capacity:
            raise ResourceExhausted(
                f"dispatch: {tokens} tokens, the Buffer's num_nvl_bytes + num_rdma_bytes hold "
                f"{capacity} per rank at hidden {hidden} ({self.group_size} ranks): make it larger")
        k = self.group_size if every_count is not None else topk_idx.shape[1]
        local = num_experts // self.group_size
        dtype = _ferry.DispatchDtype.FP8_E4M3 if fp8 else _ferry.DispatchDtype.BF16
        pooled = self._acquire(
            ("normal", x.get_device(), capacity, hidden, num_experts, k, fp8), x,
            lambda: _token_major(num_experts, k, capacity, hidden, dtype), comm=True)
        a2a = pooled.a2a
        rows = self.group_size * capacity
        dev = x.device
        try:
            weights = (topk_weights if topk_weights is not None
                       else self._constant(x, capacity, k, 1.0, comm=True))
            # The outputs on the caller's stream (DeepEP's allocate_on_comm_stream=False).
            recv = torch.empty(rows, hidden, dtype=x.dtype, device=dev)
            recv_scales = (torch.empty(rows, hidden // 128, dtype=torch.float32, device=dev)
                           if fp8 else None)
            counts = torch.empty(local, dtype=torch.int32, device=dev)
            num_rows = torch.empty(1, dtype=torch.int32, device=dev)
            experts = torch.empty(rows, k, dtype=torch.int32, device=dev)
            weights_out = torch.empty(rows, k, dtype=torch.float32, device=dev)
            current = self._begin(a2a, x, previous_event)
            if every_count is not None:  # rank r's column holds r where the token goes there
                with self._on_comm(a2a, current, dev):
                    topk_idx = torch.where(is_token_in_rank, torch.arange(
                        k, dtype=torch.int32, device=dev), -1).int()
            a2a.dispatch_send(x, topk_idx, weights, scales=x_scales, num_tokens=tokens)
            a2a.dispatch_recv(recv, counts, recv_scales, num_rows, experts, weights_out,
                              timeout=self._timeout)
        except BaseException:
            pooled.busy = False
            raise
        if num_worst_tokens > 0:
            # No wait for the count: rows past it hold no token (experts -1, weights 0).
            if num_worst_tokens > rows:
                raise InvalidArgument(f"num_worst_tokens {num_worst_tokens}: more than the "
                                      f"{rows} rows ranks can send here")
            with self._on_comm(a2a, current, x.device):
                live = torch.arange(num_worst_tokens, device=dev) < num_rows.to(torch.int64)
                experts[:num_worst_tokens].masked_fill_(~live[:, None], -1)
                weights_out[:num_worst_tokens].masked_fill_(~live[:, None], 0.0)
        event = self._end(a2a, current, async_finish, (x, x_scales, topk_idx, weights),
                          (recv, recv_scales, counts, num_rows, experts, weights_out))
        if num_worst_tokens > 0:
            r = num_worst_tokens
            per_expert_list = []
        else:
            event.current_stream_wait()
            r = int(num_rows.item())
            got = (counts.tolist() if every_count is None
                   else self._received_per_expert(every_count))
            per_expert_list = [_round_up(int(c), expert_alignment) for c in got]
        recv_x = recv[:r]
        out_x = (recv_x, recv_scales[:r]) if fp8 else recv_x
        if handle is not None:
            cached.pooled, cached.rows, cached.in_flight = pooled, r, True
            return out_x, None, None, None, None, event
        new = _Handle(pooled, tokens, k, hidden, num_experts, topk_idx, topk_weights=topk_weights,
                      rows=r)
        if every_count is not None:
            return out_x, None, None, per_expert_list, new, event
        recv_topk_idx = experts[:r].long()
        recv_topk_weights = weights_out[:r] if topk_weights is not None else None
        return out_x, recv_topk_idx, recv_topk_weights, per_expert_list, new, event

    def _check_rank_routing(self, is_token_in_rank, topk_weights, num_worst_tokens, x):
        """What a dispatch without topk_idx (DeepEP routes by is_token_in_rank alone) takes."""
        if topk_weights is not None:
            raise InvalidArgument("topk_weights: given without topk_idx (the weights follow "
                                  "the ids)")
        if num_worst_tokens > 0:
            raise InvalidArgument(f"num_worst_tokens {num_worst_tokens}: needs topk_idx (the "
                                  "rows past those received are marked by their ids)")
        world = self.group_size
        check_tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2, x.get_device())
        if tuple(is_token_in_rank.shape) != (x.shape[0], world):
            raise InvalidArgument(f"is_token_in_rank: shape {tuple(is_token_in_rank.shape)}, "
                                  f"expected {(x.shape[0], world)}")

    def _received_per_expert(self, num_tokens_per_expert):
        """Tokens this rank's experts receive, from every rank's num_tokens_per_expert (a host
        all-gather: the ids that would count them stayed with their senders)."""
        experts = num_tokens_per_expert.numel()
        mine = num_tokens_per_expert.to(torch.int64).cpu().numpy().tobytes()
        every = self._group.bootstrap.all_gather(mine, self._timeout)
        if any(len(data) != len(mine) for data in every):
            raise InvalidArgument(f"num_tokens_per_expert: {experts} experts here, another "
                                  "rank's differs")
        counts = torch.frombuffer(bytearray(b"".join(every)), dtype=torch.int64)
        local = experts // self.group_size
        mine_first = self.rank * local
        return counts.view(self.group_size, experts)[:, mine_first:mine_first + local].sum(
            0).tolist()

    def _normal_handle(self, handle, call):
        if not isinstance(handle, _Handle) or handle.rows is None:
            raise InvalidArgument(f"{call}: handle is not one this Buffer's dispatch returned")
        return handle

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """(combined_x [tokens, hidden] bf16: each token's rows from every rank that got it,
        summed without weights, plus bias; combined_topk_weights [tokens, columns] fp32 or None;
        event). bias: a [tokens, hidden] bf16 tensor or a pair of them, added in fp32 before the
        rows (a pair is first summed in fp32 and rounded to bf16 once: DeepEP keeps that sum in
        fp32). topk_weights: [received rows, columns] fp32, each token's rows summed over the
        ranks that got it as its x rows are (a second, small AllToAll of fp32 rows on the same
        stream; every rank passes it or none, or the ranks wait for each other until the
        deadline)."""
        self._check_open("combine")
        h = self._live_handle(self._normal_handle(handle, "combine"), "combine")
        check_tensor("x", x, torch.bfloat16, 2)
        if tuple(x.shape) != (h.rows, h.hidden):
            raise InvalidArgument(f"x: shape {tuple(x.shape)}, the dispatch received "
                                  f"{(h.rows, h.hidden)}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, torch.float32, 2, x.get_device())
            if topk_weights.shape[0] != h.rows:
                raise InvalidArgument(f"topk_weights: {topk_weights.shape[0]} rows, the "
                                      f"dispatch received {h.rows}")
        biases = self._biases(bias, h, x)
        a2a = h.pooled.a2a
        out = torch.empty(h.tokens, h.hidden, dtype=torch.bfloat16, device=x.device)
        combined_weights, kept = None, ()
        try:
            current = self._begin(a2a, x, previous_event)
            if biases:  # the sums start from the bias: out, taken with accumulate
                with self._on_comm(a2a, current, x.device):
                    if len(biases) == 1:
                        out.copy_(biases[0])
                    else:
                        out.copy_(biases[0].float() + biases[1].float())
            a2a.combine_send(x, num_rows=h.rows)
            a2a.combine_recv(out, accumulate=bool(biases), timeout=self._timeout)
            if topk_weights is not None:
                combined_weights, kept = self._combine_weights(h, x, topk_weights, current)
        finally:
            self._release(h)
        return out, combined_weights, self._end(a2a, current, async_finish,
                                                (x, topk_weights) + biases + kept,
                                                (out, combined_weights))

    def _combine_weights(self, h, x, topk_weights, current):
        """combine's top-k weights, (the sums [tokens, columns], the padded tensors the
        caller's event keeps alive): an AllToAll of fp32 rows (the columns padded to 16) routed
        as the handle's dispatch was, whose dispatch moves only the routing (the rows arrive in
        the main dispatch's order: senders in rank order, each sender's tokens in order) and
        whose combine sums the weights rows. Every step, the padding copies too, goes on the
        communication stream after the main combine, so what orders that combine (the caller's
        stream or previous_event) orders these, and the caller's wait on the stream covers
        both."""
        dev = x.device
        columns = topk_weights.shape[1]
        width = _round_up(max(columns, 1), 16)
        capacity = self._normal_capacity(h.hidden)
        rows = self.group_size * capacity
        local = h.num_experts // self.group_size
        key = ("normal-weights", x.get_device(), capacity, width, h.num_experts, h.k)
        pooled = self._acquire(key, x, lambda: _token_major(
            h.num_experts, h.k, capacity, width, _ferry.DispatchDtype.FP32), comm=True)
        wa2a = pooled.a2a
        try:
            # Its dispatch's outputs, read by nothing: one set per key, as the AllToAll is
            # taken and given back within this call and its steps follow each other on one
            # stream.
            scratch = self._weights_scratch.get(key)
            if scratch is None:
                scratch = self._weights_scratch[key] = (
                    torch.empty(rows, width, dtype=torch.float32, device=dev),
                    torch.empty(local, dtype=torch.int32, device=dev), None,
                    torch.empty(1, dtype=torch.int32, device=dev),
                    torch.empty(rows, h.k, dtype=torch.int32, device=dev),
                    torch.empty(rows, h.k, dtype=torch.float32, device=dev))
            f32 = dict(dtype=torch.float32, device=dev)
            padded = torch.empty(h.rows, width, **f32)
            wide = torch.empty(h.tokens, width, **f32)
            sums = wide if width == columns else torch.empty(h.tokens, columns, **f32)
            with self._on_comm(wa2a, current, dev):
                padded[:, columns:].zero_()
                padded[:, :columns].copy_(topk_weights)
            wa2a.dispatch_send(self._constant(x, capacity, width, 0.0, comm=True)[:h.tokens],
                               h.topk_idx, self._constant(x, capacity, h.k, 1.0, comm=True),
                               num_tokens=h.tokens)
            wa2a.dispatch_recv(*scratch, timeout=self._timeout)
            wa2a.combine_send(padded, num_rows=h.rows)
            wa2a.combine_recv(wide, accumulate=False, timeout=self._timeout)
            if sums is not wide:
                with self._on_comm(wa2a, current, dev):
                    sums.copy_(wide[:, :columns])
        except Error as e:  # the usual cause: a peer that passed no topk_weights
            raise type(e)(f"combine's topk_weights (their AllToAll, which every rank's combine "
                          f"must take alike): {e}") from e
        finally:
            pooled.busy = False
        return sums, (padded, wide)

    @staticmethod
    def _biases(bias, h, x):
        """combine's bias as a tuple of the tensors given (none, one or two), each checked."""
        if bias is None:
            return ()
        given = bias if isinstance(bias, tuple) else (bias,)
        if not 1 <= len(given) <= 2:
            raise InvalidArgument(f"bias: a tensor or a pair of tensors, got {len(given)}")
        given = tuple(b for b in given if b is not None)
        for b in given:
            check_tensor("bias", b, torch.bfloat16, 2, x.get_device())
            if tuple(b.shape) != (h.tokens, h.hidden):
                raise InvalidArgument(f"bias: shape {tuple(b.shape)}, the combine gives "
                                      f"{(h.tokens, h.hidden)}")
        return given

    # ---- rank masks (DeepEP's shrink mode) --------------------------------------------------

    def _low_latency_all_to_alls(self):
        return self._group.all_to_alls("ll")

    def _check_shrink(self, call):
        self._check_open(call)
        if not self.enable_shrink:
            raise InvalidArgument(f"{call}: the Buffer was made without enable_shrink=True "
                                  "(DeepEP's mask buffer exists in shrink mode only)")

    def _gather_masks(self):
        """The ranks any low-latency AllToAll masked (a call that missed its deadline masks the
        ranks it waited for), each then masked on every other one too: one mask per Buffer, as
        DeepEP's mask buffer is. An AllToAll mid-call takes a mask from its next dispatch."""
        a2as = self._low_latency_all_to_alls()
        for a2a in a2as:
            for rank, masked in enumerate(a2a.masked()):
                self._masked[rank] |= masked
        for a2a in a2as:
            for rank, masked in enumerate(self._masked):
                if masked:
                    a2a.set_masked(rank)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Mask `rank_to_mask` out of the low-latency calls (mask=True: nothing is sent to or
        awaited from it; the copies routed to its experts add nothing) from each AllToAll's next
        dispatch (a CUDA graph's next replay included). Unmasking a masked rank is refused: in ferry a masked rank stays masked, since
        sections it sent late would be read as a later call's (a rank that is back joins a new
        Buffer)."""
        self._check_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.group_size:
            raise InvalidArgument(f"low_latency_update_mask_buffer: rank {rank_to_mask} of "
                                  f"{self.group_size}")
        if rank_to_mask == self.rank:
            raise InvalidArgument("low_latency_update_mask_buffer: a rank cannot mask itself")
        self._gather_masks()
        if not mask:
            if self._masked[rank_to_mask]:
                raise Unimplemented(f"low_latency_update_mask_buffer: rank {rank_to_mask} is "
                                    "masked and stays so in this Buffer (unmasking is not "
                                    "supported: its late sections would be read as a later "
                                    "call's)")
            return
        self._masked[rank_to_mask] = 1
        for a2a in self._low_latency_all_to_alls():
            a2a.set_masked(rank_to_mask)
            # On the CUDA device the mask is set on the AllToAll's stream (AllToAll::SetMasked):
            # waited for here, so that a CUDA graph replayed next, on any stream, reads it.
            if a2a.config.device == _ferry.MoeDevice.CUDA:
                a2a.synchronize()

    def low_latency_query_mask_buffer(self, mask_status):
        """mask_status ([num_ranks] int32, any device): 1 where a rank is masked, by
        low_latency_update_mask_buffer or by a call that missed its deadline."""
        self._check_shrink("low_latency_query_mask_buffer")
        if (not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32
                or tuple(mask_status.shape) != (self.group_size,)):
            raise InvalidArgument(f"mask_status: an int32 tensor of shape ({self.group_size},)")
        self._gather_masks()
        mask_status.copy_(torch.tensor(self._masked, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self):
        """Nothing to clean while no rank is masked; with one masked, refused (a masked rank
        stays masked in ferry: see low_latency_update_mask_buffer)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._gather_masks()
        masked = [r for r, m in enumerate(self._masked) if m]
        if masked:
            raise Unimplemented(f"low_latency_clean_mask_buffer: ranks {masked} are masked and "
                                "stay so in this Buffer (unmasking is not supported: their late "
                                "sections would be read as a later call's)")
