"""The KV messenger from Python: a prefill process holding two TP ranks' caches (HND) streams a
request's pages layer by layer to a decoder holding one (NHD), over shm; every byte of every
page and the aux data is checked where the decode layout puts it."""

import asyncio
import os
import time
import unittest

import ferry
from ranks import expect_error, run_ranks, shm_engine

MODEL = dict(kv_heads=2, head_dim=8, dtype_bytes=2, page_tokens=4)
LAYERS, PAGES_PER_LAYER, AUX_BYTES = 3, 8, 40
SRC_PAGES, DST_PAGES = [5, 1, 6], [2, 7, 0]
NO_GPU = 3  # exit code of a rank that found no GPU


def side(tp, order):
    return ferry.KvSide(model=ferry.KvModel(**MODEL), order=order, tp=tp)


PREFILL, DECODE = side(2, ferry.KvOrder.HND), side(1, ferry.KvOrder.NHD)


def value(layer, i, component, head, token, k):
    """Byte k of the head_dim vector of (layer, the request's page i, component, head, token)."""
    return (layer * 131 + i * 61 + component * 29 + head * 17 + token * 7 + k) % 251


def vector_bytes():
    return MODEL["head_dim"] * MODEL["dtype_bytes"]


def write_layer(caches, layer, stride):
    """The prefill's forward pass for one layer: each TP rank writes its heads' vectors."""
    per_rank = PREFILL.heads_per_rank
    for rank, cache in enumerate(caches):
        for i, page in enumerate(SRC_PAGES):
            for c in range(2):
                for h in range(per_rank):
                    for t in range(MODEL["page_tokens"]):
                        at = layer * stride + PREFILL.offset(page, c, h, t)
                        cache[at:at + vector_bytes()] = bytes(
                            value(layer, i, c, rank * per_rank + h, t, k)
                            for k in range(vector_bytes()))


