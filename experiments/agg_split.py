"""AllGather+GEMM: how many CTAs the gathering role needs, by shape (a sweep, same run).

The fused kernel splits each rank's CTAs between the gathering role (A's blocks into every
rank's buffer) and the GEMM; a tile row of a peer's block starts only once the whole
block is in. This times the fused op at several static splits (``comm_ctas``), with the
on-GPU search (``roles="search"``) and the unfused path (mkrt.allgather + cuBLAS), paths
interleaved round by round, and records per split the time against the unfused path.
From the rows: the gathering role's bytes per second per CTA (block bytes moved per rank
over the fused time at the smallest splits) and the split a default rule should pick.

Emulated worlds on one H200: ranks share its SMs and memory; copies between them are
copies inside one HBM, not NVLink.

    PYTHONPATH=$PWD python3 experiments/agg_split.py --out experiments/results/agg_split.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (m gathered rows, n per rank, k): the reference's sweep (M = K, N = M / 16) and
#: Llama-3 70B QKV / MLP gate+up at TP 2 (N per rank for 1x2; halved again on 2x2)
SHAPES = [(8192, 512, 8192), (16384, 1024, 16384), (4096, 5120, 8192), (16384, 5120, 8192),
          (4096, 28672, 8192)]
SPLITS = [2, 4, 8, 12, 16, 24]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x2"])
    parser.add_argument("--splits", nargs="+", type=int, default=SPLITS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", default="experiments/results/agg_split.jsonl")
    args = parser.parse_args()

    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from planner import time_paths
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        W = world.size
        ops = {f"c{c}": mkrt.AllGatherGemm(world, fuse=True, comm_ctas=c, b_layout="nk",
                                           timeout_ms=20000) for c in args.splits}
        ops["search"] = mkrt.AllGatherGemm(world, fuse=True, roles="search", b_layout="nk",
                                           timeout_ms=20000)
        ops["default"] = mkrt.AllGatherGemm(world, fuse=True, b_layout="nk", timeout_ms=20000)
        for m, n, k in SHAPES:
            n = n * 2 // W if n > 1024 else n           # column-parallel: N per rank shrinks with TP
            n += (-n) % 8
            rng = cupy.random.default_rng(m + n + k)
            a = [rng.standard_normal((m // W, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
            b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
            outs = {name: [cupy.empty((m, n), bfloat16) for _ in world.local]
                    for name in [*ops, "unfused"]}
            paths = {name: (lambda op=op, name=name: op(a, b, out=outs[name])) for name, op in ops.items()}
            paths["unfused"] = lambda: ops["default"].unfused(a, b, out=outs["unfused"])
            try:
                times = time_paths(world, paths, args.rounds, args.batch)
            except mkrt.CommTimeout as error:
                print(f"{layout} {m}x{n}x{k}: CommTimeout {error}", flush=True)
                break
            block_bytes = (m // W) * k * 2
            rows = []
            for name, op in ops.items():
                split = op.last_plan.comm_ctas if name != "search" else None
                rows.append(record("agg_split", f"{layout}_{m}x{n}x{k}_{name}", "fused_us", times[name],
                                   times["unfused"], "us", higher_is_better=False, layout=layout,
                                   m=m, n=n, k=k, path=name, comm_ctas=split, ctas=op.last_plan.ctas,
                                   block_bytes=block_bytes, unfused_us=times["unfused"]))
            append_jsonl(args.out, rows)
            line = " ".join(f"{name} {times[name]:.0f}" for name in paths)
            best = min(ops, key=lambda name: times[name])
            print(f"{layout} {m}x{n}x{k}: {line}; best {best} ({times['unfused'] / times[best]:.3f}x "
                  f"unfused)", flush=True)
            a = b = outs = paths = None          # free before the next shape's operands
            cupy.get_default_memory_pool().free_all_blocks()
        for op in ops.values():
            op.close()
        world.close()


if __name__ == "__main__":
    main()
