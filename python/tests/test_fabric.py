"""ferry.TransferEngine from Python: two ranks over libfabric's shm provider."""

import os
import threading
import time
import unittest

import ferry
from ranks import expect_error, run_ranks, shm_engine

PAGE = 256


def pattern(n, seed):
    return bytes((i * 7 + seed) % 251 for i in range(n))


def connect(bootstrap, engine, region):
    """The peer's id on our engine and its region's descriptor (two ranks)."""
    other = 1 - bootstrap.rank
    addresses = bootstrap.all_gather(engine.address)
    descriptors = bootstrap.all_gather(region.descriptor)
    return engine.add_peer(addresses[other]), descriptors[other]


def writes_body(b):
    with shm_engine() as engine:
        buf = bytearray(16 * PAGE)
        region = engine.register(buf)
        peer, dst = connect(b, engine, region)
        engine.create_imm_counter(7)
        engine.create_imm_counter(8)
        b.barrier()
        if b.rank == 0:
            buf[:] = pattern(len(buf), 1)
            # Bytes [PAGE, 3 PAGE) to [5 PAGE, 7 PAGE) of the peer, counted by imm 7.
            engine.write(region, peer, dst, src_offset=PAGE, dst_offset=5 * PAGE,
                         length=2 * PAGE, imm=7).wait(10)
            # Pages 3, 0, 2 to the peer's pages 10, 11, 9; each page counted by imm 8.
            engine.write_paged(region, peer, ferry.RemoteRegion.parse(dst), PAGE,
                               [3, 0, 2], [10, 11, 9], imm=8).wait(10)
            engine.write_imm(peer, 8).wait(10)
        else:
            engine.wait_imm(7, 1, timeout=10)
            sent = pattern(len(buf), 1)
            assert buf[5 * PAGE:7 * PAGE] == sent[PAGE:3 * PAGE]
            engine.wait_imm(8, 4, timeout=10)  # three pages and one bare immediate
            for src_page, dst_page in ((3, 10), (0, 11), (2, 9)):
                assert buf[dst_page * PAGE:(dst_page + 1) * PAGE] == \
                    sent[src_page * PAGE:(src_page + 1) * PAGE], (src_page, dst_page)
            assert buf[:5 * PAGE] == bytes(5 * PAGE)  # nothing else written
            assert engine.imm_count(8) == 4
            engine.consume_imm(8, 4)
            assert engine.imm_count(8) == 0
        b.barrier()


def scatter_and_barrier_body(b):
    with shm_engine() as engine:
        buf = bytearray(4 * PAGE)
        region = engine.register(buf)
        peer, dst = connect(b, engine, region)
        group = engine.add_peer_group([peer])
        engine.create_imm_counter(9)
        engine.create_imm_counter(10)
        b.barrier()
        if b.rank == 0:
            buf[:] = pattern(len(buf), 3)
            plan = engine.prepare_scatter(group, region, [dst])
            # Two slices to the group's one member, each carrying imm 9; then a barrier (imm 10).
            engine.scatter(plan, [(0, 0, 100, 50), (0, 2 * PAGE, 3 * PAGE, 24)], imm=9).wait(10)
            engine.barrier(group, 10).wait(10)
        else:
            engine.wait_imm(9, 2, timeout=10)
            engine.wait_imm(10, 1, timeout=10)
            sent = pattern(len(buf), 3)
            assert buf[100:150] == sent[:50]
            assert buf[3 * PAGE:3 * PAGE + 24] == sent[2 * PAGE:2 * PAGE + 24]
            assert buf[:100] == bytes(100) and buf[150:3 * PAGE] == bytes(3 * PAGE - 150)
        b.barrier()


