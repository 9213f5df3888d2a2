"""Does the GEMM rule's tile width help the fused GEMM+AllReduce? 256 vs 192 vs 128, same run.

`mkrt.GemmAllReduce(block_n=None)` takes its compute tile's width from the GEMM engine's
rule (mkrt/kernels/gemm_rule.py, ``fused_tile_width``), evaluated on the compute CTAs of
the default role split. The rule was fitted on the plain GEMM alone, so the fused kernel
judges it on data it never saw: for each shape and emulated world, the fused kernel with
each width runs interleaved in rounds (planner.py's timing: CUDA events around
back-to-back calls, medians), and the row says how the rule's pick compares with the
fastest width (ratio = fastest / pick) and with the old fixed 256 (``vs_256``).

Shapes: the planner's sets (held-out first, then calibration) where the rule picks a
narrower tile than 256, then a few where it keeps 256 (controls).

    PYTHONPATH=$PWD python3 experiments/fused_tile.py --layouts 1x2 2x2 --deadline 400

Rows go to experiments/results/fused_tile.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

WIDTHS = (256, 192, 128)


def rule_pick(layout: str, m: int, n: int, k: int) -> int:
    """The width block_n=None plans for this shape on an emulated layout of one H200."""
    from mkrt.controller.cost import Ceilings
    from mkrt.kernels.gemm_allreduce_plan import plan
    nodes, per_node = (int(x) for x in layout.split("x"))
    ranks = nodes * per_node
    ctas = 132 // ranks
    p = plan(m, n, k, nodes=nodes, ranks_per_node=per_node, ctas=ctas, fuse=True,
             b_layout="nk", sms_per_gpu=132, ranks_per_gpu=ranks, block_n=None,
             ceilings=Ceilings(network_gbps=35.0))
    return p.block_n


def _ops(world) -> dict:
    """The fused op with each width (a bounded wait of 5 s, as the planner's runs)."""
    import mkrt
    return {w: mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=5000, block_n=w)
            for w in WIDTHS}


def shapes_for(layout: str, controls: int) -> list[tuple[int, int, int, str, str]]:
    import planner
    narrower, kept = [], []
    for set_name in ("held_out", "calibration"):
        for m, n, k, family in planner.SETS[set_name]():
            (narrower if rule_pick(layout, m, n, k) != 256 else kept).append(
                (m, n, k, family, set_name))
    return narrower + kept[:controls]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x2"])
    parser.add_argument("--controls", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds; stop after")
    parser.add_argument("--list", action="store_true", help="print the shapes, run nothing")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "fused_tile.jsonl"))
    args = parser.parse_args()
    if args.list:
        for layout in args.layouts:
            shapes = shapes_for(layout, args.controls)
            print(layout, len(shapes), [(m, n, k, rule_pick(layout, m, n, k)) for m, n, k, *_ in shapes])
        return 0

    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from mkrt.kernels.gemm import to_float32
    from planner import operands, time_paths
    start = time.time()
    # Each layout gets its share of the deadline, so every world has rows.
    share = args.deadline / len(args.layouts)
    for index, layout in enumerate(args.layouts):
        world = mkrt.init(emulate=layout)
        ops = _ops(world)
        for m, n, k, family, set_name in shapes_for(layout, args.controls):
            if time.time() - start > share * (index + 1):
                print(f"{layout}: stopped at the deadline", flush=True)
                break
            pick = rule_pick(layout, m, n, k)
            a, b = operands(world, m, n, k)
            outs = {w: [cupy.empty((m, n), bfloat16) for _ in world.local] for w in WIDTHS}
            paths = {w: (lambda w=w: ops[w](a, b, out=outs[w])) for w in WIDTHS}
            case = f"{layout}_{m}x{n}x{k}"
            try:
                times = time_paths(world, paths, args.rounds, args.batch)
            except mkrt.CommTimeout as error:
                print(f"{case} TIMEOUT {error}", flush=True)
                append_jsonl(args.out, [record("fused_tile", case, "timeout", 1.0, None, "count",
                                               layout=layout, m=m, n=n, k=k, error=str(error))])
                world.close()
                world = mkrt.init(emulate=layout)
                ops = _ops(world)
                continue
            # The widths sum the same products in the same order per element: equal outputs.
            base = to_float32(outs[256][0])
            same = all(bool(cupy.array_equal(to_float32(outs[w][0]), base)) for w in WIDTHS)
            best = min(times.values())
            row = record("fused_tile", case, "rule_pick_us", times[pick], best, "us",
                         higher_is_better=False, set=set_name, family=family, layout=layout,
                         m=m, n=n, k=k, pick=pick, times_us={str(w): times[w] for w in WIDTHS},
                         fastest=min(times, key=times.get), vs_256=times[256] / times[pick],
                         outputs_equal=same, rounds=args.rounds, batch=args.batch)
            print(f"{set_name:11s} {case:24s} " + " ".join(f"{w}:{times[w]:8.1f}" for w in WIDTHS)
                  + f"  pick {pick} best/pick {row['ratio']:.3f} 256/pick {row['vs_256']:.3f}"
                  + ("" if same else "  OUTPUTS DIFFER"), flush=True)
            append_jsonl(args.out, [row])
            del a, b, outs, paths
            cupy.get_default_memory_pool().free_all_blocks()
        for op in ops.values():
            op.close()
        world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
