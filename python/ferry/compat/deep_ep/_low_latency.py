"""DeepEP's low-latency mode over an expert-major AllToAll: the calls the C++ base
(_ferry.DeepEpLowLatency, which checks every argument and runs the common path) hands over,
the AllToAlls and output sets it asks for, the combine buffer."""

import torch


from ... import _ferry
from .._group import fp8_dtype
from ..._errors import InvalidArgument
from ._events import _BOTH, _Handle, _RECV, _SEND


class _LowLatency:
    """Buffer's low-latency calls (a mixin: the state is Buffer's)."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: ferry's flags carry an epoch, so no buffer needs zeroing between
        the modes."""
        self._check_open("clean_low_latency_buffer")

    def _low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats=None,
                              dispatch_wait_recv_cost_stats=None, use_fp8=True,
                              round_scale=False, use_ue8m0=False, async_finish=False,
                              return_recv_hook=False):
        """low_latency_dispatch where the C++ base does not run the call (async_finish, UE8M0
        scales, an AllToAll on another stream than the caller's); the C++ base checked every
        argument."""
        tokens, hidden = x.shape
        m, world = num_max_dispatch_tokens_per_rank, self.group_size
        local = num_experts // world
        k = topk_idx.shape[1]
        pooled = self._ll_acquire(x, m, num_experts, k, use_fp8, comm=async_finish)
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

    def _ll_acquire(self, x, m, num_experts, k, use_fp8, comm=False):
        """An idle low-latency AllToAll of the shape, taken (made where none is idle)."""
        dtype = _ferry.DispatchDtype.FP8_E4M3 if use_fp8 else _ferry.DispatchDtype.BF16
        return self._acquire(
            ("ll", x.get_device(), m, x.shape[1], num_experts, k, use_fp8), x, lambda: dict(
                num_experts=num_experts, experts_per_token=k, max_tokens_per_rank=m,
                hidden=x.shape[1], dtype=dtype), comm=comm)

    def _ll_shape(self, x, m, num_experts, k, use_fp8):
        """What the C++ base asks for where no AllToAll of a shape is idle: one (made where
        none is idle), with its two output sets, added to the C++ path and left idle there."""
        pooled = self._ll_acquire(x, m, num_experts, k, use_fp8)
        self._ll_sets(pooled, x, (m, num_experts, k), use_fp8, False)
        pooled.busy = False

    def _ll_outputs(self, pooled, x, shape, use_fp8, use_ue8m0):
        """The output set a low-latency dispatch on `pooled` writes: of its two sets, the one
        used least recently, so that (as DeepEP's buffers are) a result stays valid until the
        second dispatch after it on the same AllToAll."""
        sets = self._ll_sets(pooled, x, shape, use_fp8, use_ue8m0)
        sets.append(sets.pop(0))
        return sets[-1]

    def _ll_sets(self, pooled, x, shape, use_fp8, use_ue8m0):
        """The two output sets of a low-latency AllToAll, (recv_x, recv_count, scales,
        packed) each, made at its first use (on the CPU torch caches no large blocks, and
        every call would pay for fresh pages) and, but for UE8M0's, added to the C++ path,
        which takes them in the same turns. shape: (m, experts, k)."""
        key = (id(pooled), use_fp8, use_ue8m0)
        sets = self._outputs.get(key)
        if sets is not None:
            return sets
        m, experts, k = shape
        hidden, local, rows = x.shape[1], experts // self.group_size, self.group_size * m
        device = x.device
        sets = self._outputs[key] = []
        for _ in range(2):
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
        if not use_ue8m0:
            self._add_shape(x.get_device(), m, hidden, experts, k, use_fp8, pooled, sets,
                            self._constant(x, m, k, 1.0))
        return sets

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
        """low_latency_combine where the C++ base does not run the call (async_finish, a
        dispatch the Python path ran on an AllToAll the C++ path does not have); the C++ base
        checked every argument."""
        h = handle
        if zero_copy:
            x = h.combine_buffer
        if out is None:
            out = x.new_empty((h.tokens, h.hidden))  # x's dtype (bf16) and device
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
