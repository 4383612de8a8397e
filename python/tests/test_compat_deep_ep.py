"""ferry.compat.deep_ep on the host device against compat_reference's torch references: the
low-latency mode (bf16 and fp8, with and without the receive hook), the normal mode (its checks in
deep_ep_normal_checks.py), world sizes 1, 2 and 4 over gloo and ferry's bootstrap, and the shim
package."""

import time

import ferry
from ranks import expect_error

from compat_reference import (EXPERTS_PER_RANK, HIDDEN, K, MAX_TOKENS, Behaviours, Case,
                              decode_e4m3, dv, expert_factor, group_of, hv, inputs,
                              quantize_reference, rows_of, run_with_shim, weighted_reference)
from deep_ep_normal_checks import check_normal, check_rank_routing, check_worst_tokens

try:
    import torch
except ImportError:  # the bindings' other tests run without torch
    torch = None


def check_low_latency(buf, world, rank, use_fp8, round_scale, use_ue8m0, hook, common=False,
                      round=0, hook_stream=None, positional=False, counters=None,
                      hidden=HIDDEN):
    """One low-latency dispatch and combine against the references. common: the calls an
    engine's decode step makes (the combine into an `out` of its own, by default no expert
    counters). hook_stream
    (CUDA): the dispatch's hook called with that stream current, the results then read on the
    dispatch's. positional: every argument passed by position, none by keyword. counters:
    whether cumulative_local_expert_recv_stats is passed (default: when not common). hidden:
    the rows' first columns only."""
    from ferry import deep_ep  # noqa: F401 -- the module under test
    x, idx, w = inputs(world, rank, round=round, columns=hidden)
    e = EXPERTS_PER_RANK * world
    counters = not common if counters is None else counters
    stats = dv(torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32)) if counters else None
    if positional:
        recv, count, handle, event, recv_hook = buf.low_latency_dispatch(
            dv(x), dv(idx), MAX_TOKENS, e, stats, None, use_fp8, round_scale, use_ue8m0, False,
            hook)
    else:
        recv, count, handle, event, recv_hook = buf.low_latency_dispatch(
            dv(x), dv(idx), MAX_TOKENS, e, cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            return_recv_hook=hook)
    assert (recv_hook is not None) == hook
    if hook and hook_stream is not None:
        with torch.cuda.stream(hook_stream):
            recv_hook()
    elif hook:
        recv_hook()
    event.current_stream_wait()
    rows = world * MAX_TOKENS
    recv_x, scales = recv if use_fp8 else (recv, None)
    if use_fp8:  # the layout on the device; the values here (strides kept: copied as they are)
        assert scales.stride() == ((hidden // 512 if use_ue8m0 else hidden // 128) * rows, 1,
                                   rows), scales.stride()
    recv_x, count = hv(recv_x), hv(count)
    scales = hv(scales) if use_fp8 else None
    assert tuple(recv_x.shape) == (EXPERTS_PER_RANK, rows, hidden), recv_x.shape
    assert tuple(count.shape) == (EXPERTS_PER_RANK,) and count.dtype == torch.int32
    if use_fp8:
        groups = hidden // 512 if use_ue8m0 else hidden // 128
        assert tuple(scales.shape) == (EXPERTS_PER_RANK, rows, groups), scales.shape
        assert scales.stride() == (groups * rows, 1, rows), scales.stride()  # column-major
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
    expert_y = torch.zeros(EXPERTS_PER_RANK, rows, hidden, dtype=torch.bfloat16)
    for le in range(EXPERTS_PER_RANK):
        g = rank * EXPERTS_PER_RANK + le
        want, want_q, want_s = [], [], []
        for s in range(world):
            sx, sidx, _ = inputs(world, s, round=round, columns=hidden)
            q, qs = quantize_reference(sx, round_scale) if use_fp8 else (None, None)
            for t in range(sx.shape[0]):
                for j in range(K):
                    if int(sidx[t, j]) == g:
                        want.append(sx[t])
                        if use_fp8:
                            want_q.append(q[t])
                            want_s.append(qs[t])
        n = int(count[le])
        assert n == len(want), (rank, le, n, len(want))
        if use_fp8:
            got_q = decode_e4m3(recv_x[le, :n].contiguous())
            if use_ue8m0:  # four exponent bytes per int32, group c at byte c % 4
                b = torch.tensor(scales[le, :n].tolist(), dtype=torch.int32)
                b = b.view(torch.uint8).long()
                got_s = torch.ldexp(torch.ones(b.shape), (b - 127).int())
            else:
                got_s = scales[le, :n]
            got = sorted(tuple(qq.tolist()) + tuple(ss.tolist()) for qq, ss in zip(got_q, got_s))
            ref = sorted(tuple(qq.tolist()) + tuple(ss.tolist())
                         for qq, ss in zip(want_q, want_s))
            assert got == ref, (rank, le, "fp8 rows or scales differ from the reference")
        else:
            assert rows_of(recv_x[le, :n]) == rows_of(want), (rank, le)
        if not use_fp8:  # the expert: its rows times its factor
            expert_y[le, :n] = (recv_x[le, :n].double() * expert_factor(g)).to(torch.bfloat16)
        else:  # each received row traced back to its sender's bf16 row by its quantised form
            sources = {}
            for row in want:
                sources.setdefault(tuple(quantize_reference(row[None], round_scale)[0][0]
                                         .tolist()), []).append(row)
            got_q = decode_e4m3(recv_x[le, :n].contiguous())
            for r in range(n):
                src = sources[tuple(got_q[r].tolist())].pop()
                expert_y[le, r] = (src.double() * expert_factor(g)).to(torch.bfloat16)
    if stats is not None:
        assert torch.equal(hv(stats), count), (stats, count)
    given = dv(torch.full(x.shape, 7.0, dtype=torch.bfloat16)) if common else None
    if positional:
        out, event, combine_hook = buf.low_latency_combine(dv(expert_y), dv(idx), dv(w), handle,
                                                           False, False, False, hook, given)
    else:
        out, event, combine_hook = buf.low_latency_combine(dv(expert_y), dv(idx), dv(w), handle,
                                                           return_recv_hook=hook, out=given)
    if hook:
        combine_hook()
    event.current_stream_wait()
    assert given is None or out is given
    out = hv(out)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    ref = weighted_reference(x, idx, w)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -6)


