"""The SM-partition controller against every static role split: the ground truth it is
judged by, and a picture of what it does.

For each world and shape: every static split of a rank's CTAs between the compute and the
reduce role on a grid (``--step`` CTAs apart; ``roles="static"``), the default rule's
split (:func:`mkrt.controller.cost.default_reduce_ctas`, static), the controller
(``roles="adaptive"``, the default: CTAs move between the queues during each launch and
the next launch starts from what it learned; ``--controller-warmup`` launches first), and
the controller started at the best static split (its overhead). All timed interleaved in
rounds in the same run (experiments/planner.py's ``time_paths``: CUDA events around
back-to-back calls, medians). Rows go to ``experiments/results/controller.jsonl``:

* ``split_us`` per (shape, split);
* ``default_vs_best``: ratio = best static time / default rule's time (1.0: the rule
  found the best split);
* ``controller_vs_best``: ratio = best static / controller (the issue's target: >= 1/1.03);
* ``controller_vs_default``: ratio = default / controller (> 1: the controller is faster);
* ``controller_overhead``: ratio = best static / the controller started at the best split;
* ``search_vs_best``: ratio = best static / ``roles="search"`` after ``--search-warmup``
  launches (the split found by measuring launch times).

    PYTHONPATH=$PWD python3 experiments/controller.py --layouts 1x2 2x2 --sets calibration \
        --limit 10 --step 4
    PYTHONPATH=$PWD python3 experiments/controller.py --trace --layouts 1x2 --shape 4096x4096x512
    python3 experiments/controller.py --cpu      # no GPU: the grid and the default picks only

``--trace``: one call of the controller with its role trace (every CTA's role changes, every
control step), written as JSON and drawn as a role timeline (CTAs down, time across,
coloured by role; the controller's target over time on top) to ``--plot``.
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
        ops = {r: op_class(world, fuse=True, b_layout="nk", reduce_ctas=r, timeout_ms=20000,
                           roles="static") for r in grid}
        default_op = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000, roles="static")
        controlled = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000)
        searching = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000, roles="search")
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
                for _ in range(args.search_warmup):      # the search settles in 20-40 launches
                    searching(a, b, out=outs)
                world.synchronize()
                paths["controller"] = lambda: controlled(a, b, out=outs)
                paths["search"] = lambda: searching(a, b, out=outs)
                times = time_paths(world, paths, args.rounds, args.batch)
                learned = [s for s in controlled.controller_state() if s["shape"] == (m, n, k)]
                best_split = min(grid, key=lambda r: times[str(r)])
                best = times[str(best_split)]
                # overhead: the controller started at the best split, timed against it
                at_best = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000,
                                   reduce_ctas=best_split)
                at_best(a, b, out=outs)
                overhead = time_paths(world, {"best": paths[str(best_split)],
                                              "at_best": lambda: at_best(a, b, out=outs)},
                                      args.rounds, args.batch)
                at_best.close()
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
                                   learned_splits=[s["learned"] for s in learned],
                                   switches=[s["last_switches"] for s in learned],
                                   steps=[s["last_steps"] for s in learned],
                                   launches=[s["launches"] for s in learned]))
                found = [s for s in searching.controller_state() if s["shape"] == (m, n, k)]
                rows.append(record("controller", case, "search_vs_best", times["search"], best,
                                   "us", higher_is_better=False, op=args.op, layout=layout, m=m,
                                   n=n, k=k, family=family, set=set_name, ctas=ctas,
                                   best_split=best_split, step=args.step,
                                   found_splits=[s["s_best"] for s in found],
                                   settled=[s["s_settled"] for s in found]))
                rows.append(record("controller", case, "controller_vs_default",
                                   times["controller"], times["default"], "us",
                                   higher_is_better=False, op=args.op, layout=layout, m=m, n=n,
                                   k=k, family=family, set=set_name, ctas=ctas,
                                   default_split=default_split))
                rows.append(record("controller", case, "controller_overhead",
                                   overhead["at_best"], overhead["best"], "us",
                                   higher_is_better=False, op=args.op, layout=layout, m=m, n=n,
                                   k=k, family=family, set=set_name, ctas=ctas,
                                   best_split=best_split))
                append_jsonl(args.out, rows)
                print(f"{case:26s} {family:22s} best r={best_split:3d} {best:9.1f} us, default "
                      f"r={default_split:3d} {times['default']:9.1f} us "
                      f"(best/default {best / times['default']:.3f}), controller "
                      f"r={[s['learned'] for s in learned]} {times['controller']:9.1f} us "
                      f"(best/controller {best / times['controller']:.3f}, default/controller "
                      f"{times['default'] / times['controller']:.3f}), search "
                      f"r={[s['s_best'] for s in found]} (best/search {best / times['search']:.3f}), "
                      f"overhead at best "
                      f"{overhead['best'] / overhead['at_best']:.3f}", flush=True)
                a = b = outs = paths = at_best = None          # free this shape's memory
                cupy.get_default_memory_pool().free_all_blocks()
        world.close()


def trace(args) -> None:
    """One traced call of the controller per layout: JSON and the role-timeline plot."""
    import json

    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    m, n, k = (int(x) for x in args.shape.split("x"))
    out = {}
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        op = mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=20000, trace=True,
                                reduce_ctas=args.trace_start)
        rng = cupy.random.default_rng(1)
        a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
        b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16)
             for _ in world.local]
        launches = []
        for call in range(args.trace_calls):
            op(a, b)
            launches.append(op.role_trace(clear=True))
        out[layout] = {"shape": [m, n, k], "launches": launches,
                       "state": op.controller_state()}
        op.close()
        world.close()
    with open(args.trace_out, "w") as f:
        json.dump(out, f)
    print(f"trace written to {args.trace_out}")
    if args.plot:
        plot_timeline(out, args.plot)


def plot_timeline(traces: dict, path: str) -> None:
    """Per layout, rank 0's first and last traced launch: a bar per CTA, coloured by role."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"compute": "#4C72B0", "comm": "#DD8452", "final": "#BBBBBB"}
    panels = [(layout, i) for layout in traces for i in (0, -1)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (layout, which) in zip(axes[:, 0], panels):
        launches = traces[layout]["launches"]
        rank0 = launches[which][0]
        end = max((t for events in rank0["ctas"] for t, _ in events), default=1)
        for cta, events in enumerate(rank0["ctas"]):
            for (t0, role), (t1, _) in zip(events, events[1:]):
                if role in colours:
                    ax.broken_barh([(t0 / 1e3, max(t1 - t0, 1) / 1e3)], (cta - 0.4, 0.8),
                                   color=colours[role], linewidth=0)
        steps = rank0["steps"]
        if steps:
            ctas = len(rank0["ctas"])
            ax.step([s["time_ns"] / 1e3 for s in steps], [ctas - s["target"] for s in steps],
                    where="post", color="black", linewidth=1, label="compute CTAs the controller aims at")
            ax.legend(loc="lower right", fontsize=7)
        m, n, k = traces[layout]["shape"]
        label = "first" if which == 0 else f"launch {len(launches)}"
        ax.set_title(f"{layout}, {m}x{n}x{k}, rank 0, {label}: compute (blue), reduce (orange), "
                     "final waits (grey)", fontsize=9)
        ax.set_xlabel("us since the first CTA began")
        ax.set_ylabel("CTA")
        ax.set_xlim(0, end / 1e3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


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
    parser.add_argument("--search-warmup", type=int, default=40,
                        help="launches of the roles='search' op before it is timed")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="print the grid and default picks only")
    parser.add_argument("--trace", action="store_true", help="trace the controller's roles")
    parser.add_argument("--shape", default="4096x4096x512", help="MxNxK of --trace")
    parser.add_argument("--trace-start", type=int, default=None,
                        help="reduce CTAs the traced op starts from (default: the rule's)")
    parser.add_argument("--trace-calls", type=int, default=8)
    parser.add_argument("--trace-out", default="experiments/results/controller_trace.json")
    parser.add_argument("--plot", default="experiments/results/controller_timeline.png")
    parser.add_argument("--out", default="experiments/results/controller.jsonl")
    args = parser.parse_args()
    if args.cpu:
        cpu_report(args)
    elif args.trace:
        trace(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
