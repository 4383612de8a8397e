"""The binding layer on its own: arrays from each kind of object, errors, the bootstraps."""

import array
import importlib.util
import socket
import threading
import time
import unittest

import ferry


class FakeDevice:
    def __init__(self, kind, index):
        self.type, self.index = kind, index


class FakeDtype:
    def __init__(self, name, floating):
        self.name, self.is_floating_point, self.is_complex = name, floating, False

    def __str__(self):
        return self.name


class FakeTensor:
    """What ferry reads of a torch.Tensor (torch is not a dependency of the tests)."""

    def __init__(self, device, dtype, shape, element_size, contiguous=True):
        self.device, self.dtype, self.shape = device, dtype, shape
        self._element_size, self._contiguous = element_size, contiguous

    def data_ptr(self):
        return 0xABC000

    def is_contiguous(self):
        return self._contiguous

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self):
        return self._element_size


class FakeCudaArray:
    def __init__(self, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                         "data": (0xDEF000, False), "version": 3}


class ArrayTest(unittest.TestCase):
    def test_buffer_protocol(self):
        a = ferry.as_array(array.array("i", range(6)))
        self.assertEqual((a.num_bytes, a.kind, a.item_bytes, a.device, a.readonly),
                         (24, "i", 4, ferry.HOST_MEMORY, False))
        self.assertTrue(ferry.as_array(b"abc").readonly)
        self.assertEqual(ferry.as_array(memoryview(bytearray(8)).cast("f")).kind, "f")
        with self.assertRaises(ferry.InvalidArgument):  # every other element: not contiguous
            ferry.as_array(memoryview(bytearray(8))[::2])
        with self.assertRaises(ferry.InvalidArgument):
            ferry.as_array(3.5)

    def test_torch_tensors(self):
        bf16 = FakeDtype("torch.bfloat16", True)
        t = ferry.as_array(FakeTensor(FakeDevice("cuda", 1), bf16, [4, 128], 2))
        self.assertEqual((t.data, t.num_bytes, t.device, t.kind, t.item_bytes, t.shape),
                         (0xABC000, 1024, 1, "f", 2, [4, 128]))
        i32 = FakeDtype("torch.int32", False)
        self.assertEqual(ferry.as_array(FakeTensor(FakeDevice("cpu", None), i32, [3], 4)).device,
                         ferry.HOST_MEMORY)
        u8 = FakeDtype("torch.uint8", False)
        self.assertEqual(ferry.as_array(FakeTensor(FakeDevice("cpu", None), u8, [3], 1)).kind, "u")
        with self.assertRaises(ferry.InvalidArgument):
            ferry.as_array(FakeTensor(FakeDevice("cuda", 0), bf16, [4, 128], 2, contiguous=False))
        with self.assertRaises(ferry.InvalidArgument):
            ferry.as_array(FakeTensor(FakeDevice("mps", 0), bf16, [4], 2))

    @unittest.skipUnless(importlib.util.find_spec("torch"), "torch is not installed")
    def test_real_torch_tensors_are_read_in_cpp(self):
        """A real tensor takes the binding's own path (ferry.torch_array, what every step's
        conversion does): the same fields as the Python reading of a stand-in; anything else
        (a stand-in, a view that is not contiguous) is not its to read."""
        import torch
        t = torch.zeros(4, 128, dtype=torch.bfloat16)
        a = ferry.as_array(t)
        self.assertEqual((a.data, a.num_bytes, a.device, a.kind, a.item_bytes, a.shape),
                         (t.data_ptr(), 1024, ferry.HOST_MEMORY, "f", 2, [4, 128]))
        self.assertIs(a.owner, t)
        for dtype, kind in ((torch.int64, "i"), (torch.uint8, "u"), (torch.bool, "b")):
            self.assertEqual(ferry._ferry.torch_array(torch.zeros(3, dtype=dtype)).kind, kind)
        self.assertEqual(ferry._ferry.torch_array(torch.zeros(0, 5)).num_bytes, 0)
        self.assertIsNone(ferry._ferry.torch_array(t.t()))  # not contiguous
        self.assertIsNone(ferry._ferry.torch_array(array.array("i", [1])))
        with self.assertRaises(ferry.InvalidArgument):
            ferry.as_array(t.t())

    def test_cuda_array_interface(self):
        a = ferry.as_array(FakeCudaArray((4, 8), "<f4"))
        self.assertEqual((a.data, a.num_bytes, a.kind, a.item_bytes, a.device),
                         (0xDEF000, 128, "f", 4, ferry.CUDA_UNKNOWN_DEVICE))
        self.assertEqual(ferry.as_array(FakeCudaArray((4, 8), "<i4", (32, 4)), device=2).device, 2)
        with self.assertRaises(ferry.InvalidArgument):  # column-major
            ferry.as_array(FakeCudaArray((4, 8), "<f4", (4, 16)))

    def test_an_array_describes_cuda_memory_back(self):
        """A ferry.Array of CUDA memory (KvCudaShards hands those out) is itself a
        __cuda_array_interface__ object, torch.as_tensor's and CuPy's way in; host memory's
        is not (hasattr says so)."""
        a = ferry.Array(0xDEF000, 128, 0, "f", 4, True, [4, 8], None)
        self.assertEqual(a.__cuda_array_interface__,
                         {"shape": (4, 8), "typestr": "<f4", "data": (0xDEF000, True),
                          "strides": None, "version": 3})
        self.assertEqual(ferry.as_array(a).data, 0xDEF000)
        again = ferry.as_array(FakeCudaArray((16,), "|u1"))
        self.assertEqual(again.__cuda_array_interface__["typestr"], "|u1")
        self.assertFalse(hasattr(ferry.as_array(bytearray(8)), "__cuda_array_interface__"))


