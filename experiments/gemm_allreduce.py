"""GEMM+AllReduce: fused vs unfused (cuBLAS then all-reduce) in the same run.

Launch, one GPU (emulated worlds share it: this measures protocol overhead and overlap
on shared SMs, not NVLink):
    PYTHONPATH=$PWD python3 experiments/gemm_allreduce.py --layouts 1x2 1x4 2x2
Under mpiexec on a multi-GPU host, unchanged (one rank per GPU, mkrt.init() real world):
    mpiexec -n 8 python3 -m mpi4py experiments/gemm_allreduce.py --mpi
From IPython: ``from experiments.gemm_allreduce import run_layout; run_layout("1x2", [(4096, 4096, 256)])``

Cases: the reference's sweep M = N in {2048 .. 32768} with K = M/16 per rank, and LLM
row-parallel shapes (tokens x hidden 8192, K = 28672/8 per rank). Per case: correctness
of both paths against a float32 reference first, then CUDA-event medians of
  fused     mkrt.GemmAllReduce(fuse=True)
  unfused   cuBLAS (cupy.matmul) per rank, then mkrt's all-reduce (not overlapped)
  auto      the op's own choice (the planner may fall back to unfused)
ratio = unfused time / fused time. Also the world=1 overhead: GemmAllReduce on 1x1 vs
mkrt.gemm (target <= 3%). JSON lines to --out, a plot next to it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SWEEP = [(s, s, s // 16) for s in (2048, 4096, 8192, 16384, 32768)]
LLM = [(4096, 8192, 3584), (8192, 8192, 3584), (16384, 8192, 3584)]


def make_operands(world, m, n, k, seed):
    import cupy
    import numpy as np
    from mkrt.arrays import bfloat16
    a_list, b_list = [], []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            rng = cupy.random.default_rng(seed + info.rank)
            a_list.append(rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16))
            b_list.append((rng.standard_normal((k, n), dtype=np.float32) / 8).astype(bfloat16))
    return a_list, b_list


def check(world, op, a_list, b_list, fused: bool) -> float:
    """Worst relative error of any rank against float32, on a small-enough problem."""
    import cupy
    from mkrt.kernels import gemm_allreduce as gar
    from mkrt.kernels.gemm import poison, to_float32
    outs = [poison(cupy.empty((a_list[0].shape[0], b_list[0].shape[1]), a_list[0].dtype))
            for _ in world.local]
    if fused:
        op(a_list, b_list, out=outs)
    else:
        op.unfused(a_list, b_list, out=outs)
    world.synchronize()
    expected = gar.reference(a_list, b_list, dtype=cupy.float32)
    worst = 0.0
    for out in outs:
        diff = to_float32(out) - expected
        worst = max(worst, float(cupy.linalg.norm(diff) / cupy.linalg.norm(expected)))
    return worst


def _err(value):
    return "-" if value is None else f"{value:.1e}"


def run_layout(layout, cases, *, iters=20, mpi=False, out_path=None, block_n=256):
    import cupy

    import mkrt
    from mkrt.bench import append_jsonl, interleaved_ms, record
    from mkrt.kernels import gemm_allreduce as gar
    world = mkrt.init() if mpi else mkrt.init(emulate=layout)
    layout = world.layout
    lead = world.local[0].rank == 0
    records = []
    if lead:
        print(f"{'layout':>6} {'case':>18} {'fused us':>10} {'unfused us':>11} {'ratio':>6} "
              f"{'auto':>7} {'split':>7} {'err f/u':>16}")
    for m, n, k in cases:
        op = gar.GemmAllReduce(world, fuse=True, timeout_ms=60000, block_n=block_n)
        auto = gar.GemmAllReduce(world, timeout_ms=60000, block_n=block_n)
        a_list, b_list = make_operands(world, m, n, k, seed=m + k)
        check_ok = m * n <= 8192 * 8192
        # Larger cases are not checked (the float32 reference would dominate the run).
        err_f = check(world, op, a_list, b_list, True) if check_ok else None
        err_u = check(world, op, a_list, b_list, False) if check_ok else None
        outs = [cupy.empty((m, n), a_list[0].dtype) for _ in world.local]
        world.barrier()
        # rotating rounds (interleaved_ms; every rank the same order): clocks drift under
        # load, and until 6885d2f-era commits the fused path was always timed first
        ms_of = interleaved_ms({"fused": lambda: op(a_list, b_list, out=outs),
                                "unfused": lambda: op.unfused(a_list, b_list, out=outs),
                                "auto": lambda: auto(a_list, b_list, out=outs)},
                               iterations=max(1, iters // 5), rounds=5, warmup=3)
        fused_ms, unfused_ms, auto_ms = ms_of["fused"], ms_of["unfused"], ms_of["auto"]
        world.synchronize()
        p = op.last_plan
        choice = "fused" if auto.last_plan.fused else "unfused"
        case = f"{m}x{n}x{k}"
        if lead:
            print(f"{layout:>6} {case:>18} {fused_ms * 1e3:>10.1f} {unfused_ms * 1e3:>11.1f} "
                  f"{unfused_ms / fused_ms:>6.2f} {choice:>7} {p.compute_ctas:>3}/{p.reduce_ctas:<3} "
                  f"{_err(err_f)}/{_err(err_u)}")
        tflops = 2.0 * m * n * k * world.size / (fused_ms * 1e-3) / 1e12
        records.append(record("gemm_allreduce", f"{layout}_{case}", "time", fused_ms * 1e3,
                              unfused_ms * 1e3, "us", higher_is_better=False, layout=layout,
                              m=m, n=n, k_per_rank=k, auto_us=auto_ms * 1e3, auto_choice=choice,
                              compute_ctas=p.compute_ctas, reduce_ctas=p.reduce_ctas,
                              tflops_all_ranks=tflops, rel_error_fused=err_f,
                              rel_error_unfused=err_u, block_n=block_n,
                              baseline_name="cupy.matmul (cuBLAS) per rank + mkrt all-reduce",
                              timing="interleaved_ms medians"))
        op.close()
        auto.close()
        del a_list, b_list, outs
    if lead and out_path:
        append_jsonl(out_path, records)
    world.close()
    return records


def world_one_overhead(cases, *, iters=20, out_path=None):
    """GemmAllReduce on a 1x1 world against mkrt.gemm: the cost of the op's machinery."""
    import cupy

    import mkrt
    from mkrt.bench import append_jsonl, median_ms, record
    from mkrt.kernels import gemm_allreduce as gar
    world = mkrt.init(emulate="1x1")
    op = gar.GemmAllReduce(world, timeout_ms=60000)
    records = []
    for m, n, k in cases:
        a_list, b_list = make_operands(world, m, n, k, seed=1)
        out = cupy.empty((m, n), a_list[0].dtype)
        # Interleave the two, after a long warm-up, so clock ramps favour neither.
        median_ms(lambda: mkrt.gemm(a_list[0], b_list[0], out=out), warmup=50, iters=5)
        op_runs, gemm_runs = [], []
        for _ in range(5):
            op_runs.append(median_ms(lambda: op(a_list[0], b_list[0], out=out), iters=iters))
            gemm_runs.append(median_ms(lambda: mkrt.gemm(a_list[0], b_list[0], out=out), iters=iters))
        op_ms, gemm_ms = sorted(op_runs)[2], sorted(gemm_runs)[2]
        overhead = op_ms / gemm_ms - 1
        print(f"world=1 {m}x{n}x{k}: op {op_ms * 1e3:.1f} us, mkrt.gemm {gemm_ms * 1e3:.1f} us, "
              f"overhead {overhead * 100:+.1f}%")
        records.append(record("gemm_allreduce", f"1x1_{m}x{n}x{k}", "world1_time", op_ms * 1e3,
                              gemm_ms * 1e3, "us", higher_is_better=False, overhead=overhead,
                              baseline_name="mkrt.gemm"))
    world.close()
    if out_path:
        append_jsonl(out_path, records)
    return records


