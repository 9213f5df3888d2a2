"""mkrt.gemm against cuBLAS on one GPU, in the same run.

Measures the Hopper GEMM engine (TMA + wgmma, persistent, warp-specialised) on the
issue's suite, on the full chip and with the grid capped at 116 and 100 CTAs (the
compute role's share in fused kernels), against torch.matmul (cuBLASLt; the faster
baseline: mkrt/DESIGN.md, "Machine facts") and cupy.matmul. Every case is checked against a float32 result
first (relative Frobenius error), then timed with CUDA events: per shape, the baselines
and every grid cap take turns in --repeats rounds of --iterations launches after
warm-up (median per call; in turns, because timed one after the other the first timed
ran up to 17% faster: the GPU's clocks drift under sustained load).

Launch line (GPU machine, repository root):

    MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONPATH=$PWD python3 experiments/gemm.py \
        --out experiments/results/gemm.jsonl

Prints one line per case, ``shape | us | TFLOP/s | x cuBLAS``, then geometric means.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import subprocess
import sys

import numpy as np

#: the first suite (v1, v2 rows): seven large shapes
SUITE_V1 = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 16384, 1024), (8192, 8192, 512),
            (2048, 8192, 8192), (8192, 1024, 8192), (8000, 7936, 4096)]


def suite() -> list[tuple[int, int, int]]:
    """The 30-shape suite: the tile sweep's FIT and HELD_OUT shapes (experiments/gemm_tune.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gemm_tune
    return list(gemm_tune.FIT) + list(gemm_tune.HELD_OUT)


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    parser.add_argument("--b-layout", default="nk", choices=("nk", "kn", "both"))
    parser.add_argument("--sms", default="full,116,100",
                        help="comma list of grid caps; 'full' = every SM")
    parser.add_argument("--shapes", default="suite",
                        help="'suite' (30 shapes), 'v1' (the first 7) or MxNxK,MxNxK,...")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--group-m", type=int, default=8)
    parser.add_argument("--block-m", type=int, default=None, help="default: the tile rule's")
    parser.add_argument("--block-n", type=int, default=None, help="default: the tile rule's")
    parser.add_argument("--stages", type=int, default=None, help="default: as many as fit")
    parser.add_argument("--out", default="", help="append JSON lines here")
    parser.add_argument("--tag", default="", help="version label stored with the results")
    parser.add_argument("--commit", default=os.environ.get("MKRT_BENCH_COMMIT", ""),
                        help="git commit (default: $MKRT_BENCH_COMMIT, else git rev-parse)")
    parser.add_argument("--epilogue", default="auto", choices=("auto", "tma", "direct"))
    return parser.parse_args()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def main():
    args = parse()
    import cupy
    from mkrt.arrays import bfloat16
    from mkrt.bench import interleaved_ms
    from mkrt.kernels import gemm as G
    try:
        import torch
    except ImportError:
        torch = None

    dtype = bfloat16 if args.dtype == "bf16" else np.dtype(np.float16)
    shapes = suite() if args.shapes == "suite" else SUITE_V1 if args.shapes == "v1" else [
        tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    from mkrt.kernels.gemm_rule import choose_tile
    layouts = ("nk", "kn") if args.b_layout == "both" else (args.b_layout,)
    sm_caps = [None if s == "full" else int(s) for s in args.sms.split(",")]
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    full_sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    command = "python3 " + " ".join(sys.argv)
    date = datetime.date.today().isoformat()
    commit = args.commit or git_commit()
    rows, ratios = [], {}

    print(f"# {gpu}, {full_sms} SMs, {args.dtype}, torch={'yes' if torch else 'no'}")
    print(f"{'case':<34} | {'us':>8} | {'TFLOP/s':>7} | {'cuBLASLt':>8} | {'x cuBLAS':>8} | "
          f"{'cupy':>7} | err")
    for layout in layouts:
        for (m, n, k) in shapes:
            b_shape = (k, n) if layout == "kn" else (n, k)
            if torch is not None:   # torch makes bf16 natively; CuPy views it through DLPack
                torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
                a = cupy.from_dlpack(torch.randn((m, k), dtype=torch_dtype, device="cuda"))
                b = cupy.from_dlpack(torch.randn(b_shape, dtype=torch_dtype, device="cuda"))
            else:
                rng = cupy.random.default_rng(m + n + k)
                a = G.from_float32(rng.standard_normal((m, k), dtype=cupy.float32), dtype)
                b = G.from_float32(rng.standard_normal(b_shape, dtype=cupy.float32), dtype)
            out = cupy.empty((m, n), dtype=dtype)
            flops = 2.0 * m * n * k

            # baselines, full chip, and every grid cap, checked, then timed in turns
            calls = {"cupy": (lambda: cupy.matmul(a, b)) if layout == "kn" else (lambda: cupy.matmul(a, b.T))}
            if torch is not None:
                ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
                tb = tb if layout == "kn" else tb.t()
                calls["torch"] = lambda: torch.matmul(ta, tb)
            baseline_name = "torch.matmul" if torch is not None else "cupy.matmul"
            checked = {}
            for cap in sm_caps:
                options = dict(b_layout=layout, sms=cap, group_m=args.group_m,
                               block_m=args.block_m, block_n=args.block_n, stages=args.stages,
                               epilogue=args.epilogue)
                p = G.call_plan(a, b, out, **options)      # the tile the call runs, recorded
                why = choose_tile(m, n, k, sms=cap or full_sms, dtype=args.dtype,
                                  b_layout=layout)[1]
                G.poison(out)
                G.gemm(a, b, out, **options)
                ref = G.reference(a, b, b_layout=layout)
                got = G.to_float32(out)
                error = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
                del ref, got
                if not math.isfinite(error) or error > 1e-2:
                    print(f"FAILED correctness {layout} {m}x{n}x{k} sms={cap}: error {error}")
                    ratios.setdefault(cap, []).append(float("nan"))
                    continue
                calls[cap] = functools.partial(G.gemm, a, b, out, **options)
                checked[cap] = (p, why, error)
            ms_of = interleaved_ms(calls, iterations=args.iterations, rounds=args.repeats,
                                   warmup=args.warmup)
            cupy_ms = ms_of.pop("cupy")
            base_ms = ms_of.pop("torch", cupy_ms)
            for cap, (p, why, error) in checked.items():
                ms = ms_of[cap]
                tile = (p.spec.block_m, p.spec.block_n, p.splits, p.spec.cluster, p.split_tail)
                tflops = flops / ms / 1e9
                ratio = base_ms / ms
                ratios.setdefault(cap, []).append(ratio)
                label = f"{layout} {m}x{n}x{k} sms={cap or full_sms}"
                print(f"{label:<34} | {ms * 1e3:8.1f} | {tflops:7.1f} | "
                      f"{flops / base_ms / 1e9:8.1f} | {ratio:8.3f} | "
                      f"{flops / cupy_ms / 1e9:7.1f} | {error:.1e}", flush=True)
                rows.append(dict(experiment="gemm", case=f"{args.dtype} {label}", metric="tflops",
                                 value=round(tflops, 2), baseline=round(flops / base_ms / 1e9, 2),
                                 baseline_name=baseline_name,
                                 cupy_tflops=round(flops / cupy_ms / 1e9, 2),
                                 ratio=round(ratio, 4), unit="TFLOP/s", us=round(ms * 1e3, 2),
                                 error=error, sms=cap or full_sms, gpu=gpu, date=date,
                                 commit=commit, tag=args.tag, command=command,
                                 timing="interleaved rounds",
                                 config=dict(block_m=tile[0], block_n=tile[1], split_k=tile[2], stream_k=p.stream_k,
                                             cluster=tile[3], split_tail=tile[4],
                                             chosen_by=why if args.block_m is None and
                                             args.block_n is None else "given",
                                             stages=args.stages, group_m=args.group_m,
                                             epilogue=args.epilogue)))
            calls = ta = tb = None
            a = b = out = None
            cupy.get_default_memory_pool().free_all_blocks()

    # Linear in the SMs given: capped time against (full SMs / cap) x full-chip time, on
    # shapes of at least 4 waves of the full-chip tile (the scaling target: <= 1.05).
    by_shape: dict = {}
    for row in rows:
        by_shape.setdefault(row["case"].rsplit(" sms=", 1)[0], {})[row["sms"]] = row
    for label, caps in by_shape.items():
        full = caps.get(full_sms)
        if full is None:
            continue
        m, n, k = (int(x) for x in label.split()[-1].split("x"))
        tiles = -(-m // full["config"]["block_m"]) * -(-n // full["config"]["block_n"])
        for cap, row in caps.items():
            if cap == full_sms:
                continue
            scaling = row["us"] / (full["us"] * full_sms / cap)
            row["scaling"] = round(scaling, 4)
            row["waves_full"] = round(tiles / full_sms, 2)
            if tiles >= 4 * full_sms:
                print(f"scaling {label} sms={cap}: {scaling:.3f} of linear ({tiles / full_sms:.1f} waves)")
    for cap, values in ratios.items():
        good = [v for v in values if math.isfinite(v)]
        geo = math.exp(sum(map(math.log, good)) / len(good)) if good else float("nan")
        print(f"geomean x cuBLAS, sms={cap or full_sms}: {geo:.3f} over {len(good)} cases"
              f"{'' if len(good) == len(values) else f' ({len(values) - len(good)} FAILED)'}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
