"""ferry.deep_ep, ferry.pplx and ferry.pplx_kernels on the host device (torch CPU tensors), each
call checked against a plain torch reference written here: random bf16 rows, ids with -1,
tokens with several experts on one rank, a rank with no tokens, world sizes 1, 2 and 4, with and
without the receive hooks, over a torch.distributed gloo group and over ferry's own bootstrap.

Every rank regenerates every rank's inputs from (seed, rank), so each checks what it received on
its own. The experts multiply their rows by a power of two; dispatched rows are compared
exactly (fp8 against a quantiser written here), the combine's weighted sums within bf16's
rounding of a float64 reference."""

import os
import tempfile
import time
import unittest

import ferry
from ranks import expect_error, run_ranks

try:
    import torch
except ImportError:  # the bindings' other tests run without torch
    torch = None

HIDDEN, EXPERTS_PER_RANK, K, MAX_TOKENS = 512, 4, 4, 12
DEV = "cpu"  # where the layers' tensors live (test_engine_api_cuda sets "cuda" in its ranks)


def dv(t):
    return t.to(DEV)


def hv(t):
    return t.cpu()


def fp8_dtype():
    return getattr(torch, "float8_e4m3fn", torch.uint8)


def tokens_of(world, rank):
    """Rank 1 sends nothing (when there are two ranks or more); the others differ."""
    return 0 if (world > 1 and rank == 1) else (5 + 3 * rank) % MAX_TOKENS + 1