class ErrorTest(unittest.TestCase):
    def test_classes(self):
        self.assertTrue(issubclass(ferry.DeadlineExceeded, TimeoutError))
        self.assertTrue(issubclass(ferry.Unavailable, ConnectionError))
        self.assertTrue(issubclass(ferry.InvalidArgument, ValueError))
        for cls in (ferry.DeadlineExceeded, ferry.DataLoss, ferry.OutOfRange):
            self.assertTrue(issubclass(cls, ferry.Error))
        self.assertEqual(ferry.OutOfRange.code, "OutOfRange")


class BootstrapTest(unittest.TestCase):
    def test_callback_bootstrap(self):
        seen = []

        def all_gather(data, timeout):
            seen.append((data, timeout))
            return [data, b"peer"]

        b = ferry.CallbackBootstrap(0, 2, all_gather)
        self.assertEqual(b.all_gather(b"mine", timeout=2.5), [b"mine", b"peer"])
        self.assertEqual(seen, [(b"mine", 2.5)])

    def test_callback_bootstrap_errors(self):
        with self.assertRaises(ferry.InvalidArgument):
            ferry.CallbackBootstrap(2, 2, lambda d, t: [d, d])
        short = ferry.CallbackBootstrap(0, 2, lambda d, t: [d])
        with self.assertRaises(ferry.InvalidArgument):  # one item for two ranks
            short.all_gather(b"x")
        not_bytes = ferry.CallbackBootstrap(0, 2, lambda d, t: [d, "text"])
        with self.assertRaises(ferry.InvalidArgument):
            not_bytes.all_gather(b"x")

        def times_out(data, timeout):
            raise TimeoutError("store did not answer")

        with self.assertRaises(ferry.DeadlineExceeded) as e:
            ferry.CallbackBootstrap(0, 2, times_out).all_gather(b"x")
        self.assertIn("store did not answer", str(e.exception))

        def fails(data, timeout):
            raise KeyError("lost")

        with self.assertRaises(ferry.Unavailable):
            ferry.CallbackBootstrap(0, 2, fails).barrier()

    def test_local_ranks(self):
        def body(b):
            got = b.all_gather(bytes([b.rank]) * (b.rank + 1))
            assert got == [b"\x00", b"\x01\x01", b"\x02\x02\x02"], got
            b.barrier()

        self.assertTrue(all(e.ok for e in ferry.run_local_ranks(3, body, timeout=30)))

    def test_local_ranks_report_failures(self):
        def body(b):
            if b.rank == 1:
                raise RuntimeError("rank 1 fails on purpose (this traceback is expected)")

        exits = ferry.run_local_ranks(2, body, timeout=30)
        self.assertEqual([e.ok for e in exits], [True, False])
        self.assertEqual(exits[1].exit_code, 1)
        with self.assertRaises(ferry.InvalidArgument):
            ferry.run_local_ranks(0, body)
        with self.assertRaises(ferry.InvalidArgument):
            ferry.run_local_ranks(1, body, timeout=float("nan"))

    def test_rendezvous(self):
        # Ranks as threads of this process, each with its own connection to rank 0 (join and
        # all_gather let go of the GIL); the others start first and retry until rank 0 listens.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = "127.0.0.1:%d" % s.getsockname()[1]
        got, errors = {}, {}

        def rank(r, world):
            try:
                if r == 0:
                    time.sleep(0.2)
                b = ferry.join_rendezvous(address, world_size=world, rank=r, timeout=10)
                got[r] = (b.rank, b.world_size, b.all_gather(bytes([r]) * (r + 1)))
                b.barrier()
            except ferry.Error as e:
                errors[r] = e

        threads = [threading.Thread(target=rank, args=(r, 3)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, {})
        for r in range(3):
            self.assertEqual(got[r], (r, 3, [b"\x00", b"\x01\x01", b"\x02\x02\x02"]))
        # A world size the ranks disagree on: both told, naming the sizes.
        got.clear()
        threads = [threading.Thread(target=rank, args=(0, 2)),
                   threading.Thread(target=rank, args=(1, 3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(sorted(errors), [0, 1])
        for e in errors.values():
            self.assertIsInstance(e, ferry.InvalidArgument)
            self.assertIn("rank 1 says the world size is 3, rank 0 says 2", str(e))
        with self.assertRaises(ferry.InvalidArgument):
            ferry.join_rendezvous("no-port", world_size=2, rank=1, timeout=1)


if __name__ == "__main__":
    unittest.main()
