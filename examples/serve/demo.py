"""`make demo`: the small MoE model served disaggregated on this host -- a prefill instance of
TP 2, a decode instance of EP 2 (attention data-parallel), the router -- over libfabric's shm.
Eight prompts of different lengths (one longer than a prefill chunk, one shorter than a page)
arrive in two waves, the second while the first decodes; each answer is checked against the
same model run colocated in one process with plain torch.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model as mdl  # noqa: E402
from deploy import Deployment  # noqa: E402

LENGTHS = [120, 7, 33, 64, 2, 95, 16, 41]   # prompt tokens: chunks are 32, pages 16
NEW_TOKENS = 16


def prompt(i, n, vocab):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(vocab, (n,), generator=g).tolist()


def fmt(v):
    return "-" if v is None else f"{v:7.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "ferry-serve-model.safetensors"))
    p.add_argument("--provider", default=os.environ.get("FERRY_PROVIDER", "shm"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the instances' model on the GPU, the MoE on ferry's CUDA device, "
                        "the decode step a CUDA graph (one decode rank per GPU)")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    config, weights = mdl.load_or_make(args.model)
    print(f"model: {config.layers} layers, hidden {config.hidden}, {config.q_heads}/"
          f"{config.kv_heads} heads, {config.experts} experts top-{config.top_k} + 1 shared, "
          f"vocab {config.vocab} ({args.model})", flush=True)
    prompts = [prompt(i, n, config.vocab) for i, n in enumerate(LENGTHS)]
    requests = [{"id": i, "prompt": p, "max_new_tokens": NEW_TOKENS} for i, p in enumerate(prompts)]
    ep = 2
    if args.device == "cuda":
        import subprocess  # counted in a child: ranks fork from this process
        ep = min(2, int(subprocess.run([sys.executable, "-c", "import torch; print("
                                        "torch.cuda.device_count())"], capture_output=True,
                                       text=True).stdout or 0))
        if ep == 0:
            sys.exit("--device cuda: no GPU here")
    print(f"starting: prefill TP 2, decode EP {ep}, router (provider {args.provider}, "
          f"{args.device})", flush=True)
    with Deployment(args.model, prefills=[{"tp": 2}], decodes=[{"ep": ep}],
                    prefill_args=["--chunk", "32"], provider=args.provider, device=args.device,
                    decode_args=["--cuda-graph"] if args.device == "cuda" else []) as d:
        print(f"up in {time.monotonic() - t0:.1f} s; router at {d.router_address}", flush=True)
        answers = {}
        with d.client() as c:
            def send(wave):
                for r in wave:
                    c.send(r)
                    print(f"  sent prompt {r['id']} ({len(r['prompt'])} tokens)", flush=True)

            def receive(until):
                while len(answers) < until:
                    a = c.recv(timeout=120)
                    answers[a["id"]] = a
                    print(f"  answer {a['id']}: " + (
                        "error " + a["error"] if "error" in a
                        else f"{len(a['tokens'])} tokens, TTFT {a['ttft_ms']:.0f} ms"),
                        flush=True)

            send(requests[:4])
            receive(1)  # the rest of the first wave is decoding when the second comes
            send(requests[4:])
            receive(len(requests))
    print("checking against the colocated model (one process, plain torch) ...", flush=True)
    reference = mdl.Model(config, weights)
    equal = 0
    print()
    print(f"{'id':>2} {'prompt':>6}  {'TTFT':>7} = {'queue':>7} + {'prefill':>7} + "
          f"{'KV tail':>7} + first  {'ms/tok':>7} {'KV bytes':>9}  equal  tokens")
    for r in requests:
        a = answers[r["id"]]
        if "error" in a:
            print(f"{r['id']:>2} {len(r['prompt']):>6}  error: {a['error']}")
            continue
        want, _ = mdl.generate(reference, r["prompt"], NEW_TOKENS)
        same = a["tokens"] == want
        equal += same
        parts = [a.get("queue_ms"), a.get("prefill_ms"), a.get("kv_tail_ms")]
        rest = a["ttft_ms"] - sum(x for x in parts if x is not None)
        print(f"{r['id']:>2} {len(r['prompt']):>6}  {fmt(a['ttft_ms'])} = {fmt(parts[0])} + "
              f"{fmt(parts[1])} + {fmt(parts[2])} + {rest:5.1f}  {fmt(a['decode_ms_per_token'])} "
              f"{a['kv_bytes']:>9}  {'yes' if same else 'NO ':>5}  {a['tokens'][:8]}...")
    print()
    print("TTFT = queue (router to the prefill's first pass) + prefill compute (first pass to "
          "its last layer)\n       + KV tail (last layer to the decoder's pages complete) + "
          "the first decode step; times in ms")
    print(f"tokens equal: {equal}/{len(requests)}   "
          f"KV bytes moved: {sum(a.get('kv_bytes', 0) for a in answers.values())}   "
          f"in {time.monotonic() - t0:.1f} s")
    print("(the fabric / moe / kv benchmark demo: build/ferry-bench demo)")
    sys.exit(0 if equal == len(requests) else 1)


if __name__ == "__main__":
    main()