def inputs(world, rank, round=0, columns=HIDDEN):
    """Rank's rows (random bf16, each 128-column group of its own magnitude) and top-k ids: -1
    in some entries, and a token whose ids include two experts of one rank; `round` draws
    another set of the same shapes; `columns` keeps the rows' first columns only."""
    g = torch.Generator().manual_seed(1000 + rank + 7919 * round)
    t, e = tokens_of(world, rank), EXPERTS_PER_RANK * world
    scale = 2.0 ** torch.arange(-3, HIDDEN // 128 - 3, dtype=torch.float32).repeat_interleave(128)
    x = (torch.randn(t, HIDDEN, generator=g) * scale).to(torch.bfloat16)
    rows = []
    for i in range(t):
        perm = torch.randperm(e, generator=g).tolist()
        if i == 0:  # two experts of rank 0 first
            perm = [0, 1] + [v for v in perm if v not in (0, 1)]
        rows.append(perm[:K])
    idx = torch.tensor(rows, dtype=torch.int64).view(t, K)
    idx[1::3, K - 1] = -1
    w = torch.rand(t, K, generator=g).to(torch.float32)
    return x[:, :columns].contiguous(), idx.to(torch.int64), w


def expert_factor(global_expert):
    return 2.0 ** (global_expert % 3 - 1)


def weighted_reference(x, idx, w, dtype=torch.bfloat16):
    """Each token's sum over its experts of weight * factor * row, in float64, to bf16 (or
    dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            if e >= 0:
                out[t] += float(w[t, j]) * expert_factor(e) * x[t].double()
    return out.to(dtype)


# ---- fp8, as a reference independent of ferry's: torch ops on float32 --------------------------

E4M3 = None


def e4m3_table():
    """The 256 e4m3fn codes' values (NaN for 0x7F / 0xFF)."""
    global E4M3
    if E4M3 is None:
        values = []
        for q in range(256):
            sign = -1.0 if q & 0x80 else 1.0
            exp, man = (q >> 3) & 0xF, q & 7
            if exp == 0xF and man == 7:
                values.append(float("nan"))
            elif exp == 0:
                values.append(sign * man * 2.0 ** -9)
            else:
                values.append(sign * (1 + man / 8) * 2.0 ** (exp - 7))
        E4M3 = torch.tensor(values, dtype=torch.float32)
    return E4M3


def quantize_reference(x, power_of_two):
    """(values e4m3 holds for x / scale, scales) per 128-column group: scale = max(amax, 1e-4) /
    448, rounded up to a power of two if asked; values rounded to nearest even on e4m3's grid."""
    v = x.float().view(x.shape[0], x.shape[1] // 128, 128)
    amax = v.abs().amax(dim=2, keepdim=True).clamp(min=1e-4)
    s = amax / 448.0
    if power_of_two:
        s = torch.where(torch.frexp(s).mantissa == 0.5, s,
                        torch.ldexp(torch.ones_like(s), torch.frexp(s).exponent))
    y = (v / s).clamp(-448, 448)
    _, e = torch.frexp(y)
    step = torch.ldexp(torch.ones_like(y), torch.clamp(e - 4, min=-9))  # 3 mantissa bits
    q = torch.round(y / step) * step  # torch.round: half to even
    return q.view(x.shape), s.view(x.shape[0], x.shape[1] // 128)


def decode_e4m3(t):
    return e4m3_table()[t.view(torch.uint8).long()]


# ---- ranks ---------------------------------------------------------------------------------------

def gloo(b, path, backend="gloo"):
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"file://{path}", rank=b.rank,
                            world_size=b.world_size)
    return dist.group.WORLD


def group_of(b, path, kind):
    """The group a layer is given: a torch.distributed group ("gloo", or "nccl": the rank's
    CUDA device must be set) or ferry's own bootstrap ("ferry")."""
    return gloo(b, path, kind) if kind in ("gloo", "nccl") else b


def rows_of(t):
    return sorted(tuple(r.view(torch.int16).tolist()) for r in t)


class Case(unittest.TestCase):
    def setUp(self):
        if torch is None:
            self.skipTest("no torch for this interpreter")
        os.environ.setdefault("FERRY_PROVIDER", "shm")
        # Unique ids name loopback's address: rendezvous traffic stays on this host.
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")

    def ranks(self, world, body, timeout=120.0):
        with tempfile.TemporaryDirectory() as d:
            run_ranks(self, world, lambda b: (torch.set_num_threads(1),
                                              body(b, os.path.join(d, "store")))[1], timeout)


# ---- deep_ep -------------------------------------------------------------------------------------

def check_low_latency(buf, world, rank, use_fp8, round_scale, use_ue8m0, hook, common=False,
                      round=0, hook_stream=None, positional=False, counters=None,
                      hidden=HIDDEN):
    """One low-latency dispatch and combine against the references. common: the calls an
    engine's decode step makes (the combine into an `out` of its own, by default no expert
    counters), which the Buffer runs in C++ from a shape's third dispatch on. hook_stream
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


def check_normal(buf, world, rank, fp8, hidden=HIDDEN):
    x, idx, w = inputs(world, rank, columns=hidden)
    e = EXPERTS_PER_RANK * world
    layout = buf.get_dispatch_layout(dv(idx), e)
    per_rank, per_rdma, per_expert, in_rank = hv(layout[0]), layout[1], hv(layout[2]), hv(
        layout[3])
    # The layout against its definition.
    want_in_rank = torch.zeros(x.shape[0], world, dtype=torch.bool)
    want_per_expert = torch.zeros(e, dtype=torch.int32)
    for t in range(x.shape[0]):
        for j in range(K):
            if int(idx[t, j]) >= 0:
                want_in_rank[t, int(idx[t, j]) // EXPERTS_PER_RANK] = True
                want_per_expert[int(idx[t, j])] += 1
    assert per_rdma is None
    assert torch.equal(in_rank, want_in_rank) and torch.equal(per_expert, want_per_expert)
    assert torch.equal(per_rank, want_in_rank.sum(0).int())
    if fp8:
        q, s = quantize_reference(x, False)
        table = e4m3_table()
        codes = (q[..., None] == table[None, None, :]).float().argmax(-1).to(torch.uint8)
        xin = (dv(codes).view(fp8_dtype()), dv(s.contiguous()))
    else:
        xin = dv(x)
    recv, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
        xin, num_tokens_per_rank=dv(per_rank), is_token_in_rank=dv(in_rank),
        num_tokens_per_expert=dv(per_expert), topk_idx=dv(idx), topk_weights=dv(w),
        expert_alignment=4)
    recv_x = hv(recv[0] if fp8 else recv)
    recv_idx, recv_w = hv(recv_idx), hv(recv_w)
    # DeepEP's order: every sender's tokens in rank order, each sender's in token order; the
    # ids local to this rank (-1 for others'), their weights (0 for others').
    want_x, want_idx, want_w = [], [], []
    counts = [0] * EXPERTS_PER_RANK
    for s in range(world):
        sx, sidx, sw = inputs(world, s, columns=hidden)
        for t in range(sx.shape[0]):
            mine = [(j, int(sidx[t, j]) - rank * EXPERTS_PER_RANK) for j in range(K)
                    if int(sidx[t, j]) // EXPERTS_PER_RANK == rank and int(sidx[t, j]) >= 0]
            if not mine:
                continue
            want_x.append(quantize_reference(sx[t][None], False)[0][0] if fp8 else sx[t])
            ids, ws = [-1] * K, [0.0] * K
            for j, le in mine:
                ids[j], ws[j] = le, float(sw[t, j])
                counts[le] += 1
            want_idx.append(ids)
            want_w.append(ws)
    n = len(want_x)
    assert recv_x.shape == (n, hidden), (recv_x.shape, n)
    if fp8:
        assert torch.equal(decode_e4m3(recv_x), torch.stack(want_x) if n else
                           torch.empty(0, hidden))
    else:
        assert torch.equal(recv_x.view(torch.int16), torch.stack(want_x).view(torch.int16)
                           if n else torch.empty(0, hidden, dtype=torch.int16))
    assert recv_idx.dtype == torch.int64
    assert recv_idx.tolist() == want_idx and recv_w.tolist() == want_w
    assert per_expert_list == [(c + 3) // 4 * 4 for c in counts], (per_expert_list, counts)
    # Combine: every rank returns twice its rows; each token comes back as twice itself times
    # the number of ranks that held any of its experts.
    if fp8:  # the fp8 dispatch's combine is the bf16 one's (combine moves bf16 rows)
        buf.combine(dv(torch.zeros(n, hidden, dtype=torch.bfloat16)), handle)
        return
    back = x.double()
    out, weights_back, _ = buf.combine(dv((recv_x.double() * 2).to(torch.bfloat16)), handle)
    out = hv(out)
    assert weights_back is None
    holders = want_in_rank.sum(1, keepdim=True).double()
    assert torch.equal(out.view(torch.int16),
                       (back * 2 * holders).to(torch.bfloat16).view(torch.int16))
    # A cached dispatch (the handle's routing again), then its combine.
    again, none_idx, none_w, none_list, none_handle, _ = buf.dispatch(dv(x), handle=handle)
    assert none_idx is None and none_w is None and none_list is None and none_handle is None
    assert torch.equal(hv(again).view(torch.int16), recv_x.view(torch.int16))
    # With a bias (x / 2, exact in bf16), added before the rows.
    out2, _, _ = buf.combine(again, handle, bias=dv((x.double() / 2).to(torch.bfloat16)))
    out2 = hv(out2)
    assert torch.equal(out2.view(torch.int16),
                       (back * (holders + 0.5)).to(torch.bfloat16).view(torch.int16))
    # Refused: a handle combined already -- also once another dispatch has taken its AllToAll
    # (the handle's own state says so, not the AllToAll's) -- and top-k weights whose rows are
    # not the dispatch's.
    expect_error(ferry.InvalidArgument, "combined already", buf.combine, again, handle)
    other = buf.dispatch(dv(x), num_tokens_per_rank=dv(per_rank), is_token_in_rank=dv(in_rank),
                         num_tokens_per_expert=dv(per_expert), topk_idx=dv(idx),
                         topk_weights=dv(w))
    expect_error(ferry.InvalidArgument, "combined already", buf.combine, again, handle)
    expect_error(ferry.InvalidArgument, f"topk_weights: {n + 1} rows, the dispatch received",
                 buf.combine, other[0], other[4], topk_weights=dv(torch.zeros(n + 1, K)))
    # The combine's top-k weights: each token's rows summed over the ranks that got it. A rank
    # got a token's weights at the columns of its own experts and zeros elsewhere, so twice
    # them sum to twice the token's weights (0 where its id is -1); a column of ones sums to
    # the number of ranks that held the token. async_finish: the event covers both sums.
    given = torch.cat([recv_w * 2, torch.ones(n, 1)], 1).contiguous()
    out4, summed, event = buf.combine(dv(recv_x), other[4], topk_weights=dv(given),
                                      async_finish=True)
    event.current_stream_wait()
    assert summed.dtype == torch.float32 and summed.is_contiguous()
    want_sums = torch.cat([torch.where(idx >= 0, w * 2, torch.zeros_like(w)),
                           holders.float()], 1)
    assert torch.equal(hv(summed), want_sums), (hv(summed), want_sums)
    assert torch.equal(hv(out4).view(torch.int16),
                       (back * holders).to(torch.bfloat16).view(torch.int16))
    other = buf.dispatch(dv(x), num_tokens_per_rank=dv(per_rank), is_token_in_rank=dv(in_rank),
                         num_tokens_per_expert=dv(per_expert), topk_idx=dv(idx),
                         topk_weights=dv(w))
    expect_error(ferry.InvalidArgument, "bias: shape", buf.combine, other[0], other[4],
                 bias=dv(torch.zeros(x.shape[0] + 1, hidden, dtype=torch.bfloat16)))
    # Two biases (x / 2 and x / 4): their fp32 sum rounded to bf16 once, then the rows added.
    halves = (dv((x.double() / 2).to(torch.bfloat16)), dv((x.double() / 4).to(torch.bfloat16)))
    out3, _, _ = buf.combine(other[0], other[4], bias=halves)
    start = (x.double() * 0.75).to(torch.bfloat16).double()
    assert torch.equal(hv(out3).view(torch.int16),
                       (start + back * holders).to(torch.bfloat16).view(torch.int16))


def check_rank_routing(buf, world, rank):
    """A normal-mode dispatch without topk_idx, routed by is_token_in_rank alone as DeepEP's
    is (after previous_event, async_finish): the rows and their order as with the ids, no ids
    or weights back, each local expert's count from every rank's num_tokens_per_expert; its
    combine (with top-k weights too) and a cached dispatch as with ids; then what it
    refuses."""
    x, idx, w = inputs(world, rank, round=3)
    e = EXPERTS_PER_RANK * world
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(dv(idx), e)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    from ferry.deep_ep import EventHandle, EventOverlap
    recv, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
        dv(x), expert_alignment=2, previous_event=EventOverlap(EventHandle()), async_finish=True,
        **layout)
    event.current_stream_wait()
    assert recv_idx is None and recv_w is None
    want_x, counts = [], [0] * EXPERTS_PER_RANK
    for s in range(world):
        sx, sidx, _ = inputs(world, s, round=3)
        for t in range(sx.shape[0]):
            mine = [int(v) - rank * EXPERTS_PER_RANK for v in sidx[t]
                    if int(v) >= 0 and int(v) // EXPERTS_PER_RANK == rank]
            if mine:
                want_x.append(sx[t])
            for le in mine:
                counts[le] += 1
    n = len(want_x)
    want = torch.stack(want_x) if n else torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    assert torch.equal(hv(recv).view(torch.int16), want.view(torch.int16))
    assert per_expert_list == [(c + 1) // 2 * 2 for c in counts], (per_expert_list, counts)
    holders = hv(in_rank).sum(1, keepdim=True)
    out, none_w, _ = buf.combine(recv, handle)
    assert none_w is None
    assert torch.equal(hv(out).view(torch.int16),
                       (x.double() * holders).to(torch.bfloat16).view(torch.int16))
    again = buf.dispatch(dv(x), handle=handle)[0]
    assert torch.equal(hv(again).view(torch.int16), want.view(torch.int16))
    _, summed, _ = buf.combine(again, handle, topk_weights=dv(torch.ones(n, 3)))
    assert torch.equal(hv(summed), holders.float().expand(-1, 3))
    expect_error(ferry.InvalidArgument, "topk_weights: given without topk_idx", buf.dispatch,
                 dv(x), topk_weights=dv(w), **layout)
    expect_error(ferry.InvalidArgument, "needs topk_idx", buf.dispatch, dv(x),
                 num_worst_tokens=4, **layout)
    expect_error(ferry.InvalidArgument, "is_token_in_rank: shape", buf.dispatch, dv(x),
                 num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                 is_token_in_rank=dv(torch.zeros(x.shape[0], world + 1, dtype=torch.bool)))


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


def check_worst_tokens(buf, world, rank):
    """A normal-mode dispatch with num_worst_tokens: that many rows, no host wait, and the rows
    past those received hold no token (ids -1, weights 0); async_finish's event then waited."""
    x, idx, w = inputs(world, rank)
    e = EXPERTS_PER_RANK * world
    layout = buf.get_dispatch_layout(dv(idx), e)
    worst = world * MAX_TOKENS
    recv, recv_idx, recv_w, per_expert, handle, event = buf.dispatch(
        dv(x), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2], topk_idx=dv(idx), topk_weights=dv(w),
        num_worst_tokens=worst, async_finish=True, previous_event=layout[4])
    event.current_stream_wait()
    assert per_expert == [] and recv.shape[0] == worst and recv_idx.shape[0] == worst
    got = sum(1 for s in range(world) for sx, sidx, _ in [inputs(world, s)]
              for t in range(sx.shape[0])
              if any(int(v) >= 0 and int(v) // EXPERTS_PER_RANK == rank for v in sidx[t]))
    assert bool((hv(recv_idx)[:got] >= 0).any(dim=1).all()), "a received row without an expert"
    assert bool((hv(recv_idx)[got:] == -1).all()) and not hv(recv_w)[got:].any()
    # All num_worst_tokens rows back, as DeepEP takes them, after an event made as DeepEP's
    # callers make one (deep_ep.utils.EventHandle: the current stream, recorded now).
    from ferry.deep_ep import EventHandle, EventOverlap
    out, _, _ = buf.combine(recv, handle, previous_event=EventOverlap(EventHandle()))
    holders = torch.zeros(x.shape[0], 1, dtype=torch.float64)
    for t in range(x.shape[0]):
        holders[t] = len({int(v) // EXPERTS_PER_RANK for v in idx[t] if int(v) >= 0})
    assert torch.equal(hv(out).view(torch.int16),
                       (x.double() * holders).to(torch.bfloat16).view(torch.int16))


def deep_ep_body(world, group_kind):
    def body(b, store):
        from ferry import deep_ep
        group = group_of(b, store, group_kind)
        buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 22, num_rdma_bytes=0,
                             low_latency_mode=True, explicitly_destroy=True)
        assert buf.group_size == world and buf.rank == b.rank
        for use_fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False),
                                            (True, True, True)):
            for hook in (False, True):
                check_low_latency(buf, world, b.rank, use_fp8, round_scale, ue8m0, hook)
        # Rounds of the common calls for each form (power-of-two scales too), with and without
        # the hooks, the fourth with expert counters, the last with its arguments by position:
        # the third and later of a shape run in C++, the first two in Python (the Buffer's
        # methods the C++ base hands a call it does not take, counted here).
        in_python = []
        for name in ("_low_latency_dispatch", "_low_latency_combine"):
            setattr(buf, name, lambda *a, _f=getattr(buf, name), _n=name, **kw: (
                in_python.append(_n), _f(*a, **kw))[1])
        for use_fp8, round_scale in ((False, False), (True, False), (True, True)):
            for r in range(5):
                if r == 2:
                    before = len(in_python)
                check_low_latency(buf, world, b.rank, use_fp8, round_scale, False, r % 2 == 1,
                                  common=True, round=r, positional=r == 4, counters=r == 3)
            assert len(in_python) == before, (use_fp8, round_scale, in_python[before:])
        check_overlapped_and_zero_copy(buf, world, b.rank)
        # bf16 rows of any multiple of 16 columns, the third and later calls of the shape in C++.
        for r in range(4):
            if r == 2:
                before = len(in_python)
            check_low_latency(buf, world, b.rank, False, False, False, r % 2 == 1, common=True,
                              round=r, hidden=48)
        assert len(in_python) == before, in_python[before:]
        check_normal(buf, world, b.rank, fp8=False)
        check_normal(buf, world, b.rank, fp8=True)
        check_normal(buf, world, b.rank, fp8=False, hidden=48)  # bf16: any multiple of 16
        check_worst_tokens(buf, world, b.rank)
        check_rank_routing(buf, world, b.rank)
        # Refusals name what is not honoured.
        x, idx, _ = inputs(world, b.rank)
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
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, e, use_fp8=False)
        buf.destroy()
        expect_error(ferry.InvalidArgument, "destroyed", buf.low_latency_dispatch, x, idx,
                     MAX_TOKENS, e, use_fp8=False)
        expect_error(ferry.InvalidArgument, "destroyed", buf.low_latency_combine, y, idx, ones,
                     handle)
    return body


class Worlds:
    """World sizes 1, 2 and 4 of a layer's body (body_of(world, group kind)), over ferry's
    bootstrap and over gloo."""

    def test_world_1_over_ferrys_bootstrap(self):
        self.ranks(1, self.body_of(1, "ferry"))

    def test_world_2_over_gloo(self):
        self.ranks(2, self.body_of(2, "gloo"))

    def test_world_4_over_ferrys_bootstrap(self):
        self.ranks(4, self.body_of(4, "ferry"), timeout=240.0)


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


class DeepEpTest(Worlds, Case):
    body_of = staticmethod(deep_ep_body)

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


# ---- pplx ---------------------------------------------------------------------------------------

PADDING = 4


def padded_blocks(out_x, counts, rank, world, m=None, senders=None):
    """Checks each expert's block of out_x against the rows routed to it (senders' first m
    tokens only, if given; senders: the ranks whose inputs were sent, all by default), its
    padding rows zero; returns expert outputs in the same layout: each row times its expert's
    factor."""
    start, y = 0, torch.zeros_like(out_x)
    senders = range(world) if senders is None else senders
    for le in range(EXPERTS_PER_RANK):
        g = rank * EXPERTS_PER_RANK + le
        want = [sx[t] for s in senders for sx, sidx, _ in [inputs(world, s)]
                for t in range(sx.shape[0] if m is None else min(m, sx.shape[0]))
                for j in range(K) if int(sidx[t, j]) == g]
        n = int(counts[le])
        assert n == len(want), (rank, le, n, len(want))
        assert rows_of(out_x[start:start + n]) == rows_of(want), (rank, le)
        end = start + (n + PADDING - 1) // PADDING * PADDING
        assert not out_x[start + n:end].view(torch.int16).any(), "padding rows written"
        y[start:start + n] = (out_x[start:start + n].double() * expert_factor(g)).to(
            torch.bfloat16)
        start = end
    return y


def pplx_body(world, group_kind):
    def body(b, store):
        from ferry import pplx
        group = group_of(b, store, group_kind)
        e = EXPERTS_PER_RANK * world
        a2a = pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=e, expert_padding=PADDING,
                            hidden_dim=HIDDEN, hidden_dim_scale=None, in_dtype=torch.bfloat16,
                            out_dtype=torch.bfloat16, scale_dtype=None, num_experts_per_token=K,
                            nets_per_gpu=1, max_private_tokens=None, device=torch.device(DEV),
                            dp_group=None, node_group=None, global_group=group)
        x, idx, w = inputs(world, b.rank)
        dx, ids, dw = dv(x), dv(idx.to(torch.int32)), dv(w)
        rows = a2a.max_recv_tokens
        for split in (False, True):
            counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
            out_x = dv(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16))
            if split:
                a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_recv=False)
                expect_error(ferry.FailedPrecondition, "out of order", a2a.combine,
                             torch.empty_like(dx), ids, dw, out_x)
                a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_send=False)
            else:
                a2a.dispatch(counts, out_x, None, dx, None, ids, dw)
            y = dv(padded_blocks(hv(out_x), hv(counts), b.rank, world))
            out = torch.empty_like(dx)
            if split:
                a2a.combine(out, ids, dw, y, do_recv=False)
                a2a.combine(out, ids, dw, y, do_send=False)
            else:
                a2a.combine(out, ids, dw, y)
            torch.testing.assert_close(hv(out).float(), weighted_reference(x, idx, w).float(),
                                       rtol=2 ** -7, atol=2 ** -6)
        # bound_m: the first m tokens only; accumulate adds to what out holds.
        m = min(2, x.shape[0])
        bound = dv(torch.tensor([m], dtype=torch.int32))
        counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
        out_x = dv(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16))
        a2a.dispatch(counts, out_x, None, dx, None, ids, dw, bound_m=bound)
        y = dv(padded_blocks(hv(out_x), hv(counts), b.rank, world, m=2))
        out = dv(torch.ones(x.shape[0], HIDDEN, dtype=torch.bfloat16))
        a2a.combine(out, ids, dw, y, bound_m=bound, accumulate=True)
        ref = (weighted_reference(x[:m], idx[:m], w[:m]).double() + 1).to(torch.bfloat16)
        torch.testing.assert_close(hv(out)[:m].float(), ref.float(), rtol=2 ** -7,
                                   atol=2 ** -6)
        expect_error(ferry.InvalidArgument, "dtype", a2a.dispatch, counts, out_x, None,
                     dx.float(), None, ids, dw)
        a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_recv=False)
        expect_error(ferry.InvalidArgument, "max_recv_tokens", a2a.dispatch, counts,
                     out_x[:rows - 1], None, dx, None, ids, dw, do_send=False)
        a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_send=False)
        a2a.combine(torch.empty_like(dx), ids, dw, torch.zeros_like(out_x))
        a2a.destroy()
        check_pplx_fp8(world, b.rank, group)
        check_pplx_fp8(world, b.rank, group, hidden_dim_scale=1)  # per-token scales
        check_pplx_fp8(world, b.rank, group, hidden_dim_scale=8)  # groups of 64 columns
        check_pplx_fp8(world, b.rank, group, hidden_dim_scale=1, row_dtype=torch.int8)  # w8a8
        check_pplx_batched(world, b.rank, group)
        check_pplx_fp32(world, b.rank, group)
        check_pplx_fp32_out(world, b.rank, group)
        check_pplx_fp16(world, b.rank, group)
        # Rows of any multiple of 16 columns in bf16 and fp32 (pplx-garden's tests use 16).
        check_pplx_batched(world, b.rank, group, hidden=48)
        check_pplx_fp32(world, b.rank, group, hidden=16)
    return body


