"""What lets a fused gemm_allreduce on emulated 2x2 time out: host calls that wait for the
device while the fused kernels wait for the proxy (mkrt/DESIGN.md, "Runtime hazards").

Runs shapes that timed out in the planner experiment, one world per mode, each shape's
paths (fused, unfused = cuBLAS + mkrt's all-reduce, planner's pick) warmed up and timed as
experiments/planner.py does, with the warm-up:
  unsynced  fused, fused, unfused, unfused, auto, auto back to back (the planner's order
            before f209c40: a path's first cuBLAS call is issued while fused calls run)
  synced    each path's two warm-up calls, then world.synchronize()
  fused     the fused path alone
A watchdog dumps every thread's Python stack 2.5 s into a shape (the bound is 5 s): the
stack says which host call was in progress while the kernels waited.

    PYTHONPATH=$PWD python3 experiments/proxy_stall.py --modes unsynced synced fused \
        --out experiments/results/proxy_stall.jsonl
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [(16384, 4096, 1024), (16384, 8192, 2048), (896, 8704, 9664), (8320, 3840, 3648),
          (2304, 7936, 4160), (1792, 7424, 9920), (7168, 3584, 12544), (2944, 12544, 4352)]


def run_mode(mode: str, out_path: str) -> int:
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from planner import proxy_state, time_paths

    def new_ops(world):
        return (mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=5000),
                mkrt.GemmAllReduce(world, b_layout="nk", timeout_ms=5000))

    world = mkrt.init(emulate="2x2")
    fused_op, auto_op = new_ops(world)
    dump = tempfile.TemporaryFile("w+")
    failures = []
    for m, n, k in SHAPES:
        rng = cupy.random.default_rng(m + n + k)
        a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
        b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
        outs = [[cupy.empty((m, n), bfloat16) for _ in world.local] for _ in range(3)]
        world.synchronize()
        paths = {"fused": lambda: fused_op(a, b, out=outs[0])}
        if mode != "fused":
            paths["unfused"] = lambda: fused_op.unfused(a, b, out=outs[1])
            paths["auto"] = lambda: auto_op(a, b, out=outs[2])
        dump.seek(0)
        dump.truncate()
        faulthandler.dump_traceback_later(2.5, repeat=False, file=dump)
        start = time.perf_counter()
        error = None
        try:
            if mode == "unsynced":
                for call in paths.values():
                    call()
                    call()
            time_paths(world, paths, 3, 3)
        except mkrt.CommTimeout as timeout:
            error = timeout
        faulthandler.cancel_dump_traceback_later()
        dump.seek(0)
        stacks = dump.read()
        host_call = next((line.strip() for line in stacks.splitlines()
                          if "site-packages" in line), "") if stacks else ""
        case = f"2x2_{m}x{n}x{k}_{mode}"
        print(f"{case:32s} {'TIMEOUT' if error else 'ok':8s} {time.perf_counter() - start:6.2f} s"
              f" {host_call}", flush=True)
        extra = {}
        if error is not None:
            failures.append(case)
            extra = {"error": str(error), "records": [str(r) for r in error.records],
                     "proxy": proxy_state(world), "stacks": stacks[-4000:]}
        append_jsonl(out_path, [record("proxy_stall", case, "timeout", float(error is not None),
                                       None, "count", mode=mode, m=m, n=n, k=k,
                                       host_call_after_2_5s=host_call, **extra)])
        del a, b, outs, paths
        if error is not None:
            world.close()
            world = mkrt.init(emulate="2x2")
            fused_op, auto_op = new_ops(world)
        cupy.get_default_memory_pool().free_all_blocks()
    world.close()
    print(f"mode {mode}: {len(failures)} of {len(SHAPES)} shapes timed out", flush=True)
    return len(failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=["unsynced", "synced", "fused"],
                        choices=["unsynced", "synced", "fused"])
    parser.add_argument("--out", default="experiments/results/proxy_stall.jsonl")
    args = parser.parse_args()
    for mode in args.modes:
        run_mode(mode, args.out)


if __name__ == "__main__":
    main()
