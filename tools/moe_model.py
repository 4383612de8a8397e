#!/usr/bin/env python3
"""What ferry's MoE protocol costs at EP16-64 on EFA and ConnectX-7: a cost model.

Decode dispatch and combine (128 tokens per rank, hidden 7168, 256 experts, top-8, fp8 block-
scaled dispatch, bf16 combine; nodes of 8 GPUs). One step of one rank costs

    t = G + S + max(P + W, V)

    G  the GPU's own work in the step's kernels (packing, unpacking, sums)
    S  the GPU <-> proxy signalling: the kernel's flag to the proxy and the arrival flag back
       (0 where the GPU posts its own work requests, IBGDA)
    P  posting: the step's work requests one after another on the poster, n_wr * p
    W  the wire: phases * L + max over the rank's NICs of (bytes_k / B_eff(m) + n_k / R)
         phases the network round trips one after another in the step: 1 for ferry's steps
                (a peer's whole section is one write) and every combine; 2 for pplx-garden's
                dispatch, whose overflow writes wait for every peer's routing to arrive
         L      one write's latency, NIC to NIC, completion included
         B_eff  the NIC's bandwidth at the step's message size m: B * m / (m + m_half)
         R      the NIC's message rate
    V  NVLink, for peers of the rank's node: bytes_nv / B_nv (its latency is inside G, which
       was measured over NVLink)

and a step's time is that of its slowest rank. Dispatch + combine is the sum of the two steps.

What each system posts (the counts) comes from two places. ferry's are counted: `ferry-bench
scale` runs the protocol on host-device ranks at EP8-64 and reports the writes, bytes and
immediates each rank posts per step to peers of its own node and of others, per NIC, at two
hidden sizes; bytes are affine in the row size (rows x row bytes + headers), so the two sizes
give every rank's bytes at hidden 7168 exactly (`extrapolate`). The baselines' are their
published message patterns under uniform routing (`published_pattern`).

The machine's inputs are in INPUTS, each with its source: measured here (the command), taken
from the specification, or fitted. The fitted ones (a NIC's latency, half-bandwidth message
size and message rate, and the posting cost of the systems whose code we did not measure) are
fitted to the published figures in CALIBRATION by least squares on the log of the times; the
report shows each row's error.

Usage:
  moe_model.py COUNTS.json... [--json OUT] [--plot OUT.png]
      COUNTS: `ferry-bench scale --ranks N --hidden H` outputs, each EP at two hidden sizes.
"""
import argparse
import json
import math
import sys

# The decode shape of the documents' tables.
TOKENS, HIDDEN, EXPERTS, TOPK, NODE = 128, 7168, 256, 8, 8
FP8_ROW = HIDDEN + HIDDEN // 128 * 4  # e4m3 row and its fp32 scales, bytes
BF16_ROW = HIDDEN * 2
PER_TOKEN_HEADER = 16  # bytes a per-token message carries besides its row (index, expert)

