"""ferry.deep_ep and ferry.pplx on the CUDA device: test_engine_api's calls and torch references
with the layers' tensors on the GPU (ranks of one node sharing this machine's first GPU: world
size 1, and 2 where two ranks fit, as MPS clients under tools/gpu_check.sh). Skips without a
GPU, or torch with CUDA, in a probe rank: CUDA is touched only inside the forked ranks (a
process must not fork after initialising it). The expert ids, fp8 made inside the dispatch,
the combine-time weights and the padded expert blocks here run in ferry's CUDA kernels."""

import os
import unittest

import ferry
import test_engine_api as api

NO_GPU = 3


def probe(b):
    try:
        import torch
        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    os._exit(0 if ok else NO_GPU)


def on_gpu(body):
    def run(b, store):
        import torch
        api.DEV = "cuda"
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()  # pplx runs on the current stream, not the legacy one
        with torch.cuda.stream(stream):
            body(b, store)
        torch.cuda.synchronize()
    return run


class CudaEngineApiTest(api.Case):
    def setUp(self):
        super().setUp()
        if ferry.run_local_ranks(1, probe, 60.0)[0].exit_code == NO_GPU:
            self.skipTest("no CUDA GPU (or torch without CUDA) here")

    def test_deep_ep_world_1(self):
        self.ranks(1, on_gpu(api.deep_ep_body(1, "ferry")), timeout=240.0)

    def test_deep_ep_world_2_over_gloo(self):
        self.ranks(2, on_gpu(api.deep_ep_body(2, "gloo")), timeout=240.0)

    def test_pplx_world_1(self):
        self.ranks(1, on_gpu(api.pplx_body(1, "ferry")), timeout=240.0)

    def test_pplx_world_2(self):
        self.ranks(2, on_gpu(api.pplx_body(2, "ferry")), timeout=240.0)


if __name__ == "__main__":
    unittest.main()
