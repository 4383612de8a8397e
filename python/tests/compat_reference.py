"""What the compatibility layers' tests share: inputs and plain torch references for
ferry.compat.deep_ep, .pplx and .pplx_kernels on the host device (torch CPU tensors), each call
checked against one of them: random bf16 rows, ids with -1,
tokens with several experts on one rank, a rank with no tokens, world sizes 1, 2 and 4, with and
without the receive hooks, over a torch.distributed gloo group and over ferry's own bootstrap.

Every rank regenerates every rank's inputs from (seed, rank), so each checks what it received on
its own. The experts multiply their rows by a power of two; dispatched rows are compared
exactly (fp8 against a quantiser written here), the combine's weighted sums within bf16's
rounding of a float64 reference."""

import os
import tempfile
import unittest

import ferry
from ranks import run_ranks

try:
    import torch
except ImportError:  # the bindings' other tests run without torch
    torch = None

HIDDEN, EXPERTS_PER_RANK, K, MAX_TOKENS = 512, 4, 4, 12
DEV = "cpu"  # where the layers' tensors live (test_compat_cuda sets "cuda" in its ranks)


def dv(t):
    return t.to(DEV)


def hv(t):
    return t.cpu()


def fp8_dtype():
    return getattr(torch, "float8_e4m3fn", torch.uint8)


def tokens_of(world, rank):
    """Rank 1 sends nothing (when there are two ranks or more); the others differ."""
    return 0 if (world > 1 and rank == 1) else (5 + 3 * rank) % MAX_TOKENS + 1