def plot(records, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    rows = [r for r in records if r["metric"] == "time"]
    layouts = sorted({r["layout"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(layouts))
    cases = list(dict.fromkeys(f"{r['m']}x{r['n']}x{r['k_per_rank']}" for r in rows))
    for i, layout in enumerate(layouts):
        ratios = {f"{r['m']}x{r['n']}x{r['k_per_rank']}": r["ratio"] for r in rows if r["layout"] == layout}
        ax.bar([c + i * width for c in range(len(cases))], [ratios.get(c, 0) for c in cases],
               width, label=layout)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + width * (len(layouts) - 1) / 2 for c in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("unfused time / fused time")
    ax.set_title("GEMM+AllReduce, emulated worlds on one H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "1x4", "2x2"])
    parser.add_argument("--cases", choices=["sweep", "llm", "all", "small"], default="all")
    parser.add_argument("--max-m", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--block-n", type=int, default=256, choices=(128, 192, 256),
                        help="the fused kernel's compute tile width")
    parser.add_argument("--mpi", action="store_true", help="real world under mpiexec")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "gemm_allreduce.jsonl"))
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    args = parser.parse_args()
    cases = {"sweep": SWEEP, "llm": LLM, "all": SWEEP + LLM,
             "small": [(2048, 2048, 128), (4096, 4096, 256)]}[args.cases]
    cases = [c for c in cases if c[0] <= args.max_m]
    records = []
    if args.mpi:
        records += run_layout(None, cases, iters=args.iters, mpi=True, out_path=args.out,
                              block_n=args.block_n)
    else:
        records += world_one_overhead([(8192, 8192, 512), (4096, 4096, 4096)], iters=args.iters,
                                      out_path=args.out)
        for layout in args.layouts:
            records += run_layout(layout, cases, iters=args.iters, out_path=args.out,
                                  block_n=args.block_n)
    if records:
        ratios = [r["ratio"] for r in records if r["metric"] == "time" and r["ratio"]]
        if ratios:
            print(f"geomean unfused/fused: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
        plot(records, args.plot or str(Path(args.out).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
