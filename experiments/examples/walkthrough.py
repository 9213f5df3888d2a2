"""A first session with mkrt, cell by cell (paste the cells into IPython, or run the file).

    PYTHONPATH=$PWD python3 experiments/examples/walkthrough.py --out /tmp/mkrt-walkthrough
    python experiments/examples/walkthrough.py --cpu      # no GPU: plan and compile only

On a GPU: builds an emulated world of 1 node x 2 ranks on GPU 0, calls each op (allgather,
gemm, gemm_allreduce), checks it, times it with CUDA events, changes gemm_allreduce's role
split (reduce CTAs per rank) and plots time against the split (walkthrough_split.png, or
walkthrough_split.csv alone when matplotlib is missing).

With --cpu: what works without a GPU: the world's layout, the planners (role split, fused
or not, the schedule check) and compile-only builds of the kernels the cells use.
"""

# %% Setup ---------------------------------------------------------------------------------
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout, when not installed

import numpy as np

import mkrt
from mkrt.kernels import gemm, gemm_allreduce as gar

M, N, K = 8192, 8192, 512          # gemm_allreduce: C[M, N] = sum_r A_r[M, K] @ B_r[K, N]


def cpu_part() -> int:
    # %% Without a GPU: a world's layout, the planners, compile-only builds -----------------
    world = mkrt.init(emulate="1x2", gpus=0)          # ranks without a device
    print(world)
    p = gemm.plan(M, N, K, b_layout="kn", sms=132)
    print(f"mkrt.gemm {M}x{N}x{K}: {p.tiles} tiles of 128x256 on a grid of {p.grid} CTAs")
    for reduce_ctas in (None, 8, 16, 32):
        plan = gar.plan(M, N, K, nodes=1, ranks_per_node=2, ctas=66, ranks_per_gpu=2,
                        reduce_ctas=reduce_ctas)
        problems = plan.check()
        print(f"gemm_allreduce 1x2, reduce_ctas={reduce_ctas or 'default'}: "
              f"{plan.compute_ctas} compute + {plan.reduce_ctas} reduce CTAs per rank, "
              f"{'fused' if plan.fused else 'unfused'} ({plan.reason}); "
              f"schedule check: {'; '.join(problems) or 'every tile once, no wait cycle'}")
        if problems:
            return 1
    from mkrt.kernels.registry import all_specs
    wanted = ("allgather_", "gemm_bf16_kn_", "gemm_allreduce_bf16_kn_")
    for _, spec in all_specs():
        if spec.uri.startswith(wanted):
            build = spec.build(check_spills=True)
            registers = max(r.registers for r in build.resources.values())
            print(f"compiled {spec.uri} for sm_90a: {registers} registers, no spills "
                  f"({'cached' if build.cached else f'{build.seconds:.1f} s'})")
    world.close()
    print("walkthrough --cpu: ok (nothing was launched: no GPU needed)")
    return 0