def inputs(world, rank, round=0, columns=HIDDEN):
    """Rank's rows (random bf16, each 128-column group of its own magnitude) and top-k ids: -1
    in some entries, and a token whose ids include two experts of one rank; `round` draws
    another set of the same shapes; `columns` keeps the rows' first columns only."""
    g = torch.Generator().manual_seed(1000 + rank + 7919 * round)
    t, e = tokens_of(world, rank), EXPERTS_PER_RANK * world
    scale = 2.0 ** torch.arange(-3, HIDDEN // 128 - 3, dtype=torch.float32).repeat_interleave(128)
    x = (torch.randn(t, HIDDEN, generator=g) * scale).to(torch.bfloat16)
    rows = []
    for i in range(t):
        perm = torch.randperm(e, generator=g).tolist()
        if i == 0:  # two experts of rank 0 first
            perm = [0, 1] + [v for v in perm if v not in (0, 1)]
        rows.append(perm[:K])
    idx = torch.tensor(rows, dtype=torch.int64).view(t, K)
    idx[1::3, K - 1] = -1
    w = torch.rand(t, K, generator=g).to(torch.float32)
    return x[:, :columns].contiguous(), idx.to(torch.int64), w


def expert_factor(global_expert):
    return 2.0 ** (global_expert % 3 - 1)


def weighted_reference(x, idx, w, dtype=torch.bfloat16):
    """Each token's sum over its experts of weight * factor * row, in float64, to bf16 (or
    dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            if e >= 0:
                out[t] += float(w[t, j]) * expert_factor(e) * x[t].double()
    return out.to(dtype)


# ---- fp8, as a reference independent of ferry's: torch ops on float32 --------------------------

E4M3 = None


def e4m3_table():
    """The 256 e4m3fn codes' values (NaN for 0x7F / 0xFF)."""
    global E4M3
    if E4M3 is None:
        values = []
        for q in range(256):
            sign = -1.0 if q & 0x80 else 1.0
            exp, man = (q >> 3) & 0xF, q & 7
            if exp == 0xF and man == 7:
                values.append(float("nan"))
            elif exp == 0:
                values.append(sign * man * 2.0 ** -9)
            else:
                values.append(sign * (1 + man / 8) * 2.0 ** (exp - 7))
        E4M3 = torch.tensor(values, dtype=torch.float32)
    return E4M3


def quantize_reference(x, power_of_two):
    """(values e4m3 holds for x / scale, scales) per 128-column group: scale = max(amax, 1e-4) /
    448, rounded up to a power of two if asked; values rounded to nearest even on e4m3's grid."""
    v = x.float().view(x.shape[0], x.shape[1] // 128, 128)
    amax = v.abs().amax(dim=2, keepdim=True).clamp(min=1e-4)
    s = amax / 448.0
    if power_of_two:
        s = torch.where(torch.frexp(s).mantissa == 0.5, s,
                        torch.ldexp(torch.ones_like(s), torch.frexp(s).exponent))
    y = (v / s).clamp(-448, 448)
    _, e = torch.frexp(y)
    step = torch.ldexp(torch.ones_like(y), torch.clamp(e - 4, min=-9))  # 3 mantissa bits
    q = torch.round(y / step) * step  # torch.round: half to even
    return q.view(x.shape), s.view(x.shape[0], x.shape[1] // 128)


def decode_e4m3(t):
    return e4m3_table()[t.view(torch.uint8).long()]


# ---- ranks ---------------------------------------------------------------------------------------

def gloo(b, path, backend="gloo"):
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"file://{path}", rank=b.rank,
                            world_size=b.world_size)
    return dist.group.WORLD


def group_of(b, path, kind):
    """The group a layer is given: a torch.distributed group ("gloo", or "nccl": the rank's
    CUDA device must be set) or ferry's own bootstrap ("ferry")."""
    return gloo(b, path, kind) if kind in ("gloo", "nccl") else b


def rows_of(t):
    return sorted(tuple(r.view(torch.int16).tolist()) for r in t)


class Case(unittest.TestCase):
    def setUp(self):
        if torch is None:
            self.skipTest("no torch for this interpreter")
        os.environ.setdefault("FERRY_PROVIDER", "shm")
        # Unique ids name loopback's address: rendezvous traffic stays on this host.
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")

    def ranks(self, world, body, timeout=120.0):
        with tempfile.TemporaryDirectory() as d:
            run_ranks(self, world, lambda b: (torch.set_num_threads(1),
                                              body(b, os.path.join(d, "store")))[1], timeout)


def expert_blocks(sent, rank, counts):
    """Per local expert of `rank`: its block, its global id, the copies it received (checked
    against what every rank sent it) and the rows sent to it, in no particular order."""
    for le in range(EXPERTS_PER_RANK):
        g = rank * EXPERTS_PER_RANK + le
        want = [sx[t] for sx, sidx, _ in sent for t in range(sx.shape[0]) for j in range(K)
                if int(sidx[t, j]) == g]
        c = int(counts[le])
        assert c == len(want), (rank, le, c, len(want))
        yield le, g, c, want


def encoded_fp8(world, s, spt):
    """Rank s's inputs as e4m3 codes (the caller's quantisation) with spt float32 scales a row:
    the quantiser's, one per 128 columns, or random ones of any other count."""
    x, idx, w = inputs(world, s)
    q, scales = quantize_reference(x, True)
    codes = (q[..., None] == e4m3_table()[None, None, :]).float().argmax(-1).to(torch.uint8)
    if spt != HIDDEN // 128:
        g = torch.Generator().manual_seed(500 + s)
        scales = torch.rand(x.shape[0], spt, generator=g) + 0.5
    return codes.view(fp8_dtype()), scales.contiguous(), idx, w


class Behaviours:
    """A test per behaviour of a layer's body (body_of(world, group kind, only=name)), each in
    world sizes 1 (ferry's bootstrap), 2 (gloo) and 4 (ferry's bootstrap): a failure names the
    behaviour and the world."""

    def in_every_world(self, name):
        for world, kind in ((1, "ferry"), (2, "gloo"), (4, "ferry")):
            with self.subTest(world=world, group=kind):
                self.ranks(world, self.body_of(world, kind, only=name),
                           timeout=240.0 if world == 4 else 120.0)

    def test_every_behaviour_has_a_test(self):
        tests = {n[len("test_"):] for n in dir(self) if n.startswith("test_")}
        self.assertEqual(set(self.behaviours) - tests, set())


def run_with_shim(test, shim, script):
    """script in a new interpreter with the shim folder (and ferry's) on PYTHONPATH, as an
    engine's worker processes inherit it; it must print "shim ok"."""
    import subprocess
    import sys
    paths = [shim, os.path.dirname(os.path.dirname(ferry.__file__))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    test.assertEqual(done.returncode, 0, done.stderr)
    test.assertIn("shim ok", done.stdout)