def expert_outputs(recv_x, count, rank):
    """The experts' outputs in the low-latency layout: each received row times its expert's
    factor (rows past the counts zero)."""
    y = torch.zeros(recv_x.shape, dtype=torch.bfloat16)
    for le in range(EXPERTS_PER_RANK):
        n = int(count[le])
        y[le, :n] = (recv_x[le, :n].double() * expert_factor(rank * EXPERTS_PER_RANK + le)).to(
            torch.bfloat16)
    return y


def check_overlapped_and_zero_copy(buf, world, rank):
    """Two micro-batches dispatched before either is combined (each on an AllToAll of its
    own), combined in the other order, the second through the zero-copy combine buffer and
    async_finish; each token back as its weighted sum."""
    e = EXPERTS_PER_RANK * world
    (xa, ia, wa), (xb, ib, wb) = inputs(world, rank, round=1), inputs(world, rank, round=2)
    ra, ca, ha, _, _ = buf.low_latency_dispatch(dv(xa), dv(ia), MAX_TOKENS, e, use_fp8=False)
    rb, cb, hb, _, hook = buf.low_latency_dispatch(dv(xb), dv(ib), MAX_TOKENS, e, use_fp8=False,
                                                   return_recv_hook=True)
    hook()
    ya, yb = expert_outputs(hv(ra), hv(ca), rank), expert_outputs(hv(rb), hv(cb), rank)
    buffer = buf.get_next_low_latency_combine_buffer(hb)
    buffer.copy_(dv(yb))
    out_b, event, _ = buf.low_latency_combine(dv(torch.zeros_like(yb)), dv(ib), dv(wb), hb,
                                              zero_copy=True, async_finish=True)
    event.current_stream_wait()
    out_a, _, _ = buf.low_latency_combine(dv(ya), dv(ia), dv(wa), ha)
    for out, (x, idx, w) in ((out_a, (xa, ia, wa)), (out_b, (xb, ib, wb))):
        torch.testing.assert_close(hv(out).float(), weighted_reference(x, idx, w).float(),
                                   rtol=2 ** -7, atol=2 ** -6)



