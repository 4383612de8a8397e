"""ferry.compat.pplx on the host device against compat_reference's torch references: fp16, fp32
and fp8 rows, batched layouts, data-parallel groups, overflow and refusals."""


import ferry
from ranks import expect_error

import compat_reference as refs
from compat_reference import (EXPERTS_PER_RANK, HIDDEN, K, MAX_TOKENS, Behaviours, Case, dv,
                              encoded_fp8, expert_blocks, expert_factor, fp8_dtype, gloo, group_of,
                              hv, inputs, rows_of, weighted_reference)

try:
    import torch
except ImportError:  # the bindings' other tests run without torch
    torch = None


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


# The behaviours pplx_body checks, in order, each a function of (world, rank, group); a test per
# behaviour runs it alone (PplxTest), the CUDA tests run them all in one set of ranks.
BEHAVIOURS = {}


def behaviour(fn):
    BEHAVIOURS[fn.__name__] = fn
    return fn


def bf16_all_to_all(world, group):
    from ferry import pplx
    return pplx.AllToAll(max_num_tokens=MAX_TOKENS, num_experts=EXPERTS_PER_RANK * world,
                         expert_padding=PADDING, hidden_dim=HIDDEN, hidden_dim_scale=None,
                         in_dtype=torch.bfloat16, out_dtype=torch.bfloat16, scale_dtype=None,
                         num_experts_per_token=K, nets_per_gpu=1, max_private_tokens=None,
                         device=torch.device(refs.DEV), dp_group=None, node_group=None,
                         global_group=group)


def bf16_call(world, rank, group):
    """A bf16 AllToAll, this rank's inputs (x, ids, weights) and their copies on the device."""
    x, idx, w = inputs(world, rank)
    return bf16_all_to_all(world, group), x, idx, w, dv(x), dv(idx.to(torch.int32)), dv(w)


@behaviour
def bf16_whole_and_in_halves(world, rank, group):
    """bf16 rows dispatched and combined in one call each, then in their send and receive
    halves (a combine between the halves refused as out of order)."""
    a2a, x, idx, w, dx, ids, dw = bf16_call(world, rank, group)
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
        y = dv(padded_blocks(hv(out_x), hv(counts), rank, world))
        out = torch.empty_like(dx)
        if split:
            a2a.combine(out, ids, dw, y, do_recv=False)
            a2a.combine(out, ids, dw, y, do_send=False)
        else:
            a2a.combine(out, ids, dw, y)
        torch.testing.assert_close(hv(out).float(), weighted_reference(x, idx, w).float(),
                                   rtol=2 ** -7, atol=2 ** -6)
    a2a.destroy()


@behaviour
def bound_m_and_accumulate(world, rank, group):
    """bound_m: the first m tokens only; accumulate adds to what out holds."""
    a2a, x, idx, w, dx, ids, dw = bf16_call(world, rank, group)
    rows = a2a.max_recv_tokens
    m = min(2, x.shape[0])
    bound = dv(torch.tensor([m], dtype=torch.int32))
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16))
    a2a.dispatch(counts, out_x, None, dx, None, ids, dw, bound_m=bound)
    y = dv(padded_blocks(hv(out_x), hv(counts), rank, world, m=2))
    out = dv(torch.ones(x.shape[0], HIDDEN, dtype=torch.bfloat16))
    a2a.combine(out, ids, dw, y, bound_m=bound, accumulate=True)
    ref = (weighted_reference(x[:m], idx[:m], w[:m]).double() + 1).to(torch.bfloat16)
    torch.testing.assert_close(hv(out)[:m].float(), ref.float(), rtol=2 ** -7, atol=2 ** -6)
    a2a.destroy()


@behaviour
def bad_arguments_refused_and_the_epoch_goes_on(world, rank, group):
    """A dtype and an output too small refused, naming them; the AllToAll goes on."""
    a2a, x, idx, w, dx, ids, dw = bf16_call(world, rank, group)
    rows = a2a.max_recv_tokens
    counts = dv(torch.empty(EXPERTS_PER_RANK, dtype=torch.int32))
    out_x = dv(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16))
    expect_error(ferry.InvalidArgument, "dtype", a2a.dispatch, counts, out_x, None,
                 dx.float(), None, ids, dw)
    a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_recv=False)
    expect_error(ferry.InvalidArgument, "max_recv_tokens", a2a.dispatch, counts,
                 out_x[:rows - 1], None, dx, None, ids, dw, do_send=False)
    a2a.dispatch(counts, out_x, None, dx, None, ids, dw, do_send=False)
    a2a.combine(torch.empty_like(dx), ids, dw, torch.zeros_like(out_x))
    a2a.destroy()


