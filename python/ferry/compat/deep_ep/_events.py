"""What DeepEP's calls take and return besides tensors: Config, EventHandle, EventOverlap, and
the helpers every mode of the Buffer shares."""

import contextlib

import torch

from ... import _ferry

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


def _token_major(num_experts, k, capacity, hidden, dtype, forwarding, partial_sums):
    """The normal mode's AllToAll configuration: token-major, each token sent once per rank
    that holds any of its experts, their outputs summed at that rank; across nodes per rank or
    node-once (`forwarding`, with its `partial_sums`)."""
    return dict(num_experts=num_experts, experts_per_token=k, max_tokens_per_rank=capacity,
                hidden=hidden, dtype=dtype, dispatch_once_per_rank=True,
                combine_reduce_at_expert_rank=True,
                dispatch_layout=_ferry.DispatchLayout.TOKEN_MAJOR, forwarding=forwarding,
                partial_sums=partial_sums)


def _round_up(n, to):
    return (n + to - 1) // to * to


class LowLatencyHandle(tuple):
    """DeepEP V1's low-latency handle, as V1 lays it out for callers that index it: (src_info
    [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank] int32: each received
    row's token index in its sender; layout_range [num_local_experts, num_ranks] int64: each
    sender's rows of each local expert as (first row << 32) | rows -- the senders' rows lie in
    rank order; num_max_dispatch_tokens_per_rank; hidden; num_experts). Valid, as the rows are,
    until the second dispatch after it of the same shape. `_ferry` holds what ferry's combine
    needs (the C++ base makes these)."""


class NotKept:
    """An entry of DeepEP's normal-mode handle that ferry does not keep (DeepEP's per-channel
    bookkeeping of its own kernels, or counts only every rank together holds): any use of it
    raises Unimplemented naming it, rather than passing for a tensor of wrong values."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def _refuse(self):
        from ..._errors import Unimplemented
        raise Unimplemented(f"deep_ep normal-mode handle: {self.name} is not kept by ferry "
                            "(DeepEP's kernels' own bookkeeping); ferry's combine needs none")

    def __getattr__(self, attr):
        if attr.startswith("__"):  # what hasattr and copy probe for: simply absent
            raise AttributeError(attr)
        self._refuse()

    def __getitem__(self, key):
        self._refuse()

    def __bool__(self):
        self._refuse()

    def __repr__(self):
        return f"<deep_ep handle entry {self.name}: not kept by ferry>"


# One of each, made once: an entry holds nothing but its name.
_NOT_KEPT = {name: NotKept(name) for name in (
    "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
    "send_head", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
    "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
    "send_rdma_head", "send_nvl_head")}


class NormalHandle(tuple):
    """DeepEP V1's normal-mode handle, as V1 lays it out for callers that index or unpack it.
    Within one node (V1's intranode layout): (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head). Across nodes
    (internode): (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
    recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head). ferry fills what
    its receive knows: is_token_in_rank (the dispatch's), recv_src_idx [received rows] int32
    (each row's token index in its sender), recv_gbl_rank_prefix_sum [ranks] int32 and
    recv_rdma_rank_prefix_sum [nodes] int32 (the rows received from the senders up to each
    rank, and each node: inclusive prefix sums; the senders' rows lie in rank order). The rest
    -- the channel matrices, the send heads, recv_src_meta, and rank_prefix_matrix, which
    holds every rank's receive counts -- are NotKept, as are the sums under node-once
    forwarding, whose rows come from forwarders. `_ferry` holds what ferry's combine needs. The
    dispatch's C++ makes them (python/src/deep_ep_normal.cc)."""
