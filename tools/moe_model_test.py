#!/usr/bin/env python3
"""Tests of tools/moe_model.py.

The counts' extrapolation is checked on real `ferry-bench scale` output: from the runs at two
hidden sizes it must predict a third run's bytes exactly. The runs are taken from
FERRY_SCALE_RUNS (a directory of epN_hH.json files; ctest's moe_scale_model makes fresh EP8
ones) or else the recorded ones in docs/bench/scale_2026-12-04.
"""
import copy
import glob
import json
import math
import os
import re
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe_model  # noqa: E402

RUNS = os.environ.get("FERRY_SCALE_RUNS") or os.path.join(HERE, "..", "docs", "bench",
                                                          "scale_2026-12-04")


def runs_by_ep():
    out = {}
    for path in glob.glob(os.path.join(RUNS, "ep*_h*.json")):
        m = re.search(r"ep(\d+)_h(\d+)\.json$", path)
        with open(path) as f:
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = json.load(f)
    return out


class ExtrapolateTest(unittest.TestCase):
    def test_two_hidden_sizes_predict_a_third_exactly(self):
        checked = 0
        for ep, runs in runs_by_ep().items():
            if len(runs) < 3:
                continue
            h = sorted(runs)
            lo, mid, hi = runs[h[0]], runs[h[1]], runs[h[2]]
            predicted = moe_model.extrapolate([lo, hi], target_hidden=mid["hidden"])
            for variant in mid["variants"]:
                ranks = predicted[variant["variant"]]
                for r, rank in enumerate(variant["ranks"]):
                    for step in ("dispatch", "combine"):
                        for k, nic in enumerate(rank[step]):
                            for side in ("inter", "intra"):
                                self.assertEqual(ranks[r][step][k][f"{side}_bytes"],
                                                 nic[f"{side}_bytes"],
                                                 f"EP{ep} {variant['variant']} rank {r}")
                                checked += 1
        self.assertGreater(checked, 0, f"no EP with three hidden sizes in {RUNS}")

    def test_every_run_was_checked_and_rows_are_whole(self):
        runs = runs_by_ep()
        self.assertTrue(runs, f"no runs in {RUNS}")
        for ep, by_hidden in runs.items():
            h = sorted(by_hidden)
            counts = moe_model.extrapolate([by_hidden[h[0]], by_hidden[h[-1]]])
            node = by_hidden[h[0]]["ranks_per_node"]
            for variant, ranks in counts.items():
                self.assertEqual(len(ranks), ep)
                for rank in ranks:
                    # one write per peer of another node, each with its immediate
                    writes = sum(n["inter_writes"] for n in rank["dispatch"])
                    imms = sum(n["inter_imms"] for n in rank["dispatch"])
                    self.assertEqual(writes, imms)
                    self.assertLessEqual(writes, ep - node)
                    if ep > node:
                        self.assertGreater(writes, 0)

    def test_inconsistent_runs_are_refused(self):
        runs = runs_by_ep()
        ep = min(runs)
        h = sorted(runs[ep])
        lo, hi = runs[ep][h[0]], copy.deepcopy(runs[ep][h[-1]])
        hi["variants"][0]["ranks"][0]["dispatch"][0]["inter_bytes"] += 1
        with self.assertRaisesRegex(ValueError, "not whole"):
            moe_model.extrapolate([lo, hi])
        hi = copy.deepcopy(runs[ep][h[-1]])
        hi["variants"][0]["ranks"][0]["dispatch"][0]["inter_writes"] += 1
        with self.assertRaisesRegex(ValueError, "differs"):
            moe_model.extrapolate([lo, hi])
        hi = copy.deepcopy(runs[ep][h[-1]])
        hi["variants"][0]["checked"] = False
        with self.assertRaisesRegex(ValueError, "checked"):
            moe_model.extrapolate([lo, hi])


class StepModelTest(unittest.TestCase):
    def params(self):
        return {k: v[0] for k, v in moe_model.INPUTS.items()}

    def test_terms_follow_their_equations(self):
        p = self.params()
        nic = dict(inter_writes=4, inter_bytes=4 << 20, inter_imms=4, inter_peers=4,
                   intra_bytes=1 << 20)
        t = moe_model.step_terms(p, "ferry", "efa", "dispatch", [nic, dict(nic)])
        self.assertAlmostEqual(t["P"], 8 * (p["p_engine"] + p["p_provider_efa"]))
        m = (4 << 20) / 4
        eff = p["B_efa"] * 1e3 * m / (m + p["m_half_efa"] * 1024)
        self.assertAlmostEqual(t["W"], p["L_efa"] + (4 << 20) / eff + 4 / p["R_efa"])
        self.assertAlmostEqual(t["V"], 2 * (1 << 20) / (p["B_nv"] * 1e3))
        self.assertAlmostEqual(t["total"], p["G_dispatch"] + p["S"] +
                               max(t["P"] + t["W"], t["V"]))
        # IBGDA pays no proxy signal; more bytes never cost less
        self.assertEqual(moe_model.system_step(p, "DeepEP", "cx7", 16, "dispatch")["S"], 0)
        big = dict(nic, inter_bytes=8 << 20)
        self.assertGreater(moe_model.step_terms(p, "ferry", "efa", "dispatch", [big])["W"],
                           moe_model.step_terms(p, "ferry", "efa", "dispatch", [nic])["W"])

    def test_published_pattern_moves_every_copy_once(self):
        for ep in (16, 32, 64):
            pplx = moe_model.published_pattern("pplx-garden", ep, "combine")
            rows = sum(n["inter_bytes"] + n["intra_bytes"] for n in pplx) / moe_model.BF16_ROW
            # every copy but those for the rank itself
            self.assertAlmostEqual(rows, moe_model.TOKENS * moe_model.TOPK * (ep - 1) / ep)

    def test_nelder_mead_finds_a_known_minimum(self):
        x, fx = moe_model.nelder_mead(lambda v: (v[0] - 3) ** 2 + (v[1] + 1) ** 2 + 2,
                                      [0.0, 0.0], [1.0, 1.0])
        self.assertAlmostEqual(x[0], 3, places=4)
        self.assertAlmostEqual(x[1], -1, places=4)
        self.assertAlmostEqual(fx, 2, places=6)

    def test_the_fit_lowers_the_calibration_error(self):
        def error(p):
            return sum(math.log(r[5] / r[4]) ** 2 for r in moe_model.calibration_rows(p))
        before = error(self.params())
        after = error(moe_model.fit(moe_model.INPUTS))
        self.assertLess(after, before)


if __name__ == "__main__":
    unittest.main()