# The behaviours deep_ep_body checks, in order, each a function of (buf, world, rank); a test per
# behaviour runs it alone (DeepEpTest), the CUDA tests run them all in one set of ranks.
BEHAVIOURS = {}


def behaviour(fn):
    BEHAVIOURS[fn.__name__] = fn
    return fn


@behaviour
def low_latency_in_every_form(buf, world, rank):
    """bf16, fp8 with amax scales, fp8 with UE8M0 scales; with and without the receive hook."""
    for use_fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False),
                                        (True, True, True)):
        for hook in (False, True):
            check_low_latency(buf, world, rank, use_fp8, round_scale, ue8m0, hook)


def _counting_shapes(buf):
    """The shapes the C++ base asks the Buffer's Python for (_ll_shape: a shape's AllToAll and
    output sets), as it asks: nothing else of a low-latency call is Python's."""
    asked = []
    ask = buf._ll_shape
    buf._ll_shape = lambda *a: (asked.append(a[1:]), ask(*a))[1]
    return asked


@behaviour
def low_latency_common_calls_run_in_cpp(buf, world, rank):
    """Rounds of the common calls for each form (power-of-two scales too), with and without the
    hooks, the fourth with expert counters, the last with its arguments by position: all of it
    in C++, which asks the Buffer's Python at most once per shape for the AllToAll and output
    sets (bf16 rows, e4m3 rows: two; none where an earlier behaviour of the same Buffer made
    them) and never again."""
    asked = _counting_shapes(buf)
    for use_fp8, round_scale in ((False, False), (True, False), (True, True)):
        for r in range(5):
            check_low_latency(buf, world, rank, use_fp8, round_scale, False, r % 2 == 1,
                              common=True, round=r, positional=r == 4, counters=r == 3)
    assert len(asked) <= 2, asked


@behaviour
def low_latency_handle_is_v1s_tuple(buf, world, rank):
    """The low-latency handle is V1's tuple: (src_info, layout_range, m, hidden, num_experts).
    For each local expert and sender, layout_range's (first row << 32) | rows names that
    sender's rows in the expert's block (senders in rank order), and src_info gives each row's
    token index in its sender: the rows there are the sender's rows of those tokens, in token
    order. Combined through the tuple, and refused once combined."""
    e = EXPERTS_PER_RANK * world
    x, idx, w = inputs(world, rank)
    recv, count, handle, _, _ = buf.low_latency_dispatch(dv(x), dv(idx), MAX_TOKENS, e,
                                                         use_fp8=False)
    assert type(handle).__name__ == "LowLatencyHandle" and isinstance(handle, tuple)
    assert len(handle) == 5 and handle[2:] == (MAX_TOKENS, HIDDEN, e), handle[2:]
    src_info, layout_range = hv(handle[0]), hv(handle[1])
    assert src_info.dtype == torch.int32 and tuple(src_info.shape) == (
        EXPERTS_PER_RANK, world * MAX_TOKENS)
    assert layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (
        EXPERTS_PER_RANK, world)
    recv = hv(recv)
    for le in range(EXPERTS_PER_RANK):
        first = 0
        for s in range(world):
            sx, sidx, _ = inputs(world, s)
            tokens = [t for t in range(sx.shape[0]) for j in range(K)
                      if int(sidx[t, j]) == rank * EXPERTS_PER_RANK + le]
            packed = int(layout_range[le, s])
            assert (packed >> 32, packed & 0xFFFFFFFF) == (first, len(tokens)), (le, s, packed)
            rows = slice(first, first + len(tokens))
            assert src_info[le, rows].tolist() == tokens, (le, s)
            if tokens:
                assert torch.equal(recv[le, rows].view(torch.int16),
                                   sx[tokens].view(torch.int16))
            first += len(tokens)
        assert first == int(hv(count)[le])
    buf.low_latency_combine(dv(torch.zeros_like(recv)), dv(idx), dv(w), handle)
    expect_error(ferry.InvalidArgument, "combined already", buf.low_latency_combine,
                 dv(torch.zeros_like(recv)), dv(idx), dv(w), handle)


