"""ferry.deep_ep against DeepEP V1's public API, name by name: every name of `deep_ep` 1.2.1's
package (its __init__, Buffer, Config, EventOverlap, utils) is present with V1's parameters in
V1's order and defaults, or refused by name where ferry cannot do it; and what V1's docstrings
promise of the names that are not moving rows (the rows are test_compat_deep_ep's). The V1
references below are written from V1's docstrings and signatures."""

import inspect
import os
import subprocess
import sys
import unittest

import ferry

try:
    import torch
except ImportError:
    torch = None

# DeepEP V1 (deep_ep 1.2.1): each Buffer method's parameters after self, as (name, default);
# NO_DEFAULT for a required one. Static methods are marked.
NO_DEFAULT = object()
V1_BUFFER = {
    "__init__": [("group", NO_DEFAULT), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                 ("low_latency_mode", False), ("num_qps_per_rank", 24),
                 ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
                 ("comm", None)],
    "destroy": [],
    "is_sm90_compiled": "static", "set_num_sms": "static", "capture": "static",
    "get_low_latency_rdma_size_hint": "static", "get_dispatch_config": "static",
    "get_combine_config": "static",
    "get_comm_stream": [],
    "get_local_buffer_tensor": [("dtype", NO_DEFAULT), ("size", None), ("offset", 0),
                                ("use_rdma_buffer", False)],
    "get_dispatch_layout": [("topk_idx", NO_DEFAULT), ("num_experts", NO_DEFAULT),
                            ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": [("x", NO_DEFAULT), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                 ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                 ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False),
                 ("allocate_on_comm_stream", False)],
    "combine": [("x", NO_DEFAULT), ("handle", NO_DEFAULT), ("topk_weights", None),
                ("bias", None), ("config", None), ("previous_event", None),
                ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", NO_DEFAULT),
                                 ("hidden", NO_DEFAULT), ("num_experts", NO_DEFAULT)],
    "low_latency_dispatch": [("x", NO_DEFAULT), ("topk_idx", NO_DEFAULT),
                             ("num_max_dispatch_tokens_per_rank", NO_DEFAULT),
                             ("num_experts", NO_DEFAULT),
                             ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                             ("round_scale", False), ("use_ue8m0", False),
                             ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", NO_DEFAULT), ("topk_idx", NO_DEFAULT),
                            ("topk_weights", NO_DEFAULT), ("handle", NO_DEFAULT),
                            ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                            ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", NO_DEFAULT)],
    "low_latency_update_mask_buffer": [("rank_to_mask", NO_DEFAULT), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", NO_DEFAULT)],
    "low_latency_clean_mask_buffer": [],
}
V1_STATIC = {"is_sm90_compiled": [], "set_num_sms": [("new_num_sms", NO_DEFAULT)], "capture": [],
             "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", NO_DEFAULT),
                                                ("hidden", NO_DEFAULT), ("num_ranks", NO_DEFAULT),
                                                ("num_experts", NO_DEFAULT)],
             "get_dispatch_config": [("num_ranks", NO_DEFAULT)],
             "get_combine_config": [("num_ranks", NO_DEFAULT)]}
V1_CONFIG = [("num_sms", NO_DEFAULT), ("num_max_nvl_chunked_send_tokens", NO_DEFAULT),
             ("num_max_nvl_chunked_recv_tokens", NO_DEFAULT),
             ("num_max_rdma_chunked_send_tokens", NO_DEFAULT),
             ("num_max_rdma_chunked_recv_tokens", NO_DEFAULT)]


def parameters(fn, skip_self):
    """fn's parameters as (name, default) up to its first keyword-only one (ferry's own
    additions are keyword-only)."""
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1 if skip_self else 0:]:
        if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL):
            break
        out.append((p.name, NO_DEFAULT if p.default is p.empty else p.default))
    return out