def check_pplx_fp16(world, rank, group):
    """float16 rows through pplx (in_dtype = out_dtype = float16): moved bit for bit into the
    batched layout and summed as fp16 (fp32 sums rounded once: within an fp16 unit of the last
    place of the float64 reference); out_tokens of another dtype than expert_y's refused."""
    from ferry import pplx
    block = MAX_TOKENS * world
    a2a = pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=EXPERTS_PER_RANK * world,
                        expert_padding=1, hidden_dim=HIDDEN, hidden_dim_scale=None,
                        in_dtype=torch.float16, out_dtype=torch.float16, scale_dtype=None,
                        num_experts_per_token=K, device=torch.device(DEV), global_group=group,
                        max_tokens_per_expert=block)
    sent = [(sx.to(torch.float16), sidx, sw)
            for sx, sidx, sw in (inputs(world, s) for s in range(world))]
    x, idx, w = sent[rank]
    dx, ids, dw = dv(x), dv(idx.to(torch.int32)), dv(w)
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, HIDDEN, dtype=torch.float16))
    a2a.dispatch(counts, out_x, None, dx, None, ids, dw)
    got, n = hv(out_x), hv(counts)
    y = torch.zeros_like(got)
    for le, g, c, want in expert_blocks(sent, rank, n):
        assert rows_of(got[le, :c]) == rows_of(want), (rank, le)
        y[le, :c] = (got[le, :c].double() * expert_factor(g)).to(torch.float16)
    expect_error(ferry.InvalidArgument, "expert_y was torch.float16", a2a.combine,
                 dv(torch.empty(x.shape, dtype=torch.bfloat16)), ids, dw, dv(y))
    out = dv(torch.empty(x.shape, dtype=torch.float16))
    a2a.combine(out, ids, dw, dv(y))  # the refused call left the AllToAll where it was
    torch.testing.assert_close(hv(out).double(),
                               weighted_reference(x, idx, w, torch.float16).double(),
                               rtol=2 ** -10, atol=2 ** -14)
    a2a.destroy()


