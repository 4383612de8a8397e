"""The serving example end to end on this host (ferry's host device over shm): every prompt's
generated tokens must equal the colocated reference's (model.generate: one process, plain torch),
and every failure must end in the answer the router documents.

Run: PYTHONPATH=build/python /usr/bin/python3 -m unittest discover -s examples/serve
"""

import hashlib
import os
import random
import signal
import sys
import tempfile
import time
import unittest
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ferry  # noqa: E402
import model as mdl  # noqa: E402
from control import Client, announce  # noqa: E402
from deploy import Deployment, ask  # noqa: E402

torch.set_num_threads(1)
TMP = tempfile.mkdtemp(prefix="ferry-serve-test-")
MODEL_PATH = os.path.join(TMP, "model.safetensors")
CONFIG, WEIGHTS = mdl.load_or_make(MODEL_PATH, seed=7)
REFERENCE = mdl.Model(CONFIG, WEIGHTS)


def prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab) for _ in range(length)]


def reference(p, new):
    """(tokens, sha256 of the aux hidden state's float32 bytes) of the colocated run."""
    tokens, aux = mdl.generate(REFERENCE, p, new)
    return tokens, (hashlib.sha256(aux.numpy().tobytes()).hexdigest() if aux is not None
                    else None)


def kv_bytes(p):
    """What a request's KV moves into the decode side: every layer of its prompt pages but the
    last token's, on every decode rank together, and the aux hidden state."""
    if len(p) < 2:
        return 0
    page = 2 * CONFIG.kv_heads * CONFIG.page_tokens * CONFIG.head_dim * 4
    return mdl.pages_for(CONFIG, len(p) - 1) * CONFIG.layers * page + CONFIG.hidden * 4


class DeploymentCase(unittest.TestCase):
    """What the end-to-end tests share: a deployment per test, answers checked against the
    colocated reference, the prefills' page pools watched until whole."""

    def deployment(self, **kw):
        d = Deployment(MODEL_PATH, log_dir=os.path.join(TMP, self.id().rsplit(".", 1)[1]), **kw)
        d.__enter__()
        self.addCleanup(d.__exit__, None, None, None)
        return d

    def check_answers(self, requests, answers, d, colocated=False):
        for r in requests:
            a = answers[r["id"]]
            self.assertNotIn("error", a, f"request {r['id']}: {a}\n{d.logs()}")
            tokens, aux_sha = reference(r["prompt"], r["max_new_tokens"])
            self.assertEqual(a["tokens"], tokens, f"request {r['id']} of {len(r['prompt'])}")
            self.assertEqual(a["aux_sha256"], aux_sha, f"request {r['id']}: aux differs")
            self.assertEqual(a["kv_bytes"], 0 if colocated else kv_bytes(r["prompt"]))

    def wait_pages_free(self, client, prefill_names=None, timeout=30.0):
        """Polls the router's stats until every live prefill's pool is whole again."""
        deadline = time.monotonic() + timeout
        while True:
            client.send({"op": "stats", "id": "stats"})
            stats = client.recv(timeout=10)["stats"]
            pools = {n: s for n, s in stats.items() if n.startswith("prefill") and s["alive"]}
            if all(s["free_pages"] == s["pages"] for s in pools.values()):
                return pools
            self.assertLess(time.monotonic(), deadline, f"pages still held: {pools}")
            time.sleep(0.2)



