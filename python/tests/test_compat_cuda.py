"""ferry.compat's layers on the CUDA device: the calls and torch references of
test_compat_deep_ep, test_compat_deep_ep_v2, test_compat_pplx and test_compat_pplx_kernels
with the layers' tensors on the GPU (ranks of one node sharing this machine's first GPU: world
size 1, and 2 where two ranks fit, as MPS clients under tools/gpu_check.sh). Skips without a
GPU, or torch with CUDA, in a probe rank: CUDA is touched only inside the forked ranks (a
process must not fork after initialising it). The expert ids, fp8 made inside the dispatch,
the combine-time weights and the padded expert blocks here run in ferry's CUDA kernels."""

import os
import unittest

import ferry
import compat_reference as refs
import test_compat_deep_ep as deep_ep_tests
import test_compat_deep_ep_v2 as deep_ep_v2_tests
import test_compat_pplx as pplx_tests
import test_compat_pplx_kernels as pplx_kernels_tests

NO_GPU = 3


def probe(b):
    try:
        import torch
        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    os._exit(0 if ok else NO_GPU)


def on_gpu(body, own_stream=True):
    """body with the layers' tensors on the GPU, called on a stream of the caller's own (or on
    the legacy default stream, torch's current one unless a stream is set)."""
    def run(b, store):
        import torch
        refs.DEV = "cuda"
        torch.cuda.set_device(0)
        if own_stream:
            with torch.cuda.stream(torch.cuda.Stream()):
                body(b, store)
        else:
            body(b, store)
        torch.cuda.synchronize()
    return run


def captured(step):
    """step() run twice (what a layer sets up at its first calls: its AllToAll, its streams,
    both of deep_ep's output sets), then captured once as a CUDA graph on torch's capture
    stream."""
    import torch
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def check_replays(graph, world, rank, captured_inputs, out, ids_of=lambda idx: idx):
    """Three replays of `graph` over new rows, ids and weights copied into the tensors it
    captured (x, ids, weights; ids_of(idx): what the ids tensor holds), each replay's `out`
    against the reference for its inputs."""
    import torch
    x, ids, w = captured_inputs
    for r in range(1, 4):
        rx, ridx, rw = refs.inputs(world, rank, round=r)
        x.copy_(rx)
        ids.copy_(ids_of(ridx))
        w.copy_(rw)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().float(),
                                   refs.weighted_reference(rx, ridx, rw).float(), rtol=2 ** -7,
                                   atol=2 ** -6)


def graph_body(world, kind):
    """A low-latency dispatch, an expert and the combine captured once as a CUDA graph (as an
    engine captures its decode step), then replayed over new rows, ids and weights copied into
    the captured tensors: each replay's output against the reference for its inputs."""
    def body(b, store):
        import torch
        from ferry import deep_ep
        group = refs.group_of(b, store, kind)
        buf = deep_ep.Buffer(group, explicitly_destroy=True)
        e, local = refs.EXPERTS_PER_RANK * world, refs.EXPERTS_PER_RANK
        x, idx, w = (t.cuda() for t in refs.inputs(world, b.rank))
        factor = torch.tensor([refs.expert_factor(b.rank * local + le) for le in range(local)],
                              device="cuda").view(local, 1, 1)
        out = torch.empty_like(x)

        def step():
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, refs.MAX_TOKENS, e,
                                                             use_fp8=False)
            y = (recv.float() * factor).to(torch.bfloat16)  # rows past the counts: unread
            buf.low_latency_combine(y, idx, w, handle, out=out)

        check_replays(captured(step), world, b.rank, (x, idx, w), out)
        buf.destroy()
    return body