@behaviour
def low_latency_arguments_checked_once(buf, world, rank):
    """Every bad argument of the low-latency calls refused by the C++ base, naming it, before
    anything is sent or any AllToAll made; the calls then still run (nothing was taken or left
    half done)."""
    x = dv(torch.ones(4, HIDDEN, dtype=torch.bfloat16))
    idx = dv(torch.arange(4 * K, dtype=torch.int64).view(4, K) % (EXPERTS_PER_RANK * world))
    e = EXPERTS_PER_RANK * world
    asked = _counting_shapes(buf)
    bad_dispatch = (
        ("x: dtype", (x.float(), idx, MAX_TOKENS, e), {}),
        ("x: 1 dimensions", (x[0], idx, MAX_TOKENS, e), {}),
        ("x: not contiguous", (x.t(), idx, MAX_TOKENS, e), {}),
        ("x: expected a torch.Tensor", (x.tolist(), idx, MAX_TOKENS, e), {}),
        ("topk_idx: dtype", (x, idx.float(), MAX_TOKENS, e), {}),
        ("topk_idx: 3 rows", (x, idx[:3].contiguous(), MAX_TOKENS, e), {}),
        ("num_max_dispatch_tokens_per_rank: an int", (x, idx, float(MAX_TOKENS), e), {}),
        ("num_max_dispatch_tokens_per_rank 1", (x, idx, 1, e), {}),
        ("num_experts 0", (x, idx, MAX_TOKENS, 0), {}),
        ("use_ue8m0 needs round_scale", (x, idx, MAX_TOKENS, e), {"use_ue8m0": True}),
        ("need use_fp8", (x, idx, MAX_TOKENS, e), {"use_fp8": False, "round_scale": True}),
        ("cumulative_local_expert_recv_stats: dtype", (x, idx, MAX_TOKENS, e),
         {"cumulative_local_expert_recv_stats": dv(torch.zeros(EXPERTS_PER_RANK))}),
        (f"cumulative_local_expert_recv_stats: {EXPERTS_PER_RANK} entries",
         (x, idx, MAX_TOKENS, e),
         {"cumulative_local_expert_recv_stats": dv(torch.zeros(1, dtype=torch.int32))}),
        (f"dispatch_wait_recv_cost_stats: {world + 1} entries", (x, idx, MAX_TOKENS, e),
         {"dispatch_wait_recv_cost_stats": dv(torch.zeros(world + 1, dtype=torch.int64))}),
    )
    for message, args, kwargs in bad_dispatch:
        expect_error(ferry.InvalidArgument, message, buf.low_latency_dispatch, *args, **kwargs)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, e, use_fp8=False)
    y = dv(torch.zeros(EXPERTS_PER_RANK, world * MAX_TOKENS, HIDDEN, dtype=torch.bfloat16))
    ones = dv(torch.ones(idx.shape))
    bad_combine = (
        ("x: shape", (y[:, :1].contiguous(), idx, ones, handle), {}),
        ("x: dtype", (y.float(), idx, ones, handle), {}),
        ("topk_idx / topk_weights: shapes", (y, idx[:1].contiguous(), ones, handle), {}),
        ("topk_weights: dtype", (y, idx, ones.double(), handle), {}),
        ("handle is not one", (y, idx, ones, (1, 2)), {}),
        ("zero_copy: call get_next_low_latency_combine_buffer first", (y, idx, ones, handle),
         {"zero_copy": True}),
        ("out: shape", (y, idx, ones, handle),
         {"out": dv(torch.zeros(1, HIDDEN, dtype=torch.bfloat16))}),
        ("combine_wait_recv_cost_stats: dtype", (y, idx, ones, handle),
         {"combine_wait_recv_cost_stats": dv(torch.zeros(world))}),
    )
    for message, args, kwargs in bad_combine:
        expect_error(ferry.InvalidArgument, message, buf.low_latency_combine, *args, **kwargs)
    expect_error(ferry.Unimplemented, "use_logfmt=True", buf.low_latency_combine, y, idx, ones,
                 handle, use_logfmt=True)
    buf.low_latency_combine(y, idx, ones, handle)
    assert len(asked) <= 1, asked  # the one good dispatch's shape, unless made before