def callbacks_and_await_body(b):
    """Done callbacks: each runs once, at once on the calling thread for a transfer that has
    ended and on ferry's callback thread for one in flight; one that raises does not stop the
    next. `await` (asyncio) ends with the transfer. A write to a peer that is gone hands its
    error to both."""
    import asyncio
    options = ferry.EngineOptions.from_env(provider="shm", transfer_timeout_ms=500)
    with ferry.TransferEngine(options) as engine:
        buf = bytearray(PAGE)
        region = engine.register(buf)
        peer, dst = connect(b, engine, region)
        engine.create_imm_counter(3)
        b.barrier()
        many = 64
        if b.rank == 1:
            engine.wait_imm(3, 3 + many, timeout=10)
            assert buf == pattern(PAGE, 5)
            b.barrier()
            os._exit(0)  # gone without a word: rank 0's later writes fail
        buf[:] = pattern(PAGE, 5)
        main = threading.get_ident()

        def add_callbacks(transfer, settle=0.05):
            """A raising callback, then one recording (thread, done, error); waits for it and
            checks it ran once (`settle` seconds later), where it should have. Returns (error,
            ran at once)."""
            seen, ran = [], threading.Event()

            def boom(t):
                raise RuntimeError("a done callback that raises (this report is expected)")

            def record(t):
                seen.append((threading.get_ident(), t.done, t.error))
                ran.set()

            transfer.add_done_callback(boom)
            transfer.add_done_callback(record)
            at_once = bool(seen)  # ended before it was added: run on this thread
            assert ran.wait(10), "the done callback never ran"
            time.sleep(settle)
            assert len(seen) == 1, seen
            thread, done, error = seen[0]
            assert done and (thread == main) == at_once, (seen, at_once)
            return error, at_once

        t = engine.write(region, peer, dst, imm=3)
        assert add_callbacks(t)[0] is None and t.error is None
        assert add_callbacks(t) == (None, True)  # ended: at once, here

        async def awaited():
            await engine.write(region, peer, dst, imm=3)
            await ferry.transfer_future(engine.write(region, peer, dst, imm=3))

        asyncio.run(awaited())

        # Many in flight at once, a callback each: every one runs exactly once.
        counts, lock, all_ran = {}, threading.Lock(), threading.Event()

        def count(i):
            def done(t):
                assert t.error is None, t.error
                with lock:
                    counts[i] = counts.get(i, 0) + 1
                    if len(counts) == many:
                        all_ran.set()
            return done

        for i, t in enumerate([engine.write(region, peer, dst, imm=3) for _ in range(many)]):
            t.add_done_callback(count(i))
        assert all_ran.wait(10), f"{len(counts)} of {many} callbacks ran"
        time.sleep(0.05)
        assert counts == {i: 1 for i in range(many)}, counts
        b.barrier()  # rank 1 saw every write, and leaves

        async def until_a_write_fails():
            """Writes (awaited, with callbacks) until one fails in flight: writes may still
            land while rank 1 is on its way out (shm's queue)."""
            start = time.monotonic()
            while True:
                t = engine.write(region, peer, dst, imm=3)
                future = ferry.transfer_future(t)
                error, at_once = add_callbacks(t, settle=0)
                if error is not None:
                    try:
                        await future
                        raise AssertionError("awaiting a failed write returned")
                    except (ferry.DeadlineExceeded, ferry.Unavailable) as e:
                        assert type(e) is type(error), (e, error)
                    return error, at_once
                await future
                assert time.monotonic() - start < 3, "writes to a gone peer kept completing"

        error, at_once = asyncio.run(until_a_write_fails())
        assert isinstance(error, (ferry.DeadlineExceeded, ferry.Unavailable)), error
        # A write that fails at the transfer timeout was in flight for 500 ms: its callbacks
        # ran on ferry's callback thread. (Over shm the first failure is that one.)
        if isinstance(error, ferry.DeadlineExceeded):
            assert not at_once


def notify_imm_body(b):
    """notify_imm: a Transfer that ends when the count reaches its target -- awaited, or with a
    callback; DeadlineExceeded when it does not in time, Cancelled by disarm_imm, refused while
    another is armed on the counter, NotFound for an unknown counter."""
    import asyncio
    with shm_engine() as engine:
        region = engine.register(bytearray(PAGE))
        peer, _ = connect(b, engine, region)
        engine.create_imm_counter(9)
        engine.create_imm_counter(10)
        b.barrier()
        if b.rank == 0:
            b.barrier()  # rank 1 has armed its notification
            for _ in range(2):
                engine.write_imm(peer, 9).wait(10)
            b.barrier()
            return

        async def reached():
            await engine.notify_imm(9, 2, timeout=10)
            return engine.imm_count(9)

        reached_task = engine.notify_imm(9, 2, timeout=10)
        b.barrier()
        reached_task.wait(10)
        assert engine.imm_count(9) == 2
        assert asyncio.run(reached()) == 2  # reached already: ends at once
        b.barrier()

        late = engine.notify_imm(10, 1, timeout=0.1)
        seen = threading.Event()
        errors = []
        late.add_done_callback(lambda t: (errors.append(t.error), seen.set()))
        assert seen.wait(10) and isinstance(errors[0], ferry.DeadlineExceeded), errors

        armed = engine.notify_imm(10, 1, timeout=10)
        second = engine.notify_imm(10, 1, timeout=10)
        expect_error(ferry.FailedPrecondition, "already has a notification", second.wait, 10)
        engine.disarm_imm(10)
        expect_error(ferry.Cancelled, "disarmed", armed.wait, 10)
        expect_error(ferry.NotFound, "no immediate counter", engine.notify_imm, 77, 1)