def gpu_part(out_dir: Path) -> int:
    import cupy

    from mkrt.arrays import bfloat16
    from mkrt.bench import median_ms
    from mkrt.kernels.gemm import to_float32

    # %% A world: 1 node x 2 ranks, both on GPU 0 (each rank gets its stream and 66 SMs) --
    world = mkrt.init(emulate="1x2")
    print(world)
    rng = cupy.random.default_rng(0)

    # %% allgather: every rank gets every rank's array --------------------------------------
    xs = [cupy.full(1 << 20, float(r), cupy.float32) for r in range(world.size)]
    out = mkrt.allgather(xs)                          # one array per rank this process holds
    world.synchronize()                               # raises mkrt.CommTimeout if a wait gave up
    assert out[0].shape == (2, 1 << 20) and float(out[1][0, 0]) == 0.0 and float(out[1][1, 0]) == 1.0
    ms = median_ms(lambda: mkrt.allgather(xs, out=out), iters=20)
    print(f"allgather 4 MiB per rank: {ms * 1e3:.1f} us per call")

    # %% gemm: the engine alone, against cuBLAS -------------------------------------------
    a = rng.standard_normal((M, 4096), dtype=np.float32).astype(bfloat16)
    b = rng.standard_normal((4096, N), dtype=np.float32).astype(bfloat16)
    c = mkrt.gemm(a, b)
    error = float(cupy.linalg.norm(to_float32(c) - to_float32(a) @ to_float32(b))
                  / cupy.linalg.norm(to_float32(a) @ to_float32(b)))
    mkrt_ms = median_ms(lambda: mkrt.gemm(a, b, out=c), iters=20)
    cublas_ms = median_ms(lambda: cupy.matmul(a, b, out=c), iters=20)
    flops = 2.0 * M * N * 4096
    print(f"gemm {M}x{N}x4096: error {error:.1e}; mkrt {flops / mkrt_ms / 1e9:.0f} TFLOP/s, "
          f"cupy.matmul {flops / cublas_ms / 1e9:.0f} TFLOP/s")

    # %% gemm_allreduce: C = A_0 @ B_0 + A_1 @ B_1 on both ranks ----------------------------
    a_list = [rng.standard_normal((M, K), dtype=np.float32).astype(bfloat16) for _ in range(2)]
    b_list = [(rng.standard_normal((K, N), dtype=np.float32) / 8).astype(bfloat16) for _ in range(2)]
    expected = gar.reference(a_list, b_list, dtype=cupy.float32)
    op = mkrt.GemmAllReduce(world)                   # the planner picks split and path
    outs = op(a_list, b_list)
    world.synchronize()
    error = max(float(cupy.linalg.norm(to_float32(o) - expected) / cupy.linalg.norm(expected))
                for o in outs)
    fused_ms = median_ms(lambda: op(a_list, b_list, out=outs), iters=20)
    unfused_ms = median_ms(lambda: op.unfused(a_list, b_list, out=outs), iters=20)
    p = op.last_plan
    print(f"gemm_allreduce {M}x{N}x{K} per rank: error {error:.1e}; "
          f"{'fused' if p.fused else 'unfused'} ({p.reason}); {p.compute_ctas} compute + "
          f"{p.reduce_ctas} reduce CTAs; {fused_ms * 1e3:.0f} us vs cuBLAS + all-reduce "
          f"{unfused_ms * 1e3:.0f} us ({unfused_ms / fused_ms:.2f}x)")
    op.close()

    # %% Change the role split: reduce CTAs per rank (of 66) ------------------------------
    rows = []
    for reduce_ctas in (4, 8, 16, 24, 32, 40):
        op = mkrt.GemmAllReduce(world, fuse=True, reduce_ctas=reduce_ctas)
        op(a_list, b_list, out=outs)
        world.synchronize()
        ms = median_ms(lambda: op(a_list, b_list, out=outs), iters=10)
        rows.append((reduce_ctas, ms * 1e3))
        print(f"  reduce_ctas={reduce_ctas:>2}: {ms * 1e3:7.0f} us")
        op.close()
    best = min(rows, key=lambda r: r[1])
    print(f"best split here: {best[0]} reduce CTAs ({best[1]:.0f} us); the planner chose "
          f"{p.reduce_ctas}")

    # %% Plot time against the split ------------------------------------------------------
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "walkthrough_split.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([("reduce_ctas", "fused_us")] + rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib: wrote {out_dir / 'walkthrough_split.csv'} only")
    else:
        plt.figure(figsize=(5, 3.2))
        plt.plot([r[0] for r in rows], [r[1] for r in rows], "o-", label="fused")
        plt.axhline(unfused_ms * 1e3, color="gray", linestyle="--", label="cuBLAS + all-reduce")
        plt.xlabel("reduce CTAs per rank (of 66)")
        plt.ylabel("us per call")
        plt.title(f"gemm_allreduce 1x2 on one GPU, {M}x{N}x{K}")
        plt.legend()
        plt.tight_layout()
        plt.savefig(out_dir / "walkthrough_split.png", dpi=110)
        print(f"plot: {out_dir / 'walkthrough_split.png'}")
    world.close()
    print("walkthrough: ok")
    return 0 if error < 1e-2 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="plan and compile only (no GPU)")
    parser.add_argument("--out", default="mkrt-walkthrough", help="folder for the CSV and plot")
    args = parser.parse_args(argv)
    return cpu_part() if args.cpu else gpu_part(Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