@behaviour
def low_latency_overlapped_and_zero_copy(buf, world, rank):
    check_overlapped_and_zero_copy(buf, world, rank)


@behaviour
def low_latency_any_multiple_of_16_columns(buf, world, rank):
    """bf16 rows of any multiple of 16 columns (one shape, asked for at most once)."""
    asked = _counting_shapes(buf)
    for r in range(4):
        check_low_latency(buf, world, rank, False, False, False, r % 2 == 1, common=True,
                          round=r, hidden=48)
    assert len(asked) <= 1, asked


@behaviour
def normal_mode_bf16_and_fp8(buf, world, rank):
    check_normal(buf, world, rank, fp8=False)
    check_normal(buf, world, rank, fp8=True)
    check_normal(buf, world, rank, fp8=False, hidden=48)  # bf16: any multiple of 16


@behaviour
def normal_mode_worst_tokens(buf, world, rank):
    check_worst_tokens(buf, world, rank)


@behaviour
def normal_mode_rank_routing(buf, world, rank):
    check_rank_routing(buf, world, rank)


@behaviour
def refusals_name_what_is_not_honoured(buf, world, rank):
    """Bad arguments, DeepEP signatures not matched, a handle combined twice, a destroyed
    Buffer (last: it destroys the Buffer)."""
    x, idx, _ = inputs(world, rank)
    x, idx = dv(x), dv(idx)
    e = EXPERTS_PER_RANK * world
    expect_error(ferry.InvalidArgument, "num_max_dispatch_tokens_per_rank",
                 buf.low_latency_dispatch, dv(torch.zeros(MAX_TOKENS + 1, HIDDEN,
                                                          dtype=torch.bfloat16)),
                 dv(torch.zeros(MAX_TOKENS + 1, K, dtype=torch.int64)), MAX_TOKENS, e)
    expect_error(ferry.InvalidArgument, "use_ue8m0 needs round_scale",
                 buf.low_latency_dispatch, x, idx, MAX_TOKENS, e, use_ue8m0=True)
    expect_error(ferry.InvalidArgument, "dispatch_wait_recv_cost_stats",
                 buf.low_latency_dispatch, x, idx, MAX_TOKENS, e,
                 dispatch_wait_recv_cost_stats=dv(torch.zeros(world, dtype=torch.int32)))
    expect_error(ferry.InvalidArgument, "dtype", buf.low_latency_dispatch, x.float(), idx,
                 MAX_TOKENS, e)
    # A call that does not match DeepEP's signature raises Python's TypeError.
    for args, kwargs in (((x, idx, MAX_TOKENS), {}), ((x, idx, MAX_TOKENS, e), {"x": x}),
                         ((x, idx, MAX_TOKENS, e), {"use_fp9": True}),
                         ((x, idx, MAX_TOKENS, e) + (False,) * 8, {})):
        expect_error(TypeError, "Buffer.low_latency_dispatch()", buf.low_latency_dispatch,
                     *args, **kwargs)
    expect_error(ferry.InvalidArgument, "enable_shrink",
                 buf.low_latency_update_mask_buffer, 0, True)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, e, use_fp8=False)
    y = dv(torch.zeros(EXPERTS_PER_RANK, world * MAX_TOKENS, HIDDEN, dtype=torch.bfloat16))
    ones = dv(torch.ones(idx.shape))
    expect_error(ferry.InvalidArgument, "shape", buf.low_latency_combine,
                 y[:, :1].contiguous(), idx, ones, handle)
    buf.low_latency_combine(y, idx, ones, handle)
    expect_error(ferry.InvalidArgument, "combined already", buf.low_latency_combine, y, idx,
                 ones, handle)
    # A shape the C++ path took (this bf16 one, many times above) refused once destroyed.
    for r in range(3):
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, e, use_fp8=False)
        if r < 2:
            buf.low_latency_combine(y, idx, ones, handle)
    buf.destroy()
    expect_error(ferry.InvalidArgument, "destroyed", buf.low_latency_dispatch, x, idx,
                 MAX_TOKENS, e, use_fp8=False)
    expect_error(ferry.InvalidArgument, "destroyed", buf.low_latency_combine, y, idx, ones,
                 handle)