def pplx_graph_body(world, kind):
    """pplx's dispatch, an expert over the padded blocks and the combine captured once as a
    CUDA graph (on torch's capture stream, not the one the warm-up calls ran on), then replayed
    with new inputs and another bound_m each time (the token count the kernels read): the first
    bound_m tokens' output against the reference."""
    def body(b, store):
        import torch
        from ferry import pplx
        group = refs.group_of(b, store, kind)
        local, pad = refs.EXPERTS_PER_RANK, pplx_tests.PADDING
        a2a = pplx.AllToAll(max_num_tokens=refs.MAX_TOKENS, num_experts=local * world,
                            expert_padding=pad, hidden_dim=refs.HIDDEN, hidden_dim_scale=None,
                            in_dtype=torch.bfloat16, out_dtype=torch.bfloat16, scale_dtype=None,
                            num_experts_per_token=refs.K, device=torch.device("cuda"),
                            global_group=group)
        x, idx, w = (t.cuda() for t in refs.inputs(world, b.rank))
        ids = idx.to(torch.int32)
        bound = torch.tensor([x.shape[0]], dtype=torch.int32, device="cuda")
        rows = a2a.max_recv_tokens
        counts = torch.empty(local, dtype=torch.int32, device="cuda")
        out_x = torch.zeros(rows, refs.HIDDEN, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(out_x)
        out = torch.zeros_like(x)
        factor = torch.tensor([refs.expert_factor(b.rank * local + le) for le in range(local)],
                              device="cuda")
        row = torch.arange(rows, device="cuda")

        def step():
            a2a.dispatch(counts, out_x, None, x, None, ids, w, bound_m=bound)
            ends = torch.cumsum((counts.long() + pad - 1) // pad * pad, 0)
            expert = torch.searchsorted(ends, row, right=True).clamp(max=local - 1)
            y.copy_((out_x.float() * factor[expert][:, None]).to(torch.bfloat16))
            a2a.combine(out, ids, w, y, bound_m=bound)

        graph = captured(step)
        for r in range(1, 4):
            rx, ridx, rw = refs.inputs(world, b.rank, round=r)
            m = max(0, rx.shape[0] - r)  # fewer tokens each replay
            x.copy_(rx)
            ids.copy_(ridx.to(torch.int32))
            w.copy_(rw)
            bound.fill_(m)
            graph.replay()
            torch.cuda.synchronize()
            want = refs.weighted_reference(rx[:m], ridx[:m], rw[:m])
            torch.testing.assert_close(out[:m].cpu().float(), want.float(), rtol=2 ** -7,
                                       atol=2 ** -6)
        a2a.destroy()
    return body


def pplx_kernels_graph_body(world):
    """pplx-kernels' AllToAll as vLLM's pplx backend drives it in a captured decode step: the
    dispatch's and the combine's send and receive halves (its hooks) with an expert between,
    captured once, then replayed over new rows, ids and weights: each replay's output against
    the reference."""
    def body(b, store):
        import torch
        a2a = pplx_kernels_tests.legacy_all_to_all(b, store, "ferry", world)
        local, block = refs.EXPERTS_PER_RANK, refs.MAX_TOKENS * world
        x, idx, w = (t.cuda() for t in refs.inputs(world, b.rank))
        ids32 = idx.to(torch.int32)
        ids = ids32.view(torch.uint32) if hasattr(torch, "uint32") else ids32
        counts = torch.empty(local, dtype=torch.int32, device="cuda")
        out_x = torch.zeros(local, block, refs.HIDDEN, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(out_x)
        out = torch.zeros_like(x)
        factor = torch.tensor([refs.expert_factor(b.rank * local + le) for le in range(local)],
                              device="cuda")

        def step():
            for send, recv in ((True, False), (False, True)):
                a2a.dispatch(counts, out_x, None, x, None, ids, None, do_send=send,
                             do_recv=recv)
            y.copy_((out_x.float() * factor[:, None, None]).to(torch.bfloat16))
            for send, recv in ((True, False), (False, True)):
                a2a.combine(out, ids, w, y, None, do_send=send, do_recv=recv)

        check_replays(captured(step), world, b.rank, (x, ids32, w), out,
                      lambda idx: idx.to(torch.int32))
        a2a.destroy()
    return body


def streams_body(world):
    """Which stream the AllToAlls' steps go on. A low-latency Buffer whose first call waits for
    its result, and pplx's AllToAll, take the caller's current stream as their own (no event
    between the caller's kernels and theirs); a call from another stream after that is still
    ordered with it (the results checked). A Buffer whose first call is async_finish keeps its
    communication stream, and its event is what the caller waits for."""
    def body(b, store):
        import torch
        from ferry import deep_ep, pplx
        e, local = refs.EXPERTS_PER_RANK * world, refs.EXPERTS_PER_RANK
        factor = torch.tensor([refs.expert_factor(b.rank * local + le) for le in range(local)],
                              device="cuda").view(local, 1, 1)
        first, other = torch.cuda.Stream(), torch.cuda.Stream()

        def round_trip(buf, r, async_finish=False):
            rx, ridx, rw = refs.inputs(world, b.rank, round=r)
            x, idx, w = rx.cuda(), ridx.cuda(), rw.cuda()
            recv, _, handle, event, _ = buf.low_latency_dispatch(
                x, idx, refs.MAX_TOKENS, e, use_fp8=False, async_finish=async_finish)
            event.current_stream_wait()
            y = (recv.float() * factor).to(torch.bfloat16)
            out, event, _ = buf.low_latency_combine(y, idx, w, handle, async_finish=async_finish)
            event.current_stream_wait()
            torch.testing.assert_close(out.cpu().float(),
                                       refs.weighted_reference(rx, ridx, rw).float(),
                                       rtol=2 ** -7, atol=2 ** -6)
            return handle._ferry.pooled.a2a  # the V1 tuple holds ferry's handle

        buf = deep_ep.Buffer(b, explicitly_destroy=True)
        with torch.cuda.stream(first):
            a2a = round_trip(buf, 1)
        assert a2a.stream == first.cuda_stream, (a2a.stream, first.cuda_stream)
        with torch.cuda.stream(other):
            assert round_trip(buf, 2) is a2a and a2a.stream == first.cuda_stream
        buf.destroy()

        buf = deep_ep.Buffer(b, explicitly_destroy=True)
        with torch.cuda.stream(first):
            a2a = round_trip(buf, 3, async_finish=True)
            assert a2a.stream == buf._stream.cuda_stream != first.cuda_stream
            round_trip(buf, 4)  # a call that waits, on the same communication stream
        buf.destroy()

        p = pplx.AllToAll(max_num_tokens=refs.MAX_TOKENS, num_experts=e,
                          expert_padding=pplx_tests.PADDING, hidden_dim=refs.HIDDEN,
                          hidden_dim_scale=None, in_dtype=torch.bfloat16,
                          out_dtype=torch.bfloat16, scale_dtype=None,
                          num_experts_per_token=refs.K, device=torch.device("cuda"),
                          global_group=b)
        rx, ridx, rw = refs.inputs(world, b.rank, round=5)
        with torch.cuda.stream(other):
            x, ids, w = rx.cuda(), ridx.to(torch.int32).cuda(), rw.cuda()
            counts = torch.empty(local, dtype=torch.int32, device="cuda")
            out_x = torch.zeros(p.max_recv_tokens, refs.HIDDEN, dtype=torch.bfloat16,
                                device="cuda")
            p.dispatch(counts, out_x, None, x, None, ids, w)
            assert p._a2a.stream == other.cuda_stream, (p._a2a.stream, other.cuda_stream)
            torch.cuda.current_stream().synchronize()
        want = [sum(int((refs.inputs(world, s, round=5)[1] == b.rank * local + le).sum())
                    for s in range(world)) for le in range(local)]
        assert counts.tolist() == want, (counts.tolist(), want)
        p.destroy()
    return body


def held_arrays_body(b, store):
    """A CPU that runs ahead of the GPU: low-latency rounds enqueued behind a second of GPU
    sleep on the caller's stream (the one the AllToAll takes) neither wait for it while the
    arrays the steps hold stay within the binding's bound, nor hold more than that bound (plus
    one call's) when many more are enqueued; the arrays go once the steps have run, and the
    last round's result is right."""
    import time
    import torch
    from ferry import deep_ep
    e, local = refs.EXPERTS_PER_RANK, refs.EXPERTS_PER_RANK
    factor = torch.tensor([refs.expert_factor(le) for le in range(local)],
                          device="cuda").view(local, 1, 1)
    rx, ridx, rw = refs.inputs(1, 0, round=2)
    x, idx, w = rx.cuda(), ridx.cuda(), rw.cuda()
    buf = deep_ep.Buffer(b, explicitly_destroy=True)
    out = torch.empty_like(x)

    def round_trip():
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, refs.MAX_TOKENS, e,
                                                         use_fp8=False)
        y = (recv.float() * factor).to(torch.bfloat16)
        buf.low_latency_combine(y, idx, w, handle, out=out)
        return handle._ferry.pooled.a2a

    a2a = round_trip()
    for _ in range(3):
        round_trip()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # cycles: about a second at an H200's clocks
    start = time.monotonic()
    for _ in range(10):
        round_trip()
    ran_ahead = time.monotonic() - start
    assert ran_ahead < 0.5, f"10 rounds behind a second's sleep took {ran_ahead:.2f} s"
    held = a2a.pending_arrays
    assert 0 < held <= 128, held
    for _ in range(30):  # past the bound: it waits for the oldest steps, holds no more
        round_trip()
        assert a2a.pending_arrays <= 128 + 8, a2a.pending_arrays
    torch.cuda.synchronize()
    round_trip()  # its release sees every earlier step done
    assert a2a.pending_arrays <= 16, a2a.pending_arrays
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu().float(), refs.weighted_reference(rx, ridx, rw).float(),
                               rtol=2 ** -7, atol=2 ** -6)
    buf.destroy()


def direct_held_arrays_body(b, store):
    """The direct API's four steps on a stream, given new tensors every epoch and never
    synchronised: the arrays they hold stay within the binding's bound (each dispatch_send lets
    go those of the finished steps), and the last epoch's result is right."""
    import torch
    c = ferry.AllToAllConfig(world_size=1, rank=0, num_experts=refs.EXPERTS_PER_RANK,
                             experts_per_token=refs.K, max_tokens_per_rank=refs.MAX_TOKENS,
                             hidden=refs.HIDDEN, device=ferry.MoeDevice.CUDA, cuda_device=0,
                             ranks_per_node=1)
    a2a = ferry.AllToAll(c, None, b)
    a2a.set_stream(torch.cuda.current_stream())
    rx, ridx, rw = refs.inputs(1, 0)
    for epoch in range(60):
        x, idx, w = rx.cuda(), ridx.cuda(), rw.cuda()
        recv = torch.empty(refs.EXPERTS_PER_RANK, c.expert_capacity, refs.HIDDEN,
                           dtype=torch.bfloat16, device="cuda")
        counts = torch.empty(refs.EXPERTS_PER_RANK, dtype=torch.int32, device="cuda")
        out = torch.empty_like(x)
        a2a.dispatch_send(x, idx, w)
        a2a.dispatch_recv(recv, counts)
        a2a.combine_send(recv * 2)
        a2a.combine_recv(out)
        assert a2a.pending_arrays <= 128 + 16, (epoch, a2a.pending_arrays)
    torch.cuda.synchronize()
    routed = (rw * (ridx >= 0)).sum(1, keepdim=True)  # the weights of the copies sent
    torch.testing.assert_close(out.cpu().float(), 2 * routed * rx.float(), rtol=2 ** -7,
                               atol=2 ** -6)
    a2a.close()


def hook_on_another_stream_body(b, store):
    """The receive hooks called with another stream current than the dispatch's (bf16 and
    e4m3, whose scales are laid out after the receive), the results read on the dispatch's
    stream (every round the C++ path's), against the references."""
    import torch
    from ferry import deep_ep
    buf = deep_ep.Buffer(b, explicitly_destroy=True)
    other = torch.cuda.Stream()
    for use_fp8 in (False, True):
        for r in range(4):
            deep_ep_tests.check_low_latency(buf, 1, 0, use_fp8, False, False, True, common=True,
                                            round=r, hook_stream=other)
    buf.destroy()


def kernel_names_body(b, store):
    """A low-latency dispatch and combine under torch's profiler: the dispatch's kernels are
    found by the name "dispatch" and the combine's by "combine" (as a profiler finds DeepEP's),
    neither by the other's."""
    import torch
    from ferry import deep_ep
    buf = deep_ep.Buffer(b, explicitly_destroy=True)
    e = refs.EXPERTS_PER_RANK
    x, idx, w = refs.inputs(1, 0)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()

    def kernels(step):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            result = step()
            torch.cuda.synchronize()
        names = [ev.name for ev in prof.events()
                 if ev.device_type == torch.autograd.DeviceType.CUDA]
        return result, names

    for _ in range(2):  # the second round's, past what the first call sets up
        (recv, _, handle, _, _), names = kernels(
            lambda: buf.low_latency_dispatch(x, idx, refs.MAX_TOKENS, e, use_fp8=False))
        assert any("dispatch" in n for n in names), names
        assert not any("combine" in n for n in names), names
        _, names = kernels(lambda: buf.low_latency_combine(recv, idx, w, handle))
        assert any("combine" in n for n in names), names
        assert not any("dispatch" in n for n in names), names
    buf.destroy()


class CudaEngineApiTest(refs.Case):
    def setUp(self):
        super().setUp()
        if ferry.run_local_ranks(1, probe, 60.0)[0].exit_code == NO_GPU:
            self.skipTest("no CUDA GPU (or torch without CUDA) here")

    def test_deep_ep_world_1(self):
        self.ranks(1, on_gpu(deep_ep_tests.deep_ep_body(1, "ferry")), timeout=240.0)

    def test_deep_ep_world_2_over_gloo(self):
        self.ranks(2, on_gpu(deep_ep_tests.deep_ep_body(2, "gloo")), timeout=240.0)

    def test_deep_ep_v2_world_1(self):
        self.ranks(1, on_gpu(deep_ep_v2_tests.v2_body(1, "ferry")), timeout=240.0)

    def test_deep_ep_v2_world_2(self):
        self.ranks(2, on_gpu(deep_ep_v2_tests.v2_body(2, "ferry")), timeout=240.0)

    def test_kernels_named_by_their_step(self):
        self.ranks(1, on_gpu(kernel_names_body), timeout=240.0)

    def test_deep_ep_low_latency_as_a_cuda_graph(self):
        self.ranks(1, on_gpu(graph_body(1, "ferry")), timeout=240.0)

    def test_deep_ep_low_latency_as_a_cuda_graph_world_2(self):
        self.ranks(2, on_gpu(graph_body(2, "ferry")), timeout=240.0)

    def test_pplx_as_a_cuda_graph_with_bound_m(self):
        self.ranks(1, on_gpu(pplx_graph_body(1, "ferry")), timeout=240.0)

    def test_pplx_as_a_cuda_graph_with_bound_m_world_2(self):
        self.ranks(2, on_gpu(pplx_graph_body(2, "ferry")), timeout=240.0)

    def test_a_cpu_ahead_of_the_gpu_holds_arrays_within_a_bound(self):
        self.ranks(1, on_gpu(held_arrays_body), timeout=240.0)

    def test_the_direct_steps_on_a_stream_hold_arrays_within_a_bound(self):
        self.ranks(1, on_gpu(direct_held_arrays_body), timeout=240.0)

    def test_receive_hooks_called_on_another_stream(self):
        self.ranks(1, on_gpu(hook_on_another_stream_body), timeout=240.0)

    def test_the_stream_the_steps_take(self):
        self.ranks(1, on_gpu(streams_body(1)), timeout=240.0)

    def test_the_stream_the_steps_take_world_2(self):
        self.ranks(2, on_gpu(streams_body(2)), timeout=240.0)

    def test_pplx_world_1(self):
        self.ranks(1, on_gpu(pplx_tests.pplx_body(1, "ferry")), timeout=240.0)

    def test_pplx_world_1_on_the_legacy_default_stream(self):
        self.ranks(1, on_gpu(pplx_tests.pplx_body(1, "ferry"), own_stream=False), timeout=240.0)

    def test_deep_ep_world_1_on_the_legacy_default_stream(self):
        self.ranks(1, on_gpu(deep_ep_tests.deep_ep_body(1, "ferry"), own_stream=False),
                   timeout=240.0)

    def test_pplx_world_2(self):
        self.ranks(2, on_gpu(pplx_tests.pplx_body(2, "ferry")), timeout=240.0)

    def test_pplx_expert_block_overflow(self):
        self.ranks(1, on_gpu(pplx_tests.pplx_overflow_body), timeout=240.0)

    def test_pplx_data_parallel_group_of_two(self):
        self.ranks(2, on_gpu(pplx_tests.pplx_dp_body(2)), timeout=240.0)

    def test_pplx_kernels_world_1(self):
        self.ranks(1, on_gpu(pplx_kernels_tests.pplx_kernels_body(1, "ferry")), timeout=240.0)

    def test_pplx_kernels_world_2_over_gloo(self):
        self.ranks(2, on_gpu(pplx_kernels_tests.pplx_kernels_body(2, "gloo")), timeout=240.0)

    def test_pplx_kernels_as_a_cuda_graph_world_2(self):
        self.ranks(2, on_gpu(pplx_kernels_graph_body(2)), timeout=240.0)

    def test_pplx_kernels_data_parallel_group_of_two(self):
        self.ranks(2, on_gpu(pplx_kernels_tests.pplx_kernels_dp_body(2, "gloo")), timeout=240.0)

    def test_pplx_kernels_data_parallel_group_over_ferrys_bootstrap(self):
        self.ranks(2, on_gpu(pplx_kernels_tests.pplx_kernels_dp_body(2, "ferry")), timeout=240.0)

    # An NCCL group: world size 1 (NCCL refuses two ranks on one GPU, which is all two ranks
    # get here). The layers gather through torch.distributed's all_gather_object on it.
    def nccl(self):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_nccl_available():
            self.skipTest("torch without NCCL")

    def test_deep_ep_world_1_over_nccl(self):
        self.nccl()
        self.ranks(1, on_gpu(deep_ep_tests.deep_ep_body(1, "nccl")), timeout=240.0)

    def test_pplx_world_1_over_nccl(self):
        self.nccl()
        self.ranks(1, on_gpu(pplx_tests.pplx_body(1, "nccl")), timeout=240.0)

    def test_deep_ep_low_latency_as_a_cuda_graph_over_nccl(self):
        self.nccl()
        self.ranks(1, on_gpu(graph_body(1, "nccl")), timeout=240.0)


if __name__ == "__main__":
    unittest.main()