class FakeMpiComm:
    """What DeepEP's `comm=` takes of an mpi4py communicator: its rank, size and allgather (one
    rank here)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]


@unittest.skipIf(torch is None, "torch is not installed")
class DeepEpV1NamesTest(unittest.TestCase):
    def test_every_buffer_method_has_v1s_parameters(self):
        """Each of V1's Buffer methods: present, V1's parameters in V1's order with V1's
        defaults (ferry's own additions after them, keyword-only); the static ones static.
        ferry's group defaults to torch.distributed's default group where V1 requires one."""
        from ferry import deep_ep
        for name, want in V1_BUFFER.items():
            self.assertTrue(hasattr(deep_ep.Buffer, name), name)
            attr = inspect.getattr_static(deep_ep.Buffer, name)
            if want == "static":
                self.assertIsInstance(attr, staticmethod, name)
                self.assertEqual(parameters(attr.__func__, False), V1_STATIC[name], name)
                continue
            got = parameters(getattr(deep_ep.Buffer, name), True)
            if name == "__init__":
                self.assertEqual(got[0], ("group", None))
                got, want = got[1:], want[1:]
            self.assertEqual(got, want, name)

    def test_the_packages_names(self):
        """deep_ep's __all__ names, topk_idx_t (the dtype callers convert ids to), __version__,
        Config with V1's five parameters and its two size hints, EventOverlap and utils'
        names."""
        from ferry import deep_ep
        for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
            self.assertIn(name, deep_ep.__all__)
            self.assertTrue(hasattr(deep_ep, name), name)
        self.assertIs(deep_ep.topk_idx_t, torch.int64)
        self.assertEqual(deep_ep.__version__, "1.2.1")
        self.assertEqual([n for n, _ in parameters(deep_ep.Config, False)],
                         [n for n, _ in V1_CONFIG])
        config = deep_ep.Config(20, 6, 256, 6, 128)
        self.assertGreater(config.get_nvl_buffer_size_hint(7168 * 2, 8), 0)
        self.assertGreater(config.get_rdma_buffer_size_hint(7168 * 2, 16), 0)
        self.assertEqual([n for n, _ in parameters(deep_ep.EventOverlap, False)],
                         ["event", "extra_tensors"])
        for name in ("EventOverlap", "check_nvlink_connections"):
            self.assertTrue(hasattr(deep_ep.utils, name), name)
        self.assertIs(deep_ep.utils.EventOverlap, deep_ep.EventOverlap)

    def test_static_helpers_answer_as_v1s(self):
        """is_sm90_compiled: whether ferry's CUDA kernels are built; capture(): an EventOverlap
        (of an event on the current stream where CUDA is; none here on the CPU); set_num_sms
        refuses an odd count; the config getters give Configs."""
        from ferry import deep_ep
        self.assertIs(deep_ep.Buffer.is_sm90_compiled(), ferry._ferry.cuda_device_built())
        captured = deep_ep.Buffer.capture()
        self.assertIsInstance(captured, deep_ep.EventOverlap)
        if not torch.cuda.is_available():
            self.assertIsNone(captured.event)
        with captured:  # as callers wait for one
            pass
        with self.assertRaises(ferry.InvalidArgument):
            deep_ep.Buffer.set_num_sms(21)
        for getter in (deep_ep.Buffer.get_dispatch_config, deep_ep.Buffer.get_combine_config):
            self.assertIsInstance(getter(16), deep_ep.Config)

    def test_what_ferry_cannot_do_is_refused_by_name(self):
        """use_fabric (fabric memory handles), allow_mnnvl, the raw buffer tensor; on the CPU
        the communication stream: each refused naming it."""
        from ferry import deep_ep
        b = ferry.CallbackBootstrap(0, 1, lambda data, timeout: [data])
        for kwargs, name in (({"use_fabric": True}, "use_fabric"),
                             ({"allow_mnnvl": True}, "allow_mnnvl")):
            with self.assertRaises(ferry.Unimplemented) as raised:
                deep_ep.Buffer(b, **kwargs)
            self.assertIn(name, str(raised.exception))
        # ferry's own keyword: node-once forwarding needs several nodes of several ranks.
        with self.assertRaises(ferry.InvalidArgument) as raised:
            deep_ep.Buffer(b, forwarding=ferry.Forwarding.NODE_ONCE)
        self.assertIn("several nodes", str(raised.exception))
        buf = deep_ep.Buffer(b, explicitly_destroy=True)
        with self.assertRaises(ferry.Unimplemented) as raised:
            buf.get_local_buffer_tensor(torch.bfloat16)
        self.assertIn("get_local_buffer_tensor", str(raised.exception))
        if not torch.cuda.is_available():
            with self.assertRaises(ferry.Unimplemented) as raised:
                buf.get_comm_stream()
            self.assertIn("get_comm_stream", str(raised.exception))
        buf.destroy()

    def test_an_mpi_communicator_instead_of_a_group(self):
        """comm= (an mpi4py communicator, DeepEP's alternative to group): the Buffer's ranks are
        its, and a low-latency round trip with topk_idx_t ids moves every row."""
        from ferry import deep_ep
        buf = deep_ep.Buffer(None, comm=FakeMpiComm(), low_latency_mode=True,
                             explicitly_destroy=True)
        self.assertEqual((buf.rank, buf.group_size), (0, 1))
        x = torch.arange(4 * 128, dtype=torch.float32).view(4, 128).to(torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=deep_ep.topk_idx_t)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
        self.assertEqual(count.tolist(), [2, 2, 2, 2])
        w = torch.full((4, 2), 0.5)
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        self.assertTrue(torch.equal(out, x))  # each token: its two copies, half each
        buf.destroy()

    def test_the_normal_mode_runs_in_cpp_and_a_refused_call_holds_nothing(self):
        """dispatch and combine are the C++ base's methods (one call from Python, no frame of
        ours between); a dispatch refused for what the Buffer's size decides (num_worst_tokens
        past every rank's rows) is refused before its steps, so the shape's AllToAll stays
        free: the next dispatch of the shape runs, on the same one, and its handle combines
        once."""
        from ferry import _ferry, deep_ep
        for name in ("dispatch", "combine"):
            self.assertIs(inspect.getattr_static(deep_ep.Buffer, name).__objclass__,
                          _ferry.DeepEpBuffer, name)
        buf = deep_ep.Buffer(None, comm=FakeMpiComm(), num_nvl_bytes=1 << 16,
                             explicitly_destroy=True)
        x = torch.arange(4 * 128, dtype=torch.float32).view(4, 128).to(torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, -1], [2, 3], [3, 0]], dtype=deep_ep.topk_idx_t)
        layout = buf.get_dispatch_layout(idx, 4)
        args = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                    num_tokens_per_expert=layout[2], topk_idx=idx)
        rows = (1 << 16) // (128 * 2 + 4 + 16)  # what 64 KiB hold of one rank's rows
        with self.assertRaisesRegex(ferry.InvalidArgument,
                                    f"num_worst_tokens {rows + 1}: more than the {rows} rows"):
            buf.dispatch(x, num_worst_tokens=rows + 1, **args)
        recv, recv_idx, _, per_expert, handle, _ = buf.dispatch(x, **args)
        self.assertEqual(per_expert, [2, 2, 1, 2])  # rows per local expert (all four here)
        self.assertEqual(recv_idx.dtype, torch.int64)
        self.assertEqual(len(buf._group.all_to_alls("normal")), 1)
        out, weights, _ = buf.combine(recv, handle)
        self.assertIsNone(weights)
        self.assertTrue(torch.equal(out, x))  # one rank: each token's one row
        with self.assertRaisesRegex(ferry.InvalidArgument, "combined already"):
            buf.combine(recv, handle)
        buf.destroy()
        with self.assertRaisesRegex(ferry.InvalidArgument, "destroyed"):
            buf.dispatch(x, **args)

    def test_check_nvlink_connections_agrees_with_torch(self):
        """utils.check_nvlink_connections(group) raises exactly where two GPUs of this host cannot
        reach each other's memory, as torch reports it (needs two GPUs to check anything)."""
        from ferry import deep_ep
        if torch.cuda.device_count() < 2:
            self.skipTest("fewer than two GPUs: no pair to check")
        n = torch.cuda.device_count()
        reachable = all(torch.cuda.can_device_access_peer(i, j)
                        for i in range(n) for j in range(n) if i != j)
        if reachable:
            deep_ep.utils.check_nvlink_connections(None)
        else:
            with self.assertRaises(ferry.InvalidArgument):
                deep_ep.utils.check_nvlink_connections(None)

    def test_the_shim_has_the_same_names(self):
        """`import deep_ep` through the shim: topk_idx_t, __version__ and
        utils.check_nvlink_connections as ferry.deep_ep's."""
        from ferry import deep_ep
        code = ("import deep_ep, deep_ep.utils, torch\n"
                "assert deep_ep.topk_idx_t is torch.int64 and deep_ep.__version__ == '1.2.1'\n"
                "import ferry.deep_ep\n"
                "assert deep_ep.utils.check_nvlink_connections is "
                "ferry.deep_ep.utils.check_nvlink_connections\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [deep_ep.shim_path()] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)


if __name__ == "__main__":
    unittest.main()
