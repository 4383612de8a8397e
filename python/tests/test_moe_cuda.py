"""ferry.AllToAll on the CUDA device from Python: ranks sharing this machine's first GPU (one
node: the NVLink kernels, peers mapped by cuMemCreate), device memory from the CUDA runtime
through ctypes (no torch needed), checked like the host device's test. Skips without a GPU or
without ferry's CUDA build. CUDA is touched only inside the forked ranks: a process must not
fork after initialising it."""

import ctypes
import glob
import os
import time
import unittest

import ferry
import test_moe as host
from ranks import expect_error
from test_moe import HIDDEN, K, TOKENS, WEIGHTS, WORLD, bf16, inputs, row_of, send_arrays

NO_GPU, NO_CUDA_BUILD = 3, 4  # exit codes of the probe rank


def cudart():
    paths = sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so*")) + ["libcudart.so"]
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class DeviceMemory:
    """cudaMalloc'd arrays, freed with the object."""

    def __init__(self, rt):
        self.rt, self.pointers = rt, []

    def array(self, host_array, kind, item_bytes, shape):
        data = bytes(host_array)
        pointer = ctypes.c_void_p()
        assert self.rt.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(len(data))) == 0
        self.pointers.append(pointer)
        assert self.rt.cudaMemcpy(pointer, data, ctypes.c_size_t(len(data)), 1) == 0  # H2D
        assert self.rt.cudaDeviceSynchronize() == 0  # landed before ferry's stream reads it
        return ferry.Array(pointer.value, len(data), 0, kind, item_bytes, False, shape, None)

    def read(self, device_array, host_array):
        """Copies device_array into host_array (a writable buffer of the same size)."""
        buf = (ctypes.c_char * device_array.num_bytes).from_buffer(host_array)
        assert self.rt.cudaMemcpy(buf, ctypes.c_void_p(device_array.data),
                                  ctypes.c_size_t(device_array.num_bytes), 2) == 0  # D2H

    def close(self):
        for p in self.pointers:
            self.rt.cudaFree(p)


def probe(b):
    rt = cudart()
    count = ctypes.c_int(0)
    if rt is None or rt.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value < 1:
        os._exit(NO_GPU)


def cuda_config(rank, **fields):
    return host.config(rank, device=ferry.MoeDevice.CUDA, ranks_per_node=WORLD, cuda_device=0,
                       **fields)


def expert_major_cuda_body(b, streamed=False):
    """streamed: the steps enqueued on a stream of ours (set_stream), then synchronize()."""
    import array
    c = cuda_config(b.rank)
    local, cap = c.local_experts, c.expert_capacity
    mem = DeviceMemory(cudart())
    x, indices, weights = send_arrays(b.rank)
    T = TOKENS[b.rank]
    try:
        a2a = ferry.AllToAll(c, None, b)
    except ferry.Unimplemented:
        os._exit(NO_CUDA_BUILD)
    with a2a:
        dx = mem.array(x, "u", 2, [T, HIDDEN])
        di = mem.array(indices, "i", 4, [T, K])
        dw = mem.array(weights, "f", 4, [T, K])
        dout = mem.array(bytes(2 * local * cap * HIDDEN), "u", 2, [local, cap, HIDDEN])
        dcounts = mem.array(bytes(4 * local), "i", 4, [local])
        dy = mem.array(bytes(2 * T * HIDDEN), "u", 2, [T, HIDDEN])
        # Host memory where the CUDA device needs its GPU's.
        expect_error(ferry.InvalidArgument, "the call needs CUDA memory of device 0",
                     a2a.dispatch_send, x, indices, weights, num_tokens=T)
        if streamed:
            stream = ctypes.c_void_p()
            assert mem.rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0  # non-blocking
            a2a.set_stream(stream.value)
        a2a.dispatch_send(dx, di, dw)
        a2a.dispatch_recv(dout, dcounts, timeout=30)
        if streamed:
            # poll() lets the arrays go once the steps have finished, without waiting.
            assert a2a.pending_arrays > 0
            deadline = time.monotonic() + 30
            while not a2a.poll():
                assert time.monotonic() < deadline, "poll() never saw the steps finish"
            assert a2a.pending_arrays == 0
        out = array.array("H", bytes(dout.num_bytes))
        counts = array.array("i", bytes(dcounts.num_bytes))
        mem.read(dout, out)
        mem.read(dcounts, counts)
        for e in range(local):
            want = sorted(tuple(bf16(v) for v in rows[t])
                          for s in range(WORLD) for rows, experts in [inputs(s)]
                          for t in range(len(rows)) if b.rank * local + e in experts[t])
            got = sorted(row_of(out, e * cap + i) for i in range(counts[e]))
            assert got == want, (b.rank, e, counts[e], len(want))
        a2a.combine_send(dout)
        a2a.combine_recv(dy, timeout=30)
        if streamed:
            a2a.synchronize()
            a2a.set_stream(None)
        y = array.array("H", bytes(dy.num_bytes))
        mem.read(dy, y)
        rows, _ = inputs(b.rank)
        for t, row in enumerate(rows):
            assert row_of(y, t) == tuple(bf16(v * sum(WEIGHTS)) for v in row), (b.rank, t)
    mem.close()


class CudaAllToAllTest(unittest.TestCase):
    def setUp(self):
        code = ferry.run_local_ranks(1, probe, timeout=60)[0].exit_code
        if code == NO_GPU:
            self.skipTest("no CUDA GPU here")

    def run_cuda(self, body):
        exits = ferry.run_local_ranks(WORLD, body, timeout=120)
        if all(e.exit_code == NO_CUDA_BUILD for e in exits):
            self.skipTest("ferry was built without CUDA")
        self.assertTrue(all(e.ok for e in exits), exits)

    def test_expert_major_bf16_one_node(self):
        self.run_cuda(expert_major_cuda_body)

    def test_expert_major_bf16_one_node_on_a_stream(self):
        self.run_cuda(lambda b: expert_major_cuda_body(b, streamed=True))


if __name__ == "__main__":
    unittest.main()
