"""A whole deployment on this host, each role a process group of its own: prefill instances, decode
instances and the router, started as one would start them by hand on several machines
(README: examples/serve). The demo, the tests and the benchmark use it.

The roles stay in this Unix session (no setsid): under the kernel's autogroup scheduling each
session shares the CPU as one, and a prefill in a session of its own was seen to wait seconds
for its turn on a busy 2-core host (its tensor-parallel ranks meet at every layer, so each
waits for the other's).

    with Deployment(model_path, prefills=[{"tp": 2}], decodes=[{"ep": 2}]) as d:
        with d.client() as c: ...
        d.kill("decode", 0)          # SIGKILL the instance's every rank
        d.kill_rank("decode", 0, 1)  # one rank of an elastic decode instance (--elastic)
    A spec may pin its role's processes: {"ep": 1, "cpus": {0}}; with no prefills the decode
    instances prefill their own prompts (the router's --colocated).
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from control import Client

HERE = os.path.dirname(os.path.abspath(__file__))
START_TIMEOUT_S = 90.0


class Role:
    def __init__(self, kind, argv, log_path, env, cpus=None):
        self.kind = kind
        self.log = open(log_path, "ab")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, f"{kind}.py"), *argv],
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=HERE, env=env,
                                     process_group=0, preexec_fn=pin)
        self.ready = queue.Queue()
        self.ranks, self.generation = {}, 0
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and "ready" in msg:
                self.ready.put(msg)
            elif isinstance(msg, dict) and "ranks" in msg:  # an elastic decode's rank pids
                self.ranks = {int(r): pid for r, pid in msg["ranks"].items()}
                self.generation = msg.get("generation", 0)
        self.ready.put(None)

    def wait_ready(self, deadline):
        try:
            msg = self.ready.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            msg = None
        if msg is None:
            raise RuntimeError(f"{self.kind} did not start (log: {self.log.name})")
        self.address = msg.get("control") or msg.get("listen")
        return msg

    def kill(self, sig=signal.SIGKILL):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self):
        self.kill()
        self.proc.wait()
        self._drainer.join(timeout=10)
        self.proc.stdout.close()
        self.log.close()


class Deployment:
    def __init__(self, model_path, prefills=({"tp": 2},), decodes=({"ep": 2},),
                 prefill_args=(), decode_args=(), router_args=(), log_dir=None,
                 provider="shm", device="cpu"):
        self.model_path, self.log_dir = model_path, log_dir or os.path.join(HERE, ".logs")
        self.prefill_specs, self.decode_specs = list(prefills), list(decodes)
        self.prefill_args = ["--device", device, *prefill_args]
        self.decode_args = ["--device", device, *decode_args]
        self.router_args = list(router_args)
        # The roles import the ferry this process imported, wherever it came from.
        import ferry
        paths = [os.path.dirname(os.path.dirname(os.path.abspath(ferry.__file__)))]
        paths += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        self.env = {**os.environ, "FERRY_PROVIDER": provider, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": ":".join(paths)}
        if provider.startswith("tcp"):  # loopback: this host's roles only
            self.env.setdefault("FERRY_NODE", "127.0.0.1")
        self.roles = {"prefill": [], "decode": [], "router": []}
        self.router_address = None

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self, kind, argv, i, cpus=None):
        role = Role(kind, argv, os.path.join(self.log_dir, f"{kind}{i}.log"), self.env, cpus)
        self.roles[kind].append(role)
        return role

    def start(self):
        os.makedirs(self.log_dir, exist_ok=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, spec in enumerate(self.prefill_specs):
            self._start("prefill", ["--model", self.model_path, "--tp", str(spec.get("tp", 1)),
                                    *spec.get("args", ()), *self.prefill_args], i,
                        spec.get("cpus"))
        for i, spec in enumerate(self.decode_specs):
            self._start("decode", ["--model", self.model_path, "--ep", str(spec.get("ep", 1)),
                                   "--tp", str(spec.get("tp", 1)), *spec.get("args", ()),
                                   *self.decode_args], i, spec.get("cpus"))
        argv = list(self.router_args)
        for kind in ("prefill", "decode"):
            for role in self.roles[kind]:
                argv += [f"--{kind}", role.wait_ready(deadline)["control"]]
        if not self.prefill_specs:
            argv.append("--colocated")
        router = self._start("router", argv, 0)
        self.router_address = router.wait_ready(deadline)["listen"]

    def client(self, timeout=120.0):
        return Client(self.router_address, timeout=timeout)

    def kill(self, kind, i, sig=signal.SIGKILL):
        self.roles[kind][i].kill(sig)

    def kill_rank(self, kind, i, rank, sig=signal.SIGKILL):
        """One rank of an elastic decode instance (its pid as the instance printed it)."""
        os.kill(self.roles[kind][i].ranks[rank], sig)

    def close(self):
        for kind in ("router", "decode", "prefill"):
            for role in self.roles[kind]:
                role.close()

    def logs(self):
        """Every role's log, for a failing test to print."""
        out = []
        for kind, roles in self.roles.items():
            for role in roles:
                with open(role.log.name, "rb") as f:
                    out.append(f"--- {os.path.basename(role.log.name)}\n"
                               + f.read()[-4000:].decode(errors="replace"))
        return "\n".join(out)


def ask(client, requests, timeout=120.0):
    """Sends every request (dicts with distinct "id"s), then gathers the answers by id."""
    for r in requests:
        client.send(r)
    answers, deadline = {}, time.monotonic() + timeout
    while len(answers) < len(requests):
        msg = client.recv(timeout=max(0.1, deadline - time.monotonic()))
        answers[msg.get("id")] = msg
    return answers