def fp32_inputs(world, rank, columns=HIDDEN):
    """inputs' ids and weights with float32 rows that bf16 cannot hold (each row's bf16 part
    plus a small remainder)."""
    x, idx, w = inputs(world, rank, columns=columns)
    g = torch.Generator().manual_seed(77 + rank)
    fine = x.float() * (1 + torch.rand(x.shape, generator=g) * 2 ** -10)
    return fine, idx, w


def expert_blocks(sent, rank, counts):
    """Per local expert of `rank`: its block, its global id, the copies it received (checked
    against what every rank sent it) and the rows sent to it, in no particular order."""
    for le in range(EXPERTS_PER_RANK):
        g = rank * EXPERTS_PER_RANK + le
        want = [sx[t] for sx, sidx, _ in sent for t in range(sx.shape[0]) for j in range(K)
                if int(sidx[t, j]) == g]
        c = int(counts[le])
        assert c == len(want), (rank, le, c, len(want))
        yield le, g, c, want


def check_pplx_fp32(world, rank, group, hidden=HIDDEN):
    """pplx's float32 configuration (in_dtype = out_dtype = float32, as pplx-garden's tests
    run it): rows arrive bit for bit, in the batched layout, and the combine's sums stay fp32
    (a sum rounded through bf16 would miss by 2^-9 of its size; the tolerance is 2^-20)."""
    from ferry import pplx
    e = EXPERTS_PER_RANK * world
    common = dict(max_num_tokens=MAX_TOKENS, num_experts=e, expert_padding=1, hidden_dim=hidden,
                  hidden_dim_scale=None, in_dtype=torch.float32, out_dtype=torch.float32,
                  scale_dtype=None, num_experts_per_token=K, device=torch.device(DEV),
                  global_group=group)
    expect_error(ferry.Unimplemented, "out_dtype", pplx.AllToAll,
                 **{**common, "out_dtype": torch.bfloat16})
    block = MAX_TOKENS * world
    a2a = pplx.AllToAll(**common, max_tokens_per_expert=block)
    sent = [fp32_inputs(world, s, hidden) for s in range(world)]
    x, idx, w = sent[rank]
    dx, ids, dw = dv(x), dv(idx), dv(w)
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, hidden, dtype=torch.float32))
    expect_error(ferry.InvalidArgument, "dtype", a2a.dispatch, counts, out_x, None,
                 dx.to(torch.bfloat16), None, ids, dw)
    a2a.dispatch(counts, out_x, None, dx, None, ids, dw)
    got, n = hv(out_x), hv(counts)
    y = torch.zeros_like(got)
    bits = lambda rows: sorted(tuple(r.view(torch.int32).tolist()) for r in rows)
    for le, g, c, want in expert_blocks(sent, rank, n):
        assert bits(got[le, :c]) == bits(want), (rank, le)
        assert not got[le, c:].view(torch.int32).any(), "rows past the count written"
        y[le, :c] = got[le, :c] * expert_factor(g)
    out = dv(torch.empty(x.shape, dtype=torch.float32))
    expect_error(ferry.InvalidArgument, "dtype", a2a.combine, out, ids, dw,
                 dv(y.to(torch.bfloat16)))
    a2a.combine(out, ids, dw, dv(y))
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            if int(idx[t, j]) >= 0:
                ref[t] += float(w[t, j]) * expert_factor(int(idx[t, j])) * x[t].double()
    torch.testing.assert_close(hv(out).double(), ref, rtol=2 ** -20, atol=2 ** -30)
    a2a.destroy()


def check_pplx_fp32_out(world, rank, group):
    """bf16 rows combined in fp32 (in_dtype bfloat16, out_dtype float32): the rows arrive as
    sent, expert_y and out_tokens are float32 and the sums are kept in fp32 (within 2^-20 of a
    float64 reference, where bf16 sums would miss by 2^-9)."""
    from ferry import pplx
    e = EXPERTS_PER_RANK * world
    block = MAX_TOKENS * world
    a2a = pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=e, expert_padding=1,
                        hidden_dim=HIDDEN, hidden_dim_scale=None, in_dtype=torch.bfloat16,
                        out_dtype=torch.float32, scale_dtype=None, num_experts_per_token=K,
                        device=torch.device(DEV), global_group=group,
                        max_tokens_per_expert=block)
    sent = [inputs(world, s) for s in range(world)]
    x, idx, w = sent[rank]
    dx, ids, dw = dv(x), dv(idx), dv(w)
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, HIDDEN, dtype=torch.bfloat16))
    a2a.dispatch(counts, out_x, None, dx, None, ids, dw)
    got, n = hv(out_x), hv(counts)
    # Each expert's output in fp32: its rows times the factor plus a remainder bf16 cannot hold.
    y = torch.zeros(got.shape, dtype=torch.float32)
    for le, g, c, want in expert_blocks(sent, rank, n):
        assert rows_of(got[le, :c]) == rows_of(want), (rank, le)
        y[le, :c] = got[le, :c].float() * expert_factor(g) * (1 + 2 ** -12)
    out = dv(torch.empty(x.shape, dtype=torch.float32))
    expect_error(ferry.InvalidArgument, "dtype", a2a.combine, out, ids, dw,
                 dv(y.to(torch.bfloat16)))
    expect_error(ferry.InvalidArgument, "dtype", a2a.combine, dv(torch.empty_like(x)), ids, dw,
                 dv(y))
    a2a.combine(out, ids, dw, dv(y))
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            if int(idx[t, j]) >= 0:
                ref[t] += (float(w[t, j]) * expert_factor(int(idx[t, j])) * (1 + 2 ** -12)
                           * x[t].double())
    torch.testing.assert_close(hv(out).double(), ref, rtol=2 ** -20, atol=2 ** -30)
    a2a.destroy()


