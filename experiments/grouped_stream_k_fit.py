"""Set the grouped GEMM's stream-K rule (grouped_gemm.choose_stream_k) on the suite's rows of
experiments/grouped_gemm.py --stream-k-out and judge it on the held-out rows.

Every case was timed in turns with the rule's tile and with 128x256 tiles, each whole and
with stream-K at several part limits. A candidate rule is (tile policy, part limit, least
K): stream-K with that part limit where K >= the least K, else whole tiles. Its regret on a
case is its pick's time over the fastest variant's, same run. The candidate with the lowest
geomean regret on set "fit" (ties: the worst regret, then the simpler rule) is printed with
every case of both sets.

    PYTHONPATH=$PWD python3 experiments/grouped_stream_k_fit.py [--rows experiments/results/grouped_gemm_stream_k.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import defaultdict


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def cases_of(rows):
    """case -> {"set", "k", "rule_tile", times: {(tile, parts): ms}} (parts 0: whole tiles)."""
    cases = defaultdict(lambda: {"times": {}})
    for r in rows:
        key = r["case"].rsplit("_bm", 1)[0]
        case = cases[key]
        case.update(set=r["set"], k=r["k"], rule_tile=tuple(r["rule_tile"]), torch_ms=r["value"] * r["stream_k_ratio_vs_torch"])
        tile = (r["block_m"], r["block_n"])
        case["times"][(tile, r["max_parts"])] = r["value"]
        case["times"][(tile, 0)] = r["baseline"]
    return dict(cases)


def pick(case, policy, parts, least_k):
    tile = case["rule_tile"] if policy == "rule tile" else (128, 256)
    use = parts if case["k"] >= least_k else 0
    return case["times"].get((tile, use))


def regrets(cases, which, rule):
    out = []
    for name, case in cases.items():
        if case["set"] != which:
            continue
        chosen = pick(case, *rule)
        if chosen is not None:
            out.append((name, chosen / min(case["times"].values()), case["torch_ms"] / chosen))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="experiments/results/grouped_gemm_stream_k.jsonl")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.rows) if line.strip()]
    commit = args.commit or rows[-1]["commit"]
    cases = cases_of([r for r in rows if r["commit"] == commit])
    parts = sorted({p for c in cases.values() for (_, p) in c["times"] if p})
    ks = sorted({0} | {c["k"] for c in cases.values()})
    candidates = [("rule tile", 0, 0)] + [
        (policy, p, k) for policy, p, k in itertools.product(("rule tile", "128x256"), parts, ks)]
    scored = []
    for rule in candidates:
        fit = [x[1] for x in regrets(cases, "fit", rule)]
        if fit:
            scored.append((round(geomean(fit), 4), round(max(fit), 4), rule[1] == 0, rule))
    scored.sort(key=lambda s: (s[0], s[1], -s[2]))
    print(f"commit {commit}: {len(cases)} cases; best candidates on the fit set (geomean, worst regret):")
    for s in scored[:8]:
        print(f"  {s[3]}: {s[0]:.4f}, {s[1]:.3f}")
    best = scored[0][3]
    for which in ("fit", "held_out"):
        for rule in (best, ("rule tile", 0, 0)):
            r = regrets(cases, which, rule)
            print(f"\n{which}, rule {rule}: regret geomean {geomean([x[1] for x in r]):.3f}, worst "
                  f"{max(x[1] for x in r):.3f}; x torch geomean {geomean([x[2] for x in r]):.3f}, "
                  f"lowest {min(x[2] for x in r):.3f}")
            for name, regret, vs_torch in r:
                print(f"  {name}: regret {regret:.3f}, x torch {vs_torch:.3f}")


if __name__ == "__main__":
    main()