def mirror_imm_body(b):
    """mirror_imm keeps a host word at the counter's total (what a CUDA kernel would read through
    a mapping): at once, after each arrival, not lowered by consume_imm; None stops it; a word
    too small, read-only or not in host memory is refused."""
    import array
    with shm_engine() as engine:
        region = engine.register(bytearray(PAGE))
        peer, _ = connect(b, engine, region)
        engine.create_imm_counter(11)
        b.barrier()
        if b.rank == 0:
            for _ in range(3):
                engine.write_imm(peer, 11).wait(10)
            b.barrier()  # rank 1 mirrors and consumes
            engine.write_imm(peer, 11).wait(10)
            b.barrier()  # rank 1 stops the mirror
            engine.write_imm(peer, 11).wait(10)
            b.barrier()
            return
        engine.wait_imm(11, 3, timeout=10)
        word = array.array("Q", [7])
        engine.mirror_imm(11, word)
        assert word[0] == 3, word
        engine.consume_imm(11, 3)
        b.barrier()
        deadline = time.monotonic() + 10
        while word[0] != 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert word[0] == 4 and engine.imm_count(11) == 1, (word, engine.imm_count(11))
        engine.mirror_imm(11, None)
        b.barrier()
        engine.wait_imm(11, 2, timeout=10)
        assert word[0] == 4, word
        b.barrier()
        expect_error(ferry.InvalidArgument, "at least 8", engine.mirror_imm, 11, bytearray(4))
        expect_error(ferry.InvalidArgument, "8-byte aligned", engine.mirror_imm, 11,
                     memoryview(bytearray(16))[4:12])
        expect_error(ferry.InvalidArgument, "read-only", engine.mirror_imm, 11, bytes(8))
        expect_error(ferry.InvalidArgument, "the call needs host memory", engine.mirror_imm, 11,
                     ferry.Array(0x1000, 8, 0, "u", 8, False, [1], None))
        expect_error(ferry.NotFound, "no immediate counter", engine.mirror_imm, 78, word)


NO_GPU = 3  # exit code of a rank that found no GPU


def gpu_words_body(b):
    """ferry.GpuWords as mirror_imm's word: the count shows up in word 1 (read back by load);
    host and device views of the words; out-of-range words refused. Without a GPU (or a CUDA
    build) both ranks exit NO_GPU before anything collective."""
    try:
        words = ferry.GpuWords(0, 2)
    except (ferry.FailedPrecondition, ferry.Unimplemented):
        os._exit(NO_GPU)
    assert words.placement in ("gpu_memory", "mapped_host"), words.placement
    assert (words.placement == "gpu_memory") == (words.gdrcopy_status == ""), words.gdrcopy_status
    assert words.size == 2 and words.cuda_device == 0
    assert words.host.device == ferry.HOST_MEMORY and words.host.num_bytes == 16
    assert words.device.device == 0 and words.device.__cuda_array_interface__["shape"] == (2,)
    assert words.load(0) == 0 and words.load(1) == 0
    expect_error(ferry.InvalidArgument, "word 2 of 2", words.word, 2)
    expect_error(ferry.InvalidArgument, "word 5 of 2", words.load, 5)
    expect_error(ferry.InvalidArgument, "0 words", ferry.GpuWords, 0, 0)
    expect_error(ferry.InvalidArgument, "CUDA device 4096", ferry.GpuWords, 4096, 1)
    host = ferry.GpuWords(0, 1, gdrcopy=False)
    assert host.placement == "mapped_host" and host.gdrcopy_status == "GDRCopy not asked for"
    with shm_engine() as engine:
        region = engine.register(bytearray(PAGE))
        peer, _ = connect(b, engine, region)
        engine.create_imm_counter(12)
        if b.rank == 1:
            engine.mirror_imm(12, words.word(1))
        b.barrier()
        if b.rank == 0:
            for _ in range(2):
                engine.write_imm(peer, 12).wait(10)
        else:
            deadline = time.monotonic() + 10
            while words.load(1) != 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert words.load(1) == 2 and words.load(0) == 0, (words.load(0), words.load(1))
            engine.mirror_imm(12, None)
        b.barrier()