def check_pplx_batched(world, rank, group, hidden=HIDDEN):
    """pplx's batched layout (max_tokens_per_expert = b, here one more than the most any expert
    receives, under the worst case): out_expert_x [local experts, b, hidden], expert e's rows
    from row 0 of its block and the rest untouched, expert_y in the same layout; through
    dispatch_async / combine_async and their handles' recv()."""
    from ferry import pplx
    e = EXPERTS_PER_RANK * world
    sent = [inputs(world, s, columns=hidden) for s in range(world)]
    ids_sent = torch.cat([i for _, i, _ in sent])
    most = max(int((ids_sent == g).sum()) for g in range(e))
    block = most + 1
    assert block < MAX_TOKENS * world
    a2a = pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=e, expert_padding=PADDING,
                        hidden_dim=hidden, hidden_dim_scale=None, in_dtype=torch.bfloat16,
                        out_dtype=torch.bfloat16, scale_dtype=None, num_experts_per_token=K,
                        device=torch.device(DEV), global_group=group,
                        max_tokens_per_expert=block)
    assert a2a.max_recv_tokens == EXPERTS_PER_RANK * block
    x, idx, w = sent[rank]
    dx, ids, dw = dv(x), dv(idx.to(torch.int32)), dv(w)
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, hidden, dtype=torch.bfloat16))
    expect_error(ferry.InvalidArgument, "max_tokens_per_expert", a2a.dispatch, counts,
                 dv(torch.zeros(EXPERTS_PER_RANK, block - 1, hidden, dtype=torch.bfloat16)),
                 None, dx, None, ids, dw)
    handle = a2a.dispatch_async(out_expert_num_tokens=counts, out_expert_x=out_x,
                                out_expert_x_scale=None, dp_x=dx, dp_x_scale=None, indices=ids,
                                weights=dw)
    handle.recv()
    handle.recv()  # once only: a second call does nothing
    got, n = hv(out_x), hv(counts)
    y = torch.zeros_like(got)
    for le, g, c, want in expert_blocks(sent, rank, n):
        assert rows_of(got[le, :c]) == rows_of(want), (rank, le)
        assert not got[le, c:].view(torch.int16).any(), "rows past the count written"
        y[le, :c] = (got[le, :c].double() * expert_factor(g)).to(torch.bfloat16)
    out = torch.empty_like(dx)
    expect_error(ferry.InvalidArgument, "expert_y", a2a.combine_async, out_tokens=out,
                 dispatch_handle=handle, expert_y=dv(y.view(-1, hidden)))
    done = a2a.combine_async(out_tokens=out, dispatch_handle=handle, expert_y=dv(y))
    done.recv()
    torch.testing.assert_close(hv(out).float(), weighted_reference(x, idx, w).float(),
                               rtol=2 ** -7, atol=2 ** -6)
    a2a.destroy()


def pplx_overflow_body(b, store):
    """max_tokens_per_expert 2 and three copies for expert 0: ResourceExhausted naming it (on
    the CUDA device at the AllToAll's next synchronisation, as kernel errors surface), and the
    AllToAll unusable after it."""
    from ferry import pplx
    a2a = pplx.AllToAll(max_num_tokens=4, num_experts=2, expert_padding=1, hidden_dim=128,
                        hidden_dim_scale=None, in_dtype=torch.bfloat16,
                        out_dtype=torch.bfloat16, scale_dtype=None, num_experts_per_token=1,
                        device=torch.device(DEV), global_group=b, max_tokens_per_expert=2)
    x = dv(torch.ones(4, 128, dtype=torch.bfloat16))
    ids = dv(torch.tensor([[0], [1], [0], [0]], dtype=torch.int32))
    w = dv(torch.ones(4, 1))
    counts = dv(torch.zeros(2, dtype=torch.int32))
    out_x = dv(torch.zeros(2, 2, 128, dtype=torch.bfloat16))

    def dispatch():
        a2a.dispatch(counts, out_x, None, x, None, ids, w)
        if DEV == "cuda":
            a2a._a2a.synchronize()
    expect_error(ferry.ResourceExhausted, "local expert 0 received 3 copies", dispatch)
    if DEV == "cuda":  # the dispatch's halves ran: the combine is next
        expect_error(ferry.ResourceExhausted, "unusable", a2a.combine, torch.empty_like(x), ids,
                     w, out_x)
    else:
        expect_error(ferry.ResourceExhausted, "unusable", a2a.dispatch, counts, out_x, None, x,
                     None, ids, w)
    a2a.destroy()


def encoded_fp8(world, s, spt):
    """Rank s's inputs as e4m3 codes (the caller's quantisation) with spt float32 scales a row:
    the quantiser's, one per 128 columns, or random ones of any other count."""
    x, idx, w = inputs(world, s)
    q, scales = quantize_reference(x, True)
    codes = (q[..., None] == e4m3_table()[None, None, :]).float().argmax(-1).to(torch.uint8)
    if spt != HIDDEN // 128:
        g = torch.Generator().manual_seed(500 + s)
        scales = torch.rand(x.shape[0], spt, generator=g) + 0.5
    return codes.view(fp8_dtype()), scales.contiguous(), idx, w


def check_pplx_fp8(world, rank, group, hidden_dim_scale=HIDDEN // 128, row_dtype=None):
    """e4m3 rows with their scales through pplx's dispatch (the caller quantised them): each
    expert's block holds its rows' codes and scales, as sent. hidden_dim_scale other than one
    per 128 columns (per token: 1): scales of that count, opaque to ferry, moved as they are.
    row_dtype: the rows' torch dtype (e4m3 by default; int8 carries the same bytes)."""
    from ferry import pplx
    spt = hidden_dim_scale
    row_dtype = row_dtype or fp8_dtype()
    a2a = pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=EXPERTS_PER_RANK * world,
                        expert_padding=PADDING, hidden_dim=HIDDEN, hidden_dim_scale=spt,
                        in_dtype=row_dtype, out_dtype=torch.bfloat16, scale_dtype=torch.float32,
                        num_experts_per_token=K, device=torch.device(DEV), global_group=group)

    def encoded(s):
        return encoded_fp8(world, s, spt)

    codes, scales, idx, w = encoded(rank)
    rows = a2a.max_recv_tokens
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(rows, HIDDEN, dtype=torch.uint8).view(row_dtype))
    out_s = dv(torch.zeros(rows, spt, dtype=torch.float32))
    a2a.dispatch(counts, out_x, out_s, dv(codes.view(row_dtype)), dv(scales), dv(idx), dv(w))
    counts, out_x, out_s = hv(counts), hv(out_x).view(torch.uint8), hv(out_s)
    start = 0
    for le in range(EXPERTS_PER_RANK):
        g = rank * EXPERTS_PER_RANK + le
        want = sorted(tuple(sc[t].view(torch.uint8).tolist()) + tuple(ss[t].tolist())
                      for s in range(world) for sc, ss, sidx, _ in [encoded(s)]
                      for t in range(sc.shape[0]) for j in range(K) if int(sidx[t, j]) == g)
        n = int(counts[le])
        got = sorted(tuple(out_x[start + i].tolist()) + tuple(out_s[start + i].tolist())
                     for i in range(n))
        assert got == want, (rank, le, n, len(want))
        start += (n + PADDING - 1) // PADDING * PADDING
    a2a.combine(dv(torch.empty(codes.shape[0], HIDDEN, dtype=torch.bfloat16)), dv(idx), dv(w),
                dv(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16)))
    a2a.destroy()