# name: (value, unit, source). Fitted values start from the value given here.
INPUTS = {
    "G_dispatch": (15.1, "us", "measured: ferry's token-major decode dispatch on 2 x H200 "
                   "over NVLink, 19.6 us p50 less the 4.5 us an empty step costs between the "
                   "same events (docs/PERFORMANCE.md, 2026-11-30)"),
    "G_combine": (12.7, "us", "measured: the same run's combine, 17.2 - 4.5 us"),
    "S": (3.9, "us", "measured: a kernel polling a mirrored immediate and answering through "
          "host memory, round trip p50 on shm (ferry-bench mirror, 2026-12-02): one flag each "
          "way, what a step pays between its kernels and the proxy"),
    "p_engine": (0.49, "us", "measured: ferry's engine's own cost per work request over the "
                 "provider's, 1 KiB writes on shm: 1/0.505 - 1/0.673 Mops/s (ferry-bench fabric "
                 "--quick, docs/PERFORMANCE.md, 2026-11-30)"),
    "B_nv": (390.0, "GB/s", "measured: GPU0 -> GPU1 copy on 2 x H200 (ferry-bench moe "
             "--nvlink, 2026-11-30)"),
    "B_efa": (25.0, "GB/s per NIC", "specification: p5en, 2 x 200 Gbit/s EFA per GPU"),
    "B_cx7": (50.0, "GB/s per NIC", "specification: 1 x 400 Gbit/s ConnectX-7 per GPU"),
    "L_efa": (15.0, "us", "fitted"),
    "m_half_efa": (64.0, "KiB", "fitted"),
    "R_efa": (1e3, "M messages/s per NIC", "not fitted: no published figure; taken as no limit "
              "(UCCL-EP's per-message cost is in p_generic)"),
    "p_provider_efa": (0.0, "us", "not fitted: libfabric's efa provider's own cost per work "
                       "request, on top of p_engine (unknown; a step posts at most 2 per peer, "
                       "and the fit's L_efa absorbs what it adds)"),
    "p_generic": (1.0, "us", "fitted: UCCL-EP's generic proxy's cost per work request"),
    "L_cx7": (3.0, "us", "fitted"),
    "m_half_cx7": (16.0, "KiB", "fitted"),
    "R_cx7": (20.0, "M messages/s per NIC", "fitted"),
    "p_gpu": (0.05, "us", "fitted: DeepEP's per-work-request cost posted from the GPU (IBGDA), "
              "its warps' posts one after another"),
    "hop": (5.0, "us per step", "assumed: node-once forwarding's node hop (its kernels' send and "
            "receive inside the node, beyond its NVLink bytes, which V counts); to be replaced by "
            "the phase stamps of `tools/gpu_check.sh hybrid`"),
}
# Fitted inputs per NIC, each within bounds that keep it physical (a fit outside them is
# penalised, not taken).
# Each system's calibration rows fit the inputs listed for it, in this order (EFA's first:
# ConnectX-7's half-bandwidth size follows from it), each within bounds that keep it physical
# (a fit outside them is penalised, not taken). pplx-garden's protocol is the documents' and
# ferry's own shape, so its rows set EFA's wire; DeepEP's set ConnectX-7's; UCCL-EP's set
# only its own proxy's cost, its message pattern being the least certain.
FITTED = {"pplx-garden": {"L_efa": (2, 200), "m_half_efa": (1, 4096)},
          "DeepEP": {"L_cx7": (1, 50), "m_half_cx7": (1, 4096), "R_cx7": (1, 200),
                     "p_gpu": (0.001, 1)},
          "UCCL-EP": {"p_generic": (0.01, 10)}}