def deep_ep_body(world, group_kind, only=None):
    """A rank's body: one Buffer over `group_kind`, then every behaviour in order (or `only`
    that one)."""
    def body(b, store):
        from ferry import deep_ep
        group = group_of(b, store, group_kind)
        buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 22, num_rdma_bytes=0,
                             low_latency_mode=True, explicitly_destroy=True)
        assert buf.group_size == world and buf.rank == b.rank
        for name, check in BEHAVIOURS.items():
            if only is None or name == only:
                check(buf, world, b.rank)
        if not buf._destroyed:
            buf.destroy()
    return body


DEEP_EP_SHIM_CHECK = """
import importlib.util, sys, torch
import ferry, ferry.deep_ep
assert "deep_ep" not in sys.modules
import deep_ep
from deep_ep import Buffer, Config
from deep_ep.utils import EventHandle, EventOverlap
assert importlib.util.find_spec("deep_ep") is not None  # how vLLM asks
assert Buffer is ferry.deep_ep.Buffer and EventOverlap is ferry.deep_ep.EventOverlap
assert Config is ferry.deep_ep.Config and EventHandle is ferry.deep_ep.EventHandle
with EventOverlap(EventHandle()):  # as Megatron's callers wait for one; no CUDA here: no event
    pass
b = ferry.CallbackBootstrap(0, 1, lambda data, timeout: [data])
buf = deep_ep.Buffer(b, ranks_per_node=1, explicitly_destroy=True)
x = torch.randn(3, 128).to(torch.bfloat16)
idx = torch.tensor([[1], [0], [1]])
recv_x, count, handle, event, hook = buf.low_latency_dispatch(x, idx, 4, 2, use_fp8=False)
assert count.tolist() == [1, 2], count
out, event, hook = buf.low_latency_combine(recv_x, idx, torch.ones(3, 1), handle)
assert torch.equal(out, x)
buf.destroy()
print("shim ok")
"""