def pplx_dp_body(world):
    """Ranks in data-parallel groups of two ({0, 1}, {2, 3}, ..., as pplx groups tensor-parallel
    ranks), each group's ranks holding the same tokens (its first rank's inputs): every expert
    receives each group's tokens once, and every rank of a group gets the group's combined
    output -- plain, in halves, and with accumulate; the groups given as torch.distributed
    (gloo) groups, then as ferry Bootstraps (CallbackBootstrap over the groups'
    all_gather_object)."""
    def body(b, store):
        import torch.distributed as dist
        group = gloo(b, store)
        dp_groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        mine = dp_groups[b.rank // 2]

        def gather(data, timeout):
            out = [None] * 2
            dist.all_gather_object(out, data, group=mine)
            return out
        for dp_group in (mine, ferry.CallbackBootstrap(b.rank % 2, 2, gather)):
            check_pplx_dp(b, group, dp_group)
    return body


def check_pplx_dp(b, group, dp_group):
    from ferry import pplx
    world = b.world_size
    e = EXPERTS_PER_RANK * world
    a2a = pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=e, expert_padding=PADDING,
                        hidden_dim=HIDDEN, hidden_dim_scale=None, in_dtype=torch.bfloat16,
                        out_dtype=torch.bfloat16, scale_dtype=None, num_experts_per_token=K,
                        device=torch.device(DEV), dp_group=dp_group, global_group=group)
    source = b.rank // 2 * 2  # whose inputs this rank's group holds
    x, idx, w = inputs(world, source)
    dx, ids, dw = dv(x), dv(idx.to(torch.int32)), dv(w)
    for split, accumulate in ((False, False), (True, False), (False, True)):
        counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
        out_x = dv(torch.zeros(a2a.max_recv_tokens, HIDDEN, dtype=torch.bfloat16))
        halves = ((True, False), (False, True)) if split else ((True, True),)
        for send, recv in halves:
            a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_send=send, do_recv=recv)
        y = dv(padded_blocks(hv(out_x), hv(counts), b.rank, world,
                             senders=range(0, world, 2)))
        out = dv(torch.ones(x.shape[0], HIDDEN, dtype=torch.bfloat16))
        for send, recv in halves:
            a2a.combine(out, ids, dw, y, do_send=send, do_recv=recv, accumulate=accumulate)
        ref = weighted_reference(x, idx, w)
        if accumulate:
            ref = (ref.double() + 1).to(torch.bfloat16)
        torch.testing.assert_close(hv(out).float(), ref.float(), rtol=2 ** -7, atol=2 ** -6)
    a2a.destroy()


class PplxTest(Worlds, Case):
    body_of = staticmethod(pplx_body)

    def test_data_parallel_groups_of_two_among_four(self):
        self.ranks(4, pplx_dp_body(4), timeout=240.0)

    def test_an_expert_sent_more_than_its_block_fails_the_dispatch(self):
        self.ranks(1, pplx_overflow_body)

    def test_refuses_what_it_cannot_honour(self):
        from ferry import pplx

        def body(b, store):
            common = dict(max_num_tokens=4, num_experts=2, expert_padding=1, hidden_dim=128,
                          hidden_dim_scale=None, in_dtype=torch.bfloat16,
                          out_dtype=torch.bfloat16, scale_dtype=None, num_experts_per_token=1,
                          global_group=b)
            expect_error(ferry.Unimplemented, "out_dtype", pplx.AllToAll,
                         **{**common, "out_dtype": torch.float64})
            expect_error(ferry.Unimplemented, "scale_dtype", pplx.AllToAll,
                         **{**common, "scale_dtype": torch.float32, "hidden_dim_scale": 16})
            expect_error(ferry.InvalidArgument, "max_tokens_per_expert", pplx.AllToAll,
                         **common, max_tokens_per_expert=0)
            expect_error(ferry.InvalidArgument, "hidden_dim_scale", pplx.AllToAll,
                         **{**common, "in_dtype": torch.uint8, "scale_dtype": torch.float32})
            expect_error(ferry.InvalidArgument, "hidden_dim_scale", pplx.AllToAll,
                         **{**common, "in_dtype": torch.uint8, "scale_dtype": torch.float32,
                            "hidden_dim_scale": 129})
            expect_error(ferry.Unimplemented, "scale_dtype", pplx.AllToAll,
                         **{**common, "in_dtype": torch.uint8, "scale_dtype": torch.float16,
                            "hidden_dim_scale": 1})
        self.ranks(1, body)


# ---- pplx-kernels (ferry.pplx_kernels) -------------------------------------------------------

def legacy_ids(idx):
    """Ids as vLLM hands them to pplx-kernels, on DEV: uint32 where torch has it (-1 as
    0xFFFFFFFF; a view of int32 ids, as vLLM makes them), int32 before."""
    ids = dv(idx.to(torch.int32))
    return ids.view(torch.uint32) if hasattr(torch, "uint32") else ids


NVSHMEM_JOINED = []  # this rank's unique id, once its nvshmem_init ran


def legacy_all_to_all(b, store, group_kind, world, dp_size=1, **shape):
    """pplx_kernels imported as an engine imports it (after ferry.pplx_kernels.install()), its
    AllToAll made as vLLM's pplx backend makes it: over gloo, internode after nvshmem_init with
    a broadcast unique id, or intranode by the name of a gloo group of every rank; over ferry's
    bootstrap, intranode given the group."""
    import importlib.util
    import ferry.pplx_kernels
    ferry.pplx_kernels.install()
    import pplx_kernels as pplx
    from pplx_kernels.nvshmem import (nvshmem_alloc_empty_unique_id, nvshmem_get_unique_id,
                                      nvshmem_init)
    assert importlib.util.find_spec("pplx_kernels") is not None  # how vLLM asks
    assert importlib.util.find_spec("pplx_kernels.nvshmem") is not None
    args = dict(max_num_tokens=MAX_TOKENS, num_experts=EXPERTS_PER_RANK * world,
                experts_per_token=K, rank=b.rank, world_size=world, dp_size=dp_size,
                hidden_dim=HIDDEN, hidden_dim_bytes=HIDDEN * 2, hidden_dim_scale_bytes=0)
    args.update(shape)
    kinds = {"device": torch.device(DEV)}
    if group_kind == "ferry":
        return pplx.AllToAll.intranode(**args, group=b, **kinds)
    import torch.distributed as dist
    if not dist.is_initialized():
        gloo(b, store)
    if shape.get("hidden_dim_scale_bytes"):  # fp8: as vLLM's internode setup, once a process
        if not NVSHMEM_JOINED:
            uid = nvshmem_get_unique_id() if b.rank == 0 else nvshmem_alloc_empty_unique_id()
            dist.broadcast(uid, src=0)
            assert nvshmem_init(uid, b.rank, world) == 0
            NVSHMEM_JOINED.append(uid)
        return pplx.AllToAll.internode(**args, **kinds)
    cpu_group = dist.new_group(list(range(world)), backend="gloo")
    name = getattr(cpu_group, "group_name", None)
    if name is None:  # torch before 2.0 names groups in a table
        from torch.distributed import distributed_c10d as c10d
        name = c10d._pg_names[cpu_group]
    return pplx.AllToAll.intranode(**args, group_name=name, **kinds)


def check_legacy_2byte(a2a, rank, world, dtype=torch.bfloat16):
    """Two rounds of bf16 rows (or float16: dtype) dispatched and combined in halves, as vLLM's
    prepare and finalize call them, against the references (float16 sums within an fp16 unit
    of the last place, where bf16 rounding would miss by up to four); returns the last round's
    counts, output, rows and ids for further calls."""
    block = MAX_TOKENS * world
    sent = [(sx.to(dtype), sidx, sw) for sx, sidx, sw in (inputs(world, s) for s in range(world))]
    x, idx, w = sent[rank]
    dx, ids, dw = dv(x), legacy_ids(idx), dv(w)
    for round in range(2):
        counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
        out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, HIDDEN, dtype=dtype))
        a2a.dispatch(out_expert_num_tokens=counts, out_expert_x=out_x,
                     out_expert_x_scale=None, dp_x=dx, dp_x_scale=None, indices=ids,
                     bound_m=None, do_send=True, do_recv=False)
        a2a.dispatch(out_expert_num_tokens=counts, out_expert_x=out_x,
                     out_expert_x_scale=None, dp_x=dx, dp_x_scale=None, indices=ids,
                     bound_m=None, do_send=False, do_recv=True)
        got, n = hv(out_x), hv(counts)
        y = torch.zeros_like(got)
        for le, g, c, want in expert_blocks(sent, rank, n):
            assert rows_of(got[le, :c]) == rows_of(want), (rank, le)
            assert not got[le, c:].view(torch.int16).any(), "rows past the count written"
            y[le, :c] = (got[le, :c].double() * expert_factor(g)).to(dtype)
        out = dv(torch.full(x.shape, float("nan"), dtype=dtype))
        a2a.combine(out_tokens=out, indices=ids, weights=dw, expert_y=dv(y), bound_m=None,
                    do_send=True, do_recv=False)
        a2a.combine(out_tokens=out, indices=ids, weights=dw, expert_y=dv(y), bound_m=None,
                    do_send=False, do_recv=True)
        fp16 = dtype == torch.float16
        torch.testing.assert_close(hv(out).double(), weighted_reference(x, idx, w, dtype).double(),
                                   rtol=2 ** -10 if fp16 else 2 ** -7,
                                   atol=2 ** -14 if fp16 else 2 ** -6)
    return counts, out_x, dx, ids


