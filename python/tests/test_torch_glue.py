"""ferry._ferry_torch (torch's tensors read and made in C++) against torch's Python API, which
the bindings use without it: the same Array read from every kind of tensor, and
AllToAll.dispatch_recv_new's tensors holding what dispatch_recv writes into the caller's, with
the module and without (two ranks on the host device, over shm)."""

import unittest

import torch

import ferry
from ferry import _ferry
from ranks import expect_error, run_ranks, shm_engine

WORLD, EXPERTS, K, HIDDEN, TOKENS = 2, 8, 2, 128, 6


def glue_built():
    return _ferry._use_torch_glue(True)


class Glue:
    """The bindings with _ferry_torch switched on or off for the block."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.was = _ferry._use_torch_glue(self.on)

    def __exit__(self, *exc):
        _ferry._use_torch_glue(self.was)
        return False


def described(t):
    a = _ferry.torch_array(t)
    return None if a is None else (a.data, a.num_bytes, a.device, a.kind, a.item_bytes,
                                   list(a.shape), a.owner is t)


def token_major(rank, **fields):
    return ferry.AllToAllConfig(world_size=WORLD, rank=rank, num_experts=EXPERTS,
                                experts_per_token=K, max_tokens_per_rank=TOKENS, hidden=HIDDEN,
                                dispatch_once_per_rank=True, combine_reduce_at_expert_rank=True,
                                dispatch_layout=ferry.DispatchLayout.TOKEN_MAJOR, **fields)


def recv_new_body(glue):
    def body(b):
        with Glue(glue):
            assert _ferry._torch_glue_loaded() == (glue and glue_built())
            g = torch.Generator().manual_seed(b.rank)
            x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(TOKENS)])
            w = torch.rand(TOKENS, K, generator=g)
            c = token_major(b.rank, forwarding=ferry.Forwarding.PER_RANK)
            with shm_engine() as engine, ferry.AllToAll(c, engine, b) as a2a:
                cap, local = c.expert_capacity, c.local_experts
                # The caller's tensors, filled by dispatch_recv: what the made ones must hold.
                want = (torch.empty(cap, HIDDEN, dtype=torch.bfloat16),
                        torch.empty(local, dtype=torch.int32), torch.empty(1, dtype=torch.int32),
                        torch.empty(cap, K, dtype=torch.int32),
                        torch.empty(cap, K, dtype=torch.float32),
                        torch.empty(2, cap, dtype=torch.int32))
                a2a.dispatch_send(x, ids, w)
                a2a.dispatch_recv(*want[:2], num_rows=want[2], token_experts=want[3],
                                  token_weights=want[4], source_tokens=want[5][0],
                                  source_ranks=want[5][1], timeout=10)
                a2a.combine_send(want[0])
                a2a.combine_recv(torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16), timeout=10)
                for sources in (True, False):
                    a2a.dispatch_send(x, ids, w)
                    got = a2a.dispatch_recv_new(x.dtype, -1, sources=sources, timeout=10)
                    recv, scales, counts, experts, weights, tokens, senders = got
                    assert scales is None, "bf16 rows have no scales"
                    assert (recv.dtype, tuple(recv.shape)) == (torch.bfloat16, (cap, HIDDEN))
                    assert tuple(counts.shape) == (1 + local,) and counts.dtype == torch.int32
                    rows = int(counts[0])
                    assert rows == int(want[2][0]) and rows > 0, (rows, want[2])
                    assert torch.equal(counts[1:], want[1])
                    assert torch.equal(recv[:rows], want[0][:rows])
                    # int64 ids (torch's index type), the int32 receive's values.
                    assert experts.dtype == torch.int64
                    assert torch.equal(experts[:rows], want[3][:rows].long())
                    assert torch.equal(weights[:rows], want[4][:rows])
                    if sources:
                        assert torch.equal(tokens[:rows], want[5][0, :rows])
                        assert torch.equal(senders[:rows], want[5][1, :rows])
                        assert set(senders[:rows].tolist()) <= set(range(WORLD))
                    else:
                        assert tokens is None and senders is None
                    a2a.combine_send(recv)
                    a2a.combine_recv(torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16),
                                     timeout=10)
            # The layout it makes is token-major's: an expert-major AllToAll refuses.
            em = ferry.AllToAllConfig(world_size=WORLD, rank=b.rank, num_experts=EXPERTS,
                                      experts_per_token=K, max_tokens_per_rank=TOKENS,
                                      hidden=HIDDEN, instance=3)
            with shm_engine() as engine, ferry.AllToAll(em, engine, b) as a2a:
                expect_error(ferry.InvalidArgument, "token-major", a2a.dispatch_recv_new,
                             torch.bfloat16, -1)
    return body


class TorchGlueTest(unittest.TestCase):
    def test_each_tensor_is_read_as_the_python_path_reads_it(self):
        if not glue_built():
            self.skipTest("ferry._ferry_torch not built (no torch C++ headers)")
        base = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
        tensors = [base, base.to(torch.bfloat16), base.to(torch.int32), base.to(torch.int64),
                   base.to(torch.uint8), base > 3, base[1], torch.zeros(0, 5), torch.tensor(7.0),
                   base[:, :, :2],  # not contiguous: neither path takes it
                   base.transpose(0, 2)]
        for t in tensors:
            with Glue(True):
                fast = described(t)
            with Glue(False):
                slow = described(t)
            self.assertEqual(fast, slow, (t.dtype, tuple(t.shape), t.stride()))
        with Glue(True):
            self.assertIsNone(_ferry.torch_array(bytearray(4)))

    def test_first_rows_views_each_tensors_first_rows(self):
        a = torch.arange(20, dtype=torch.int32).view(5, 4)
        b = torch.arange(5, dtype=torch.float32)
        for glue in (True, False):
            with Glue(glue):
                got = _ferry.first_rows(3, a, None, b)
                self.assertEqual(len(got), 3)
                self.assertTrue(torch.equal(got[0], a[:3]))
                self.assertIsNone(got[1])
                self.assertTrue(torch.equal(got[2], b[:3]))
                got[0][0, 0] = 99  # a view: written through to a
                self.assertEqual(int(a[0, 0]), 99)
                a[0, 0] = 0
                self.assertEqual(tuple(_ferry.first_rows(9, b)[0].shape), (5,))
                self.assertEqual(_ferry.first_rows(0), ())
                with self.assertRaises(ferry.InvalidArgument):
                    _ferry.first_rows(-1, a)
                with self.assertRaises(TypeError):
                    _ferry.first_rows()

    def test_empty_makes_what_torch_empty_makes(self):
        for glue in (True, False):
            with Glue(glue):
                for dtype, shape in ((torch.bfloat16, (3, 4)), (torch.int32, (5,)),
                                     (torch.float32, ()), (torch.uint8, (2, 0, 3))):
                    t = _ferry.empty(dtype, -1, *shape)
                    self.assertEqual((t.dtype, tuple(t.shape), t.device.type),
                                     (dtype, shape, "cpu"))
                    self.assertTrue(t.is_contiguous())
                with self.assertRaises(ferry.InvalidArgument):
                    _ferry.empty(torch.int32, -1, -2)
                with self.assertRaises(ferry.InvalidArgument):
                    _ferry.empty(torch.int32, -3, 2)
                with self.assertRaises(TypeError):
                    _ferry.empty(torch.int32)

    def test_check_tensor_names_what_is_wrong(self):
        from ferry.compat._group import check_tensor
        t = torch.zeros(4, 3, dtype=torch.int32)
        for glue in (True, False):
            with Glue(glue):
                check_tensor("t", t)
                check_tensor("t", t, (torch.int64, torch.int32), 2, -1)
                check_tensor("t", t, dtype=torch.int32, dims=2, device=-1)
                for args, text in (((t, torch.float32), "t: dtype torch.int32, expected "
                                    "torch.float32"),
                                   ((t, (torch.int64, torch.uint8)), "expected torch.int64 or "
                                    "torch.uint8"),
                                   ((t, None, 3), "t: 2 dimensions (4, 3), expected 3"),
                                   ((t, None, None, 0), "t: on cpu, the others on cuda:0"),
                                   ((t.t(), None), "t: not contiguous"),
                                   ((t.tolist(),), "t: expected a torch.Tensor, got list")):
                    with self.assertRaises(ferry.InvalidArgument) as e:
                        check_tensor("t", *args)
                    self.assertIn(text, str(e.exception))
                with self.assertRaises(TypeError):
                    check_tensor("t")
                with self.assertRaises(TypeError):
                    check_tensor("t", t, bogus=1)

    def test_the_switch_says_what_it_was(self):
        built = glue_built()
        self.assertEqual(_ferry._use_torch_glue(False), built)
        self.assertFalse(_ferry._torch_glue_loaded())
        self.assertFalse(_ferry._use_torch_glue(True))
        self.assertEqual(_ferry._torch_glue_loaded(), built)

    def test_dispatch_recv_new_with_the_glue(self):
        if not glue_built():
            self.skipTest("ferry._ferry_torch not built (no torch C++ headers)")
        run_ranks(self, WORLD, recv_new_body(True))

    def test_dispatch_recv_new_through_torchs_python_api(self):
        run_ranks(self, WORLD, recv_new_body(False))


if __name__ == "__main__":
    unittest.main()
