"""The tensor-parallel pair against its unfused baselines, in the same run.

GEMM+ReduceScatter (mkrt.GemmReduceScatter): fused vs cuBLAS + mkrt's reduce-scatter over
the same transports, the planner's pick (fuse=None) and fuse="measure" (both paths timed
on its first call of a size class, the faster kept; that call is not counted). Shapes: the reference's sweep
(K = M / 16 per rank, N = M) and Llama-3 70B / Qwen2.5-72B row-parallel projections
(attention output, MLP down) at the world's TP size, 1024 to 16384 tokens.

AllGather+GEMM (mkrt.AllGatherGemm, ``--ops allgather_gemm``): fused vs mkrt.allgather +
cuBLAS, and the pick. Shapes: the reference's sweep (M = K, N = M / 16 per rank) and the
same models' column-parallel projections (QKV, MLP gate+up).

Emulated worlds on one H200: ranks share its SMs and memory, so a ratio measures overlap
and protocol cost, not NVLink.

    PYTHONPATH=$PWD python3 experiments/tp_pair.py --layouts 1x2 2x2 \
        --out experiments/results/tp_pair.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (hidden, intermediate, heads x head_dim, kv heads x head_dim) of the models
MODELS = {"llama3_70b": (8192, 28672, 8192, 1024), "qwen25_72b": (8192, 29568, 8192, 1024)}


def shapes(world_size: int, nodes: int, quick: bool) -> list[tuple[int, int, int, str]]:
    """(m, n, k per rank, family) for GEMM+ReduceScatter on a world of `world_size`."""
    out = []
    for m in ([4096, 8192] if quick else [2048, 4096, 8192, 16384]):
        out.append((m, m, m // 16, "reference_sweep"))
    for name, (hidden, inter, attn, _) in MODELS.items():
        for tokens in ([4096] if quick else [1024, 4096, 16384]):
            out.append((tokens, hidden, attn // world_size, f"{name}_o_proj"))
            k = -(-inter // world_size)
            out.append((tokens, hidden, k + (-k) % 8, f"{name}_down_proj"))
    unit = 128 * nodes
    return [(m, n, k, f) for m, n, k, f in out if m % world_size == 0 and m % unit == 0]


def gather_shapes(world_size: int, quick: bool) -> list[tuple[int, int, int, str]]:
    """(m gathered rows, n per rank, k, family) for AllGather+GEMM on a world of `world_size`."""
    out = []
    for m in ([4096, 8192] if quick else [2048, 4096, 8192, 16384]):
        out.append((m, m // 16, m, "reference_sweep"))
    for name, (hidden, inter, attn, kv) in MODELS.items():
        for tokens in ([4096] if quick else [1024, 4096, 16384]):
            qkv = -(-(attn + 2 * kv) // world_size)
            out.append((tokens, qkv + (-qkv) % 8, hidden, f"{name}_qkv_proj"))
            up = -(-2 * inter // world_size)
            out.append((tokens, up + (-up) % 8, hidden, f"{name}_gate_up_proj"))
    return [(m, n, k, f) for m, n, k, f in out if m % world_size == 0]


# op -> (op class, its shapes on a world (size, nodes, quick), rows of A per rank, rows of
# the output per rank, the float64 reference of rank 0's output)
def _reducescatter_reference(a, b):
    from mkrt.kernels import gemm_reducescatter
    return gemm_reducescatter.reference(a, b, 0, b_layout="nk")


def _allgather_gemm_reference(a, b):
    from mkrt.kernels import allgather_gemm
    return allgather_gemm.reference(a, b[0], b_layout="nk")


OPS = {
    "gemm_reducescatter": ("GemmReduceScatter", shapes, lambda m, w: m, lambda m, w: m // w,
                           _reducescatter_reference),
    "allgather_gemm": ("AllGatherGemm", lambda size, nodes, quick: gather_shapes(size, quick),
                       lambda m, w: m // w, lambda m, w: m, _allgather_gemm_reference),
}


def run(args, op: str) -> None:
    """Fused vs unfused vs the planner's pick of `op`, interleaved in the same run."""
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from mkrt.kernels.gemm import to_float32
    from planner import time_paths
    class_name, shapes_of, a_rows, out_rows, reference = OPS[op]
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        op_class = getattr(mkrt, class_name)
        fused_op = op_class(world, fuse=True, b_layout="nk", timeout_ms=20000)
        auto_op = op_class(world, fuse="model", b_layout="nk", timeout_ms=20000)
        measure_op = op_class(world, fuse="measure", b_layout="nk", timeout_ms=20000)
        for m, n, k, family in shapes_of(world.size, world.nodes, args.quick):
            rng = cupy.random.default_rng(m + n + k)
            a = [rng.standard_normal((a_rows(m, world.size), k), dtype=np.float32).astype(bfloat16)
                 for _ in world.local]
            b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
            outs = {name: [cupy.empty((out_rows(m, world.size), n), bfloat16) for _ in world.local]
                    for name in ("fused", "unfused", "auto", "measured")}
            paths = {"fused": lambda: fused_op(a, b, out=outs["fused"]),
                     "unfused": lambda: fused_op.unfused(a, b, out=outs["unfused"]),
                     "auto": lambda: auto_op(a, b, out=outs["auto"]),
                     # fuse="measure": its first call times both paths (not counted here)
                     "measured": lambda: measure_op(a, b, out=outs["measured"])}
            times = time_paths(world, paths, args.rounds, args.batch)
            expected = reference(a, b)
            error = float(cupy.linalg.norm(to_float32(outs["fused"][0]).astype(cupy.float64) - expected)
                          / cupy.linalg.norm(expected))
            case = f"{layout}_{m}x{n}x{k}"
            row = record("tp_pair", case, f"{op}_fused_vs_unfused", times["fused"], times["unfused"],
                         "us", higher_is_better=False, op=op, layout=layout, family=family, m=m,
                         n=n, k=k, fused_us=times["fused"], unfused_us=times["unfused"],
                         auto_us=times["auto"], auto_fused=auto_op.last_plan.fused,
                         measured_us=times["measured"],
                         measured_fused=measure_op.last_plan.fused,
                         rel_error_rank0=error,
                         fused_tflops_all_ranks=2.0 * m * n * k * world.size / times["fused"] / 1e6,
                         network_bytes_per_node=fused_op.last_plan.traffic()["network_per_node"])
            print(f"{case:26s} {family:22s} fused {times['fused']:9.1f} unfused {times['unfused']:9.1f}"
                  f" auto {times['auto']:9.1f} ({'F' if auto_op.last_plan.fused else 'U'}) "
                  f"measured {times['measured']:9.1f} ({'F' if measure_op.last_plan.fused else 'U'}) "
                  f"unfused/fused {row['ratio']:.3f} err {error:.1e}", flush=True)
            append_jsonl(args.out, [row])
            del a, b, outs, paths
            cupy.get_default_memory_pool().free_all_blocks()
        for each in (fused_op, auto_op, measure_op):
            each.close()
        world.close()


