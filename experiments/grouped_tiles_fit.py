"""Fit the grouped GEMM's tile rule (mkrt.kernels.grouped_gemm.choose_tile) on the suite's
rows of experiments/grouped_gemm.py --sweep-tiles and judge it on the held-out rows.

The rule's one unknown per tile shape is its efficiency against a 128x256 tile (work per
unit time). This script searches them on a grid for the lowest geomean regret (the chosen
tile's time over the fastest tile's, same run) on set "fit" and prints every case of both
sets with the rule's choice, the committed efficiencies' choice and the old rule's
(64 rows below 128 rows per group, else 128; always 256 columns).

    PYTHONPATH=$PWD python3 experiments/grouped_tiles_fit.py [--rows experiments/results/grouped_gemm_tiles.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.kernels import grouped_gemm as GG  # noqa: E402
from mkrt.report import geomean, grouped_tile_cases, tile_regrets  # noqa: E402


def load(path: str, commit: str | None) -> dict:
    rows = [json.loads(line) for line in open(path)]
    return grouped_tile_cases([r for r in rows if not commit or r["commit"] == commit])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="experiments/results/grouped_gemm_tiles.jsonl")
    parser.add_argument("--commit", default=None, help="only rows of this commit")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    cases = load(args.rows, args.commit)
    grid = [x / 40 for x in range(16, 41)]
    scored = []
    for a, b, c in itertools.product(grid, grid, grid):
        efficiency = {(128, 256): 1.0, (64, 256): a, (128, 128): b, (64, 128): c}
        fit = tile_regrets(cases, "fit", lambda r, g, n: GG.choose_tile(r, g, n, args.sms, efficiency))
        scored.append((round(geomean([x[2] for x in fit]), 4), max(x[2] for x in fit), a, b, c))
    best = min(s[:2] for s in scored)
    tied = [s for s in scored if s[:2] == best]
    print(f"fit set: lowest geomean regret {best[0]:.4f} (worst {best[1]:.3f}), reached with")
    for name, index in (("64x256", 2), ("128x128", 3), ("64x128", 4)):
        values = sorted({s[index] for s in tied})
        print(f"  {name} efficiency in [{values[0]}, {values[-1]}]")
    print(f"committed: {GG.TILE_EFFICIENCY}")

    def old_rule(rows, groups, n):
        return (GG.choose_block_m(rows, groups), 256)

    def committed(rows, groups, n):
        return GG.choose_tile(rows, groups, n, args.sms)
    for which in ("fit", "held_out"):
        new, old = tile_regrets(cases, which, committed), tile_regrets(cases, which, old_rule)
        print(f"\n{which}: rule's tile / fastest: geomean {geomean([x[2] for x in new]):.3f}, worst "
              f"{max(x[2] for x in new):.3f}; old rule geomean {geomean([x[2] for x in old]):.3f}, "
              f"worst {max(x[2] for x in old):.3f}")
        for (key, tile, regret), (_, old_tile, old_regret) in zip(new, old):
            print(f"  {key[1]:18s} {key[2]:6d} rows {key[3]:8s} rule {tile[0]}x{tile[1]} {regret:.3f}  "
                  f"old {old_tile[0]}x{old_tile[1]} {old_regret:.3f}")


if __name__ == "__main__":
    main()
