"""ferry.deep_ep's rank masks (DeepEP's shrink mode): a rank that dies is masked by the
survivors' next low-latency call at its deadline, and masks set by hand leave a rank out of
every call; and the wait-cost statistics that name a slow rank. Each survivor checks its
received rows and counts, and its combined output, against a torch reference written here that
leaves the masked ranks' tokens and experts out. On the host device (torch CPU tensors) and,
where there is a GPU, on the CUDA device (the three ranks in one node on this machine's first
GPU; CUDA touched only inside the forked ranks)."""

import os
import signal
import struct
import time
import unittest

import ferry
from ranks import expect_error
from test_moe import free_address

try:
    import torch
except ImportError:
    torch = None

HIDDEN, LOCAL, K, M = 256, 2, 3, 5  # hidden, experts per rank, top-k, tokens per rank (most)
DEV = "cpu"  # where the layer's tensors live (the CUDA cases set "cuda" in their ranks)


def inputs(rank, round):
    """Rank's bf16 rows and ids (some -1) for one round, reproducible on every rank."""
    g = torch.Generator().manual_seed(17 + 31 * rank + 1009 * round)
    x = torch.randn(M, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(3 * LOCAL, generator=g)[:K] for _ in range(M)])
    idx[::2, K - 1] = -1
    w = torch.rand(M, K, generator=g)
    return x, idx.to(torch.int64), w


def check_call(buf, me, world, live, round, hook, stats=(None, None), delay=0.0):
    """One low-latency dispatch and combine: rows from live senders only; the combine (experts
    multiply by 1 + their global id) sums only the copies that went to live ranks. stats: the
    dispatch's and the combine's wait-cost tensors; delay: seconds slept before each call."""
    x, idx, w = inputs(me, round)
    e = LOCAL * world
    time.sleep(delay)
    recv, count, handle, event, recv_hook = buf.low_latency_dispatch(
        x.to(DEV), idx.to(DEV), M, e, use_fp8=False, return_recv_hook=hook,
        dispatch_wait_recv_cost_stats=stats[0])
    if hook:
        recv_hook()
    recv, count = recv.cpu(), count.cpu()
    y = torch.zeros(LOCAL, world * M, HIDDEN, dtype=torch.bfloat16)
    for le in range(LOCAL):
        g = me * LOCAL + le
        want = []
        for s in range(world):
            if s != me and not live[s]:
                continue
            sx, sidx, _ = inputs(s, round)
            want += [sx[t] for t in range(M) for j in range(K) if int(sidx[t, j]) == g]
        n = int(count[le])
        assert n == len(want), (me, le, n, len(want))
        got = sorted(tuple(r.view(torch.int16).tolist()) for r in recv[le, :n])
        assert got == sorted(tuple(r.view(torch.int16).tolist()) for r in want), (me, le)
        y[le, :n] = (recv[le, :n].double() * (1 + g)).to(torch.bfloat16)
    time.sleep(delay)
    out, event, combine_hook = buf.low_latency_combine(y.to(DEV), idx.to(DEV), w.to(DEV), handle,
                                                       return_recv_hook=hook,
                                                       combine_wait_recv_cost_stats=stats[1])
    if hook:
        combine_hook()
    out = out.cpu()
    ref = torch.zeros(M, HIDDEN, dtype=torch.float64)
    for t in range(M):
        for j in range(K):
            g = int(idx[t, j])
            if g >= 0 and live[g // LOCAL]:
                ref[t] += float(w[t, j]) * (1 + g) * x[t].double()
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=2 ** -7,
                               atol=2 ** -6)


