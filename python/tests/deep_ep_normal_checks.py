"""ferry.compat.deep_ep's normal mode against compat_reference's torch references: the checks
test_compat_deep_ep's behaviours (and the CUDA tests through them) run -- a dispatch and its
combines, one routed by is_token_in_rank alone, one with num_worst_tokens."""

import ferry
from ranks import expect_error

from compat_reference import (EXPERTS_PER_RANK, HIDDEN, K, MAX_TOKENS, decode_e4m3, dv, e4m3_table,
                              fp8_dtype, hv, inputs, quantize_reference)

try:
    import torch
except ImportError:  # the bindings' other tests run without torch
    torch = None


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
    want_x, want_idx, want_w, want_src = [], [], [], []
    counts = [0] * EXPERTS_PER_RANK
    for s in range(world):
        sx, sidx, sw = inputs(world, s, columns=hidden)
        for t in range(sx.shape[0]):
            mine = [(j, int(sidx[t, j]) - rank * EXPERTS_PER_RANK) for j in range(K)
                    if int(sidx[t, j]) // EXPERTS_PER_RANK == rank and int(sidx[t, j]) >= 0]
            if not mine:
                continue
            want_src.append(t)
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
    # V1's intranode handle (one host): each row's token in its sender, the routing given; what
    # ferry does not keep refuses any use by name.
    assert isinstance(handle, tuple) and len(handle) == 6
    rank_prefix_matrix, _, _, recv_src_idx, handle_in_rank, _ = handle
    assert hv(recv_src_idx).tolist() == want_src and handle_in_rank is not None
    assert torch.equal(hv(handle_in_rank), in_rank)
    expect_error(ferry.Unimplemented, "rank_prefix_matrix", lambda: rank_prefix_matrix.shape)
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