@behaviour
def fp8_rows_with_their_scales(world, rank, group):
    check_pplx_fp8(world, rank, group)
    check_pplx_fp8(world, rank, group, hidden_dim_scale=1)  # per-token scales
    check_pplx_fp8(world, rank, group, hidden_dim_scale=8)  # groups of 64 columns
    check_pplx_fp8(world, rank, group, hidden_dim_scale=1, row_dtype=torch.int8)  # w8a8


@behaviour
def batched_layout(world, rank, group):
    check_pplx_batched(world, rank, group)
    check_pplx_batched(world, rank, group, hidden=48)  # any multiple of 16 columns


@behaviour
def fp32_rows(world, rank, group):
    check_pplx_fp32(world, rank, group)
    check_pplx_fp32(world, rank, group, hidden=16)  # pplx-garden's tests use 16


@behaviour
def fp32_sums_of_bf16_rows(world, rank, group):
    check_pplx_fp32_out(world, rank, group)


@behaviour
def fp16_rows(world, rank, group):
    check_pplx_fp16(world, rank, group)


def pplx_body(world, group_kind, only=None):
    """A rank's body: every behaviour in order (or `only` that one) over `group_kind`."""
    def body(b, store):
        group = group_of(b, store, group_kind)
        for name, check in BEHAVIOURS.items():
            if only is None or name == only:
                check(world, b.rank, group)
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
                        num_experts_per_token=K, device=torch.device(refs.DEV), global_group=group,
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


def check_pplx_fp32(world, rank, group, hidden=HIDDEN):
    """pplx's float32 configuration (in_dtype = out_dtype = float32, as pplx-garden's tests
    run it): rows arrive bit for bit, in the batched layout, and the combine's sums stay fp32
    (a sum rounded through bf16 would miss by 2^-9 of its size; the tolerance is 2^-20)."""
    from ferry import pplx
    e = EXPERTS_PER_RANK * world
    common = dict(max_num_tokens=MAX_TOKENS, num_experts=e, expert_padding=1, hidden_dim=hidden,
                  hidden_dim_scale=None, in_dtype=torch.float32, out_dtype=torch.float32,
                  scale_dtype=None, num_experts_per_token=K, device=torch.device(refs.DEV),
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
                        device=torch.device(refs.DEV), global_group=group,
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
                        device=torch.device(refs.DEV), global_group=group,
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
                        device=torch.device(refs.DEV), global_group=b, max_tokens_per_expert=2)
    x = dv(torch.ones(4, 128, dtype=torch.bfloat16))
    ids = dv(torch.tensor([[0], [1], [0], [0]], dtype=torch.int32))
    w = dv(torch.ones(4, 1))
    counts = dv(torch.zeros(2, dtype=torch.int32))
    out_x = dv(torch.zeros(2, 2, 128, dtype=torch.bfloat16))

    def dispatch():
        a2a.dispatch(counts, out_x, None, x, None, ids, w)
        if refs.DEV == "cuda":
            a2a._a2a.synchronize()
    expect_error(ferry.ResourceExhausted, "local expert 0 received 3 copies", dispatch)
    if refs.DEV == "cuda":  # the dispatch's halves ran: the combine is next
        expect_error(ferry.ResourceExhausted, "unusable", a2a.combine, torch.empty_like(x), ids,
                     w, out_x)
    else:
        expect_error(ferry.ResourceExhausted, "unusable", a2a.dispatch, counts, out_x, None, x,
                     None, ids, w)
    a2a.destroy()


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
                        num_experts_per_token=K, device=torch.device(refs.DEV), global_group=group)

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
                        device=torch.device(refs.DEV), dp_group=dp_group, global_group=group)
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


class PplxTest(Behaviours, Case):
    body_of = staticmethod(pplx_body)
    behaviours = BEHAVIOURS

    def test_bf16_whole_and_in_halves(self):
        self.in_every_world("bf16_whole_and_in_halves")

    def test_bound_m_and_accumulate(self):
        self.in_every_world("bound_m_and_accumulate")

    def test_bad_arguments_refused_and_the_epoch_goes_on(self):
        self.in_every_world("bad_arguments_refused_and_the_epoch_goes_on")

    def test_fp8_rows_with_their_scales(self):
        self.in_every_world("fp8_rows_with_their_scales")

    def test_batched_layout(self):
        self.in_every_world("batched_layout")

    def test_fp32_rows(self):
        self.in_every_world("fp32_rows")

    def test_fp32_sums_of_bf16_rows(self):
        self.in_every_world("fp32_sums_of_bf16_rows")

    def test_fp16_rows(self):
        self.in_every_world("fp16_rows")


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