# Published decode figures, us. Each row: system, NIC, EP, dispatch, combine (None: only the
# sum is published), source. Rows whose source says "not fitted" are shown with their error but
# fit nothing: they check the fit out of sample (the same systems measured elsewhere, or
# systems whose message pattern here is an assumption).
PPLX_TABLE = "perplexityai/pplx-garden docs/fabric-lib.md"
AWS_RUN = "AWS's matched run, Aug 2026, p6-b200, 400 Gbit/s of EFA per GPU; not fitted"
CALIBRATION = [
    ("pplx-garden", "efa", 16, 214.8, 241.5, None, PPLX_TABLE + ", H200 on p5en"),
    ("pplx-garden", "efa", 32, 229.1, 335.0, None, PPLX_TABLE),
    ("pplx-garden", "efa", 64, 266.7, 391.2, None, PPLX_TABLE),
    ("pplx-garden", "efa", 16, None, None, 459, "the documents (seed 000), p5en; not fitted"),
    ("pplx-garden", "efa", 32, None, None, 582, "the documents; not fitted"),
    ("pplx-garden", "efa", 64, None, None, 692, "the documents; not fitted"),
    ("pplx-garden", "cx7", 16, 110.2, 185.5, None, PPLX_TABLE + ", CX7; not fitted"),
    ("pplx-garden", "cx7", 32, 153.9, 266.3, None, PPLX_TABLE + ", CX7; not fitted"),
    ("pplx-garden", "cx7", 64, 187.5, 309.1, None, PPLX_TABLE + ", CX7; not fitted"),
    ("UCCL-EP", "efa", 16, 226, 293, None, "uccl-project/uccl ep/README.md, p5en"),
    ("UCCL-EP", "efa", 24, 386, 580, None, "the same"),
    ("UCCL-EP", "efa", 32, 465, 694, None, "the same"),
    ("UCCL-EP", "efa", 16, None, None, 476, AWS_RUN),
    ("UCCL-EP", "efa", 32, None, None, 694, AWS_RUN),
    # Not fitted: at EP8 DeepEP's table reports 98 and 127 GB/s, past one CX7's 50 GB/s, so
    # not all of it crossed the NIC, and what took another path is not published.
    ("DeepEP", "cx7", 8, 77, 114, None, "deepseek-ai/DeepEP README.md, H800 + CX7; not fitted"),
    ("DeepEP", "cx7", 16, 118, 195, None, "deepseek-ai/DeepEP README.md, H800 + CX7"),
    ("DeepEP", "cx7", 32, 155, 273, None, "the same"),
    ("DeepEP", "cx7", 64, 173, 314, None, "the same"),
    ("DeepEP", "cx7", 16, 123.9, 203.0, None, PPLX_TABLE + ", DeepEP-CX7; not fitted"),
    ("DeepEP", "cx7", 32, 159.1, 285.0, None, PPLX_TABLE + ", DeepEP-CX7; not fitted"),
    ("DeepEP", "cx7", 64, 177.9, 325.0, None, PPLX_TABLE + ", DeepEP-CX7; not fitted"),
    ("DeepEP V1", "efa", 16, None, None, 882, AWS_RUN),
    ("DeepEP V1", "efa", 32, None, None, 1404, AWS_RUN),
    ("DeepEP V2", "efa", 16, None, None, 385, AWS_RUN),
    ("DeepEP V2", "efa", 32, None, None, 647, AWS_RUN),
]
# Each peer's published decode figure per EP (dispatch + combine, us), per NIC: what ferry's
# predictions are held against (GOAL x the best of them at each EP).
PEERS_CX7 = {
    "DeepEP": {16: 118 + 195, 32: 155 + 273, 64: 173 + 314},
    "pplx-garden": {16: 110.2 + 185.5, 32: 153.9 + 266.3, 64: 187.5 + 309.1},
    "DeepEP (pplx's run)": {16: 123.9 + 203.0, 32: 159.1 + 285.0, 64: 177.9 + 325.0},
}
PEERS_EFA = {
    "pplx-garden": {16: 214.8 + 241.5, 32: 229.1 + 335.0, 64: 266.7 + 391.2},
    "DeepEP V2": {16: 385, 32: 647},
    "UCCL-EP": {16: 476, 32: 694},
    "DeepEP V1": {16: 882, 32: 1404},
}
GOAL = 0.8  # ferry's predicted EFA decode against the best published figure at each EP


# ---- counts ------------------------------------------------------------------------------------

def round_up(x, to):
    return (x + to - 1) // to * to