def lost_peer_body(b):
    """Rank 1 dies without a word; rank 0's writes to it fail within the transfer timeout (500
    ms), and so does the next one. Rank 1 dies idle, its worker asleep: shm wedges a peer's
    provider calls for good when a rank dies inside one of its own (holding its queue's lock),
    which no deadline of ours can end (the C++ fault tests cover that case)."""
    quiet = {"idle_yield_us": 100, "idle_sleep_us": 500_000} if b.rank == 1 else {}
    options = ferry.EngineOptions.from_env(provider="shm", transfer_timeout_ms=500, **quiet)
    with ferry.TransferEngine(options) as engine:
        buf = bytearray(PAGE)
        region = engine.register(buf)
        peer, dst = connect(b, engine, region)
        assert not engine.peer_lost(peer)
        b.barrier()
        if b.rank == 1:
            time.sleep(0.05)  # the worker, idle since connecting, goes to sleep
            os._exit(0)
        time.sleep(0.2)  # rank 1 is gone before anything goes to it

        def write():
            engine.write(region, peer, dst, imm=1).wait(timeout=5)

        # The first writes may still complete (shm's queue outlives the rank for a while).
        start = time.monotonic()
        while True:
            try:
                write()
            except (ferry.DeadlineExceeded, ferry.Unavailable):
                break
            assert time.monotonic() - start < 3, "writes to a dead peer kept completing"
        failed_at = time.monotonic()
        try:
            write()
            raise AssertionError("a write to a lost peer completed")
        except (ferry.DeadlineExceeded, ferry.Unavailable):
            pass
        assert time.monotonic() - failed_at < 1.5, time.monotonic() - failed_at
        assert engine.peer_lost(peer)
        expect_error(ferry.NotFound, "unknown", engine.peer_lost, peer + 100)


def messages_and_errors_body(b):
    import asyncio
    with shm_engine() as engine:
        buf = bytearray(4 * PAGE)
        region = engine.register(buf)
        peer, dst = connect(b, engine, region)
        ready = engine.message_ready()
        assert not ready.done  # nothing sent before the barrier
        b.barrier()
        if b.rank == 0:
            for i in range(3):
                engine.send(peer, b"hello %d from rank 0" % i).wait(10)
        else:
            ready.wait(10)  # ended by the first message
            assert engine.message_ready().done  # one is queued: ended at once
            sender, message = engine.recv(timeout=10)
            assert (sender, message) == (peer, b"hello 0 from rank 0"), (sender, message)

            async def the_rest():  # awaited and polled, as an asyncio server would
                got = []
                while len(got) < 2:
                    await asyncio.wait_for(engine.message_ready(), 10)
                    got += engine.poll_messages()
                return got

            polled = asyncio.run(the_rest())
            assert polled == [(peer, b"hello 1 from rank 0"), (peer, b"hello 2 from rank 0")], \
                polled
            assert engine.poll_messages() == []
        # Bad input fails at submit, naming what is wrong; nothing is posted.
        expect_error(ferry.OutOfRange, "exceeds", engine.write, region, peer, dst,
                     dst_offset=4 * PAGE - 8, length=16)
        expect_error(ferry.OutOfRange, "past the region", engine.write, region, peer, dst,
                     src_offset=4 * PAGE + 1)
        expect_error(ferry.Error, "peer", engine.write, region, 999, dst, length=16)
        expect_error(ferry.InvalidArgument, "", engine.write, region, peer, b"not a descriptor",
                     length=16)
        # Bounded waits: nobody sends imm 99 or a second message (DeadlineExceeded is also a
        # TimeoutError).
        engine.create_imm_counter(99)
        expect_error(TimeoutError, "expected 1, seen 0", engine.wait_imm, 99, 1, timeout=0.05)
        expect_error(ferry.DeadlineExceeded, "no messages", engine.recv, timeout=0.05)
        waiting = engine.message_ready()  # no more messages come: closing ends it
        b.barrier()
    expect_error(ferry.Cancelled, "closed", waiting.wait, 1)
    expect_error(ferry.Cancelled, "closed", engine.message_ready().wait, 1)


