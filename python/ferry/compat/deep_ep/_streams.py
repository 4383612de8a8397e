"""The Buffer's AllToAlls and streams: what both modes share (pools, constants, the
communication stream, the order between it and the caller's)."""

import contextlib

import torch


from ... import _ferry
from ..._errors import InvalidArgument
from ._events import _DONE, EventOverlap, _NO_STREAM


class _Streams:
    """What Buffer's modes share (a mixin: the state is Buffer's)."""

    def _check_open(self, call):
        if self._destroyed:
            raise InvalidArgument(f"{call}: the Buffer was destroyed")

    def _constant(self, x, rows, columns, value, a2a=None, current=None):
        """A float32 [rows, columns] tensor of `value` on x's device, made once per stream, for
        step inputs whose values no result reads (dispatch-time weights the combine does not
        use, the rows of a dispatch that moves only its routing). Given the normal mode's `a2a`
        (and the caller's stream handle `current`) it is made on the stream a2a's steps go on,
        which reads it: made on the caller's, a call ordered after previous_event alone could
        read it before it was filled."""
        key = (x.get_device(), rows, columns, value, None if a2a is None else a2a.stream)
        t = self._constants.get(key)
        if t is None:
            with _NO_STREAM if a2a is None else self._on_comm(a2a, current, x.device):
                t = self._constants[key] = torch.full((rows, columns), value,
                                                      dtype=torch.float32, device=x.device)
        return t

    def _acquire(self, key, x, fields):
        """The idle AllToAll of `key` (made from fields(), the config's keywords, when there is
        none: the call that makes it is the only one that builds them). The key names x's
        device (Tensor.get_device()). Its stream is decided at its first call (_stream_of), by
        the calls' C++."""
        pooled = self._group.acquire(key)
        if pooled is None:
            pooled = self._create(key, x, fields)
        return pooled

    def _create(self, key, x, fields):
        pooled = self._group.acquire(key, lambda: self._config(key, fields))
        if key[0] == "ll":
            for rank, masked in enumerate(self._masked):
                if masked:
                    pooled.a2a.set_masked(rank)
        return pooled

    def _config(self, key, fields):
        """The configuration of pool `key`'s AllToAlls from fields() (its mode's keywords): its
        device from the key's second element (the tensors', Tensor.get_device(): -1 on the
        CPU), the rest from the Buffer's settings -- what a process that joins later
        (_Shrink._join_world) makes from the key alone."""
        device = _ferry.MoeDevice.HOST if key[1] < 0 else _ferry.MoeDevice.CUDA
        low_latency = key[0] == "ll"
        c = _ferry.AllToAllConfig(**fields())
        c.device = device
        c.mask_lost_peers = low_latency and self.enable_shrink
        if low_latency:
            # The low-latency handle names each row's sender (src_info), which rows forwarded
            # inside a node lack: across nodes, per rank.
            c.forwarding = _ferry.Forwarding.PER_RANK
        if device == _ferry.MoeDevice.CUDA:
            c.cuda_device = key[1]
        if device == _ferry.MoeDevice.CUDA or c.forwarding == _ferry.Forwarding.NODE_ONCE:
            # The NVLink domain; node-once's nodes on the host device too.
            c.ranks_per_node = self._group.ranks_per_node()
        return c

    def _stream_for(self, pooled):
        """The AllToAll on the communication stream (set once: its four steps must share
        one)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        pooled.a2a.set_stream(self._stream)

    def _stream_of(self, a2a, current, device):
        """torch's object for the stream a2a's steps go on, None where that is the caller's
        current stream (handle `current`). An AllToAll (of either mode) whose first call waits
        for its result (no async_finish) takes the caller's stream as its own in that call, as
        DeepEP launches a hook's send half on the caller's stream: the steps then follow the
        caller's kernels on it with no event between them, and a caller that waits pays no
        ordering. The first async_finish call gives it the communication stream instead, so
        that its transfers overlap the caller's work; a call on another stream than the
        AllToAll's is ordered with it by events."""
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

    def _end(self, a2a, current, async_finish, inputs, outputs=(), waited=False, device=None):
        """DeepEP's finish: the caller's stream waits for the AllToAll's (done already where
        `waited`, or where that is the caller's), or (with async_finish) gets an event to wait
        on. The AllToAll keeps the tensors its enqueued steps use referenced until they finish,
        so none is freed (and its memory reused) under them."""
        if current is None:
            return EventOverlap(None, inputs + outputs) if async_finish else _DONE
        if not async_finish:
            if not waited and a2a.stream != current:
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
