"""ferry.deep_ep.ElasticBuffer (DeepEP V2's API for expert parallelism) on the host device, in
world sizes 1, 2 and 4, against compat_reference's inputs: construction from the MoE settings
and from bytes, the non-expanding and the expanding dispatch (with and without the CPU sync,
cached), the combine (bias, top-k weights), the expert counters, fp8 scales in the TMA-aligned
layout, and what is refused by name."""

import inspect

import ferry
from ranks import expect_error

from compat_reference import (EXPERTS_PER_RANK, HIDDEN, K, MAX_TOKENS, Behaviours, Case, dv,
                              fp8_dtype, group_of, hv, inputs, quantize_reference)

try:
    import torch
except ImportError:
    torch = None

BEHAVIOURS = {}


def behaviour(fn):
    BEHAVIOURS[fn.__name__] = fn
    return fn


def expected(world, rank):
    """What rank `rank` receives: (rows, ids local to it or -1, weights or 0) in DeepEP's order
    (senders in rank order, each sender's tokens in order), the ranks each of its own tokens
    reached, and its experts' counts."""
    want_x, want_idx, want_w, counts = [], [], [], [0] * EXPERTS_PER_RANK
    for s in range(world):
        sx, sidx, sw = inputs(world, s)
        for t in range(sx.shape[0]):
            mine = [(j, int(sidx[t, j]) - rank * EXPERTS_PER_RANK) for j in range(K)
                    if int(sidx[t, j]) >= 0 and int(sidx[t, j]) // EXPERTS_PER_RANK == rank]
            if not mine:
                continue
            ids, ws = [-1] * K, [0.0] * K
            for j, le in mine:
                ids[j], ws[j] = le, float(sw[t, j])
                counts[le] += 1
            want_x.append(sx[t])
            want_idx.append(ids)
            want_w.append(ws)
    x, idx, _ = inputs(world, rank)
    holders = torch.zeros(x.shape[0], 1, dtype=torch.float64)
    for t in range(x.shape[0]):
        holders[t] = len({int(e) // EXPERTS_PER_RANK for e in idx[t] if int(e) >= 0})
    return want_x, want_idx, want_w, holders, counts


@behaviour
def dispatch_and_combine(buf, world, rank):
    """A dispatch with the CPU sync: the rows, local ids and weights DeepEP's order gives, the
    handle's counts (aligned) and their prefix sums, the expert counters added to; the combine
    sums each token's rows over the ranks that got it (twice its rows back: twice it times
    their number), then with a bias; the top-k weights summed alike."""
    from ferry import deep_ep
    x, idx, w = inputs(world, rank)
    want_x, want_idx, want_w, holders, counts = expected(world, rank)
    stats = dv(torch.full((EXPERTS_PER_RANK,), 3, dtype=torch.int32))
    e = EXPERTS_PER_RANK * world
    recv, recv_idx, recv_w, handle, event = buf.dispatch(
        dv(x), topk_idx=dv(idx), topk_weights=dv(w), num_experts=e, expert_alignment=4,
        cumulative_local_expert_recv_stats=stats)
    assert isinstance(handle, deep_ep.EPHandle) and isinstance(event, deep_ep.EventOverlap)
    n = len(want_x)
    assert handle.num_recv_tokens == n and tuple(recv.shape) == (n, HIDDEN)
    if n:
        assert torch.equal(hv(recv).view(torch.int16), torch.stack(want_x).view(torch.int16))
    assert hv(recv_idx).tolist() == want_idx and hv(recv_w).tolist() == want_w
    aligned = [(c + 3) // 4 * 4 for c in counts]
    assert handle.num_recv_tokens_per_expert_list == aligned, (aligned, handle)
    assert hv(handle.psum_num_recv_tokens_per_expert).tolist() == list(
        torch.tensor(aligned).cumsum(0).tolist())
    assert hv(stats).tolist() == [3 + c for c in counts]
    out, none, _ = buf.combine(dv((hv(recv).double() * 2).to(torch.bfloat16)), handle)
    assert none is None
    assert torch.equal(hv(out).view(torch.int16),
                       (x.double() * 2 * holders).to(torch.bfloat16).view(torch.int16))
    # The cached dispatch (the handle's routing), a bias and the top-k weights summed.
    again, again_idx, _, same, _ = buf.dispatch(dv(x), handle=handle)
    assert same is handle and torch.equal(hv(again).view(torch.int16),
                                          hv(recv).view(torch.int16))
    given = torch.cat([hv(again_idx).ne(-1).float(), torch.ones(n, 1)], 1) if n else \
        torch.zeros(0, K + 1)
    out2, summed, _ = buf.combine(again, handle, topk_weights=dv(given.contiguous()),
                                  bias=dv((x.double() / 2).to(torch.bfloat16)))
    assert torch.equal(hv(out2).view(torch.int16),
                       (x.double() * (holders + 0.5)).to(torch.bfloat16).view(torch.int16))
    assert torch.equal(hv(summed)[:, K], holders.float()[:, 0])


@behaviour
def plain_dispatch_handle(buf, world, rank):
    """The commonest call (no statistics, the CPU sync, no expansion) runs in the C++ base
    alone: its EPHandle holds every attribute V2's has (the counts aligned, their prefix sums
    read as a tensor, the SM count, V2's routing tables None), a copy of topk_idx unless
    do_handle_copy=False, and the received rows' origins."""
    from ferry import _ferry, deep_ep
    for name in ("dispatch", "combine"):
        assert inspect.getattr_static(deep_ep.ElasticBuffer, name).__objclass__ is \
            _ferry.DeepEpElastic, name
    x, idx, w = inputs(world, rank)
    want_x, _, _, _, counts = expected(world, rank)
    e = EXPERTS_PER_RANK * world
    ids = dv(idx)
    recv, recv_idx, recv_w, handle, _ = buf.dispatch(dv(x), topk_idx=ids, topk_weights=dv(w),
                                                     num_experts=e, expert_alignment=2)
    aligned = [(c + 1) // 2 * 2 for c in counts]
    assert (handle.do_expand, handle.num_experts, handle.expert_alignment) == (False, e, 2)
    assert handle.num_max_tokens_per_rank == MAX_TOKENS and handle.num_sms >= 1
    assert handle.num_recv_tokens == recv.shape[0] == len(want_x)
    assert handle.num_recv_tokens_per_expert_list == aligned
    assert hv(handle.psum_num_recv_tokens_per_expert).tolist() == list(
        torch.tensor(aligned).cumsum(0).tolist())
    assert handle.num_expanded_tokens == 0 and handle.num_unaligned_recv_tokens_per_expert is None
    assert handle.dst_buffer_slot_idx is None and handle.token_metadata_at_forward is None \
        and handle.channel_linked_list is None
    assert handle.topk_idx is not ids and torch.equal(handle.topk_idx, ids)
    meta = hv(handle.recv_src_metadata)
    assert tuple(meta.shape) == (handle.num_recv_tokens, 2 + K)
    assert bool((meta[:, 1] >= 0).all()) and bool((meta[:, 1] < world).all())
    buf.combine(recv, handle)
    _, _, _, kept, _ = buf.dispatch(dv(x), topk_idx=ids, num_experts=e, do_handle_copy=False)
    assert kept.topk_idx is ids
    buf.combine(dv(torch.zeros(kept.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)), kept)
    # A call that fails after its steps (here the expanded layout's hook) returns no handle: its
    # AllToAll, which awaits that dispatch's combine, stays held, and the next dispatch of the
    # shape runs on another one the pool makes.
    made = len(buf._buffer._group.all_to_alls("normal"))

    def failing(*args):
        raise RuntimeError("expansion failed")
    buf._expand_outputs = failing
    expect_error(RuntimeError, "expansion failed", buf.dispatch, dv(x), topk_idx=ids,
                 num_experts=e, do_expand=True)
    del buf._expand_outputs
    _, _, _, again, _ = buf.dispatch(dv(x), topk_idx=ids, num_experts=e)
    assert len(buf._buffer._group.all_to_alls("normal")) == made + 1
    buf.combine(dv(torch.zeros(again.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)), again)


@behaviour
def dispatch_without_cpu_sync(buf, world, rank):
    """do_cpu_sync=False: ranks x num_max_tokens_per_rank rows, the received ones first, those
    past them with ids -1 and weights 0; the combine of all of them sums only the received."""
    x, idx, w = inputs(world, rank)
    want_x, want_idx, want_w, holders, _ = expected(world, rank)
    recv, recv_idx, recv_w, handle, _ = buf.dispatch(
        dv(x), topk_idx=dv(idx), topk_weights=dv(w), num_experts=EXPERTS_PER_RANK * world,
        do_cpu_sync=False)
    rows = world * MAX_TOKENS
    n = len(want_x)
    assert tuple(recv.shape) == (rows, HIDDEN) and handle.num_recv_tokens_per_expert_list is None
    assert hv(recv_idx)[:n].tolist() == want_idx and hv(recv_w)[:n].tolist() == want_w
    assert bool((hv(recv_idx)[n:] == -1).all()) and bool((hv(recv_w)[n:] == 0).all())
    out, _, _ = buf.combine(recv, handle)
    assert torch.equal(hv(out).view(torch.int16),
                       (x.double() * holders).to(torch.bfloat16).view(torch.int16))


def origins(world, rank):
    """What rank `rank` receives in order, as (sender, token, that token's ids) per row."""
    rows = []
    for s in range(world):
        _, sidx, _ = inputs(world, s)
        for t in range(sidx.shape[0]):
            if any(int(e) >= 0 and int(e) // EXPERTS_PER_RANK == rank for e in sidx[t]):
                rows.append((s, t, [int(e) for e in sidx[t]]))
    return rows


def folded_reference(world, rank):
    """An expanded combine of the received rows as they came (each copy's row the token's row):
    at each rank the token's copies summed and rounded to bf16, then the ranks' sums summed and
    rounded once more."""
    x, idx, _ = inputs(world, rank)
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for t in range(x.shape[0]):
        for r in range(world):
            copies = sum(1 for e in idx[t] if int(e) >= 0 and int(e) // EXPERTS_PER_RANK == r)
            if copies:
                out[t] += (x[t].double() * copies).to(torch.bfloat16).double()
    return out.to(torch.bfloat16)


def check_expanded(recv, recv_w, handle, world, rank, alignment, rows_of_layout):
    """The expanded layout against what the ranks sent: each expert's copies in its tokens'
    order from its block's start, the blocks rounded up to `alignment`; the handle's counts,
    prefix sums and sources (recv_src_metadata)."""
    want_x, want_idx, want_w, _, counts = expected(world, rank)
    aligned = [(c + alignment - 1) // alignment * alignment for c in counts]
    starts = [sum(aligned[:e]) for e in range(EXPERTS_PER_RANK)]
    assert handle.do_expand and handle.num_expanded_tokens == rows_of_layout
    assert tuple(recv.shape) == (rows_of_layout, HIDDEN) and recv_w.shape == (rows_of_layout,)
    assert hv(handle.num_unaligned_recv_tokens_per_expert).tolist() == counts
    assert hv(handle.psum_num_recv_tokens_per_expert).tolist() == [
        starts[e] + counts[e] for e in range(EXPERTS_PER_RANK)]
    n = len(want_x)
    meta = hv(handle.recv_src_metadata)[:n]
    sent = origins(world, rank)
    assert meta[:, 0].tolist() == [s * MAX_TOKENS + t for s, t, _ in sent]
    assert meta[:, 1].tolist() == [s for s, _, _ in sent]
    assert int(hv(handle.psum_num_recv_tokens_per_scaleup_rank)[-1]) == n
    seen = [0] * EXPERTS_PER_RANK
    for row in range(n):
        for j in range(K):
            e = want_idx[row][j]
            slot = int(meta[row, 2 + j])
            if e < 0:
                assert slot == -1, (row, j, slot)
                continue
            assert slot == starts[e] + seen[e], (row, j, slot, starts[e], seen[e])
            seen[e] += 1
            assert torch.equal(hv(recv[slot]).view(torch.int16), want_x[row].view(torch.int16))
            assert float(recv_w[slot]) == want_w[row][j]
    return starts, counts


@behaviour
def expanded_dispatch_and_combine(buf, world, rank):
    """do_expand, with and without the CPU sync: the layout and handle as check_expanded says;
    the combine folds each token's copies (then sums the ranks' folds), and sums the per-row
    weights back to their top-k columns; the cached expanded dispatch with do_zero_padding
    gives the same rows, the padding zero."""
    x, idx, w = inputs(world, rank)
    e = EXPERTS_PER_RANK * world
    alignment = 4
    for sync in (True, False):
        recv, recv_idx, recv_w, handle, _ = buf.dispatch(
            dv(x), topk_idx=dv(idx), topk_weights=dv(w), num_experts=e,
            expert_alignment=alignment, do_expand=True, do_cpu_sync=sync)
        assert recv_idx is None
        counts = expected(world, rank)[4]
        total = (sum((c + alignment - 1) // alignment * alignment for c in counts) if sync else
                 (world * MAX_TOKENS * min(K, EXPERTS_PER_RANK) + EXPERTS_PER_RANK *
                  (alignment - 1) + alignment - 1) // alignment * alignment)
        starts, counts = check_expanded(recv, recv_w, handle, world, rank, alignment, total)
        out, summed, _ = buf.combine(recv, handle, topk_weights=recv_w)
        assert torch.equal(hv(out).view(torch.int16),
                           folded_reference(world, rank).view(torch.int16)), (sync, rank)
        assert torch.equal(hv(summed), torch.where(idx >= 0, w, 0.0))
        again, _, again_w, same, _ = buf.dispatch(dv(x), topk_weights=dv(w), handle=handle,
                                                 do_expand=True, do_zero_padding=True)
        assert same is handle and tuple(again.shape) == tuple(recv.shape)
        for le in range(EXPERTS_PER_RANK):
            first, end = starts[le], starts[le] + counts[le]
            assert torch.equal(hv(again[first:end]).view(torch.int16),
                               hv(recv[first:end]).view(torch.int16))
            pad = (counts[le] + alignment - 1) // alignment * alignment - counts[le]
            assert bool((hv(again[end:end + pad]) == 0).all())
            assert bool((hv(again_w[end:end + pad]) == 0).all())
        buf.combine(again, handle)
    expect_error(ferry.InvalidArgument, "do_expand", buf.dispatch, dv(x), handle=handle)
    expect_error(ferry.InvalidArgument, "needs do_expand", buf.dispatch, dv(x),
                 topk_idx=dv(idx), num_experts=e, do_zero_padding=True)


@behaviour
def fp8_scales_tma_aligned(buf, world, rank):
    """fp8 rows with use_tma_aligned_col_major_sf: the same scales as the plain layout's, each
    column contiguous with its rows padded to a multiple of four; expanded too."""
    x, idx, _ = inputs(world, rank)
    q, scales = quantize_reference(x, False)
    rows = (dv(q.to(fp8_dtype())), dv(scales))
    e = EXPERTS_PER_RANK * world
    (plain, plain_sf), _, _, h1, _ = buf.dispatch(rows, topk_idx=dv(idx), num_experts=e)
    buf.combine(dv(torch.zeros(plain.shape[0], HIDDEN, dtype=torch.bfloat16)), h1)
    for expand in (False, True):
        (got, sf), _, _, h2, _ = buf.dispatch(rows, topk_idx=dv(idx), num_experts=e,
                                              do_expand=expand,
                                              use_tma_aligned_col_major_sf=True)
        n = got.shape[0]
        assert tuple(sf.shape) == (n, HIDDEN // 128)
        assert sf.stride() == (1, (n + 3) // 4 * 4), (sf.stride(), n)
        if not expand:
            assert torch.equal(hv(sf), hv(plain_sf))
        else:
            meta = hv(h2.recv_src_metadata)
            for row in range(meta.shape[0]):
                for slot in meta[row, 2:].tolist():
                    if slot >= 0:
                        assert torch.equal(hv(sf[slot]), hv(plain_sf[row]))
        buf.combine(dv(torch.zeros(n, HIDDEN, dtype=torch.bfloat16)), h2)


@behaviour
def refusals_name_what_is_not_built(buf, world, rank):
    """Engram, PP and AGRS refused by name; a handle not the buffer's, and a dispatch without
    num_experts, refused."""
    x, idx, _ = inputs(world, rank)
    for call in (buf.engram_write, buf.pp_send, buf.all_gather, buf.create_agrs_session):
        expect_error(ferry.Unimplemented, call.__name__, call)
    expect_error(ferry.InvalidArgument, "num_experts", buf.dispatch, dv(x), topk_idx=dv(idx))
    expect_error(ferry.InvalidArgument, "handle is not one", buf.combine, dv(x), object())


def v2_body(world, kind, only=None):
    def body(b, store):
        from ferry import deep_ep
        group = group_of(b, store, kind)
        buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                    num_topk=K, explicitly_destroy=True)
        assert (buf.rank_idx, buf.num_ranks) == (b.rank, world)
        assert buf.num_bytes % (2 << 20) == 0 and buf.num_bytes == \
            deep_ep.ElasticBuffer.get_buffer_size_hint(group, MAX_TOKENS, HIDDEN)
        assert buf.get_theoretical_num_qps(buf.get_theoretical_num_sms(4 * world, K)) >= 1
        buf.barrier()
        for name, check in BEHAVIOURS.items():
            if only is None or name == only:
                check(buf, world, b.rank)
        buf.destroy()
    return body


class ElasticBufferTest(Behaviours, Case):
    body_of = staticmethod(v2_body)
    behaviours = BEHAVIOURS

    def test_dispatch_and_combine(self):
        self.in_every_world("dispatch_and_combine")

    def test_plain_dispatch_handle(self):
        self.in_every_world("plain_dispatch_handle")

    def test_dispatch_without_cpu_sync(self):
        self.in_every_world("dispatch_without_cpu_sync")

    def test_expanded_dispatch_and_combine(self):
        self.in_every_world("expanded_dispatch_and_combine")

    def test_fp8_scales_tma_aligned(self):
        self.in_every_world("fp8_scales_tma_aligned")

    def test_refusals_name_what_is_not_built(self):
        self.in_every_world("refusals_name_what_is_not_built")

    def test_hybrid_mode_is_node_once_forwarding(self):
        """Four ranks as two nodes of two, hybrid mode: the normal mode's AllToAll is node-once
        (its rows cross to the other node once and are forwarded in it). Each rank receives
        what DeepEP's per-rank order holds, in the forwarders' order (the same rows, ids and
        weights as a multiset), its experts' counts; the combine sums each token's rows over
        its ranks exactly (two ranks' rows per node, then two nodes: no rounding in between at
        these values). allow_multiple_reduction=False keeps the node's sums fp32 across the
        rail (one rounding, as per rank). The expanded layout and its fold work from the
        forwarders' order too; the rows' senders are unknown there (-1)."""
        def body(b, store):
            from ferry import deep_ep
            world = 4
            for multiple, sums in ((True, ferry.PartialSums.COMBINE_ELEMENT),
                                   (False, ferry.PartialSums.FP32)):
                buf = deep_ep.ElasticBuffer(b, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                            allow_multiple_reduction=multiple,
                                            explicitly_destroy=True, ranks_per_node=2)
                assert buf.get_physical_domain_size() == (2, 2)
                x, idx, w = inputs(world, b.rank)
                want_x, want_idx, want_w, holders, counts = expected(world, b.rank)
                stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32)
                recv, recv_idx, recv_w, handle, _ = buf.dispatch(
                    x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS_PER_RANK * world,
                    cumulative_local_expert_recv_stats=stats)
                configs = [a.config for a in buf._buffer._group.all_to_alls("normal")]
                assert configs and all(c.forwarding == ferry.Forwarding.NODE_ONCE
                                       and c.partial_sums == sums for c in configs), configs
                got = sorted((tuple(r.view(torch.int16).tolist()), tuple(i), tuple(v))
                             for r, i, v in zip(recv, recv_idx.tolist(), recv_w.tolist()))
                ref = sorted((tuple(r.view(torch.int16).tolist()), tuple(i), tuple(v))
                             for r, i, v in zip(want_x, want_idx, want_w))
                assert got == ref, (b.rank, len(got), len(ref))
                assert stats.tolist() == counts
                out, _, _ = buf.combine((recv.double() * 2).to(torch.bfloat16), handle)
                assert torch.equal(out.view(torch.int16),
                                   (x.double() * 2 * holders).to(torch.bfloat16).view(torch.int16))
                # Expanded: laid out from the forwarders' order; no row's sender is known.
                recv, _, recv_w, handle, _ = buf.dispatch(
                    x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS_PER_RANK * world,
                    do_expand=True)
                n = len(want_x)
                assert handle.recv_src_metadata.shape == (n, 2 + K)
                assert bool((handle.recv_src_metadata[:, :2] == -1).all())
                assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == [n]
                out, summed, _ = buf.combine(recv, handle, topk_weights=recv_w)
                assert torch.equal(out.view(torch.int16),
                                   folded_reference(world, b.rank).view(torch.int16))
                assert torch.equal(summed, torch.where(idx >= 0, w, 0.0))
                buf.destroy()
        self.ranks(4, body, timeout=240.0)

    def test_construction_refuses_what_it_cannot_size(self):
        """Neither num_bytes nor the MoE settings, bytes not a multiple of 2 MiB, CPU bytes."""
        from ferry import deep_ep
        b = ferry.CallbackBootstrap(0, 1, lambda data, timeout: [data])
        for kwargs, error in (({}, ferry.InvalidArgument),
                              ({"num_bytes": 1000}, ferry.InvalidArgument),
                              ({"num_bytes": 2 << 20, "num_cpu_bytes": 2 << 20},
                               ferry.Unimplemented)):
            with self.assertRaises(error):
                deep_ep.ElasticBuffer(b, **kwargs)
        buf = deep_ep.ElasticBuffer(b, num_bytes=4 << 20, num_max_tokens_per_rank=MAX_TOKENS,
                                    explicitly_destroy=True)
        self.assertEqual(buf.get_logical_domain_size(), (1, 1))
        self.assertIsInstance(buf.capture(), deep_ep.EventHandle)
        buf.destroy()