class TransferEngineTest(unittest.TestCase):
    def test_write_paged_and_imm(self):
        run_ranks(self, 2, writes_body)

    def test_scatter_and_barrier(self):
        run_ranks(self, 2, scatter_and_barrier_body)

    def test_done_callbacks_and_await(self):
        run_ranks(self, 2, callbacks_and_await_body)

    def test_notify_imm(self):
        run_ranks(self, 2, notify_imm_body)

    def test_mirror_imm(self):
        run_ranks(self, 2, mirror_imm_body)

    def test_gpu_words(self):
        exits = ferry.run_local_ranks(2, gpu_words_body, 60)
        if all(e.exit_code == NO_GPU for e in exits):
            self.skipTest("no GPU here (GpuWords said so)")
        self.assertTrue(all(e.ok for e in exits), exits)

    def test_lost_peer_fails_within_the_deadline(self):
        run_ranks(self, 2, lost_peer_body)

    def test_messages_and_bad_input(self):
        run_ranks(self, 2, messages_and_errors_body)

    def test_ended_at_is_when_a_transfer_ended(self):
        """Transfer.ended_at: None in flight; once ended, a time.time() taken between the
        submit and the wait's return."""
        with shm_engine() as engine:
            me = engine.add_peer(engine.address)
            before = time.time()
            t = engine.send(me, b"x")
            t.wait(timeout=10)
            after = time.time()
            self.assertIsNotNone(t.ended_at)
            self.assertTrue(before <= t.ended_at <= after, (before, t.ended_at, after))
            self.assertEqual(engine.recv(timeout=10), (me, b"x"))
            ready = engine.message_ready()
            self.assertIsNone(ready.ended_at)  # nothing queued: still in flight

    def test_options(self):
        options = ferry.EngineOptions(provider="shm", transfer_timeout_ms=250)
        self.assertEqual((options.provider, options.transfer_timeout_ms), ("shm", 250))
        with self.assertRaises(TypeError):
            ferry.EngineOptions(no_such_field=1)
        self.assertEqual(ferry.EngineOptions(port=40123).port, 40123)
        with self.assertRaises(TypeError):  # a port is 16 bits
            ferry.EngineOptions(port=70000)
        with self.assertRaises(ferry.InvalidArgument):  # shm names its endpoints: no ports
            ferry.TransferEngine(ferry.EngineOptions(provider="shm", port=40123))
        # The verbs backend's settings are fields too, as FERRY_IB_* sets them.
        verbs = ferry.VerbsOptions(gid_index=3, qkey=0x11)
        options = ferry.EngineOptions(verbs=verbs)
        self.assertEqual((options.verbs.gid_index, options.verbs.qkey), (3, 0x11))
        self.assertEqual(ferry.EngineOptions().verbs.port, 1)

    def test_closed_engine_and_bad_timeout(self):
        engine = shm_engine()
        region = engine.register(bytearray(64))
        with self.assertRaises(ValueError):  # ferry.InvalidArgument
            engine.wait_imm(1, 1, timeout=-1)
        with self.assertRaises(ferry.InvalidArgument):  # peers could write into it
            engine.register(b"immutable")
        engine.close()
        with self.assertRaises(ferry.FailedPrecondition):
            engine.register(bytearray(64))
        self.assertEqual(region.length, 64)

    def test_close_refused_while_another_thread_waits(self):
        engine = shm_engine()
        engine.create_imm_counter(5)
        outcome = []

        def wait():
            try:
                engine.wait_imm(5, 1, timeout=1.0)
            except ferry.DeadlineExceeded:
                outcome.append("deadline")

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        with self.assertRaises(ferry.FailedPrecondition):
            engine.close()
        waiter.join()
        self.assertEqual(outcome, ["deadline"])
        engine.close()


if __name__ == "__main__":
    unittest.main()