def masks(buf, world):
    status = torch.full((world,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return status.tolist()


def on(dev, body):
    """body in a rank with the layer's tensors on `dev` (CUDA set up here, after the fork)."""
    def run(b):
        global DEV
        DEV = dev
        if dev == "cuda":
            torch.cuda.set_device(0)
        body(b)
        if dev == "cuda":
            torch.cuda.synchronize()
    return run


class DeepEpMaskTest(unittest.TestCase):
    dev = "cpu"

    def setUp(self):
        if torch is None:
            self.skipTest("no torch for this interpreter")
        os.environ.setdefault("FERRY_PROVIDER", "shm")

    def test_a_rank_that_died_is_masked_and_the_others_go_on(self):
        def body(b):
            from ferry import deep_ep
            torch.set_num_threads(1)
            world, me = b.world_size, b.rank
            buf = deep_ep.Buffer(b, low_latency_mode=True, enable_shrink=True, timeout=1.0)
            everyone = [True] * world
            # Rounds 0-2 by everyone (the third runs on the C++ path), then rank 2 dies.
            for round in range(3):
                check_call(buf, me, world, everyone, round, hook=round == 1)
            assert masks(buf, world) == [0, 0, 0]
            b.barrier(30.0)
            if me == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            live = [True, True, False]
            for round in range(3, 6):
                start = time.monotonic()
                check_call(buf, me, world, live, round, hook=round == 4)
                took = time.monotonic() - start
                assert took < (5.0 if round == 3 else 0.5), (round, took)
                assert masks(buf, world) == [0, 0, 1]
            # Unmasking brings rank 2 back as a new process met over `rejoin`, which this
            # Buffer lacks.
            expect_error(ferry.InvalidArgument, "rejoin=", buf.low_latency_update_mask_buffer,
                         2, False)
            expect_error(ferry.InvalidArgument, "rejoin=", buf.low_latency_clean_mask_buffer)
            buf.low_latency_update_mask_buffer(2, True)  # masked already: nothing changes
            check_call(buf, me, world, live, 6, hook=False)

        exits = ferry.run_local_ranks(3, on(self.dev, body), 120.0)
        self.assertTrue(exits[0].ok and exits[1].ok, exits)
        self.assertEqual(exits[2].signal, signal.SIGKILL)

    def test_a_rank_that_died_comes_back_as_a_new_process(self):
        """Rank 2 dies after two rounds; the survivors mask it at the next call's deadline and
        go on without it; a new process takes its place (join=True) and the survivors unmask
        it (low_latency_update_mask_buffer(2, False); rank 1 cleans the mask buffer, which
        does the same), meeting over `rejoin`: from the next
        call every rank's rows and sums are whole again, on every rank, the new one included
        (on the CUDA device, the three ranks in one node: each low-latency AllToAll made
        anew)."""
        first, again = free_address(), free_address()

        def body(b):
            from ferry import deep_ep
            torch.set_num_threads(1)
            world, me = 3, min(b.rank, 2)  # process 3 is rank 2's replacement

            def rejoin():
                return ferry.join_rendezvous(again, world_size=world, rank=me, timeout=30)

            everyone = [True] * world
            if b.rank == 3:
                buf = deep_ep.Buffer(None, low_latency_mode=True, enable_shrink=True,
                                     timeout=5.0, rejoin=rejoin, join=True)
                assert masks(buf, world) == [0, 0, 0]
                for round in range(4, 7):
                    check_call(buf, me, world, everyone, round, hook=round == 5)
                return
            group = ferry.join_rendezvous(first, world_size=world, rank=me, timeout=30)
            buf = deep_ep.Buffer(group, low_latency_mode=True, enable_shrink=True, timeout=1.0,
                                 rejoin=rejoin)
            for round in range(2):
                check_call(buf, me, world, everyone, round, hook=round == 1)
            group.barrier(30.0)
            if me == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            for round in range(2, 4):
                check_call(buf, me, world, [True, True, False], round, hook=round == 3)
            assert masks(buf, world) == [0, 0, 1]
            # Rank 1 cleans the mask buffer instead: the same readmission.
            if me == 1:
                buf.low_latency_clean_mask_buffer()
            else:
                buf.low_latency_update_mask_buffer(2, False)
            assert masks(buf, world) == [0, 0, 0]
            for round in range(4, 7):
                check_call(buf, me, world, everyone, round, hook=round == 5)

        exits = ferry.run_local_ranks(4, on(self.dev, body), 120.0)
        self.assertTrue(exits[0].ok and exits[1].ok and exits[3].ok, exits)
        self.assertEqual(exits[2].signal, signal.SIGKILL)

    def test_masks_set_by_hand_leave_a_rank_out(self):
        def body(b):
            from ferry import deep_ep
            torch.set_num_threads(1)
            world, me = b.world_size, b.rank
            buf = deep_ep.Buffer(b, low_latency_mode=True, enable_shrink=True, timeout=30.0)
            check_call(buf, me, world, [True] * world, 0, hook=False)
            buf.low_latency_clean_mask_buffer()  # nothing masked: nothing to clean
            buf.low_latency_update_mask_buffer((me + 1) % world, False)  # not masked: no change
            expect_error(ferry.InvalidArgument, "cannot mask itself",
                         buf.low_latency_update_mask_buffer, me, True)
            expect_error(ferry.InvalidArgument, "rank 3 of 3",
                         buf.low_latency_update_mask_buffer, 3, True)
            expect_error(ferry.InvalidArgument, "int32 tensor",
                         buf.low_latency_query_mask_buffer, torch.zeros(world))
            # Ranks 0 and 1 mask rank 2; rank 2 masks both: two worlds from the next call on.
            for r in range(world):
                if (r == 2) != (me == 2):
                    buf.low_latency_update_mask_buffer(r, True)
            live = [me != 2] * 2 + [me == 2]
            assert masks(buf, world) == [int(not v) for v in live]
            for round in range(1, 5):
                start = time.monotonic()
                check_call(buf, me, world, live, round, hook=round % 2 == 0)
                assert time.monotonic() - start < 1.0, "a call waited for a masked rank"
            b.barrier(30.0)

            plain = deep_ep.Buffer(b, low_latency_mode=True)
            expect_error(ferry.InvalidArgument, "enable_shrink",
                         plain.low_latency_update_mask_buffer, 0, True)
            expect_error(ferry.InvalidArgument, "enable_shrink",
                         plain.low_latency_query_mask_buffer, torch.zeros(world,
                                                                          dtype=torch.int32))

        exits = ferry.run_local_ranks(3, on(self.dev, body), 120.0)
        self.assertTrue(all(e.ok for e in exits), exits)

    def test_wait_costs_name_a_slow_rank(self):
        """Rank 2 calls each step 0.3 s after the others: in both wait-cost tensors (added to
        what they held) ranks 0 and 1 find a good part of that in rank 2's entry and a quarter
        of it or less in the other's, and rank 2 waited less for anyone than they did for it --
        with and without the hooks. Nanoseconds on CPU tensors, GPU clock cycles on CUDA ones (read here at 2 GHz, above
        an H100's or H200's clock, for a bound that holds at any clock)."""
        def body(b):
            from ferry import deep_ep
            torch.set_num_threads(1)
            world, me = b.world_size, b.rank
            buf = deep_ep.Buffer(b, low_latency_mode=True, timeout=30.0)
            everyone = [True] * world
            per_second = 2e9 if DEV == "cuda" else 1e9
            expect_error(ferry.InvalidArgument, "dispatch_wait_recv_cost_stats",
                         buf.low_latency_dispatch, torch.zeros(M, HIDDEN, dtype=torch.bfloat16)
                         .to(DEV), torch.zeros(M, K, dtype=torch.int64).to(DEV), M, LOCAL * world,
                         dispatch_wait_recv_cost_stats=torch.zeros(world + 1, dtype=torch.int64)
                         .to(DEV))
            check_call(buf, me, world, everyone, 0, hook=False)
            for round in range(1, 5):
                stats = [torch.full((world,), 5, dtype=torch.int64).to(DEV) for _ in range(2)]
                b.barrier(30.0)
                check_call(buf, me, world, everyone, round, hook=round % 2 == 0, stats=stats,
                           delay=0.3 if me == 2 else 0.0)
                gained = [(s.cpu() - 5).tolist() for s in stats]
                longest = max(g[q] for g in gained for q in range(world) if q != me)
                for_slow = 0 if me == 2 else min(g[2] for g in gained)
                reported = [struct.unpack("qq", v)
                              for v in b.all_gather(struct.pack("qq", longest, for_slow))]
                if me == 2:
                    assert all(longest < reported[q][1] for q in (0, 1)), (round, reported)
                    continue
                for g in gained:
                    assert g[2] / per_second > 0.1, (round, me, gained)
                    assert 0 <= g[1 - me] and 4 * g[1 - me] < g[2], (round, me, gained)

        exits = ferry.run_local_ranks(3, on(self.dev, body), 120.0)
        self.assertTrue(all(e.ok for e in exits), exits)


class DeepEpMaskCudaTest(DeepEpMaskTest):
    """The same on the CUDA device: the kernels' masks, in one node."""
    dev = "cuda"

    def setUp(self):
        super().setUp()
        from test_compat_cuda import NO_GPU, probe
        if ferry.run_local_ranks(1, probe, 60.0)[0].exit_code == NO_GPU:
            self.skipTest("no GPU, or torch without CUDA")


if __name__ == "__main__":
    unittest.main()