def poll(take, timeout=20):
    """take() until it gives something (a non-empty list), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (items := take()):
        assert time.monotonic() < deadline, f"{take.__name__}: nothing within {timeout} s"
        time.sleep(0.005)
    return items


def prefill_body(b):
    stride = PREFILL.page_bytes * PAGES_PER_LAYER
    with shm_engine() as engine:
        caches = [bytearray(stride * LAYERS) for _ in range(PREFILL.tp)]
        regions = [engine.register(c) for c in caches]
        aux = bytearray(bytes(range(AUX_BYTES)))
        counter = ferry.LayerCounter()
        with ferry.KvPrefill(engine, PREFILL, regions, LAYERS, stride,
                             engine.register(aux), counter) as prefill:
            b.all_gather(engine.address)
            request = prefill.next_request(timeout=20)
            assert request == {"request_id": 42, "num_pages": 3, "num_tokens": 12,
                               "speculative": False}, request
            prefill.schedule(42, SRC_PAGES, aux_offset=0, pass_base=counter.value)
            for layer in range(LAYERS):
                write_layer(caches, layer, stride)
                counter.increment()
            assert prefill.next_release(timeout=20) == (42, None)
            # Request 43 is never scheduled: the decoder gives up at its deadline. Its request
            # taken by polling, as a scheduler does once per step; its release awaited, as an
            # asyncio one would, then polled.
            requests = poll(prefill.poll_requests)
            assert [r["request_id"] for r in requests] == [43], requests

            async def released_ones():
                await asyncio.wait_for(prefill.release_ready(), 20)
                return prefill.poll_releases()

            [(released, error)] = asyncio.run(released_ones())
            assert released == 43 and isinstance(error, ferry.Error), (released, error)
            assert prefill.poll_requests() == [] and prefill.poll_releases() == []
            assert not prefill.request_ready().done
            b.barrier()
        expect_error(ferry.Cancelled, "KvPrefill is closed", prefill.request_ready().wait, 1)


def decoder_body(b):
    stride = DECODE.page_bytes * PAGES_PER_LAYER
    with shm_engine() as engine:
        cache = bytearray(stride * LAYERS)
        aux = bytearray(64)
        with ferry.KvDecoder(engine, DECODE, [engine.register(cache)], LAYERS, stride,
                             aux=engine.register(aux)) as decoder:
            prefill_address = b.all_gather(engine.address)[0]
            expect_error(ferry.OutOfRange, "outside the layer", decoder.submit, 41,
                         prefill_address, PREFILL, [PAGES_PER_LAYER], num_tokens=4)
            decoder.submit(42, prefill_address, PREFILL, DST_PAGES, num_tokens=12,
                           aux_offset=8, aux_bytes=AUX_BYTES).wait(timeout=20)
            for layer in range(LAYERS):
                for i, page in enumerate(DST_PAGES):
                    for c in range(2):
                        for h in range(MODEL["kv_heads"]):
                            for t in range(MODEL["page_tokens"]):
                                at = layer * stride + DECODE.offset(page, c, h, t)
                                want = bytes(value(layer, i, c, h, t, k)
                                             for k in range(vector_bytes()))
                                assert cache[at:at + vector_bytes()] == want, (layer, i, c, h, t)
            assert aux[8:8 + AUX_BYTES] == bytes(range(AUX_BYTES))
            late = decoder.submit(43, prefill_address, PREFILL, DST_PAGES, num_tokens=12,
                                  timeout=0.3)
            expect_error(ferry.DeadlineExceeded, "", late.wait, timeout=20)
            b.barrier()


def kv_body(b):
    (prefill_body if b.rank == 0 else decoder_body)(b)


class KvTest(unittest.TestCase):
    def test_prefill_to_decoder_tp2_to_tp1(self):
        run_ranks(self, 2, kv_body)

    def test_plan(self):
        plan = ferry.plan_kv_transfer(PREFILL, DECODE, SRC_PAGES, DST_PAGES, seed=1)
        # HND heads to NHD: one write per (page, component, head, token) vector.
        self.assertEqual(len(plan.writes), 3 * 2 * 2 * MODEL["page_tokens"])
        self.assertEqual(plan.writes_per_dst, [len(plan.writes)])
        self.assertEqual({w.src_rank for w in plan.writes}, {0, 1})
        self.assertTrue(all(w.length == vector_bytes() for w in plan.writes))
        with self.assertRaises(ferry.InvalidArgument):
            ferry.plan_kv_transfer(PREFILL, DECODE, SRC_PAGES, DST_PAGES[:2])

    def test_a_role_holds_its_engine(self):
        stride = DECODE.page_bytes * PAGES_PER_LAYER
        with shm_engine() as engine:
            decoder = ferry.KvDecoder(engine, DECODE, [engine.register(bytearray(stride))], 1,
                                      stride)
            with self.assertRaises(ferry.NotFound):
                decoder.cancel(5)
            with self.assertRaises(ferry.FailedPrecondition):
                engine.close()
            decoder.close()
            with self.assertRaises(ferry.FailedPrecondition):
                decoder.cancel(1)
            # The engine's messages are recv()'s again (here, one sent to itself).
            me = engine.add_peer(engine.address)
            engine.send(me, b"back").wait(timeout=10)
            self.assertEqual(engine.recv(timeout=10), (me, b"back"))

    def test_unknown_requests_and_bad_input(self):
        stride = PREFILL.page_bytes * PAGES_PER_LAYER
        with shm_engine() as engine:
            caches = [engine.register(bytearray(stride)) for _ in range(PREFILL.tp)]
            with self.assertRaises(ferry.InvalidArgument):
                ferry.KvPrefill(engine, PREFILL, caches, 1, stride, None, "not a counter")
            with ferry.KvPrefill(engine, PREFILL, caches, 1, stride, None,
                                 ferry.LayerCounter()) as prefill:
                with self.assertRaises(ferry.NotFound):
                    prefill.schedule(7, [0])
                with self.assertRaises(ferry.NotFound):
                    prefill.cancel(7)
                with self.assertRaises(ferry.DeadlineExceeded):
                    prefill.next_request(timeout=0.05)
                with self.assertRaises(ferry.DeadlineExceeded):
                    prefill.next_release(timeout=0.05)
                self.assertEqual((prefill.poll_requests(), prefill.poll_releases()), ([], []))

    def test_layer_counter(self):
        c = ferry.LayerCounter()
        c.increment()
        c.increment(2)
        self.assertEqual(c.value, 3)

    def test_gpu_layer_counter(self):
        """Without a GPU (or a CUDA build) it says so; with one (in a forked rank: this process
        must not initialise CUDA before later tests fork), the stream's increments show up."""
        def body(b):
            try:
                counter = ferry.GpuLayerCounter()
            except (ferry.FailedPrecondition, ferry.Unimplemented):
                os._exit(NO_GPU)
            counter.increment(0)
            counter.increment(0)
            deadline = time.monotonic() + 10
            while counter.value < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert counter.value == 2, counter.value

        exits = ferry.run_local_ranks(1, body, timeout=60)
        if exits[0].exit_code == NO_GPU:
            self.skipTest("no GPU here (GpuLayerCounter said so)")
        self.assertTrue(exits[0].ok, exits)

    def test_cuda_shards(self):
        """Two TP ranks' caches on this machine's first GPU, mapped into the leader (rank 0):
        each rank fills its own with its byte, the leader reads both through leader_view. Bad
        input is refused before anything collective; without a GPU (or a CUDA build) it says
        so."""
        size = 1 << 16

        def body(b):
            expect_error(ferry.InvalidArgument, "leader 2", ferry.KvCudaShards, b, 2, 0, size)
            expect_error(ferry.InvalidArgument, "positive", ferry.KvCudaShards, b, 0, 0, 0)
            expect_error(ferry.InvalidArgument, "timeout", ferry.KvCudaShards, b, 0, 0, size,
                         timeout=-1.0)
            try:
                shards = ferry.KvCudaShards(b, leader=0, cuda_device=0, num_bytes=size)
            except (ferry.FailedPrecondition, ferry.Unimplemented):
                os._exit(NO_GPU)
            import ctypes
            from test_moe_cuda import cudart
            rt = cudart()
            local = shards.local
            assert (local.device, local.num_bytes, local.owner) == (0, size, shards), local
            cai = local.__cuda_array_interface__
            assert cai["shape"] == (size,) and cai["typestr"] == "|u1", cai
            assert cai["data"] == (local.data, False) and cai["version"] == 3, cai
            assert rt.cudaMemset(ctypes.c_void_p(local.data), b.rank + 1, size) == 0
            assert rt.cudaDeviceSynchronize() == 0
            b.barrier()
            views = shards.leader_view
            if b.rank != 0:
                assert views == [], views
            else:
                assert len(views) == 2 and all(v.num_bytes == size for v in views), views
                for rank, view in enumerate(views):
                    got = bytearray(size)
                    buf = (ctypes.c_char * size).from_buffer(got)
                    assert rt.cudaMemcpy(buf, ctypes.c_void_p(view.data), size, 2) == 0
                    assert got == bytes([rank + 1]) * size, (rank, got[:8])
            b.barrier()  # the leader has read before any rank lets its cache go

        exits = ferry.run_local_ranks(2, body, timeout=120)
        if all(e.exit_code == NO_GPU for e in exits):
            self.skipTest("no GPU here (KvCudaShards said so)")
        self.assertTrue(all(e.ok for e in exits), exits)


if __name__ == "__main__":
    unittest.main()