def row_bytes(step, hidden, dtype="fp8"):
    """What one more row costs on ferry's wire (src/moe/wire.h): a dispatch slot is its
    metadata (a 16-byte header and 16 bytes per top-k entry) rounded up to a 128-byte line,
    then the row and its fp32 scales, the whole rounded up to a line; a combine row is bf16."""
    if step == "combine":
        return hidden * 2
    meta = round_up(16 + 16 * TOPK, 128)
    row = hidden * (1 if dtype == "fp8" else 2) + (hidden // 128 * 4 if dtype == "fp8" else 0)
    return round_up(meta + row, 128)


def extrapolate(runs, target_hidden=HIDDEN):
    """ferry's counts at target_hidden from `ferry-bench scale` runs of one EP at two hidden
    sizes.

    Returns {variant: [rank: {step: [nic: {...}]}]}: writes and immediates as counted (they do not
    depend on the hidden size; checked), bytes as a + rows * row_bytes(target_hidden), with rows
    and a solved from the two runs (rows must come out whole; checked)."""
    if len(runs) != 2:
        raise ValueError("need one EP's runs at exactly two hidden sizes")
    lo, hi = sorted(runs, key=lambda r: r["hidden"])
    if lo["hidden"] == hi["hidden"] or lo["ep"] != hi["ep"]:
        raise ValueError("the two runs must share the EP and differ in hidden size")
    out = {}
    for vl, vh in zip(lo["variants"], hi["variants"]):
        if not (vl["checked"] and vh["checked"]):
            raise ValueError(f"{vl['variant']}: a run's outputs were not checked clean")
        ranks = []
        for rl, rh in zip(vl["ranks"], vh["ranks"]):
            steps = {}
            for step in ("dispatch", "combine"):
                rl_b = row_bytes(step, lo["hidden"], lo["dtype"])
                rh_b = row_bytes(step, hi["hidden"], hi["dtype"])
                r7 = row_bytes(step, target_hidden, lo["dtype"])
                nics = []
                for nl, nh in zip(rl[step], rh[step]):
                    n = {}
                    for key in ("writes", "imms"):
                        for side in ("inter", "intra"):
                            k = f"{side}_{key}"
                            if nl[k] != nh[k]:
                                raise ValueError(f"{k} differs between hidden sizes")
                            n[k] = nl[k]
                    for side in ("inter", "intra"):
                        k = f"{side}_bytes"
                        rows = (nh[k] - nl[k]) / (rh_b - rl_b)
                        if abs(rows - round(rows)) > 1e-9:
                            raise ValueError(f"{k}: {rows} rows is not whole")
                        header = nl[k] - round(rows) * rl_b
                        n[k] = header + round(rows) * r7
                        n[f"{side}_rows"] = round(rows)
                    n["inter_peers"] = nl["inter_peers"]
                    nics.append(n)
                steps[step] = nics
            ranks.append(steps)
        out[vl["variant"]] = ranks
    return out


def published_pattern(system, ep, step, nic="efa"):
    """One rank's step under uniform routing, as the baseline posts it: a dict per NIC, as
    extrapolate's (intra_bytes: what crosses NVLink, 0 where the system sends it all through
    the NIC). EFA: 2 NICs per GPU (p5en's 2 x 200 Gbit/s; p6-b200's 400 Gbit/s per GPU taken
    alike); ConnectX-7: one."""
    nics = 2 if nic == "efa" else 1
    copies = TOKENS * TOPK
    row = FP8_ROW if step == "dispatch" else BF16_ROW
    remote = ep - min(ep, NODE)
    if system == "pplx-garden":  # one section per peer, NVLink inside the node
        rows = copies * remote / ep
        # dispatch: the counts with the first tokens, then the rest (two writes per peer);
        # combine: one write per peer
        writes = remote * (2 if step == "dispatch" else 1)
        intra_rows = copies * (min(ep, NODE) - 1) / ep
        per_nic = dict(inter_writes=writes / nics, inter_bytes=rows * row / nics,
                       inter_peers=remote / nics, inter_imms=remote / nics,
                       intra_bytes=intra_rows * row / nics,
                       phases=2 if step == "dispatch" else 1)
    elif system.startswith("DeepEP"):  # a message per token copy to each rank of another
        # node; NVLink inside the node (its low-latency kernels since 2025-06: the table's
        # 63 GB/s at EP16 is more than one CX7 carries, so its peers of the node did not all
        # cross the NIC). V2's pattern over NCCL GIN is taken as V1's (an assumption: its
        # hybrid mode's forwarding is not published in a form the model can take).
        rows = copies * remote / ep
        intra_rows = copies * (min(ep, NODE) - 1) / ep
        per_nic = dict(inter_writes=rows / nics, inter_bytes=rows * (row + PER_TOKEN_HEADER) / nics,
                       inter_peers=remote / nics, inter_imms=rows / nics,
                       intra_bytes=intra_rows * row / nics)
    else:  # UCCL-EP: a message per token copy, to every other rank, through its proxy
        rows = copies * (ep - 1) / ep
        per_nic = dict(inter_writes=rows / nics, inter_bytes=rows * (row + PER_TOKEN_HEADER) / nics,
                       inter_peers=(ep - 1) / nics, inter_imms=rows / nics, intra_bytes=0)
    return [dict(per_nic) for _ in range(nics)]


# ---- the step model ----------------------------------------------------------------------------

def value(params, name):
    return params[name][0] if isinstance(params[name], tuple) else params[name]


def step_terms(params, system, nic, step, nics):
    """The terms of one rank's step (us), from its per-NIC counts."""
    v = lambda n: value(params, n)
    g = v("G_dispatch") if step == "dispatch" else v("G_combine")
    if system in ("DeepEP", "DeepEP V2"):  # posted from the GPU (IBGDA; GIN's GPU-initiated
        s, p = 0.0, v("p_gpu")                # path on EFA taken alike, an assumption)
    elif system in ("UCCL-EP", "DeepEP V1"):  # a generic CPU proxy (V1 on EFA has no IBGDA:
        s, p = v("S"), v("p_generic")          # NVSHMEM's libfabric proxy)
    else:  # ferry and pplx-garden: a specialised proxy on libfabric's efa or on verbs
        s = v("S")
        p = v("p_engine") + (v("p_provider_efa") if nic == "efa" else 0.0)
    if nic == "efa":
        lat, bw, rate, half = v("L_efa"), v("B_efa"), v("R_efa"), v("m_half_efa") * 1024
    else:
        lat, bw, rate, half = v("L_cx7"), v("B_cx7"), v("R_cx7"), v("m_half_cx7") * 1024
    wr = sum(n["inter_writes"] for n in nics)
    post = wr * p
    wire = 0.0
    for n in nics:
        if n["inter_writes"] == 0:
            continue
        m = n["inter_bytes"] / n["inter_writes"]  # the step's message size on this NIC
        eff = bw * 1e3 * m / (m + half)  # bytes per us
        wire = max(wire, n["inter_bytes"] / eff + n["inter_writes"] / rate)
    if wr:
        wire += lat * max(n.get("phases", 1) for n in nics)
    nv = sum(n["intra_bytes"] for n in nics) / (v("B_nv") * 1e3)
    total = g + s + max(post + wire, nv)
    return dict(G=g, S=s, P=post, W=wire, V=nv, total=total)


def system_step(params, system, nic, ep, step):
    return step_terms(params, system, nic, step, published_pattern(system, ep, step, nic))


def ferry_step(params, nic, ranks, step, node_once=False):
    """ferry's step: the slowest rank's terms. Node-once adds its node hop's own time (its NVLink
    bytes are counted in V)."""
    worst = None
    for r in ranks:
        t = step_terms(params, "ferry", nic, step, r[step])
        if node_once:
            t = dict(t, hop=value(params, "hop"), total=t["total"] + value(params, "hop"))
        if worst is None or t["total"] > worst["total"]:
            worst = t
    return worst


# ---- fitting -----------------------------------------------------------------------------------

def calibration_rows(params):
    rows = []
    for system, nic, ep, d, c, total, source in CALIBRATION:
        md = system_step(params, system, nic, ep, "dispatch")["total"]
        mc = system_step(params, system, nic, ep, "combine")["total"]
        if total is not None:
            rows.append((system, nic, ep, "dispatch + combine", total, md + mc, source))
        else:
            rows.append((system, nic, ep, "dispatch", d, md, source))
            rows.append((system, nic, ep, "combine", c, mc, source))
    return rows


def nelder_mead(f, x0, steps, iters=4000):
    """Minimises f over R^n from x0 (plain Nelder-Mead; the model is small and smooth)."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (steps[j] if j == i else 0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centroid = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        worst = pts[-1]
        refl = [centroid[j] + (centroid[j] - worst[j]) for j in range(n)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [centroid[j] + 2 * (centroid[j] - worst[j]) for j in range(n)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [centroid[j] + 0.5 * (worst[j] - centroid[j]) for j in range(n)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                for i in range(1, n + 1):
                    pts[i] = [pts[0][j] + 0.5 * (pts[i][j] - pts[0][j]) for j in range(n)]
                    vals[i] = f(pts[i])
        if max(vals) - min(vals) < 1e-12:
            break
    best = min(range(n + 1), key=lambda i: vals[i])
    return pts[best], vals[best]


def fit(params):
    """Fits each system's FITTED inputs to its calibration rows (least squares on the log of the
    times, in log parameters, each held within its bounds); returns the fitted set."""
    params = {k: value(params, k) for k in params}
    for fitted_system, bounds in FITTED.items():
        names = list(bounds)

        def loss(x):
            trial = dict(params)
            penalty = 0.0
            for name, lx in zip(names, x):
                lo, hi = bounds[name]
                clamped = min(max(lx, math.log(lo)), math.log(hi))
                penalty += (lx - clamped) ** 2
                trial[name] = math.exp(clamped)
            err = 0.0
            for system, row_nic, ep, step, pub, mod, source in calibration_rows(trial):
                if system == fitted_system and "not fitted" not in source:
                    err += math.log(mod / pub) ** 2
            return err + 10 * penalty
        x0 = [math.log(params[n]) for n in names]
        best, _ = nelder_mead(loss, x0, [0.5] * len(names))
        for name, lx in zip(names, best):
            lo, hi = bounds[name]
            params[name] = min(max(math.exp(lx), lo), hi)
    return params


# ---- report ------------------------------------------------------------------------------------

def load(paths):
    """ferry's counts per EP at hidden 7168, from each EP's smallest and largest hidden size; a
    run at a size between them must be what those two predict (ValueError otherwise)."""
    by_ep = {}
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        by_ep.setdefault(run["ep"], []).append(run)
    out = {}
    for ep, runs in sorted(by_ep.items()):
        runs.sort(key=lambda r: r["hidden"])
        for mid in runs[1:-1]:
            want = extrapolate([runs[0], runs[-1]], target_hidden=mid["hidden"])
            for v in mid["variants"]:
                for r, rank in enumerate(v["ranks"]):
                    for step in ("dispatch", "combine"):
                        for k, nic in enumerate(rank[step]):
                            got = want[v["variant"]][r][step][k]
                            if any(got[f"{s}_bytes"] != nic[f"{s}_bytes"] for s in ("inter", "intra")):
                                raise ValueError(f"EP{ep} hidden {mid['hidden']}: the bytes are not "
                                                 "those the other sizes predict")
        out[ep] = extrapolate([runs[0], runs[-1]])
    return out


def report(params, counts, out=sys.stdout):
    w = out.write
    result = {"inputs": {}, "calibration": [], "predictions": []}
    w("## Inputs\n\n| input | value | unit | source |\n| --- | --- | --- | --- |\n")
    for name, (v0, unit, source) in INPUTS.items():
        v = params[name]
        w(f"| {name} | {v:.3g} | {unit} | {source} |\n")
        result["inputs"][name] = v
    w("\n## Calibration: published against modelled\n\n"
      "| system | NIC | EP | step | published us | modelled us | error |\n"
      "| --- | --- | --- | --- | --- | --- | --- |\n")
    for system, nic, ep, step, pub, mod, source in calibration_rows(params):
        w(f"| {system} | {nic} | {ep} | {step} | {pub} | {mod:.0f} | {100 * (mod / pub - 1):+.0f} % |\n")
        result["calibration"].append(dict(system=system, nic=nic, ep=ep, step=step,
                                          published=pub, modelled=mod, source=source))
    peers = {"efa": PEERS_EFA, "cx7": PEERS_CX7}
    best = {(nic, ep): min(v[ep] for v in peers[nic].values() if ep in v)
            for nic in peers for ep in (16, 32, 64)}
    w("\n## ferry, predicted (slowest rank; terms of dispatch / combine, us)\n\n"
      "Node-once variants add the node hop's own time (`hop`) to each step.\n\n"
      "| NIC | EP | variant | dispatch | combine | total | best published | ratio | "
      "G | S | P | W | V |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
      "| --- | --- |\n")
    for nic in ("efa", "cx7"):
        for ep, variants in counts.items():
            for variant, ranks in variants.items():
                if nic == "cx7":  # one NIC per GPU: fold the two NICs' counts into one
                    ranks = [{s: [fold(r[s])] for s in r} for r in ranks]
                once = variant.startswith("node-once")
                d = ferry_step(params, nic, ranks, "dispatch", once)
                c = ferry_step(params, nic, ranks, "combine", once)
                total = d["total"] + c["total"]
                ref = best.get((nic, ep))
                ratio = f"{total / ref:.2f}" if ref else "-"
                terms = " | ".join(f"{d[k]:.0f} / {c[k]:.0f}" for k in ("G", "S", "P", "W", "V"))
                w(f"| {nic} | {ep} | {variant} | {d['total']:.0f} | {c['total']:.0f} | "
                  f"{total:.0f} | {f'{ref:.0f}' if ref else '-'} | {ratio} | {terms} |\n")
                result["predictions"].append(dict(nic=nic, ep=ep, variant=variant,
                                                  dispatch=d, combine=c, total=total,
                                                  best_published=ref))
    # ferry's (a)+(b) per rank and node-once against each peer's published figure.
    result["peers"] = []
    for nic in ("efa", "cx7"):
        w(f"\n## Against each peer on {nic.upper()} (dispatch + combine, us; goal: {GOAL} x the "
          "best)\n\n| EP | ferry variant | ferry | " + " | ".join(peers[nic]) +
          " | goal | met |\n| --- | --- | --- | " + "--- | " * len(peers[nic]) + "--- | --- |\n")
        for p in result["predictions"]:
            if p["nic"] != nic or p["variant"] not in ("(a)+(b)", "node-once (a)+(b)") or \
                    p["ep"] not in (16, 32, 64):
                continue
            cells = []
            for peer, figures in peers[nic].items():
                f = figures.get(p["ep"])
                cells.append(f"{f:.0f} ({p['total'] / f:.2f})" if f else "-")
            goal = GOAL * best[(nic, p["ep"])]
            w(f"| {p['ep']} | {p['variant']} | {p['total']:.0f} | " + " | ".join(cells) +
              f" | {goal:.0f} | {'yes' if p['total'] <= goal else 'no'} |\n")
            result["peers"].append(dict(nic=nic, ep=p["ep"], variant=p["variant"],
                                        total=p["total"], goal=goal, met=p["total"] <= goal))
    # The baselines as modelled at the same sizes, for the plot.
    result["baselines"] = []
    for system, nic in (("pplx-garden", "efa"), ("UCCL-EP", "efa"), ("DeepEP", "cx7"),
                        ("DeepEP V2", "efa")):
        for ep in (16, 24, 32, 64):
            t = sum(system_step(params, system, nic, ep, s)["total"]
                    for s in ("dispatch", "combine"))
            result["baselines"].append(dict(system=system, nic=nic, ep=ep, total=t))
    return result


def fold(nics):
    """Two NICs' counts as one NIC's."""
    out = {}
    for n in nics:
        for k, v in n.items():
            out[k] = out.get(k, 0) + v if k != "max_peer_bytes" else max(out.get(k, 0), v)
    return out


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"pplx-garden": "s", "UCCL-EP": "^", "DeepEP V2": "P", "DeepEP V1": "x"}
    for system, nic, style in (("pplx-garden", "efa", "s--"), ("UCCL-EP", "efa", "^--"),
                               ("DeepEP V2", "efa", "P--"), ("DeepEP", "cx7", "v--")):
        pts = [(b["ep"], b["total"]) for b in result["baselines"]
               if b["system"] == system and b["nic"] == nic]
        ax.plot(*zip(*pts), style, label=f"{system} on {nic.upper()}, modelled", alpha=0.5)
    for system, figures in PEERS_EFA.items():
        pts = sorted(figures.items())
        ax.plot(*zip(*pts), markers[system], color="black", markerfacecolor="none",
                label=f"{system} on EFA, published")
    for nic, variant, style in (("efa", "(a)+(b)", "o-"), ("efa", "node-once (a)+(b)", "o-"),
                                ("cx7", "(a)+(b)", "D-"), ("cx7", "node-once (a)+(b)", "D-")):
        pts = [(p["ep"], p["total"]) for p in result["predictions"]
               if p["nic"] == nic and p["variant"] == variant]
        if pts:
            ax.plot(*zip(*pts), style, label=f"ferry {variant} on {nic.upper()}, predicted")
    goal = sorted((p["ep"], p["goal"]) for p in result["peers"]
                  if p["nic"] == "efa" and p["variant"] == "(a)+(b)")
    if goal:
        ax.plot(*zip(*goal), ":", color="gray", label=f"goal: {GOAL} x the best published (EFA)")
    ax.set_xlabel("EP (GPUs; nodes of 8)")
    ax.set_ylabel("decode dispatch + combine, us")
    ax.set_xscale("log", base=2)
    ax.set_xticks([8, 16, 24, 32, 64])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title("black: published; lines: modelled (128 tokens, hidden 7168, top-8)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("counts", nargs="+", help="ferry-bench scale outputs (JSON)")
    ap.add_argument("--json", help="write the report's figures here")
    ap.add_argument("--plot", help="write a PNG of time against EP here (needs matplotlib)")
    args = ap.parse_args(argv)
    counts = load(args.counts)
    params = fit(INPUTS)
    result = report(params, counts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