class DeepEpTest(Behaviours, Case):
    body_of = staticmethod(deep_ep_body)
    behaviours = BEHAVIOURS

    def test_low_latency_in_every_form(self):
        self.in_every_world("low_latency_in_every_form")

    def test_low_latency_common_calls_run_in_cpp(self):
        self.in_every_world("low_latency_common_calls_run_in_cpp")

    def test_low_latency_handle_is_v1s_tuple(self):
        self.in_every_world("low_latency_handle_is_v1s_tuple")

    def test_low_latency_arguments_checked_once(self):
        self.in_every_world("low_latency_arguments_checked_once")

    def test_low_latency_overlapped_and_zero_copy(self):
        self.in_every_world("low_latency_overlapped_and_zero_copy")

    def test_low_latency_any_multiple_of_16_columns(self):
        self.in_every_world("low_latency_any_multiple_of_16_columns")

    def test_normal_mode_bf16_and_fp8(self):
        self.in_every_world("normal_mode_bf16_and_fp8")

    def test_normal_mode_worst_tokens(self):
        self.in_every_world("normal_mode_worst_tokens")

    def test_normal_mode_rank_routing(self):
        self.in_every_world("normal_mode_rank_routing")

    def test_refusals_name_what_is_not_honoured(self):
        self.in_every_world("refusals_name_what_is_not_honoured")


    def test_normal_mode_handle_across_nodes_is_v1s_internode_tuple(self):
        """Four ranks as two nodes of two: the normal-mode handle is V1's internode tuple, its
        received rows per sender and per node (inclusive prefix sums, senders in rank order)
        exact; under node-once forwarding, whose rows come from forwarders, those are not kept
        and say so when used."""
        def body(b, store):
            from ferry import deep_ep
            world, e = 4, EXPERTS_PER_RANK * 4
            x, idx, w = inputs(world, b.rank)
            want = [0] * world  # rows from each sender
            for s in range(world):
                _, sidx, _ = inputs(world, s)
                want[s] = sum(1 for t in range(sidx.shape[0]) if any(
                    int(v) >= 0 and int(v) // EXPERTS_PER_RANK == b.rank for v in sidx[t]))
            for forwarding in (ferry.Forwarding.PER_RANK, ferry.Forwarding.NODE_ONCE):
                buf = deep_ep.Buffer(b, num_nvl_bytes=1 << 22, ranks_per_node=2,
                                     forwarding=forwarding, explicitly_destroy=True)
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
                recv, _, _, _, handle, _ = buf.dispatch(
                    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
                assert isinstance(handle, tuple) and len(handle) == 10
                assert handle[0] is in_rank
                rdma, gbl = handle[4], handle[6]
                if forwarding == ferry.Forwarding.PER_RANK:
                    sums = torch.tensor(want).cumsum(0)
                    assert gbl.tolist() == sums.tolist(), (gbl, want)
                    assert rdma.tolist() == sums[1::2].tolist(), (rdma, want)
                    assert gbl.dtype == rdma.dtype == torch.int32
                    buf.combine(torch.zeros(recv.shape[0], HIDDEN, dtype=torch.bfloat16),
                                handle)
                    # Without the wait for the count (num_worst_tokens): the same sums.
                    recv, _, _, _, handle, _ = buf.dispatch(
                        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                        num_worst_tokens=world * MAX_TOKENS)
                    assert handle[6].tolist() == sums.tolist(), (handle[6], want)
                    assert handle[4].tolist() == sums[1::2].tolist(), (handle[4], want)
                else:
                    expect_error(ferry.Unimplemented, "recv_gbl_rank_prefix_sum",
                                 lambda: gbl.shape)
                expect_error(ferry.Unimplemented, "send_nvl_head", lambda: handle[9][0])
                buf.combine(torch.zeros(recv.shape[0], HIDDEN, dtype=torch.bfloat16), handle)
                buf.destroy()
        self.ranks(4, body, timeout=240.0)

    def test_the_shim_package_on_pythonpath(self):
        """With ferry.deep_ep.shim_path() on PYTHONPATH, `import deep_ep` (and deep_ep.utils)
        gives ferry's, vLLM's find_spec sees it, and a Buffer made through it moves rows."""
        from ferry import deep_ep
        run_with_shim(self, deep_ep.shim_path(), DEEP_EP_SHIM_CHECK)

    def test_topk_weights_passed_by_one_rank_alone_fail_there_at_the_deadline(self):
        """combine(topk_weights=...) is collective (its weights take a second AllToAll): once
        both ranks have combined weights, a rank that passes them while its peer does not gets
        DeadlineExceeded within the Buffer's timeout, not a hang; the peer's combine returns
        its rows and no weights."""
        def body(b, store):
            from ferry import deep_ep
            buf = deep_ep.Buffer(b, num_nvl_bytes=1 << 22, ranks_per_node=1, timeout=1.0,
                                 explicitly_destroy=True)
            x, idx, w = inputs(2, b.rank)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx,
                                                                          EXPERTS_PER_RANK * 2)
            for both in (True, False):
                recv, _, recv_w, _, handle, _ = buf.dispatch(
                    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
                if both:
                    _, weights, _ = buf.combine(recv, handle, topk_weights=recv_w)
                    assert torch.equal(weights, torch.where(idx >= 0, w, torch.zeros_like(w)))
                elif b.rank == 0:
                    start = time.monotonic()
                    expect_error(ferry.DeadlineExceeded, "topk_weights (their AllToAll",
                                 buf.combine, recv, handle, topk_weights=recv_w)
                    assert time.monotonic() - start < 10.0, time.monotonic() - start
                else:
                    out, weights, _ = buf.combine(recv, handle)
                    assert weights is None and out.shape == x.shape
            b.all_gather(b"", 30.0)  # the peer's buffers kept until rank 0's deadline passed
            buf.destroy()
        self.ranks(2, body)