def pplx_kernels_body(world, group_kind):
    """bf16 rows dispatched and combined in halves, as vLLM's prepare and finalize call them
    (the send half, then the receive half as the hook), into pplx-kernels' batched layout
    (max_num_tokens * world_size rows per local expert); then e4m3 rows with vLLM's scales."""
    def body(b, store):
        a2a = legacy_all_to_all(b, store, group_kind, world)
        check_legacy_2byte(a2a, b.rank, world, torch.float16)  # pplx-kernels takes either
        counts, out_x, dx, ids = check_legacy_2byte(a2a, b.rank, world)
        expect_error(ferry.InvalidArgument, "input has no scales", a2a.dispatch,
                     counts, out_x, None, dx, dv(torch.ones(dx.shape[0], 4)), ids, None)
        a2a.destroy()
        a2a.destroy()  # once only
        expect_error(ferry.FailedPrecondition, "closed", a2a.dispatch, counts, out_x, None, dx,
                     None, ids, None)
        # vLLM's per-token scales (one a row, repeated to 4 columns: 16 bytes) and block scales
        # (here 11 groups of 48 columns, given as 11 columns of the 12 that 16-byte rounding
        # makes).
        # vLLM's per-token output scales are [experts, rows, hidden]: the 4 land in its first
        # columns.
        # int8 rows (vLLM's int8 w8a8 path) with per-token scales, moved as they are.
        for given, spt, out_cols, int8 in ((4, 4, HIDDEN, False), (11, 12, 12, False),
                                           (4, 4, 4, True)):
            check_legacy_fp8(b, store, group_kind, world, given, spt, out_cols, int8)
    return body


def check_legacy_fp8(b, store, group_kind, world, given, spt, out_cols, int8=False):
    """e4m3 rows (int8: the same bytes as int8 tensors) with `given` scale columns a row,
    through an AllToAll made for spt (hidden_dim_scale_bytes 4 * spt), received into scales of
    out_cols columns: each block's rows and scales as sent, the columns past `given` zero,
    those past spt untouched."""
    a2a = legacy_all_to_all(b, store, group_kind, world, hidden_dim_bytes=HIDDEN,
                               hidden_dim_scale_bytes=4 * spt)
    block = MAX_TOKENS * world
    sent = [encoded_fp8(world, s, given) for s in range(world)]
    codes, scales, idx, w = sent[b.rank]
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    row_dtype = torch.int8 if int8 else fp8_dtype()
    out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, HIDDEN, dtype=torch.uint8).view(row_dtype))
    out_s = dv(torch.full((EXPERTS_PER_RANK, block, out_cols), -1.0))
    rows = dv(codes.view(row_dtype))
    expect_error(ferry.InvalidArgument, "dp_x_scale: expected a torch.Tensor", a2a.dispatch,
                 counts, out_x, out_s, rows, None, legacy_ids(idx), None)
    a2a.dispatch(counts, out_x, out_s, rows, dv(scales), legacy_ids(idx), None)
    assert out_x.dtype == row_dtype
    n, got_x, got_s = hv(counts), hv(out_x).view(torch.uint8), hv(out_s)
    assert (got_s[:, :, spt:] == -1.0).all(), "scale columns past the row's written"
    got_s = got_s[:, :, :spt]
    for le in range(EXPERTS_PER_RANK):
        g = b.rank * EXPERTS_PER_RANK + le
        want = sorted(tuple(sc[t].view(torch.uint8).tolist()) + tuple(ss[t].tolist())
                      + (0.0,) * (spt - given)
                      for sc, ss, sidx, _ in sent for t in range(sc.shape[0])
                      for j in range(K) if int(sidx[t, j]) == g)
        c = int(n[le])
        got = sorted(tuple(got_x[le, i].tolist()) + tuple(got_s[le, i].tolist())
                     for i in range(c))
        assert got == want, (b.rank, le, c, len(want))
    a2a.combine(dv(torch.empty(codes.shape[0], HIDDEN, dtype=torch.bfloat16)),
                legacy_ids(idx), dv(w),
                dv(torch.zeros(EXPERTS_PER_RANK, block, HIDDEN, dtype=torch.bfloat16)), None)
    a2a.destroy()


