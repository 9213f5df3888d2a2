"""Sweep gemm_allreduce over shapes on emulated worlds and plot fused vs unfused.

    PYTHONPATH=$PWD python3 experiments/examples/sweep.py --out /tmp/mkrt-sweep
    python experiments/examples/sweep.py --cpu --out /tmp/mkrt-sweep   # no GPU: the planner's
                                                                       # predictions instead

For each layout (default 1x2 and 2x2, all ranks on GPU 0) and each M in --m (N = M,
K = M/16 per rank, the shape family of the reference's sweep): check the fused op once
against a float32 reference (small shapes), then time fused, cuBLAS + all-reduce
(``op.unfused``) and the planner's choice, with CUDA events (median). Writes sweep.csv,
and sweep.png when matplotlib is installed (else it says so and keeps the CSV).

With --cpu the same table holds the planner's modelled times (its cost model, not a
measurement), each plan's schedule is checked, and the kernels are compiled.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout, when not installed

import numpy as np

COLUMNS = ("layout", "m", "n", "k_per_rank", "fused_us", "unfused_us", "auto_us", "auto_choice",
           "compute_ctas", "reduce_ctas", "rel_error", "source")


def cpu_rows(layouts, ms) -> list[dict]:
    from mkrt.kernels import gemm_allreduce as gar
    from mkrt.world import parse_layout
    rows = []
    for layout in layouts:
        nodes, per_node = parse_layout(layout)
        size = nodes * per_node
        for m in ms:
            # One GPU holds every rank: each gets 132 / size SMs; nodes talk through the
            # `ce` proxy, which leaves 4 SMs for its copies (mkrt.world.CE_COPY_SMS).
            ctas = (132 - (4 if nodes > 1 else 0)) // size
            p = gar.plan(m, m, m // 16, nodes=nodes, ranks_per_node=per_node, ctas=ctas,
                         ranks_per_gpu=size, sms_per_gpu=ctas * size)
            problems = p.check()
            if problems:
                raise SystemExit(f"sweep: plan {layout} {m}: {problems}")
            rows.append(dict(layout=layout, m=m, n=m, k_per_rank=m // 16,
                             fused_us=round(p.predicted_fused_us, 1),
                             unfused_us=round(p.predicted_unfused_us, 1),
                             auto_us=round(p.predicted_fused_us if p.fused
                                           else p.predicted_unfused_us, 1),
                             auto_choice="fused" if p.fused else "unfused",
                             compute_ctas=p.compute_ctas, reduce_ctas=p.reduce_ctas,
                             rel_error="", source="planner model"))
    from mkrt.kernels.registry import all_specs
    for _, spec in all_specs():
        if spec.uri.startswith("gemm_allreduce_bf16_kn_"):
            spec.build(check_spills=True)
            print(f"compiled {spec.uri}")
    return rows


def gpu_rows(layouts, ms, iters: int) -> list[dict]:
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import median_ms
    from mkrt.kernels import gemm_allreduce as gar
    from mkrt.kernels.gemm import to_float32
    rows = []
    for layout in layouts:
        world = mkrt.init(emulate=layout)
        for m in ms:
            n, k = m, m // 16
            rng = cupy.random.default_rng(m)
            a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
            b = [(rng.standard_normal((k, n), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
            fused = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=60000)
            auto = mkrt.GemmAllReduce(world, timeout_ms=60000)
            outs = fused(a, b)
            world.synchronize()
            error = ""
            if m <= 4096:     # the float32 reference costs more than the op at large sizes
                expected = gar.reference(a, b, dtype=cupy.float32)
                error = max(float(cupy.linalg.norm(to_float32(o) - expected) / cupy.linalg.norm(expected))
                            for o in outs)
                if error > 1e-2:
                    raise SystemExit(f"sweep: {layout} {m}: relative error {error:.2e}")
            fused_ms = median_ms(lambda: fused(a, b, out=outs), warmup=3, iters=iters)
            unfused_ms = median_ms(lambda: fused.unfused(a, b, out=outs), warmup=3, iters=iters)
            auto_ms = median_ms(lambda: auto(a, b, out=outs), warmup=3, iters=iters)
            world.synchronize()
            p, choice = fused.last_plan, auto.last_plan
            rows.append(dict(layout=world.layout, m=m, n=n, k_per_rank=k,
                             fused_us=round(fused_ms * 1e3, 1), unfused_us=round(unfused_ms * 1e3, 1),
                             auto_us=round(auto_ms * 1e3, 1),
                             auto_choice="fused" if choice.fused else "unfused",
                             compute_ctas=p.compute_ctas, reduce_ctas=p.reduce_ctas,
                             rel_error=error if error == "" else f"{error:.1e}",
                             source="measured, one GPU"))
            fused.close()
            auto.close()
        world.close()
    return rows


def write(rows: list[dict], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'layout':>6} {'M=N':>6} {'K/rank':>6} {'fused us':>10} {'unfused us':>11} "
          f"{'ratio':>6} {'auto':>8} {'split':>7} {'error':>8}")
    for r in rows:
        print(f"{r['layout']:>6} {r['m']:>6} {r['k_per_rank']:>6} {r['fused_us']:>10} "
              f"{r['unfused_us']:>11} {r['unfused_us'] / r['fused_us']:>6.2f} {r['auto_choice']:>8} "
              f"{r['compute_ctas']:>3}/{r['reduce_ctas']:<3} {r['rel_error'] or '-':>8}")
    with open(out / "sweep.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"csv: {out / 'sweep.csv'}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib); the CSV has "
              "every number")
        return
    figure, axis = plt.subplots(figsize=(6, 3.6))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        axis.plot([r["m"] for r in mine], [r["unfused_us"] / r["fused_us"] for r in mine], "o-",
                  label=f"{layout}")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xscale("log", base=2)
    sizes = sorted({r["m"] for r in rows})
    axis.set_xticks(sizes, [str(m) for m in sizes])
    axis.minorticks_off()
    axis.set_xlabel("M = N (K = M/16 per rank)")
    axis.set_ylabel("unfused time / fused time")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "sweep.png", dpi=110)
    print(f"plot: {out / 'sweep.png'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU: the planner's model, compile")
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x2"])
    parser.add_argument("--m", nargs="+", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="mkrt-sweep", help="folder for sweep.csv and sweep.png")
    args = parser.parse_args(argv)
    if args.cpu:
        rows = cpu_rows(args.layouts, args.m)
        title = "gemm_allreduce, planner model (no GPU)"
    else:
        rows = gpu_rows(args.layouts, args.m, args.iters)
        title = "gemm_allreduce on emulated worlds, one GPU"
    write(rows, Path(args.out), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