def plot(rows: list[dict], path: str) -> None:
    """Per op and world (newest run of each), each shape's unfused time over the fused
    path's and over fuse="measure"'s: bars above 1 favour mkrt."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    panels = {}
    for r in rows:                      # rows in run order: the newest commit of a panel wins
        key = (r["op"], r["layout"])
        if key not in panels or panels[key][0]["commit"] != r["commit"]:
            panels[key] = []
        panels[key].append(r)
    keys = sorted(panels)
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        run = panels[key]
        x = range(len(run))
        ax.bar([i - 0.2 for i in x], [r["unfused_us"] / r["fused_us"] for r in run], 0.4, label="fused")
        ax.bar([i + 0.2 for i in x], [r["unfused_us"] / r["measured_us"] for r in run], 0.4,
               label='fuse="measure"')
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [f"{r['m']}x{r['n']}x{r['k']}" for r in run], rotation=30, fontsize=6)
        ax.set_ylabel("unfused / path")
        ax.set_title(f"{key[0]}, {key[1]} emulated on one GPU ({run[0]['commit']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x2"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few shapes per family")
    parser.add_argument("--ops", nargs="+", default=["gemm_reducescatter"],
                        choices=["gemm_reducescatter", "allgather_gemm"])
    parser.add_argument("--out", default="experiments/results/tp_pair.jsonl")
    parser.add_argument("--plot", default="", help="PNG of the rows in --out (after the run)")
    parser.add_argument("--plot-only", action="store_true",
                        help="no run: plot the rows already in --out (any machine with matplotlib)")
    args = parser.parse_args()
    if args.plot_only:
        import json
        plot([json.loads(line) for line in Path(args.out).read_text().splitlines()], args.plot)
        return
    for op in args.ops:
        run(args, op)
    if args.plot:
        import json
        plot([json.loads(line) for line in Path(args.out).read_text().splitlines()], args.plot)


if __name__ == "__main__":
    main()