def pplx_kernels_dp_body(world, group_kind):
    """dp_size 2 (vLLM's tensor-parallel ranks, {0, 1} and {2, 3}): each group's tokens (its
    first rank's inputs) reach their experts once, in blocks of max_num_tokens * world_size /
    dp_size rows, and both ranks of a group get the group's sums."""
    def body(b, store):
        a2a = legacy_all_to_all(b, store, group_kind, world, dp_size=2)
        block = MAX_TOKENS * world // 2
        sent = [inputs(world, s) for s in range(0, world, 2)]
        x, idx, w = sent[b.rank // 2]
        dx, ids, dw = dv(x), legacy_ids(idx), dv(w)
        counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
        out_x = dv(torch.zeros(EXPERTS_PER_RANK, block, HIDDEN, dtype=torch.bfloat16))
        a2a.dispatch(counts, out_x, None, dx, None, ids, None)
        got, n = hv(out_x), hv(counts)
        y = torch.zeros_like(got)
        for le, g, c, want in expert_blocks(sent, b.rank, n):
            assert rows_of(got[le, :c]) == rows_of(want), (b.rank, le)
            y[le, :c] = (got[le, :c].double() * expert_factor(g)).to(torch.bfloat16)
        out = dv(torch.empty(x.shape, dtype=torch.bfloat16))
        a2a.combine(out, ids, dw, dv(y), None)
        torch.testing.assert_close(hv(out).float(), weighted_reference(x, idx, w).float(),
                                   rtol=2 ** -7, atol=2 ** -6)
        a2a.destroy()
    return body


SHIM_CHECK = """
import importlib.util, sys, torch
import ferry, ferry.pplx_kernels
assert "pplx_kernels" not in sys.modules
import pplx_kernels
from pplx_kernels.nvshmem import nvshmem_init
assert importlib.util.find_spec("pplx_kernels") is not None  # how vLLM asks
assert pplx_kernels.AllToAll is ferry.pplx_kernels.AllToAll
assert nvshmem_init is ferry.pplx_kernels.nvshmem_init
ferry.pplx_kernels.install()  # the shim's modules stay
assert sys.modules["pplx_kernels"] is pplx_kernels
b = ferry.CallbackBootstrap(0, 1, lambda data, timeout: [data])
a2a = pplx_kernels.AllToAll.intranode(4, 2, 1, 0, 1, 1, 128, 256, 0, group=b,
                                      device=torch.device("cpu"))
x = torch.randn(3, 128).to(torch.bfloat16)
ids = torch.tensor([[1], [0], [1]], dtype=torch.int32)
counts = torch.zeros(2, dtype=torch.int32)
out_x = torch.zeros(2, 4, 128, dtype=torch.bfloat16)
a2a.dispatch(counts, out_x, None, x, None, ids, None)
assert counts.tolist() == [1, 2], counts
out = torch.empty_like(x)
a2a.combine(out, ids, torch.ones(3, 1), out_x, None)
assert torch.equal(out, x)
a2a.destroy()
print("shim ok")
"""


def run_with_shim(test, shim, script):
    """script in a new interpreter with the shim folder (and ferry's) on PYTHONPATH, as an
    engine's worker processes inherit it; it must print "shim ok"."""
    import subprocess
    import sys
    paths = [shim, os.path.dirname(os.path.dirname(ferry.__file__))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    test.assertEqual(done.returncode, 0, done.stderr)
    test.assertIn("shim ok", done.stdout)


class PplxKernelsTest(Worlds, Case):
    body_of = staticmethod(pplx_kernels_body)

    def test_the_shim_package_on_pythonpath(self):
        """With ferry.pplx_kernels.shim_path() on PYTHONPATH, pplx_kernels imports as ferry's,
        vLLM's find_spec sees it, and an AllToAll made through it moves rows."""
        import ferry.pplx_kernels
        run_with_shim(self, ferry.pplx_kernels.shim_path(), SHIM_CHECK)

    def test_data_parallel_groups_of_two_among_four(self):
        self.ranks(4, pplx_kernels_dp_body(4, "gloo"), timeout=240.0)

    def test_data_parallel_groups_over_ferrys_bootstrap(self):
        self.ranks(4, pplx_kernels_dp_body(4, "ferry"), timeout=240.0)

    def test_internode_runs_among_the_ranks_nvshmem_init_joined(self):
        """Two EP groups in one torch.distributed world of four ({0, 2} and {1, 3}, as pipeline
        stages make them): each broadcasts its own unique id within its group, joins with
        nvshmem_init, and internode's AllToAll runs among its two ranks alone."""
        def body(b, store):
            import torch.distributed as dist
            import ferry.pplx_kernels as pplx
            gloo(b, store)
            teams = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            rank = b.rank // 2
            uid = (pplx.nvshmem_get_unique_id() if rank == 0
                   else pplx.nvshmem_alloc_empty_unique_id())
            dist.broadcast(uid, src=b.rank % 2, group=teams[b.rank % 2])
            assert pplx.nvshmem_init(uid, rank, 2) == 0
            assert pplx.nvshmem_init(uid, rank, 2) == 0  # again: nothing to do
            a2a = pplx.AllToAll.internode(
                max_num_tokens=MAX_TOKENS, num_experts=EXPERTS_PER_RANK * 2, experts_per_token=K,
                rank=rank, world_size=2, dp_size=1, hidden_dim=HIDDEN,
                hidden_dim_bytes=HIDDEN * 2, hidden_dim_scale_bytes=0, device=torch.device(DEV))
            check_legacy_2byte(a2a, rank, 2)
            a2a.destroy()
            pplx.nvshmem_finalize()
        self.ranks(4, body, timeout=240.0)

    def test_nvshmem_set_up_refusals(self):
        def body(b, store):
            import ferry.pplx_kernels as pplx
            expect_error(ferry.InvalidArgument, "uid must be", pplx.nvshmem_init,
                         torch.zeros(3), 0, 1)
            expect_error(ferry.InvalidArgument, "not one nvshmem_get_unique_id made",
                         pplx.nvshmem_init, pplx.nvshmem_alloc_empty_unique_id(), 0, 1)
            expect_error(ferry.InvalidArgument, "rank 2 of 2", pplx.nvshmem_init,
                         pplx.nvshmem_get_unique_id(), 2, 2)
            os.environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = "nosuchif"
            expect_error(ferry.InvalidArgument, "nosuchif", pplx.nvshmem_get_unique_id)
            os.environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = "lo"
            # Rank 1 whose rank 0 never comes: a deadline, not a wait without end.
            os.environ["FERRY_RENDEZVOUS_TIMEOUT_MS"] = "300"
            expect_error(ferry.DeadlineExceeded, "could not reach rank 0", pplx.nvshmem_init,
                         pplx.nvshmem_get_unique_id(), 1, 2)
            del os.environ["FERRY_RENDEZVOUS_TIMEOUT_MS"]
            uid = pplx.nvshmem_get_unique_id()
            assert bytes(uid[:14].tolist()) == b"ferry-uid:127."  # lo's address
            assert pplx.nvshmem_init(uid, 0, 1) == 0
            expect_error(ferry.FailedPrecondition, "already joined as rank 0 of 1",
                         pplx.nvshmem_init, pplx.nvshmem_get_unique_id(), 0, 1)
            common = dict(max_num_tokens=4, num_experts=2, experts_per_token=1, dp_size=1,
                          hidden_dim=128, hidden_dim_bytes=256, hidden_dim_scale_bytes=0,
                          device=torch.device(DEV))
            expect_error(ferry.InvalidArgument, "nvshmem_init was given rank 0 of 1",
                         pplx.AllToAll.internode, rank=1, world_size=2, **common)
            # Without torch.distributed: internode's ranks are nvshmem_init's.
            a2a = pplx.AllToAll.internode(rank=0, world_size=1, **common)
            x = dv(torch.randn(2, 128).to(torch.bfloat16))
            ids = dv(torch.tensor([[1], [0]], dtype=torch.int32))
            counts = dv(torch.zeros(2, dtype=torch.int32))
            out_x = dv(torch.zeros(2, 4, 128, dtype=torch.bfloat16))
            a2a.dispatch(counts, out_x, None, x, None, ids, None)
            assert hv(counts).tolist() == [1, 1]
            out = torch.empty_like(x)
            a2a.combine(out, ids, dv(torch.ones(2, 1)), out_x, None)
            assert torch.equal(hv(out), hv(x))
            a2a.destroy()
            pplx.nvshmem_finalize()
            assert pplx.nvshmem_init(pplx.nvshmem_get_unique_id(), 0, 1) == 0  # joins anew
            pplx.nvshmem_finalize()
        self.ranks(1, body)

    def test_refuses_what_it_cannot_honour(self):
        def body(b, store):
            import ferry.pplx_kernels as pplx
            common = dict(max_num_tokens=4, num_experts=2, experts_per_token=1, rank=0,
                          world_size=1, dp_size=1, hidden_dim=128, hidden_dim_bytes=256,
                          hidden_dim_scale_bytes=0, group=b, device=torch.device(DEV))
            cases = [
                (ferry.InvalidArgument, "hidden_dim_bytes", dict(hidden_dim_bytes=300)),
                (ferry.InvalidArgument, "hidden_dim_bytes", dict(hidden_dim_bytes=384)),
                (ferry.Unimplemented, "1-byte rows without scales", dict(hidden_dim_bytes=128)),
                (ferry.Unimplemented, "scales with e4m3 rows only",
                 dict(hidden_dim_scale_bytes=16)),
                (ferry.InvalidArgument, "multiple of 4", dict(hidden_dim_bytes=128,
                                                             hidden_dim_scale_bytes=6)),
                (ferry.InvalidArgument, "rank 1 of 2", dict(rank=1, world_size=2)),
                (ferry.InvalidArgument, "dp_size 2", dict(dp_size=2)),
                (ferry.InvalidArgument, "max_num_tokens", dict(max_num_tokens=0)),
            ]
            for error, words, change in cases:
                expect_error(error, words, pplx.AllToAll.intranode, **{**common, **change})
            no_group = {k: v for k, v in common.items() if k != "group"}
            expect_error(ferry.InvalidArgument, "group_name 'nowhere'", pplx.AllToAll.intranode,
                         **no_group, group_name="nowhere")
            # The default group where torch.distributed was never set up: named, not torch's.
            expect_error(ferry.InvalidArgument, "not initialised", pplx.AllToAll.intranode,
                         **no_group)
            a2a = pplx.AllToAll.intranode(**common)
            x = dv(torch.ones(2, 128, dtype=torch.bfloat16))
            ids = dv(torch.zeros(2, 1, dtype=torch.int32))
            counts = dv(torch.zeros(1 * 2, dtype=torch.int32))
            out_x = dv(torch.zeros(2, 4, 128, dtype=torch.bfloat16))
            expect_error(ferry.InvalidArgument, "dtype torch.float64", a2a.dispatch, counts,
                         out_x, None, x.double(), None, ids, None)
            expect_error(ferry.InvalidArgument, "at most (4, 128)", a2a.dispatch, counts, out_x,
                         None, dv(torch.ones(5, 128, dtype=torch.bfloat16)), None,
                         dv(torch.zeros(5, 1, dtype=torch.int32)), None)
            a2a.dispatch(counts, out_x, None, x, None, ids, None)  # still usable after both
            assert hv(counts).tolist() == [2, 0]
            a2a.combine(torch.empty_like(x), ids, dv(torch.ones(2, 1)), out_x, None)
            a2a.destroy()
            # 4-byte rows: float32 moved bit for bit and combined in float32.
            a2a = pplx.AllToAll.intranode(**{**common, "hidden_dim_bytes": 512})
            fx = dv(torch.randn(2, 128))
            got = dv(torch.zeros(2, 4, 128))
            expect_error(ferry.InvalidArgument, "dtype", a2a.dispatch, counts, got, None, x,
                         None, ids, None)
            a2a.dispatch(counts, got, None, fx, None, ids, None)
            assert torch.equal(hv(got)[0, :2], hv(fx)), "float32 rows changed on the way"
            fout = dv(torch.empty(2, 128))
            a2a.combine(fout, ids, dv(torch.tensor([[0.5], [0.25]])), got, None)
            torch.testing.assert_close(hv(fout), hv(fx) * torch.tensor([[0.5], [0.25]]),
                                       rtol=0, atol=0)
            a2a.destroy()
            import sys
            sys.modules["pplx_kernels"] = object()  # another pplx_kernels imported first
            expect_error(ferry.FailedPrecondition, "imported before", pplx.install)
            del sys.modules["pplx_kernels"]
        self.ranks(1, body)


if __name__ == "__main__":
    unittest.main()