class ServeTest(DeploymentCase):
    def test_tp2_prefill_into_ep2_decode_tokens_equal_colocated(self):
        """Prefill TP 2 (chunks of 32) into decode EP 2 (attention DP 2, TP 1): 10 prompts of
        1 to 120 tokens, one shorter than a page, several longer than a chunk; the second half
        arrives while the first decodes."""
        d = self.deployment(prefills=[{"tp": 2}], decodes=[{"ep": 2}],
                            prefill_args=["--chunk", "32", "--batch-tokens", "64"])
        lengths = [70, 1, 9, 33, 2, 120, 16, 17, 48, 5]
        requests = [{"id": i, "prompt": prompt(i, n), "max_new_tokens": 12 if i < 5 else 6}
                    for i, n in enumerate(lengths)]
        with d.client() as c:
            for r in requests[:5]:
                c.send(r)
            first = c.recv(timeout=120)  # one has finished: the others are decoding
            answers = ask(c, requests[5:])
            answers[first["id"]] = first
            while len(answers) < len(requests):
                a = c.recv(timeout=120)
                answers[a["id"]] = a
            self.check_answers(requests, answers, d)
            self.assertTrue(any(a["attempts"] == 1 and "queue_ms" in a for a in answers.values()))
            self.wait_pages_free(c)

    def test_two_decode_instances_share_a_prefill_tp1_into_tp2(self):
        """One prefill of TP 1 feeds two decode instances: one of EP 2 whose attention is TP 2
        (a page rebuilt from halves of the prefill's), one of EP 1."""
        d = self.deployment(prefills=[{"tp": 1}], decodes=[{"ep": 2, "tp": 2}, {"ep": 1}])
        requests = [{"id": i, "prompt": prompt(100 + i, n), "max_new_tokens": 8}
                    for i, n in enumerate([40, 3, 65, 18, 1, 29])]
        with d.client() as c:
            answers = ask(c, requests)
            self.check_answers(requests, answers, d)
            used = {a["decode"] for a in answers.values()}
            self.assertEqual(len(used), 2, f"both decode instances serve: {used}")

    def test_colocated_baseline_tokens_equal(self):
        """The benchmark's baseline: no prefill instances, the decode instance (EP 2) prefills
        prompts in chunks mixed into its decode steps -- the same tokens."""
        d = self.deployment(prefills=[], decodes=[{"ep": 2, "args": ["--chunk", "32"]}])
        requests = [{"id": i, "prompt": prompt(500 + i, n), "max_new_tokens": 10}
                    for i, n in enumerate([1, 70, 12, 40])]
        with d.client() as c:
            answers = ask(c, requests)
        for r in requests:
            a = answers[r["id"]]
            self.assertNotIn("error", a, d.logs())
            tokens, aux_sha = reference(r["prompt"], r["max_new_tokens"])
            self.assertEqual((a["tokens"], a["aux_sha256"], a["kv_bytes"]), (tokens, aux_sha, 0))

    def test_a_decode_killed_mid_stream(self):
        """The decode instance receiving a long prompt's KV is killed while it streams: its
        request is answered with an error, the prefill frees the pages once its writes have
        ended and serves the other decode instance, before and after."""
        d = self.deployment(prefills=[{"tp": 1, "args": ["--layer-delay-ms", "150"]}],
                            decodes=[{"ep": 1}, {"ep": 1}])
        long_a, long_b = prompt(200, 90), prompt(201, 90)
        with d.client() as c:
            c.send({"id": "a", "prompt": long_a, "max_new_tokens": 4})
            c.send({"id": "b", "prompt": long_b, "max_new_tokens": 4})
            time.sleep(0.35)  # both are in the prefill's pass, their layers streaming
            d.kill("decode", 0)
            answers = {}
            while len(answers) < 2:
                a = c.recv(timeout=60)
                answers[a["id"]] = a
            failed = [a for a in answers.values() if "error" in a]
            served = [a for a in answers.values() if "error" not in a]
            self.assertEqual(len(failed), 1, answers)
            self.assertIn("lost", failed[0]["error"])
            self.assertTrue(failed[0]["error"].startswith("unavailable: "), failed[0])
            self.assertIs(failed[0]["retryable"], True)
            want = reference(long_a if served[0]["id"] == "a" else long_b, 4)[0]
            self.assertEqual(served[0]["tokens"], want)
            self.wait_pages_free(c)
            r = {"id": "after", "prompt": prompt(202, 40), "max_new_tokens": 5}
            self.check_answers([r], ask(c, [r]), d)
            # With no decode instance left, a request reads as an outage the client may retry
            # (once the router has seen the last one go), never as a fault of its own.
            d.kill("decode", 1)
            deadline = time.time() + 30
            while True:
                c.send({"id": "none", "prompt": prompt(203, 8), "max_new_tokens": 2})
                a = c.recv(timeout=30)
                self.assertTrue(a["error"].startswith("unavailable: "), a)
                self.assertIs(a["retryable"], True)
                if "no decode instance is up" in a["error"] or time.time() > deadline:
                    break
                time.sleep(0.1)
            self.assertIn("no decode instance is up", a["error"])

    def test_an_elastic_decode_loses_each_rank_in_turn(self):
        """Decode EP 2 with --elastic: rank 0, then rank 1, dies in the middle of a step while
        it holds requests; the other serves on, a new process takes the rank (generations 1
        and 2), and every request of three waves ends with the colocated tokens -- the lost
        rank's failed back to the router as retryable and sent again. Over tcp;ofi_rxm on
        loopback: over shm a process that ends while a peer writes into it can leave the
        peer's engine stalled in the provider, and a process that replaces it was seen to fault
        inside the provider (libfabric 1.17), neither of which a NIC does."""
        d = self.deployment(prefills=[{"tp": 1, "args": ["--layer-delay-ms", "20"]}],
                            decodes=[{"ep": 2, "args": ["--elastic", "--step-timeout", "5",
                                                        "--recovery-timeout", "60"]}],
                            provider="tcp;ofi_rxm")
        lengths = [30, 5, 60, 12, 41, 3, 25, 50, 8]
        with d.client() as c, d.client() as watch:
            for wave, lost in enumerate((0, 1, None)):
                requests = [{"id": 100 * wave + i, "prompt": prompt(700 + 100 * wave + i, n),
                             "max_new_tokens": 40 if lost is not None else 12}
                            for i, n in enumerate(lengths)]
                for r in requests:
                    c.send(r)
                if lost is not None:
                    self.wait_for_load(watch, lost)
                    # Mid-step (elastic.crash_hook: its engines closed first, as over shm a
                    # process killed inside the provider can leave its peers spinning on a
                    # lock).
                    d.kill_rank("decode", 0, lost, signal.SIGUSR1)
                answers = {}
                while len(answers) < len(requests):
                    a = c.recv(timeout=180)
                    answers[a["id"]] = a
                self.check_answers(requests, answers, d)
                if lost is not None:
                    self.assertTrue(any(a["attempts"] > 1 for a in answers.values()),
                                    f"wave {wave}: no request was sent again: {answers}")
            self.assertEqual(d.roles["decode"][0].generation, 2, d.logs())

    def wait_for_load(self, watch, rank, timeout=60):
        """Until rank `rank` of the decode instance (its group: attention TP 1) holds
        requests, none of them still streaming its KV in, asking the router's stats over
        `watch`. (Over shm a process that ends while a peer's writes stream into it can leave
        that peer's engine stalled in the provider -- the prefill's here -- which no NIC
        does.)"""
        deadline = time.monotonic() + timeout
        while True:
            watch.send({"op": "stats", "id": "stats"})
            stats = next(s for n, s in watch.recv(timeout=10)["stats"].items()
                         if n.startswith("decode"))
            if stats["loads"][rank] > 0 and stats["streaming"][rank] == 0:
                return
            self.assertLess(time.monotonic(), deadline, f"rank {rank} never held a request")
            time.sleep(0.02)

    def test_a_prefill_killed_its_requests_retried_on_another(self):
        """Two prefills; one is killed in the middle of a pass. Its request's KV transfer ends
        (Unavailable or DeadlineExceeded) within the decoder's deadline and the router tries
        the other prefill: every prompt is answered, tokens equal to colocated."""
        # Long enough for the fast prefill's first pass (3.07 s seen on 2 cores, its forked
        # rank warming torch up beside the others) to beat it.
        kv_timeout = 6.0
        d = self.deployment(prefills=[{"tp": 1, "args": ["--layer-delay-ms", "400"]},
                                      {"tp": 1, "args": ["--layer-delay-ms", "5"]}],
                            decodes=[{"ep": 1, "args": ["--kv-timeout", str(kv_timeout)]}])
        requests = [{"id": i, "prompt": prompt(300 + i, 50), "max_new_tokens": 4}
                    for i in range(2)]
        with d.client() as c:
            t0 = time.monotonic()
            for r in requests:
                c.send(r)
            time.sleep(0.6)  # the slow prefill is in its pass
            d.kill("prefill", 0)
            answers = {}
            while len(answers) < 2:
                a = c.recv(timeout=60)
                answers[a["id"]] = a
            elapsed = time.monotonic() - t0
            self.check_answers(requests, answers, d)
            self.assertEqual(sorted(a["attempts"] for a in answers.values()), [1, 2])
            # The deadline, the decoder's wait for the prefill's acknowledgement (a few
            # seconds), the retry itself: well under 20 s.
            self.assertLess(elapsed, 20.0)

    def test_malformed_and_oversized_prompts_are_refused_clearly(self):
        d = self.deployment(prefills=[{"tp": 1}], decodes=[{"ep": 1}],
                            router_args=["--max-prompt", "200"])
        good = {"id": "good", "prompt": prompt(400, 30), "max_new_tokens": 5}
        with Client(d.router_address) as c:
            c.send(b"this is not json\n")
            self.assertIn("not JSON", c.recv(timeout=30)["error"])
            c.send(b"[" + b"1," * (600 << 10) + b"1]\n")  # over the router's 1 MiB line
            self.assertIn("over", c.recv(timeout=30)["error"])
            bad = [({"id": 1, "prompt": []}, "non-empty"),
                   ({"id": 2, "prompt": "hello"}, "non-empty"),
                   ({"id": 3, "prompt": [1, 2, CONFIG.vocab]}, "not an id"),
                   ({"id": 4, "prompt": [1, -1]}, "not an id"),
                   ({"id": 5, "prompt": [1, 2.5]}, "not an id"),
                   ({"id": 6, "prompt": list(range(201))}, "at most 200"),
                   ({"id": 7, "prompt": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
                   ({"id": 8, "prompt": [1, 2], "max_new_tokens": True}, "max_new_tokens")]
            answers = ask(c, [b for b, _ in bad] + [good])
            for request, text in bad:
                self.assertIn(text, answers[request["id"]].get("error", ""), answers)
                self.assertIs(answers[request["id"]].get("retryable"), False, answers)
            self.check_answers([good], answers, d)


def gpus():
    """GPUs torch sees, asked in a child process: this one forks ranks later, and a process
    must not fork once it has initialised CUDA."""
    import subprocess
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


class ServeCudaTest(DeploymentCase):
    """The same deployments with the model on the GPU: the decode's MoE layers on ferry's CUDA
    device (NVLink kernels), the prefill's layer counter a GpuLayerCounter on torch's stream,
    the caches host memory mapped into the GPU (the lent machine's fabric registers no GPU
    memory). Tokens must still equal the colocated CPU reference's."""

    def setUp(self):
        self.gpus = gpus()
        if self.gpus == 0:
            self.skipTest("no CUDA GPU here")

    def deployment(self, **kw):
        return super().deployment(device="cuda", **kw)

    def test_tp2_prefill_into_ep1_decode_on_the_gpu(self):
        d = self.deployment(prefills=[{"tp": 2}], decodes=[{"ep": 1}],
                            prefill_args=["--chunk", "32"])
        requests = [{"id": i, "prompt": prompt(600 + i, n), "max_new_tokens": 8}
                    for i, n in enumerate([70, 1, 9, 33, 120, 2])]
        with d.client() as c:
            self.check_answers(requests, ask(c, requests), d)

    def test_the_decode_step_as_a_cuda_graph(self):
        """--cuda-graph: the decode step captured once, replayed for every batch size (the
        AllToAll reads the token count on the GPU); requests join and leave between steps."""
        d = self.deployment(prefills=[{"tp": 1}],
                            decodes=[{"ep": 1, "args": ["--cuda-graph", "--max-batch", "8"]}])
        requests = [{"id": i, "prompt": prompt(800 + i, n), "max_new_tokens": 6 + 2 * i}
                    for i, n in enumerate([50, 1, 17, 90, 4])]
        with d.client() as c:
            self.check_answers(requests, ask(c, requests), d)

    def test_tp1_prefill_into_ep2_tp2_decode_on_the_gpus(self):
        if self.gpus < 2:
            self.skipTest("EP 2 on the CUDA device wants two GPUs (here one: its receive "
                          "kernels would wait resident for each other's time slices)")
        d = self.deployment(prefills=[{"tp": 1}], decodes=[{"ep": 2, "tp": 2}])
        requests = [{"id": i, "prompt": prompt(700 + i, n), "max_new_tokens": 8}
                    for i, n in enumerate([40, 3, 65])]
        with d.client() as c:
            self.check_answers(requests, ask(c, requests), d)



class HostileControlTest(DeploymentCase):
    """Messages on an instance's control socket that no router would send: each is refused
    (a generate answered `failed`), the instance goes on serving the router's requests."""

    def test_malformed_control_messages_leave_instances_serving(self):
        d = self.deployment(prefills=[{"tp": 1}], decodes=[{"ep": 1}])
        with Client(d.roles["decode"][0].address) as c:
            self.assertEqual(c.recv(timeout=30)["role"], "decode")  # its hello
            bad = [{"op": "generate"}, {"op": "generate", "id": 1, "prompt_len": "3",
                                        "last_token": 1, "max_new_tokens": 2},
                   {"op": "generate", "id": 2, "prompt_len": 3, "last_token": -1,
                    "max_new_tokens": 2},
                   {"op": "generate", "id": 3, "prompt_len": 3, "last_token": 1,
                    "max_new_tokens": 2, "prefill_address": "zz", "prefill_tp": 1},
                   {"op": "generate", "id": 4, "prompt_len": 1 << 30, "last_token": 1,
                    "max_new_tokens": 2},
                   {"op": "generate", "id": 5, "prompt_len": 2, "last_token": 1,
                    "max_new_tokens": True, "prompt": [1, 2]}]
            c.send(b"not json\n")
            c.send(b"[1, 2]\n")
            for m in bad:
                c.send(m)
            for m in bad:
                reply = c.recv(timeout=30)
                self.assertEqual((reply["op"], reply["retryable"]), ("failed", False), reply)
        with Client(d.roles["prefill"][0].address) as c:
            self.assertEqual(c.recv(timeout=30)["role"], "prefill")
            c.send({"op": "prompt", "id": 9, "tokens": [1, -5]})
            c.send({"op": "prompt", "id": "x", "tokens": [1]})
            c.send({"op": "stats"})
            self.assertEqual(c.recv(timeout=30)["op"], "stats")  # still answering
        r = {"id": "after", "prompt": prompt(900, 30), "max_new_tokens": 5}
        with d.client() as c:
            self.check_answers([r], ask(c, [r]), d)



class AnnounceTest(unittest.TestCase):
    def test_a_line_is_one_write_to_the_shared_stdout(self):
        """announce writes the object and its newline in one os.write, to stdout's descriptor:
        processes sharing an instance's stdout cannot land a line of theirs inside it (print,
        unbuffered, writes the text and its end apart)."""
        writes = []
        with mock.patch("os.write", side_effect=lambda fd, data: writes.append((fd, data))):
            announce({"ready": "decode", "control": "127.0.0.1:1"})
        self.assertEqual(writes, [(sys.stdout.fileno(),
                                   b'{"ready": "decode", "control": "127.0.0.1:1"}\n')])


class ModelFileTest(unittest.TestCase):
    def test_save_load_round_trip_and_refusals(self):
        path = os.path.join(TMP, "m2.safetensors")
        mdl.save(path, CONFIG, WEIGHTS)
        config, weights = mdl.load(path)
        self.assertEqual(config, CONFIG)
        self.assertTrue(all(torch.equal(weights[k], WEIGHTS[k]) for k in WEIGHTS))
        broken = dict(WEIGHTS)
        del broken["layers.1.wq"]
        mdl.save(path + ".missing", CONFIG, broken)
        with self.assertRaisesRegex(ValueError, "missing.*layers.1.wq"):
            mdl.load(path + ".missing")
        broken = dict(WEIGHTS, **{"lm_head": torch.zeros(3, 3)})
        mdl.save(path + ".shape", CONFIG, broken)
        with self.assertRaisesRegex(ValueError, "lm_head"):
            mdl.load(path + ".shape")
        for junk in (b"\x80not a model", b"", (1 << 40).to_bytes(8, "little"),
                     (4).to_bytes(8, "little") + b"[1] "):
            with open(path + ".junk", "wb") as f:
                f.write(junk)
            with self.assertRaisesRegex(ValueError, "not a model file"):
                mdl.load(path + ".junk")
        # A byte range past the file's end.
        with open(path, "rb") as f:
            data = bytearray(f.read())
        with open(path + ".short", "wb") as f:
            f.write(data[:-100])
        with self.assertRaisesRegex(ValueError, "bad entry"):
            mdl.load(path + ".short")

    def test_cache_layout_is_ferrys_hnd(self):
        """model.cache_shape's pages are where ferry's KvSide says (HND, float32)."""
        from ranks import kv_side
        for tp in (1, 2):
            side = kv_side(CONFIG, tp)
            pages = 3
            cache = torch.arange(torch.Size(mdl.cache_shape(CONFIG, pages, CONFIG.kv_heads // tp))
                                 .numel(), dtype=torch.int64).view(
                mdl.cache_shape(CONFIG, pages, CONFIG.kv_heads // tp))
            for page, comp, head, token in [(0, 0, 0, 0), (2, 1, side.heads_per_rank - 1, 15),
                                            (1, 0, 0, 7)]:
                element = int(cache[0, page, comp, head, token, 0])
                self.assertEqual(element * 4, side.offset(page, comp, head, token))
            self.assertEqual(cache[0].numel() * 4, side.page_bytes * pages)

    def test_the_combine_is_ferrys_sum_bit_for_bit(self):
        """Model.combine against ferry's AllToAll (host device, EP 2) on the same routed bf16
        outputs: the same bits, which is what lets served tokens equal colocated ones."""
        tokens = 13

        def body(b):
            rank = b.rank
            g = torch.Generator().manual_seed(rank)
            h = torch.randn(tokens, CONFIG.hidden, generator=g, dtype=torch.float64)
            xn, ids, weights = REFERENCE.route(0, h)
            engine = ferry.TransferEngine(ferry.EngineOptions.from_env(provider="shm"))
            cfg = ferry.AllToAllConfig(world_size=2, rank=rank, num_experts=CONFIG.experts,
                                       experts_per_token=CONFIG.top_k,
                                       max_tokens_per_rank=tokens, hidden=CONFIG.hidden,
                                       dtype=ferry.DispatchDtype.BF16)
            with engine, ferry.AllToAll(cfg, engine, b) as a2a:
                x = xn.to(mdl.BF16)
                a2a.dispatch_send(x, ids.to(torch.int32), weights, num_tokens=tokens)
                recv = torch.zeros(cfg.local_experts, cfg.expert_capacity, CONFIG.hidden,
                                   dtype=mdl.BF16)
                counts = torch.zeros(cfg.local_experts, dtype=torch.int32)
                a2a.dispatch_recv(recv, counts)
                out = torch.zeros_like(recv)
                for e in range(cfg.local_experts):
                    n = int(counts[e])
                    out[e, :n] = REFERENCE.expert(0, rank * cfg.local_experts + e, recv[e, :n])
                a2a.combine_send(out)
                y = torch.zeros(tokens, CONFIG.hidden, dtype=mdl.BF16)
                a2a.combine_recv(y)
            want = REFERENCE.combine(REFERENCE.local_moe(0, xn, ids, weights), weights)
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), \
                (y - want).abs().max()

        exits = ferry.run_local_ranks(2, body, 120)
        self.assertTrue(all(e.ok for e in exits), exits)


if __name__ == "__main__":
    unittest.main()
