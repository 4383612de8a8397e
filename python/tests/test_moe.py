"""ferry.AllToAll from Python on the host device: two ranks over shm, checked against what the
routing says each rank must receive and sum. Plain Python arrays (array.array): bf16 rows are
2-byte integers, and every value is a small integer times a power of two, so bf16 holds each
input and each weighted sum exactly and the checks compare for equality."""

import array
import os
import random
import socket
import struct
import unittest

import ferry
from ranks import expect_error, run_ranks, shm_engine

WORLD, EXPERTS, K, HIDDEN, MAX_TOKENS = 2, 8, 2, 128, 8
TOKENS = (5, 8)  # per rank
WEIGHTS = (0.5, 0.25)


def bf16(value):
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


def from_bf16(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def inputs(rank):
    """Rank's tokens: rows of small integers unique to (rank, token), two distinct experts each."""
    rng = random.Random(rank)
    rows = [[float((rank * 37 + t * 11 + h) % 15 - 7) for h in range(HIDDEN)]
            for t in range(TOKENS[rank])]
    experts = [rng.sample(range(EXPERTS), K) for _ in rows]
    return rows, experts


def config(rank, **fields):
    return ferry.AllToAllConfig(world_size=WORLD, rank=rank, num_experts=EXPERTS,
                                experts_per_token=K, max_tokens_per_rank=MAX_TOKENS,
                                hidden=HIDDEN, **fields)


def send_arrays(rank):
    rows, experts = inputs(rank)
    x = array.array("H", [bf16(v) for row in rows for v in row])
    indices = array.array("i", [e for pair in experts for e in pair])
    weights = array.array("f", [w for _ in rows for w in WEIGHTS])
    return x, indices, weights


def row_of(x, i):
    return tuple(x[i * HIDDEN:(i + 1) * HIDDEN])


def check_round(a2a, rank):
    """One dispatch and combine of rank's inputs with every rank live, checked: each local
    expert gets exactly the rows routed to it, from every rank; experts that return their input
    give each token back as its weights' sum times itself."""
    c = a2a.config
    local = c.local_experts
    x, indices, weights = send_arrays(rank)
    out = array.array("H", bytes(2 * local * c.expert_capacity * HIDDEN))
    counts = array.array("i", [0] * local)
    y = array.array("H", bytes(2 * TOKENS[rank] * HIDDEN))
    a2a.dispatch_send(x, indices, weights, num_tokens=TOKENS[rank])
    a2a.dispatch_recv(out, counts, timeout=10)
    for e in range(local):
        want = sorted(tuple(bf16(v) for v in rows[t])
                      for s in range(WORLD)
                      for rows, experts in [inputs(s)]
                      for t in range(len(rows)) if rank * local + e in experts[t])
        got = sorted(row_of(out, e * c.expert_capacity + i) for i in range(counts[e]))
        assert got == want, (rank, e, counts[e], len(want))
    a2a.combine_send(out)
    a2a.combine_recv(y, timeout=10)
    rows, _ = inputs(rank)
    for t, row in enumerate(rows):
        want = tuple(bf16(v * sum(WEIGHTS)) for v in row)
        assert row_of(y, t) == want, (rank, t)


def grow_body(b, alone, grown):
    """A world of one rank grows to two (resize on the rank that was there, AllToAll.join on
    the new process): the round after is whole, config and membership_version follow."""
    if b.rank == 1:
        group = ferry.join_rendezvous(grown, world_size=WORLD, rank=1, timeout=30)
        with shm_engine() as engine, ferry.AllToAll.join(config(1), engine, group, 30) as a2a:
            check_round(a2a, 1)
        return
    one = ferry.AllToAllConfig(world_size=1, rank=0, num_experts=EXPERTS, experts_per_token=K,
                               max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN)
    world = ferry.join_rendezvous(alone, world_size=1, rank=0, timeout=30)
    with shm_engine() as engine, ferry.AllToAll(one, engine, world) as a2a:
        a2a.resize(config(0), ferry.join_rendezvous(grown, world_size=WORLD, rank=0, timeout=30))
        assert a2a.config.world_size == WORLD and a2a.membership_version == 1
        check_round(a2a, 0)


def expert_major_body(b):
    with shm_engine() as engine, ferry.AllToAll(config(b.rank), engine, b) as a2a:
        for _ in range(2):  # the second round reuses every buffer
            check_round(a2a, b.rank)
        assert a2a.dispatch_bytes_sent > 0


def free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


def rejoin_body(b, first, again):
    """Three processes: ranks 0 and 1 of an AllToAll (met at `first`), and one that takes rank
    1's place once rank 1 has left (rank 0 masked it, its process closed its AllToAll): rank 0
    readmits it over `again` (readmit while a step is under way is refused), the new rank 1
    joins, and the next round is whole again."""
    if b.rank == 2:
        group = ferry.join_rendezvous(again, world_size=WORLD, rank=1, timeout=30)
        with shm_engine() as engine, ferry.AllToAll.join(config(1), engine, group, 30) as a2a:
            assert a2a.membership_version == 1
            check_round(a2a, 1)
        return
    world = ferry.join_rendezvous(first, world_size=WORLD, rank=b.rank, timeout=30)
    with shm_engine() as engine, ferry.AllToAll(config(b.rank), engine, world) as a2a:
        check_round(a2a, b.rank)
        if b.rank == 1:
            return
        a2a.set_masked(1)
        x, indices, weights = send_arrays(0)
        a2a.dispatch_send(x, indices, weights, num_tokens=TOKENS[0])
        expect_error(ferry.FailedPrecondition, "out of order", a2a.readmit, world)
        a2a.dispatch_recv(array.array("H", bytes(2 * a2a.config.local_experts *
                                                 a2a.config.expert_capacity * HIDDEN)),
                          array.array("i", [0] * a2a.config.local_experts), timeout=10)
        expect_error(ferry.FailedPrecondition, "out of order", a2a.readmit, world)
        a2a.combine_send(array.array("H", bytes(2 * a2a.config.local_experts *
                                                a2a.config.expert_capacity * HIDDEN)))
        a2a.combine_recv(array.array("H", bytes(2 * TOKENS[0] * HIDDEN)), timeout=10)
        assert list(a2a.masked()) == [0, 1]
        a2a.readmit(ferry.join_rendezvous(again, world_size=WORLD, rank=0, timeout=30), 30)
        assert list(a2a.masked()) == [0, 0] and a2a.membership_version == 1
        check_round(a2a, 0)


def float16_body(b):
    """float16 rows (NumPy's): moved bit for bit, and combined as fp16 -- each token's fp32 sum
    rounded once to fp16 (values of 10 significant bits, which bf16 would round); a bf16 output
    for fp16 rows refused, the combine then finished as it should be; float16 rows refused
    where an fp8 AllToAll would quantise them (it reads bf16)."""
    import numpy as np
    c = config(b.rank)
    local, cap = c.local_experts, c.expert_capacity
    _, experts = inputs(b.rank)

    def rows_of_rank(s):
        return np.array([[((s * 37 + t * 11 + h) % 511 - 255) + 0.25 for h in range(HIDDEN)]
                         for t in range(TOKENS[s])], dtype=np.float16)

    x = rows_of_rank(b.rank)
    indices = np.array(experts, dtype=np.int32)
    weights = np.array([WEIGHTS] * len(experts), dtype=np.float32)
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = np.zeros((local * cap, HIDDEN), np.float16)
        counts = array.array("i", [0] * local)
        a2a.dispatch_send(x, indices, weights)
        a2a.dispatch_recv(out, counts, timeout=10)
        for e in range(local):
            want = sorted(rows_of_rank(s)[t].tobytes() for s in range(WORLD)
                          for t, ex in enumerate(inputs(s)[1]) if b.rank * local + e in ex)
            got = sorted(out[e * cap + i].tobytes() for i in range(counts[e]))
            assert got == want, (b.rank, e)
        a2a.combine_send(out * np.float16(2))  # experts that double their input (exact)
        y = np.zeros((TOKENS[b.rank], HIDDEN), np.float16)
        expect_error(ferry.InvalidArgument, "bf16 output, and its CombineSend was given fp16",
                     a2a.combine_recv, array.array("H", bytes(2 * TOKENS[b.rank] * HIDDEN)),
                     timeout=10)
        a2a.combine_recv(y, timeout=10)
        want = (x.astype(np.float64) * 2 * sum(WEIGHTS)).astype(np.float16)
        assert (want.astype(np.float64) != x.astype(np.float64) * 1.5).any()  # fp16 rounded some
        assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (b.rank, y, want)
        fp8 = config(b.rank, dtype=ferry.DispatchDtype.FP8_E4M3, instance=1)
        with ferry.AllToAll(fp8, engine, b) as quantising:
            expect_error(ferry.InvalidArgument, "x: float16 elements; the dispatch quantises",
                         quantising.dispatch_send, x, indices, weights)


def fp32_out_body(b):
    """A float32 out for 2-byte rows takes each token's fp32 sum unrounded (here float16 rows,
    whose sums fp16 would round): equal to the float64 sum, and to the float16 output once
    rounded; with accumulate, added to what out holds; an out of the wrong size refused."""
    import numpy as np
    c = config(b.rank)
    local, cap = c.local_experts, c.expert_capacity
    _, experts = inputs(b.rank)
    x = np.array([[((b.rank * 37 + t * 11 + h) % 511 - 255) + 0.25 for h in range(HIDDEN)]
                  for t in range(TOKENS[b.rank])], dtype=np.float16)
    indices = np.array(experts, dtype=np.int32)
    weights = np.array([WEIGHTS] * len(experts), dtype=np.float32)
    exact = x.astype(np.float64) * 2 * sum(WEIGHTS)  # experts that double their input
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = np.zeros((local * cap, HIDDEN), np.float16)
        counts = array.array("i", [0] * local)
        for accumulate in (False, True):
            a2a.dispatch_send(x, indices, weights)
            a2a.dispatch_recv(out, counts, timeout=10)
            a2a.combine_send(out * np.float16(2))
            if accumulate:
                expect_error(ferry.InvalidArgument, "out",
                             a2a.combine_recv, np.zeros((TOKENS[b.rank] - 1, HIDDEN), np.float32),
                             timeout=10)
            y = np.full((TOKENS[b.rank], HIDDEN), 1.0 if accumulate else 0.0, np.float32)
            a2a.combine_recv(y, accumulate=accumulate, timeout=10)
            want = exact + (1.0 if accumulate else 0.0)
            assert np.array_equal(y.astype(np.float64), want), (b.rank, accumulate)
        assert (exact.astype(np.float16).astype(np.float64) != exact).any()  # fp16 would round
        assert np.array_equal((y - 1).astype(np.float16), exact.astype(np.float16))


def token_major_body(b):
    c = config(b.rank, dispatch_once_per_rank=True, combine_reduce_at_expert_rank=True,
               dispatch_layout=ferry.DispatchLayout.TOKEN_MAJOR)
    local, cap = c.local_experts, c.expert_capacity
    x, indices, weights = send_arrays(b.rank)
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = array.array("H", bytes(2 * cap * HIDDEN))
        counts = array.array("i", [0] * local)
        num_rows = array.array("i", [0])
        token_experts = array.array("i", [0] * cap * K)
        token_weights = array.array("f", [0.0] * cap * K)
        a2a.dispatch_send(x, indices, weights, num_tokens=TOKENS[b.rank])
        # Expert padding is for the expert-major layout: refused, the step then taken as is.
        expect_error(ferry.InvalidArgument, "expert_padding 4", a2a.dispatch_recv, out, counts,
                     num_rows=num_rows, token_experts=token_experts,
                     token_weights=token_weights, timeout=10, expert_padding=4)
        a2a.dispatch_recv(out, counts, num_rows=num_rows, token_experts=token_experts,
                          token_weights=token_weights, timeout=10)
        # Each token that has an expert here arrives once, in (sender, token) order, with its
        # local experts and weights in the columns of its copies.
        want = []
        for s in range(WORLD):
            rows, experts = inputs(s)
            for t, row in enumerate(rows):
                ours = [(e - b.rank * local if e // local == b.rank else -1) for e in experts[t]]
                if any(e >= 0 for e in ours):
                    want.append((tuple(bf16(v) for v in row), ours,
                                 [w if e >= 0 else 0.0 for e, w in zip(ours, WEIGHTS)]))
        assert num_rows[0] == len(want), (num_rows[0], len(want))
        for i, (row, experts, ws) in enumerate(want):
            assert row_of(out, i) == row, i
            assert list(token_experts[i * K:(i + 1) * K]) == experts, i
            assert list(token_weights[i * K:(i + 1) * K]) == ws, i
        # Each rank returns its received rows as they came: a token sums to itself once per
        # rank that holds one of its experts.
        a2a.combine_send(out)
        y = array.array("H", bytes(2 * TOKENS[b.rank] * HIDDEN))
        a2a.combine_recv(y, timeout=10)
        rows, experts = inputs(b.rank)
        for t, row in enumerate(rows):
            holders = len({e // local for e in experts[t]})
            assert row_of(y, t) == tuple(bf16(v * holders) for v in row), (b.rank, t)


def fp8_body(b):
    c = config(b.rank, dtype=ferry.DispatchDtype.FP8_E4M3)
    local, cap, spt = c.local_experts, c.expert_capacity, c.scales_per_token
    rows, experts = inputs(b.rank)
    x = bytes((b.rank * 61 + i) % 256 for i in range(len(rows) * HIDDEN))
    scales = array.array("f", [float(b.rank * 100 + t) for t in range(len(rows))])
    indices = array.array("i", [e for pair in experts for e in pair])
    weights = array.array("f", [w for _ in rows for w in WEIGHTS])
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = bytearray(local * cap * HIDDEN)
        out_scales = array.array("f", [0.0] * local * cap * spt)
        counts = array.array("i", [0] * local)
        a2a.dispatch_send(x, indices, weights, scales=scales, num_tokens=len(rows))
        a2a.dispatch_recv(out, counts, scales=out_scales, timeout=10)
        for e in range(local):
            want = sorted((bytes((s * 61 + t * HIDDEN + h) % 256 for h in range(HIDDEN)),
                           float(s * 100 + t))
                          for s in range(WORLD) for t, ex in enumerate(inputs(s)[1])
                          if b.rank * local + e in ex)
            got = sorted((bytes(out[(e * cap + i) * HIDDEN:(e * cap + i + 1) * HIDDEN]),
                          out_scales[e * cap + i]) for i in range(counts[e]))
            assert got == want, (b.rank, e)


def bad_input_body(b):
    c = ferry.AllToAllConfig(world_size=1, rank=0, num_experts=EXPERTS, experts_per_token=K,
                             max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN)
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        x, indices, weights = send_arrays(0)

        def send(x, indices, weights, num_tokens=TOKENS[0], **kwargs):
            a2a.dispatch_send(x, indices, weights, num_tokens=num_tokens, **kwargs)

        expect_error(ferry.InvalidArgument, "9 tokens", send, x, indices, weights, num_tokens=9)
        expect_error(ferry.InvalidArgument, "num_tokens is required", a2a.dispatch_send, x, indices,
              weights)
        expect_error(ferry.InvalidArgument, "x:", send, x[:HIDDEN], indices, weights)
        expect_error(ferry.InvalidArgument, "indices:", send, x, array.array("f", indices), weights)
        expect_error(ferry.InvalidArgument, "scales:", send, x, indices, weights,
              scales=array.array("f", [1.0] * TOKENS[0]))
        bad = array.array("i", indices)
        bad[3] = EXPERTS
        expect_error(ferry.OutOfRange, "expert 8", send, x, bad, weights)
        # CUDA memory where the host device needs host memory.
        gpu = ferry.Array(0x1000, 1 << 20, 0, "u", 2, False, [MAX_TOKENS, HIDDEN], None)
        expect_error(ferry.InvalidArgument, "CUDA memory of device 0", send, gpu, indices, weights)
        expect_error(ferry.FailedPrecondition, "out of order", a2a.combine_send,
              array.array("H", bytes(2 * c.local_experts * c.expert_capacity * HIDDEN)))
        out = array.array("H", bytes(2 * c.local_experts * c.expert_capacity * HIDDEN))
        counts = array.array("i", [0] * c.local_experts)
        a2a.dispatch_send(x, indices, weights, num_tokens=TOKENS[b.rank])
        expect_error(ferry.InvalidArgument, "read-only", a2a.dispatch_recv, bytes(len(out) * 2),
              counts)
        a2a.dispatch_recv(out, counts, timeout=10)
        assert sum(counts) == TOKENS[0] * K
        kept = a2a.config
        # One engine serves one AllToAll per instance.
        expect_error(ferry.AlreadyExists, "instance 0 is taken", ferry.AllToAll, c, engine, b)
        c.instance = 1
        with ferry.AllToAll(c, engine, b) as second:
            assert second.config.instance == 1
    assert (kept.hidden, kept.num_experts) == (HIDDEN, EXPERTS)  # a copy, valid after close


def combine_weights_body(b):
    """Weights given at combine time take the dispatch's place (the dispatch's are ignored);
    with the sums taken at the expert rank they are refused."""
    c = config(b.rank)
    x, indices, _ = send_arrays(b.rank)
    rows, _ = inputs(b.rank)
    ignored = array.array("f", [9.0] * len(indices))
    late = array.array("f", [w for _ in rows for w in (0.125, 2.0)])
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = array.array("H", bytes(2 * c.local_experts * c.expert_capacity * HIDDEN))
        counts = array.array("i", [0] * c.local_experts)
        y = array.array("H", bytes(2 * TOKENS[b.rank] * HIDDEN))
        a2a.dispatch_send(x, indices, ignored, num_tokens=TOKENS[b.rank])
        a2a.dispatch_recv(out, counts, timeout=10)
        a2a.combine_send(out)
        expect_error(ferry.InvalidArgument, "weights:", a2a.combine_recv, y,
                     weights=array.array("f", [1.0]))
        a2a.combine_recv(y, timeout=10, weights=late)
        for t, row in enumerate(rows):
            assert row_of(y, t) == tuple(bf16(v * 2.125) for v in row), t
    reduced = config(b.rank, combine_reduce_at_expert_rank=True)
    with shm_engine() as engine, ferry.AllToAll(reduced, engine, b) as a2a:
        a2a.dispatch_send(x, indices, ignored, num_tokens=TOKENS[b.rank])
        a2a.dispatch_recv(out, counts, timeout=10)
        a2a.combine_send(out)
        expect_error(ferry.InvalidArgument, "combine_reduce_at_expert_rank", a2a.combine_recv, y,
                     weights=late)
        a2a.combine_recv(y, timeout=10)  # the step still ends, with the dispatch's weights


def one_call_body(b):
    """dispatch() and combine() run the halves that `halves` names, as the four steps would:
    both in one call, then each half in a call of its own (the receive halves without their
    send's arguments); a halves value outside 1..3 is refused before anything runs."""
    c = config(b.rank)
    x, indices, weights = send_arrays(b.rank)
    rows, _ = inputs(b.rank)
    amax = ferry.Fp8Scaling.AMAX
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = array.array("H", bytes(2 * c.local_experts * c.expert_capacity * HIDDEN))
        counts = array.array("i", [0] * c.local_experts)
        for halves in (0, 4):
            expect_error(ferry.InvalidArgument, "halves", a2a.dispatch, x, indices, weights,
                         None, TOKENS[b.rank], None, amax, out, counts, None, 10, 0, None,
                         halves, True, True)
        for split in (False, True):
            y = array.array("H", bytes(2 * TOKENS[b.rank] * HIDDEN))
            send = (x, indices, weights, None, TOKENS[b.rank], None, amax)
            recv = (out, counts, None, 10, 0, None)
            none = (None,) * 6 + (amax,)
            if split:
                a2a.dispatch(*send, *(None, None, None, 10, 0, None), 1, True, True)
                a2a.dispatch(*none, *recv, 2, True, True)
                a2a.combine(out, None, None, False, 10, None, 1, True, True)
                a2a.combine(None, y, None, False, 10, None, 2, True, True)
            else:
                a2a.dispatch(*send, *recv, 3, True, True)
                a2a.combine(out, y, None, False, 10, None, 3, True, True)
            local = range(b.rank * c.local_experts, (b.rank + 1) * c.local_experts)
            assert list(counts) == [sum(e in ex for s in range(WORLD) for ex in inputs(s)[1])
                                    for e in local], (split, list(counts))
            for t, row in enumerate(rows):
                assert row_of(y, t) == tuple(bf16(v * sum(WEIGHTS)) for v in row), (split, t)


class LegacyDefaultStream:
    cuda_stream = 0  # what torch.cuda.current_stream() has unless a stream was set


def legacy_stream_body(b):
    """The legacy default stream is refused by name (taken as "no stream" it would leave the
    steps unordered with the kernels on it); None stays "back to waiting"."""
    with shm_engine() as engine, ferry.AllToAll(config(b.rank), engine, b) as a2a:
        expect_error(ferry.InvalidArgument, "legacy default stream", a2a.set_stream,
                     LegacyDefaultStream())
        expect_error(ferry.InvalidArgument, "legacy default stream", a2a.set_stream, 0)
        expect_error(ferry.Unimplemented, "need the CUDA device", a2a.set_stream, None)
        # The host device's steps wait for themselves: poll() finds nothing in flight, and
        # release_finished has nothing to let go (with or without a caller's stream).
        assert a2a.poll() is True and a2a.pending_arrays == 0
        assert a2a.release_finished() is None and a2a.release_finished(0) is None
        assert a2a.pending_arrays == 0


def id_types_body(b):
    """int64 ids (what torch.topk gives) and uint32 ids route as int32 ones do on the host device;
    -1 is a copy routed nowhere; an int64 id out of range is refused before anything is sent."""
    c = config(b.rank)
    x, indices, weights = send_arrays(b.rank)
    rows, _ = inputs(b.rank)
    with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
        out = array.array("H", bytes(2 * c.local_experts * c.expert_capacity * HIDDEN))
        counts = array.array("i", [0] * c.local_experts)
        y = array.array("H", bytes(2 * TOKENS[b.rank] * HIDDEN))
        huge = array.array("q", indices)
        huge[1] = 1 << 40
        expect_error(ferry.OutOfRange, f"expert {1 << 40}", a2a.dispatch_send, x, huge, weights,
                     num_tokens=TOKENS[b.rank])
        none = array.array("q", indices)
        none[1] = -1  # token 0's second copy
        for ids, first_weight in ((array.array("q", indices), sum(WEIGHTS)),
                                  (array.array("I", indices), sum(WEIGHTS)),
                                  (none, WEIGHTS[0])):
            a2a.dispatch_send(x, ids, weights, num_tokens=TOKENS[b.rank])
            a2a.dispatch_recv(out, counts, timeout=10)
            a2a.combine_send(out)  # experts that return their input
            a2a.combine_recv(y, timeout=10)
            for t, row in enumerate(rows):
                w = first_weight if t == 0 else sum(WEIGHTS)
                assert row_of(y, t) == tuple(bf16(v * w) for v in row), (ids.typecode, t)


class FakeDist:
    """What torch_bootstrap needs of torch.distributed, over a ferry bootstrap."""

    def __init__(self, bootstrap):
        self.b = bootstrap

    def get_rank(self, group=None):
        return self.b.rank

    def get_world_size(self, group=None):
        return self.b.world_size

    def all_gather_object(self, out, obj, group=None):
        out[:] = self.b.all_gather(obj)


def torch_bootstrap_body(b):
    bootstrap = ferry.torch_bootstrap(dist=FakeDist(b))
    assert (bootstrap.rank, bootstrap.world_size) == (b.rank, WORLD)
    expert_major_body(bootstrap)


class AllToAllTest(unittest.TestCase):
    def test_expert_major_bf16(self):
        run_ranks(self, WORLD, expert_major_body)

    def test_float16_rows_moved_and_combined_as_fp16(self):
        try:
            import numpy  # noqa: F401
        except ImportError:
            self.skipTest("no numpy for this interpreter")
        run_ranks(self, WORLD, float16_body)

    def test_a_world_of_one_grows_to_two(self):
        alone, grown = free_address(), free_address()
        run_ranks(self, WORLD, lambda b: grow_body(b, alone, grown))

    def test_a_rank_that_left_is_readmitted_as_a_new_process(self):
        first, again = free_address(), free_address()
        run_ranks(self, WORLD + 1, lambda b: rejoin_body(b, first, again))

    def test_float32_out_takes_the_sums_unrounded(self):
        try:
            import numpy  # noqa: F401
        except ImportError:
            self.skipTest("no numpy for this interpreter")
        run_ranks(self, WORLD, fp32_out_body)

    def test_token_major_once_per_rank_reduced(self):
        run_ranks(self, WORLD, token_major_body)

    def test_fp8_with_scales(self):
        run_ranks(self, WORLD, fp8_body)

    def test_weights_given_at_combine_time(self):
        run_ranks(self, WORLD, combine_weights_body)

    def test_both_halves_in_one_call(self):
        run_ranks(self, WORLD, one_call_body)

    def test_set_stream_refuses_the_legacy_default_stream(self):
        run_ranks(self, WORLD, legacy_stream_body)

    def test_int64_and_uint32_ids_and_unrouted_copies(self):
        run_ranks(self, WORLD, id_types_body)

    def test_bad_input(self):
        run_ranks(self, 1, bad_input_body)

    def test_over_a_torch_style_bootstrap(self):
        run_ranks(self, WORLD, torch_bootstrap_body)

    def test_config(self):
        c = config(1)
        self.assertEqual((c.local_experts, c.token_bytes, c.expert_capacity), (4, 256, 16))
        with self.assertRaises(ferry.InvalidArgument):
            ferry.AllToAllConfig(world_size=2, num_experts=8, experts_per_token=2,
                                 max_tokens_per_rank=8, hidden=100).validate()
        with self.assertRaises(TypeError):
            config(0, hiden=128)

    def test_forwarding_default_chosen(self):
        """forwarding defaults to AUTO, which takes node-once for several nodes of several
        ranks and per rank on one node (chosen_forwarding says which)."""
        c = ferry.AllToAllConfig(world_size=16, rank=3, ranks_per_node=8, num_experts=256,
                                 experts_per_token=8, max_tokens_per_rank=128, hidden=7168)
        self.assertEqual(c.forwarding, ferry.Forwarding.AUTO)
        self.assertEqual(c.chosen_forwarding(), ferry.Forwarding.NODE_ONCE)
        c.ranks_per_node = 16
        self.assertEqual(c.chosen_forwarding(), ferry.Forwarding.PER_RANK)
        c.ranks_per_node, c.forwarding = 8, ferry.Forwarding.PER_RANK
        self.assertEqual(c.chosen_forwarding(), ferry.Forwarding.PER_RANK)

    def test_streaming_and_cuda_tuning(self):
        """Which steps stream is a config field the ranks agree on (a typed value); the CUDA
        device's diagnostics are set in place or whole, or read from the environment by
        from_env (a bad value refused naming its variable)."""
        c = config(0)
        self.assertEqual(c.streaming, ferry.Streaming.AUTO)
        c.streaming = ferry.Streaming.BOTH
        self.assertEqual(c.streaming, ferry.Streaming.BOTH)
        c.validate()
        with self.assertRaises(TypeError):
            c.streaming = 3
        self.assertEqual((c.cuda.trace, c.cuda.relay_trace), (False, False))
        c.cuda = ferry.CudaTuning(trace=True)
        self.assertTrue(c.cuda.trace)
        os.environ["FERRY_NV_TRACE"] = "1"
        try:
            self.assertTrue(ferry.CudaTuning.from_env().trace)
            os.environ["FERRY_NV_TRACE"] = "2"
            with self.assertRaisesRegex(ferry.InvalidArgument, "FERRY_NV_TRACE"):
                ferry.CudaTuning.from_env()
        finally:
            del os.environ["FERRY_NV_TRACE"]

if __name__ == "__main__":
    unittest.main()
