"""The served model (examples/serve) disaggregated against colocated, in one run: decode
inter-token latency (ITL) under a steady decode load, without and with long prompts arriving,
and the long prompts' TTFT. The baseline is the same model on the same number of ranks, each
rank prefilling chunks mixed into its decode steps (the router's --colocated): the stall the
source documents describe.

  disaggregated: 1 prefill rank + 1 decode rank, each pinned to half the host's CPUs
  colocated:     1 decode instance of EP 2 (its two ranks prefill and decode)

Targets: disaggregated p99 ITL with arrivals <= 1.2 x without; the KV tail after the prefill's
last layer <= one layer's transfer time, measured here by one layer of a long prompt moved
between two ranks as the messenger moves it (a write per page, one immediate for the layer),
the receiver counting it; and, for reference, as one contiguous write.

  PYTHONPATH=build/python /usr/bin/python3 tools/bench_serve.py [--json out.json] [--quick]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "serve"))
import torch  # noqa: E402

import ferry  # noqa: E402
import model as mdl  # noqa: E402
from deploy import Deployment  # noqa: E402


WEIGHT_MASK = 0xFFFF0000  # a paged write's immediate carries its pages there, as the KV's do


def percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def prompt(seed, n, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (n,), generator=g).tolist()


def run_load(d, args, vocab, with_arrivals):
    """Background decoders (short prompts, long generations); with_arrivals, long prompts sent
    while they decode. Returns (background answers, long-prompt answers, arrival window)."""
    background = [{"id": f"bg{i}", "prompt": prompt(i, 8, vocab),
                   "max_new_tokens": args.background_tokens} for i in range(args.background)]
    longs = [{"id": f"long{i}", "prompt": prompt(100 + i, args.long_tokens, vocab),
              "max_new_tokens": 4} for i in range(args.arrivals if with_arrivals else 0)]
    answers = {}
    window = [None, None]
    with d.client(timeout=600) as c:
        for r in background:
            c.send(r)
        stop = threading.Event()

        def arrive():
            time.sleep(args.warmup_s)
            window[0] = time.time()
            for r in longs:
                if stop.is_set():
                    return
                c.send(r)
                time.sleep(args.interval_s)

        sender = threading.Thread(target=arrive)
        sender.start()
        while len(answers) < len(background) + len(longs):
            a = c.recv(timeout=600)
            answers[a["id"]] = a
            if "error" in a:
                stop.set()
                raise RuntimeError(f"{a['id']}: {a['error']}\n{d.logs()}")
        sender.join()
    long_answers = [answers[r["id"]] for r in longs]
    if long_answers:
        window[1] = max(a["t_first_token"] for a in long_answers)
    return [answers[r["id"]] for r in background], long_answers, window


def itls(background, window):
    """Inter-token gaps (ms) of the background requests, those ending inside `window` when it
    is given, else all but each request's first few (the batch filling up)."""
    out = []
    for a in background:
        times = [a["t_first_token"]]
        for gap in a["itl_ms"]:
            times.append(times[-1] + gap / 1e3)
        for t0, t1 in zip(times[3:], times[4:]):
            if window[0] is None or window[0] <= t1 <= window[1]:
                out.append((t1 - t0) * 1e3)
    return out


