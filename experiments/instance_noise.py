"""How much do two ops of the same path differ? GEMM+AllReduce fused in two op instances,
and unfused in two, interleaved round by round on the same operands (same run).

The planner's held-out runs compare a fused-only op, an unfused path and the picking ops,
each a separate op instance with its own buffers and controller board. Where
``fuse="measure"`` missed the 3% target, its fused calls ran 7-32% slower than the
fused-only op's on the same shape. This measures that spread directly: per shape, the
time of instance B over instance A for each path (1.0: no instance effect). Shapes: those
of experiments/results/planner.jsonl where the measured pick missed 3% (``--from-misses``),
or given on the command line.

A third op with ``fuse="measure"`` runs beside them (``measured``): once it has settled,
its calls run the same path as one of the fixed ops, so its time over that op's says
whether measuring leaves the kept path slower (on 2x2, 7 of the planner's 8 misses ran
the kept path 1-13% slower than the op fixed to it, where two fixed ops agree within 3%).
``--roles static`` gives every op a fixed split (no controller) to tell whether the
controller's state carries the difference.

    PYTHONPATH=$PWD python3 experiments/instance_noise.py --from-misses \
        --out experiments/results/instance_noise.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))


def misses(path: Path, below: float = 0.97) -> list[tuple[str, int, int, int]]:
    """(layout, m, n, k) of the planner rows whose measured pick was below `below` of the
    faster path, newest row per (layout, shape)."""
    seen = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        ratio = row.get("measured_vs_best")
        if ratio is None:
            continue
        seen[(row["layout"], row["m"], row["n"], row["k"])] = ratio
    return [key for key, ratio in seen.items() if ratio < below]


def kept_path(op, m: int, n: int, k: int, dtype) -> str:
    """The path a settled fuse="measure" op runs for the shape: "fused" or "unfused" (its
    measured choice for the shape's size class)."""
    from mkrt.controller.fusion import size_class
    chosen = op.measured.choice(size_class(m, n, k, np.dtype(dtype)))
    if chosen is None:
        raise RuntimeError(f"the measuring op has not measured {m}x{n}x{k}")
    return "fused" if chosen else "unfused"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-misses", action="store_true")
    parser.add_argument("--shapes", nargs="*", default=[], help="layout:MxNxK, e.g. 1x2:512x8192x2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--roles", choices=("adaptive", "static"), default="adaptive")
    parser.add_argument("--out", default=str(ROOT / "experiments/results/instance_noise.jsonl"))
    args = parser.parse_args()
    shapes = [(s.split(":")[0], *(int(v) for v in s.split(":")[1].split("x"))) for s in args.shapes]
    if args.from_misses:
        shapes += misses(ROOT / "experiments/results/planner.jsonl")

    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from planner import operands, time_paths
    for layout in dict.fromkeys(s[0] for s in shapes):
        world = mkrt.init(emulate=layout)
        ops = {name: mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=5000,
                                        roles=args.roles)
               for name in ("a", "b")}
        ops["measure"] = mkrt.GemmAllReduce(world, fuse="measure", b_layout="nk", timeout_ms=5000,
                                            roles=args.roles)
        for _, m, n, k in [s for s in shapes if s[0] == layout]:
            a, b = operands(world, m, n, k)
            outs = [cupy.empty((m, n), bfloat16) for _ in world.local]
            paths = {"fused_a": lambda: ops["a"](a, b, out=outs),
                     "fused_b": lambda: ops["b"](a, b, out=outs),
                     "unfused_a": lambda: ops["a"].unfused(a, b, out=outs),
                     "unfused_b": lambda: ops["b"].unfused(a, b, out=outs),
                     "measured": lambda: ops["measure"](a, b, out=outs)}
            ops["measure"](a, b, out=outs)          # times both paths and settles
            world.synchronize()
            kept = kept_path(ops["measure"], m, n, k, bfloat16)
            times = time_paths(world, paths, args.rounds, args.batch)
            rows = [record("instance_noise", f"{layout}_{m}x{n}x{k}_{path}", "b_over_a",
                           times[f"{path}_b"], times[f"{path}_a"], "us", higher_is_better=False,
                           layout=layout, m=m, n=n, k=k, path=path, roles=args.roles,
                           a_us=times[f"{path}_a"], b_us=times[f"{path}_b"])
                    for path in ("fused", "unfused")]
            rows.append(record("instance_noise", f"{layout}_{m}x{n}x{k}_measured", "measured_over_fixed",
                               times["measured"], times[f"{kept}_a"], "us", higher_is_better=False,
                               layout=layout, m=m, n=n, k=k, path=kept, roles=args.roles,
                               measured_us=times["measured"], fixed_us=times[f"{kept}_a"]))
            append_jsonl(args.out, rows)
            print(f"{layout} {m}x{n}x{k}: " + " ".join(f"{p} {t:.1f}" for p, t in times.items()),
                  flush=True)
        for op in ops.values():
            op.close()
        world.close()


if __name__ == "__main__":
    main()
