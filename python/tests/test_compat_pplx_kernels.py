"""ferry.compat.pplx_kernels (pplx-kernels' AllToAll, what vLLM's pplx backend imports) on the
host device: its sizes in bytes, data-parallel groups, nvshmem's set-up, and the shim package."""

import os
import unittest

import ferry
from ranks import expect_error

import compat_reference as refs
from compat_reference import (EXPERTS_PER_RANK, HIDDEN, K, MAX_TOKENS, Behaviours, Case, dv,
                              encoded_fp8, expert_blocks, expert_factor, fp8_dtype, gloo, hv,
                              inputs, rows_of, run_with_shim, weighted_reference)

try:
    import torch
except ImportError:  # the bindings' other tests run without torch
    torch = None


def legacy_ids(idx):
    """Ids as vLLM hands them to pplx-kernels, on refs.DEV: uint32 where torch has it (-1 as
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
    kinds = {"device": torch.device(refs.DEV)}
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


# The behaviours pplx_kernels_body checks, in order, each a function of (b, store, group kind,
# world); a test per behaviour runs it alone (PplxKernelsTest), the CUDA tests run them all.
BEHAVIOURS = {}


def behaviour(fn):
    BEHAVIOURS[fn.__name__] = fn
    return fn


@behaviour
def two_byte_rows_in_halves(b, store, group_kind, world):
    """bf16 and float16 rows dispatched and combined in halves, as vLLM's prepare and finalize
    call them (the send half, then the receive half as the hook), into pplx-kernels' batched
    layout (max_num_tokens * world_size rows per local expert); scales with 2-byte rows
    refused; destroy once only, a closed AllToAll refused."""
    a2a = legacy_all_to_all(b, store, group_kind, world)
    check_legacy_2byte(a2a, b.rank, world, torch.float16)  # pplx-kernels takes either
    counts, out_x, dx, ids = check_legacy_2byte(a2a, b.rank, world)
    expect_error(ferry.InvalidArgument, "input has no scales", a2a.dispatch,
                 counts, out_x, None, dx, dv(torch.ones(dx.shape[0], 4)), ids, None)
    a2a.destroy()
    a2a.destroy()  # once only
    expect_error(ferry.FailedPrecondition, "closed", a2a.dispatch, counts, out_x, None, dx,
                 None, ids, None)


@behaviour
def one_byte_rows_with_vllms_scales(b, store, group_kind, world):
    """e4m3 rows with vLLM's per-token scales (one a row, repeated to 4 columns: 16 bytes) and
    block scales (11 groups of 48 columns, given as 11 columns of the 12 that 16-byte rounding
    makes; vLLM's per-token output scales are [experts, rows, hidden]: the 4 land in its first
    columns), and int8 rows (vLLM's int8 w8a8 path) with per-token scales, moved as they are."""
    for given, spt, out_cols, int8 in ((4, 4, HIDDEN, False), (11, 12, 12, False),
                                       (4, 4, 4, True)):
        check_legacy_fp8(b, store, group_kind, world, given, spt, out_cols, int8)


def pplx_kernels_body(world, group_kind, only=None):
    """A rank's body: every behaviour in order (or `only` that one) over `group_kind`."""
    def body(b, store):
        for name, check in BEHAVIOURS.items():
            if only is None or name == only:
                check(b, store, group_kind, world)
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


class PplxKernelsTest(Behaviours, Case):
    body_of = staticmethod(pplx_kernels_body)
    behaviours = BEHAVIOURS

    def test_two_byte_rows_in_halves(self):
        self.in_every_world("two_byte_rows_in_halves")

    def test_one_byte_rows_with_vllms_scales(self):
        self.in_every_world("one_byte_rows_with_vllms_scales")

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
                hidden_dim_bytes=HIDDEN * 2, hidden_dim_scale_bytes=0,
                device=torch.device(refs.DEV))
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
                          device=torch.device(refs.DEV))
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
                          hidden_dim_scale_bytes=0, group=b, device=torch.device(refs.DEV))
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
