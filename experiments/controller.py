"""Static role splits of the fused kernels, swept: the ground truth the SM-partition
controller is judged against.

For each world and shape, every static split of a rank's CTAs between the compute and the
reduce role on a grid (``--step`` CTAs apart), timed interleaved in rounds in the same run
(experiments/planner.py's ``time_paths``: CUDA events around back-to-back calls, medians),
then: the best static split, and the default rule's split
(:func:`mkrt.controller.cost.default_reduce_ctas`) with its time relative to the best.
Rows go to ``experiments/results/controller.jsonl``: one per (shape, split) with metric
``split_us``, and one per shape with metric ``default_vs_best`` (ratio = best time /
default time, so 1.0 means the default rule found the best split).

    PYTHONPATH=$PWD python3 experiments/controller.py --layouts 1x2 2x2 --sets calibration \\
        --limit 10 --op gemm_allreduce
    python3 experiments/controller.py --cpu      # no GPU: the grid and the default picks only

The controller (``controller=True``: the split moves between launches on the GPU) runs
``--controller-warmup`` launches to settle, then is timed with the static splits; a row
per shape with metric ``controller_vs_best`` holds its time, the splits it ended with per
rank, and whether it froze.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def split_grid(ctas: int, step: int) -> list[int]:
    """Reduce-role CTAs to try: 1, then every `step`, up to all but one CTA."""
    grid = sorted({1, *range(step, ctas, step), ctas - 1})
    return [r for r in grid if 1 <= r < ctas]


def shapes_of(set_name: str, limit: int | None, start: int) -> list[tuple[int, int, int, str]]:
    from planner import SETS
    return SETS[set_name]()[start:limit]


def cpu_report(args) -> None:
    from mkrt.controller.cost import default_reduce_ctas
    from mkrt.world import CE_COPY_SMS, parse_layout
    for layout in args.layouts:
        nodes, per_node = parse_layout(layout)
        # an H200's 132 SMs shared by the emulated ranks (less the copies' SMs with nodes)
        ctas = (132 - (CE_COPY_SMS if nodes > 1 else 0)) // (nodes * per_node)
        for set_name in args.sets:
            for m, n, k, family in shapes_of(set_name, args.limit, args.start):
                grid = split_grid(ctas, args.step)
                default = default_reduce_ctas(k, ctas, nodes=nodes)
                print(f"{layout} {m}x{n}x{k:<6d} {family:24s} ctas {ctas:3d} default "
                      f"{default:3d} grid {grid}")


def run(args) -> None:
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from planner import time_paths
    op_class = {"gemm_allreduce": mkrt.GemmAllReduce,
                "gemm_reducescatter": mkrt.GemmReduceScatter}[args.op]
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        ctas = world.sm_count(world.local[0].rank)
        grid = split_grid(ctas, args.step)
        ops = {r: op_class(world, fuse=True, b_layout="nk", reduce_ctas=r, timeout_ms=20000)
               for r in grid}
        default_op = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000)
        controlled = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000, controller=True)
        for set_name in args.sets:
            for m, n, k, family in shapes_of(set_name, args.limit, args.start):
                if m % world.size or (args.op == "gemm_reducescatter" and world.nodes > 1
                                      and (m // world.nodes) % 128):
                    continue
                rng = cupy.random.default_rng(m + n + k)
                a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
                b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16)
                     for _ in world.local]
                rows_out = m if args.op == "gemm_allreduce" else m // world.size
                outs = [cupy.empty((rows_out, n), bfloat16) for _ in world.local]
                paths = {str(r): (lambda op=op: op(a, b, out=outs)) for r, op in ops.items()}
                paths["default"] = lambda: default_op(a, b, out=outs)
                # the controller learns over launches: let it settle before it is timed
                for _ in range(args.controller_warmup):
                    controlled(a, b, out=outs)
                world.synchronize()
                paths["controller"] = lambda: controlled(a, b, out=outs)
                times = time_paths(world, paths, args.rounds, args.batch)
                learned = [s for s in controlled.controller_state() if s["shape"] == (m, n, k)]
                best_split = min(grid, key=lambda r: times[str(r)])
                best = times[str(best_split)]
                default_split = default_op.last_plan.reduce_ctas
                case = f"{layout}_{m}x{n}x{k}"
                rows = [record("controller", f"{case}_r{r}", "split_us", times[str(r)], best, "us",
                               higher_is_better=False, op=args.op, layout=layout, m=m, n=n, k=k,
                               family=family, set=set_name, reduce_ctas=r, ctas=ctas)
                        for r in grid]
                rows.append(record("controller", case, "default_vs_best", times["default"], best,
                                   "us", higher_is_better=False, op=args.op, layout=layout, m=m,
                                   n=n, k=k, family=family, set=set_name, ctas=ctas,
                                   default_split=default_split, best_split=best_split,
                                   step=args.step))
                rows.append(record("controller", case, "controller_vs_best", times["controller"],
                                   best, "us", higher_is_better=False, op=args.op, layout=layout,
                                   m=m, n=n, k=k, family=family, set=set_name, ctas=ctas,
                                   best_split=best_split, step=args.step,
                                   learned_splits=[ctas - s["split"] for s in learned],
                                   frozen=[s["frozen"] for s in learned],
                                   launches=[s["calls"] for s in learned]))
                append_jsonl(args.out, rows)
                print(f"{case:26s} {family:22s} best r={best_split:3d} {best:9.1f} us, default "
                      f"r={default_split:3d} {times['default']:9.1f} us "
                      f"(best/default {best / times['default']:.3f}), controller "
                      f"r={[ctas - s['split'] for s in learned]} {times['controller']:9.1f} us "
                      f"(best/controller {best / times['controller']:.3f})", flush=True)
                a = b = outs = paths = None          # free this shape's memory
                cupy.get_default_memory_pool().free_all_blocks()
        world.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x2"])
    parser.add_argument("--sets", nargs="+", default=["calibration"],
                        choices=["calibration", "held_out"])
    parser.add_argument("--op", default="gemm_allreduce",
                        choices=["gemm_allreduce", "gemm_reducescatter"])
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--controller-warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="print the grid and default picks only")
    parser.add_argument("--out", default="experiments/results/controller.jsonl")
    args = parser.parse_args()
    if args.cpu:
        cpu_report(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
