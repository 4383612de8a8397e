#!/usr/bin/env python3
"""What the Python layer adds to a transfer: immediate round trips and window-1 single writes
through ferry's Python API, next to the C++ engine and a raw libfabric loop measured by
`ferry-bench fabric --json` in the same invocation (same provider, same machine).

    PYTHONPATH=build/python python3 tools/bench_python.py [--provider shm] [--iters 5000]
        [--ferry-bench build/ferry-bench] [--quick]

Prints one row per case: p50 / p99 µs through Python, the C++ engine's and raw's p50, and
python ÷ C++ (latency: above 1 is the Python layer's cost); then the same single write awaited
in asyncio and ended through a done callback, each ÷ the .wait() row.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import ferry

PING, PONG, DONE = 1, 2, 3


def percentile(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def awaited_writes(engine, region, peer, dst, write_bytes, iters):
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        await engine.write(region, peer, dst, length=write_bytes)
        times.append((time.perf_counter_ns() - t0) / 1000)
    return times


def python_side(provider, iters, write_bytes, out_path):
    """Rank 0 times round trips and writes; rank 1 answers pings. Rank 0 saves the figures."""

    def body(b):
        engine = ferry.TransferEngine(ferry.EngineOptions.from_env(provider=provider))
        buf = bytearray(write_bytes)
        region = engine.register(buf)
        addresses = b.all_gather(engine.address)
        regions = b.all_gather(region.descriptor)
        peer = engine.add_peer(addresses[1 - b.rank])
        dst = ferry.RemoteRegion.parse(regions[1 - b.rank])
        for imm in (PING, PONG, DONE):
            engine.create_imm_counter(imm)
        b.barrier()
        if b.rank == 1:
            for i in range(iters):
                engine.wait_imm(PING, i + 1, timeout=10)
                engine.write_imm(peer, PONG)
            engine.wait_imm(DONE, 1, timeout=60)
        else:
            rtt = []
            for i in range(iters):
                t0 = time.perf_counter_ns()
                engine.write_imm(peer, PING)
                engine.wait_imm(PONG, i + 1, timeout=10)
                rtt.append((time.perf_counter_ns() - t0) / 1000)
            write = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                engine.write(region, peer, dst, length=write_bytes).wait(timeout=10)
                write.append((time.perf_counter_ns() - t0) / 1000)
            # The same write awaited in asyncio, and ended through a done callback (the
            # callback thread sets an event this thread waits on).
            awaited = asyncio.run(awaited_writes(engine, region, peer, dst, write_bytes, iters))
            called = []
            for _ in range(iters):
                ended = threading.Event()
                t0 = time.perf_counter_ns()
                engine.write(region, peer, dst, length=write_bytes).add_done_callback(
                    lambda t: ended.set())
                assert ended.wait(10)
                called.append((time.perf_counter_ns() - t0) / 1000)
            engine.write_imm(peer, DONE).wait(timeout=10)
            with open(out_path, "w") as f:
                json.dump({"imm-rtt": rtt, "single": write, "awaited": awaited,
                           "callback": called}, f)
        b.barrier()
        engine.close()

    exits = ferry.run_local_ranks(2, body, timeout=600)
    if not all(e.ok for e in exits):
        sys.exit(f"python ranks failed: {exits}")
    with open(out_path) as f:
        return json.load(f)


def cpp_side(ferry_bench, provider, quick):
    args = [ferry_bench, "fabric", "--provider", provider, "--json"] + (["--quick"] if quick else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])["rows"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--provider", default="shm")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--bytes", type=int, default=4096, help="single write size (a bench row)")
    p.add_argument("--ferry-bench", default=os.path.join("build", "ferry-bench"))
    p.add_argument("--quick", action="store_true", help="ferry-bench fabric --quick")
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        py = python_side(a.provider, a.iters, a.bytes, os.path.join(tmp, "python.json"))
    rows = cpp_side(a.ferry_bench, a.provider, a.quick)

    def cpp_row(kind, size):
        return next(r for r in rows if r["kind"] == kind and r["bytes"] == size)

    print(f"provider {a.provider}, {a.iters} iterations through Python; C++ rows from "
          f"ferry-bench fabric{' --quick' if a.quick else ''} in this invocation")
    print(f"{'case':<28} {'python p50':>10} {'p99':>9} {'C++ p50':>9} {'raw p50':>9} "
          f"{'python/C++':>10}")
    for kind, size, label in (("imm-rtt", 0, "immediate round trip, µs"),
                              ("single", a.bytes, f"single {a.bytes} B write, µs")):
        c = cpp_row(kind, size)
        p50, p99 = percentile(py[kind], 0.5), percentile(py[kind], 0.99)
        print(f"{label:<28} {p50:>10.2f} {p99:>9.2f} {c['ferry']['p50_us']:>9.2f} "
              f"{c['raw']['p50_us']:>9.2f} {p50 / c['ferry']['p50_us']:>10.2f}")
    # The same write ended other ways, against .wait() in the same Python run.
    waited = percentile(py["single"], 0.5)
    print(f"{'':<28} {'p50':>10} {'p99':>9} {'÷ .wait()':>9}")
    for kind, label in (("awaited", "  awaited (asyncio), µs"),
                        ("callback", "  done callback + event, µs")):
        p50, p99 = percentile(py[kind], 0.5), percentile(py[kind], 0.99)
        print(f"{label:<28} {p50:>10.2f} {p99:>9.2f} {p50 / waited:>9.2f}")


if __name__ == "__main__":
    main()