def measure_mode(name, model_path, args, vocab):
    if name == "disaggregated":
        # Each side on half the host's CPUs, as on machines of their own (on 2 CPUs: one each).
        cpus = sorted(os.sched_getaffinity(0))
        half = max(1, len(cpus) // 2)
        spec = dict(prefills=[{"tp": 1, "cpus": set(cpus[half:]) or set(cpus),
                               "args": ["--chunk", str(args.chunk)]}],
                    decodes=[{"ep": 1, "cpus": set(cpus[:half])}])
    else:
        spec = dict(prefills=[], decodes=[{"ep": 2, "args": ["--chunk", str(args.chunk)]}])
    with Deployment(model_path, log_dir=os.path.join(args.logs, name), **spec) as d:
        run_load(d, args, vocab, False)  # warm: every code path once
        quiet_bg, _, _ = run_load(d, args, vocab, False)
        busy_bg, longs, window = run_load(d, args, vocab, True)
    quiet, busy = itls(quiet_bg, [None, None]), itls(busy_bg, window)
    result = {"mode": name, "itl_quiet_p50": percentile(quiet, 50),
              "itl_quiet_p99": percentile(quiet, 99), "itl_busy_p50": percentile(busy, 50),
              "itl_busy_p99": percentile(busy, 99), "itl_samples": [len(quiet), len(busy)],
              "ttft_long_p50": statistics.median(a["ttft_ms"] for a in longs)}
    result["p99_ratio"] = result["itl_busy_p99"] / result["itl_quiet_p99"]
    tails = [a["kv_tail_ms"] for a in longs if "kv_tail_ms" in a]
    if tails:
        result["kv_tail_p50"] = statistics.median(tails)
        result["prefill_p50"] = statistics.median(a["prefill_ms"] for a in longs)
    return result


def layer_transfer_ms(config, tokens, provider):
    """One layer of a prompt's KV moved by one rank's engine into another's, median of 30
    after 10: as the messenger moves it (a write per page, one immediate for the layer, the
    receiver counting it) and as one contiguous write of the same bytes. Returns
    ({"paged": ms, "contiguous": ms}, bytes)."""
    page = 2 * config.kv_heads * config.page_tokens * config.head_dim * 4
    pages = mdl.pages_for(config, tokens - 1)
    out_path = os.path.join(tempfile.mkdtemp(prefix="ferry-bench-serve-"), "layer.json")

    def body(b):
        engine = ferry.TransferEngine(ferry.EngineOptions.from_env(provider=provider))
        buf = bytearray(pages * page)
        region = engine.register(buf)
        addresses = b.all_gather(engine.address)
        regions = b.all_gather(region.descriptor)
        peer = engine.add_peer(addresses[1 - b.rank])
        engine.create_imm_counter(5)
        engine.create_imm_counter(6, weight_mask=WEIGHT_MASK)  # counts the pages
        b.barrier()
        times = {"paged": [], "contiguous": []}
        for kind in times:
            for i in range(40):
                if b.rank == 0:
                    t = time.perf_counter()
                    if kind == "paged":
                        engine.write_paged(region, peer, regions[1], page_bytes=page,
                                           src_pages=list(range(pages)),
                                           dst_pages=list(range(pages)), imm=6, imm_once=True,
                                           imm_weight_mask=WEIGHT_MASK)
                    else:
                        engine.write(region, peer, regions[1], imm=5)
                    b.all_gather(b"")  # the receiver counted it
                    times[kind].append((time.perf_counter() - t) * 1e3)
                else:
                    if kind == "paged":
                        engine.wait_imm(6, (i + 1) * pages, timeout=10)
                    else:
                        engine.wait_imm(5, i + 1, timeout=10)
                    b.all_gather(b"")
        if b.rank == 0:
            with open(out_path, "w") as f:
                json.dump({k: statistics.median(v[10:]) for k, v in times.items()}, f)
        b.barrier()
        engine.close()

    exits = ferry.run_local_ranks(2, body, 120)
    if not all(e.ok for e in exits):
        raise RuntimeError(f"layer transfer baseline failed: {exits}")
    with open(out_path) as f:
        return json.load(f), pages * page


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a shorter run (a smoke test)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--background", type=int, default=6, help="decoding requests")
    p.add_argument("--background-tokens", type=int, default=160)
    p.add_argument("--long-tokens", type=int, default=384, help="each arriving prompt's length")
    p.add_argument("--arrivals", type=int, default=4)
    p.add_argument("--interval-s", type=float, default=0.6)
    p.add_argument("--warmup-s", type=float, default=0.8)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--logs", default=os.path.join(tempfile.gettempdir(), "ferry-bench-serve"))
    p.add_argument("--provider", default=os.environ.get("FERRY_PROVIDER", "shm"))
    args = p.parse_args()
    if args.quick:
        args.background, args.background_tokens, args.arrivals, args.long_tokens = 3, 60, 2, 128
    torch.set_num_threads(1)
    model_path = os.path.join(tempfile.gettempdir(), "ferry-serve-model.safetensors")
    config, _ = mdl.load_or_make(model_path)
    results = [measure_mode(m, model_path, args, config.vocab)
               for m in ("disaggregated", "colocated")]
    layer_ms, layer_bytes = layer_transfer_ms(config, args.long_tokens, args.provider)
    print(f"serve: {args.background} decoding requests, {args.arrivals} prompts of "
          f"{args.long_tokens} tokens arriving {args.interval_s} s apart, chunk {args.chunk}; "
          f"ITL in ms")
    print(f"{'mode':>14} {'quiet p50':>9} {'p99':>7} {'arrivals p50':>12} {'p99':>7} "
          f"{'p99 ratio':>9} {'TTFT long':>9} {'KV tail':>7}")
    for r in results:
        print(f"{r['mode']:>14} {r['itl_quiet_p50']:9.1f} {r['itl_quiet_p99']:7.1f} "
              f"{r['itl_busy_p50']:12.1f} {r['itl_busy_p99']:7.1f} {r['p99_ratio']:9.2f} "
              f"{r['ttft_long_p50']:9.0f} "
              + (f"{r['kv_tail_p50']:7.2f}" if "kv_tail_p50" in r else f"{'-':>7}"))
    d = results[0]
    print(f"one layer of a long prompt ({layer_bytes} bytes), receiver counting it: "
          f"{layer_ms['paged']:.3f} ms as pages, {layer_ms['contiguous']:.3f} ms as one write; "
          f"KV tail / layer = {d['kv_tail_p50'] / layer_ms['paged']:.2f} (target <= 1); "
          f"disaggregated p99 ratio {d['p99_ratio']:.2f} (target <= 1.2); colocated "
          f"{results[1]['p99_ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "layer_ms": layer_ms, "layer_bytes": layer_bytes,
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
